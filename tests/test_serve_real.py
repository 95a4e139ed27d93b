"""`eagle3 serve` as users start it, on the real packaged SmolLM2: the openai client's greedy answer
equals what `eagle3 generate` prints for the same request (both with the default draft setting)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from serve_fixtures import free_socket

pytestmark = pytest.mark.real

PROMPT = "What is a llama? Answer in one sentence."
MAX_TOKENS = 16


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", *args]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"eagle3 serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("eagle3 serve did not become healthy")


def test_eagle3_serve_equals_eagle3_generate(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    generated = subprocess.run(cli("generate", PROMPT, "--max-new-tokens", str(MAX_TOKENS)),
                               capture_output=True, text=True, timeout=600, env=env, check=True)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cli("serve", "--port", str(port), "--api-key", "k", "--max-model-len",
                                "512", "--log-level", "warning"),
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)
        resp = client.chat.completions.create(model="smollm2", max_tokens=MAX_TOKENS,
                                              temperature=0,
                                              messages=[{"role": "user", "content": PROMPT}])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert resp.choices[0].message.content + "\n" == generated.stdout
    assert resp.usage.completion_tokens == MAX_TOKENS
    assert proc.returncode == 0

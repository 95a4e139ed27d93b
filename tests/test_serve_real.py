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


@pytest.mark.slow
@pytest.mark.lossless
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


@pytest.mark.skipif(not os.environ.get("EAGLE3_SERVE_LOAD_REAL"),
                    reason="set EAGLE3_SERVE_LOAD_REAL=1 to measure the real-model load figures")
def test_real_load_32_concurrent_streams():
    """32 concurrent streaming clients on SmolLM2 (default draft setting), 8 tokens each: all
    complete, each equal to its serial run; prints requests/s and p50/p95 latency."""
    import asyncio
    import statistics

    from eagle3.api import load_engine
    from eagle3.serve import create_app
    from serve_fixtures import RunningServer
    from test_serve import KEY, MODEL, load_run

    engine = load_engine(max_model_len=512)
    prompts = [f"Give me one fact about the number {i}." for i in range(32)]
    with RunningServer(create_app(engine, model_name=MODEL, api_key=KEY)) as server:
        serial, serial_wall = asyncio.run(load_run(server.url, prompts, False, max_tokens=8))
        results, wall = asyncio.run(load_run(server.url, prompts, True, max_tokens=8))
    assert [t for t, _ in results] == [t for t, _ in serial]
    lat = sorted(s for _, s in results)
    print(f"\nreal load ({'speculative' if engine.speculative else 'plain'}): 32 concurrent "
          f"streaming clients x 8 tokens: {32 / wall:.2f} req/s, p50 {statistics.median(lat):.2f} s, "
          f"p95 {lat[int(0.95 * 31)]:.2f} s; serial {32 / serial_wall:.2f} req/s")

"""The chat page at / in headless Chromium (Debian `chromium`, driven over the DevTools protocol):
it loads, streams a reply equal to Engine.generate, highlights exactly the drafted runs the server
sent, shows a live tau, and raises no JavaScript errors. The screenshot is kept in tests/artifacts/."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="/usr/bin/chromium is absent: install Debian chromium (apt-get install -y chromium) "
           "to run the page test")
websocket = pytest.importorskip(
    "websocket", reason="websocket-client (in the test extra) drives Chromium over CDP")

from eagle3.generate import Engine, SamplingParams  # noqa: E402
from eagle3.serve import create_app  # noqa: E402
from serve_fixtures import GroupedEngine, RunningServer, tiny_target, tokenizer  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--no-default-browser-check", "--mute-audio",
         "--remote-debugging-port=0", "--window-size=1100,760"]


class CDP:
    """Minimal Chrome DevTools protocol client: call(method, **params); events are kept."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") != self.next_id:
                self.events.append(msg)
                continue
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return msg.get("result", {})

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait(self, expression: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"page never satisfied: {expression}")


@contextmanager
def chromium(tmp_path: Path):
    profile = tmp_path / "chromium-profile"
    log = open(tmp_path / "chromium.log", "wb")
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start; see {tmp_path / 'chromium.log'}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        cdp = CDP(pages[0]["webSocketDebuggerUrl"])
        yield cdp
        cdp.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def drafted_text_from_api(url: str, body: dict) -> str:
    """The drafted runs the server sends for this (greedy, deterministic) request."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=30) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: {") and '"eagle3"' in ln]
    return "".join(t for e in events for t, d in e["eagle3"]["segments"] if d)


ASSISTANT_TEXT = """(() => {
  const el = document.querySelector('.msg.assistant');
  let s = '';
  for (const n of el.childNodes) {
    if (n.nodeType === 3 || (n.classList && n.classList.contains('draft'))) s += n.textContent;
  }
  return s;
})()"""


def test_page_streams_and_highlights_draft_tokens(tmp_path):
    target, tok = tiny_target(), tokenizer()
    prompt, max_tokens = "Hello there, page!", 40
    ref = Engine(target, tok, max_model_len=256).generate(
        messages=[{"role": "user", "content": prompt}],
        params=SamplingParams(temperature=0.0, max_new_tokens=max_tokens))
    app = create_app(GroupedEngine(target, tok, max_model_len=256), model_name="tiny")
    with RunningServer(app) as server, chromium(tmp_path) as cdp:
        cdp.call("Runtime.enable")
        cdp.call("Page.enable")
        cdp.call("Page.navigate", url=server.url + "/")
        cdp.wait("document.readyState === 'complete' && "
                 "document.getElementById('model').textContent === 'tiny'")
        cdp.eval(f"""document.getElementById('prompt').value = {json.dumps(prompt)};
                     document.getElementById('max_tokens').value = '{max_tokens}';
                     document.getElementById('temperature').value = '0';
                     document.getElementById('form').requestSubmit(); true""")
        cdp.wait("document.body.dataset.replies === '1'")
        reply = cdp.eval(ASSISTANT_TEXT)
        drafted = cdp.eval("[...document.querySelectorAll('.msg.assistant .draft')]"
                           ".map(e => e.textContent).join('')")
        tau = cdp.eval("document.getElementById('tau').textContent")
        stats = cdp.eval("document.querySelector('.msg.assistant .stats').textContent")
        shot = cdp.call("Page.captureScreenshot", format="png")["data"]
        errors = [e for e in cdp.events if e.get("method") == "Runtime.exceptionThrown"]
        expect_drafted = drafted_text_from_api(server.url, {
            "model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0})
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")
    path = ARTIFACTS / "serve_page.png"
    path.write_bytes(base64.b64decode(shot))
    print(f"\nscreenshot: {path}")
    assert not errors, errors
    assert reply == ref.text
    assert drafted == expect_drafted and 0 < len(drafted) < len(reply)
    assert float(tau) > 1.0 and stats.startswith("tau ")

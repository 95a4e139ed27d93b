"""The server end to end on loopback: the real `openai` client against uvicorn, bad input, metrics,
load, disconnects, a full queue, health. Tiny random target + the real SmolLM2 tokenizer; the engine
is GroupedEngine (plain tokens reported in speculative-looking groups), so outputs must equal the
plain engine's while the server sees drafted tokens."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from eagle3.generate import Engine, SamplingParams
from eagle3.serve import create_app
from serve_fixtures import CountingTokenizer, GroupedEngine, RunningServer, tiny_target, tokenizer, wait_for

KEY = "sk-test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 256


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def reference(target):
    """A second engine on the same weights: what `eagle3 generate` gives (plain decoding)."""
    return Engine(target, tokenizer(), max_model_len=CTX)


@pytest.fixture(scope="module")
def server(target):
    app = create_app(GroupedEngine(target, tokenizer(), max_model_len=CTX), model_name=MODEL,
                     api_key=KEY)
    with RunningServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def metrics(url: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------------------- openai client
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_equals_engine_generate(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ref = reference.generate(messages=messages, params=greedy(24))
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0)
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (ref.prompt_tokens, 24)
    stats = resp.model_extra["eagle3"]
    assert stats["draft_tokens_accepted"] > 0 and stats["tau"] > 1.0
    assert stats["tokens"] == 24


def test_chat_stream_equals_engine_generate(client, reference):
    messages = [{"role": "user", "content": "Tell me about owls."}]
    ref = reference.generate(messages=messages, params=greedy(30))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices
    live = [c.model_extra["eagle3"] for c in chunks if c.choices and "eagle3" in c.model_extra]
    for c, extra in zip([c for c in chunks if c.choices and "eagle3" in c.model_extra], live):
        assert "".join(t for t, _ in extra["segments"]) == c.choices[0].delta.content
    assert any(d for extra in live for _, d in extra["segments"])        # drafted runs present
    assert any(not d for extra in live for _, d in extra["segments"])
    assert live[-1]["stats"]["tokens"] == 30


def test_completions_equal_engine_generate(client, reference):
    prompt = "The quick brown fox"
    ref = reference.generate(prompt=prompt, chat=False, params=greedy(20))
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.choices[0].text == ref.text and resp.usage.prompt_tokens == ref.prompt_tokens
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text


def test_completions_token_id_prompt_and_stop(client, reference):
    ids = tokenizer().encode("Once upon a time", add_special_tokens=False)
    full = reference.generate(prompt_ids=ids, params=greedy(30)).text
    stop = full.split()[3]                       # a word from the middle of the greedy output
    ref = reference.generate(prompt_ids=ids, params=greedy(30, stop=(stop,)))
    assert ref.finish_reason == "stop" and stop not in ref.text
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "stop"


def test_seeded_sampling_equals_engine(client, reference):
    messages = [{"role": "user", "content": "Pick a word."}]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7, max_new_tokens=16)
    ref = reference.generate(messages=messages, params=params)
    texts = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0.9, top_p=0.95, seed=7,
                                            extra_body={"top_k": 40}).choices[0].message.content
             for _ in range(2)]
    assert texts == [ref.text, ref.text]


def test_tiny_temperature_is_greedy(client, reference):
    """T = 1e-300 overflowed `logits / T` (500, or an error event mid-stream): it decodes greedily."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ref = reference.generate(messages=messages, params=greedy(12))
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=1e-300)
    assert resp.choices[0].message.content == ref.text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=1e-300, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# ---------------------------------------------------------------------------- bad input
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG_PROMPT = "word " * 400          # ~400 tokens > the 256-token context

BAD = [  # (name, method, path, body (dict -> JSON, bytes -> raw), headers, status)
    ("malformed json", "POST", "/v1/chat/completions", b'{"messages": [', AUTH, 400),
    ("malformed json completions", "POST", "/v1/completions", b"prompt=hi", AUTH, 400),
    ("body is a list", "POST", "/v1/chat/completions", b"[1, 2]", AUTH, 400),
    ("messages wrong type", "POST", "/v1/chat/completions", {**GOOD, "messages": "hi"}, AUTH, 400),
    ("max_tokens wrong type", "POST", "/v1/chat/completions", {**GOOD, "max_tokens": "8"}, AUTH, 400),
    ("temperature wrong type", "POST", "/v1/chat/completions", {**GOOD, "temperature": "hot"},
     AUTH, 400),
    ("stream wrong type", "POST", "/v1/chat/completions", {**GOOD, "stream": "yes"}, AUTH, 400),
    ("stop wrong type", "POST", "/v1/completions", {"prompt": "a", "stop": 5}, AUTH, 400),
    ("negative max_tokens", "POST", "/v1/chat/completions", {**GOOD, "max_tokens": -5}, AUTH, 400),
    ("zero max_tokens", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, AUTH, 400),
    ("huge max_tokens", "POST", "/v1/chat/completions", {**GOOD, "max_tokens": 10**12}, AUTH, 400),
    ("prompt longer than context", "POST", "/v1/completions",
     {"prompt": LONG_PROMPT, "max_tokens": 1}, AUTH, 400),
    ("chat longer than context", "POST", "/v1/chat/completions",
     {**GOOD, "messages": [{"role": "user", "content": LONG_PROMPT}]}, AUTH, 400),
    ("unknown model", "POST", "/v1/chat/completions", {**GOOD, "model": "gpt-9"}, AUTH, 404),
    ("model as a file path", "POST", "/v1/completions",
     {"model": "/etc/passwd", "prompt": "a"}, AUTH, 404),
    ("empty messages", "POST", "/v1/chat/completions", {**GOOD, "messages": []}, AUTH, 400),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, AUTH, 400),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, AUTH, 400),
    ("unknown role", "POST", "/v1/chat/completions",
     {**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, AUTH, 400),
    ("image content part", "POST", "/v1/chat/completions",
     {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     AUTH, 400),
    ("unsupported field tools", "POST", "/v1/chat/completions", {**GOOD, "tools": []}, AUTH, 400),
    ("unsupported field suffix", "POST", "/v1/completions", {"prompt": "a", "suffix": "b"}, AUTH, 400),
    ("n=2", "POST", "/v1/chat/completions", {**GOOD, "n": 2}, AUTH, 400),
    ("logprobs", "POST", "/v1/completions", {"prompt": "a", "logprobs": 5}, AUTH, 400),
    ("top_p out of range", "POST", "/v1/chat/completions", {**GOOD, "top_p": 1.5}, AUTH, 400),
    ("negative temperature", "POST", "/v1/chat/completions", {**GOOD, "temperature": -1}, AUTH, 400),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 10**9]}, AUTH, 400),
    ("batched prompts", "POST", "/v1/completions", {"prompt": ["a", "b"]}, AUTH, 400),
    ("missing api key", "POST", "/v1/chat/completions", GOOD, {}, 401),
    ("wrong api key", "POST", "/v1/chat/completions", GOOD, {"Authorization": "Bearer nope"}, 401),
    ("basic auth instead of bearer", "GET", "/v1/models", None, {"Authorization": f"Basic {KEY}"},
     401),
    ("unknown endpoint", "POST", "/v1/embeddings", {"input": "a"}, AUTH, 404),
    ("path traversal", "GET", "/static/../../etc/passwd", None, {}, 404),
    ("wrong method", "GET", "/v1/chat/completions", None, AUTH, 405),
    ("body too large", "POST", "/v1/completions", b"x" * (5 << 20), AUTH, 413),
    ("json sent as text/plain", "POST", "/v1/chat/completions", json.dumps(GOOD).encode(),
     {**AUTH, "Content-Type": "text/plain"}, 415),
    ("form body", "POST", "/v1/completions", b"prompt=hi",
     {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("no content type", "POST", "/v1/completions", b'{"prompt": "a"}', {**AUTH, "Content-Type": ""},
     415),
    ("json in latin-1", "POST", "/v1/completions", b'{"prompt": "a"}',
     {**AUTH, "Content-Type": "application/json; charset=latin-1"}, 415),
]


def test_bad_input_gets_openai_errors_and_server_keeps_serving(server, client):
    assert len(BAD) >= 20
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, method, path, body, headers, status in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            if isinstance(body, bytes):
                headers = {"Content-Type": "application/json", **headers}
            r = http.request(method, path, headers=headers, **({} if body is None else kw))
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert isinstance(err["message"], str) and len(err["message"]) > 5, name
            if status == 401:
                assert r.headers["www-authenticate"] == "Bearer"
    resp = client.chat.completions.create(model=MODEL, messages=GOOD["messages"], max_tokens=3,
                                          temperature=0)
    assert resp.choices[0].finish_reason == "length"


def test_errors_name_the_field(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={**GOOD, "frequency_penalty": 1.0})
    assert r.json()["error"]["param"] == "frequency_penalty"
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={**GOOD, "max_tokens": 300})
    assert r.json()["error"]["param"] == "max_tokens" and "256" in r.json()["error"]["message"]


def test_only_json_bodies_are_served(server):
    """text/plain is a CORS "simple" request: without this check any web page could POST to the
    server cross-origin without a preflight."""
    body = json.dumps({**GOOD, "max_tokens": 1}).encode()
    for ctype, status in [("text/plain", 415), ("text/plain; charset=utf-8", 415),
                          ("application/json; charset=utf-8", 200),
                          ('Application/JSON;charset="UTF-8"', 200)]:
        r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                       headers={**AUTH, "Content-Type": ctype})
        assert r.status_code == status, (ctype, r.text[:200])
        if status == 415:
            assert r.json()["error"]["code"] == "unsupported_media_type"
            assert "application/json" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- metrics, health
def test_metrics_counters_move(server, client):
    before = metrics(server.url)
    messages = [{"role": "user", "content": "Count to three."}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Rain", max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={**GOOD, "n": 5}, timeout=30)
    after = metrics(server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    s1 = r1.model_extra["eagle3"]
    s2 = [c for c in chunks if c.choices and c.choices[0].finish_reason][0].model_extra["eagle3"]["stats"]
    usage2 = chunks[-1].usage
    assert delta("eagle3:requests_total", endpoint="chat", status="200") == 1
    assert delta("eagle3:requests_total", endpoint="completions", status="200") == 1
    assert delta("eagle3:requests_total", endpoint="chat", status="400") == 1
    assert delta("eagle3:prompt_tokens_total") == r1.usage.prompt_tokens + usage2.prompt_tokens
    assert delta("eagle3:generation_tokens_total") == 12 + 9
    assert delta("eagle3:e2e_request_latency_seconds_count") == 2
    assert delta("eagle3:time_to_first_token_seconds_count") == 2
    assert delta("eagle3:request_success_total", finish_reason="length") == 2
    assert delta("eagle3:spec_decode_num_drafts_total") == s1["decode_steps"] + s2["decode_steps"]
    assert delta("eagle3:spec_decode_num_draft_tokens_total") == (
        s1["draft_tokens_proposed"] + s2["draft_tokens_proposed"])
    assert delta("eagle3:spec_decode_num_accepted_tokens_total") == (
        s1["draft_tokens_accepted"] + s2["draft_tokens_accepted"]) > 0
    for k in (1, 2):
        expect = sum(round(s["acceptance_per_position"][k - 1] * s["decode_steps"]) for s in (s1, s2))
        assert delta("eagle3:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) == expect
    assert delta("eagle3:spec_decode_acceptance_length_sum") == sum(      # accepted + 1 per step
        s["decode_steps"] + s["draft_tokens_accepted"] for s in (s1, s2))
    assert after[("eagle3:num_requests_waiting", ())] == 0
    assert after[("eagle3:num_requests_running", ())] == 0


def test_health_reports_degraded_and_warns(target, caplog):
    """The engine's AcceptanceMonitor over a draft whose proposals are all rejected."""
    from eagle3.speculative.monitor import AcceptanceMonitor
    engine = GroupedEngine(target, tokenizer(), max_model_len=CTX)
    engine.monitor = AcceptanceMonitor(window=8)
    chat = {**GOOD, "max_tokens": 12, "temperature": 0}
    with TestClient(create_app(engine, model_name=MODEL)) as http:
        assert http.get("/health").json()["status"] == "ok"
        engine.never_accept = True
        with caplog.at_level(logging.WARNING, logger="eagle3.serve"):
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert any("not paying off" in rec.message for rec in caplog.records
                   if rec.name == "eagle3.serve")
        body = http.get("/health").json()
        assert body["status"] == "degraded" and "layer ids" in body["reason"]
        assert body["acceptance"]["accepted_tokens"] == 0
        assert "eagle3:spec_decode_degraded 1.0" in http.get("/metrics").text
        engine.never_accept = False
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.get("/health").json()["status"] == "ok"


def test_metrics_and_stats_count_suffix_accepts_and_steps_by_arm(target):
    """Accepted tokens by source (suffix-only nodes) and decode steps by the adaptive choice, in
    /metrics and in the response's stats, from the same steps."""
    engine = GroupedEngine(target, tokenizer(), max_model_len=CTX)
    engine.arms = ("tree4x5n8", "suffix", "tree4x5n8", "plain")   # labels in turn, as a policy's

    def scrape(http) -> dict[tuple, float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples}

    with TestClient(create_app(engine, model_name=MODEL)) as http:
        before = scrape(http)
        r = http.post("/v1/chat/completions", json={**GOOD, "max_tokens": 12, "temperature": 0})
        after = scrape(http)
    stats = r.json()["eagle3"]

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert set(stats["arms"]) == set(engine.arms) and sum(stats["arms"].values()) == stats["decode_steps"]
    for arm, steps in stats["arms"].items():
        assert delta("eagle3:spec_decode_steps_total", arm=arm) == steps
    suffix = delta("eagle3:spec_decode_num_accepted_suffix_tokens_total")
    assert suffix == stats["draft_tokens_accepted_suffix"] > 0
    assert delta("eagle3:spec_decode_num_accepted_tokens_total") == stats["draft_tokens_accepted"] > suffix


# ---------------------------------------------------------------------------- load
PROMPTS = [f"Question {i}: tell me something about the number {i * 7}." for i in range(32)]


async def stream_one(aclient, prompt: str, max_tokens: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    return text, time.perf_counter() - t0


async def load_run(url: str, prompts: list[str], concurrent: bool, max_tokens: int = 16):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=120) as aclient:
        t0 = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(stream_one(aclient, p, max_tokens) for p in prompts))
        else:
            results = [await stream_one(aclient, p, max_tokens) for p in prompts]
        return results, time.perf_counter() - t0


def test_load_32_concurrent_streams(server):
    serial, _ = asyncio.run(load_run(server.url, PROMPTS, concurrent=False))
    results, wall = asyncio.run(load_run(server.url, PROMPTS, concurrent=True))
    assert [t for t, _ in results] == [t for t, _ in serial]
    assert all(len(t) > 0 for t, _ in results)
    lat = sorted(s for _, s in results)
    p50, p95 = statistics.median(lat), lat[int(0.95 * (len(lat) - 1))]
    print(f"\nload: 32 concurrent streaming clients x 16 tokens (tiny model): "
          f"{len(results) / wall:.1f} req/s, p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
          f"serial mean {statistics.mean(s for _, s in serial) * 1000:.0f} ms")


# ---------------------------------------------------------------------------- faults
@pytest.fixture
def slow_server(target):
    """Each decode step sleeps 50 ms: an uncancelled 200-token request would hold the engine ~5 s."""
    engine = GroupedEngine(target, tokenizer(), max_model_len=CTX, delay_s=0.05)
    app = create_app(engine, model_name=MODEL, max_queue=1)
    with RunningServer(app) as s:
        s.app = app
        yield s


def open_stream(url: str, max_tokens: int):
    http = httpx.Client(timeout=30)
    req = http.build_request("POST", url + "/v1/chat/completions",
                             json={**GOOD, "max_tokens": max_tokens, "stream": True,
                                   "temperature": 0})
    return http, http.send(req, stream=True)


def test_disconnect_mid_stream_frees_the_engine(slow_server):
    http, resp = open_stream(slow_server.url, 200)
    lines = resp.iter_lines()
    events = []
    for ln in lines:
        if ln.startswith("data:"):
            events.append(ln)
        if len(events) >= 3:
            break
    t_close = time.perf_counter()
    resp.close()
    http.close()
    worker = slow_server.app.state.server.worker
    assert wait_for(lambda: worker.busy == 0, 2.0), "generation kept running after disconnect"
    r = httpx.post(slow_server.url + "/v1/chat/completions", json={**GOOD, "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.perf_counter() - t_close < 3.0
    m = metrics(slow_server.url)
    assert m[("eagle3:requests_cancelled_total", ())] == 1
    assert m[("eagle3:generation_tokens_total", ())] < 60          # far fewer than 200 + 4


def test_disconnect_while_waiting_for_a_whole_response(slow_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "Tell a long story", "max_tokens": 200, "temperature": 0})
    worker = slow_server.app.state.server.worker
    assert wait_for(lambda: worker.busy == 0, 2.0), "generation kept running after disconnect"
    assert metrics(slow_server.url)[("eagle3:requests_cancelled_total", ())] == 1


def test_cancelled_steps_count_in_health_and_metrics(slow_server):
    """/health's acceptance monitor saw the decode steps of cancelled requests and /metrics did
    not; both count them now (the draft and verify work was done)."""
    from eagle3.speculative.monitor import AcceptanceMonitor
    state = slow_server.app.state.server
    state.engine.monitor = AcceptanceMonitor()
    http, resp = open_stream(slow_server.url, 200)
    events = [ln for _, ln in zip(range(20), resp.iter_lines()) if ln.startswith("data:")]
    resp.close()
    http.close()
    assert len(events) >= 3
    assert wait_for(lambda: state.worker.busy == 0 and state.acceptance is not None, 2.0)
    acceptance = httpx.get(slow_server.url + "/health", timeout=10).json()["acceptance"]
    m = metrics(slow_server.url)
    assert m[("eagle3:requests_cancelled_total", ())] == 1
    assert acceptance["steps"] >= 2 and acceptance["accepted_tokens"] > 0
    assert m[("eagle3:spec_decode_num_drafts_total", ())] == acceptance["steps"]
    assert m[("eagle3:spec_decode_num_draft_tokens_total", ())] == acceptance["proposed_tokens"]
    assert m[("eagle3:spec_decode_num_accepted_tokens_total", ())] == acceptance["accepted_tokens"]
    assert m[("eagle3:spec_decode_acceptance_length_count", ())] == acceptance["steps"]


def test_full_queue_answers_503_with_retry_after(slow_server):
    http, running = open_stream(slow_server.url, 200)          # occupies the engine
    lines = running.iter_lines()         # keep a reference: a dropped iterator closes the stream
    next(lines)
    worker = slow_server.app.state.server.worker
    assert wait_for(lambda: worker.busy == 1)
    queued = {}
    t = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
        slow_server.url + "/v1/chat/completions", json=GOOD, timeout=60)))
    t.start()
    assert wait_for(lambda: worker.waiting == 1)
    r = httpx.post(slow_server.url + "/v1/chat/completions", json=GOOD, timeout=30)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    running.close()
    http.close()
    t.join(timeout=30)
    assert queued["r"].status_code == 200


@pytest.fixture(scope="module")
def small_body_server(target):
    """Bodies are limited to 64 KB."""
    engine = GroupedEngine(target, tokenizer(), max_model_len=CTX)
    app = create_app(engine, model_name=MODEL, max_body_bytes=64 << 10)
    with RunningServer(app) as s:
        s.app = app
        yield s


def raw_request(port: int, head: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head.encode())
    return sock


def read_reply(sock: socket.socket, timeout_s: float) -> str:
    """One HTTP response (headers and Content-Length body) as text; what came if it stops short."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"content-length: *(\d+)", data, re.I).group(1)):
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    except socket.timeout:
        pass
    return data.decode("latin-1")


def test_chunked_upload_answers_413_at_the_limit(small_body_server):
    """No Content-Length: the server must stop at the limit, not read the whole upload first (a
    400 MB chunked body grew the server by ~700 MB). The client sends just past the limit and then
    waits without finishing the body: the 413 has to come anyway."""
    sock = raw_request(small_body_server.port,
                       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                       "\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (16 << 10)
    for _ in range(5):                           # 80 KB > 64 KB; the terminating chunk never comes
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    reply = read_reply(sock, timeout_s=5) or "(no answer in 5 s: the server waits for the rest)"
    sock.close()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert '"code":"body_too_large"' in reply.replace(" ", "")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_while_sending_the_body_is_quiet(small_body_server):
    """A client that goes away mid-body got ~118 lines of tracebacks; now a quiet 499, counted."""
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "eagle3.serve")]
    for lg in loggers:
        lg.addHandler(handler)
    before = metrics(small_body_server.url)
    try:
        for _ in range(2):
            sock = raw_request(small_body_server.port,
                               "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                               "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
            sock.sendall(b'{"messages": [{"role": "user", "content": "')
            sock.close()
        key = ("eagle3:requests_body_disconnected_total", ())
        counted = wait_for(lambda: metrics(small_body_server.url).get(key, 0) - before.get(key, 0)
                           == 2)
        time.sleep(0.2)                      # any late traceback of the second request
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    noisy = [r.getMessage() for r in handler.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, noisy
    assert counted
    after = metrics(small_body_server.url)
    status = ("eagle3:requests_total", (("endpoint", "chat"), ("status", "499")))
    assert after.get(status, 0) - before.get(status, 0) == 2


@pytest.fixture
def counted_prompts(small_body_server):
    """The server's prompt tokenizer, counting its encode calls (delay_s settable)."""
    state = small_body_server.app.state.server
    real = state.prompt_tokenizer
    state.prompt_tokenizer = CountingTokenizer(real)
    yield state.prompt_tokenizer
    state.prompt_tokenizer = real


def test_prompt_over_the_character_bound_is_refused_before_tokenizing(small_body_server,
                                                                      counted_prompts):
    """A 3.9 MB prompt took 3.6 s of tokenizing before its 400: no prompt with more characters
    than the context's tokens times the longest token's characters can fit."""
    state = small_body_server.app.state.server
    longest = max(map(len, tokenizer().get_vocab()))
    assert state.max_prompt_chars >= CTX * longest          # never refuses a prompt that fits
    text = "a" * (state.max_prompt_chars + 1)
    for path, body, param in [("/v1/completions", {"prompt": text}, "prompt"),
                              ("/v1/completions", {"prompt": [text]}, "prompt"),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": text[:9]},
                                             {"role": "user", "content": text[9:]}]}, "messages")]:
        r = httpx.post(small_body_server.url + path, json={**body, "max_tokens": 1}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text[:300]
        assert err["param"] == param and f"{len(text)} characters" in err["message"]
    assert counted_prompts.calls == 0
    # long tokens: far more characters than a fixed 32 per token would allow, and it fits
    fits = ("\n" + " " * 80) * 150                          # 12150 characters, 150 tokens
    r = httpx.post(small_body_server.url + "/v1/completions", timeout=30,
                   json={"prompt": fits, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 150
    assert counted_prompts.calls == 1


def test_health_answers_while_a_prompt_is_tokenized(small_body_server, counted_prompts):
    """Tokenizing ran on the event loop and froze every route, /health included."""
    counted_prompts.delay_s = 1.5
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
        small_body_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
        timeout=30)))
    t.start()
    assert wait_for(lambda: counted_prompts.calls == 1)
    t0 = time.perf_counter()
    health = httpx.get(small_body_server.url + "/health", timeout=10)
    waited = time.perf_counter() - t0
    t.join(timeout=30)
    assert health.status_code == 200 and waited < 0.5, f"/health took {waited:.2f} s"
    assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------- real speculation
def test_real_spec_decoder_served_equals_plain(target):
    """The engine's own SpecDecoder with a random EAGLE-3 draft: same greedy text as plain decoding,
    and the proposals show up in the response stats."""
    import torch

    from eagle3.draft.model import DraftConfig, Eagle3Draft
    from eagle3.speculative.tree import SpecParams
    torch.manual_seed(3)
    draft = Eagle3Draft(DraftConfig.for_target(target.config, aux_layer_ids=(0, 2, 3))).eval()
    draft.set_embedding(target.embed_tokens.weight)
    engine = Engine(target, tokenizer(), draft=draft,
                    spec=SpecParams(top_k=2, depth=3, num_draft_tokens=5, min_prob=0.0), max_model_len=CTX)
    plain = Engine(target, tokenizer(), max_model_len=CTX)
    messages = [{"role": "user", "content": "Speculate."}]
    ref = plain.generate(messages=messages, params=greedy(12))
    with TestClient(create_app(engine, model_name=MODEL)) as http:
        body = http.post("/v1/chat/completions", json={**GOOD, "messages": messages,
                                                        "max_tokens": 12, "temperature": 0}).json()
        health = http.get("/health").json()
    assert body["choices"][0]["message"]["content"] == ref.text
    stats = body["eagle3"]
    assert stats["speculative"] and stats["draft_tokens_proposed"] == 4 * stats["decode_steps"]
    assert len(stats["acceptance_per_position"]) == 3
    assert health["acceptance"]["steps"] == stats["decode_steps"]

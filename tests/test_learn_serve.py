"""Learning in the server: capture of served requests (opt-out), /metrics, the swap between steps
with outputs unchanged, the rollback on live acceptance, and a directory of another target."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3.generate import Engine, SamplingParams
from eagle3.learn import LearnController, LearnOptions, versions
from eagle3.learn.controller import swap_draft
from eagle3.learn.traffic import read_shard
from eagle3.learn.capture import traffic_shards
from eagle3.speculative.tree import SpecParams
from spec_helpers import one_thread, tiny_draft  # noqa: F401  (fixture)
from serve_fixtures import tiny_target, tokenizer

CTX = 128
IDENTITY = {"model": "tiny", "vocab_size": 49152}


def load_module(path):
    from eagle3.draft.formats import load_draft
    target = load_module.target
    return load_draft(path, target.config, target=target).draft.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    load_module.target = target
    return target, tiny_draft(target, seed=1), tiny_draft(target, seed=2)


def engine_with(target, draft) -> Engine:
    return Engine(target, tokenizer(), draft=draft, spec=SpecParams(2, 3, 4, 0.0), max_model_len=CTX)


def controller(root: Path, served=None) -> LearnController:
    opts = LearnOptions(root, min_tokens=1 << 30, poll_s=3600, spawn=False, rollback_steps=4)
    return LearnController(opts, IDENTITY, served, load_module)


def chat(client, text: str, **extra) -> list[int]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_served_requests_are_captured_unless_they_opt_out(pair, tmp_path, one_thread):
    from fastapi.testclient import TestClient
    from eagle3.serve import create_app
    target, a, _ = pair
    learn = controller(tmp_path)
    app = create_app(engine_with(target, a), model_name="tiny", learn=learn)
    pause = tmp_path / "learner" / "pause"
    seen = []
    busy = learn.set_busy
    learn.set_busy = lambda b: (busy(b), seen.append((b, pause.exists())))
    app.state.server.worker.on_busy = learn.set_busy
    with TestClient(app) as client:
        first = chat(client, "one")
        chat(client, "two", learn=False)
        chat(client, "three", temperature=1.0, seed=3)
        metrics = client.get("/metrics").text
    recs = [r for p in traffic_shards(tmp_path) for r in read_shard(p).records]
    assert len(recs) == 2 and recs[0]["response_ids"] == first
    assert (True, True) in seen and not pause.exists()     # paused while busy, not after
    assert [r["temperature"] for r in recs] == [0.0, 1.0]
    assert "eagle3:learn_draft_version 0.0" in metrics
    assert 'eagle3:learn_learner_state{state="idle"} 1.0' in metrics
    assert f"eagle3:learn_captured_tokens {float(learn.capture.tokens_written)}" in metrics or \
        learn.capture.tokens_written == sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in recs)


def test_a_swap_between_steps_leaves_greedy_outputs_unchanged(pair, tmp_path, one_thread):
    from fastapi.testclient import TestClient
    from eagle3.draft.formats import save_draft
    from eagle3.serve import create_app
    target, a, b = pair
    plain = Engine(target, tokenizer(), max_model_len=CTX)
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    want = [plain.generate(messages=[{"role": "user", "content": p}],
                           params=SamplingParams(temperature=0.0, max_new_tokens=12)).token_ids for p in prompts]
    engine = engine_with(target, a)
    learn = controller(tmp_path)
    save_draft(b, versions.drafts_dir(tmp_path) / "v1", "specforge", target.config)
    versions.write_card(tmp_path, 1, {"status": "served"})
    with TestClient(create_app(engine, model_name="tiny", learn=learn)) as client:
        before = [chat(client, p) for p in prompts]
        versions.set_current(tmp_path, 1)
        learn.poll()                                   # loads v1, swaps it on the engine thread
        after = [chat(client, p) for p in prompts]
    assert learn.version == 1 and learn.swaps == 1 and engine.draft is not a
    assert torch.equal(engine.draft.fc.weight, b.fc.weight)
    assert before == want and after == want


def test_a_request_running_through_a_swap_keeps_its_output(pair, one_thread):
    target, a, b = pair
    plain = Engine(target, tokenizer(), max_model_len=CTX)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    ids = plain.encode("a request that runs through a swap")
    want = plain.generate(prompt_ids=ids, params=params).token_ids
    engine = engine_with(target, a)
    run = engine.start(ids, params)
    out = []
    for k in range(40):
        if run.done:
            break
        out += run.step().token_ids
        if k == 2:
            swap_draft(engine, None, b)
    assert out == want and engine.draft is b
    assert engine.generate(prompt_ids=ids, params=params).token_ids == want


class FakeMonitor:
    steps = accepted = 0


def test_a_worse_version_on_live_traffic_is_rolled_back(tmp_path, caplog):
    learn = controller(tmp_path)
    engine = SimpleNamespace(draft="v0-layout", monitor=FakeMonitor())
    learn.attach(engine, None, lambda task: task())
    learn.load_layout = lambda path: f"layout of {path}"
    versions.write_card(tmp_path, 1, {"status": "served"})
    (versions.drafts_dir(tmp_path) / "v1" / "config.json").write_text("{}")
    engine.monitor.steps, engine.monitor.accepted = 10, 10          # v0: tau 2.0 live
    versions.set_current(tmp_path, 1)
    learn.poll()
    assert learn.version == 1 and learn.watch is not None
    engine.monitor.steps, engine.monitor.accepted = 20, 13          # v1: tau 1.3 live
    with caplog.at_level(logging.INFO, logger="eagle3.learn"):
        learn.poll()
    assert learn.version == 0 and learn.rollbacks == 1 and versions.current(tmp_path) == 0
    assert versions.card(tmp_path, 1)["status"] == "rolled back"
    assert len([r for r in caplog.records if "rolled back v1 -> v0" in r.getMessage()]) == 1


def test_a_better_version_is_kept(tmp_path):
    learn = controller(tmp_path)
    engine = SimpleNamespace(draft="x", monitor=FakeMonitor())
    learn.attach(engine, None, lambda task: task())
    versions.write_card(tmp_path, 1, {"status": "served"})
    (versions.drafts_dir(tmp_path) / "v1" / "config.json").write_text("{}")
    learn.load_layout = lambda path: "new"
    engine.monitor.steps, engine.monitor.accepted = 10, 10
    versions.set_current(tmp_path, 1)
    learn.poll()
    engine.monitor.steps, engine.monitor.accepted = 20, 21
    learn.poll()
    assert learn.version == 1 and learn.rollbacks == 0 and learn.watch is None


def test_the_learner_state_reads_swapping_until_the_new_version_serves(tmp_path):
    """A finished learner is not yet a served version: while the version loads and swaps in, the
    state reads swapping (a client that took idle for done stopped the server before its swap)."""
    learn = controller(tmp_path)
    engine = SimpleNamespace(draft="x", monitor=FakeMonitor())
    seen = []
    learn.attach(engine, None, lambda task: (seen.append(("engine", learn.snapshot()["learner_state"])), task()))
    versions.write_card(tmp_path, 1, {"status": "served"})
    (versions.drafts_dir(tmp_path) / "v1" / "config.json").write_text("{}")
    learn.load_layout = lambda path: seen.append(("load", learn.snapshot()["learner_state"])) or "new"
    versions.set_current(tmp_path, 1)
    learn.poll()
    assert seen == [("load", "swapping"), ("engine", "swapping")]
    assert learn.version == 1 and learn.snapshot()["learner_state"] == "idle"


def test_a_directory_of_another_target_serves_without_learning(tmp_path, caplog):
    from eagle3.serve.cli import learn_controller
    controller(tmp_path).stop()
    args = SimpleNamespace(learn=str(tmp_path), learn_min_tokens=10, learn_max_bytes=1 << 20,
                           learn_replay=None, model=None, draft="none", algorithm=None, weights="auto",
                           draft_weights="auto", device=None, threads=None, kv_cache_dtype="auto",
                           remeasure=False)
    engine = SimpleNamespace(target=SimpleNamespace(config=SimpleNamespace(
        vocab_size=49152, hidden_size=64, num_layers=4)))
    with caplog.at_level(logging.ERROR, logger="eagle3.serve"):
        assert learn_controller(args, engine) is None
    assert len(caplog.records) == 1 and "another target" in caplog.records[0].getMessage()
    assert (tmp_path / "learn.json").is_file() and json.loads((tmp_path / "learn.json").read_text())["target"] == IDENTITY


def test_a_target_without_a_draft_gets_its_first_one_between_requests(pair, one_thread):
    from eagle3.learn.controller import attach_first_draft
    from eagle3.runtime.costs import CostTable
    from eagle3.speculative.policy import AdaptivePolicy
    target, a, _ = pair
    costs = CostTable((1, 2, 4, 8, 16), (10.0, 10.1, 10.2, 10.4, 10.8), (0.01,) * 5)
    suffix_only = lambda greedy: AdaptivePolicy((), costs, suffix_only_tokens=8, correct_costs=False)  # noqa: E731
    engine = Engine(target, tokenizer(), max_model_len=CTX, policy=suffix_only)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    ids = engine.encode("a code request")
    before = engine.generate(prompt_ids=ids, params=params)
    assert engine.draft is None and not any(s.arm.startswith("tree") for s in before.decode_steps)
    shapes = (SpecParams(2, 3, 6, 0.0),)
    why = attach_first_draft(engine, a, lambda greedy: AdaptivePolicy(shapes, costs, correct_costs=False))
    assert why is None and engine.draft is a
    after = engine.generate(prompt_ids=ids, params=params)
    assert after.token_ids == before.token_ids
    assert any(s.arm.startswith("tree") for s in after.decode_steps)     # the draft's trees now run


def test_a_busy_server_stops_its_learner_at_once_and_continues_it_when_idle(tmp_path):
    """The learner pauses between its steps only; a step under way ran on beside the requests. So
    the server stops the process itself while busy (SIGSTOP) and continues it when idle."""
    import subprocess
    import sys
    import time
    learn = controller(tmp_path)

    def state() -> str:                                           # R running, T stopped
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    proc = learn.learner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        learn.set_busy(True)
        time.sleep(0.2)
        assert state() == "T"                                     # stopped
        learn.set_busy(False)
        time.sleep(0.2)
        assert state() == "R"                                     # running again
        learn.stop()
        assert proc.wait(10) is not None                          # a stopped one would not end
    finally:
        proc.kill()

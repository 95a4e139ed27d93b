"""eagle3 doctor --server: a running server's speculation judged from outside, over HTTP on loopback.

Our own server runs tiny random targets with GroupedEngine (plain tokens reported in speculative
groups: a known tau of 2.0), or never accepting (the zero-acceptance incident), or plain. vLLM and
SGLang cannot run here: small FastAPI stand-ins answer with the shapes their sources give
(recorded below, versions named) and count speculation like the real engines. Every error path
(unreachable, 401, HTML instead of JSON, unparsable metrics, timeout) is a failed check with a fix.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Optional

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client.parser import text_string_to_metric_families

from eagle3.doctor import doctor_main, run_server_doctor
from eagle3.doctor.endpoint import ServerError, base_url, by_position, parse_metrics, total
from eagle3.doctor.server import PHASES, LiveStats, PhaseResult, ServerSettings, offline_checks
from eagle3.doctor.report import DoctorReport
from eagle3.generate import Engine
from eagle3.serve import create_app
from serve_fixtures import GroupedEngine, RunningServer, free_socket, tiny_target, tokenizer

KEY = "sk-doctor"
FAST = ServerSettings(max_tokens=12, timeout_s=30)

pytestmark = pytest.mark.usefixtures("one_thread")


def check(report, name: str):
    found = [c for c in report.checks if c.name == name]
    assert found, f"no check {name}:\n{report.table()}"
    return found[0]


def metrics_tau(url: str) -> float:
    """1 + accepted / verify steps from our /metrics, read with prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return 1 + values["eagle3:spec_decode_num_accepted_tokens_total"] / \
        values["eagle3:spec_decode_num_drafts_total"]


# ---------------------------------------------------------------------------- our own server
@pytest.fixture(scope="module")
def target():
    return tiny_target()


def serve(engine, **kw) -> RunningServer:
    return RunningServer(create_app(engine, model_name="tiny", api_key=KEY, **kw))


def grouped(target, never_accept: bool = False, arms: tuple[str, ...] = ()) -> GroupedEngine:
    engine = GroupedEngine(target, tokenizer(), max_model_len=256)
    engine.never_accept, engine.arms = never_accept, arms
    return engine


def test_our_server_passes_with_the_tau_its_metrics_show(target, capsys):
    with serve(grouped(target)) as s:
        code = doctor_main(["--server", s.url, "--api-key", KEY, "--max-tokens", "12", "--json"])
        reference = metrics_tau(s.url)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"], report
    phases = report["probe"]["phases"]
    assert [p["phase"] for p in phases] == [p.name for p in PHASES]
    assert all(p["tau"] == pytest.approx(2.0) for p in phases)          # GroupedEngine's pattern
    steps = sum(p["verify_steps"] for p in phases)
    assert 1 + sum(p["accepted_tokens"] for p in phases) / steps == pytest.approx(reference)
    assert phases[0]["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3])
    assert report["facts"]["engine"] == "eagle3" and report["facts"]["model"] == "tiny"


def test_zero_acceptance_fails_naming_the_causes(target):
    with serve(grouped(target, never_accept=True)) as s:
        report = run_server_doctor(s.url, KEY, settings=FAST)
    tau = check(report, "server.tau")
    assert tau.status == "fail" and "tau 1.00" in tau.message and "never accepted" in tau.message
    for cause in ("algorithm flag", "aux hidden-state capture", "off by one", "d2t", "another target"):
        assert cause in tau.fix
    assert report.exit_code == 1


def test_plain_server_is_not_speculating(target):
    with serve(Engine(target, tokenizer(), max_model_len=256)) as s:
        report = run_server_doctor(s.url, KEY, settings=FAST)
    spec = check(report, "server.speculation")
    assert spec.status == "fail" and "not speculating" in spec.message and "--draft" in spec.fix
    assert not any(c.name == "server.tau" for c in report.checks)


def test_speculation_configured_but_never_run(target):
    with serve(grouped(target, arms=("plain",))) as s:          # every step decodes plainly
        report = run_server_doctor(s.url, KEY, settings=FAST)
    spec = check(report, "server.speculation")
    assert spec.status == "fail" and "configured" in spec.message and "no draft was verified" \
        in spec.message


def test_a_draftless_server_without_blocks_warns_and_does_not_fail(target):
    """`eagle3 serve --draft suffix` (or a model with no shipped draft) speculates only where the
    text repeats: no block over the doctor's prompts is a warning that names the way to a draft,
    not a failure, and no tau is judged (/health names suffix_only_tokens, not a tree)."""
    from test_spec_suffix import draftless_policy
    with serve(Engine(target, tokenizer(), max_model_len=256, policy=draftless_policy)) as s:
        report = run_server_doctor(s.url, KEY, settings=FAST)
    spec = check(report, "server.speculation")
    assert spec.status == "warn" and "without a draft" in spec.message and "--learn" in spec.fix
    assert not any(c.name == "server.tau" for c in report.checks) and report.exit_code == 0


def test_wrong_key_and_no_key(target):
    with serve(grouped(target)) as s:
        missing = run_server_doctor(s.url, None, settings=FAST)
        wrong = run_server_doctor(s.url + "/v1/", "nope", settings=FAST)
    assert check(missing, "server.auth").status == "fail" and "--api-key" in missing.checks[0].fix
    assert "needs an API key" in missing.checks[0].message
    assert "refused the API key" in check(wrong, "server.auth").message
    assert missing.exit_code == wrong.exit_code == 1


# ---------------------------------------------------------------------------- recorded engine shapes
# vLLM 0.32 (V1 engine): vllm/v1/spec_decode/metrics.py SpecDecodingProm registers counters with
# labels [model_name, engine] (+ position, 0-based, created for every position up to
# num_speculative_tokens); prometheus_client exposes them with _total and _created samples. Without
# --speculative-config none of them exists. /version answers {"version": ...}.
VLLM_HEAD = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} %(tokens)s
"""
VLLM_SPEC = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} %(drafts)s
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} %(draft_tokens)s
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} %(accepted)s
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
"""
VLLM_POS = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",' \
           'position="%d"} %s\n'

# SGLang 0.5.3: http_server.get_server_info returns the server args, the scheduler info,
# "internal_states" (per DP rank; scheduler.get_internal_state adds avg_spec_accept_length =
# accepted tokens incl. the bonus / verify steps, since start, only once a step ran) and "version".
# /server_info is the newer route (older releases: /get_server_info only, as here); /health answers
# an empty 200. /metrics (--enable-metrics) has the gauge sglang:spec_accept_length per rank.
SGLANG_INFO = {"model_path": "tiny", "tokenizer_path": "tiny", "served_model_name": "tiny",
               "speculative_draft_model_path": "/drafts/d", "speculative_num_steps": 3,
               "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6,
               "max_req_input_len": 4096, "version": "0.5.3"}


class FakeEngine:
    """An engine that speculates a chain of `depth`, accepting `accept` tokens per verify step."""

    def __init__(self, kind: str, accept: int = 2, depth: int = 3, speculative: bool = True,
                 algorithm: str = "EAGLE3", metrics: Optional[str] = None):
        self.kind, self.accept, self.depth, self.speculative = kind, accept, depth, speculative
        self.algorithm, self.metrics_override = algorithm, metrics
        self.tokens = self.drafts = self.accepted = 0

    def generate(self, max_tokens: int) -> None:
        self.tokens += max_tokens
        if self.speculative:
            self.drafts += math.ceil(max_tokens / (self.accept + 1))
            self.accepted += self.accept * math.ceil(max_tokens / (self.accept + 1))

    def vllm_metrics(self) -> str:
        text = VLLM_HEAD % {"tokens": float(self.tokens)}
        if self.speculative:
            text += VLLM_SPEC % {"drafts": float(self.drafts), "accepted": float(self.accepted),
                                 "draft_tokens": float(self.drafts * self.depth)}
            text += "".join(VLLM_POS % (k, float(self.drafts if k < self.accept else 0))
                            for k in range(self.depth))
        return text

    def sglang_info(self) -> dict:
        state = {"last_gen_throughput": 12.5, "load": 0}
        if self.speculative and self.drafts:
            state["avg_spec_accept_length"] = (self.accepted + self.drafts) / self.drafts
        return {**SGLANG_INFO, "speculative_algorithm": self.algorithm if self.speculative else None,
                "internal_states": [state]}


def fake_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": engine.kind,
                                            "root": "tiny", "max_model_len": 2048}]}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.json()
        engine.generate(body["max_tokens"])
        choice = {"index": 0, "finish_reason": "length", "text": "x",
                  "message": {"role": "assistant", "content": "x"}}
        return {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": body["max_tokens"],
                          "total_tokens": 5 + body["max_tokens"]}}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    if engine.kind == "vllm":
        @app.get("/version")
        async def version():
            return {"version": "0.32.0"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(engine.metrics_override or engine.vllm_metrics())
    else:
        @app.get("/get_server_info")
        async def server_info():
            return JSONResponse(engine.sglang_info())
    return app


def run_fake(engine: FakeEngine, **kw):
    with RunningServer(fake_app(engine)) as s:
        return run_server_doctor(s.url, settings=FAST, **kw)


def test_vllm_counters_give_tau_and_acceptance_per_position():
    report = run_fake(FakeEngine("vllm", accept=2, depth=3))
    assert report.ok, report.table()
    assert "vLLM 0.32.0" in check(report, "server.engine").message
    first = report.probe["phases"][0]
    assert first["tau"] == pytest.approx(3.0)
    assert first["acceptance_per_position"] == pytest.approx([1.0, 1.0, 0.0])   # 0-based labels
    assert "3 draft positions" in check(report, "server.speculation").message


def test_vllm_without_speculative_config_is_not_speculating():
    report = run_fake(FakeEngine("vllm", speculative=False))
    spec = check(report, "server.speculation")
    assert spec.status == "fail" and "vllm:spec_decode_num_drafts" in spec.message
    assert "--speculative-config" in spec.fix


def test_vllm_zero_acceptance_fails():
    report = run_fake(FakeEngine("vllm", accept=0))
    assert check(report, "server.tau").status == "fail"
    assert report.probe["phases"][0]["acceptance_per_position"] == [0.0, 0.0, 0.0]


def test_sglang_server_info_accept_length():
    report = run_fake(FakeEngine("sglang", accept=1))
    assert report.ok, report.table()
    assert "SGLang 0.5.3 (/get_server_info)" in check(report, "server.engine").message
    assert "speculative_algorithm EAGLE3" in check(report, "server.speculation").message
    assert report.probe["phases"][0]["tau"] == pytest.approx(2.0)
    assert "since the server started" in check(report, "server.tau").message


def test_sglang_run_as_eagle_names_the_algorithm_first():
    report = run_fake(FakeEngine("sglang", accept=0, algorithm="EAGLE"))
    tau = check(report, "server.tau")
    assert tau.status == "fail" and tau.fix.startswith("the server runs speculative_algorithm EAGLE")


def test_sglang_without_speculation():
    report = run_fake(FakeEngine("sglang", speculative=False))
    spec = check(report, "server.speculation")
    assert spec.status == "fail" and "--speculative-algorithm EAGLE3" in spec.fix


# ---------------------------------------------------------------------------- error paths
def test_unreachable_url():
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()                                    # nothing listens there now
    report = run_server_doctor(f"http://127.0.0.1:{port}", settings=FAST)
    reach = check(report, "server.reach")
    assert reach.status == "fail" and "cannot connect" in reach.message and "running" in reach.fix


def test_html_instead_of_json():
    app = FastAPI()

    @app.get("/v1/models")
    async def page():
        return HTMLResponse("<!doctype html><html><body>Login</body></html>")

    with RunningServer(app) as s:
        report = run_server_doctor(s.url, settings=FAST)
    api = check(report, "server.api")
    assert api.status == "fail" and "text/html" in api.message and "not JSON" in api.message
    assert "base URL" in api.fix


def test_unparsable_metrics_name_the_line():
    broken = VLLM_HEAD % {"tokens": 1.0} + "vllm:spec_decode_num_drafts_total{engine=0} many\n"
    report = run_fake(FakeEngine("vllm", metrics=broken))
    bad = check(report, "server.metrics")
    assert bad.status == "fail" and "line 7" in bad.message and "many" in bad.message


def test_timeout():
    app = FastAPI()

    @app.get("/v1/models")
    async def slow():
        import asyncio
        await asyncio.sleep(2.0)
        return {"data": []}

    with RunningServer(app) as s:
        start = time.monotonic()
        report = run_server_doctor(s.url, settings=ServerSettings(timeout_s=0.3))
        waited = time.monotonic() - start
    timeout = check(report, "server.timeout")
    assert timeout.status == "fail" and "0.3 s" in timeout.message and "--timeout" in timeout.fix
    assert waited < 1.5


def test_bad_url_is_an_input_error():
    with pytest.raises(Exception, match="expected http://HOST:PORT"):
        base_url("localhost:8000")
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


# ---------------------------------------------------------------------------- parsing, offline
def test_prometheus_text_parsing():
    text = ('# HELP x y\nm_total{a="q\\"u",position="1"} 3\nm_total{position="2",a="b"} 1.5e0 17\n'
            'm_created{a="b"} 9\ng NaN\n')
    samples = parse_metrics(text)
    assert samples[0].labels == (("a", 'q"u'), ("position", "1"))
    assert total(samples, "m") == 4.5 and by_position(samples, "m", first=1) == {1: 3.0, 2: 1.5}
    with pytest.raises(ServerError, match="line 2"):
        parse_metrics("ok 1\nm{a=b} 1\n")
    with pytest.raises(ServerError, match="below the first"):     # a 0-based engine read as 1-based
        by_position(parse_metrics('m_total{position="0"} 1\n'), "m", first=1)


def test_offline_probe_far_above_the_server_fails(tmp_path):
    """The same pair offline (our probe) accepts much more than the server: the engine runs the
    draft differently (e.g. vLLM reading a SpecForge eagle_config list one layer early)."""
    from test_doctor import bigram_target, copy_draft, save_target, write_draft
    model = bigram_target()
    target_dir = save_target(model, tmp_path / "t")
    draft_dir = write_draft(tmp_path, copy_draft(model), "d", target=model)
    settings = ServerSettings(max_tokens=12, phases=(PHASES[0],))

    def verdict(server_tau: float) -> str:
        report = DoctorReport(probe={})
        phase = PhaseResult(PHASES[0], 36, 1.0, LiveStats(server_tau, [], 30, 0))
        offline_checks(report, str(target_dir), str(draft_dir), phase, (2, 3, 5), settings)
        return check(report, "server.offline")

    low = verdict(1.05)
    assert low.status == "fail" and "far below" in low.message and "one layer early" in low.fix
    assert verdict(2.5).status == "pass"


# ---------------------------------------------------------------------------- the real model
@pytest.mark.real
def test_real_server_shipped_draft_passes_random_draft_fails(tmp_path):
    """SmolLM2 + the shipped draft behind our server: the doctor's tau is the one /metrics shows.
    The same server with a random-weight draft of the right shapes fails on near-zero acceptance.
    A fixed tree (no adaptive policy), so that every decode step verifies a draft."""
    import torch
    from eagle3.api import load_engine
    from eagle3.draft.formats import save_draft
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    greedy = ServerSettings(max_tokens=24, phases=PHASES[:2])
    shipped = load_engine(max_model_len=512, adaptive=False)
    with RunningServer(create_app(shipped, model_name="smollm2")) as s:
        good = run_server_doctor(s.url, settings=greedy)
        reference = metrics_tau(s.url)
    assert good.ok and check(good, "server.tau").status == "pass", good.table()
    doctor_tau = float(re.match(r"tau (\d+\.\d+)", check(good, "server.tau").message)[1])
    print(f"\nshipped draft: doctor tau {doctor_tau:.2f}, /metrics tau {reference:.3f}")
    assert doctor_tau == pytest.approx(reference, rel=0.10) and doctor_tau > 1.3
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.for_target(shipped.target.config))
    draft_dir = save_draft(draft, tmp_path / "random", "specforge", shipped.target.config)
    random_engine = load_engine(draft=str(draft_dir), max_model_len=512, adaptive=False)
    with RunningServer(create_app(random_engine, model_name="smollm2")) as s:
        bad = run_server_doctor(s.url, settings=greedy)
    print(f"random draft: doctor tau {bad.probe['phases'][0]['tau']:.3f}")
    assert check(bad, "server.tau").status == "fail", bad.table()
    assert "off by one" in check(bad, "server.tau").fix


@pytest.mark.real
def test_real_adaptive_server_random_draft_exits_1_shipped_exits_0(tmp_path):
    """The seed's silent failure in our own server: with its default adaptive step a server stops
    asking a useless draft and runs at plain speed. It still measures its draft (its first own
    steps densely), so the doctor fails a random-weights draft of the shipped draft's shapes,
    naming the draft and its acceptance, and passes the shipped draft."""
    import torch
    from eagle3.api import load_engine
    from eagle3.draft.formats import save_draft
    from eagle3.draft.model import DraftConfig, Eagle3Draft
    shipped = load_engine(max_model_len=512)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.for_target(shipped.target.config))
    draft_dir = save_draft(draft, tmp_path / "random", "specforge", shipped.target.config)
    with RunningServer(create_app(shipped, model_name="smollm2")) as s:
        good = run_server_doctor(s.url)
        good_health = httpx.get(s.url + "/health", timeout=10).json()
    assert good.exit_code == 0 and check(good, "server.draft").status == "pass", good.table()
    assert not good_health["draft"]["collapsed"]
    random_engine = load_engine(draft=str(draft_dir), max_model_len=512)
    random_engine.draft_name = str(draft_dir)                  # as `eagle3 serve --draft DIR` names it
    with RunningServer(create_app(random_engine, model_name="smollm2")) as s:
        bad = run_server_doctor(s.url)
        bad_health = httpx.get(s.url + "/health", timeout=10).json()
    found = check(bad, "server.draft")
    print(f"\nshipped: {check(good, 'server.draft').message}\nrandom: {found.message}")
    assert bad.exit_code == 1 and found.status == "fail" and found.field == "draft tau", bad.table()
    assert "random" in found.message and "never accepted" in found.message
    assert bad_health["status"] == "degraded" and bad_health["draft"]["collapsed"]

"""The bench harness on a tiny random model: workload selection, interleaved runs, statistics,
greedy identity, report files, --quick/--tune option logic, llama.cpp log parsing. No timing
assertions (timings on a shared machine prove nothing)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3.bench.cli import config_from, parse_args, workload_text
from eagle3.bench.llamacpp import CompletionOutput, SpecSimpleOutput, sampler_kwargs
from eagle3.bench.report import (identities, save_json, save_plots, summarize, table,
                                 tree_vs_chain_text)
from eagle3.bench.roofline import measure, read_bytes_per_forward, verify_costs
from eagle3.bench.runner import BenchConfig, Failures, Setup, context_len, rotate, run, spec_shapes
from eagle3.bench.stats import (Record, Spread, acceptance_per_position, first_divergence,
                                greedy_identity, ratios)
from eagle3.bench.systems import GenParams, HFSystem, build_ours, cut_at_stop
from eagle3.bench.tune import costs_text, parse_shapes, tune, tune_text
from eagle3.bench.workload import (COPY_CATEGORIES, BenchPrompt, Question, load_questions,
                                   load_workload, select_questions, workload_questions)
from eagle3.config import RunConfig
from eagle3.errors import InputError
from eagle3.runtime.target import build_target
from eagle3.speculative.tree import SpecParams
from spec_helpers import StubTokenizer, tiny_draft, tiny_target

STOP = 2


# ---------------------------------------------------------------------------- workload
def test_mtbench_file_has_80_first_turns_in_8_categories():
    qs = load_questions()
    assert len(qs) == 80
    assert len({q.category for q in qs}) == 8
    assert all(q.text for q in qs)


def test_selection_round_robins_over_categories():
    qs = [Question(i, cat, f"{cat}{i}") for i, cat in enumerate(["math"] * 3 + ["coding"] * 2
                                                                   + ["writing"])]
    picked = select_questions(qs, 4)
    assert [q.category for q in picked] == ["writing", "math", "coding", "math"]
    assert len(select_questions(qs, 100)) == len(qs)
    assert len({q.question_id for q in select_questions(qs, 100)}) == len(qs)


COPY_PER_CATEGORY = 8          # docs/benchmarks.md: 40 prompts, 8 in each of the 5 categories
RUNS = Path(__file__).resolve().parent.parent / "runs"


def test_copy_workload_file_has_8_prompts_in_each_of_5_categories():
    qs = load_workload("copy")
    assert len(COPY_CATEGORIES) == 5
    assert [q.category for q in qs] == [c for c in COPY_CATEGORIES for _ in range(COPY_PER_CATEGORY)]
    assert len({q.source_id for q in qs}) == len({q.text for q in qs}) == len(qs)
    assert all(len(q.text) > 400 and q.source_id for q in qs)


def test_copy_workload_holds_no_training_prompt():
    from eagle3.train.data import PromptFilter, clean, junk_reason
    if not (RUNS / "data" / "conversations.jsonl").is_file():
        pytest.skip(f"{RUNS}/data/conversations.jsonl is absent: the training ids are not here")
    qs = load_workload("copy")
    trained = {json.loads(line)["id"] for line in
               (RUNS / "data" / "conversations.jsonl").read_text().splitlines() if line.strip()}
    assert not trained & {q.source_id for q in qs}
    # the later runs (data_sharegpt*) commit counts, not ids: every copy prompt is one the training
    # filter rejects, so select_prompts, which drew all of them, cannot have picked it
    assert all(junk_reason(clean(q.text), PromptFilter()) in ("too_long", "non_text") for q in qs)


def test_copy_workload_holds_no_prompt_of_the_recomputed_training_selection():
    from eagle3.train.data import select_prompts
    try:
        from eagle3.runtime.assets import mtbench_questions, sharegpt_json
        sharegpt, mtbench = sharegpt_json(), mtbench_questions()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the ShareGPT / MT-bench packages are not installed: {e}")
    committed = [json.loads(p.read_text()) for p in RUNS.glob("data*/prompt_selection.json")]
    if not committed:
        pytest.skip(f"no {RUNS}/data*/prompt_selection.json")
    prompts, stats = select_prompts(sharegpt, mtbench)
    assert dict(stats) == max(committed, key=lambda s: s["records"])   # the selection the runs drew
    assert not {p.id for p in prompts} & {q.source_id for q in load_workload("copy")}


def test_workload_option_selects_the_copy_file_round_robin():
    assert config_from(parse_args([])).workload == "mtbench"
    cfg = config_from(parse_args(["--workload", "copy", "--prompts", "7"]))
    assert cfg.workload == "copy"
    picked = workload_questions(cfg.workload, cfg.prompts)
    assert [q.category for q in picked] == list(COPY_CATEGORIES) + list(COPY_CATEGORIES[:2])
    assert len(workload_questions("copy", 1000)) == len(COPY_CATEGORIES) * COPY_PER_CATEGORY
    assert "copy" in workload_text(cfg, 7) and "MT-bench" in workload_text(config_from(parse_args([])), 7)
    with pytest.raises(SystemExit):
        parse_args(["--workload", "nope"])
    with pytest.raises(InputError, match="workload"):
        BenchConfig(workload="nope")


# ---------------------------------------------------------------------------- statistics
def rec(system, qid, tps, temp=0.0, tokens=None, accept=None):
    n = 10
    return Record(system, "ours", "cpu", qid, "x", temp, 5, n, n / tps, accept_lens=accept,
                  tokens=tokens)


def test_ratios_pair_prompts_and_temperatures():
    records = [rec("a", 1, 20.0), rec("b", 1, 10.0), rec("a", 2, 30.0), rec("b", 2, 10.0),
               rec("a", 1, 5.0, temp=1.0), rec("b", 1, 10.0, temp=1.0)]
    assert ratios(records, "a", "b", 0.0) == pytest.approx([2.0, 3.0])
    assert ratios(records, "a", "b", 1.0) == pytest.approx([0.5])
    s = Spread.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median, s.lo, s.hi, s.n) == (3.0, 1.0, 100.0, 5)
    assert s.p25 <= s.median <= s.p75


def test_acceptance_per_position_pools_steps():
    records = [rec("a", 1, 1.0, accept=[0, 2, 3]), rec("a", 2, 1.0, accept=[1])]
    assert acceptance_per_position(records, 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_identity_reports_the_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    records = [rec("ours-plain", 1, 1.0, tokens=[1, 2, 3]), rec("ours-x", 1, 1.0, tokens=[1, 2, 3]),
               rec("ours-plain", 2, 1.0, tokens=[4, 5]), rec("ours-x", 2, 1.0, tokens=[4, 6])]
    ident = greedy_identity(records, "ours-x", "ours-plain")
    assert (ident.identical, ident.compared, ident.divergences) == (1, 2, ((2, 1),))


def test_cut_at_stop_and_hf_sampling_arguments():
    p = GenParams(0.0, 4, 0, (STOP,))
    assert cut_at_stop([5, 6, STOP, 7], p) == [5, 6]
    assert cut_at_stop([5, 6, 7, 8, 9], p) == [5, 6, 7, 8]
    assert cut_at_stop([5, STOP, 7], GenParams(0.0, 4, 0, (STOP,), ignore_eos=True)) == [5, STOP, 7]
    hf = HFSystem.__new__(HFSystem)
    hf.prompt_lookup = 10
    x = torch.ones(1, 3, dtype=torch.long)
    kw = hf.kwargs(GenParams(1.0, 8, 0, (STOP,), ignore_eos=True), x)
    assert (kw["do_sample"], kw["top_k"], kw["top_p"], kw["temperature"]) == (True, 0, 1.0, 1.0)
    assert kw["min_new_tokens"] == 8 and kw["prompt_lookup_num_tokens"] == 10
    assert "temperature" not in hf.kwargs(GenParams(0.0, 8, 0, (STOP,)), x)
    s = sampler_kwargs(GenParams(1.0, 8, 0, (STOP,)))
    assert (s["top_k"], s["top_p"], s["min_p"], s["repeat_penalty"]) == (0, 1.0, 0.0, 1.0)


LOG = """
encoded  215 tokens in    0.312 seconds, speed:  689.103 t/s
decoded  130 tokens in    1.500 seconds, speed:   86.667 t/s

n_draft   = 5
n_predict = 130
n_drafted = 200
n_accept  = 80
accept    = 40.000%
"""


def test_llama_speculative_simple_log_parsing():
    out = SpecSimpleOutput.parse(LOG)
    assert (out["prompt_tokens"], out["decoded"], out["n_accept"]) == (215, 130, 80)
    assert out["encode_s"] == pytest.approx(0.312)
    assert out.tau == pytest.approx(130 / 50)
    with pytest.raises(RuntimeError):
        SpecSimpleOutput.parse("no timings here")


COMPLETION_LOG = """
<|im_start|>assistant
A gear is a wheel with teeth. [end of text]

common_perf_print:    sampling time =      31.50 ms
common_perf_print:    samplers time =      20.10 ms /   230 tokens
common_perf_print:        load time =     210.00 ms
common_perf_print: prompt eval time =     120.00 ms /    99 tokens (    1.21 ms per token,   825.00 tokens per second)
common_perf_print:        eval time =    1400.00 ms /   130 runs   (   10.77 ms per token,    92.86 tokens per second)
common_perf_print:       total time =    1800.00 ms /   229 tokens
"""


def test_llama_completion_log_parsing():
    """Its own timers: prompt eval + eval + sampling, load excluded; tokens = eval runs + the last
    one drawn, which is not evaluated, unless that was the end-of-text token (not emitted). The
    sampler's own count includes the prompt's tokens, so it is not used."""
    out = CompletionOutput.parse(COMPLETION_LOG)
    assert (out["prompt_tokens"], out["eval_runs"], out["emitted"]) == (99, 130, 130)
    assert out.seconds == pytest.approx((120.0 + 1400.0 + 31.5) / 1e3)
    capped = CompletionOutput.parse(COMPLETION_LOG.replace(" [end of text]", ""))
    assert capped["emitted"] == 131 and not capped["stopped_at_eos"]
    with pytest.raises(RuntimeError, match="eval"):
        CompletionOutput.parse(COMPLETION_LOG.replace("common_perf_print:        eval time", "x"))


def test_the_native_llama_cpp_system_runs_the_binary_with_plain_sampling(tmp_path):
    """llama.cpp-native: one llama-completion process per prompt, no conversation mode, llama.cpp's
    default samplers switched off, the chat text as the prompt, timed by the binary's timers."""
    from eagle3.bench.llamacpp import LlamaCppNativeSystem
    from eagle3.bench.workload import BenchPrompt
    fake = tmp_path / "llama-completion"
    args = tmp_path / "args.txt"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args}\ncat <<'EOF'\n{COMPLETION_LOG}\nEOF\n")
    fake.chmod(0o755)
    system = LlamaCppNativeSystem("llama.cpp-native", fake, tmp_path / "m.gguf", threads=2, n_ctx=512)
    prompt = BenchPrompt(1, "writing", "Hi", (1, 2, 3), "<|im_start|>user\nHi<|im_end|>\n", 7)
    res = system.run(prompt, GenParams(1.0, 256, 7, (STOP,)))
    assert len(res.tokens) == 130 and res.seconds == pytest.approx(1.5515)
    argv = args.read_text().split()
    for flag, value in (("-n", "256"), ("--temp", "1.0"), ("--top-k", "0"), ("--min-p", "0"),
                        ("--seed", "7"), ("-t", "2"), ("-c", "512")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "-no-cnv" in argv and "--ignore-eos" not in argv


# ---------------------------------------------------------------------------- options
def test_quick_and_tune_presets():
    cfg = config_from(parse_args(["--quick", "--threads", "1"]))
    assert (cfg.prompts, cfg.max_new_tokens, cfg.temperatures, cfg.threads) == (3, 32, (0.0, 1.0), 1)
    cfg = config_from(parse_args(["--quick", "--prompts", "5", "--tree", "2,3,5"]))
    assert cfg.prompts == 5 and cfg.tree == SpecParams(2, 3, 5, 0.0)
    cfg = config_from(parse_args([]))
    assert (cfg.prompts, cfg.max_new_tokens) == (80, 256)
    cfg = config_from(parse_args(["--tune"]))
    assert cfg.systems == ("ours-*",) and cfg.temperatures == (0.0,)
    assert parse_shapes("1,3,9;2,3,5") == (SpecParams.chain(3), SpecParams(2, 3, 5, 0.0))
    assert parse_shapes("4,5,8,0.05;1,4,0,0.1") == (SpecParams(4, 5, 8, 0.05), SpecParams.chain(4, 0.1))
    cfg = config_from(parse_args(["--tune", "--temperatures", "1,0"]))
    assert cfg.temperatures == (1.0,)
    cfg = config_from(parse_args(["--tree", "4,5,8,0.02"]))
    assert cfg.tree == SpecParams(4, 5, 8, 0.02) and "ours-tree4x5n8p0.02" in spec_shapes(cfg)
    for bad in ("4,5", "4,5,8,x", "a,b,c"):
        with pytest.raises(InputError, match="TOP_K,DEPTH,NUM_DRAFT_TOKENS"):
            parse_shapes(bad)
    assert config_from(parse_args(["--clock", "cpu", "--threads", "1"])).clock == "cpu"
    with pytest.raises(InputError, match="threads 1"):
        config_from(parse_args(["--clock", "cpu", "--threads", "2"]))


# ---------------------------------------------------------------------------- harness
def tiny_setup(systems, prompts) -> Setup:
    warm = BenchPrompt(-1, "warmup", "w", (3, 4, 5), "w", 7)
    depths = {s.name: s.spec.depth for s in systems if s.speculative}
    return Setup(systems, [], prompts, warm, (STOP,), depths, systems[0].engine.target, 0)


@pytest.fixture
def harness(one_thread):
    target = tiny_target(vocab=32)
    systems = build_ours(target, tiny_draft(target), StubTokenizer(), 64,
                         {"ours-chain3": SpecParams.chain(3), "ours-tree": SpecParams(3, 3, 6, 0.0)})
    gen = torch.Generator().manual_seed(0)
    prompts = [BenchPrompt(10 + i, "cat", "t", tuple(torch.randint(3, 32, (6 + i,), generator=gen)
                                                      .tolist()), "t", i) for i in range(3)]
    cfg = BenchConfig(prompts=3, max_new_tokens=12, temperatures=(0.0, 1.0), run=RunConfig(threads=1))
    return cfg, tiny_setup(systems, prompts)


def test_cpu_clock_keeps_the_split_fractions(harness):
    cfg, setup = harness
    records, _, _ = run(replace(cfg, clock="cpu"), setup, progress=False)
    tree = [r for r in records if r.system == "ours-tree"]
    assert all(r.seconds > 0 and r.draft_s + r.verify_s <= r.seconds * 1.001 for r in tree)


def test_harness_runs_every_system_and_greedy_is_identical(harness, tmp_path):
    cfg, setup = harness
    records, peaks, failed = run(cfg, setup, progress=False)
    assert not failed
    assert len(records) == 3 * 2 * 3
    assert {r.system for r in records} == {"ours-plain", "ours-chain3", "ours-tree"}
    assert all(r.new_tokens > 0 and r.seconds > 0 for r in records)
    ids = {i.system: i for i in identities(records)}
    for name in ("ours-chain3", "ours-tree"):
        assert ids[name].identical == ids[name].compared == 3, ids[name]
    spec = [r for r in records if r.system == "ours-tree"]
    assert all(r.tau >= 1.0 and r.accept_lens is not None and r.draft_s > 0 for r in spec)
    assert set(peaks.rss) == {"ours-plain", "ours-chain3", "ours-tree"}
    rows = summarize(records, setup.depths, {"rss": peaks.rss, "load_mb": {"ours": 100.0}})
    assert len(rows) == 6 and all(r.own_mb == pytest.approx(100.0) for r in rows)
    tree0 = next(r for r in rows if r.system == "ours-tree" and r.temperature == 0)
    assert len(tree0.acceptance) == 3 and tree0.speedup["ours-plain"].n == 3
    assert sum(tree0.split.values()) == pytest.approx(1.0, abs=0.05)
    text = table(rows)
    assert "ours-tree" in text and "x ours-plain" in text
    assert "T=0: tau" in tree_vs_chain_text(rows, records)
    save_json(tmp_path / "bench.json", {"m": 1}, rows, records, identities(records), {"x": None})
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert len(doc["records"]) == 18 and "tokens" not in doc["records"][0]
    plots = save_plots(tmp_path, rows, records)
    assert all(Path(p).stat().st_size > 1000 for p in plots)
    back = [Record.from_json(r) for r in doc["records"]]
    assert [(r.system, r.tokens_per_s) for r in back] == [(r.system, r.tokens_per_s) for r in records]


def test_sampled_runs_follow_the_prompt_seed(harness):
    cfg, setup = harness
    plain = setup.systems[0]
    p = setup.prompts[0]
    params = GenParams(1.0, 10, p.seed, (STOP,))
    assert plain.run(p, params).tokens == plain.run(p, params).tokens


def test_rotation_and_peer_failures_are_reported():
    assert rotate([1, 2, 3], 4) == [2, 3, 1]

    class Peer:
        name, family = "peer", "llama.cpp"

    class Ours:
        name, family = "ours-x", "ours"

    f = Failures()

    def boom():
        raise RuntimeError("binary crashed\nmore")
    assert f.call(Peer(), boom) is None and f.failed == {"peer": "RuntimeError: binary crashed"}
    assert f.call(Peer(), lambda: 1) is None        # a failed peer is not run again
    with pytest.raises(RuntimeError):
        f.call(Ours(), boom)


def test_context_len_checks_the_budget():
    prompts = [BenchPrompt(1, "c", "t", (1,) * 50, "t", 0)]
    assert context_len(BenchConfig(max_new_tokens=20), prompts) >= 70
    with pytest.raises(Exception, match="max-model-len"):
        context_len(BenchConfig(max_new_tokens=20, max_model_len=60), prompts)


def test_tune_ranks_shapes(harness):
    cfg, setup = harness
    rows = tune(cfg, setup, (SpecParams.chain(2), SpecParams(2, 3, 4, 0.0)), progress=False)
    assert len(rows) == 2 and rows[0].speedup >= rows[1].speedup
    assert all(r.tau >= 1.0 for r in rows)
    assert "best on this machine" in tune_text(rows)


def test_roofline_counts_what_a_forward_reads(one_thread):
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert read_bytes_per_forward(tied) == 10 * 4 * 4           # the embedding reads one row
    target = tiny_target()
    fp32 = read_bytes_per_forward(target)
    target = build_target(target, torch.bfloat16)
    linears = sum(m.weight.numel() for m in tiny_target().modules() if isinstance(m, torch.nn.Linear))
    assert read_bytes_per_forward(target) == fp32 - 2 * linears  # bf16 GEMM weights: half
    roof = measure(target, read_bytes_per_forward(target), context=8, mib=4)
    assert roof.forward_ms > 0 and roof.bound_ms > 0
    assert roof.ratio == pytest.approx(roof.forward_ms / roof.bound_ms)
    assert "memory bound" in roof.text()
    costs = verify_costs(target, (1, 4), context=8, reps=2)
    assert set(costs) == {1, 4} and all(ms > 0 for ms in costs.values())
    assert "4: " in costs_text(costs)


def hand_count_weight_bytes(vocab, hidden, intermediate, layers, heads, kv_heads, gemm_bytes):
    """One-token weight reads of an untied Llama, from its shape alone: per layer q, k, v, o
    (head_dim = hidden / heads) and gate, up, down at the GEMM dtype plus two fp32 norms; the
    final fp32 norm; the lm_head; the embedding reads one row (not counted)."""
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    return (layers * per_layer + vocab * hidden) * gemm_bytes + (2 * layers + 1) * hidden * 4


def kernels_vnni() -> bool:
    from eagle3 import kernels
    return kernels.integer_dots()


class Ticks:
    """A clock that moves `step_s` per reading: every timed interval is exactly one step."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_roofline_bound_from_hand_counted_bytes_and_a_ticking_clock(one_thread):
    shape = dict(vocab=48, hidden=32, intermediate=80, layers=3)
    for dtype, gemm_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        target = build_target(tiny_target(**shape), dtype)           # fused qkv / gate_up, packed
        want = hand_count_weight_bytes(**shape, heads=4, kv_heads=2, gemm_bytes=gemm_bytes)
        assert read_bytes_per_forward(target) == want, dtype
    # each copy, sum and forward takes one 2 ms tick; a 4 MiB copy reads and writes 8 MiB
    roof = measure(target, want, context=8, mib=4, clock=Ticks(2e-3))
    assert roof.copy_gb_s == pytest.approx(8 * 2**20 / 2e-3 / 1e9)
    assert roof.read_gb_s == pytest.approx(4 * 2**20 / 2e-3 / 1e9)
    assert roof.forward_ms == pytest.approx(2.0)
    assert roof.bound_ms == pytest.approx(1e3 * want * 2e-3 / (8 * 2**20))   # weights at copy speed
    assert roof.ratio == pytest.approx(8 * 2**20 / want)
    assert roof.ratio_read == pytest.approx(4 * 2**20 / want)
    assert roof.forward_p10_ms == pytest.approx(2.0) and roof.spread == 200
    assert "the tenth percentile of 200 forwards 2.00 ms" in roof.text()


def test_row_roof_counts_the_integer_dots_a_row_needs(one_thread, monkeypatch):  # noqa: F811
    """A row needs in x out / 64 vpdpbusd a linear; an extra row is priced between the two larger
    blocks; a layout without one-digit codes has no row roof."""
    from eagle3 import kernels
    from eagle3.bench.roofline import dots_per_row, measure_rows
    shape = dict(vocab=48, hidden=32, intermediate=80, layers=3)
    target = build_target(tiny_target(**shape), torch.bfloat16)
    head_dim = 32 // 4
    per_layer = 32 * head_dim * (2 * 4 + 2 * 2) + 3 * 32 * 80
    assert dots_per_row(target) == sum(-(-l.in_features * l.out_features // 64) for l in target.linears)
    assert 64 * dots_per_row(target) == 3 * per_layer + 48 * 32
    assert measure_rows(target) is None
    for lin in target.linears:
        lin.one_digit = True
    monkeypatch.setattr(kernels, "integer_dot_peak", lambda reps=0: 2e9)
    roof = measure_rows(target, rows=(1, 2, 4), context=8, clock=Ticks(2e-3))
    assert roof.bound_ms == pytest.approx(1e3 * dots_per_row(target) / 2e9)
    assert set(roof.forward_ms) == {1, 2, 4} and roof.extra_row_ms == pytest.approx(0.0)
    assert "integer-dot bound" in roof.text()
    from eagle3.bench.roofline import RowRoof
    priced = RowRoof(2.0, 1000, 0.5, {"1": 5.0, "8": 9.0, "16": 14.0}, 0.625)   # as read back from json
    assert "16 rows = 2.80x one row" in priced.text() and "1.25x the bound" in priced.text()


@pytest.mark.skipif(not kernels_vnni(), reason="no AVX512-VNNI kernels here")
def test_the_integer_dot_peak_is_measured_on_this_cpu():
    from eagle3 import kernels
    peak = kernels.integer_dot_peak(2_000_000)
    assert 1e8 < peak < 1e12


@pytest.mark.real
def test_bench_main_quick_on_the_real_model(tmp_path, capsys):
    from eagle3.bench import bench_main
    rc = bench_main(["--quick", "--prompts", "1", "--max-new-tokens", "4", "--draft", "none",
                     "--systems", "ours-plain,hf-generate", "--temperatures", "0",
                     "--no-plots", "--no-progress", "--no-roofline", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "ours-plain" in out and "hf-generate" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert {r["system"] for r in doc["records"]} == {"ours-plain", "hf-generate"}


def test_a_llama_cpp_binding_that_crashes_is_skipped_with_the_rebuild(monkeypatch, tmp_path):
    """The binding runs in our process: a segfault there (a native llama-cpp-python build's AMX
    kernels on Sapphire Rapids) took the whole bench run with it. A child generates first."""
    from eagle3.bench import llamacpp
    gguf = tmp_path / "m.gguf"
    monkeypatch.setattr(llamacpp, "SMOKE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    why = llamacpp.binding_crash(gguf, 2)
    assert why and "crashed generating from m.gguf (signal 11" in why and "GGML_NATIVE=OFF" in why
    monkeypatch.setattr(llamacpp, "SMOKE", "import diskcache_not_installed_here")   # not a crash of the build
    why = llamacpp.binding_crash(gguf, 2)
    assert why and "cannot import 'diskcache_not_installed_here'" in why and "GGML_NATIVE" not in why
    assert why.endswith("pip install diskcache_not_installed_here")
    monkeypatch.setattr(llamacpp, "SMOKE", "import sys; assert sys.argv[1:] == ['%s', '2']" % gguf)
    assert llamacpp.binding_crash(gguf, 2) is None
    monkeypatch.setattr(llamacpp, "binding_crash", lambda *a: "crashed")
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: object())
    systems, skipped = llamacpp.build_binding(gguf, 2, 64, 10)
    assert systems == [] and skipped == [("llama.cpp", "crashed"), ("llama.cpp-prompt-lookup", "crashed")]


def test_bench_serve_is_the_serving_bench_with_the_products_defaults(tmp_path):
    """`eagle3 bench serve`: the server's own weights default (GGUF codes), --max-batch 16, output
    under runs/; the bench command reaches it."""
    from eagle3.bench.cli import bench_main
    from eagle3.bench.serving import parse_args
    args = parse_args([])
    assert (args.weights, args.max_batch, args.out.parts[0]) == ("auto", [16], "runs")
    with pytest.raises(SystemExit, match="unknown"):
        bench_main(["serve", "--systems", "ours,sglang", "--out", str(tmp_path)])


def test_bench_serve_reverses_the_servers_order_every_other_round(monkeypatch):
    """Two identical plain servers, the second always after the first, read 1.01-1.05x apart in 7
    of 8 cells: each system runs a cell first in half the rounds."""
    from types import SimpleNamespace

    from eagle3.bench import serving
    order = []
    monkeypatch.setattr(serving, "warm_up", lambda *a: None)
    monkeypatch.setattr(serving, "reset_prefix_cache", lambda url: True)

    async def clients(url, prompts, n, tokens, temp):
        order.append(url)
        return [], 1.0
    monkeypatch.setattr(serving, "run_clients", clients)
    monkeypatch.setattr(serving, "summarize", lambda *a: a)
    monkeypatch.setattr(serving, "table", lambda rows: "\n")
    args = SimpleNamespace(rounds=3, temperatures=[0.0], clients=[4, 8], tokens=8)
    serving.bench_servers(args, [("ours", 16, "a"), ("ours-eagle3", 16, "b")], ["p"])
    assert order == ["a", "b", "a", "b", "b", "a", "b", "a", "a", "b", "a", "b"]

"""eagle3.config.RunConfig: one frozen configuration of a run, built from flags and environment in
one place, taken by load_engine (its one precision control)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from eagle3.config import REFERENCE, RunConfig, use
from eagle3.errors import InputError


def test_frozen_and_checked():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.weights = "bf16"
    with pytest.raises(InputError, match="weights='int4'"):
        RunConfig(weights="int4")
    with pytest.raises(InputError, match="draft_weights='gguf'"):
        RunConfig(draft_weights="gguf")
    with pytest.raises(InputError, match="threads=0"):
        RunConfig(threads=0)
    with pytest.raises(InputError, match="kv_cache_dtype='int8'"):
        RunConfig(kv_cache_dtype="int8")
    with pytest.raises(InputError, match="kv_cache_dtype='fp16' needs an inference layout"):
        RunConfig(weights=REFERENCE, kv_cache_dtype="fp16")


def test_the_defaults_are_todays(monkeypatch):
    for name in ("EAGLE3_KERNELS", "EAGLE3_VNNI", "EAGLE3_AMX", "EAGLE3_THREAD_GOVERNOR", "EAGLE3_REMEASURE"):
        monkeypatch.delenv(name, raising=False)
    cfg = RunConfig()
    assert (cfg.weights, cfg.draft_weights, cfg.device, cfg.threads) == ("auto", "auto", None, None)
    assert cfg.kernels and cfg.vnni and cfg.amx and cfg.thread_governor and not cfg.remeasure
    assert cfg.packed_target and cfg.packed_draft


def test_switches_default_to_the_environment_when_made(monkeypatch):
    monkeypatch.setenv("EAGLE3_KERNELS", "0")
    monkeypatch.setenv("EAGLE3_REMEASURE", "1")
    cfg = RunConfig()
    monkeypatch.delenv("EAGLE3_KERNELS")
    assert not cfg.kernels and cfg.remeasure                  # read once, when made
    assert cfg.switches["EAGLE3_KERNELS"] is False and RunConfig().kernels


def test_the_command_line_builds_it_in_one_place(monkeypatch):
    from eagle3.cli import build_parser
    from eagle3.cli_args import run_config_from_args
    monkeypatch.setenv("EAGLE3_AMX", "0")
    args = build_parser().parse_args(["generate", "hi", "--weights", "bf16", "--draft-weights", "q4",
                                      "--threads", "3", "--device", "cpu", "--kv-cache-dtype", "fp16"])
    cfg = run_config_from_args(args)
    assert (cfg.weights, cfg.draft_weights, cfg.threads, cfg.device, cfg.amx) == ("bf16", "q4", 3, "cpu", False)
    assert cfg.kv_cache_dtype == "fp16"
    defaults = run_config_from_args(build_parser().parse_args(["generate", "hi"]))
    assert dataclasses.replace(defaults, amx=True) == dataclasses.replace(RunConfig(), amx=True)


def test_serve_and_bench_take_the_same_flags():
    from eagle3.bench.cli import config_from, parse_args
    from eagle3.serve.cli import build_parser
    from eagle3.cli_args import run_config_from_args
    flags = ["--weights", "gguf-exact", "--draft-weights", "fp32", "--threads", "1", "--device", "cpu"]
    served = run_config_from_args(build_parser().parse_args(flags))
    bench = config_from(parse_args(flags))
    assert served == bench.run
    assert (bench.weights, bench.draft_weights, bench.threads, bench.device) == ("gguf-exact", "fp32", 1, "cpu")


def test_load_engine_runs_the_config(monkeypatch):
    """weights="reference" leaves the target's modules as loaded; a packed choice lays them out;
    the config's remeasure reaches the adaptive policy."""
    import types
    import eagle3.api as api
    import eagle3.layouts as layouts
    import eagle3.runtime.loader as loader
    from spec_helpers import StubTokenizer, tiny_target
    monkeypatch.setattr(loader, "resolve_model", lambda model: types.SimpleNamespace(gguf=None, name=model))
    monkeypatch.setattr(api, "load_target", lambda model, dev, dtype: (tiny_target(2, vocab=8), StubTokenizer()))
    asked = []
    monkeypatch.setattr(api, "adaptive_policy", lambda target, draft, remeasure: asked.append(remeasure))
    reference = api.load_engine("m", draft="suffix", config=RunConfig(weights=REFERENCE, remeasure=True))
    packed = api.load_engine("m", draft="none", config=RunConfig(weights="fp32"))
    assert type(reference.target).__name__ == "LlamaModel" and type(packed.target).__name__ != "LlamaModel"
    assert packed.target.kv_dtype == packed.target.backend.kv_dtype     # fp32 weights: a full cache
    half = api.load_engine("m", draft="none", config=RunConfig(weights="fp32", kv_cache_dtype="fp16"))
    assert half.target.kv_dtype == torch.float16 and half.cache.k.dtype == torch.float16
    # a target the layout does not cover keeps its own cache: asking for another is an error
    from eagle3.errors import InputError
    with pytest.raises(InputError, match="kv_cache_dtype='fp16' needs the inference layout"):
        layouts.build_layouts(object(), None, "fp32", kv_cache_dtype="fp16")
    assert asked == [True]


def test_use_sets_the_threads_and_the_switches_that_differ(monkeypatch):
    import torch
    monkeypatch.setenv("EAGLE3_THREAD_GOVERNOR", "1")
    before = torch.get_num_threads()
    try:
        use(RunConfig(threads=1, thread_governor=False))
        assert torch.get_num_threads() == 1
        import os
        assert os.environ["EAGLE3_THREAD_GOVERNOR"] == "0"
        from eagle3.threads import governor_enabled
        assert not governor_enabled()
    finally:
        torch.set_num_threads(before)


def test_turning_off_kernels_in_use_is_an_error(monkeypatch):
    from eagle3 import kernels
    monkeypatch.setenv("EAGLE3_KERNELS", "1")
    if kernels.state().module is None:
        pytest.skip(f"no kernels here: {kernels.why()}")
    with pytest.raises(InputError, match="already runs them"):
        use(RunConfig(kernels=False))


def test_a_draft_name_means_the_same_to_the_api_the_doctor_and_the_bench(tmp_path):
    """draft.names.resolve_draft_name reads every draft name; the doctor and the bench ask it."""
    from eagle3.bench.runner import BenchConfig, resolve_draft as bench_draft
    from eagle3.doctor.cli import resolve_draft as doctor_draft
    from eagle3.draft.names import DEFAULT_DRAFT, resolve_draft_name
    assert resolve_draft_name("none", None) == (None, False, "--draft none")
    assert resolve_draft_name(None, None).path is None
    assert resolve_draft_name("suffix", None)[:2] == (None, True)
    assert resolve_draft_name("default", "some.gguf")[:2] == (None, True)      # no shipped draft for it
    assert resolve_draft_name(str(tmp_path), None)[:2] == (tmp_path, False)
    if (DEFAULT_DRAFT / "config.json").is_file():
        assert resolve_draft_name("default", None).path == DEFAULT_DRAFT
    for name in ("none", "suffix", "default", str(tmp_path)):
        for model in (None, "some.gguf"):
            choice = resolve_draft_name(name, model)
            want = None if choice.path is None else str(choice.path)
            assert doctor_draft(name, model) == want
            assert bench_draft(BenchConfig(model=model, draft=name)) == (want, choice.reason)

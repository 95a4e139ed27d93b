"""`eagle3 doctor`: is this draft the right one for this target, and will this launch line work?

Order of the checks (each a Check with pass/warn/fail, message and fix):

| group    | what                                                                                |
|----------|-------------------------------------------------------------------------------------|
| target   | loads (native LlamaModel or the generic HF adapter); layers, hidden, vocab          |
| draft    | format, algorithm, layer-id convention found, embedding source (draft/formats.py)    |
| contract | hidden sizes, fc width, ids in range, vocab + d2t/t2d, rope/head_dim (draft/contract)|
| launch   | the SGLang / vLLM / llama.cpp line, against the facts above (doctor/launch.py)      |
| probe    | a few prompts through the speculative engine: tau, acceptance per position, equal   |
|          | greedy output with and without the draft; tau near 1.0 fails with likely causes,    |
|          | and ids shifted by one are tried to name an off-by-one                               |
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from ..engines import NESTED_OUTPUT, TOP_INPUT
from ..errors import ContractError, Eagle3Error
from .launch import DraftFacts, TargetFacts, lint_launch, read_json
from . import silent
from .report import Check, DoctorReport, failed, from_error, passed, warned

PROBE_PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that reverses a string.",
    "List three tips for staying focused while studying.",
)
CAUSES = ("likely causes: wrong aux layer ids (the 'input to layer i' vs 'output of layer i' "
          "off-by-one), the wrong algorithm (an EAGLE-3 draft run as EAGLE), a d2t rebuilt or "
          "reordered after training, a draft trained for another target or tokenizer, or draft "
          "weights lost or never trained (random)")


@dataclass(frozen=True)
class ProbeSettings:
    prompts: tuple[str, ...] = PROBE_PROMPTS
    max_new_tokens: int = 32
    top_k: int = 4
    depth: int = 5
    num_draft_tokens: int = 8
    fail_tau: float = 1.1     # tau <= this: nothing (or almost nothing) is accepted
    warn_tau: float = 1.3
    try_shifted_ids: bool = True


@dataclass
class Pair:
    """What the doctor has loaded so far (None where loading failed)."""
    target: Any = None
    tokenizer: Any = None
    target_path: Optional[str] = None
    draft: Any = None
    info: Any = None
    draft_config: Optional[dict] = None


# ---------------------------------------------------------------------------- target
def load_target_checked(target: Any, report: DoctorReport) -> Pair:
    """Accept a loaded model (tests) or a spec string (CLI: path, .gguf, None = packaged)."""
    if target is not None and not isinstance(target, (str, Path)):
        pair = Pair(target=target)
    else:
        try:
            pair = _load_target(None if target is None else str(target))
        except Eagle3Error as e:
            report.checks.append(failed("target.load", str(e), "give --model a local HF "
                                        "directory (config.json + safetensors) or a .gguf file"))
            return Pair()
    cfg = pair.target.config
    kind = type(pair.target).__name__
    how = "native model" if kind == "LlamaModel" else "generic HF adapter"
    report.checks.append(passed("target.load", f"{cfg.architecture} via {how} ({kind}): "
                                f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
                                f"{cfg.vocab_size}, default ids {list(cfg.default_aux_layer_ids)}"))
    report.facts["target"] = {"path": pair.target_path, "class": kind, "architecture":
                              cfg.architecture, "num_layers": cfg.num_layers,
                              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    return pair


def _load_target(spec: Optional[str]) -> Pair:
    from ..adapters import load_target
    from ..runtime.loader import load_tokenizer, resolve_model
    src = resolve_model(spec)
    target = load_target(str(src.hf_dir))
    try:
        tokenizer = load_tokenizer(src.hf_dir)
    except (OSError, ValueError):
        tokenizer = None   # the probe then uses fixed random token prompts
    return Pair(target=target, tokenizer=tokenizer, target_path=str(src.gguf or src.hf_dir))


# ---------------------------------------------------------------------------- draft
def load_draft_checked(pair: Pair, draft_path: Optional[str], algorithm: Optional[str],
                       report: DoctorReport) -> None:
    if draft_path is None:
        report.checks.append(failed("draft.path", "no draft given and no shipped draft for this "
                                    "target", "pass --draft DRAFT_DIR"))
        return
    from ..draft.formats import load_draft
    pair.draft_config = read_json(Path(draft_path) / "config.json")
    try:
        loaded = load_draft(draft_path, pair.target.config if pair.target is not None else None,
                            algorithm=algorithm)
    except ContractError as e:
        report.checks.append(from_error("draft.algorithm" if e.field == "algorithm" else "draft.load", e))
        return
    except Eagle3Error as e:
        report.checks.append(silent.check_missing_d2t(pair.draft_config) if "d2t" in str(e) else
                             failed("draft.load", str(e), "see the message; `eagle3 export` "
                                    "writes drafts every engine reads"))
        return
    pair.draft, pair.info = loaded.draft, loaded.info
    report.checks += describe_draft(loaded.info)
    report.facts["draft"] = {"path": draft_path, "format": loaded.info.format,
                             "algorithm": loaded.info.algorithm,
                             "aux_layer_ids": list(loaded.info.aux_layer_ids),
                             "layer_id_convention": loaded.info.layer_id_convention,
                             "draft_vocab_size": loaded.info.draft_vocab_size}
    if pair.target is not None:
        attach(pair, loaded, report)


def describe_draft(info: Any) -> list[Check]:
    algo = "EAGLE-3" if info.algorithm == "eagle3" else "EAGLE-1/2"
    out = [passed("draft.format", f"{info.format} layout ({info.architecture}), weights "
                                  f"{info.weights_file}"),
           passed("draft.algorithm", f"{algo}: {info.algorithm_evidence}")]
    if info.algorithm == "eagle3":
        out.append(passed("draft.layer_ids", f"{list(info.aux_layer_ids)} as 'input to layer i' "
                                             f"(convention found: {info.layer_id_convention}; "
                                             f"{info.layer_id_source})"))
    out.append(passed("draft.embedding", f"embedding from the {info.embedding_source}, lm_head "
                                         f"from the {info.lm_head_source}"))
    out += [warned("draft.note", note, "check which layers the draft was trained on")
            for note in info.notes if "convention" in note or "defaults" in note]
    return out


def attach(pair: Pair, loaded: Any, report: DoctorReport) -> None:
    from ..draft.formats import attach_target
    try:
        attached = attach_target(loaded, pair.target)
    except ContractError as e:
        report.checks.append(from_error("contract.embedding", e))
        return
    pair.draft, pair.info = attached.draft, attached.info


# ---------------------------------------------------------------------------- contract
def contract_checks(pair: Pair) -> list[Check]:
    """draft/contract.py's checks, named under contract.*."""
    from ..draft.contract import run_checks
    checks = run_checks(pair.target.config, pair.draft, target=pair.target, info=pair.info)
    out = [replace(c, name=f"contract.{c.name.replace(' ', '_')}") for c in checks
           if c.name != "embedding" or pair.info.embedding_attached]   # else reported by attach()
    return out + silent.check_d2t_rows(pair.draft, pair.target) + \
        silent.check_pair_template(pair.draft_config, pair.tokenizer)


# ---------------------------------------------------------------------------- launch
def launch_facts(pair: Pair) -> tuple[Optional[DraftFacts], Optional[TargetFacts]]:
    draft = None
    if pair.info is not None:
        i = pair.info
        cfg = getattr(pair.draft, "config", None)
        draft = DraftFacts(i.algorithm, tuple(i.aux_layer_ids), i.vocab_size, i.draft_vocab_size,
                           pair.draft_config or {}, i.path, bool(getattr(cfg, "norm_before_fc", False)),
                           bool(getattr(cfg, "norm_output", False)))
    target = None if pair.target is None else TargetFacts.of(pair.target.config, pair.target_path)
    return draft, target


# ---------------------------------------------------------------------------- probe
@dataclass(frozen=True)
class ProbeResult:
    tau: float
    acceptance_per_position: list[float]
    lossless: bool
    spec_tokens_per_s: float
    plain_tokens_per_s: float
    steps: int


class IdTokenizer:
    """Stands in for a tokenizer when the target has none (tiny test targets): ids as text."""
    eos_token_id = None
    chat_template = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def probe_prompts(pair: Pair, settings: ProbeSettings) -> list[list[int]]:
    if pair.tokenizer is not None:
        from ..generate.text import encode_prompt
        return [encode_prompt(pair.tokenizer, p, None, True) for p in settings.prompts]
    vocab = pair.target.config.vocab_size   # tiny test targets have no tokenizer
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (8,), generator=g).tolist() for _ in settings.prompts]


def run_probe(pair: Pair, draft: Any, settings: ProbeSettings, plain: bool = True) -> ProbeResult:
    """Greedy generation of each probe prompt with the draft (and without, when `plain`)."""
    from ..generate import Engine, SamplingParams
    from ..speculative.step import acceptance_stats
    from ..speculative.tree import SpecParams
    spec = SpecParams(settings.top_k, settings.depth, settings.num_draft_tokens)
    prompts = probe_prompts(pair, settings)
    max_len = max(len(p) for p in prompts) + settings.max_new_tokens + 1
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, ignore_eos=True)
    tokenizer = pair.tokenizer or IdTokenizer()
    spec_engine = Engine(pair.target, tokenizer, draft=draft, spec=spec, max_model_len=max_len)
    plain_engine = Engine(pair.target, tokenizer, max_model_len=max_len) if plain else None
    with quiet_monitor():   # the doctor reports low acceptance itself
        spec_runs = [spec_engine.generate(prompt_ids=p, params=params) for p in prompts]
        plain_runs = [plain_engine.generate(prompt_ids=p, params=params) for p in prompts] \
            if plain else []
    steps = [s for r in spec_runs for s in r.decode_steps]
    stats = acceptance_stats([s.accepted for s in steps], settings.depth)
    tokens = sum(len(r.token_ids) for r in spec_runs)
    spec_s, plain_s = sum(r.wall_s for r in spec_runs), sum(r.wall_s for r in plain_runs)
    return ProbeResult(stats.tau, stats.per_position,
                       all(r.token_ids == p.token_ids
                           for r, p in zip(spec_runs, plain_runs, strict=True)) if plain else True,
                       tokens / spec_s if spec_s else 0.0, tokens / plain_s if plain_s else 0.0,
                       len(steps))


@contextlib.contextmanager
def quiet_monitor() -> Iterator[None]:
    log = logging.getLogger("eagle3.speculative")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def probe_checks(pair: Pair, settings: ProbeSettings, report: DoctorReport) -> None:
    result = run_probe(pair, pair.draft, settings)
    acc = ", ".join(f"{a:.2f}" for a in result.acceptance_per_position)
    report.probe = {"tau": result.tau, "acceptance_per_position": result.acceptance_per_position,
                    "lossless": result.lossless, "steps": result.steps,
                    "spec_tokens_per_s": result.spec_tokens_per_s,
                    "plain_tokens_per_s": result.plain_tokens_per_s,
                    "tree": [settings.top_k, settings.depth, settings.num_draft_tokens]}
    what = (f"tau {result.tau:.2f} over {result.steps} steps of {len(settings.prompts)} prompts "
            f"(tree top_k {settings.top_k}, depth {settings.depth}, {settings.num_draft_tokens} "
            f"tokens); acceptance per position [{acc}]; {result.spec_tokens_per_s:.1f} tok/s vs "
            f"{result.plain_tokens_per_s:.1f} plain")
    if result.tau <= settings.fail_tau:
        hint = shift_hint(pair, settings, result.tau)
        report.checks.append(replace(failed("probe.tau", f"{what}: the draft is (almost) never "
                                            "accepted", hint or CAUSES),
                                     catalog="aux-layer-ids" if hint else None))
    elif result.tau < settings.warn_tau:
        report.checks.append(warned("probe.tau", f"{what}: low acceptance", CAUSES))
    else:
        report.checks.append(passed("probe.tau", what))
    report.checks.append(passed("probe.lossless", "greedy output identical with and without the "
                                "draft") if result.lossless else
                         failed("probe.lossless", "greedy output differs with the draft",
                                "a verification bug: report it with this target and draft"))


def shift_hint(pair: Pair, settings: ProbeSettings, tau: float) -> Optional[str]:
    """Re-run the probe with every aux id moved by -1 and +1: a recovery names the off-by-one."""
    cfg = pair.draft.config
    if not settings.try_shifted_ids or cfg.algorithm != "eagle3":
        return None
    n = pair.target.config.num_layers
    best = None
    for delta in (-1, 1):
        ids = tuple(i + delta for i in cfg.aux_layer_ids)
        if not all(0 <= i < n for i in ids):
            continue
        quick = replace(settings, prompts=settings.prompts[:2],
                        max_new_tokens=min(settings.max_new_tokens, 24))
        shifted_tau = run_probe(pair, shifted_draft(pair.draft, ids), quick, plain=False).tau
        if shifted_tau > max(settings.warn_tau, tau + 0.3) and (best is None or shifted_tau > best[1]):
            best = (ids, shifted_tau)
    if best is None:
        return None
    return (f"with layer ids {list(best[0])} instead of {list(cfg.aux_layer_ids)} tau rises to "
            f"{best[1]:.2f}: the stored ids are in the other convention. Store "
            f"{NESTED_OUTPUT.label} = {NESTED_OUTPUT.as_stored(best[0])} (output convention) and "
            f"{TOP_INPUT.label} = {TOP_INPUT.as_stored(best[0])} (input convention)")


def shifted_draft(draft: Any, ids: tuple[int, ...]) -> Any:
    from ..draft.model import build_draft
    other = build_draft(replace(draft.config, aux_layer_ids=ids))
    other.load_state_dict(draft.state_dict())
    other.set_embedding(draft.embed_tokens.weight)
    return other.to(draft.fc.weight.device).eval()


# ---------------------------------------------------------------------------- quantized draft
FP8_MAX = 448.0       # float8_e4m3fn's largest finite value


def fp8_draft(draft: Any) -> Any:
    """A copy of the draft whose matrices (fc, the layer, lm_head) are rounded through FP8 e4m3
    with one scale per row, as an FP8 serving engine stores them; the shared embedding stays."""
    from ..draft.model import build_draft
    other = build_draft(draft.config)
    other.load_state_dict(draft.state_dict())
    with torch.no_grad():
        for name, p in other.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                scale = p.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
                p.copy_((p / scale).to(torch.float8_e4m3fn).to(p.dtype) * scale)
    other.set_embedding(draft.embed_tokens.weight)
    return other.to(draft.fc.weight.device).eval()


def quantized_probe(pair: Pair, settings: ProbeSettings, report: DoctorReport, method: str) -> None:
    """The launch line serves the draft quantized: the probe again with the draft rounded to FP8,
    against the unquantized draft's tau."""
    base = report.probe["tau"]
    quick = replace(settings, try_shifted_ids=False)
    tau = run_probe(pair, fp8_draft(pair.draft), quick, plain=False).tau
    report.probe["quantized"] = {"method": method, "tau": tau}
    what = f"tau {tau:.2f} with the draft rounded to FP8 ({method} on the line) vs {base:.2f} unquantized"
    if tau <= settings.fail_tau < base or (base - 1 > 0.2 and tau - 1 < 0.6 * (base - 1)):
        report.checks.append(silent.field_check(
            "probe.quantized", "fail", "draft tau quantized", round(tau, 2), f"about {base:.2f}",
            f"{what}: quantizing the draft loses its acceptance",
            "serve the draft unquantized (drop the draft quantization flag); quantize the target only"))
    else:
        report.checks.append(passed("probe.quantized", what))


# ---------------------------------------------------------------------------- entry point
def run_doctor(target: Any = None, draft: Optional[str | Path] = None,
               launch: Optional[str | Sequence[str]] = None, probe: bool = True,
               algorithm: Optional[str] = None, tokenizer: Any = None,
               settings: ProbeSettings = ProbeSettings(),
               versions: Optional[dict[str, str]] = None) -> DoctorReport:
    """Check a target/draft pair (and optionally launch lines); never raises for a failed check.

    target: a loaded target (LlamaModel / HFTarget), or a spec (None = packaged SmolLM2, a .gguf,
    an HF directory). draft: a draft directory. launch: one or more command lines to lint.
    versions: engine name -> release, for the launch checks that depend on it.
    """
    report = DoctorReport()
    pair = load_target_checked(target, report)
    pair.tokenizer = pair.tokenizer or tokenizer
    load_draft_checked(pair, None if draft is None else str(draft), algorithm, report)
    if pair.draft is not None and pair.target is not None:
        report.checks += contract_checks(pair)
    for line in [launch] if isinstance(launch, str) else list(launch or []):
        report.checks += lint_launch(line, *launch_facts(pair), versions=versions)
    contract_ok = not any(c.name.startswith(("contract.", "draft.")) for c in report.failures)
    if probe and pair.draft is not None and pair.info.embedding_attached and contract_ok:
        probe_checks(pair, settings, report)
        quantized = [c for c in report.checks if c.name.endswith(".draft_quantization")]
        if quantized and report.probe:
            quantized_probe(pair, settings, report, str(quantized[0].found))
    elif probe and pair.draft is not None:
        report.checks.append(warned("probe.tau", "probe skipped: the pair breaks the contract "
                                    "(see the failures above)", "fix those first"))
    return report

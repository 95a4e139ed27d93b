"""The field's silent failures: one table of what users of SGLang, vLLM, SpecForge and speculators
hit (speculation runs, answers are right, and acceptance has quietly collapsed or a setting is
quietly ignored), where the doctor catches each, and the public thread it comes from.

Each row names the doctor checks that report it (patterns over `Check.name`, or `name:field` for a
check that compares several fields), so every finding in `eagle3 doctor --json` carries its row's
id; `eagle3 doctor --list-checks` prints the table and docs/silent-failures.md is generated from it
(`markdown()`, command in HEADER; a test keeps the two equal).

Severity: `error` (exit 1) for what loses acceptance or silently ignores a setting, `warning` for
what is only slower (`--strict` fails on those too).
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional

from ..checks import Check

PAIR, LAUNCH, PROBE, SERVER = "pair check", "launch lint", "live probe", "server"
ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Failure:
    id: str
    symptom: str
    caught: tuple[str, ...]        # PAIR | LAUNCH | PROBE | SERVER
    severity: str                  # ERROR | WARNING
    checks: tuple[str, ...]        # check-name patterns (fnmatch), or "name:field"
    source: str                    # the public thread(s)
    test: str                      # tests/test_doctor_catalog.py: the row rebuilt small


CATALOG: tuple[Failure, ...] = (
    Failure("d2t-missing",
            "a reduced draft vocabulary shipped without its d2t map: the engine reads draft ids as "
            "the first N target ids, acceptance collapses, no error",
            (PAIR,), ERROR, ("draft.d2t",),
            "NVIDIA-NeMo/Automodel#2447; verl-SpeCo#66", "test_d2t_missing"),
    Failure("d2t-rebuilt",
            "d2t rebuilt or reordered when fine-tuning from a checkpoint: lm_head rows no longer "
            "belong to the tokens they are mapped to",
            (PAIR, PROBE), ERROR, ("contract.d2t_rows",),
            "sgl-project/SpecForge#534", "test_d2t_permuted"),
    Failure("draft-context",
            "the draft's max_position_embeddings is shorter than the served context "
            "(--context-length / --max-model-len): past it, speculation costs more than it gives",
            (LAUNCH, PAIR), ERROR,
            ("launch.*.context_length", "contract.attention:max_position_embeddings"),
            "sgl-project/sglang#6783; NVIDIA-NeMo/RL#3960", "test_draft_context"),
    Failure("vllm-disable-by-batch-size",
            "vLLM speculative_config.disable_by_batch_size: a no-op since v0.10.0 (the V0 engine's "
            "removal), then removed; speculation is never switched off at large batches",
            (LAUNCH,), ERROR, ("launch.vllm.disable_by_batch_size",),
            "vllm-project/vllm#35060, #25112", "test_vllm_disable_by_batch_size"),
    Failure("vllm-draft-max-model-len",
            "vLLM speculative_config.max_model_len: accepted, but the V1 engine never skips "
            "speculation past it (observed on 0.26.0)",
            (LAUNCH,), ERROR, ("launch.vllm.draft_max_model_len",),
            "vllm-project/vllm#52258", "test_vllm_draft_max_model_len"),
    Failure("sglang-token-map",
            "SGLang --speculative-token-map with EAGLE3: ignored, one log line at start-up (it "
            "reduces an EAGLE-2 draft's vocabulary only)",
            (LAUNCH,), ERROR, ("launch.sglang.token_map",),
            "sgl-project/sglang eagle worker init_token_map; suggested for an EAGLE3 draft in "
            "sgl-project/sglang#6783", "test_sglang_token_map"),
    Failure("no-draft-path",
            "EAGLE3 launched without a draft path (SGLang --speculative-draft-model-path, vLLM "
            "\"model\" in --speculative-config)",
            (LAUNCH,), ERROR, ("launch.*.draft_path",),
            "sgl-project/sglang#36593", "test_no_draft_path"),
    Failure("draft-weights-lost",
            "draft weights lost after an RL weight update or a memory release (or a random draft): "
            "accept length ~1.0, no error; an adaptive server stops asking the draft and looks healthy",
            (SERVER, PROBE), ERROR, ("server.draft", "server.tau", "probe.tau"),
            "sgl-project/sglang#31674", "test_draft_weights_lost"),
    Failure("chat-template",
            "the chat template at serving differs from the one the draft was trained with "
            "(Qwen3 thinking): acceptance drops, no error",
            (PAIR, LAUNCH), ERROR, ("draft.chat_template", "launch.*.chat_template"),
            "sgl-project/SpecForge#296", "test_chat_template"),
    Failure("quantized-draft",
            "a quantized (FP8) draft accepting nothing: the probe runs the draft rounded to FP8 "
            "against the unquantized one",
            (LAUNCH, PROBE), ERROR, ("launch.*.draft_quantization", "probe.quantized"),
            "vllm-project/llm-compressor#1843", "test_quantized_draft"),
    Failure("aux-layer-ids",
            "aux layer ids hard-coded or one off ('input to layer i' vs 'output of layer i')",
            (PAIR, LAUNCH, PROBE), ERROR,
            ("launch.*.layer_ids", "contract.layer_ids", "contract.fc_width"),
            "lightseekorg/tokenspeed#526", "test_aux_layer_ids"),
    Failure("eagle-vs-eagle3",
            "an EAGLE-3 draft served as EAGLE: one hidden state instead of the fused layers, zero "
            "acceptance, no error",
            (PAIR, LAUNCH), ERROR,
            ("launch.sglang.algorithm", "launch.vllm.method", "launch.llama.cpp.spec_type",
             "contract.algorithm", "draft.algorithm"),
            "sgl-project/sglang#21272; this project's own story", "test_eagle_vs_eagle3"),
    Failure("sglang-overlap-eagle3",
            "slower, not broken: SGLang EAGLE-3 with the overlap scheduler (SGLANG_ENABLE_SPEC_V2=1) "
            "ran slower than without it (reported on 0.5.4, Oct 2025)",
            (LAUNCH,), WARNING, ("launch.sglang.overlap_schedule",),
            "sgl-project/sglang#12411", "test_sglang_overlap"),
    Failure("sampled-argmax-draft",
            "slower, not broken: sampled requests on an engine whose draft proposes by argmax accept "
            "far less than greedy ones",
            (SERVER,), WARNING, ("server.sampled_acceptance",),
            "vllm-project/vllm#16899 (V1 drafts by argmax at any temperature)", "test_sampled_argmax"),
)
BY_ID = {f.id: f for f in CATALOG}


def _matches(pattern: str, check: Check) -> bool:
    name, _, field = pattern.partition(":")
    return fnmatchcase(check.name, name) and (not field or check.field == field)


def catalog_id(check: Check) -> Optional[str]:
    """The catalog row a check reports: its own `catalog` when set, else the first row whose
    patterns match its name (and field)."""
    if check.catalog:
        return check.catalog
    for row in CATALOG:
        if any(_matches(p, check) for p in row.checks):
            return row.id
    return None


def listing() -> str:
    """`eagle3 doctor --list-checks`: one block per row."""
    out = []
    for f in CATALOG:
        out += [f"{f.id}  [{f.severity}; {', '.join(f.caught)}]", f"    {f.symptom}",
                f"    checks: {', '.join(f.checks)}", f"    source: {f.source}", ""]
    return "\n".join(out).rstrip() + "\n"


HEADER = """# Silent failures the doctor knows

Generated from `eagle3/doctor/catalog.py`; `tests/test_doctor_catalog.py` keeps the two equal:

    python -c "from eagle3.doctor.catalog import markdown; print(markdown(), end='')" \\
        > docs/silent-failures.md

Each row is a failure users of SGLang, vLLM, SpecForge and speculators have reported: speculation
runs, answers are right, and acceptance has quietly collapsed or a setting is quietly ignored. Each
is rebuilt small in `tests/test_doctor_catalog.py` (the named test), where the doctor names the
field, both values and the fix, and the good case passes.

- Where caught: *pair check* (`eagle3 doctor --draft D --model T`), *launch lint* (`--launch LINE`,
  with `--engine-version ENGINE=X` where the release matters), *live probe* (our engine on the pair),
  *server* (`--server URL`).
- Severity: `error` exits 1 (acceptance lost or a setting silently ignored); `warning` is only
  slower, and exits 1 with `--strict`. `--json` gives each finding its row's id as `catalog`;
  `--list-checks` prints this table.

| id | symptom | where caught | severity | checks | source | test |
|---|---|---|---|---|---|---|
"""


def markdown() -> str:
    rows = [f"| `{f.id}` | {f.symptom} | {', '.join(f.caught)} | {f.severity} | "
            f"{', '.join(f'`{c}`' for c in f.checks)} | {f.source} | `{f.test}` |" for f in CATALOG]
    return HEADER + "\n".join(rows) + "\n"

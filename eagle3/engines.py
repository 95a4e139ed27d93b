"""Serving engines and draft layouts: where each reads an EAGLE-3 draft's layer ids, in which numbering,
and how it is told to run the draft. One table: the loader (draft/formats.py), the exporter
(export/writer.py) and the launch linter (doctor/launch.py) read it; nothing else spells out an
engine's convention.

Numbering: "input" = id i names the residual stream ENTERING layer i (= HF output_hidden_states[i]; what
this project, vLLM and llama.cpp capture for id i); "output" = id i names the output of layer i, i.e.
input id - 1 (SpecForge's eagle_config; SGLang adds 1 before capturing).

| engine     | loads layouts             | reads ids (first list found wins)                 | none found   |
|------------|---------------------------|---------------------------------------------------|--------------|
| SGLang     | specforge, eagle          | eagle_config (output, +1), then top-level (output,| defaults     |
|            |                           | +1); older releases read eagle_config only        |              |
| vLLM       | speculators, vllm,        | top-level (input), then eagle_config taken RAW as | defaults     |
| 0.32-0.33  | specforge, eagle          | input (no +1: a SpecForge list runs one layer     |              |
|            |                           | early); older releases read top-level only        |              |
| llama.cpp  | specforge, vllm, eagle    | top-level (input), read once by                   | defaults     |
|            | (convert_hf_to_gguf.py)   | convert_hf_to_gguf.py into eagle3.target_layers   |              |
| EAGLE ref. | eagle                     | nothing                                           | defaults     |

"defaults" = 2, L//2, L-3 for a target of L layers (models.config.default_capture_ids). SGLang and
llama.cpp serve exactly 3 captured layers; vLLM any count.

| layout      | config.json marker (architectures[0])   | layer prefix | ids stored (numbering)           |
|-------------|-----------------------------------------|--------------|----------------------------------|
| eagle       | LlamaForCausalLM, 1 layer               | midlayer.    | nowhere (the defaults)           |
| specforge   | LlamaForCausalLMEagle3 or eagle_config  | midlayer.    | eagle_config (output) + our      |
|             |                                         |              | export: top-level (input) always |
| vllm        | Eagle3LlamaForCausalLM                  | either       | top-level (input)                |
| speculators | Eagle3Speculator, speculators_model_type| layers.0.    | top-level (input)                |

A running server (`LIVE`, read by `eagle3 doctor --server`):

| engine       | identity                        | speculation                                          |
|--------------|---------------------------------|------------------------------------------------------|
| vLLM 0.32    | /version {"version"}            | /metrics counters vllm:spec_decode_num_drafts, _num_draft_tokens, |
|              |                                 | _num_accepted_tokens, _per_pos{position = 0-based}; none without |
|              |                                 | --speculative-config                                 |
| SGLang 0.5.3 | /server_info (newer) or         | internal_states[].avg_spec_accept_length in that JSON (tokens per |
|              | /get_server_info: server args   | verify since start, absent before the first); gauge  |
|              | (speculative_*), "version"      | sglang:spec_accept_length with --enable-metrics      |
| eagle3 serve | /health {"speculative", "spec"} | /metrics counters eagle3:spec_decode_*, position 1-based; |
|              | {"draft"}: its own acceptance   | the draft's own steps apart from suffix-only blocks:  |
|              |                                 | eagle3:spec_decode_draft_steps, _draft_accepted_tokens|

Sources: vllm-project/vllm vllm/v1/spec_decode/metrics.py (SpecDecodingProm); sgl-project/sglang
srt/entrypoints/http_server.py (get_server_info), srt/managers/scheduler.py (get_internal_state),
srt/metrics/collector.py; sgl-project/sglang eagle worker + set_eagle3_layers_to_capture (+1); vllm-project/vllm
config/speculative.py (method detection), gpu_model_runner aux-layer lookup, transformers_utils/config.py
maybe_override_with_speculators; llama.cpp conversion/llama.py and src/models/eagle3.cpp (as vendored
in llama-cpp-python 0.3.36); SafeAILab/EAGLE eagle/model/cnets.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from .errors import LoadError

IDS_KEY = "eagle_aux_hidden_state_layer_ids"
NESTED_KEY = "eagle_config"
INPUT, OUTPUT = "input", "output"


# ---------------------------------------------------------------------------- where ids are stored
@dataclass(frozen=True)
class IdsSlot:
    """One place in a draft's config.json that holds layer ids, and the numbering a reader gives it."""
    nested: bool          # inside eagle_config (else at the top level)
    numbering: str        # INPUT | OUTPUT

    @property
    def label(self) -> str:
        return f"{NESTED_KEY}.{IDS_KEY}" if self.nested else f"top-level {IDS_KEY}"

    @property
    def meaning(self) -> str:
        return "input to layer i" if self.numbering == INPUT else "output of layer i"

    @property
    def shift(self) -> int:
        """Added to a stored id to get the input id."""
        return 1 if self.numbering == OUTPUT else 0

    def stored(self, config: dict) -> Optional[tuple[int, ...]]:
        """The list as written (None when absent or empty); anything but a list of ints raises."""
        container = (config.get(NESTED_KEY) or {}) if self.nested else config
        ids = container.get(IDS_KEY)
        if ids in (None, []):
            return None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
            raise LoadError(f"{self.label}: expected a list of ints, found {ids!r}")
        return tuple(ids)

    def as_input(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i + self.shift for i in stored)

    def as_stored(self, input_ids: tuple[int, ...]) -> list[int]:
        return [i - self.shift for i in input_ids]

    def write(self, config: dict, input_ids: tuple[int, ...]) -> None:
        container = config.setdefault(NESTED_KEY, {}) if self.nested else config
        container[IDS_KEY] = self.as_stored(input_ids)


TOP_INPUT = IdsSlot(nested=False, numbering=INPUT)
TOP_OUTPUT = IdsSlot(nested=False, numbering=OUTPUT)
NESTED_INPUT = IdsSlot(nested=True, numbering=INPUT)
NESTED_OUTPUT = IdsSlot(nested=True, numbering=OUTPUT)


# ---------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    name: str
    architecture: str                  # architectures[0] our writer puts in config.json
    layer_prefix: str                  # the draft layer's weight prefix as written
    writes: tuple[IdsSlot, ...]        # where our writer stores the ids (every engine serving it reads one)


LAYOUTS: dict[str, Layout] = {
    # the EAGLE reference hard-codes the default ids: the layout cannot record others
    "eagle": Layout("eagle", "LlamaForCausalLM", "midlayer.", ()),
    # eagle_config for SGLang; top-level for vLLM (which would read a lone eagle_config raw, one layer
    # early) and llama.cpp (which drops eagle_config). SGLang reads eagle_config first, so both agree.
    "specforge": Layout("specforge", "LlamaForCausalLMEagle3", "midlayer.", (NESTED_OUTPUT, TOP_INPUT)),
    "vllm": Layout("vllm", "Eagle3LlamaForCausalLM", "midlayer.", (TOP_INPUT,)),
    "speculators": Layout("speculators", "Eagle3Speculator", "layers.0.", (TOP_INPUT,)),
}
EAGLE3_ARCHITECTURES = {layout.architecture: name for name, layout in LAYOUTS.items() if name != "eagle"}
SPECULATORS_KEY = "speculators_model_type"


def is_speculators(config: dict) -> bool:
    return SPECULATORS_KEY in config


# ---------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EngineFacts:
    name: str                                # sglang | vllm | llama.cpp | eagle
    label: str
    reads: tuple[IdsSlot, ...]               # tried in order: the first stored list wins; none -> defaults
    layouts: tuple[str, ...]                 # draft layouts it loads
    export_format: str                       # the `eagle3 export --format` to give it
    method_option: str                       # where its command line names the algorithm
    methods: dict[str, str]                  # our algorithm ("eagle3" | "eagle") -> its name for it
    other_methods: tuple[str, ...] = ()      # its non-EAGLE methods (not an EAGLE head)
    num_aux_layers: Optional[int] = None     # the captured-layer count it serves (None: any)
    older_reads: Optional[tuple[IdsSlot, ...]] = None   # what older releases read, where it differs
    eagle31_since: Optional[str] = None      # first release that runs the Eagle 3.1 norms (None: none)
    notes: tuple[str, ...] = field(default_factory=tuple)


SGLANG = EngineFacts(
    "sglang", "SGLang", reads=(NESTED_OUTPUT, TOP_OUTPUT), older_reads=(NESTED_OUTPUT,),
    layouts=("specforge", "eagle"), export_format="specforge", method_option="--speculative-algorithm",
    methods={"eagle3": "EAGLE3", "eagle": "EAGLE"},
    other_methods=("STANDALONE", "NGRAM", "NEXTN", "DFLASH"), num_aux_layers=3)
VLLM = EngineFacts(
    "vllm", "vLLM", reads=(TOP_INPUT, NESTED_INPUT), older_reads=(TOP_INPUT,),
    layouts=("speculators", "vllm", "specforge", "eagle"), export_format="speculators",
    method_option='"method" in --speculative-config', methods={"eagle3": "eagle3", "eagle": "eagle"},
    other_methods=("suffix", "ngram", "dflash", "mtp", "draft_model"), eagle31_since="0.22")
LLAMA_CPP = EngineFacts(
    "llama.cpp", "llama.cpp", reads=(TOP_INPUT,), layouts=("specforge", "vllm", "eagle"),
    export_format="specforge", method_option="--spec-type", methods={"eagle3": "draft-eagle3"},
    other_methods=("draft-simple",), num_aux_layers=3,
    notes=("ids are read once, by convert_hf_to_gguf.py, and baked into the GGUF as "
           "eagle3.target_layers",))
EAGLE_REFERENCE = EngineFacts(
    "eagle", "EAGLE reference", reads=(), layouts=("eagle",), export_format="eagle",
    method_option="use_eagle3 (Python API)", methods={"eagle3": "use_eagle3=True", "eagle": "use_eagle3=False"},
    num_aux_layers=3)
ENGINES: dict[str, EngineFacts] = {e.name: e for e in (SGLANG, VLLM, LLAMA_CPP, EAGLE_REFERENCE)}

# How this project reads a draft's ids (draft/formats.py resolve_layer_ids, which also requires the two
# to agree when both are stored): the ids the draft was trained on.
TRAINED_READS = (TOP_INPUT, NESTED_OUTPUT)

# How vLLM picks `method` when --speculative-config omits it: substrings of the draft path, in order,
# else draft_model. `vllm serve SPECULATORS_DIR` instead builds the whole config from the checkpoint.
VLLM_METHOD_FROM_PATH = (("eagle-", "eagle"), ("eagle3", "eagle3"))
VLLM_METHOD_FALLBACK = "draft_model"


# ---------------------------------------------------------------------------- Eagle 3.1 norms
# speculators' switches (vLLM keeps "method": "eagle3" for them since 0.22): an RMSNorm over the fused
# k*Ht features before fc (weight input_norm.weight), and the post-norm hidden fed to the next draft
# step. vLLM reads norm_before_fc from eagle_config, then the top level; norm_output at the top level.
# An engine that ignores them still runs the draft, with low acceptance and no error.
EAGLE31_FLAGS = ("norm_before_fc", "norm_output")


def eagle31_flags(config: dict) -> dict[str, bool]:
    """The Eagle 3.1 switches a draft config turns on, read where vLLM reads them."""
    nested = config.get(NESTED_KEY) or {}
    return {flag: bool(nested.get(flag, config.get(flag, False))) for flag in EAGLE31_FLAGS}


def version_tuple(version: str) -> tuple[int, int, int]:
    """'0.22.1rc2' -> (0, 22, 1)."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not m:
        raise LoadError(f"engine version {version!r}: expected a release number such as 0.22.1")
    return int(m[1]), int(m[2]), int(m[3] or 0)


# ---------------------------------------------------------------------------- reading
class Reading(NamedTuple):
    ids: tuple[int, ...]              # what the engine captures, input numbering
    slot: Optional[IdsSlot]           # where it found them (None: nothing stored, the defaults)
    stored: Optional[tuple[int, ...]]  # the list as written there


def read_ids(reads: tuple[IdsSlot, ...], config: dict, defaults: tuple[int, ...]) -> Reading:
    """What a reader that tries `reads` in order captures; `defaults` when nothing is stored."""
    for slot in reads:
        stored = slot.stored(config)
        if stored is not None:
            return Reading(slot.as_input(stored), slot, stored)
    return Reading(tuple(defaults), None, None)


def engine_reading(engine: EngineFacts, config: dict, defaults: tuple[int, ...]) -> Reading:
    return read_ids(engine.reads, config, defaults)


def describe(reading: Reading) -> str:
    slot = reading.slot
    if slot is None:
        return "no ids stored: the default 2, L//2, L-3"
    if slot.shift:
        how = f" +{slot.shift}"
    elif slot.nested:
        how = " taken raw as input ids (no +1, as SGLang adds)"
    else:
        how = ", no shift"
    return f"{slot.label}={list(reading.stored)}{how}"


def vllm_method(spec: dict[str, Any]) -> tuple[str, str]:
    """(method, how) as vLLM resolves --speculative-config: explicit, else guessed from the path."""
    if spec.get("method"):
        return str(spec["method"]).lower(), "set explicitly"
    model = str(spec.get("model") or "").lower()
    for part, method in VLLM_METHOD_FROM_PATH:
        if part in model:
            return method, f"guessed from the path ('{part}' -> {method})"
    return VLLM_METHOD_FALLBACK, f"no method and no 'eagle3' in the path -> {VLLM_METHOD_FALLBACK}"


def speculators_spec(config: dict, path: str) -> tuple[dict[str, Any], Optional[str]]:
    """`vllm serve SPECULATORS_DIR`: the speculative config vLLM builds from the checkpoint, and the
    target it serves (speculators_config.verifier.name_or_path)."""
    sc = config.get("speculators_config") or {}
    proposals = sc.get("proposal_methods") or [{}]
    spec = {"method": sc.get("algorithm") or config.get(SPECULATORS_KEY), "model": path,
            "num_speculative_tokens": proposals[0].get("speculative_tokens")}
    return spec, (sc.get("verifier") or {}).get("name_or_path")


# ---------------------------------------------------------------------------- running servers
@dataclass(frozen=True)
class LiveFacts:
    """Where a running server states what it is and how its speculation goes (`eagle3 doctor
    --server`). Metric names are Prometheus family names (a counter's samples may end in `_total`);
    routes are GET paths. A counter engine exports totals since start, so a run's figures are the
    difference before and after it; a ratio engine exports only a mean accept length."""
    name: str                                # vllm | sglang | eagle3
    label: str
    detect: tuple[tuple[str, str], ...]      # (route, key its JSON must hold): the engine is found
    info_routes: tuple[str, ...] = ()        # JSON routes read for version and settings (first found)
    version_key: Optional[str] = None        # where the version sits in that JSON
    settings: tuple[str, ...] = ()           # speculative settings in that JSON (algorithm first)
    drafts: Optional[str] = None             # counter: verify steps that checked draft tokens
    draft_tokens: Optional[str] = None       # counter: draft tokens checked
    accepted: Optional[str] = None           # counter: draft tokens accepted (bonus excluded)
    per_position: Optional[str] = None       # counter labelled `position`: steps accepting >= k
    first_position: int = 0                  # the `position` label of the first draft token
    accept_length_key: Optional[str] = None  # list.key in the info JSON: tokens per verify since start
    accept_length_gauge: Optional[str] = None  # gauge: tokens per verify over a recent interval
    metrics_flag: str = ""                   # what turns /metrics on, where it is optional
    draft_steps: Optional[str] = None        # counter: steps verifying the draft's own proposals
    draft_accepted: Optional[str] = None     # counter: accepted tokens the draft itself proposed
    argmax_draft: bool = False               # the draft proposes by argmax for sampled requests too


LIVE_VLLM = LiveFacts(
    "vllm", "vLLM", detect=(("/version", "version"),), info_routes=("/version",),
    version_key="version", drafts="vllm:spec_decode_num_drafts",
    draft_tokens="vllm:spec_decode_num_draft_tokens",
    accepted="vllm:spec_decode_num_accepted_tokens",
    per_position="vllm:spec_decode_num_accepted_tokens_per_pos", first_position=0,
    argmax_draft=True)
LIVE_SGLANG = LiveFacts(
    "sglang", "SGLang", detect=(("/server_info", "internal_states"),
                                ("/get_server_info", "internal_states")),
    info_routes=("/server_info", "/get_server_info"), version_key="version",
    settings=("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
              "speculative_eagle_topk", "speculative_num_draft_tokens"),
    accept_length_key="internal_states.avg_spec_accept_length",
    accept_length_gauge="sglang:spec_accept_length", metrics_flag="--enable-metrics")
LIVE_EAGLE3 = LiveFacts(
    "eagle3", "eagle3 serve", detect=(("/health", "speculative"),), info_routes=("/health",),
    settings=("speculative", "spec", "suffix_only_tokens"), drafts="eagle3:spec_decode_num_drafts",
    draft_tokens="eagle3:spec_decode_num_draft_tokens",
    accepted="eagle3:spec_decode_num_accepted_tokens",
    per_position="eagle3:spec_decode_num_accepted_tokens_per_pos", first_position=1,
    draft_steps="eagle3:spec_decode_draft_steps", draft_accepted="eagle3:spec_decode_draft_accepted_tokens")
# tried in this order: SGLang and vLLM answer /health with an empty body, only eagle3 with JSON
LIVE: dict[str, LiveFacts] = {f.name: f for f in (LIVE_EAGLE3, LIVE_SGLANG, LIVE_VLLM)}

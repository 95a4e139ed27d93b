"""One call from names to a ready Engine: resolve the target, the draft and the tree shape."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .config import DRAFT_WEIGHT_CHOICES, GGUF_CHOICES, REFERENCE, WEIGHT_CHOICES, RunConfig, use
from .errors import InputError
from .memory import freeze_loaded
from .generate import Engine

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHIPPED_DRAFTS = Path(__file__).parent / "drafts"
SUFFIX_ONLY_DRAFT = "suffix"   # draft=: no draft model, suffix-only blocks under the adaptive step
DEFAULT_DRAFT = SHIPPED_DRAFTS / "smollm2-135m-eagle3"


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_draft_path(model: Optional[str]) -> Optional[Path]:
    """The shipped draft goes with the packaged default target only."""
    from .runtime.assets import DEFAULT_MODEL
    if model in (None, "", "default", DEFAULT_MODEL) and (DEFAULT_DRAFT / "config.json").is_file():
        return DEFAULT_DRAFT
    return None


def load_target(model: Optional[str], device: torch.device, dtype: torch.dtype):
    """Native model when the architecture is supported, else the generic HF adapter."""
    from .adapters import load_target as load_any
    from .runtime.loader import load_tokenizer, resolve_model
    return load_any(model, device, dtype), load_tokenizer(resolve_model(model).hf_dir)


def draft_weight_dtype(choice: str) -> torch.dtype:
    """The draft's CPU GEMM weight dtype for "auto" | "bf16" | "fp32" (the bf16 lm_head GEMV reads
    half the bytes of fp32, and it is memory-bound)."""
    bf16_ok = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if choice == "auto":
        return torch.bfloat16 if bf16_ok else torch.float32
    if choice not in WEIGHT_DTYPES:
        raise InputError(f"draft_weights={choice!r}: choose one of {', '.join(DRAFT_WEIGHT_CHOICES)}")
    if choice == "bf16" and not bf16_ok:
        raise InputError("draft_weights=bf16: this CPU/torch build has no oneDNN bf16 kernels; "
                         "use draft_weights=fp32 (or auto)")
    return WEIGHT_DTYPES[choice]


def resolve_draft_weights(choice: str, draft=None) -> str:
    """The draft's CPU weights: "q4" | "bf16" | "fp32". "auto" takes q4 where it runs (4-bit blocks
    quantized at load, inputs rounded to one byte, on the kernels' integer dot products: about half
    a bf16 draft forward, MT-bench tau unchanged; docs/kernels.md), else bf16 where oneDNN has bf16 kernels, else fp32. The draft only proposes,
    so each choice changes acceptance and speed, never the output."""
    if choice not in DRAFT_WEIGHT_CHOICES:
        raise InputError(f"draft_weights={choice!r}: choose one of {', '.join(DRAFT_WEIGHT_CHOICES)}")
    if choice in ("auto", "q4"):
        why = q4_draft_unavailable(draft)
        if why is None:
            return "q4"
        if choice == "q4":
            raise InputError(f"draft_weights=q4: {why}; use draft_weights=bf16 or fp32 (or auto)")
    return "bf16" if draft_weight_dtype(choice) == torch.bfloat16 else "fp32"


def q4_draft_unavailable(draft=None) -> Optional[str]:
    """Why a draft cannot run as q4 here (None: it can): draft.inference.q4_unavailable."""
    from .draft.inference import q4_unavailable
    return q4_unavailable(draft)


def resolve_weights(weights: str, source=None, native_cpu: bool = True) -> str:
    """"auto" -> "gguf" for a GGUF target run natively on the CPU (the file's own codes, the fewest
    bytes a token; one-byte inputs where the CPU has integer dot products), else "fp32"; other
    choices are checked and returned."""
    if weights not in WEIGHT_CHOICES:
        raise InputError(f"weights={weights!r}: choose one of {', '.join(WEIGHT_CHOICES)}")
    is_gguf = source is not None and source.gguf is not None
    if weights == "auto":
        return "gguf" if is_gguf and native_cpu else "fp32"
    if weights in GGUF_CHOICES and not is_gguf:
        raise InputError(f"weights={weights} runs a GGUF file's own quantized weights, but this target is "
                         f"{getattr(source, 'name', 'not a GGUF file')}. Fix: give a .gguf target, or "
                         "weights=fp32 / bf16")
    if weights != "fp32" and not native_cpu:
        raise InputError(f"weights={weights} needs the native model on the CPU")
    return weights


def build_layouts(target, draft, weights: str = "fp32", draft_weights: str = "auto", source=None,
                  kv_cache_dtype: str = "auto"):
    """The inference layouts (runtime.target / draft.inference) of a native target and a draft,
    built once from their weights, which are left as they are; (target, draft). Targets the layout
    does not cover (the generic HF adapter) are returned as they are, and so is a model whose
    choice is "reference". `weights`/`draft_weights` as RunConfig's fields; source: the target's
    runtime.loader.ModelSource (weights gguf/auto read it); kv_cache_dtype as RunConfig's."""
    from .draft.inference import build_draft_layout
    from .models.llama import LlamaModel
    from .runtime.target import build_target
    native_cpu = isinstance(target, LlamaModel) and target.device.type == "cpu"
    weights = REFERENCE if weights == REFERENCE else resolve_weights(weights, source, native_cpu)
    if weights == REFERENCE:
        pass
    elif weights in GGUF_CHOICES:
        codes = gguf_codes(target, source, one_byte_inputs=weights == "gguf")
        # without the kernels the codes have nothing to run on: the fp32 layout is the same model
        target = (build_target(target, torch.float32, row_stable=True, gguf=codes, kv_cache_dtype=kv_cache_dtype)
                  if codes is not None else build_target(target, torch.float32, kv_cache_dtype=kv_cache_dtype))
    elif isinstance(target, LlamaModel):
        # low-precision weights amplify last-bit differences: keep verify == decode bit for bit
        target = build_target(target, WEIGHT_DTYPES[weights], row_stable=weights != "fp32",
                              kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype != "auto" and not hasattr(target, "kv_dtype"):
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} needs the inference layout, which "
                         f"{type(target).__name__} (weights={weights!r}) does not run; leave it "
                         "'auto' for this target")
    if draft is not None and draft_weights != REFERENCE:
        choice = resolve_draft_weights(draft_weights, draft) if draft.device.type == "cpu" else "fp32"
        dtype = draft_weight_dtype("auto") if choice == "q4" else WEIGHT_DTYPES[choice]  # q4: past its rows
        draft = build_draft_layout(draft, dtype, quantize=choice == "q4")
    return target, draft


def gguf_codes(target, source, one_byte_inputs: bool = True):
    """The GGUF's integer codes for the kernels (None where there are none), with one line on
    what runs (runtime.quant). one_byte_inputs (`--weights gguf`): the kernels may round each block
    of 32 inputs to one byte where they run integer dot products (`gguf_inputs` says)."""
    import sys
    from . import kernels
    from .runtime.quant import load_gguf_codes
    if kernels.quant_linear() is None:
        print(f"eagle3: gguf weights dequantised to fp32, the same model (no quantized kernels here: "
              f"{kernels.why()})", file=sys.stderr)
        return None
    codes = load_gguf_codes(source.gguf, source.hf_dir, target)
    if one_byte_inputs:
        codes = codes.with_int8_inputs()
    print(f"eagle3: {codes.describe()}, on the kernels; {gguf_inputs(one_byte_inputs)}", file=sys.stderr)
    return codes


def gguf_inputs(one_byte_inputs: bool = True) -> str:
    """What the codes meet here: one-byte inputs (`--weights gguf` where the kernels run integer
    dot products, as llama.cpp runs the file) or exact ones (`gguf-exact`, or no AVX512-VNNI: there
    the float path is the faster one anyway)."""
    from . import kernels
    if one_byte_inputs and kernels.integer_dots():
        return "inputs rounded to one byte per block of 32 (integer dot products, as llama.cpp)"
    if one_byte_inputs:
        return "exact inputs (no AVX512-VNNI here: rounded inputs would gain nothing on fp32 FMA)"
    return "exact inputs (--weights gguf-exact: within 1e-4 of the dequantised model)"


def adaptive_policy(target, draft, shapes=None, remeasure: bool = False):
    """The adaptive step's policy factory for this target/draft pair, called with `greedy`: the
    machine's cost table (runtime.costs, measured once and cached) and the shapes to choose among
    (policy.DEFAULT_SHAPES for greedy requests, SAMPLED_SHAPES with SAMPLED_MEMORY and
    SAMPLED_PROBE_STEPS for sampled ones; `shapes` given: those for both)."""
    from .runtime.costs import machine_costs
    from .speculative.policy import (DEFAULT_SHAPES, DRAFTLESS_MIN_MATCH, DRAFTLESS_SUFFIX_TOKENS, SAMPLED_MEMORY,
                                     SAMPLED_MIN_MATCH, SAMPLED_PROBE_SHARE, SAMPLED_PROBE_STEPS, SAMPLED_SHAPES,
                                     AdaptivePolicy)
    costs = machine_costs(target, draft, remeasure=remeasure)
    if draft is None:     # no draft: suffix-only blocks where the index matches, else plain steps
        return lambda greedy=True: AdaptivePolicy((), costs, suffix_only_tokens=DRAFTLESS_SUFFIX_TOKENS,
                                                  suffix_only_min_match=DRAFTLESS_MIN_MATCH,
                                                  **({} if greedy else {"memory": SAMPLED_MEMORY,
                                                                        "probe_steps": SAMPLED_PROBE_STEPS,
                                                                        "probe_share": SAMPLED_PROBE_SHARE}))

    def make(greedy: bool = True) -> AdaptivePolicy:
        if greedy:
            return AdaptivePolicy(tuple(shapes or DEFAULT_SHAPES), costs)
        return AdaptivePolicy(tuple(shapes or SAMPLED_SHAPES), costs, memory=SAMPLED_MEMORY,
                              probe_steps=SAMPLED_PROBE_STEPS, suffix_only_min_match=SAMPLED_MIN_MATCH,
                              probe_share=SAMPLED_PROBE_SHARE)
    return make


def load_draft_layout(path: Path, target, config: Optional[RunConfig] = None,
                      algorithm: Optional[str] = None):
    """A draft directory for a running engine's `target` (its inference layout or reference model):
    loaded in fp32, the contract checked, laid out as config.draft_weights says (a learned
    version swapped in while serving)."""
    from .draft.contract import check_pair
    from .draft.formats import load_draft
    config = config or RunConfig()
    loaded = load_draft(path, target.config, algorithm=algorithm, device=target.device,
                        dtype=torch.float32, target=target)
    check_pair(target.config, loaded.draft, algorithm, None, loaded.info)
    drafter = loaded.draft.requires_grad_(False)
    if not config.packed_draft or config.draft_weights == REFERENCE:
        return drafter
    from .draft.inference import build_draft_layout
    choice = resolve_draft_weights(config.draft_weights, drafter) if drafter.device.type == "cpu" else "fp32"
    dtype = draft_weight_dtype("auto") if choice == "q4" else WEIGHT_DTYPES[choice]
    return build_draft_layout(drafter, dtype, quantize=choice == "q4")


def load_engine(model: Optional[str] = None, draft: Optional[str] = "default", spec=None, *,
                config: Optional[RunConfig] = None, max_model_len: int = 2048,
                algorithm: Optional[str] = None, adaptive: bool = True) -> Engine:
    """A ready Engine for `model` and `draft`, run as `config` says (eagle3.config.RunConfig: the
    target's and the draft's weights, device, threads, the backend switches; None: RunConfig(),
    the defaults). Speculation is lossless whatever the precision: speculative output equals plain
    decoding on the same target weights.

    model: None = packaged SmolLM2, a .gguf, or an HF dir. draft: "default" (the shipped draft
    for the default model; for any other model suffix-only speculation: the suffix index's
    continuations over the prompt and output verified as blocks, where the adaptive step says they
    pay), "suffix" (that, for any model), None/"none" (plain decoding), or a draft checkpoint
    directory. Both are loaded in fp32, then laid out for inference from those weights as
    config.weights / config.draft_weights say ("reference": the modules as loaded).
    algorithm: optional "eagle3"/"eagle" assertion; it must agree with what the checkpoint is (the
    contract is checked here, before anything runs).
    spec / adaptive: a SpecParams fixes the tree shape of every step; with spec None and adaptive
    (the default) each step takes the shape the adaptive policy picks from the machine's measured
    costs (config.remeasure: measured again) and the rolling acceptance (speculative.policy), plain
    decoding included."""
    config = config or RunConfig()
    use(config)             # threads, and the backend switches the environment does not say
    dev = pick_device(config.device)
    target, tokenizer = load_target(model, dev, torch.float32)
    draft_path = default_draft_path(model) if draft == "default" else (
        None if draft in (None, "", "none", SUFFIX_ONLY_DRAFT) else Path(draft))
    drafter = None
    if draft_path is not None:
        from .draft.contract import check_pair
        from .draft.formats import load_draft
        loaded = load_draft(draft_path, target.config, algorithm=algorithm, device=dev,
                            dtype=torch.float32, target=target)
        check_pair(target.config, loaded.draft, algorithm, target, loaded.info)
        drafter = loaded.draft.requires_grad_(False)
    if config.packed_target or (config.packed_draft and drafter is not None):
        from .runtime.loader import resolve_model
        target, drafter = build_layouts(target, drafter, config.weights, config.draft_weights,
                                        resolve_model(model), config.kv_cache_dtype)
    policy = None
    if spec is None and adaptive and (drafter is not None or draft in ("default", SUFFIX_ONLY_DRAFT)):
        # a target no draft is shipped for still speculates: suffix-only blocks (draft=None)
        policy = adaptive_policy(target, drafter, remeasure=config.remeasure)
    engine = Engine(target, tokenizer, draft=drafter, spec=spec, max_model_len=max_model_len,
                    policy=policy)
    freeze_loaded()     # the garbage collector's passes then skip the loaded engine's objects
    return engine

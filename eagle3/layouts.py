"""Precision and inference layouts: what `--weights` / `--draft-weights` resolve to on this machine,
and the layouts (runtime.target, draft.inference) built once from the loaded weights.

The names are checked in one place (config.checked, which RunConfig calls); here "auto" is resolved
against the target's file and this CPU, and a choice the machine or the target cannot run is an
error naming the fix. Every choice is lossless: speculative output equals plain decoding on the same
target weights.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from .config import GGUF_CHOICES, REFERENCE, checked
from .errors import InputError

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- the target
def resolve_weights(weights: str, source=None, native_cpu: bool = True) -> str:
    """"auto" -> "gguf" for a GGUF target run natively on the CPU (the file's own codes, the fewest
    bytes a token; one-byte inputs where the CPU has integer dot products), else "fp32"; other
    choices are returned where this target runs them."""
    checked("weights", weights)
    is_gguf = source is not None and source.gguf is not None
    if weights == "auto":
        return "gguf" if is_gguf and native_cpu else "fp32"
    if weights in GGUF_CHOICES and not is_gguf:
        raise InputError(f"weights={weights} runs a GGUF file's own quantized weights, but this target is "
                         f"{getattr(source, 'name', 'not a GGUF file')}. Fix: give a .gguf target, or "
                         "weights=fp32 / bf16")
    if weights not in ("fp32", REFERENCE) and not native_cpu:
        raise InputError(f"weights={weights} needs the native model on the CPU")
    return weights


def gguf_codes(target, source, one_byte_inputs: bool = True):
    """The GGUF's integer codes for the kernels (None where there are none), with one line on
    what runs (runtime.quant). one_byte_inputs (`--weights gguf`): the kernels may round each block
    of 32 inputs to one byte where they run integer dot products (`gguf_inputs` says)."""
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


# ---------------------------------------------------------------------------- the draft
def bf16_kernels() -> bool:
    """Whether oneDNN has bf16 kernels in this CPU/torch build."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def draft_weight_dtype(choice: str) -> torch.dtype:
    """The draft's CPU GEMM weight dtype for a resolved "bf16" | "fp32", or "auto" (bf16 where
    oneDNN has bf16 kernels: the lm_head GEMV reads half the bytes of fp32, and it is memory-bound)."""
    if choice == "auto":
        return torch.bfloat16 if bf16_kernels() else torch.float32
    return WEIGHT_DTYPES[choice]


def q4_draft_unavailable(draft=None) -> Optional[str]:
    """Why a draft cannot run as q4 here (None: it can): draft.inference.q4_unavailable."""
    from .draft.inference import q4_unavailable
    return q4_unavailable(draft)


def resolve_draft_weights(choice: str, draft=None) -> str:
    """The draft's CPU weights: "q4" | "bf16" | "fp32". "auto" takes q4 where it runs (4-bit blocks
    quantized at load, inputs rounded to one byte, on the kernels' integer dot products: about half
    a bf16 draft forward, MT-bench tau unchanged; docs/kernels.md), else bf16 where oneDNN has bf16
    kernels, else fp32. The draft only proposes, so each choice changes acceptance and speed, never
    the output."""
    if checked("draft_weights", choice) == REFERENCE:
        return REFERENCE
    if choice in ("auto", "q4"):
        why = q4_draft_unavailable(draft)
        if why is None:
            return "q4"
        if choice == "q4":
            raise InputError(f"draft_weights=q4: {why}; use draft_weights=bf16 or fp32 (or auto)")
    if choice == "bf16" and not bf16_kernels():
        raise InputError("draft_weights=bf16: this CPU/torch build has no oneDNN bf16 kernels; "
                         "use draft_weights=fp32 (or auto)")
    return "bf16" if draft_weight_dtype(choice) == torch.bfloat16 else "fp32"


def draft_layout(draft, draft_weights: str = "auto"):
    """The draft's inference layout (draft.inference) as `draft_weights` says; on a GPU fp32."""
    from .draft.inference import build_draft_layout
    choice = resolve_draft_weights(draft_weights, draft) if draft.device.type == "cpu" else "fp32"
    dtype = draft_weight_dtype("auto") if choice == "q4" else WEIGHT_DTYPES[choice]  # q4: past its rows
    return build_draft_layout(draft, dtype, quantize=choice == "q4")


# ---------------------------------------------------------------------------- both
def build_layouts(target, draft, weights: str = "fp32", draft_weights: str = "auto", source=None,
                  kv_cache_dtype: str = "auto"):
    """The inference layouts (runtime.target / draft.inference) of a native target and a draft,
    built once from their weights, which are left as they are; (target, draft). Targets the layout
    does not cover (the generic HF adapter) are returned as they are, and so is a model whose
    choice is "reference". `weights`/`draft_weights` as RunConfig's fields; source: the target's
    runtime.loader.ModelSource (weights gguf/auto read it); kv_cache_dtype as RunConfig's."""
    from .models.llama import LlamaModel
    from .runtime.target import build_target
    checked("kv_cache_dtype", kv_cache_dtype)
    native_cpu = isinstance(target, LlamaModel) and target.device.type == "cpu"
    weights = resolve_weights(weights, source, native_cpu)
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
        draft = draft_layout(draft, draft_weights)
    return target, draft

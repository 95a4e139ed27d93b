"""A GGUF target's weights at the file's own precision (`--weights gguf`).

The loader dequantises a GGUF once into fp32 safetensors (the reference model: exact, since every
GGUF weight is scale * integer code + offset). This module reads the same file's integer codes
and per-block scales so the small-M kernel (csrc/linear_quant.cpp) can run them directly:
~0.6-1.3 bytes a weight instead of bf16's 2 or fp32's 4, on the file's own values (no bf16 rounding
of weights, no int8 rounding of activations): fp32 FMA, or, for the 4-bit codes on a CPU with
AVX512-VNNI, integer dot products with each block of inputs split into three exact byte digits (23
bits under the block's largest input; csrc/linear_quant_vnni.cpp nibble_tile_vnni), as close to the
exact model as fp32 evaluation is (tests/test_quant.py).

    tensor type        codes            block   w
    Q4_0               4-bit 0..15      32      d * c - 8 d
    Q4_1               4-bit 0..15      32      d * c + m
    Q4_K               4-bit 0..15      32      (d * sc) * c - (dmin * mn)   (6-bit sc, mn per 32)
    Q5_0               5-bit -16..15    32      d * c
    Q8_0               int8             32      d * c
    Q6_K               int8 -32..31     16      (d * sc) * c
    anything else      dequantised (the fp32 reference weight), said by `describe`

`read_gguf_codes` returns them per module weight name; `check_codes` proves, tensor by tensor,
that the codes reproduce the reference model's fp32 weight bit for bit (the names, the row order
of llama q/k, which transformers permutes when it reads a GGUF, and the unpacking all checked at
once), so a wrong mapping is a LoadError, never a wrong model.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import LoadError


@dataclass(frozen=True)
class QuantCodes:
    """One weight [O, I] as integer codes: w = scales * codes (+ offsets), per block of inputs."""
    ggml_type: str
    kind: int                        # 4: codes 0..15 with offsets; 8: int8 codes, no offsets
    block: int                       # inputs per scale
    codes: torch.Tensor              # [O, I] uint8 (kind 4) or int8 (kind 8)
    scales: torch.Tensor             # [O, I / block] fp32
    offsets: Optional[torch.Tensor]  # [O, I / block] fp32 (kind 4)
    int8_inputs: bool = False        # the kernel may round each block of inputs to one byte
                                     # (quantize_q4: a draft's weights, not a file's model)

    def dequantize(self) -> torch.Tensor:
        """fp32 [O, I], computed as the gguf package computes it (same roundings)."""
        s = self.scales.repeat_interleave(self.block, dim=1)
        w = s * self.codes.float()
        if self.offsets is not None:
            w = w + self.offsets.repeat_interleave(self.block, dim=1)
        return w

    def kernel_part(self) -> tuple:
        """The (kind, block, codes, scales, offsets) part kernels.pack_quant takes (Q5_0's codes
        are packed in 5 bits: kernel kind 5)."""
        kind = 5 if self.ggml_type == "Q5_0" else self.kind
        return kind, self.block, self.codes, self.scales, self.offsets


def quantize_q4(weight: torch.Tensor) -> QuantCodes:
    """A draft's weight [O, I] (I a multiple of 32) as Q4_1 blocks, rounded to nearest here: per
    block of 32 inputs w ~ d * c + m with m the block's least value, d its range / 15 (both fp16
    where they fit, so the packed records are GGUF-sized) and c = round((w - m) / d) in 0..15.
    int8_inputs: the kernel rounds each block of inputs to one byte too. A draft only proposes
    tokens, so this changes acceptance, never the output (MT-bench tau unchanged: docs/results/)."""
    out_features, in_features = weight.shape
    if in_features % 32:
        raise ValueError(f"quantize_q4: input width {in_features} is not a multiple of 32")
    blocks = weight.detach().float().reshape(out_features, in_features // 32, 32)
    low, high = blocks.min(dim=-1).values, blocks.max(dim=-1).values
    d, m = _half_where_finite((high - low) / 15), _half_where_finite(low)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = ((blocks - m[..., None]) / safe[..., None]).round().clamp_(0, 15)
    codes = torch.where(d[..., None] > 0, codes, torch.zeros_like(codes))
    return QuantCodes("Q4_1", 4, 32, codes.to(torch.uint8).reshape(out_features, in_features), d, m,
                      int8_inputs=True)


def _half_where_finite(x: torch.Tensor) -> torch.Tensor:
    half = x.half().float()
    return torch.where(torch.isfinite(half), half, x)


# ---------------------------------------------------------------------------- unpacking
def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are inputs 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return 4, 32, _nibbles(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray):
    return 4, 32, _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray):
    return 8, 32, np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b[:, 0:2])


def _q5_0(b: np.ndarray):
    qh = np.ascontiguousarray(b[:, 2:6]).view(np.uint32)               # [n, 1]: bit j = input j
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    codes = (_nibbles(b[:, 6:22]) | (high << 4)).astype(np.int8) - np.int8(16)
    return 8, 32, codes, _f16(b[:, 0:2])


def _q4_k(b: np.ndarray):
    from gguf.quants import Q4_K
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))       # [n, 8] each
    qs = b[:, 16:144].reshape(n, 4, 32)                                   # chunk c: sub-blocks 2c, 2c+1
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    scales = (d * sc.reshape(n, 8).astype(np.float32))
    offsets = -(dmin * mn.reshape(n, 8).astype(np.float32))
    return 4, 32, codes, scales, offsets


def _q6_k(b: np.ndarray):
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)    # half, quarter, input
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)        # [n, 2, 4, 32]
    codes = (low | (high << 4)).astype(np.int8).reshape(n, 256) - np.int8(32)
    scales = _f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return 8, 16, codes, scales


UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def unpack(ggml_type: str, raw: np.ndarray, out_features: int, in_features: int) -> QuantCodes:
    """A quantized tensor's raw bytes (rows of blocks, as the file stores them) -> QuantCodes."""
    import gguf
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, type_size)
    if blocks.shape[0] * block != out_features * in_features:
        raise LoadError(f"{ggml_type} tensor of {blocks.shape[0]} blocks does not hold "
                        f"[{out_features}, {in_features}] weights")
    kind, sub, codes, scales, *offsets = UNPACK[ggml_type](blocks)
    as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).reshape(out_features, -1)
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(out_features, in_features))
    return QuantCodes(ggml_type, kind, sub, codes_t.to(torch.uint8 if kind == 4 else torch.int8),
                      as_torch(scales), as_torch(offsets[0]) if offsets else None)


# ---------------------------------------------------------------------------- names and order
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}


def module_name(gguf_name: str) -> Optional[str]:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight; None for tensors not in a linear."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"
    return None


def llama_row_order(out_features: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a llama q/k weight read from a GGUF (llama.cpp stores the
    rotary halves interleaved): HF row i is GGUF row order[i]."""
    half = out_features // heads // 2
    return torch.arange(out_features).view(heads, half, 2).transpose(1, 2).reshape(-1)


@dataclass
class GgufWeights:
    codes: dict[str, QuantCodes]                  # module weight name -> codes (kernel types)
    types: Counter                                # GGUF type -> tensors (linears only)
    dequantized: dict[str, str]                   # module weight name -> its type without a kernel
    unmatched: list[str] = field(default_factory=list)   # model linears no GGUF tensor name maps to

    def with_int8_inputs(self) -> "GgufWeights":
        """The same codes, each allowed one-byte inputs (`--weights gguf`: csrc/linear_quant_vnni.cpp
        byte_tile)."""
        codes = {n: replace(qc, int8_inputs=True) for n, qc in self.codes.items()}
        return GgufWeights(codes, self.types, self.dequantized, self.unmatched)

    def describe(self) -> str:
        kinds = ", ".join(f"{t} x{n}" for t, n in sorted(self.types.items()))
        line = f"gguf weights: {kinds}"
        if self.dequantized:
            missing = sorted(set(self.dequantized.values()))
            line += (f"; no kernel for {', '.join(missing)}: {len(self.dequantized)} tensor(s) "
                     "dequantised to fp32")
        if self.unmatched:
            shown = ", ".join(self.unmatched[:3]) + (", ..." if len(self.unmatched) > 3 else "")
            line += (f"; {len(self.unmatched)} linear weight(s) matched no GGUF tensor name and run "
                     f"dequantised in fp32 ({shown})")
        return line

    def match(self, params: dict) -> "GgufWeights":
        """Record the model's linear weights that no GGUF tensor name maps to (a file whose
        tensor naming this reader does not know): said by describe(), never silent."""
        linear = [n for n, p in params.items() if p.ndim == 2 and n.endswith(("proj.weight", "lm_head.weight"))]
        self.unmatched = sorted(n for n in linear if n not in self.codes and n not in self.dequantized)
        return self


def linear_tensors(reader, tie_word_embeddings: bool):
    """(module weight name, tensor) for every linear weight a GGUF holds: the tied embedding as the
    lm_head; an untied embedding is a lookup (the fp32 reference rows serve it) and is skipped."""
    for t in reader.tensors:
        name = module_name(t.name)
        if name == "embed_tokens.weight":
            name = "lm_head.weight" if tie_word_embeddings else None
        if name is not None:
            yield name, t


def read_gguf_codes(path: str | os.PathLike, num_heads: int, num_kv_heads: int,
                    tie_word_embeddings: bool) -> GgufWeights:
    """The integer codes of every linear weight of a GGUF target, by module weight name."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    codes, types, dequantized = {}, Counter(), {}
    for name, t in linear_tensors(reader, tie_word_embeddings):
        type_name = t.tensor_type.name
        types[type_name] += 1
        in_features, out_features = int(t.shape[0]), int(t.shape[1])
        if type_name not in UNPACK:
            dequantized[name] = type_name
            continue
        qc = unpack(type_name, t.data, out_features, in_features)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in name else num_kv_heads
            qc = reorder_rows(qc, llama_row_order(out_features, heads))
        codes[name] = qc
    return GgufWeights(codes, types, dequantized)


def tensor_types(path: str | os.PathLike, tie_word_embeddings: bool) -> str:
    """What `--weights gguf` runs for each type of linear weight in the file (`eagle3 info`)."""
    import gguf
    types = Counter(t.tensor_type.name for _, t in linear_tensors(gguf.GGUFReader(str(path)), tie_word_embeddings))
    return ", ".join(f"{k} x{n} ({'kernel' if k in UNPACK else 'dequantised to fp32: no kernel'})"
                     for k, n in sorted(types.items()))


def reorder_rows(qc: QuantCodes, order: torch.Tensor) -> QuantCodes:
    pick = lambda t: None if t is None else t[order].contiguous()
    return QuantCodes(qc.ggml_type, qc.kind, qc.block, pick(qc.codes), pick(qc.scales), pick(qc.offsets))


def check_codes(weights: GgufWeights, params: dict[str, torch.Tensor]) -> None:
    """Every tensor's codes reproduce the reference model's fp32 weight bit for bit, or LoadError."""
    for name, qc in weights.codes.items():
        if name not in params:
            raise LoadError(f"GGUF tensor for {name!r} has no weight in the model")
        ref = params[name].detach().float()
        if tuple(ref.shape) != tuple(qc.codes.shape):
            raise LoadError(f"{name}: GGUF codes {tuple(qc.codes.shape)} vs model weight {tuple(ref.shape)}")
        if not torch.equal(qc.dequantize(), ref):
            bad = (qc.dequantize() - ref).abs().max().item()
            raise LoadError(f"{name}: the {qc.ggml_type} codes do not reproduce the dequantised weight "
                            f"(max difference {bad:.3g}); the GGUF and the cached model disagree. Fix: "
                            f"delete the cached conversion (EAGLE3_CACHE/gguf) and load again, or use "
                            f"--weights fp32")


# ---------------------------------------------------------------------------- cache
CODES_SUFFIX = ".codes.safetensors"


def load_gguf_codes(gguf_path: str | os.PathLike, hf_dir: str | os.PathLike,
                    model: torch.nn.Module) -> GgufWeights:
    """The codes of `gguf_path` for `model` (loaded from `hf_dir`, its dequantised conversion):
    read from the file the first time, then kept beside the conversion (a second load reads them in
    well under a second). runtime.target.build_target checks them against the model's weights."""
    cfg = model.config
    # beside the conversion, not in it: tools that load every *.safetensors of a model directory
    # (vLLM) would take the codes for weights
    cached = Path(hf_dir).with_name(Path(hf_dir).name + CODES_SUFFIX)
    params = dict(model.named_parameters(remove_duplicate=False))
    if cached.is_file():
        return _read_cache(cached).match(params)
    weights = read_gguf_codes(gguf_path, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings)
    _write_cache(weights, cached)
    return weights.match(params)


def _write_cache(weights: GgufWeights, path: Path) -> None:
    from safetensors.torch import save_file
    tensors, meta = {}, {"types": json.dumps(dict(weights.types)), "dequantized": json.dumps(weights.dequantized)}
    for name, qc in weights.codes.items():
        tensors[f"{name}.codes"], tensors[f"{name}.scales"] = qc.codes, qc.scales
        if qc.offsets is not None:
            tensors[f"{name}.offsets"] = qc.offsets
        meta[name] = json.dumps([qc.ggml_type, qc.kind, qc.block])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as e:   # a read-only cache: the codes are simply read from the GGUF each time
        print(f"eagle3: cannot cache the GGUF codes in {path.parent} ({e})", file=sys.stderr)
        tmp.unlink(missing_ok=True)


def _read_cache(path: Path) -> GgufWeights:
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            codes = {}
            for name, spec in meta.items():
                if name in ("types", "dequantized", "format"):
                    continue
                ggml_type, kind, block = json.loads(spec)
                offsets = f.get_tensor(f"{name}.offsets") if kind == 4 else None
                codes[name] = QuantCodes(ggml_type, kind, block, f.get_tensor(f"{name}.codes"),
                                         f.get_tensor(f"{name}.scales"), offsets)
    except Exception as e:   # safetensors raises several types on a truncated file
        raise LoadError(f"{path}: unreadable cached GGUF codes ({type(e).__name__}: {e}). Fix: delete "
                        f"the file; it is rebuilt from the GGUF on the next load") from None
    return GgufWeights(codes, Counter(json.loads(meta["types"])), json.loads(meta["dequantized"]))

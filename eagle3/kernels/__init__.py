"""Small-M linear kernels and fused ops for CPU inference (the C++ sources in kernels/csrc), built
once on first use and cached. What each source file owns and the measured figures: docs/kernels.md.

Why: decode and tree verification multiply 1..8 rows by every weight once, so a forward costs the
weight bytes it reads, and these kernels read them closer to the memory's speed than oneDNN does on
those shapes (scripts/bench_kernels.py). Each output is one dot product in a fixed order, so a
row's result does not depend on the other rows of the call: the property a lossless verify needs
(verify block == one-token decode). The same holds for the fused RMSNorm and the fp32 attention
(fused_ops): each row in one fixed order, which lets a bf16 target be row-stable without the far
slower fp64 attention.

    kernel = small_linear()            # None where the CPU or the build cannot run them (why())
    packed = pack_weight(w, dtype)     # once, at pack time
    y = kernel(x, packed, bias, out_features)

EAGLE3_KERNELS=0 switches them off (the oneDNN path then serves every call). How and where they
are built (cache key, temp-dir fallback, ninja, the build lock): kernels/build.py.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from .. import settings

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))   # the translation units (bindings.cpp: the module)
HEADERS = tuple(sorted(CSRC.glob("*.h")))     # in the cache key with the sources
BLOCK = 32                      # outputs per packed block (csrc/common.h kBlock)
NEED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
BF16_FLAG = "avx512_bf16"       # /proc/cpuinfo's name; linear_bf16 is handed out only with it
# no FMA contraction: where a kernel replaces torch ops (rope_qkv) it must round as they do.
# -fopenmp: at::parallel_for is an OpenMP pragma in the headers; without the flag every kernel
# ran on one thread whatever torch.get_num_threads() said. No -mavx512bf16: the bf16 functions
# carry target("avx512bf16") (csrc/linear_float.cpp), so no other code can hold an AVX512-BF16
# instruction.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# rpath: resolve libgomp.so.1 to torch's copy (the one already loaded), as `ldd` shows too
LDFLAGS = ["-fopenmp", f"-Wl,-rpath,{Path(torch.__file__).parent / 'lib'}"]


VNNI_FLAG = "avx512_vnni"       # /proc/cpuinfo's name; linear_quant's integer dot products need it
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})   # linear_bf16(amx=True) needs both (and the OS's grant)
AMX_INT8_FLAGS = frozenset({"amx_tile", "amx_int8"})   # linear_quant's 4-bit codes of 8+ rows on tiles
AMX_WIDTH = 32                  # linear_bf16(amx=True) takes input widths that are multiples of this


class KernelState(NamedTuple):
    module: Optional[object]    # the built extension, or None
    reason: str                 # why it is (not) in use
    bf16: bool                  # the CPU has AVX512-BF16 (linear_bf16 may run)
    build_dir: Optional[Path] = None
    vnni: bool = False          # 4-bit GGUF codes may run on integer dot products (AVX512-VNNI)
    amx: bool = False           # bf16 weights run on AMX tile multiplies (linear_bf16's amx)
    amx_int8: bool = False      # 4-bit codes of blocks of 8+ rows on AMX-INT8 tiles (VNNI's bits)


_STATE: Optional[KernelState] = None


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build() -> KernelState:
    if not settings.enabled("EAGLE3_KERNELS"):
        return KernelState(None, "off (EAGLE3_KERNELS=0)", False)
    flags = cpu_flags()
    if not NEED_FLAGS <= flags:
        return KernelState(None, f"CPU lacks {sorted(NEED_FLAGS - flags)}", False)
    from .build import BuildError, build
    try:
        module, build_dir = build("eagle3_kernels", SOURCES, CFLAGS, LDFLAGS, HEADERS)
    except BuildError as exc:
        print(f"eagle3: small-M kernels off: {exc}", file=sys.stderr)
        return KernelState(None, f"not built: {exc}", False)
    except Exception as exc:  # the compiler failed: oneDNN serves every call
        print(f"eagle3: small-M kernels not built ({type(exc).__name__}: {exc}); using oneDNN",
              file=sys.stderr)
        return KernelState(None, f"build failed: {type(exc).__name__}", False)
    bf16 = BF16_FLAG in flags
    vnni = VNNI_FLAG in flags and settings.enabled("EAGLE3_VNNI")
    amx = (bf16 and AMX_FLAGS <= flags and settings.enabled("EAGLE3_AMX")
           and bool(module.amx_permitted()))
    # the integer dot products of 4-bit codes on tiles for blocks of 8+ rows: exact integer sums,
    # so the same bits as the VNNI path (faster from 16 rows: prefill pieces, long verify blocks)
    amx_int8 = (vnni and AMX_INT8_FLAGS <= flags and settings.enabled("EAGLE3_AMX")
                and bool(module.amx_int8_available()))
    module.set_amx_int8(amx_int8)
    reason = ("avx512" + (" + bf16" if bf16 else " (fp32 only)") + (" + vnni" if vnni else "")
              + (" + amx" if amx else "") + (" + amx-int8" if amx_int8 else ""))
    return KernelState(module, reason, bf16, build_dir, vnni, amx, amx_int8)


def state() -> KernelState:
    global _STATE
    if _STATE is None:
        _STATE = _build()
    return _STATE


def why() -> str:
    st = state()
    if st.module is None:
        return st.reason
    return f"{st.reason}, {parallel_threads()} of {torch.get_num_threads()} threads"


def parallel_threads() -> int:
    """Threads a kernel's parallel region gets now (0 without the kernels)."""
    st = state()
    return 0 if st.module is None else int(st.module.parallel_threads())


def integer_dot_peak(reps: int = 20_000_000) -> Optional[float]:
    """vpdpbusd (zmm: 64 byte products each) this CPU retires a second over the kernels' threads,
    or None where the kernels run no integer dot products: the compute roof of one-digit codes
    (bench.roofline). About reps / 1.5e9 s a thread."""
    st = state()
    return float(st.module.integer_dot_peak(reps)) if st.module is not None and st.vnni else None


def small_linear(dtype: torch.dtype, amx: bool = False) -> Optional[Callable]:
    """The kernel for weights of `dtype` (fp32 or bf16), or None where it cannot run here; amx: bf16
    on AMX tiles (where `amx()` says so and the input width is a multiple of AMX_WIDTH)."""
    st = state()
    if st.module is None or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.bfloat16:
        if not st.bf16:
            return None
        if amx and not st.amx:
            raise ValueError(f"small_linear(amx=True): AMX tiles are not in use here ({why()}); "
                             "pass amx=False")
        return functools.partial(st.module.linear_bf16, amx=amx)
    return st.module.linear_fp32


def amx() -> bool:
    """Whether bf16 weights run on AMX tile multiplies here (the CPU has AMX-BF16, Linux granted the
    tiles, EAGLE3_AMX is not 0). A packed linear keeps the path it was built with: the two round
    differently, and every call on one weight must round alike."""
    return state().amx


def quant_linear() -> Optional[Callable]:
    """linear_quant(x fp32 [M, I], pack_quant(...), bias, out_features), or None here."""
    st = state()
    return None if st.module is None else st.module.linear_quant


def fused_ops() -> Optional[tuple[Callable, Callable]]:
    """(rms_norm(x, w, eps), attention(q, k, v, mask)): row-stable fp32 ops, or None here."""
    st = state()
    if st.module is None:
        return None
    return st.module.rms_norm, st.module.attention


def rope_qkv() -> Optional[Callable]:
    """rope_qkv(qkv, cos, sin, k_buf, v_buf, start, Hq, Hkv) -> q: rotary + cache write, or None."""
    st = state()
    return None if st.module is None else st.module.rope_qkv


def decoder_layer() -> Optional[Callable]:
    """The one-call Llama decoder layer (csrc/layer.cpp decoder_layer), or None here."""
    st = state()
    return None if st.module is None else st.module.decoder_layer


def pack_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[O, I] -> the kernel layout: bf16 [O/32, I/2, 32, 2] (I even), fp32 [O/32, I, 32]; O padded
    to a multiple of 32 with zero rows (their outputs are never stored)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // BLOCK) * BLOCK
    w = torch.zeros(padded, in_features, dtype=dtype)
    w[:out_features] = weight.detach().to(dtype)
    if dtype == torch.bfloat16:
        if in_features % 2:
            raise ValueError(f"bf16 small-M kernel needs an even input width, got {in_features}")
        return w.view(padded // BLOCK, BLOCK, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.view(padded // BLOCK, BLOCK, in_features).permute(0, 2, 1).contiguous()


QUANT_MAGIC = 0x5451474746      # csrc/linear_quant.cpp kQuantMagic
QUANT_LANES = 16                # outputs per record (csrc/quant.h kQuantLanes)


def integer_dots() -> bool:
    """Whether pack_quant's default runs 4-bit codes on integer dot products here (AVX512-VNNI;
    EAGLE3_VNNI=0 keeps them on fp32 FMA)."""
    return state().vnni


def pack_quant(parts: list, integer_dots: Optional[bool] = None, one_digit: bool = False) -> torch.Tensor:
    """GGUF integer codes -> linear_quant's packed weight (the layout is documented in csrc/quant.h).

    parts: one per run of outputs, each (kind, block, codes [O, I], scales [O, I/block] fp32,
    offsets [O, I/block] fp32 or None): kind 4 = codes 0..15 and w = scale * code + offset,
    kind 5 = codes -16..15 (5 bits) and kind 8 = int8 codes, both w = scale * code. Scales and
    offsets are stored in fp16 where that is exact, else fp32. integer_dots (default: the CPU has
    AVX512-VNNI): kind-4 codes meet the activations as byte digits in integer dot products
    (csrc/linear_quant_vnni.cpp nibble_tile_vnni), fixed for the packed weight's life so every call
    rounds alike. one_digit (with integer dots): each block of 32 inputs is rounded to one signed
    byte under its largest instead of three exact digits (a third of the integer work; for a draft,
    whose precision only changes what it proposes: runtime.quant.quantize_q4)."""
    if integer_dots is None:
        integer_dots = state().vnni
    elif integer_dots and VNNI_FLAG not in cpu_flags():
        raise ValueError("pack_quant(integer_dots=True): this CPU has no AVX512-VNNI, so linear_quant "
                         "could not run the weight; pass integer_dots=None (the CPU's choice) or False")
    if one_digit and not integer_dots:
        raise ValueError("pack_quant(one_digit=True) rounds inputs for integer dot products, which this "
                         "packing does not use (no AVX512-VNNI, or integer_dots=False); pack with "
                         "one_digit=False")
    in_features = parts[0][2].shape[1]
    flags = int(bool(integer_dots)) | (2 if one_digit else 0)
    header = [QUANT_MAGIC, len(parts), in_features, sum(p[2].shape[0] for p in parts), flags]
    blobs, offset = [], _align(8 * (5 + 6 * len(parts)))
    for kind, block, codes, scales, offsets in parts:
        if codes.shape[1] != in_features:
            raise ValueError(f"fused parts differ in input width: {codes.shape[1]} vs {in_features}")
        blob, scale_bytes, rec_bytes = (_byte_records if one_digit else _records)(kind, block, codes, scales, offsets)
        header += [kind, codes.shape[0], block, scale_bytes, rec_bytes, offset]
        blobs.append((offset, blob))
        offset = _align(offset + blob.numel())
    out = torch.zeros(offset, dtype=torch.uint8)
    out[:8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for start, blob in blobs:
        out[start:start + blob.numel()] = blob
    return out


def _words(values: torch.Tensor, groups: int, blocks: int, zmms: int, bits: int) -> torch.Tensor:
    """[O, I] small ints -> per (group, block) `zmms` x 16 uint32 lanes (lane o = output o), each
    holding 32 / zmms inputs of `bits` bits, input j of a word in bits bits*j..; as bytes."""
    per = 32 // zmms
    v = values.view(groups, QUANT_LANES, blocks, zmms, per).permute(0, 2, 3, 1, 4)
    words = (v << (bits * torch.arange(per))).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)        # the same 32 bits as int32
    return words.to(torch.int32).contiguous().view(groups, blocks, zmms * QUANT_LANES).view(torch.uint8)


# one digit (csrc/linear_quant_vnni.cpp ByteCodes): a record's byte j of word w holds input
# BYTE_ORDER[w][j], the activation words' order (word 2k + h: inputs 8k + h + {0, 2, 4, 6}); kind
# 5's high bits: bit 8b + p of a lane's word is input HIGH_ORDER[8b + p] = 8 (p // 2) + 2b + p % 2
BYTE_ORDER = torch.tensor([[8 * (w // 2) + w % 2 + 2 * j for j in range(4)] for w in range(8)])
HIGH_ORDER = torch.tensor([8 * (p // 2) + 2 * b + p % 2 for b in range(4) for p in range(8)])
ZERO_POINT = {(5, 32): 16, (8, 32): 128, (8, 16): 32}     # u = c + Z: codes as unsigned bytes


def _byte_records(kind: int, block: int, codes: torch.Tensor, scales: torch.Tensor,
                  offsets: Optional[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """One segment's one-digit records (csrc/linear_quant_vnni.cpp ByteCodes: 32 inputs of 16
    outputs whatever the file's block): kind 4 as _records; kind 5 with its high bits in
    HIGH_ORDER; kind 8 as unsigned bytes in BYTE_ORDER with one scale vector per 16 or 32 inputs."""
    if kind == 4:
        return _records(kind, block, codes, scales, offsets)
    out_features, in_features = codes.shape
    if in_features % 32:
        raise ValueError(f"one digit: input width {in_features} is not a multiple of 32")
    groups, blocks = -(-out_features // QUANT_LANES), in_features // 32
    pad = groups * QUANT_LANES - out_features
    if (kind, block) not in ZERO_POINT:
        raise ValueError(f"one digit: kind {kind} with block {block} has no kernel (known: "
                         f"{sorted(ZERO_POINT)} and kind 4 with block 32)")
    u = torch.nn.functional.pad(codes.to(torch.int64) + ZERO_POINT[kind, block], (0, 0, 0, pad))
    u = u.view(groups, QUANT_LANES, blocks, 32)                        # [group, lane, block, input]
    scale_dtype = _scale_dtype([scales])
    per = 32 // block                                                 # scale vectors a record
    lanes = (torch.nn.functional.pad(scales, (0, 0, 0, pad)).to(scale_dtype)
             .view(groups, QUANT_LANES, blocks, per).permute(0, 2, 3, 1).contiguous()
             .view(groups, blocks, -1).view(torch.uint8))
    if kind == 5:
        nibbles = _words(u.reshape(-1, in_features) & 0x0F, groups, blocks, 4, 4)
        bits = (u[..., HIGH_ORDER] >> 4) << torch.arange(32)          # [group, lane, block, 32]
        high = bits.sum(-1)
        high = torch.where(high >= 2 ** 31, high - 2 ** 32, high).to(torch.int32)
        high = high.permute(0, 2, 1).contiguous().view(groups, blocks, -1).view(torch.uint8)
        recs = torch.cat([nibbles, high, lanes], dim=-1)
    else:
        b = u[..., BYTE_ORDER].to(torch.uint8)                        # [group, lane, block, word, byte]
        b = b.permute(0, 2, 3, 1, 4).contiguous().view(groups, blocks, -1)
        recs = torch.cat([b, lanes], dim=-1)
    return recs.reshape(-1), scale_dtype.itemsize, recs.shape[-1]


def _scale_dtype(factors: list) -> torch.dtype:
    """fp16 where every scale (and offset) is exact in it, else fp32."""
    return torch.float16 if all(torch.equal(f.half().float(), f) for f in factors) else torch.float32


def _align(n: int) -> int:
    return -(-n // 64) * 64


def _records(kind: int, block: int, codes: torch.Tensor, scales: torch.Tensor,
             offsets: Optional[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """One segment's records: [groups, blocks, record bytes] flattened; (blob, scale bytes, record bytes)."""
    out_features, in_features = codes.shape
    groups, blocks = -(-out_features // QUANT_LANES), in_features // block
    pad = groups * QUANT_LANES - out_features
    factors = [scales] + ([offsets] if kind == 4 else [])
    scale_dtype = _scale_dtype(factors)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    lanes = [torch.nn.functional.pad(f, (0, 0, 0, pad)).to(scale_dtype)
             .view(groups, QUANT_LANES, blocks).transpose(1, 2).contiguous().view(groups, blocks, -1)
             .view(torch.uint8) for f in factors]
    if kind in (4, 5):   # zmm k, lane o: a uint32 of the codes of inputs 8k..8k+7, input 8k+j in bits 4j..
        c = codes.to(torch.int64) + (16 if kind == 5 else 0)              # kind 5: codes -16..15 -> 0..31
        nibbles = _words(c & 0x0F, groups, blocks, 4, 4)
        high = [_words(c >> 4, groups, blocks, 1, 1)] if kind == 5 else []  # lane o: bit j = input j's
        recs = torch.cat([nibbles] + high + lanes, dim=-1)
    else:           # input-major int8: 16 outputs per input
        c = codes.to(torch.int8).view(groups, QUANT_LANES, blocks, block).permute(0, 2, 3, 1)
        recs = torch.cat([c.contiguous().view(groups, blocks, -1).view(torch.uint8)] + lanes, dim=-1)
    return recs.reshape(-1), scale_dtype.itemsize, recs.shape[-1]

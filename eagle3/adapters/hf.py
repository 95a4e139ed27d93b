"""Generic target: any Hugging Face transformers causal LM, behind the LlamaModel interface.

Slower than a native model, never different: the HF model runs its own forward; we only
- find the decoder stack, even inside a wrapper (`Kimi_K25ForConditionalGeneration.model.
  language_model.layers`, or any module whose `.language_model` holds the decoder);
- capture the residual stream *entering* decoder layer i with a forward pre-hook ("input to layer
  i", = HF `output_hidden_states[i]`), registered for one call and removed after it;
- pass our block mask as a custom 4D mask (HF returns such masks untouched) with explicit
  position ids, so a tree of draft tokens is verified in one forward;
- wrap the HF DynamicCache in `HFCache`, which has the KVCache interface (`length`, check_room,
  advance, truncate, keep). `keep` selects sequence slots in every layer's cached tensors, whatever
  they hold: per-head K/V, or the compressed MLA latents (kv_lora_rank + rope dims, one "head")
  that DeepseekV3 caches in this transformers version.

Cache layers that cannot be compacted exactly (sliding window, linear attention, quantised) are
rejected when the cache is created, never approximated.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from ..errors import ContractError, LoadError, UnsupportedError
from ..models.config import RopeConfig, check_capture_ids, default_capture_ids
from ..models.llama import ForwardOutput
from ..models.kv_cache import check_room

# attribute names of a decoder stack: (layer list, token embedding)
LAYER_ATTRS = ("layers", "h")
EMBED_ATTRS = ("embed_tokens", "wte", "word_embeddings")


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class TargetConfig:
    """The subset of ModelConfig that a generic target can state (same field names; its facts for the
    exporter and the doctor: models.target.TargetFacts.of(config))."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Optional[RopeConfig]        # None: the target's rope has no native equivalent
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    attention: str = "mha"            # "mha" (per-head K/V cache) | "mla" (latent cache)

    @classmethod
    def from_hf(cls, text_cfg: Any, architecture: str) -> "TargetConfig":
        """From a transformers text (decoder) config object."""
        get = lambda *names, default=None: next(  # noqa: E731
            (getattr(text_cfg, n) for n in names if getattr(text_cfg, n, None) is not None), default)
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        mla = get("kv_lora_rank") is not None
        eos = get("eos_token_id")
        return cls(
            architecture=architecture, vocab_size=int(get("vocab_size")), hidden_size=hidden,
            intermediate_size=int(get("intermediate_size", "n_inner", default=4 * hidden)),
            num_layers=int(get("num_hidden_layers")), num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", default=heads)),
            head_dim=hidden // heads if mla else int(get("head_dim", default=hidden // heads)),
            rms_norm_eps=float(get("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps",
                                   default=1e-6)),
            rope=_native_rope(text_cfg), max_position=int(get("max_position_embeddings",
                                                              "n_positions", default=2048)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else
            ((int(eos),) if eos is not None else ()),
            attention="mla" if mla else "mha")

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        return default_capture_ids(self.num_layers)


def _native_rope(text_cfg: Any) -> Optional[RopeConfig]:
    try:
        return RopeConfig.from_hf(text_cfg.to_dict())
    except UnsupportedError:
        return None  # e.g. yarn: stated as None, so a draft built from it must bring its own


# ---------------------------------------------------------------------------- cache
class HFCache:
    """KVCache interface over a transformers DynamicCache (which grows by concatenation).

    `length` counts live slots; the HF forward appends a block, then `advance(T)` records it and
    checks that the HF cache agrees. `keep(start, kept)` keeps slots [0, start) and start+kept, in
    order, in every layer; `truncate(n)` drops slots from n on.
    """

    def __init__(self, hf_cache: Any, max_len: int, batch: int = 1):
        for i, layer in enumerate(getattr(hf_cache, "layers", [])):
            if type(layer).__name__ != "DynamicLayer":
                raise UnsupportedError(
                    f"cache layer {i} is a {type(layer).__name__}; the generic adapter compacts only "
                    "full-attention DynamicLayer caches (sliding-window, linear-attention and "
                    "quantised caches cannot keep an arbitrary subset of a tree block exactly)")
        self.hf = hf_cache
        self.max_len = max_len
        self.batch = batch
        self.length = 0

    def check_room(self, num_new: int) -> None:
        check_room(self.length, num_new, self.max_len)

    def advance(self, num_new: int) -> None:
        self.check_room(num_new)
        self.length += num_new
        self.check_sync()

    def check_sync(self) -> None:
        stored = self.hf.get_seq_length()
        if stored != self.length:
            raise RuntimeError(f"HF cache holds {stored} slots but HFCache.length is {self.length}: "
                               "the cache was written outside HFTarget.forward")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} outside [0, {self.length}]")
        if length < self.length:
            self.hf.crop(length - self.length)   # this transformers takes a negative count
        self.length = length

    def keep(self, start: int, kept: torch.Tensor) -> None:
        """Keep only block slots `start + kept` (sorted, relative to start), compacted to start.."""
        n = int(kept.numel())
        if not 0 <= start <= self.length or start + n > self.length:
            raise ValueError(f"keep({start}, {n} slots) outside the {self.length} live slots")
        for layer in self.hf.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            idx = _keep_index(start, kept, layer.keys.device)
            # keys/values [B, heads or 1 (MLA latent), S, D]: the sequence is always dim -2
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        self.length = start + n
        self.check_sync()

    def reset(self) -> None:
        self.hf.reset()
        self.length = 0


def _keep_index(start: int, kept: torch.Tensor, device: torch.device) -> torch.Tensor:
    prefix = torch.arange(start, device=device)
    return torch.cat([prefix, kept.to(device=device, dtype=torch.long) + start])


# ---------------------------------------------------------------------------- model discovery
def _child(module: nn.Module, names: Sequence[str]) -> Optional[nn.Module]:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Module)),
                None)


def find_decoder(model: nn.Module) -> str:
    """Path of the decoder stack: the module holding the layer list and the token embedding.

    Several candidates (a vision tower with its own stack) are resolved by the embedding that the
    whole model uses for input ids.
    """
    cands = []
    for name, mod in model.named_modules():
        layers = _child(mod, LAYER_ATTRS)
        if isinstance(layers, nn.ModuleList) and len(layers) and \
                isinstance(_child(mod, EMBED_ATTRS), nn.Embedding):
            cands.append((name, mod))
    if len(cands) > 1 and hasattr(model, "get_input_embeddings"):
        emb = model.get_input_embeddings()
        cands = [(n, m) for n, m in cands if _child(m, EMBED_ATTRS) is emb]
    if len(cands) != 1:
        raise UnsupportedError(
            f"{type(model).__name__}: found {len(cands)} decoder stacks "
            f"({[n or '<root>' for n, _ in cands]}); expected exactly one module with a layer list "
            f"({'/'.join(LAYER_ATTRS)}) and a token embedding ({'/'.join(EMBED_ATTRS)}). Pass "
            "decoder_path= to HFTarget to name it")
    return cands[0][0]


def find_lm(model: nn.Module, decoder_path: str, vocab_size: int) -> str:
    """Path of the innermost module at or above the decoder that produces vocabulary logits."""
    parts = decoder_path.split(".") if decoder_path else []
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        mod = model.get_submodule(path)
        head = mod.get_output_embeddings() if hasattr(mod, "get_output_embeddings") else None
        if isinstance(head, nn.Module) and getattr(head, "weight", None) is not None \
                and head.weight.shape[0] == vocab_size:
            return path
    raise UnsupportedError(
        f"{type(model).__name__}: no module at or above {decoder_path or '<root>'} has an output "
        f"embedding of {vocab_size} rows (get_output_embeddings()); a causal LM head is required")


def _cache_kwarg(lm: nn.Module) -> str:
    params = inspect.signature(lm.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UnsupportedError(f"{type(lm).__name__}.forward takes neither cache= nor past_key_values=")


# ---------------------------------------------------------------------------- loading
def load_hf_model(hf_dir: str | os.PathLike, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> nn.Module:
    """transformers' own class for `architectures[0]`, from local safetensors only, SDPA attention."""
    import transformers
    hf_dir = Path(hf_dir)
    from ..runtime.loader import checkpoint_files, read_hf_config
    checkpoint_files(hf_dir)  # raises LoadError unless safetensors are there
    hf = read_hf_config(hf_dir)
    arch = (hf.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        if not (hf.get("auto_map") and trust_remote_code):
            raise LoadError(
                f"{hf_dir}: architecture {arch!r} is not in transformers {transformers.__version__}"
                + ("; its code ships with the checkpoint (auto_map): pass trust_remote_code=True "
                   "only if you trust that code" if hf.get("auto_map") else
                   "; upgrade transformers or convert the checkpoint to a supported architecture"))
        cls = transformers.AutoModelForCausalLM
    try:
        model, info = cls.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True,
                                          use_safetensors=True, attn_implementation="sdpa",
                                          trust_remote_code=trust_remote_code,
                                          output_loading_info=True)
    except (OSError, ValueError) as e:
        raise LoadError(f"{hf_dir}: transformers could not load {arch} ({e})") from None
    check_loading_info(hf_dir, info)
    return model.to(device).eval()


def check_loading_info(hf_dir: Path, info: dict) -> None:
    """transformers initialises missing weights randomly and only warns: refuse instead."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [str(m) for m in info.get("mismatched_keys") or []]
    if missing or mismatched:
        raise LoadError(f"{hf_dir}: checkpoint does not match its config: missing "
                        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, shape mismatches "
                        f"{mismatched[:3]}")


# ---------------------------------------------------------------------------- target
class HFTarget(nn.Module):
    """A transformers causal LM behind the models.target.Target protocol (LlamaModel's interface).

    `model` may be the causal LM itself or any wrapper around it. Weights stay where they are.
    """

    def __init__(self, model: nn.Module, decoder_path: Optional[str] = None):
        super().__init__()
        self.hf_model = model.eval()
        self.decoder_path = decoder_path if decoder_path is not None else find_decoder(model)
        decoder = model.get_submodule(self.decoder_path)
        text_cfg = getattr(decoder, "config", None) or model.config.get_text_config(decoder=True)
        self.text_config = text_cfg
        arch = type(model).__name__
        self.config = TargetConfig.from_hf(text_cfg, arch)
        self.lm_path = find_lm(model, self.decoder_path, self.config.vocab_size)
        self._cache_kw = _cache_kwarg(self.lm)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(
            self.lm.forward).parameters
        if len(self.layers) != self.config.num_layers:
            raise ContractError("num_hidden_layers", len(self.layers), self.config.num_layers,
                                "the decoder stack found does not match the text config; pass "
                                "decoder_path= naming the right module")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, hf_dir: Path | str, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False) -> "HFTarget":
        """Load a local HF directory (safetensors only, no hub access) with transformers' class."""
        return cls(load_hf_model(Path(hf_dir), device, dtype, trust_remote_code))

    # ------------------------------------------------------------------ parts (LlamaModel names)
    @property
    def decoder(self) -> nn.Module:
        return self.hf_model.get_submodule(self.decoder_path)

    @property
    def lm(self) -> nn.Module:
        return self.hf_model.get_submodule(self.lm_path)

    @property
    def layers(self) -> nn.ModuleList:
        return _child(self.decoder, LAYER_ATTRS)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return _child(self.decoder, EMBED_ATTRS)

    @property
    def device(self) -> torch.device:
        """Where the inputs go: the device of the token embedding."""
        return self.embed_tokens.weight.device

    @property
    def lm_head(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    @property
    def norm(self) -> Optional[nn.Module]:
        return _child(self.decoder, ("norm", "ln_f", "final_layernorm"))

    def new_cache(self, max_len: int, batch: int = 1) -> HFCache:
        from transformers import DynamicCache
        return HFCache(DynamicCache(config=self.text_config), max_len, batch)

    def check_capture_ids(self, capture_ids: Sequence[int]) -> None:
        check_capture_ids(capture_ids, self.config.num_layers, self.config.default_aux_layer_ids)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: HFCache,
                attn_mask: Optional[torch.Tensor] = None,
                logits_rows: Optional[torch.Tensor | slice] = None,
                capture_ids: Sequence[int] = ()) -> ForwardOutput:
        """Same contract as LlamaModel.forward: a block [B, T] appended at cache.length.

        attn_mask: bool, broadcastable to [B, 1, T, cache.length + T], True = may attend;
        None = plain causal. capture_ids: "input to layer i", ascending.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        bsz, seq = input_ids.shape
        if positions.dim() == 1:
            positions = positions[None].expand(bsz, seq)
        if not isinstance(cache, HFCache):
            raise ContractError("cache", type(cache).__name__, "HFCache",
                                "create the cache with this target's new_cache()")
        cache.check_room(seq)
        cache.check_sync()
        if capture_ids:
            self.check_capture_ids(capture_ids)
        mask = self._hf_mask(attn_mask, cache.length, seq, input_ids.device)
        rows = _row_index(logits_rows, seq, input_ids.device)
        with self._hooks(capture_ids) as store:
            out = self.lm(input_ids=input_ids, position_ids=positions.to(torch.long),
                          attention_mask=mask, use_cache=True, **{self._cache_kw: cache.hf},
                          **self._logits_kwargs(rows))
        cache.advance(seq)
        logits = self._select_logits(out.logits if hasattr(out, "logits") else out[0], rows, seq)
        aux = torch.cat([store[i] for i in capture_ids], dim=-1) if capture_ids else None
        return ForwardOutput(logits, store["hidden"], aux)

    def _hf_mask(self, attn_mask: Optional[torch.Tensor], start: int, seq: int,
                 device: torch.device) -> Optional[torch.Tensor]:
        # -> None (one query sees everything) or a 4D mask HF passes through untouched
        if attn_mask is None:
            if seq == 1:
                return None
            cols = torch.arange(start + seq, device=device)
            attn_mask = (cols[None, :] <= torch.arange(start, start + seq, device=device)[:, None])
        mask = attn_mask.to(device=device, dtype=torch.bool)
        while mask.dim() < 4:
            mask = mask[None]
        if mask.shape[-1] != start + seq or mask.shape[-2] != seq:
            raise ContractError("attn_mask shape", tuple(attn_mask.shape),
                                f"[B|1, 1, {seq}, {start + seq}]",
                                "the mask covers the cached prefix plus the new block")
        impl = getattr(self.text_config, "_attn_implementation", "sdpa")
        if impl == "eager":
            dtype = self.embed_tokens.weight.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        if impl != "sdpa":
            raise UnsupportedError(f"attention implementation {impl!r} cannot take a custom tree "
                                   "mask; load the model with attn_implementation='sdpa'")
        return mask

    def _logits_kwargs(self, rows: Optional[torch.Tensor]) -> dict:
        if not self._takes_logits_to_keep:
            return {}
        return {"logits_to_keep": 0 if rows is None else rows}

    def _select_logits(self, logits: torch.Tensor, rows: Optional[torch.Tensor],
                       seq: int) -> Optional[torch.Tensor]:
        if rows is not None and rows.numel() == 0:
            return None
        if rows is not None and logits.shape[1] == seq and not self._takes_logits_to_keep:
            logits = logits[:, rows]
        return logits

    @contextlib.contextmanager
    def _hooks(self, capture_ids: Sequence[int]) -> Iterator[dict]:
        """Pre-hooks on the requested layers and a hook on the decoder output, for one call."""
        store: dict = {}
        handles = [self.layers[i].register_forward_pre_hook(_capture_input(store, i),
                                                            with_kwargs=True)
                   for i in capture_ids]
        handles.append(self.decoder.register_forward_hook(_capture_output(store)))
        try:
            yield store
        finally:
            for h in handles:
                h.remove()


def _capture_input(store: dict, layer_id: int):
    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        store[layer_id] = h.clone()   # [B, T, H] residual stream entering the layer
    return hook


def _capture_output(store: dict):
    def hook(module, args, output):
        h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        store["hidden"] = h            # [B, T, H] after the final norm
    return hook


def _row_index(logits_rows: Optional[torch.Tensor | slice], seq: int,
               device: torch.device) -> Optional[torch.Tensor]:
    if logits_rows is None:
        return None
    if isinstance(logits_rows, slice):
        return torch.arange(seq, device=device)[logits_rows]
    rows = torch.as_tensor(logits_rows, device=device)
    return rows.reshape(-1) if rows.dim() == 0 else rows

"""Argument groups shared by the entry points (eagle3 generate, serve, bench): one definition each,
and the one place a RunConfig is built from flags (run_config_from_args). docs/configuration.md
lists them (tests/test_settings.py checks it)."""
from __future__ import annotations

import argparse

from .config import DRAFT_WEIGHT_CHOICES, KV_CACHE_CHOICES, WEIGHT_CHOICES, RunConfig


MODEL_HELP = "target: .gguf, HF dir, qwen2.5-coder-0.5b, or the default SmolLM2"
DRAFT_HELP = ("draft checkpoint dir; 'default' = the shipped draft for the default model (any other "
              "model: as 'suffix'); 'suffix' = no draft model, blocks copied from suffix matches over the "
              "prompt and output, verified where they pay; 'none' = plain decoding (draft.names)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default="default", help=DRAFT_HELP)
    p.add_argument("--algorithm", choices=["eagle3", "eagle"], type=str.lower,
                   help="assert the draft's algorithm (read from the checkpoint; a mismatch is an error)")
    p.add_argument("--top-k", type=int, default=None, help="tree: children per node (1 = chain)")
    p.add_argument("--depth", type=int, default=None, help="tree: draft forwards per step")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tree: nodes verified per step, root included")
    p.add_argument("--min-prob", type=float, default=None,
                   help="tree: verify only draft tokens whose path probability under the draft is >= "
                        "this (dynamic tree size; default 0.05; 0 = always --num-draft-tokens)")
    p.add_argument("--suffix-tokens", type=int, default=None,
                   help="tree: up to this many extra nodes copied from suffix matches over the prompt "
                        "and output (0 = none)")
    p.add_argument("--policy", choices=["adaptive", "fixed"], default=None,
                   help="adaptive (default): each step picks a tree shape or plain decoding from this "
                        "machine's measured costs and the rolling acceptance; fixed: every step drafts "
                        "one shape (the default 4/5/8, or the one the tree flags give; any tree flag "
                        "implies fixed)")


def one_of(choices: tuple[str, ...]) -> str:
    return "{" + ",".join(choices) + "}"


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--weights / --draft-weights / --device / --threads: RunConfig's fields (generate, serve,
    bench); the backend switches come from the environment (eagle3.settings). The precision names
    are checked where the RunConfig is made (config.checked), not here."""
    p.add_argument("--weights", metavar=one_of(WEIGHT_CHOICES), default="auto",
                   help="target weights on CPU: gguf (a GGUF target's own quantized codes on the "
                        "kernels, in the fewest bytes; where the CPU has AVX512-VNNI each block of 32 "
                        "inputs is rounded to one byte for integer dot products, as llama.cpp runs the "
                        "file), gguf-exact (the same codes against exact inputs: the file's exact "
                        "model, within 1e-4 of fp64), fp32 (the dequantised "
                        "weights; matches HF transformers), bf16 (a different model numerically; "
                        "verify and decode stay bit-identical, so speculation stays lossless); auto "
                        "(default): gguf for a GGUF target, else fp32")
    p.add_argument("--draft-weights", metavar=one_of(DRAFT_WEIGHT_CHOICES), default="auto",
                   help="draft weights on CPU: q4 (4-bit blocks quantized at load, one-byte inputs, "
                        "on the kernels' integer dot products: ~2x faster draft forwards), bf16, fp32; "
                        "auto: q4 where it runs, else bf16 where oneDNN supports it, else fp32. The "
                        "draft only proposes, so the output is the same either way")
    p.add_argument("--kv-cache-dtype", metavar=one_of(KV_CACHE_CHOICES), default="auto",
                   help="the target's KV cache: fp16 (half the bytes attention reads; llama.cpp's "
                        "default), fp32; auto (default): fp16 where the GGUF codes meet one-byte "
                        "inputs (--weights gguf), else fp32. Lossless either way")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the cores this process may use; bench: for every system)")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's configuration: the flags of add_run_args, and the environment's switches."""
    return RunConfig(weights=args.weights, draft_weights=args.draft_weights,
                     kv_cache_dtype=args.kv_cache_dtype, device=args.device, threads=args.threads)


SHAPE_FLAGS = ("top_k", "depth", "num_draft_tokens", "min_prob", "suffix_tokens")


def spec_from_args(args: argparse.Namespace):
    """The fixed tree shape the flags ask for, or None for the adaptive step (load_engine's default)."""
    from .errors import InputError
    from .speculative.tree import SpecParams
    shaped = any(getattr(args, f, None) is not None for f in SHAPE_FLAGS)
    policy = getattr(args, "policy", None)
    if policy == "adaptive" and shaped:
        raise InputError("--policy adaptive chooses the tree shape itself; drop the tree flags "
                         f"({', '.join('--' + f.replace('_', '-') for f in SHAPE_FLAGS)}) or use "
                         "--policy fixed")
    if not shaped and policy != "fixed":
        return None
    base = SpecParams()
    return SpecParams(top_k=args.top_k or base.top_k, depth=args.depth or base.depth,
                      num_draft_tokens=args.num_draft_tokens or base.num_draft_tokens,
                      min_prob=base.min_prob if args.min_prob is None else args.min_prob,
                      suffix_tokens=args.suffix_tokens or 0)

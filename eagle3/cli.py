"""The `eagle3` command line: generate, info, serve, train, export, doctor, bench.

Subcommands owned by other packages are thin wrappers over their `*_main(argv)` functions, imported
only when used, so `eagle3 generate` does not pay for the server or the trainer.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from .cli_args import MODEL_HELP, add_run_args, add_spec_args, run_config_from_args, spec_from_args
from .errors import Eagle3Error

DELEGATED = {  # subcommand -> (module, function, help)
    "serve": ("eagle3.serve", "serve_main", "OpenAI-compatible server with speculation metrics"),
    "train": ("eagle3.train", "train_main", "train an EAGLE-3 draft for a target"),
    "export": ("eagle3.export.cli", "export_main", "export a draft for SGLang / vLLM / llama.cpp"),
    "doctor": ("eagle3.doctor.cli", "doctor_main", "check a target/draft pair or a launch line"),
    "bench": ("eagle3.bench.cli", "bench_main", "benchmark against HF transformers and llama.cpp; "
              "`bench serve`: the server under concurrent clients"),
}


def generate_cmd(args: argparse.Namespace) -> int:
    from .api import load_engine
    from .generate import SamplingParams
    engine = load_engine(args.model, args.draft, spec_from_args(args), config=run_config_from_args(args),
                         max_model_len=args.max_model_len, algorithm=args.algorithm)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.sample_top_k,
                            seed=args.seed, max_new_tokens=args.max_new_tokens,
                            stop=tuple(args.stop or ()), speculative=not args.no_speculation)
    result = None
    for chunk in engine.stream(args.prompt, params, chat=not args.raw):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    mode = "speculative" if engine.speculative and params.speculative else "plain"
    print(f"[{mode}] {len(result.token_ids)} tokens in {result.wall_s:.2f} s = "
          f"{result.tokens_per_s:.1f} tok/s, tau {result.tau:.2f}, finish {result.finish_reason}",
          file=sys.stderr)
    if result.arms:
        print("[adaptive] steps per choice: " + ", ".join(f"{k} {v}" for k, v in
                                                          sorted(result.arms.items())), file=sys.stderr)
    if engine.monitor is not None and engine.monitor.degraded:
        print("WARNING: acceptance is at 1.0 (nothing accepted); run `eagle3 doctor`", file=sys.stderr)
    return 0


def info_cmd(args: argparse.Namespace) -> int:
    from .models import ModelConfig
    from .engines import NESTED_OUTPUT
    from .runtime.loader import read_hf_config, resolve_model
    src = resolve_model(args.model)
    cfg = ModelConfig.from_hf(read_hf_config(src.hf_dir))
    rows = [("source", str(src.gguf or src.hf_dir)), ("architecture", cfg.architecture),
            ("layers", cfg.num_layers), ("hidden", cfg.hidden_size),
            ("heads / kv heads / head_dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
            ("intermediate", cfg.intermediate_size), ("vocab", cfg.vocab_size),
            ("tied embeddings", cfg.tie_word_embeddings), ("rope", cfg.rope),
            ("default capture ids (input to layer i)", list(cfg.default_aux_layer_ids)),
            ("same ids, output-of-layer convention (SpecForge eagle_config)",
             NESTED_OUTPUT.as_stored(cfg.default_aux_layer_ids))]
    from .kernels import why
    from .threads import describe
    rows.append(("CPU small-M linear kernels", why()))
    if src.gguf is not None:
        from .kernels import quant_linear
        from .runtime.quant import tensor_types
        kernels_on = quant_linear() is not None
        rows.append(("--weights gguf (auto) linears" + ("" if kernels_on else ": all dequantised here"),
                     tensor_types(src.gguf, cfg.tie_word_embeddings)))
        if kernels_on:
            from .layouts import gguf_inputs
            rows.append(("--weights gguf (auto) inputs", gguf_inputs(True)))
            rows.append(("--weights gguf-exact inputs", gguf_inputs(False)))
    from . import kernels
    one_byte = src.gguf is not None and kernels.quant_linear() is not None and kernels.integer_dots()
    rows.append(("--kv-cache-dtype auto", "fp16 (the codes meet one-byte inputs: llama.cpp's cache type)"
                 if one_byte else "fp32 (fp16 only beside one-byte inputs: --weights gguf on AVX512-VNNI)"))
    from .layouts import q4_draft_unavailable, resolve_draft_weights
    choice = resolve_draft_weights("auto")
    rows.append(("--draft-weights auto", choice + ("" if choice == "q4" else f" (no q4: {q4_draft_unavailable()})")))
    rows.append(("CPU threads", describe()))
    from .memory import describe as allocator
    rows.append(("C allocator", allocator()))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(environment_text())
    return 0


def environment_text() -> str:
    """`eagle3 info`'s last block: every EAGLE3_* variable (eagle3.settings) and its value here."""
    from .settings import current
    rows = current()
    width = max(len(name) for name, _ in rows)
    return "\n".join(["environment (docs/configuration.md):"] + [f"  {name:<{width}}  {value}" for name, value in rows])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text (speculative when a draft is available)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    add_spec_args(g)
    add_run_args(g)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k (0 = off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-speculation", action="store_true",
                   help="decode plainly with the draft loaded (the request-level switch a server "
                        "request sets with \"speculation\": false)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.set_defaults(func=generate_cmd)
    i = sub.add_parser("info", help="architecture, layers, hidden, vocab, default capture ids; this "
                       "machine's backends; the EAGLE3_* environment")
    i.add_argument("model", nargs="?", default=None)
    i.set_defaults(func=info_cmd)
    for name, (_, _, help_text) in DELEGATED.items():
        d = sub.add_parser(name, help=help_text, add_help=False)
        d.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from . import tune_process
    tune_process()      # first: OpenMP reads its wait policy when torch loads (nothing above imports it)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and any(a.split("=")[0] == "--from-traffic" for a in argv):
        from .learn.process import from_traffic_main      # the learning round, offline
        return _guard(lambda: from_traffic_main(argv[1:]))
    if argv and argv[0] in DELEGATED:
        module, func, _ = DELEGATED[argv[0]]
        runner = getattr(importlib.import_module(module), func)
        return _guard(lambda: runner(argv[1:]))
    args = build_parser().parse_args(argv)
    return _guard(lambda: args.func(args))


def _guard(fn) -> int:
    try:
        return int(fn() or 0)
    except Eagle3Error as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

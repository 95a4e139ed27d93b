"""One call from names to a ready Engine: resolve the target, the draft and the tree shape.

Draft names are read by draft.names.resolve_draft_name; precision and the inference layouts are
layouts.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .config import RunConfig, use
from .draft.names import default_draft_path, resolve_draft_name  # noqa: F401 (serve/cli.py imports it here)
from .generate import Engine
from .layouts import build_layouts, draft_layout
from .memory import freeze_loaded


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_target(model: Optional[str], device: torch.device, dtype: torch.dtype):
    """Native model when the architecture is supported, else the generic HF adapter."""
    from .adapters import load_target as load_any
    from .runtime.loader import load_tokenizer, resolve_model
    return load_any(model, device, dtype), load_tokenizer(resolve_model(model).hf_dir)


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
    return draft_layout(drafter, config.draft_weights) if config.packed_draft else drafter


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
    choice = resolve_draft_name(draft, model)
    draft_path = choice.path
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
    if spec is None and adaptive and (drafter is not None or choice.suffix_only):
        # a target no draft is shipped for still speculates: suffix-only blocks (draft=None)
        policy = adaptive_policy(target, drafter, remeasure=config.remeasure)
    engine = Engine(target, tokenizer, draft=drafter, spec=spec, max_model_len=max_model_len,
                    policy=policy)
    freeze_loaded()     # the garbage collector's passes then skip the loaded engine's objects
    return engine

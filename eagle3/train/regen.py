"""Regenerate assistant responses with the target itself (batched, left-padded, resumable).

Left padding: row b holds its prompt right-aligned; positions = cumsum(key_valid) - 1, so every
row's first real token sits at position 0, and a query may attend only to valid (non-pad) keys
at or before it. Decode steps pass a [B, 1, 1, S] mask of valid keys. Rows that finish (eos or
max_new_tokens) leave the batch, so the cache shrinks with the live rows.

Output: one JSON line per conversation {id, prompt, temperature, prompt_ids, response_ids, finish};
response_ids ends with the eos token when finish == "eos". A manifest json sits next to it.

`write_dataset_responses` writes the same format with the dataset's own assistant reply instead
(finish = "dataset", temperature null): no generation cost. The training labels are the target's
distribution at every position either way; only the context the draft sees differs from what the
target itself would have written.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..sampling import sample_rows
from ..models.llama import LlamaModel
from .data import Prompt


@dataclass(frozen=True)
class RegenConfig:
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    batch_size: int = 32
    temperatures: tuple[float, ...] = (0.0, 1.0)   # conversation i uses temperatures[i % len]
    seed: int = 0


class Generated(NamedTuple):
    tokens: list[list[int]]     # per row: new tokens (eos included when it stopped on eos)
    finished: list[bool]        # per row: stopped on eos


# ---------------------------------------------------------------------------- batched generation
def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T], key_valid bool [B, T] with prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[b, width - len(p):] = True
    return ids, valid


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    # valid [B, T] -> [B, 1, T, T]: causal AND key is not padding
    seq = valid.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (causal[None] & valid[:, None, :])[:, None]


def pick_tokens(logits: torch.Tensor, temps: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # logits [B, V], temps [B] (0 = greedy) -> [B]; sampled rows draw from softmax(logits / t)
    # through the decoder's sampler, in row order, one draw per sampled row
    tokens = logits.argmax(-1)
    hot = (temps > 0).nonzero()[:, 0]
    if len(hot):
        probs = torch.softmax(logits[hot].float() / temps[hot, None], dim=-1)
        tokens[hot] = sample_rows(probs, gen)
    return tokens


def generate_batch(model: LlamaModel, prompts: Sequence[Sequence[int]], temps: Sequence[float],
                   max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
                   gen: torch.Generator) -> Generated:
    """Generate for a batch of token prompts with left padding; returns each row's new tokens."""
    ids, valid = left_pad(prompts, pad_id)
    bsz, width = ids.shape
    cache = model.new_cache(width + max_new_tokens, bsz)
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(ids, positions, cache, attn_mask=prefill_mask(valid), logits_rows=slice(-1, None)).logits
    live = torch.arange(bsz)                      # original row of each live batch row
    temps_t = torch.tensor(list(temps), dtype=torch.float32)
    next_pos = positions[:, -1] + 1
    out: list[list[int]] = [[] for _ in range(bsz)]
    finished = [False] * bsz
    eos = torch.tensor(list(eos_ids), dtype=torch.long)
    for step in range(max_new_tokens):
        tok = pick_tokens(logits[:, -1], temps_t[live], gen)
        for row, t in zip(live.tolist(), tok.tolist()):
            out[row].append(t)
        done = torch.isin(tok, eos)
        for row in live[done].tolist():
            finished[row] = True
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        keep = (~done).nonzero()[:, 0]
        if len(keep) < len(live):
            live, tok, next_pos, valid = live[keep], tok[keep], next_pos[keep], valid[keep]
            cache = cache.take_rows(keep)
        valid = torch.cat([valid, torch.ones(len(live), 1, dtype=torch.bool)], dim=1)
        mask = valid[:, None, None, :]                                        # [B, 1, 1, S]
        logits = model(tok[:, None], next_pos[:, None], cache, attn_mask=mask).logits
        next_pos = next_pos + 1
    return Generated(out, finished)


# ---------------------------------------------------------------------------- resumable job
def done_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue                              # a half-written last line from a killed run
    return ids


def write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def encode_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


class RegenJob(NamedTuple):
    prompts: list[Prompt]
    out_jsonl: Path
    manifest: Path
    source: dict


def run_regen(model: LlamaModel, tokenizer, job: RegenJob, cfg: RegenConfig,
              progress: Optional[Callable] = None) -> dict:
    """Generate responses for all prompts not yet in job.out_jsonl; returns the manifest dict."""
    eos_ids = list(model.config.eos_token_ids) or [tokenizer.eos_token_id]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    have = done_ids(job.out_jsonl)
    todo = [(i, p) for i, p in enumerate(job.prompts) if p.id not in have]
    rows = _length_sorted(_encode_rows(tokenizer, todo, cfg), 8 * cfg.batch_size)
    manifest = _load_manifest(job, cfg)
    manifest["dropped_long_prompts"] = len(job.prompts) - len(have) - len(rows)
    bar = progress(total=len(have) + len(rows), initial=len(have)) if progress else None
    t_start = time.time()
    with open(job.out_jsonl, "a", encoding="utf-8") as f:
        for chunk in _chunks(rows, cfg.batch_size):
            recs, stats = _generate_rows(model, chunk, cfg, eos_ids, pad_id)
            for r in recs:
                f.write(json.dumps(r) + "\n")
            f.flush()
            _update_manifest(manifest, stats, time.time() - t_start, len(recs))
            t_start = time.time()
            write_json_atomic(job.manifest, manifest)
            if bar:
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{manifest['new_tokens_per_s']:.1f}")
    if bar:
        bar.close()
    return manifest


def write_dataset_responses(tokenizer, job: RegenJob, eos_id: int, max_prompt_tokens: int = 256,
                            max_response_tokens: int = 448, exclude: frozenset[str] = frozenset(),
                            limit: Optional[int] = None) -> dict:
    """Conversations = chat-templated prompt + the dataset's reply + eos, for prompts not in
    job.out_jsonl or `exclude` (e.g. ids already regenerated); resumable; returns the manifest."""
    have = done_ids(job.out_jsonl)
    manifest = json.loads(job.manifest.read_text()) if have and job.manifest.is_file() else {
        "source": job.source, "responses": "dataset", "max_prompt_tokens": max_prompt_tokens,
        "max_response_tokens": max_response_tokens, "conversations": 0, "response_tokens": 0,
        "prompt_tokens": 0, "skipped": {}}
    skipped = manifest["skipped"]
    with open(job.out_jsonl, "a", encoding="utf-8") as f:
        for p in job.prompts:
            if limit is not None and manifest["conversations"] >= limit:
                break
            if p.id in have or p.id in exclude:
                continue
            reason = _reply_problem(p.response)
            ids = encode_prompt(tokenizer, p.text) if reason is None else []
            if reason is None and len(ids) > max_prompt_tokens:
                reason = "long_prompt"
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            reply = tokenizer.encode(p.response.strip(), add_special_tokens=False)
            resp = reply[:max_response_tokens] + ([eos_id] if len(reply) <= max_response_tokens else [])
            f.write(json.dumps({"id": p.id, "prompt": p.text, "temperature": None, "prompt_ids": ids,
                                "response_ids": resp, "finish": "dataset"}) + "\n")
            manifest["conversations"] += 1
            manifest["response_tokens"] += len(resp)
            manifest["prompt_tokens"] += len(ids)
    write_json_atomic(job.manifest, manifest)
    return manifest


def _reply_problem(reply: Optional[str]) -> Optional[str]:
    if not reply or len(reply.strip()) < 8:
        return "no_reply"
    return "non_english_reply" if sum(c.isascii() for c in reply) / len(reply) < 0.9 else None


def _chunks(items: list, n: int) -> list[list]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _length_sorted(rows: list, window: int) -> list:
    """Sort by prompt length inside windows of `window` rows (less padding, order stays local)."""
    return [r for i in range(0, len(rows), window)
            for r in sorted(rows[i:i + window], key=lambda r: len(r[1]))]


def _encode_rows(tokenizer, chunk, cfg: RegenConfig) -> list[tuple[Prompt, list[int], float]]:
    rows = []
    for i, p in chunk:
        ids = encode_prompt(tokenizer, p.text)
        if len(ids) <= cfg.max_prompt_tokens:
            rows.append((p, ids, cfg.temperatures[i % len(cfg.temperatures)]))
    return rows


def _generate_rows(model, rows, cfg: RegenConfig, eos_ids, pad_id) -> tuple[list[dict], dict]:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(rows[0][0].id.encode()) % 1_000_003)
    t0 = time.time()
    res = generate_batch(model, [r[1] for r in rows], [r[2] for r in rows], cfg.max_new_tokens,
                         eos_ids, pad_id, gen)
    recs = [{"id": p.id, "prompt": p.text, "temperature": t, "prompt_ids": ids, "response_ids": out,
             "finish": "eos" if fin else "length"}
            for (p, ids, t), out, fin in zip(rows, res.tokens, res.finished)]
    stats = {"new_tokens": sum(len(o) for o in res.tokens), "prompt_tokens": sum(len(r[1]) for r in rows),
             "eos": sum(res.finished), "gen_s": time.time() - t0}
    return recs, stats


def _load_manifest(job: RegenJob, cfg: RegenConfig) -> dict:
    # a manifest counts what its jsonl holds: without the jsonl (a fresh checkout keeps the committed
    # manifest but not the ignored data) it describes nothing and the run starts from zero
    if job.manifest.is_file() and done_ids(job.out_jsonl):
        m = json.loads(job.manifest.read_text())
        m["resumed"] = m.get("resumed", 0) + 1
        return m
    return {"source": job.source, "settings": asdict(cfg), "prompts_selected": len(job.prompts),
            "conversations": 0, "new_tokens": 0, "prompt_tokens": 0, "finished_eos": 0,
            "wall_s": 0.0, "resumed": 0}


def _update_manifest(m: dict, stats: dict, wall_s: float, n: int) -> None:
    m["conversations"] += n
    m["new_tokens"] += stats["new_tokens"]
    m["prompt_tokens"] += stats["prompt_tokens"]
    m["finished_eos"] += stats["eos"]
    m["wall_s"] = round(m["wall_s"] + wall_s, 1)
    m["new_tokens_per_s"] = round(m["new_tokens"] / max(m["wall_s"], 1e-9), 1)

"""Reading traffic: captured shards (tolerant of a damaged shard, with one log line) and OpenAI-style
logs of another engine (messages + the engine's reply), both as regenerated-data records."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple, Sequence

from ..errors import InputError

log = logging.getLogger("eagle3.learn")


class Shard(NamedTuple):
    path: Path
    records: list[dict]      # {"prompt_ids", "response_ids", ...}


def read_shard(path: Path) -> Shard:
    """A shard's complete conversations. A line that does not parse (a truncated or damaged shard)
    is skipped with one log line naming the file and how many conversations were kept."""
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            if isinstance(rec.get("prompt_ids"), list) and isinstance(rec.get("response_ids"), list):
                records.append(rec)
                continue
        except (json.JSONDecodeError, AttributeError):
            pass
        bad += bool(line.strip())
    if bad:
        log.warning("learn: traffic shard %s has %d damaged line(s) (truncated?); %d conversations "
                    "read, the damaged ones skipped", path.name, bad, len(records))
    return Shard(path, records)


def heldout_split(shards: Sequence[Path], fraction: float, earlier: Sequence[str]) -> tuple[list[Path], list[Path]]:
    """(train, held-out) shards: every shard held out before stays held out (no version ever trains
    on it), and the newest shards join it until it holds `fraction` of the tokens."""
    from .capture import shard_tokens
    held = [p for p in shards if p.name in set(earlier)]
    total = sum(shard_tokens(p) for p in shards)
    for p in reversed(shards):
        if sum(shard_tokens(h) for h in held) >= fraction * total:
            break
        if p not in held:
            held.append(p)
    if len(held) == len(shards) and len(shards) > 1:   # never hold out everything
        held = held[:-1] if shards[0] in held else held
    return [p for p in shards if p not in held], sorted(held)


# ---------------------------------------------------------------------------- other engines' logs
def openai_records(path: Path, tokenizer) -> list[dict]:
    """An OpenAI-style log (one JSON object a line: `messages` [+ a reply]) as records of ids: the
    prompt is the chat-templated messages before the reply, the reply is the assistant's text.
    Accepted reply fields: a last `assistant` message, `response` (text), or `choices[0].message`
    (an OpenAI response body)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not JSON ({e}). Fix: one object a line with 'messages' "
                             "and the reply") from None
        messages, reply = split_reply(rec, f"{path}:{n}")
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            reply_ids.append(int(tokenizer.eos_token_id))
        out.append({"prompt_ids": prompt, "response_ids": reply_ids,
                    "temperature": rec.get("temperature")})
    return out


def split_reply(rec: dict, where: str) -> tuple[list[dict], str]:
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: no 'messages' list. Fix: an OpenAI chat request's messages")
    if isinstance(rec.get("response"), str):
        return messages, rec["response"]
    choices = rec.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0].get("message"), dict):
        return messages, choices[0]["message"].get("content") or ""
    if messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str):
        return messages[:-1], messages[-1]["content"]
    raise InputError(f"{where}: no reply: expected a last 'assistant' message, 'response' or "
                     "'choices[0].message'")

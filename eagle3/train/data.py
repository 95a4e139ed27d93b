"""Training prompts: ShareGPT first human turns, cleaned, deduplicated, MT-bench held out.

The packaged ShareGPT JSON is truncated at the end, so the top-level array is parsed record by
record with `json.JSONDecoder.raw_decode`; the incomplete last record is dropped. MT-bench questions
are evaluation data and never training data: a prompt is dropped when its normalised text equals an
MT-bench turn, or when it shares any word n-gram (default 8 words) with one.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..errors import LoadError

_WS = re.compile(r"\s+")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class PromptFilter:
    min_chars: int = 8
    max_chars: int = 2000
    min_alpha_frac: float = 0.5     # drop code dumps / non-text junk
    min_ascii_frac: float = 0.9     # the default target is an English model
    ngram: int = 8                  # MT-bench overlap: shared word n-gram of this length


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    response: Optional[str] = None  # the dataset's own first assistant reply, when it has one


class PromptStats(dict):
    """Counts of records seen and prompts dropped by each rule (a plain dict for the manifest)."""


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the complete records of a (possibly truncated) top-level JSON array."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, done = f.read(chunk_chars), 0, False
        pos = _skip(buf, pos, "[")
        while True:
            pos = _skip(buf, pos, ",")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if done:
                    return                      # truncated tail: stop at the last complete record
                more = f.read(chunk_chars)
                done = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield record
            pos = end
            if len(buf) - pos < chunk_chars // 4 and not done:
                more = f.read(chunk_chars)
                done = not more
                buf, pos = buf[pos:] + more, 0


def _skip(buf: str, pos: int, sep: str) -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] == sep):
        pos += 1
    return pos


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def text_hash(text: str) -> str:
    return hashlib.sha1(normalise(text).encode()).hexdigest()


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = normalise(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


class HeldOut:
    """MT-bench turns: exact normalised matches and word n-grams that a training prompt may not share."""

    def __init__(self, texts: list[str], ngram: int):
        self.exact = {normalise(t) for t in texts}
        self.ngram = ngram
        self.grams: set[tuple[str, ...]] = set()
        for t in texts:
            self.grams |= word_ngrams(t, ngram)

    def overlaps(self, text: str) -> bool:
        if normalise(text) in self.exact:
            return True
        return not self.grams.isdisjoint(word_ngrams(text, self.ngram))


def load_mtbench_turns(path: Path) -> list[str]:
    turns = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            turns.extend(json.loads(line)["turns"])
    if not turns:
        raise LoadError(f"{path}: no MT-bench questions found")
    return turns


def clean(text: str) -> str:
    return _WS.sub(" ", text).strip() if "\n" not in text else text.strip()


def junk_reason(text: str, filt: PromptFilter) -> str | None:
    if len(text) < filt.min_chars:
        return "too_short"
    if len(text) > filt.max_chars:
        return "too_long"
    alpha = sum(c.isalpha() or c.isspace() for c in text) / len(text)
    if alpha < filt.min_alpha_frac:
        return "non_text"
    ascii_frac = sum(c.isascii() for c in text) / len(text)
    return "non_english" if ascii_frac < filt.min_ascii_frac else None


def first_human_turns(records: Iterator[dict]) -> Iterator[Prompt]:
    for rec in records:
        conv = rec.get("conversations") or []
        if conv and conv[0].get("from") == "human" and isinstance(conv[0].get("value"), str):
            reply = conv[1].get("value") if len(conv) > 1 and conv[1].get("from") == "gpt" else None
            yield Prompt(str(rec.get("id")), conv[0]["value"], reply if isinstance(reply, str) else None)


def select_prompts(sharegpt: Path, mtbench: Path, filt: PromptFilter = PromptFilter(),
                   limit: int | None = None) -> tuple[list[Prompt], PromptStats]:
    """Clean, dedupe and hold out MT-bench; return prompts in file order and drop counts."""
    held = HeldOut(load_mtbench_turns(mtbench), filt.ngram)
    stats, seen, out = PromptStats(records=0), set(), []
    for p in first_human_turns(_counted(iter_json_array(sharegpt), stats)):
        text = clean(p.text)
        reason = junk_reason(text, filt) or ("duplicate" if text_hash(text) in seen else None) \
            or ("mtbench_overlap" if held.overlaps(text) else None)
        if reason:
            stats[reason] = stats.get(reason, 0) + 1
            continue
        seen.add(text_hash(text))
        out.append(Prompt(p.id, text, p.response))
        if limit and len(out) >= limit:
            break
    stats["kept"] = len(out)
    return out, stats


def _counted(records: Iterator[dict], stats: PromptStats) -> Iterator[dict]:
    for r in records:
        stats["records"] += 1
        yield r

"""Streaming detokenisation on the real SmolLM2 tokenizer (byte-level BPE: an emoji or a CJK
character spans several tokens): deltas concatenate to decode(all ids), incomplete characters and
possible stop strings are held back, and the decode work is linear in the output length."""
from __future__ import annotations

import random
from typing import Sequence

import pytest

from eagle3.generate import TextStream
from eagle3.serve.highlight import DraftSpans
from serve_fixtures import tokenizer

MIXED = ("Speculative decoding drafts tokens 😀, then the target checks them: 世界 says "
         "héllo, naïve café! 🎉🎉 Done.")


class CountingDecodes:
    """The real tokenizer; counts the ids passed to decode."""

    def __init__(self, inner):
        self.inner, self.decoded_ids = inner, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


def ids_of(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def full(ids: Sequence[int]) -> str:
    return tokenizer().decode(list(ids), skip_special_tokens=True)


def stream(ids: Sequence[int], sizes: Sequence[int], stop: Sequence[str] = (),
           tok=None) -> tuple[list[str], TextStream]:
    """Push `ids` in groups of the given sizes (cycled); the deltas, the last one the flush."""
    text = TextStream(tok or tokenizer(), stop)
    deltas, i, k = [], 0, 0
    while i < len(ids) and not text.stopped:
        n = sizes[k % len(sizes)]
        deltas.append(text.push(ids[i:i + n]))
        i, k = i + n, k + 1
    deltas.append(text.flush())
    return deltas, text


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [7]])
def test_deltas_concatenate_to_the_full_decode(sizes):
    ids = ids_of(MIXED)
    ids = ids[:10] + [tokenizer().eos_token_id] + ids[10:]      # a skipped special token
    deltas, text = stream(ids, sizes)
    assert "".join(deltas) == text.text == full(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_split_across_tokens_is_held_until_complete():
    ids = ids_of(" 世")
    pieces = [tokenizer().decode([i]) for i in ids]
    assert len(ids) >= 2 and all("\ufffd" in p for p in pieces[1:])   # really split into bytes
    deltas, text = stream(ids_of("ok") + ids, [1])
    assert "".join(deltas) == "ok 世" and deltas[-1] == ""
    assert deltas[-2].endswith("世")                   # appears with the id that completes it
    assert not any("\ufffd" in d or "世" in d for d in deltas[:-2])


def test_random_ids_end_exactly_at_the_full_decode():
    """Random ids include lone UTF-8 bytes (decoded as U+FFFD) and special tokens."""
    rng = random.Random(0)
    vocab = len(tokenizer())
    for trial in range(4):
        ids = [rng.randrange(vocab) for _ in range(300)] + [rng.randrange(256)] * 3
        deltas, text = stream(ids, [1 + trial, 2, 1])
        assert "".join(deltas) == text.text == full(ids)


def test_stop_string_split_across_steps_is_never_emitted():
    ids = ids_of("The quick brown fox jumps over the lazy dog")
    deltas, text = stream(ids, [1], stop=("own fox j",))
    assert text.stopped and text.text == "".join(deltas) == "The quick br"
    # a held-back prefix that does not become the stop string is released
    deltas, text = stream(ids, [1], stop=("own fox k",))
    assert not text.stopped and "".join(deltas) == full(ids)
    held = [i for i, d in enumerate(deltas) if d == ""]
    assert held, "the possible stop prefix was not held back"


def test_stop_string_inside_one_step_and_after_a_split_character():
    ids = ids_of("abc 😀 stop here")
    deltas, text = stream(ids, [len(ids)], stop=("stop",))
    assert text.text == "".join(deltas) == "abc 😀 "
    deltas, text = stream(ids, [1], stop=("😀 s",))
    assert text.text == "".join(deltas) == "abc "


def long_ids(n: int) -> list[int]:
    text = " ".join(f"Step {i}: draft 😀, verify 世界 and accept." for i in range(n // 8))
    ids = ids_of(text)
    assert len(ids) >= n
    return ids[:n]


def test_decode_work_is_linear_in_the_output():
    """Decoding every id again at every step is O(n^2): 2000 tokens cost ~2M decoded ids."""
    n = 2000
    ids = long_ids(n)
    counting = CountingDecodes(tokenizer())
    deltas, text = stream(ids, [1, 3], stop=("never appears",), tok=counting)
    assert "".join(deltas) == text.text == full(ids)
    print(f"TextStream: {counting.decoded_ids} ids decoded for {n} tokens")
    assert counting.decoded_ids < 8 * n, counting.decoded_ids


def test_draft_spans_work_is_linear_and_covers_the_text():
    n = 2000
    ids = long_ids(n)
    counting = CountingDecodes(tokenizer())
    spans = DraftSpans(counting)
    flags = [i % 3 == 0 for i in range(n)]
    for i in range(0, n, 4):
        spans.push(ids[i:i + 4], flags[i:i + 4])
    print(f"DraftSpans: {counting.decoded_ids} ids decoded for {n} tokens")
    assert counting.decoded_ids < 8 * n, counting.decoded_ids
    text = full(ids)
    runs = spans.segments(0, text)
    assert "".join(t for t, _ in runs) == text and len(spans.flags) == len(text)

"""Which characters of a streamed reply came from accepted draft proposals.

The engine reports, per emitted token, whether it was an accepted draft proposal; the text it
streams is `decode(all ids)` cut into deltas. DraftSpans keeps one flag per character of that
decoded text so a delta covering characters [start, start + len) can be split into runs
[(text, drafted), ...] for the page to highlight. A character belongs to the token whose decode
first completes it (an incomplete UTF-8 sequence, shown as U+FFFD, is not counted yet).
"""
from __future__ import annotations

from typing import Sequence

WINDOW = 8   # tokens of left context when measuring one token's text (BPE merges are local)


class DraftSpans:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.flags: list[bool] = []     # one per character of the decoded text so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).rstrip("\ufffd")

    def push(self, token_ids: Sequence[int], drafted: Sequence[bool]) -> None:
        """Append a chunk's tokens with their drafted flags."""
        for tok, flag in zip(token_ids, drafted):
            start = max(0, len(self.ids) - WINDOW)
            before = len(self._decode(self.ids[start:]))
            self.ids.append(int(tok))
            grown = len(self._decode(self.ids[start:])) - before
            self.flags.extend([bool(flag)] * max(0, grown))
        self._resync()

    def _resync(self) -> None:
        """Match the flag count to the full decode (windowed lengths can drift on odd merges)."""
        n = len(self._decode(self.ids))
        if n < len(self.flags):
            del self.flags[n:]
        else:
            self.flags.extend([self.flags[-1] if self.flags else False] * (n - len(self.flags)))

    def segments(self, start: int, text: str) -> list[tuple[str, bool]]:
        """Split `text`, which sits at characters [start, start+len(text)), into (run, drafted)."""
        def flag(i: int) -> bool:
            return self.flags[start + i] if start + i < len(self.flags) else False

        runs: list[tuple[str, bool]] = []
        begin = 0
        for i in range(1, len(text) + 1):
            if i == len(text) or flag(i) != flag(begin):
                runs.append((text[begin:i], flag(begin)))
                begin = i
        return runs

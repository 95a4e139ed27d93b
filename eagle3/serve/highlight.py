"""Which characters of a streamed reply came from accepted draft proposals.

The engine reports, per emitted token, whether it was an accepted draft proposal; the text it
streams is `decode(all ids)` cut into deltas. DraftSpans keeps one flag per character of that
decoded text so a delta covering characters [start, start + len) can be split into runs
[(text, drafted), ...] for the page to highlight. A character belongs to the token whose decode
first completes it (an incomplete UTF-8 sequence, shown as U+FFFD, is not counted yet).
"""
from __future__ import annotations

from typing import Sequence

from ..generate.text import IncrementalDecoder


class DraftSpans:
    def __init__(self, tokenizer):
        self.decoder = IncrementalDecoder(tokenizer)
        self.flags: list[bool] = []     # one per character of the decoded text so far

    def push(self, token_ids: Sequence[int], from_draft: Sequence[bool]) -> None:
        """Append a chunk's tokens with their drafted flags (one incremental decode per token)."""
        for tok, flag in zip(token_ids, from_draft):
            self.flags.extend([bool(flag)] * len(self.decoder.push([tok])))

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

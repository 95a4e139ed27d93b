"""Prompts in, text out: chat templating, incremental detokenisation and stop handling."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import InputError


def encode_prompt(tokenizer, prompt: Optional[str] = None,
                  messages: Optional[Sequence[dict]] = None, chat: bool = True) -> list[int]:
    """Token ids for a prompt (wrapped as one user turn when `chat`) or for chat `messages`."""
    if messages is None:
        if not prompt:
            raise InputError("empty prompt: give some text or chat messages")
        if not chat or not getattr(tokenizer, "chat_template", None):
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                raise InputError("the prompt encodes to zero tokens")
            return list(ids)
        messages = [{"role": "user", "content": prompt}]
    if not messages:
        raise InputError("messages is empty: give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise InputError(f"messages[{i}] must be an object with 'role' and string 'content'")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDecoder:
    """Token ids in, newly decoded text out, decoding only a short window of recent ids.

    The window ids[prefix:] starts at a point where everything before was returned, so each call
    costs the window, not the whole output. `prefix` trails one step behind `read` (the end of the
    last fully decoded step) so the window keeps left context for decoders whose text depends on
    the previous token (SentencePiece's leading space, joined words). A window whose decode ends in
    U+FFFD holds that tail until a later id completes the UTF-8 character; the window slides only
    at complete points, which are character boundaries, so the pieces concatenate to
    decode(all ids). (A run of ids that never completes a character, i.e. invalid UTF-8 bytes,
    widens the window until a complete character follows.)
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0           # window start
        self.read = 0             # end of the ids of the last complete step
        self.shown = 0            # characters of decode(ids[prefix:]) already returned

    def push(self, ids: Sequence[int]) -> str:
        """Append ids; return the newly complete text (a trailing incomplete character held)."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held tail as it decodes now (an unfinished character comes out as U+FFFD)."""
        return self._advance(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _advance(self, final: bool) -> str:
        text = self._decode(self.ids[self.prefix:])
        end = len(text) if final else len(text.rstrip("\ufffd"))
        delta = text[self.shown:end]
        self.shown = max(self.shown, end)
        if end == len(text) and len(self.ids) > self.read:      # complete: slide the window
            moved = self.read > self.prefix
            self.prefix, self.read = self.read, len(self.ids)
            self.shown = len(self._decode(self.ids[self.prefix:])) if moved else len(text)
        return delta


class TextStream:
    """Turns appended token ids into text deltas, holding back what may still become a stop string.

    Decoding is incremental (IncrementalDecoder), and stop strings are searched only in the text
    not yet emitted: emitted text never ends with a prefix of a stop string (`_safe_end` holds
    those back), so no stop string can start inside it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.pending = ""         # decoded, not yet emitted (may still become a stop string)
        self.pieces: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self.pieces)

    def push(self, ids: Sequence[int]) -> str:
        """Append token ids; return the newly final text (stop strings cut, incomplete UTF-8 held)."""
        if self.stopped:
            return ""
        self.pending += self.decoder.push(ids)
        end = len(self.pending)
        for s in self.stop:
            pos = self.pending.find(s)
            if pos != -1 and pos <= end:
                end, self.stopped = pos, True
        if not self.stopped:
            end = self._safe_end(self.pending, end)
        return self._emit(end)

    def _emit(self, end: int) -> str:
        delta, self.pending = self.pending[:end], self.pending[end:]
        if delta:
            self.pieces.append(delta)
        return delta

    def _safe_end(self, text: str, end: int) -> int:
        """Hold back a suffix that is a prefix of some stop string."""
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[end - k:end] == s[:k]:
                    end = min(end, end - k)
                    break
        return end

    def flush(self) -> str:
        """At the end of generation: release the held-back tail (unless stopped)."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        return self._emit(len(self.pending))

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


class TextStream:
    """Turns appended token ids into text deltas, holding back what may still become a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = 0          # characters of the full text already handed out
        self.stopped = False
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Append token ids; return the newly final text (stop strings cut, incomplete UTF-8 held)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        end = len(text)
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        for s in self.stop:
            pos = text.find(s, max(0, self.emitted - len(s)))
            if pos != -1 and pos <= end:
                end, self.stopped = pos, True
        if not self.stopped:
            end = min(end, self._safe_end(text, end))
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        self.text = text[:self.emitted]
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
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = text[self.emitted:]
        self.emitted, self.text = len(text), text
        return delta

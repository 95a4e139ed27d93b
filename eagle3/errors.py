"""Errors that name what is wrong and how to fix it.

Every contract violation in the project raises one of these: the message names the field, the value
that was found, the value that was expected, and the fix. Nothing is switched off silently.
"""
from __future__ import annotations


class Eagle3Error(Exception):
    """Base class: a user-facing error with a message that stands on its own (no traceback needed)."""


class ContractError(Eagle3Error, ValueError):
    """A width, layer id, vocabulary or algorithm contract between target and draft is broken."""

    def __init__(self, field: str, found: object, expected: object, fix: str):
        self.field, self.found, self.expected, self.fix = field, found, expected, fix
        super().__init__(f"{field}: found {found!r}, expected {expected!r}. Fix: {fix}")


class LoadError(Eagle3Error, ValueError):
    """A model or draft file is missing, corrupt, truncated or does not match its config."""


class UnsupportedError(Eagle3Error, ValueError):
    """An architecture, checkpoint flag or request option that this project does not implement."""


class InputError(Eagle3Error, ValueError):
    """Bad user input: empty prompt, prompt longer than the cache, invalid sampling parameters."""

"""One check result for every checker: the target/draft contract (draft/contract.py) and the doctor
(doctor/*). A Check is data: a name, a status, what was found and what to change.

Statuses are pass | warn | fail (the contract's old ok / error are gone: one vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import ContractError

STATUSES = ("pass", "warn", "fail")


def Status(value: str) -> str:
    """`value` if it is one of STATUSES, else ValueError naming them."""
    if value not in STATUSES:
        raise ValueError(f"check status {value!r} not in {STATUSES}")
    return str(value)


@dataclass(frozen=True)
class Check:
    name: str                       # dotted, e.g. "contract.fc_width", "launch.vllm.layer_ids"
    status: str                     # pass | warn | fail (checked)
    message: str = ""               # what was found, with both values (derived from field/found/expected)
    fix: str = ""                   # what to change (empty on pass)
    field: Optional[str] = None     # a compared field: its name, the value found and the value expected
    found: Any = None
    expected: Any = None
    catalog: Optional[str] = None   # the silent-failure row it reports (doctor/catalog.py), if set

    def __post_init__(self):
        object.__setattr__(self, "status", Status(self.status))
        if not self.message and self.field is not None:
            object.__setattr__(self, "message", self._field_message())

    def _field_message(self) -> str:
        if self.status == "pass":
            return f"{self.field}: {self.found!r}"
        return f"{self.field}: found {self.found!r}, expected {self.expected!r}"

    def as_error(self) -> ContractError:
        return ContractError(self.field or self.name, self.found, self.expected, self.fix)

    def as_dict(self) -> dict[str, Any]:
        """The report form (JSON): name, status, message, fix."""
        return {"name": self.name, "status": str(self.status), "message": self.message, "fix": self.fix}


def passed(name: str, message: str) -> Check:
    return Check(name, "pass", message)


def warned(name: str, message: str, fix: str) -> Check:
    return Check(name, "warn", message, fix)


def failed(name: str, message: str, fix: str) -> Check:
    return Check(name, "fail", message, fix)


def compared(name: str, good: bool, field: str, found: Any, expected: Any, fix: str,
             bad: str = "fail") -> Check:
    """`field` found vs expected: pass when `good`, else `bad` (fail | warn) with the fix."""
    return Check(name, "pass" if good else bad, field=field, found=found, expected=expected,
                 fix="" if good else fix)


def from_error(name: str, error: ContractError) -> Check:
    return Check(name, "fail", field=error.field, found=error.found, expected=error.expected,
                 fix=error.fix)

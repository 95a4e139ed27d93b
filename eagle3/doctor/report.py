"""Doctor results as data: one eagle3.checks.Check per finding, a report that prints as a table or as
JSON."""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..checks import Check, failed, from_error, passed, warned
from .catalog import catalog_id

__all__ = ["Check", "DoctorReport", "failed", "from_error", "passed", "warned"]

@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)   # what was inspected (paths, sizes)
    probe: dict[str, Any] | None = None                    # live probe numbers, if run

    def extend(self, checks: Iterable[Check]) -> None:
        self.checks.extend(checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def strict_exit_code(self) -> int:
        """`--strict`: warnings (slower, not broken) fail too."""
        return 0 if self.ok and not self.warnings else 1

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "failures": len(self.failures), "warnings": len(self.warnings),
                "checks": [{**c.as_dict(), "catalog": catalog_id(c)} for c in self.checks],
                "facts": self.facts, "probe": self.probe}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def table(self, width: int = 100) -> str:
        """Plain-text table: status, check, message (and the fix under each non-pass row)."""
        name_w = max([len("check")] + [len(c.name) for c in self.checks])
        msg_w = max(30, width - name_w - 9)
        lines = [f"{'status':<6}  {'check':<{name_w}}  message", "-" * min(width, name_w + msg_w + 9)]
        for c in self.checks:
            wrapped = textwrap.wrap(c.message, msg_w) or [""]
            lines.append(f"{c.status.upper():<6}  {c.name:<{name_w}}  {wrapped[0]}")
            lines += [f"{'':<6}  {'':<{name_w}}  {w}" for w in wrapped[1:]]
            if c.fix and c.status != "pass":
                for w in textwrap.wrap("fix: " + c.fix, msg_w):
                    lines.append(f"{'':<6}  {'':<{name_w}}  {w}")
            if c.status != "pass" and catalog_id(c):
                lines.append(f"{'':<6}  {'':<{name_w}}  known failure: {catalog_id(c)} "
                             "(docs/silent-failures.md)")
        verdict = "FAIL" if self.failures else "OK"
        lines.append(f"\n{verdict}: {len(self.checks)} checks, {len(self.failures)} failed, "
                     f"{len(self.warnings)} warnings")
        return "\n".join(lines)

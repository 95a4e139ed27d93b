"""Every script users and maintainers run (scripts/, tools/, studies/) still imports and parses its
arguments: they live outside the package, so nothing else would notice a renamed import."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("scripts", "tools", "studies") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_script_answers_help(path):
    out = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-2000:]

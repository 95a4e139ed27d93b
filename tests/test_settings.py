"""eagle3.settings: every EAGLE3_* variable in one table, read only through it, documented from it;
and `import eagle3` changes nothing in the process (the entry points tune it)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3 import settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagle3"
# EAGLE3_* identifiers that are not environment variables: a Python table, C++ macros
NOT_VARIABLES = {"EAGLE3_ARCHITECTURES", "EAGLE3_AMX_BUILT", "EAGLE3_NIBBLE_STEP"}
NAME = re.compile(r"\bEAGLE3_[A-Z0-9_]*[A-Z0-9]\b")


def test_an_unknown_name_raises():
    with pytest.raises(settings.UnknownSetting, match="EAGLE3_NO_SUCH"):
        settings.env("EAGLE3_NO_SUCH")
    with pytest.raises(settings.UnknownSetting):
        settings.enabled("EAGLE3_NO_SUCH")
    with pytest.raises(settings.UnknownSetting, match="not a switch"):
        settings.enabled("EAGLE3_CACHE")


def test_switches_keep_their_old_meaning():
    assert settings.enabled("EAGLE3_KERNELS", {}) and settings.enabled("EAGLE3_KERNELS", {"EAGLE3_KERNELS": ""})
    assert not settings.enabled("EAGLE3_KERNELS", {"EAGLE3_KERNELS": "0"})
    assert settings.enabled("EAGLE3_AMX", {"EAGLE3_AMX": "yes"})
    assert not settings.enabled("EAGLE3_REMEASURE", {})
    assert settings.enabled("EAGLE3_REMEASURE", {"EAGLE3_REMEASURE": "1"})
    assert settings.env("EAGLE3_CACHE", {}) == "" and settings.env("EAGLE3_CACHE", {"EAGLE3_CACHE": "/x"}) == "/x"


def test_every_variable_the_repository_names_is_in_the_table():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts").glob("*.sh"),
             *(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)]
    named = {}
    for path in files:
        for name in NAME.findall(path.read_text()):
            named.setdefault(name, path.relative_to(ROOT))
    unknown = {n: str(p) for n, p in named.items() if n not in settings.VARIABLES and n not in NOT_VARIABLES}
    assert not unknown, f"add these to eagle3/settings.py VARIABLES: {unknown}"


def environ_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every os.environ / getenv access to an EAGLE3_* name, constants resolved."""
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def key(node):
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("EAGLE3_") else None

    def is_environ(node):
        return ast.unparse(node).split(".")[-1] == "environ"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value) and key(node.slice):
            found.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Call) and node.args and key(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Attribute) and (f.attr == "getenv" or is_environ(f.value))) or \
                    (isinstance(f, ast.Name) and f.id == "getenv"):
                found.append((node.lineno, key(node.args[0])))
    return found


def test_eagle3_reads_its_variables_only_through_settings():
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in PACKAGE.rglob("*.py") if p.name != "settings.py"
           or p.parent != PACKAGE for line, name in environ_reads(ast.parse(p.read_text()))]
    assert not bad, "read these through eagle3.settings.env()/enabled(): " + ", ".join(bad)


def test_the_checker_sees_a_direct_read():
    src = 'import os\nK = "EAGLE3_X"\na = os.environ.get("EAGLE3_A")\nb = os.environ[K]\nc = os.getenv("EAGLE3_C")\n' \
          'd = environ.get("EAGLE3_D", "1")\ne = settings.env("EAGLE3_E")\n'
    assert [n for _, n in environ_reads(ast.parse(src))] == ["EAGLE3_A", "EAGLE3_X", "EAGLE3_C", "EAGLE3_D"]


def test_docs_list_every_variable_as_the_table_says():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert settings.markdown() in doc, ("docs/configuration.md's table differs from eagle3/settings.py: "
                                        "paste `python -c 'from eagle3.settings import markdown; print(markdown())'`")


def test_docs_list_every_shared_flag():
    import argparse
    from eagle3.cli_args import add_run_args, add_spec_args
    doc = (ROOT / "docs" / "configuration.md").read_text()
    p = argparse.ArgumentParser()
    add_spec_args(p)
    add_run_args(p)
    flags = [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f"`{f}" not in doc]
    assert not missing, f"docs/configuration.md does not list {missing}"


def test_info_lists_the_environment(monkeypatch):
    from eagle3.cli import environment_text
    monkeypatch.setenv("EAGLE3_CACHE", "/tmp/somewhere")
    monkeypatch.delenv("EAGLE3_VNNI", raising=False)
    text = environment_text()
    assert all(name in text for name in settings.VARIABLES)
    assert re.search(r"EAGLE3_CACHE +/tmp/somewhere$", text, re.M)
    assert re.search(r"EAGLE3_VNNI +1 \(default\)$", text, re.M)
    monkeypatch.setenv("EAGLE3_API_KEY", "sk-secret")
    assert "sk-secret" not in environment_text() and "EAGLE3_API_KEY" in environment_text()


# ---------------------------------------------------------------------------- import changes nothing
IMPORT_ALL = """
import ctypes, os, sys
calls = []
real = ctypes.CDLL
ctypes.CDLL = lambda name, *a, **k: calls.append(name) or real(name, *a, **k)   # memory._glibc's way in
before = dict(os.environ)
import eagle3
assert dict(os.environ) == before, "import eagle3 changed the environment"
assert "torch" not in sys.modules
import eagle3.cli, eagle3.api, eagle3.serve.cli, eagle3.bench, eagle3.train.cli, eagle3.doctor
from eagle3 import memory, threads
changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
assert not changed, f"importing eagle3's modules changed the environment: {changed}"
assert None not in calls and memory._STATE is None and threads._SETUP is None, "the allocator was tuned"
eagle3.tune_process()
print(os.environ.get("GOMP_SPINCOUNT"), None in calls, memory.describe())
"""


def test_import_eagle3_changes_nothing_until_tune_process():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    spin, tuned, allocator = out.stdout.split(maxsplit=2)
    assert spin == "30000"
    if sys.platform.startswith("linux"):
        assert tuned == "True" and "eagle3 default" in allocator


def test_the_plain_import_changes_no_variable():
    code = "import os; before=dict(os.environ); import eagle3; assert dict(os.environ)==before"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=60).returncode == 0

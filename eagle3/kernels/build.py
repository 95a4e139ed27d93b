"""Build the kernel sources (kernels/csrc) into the cache once, safely: the machinery behind
eagle3.kernels.state().

- Key: every source and header (name and text), flags, torch, the Python ABI and the compiler (path
  and `--version`), so an edit to any file, a new interpreter or a new compiler never loads a stale
  .so.
- Directory: <cache>/kernels/<key>; a cache that cannot be written falls back to a temp dir (said
  in one line), and with neither the kernels are off with the reason.
- ninja: the running interpreter's environment's (the `ninja` package), found without PATH, since
  `.venv/bin/eagle3` runs without the venv activated.
- Lock: torch's own lock (<dir>/lock) is a plain file that a killed build leaves behind, and the
  next build then waits for it forever. We hold an flock on <dir>/eagle3.lock around the build
  (the kernel drops it when its holder dies), so a torch lock found while we hold ours is stale.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch

LOCK_NAME = "eagle3.lock"       # ours (flock); torch's is <dir>/lock
TORCH_LOCK = "lock"
LOCK_WAIT_S = 600.0             # well past a live build (docs/kernels.md has the time)


class BuildError(RuntimeError):
    """The kernels cannot be built here; the message says why and what to do."""


class Built(NamedTuple):
    module: object              # the loaded extension
    build_dir: Path


class Compiler(NamedTuple):
    path: str
    version: str                # the full `--version` output


def say(message: str) -> None:
    print(f"eagle3: {message}", file=sys.stderr, flush=True)


def find_compiler() -> Compiler:
    """The C++ compiler torch's build will run: $CXX, else c++ on PATH."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"no C++ compiler: CXX={name!r} is not on PATH (install g++ or set CXX)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{path} --version failed: {exc}") from exc
    return Compiler(path, out.stdout.strip())


def build_key(source: bytes, cflags: Sequence[str], ldflags: Sequence[str], compiler: Compiler) -> str:
    parts = [source, " ".join(cflags).encode(), " ".join(ldflags).encode(), torch.__version__.encode(),
             str(Path(torch.__file__).parent).encode(), sys.implementation.cache_tag.encode(),
             str(sysconfig.get_config_var("SOABI")).encode(), compiler.path.encode(),
             compiler.version.encode()]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:12]


def source_bytes(paths: Sequence[Path]) -> bytes:
    """The files' names and texts in one string for the key: editing, adding, removing or renaming
    any of them changes it."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in paths)


def ninja_dir() -> str:
    """The directory of the ninja that belongs to this interpreter's environment ('' if none)."""
    try:
        import ninja
        candidates = [ninja.BIN_DIR]
    except (ImportError, AttributeError):
        candidates = []
    candidates.append(os.path.dirname(sys.executable))
    for d in candidates:
        if d and os.access(os.path.join(d, "ninja"), os.X_OK):
            return d
    return ""


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """PATH with the environment's ninja first for the build (torch runs `ninja` from PATH)."""
    d = ninja_dir()
    if not d and shutil.which("ninja") is None:
        raise BuildError("ninja not found (neither in this Python's environment nor on PATH): "
                         "pip install ninja")
    old = os.environ.get("PATH")
    if d:
        os.environ["PATH"] = d + os.pathsep + (old or "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _writable_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe"):
        pass
    return path


def build_root() -> Path:
    """<cache>/kernels, or a temp dir (one line says why) when the cache cannot be written."""
    from ..paths import cache_root
    try:
        return _writable_dir(cache_root() / "kernels")
    except (OSError, RuntimeError) as exc:
        first = exc
    fallback = Path(tempfile.gettempdir()) / f"eagle3-{os.getuid()}" / "kernels"
    try:
        _writable_dir(fallback)
    except OSError as exc:
        raise BuildError(f"no writable directory for the kernels: cache ({first}), temp ({exc}); "
                         f"set EAGLE3_CACHE to a writable directory") from exc
    say(f"kernel cache not writable ({type(first).__name__}: {first}); building in {fallback} "
        f"(set EAGLE3_CACHE to choose)")
    return fallback


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_flock(fd: int, lock: Path, wait_s: float) -> None:
    holder = lock.read_text().strip() or "?"
    say(f"waiting for pid {holder}, which is building the kernels in {lock.parent}")
    deadline = time.monotonic() + wait_s
    while not _try_flock(fd):
        if time.monotonic() > deadline:
            raise BuildError(f"pid {holder} has held {lock} for over {wait_s:.0f} s; if no build is "
                             f"running, delete that directory")
        time.sleep(0.2)


@contextlib.contextmanager
def build_lock(build_dir: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold <build_dir>/eagle3.lock for a build; clear a torch lock that a killed build left."""
    lock = build_dir / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_flock(fd):
            _wait_flock(fd, lock, wait_s)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        stale = build_dir / TORCH_LOCK
        if stale.exists():   # we hold the flock, so no live eagle3 build owns it
            say(f"removed a stale build lock {stale} (an earlier build was stopped half way)")
            stale.unlink()
        yield
    finally:
        os.close(fd)         # drops the flock


def build(name: str, sources: Sequence[Path], cflags: list[str], ldflags: list[str],
          headers: Sequence[Path] = ()) -> Built:
    """Build (or load the cached) extension from `sources` (translation units); `headers` only
    enter the cache key. Raises BuildError where it cannot be built here."""
    compiler = find_compiler()
    key = build_key(source_bytes([*sources, *headers]), cflags, ldflags, compiler)
    build_dir = build_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load
    with ninja_on_path(), build_lock(build_dir):
        fresh = not (build_dir / f"{name}_{key}.so").exists()
        if fresh:
            print(f"eagle3: building the CPU kernels (first use) in {build_dir} ...", end="",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            # copies: torch's load appends its own flags to the lists it is given, and a second
            # setup in the process then keyed (and compiled) a new build
            module = load(f"{name}_{key}", [str(s) for s in sources], extra_cflags=list(cflags),
                          extra_ldflags=list(ldflags), build_directory=str(build_dir), verbose=False)
        except BaseException:
            if fresh:
                print(" failed", file=sys.stderr, flush=True)
            raise
        if fresh:
            print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return Built(module, build_dir)

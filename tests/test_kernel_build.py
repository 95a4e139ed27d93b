"""Building the kernels: ninja without PATH, unwritable caches, stale locks, the cache key over every
source file, the target attributes of the newer instruction sets, the sources' header comments and
the first-build message."""
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3 import kernels
from eagle3.kernels import build

ROOT = Path(__file__).resolve().parents[1]
BF16_OPS = ("vdpbf16ps", "vcvtne2ps2bf16", "vcvtneps2bf16")   # the AVX512-BF16 instructions
VNNI_OPS = ("vpdpbusd", "vpdpbusds", "vpdpwssd", "vpdpwssds")     # the AVX512-VNNI instructions
needs = pytest.mark.skipif(kernels.small_linear(torch.float32) is None,
                           reason=f"small-M kernels not available here: {kernels.why()}")


@pytest.mark.lossless
def test_the_kernels_follow_the_switch_and_build_where_the_cpu_runs_them():
    """Runs in both CI passes: off under EAGLE3_KERNELS=0; otherwise a CPU with the AVX-512 the
    kernels need must have them built (a failed build would only skip the kernel tests)."""
    st = kernels.state()
    if os.environ.get("EAGLE3_KERNELS") == "0":
        assert st.module is None, "EAGLE3_KERNELS=0 but the kernels are in use"
    elif not kernels.NEED_FLAGS <= kernels.cpu_flags():
        pytest.skip(f"CPU lacks {sorted(kernels.NEED_FLAGS - kernels.cpu_flags())}")
    else:
        assert st.module is not None, f"this CPU has AVX-512 but the kernels did not build: {st.reason}"
        assert st.bf16 == (kernels.BF16_FLAG in kernels.cpu_flags())


def test_the_build_finds_the_environments_ninja_without_path(monkeypatch, tmp_path):
    """`.venv/bin/eagle3` runs without the venv on PATH: torch runs `ninja` from PATH."""
    from torch.utils.cpp_extension import is_ninja_available
    monkeypatch.setenv("PATH", str(tmp_path))          # no ninja (nor anything else) here
    assert not is_ninja_available()
    with build.ninja_on_path():
        assert is_ninja_available()
    assert os.environ["PATH"] == str(tmp_path)


def test_cache_root_without_a_home_is_absolute_and_said(monkeypatch, capsys):
    import pwd
    from eagle3 import paths
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("EAGLE3_CACHE", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    paths._no_home_cache.cache_clear()
    root = paths.cache_root()
    assert root.is_absolute()                          # was Path("~/.cache/eagle3"), relative
    assert "HOME unset" in capsys.readouterr().err


def test_an_unwritable_gguf_cache_is_a_load_error_naming_the_fix(monkeypatch, tmp_path):
    from eagle3.errors import LoadError
    from eagle3.runtime.loader import gguf_to_hf_dir
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little"))
    monkeypatch.setenv("EAGLE3_CACHE", "/proc/eagle3-cache")
    with pytest.raises(LoadError, match="cannot write the GGUF cache .*EAGLE3_CACHE"):
        gguf_to_hf_dir(gguf)


def test_an_unwritable_cache_falls_back_to_a_temp_dir(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("EAGLE3_CACHE", "/proc/eagle3-cache")       # cannot be created, even by root
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path))
    root = build.build_root()
    assert root == tmp_path / f"eagle3-{os.getuid()}" / "kernels" and root.is_dir()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not writable" in err[0] and str(root) in err[0]


def test_no_writable_directory_turns_the_kernels_off_with_the_reason(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EAGLE3_CACHE", str(blocker / "cache"))     # under a file: cannot exist
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(blocker))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(kernels.NEED_FLAGS))
    st = kernels._build()
    assert st.module is None and "EAGLE3_CACHE" in st.reason
    assert "kernels off" in capsys.readouterr().err


def test_the_cache_key_covers_the_python_abi_and_the_compiler(monkeypatch):
    gcc = build.Compiler("/usr/bin/c++", "c++ (Debian 12.2.0-14) 12.2.0")
    base = build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc)
    assert build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc) == base
    assert build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc._replace(version="c++ 13.1")) != base
    assert build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc._replace(path="/opt/c++")) != base
    monkeypatch.setattr(sys.implementation, "cache_tag", "cpython-399")
    tagged = build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc)
    assert tagged != base
    real = build.sysconfig.get_config_var
    monkeypatch.setattr(build.sysconfig, "get_config_var",
                        lambda name: "other-abi" if name == "SOABI" else real(name))
    assert build.build_key(b"src", ["-O3"], ["-fopenmp"], gcc) != tagged


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(build.BuildError, match="CXX='no-such-c\\+\\+' is not on PATH"):
        build.find_compiler()


def test_a_live_builder_is_waited_for_then_named(tmp_path):
    holder = os.open(tmp_path / build.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    os.write(holder, b"4242")
    fcntl.flock(holder, fcntl.LOCK_EX)                 # another build, alive
    try:
        with pytest.raises(build.BuildError, match="pid 4242 has held"):
            with build.build_lock(tmp_path, wait_s=0.3):
                pass
    finally:
        os.close(holder)
    with build.build_lock(tmp_path, wait_s=0.3):       # released: taken at once
        assert (tmp_path / build.LOCK_NAME).read_text() == str(os.getpid())


@needs
def test_a_stale_torch_lock_from_a_killed_build_is_cleared(tmp_path):
    """A build stopped half way leaves <dir>/lock; torch then waits for it forever."""
    built = kernels.state().build_dir
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(build.LOCK_NAME))
    (copy / build.TORCH_LOCK).write_text("")
    env = {**os.environ, "EAGLE3_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "from eagle3 import kernels; print(kernels.why())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "avx512" in out.stdout and "stale build lock" in out.stderr
    assert not (copy / build.TORCH_LOCK).exists()


def test_the_first_build_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    """...once per key: a header edited (the sources unchanged) builds anew, said again."""
    import torch.utils.cpp_extension as cpp
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    (tmp_path / "src").mkdir()
    sources = [Path(shutil.copy(p, tmp_path / "src")) for p in kernels.SOURCES]
    headers = [Path(shutil.copy(p, tmp_path / "src")) for p in kernels.HEADERS]
    compiled = []

    def fake_load(name, sources, build_directory, **kw):   # what a build leaves behind
        compiled.append(sources)
        (Path(build_directory) / f"{name}.so").write_text("")
        return object()

    monkeypatch.setattr(cpp, "load", fake_load)
    first = build.build("eagle3_kernels", sources, kernels.CFLAGS, kernels.LDFLAGS, headers)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.search(r"building the CPU kernels .* done in \d+\.\d s$", err[0]), err
    assert compiled == [[str(s) for s in sources]]      # every translation unit, headers not
    build.build("eagle3_kernels", sources, kernels.CFLAGS, kernels.LDFLAGS, headers)
    assert capsys.readouterr().err == ""                # cached: silent
    headers[0].write_text(headers[0].read_text() + "\n")
    again = build.build("eagle3_kernels", sources, kernels.CFLAGS, kernels.LDFLAGS, headers)
    assert "building the CPU kernels" in capsys.readouterr().err and again.build_dir != first.build_dir


def test_every_source_file_is_built_and_keyed(tmp_path):
    """The build compiles every .cpp of csrc and keys the cache on every .cpp and .h, so an edit to
    any of them (a header that several files include too) builds anew."""
    assert {p.name for p in kernels.SOURCES} == {p.name for p in kernels.CSRC.glob("*.cpp")}
    assert {p.name for p in kernels.HEADERS} == {p.name for p in kernels.CSRC.glob("*.h")}
    assert {"bindings.cpp", "common.h"} <= {p.name for p in (*kernels.SOURCES, *kernels.HEADERS)}
    gcc = build.Compiler("/usr/bin/c++", "c++ 12")
    copies = [Path(shutil.copy(p, tmp_path)) for p in (*kernels.SOURCES, *kernels.HEADERS)]

    def key() -> str:
        return build.build_key(build.source_bytes(copies), kernels.CFLAGS, kernels.LDFLAGS, gcc)

    base = key()
    for path in copies:
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        assert key() != base, f"editing {path.name} keeps the cached build"
        path.write_bytes(text)
    assert key() == base


def _functions_with(so: Path, ops: tuple[str, ...]) -> set[str]:
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(so)], capture_output=True,
                          text=True, check=True).stdout
    found, name = set(), None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
        elif name and any(op in line for op in ops):
            found.add(name)
    return found


@needs
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_avx512_bf16_instructions_sit_only_in_the_attributed_functions():
    """No -mavx512bf16 for the build: only target("avx512bf16") functions may hold them."""
    holders = _functions_with(Path(kernels.state().module.__file__), BF16_OPS)
    assert holders, "linear_bf16's dot products are gone"
    assert all(re.search(r"\btile_bf16<\d>\(", f) for f in holders), sorted(holders)
    assert "-mavx512bf16" not in kernels.CFLAGS


@needs
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_avx512_vnni_instructions_sit_only_in_the_attributed_function():
    """No -mavx512vnni for the build: only the integer-dot tiles (exact digits, one digit) and
    the integer-dot peak's burst may hold them, so a CPU with AVX-512 but without VNNI runs every
    other kernel."""
    holders = _functions_with(Path(kernels.state().module.__file__), VNNI_OPS)
    assert holders, "linear_quant's integer dot products are gone"
    tile = r"\b(nibble_tile_vnni<\d>|byte_tile<\d+, \d, \d+>|dot_burst)\("
    assert all(re.search(tile, f) for f in holders), sorted(holders)
    assert not any("vnni" in flag for flag in kernels.CFLAGS)



# the newer instruction sets' intrinsics, each in one file (the objdump tests above check, where the
# library is built, that inside it only the attributed functions hold the instructions)
ISA_FILES = {r"\b_mm512_dpbf16_ps\b|\b__m512bh\b": "linear_float.cpp",
             r"\b_mm512_dpbusds?_epi32\b|\b_mm512_dpwssds?_epi32\b": "linear_quant_vnni.cpp",
             r"\b_tile_\w+\(": "linear_amx.cpp"}
# measured figures belong in docs/kernels.md, not in the sources' comments
FIGURE = re.compile(r"\b\d+(\.\d+)?\s*(GB/s|MB/s|ms|us|µs)\b|\b\d+(\.\d+)?x\b")


def _sources() -> list[Path]:
    return sorted([*kernels.SOURCES, *kernels.HEADERS])


def _header_comment(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    head = []
    for line in lines:
        if not line.startswith("//"):
            break
        head.append(line[2:].strip())
    return head


def _comments(path: Path) -> str:
    return "\n".join(line.split("//", 1)[1] for line in path.read_text().splitlines() if "//" in line)


def test_the_build_flags_keep_their_properties():
    """One set of flags for every file: no FMA contraction (rope_qkv rounds as torch does), OpenMP,
    and no flag that would let the compiler put AVX512-BF16, VNNI or AMX code anywhere."""
    assert "-ffp-contract=off" in kernels.CFLAGS and "-fopenmp" in kernels.CFLAGS
    assert not any(f.startswith(("-mavx512bf16", "-mavx512vnni", "-mamx", "-march", "-ffast-math"))
                   for f in kernels.CFLAGS)
    for path in _sources():
        assert not re.search(r"#pragma\s+GCC\s+(target|optimize)|#pragma\s+clang\s+attribute",
                             path.read_text()), path.name


def test_each_newer_instruction_set_lives_in_its_own_file():
    for pattern, owner in ISA_FILES.items():
        holders = {p.name for p in _sources() if re.search(pattern, p.read_text())}
        assert holders == {owner}, (pattern, sorted(holders))


def test_every_kernel_source_opens_with_what_it_owns():
    """Each file starts with a comment of two lines or more that says what it owns (or does not),
    and a .cpp names there every entry point (kernels.h) it defines."""
    entry = re.compile(r"^(?:torch::Tensor|void|bool|int64_t) (\w+)\(", re.M)
    declared = set(entry.findall((kernels.CSRC / "kernels.h").read_text()))
    assert {"linear_bf16", "linear_quant", "attention", "decoder_layer"} <= declared
    for path in _sources():
        head = _header_comment(path)
        text = " ".join(head)
        assert len(head) >= 2 and re.search(r"\bown", text), f"{path.name}: no header comment saying what it owns"
        if path.suffix == ".cpp":
            defined = set(entry.findall(path.read_text())) & declared
            missing = sorted(name for name in defined if not re.search(rf"\b{name}\b", text))
            assert not missing, f"{path.name} defines {missing} but its header comment does not name them"


def test_kernel_sources_hold_no_measured_figures_and_no_long_files():
    """Comments keep the reasoning; measured figures go to docs/kernels.md with the script that
    measures them. No kernel file (C++ or Python) over 800 lines."""
    for path in _sources():
        hits = [m.group(0) for m in FIGURE.finditer(_comments(path))]
        assert not hits, f"{path.name}: figures {hits} in comments (docs/kernels.md)"
    for path in [*_sources(), *Path(kernels.__file__).parent.glob("*.py")]:
        assert len(path.read_text().splitlines()) <= 800, path.name
    doc = (ROOT / "docs" / "kernels.md").read_text()
    assert all(p.name in doc for p in _sources()), "docs/kernels.md lists every source file"

@needs
def test_setting_the_kernels_up_again_loads_the_same_build(monkeypatch):
    """A second setup in the process (a test's switch, a reset state) keys the same build: the
    flags handed to torch's build are copies, so its own additions do not change the key (each
    setup compiled a new build, ~65 s, four times in the test suite)."""
    before = (list(kernels.CFLAGS), list(kernels.LDFLAGS))
    first = kernels.state().build_dir
    monkeypatch.setattr(kernels, "_STATE", None)
    assert kernels.state().build_dir == first
    assert (kernels.CFLAGS, kernels.LDFLAGS) == before


@needs
def test_without_avx512_vnni_the_codes_run_on_fma(monkeypatch):
    """The CPU flag gate: no integer dot products are packed, and the codes still run (fp32 FMA)."""
    from test_quant import gguf_tiny_target
    from eagle3.runtime.target import build_target
    flags = kernels.cpu_flags() - {kernels.VNNI_FLAG}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "_STATE", None)
    assert not kernels.integer_dots() and "vnni" not in kernels.why()
    model, codes = gguf_tiny_target("Q4_1")
    layout = build_target(model, torch.float32, row_stable=True, gguf=codes)
    assert layout.weights_name == "gguf:Q4_1" and not any(l.integer_dots for l in layout.linears)
    out = layout(torch.tensor([[1, 2, 3]]), torch.arange(3), layout.new_cache(8))
    assert torch.isfinite(out.logits).all()
    part = codes.codes["layers.0.mlp.up_proj.weight"].kernel_part()
    with pytest.raises(ValueError, match="no AVX512-VNNI.*pass integer_dots=None"):
        kernels.pack_quant([part], integer_dots=True)


@needs
def test_without_avx512_bf16_no_bf16_kernel_is_handed_out(monkeypatch, tmp_path):
    """The CPU flag gate: bf16 packing then takes oneDNN, and no layer gets the bf16 one-call path."""
    from eagle3.runtime.target import build_target
    from eagle3.testing import FAMILIES, hf_model_from_dict, native_from_hf
    flags = kernels.cpu_flags() - {kernels.BF16_FLAG}
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "_STATE", None)
    assert kernels.small_linear(torch.float32) is not None
    assert kernels.small_linear(torch.bfloat16) is None and not kernels.state().bf16
    model = native_from_hf(hf_model_from_dict(FAMILIES["llama3"]), tmp_path)
    model = build_target(model, torch.bfloat16, row_stable=True)
    linears = model.linears
    assert linears and all(l.small is None and l.onednn is not None for l in linears)
    assert all(layer.one_call is None for layer in model.layers)
    out = model(torch.tensor([[1, 2, 3]]), torch.arange(3), model.new_cache(8))
    assert torch.isfinite(out.logits).all()

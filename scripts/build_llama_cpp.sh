#!/usr/bin/env bash
# Optional, for `eagle3 bench`: build llama.cpp's EAGLE-3 runner (llama-speculative-simple, which
# takes --spec-type draft-eagle3) and its plain command-line generator (llama-completion, the
# `llama.cpp-native` system) from the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, and
# expose its convert_hf_to_gguf.py. Cached under ~/.cache/eagle3/llama.cpp (EAGLE3_LLAMA_CPP);
# a second run does nothing. Never run in CI. About 10 minutes on 2 cores; it runs under nice -n 19
# with one compile job (JOBS=N to change) so it does not starve the machine.
#
#   bash scripts/build_llama_cpp.sh            # build once
#   bash scripts/build_llama_cpp.sh --force    # also while a pip build of llama-cpp-python runs
#
# Layout:  $HOME_DIR/llama_cpp_python-0.3.36.tar.gz   the sdist (pip download, PyPI only)
#          $HOME_DIR/src -> .../vendor/llama.cpp       sources + convert_hf_to_gguf.py + gguf-py
#          $HOME_DIR/build/bin/llama-speculative-simple, llama-completion
set -euo pipefail

VERSION=0.3.36
HOME_DIR="${EAGLE3_LLAMA_CPP:-$HOME/.cache/eagle3/llama.cpp}"
JOBS="${JOBS:-1}"
PY="${PYTHON:-python3}"
BIN="$HOME_DIR/build/bin/llama-speculative-simple"
PLAIN="$HOME_DIR/build/bin/llama-completion"

if [[ -x "$BIN" && -x "$PLAIN" && -f "$HOME_DIR/src/convert_hf_to_gguf.py" ]]; then
  echo "already built: $BIN $PLAIN"
  exit 0
fi
if [[ "${1:-}" != "--force" ]] && pgrep -f "pip.*install.*llama.cpp.python|pip.*install.*llama_cpp_python" >/dev/null; then
  echo "a pip build of llama-cpp-python is running; wait for it (or pass --force)" >&2
  exit 1
fi
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install cmake g++)" >&2; exit 1; }
done

mkdir -p "$HOME_DIR"
cd "$HOME_DIR"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d .
fi
if [[ ! -d "llama_cpp_python-$VERSION/vendor/llama.cpp/src" ]]; then
  tar xzf "$SDIST" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
ln -sfn "llama_cpp_python-$VERSION/vendor/llama.cpp" src

nice -n 19 cmake -S src -B build -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF
CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" nice -n 19 cmake --build build --target llama-speculative-simple llama-completion
echo "built: $BIN $PLAIN"
echo "draft converter: $HOME_DIR/src/convert_hf_to_gguf.py (needs: pip install gguf sentencepiece)"

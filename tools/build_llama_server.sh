#!/usr/bin/env bash
# llama.cpp's `llama-server` from source, for `python -m bench serve-vs-vllm` (the llama.cpp peer) only.
# Never a dependency of this project; not run by setup.sh or CI.
#
#   tools/build_llama_server.sh [PREFIX]     # default ~/llama-server; installs PREFIX/bin/llama-server
#                                            # and PREFIX/bin/llama-quantize (bench makes its Q8_0 GGUF with it)
#
# Where the source comes from (the first that exists):
#   1. $LLAMA_CPP_SRC: a llama.cpp checkout (the directory holding its CMakeLists.txt);
#   2. a llama_cpp_python-<version>.tar.gz sdist in $PIP_FIND_LINKS (a local wheel folder) or
#      $PREFIX/src (a copy fetched before);
#   3. `pip download llama-cpp-python==<version> --no-binary :all: --no-deps` into $PREFIX/src.
# The sdist carries llama.cpp as vendor/llama.cpp, at the commit llama-cpp-python pins: the same
# llama.cpp that bench/llamacpp.py runs in-process. <version> is $LLAMA_CPP_PYTHON_VERSION, else
# the llama-cpp-python installed for $PYTHON (default: python3), else 0.3.36.
#
# The build: only the llama-server and llama-quantize targets ($TARGETS), Release, GGML_NATIVE (this CPU's instruction sets:
# AVX2 / AVX-512 / VNNI / AMX as present), static ggml, no tests / examples / libcurl / web UI
# download, under `nice -n 19` with $JOBS (default: all usable CPUs) jobs, because the machine's cores
# are shared with other work. It writes PREFIX/BUILD_INFO (source, version, cmake flags, seconds).
set -euo pipefail
PREFIX=${1:-$HOME/llama-server}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
TARGETS=${TARGETS:-llama-server llama-quantize}
mkdir -p "$PREFIX/bin" "$PREFIX/src"
PREFIX=$(cd "$PREFIX" && pwd)

VERSION=${LLAMA_CPP_PYTHON_VERSION:-$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || echo 0.3.36)}

if [[ -n "${LLAMA_CPP_SRC:-}" ]]; then
  SRC=$(cd "$LLAMA_CPP_SRC" && pwd)
  ORIGIN="llama.cpp checkout $SRC"
else
  SDIST=""
  for dir in ${PIP_FIND_LINKS:-} "$PREFIX/src"; do
    for f in "$dir"/llama_cpp_python-"$VERSION".tar.gz; do
      [[ -f "$f" ]] && SDIST=$f && break 2
    done
  done
  if [[ -z "$SDIST" ]]; then
    echo "[build_llama_server] downloading the llama-cpp-python $VERSION sdist (it vendors llama.cpp) ..."
    "$PYTHON" -m pip download -q "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$PREFIX/src"
    SDIST=$PREFIX/src/llama_cpp_python-$VERSION.tar.gz
  fi
  rm -rf "$PREFIX/src/llama_cpp_python-$VERSION"
  tar -xzf "$SDIST" -C "$PREFIX/src"
  SRC=$PREFIX/src/llama_cpp_python-$VERSION/vendor/llama.cpp
  ORIGIN="llama-cpp-python $VERSION sdist ($(basename "$SDIST")), vendor/llama.cpp"
fi
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no llama.cpp CMakeLists.txt under $SRC" >&2; exit 1; }

BUILD=$PREFIX/build
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
       -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON)
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
start=$(date +%s)
rm -rf "$BUILD"  # a fresh configure: the flags above, this CPU's
nice -n 19 cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" "${FLAGS[@]}"
# shellcheck disable=SC2086
nice -n 19 cmake --build "$BUILD" --target $TARGETS -j "$JOBS"
seconds=$(( $(date +%s) - start ))
for t in $TARGETS; do
  install -m 755 "$BUILD/bin/$t" "$PREFIX/bin/$t"
done
cat > "$PREFIX/BUILD_INFO" <<EOF
source: $ORIGIN
targets: $TARGETS
cmake: ${FLAGS[*]}
jobs: $JOBS (nice -n 19)
build_seconds: $seconds
EOF
"$PREFIX/bin/llama-server" --version 2>&1 | tail -n 2 >> "$PREFIX/BUILD_INFO" || true  # version and commit
echo "[build_llama_server] $TARGETS built into $PREFIX/bin in ${seconds} s"
cat "$PREFIX/BUILD_INFO"

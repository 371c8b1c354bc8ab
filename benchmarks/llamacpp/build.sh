#!/usr/bin/env bash
# Build benchmarks/llamacpp/llama_decode_bench.cpp and llama_kv_quality.cpp against the libraries and headers
# fetch.sh put in the ortkv cache (fetching them first if missing); the executables go beside the libraries
# (rpath $ORIGIN, so ggml finds its CPU variant libraries there too). Prints llama_decode_bench's path (the
# other executable is beside it).
#   benchmarks/llamacpp/build.sh [LLAMACPP_DIR]   (default: the directory fetch.sh prints)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-$("$HERE/fetch.sh")}"
CXX="${CXX:-c++}"
command -v "$CXX" >/dev/null || { echo "build.sh: no C++ compiler ($CXX); install g++ or set CXX" >&2; exit 1; }
LIBLLAMA="$(ls "$DIR/lib" | grep -E '^libllama(\.v[0-9.]+)?\.so$' | head -1 || true)"
LIBGGML="$(ls "$DIR/lib" | grep -E '^libggml(\.v[0-9.]+)?\.so$' | head -1 || true)"
[[ -n "$LIBLLAMA" && -n "$LIBGGML" ]] || { echo "build.sh: no libllama / libggml in $DIR/lib: run fetch.sh" >&2; exit 1; }
for PROG in llama_kv_quality llama_decode_bench; do
  OUT="$DIR/lib/$PROG"
  "$CXX" -O2 -std=c++17 -o "$OUT.tmp" "$HERE/$PROG.cpp" -I"$DIR/include" -L"$DIR/lib" \
    -l:"$LIBLLAMA" -l:"$LIBGGML" -l:libggml-base.so -Wl,-rpath,'$ORIGIN'
  mv "$OUT.tmp" "$OUT"
done
echo "$OUT"

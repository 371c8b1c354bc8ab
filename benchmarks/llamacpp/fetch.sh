#!/usr/bin/env bash
# Fetch llama.cpp's prebuilt CPU libraries and its headers from npm, version pinned, into the ortkv cache:
#   <cache>/llamacpp-<version>/lib      libllama / libggml*.so (every CPU variant ggml picks from at run time)
#   <cache>/llamacpp-<version>/include  llama.h, ggml*.h, gguf.h
# <cache> = $ORTKV_CACHE_DIR, else $XDG_CACHE_HOME/ortkv, else ~/.cache/ortkv (as python/ortkv/generate/assets.py).
# The libraries come from @node-llama-cpp/linux-x64 (node-llama-cpp's prebuilt binaries); the headers from
# the llama.cpp source node-llama-cpp ships as a git bundle (package/llama/gitRelease.bundle) of the same
# release. Needs npm, git and tar; nothing is committed to the repository. Prints the directory.
set -euo pipefail
VERSION="${NODE_LLAMA_CPP_VERSION:-3.22.1}"
CACHE="${ORTKV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ortkv}"
DEST="$CACHE/llamacpp-$VERSION"
if [[ -f "$DEST/include/llama.h" && -n "$(ls "$DEST"/lib/libllama*.so 2>/dev/null)" ]]; then
  echo "$DEST"; exit 0
fi
for tool in npm git tar; do
  command -v "$tool" >/dev/null || { echo "fetch.sh: $tool is not installed (needed to fetch llama.cpp $VERSION)" >&2; exit 1; }
done
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) PLATFORM=linux-x64 ;;
  Linux-aarch64) PLATFORM=linux-arm64 ;;
  *) echo "fetch.sh: no prebuilt llama.cpp package for $(uname -s)-$(uname -m)" >&2; exit 1 ;;
esac
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
( cd "$TMP" && npm pack --silent "@node-llama-cpp/$PLATFORM@$VERSION" "node-llama-cpp@$VERSION" >/dev/null )
mkdir -p "$TMP/bins" "$TMP/src" "$TMP/out/lib" "$TMP/out/include"
tar xzf "$TMP"/node-llama-cpp-"$PLATFORM"-"$VERSION".tgz -C "$TMP/bins"
tar xzf "$TMP"/node-llama-cpp-"$VERSION".tgz -C "$TMP/src" package/llama/gitRelease.bundle package/llama/llama.cpp.info.json
cp "$TMP/bins/package/bins/$PLATFORM"/*.so "$TMP/bins/package/bins/$PLATFORM"/_nlcBuildMetadata.json "$TMP/out/lib/"
git clone -q --no-checkout "$TMP/src/package/llama/gitRelease.bundle" "$TMP/llama.cpp"
for h in include/llama.h ggml/include/ggml.h ggml/include/ggml-alloc.h ggml/include/ggml-backend.h \
         ggml/include/ggml-cpu.h ggml/include/ggml-opt.h ggml/include/gguf.h; do
  git -C "$TMP/llama.cpp" show "HEAD:$h" > "$TMP/out/include/$(basename "$h")"
done
{ echo "node-llama-cpp $VERSION ($PLATFORM)"; cat "$TMP/src/package/llama/llama.cpp.info.json";
  echo "bundle commit $(git -C "$TMP/llama.cpp" rev-parse HEAD)"; } > "$TMP/out/VERSION.txt"
mkdir -p "$CACHE"
rm -rf "$DEST"
mv "$TMP/out" "$DEST"
echo "$DEST"

"""`ortkv bench --device cuda` (see python/ortkv/generate/bench.py): float16 SmolLM2-135M on the GPU, ortkv
(CUDA graph and not) against onnxruntime-genai (share-buffer and not), the copy model and, where
$ORTKV_LLAMACPP_BENCH names a driver, llama.cpp; batch 1/8/32, max_length 2048/8192, prompt 16/1024, 256 new
tokens, each variant in its own process. Extra arguments go to `ortkv bench` (e.g. --out, --quick)."""

import sys

from ortkv.generate.bench import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        args = ["--device", "cuda"] + args
    sys.exit(main(args + ([] if any(a.startswith("--out") for a in args) else ["--out", "benchmarks/results"])))

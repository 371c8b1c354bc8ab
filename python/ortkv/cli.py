"""The ``ortkv`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="ortkv", description="ortkv: in-place KV caches for ONNX Runtime")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="decode with an in-place cache beside a Concat copy baseline", add_help=False)
    sub.add_parser("generate", help="generate text with SmolLM2-135M through ortkv (--compare: vs GenAI, copy)",
                   add_help=False)
    sub.add_parser("bench", help="ortkv vs onnxruntime-genai (share-buffer and not) vs copy, same weights",
                   add_help=False)
    sub.add_parser("check", help="check a model: alias rules, alias-aware shapes, peak-memory plan", add_help=False)
    sub.add_parser("lib", help="print the op library path (for register_custom_ops_library)")
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "generate":
        from .generate.cli import main as generate_main

        return generate_main(rest)
    if cmd == "bench":
        from .generate.bench import main as bench_main

        return bench_main(rest)
    if cmd == "check":
        from .graph.cli import main as check_main

        return check_main(rest)
    if cmd == "lib":
        from . import get_library_path

        print(get_library_path())
        return 0
    p.parse_args(argv)  # reports the unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``ortkv`` command line."""

from __future__ import annotations

import argparse
import difflib
import os
import sys

COMMANDS = {
    "demo": "decode with an in-place cache beside a Concat copy baseline",
    "generate": "generate text with SmolLM2-135M through ortkv (--compare: vs GenAI, copy)",
    "bench": "ortkv vs onnxruntime-genai (share-buffer and not) vs copy, same weights",
    "check": "check a model: alias rules, alias-aware shapes, peak-memory plan",
    "cache": "list or remove the cached model files (ortkv cache list | rm NAME | rm --all)",
    "lib": "print the op library path (for register_custom_ops_library)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ortkv", description="ortkv: in-place KV caches for ONNX Runtime",
                                epilog="`ortkv COMMAND --help` lists a command's options")
    p.add_argument("--version", action="store_true", help="print the version")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def _usage_error(message: str) -> int:
    print(f"usage: ortkv [-h] [--version] COMMAND ...\nortkv: error: {message}", file=sys.stderr)
    return 2


def _dispatch(cmd: str, rest: list) -> int:
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
    if cmd == "cache":
        from .generate.cache import main as cache_main

        return cache_main(rest)
    from . import get_library_path  # lib

    if rest:
        return _usage_error(f"'ortkv lib' takes no arguments (got {' '.join(rest)})")
    print(get_library_path())
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _parser().print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"ortkv {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    names = ", ".join(COMMANDS)
    if cmd.startswith("-"):
        return _usage_error(f"unknown option '{cmd}': ortkv itself takes only --help and --version; options go "
                            f"after a command (ortkv generate --help); commands: {names}")
    if cmd not in COMMANDS:
        close = difflib.get_close_matches(cmd, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return _usage_error(f"unknown command '{cmd}'{hint} (commands: {names})")
    try:
        return _dispatch(cmd, rest)
    except KeyboardInterrupt:
        # Note [Ctrl-C]: no traceback, exit status 128 + SIGINT as shells report it; a line of streamed
        # text that was cut is ended first so the message stands on its own line.
        sys.stdout.flush()
        print("\nortkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ortkv ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

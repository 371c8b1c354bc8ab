"""``ortkv check MODEL [--dims NAME=VALUE ...] [--bounds NAME=LO:HI ...]``: findings and memory plan.

Exit codes: 0 no errors, 1 the model has errors (the report says which), 2 the command could not run
(misuse, or a file that is not an ONNX model): one line on stderr, ``ortkv check: ...``, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import onnx

from ..errors import OrtkvError

MAX_FILE_BYTES = 2 << 30  # protobuf refuses messages of 2 GiB and more; weights above that are external data


class _Misuse(Exception):
    """The command line cannot be run; the message is the one line printed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage too and exit: one line, returned as 2
        raise _Misuse(message)


def _one_line(text) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0][:500] if lines else ""


def _pairs(items, opt: str, example: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise _Misuse(f"{opt} '{item}' must look like NAME=VALUE (e.g. {opt} {example})")
        if name in out:
            raise _Misuse(f"{opt} gives '{name}' twice ({name}={out[name]} and {item}); give each name once")
        out[name] = value
    return out


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _Misuse(f"{what}: the value must be an integer") from None


def _parse(argv):
    p = _Parser(prog="ortkv check", description="check a model's alias annotations, infer every "
                "value's type and shape (alias-aware) and plan its peak memory")
    p.add_argument("model", nargs="?", help="path of an .onnx model (external data is not read)")
    p.add_argument("--variant", choices=["ortkv", "genai", "copy"],
                   help="check the default SmolLM2 decoder of this variant instead (built on first use)")
    p.add_argument("--config", help="genai_config.json for --variant (default: ./genai_config.json)")
    p.add_argument("--dims", nargs="*", metavar="NAME=VALUE", help="bind symbolic dims, e.g. batch=1 seq=1 "
                   "capacity=2048; with every dim bound the memory plan is printed")
    p.add_argument("--bounds", nargs="*", metavar="NAME=LO:HI", help="known range of an integer input, e.g. "
                   "positions=0:4095 (checked against the cache capacity)")
    p.add_argument("--share-buffer", action="store_true", help="plan as onnxruntime-genai's "
                   "past_present_share_buffer runs it: each GroupQueryAttention's present K/V is its past K/V buffer")
    p.add_argument("--threads", default="1", help="threads for per-thread kernel workspace (default 1)")
    p.add_argument("--json", action="store_true", help="print findings and plan as JSON")
    args = p.parse_args(argv)
    for opt in ("dims", "bounds"):  # "--dims a=1 model.onnx": the path was taken as one more NAME=VALUE
        items = getattr(args, opt) or []
        last = items[-1] if items else ""
        if args.model is None and last and "=" not in last and (last.endswith(".onnx") or os.path.isfile(last)):
            args.model = items.pop()
    dims = {}
    for k, v in _pairs(args.dims or [], "--dims", "batch=1").items():
        dims[k] = _int(v, f"--dims {k}={v}")
        if dims[k] < 0:
            raise _Misuse(f"--dims {k}={v}: a dim is >= 0")
    bounds = {}
    for k, v in _pairs(args.bounds or [], "--bounds", "positions=0:4095").items():
        what = f"--bounds {k}={v}: expected LO:HI integers (or one integer)"
        lo, sep, hi = v.partition(":")
        lo, hi = _int(lo, what), _int(hi if sep else lo, what)
        if lo > hi:
            raise _Misuse(f"--bounds {k}={v}: LO {lo} is above HI {hi}")
        bounds[k] = (lo, hi)
    if args.model and args.variant:
        raise _Misuse(f"give either a MODEL path or --variant, not both (got '{args.model}' and "
                      f"--variant {args.variant})")
    if not args.model and not args.variant:
        raise _Misuse("give a MODEL path (an .onnx file) or --variant ortkv|genai|copy")
    if args.config and not args.variant:
        raise _Misuse(f"--config applies only with --variant; '{args.model}' is checked as it is")
    threads = _int(args.threads, f"--threads {args.threads}")
    if threads < 1:
        raise _Misuse(f"--threads {threads}: at least 1")
    return args, dims, bounds, threads


def _load(path: str) -> onnx.ModelProto:
    if os.path.isdir(path):
        raise _Misuse(f"'{path}' is a directory; give the path of an .onnx file")
    if not os.path.exists(path):
        raise _Misuse(f"cannot load '{path}': no such file")
    size = os.path.getsize(path)
    if size == 0:
        raise _Misuse(f"'{path}' is empty (0 bytes); not an ONNX model")
    if size >= MAX_FILE_BYTES:
        raise _Misuse(f"'{path}' is {size} bytes; an ONNX file holds less than 2 GiB (larger weights live in "
                      f"external data files, which ortkv check does not read)")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise _Misuse(f"cannot load '{path}': not an ONNX model ({type(exc).__name__}: {_one_line(exc)})") from None
    if model.ir_version <= 0 and not model.HasField("graph"):
        raise _Misuse(f"'{path}' is not an ONNX model (it parses as protobuf but has no IR version and no graph)")
    return model


def main(argv=None) -> int:
    try:
        args, dims, bounds, threads = _parse(argv)
    except _Misuse as exc:
        print(f"ortkv check: {exc}", file=sys.stderr)
        return 2
    path = args.model
    try:
        if args.variant:
            from ..generate.cli import resolve_config
            from ..generate.models import model_path

            path = str(model_path(resolve_config(args.config), args.variant, log=lambda m: print(m, file=sys.stderr)))
        model = _load(path)
    except _Misuse as exc:
        print(f"ortkv check: {exc}", file=sys.stderr)
        return 2
    except OrtkvError as exc:
        print(f"ortkv check: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # building or finding the --variant model
        print(f"ortkv check: cannot load '{path}': {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 2
    from .check import check
    from .shapes import share_buffer_aliases

    assumed = share_buffer_aliases(model) if args.share_buffer else None
    report = check(model, dims=dims, bounds=bounds, threads=threads, assume_aliases=assumed)
    if args.json:
        print(json.dumps({
            "model": path,
            "findings": [vars(f) for f in report.findings],
            "typed": report.shapes.counts()[0],
            "values": report.shapes.counts()[1],
            "alias_classes": report.shapes.classes(),
            "dims": report.shapes.dim_bindings(),
            "plan": report.plan.as_dict() if report.plan else None,
            "plan_error": report.plan_error,
        }, indent=2))
    else:
        print(f"model: {path}")
        print(report.format())
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())

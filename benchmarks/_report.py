"""What every benchmark script does with its report: print it, and write it to --out when given."""

from __future__ import annotations


def emit(text: str, out: str | None) -> int:
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0

"""A/B of harness builds: runs two or more builds of a sweep binary (paged_sweep, attention_sweep, update_sweep: a
variant each, e.g. built with different -D knobs) with the same arguments, alternating them round after round on one
GPU, and prints each row's median time per build and the ratios to the first build.

These machines are shared and noisy (one cell read 16 and 33 tok/s minutes apart), so a comparison is only taken from
builds run alternately in one sitting, as medians. A row is one line of the sweeps' tables, `<cell> | <kernel>
<us> <GB/s> ...`: its cell (the text before '|') and kernel name make its key, its first decimal number after the
name is the time. Rows that a build does not print are left empty for it.

    python benchmarks/cuda/sweep_ab.py --rounds 3 main=/tmp/paged_sweep int8t=/tmp/paged_sweep_int8t \\
        -- 20 0,1,14,2,3 F84                         (the sweep's own arguments after --)
    python benchmarks/cuda/sweep_ab.py --rounds 3 --match 'INT8 v3us|F16 v3us' a=/tmp/ps_a b=/tmp/ps_b -- 20 0,3 F8

--match keeps the rows whose kernel name matches a regular expression; --out writes the table (markdown) to a file.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the scripts' shared report helper
from _report import emit  # noqa: E402

ROW = re.compile(r"^(?P<cell>[^|]*\S)\s*\|\s(?P<name>.+?)\s+(?P<us>\d+\.\d+)\s+\d")


def parse(text: str) -> dict[tuple[str, str], float]:
    """The rows of one run's output: (cell, kernel name) -> microseconds (the first row of a key wins)."""
    rows: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            rows.setdefault((" ".join(m["cell"].split()), m["name"].strip()), float(m["us"]))
    return rows


DIFF = re.compile(r"max \|diff\| (?P<d>\d+(\.\d+)?)")


def parse_diffs(text: str) -> dict[tuple[str, str], float]:
    """The outputs' checks of one run: (cell, kernel name) -> the largest "max |diff| X" printed on its row or on
    the lines after it before the next row (paged_sweep prints it on the row, attention_sweep on the next line)."""
    diffs: dict[tuple[str, str], float] = {}
    key = None
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            key = (" ".join(m["cell"].split()), m["name"].strip())
        d = DIFF.search(line)
        if d and key is not None:
            diffs[key] = max(diffs.get(key, 0.0), float(d["d"]))
    return diffs


def run_rounds(builds: list[tuple[str, str]], args: list[str], rounds: int, runner=None, log=print):
    """Each round runs every build once, in turn (the order rotated each round so that no build always runs
    first); returns {key: {build: [us of each round]}}, the keys in first-seen order and {key: {build: the
    largest max |diff| of its rounds}}."""
    runner = runner or (lambda path, a: subprocess.run([path, *a], capture_output=True, text=True, check=True).stdout)
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    order: list[tuple[str, str]] = []
    diffs: dict[tuple[str, str], dict[str, float]] = {}
    for r in range(rounds):
        for i in range(len(builds)):
            name, path = builds[(i + r) % len(builds)]
            log(f"round {r + 1}/{rounds}: {name}", file=sys.stderr)
            out = runner(path, args)
            for key, us in parse(out).items():
                if key not in times:
                    times[key] = {}
                    order.append(key)
                times[key].setdefault(name, []).append(us)
            for key, d in parse_diffs(out).items():
                per = diffs.setdefault(key, {})
                per[name] = max(per.get(name, 0.0), d)
    return times, order, diffs


def table(builds: list[str], times, order, match: str | None = None, diffs=None) -> str:
    """diffs ({key: {build: max |diff|}}, run_rounds'): a last column, each build's largest output check."""
    pat = re.compile(match) if match else None
    head = "| cell | kernel | " + " | ".join(f"{b} us" for b in builds) + " | " + \
        " | ".join(f"{b} / {builds[0]}" for b in builds[1:]) + " |" + \
        (f" max \\|diff\\| {' / '.join(builds)} |" if diffs else "")
    lines = [head, "|" + "---|" * (2 + 2 * len(builds) - 1 + (1 if diffs else 0))]
    for cell, kernel in order:
        if pat and not pat.search(kernel):
            continue
        per = times[(cell, kernel)]
        med = {b: statistics.median(per[b]) for b in builds if b in per}
        cols = [f"{med[b]:.2f} ({min(per[b]):.2f}-{max(per[b]):.2f})" if b in med else "-" for b in builds]
        ratios = [f"{med[b] / med[builds[0]]:.3f}" if b in med and builds[0] in med else "-" for b in builds[1:]]
        row = f"| {cell} | {kernel} | " + " | ".join(cols) + " | " + " | ".join(ratios) + " |"
        if diffs:
            d = diffs.get((cell, kernel), {})
            row += " " + " / ".join(f"{d[b]:.5f}" if b in d else "-" for b in builds) + " |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, sweep_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", help="NAME=PATH of each build (the first is the baseline of the ratios)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--match", help="keep the rows whose kernel name matches this regular expression")
    p.add_argument("--out", help="also write the table to this file")
    a = p.parse_args(argv)
    builds = []
    for b in a.builds:
        name, sep, path = b.partition("=")
        if not sep or not name or not path:
            p.error(f"{b!r} is not NAME=PATH (e.g. main=/tmp/paged_sweep)")
        builds.append((name, path))
    if len({n for n, _ in builds}) != len(builds):
        p.error("two builds share a name")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        times, order, diffs = run_rounds(builds, sweep_args, a.rounds)
    except subprocess.CalledProcessError as e:
        print(f"sweep_ab: {' '.join(map(str, e.cmd))} exited with {e.returncode}; no table (a failed build has no "
              f"times to compare):\n{e.stderr or ''}", file=sys.stderr)
        return 1
    text = (f"`sweep_ab.py --rounds {a.rounds} {' '.join(a.builds)} -- {' '.join(sweep_args)}`: medians of "
            f"{a.rounds} alternated rounds (min-max); the outputs' checks, largest over the rounds\n\n" +
            table([n for n, _ in builds], times, order, a.match, diffs))
    return emit(text, a.out)


if __name__ == "__main__":
    sys.exit(main())

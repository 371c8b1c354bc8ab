"""The loops of one CUDA kernel as the GPU runs them: instructions per iteration, tensor-core ops, and the source
lines they come from, read from the SASS of a binary built here (no GPU needed).

A kernel loop that is bound by instruction issue or latency (benchmarks/results/paged_attention_cuda_h200.md: the
INT4 register decode of PagedCacheAttention) is tuned by its instruction count per iteration, and the SASS says
what the C++ does not: rematerialized registers, selects, address arithmetic. This script lists every loop
(a backward branch and its target) of a function with at least --min-mma HMMA instructions, and with --range
the instructions of one loop by source line and by opcode.

    nvcc ... -lineinfo benchmarks/cuda/paged_sweep.cu ... -o /tmp/paged_sweep    (see paged_sweep.cu)
    python benchmarks/cuda/sass_loops.py /tmp/paged_sweep --function 'PagedAttentionV3I6__halfLi64'
    python benchmarks/cuda/sass_loops.py /tmp/paged_sweep --function 'PagedAttentionV3I6__halfLi64' \\
        --range 0x1d350 0x1f420

cuobjdump and nvdisasm come from the PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the CUDA
toolkit's own where it has them): `pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, unzip,
and pass --bin DIR (the wheels' nvidia/cu13/bin), or put them on PATH.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_LINE = re.compile(r'\s*//## File "(.*?)", line (\d+)')
_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA.*`\(\.(L_x_\d+)\)")


def _tool(name: str, bin_dir: str | None) -> str:
    path = shutil.which(name, path=bin_dir) if bin_dir else shutil.which(name)
    if path is None:
        sys.exit(f"{name} not found{' in ' + bin_dir if bin_dir else ' on PATH'}; see this script's docstring")
    return path


def disassemble(binary: Path, function: str, bin_dir: str | None) -> list[str]:
    """nvdisasm -gi of the first function of `binary` whose mangled name contains `function`."""
    cuobjdump, nvdisasm = _tool("cuobjdump", bin_dir), _tool("nvdisasm", bin_dir)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", str(binary.resolve())], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        for cubin in sorted(Path(tmp).glob("*.cubin")):
            symbols = subprocess.run(["readelf", "-sW", str(cubin)], capture_output=True, text=True).stdout
            for row in symbols.splitlines():
                cols = row.split()
                if len(cols) >= 8 and cols[3] == "FUNC" and function in cols[-1]:
                    index = cols[0].rstrip(":")
                    out = subprocess.run([nvdisasm, "-gi", "-c", "-fun", index, str(cubin)], capture_output=True,
                                         text=True, check=True).stdout
                    print(f"{cols[-1]} ({cubin.name}, symbol {index})")
                    return out.splitlines()
    sys.exit(f"no function matching {function!r} in {binary}")


def parse(lines: list[str]):
    """[(address, instruction, [(file, line), ...] innermost first)], {label: address}."""
    insns, labels, pending_chain, chain, pending_labels = [], {}, None, [], []
    for text in lines:
        m = _LINE.match(text)
        if m:
            pending_chain = (pending_chain or []) + [(os.path.basename(m.group(1)), int(m.group(2)))]
            continue
        m = _LABEL.match(text.strip())
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _INSN.match(text)
        if m:
            if pending_chain:
                chain, pending_chain = pending_chain, None
            address = int(m.group(1), 16)
            for label in pending_labels:
                labels[label] = address
            pending_labels = []
            insns.append((address, m.group(2).strip(), chain))
    return insns, labels


def find_loops(insns, labels):
    """[(start, end, body)] for every backward branch: its target, the branch's address, the instructions between."""
    loops = []
    for address, insn, _ in insns:
        m = _BRANCH.search(insn)
        if m and m.group(1) in labels and labels[m.group(1)] < address:
            start = labels[m.group(1)]
            loops.append((start, address, [x for x in insns if start <= x[0] <= address]))
    return loops


def opcode(insn: str) -> str:
    words = insn.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", type=Path)
    ap.add_argument("--function", required=True, help="a substring of the kernel's mangled name")
    ap.add_argument("--bin", default=None, help="folder with cuobjdump and nvdisasm")
    ap.add_argument("--min-mma", type=int, default=1, help="list loops with at least this many HMMA")
    ap.add_argument("--max-size", type=int, default=2000, help="skip loops longer than this (outer loops)")
    ap.add_argument("--range", nargs=2, metavar=("START", "END"), help="one loop's addresses (hex): its breakdown")
    args = ap.parse_args()
    insns, labels = parse(disassemble(args.binary, args.function, args.bin))
    print(f"{len(insns)} instructions")
    if args.range:
        lo, hi = (int(x, 16) for x in args.range)
        body = [x for x in insns if lo <= x[0] <= hi]
        by_line, by_op = collections.Counter(), collections.Counter()
        for _, insn, chain in body:
            by_line[chain[0] if chain else ("?", 0)] += 1
            by_op[opcode(insn)] += 1
        print(f"{len(body)} instructions in {args.range[0]}..{args.range[1]}")
        print("by innermost source line:")
        for (name, line), n in sorted(by_line.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            print(f"  {name}:{line:<6} {n}")
        print("by opcode:", ", ".join(f"{op} {n}" for op, n in by_op.most_common()))
        return
    for start, address, body in find_loops(insns, labels):
        mma = sum(opcode(i) == "HMMA" for _, i, _ in body)
        if mma < args.min_mma or len(body) > args.max_size:
            continue
        outer = collections.Counter(c[-1] for _, _, c in body if c)
        top = ", ".join(f"{f}:{ln} x{n}" for (f, ln), n in outer.most_common(3))
        print(f"loop {start:#x}..{address:#x}: {len(body)} instructions, {mma} HMMA; outermost lines {top}")


if __name__ == "__main__":
    main()

"""benchmarks/cuda/sass_loops.py reads nvdisasm's text: its parser and loop finder on a hand-written listing
(no CUDA tools needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "cuda"))
import sass_loops  # noqa: E402

LISTING = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "/src/paged_cuda.cu", line 2207 inlined at "/src/paged_cuda.cu", line 2479
	//## File "/src/paged_cuda.cu", line 2479
        /*0010*/                   HMMA.16816.F32 R80, R56, R80, RZ ;
        /*0020*/                   HMMA.16816.F32 R80, R60, R82, R80 ;
	//## File "/src/paged_cuda.cu", line 2092
        /*0030*/                   LOP3.LUT R80, R74, 0xf000f, R163, 0xea, !PT ;
        /*0040*/              @!P2 BRA `(.L_x_1) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   EXIT ;
"""


def test_parse_reads_addresses_labels_and_inline_chains():
    insns, labels = sass_loops.parse(LISTING.splitlines())
    assert [a for a, _, _ in insns] == [0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    assert labels == {"L_x_1": 0x10, "L_x_2": 0x60}
    assert insns[1][2] == [("paged_cuda.cu", 2207), ("paged_cuda.cu", 2479)]  # innermost first
    assert insns[3][2] == [("paged_cuda.cu", 2092)]
    assert sass_loops.opcode(insns[4][1]) == "BRA" and sass_loops.opcode(insns[1][1]) == "HMMA"


def test_only_backward_branches_are_loops():
    insns, labels = sass_loops.parse(LISTING.splitlines())
    loops = sass_loops.find_loops(insns, labels)
    assert [(start, end) for start, end, _ in loops] == [(0x10, 0x40)]  # the forward BRA to .L_x_2 is not one
    body = loops[0][2]
    assert len(body) == 4
    assert sum(sass_loops.opcode(i) == "HMMA" for _, i, _ in body) == 2

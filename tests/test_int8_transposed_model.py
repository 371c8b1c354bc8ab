"""benchmarks/cuda/int8_transposed_model.py: the lane-level numpy model of the transposed INT8 attention step (Note
[Paged CUDA v3 transposed INT8]) matches float attention, and fails when one of its index maps is changed (so the
model can tell a wrong map; the CUDA code itself is tested on a GPU by tests/test_cuda_paged.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda" / "int8_transposed_model.py"


def _run(source):
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)


def test_model_matches_float_attention():
    r = _run(MODEL.read_text())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok"), r.stdout


@pytest.mark.parametrize("old,new", [
    ("prmt(p_, q_, 0x5140)", "prmt(p_, q_, 0x4051)"),  # V: keys c and c + 4 swapped in a pair
    ("kappa = lambda g: (g >> 1) + 4 * (g & 1)", "kappa = lambda g: g"),  # S^T's rows in key order
    ("8 * g + mt + 4 * (e >> 1)]", "8 * g + 2 * mt + (e >> 1)]"),  # MergeWindowT's dim map
], ids=["v_pairs", "kappa", "merge_dims"])
def test_model_fails_on_a_wrong_map(old, new):
    src = MODEL.read_text()
    assert src.count(old) == 1, old
    r = _run(src.replace(old, new))
    assert r.returncode != 0 and "mismatch" in r.stderr, (r.stdout, r.stderr)

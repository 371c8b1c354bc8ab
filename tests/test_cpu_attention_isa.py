"""CPU attention kernels per instruction set (Note [CPU attention ISA dispatch]) and the paged kernel's
in-register block path (Note [PagedCacheAttention in registers]).

The library carries each attention task three times (AVX-512, AVX2 + FMA + F16C, baseline x86-64) and
runs the best the CPU has; ORTKV_CPU_ISA forces a narrower one. The process decides once, so the forced
copies run the attention test files in a child pytest with the variable set; a bad value is refused
with E_INPUT in a child process too. The paged cases sit where the gathered blocks have their edges:
blocks that end at a format change, page sizes that do not divide the 64-key block, lengths that are
not multiples of 16 (the scalar tail of the scores), F16 / BF16 rows read in place next to blocks of
decoded rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import cpu_isas
from ortkv.reference.codecs import PageFormat
from test_paged_ops import ALL, _attn_case

HERE = os.path.dirname(os.path.abspath(__file__))


def _child_env(isa: str | None) -> dict:
    env = dict(os.environ)
    env.pop("ORTKV_CPU_ISA", None)
    if isa is not None:
        env["ORTKV_CPU_ISA"] = isa
    return env


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 Linux only")
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_attention_suites_pass_on_each_forced_isa(isa):
    """The dense and paged attention tests (numpy references, NaN-poisoned tails, every format, head
    sizes 8-256, split-K boundaries) pass with each copy of the kernels forced."""
    if isa not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} copy")
    if isa == cpu_isas()[-1]:
        pytest.skip(f"{isa} is this CPU's best: the suites themselves run it, unforced")
    files = ["test_cache_attention.py", "test_sbnh.py", "test_paged_ops.py", __file__]
    cmd = [sys.executable, "-m", "pytest", *[os.path.join(HERE, f) for f in files], "-q", "-x", "-p", "no:cacheprovider",
           "-k", "not each_forced_isa and not refused"]
    r = subprocess.run(cmd, cwd=HERE, env=_child_env(isa), capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 100, tail  # the suites ran, not a handful of tests
    assert " failed" not in r.stdout and " error" not in r.stdout, tail


_CHILD = r"""
import sys
import numpy as np, onnxruntime as ort, ortkv
sys.path.insert(0, {here!r})
from conftest import cache_attention_model, ort_session
q = np.ones((1, 1, 64), np.float32)
k = np.full((1, 8, 1, 64), 0.5, np.float32)
before = k.copy()
out = np.full((1, 1, 64), 7.0, np.float32)
sess = ort_session(cache_attention_model(1, 1, 1))
io = sess.io_binding()
io.bind_cpu_input("q", q); io.bind_cpu_input("k", k); io.bind_cpu_input("v", k)
io.bind_cpu_input("start", np.array([3], np.int64))
io.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(out))
try:
    sess.run_with_iobinding(io)
except Exception as exc:
    assert np.array_equal(k, before) and (out == 7.0).all(), "the refused run wrote"
    print("REFUSED", str(exc).replace("\n", " "))
else:
    print("RAN", float(out[0, 0, 0]))
"""


def _run_child(isa: str) -> str:
    r = subprocess.run([sys.executable, "-c", _CHILD.format(here=HERE)], env=_child_env(isa), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_bad_isa_name_is_refused():
    line = _run_child("avx9000")
    assert line.startswith("REFUSED"), line
    assert "E_INPUT" in line and "CacheAttention node 'attn'" in line, line
    assert "ORTKV_CPU_ISA='avx9000' is not one of baseline, avx2, avx512; unset it" in line, line


def test_isa_the_cpu_lacks_is_refused_else_runs():
    """Forcing a copy the CPU cannot run is refused naming the CPU's best; the best itself runs."""
    sup = cpu_isas()
    line = _run_child(sup[-1])
    assert line == "RAN 0.5", line
    if len(sup) == 3:
        pytest.skip("this CPU runs every copy; the refusal of a missing one cannot be shown here")
    line = _run_child("avx512")
    assert line.startswith("REFUSED") and "asks for instructions this CPU lacks" in line, line
    assert f"its best is {sup[-1]}" in line, line


# ---- the paged kernel's gathered blocks (Note [PagedCacheAttention in registers]) ---------------------------
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("D,PS", [(64, 24), (32, 8), (128, 40)])
def test_paged_attention_block_edges_each_format(rng, fmt, D, PS):
    """Page sizes that do not divide the 64-key block (a block spans a page boundary mid-page), lengths
    not a multiple of 16, a split-K row (1,200 keys: chunks not aligned to pages), decode and a block of 3."""
    _attn_case(rng, [fmt], B=1, T=1, lengths=[1200], PS=PS, D=D, H=3, G=3)
    _attn_case(rng, [fmt], B=2, T=3, lengths=[PS * 3 + 7, 29], PS=PS, D=D, H=2, G=2)


@pytest.mark.parametrize("PS", [16, 24])
def test_paged_attention_format_runs_end_blocks(rng, PS):
    """A recency-like mix (runs of INT4 pages between F16 pages, every other format sprinkled in): each
    format change ends a block early, so blocks of many lengths under 64 occur, read in place (F16, BF16)
    and decoded (the rest) one after the other in one task."""
    fmts = [PageFormat.F16] + [PageFormat.INT4] * 5 + [PageFormat.INT8, PageFormat.F16, PageFormat.INT2_KC] + ALL
    _attn_case(rng, fmts, B=2, T=1, lengths=[700, 333], PS=PS, D=64, H=3, G=3)


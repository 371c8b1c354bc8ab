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

import numpy as np
import pytest

from conftest import cpu_isas
from ortkv.reference.codecs import PageFormat, decode_page, encode_page, layout
from test_paged_ops import ALL, _attn_case, run_attention

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



# ---- every code of every format, decoded exactly (Note [Paged CPU AVX2 decode]) ------------------------------
def _code_rows(fmt, H: int, D: int, rng) -> np.ndarray:
    """V rows 0 of H KV heads as raw payload bytes [H, row_bytes] covering every code of fmt (and, for the 16-bit
    formats, zeros of both signs, subnormals, the largest finite values, inf and NaN)."""
    if fmt in (PageFormat.F16, PageFormat.BF16):
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00,
                   0xFC00, 0x7E00, 0x0200, 0x3555]
        if fmt == PageFormat.BF16:
            special = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80,
                       0xFF80, 0x7FC0, 0x0040, 0x4049, 0x3EAA]
        halves = np.array(special + list(rng.integers(0, 1 << 16, H * D - len(special))), np.uint16)
        return halves.reshape(H, D).view(np.uint8)
    bits = {PageFormat.INT8: 8, PageFormat.FP8_E4M3: 8, PageFormat.INT4: 4, PageFormat.INT4_KC: 4,
            PageFormat.INT2: 2, PageFormat.INT2_KC: 2}[fmt]
    codes = np.arange(H * D) % (1 << bits)  # every code, in every channel position mod 2^bits
    per = 8 // bits
    packed = np.zeros(H * D // per, np.uint8)
    for k in range(per):
        packed |= (codes[k::per] << (bits * k)).astype(np.uint8)
    return packed.reshape(H, D * bits // 8)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("G", [1, 3])
def test_paged_attention_decodes_every_code_exactly(rng, fmt, G):
    """One key (start 0, one token): the softmax weight is exactly 1, so each head's output IS its KV head's
    decoded V row 0. Those rows hold every code of the format (every byte value for INT8 / FP8 E4M3, NaN codes
    included; every nibble / crumb in every position of its byte) and, for F16 / BF16, signed zeros, subnormals,
    the largest finite values, inf and NaN. Scales 0.5 / 0.25 and offsets -4 keep every value exact in float32, so
    the copy that runs (AVX2 intrinsics, SSE2, AVX-512) must give the reference decoder's floats bit for bit, in
    the decoded-block path (G = 1) and where rows are read in place (G = 3: 16-bit rows, and in the AVX-512 copy
    the codes with their scale and offset applied outside the channel loop, Note [Paged codes in registers])."""
    H, PS, D = 4, 16, 64
    lay = layout(fmt, H, PS, D)
    vals = rng.standard_normal((2, H, PS, D)).astype(np.float32)
    page = encode_page(fmt, vals)
    rows = _code_rows(fmt, H, D, rng)
    for h in range(H):  # V row 0 of head h: payload, then its scales (per-row formats)
        o = lay.v_payload + (h * PS) * lay.row_bytes
        page[o:o + lay.row_bytes] = rows[h]
        if lay.scale_row_bytes:
            s = lay.v_scales + (h * PS) * lay.scale_row_bytes
            sc = np.array([0.25] if lay.scale_row_bytes == 2 else [0.5, -4.0], np.float16)
            page[s:s + lay.scale_row_bytes] = sc.view(np.uint8)
    want = decode_page(fmt, page, H, PS, D)[1, :, 0, :]  # [H, D]
    directory = np.array([[int(fmt), 16]], np.int64)
    pool = np.zeros(16 + lay.page_bytes + 16, np.uint8)
    pool[16:16 + lay.page_bytes] = page
    table = np.array([[0, -1]], np.int32)
    q = rng.standard_normal((1, 1, H * G * D)).astype(np.float32)
    got = run_attention(q, pool, directory, table, np.array([0]), num_heads=H * G, kv_heads=H, layer=0,
                        num_layers=1, page_size=PS)
    got = got.reshape(H, G, D)
    for g in range(G):
        np.testing.assert_array_equal(got[:, g, :], want, err_msg=f"{fmt.name} query head {g} of each group")
    if fmt in (PageFormat.F16, PageFormat.BF16):
        assert np.isnan(want).any() and np.isinf(want).any()  # the specials are in the rows compared

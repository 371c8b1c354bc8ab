"""The optional page_fill input of PagedCacheUpdate / PagedCacheAttention (Note [Page fill] in
custom_ops/include/ortkv/paged.h) on the CPU, against the numpy oracle (ortkv.reference.paged) over the
same pool bytes: random fills with holes in middle pages, fill-0 entries with -1 ids, prefills crossing
entries, rows sharing a partly filled page (a fork) and writing past each other, mixed formats; absent ==
every entry full, bit for bit; every refusal names the tensor / row / entry / value and leaves the pool's
bytes untouched."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import digest, ort_session
from ortkv import errors
from ortkv.errors import CacheInputError
from ortkv.reference.codecs import KEYS_PER_CHANNEL, PageFormat, _sections, layout
from ortkv.reference.paged import paged_cache_attention_ref, paged_cache_update_ref, position_map
from test_paged_ops import (ALL, DIRECT, _bind, _logical, _model, _rand, build_pool, run_attention,
                            run_update, table_for)


# ---- runs with the optional input (test_paged_ops' runs with page_fill bound) ---------------------------------
def run_update_fill(pool, directory, table, fill, key, value, position, **kw):
    run_update(pool, directory, table, key, value, position, fill=fill, **kw)


def run_attention_fill(q, pool, directory, table, fill, start, **kw):
    return run_attention(q, pool, directory, table, start, fill=fill, **kw)


# ---- random layouts ----------------------------------------------------------------------------------------------
def random_layout(rng, n_pages_pool, B, lengths, PS, max_pages, *, shared=True, extra=0):
    """Per row: entries (page id, fill) holding at least lengths[b] positions, with partly filled middle
    entries (holes), fill-0 entries whose id is -1, and (shared) rows 1.. starting with row 0's first
    entries, the last shared one partly filled (a fork). Every page appears in at most one entry of
    one row past the shared ones, so no two rows map a position to the same (page, row) unless shared."""
    free = list(rng.permutation(n_pages_pool))
    table = np.full((B, max_pages), -1, np.int32)
    fill = np.zeros((B, max_pages), np.int32)
    base: list[tuple[int, int]] = []
    for b in range(B):
        entries: list[tuple[int, int]] = []
        held = 0
        if shared and b > 0 and base:
            k = 1 + int(rng.choice([i for i, (_, f) in enumerate(base) if f > 0]))
            entries = [(p, f) for p, f in base[:k]]
            p, f = entries[-1]
            entries[-1] = (p, int(rng.integers(1, f + 1)))  # the child sees fewer rows of the shared page
            held = sum(f for _, f in entries)
        while held < lengths[b] or len(entries) < 2:
            if rng.random() < 0.2:
                entries.append((-1, 0))
                continue
            f = int(rng.integers(1, PS + 1)) if rng.random() < 0.5 else PS
            entries.append((int(free.pop()), f))
            held += f
        if b == 0:
            base = list(entries)
        own = 0  # `extra` more positions in pages of this row alone, past what others can share
        while own < extra:
            f = int(rng.integers(1, PS + 1))
            entries.append((int(free.pop()), f))
            own += f
        assert len(entries) <= max_pages, "raise max_pages"
        for e, (p, f) in enumerate(entries):
            table[b, e], fill[b, e] = p, f
    return table, fill


def unused_rows_poisoned(pool, directory, table, fill, lengths, *, num_layers, kv_heads, page_size, head_size):
    """0xFF into every (page, row) of every layer that no row's positions [0, lengths[b]) map to."""
    used = set()
    for b, n in enumerate(lengths):
        used |= set(position_map(table[b], fill[b], page_size, n))
    for pid in {int(p) for p in table.ravel() if p >= 0}:
        fmt = PageFormat(int(directory[pid, 0]))
        lay = layout(fmt, kv_heads, page_size, head_size)
        rows = [r for r in range(page_size) if (pid, r) not in used]
        for layer in range(num_layers):
            o = int(directory[pid, 1]) + layer * lay.page_bytes
            page = pool[o:o + lay.page_bytes]
            for kv, (p, s) in enumerate(_sections(fmt, lay, page, kv_heads, page_size, head_size)):
                p[:, rows] = 0xFF
                if not (kv == 0 and fmt in KEYS_PER_CHANNEL):  # *_KC keys: scales per channel, not per row
                    s.view(np.uint16)[:, rows] = 0xFFFF


# ---- absent == all full --------------------------------------------------------------------------------------------
def test_absent_equals_every_entry_full_bit_identical(rng):
    """The same update and attention with page_fill absent and with page_fill = page_size everywhere: the
    same pool bytes and the same output bits."""
    NL, H, G, PS, D = 2, 2, 3, 4, 32
    fmts = [DIRECT[i % len(DIRECT)] for i in range(12)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[3, 7, 1, 9], [0, 5, 11, 2]], 5)
    full = np.full(table.shape, PS, np.int32)
    key, value = _rand(rng, (2, 6, H * D), "float32"), _rand(rng, (2, 6, H * D), "float32")
    kw = dict(layer=1, num_layers=NL, kv_heads=H, page_size=PS)
    a, b = pool.copy(), pool.copy()
    run_update(a, directory, table, key, value, [3, 9], **kw)
    run_update_fill(b, directory, table, full, key, value, [3, 9], **kw)
    assert digest(a) != digest(pool)
    np.testing.assert_array_equal(a, b)
    q = _rand(rng, (2, 6, H * G * D), "float32")
    akw = dict(num_heads=H * G, kv_heads=H, layer=1, num_layers=NL, page_size=PS)
    out_a = run_attention(q, a, directory, table, [3, 9], **akw)
    out_b = run_attention_fill(q, a, directory, table, full, [3, 9], **akw)
    assert out_a.tobytes() == out_b.tobytes()


# ---- PagedCacheUpdate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("T", [1, 3, 9])
def test_update_random_fills_equal_reference(seed, T):
    """Random entries (holes, fill-0 entries with -1 ids, rows sharing row 0's first entries, the last one
    partly filled), every direct format mixed, each row writing T tokens at a random position inside its
    own entries (a prefill of 9 crosses several entries): the pool equals the oracle's, byte for byte."""
    rng = np.random.default_rng(1000 + seed)
    NL, H, PS, D = 2, 2, 4, 16
    B = 3
    fmts = [DIRECT[int(i)] for i in rng.integers(0, len(DIRECT), 40)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    lengths = [int(rng.integers(2, 14)) for _ in range(B)]
    table, fill = random_layout(rng, 40, B, lengths, PS, 24, extra=T)
    # each row writes only where no other row's positions land: past its last shared (page, row)
    maps = [position_map(table[b], fill[b], PS, int(fill[b].sum())) for b in range(B)]
    position = []
    for b in range(B):
        others = set().union(*(set(maps[o]) for o in range(B) if o != b))
        lo = 1 + max([i for i, pr in enumerate(maps[b]) if pr in others], default=-1)
        assert lo <= len(maps[b]) - T, "layout too small"
        position.append(int(rng.integers(lo, len(maps[b]) - T + 1)))
    written = [maps[b][p] for b in range(B) for p in range(position[b], position[b] + T)]
    assert len(set(written)) == len(written)
    key, value = _rand(rng, (B, T, H * D), "float32"), _rand(rng, (B, T, H * D), "float32")
    kw = dict(layer=1, num_layers=NL, page_size=PS)
    want = paged_cache_update_ref(pool, directory, table, key, value, position, kv_num_heads=H, page_fill=fill, **kw)
    assert digest(want) != digest(pool)
    run_update_fill(pool, directory, table, fill, key, value, position, kv_heads=H, **kw)
    np.testing.assert_array_equal(pool, want)


def test_update_fork_child_and_parent_write_past_each_other(rng):
    """A fork: rows 0 and 1 share page 4 with 3 rows; row 0 (the owner at the high-water mark) appends row 3
    of page 4, row 1 writes its next token into page 6 (a new entry); the shared rows stay as they were."""
    NL, H, PS, D = 1, 2, 4, 16
    pool, directory = build_pool(rng, [PageFormat.F16] * 8, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[2, 4], [2, 4, 6]], 4)
    fill = np.array([[4, 4, 0, 0], [4, 3, 1, 0]], np.int32)
    key, value = _rand(rng, (2, 1, H * D), "float32"), _rand(rng, (2, 1, H * D), "float32")
    kw = dict(layer=0, num_layers=NL, page_size=PS)
    want = paged_cache_update_ref(pool, directory, table, key, value, [7, 7], kv_num_heads=H, page_fill=fill, **kw)
    run_update_fill(pool, directory, table, fill, key, value, [7, 7], kv_heads=H, **kw)
    np.testing.assert_array_equal(pool, want)
    assert position_map(table[0], fill[0], PS, 8)[7] == (4, 3)
    assert position_map(table[1], fill[1], PS, 8)[7] == (6, 0)
    # both rows then read their own 8 positions: the shared 7 and their own last one
    q = _rand(rng, (2, 1, 2 * H * D), "float32")
    akw = dict(num_heads=2 * H, kv_heads=H, layer=0, num_layers=NL, page_size=PS)
    got = run_attention_fill(q, pool, directory, table, fill, [7, 7], **akw)
    ref = paged_cache_attention_ref(q, pool, directory, table, [7, 7], num_heads=2 * H, kv_num_heads=H, page_fill=fill,
                                    **kw)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    assert not np.allclose(got[0], got[1])


# ---- PagedCacheAttention ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [PageFormat.INT4_KC, PageFormat.INT2_KC], ids=lambda f: f.name)
@pytest.mark.parametrize("G", [3, 4])
def test_attention_kc_pages_of_one_row_each(rng, fmt, G):
    """Note [Paged _KC keys in registers]: a block of _KC keys holds the channel scales of at most 32 pages, so
    entries of one row each (page_fill 1) end a 64-key block at 32 keys; 100 such entries, then full ones; G = 3
    reads the codes in place, G = 4 decodes them."""
    NL, H, PS, D = 2, 2, 4, 64
    n_one, n_full = 100, 5
    pool, directory = build_pool(rng, [fmt] * (n_one + n_full), num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    ids = [int(i) for i in rng.permutation(n_one + n_full)]
    table = table_for([ids], n_one + n_full)
    fill = np.array([[1] * n_one + [PS] * n_full], np.int32)
    L = n_one + PS * n_full
    q = _rand(rng, (1, 1, H * G * D), "float32")
    kw = dict(layer=1, num_layers=NL, page_size=PS)
    got = run_attention_fill(q, pool, directory, table, fill, [L - 1], num_heads=H * G, kv_heads=H, **kw)
    want = paged_cache_attention_ref(q, pool, directory, table, [L - 1], num_heads=H * G, kv_num_heads=H,
                                     page_fill=fill, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _attn_fill_case(rng, formats, *, B, T, NL=2, H=2, G=3, PS=8, D=32, layer=1, dtype="float32", max_len=60):
    n_pages = 80
    fmts = [formats[int(i)] for i in rng.integers(0, len(formats), n_pages)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    lengths = [int(rng.integers(T, max_len)) for _ in range(B)]
    table, fill = random_layout(rng, n_pages, B, lengths, PS, 40)
    start = np.array(lengths) - T
    clean = pool.copy()
    unused_rows_poisoned(pool, directory, table, fill, lengths, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    q = _rand(rng, (B, T, H * G * D), dtype)
    got = run_attention_fill(q, pool, directory, table, fill, start, num_heads=H * G, kv_heads=H, layer=layer,
                             num_layers=NL, page_size=PS, dtype=dtype)
    want = paged_cache_attention_ref(q.view(np.uint16) if dtype == "bfloat16" else q, clean, directory, table, start,
                                     num_heads=H * G, kv_num_heads=H, layer=layer, num_layers=NL, page_size=PS,
                                     logical=_logical(dtype), page_fill=fill)
    got = got.astype(np.float32)
    assert np.isfinite(got).all(), "a row outside the fills (poisoned) was read"
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("T", [1, 4])
def test_attention_random_fills_every_format_equal_reference(seed, T):
    """All eight formats mixed, random fills (holes, fill-0 / -1 entries, shared partly filled pages), rows
    outside every fill poisoned: equals the oracle and never reads a poisoned row."""
    _attn_fill_case(np.random.default_rng(2000 + seed), ALL, B=3, T=T)


@pytest.mark.parametrize("D", [16, 64, 20])
def test_attention_fills_head_sizes(rng, D):
    """The register path (64), the decode-into-buffer path (16) and the plain loops (20)."""
    _attn_fill_case(rng, ALL if D % 16 == 0 else [PageFormat.F16, PageFormat.INT8], B=2, T=3, D=D, PS=4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_fills_logical_types(rng, dtype):
    _attn_fill_case(rng, [PageFormat.F16, PageFormat.BF16, PageFormat.INT4], B=2, T=2, dtype=dtype)


def test_attention_fills_split_k(rng):
    """One long row (split-K tasks, blocks of 64 keys gathered over many partly filled entries)."""
    NL, H, G, PS, D = 1, 2, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8] * 80, num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    fill = rng.integers(0, PS + 1, (1, 160)).astype(np.int32)
    table = rng.permutation(160).astype(np.int32)[None, :].copy()
    table[fill == 0] = -1
    n = int(fill.sum())
    q = _rand(rng, (1, 1, H * G * D), "float32")
    akw = dict(layer=0, num_layers=NL, page_size=PS)
    got = run_attention_fill(q, pool, directory, table, fill, [n - 1], num_heads=H * G, kv_heads=H, **akw)
    want = paged_cache_attention_ref(q, pool, directory, table, [n - 1], num_heads=H * G, kv_num_heads=H,
                                     page_fill=fill, **akw)
    assert n > 1000
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---- refusals: message and untouched bytes ---------------------------------------------------------------------------
@pytest.fixture
def case(rng):
    NL, H, PS, D = 2, 2, 4, 16
    fmts = [PageFormat.F16, PageFormat.INT8, PageFormat.INT4_KC, PageFormat.F16, PageFormat.F16, PageFormat.F16]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[0, -1, 1], [4, 3, 5]], 3)
    fill = np.array([[2, 0, 4], [4, 1, 3]], np.int32)   # row 0 holds 6 positions, row 1 holds 8
    key, value = _rand(rng, (2, 2, H * D), "float32"), _rand(rng, (2, 2, H * D), "float32")
    return dict(pool=pool, directory=directory, table=table, fill=fill, key=key, value=value,
                kw=dict(layer=1, num_layers=NL, kv_heads=H, page_size=PS), H=H, D=D)


def _upd_refused(c, position, *, fill=None, table=None, directory=None, exc=CacheInputError, fragments=(),
                 fill_type=TP.INT32):
    before = digest(c["pool"])
    with pytest.raises(exc) as info:
        run_update_fill(c["pool"], c["directory"] if directory is None else directory,
                        c["table"] if table is None else table, c["fill"] if fill is None else fill, c["key"],
                        c["value"], position, fill_type=fill_type, **c["kw"])
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert digest(c["pool"]) == before, "a refused call changed the pool"


def test_fill_zero_entry_with_minus_one_is_skipped(case):
    """Row 0's entry 1 is (-1, fill 0): positions 1..2 go to page 0 row 1 and page 1 row 0, no error."""
    pool = case["pool"]
    want = paged_cache_update_ref(pool, case["directory"], case["table"], case["key"], case["value"], [1, 0],
                                  layer=1, num_layers=2, kv_num_heads=case["H"], page_size=4, page_fill=case["fill"])
    run_update_fill(pool, case["directory"], case["table"], case["fill"], case["key"], case["value"], [1, 0],
                    **case["kw"])
    np.testing.assert_array_equal(pool, want)


@pytest.mark.parametrize("bad", [-1, 5, 1 << 30])
def test_refuses_fill_outside_page_size(case, bad):
    fill = case["fill"].copy()
    fill[1, 2] = bad
    _upd_refused(case, [0, 0], fill=fill, fragments=[f"page_fill 'page_fill' row 1 entry 2 is {bad}",
                                                      "outside [0, page_size=4]", "Nothing was written"])


def test_refuses_fill_shape_and_type(case):
    _upd_refused(case, [0, 0], fill=case["fill"][:, :2].copy(),
                 fragments=["page_fill 'page_fill' must be int32 [batch=2, max_pages=3]", "[2, 2]"])
    _upd_refused(case, [0, 0], fill=case["fill"][:1].copy(),
                 fragments=["page_fill 'page_fill' must be int32 [batch=2, max_pages=3]", "[1, 3]"])


def test_refuses_position_past_total_fill(case):
    # row 0 holds 6 positions: 5 + 2 tokens = 7 > 6
    _upd_refused(case, [5, 0], exc=errors.CapacityError,
                 fragments=["row 0: position 5 + tokens 2 = 7 exceeds the row's total fill of 6 tokens "
                            "('page_fill' over 'page_table')", "Nothing was written"])


def test_refuses_missing_page_under_a_nonzero_fill(case):
    t = case["table"].copy()
    t[1, 1] = -1   # fill 1: position 4 of row 1 lives there
    _upd_refused(case, [0, 3], table=t, fragments=["row 1 needs page 1 of its page table 'page_table' (tokens [4, 5)",
                                                    "the entry is -1"])


def test_refuses_two_rows_writing_one_row_through_fills(case):
    """Row 1's entry 2 is page 1 (row 0's last page too): both rows map a position to page 1 row 0."""
    t, f = case["table"].copy(), case["fill"].copy()
    t[1, 2] = 1
    _upd_refused(case, [2, 5], table=t, fill=f, fragments=["rows 0 and 1 both write row 0 of page 1"])


def test_refuses_keys_into_kc_page_through_fill(case):
    t = case["table"].copy()
    t[0, 2] = 2   # INT4_KC
    _upd_refused(case, [2, 0], table=t, fragments=["a INT4_KC page", "key rows cannot be written alone"])


def test_attention_refusals_with_fill(case):
    c = case
    q = _rand(np.random.default_rng(0), (2, 1, 2 * c["H"] * c["D"]), "float32")
    akw = dict(num_heads=2 * c["H"], kv_heads=c["H"], layer=1, num_layers=2, page_size=4)
    before = digest(c["pool"])
    with pytest.raises(errors.CapacityError, match=r"row 0: start 6 \+ tokens 1 = 7 exceeds the row's total fill of 6"):
        run_attention_fill(q, c["pool"], c["directory"], c["table"], c["fill"], [6, 0], **akw)
    fill = c["fill"].copy()
    fill[0, 1] = -3
    with pytest.raises(CacheInputError, match=r"page_fill 'page_fill' row 0 entry 1 is -3, outside \[0, page_size=4\]"):
        run_attention_fill(q, c["pool"], c["directory"], c["table"], fill, [0, 0], **akw)
    t = c["table"].copy()
    t[1, 2] = -1
    with pytest.raises(CacheInputError, match=r"row 1 needs page 2 of its page table 'page_table' \(tokens \[5, 8\)"):
        run_attention_fill(q, c["pool"], c["directory"], t, c["fill"], [0, 6], **akw)
    assert digest(c["pool"]) == before


def test_reference_position_map():
    """The oracle's mapping itself: skipped fill-0 entries, partial entries, too few positions refused."""
    table = np.array([7, -1, 3, 9], np.int32)
    fill = np.array([2, 0, 1, 4], np.int32)
    assert position_map(table, fill, 4, 7) == [(7, 0), (7, 1), (3, 0), (9, 0), (9, 1), (9, 2), (9, 3)]
    assert position_map(table, None, 4, 5) == [(7, 0), (7, 1), (7, 2), (7, 3), (-1, 0)]
    with pytest.raises(CacheInputError, match="holds 7 positions"):
        position_map(table, fill, 4, 8)
    with pytest.raises(CacheInputError, match="entry 1 is 5"):
        position_map(table, np.array([2, 5, 0, 0]), 4, 1)


# ---- the graph layer: contract, shape rules, checker, planner ------------------------------------------------------
def _checked_fill(fill_type=TP.INT32, fill_shape=("B", 3), names=None, attention=False):
    from ortkv.graph import check, mark_mutable, set_alias_of

    vi = helper.make_tensor_value_info
    if attention:
        ins = names or ["query", "pool", "directory", "page_table", "start", "page_fill"]
        node = helper.make_node("PagedCacheAttention", ins, ["out"], name="attn", domain="ortkv", num_heads=4,
                                kv_num_heads=2, layer=0, num_layers=2, page_size=4)
        inputs = [vi("query", TP.FLOAT, ["B", 1, 64]), vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                  vi("page_table", TP.INT32, ["B", 3]), vi("start", TP.INT64, ["B"])]
        outputs = [vi("out", TP.FLOAT, ["B", 1, 64])]
    else:
        ins = names or ["pool", "directory", "page_table", "key", "value", "position", "page_fill"]
        node = helper.make_node("PagedCacheUpdate", ins, ["pool_out"], name="upd", domain="ortkv", layer=0,
                                num_layers=2, kv_num_heads=2, page_size=4)
        inputs = [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]), vi("page_table", TP.INT32, ["B", 3]),
                  vi("key", TP.FLOAT, ["B", 1, 32]), vi("value", TP.FLOAT, ["B", 1, 32]), vi("position", TP.INT64, ["B"])]
        outputs = [vi("pool_out", TP.UINT8, ["P"])]
    if "page_fill" in ins:
        inputs.append(vi("page_fill", fill_type, list(fill_shape)))
    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                          ir_version=10)
    if not attention:
        mark_mutable(m, "pool")
        set_alias_of(m, "pool_out", "pool")
    report = check(m, plan=False)
    return "\n".join(str(f) for f in report.errors)


@pytest.mark.parametrize("attention", [False, True])
def test_checker_describes_optional_page_fill(attention):
    """The contract's optional port: present, absent or empty-named are accepted; a wrong type or a shape
    other than the page table's is an op-input error naming the tensor; a required port left empty is not."""
    assert _checked_fill(attention=attention) == ""
    base = (["query", "pool", "directory", "page_table", "start"] if attention else
            ["pool", "directory", "page_table", "key", "value", "position"])
    assert _checked_fill(names=base, attention=attention) == ""
    assert _checked_fill(names=base + [""], attention=attention) == ""
    err = _checked_fill(fill_type=TP.INT64, attention=attention)
    assert "'page_fill' is int64" in err and "page_fill must be int32 [batch, max_pages]" in err
    err = _checked_fill(fill_shape=("B", 4), attention=attention)
    assert "page_fill" in err and "page table" in err, err
    err = _checked_fill(names=base + ["page_fill", "page_fill"], attention=attention)
    assert "takes 5 to 6" in err or "takes 6 to 7" in err, err
    empty = list(base)
    empty[2] = ""
    assert "is empty" in _checked_fill(names=empty + ["page_fill"], attention=attention)


def test_planner_counts_the_fill_prefix():
    from ortkv.graph.op_rules import paged_cache_attention_workspace
    from ortkv.graph.shapes import ShapesContext  # noqa: F401 - the context the planner passes

    class Ctx:
        def __init__(self, types):
            self.types = types

        def type_of(self, name):
            return self.types[name]

    from ortkv.graph.dims import ValueType

    node = helper.make_node("PagedCacheAttention", ["q", "pool", "d", "t", "s", "f"], ["o"], domain="ortkv",
                            num_heads=4, kv_num_heads=2, layer=0, num_layers=1, page_size=4)
    types = {"q": ValueType(TP.FLOAT, (3, 1, 64)), "f": ValueType(TP.INT32, (3, 10))}
    with_fill = paged_cache_attention_workspace(Ctx(types), node, 2)
    del node.input[5]
    assert with_fill - paged_cache_attention_workspace(Ctx(types), node, 2) == 3 * 11 * 8


def test_an_empty_named_page_fill_port_is_absent(rng):
    """A node that names the optional port "" runs exactly as one that omits it (every entry full)."""
    NL, H, PS, D = 1, 2, 4, 16
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8, PageFormat.F16], num_layers=NL, kv_heads=H,
                                 page_size=PS, head_size=D)
    table = table_for([[2, 0, 1]], 3)
    key, value = _rand(rng, (1, 3, H * D), "float32"), _rand(rng, (1, 3, H * D), "float32")
    node = helper.make_node("PagedCacheUpdate", ["pool", "directory", "page_table", "key", "value", "position", ""],
                            ["pool_out"], name="upd", domain="ortkv", layer=0, num_layers=NL, kv_num_heads=H,
                            page_size=PS)
    vi = helper.make_tensor_value_info
    sess = ort_session(_model(node, [vi("pool", TP.UINT8, ["P"]), vi("directory", TP.INT64, ["N", 2]),
                                     vi("page_table", TP.INT32, ["B", "M"]), vi("key", TP.FLOAT, ["B", "T", "W"]),
                                     vi("value", TP.FLOAT, ["B", "T", "W"]), vi("position", TP.INT64, ["B"])],
                              [vi("pool_out", TP.UINT8, ["P"])]))
    want = paged_cache_update_ref(pool, directory, table, key, value, [3], layer=0, num_layers=NL, kv_num_heads=H,
                                  page_size=PS)
    before = pool.copy()
    io = sess.io_binding()
    keep = [_bind(io, "pool", pool, TP.UINT8), _bind(io, "directory", directory, TP.INT64),
            _bind(io, "page_table", table, TP.INT32), _bind(io, "key", key, TP.FLOAT), _bind(io, "value", value, TP.FLOAT),
            _bind(io, "position", np.array([3], np.int64), TP.INT64), _bind(io, "pool_out", pool, TP.UINT8, output=True)]
    sess.run_with_iobinding(io)
    del keep
    np.testing.assert_array_equal(pool, want)
    assert digest(want) != digest(before)

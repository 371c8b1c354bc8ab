"""The optional page_fill input (Note [Page fill] in custom_ops/include/ortkv/paged.h) on the CUDA
execution provider, every input in device memory: update bytes == the numpy oracle (and the CPU op),
attention == the oracle over random fills (holes, fill-0 entries with -1 ids, rows sharing a partly filled
page), absent == all full (within float rounding: the attention with page_fill takes the per-key kernel,
Note [Page fill] on CUDA in ortkv/paged_cuda.h), and the fill refusals with the pool untouched. Skipped with
a reason where there is no CUDA provider or device."""

from __future__ import annotations

import numpy as np
import pytest

from ortkv.reference.codecs import PageFormat
from ortkv.reference.paged import paged_cache_attention_ref, paged_cache_update_ref, position_map
from test_cuda_paged import ALL, DIRECT, TOL, _rand, build_pool, cuda_attention, cuda_update, table_for
from test_page_fill import random_layout, run_update_fill, unused_rows_poisoned

pytestmark = pytest.mark.cuda


def cuda_update_fill(pool, directory, table, fill, key, value, position, **kw):
    return cuda_update(pool, directory, table, key, value, position, fill=fill, **kw)


def cuda_attention_fill(q, pool, directory, table, fill, start, **kw):
    return cuda_attention(q, pool, directory, table, start, fill=fill, **kw)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("T", [1, 5])
def test_update_with_fills_equals_reference_and_cpu(seed, T):
    rng = np.random.default_rng(3000 + seed)
    NL, H, PS, D = 2, 2, 4, 64
    B = 3
    fmts = [DIRECT[int(i)] for i in rng.integers(0, len(DIRECT), 40)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    lengths = [int(rng.integers(2, 14)) for _ in range(B)]
    table, fill = random_layout(rng, 40, B, lengths, PS, 24, extra=T)
    maps = [position_map(table[b], fill[b], PS, int(fill[b].sum())) for b in range(B)]
    position = []
    for b in range(B):
        others = set().union(*(set(maps[o]) for o in range(B) if o != b))
        lo = 1 + max([i for i, pr in enumerate(maps[b]) if pr in others], default=-1)
        position.append(int(rng.integers(lo, len(maps[b]) - T + 1)))
    key, value = _rand(rng, (B, T, H * D), "float16"), _rand(rng, (B, T, H * D), "float16")
    kw = dict(layer=1, num_layers=NL, page_size=PS)
    want = paged_cache_update_ref(pool, directory, table, key, value, position, kv_num_heads=H, page_fill=fill, **kw)
    got, err = cuda_update_fill(pool, directory, table, fill, key, value, position, kv_heads=H, dtype="float16", **kw)
    assert err is None, err
    np.testing.assert_array_equal(got, want)
    cpu = pool.copy()
    run_update_fill(cpu, directory, table, fill, key, value, position, kv_heads=H, dtype="float16", **kw)
    np.testing.assert_array_equal(got, cpu)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("T", [1, 5])
def test_attention_with_fills_every_format_equals_reference(seed, T):
    rng = np.random.default_rng(4000 + seed)
    NL, H, G, PS, D = 2, 2, 3, 16, 64
    B = 3
    fmts = [ALL[int(i)] for i in rng.integers(0, len(ALL), 80)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    lengths = [int(rng.integers(T, 200)) for _ in range(B)]
    table, fill = random_layout(rng, 80, B, lengths, PS, 64)
    start = np.array(lengths) - T
    clean = pool.copy()
    unused_rows_poisoned(pool, directory, table, fill, lengths, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    q = _rand(rng, (B, T, H * G * D), "float16")
    got, after, err = cuda_attention_fill(q, pool, directory, table, fill, start, num_heads=H * G, kv_heads=H, layer=1,
                                          num_layers=NL, page_size=PS, dtype="float16")
    assert err is None, err
    assert after.tobytes() == pool.tobytes()
    want = paged_cache_attention_ref(q, clean, directory, table, start, num_heads=H * G, kv_num_heads=H, layer=1,
                                     num_layers=NL, page_size=PS, page_fill=fill)
    assert np.isfinite(got).all(), "a row outside the fills (poisoned) was read"
    np.testing.assert_allclose(got, want, rtol=TOL["float16"], atol=TOL["float16"])


def test_absent_equals_all_full_on_cuda(rng):
    """All-full fills give the absent mapping; the update's bytes are identical (same arithmetic)."""
    NL, H, G, PS, D = 1, 2, 2, 16, 64
    pool, directory = build_pool(rng, [PageFormat.F16, PageFormat.INT8] * 4, num_layers=NL, kv_heads=H, page_size=PS,
                                 head_size=D)
    table = table_for([[3, 1, 6], [0, 7, 2]], 4)
    full = np.full(table.shape, PS, np.int32)
    q = _rand(rng, (2, 3, H * G * D), "float16")
    akw = dict(num_heads=H * G, kv_heads=H, layer=0, num_layers=NL, page_size=PS, dtype="float16")
    a, _, err_a = cuda_attention(q, pool, directory, table, [30, 20], **akw)
    b, _, err_b = cuda_attention_fill(q, pool, directory, table, full, [30, 20], **akw)
    assert err_a is None and err_b is None
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)  # different kernels, same math
    key = _rand(rng, (2, 2, H * D), "float16")
    ukw = dict(layer=0, num_layers=NL, kv_heads=H, page_size=PS, dtype="float16")
    u_a, err_a = cuda_update(pool, directory, table, key, key, [30, 20], **ukw)
    u_b, err_b = cuda_update_fill(pool, directory, table, full, key, key, [30, 20], **ukw)
    assert err_a is None and err_b is None
    assert u_a.tobytes() == u_b.tobytes() and u_a.tobytes() != pool.tobytes()


def test_fill_refusals_leave_the_pool_untouched(rng):
    """Fill outside [0, page_size] and a position past the row's total fill: refused (synchronously or through
    the device error word), naming page_fill / the total, nothing written."""
    NL, H, PS, D = 1, 2, 4, 64
    pool, directory = build_pool(rng, [PageFormat.F16] * 4, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[0, 1], [2, 3]], 2)
    key = _rand(rng, (2, 1, H * D), "float16")
    kw = dict(layer=0, num_layers=NL, kv_heads=H, page_size=PS, dtype="float16")
    for fill, position, words in ((np.array([[4, 5], [4, 4]], np.int32), [0, 0], "page_fill"),
                                  (np.array([[4, 1], [4, 4]], np.int32), [5, 0], "total fill")):
        try:
            got, err = cuda_update_fill(pool, directory, table, fill, key, key, position, **kw)
        except Exception as exc:  # noqa: BLE001 - a synchronous refusal
            assert words in str(exc), str(exc)
            continue
        assert err is not None and words in str(err), err
        assert got.tobytes() == pool.tobytes()


@pytest.mark.parametrize("rows", [2, 200])
def test_fill_rows_sharing_a_page_row_refused_through_row_owners(rng, rows):
    """Note [Paged CUDA row owners] with page_fill (which always takes the claim + check + store kernels): row 1's
    last entry lists row 0's last page, partly filled, so both rows map a position to one page row. Two rows, and 200
    rows (400 tokens), each refused with the CPU op's message (the first writer's row, the page, its row) and nothing
    written; without the shared entry the bytes equal the CPU op's."""
    NL, H, PS, D = 1, 2, 4, 64
    n_pages = 3 * rows
    fmts = [(PageFormat.F16, PageFormat.INT8)[i % 2] for i in range(n_pages)]
    pool, directory = build_pool(rng, fmts, num_layers=NL, kv_heads=H, page_size=PS, head_size=D)
    table = table_for([[3 * b, 3 * b + 1, 3 * b + 2] for b in range(rows)], 3)
    fill = np.tile(np.array([[4, 2, 4]], np.int32), (rows, 1))  # 10 positions a row; position 5 is entry 1 row 1
    key = _rand(rng, (rows, 2, H * D), "float16")
    kw = dict(layer=0, num_layers=NL, kv_heads=H, page_size=PS, dtype="float16")
    position = [4] * rows  # positions 4, 5: entry 1 rows 0, 1
    got, err = cuda_update_fill(pool, directory, table, fill, key, key, position, **kw)
    assert err is None, err
    cpu = pool.copy()
    run_update_fill(cpu, directory, table, fill, key, key, position, **kw)
    assert got.tobytes() == cpu.tobytes() and got.tobytes() != pool.tobytes()
    shared = table.copy()
    shared[rows - 1, 1] = table[0, 1]  # the last row writes row 0's entry-1 page, rows 0 and 1
    with pytest.raises(Exception) as cpu_err:
        run_update_fill(pool.copy(), directory, shared, fill, key, key, position, **kw)
    want = f"rows 0 and {rows - 1} both write row 0 of page {int(table[0, 1])}"
    assert want in str(cpu_err.value), str(cpu_err.value)
    after, err = cuda_update_fill(pool, directory, shared, fill, key, key, position, **kw)
    assert err is not None and want in err and "Nothing was written" in err, err
    assert after.tobytes() == pool.tobytes()


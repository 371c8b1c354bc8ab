"""CacheUpdate (CPU kernel) against the numpy oracle, its error contract, and in-place proof."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DTYPES, cache_update_model, cached_session, digest, ort_session, random_case, run_bound
from ortkv._memory import rss_bytes
from ortkv.reference import cache_update_ref

LAYOUTS = {  # name: (cache shape, seq_axis)
    "BNSH": ((2, 3, 16, 8), -2),
    "BNSH_pos_axis": ((2, 3, 16, 8), 2),
    "BSNH": ((2, 16, 3, 8), 1),
    "rank3_BSD": ((3, 16, 24), 1),
    "rank5": ((2, 2, 3, 16, 4), 3),
}


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("vector", [False, True])
def test_matches_reference(rng, dtype, layout, n, vector):
    np_type, onnx_type = DTYPES[dtype]
    shape, axis = LAYOUTS[layout]
    cache, values, position = random_case(rng, shape, axis, n, vector, np_type)
    expected = cache_update_ref(cache, values, position, axis)
    assert not np.array_equal(cache.view(np.uint8), expected.view(np.uint8))  # the update is visible
    sess = cached_session(onnx_type, len(shape), axis, vector)
    run_bound(sess, cache, values, position, onnx_type)
    np.testing.assert_array_equal(cache.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("position", [0, 15, 16 - 4])
def test_capacity_edges(rng, position):
    cache = _rand(rng, (1, 2, 16, 4), np.float32)
    n = 16 - position if position else 16  # fill exactly to the end, or the whole cache from 0
    values = _rand(rng, (1, 2, n, 4), np.float32)
    expected = cache_update_ref(cache, values, position)
    run_bound(cached_session(1, 4, -2, False), cache, values, position, 1)
    np.testing.assert_array_equal(cache, expected)


def test_large_update_uses_all_rows(rng):
    # > 1 MiB: the kernel splits the copy over ORT's thread pool.
    cache = _rand(rng, (4, 8, 512, 64), np.float32)
    values = _rand(rng, (4, 8, 300, 64), np.float32)
    position = np.array([0, 100, 212, 7])
    expected = cache_update_ref(cache, values, position)
    run_bound(cached_session(1, 4, -2, True), cache, values, position, 1)
    np.testing.assert_array_equal(cache, expected)


# --- error contract ---------------------------------------------------------------------------
def _expect_error(sess, cache, values, position, onnx_type, *fragments):
    before = digest(cache)
    with pytest.raises(Exception) as info:
        run_bound(sess, cache, values, position, onnx_type)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    assert digest(cache) == before, "a refused update changed the cache bytes"
    return text


def test_negative_position(rng):
    cache = _rand(rng, (2, 2, 8, 4), np.float32)
    _expect_error(cached_session(1, 4, -2, True), cache, _rand(rng, (2, 2, 1, 4), np.float32), np.array([3, -1]), 1,
                  "[ortkv:E_INPUT]", "position -1 for row 1 of 'cache' is negative", "node 'cache_update'")


def test_overflow_names_both_numbers(rng):
    cache = _rand(rng, (2, 2, 8, 4), np.float32)
    # row 0 fits, row 1 does not: nothing at all may be written (row 0 included)
    _expect_error(cached_session(1, 4, -2, True), cache, _rand(rng, (2, 2, 3, 4), np.float32), np.array([0, 6]), 1,
                  "[ortkv:E_CAPACITY]", "row 1: position 6 + n 3 = 9 exceeds capacity 8 of 'cache'",
                  "capacity >= 9")


def test_values_shape_mismatch(rng):
    cache = _rand(rng, (2, 3, 8, 4), np.float32)
    _expect_error(cached_session(1, 4, -2, False), cache, _rand(rng, (2, 2, 1, 4), np.float32), 0, 1,
                  "[ortkv:E_INPUT]", "'values' has shape [2, 2, 1, 4]", "dim 1 is 2, expected 3")


def test_values_type_mismatch(rng):
    cache = _rand(rng, (1, 2, 8, 4), np.float32)
    sess = ort_session(_mixed_type_model())
    before = digest(cache)
    io = sess.io_binding()
    io.bind_input("cache", "cpu", 0, np.float32, list(cache.shape), cache.ctypes.data)
    io.bind_output("updated_cache", "cpu", 0, np.float32, list(cache.shape), cache.ctypes.data)
    io.bind_cpu_input("values", np.ones((1, 2, 1, 4), np.float16))
    io.bind_cpu_input("position", np.array(0, np.int64))
    with pytest.raises(Exception, match=r"'values' is float16 but 'cache' is float32"):
        sess.run_with_iobinding(io)
    assert digest(cache) == before


def _mixed_type_model():
    from onnx import TensorProto as TP

    m = cache_update_model(TP.FLOAT)
    m.graph.input[1].type.tensor_type.elem_type = TP.FLOAT16
    return m


def test_position_vector_length(rng):
    cache = _rand(rng, (2, 2, 8, 4), np.float32)
    _expect_error(cached_session(1, 4, -2, True), cache, _rand(rng, (2, 2, 1, 4), np.float32), np.array([0, 1, 2]), 1,
                  "'position' has 3 entries but 'cache' has batch size 2")


def test_rank_and_axis_refused(rng):
    cache = _rand(rng, (2, 8), np.float32)
    _expect_error(cached_session(1, 2, 1, False), cache, _rand(rng, (2, 1), np.float32), 0, 1,
                  "has rank 2", "needs rank >= 3")
    cache = _rand(rng, (4, 2, 8), np.float32)  # seq_axis 0 is SBNH: the values must keep axis 1 (batch 2)
    _expect_error(cached_session(1, 3, 0, False), cache, _rand(rng, (1, 3, 8), np.float32), 0, 1,
                  "dim 1 is 3, expected 2")
    _expect_error(cached_session(1, 3, -3, False), cache, _rand(rng, (1, 2, 8), np.float32), 0, 1,
                  "seq_axis=-3 resolves to axis 0", "axis 0 is the batch")


def test_unbound_output_refused_not_copied(rng):
    """Plain run(): ORT gives the op a fresh output buffer; the kernel refuses instead of copying."""
    cache = _rand(rng, (1, 2, 8, 4), np.float32)
    before = digest(cache)
    sess = cached_session(1, 4, -2, False)
    with pytest.raises(Exception) as info:
        sess.run(None, {"cache": cache, "values": _rand(rng, (1, 2, 1, 4), np.float32), "position": np.array(0)})
    text = str(info.value)
    assert "[ortkv:E_ALIAS]" in text and "is not the storage of input 'cache'" in text
    assert f"0x{cache.ctypes.data:x}" in text and "IOBinding" in text
    assert digest(cache) == before


# --- in place, repeatedly ---------------------------------------------------------------------
def test_100_runs_same_pointer_and_flat_rss(rng):
    cache = np.zeros((1, 8, 2048, 512), np.float32)  # 32 MiB: a copy per run would show in RSS
    cache.fill(0)
    sess = cached_session(1, 4, -2, False)
    values = _rand(rng, (1, 8, 1, 512), np.float32)
    run_bound(sess, cache, values, 0, 1)  # warm-up (ORT allocates its own small buffers once)
    rss0 = rss_bytes()
    for step in range(100):
        run_bound(sess, cache, values * step, step, 1)
    growth = rss_bytes() - rss0
    assert growth < 4 << 20, f"RSS grew by {growth} bytes over 100 in-place runs of a 32 MiB cache"
    # every run landed in the caller's array (not in a buffer ORT handed back), and nothing beyond
    steps = np.arange(100, dtype=np.float32)[None, :, None]
    np.testing.assert_array_equal(cache[0, :, :100], values[0] * steps)
    assert not cache[0, :, 100:].any()


# --- hypothesis: the error contract on random shapes and positions ----------------------------
@st.composite
def _cases(draw):
    rank = draw(st.integers(3, 5))
    axis = draw(st.integers(1, rank - 1))
    shape = [draw(st.integers(1, 4)) for _ in range(rank)]
    shape[axis] = draw(st.integers(1, 12))
    n = draw(st.integers(1, shape[axis] + 2))
    vector = draw(st.booleans())
    k = shape[0] if vector else 1
    positions = draw(st.lists(st.integers(-3, shape[axis] + 2), min_size=k, max_size=k))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    return rank, axis, shape, n, vector, positions, dtype


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_error_contract_random(case):
    rank, axis, shape, n, vector, positions, dtype = case
    np_type, onnx_type = DTYPES[dtype]
    rng = np.random.default_rng(len(shape) * 31 + n)
    cache = _rand(rng, shape, np_type)
    vshape = list(shape)
    vshape[axis] = n
    values = _rand(rng, vshape, np_type)
    position = np.array(positions, np.int64) if vector else np.int64(positions[0])
    try:
        expected = cache_update_ref(cache, values, position, axis)
    except ValueError:
        expected = None
    sess = cached_session(onnx_type, rank, axis, vector)
    before = digest(cache)
    if expected is None:
        with pytest.raises(Exception, match=r"\[ortkv:E_(CAPACITY|INPUT)\]"):
            run_bound(sess, cache, values, position, onnx_type)
        assert digest(cache) == before
    else:
        run_bound(sess, cache, values, position, onnx_type)
        np.testing.assert_array_equal(cache.view(np.uint8), expected.view(np.uint8))


# --- misuse (issue 9) -------------------------------------------------------------------------
def test_position_at_int64_max_reports_the_true_sum(rng):
    """position + n overflowed int64 in the message (printed negative; CapacityError.requested None)."""
    cache = _rand(rng, (1, 2, 8, 4), np.float32)
    _expect_error(cached_session(1, 4, -2, False), cache, _rand(rng, (1, 2, 1, 4), np.float32), 2**63 - 1, 1,
                  "[ortkv:E_CAPACITY]", "position 9223372036854775807 + n 1 = 9223372036854775808 exceeds capacity 8",
                  "capacity >= 9223372036854775808")


def test_zero_element_cache_refused(rng):
    """A cache with a 0 dim used to pass (or end in a bogus alias error in the session)."""
    cache = np.zeros((1, 0, 8, 4), np.float32)
    _expect_error(cached_session(1, 4, -2, False), cache, np.zeros((1, 0, 1, 4), np.float32), 0, 1,
                  "[ortkv:E_INPUT]", "'cache' has shape [1, 0, 8, 4] with no elements (dim 1 is 0)")


def _run_raw(sess, cache, values, position):
    """run_bound with raw pointers: `values` may be any (pointer, shape) inside another buffer."""
    io = sess.io_binding()
    io.bind_input("cache", "cpu", 0, 1, list(cache.shape), cache.ctypes.data)
    io.bind_output("updated_cache", "cpu", 0, 1, list(cache.shape), cache.ctypes.data)
    io.bind_input("values", "cpu", 0, 1, list(values.shape), values.ctypes.data)
    io.bind_cpu_input("position", np.asarray(position, dtype=np.int64))
    sess.run_with_iobinding(io)


@pytest.mark.parametrize("where", ["inside", "head", "tail"])
def test_values_overlapping_cache_refused(where):
    """values sharing bytes with the cache: memcpy with overlapping arguments (undefined, and run to run
    different on the thread pool). Refused before any write, whatever the overlap."""
    buf = np.arange(3 * 64, dtype=np.float32)
    cache = buf[64:128].reshape(1, 2, 8, 4)
    if where == "inside":
        values = cache.reshape(-1)[8:16].reshape(1, 2, 1, 4)
    elif where == "head":  # the last value element is the cache's first
        values = buf[64 - 7:64 + 1].reshape(1, 2, 1, 4)
    else:  # the first value element is the cache's last
        values = buf[127:135].reshape(1, 2, 1, 4)
    assert np.shares_memory(values, cache)
    before = digest(buf)
    with pytest.raises(Exception) as info:
        _run_raw(cached_session(1, 4, -2, False), cache, values, 3)
    text = str(info.value)
    assert "[ortkv:E_INPUT]" in text and "input 'values' [0x" in text and "overlaps the cache 'cache'" in text
    assert "32 and 256 bytes" in text and "Nothing was written" in text
    assert digest(buf) == before


def test_values_adjacent_to_cache_accepted():
    buf = np.arange(3 * 64, dtype=np.float32)
    cache = buf[64:128].reshape(1, 2, 8, 4)
    for values in (buf[56:64].reshape(1, 2, 1, 4), buf[128:136].reshape(1, 2, 1, 4)):
        expected = cache_update_ref(cache, values.copy(), 7)
        _run_raw(cached_session(1, 4, -2, False), cache, values, 7)
        np.testing.assert_array_equal(cache, expected)


def test_large_overlapping_update_refused():
    """The multithreaded path (> 1 MiB): refused the same way, cache unchanged."""
    cache = np.zeros((4, 8, 512, 64), np.float32)
    cache[:] = np.arange(512, dtype=np.float32)[:, None]
    values = cache.reshape(-1)[: 4 * 8 * 300 * 64].reshape(4, 8, 300, 64)
    before = digest(cache)
    with pytest.raises(Exception, match=r"\[ortkv:E_INPUT\].*overlaps the cache 'cache'"):
        _run_raw(cached_session(1, 4, -2, True), cache, values, np.array([0, 100, 212, 7]))
    assert digest(cache) == before

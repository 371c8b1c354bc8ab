"""Both graph topologies of CacheUpdate with plain ONNX Runtime (no ortkv Python wrapper)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from conftest import cache_update_model, digest, ort_session
from ortkv.reference import cache_update_ref


def test_graph_output_bound_through_iobinding_one_ortvalue(rng):
    cache = rng.standard_normal((2, 3, 10, 4)).astype(np.float32)
    values = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    expected = cache_update_ref(cache, values, np.array([1, 8]))
    sess = ort_session(cache_update_model(vector_position=True))
    v = ort.OrtValue.ortvalue_from_numpy(cache)  # wraps the array, no copy
    io = sess.io_binding()
    io.bind_ortvalue_input("cache", v)
    io.bind_ortvalue_output("updated_cache", v)
    io.bind_cpu_input("values", values)
    io.bind_cpu_input("position", np.array([1, 8], np.int64))
    assert not np.array_equal(cache, expected)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(cache, expected)  # the caller's array holds the update: in place


def test_output_bound_to_another_buffer_is_refused(rng):
    cache = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    other = np.zeros_like(cache)
    before, before_other = digest(cache), digest(other)
    sess = ort_session(cache_update_model())
    io = sess.io_binding()
    io.bind_cpu_input("cache", cache)
    io.bind_output("updated_cache", "cpu", 0, np.float32, list(cache.shape), other.ctypes.data)
    io.bind_cpu_input("values", np.ones((1, 2, 1, 4), np.float32))
    io.bind_cpu_input("position", np.array(0, np.int64))
    with pytest.raises(RuntimeError, match=r"E_ALIAS.*is not the storage of input 'cache'"):
        sess.run_with_iobinding(io)
    assert digest(cache) == before and digest(other) == before_other


def test_updated_cache_consumed_inside_graph(rng):
    """updated_cache is not a graph output: GetAliasMap makes ORT hand the kernel the input buffer,
    so plain run() updates the caller's array in place and the consumer sees the new data."""
    cache = rng.standard_normal((2, 2, 8, 4)).astype(np.float32)
    values = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    expected = cache_update_ref(cache, values, 4)
    sess = ort_session(cache_update_model(consumer=True))
    (total,) = sess.run(None, {"cache": cache, "values": values, "position": np.array(4, np.int64)})
    np.testing.assert_array_equal(cache, expected)  # written in place into the feed
    np.testing.assert_allclose(total, expected.sum(dtype=np.float64), rtol=1e-5)


def test_consumer_topology_with_ortvalue_feed(rng):
    cache = rng.standard_normal((1, 4, 8, 2)).astype(np.float32)
    values = rng.standard_normal((1, 4, 1, 2)).astype(np.float32)
    expected = cache_update_ref(cache, values, 7)
    sess = ort_session(cache_update_model(consumer=True))
    io = sess.io_binding()
    io.bind_ortvalue_input("cache", ort.OrtValue.ortvalue_from_numpy(cache))
    io.bind_cpu_input("values", values)
    io.bind_cpu_input("position", np.array(7, np.int64))
    io.bind_output("total", "cpu")
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(cache, expected)

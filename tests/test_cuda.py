"""CacheUpdate on the CUDA execution provider (skipped with a reason where there is no GPU).
Buffers are torch CUDA tensors; the oracle is the numpy reference on copies brought to the host."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import ortkv
from conftest import DTYPES, cache_update_model, ort_session, random_case
from ortkv.reference import cache_update_ref

pytestmark = pytest.mark.cuda

LAYOUTS = {"BNSH": ((2, 3, 16, 8), -2), "BSNH": ((2, 16, 3, 8), 1), "rank3": ((3, 16, 24), 1),
           "odd_token": ((2, 2, 9, 3), -2),  # 3-element tokens: the kernel's narrowest vector path
           "rows_40": ((40, 6, 2, 4), 1), "rows_300": ((300, 6, 2, 4), 1)}  # parameter blocks 64, 256 + chunks


def _torch():
    import torch

    return torch


def _to_torch(arr):
    torch = _torch()
    raw = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8).copy())
    tdtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
              np.dtype(ml_dtypes.bfloat16): torch.bfloat16}[arr.dtype]
    return raw.view(tdtype).reshape(arr.shape).cuda()


def _bytes(t):
    torch = _torch()
    torch.cuda.synchronize()
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _cuda_session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # CacheUpdate must run on CUDA
    so.register_custom_ops_library(ortkv.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])


def _run(sess, cache_t, values_t, position, onnx_type):
    io = sess.io_binding()
    io.bind_input("cache", "cuda", 0, onnx_type, list(cache_t.shape), cache_t.data_ptr())
    io.bind_output("updated_cache", "cuda", 0, onnx_type, list(cache_t.shape), cache_t.data_ptr())
    io.bind_input("values", "cuda", 0, onnx_type, list(values_t.shape), values_t.data_ptr())
    io.bind_cpu_input("position", np.asarray(position, dtype=np.int64, order="C"))
    sess.run_with_iobinding(io)
    return io.get_outputs()[0].data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("vector", [False, True])
def test_cuda_matches_reference(rng, dtype, layout, n, vector):
    np_type, onnx_type = DTYPES[dtype]
    shape, axis = LAYOUTS[layout]
    cache, values, position = random_case(rng, shape, axis, n, vector, np_type)
    expected = cache_update_ref(cache, values, position, axis)
    cache_t, values_t = _to_torch(cache), _to_torch(values)
    sess = _cuda_session(cache_update_model(onnx_type, len(shape), axis, vector_position=vector))
    assert _bytes(cache_t) != expected.view(np.uint8).tobytes()
    _run(sess, cache_t, values_t, position, onnx_type)
    assert _bytes(cache_t) == expected.view(np.uint8).tobytes()


def test_cuda_errors_leave_cache_unchanged(rng):
    cache_t = _to_torch(rng.standard_normal((2, 2, 8, 4)).astype(np.float32))
    before = _bytes(cache_t)
    sess = _cuda_session(cache_update_model(vector_position=True))
    values_t = _to_torch(np.ones((2, 2, 3, 4), np.float32))
    # positions are on the device: checked there, reported after the run (Note [CUDA deferred errors])
    from ortkv import _ortkv

    _run(sess, cache_t, values_t, np.array([0, 6]), 1)
    assert re.search(r"E_CAPACITY.*row 1: position 6 \+ n 3 = 9 exceeds capacity 8", _ortkv.cuda_take_error() or "")
    assert _bytes(cache_t) == before
    _run(sess, cache_t, values_t, np.array([-2, 0]), 1)
    assert _bytes(cache_t) == before
    with pytest.raises(RuntimeError, match=r"E_INPUT.*position -2 for row 0"):  # the next run reports it
        _run(sess, cache_t, values_t, np.array([0, 0]), 1)
    assert _ortkv.cuda_take_error() is None
    other = cache_t.clone()
    io = sess.io_binding()
    io.bind_input("cache", "cuda", 0, 1, list(cache_t.shape), cache_t.data_ptr())
    io.bind_output("updated_cache", "cuda", 0, 1, list(cache_t.shape), other.data_ptr())
    io.bind_input("values", "cuda", 0, 1, list(values_t.shape), values_t.data_ptr())
    io.bind_cpu_input("position", np.array([0, 0], np.int64))
    with pytest.raises(RuntimeError, match=r"E_ALIAS"):
        sess.run_with_iobinding(io)
    assert _bytes(cache_t) == before and _bytes(other) == before


def test_cuda_consumer_topology(rng):
    import onnxruntime as ort

    cache = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
    values = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    expected = cache_update_ref(cache, values, 5)
    cache_v = ort.OrtValue.ortvalue_from_numpy(cache, "cuda", 0)
    sess = ort_session(cache_update_model(consumer=True), providers=("CUDAExecutionProvider",))
    io = sess.io_binding()
    io.bind_ortvalue_input("cache", cache_v)
    io.bind_cpu_input("values", values)
    io.bind_cpu_input("position", np.array(5, np.int64))
    io.bind_output("total", "cpu")
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(cache_v.numpy(), expected)
    np.testing.assert_allclose(io.get_outputs()[0].numpy(), expected.sum(dtype=np.float64), rtol=1e-5)


def test_cuda_mutable_cache_session_with_dlpack_tensor(rng):
    """A 64 MiB cache held by torch, updated in place 100 times by a session whose CUDA arena may hold 8 MiB in
    all: a cache-sized buffer anywhere in ORT (a copy of the input, an output not aliased) would fail its
    allocation. (The device's free memory, checked here before, also moves with every other process on the GPU,
    e.g. pytest -n's other workers: one such run failed a correct build.)"""
    torch = _torch()
    cache_t = torch.zeros((2, 8, 4096, 256), device="cuda")  # 64 MiB
    cuda = ("CUDAExecutionProvider", {"gpu_mem_limit": str(8 << 20), "arena_extend_strategy": "kSameAsRequested"})
    s = ortkv.MutableCacheSession(cache_update_model(vector_position=True), providers=[cuda])
    s.bind_cache("cache", cache_t)
    feed = lambda step: {"values": np.full((2, 8, 1, 256), float(step), np.float32),  # noqa: E731
                         "position": np.array([step % 4096, 4095])}
    for step in range(100):
        s.run(["updated_cache"], feed(step))
    torch.cuda.synchronize()
    # the control: the same limit refuses a cache-sized buffer (binding a host cache copies it to the device)
    plain = ort_session(cache_update_model(vector_position=True), providers=(cuda,))
    io = plain.io_binding()
    with pytest.raises(RuntimeError, match=r"Available memory of 8388608 is smaller than requested bytes of 67108864"):
        io.bind_cpu_input("cache", np.zeros((2, 8, 4096, 256), np.float32))
    assert float(cache_t[0, 0, 99, 0]) == 99.0 and float(cache_t[1, 7, 4095, 0]) == 99.0
    with pytest.raises(ortkv.CapacityError) as info:
        s.run(None, {"values": np.ones((2, 8, 2, 256), np.float32), "position": np.array([0, 4095])})
    assert (info.value.requested, info.value.capacity) == (4097, 4096)
    s.close()


def test_cuda_failed_run_raises_its_own_device_report():
    # Note [A failed run's device report]: three 8K MatMuls (~50-100 ms) hold the stream, so when the Reshape after
    # the update fails on the host the update's kernel (position -2) has not run yet. The failed run must raise
    # that report itself, and the next run must not.
    from onnx import TensorProto as TP
    from onnx import helper

    from ortkv.graph import make_cache_update, mark_mutable, set_alias_of

    torch = _torch()
    nodes = [helper.make_node("Expand", ["z", "big"], ["A0"])]
    nodes += [helper.make_node("MatMul", [f"A{i}", f"A{i}"], [f"A{i + 1}"]) for i in range(3)]
    nodes += [helper.make_node("ReduceSum", ["A3"], ["s"], keepdims=1),
              helper.make_node("Add", ["values_in", "s"], ["values"]),
              make_cache_update("cache", "values", "position", "updated_cache", name="cu", seq_axis=-2),
              helper.make_node("Reshape", ["updated_cache", "shape"], ["flat"], name="flatten")]
    dims = ["b", "h", "c", "d"]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes, "late_report",
        [vi("cache", TP.FLOAT, dims), vi("z", TP.FLOAT, [1, 1]), vi("values_in", TP.FLOAT, ["b", "h", "n", "d"]),
         vi("position", TP.INT64, ["b"]), vi("shape", TP.INT64, [2])],
        [vi("updated_cache", TP.FLOAT, dims), vi("flat", TP.FLOAT, None)],
        [helper.make_tensor("big", TP.INT64, [2], [8192, 8192])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    mark_mutable(model, "cache")
    set_alias_of(model, "updated_cache", "cache")
    cache_t = torch.zeros((1, 2, 8, 4), device="cuda")
    feed = lambda pos, shape: {"z": np.zeros((1, 1), np.float32),  # noqa: E731
                               "values_in": np.ones((1, 2, 1, 4), np.float32),
                               "position": np.array([pos]), "shape": np.array(shape)}
    with ortkv.MutableCacheSession(model, providers=["CUDAExecutionProvider"]) as s:
        s.bind_cache("cache", cache_t)
        assert s.run(["flat"], feed(0, [8, 8]))[0].shape == (8, 8)  # warm-up (and a position-0 write of ones)
        for _ in range(3):
            before = _bytes(cache_t)
            with pytest.raises(ortkv.CacheInputError, match=r"CacheUpdate node 'cu': position -2 for row 0") as info:
                s.run(["flat"], feed(-2, [3, 5]))
            assert "cannot be reshaped" in str(info.value.__context__)
            assert _bytes(cache_t) == before
            assert s.run(["flat"], feed(1, [8, 8]))[0].shape == (8, 8)  # no report left for this run
        assert ortkv.take_cuda_error() is None


def test_cuda_cupy_storage_if_available(rng):
    cp = pytest.importorskip("cupy", reason="cupy not installed")
    cache = cp.zeros((1, 2, 8, 4), dtype=cp.float32)
    with ortkv.MutableCacheSession(cache_update_model(), providers=["CUDAExecutionProvider"]) as s:
        s.bind_cache("cache", cache)
        s.run(None, {"values": np.full((1, 2, 1, 4), 3, np.float32), "position": np.array(7)})
    assert float(cache[0, 1, 7, 3]) == 3.0 and float(cache[0, 1, 6, 3]) == 0.0


# --- misuse (issue 9), CUDA variants ------------------------------------------------------------
@pytest.mark.parametrize("where", ["inside", "head", "tail"])
def test_cuda_values_overlapping_cache_refused(where):
    torch = _torch()
    buf = torch.arange(3 * 64, dtype=torch.float32, device="cuda")
    cache_t = buf[64:128].view(1, 2, 8, 4)
    values_t = {"inside": buf[72:80], "head": buf[57:65], "tail": buf[127:135]}[where].view(1, 2, 1, 4)
    before = _bytes(buf)
    sess = _cuda_session(cache_update_model())
    with pytest.raises(RuntimeError,
                       match=r"E_INPUT.*input 'values' \[0x.*overlaps the cache 'cache'.*Nothing was written"):
        _run(sess, cache_t, values_t, 3, 1)
    assert _bytes(buf) == before


def test_cuda_position_at_int64_max_reports_the_true_sum():
    torch = _torch()
    cache_t = torch.zeros((1, 2, 8, 4), device="cuda")
    sess = _cuda_session(cache_update_model())
    from ortkv import _ortkv

    _run(sess, cache_t, torch.ones((1, 2, 1, 4), device="cuda"), 2**63 - 1, 1)
    assert re.search(r"E_CAPACITY.*= 9223372036854775808 exceeds capacity 8", _ortkv.cuda_take_error() or "")
    assert not bool(cache_t.any())


def test_cuda_ortvalue_cache_with_its_device_index():
    import onnxruntime as ort
    from ortkv._storage import as_storage

    value = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 2, 8, 4), np.float32), "cuda", 0)
    assert as_storage(value).device_key == ("cuda", 0)
    with ortkv.MutableCacheSession(cache_update_model(), providers=["CUDAExecutionProvider"]) as s:
        s.bind_cache("cache", value)
        s.run(None, {"values": np.full((1, 2, 1, 4), 2, np.float32), "position": np.array(5)})
    host = value.numpy()
    assert (host[0, :, 5] == 2).all() and host.sum() == 16


def test_cuda_session_feed_overlapping_cache_refused():
    import onnxruntime as ort

    torch = _torch()
    cache_t = torch.zeros((1, 1, 16, 4), device="cuda")
    with ortkv.MutableCacheSession(cache_update_model(), providers=["CUDAExecutionProvider"]) as s:
        s.bind_cache("cache", cache_t)
        values = ort.OrtValue.from_dlpack(cache_t[:, :, 2:3])
        with pytest.raises(ortkv.BindingConflictError, match=r"feed 'values' .* on cuda:0 overlaps cache 'cache'"):
            s.run(None, {"values": values, "position": np.array(5)})
    assert not bool(cache_t.any())

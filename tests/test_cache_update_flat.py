"""CacheUpdate with flat values [batch, n, heads * head_size] into a BSNH cache (Note [CacheUpdate flat values] in
custom_ops/ort/cache_update_op.cc): the decoders' K / V go in without a Reshape node (issue 12). Checked against
the numpy reference of the same update in the cache's rank; refusals name the numbers and leave the cache bytes
as they were; the other layouts still take values in the cache's rank only; ortkv.graph's checker agrees."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from conftest import digest, ort_session, run_bound
from ortkv.graph import make_cache_update, mark_mutable, set_alias_of
from ortkv.graph.check import check
from ortkv.reference import cache_update_ref


def flat_model(seq_axis: int = 1, rank: int = 4):
    dims = [f"d{i}" for i in range(rank)]
    node = make_cache_update("cache", "values", "position", "updated_cache", name="cache_update", seq_axis=seq_axis)
    graph = helper.make_graph(
        [node], "cache_update_flat",
        [helper.make_tensor_value_info("cache", TP.FLOAT, dims),
         helper.make_tensor_value_info("values", TP.FLOAT, ["b", "n", "w"]),
         helper.make_tensor_value_info("position", TP.INT64, ["b"])],
        [helper.make_tensor_value_info("updated_cache", TP.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    mark_mutable(model, "cache")
    set_alias_of(model, "updated_cache", "cache")
    return model


@pytest.fixture(scope="module")
def bsnh():
    return ort_session(flat_model(1))


@pytest.mark.parametrize("n", [1, 5])
def test_flat_values_match_the_reference_in_the_cache_rank(bsnh, n):
    rng = np.random.default_rng(n)
    cache = rng.standard_normal((3, 16, 3, 8)).astype(np.float32)
    values = rng.standard_normal((3, n, 24)).astype(np.float32)
    position = np.array([0, 7, 16 - n])
    want = cache_update_ref(cache, values.reshape(3, n, 3, 8), position, seq_axis=1)
    ptr = run_bound(bsnh, cache, values, position, TP.FLOAT)
    assert ptr == cache.ctypes.data  # in place
    np.testing.assert_array_equal(cache, want)


def _refused(sess, cache, values, position, *fragments):
    before = digest(cache)
    with pytest.raises(Exception) as info:
        run_bound(sess, cache, values, position, TP.FLOAT)
    for f in fragments:
        assert f in str(info.value), f"{f!r} not in {str(info.value)!r}"
    assert digest(cache) == before, "a refused update changed the cache bytes"


def test_flat_values_of_the_wrong_width_are_refused_untouched(bsnh):
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((2, 16, 3, 8)).astype(np.float32)
    _refused(bsnh, cache, rng.standard_normal((2, 1, 16)).astype(np.float32), np.array([0, 1]),
             "[ortkv:E_INPUT]", "CacheUpdate node 'cache_update': input 'values' has shape [2, 1, 16]: flat values "
             "[batch, n, width] for the cache 'cache' (sequence axis 1) need width 3 x 8 = 24",
             "Nothing was written. Remedy: pass values of width 24, or in the cache's rank [batch, n, 3, 8]")
    # the rest is checked as for values in the cache's rank: the batch, the capacity
    _refused(bsnh, cache, rng.standard_normal((1, 1, 24)).astype(np.float32), np.array([0, 1]),
             "[ortkv:E_INPUT]", "'values' has shape [1, 1, 3, 8]", "dim 0 is 1, expected 2")
    _refused(bsnh, cache, rng.standard_normal((2, 2, 24)).astype(np.float32), np.array([0, 15]),
             "[ortkv:E_CAPACITY]", "row 1: position 15 + n 2 = 17 exceeds capacity 16 of 'cache'")


def test_other_layouts_take_values_in_the_cache_rank_only():
    """BNSH (seq_axis -2) would need a transposition of the new tokens: flat values are refused there."""
    rng = np.random.default_rng(1)
    sess = ort_session(flat_model(-2))
    cache = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    _refused(sess, cache, rng.standard_normal((2, 1, 24)).astype(np.float32), np.array([0, 1]),
             "[ortkv:E_INPUT]", "'values' has shape [2, 1, 24] (rank 3) but 'cache' has shape [2, 3, 16, 8] (rank 4)")


def test_the_graph_checker_accepts_flat_values_and_names_a_wrong_width():
    ok = check(flat_model(1), dims={"d0": 2, "d1": 16, "d2": 3, "d3": 8, "b": 2, "n": 1, "w": 24})
    assert not [f for f in ok.findings if f.severity == "error"], ok.findings
    bad = check(flat_model(1), dims={"d0": 2, "d1": 16, "d2": 3, "d3": 8, "b": 2, "n": 1, "w": 16})
    text = " ".join(f.message for f in bad.findings)
    assert "dim 2 of 'values' [2, 1, 16] is 16, expected 24 (flat values [batch, n, width] need width 3 x 8)" in text
    bnsh = check(flat_model(-2), dims={"d0": 2, "d1": 3, "d2": 16, "d3": 8, "b": 2, "n": 1, "w": 24})
    assert "has rank 3 but 'cache'" in " ".join(f.message for f in bnsh.findings)


@pytest.mark.cuda
@pytest.mark.parametrize("np_type, onnx_type", [(np.float32, TP.FLOAT), (np.float16, TP.FLOAT16)])
def test_flat_values_on_cuda(np_type, onnx_type):
    """The CUDA CacheUpdate reads flat values the same way (the shape is reinterpreted before its plan); a wrong
    width is refused before any launch, the device cache unchanged."""
    import onnxruntime as ort

    model = flat_model(1)
    for vi in list(model.graph.input)[:2] + list(model.graph.output):
        vi.type.tensor_type.elem_type = onnx_type
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # CacheUpdate must run on CUDA
    so.register_custom_ops_library(__import__("ortkv").get_library_path())
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])
    rng = np.random.default_rng(3)
    cache = rng.standard_normal((2, 16, 3, 8)).astype(np_type)
    values = rng.standard_normal((2, 4, 24)).astype(np_type)
    position = np.array([3, 12])
    want = cache_update_ref(cache, values.reshape(2, 4, 3, 8), position, seq_axis=1)
    cache_v = ort.OrtValue.ortvalue_from_numpy(cache, "cuda", 0)

    def run(vals):
        io = sess.io_binding()
        io.bind_ortvalue_input("cache", cache_v)
        io.bind_ortvalue_output("updated_cache", cache_v)
        io.bind_ortvalue_input("values", ort.OrtValue.ortvalue_from_numpy(vals, "cuda", 0))
        io.bind_cpu_input("position", position)
        sess.run_with_iobinding(io)

    run(values)
    np.testing.assert_array_equal(cache_v.numpy(), want)
    with pytest.raises(Exception, match=r"flat values \[batch, n, width\] for the cache 'cache' \(sequence axis 1\) "
                                        r"need width 3 x 8 = 24"):
        run(rng.standard_normal((2, 1, 16)).astype(np_type))
    np.testing.assert_array_equal(cache_v.numpy(), want)

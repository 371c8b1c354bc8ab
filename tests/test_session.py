"""MutableCacheSession: binding, refusals, pointer verification, typed errors."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import cache_update_model, digest
from ortkv import session as session_mod
from ortkv.graph import Access, set_input_access
from ortkv.reference import cache_update_ref


def _session(**kw):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ortkv.MutableCacheSession(cache_update_model(**kw), sess_options=so)


def test_run_updates_in_place_and_returns_the_cache(rng):
    cache = rng.standard_normal((2, 3, 8, 4)).astype(np.float32)
    values = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    expected = cache_update_ref(cache, values, np.array([0, 6]))
    with _session(vector_position=True) as s:
        assert s.caches == ["cache"] and s.aliased_outputs("cache") == ["updated_cache"]
        s.bind_cache("cache", cache)
        (out,) = s.run(["updated_cache"], {"values": values, "position": np.array([0, 6])})
    assert out is cache
    np.testing.assert_array_equal(cache, expected)


@pytest.mark.parametrize("kind", ["ortvalue", "dlpack", "bf16_uint16", "bf16_ml_dtypes"])
def test_storage_kinds(rng, kind):
    onnx_type = TP.BFLOAT16 if kind.startswith("bf16") else TP.FLOAT
    base = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    if kind.startswith("bf16"):
        base = base.astype(ml_dtypes.bfloat16)
    values = rng.standard_normal((1, 2, 1, 4)).astype(np.float32).astype(base.dtype)
    expected = cache_update_ref(base, values, 3)
    if kind == "ortvalue":
        storage = ort.OrtValue.ortvalue_from_numpy(base)
    elif kind == "dlpack":
        class Tensor:  # a minimal DLPack producer (what torch and cupy tensors look like)
            def __dlpack__(self, **kw):
                return base.__dlpack__(**kw)

            def __dlpack_device__(self):
                return base.__dlpack_device__()

        storage = Tensor()
    elif kind == "bf16_uint16":
        storage = base.view(np.uint16)
    else:
        storage = base
    s = ortkv.MutableCacheSession(cache_update_model(onnx_type))
    s.bind_cache("cache", storage)
    feed = values.view(np.uint16) if kind.startswith("bf16") else values
    if kind.startswith("bf16"):
        feed = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(values.view(np.uint16), onnx_type)
    s.run(["updated_cache"], {"values": feed, "position": np.array(3)})
    np.testing.assert_array_equal(base.view(np.uint8), expected.view(np.uint8))
    s.close()


def test_readonly_array_refused():
    cache = np.zeros((1, 2, 4, 4), np.float32)
    cache.flags.writeable = False
    with _session() as s, pytest.raises(ortkv.ImmutableStorageError, match=r"cache 'cache'.*read-only"):
        s.bind_cache("cache", cache)


def test_readonly_dlpack_refused():
    cache = np.zeros((1, 2, 4, 4), np.float32)
    cache.flags.writeable = False

    class Tensor:
        def __dlpack__(self, **kw):
            return cache.__dlpack__(**kw)

        def __dlpack_device__(self):
            return cache.__dlpack_device__()

    with _session() as s, pytest.raises(ortkv.ImmutableStorageError, match=r"dlpack storage is read-only"):
        s.bind_cache("cache", Tensor())


def test_initializer_refused():
    model = cache_update_model()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "bias"))
    model.graph.input.append(helper.make_tensor_value_info("bias", TP.FLOAT, [1, 1, 1, 1]))
    s = ortkv.MutableCacheSession(model)
    with pytest.raises(ortkv.ImmutableStorageError, match=r"'bias' is an initializer"):
        s.bind_cache("bias", np.zeros((1, 1, 1, 1), np.float32))


def test_input_not_read_write_refused():
    model = cache_update_model(consumer=True)  # cache is READ_WRITE ...
    model.graph.input.append(helper.make_tensor_value_info("extra", TP.FLOAT, [2]))
    set_input_access(model, "extra", Access.READ_ONLY)
    s = ortkv.MutableCacheSession(model)
    with pytest.raises(ortkv.ImmutableStorageError, match=r"input 'extra' is READ_ONLY, not READ_WRITE"):
        s.bind_cache("extra", np.zeros(2, np.float32))
    with pytest.raises(ortkv.ImmutableStorageError, match=r"input 'values' is not annotated, not READ_WRITE"):
        s.bind_cache("values", np.zeros((1, 1, 1, 1), np.float32))


def test_type_and_shape_checked():
    with _session() as s:
        with pytest.raises(ortkv.StorageError, match=r"storage is float16 but the model declares float32"):
            s.bind_cache("cache", np.zeros((1, 2, 4, 4), np.float16))
        with pytest.raises(ortkv.StorageError, match=r"not C-contiguous"):
            s.bind_cache("cache", np.zeros((1, 2, 4, 8), np.float32)[..., ::2])


def test_overlap_across_two_sessions_refused():
    buf = np.zeros((2, 2, 8, 4), np.float32)
    a, b = _session(), _session()
    a.bind_cache("cache", buf[:1])
    with pytest.raises(ortkv.BindingConflictError, match=r"overlaps cache 'cache' of session #"):
        b.bind_cache("cache", buf)
    b.bind_cache("cache", buf[1:])  # disjoint half: fine
    a.close()
    b.unbind_cache("cache")
    b.bind_cache("cache", buf)  # the first session released its binding on close
    b.close()
    assert session_mod.BINDINGS.count() == 0


def test_second_concurrent_run_refused():
    """Thread A is inside run() (its feed conversion blocks); thread B's run is refused, not queued."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    s = _session()
    s.bind_cache("cache", cache)
    entered, release = threading.Event(), threading.Event()

    class SlowFeed:
        def __array__(self, dtype=None, copy=None):
            entered.set()
            release.wait(10)
            return np.ones((1, 2, 1, 4), np.float32)

    results = {}

    def first():
        results["a"] = s.run(["updated_cache"], {"values": SlowFeed(), "position": np.array(0)})

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    with pytest.raises(ortkv.BindingConflictError, match=r"a run is in progress on this session's caches"):
        s.run(["updated_cache"], {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array(1)})
    with pytest.raises(ortkv.BindingConflictError):
        s.bind_cache("cache", np.zeros((1, 2, 8, 4), np.float32))
    release.set()
    t.join(10)
    assert results["a"][0] is cache and cache[0, 0, 0, 0] == 1 and cache[0, 0, 1, 0] == 0


def test_capacity_error_has_numbers():
    cache = np.zeros((1, 2, 8, 4), np.float32)
    before = digest(cache)
    with _session() as s:
        s.bind_cache("cache", cache)
        with pytest.raises(ortkv.CapacityError) as info:
            s.run(None, {"values": np.ones((1, 2, 3, 4), np.float32), "position": np.array(7)})
    assert (info.value.requested, info.value.capacity) == (10, 8)
    assert "exceeds capacity 8 of 'cache'" in str(info.value)
    assert digest(cache) == before


def test_alias_error_when_pointer_differs(monkeypatch, rng):
    """The post-run check: an aliased output that comes back elsewhere raises AliasError."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with _session() as s:
        s.bind_cache("cache", cache)
        real = ort.IOBinding.get_outputs

        class Moved:
            def __init__(self, v):
                self.v = v

            def data_ptr(self):
                return self.v.data_ptr() + 64

            def numpy(self):
                return self.v.numpy()

        monkeypatch.setattr(ort.IOBinding, "get_outputs", lambda io: [Moved(v) for v in real(io)])
        with pytest.raises(ortkv.AliasError, match=r"output 'updated_cache' came back at 0x[0-9a-f]+ but its cache"):
            s.run(None, {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array(0)})


def test_kernel_alias_error_is_typed():
    exc = RuntimeError("Non-zero status ... Status Message: [ortkv:E_ALIAS] CacheUpdate node 'x': output ...")
    assert isinstance(session_mod.translate_ort_error(exc), ortkv.AliasError)
    other = RuntimeError("something else")
    assert session_mod.translate_ort_error(other) is other


def test_unbound_cache_and_cache_in_feeds_refused():
    with _session() as s:
        with pytest.raises(ortkv.OrtkvError, match=r"not bound; call bind_cache"):
            s.run(None, {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array(0)})
        s.bind_cache("cache", np.zeros((1, 2, 8, 4), np.float32))
        with pytest.raises(ortkv.OrtkvError, match=r"'cache' is a cache: bind it with bind_cache"):
            s.run(None, {"cache": np.zeros((1, 2, 8, 4), np.float32), "values": np.ones((1, 2, 1, 4), np.float32),
                         "position": np.array(0)})


def test_session_refuses_model_failing_the_checker():
    model = cache_update_model()
    del model.graph.output[0].metadata_props[:]  # output_alias without alias_of on the graph output
    with pytest.raises(ortkv.GraphCheckError, match=r"alias-disagree"):
        ortkv.MutableCacheSession(model)


def test_full_check_at_load_refuses_what_the_annotation_rules_cannot_see():
    model = cache_update_model()
    # the cache declared with capacity 16, its update with 8: the annotations agree, the shapes cannot
    for vi, cap in ((model.graph.input[0], 16), (model.graph.output[0], 8)):
        for d, v in zip(vi.type.tensor_type.shape.dim, (1, 2, cap, 4)):
            d.dim_value = v
    assert ortkv.MutableCacheSession(model).warnings == []  # annotation rules only: loads
    with pytest.raises(ortkv.GraphCheckError, match=r"alias-dim.*'updated_cache'.*'cache'.*dim 2 is 16 vs 8") as info:
        ortkv.MutableCacheSession(model, check="full")
    assert [f.rule for f in info.value.findings] == ["alias-dim"]
    assert ortkv.MutableCacheSession(cache_update_model(), check="full").warnings == []
    with pytest.raises(ValueError, match="'annotations' or 'full'"):
        ortkv.MutableCacheSession(cache_update_model(), check="everything")


def test_model_from_path_and_bytes(tmp_path):
    model = cache_update_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for source in (str(path), model.SerializeToString()):
        s = ortkv.MutableCacheSession(source)
        assert s.caches == ["cache"]
        s.close()
    with pytest.raises(ortkv.OrtkvError, match=r"does not exist"):
        ortkv.MutableCacheSession(str(tmp_path / "missing.onnx"))

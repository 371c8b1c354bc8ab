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
    assert not np.array_equal(cache, expected)
    with _session(vector_position=True) as s:
        assert s.caches == ["cache"] and s.aliased_outputs("cache") == ["updated_cache"]
        s.bind_cache("cache", cache)
        (out,) = s.run(["updated_cache"], {"values": values, "position": np.array([0, 6])})
    np.testing.assert_array_equal(cache, expected)  # the caller's array was updated in place
    np.testing.assert_array_equal(out, expected)


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
    assert cache[0, 0, 0, 0] == 1 and cache[0, 0, 1, 0] == 0  # only the first run wrote


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
    """The post-run check: an aliased output that comes back elsewhere raises AliasError.

    This check is reachable only by monkeypatching: with one buffer bound as input and output, ORT
    always hands back that buffer, and an unbound output is refused by the kernel first (E_ALIAS,
    see test_plain_run_of_the_session_model_is_refused). It stays as a second line of defence; this
    test only proves the check is wired (a changed pointer is reported, not ignored)."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with _session() as s:
        s.bind_cache("cache", cache)
        real = ort.IOBinding.get_outputs_as_ortvaluevector  # what the check reads (Note [Alias check without wrappers])

        class Moved:
            def __init__(self, v):
                self.v = v

            def data_ptr(self):
                return self.v.data_ptr() + 64

            def numpy(self):
                return self.v.numpy()

        monkeypatch.setattr(ort.IOBinding, "get_outputs_as_ortvaluevector", lambda io: [Moved(v) for v in real(io)])
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


# --- misuse (issue 9): read-only memory behind an OrtValue, overlapping feeds, feed types ------
def _feed(n=1, position=0, dtype=np.float32):
    return {"values": np.ones((1, 2, n, 4), dtype), "position": np.array(position)}


def test_ortvalue_over_bytes_refused_and_bytes_untouched():
    """ortvalue_from_numpy wraps a read-only array (here over a Python bytes object) without a word;
    binding it used to succeed and the run wrote into the bytes object."""
    raw = bytes(range(256))  # 256 bytes: float32 [1, 2, 8, 4]
    arr = np.frombuffer(raw, np.float32).reshape(1, 2, 8, 4)
    original = bytes(raw)
    value = ort.OrtValue.ortvalue_from_numpy(arr)
    with _session() as s:
        with pytest.raises(ortkv.ImmutableStorageError,
                           match=r"cache 'cache': an OrtValue made from a read-only numpy array"
                                 r".*np.array\(x, copy=True\)"):
            s.bind_cache("cache", value)
        with pytest.raises(ortkv.OrtkvError, match=r"not bound"):
            s.run(None, _feed())
    assert raw == original


def test_ortvalue_over_readonly_memmap_refused(tmp_path):
    """A read-only np.memmap behind an OrtValue: the run used to segfault writing the mapping."""
    path = tmp_path / "cache.bin"
    data = np.arange(64, dtype=np.float32)
    data.tofile(path)
    mm = np.memmap(path, np.float32, mode="r", shape=(1, 2, 8, 4))
    value = ort.OrtValue.ortvalue_from_numpy(mm)
    with _session() as s, pytest.raises(ortkv.ImmutableStorageError, match=r"read-only numpy array.*memmap"):
        s.bind_cache("cache", value)
    del value, mm
    assert path.read_bytes() == data.tobytes()


def test_read_only_pages_refused_even_when_numpy_says_writable():
    """An array built over a raw pointer claims writeable=True whatever the page protection is;
    the bind checks the pages themselves (a run would segfault inside the op)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        arr = np.ctypeslib.as_array((ctypes.c_float * 64).from_address(addr)).reshape(1, 2, 8, 4)
        assert arr.flags.writeable  # numpy cannot know
        with _session() as s, pytest.raises(ortkv.ImmutableStorageError,
                                            match=r"is not writable memory: \[0x[0-9a-f]+, 0x[0-9a-f]+\) "
                                                  r"is mapped r--"):
            s.bind_cache("cache", arr)
        assert not arr.any()  # still the zero page: nothing was written (a write would have faulted)
    finally:
        libc.munmap(addr, 4096)


def test_ortvalue_over_bytes_laundered_through_dlpack_refused():
    """OrtValue.__dlpack__ exports read-only memory through a capsule that cannot say so: the same
    bytes object, bound as a DLPack tensor, is refused too."""
    raw = bytes(range(256))
    value = ort.OrtValue.ortvalue_from_numpy(np.frombuffer(raw, np.float32).reshape(1, 2, 8, 4))

    class Tensor:  # any object forwarding the OrtValue's DLPack export
        def __dlpack__(self, **kw):
            return value.__dlpack__()

        def __dlpack_device__(self):
            return value.__dlpack_device__()

    with _session() as s, pytest.raises(ortkv.ImmutableStorageError,
                                        match=r"exported by an onnxruntime OrtValue.*not known writable"):
        s.bind_cache("cache", Tensor())
    assert raw == bytes(range(256))


def test_host_ortvalue_of_unknown_provenance_refused():
    """An OrtValue that ORT allocated carries no owner's word on writability: refused with a remedy."""
    value = ort.OrtValue.ortvalue_from_shape_and_type([1, 2, 8, 4], np.float32)
    with _session() as s, pytest.raises(ortkv.ImmutableStorageError,
                                        match=r"not known writable: it was not made from a numpy array.*"
                                              r"ortvalue_from_numpy\(writable_array\)"):
        s.bind_cache("cache", value)


def test_ortvalue_of_a_non_contiguous_array_is_a_copy_and_refused():
    """ortvalue_from_numpy copies a non-contiguous array: an update would never reach the caller's array."""
    base = np.zeros((1, 2, 8, 8), np.float32)
    value = ort.OrtValue.ortvalue_from_numpy(base[..., ::2])
    with _session() as s, pytest.raises(ortkv.StorageError, match=r"onnxruntime copied it.*np.ascontiguousarray"):
        s.bind_cache("cache", value)


def test_ortvalue_device_index_comes_from_the_value():
    """The device index was hard-coded to 0; it now comes from the OrtValue (DLPack device)."""
    from ortkv._storage import as_storage

    class OnSecondGpu(ort.OrtValue):  # what a CUDA OrtValue on device 1 reports
        def device_name(self):
            return "cuda"

        def __dlpack_device__(self):
            return (2, 1)

    inner = ort.OrtValue.ortvalue_from_shape_and_type([1, 2, 8, 4], np.float32)
    st = as_storage(OnSecondGpu(inner._get_c_value()))
    assert (st.device_type, st.device_id, st.writable) == ("cuda", 1, True)
    assert as_storage(ort.OrtValue.ortvalue_from_numpy(np.zeros(4, np.float32))).device_key == ("cpu", 0)


def test_values_overlapping_the_cache_refused():
    cache = np.arange(64, dtype=np.float32).reshape(1, 1, 16, 4)
    before = digest(cache)
    values = cache[:, :, 2:3]  # a contiguous view into the cache itself
    assert np.shares_memory(values, cache) and values.flags.c_contiguous
    with _session() as s:
        s.bind_cache("cache", cache)
        with pytest.raises(ortkv.BindingConflictError,
                           match=r"feed 'values' \[0x[0-9a-f]+, 0x[0-9a-f]+\) on cpu:0 overlaps cache 'cache'.*copy"):
            s.run(None, {"values": values, "position": np.array(5)})
        assert digest(cache) == before
        s.run(None, {"values": values.copy(), "position": np.array(5)})  # a copy is fine
    np.testing.assert_array_equal(cache[0, 0, 5], [8, 9, 10, 11])


def test_capacity_error_at_the_largest_position_keeps_its_numbers():
    cache = np.zeros((1, 2, 8, 4), np.float32)
    before = digest(cache)
    with _session() as s:
        s.bind_cache("cache", cache)
        with pytest.raises(ortkv.CapacityError, match=r"= 9223372036854775808 exceeds capacity 8") as info:
            s.run(None, _feed(position=2**63 - 1))
    assert (info.value.requested, info.value.capacity, info.value.position) == (2**63, 8, 2**63 - 1)
    assert digest(cache) == before


@pytest.mark.parametrize("shape", [(1, 2, 0, 4), (1, 0, 8, 4), (0, 2, 8, 4)])
def test_zero_element_cache_refused_at_bind(shape):
    with _session() as s, pytest.raises(ortkv.StorageError,
                                        match=r"cache 'cache': storage shape \[.*\] has no elements"):
        s.bind_cache("cache", np.zeros(shape, np.float32))


def test_feed_of_the_wrong_type_is_a_typed_error():
    cache = np.zeros((1, 2, 8, 4), np.float32)
    before = digest(cache)
    with _session() as s:
        s.bind_cache("cache", cache)
        with pytest.raises(ortkv.InputTypeError,
                           match=r"input 'position' is int32 but the model declares int64") as info:
            s.run(None, {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array(0, np.int32)})
        assert (info.value.input, info.value.expected, info.value.given) == ("position", "int64", "int32")
        assert str(info.value).endswith("e.g. np.asarray(x, dtype=np.int64)")
        with pytest.raises(ortkv.InputTypeError, match=r"input 'values' is float16 but the model declares float32"):
            s.run(None, {"values": ort.OrtValue.ortvalue_from_numpy(np.ones((1, 2, 1, 4), np.float16)),
                         "position": np.array(0)})
    assert digest(cache) == before


@pytest.mark.parametrize("feed_kind", ["ml_dtypes", "uint16_bits"])
def test_bfloat16_numpy_feed(rng, feed_kind):
    cache = rng.standard_normal((1, 2, 8, 4)).astype(ml_dtypes.bfloat16)
    values = rng.standard_normal((1, 2, 2, 4)).astype(ml_dtypes.bfloat16)
    expected = cache_update_ref(cache, values, 3)
    assert not np.array_equal(expected.view(np.uint16), cache.view(np.uint16))
    with ortkv.MutableCacheSession(cache_update_model(TP.BFLOAT16)) as s:
        s.bind_cache("cache", cache)
        feed = values if feed_kind == "ml_dtypes" else values.view(np.uint16)
        s.run(None, {"values": feed, "position": np.array(3)})
    np.testing.assert_array_equal(cache.view(np.uint16), expected.view(np.uint16))


def test_plain_run_of_the_session_model_is_refused():
    """What can actually go wrong with the aliasing: running the model without binding the cache as
    its output (plain InferenceSession.run). The kernel refuses; the caller's array is untouched."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    before = digest(cache)
    with _session() as s:
        with pytest.raises(Exception, match=r"\[ortkv:E_ALIAS\].*is not the storage of input 'cache'"):
            s.session.run(None, {"cache": cache, **_feed()})
    assert digest(cache) == before


_UNCOMMITTED_SCRIPT = r"""
import sys
import numpy as np
import onnxruntime as ort
sys.path.insert(0, {tests!r})
import ortkv
from conftest import cache_update_model
from ortkv.vmm import Arena

a = Arena(1 << 24, "cpu")
g = a.granule
a.commit(g)                                  # only the first granule is committed
shape = (1, 1, (2 * g) // 16, 4)             # two granules; the write at token 0 lands in the first
view = a.view(np.float32, shape)
def so():
    o = ort.SessionOptions(); o.log_severity_level = 4
    return o
feed = {{"values": np.ones((1, 1, 1, 4), np.float32), "position": np.array(0)}}
with ortkv.MutableCacheSession(cache_update_model(consumer=True), sess_options=so(), check={check!r}) as s:
    s.bind_cache("cache", view)
    try:
        s.run(None, feed)
        print("RAN")
    except ortkv.CapacityError as e:
        print("REFUSED", e.requested, e.capacity, str(e))
    a.commit(2 * g)                          # commit what ReduceSum reads: the run goes through
    total, = s.run(None, feed)
    print("TOTAL", float(total))
with ortkv.MutableCacheSession(cache_update_model(), sess_options=so()) as s:  # no whole-tensor reader
    b = Arena(1 << 24, "cpu"); b.commit(g)
    s.bind_cache("cache", b.view(np.float32, shape))
    s.run(None, feed)
    print("PLAIN OK")
"""


@pytest.mark.parametrize("check", ["annotations", "full"])
def test_uncommitted_cache_read_by_a_non_ortkv_op_refused(check):
    """An arena view with an uncommitted tail, consumed by ReduceSum, used to segfault inside ORT:
    run in a subprocess so that a regression cannot take the suite down."""
    import subprocess
    import sys
    from pathlib import Path

    code = _UNCOMMITTED_SCRIPT.format(tests=str(Path(__file__).parent), check=check)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}: {proc.stdout}{proc.stderr[-2000:]}"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("REFUSED"), lines
    _, requested, committed, message = lines[0].split(" ", 3)
    assert int(committed) > 0 and int(requested) == 2 * int(committed)
    assert "read whole by node 'ReduceSum' (ReduceSum, not an ortkv op" in message and "Arena.commit" in message
    assert f"({int(requested) - int(committed)} bytes, 'uncommitted arena granules') is not committed" in message
    assert lines[1:] == ["TOTAL 4.0", "PLAIN OK"]


# --- Note [Reused IOBinding]: the caches' bindings are kept across runs, nothing else is ---------------
def test_cache_bindings_are_reused_across_runs_and_follow_a_rebinding(rng):
    a = np.zeros((1, 2, 8, 4), np.float32)
    b = np.zeros((1, 2, 8, 4), np.float32)
    with _session() as s:
        s.bind_cache("cache", a)
        s.run(["updated_cache"], _feed(position=0))
        io = s._io_cache[1]
        s.run(["updated_cache"], _feed(position=1))
        assert s._io_cache[1] is io  # same feeds and outputs: the binding object is reused
        assert a[:, :, :2].sum() == 16 and a[:, :, 2:].sum() == 0
        s.unbind_cache("cache")
        s.bind_cache("cache", b)
        before = digest(a)
        s.run(["updated_cache"], _feed(position=5))
        assert s._io_cache[1] is not io  # a new binding after the caches changed
    assert digest(a) == before  # the old cache is no longer written
    assert b[:, :, 5].sum() == 8 and b.sum() == 8


def test_a_feed_left_out_of_a_later_run_is_not_taken_from_the_earlier_one(rng):
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with _session() as s:
        s.bind_cache("cache", cache)
        s.run(["updated_cache"], _feed(position=3))
        before = digest(cache)
        with pytest.raises(ortkv.errors.MissingInputError, match=r"\['position'\] not fed") as e:
            s.run(["updated_cache"], {"values": np.full((1, 2, 1, 4), 7, np.float32)})
        assert e.value.inputs == ["position"]
    assert digest(cache) == before


def test_outputs_of_an_earlier_run_are_not_overwritten_by_a_later_one(rng):
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with _session(consumer=True) as s:
        s.bind_cache("cache", cache)
        (t1,) = s.run(["total"], _feed(position=0))
        first = np.array(t1, copy=True)
        (t2,) = s.run(["total"], {"values": np.full((1, 2, 1, 4), 5, np.float32), "position": np.array(1)})
    np.testing.assert_array_equal(t1, first)
    assert float(t1) == 8 and float(t2) == 8 + 40

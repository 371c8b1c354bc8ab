"""The CPU decode step's lean Python path (issue 12): the post-run alias check read through DLPack capsules
(Note [Alias check without wrappers] in session.py), OrtValue feeds bound once (Note [CPU decode feeds] in
runners.py), the feed overlap check by bisection, and the generation loop's RSS reading. Each shortcut must
refuse exactly what the long way refused, with the same message, and leave the caches untouched."""

from __future__ import annotations

import copy

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortkv
from ortkv import _ortkv
from ortkv._memory import rss_bytes, rss_bytes_fast
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.config import GenAIConfig
from ortkv.generate.runners import OrtkvRunner

from conftest import cache_update_model, digest


def _session():
    so = ort.SessionOptions()
    so.log_severity_level = 4
    return ortkv.MutableCacheSession(cache_update_model(), sess_options=so)


def _feed(position=0, value=1.0):
    return {"values": np.full((1, 2, 1, 4), value, np.float32), "position": np.array(position)}


# --- _ortkv.dlpack_data_ptr: numpy's own pointers, both capsule kinds -------------------------------------------
def test_dlpack_data_ptr_reads_numpy_pointers():
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    for view in (a, a[3:], a[2:5, 1:3]):
        assert _ortkv.dlpack_data_ptr(view.__dlpack__()) == view.ctypes.data
        assert _ortkv.dlpack_data_ptr(view.__dlpack__(max_version=(1, 0))) == view.ctypes.data
    with pytest.raises(TypeError, match=r"dlpack_data_ptr: not an unconsumed DLPack capsule \(\"dltensor\""):
        _ortkv.dlpack_data_ptr(a)


def test_dlpack_data_ptr_consumes_the_capsule():
    """Note [DLPack capsules are consumed]: the managed tensor's deleter runs (the producer's reference is dropped)
    and the capsule is renamed used_*, so it cannot be read twice and its own destructor frees nothing more."""
    import sys

    a = np.arange(64, dtype=np.float32)
    before = sys.getrefcount(a)
    for versioned in (False, True):
        cap = a.__dlpack__(max_version=(1, 0)) if versioned else a.__dlpack__()
        assert sys.getrefcount(a) == before + 1  # the capsule's managed tensor holds the array
        assert _ortkv.dlpack_data_ptr(cap) == a.ctypes.data
        assert sys.getrefcount(a) == before  # consumed: the deleter dropped that reference
        with pytest.raises(TypeError, match="not an unconsumed DLPack capsule"):
            _ortkv.dlpack_data_ptr(cap)
        del cap  # its destructor sees a used capsule: no second release (a double free would crash here)
        assert sys.getrefcount(a) == before


def test_alias_check_does_not_keep_outputs_alive():
    """Every run's outputs go through to_dlpacks(dlpack_data_ptr); a callback that only read the capsules kept
    each output's tensor alive forever (~200 KiB a decode step for SmolLM2's logits). 40 runs that each return a
    16 MiB non-cache output must not grow the process by more than a few of them."""
    from onnx import TensorProto as TP
    from onnx import helper

    big = 4 << 20  # floats: 16 MiB
    m = cache_update_model()
    m.graph.node.append(helper.make_node("Expand", ["one", "shape"], ["big"]))
    m.graph.input.append(helper.make_tensor_value_info("one", TP.FLOAT, [1]))
    m.graph.output.append(helper.make_tensor_value_info("big", TP.FLOAT, [big]))
    m.graph.initializer.append(helper.make_tensor("shape", TP.INT64, [1], [big]))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with ortkv.MutableCacheSession(m.SerializeToString(), sess_options=so) as s:
        s.bind_cache("cache", cache)
        feeds = {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array(0), "one": np.ones(1, np.float32)}
        for _ in range(3):
            s.run(["updated_cache", "big"], feeds)
        start = rss_bytes()
        for _ in range(40):
            (_, out) = s.run(["updated_cache", "big"], feeds)
            assert out.shape == (big,) and out[-1] == 1.0
        grown = rss_bytes() - start
    assert grown < 8 * 16 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB over 40 runs of a 16 MiB output"


def test_dlpack_data_ptr_through_ort_to_dlpacks_matches_data_ptr():
    """ORT hands each capsule over while the call lasts (to_dlpacks): read then, it is each output's pointer."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    with _session() as s:
        s.bind_cache("cache", cache)
        s.run(["updated_cache"], _feed())
        values = s._io_cache[1].get_outputs_as_ortvaluevector()
        via_dlpack = values.to_dlpacks(_ortkv.dlpack_data_ptr)
        assert via_dlpack == [values[i].data_ptr() for i in range(len(values))]
        assert via_dlpack[0] == cache.ctypes.data


# --- the post-run alias check, through the DLPack path -------------------------------------------------------------
class _MovedVector:
    """ORT's output vector with every output 64 bytes off (what a fresh buffer from ORT would look like)."""

    def __init__(self, real, arrays):
        self.real, self.arrays = real, arrays

    def to_dlpacks(self, read):
        return [read(a[16:].__dlpack__()) for a in self.arrays]  # 16 float32 = 64 bytes past each cache

    def __getitem__(self, i):
        return self.real[i]

    def __len__(self):
        return len(self.real)


def test_alias_error_through_the_dlpack_path(monkeypatch):
    cache = np.zeros((1, 2, 8, 4), np.float32)
    flat = cache.reshape(-1)
    with _session() as s:
        s.bind_cache("cache", cache)
        real = ort.IOBinding.get_outputs_as_ortvaluevector
        monkeypatch.setattr(ort.IOBinding, "get_outputs_as_ortvaluevector",
                            lambda io: _MovedVector(real(io), [flat]))
        with pytest.raises(ortkv.AliasError,
                           match=rf"output 'updated_cache' came back at 0x{cache.ctypes.data + 64:x} but its cache "
                                 rf"'cache' is at 0x{cache.ctypes.data:x}"):
            s.run(["updated_cache"], _feed())
        assert s._io_cache is None  # a run whose check failed leaves no plan to reuse
        monkeypatch.undo()
        before = digest(cache)
        (out,) = s.run(["updated_cache"], _feed(position=1, value=2.0))  # and the session still works
    assert out is cache and digest(cache) != before and cache[0, :, 1].sum() == 16


# --- OrtValue feeds bound once (Note [CPU decode feeds]) --------------------------------------------------------
def test_same_ortvalue_feed_is_reused_and_reads_its_new_contents():
    cache = np.zeros((1, 2, 8, 4), np.float32)
    pos = np.zeros((), np.int64)
    vals = np.ones((1, 2, 1, 4), np.float32)
    feeds = {"values": ort.OrtValue.ortvalue_from_numpy(vals), "position": ort.OrtValue.ortvalue_from_numpy(pos)}
    with _session() as s:
        s.bind_cache("cache", cache)
        for p in range(4):
            pos[...] = p  # written in place: the OrtValue wraps this memory
            vals[...] = p + 1
            s.run(["updated_cache"], feeds)
        plan = s._io_cache
        assert plan[7] == feeds  # both bound once, kept while the plan lives
    np.testing.assert_array_equal(cache[0, :, :4, 0], np.tile([1, 2, 3, 4], (2, 1)))
    assert cache[0, :, 4:].sum() == 0


def test_a_new_ortvalue_under_the_same_name_is_checked_again():
    """The shortcut is for the very object bound before: another OrtValue under that name is type-checked and
    overlap-checked as the first one was, and refused before the run (the cache untouched)."""
    cache = np.zeros((1, 2, 8, 4), np.float32)
    vals = ort.OrtValue.ortvalue_from_numpy(np.ones((1, 2, 1, 4), np.float32))
    with _session() as s:
        s.bind_cache("cache", cache)
        s.run(["updated_cache"], {"values": vals, "position": ort.OrtValue.ortvalue_from_numpy(np.array(0))})
        before = digest(cache)
        wrong = ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int32))
        with pytest.raises(ortkv.InputTypeError, match=r"input 'position' is int32 but the model declares int64"):
            s.run(["updated_cache"], {"values": vals, "position": wrong})
        assert digest(cache) == before
        inside = ort.OrtValue.ortvalue_from_numpy(cache.reshape(-1)[8:16].reshape(1, 2, 1, 4))  # the cache's bytes
        with pytest.raises(ortkv.BindingConflictError, match=r"feed 'values' .* overlaps cache 'cache'"):
            s.run(["updated_cache"], {"values": inside, "position": ort.OrtValue.ortvalue_from_numpy(np.array(2))})
        assert digest(cache) == before


# --- the overlap check by bisection --------------------------------------------------------------------------------
def test_feed_overlap_by_bisection_refuses_overlaps_and_allows_neighbours():
    buf = np.zeros(64 + 16, np.float32)
    cache = buf[:64].reshape(1, 2, 8, 4)
    with _session() as s:
        s.bind_cache("cache", cache)
        before = digest(cache)
        for start in (60, 0, 30):  # the last 4 floats, the first 4, the middle: each overlaps
            values = buf[start:start + 8].reshape(1, 2, 1, 4)
            with pytest.raises(ortkv.BindingConflictError,
                               match=rf"feed 'values' \[0x{values.ctypes.data:x}, 0x{values.ctypes.data + 32:x}\) on "
                                     r"cpu:0 overlaps cache 'cache'.*Nothing was run"):
                s.run(["updated_cache"], {"values": values, "position": np.array(0)})
            assert digest(cache) == before
        after = buf[64:72].reshape(1, 2, 1, 4)  # right after the cache's last byte: no overlap
        after[...] = 5
        s.run(["updated_cache"], {"values": after, "position": np.array(7)})
    assert cache[0, :, 7].sum() == 40 and digest(cache[:, :, :7]) == digest(np.zeros((1, 2, 7, 4), np.float32))


# --- the runner's CPU step: same logits as a plain session run, earlier logits kept -----------------------------------
@pytest.fixture(scope="module")
def slice_ortkv(tmp_path_factory):
    w, _ = weights.load(smollm2_gguf(), layers=2)
    root = tmp_path_factory.mktemp("slice_fast")
    onnx.save_model(builder.build(w, "ortkv", max_positions=256), str(root / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data")
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    return cfg.validate(), root / "model.onnx"


def test_runner_step_matches_a_plain_run_and_keeps_earlier_logits(slice_ortkv):
    cfg, path = slice_ortkv
    ids, steps = np.array([[504, 3575, 282, 4649, 314]]), [7042, 30, 198, 28]
    fast = OrtkvRunner(path, cfg)
    fast.start(1, 64)
    fast.prefill(ids, np.array([5]))
    got = [fast.step(np.array([t], np.int64)) for t in steps]
    kept = [g.copy() for g in got]
    plain = OrtkvRunner(path, cfg)  # the same steps through sess.run with numpy feeds, as before
    plain.start(1, 64)
    plain.prefill(ids, np.array([5]))
    for t, g, k in zip(steps, got, kept):
        (want,) = plain.sess.run(["logits"], {"input_ids": np.array([[t]], np.int64), "positions": plain.lengths})
        plain.lengths += 1
        np.testing.assert_array_equal(g, want[:, -1])  # bit for bit
        np.testing.assert_array_equal(g, k)  # a later step did not write into an earlier step's logits
    assert fast.sess._io_cache[7] == fast._cpu_step[3]  # the step's feeds were bound once
    assert fast.lengths is fast._cpu_step[0] and fast.lengths.tolist() == [5 + len(steps)]
    fast.close()
    plain.close()


def test_runner_step_refuses_non_int64_ids_by_name_and_changes_nothing(slice_ortkv):
    cfg, path = slice_ortkv
    cfg = copy.deepcopy(cfg)
    cfg.ortkv.cache = "dense"  # plain arrays: every byte can be read for the digest
    r = OrtkvRunner(path, cfg)
    r.start(1, 64)
    r.prefill(np.array([[504, 3575, 282]]), np.array([3]))
    r.step(np.array([30], np.int64))
    caches = [r.sess._owners[name] for name in r.sess.caches]
    before = [digest(c) for c in caches]
    with pytest.raises(ortkv.InputTypeError, match=r"input 'input_ids' is int32 but the model declares int64"):
        r.step(np.array([30], np.int32))
    assert [digest(c) for c in caches] == before
    assert r.lengths.tolist() == [4]
    r.close()


def test_rss_bytes_fast_is_rss_bytes():
    a = np.ones(1 << 22)  # 32 MiB touched
    x, y = rss_bytes(), rss_bytes_fast()
    assert abs(x - y) <= 1 << 20 and y > a.nbytes


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                mine = len(head) == 6 and head[5] == str(path)
            elif mine and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_populate_file_mappings_faults_the_mapped_pages_in(tmp_path):
    """Note [Weights resident at load]: pages of a file mapped read-only are resident only once touched;
    populate_file_mappings(dir) faults in every mapping of a file under dir and returns their bytes; files
    elsewhere and unmapped directories are left alone (0)."""
    from ortkv._memory import populate_file_mappings

    weights, other = tmp_path / "model" / "model.onnx.data", tmp_path / "other.bin"
    weights.parent.mkdir()
    size = 16 << 20
    weights.write_bytes(np.random.default_rng(0).bytes(size))
    other.write_bytes(np.random.default_rng(1).bytes(size))
    a = np.memmap(weights, dtype=np.uint8, mode="r")
    b = np.memmap(other, dtype=np.uint8, mode="r")
    try:
        assert _mapped_rss(weights) < size // 4 and _mapped_rss(other) < size // 4  # nothing touched yet
        assert populate_file_mappings(str(tmp_path / "nothing")) == 0
        assert populate_file_mappings(str(weights.parent)) >= size
        assert _mapped_rss(weights) >= size * 9 // 10
        assert _mapped_rss(other) < size // 4  # not under the directory
    finally:
        del a, b


# --- Note [Weights on huge pages] ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slice_linear(tmp_path_factory):
    """A 2-layer slice of the float32 CPU decoder as the model cache builds it: ortkv.Linear projections and LM head."""
    w, _ = weights.load(smollm2_gguf(), layers=2)
    root = tmp_path_factory.mktemp("slice_linear")
    onnx.save_model(builder.build(w, "ortkv", max_positions=256, linear=True), str(root / "model.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    return cfg.validate(), root / "model.onnx"


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_huge_page_weights_hold_the_files_bytes_for_ortkvs_in_place_ops(slice_linear):
    """HugePageWeights reads every external initializer that only ortkv ops or Gather consume, byte for byte, into
    one anonymous mapping (advised MADV_HUGEPAGE where the kernel has transparent huge pages); ORT's own ops'
    initializers are left to ORT."""
    from onnx import numpy_helper

    from ortkv._memory import HugePageWeights

    _, path = slice_linear
    w = HugePageWeights(str(path))
    full = onnx.load(str(path))  # with the external data
    by_name = {i.name: i for i in full.graph.initializer}
    proto = onnx.load(str(path), load_external_data=False)
    users: dict[str, set] = {}
    for n in proto.graph.node:
        for x in n.input:
            users.setdefault(x, set()).add((n.domain, n.op_type))
    external = {i.name for i in proto.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL}
    want = {n for n in external if users.get(n) and all(d == "ortkv" or t == "Gather" for d, t in users[n])}
    assert set(w.names) == want and len(want) >= 2 * 4 + 1  # per layer at least QKV, O, gate/up, down; the LM head
    base = np.frombuffer(w.mapping, np.uint8).ctypes.data
    for name, a in zip(w.names, w.arrays):
        np.testing.assert_array_equal(a, numpy_helper.to_array(by_name[name]))
        assert base <= a.ctypes.data and a.ctypes.data + a.nbytes <= base + len(w.mapping)  # one mapping
        assert a.ctypes.data % 64 == 0
    assert w.nbytes == sum(a.nbytes for a in w.arrays)
    assert w.huge or not _thp_available()  # madvise(MADV_HUGEPAGE) accepted wherever the kernel has THP


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_runner_on_huge_pages_gives_the_same_logits_and_does_not_map_the_file(slice_linear, monkeypatch):
    """The runner hands the weights to ORT as pre-allocated initializers: ORT reads them in place (it maps nothing of
    the weights file and keeps no copy of its own), and the logits are bit for bit those of ORT's own mapping."""
    cfg, path = slice_linear
    data = path.parent / "model.onnx.data"
    ids, steps = np.array([[504, 3575, 282, 4649, 314]]), [7042, 30, 198]

    def run(flag):
        monkeypatch.setenv("ORTKV_WEIGHTS_HUGE_PAGES", flag)
        r = OrtkvRunner(path, cfg)
        r.start(1, 64)
        out = [r.prefill(ids, np.array([5])).copy()] + [r.step(np.array([t], np.int64)).copy() for t in steps]
        mapped = _mapped_rss(data)
        held = getattr(r, "_huge_weights", None)
        r.close()
        return out, mapped, held

    huge, mapped_huge, held = run("1")
    plain, mapped_plain, none = run("0")
    for a, b in zip(huge, plain):
        np.testing.assert_array_equal(a, b)
    assert none is None and held is not None and held.nbytes > 0
    assert mapped_plain > 0  # ORT's own path: the weights file mapped (and made resident at load)
    # ORT still maps the file for the few initializers left to it (norm weights, small tables), never the big ones
    assert mapped_huge < held.nbytes // 8


def test_weights_huge_pages_variable_is_refused_by_name(slice_ortkv, monkeypatch):
    cfg, path = slice_ortkv
    monkeypatch.setenv("ORTKV_WEIGHTS_HUGE_PAGES", "yes")
    with pytest.raises(ortkv.OrtkvError, match=r"ORTKV_WEIGHTS_HUGE_PAGES='yes' is not 0 or 1; unset it"):
        OrtkvRunner(path, cfg)

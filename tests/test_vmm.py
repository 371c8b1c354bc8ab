"""ortkv.vmm: one suite over both backends (host memfd twin and CUDA VMM; CUDA skipped with a reason
where there is no GPU). Failure injection at every step checks that a failed commit leaves committed
bytes, budget in use and live mappings exactly as they were."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import ortkv
from conftest import cache_update_model, cached_session, run_bound
from ortkv import _ortkv
from ortkv._ortkv import _testing
from ortkv.vmm import (
    Arena,
    ArenaBusyError,
    ArenaKVCache,
    CacheGeometry,
    Governor,
    committed_bytes_for,
    cuda_available,
    evaluate_prefix_shareability,
    live_bytes,
    live_fragments,
)

BACKENDS = ["cpu", pytest.param("cuda:0", marks=pytest.mark.cuda)]


@pytest.fixture(params=BACKENDS)
def device(request):
    if request.param != "cpu":
        ok, why = cuda_available()
        if not ok:
            pytest.skip(f"CUDA VMM unavailable: {why}")
    return request.param


# --- moving bytes in and out of views, whatever the backend ------------------------------------
def fill(view, value):
    if isinstance(view, np.ndarray):
        view[...] = value
    else:
        import cupy

        cupy.asarray(view).fill(value)
        cupy.cuda.runtime.deviceSynchronize()


def read(view, index=Ellipsis) -> np.ndarray:
    """Copy view[index] to the host (touching only those elements: the rest may be uncommitted)."""
    if isinstance(view, np.ndarray):
        return np.array(view[index])
    import cupy

    return cupy.asnumpy(cupy.asarray(view)[index])


@pytest.fixture(autouse=True)
def _collected():
    """live_mappings() is process-wide: an arena whose close was deferred by a view that an earlier
    test left in a reference cycle (pytest's ExceptionInfo holds the test's frame) is freed first."""
    gc.collect()


def mappings(device) -> int:
    return _ortkv.live_mappings(_ortkv.DEVICE_CPU if device == "cpu" else _ortkv.DEVICE_CUDA)


def snapshot(arena, gov, device):
    return (arena.committed_bytes, gov.in_use, arena.live_mappings, mappings(device))


# --- basics -------------------------------------------------------------------------------------
def test_granule_is_queried(device):
    with Arena(1 << 26, device) as a:
        if device == "cpu":
            assert a.granule == os.sysconf("SC_PAGE_SIZE")
        else:
            assert a.granule >= 1 << 16 and a.granule & (a.granule - 1) == 0
        assert a.reserved_bytes % a.granule == 0 and a.committed_bytes == 0


def test_commit_grows_in_place(device):
    gov = Governor(1 << 30)
    with Arena(64 * 4 << 20, device, gov) as a:
        g, base = a.granule, a.base
        assert a.commit(1) == g and a.committed_bytes == g
        assert a.commit(g) == 0  # already committed granules are kept
        assert a.commit(g + 2, offset=g - 1) == 2 * g  # [g-1, 2g+1) overlaps granules 0, 1 and 2
        assert a.committed_bytes == 3 * g == gov.in_use
        view = a.view(np.float32, (3 * g // 4,))
        fill(view, 7)
        assert a.commit(2 * g, offset=3 * g) == 2 * g  # grow: same base, old bytes untouched
        assert a.base == base and (read(view) == 7).all()
        assert gov.in_use == 5 * g and a.is_committed(0, 5 * g) and not a.is_committed(0, 6 * g)


def test_commit_past_reservation_refused(device):
    with Arena(1 << 20, device) as a:
        before = a.committed_bytes
        with pytest.raises(ortkv.CapacityError) as info:
            a.commit(a.reserved_bytes + 1)
        assert info.value.requested == a.reserved_bytes + 1 and info.value.capacity == a.reserved_bytes
        assert "reserve a larger arena" in str(info.value) and a.committed_bytes == before


def test_governor_backpressure(device):
    probe = Arena(1 << 22, device)
    g = probe.granule
    probe.close()
    gov = Governor(3 * g)
    with Arena(16 * g, device, gov) as a, Arena(16 * g, device, gov) as b:
        a.commit(2 * g)
        before = snapshot(b, gov, device)
        with pytest.raises(ortkv.CapacityError) as info:
            b.commit(2 * g)
        e = info.value
        assert (e.requested, e.budget, e.in_use) == (2 * g, 3 * g, 2 * g) and e.retry_hint
        assert f"budget {3 * g}, in use {2 * g}" in str(e)
        assert snapshot(b, gov, device) == before
        a.release()  # backpressure lifts once memory comes back
        assert b.commit(2 * g) == 2 * g and gov.in_use == 2 * g


# --- lifetime (both backends; the host's misuse cases are in test_vmm_lifetime.py) --------------------
def test_refused_reservation_raises_on_every_backend(device):
    """Arena::Create used to deadlock on its own lock when the reservation failed: run it in a child."""
    code = (f"import ortkv; from ortkv.vmm import Arena\ntry:\n    Arena(2**63, {device!r})\n"
            "except ortkv.CapacityError as e:\n    print('refused', e.requested, 'reservation' in str(e))\n"
            f"print('next', Arena(1 << 22, {device!r}).reserved_bytes >= 1 << 22)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"refused {2**63} True", "next True"]


def test_close_and_release_refuse_while_a_view_is_alive(device):
    gov = Governor(1 << 30)
    a = Arena(1 << 24, device, gov)
    g = a.granule
    a.commit(g)
    view = a.view(np.uint8, (g,))
    fill(view, 6)
    for op in ("release", "close"):
        with pytest.raises(ArenaBusyError, match=rf"Arena.{op}: 1 export\(s\).*view uint8\[{g}\] at offset 0"):
            getattr(a, op)()
    assert not a.closed and a.committed_bytes == g and gov.in_use == g and (read(view) == 6).all()
    del view
    a.close()
    assert a.closed and gov.in_use == 0


# --- transactions ---------------------------------------------------------------------------------
# Every step of a commit of three runs; countdown k fails the step of run k (the grant happens once).
STEPS = [("grant", 0)] + [(op, k) for op in ("create", "map", "set_access") for k in range(3)]


@pytest.mark.parametrize("op,countdown", STEPS)
def test_failed_commit_rolls_back_exactly(device, op, countdown):
    gov = Governor(1 << 34)
    with Arena(1 << 26, device, gov) as a:
        g = a.granule
        a.commit(g, offset=g)  # granules 1 and 3 committed: committing [0, 5g) needs runs 0, 2, 4
        a.commit(g, offset=3 * g)
        keep = a.view(np.uint8, (g,), offset=g)
        fill(keep, 42)
        before = snapshot(a, gov, device)
        _testing.inject_fault(a._native, op, countdown)
        with pytest.raises(ortkv.OrtkvError, match=rf"injected failure at {op}"):
            a.commit(5 * g)
        assert snapshot(a, gov, device) == before
        assert (read(keep) == 42).all()
        assert a.commit(5 * g) == 3 * g and a.committed_bytes == 5 * g


def test_failed_unmap_in_rollback_stays_mapped(device):
    gov = Governor(1 << 34)
    with Arena(1 << 26, device, gov) as a:
        g = a.granule
        a.commit(g, offset=g)
        before = snapshot(a, gov, device)
        _testing.inject_fault(a._native, "set_access", 1)  # the 2nd run fails after it was mapped ...
        _testing.inject_fault(a._native, "unmap", 0)  # ... and undoing it fails too
        with pytest.raises(ortkv.OrtkvError, match=r"an unmap failed: that run stays mapped"):
            a.commit(3 * g)
        # The run whose unmap failed is recorded as mapped and billed (never freed); the other was undone.
        assert a.committed_bytes == before[0] + g and gov.in_use == before[1] + g
        assert a.live_mappings == before[2] + 1


def test_failed_unmap_in_release_keeps_block(device):
    gov = Governor(1 << 34)
    with Arena(1 << 26, device, gov) as a:
        g = a.granule
        a.commit(g, offset=0)
        a.commit(g, offset=2 * g)
        _testing.inject_fault(a._native, "unmap", 0)  # release walks in reverse: the block at 2g fails
        with pytest.raises(ortkv.OrtkvError, match=r"injected failure at unmap"):
            a.release()
        assert a.committed_bytes == g and gov.in_use == g and a.is_committed(2 * g, g)
        a.release()
        assert a.committed_bytes == 0 and gov.in_use == 0


def test_release_keeps_the_range_and_reuses_addresses(device):
    gov = Governor(1 << 34)
    a = Arena(1 << 24, device, gov)
    base, g = a.base, a.granule
    a.commit(3 * g)
    a.release()
    assert (a.base, a.committed_bytes, gov.in_use, a.live_mappings) == (base, 0, 0, 0)
    a.commit(g)
    view = a.view(np.float32, (g // 4,))
    fill(view, 1.5)
    assert a.base == base and (read(view) == 1.5).all()
    m = mappings(device)
    del view  # close() refuses while a view is alive (Note [Arena exports])
    a.close()
    assert a.closed and gov.in_use == 0 and mappings(device) == m - 1


def test_teardown_sync_failure_quarantines(device):
    gov = Governor(1 << 34)
    a = Arena(1 << 24, device, gov)
    a.commit(2 * a.granule)
    before = snapshot(a, gov, device)
    _testing.inject_fault(a._native, "synchronize", 0)
    import ortkv.vmm as vmm_mod

    vmm_mod._warned_quarantine = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.close()
    assert a.closed and a.quarantined
    assert [str(w.message) for w in caught if "quarantined" in str(w.message)]
    # kept: range, handles, mappings; counted as neither free nor reusable
    assert snapshot(a, gov, device)[1:] == before[1:] and gov.quarantined == 2 * a.granule


# --- shared prefixes --------------------------------------------------------------------------------
def test_shared_prefix_same_memory_billed_once_refcounted(device):
    gov = Governor(1 << 34)
    owner = Arena(1 << 24, device, gov)
    g = owner.granule
    owner.commit(4 * g)
    data = owner.view(np.float32, (g,))  # 4 bytes x g = the first 4 granules
    fill(data, 3.0)
    billed = gov.in_use
    sharer = owner.map_shared_prefix(2 * g)
    assert sharer.read_only and sharer.base != owner.base and sharer.billed_bytes == 0 and gov.in_use == billed
    view = sharer.view(np.float32, (2 * g // 4,))
    assert (read(view) == 3.0).all()
    fill(data, 5.0)  # writes through the owner are visible through the sharer: same physical memory
    assert (read(view) == 5.0).all()
    with pytest.raises(ortkv.OrtkvError, match=r"read-only shared prefix cannot commit"):
        sharer.commit(g)
    del data  # close() refuses while a view is alive (Note [Arena exports])
    owner.close()  # the sharer keeps its granules alive
    # The host commits one handle for the run of 4 granules (still half mapped: all 4 stay billed);
    # CUDA maps whole handles only, so it made one per granule and the 2 unshared ones came back.
    assert (read(view) == 5.0).all() and gov.in_use == (4 * g if device == "cpu" else 2 * g)
    m, mine = mappings(device), sharer.live_mappings
    del view
    sharer.close()
    assert gov.in_use == 0 and mappings(device) == m - mine


def test_shared_prefix_must_be_committed(device):
    with Arena(1 << 24, device) as a:
        a.commit(a.granule)
        with pytest.raises(ortkv.OrtkvError, match=r"is not fully committed"):
            a.map_shared_prefix(2 * a.granule)


def test_shared_prefix_set_access_failure_undoes_that_mapping_only(device):
    gov = Governor(1 << 34)
    with Arena(1 << 24, device, gov) as owner:
        g = owner.granule
        owner.commit(g)
        owner.commit(g, offset=g)  # two handles
        view = owner.view(np.uint8, (2 * g,))
        fill(view, 9)
        before = snapshot(owner, gov, device)
        _testing.inject_fault(owner._native, "set_access", 1)  # the sharer's 2nd mapping
        with pytest.raises(ortkv.OrtkvError, match=r"map_shared_prefix failed and was undone"):
            owner.map_shared_prefix(2 * g)
        assert snapshot(owner, gov, device) == before and (read(view) == 9).all()
        fill(view, 10)  # the owner's handles stayed and are still writable
        assert (read(view) == 10).all()
        sharer = owner.map_shared_prefix(2 * g)  # and sharing works afterwards
        assert (read(sharer.view(np.uint8, (2 * g,))) == 10).all()
        sharer.close()


def test_host_read_only_prefix_refused_by_hardware():
    """A store through the sharer's mapping is refused by the MMU: the writing process dies of SIGSEGV."""
    code = ("import ctypes, numpy as np; from ortkv.vmm import Arena; a = Arena(1 << 20); a.commit(4096); "
            "s = a.map_shared_prefix(4096); v = s.view(np.uint8, (4096,)); assert not v.flags.writeable; "
            "print('ready', flush=True); ctypes.memset(s.base, 1, 1)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ready" and out.returncode == -11


@pytest.mark.cuda
def test_cuda_read_only_prefix_refused_by_the_driver():
    ok, why = cuda_available()
    if not ok:
        pytest.skip(why)
    cuda = ctypes.CDLL("libcuda.so.1")
    with Arena(1 << 26, "cuda:0") as owner:
        owner.commit(owner.granule)
        fill(owner.view(np.uint8, (owner.granule,)), 4)
        sharer = owner.map_shared_prefix(owner.granule)
        rc = cuda.cuMemsetD8_v2(ctypes.c_uint64(sharer.base), ctypes.c_ubyte(1), ctypes.c_size_t(16))
        assert rc == 1  # CUDA_ERROR_INVALID_VALUE: nothing written, the context stays usable
        assert (read(sharer.view(np.uint8, (16,))) == 4).all()
        sharer.close()


def test_kernel_refuses_to_write_read_only_prefix():
    """CacheUpdate checks before writing: a read-only shared prefix is never written."""
    with Arena(1 << 20) as owner:
        owner.commit(4096)
        cache = owner.view(np.float32, (1, 2, 8, 4))
        cache[...] = 1
        sharer = owner.map_shared_prefix(4096)
        shared = sharer.view(np.float32, (1, 2, 8, 4))
        before = shared.copy()
        with pytest.raises(RuntimeError, match=r"E_READONLY.*'read-only shared prefix'"):
            run_bound(cached_session(1, 4, -2, False), shared, np.zeros((1, 2, 1, 4), np.float32), 0, 1)
        np.testing.assert_array_equal(shared, before)
        with pytest.raises(ortkv.ImmutableStorageError):
            ortkv.MutableCacheSession(cache_update_model()).bind_cache("cache", shared)
        del shared
        sharer.close()


# --- a dense cache on an arena through MutableCacheSession -------------------------------------------
def test_dense_cache_grows_by_commit_without_moving(device):
    providers = ["CPUExecutionProvider"] if device == "cpu" else ["CUDAExecutionProvider"]
    geom = CacheGeometry(layers=1, kv_heads=4, head_size=64, capacity=65536, batch=1, dtype_bytes=4)  # 2 x 64 MiB
    with ArenaKVCache(geom, "BSNH", device, Governor(1 << 30), dtype=np.float32, chunk_tokens=1) as kv:
        key = kv.key(0)
        s = ortkv.MutableCacheSession(cache_update_model(seq_axis=1), providers=providers)
        s.bind_cache("cache", key)
        ptr = kv.arena.base
        granule = kv.arena.granule
        for pos in range(0, 300, 3):
            kv.ensure(pos + 3)
            s.run(["updated_cache"], {"values": np.full((1, 3, 4, 64), pos, np.float32), "position": np.array(pos)})
            assert kv.arena.base == ptr
            assert kv.committed_bytes == committed_bytes_for("BSNH", geom, pos + 3, granule)
        assert kv.committed_bytes < geom.total_bytes // 4  # follows the tokens, not the capacity
        got = read(key, (0, slice(0, 300), 0, 0))
        np.testing.assert_array_equal(got, np.repeat(np.arange(0, 300, 3), 3).astype(np.float32))
        # Writing past the committed tokens is refused before the kernel touches unmapped memory.
        far = geom.capacity - 1  # the last token: its granule is not committed
        with pytest.raises(ortkv.CapacityError, match=r"uncommitted.*Arena.commit"):
            s.run(None, {"values": np.ones((1, 1, 4, 64), np.float32), "position": np.array(far)})
        s.close()


def test_cache_commits_ahead_in_chunks_in_one_transaction(device):
    geom = CacheGeometry(layers=2, kv_heads=2, head_size=64, capacity=8192, batch=2, dtype_bytes=4)
    gov = Governor(1 << 30)
    with ArenaKVCache(geom, "BSNH", device, gov, dtype=np.float32, chunk_tokens=64) as kv:
        g = kv.arena.granule
        first = kv.ensure(1)
        assert first == committed_bytes_for("BSNH", geom, 64, g) and kv.committed_tokens == 64
        assert kv.ensure(50) == 0 and kv.ensure(64) == 0  # inside the chunk: nothing to do
        assert kv.ensure(65) == committed_bytes_for("BSNH", geom, 128, g) - first
        assert gov.in_use == kv.committed_bytes
        # one transaction: a refused grant leaves every tensor as it was
        small = Governor(kv.committed_bytes)
        with ArenaKVCache(geom, "BSNH", device, small, dtype=np.float32, chunk_tokens=64) as kv2:
            kv2.ensure(1)
            with pytest.raises(ortkv.CapacityError):
                kv2.ensure(geom.capacity)  # more than one granule per row on either backend
            assert kv2.committed_tokens == 64 and kv2.committed_bytes == small.in_use


# --- layouts and shareability (hand-computed) -----------------------------------------------------------
GEOM = CacheGeometry(layers=1, kv_heads=2, head_size=4, capacity=1024, batch=1, dtype_bytes=2)


def test_layout_calculator_hand_computed():
    # tensor = 1 x 2 x 1024 x 4 x 2 bytes = 16384; K at 0, V at 16384
    assert live_fragments("BSNH", GEOM, 100) == [(0, 1600), (16384, 1600)]
    assert committed_bytes_for("BSNH", GEOM, 100, 4096) == 8192
    assert live_fragments("BNSH", GEOM, 100) == [(0, 800), (8192, 800), (16384, 800), (24576, 800)]
    assert committed_bytes_for("BNSH", GEOM, 100, 4096) == 16384
    assert live_fragments("token-major", GEOM, 100) == [(0, 3200)]
    assert committed_bytes_for("token-major", GEOM, 100, 4096) == 4096
    assert committed_bytes_for("token-major", GEOM, 1024, 4096) == GEOM.total_bytes == 32768
    assert live_bytes(GEOM, 100) == 3200
    assert committed_bytes_for("BNSH", GEOM, 0, 4096) == 0


def test_prefix_shareability():
    bnsh = evaluate_prefix_shareability("BNSH", GEOM, 100, 4096)
    assert not bnsh.shareable and bnsh.fragments == 4 and bnsh.fragment_bytes == 800
    assert "cover at least one whole 4096-byte granule" in bnsh.reason and ">= 512 tokens" in bnsh.reason
    tm = evaluate_prefix_shareability("token-major", GEOM, 1000, 4096)
    assert tm.shareable and tm.map_operations == 1 and tm.shareable_granules_per_fragment == 7
    bsnh = evaluate_prefix_shareability("BSNH", GEOM, 1000, 4096)  # 16000-byte runs at 0 and 16384
    assert bsnh.shareable and bsnh.map_operations == 2 and bsnh.shareable_granules_per_fragment == 3
    assert not evaluate_prefix_shareability("BSNH", GEOM, 100, 4096).shareable


def test_bad_inputs_are_named():
    with pytest.raises(ortkv.OrtkvError, match=r"device must be 'cpu' or 'cuda:N'"):
        Arena(1 << 20, "tpu")
    with pytest.raises(ortkv.OrtkvError, match=r"unknown layout"):
        live_fragments("NHWC", GEOM, 1)
    with pytest.raises(ortkv.OrtkvError, match=r"valid_len 2000 is outside"):
        live_fragments("BSNH", GEOM, 2000)

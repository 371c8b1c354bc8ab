"""ortkv.vmm under misuse: refused reservations, views and sessions that outlive their arena
(Note [Arena exports]), kernels racing release() (Note [Arena lease]), the memfd free list, 64-bit
overflow and the arena's argument errors. Repros that could hang or kill the process run in a
subprocess with a timeout. Host backend only (the CUDA backend shares the Arena code paths)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ortkv
from conftest import cache_update_model
from ortkv import _ortkv
from ortkv.errors import CacheInputError
from ortkv.vmm import Arena, ArenaBusyError, ArenaError, ArenaKVCache, CacheGeometry, Governor

TESTS = os.path.dirname(os.path.abspath(__file__))
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collected():
    gc.collect()  # arenas whose close an earlier test deferred (views held by pytest's tracebacks)


def run_py(code: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (tests/ on sys.path); a hang shows as returncode None."""
    prelude = f"import sys; sys.path.insert(0, {TESTS!r})\n"
    try:
        return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, None, exc.stdout or "", f"TIMEOUT after {timeout}s")


def live() -> int:
    return _ortkv.live_mappings(_ortkv.DEVICE_CPU)


# --- 1. a refused reservation raises (it used to deadlock) ------------------------------------------
def test_refused_reservation_raises_capacity_error():
    out = run_py("""
        import ortkv
        from ortkv.vmm import Arena, Governor
        gov = Governor(1 << 30)
        for size in (2**63, 2**64 - 1):
            try:
                Arena(size, governor=gov)
            except ortkv.CapacityError as e:
                print(type(e).__name__, e.requested, gov.in_use, "reservation" in str(e) or "rounded" in str(e))
        from ortkv.vmm import ArenaKVCache, CacheGeometry  # a genai_config max_length of 4e9
        try:
            ArenaKVCache(CacheGeometry(layers=30, kv_heads=3, head_size=64, capacity=4_000_000_000, dtype_bytes=4),
                         dtype="float32")
        except ortkv.CapacityError as e:
            print("kv", e.requested == 2 * 30 * 3 * 64 * 4 * 4_000_000_000)
        a = Arena(1 << 20)  # the global arena lock was released: the next arena works
        print("ok", a.commit(1) > 0)
    """, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == [f"CapacityError {2**63} 0 True", f"CapacityError {2**64 - 1} 0 True",
                                          "kv True", "ok True"]


def test_reservation_refused_under_ulimit_v_and_for_a_shared_prefix():
    out = run_py("""
        import resource, ortkv
        from ortkv.vmm import Arena
        owner = Arena(8 << 20)
        owner.commit(4 << 20)
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), resource.RLIM_INFINITY))
        for what in ("arena", "prefix"):
            try:
                Arena(1 << 24) if what == "arena" else owner.map_shared_prefix(4 << 20)
            except ortkv.CapacityError as e:
                print(what, e.requested, "ulimit -v" in str(e))
        print("owner intact", owner.committed_bytes, owner.live_mappings)
    """, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [f"arena {1 << 24} True", f"prefix {4 << 20} True",
                                          f"owner intact {4 << 20} 1"]


# --- 2. views and sessions outliving close()/release() ----------------------------------------------
def test_close_refuses_while_a_view_is_alive():
    gov = Governor(1 << 30)
    a = Arena(1 << 20, governor=gov)
    a.commit(2 * PAGE)
    v = a.view(np.float32, (4, 8), offset=PAGE)
    v[...] = 7
    derived = v[1:]  # numpy keeps the view's holder as .base: a slice counts as the view
    del v
    before = (a.committed_bytes, gov.in_use, a.live_mappings)
    with pytest.raises(ArenaBusyError) as info:
        a.close()
    assert isinstance(info.value, BufferError) and isinstance(info.value, ortkv.OrtkvError)
    msg = str(info.value)
    assert "Arena.close: 1 export(s)" in msg and f"0x{a.base:x} (+{a.reserved_bytes} bytes)" in msg
    assert "view float32[4, 8] at offset 4096" in msg.replace(str(PAGE), "4096") and "del" in msg
    assert not a.closed and (a.committed_bytes, gov.in_use, a.live_mappings) == before
    assert (derived == 7).all()
    assert a.commit(PAGE, offset=2 * PAGE) == PAGE  # still fully usable
    del derived
    a.close()
    assert a.closed and gov.in_use == 0 and a.exports == []


def test_release_refuses_while_a_view_is_alive():
    gov = Governor(1 << 30)
    a = Arena(1 << 20, governor=gov)
    a.commit(PAGE)
    v = a.view(np.uint8, (PAGE,))
    v[...] = 3
    with pytest.raises(ArenaBusyError, match=r"Arena.release: 1 export\(s\).*view uint8\[4096\] at offset 0"):
        a.release()
    assert a.committed_bytes == PAGE and gov.in_use == PAGE and (v == 3).all()
    del v
    a.release()
    assert a.committed_bytes == 0 and gov.in_use == 0
    a.close()


def test_view_read_after_with_block_and_release_does_not_kill_the_process():
    out = run_py("""
        import numpy as np
        from ortkv import _ortkv
        from ortkv.vmm import Arena, Governor
        gov = Governor(1 << 30)
        with Arena(1 << 20, governor=gov) as a:   # the README's pattern
            a.commit(4096)
            cache = a.view(np.float32, (1024,))
            cache[...] = 7
        print("closed", a.closed, float(cache.sum()))  # readable after the block (it was SIGSEGV)
        try:
            a.release()
        except Exception as e:
            print("release", type(e).__name__)
        b = Arena(1 << 20, governor=gov)  # cannot get a's addresses while `cache` lives
        b.commit(4096)
        fresh = b.view(np.float32, (1024,))
        fresh[...] = 0
        cache[...] = 5  # a stale write lands in a's memory, never in b's
        print("isolated", a.base != b.base, float(fresh.sum()), float(cache.sum()))
        del cache
        print("freed", gov.in_use, a.live_mappings, a.exports)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["closed True 7168.0", "release ArenaError",
                                          "isolated True 0.0 5120.0", "freed 4096 0 []"]


def test_with_block_defers_the_free_until_the_last_view_is_gone():
    gov = Governor(1 << 30)
    m = live()
    with Arena(1 << 20, governor=gov) as a:
        a.commit(3 * PAGE)
        keep = a.view(np.uint8, (PAGE,), offset=PAGE)
        keep[...] = 11
    assert a.closed and "closing" in repr(a) and gov.in_use == 3 * PAGE and live() == m + 1
    for op in (lambda: a.commit(PAGE), lambda: a.view(np.uint8, (1,)), lambda: a.map_shared_prefix(PAGE)):
        with pytest.raises(ArenaError, match=r"closed"):
            op()
    with pytest.raises(ArenaBusyError):
        a.close()  # an explicit close still refuses while `keep` lives
    assert (keep == 11).all()
    del keep
    assert gov.in_use == 0 and live() == m and a.exports == []
    # The same through ArenaKVCache: a held key view neither raises at __exit__ nor dangles.
    geom = CacheGeometry(layers=1, kv_heads=1, head_size=16, capacity=256, dtype_bytes=4)
    with ArenaKVCache(geom, "BSNH", "cpu", gov, dtype=np.float32) as kv:
        kv.ensure(1)
        key = kv.key(0)
        key[0, 0] = 1.5
    assert kv.arena.closed and gov.in_use > 0 and key[0, 0, 0, 0] == 1.5
    del key
    assert gov.in_use == 0


def test_close_refuses_while_a_session_is_bound_and_bind_refuses_a_closed_arena():
    gov = Governor(1 << 30)
    a = Arena(1 << 20, governor=gov)
    a.commit(PAGE)
    s = ortkv.MutableCacheSession(cache_update_model())
    cache = a.view(np.float32, (1, 2, 8, 4))
    cache[...] = 1
    s.bind_cache("cache", cache)
    del cache  # the session's binding alone keeps the arena busy
    with pytest.raises(ArenaBusyError, match=rf"cache 'cache' of session #{s._id}"):
        a.close()
    with pytest.raises(ArenaBusyError, match=rf"cache 'cache' of session #{s._id}"):
        a.release()
    assert not a.closed and a.committed_bytes == PAGE and gov.in_use == PAGE
    s.run(["updated_cache"], {"values": np.full((1, 2, 1, 4), 9, np.float32), "position": np.array(3)})
    s.unbind_cache("cache")
    assert a.exports == []
    with a:
        stale = a.view(np.float32, (1, 2, 8, 4))
    assert (stale[0, :, 3] == 9).all() and (stale[0, :, 2] == 1).all()
    s2 = ortkv.MutableCacheSession(cache_update_model())
    with pytest.raises(ArenaError, match=r"cache 'cache' of session #\d+: the arena 0x[0-9a-f]+ .* is closed"):
        s2.bind_cache("cache", stale)  # the arena is closing: binding it would outlive the free
    assert s2.caches == ["cache"] and not s2._bindings and len(a.exports) == 1
    del stale
    assert a._native.closed and gov.in_use == 0
    s.close()
    s2.close()


def test_rebind_and_session_close_return_their_leases():
    a = Arena(1 << 20)
    a.commit(2 * PAGE)
    s = ortkv.MutableCacheSession(cache_update_model())
    s.bind_cache("cache", a.view(np.float32, (1, 2, 8, 4)))
    s.bind_cache("cache", a.view(np.float32, (1, 2, 8, 4), offset=PAGE))  # the first binding's lease goes
    assert [e for e in a.exports if e.startswith("cache")] == [f"cache 'cache' of session #{s._id}"]
    s.close()
    gc.collect()
    assert a.exports == []
    a.close()


def test_bind_and_run_racing_close_never_crash():
    out = run_py("""
        import threading, time, numpy as np, ortkv
        from conftest import cache_update_model
        from ortkv.vmm import Arena
        a = Arena(1 << 24)
        a.commit(1 << 24)
        s = ortkv.MutableCacheSession(cache_update_model())
        vals = np.ones((1, 64, 1024, 64), np.float32)  # 16 MiB per run: slow enough to overlap
        runs, refusals = [0], [0]
        def worker():
            while True:
                try:
                    s.bind_cache("cache", a.view(np.float32, (1, 64, 1024, 64)))
                except ortkv.OrtkvError as e:
                    assert type(e).__name__ == "ArenaError", e
                    return  # closed: nothing bound
                s.run(["updated_cache"], {"values": vals, "position": np.array(0)})
                s.unbind_cache("cache")
                runs[0] += 1
                time.sleep(0.001)  # a window with nothing bound, so that close() can succeed
        t = threading.Thread(target=worker)
        t.start()
        while runs[0] < 2:  # close while the worker binds and runs
            time.sleep(0.001)
        while True:
            try:
                a.close()
                break
            except BufferError:
                refusals[0] += 1
        t.join()
        print("done", a.closed, a._native.closed, s._bindings == {})
    """, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done True True True"


# --- 8. the kernels' lease: release()/close() wait for a kernel between its check and its write -----
def test_release_waits_for_the_kernel_lease():
    from ortkv._ortkv import _testing

    a = Arena(1 << 20)
    a.commit(PAGE)
    _testing.lease_acquire()  # what CacheUpdate holds around check + write
    done = threading.Event()
    t = threading.Thread(target=lambda: (a._native.release(), done.set()))
    t.start()
    try:  # (no arena call here: the blocked release holds the arena lock, and we hold the lease)
        assert not done.wait(0.3)  # blocked: nothing unmapped while a kernel holds the lease
    finally:
        _testing.lease_release()
    assert done.wait(10) and a.committed_bytes == 0
    t.join()
    a.close()


def test_kernel_racing_raw_release_is_refused_or_completes():
    """A raw-ORT user (no MutableCacheSession: no Python lease) writes arena memory while another
    thread releases it: the write either finishes before the unmap or is refused (E_UNCOMMITTED);
    it never stores into unmapped pages."""
    out = run_py("""
        import threading, time, numpy as np
        from conftest import cached_session, run_bound
        from ortkv.vmm import Arena
        sess = cached_session(1, 4, -2, False)
        n = 1 << 23  # 32 MiB of float32
        vals = np.ones((1, 8, 1 << 16, 16), np.float32)
        refused = 0
        for i in range(12):
            a = Arena(4 * n)
            a.commit(4 * n)
            cache = a.view(np.float32, (1, 8, 1 << 16, 16))  # run_bound binds its raw pointer
            t = threading.Thread(target=lambda: (time.sleep(0.001 * (i % 6)), a._native.release()))
            t.start()
            try:
                run_bound(sess, cache, vals, 0, 1)
            except Exception as e:
                assert "E_UNCOMMITTED" in str(e), e
                refused += 1
            t.join()
            del cache
            a._native.close()
        print("survived", refused >= 0)
    """, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "survived True"


# --- 8. the host memfd reuses released file ranges ----------------------------------------------------
def _memfds() -> dict[int, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:ortkv-vmm"):
            fds[int(fd)] = target
    return fds


def test_memfd_size_stays_bounded_over_commit_release_cycles():
    a = Arena(64 * PAGE)
    before = set(_memfds())
    a.commit(PAGE)
    (fd,) = set(_memfds()) - before
    for cycle in range(200):
        a.commit(PAGE * (1 + cycle % 5), offset=PAGE * (cycle % 7))
        a.commit(PAGE, offset=PAGE * (20 + cycle % 11))
        assert os.fstat(fd).st_size <= 16 * PAGE, cycle
        a.release()
    assert os.fstat(fd).st_size == 0  # everything released: the file is cut back
    a.close()


def test_memfd_reuse_never_aliases_a_sharers_pages():
    owner = Arena(64 * PAGE)
    owner.commit(2 * PAGE)
    v = owner.view(np.uint8, (2 * PAGE,))
    v[...] = 4
    del v
    sharer = owner.map_shared_prefix(2 * PAGE)  # keeps the owner's first handle alive
    owner.release()
    for _ in range(3):  # new handles must not reuse the sharer's file range
        owner.commit(4 * PAGE)
        w = owner.view(np.uint8, (4 * PAGE,))
        w[...] = 9
        del w
        owner.release()
    shared = sharer.view(np.uint8, (2 * PAGE,))
    assert (shared == 4).all()
    del shared
    sharer.close()
    owner.close()


# --- 8. 64-bit overflow and argument errors ------------------------------------------------------------
def test_ranges_near_2_pow_64_are_refused_with_numbers():
    a = Arena(1 << 20)
    a.commit(PAGE)
    with pytest.raises(ArenaError, match=rf"\[{PAGE}, {2**64}\) exceeds the {1 << 20} reserved bytes"):
        a.is_committed(PAGE, 2**64 - PAGE)  # offset + nbytes wrapped to 0: it said True
    with pytest.raises(ortkv.CapacityError) as info:
        a.commit_many([(2**64 - 1, 1)])
    assert info.value.requested == 2**64 and info.value.capacity == a.reserved_bytes
    assert f"[{2**64 - 1}, {2**64})" in str(info.value)
    with pytest.raises(ArenaError, match=r"Arena.commit: offset must be in \[0, 2\*\*64\), got 18446744073709551616"):
        a.commit(1, offset=2**64)
    with pytest.raises(ArenaError, match=r"offset of range 1 must be in \[0, 2\*\*64\)"):
        a.commit_many([(0, 1), (-1, 1)])
    assert a.committed_bytes == PAGE and a.is_committed(0, PAGE) and not a.is_committed(0, PAGE + 1)
    a.close()


def test_arena_argument_errors_are_arena_errors():
    a = Arena(1 << 20)
    a.commit(PAGE)
    cases = [(lambda: a.map_shared_prefix(0), rf"nbytes must be in \[1, {1 << 20}\]"),
             (lambda: a.map_shared_prefix(2 * PAGE), rf"prefix \[0, {2 * PAGE}\) is not fully committed"),
             (lambda: Arena(0), r"reserve_bytes must be > 0, got 0"),
             (lambda: Arena(-5), r"reserve_bytes must be in \[0, 2\*\*64\), got -5"),
             (lambda: Arena(1 << 20, device=0), r"device must be 'cpu' or 'cuda:N', got int 0"),
             (lambda: Governor(-1), r"budget_bytes must be in \[0, 2\*\*64\), got -1")]
    for fn, pattern in cases:
        with pytest.raises(ArenaError, match=pattern) as info:
            fn()
        assert isinstance(info.value, ValueError) and not isinstance(info.value, CacheInputError)
    sharer = a.map_shared_prefix(PAGE)
    with pytest.raises(ArenaError, match=r"read-only shared prefix cannot commit"):
        sharer.commit(PAGE)
    sharer.close()
    a.close()
    with pytest.raises(ArenaError, match=r"Arena.commit: the arena is closed"):
        a.commit(PAGE)
    assert a.committed_bytes == 0


def test_fault_injection_is_not_public():
    from ortkv._ortkv import _testing

    assert not hasattr(_ortkv.Arena, "inject_fault") and not hasattr(Arena, "inject_fault")
    with Arena(1 << 20) as a:
        _testing.inject_fault(a._native, "grant")
        with pytest.raises(ortkv.OrtkvError, match=r"injected failure at grant"):
            a.commit(PAGE)
        assert a.committed_bytes == 0

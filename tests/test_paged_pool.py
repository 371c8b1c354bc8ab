"""ortkv.paged: the page pool on one arena (growth, reuse, governor, requantize, demotion), the policies and
the sequence manager. Requantize runs through _ortkv.paged_requantize; where this build lacks it, a numpy
stand-in built on ortkv.reference.codecs takes its place (same contract: all layers, nothing written on
refusal)."""

from __future__ import annotations

import numpy as np
import pytest

from ortkv import _ortkv, paged
from ortkv.errors import CacheInputError, CapacityError, OrtkvError
from ortkv.paged import (ExplicitPolicy, PagedKVCache, PagePool, RecencyPolicy, UniformPolicy, parse_format,
                         policy_from_config)
from ortkv.reference import codecs as rc
from ortkv.reference.codecs import PageFormat as F
from ortkv.reference.page_policy import walk_advance, walk_reserve
from ortkv.vmm import Governor

L, H, PS, D = 2, 2, 16, 64  # layers, kv heads, page size, head size
GRANULE = 4096


def _numpy_requantize(pool, src_offset, src_format, dst_offset, dst_format, num_layers, kv_heads, page_size,
                      head_size, logical):
    src_pb = rc.layout(src_format, kv_heads, page_size, head_size).page_bytes
    dst_pb = rc.layout(dst_format, kv_heads, page_size, head_size).page_bytes
    encoded = []
    for layer in range(num_layers):  # every layer encoded before any byte is written
        src = np.array(pool[src_offset + layer * src_pb: src_offset + (layer + 1) * src_pb])
        encoded.append(rc.encode_page(dst_format, rc.decode_page(src_format, src, kv_heads, page_size, head_size)))
    for layer, page in enumerate(encoded):
        pool[dst_offset + layer * dst_pb: dst_offset + (layer + 1) * dst_pb] = page


@pytest.fixture(autouse=True)
def _requantize(monkeypatch):
    if not hasattr(_ortkv, "paged_requantize"):
        monkeypatch.setattr(paged, "_native_requantize", _numpy_requantize)


def _pool(**kw):
    kw.setdefault("max_pages", 64)
    return PagePool(L, H, D, PS, np.float32, **kw)


def _write(pool, page, values):
    """values [L, 2, H, PS, D] encoded into page (its format) with the reference codec."""
    f = pool.format_of(page)
    pb = pool.page_bytes(f)
    for layer in range(L):  # write_bytes: a host-to-device copy on a CUDA pool
        pool.write_bytes(pool.offset_of(page) + layer * pb, rc.encode_page(f, values[layer]))


def _read(pool, page):
    f = pool.format_of(page)
    return np.stack([rc.decode_page(f, np.array(pool.layer_bytes(page, layer)), H, PS, D) for layer in range(L)])


def _rup(n, g=GRANULE):
    return -(-n // g) * g


def test_slot_sizes_follow_the_codec_layout():
    with _pool() as pool:
        for f in F:
            assert pool.page_bytes(f) == rc.layout(f, H, PS, D).page_bytes
            assert pool.slot_bytes(f) == L * rc.layout(f, H, PS, D).page_bytes
        offsets = sorted(s.offset for s in pool.slabs.values())
        assert offsets[0] == 0 and all(o % paged.SLAB_ALIGN == 0 for o in offsets)
        assert pool.pool.dtype == np.uint8 and pool.pool.shape == (pool.pool_bytes,)
        assert pool.committed_bytes == 0  # address space only


DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_slabs_grow_granule_by_granule_as_slots_are_taken(device):
    with _pool(device=device) as pool:
        g = pool.granule  # 4 KiB on the host, 2 MiB on CUDA (queried)
        assert g == GRANULE or device != "cpu"
        slot = pool.slot_bytes(F.INT8)  # 8448: not a multiple of the granule
        for n in range(1, 9):
            page = pool.alloc(F.INT8)
            assert pool.format_of(page) == F.INT8
            assert pool.offset_of(page) == pool.slabs[F.INT8].offset + (n - 1) * slot
            assert pool.committed_bytes_per_format()["INT8"] == _rup(n * slot, g)
            assert pool.committed_bytes == _rup(n * slot, g)
        assert pool.committed_bytes_per_format()["F16"] == 0
        assert pool.pages_per_format()["INT8"] == 8
        assert pool.bytes_copied == 0


@pytest.mark.parametrize("device", DEVICES)
def test_freed_slots_are_reused_per_format(device):
    with _pool(device=device) as pool:
        g = pool.granule
        a, b, c = (pool.alloc(F.F16) for _ in range(3))
        committed = pool.committed_bytes
        off_b = pool.offset_of(b)
        pool.free(b)
        assert pool.directory[b].tolist() == [-1, -1]
        i8 = pool.alloc(F.INT8)  # its own slab grows; the free F16 slot is not taken
        assert pool.offset_of(i8) >= pool.slabs[F.INT8].offset
        assert pool.committed_bytes == committed + _rup(pool.slot_bytes(F.INT8), g)
        d = pool.alloc(F.F16)
        assert pool.offset_of(d) == off_b  # the freed slot, no growth
        assert pool.committed_bytes == committed + _rup(pool.slot_bytes(F.INT8), g)
        assert pool.pages_per_format() == {**{f.name: 0 for f in F}, "F16": 3, "INT8": 1}
        assert pool.bytes_copied == 0


@pytest.mark.parametrize("device", DEVICES)
def test_commit_ahead_grows_a_slab_by_more_slots_and_falls_back_to_one(device):
    """commit_ahead (the CUDA-graph runner's, Note [Paged decoder on CUDA]): a slab that must grow commits that many
    slots beyond the one it needs, so the next ones commit nothing; a governor that refuses the more gets the one
    alone; a slot committed ahead is lent to a format whose slab the governor cannot grow; 0 (the default) is the
    granule-by-granule growth above."""
    with _pool(device=device, commit_ahead=5) as pool:
        g, slot = pool.granule, pool.slot_bytes(F.INT8)
        grown = []
        for _ in range(13):
            pool.alloc(F.INT8)
            grown.append(pool.committed_bytes)
        assert grown[0] == _rup(6 * slot, g)  # the slot and 5 ahead
        assert len(set(grown[:6])) == 1  # the next 5 commit nothing
        assert grown[6] == _rup(12 * slot, g) and grown[12] == _rup(18 * slot, g)
    with pytest.raises(OrtkvError, match=r"commit_ahead = -1 must be an integer >= 0"):
        _pool(commit_ahead=-1)
    if device != "cpu":
        return
    gov = Governor(5 * 16384)  # one F16 page and 4 ahead take the whole budget
    with _pool(governor=gov, commit_ahead=4) as pool:
        f16 = pool.alloc(F.F16)
        assert pool.committed_bytes == 5 * 16384 == gov.in_use
        i4 = pool.alloc(F.INT4)  # its slab cannot grow: a slot committed ahead in the F16 slab holds it
        assert pool.format_of(i4) == F.INT4 and pool.offset_of(i4) == pool.slabs[F.F16].slot_offset(1)
        assert pool.offset_of(pool.alloc(F.F16)) == pool.slabs[F.F16].slot_offset(2)  # the next fresh one
        pool.free(i4)
        assert pool.offset_of(pool.alloc(F.F16)) == pool.slabs[F.F16].slot_offset(1)  # lent and given back
        assert pool.committed_bytes == 5 * 16384 and len(pool.live_pages) == 3 and f16 in pool.live_pages
    gov = Governor(3 * 16384)  # F16 slots of 16384 bytes: three fit, not 1 + 4 ahead
    with _pool(governor=gov, commit_ahead=4) as pool:
        pages = [pool.alloc(F.F16) for _ in range(3)]
        assert pool.committed_bytes == 3 * 16384 and gov.in_use == 3 * 16384  # one at a time once refused
        with pytest.raises(CapacityError, match=r"refused .* F16 page of 16384 bytes"):
            pool.alloc(F.F16)
        assert pool.live_pages == sorted(pages) and pool.committed_bytes == 3 * 16384


def test_governor_refusal_is_capacity_error_with_numbers_and_changes_nothing():
    gov = Governor(2 * 16384)
    with _pool(governor=gov) as pool:
        pages = [pool.alloc(F.F16) for _ in range(2)]
        directory = pool.directory.copy()
        with pytest.raises(CapacityError, match=r"refused .* F16 page of 16384 bytes \(budget 32768 bytes, "
                                                r"32768 in use.*raise the budget or free pages") as e:
            pool.alloc(F.F16)
        assert e.value.requested == 16384 and e.value.budget == 32768 and e.value.in_use == 32768
        assert np.array_equal(pool.directory, directory) and pool.live_pages == sorted(pages)
        assert pool.committed_bytes == 32768 and gov.in_use == 32768
        pool.free(pages[0])
        assert pool.alloc(F.F16) == pages[0]  # a freed slot needs no grant


def test_refused_format_borrows_a_free_wider_slot():
    gov = Governor(2 * 16384)
    with _pool(governor=gov) as pool:
        pages = [pool.alloc(F.F16) for _ in range(2)]
        pool.free(pages[1])
        p = pool.alloc(F.INT4)  # the INT4 slab cannot grow: the free F16 slot holds it
        assert pool.format_of(p) == F.INT4 and pool.offset_of(p) == pool.slabs[F.F16].slot_offset(1)
        values = np.random.default_rng(0).standard_normal((L, 2, H, PS, D)).astype(np.float32)
        _write(pool, p, values)
        np.testing.assert_array_less(np.abs(_read(pool, p) - values), rc.page_round_trip_bound(F.INT4, values[0]).max() * 2)
        pool.free(p)
        q = pool.alloc(F.F16)  # the borrowed slot went back to the F16 free list
        assert pool.offset_of(q) == pool.slabs[F.F16].slot_offset(1) and gov.in_use == 2 * 16384


def test_max_pages_is_refused_with_numbers():
    with _pool(max_pages=3) as pool:
        for _ in range(3):
            pool.alloc(F.INT2)
        with pytest.raises(CapacityError, match=r"all 3 pages are in use \(max_pages\)") as e:
            pool.alloc(F.INT2)
        assert e.value.capacity == 3


@pytest.mark.parametrize("mix", [[F.F16], [F.INT4], [F.F16, F.INT8, F.INT4],
                                 [F.F16, F.BF16, F.INT8, F.FP8_E4M3, F.INT4, F.INT2, F.INT4_KC, F.INT2_KC]])
def test_tokens_per_gib_within_5_percent_of_ideal(mix):
    # SmolLM2-135M's shape: 30 layers, 3 KV heads, head_size 64, pages of 16 tokens
    with PagePool(30, 3, 64, 16, np.float32, max_pages=512) as pool:
        rng = np.random.default_rng(1)
        fmts = [mix[i] for i in rng.integers(0, len(mix), 400)]
        for f in fmts:
            pool.alloc(f)
        ideal = sum(30 * rc.layout(f, 3, 16, 64).ideal_bytes for f in fmts)
        tokens = 16 * len(fmts)
        assert pool.committed_bytes == sum(pool.committed_bytes_per_format().values())
        measured, best = tokens / pool.committed_bytes, tokens / ideal
        assert measured >= 0.95 * best, (measured, best)


def test_requantize_moves_one_page_and_frees_the_old_slot():
    with _pool() as pool:
        p, q = pool.alloc(F.F16), pool.alloc(F.F16)
        values = np.random.default_rng(2).standard_normal((L, 2, H, PS, D)).astype(np.float32)
        _write(pool, p, values)
        q_bytes = np.array(pool.pool[pool.offset_of(q):pool.offset_of(q) + pool.slot_bytes(F.F16)])
        old_offset = pool.offset_of(p)
        pool.requantize(p, F.INT8)
        assert pool.format_of(p) == F.INT8 and pool.directory[p, 0] == int(F.INT8)
        assert pool.offset_of(p) == pool.slabs[F.INT8].offset
        assert pool.bytes_copied == pool.slot_bytes(F.INT8) and pool.requantized_pages == 1
        got = _read(pool, p)
        for layer in range(L):
            f16 = values[layer].astype(np.float16).astype(np.float32)
            assert (np.abs(got[layer] - f16) <= rc.page_round_trip_bound(F.INT8, f16) + 1e-6).all()
        assert np.array_equal(q_bytes, pool.pool[pool.offset_of(q):pool.offset_of(q) + pool.slot_bytes(F.F16)])
        assert pool.offset_of(pool.alloc(F.F16)) == old_offset  # the old slot is free again
        pool.requantize(p, F.INT8)  # same format: nothing to do
        assert pool.bytes_copied == pool.slot_bytes(F.INT8)


def test_requantize_refusal_leaves_everything_untouched():
    with _pool() as pool:
        p = pool.alloc(F.F16)
        values = np.ones((L, 2, H, PS, D), np.float32)
        values[1, 0, 1, 3, 5] = np.inf
        _write(pool, p, values)
        before_page = np.array(pool.pool[pool.offset_of(p):pool.offset_of(p) + pool.slot_bytes(F.F16)])
        directory = pool.directory.copy()
        with pytest.raises(CacheInputError, match="inf|NaN|finite"):
            pool.requantize(p, F.INT8)
        assert np.array_equal(pool.directory, directory) and pool.bytes_copied == 0
        assert np.array_equal(before_page, pool.pool[pool.offset_of(p):pool.offset_of(p) + pool.slot_bytes(F.F16)])
        assert pool.pages_per_format()["INT8"] == 0
        i8 = pool.alloc(F.INT8)  # the slot taken for the refused copy went back to the free list
        assert pool.offset_of(i8) == pool.slabs[F.INT8].offset


def test_demotion_on_refusal_narrows_the_oldest_unpinned_page():
    slot16, slot8 = L * 8192, L * 4224
    gov = Governor(4 * slot16 + _rup(slot8))
    with _pool(governor=gov, demote_on_refusal=True) as pool:
        pages = [pool.alloc(F.F16, pinned=(i == 0)) for i in range(4)]  # page 0: a sink
        rng = np.random.default_rng(3)
        values = {p: rng.standard_normal((L, 2, H, PS, D)).astype(np.float32) for p in pages}
        for p in pages:
            _write(pool, p, values[p])
        slot_of_1 = pool.offset_of(pages[1])
        new = pool.alloc(F.F16)  # refused growth: page 1 (oldest unpinned) goes to INT8, its slot is reused
        assert pool.format_of(pages[0]) == F.F16 and pool.format_of(pages[1]) == F.INT8
        assert pool.offset_of(new) == slot_of_1 and pool.demoted_pages == 1
        assert pool.bytes_copied == slot8
        f16 = values[pages[1]].astype(np.float16).astype(np.float32)
        assert (np.abs(_read(pool, pages[1]) - f16) <= rc.page_round_trip_bound(F.INT8, f16[0]).max() + 1e-3).all()
        directory = pool.directory.copy()
        # the INT8 slab cannot grow again either: nothing fits, CapacityError names what was tried
        with pytest.raises(CapacityError, match=r"demoted 0 page\(s\) one step .*pinned pages"):
            pool.alloc(F.F16)
        assert np.array_equal(pool.directory, directory) and gov.in_use == gov.budget


def test_demotion_never_touches_pinned_pages():
    gov = Governor(2 * L * 8192)
    with _pool(governor=gov, demote_on_refusal=True) as pool:
        for _ in range(2):
            pool.alloc(F.F16, pinned=True)
        with pytest.raises(CapacityError, match="demoted 0 page"):
            pool.alloc(F.F16)
        assert pool.pages_per_format()["F16"] == 2 and pool.demoted_pages == 0


def test_pool_argument_errors():
    with pytest.raises(OrtkvError, match=r"page_size = 0 must be an integer >= 1"):
        PagePool(L, H, D, 0)
    with pytest.raises(OrtkvError, match="logical_dtype .* float32, float16 or bfloat16"):
        PagePool(L, H, D, PS, np.int8)
    with PagePool(L, H, 6, PS, np.float16, max_pages=4) as pool:  # head_size 6: no INT2 slabs
        assert pool.wide == F.F16 and F.INT2 not in pool.slabs and F.INT2_KC not in pool.slabs and F.INT4 in pool.slabs
        with pytest.raises(OrtkvError, match="INT2 cannot hold pages of head_size 6"):
            pool.alloc(F.INT2)
        with pytest.raises(OrtkvError, match=r"page 3 is not an allocated page"):
            pool.free(3)
        with pytest.raises(OrtkvError, match="kv_format = 'int3': one of 'f16'"):
            parse_format("int3", "kv_format")
    assert PagePool(L, H, D, PS, "bfloat16", max_pages=2).wide == F.BF16


# --- policies and the sequence manager -------------------------------------------------------------------
def test_recency_policy_requantizes_pages_leaving_the_window():
    with _pool() as pool:
        cache = PagedKVCache(pool, batch=2, max_pages_per_seq=16, policy=RecencyPolicy(1, 2, F.F16, F.INT4))
        lengths = np.array([0, 0])
        formats_seen = []
        for step in range(8):
            new = lengths + np.array([PS, PS // 2])  # row 0 a page per step, row 1 half a page
            cache.reserve(new)
            cache.advance(new)
            lengths = new
            if step == 2:  # row 1: 24 tokens, page 1 is being filled: pinned until full
                assert int(cache.page_table[1, 1]) in pool._pinned
            if step == 3:
                assert int(cache.page_table[1, 1]) not in pool._pinned
            formats_seen.append([pool.format_of(int(p)).name for p in cache.page_table[0] if p >= 0])
        # row 0: 8 pages; sink page 0 and the newest 2 stay F16, the rest INT4
        assert formats_seen[-1] == ["F16"] + ["INT4"] * 5 + ["F16"] * 2
        assert formats_seen[2] == ["F16", "F16", "F16"]
        assert formats_seen[3] == ["F16", "INT4", "F16", "F16"]
        row1 = [pool.format_of(int(p)).name for p in cache.page_table[1] if p >= 0]
        assert row1 == ["F16", "INT4", "F16", "F16"]  # 64 tokens = 4 pages
        assert pool.requantized_pages == 5 + 1 and pool.bytes_copied == 6 * pool.slot_bytes(F.INT4)
        assert pool.pages_per_format()["F16"] == 6 and pool.pages_per_format()["INT4"] == 6
        assert pool.stats()["live_bytes"] == 6 * pool.slot_bytes(F.F16) + 6 * pool.slot_bytes(F.INT4)
        assert pool._pinned == {int(cache.page_table[0, 0]), int(cache.page_table[1, 0])}  # the sinks
        cache.release()
        assert pool.live_pages == [] and (cache.page_table == -1).all()


def test_uniform_kc_pages_fill_wide_and_are_requantized_when_full():
    with _pool() as pool:
        cache = PagedKVCache(pool, 1, 8, UniformPolicy(F.INT4_KC))
        cache.reserve([PS + 3])
        assert [pool.format_of(int(p)) for p in cache.page_table[0, :2]] == [F.F16, F.F16]
        cache.advance([PS + 3])
        assert [pool.format_of(int(p)) for p in cache.page_table[0, :2]] == [F.INT4_KC, F.F16]
        cache.reserve([2 * PS])
        cache.advance([2 * PS])
        assert [pool.format_of(int(p)) for p in cache.page_table[0, :2]] == [F.INT4_KC, F.INT4_KC]
        assert pool.bytes_copied == 2 * pool.slot_bytes(F.INT4_KC)


def test_uniform_int8_writes_directly_and_copies_nothing():
    with _pool() as pool:
        cache = PagedKVCache(pool, 1, 8, policy_from_config(kv_format="int8"))
        for n in range(1, 3 * PS + 1):
            cache.reserve([n])
            cache.advance([n])
        assert pool.pages_per_format()["INT8"] == 3 and pool.bytes_copied == 0
        assert pool.committed_bytes == _rup(3 * pool.slot_bytes(F.INT8))


class _OddPolicy(paged.Policy):
    """A target that depends on the page count in no pattern Policy.retargeted knows (its default applies)."""

    sink_pages = 1

    def target(self, index, num_pages):
        return (F.INT8, F.INT4, F.F16)[(index * 7 + num_pages) % 3]

    def describe(self):
        return "odd"


_POLICIES = [UniformPolicy(F.F16), UniformPolicy(F.INT4_KC), RecencyPolicy(1, 2, F.F16, F.INT4),
             RecencyPolicy(0, 3, F.INT8, F.INT2), ExplicitPolicy((F.F16, F.INT8, F.F16, F.INT4)), _OddPolicy()]


@pytest.mark.parametrize("policy", _POLICIES, ids=lambda p: p.describe())
@pytest.mark.parametrize("budget", [None, 8], ids=["no-budget", "tight-demoting"])
def test_incremental_reserve_and_advance_equal_the_full_walk(policy, budget):
    """Note [Incremental advance]: two pools driven by the same random steps (decode steps, prefills of several
    pages, shorter lengths, a user's requantize, pin and table edit, release, a budget that makes reserve demote),
    one through PagedKVCache.reserve / advance, one through the walk over every page: the same page tables,
    directories, pins, counters, return values and errors after every step (the walk: ortkv.reference.page_policy)."""
    rng = np.random.default_rng(len(policy.describe()) + (budget or 0))

    def make():
        if not budget:
            pool = _pool()
        else:  # room for `budget` F16 pages, and free committed INT8 / INT4 slots that demotion can take
            pool = _pool(governor=Governor(budget * L * 8192), demote_on_refusal=True)
            for f in (F.INT8, F.INT4):
                for page in [pool.alloc(f) for _ in range(6)]:
                    pool.free(page)
        return pool, PagedKVCache(pool, batch=3, max_pages_per_seq=12, policy=policy)

    (pa, ca), (pb, cb) = make(), make()
    lengths = np.zeros(3, np.int64)

    def both(fa, fb):
        out = []
        for f in (fa, fb):
            try:
                out.append(("ok", f()))
            except OrtkvError as e:
                out.append((type(e).__name__, str(e).split(":")[-1]))
        assert out[0] == out[1]
        return out[0][0] == "ok"

    try:
        for step in range(160):
            op = rng.random()
            if op < 0.05:
                ca.release(), cb.release()
                lengths[:] = 0
                continue
            if op < 0.10 and pa.live_pages:  # a user's requantize of some live page
                page = int(rng.choice(pa.live_pages))
                fmt = F(int(rng.choice([F.F16, F.INT8, F.INT4, F.INT2])))
                both(lambda: pa.requantize(page, fmt), lambda: pb.requantize(page, fmt))
            elif op < 0.13 and pa.live_pages:  # a user's pin or unpin
                page, on = int(rng.choice(pa.live_pages)), bool(rng.random() < 0.5)
                pa.pin(page, on), pb.pin(page, on)
            elif op < 0.18 and lengths.max() >= 2 * PS:  # a user's swap of two full pages of a row in its table
                b = int(np.argmax(lengths))
                i, j = rng.choice(int(lengths[b]) // PS, size=2, replace=False)
                for c in (ca, cb):
                    c.page_table[b, [i, j]] = c.page_table[b, [j, i]]
            grow = rng.choice([0, 1, 1, 1, 1, PS - 1, PS, 3 * PS + 2], size=3)
            new = np.minimum(lengths + grow, 12 * PS) if rng.random() > 0.04 else lengths // 2
            if both(lambda: ca.reserve(new), lambda: walk_reserve(cb, new)):
                both(lambda: ca.advance(new), lambda: walk_advance(cb, new))  # a refused requantize: in both
                lengths = np.maximum(lengths, new)
            assert np.array_equal(ca.page_table, cb.page_table), step
            assert np.array_equal(pa.directory, pb.directory), step
            assert pa._pinned == pb._pinned, step
            assert (pa.requantized_pages, pa.demoted_pages, pa.bytes_copied) == \
                (pb.requantized_pages, pb.demoted_pages, pb.bytes_copied), step
            assert np.array_equal(ca.lengths, cb.lengths)
        assert pa.requantized_pages > 0  # the steps exercised the policy, and with wide pages the demotion
        assert pa.demoted_pages > 0 or not budget or policy not in (_POLICIES[0], _POLICIES[2], _POLICIES[4])
    finally:
        pa.close(), pb.close()


def test_advance_visits_only_the_pages_that_changed():
    """A decode step's host work does not grow with the tokens held (Note [Incremental advance]): with 40 pages a
    row, 64 one-token steps ask the policy about ~one page per page that fills (and, for the recency policy, the
    one that leaves the window), not 40 pages a row each step as the full walk did; a hole in a full prefix is
    refused before anything changes."""
    calls = []

    class Counting(RecencyPolicy):
        def target(self, index, num_pages):
            calls.append(index)
            return super().target(index, num_pages)

    with _pool(max_pages=128) as pool:
        cache = PagedKVCache(pool, batch=2, max_pages_per_seq=48, policy=Counting(1, 4, F.F16, F.INT4))
        n = np.array([40 * PS, 40 * PS - 5])
        cache.reserve(n)
        cache.advance(n)
        calls.clear()
        for _ in range(64):
            n = n + 1
            cache.reserve(n)
            cache.advance(n)
        opened = 2 * 4  # pages opened by reserve (_open_format asks the policy once each)
        assert len(calls) <= opened + 2 * 2 * 4 + 2, len(calls)  # the full walk: ~2 x 64 x 41
        assert [pool.format_of(int(p)).name for p in cache.page_table[0, :44]] == \
            ["F16"] + ["INT4"] * 39 + ["F16"] * 4
        before = (cache.page_table.copy(), pool.directory.copy(), set(pool._pinned))
        cache.page_table[1, 3] = -1
        with pytest.raises(OrtkvError, match=r"row 1 has 700 tokens but no page 3; reserve\(\) before the run"):
            cache.advance(n + 1)
        cache.page_table[1, 3] = before[0][1, 3]
        assert np.array_equal(pool.directory, before[1]) and pool._pinned == before[2]


def test_explicit_policy_and_reserve_is_all_or_nothing():
    gov = Governor(3 * L * 8192)
    with _pool(governor=gov) as pool:
        cache = PagedKVCache(pool, 2, 8, policy_from_config(kv_page_formats=["f16", "int8", "f16"]))
        cache.reserve([PS, 0])
        assert pool.format_of(int(cache.page_table[0, 0])) == F.F16
        table = cache.page_table.copy()
        with pytest.raises(CapacityError):
            cache.reserve([3 * PS, 3 * PS])  # 5 more pages do not fit the budget
        assert np.array_equal(cache.page_table, table) and len(pool.live_pages) == 1
        cache.reserve([3 * PS, 0])
        assert [pool.format_of(int(p)).name for p in cache.page_table[0, :3]] == ["F16", "INT8", "F16"]
        with pytest.raises(CapacityError, match=r"200 tokens exceed the 128 a row holds \(8 pages of 16\)"):
            cache.reserve([200, 0])


@pytest.mark.parametrize("kw, message", [
    ({"kv_format": "int8", "kv_policy": {"recent": "f16"}}, "kv_format and kv_policy are both set"),
    ({"kv_format": "q8_0"}, r"ortkv.kv_format = 'q8_0': one of 'f16'"),
    ({"kv_policy": {"sink": 1}}, r"ortkv.kv_policy: unknown key\(s\) \['sink'\]"),
    ({"kv_policy": {"recent_pages": 0}}, r"ortkv.kv_policy.recent_pages = 0 must be >= 1"),
    ({"kv_policy": {"sink_pages": -1}}, r"ortkv.kv_policy.sink_pages = -1 must be >= 0"),
    ({"kv_policy": {"sink_pages": 1.5}}, r"ortkv.kv_policy.sink_pages = 1.5: expected an integer"),
    ({"kv_policy": {"recent": "int4_kc"}}, r"ortkv.kv_policy.recent = 'int4_kc': the recent window"),
    ({"kv_policy": {"old": "int5"}}, r"ortkv.kv_policy.old = 'int5'"),
    ({"kv_page_formats": "int8"}, r"ortkv.kv_page_formats = 'int8': expected a list"),
    ({"kv_page_formats": ["f16", 9]}, r"ortkv.kv_page_formats\[1\] = 9"),
])
def test_policy_config_errors(kw, message):
    with pytest.raises(OrtkvError, match=message):
        policy_from_config(**kw)


def test_a_policy_naming_a_format_the_pool_cannot_hold_is_refused_up_front():
    with PagePool(L, H, 6, PS, np.float32, max_pages=4) as pool:
        with pytest.raises(OrtkvError, match="INT2 cannot hold pages of head_size 6"):
            PagedKVCache(pool, 1, 4, ExplicitPolicy((F.F16,) * 70 + (F.INT2,)))
        assert pool.live_pages == []


def test_policy_from_config_defaults():
    assert policy_from_config() == UniformPolicy(F.F16)
    assert policy_from_config(kv_policy={"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"}) == \
        RecencyPolicy(1, 4, F.F16, F.INT4)
    assert policy_from_config(kv_page_formats=["int2"]) == ExplicitPolicy((F.INT2,))


# ---- bytes on either device, the device directory, requantize on CUDA (Note [Page pool on CUDA],
# ---- Note [Requantize on CUDA]) ------------------------------------------------------------------------------
def _device_directory(pool):
    d = pool.directory_input()
    return d if isinstance(d, np.ndarray) else d.numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_read_write_copy_bytes_and_their_refusals(device):
    with _pool(device=device) as pool:
        a, b = pool.alloc(F.INT8), pool.alloc(F.INT8)
        n = pool.slot_bytes(F.INT8)
        data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        pool.write_bytes(pool.offset_of(a), data)
        assert np.array_equal(pool.read_bytes(pool.offset_of(a), n), data)
        assert np.array_equal(pool.slot_contents(a), data)
        pool.copy_bytes(pool.offset_of(b), pool.offset_of(a), n)
        assert np.array_equal(pool.slot_contents(b), data)
        assert np.array_equal(pool.layer_bytes(b, 1), data[pool.page_bytes(F.INT8):])
        before = pool.slot_contents(b)
        with pytest.raises(OrtkvError, match=r"PagePool.write_bytes: \[\d+, \+\d+\) is outside the pool's \d+ bytes"):
            pool.write_bytes(pool.pool_bytes - 4, np.zeros(8, np.uint8))
        far = pool.slabs[F.F16].offset  # reserved, never committed
        with pytest.raises(OrtkvError, match=r"PagePool.copy_bytes: \[\d+, \+\d+\) is not committed; touch only "
                                             r"allocated pages"):
            pool.copy_bytes(pool.offset_of(b), far, n)
        with pytest.raises(OrtkvError, match=r"PagePool.read_bytes: .* is not committed"):
            pool.read_bytes(far, 16)
        assert np.array_equal(pool.slot_contents(b), before)
        assert pool.bytes_copied == 0  # copy_bytes is counted by its caller (PoolPageStore.copy)


@pytest.mark.parametrize("device", DEVICES)
def test_directory_input_is_the_host_rows_on_the_device(device):
    with _pool(device=device) as pool:
        pages = [pool.alloc(F.F16) for _ in range(4)]
        assert np.array_equal(_device_directory(pool), pool.directory)
        up = pool.directory_bytes_uploaded
        assert np.array_equal(_device_directory(pool), pool.directory)
        assert pool.directory_bytes_uploaded == up  # nothing changed: nothing copied
        pool.free(pages[1])
        _write(pool, pages[3], np.zeros((L, 2, H, PS, D), np.float32))  # fresh CUDA memory is not zeroed
        pool.requantize(pages[3], F.INT8)
        assert np.array_equal(_device_directory(pool), pool.directory)
        if device == "cpu":
            assert pool.directory_input() is pool.directory and pool.directory_bytes_uploaded == 0
        else:  # rows 1..3 changed: one copy of that span
            assert pool.directory_bytes_uploaded == up + 3 * 16
        assert pool.stats()["directory_bytes_uploaded"] == pool.directory_bytes_uploaded


def _cuda_kernel_or_skip():
    """_ortkv.paged_requantize_cuda, or skip in a build without the CUDA kernels."""
    kernel = paged._cuda_requantize_kernel()
    if kernel is None:
        pytest.skip("this build has no CUDA kernels (_ortkv.paged_requantize_cuda): Note [Requantize on a CUDA pool]")
    return kernel


_ROUND_TRIPS = [(F.F16, F.INT8), (F.F16, F.INT4), (F.F16, F.FP8_E4M3), (F.F16, F.INT4_KC), (F.F16, F.INT2),
                (F.F16, F.INT2_KC), (F.F16, F.BF16), (F.BF16, F.INT8), (F.INT8, F.INT4), (F.INT4_KC, F.INT8),
                (F.FP8_E4M3, F.F16), (F.INT2, F.INT4_KC)]


@pytest.mark.cuda
@pytest.mark.parametrize("src,dst", _ROUND_TRIPS, ids=lambda f: f.name)
@pytest.mark.parametrize("logical", [np.float32, np.float16, "bfloat16"])
def test_requantize_on_cuda_runs_on_the_device_and_equals_cpu_byte_for_byte(src, dst, logical):
    """Note [Requantize on CUDA]: the device kernels give the host's bytes (and the numpy reference's for float32),
    touch nothing else, and stage nothing."""
    _cuda_kernel_or_skip()
    values = np.random.default_rng(7).standard_normal((L, 2, H, PS, D)).astype(np.float32)
    slots = {}
    for device in ("cpu", "cuda:0"):
        with PagePool(L, H, D, PS, logical, device=device, max_pages=16) as pool:
            keep = pool.alloc(src)
            p = pool.alloc(src)
            _write(pool, keep, -values)
            _write(pool, p, values)
            keep_bytes, src_bytes = pool.slot_contents(keep), pool.slot_contents(p)
            pool.requantize(p, dst)
            assert pool.format_of(p) == dst and pool.bytes_copied == pool.slot_bytes(dst)
            assert np.array_equal(pool.slot_contents(keep), keep_bytes)  # the neighbour is untouched
            assert np.array_equal(_device_directory(pool), pool.directory)
            assert pool.bytes_staged == 0 and pool.stats()["bytes_staged"] == 0
            slots[device] = (pool.slot_contents(p), pool.offset_of(p), src_bytes)
    assert slots["cpu"][1] == slots["cuda:0"][1]
    assert np.array_equal(slots["cpu"][2], slots["cuda:0"][2])  # the same source bytes on both
    assert np.array_equal(slots["cpu"][0], slots["cuda:0"][0])
    if logical is np.float32:  # and the numpy reference's
        ref = np.concatenate([rc.encode_page(dst, rc.decode_page(src, layer, H, PS, D))
                              for layer in np.split(slots["cpu"][2], L)])
        assert np.array_equal(slots["cuda:0"][0], ref)


@pytest.mark.cuda
@pytest.mark.parametrize("dst,where", [(F.INT8, "V row [head=0 token=3]"), (F.INT4_KC, "K channel [head=1 channel=5]"),
                                       (F.INT4, "K row [head=1 token=3]")])
def test_requantize_refusal_on_cuda_gives_the_cpu_message_and_writes_nothing(dst, where):
    _cuda_kernel_or_skip()
    values = np.ones((L, 2, H, PS, D), np.float32)
    values[1, 0, 1, 3, 5] = np.inf  # layer 1: K head 1 token 3 channel 5
    values[1, 1, 0, 3, 7] = np.nan  # layer 1: V head 0 token 3 (after the K rows in the host's order)
    if dst == F.INT8:
        values[1, 0, 1, 3, 5] = 1.0  # only the V row is bad
    messages = {}
    for device in ("cpu", "cuda:0"):
        with _pool(device=device) as pool:
            spare = pool.alloc(dst)  # commits the slab's granule; its slot is the one the refusal takes
            spare_offset = pool.offset_of(spare)
            fresh = pool.slot_contents(spare)
            pool.free(spare)
            p = pool.alloc(F.F16)
            _write(pool, p, values)
            before = pool.slot_contents(p)
            directory = pool.directory.copy()
            with pytest.raises(CacheInputError) as err:
                pool.requantize(p, dst)
            messages[device] = str(err.value)
            assert np.array_equal(pool.directory, directory) and pool.bytes_copied == 0
            assert np.array_equal(_device_directory(pool), directory)
            assert np.array_equal(pool.slot_contents(p), before)
            assert pool.bytes_staged == 0
            again = pool.alloc(dst)
            assert pool.offset_of(again) == spare_offset  # the slot the refused copy took went back to the free list
            assert np.array_equal(pool.slot_contents(again), fresh)  # and no byte of it was written
    assert f"layer 1: {dst.name} page: {where}" in messages["cpu"]
    assert "nothing was written" in messages["cpu"]
    assert messages["cuda:0"].replace("paged_requantize (CUDA): ", "paged_requantize: ") == messages["cpu"]


def test_requantize_refuses_uncommitted_slots_and_writes_nothing():
    """The host requantize checks both slots against the arena's registered ranges (Note [Write-protection check]):
    a destination or a source in reserved, uncommitted arena space is refused with E_UNCOMMITTED (a CapacityError
    through the pool's wrapper) before any byte is written."""
    if not hasattr(_ortkv, "paged_requantize"):
        pytest.skip("this build has no _ortkv.paged_requantize (the numpy stand-in has no range check)")
    with _pool() as pool:
        p = pool.alloc(F.F16)
        _write(pool, p, np.ones((L, 2, H, PS, D), np.float32))
        before = pool.slot_contents(p)
        far = pool.slabs[F.INT8].offset  # reserved, never committed (no INT8 page yet)
        args = (pool.num_layers, pool.kv_heads, pool.page_size, pool.head_size, "float32")
        with pytest.raises(CapacityError, match=r"paged_requantize: the destination slot \[0x[0-9a-f]+, 0x[0-9a-f]+\), "
                                                r"which overlaps the uncommitted range .*Nothing was written. Remedy: "
                                                r"requantize into a committed free slot"):
            paged._call_native(_ortkv.paged_requantize, pool.pool, pool.offset_of(p), int(F.F16), far, int(F.INT8),
                               *args)
        with pytest.raises(CapacityError, match=r"paged_requantize: the source slot .*which overlaps the uncommitted "
                                                r"range .*Remedy: requantize only a page whose slot is committed"):
            paged._call_native(_ortkv.paged_requantize, pool.pool, far, int(F.INT8), pool.offset_of(p) + 4096 * 4,
                               int(F.F16), *args)
        assert np.array_equal(pool.slot_contents(p), before)


@pytest.mark.cuda
def test_requantize_cuda_refuses_uncommitted_or_overlapping_slots_and_writes_nothing():
    kernel = _cuda_kernel_or_skip()
    with _pool(device="cuda:0") as pool:
        p = pool.alloc(F.F16)
        _write(pool, p, np.ones((L, 2, H, PS, D), np.float32))
        before = pool.slot_contents(p)
        far = pool.slabs[F.INT8].offset  # reserved, never committed (no INT8 page yet)
        args = (pool.num_layers, pool.kv_heads, pool.page_size, pool.head_size, "float32")
        refused = (r"\[ortkv:E_UNCOMMITTED\] paged_requantize \(CUDA\): the destination slot \[0x[0-9a-f]+, "
                   r"0x[0-9a-f]+\), which overlaps the uncommitted range .*Nothing was written. Remedy: requantize "
                   r"into a committed free slot")
        with pytest.raises((RuntimeError, ValueError), match=refused):
            kernel(0, pool.arena.base, pool.pool_bytes, pool.offset_of(p), int(F.F16), far, int(F.INT8), *args)
        src_refused = (r"\[ortkv:E_UNCOMMITTED\] paged_requantize \(CUDA\): the source slot .*which overlaps the "
                       r"uncommitted range .*Remedy: requantize only a page whose slot is committed")
        with pytest.raises((RuntimeError, ValueError), match=src_refused):
            kernel(0, pool.arena.base, pool.pool_bytes, far, int(F.INT8), pool.offset_of(p) + 4096 * 4, int(F.F16),
                   *args)
        overlap = "overlap; requantize into a free slot; nothing was written"
        with pytest.raises((RuntimeError, ValueError), match=overlap):
            kernel(0, pool.arena.base, pool.pool_bytes, pool.offset_of(p), int(F.F16), pool.offset_of(p) + 16,
                   int(F.INT8), *args)
        assert np.array_equal(pool.slot_contents(p), before)


def test_requantize_cuda_checks_its_arguments_before_touching_a_device():
    """The device function's argument checks run on the host (no GPU needed): a refusal names the numbers."""
    kernel = _cuda_kernel_or_skip()
    with pytest.raises((RuntimeError, ValueError), match=r"source slot \[0, \+\d+\) and destination slot \[16, "
                                                         r"\+\d+\) overlap; requantize into a free slot"):
        kernel(0, 1 << 40, 1 << 20, 0, int(F.F16), 16, int(F.INT8), 2, 2, 16, 64, "float32")
    with pytest.raises((RuntimeError, ValueError), match=r"INT4 packs 2 channels per byte, so head_size must be a "
                                                         r"multiple of 2; got head_size=63"):
        kernel(0, 1 << 40, 1 << 20, 0, int(F.F16), 1 << 16, int(F.INT4), 2, 2, 16, 63, "float32")
    with pytest.raises(ValueError, match="logical must be 'float32', 'float16' or 'bfloat16', got 'int8'"):
        kernel(0, 1 << 40, 1 << 20, 0, int(F.F16), 1 << 16, int(F.INT8), 2, 2, 16, 64, "int8")


@pytest.mark.cuda
def test_demotion_on_a_cuda_pool_requantizes_on_the_device_and_matches_a_cpu_requantize():
    _cuda_kernel_or_skip()
    values = np.random.default_rng(1).standard_normal((L, 2, H, PS, D)).astype(np.float32)
    gov = Governor(2 * (2 << 20))  # two CUDA granules: one for INT8, one for F16
    with PagePool(L, H, D, PS, np.float32, device="cuda:0", governor=gov, max_pages=256,
                  demote_on_refusal=True) as pool:
        pool.free(pool.alloc(F.INT8))  # the INT8 slab's granule is committed, its slot free
        pages = [pool.alloc(F.F16) for _ in range(pool.granule // pool.slot_bytes(F.F16))]
        _write(pool, pages[0], values)
        new = pool.alloc(F.F16)  # refused by the governor: pages[0] (oldest) is demoted, its F16 slot reused
        assert pool.demoted_pages == 1 and pool.format_of(pages[0]) == F.INT8
        assert pool.bytes_staged == 0
        assert pool.format_of(new) == F.F16
        assert np.array_equal(_device_directory(pool), pool.directory)
        demoted = pool.slot_contents(pages[0])
    with _pool() as cpu:
        p = cpu.alloc(F.F16)
        _write(cpu, p, values)
        cpu.requantize(p, F.INT8)
        assert np.array_equal(cpu.slot_contents(p), demoted)


def _as_host_staged(pool, monkeypatch):
    """Run a CPU pool through its CUDA code paths (staged requantize, the device directory, the byte helpers):
    _cuda_copy becomes a memmove between host addresses and the 'device' directory a second host array, so
    the logic of Note [Page pool on CUDA] / [Requantize on CUDA] is checked here; the H200 runs the real one."""
    import ctypes

    import onnxruntime as ort

    calls = []

    def fake_copy(device, dst, src, nbytes, what):
        calls.append((what, nbytes))
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(paged, "_cuda_copy", fake_copy)
    monkeypatch.setattr(paged, "_cuda_requantize_kernel", lambda: None)  # the path of a build without CUDA kernels
    pool.device = "cuda:0"
    pool._fake_device_directory = np.full_like(pool.directory, -1)  # kept alive: the OrtValue borrows it
    pool.directory_device = ort.OrtValue.ortvalue_from_numpy(pool._fake_device_directory)
    for page in pool.live_pages:
        pool._set_row(page, *pool.directory[page])
    return calls


@pytest.mark.parametrize("dst", [F.INT8, F.INT4, F.INT4_KC])
def test_staged_requantize_path_equals_the_direct_one_on_the_host(monkeypatch, dst):
    values = np.random.default_rng(11).standard_normal((L, 2, H, PS, D)).astype(np.float32)
    with _pool() as direct, _pool() as staged:
        for pool in (direct, staged):
            keep = pool.alloc(F.F16)
            _write(pool, keep, -values)
            _write(pool, pool.alloc(F.F16), values)
        calls = _as_host_staged(staged, monkeypatch)
        keep_bytes = staged.slot_contents(keep)
        for pool in (direct, staged):
            pool.requantize(1, dst)
        assert np.array_equal(direct.slot_contents(1), staged.slot_contents(1))
        assert np.array_equal(direct.directory, staged.directory)
        assert np.array_equal(staged.slot_contents(keep), keep_bytes)
        assert staged.bytes_staged == staged.slot_bytes(F.F16) + staged.slot_bytes(dst) and direct.bytes_staged == 0
        assert staged.bytes_copied == direct.bytes_copied == staged.slot_bytes(dst)
        assert [c for c in calls if c[0] == "requantize"] == [("requantize", staged.slot_bytes(F.F16)),
                                                              ("requantize", staged.slot_bytes(dst))]
        assert not np.array_equal(staged._fake_device_directory, staged.directory)  # not uploaded yet
        assert staged.directory_input() is staged.directory_device
        assert np.array_equal(staged._fake_device_directory, staged.directory)
        assert staged.directory_bytes_uploaded == 2 * 16  # rows 0 and 1: one copy of that span
        staged.directory_input()
        assert staged.directory_bytes_uploaded == 2 * 16


def test_staged_requantize_refusal_writes_nothing_back(monkeypatch):
    with _pool() as pool:
        p = pool.alloc(F.F16)
        values = np.ones((L, 2, H, PS, D), np.float32)
        values[0, 1, 0, 2, 7] = np.nan
        _write(pool, p, values)
        calls = _as_host_staged(pool, monkeypatch)
        before, directory = pool.slot_contents(p), pool.directory.copy()
        pool.directory_input()
        up = pool.directory_bytes_uploaded
        with pytest.raises(CacheInputError, match="inf|NaN|finite"):
            pool.requantize(p, F.INT4)
        assert [c for c in calls if c[0] == "requantize"] == [("requantize", pool.slot_bytes(F.F16))]  # up, not back
        assert pool.bytes_staged == pool.slot_bytes(F.F16) and pool.bytes_copied == 0
        assert np.array_equal(pool.slot_contents(p), before) and np.array_equal(pool.directory, directory)
        pool.directory_input()
        assert pool.directory_bytes_uploaded == up  # no row changed
        assert pool.offset_of(pool.alloc(F.INT4)) == pool.slabs[F.INT4].offset  # the refused slot went back

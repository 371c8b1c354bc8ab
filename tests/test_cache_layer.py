"""ortkv.cache: page metadata, admission, forks, removal, masks, prefix caching and the scheduler,
over MemoryPageStore, whose cells hold one token id each, so a step can be "run" (writes through the
slot mapping) and every sequence read back through its page table and fills (Note [Page fill])."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ortkv.cache import (
    CacheProtocolError,
    CapacityError,
    MemoryPageStore,
    PageCache,
    PageStore,
    Refusal,
    Scheduler,
    SequenceBusyError,
    SequenceRemovedError,
    chain_hashes,
)
from ortkv.errors import OrtkvError

PS = 4


# -- helpers shared with test_cache_statemachine.py ----------------------------------------------
def run_step(store: MemoryPageStore, placement, tokens: dict | None = None) -> None:
    """What a runner does: each new token written into its cell (nothing is ever copied first)."""
    slots = placement.slot_mapping()
    vals = []
    for sid, ids, n in zip(placement.seq_ids, placement.tokens, placement.new_tokens):
        if ids is None:
            ids = tokens[sid] if tokens else np.full(int(n), -7)
        vals.append(np.asarray(ids, np.int64))
    flat = np.concatenate(vals) if vals else np.zeros(0, np.int64)
    store.cells.reshape(-1)[slots] = flat


def read_back(cache: PageCache, store: MemoryPageStore, sid) -> list[int]:
    """Token ids of positions [0, length) of sequence ``sid``, read through its page table and fill rows
    (the oracle's mapping, ortkv.reference.paged.position_map)."""
    from ortkv.reference.paged import position_map

    n = cache.length(sid)
    where = position_map(cache.page_table([sid])[0], cache.page_fill([sid])[0], cache.page_size, n)
    return [int(store.cells[pid, r]) for pid, r in where]


def snapshot(cache: PageCache, store: MemoryPageStore):
    return (
        {pid: (p.fmt, p.base, p.filled, frozenset(p.owners.items()), p.key) for pid, p in cache._pages.items()},
        {sid: (tuple(s.pages), tuple(s.fills), s.length, None if s.tokens is None else tuple(s.tokens),
               tuple(s.keys), s.slot) for sid, s in cache._seqs.items()},
        (cache._table.copy(), cache._fill.copy()), frozenset(cache._removed), tuple(cache._free_slots),
        tuple(cache.prefix.by_key.items()), tuple(cache.prefix.unreferenced.items()),
        store.live, store.cells.copy(), store.committed_bytes,
    )


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, tuple) and x and isinstance(x[0], np.ndarray):
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u, v)
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y


def check_invariants(cache: PageCache, store: MemoryPageStore) -> None:
    """Note [Page metadata]'s invariants."""
    ps = cache.page_size
    owners: dict[int, dict] = {}
    for sid, s in cache._seqs.items():
        assert len(s.fills) == len(s.pages) and all(1 <= f <= ps for f in s.fills), (sid, s.fills)
        assert sum(s.fills) == s.length, (sid, s.fills, s.length)
        assert len(set(s.pages)) == len(s.pages)
        row, fill = cache._table[s.slot], cache._fill[s.slot]
        np.testing.assert_array_equal(row[:len(s.pages)], s.pages)
        np.testing.assert_array_equal(fill[:len(s.pages)], s.fills)
        assert (row[len(s.pages):] == -1).all() and (fill[len(s.pages):] == 0).all()
        base = 0
        for pid, f in zip(s.pages, s.fills):
            assert cache._pages[pid].base == base, (sid, pid)   # one base for every owner
            owners.setdefault(pid, {})[sid] = f
            base += f
    for pid, page in cache._pages.items():
        assert page.owners == owners.get(pid, {}), pid
        info = cache.page_info(pid)
        assert info.refcount == len(owners.get(pid, ()))
        if page.owners:
            assert page.filled == max(page.owners.values()), pid
        else:
            assert page.key is not None and pid in cache.prefix.unreferenced
        if page.key is not None:
            assert page.filled == ps and page.base % ps == 0, pid
    assert set(cache.prefix.unreferenced) == {p for p, pg in cache._pages.items() if not pg.owners}
    for key, pid in cache.prefix.by_key.items():
        assert cache._pages[pid].key == key
    assert set(cache._pages) == set(store.live), "a page leaked, or was freed while held"
    used = {s.slot for s in cache._seqs.values()}
    assert used.isdisjoint(cache._free_slots) and len(used) + len(cache._free_slots) == cache.max_sequences


def make(num_pages=32, max_pages=8, max_sequences=8, **kw):
    store = MemoryPageStore(num_pages, PS)
    return PageCache(store, PS, max_pages, max_sequences, **kw), store


def step(cache, store, entries):
    p = cache.admit(entries)
    assert p, p
    run_step(store, p)
    cache.done(p)
    check_invariants(cache, store)
    return p


# -- admission, placement, masks -------------------------------------------------------------------
def test_store_is_a_page_store():
    assert isinstance(MemoryPageStore(2, PS), PageStore)


def test_admit_places_variable_counts_across_pages():
    cache, store = make()
    cache.new_sequence("a")
    cache.new_sequence("b")
    step(cache, store, {"a": [1, 2, 3]})
    p = cache.admit([("a", [4, 5, 6, 7, 8, 9]), ("b", [10])])
    assert p.seq_ids == ("a", "b")
    np.testing.assert_array_equal(p.start, [3, 0])
    np.testing.assert_array_equal(p.new_tokens, [6, 1])
    np.testing.assert_array_equal(p.lengths, [9, 1])
    assert p.page_table.dtype == np.int32 and p.page_table.shape == (2, 24) == p.page_fill.shape   # 8 pages + 16
    assert len(p.allocated) == 3                         # a: pages 1, 2; b: page 0
    np.testing.assert_array_equal(p.page_fill[:, :4], [[4, 4, 1, 0], [1, 0, 0, 0]])
    assert p.page_fill.base is cache._step_fill
    a_pages, b_pages = cache.pages_of("a"), cache.pages_of("b")
    np.testing.assert_array_equal(p.page_table[0, :3], a_pages)
    np.testing.assert_array_equal(p.page_table[1, :1], b_pages)
    assert (p.page_table[0, 3:] == -1).all() and (p.page_table[1, 1:] == -1).all()
    assert p.capacity == 32
    np.testing.assert_array_equal(p.token_offsets, [0, 6, 7])
    np.testing.assert_array_equal(p.positions(), [3, 4, 5, 6, 7, 8, 0])
    expect = [a_pages[t // PS] * PS + t % PS for t in range(3, 9)] + [b_pages[0] * PS]
    np.testing.assert_array_equal(p.slot_mapping(), expect)
    pid = p.position_ids()
    np.testing.assert_array_equal(pid, [[3, 4, 5, 6, 7, 8], [0, -1, -1, -1, -1, -1]])
    # masks against a brute-force loop
    km, am = p.key_mask(), p.attention_mask()
    assert km.shape == (2, 32) and am.shape == (2, 6, 32)
    for b in range(2):
        for c in range(32):
            assert km[b, c] == (c < p.lengths[b])
            for t in range(6):
                assert am[b, t, c] == (t < p.new_tokens[b] and c <= p.start[b] + t)
    runs = p.runs()
    assert [(r.tolist(), t) for r, t in runs] == [([1], 1), ([0], 6)]
    run_step(store, p)
    cache.done(p)
    assert read_back(cache, store, "a") == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert read_back(cache, store, "b") == [10]
    assert cache.page_info(a_pages[2]).positions == range(8, 9)
    np.testing.assert_array_equal(cache.key_mask(["a"])[0, :10], [1] * 9 + [0])
    check_invariants(cache, store)


def test_entries_limit_refuses_a_fragmented_sequence():
    """Every write of 1 opens a page because another sequence holds the shared page's mark: entries grow
    faster than pages, and max_entries refuses (nothing changed) before the token capacity."""
    cache2, store2 = make(num_pages=64, max_pages=8, max_entries=9)
    cache2.new_sequence("a")
    step(cache2, store2, {"a": [0]})
    for i in range(8):                              # "a" is never the first claimant: one entry per token
        cache2.fork("a", ("b", i))
        step(cache2, store2, [(("b", i), [9]), ("a", [i + 1])])
        cache2.remove(("b", i))
    assert cache2.fills_of("a") == (1,) * 9 and cache2.length("a") == 9
    cache2.fork("a", "c")
    before = snapshot(cache2, store2)
    r = cache2.admit([("c", [7]), ("a", [5])])     # "c" claims the mark: "a" would need a 10th entry
    assert not r and r.kind == "sequence_full" and r.pages_needed == 10
    assert "needs 10 page-table entries > max_entries 9" in r.reason and "shared partly filled" in r.reason
    assert_same(before, snapshot(cache2, store2))
    with pytest.raises(CacheProtocolError, match="max_entries 3 < max_pages_per_seq 4"):
        PageCache(store2, PS, 4, 2, max_entries=3)


def test_fresh_id_skips_live_and_removed_ids():
    cache, store = make()
    cache.new_sequence(0)
    cache.new_sequence(2)
    cache.remove(2)
    assert [cache.fresh_id() for _ in range(3)] == [1, 3, 4]


def test_page_table_buffer_is_reused_across_steps():
    cache, store = make()
    cache.new_sequence(1)
    p1 = step(cache, store, {1: [1]})
    p2 = step(cache, store, {1: [2]})
    assert p1.page_table.base is p2.page_table.base is cache._step_table
    assert p2.page_table.ctypes.data == cache._step_table.ctypes.data


def test_counts_without_ids_stop_prefix_keys():
    cache, store = make()
    cache.new_sequence(1)
    p = cache.admit({1: 5})
    assert p.tokens == [None]
    run_step(store, p, {1: [1, 2, 3, 4, 5]})
    cache.done(p)
    assert cache.tokens_of(1) is None and cache.page_info(cache.pages_of(1)[0]).key is None
    assert read_back(cache, store, 1) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad, cls, words", [
    ({}, CacheProtocolError, "empty step"),
    ({9: [1]}, CacheProtocolError, "unknown sequence 9"),
    ([(1, [1]), (1, [2])], SequenceBusyError, "stepped twice in one step"),
    ({1: 0}, CacheProtocolError, "0 new tokens"),
    ({1: []}, CacheProtocolError, "0 new tokens"),
    ({1: [1.5]}, CacheProtocolError, "integer ids"),
    ({1: [[1]]}, CacheProtocolError, "1-D"),
    ([1], CacheProtocolError, "(sequence, tokens) pairs"),
])
def test_admit_protocol_errors_change_nothing(bad, cls, words):
    cache, store = make()
    cache.new_sequence(1)
    step(cache, store, {1: [1, 2]})
    before = snapshot(cache, store)
    with pytest.raises(cls, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        cache.admit(bad)
    assert isinstance(e.value, OrtkvError)
    assert_same(before, snapshot(cache, store))


def test_refusal_by_store_is_all_or_nothing():
    cache, store = make(num_pages=3)
    cache.new_sequence(1)
    cache.new_sequence(2)
    step(cache, store, {1: [1, 2, 3, 4, 5]})       # 2 pages
    before = snapshot(cache, store)
    r = cache.admit({1: [6], 2: [1, 2, 3, 4, 5]})  # needs 2 more; 1 left
    assert isinstance(r, Refusal) and not r and r.kind == "store" and r.pages_needed == 2
    assert "refused 2 pages" in r.reason and "no room" in r.reason
    assert_same(before, snapshot(cache, store))
    assert store.refusals == 1
    step(cache, store, {1: [6], 2: [7]})           # fits: 1 page for 2
    check_invariants(cache, store)


def test_refusal_sequence_full():
    cache, store = make(max_pages=2)
    cache.new_sequence(1)
    before = snapshot(cache, store)
    r = cache.admit({1: list(range(9))})
    assert not r and r.kind == "sequence_full" and r.seq == 1 and r.pages_needed == 3
    assert "max_pages_per_seq 2" in r.reason
    assert_same(before, snapshot(cache, store))


def test_busy_while_a_step_is_admitted_and_cancel_undoes_it():
    cache, store = make()
    cache.new_sequence(1)
    step(cache, store, {1: [1, 2, 3, 4, 5, 6]})
    cache.fork(1, 2)
    before = snapshot(cache, store)
    p = cache.admit({1: [7, 8, 9], 2: [10]})
    assert len(p.allocated) == 2   # 1 appends to its shared last page, then page 2; 2 opens a page
    for call in (lambda: cache.admit({1: [1]}), lambda: cache.fork(1, 3), lambda: cache.remove(1),
                 lambda: cache.remove(2, 1), lambda: cache.new_sequence(5), lambda: cache.reorder([1, 2], [1, 1]),
                 lambda: cache.requantize(cache.pages_of(1)[0], 2), lambda: cache.fork_n(1, [7])):
        with pytest.raises(SequenceBusyError, match="admitted and not finished"):
            call()
    other = Refusal("x", "store")
    with pytest.raises(CacheProtocolError, match="not the step admitted last"):
        cache.done(other)
    cache.cancel(p)
    after = snapshot(cache, store)
    assert_same(before[:8], after[:8])               # metadata, table, live pages: as before the admit
    with pytest.raises(CacheProtocolError, match="not the step admitted last"):
        cache.cancel(p)
    step(cache, store, {1: [7, 8, 9], 2: [10]})
    assert read_back(cache, store, 1) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert read_back(cache, store, 2) == [1, 2, 3, 4, 5, 6, 10]


# -- fork, reorder: table changes, never a copy (Note [Page metadata]) -------------------------------
def test_fork_shares_every_page_and_never_copies():
    cache, store = make()
    cache.new_sequence(0)
    step(cache, store, {0: list(range(1, 11))})    # 10 tokens: pages 0, 1 full, page 2 holds 2 rows
    live = len(store.live)
    cache.fork(0, 1)
    assert len(store.live) == live and store.bytes_copied == 0
    assert cache.pages_of(1) == cache.pages_of(0) and cache.fills_of(1) == cache.fills_of(0) == (4, 4, 2)
    for pid in cache.pages_of(0):
        assert cache.page_info(pid).owners == {0, 1} and cache.page_info(pid).refcount == 2
    np.testing.assert_array_equal(cache.page_table([0]), cache.page_table([1]))
    np.testing.assert_array_equal(cache.page_fill([0]), cache.page_fill([1]))
    last = cache.pages_of(0)[2]
    p = step(cache, store, {1: [99]})              # 1 holds the mark of the shared page: appends in place
    assert p.allocated == [] and cache.fills_of(1) == (4, 4, 3) and cache.fills_of(0) == (4, 4, 2)
    assert cache.page_info(last).positions == range(8, 11)
    assert read_back(cache, store, 1) == list(range(1, 11)) + [99]
    p = step(cache, store, {0: [50]})              # 0 sees 2 rows of it, below the mark: a new page
    assert len(p.allocated) == 1 and cache.pages_of(0)[:3] == cache.pages_of(1)
    assert cache.fills_of(0) == (4, 4, 2, 1) and cache.page_info(p.allocated[0]).positions == range(10, 11)
    assert read_back(cache, store, 0) == list(range(1, 11)) + [50]
    assert read_back(cache, store, 1) == list(range(1, 11)) + [99]
    assert store.bytes_copied == 0 and cache.pages_opened_by_sharing == 1


def test_fork_at_a_page_boundary_copies_nothing():
    cache, store = make()
    cache.new_sequence(0)
    step(cache, store, {0: list(range(8))})
    cache.fork_n(0, [1, 2, 3])
    p = step(cache, store, {0: [8], 1: [9], 2: [10], 3: [11]})
    assert len(p.allocated) == 4 and cache.pages_opened_by_sharing == 0
    assert store.bytes_copied == 0
    for s, t in zip(range(4), range(8, 12)):
        assert read_back(cache, store, s) == list(range(8)) + [t]


def test_owners_writing_a_shared_partial_page_first_claimant_appends():
    cache, store = make()
    cache.new_sequence(0)
    step(cache, store, {0: [1, 2]})
    cache.fork_n(0, [1, 2])
    shared = cache.pages_of(0)[0]
    p = step(cache, store, {2: [5], 0: [3], 1: [4]})
    assert len(p.allocated) == 2 and store.bytes_copied == 0   # 2 (first in the step) appends; 0 and 1 open pages
    assert cache.fills_of(2) == (3,) and cache.fills_of(0) == cache.fills_of(1) == (2, 1)
    assert cache.page_info(shared).positions == range(0, 3)
    assert [read_back(cache, store, s) for s in range(3)] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    cache.remove(2)                                 # the mark holder leaves: the mark drops to 2 rows
    assert cache.page_info(shared).positions == range(0, 2)
    check_invariants(cache, store)


def test_cancel_restores_fills_and_marks():
    cache, store = make()
    cache.new_sequence(0)
    step(cache, store, {0: [1, 2, 3]})
    cache.fork(0, 1)
    before = snapshot(cache, store)
    p = cache.admit({0: [4, 5, 6], 1: [7]})
    assert cache.fills_of(0) == (4, 2) and cache.fills_of(1) == (3, 1)
    cache.cancel(p)
    assert_same(before[:8], snapshot(cache, store)[:8])
    check_invariants(cache, store)


def test_fork_and_fork_n_errors_change_nothing():
    cache, store = make(max_sequences=3)
    cache.new_sequence(0)
    cache.new_sequence(1)
    step(cache, store, {0: [1]})
    before = snapshot(cache, store)
    for call, cls, words in [
        (lambda: cache.fork(9, 5), CacheProtocolError, "unknown sequence 9"),
        (lambda: cache.fork(0, 1), CacheProtocolError, "already exists"),
        (lambda: cache.fork_n(0, [5, 5]), CacheProtocolError, "duplicate destination"),
        (lambda: cache.fork_n(0, [5, 6]), CacheProtocolError, "only 1 slots free"),
        (lambda: cache.new_sequence(0), CacheProtocolError, "already exists"),
    ]:
        with pytest.raises(cls, match=words):
            call()
        assert_same(before, snapshot(cache, store))
    cache.new_sequence(2)
    with pytest.raises(CacheProtocolError, match="all 3 sequence slots are in use"):
        cache.fork(0, 7)


def test_reorder_is_a_page_table_change():
    cache, store = make(num_pages=64)
    cache.new_sequence(0)
    step(cache, store, {0: list(range(6))})
    cache.fork_n(0, [1, 2, 3])
    step(cache, store, {b: [100 + b] for b in range(4)})
    hist = {b: read_back(cache, store, b) for b in range(4)}
    copied = store.bytes_copied
    live = len(store.live)
    cache.reorder([0, 1, 2, 3], [2, 2, 0, 3])       # beam 1 dropped; beam 2 doubled
    assert store.bytes_copied == copied == 0
    assert len(store.live) == live - 1              # beam 1's private last page freed
    for b, parent in zip(range(4), [2, 2, 0, 3]):
        assert read_back(cache, store, b) == hist[parent]
        assert cache.tokens_of(b) == hist[parent]
    check_invariants(cache, store)
    p = step(cache, store, {b: [200 + b] for b in range(4)})
    # beams 0 and 1 share old beam 2's last page (beam 0, first in the step, appends; beam 1 opens a
    # page); beam 2 holds the mark of old beam 0's last page and beam 3 its own: appended in place
    assert len(p.allocated) == 1 and store.bytes_copied == 0
    for b, parent in zip(range(4), [2, 2, 0, 3]):
        assert read_back(cache, store, b) == hist[parent] + [200 + b]
    with pytest.raises(CacheProtocolError, match="parent 9 is not one of"):
        cache.new_sequence(9)
        cache.reorder([0, 1], [0, 9])
    with pytest.raises(CacheProtocolError, match="2 sequences but 1 parents"):
        cache.reorder([0, 1], [0])
    with pytest.raises(SequenceBusyError, match="appears twice"):
        cache.reorder([0, 0], [0, 0])


# -- remove ----------------------------------------------------------------------------------------
def test_remove_frees_only_pages_no_other_owner_holds():
    cache, store = make(prefix_caching=False)
    cache.new_sequence(0)
    step(cache, store, {0: list(range(6))})
    cache.fork(0, 1)
    step(cache, store, {1: [6, 7, 8]})             # 1 appends 2 rows to the shared page 1, then page 2
    shared, partial = cache.pages_of(0)
    assert cache.fills_of(1) == (4, 4, 1) and cache.page_info(partial).positions == range(4, 8)
    live = set(store.live)
    cache.remove(1)
    freed = live - set(store.live)
    assert shared in store.live and cache.page_info(shared).owners == {0}
    assert len(freed) == 1 and shared not in freed and partial not in freed
    assert cache.page_info(partial).positions == range(4, 6)   # the mark drops to 0's 2 rows
    for call in (lambda: cache.admit({1: [1]}), lambda: cache.fork(1, 5), lambda: cache.remove(1),
                 lambda: cache.new_sequence(1), lambda: cache.fork(0, 1), lambda: cache.length(1)):
        with pytest.raises(SequenceRemovedError, match="removed"):
            call()
    cache.remove(0)
    assert store.live == frozenset() and cache.held_pages == frozenset()


def test_remove_suffix_and_write_again():
    cache, store = make(prefix_caching=False)
    cache.new_sequence(0)
    step(cache, store, {0: list(range(10))})
    pages = cache.pages_of(0)
    cache.remove(0, 5)
    assert cache.length(0) == 5 and cache.pages_of(0) == pages[:2]
    assert pages[2] not in store.live
    np.testing.assert_array_equal(cache.page_table([0])[0, :3], [pages[0], pages[1], -1])
    cache.remove(0, 7, None)                       # past the end: nothing
    cache.remove(0, 5, 100)                        # empty range at the end: nothing
    assert cache.length(0) == 5
    p = step(cache, store, {0: [50, 51]})
    assert p.allocated == [] and cache.fills_of(0) == (4, 3)   # the sole owner's mark dropped to 1: appends
    assert read_back(cache, store, 0) == [0, 1, 2, 3, 4, 50, 51]
    cache.remove(0, 0)
    assert cache.length(0) == 0 and cache.pages_of(0) == () and store.live == frozenset()
    step(cache, store, {0: [1]})                   # an emptied sequence is still usable


def test_remove_errors_change_nothing():
    cache, store = make()
    cache.new_sequence(0)
    step(cache, store, {0: list(range(10))})
    before = snapshot(cache, store)
    with pytest.raises(CacheProtocolError, match=r"positions \[6, 10\) would remain after a hole.*remove a suffix"):
        cache.remove(0, 2, 6)
    with pytest.raises(CacheProtocolError, match="0 <= p0 <= p1"):
        cache.remove(0, 5, 3)
    with pytest.raises(CacheProtocolError, match="0 <= p0 <= p1"):
        cache.remove(0, -1)
    with pytest.raises(CacheProtocolError, match="unknown sequence 4"):
        cache.remove(4)
    assert_same(before, snapshot(cache, store))


def test_truncating_into_a_shared_page_opens_a_page_on_the_next_write():
    cache, store = make(prefix_caching=False)
    cache.new_sequence(0)
    step(cache, store, {0: list(range(8))})
    cache.fork(0, 1)
    cache.remove(1, 6)
    assert cache.pages_of(1) == cache.pages_of(0) and cache.fills_of(1) == (4, 2)
    p = step(cache, store, {1: [60]})
    assert len(p.allocated) == 1 and cache.pages_of(1)[:2] == cache.pages_of(0) and store.bytes_copied == 0
    assert read_back(cache, store, 1) == [0, 1, 2, 3, 4, 5, 60]
    assert read_back(cache, store, 0) == list(range(8))


# -- prefix caching --------------------------------------------------------------------------------
def test_prefix_reuse_and_keys():
    cache, store = make(num_pages=64, model_key=b"m1")
    prompt = list(range(10, 23))                     # 13 tokens: 3 full pages
    assert cache.new_sequence(0, prompt) == 0
    step(cache, store, {0: prompt})
    keys = chain_hashes(prompt, PS, b"m1")
    assert len(keys) == 3
    h0 = hashlib.blake2b(b"m1" + np.asarray(prompt[:4], "<i8").tobytes(), digest_size=16).digest()
    assert keys[0] == h0
    assert [cache.page_info(p).key for p in cache.pages_of(0)] == keys + [None]
    other = prompt[:9] + [7, 7, 7, 7]
    assert cache.new_sequence(1, other) == 8        # pages 0, 1 match; page 2 differs
    assert cache.pages_of(1) == cache.pages_of(0)[:2]
    assert cache.prefix.hits == 2
    p = step(cache, store, {1: other[8:]})
    assert p.start.tolist() == [8] and len(p.allocated) == 2
    assert read_back(cache, store, 1) == other
    # a prompt that is exactly cached pages: its last token still runs
    assert cache.new_sequence(2, prompt[:12]) == 8
    # another model's key shares nothing
    cache2, store2 = make(model_key=b"m2")
    assert chain_hashes(prompt, PS, b"m2")[0] != keys[0]


def test_unreferenced_prefix_pages_are_kept_then_evicted_lru():
    cache, store = make(num_pages=6)
    cache.new_sequence("a", list(range(9)))
    step(cache, store, {"a": list(range(9))})       # 3 pages, 2 keyed
    cache.new_sequence("b", list(range(100, 109)))
    step(cache, store, {"b": list(range(100, 109))})
    a_pages, b_pages = cache.pages_of("a"), cache.pages_of("b")
    cache.remove("a")
    cache.remove("b")
    assert cache.cached_pages == {*a_pages[:2], *b_pages[:2]}
    assert store.live == cache.cached_pages             # unkeyed last pages were freed
    # 'a' comes back: its pages are taken out of the LRU
    assert cache.new_sequence("a2", list(range(9))) == 8
    assert cache.cached_pages == set(b_pages[:2])
    # a request needing 4 pages: 2 free, then b's two (LRU: b's first page first) are evicted
    cache.new_sequence("c")
    p = cache.admit({"c": list(range(200, 214))})
    assert p and cache.prefix.evictions == 2 and cache.cached_pages == frozenset()
    assert set(a_pages[:2]) <= store.live                 # owned pages are never evicted
    run_step(store, p)
    cache.done(p)
    check_invariants(cache, store)
    cache.new_sequence("d")
    before = snapshot(cache, store)
    r = cache.admit({"d": [1]})
    assert not r and r.kind == "store"
    assert_same(before, snapshot(cache, store))


def test_writing_in_place_into_a_keyed_page_drops_its_key():
    cache, store = make()
    cache.new_sequence(0, list(range(8)))
    step(cache, store, {0: list(range(8))})
    page1 = cache.pages_of(0)[1]
    key = cache.page_info(page1).key
    assert key is not None and cache.prefix.by_key[key] == page1
    cache.remove(0, 6)
    step(cache, store, {0: [66, 67]})
    assert cache.pages_of(0)[1] == page1 and cache.page_info(page1).key == chain_hashes(
        [0, 1, 2, 3, 4, 5, 66, 67], PS)[1]
    assert read_back(cache, store, 0) == [0, 1, 2, 3, 4, 5, 66, 67]
    assert cache.new_sequence(1, list(range(8)) + [9]) == 4   # the old page 1 is no longer offered


def test_requantize_full_pages_only():
    cache, store = make()
    store._page_bytes[2] = 1
    cache.new_sequence(0)
    step(cache, store, {0: list(range(6))})
    full, partial = cache.pages_of(0)
    cache.requantize(full, 2)
    assert cache.page_info(full).fmt == 2 and store.format_of(full) == 2
    before = snapshot(cache, store)
    with pytest.raises(CacheProtocolError, match="holds 2 of 4 rows"):
        cache.requantize(partial, 2)
    with pytest.raises(CacheProtocolError, match="page 99 is not held"):
        cache.requantize(99, 2)
    assert_same(before, snapshot(cache, store))


def test_constructor_and_store_errors():
    with pytest.raises(CacheProtocolError, match="page_size must be positive"):
        PageCache(MemoryPageStore(1, 1), 0, 4)
    with pytest.raises(CacheProtocolError, match="num_pages 0"):
        MemoryPageStore(0, 4)
    s = MemoryPageStore(1, 4)
    with pytest.raises(CacheProtocolError, match="no page size for format 3"):
        s.alloc(3)
    pid = s.alloc(0)
    with pytest.raises(CapacityError, match="no room for one more page"):
        s.alloc(0)
    s.free(pid)
    with pytest.raises(CacheProtocolError, match="not live"):
        s.free(pid)
    b = MemoryPageStore(4, 4, {0: 100}, budget_bytes=250)
    b.alloc(0), b.alloc(0)
    with pytest.raises(CapacityError) as e:
        b.alloc(0)
    assert e.value.capacity == 250 and e.value.requested == 300


# -- scheduler -------------------------------------------------------------------------------------
def _next_token(history) -> int:
    return int(hashlib.blake2b(np.asarray(history, "<i8").tobytes(), digest_size=4).hexdigest(), 16) % 500


def make_forward(sched, store):
    """A fake model that reads each row's whole history back from the store through the page
    table, so a wrong page, copy or position changes its output."""
    def forward(step):
        run_step(store, step.placement)
        out = {}
        for row in step.rows:
            if row.wants_token:
                h = read_back(sched.cache, store, row.seq)
                if row.draws > 1:
                    out[row.seq] = [_next_token(h + [i]) for i in range(row.draws)]
                else:
                    out[row.seq] = _next_token(h)
        return out
    return forward


def reference(prompt, max_new, n=1, eos=None):
    outs = []
    first = [_next_token(prompt + [i]) for i in range(n)] if n > 1 else [_next_token(prompt)]
    for i in range(n):
        h = list(prompt) + [first[i]]
        while h[-1] != eos and len(h) - len(prompt) < max_new:
            h.append(_next_token(h))
        outs.append(h[len(prompt):])
    return outs


def test_scheduler_shared_system_prompt_prefills_only_suffixes():
    store = MemoryPageStore(512, 16)
    cache = PageCache(store, 16, 64, 64)
    sched = Scheduler(cache, max_step_tokens=4096)
    system = list(range(1000, 1512))
    first = sched.submit(system + [1], 4)
    fwd = make_forward(sched, store)
    events = sched.complete(s := sched.schedule(), fwd(s))   # request 1 alone first
    rest = [sched.submit(system + [2 + i, 3 + i], 4) for i in range(31)]
    events += list(sched.stream(fwd))
    assert sched.prefill_tokens == 513 + 31 * 2
    assert sched.reused_tokens == 31 * 512
    assert sched.result(first) == reference(system + [1], 4)
    for i, rid in enumerate(rest):
        assert sched.result(rid) == reference(system + [2 + i, 3 + i], 4)
        assert sched.finish_reasons(rid) == ["max_new_tokens"]
    assert sum(1 for e in events if e.finished) == 32
    assert cache.sequences == [] and store.live == cache.cached_pages
    check_invariants(cache, store)


def test_scheduler_preempts_and_recomputes_when_the_store_refuses():
    store = MemoryPageStore(12, PS)
    cache = PageCache(store, PS, 16, 16)
    sched = Scheduler(cache, max_step_tokens=64)
    prompts = [[i * 10 + j for j in range(7)] for i in range(5)]
    ids = [sched.submit(p, 9) for p in prompts]
    list(sched.stream(make_forward(sched, store)))
    assert sched.preemptions > 0
    for rid, p in zip(ids, prompts):
        assert sched.result(rid) == reference(p, 9)
    assert cache.sequences == []
    check_invariants(cache, store)


def test_scheduler_parallel_samples_share_the_prompt():
    store = MemoryPageStore(64, PS)
    cache = PageCache(store, PS, 16, 16, prefix_caching=False)
    sched = Scheduler(cache)
    prompt = list(range(30, 40))                     # 10 tokens: 2 full pages + 2 rows
    rid = sched.submit(prompt, 3, n=4)
    fwd = make_forward(sched, store)
    sched.complete(s := sched.schedule(), fwd(s))
    seqs = [smp.seq for smp in sched._requests[rid].samples]
    assert len(seqs) == 4 and len(store.live) == 3   # 4 samples, the prompt's 3 pages
    sched.complete(s := sched.schedule(), fwd(s))
    assert len(store.live) == 3 + 3                  # 3 samples open a page, 1 appends to the shared one
    assert store.bytes_copied == 0
    list(sched.stream(fwd))
    assert sched.result(rid) == reference(prompt, 3, n=4)
    assert store.live == frozenset()


def test_scheduler_eos_length_and_errors():
    store = MemoryPageStore(8, PS)
    cache = PageCache(store, PS, 3, 8)
    sched = Scheduler(cache)
    p = [5, 6, 7]
    eos = reference(p, 5)[0][1]
    r_eos = sched.submit(p, 5, eos_token_id=eos)
    r_len = sched.submit([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 10)   # 12 cells max: stops at length
    fwd = make_forward(sched, store)
    step_ = sched.schedule()
    with pytest.raises(CacheProtocolError, match="schedule: the previous step is not completed"):
        sched.schedule()
    with pytest.raises(CacheProtocolError, match="no sampled token for sequence"):
        sched.complete(step_, {})
    sched.complete(step_, fwd(step_))
    list(sched.stream(fwd))
    assert sched.result(r_eos) == [reference(p, 5)[0][:2]] and sched.finish_reasons(r_eos) == ["eos"]
    # 12 cells: positions 0..11 hold the prompt and 2 generated tokens; the 3rd never needs a cell
    assert sched.finish_reasons(r_len) == ["length"] and len(sched.result(r_len)[0]) == 3
    with pytest.raises(CacheProtocolError, match="empty prompt"):
        sched.submit([], 3)
    with pytest.raises(CacheProtocolError, match="must be >= 1"):
        sched.submit([1], 0)
    small = Scheduler(PageCache(MemoryPageStore(2, PS), PS, 8, 4))
    small.submit(list(range(12)), 2)
    with pytest.raises(CapacityError, match="does not fit in the page store even with nothing else running"):
        small.schedule()


def test_docs_cache_md_examples_run():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "cache.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    prompt = list(range(40))
    ns = {"prompt_ids": prompt}
    ns["forward"] = lambda step: make_forward(ns["sched"], ns["store"])(step)
    exec(blocks[0], ns)
    cache, store = ns["cache"], ns["store"]
    run_step(store, ns["p"])                          # the run the block's comment stands for
    assert ns["reused"] == 0 and cache.length(1) == 40 and read_back(cache, store, 1) == prompt
    exec(blocks[1], ns)
    rid = ns["rid"]
    assert ns["sched"].result(rid) == reference(prompt, 64, n=4, eos=2)
    assert ns["sched"].reused_tokens == 32            # the prompt's first two pages were cached by block 1

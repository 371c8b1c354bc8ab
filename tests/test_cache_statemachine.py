"""A hypothesis state machine over random new / step (done or cancel) / fork / reorder / remove /
truncate / finish on a small store (so refusals, evictions and shared partly filled pages happen
often). After every rule: no page leaked, none freed while owned, refcount = owners, every sequence
reads back exactly its tokens through its page table and fills (Note [Page fill]), every mask equals a
brute-force reference, and no KV byte was ever copied (forks and reorders are table changes; a step
writes only rows no other sequence sees)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ortkv.cache import MemoryPageStore, PageCache, Refusal, SequenceRemovedError
from ortkv.reference.paged import position_map
from test_cache_layer import assert_same, check_invariants, read_back, run_step, snapshot

PS = 4
MAX_PAGES = 6
TOKENS = st.integers(0, 2)     # a tiny alphabet: prompts collide, so prefix pages are reused


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = MemoryPageStore(14, PS)
        self.cache = PageCache(self.store, PS, MAX_PAGES, max_sequences=6, model_key=b"sm")
        self.expect: dict[int, list[int]] = {}     # the model: each live sequence's tokens
        self.removed: set[int] = set()
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @precondition(lambda self: self.cache.free_slots > 0)
    @rule(prompt=st.none() | st.lists(TOKENS, min_size=1, max_size=14))
    def new(self, prompt):
        sid = self._new_id()
        reused = self.cache.new_sequence(sid, prompt)
        if prompt is None:
            assert reused == 0
        else:
            assert reused % PS == 0 and reused <= max(0, len(prompt) - 1)
        self.expect[sid] = [] if prompt is None else list(prompt[:reused])

    @precondition(lambda self: self.expect)
    @rule(data=st.data(), run=st.booleans())
    def step(self, data, run):
        ids = sorted(self.expect)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids), unique=True))
        entries = []
        for sid in chosen:
            if data.draw(st.booleans()):
                entries.append((sid, data.draw(st.lists(TOKENS, min_size=1, max_size=7))))
            else:
                entries.append((sid, data.draw(st.integers(1, 7))))
        before = snapshot(self.cache, self.store)
        p = self.cache.admit(entries)
        if isinstance(p, Refusal):
            assert not p and p.kind in ("store", "sequence_full")
            if p.kind == "sequence_full":
                assert_same(before, snapshot(self.cache, self.store))
            else:   # only evictions of unreferenced cached pages may have happened
                assert_same(before[1:3], snapshot(self.cache, self.store)[1:3])
            for sid, val in entries:
                assert self.cache.length(sid) == len(self.expect[sid])
            return
        self._check_placement(p, entries, before)
        if not run:
            self.cache.cancel(p)
            return
        values = {}
        for sid, val in entries:
            values[sid] = list(val) if isinstance(val, list) else [int(x) for x in
                                                                    data.draw(st.lists(TOKENS, min_size=val, max_size=val))]
        run_step(self.store, p, {s: v for s, v in values.items()})
        self.cache.done(p)
        for sid, v in values.items():
            self.expect[sid] += v

    def _check_placement(self, p, entries, before):
        counts = [len(v) if isinstance(v, list) else v for _, v in entries]
        assert p.seq_ids == tuple(s for s, _ in entries)
        np.testing.assert_array_equal(p.start, [len(self.expect[s]) for s, _ in entries])
        np.testing.assert_array_equal(p.new_tokens, counts)
        km, am, pos = p.key_mask(), p.attention_mask(), p.position_ids()
        cells = MAX_PAGES * PS
        for b, (sid, _) in enumerate(entries):
            start, n = int(p.start[b]), counts[b]
            assert [bool(km[b, c]) for c in range(cells)] == [c < start + n for c in range(cells)]
            for t in range(am.shape[1]):
                assert [bool(am[b, t, c]) for c in range(cells)] == [t < n and c <= start + t for c in range(cells)]
                assert pos[b, t] == (start + t if t < n else -1)
            # every (page, row) the row writes is one no other sequence saw before the step (so sharing
            # never needs a copy), reached through this step's table and fill rows
            where = position_map(p.page_table[b], p.page_fill[b], PS, start + n)
            for t in range(start, start + n):
                page, row = where[t]
                assert page >= 0 and sid in self.cache.page_info(page).owners
                if page in before[0]:
                    for other, seen in before[0][page][3]:
                        assert other == sid or seen <= row, (sid, other, page, row, seen)
        slots = p.slot_mapping()
        assert len(set(slots.tolist())) == len(slots), "two tokens of one step share a cell"
        assert not hasattr(p, "copies")

    @precondition(lambda self: self.expect and self.cache.free_slots > 0)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.expect)))
        dst = self._new_id()
        live = self.store.live
        self.cache.fork(src, dst)
        assert self.store.live == live and self.cache.pages_of(dst) == self.cache.pages_of(src)
        assert self.cache.fills_of(dst) == self.cache.fills_of(src)
        self.expect[dst] = list(self.expect[src])

    @precondition(lambda self: len(self.expect) >= 2)
    @rule(data=st.data())
    def reorder(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.expect)), min_size=2, max_size=len(self.expect),
                                 unique=True))
        parents = data.draw(st.lists(st.sampled_from(ids), min_size=len(ids), max_size=len(ids)))
        live = self.store.live
        self.cache.reorder(ids, parents)
        assert self.store.live <= live   # a reorder only drops pages, never makes one
        new = {i: list(self.expect[p]) for i, p in zip(ids, parents)}
        self.expect.update(new)

    @precondition(lambda self: self.expect)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(sorted(self.expect)))
        p0 = data.draw(st.integers(0, len(self.expect[sid]) + 2))
        self.cache.remove(sid, p0)
        del self.expect[sid][p0:]

    @precondition(lambda self: self.expect)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.expect)))
        owned_by_others = {pid for s in self.expect if s != sid for pid in self.cache.pages_of(s)}
        self.cache.remove(sid)
        del self.expect[sid]
        self.removed.add(sid)
        assert owned_by_others <= self.store.live

    @precondition(lambda self: self.removed)
    @rule(data=st.data())
    def use_removed(self, data):
        sid = data.draw(st.sampled_from(sorted(self.removed)))
        before = snapshot(self.cache, self.store)
        with pytest.raises(SequenceRemovedError):
            self.cache.admit({sid: [1]})
        assert_same(before, snapshot(self.cache, self.store))

    @invariant()
    def consistent(self):
        check_invariants(self.cache, self.store)
        assert self.store.bytes_copied == 0, "a KV byte was copied"
        for sid, toks in self.expect.items():
            assert self.cache.length(sid) == len(toks)
            assert read_back(self.cache, self.store, sid) == toks
        if self.expect:
            ids = sorted(self.expect)
            km = self.cache.key_mask(ids)
            for b, sid in enumerate(ids):
                assert km[b].sum() == len(self.expect[sid]) and km[b, :len(self.expect[sid])].all()


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase

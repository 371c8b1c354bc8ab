"""Page and sequence metadata apart from storage: ``PageCache``, its ``Placement`` / ``Refusal``.

Note [Page metadata]
~~~~~~~~~~~~~~~~~~~~
Storage (a ``PageStore``, Note [Page store protocol]) holds bytes; ``PageCache`` holds what they mean.
Per page: its format, its logical index k (it holds positions [k*page_size, k*page_size + filled)
for EVERY owner: pages are shared only between sequences that agree on those positions, by fork,
reorder or a prefix-cache hit), ``filled`` (rows ever written, a high-water mark), its owner set
(refcount = number of owners) and its prefix key (Note [Prefix hash chain]). Per sequence: its page
list, its length, a row ("slot") of the persistent page table, and, when token ids are known, its
tokens and the keys of its full pages.

Invariants (the state-machine test checks them after every operation):
  * len(seq.pages) == ceil(seq.length / page_size); positions [0, length) are all valid (no holes:
    the paged ops read a sequence's positions [0, start + t] through page_table; hence ``remove``
    takes a suffix or the whole sequence, never a middle range);
  * page.owners == {s : page in s.pages}; a page in the store is owned, or unowned and cached;
  * the table row of a sequence equals its page list, -1 after it.

A sequence's view of a shared page is bounded by its own length, so a page may hold rows past one
owner's length (written by another owner, or before a truncation). Writing into a page is allowed
only when the writer is its sole owner; otherwise the writer gets a copy first (copy-on-write), and
only the last, partly filled page of a sequence can ever be written, so only such pages are copied.

Note [Admission]
~~~~~~~~~~~~~~~~
``admit(step)`` takes a whole step (new tokens of each running sequence, counts may differ) BEFORE
the run and returns a ``Placement`` or a ``Refusal``; never a half-admitted step:
  1. validate everything (protocol errors raise, nothing changed; a sequence that would outgrow
     ``max_pages_per_seq`` is a ``Refusal``);
  2. count the pages the step needs: new pages past each sequence's last one, plus one copy for each
     writer of a shared partly filled page (when every owner of the page writes in this step, the
     last of them keeps it, so k writers of a page held by r owners copy k, or k - 1 when k == r);
  3. allocate all of them from the store, evicting cold unreferenced prefix pages when it refuses;
     if it still refuses, give back what was taken and return a ``Refusal`` (no metadata changed);
  4. apply: copy-on-write swaps, new pages, lengths. Nothing here can fail.
So a step that was admitted cannot fail to allocate during the run. Copy-on-write is lazy: ``fork``
and ``reorder`` share every page, the partly filled last one included, and the copy happens at the
first write (often never: a beam dropped before its next step costs nothing), as ``Placement.copies``.
Between ``admit`` and ``done`` (or ``cancel``) the cache refuses every other mutating call
(``SequenceBusyError``); ``done`` records rows written and registers newly full pages for prefix
reuse, ``cancel`` undoes the step (lengths, new pages, copy-on-write swaps).

Per step the work is O(batch) Python plus O(batch x max_pages) numpy (the page-table rows are copied
from the persistent table with one np.take into a buffer that stays the same across steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import CacheProtocolError, CapacityError, SequenceBusyError, SequenceRemovedError
from .prefix import PrefixIndex, chain_hashes


class _Page:
    __slots__ = ("fmt", "index", "filled", "owners", "key")

    def __init__(self, fmt: int, index: int, filled: int, owner: int):
        self.fmt, self.index, self.filled = fmt, index, filled
        self.owners = {owner}
        self.key: bytes | None = None


class _Seq:
    __slots__ = ("id", "pages", "length", "tokens", "keys", "slot")

    def __init__(self, seq_id: int, slot: int):
        self.id, self.slot = seq_id, slot
        self.pages: list[int] = []
        self.length = 0
        self.tokens: list[int] | None = []
        self.keys: list[bytes] = []


@dataclass(frozen=True)
class PageCopy:
    """Copy-on-write request for the storage layer, to run before the step: ``rows`` leading rows of
    page ``src`` are what the writer needs in ``dst`` (a store copies the slot)."""
    src: int
    dst: int
    rows: int


@dataclass(frozen=True)
class PageInfo:
    fmt: int
    index: int
    positions: range
    owners: frozenset
    refcount: int
    key: bytes | None


@dataclass
class Refusal:
    """Admission refused the whole step; nothing changed. ``kind`` is "store" (the page store refused
    ``pages_needed`` pages after evicting every unreferenced cached page) or "sequence_full" (``seq``
    would need more than ``max_pages_per_seq`` pages). Falsy, so ``if placement:`` tells them apart."""
    reason: str
    kind: str
    pages_needed: int = 0
    seq: int | None = None

    def __bool__(self) -> bool:
        return False


@dataclass
class Placement:
    """Where an admitted step's tokens go. Row b is sequence ``seq_ids[b]``: it writes
    ``new_tokens[b]`` tokens at positions [start[b], start[b] + new_tokens[b]).

    ``page_table`` (int32 [batch, max_pages_per_seq], -1 = none) and ``start`` (int64 [batch]) are
    what PagedCacheUpdate / PagedCacheAttention take; ``page_table`` is a view of a buffer the cache
    reuses every step (bind it in place; it is valid until the next ``admit``). Run ``copies`` on the
    store before the step. ``allocated`` lists the pages this step took from the store."""
    seq_ids: tuple
    start: np.ndarray
    new_tokens: np.ndarray
    page_table: np.ndarray
    page_size: int
    tokens: list
    allocated: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Valid length of each row after the step (start + new tokens)."""
        return self.start + self.new_tokens

    @property
    def max_tokens(self) -> int:
        return int(self.new_tokens.max()) if self.batch else 0

    @property
    def token_offsets(self) -> np.ndarray:
        """int64 [batch + 1]: row b's tokens are [offsets[b], offsets[b+1]) of the flattened step."""
        out = np.zeros(self.batch + 1, np.int64)
        np.cumsum(self.new_tokens, out=out[1:])
        return out

    def positions(self) -> np.ndarray:
        """int64 [total tokens]: the position of every new token, rows one after another."""
        off = self.token_offsets
        total = int(off[-1])
        return np.arange(total, dtype=np.int64) - np.repeat(off[:-1] - self.start, self.new_tokens)

    def slot_mapping(self) -> np.ndarray:
        """int64 [total tokens]: page_id * page_size + row of every new token (vLLM's form)."""
        pos = self.positions()
        rows = np.repeat(np.arange(self.batch), self.new_tokens)
        return self.page_table[rows, pos // self.page_size].astype(np.int64) * self.page_size \
            + pos % self.page_size

    def position_ids(self, pad: int = -1) -> np.ndarray:
        """int64 [batch, max_tokens]: start + t where t < new_tokens[b], else ``pad``."""
        t = np.arange(self.max_tokens, dtype=np.int64)
        return np.where(t[None, :] < self.new_tokens[:, None], self.start[:, None] + t[None, :], pad)

    def key_mask(self) -> np.ndarray:
        """bool [batch, max_pages_per_seq * page_size]: cell c of row b holds a valid key after the
        step (c < length). The dense masks are O(batch x cells); the paged ops need only
        ``page_table`` and ``start`` (the same information in O(batch)), so a runner of the paged ops
        never builds them: they are for other attention kernels, and for tests."""
        cells = np.arange(self.page_table.shape[1] * self.page_size)
        return cells[None, :] < self.lengths[:, None]

    def attention_mask(self) -> np.ndarray:
        """bool [batch, max_tokens, cells]: query t of row b sees cell c iff t < new_tokens[b] and
        c <= start[b] + t (Note [CacheAttention]: causal inside the new block, nothing past the
        row's valid length)."""
        cells = np.arange(self.page_table.shape[1] * self.page_size)
        t = np.arange(self.max_tokens)
        # one pass over the cells: c < limit, limit = start + t + 1 for live queries, 0 for padding
        limit = np.where(t[None, :] < self.new_tokens[:, None], self.start[:, None] + t[None, :] + 1, 0)
        return cells[None, None, :] < limit[:, :, None]

    def runs(self) -> list[tuple[np.ndarray, int]]:
        """Rows grouped by token count: each (rows, T) is one run of the paged ops as specified today
        (key [len(rows), T, ...], page_table[rows], start[rows]), no padding written."""
        out = []
        for n in np.unique(self.new_tokens):
            out.append((np.flatnonzero(self.new_tokens == n), int(n)))
        return out


class PageCache:
    """Page metadata, admission, forks, removal and prefix caching over a ``PageStore``
    (Notes [Page metadata], [Admission], [Prefix hash chain])."""

    def __init__(self, store, page_size: int, max_pages_per_seq: int, max_sequences: int = 256,
                 fmt: int = 0, model_key: bytes = b"", prefix_caching: bool = True):
        for name, v in (("page_size", page_size), ("max_pages_per_seq", max_pages_per_seq),
                        ("max_sequences", max_sequences)):
            if int(v) <= 0:
                raise CacheProtocolError(f"PageCache: {name} must be positive, got {v}")
        self.store = store
        self.page_size = int(page_size)
        self.max_pages = int(max_pages_per_seq)
        self.max_sequences = int(max_sequences)
        self.fmt = int(fmt)
        self.model_key = bytes(model_key)
        self.prefix_caching = bool(prefix_caching)
        self._pages: dict[int, _Page] = {}
        self._seqs: dict[int, _Seq] = {}
        self._removed: set[int] = set()
        self._free_slots = list(range(self.max_sequences - 1, -1, -1))
        self._table = np.full((self.max_sequences, self.max_pages), -1, np.int32)
        self._step_table = np.full((self.max_sequences, self.max_pages), -1, np.int32)
        self.prefix = PrefixIndex()
        self._pending: Placement | None = None
        self._next_id = 0
        self.copies_requested = 0     # copy-on-write page copies handed out in placements
        self.rows_copied = 0          # their rows

    # -- lookup helpers ----------------------------------------------------------------------------
    def _seq(self, seq_id, what: str) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            if seq_id in self._removed:
                raise SequenceRemovedError(f"{what}: sequence {seq_id} was removed; removed ids are never "
                                           "reused, start a new sequence with a new id")
            raise CacheProtocolError(f"{what}: unknown sequence {seq_id}; create it with "
                                     "new_sequence() or fork() first")
        return s

    def _idle(self, what: str) -> None:
        if self._pending is not None:
            raise SequenceBusyError(f"{what}: a step of {len(self._pending.seq_ids)} sequences is admitted "
                                    "and not finished; call done(placement) after the run, or cancel(placement)")

    def _new_id(self, seq_id, what: str) -> None:
        if seq_id in self._seqs:
            raise CacheProtocolError(f"{what}: sequence {seq_id} already exists; pick a new id")
        if seq_id in self._removed:
            raise SequenceRemovedError(f"{what}: sequence id {seq_id} was removed and cannot be reused; "
                                       "pick a new id")
        if not self._free_slots:
            raise CacheProtocolError(f"{what}: all {self.max_sequences} sequence slots are in use "
                                     "(max_sequences); remove a sequence or build the cache with more")

    def _add_seq(self, seq_id) -> _Seq:
        s = _Seq(seq_id, self._free_slots.pop())
        if not self.prefix_caching:
            s.tokens = None
        self._seqs[seq_id] = s
        return s

    def _release(self, pid: int, seq_id) -> None:
        page = self._pages[pid]
        page.owners.discard(seq_id)
        if not page.owners:
            if page.key is not None:
                self.prefix.park(pid, page.key)
            else:
                del self._pages[pid]
                self.store.free(pid)

    def _own(self, pid: int, seq_id) -> None:
        page = self._pages[pid]
        if not page.owners:
            self.prefix.unpark(pid)
        page.owners.add(seq_id)

    def _alloc_many(self, n: int) -> tuple[list[int], CapacityError | None]:
        got: list[int] = []
        try:
            while len(got) < n:
                try:
                    got.append(self.store.alloc(self.fmt))
                except CapacityError:
                    cold = self.prefix.pop_coldest()
                    if cold is None:
                        raise
                    del self._pages[cold[0]]
                    self.store.free(cold[0])
        except CapacityError as e:
            for pid in got:
                self.store.free(pid)
            return [], e
        except BaseException:
            for pid in got:
                self.store.free(pid)
            raise
        return got, None

    # -- sequences ---------------------------------------------------------------------------------
    def fresh_id(self) -> int:
        """An int id no sequence has used (live or removed); ids may be any hashable otherwise."""
        while self._next_id in self._seqs or self._next_id in self._removed:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def new_sequence(self, seq_id, prompt: Sequence[int] | np.ndarray | None = None) -> int:
        """Create an empty sequence; with ``prompt`` and prefix caching on, take the cached full pages
        of its longest cached prefix (at most all but the prompt's last token: that one must run to
        give logits). Returns the number of prompt tokens already in the cache; admit the rest."""
        self._idle("new_sequence")
        self._new_id(seq_id, "new_sequence")
        keys, hits = [], []
        if prompt is not None and self.prefix_caching:
            prompt = np.asarray(prompt, dtype=np.int64)
            if prompt.ndim != 1:
                raise CacheProtocolError(f"new_sequence({seq_id}): prompt must be 1-D token ids, got shape "
                                         f"{prompt.shape}")
            usable = max(0, (prompt.size - 1) // self.page_size)
            keys = chain_hashes(prompt, self.page_size, self.model_key, count=usable)
            hits = self.prefix.lookup(keys)
        s = self._add_seq(seq_id)
        for k, pid in enumerate(hits):
            self._own(pid, seq_id)
            s.pages.append(pid)
            self._table[s.slot, k] = pid
        s.length = len(hits) * self.page_size
        s.keys = keys[:len(hits)]
        if s.tokens is not None and hits:
            s.tokens = prompt[:s.length].tolist()
        self.prefix.hits += len(hits)
        return s.length

    def fork(self, src, dst) -> None:
        """``dst`` becomes a copy of ``src`` that shares every page (no KV byte copied now; the partly
        filled last page is copied at the first write to it, Note [Admission])."""
        self._idle("fork")
        s = self._seq(src, "fork")
        self._new_id(dst, "fork")
        d = self._add_seq(dst)
        for pid in s.pages:
            self._pages[pid].owners.add(dst)
        d.pages = list(s.pages)
        d.length = s.length
        d.tokens = None if s.tokens is None else list(s.tokens)
        d.keys = list(s.keys)
        self._table[d.slot] = self._table[s.slot]

    def fork_n(self, src, dsts: Iterable) -> None:
        """Parallel sampling: ``fork(src, d)`` for every d (all ids checked first)."""
        self._idle("fork_n")
        dsts = list(dsts)
        self._seq(src, "fork_n")
        if len(set(dsts)) != len(dsts):
            raise CacheProtocolError(f"fork_n({src}): duplicate destination ids in {dsts}")
        for d in dsts:
            self._new_id(d, "fork_n")
        if len(dsts) > len(self._free_slots):
            raise CacheProtocolError(f"fork_n({src}): {len(dsts)} new sequences but only "
                                     f"{len(self._free_slots)} slots free (max_sequences {self.max_sequences})")
        for d in dsts:
            self.fork(src, d)

    def reorder(self, seq_ids: Sequence, parents: Sequence) -> None:
        """Beam search: afterwards ``seq_ids[i]`` holds what ``parents[i]`` held before (pages, length,
        tokens); every parent is one of ``seq_ids``. A page-table change: no KV byte is copied here,
        only shared partly filled pages at their next write."""
        self._idle("reorder")
        seq_ids, parents = list(seq_ids), list(parents)
        if len(seq_ids) != len(parents):
            raise CacheProtocolError(f"reorder: {len(seq_ids)} sequences but {len(parents)} parents")
        if len(set(seq_ids)) != len(seq_ids):
            raise SequenceBusyError(f"reorder: a sequence appears twice in {seq_ids}")
        seqs = [self._seq(i, "reorder") for i in seq_ids]
        members = set(seq_ids)
        for p in parents:
            if p not in members:
                self._seq(p, "reorder")  # unknown / removed first, with their own message
                raise CacheProtocolError(f"reorder: parent {p} is not one of the reordered sequences {seq_ids}")
        snap = {p: (list(self._seqs[p].pages), self._seqs[p].length, self._seqs[p].tokens,
                    list(self._seqs[p].keys)) for p in set(parents)}
        old = [s.pages for s in seqs]
        for s, p in zip(seqs, parents):           # every new owner first, then drop the old ones:
            for pid in snap[p][0]:                # a page that stays wanted is never freed between
                self._pages[pid].owners.add(s.id)
        for s, p, old_pages in zip(seqs, parents, old):
            pages, length, tokens, keys = snap[p]
            keep = set(pages)
            for pid in old_pages:
                if pid not in keep:
                    self._release(pid, s.id)
            s.pages, s.length = list(pages), length
            s.tokens = None if tokens is None else list(tokens)
            s.keys = list(keys)
        rows = np.array([self._seqs[p].slot for p in parents])  # parents' slots still hold the old rows
        self._table[[s.slot for s in seqs]] = self._table[rows].copy()

    def remove(self, seq_id, p0: int | None = None, p1: int | None = None) -> None:
        """``remove(seq)``: the sequence is gone (its id is never reused) and each of its pages that
        no other sequence owns is freed (or kept as an unreferenced prefix page). ``remove(seq, p0)``
        or ``remove(seq, p0, p1)`` with p1 >= length: positions [p0, length) are dropped (pages past
        the new length released the same way). A middle range is refused (Note [Page metadata])."""
        self._idle("remove")
        s = self._seq(seq_id, "remove")
        if p0 is None and p1 is None:
            for pid in s.pages:
                self._release(pid, seq_id)
            self._table[s.slot] = -1
            self._free_slots.append(s.slot)
            del self._seqs[seq_id]
            self._removed.add(seq_id)
            return
        p0 = 0 if p0 is None else int(p0)
        end = max(s.length, p0) if p1 is None else int(p1)
        if p0 < 0 or end < p0:
            raise CacheProtocolError(f"remove({seq_id}, {p0}, {p1}): need 0 <= p0 <= p1")
        if p0 >= s.length:
            return
        if end < s.length:
            raise CacheProtocolError(
                f"remove({seq_id}, {p0}, {p1}): positions [{end}, {s.length}) would remain after a hole, but "
                "the paged ops read a sequence's positions [0, length) without holes; remove a suffix "
                "(p1=None or p1 >= length) or the whole sequence")
        keep = -(-p0 // self.page_size)
        for pid in s.pages[keep:]:
            self._release(pid, seq_id)
        self._table[s.slot, keep:len(s.pages)] = -1
        del s.pages[keep:]
        s.length = p0
        if s.tokens is not None:
            del s.tokens[p0:]
        del s.keys[p0 // self.page_size:]

    def requantize(self, page_id: int, fmt: int) -> None:
        """Re-encode a full page in format ``fmt`` through the store (``store.requantize``); the page
        keeps its id, owners and key. Partly filled pages are refused (they are still written)."""
        self._idle("requantize")
        page = self._pages.get(page_id)
        if page is None:
            raise CacheProtocolError(f"requantize: page {page_id} is not held by the cache")
        if page.filled < self.page_size:
            raise CacheProtocolError(f"requantize: page {page_id} holds {page.filled} of {self.page_size} rows; "
                                     "only full pages are requantized (a page being filled stays in the write format)")
        self.store.requantize(page_id, int(fmt))
        page.fmt = int(fmt)

    # -- a step ------------------------------------------------------------------------------------
    def admit(self, step) -> Placement | Refusal:
        """Admit a whole step (Note [Admission]). ``step``: a mapping or (seq, tokens) pairs; tokens is
        a token count or the token ids (ids keep prefix caching going). Returns a ``Placement`` or a
        ``Refusal``."""
        self._idle("admit")
        items = list(step.items()) if isinstance(step, Mapping) else list(step)
        if not items:
            raise CacheProtocolError("admit: empty step; pass at least one (sequence, tokens)")
        ps = self.page_size
        seqs, counts, toks = [], [], []
        seen = set()
        for entry in items:
            try:
                seq_id, val = entry
            except (TypeError, ValueError):
                raise CacheProtocolError(f"admit: step entries are (sequence, tokens) pairs, got {entry!r}") from None
            s = self._seq(seq_id, "admit")
            if seq_id in seen:
                raise SequenceBusyError(f"admit: sequence {seq_id} stepped twice in one step; give each "
                                        "sequence one entry with all its new tokens")
            seen.add(seq_id)
            if isinstance(val, (int, np.integer)):
                n, ids = int(val), None
            else:
                ids = np.asarray(val)
                if ids.ndim != 1 or not (ids.size == 0 or ids.dtype.kind in "iu"):  # (np.issubdtype: 10 us a call)
                    raise CacheProtocolError(f"admit: tokens of sequence {seq_id} must be a count or 1-D "
                                             f"integer ids, got dtype {ids.dtype} shape {ids.shape}")
                n = int(ids.size)
            if n < 1:
                raise CacheProtocolError(f"admit: sequence {seq_id} has {n} new tokens; each entry needs at "
                                         "least 1 (leave idle sequences out of the step)")
            seqs.append(s), counts.append(n), toks.append(ids)
        # 1b. sequence limits, 2. pages needed
        need = 0
        writers: dict[int, int] = {}
        for s, n in zip(seqs, counts):
            end_pages = -(-(s.length + n) // ps)
            if end_pages > self.max_pages:
                return Refusal(f"sequence {s.id} at length {s.length} + {n} new tokens needs {end_pages} pages "
                               f"> max_pages_per_seq {self.max_pages}; finish or truncate it",
                               "sequence_full", end_pages, s.id)
            need += end_pages - len(s.pages)
            if s.length % ps:
                pid = s.pages[-1]
                writers[pid] = writers.get(pid, 0) + 1
        for pid, k in writers.items():
            r = len(self._pages[pid].owners)
            need += k if k < r else k - 1
        # 3. allocate all or nothing
        fresh, err = self._alloc_many(need)
        if err is not None:
            return Refusal(f"the page store refused {need} pages for this step of {len(seqs)} sequences "
                           f"(after evicting every unreferenced cached page): {err}", "store", need)
        # 4. apply
        allocated = list(fresh)
        copies, undo = [], []
        fresh.reverse()
        for s, n in zip(seqs, counts):
            start = s.length
            before = len(s.pages)
            cow = None
            if start % ps:
                pid = s.pages[-1]
                page = self._pages[pid]
                if len(page.owners) > 1:
                    new = fresh.pop()
                    rows = start - page.index * ps
                    np_ = _Page(page.fmt, page.index, rows, s.id)
                    self._pages[new] = np_
                    page.owners.discard(s.id)
                    s.pages[-1] = new
                    self._table[s.slot, before - 1] = new
                    copies.append(PageCopy(pid, new, rows))
                    self.rows_copied += rows
                    cow = pid
                elif page.key is not None:   # written in place: its content no longer matches its key
                    self.prefix.forget(page.key)
                    page.key = None
            end_pages = -(-(start + n) // ps)
            for k in range(before, end_pages):
                new = fresh.pop()
                self._pages[new] = _Page(self.fmt, k, 0, s.id)
                s.pages.append(new)
                self._table[s.slot, k] = new
            s.length = start + n
            undo.append((s, start, before, cow))
        self.copies_requested += len(copies)
        slots = np.fromiter((s.slot for s in seqs), np.intp, len(seqs))
        table = np.take(self._table, slots, axis=0, out=self._step_table[:len(seqs)])
        placement = Placement(tuple(s.id for s in seqs), np.array([u[1] for u in undo], np.int64),
                              np.array(counts, np.int64), table, ps, toks, allocated, copies, undo)
        self._pending = placement
        return placement

    def _check_pending(self, placement, what: str) -> None:
        if self._pending is None or placement is not self._pending:
            raise CacheProtocolError(f"{what}: this placement is not the step admitted last (or it was "
                                     "already finished)")

    def done(self, placement: Placement) -> None:
        """The step ran: record the rows written and key the pages it filled (prefix caching)."""
        self._check_pending(placement, "done")
        ps = self.page_size
        for (s, start, _before, _cow), ids in zip(placement._undo, placement.tokens):
            end = s.length
            for k in range(start // ps, -(-end // ps)):
                page = self._pages[s.pages[k]]
                page.filled = max(page.filled, min(ps, end - k * ps))
            if s.tokens is not None:
                if ids is None:
                    s.tokens = None        # counts only: this sequence's pages cannot be keyed
                else:
                    s.tokens.extend(ids.tolist())
            if s.tokens is not None and end // ps > len(s.keys):
                prev = s.keys[-1] if s.keys else b""
                first = len(s.keys)        # hash only the pages that filled: O(new tokens)
                new_keys = chain_hashes(s.tokens[first * ps:(end // ps) * ps], ps, self.model_key, prev)
                for k, key in enumerate(new_keys, start=len(s.keys)):
                    pid = s.pages[k]
                    page = self._pages[pid]
                    if page.key is None and self.prefix.register(key, pid):
                        page.key = key
                s.keys.extend(new_keys)
        self._pending = None

    def cancel(self, placement: Placement) -> None:
        """The step did not run: lengths, pages and copy-on-write swaps go back to before ``admit``
        (pages it allocated return to the store). Keys dropped for in-place writes stay dropped."""
        self._check_pending(placement, "cancel")
        for s, start, before, cow in reversed(placement._undo):
            for k in range(before, len(s.pages)):
                pid = s.pages[k]
                del self._pages[pid]
                self.store.free(pid)
            self._table[s.slot, before:len(s.pages)] = -1
            del s.pages[before:]
            if cow is not None:
                new = s.pages[-1]
                del self._pages[new]
                self.store.free(new)
                self._pages[cow].owners.add(s.id)
                s.pages[-1] = cow
                self._table[s.slot, before - 1] = cow
            s.length = start
        self._pending = None

    # -- queries -----------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Sequences that can still be created (max_sequences minus live ones)."""
        return len(self._free_slots)

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def length(self, seq_id) -> int:
        return self._seq(seq_id, "length").length

    def pages_of(self, seq_id) -> tuple:
        return tuple(self._seq(seq_id, "pages_of").pages)

    def tokens_of(self, seq_id) -> list | None:
        t = self._seq(seq_id, "tokens_of").tokens
        return None if t is None else list(t)

    def page_info(self, page_id: int) -> PageInfo:
        p = self._pages.get(page_id)
        if p is None:
            raise CacheProtocolError(f"page_info: page {page_id} is not held by the cache")
        base = p.index * self.page_size
        return PageInfo(p.fmt, p.index, range(base, base + p.filled), frozenset(p.owners), len(p.owners), p.key)

    @property
    def held_pages(self) -> frozenset:
        """Every page the cache holds in the store: owned ones and unreferenced cached ones."""
        return frozenset(self._pages)

    @property
    def owned_pages(self) -> frozenset:
        return frozenset(pid for pid, p in self._pages.items() if p.owners)

    @property
    def cached_pages(self) -> frozenset:
        """Unreferenced pages kept for prefix reuse (evicted LRU when the store refuses)."""
        return frozenset(self.prefix.unreferenced)

    def page_table(self, seq_ids: Sequence) -> np.ndarray:
        """int32 [len(seq_ids), max_pages_per_seq] (a new array)."""
        return self._table[[self._seq(i, "page_table").slot for i in seq_ids]]

    def lengths(self, seq_ids: Sequence) -> np.ndarray:
        return np.array([self._seq(i, "lengths").length for i in seq_ids], np.int64)

    def key_mask(self, seq_ids: Sequence) -> np.ndarray:
        """bool [len(seq_ids), max_pages_per_seq * page_size]: cell c of each sequence holds a key."""
        cells = np.arange(self.max_pages * self.page_size)
        return cells[None, :] < self.lengths(seq_ids)[:, None]

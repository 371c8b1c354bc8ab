"""Page and sequence metadata apart from storage: ``PageCache``, its ``Placement`` / ``Refusal``.

Note [Page metadata]
~~~~~~~~~~~~~~~~~~~~
Storage (a ``PageStore``, Note [Page store protocol]) holds bytes; ``PageCache`` holds what they mean.
A sequence is a list of ENTRIES (page id, fill): entry e holds the first ``fill`` rows of its page, and
the sequence's positions are its entries' rows in entry order, exactly the mapping of the paged ops'
optional ``page_fill`` input (Note [Page fill] in custom_ops/include/ortkv/paged.h). Per page: its
format, ``base`` (the position of its row 0: the same for every owner, since pages are shared only by
fork, reorder or a prefix-cache hit, which keep positions), its owners with the fill each one sees
(refcount = number of owners), ``filled`` (the high-water mark: the largest fill of an owner; rows past
it are seen by nobody) and its prefix key (Note [Prefix hash chain]). Per sequence: its entries, its
length, a row ("slot") of the persistent page table and of the persistent fill table, and, when token
ids are known, its tokens and the chain keys of its full pages' tokens.

Invariants (the state-machine test checks them after every operation):
  * every fill is in [1, page_size] and sum(fills) == length; a sequence holds a page at most once;
    positions [0, length) are all valid (no holes: ``remove`` takes a suffix or the whole sequence,
    never a middle range, because the model's positions would no longer be the cache's);
  * page.owners == {s: fill of the page in s}; page.filled == max(page.owners.values()) for an owned
    page; a page in the store is owned, or unowned, full and cached under its key;
  * a keyed page is full (filled == page_size), starts on a page boundary (base % page_size == 0) and
    holds exactly the tokens its key hashes;
  * the table rows of a sequence equal its page ids and fills, -1 / 0 after them.

Writes and sharing (why nothing is ever copied): a row of a page is written only by the owner at the
page's high-water mark, appending (its fill == filled < page_size); every other writer opens a new
page for its next token (a new entry, fill growing from 0). Rows below the mark are never written
again while anyone sees them, so sharing needs no copy: ``fork``, ``fork_n`` and ``reorder`` are
table changes and copy no KV byte, ever. When the owner at the mark goes away (removed, reordered
away, truncated), the mark drops to the largest remaining fill and the next owner there may append
(the rows above were seen by nobody). Cost: a fork whose parent keeps appending opens one page for
the child's next token, which the child then fills (a page per fork of a partly filled page, instead
of a copy of it).

Note [Admission]
~~~~~~~~~~~~~~~~
``admit(step)`` takes a whole step (new tokens of each running sequence, counts may differ) BEFORE
the run and returns a ``Placement`` or a ``Refusal``; never a half-admitted step:
  1. validate everything (protocol errors raise, nothing changed; a sequence that would outgrow
     ``max_pages_per_seq`` pages of tokens, or ``max_entries`` page-table entries, is a ``Refusal``);
  2. count the pages the step needs: each sequence first appends to its last page when it holds that
     page's high-water mark (Note [Page metadata]) and no earlier sequence of the step claimed the page
     (of owners at one mark, the first in step order appends); the rest of its tokens go to new pages;
  3. allocate all of them from the store, evicting cold unreferenced prefix pages when it refuses;
     if it still refuses, give back what was taken and return a ``Refusal`` (no metadata changed);
  4. apply: appends (fills, marks), new entries, lengths. Nothing here can fail.
So a step that was admitted cannot fail to allocate during the run, and no step ever copies a page.
Between ``admit`` and ``done`` (or ``cancel``) the cache refuses every other mutating call
(``SequenceBusyError``); ``done`` records the tokens and registers newly full pages for prefix reuse
(only an entry that starts on a page boundary with fill == page_size: a page shifted by a fork holds
tokens of two chunks and is never keyed); ``cancel`` undoes the step (fills, marks, new pages, lengths).

Entries vs pages: an entry holds 1 .. page_size tokens, so a sequence whose lineage went through shared
partly filled pages (a beam that was not the first child of its parent) holds more entries than
ceil(length / page_size). The token capacity is ``max_pages_per_seq * page_size``; the page table is
``max_entries`` wide (a sequence has at most ceil(length / page_size) + (writes that opened a page
because of sharing) entries; default max_pages_per_seq + 16, room for the one extra entry of a forked
sample many times over; a beam search can open one per generated token and should pass more, as
ortkv.generate.multi.MultiRunner does), and a sequence that runs out of entries is refused
("sequence_full", saying so) rather than copied into fewer pages.

Per step the work is O(batch) Python plus O(batch x max_entries) numpy (the page-table and fill rows are
copied from the persistent tables with one np.take each into buffers that stay the same across steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import CacheProtocolError, CapacityError, SequenceBusyError, SequenceRemovedError
from .prefix import PrefixIndex, chain_hashes


class _Page:
    __slots__ = ("fmt", "base", "filled", "owners", "key")

    def __init__(self, fmt: int, base: int, filled: int, owner):
        self.fmt, self.base, self.filled = fmt, base, filled
        self.owners = {owner: filled}   # seq id -> the rows of this page it sees (its entry's fill)
        self.key: bytes | None = None


class _Seq:
    __slots__ = ("id", "pages", "fills", "length", "tokens", "keys", "slot")

    def __init__(self, seq_id, slot: int):
        self.id, self.slot = seq_id, slot
        self.pages: list[int] = []
        self.fills: list[int] = []
        self.length = 0
        self.tokens: list[int] | None = []
        self.keys: list[bytes] = []


@dataclass(frozen=True)
class PageInfo:
    fmt: int
    base: int           # the position of row 0 (Note [Page metadata])
    positions: range    # [base, base + filled): the rows some owner sees
    owners: frozenset
    refcount: int
    key: bytes | None


@dataclass
class Refusal:
    """Admission refused the whole step; nothing changed. ``kind`` is "store" (the page store refused
    ``pages_needed`` pages after evicting every unreferenced cached page) or "sequence_full" (``seq``
    would need more than ``max_pages_per_seq`` pages of tokens or ``max_entries`` entries). Falsy, so ``if placement:`` tells them apart."""
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

    ``page_table`` (int32 [batch, max_entries], -1 = none), ``page_fill`` (int32, the same shape:
    rows held per entry, Note [Page fill]) and ``start`` (int64 [batch]) are what PagedCacheUpdate /
    PagedCacheAttention take; ``page_table`` and ``page_fill`` are views of buffers the cache reuses
    every step (bind them in place; valid until the next ``admit``), already holding this step's new
    tokens. Nothing is ever copied before a step (Note [Page metadata]). ``allocated`` lists the pages
    this step took from the store."""
    seq_ids: tuple
    start: np.ndarray
    new_tokens: np.ndarray
    page_table: np.ndarray
    page_fill: np.ndarray
    page_size: int
    tokens: list
    capacity: int                 # positions a sequence may hold: max_pages_per_seq * page_size
    allocated: list = field(default_factory=list)
    _segments: list = field(default_factory=list, repr=False)  # (page, first row, rows) in token order
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
        """int64 [total tokens]: page_id * page_size + row of every new token (vLLM's form), through the
        fills (Note [Page fill]): from the runs of rows admission placed, O(pages touched)."""
        if not self._segments:
            return np.zeros(0, np.int64)
        seg = np.array(self._segments, np.int64).reshape(-1, 3)
        first = seg[:, 0] * self.page_size + seg[:, 1]
        before = np.cumsum(seg[:, 2]) - seg[:, 2]
        return np.repeat(first - before, seg[:, 2]) + np.arange(int(seg[:, 2].sum()), dtype=np.int64)

    def position_ids(self, pad: int = -1) -> np.ndarray:
        """int64 [batch, max_tokens]: start + t where t < new_tokens[b], else ``pad``."""
        t = np.arange(self.max_tokens, dtype=np.int64)
        return np.where(t[None, :] < self.new_tokens[:, None], self.start[:, None] + t[None, :], pad)

    def key_mask(self) -> np.ndarray:
        """bool [batch, capacity]: position c of row b holds a valid key after the
        step (c < length). The dense masks are O(batch x cells); the paged ops need only
        ``page_table`` and ``start`` (the same information in O(batch)), so a runner of the paged ops
        never builds them: they are for other attention kernels, and for tests."""
        cells = np.arange(self.capacity)
        return cells[None, :] < self.lengths[:, None]

    def attention_mask(self) -> np.ndarray:
        """bool [batch, max_tokens, capacity]: query t of row b sees position c iff t < new_tokens[b] and
        c <= start[b] + t (Note [CacheAttention]: causal inside the new block, nothing past the
        row's valid length)."""
        cells = np.arange(self.capacity)
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
                 fmt: int = 0, model_key: bytes = b"", prefix_caching: bool = True, max_entries: int | None = None):
        for name, v in (("page_size", page_size), ("max_pages_per_seq", max_pages_per_seq),
                        ("max_sequences", max_sequences)):
            if int(v) <= 0:
                raise CacheProtocolError(f"PageCache: {name} must be positive, got {v}")
        max_entries = int(max_pages_per_seq) + 16 if max_entries is None else int(max_entries)
        if max_entries < int(max_pages_per_seq):
            raise CacheProtocolError(f"PageCache: max_entries {max_entries} < max_pages_per_seq {max_pages_per_seq}; "
                                     "the page table needs at least one entry per page of tokens")
        self.store = store
        self.page_size = int(page_size)
        self.max_pages = int(max_pages_per_seq)
        self.max_entries = max_entries
        self.max_sequences = int(max_sequences)
        self.fmt = int(fmt)
        self.model_key = bytes(model_key)
        self.prefix_caching = bool(prefix_caching)
        self._pages: dict[int, _Page] = {}
        self._seqs: dict[int, _Seq] = {}
        self._removed: set[int] = set()
        self._free_slots = list(range(self.max_sequences - 1, -1, -1))
        self._table = np.full((self.max_sequences, self.max_entries), -1, np.int32)
        self._fill = np.zeros((self.max_sequences, self.max_entries), np.int32)
        self._step_table = np.full((self.max_sequences, self.max_entries), -1, np.int32)
        self._step_fill = np.zeros((self.max_sequences, self.max_entries), np.int32)
        self.prefix = PrefixIndex()
        self._pending: Placement | None = None
        self._next_id = 0
        self.pages_opened_by_sharing = 0   # pages a writer opened because another owner held the mark

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

    def _lower_mark(self, page: _Page) -> None:
        """An owned page's mark after an owner left or shrank: the largest fill still seen (Note [Page
        metadata]); a keyed page that is no longer full loses its key (its rows past the mark may be
        written again)."""
        page.filled = max(page.owners.values())
        if page.key is not None and page.filled < self.page_size:
            self.prefix.forget(page.key)
            page.key = None

    def _release(self, pid: int, seq_id) -> None:
        page = self._pages[pid]
        page.owners.pop(seq_id, None)
        if not page.owners:
            if page.key is not None:
                self.prefix.park(pid, page.key)
            else:
                del self._pages[pid]
                self.store.free(pid)
        else:
            self._lower_mark(page)

    def _own(self, pid: int, seq_id, fill: int) -> None:
        page = self._pages[pid]
        if not page.owners:
            self.prefix.unpark(pid)
        page.owners[seq_id] = fill

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

    def _set_row(self, s: _Seq) -> None:
        n = len(s.pages)
        self._table[s.slot, :n] = s.pages
        self._table[s.slot, n:] = -1
        self._fill[s.slot, :n] = s.fills
        self._fill[s.slot, n:] = 0

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
        for pid in hits:
            self._own(pid, seq_id, self.page_size)
            s.pages.append(pid)
            s.fills.append(self.page_size)
        self._set_row(s)
        s.length = len(hits) * self.page_size
        s.keys = keys[:len(hits)]
        if s.tokens is not None and hits:
            s.tokens = prompt[:s.length].tolist()
        self.prefix.hits += len(hits)
        return s.length

    def fork(self, src, dst) -> None:
        """``dst`` becomes a copy of ``src`` that shares every page, the partly filled last one
        included, with the same fills: a table change, no KV byte copied now or later (Note [Page
        metadata]: whichever of them does not hold the last page's mark writes into a new page)."""
        self._idle("fork")
        s = self._seq(src, "fork")
        self._new_id(dst, "fork")
        d = self._add_seq(dst)
        for pid, f in zip(s.pages, s.fills):
            self._pages[pid].owners[dst] = f
        d.pages, d.fills = list(s.pages), list(s.fills)
        d.length = s.length
        d.tokens = None if s.tokens is None else list(s.tokens)
        d.keys = list(s.keys)
        self._table[d.slot] = self._table[s.slot]
        self._fill[d.slot] = self._fill[s.slot]

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
        """Beam search: afterwards ``seq_ids[i]`` holds what ``parents[i]`` held before (entries, length,
        tokens); every parent is one of ``seq_ids``. A page-table change: no KV byte is copied, now or at
        a later write (Note [Page metadata])."""
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
        snap = {p: (list(self._seqs[p].pages), list(self._seqs[p].fills), self._seqs[p].length,
                    self._seqs[p].tokens, list(self._seqs[p].keys)) for p in set(parents)}
        old = [(s.pages, s.fills) for s in seqs]
        touched = set()
        for s, p in zip(seqs, parents):           # every new owner first, then drop the old ones:
            for pid, f in zip(snap[p][0], snap[p][1]):  # a page that stays wanted is never freed between
                self._pages[pid].owners[s.id] = f
                touched.add(pid)
        for s, p, (old_pages, _) in zip(seqs, parents, old):
            pages, fills, length, tokens, keys = snap[p]
            keep = set(pages)
            for pid in old_pages:
                if pid not in keep:
                    self._release(pid, s.id)
            s.pages, s.fills, s.length = list(pages), list(fills), length
            s.tokens = None if tokens is None else list(tokens)
            s.keys = list(keys)
        for pid in touched:                       # an owner may now see fewer rows of a page it kept
            page = self._pages[pid]
            if page.owners:
                self._lower_mark(page)
        rows = np.array([self._seqs[p].slot for p in parents])  # parents' slots still hold the old rows
        slots = [s.slot for s in seqs]
        self._table[slots] = self._table[rows].copy()
        self._fill[slots] = self._fill[rows].copy()

    def remove(self, seq_id, p0: int | None = None, p1: int | None = None) -> None:
        """``remove(seq)``: the sequence is gone (its id is never reused) and each of its pages that
        no other sequence owns is freed (or kept as an unreferenced prefix page). ``remove(seq, p0)``
        or ``remove(seq, p0, p1)`` with p1 >= length: positions [p0, length) are dropped (entries past
        the new length released the same way, the entry holding p0 cut to end there). A middle range is
        refused (Note [Page metadata])."""
        self._idle("remove")
        s = self._seq(seq_id, "remove")
        if p0 is None and p1 is None:
            for pid in s.pages:
                self._release(pid, seq_id)
            self._table[s.slot] = -1
            self._fill[s.slot] = 0
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
        held, keep = 0, 0
        while held + s.fills[keep] <= p0:        # entries wholly below p0 stay
            held += s.fills[keep]
            keep += 1
        cut = p0 - held                           # rows of entry `keep` that stay (0: the entry goes)
        for pid in s.pages[keep + (1 if cut else 0):]:
            self._release(pid, seq_id)
        if cut:
            s.fills[keep] = cut
            page = self._pages[s.pages[keep]]
            page.owners[seq_id] = cut
            self._lower_mark(page)
            keep += 1
        del s.pages[keep:], s.fills[keep:]
        self._set_row(s)
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
        # 1b. sequence limits, 2. pages needed: append at the mark (first claimant), the rest in new pages
        need = 0
        claimed: set[int] = set()
        plan = []
        for s, n in zip(seqs, counts):
            k = 0
            if s.pages and s.fills[-1] < ps:
                pid = s.pages[-1]
                if self._pages[pid].filled == s.fills[-1] and pid not in claimed:
                    k = min(n, ps - s.fills[-1])
                    claimed.add(pid)
            new = -(-(n - k) // ps)
            end_pages = -(-(s.length + n) // ps)
            if end_pages > self.max_pages:
                return Refusal(f"sequence {s.id} at length {s.length} + {n} new tokens needs {end_pages} pages "
                               f"> max_pages_per_seq {self.max_pages}; finish or truncate it",
                               "sequence_full", end_pages, s.id)
            if len(s.pages) + new > self.max_entries:
                return Refusal(f"sequence {s.id} at length {s.length} + {n} new tokens needs {len(s.pages) + new} "
                               f"page-table entries > max_entries {self.max_entries} (its {len(s.pages)} entries hold "
                               f"{s.length} tokens: shared partly filled pages left entries of a few rows, Note [Page "
                               "metadata]); finish it, or build the cache with a larger max_entries",
                               "sequence_full", len(s.pages) + new, s.id)
            need += new
            plan.append((k, new))
        # 3. allocate all or nothing
        fresh, err = self._alloc_many(need)
        if err is not None:
            return Refusal(f"the page store refused {need} pages for this step of {len(seqs)} sequences "
                           f"(after evicting every unreferenced cached page): {err}", "store", need)
        # 4. apply
        allocated = list(fresh)
        undo, segments = [], []
        fresh.reverse()
        for s, n, (k, new) in zip(seqs, counts, plan):
            start, before = s.length, len(s.pages)
            app = None
            if k:
                pid = s.pages[-1]
                page = self._pages[pid]
                app = (page, s.fills[-1], page.filled)
                s.fills[-1] += k
                page.owners[s.id] = page.filled = s.fills[-1]
                self._fill[s.slot, before - 1] = s.fills[-1]
                segments.append((pid, s.fills[-1] - k, k))
            elif s.pages and s.fills[-1] < ps:
                self.pages_opened_by_sharing += 1   # another owner holds (or claimed) the mark
            pos, rem = start + k, n - k
            for e in range(before, before + new):
                f = min(ps, rem)
                pid = fresh.pop()
                self._pages[pid] = _Page(self.fmt, pos, f, s.id)
                s.pages.append(pid)
                s.fills.append(f)
                self._table[s.slot, e] = pid
                self._fill[s.slot, e] = f
                segments.append((pid, 0, f))
                pos += f
                rem -= f
            s.length = start + n
            undo.append((s, start, before, app))
        slots = np.fromiter((s.slot for s in seqs), np.intp, len(seqs))
        table = np.take(self._table, slots, axis=0, out=self._step_table[:len(seqs)])
        fill = np.take(self._fill, slots, axis=0, out=self._step_fill[:len(seqs)])
        placement = Placement(tuple(s.id for s in seqs), np.array([u[1] for u in undo], np.int64),
                              np.array(counts, np.int64), table, fill, ps, toks, self.max_pages * ps, allocated, segments, undo)
        self._pending = placement
        return placement

    def _check_pending(self, placement, what: str) -> None:
        if self._pending is None or placement is not self._pending:
            raise CacheProtocolError(f"{what}: this placement is not the step admitted last (or it was "
                                     "already finished)")

    def done(self, placement: Placement) -> None:
        """The step ran: record the tokens and key the pages it filled (prefix caching: only entries that
        start on a page boundary with fill == page_size, Note [Admission])."""
        self._check_pending(placement, "done")
        ps = self.page_size
        for (s, _start, _before, _app), ids in zip(placement._undo, placement.tokens):
            end = s.length
            if s.tokens is not None:
                if ids is None:
                    s.tokens = None        # counts only: this sequence's pages cannot be keyed
                else:
                    s.tokens.extend(ids.tolist())
            if s.tokens is not None and end // ps > len(s.keys):
                prev = s.keys[-1] if s.keys else b""
                first = len(s.keys)        # hash only the pages that filled: O(new tokens)
                new_keys = chain_hashes(s.tokens[first * ps:(end // ps) * ps], ps, self.model_key, prev)
                aligned = {}               # chunk index -> page of an aligned full entry
                held = 0
                for pid, f in zip(s.pages, s.fills):
                    if f == ps and held % ps == 0 and held >= first * ps:
                        aligned[held // ps] = pid
                    held += f
                for k, key in enumerate(new_keys, start=first):
                    pid = aligned.get(k)
                    if pid is None:
                        continue
                    page = self._pages[pid]
                    if page.key is None and self.prefix.register(key, pid):
                        page.key = key
                s.keys.extend(new_keys)
        self._pending = None

    def cancel(self, placement: Placement) -> None:
        """The step did not run: fills, marks, pages and lengths go back to before ``admit`` (pages it
        allocated return to the store)."""
        self._check_pending(placement, "cancel")
        for s, start, before, app in reversed(placement._undo):
            for pid in s.pages[before:]:
                del self._pages[pid]
                self.store.free(pid)
            del s.pages[before:], s.fills[before:]
            if app is not None:
                page, fill, mark = app
                s.fills[-1] = fill
                page.owners[s.id] = fill
                page.filled = mark
            self._set_row(s)
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

    def fills_of(self, seq_id) -> tuple:
        """The fill of each entry of ``pages_of(seq_id)`` (Note [Page metadata])."""
        return tuple(self._seq(seq_id, "fills_of").fills)

    def tokens_of(self, seq_id) -> list | None:
        t = self._seq(seq_id, "tokens_of").tokens
        return None if t is None else list(t)

    def page_info(self, page_id: int) -> PageInfo:
        p = self._pages.get(page_id)
        if p is None:
            raise CacheProtocolError(f"page_info: page {page_id} is not held by the cache")
        return PageInfo(p.fmt, p.base, range(p.base, p.base + p.filled), frozenset(p.owners), len(p.owners), p.key)

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
        """int32 [len(seq_ids), max_entries] (a new array)."""
        return self._table[[self._seq(i, "page_table").slot for i in seq_ids]]

    def page_fill(self, seq_ids: Sequence) -> np.ndarray:
        """int32 [len(seq_ids), max_entries]: rows held per entry, 0 past the last (a new array)."""
        return self._fill[[self._seq(i, "page_fill").slot for i in seq_ids]]

    def lengths(self, seq_ids: Sequence) -> np.ndarray:
        return np.array([self._seq(i, "lengths").length for i in seq_ids], np.int64)

    def key_mask(self, seq_ids: Sequence) -> np.ndarray:
        """bool [len(seq_ids), max_pages_per_seq * page_size]: position c of each sequence holds a key."""
        cells = np.arange(self.max_pages * self.page_size)
        return cells[None, :] < self.lengths(seq_ids)[:, None]

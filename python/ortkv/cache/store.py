"""What ``ortkv.cache`` needs of the storage underneath: the ``PageStore`` protocol, and
``MemoryPageStore``, an in-memory store with a page budget (for tests, benchmarks and planning).

Note [Page store protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The cache layer keeps page metadata (positions, owners, refcount, format, content hash) and never
touches KV bytes. From the store it needs only:

  alloc(fmt) -> page_id   a page id in [0, num_pages) for a fresh slot of format ``fmt``; when the
                          budget refuses it raises ``CapacityError`` and nothing was allocated.
  free(page_id)           returns the slot (a free of a page that is not live raises; the cache never
                          does that, and the state-machine test checks it).
  page_bytes(fmt)         bytes of one page of that format (all layers), for reports.

The cache never asks for a copy: forks and beam reorders share pages, partly filled ones included,
through per-entry fills (Note [Page metadata], Note [Page fill]). ``copy(src, dst)`` (one slot, counted
in ``bytes_copied``) remains a store primitive that nothing in ortkv.cache calls.
``ortkv.paged.PagePool`` provides alloc / free / requantize.
The store's own refusal (a governor's budget) is the only refusal admission cannot foresee, so
admission allocates every page a step needs before it changes any metadata, and gives them back if
one allocation is refused (Note [Admission]).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import CacheProtocolError, CapacityError


@runtime_checkable
class PageStore(Protocol):
    def alloc(self, fmt: int) -> int: ...

    def free(self, page_id: int) -> None: ...

    def page_bytes(self, fmt: int) -> int: ...


class MemoryPageStore:
    """A page store without KV bytes: ids, a budget of ``num_pages`` pages (or ``budget_bytes``),
    counters, and, for tests, one int64 token id per cell (``cells[page_id, row]``, -1 = never
    written), so that a test can "run" a step by writing token ids and reading them back through the
    page table."""

    def __init__(self, num_pages: int, page_size: int, page_bytes: dict[int, int] | None = None,
                 budget_bytes: int | None = None):
        if num_pages <= 0 or page_size <= 0:
            raise CacheProtocolError(f"MemoryPageStore: num_pages {num_pages} and page_size {page_size} "
                                     "must be positive")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._page_bytes = dict(page_bytes or {0: 1})
        self.budget_bytes = budget_bytes
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() gives the lowest id first
        self._fmt: dict[int, int] = {}
        self.cells = np.full((self.num_pages, self.page_size), -1, np.int64)
        self.allocs = self.frees = self.refusals = 0
        self.bytes_copied = 0
        self.committed_bytes = 0
        self.peak_committed_bytes = 0
        self.peak_pages = 0

    # -- the protocol ------------------------------------------------------------------------------
    def page_bytes(self, fmt: int) -> int:
        if fmt not in self._page_bytes:
            raise CacheProtocolError(f"MemoryPageStore: no page size for format {fmt}; known formats "
                                     f"{sorted(self._page_bytes)} (pass page_bytes={{fmt: bytes}})")
        return self._page_bytes[fmt]

    def alloc(self, fmt: int) -> int:
        size = self.page_bytes(fmt)
        if not self._free or (self.budget_bytes is not None
                              and self.committed_bytes + size > self.budget_bytes):
            self.refusals += 1
            cap = self.budget_bytes if self.budget_bytes is not None else self.num_pages * size
            raise CapacityError(f"page store: no room for one more page of format {fmt} ({size} bytes): "
                                f"{len(self._fmt)} of {self.num_pages} pages live, {self.committed_bytes} "
                                f"bytes committed of {cap}; free pages or raise the budget",
                                requested=self.committed_bytes + size, capacity=cap)
        pid = self._free.pop()
        self._fmt[pid] = fmt
        self.allocs += 1
        self.committed_bytes += size
        self.peak_committed_bytes = max(self.peak_committed_bytes, self.committed_bytes)
        self.peak_pages = max(self.peak_pages, len(self._fmt))
        return pid

    def free(self, page_id: int) -> None:
        if page_id not in self._fmt:
            raise CacheProtocolError(f"MemoryPageStore: free of page {page_id}, which is not live")
        self.committed_bytes -= self._page_bytes[self._fmt.pop(page_id)]
        self.cells[page_id] = -1
        self._free.append(page_id)
        self.frees += 1

    # -- what a runner does with a Placement ---------------------------------------------------------
    def copy(self, src: int, dst: int) -> None:
        for p in (src, dst):
            if p not in self._fmt:
                raise CacheProtocolError(f"MemoryPageStore: copy {src} -> {dst}: page {p} is not live")
        self.cells[dst] = self.cells[src]
        self.bytes_copied += self._page_bytes[self._fmt[src]]

    def requantize(self, page_id: int, fmt: int) -> None:
        if page_id not in self._fmt:
            raise CacheProtocolError(f"MemoryPageStore: requantize of page {page_id}, which is not live")
        new = self.page_bytes(fmt)
        self.committed_bytes += new - self._page_bytes[self._fmt[page_id]]
        self._fmt[page_id] = fmt

    # -- queries -----------------------------------------------------------------------------------
    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._fmt)

    def format_of(self, page_id: int) -> int:
        return self._fmt[page_id]

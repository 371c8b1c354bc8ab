"""The oracle of PagedKVCache.reserve / advance (ortkv.paged, Note [Incremental advance]): every page of every
row visited on every call, as the first implementation did (except that a hole in a full prefix is refused
before anything changes, the incremental contract). The incremental methods must leave the same page tables,
directory, pins and counters, return the same values and raise the same errors (tests/test_paged_pool.py);
benchmarks/bench_paged_bookkeeping.py times the two side by side."""

from __future__ import annotations

import numpy as np

from ..errors import CapacityError, OrtkvError


def walk_reserve(cache, new_lengths) -> int:
    """Open the pages rows need for ``new_lengths`` tokens, row by row, page by page; all or nothing."""
    new_lengths = np.asarray(new_lengths, np.int64).reshape(-1)
    ps = cache.pool.page_size
    if new_lengths.max(initial=0) > cache.capacity:
        raise CapacityError(f"PagedKVCache.reserve: {int(new_lengths.max())} tokens exceed the {cache.capacity} "
                            f"a row holds ({cache.page_table.shape[1]} pages of {ps}); raise max_pages_per_seq",
                            requested=int(new_lengths.max()), capacity=cache.capacity)
    # which pages: every entry of every row's first ceil(n / page_size) that is -1 (opening them, all or nothing,
    # is the cache's own _open)
    return cache._open((b, i) for b, n in enumerate(new_lengths) for i in range(-(-int(n) // ps))
                       if cache.page_table[b, i] < 0)


def walk_advance(cache, new_lengths) -> int:
    """The policy applied to every full page of every row (requantize a page wider than its target, pin the
    sink pages, unpin the others); returns the pages requantized."""
    new_lengths = np.asarray(new_lengths, np.int64).reshape(-1)
    ps, pool, policy = cache.pool.page_size, cache.pool, cache.policy
    full_now = new_lengths // ps
    holes = (cache.page_table < 0) & (np.arange(cache.page_table.shape[1]) < full_now[:, None])
    if holes.any():
        b, i = (int(x[0]) for x in np.nonzero(holes))
        raise OrtkvError(f"PagedKVCache.advance: row {b} has {int(new_lengths[b])} tokens but no page {i}; "
                         "reserve() before the run")
    changed = 0
    for b, n in enumerate(new_lengths):
        n = int(n)
        num_pages, full = -(-n // ps), n // ps
        for i in range(full):
            page = int(cache.page_table[b, i])
            want, have = policy.target(i, num_pages), pool.format_of(page)
            if want != have and pool.slot_bytes(want) < pool.slot_bytes(have):
                pool.requantize(page, want)
                changed += 1
            pool.pin(page, i < policy.sink_pages)
    cache.lengths = np.maximum(cache.lengths, new_lengths)
    return changed

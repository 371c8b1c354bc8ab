"""numpy oracle of CacheUpdate: an out-of-place rewrite of the op's definition."""

from __future__ import annotations

import numpy as np


def cache_update_ref(cache: np.ndarray, values: np.ndarray, position, seq_axis: int = -2) -> np.ndarray:
    """Return a copy of ``cache`` with ``values`` written at ``position`` along ``seq_axis``
    (a scalar for every row of axis 0, or one position per row). Raises ValueError where the op
    refuses its inputs."""
    if seq_axis == 0:  # SBNH [capacity, batch, ...]: the same update with the batch moved first
        if cache.ndim < 3 or values.ndim != cache.ndim:
            raise ValueError(f"rank {cache.ndim} / seq_axis 0")
        return np.swapaxes(cache_update_ref(np.swapaxes(cache, 0, 1), np.swapaxes(values, 0, 1), position, 1),
                           0, 1).copy()
    rank = cache.ndim
    axis = seq_axis + rank if seq_axis < 0 else seq_axis
    if rank < 3 or not 1 <= axis < rank:
        raise ValueError(f"rank {rank} / seq_axis {seq_axis}")
    if values.dtype != cache.dtype or values.ndim != rank:
        raise ValueError("values dtype or rank")
    if any(values.shape[i] != cache.shape[i] for i in range(rank) if i != axis):
        raise ValueError("values shape")
    n, capacity, rows = values.shape[axis], cache.shape[axis], cache.shape[0]
    pos = np.asarray(position, dtype=np.int64)
    if pos.ndim == 0:
        pos = np.full(rows, int(pos), np.int64)
    elif pos.ndim != 1 or pos.shape[0] != rows:
        raise ValueError("position length")
    if n < 1 or (pos < 0).any() or (pos + n > capacity).any():
        raise ValueError("position range")
    out = cache.copy()
    for r in range(rows):
        index = [slice(None)] * rank
        index[0] = r
        index[axis] = slice(int(pos[r]), int(pos[r]) + n)
        out[tuple(index)] = values[r]
    return out

"""numpy oracle of CacheAttention (Note [CacheAttention] in custom_ops/include/ortkv/cache_attention.h)."""

from __future__ import annotations

import numpy as np


def cache_attention_ref(q, k_cache, v_cache, start, num_heads: int, kv_num_heads: int, scale: float | None = None,
                        seq_axis: int = 1) -> np.ndarray:
    B, T, width = q.shape
    D = width // num_heads
    if seq_axis == 0:  # SBNH -> BSNH
        k_cache, v_cache = k_cache.transpose(1, 0, 2, 3), v_cache.transpose(1, 0, 2, 3)
    elif seq_axis != 1:  # BNSH -> BSNH
        k_cache, v_cache = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
    start = np.broadcast_to(np.asarray(start, np.int64), (B,))
    scale = 1.0 / np.sqrt(D) if not scale else scale
    group = num_heads // kv_num_heads
    out = np.zeros((B, T, num_heads, D), np.float64)
    qh = q.reshape(B, T, num_heads, D).astype(np.float64)
    for b in range(B):
        for t in range(T):
            n = int(start[b]) + t + 1
            for h in range(num_heads):
                keys = k_cache[b, :n, h // group].astype(np.float64)
                vals = v_cache[b, :n, h // group].astype(np.float64)
                s = scale * keys @ qh[b, t, h]
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ vals
    return out.reshape(B, T, width).astype(np.float32)

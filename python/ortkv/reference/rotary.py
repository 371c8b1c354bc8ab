"""numpy oracles of RotaryCacheUpdate and SwiGLU (Note [RotaryCacheUpdate], Note [SwiGLU] in
custom_ops/include/ortkv/rotary_cache_update.h): out-of-place rewrites of the ops' definitions."""

from __future__ import annotations

import numpy as np

from .cache_update import cache_update_ref

# seq_axis -> (the caches' layout, how [B, T, Hkv, D] new tokens are laid out for cache_update_ref)
_LAYOUTS = {0: ("SBNH", (1, 0, 2, 3)), 1: ("BSNH", (0, 1, 2, 3)), 2: ("BNSH", (0, 2, 1, 3)), -2: ("BNSH", (0, 2, 1, 3))}


def rotary_interleaved_ref(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int) -> np.ndarray:
    """com.microsoft.RotaryEmbedding(interleaved=1), full head: x [B, T, heads * D], pos [B, T] (computed in
    float64, returned in x's dtype)."""
    B, T, W = x.shape
    D = W // heads
    h = x.reshape(B, T, heads, D // 2, 2).astype(np.float64)
    c = cos[pos].astype(np.float64)[:, :, None, :]  # [B, T, 1, D / 2]
    s = sin[pos].astype(np.float64)[:, :, None, :]
    y = np.empty_like(h)
    y[..., 0] = h[..., 0] * c - h[..., 1] * s
    y[..., 1] = h[..., 1] * c + h[..., 0] * s
    return y.reshape(B, T, W).astype(x.dtype)


def rotary_cache_update_ref(qkv, k_cache, v_cache, positions, cos, sin, num_heads: int, kv_num_heads: int,
                            seq_axis: int = -2):
    """(q_rot, new k_cache, new v_cache): copies; the caches' other bytes unchanged. Raises ValueError where the
    op refuses its inputs."""
    if seq_axis not in _LAYOUTS:
        raise ValueError(f"seq_axis {seq_axis}")
    B, T, W = qkv.shape
    H, Hkv = num_heads, kv_num_heads
    if W % (H + 2 * Hkv) or (W // (H + 2 * Hkv)) % 2:
        raise ValueError("qkv width")
    D = W // (H + 2 * Hkv)
    seq = {0: 0, 1: 1}.get(seq_axis, 2)
    if cos.shape != (cos.shape[0], D // 2) or cos.shape[0] < k_cache.shape[seq]:
        raise ValueError("rotary table")
    pos = np.asarray(positions, np.int64)
    pos = np.full(B, int(pos), np.int64) if pos.ndim == 0 else pos
    if (pos < 0).any() or (pos + T > k_cache.shape[seq]).any():
        raise ValueError("position range")
    pid = pos[:, None] + np.arange(T)[None, :]
    q = rotary_interleaved_ref(qkv[..., : H * D], pid, cos, sin, H)
    k = rotary_interleaved_ref(qkv[..., H * D:(H + Hkv) * D], pid, cos, sin, Hkv)
    v = qkv[..., (H + Hkv) * D:]
    perm = _LAYOUTS[seq_axis][1]
    to_layout = lambda t: np.ascontiguousarray(t.reshape(B, T, Hkv, D).transpose(perm))  # noqa: E731
    return (q, cache_update_ref(k_cache, to_layout(k), pos, seq_axis),
            cache_update_ref(v_cache, to_layout(v), pos, seq_axis))


def swiglu_ref(x: np.ndarray) -> np.ndarray:
    """silu(x[..., :F]) * x[..., F:] (float64 arithmetic, returned in x's dtype)."""
    f = x.shape[-1] // 2
    g, u = x[..., :f].astype(np.float64), x[..., f:].astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * u).astype(x.dtype)

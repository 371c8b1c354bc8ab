"""numpy oracle of PagedCacheUpdate, PagedCacheAttention and paged_requantize over the physical form of
Note [Paged cache physical form] (custom_ops/include/ortkv/paged.h):

* ``pool``: uint8 [pool_bytes], every page's bytes;
* ``directory``: int64 [num_pages, 2] = (format code, byte offset of the page's slot in the pool);
* ``page_table``: int32 [batch, max_pages] of page ids (-1 = none).

A page id is one logical page of ``page_size`` tokens for every layer: its slot holds ``num_layers`` codec
pages (ortkv.reference.codecs) of its one format back to back, layer ``l`` at
``directory[p, 1] + l * page_bytes(format)``. Token ``t`` of sequence ``b`` is row ``t % page_size`` of page
``page_table[b, t // page_size]``, unless ``page_fill`` (int32 [batch, max_pages], optional) is given: then
entry e of row b holds the first ``page_fill[b, e]`` rows of page ``page_table[b, e]`` and a row's
positions are its entries' rows in entry order (Note [Page fill] in custom_ops/include/ortkv/paged.h;
``position_map``).

Values of the logical types: float32 and float16 numpy arrays as they are; bfloat16 as ml_dtypes.bfloat16
or as its bits in uint16 (``logical="bfloat16"``).
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheInputError
from .cache_attention import cache_attention_ref
from .codecs import KEYS_PER_CHANNEL, PageFormat, _sections, decode_page, encode_page, encode_rows, layout


def page_bytes(fmt, kv_heads: int, page_size: int, head_size: int) -> int:
    """Bytes of one layer of a page of format ``fmt``."""
    return layout(fmt, kv_heads, page_size, head_size).page_bytes


def slot_bytes(fmt, num_layers: int, kv_heads: int, page_size: int, head_size: int) -> int:
    """Bytes of one page slot (every layer) of format ``fmt``."""
    return num_layers * page_bytes(fmt, kv_heads, page_size, head_size)


def to_f32(x, logical: str | None = None) -> np.ndarray:
    """Values of a logical type as float32 (bfloat16 bits in uint16 when logical == 'bfloat16')."""
    x = np.asarray(x)
    if logical == "bfloat16" and x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def position_map(page_table_row, page_fill_row, page_size: int, n_tokens: int) -> list[tuple[int, int]]:
    """(page id, row) of logical positions [0, n_tokens) of one sequence (Note [Page fill]);
    ``page_fill_row`` None = every entry full. Raises CacheInputError when the row holds fewer positions
    or a fill is outside [0, page_size]."""
    table = np.asarray(page_table_row)
    if page_fill_row is None:
        fill = np.full(table.shape, page_size, np.int64)
    else:
        fill = np.asarray(page_fill_row, np.int64)
    for e, f in enumerate(fill.tolist()):
        if not 0 <= f <= page_size:
            raise CacheInputError(f"page_fill entry {e} is {f}, outside [0, page_size={page_size}]")
    out: list[tuple[int, int]] = []
    for e, f in enumerate(fill.tolist()):
        if len(out) >= n_tokens:
            break
        if f == 0:
            continue
        pid = int(table[e])
        out.extend((pid, r) for r in range(min(f, n_tokens - len(out))))
    if len(out) < n_tokens:
        raise CacheInputError(f"the row holds {len(out)} positions (its total fill), {n_tokens} needed")
    return out


def _page_layer(pool, directory, page_id: int, layer: int, kv_heads: int, page_size: int, head_size: int):
    fmt = PageFormat(int(directory[page_id, 0]))
    lay = layout(fmt, kv_heads, page_size, head_size)
    off = int(directory[page_id, 1]) + layer * lay.page_bytes
    return fmt, lay, pool[off:off + lay.page_bytes]


def paged_cache_update_ref(pool, directory, page_table, key, value, position, *, layer: int, num_layers: int,
                           kv_num_heads: int, page_size: int, logical: str | None = None,
                           page_fill=None) -> np.ndarray:
    """The pool after PagedCacheUpdate (a new array; ``pool`` is not changed). key/value [B, T, Hkv * D].
    ``page_fill``: the optional input (Note [Page fill])."""
    del num_layers  # the slot's other layers are not touched; the offset needs only `layer`
    out = np.array(pool, np.uint8, copy=True)
    k = to_f32(key, logical)
    v = to_f32(value, logical)
    B, T, W = k.shape
    D = W // kv_num_heads
    position = np.broadcast_to(np.asarray(position, np.int64), (B,))
    for b in range(B):
        where = position_map(page_table[b], None if page_fill is None else page_fill[b], page_size,
                             int(position[b]) + T)
        for t in range(T):
            tok = int(position[b]) + t
            pid, row = where[tok]
            if pid < 0:
                raise CacheInputError(f"row {b} token {tok}: its page-table entry is -1")
            fmt, lay, page = _page_layer(out, directory, pid, layer, kv_num_heads, page_size, D)
            if fmt in KEYS_PER_CHANNEL:
                raise CacheInputError(f"row {b}: page {pid} is {fmt.name}: key rows cannot be written alone")
            rows = np.stack([k[b, t].reshape(kv_num_heads, D), v[b, t].reshape(kv_num_heads, D)])
            payload, scales = encode_rows(fmt, rows, what="row [kv, head]")
            for kv, (p, s) in enumerate(_sections(fmt, lay, page, kv_num_heads, page_size, D)):
                p[:, row] = payload[kv]
                s[:, row] = scales[kv]
    return out


def gather_kv(pool, directory, page_table_row, n_tokens: int, *, layer: int, kv_heads: int, page_size: int,
              head_size: int, page_fill_row=None) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [n_tokens, kv_heads, head_size] float32 of one sequence, decoded page by page
    (``page_fill_row``: Note [Page fill])."""
    if page_fill_row is not None:
        decoded: dict[int, np.ndarray] = {}
        k = np.zeros((n_tokens, kv_heads, head_size), np.float32)
        v = np.zeros_like(k)
        for t, (pid, row) in enumerate(position_map(page_table_row, page_fill_row, page_size, n_tokens)):
            if pid not in decoded:
                fmt, _, page = _page_layer(pool, directory, pid, layer, kv_heads, page_size, head_size)
                decoded[pid] = decode_page(fmt, page, kv_heads, page_size, head_size)  # [2, Hkv, ps, D]
            k[t], v[t] = decoded[pid][0, :, row], decoded[pid][1, :, row]
        return k, v
    pages = []
    for i in range(-(-n_tokens // page_size)):
        pid = int(page_table_row[i])
        fmt, _, page = _page_layer(pool, directory, pid, layer, kv_heads, page_size, head_size)
        pages.append(decode_page(fmt, page, kv_heads, page_size, head_size))  # [2, Hkv, ps, D]
    if not pages:
        z = np.zeros((0, kv_heads, head_size), np.float32)
        return z, z
    kv = np.concatenate(pages, axis=2)[:, :, :n_tokens]  # [2, Hkv, n, D]
    return kv[0].transpose(1, 0, 2), kv[1].transpose(1, 0, 2)


def paged_cache_attention_ref(query, pool, directory, page_table, start, *, num_heads: int, kv_num_heads: int,
                              layer: int, num_layers: int, page_size: int, scale: float | None = None,
                              logical: str | None = None, page_fill=None) -> np.ndarray:
    """PagedCacheAttention's output as float32 [B, T, Hq * D] (float64 arithmetic); ``page_fill``: the
    optional input (Note [Page fill])."""
    del num_layers
    q = to_f32(query, logical)
    B, T, W = q.shape
    D = W // num_heads
    start = np.broadcast_to(np.asarray(start, np.int64), (B,))
    out = np.zeros((B, T, W), np.float32)
    for b in range(B):
        n = int(start[b]) + T
        k, v = gather_kv(pool, directory, page_table[b], n, layer=layer, kv_heads=kv_num_heads, page_size=page_size,
                         head_size=D, page_fill_row=None if page_fill is None else page_fill[b])
        out[b] = cache_attention_ref(q[b:b + 1], k[None], v[None], start[b:b + 1], num_heads, kv_num_heads, scale)[0]
    return out


def _round_logical(x: np.ndarray, logical: str) -> np.ndarray:
    if logical == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if logical == "bfloat16":
        from .codecs import _to_bf16_bits

        return (_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    return x


def paged_requantize_ref(pool, src_offset: int, src_format, dst_offset: int, dst_format, num_layers: int,
                         kv_heads: int, page_size: int, head_size: int, logical: str) -> np.ndarray:
    """The pool after paged_requantize (a new array): every layer decoded, rounded to the logical type,
    encoded in dst_format. Raises CacheInputError (nothing changed) when a layer cannot be encoded."""
    out = np.array(pool, np.uint8, copy=True)
    sb = page_bytes(src_format, kv_heads, page_size, head_size)
    db = page_bytes(dst_format, kv_heads, page_size, head_size)
    encoded = []
    for layer in range(num_layers):
        src = out[src_offset + layer * sb:src_offset + (layer + 1) * sb]
        values = _round_logical(decode_page(src_format, src, kv_heads, page_size, head_size), logical)
        encoded.append(encode_page(dst_format, values))
    out[dst_offset:dst_offset + num_layers * db] = np.concatenate(encoded)
    return out


def _round_to(x: np.ndarray, logical: str) -> np.ndarray:
    """float32 values rounded to float16 / bfloat16 (nearest even) and back; float32 unchanged."""
    x = np.asarray(x, np.float32)
    if logical == "float16":
        return x.astype(np.float16).astype(np.float32)
    if logical == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
        return r.astype(np.uint32).view(np.float32)
    return x


def rotary_fma_ref(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int) -> np.ndarray:
    """The interleaved rotary of Note [PagedRotaryCacheUpdate] (custom_ops/include/ortkv/paged.h), float32 in its
    one form: y[2i] = fma(x[2i], c, -(x[2i+1] s)), y[2i+1] = fma(x[2i], s, x[2i+1] c) (one float32 product
    rounded, the fma's sum exact before its rounding: float64 holds x c exactly). x [B, T, heads * D] float32, pos
    [B, T]; float32 out, not yet rounded to the logical type."""
    B, T, W = x.shape
    D = W // heads
    h = x.reshape(B, T, heads, D // 2, 2).astype(np.float32)
    c = cos[pos].astype(np.float32)[:, :, None, :]
    s = sin[pos].astype(np.float32)[:, :, None, :]
    x0, x1 = h[..., 0], h[..., 1]
    y = np.empty_like(h)
    y[..., 0] = (x0.astype(np.float64) * c - (x1 * s).astype(np.float64)).astype(np.float32)
    y[..., 1] = (x0.astype(np.float64) * s + (x1 * c).astype(np.float64)).astype(np.float32)
    return y.reshape(B, T, W)


def paged_rotary_cache_update_ref(pool, directory, page_table, qkv, position, cos, sin, *, num_heads: int,
                                  kv_num_heads: int, layer: int, num_layers: int, page_size: int,
                                  logical: str = "float32", page_fill=None) -> tuple[np.ndarray, np.ndarray]:
    """(the pool after PagedRotaryCacheUpdate, q_rot as float32 values of the logical type): Note
    [PagedRotaryCacheUpdate]'s definition, q and k rotated and rounded to ``logical`` ("float32", "float16",
    "bfloat16"; bfloat16 inputs as uint16 bits), then PagedCacheUpdate of the rotated k and the v columns."""
    lg = None if logical != "bfloat16" else "bfloat16"
    x = to_f32(qkv, lg)
    c, s = to_f32(cos, lg), to_f32(sin, lg)
    B, T, W = x.shape
    H, Hkv = num_heads, kv_num_heads
    D = W // (H + 2 * Hkv)
    pos = np.broadcast_to(np.asarray(position, np.int64), (B,))
    pid = pos[:, None] + np.arange(T)[None, :]
    q = _round_to(rotary_fma_ref(x[..., :H * D], pid, c, s, H), logical)
    k = _round_to(rotary_fma_ref(x[..., H * D:(H + Hkv) * D], pid, c, s, Hkv), logical)
    v = x[..., (H + Hkv) * D:]
    out = paged_cache_update_ref(pool, directory, page_table, k, v, pos, layer=layer, num_layers=num_layers,
                                 kv_num_heads=Hkv, page_size=page_size, page_fill=page_fill)
    return out, q

"""Shape rules of the ortkv ops and of the com.microsoft ops the decoders use, for ShapesContext.

A rule takes (ctx, node, label, input types) and returns the output types; it reports what is wrong
with the inputs as ``op-input`` findings (the same conditions the kernels refuse at run time, found
before the model runs; ports, types, attributes and limits of the ortkv ops come from their op
contract, Note [Op contract] in op_contract.py) and checks ``position + n <= capacity`` where the numbers are known.
WORKSPACE gives the bytes an op allocates beside its outputs while it runs (the memory planner).

PagedCacheUpdate / PagedCacheAttention (Note [Paged cache physical form] in custom_ops/include/ortkv/paged.h):
  PagedCacheUpdate(pool, directory, page_table, key, value, position[, page_fill]) -> updated_pool (MUST alias
      the pool); pool uint8 [pool_bytes]; directory int64 [num_pages, 2]; page_table int32 [batch, max_pages];
      key/value [batch, T, kv_heads * head_size]; a row holds at most max_pages * page_size tokens;
      page_fill (optional, Note [Page fill]) int32 [batch, max_pages], the page table's shape.
  PagedRotaryCacheUpdate(pool, directory, page_table, qkv, position, cos_cache, sin_cache[, page_fill]) ->
      (updated_pool, q_rot): the same alias, RotaryCacheUpdate's rotary first (Note [PagedRotaryCacheUpdate]).
  PagedCacheAttention(query, pool, directory, page_table, start[, page_fill]) -> output shaped and typed like
      query.
  What only the run-time values decide (page ids present, each page's format and slot) the kernels check.
"""

from __future__ import annotations

import math

from onnx import TensorProto, helper

from .dims import ShapeConflict, ValueType, elem_name, list_dims
from .op_contract import CONTRACTS, FLOATS, arity_problems, attribute, attribute_problems


def attr(node, name, default=None):
    """The value of attribute ``name`` of ``node``, or ``default`` (also when the attribute is malformed)."""
    for a in node.attribute:
        if a.name == name:
            try:
                return helper.get_attribute_value(a)
            except Exception:  # an attribute of an undefined type in an untrusted model
                return default
    return default


def _contract(ctx, node, label) -> bool:
    """The op contract's port count and attributes (Note [Op contract]); False when the node cannot run."""
    c = CONTRACTS[(node.domain, node.op_type)]
    if not c.kernel and c.op_type not in ctx._warned_ops:
        ctx._warned_ops.add(c.op_type)
        ctx.warning("no-kernel", label, f"{c.op_type} (first at node '{label}') is a design contract: this ortkv "
                    f"build registers no kernel for it, so ONNX Runtime will not load the model")
    problems = arity_problems(node, c) + attribute_problems(node, c)
    for p in problems:
        ctx.error("op-input", label, f"{c.op_type} node '{label}': {p}")
    return not problems


def _pad(ins, n):
    return list(ins) + [ValueType()] * (n - len(ins))


def _meet_dim(ctx, label, op, a_name, a_t, a_i, b_name, b_t, b_i, why) -> None:
    """Dim a_i of a_name and dim b_i of b_name must be equal (unify when symbolic)."""
    if a_t.shape is None or b_t.shape is None or a_i >= len(a_t.shape) or b_i >= len(b_t.shape):
        return
    try:
        ctx.table.meet(a_t.shape[a_i], b_t.shape[b_i])
    except ShapeConflict:
        ctx.error("op-input", label, f"{op} node '{label}': dim {a_i} of '{a_name}' {list_dims(a_t.shape)} is "
                  f"{a_t.shape[a_i]} but dim {b_i} of '{b_name}' {list_dims(b_t.shape)} is {b_t.shape[b_i]} ({why})")


def _meet_value(ctx, label, op, name, t, i, value, why) -> None:
    if t.shape is None or i >= len(t.shape):
        return
    try:
        ctx.table.meet(t.shape[i], value)
    except ShapeConflict:
        ctx.error("op-input", label, f"{op} node '{label}': dim {i} of '{name}' {list_dims(t.shape)} is "
                  f"{ctx.table.resolve(t.shape[i])}, expected {value} ({why})")


def _position(ctx, label, op, name, t, batch_t, batch_name, batch_axis: int = 0) -> bool:
    if t.elem is not None and t.elem != TensorProto.INT64:
        ctx.error("op-input", label, f"{op} node '{label}': input '{name}' is {elem_name(t.elem)}; "
                  f"positions must be int64")
        return False
    if t.rank is not None and t.rank > 1:
        ctx.error("op-input", label, f"{op} node '{label}': input '{name}' has shape {list_dims(t.shape)}; "
                  f"it must be a scalar or one entry per batch row")
        return False
    if t.rank == 1:
        _meet_dim(ctx, label, op, name, t, 0, batch_name, batch_t, batch_axis, "one position per batch row")
    return True


def cache_update(ctx, node, label, ins):
    op = "CacheUpdate"
    if not _contract(ctx, node, label):
        return [ins[0] if ins else None]
    cache, values, pos = _pad(ins, 3)
    cname, vname, pname = (list(node.input) + ["", "", ""])[:3]
    if cache.rank is not None and cache.rank < 3:
        ctx.error("op-input", label, f"{op} node '{label}': input '{cname}' has rank {cache.rank} "
                  f"{list_dims(cache.shape)}; a cache needs rank >= 3, e.g. BNSH [batch, heads, capacity, head_size]")
        return [cache]
    if cache.elem is not None and cache.elem not in FLOATS:
        ctx.error("op-input", label, f"{op} node '{label}': input '{cname}' is {elem_name(cache.elem)}; "
                  f"CacheUpdate takes float32, float16 or bfloat16")
    if cache.elem is not None and values.elem is not None and cache.elem != values.elem:
        ctx.error("op-input", label, f"{op} node '{label}': input '{vname}' is {elem_name(values.elem)} but "
                  f"'{cname}' is {elem_name(cache.elem)}; the new values must have the cache's element type")
    rank = cache.rank if cache.rank is not None else values.rank
    seq_axis = attribute(node, "seq_axis")
    batch_axis = 1 if seq_axis == 0 else 0  # seq_axis 0: SBNH [capacity, batch, ...] (Note [CacheUpdate SBNH])
    if rank is None:
        _position(ctx, label, op, pname, pos, cache, cname, batch_axis)
        return [cache]
    axis = seq_axis + rank if seq_axis < 0 else seq_axis
    if not 1 <= axis < rank and seq_axis != 0:
        ctx.error("op-input", label, f"{op} node '{label}': seq_axis={seq_axis} resolves to axis {axis} of a "
                  f"rank-{rank} cache; the sequence axis must be 0 (SBNH) or in [1, {rank - 1}] (-2 for BNSH, "
                  f"1 for BSNH)")
        return [cache]
    flat = (cache.rank is not None and values.rank == 3 and cache.rank >= 4 and axis == 1 and seq_axis != 0)
    if flat:  # [batch, n, heads * head_size] for a BSNH cache (Note [CacheUpdate flat values] in cache_update_op.cc)
        _meet_dim(ctx, label, op, vname, values, 0, cname, cache, 0, "the batch")
        trailing = [ctx.table.resolve(d) for d in (cache.shape or [])[2:]]
        if trailing and all(isinstance(d, int) for d in trailing):
            _meet_value(ctx, label, op, vname, values, 2, math.prod(trailing),
                        f"flat values [batch, n, width] need width {' x '.join(map(str, trailing))}")
    elif cache.rank is not None and values.rank is not None:
        if values.rank != cache.rank:
            ctx.error("op-input", label, f"{op} node '{label}': input '{vname}' {list_dims(values.shape)} has "
                      f"rank {values.rank} but '{cname}' {list_dims(cache.shape)} has rank {cache.rank}; they "
                      f"must differ only along the sequence axis {axis}")
            return [cache]
        for i in range(rank):
            if i != axis:
                _meet_dim(ctx, label, op, vname, values, i, cname, cache, i,
                          f"only the sequence axis {axis} may differ")
    values = ctx.type_of(vname)
    n = values.shape[1 if flat else axis] if values.shape is not None else None
    if isinstance(n, int) and n < 1:
        ctx.error("op-input", label, f"{op} node '{label}': input '{vname}' {list_dims(values.shape)} holds {n} "
                  f"tokens along the sequence axis {axis}; n must be >= 1")
    _position(ctx, label, op, pname, pos, cache, cname, batch_axis)
    cache = ctx.type_of(cname)
    cap = cache.shape[axis] if cache.shape is not None else None
    ctx.check_capacity(label, op, pname, n, cap, f"'{cname}'", "position")
    return [cache]


LAYOUT_DOC = {1: "[batch, capacity, kv_heads, head_size]", 2: "[batch, kv_heads, capacity, head_size]",
              0: "[capacity, batch, kv_heads, head_size]"}


def cache_attention(ctx, node, label, ins):
    op = "CacheAttention"
    q, k, v, start = _pad(ins, 4)
    qn, kn, vn, sn = (list(node.input) + [""] * 4)[:4]
    if not _contract(ctx, node, label):
        return [q]
    contract = CONTRACTS[(node.domain, node.op_type)]
    hq, hkv = attribute(node, "num_heads"), attribute(node, "kv_num_heads")
    seq_axis = attribute(node, "seq_axis")
    max_group = contract.limits["max_group"]
    if hq % hkv or hq // hkv > max_group:
        ctx.error("op-input", label, f"{op} node '{label}': num_heads={hq} must be a positive multiple of "
                  f"kv_num_heads={hkv} with at most {max_group} query heads per KV head (the kernel's limit)")
        return [q]
    # seq_axis -2 is axis 2 of the rank-4 cache; 0 is SBNH [capacity, batch, kv_heads, head_size]
    cache_axis = {1: 1, 0: 0}.get(seq_axis, 2)
    batch_axis = 1 if seq_axis == 0 else 0
    if q.rank is not None and q.rank != 3:
        ctx.error("op-input", label, f"{op} node '{label}': query '{qn}' {list_dims(q.shape)} must be "
                  f"[batch, tokens, num_heads * head_size]")
        return [q]
    for name, t in ((kn, k), (vn, v)):
        if t.rank is not None and t.rank != 4:
            ctx.error("op-input", label, f"{op} node '{label}': cache '{name}' {list_dims(t.shape)} must have rank 4 "
                      f"({LAYOUT_DOC[cache_axis]})")
            return [q]
    for name, t in ((qn, q), (kn, k), (vn, v)):  # the rules follow the CPU kernel (float16 / bfloat16: CUDA only)
        if t.elem is not None and t.elem != TensorProto.FLOAT:
            ctx.error("op-input", label, f"{op} node '{label}': {'query' if name == qn else 'cache'} '{name}' is "
                      f"{elem_name(t.elem)}; the CPU kernel takes float32 query, key and value")
    for i in range(4):
        _meet_dim(ctx, label, op, vn, v, i, kn, k, i, "the key and value caches share one layout")
    head_axis = 1 if cache_axis == 2 else 2
    _meet_value(ctx, label, op, kn, k, head_axis, hkv, f"kv_num_heads={hkv}")
    _meet_dim(ctx, label, op, qn, q, 0, kn, k, batch_axis, "batch")
    k = ctx.type_of(kn)
    if k.shape is not None and isinstance(k.shape[3], int):
        _meet_value(ctx, label, op, qn, q, 2, hq * k.shape[3], f"num_heads={hq} x head_size={k.shape[3]}")
    _position(ctx, label, op, sn, start, q, qn)
    q, k = ctx.type_of(qn), ctx.type_of(kn)
    if q.shape is not None and k.shape is not None:
        ctx.check_capacity(label, op, sn, q.shape[1], k.shape[cache_axis], f"'{kn}'", "start")
    return [q]


_QKV_DOC = "[batch, tokens, (num_heads + 2 kv_num_heads) * head_size]"
_TABLE_DOC = "[rows, head_size / 2]"


def _ranks_ok(ctx, label, op, entries) -> bool:
    """(name, type, rank, shape doc) entries: False (reported) at the first known rank that differs."""
    for name, t, rank, what in entries:
        if t.rank is not None and t.rank != rank:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' {list_dims(t.shape)} must be {what}")
            return False
    return True


def _qkv_head_size(ctx, label, op, qn, qkv, hq, hkv, cn, cos):
    """(ok, head_size or None) of a fused qkv [batch, tokens, (num_heads + 2 kv_num_heads) * head_size] with an even
    head_size (the rotary turns pairs); the rotary table's width meets head_size / 2."""
    width = qkv.shape[2] if qkv.shape is not None else None
    if not isinstance(width, int):
        return True, None
    if width % (hq + 2 * hkv) or (width // (hq + 2 * hkv)) % 2:
        ctx.error("op-input", label, f"{op} node '{label}': '{qn}' width {width} must be (num_heads + 2 "
                  f"kv_num_heads) * head_size = {hq + 2 * hkv} * head_size with an even head_size")
        return False, None
    d = width // (hq + 2 * hkv)
    _meet_value(ctx, label, op, cn, cos, 1, d // 2, f"head_size / 2 = {d // 2}")
    return True, d


def rotary_cache_update(ctx, node, label, ins):
    """RotaryCacheUpdate (Note [RotaryCacheUpdate] in custom_ops/include/ortkv/rotary_cache_update.h): q_rot
    [batch, tokens, num_heads * head_size], and the two caches (outputs 1, 2 alias inputs 1, 2)."""
    op = "RotaryCacheUpdate"
    qkv, kc, vc, pos, cos, sin = _pad(ins, 6)[:6]
    qn, kn, vn, pn, cn, sn = (list(node.input) + [""] * 6)[:6]
    unknown = [ValueType(qkv.elem), kc, vc]
    if not _contract(ctx, node, label):
        return unknown
    hq, hkv = attribute(node, "num_heads"), attribute(node, "kv_num_heads")
    seq_axis = attribute(node, "seq_axis")
    cache_axis = {1: 1, 0: 0}.get(seq_axis, 2)
    batch_axis = 1 if seq_axis == 0 else 0
    head_axis = 1 if cache_axis == 2 else 2
    for name, t in ((qn, qkv), (kn, kc), (vn, vc), (cn, cos), (sn, sin)):
        if t.elem is not None and qkv.elem is not None and t.elem != qkv.elem:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)} but '{qn}' is "
                      f"{elem_name(qkv.elem)}; qkv, both caches and the rotary tables must have one element type")
            return unknown
    if not _ranks_ok(ctx, label, op, ((qn, qkv, 3, _QKV_DOC), (kn, kc, 4, LAYOUT_DOC[cache_axis]),
                                      (vn, vc, 4, LAYOUT_DOC[cache_axis]), (cn, cos, 2, _TABLE_DOC),
                                      (sn, sin, 2, _TABLE_DOC))):
        return unknown
    for i in range(4):
        _meet_dim(ctx, label, op, vn, vc, i, kn, kc, i, "the key and value caches share one shape")
    for i in range(2):
        _meet_dim(ctx, label, op, sn, sin, i, cn, cos, i, "the sin and cos tables share one shape")
    _meet_value(ctx, label, op, kn, kc, head_axis, hkv, f"kv_num_heads={hkv}")
    _meet_dim(ctx, label, op, qn, qkv, 0, kn, kc, batch_axis, "batch")
    qkv, kc = ctx.type_of(qn), ctx.type_of(kn)
    ok, d = _qkv_head_size(ctx, label, op, qn, qkv, hq, hkv, cn, cos)
    if not ok:
        return unknown
    if d is not None:
        _meet_value(ctx, label, op, kn, kc, 3, d, f"head_size {d} from '{qn}'")
    kc, cos = ctx.type_of(kn), ctx.type_of(cn)
    cap = kc.shape[cache_axis] if kc.shape is not None else None
    rows = cos.shape[0] if cos.shape is not None else None
    if isinstance(cap, int) and isinstance(rows, int) and rows < cap:
        ctx.error("op-input", label, f"{op} node '{label}': rotary table '{cn}' has {rows} rows but the caches hold "
                  f"{cap} positions; it needs a row for every position a cache can hold (rows >= capacity)")
    _position(ctx, label, op, pn, pos, kc, kn, batch_axis)
    n = qkv.shape[1] if qkv.shape is not None else None
    ctx.check_capacity(label, op, pn, n, cap, f"'{kn}'", "position")
    q = ValueType(qkv.elem, None if qkv.shape is None else (qkv.shape[0], qkv.shape[1], None if d is None else hq * d))
    return [q, ctx.type_of(kn), ctx.type_of(vn)]


def swiglu(ctx, node, label, ins):
    """SwiGLU (Note [SwiGLU]): x [..., 2F] -> [..., F]."""
    x = ins[0] if ins else ValueType()
    if not _contract(ctx, node, label):
        return [ValueType(x.elem)]
    if x.elem is not None and x.elem not in FLOATS:
        ctx.error("op-input", label, f"SwiGLU node '{label}': input '{node.input[0]}' is {elem_name(x.elem)}; "
                  f"SwiGLU takes float32, float16 or bfloat16")
    if not x.shape:
        return [ValueType(x.elem, x.shape)]
    last = x.shape[-1]
    if isinstance(last, int) and last % 2:
        ctx.error("op-input", label, f"SwiGLU node '{label}': input '{node.input[0]}' {list_dims(x.shape)} has an "
                  f"odd last dim {last}; it must be 2 * F (gate, then up)")
    return [ValueType(x.elem, tuple(x.shape[:-1]) + (last // 2 if isinstance(last, int) else None,))]


# The CPU kernel's sizes (custom_ops/include/ortkv/cache_attention.h): keys go by in blocks of 64 with an
# online softmax; split-K aims at 24 tasks, so (units x splits) < 24 + units <= 48 when it splits.
_ATTN_BLOCK_KEYS, _ATTN_MAX_SPLIT_TASKS = 64, 48


def cache_attention_workspace(ctx, node, threads: int) -> int:
    """The CPU kernel's scratch, independent of the cache length: per thread, G x (64 + 2D + 2) floats
    (a block's scores, the scaled queries, the accumulator, m and l); plus, when one sequence's keys are
    split across threads, at most 48 x G x (D + 2) floats of partials (an upper bound)."""
    if len(node.input) < 2:
        return 0
    k = ctx.type_of(node.input[1])
    hq, hkv = attribute(node, "num_heads") or 1, attribute(node, "kv_num_heads") or 1
    if k.shape is None or len(k.shape) != 4 or not isinstance(k.shape[3], int) or hkv < 1:
        return 0
    group, head = max(hq // hkv, 0), k.shape[3]
    per_thread = group * (_ATTN_BLOCK_KEYS + 2 * head + 2) * 4
    return per_thread * threads + _ATTN_MAX_SPLIT_TASKS * group * (head + 2) * 4


def _paged_common(ctx, node, label, op, pool, directory, table, pn, dn, tn) -> bool:
    """Ports and attributes shared by both paged ops; False when the node cannot run."""
    ok = True
    layer, layers = attribute(node, "layer"), attribute(node, "num_layers")
    if isinstance(layer, int) and isinstance(layers, int) and layer >= layers:
        ctx.error("op-input", label, f"{op} node '{label}': attribute layer={layer} must be in [0, num_layers="
                  f"{layers})")
        ok = False
    for name, t, elem, rank, what in ((pn, pool, TensorProto.UINT8, 1, "[pool_bytes] uint8: the page pool's bytes"),
                                      (dn, directory, TensorProto.INT64, 2, "[num_pages, 2] int64 = (format, offset)"),
                                      (tn, table, TensorProto.INT32, 2, "[batch, max_pages] int32 page ids")):
        if (t.elem is not None and t.elem != elem) or (t.rank is not None and t.rank != rank):
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)} "
                      f"{list_dims(t.shape)}; it must be {what}")
            ok = False
    _meet_value(ctx, label, op, dn, directory, 1, 2, "(format, byte offset) per page")
    return ok


def _page_fill(ctx, node, label, op, fill, fn, table, tn) -> None:
    """The optional page_fill input (Note [Page fill]): int32 with the page table's shape."""
    if not fn:
        return
    if (fill.elem is not None and fill.elem != TensorProto.INT32) or (fill.rank is not None and fill.rank != 2):
        ctx.error("op-input", label, f"{op} node '{label}': '{fn}' is {elem_name(fill.elem)} {list_dims(fill.shape)}; "
                  f"page_fill must be int32 [batch, max_pages], the shape of the page table '{tn}'")
        return
    for i in range(2):
        _meet_dim(ctx, label, op, fn, fill, i, tn, table, i, "page_fill has the page table's shape")


def paged_cache_update(ctx, node, label, ins):
    op = "PagedCacheUpdate"
    pool, directory, table, key, value, pos, fill = _pad(ins, 7)[:7]
    pn, dn, tn, kn, vn, sn, fn = (list(node.input) + [""] * 7)[:7]
    if not _contract(ctx, node, label):
        return [pool]
    if not _paged_common(ctx, label=label, node=node, op=op, pool=pool, directory=directory, table=table, pn=pn,
                         dn=dn, tn=tn):
        return [pool]
    for name, t in ((kn, key), (vn, value)):
        if t.rank is not None and t.rank != 3:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' {list_dims(t.shape)} must be "
                      f"[batch, tokens, kv_heads * head_size]")
            return [pool]
        if t.elem is not None and t.elem not in FLOATS:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)}; the kernel "
                      f"quantizes float32, float16 or bfloat16 keys and values into the pages")
    if key.elem is not None and value.elem is not None and key.elem != value.elem:
        ctx.error("op-input", label, f"{op} node '{label}': key '{kn}' is {elem_name(key.elem)} but value '{vn}' is "
                  f"{elem_name(value.elem)}; they must have one type")
    for i in range(3):
        _meet_dim(ctx, label, op, vn, value, i, kn, key, i, "key and value have one shape")
    _meet_dim(ctx, label, op, kn, key, 0, tn, table, 0, "one page-table row per batch row")
    hkv = attribute(node, "kv_num_heads")
    key = ctx.type_of(kn)
    if key.shape is not None and isinstance(key.shape[2], int) and isinstance(hkv, int) and key.shape[2] % hkv:
        ctx.error("op-input", label, f"{op} node '{label}': '{kn}' width {key.shape[2]} must be kv_num_heads "
                  f"({hkv}) * head_size")
    _position(ctx, label, op, sn, pos, key, kn)
    _page_fill(ctx, node, label, op, fill, fn, table, tn)
    table, key = ctx.type_of(tn), ctx.type_of(kn)
    page_size = attribute(node, "page_size")
    if table.shape is not None and key.shape is not None and page_size:
        max_pages = table.shape[1]
        cap = max_pages * page_size if isinstance(max_pages, int) else None
        ctx.check_capacity(label, op, sn, key.shape[1], cap, f"page table '{tn}' ({max_pages} pages x {page_size} tokens)",
                           "position")
    return [ctx.type_of(pn)]


def paged_rotary_cache_update(ctx, node, label, ins):
    """PagedRotaryCacheUpdate (Note [PagedRotaryCacheUpdate] in custom_ops/include/ortkv/paged.h): the updated pool
    (aliases the pool) and q_rot [batch, tokens, num_heads * head_size]."""
    op = "PagedRotaryCacheUpdate"
    pool, directory, table, qkv, pos, cos, sin, fill = _pad(ins, 8)[:8]
    pn, dn, tn, qn, sn, cn, snn, fn = (list(node.input) + [""] * 8)[:8]
    unknown = [pool, ValueType(qkv.elem)]
    if not _contract(ctx, node, label):
        return unknown
    if not _paged_common(ctx, label=label, node=node, op=op, pool=pool, directory=directory, table=table, pn=pn,
                         dn=dn, tn=tn):
        return unknown
    hq, hkv = attribute(node, "num_heads"), attribute(node, "kv_num_heads")
    for name, t in ((qn, qkv), (cn, cos), (snn, sin)):
        if t.elem is not None and t.elem not in FLOATS:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)}; qkv and the rotary "
                      f"tables are float32, float16 or bfloat16")
            return unknown
        if t.elem is not None and qkv.elem is not None and t.elem != qkv.elem:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)} but '{qn}' is "
                      f"{elem_name(qkv.elem)}; qkv and the rotary tables must have one element type")
            return unknown
    if not _ranks_ok(ctx, label, op, ((qn, qkv, 3, _QKV_DOC), (cn, cos, 2, _TABLE_DOC), (snn, sin, 2, _TABLE_DOC))):
        return unknown
    for i in range(2):
        _meet_dim(ctx, label, op, snn, sin, i, cn, cos, i, "the sin and cos tables share one shape")
    _meet_dim(ctx, label, op, qn, qkv, 0, tn, table, 0, "one page-table row per batch row")
    qkv = ctx.type_of(qn)
    ok, d = _qkv_head_size(ctx, label, op, qn, qkv, hq, hkv, cn, cos)
    if not ok:
        return unknown
    _position(ctx, label, op, sn, pos, qkv, qn)
    _page_fill(ctx, node, label, op, fill, fn, table, tn)
    table, cos = ctx.type_of(tn), ctx.type_of(cn)
    page_size = attribute(node, "page_size")
    max_pages = table.shape[1] if table.shape is not None else None
    cap = max_pages * page_size if isinstance(max_pages, int) and page_size else None
    rows = cos.shape[0] if cos.shape is not None else None
    if qkv.shape is not None:
        ctx.check_capacity(label, op, sn, qkv.shape[1], cap, f"page table '{tn}' ({max_pages} pages x {page_size} "
                           f"tokens)", "position")
        # a row per position written (the kernels check each row's position against the tables' rows)
        ctx.check_capacity(label, op, sn, qkv.shape[1], rows, f"rotary table '{cn}' ({rows} rows, one per position)",
                           "position")
    q = ValueType(qkv.elem, None if qkv.shape is None else (qkv.shape[0], qkv.shape[1], None if d is None else hq * d))
    return [ctx.type_of(pn), q]


def paged_cache_attention(ctx, node, label, ins):
    op = "PagedCacheAttention"
    q, pool, directory, table, start, fill = _pad(ins, 6)[:6]
    qn, pn, dn, tn, sn, fn = (list(node.input) + [""] * 6)[:6]
    if not _contract(ctx, node, label):
        return [q]
    if not _paged_common(ctx, label=label, node=node, op=op, pool=pool, directory=directory, table=table, pn=pn,
                         dn=dn, tn=tn):
        return [q]
    contract = CONTRACTS[(node.domain, node.op_type)]
    hq, hkv = attribute(node, "num_heads"), attribute(node, "kv_num_heads")
    max_group = contract.limits["max_group"]
    if hq % hkv or hq // hkv > max_group:
        ctx.error("op-input", label, f"{op} node '{label}': num_heads={hq} must be a positive multiple of "
                  f"kv_num_heads={hkv} with at most {max_group} query heads per KV head (the kernel's limit)")
        return [q]
    if q.rank is not None and q.rank != 3:
        ctx.error("op-input", label, f"{op} node '{label}': query '{qn}' {list_dims(q.shape)} must be "
                  f"[batch, tokens, num_heads * head_size]")
        return [q]
    if q.elem is not None and q.elem not in FLOATS:
        ctx.error("op-input", label, f"{op} node '{label}': query '{qn}' is {elem_name(q.elem)}; the kernel takes "
                  f"float32, float16 or bfloat16")
    if q.shape is not None and isinstance(q.shape[2], int) and q.shape[2] % hq:
        ctx.error("op-input", label, f"{op} node '{label}': query '{qn}' width {q.shape[2]} must be num_heads "
                  f"({hq}) * head_size")
    _meet_dim(ctx, label, op, qn, q, 0, tn, table, 0, "one page-table row per batch row")
    _position(ctx, label, op, sn, start, q, qn)
    _page_fill(ctx, node, label, op, fill, fn, table, tn)
    q, table = ctx.type_of(qn), ctx.type_of(tn)
    page_size = attribute(node, "page_size")
    if q.shape is not None and table.shape is not None and page_size:
        max_pages = table.shape[1]
        cap = max_pages * page_size if isinstance(max_pages, int) else None
        ctx.check_capacity(label, op, sn, q.shape[1], cap, f"page table '{tn}' ({max_pages} pages x {page_size} tokens)",
                           "start")
    return [q]


def paged_cache_attention_workspace(ctx, node, threads: int) -> int:
    """The CPU kernel's scratch (custom_ops/include/ortkv/paged.h): CacheAttention's per-thread scratch plus
    one decoded block of 64 keys and 64 values (2 x 64 x D floats) per thread, and the same split-K partials;
    with page_fill bound (Note [Page fill]), its prefix sums, batch x (max_pages + 1) int64 (when known)."""
    if not node.input:
        return 0
    q = ctx.type_of(node.input[0])
    hq, hkv = attribute(node, "num_heads") or 1, attribute(node, "kv_num_heads") or 1
    if q.shape is None or len(q.shape) != 3 or not isinstance(q.shape[2], int) or hkv < 1 or hq < 1:
        return 0
    group, head = max(hq // hkv, 0), q.shape[2] // hq
    per_thread = (group * (_ATTN_BLOCK_KEYS + 2 * head + 2) + 2 * _ATTN_BLOCK_KEYS * head) * 4
    fill_prefix = 0
    if len(node.input) > 5 and node.input[5]:
        f = ctx.type_of(node.input[5])
        if f.shape is not None and len(f.shape) == 2 and all(isinstance(d, int) for d in f.shape):
            fill_prefix = f.shape[0] * (f.shape[1] + 1) * 8
    return per_thread * threads + _ATTN_MAX_SPLIT_TASKS * group * (head + 2) * 4 + fill_prefix


def passthrough(ctx, node, label, ins):
    return [ins[0] if ins else None]


def _int_attr(node, name):
    v = attr(node, name)
    return v if isinstance(v, int) else None


def simplified_layer_norm(ctx, node, label, ins):
    x = ins[0] if ins else ValueType()
    outs = [x]
    if len(node.output) > 1 and x.shape:  # rank >= 1
        axis = (_int_attr(node, "axis") if _int_attr(node, "axis") is not None else -1)
        if -len(x.shape) <= axis < len(x.shape):
            axis %= len(x.shape)
            outs.append(ValueType(TensorProto.FLOAT, tuple(x.shape[:axis]) + (1,) * (len(x.shape) - axis)))
    return outs


def skip_simplified_layer_norm(ctx, node, label, ins):
    """com.microsoft.SkipSimplifiedLayerNormalization: output and input_skip_bias_sum (outputs 0 and 3) as
    the input; the optional mean / inv_std_var (1, 2) float [..., 1] over the last axis."""
    x = ins[0] if ins else ValueType()
    stat = ValueType(TensorProto.FLOAT, tuple(x.shape[:-1]) + (1,) if x.shape else None)
    return [x, stat, stat, x][:len(node.output)]


def matmul_nbits(ctx, node, label, ins):
    a = ins[0] if ins else ValueType()
    n, k = _int_attr(node, "N"), _int_attr(node, "K")
    if a.shape and k is not None:
        _meet_value(ctx, label, "MatMulNBits", node.input[0], a, len(a.shape) - 1, k, f"K={k}")
    return [ValueType(a.elem, None if not a.shape else tuple(a.shape[:-1]) + (n,))]


def matmul_q4(ctx, node, label, ins):
    """ortkv.MatMulQ4 (Note [MatMulQ4 layout] in custom_ops/include/ortkv/matmul_q4.h): X float32 [..., K],
    codes uint8 [T, K / 32, 256], scales / mins float16 [T, K / 32, 16] with T = ceil(N / 16) -> Y float32
    [..., N]; K a multiple of 32."""
    op = "MatMulQ4"
    x = _pad(ins, 4)[0]
    if not _contract(ctx, node, label):
        return [ValueType(TensorProto.FLOAT)]
    n, k = attribute(node, "N"), attribute(node, "K")
    out = ValueType(TensorProto.FLOAT, None if x.shape is None or not x.shape else tuple(x.shape[:-1]) + (n,))
    if k % 32:
        ctx.error("op-input", label, f"{op} node '{label}': attribute K={k} is not a multiple of 32 (the Q4_1 block); "
                  "MatMulQ4 takes only such K: use MatMul or MatMulNBits for this matrix")
        return [out]
    if x.elem is not None and x.elem != TensorProto.FLOAT:
        ctx.error("op-input", label, f"{op} node '{label}': X '{node.input[0]}' is {elem_name(x.elem)}; MatMulQ4 "
                  "takes float32 X")
    if x.shape is not None and len(x.shape) == 0:
        ctx.error("op-input", label, f"{op} node '{label}': X '{node.input[0]}' is a scalar; it must be [..., K={k}]")
        return [out]
    if x.shape:
        _meet_value(ctx, label, op, node.input[0], x, len(x.shape) - 1, k, f"K={k}")
    tiles, blocks = -(-n // 16), k // 32
    for i, (port, last) in enumerate((("codes", 256), ("scales", 16), ("mins", 16)), start=1):
        t = _pad(ins, 4)[i]
        want = (tiles, blocks, last)
        if t.elem is not None and t.elem != (TensorProto.UINT8 if i == 1 else TensorProto.FLOAT16) or \
                t.shape is not None and all(isinstance(d, int) for d in t.shape) and tuple(t.shape) != want:
            ctx.error("op-input", label, f"{op} node '{label}': {port} '{node.input[i]}' is {elem_name(t.elem)} "
                      f"{list_dims(t.shape) if t.shape is not None else '[?]'}; expected "
                      f"{'uint8' if i == 1 else 'float16'} {list(want)} for K={k}, N={n}; repack the Q4_1 matrix "
                      "with ortkv.generate.weights.pack_matmul_q4 (Note [MatMulQ4 layout])")
    return [out]


def linear(ctx, node, label, ins):
    """ortkv.Linear (Note [Linear] in custom_ops/include/ortkv/linear.h): X [..., K], W [N, K] of X's float type
    -> Y [..., N]; K a multiple of 8."""
    op = "Linear"
    x, w = _pad(ins, 2)[:2]
    if not _contract(ctx, node, label):
        return [ValueType(x.elem)]
    for name, t in ((node.input[0], x), (node.input[1], w)):
        if t.elem is not None and t.elem not in FLOATS:
            ctx.error("op-input", label, f"{op} node '{label}': '{name}' is {elem_name(t.elem)}; Linear takes float32, "
                      "float16 or bfloat16")
    if x.elem is not None and w.elem is not None and x.elem != w.elem:
        ctx.error("op-input", label, f"{op} node '{label}': X '{node.input[0]}' is {elem_name(x.elem)} but W "
                  f"'{node.input[1]}' is {elem_name(w.elem)}; both must have the same float type")
    if w.shape is not None and len(w.shape) != 2:
        ctx.error("op-input", label, f"{op} node '{label}': W '{node.input[1]}' is {list_dims(w.shape)}; it must be "
                  "[N, K] (rank 2, torch's Linear layout: MatMul's B transposed)")
        return [ValueType(x.elem)]
    if x.shape is not None and len(x.shape) == 0:
        ctx.error("op-input", label, f"{op} node '{label}': X '{node.input[0]}' is a scalar; it must be [..., K]")
        return [ValueType(x.elem)]
    n = w.shape[0] if w.shape is not None else None
    if x.shape and w.shape is not None:
        _meet_dim(ctx, label, op, node.input[0], x, len(x.shape) - 1, node.input[1], w, 1,
                  "K: W must be [N, K] with X's last dim as K")
    k = ctx.table.resolve(w.shape[1]) if w.shape is not None else (ctx.table.resolve(x.shape[-1]) if x.shape else None)
    if isinstance(k, int) and k % 8:
        ctx.error("op-input", label, f"{op} node '{label}': K = {k} is not a multiple of 8; Linear reads W in 16-byte "
                  "vectors of 8 elements: use MatMul for this matrix")
    if attr(node, "activation") in ("swiglu", b"swiglu"):  # Note [Linear SwiGLU epilogue]: Y [..., N / 2]
        n_val = ctx.table.resolve(n) if n is not None else None
        if isinstance(n_val, int) and n_val % 2:
            ctx.error("op-input", label, f"{op} node '{label}': activation 'swiglu' needs W '{node.input[1]}' to have "
                      f"an even N (gate rows, then as many up rows); N = {n_val}")
        n = n_val // 2 if isinstance(n_val, int) else None
    y = ValueType(x.elem, None if not x.shape else tuple(x.shape[:-1]) + (n,))
    names = list(node.input) + [""] * (4 - len(node.input))
    if names[2] or names[3]:  # Note [Linear norm prologue]: skip [..., K] and gamma [K], float32
        skip, gamma = _pad(ins, 4)[2:4]
        if not (names[2] and names[3]):
            ctx.error("op-input", label, f"{op} node '{label}': the norm prologue takes skip (input 2) and gamma "
                      f"(input 3) together; only {'skip' if names[2] else 'gamma'} is given")
        for nm, t in ((names[2], skip), (names[3], gamma)):
            if nm and t.elem is not None and x.elem is not None and t.elem != x.elem:
                ctx.error("op-input", label, f"{op} node '{label}': '{nm}' is {elem_name(t.elem)} but X "
                          f"'{node.input[0]}' is {elem_name(x.elem)}; the norm prologue takes X's type")
        return [y, ValueType(x.elem, x.shape)]
    return [y]


def group_query_attention(ctx, node, label, ins):
    q, past_k = _pad(ins, 4)[0], _pad(ins, 4)[3]
    hq, hkv = _int_attr(node, "num_heads"), _int_attr(node, "kv_num_heads")
    d = past_k.shape[3] if past_k.shape is not None and len(past_k.shape) == 4 else None
    q_ok = q.shape is not None and len(q.shape) == 3
    out = ValueType(q.elem, None if not q_ok else (q.shape[0], q.shape[1],
                                                   hq * d if isinstance(d, int) and hq is not None else None))
    present = ValueType(q.elem, None if not q_ok else (q.shape[0], hkv, None, d))
    return [out, present, present]


OP_RULES = {
    ("ortkv", "CacheUpdate"): cache_update,
    ("ortkv", "CacheAttention"): cache_attention,
    ("ortkv", "PagedCacheUpdate"): paged_cache_update,
    ("ortkv", "PagedRotaryCacheUpdate"): paged_rotary_cache_update,
    ("ortkv", "PagedCacheAttention"): paged_cache_attention,
    ("ortkv", "RotaryCacheUpdate"): rotary_cache_update,
    ("ortkv", "SwiGLU"): swiglu,
    ("com.microsoft", "SimplifiedLayerNormalization"): simplified_layer_norm,
    ("", "SimplifiedLayerNormalization"): simplified_layer_norm,  # ORT also registers it in the onnx domain
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): skip_simplified_layer_norm,
    ("com.microsoft", "RotaryEmbedding"): passthrough,
    ("com.microsoft", "MatMulNBits"): matmul_nbits,
    ("ortkv", "MatMulQ4"): matmul_q4,
    ("ortkv", "Linear"): linear,
    ("com.microsoft", "GroupQueryAttention"): group_query_attention,
}

WORKSPACE = {
    ("ortkv", "CacheAttention"): cache_attention_workspace,
    ("ortkv", "PagedCacheAttention"): paged_cache_attention_workspace,
}

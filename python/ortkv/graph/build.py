"""Helpers that build ortkv nodes with their alias annotation already declared."""

from __future__ import annotations

import onnx
from onnx import helper

DOMAIN = "ortkv"


def make_cache_update(cache: str, values: str, position: str, updated: str, *, name: str,
                      seq_axis: int = -2) -> onnx.NodeProto:
    """``updated = CacheUpdate(cache, values, position)``, declared ``0:0:MUST_ALIAS``.

    seq_axis=-2 for BNSH [batch, heads, capacity, head_size]; 1 for BSNH."""
    from .annotations import declare_output_alias

    node = helper.make_node("CacheUpdate", [cache, values, position], [updated], domain=DOMAIN, name=name,
                            seq_axis=seq_axis)
    declare_output_alias(node, 0, 0)
    return node


def make_cache_attention(query: str, key_cache: str, value_cache: str, start: str, output: str, *, name: str,
                         num_heads: int, kv_num_heads: int, scale: float = 0.0, seq_axis: int = 1) -> onnx.NodeProto:
    """``output = CacheAttention(query, key_cache, value_cache, start)``: GQA over the caches in place.
    start: the position of each row's first new token (the row's length before this block)."""
    return helper.make_node("CacheAttention", [query, key_cache, value_cache, start], [output], domain=DOMAIN,
                            name=name, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=float(scale),
                            seq_axis=seq_axis)


def make_rotary_cache_update(qkv: str, k_cache: str, v_cache: str, positions: str, cos_cache: str, sin_cache: str,
                             q_rot: str, k_updated: str, v_updated: str, *, name: str, num_heads: int,
                             kv_num_heads: int, seq_axis: int = -2) -> onnx.NodeProto:
    """``q_rot, k_updated, v_updated = RotaryCacheUpdate(qkv, k_cache, v_cache, positions, cos_cache, sin_cache)``
    (Note [RotaryCacheUpdate] in custom_ops/include/ortkv/rotary_cache_update.h), declared ``1:1:MUST_ALIAS`` and
    ``2:2:MUST_ALIAS``. seq_axis as CacheUpdate's: -2 BNSH, 1 BSNH, 0 SBNH."""
    from .annotations import declare_output_alias

    node = helper.make_node("RotaryCacheUpdate", [qkv, k_cache, v_cache, positions, cos_cache, sin_cache],
                            [q_rot, k_updated, v_updated], domain=DOMAIN, name=name, num_heads=num_heads,
                            kv_num_heads=kv_num_heads, seq_axis=seq_axis)
    declare_output_alias(node, 1, 1)
    declare_output_alias(node, 2, 2)
    return node


def make_swiglu(x: str, y: str, *, name: str) -> onnx.NodeProto:
    """``y = SwiGLU(x)``: x [..., 2F] (gate, then up) -> silu(gate) * up [..., F] (Note [SwiGLU])."""
    return helper.make_node("SwiGLU", [x], [y], domain=DOMAIN, name=name)

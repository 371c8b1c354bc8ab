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

"""ortkv.graph: alias annotations in the model, the alias checker, alias-aware shape inference
(ShapesContext), the peak-memory planner, and helpers to build ortkv nodes."""

from .annotations import (
    ACCESS_KEY,
    ALIAS_OF_KEY,
    MUST_ALIAS,
    OUTPUT_ALIAS_KEY,
    Access,
    AliasAnnotations,
    OutputAlias,
    alias_of,
    annotate_in_place,
    declare_output_alias,
    ensure_ir_version,
    input_access,
    mark_mutable,
    output_aliases,
    read_annotations,
    set_alias_of,
    set_input_access,
)
from .checker import Finding, check_aliases, check_model
from .build import make_cache_attention, make_cache_update, make_rotary_cache_update, make_swiglu
from .dims import DimTable, ValueType
from .shapes import ShapesContext, infer_shapes, share_buffer_aliases
from .planner import MemoryPlan, plan_memory
from .check import CheckReport, check

__all__ = [
    "CheckReport", "DimTable", "MemoryPlan", "ShapesContext", "ValueType", "check", "infer_shapes", "plan_memory",
    "share_buffer_aliases",
    "ACCESS_KEY", "ALIAS_OF_KEY", "MUST_ALIAS", "OUTPUT_ALIAS_KEY", "Access", "AliasAnnotations", "Finding",
    "OutputAlias", "alias_of", "annotate_in_place", "check_aliases", "check_model", "declare_output_alias",
    "ensure_ir_version", "input_access", "make_cache_attention", "make_cache_update", "make_rotary_cache_update",
    "make_swiglu", "mark_mutable", "output_aliases",
    "read_annotations", "set_alias_of", "set_input_access",
]

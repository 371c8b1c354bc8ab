"""ShapesContext (alias-aware shape inference) and the memory planner.

CORPUS: small models built here with onnx.helper, each exercising one rule, accepted or rejected, with
the words the finding must contain. Then planner numbers for hand-computable models, checked exactly,
and the ``ortkv check`` command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from ortkv.cli import main as cli_main
from ortkv.graph import ShapesContext, ValueType, check, infer_shapes, make_cache_attention, make_cache_update, \
    mark_mutable, plan_memory, set_alias_of
from ortkv.graph.annotations import declare_output_alias
from ortkv.graph.dims import DimTable, ShapeConflict

F, F16, I64, I32, U8 = TP.FLOAT, TP.FLOAT16, TP.INT64, TP.INT32, TP.UINT8
KV = [1, 2, 8, 4]  # [batch, heads, capacity, head_size]: BNSH, sequence axis 2


def vi(name, shape=KV, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def init(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.array(value, dtype), name)


def model(nodes, inputs, outputs, inits=(), mutable=("past",), alias=None, functions=(), value_info=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1),
                                            helper.make_opsetid("local", 1)],
                          ir_version=10, functions=list(functions))
    for name in mutable:
        mark_mutable(m, name)
    for out, target in ({"present": "past"} if alias is None else alias).items():
        set_alias_of(m, out, target)
    return m


def update(cache="past", values="new", pos="pos", out="present", name="update", seq_axis=-2):
    return make_cache_update(cache, values, pos, out, name=name, seq_axis=seq_axis)


def basic(values=(1, 2, 1, 4), out_shape=KV, out_t=F, past_shape=KV, pos_input=True, inits=(), nodes=None,
          values_t=F, pos_t=I64, **kw):
    inputs = [vi("past", list(past_shape)), vi("new", list(values), values_t)]
    if pos_input:
        inputs.append(vi("pos", [], pos_t))
    return model(nodes or [update()], inputs, [vi("present", out_shape, out_t)], inits=inits, **kw)


# --- the corpus -------------------------------------------------------------------------------------

def m_accept():
    return basic(), {}


def m_alias_of_disagrees():
    inputs = [vi("past"), vi("other"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64)]
    return model([update()], inputs, [vi("present")], mutable=("past", "other"), alias={"present": "other"}), {}


def m_alias_type():
    return basic(out_t=F16), {}


def m_alias_rank():
    return basic(out_shape=[1, 2, 8]), {}


def m_alias_dim():
    return basic(out_shape=[1, 2, 16, 4]), {}


def m_symbolic_meets_concrete():
    return basic(past_shape=["batch", 2, "cap", 4], out_shape=[1, 2, 16, 4]), {}


def m_symbols_unify():
    return basic(past_shape=["b", 2, "cap", 4], out_shape=["batch", 2, "capacity", 4], values=("batch", 2, 1, 4)), \
        {"dims": {"capacity": 32}}


def m_bound_symbol_conflict():
    return basic(past_shape=[1, 2, "cap", 4], out_shape=[1, 2, 16, 4]), {"dims": {"cap": 8}}


def m_alias_cycle():
    m = basic()
    set_alias_of(m, "present", "loop_a")
    set_alias_of(m, "loop_a", "loop_b")
    set_alias_of(m, "loop_b", "present")
    return m, {}


def m_alias_index():
    node = update()
    declare_output_alias(node, 0, 2)
    node.metadata_props[0].value = "0:5:MUST_ALIAS"
    return basic(nodes=[node]), {}


def m_capacity_initializer():
    return basic(values=(1, 2, 2, 4), pos_input=False, inits=[init("pos", 7)]), {}


def m_capacity_exact_fit():
    return basic(values=(1, 2, 2, 4), pos_input=False, inits=[init("pos", 6)]), {}


def m_capacity_constant_node():
    const = helper.make_node("Constant", [], ["pos"], value=numpy_helper.from_array(np.array(8, np.int64)))
    return basic(pos_input=False, nodes=[const, update()]), {}


def m_capacity_folded():
    nodes = [helper.make_node("Add", ["five", "three"], ["pos"], name="add"), update()]
    return basic(pos_input=False, nodes=nodes, inits=[init("five", 5), init("three", 3)]), {}


def m_capacity_bounds():
    return basic(values=(1, 2, 2, 4)), {"bounds": {"pos": (0, 7)}}


def m_capacity_clip_proves_safe():
    nodes = [helper.make_node("Clip", ["raw", "", "six"], ["pos"], name="clip"), update(values="new")]
    inputs = [vi("past"), vi("new", [1, 2, 2, 4]), vi("raw", [], I64)]
    return model(nodes, inputs, [vi("present")], inits=[init("six", 6)]), {"bounds": {"raw": (0, 1000)}}


def m_capacity_symbolic_capacity():
    return basic(past_shape=[1, 2, "cap", 4], out_shape=[1, 2, "cap", 4], pos_input=False,
                 inits=[init("pos", 10)]), {"dims": {"cap": 8}}


def m_attention_capacity():
    att = make_cache_attention("q", "past", "past_v", "start", "out", name="attn", num_heads=4, kv_num_heads=2,
                               seq_axis=1)
    inputs = [vi("q", [1, 2, 16]), vi("past", [1, 8, 2, 4]), vi("past_v", [1, 8, 2, 4])]
    return model([att], inputs, [vi("out", [1, 2, 16])], inits=[init("start", [7])], mutable=(), alias={}), {}


def m_values_dim():
    return basic(values=(1, 3, 1, 4)), {}


def m_values_type():
    return basic(values_t=F16), {}


def m_position_type():
    return basic(pos_t=I32), {}


def m_attention_heads():
    att = make_cache_attention("q", "present", "past_v", "pos", "out", name="attn", num_heads=6, kv_num_heads=3,
                               seq_axis=2)
    inputs = [vi("past"), vi("past_v"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64), vi("q", [1, 1, 24])]
    return model([update(), att], inputs, [vi("present"), vi("out", [1, 1, 24])]), {}


def m_cache_rank():
    return basic(past_shape=[8, 4], out_shape=[8, 4], values=(1, 4)), {}


def _branch(name, nodes, out):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, F, None)])


def _if(then_nodes, then_out, else_nodes, else_out, mutable=("past",), alias=None, extra_inputs=()):
    node = helper.make_node("If", ["cond"], ["present"], name="branch",
                            then_branch=_branch("then", then_nodes, then_out),
                            else_branch=_branch("else", else_nodes, else_out))
    inputs = [vi("cond", [], TP.BOOL), vi("past"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64), *extra_inputs]
    return model([node], inputs, [vi("present")], mutable=mutable, alias=alias)


def m_if_same_root():
    return _if([update(out="t_out", name="then_update")], "t_out", [update(out="e_out", name="else_update")],
               "e_out"), {}


def m_if_different_roots():
    return _if([update(out="t_out", name="then_update")], "t_out",
               [update(cache="past_v", out="e_out", name="else_update")], "e_out",
               mutable=("past", "past_v"), extra_inputs=[vi("past_v")]), {}


def m_if_new_value():
    return _if([update(out="t_out", name="then_update")], "t_out",
               [helper.make_node("Identity", ["past"], ["e_out"], name="copy")], "e_out"), {}


def _loop(body_nodes, body_out, trips=3):
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"), *body_nodes], "body",
        [vi("iter", [], I64), vi("cond_in", [], TP.BOOL), helper.make_tensor_value_info("k_in", F, None)],
        [vi("cond_out", [], TP.BOOL), helper.make_tensor_value_info(body_out, F, None)])
    node = helper.make_node("Loop", ["trips", "", "past"], ["present"], name="loop", body=body)
    return model([node], [vi("past"), vi("new", [1, 2, 1, 4])], [vi("present")], inits=[init("trips", trips)])


def m_loop_carries_cache():
    return _loop([update(cache="k_in", pos="iter", out="k_out", name="body_update")], "k_out"), {}


def m_loop_overflows():
    return _loop([update(cache="k_in", pos="iter", out="k_out", name="body_update")], "k_out", trips=9), {}


def m_scan_overflows():
    m, _ = m_scan_carries_cache()
    m.graph.initializer.append(init("positions", [0, 5, 8]))
    del m.graph.input[2]
    return m, {}


def m_loop_body_hazard():
    late = helper.make_node("ReduceSum", ["k_in"], ["seen"], name="late_reader", keepdims=0)
    m = _loop([update(cache="k_in", pos="iter", out="k_out", name="body_update"), late], "k_out")
    m.graph.node[0].attribute[0].g.output.append(helper.make_tensor_value_info("seen", F, None))
    m.graph.output.append(helper.make_tensor_value_info("seen_all", F, None))
    m.graph.node[0].output.append("seen_all")
    return m, {}


def m_loop_loses_alias():
    return _loop([helper.make_node("Concat", ["k_in", "new"], ["k_out"], axis=2, name="grow")], "k_out"), {}


def m_scan_carries_cache():
    body = helper.make_graph(
        [update(cache="state", values="v_t", pos="p_t", out="state_out", name="step")], "body",
        [helper.make_tensor_value_info("state", F, None), helper.make_tensor_value_info("v_t", F, None),
         helper.make_tensor_value_info("p_t", I64, None)],
        [helper.make_tensor_value_info("state_out", F, None)])
    node = helper.make_node("Scan", ["past", "vals", "positions"], ["present"], name="scan", body=body,
                            num_scan_inputs=2)
    inputs = [vi("past"), vi("vals", [3, 1, 2, 1, 4]), vi("positions", [3], I64)]
    return model([node], inputs, [vi("present")]), {}


def _append_function(body_node):
    return helper.make_function("local", "Append", ["cache", "vals", "at"], ["out"], [body_node],
                                [helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)])


def m_function_carries_alias():
    f = _append_function(update(cache="cache", values="vals", pos="at", out="out", name="inner"))
    call = helper.make_node("Append", ["past", "new", "pos"], ["present"], domain="local", name="call")
    return model([call], [vi("past"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64)], [vi("present")],
                 functions=[f]), {}


def m_function_claim_broken():
    f = _append_function(helper.make_node("Mul", ["cache", "cache"], ["out"], name="square"))
    call = helper.make_node("Append", ["past", "new", "pos"], ["present"], domain="local", name="call")
    declare_output_alias(call, 0, 0)
    return model([call], [vi("past"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64)], [vi("present")],
                 functions=[f]), {}


def m_read_after_write():
    late = helper.make_node("ReduceSum", ["past"], ["total"], name="late_reader", keepdims=0)
    return model([update(), late], [vi("past"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64)],
                 [vi("present"), vi("total", [], F)]), {}


def _paged(alias_input=0, table_t=I32, pos=None, page_size=16):
    node = helper.make_node("PagedCacheUpdate", ["pool", "directory", "table", "key", "value", "pos"], ["pool_out"],
                            domain="ortkv", name="paged", layer=0, num_layers=2, kv_num_heads=2, page_size=page_size)
    declare_output_alias(node, 0, alias_input)
    inputs = [vi("pool", [65536], U8), vi("directory", [8, 2], I64), vi("table", [1, 4], table_t),
              vi("key", [1, 1, 8]), vi("value", [1, 1, 8])]
    inits = [init("pos", pos)] if pos is not None else []
    if pos is None:
        inputs.append(vi("pos", [1], I64))
    return model([node], inputs, [vi("pool_out", [65536], U8)], inits=inits, mutable=("pool",),
                 alias={"pool_out": "pool"})


def m_paged_accept():
    return _paged(), {}


def m_paged_table_aliases_pool():
    return _paged(alias_input=1), {}  # the annotation contradicts PagedCacheUpdate's contract (0:0)


def m_paged_capacity():
    return _paged(pos=[64]), {}


def m_paged_table_type():
    return _paged(table_t=F), {}


def _paged_rotary(rows=64, width=48, pos=None):
    """PagedRotaryCacheUpdate (Note [PagedRotaryCacheUpdate]): 2 query heads over 1 KV head of 12 (qkv width 48),
    a [1, 4] table of pages of 16."""
    node = helper.make_node("PagedRotaryCacheUpdate", ["pool", "directory", "table", "qkv", "pos", "cos", "sin"],
                            ["pool_out", "q_rot"], domain="ortkv", name="paged_rot", layer=0, num_layers=2,
                            num_heads=2, kv_num_heads=1, page_size=16)
    declare_output_alias(node, 0, 0)
    inputs = [vi("pool", [65536], U8), vi("directory", [8, 2], I64), vi("table", [1, 4], I32), vi("qkv", [1, 1, width])]
    inits = [init("cos", np.zeros((rows, 6), np.float32), np.float32), init("sin", np.zeros((rows, 6), np.float32),
                                                                             np.float32)]
    if pos is None:
        inputs.append(vi("pos", [1], I64))
    else:
        inits.append(init("pos", pos))
    return model([node], inputs, [vi("pool_out", [65536], U8), vi("q_rot", [1, 1, 24])], inits=inits,
                 mutable=("pool",), alias={"pool_out": "pool"})


def m_paged_rotary_accept():
    return _paged_rotary(), {}


def m_paged_rotary_short_tables():  # a table shorter than the page table's reach: fine unless a position passes it
    return _paged_rotary(rows=40, pos=[40]), {}


def m_paged_rotary_short_tables_accept():
    return _paged_rotary(rows=40, pos=[39]), {}


def m_paged_rotary_width():
    return _paged_rotary(width=50), {}


def m_paged_rotary_capacity():
    return _paged_rotary(pos=[64]), {}


def m_unknown_op():
    node = helper.make_node("Mystery", ["past"], ["odd"], domain="elsewhere", name="mystery")
    return model([node], [vi("past")], [helper.make_tensor_value_info("odd", F, None)], mutable=(), alias={}), {}


def m_symbolic_reshape():
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], end=2, name="shape"),
        helper.make_node("Concat", ["shape", "two_three"], ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="split_heads"),
        helper.make_node("Reshape", ["y", "merge"], ["z"], name="merge_heads"),
    ]
    return model(nodes, [vi("x", ["batch", "seq", 6])], [helper.make_tensor_value_info("z", F, None)],
                 inits=[init("two_three", [2, 3]), init("merge", [0, 0, -1])], mutable=(), alias={}), {}


def m_declared_type_conflict():
    node = helper.make_node("Add", ["a", "a"], ["b"], name="add")
    return model([node], [vi("a", [2])], [vi("b", [2], I64)], mutable=(), alias={}), {}


def m_onnx_rejects():
    node = helper.make_node("MatMul", ["a", "b"], ["c"], name="mm")
    return model([node], [vi("a", [2, 3]), vi("b", [4, 5])], [helper.make_tensor_value_info("c", F, None)],
                 mutable=(), alias={}), {}


# (builder, rule or None for "accepted", words the finding must contain)
CORPUS = {
    "accept": (m_accept, None, ()),
    "alias-of-disagrees": (m_alias_of_disagrees, "alias-disagree", ("'other'", "'past'")),
    "alias-type": (m_alias_type, "alias-type", ("float16", "float32")),
    "alias-rank": (m_alias_rank, "alias-rank", ("rank 3", "rank 4")),
    "alias-dim": (m_alias_dim, "alias-dim", ("dim 2 is 8 vs 16",)),
    "symbolic-meets-concrete": (m_symbolic_meets_concrete, None, ()),
    "symbols-unify": (m_symbols_unify, None, ()),
    "bound-symbol-conflict": (m_bound_symbol_conflict, "alias-dim", ("dim 2 is 8 vs 16",)),
    "alias-cycle": (m_alias_cycle, "alias-cycle", ("loop_a -> loop_b -> present -> loop_a",)),
    "alias-index": (m_alias_index, "alias-index", ("input 5", "3 inputs")),
    "capacity-initializer": (m_capacity_initializer, "capacity", ("position 7 + n 2 = 9 exceeds capacity 8",
                                                                  "'past'", "capacity >= 9")),
    "capacity-exact-fit": (m_capacity_exact_fit, None, ()),
    "capacity-constant-node": (m_capacity_constant_node, "capacity", ("position 8 + n 1 = 9",)),
    "capacity-folded": (m_capacity_folded, "capacity", ("'pos' is 8", "position 8 + n 1 = 9")),
    "capacity-bounds": (m_capacity_bounds, "capacity", ("may reach 7 (bounds [0, 7])", "7 + n 2 = 9")),
    "capacity-clip-proves-safe": (m_capacity_clip_proves_safe, None, ()),
    "capacity-symbolic-capacity": (m_capacity_symbolic_capacity, "capacity", ("position 10 + n 1 = 11",
                                                                              "capacity 8")),
    "attention-capacity": (m_attention_capacity, "capacity", ("CacheAttention", "start 'start' is 7",
                                                              "7 + n 2 = 9 exceeds capacity 8")),
    "values-dim": (m_values_dim, "op-input", ("dim 1 of 'new'", "is 3", "is 2")),
    "values-type": (m_values_type, "op-input", ("'new' is float16", "float32")),
    "position-type": (m_position_type, "op-input", ("'pos' is int32", "int64")),
    "attention-heads": (m_attention_heads, "op-input", ("kv_num_heads=3", "dim 1 of 'present'")),
    "cache-rank": (m_cache_rank, "op-input", ("rank 2", "rank >= 3")),
    "if-same-root": (m_if_same_root, None, ()),
    "if-different-roots": (m_if_different_roots, "if-branch", ("then_branch returns 't_out', the storage of 'past'",
                                                              "else_branch returns 'e_out', the storage of 'past_v'")),
    "if-new-value": (m_if_new_value, "if-branch", ("else_branch returns 'e_out', a new value",)),
    "loop-carries-cache": (m_loop_carries_cache, None, ()),
    "loop-overflows": (m_loop_overflows, "capacity", ("loop/body/body_update", "'iter' may reach 8 (bounds [0, 8])",
                                                     "8 + n 1 = 9 exceeds capacity 8 of 'k_in'")),
    "scan-overflows": (m_scan_overflows, "capacity", ("scan/body/step", "'p_t' may reach 8")),
    "loop-body-hazard": (m_loop_body_hazard, "alias-hazard", ("loop/body/late_reader", "reads 'k_in'",
                                                             "node 'loop/body/body_update' overwrites")),
    "loop-loses-alias": (m_loop_loses_alias, "loop-carry", ("carries cache 'past' as 'k_in'", "'k_out'",
                                                            "a new value")),
    "scan-carries-cache": (m_scan_carries_cache, None, ()),
    "function-carries-alias": (m_function_carries_alias, None, ()),
    "function-claim-broken": (m_function_claim_broken, "function-alias", ("function 'Append'", "a new value",
                                                                          "parameter 'cache'")),
    "read-after-write": (m_read_after_write, "alias-hazard", ("'past'", "node 'update' overwrites")),
    "paged-accept": (m_paged_accept, None, ()),
    "paged-table-aliases-pool": (m_paged_table_aliases_pool, "alias-contract", ("output_alias '0:1:MUST_ALIAS'",
                                                                                "storage of input 0 (pool)")),
    "paged-capacity": (m_paged_capacity, "capacity", ("position 64 + n 1 = 65", "4 pages x 16 tokens")),
    "paged-table-type": (m_paged_table_type, "op-input", ("'table' is float32 [1, 4]; it must be [batch, max_pages] int32",)),
    "paged-rotary-accept": (m_paged_rotary_accept, None, ()),
    "paged-rotary-short-tables": (m_paged_rotary_short_tables, "capacity", ("position 40 + n 1 = 41",
                                                                            "rotary table 'cos' (40 rows")),
    "paged-rotary-short-tables-accept": (m_paged_rotary_short_tables_accept, None, ()),
    "paged-rotary-width": (m_paged_rotary_width, "op-input", ("'qkv' width 50 must be (num_heads + 2 kv_num_heads) "
                                                              "* head_size = 4 * head_size",)),
    "paged-rotary-capacity": (m_paged_rotary_capacity, "capacity", ("position 64 + n 1 = 65", "4 pages x 16 tokens")),
    "symbolic-reshape": (m_symbolic_reshape, None, ()),
    "declared-type-conflict": (m_declared_type_conflict, "shape-type", ("int64", "float32")),
    "onnx-rejects": (m_onnx_rejects, "shape", ("MatMul",)),
}


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 30
    assert sum(rule is None for _, rule, _ in CORPUS.values()) >= 8  # accepted models too


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corpus(case):
    build, rule, words = CORPUS[case]
    m, kw = build()
    report = check(m, **kw, plan=False)
    errors = report.errors
    if rule is None:
        assert errors == [], errors
        assert report.shapes.untyped() == []
        return
    assert errors, f"{case}: expected a {rule} finding"
    assert {e.rule for e in errors} == {rule}, errors
    text = " ".join(f"{e.subject} {e.message}" for e in errors)
    for w in words:
        assert w in text, (w, text)
    err = report.error()
    assert isinstance(err, ortkv.GraphCheckError) and err.findings == errors
    with pytest.raises(ortkv.GraphCheckError, match=rule):
        report.raise_for_errors()


# --- what the accepted models must have learned ----------------------------------------------------

def shapes(build):
    m, kw = build()
    return infer_shapes(m, **kw)


def test_alias_class_and_type_through_either_name():
    ctx = shapes(m_symbolic_meets_concrete)
    assert ctx.root("present") == "past"
    assert ctx.classes() == {"past": ["past", "present"]}
    assert ctx.type_of("past") == ValueType(F, (1, 2, 16, 4))  # learned from present's declaration


def test_symbols_unify_and_bind():
    ctx = shapes(m_symbols_unify)
    assert ctx.table.resolve("b") == ctx.table.resolve("batch")
    assert ctx.type_of("past").shape[2] == 32 and ctx.type_of("present").shape[2] == 32


def test_if_loop_scan_function_keep_the_root():
    for build, out in ((m_if_same_root, "present"), (m_loop_carries_cache, "present"),
                       (m_scan_carries_cache, "present"), (m_function_carries_alias, "present")):
        ctx = shapes(build)
        assert ctx.root(out) == "past", build.__name__
        assert ctx.type_of(out) == ValueType(F, tuple(KV)), build.__name__
    ctx = shapes(m_loop_carries_cache)
    assert ctx.root("k_in") == "past" and ctx.root("k_out") == "past"


def test_paged_classes():
    ctx = shapes(m_paged_accept)
    assert ctx.root("pool_out") == "pool" and ctx.root("table") == "table"


def test_symbolic_reshape_types():
    ctx = shapes(m_symbolic_reshape)
    assert ctx.type_of("y") == ValueType(F, ("batch", "seq", 2, 3))
    assert ctx.type_of("z") == ValueType(F, ("batch", "seq", 6))


def test_unknown_op_is_a_warning_and_untyped():
    m, _ = m_unknown_op()
    ctx = ShapesContext(m).infer()
    assert ctx.errors == []
    rules = [f.rule for f in ctx.findings]
    assert rules == ["no-rule", "untyped"], ctx.findings
    assert "elsewhere::Mystery" in ctx.findings[0].message and ctx.untyped() == ["odd"]


def test_findings_leave_the_model_untouched():
    m, kw = m_alias_dim()
    before = m.SerializeToString()
    check(m, **kw)
    assert m.SerializeToString() == before


# --- the memory planner: hand-computable models ----------------------------------------------------

def test_plan_in_place_update_adds_no_cache_bytes():
    # past 256 B (READ_WRITE), new 32 B, pos 8 B, two 4 B; present = past (0 B); y = present * two: 256 B
    nodes = [update(), helper.make_node("Mul", ["present", "two"], ["y"], name="scale")]
    m = model(nodes, [vi("past"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64)], [vi("present"), vi("y")],
              inits=[numpy_helper.from_array(np.array(2, np.float32), "two")])
    plan = plan_memory(infer_shapes(m))
    assert [b for _, b in plan.steps] == [256 + 32 + 8 + 4, 256 + 32 + 8 + 4 + 256]
    assert plan.peak_bytes == 556 and plan.peak_node == "scale"
    assert plan.in_place == [("update", "present", "past")]
    assert plan.bytes_by_kind(at_peak=True) == {"cache": 256, "input": 40, "initializer": 4, "output": 256,
                                                "activation": 0}


def test_plan_concat_copy_holds_a_second_cache():
    # past 224 B ([1,2,7,4]), new 32 B, two 4 B; present = Concat: 256 B; y: 256 B
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2, name="append"),
             helper.make_node("Mul", ["present", "two"], ["y"], name="scale")]
    m = model(nodes, [vi("past", [1, 2, 7, 4]), vi("new", [1, 2, 1, 4])], [vi("present"), vi("y")],
              inits=[numpy_helper.from_array(np.array(2, np.float32), "two")], mutable=(), alias={})
    plan = plan_memory(infer_shapes(m))
    assert [b for _, b in plan.steps] == [224 + 32 + 4 + 256, 224 + 32 + 4 + 256 + 256]
    assert plan.peak_bytes == 772 and plan.in_place == []


def test_plan_releases_dead_activations_and_counts_workspace():
    # x 16 B; a, b, c 16 B each; a dies after b is made. CacheAttention adds its scratch (see op_rules).
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["b"], name="r2"),
             helper.make_node("Relu", ["b"], ["c"], name="r3")]
    m = model(nodes, [vi("x", [4])], [vi("c", [4])], mutable=(), alias={})
    plan = plan_memory(infer_shapes(m))
    assert [b for _, b in plan.steps] == [32, 48, 48]
    assert plan.peak_step == 1 and sorted(b.root for b in plan.live_at_peak) == ["a", "b", "x"]

    att = make_cache_attention("q", "present", "past_v", "pos", "out", name="attn", num_heads=4, kv_num_heads=2,
                               seq_axis=2)
    inputs = [vi("past"), vi("past_v"), vi("new", [1, 2, 1, 4]), vi("pos", [], I64), vi("q", [1, 1, 16])]
    m = model([update(), att], inputs, [vi("present"), vi("out", [1, 1, 16])], mutable=("past", "past_v"))
    plan = plan_memory(infer_shapes(m), threads=4)
    # out [1,1,16] f32 + per thread G * (64 + 2D + 2) floats x 4 threads + 48 * G * (D + 2) floats of partials
    workspace = 2 * (64 + 2 * 4 + 2) * 4 * 4 + 48 * 2 * (4 + 2) * 4
    assert plan.steps[1][1] - plan.steps[0][1] == 64 + workspace
    assert plan.workspace_at_peak == workspace


def test_plan_needs_concrete_dims():
    m, _ = m_symbolic_meets_concrete()
    m.graph.input[1].type.tensor_type.shape.dim[2].dim_param = "tokens"
    with pytest.raises(ortkv.GraphCheckError, match=r"'tokens'.*--dims"):
        plan_memory(infer_shapes(m))
    plan = plan_memory(infer_shapes(m, dims={"batch": 1, "tokens": 1}))
    assert plan.peak_bytes == 16 * 2 * 4 * 4 + 2 * 4 * 4 + 8


# --- ortkv check ---------------------------------------------------------------------------------

def test_cli_check(tmp_path, capsys):
    import onnx

    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    onnx.save(m_accept()[0], good)
    onnx.save(m_capacity_initializer()[0], bad)
    assert cli_main(["check", str(good)]) == 0
    out = capsys.readouterr().out
    assert "no findings" in out and "memory plan: peak 296 B" in out and "in-place updates: 1" in out
    assert cli_main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "error: [capacity] update:" in out and "exceeds capacity 8" in out
    assert cli_main(["check", str(good), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"] == [] and data["plan"]["peak_bytes"] == 296
    assert data["alias_classes"] == {"past": ["past", "present"]} and data["typed"] == data["values"] == 1
    m = m_symbolic_meets_concrete()[0]
    m.graph.input[1].type.tensor_type.shape.dim[2].dim_param = "tokens"
    onnx.save(m, tmp_path / "sym.onnx")
    assert cli_main(["check", str(tmp_path / "sym.onnx")]) == 0
    assert "memory plan: not computed" in capsys.readouterr().out
    assert cli_main(["check", str(tmp_path / "sym.onnx"), "--dims", "batch=1", "tokens=1"]) == 0
    assert "memory plan: peak" in capsys.readouterr().out
    assert cli_main(["check", str(tmp_path / "sym.onnx"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"] is None and "'tokens'" in data["plan_error"] and data["dims"]["batch"] == 1
    assert cli_main(["check", "--dims", "batch=1", "tokens=1", str(tmp_path / "sym.onnx")]) == 0  # path last
    assert "memory plan: peak" in capsys.readouterr().out
    assert cli_main(["check", str(tmp_path / "missing.onnx")]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert cli_main(["check", str(good), "--dims", "batch=x"]) == 2
    assert "--dims batch=x: the value must be an integer" in capsys.readouterr().err
    assert cli_main(["check", str(good), "--bounds", "pos=0:z"]) == 2
    assert "expected LO:HI" in capsys.readouterr().err
    assert cli_main(["check", str(good), "--bounds", "pos=0:7"]) == 0  # n 1 at 7 fits capacity 8
    capsys.readouterr()
    assert cli_main(["check", str(good), "--bounds", "pos=0:8"]) == 1
    assert "position 8 + n 1 = 9 exceeds capacity 8" in capsys.readouterr().out


# --- DimTable against a plain partition of symbols ---------------------------------------------------
_dim = st.one_of(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(1, 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_dim, _dim), max_size=12))
def test_dim_table_is_a_partition_with_bindings(meets):
    table, groups = DimTable(), {s: ({s}, None) for s in "abcde"}  # symbol -> (its group, its value)

    def ref_value(d):
        return d if isinstance(d, int) else groups[d][1]

    for x, y in meets:
        vx, vy = ref_value(x), ref_value(y)
        conflict = vx is not None and vy is not None and vx != vy
        if isinstance(x, str) and isinstance(y, str) and groups[x][0] is groups[y][0]:
            conflict = False
        if conflict:
            with pytest.raises(ShapeConflict):
                table.meet(x, y)
            continue
        table.meet(x, y)
        value = vx if vx is not None else vy
        members = set().union(*(groups[d][0] for d in (x, y) if isinstance(d, str)))
        for s in members:
            groups[s] = (members, value)
    for s, (members, value) in groups.items():
        got = table.resolve(s)
        if value is not None:
            assert got == value
        else:
            assert isinstance(got, str) and all(table.resolve(m) == got for m in members)
            assert all(table.resolve(o) != got for o in "abcde" if o not in members)


def test_agrees_with_onnx_on_its_own_test_models():
    """On the models onnx ships (no ortkv ops), ShapesContext knows at least what onnx's own inference
    knows and never contradicts a concrete dim."""
    import glob
    import os

    import onnx
    from onnx import shape_inference

    paths = sorted(glob.glob(os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/*/*/model.onnx")))
    if not paths:
        pytest.skip("this onnx wheel ships no backend test models")
    compared = 0
    for p in paths:
        m = onnx.load(p)
        ref = shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
        ctx = ShapesContext(m).infer()
        assert ctx.errors == [], (p, ctx.errors)
        known = {vi.name: ValueType.from_proto(vi.type) for vi in (*ref.graph.value_info, *ref.graph.output)}
        for _, node in ctx.order:
            for name in node.output:
                r, t = known.get(name), ctx.type_of(name)
                if r is None or not r.known or r.opaque is not None:
                    continue
                compared += 1
                assert t.known and t.elem == r.elem and t.rank == r.rank, (p, name, r, t)
                for a, b in zip(r.shape, t.shape):
                    assert not isinstance(a, int) or a == b, (p, name, r, t)
    assert compared > 100


def test_share_buffer_aliases_plan_genai_as_it_runs():
    """GroupQueryAttention under past_present_share_buffer: present K/V are the past buffers (bound so by
    onnxruntime-genai); assumed as aliases, the plan counts each cache once; unequal past/present dims are
    refused (share-buffer needs past = present = max_length)."""
    from ortkv.graph import share_buffer_aliases

    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens", "total"],
                           ["out", "present_k", "present_v"], domain="com.microsoft", name="gqa", num_heads=4,
                           kv_num_heads=2)
    inputs = [vi("q", [1, 1, 16]), vi("k", [1, 1, 8]), vi("v", [1, 1, 8]), vi("past_k", [1, 2, "past", 4]),
              vi("past_v", [1, 2, "past", 4]), vi("seqlens", [1], I32), vi("total", [], I32)]
    m = model([gqa], inputs, [vi("out", [1, 1, 16]), vi("present_k", [1, 2, "total_seq", 4]),
                              vi("present_v", [1, 2, "total_seq", 4])], mutable=(), alias={})
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assumed = share_buffer_aliases(m)
    assert assumed == {"present_k": "past_k", "present_v": "past_v"}
    dims = {"past": 8, "total_seq": 8}
    copy_plan = check(m, dims=dims).plan
    shared = check(m, dims=dims, assume_aliases=assumed)
    assert shared.ok and shared.shapes.root("present_k") == "past_k"
    cache = 2 * 8 * 4 * 4  # one [1, 2, 8, 4] float32
    assert copy_plan.peak_bytes - shared.plan.peak_bytes == 2 * cache
    bad = check(m, dims={"past": 7, "total_seq": 8}, assume_aliases=assumed)
    assert {f.rule for f in bad.errors} == {"alias-dim"} and "the assumed alias 'present_k' -> 'past_k'" in str(
        bad.errors[0])

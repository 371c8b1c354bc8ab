"""Alias annotations (round trip through serialization) and every checker rule, each with a model
that breaks it and the message it must produce."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import cache_update_model
from ortkv.graph import (
    Access,
    OutputAlias,
    alias_of,
    annotate_in_place,
    check_aliases,
    check_model,
    declare_output_alias,
    input_access,
    make_cache_update,
    mark_mutable,
    output_aliases,
    read_annotations,
    set_alias_of,
    set_input_access,
)

F = TP.FLOAT
KV = [1, 2, 8, 4]


def _model(nodes, inputs, outputs, inits=(), ir=10):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=ir)


def _vi(name, shape=KV, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _base_inputs():
    return [_vi("cache"), _vi("values", [1, 2, 1, 4]), _vi("position", [], TP.INT64)]


def _errors(model):
    return [f for f in check_aliases(model) if f.severity == "error"]


def _one_error(model, rule, *fragments):
    errs = _errors(model)
    assert [e.rule for e in errs] == [rule], errs
    for fragment in fragments:
        assert fragment in errs[0].message or fragment == errs[0].subject, (fragment, errs[0])
    with pytest.raises(ortkv.GraphCheckError) as info:
        check_model(model)
    assert rule in str(info.value)
    return errs[0]


# --- the typed API and serialization ------------------------------------------------------------
def test_round_trip_through_bytes():
    model = cache_update_model()
    again = onnx.load_from_string(model.SerializeToString())
    assert input_access(again, "cache") is Access.READ_WRITE
    assert input_access(again, "values") is None
    assert alias_of(again, "updated_cache") == "cache"
    assert output_aliases(again.graph.node[0]) == [OutputAlias(0, 0)]
    ann = read_annotations(again)
    assert ann.mutable_inputs() == ["cache"]
    assert ann.aliased_outputs(again.graph) == {"updated_cache": "cache"}
    raw = {p.key: p.value for p in again.graph.node[0].metadata_props}
    assert raw == {"output_alias": "0:0:MUST_ALIAS"}
    assert {p.key: p.value for p in again.graph.input[0].metadata_props} == {"access": "READ_WRITE"}
    assert {p.key: p.value for p in again.graph.output[0].metadata_props} == {"alias_of": "cache"}
    onnx.checker.check_model(again)
    assert check_aliases(again) == []


def test_several_entries_on_one_node():
    node = helper.make_node("Split2", ["a", "b"], ["x", "y"], domain="ortkv")
    declare_output_alias(node, 0, 1)
    declare_output_alias(node, 1, 0)
    declare_output_alias(node, 0, 0)  # replaces the first entry for output 0
    assert {p.key: p.value for p in node.metadata_props}["output_alias"] == "1:0:MUST_ALIAS;0:0:MUST_ALIAS"
    assert output_aliases(node) == [OutputAlias(1, 0), OutputAlias(0, 0)]


def test_annotate_in_place_writes_all_three():
    node = helper.make_node("CacheUpdate", ["cache", "values", "position"], ["out"], domain="ortkv", name="cu")
    model = _model([node], _base_inputs(), [_vi("out")])
    annotate_in_place(model, model.graph.node[0])
    assert (input_access(model, "cache"), alias_of(model, "out")) == (Access.READ_WRITE, "cache")
    assert check_aliases(model) == []


def test_api_refusals():
    model = cache_update_model()
    with pytest.raises(ortkv.GraphCheckError, match=r"'nope' is not a graph input"):
        mark_mutable(model, "nope")
    with pytest.raises(ortkv.GraphCheckError, match=r"input_index 5 is out of range"):
        declare_output_alias(model.graph.node[0], 0, 5)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w"))
    with pytest.raises(ortkv.GraphCheckError, match=r"'w' is an initializer"):
        set_input_access(model, "w", "READ_WRITE")


def test_ir_version_raised_to_10_when_annotating():
    model = cache_update_model(annotate=False)
    model.ir_version = 8
    mark_mutable(model, "cache")
    assert model.ir_version == 10


# --- checker rules: one negative model each ------------------------------------------------------
def test_rule_disagree_names_differ():
    model = cache_update_model()
    model.graph.input.append(_vi("other"))
    mark_mutable(model, "other")
    set_alias_of(model, "updated_cache", "other")
    _one_error(model, "alias-disagree", "output_alias says 'updated_cache' is the storage of 'cache'",
               "alias_of 'other'")


def test_rule_disagree_alias_of_without_node_alias():
    node = helper.make_node("Identity", ["cache"], ["out"], name="copy")
    model = _model([node], [_vi("cache")], [_vi("out")])
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    _one_error(model, "alias-disagree", "producer (copy) declares no output_alias")


def test_rule_disagree_node_alias_without_alias_of():
    model = cache_update_model()
    del model.graph.output[0].metadata_props[:]
    _one_error(model, "alias-disagree", "carries no alias_of='cache'")


def test_rule_target_not_a_graph_input():
    model = cache_update_model()
    set_alias_of(model, "updated_cache", "values_typo")
    errs = _errors(model)
    assert {e.rule for e in errs} == {"alias-target", "alias-disagree"}
    assert any("'values_typo', which is not a graph input" in e.message for e in errs)


def test_rule_target_not_read_write():
    model = cache_update_model()
    set_input_access(model, "cache", "READ_ONLY")
    errs = _errors(model)
    assert {e.rule for e in errs} == {"alias-target", "alias-readonly"}
    assert any("graph input 'cache', which is READ_ONLY" in e.message for e in errs)


def test_rule_node_writes_unannotated_input():
    model = cache_update_model(consumer=True, annotate=False)
    _one_error(model, "alias-readonly", "into graph input 'cache', which is not annotated")


def test_rule_initializer_aliased():
    node = make_cache_update("w", "values", "position", "w_out", name="cu_w")
    reader = helper.make_node("ReduceSum", ["w_out"], ["s"], keepdims=0)
    model = _model([node, reader], _base_inputs()[1:], [_vi("s", [])],
                   inits=[numpy_helper.from_array(np.zeros(KV, np.float32), "w")])
    _one_error(model, "alias-initializer", "into 'w', an initializer")


def test_rule_alias_of_names_initializer():
    model = cache_update_model()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(KV, np.float32), "w"))
    del model.graph.output[0].metadata_props[:]
    set_alias_of(model, "updated_cache", "w")
    errs = _errors(model)
    assert "alias-initializer" in {e.rule for e in errs}
    assert any("alias_of names 'w', an initializer" in e.message for e in errs)


def test_rule_read_after_write_hazard():
    # Shape(cache) reads the pre-update name; nothing orders it before the in-place write.
    model = cache_update_model()
    model.graph.node.append(helper.make_node("Shape", ["cache"], ["cache_shape"], name="shape_reader"))
    model.graph.output.append(helper.make_tensor_value_info("cache_shape", TP.INT64, [4]))
    err = _one_error(model, "alias-hazard", "reads 'cache', which node 'cache_update' overwrites in place")
    assert err.subject == "shape_reader"


def test_reader_ordered_before_write_is_fine():
    # The reader feeds the writer (values derived from the old cache): it is an ancestor, so it runs first.
    reader = helper.make_node("Slice", ["cache", "s0", "s1", "ax"], ["old_slice"], name="reader")
    writer = make_cache_update("cache", "old_slice", "position", "out", name="writer")
    inits = [numpy_helper.from_array(np.array([0], np.int64), "s0"),
             numpy_helper.from_array(np.array([1], np.int64), "s1"),
             numpy_helper.from_array(np.array([2], np.int64), "ax")]
    model = _model([reader, writer], [_vi("cache"), _vi("position", [], TP.INT64)], [_vi("out")], inits)
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    assert _errors(model) == []


def test_rule_two_unordered_writers():
    a = make_cache_update("cache", "values", "position", "out_a", name="a")
    b = make_cache_update("cache", "values", "position", "out_b", name="b")
    model = _model([a, b], _base_inputs(), [_vi("out_a"), _vi("out_b")])
    mark_mutable(model, "cache")
    set_alias_of(model, "out_a", "cache")
    set_alias_of(model, "out_b", "cache")
    assert {e.rule for e in _errors(model)} == {"alias-hazard"}


def test_rule_pre_update_name_as_graph_output():
    model = cache_update_model()
    model.graph.output.append(_vi("cache"))
    _one_error(model, "alias-hazard", "graph output 'cache' is the pre-update name")


def test_chain_of_in_place_writes_resolves_to_root():
    a = make_cache_update("cache", "values", "position", "mid", name="a")
    b = make_cache_update("mid", "values", "position", "out", name="b")
    model = _model([a, b], _base_inputs(), [_vi("out")])
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    assert _errors(model) == []
    set_alias_of(model, "out", "mid")  # names the intermediate instead of the root input
    assert {e.rule for e in _errors(model)} == {"alias-target", "alias-disagree"}


def test_rule_cycle():
    model = cache_update_model()
    vi_a, vi_b = model.graph.value_info.add(), model.graph.value_info.add()
    vi_a.name, vi_b.name = "a", "b"
    set_alias_of(model, "a", "b")
    set_alias_of(model, "b", "a")
    errs = _errors(model)
    assert [e.rule for e in errs] == ["alias-cycle"]
    assert "form a cycle: a -> b -> a" in errs[0].message


def test_rule_bad_index_and_malformed_entry():
    model = cache_update_model()
    model.graph.node[0].metadata_props[0].value = "3:0:MUST_ALIAS"
    assert "alias-index" in {e.rule for e in _errors(model)}
    model.graph.node[0].metadata_props[0].value = "0:0:MAY_ALIAS"
    errs = _errors(model)
    assert errs[0].rule == "malformed" and "expected '<output_index>:<input_index>:MUST_ALIAS'" in errs[0].message


def test_rule_ir_version():
    model = cache_update_model()
    model.ir_version = 9
    _one_error(model, "ir-version", "alias annotations need IR >= 10")


def _paged_attention_model(static_tables, table_from=None):
    """One PagedCacheAttention node; table_from: the op type of a node that computes its page table (from the graph
    input 'table_in'), else the table is a graph input."""
    nodes, table = [], "page_table"
    ins = [_vi("query", [1, 1, 64]), _vi("pool", ["P"], TP.UINT8), _vi("directory", ["N", 2], TP.INT64),
           _vi("start", [1], TP.INT64)]
    if table_from == "Add":
        nodes.append(helper.make_node("Add", ["table_in", "table_in"], ["page_table"], name="make_table"))
        ins.append(_vi("table_in", [1, 4], TP.INT32))
    else:
        ins.append(_vi("page_table", [1, 4], TP.INT32))
    if table_from == "in_place":  # a node that writes the graph input in place (declared and annotated)
        node = helper.make_node("Scratch", ["page_table"], ["scratched"], domain="ortkv", name="scratch")
        declare_output_alias(node, 0, 0)
        nodes.append(node)
    extra = {} if static_tables is None else {"static_tables": static_tables}
    nodes.append(helper.make_node("PagedCacheAttention", ["query", "pool", "directory", table, "start"], ["out"],
                                  domain="ortkv", name="attn", num_heads=1, kv_num_heads=1, layer=0, num_layers=1,
                                  page_size=16, **extra))
    model = _model(nodes, ins, [_vi("out", [1, 1, 64])])
    if table_from == "in_place":
        mark_mutable(model, "page_table")
    return model


def test_rule_static_tables():
    """A PagedCacheAttention node's static_tables = 1 (Note [Paged CUDA static tables]) promises that no node writes
    its tables: refused when a node computes the page table or writes it in place, with the node, the table and
    the remedy; accepted on graph inputs, and without the attribute any table goes."""
    assert _errors(_paged_attention_model(1)) == []
    assert _errors(_paged_attention_model(None, table_from="Add")) == []
    assert _errors(_paged_attention_model(0, table_from="Add")) == []
    _one_error(_paged_attention_model(1, table_from="Add"), "static-tables", "attn",
               "static_tables = 1 promises that no node writes its page_table 'page_table', but node 'make_table' "
               "computes it. Remedy: feed 'page_table' as a graph input or initializer, or drop static_tables")
    errs = [e for e in _errors(_paged_attention_model(1, table_from="in_place")) if e.rule == "static-tables"]
    assert len(errs) == 1 and errs[0].subject == "attn", errs
    assert "but a node writes graph input 'page_table' in place. Remedy: drop static_tables" in errs[0].message


def test_rule_static_tables_in_a_body():
    """static_tables inside an If branch: the table may be an outer graph input; a table computed in the body, or
    one the body declares as its own input (not the model's), is refused, naming the node and where it lies."""
    outer = _paged_attention_model(None)
    attn = outer.graph.node[0]

    def model_with_branch(table_node=None):
        node = helper.make_node("PagedCacheAttention", list(attn.input), ["out_b"], domain="ortkv", name="attn_b",
                                num_heads=1, kv_num_heads=1, layer=0, num_layers=1, page_size=16, static_tables=1)
        nodes = ([table_node] if table_node is not None else []) + [node]
        body = helper.make_graph(nodes, "branch", [], [_vi("out_b", [1, 1, 64])])
        if_node = helper.make_node("If", ["cond"], ["out"], name="choose", then_branch=body, else_branch=body)
        ins = list(outer.graph.input) + [_vi("cond", [], TP.BOOL)]
        return _model([if_node], ins, [_vi("out", [1, 1, 64])])

    assert [e for e in _errors(model_with_branch()) if e.rule == "static-tables"] == []
    make = helper.make_node("Add", ["page_table", "page_table"], ["page_table2"], name="inner_add")
    bad = model_with_branch(make)
    bad.graph.node[0].attribute[0].g.node[1].input[3] = "page_table2"
    bad.graph.node[0].attribute[1].g.node[1].input[3] = "page_table2"
    errs = [e for e in _errors(bad) if e.rule == "static-tables"]
    assert len(errs) == 2 and all(e.subject.startswith("attn_b (in choose.") for e in errs), errs
    assert "node 'inner_add (in choose.then_branch)' computes it" in errs[0].message

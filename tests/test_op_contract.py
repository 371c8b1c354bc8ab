"""The op contract (Note [Op contract] in ortkv/graph/op_contract.py): the aliases of ortkv ops come from
the op, annotated or not; and a parity test: for a grid of attributes, shapes and types, the Python
rules (ortkv.graph.check) and the real kernels on ONNX Runtime CPU agree on accepted / refused."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from conftest import digest, ort_session
from ortkv.graph import check, check_aliases, declare_output_alias, mark_mutable, set_alias_of
from ortkv.graph.op_contract import CONTRACTS, KERNEL_LENIENCY
from ortkv.graph.op_rules import OP_RULES

F, F16, BF16, I32, I64 = TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, TP.INT32, TP.INT64
KV = [1, 2, 8, 4]


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def _raw_update(cache="cache", out="out", name="cu"):
    """A CacheUpdate node exactly as a model from elsewhere would carry it: no annotation at all."""
    return helper.make_node("CacheUpdate", [cache, "values", "position"], [out], domain="ortkv", name=name)


def _errors(model):
    return [f for f in check_aliases(model) if f.severity == "error"]


def test_every_ortkv_rule_has_a_contract():
    assert {k for k in OP_RULES if k[0] == "ortkv"} == set(CONTRACTS)
    assert CONTRACTS[("ortkv", "CacheUpdate")].must_alias == ((0, 0),)
    assert CONTRACTS[("ortkv", "CacheAttention")].must_alias == ()


# --- aliases from the op, annotated or not (defect 6) ------------------------------------------------
def _initializer_update_model():
    reader = helper.make_node("ReduceSum", ["out"], ["s"], keepdims=0, name="reader")
    return _model([_raw_update("w"), reader], [_vi("values", [1, 2, 1, 4]), _vi("position", [], I64)],
                  [_vi("s", [])], inits=[numpy_helper.from_array(np.ones(KV, np.float32), "w")])


def test_unannotated_update_of_an_initializer_is_an_error():
    model = _initializer_update_model()
    errs = _errors(model)
    assert [e.rule for e in errs] == ["alias-initializer"], errs
    assert "into 'w', an initializer" in errs[0].message and "op contract" in errs[0].message
    with pytest.raises(ortkv.GraphCheckError, match="alias-initializer"):
        ortkv.graph.check_model(model)
    with pytest.raises(ortkv.GraphCheckError, match="alias-initializer"):
        ortkv.MutableCacheSession(model)
    assert not check(model, plan=False).ok


def test_plain_ort_really_writes_the_unannotated_initializer():
    # Why the rule matters: ORT hands CacheUpdate the initializer's buffer (GetAliasMap) and the write
    # persists from one run to the next. (If this ever stops being true the rule is still right.)
    sess = ort_session(_initializer_update_model())
    feeds = {"values": np.full([1, 2, 1, 4], 5, np.float32), "position": np.array(0, np.int64)}
    first = sess.run(None, feeds)[0]
    feeds["position"] = np.array(1, np.int64)
    second = sess.run(None, feeds)[0]
    assert second == pytest.approx(first + 2 * 4 * (5 - 1))


def test_unannotated_update_of_an_unmarked_input_is_an_error():
    reader = helper.make_node("ReduceSum", ["out"], ["s"], keepdims=0, name="reader")
    model = _model([_raw_update(), reader], [_vi("cache", KV), _vi("values", [1, 2, 1, 4]), _vi("position", [], I64)],
                   [_vi("s", [])])
    errs = _errors(model)
    assert [e.rule for e in errs] == ["alias-readonly"], errs
    assert "graph input 'cache', which is not annotated" in errs[0].message
    assert "mark it access=READ_WRITE" in errs[0].message
    with pytest.raises(ortkv.GraphCheckError, match="alias-readonly"):
        ortkv.MutableCacheSession(model)
    # the same with the updated cache as a graph output: one finding, the one to fix first
    model = _model([_raw_update()], [_vi("cache", KV), _vi("values", [1, 2, 1, 4]), _vi("position", [], I64)],
                   [_vi("out", KV)])
    assert [e.rule for e in _errors(model)] == ["alias-readonly"]


def test_unannotated_update_of_a_read_write_input_with_alias_of_is_fine():
    model = _model([_raw_update()], [_vi("cache", KV), _vi("values", [1, 2, 1, 4]), _vi("position", [], I64)],
                   [_vi("out", KV)])
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    assert check_aliases(model) == []
    assert check(model, plan=False).errors == []
    sess = ortkv.MutableCacheSession(model)
    assert sess.aliased_outputs("cache") == ["out"]


def test_unannotated_update_output_without_alias_of_names_the_fix():
    model = _model([_raw_update()], [_vi("cache", KV), _vi("values", [1, 2, 1, 4]), _vi("position", [], I64)],
                   [_vi("out", KV)])
    mark_mutable(model, "cache")
    errs = _errors(model)
    assert [e.rule for e in errs] == ["alias-disagree"]
    assert "its op contract (CacheUpdate)" in errs[0].message and "set_alias_of(model, 'out', 'cache')" in \
        errs[0].message


def test_annotation_contradicting_the_contract_is_refused():
    att = helper.make_node("CacheAttention", ["q", "k", "v", "start"], ["o"], domain="ortkv", name="att",
                           num_heads=2, kv_num_heads=2)
    declare_output_alias(att, 0, 1)  # would make MutableCacheSession bind the output onto the key cache
    model = _model([att], [_vi("q", [1, 1, 8]), _vi("k", [1, 8, 2, 4]), _vi("v", [1, 8, 2, 4]),
                           _vi("start", [], I64)], [_vi("o", [1, 1, 8])])
    mark_mutable(model, "k")
    set_alias_of(model, "o", "k")
    errs = _errors(model)
    assert "alias-contract" in {e.rule for e in errs}
    text = " ".join(e.message for e in errs)
    assert "CacheAttention writes a new buffer for that output" in text
    assert "alias-contract" in {e.rule for e in check(model, plan=False).errors}
    update = _raw_update()
    declare_output_alias(update, 0, 1)  # CacheUpdate's output is the cache's storage, not the values'
    model = _model([update], [_vi("cache", KV), _vi("values", KV), _vi("position", [], I64)], [_vi("out", KV)])
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    errs = _errors(model)
    assert [e.rule for e in errs] == ["alias-contract"]
    assert "makes output 0 the storage of input 0 (cache)" in errs[0].message


# --- parity: the rules and the kernels agree ---------------------------------------------------------
NP = {F: np.float32, F16: np.float16, I32: np.int32, I64: np.int64}


def _ortvalue(shape, t, fill=None):
    if t == BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, np.uint16), onnx_element_type=BF16)
    arr = np.zeros(shape, NP[t]) if fill is None else np.asarray(fill, NP[t]).reshape(shape)
    if fill is None and NP[t] in (np.float32, np.float16):
        arr[...] = np.random.default_rng(0).standard_normal(shape)
    return ort.OrtValue.ortvalue_from_numpy(arr)


def _kernel_verdict(model, feeds, bind_same=None):
    """True when ORT CPU creates the session and runs the node; False when it refuses (at session
    creation or in Compute). ``bind_same``: (input, output) bound to ONE buffer (a cache update)."""
    try:
        sess = ort_session(model)
    except Exception:
        return False
    io = sess.io_binding()
    values = {name: _ortvalue(*spec) for name, spec in feeds.items()}
    for name, v in values.items():
        io.bind_ortvalue_input(name, v)
    for o in sess.get_outputs():
        if bind_same and o.name == bind_same[1]:
            io.bind_ortvalue_output(o.name, values[bind_same[0]])
        else:
            io.bind_output(o.name, "cpu")
    try:
        sess.run_with_iobinding(io)
    except Exception:
        return False
    return True


def _rule_verdict(model, bounds):
    return check(model, bounds=bounds, plan=False).ok


def _update_case(rank=4, seq_axis=-2, cache_t=F, values_t=F, pos=0, pos_t=I64, n=1, values_dims=None,
                 pos_shape=None, attrs=None, inputs=None):
    cache = [1, 2, 8, 4, 3][:rank] if rank <= 5 else [1] * rank
    if rank >= 3:
        cache[0] = 2
    axis = seq_axis + rank if isinstance(seq_axis, int) and seq_axis < 0 else seq_axis
    values = list(cache)
    if isinstance(axis, int) and 0 <= axis < rank:
        values[axis] = n
    if values_dims:
        for i, d in values_dims.items():
            values[i] = d
    pos = np.asarray(pos)
    pos_shape = list(pos.shape) if pos_shape is None else pos_shape
    kw = {"seq_axis": seq_axis} if attrs is None else attrs
    names = ["cache", "values", "position"] if inputs is None else inputs
    node = helper.make_node("CacheUpdate", names, ["out"], domain="ortkv", name="cu", **kw)
    model = _model([node], [_vi("cache", cache, cache_t), _vi("values", values, values_t),
                            _vi("position", pos_shape, pos_t)], [_vi("out", cache, cache_t)])
    mark_mutable(model, "cache")
    set_alias_of(model, "out", "cache")
    feeds = {"cache": (cache, cache_t), "values": (values, values_t),
             "position": (pos_shape, pos_t, np.broadcast_to(pos, pos_shape) if pos_t in NP else None)}
    feeds = {k: v for k, v in feeds.items() if k in names}
    bounds = {"position": (int(pos.min()), int(pos.max()))} if pos.size else None
    return model, feeds, ("cache", "out"), bounds


def _attention_case(hq=4, hkv=2, d=4, seq_axis=1, cap=8, t=1, batch=2, start=0, q_t=F, kv_t=F, start_t=I64,
                    q_width=None, v_dims=None, q_rank=3, attrs=None, start_shape=None):
    cache_axis = 1 if seq_axis == 1 else 2
    k = [batch, cap, hkv, d] if cache_axis == 1 else [batch, hkv, cap, d]
    k = [max(x, 0) for x in k]
    v = list(k) if v_dims is None else v_dims
    q = [batch, t, hq * d if q_width is None else q_width][:q_rank] if q_rank <= 3 else [batch, t, hq * d, 1]
    q = [max(x, 0) for x in q]
    start = np.asarray(start)
    start_shape = list(start.shape) if start_shape is None else start_shape
    kw = {"num_heads": hq, "kv_num_heads": hkv, "seq_axis": seq_axis} if attrs is None else attrs
    node = helper.make_node("CacheAttention", ["q", "k", "v", "start"], ["o"], domain="ortkv", name="att", **kw)
    model = _model([node], [_vi("q", q, q_t), _vi("k", k, kv_t), _vi("v", v, kv_t),
                            _vi("start", start_shape, start_t)], [_vi("o", q, q_t)])
    feeds = {"q": (q, q_t), "k": (k, kv_t), "v": (v, kv_t),
             "start": (start_shape, start_t, np.broadcast_to(start, start_shape) if start_t in NP else None)}
    bounds = {"start": (int(start.min()), int(start.max()))} if start.size else None
    return model, feeds, None, bounds


UPDATE_CASES = {}
for rank, axis in itertools.product((2, 3, 4, 5), range(-6, 6)):
    UPDATE_CASES[f"rank{rank}-seq_axis{axis}"] = dict(rank=rank, seq_axis=axis)
UPDATE_CASES.update({
    "default-seq_axis": dict(attrs={}),
    "f16": dict(cache_t=F16, values_t=F16),
    "bf16": dict(cache_t=BF16, values_t=BF16),
    "int32-cache": dict(cache_t=I32, values_t=I32),
    "values-type-differs": dict(cache_t=F, values_t=F16),
    "position-int32": dict(pos_t=I32),
    "position-per-row": dict(pos=[0, 7]),
    "position-rows-mismatch": dict(pos=[0, 1, 2]),
    "position-rank2": dict(pos=[[0, 1]]),
    "position-negative": dict(pos=-1),
    "position-last-slot": dict(pos=7),
    "position-overflow": dict(pos=8),
    "position-overflow-n2": dict(pos=7, n=2),
    "n-zero": dict(n=0),
    "n-fills-capacity": dict(n=8),
    "n-exceeds-capacity": dict(n=9),
    "values-dim-differs": dict(values_dims={3: 5}),
    "values-batch-differs": dict(values_dims={0: 1}),
    "two-inputs": dict(inputs=["cache", "values"]),
})

ATTENTION_CASES = {}
for hq, hkv in ((4, 2), (4, 4), (4, 3), (3, 4), (0, 1), (4, 0), (-4, -2), (64, 1), (65, 1), (128, 2), (130, 2)):
    ATTENTION_CASES[f"heads{hq}-kv{hkv}"] = dict(hq=hq, hkv=hkv, d=1 if abs(hq) > 8 else 4)
for axis in (-3, -2, -1, 0, 1, 2, 3, 4):
    ATTENTION_CASES[f"seq_axis{axis}"] = dict(seq_axis=axis)
for d in (1, 3, 64, 65):
    ATTENTION_CASES[f"head_size{d}"] = dict(d=d)
ATTENTION_CASES.update({
    "default-seq_axis-and-scale": dict(attrs={"num_heads": 4, "kv_num_heads": 2}),
    "missing-num_heads": dict(attrs={"kv_num_heads": 2}),
    "missing-kv_num_heads": dict(attrs={"num_heads": 4}),
    "query-f16": dict(q_t=F16),
    "caches-f16": dict(kv_t=F16),
    "all-f16": dict(q_t=F16, kv_t=F16),
    "start-int32": dict(start_t=I32),
    "start-per-row": dict(start=[0, 7]),
    "start-rows-mismatch": dict(start=[0, 1, 2]),
    "start-negative": dict(start=-1),
    "start-overflow": dict(start=8),
    "start-overflow-t2": dict(start=7, t=2),
    "block-fills-capacity": dict(start=0, t=8),
    "query-width-wrong": dict(q_width=12),
    "query-rank2": dict(q_rank=2),
    "value-cache-differs": dict(v_dims=[2, 9, 2, 4]),
    "bnsh": dict(seq_axis=2, start=7),
    "bnsh-negative": dict(seq_axis=-2, start=[3, 7]),
    "zero-tokens": dict(t=0),
})


def _assert_parity(case, model, feeds, same, bounds):
    rule, kernel = _rule_verdict(model, bounds), _kernel_verdict(model, feeds, same)
    assert rule == kernel, (case, "rule accepts" if rule else check(model, bounds=bounds, plan=False).errors,
                            "kernel accepts" if kernel else "kernel refuses")


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_parity_cache_update(case):
    _assert_parity(case, *_update_case(**UPDATE_CASES[case]))


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_parity_cache_attention(case):
    _assert_parity(case, *_attention_case(**ATTENTION_CASES[case]))


def test_parity_grid_covers_both_verdicts():
    verdicts = {c: _rule_verdict(*_update_case(**kw)[::3]) for c, kw in UPDATE_CASES.items()}
    verdicts.update({c: _rule_verdict(*_attention_case(**kw)[::3]) for c, kw in ATTENTION_CASES.items()})
    assert sum(verdicts.values()) >= 20 and sum(not v for v in verdicts.values()) >= 40, verdicts
    for case in ("rank4-seq_axis-2", "rank4-seq_axis2", "rank4-seq_axis1", "rank3-seq_axis-1"):
        assert verdicts[case], case
    assert verdicts["bnsh-negative"] and verdicts["heads64-kv1"] and not verdicts["heads65-kv1"]
    assert not verdicts["n-zero"] and not verdicts["seq_axis-1"]


@pytest.mark.parametrize("which", ["update-float-seq_axis", "attention-float-seq_axis", "attention-int-scale"])
def test_wrongly_typed_attribute_refused_by_checker_and_kernel(which):
    """seq_axis=1.0 (or scale=1) used to be read by the kernels as absent, running with the default;
    now both the contract and the kernel refuse it, naming the attribute."""
    assert KERNEL_LENIENCY == {}
    if which.startswith("update"):
        model, feeds, same, bounds = _update_case(attrs={"seq_axis": 1.0})
        attr, kind = "seq_axis", "int"
    elif which == "attention-float-seq_axis":
        model, feeds, same, bounds = _attention_case(attrs={"num_heads": 4, "kv_num_heads": 2, "seq_axis": 2.0})
        attr, kind = "seq_axis", "int"
    else:
        model, feeds, same, bounds = _attention_case(attrs={"num_heads": 4, "kv_num_heads": 2, "scale": 1})
        attr, kind = "scale", "float"
    report = check(model, bounds=bounds, plan=False)
    assert [e.rule for e in report.errors] == ["op-input"]
    assert f"attribute {attr} is" in report.errors[0].message and f"it must be {kind}" in report.errors[0].message
    assert _kernel_verdict(model, feeds, same) is False
    with pytest.raises(Exception, match=rf"attribute '{attr}' must be an? {kind}"):
        ort_session(model)


def test_refusals_leave_the_cache_untouched():
    # A refused update writes nothing (the checker refuses the same model before it runs).
    model, _, _, bounds = _update_case(pos=8)
    assert not _rule_verdict(model, bounds)
    sess = ort_session(model)
    cache = np.arange(np.prod([2, 2, 8, 4]), dtype=np.float32).reshape(2, 2, 8, 4)
    before = digest(cache)
    v = ort.OrtValue.ortvalue_from_numpy(cache)
    io = sess.io_binding()
    io.bind_ortvalue_input("cache", v)
    io.bind_ortvalue_output("out", v)
    io.bind_cpu_input("values", np.ones([2, 2, 1, 4], np.float32))
    io.bind_cpu_input("position", np.array(8, np.int64))
    with pytest.raises(Exception, match="exceeds capacity 8"):
        sess.run_with_iobinding(io)
    assert digest(cache) == before


@pytest.mark.parametrize("key", sorted(CONTRACTS))
def test_contract_kernel_field_matches_the_library(key):
    """``OpContract.kernel`` says where the library registers a kernel: ORT CPU loads a one-node model of
    every op that has one and refuses every op that has none (the checker warns: no-kernel)."""
    c = CONTRACTS[key]
    inputs = [_vi(f"i{k}", None, (p.types or (F,))[0]) for k, p in enumerate(c.inputs)]
    outputs = [_vi(f"o{k}", None, (p.types or (F,))[0]) for k, p in enumerate(c.outputs)]
    attrs = {a.name: (a.default if a.default is not None else 2) for a in c.attrs}
    node = helper.make_node(c.op_type, [i.name for i in inputs], [o.name for o in outputs], domain=c.domain,
                            name="n", **attrs)
    model = _model([node], inputs, outputs)
    try:
        ort_session(model)
        loads = True
    except Exception as exc:
        loads = False
        why = str(exc)
    assert loads == ("CPU" in c.kernel), (key, c.kernel, None if loads else why)
    warnings = [f for f in check(model, plan=False).findings if f.rule == "no-kernel"]
    assert bool(warnings) == (not c.kernel), warnings

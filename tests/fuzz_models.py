"""Malformed and mutated models for tests/test_check_untrusted.py (Note [Untrusted models] in
ortkv/graph/structure.py): seeds that pass the checker, and mutations of their protos and bytes."""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from ortkv.graph import make_cache_attention, make_cache_update, mark_mutable, set_alias_of

F, I64 = TP.FLOAT, TP.INT64


def _vi(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, inits=(), functions=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1),
                                               helper.make_opsetid("local", 1)], ir_version=10,
                             functions=list(functions))


def seed_update_attention():
    """CacheUpdate x2 (K, V) -> CacheAttention -> MatMul, with shape arithmetic on the side."""
    nodes = [
        make_cache_update("past_k", "new_k", "pos", "present_k", name="uk", seq_axis=1),
        make_cache_update("past_v", "new_v", "pos", "present_v", name="uv", seq_axis=1),
        make_cache_attention("q", "present_k", "present_v", "pos", "att", name="att", num_heads=4, kv_num_heads=2),
        helper.make_node("Shape", ["q"], ["qs"], name="shape"),
        helper.make_node("Gather", ["qs", "zero"], ["b"], axis=0, name="gather"),
        helper.make_node("Concat", ["b", "minus1"], ["target"], axis=0, name="concat"),
        helper.make_node("Reshape", ["att", "target"], ["flat"], name="reshape"),
        helper.make_node("MatMul", ["flat", "w"], ["y"], name="mm"),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.ones([16, 3], np.float32), "w")]
    kv = ["batch", 8, 2, 4]
    m = _model(nodes, [_vi("past_k", kv), _vi("past_v", kv), _vi("new_k", ["batch", 1, 2, 4]),
                       _vi("new_v", ["batch", 1, 2, 4]), _vi("pos", [], I64), _vi("q", ["batch", 1, 16])],
               [_vi("present_k", kv), _vi("present_v", kv), _vi("y", ["batch", 3])], inits)
    for c in ("past_k", "past_v"):
        mark_mutable(m, c)
    set_alias_of(m, "present_k", "past_k")
    set_alias_of(m, "present_v", "past_v")
    return m


def seed_control_flow():
    """A Loop whose body updates a carried cache, an If, a local function, ConstantOfShape."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
         make_cache_update("k_in", "new", "iter", "k_out", name="body_update")],
        "body", [_vi("iter", [], I64), _vi("cond_in", [], TP.BOOL), _vi("k_in", [1, 2, 8, 4])],
        [_vi("cond_out", [], TP.BOOL), _vi("k_out", [1, 2, 8, 4])])
    loop = helper.make_node("Loop", ["trips", "", "past"], ["present"], name="loop", body=body)
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t_out"], name="t")], "then", [],
                               [_vi("t_out", [2])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e_out"], name="e")], "else", [],
                               [_vi("e_out", [2])])
    branch = helper.make_node("If", ["flag"], ["chosen"], name="branch", then_branch=then_g, else_branch=else_g)
    shape = helper.make_node("Constant", [], ["shape2"], name="c2",
                             value=numpy_helper.from_array(np.array([2, 3], np.int64)))
    cos = helper.make_node("ConstantOfShape", ["shape2"], ["zeros"], name="cos")
    fbody = [helper.make_node("Add", ["a", "a"], ["twice"], name="add")]
    fn = helper.make_function("local", "Twice", ["a"], ["twice"], fbody,
                              [helper.make_opsetid("", 17)])
    call = helper.make_node("Twice", ["chosen"], ["called"], domain="local", name="call")
    m = _model([loop, branch, shape, cos, call],
               [_vi("past", [1, 2, 8, 4]), _vi("new", [1, 2, 1, 4]), _vi("flag", [], TP.BOOL), _vi("x", [2])],
               [_vi("present", [1, 2, 8, 4]), _vi("called", [2]), _vi("zeros", [2, 3])],
               [numpy_helper.from_array(np.array(4, np.int64), "trips")], functions=[fn])
    mark_mutable(m, "past")
    set_alias_of(m, "present", "past")
    return m


SEEDS = {"update_attention": seed_update_attention, "control_flow": seed_control_flow}

_ATTR_VALUES = [0, -1, -2, 1, 2, 3, 64, 65, -(2 ** 62), 2 ** 62, 7]
_DIMS = [0, 1, -1, 2 ** 40, 2 ** 62, 12000]


def _all_graphs(model):
    out, stack = [], [model.graph]
    while stack:
        g = stack.pop()
        out.append(g)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.append(a.g)
                stack.extend(a.graphs)
    return out


def _all_nodes(model):
    nodes = [n for g in _all_graphs(model) for n in g.node]
    return nodes + [n for f in model.functions for n in f.node]


def _value_infos(model):
    return [vi for g in _all_graphs(model) for vi in (*g.input, *g.output, *g.value_info)]


def mutate(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """One to three random structural mutations of a copy of ``model``."""
    m = copy.deepcopy(model)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 14))
        nodes, vis = _all_nodes(m), _value_infos(m)
        if kind == 0 and nodes:  # drop an input name
            n = nodes[rng.integers(len(nodes))]
            if n.input:
                del n.input[int(rng.integers(len(n.input)))]
        elif kind == 1 and nodes:  # rename an input to something undefined
            n = nodes[rng.integers(len(nodes))]
            if n.input:
                n.input[int(rng.integers(len(n.input)))] = "nowhere"
        elif kind == 2 and nodes:  # corrupt an attribute: value, or type
            n = nodes[rng.integers(len(nodes))]
            if n.attribute:
                a = n.attribute[int(rng.integers(len(n.attribute)))]
                choice = int(rng.integers(0, 4))
                if choice == 0:
                    a.type, a.i = onnx.AttributeProto.INT, _ATTR_VALUES[rng.integers(len(_ATTR_VALUES))]
                elif choice == 1:
                    a.type, a.f = onnx.AttributeProto.FLOAT, float(rng.normal())
                elif choice == 2:
                    a.type = onnx.AttributeProto.UNDEFINED
                else:
                    a.type, a.s = onnx.AttributeProto.STRING, b"junk"
        elif kind == 3 and vis:  # a dim becomes 0, -1, huge, or a symbol
            vi = vis[rng.integers(len(vis))]
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.shape.dim:
                dims = vi.type.tensor_type.shape.dim
                d = dims[int(rng.integers(len(dims)))]
                if rng.random() < 0.2:
                    d.dim_param = "sym"
                else:
                    d.dim_value = _DIMS[rng.integers(len(_DIMS))]
        elif kind == 4 and vis:  # element type: another, or invalid
            vi = vis[rng.integers(len(vis))]
            if vi.type.HasField("tensor_type"):
                vi.type.tensor_type.elem_type = int(rng.choice([0, 1, 6, 7, 8, 10, 16, 99]))
        elif kind == 5 and m.graph.node:  # drop a node
            del m.graph.node[int(rng.integers(len(m.graph.node)))]
        elif kind == 6 and len(m.graph.node) > 1:  # swap two nodes (out of order)
            i, j = rng.choice(len(m.graph.node), 2, replace=False)
            a, b = copy.deepcopy(m.graph.node[int(i)]), copy.deepcopy(m.graph.node[int(j)])
            m.graph.node[int(i)].CopyFrom(b)
            m.graph.node[int(j)].CopyFrom(a)
        elif kind == 7 and m.graph.input:  # drop a graph input
            del m.graph.input[int(rng.integers(len(m.graph.input)))]
        elif kind == 8:  # annotations: garbage output_alias / alias_of / access
            targets = list(nodes) + list(vis)
            if targets:
                t = targets[rng.integers(len(targets))]
                p = t.metadata_props.add()
                p.key = str(rng.choice(["output_alias", "alias_of", "access"]))
                p.value = str(rng.choice(["0:0:MUST_ALIAS", "9:9:MUST_ALIAS", "x", "READ_WRITE", "past",
                                          "0:0:MUST_ALIAS;1:0:MUST_ALIAS", ""]))
        elif kind == 9:  # opset / IR version
            if rng.random() < 0.5:
                del m.opset_import[:]
            else:
                m.ir_version = int(rng.choice([0, 3, 9, 10, 13, 14, 99]))
        elif kind == 10 and m.graph.initializer:  # initializer dims lie about the data
            t = m.graph.initializer[int(rng.integers(len(m.graph.initializer)))]
            if t.dims:
                t.dims[0] = _DIMS[rng.integers(len(_DIMS))]
            else:
                t.dims.append(3)
        elif kind == 11 and nodes:  # op type / domain
            n = nodes[rng.integers(len(nodes))]
            n.op_type = str(rng.choice(["CacheUpdate", "CacheAttention", "PagedCacheUpdate", "Loop", "If",
                                        "Twice", "Reshape", "NoSuchOp", ""]))
            n.domain = str(rng.choice(["", "ortkv", "local", "com.microsoft"]))
        elif kind == 12 and nodes:  # duplicate an output name
            n = nodes[rng.integers(len(nodes))]
            if n.output and m.graph.input:
                n.output[0] = m.graph.input[0].name
        elif kind == 13 and nodes:  # an extra or empty output
            n = nodes[rng.integers(len(nodes))]
            n.output.append(str(rng.choice(["", "extra"])))
    return m


def corrupt_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    """Truncated, or a few bytes flipped."""
    if rng.random() < 0.5:
        return data[:int(rng.integers(0, len(data)))]
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        b[int(rng.integers(len(b)))] = int(rng.integers(256))
    return bytes(b)


def constant_of_shape(dims) -> onnx.ModelProto:
    """135 bytes that would allocate prod(dims) floats if folded."""
    c = helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array(dims, np.int64)))
    cos = helper.make_node("ConstantOfShape", ["s"], ["y"])
    return helper.make_model(helper.make_graph([c, cos], "g", [], [_vi("y", None)]),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def update_chain(n: int) -> onnx.ModelProto:
    """n CacheUpdates, each updating the previous one's output; names sort against the chain."""
    nodes = [make_cache_update(f"c{n - i:05d}", "v", "p", f"c{n - i - 1:05d}", name=f"u{i}") for i in range(n)]
    m = _model(nodes, [_vi(f"c{n:05d}", [1, 2, 8, 4]), _vi("v", [1, 2, 1, 4]), _vi("p", [], I64)],
               [_vi("c00000", [1, 2, 8, 4])])
    mark_mutable(m, f"c{n:05d}")
    set_alias_of(m, "c00000", f"c{n:05d}")
    return m


def alias_of_chain(n: int) -> onnx.ModelProto:
    """value_info alias_of annotations a_i -> a_(i+1), n long (no nodes behind them)."""
    m = _model([helper.make_node("Identity", ["x"], ["y"], name="id")], [_vi("x", [1])], [_vi("y", [1])])
    for i in range(n):
        vi = m.graph.value_info.add()
        vi.name = f"a{n - i:05d}"
        set_alias_of(m, vi.name, f"a{n - i - 1:05d}")
    return m


def nested_ifs(depth: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["o0"])], "leaf", [], [_vi("o0", [1])])
    for d in range(1, depth + 1):
        leaf = helper.make_graph([helper.make_node("Identity", ["x"], [f"e{d}"])], "leaf", [], [_vi(f"e{d}", [1])])
        node = helper.make_node("If", ["flag"], [f"o{d}"], then_branch=g, else_branch=leaf)
        g = helper.make_graph([node], f"level{d}", [], [_vi(f"o{d}", [1])])
    return helper.make_model(helper.make_graph(list(g.node), "g", [_vi("flag", [], TP.BOOL), _vi("x", [1])],
                                               [_vi(f"o{depth}", [1])]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def function_fanout(levels: int) -> onnx.ModelProto:
    """Local functions f_k calling f_(k-1) twice: 2**levels inlined nodes from a handful."""
    fns = [helper.make_function("local", "f0", ["a"], ["b"], [helper.make_node("Neg", ["a"], ["b"])],
                                [helper.make_opsetid("", 17)])]
    for k in range(1, levels + 1):
        body = [helper.make_node(f"f{k - 1}", ["a"], ["m"], domain="local"),
                helper.make_node(f"f{k - 1}", ["m"], ["b"], domain="local")]
        fns.append(helper.make_function("local", f"f{k}", ["a"], ["b"], body,
                                        [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]))
    call = helper.make_node(f"f{levels}", ["x"], ["y"], domain="local", name="call")
    return _model([call], [_vi("x", [2])], [_vi("y", [2])], functions=fns)


def run_fuzz(seed: int, mutations: int, time_limit: float) -> dict:
    """Every seed, ``mutations`` proto mutations and as many byte corruptions of it, through
    ortkv.graph.check, check_aliases and ``ortkv check``; returns what went wrong (JSON-able)."""
    import contextlib
    import io
    import os
    import tempfile
    import time
    import traceback

    from ortkv.errors import GraphCheckError
    from ortkv.graph import check, check_aliases
    from ortkv.graph.cli import main as check_main

    rng = np.random.default_rng(seed)
    summary = {"models": 0, "cli_runs": 0, "raised": [], "internal": [], "slow": [], "cli": [], "rules": {}}
    tmp = tempfile.mkdtemp()

    def one(model, tag):
        summary["models"] += 1
        t = time.monotonic()
        try:
            report = check(model, dims={"batch": 1})
            report.format()
            for f in report.findings:
                summary["rules"][f.rule] = summary["rules"].get(f.rule, 0) + 1
                if f.rule == "internal":
                    summary["internal"].append(f"{tag}: {f.message}")
            check_aliases(model)
        except GraphCheckError:
            pass
        except BaseException as exc:  # noqa: BLE001 - the point of the test
            summary["raised"].append(f"{tag}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
        if time.monotonic() - t > time_limit:
            summary["slow"].append(f"{tag}: {time.monotonic() - t:.1f} s")

    def cli(data: bytes, tag):
        summary["cli_runs"] += 1
        path = os.path.join(tmp, "m.onnx")
        with open(path, "wb") as fh:
            fh.write(data)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = check_main([path])
        except BaseException as exc:  # noqa: BLE001
            summary["cli"].append(f"{tag}: raised {type(exc).__name__}: {exc}")
            return
        lines = err.getvalue().strip().splitlines()
        if rc not in (0, 1, 2) or (rc == 2 and len(lines) != 1) or "Traceback" in err.getvalue():
            summary["cli"].append(f"{tag}: rc {rc}, stderr {err.getvalue()[:300]!r}")

    for name, build in SEEDS.items():
        base = build()
        data = base.SerializeToString()
        for i in range(mutations):
            m = mutate(base, rng)
            one(m, f"{name}/mutation{i}")
            if i % 5 == 0:
                cli(m.SerializeToString(), f"{name}/mutation{i}")
            bad = corrupt_bytes(data, rng)
            try:
                parsed = onnx.load_from_string(bad)
            except Exception:  # not protobuf at all: the CLI's one-line refusal
                if i % 5 == 0:
                    cli(bad, f"{name}/bytes{i}")
                continue
            one(parsed, f"{name}/bytes{i}")
            if i % 5 == 0:
                cli(bad, f"{name}/bytes{i}")
    for tag, m in (("empty", onnx.ModelProto()), ("zero-dims", constant_of_shape([0, 0])),
                   ("huge-dims", constant_of_shape([2 ** 62, 2 ** 62])), ("chain", update_chain(300)),
                   ("nested-ifs", nested_ifs(20)), ("fanout", function_fanout(24))):
        one(m, tag)
    return summary

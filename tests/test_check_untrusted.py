"""Untrusted models (Note [Untrusted models] in ortkv/graph/structure.py): ``ortkv.graph.check`` and
``ortkv check`` on empty, malformed, mutated, huge and deep models give findings or one-line errors,
never an exception, within a time and memory bound. The dangerous ones run in a subprocess with a
timeout, so a regression fails the test instead of hanging or killing the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import ortkv
from fuzz_models import seed_update_attention
from ortkv.cli import main as cli_main
from ortkv.graph import check, check_aliases, check_model

HERE = os.path.dirname(os.path.abspath(__file__))


def _subprocess(code: str, timeout: float, memory_mb: int | None = None) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter, with an address-space
    cap when given; return the JSON."""
    limit = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_mb << 20}, {memory_mb << 20}))\n"
             if memory_mb else "")
    prog = limit + textwrap.dedent(code)
    # one BLAS/OpenMP thread: thread pools reserve address space per core, which the cap would count
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                              cwd=HERE, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {timeout} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rules(report_or_findings):
    findings = getattr(report_or_findings, "findings", report_or_findings)
    return [f.rule for f in findings if f.severity == "error"]


# --- the cases from the issue ---------------------------------------------------------------------
def test_constant_of_shape_is_not_folded_before_the_size_cap():
    # 135 bytes asking for a [12000, 12000] float tensor: it was computed (1.1 GiB, 7 s) before the
    # size cap looked at it. Now the output shape decides, first: nothing is computed.
    out = _subprocess("""
        import json, resource, time
        import fuzz_models as fm
        from ortkv.graph import check
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = {}
        for dims in ([12000, 12000], [2 ** 31, 2 ** 31], [2 ** 62, 2 ** 62]):
            t = time.monotonic()
            report = check(fm.constant_of_shape(dims), plan=False)
            res[str(dims)] = [time.monotonic() - t, [f.rule for f in report.errors]]
        res["grew_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        print(json.dumps(res))
    """, timeout=60, memory_mb=4096)
    assert out["grew_mb"] < 100, out
    for dims in ("[12000, 12000]", "[2147483648, 2147483648]"):
        seconds, errors = out[dims]
        assert seconds < 2 and errors == [], out


def test_long_update_chain_and_alias_of_chain_are_linear():
    # A 3,000-update chain raised RecursionError (a recursive alias-cycle search); a 3,000-long
    # alias_of chain took minutes (a cubic cycle walk).
    out = _subprocess("""
        import json, time
        import fuzz_models as fm
        from ortkv.graph import check
        res = {}
        for name, m in (("updates", fm.update_chain(3000)), ("alias_of", fm.alias_of_chain(3000))):
            t = time.monotonic()
            report = check(m, plan=False)
            res[name] = [time.monotonic() - t, sorted({f.rule for f in report.errors})]
        print(json.dumps(res))
    """, timeout=120)
    seconds, rules = out["updates"]
    assert seconds < 15 and rules == [], out
    seconds, rules = out["alias_of"]
    assert seconds < 15 and rules == ["alias-target"], out  # each link names a non-input: a finding each


def test_function_fanout_hits_the_inlining_cap():
    out = _subprocess("""
        import json, time
        import fuzz_models as fm
        from ortkv.graph import check
        t = time.monotonic()
        report = check(fm.function_fanout(32), plan=False)  # 2**32 nodes if every call were inlined
        print(json.dumps([time.monotonic() - t, [(f.rule, f.message) for f in report.errors]]))
    """, timeout=120)
    seconds, errors = out
    assert seconds < 20, out
    assert [r for r, _ in errors] == ["limit"] and "nodes to infer" in errors[0][1], errors


def test_empty_model_is_an_error_not_no_findings(tmp_path, capsys):
    report = check(onnx.ModelProto())
    assert _rules(report) == ["malformed"] and "empty or not an ONNX model" in report.errors[0].message
    assert "no findings" not in report.format()
    with pytest.raises(ortkv.GraphCheckError, match="malformed"):
        check_model(onnx.ModelProto())
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert cli_main(["check", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"ortkv check: '{empty}' is empty (0 bytes); not an ONNX model"
    bare = tmp_path / "bare.onnx"
    bare.write_bytes(b"\x42\x00")  # valid protobuf (one empty opset_import entry), no IR version, no graph
    assert cli_main(["check", str(bare)]) == 2
    assert "is not an ONNX model" in capsys.readouterr().err


# --- structure: each malformed shape gives a named finding ---------------------------------------------
def _m(nodes, inputs, outputs, inits=()):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _v(name, shape=(2,), t=TP.FLOAT):
    return helper.make_tensor_value_info(name, t, list(shape))


@pytest.mark.parametrize("case, words", [
    ("missing-input", ["node 'neg' reads 'nowhere'", "a missing input, or nodes out of order"]),
    ("out-of-order", ["node 'first' reads 'mid'"]),
    ("defined-twice", ["defines 'x', which is already defined"]),
    ("negative-dim", ["'x' is declared with a negative dim"]),
    ("no-outputs", ["the main graph has no outputs"]),
    ("no-opset", ["imports no opset"]),
    ("untyped-attribute", ["attribute 'axis' has no type"]),
    ("undefined-output", ["graph output 'ghost' is not defined"]),
])
def test_structure_findings(case, words):
    if case == "missing-input":
        m = _m([helper.make_node("Neg", ["nowhere"], ["y"], name="neg")], [_v("x")], [_v("y")])
    elif case == "out-of-order":
        m = _m([helper.make_node("Neg", ["mid"], ["y"], name="first"), helper.make_node("Neg", ["x"], ["mid"])],
               [_v("x")], [_v("y")])
    elif case == "defined-twice":
        m = _m([helper.make_node("Neg", ["x"], ["x"], name="again")], [_v("x")], [_v("x")])
    elif case == "negative-dim":
        m = _m([helper.make_node("Neg", ["x"], ["y"])], [_v("x", [-3])], [_v("y")])
    elif case == "no-outputs":
        m = _m([helper.make_node("Neg", ["x"], ["y"])], [_v("x")], [])
    elif case == "no-opset":
        m = _m([helper.make_node("Neg", ["x"], ["y"])], [_v("x")], [_v("y")])
        del m.opset_import[:]
    elif case == "untyped-attribute":
        node = helper.make_node("Softmax", ["x"], ["y"], axis=0)
        node.attribute[0].type = onnx.AttributeProto.UNDEFINED
        m = _m([node], [_v("x")], [_v("y")])
    else:
        m = _m([helper.make_node("Neg", ["x"], ["y"])], [_v("x")], [_v("y"), _v("ghost")])
    report = check(m)
    assert set(_rules(report)) == {"malformed"}, report.findings
    text = " ".join(f.message for f in report.errors)
    for w in words:
        assert w in text, (w, text)
    assert report.plan is None
    assert _rules(check_aliases(m)) == _rules(report)


def test_malformed_ortkv_nodes_are_findings():
    # A CacheUpdate with two inputs, a CacheAttention with a string num_heads, a Loop without a body:
    # these raised IndexError / TypeError / AttributeError inside the rules.
    cu = helper.make_node("CacheUpdate", ["x", "v"], ["y"], domain="ortkv", name="cu")
    att = helper.make_node("CacheAttention", ["q", "k", "k", "s"], ["o"], domain="ortkv", name="att",
                           num_heads="four", kv_num_heads=2)
    loop = helper.make_node("Loop", ["n", ""], [], name="loop", body=b"not a graph")
    ln = helper.make_node("SimplifiedLayerNormalization", ["s", "w"], ["ln", "inv"], domain="com.microsoft",
                          name="ln")
    m = helper.make_model(helper.make_graph(
        [cu, att, loop, ln], "g",
        [_v("x", [1, 2, 8, 4]), _v("v", [1, 2, 1, 4]), _v("q", [1, 1, 8]), _v("k", [1, 8, 2, 4]),
         _v("s", [], TP.INT64), _v("n", [], TP.INT64), _v("w", [1])],
        [_v("y", [1, 2, 8, 4]), _v("o", [1, 1, 8]), _v("ln", [])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1),
                       helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    ortkv.graph.mark_mutable(m, "x")
    ortkv.graph.set_alias_of(m, "y", "x")
    report = check(m, plan=False)
    assert "internal" not in _rules(report)
    text = " | ".join(f"{f.subject}: {f.message}" for f in report.errors)
    assert "CacheUpdate node 'cu': has 2 inputs but CacheUpdate takes 3 (cache, values, position)" in text
    assert "attribute num_heads is STRING; it must be int" in text
    assert "Loop node 'loop' has no body graph" in text


def test_invalid_utf8_names_are_one_finding():
    m = _m([helper.make_node("Neg", ["x"], ["y"], name="neg")], [_v("x")], [_v("y")])
    data = m.SerializeToString().replace(b"neg", b"n\xffg")
    parsed = onnx.load_from_string(data)  # proto2 strings are not validated: the name comes back as bytes
    report = check(parsed)
    assert _rules(report) == ["malformed"] and "is not valid UTF-8" in report.errors[0].message


# --- the fuzz ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_mutated_models_give_findings_not_exceptions(seed):
    out = _subprocess(f"""
        import json
        import fuzz_models as fm
        print(json.dumps(fm.run_fuzz({seed}, 120, 5.0)))
    """, timeout=300, memory_mb=4096)
    assert out["models"] >= 250 and out["cli_runs"] >= 40, out
    assert out["raised"] == [], out["raised"][:3]
    assert out["internal"] == [], out["internal"][:3]  # every failure has a named rule
    assert out["cli"] == [], out["cli"][:3]
    assert out["slow"] == [], out["slow"]
    assert {"malformed", "op-input", "shape"} <= set(out["rules"]), out["rules"]


def test_seeds_pass_the_checker():
    # The fuzz starts from models the checker accepts, so its findings come from the mutations.
    from fuzz_models import SEEDS

    for name, build in SEEDS.items():
        assert check(build(), dims={"batch": 1}).errors == [], name


# --- the check command line: misuse gets one line naming the problem, exit 2 ------------------------------
@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.onnx"
    onnx.save(seed_update_attention(), path)
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["{good}", "--variant", "ortkv"], "give either a MODEL path or --variant, not both (got '{good}' and "
                                       "--variant ortkv)"),
    (["--dims", "batch"], "--dims 'batch' must look like NAME=VALUE (e.g. --dims batch=1)"),
    (["{good}", "--dims", "batch"], "--dims 'batch' must look like NAME=VALUE (e.g. --dims batch=1)"),
    (["{good}", "--dims", "batch="], "--dims 'batch=' must look like NAME=VALUE"),
    (["{good}", "--dims", "batch=1", "batch=2"], "--dims gives 'batch' twice (batch=1 and batch=2)"),
    (["{good}", "--dims", "batch=-1"], "--dims batch=-1: a dim is >= 0"),
    (["{good}", "--dims", "batch=x"], "--dims batch=x: the value must be an integer"),
    (["{good}", "--bounds", "pos=5:2"], "--bounds pos=5:2: LO 5 is above HI 2"),
    (["{good}", "--bounds", "pos"], "--bounds 'pos' must look like NAME=VALUE"),
    (["{good}", "--threads", "0"], "--threads 0: at least 1"),
    (["{good}", "--threads", "many"], "--threads many: the value must be an integer"),
    (["{good}", "--config", "c.json"], "--config applies only with --variant"),
    (["--dims", "batch=1"], "give a MODEL path (an .onnx file) or --variant ortkv|genai|copy"),
    ([], "give a MODEL path (an .onnx file) or --variant"),
    (["{good}", "other.onnx"], "unrecognized arguments: other.onnx"),
    (["{good}", "--variant", "llama"], "argument --variant: invalid choice: 'llama'"),
    (["{dir}"], "is a directory; give the path of an .onnx file"),
    (["{dir}/missing.onnx"], "cannot load '{dir}/missing.onnx': no such file"),
])
def test_cli_misuse_is_one_line(args, message, good, tmp_path, capsys):
    fill = {"good": good, "dir": str(tmp_path)}
    assert cli_main(["check", *[a.format(**fill) for a in args]]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ortkv check: "), captured.err
    assert message.format(**fill) in lines[0], (message, lines[0])
    assert captured.out == ""


def test_cli_entry_point_misuse_has_no_traceback(good, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07\x12\xff\xff\xff\xff\x0f")  # truncated protobuf
    for args in ([good, "--variant", "ortkv"], ["--dims", "batch"], [str(junk)]):
        proc = subprocess.run([sys.executable, "-m", "ortkv.cli", "check", *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
    assert "not an ONNX model" in proc.stderr


def test_cli_good_and_bad_models_still_report(good, tmp_path, capsys):
    assert cli_main(["check", good, "--dims", "batch=1"]) == 0
    assert "memory plan: peak" in capsys.readouterr().out
    m = seed_update_attention()
    m.graph.node[0].input[0] = "nowhere"
    bad = tmp_path / "bad.onnx"
    onnx.save(m, bad)
    assert cli_main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "error: [malformed] uk: node 'uk' reads 'nowhere'" in out and "memory plan: not computed" in out


def test_initializer_data_that_lies_about_its_dims():
    # dims say 4 int64 values, the data holds 3: read as unknown, not an exception
    t = numpy_helper.from_array(np.array([1, 2, 3], np.int64), "shape")
    t.dims[:] = [4]
    m = _m([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")], [_v("x", [6])], [_v("y", [6])],
           inits=[t])
    report = check(m, plan=False)
    assert "internal" not in _rules(report)


def test_string_tensors_leave_the_plan_out_with_a_reason():
    # elem_size raised ValueError out of check() for a string tensor once every dim was concrete
    m = _m([helper.make_node("Identity", ["x"], ["y"], name="id")], [_v("x", [2], TP.STRING)],
           [_v("y", [2], TP.STRING)])
    report = check(m)
    assert report.errors == [] and report.plan is None
    assert report.plan_error == ("the memory plan needs a fixed element size for every value; 2 have none "
                                 "('x' is string [2]; 'y' is string [2])")


def test_caps_on_nodes_and_nesting(monkeypatch):
    # The caps are checked before any rule runs; lowered here so the models stay small.
    import fuzz_models as fm
    from ortkv.graph import structure

    monkeypatch.setattr(structure, "MAX_NODES", 100)
    report = check(fm.update_chain(101), plan=False)
    assert _rules(report) == ["limit"] and "more than 100 nodes" in report.errors[0].message
    assert check(fm.update_chain(100), plan=False).errors == []
    monkeypatch.setattr(structure, "MAX_DEPTH", 3)
    report = check(fm.nested_ifs(5), plan=False)
    assert _rules(report) == ["limit"] and "nest deeper than 3 levels" in report.errors[0].message
    assert check(fm.nested_ifs(3), plan=False).errors == []

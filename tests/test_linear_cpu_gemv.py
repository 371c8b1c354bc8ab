"""ortkv.Linear's float32 CPU tile kernel (Note [Linear CPU GEMV] in custom_ops/kernels/cpu/linear.cc) against a
float64 numpy reference: M = 1..4 (the decode path: N split into contiguous tasks of 4-row groups) and M = 5..9
and 70 (X rows in chunks of 4, W re-read from L1), K a multiple of 16 and K = 8 mod 16 (the masked half-vector
tail), N not a multiple of 4 (the one-row tail), N large enough for several tasks and for the prefetched groups;
the same bytes with 1 and 2 threads; each instruction-set copy forced through ORTKV_CPU_ISA in a child process
(baseline is the reference path), and a bad ORTKV_CPU_ISA refused by name with Y untouched; each one-row path
(ORTKV_LINEAR_M1: tile, stream, stream-nta) likewise in a child, and a bad ORTKV_LINEAR_M1 refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from onnx import TensorProto as TP

from conftest import cpu_isas
from test_linear import _bound_run, bound, check_close, linear_model, session

HERE = os.path.dirname(os.path.abspath(__file__))

# (M, K, N): decode shapes (incl. the decoder's own), odd N, K = 8 mod 16, several tasks
CASES = [(1, 8, 1), (1, 24, 3), (2, 40, 5), (3, 72, 37), (4, 584, 101), (1, 576, 960), (1, 1536, 577),
         (4, 1536, 579), (2, 576, 3075), (1, 8, 4099), (3, 24, 1001)]
# prefill-like: X rows in chunks of 4 (+ 1, 2, 3), several 64-row tasks at 70
PREFILL = [(5, 72, 37), (6, 88, 13), (7, 16, 9), (8, 576, 64), (9, 24, 131), (70, 40, 21)]


@pytest.mark.parametrize("M,K,N", CASES + PREFILL)
def test_float32_kernel_matches_numpy(rng, M, K, N):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    (y,) = session(linear_model(K, N, [M, K], w=w)).run(None, {"x": x})
    check_close(y, x, w, np.float32)


def test_float32_kernel_3d_x_and_large_values(rng):
    """X [B, T, K] with M = B T = 4; values of very different magnitudes (the bound scales with sum |x w|)."""
    K, N = 584, 203
    x = (rng.standard_normal((2, 2, K)) * np.exp(rng.uniform(-8, 8, (2, 2, K)))).astype(np.float32)
    w = (rng.standard_normal((N, K)) * np.exp(rng.uniform(-8, 8, (N, K)))).astype(np.float32)
    (y,) = session(linear_model(K, N, [2, 2, K], w=w)).run(None, {"x": x})
    assert y.shape == (2, 2, N)
    check_close(y.reshape(4, N), x.reshape(4, K), w, np.float32)


@pytest.mark.parametrize("M", [1, 4, 9])
def test_float32_kernel_same_bytes_any_thread_count(rng, M):
    """Each (m, n) is one sum in one order whichever task computes it: 1 and 2 threads give the same bytes."""
    K, N = 576, 2053
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    one, two = (session(linear_model(K, N, [M, K], w=w), t).run(None, {"x": x})[0] for t in (1, 2))
    assert one.tobytes() == two.tobytes()
    check_close(one, x, w, np.float32)


@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize("K", [8, 40, 576, 584, 1536])
def test_float32_kernel_row_count_same_bytes(rng, K, activation):
    """Note [Linear row-count invariance]: row m of a call with M rows is the same bytes as that row alone (M = 1,
    the one-row path this process chose: the tile, or one W row at a time with one accumulator in the tile's order)
    and as in a call of another M, with and without the SwiGLU epilogue. K below, at and past one 64-float step of the
    one-row stream, and K = 8 mod 16 (the half tail). What logits_start relies on: the head's last row computed
    alone equals the last row of all positions."""
    N = 4 * 97 + 2  # several tasks, and a one-row tail after the 4-row groups
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    x = rng.standard_normal((9, K)).astype(np.float32)
    attrs = {} if activation is None else {"activation": activation}
    sess = {M: session(linear_model(K, N, [M, K], w=w, **attrs)) for M in (1, 2, 5, 9)}
    full = sess[9].run(None, {"x": x})[0]
    for m in (0, 4, 8):
        alone = sess[1].run(None, {"x": x[m:m + 1]})[0]
        assert alone.tobytes() == full[m:m + 1].tobytes(), (m, float(np.abs(alone - full[m:m + 1]).max()))
    assert sess[2].run(None, {"x": x[3:5]})[0].tobytes() == full[3:5].tobytes()
    assert sess[5].run(None, {"x": x[4:]})[0].tobytes() == full[4:].tobytes()


def test_float32_kernel_nan_and_inf_propagate(rng):
    """A NaN / inf in W reaches exactly its output column (no lane of another row is mixed in)."""
    K, N = 72, 13
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[5, 70] = np.nan  # in the half-vector tail (K = 72 = 64 + 8)
    w[9, 3] = np.inf
    x = np.abs(rng.standard_normal((3, K))).astype(np.float32) + 0.5
    (y,) = session(linear_model(K, N, [3, K], w=w)).run(None, {"x": x})
    assert np.isnan(y[:, 5]).all() and np.isposinf(y[:, 9]).all()
    ok = [n for n in range(N) if n not in (5, 9)]
    check_close(y[:, ok], x, w[ok], np.float32)


def _child(isa: str, args: list[str], one_row: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("ORTKV_CPU_ISA", None)
    if isa != "best":
        env["ORTKV_CPU_ISA"] = isa
    if one_row is not None:
        env["ORTKV_LINEAR_M1"] = one_row
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 Linux only")
@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_each_forced_isa_matches_numpy(isa):
    """The process picks its instruction set once, so each forced copy runs this file's kernel tests in a child."""
    if isa not in cpu_isas():
        pytest.skip(f"this CPU cannot run {isa} (flags checked in /proc/cpuinfo)")
    r = _child(isa, [os.path.abspath(__file__), "-k",
                                 "matches_numpy and not forced and not one_row or same_bytes or nan_and_inf or activation_values"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 Linux only")
@pytest.mark.parametrize("isa,one_row", [("best", "tile"), ("best", "stream"), ("best", "stream-nta"),
                                         ("avx2", "stream-nta"), ("avx2", "tile")])
def test_each_one_row_path_matches_numpy(isa, one_row):
    """Note [Linear GEMV one stream]: a one-row call reads W by the 4-row tile or one row at a time (prefetcht0 or
    prefetchnta), chosen once per process by the CPU's vendor or ORTKV_LINEAR_M1: every path, in a child, runs this
    file's kernel tests (M = 1 cases included, SwiGLU too)."""
    if isa != "best" and isa not in cpu_isas():
        pytest.skip(f"this CPU cannot run {isa} (flags checked in /proc/cpuinfo)")
    r = _child(isa, [os.path.abspath(__file__), "-k",
                     "matches_numpy and not forced and not one_row or same_bytes or nan_and_inf or activation_values"],
               one_row=one_row)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


@pytest.mark.parametrize("var,value,message", [
    ("ORTKV_CPU_ISA", "sse9", "environment variable ORTKV_CPU_ISA='sse9' is not one of baseline, avx2, avx512"),
    ("ORTKV_LINEAR_M1", "fast", "environment variable ORTKV_LINEAR_M1='fast' is not one of tile, stream, stream-nta; "
                                "unset it for this CPU's default")])
def test_bad_environment_is_refused_by_name_with_y_untouched(var, value, message):
    """A misspelt ORTKV_CPU_ISA (sse9) or ORTKV_LINEAR_M1 (fast; Note [Linear GEMV one stream]): the float32 Linear
    refuses with E_INPUT naming the node and the choices, Y's bytes unchanged; a float16 Linear (the reference path,
    no instruction-set copies) still runs."""
    code = (
        "import numpy as np, onnxruntime as ort, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_linear import linear_model, session\n"
        "s = session(linear_model(16, 8, [1, 16], w=np.ones((8, 16), np.float32)))\n"
        "y = ort.OrtValue.ortvalue_from_numpy(np.full((1, 8), np.nan, np.float32))\n"
        "io = s.io_binding(); io.bind_cpu_input('x', np.ones((1, 16), np.float32)); io.bind_ortvalue_output('y', y)\n"
        "try:\n"
        "    s.run_with_iobinding(io)\n"
        "    print('NO ERROR')\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
        "print('UNTOUCHED', np.isnan(y.numpy()).all())\n"
        "from onnx import TensorProto as TP\n"  # float16 runs the reference path: no instruction-set check
        "h = session(linear_model(16, 8, [1, 16], TP.FLOAT16, w=np.ones((8, 16), np.float16)))\n"
        "print('FLOAT16', h.run(None, {'x': np.ones((1, 16), np.float16)})[0].tolist())\n" % HERE)
    env = {k: v for k, v in os.environ.items() if k not in ("ORTKV_CPU_ISA", "ORTKV_LINEAR_M1")}
    env[var] = value
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=HERE)
    assert f"[ortkv:E_INPUT] Linear node 'lin': {message}" in r.stdout, r.stdout + r.stderr
    assert "UNTOUCHED True" in r.stdout, r.stdout
    assert "FLOAT16 [[16.0, 16.0, 16.0, 16.0, 16.0, 16.0, 16.0, 16.0]]" in r.stdout, r.stdout + r.stderr


# -- activation="swiglu" (Note [Linear SwiGLU epilogue]) -------------------------------------------------------------

def _silu_ref(g, u):
    g, u = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (g / (1.0 + np.exp(-g))) * u


@pytest.mark.parametrize("M,K,N", [(1, 576, 3072), (2, 72, 74), (3, 24, 10), (4, 584, 202), (1, 8, 2),
                                   (9, 40, 66), (70, 16, 34)])
def test_swiglu_matches_numpy(rng, M, K, N):
    """Y [M, N / 2] = silu(X wg^T) * (X wu^T), W = [wg; wu]: the products' float32 bound carried through silu (its
    slope is within [-0.1, 1.1]) plus a few float32 ulps of the activation itself."""
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.2).astype(np.float32)
    (y,) = session(linear_model(K, N, [M, K], w=w, activation="swiglu")).run(None, {"x": x})
    h = N // 2
    p = x.astype(np.float64) @ w.astype(np.float64).T
    g, u = p[:, :h], p[:, h:]
    assert y.shape == (M, h) and y.dtype == np.float32
    bg, bu = bound(x, w[:h], np.float32), bound(x, w[h:], np.float32)
    sg = 1.0 / (1.0 + np.exp(-g))
    allowed = 1.1 * bg * (np.abs(u) + bu) + np.abs(g * sg) * bu + 2.0 ** -20 * np.abs(g * sg * u) + 1e-30
    err = np.abs(y.astype(np.float64) - _silu_ref(g, u))
    assert np.all(err <= allowed), float((err / allowed).max())


def test_swiglu_activation_values_and_specials():
    """X = e_0 makes the products W's first column exactly: g over [-110, 110] and the specials, against float64.
    Finite g >= -80: within 4 float32 ulps of silu(g) * u; below, both under 1e-33; NaN anywhere -> NaN;
    g = +inf -> +inf * u; u = 0 -> 0 (g finite)."""
    g = np.concatenate([np.linspace(-110, 110, 2201), [0.0, -0.0, 1e-30, -1e-30, 87.0, 88.5, 89.5, -87.0, -88.5,
                                                        -89.5, -103.0, -105.0, np.nan, np.inf, 3.0, 3.0]])
    u = np.ones_like(g)
    u[-2], u[-1] = np.nan, 0.0
    h = g.size
    K = 16
    w = np.zeros((2 * h, K), np.float32)
    w[:h, 0], w[h:, 0] = g, u
    x = np.zeros((1, K), np.float32)
    x[0, 0] = 1.0
    (y,) = session(linear_model(K, 2 * h, [1, K], w=w, activation="swiglu")).run(None, {"x": x})
    y = y[0].astype(np.float64)
    ref = _silu_ref(g.astype(np.float32), u.astype(np.float32))
    finite = np.isfinite(g) & np.isfinite(u)
    # sigmoid(g) = 1 / (1 + exp(-g)) is a normal float32 for g >= -80 (the float32 formula's own limit: below,
    # its intermediate is subnormal and every float32 evaluation, std::exp's too, loses relative precision)
    normal = finite & (g >= -80) & (np.abs(ref) >= np.finfo(np.float32).tiny)
    ulp = np.spacing(np.abs(ref[normal]).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(y[normal] - ref[normal]) <= 4 * ulp), float((np.abs(y[normal] - ref[normal]) / ulp).max())
    assert np.all(np.abs(y[finite & ~normal] - ref[finite & ~normal]) < 1e-33)  # ~0: both under 1e-33
    assert np.isnan(y[np.isnan(g) | np.isnan(u)]).all()
    assert y[np.isposinf(g)][0] == np.inf
    assert y[-1] == 0.0


def test_swiglu_same_bytes_any_thread_count(rng):
    K, N = 576, 3072
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    x = rng.standard_normal((1, K)).astype(np.float32)
    one, two = (session(linear_model(K, N, [1, K], w=w, activation="swiglu"), t).run(None, {"x": x})[0]
                for t in (1, 2))
    assert one.tobytes() == two.tobytes()


def test_swiglu_shape_inference_gives_half_n(rng):
    sess = session(linear_model(16, 24, ["b", "t", 16], w=rng.standard_normal((24, 16)).astype(np.float32),
                                activation="swiglu"))
    (y,) = sess.run(None, {"x": np.ones((2, 3, 16), np.float32)})
    assert y.shape == (2, 3, 12)


def test_swiglu_refusals_name_the_node_and_leave_y_untouched():
    sess = session(linear_model("k", "n", ["m", "k"], activation="swiglu"))
    msg, same = _bound_run(sess, np.ones((2, 16), np.float32), np.ones((7, 16), np.float32), [2, 3])
    assert "[ortkv:E_INPUT] Linear node 'lin': activation 'swiglu' needs W 'w' [7, 16] to have an even N (gate " \
           "rows, then as many up rows); N = 7" in msg and same
    h16 = session(linear_model("k", "n", ["m", "k"], TP.FLOAT16, activation="swiglu"))
    msg, same = _bound_run(h16, np.ones((2, 16), np.float16), np.ones((6, 16), np.float16), [2, 3], np.float16)
    assert "Linear node 'lin': activation 'swiglu' is implemented for float32 only, X 'x' is float16. Remedy: " \
           "Linear without activation, then ortkv.SwiGLU" in msg and same
    with pytest.raises(Exception, match=r"Linear node 'lin': attribute activation='gelu' must be 'none' or 'swiglu'"):
        session(linear_model(16, 8, [1, 16], w=np.ones((8, 16), np.float32), activation="gelu"))


def test_graph_checker_swiglu_rule():
    """op_rules: Y [..., N / 2] with activation swiglu (a consumer of K = N / 2 checks clean), odd N named."""
    from ortkv.graph import check

    ok = check(linear_model(16, 24, ["b", 16], w=np.zeros((24, 16), np.float32), activation="swiglu"), plan=False)
    assert not [f for f in ok.findings if f.severity == "error"], ok.findings
    odd = check(linear_model(16, 7, ["b", 16], w=np.zeros((7, 16), np.float32), activation="swiglu"), plan=False)
    assert any("Linear node 'lin': activation 'swiglu' needs W 'w' to have an even N (gate rows, then as many up "
               "rows); N = 7" in f.message for f in odd.findings), odd.findings
    bad = check(linear_model(16, 8, ["b", 16], w=np.zeros((8, 16), np.float32), activation="gelu"), plan=False)
    assert any("activation" in f.message and "gelu" in f.message for f in bad.findings), bad.findings

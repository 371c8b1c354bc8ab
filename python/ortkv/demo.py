"""``ortkv demo``: one attention decoder layer, decoded step by step two ways on the same weights.

* ortkv: K/V caches of fixed capacity are READ_WRITE graph inputs, written in place by CacheUpdate
  and read in place by attention written in standard ONNX ops (scores = K @ q^T, a mask of the
  positions not yet written, softmax, V weighted). Cache bytes never move, nothing cache-sized is
  allocated per step.
* copy: the classic past/present model: present = Concat(past, new), fed back as the next past.

Both start from the same context of ``context`` tokens (as if a prompt had been prefilled) and decode
``steps`` tokens; the worker of each variant runs in its own process so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from .graph import make_cache_update, mark_mutable, set_alias_of


@dataclass
class DemoConfig:
    batch: int = 4
    heads: int = 8
    head_size: int = 64
    context: int = 512  # tokens already in the cache when decoding starts
    steps: int = 512  # decode steps
    capacity: int = 0  # ortkv cache capacity; 0 = context + steps
    seed: int = 0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def cap(self) -> int:
        return self.capacity or (self.context + self.steps)

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.batch * self.heads * tokens * self.head_size * 4

    @classmethod
    def for_cache_mib(cls, mib: int, steps: int = 64, **kw) -> "DemoConfig":
        """A config whose ortkv K+V caches take ``mib`` MiB, decoding ``steps`` tokens at the end."""
        cfg = cls(steps=steps, **kw)
        cap = mib * (1 << 20) // cfg.kv_bytes(1)
        cfg.capacity, cfg.context = cap, cap - steps
        return cfg


def _weights(cfg: DemoConfig):
    rng = np.random.default_rng(cfg.seed)
    d = cfg.hidden
    return {n: (rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32) for n in ("Wq", "Wk", "Wv", "Wo")}


def build_decoder_layer(cfg: DemoConfig, variant: str) -> onnx.ModelProto:
    """One attention layer over T new tokens (T=1 when decoding), variant 'ortkv' or 'copy'."""
    B, H, Dh, D = cfg.batch, cfg.heads, cfg.head_size, cfg.hidden
    nodes, inits = [], [numpy_helper.from_array(w, n) for n, w in _weights(cfg).items()]
    c = lambda name, arr: inits.append(numpy_helper.from_array(np.asarray(arr), name))  # noqa: E731
    c("shape_bthd", np.array([B, -1, H, Dh], np.int64))
    c("shape_btd", np.array([B, -1, D], np.int64))
    c("scale", np.array(1.0 / math.sqrt(Dh), np.float32))
    c("neg_inf", np.array(-np.inf, np.float32))
    c("zero", np.array(0, np.int64))
    c("one", np.array(1, np.int64))
    c("axis2", np.array([2], np.int64))
    n = lambda *a, **k: nodes.append(helper.make_node(*a, **k))  # noqa: E731
    for proj in ("q", "k", "v"):  # x [B,T,D] -> [B,H,T,Dh]
        n("MatMul", ["x", f"W{proj}"], [f"{proj}_flat"])
        n("Reshape", [f"{proj}_flat", "shape_bthd"], [f"{proj}_bthd"])
        n("Transpose", [f"{proj}_bthd"], [f"{proj}_new"], perm=[0, 2, 1, 3])
    if variant == "ortkv":
        nodes.append(make_cache_update("k_cache", "k_new", "position", "k_cache_out", name="update_k"))
        nodes.append(make_cache_update("v_cache", "v_new", "position", "v_cache_out", name="update_v"))
        keys, vals, start = "k_cache_out", "v_cache_out", "position"
    elif variant == "copy":
        n("Concat", ["past_k", "k_new"], ["present_k"], axis=2)
        n("Concat", ["past_v", "v_new"], ["present_v"], axis=2)
        n("Shape", ["past_k"], ["past_shape"])
        n("Gather", ["past_shape", "axis2"], ["past_len1"], axis=0)
        n("Squeeze", ["past_len1"], ["past_len"])
        keys, vals, start = "present_k", "present_v", "past_len"
    else:
        raise ValueError(f"variant must be 'ortkv' or 'copy', not {variant!r}")
    # scores^T = K @ q^T : [B,H,S,T] (S = cache length); the cache is read where it lies.
    n("Transpose", ["q_new"], ["q_t"], perm=[0, 1, 3, 2])
    n("MatMul", [keys, "q_t"], ["scores_raw"])
    n("Mul", ["scores_raw", "scale"], ["scores"])
    # mask: key position s is visible to new token t iff s <= start + t
    n("Shape", [keys], ["keys_shape"])
    n("Gather", ["keys_shape", "axis2"], ["s_len1"], axis=0)
    n("Squeeze", ["s_len1"], ["s_len"])
    n("Shape", ["q_new"], ["q_shape"])
    n("Gather", ["q_shape", "axis2"], ["t_len1"], axis=0)
    n("Squeeze", ["t_len1"], ["t_len"])
    n("Range", ["zero", "s_len", "one"], ["s_idx"])
    n("Unsqueeze", ["s_idx", "one"], ["s_col"])  # [S,1]
    n("Range", ["zero", "t_len", "one"], ["t_idx"])
    n("Add", ["t_idx", start], ["t_pos"])  # [T]
    n("LessOrEqual", ["s_col", "t_pos"], ["visible"])  # [S,T]
    n("Where", ["visible", "scores", "neg_inf"], ["scores_masked"])
    n("Softmax", ["scores_masked"], ["probs_t"], axis=2)
    n("Transpose", ["probs_t"], ["probs"], perm=[0, 1, 3, 2])  # [B,H,T,S]
    n("MatMul", ["probs", vals], ["ctx"])  # [B,H,T,Dh]
    n("Transpose", ["ctx"], ["ctx_bthd"], perm=[0, 2, 1, 3])
    n("Reshape", ["ctx_bthd", "shape_btd"], ["ctx_flat"])
    n("MatMul", ["ctx_flat", "Wo"], ["y"])

    x = helper.make_tensor_value_info("x", TP.FLOAT, [B, "T", D])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [B, "T", D])
    if variant == "ortkv":
        kv = [B, H, cfg.cap, Dh]
        inputs = [x, helper.make_tensor_value_info("position", TP.INT64, []),
                  helper.make_tensor_value_info("k_cache", TP.FLOAT, kv),
                  helper.make_tensor_value_info("v_cache", TP.FLOAT, kv)]
        outputs = [y, helper.make_tensor_value_info("k_cache_out", TP.FLOAT, kv),
                   helper.make_tensor_value_info("v_cache_out", TP.FLOAT, kv)]
    else:
        inputs = [x, helper.make_tensor_value_info("past_k", TP.FLOAT, [B, H, "P", Dh]),
                  helper.make_tensor_value_info("past_v", TP.FLOAT, [B, H, "P", Dh])]
        outputs = [y, helper.make_tensor_value_info("present_k", TP.FLOAT, [B, H, "P1", Dh]),
                   helper.make_tensor_value_info("present_v", TP.FLOAT, [B, H, "P1", Dh])]
    graph = helper.make_graph(nodes, f"decoder_layer_{variant}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortkv", 1)],
                              ir_version=10, producer_name="ortkv.demo")
    if variant == "ortkv":
        for cache, out in (("k_cache", "k_cache_out"), ("v_cache", "v_cache_out")):
            mark_mutable(model, cache)
            set_alias_of(model, out, cache)
    return model


def _context_kv(cfg: DemoConfig):
    rng = np.random.default_rng(cfg.seed + 1)
    shape = (cfg.batch, cfg.heads, cfg.context, cfg.head_size)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def _inputs(cfg: DemoConfig, step: int) -> np.ndarray:
    return np.random.default_rng(cfg.seed + 1000 + step).standard_normal((cfg.batch, 1, cfg.hidden), dtype=np.float32)


def run_variant(cfg: DemoConfig, variant: str) -> dict:
    """Decode cfg.steps tokens with one variant in this process; returns its measurements."""
    import onnxruntime as ort

    from . import MutableCacheSession
    from ._memory import peak_rss_bytes, reset_peak, rss_bytes

    model = build_decoder_layer(cfg, variant)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 0
    rss_load = rss_bytes()
    k_ctx, v_ctx = _context_kv(cfg)
    if variant == "ortkv":
        sess = MutableCacheSession(model, sess_options=so, providers=["CPUExecutionProvider"])
        shape = (cfg.batch, cfg.heads, cfg.cap, cfg.head_size)
        # Full capacity, every page resident (np.zeros alone would leave untouched pages lazy).
        k_cache, v_cache = np.empty(shape, np.float32), np.empty(shape, np.float32)
        k_cache.fill(0)
        v_cache.fill(0)
        k_cache[:, :, : cfg.context], v_cache[:, :, : cfg.context] = k_ctx, v_ctx
        sess.bind_cache("k_cache", k_cache)
        sess.bind_cache("v_cache", v_cache)
        ptrs = (k_cache.ctypes.data, v_cache.ctypes.data)
        kv_alloc = k_cache.nbytes + v_cache.nbytes

        def step(i):
            (y,) = sess.run(["y"], {"x": _inputs(cfg, i), "position": np.array(cfg.context + i, np.int64)})
            return y
    else:
        from onnxruntime import InferenceSession

        sess = InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        state = {"k": k_ctx, "v": v_ctx}

        def step(i):
            y, state["k"], state["v"] = sess.run(None, {"x": _inputs(cfg, i), "past_k": state["k"], "past_v": state["v"]})
            return y
    del k_ctx, v_ctx
    rss_start = rss_bytes()
    reset_ok = reset_peak()
    t0 = time.perf_counter()
    ys = [step(i) for i in range(cfg.steps)]
    elapsed = time.perf_counter() - t0
    peak = peak_rss_bytes()
    if variant == "ortkv":
        assert (k_cache.ctypes.data, v_cache.ctypes.data) == ptrs
        kv_held = kv_alloc
    else:
        kv_alloc = kv_held = state["k"].nbytes + state["v"].nbytes
    return {
        "variant": variant,
        "steps": cfg.steps,
        "tokens_per_s": cfg.steps * cfg.batch / elapsed,
        "ms_per_step": 1000 * elapsed / cfg.steps,
        "kv_bytes": kv_held,
        "kv_valid_bytes": cfg.kv_bytes(cfg.context + cfg.steps),
        "rss_after_load": rss_start - rss_load,
        "peak_rss_growth_decode": (peak - rss_start) if reset_ok else None,
        "y_last": ys[-1].ravel()[:8].tolist(),
        "y_checksum": float(np.sum(np.stack(ys).astype(np.float64))),
    }


def run_in_subprocess(cfg: DemoConfig, variant: str) -> dict:
    cmd = [sys.executable, "-m", "ortkv.demo", "--worker", variant, "--config", json.dumps(asdict(cfg))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"demo worker '{variant}' failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / (1 << 20):8.1f} MiB"


def compare(cfg: DemoConfig, out=print) -> dict:
    out(f"ortkv demo: one attention layer, batch {cfg.batch}, {cfg.heads} heads x {cfg.head_size}, float32; "
        f"{cfg.context} context tokens, {cfg.steps} decode steps (ortkv cache capacity {cfg.cap} tokens)")
    res = {v: run_in_subprocess(cfg, v) for v in ("ortkv", "copy")}
    o, c = res["ortkv"], res["copy"]
    out(f"{'':28}{'ortkv (in place)':>20}{'copy (Concat)':>20}")
    out(f"{'KV cache bytes':28}{_mib(o['kv_bytes']):>20}{_mib(c['kv_bytes']):>20}")
    out(f"{'peak RSS growth in decode':28}{_mib(o['peak_rss_growth_decode']):>20}{_mib(c['peak_rss_growth_decode']):>20}")
    out(f"{'decode tokens/s':28}{o['tokens_per_s']:>20.1f}{c['tokens_per_s']:>20.1f}")
    out(f"{'ms per step':28}{o['ms_per_step']:>20.2f}{c['ms_per_step']:>20.2f}")
    diff = max(abs(a - b) for a, b in zip(o["y_last"], c["y_last"]))
    rel = abs(o["y_checksum"] - c["y_checksum"]) / max(1.0, abs(c["y_checksum"]))
    out(f"same outputs: max |dy| on the last step {diff:.2e}, checksum rel. diff {rel:.2e}; "
        f"speed ratio ortkv/copy {o['tokens_per_s'] / c['tokens_per_s']:.2f}x")
    res["max_abs_diff_last"] = diff
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortkv demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=DemoConfig.batch)
    p.add_argument("--heads", type=int, default=DemoConfig.heads)
    p.add_argument("--head-size", type=int, default=DemoConfig.head_size)
    p.add_argument("--context", type=int, default=DemoConfig.context)
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--cache-mib", type=int, default=0, help="size the ortkv K+V caches to this many MiB "
                   "(context = capacity - steps)")
    p.add_argument("--worker", choices=["ortkv", "copy"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(run_variant(DemoConfig(**json.loads(a.config)), a.worker)))
        return 0
    kw = dict(batch=a.batch, heads=a.heads, head_size=a.head_size)
    cfg = DemoConfig.for_cache_mib(a.cache_mib, steps=a.steps, **kw) if a.cache_mib else \
        DemoConfig(context=a.context, steps=a.steps, **kw)
    compare(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

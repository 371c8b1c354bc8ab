"""ONNX decoders of a llama-architecture model, three ways, on the same weights:

* ``ortkv``: per layer K and V caches [B, kv_heads, capacity, head_size] (BNSH; BSNH on request) are
  READ_WRITE graph inputs; CacheUpdate writes the new tokens at each row's position and CacheAttention reads the
  valid prefix in place. Inputs: input_ids [B, T], positions [B] (each row's length before the block).
* ``genai``: onnxruntime-genai's decoder format (input_ids, attention_mask, position_ids,
  past_key_values.N.key/value -> logits, present.N.key/value, BNSH) with com.microsoft
  GroupQueryAttention, which writes in place when past and present share a buffer.
* ``copy``: the same interface as ``genai``, attention in plain ONNX ops with present = Concat(past, new).

Shared by all three: Gather embedding, SimplifiedLayerNormalization, MatMul projections,
com.microsoft RotaryEmbedding (interleaved: llama.cpp's Q/K row order), SwiGLU MLP, tied LM head.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from ..errors import OrtkvError
from ..graph import make_cache_attention, make_cache_update, mark_mutable, set_alias_of
from .config import MAX_POSITIONS
from .weights import LlamaWeights, Q4Weight

VARIANTS = ("ortkv", "genai", "copy")
IR_VERSION = 10
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("ortkv", 1)]


def genai_names(i: int) -> tuple[str, str, str, str]:
    return f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value"


def ortkv_names(i: int) -> tuple[str, str, str, str]:
    return f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}"


class _Graph:
    def __init__(self):
        self.nodes, self.inits = [], []
        self._n = 0

    def init(self, name: str, array) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs, outputs=None, domain: str = "", name: str | None = None, **attrs):
        self._n += 1
        name = name or f"{op_type}_{self._n}"
        outputs = outputs or [f"{name}_out"]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def rope_tables(cfg, rows: int) -> tuple[np.ndarray, np.ndarray]:
    inv = cfg.rope_theta ** (-np.arange(0, cfg.head_size, 2, dtype=np.float64) / cfg.head_size)
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def build(weights: LlamaWeights, variant: str, max_positions: int | None = None,
          cache_layout: str = "BNSH") -> onnx.ModelProto:
    """cache_layout (ortkv variant): BNSH [B, kv_heads, capacity, D] (each head's keys contiguous: the
    fastest for CacheAttention on CPU) or BSNH [B, capacity, kv_heads, D] (token-major per row: the
    fewest committed bytes with large granules)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    if cache_layout not in ("BNSH", "BSNH"):
        raise ValueError(f"cache_layout must be BNSH or BSNH, not {cache_layout!r}")
    bnsh = cache_layout == "BNSH"
    cfg = weights.config
    H, Hkv, D, E = cfg.heads, cfg.kv_heads, cfg.head_size, cfg.hidden
    g = _Graph()
    # Note [Rotary rows]: the table covers the positions a generation can reach (max_positions, the cap
    # on search.max_length), not the GGUF's context_length: that number comes from the file, and 2**26
    # of it would be a 16 GiB table.
    rows = cfg.context_length if max_positions is None else max_positions
    if not 1 <= rows <= MAX_POSITIONS:
        raise OrtkvError(f"rotary table of {rows} positions: pass max_positions between 1 and {MAX_POSITIONS} "
                         f"(the GGUF's context_length is {cfg.context_length})")
    cos, sin = rope_tables(cfg, rows)
    g.init("rope_cos", cos)
    g.init("rope_sin", sin)
    g.init("embed", weights.embed)
    g.init("lm_head", np.ascontiguousarray(weights.embed.T))
    g.init("final_norm", weights.final_norm)
    g.init("shape_kv", np.array([0, 0, Hkv, D], np.int64))
    g.init("zero", np.array(0, np.int64))
    g.init("one", np.array(1, np.int64))
    g.init("axis1", np.array([1], np.int64))

    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", "seq", cfg.vocab])]
    if variant == "ortkv":
        inputs.append(helper.make_tensor_value_info("positions", TP.INT64, ["batch"]))
        # position_ids [B, T] = positions[:, None] + arange(T)
        seq = g.op("Gather", [g.op("Shape", ["input_ids"]), "one"], axis=0)
        rng = g.op("Range", ["zero", seq, "one"])
        pos_ids = g.op("Add", [g.op("Unsqueeze", ["positions", "axis1"]), rng])
    else:
        inputs += [helper.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total_seq"]),
                   helper.make_tensor_value_info("position_ids", TP.INT64, ["batch", "seq"])]
        pos_ids = "position_ids"
        if variant == "genai":
            seqlens = g.op("Sub", [g.op("ReduceSum", ["attention_mask", "axis1"], keepdims=0), "one"])
            g.op("Cast", [seqlens], ["seqlens_k"], to=TP.INT32)
            total = g.op("Gather", [g.op("Shape", ["attention_mask"]), "one"], axis=0)
            g.op("Cast", [total], ["total_seq_len"], to=TP.INT32)
        else:  # copy: additive mask [B, 1, 1, T, P+T] from padding and causality
            g.init("neg_inf", np.array(-np.inf, np.float32))
            g.init("zero_f", np.array(0, np.float32))
            total = g.op("Gather", [g.op("Shape", ["attention_mask"]), "one"], axis=0)
            seq = g.op("Gather", [g.op("Shape", ["input_ids"]), "one"], axis=0)
            past = g.op("Sub", [total, seq])
            key_idx = g.op("Range", ["zero", total, "one"])  # [S]
            q_idx = g.op("Add", [g.op("Range", ["zero", seq, "one"]), past])  # [T]
            causal = g.op("LessOrEqual", [key_idx, g.op("Unsqueeze", [q_idx, "axis1"])])  # [T, S]
            g.init("axes_mask", np.array([1, 2], np.int64))
            pad = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=TP.BOOL), "axes_mask"])  # [B,1,1,S]
            visible = g.op("And", [causal, pad])  # [B, 1, T, S]
            # rows of the grouped scores are (query head in group, token): repeat the mask per group
            g.init("mask_repeats", np.array([1, 1, H // Hkv, 1], np.int64))
            g.op("Tile", [g.op("Where", [visible, "zero_f", "neg_inf"]), "mask_repeats"], ["mask"])  # [B,1,G*T,S]
            g.init("shape_grouped_q", np.array([0, Hkv, -1, D], np.int64))  # [B, Hkv, G*T, D]
            g.init("shape_bhtd", np.array([0, H, -1, D], np.int64))
            g.init("shape_q", np.array([0, 0, H, D], np.int64))
            g.init("shape_e", np.array([0, 0, E], np.int64))

    def matmul(x, name, w):
        """x @ W: MatMul on float32 [in, out], or MatMulNBits on a Q4Weight."""
        if isinstance(w, Q4Weight):
            g.init(name + "_q4", w.packed)
            g.init(name + "_scales", w.scales)
            g.init(name + "_zp", w.zero_points)
            return g.op("MatMulNBits", [x, name + "_q4", name + "_scales", name + "_zp"], domain="com.microsoft",
                        K=w.K, N=w.N, bits=4, block_size=32)
        return g.op("MatMul", [x, g.init(name, w)])

    x = g.op("Gather", ["embed", "input_ids"], axis=0)
    for i, lw in enumerate(weights.layers):
        p = f"l{i}_"
        for k in ("attn_norm", "ffn_norm"):
            g.init(p + k, lw[k])
        h = g.op("SimplifiedLayerNormalization", [x, p + "attn_norm"], axis=-1, epsilon=cfg.rms_eps)
        q = g.op("RotaryEmbedding", [matmul(h, p + "wq", lw["wq"]), pos_ids, "rope_cos", "rope_sin"],
                 domain="com.microsoft", interleaved=1, num_heads=H)
        k = g.op("RotaryEmbedding", [matmul(h, p + "wk", lw["wk"]), pos_ids, "rope_cos", "rope_sin"],
                 domain="com.microsoft", interleaved=1, num_heads=Hkv)
        v = matmul(h, p + "wv", lw["wv"])
        if variant == "ortkv":
            past_k, past_v, pres_k, pres_v = ortkv_names(i)
            kv_shape = ["batch", Hkv, "capacity", D] if bnsh else ["batch", "capacity", Hkv, D]
            axis = 2 if bnsh else 1

            def new_tokens(t):  # [B, T, Hkv*D] -> the cache's layout (only the new tokens move)
                t = g.op("Reshape", [t, "shape_kv"])
                return g.op("Transpose", [t], perm=[0, 2, 1, 3]) if bnsh else t

            g.nodes.append(make_cache_update(past_k, new_tokens(k), "positions", pres_k, name=f"update_k_{i}",
                                             seq_axis=axis))
            g.nodes.append(make_cache_update(past_v, new_tokens(v), "positions", pres_v, name=f"update_v_{i}",
                                             seq_axis=axis))
            attn = p + "attn"
            g.nodes.append(make_cache_attention(q, pres_k, pres_v, "positions", attn, name=f"attention_{i}",
                                                num_heads=H, kv_num_heads=Hkv, seq_axis=axis))
        else:
            past_k, past_v, pres_k, pres_v = genai_names(i)
            kv_shape = ["batch", Hkv, "past_seq", D]
            if variant == "genai":
                attn = g.op("GroupQueryAttention", [q, k, v, past_k, past_v, "seqlens_k", "total_seq_len"],
                            [p + "attn", pres_k, pres_v], domain="com.microsoft", num_heads=H, kv_num_heads=Hkv,
                            name=f"attention_{i}")[0]
            else:
                to_bnsh = lambda t, shape: g.op("Transpose", [g.op("Reshape", [t, shape])], perm=[0, 2, 1, 3])  # noqa
                g.op("Concat", [past_k, to_bnsh(k, "shape_kv")], [pres_k], axis=2)
                g.op("Concat", [past_v, to_bnsh(v, "shape_kv")], [pres_v], axis=2)
                qg = g.op("Reshape", [to_bnsh(q, "shape_q"), "shape_grouped_q"])  # [B, Hkv, G*T, D]
                scores = g.op("MatMul", [qg, g.op("Transpose", [pres_k], perm=[0, 1, 3, 2])])
                scores = g.op("Mul", [scores, g.init(p + "scale", np.array(1 / math.sqrt(D), np.float32))])
                probs = g.op("Softmax", [g.op("Add", [scores, "mask"])], axis=-1)  # [B, Hkv, G*T, S]
                ctx = g.op("Reshape", [g.op("MatMul", [probs, pres_v]), "shape_bhtd"])  # [B, H, T, D]
                ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), "shape_e"])
                attn = ctx
        inputs += [helper.make_tensor_value_info(past_k, TP.FLOAT, kv_shape),
                   helper.make_tensor_value_info(past_v, TP.FLOAT, kv_shape)]
        out_shape = kv_shape if variant == "ortkv" else ["batch", Hkv, "total_seq", D]
        outputs += [helper.make_tensor_value_info(pres_k, TP.FLOAT, out_shape),
                    helper.make_tensor_value_info(pres_v, TP.FLOAT, out_shape)]
        x = g.op("Add", [x, matmul(attn, p + "wo", lw["wo"])])
        h2 = g.op("SimplifiedLayerNormalization", [x, p + "ffn_norm"], axis=-1, epsilon=cfg.rms_eps)
        gate = matmul(h2, p + "wg", lw["wg"])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), matmul(h2, p + "wu", lw["wu"])])
        x = g.op("Add", [x, matmul(act, p + "wd", lw["wd"])])
    xn = g.op("SimplifiedLayerNormalization", [x, "final_norm"], axis=-1, epsilon=cfg.rms_eps)
    g.op("MatMul", [xn, "lm_head"], ["logits"])
    graph = helper.make_graph(g.nodes, f"smollm2_{variant}", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION, producer_name="ortkv.generate")
    if variant == "ortkv":
        for i in range(cfg.layers):
            past_k, past_v, pres_k, pres_v = ortkv_names(i)
            for past, pres in ((past_k, pres_k), (past_v, pres_v)):
                mark_mutable(model, past)
                set_alias_of(model, pres, past)
    return model

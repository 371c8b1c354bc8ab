"""ONNX decoders of a llama-architecture model, three ways, on the same weights:

* ``ortkv``: per layer K and V caches [B, kv_heads, capacity, head_size] (BNSH; BSNH on request) are
  READ_WRITE graph inputs; CacheUpdate writes the new tokens at each row's position and CacheAttention reads the
  valid prefix in place. Inputs: input_ids [B, T], positions [B] (each row's length before the block), and
  optionally logits_start [1] (default 0): logits [B, T - logits_start, V] (Note [Logits from logits_start]).
* ``genai``: onnxruntime-genai's decoder format (input_ids, attention_mask, position_ids,
  past_key_values.N.key/value -> logits, present.N.key/value, BNSH) with com.microsoft
  GroupQueryAttention, which writes in place when past and present share a buffer.
* ``copy``: the same interface as ``genai``, attention in plain ONNX ops with present = Concat(past, new), and
  the ortkv decoder's optional logits_start.

Shared by all three: Gather embedding, SimplifiedLayerNormalization, MatMul projections,
com.microsoft RotaryEmbedding (interleaved: llama.cpp's Q/K row order), SwiGLU MLP, tied LM head.
With q4 weights: ortkv.MatMulQ4 (the Q4_1 projections; genai: MatMulNBits + the minimum term), MatMulNBits (8-bit
LM head) and GatherBlockQuantized (8-bit embedding);
q8 weights: the same with 8-bit projections (Note [8-bit from Q4_1] in weights.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from ..errors import OrtkvError
from ..graph import (make_cache_attention, make_cache_update, make_rotary_cache_update, make_swiglu, mark_mutable,
                     set_alias_of)
from .config import MAX_POSITIONS
from .weights import LlamaWeights, Q4Weight, concat_n, pack_matmul_q4

VARIANTS = ("ortkv", "genai", "copy")
LOGITS_START = "logits_start"  # Note [Logits from logits_start]
LOGITS_SEQ = "logits_seq"      # the logits' position dim: seq - logits_start
IR_VERSION = 10
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations (Note [Fast 4-bit path] in weights.py)
ACCURACY_LEVEL_DOWN = 0  # ffn_down: float activations (Note [Accuracy levels])

# Note [Accuracy levels]
# accuracy_level 4 quantizes MatMulNBits' activations to int8 per block (the VNNI kernels); 0 keeps them
# float32 (slower). Teacher-forced top-1 agreement with llama.cpp (224 positions, SmolLM2-135M, float32
# weights: 216/224 = 96.4 %): every 4-bit matrix at level 4: 211/224 = 94.2 %; every one at 0: 216/224;
# level 0 for ffn_down only: 215/224 = 96.0 % at most of level 4's speed. ffn_down reads the SwiGLU
# product, the activation of the widest range (its int8 blocks lose the most). The 8-bit LM head stays at
# level 4: level 0 has no fast 8-bit kernel (~240 ms a token). A few near ties decide these figures.

# Note [Fused q4 projections]
# With q4 weights Q, K and V are one MatMulQ4 (MatMulNBits in the genai form) of N = 576 + 192 + 192 and gate /
# up another (N = 2 x 1536), each followed by a Split: fewer, larger kernels (in the genai form one blocksum /
# minimum term each, Note [Fast 4-bit path]), which matters at one token per step where per-node overhead is a
# large part of the time.
# Note [Block sums as a MatMul]
# (The MatMulNBits form of q4, genai's; MatMulQ4 sums each block of x itself.)
# Q4_1's minimum term needs x summed over each block of 32 (Note [Fast 4-bit path] in weights.py): as
# Reshape [.., K / 32, 32] + ReduceSum, two nodes per projection input (120 of a SmolLM2 decode step's
# ~1,060). Tried: one MatMul with a 0/1 matrix [K, K / 32] instead (120 nodes fewer). Teacher-forced top-1
# agreement with llama.cpp fell from 215/224 to 206/224 (92 %, under the 95 % bar). Not explained yet:
# x * 1.0 is exact and only the order of the additions differs; a suspect is that the minimum term and
# the MatMulNBits term nearly cancel (m ~ -8 d), which magnifies any rounding difference, with the near
# ties of Note [Accuracy levels]. So the block sums stay Reshape + ReduceSum.

# Note [Fused decoder layer]
# One decode step is ~30 layers of small kernels, and at one token per step ORT's cost per node (~5-10 us
# between kernels on this kind of CPU) is a large share of the step (benchmarks/profile_decode.py). So:
# * each residual add and the RMSNorm after it are ONE com.microsoft.SkipSimplifiedLayerNormalization
#   (output 0: the normalized sum for the next projection; output 3: the sum, the residual stream): the
#   attention output enters the ffn norm, the MLP output enters the NEXT layer's attn norm, and after the
#   last layer the final norm (whose sum nobody reads). Only layer 0's attn norm stays a plain
#   SimplifiedLayerNormalization. 4 nodes per layer become 2. FLOAT weights only: with the q4 weights
#   the fused norm (its own float arithmetic, not Add's + SimplifiedLayerNormalization's) changed the
#   greedy continuation of the README prompt ("... 2018-01-22 12:12:53." became "... 2017-01-22
#   12:12:12."; teacher-forced agreement stayed >= 95 %), so the q4 graphs keep Add +
#   SimplifiedLayerNormalization (their 4-bit projections were fused already) until that is accepted.
#   The q8 graphs (Note [8-bit from Q4_1] in weights.py) too: fused, their agreement fell from 216/224 to
#   211/224 (94.2 %, under the 95 % bar). build(fused_norm=True / False) overrides this per build.
# * the float projections are fused as the q4 ones are (Note [Fused q4 projections]): [wq | wk | wv] one
#   MatMul of N = (H + 2 Hkv) D and [wg | wu] one of N = 2 ffn, each followed by a Split: one larger GEMM
#   instead of three (two), the same weight bytes read once.
# float32: greedy tokens identical to the unfused graph's on the README prompt and "Once upon a time, there
# was a little robot who" (128 new tokens each), and the three variants agree (tests/test_generate.py).
# Note [Fused ortkv layer]
# The ortkv decoder's attention input is ONE ortkv.RotaryCacheUpdate per layer (Note [RotaryCacheUpdate] in
# custom_ops/include/ortkv/rotary_cache_update.h): the fused QKV MatMul's output goes in as it is, q comes out
# rotated, and rotated k and plain v are written into the caches where CacheUpdate wrote them; it replaces Split,
# two RotaryEmbedding, the position_ids subgraph, and per K / V a Reshape + Transpose (BNSH, SBNH) and a
# CacheUpdate (9 nodes per layer with BNSH / SBNH caches). Its MLP activation is ONE ortkv.SwiGLU (Note [SwiGLU])
# instead of Split + Sigmoid + Mul + Mul. 13 nodes per layer become 2: SmolLM2's graph has 273 nodes instead of
# 608 (float32 BNSH; 274 / 609 float16 SBNH), on the CPU and on CUDA.
# The CPU rotary is ORT's bit for bit (Note [Rotary bit for bit]); the SwiGLU's sigmoid is exact where ORT's
# QuickGelu uses MLAS's approximation (differences below 1e-5 absolute). Float weights: the greedy tokens of the
# README prompt and the test prompts stay the same (tests/test_generate.py) and teacher-forced top-1 agreement
# with llama.cpp stays 216/224. The q4 / q8 graphs take RotaryCacheUpdate (agreement 217/224 and 216/224, as
# unfused) but keep Split + Sigmoid + Mul + Mul: with SwiGLU the q4 agreement fell to 207/224 (92 %, under the
# 95 % bar; not explained yet: a near-tie effect like Note [Block sums as a MatMul], or ORT fusing the unfused
# MLP of a MatMulNBits graph its own way). Graph nodes: q4 1,149 -> 904, q8 669 -> 424. BSNH keeps the unfused form by
# default: it is the paged decoder's base, which rewrites each CacheUpdate into a PagedCacheUpdate (Note [Paged
# decoder]); build(fused=True / False) overrides this per build. The GenAI and copy variants stay as they are
# (the baselines).
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("ortkv", 1)]


def genai_names(i: int) -> tuple[str, str, str, str]:
    return f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value"


def ortkv_names(i: int) -> tuple[str, str, str, str]:
    return f"past_key.{i}", f"past_value.{i}", f"present_key.{i}", f"present_value.{i}"


# Note [Float16 models]
# dtype float16 builds the same three graphs with every float tensor in float16: weights (the GGUF dequantized
# to float32, then rounded once to float16), rotary tables, norms, activations and K/V caches. Each op then
# has a float16 CUDA kernel in onnxruntime-gpu 1.31 (MatMul, Gather, SimplifiedLayerNormalization with a
# float16 scale, com.microsoft RotaryEmbedding and GroupQueryAttention, Softmax / Where / Tile / Concat of
# the copy model, ortkv CacheUpdate / CacheAttention); in float32 GroupQueryAttention has NO CUDA kernel and
# ORT silently places it on the CPU (23 tok/s on the H200). The logits stay a float32 output (a Cast after
# the LM head): the sampler, the GenAI comparison and the tests read float32, and only [batch, vocab] of
# them come back per decode step (192 KiB at batch 1), so the Cast costs nothing that matters. The 4-bit
# path (MatMulNBits) stays float32-only here: config refuses weights q4 with dtype float16.
FLOAT_TYPES = {"float32": (np.float32, TP.FLOAT), "float16": (np.float16, TP.FLOAT16)}
CACHE_LAYOUTS = ("BNSH", "BSNH", "SBNH")


class _PendingNorm(NamedTuple):
    """norm(x + y) * gamma, not yet computed: the Linear that reads it applies it (Note [Norm in the projection])
    and, when `sum` is a name, also outputs x + y under it."""
    x: str
    y: str
    gamma: str
    sum: str
    epsilon: float


class _Graph:
    def __init__(self, float_dtype=np.float32):
        self.nodes, self.inits = [], []
        self._n = 0
        self.float_dtype = np.dtype(float_dtype)

    def init(self, name: str, array) -> str:
        array = np.asarray(array)
        if array.dtype == np.float32 and self.float_dtype != np.float32:
            array = array.astype(self.float_dtype)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs, outputs=None, domain: str = "", name: str | None = None, **attrs):
        self._n += 1
        name = name or f"{op_type}_{self._n}"
        # None: a generated name ("" stays: an omitted optional output)
        outputs = [f"{name}_out" if o is None else o for o in outputs] if outputs else [f"{name}_out"]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs


def rope_tables(cfg, rows: int) -> tuple[np.ndarray, np.ndarray]:
    inv = cfg.rope_theta ** (-np.arange(0, cfg.head_size, 2, dtype=np.float64) / cfg.head_size)
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def build(weights: LlamaWeights, variant: str, max_positions: int | None = None,
          cache_layout: str = "BNSH", accuracy_level: int | None = None, dtype: str = "float32",
          fused_norm: bool | None = None, fused: bool | None = None, fused_mlp: bool | None = None,
          matmul_q4: bool | None = None, linear: bool | None = None) -> onnx.ModelProto:
    """cache_layout (ortkv variant): BNSH [B, kv_heads, capacity, D] (each head's keys contiguous: the
    fastest for CacheAttention on CPU), BSNH [B, capacity, kv_heads, D] (token-major per row) or SBNH
    [capacity, B, kv_heads, D] (seq_axis 0: token-major per tensor, one contiguous prefix whatever the batch,
    the fewest committed bytes with 2 MiB granules; needs kernels that take seq_axis 0). accuracy_level (q4
    weights): None for the measured choice (Note [Accuracy levels]), or one level (0 or 4) for every
    MatMulNBits (tests: 0 computes in float32). dtype: float32 or float16 (Note [Float16 models]).
    fused_norm: None for the measured choice (SkipSimplifiedLayerNormalization with float weights only, Note
    [Fused decoder layer]), or True / False for every residual add + norm. fused (ortkv variant): RotaryCacheUpdate
    and SwiGLU (Note [Fused ortkv layer]); None: with BNSH and SBNH caches, not BSNH (the paged decoder's base).
    fused_mlp (ortkv variant, float weights): the MLP's SwiGLU alone, whatever the rotary; None: as fused (the paged
    decoder asks for it: its rotary stays unfused, Note [Paged decoder]).
    matmul_q4 (q4 weights): None for the ortkv and copy variants' ortkv.MatMulQ4 projections and the genai
    variant's MatMulNBits + minimum term (onnxruntime-genai does not load ortkv's op library), or True / False for
    either form (Note [Fast 4-bit path] in weights.py). linear (float weights): None for ortkv.Linear (Note [Linear] in
    custom_ops/include/ortkv/linear.h) as every projection and the tied LM head of the float16 ortkv and copy
    decoders, MatMul elsewhere (genai: onnxruntime-genai loads no ortkv ops; float32: Linear's CUDA kernel is
    float16 / bfloat16 only, so the model cache asks for Linear where a float32 decoder runs on the CPU), or
    True / False for every variant and dtype (Note [Linear projections])."""
    if accuracy_level not in (None, 0, 4):
        raise ValueError(f"accuracy_level must be None, 0 or 4, not {accuracy_level!r}")
    level = ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    level_down = ACCURACY_LEVEL_DOWN if accuracy_level is None else accuracy_level
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, not {cache_layout!r}")
    if dtype not in FLOAT_TYPES:
        raise ValueError(f"dtype must be one of {tuple(FLOAT_TYPES)}, not {dtype!r}")
    np_float, FT = FLOAT_TYPES[dtype]
    if dtype != "float32" and (weights.embed_q is not None or
                               (weights.layers and isinstance(weights.layers[0]["wq"], Q4Weight))):
        raise OrtkvError("the 4-bit decoders are built in float32 only: load the GGUF with fmt='float32' for a "
                         "float16 model (Note [Float16 models])")
    bnsh = cache_layout == "BNSH"
    fused = variant == "ortkv" and (cache_layout != "BSNH" if fused is None else fused)  # Note [Fused ortkv layer]
    fused_mlp = fused if fused_mlp is None else variant == "ortkv" and fused_mlp
    cfg = weights.config
    H, Hkv, D, E = cfg.heads, cfg.kv_heads, cfg.head_size, cfg.hidden
    g = _Graph(np_float)
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
    eq = weights.embed_q
    # Note [Linear projections]
    # The float16 ortkv and copy decoders (the copy baseline then differs from ortkv only by its cache, as with
    # MatMulQ4) compute every float projection and the tied LM head with ortkv.Linear (Note [Linear] in
    # custom_ops/include/ortkv/linear.h): on CUDA a batch-1 step's 121 projections run our GEMV instead of
    # cuBLAS's M = 1 GEMMs (3.7 us each, ~2x their bytes' time on the H200). Linear takes W as [N, K], so each
    # projection is stored transposed once, and the LM head reads the embedding table [vocab, E] as it is:
    # no 56.6 MB transposed copy (MatMul needs lm_head = embed^T). The genai variant keeps MatMul
    # (onnxruntime-genai loads no ortkv ops: it is the baseline). The Cast to float32 logits and the greedy output
    # are unchanged. build(linear=True / False) overrides.
    # Float32: MatMul by default (Linear's CUDA kernel takes float16 / bfloat16 only), Linear on request: the model
    # cache asks for it for the float32 CPU decoders (models.linear_projections), whose Linear runs the CPU tile
    # kernel (Note [Linear CPU GEMV] in custom_ops/kernels/cpu/linear.cc), faster than ORT's MLAS MatMul at M = 1
    # (benchmarks/results/linear_cpu.md) with the same greedy tokens (benchmarks/results/weight_bound.md).
    use_linear = (dtype != "float32" and variant != "genai") if linear is None else bool(linear)
    if eq is None:
        g.init("embed", weights.embed)
        if not use_linear:
            g.init("lm_head", np.ascontiguousarray(weights.embed.T))
    g.init("final_norm", weights.final_norm)
    g.init("shape_kv", np.array([0, 0, Hkv, D], np.int64))
    g.init("zero", np.array(0, np.int64))
    g.init("one", np.array(1, np.int64))
    g.init("axis1", np.array([1], np.int64))

    inputs = [helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"])]
    # Note [Logits from logits_start]
    # A prefill needs the logits of one position per row, its last prompt token, and the LM head computed them for
    # every position: SmolLM2's tied head (V = 49,152 x E = 576) is 2 E V = 56.6 MFLOP a position against ~270 MFLOP
    # for the whole token's weights (~21 % of a short prompt's FLOPs; less at long prompts, where attention grows),
    # and on CUDA its outputs are the run's largest tensors. llama.cpp computes only the logits asked for. So the
    # decoders our runners execute (ortkv in every dtype / layout / fused form, the paged decoder built from it, the
    # copy baseline; the genai variant stays onnxruntime-genai's format) take an optional input
    #     logits_start  int64 [1], default 0:   logits [B, seq - logits_start, V],
    # logits[:, j] being position logits_start + j's: a Slice of the hidden state on axis 1 right before the head
    # (with norm_linear before the final RMSNorm, which the head's Linear applies: its two inputs are sliced; both
    # are per position, nothing else changes). The default comes from an initializer of the same name: ORT
    # (ir_version >= 4; these models are IR_VERSION 10) takes an initializer that is also a graph input as an
    # overridable default, never folds it as a constant (the Slice stays: tested with a fed value) and does not
    # require the feed, so every caller that does not feed it gets every position, bit for bit what the graph
    # without the Slice computes (tests/test_logits_start.py): teacher forcing, perplexity, logits_all, reference
    # agreement, MultiRunner.forward(all_logits=True), and each decode step (T = 1). Note [Greedy in the decoder]
    # slices the last position of these logits, the same one whatever logits_start is.
    # The runners' prefills (runners.head_start) feed min(lengths) - 1 for right-padded rows (each row's last token
    # is at lengths[b] - 1 >= that; row b's logits at lengths[b] - 1 - logits_start; equal lengths: one position a
    # row), T - 1 for the copy model's left-padded rows and for MultiRunner's runs (rows of one token count). On this
    # CPU the picked logits equal the full run's bit for bit: the head's kernels (ortkv.Linear's tiles, MLAS SGEMM,
    # the 8-bit MatMulNBits head with int8 activations per row) sum each (row, column) in an order set by K, not by
    # the number of rows (tested; a kernel that picked its order by M would differ by rounding only). ortkv.Linear's
    # one-row path keeps the tile's order on every CPU (Note [Linear row-count invariance] in linear.cc; on AMD CPUs
    # its stream differed in the last bits until 2026-12-06).
    # Cost: one Slice node (two with norm_linear) in every run, decode steps included, copying [B, T - logits_start,
    # E] floats (a decode step's [B, 1, 576]: one more small kernel of ORT's per-node overhead).
    # Measured (2-core AVX-512 VM, float32 SmolLM2 with ortkv.Linear, OrtkvRunner.prefill against the same decoder
    # without the Slice, alternated, median of 3; same logits bit for bit): 1 x 1,024 tokens 1,644 -> 1,313 ms
    # (0.80x), 1 x 2,048 3,329 -> 2,720 ms (0.82x), 4 rows of 512 / 400 / 300 / 200 tokens (logits_start 199: 313 of
    # 512 positions still computed) 2,955 -> 2,796 ms (0.95x); the decode step 18.3 ms both.
    # Memory (from the shapes, not measured): a float16 CUDA prefill of batch 8 x 4,000 tokens held the head's
    # float16 logits [8, 4000, 49152], 3.15 GB, and the float32 logits the Cast writes into the output the runner
    # binds, 6.29 GB: 9.44 GB (8.8 GiB) per session; now [8, 1, 49152] with equal lengths, 0.79 + 1.57 MB, and at
    # most [8, 4000 - min(lengths) + 1, 49152] with right padding. A float32 CPU prefill's logits: [B, T, V] float32
    # before (1 x 4,000: 786 MB), [B, 1, V] after.
    # The model check (ortkv check, ShapesContext) reads the initializer as the input's value, so its shapes and
    # memory plan are those of the default run (every position: the largest logits). ORT logs a warning at load
    # that the initializer is a graph input and no constant (the runners log errors only). ortkv.MutableCacheSession
    # binds a numpy feed of it as an OrtValue (Note [Overridable initializers] in session.py).
    head_from = variant != "genai"
    logits_seq = LOGITS_SEQ if head_from else "seq"
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", logits_seq, cfg.vocab])]  # float32 always
    if variant == "ortkv":
        inputs.append(helper.make_tensor_value_info("positions", TP.INT64, ["batch"]))
        pos_ids = None
        if not fused:  # position_ids [B, T] = positions[:, None] + arange(T) (RotaryCacheUpdate takes positions)
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
            # Note [Copy mask is finite]
            # A hidden key gets -1e4, not -inf. A left-padded row's pad queries see no key at all (the pads before
            # them are masked too): with -inf their softmax was 0 / 0 = NaN, their hidden states NaN from the first
            # layer on, and in the next layer the row's real tokens, which give those keys weight exp(-inf) = 0,
            # still multiplied 0 by NaN values: a batch of prompts of different lengths had NaN logits in every row
            # but the longest. With -1e4 a pad query averages finite values (never read: a real query's weight on a
            # hidden key is exp(-1e4 + s - max) = 0 exactly in float16 and float32 while its scores s stay within
            # ~1e4 of each other), and a row without pads computes the same bits as with -inf. -1e4 fits float16.
            g.init("neg_inf", np.array(-1e4, np.float32))  # float16 models: cast by g.init
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

    if head_from:  # Note [Logits from logits_start]: an optional input, 0 unless fed (an initializer that is an input)
        inputs.append(helper.make_tensor_value_info(LOGITS_START, TP.INT64, [1]))
        g.init(LOGITS_START, np.zeros(1, np.int64))
        g.init("logits_end", np.array([np.iinfo(np.int64).max], np.int64))

    block_sums = {}  # (x, K, block) -> x summed per block, shared by the matrices reading the same x
    g.init("split_qkv", np.array([H * D, Hkv * D, Hkv * D], np.int64))
    g.init("split_gu", np.array([cfg.ffn, cfg.ffn], np.int64))
    use_q4_op = variant != "genai" if matmul_q4 is None else bool(matmul_q4)
    # MatMulQ4's activations: one int8 term (llama.cpp's q8_1), two for accuracy_level 0 (Note [MatMulQ4 activation terms])
    q4_terms = 2 if accuracy_level == 0 else 1
    if weights.layers and isinstance(weights.layers[0]["wq"], Q4Weight) and weights.layers[0]["wq"].mins is not None \
            and not use_q4_op:
        g.init("axis_last", np.array([-1], np.int64))
        for k in sorted({E, cfg.ffn}):
            g.init(f"shape_blocks_{k}", np.array([0, 0, k // 32, 32], np.int64))

    def matmul(x, name, w, outputs=None, accuracy_level=None):
        """x @ W: MatMul on float32 [in, out]; a Q4_1 Q4Weight (minimums) as one ortkv.MatMulQ4 (Q4_1 exactly,
        int8 activations, Note [MatMulQ4 arithmetic]) unless matmul_q4 is off; other Q4Weights (and Q4_1 with
        matmul_q4 off) as MatMulNBits in MLAS's fast form: uint8 or no zero points, accuracy_level 4 (int8
        activations: VNNI / AVX512 where the CPU has them, else MLAS's own fallback; Note [Fast 4-bit path]
        in weights.py), Q4_1's minimums as blocksum(x) @ M beside it."""
        if isinstance(w, Q4Weight) and w.mins is not None and use_q4_op:
            p = pack_matmul_q4(w)
            names = [g.init(name + "_q4codes", p.codes), g.init(name + "_q4scales", p.scales),
                     g.init(name + "_q4mins", p.mins)]
            return g.op("MatMulQ4", [x, *names], outputs, domain="ortkv", K=p.K, N=p.N, act_terms=q4_terms)
        if isinstance(w, Q4Weight):
            names = [g.init(name + f"_q{w.bits}", w.packed), g.init(name + "_scales", w.scales)]
            if w.zero_points is not None:
                names.append(g.init(name + "_zp", w.zero_points))
            y = g.op("MatMulNBits", [x, *names], None if w.mins is not None else outputs, domain="com.microsoft",
                     K=w.K, N=w.N, bits=w.bits, block_size=w.block_size,
                     accuracy_level=level if accuracy_level is None else accuracy_level)
            if w.mins is None:
                return y
            # + blocksum(x) @ M: Q4_1's block minimums (Note [Fast 4-bit path] in weights.py)
            key = (x, w.K, w.block_size)
            if key not in block_sums:
                assert w.block_size == 32, "the minimums come from Q4_1, blocks of 32"
                block_sums[key] = g.op("ReduceSum", [g.op("Reshape", [x, f"shape_blocks_{w.K}"]), "axis_last"],
                                       keepdims=0)  # Note [Block sums as a MatMul]
            mins = g.op("MatMul", [block_sums[key], g.init(name + "_mins", np.ascontiguousarray(w.mins.T))])
            return g.op("Add", [y, mins], outputs)
        if use_linear:  # Note [Linear projections]: W stored transposed once, [N, K]
            return linear(x, g.init(name, np.ascontiguousarray(np.asarray(w).T)), outputs)
        return g.op("MatMul", [x, g.init(name, w)], outputs)

    def linear(x, w_name, outputs=None, **attrs):
        """ortkv.Linear of x (a tensor name, or a _PendingNorm: Note [Norm in the projection]) by W [N, K]."""
        if isinstance(x, _PendingNorm):
            outs = (outputs or [None])[:1] + ([x.sum] if x.sum else [])
            y = g.op("Linear", [x.x, w_name, x.y, x.gamma], outs, domain="ortkv", epsilon=x.epsilon, **attrs)
            return y[0] if x.sum else y
        return g.op("Linear", [x, w_name], outputs, domain="ortkv", **attrs)

    if eq is None:
        x = g.op("Gather", ["embed", "input_ids"], axis=0)
    else:
        # Note [Quantized tied embedding]: one 8-bit table [vocab, E / 32, 32] serves the lookup
        # (GatherBlockQuantized, blocks along its last axis) and the LM head (MatMulNBits: the same bytes
        # are its B [N = vocab, K blocks, 32]); only the scales are stored twice (the two ops want
        # [vocab, blocks, 1] and [vocab, blocks]). GatherBlockQuantized gives zeros for an id outside the
        # vocabulary where Gather fails: ids come from the tokenizer or the sampler.
        g.init("embed_scales_g", eq.scales[..., None])
        g.init("shape_e_embed", np.array([0, 0, E], np.int64))
        rows = g.op("GatherBlockQuantized", ["embed_q8", "input_ids", "embed_scales_g"], domain="com.microsoft",
                    bits=8, block_size=eq.block_size, gather_axis=0, quantize_axis=2)
        x = g.op("Reshape", [rows, "shape_e_embed"])
    for i, lw in enumerate(weights.layers):
        g.init(f"l{i}_attn_norm", lw["attn_norm"])
        g.init(f"l{i}_ffn_norm", lw["ffn_norm"])
    # the residual stream x enters each norm through SkipSimplifiedLayerNormalization (Note [Fused decoder layer])
    # the block-quantized graphs (q4, q8) keep Add + SimplifiedLayerNormalization unless told (fused_norm)
    quantized = bool(weights.layers) and isinstance(weights.layers[0]["wq"], Q4Weight)
    skip_norm = not quantized if fused_norm is None else fused_norm

    # Note [Norm in the projection]: a float32 decoder whose projections are ortkv.Linear (the CPU ortkv / copy
    # decoders) hands each residual add + RMSNorm to the Linear that reads its output (QKV, gate / up, the LM head):
    # Linear(x, W, skip, gamma) -> (y, x + skip) (Note [Linear norm prologue] in custom_ops/kernels/cpu/linear.cc,
    # the arithmetic of SkipSimplifiedLayerNormalization's CPU kernel), so the 60 norm nodes of a step go.
    norm_linear = use_linear and dtype == "float32" and skip_norm and not quantized

    def add_norm(x, y, gamma, out, need_sum=True):
        """(norm(x + y) * gamma, x + y): one SkipSimplifiedLayerNormalization, or Add + SimplifiedLayerNormalization;
        with norm_linear a _PendingNorm for the next projection to apply, and the name its sum output will have."""
        if norm_linear:
            pend = _PendingNorm(x, y, gamma, out + "_sum" if need_sum else "", cfg.rms_eps)
            return pend, pend.sum or None
        if not skip_norm:
            s = g.op("Add", [x, y])
            return g.op("SimplifiedLayerNormalization", [s, gamma], axis=-1, epsilon=cfg.rms_eps), s
        if not need_sum:
            return g.op("SkipSimplifiedLayerNormalization", [x, y, gamma], [out], domain="com.microsoft",
                        epsilon=cfg.rms_eps), None
        n, _, _, s = g.op("SkipSimplifiedLayerNormalization", [x, y, gamma], [out, "", "", out + "_sum"],
                          domain="com.microsoft", epsilon=cfg.rms_eps)
        return n, s

    h = g.op("SimplifiedLayerNormalization", [x, "l0_attn_norm"], axis=-1, epsilon=cfg.rms_eps) if weights.layers \
        else None
    for i, lw in enumerate(weights.layers):
        p = f"l{i}_"
        if isinstance(lw["wq"], Q4Weight):  # Note [Fused q4 projections]
            wqkv = concat_n([lw["wq"], lw["wk"], lw["wv"]])
        else:  # float: the three matrices side by side, [E, (H + 2 Hkv) D]
            wqkv = np.concatenate([lw["wq"], lw["wk"], lw["wv"]], axis=1)
        qkv = matmul(h, p + "wqkv", wqkv)
        if not fused:
            q_lin, k_lin, v = g.op("Split", [qkv, "split_qkv"], [p + "q", p + "k", p + "v"], axis=-1)
            q = g.op("RotaryEmbedding", [q_lin, pos_ids, "rope_cos", "rope_sin"],
                     domain="com.microsoft", interleaved=1, num_heads=H)
            k = g.op("RotaryEmbedding", [k_lin, pos_ids, "rope_cos", "rope_sin"],
                     domain="com.microsoft", interleaved=1, num_heads=Hkv)
        if variant == "ortkv":
            past_k, past_v, pres_k, pres_v = ortkv_names(i)
            kv_shape = {"BNSH": ["batch", Hkv, "capacity", D], "BSNH": ["batch", "capacity", Hkv, D],
                        "SBNH": ["capacity", "batch", Hkv, D]}[cache_layout]
            axis = {"BNSH": 2, "BSNH": 1, "SBNH": 0}[cache_layout]

            def new_tokens(t):  # [B, T, Hkv*D] -> the cache's layout (only the new tokens move)
                if cache_layout == "BSNH":  # taken flat, no node (Note [CacheUpdate flat values])
                    return t
                t = g.op("Reshape", [t, "shape_kv"])  # BSNH [B, T, Hkv, D]
                return g.op("Transpose", [t], perm=[0, 2, 1, 3] if bnsh else [1, 0, 2, 3])

            if fused:  # Note [Fused ortkv layer]
                q = p + "q_rot"
                g.nodes.append(make_rotary_cache_update(qkv, past_k, past_v, "positions", "rope_cos", "rope_sin", q,
                                                        pres_k, pres_v, name=f"rotary_update_{i}", num_heads=H,
                                                        kv_num_heads=Hkv, seq_axis=axis))
            else:
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
        inputs += [helper.make_tensor_value_info(past_k, FT, kv_shape),
                   helper.make_tensor_value_info(past_v, FT, kv_shape)]
        out_shape = kv_shape if variant == "ortkv" else ["batch", Hkv, "total_seq", D]
        outputs += [helper.make_tensor_value_info(pres_k, FT, out_shape),
                    helper.make_tensor_value_info(pres_v, FT, out_shape)]
        # x + attention output, and its ffn norm, in one node (outputs: normalized, -, -, the sum)
        h2, x = add_norm(x, matmul(attn, p + "wo", lw["wo"]), p + "ffn_norm", p + "ffn_in")
        wgu = (concat_n([lw["wg"], lw["wu"]]) if isinstance(lw["wg"], Q4Weight)
               else np.concatenate([lw["wg"], lw["wu"]], axis=1))
        if fused_mlp and not quantized and use_linear and dtype == "float32":
            # Note [Linear SwiGLU epilogue] in custom_ops/kernels/cpu/linear.cc: the gate / up Linear applies the
            # SwiGLU itself (CPU float32 only), W [wg; wu] stored [2 ffn, E]
            act = linear(h2, g.init(p + "wgu", np.ascontiguousarray(wgu.T)), [p + "act"], activation="swiglu")
        elif fused_mlp and not quantized:  # Note [SwiGLU]; the q4 / q8 graphs keep Split + SiLU + Mul (Note [Fused ortkv layer])
            act = p + "act"
            g.nodes.append(make_swiglu(matmul(h2, p + "wgu", wgu), act, name=f"swiglu_{i}"))
        else:
            gate, up = g.op("Split", [matmul(h2, p + "wgu", wgu), "split_gu"], [p + "gate", p + "up"], axis=-1)
            act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        # level 0 only for 4-bit ffn_down: MLAS has no fast 8-bit kernel at level 0 (Note [8-bit from Q4_1])
        down = matmul(act, p + "wd", lw["wd"],
                      accuracy_level=level_down if isinstance(lw["wd"], Q4Weight) and lw["wd"].bits == 4 else None)
        last = i == len(weights.layers) - 1
        # x + MLP output, normalized for the next layer's attention (the final norm after the last layer)
        norm_next = "final_norm" if last else f"l{i + 1}_attn_norm"
        h, x = add_norm(x, down, norm_next, p + "out_norm", need_sum=not last)
    xn = h if weights.layers else g.op("SimplifiedLayerNormalization", [x, "final_norm"], axis=-1, epsilon=cfg.rms_eps)
    value_info = []
    if head_from:  # Note [Logits from logits_start]: the head (and a norm it applies) sees positions logits_start..

        def from_start(t):
            out = g.op("Slice", [t, LOGITS_START, "logits_end", "axis1"])
            # declared, so that ORT's shape inference hands the head named dims (unnamed ones made the Linear's
            # output [-1, -1, V] fixed dims: a VerifyOutputSizes warning on every run)
            value_info.append(helper.make_tensor_value_info(out, FT, ["batch", LOGITS_SEQ, E]))
            return out

        xn = xn._replace(x=from_start(xn.x), y=from_start(xn.y)) if isinstance(xn, _PendingNorm) else from_start(xn)
    # the tied LM head: Linear on the embedding table itself, or MatMul on its transposed copy
    head = (lambda out: linear(xn, "embed", [out])) if use_linear else \
        (lambda out: g.op("MatMul", [xn, "lm_head"], [out]))
    if eq is None and dtype != "float32":
        g.op("Cast", [head("logits_" + dtype)], ["logits"], to=TP.FLOAT)
    elif eq is None:
        head("logits")
    else:
        matmul(xn, "embed", eq, ["logits"])  # initializers embed_q8 (shared with the lookup) and embed_scales
    if variant == "ortkv" and dtype != "float32":
        # Note [Greedy in the decoder]: a CUDA decode step also picks its greedy token, inside the same run
        # (and the same captured CUDA graph), instead of a second session (GreedyToken in runners.py: ~0.13 ms
        # of host time per step at batch 1 on the H200, 8 % of the step). greedy [B, 2] int64: column 0 the
        # ArgMax of the LAST position's logits (the lowest id among ties, as numpy), column 1 the first NaN's
        # token id in that row (vocab when none; ArgMax of IsNaN padded with a 0.5 column, as GreedyToken, no
        # Reduce*). Only the decode step (T = 1) reads it; a right-padded prefill's rows end at different
        # positions, so the prefill still picks through GreedyToken with each row's length.
        g.init("greedy_last", np.array([-1], np.int64))
        g.init("greedy_end", np.array([np.iinfo(np.int64).max], np.int64))
        g.init("greedy_pads", np.array([0, 0, 0, 0, 0, 1], np.int64))
        g.init("greedy_pad_value", np.array(0.5, np.float32))  # in the model's float type, as the 0 / 1 flags
        last = g.op("Slice", ["logits", "greedy_last", "greedy_end", "axis1"])  # [B, 1, V]
        pick = g.op("ArgMax", [last], axis=2, keepdims=0, select_last_index=0)  # [B, 1]
        isnan = g.op("Cast", [g.op("IsNaN", [last])], to=FT)
        nan = g.op("ArgMax", [g.op("Pad", [isnan, "greedy_pads", "greedy_pad_value"], mode="constant")], axis=2,
                   keepdims=0, select_last_index=0)
        g.op("Concat", [pick, nan], ["greedy"], axis=1)
        outputs.append(helper.make_tensor_value_info("greedy", TP.INT64, ["batch", 2]))
    name = f"smollm2_{variant}" if dtype == "float32" else f"smollm2_{variant}_{dtype}"
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits, value_info=value_info)
    model = helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION, producer_name="ortkv.generate")
    if variant == "ortkv":
        for i in range(cfg.layers):
            past_k, past_v, pres_k, pres_v = ortkv_names(i)
            for past, pres in ((past_k, pres_k), (past_v, pres_v)):
                mark_mutable(model, past)
                set_alias_of(model, pres, past)
    return model

"""Read the llama-architecture GGUF: config, tokenizer and dequantized float32 weights.

GGUF stores a matrix as [out, in] after dequantization; the ONNX graphs multiply x @ W with W as
[in, out], so matrices are transposed here once. The Q and K rows keep llama.cpp's permutation,
which makes rotary embedding rotate ADJACENT pairs: the graphs use RotaryEmbedding(interleaved=1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import OrtkvError
from .tokenizer import SmolTokenizer


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_size: int
    rms_eps: float
    rope_theta: float
    context_length: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:  # float32 K and V of every layer
        return 2 * self.layers * self.kv_heads * self.head_size * 4


# Note [Fast 4-bit path]
# Q4_1 stores w = d * q + m per block of 32 with a float16 scale d and a float16 minimum m. ORT's CPU
# MatMulNBits (MLAS) has fast kernels only for integer zero points (w = s * (q - z), z in [0, 15]), which
# carry m only when -m / d happens to be an integer; float zero points run ~10 ms for one 576 x 1536 token
# (every call dequantizes the whole weight; benchmarks/results/q4_cpu.md). Requantizing the dequantized
# values to integer zero points adds an error as large as Q4_1's own (relative RMS ~7.5 %) and dropped
# teacher-forced top-1 agreement with llama.cpp from 96.4 % to 74.1 %. So Q4_1 is kept EXACTLY:
# * the ortkv and copy decoders carry each projection as ONE ortkv.MatMulQ4 node (custom_ops/include/ortkv/
#   matmul_q4.h): the codes, d and m repacked once at build time into tiles of 16 output columns
#   (pack_matmul_q4, Note [MatMulQ4 layout]), activations quantized per block of 32 to int8 as llama.cpp's
#   q8_1, the minimum term on the dequantized activations' block sums (Note [MatMulQ4 arithmetic]), integer
#   dots on AVX512-VNNI / AVX2 / scalar (Note [MatMulQ4 dispatch]). Teacher-forced agreement with llama.cpp:
#   217/224 = 96.9 % (with the exact float sums of x in the minimum term 211/224; MLAS with every matrix at
#   accuracy_level 4 also 211, the shipped MLAS form 215). A decode step has 4 MatMulQ4 per layer and no
#   minimum-term nodes (639 nodes instead of 1,119).
# * the genai decoder (onnxruntime-genai loads no ortkv op library) keeps the MLAS form, split in two terms:
#     x @ W = MatMulNBits(x; codes q, scales d, uint8 zero points 0)  +  blocksum(x) @ M
#   where blocksum(x) [.., K / 32] sums x over each block and M [K / 32, N] holds the minimums (one blocksum
#   per projection input, shared): Reshape + ReduceSum + MatMul + Add per projection. build(matmul_q4=False)
#   gives this form to every variant.
# MatMulQ4 is a CPU kernel: config refuses weights q4 on CUDA (onnxruntime would place the nodes on the CPU and
# copy activations every step). The tied embedding / LM head is Q8_0 in the GGUF (w = d * q, q int8): that
# form IS MatMulNBits' and GatherBlockQuantized's 8-bit symmetric one (uint8 q + 128, default zero point 128),
# so it is carried exactly too (q8_from_gguf); MatMulNBits bits 8 with accuracy_level 4 is the fastest LM head
# measured (~1.5 ms against ~16 ms for float32 MatMul and ~3.6 ms at 4 bits), reading ~30 MB per token near the
# machine's bandwidth, so it stays MatMulNBits.

# Note [8-bit from Q4_1]
# weights "q8" puts every Q4_1 block on MatMulNBits' 8-bit grid (bits 8, block 32, uint8 zero points,
# accuracy_level 4: the VNNI kernels the Q8_0 LM head already uses), so that x @ W is ONE node: no
# blocksum(x) @ M term, no Reshape / ReduceSum / MatMul / Add per projection (480 of the 1,119 nodes of a
# SmolLM2 q4 decode step; 639 left). A Q4_1 block's 16 levels m + d q (q = 0..15) with m <= 0 <= m + 15 d
# (its levels straddle 0, as ggml's Q4_1 blocks of these weights do) become s = d / 17, c = 17 q,
# z = round(-17 m / d): the levels land exactly on the 256-level grid and only the minimum moves, by at most
# s / 2 = d / 34 (Q4_1's own rounding step is d). Other blocks get the plain asymmetric 8-bit rule over
# their levels' range with 0 in it (error <= s / 2 too). Teacher-forced top-1 agreement with llama.cpp:
# 216/224 = 96.4 %, as float32 weights (q4 as shipped: 215-217/224; requantizing to 4-bit zero points gave
# 74 %). Costs: 1.85x the projection bytes (123 MB instead of 66 MB per token, + the 30 MB LM head either
# way; the machine reads ~24 GB/s, benchmarks/results/weight_bound.md) and ffn_down at level 4 as well (MLAS has no fast 8-bit kernel at level 0). With
# com.microsoft.SkipSimplifiedLayerNormalization as well (Note [Fused decoder layer]) agreement fell to
# 211/224 = 94.2 %, under the 95 % bar, so q8 keeps Add + SimplifiedLayerNormalization like q4. Measured
# speed against q4 and llama.cpp: benchmarks/results/q8_cpu.md.
BLOCK = 32
WEIGHT_FORMATS = ("float32", "q4", "q8")


@dataclass
class Q4Weight:
    """A block-quantized matrix in com.microsoft.MatMulNBits' form: w[k, n] = (q - zero_point) * scale
    (+ mins[n, k // block] when given) per block of ``block_size`` along K. bits 4 (uint8 zero points,
    packed two per byte) or 8 (symmetric: no zero points, MatMulNBits' default zero point 128)."""

    packed: np.ndarray  # [N, K / block, block * bits / 8] uint8; 4 bits: byte i holds element 2i (low), 2i + 1 (high)
    scales: np.ndarray  # [N, K / block] float32
    zero_points: np.ndarray | None  # [N, ceil(K / block / 2)] uint8 (4 bits: block 2j low, 2j + 1 high), or None
    K: int
    N: int
    bits: int = 4
    block_size: int = BLOCK
    mins: np.ndarray | None = None  # [N, K / block] float32: Q4_1's block minimum m, added outside MatMulNBits

    def codes(self) -> np.ndarray:  # [N, K / block, block] integer codes
        if self.bits == 8:
            return self.packed.astype(np.int32)
        return np.stack([self.packed & 0x0F, self.packed >> 4], axis=-1).reshape(self.N, -1, self.block_size)

    def zero_point_values(self) -> np.ndarray:  # [N, K / block]
        kb = self.K // self.block_size
        if self.zero_points is None:
            return np.full((self.N, kb), 1 << (self.bits - 1), np.int32)
        if self.bits == 8:  # one byte per block
            return self.zero_points[:, :kb].astype(np.int32)
        z = np.stack([self.zero_points & 0x0F, self.zero_points >> 4], axis=-1).reshape(self.N, -1)
        return z[:, :kb].astype(np.int32)

    def dequantize(self) -> np.ndarray:  # [K, N] float32, for tests
        q = self.codes().astype(np.int32) - self.zero_point_values()[..., None]
        w = q * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.N, self.K).T.astype(np.float32)


def concat_n(ws: list[Q4Weight]) -> Q4Weight:
    """Matrices of the same K side by side along N (one MatMulNBits for several projections)."""
    a = ws[0]
    if any((w.K, w.bits, w.block_size, w.zero_points is None, w.mins is None) !=
           (a.K, a.bits, a.block_size, a.zero_points is None, a.mins is None) for w in ws):
        raise OrtkvError("concat_n: the matrices differ in K, bits, block size or zero points / minimums")
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs, axis=0)  # noqa: E731
    return Q4Weight(cat([w.packed for w in ws]), cat([w.scales for w in ws]), cat([w.zero_points for w in ws]),
                    a.K, sum(w.N for w in ws), a.bits, a.block_size, cat([w.mins for w in ws]))


def q4_from_gguf(raw: np.ndarray, n: int, k: int) -> Q4Weight:
    """ggml's block_q4_1 {f16 d; f16 m; u8 qs[16]} (qs[j]: element j low, j + 16 high), exactly: codes
    and scales d for MatMulNBits with zero points 0, minimums m beside (Note [Fast 4-bit path])."""
    blocks = np.asarray(raw).reshape(n, k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element order 0..31
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zp = np.zeros((n, (k // 32 + 1) // 2), np.uint8)
    return Q4Weight(packed, d, zp, k, n, 4, 32, mins=m)


def q8_from_gguf(raw: np.ndarray, n: int, k: int) -> Q4Weight:
    """ggml's block_q8_0 {f16 d; i8 qs[32]} as MatMulNBits / GatherBlockQuantized 8-bit symmetric blocks:
    w = d * q = d * ((q + 128) - 128), exactly (Note [Fast 4-bit path])."""
    blocks = np.asarray(raw).reshape(n, k // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    return Q4Weight(np.ascontiguousarray(q.astype(np.uint8)), d, None, k, n, 8, 32)


def q8_from_q4_1(w: Q4Weight) -> Q4Weight:
    """A Q4_1 matrix (codes q, scales d, minimums m) as MatMulNBits bits 8 with uint8 zero points, block 32:
    no minimum term (Note [8-bit from Q4_1]). Per block: the range [lo, hi] of its 16 levels [m, m + 15 d]
    with 0 in it, s = (hi - lo) / 255, z = round(-lo / s), c = round(w / s) + z. Where m <= 0 <= m + 15 d
    (a block whose levels straddle 0) this is s = d / 17, c = 17 q: the 16 levels land exactly on the
    256-level grid and only the minimum moves, by at most s / 2 = d / 34."""
    if w.bits != 4 or w.mins is None or w.block_size != BLOCK:
        raise OrtkvError(f"q8_from_q4_1 needs a Q4_1 matrix (bits 4, block {BLOCK}, minimums); got bits {w.bits}, "
                         f"block {w.block_size}, minimums {'yes' if w.mins is not None else 'no'}")
    q = w.codes().astype(np.float64)  # [N, kb, 32]
    d = w.scales.astype(np.float64)[..., None]
    m = w.mins.astype(np.float64)[..., None]
    vals = d * q + m
    lo = np.minimum(m, 0.0)  # the levels' range, not the values': the codes a block uses do not change s
    hi = np.maximum(m + 15 * d, 0.0)
    s = (hi - lo) / 255
    s = np.where(s > 0, s, 1.0)  # an all-zero block: any scale, codes = zero point
    z = np.clip(np.rint(-lo / s), 0, 255)
    c = np.clip(np.rint(vals / s) + z, 0, 255)
    return Q4Weight(c.astype(np.uint8), s[..., 0].astype(np.float32), z[..., 0].astype(np.uint8), w.K, w.N, 8,
                    BLOCK)


Q4_TILE = 16  # output columns per MatMulQ4 tile (Note [MatMulQ4 layout] in custom_ops/include/ortkv/matmul_q4.h)


@dataclass(frozen=True)
class MatMulQ4Pack:
    """A Q4_1 matrix in ortkv.MatMulQ4's kernel order (Note [MatMulQ4 layout]): codes uint8 [T, K / 32, 256],
    scales d and mins m float16 [T, K / 32, 16], T = ceil(N / 16) tiles of 16 output columns (zero-padded)."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    K: int
    N: int


def pack_matmul_q4(w: Q4Weight) -> MatMulQ4Pack:
    """Repack a Q4_1 matrix (bits 4, block 32, zero points 0, minimums) for ortkv.MatMulQ4, exactly: d and m
    were float16 in the GGUF (q4_from_gguf widened them to float32 without loss), so they go back to float16
    bit for bit; a matrix whose d or m is not a float16 value is refused (the pack would round it)."""
    if w.bits != 4 or w.block_size != BLOCK or w.mins is None:
        raise OrtkvError(f"pack_matmul_q4 needs a Q4_1 matrix (bits 4, block {BLOCK}, minimums); got bits {w.bits}, "
                         f"block {w.block_size}, minimums {'yes' if w.mins is not None else 'no'}")
    if w.K % BLOCK:
        raise OrtkvError(f"pack_matmul_q4: K={w.K} is not a multiple of {BLOCK}; MatMulQ4 takes K in whole Q4_1 blocks")
    if w.zero_points is not None and w.zero_point_values().any():
        raise OrtkvError("pack_matmul_q4: the matrix has nonzero 4-bit zero points; MatMulQ4 carries Q4_1's "
                         "w = d * q + m only (zero points 0)")
    d16, m16 = w.scales.astype(np.float16), w.mins.astype(np.float16)
    if not (np.array_equal(d16.astype(np.float32), w.scales) and np.array_equal(m16.astype(np.float32), w.mins)):
        raise OrtkvError("pack_matmul_q4: a block scale or minimum is not a float16 value; MatMulQ4 stores them as "
                         "float16 (the GGUF's Q4_1 form) and would round them")
    kb, tiles = w.K // BLOCK, -(-w.N // Q4_TILE)
    pad = tiles * Q4_TILE - w.N
    q = np.pad(w.codes().astype(np.uint8), ((0, pad), (0, 0), (0, 0)))  # [Np, kb, 32]
    # [T, 16 columns, kb, 2 halves, 4 groups, 4 bytes] -> [T, kb, 4 groups, 16 columns, 4 bytes]
    q = q.reshape(tiles, Q4_TILE, kb, 2, 4, 4)
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # element 4g + j low, 16 + 4g + j high
    codes = np.ascontiguousarray(byte.transpose(0, 2, 3, 1, 4)).reshape(tiles, kb, 256)

    def tiled(a):  # [N, kb] -> [T, kb, 16]
        a = np.pad(a, ((0, pad), (0, 0)))
        return np.ascontiguousarray(a.reshape(tiles, Q4_TILE, kb).transpose(0, 2, 1))

    return MatMulQ4Pack(codes, tiled(d16), tiled(m16), w.K, w.N)


def quantize_q8(w: np.ndarray) -> Q4Weight:
    """Q8_0's rule (d = max |w| / 127 per block of 32) for an embedding stored in another type."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    x = w.reshape(n, k // 32, 32)
    d = np.abs(x).max(-1) / 127
    q = np.rint(x / np.where(d > 0, d, 1)[..., None]).clip(-127, 127).astype(np.int16) + 128
    return Q4Weight(q.astype(np.uint8), d.astype(np.float32), None, k, n, 8, 32)


@dataclass
class LlamaWeights:
    config: LlamaConfig
    embed: np.ndarray  # [vocab, hidden]
    final_norm: np.ndarray  # [hidden]
    # MatMul weights as float32 [in, out], or Q4Weight for weights="q4" / "q8"
    layers: list[dict] = field(default_factory=list)
    format: str = "float32"
    embed_q: Q4Weight | None = None  # weights="q4" / "q8": the tied embedding / LM head, 8-bit blocks


def _reader(path):
    import gguf

    path = Path(path)
    if not path.exists():
        raise OrtkvError(f"model file {path} does not exist")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError / struct errors on a foreign file
        raise OrtkvError(f"{path} is not a readable GGUF file ({exc}); expected SmolLM2-135M-Instruct.Q4_1.gguf") from None


def read_config(reader) -> LlamaConfig:
    """The model's shape from the GGUF's metadata, validated (Note [Untrusted GGUF])."""
    f = reader.fields

    def get(key):
        if key not in f:
            raise OrtkvError(f"the GGUF has no '{key}': not a llama-architecture model")
        try:
            return f[key].contents()
        except Exception as exc:  # a malformed field: gguf raises from numpy / struct
            raise OrtkvError(f"the GGUF's '{key}' cannot be read ({exc})") from None

    def integer(key, low=1, value=None):
        value = get(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise OrtkvError(f"the GGUF's '{key}' is {value!r}; expected an integer >= {low}")
        return int(value)

    def positive(key):
        value = get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) \
                or value <= 0:
            raise OrtkvError(f"the GGUF's '{key}' is {value!r}; expected a finite number > 0")
        return float(value)

    arch = get("general.architecture")
    if arch != "llama":
        raise OrtkvError(f"the GGUF's architecture is {arch!r}; ortkv builds llama-architecture models")
    heads, kv_heads = integer("llama.attention.head_count"), integer("llama.attention.head_count_kv")
    hidden = integer("llama.embedding_length")
    if heads % kv_heads:
        raise OrtkvError(f"the GGUF's head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    if hidden % heads or (hidden // heads) % 2:
        raise OrtkvError(f"the GGUF's embedding_length {hidden} does not split into {heads} heads of an even size "
                         "(rotary embedding rotates pairs)")
    if "llama.vocab_size" in f:
        vocab = integer("llama.vocab_size")
    elif "tokenizer.ggml.tokens" in f:
        vocab = integer("tokenizer.ggml.tokens", value=len(f["tokenizer.ggml.tokens"].data))
    else:
        raise OrtkvError("the GGUF has neither 'llama.vocab_size' nor 'tokenizer.ggml.tokens'")
    return LlamaConfig(layers=integer("llama.block_count"), hidden=hidden, ffn=integer("llama.feed_forward_length"),
                       heads=heads, kv_heads=kv_heads, head_size=hidden // heads,
                       rms_eps=positive("llama.attention.layer_norm_rms_epsilon"),
                       rope_theta=positive("llama.rope.freq_base"),
                       context_length=integer("llama.context_length", low=2), vocab=vocab)


# Note [Untrusted GGUF]
# A GGUF is untrusted input: its metadata sizes everything that is built from it. Every count is checked
# to be a positive integer (zero heads used to divide by zero), the heads to group evenly and split the
# embedding into an even head size; context_length is only recorded: what is allocated from it is bounded
# elsewhere (Note [Rotary rows] in builder.py, search.max_length in config.py). Tensors are checked for
# their shapes against this metadata when read (_tensor_shape), so a truncated or inconsistent file is an
# OrtkvError naming the tensor, not a reshape error deep in numpy or ONNX.


def load(path, layers: int | None = None, log=None, fmt: str = "float32") -> tuple[LlamaWeights, SmolTokenizer]:
    """Read the GGUF: matrices dequantized to float32, or (fmt="q4") kept as Q4_1 exactly (codes, scales, minimums:
    MatMulQ4 or MatMulNBits + the minimum term, Note [Fast 4-bit path]), or (fmt="q8") the Q4_1 blocks on the 8-bit grid (Note [8-bit from Q4_1]); q4 and
    q8 carry the embedding / LM head as 8-bit blocks (Note [Fast 4-bit path]); norms are float32 either way.
    ``layers`` limits the blocks read (tests)."""
    if fmt not in WEIGHT_FORMATS:
        raise OrtkvError(f"weights format {fmt!r}: one of {', '.join(repr(f) for f in WEIGHT_FORMATS)}")
    import gguf

    t0 = time.perf_counter()
    reader = _reader(path)
    cfg = read_config(reader)
    n = cfg.layers if layers is None else min(layers, cfg.layers)
    cfg = LlamaConfig(**{**cfg.__dict__, "layers": n})
    tensors = {t.name: t for t in reader.tensors}

    E, F, Dkv = cfg.hidden, cfg.ffn, cfg.kv_heads * cfg.head_size
    shapes = {"attn_q": (E, E), "attn_k": (Dkv, E), "attn_v": (Dkv, E), "attn_output": (E, E),
              "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}  # [out, in]

    def _tensor_shape(name, shape):
        if name not in tensors:
            raise OrtkvError(f"the GGUF has no tensor '{name}'")
        t = tensors[name]
        got = tuple(int(x) for x in reversed(t.shape))  # ggml lists ne0 (the innermost) first
        if got != shape:
            raise OrtkvError(f"the GGUF's tensor '{name}' has shape {list(got)}; its metadata says {list(shape)}")
        return t

    def deq(name, shape):
        t = _tensor_shape(name, shape)
        try:
            out = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as exc:
            raise OrtkvError(f"the GGUF's tensor '{name}' cannot be dequantized ({exc})") from None
        return np.ascontiguousarray(out.reshape(shape))

    def matrix(name, shape):
        if fmt in ("q4", "q8"):  # kept exactly (Note [Fast 4-bit path]) / on the 8-bit grid (Note [8-bit from Q4_1])
            t = _tensor_shape(name, shape)
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                raise OrtkvError(f"weights '{fmt}' need Q4_1 tensors; '{name}' is {t.tensor_type.name}")
            k, n = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 = in (K), ne1 = out (N)
            q4 = q4_from_gguf(t.data, n, k)
            return q8_from_q4_1(q4) if fmt == "q8" else q4
        return np.ascontiguousarray(deq(name, shape).T)

    embed = deq("token_embd.weight", (cfg.vocab, E))
    embed_q = None
    if fmt in ("q4", "q8"):
        if E % 32:
            raise OrtkvError(f"weights '{fmt}': embedding_length {E} is not a multiple of 32 (the block size of "
                             "the 8-bit embedding / LM head); use --weights float32")
        t = tensors["token_embd.weight"]
        embed_q = (q8_from_gguf(t.data, cfg.vocab, E) if t.tensor_type == gguf.GGMLQuantizationType.Q8_0
                   else quantize_q8(embed))
    w = LlamaWeights(cfg, embed=embed, final_norm=deq("output_norm.weight", (E,)), format=fmt, embed_q=embed_q)
    for i in range(n):
        p = f"blk.{i}."
        w.layers.append({
            "attn_norm": deq(p + "attn_norm.weight", (E,)),
            "ffn_norm": deq(p + "ffn_norm.weight", (E,)),
            **{k: matrix(p + name + ".weight", shapes[name]) for k, name in
               (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
                ("wg", "ffn_gate"), ("wu", "ffn_up"), ("wd", "ffn_down"))},
        })
    if log:
        log(f"ortkv: read {n} layers of {Path(path).name} ({fmt} matrices) in {time.perf_counter() - t0:.1f} s")
    return w, SmolTokenizer.from_gguf(reader)


def load_tokenizer(path) -> SmolTokenizer:
    return SmolTokenizer.from_gguf(_reader(path))

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


@dataclass
class Q4Weight:
    """A Q4_1 matrix in com.microsoft.MatMulNBits' form (bits 4, block 32): w = (q - zero_point) * scale.
    Q4_1 stores w = d * q + m per block of 32, so scale = d and zero_point = -m / d."""

    packed: np.ndarray  # [N, K / 32, 16] uint8: byte i of a block holds element 2i (low) and 2i + 1 (high)
    scales: np.ndarray  # [N * K / 32] float32
    zero_points: np.ndarray  # [N * K / 32] float32
    K: int
    N: int

    def dequantize(self) -> np.ndarray:  # [K, N], for tests
        q = np.stack([self.packed & 0x0F, self.packed >> 4], axis=-1).reshape(self.N, self.K)
        s = np.repeat(self.scales.reshape(self.N, -1), 32, axis=1)
        z = np.repeat(self.zero_points.reshape(self.N, -1), 32, axis=1)
        return ((q - z) * s).T.astype(np.float32)


def q4_from_gguf(raw: np.ndarray, n: int, k: int) -> Q4Weight:
    """Repack ggml's block_q4_1 {f16 d; f16 m; u8 qs[16]} (qs[j]: element j low, j + 16 high)."""
    blocks = np.asarray(raw).reshape(n, k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element order 0..31
    flat = d == 0  # every element equals m: encode as q = 0, zero point -1, scale m
    q[flat] = 0
    scale = np.where(flat, m, d)
    zp = np.where(flat, -1.0, -m / np.where(flat, 1.0, d))
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return Q4Weight(packed, scale.ravel().astype(np.float32), zp.ravel().astype(np.float32), k, n)


@dataclass
class LlamaWeights:
    config: LlamaConfig
    embed: np.ndarray  # [vocab, hidden]
    final_norm: np.ndarray  # [hidden]
    # MatMul weights as float32 [in, out], or Q4Weight for weights="q4"
    layers: list[dict] = field(default_factory=list)
    format: str = "float32"


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
    """Read the GGUF: matrices dequantized to float32, or (fmt="q4") kept 4-bit for MatMulNBits;
    norms and the embedding are float32 either way. ``layers`` limits the blocks read (tests)."""
    if fmt not in ("float32", "q4"):
        raise OrtkvError(f"weights format {fmt!r}: one of 'float32', 'q4'")
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
        if fmt == "q4":
            t = _tensor_shape(name, shape)
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                raise OrtkvError(f"weights 'q4' need Q4_1 tensors; '{name}' is {t.tensor_type.name}")
            k, n = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 = in (K), ne1 = out (N)
            return q4_from_gguf(t.data, n, k)
        return np.ascontiguousarray(deq(name, shape).T)

    w = LlamaWeights(cfg, embed=deq("token_embd.weight", (cfg.vocab, E)), final_norm=deq("output_norm.weight", (E,)),
                     format=fmt)
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

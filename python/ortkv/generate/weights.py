"""Read the llama-architecture GGUF: config, tokenizer and dequantized float32 weights.

GGUF stores a matrix as [out, in] after dequantization; the ONNX graphs multiply x @ W with W as
[in, out], so matrices are transposed here once. The Q and K rows keep llama.cpp's permutation,
which makes rotary embedding rotate ADJACENT pairs: the graphs use RotaryEmbedding(interleaved=1).
"""

from __future__ import annotations

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
class LlamaWeights:
    config: LlamaConfig
    embed: np.ndarray  # [vocab, hidden]
    final_norm: np.ndarray  # [hidden]
    layers: list[dict[str, np.ndarray]] = field(default_factory=list)  # MatMul weights as [in, out]


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
    f = reader.fields

    def get(key):
        if key not in f:
            raise OrtkvError(f"the GGUF has no '{key}': not a llama-architecture model")
        return f[key].contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise OrtkvError(f"the GGUF's architecture is {arch!r}; ortkv builds llama-architecture models")
    heads = int(get("llama.attention.head_count"))
    hidden = int(get("llama.embedding_length"))
    return LlamaConfig(layers=int(get("llama.block_count")), hidden=hidden, ffn=int(get("llama.feed_forward_length")),
                       heads=heads, kv_heads=int(get("llama.attention.head_count_kv")), head_size=hidden // heads,
                       rms_eps=float(get("llama.attention.layer_norm_rms_epsilon")),
                       rope_theta=float(get("llama.rope.freq_base")),
                       context_length=int(get("llama.context_length")),
                       vocab=int(f["llama.vocab_size"].contents()) if "llama.vocab_size" in f else
                       len(f["tokenizer.ggml.tokens"].data))


def load(path, layers: int | None = None, log=None) -> tuple[LlamaWeights, SmolTokenizer]:
    """Dequantize the GGUF to float32 (``layers`` limits the blocks read, for tests)."""
    import gguf

    t0 = time.perf_counter()
    reader = _reader(path)
    cfg = read_config(reader)
    n = cfg.layers if layers is None else min(layers, cfg.layers)
    cfg = LlamaConfig(**{**cfg.__dict__, "layers": n})
    tensors = {t.name: t for t in reader.tensors}

    def deq(name):
        if name not in tensors:
            raise OrtkvError(f"the GGUF has no tensor '{name}'")
        t = tensors[name]
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False))

    w = LlamaWeights(cfg, embed=deq("token_embd.weight"), final_norm=deq("output_norm.weight"))
    for i in range(n):
        p = f"blk.{i}."
        w.layers.append({
            "attn_norm": deq(p + "attn_norm.weight"),
            "ffn_norm": deq(p + "ffn_norm.weight"),
            **{k: np.ascontiguousarray(deq(p + name + ".weight").T) for k, name in
               (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output"),
                ("wg", "ffn_gate"), ("wu", "ffn_up"), ("wd", "ffn_down"))},
        })
    if log:
        log(f"ortkv: dequantized {n} layers of {Path(path).name} to float32 in {time.perf_counter() - t0:.1f} s")
    return w, SmolTokenizer.from_gguf(reader)


def load_tokenizer(path) -> SmolTokenizer:
    return SmolTokenizer.from_gguf(_reader(path))

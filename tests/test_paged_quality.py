"""benchmarks/paged_quality.py (issue 11's quality table) without the model: its KL / perplexity against a
numpy loop, the one-file-per-configuration store (Note [Quality runs, one file each]), the report built
from stored rows; and llama.cpp's llama_kv_quality on a few token ids when the build and the GGUF are in
the ortkv cache (skipped with the reason otherwise)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import paged_quality as pq  # noqa: E402


def _log_softmax_rows(x):
    return np.array([[v - math.log(sum(math.exp(w) for w in row)) for v in row] for row in x])


def test_compare_is_kl_and_perplexity_of_the_next_tokens():
    rng = np.random.default_rng(0)
    n, vocab = 9, 7
    ref = _log_softmax_rows(rng.normal(size=(n, vocab))).astype(np.float32)
    other = _log_softmax_rows(rng.normal(size=(n, vocab)) * 2).astype(np.float32)
    ids = rng.integers(0, vocab, n)
    got = pq.compare(ref, other, ids, rows=4)  # rows < n: the blocks must join up
    kl = [sum(math.exp(p) * (p - q) for p, q in zip(ref[t].astype(float), other[t].astype(float))) for t in range(n - 1)]
    nll = [-float(other[t, ids[t + 1]]) for t in range(n - 1)]
    assert got["kl"] == pytest.approx(sum(kl) / (n - 1), rel=1e-9)
    assert got["ppl"] == pytest.approx(math.exp(sum(nll) / (n - 1)), rel=1e-9)
    assert got["kl_quarters"] == pytest.approx([float(np.mean(q)) for q in np.array_split(kl, 4)], rel=1e-9)
    same = pq.compare(ref, ref, ids)
    assert same["kl"] == 0.0 and same["ppl"] == pytest.approx(math.exp(-np.mean(ref[np.arange(n - 1), ids[1:]])))


def test_store_keeps_one_file_per_configuration_and_only_for_its_key(tmp_path):
    key = {"tokens": 4096, "chunk": 64, "page_size": 16, "ids_sha1": "ab" * 20}
    s = pq.Store(tmp_path / "runs", key)
    assert s.get("int4") is None
    s.put("int4", {"ppl": 4.5, "kl": 0.2})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["int4.json"]  # no .part left
    r = s.get("int4")
    assert r["ppl"] == 4.5 and r["name"] == "int4" and r["ids_sha1"] == key["ids_sha1"]
    # another text, length, chunk or page size: the file does not count (it is run again, not reused)
    for change in ({"ids_sha1": "cd" * 20}, {"tokens": 2048}, {"chunk": 32}, {"page_size": 32}):
        assert pq.Store(tmp_path / "runs", {**key, **change}).get("int4") is None, change
    assert s.get("int8") is None


def _row(label, ppl, kl, committed, live, pages, **extra):
    return {"label": label, "ppl": ppl, "kl": kl, "kl_quarters": [kl] * 4, "committed": committed, "live": live,
            "pages": pages, "seconds": 10.0, "load1": [3.0, 5.0], **extra}


def test_report_from_stored_rows(tmp_path):
    from ortkv.generate.config import GenAIConfig

    n = 1024
    key = {"tokens": n, "chunk": 64, "page_size": 16, "ids_sha1": "ef" * 20}
    s = pq.Store(tmp_path, key)
    a = type("A", (), {"chunk": 64, "page_size": 16})()
    d = GenAIConfig().model.decoder
    assert "no dense run yet" in pq.build_report(a, s, d)
    f16 = pq.simulate_bytes({"kv_format": "f16"}, n, 64, 16, d)["committed"]
    s.put("dense", {"ppl": 4.0, "seconds": 5.0, "kv_bytes": 2 * f16, "load1": [2.0, 2.5]})
    s.put("int4", _row("INT4", 5.0, 0.3, f16 // 4, f16 // 4, {"INT4": 64}))
    s.put("recency", _row("recency 1+4 F16, rest INT4", 4.06, 0.01, int(0.34 * f16), int(0.3 * f16),
                          {"F16": 5, "INT4": 59}))
    text = pq.build_report(a, s, d)
    assert "| INT4 | 5.0000 | +25.00 % | 0.30000 |" in text and f"| 0.250x | {4 * n / f16 * 2**30:,.0f} (4.00x) |" in text
    assert "| float32 dense (reference) | 4.0000 |" in text and "| 2.000x |" in text
    assert "+1.50 % perplexity (within 2 %" in text and "0.340x the F16 bytes committed" in text
    assert text.rstrip().splitlines()[-3].endswith(": met.")
    assert "Not run at 1,024 tokens yet: F16, BF16, INT8" in text
    assert "llama.cpp's KV cache types" not in text  # no llama.cpp rows stored
    s.put("recency", _row("recency 1+4 F16, rest INT4", 4.2, 0.05, int(0.34 * f16), int(0.3 * f16), {"F16": 5}))
    assert "+5.00 % perplexity (NOT within 2 %" in pq.build_report(a, s, d)
    s.put("llamacpp_f16", {"ppl": 3.9, "kl": 0.0, "kv": "f16", "kv_bytes": 1000, "seconds": 1.0,
                           "vs_ortkv_dense": {"kl": 0.007}})
    s.put("llamacpp_q4_0", {"ppl": 4.29, "kl": 0.1, "kl_quarters": [0.1] * 4, "kv": "q4_0", "kv_bytes": 281,
                            "seconds": 1.0})
    text = pq.build_report(a, s, d)
    assert f"| q4_0 | 4.2900 | +10.00 % | 0.10000 | 0.10000 | 0.00 MiB | 0.281x | {n / 281 * 2**30:,.0f} (3.56x) |" in text
    assert "mean KL 0.00700 nats" in text


# --- llama_kv_quality itself (needs benchmarks/llamacpp/build.sh's build and the GGUF in the ortkv cache) ----

def _llama():
    from ortkv.generate.assets import cache_dir

    exe = cache_dir() / f"llamacpp-{pq.LLAMACPP_VERSION}" / "lib" / "llama_kv_quality"
    gguf = cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not exe.exists() or not gguf.exists():
        pytest.skip(f"needs {exe} (benchmarks/llamacpp/build.sh) and {gguf} (ortkv generate downloads it)")
    return str(exe), str(gguf)


def _run(exe, *args):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_llama_kv_quality_logprobs_and_perplexity(tmp_path):
    exe, gguf = _llama()
    ids = [1, 504, 3287, 282, 260, 1834, 30, 2357, 1062, 314, 3287, 28, 2357, 30, 504, 282, 260, 4187]
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)) + "\n")
    rows = {}
    for kv in ("f16", "q4_0"):
        out = _run(exe, "--model", gguf, "--ids", str(tmp_path / "ids.txt"), "--chunk", "5", "--type-k", kv,
                   "--type-v", kv, "--threads", "1", "--logprobs-out", str(tmp_path / f"{kv}.f32"))
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout.strip().splitlines()[-1])
        lp = np.fromfile(tmp_path / f"{kv}.f32", np.float32).reshape(len(ids), r["n_vocab"])
        assert r["n"] == len(ids) and r["type_k"] == kv and r["flash_attn"] is True
        # rows are log-softmax; the printed perplexity is the file's, on the next tokens
        assert np.allclose(np.log(np.exp(lp.astype(np.float64)).sum(-1)), 0, atol=1e-4)
        nll = -lp[np.arange(len(ids) - 1), ids[1:]].astype(np.float64)
        assert r["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-4)
        rows[kv] = (r, lp)
    # K + V bytes per token and layer: f16 2 bytes an element, q4_0 18 bytes per 32 elements
    assert rows["q4_0"][0]["kv_bytes"] * 32 == rows["f16"][0]["kv_bytes"] * 18 // 2
    # q4_0 changes the distributions, but not beyond recognition on a short text
    kl = pq.compare(rows["f16"][1], rows["q4_0"][1], np.array(ids))["kl"]
    assert 0 < kl < 1


def test_llama_kv_quality_refuses_bad_input(tmp_path):
    exe, gguf = _llama()
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    (tmp_path / "big.txt").write_text("1 2 99999999\n")
    (tmp_path / "text.txt").write_text("1 2 three\n")
    base = ["--model", gguf, "--threads", "1"]
    cases = [
        ([*base, "--ids", str(tmp_path / "ids.txt"), "--type-k", "q3"], "--type-k q3: not a KV cache type of llama.cpp; give one of f32, f16"),
        ([*base, "--ids", str(tmp_path / "ids.txt"), "--type-v", "q4_0", "--flash-attn", "off"],
         "needs flash attention for a quantized V cache; use --flash-attn on"),
        ([*base, "--ids", str(tmp_path / "big.txt")], "token 2 is 99999999, outside the model's vocabulary [0, 49152)"),
        ([*base, "--ids", str(tmp_path / "text.txt")], "entry 2 is not an integer"),
        ([*base], "--ids FILE (whitespace-separated token ids) is required"),
    ]
    for argv, message in cases:
        out = _run(exe, *argv, "--logprobs-out", str(tmp_path / "never.f32"))
        assert out.returncode == 1 and message in out.stderr, (argv, out.stderr)
        assert not (tmp_path / "never.f32").exists()  # refused before anything is written


def test_build_script_builds_the_quality_program_and_still_prints_the_bench_driver():
    """bench.py's find_llamacpp takes build.sh's last stdout line as llama_decode_bench's path."""
    build = (REPO / "benchmarks" / "llamacpp" / "build.sh").read_text()
    assert "for PROG in llama_kv_quality llama_decode_bench; do" in build and build.rstrip().endswith('echo "$OUT"')
    src = (REPO / "benchmarks" / "llamacpp" / "llama_kv_quality.cpp").read_text()
    for flag in ("--model", "--ids", "--chunk", "--type-k", "--type-v", "--flash-attn", "--threads", "--logprobs-out"):
        assert f'"{flag}"' in src, flag

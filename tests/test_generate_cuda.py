"""Generation on the GPU (issue 10): float16 models on the CUDA provider, caches in CUDA arenas, the CUDA
graph decode step, onnxruntime-genai's CUDA path on the same weights. Skipped, with the reason, where
onnxruntime has no CUDAExecutionProvider, ortkv has no CUDA kernels or no CUDA arena can be made. Needs no
torch: buffers are ORT OrtValues and arena views. Runs the full SmolLM2-135M (its GGUF cached once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortkv
from ortkv.generate.config import GenAIConfig, set_device
from ortkv.generate.loop import generate
from ortkv.generate.models import model_path, tokenizer_for
from ortkv.generate.reference import load_reference
from ortkv.generate.runners import CopyRunner, GenAIRunner, OrtkvRunner, device_memory_used


def _why_not() -> str | None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu, docs/GPU.md)"
    from ortkv import _ortkv
    from ortkv.vmm import cuda_available

    if not _ortkv.CUDA_BUILD:
        return "ortkv was built without CUDA kernels (ORTKV_CUDA=OFF or no nvcc)"
    ok, why = cuda_available()
    return None if ok else f"no CUDA arena: {why}"


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"GPU generation test skipped: {_why_not()}")
REFERENCE = Path(__file__).resolve().parent / "data" / "smollm2_llamacpp_reference.json"


def _cfg(cuda_graph: bool, max_length: int = 512, **ortkv_keys) -> GenAIConfig:
    cfg = GenAIConfig()
    set_device(cfg, "cuda:0", cuda_graph)
    cfg.search.max_length = max_length
    for k, v in ortkv_keys.items():
        setattr(cfg.ortkv, k, v)
    return cfg.validate()


def _run(runner, prompts, steps):
    """Greedy: prefill then ``steps`` decode steps; the logits of every step [steps + 1, B, V]."""
    lengths = np.array([len(p) for p in prompts])
    ids = np.full((len(prompts), lengths.max()), 2, np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    runner.start(len(prompts), runner.cfg.search.max_length)
    out = [runner.prefill(ids, lengths)]
    for _ in range(steps):
        out.append(runner.step(out[-1].argmax(-1)))
    return np.stack(out)


PROMPTS = [[504, 3575, 282, 4649, 314], [1, 504, 3575, 282, 4649, 314, 7042, 30, 198]]


@pytest.mark.parametrize("variant", ["genai", "copy"])
def test_float16_baselines_run_every_compute_node_on_cuda(variant, tmp_path):
    """Profile one run: no compute op of the float16 GenAI / copy decoder runs on the CPU (float32 GQA did,
    silently). The ortkv decoder is covered by the CUDA graph tests: ORT refuses to capture a session with
    any compute node off CUDA."""
    cfg = _cfg(cuda_graph=False)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / variant)
    so.register_custom_ops_library(ortkv.get_library_path())  # the float16 copy model's ortkv.Linear
    sess = ort.InferenceSession(str(model_path(cfg, variant)), so,
                                providers=[("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[504, 3575]]), "attention_mask": np.ones((1, 2), np.int64),
             "position_ids": np.arange(2)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            feeds[i.name] = np.zeros((1, 3, 0, 64), np.float16)
    sess.run(["logits"], feeds)
    prof = json.loads(Path(sess.end_profiling()).read_text())
    nodes = [e["args"] for e in prof if e.get("cat") == "Node" and "provider" in e.get("args", {})]
    assert any(a["provider"] == "CUDAExecutionProvider" and a["op_name"] == "MatMul" for a in nodes)
    shape_ops = ("Shape", "Gather", "Sub", "Cast", "ReduceSum", "Range", "Unsqueeze", "Concat", "Reshape")
    on_cpu = sorted({a["op_name"] for a in nodes if a["provider"] == "CPUExecutionProvider"} - set(shape_ops))
    assert on_cpu == [], f"{variant}: compute ops placed on the CPU: {on_cpu}"


def test_cuda_graph_decode_equals_uncaptured_decode():
    """Same logits, bit for bit, with and without the CUDA graph (capture on the third decode run: the
    replays read new ids and positions from the fixed device buffers), two rows of different lengths."""
    runs = {}
    for graph in (False, True):
        cfg = _cfg(cuda_graph=graph)
        r = OrtkvRunner(model_path(cfg, "ortkv"), cfg)
        try:
            runs[graph] = _run(r, PROMPTS, steps=8)
            assert r.arena_cache.layout == "SBNH" and r.arena_cache.arena_per_tensor
        finally:
            r.close()
    assert np.isfinite(runs[True]).all()
    np.testing.assert_array_equal(runs[True], runs[False])


@pytest.mark.parametrize("graph", [False, True])
def test_decoder_picks_the_greedy_token_of_its_own_logits(graph):
    """Note [Greedy in the decoder]: the float16 ortkv decoder's greedy output is the ArgMax of the step's own
    logits (bound in the same run), two rows, with and without the CUDA graph; and NaN logits are refused by
    name (row, token) as the separate greedy session refuses them."""
    from ortkv.errors import OrtkvError
    from ortkv.generate.runners import checked_greedy

    cfg = _cfg(cuda_graph=graph)
    r = OrtkvRunner(model_path(cfg, "ortkv"), cfg)
    try:
        assert r._greedy_out
        lengths = np.array([len(p) for p in PROMPTS])
        ids = np.full((len(PROMPTS), lengths.max()), 2, np.int64)
        for b, p in enumerate(PROMPTS):
            ids[b, : len(p)] = p
        r.start(len(PROMPTS), cfg.search.max_length)
        tok = r.prefill_tokens(ids, lengths)
        for _ in range(6):
            nxt = r.step_tokens(tok)
            logits = r._io["logits"].numpy()[:, -1]
            np.testing.assert_array_equal(nxt, logits.argmax(-1))
            tok = nxt
    finally:
        r.close()
    V = cfg.model.vocab_size
    with pytest.raises(OrtkvError, match=r"the logits of row 1 hold NaN at token 7"):
        checked_greedy(np.array([3, 4]), np.array([V, 7]), V)


def test_second_generation_captures_its_own_graph():
    """A new start() (new arenas: new pointers, another batch) gets a new graph id, not the old replay."""
    cfg = _cfg(cuda_graph=True)
    r = OrtkvRunner(model_path(cfg, "ortkv"), cfg)
    try:
        a = _run(r, PROMPTS, steps=5)
        b = _run(r, PROMPTS[:1], steps=5)
    finally:
        r.close()
    np.testing.assert_allclose(b[:, 0], a[:, 0], rtol=2e-2, atol=5e-2)  # row 0 alone: same tokens' logits
    assert (b[:, 0].argmax(-1) == a[:, 0].argmax(-1)).all()


def test_ortkv_copy_and_genai_agree_on_cuda():
    cfg = _cfg(cuda_graph=True)
    runners = [OrtkvRunner(model_path(cfg, "ortkv"), cfg), CopyRunner(model_path(cfg, "copy"), cfg),
               GenAIRunner(model_path(cfg, "genai"), cfg, share=True)]
    outs = []
    for r in runners:
        try:
            outs.append(_run(r, [PROMPTS[0]], steps=6))
        finally:
            r.close()
    for other in outs[1:]:
        # float16 through 30 layers: three attention implementations round differently; measured on the
        # H200 max |diff| 0.09 on logits of magnitude ~10 (0.04 % of elements above 0.06)
        np.testing.assert_allclose(other, outs[0], rtol=2e-2, atol=0.15)
        assert np.abs(other - outs[0]).mean() < 0.05  # measured 0.021
        assert (other.argmax(-1) == outs[0].argmax(-1)).all()


EOS = 2  # SmolLM2's <|im_end|>: GenAIConfig().model.eos_token_id


def test_greedy_tokens_equal_genai_float16_for_32_tokens():
    """Goal of issue 10: ortkv fp16 (CUDA graph) and onnxruntime-genai fp16 (share-buffer) pick the same 32
    greedy tokens for every reference prompt, except near ties: a flip passes only when the two picks are
    within 0.125 in ortkv's float16 logits (float16 spacing at |logit| 16-32 is 0.0156) and at most a quarter
    of the prompts flip; every flip is printed with its margin."""
    if not REFERENCE.exists():
        pytest.skip(f"reference data not found at {REFERENCE}")
    prompts = [c["prompt_ids"] for c in load_reference(REFERENCE)["greedy"]]
    assert prompts
    cfg = _cfg(cuda_graph=True, max_new_tokens=32)
    results = {}
    for name, make in (("ortkv", lambda: OrtkvRunner(model_path(cfg, "ortkv"), cfg)),
                       ("genai-share", lambda: GenAIRunner(model_path(cfg, "genai"), cfg, share=True))):
        r = make()
        try:
            results[name] = [generate(r, [p], cfg.search, 32, eos_id=-1, pad_id=2).new_ids[0] for p in prompts]
        finally:
            r.close()
    flips, far = [], []
    for i, (a, b) in enumerate(zip(results["ortkv"], results["genai-share"])):
        assert len(a) == len(b) == 32
        # onnxruntime-genai runs its own greedy loop on CUDA (Note [Greedy on the device]): after its eos a
        # row is done and yields pad tokens, where ortkv (eos_id -1 here) goes on; compare up to the eos
        if EOS in b:
            a, b = a[: b.index(EOS) + 1], b[: b.index(EOS) + 1]
        if a != b:
            k = next(j for j in range(len(a)) if a[j] != b[j])
            # the margin between the two picks in ortkv's own logits after the shared prefix: a near tie
            # (float16 rounding of a different attention kernel) or a real disagreement
            r = OrtkvRunner(model_path(cfg, "ortkv"), cfg)
            try:
                logits = _run(r, [list(prompts[i]) + list(a[:k])], steps=0)[0, 0]
            finally:
                r.close()
            margin = float(logits[a[k]] - logits[b[k]])
            flips.append(f"prompt {i}: first difference at token {k} (ortkv {a[k]}, genai {b[k]}, "
                         f"margin {margin:+.3f} in ortkv's float16 logits)")
            if abs(margin) > 0.125:
                far.append(flips[-1])
    print("greedy flips vs GenAI fp16:", "; ".join(flips) or "none")
    assert not far, "; ".join(far)
    assert len(flips) <= len(prompts) // 4, "; ".join(flips)


def test_committed_kv_follows_tokens_at_8192_x_32():
    """Goal: at max_length 8192, batch 32, 1024 + 256 tokens, committed KV <= 1.1 x live + one granule per
    arena (SBNH, one CUDA arena per tensor), and it grows with the tokens."""
    from ortkv.vmm import ArenaKVCache, CacheGeometry, Governor

    g = CacheGeometry(layers=30, kv_heads=3, head_size=64, capacity=8192, batch=32, dtype_bytes=2)
    with ArenaKVCache(g, "SBNH", "cuda:0", Governor(64 << 30), np.float16) as kv:
        assert kv.committed_bytes == 0
        for tokens in (1, 16, 1024, 1280):
            kv.ensure(tokens)
            bound = 1.1 * kv.live_bytes + len(kv.arenas) * kv.granule
            assert kv.live_bytes <= kv.committed_bytes <= bound, (tokens, kv.committed_bytes, kv.live_bytes)
        assert kv.committed_bytes < g.total_bytes / 5


def test_generate_cli_on_cuda_reports_committed_and_live(tmp_path):
    cmd = [sys.executable, "-m", "ortkv.generate.cli", "--device", "cuda:0", "--cuda-graph", "--json",
           "--max-new-tokens", "24", "--max-length", "1024", "--prompt", "The capital of France is"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["device"], r["dtype"], r["cache_layout"], r["cuda_graph"]) == ("cuda:0", "float16", "SBNH", True)
    assert len(r["new_ids"][0]) == 24 and r["decode_tok_s"] > 0 and r["median_step_ms"] > 0
    assert 0 < r["kv_live_bytes"] <= r["kv_committed_bytes"] <= 1.1 * r["kv_live_bytes"] + 60 * (2 << 20)
    assert r["peak_device_above_load"] is None or r["peak_device_above_load"] >= r["kv_committed_bytes"] // 2
    assert "Paris" in tokenizer_for(GenAIConfig().validate()).decode(r["new_ids"][0])


def test_device_memory_used_is_measured():
    used = device_memory_used(0)
    assert isinstance(used, int) and used > 0


def test_bench_cuda_quick(tmp_path):
    cmd = [sys.executable, "-m", "ortkv.cli", "bench", "--device", "cuda:0", "--quick", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    (table,) = list(tmp_path.glob("bench_*/bench_generate.md"))
    text = table.read_text()
    for v in ("ortkv", "ortkv-nograph", "genai-share", "genai", "copy"):
        assert f"| 16 | 64 | 2048 | 1 | {v} | " in text, v
    assert "failed" not in text

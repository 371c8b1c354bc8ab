"""`ortkv bench --cpu-baseline llamacpp` (issue 12): the orchestration with a fake llama.cpp driver and fake
ortkv workers (no network, no model run): alternating runs, medians, ratios, thread counts, the driver's
resolution order and its failures; and the llama.cpp driver sources' contract."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ortkv
from ortkv.generate import bench as bench_mod

REPO = Path(__file__).resolve().parents[1]


class FakeTokenizer:
    def encode(self, text):
        return list(range(1000, 1000 + len(text.split())))


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    """A fake driver (logs its argv, prints a JSON line whose speed depends on the batch and the run) and a
    fake worker (ortkv: decode 40, 44, 50 tok/s in its three runs at batch 1)."""
    calls = []
    log = tmp_path / "driver_calls.txt"
    driver = tmp_path / "fake_llama_decode_bench"
    driver.write_text(f"""#!/bin/sh
echo "$@" >> {log}
n=$(wc -l < {log})
b=$(echo "$@" | sed 's/.*--batch \\([0-9]*\\).*/\\1/')
echo "llama.cpp logs go to stdout too"
echo "{{\\"decode_tok_s\\": $((30 + n)).0, \\"prefill_tok_s\\": $((100 * b)).0, \\"median_step_ms\\": 25.0, \\"kv_bytes\\": 1048576}}"
""")
    driver.chmod(0o755)
    speeds = {1: iter([40.0, 50.0, 44.0] * 4), 4: iter([100.0, 120.0, 110.0] * 4)}

    def fake_worker(variant, cfg_path, overrides, prompts):
        calls.append(("worker", variant, overrides, prompts))
        return {"variant": variant, "prompts": prompts, "prompt_ids": prompts, "texts": [], "new_ids": [[1]] * len(prompts),
                "decode_tok_s": next(speeds[len(prompts)]), "prefill_tok_s": 50.0 * len(prompts),
                "median_step_ms": 20.0, "kv_bytes": 2 << 20, "rss_per_step": [1, 2], "kv_bytes_per_step": [3]}

    built = []
    monkeypatch.setattr(bench_mod, "run_worker", fake_worker)
    monkeypatch.setattr("ortkv.generate.models.build_models", lambda cfg, variants, log=print: built.append(
        (cfg.ortkv.weights, list(variants))))
    monkeypatch.setattr("ortkv.generate.models.tokenizer_for", lambda cfg, log=print: FakeTokenizer())
    monkeypatch.setattr("ortkv.generate.models.gguf_path", lambda cfg, log=print: Path("/models/same.gguf"))
    monkeypatch.delenv(bench_mod.LLAMACPP_ENV, raising=False)
    monkeypatch.setenv("ORTKV_CACHE_DIR", str(tmp_path / "cache"))
    return {"driver": driver, "log": log, "calls": calls, "built": built, "out": tmp_path / "results"}


def _table(out: Path) -> tuple[str, dict]:
    (d,) = list(out.glob("bench_cpu_*"))
    return (d / "bench_cpu_llamacpp.md").read_text(), json.loads((d / "bench_cpu_llamacpp.json").read_text())


def test_cpu_baseline_alternates_and_reports_medians_and_ratios(fakes):
    assert bench_mod.main(["--cpu-baseline", "llamacpp", "--llamacpp-bin", str(fakes["driver"]), "--threads", "2",
                           "--max-length", "2048", "--batch", "1", "4", "--out", str(fakes["out"])]) == 0
    # alternating: per cell ortkv, llama.cpp, ortkv, llama.cpp, ortkv, llama.cpp
    driver_calls = fakes["log"].read_text().splitlines()
    assert len(driver_calls) == 6
    assert driver_calls[0] == "--model /models/same.gguf --batch 1 --prompt-tokens 16 --new-tokens 256 --ctx 2048 --threads 2"
    assert all("--batch 4" in c for c in driver_calls[3:])
    workers = [c for c in fakes["calls"] if c[0] == "worker"]
    assert [w[1] for w in workers] == ["ortkv"] * 6
    overrides = workers[0][2]
    assert overrides == {"search.max_length": 2048, "ortkv.max_new_tokens": 256, "ortkv.weights": "q4",
                         "ortkv.intra_op_num_threads": 2, "ortkv.warmup": True}  # as the driver warms up
    # one prompt of 16 tokens, the same in every row (as the driver prefills B copies of one prompt)
    prompts4 = workers[3][3]
    assert len(prompts4) == 4 and all(p == prompts4[0] for p in prompts4) and len(prompts4[0]) == 16
    assert fakes["built"] == [("q4", ["ortkv"])]
    table, data = _table(fakes["out"])
    # batch 1: ortkv runs 40, 50, 44 -> median 44; llama.cpp runs 31, 32, 33 -> 32; ratio 1.38
    assert "| 16 | 256 | 2048 | 1 | ortkv | 44.0 | 1.38 | 40.0, 50.0, 44.0 | 20.00 | 50.0 | 0.50 | 2.0 MiB |" in table
    assert "| 16 | 256 | 2048 | 1 | llama.cpp | 32.0 | 1.00 | 31.0, 32.0, 33.0 | 25.00 | 100.0 | 1.00 | 1.0 MiB |" in table
    # batch 4: ortkv median 110 over llama.cpp's 35 (34, 35, 36)
    assert "| 16 | 256 | 2048 | 4 | ortkv | 110.0 | 3.14 |" in table
    assert "2 threads for every variant, 3 alternating runs" in table
    assert data["meta"]["threads"] == 2 and data["meta"]["weights"] == "q4"
    assert data["rows"][0]["median"]["llama.cpp"]["decode_tok_s"] == 32.0
    assert "rss_per_step" not in data["rows"][0]["runs"]["ortkv"][0]


def test_cpu_baseline_reads_the_hook_variable_and_reports_a_failing_driver(fakes, monkeypatch, tmp_path):
    bad = tmp_path / "bad_driver"
    bad.write_text("#!/bin/sh\necho 'llama_decode_bench: cannot load the GGUF' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv(bench_mod.LLAMACPP_ENV, str(bad))
    assert bench_mod.main(["--cpu-baseline", "llamacpp", "--quick", "--variants", "ortkv", "copy",
                           "--threads", "1", "--out", str(fakes["out"])]) == 0
    table, data = _table(fakes["out"])
    assert "| 16 | 64 | 2048 | 1 | llama.cpp | failed: " in table and "cannot load the GGUF" in table
    # without llama.cpp's numbers the ratios are '-', the ortkv rows still there
    assert "| 16 | 64 | 2048 | 1 | ortkv | 40.0 | - | 40.0 | 20.00 | 50.0 | - | 2.0 MiB |" in table
    assert [c[1] for c in fakes["calls"]] == ["ortkv", "copy"]
    assert fakes["built"] == [("q4", ["copy", "ortkv"])]
    # the flag beats the variable
    assert bench_mod.find_llamacpp(str(fakes["driver"])) == str(fakes["driver"])
    assert bench_mod.find_llamacpp(None) == str(bad)


def test_cpu_baseline_runs_several_weights_as_variants_of_their_own(fakes):
    """--weights q4 q8: one ortkv column per weights ("ortkv q4", "ortkv q8"), alternating with llama.cpp in
    every repeat, each decoder built once before the timing."""
    assert bench_mod.main(["--cpu-baseline", "llamacpp", "--llamacpp-bin", str(fakes["driver"]), "--threads", "2",
                           "--max-length", "2048", "--batch", "1", "--weights", "q4", "q8", "--cache-layout", "BSNH",
                           "--out", str(fakes["out"])]) == 0
    workers = [c for c in fakes["calls"] if c[0] == "worker"]
    assert [(w[1], w[2]["ortkv.weights"]) for w in workers] == [("ortkv", "q4"), ("ortkv", "q8")] * 3
    assert all(w[2]["ortkv.cache_layout"] == "BSNH" for w in workers)
    assert len(fakes["log"].read_text().splitlines()) == 3  # llama.cpp once per repeat
    assert fakes["built"] == [("q4", ["ortkv"]), ("q8", ["ortkv"])]
    table, data = _table(fakes["out"])
    # ortkv q4 runs 40, 44, 50 (every other run) -> 44; q8 50, 40, 44 -> 44; llama.cpp 31, 32, 33 -> 32
    assert "| 16 | 256 | 2048 | 1 | ortkv q4 | 44.0 | 1.38 | 40.0, 44.0, 50.0 |" in table
    assert "| 16 | 256 | 2048 | 1 | ortkv q8 | 44.0 | 1.38 | 50.0, 40.0, 44.0 |" in table
    assert "ortkv weights q4 q8, cache layout BSNH, 2 threads" in table and data["meta"]["variants"] == ["ortkv q4", "ortkv q8"]


def test_bench_refuses_several_weights_without_the_cpu_baseline(fakes, capsys):
    with pytest.raises(SystemExit):
        bench_mod.main(["--weights", "q4", "q8"])
    assert "--weights q4 q8: several weights only with --cpu-baseline; give one" in capsys.readouterr().err
    assert fakes["calls"] == []


def test_cpu_baseline_driver_resolution_errors(fakes, monkeypatch, tmp_path):
    with pytest.raises(ortkv.OrtkvError, match=r"--llamacpp-bin .*missing: no executable there"):
        bench_mod.find_llamacpp(str(tmp_path / "missing"))
    monkeypatch.setenv(bench_mod.LLAMACPP_ENV, str(tmp_path / "gone"))
    with pytest.raises(ortkv.OrtkvError, match=r"\$ORTKV_LLAMACPP_BENCH .*gone: no executable there"):
        bench_mod.find_llamacpp(None)
    monkeypatch.delenv(bench_mod.LLAMACPP_ENV)
    # no cached build and not inside a checkout: a clear error, nothing fetched
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ortkv.OrtkvError, match="no llama.cpp driver: .* pass --llamacpp-bin PATH or set ORTKV_LLAMACPP_BENCH"):
        bench_mod.find_llamacpp(None)
    # a cached build (what benchmarks/llamacpp/build.sh leaves) is found
    built = tmp_path / "cache" / f"llamacpp-{bench_mod.LLAMACPP_VERSION}" / "lib" / "llama_decode_bench"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    assert bench_mod.find_llamacpp(None) == str(built)
    # inside a checkout without a build: the checkout's build.sh runs (here a fake one)
    built.unlink()
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks" / "llamacpp").mkdir(parents=True)
    (checkout / "benchmarks" / "llamacpp" / "build.sh").write_text("echo building >&2\necho /built/llama_decode_bench\n")
    (checkout / "sub").mkdir()
    monkeypatch.chdir(checkout / "sub")
    assert bench_mod.find_llamacpp(None, log=lambda m: None) == "/built/llama_decode_bench"
    (checkout / "benchmarks" / "llamacpp" / "build.sh").write_text("echo 'npm: not found' >&2\nexit 1\n")
    with pytest.raises(ortkv.OrtkvError, match="build.sh failed \\(1\\): npm: not found"):
        bench_mod.find_llamacpp(None, log=lambda m: None)


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--cpu-baseline compares CPU decoding"),
    (["--repeats", "0"], "--repeats 0: give 1 or more"),
    (["--threads", "0"], "--threads 0: give 1 or more"),
    (["--variants", "ortkv-nograph"], "needs --device cuda"),
])
def test_cpu_baseline_refuses_bad_flags(fakes, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_mod.main(["--cpu-baseline", "llamacpp", "--llamacpp-bin", str(fakes["driver"]), *argv])
    assert message in capsys.readouterr().err
    assert not fakes["log"].exists() and fakes["calls"] == []


def test_driver_sources_follow_the_hook_contract():
    """The driver takes the hook's flags (Note [llama.cpp hook]) and prints the keys the bench reads; the
    scripts pin the npm version the bench looks for and keep everything in the ortkv cache."""
    src = (REPO / "benchmarks" / "llamacpp" / "llama_decode_bench.cpp").read_text()
    for flag in ("--model", "--batch", "--prompt-tokens", "--new-tokens", "--ctx", "--threads"):
        assert f'"{flag}"' in src, flag
    for key in ("prefill_tok_s", "decode_tok_s", "median_step_ms", "kv_bytes"):
        assert f'\\"{key}\\"' in src, key
    fetch = (REPO / "benchmarks" / "llamacpp" / "fetch.sh").read_text()
    assert f'NODE_LLAMA_CPP_VERSION:-{bench_mod.LLAMACPP_VERSION}' in fetch
    assert "ORTKV_CACHE_DIR" in fetch and "gitRelease.bundle" in fetch
    assert os.access(REPO / "benchmarks" / "llamacpp" / "build.sh", os.X_OK)


# --- the decoder layer's fused form (issue 12, Note [Fused decoder layer] in builder.py) -------------------

@pytest.fixture(scope="module")
def two_layer_weights():
    from ortkv.generate import weights
    from ortkv.generate.assets import smollm2_gguf

    gguf = smollm2_gguf()
    return weights.load(gguf, layers=2)[0], weights.load(gguf, layers=2, fmt="q4")[0]


def _op_counts(model):
    import collections

    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("variant", ["ortkv", "genai", "copy"])
def test_float_layers_use_skip_norms_and_fused_projections(two_layer_weights, variant):
    from ortkv.generate import builder

    w32, _ = two_layer_weights
    ops = _op_counts(builder.build(w32, variant, max_positions=64))
    # per layer: x + attention output -> ffn norm, x + MLP output -> next attn norm (the final norm last)
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * 2 and ops["SimplifiedLayerNormalization"] == 1
    # projections: QKV, output, gate/up, down per layer, and the LM head; one Split per fused pair/triple
    matmuls = ops["MatMul"] - (2 * 2 if variant == "copy" else 0)  # the copy model's attention MatMuls
    # the ortkv decoder takes QKV and gate/up unsplit (RotaryCacheUpdate, SwiGLU: Note [Fused ortkv layer])
    assert matmuls == 2 * 4 + 1 and ops["Split"] == (0 if variant == "ortkv" else 2 * 2)
    if variant == "ortkv":
        assert ops["RotaryCacheUpdate"] == ops["SwiGLU"] == 2 and not ops["CacheUpdate"] and not ops["RotaryEmbedding"]
    model = builder.build(w32, variant, max_positions=64)
    last = [n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"][-1]
    assert last.input[2] == "final_norm" and list(last.output) == ["l1_out_norm"]  # nobody reads the last sum


def test_q4_layers_keep_add_and_norm(two_layer_weights):
    """Note [Fused decoder layer]: the q4 graphs keep Add + SimplifiedLayerNormalization (the fused norm
    changed their greedy continuation of the README prompt)."""
    from ortkv.generate import builder

    _, w4 = two_layer_weights
    ops = _op_counts(builder.build(w4, "ortkv", max_positions=64))
    assert ops["SkipSimplifiedLayerNormalization"] == 0 and ops["SimplifiedLayerNormalization"] == 2 * 2 + 1
    # Note [Fused ortkv layer]: RotaryCacheUpdate takes QKV unsplit; gate/up keep their Split (no SwiGLU for q4);
    # the projections are ortkv.MatMulQ4, the 8-bit LM head MatMulNBits (Note [Fast 4-bit path])
    assert ops["MatMulQ4"] == 2 * 4 and ops["MatMulNBits"] == 1 and ops["Split"] == 2
    assert ops["RotaryCacheUpdate"] == 2 and not ops["SwiGLU"]


def test_warmup_runs_an_untimed_generation_first(monkeypatch):
    """ortkv.warmup (set by --cpu-baseline, Note [CPU baseline]): one untimed 2-token generation on the same
    runner before the timed one, whose figures alone are reported; without it, one generation."""
    import ortkv.generate.loop as loop
    import ortkv.generate.models as models
    import ortkv.generate.runners as runners
    from ortkv.generate.cli import run_one
    from ortkv.generate.config import GenAIConfig

    calls = []

    class Runner:
        def close(self):
            calls.append("close")

    def fake_generate(runner, prompt_ids, search, max_new, eos, pad, seed=0, on_token=None):
        calls.append(("generate", max_new))
        return loop.Generation(prompt_ids=prompt_ids, new_ids=[[7] * max_new for _ in prompt_ids], decode_s=1.0,
                               decode_steps=max_new - 1)

    class Tok:
        def decode(self, ids):
            return "x" * len(ids)

    monkeypatch.setattr(loop, "generate", fake_generate)
    monkeypatch.setattr(runners, "make_runner", lambda variant, cfg, log=print: Runner())
    monkeypatch.setattr(models, "tokenizer_for", lambda cfg, log=print: Tok())
    for warm, want in ((False, [("generate", 5), "close"]), (True, [("generate", 2), ("generate", 5), "close"])):
        calls.clear()
        cfg = GenAIConfig()
        cfg.ortkv.max_new_tokens, cfg.ortkv.warmup = 5, warm
        r = run_one(cfg.validate(), "ortkv", [[1, 2, 3]], stream=False, log=lambda *a: None)
        assert calls == want and r["new_ids"] == [[7] * 5] and r["decode_tok_s"] == 4.0

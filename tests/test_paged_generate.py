"""``--cache paged``: the paged decoder graph (Note [Paged decoder]), its config keys and flags, and
generation through PagedCacheUpdate / PagedCacheAttention (those tests need the paged kernels in the op
library and are skipped, saying so, in a build without them)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from ortkv import _ortkv
from ortkv.errors import OrtkvError
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.cli import apply_overrides, build_parser, config_from_args
from ortkv.generate.config import GenAIConfig, load_config
from ortkv.generate.loop import generate
from ortkv.generate.paged import POOL, PagedRunner, pool_output, to_paged
from ortkv.generate.runners import OrtkvRunner, make_runner
from ortkv.graph.annotations import Access, alias_of, input_access, output_aliases

HAVE_KERNELS = hasattr(_ortkv, "paged_requantize")
kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="this build has no paged kernels (PagedCacheUpdate, "
                                                      "PagedCacheAttention, _ortkv.paged_requantize)")


@pytest.fixture(scope="module")
def slice_paths(tmp_path_factory):
    """A 2-layer slice of SmolLM2 as the dense ortkv decoder (BSNH) and as the paged one (pages of 4), all with the
    paged decoder's MLP (one SwiGLU: build(fused_mlp=True), as paged_model_path builds it): "paged" on the fused
    base (PagedRotaryCacheUpdate, as paged_model_path builds it), "paged_unfused" on the unfused one (Split +
    RotaryEmbedding + PagedCacheUpdate: the many-sequence model's base)."""
    w, _ = weights.load(smollm2_gguf(), layers=2)
    root = tmp_path_factory.mktemp("paged_slice")
    paths = {}
    for name in ("dense", "paged", "paged_unfused"):
        model = builder.build(w, "ortkv", max_positions=256, cache_layout="BSNH", fused_mlp=True,
                              fused=name == "paged")
        if name != "dense":
            model = to_paged(model, w.config.heads, w.config.kv_heads, 4)
        (root / name).mkdir()
        onnx.save_model(model, str(root / name / "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data")
        paths[name] = root / name / "model.onnx"
    return paths


def _slice_cfg(**ortkv):
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    cfg.ortkv.cache_layout = "BSNH"
    cfg.ortkv.cache = "paged"
    cfg.ortkv.page_size = 4
    for k, v in ortkv.items():
        setattr(cfg.ortkv, k, v)
    return cfg.validate()


@pytest.mark.parametrize("base", ["paged", "paged_unfused"])
def test_paged_graph_replaces_every_cache_op(slice_paths, base):
    model = onnx.load(str(slice_paths[base]), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    update = "PagedRotaryCacheUpdate" if base == "paged" else "PagedCacheUpdate"
    assert ops.count(update) == 2 and ops.count("PagedCacheAttention") == 2
    assert not {"CacheUpdate", "CacheAttention", "RotaryCacheUpdate"} & set(ops)
    # the MLP as one SwiGLU per layer; the rotary in the update, or unfused (Note [Paged decoder])
    assert ops.count("SwiGLU") == 2 and "Sigmoid" not in ops
    if base == "paged":
        assert "RotaryEmbedding" not in ops and "Split" not in ops and "PagedCacheUpdate" not in ops
    else:
        assert ops.count("RotaryEmbedding") == 4
    names = [i.name for i in model.graph.input]
    assert names[-3:] == [POOL, "directory", "page_table"] and not any(n.startswith("past_") for n in names)
    assert input_access(model, POOL) is Access.READ_WRITE
    outs = [o.name for o in model.graph.output]
    assert outs == ["logits", pool_output(1)]  # in-graph pools alias the input through the kernel's alias map
    assert alias_of(model, pool_output(1)) == POOL
    upd = [n for n in model.graph.node if n.op_type == update]
    assert [list(n.input[:3]) for n in upd] == [[POOL, "directory", "page_table"],
                                                [pool_output(0), "directory", "page_table"]]
    assert all([(e.output_index, e.input_index) for e in output_aliases(n)] == [(0, 0)] for n in upd)
    attrs = {a.name: a.i for a in upd[1].attribute}
    assert attrs == {"layer": 1, "num_layers": 2, "kv_num_heads": 3, "page_size": 4,
                     **({"num_heads": 9} if base == "paged" else {})}
    att = [n for n in model.graph.node if n.op_type == "PagedCacheAttention"]
    if base == "paged":  # the attention reads the update's q_rot
        assert [n.input[0] for n in att] == [n.output[1] for n in upd]
    assert att[0].input[1] == pool_output(0) and {a.name: a.i for a in att[0].attribute}["num_heads"] == 9
    known = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    for n in model.graph.node:  # topological order, every input defined, nothing dangling from the dense ops
        assert set(n.input) <= known, (n.name, set(n.input) - known)
        known |= set(n.output)
    consumed = {i for n in model.graph.node for i in n.input} | set(outs)
    assert all(set(n.output) & consumed for n in model.graph.node)  # no dead node left


def test_to_paged_refuses_an_unfused_bnsh_decoder(slice_paths):
    w, _ = weights.load(smollm2_gguf(), layers=1)
    with pytest.raises(OrtkvError, match="BSNH"):
        to_paged(builder.build(w, "ortkv", max_positions=64, cache_layout="BNSH", fused=False), 9, 3, 4)


def test_slice_fused_and_unfused_paged_decoders_agree_bit_for_bit(slice_paths):
    """PagedRotaryCacheUpdate rotates in the form of ORT's CPU RotaryEmbedding (Note [Rotary bit for bit]), so the
    fused paged decoder's logits equal the unfused one's exactly on the CPU."""
    ids = np.array([[504, 3575, 282, 4649, 314]])
    steps = [7042, 30, 198, 1117, 28, 253]
    got = {}
    for base in ("paged", "paged_unfused"):
        r = PagedRunner(slice_paths[base], _slice_cfg(kv_format="int8"))
        got[base] = _run(r, ids, steps)
        r.close()
    np.testing.assert_array_equal(got["paged"], got["paged_unfused"])


@pytest.mark.parametrize("ortkv, message", [
    ({"cache": "paged", "kv_format": "int3"}, r"ortkv.kv_format = 'int3': one of 'f16'"),
    ({"cache": "arena", "kv_format": "int8"}, r"ortkv.kv_format is set but ortkv.cache = 'arena'"),
    ({"cache": "paged", "kv_format": "int8", "kv_page_formats": ["f16"]}, "kv_format and kv_page_formats"),
    ({"cache": "paged", "kv_policy": {"recent_pages": 0}}, r"ortkv.kv_policy.recent_pages = 0 must be >= 1"),
    ({"cache": "paged", "page_size": 0}, r"ortkv.page_size = 0 must be >= 1"),
    ({"cache": "paged", "page_size": 8192}, r"ortkv.page_size = 8192 must be <= 4096"),
    ({"cache": "paged", "kv_page_formats": "int8"}, r"ortkv.kv_page_formats = 'int8': expected a list"),
    ({"cache": "pages"}, r"ortkv.cache = 'pages': one of 'arena', 'dense', 'paged'"),
])
def test_paged_config_errors(tmp_path, ortkv, message):
    path = tmp_path / "genai_config.json"
    path.write_text(json.dumps({"ortkv": ortkv}))
    with pytest.raises(OrtkvError, match=message):
        load_config(path)


def test_paged_config_keys_load():
    cfg = apply_overrides(GenAIConfig(), {"ortkv.cache": "paged", "ortkv.kv_policy": {"sink_pages": 2}})
    assert cfg.ortkv.kv_policy == {"sink_pages": 2} and cfg.ortkv.page_size == 16


def test_cli_flags_set_the_paged_keys():
    cfg, _ = config_from_args(build_parser().parse_args(["--cache", "paged", "--kv-format", "int4_kc",
                                                         "--page-size", "32"]))
    assert (cfg.ortkv.cache, cfg.ortkv.kv_format, cfg.ortkv.page_size) == ("paged", "int4_kc", 32)
    cfg, _ = config_from_args(build_parser().parse_args(["--cache", "paged", "--kv-policy", "recency"]))
    assert cfg.ortkv.kv_policy == {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"}
    assert cfg.ortkv.kv_format == "" and cfg.ortkv.kv_page_formats == []
    with pytest.raises(OrtkvError, match="kv_format and kv_policy are both set"):
        config_from_args(build_parser().parse_args(["--cache", "paged", "--kv-policy", "recency",
                                                    "--kv-format", "int8"]))
    with pytest.raises(OrtkvError, match="ortkv.kv_format is set but ortkv.cache = 'arena'"):
        config_from_args(build_parser().parse_args(["--kv-format", "int8"]))


# --- through the kernels ----------------------------------------------------------------------------------
def _run(runner, ids, steps, kv=None):
    runner.start(len(ids), 64)
    out = [runner.prefill(ids, np.array([ids.shape[1]] * len(ids)))]
    for t in steps:
        out.append(runner.step(np.array([t] * len(ids))))
        if kv is not None:
            kv.append((int(runner.lengths[0]), runner.kv_bytes(), runner.paged_stats()["bytes_copied"]))
    return np.stack(out)


@kernels
def test_slice_f16_pages_match_the_dense_cache(slice_paths):
    ids = np.array([[504, 3575, 282, 4649, 314]])
    steps = [7042, 30, 198, 1117, 28, 253, 2, 17]  # crosses pages of 4 several times
    dense = OrtkvRunner(slice_paths["dense"], _slice_cfg(cache="arena"))
    want = _run(dense, ids, steps)
    dense.close()
    paged = PagedRunner(slice_paths["paged"], _slice_cfg(kv_format="f16"))
    kv = []
    got = _run(paged, ids, steps, kv)
    stats = paged.paged_stats()
    slot, granule = paged.pool.slot_bytes("f16"), paged.pool.granule
    paged.close()
    # allocation per step: nothing, except when a step opens a page (then that page's granules)
    rup = lambda n: -(-n // granule) * granule  # noqa: E731
    prev = rup(2 * slot)  # the prefill's 5 tokens: 2 pages of 4
    for length, committed, copied in kv:
        opened = (length - 1) % 4 == 0  # the token at position length - 1 began a page
        assert committed - prev == (rup(-(-length // 4) * slot) - prev if opened else 0)
        assert copied == 0
        prev = committed
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # K/V rounded to float16
    assert stats["pages"]["F16"] == 4 and stats["bytes_copied"] == 0  # 13 tokens in pages of 4


@kernels
def test_slice_recency_policy_requantizes_and_stays_close(slice_paths):
    ids = np.array([[504, 3575, 282, 4649, 314, 7042, 30, 198, 1117, 28, 253, 2, 17, 504, 3575, 282]])
    dense = OrtkvRunner(slice_paths["dense"], _slice_cfg(cache="arena"))
    want = _run(dense, ids, [7042, 30, 198, 1117, 28])
    dense.close()
    runner = PagedRunner(slice_paths["paged"], _slice_cfg(kv_policy={"sink_pages": 1, "recent_pages": 2,
                                                                     "recent": "f16", "old": "int8"}))
    got = _run(runner, ids, [7042, 30, 198, 1117, 28])
    stats = runner.paged_stats()
    runner.close()
    # 21 tokens = 6 pages: page 0 (sink) and the newest 2 F16, pages 1-3 INT8
    assert stats["pages"]["F16"] == 3 and stats["pages"]["INT8"] == 3 and stats["requantized_pages"] == 3
    p_want = np.exp(want - want.max(-1, keepdims=True))
    p_got = np.exp(got - got.max(-1, keepdims=True))
    p_want /= p_want.sum(-1, keepdims=True)
    p_got /= p_got.sum(-1, keepdims=True)
    assert np.abs(p_want - p_got).sum(-1).max() < 0.1  # total variation of the next-token distributions


@pytest.fixture(scope="module")
def full_cfg():
    return apply_overrides(GenAIConfig(), {"ortkv.cache": "paged", "ortkv.kv_format": "f16"})


@kernels
def test_f16_pages_greedy_equal_dense_for_the_readme_prompt(full_cfg):
    from ortkv.generate.models import tokenizer_for

    tok = tokenizer_for(full_cfg)
    ids = [tok.encode("The capital of France is")]
    dense_cfg = GenAIConfig().validate()
    r = make_runner("ortkv", dense_cfg)
    want = generate(r, ids, dense_cfg.search, 32, 2, 2).new_ids
    r.close()
    r = make_runner("ortkv", full_cfg)
    assert isinstance(r, PagedRunner)
    got = generate(r, ids, full_cfg.search, 32, 2, 2)
    r.close()
    assert got.new_ids == want
    assert got.kv_bytes == -(-(len(ids[0]) + 31) // 16) * 30 * 2 * 3 * 16 * 64 * 2  # F16 pages, 4 KiB granules


@kernels
def test_paged_batch_equals_single_rows(full_cfg):
    from ortkv.generate.models import tokenizer_for

    tok = tokenizer_for(full_cfg)
    ids = [tok.encode(p) for p in ("The capital of France is", "Once upon a time, there was a little robot who",
                                   "def f(x):")]
    r = make_runner("ortkv", full_cfg)
    single = [generate(r, [p], full_cfg.search, 24, 2, 2).new_ids[0] for p in ids]
    batch = generate(r, ids, full_cfg.search, 24, 2, 2).new_ids
    r.close()
    assert batch == single


@kernels
def test_cli_json_reports_pages_per_format():
    out = subprocess.run([sys.executable, "-m", "ortkv.generate.cli", "--cache", "paged", "--kv-policy", "recency",
                          "--page-size", "4", "--max-new-tokens", "40", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    paged = r["paged"]
    tokens = len(r["prompt_ids"][0]) + len(r["new_ids"][0]) - 1  # the last token is sampled, not written
    assert sum(paged["pages"].values()) == -(-tokens // 4)
    assert paged["pages"]["F16"] == 5 and paged["pages"]["INT4"] == -(-tokens // 4) - 5
    assert paged["committed_total"] == r["kv_bytes"] == sum(paged["committed_bytes"].values())
    assert paged["policy"].startswith("recency")


def test_paged_cache_on_cuda_is_refused_only_without_cuda_kernels(monkeypatch):
    """On CUDA without the CUDA paged kernels ORT would place the CPU ops on the CPU and copy the pool every
    step: refused, naming the remedy. With them (a CUDA build) the config is valid."""
    from ortkv.generate import config as config_module
    from ortkv.generate.config import GenAIConfig, set_device

    cfg = GenAIConfig()
    cfg.ortkv.cache = "paged"
    cfg.validate()  # the CPU is fine
    set_device(cfg, "cuda:0", False)
    monkeypatch.setattr(config_module, "_cuda_kernels", lambda: False)
    with pytest.raises(OrtkvError, match=r"ortkv.cache = 'paged' on cuda:0: this build of ortkv has no CUDA kernels "
                                         r"for PagedCacheUpdate / PagedCacheAttention .*reinstall ortkv with CUDA on"):
        cfg.validate()
    monkeypatch.setattr(config_module, "_cuda_kernels", lambda: True)
    assert cfg.validate().ortkv.cache == "paged" and cfg.dtype == "float16"


def test_uniform_page_format_promised_only_where_pages_never_change_format(monkeypatch, slice_paths):
    """uniform_page_format: the decoder's attention nodes promise F16, INT8 or INT4 pages (Note [Paged CUDA uniform
    16-bit] / [... uniform INT4] / [... uniform INT8] in custom_ops/kernels/cuda/paged_cuda.cu) on CUDA for a float16
    model with one format, F16, INT8 or INT4, for every page; not on the CPU, not for another format, a recency
    policy, explicit formats, demotion or the page_fill model.
    to_paged writes it into every PagedCacheAttention node."""
    from ortkv.generate import config as config_module
    from ortkv.generate.config import set_device
    from ortkv.generate.paged import uniform_page_format

    monkeypatch.setattr(config_module, "_cuda_kernels", lambda: True)

    def cfg_for(device, **keys):
        cfg = GenAIConfig()
        cfg.ortkv.cache = "paged"
        if device != "cpu":
            set_device(cfg, device, False)
        for k, v in keys.items():
            setattr(cfg.ortkv, k, v)
        return cfg.validate()

    assert uniform_page_format(cfg_for("cuda:0")) == "F16"
    assert uniform_page_format(cfg_for("cuda:0", kv_format="f16")) == "F16"
    assert uniform_page_format(cfg_for("cuda:0", kv_format="int4")) == "INT4"
    assert uniform_page_format(cfg_for("cuda:0", kv_format="int8")) == "INT8"
    assert uniform_page_format(cfg_for("cuda:0", kv_format="int8"), page_fill=True) is None
    assert uniform_page_format(cfg_for("cpu", kv_format="int8")) is None
    assert uniform_page_format(cfg_for("cuda:0"), page_fill=True) is None
    assert uniform_page_format(cfg_for("cuda:0", kv_format="int4"), page_fill=True) is None
    assert uniform_page_format(cfg_for("cpu")) is None
    assert uniform_page_format(cfg_for("cpu", kv_format="int4")) is None
    for keys in ({"kv_format": "fp8_e4m3"}, {"kv_format": "int4_kc"}, {"kv_policy": {"sink_pages": 1}},
                 {"kv_page_formats": ["f16"]}, {"kv_demote_on_refusal": True},
                 {"kv_format": "int4", "kv_demote_on_refusal": True},
                 {"kv_format": "int8", "kv_demote_on_refusal": True}):
        assert uniform_page_format(cfg_for("cuda:0", **keys)) is None, keys
    w, _ = weights.load(smollm2_gguf(), layers=2)
    model = to_paged(builder.build(w, "ortkv", max_positions=64, cache_layout="BSNH"), 9, 3, 4, page_format="F16")
    att = [n for n in model.graph.node if n.op_type == "PagedCacheAttention"]
    assert len(att) == 2 and all({a.name: a.s for a in n.attribute}["page_format"] == b"F16" for n in att)
    plain = onnx.load(str(slice_paths["paged"]), load_external_data=False)
    assert not any(a.name == "page_format" for n in plain.graph.node for a in n.attribute)


def test_to_paged_promises_static_tables(slice_paths):
    """Every PagedCacheAttention node of the paged decoder (and of the page_fill model) sets static_tables = 1
    (Note [Paged CUDA static tables]): its directory, page table and page_fill are graph inputs that no node
    writes, which the checker confirms."""
    from ortkv.graph import check_model

    w, _ = weights.load(smollm2_gguf(), layers=2)
    for fill in (False, True):
        model = to_paged(builder.build(w, "ortkv", max_positions=64, cache_layout="BSNH"), 9, 3, 4, page_fill=fill)
        att = [n for n in model.graph.node if n.op_type == "PagedCacheAttention"]
        assert len(att) == 2 and all({a.name: a.i for a in n.attribute}["static_tables"] == 1 for n in att)
        assert {"directory", "page_table"} <= {vi.name for vi in model.graph.input}
        check_model(model)
    built = onnx.load(str(slice_paths["paged"]), load_external_data=False)
    assert all({a.name: a.i for a in n.attribute}.get("static_tables") == 1
               for n in built.graph.node if n.op_type == "PagedCacheAttention")


def test_paged_runner_refuses_float16_on_the_cpu(slice_paths):
    cfg = _slice_cfg(dtype="float16")
    with pytest.raises(OrtkvError, match=r"ortkv.cache = 'paged' on the CPU runs float32 models; got dtype float16"):
        PagedRunner(slice_paths["paged"], cfg)


# ---- on CUDA (Note [Paged decoder on CUDA]): float16 model, pool in a CUDA arena -----------------------------
def _cuda_why_not() -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu, docs/GPU.md)"
    from ortkv.vmm import cuda_available

    if not _ortkv.CUDA_BUILD:
        return "ortkv was built without CUDA kernels (ORTKV_CUDA=OFF or no nvcc)"
    ok, why = cuda_available()
    return None if ok else f"no CUDA arena: {why}"


README_PROMPT = "The capital of France is"


def _cuda_cfg(cuda_graph: bool, paged: bool = True, **ortkv_keys) -> GenAIConfig:
    from ortkv.generate.config import set_device

    cfg = GenAIConfig()
    set_device(cfg, "cuda:0", cuda_graph)
    cfg.search.max_length = 512
    if paged:
        cfg.ortkv.cache = "paged"
    for k, v in ortkv_keys.items():
        setattr(cfg.ortkv, k, v)
    return cfg.validate()


def _logit_steps(runner, prompts, steps):
    """Prefill then ``steps`` decode steps on the argmax; the [B, V] logits of each, stacked."""
    lengths = np.array([len(p) for p in prompts])
    ids = np.full((len(prompts), lengths.max()), 2, np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    runner.start(len(prompts), runner.cfg.search.max_length)
    out = [runner.prefill(ids, lengths)]
    for _ in range(steps):
        out.append(runner.step(out[-1].argmax(-1)))
    return np.stack(out)


def _near_tie_or_equal(a, b, prompt, cfg_dense, what):
    """a (paged) == b (dense), or the first difference is a near tie: the two picks within 0.125 in the dense
    runner's float16 logits after the shared prefix (the rule of test_generate_cuda.py)."""
    if a == b:
        return None
    k = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
    from ortkv.generate.models import model_path

    r = OrtkvRunner(model_path(cfg_dense, "ortkv"), cfg_dense)
    try:
        logits = _logit_steps(r, [list(prompt) + list(b[:k])], 0)[0, 0]
    finally:
        r.close()
    margin = float(logits[b[k]] - logits[a[k]])
    msg = f"{what}: first difference at token {k} (dense {b[k]}, paged {a[k]}, margin {margin:+.3f})"
    print(msg)
    assert abs(margin) <= 0.125, msg
    return msg


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_cuda_f16_pages_greedy_equal_the_dense_cuda_path(graph):
    """Issue 11 on CUDA: greedy tokens of --cache paged --kv-format f16 == the dense (arena) CUDA path's for
    the README prompt, 32 tokens, or differ first at a near tie (_near_tie_or_equal)."""
    from ortkv.generate.models import model_path, tokenizer_for

    dense_cfg = _cuda_cfg(graph, paged=False)
    ids = [tokenizer_for(dense_cfg).encode(README_PROMPT)]
    r = OrtkvRunner(model_path(dense_cfg, "ortkv"), dense_cfg)
    try:
        want = generate(r, ids, dense_cfg.search, 32, -1, 2).new_ids[0]
    finally:
        r.close()
    cfg = _cuda_cfg(graph, kv_format="f16")
    r = make_runner("ortkv", cfg)
    assert isinstance(r, PagedRunner) and r.greedy_on_device and r._greedy_out
    try:
        g = generate(r, ids, cfg.search, 32, -1, 2)
        stats = r.paged_stats()
    finally:
        r.close()
    got = g.new_ids[0]
    assert len(got) == 32
    _near_tie_or_equal(got, want, ids[0], dense_cfg, f"paged f16 (graph {graph}) vs dense")
    assert stats["device"] == "cuda:0" and stats["bytes_staged"] == 0 and stats["bytes_copied"] == 0
    tokens = len(ids[0]) + 31  # the last token is sampled, not written
    assert stats["pages"]["F16"] == -(-tokens // 16) and g.kv_bytes == stats["committed_total"] > 0
    assert stats["directory_bytes_uploaded"] >= 16 * stats["pages"]["F16"]


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_cuda_paged_decoder_picks_the_greedy_token_of_its_own_logits(graph):
    """Note [Greedy in the decoder] on the paged decoder: step_tokens reads the decode step's own greedy output
    (bound in the same run, no GreedyToken session), and it is the ArgMax of that step's logits, two rows of
    different lengths, with and without the CUDA graph."""
    from ortkv.generate.models import tokenizer_for

    cfg = _cuda_cfg(graph, kv_format="f16")
    tok = tokenizer_for(cfg)
    prompts = [tok.encode(README_PROMPT), tok.encode("The capital of France is")]
    lengths = np.array([len(p) for p in prompts])
    ids = np.full((len(prompts), lengths.max()), 2, np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    r = make_runner("ortkv", cfg)
    assert isinstance(r, PagedRunner) and r._greedy_out
    calls = []
    real = r.greedy_token.__call__
    r.greedy_token = lambda logits, index: calls.append(len(index)) or real(logits, index)
    try:
        r.start(len(prompts), cfg.search.max_length)
        nxt = r.prefill_tokens(ids, lengths)
        assert calls == [2]  # the prefill's rows end at different positions: GreedyToken with each row's length
        for _ in range(6):
            nxt_new = r.step_tokens(nxt)
            logits = r._io["logits"].numpy()[:, -1]
            np.testing.assert_array_equal(nxt_new, logits.argmax(-1))
            nxt = nxt_new
        assert calls == [2], "a decode step ran the separate GreedyToken session"
    finally:
        r.close()


def test_table_bucket_widths():
    """Note [Page table buckets]: the smallest power-of-two key bucket (at least TABLE_BUCKET_MIN keys) that holds
    the rows, in pages, never wider than the table."""
    from ortkv.generate.paged import TABLE_BUCKET_MIN, table_bucket

    assert TABLE_BUCKET_MIN == 256
    cases = [(1, 16, 128, 16), (16, 16, 128, 16), (256, 16, 128, 16), (257, 16, 128, 32), (512, 16, 128, 32),
             (513, 16, 128, 64), (1500, 16, 128, 128), (2048, 16, 128, 128), (5000, 16, 128, 128),
             (300, 32, 100, 16), (1, 48, 10, 6), (700, 48, 10, 10), (0, 16, 128, 16)]
    for need, ps, max_pages, want in cases:
        assert table_bucket(need, ps, max_pages) == want, (need, ps, max_pages)
        assert table_bucket(need, ps, max_pages) * ps >= min(need, max_pages * ps)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_cuda_table_buckets_give_the_full_tables_logits(graph, monkeypatch):
    """Note [Page table buckets]: with buckets of 16, 32 and 64 keys (TABLE_BUCKET_MIN lowered to 16) two rows of
    5 and 9 prompt tokens, fed the same 40 tokens, give the logits of the full 512-key table (other splits: a
    different summation order, so within 0.1), and the runner bound tables of 1, 2 and 4 pages only."""
    from ortkv.generate import paged as paged_module

    prompts = [[504, 3575, 282, 4649, 314], [1, 504, 3575, 282, 4649, 314, 7042, 30, 198]]
    feed = np.array([[(7 * i + 3 * b) % 4000 + 100 for b in range(2)] for i in range(40)], np.int64)
    runs = {}
    for bucket_min in (16, 1 << 30):
        monkeypatch.setattr(paged_module, "TABLE_BUCKET_MIN", bucket_min)
        cfg = _cuda_cfg(graph, kv_format="f16")
        r = make_runner("ortkv", cfg)
        try:
            lengths = np.array([len(p) for p in prompts])
            ids = np.full((2, lengths.max()), 2, np.int64)
            for b, p in enumerate(prompts):
                ids[b, : len(p)] = p
            r.start(2, cfg.search.max_length)
            out = [r.prefill(ids, lengths)]
            for i in range(40):
                out.append(r.step(feed[i]))
            runs[bucket_min] = np.stack(out)
            runs[bucket_min, "widths"] = sorted(r._tables)
        finally:
            r.close()
    assert runs[16, "widths"] == [1, 2, 4], runs[16, "widths"]
    assert runs[1 << 30, "widths"] == [32], runs[1 << 30, "widths"]
    assert np.isfinite(runs[16]).all()
    diff = float(np.abs(runs[16] - runs[1 << 30]).max())
    assert diff <= 0.1, diff
    assert (runs[16].argmax(-1) == runs[1 << 30].argmax(-1)).mean() >= 0.95


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
def test_cuda_graph_paged_decode_equals_uncaptured_paged_decode():
    """Same logits, bit for bit, with and without the CUDA graph, two rows of different lengths over three
    pages each (new pages open, the directory and page table change, the arena commits, under capture)."""
    prompts = [[504, 3575, 282, 4649, 314], [1, 504, 3575, 282, 4649, 314, 7042, 30, 198]]
    runs = {}
    for graph in (False, True):
        cfg = _cuda_cfg(graph, kv_format="f16")
        r = make_runner("ortkv", cfg)
        try:
            runs[graph] = _logit_steps(r, prompts, steps=40)
            runs[graph, "stats"] = r.paged_stats()
        finally:
            r.close()
    assert np.isfinite(runs[True]).all()
    np.testing.assert_array_equal(runs[True], runs[False])
    assert runs[True, "stats"]["pages"] == runs[False, "stats"]["pages"]


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
def test_cuda_graph_decode_ids_follow_commit_chunks(monkeypatch):
    """Note [Paged decoder on CUDA]: under CUDA graphs every pool commit moves decode to a new graph id (captured
    on its first run). 8 rows x 100 steps open 56 F16 pages: page by page (COMMIT_AHEAD_TOKENS 0) that is a
    commit every ~5.7 pages (a 2 MiB granule), so 5 or more decode graphs; committing 128 tokens of every row at a
    time, the prefill's commit holds them all: one decode graph. The same logits either way."""
    from ortkv.generate import paged as paged_module

    prompts = [[504, 3575, 282, 4649, 314]] * 8
    graphs, logits = {}, {}
    shipped = paged_module.COMMIT_AHEAD_TOKENS
    for ahead in (shipped, 0):
        monkeypatch.setattr(paged_module, "COMMIT_AHEAD_TOKENS", ahead)
        r = make_runner("ortkv", _cuda_cfg(True, kv_format="f16"))
        try:
            logits[ahead] = _logit_steps(r, prompts, steps=100)
            graphs[ahead] = r.paged_stats()["decode_graphs"]
        finally:
            r.close()
    assert graphs[shipped] == 1 and graphs[0] >= 5, graphs
    np.testing.assert_array_equal(logits[shipped], logits[0])


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
def test_cuda_int8_pages_run_and_stay_close_to_f16_pages():
    from ortkv.generate.models import tokenizer_for

    tok = tokenizer_for(_cuda_cfg(False))
    ids = [tok.encode(README_PROMPT)]
    logits = {}
    for fmt in ("f16", "int8"):
        cfg = _cuda_cfg(False, kv_format=fmt)
        r = make_runner("ortkv", cfg)
        try:
            logits[fmt] = _logit_steps(r, ids, steps=4)
            stats = r.paged_stats()
        finally:
            r.close()
        want = -(-(len(ids[0]) + 4) // 16)
        assert stats["pages"][fmt.upper()] == want and sum(stats["pages"].values()) == want
    assert np.isfinite(logits["int8"]).all()
    # the prompt's logits (later steps may follow different tokens): int8 keys and values with per-row
    # scales move float16 logits of magnitude ~10 by well under 1, and the first pick is the same
    assert np.abs(logits["int8"][0] - logits["f16"][0]).max() < 1.0
    assert (logits["int8"][0].argmax(-1) == logits["f16"][0].argmax(-1)).all()


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
@pytest.mark.parametrize("fmt", ["INT4", "INT8"])
def test_cuda_narrow_pages_promised_match_the_every_format_kernel(monkeypatch, fmt):
    """kv_format = int4 / int8 on CUDA: the decoder promises INT4 / INT8 pages (uniform_page_format; Note [Paged
    CUDA uniform INT4], Note [Paged CUDA uniform INT8]), and its logits over the prompt and 4 greedy steps equal
    those of the same decoder without the promise (the every-format kernel) within float16 rounding, as long as
    the two pick the same tokens."""
    from ortkv.generate import paged as paged_module
    from ortkv.generate.models import tokenizer_for

    tok = tokenizer_for(_cuda_cfg(False))
    ids = [tok.encode(README_PROMPT)]
    logits = {}
    for promise in (fmt, None):
        if promise is None:
            monkeypatch.setattr(paged_module, "uniform_page_format", lambda cfg, page_fill=False: None)
        cfg = _cuda_cfg(False, kv_format=fmt.lower())
        path = paged_module.paged_model_path(cfg)
        model = onnx.load(str(path), load_external_data=False)
        att = [n for n in model.graph.node if n.op_type == "PagedCacheAttention"]
        assert att and all({a.name: a.s for a in n.attribute}.get("page_format", b"") == (promise or "").encode()
                           for n in att), (path, promise)
        r = make_runner("ortkv", cfg)
        try:
            logits[promise] = _logit_steps(r, ids, steps=4)
            stats = r.paged_stats()
        finally:
            r.close()
        want = -(-(len(ids[0]) + 4) // 16)
        assert stats["pages"][fmt] == want and sum(stats["pages"].values()) == want
    a, b = logits[fmt], logits[None]
    assert np.isfinite(a).all()
    for k in range(len(a)):  # step k's input is step k - 1's pick
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=0.05, err_msg=f"step {k}")
        if (a[k].argmax(-1) != b[k].argmax(-1)).any():
            break


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
def test_cuda_recency_policy_requantizes_on_the_device():
    """Pages leaving the recent window are requantized on the CUDA pool by the device kernels (Note [Requantize
    on CUDA]): one INT4 slot written per page, nothing staged through the host."""
    cfg = _cuda_cfg(False, kv_policy={"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"},
                    page_size=4)
    r = make_runner("ortkv", cfg)
    try:
        out = _logit_steps(r, [[504, 3575, 282, 4649, 314]], steps=35)
        stats = r.paged_stats()
        pool = r.pool
        slot_f16, slot_int4 = pool.slot_bytes("f16"), pool.slot_bytes("int4")
    finally:
        r.close()
    tokens = 5 + 35
    assert np.isfinite(out).all()
    assert stats["pages"]["F16"] == 5 and stats["pages"]["INT4"] == -(-tokens // 4) - 5
    assert stats["requantized_pages"] == stats["pages"]["INT4"]
    assert stats["bytes_staged"] == 0 and slot_f16 > slot_int4
    assert stats["bytes_copied"] == stats["requantized_pages"] * slot_int4


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_why_not() is not None, reason=f"paged CUDA generation skipped: {_cuda_why_not()}")
def test_cli_paged_int8_on_cuda_reports_pages_and_committed_bytes(tmp_path):
    cmd = [sys.executable, "-m", "ortkv.generate.cli", "--device", "cuda:0", "--cache", "paged", "--kv-format", "int8",
           "--max-new-tokens", "24", "--max-length", "1024", "--json", "--prompt", README_PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["device"], r["dtype"]) == ("cuda:0", "float16")
    paged = r["paged"]
    tokens = len(r["prompt_ids"][0]) + len(r["new_ids"][0]) - 1
    assert paged["pages"]["INT8"] == -(-tokens // 16) == sum(paged["pages"].values())
    assert paged["committed_total"] == r["kv_bytes"] == sum(paged["committed_bytes"].values()) > 0
    assert paged["device"] == "cuda:0" and paged["bytes_staged"] == 0
    assert 1 <= len(r["new_ids"][0]) <= 24  # 24 unless the model ends with eos first


def test_float16_decoder_rewrites_onto_the_paged_ops():
    """The CUDA paged decoder is the float16 ortkv decoder rewritten (paged_model_path passes cfg.dtype):
    same nodes, float16 values into the paged ops, float32 logits."""
    w, _ = weights.load(smollm2_gguf(), layers=2)
    model = to_paged(builder.build(w, "ortkv", max_positions=256, cache_layout="BSNH", dtype="float16",
                                   fused_mlp=True, fused=True), w.config.heads, w.config.kv_heads, 16)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("PagedRotaryCacheUpdate") == 2 and ops.count("PagedCacheAttention") == 2
    assert not {"CacheUpdate", "CacheAttention", "RotaryCacheUpdate", "RotaryEmbedding"} & set(ops)
    # the MLP as one SwiGLU per layer (Note [Paged decoder])
    assert ops.count("SwiGLU") == 2 and "Sigmoid" not in ops
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t.data_type for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "PagedRotaryCacheUpdate":  # qkv = Linear(x, the fused float16 projection)
            matmul = producer[n.input[3]]
            assert matmul.op_type == "Linear"
            assert inits[matmul.input[1]] == onnx.TensorProto.FLOAT16
            assert inits[n.input[5]] == onnx.TensorProto.FLOAT16  # the rotary tables
    assert [o.type.tensor_type.elem_type for o in model.graph.output if o.name == "logits"] == [onnx.TensorProto.FLOAT]
    assert alias_of(model, pool_output(1)) == POOL

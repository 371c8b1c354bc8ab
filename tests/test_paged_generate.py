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
    """A 2-layer slice of SmolLM2 as the dense ortkv decoder (BSNH) and as the paged one (pages of 4)."""
    w, _ = weights.load(smollm2_gguf(), layers=2)
    root = tmp_path_factory.mktemp("paged_slice")
    paths = {}
    for name in ("dense", "paged"):
        model = builder.build(w, "ortkv", max_positions=256, cache_layout="BSNH")
        if name == "paged":
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


def test_paged_graph_replaces_every_cache_op(slice_paths):
    model = onnx.load(str(slice_paths["paged"]), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("PagedCacheUpdate") == 2 and ops.count("PagedCacheAttention") == 2
    assert "CacheUpdate" not in ops and "CacheAttention" not in ops
    names = [i.name for i in model.graph.input]
    assert names[-3:] == [POOL, "directory", "page_table"] and not any(n.startswith("past_") for n in names)
    assert input_access(model, POOL) is Access.READ_WRITE
    outs = [o.name for o in model.graph.output]
    assert outs == ["logits", pool_output(1)]  # in-graph pools alias the input through the kernel's alias map
    assert alias_of(model, pool_output(1)) == POOL
    upd = [n for n in model.graph.node if n.op_type == "PagedCacheUpdate"]
    assert [list(n.input[:3]) for n in upd] == [[POOL, "directory", "page_table"],
                                                [pool_output(0), "directory", "page_table"]]
    assert all([(e.output_index, e.input_index) for e in output_aliases(n)] == [(0, 0)] for n in upd)
    attrs = {a.name: a.i for a in upd[1].attribute}
    assert attrs == {"layer": 1, "num_layers": 2, "kv_num_heads": 3, "page_size": 4}
    att = [n for n in model.graph.node if n.op_type == "PagedCacheAttention"]
    assert att[0].input[1] == pool_output(0) and {a.name: a.i for a in att[0].attribute}["num_heads"] == 9
    known = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    for n in model.graph.node:  # topological order, every input defined, nothing dangling from the dense ops
        assert set(n.input) <= known, (n.name, set(n.input) - known)
        known |= set(n.output)
    consumed = {i for n in model.graph.node for i in n.input} | set(outs)
    assert all(set(n.output) & consumed for n in model.graph.node)  # no dead node left


def test_to_paged_refuses_a_bnsh_decoder(slice_paths):
    w, _ = weights.load(smollm2_gguf(), layers=1)
    with pytest.raises(OrtkvError, match="BSNH"):
        to_paged(builder.build(w, "ortkv", max_positions=64, cache_layout="BNSH"), 9, 3, 4)


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

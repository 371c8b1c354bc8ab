"""Many sequences on one page pool (ortkv.generate.multi): the PageStore adapter over PagePool, the
runner of PageCache placements, parallel sampling through the Scheduler, beam search by page-table
reorder, and their config / CLI keys. Model tests run a 2-layer slice of SmolLM2 with pages of 4 tokens;
they need the paged kernels and are skipped, saying so, in a build without them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortkv import _ortkv
from ortkv.cache import PageCache, Scheduler
from ortkv.cache.pool_store import PoolPageStore
from ortkv.errors import CacheProtocolError, OrtkvError
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.cli import build_parser, config_from_args
from ortkv.generate.config import GenAIConfig, Search
from ortkv.generate.loop import generate
from ortkv.generate.multi import (BeamStats, MultiRunner, _Hypotheses, beam_search, generate_many, log_softmax,
                                  multi_summary, run_multi, sample_many)
from ortkv.generate.paged import PagedRunner, to_paged
from ortkv.paged import PagePool
from ortkv.reference.codecs import PageFormat
from ortkv.vmm import Governor

HAVE_KERNELS = hasattr(_ortkv, "paged_requantize")
kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="this build has no paged kernels (PagedCacheUpdate, "
                                                      "PagedCacheAttention, _ortkv.paged_requantize)")
PS = 4


# --- the store adapter -------------------------------------------------------------------------------------
def _pool(max_pages=16, budget=64 << 20):
    return PagePool(2, 3, 64, PS, np.float32, "cpu", Governor(budget), max_pages=max_pages)


def _fill(pool, page, seed):
    n = pool.slot_bytes(pool.format_of(page))
    o = pool.offset_of(page)
    pool.pool[o:o + n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return pool.pool[o:o + n].copy()


def _snapshot(pool) -> dict:
    """The bytes of every live page's slot (the pool's reservation past its committed granules is not
    readable)."""
    return {p: pool.pool[pool.offset_of(p):pool.offset_of(p) + pool.slot_bytes(pool.format_of(p))].copy()
            for p in pool.live_pages}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_store_alloc_free_page_bytes_pass_through():
    with _pool() as pool:
        store = PoolPageStore(pool)
        a = store.alloc(int(PageFormat.F16))
        b = store.alloc(int(PageFormat.INT8))
        assert pool.live_pages == [a, b] and pool.format_of(b) is PageFormat.INT8
        assert store.page_bytes(int(PageFormat.F16)) == 2 * pool.page_bytes("f16")  # every layer of a page
        store.free(a)
        assert pool.live_pages == [b]


def test_store_copy_is_one_slot_counted_in_the_pool():
    with _pool() as pool:
        store = PoolPageStore(pool)
        src, dst = store.alloc(0), store.alloc(0)
        want = _fill(pool, src, 1)
        _fill(pool, dst, 2)
        store.copy(src, dst)
        o, n = pool.offset_of(dst), pool.slot_bytes("f16")
        assert np.array_equal(pool.pool[o:o + n], want)
        assert pool.bytes_copied == n == store.bytes_copied and store.copies == 1


def test_store_copy_refusals_leave_bytes_untouched():
    with _pool() as pool:
        store = PoolPageStore(pool)
        src, dst = store.alloc(0), store.alloc(int(PageFormat.INT8))
        _fill(pool, src, 3)
        _fill(pool, dst, 4)
        before = _snapshot(pool)
        with pytest.raises(CacheProtocolError, match=r"copy 0 -> 1: formats differ \(F16 vs INT8\)"):
            store.copy(src, dst)
        with pytest.raises(CacheProtocolError, match=r"copy 0 -> 7: page 7 is not live in the pool"):
            store.copy(src, 7)
        assert _same(_snapshot(pool), before) and pool.bytes_copied == 0 and store.copies == 0


def test_store_refuses_keys_per_channel_pages():
    with _pool() as pool:
        store = PoolPageStore(pool)
        with pytest.raises(CacheProtocolError, match=r"INT4_KC encodes keys per channel.*f16, bf16, int8"):
            store.alloc(int(PageFormat.INT4_KC))
        assert pool.live_pages == []


@kernels
def test_store_requantize_keeps_the_page_id():
    with _pool() as pool:
        store = PoolPageStore(pool)
        cache = PageCache(store, PS, max_pages_per_seq=4, max_sequences=2)
        cache.new_sequence(0)
        p = cache.admit({0: np.arange(PS)})
        cache.done(p)
        pid = cache.pages_of(0)[0]
        o = pool.offset_of(pid)
        pool.pool[o:o + pool.slot_bytes("f16")] = 0  # zeros: representable in every format
        cache.requantize(pid, int(PageFormat.INT8))
        assert cache.pages_of(0) == (pid,) and pool.format_of(pid) is PageFormat.INT8
        assert pool.bytes_copied == pool.slot_bytes("int8")


def test_page_cache_on_the_pool_refuses_a_whole_step_when_the_pool_is_full():
    with _pool(max_pages=4) as pool:
        store = PoolPageStore(pool)
        outside = pool.alloc(0)                               # a page the cache does not own
        _fill(pool, outside, 5)
        cache = PageCache(store, PS, max_pages_per_seq=8, max_sequences=2)
        cache.new_sequence(0)
        cache.new_sequence(1)
        before = _snapshot(pool)
        r = cache.admit({0: np.arange(8), 1: np.arange(8)})  # 4 pages, the pool has 3 left
        assert not r and r.kind == "store" and r.pages_needed == 4
        assert "all 4 pages are in use" in r.reason
        assert pool.live_pages == [outside] and cache.length(0) == 0 and _same(_snapshot(pool), before)


# --- the model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paged_path(tmp_path_factory):
    """The 2-layer paged decoder with the page_fill input (what MultiRunner binds)."""
    return _slice_model(tmp_path_factory, page_fill=True)


@pytest.fixture(scope="module")
def plain_path(tmp_path_factory):
    """The same decoder without page_fill: the single-sequence PagedRunner that the references run."""
    return _slice_model(tmp_path_factory, page_fill=False)


def _slice_model(tmp_path_factory, page_fill):
    if not HAVE_KERNELS:
        pytest.skip("this build has no paged kernels")
    w, _ = weights.load(smollm2_gguf(), layers=2)
    root = tmp_path_factory.mktemp("multi_slice")
    # as paged_model_path builds it: the rotary in PagedRotaryCacheUpdate, the MLP as one SwiGLU (Note [Paged
    # decoder]); 256 rotary rows, fewer than the many-sequence page tables reach (each row's positions are checked)
    model = to_paged(builder.build(w, "ortkv", max_positions=256, cache_layout="BSNH", fused=True, fused_mlp=True),
                     w.config.heads, w.config.kv_heads, PS, page_fill=page_fill)
    onnx.save_model(model, str(root / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")
    return root / "model.onnx"


def _cfg(**search):
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    cfg.ortkv.cache_layout = "BSNH"
    cfg.ortkv.cache = "paged"
    cfg.ortkv.page_size = PS
    cfg.search.max_length = 64
    for k, v in search.items():
        setattr(cfg.search, k, v)
    return cfg.validate()


PROMPTS = [[1, 504, 3458, 282, 4649, 314, 5], [1, 9690, 28, 2, 4932, 30, 1001, 17, 600, 22, 11]]


def _reference_greedy(path, cfg, prompts, new):
    r = PagedRunner(path, cfg)
    try:
        return generate(r, prompts, Search(max_length=cfg.search.max_length), new, eos_id=-1, pad_id=0).new_ids
    finally:
        r.close()


@kernels
def test_greedy_through_the_scheduler_equals_the_paged_runner(paged_path, plain_path):
    cfg = _cfg()
    want = _reference_greedy(plain_path, cfg, PROMPTS, 10)
    runner = MultiRunner(paged_path, cfg, max_sequences=4)
    try:
        got = {0: [], 1: []}
        for ev in generate_many(PROMPTS, runner, max_new_tokens=10, eos_token_id=-1):
            got[ev.request].append(ev.token)
        assert [got[0], got[1]] == want
        # every token fed once: the two prompts and 9 decode tokens each, in one run per distinct count
        assert runner.tokens_computed == sum(map(len, PROMPTS)) + 2 * 9
        assert runner.pool.bytes_copied == 0
    finally:
        runner.close()


@kernels
def test_greedy_one_prompt_at_a_time_equals_the_paged_runner(paged_path, plain_path):
    cfg = _cfg()
    runner = MultiRunner(paged_path, cfg, max_sequences=2)
    try:
        for p in PROMPTS:
            assert sample_many(p, runner, 1, 8, eos_token_id=-1) == _reference_greedy(plain_path, cfg, [p], 8)
    finally:
        runner.close()


@kernels
def test_parallel_samples_are_reproducible_and_share_the_prompt_pages(paged_path):
    cfg = _cfg()
    search = Search(do_sample=True, temperature=1.0, top_k=50, max_length=64)
    prompt, n, new = PROMPTS[1], 4, 9          # 11 prompt tokens: 2 full pages + 3 rows of a third
    runs = []
    for _ in range(2):
        runner = MultiRunner(paged_path, cfg, max_sequences=n)
        seen = []
        forward0 = runner.forward

        def spy(placement, all_logits=False, runner=runner, seen=seen, forward0=forward0):
            out = forward0(placement, all_logits)
            live = [s for s in runner.cache.sequences]
            seen.append((len(runner.cache.owned_pages), sorted(runner.cache.length(s) for s in live),
                         runner.pool.stats()["live_bytes"]))
            return out

        runner.forward = spy
        try:
            samples = sample_many(prompt, runner, n, new, search=search, seed=11, eos_token_id=-1)
            runs.append((samples, runner.store.copies, seen))
        finally:
            runner.close()
    (a, copies, seen), (b, _, _) = runs
    assert a == b and all(len(s) == new for s in a)
    assert len({tuple(s) for s in a}) > 1          # sampling with top_k 50: the samples differ
    assert copies == 0                              # forks share the partly filled prompt page: no copy
    slot = PagePool(2, 3, 64, PS, np.float32, "cpu", max_pages=1).slot_bytes("f16")
    shared = -(-len(prompt) // PS)                  # the prompt's pages, its partly filled one included
    first = PS - len(prompt) % PS                   # rows left in it: the first sample fills them
    for pages, lengths, live in seen[1:]:           # after the fork: every step with all 4 samples
        length = lengths[0]
        assert lengths == [length] * n
        mine = length - len(prompt)                 # each sample's own tokens
        # the prompt's pages once; sample 0 appends to the shared page, the 3 others open pages of their own
        assert pages == shared + -(-max(0, mine - first) // PS) + (n - 1) * -(-mine // PS)
        assert live == pages * slot
        assert pages < n * -(-length // PS)           # less than n full copies
    assert sum(1 for s in seen if s[1] == [len(prompt) + new - 1] * n) == 1


@kernels
def test_samples_with_different_seeds_differ(paged_path):
    cfg = _cfg()
    search = Search(do_sample=True, top_k=0, max_length=64)
    runner = MultiRunner(paged_path, cfg, max_sequences=4)
    try:
        a = sample_many(PROMPTS[0], runner, 4, 8, search=search, seed=1, eos_token_id=-1)
        b = sample_many(PROMPTS[0], runner, 4, 8, search=search, seed=2, eos_token_id=-1)
        assert a != b
    finally:
        runner.close()


def _brute_force_beams(path, cfg, prompt, num_beams, steps):
    """Beam search with no eos, every beam's logits recomputed from scratch (a fresh pool per sequence)."""
    r = PagedRunner(path, cfg)

    def logits(seq):
        r.start(1, cfg.search.max_length)
        return r.prefill(np.array([seq], np.int64), np.array([len(seq)]))[0]

    try:
        beams, scores = [list(prompt)], np.zeros(1)
        for _ in range(steps):
            total = np.stack([log_softmax(logits(b)) for b in beams]) + scores[:, None]
            flat = total.reshape(-1)
            order = np.lexsort((np.arange(flat.size), -flat))[:num_beams]
            v = total.shape[1]
            beams = [beams[i // v] + [int(i % v)] for i in order]
            scores = flat[order]
        return [b[len(prompt):] for b in beams], scores
    finally:
        r.close()


@kernels
def test_beam_search_equals_brute_force_and_copies_nothing(paged_path, plain_path):
    cfg = _cfg()
    prompt, nb, steps = PROMPTS[0], 4, 6         # 7 prompt tokens: writes start at 7, 8 (boundary), 9, ...
    want, want_scores = _brute_force_beams(plain_path, cfg, prompt, nb, steps)
    runner = MultiRunner(paged_path, cfg, max_sequences=nb)
    try:
        stats = BeamStats()
        got = beam_search(runner, prompt, nb, steps, length_penalty=1.0, num_return_sequences=nb,
                          eos_token_id=-1, stats=stats)
        assert [h.tokens for h in got] == want
        np.testing.assert_allclose([h.sum_logprobs for h in got], want_scores, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose([h.score for h in got], np.asarray(want_scores) / (len(prompt) + steps),
                                   rtol=1e-4, atol=1e-4)
        assert len(stats.bytes_copied_per_step) == steps - 1
        assert any(stats.boundary_steps) and not all(stats.boundary_steps)
        # a reorder is a page-table change and a shared partly filled page is never copied (Note [Page fill])
        assert stats.bytes_copied_per_step == [0] * (steps - 1) and stats.copies_per_step == [0] * (steps - 1)
        assert runner.pool.bytes_copied == 0 and runner.store.copies == 0
        assert runner.cache.pages_opened_by_sharing > 0   # children of one beam did share a partly filled page
        assert runner.pool.live_pages == [] or set(runner.pool.live_pages) == runner.cache.held_pages
        assert runner.cache.sequences == []
    finally:
        runner.close()


def test_hypotheses_keep_the_best_and_stop_as_genai_does():
    h = _Hypotheses(2, length_penalty=1.0, early_stopping=False)
    h.add([1], -4.0, 4, True)                      # score -1
    h.add([2], -6.0, 3, True)                      # score -2
    h.add([3], -9.0, 3, True)                      # score -3: worse than both, not kept
    assert sorted(x.tokens for x in h.items) == [[1], [2]]
    assert not h.done(-6.0, 4)                     # -6/4 = -1.5 can still beat the worst kept (-2)
    assert h.done(-9.0, 4)                         # -9/4 = -2.25 cannot: done
    h2 = _Hypotheses(2, length_penalty=2.0, early_stopping=True)
    h2.add([1], -8.0, 2, True)
    assert h2.items[0].score == -2.0 and not h2.done(0.0, 3)
    h2.add([2], -8.0, 4, True)
    assert h2.done(0.0, 3)                         # early stopping: num_beams hypotheses are enough


@kernels
def test_beam_search_stops_at_eos_with_early_stopping(paged_path):
    cfg = _cfg()
    runner = MultiRunner(paged_path, cfg, max_sequences=2)
    try:
        eos = sample_many(PROMPTS[0], runner, 1, 1, eos_token_id=-1)[0][0]  # the greedy first token ends it
        got = beam_search(runner, PROMPTS[0], 2, 6, eos_token_id=eos, num_return_sequences=2)
        assert len(got) == 2 and all(eos not in h.tokens for h in got)
        assert any(h.eos and h.tokens == [] for h in got)   # the most likely first token is the eos
        assert runner.cache.sequences == []
    finally:
        runner.close()


@kernels
def test_forward_of_a_count_placement_is_refused_and_cancelled(paged_path):
    cfg = _cfg()
    runner = MultiRunner(paged_path, cfg, max_sequences=2)
    try:
        runner.cache.new_sequence(0)
        runner.step({0: np.array(PROMPTS[0][:6])})            # 6 tokens: a full page and half of one
        before = _snapshot(runner.pool)
        p = runner.cache.admit({0: 5})
        with pytest.raises(OrtkvError, match=r"admitted with token counts; admit token ids"):
            runner.forward(p)
        assert runner.cache.length(0) == 6 and len(runner.pool.live_pages) == 2
        assert _same(_snapshot(runner.pool), before)
    finally:
        runner.close()


@kernels
def test_beam_search_argument_errors(paged_path):
    runner = MultiRunner(paged_path, _cfg(), max_sequences=2)
    try:
        with pytest.raises(OrtkvError, match=r"num_beams = 2, num_return_sequences = 3: need 1 <= "):
            beam_search(runner, PROMPTS[0], 2, 4, num_return_sequences=3)
        with pytest.raises(OrtkvError, match=r"4 beams but the cache has 2 free sequence slots"):
            beam_search(runner, PROMPTS[0], 4, 4)
        assert runner.pool.live_pages == [] and runner.cache.sequences == []
    finally:
        runner.close()


@kernels
def test_generate_many_refuses_a_prompt_past_max_length(paged_path):
    runner = MultiRunner(paged_path, _cfg(), max_sequences=2, max_length=16)
    try:
        with pytest.raises(OrtkvError, match=r"prompt 1 has 11 tokens \+ max_new_tokens 8 > the runner's "
                                             r"max_length 16"):
            list(generate_many(PROMPTS, runner, 8))
        assert runner.pool.live_pages == []
    finally:
        runner.close()


# --- config and CLI ------------------------------------------------------------------------------------------
def test_config_keys_and_refusals():
    assert _cfg(num_beams=4, num_return_sequences=2).search.num_beams == 4
    assert _cfg(num_return_sequences=16, do_sample=True).search.num_return_sequences == 16
    cases = [({"num_beams": 4, "do_sample": True}, r"num_beams = 4 with do_sample true: .*set do_sample false"),
             ({"num_beams": 2, "num_return_sequences": 3}, r"num_return_sequences = 3 > num_beams = 2"),
             ({"num_beams": 0}, r"search.num_beams"),
             ({"num_return_sequences": 1000}, r"num_return_sequences = 1000 must be <= 256"),
             ({"num_beams": 2, "length_penalty": float("nan")}, r"search.length_penalty: expected a finite number, got nan")]
    for search, msg in cases:
        with pytest.raises(OrtkvError, match=msg):
            _cfg(**search)
    cfg = GenAIConfig()
    cfg.search.num_beams = 4
    with pytest.raises(OrtkvError, match=r"num_beams = 4: .*set ortkv.cache 'paged' \(--cache paged\)"):
        cfg.validate()
    cfg = GenAIConfig()
    cfg.search.num_return_sequences = 3
    with pytest.raises(OrtkvError, match=r"num_return_sequences = 3: ortkv returns one sequence.*--cache paged"):
        cfg.validate()


def test_cli_flags_set_the_search_keys():
    a = build_parser().parse_args(["--cache", "paged", "--num-beams", "4", "--num-return-sequences", "2"])
    cfg, overrides = config_from_args(a)
    assert (cfg.search.num_beams, cfg.search.num_return_sequences) == (4, 2)
    assert overrides["search.num_beams"] == 4
    with pytest.raises(OrtkvError, match=r"num_beams = 4: ortkv decodes greedily or by sampling with cache 'arena'"):
        config_from_args(build_parser().parse_args(["--cache", "arena", "--num-beams", "4"]))


def test_policies_that_change_formats_are_refused_for_many_sequences():
    from ortkv.generate.multi import write_format

    cfg = _cfg()
    cfg.ortkv.kv_policy = {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"}
    with pytest.raises(OrtkvError, match=r"write every page in one format: set ortkv.kv_format"):
        write_format(cfg)
    cfg = _cfg()
    cfg.ortkv.kv_format = "int4_kc"
    with pytest.raises(OrtkvError, match=r"kv_format = 'int4_kc': a keys-per-channel format"):
        write_format(cfg)
    cfg.ortkv.kv_format = "int8"
    assert write_format(cfg) is PageFormat.INT8


class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


@kernels
def test_run_multi_beams_and_samples(paged_path):
    cfg = _cfg(num_beams=3, num_return_sequences=2)
    cfg.ortkv.max_new_tokens = 5
    r = run_multi(cfg, ["a"], [PROMPTS[0]], _Tok(), log=lambda *x: None, path=paged_path)
    assert [(q["prompt"], q["index"]) for q in r["sequences"]] == [(0, 0), (0, 1)]
    assert r["sequences"][0]["score"] >= r["sequences"][1]["score"]
    assert r["search"]["num_beams"] == 3 and r["paged"]["format"] == "F16"
    line = multi_summary(r)
    assert line.startswith("[ortkv paged, 3 beams] ") and "KV bytes copied" in line
    assert r["paged"]["bytes_copied"] == 0 and r["paged"]["copies"] == 0
    cfg = _cfg(num_return_sequences=3, do_sample=True)
    cfg.ortkv.max_new_tokens = 4
    r = run_multi(cfg, ["a", "b"], PROMPTS, _Tok(), log=lambda *x: None, path=paged_path)
    assert [(q["prompt"], q["index"]) for q in r["sequences"]] == [(i, j) for i in range(2) for j in range(3)]
    assert all(len(q["new_ids"]) == 4 or q["new_ids"][-1] == cfg.model.eos_token_id for q in r["sequences"])


@kernels
def test_beam_search_equals_onnxruntime_genai_beam_search(paged_path, tmp_path):
    """onnxruntime-genai's own CPU beam search on the same 2-layer weights (its genai decoder, caches copied
    per beam) picks the same beams as ortkv's page-table reorder."""
    og = pytest.importorskip("onnxruntime_genai")
    from ortkv.generate.models import write_genai_folder

    w, tokenizer = weights.load(smollm2_gguf(), layers=2)
    onnx.save_model(builder.build(w, "genai", max_positions=256), str(tmp_path / "model.onnx"),
                    save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    cfg = _cfg()
    write_genai_folder(tmp_path, cfg, tokenizer)
    prompt, nb, new = PROMPTS[1], 4, 8
    config = og.Config(str(tmp_path))
    config.clear_providers()
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, num_beams=nb, num_return_sequences=nb,
                              do_sample=False, early_stopping=True, length_penalty=1.0, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    theirs = [[int(t) for t in gen.get_sequence(i)][len(prompt):] for i in range(nb)]
    runner = MultiRunner(paged_path, cfg, max_sequences=nb)
    try:
        ours = beam_search(runner, prompt, nb, new, num_return_sequences=nb, eos_token_id=cfg.model.eos_token_id)
    finally:
        runner.close()
    eos = cfg.model.eos_token_id
    assert not any(h.eos for h in ours), "an eos ended a beam: the comparison would test eos bookkeeping"
    assert [h.tokens for h in ours] == [[t for t in s if t != eos] for s in theirs]


@kernels
def test_a_warmed_system_prompt_is_prefilled_once_and_gives_the_same_tokens(paged_path):
    cfg = _cfg()
    system = list(range(100, 112))                  # 3 full pages
    prompts = [system + [7, 8], system + [9], system + [10, 11, 12]]
    cold = MultiRunner(paged_path, cfg, max_sequences=4, prefix_caching=False)
    try:
        with pytest.raises(OrtkvError, match=r"built with prefix_caching=False, so no page would be kept"):
            cold.warm_prefix(system)
        assert cold.pool.live_pages == [] and cold.tokens_computed == 0
        want = [sample_many(p, cold, 1, 5, eos_token_id=-1)[0] for p in prompts]
    finally:
        cold.close()
    runner = MultiRunner(paged_path, cfg, max_sequences=4)
    try:
        assert runner.warm_prefix(system) == 12 and runner.tokens_computed == 12
        assert len(runner.cache.cached_pages) == 3
        sched = Scheduler(runner.cache)
        got = {}
        for ev in generate_many(prompts, runner, 5, eos_token_id=-1, scheduler=sched):
            got.setdefault(ev.request, []).append(ev.token)
        assert [got[i] for i in range(3)] == want
        assert sched.reused_tokens == 3 * 12 and sched.prefill_tokens == 2 + 1 + 3
        assert runner.tokens_computed == 12 + 6 + 3 * 4
    finally:
        runner.close()


@kernels
def test_close_with_a_step_admitted_and_not_run(paged_path):
    runner = MultiRunner(paged_path, _cfg(), max_sequences=2)
    runner.cache.new_sequence(0)
    assert runner.cache.admit({0: np.array(PROMPTS[0])})
    runner.close()
    assert runner.pool is None


def test_docs_cache_md_generation_example_names_what_exists():
    """The `py` block of docs/cache.md's generation section (it needs the full model, so it is compiled
    and its names checked here, not run)."""
    import re
    from pathlib import Path

    import ortkv.generate.multi as multi

    text = (Path(__file__).resolve().parent.parent / "docs" / "cache.md").read_text()
    (block,) = re.findall(r"```py\n(.*?)```", text, flags=re.S)
    compile(block, "docs/cache.md", "exec")
    for name in re.findall(r"from ortkv\.generate\.multi import (.*)", block)[0].split(","):
        assert hasattr(multi, name.strip())
    for attr in re.findall(r"runner\.(\w+)\(", block):
        assert hasattr(MultiRunner, attr), attr


@kernels
def test_a_small_pool_queues_and_preempts_without_changing_the_tokens(paged_path, plain_path):
    """The pool's own refusal (max_pages) reaches the Scheduler through admission: requests wait or are
    preempted and recomputed, and greedy tokens are still each prompt's own."""
    cfg = _cfg()
    prompts = PROMPTS + [[1, 22, 333, 4444, 55]]
    want = _reference_greedy(plain_path, cfg, prompts, 10)
    runner = MultiRunner(paged_path, cfg, max_sequences=3, max_pages=9, prefix_caching=False)
    try:
        sched = Scheduler(runner.cache)
        got = {}
        for ev in generate_many(prompts, runner, 10, eos_token_id=-1, scheduler=sched):
            got.setdefault(ev.request, []).append(ev.token)
            assert len(runner.pool.live_pages) <= 9
        assert [got[i] for i in range(3)] == want
        assert sched.preemptions > 0                # 15 pages wanted at the end, 9 in the pool
        assert runner.tokens_computed > sum(map(len, prompts)) + 3 * 9   # the preempted were recomputed
        assert runner.pool.live_pages == []
    finally:
        runner.close()


# ---- on CUDA: the pool in a CUDA arena, pages shared through page_fill (no copy) --------------------------------
def _cuda_why_not() -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu, docs/GPU.md)"
    from ortkv.vmm import cuda_available

    if not _ortkv.CUDA_BUILD:
        return "ortkv was built without CUDA kernels (ORTKV_CUDA=OFF or no nvcc)"
    ok, why = cuda_available()
    return None if ok else f"no CUDA arena: {why}"


on_cuda = pytest.mark.skipif(_cuda_why_not() is not None, reason=f"many sequences on CUDA skipped: {_cuda_why_not()}")


@pytest.mark.cuda
@on_cuda
def test_store_copy_on_a_cuda_pool_is_one_device_slot_counted():
    with PagePool(2, 3, 64, PS, np.float16, "cuda:0", Governor(64 << 20), max_pages=16) as pool:
        store = PoolPageStore(pool)
        src, dst, other = store.alloc(0), store.alloc(0), store.alloc(0)
        n = pool.slot_bytes("f16")
        rng = np.random.default_rng(3)
        want, keep = (rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2))
        pool.write_bytes(pool.offset_of(src), want)
        pool.write_bytes(pool.offset_of(other), keep)
        store.copy(src, dst)
        assert np.array_equal(pool.slot_contents(dst), want) and np.array_equal(pool.slot_contents(src), want)
        assert np.array_equal(pool.slot_contents(other), keep)
        assert pool.bytes_copied == n == store.bytes_copied and store.copies == 1 and pool.bytes_staged == 0
        i8 = store.alloc(int(PageFormat.INT8))
        with pytest.raises(CacheProtocolError, match="formats differ"):
            store.copy(src, i8)
        assert np.array_equal(pool.slot_contents(dst), want) and pool.bytes_copied == n


def _full_cfg(device: str, **search):
    from ortkv.generate.config import set_device

    cfg = GenAIConfig()
    cfg.ortkv.cache = "paged"
    cfg.ortkv.kv_format = "f16"
    cfg.search.max_length = 256
    if device != "cpu":
        set_device(cfg, device, False)
    for k, v in search.items():
        setattr(cfg.search, k, v)
    return cfg.validate()


@pytest.mark.cuda
@on_cuda
def test_four_beams_on_cuda_equal_four_beams_on_the_cpu():
    """The same 4-beam search (README prompt, 12 tokens) on the CPU (float32 model, F16 pages) and on CUDA
    (float16 model, F16 pages). Float16 weights and activations move log-probabilities by ~1e-2, so beams
    can swap at a near tie: the best hypothesis must be the same tokens, or its score on each device within
    0.05 of the other's best (a tie between two hypotheses, printed). Nothing is copied on either device
    (page_fill: the CUDA kernels must take it, Note [Page fill])."""
    from ortkv.generate.models import tokenizer_for
    from ortkv.generate.paged import paged_model_path

    results = {}
    for device in ("cpu", "cuda:0"):
        cfg = _full_cfg(device)
        prompt = tokenizer_for(cfg).encode("The capital of France is")
        runner = MultiRunner(paged_model_path(cfg, page_fill=True), cfg, max_sequences=4, max_length=128)
        try:
            stats = BeamStats()
            hyps = beam_search(runner, prompt, 4, 12, num_return_sequences=4, eos_token_id=-1, stats=stats)
            assert runner.pool.bytes_copied == 0 == sum(stats.bytes_copied_per_step) and runner.store.copies == 0
            assert runner.pool.stats()["device"] == device and runner.pool.bytes_staged == 0
            results[device] = (hyps, stats)
        finally:
            runner.close()
    (cpu, _), (gpu, _) = results["cpu"], results["cuda:0"]
    assert len(cpu) == len(gpu) == 4
    if cpu[0].tokens == gpu[0].tokens:
        assert abs(cpu[0].score - gpu[0].score) < 0.05
    else:
        print(f"4 beams: best hypothesis differs (cpu {cpu[0].tokens} {cpu[0].score:.4f}, cuda {gpu[0].tokens} "
              f"{gpu[0].score:.4f})")
        assert abs(cpu[0].score - gpu[0].score) < 0.05
        assert gpu[0].tokens in [h.tokens for h in cpu] or cpu[0].tokens in [h.tokens for h in gpu]


@pytest.mark.cuda
@on_cuda
def test_parallel_samples_on_cuda_share_the_prompt_pages():
    """4 samples of one prompt on a CUDA pool: reproducible by seed, and the prompt's partly filled page is
    shared, never copied, as on the CPU (page_fill on the CUDA kernels, Note [Page fill])."""
    from ortkv.generate.paged import paged_model_path

    cfg = _full_cfg("cuda:0", do_sample=True, top_k=20, temperature=0.8)
    prompt, n = [1, 504, 3458, 282, 4649, 314, 5, 9690, 28], 4  # 9 tokens: one partly filled page of 16
    runs = []
    for _ in range(2):
        runner = MultiRunner(paged_model_path(cfg, page_fill=True), cfg, max_sequences=n, max_length=128)
        try:
            samples = sample_many(prompt, runner, n, 10, search=cfg.search, seed=1, eos_token_id=-1)
            runs.append((samples, runner.store.copies, runner.pool.bytes_copied, runner.pool.stats()))
        finally:
            runner.close()
    (a, copies, copied, stats), (b, _, _, _) = runs
    assert a == b and all(len(s) == 10 for s in a)
    assert copies == 0 and copied == 0
    assert stats["device"] == "cuda:0" and stats["bytes_staged"] == 0


@pytest.mark.cuda
@on_cuda
def test_cli_four_beams_on_cuda(tmp_path):
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ortkv.generate.cli", "--device", "cuda:0", "--cache", "paged", "--num-beams", "4",
           "--num-return-sequences", "2", "--max-new-tokens", "8", "--max-length", "256", "--json", "--prompt",
           "The capital of France is"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["device"], r["dtype"]) == ("cuda:0", "float16")
    assert len(r["sequences"]) == 2 and all(1 <= len(q["new_ids"]) <= 8 for q in r["sequences"])
    assert r["sequences"][0]["score"] >= r["sequences"][1]["score"]
    p = r["paged"]
    assert p["device"] == "cuda:0" and p["bytes_copied"] == 0 and p["copies"] == 0
    assert r["kv_bytes"] > 0


@kernels
def test_multi_runner_refuses_a_decoder_without_page_fill(tmp_path):
    """The many-sequence path binds each row's fills (Note [Page fill]); a paged decoder built without the
    input is refused up front, naming the remedy."""
    w, _ = weights.load(smollm2_gguf(), layers=2)
    model = to_paged(builder.build(w, "ortkv", max_positions=64, cache_layout="BSNH"), w.config.heads,
                     w.config.kv_heads, PS)
    assert "page_fill" not in {i.name for i in model.graph.input}
    onnx.save_model(model, str(tmp_path / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")
    with pytest.raises(OrtkvError, match=r"has no page_fill input.*to_paged\(\.\.\., page_fill=True\)"):
        MultiRunner(tmp_path / "model.onnx", _cfg(), max_sequences=2)

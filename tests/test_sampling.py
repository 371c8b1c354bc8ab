"""The sampler against an independent reference (Hugging Face's logits warpers, written out here):
temperature scales the logits, top_k keeps the k best (0: all), top_p keeps the smallest most-likely
set whose mass is >= p (at least one token), and a seeded draw follows the renormalized distribution."""

from __future__ import annotations

import numpy as np
import pytest

import ortkv
from ortkv.generate.cli import apply_overrides
from ortkv.generate.config import GenAIConfig
from ortkv.generate.loop import Sampler


def search(**kw):
    return apply_overrides(GenAIConfig(), {f"search.{k}": v for k, v in kw.items()}).search


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper (min_tokens_to_keep=1), then
    softmax: the probability of every token of the vocabulary (0 for those cut)."""
    x = np.asarray(logits, np.float64)
    if temperature == 0 or top_k == 1:
        out = np.zeros(len(x))
        out[x.argmax()] = 1
        return out
    x = x / temperature
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(p)  # ascending
    cum = np.cumsum(p[order])
    remove = cum <= 1 - top_p
    remove[-1] = False  # min_tokens_to_keep = 1
    x[order[remove]] = -np.inf
    p = np.exp(x - x.max())
    return p / p.sum()


def draws(sampler: Sampler, logits: np.ndarray, n: int) -> np.ndarray:
    rows = np.repeat(logits[None], 500, axis=0)
    return np.concatenate([sampler(rows) for _ in range(n // 500)])


V = 24
LOGITS = np.random.default_rng(7).standard_normal(V) * 2.0  # no ties


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 50, 1.0),  # the shipped defaults (top_k above the vocabulary)
    (1.0, 0, 1.0),  # top_k 0: every token
    (1.0, V, 1.0),  # top_k = vocabulary size
    (1.0, 5, 1.0),
    (1.0, 0, 0.9),
    (1.0, 5, 0.5),
    (0.5, 0, 0.8),
    (2.0, 10, 0.95),
    (1.0, 0, 0.0),  # top_p 0: only the most likely token
    (1.0, 2, 1.0),
    (1e-3, 0, 1.0),  # tiny temperature: practically greedy, never a NaN
    (100.0, 0, 1.0),  # flat
])
def test_empirical_distribution_matches_the_reference(temperature, top_k, top_p):
    n = 20000
    s = search(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    ref = reference(LOGITS, temperature, top_k, top_p)
    order, kept = Sampler(s).kept(LOGITS)
    expect = np.zeros(V)
    expect[order] = kept
    np.testing.assert_allclose(expect, ref, atol=1e-12)  # the kept set and its renormalized mass
    counts = np.bincount(draws(Sampler(s, seed=11), LOGITS, n), minlength=V)
    assert counts.sum() == n
    assert counts[ref == 0].sum() == 0, "a token outside the kept set was drawn"
    emp = counts / n
    assert 0.5 * np.abs(emp - ref).sum() < 0.02, (emp, ref)  # total variation
    sigma = np.sqrt(n * ref * (1 - ref))
    assert (np.abs(counts - n * ref) <= 5 * sigma + 1).all(), (counts, n * ref)


def test_default_top_p_1_never_overruns_the_vocabulary_over_thousands_of_steps():
    """The nucleus cut at top_p = 1.0 used to be searchsorted(cumsum, 1.0) + 1: whenever the cumulative sum
    rounded below 1 the cut exceeded the kept tokens and numpy raised 'a and p must have same size'."""
    rng = np.random.default_rng(0)
    for top_k in (50, 0):
        sampler = Sampler(search(do_sample=True, top_k=top_k, top_p=1.0), seed=3)
        for step in range(1500):
            logits = rng.standard_normal((2, 4096)).astype(np.float32) * rng.uniform(0.1, 20)
            out = sampler(logits)
            assert out.shape == (2,) and ((0 <= out) & (out < 4096)).all()
            if top_k:
                for b in range(2):  # never a token outside the top 50
                    assert logits[b, out[b]] >= np.sort(logits[b])[-50]


def test_full_vocabulary_steps_with_the_shipped_config():
    s = GenAIConfig().validate().search
    s.do_sample = True  # the shipped genai_config.json with sampling switched on
    sampler = Sampler(s, seed=1)
    rng = np.random.default_rng(1)
    for _ in range(300):
        logits = rng.standard_normal((1, 49152)).astype(np.float32) * 8
        assert 0 <= sampler(logits)[0] < 49152


@pytest.mark.parametrize("kw", [dict(do_sample=False), dict(do_sample=True, temperature=0.0),
                                dict(do_sample=True, top_k=1), dict(do_sample=True, top_k=0, top_p=0.0)])
def test_greedy_edges_pick_the_argmax(kw):
    logits = np.random.default_rng(2).standard_normal((64, 300))
    sampler = Sampler(search(**kw), seed=9)
    for _ in range(5):
        np.testing.assert_array_equal(sampler(logits), logits.argmax(-1))


def test_ties_go_to_the_lowest_token_id():
    logits = np.zeros((3, 10))
    logits[:, [3, 7]] = 5.0
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=1), dict(do_sample=True, top_k=0, top_p=0.0)):
        assert Sampler(search(**kw))(logits).tolist() == [3, 3, 3]


def test_seeded_draws_repeat_and_differ_by_seed():
    logits = np.random.default_rng(0).standard_normal((200, 50))
    s = search(do_sample=True, top_k=0, top_p=0.95, temperature=1.3)
    a, b, c = Sampler(s, seed=5)(logits), Sampler(s, seed=5)(logits), Sampler(s, seed=6)(logits)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_unusable_logits_are_refused():
    s = search(do_sample=True, top_k=0)
    bad = np.zeros((1, 8))
    bad[0, 3] = np.nan
    for sampler in (Sampler(s), Sampler(search(do_sample=False))):
        with pytest.raises(ortkv.OrtkvError, match=r"the logits hold nan at token 3"):
            sampler(bad)
    with pytest.raises(ortkv.OrtkvError, match=r"all -inf"):
        Sampler(s)(np.full((1, 8), -np.inf))
    masked = np.full((1, 8), -np.inf)
    masked[0, 5] = 0.0  # -inf logits are masked tokens, not an error
    assert Sampler(s)(masked).tolist() == [5]


@pytest.mark.parametrize("key,value,message", [
    ("top_p", 1.5, r"search.top_p = 1.5 must be between 0 and 1"),
    ("top_p", -0.1, r"search.top_p = -0.1 must be between 0 and 1"),
    ("top_k", -1, r"search.top_k = -1 must be >= 0 \(0: every token\)"),
    ("temperature", -1.0, r"search.temperature = -1.0 must be >= 0 \(0: greedy\)"),
])
def test_sampling_settings_out_of_range_are_refused(key, value, message):
    with pytest.raises(ortkv.OrtkvError, match=message):
        search(do_sample=True, **{key: value})

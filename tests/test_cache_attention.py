"""CacheAttention (CPU) against the numpy oracle: GQA ratios, decode and prefill, rows of different
lengths in one batch, both cache layouts; and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cache_attention_model, ort_session
from ortkv.reference import cache_attention_ref


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("seq_axis", [1, 2])
def test_matches_reference(rng, heads, kv_heads, T, seq_axis):
    B, C, D = 3, 40, 16
    start = np.array([0, 13, 40 - T])  # empty row, middle, last slot
    q = rng.standard_normal((B, T, heads * D), dtype=np.float32)
    shape = (B, C, kv_heads, D) if seq_axis == 1 else (B, kv_heads, C, D)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    sess = ort_session(cache_attention_model(heads, kv_heads, seq_axis))
    (out,) = sess.run(None, {"q": q, "k": k, "v": v, "start": start})
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, start, heads, kv_heads, seq_axis=seq_axis),
                               rtol=2e-5, atol=2e-5)


def test_reads_only_valid_prefix(rng):
    """Keys past a row's valid length are never read: poisoning them with NaN changes nothing."""
    B, C, H, D = 2, 32, 2, 8
    k = rng.standard_normal((B, C, H, D), dtype=np.float32)
    v = rng.standard_normal((B, C, H, D), dtype=np.float32)
    start = np.array([5, 20])
    k[0, 6:], v[0, 6:], k[1, 21:], v[1, 21:] = np.nan, np.nan, np.nan, np.nan
    q = rng.standard_normal((B, 1, 2 * H * D), dtype=np.float32)
    (out,) = ort_session(cache_attention_model(2 * H, H)).run(None, {"q": q, "k": k, "v": v, "start": start})
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, start, 2 * H, H), rtol=2e-5, atol=2e-5)


def test_scalar_start(rng):
    q = rng.standard_normal((2, 3, 32), dtype=np.float32)
    k = rng.standard_normal((2, 10, 2, 16), dtype=np.float32)
    v = rng.standard_normal((2, 10, 2, 16), dtype=np.float32)
    (out,) = ort_session(cache_attention_model(2, 2, vector=False)).run(None, {"q": q, "k": k, "v": v, "start": np.array(4)})
    np.testing.assert_allclose(out, cache_attention_ref(q, k, v, 4, 2, 2), rtol=2e-5, atol=2e-5)


def test_refusals(rng):
    q = rng.standard_normal((1, 4, 32), dtype=np.float32)
    k = rng.standard_normal((1, 10, 2, 16), dtype=np.float32)
    sess = ort_session(cache_attention_model(2, 2))
    with pytest.raises(Exception, match=r"E_CAPACITY.*position 8 \+ n 4 = 12 exceeds capacity 10 of 'k'"):
        sess.run(None, {"q": q, "k": k, "v": k, "start": np.array([8])})
    with pytest.raises(Exception, match=r"E_INPUT.*start -1 for row 0 is negative"):
        sess.run(None, {"q": q, "k": k, "v": k, "start": np.array([-1])})
    bad = ort_session(cache_attention_model(3, 2))
    with pytest.raises(Exception, match=r"num_heads 3 must be a positive multiple of kv_num_heads 2"):
        bad.run(None, {"q": rng.standard_normal((1, 1, 48), dtype=np.float32), "k": k, "v": k, "start": np.array([0])})
    with pytest.raises(Exception, match=r"query width of num_heads \* D = 32"):
        sess.run(None, {"q": rng.standard_normal((1, 1, 30), dtype=np.float32), "k": k, "v": k, "start": np.array([0])})


# --- Note [CacheAttention CPU split-K]: key blocks of 64 (kAttnBlockKeys), split-K chunks of >= 256 keys
# (kAttnMinSplitKeys) while there are fewer than 24 (row, KV head, token) units. The cases below sit on
# those boundaries; every key and value slot past a row's valid length is NaN, so a chunk or block that
# reads one slot too far turns its row's output into NaN.


def _poisoned(rng, B, C, Hkv, D, start, T, seq_axis):
    shape = (B, C, Hkv, D) if seq_axis == 1 else (B, Hkv, C, D)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    for b, s in enumerate(np.broadcast_to(start, (B,))):
        tail = (b, slice(int(s) + T, None)) if seq_axis == 1 else (b, slice(None), slice(int(s) + T, None))
        k[tail], v[tail] = np.nan, np.nan
    return k, v


def _run_and_check(rng, heads, kv_heads, D, C, start, T=1, seq_axis=2, k=None, v=None, tol=2e-5):
    start = np.asarray(start, np.int64)
    B = start.shape[0]
    if k is None:
        k, v = _poisoned(rng, B, C, kv_heads, D, start, T, seq_axis)
    q = rng.standard_normal((B, T, heads * D), dtype=np.float32)
    k_before, v_before = k.copy(), v.copy()
    (out,) = ort_session(cache_attention_model(heads, kv_heads, seq_axis)).run(None, {"q": q, "k": k, "v": v, "start": start})
    assert np.isfinite(out).all(), "a NaN-poisoned slot past a row's valid length was read"
    ref = cache_attention_ref(q, k, v, start, heads, kv_heads, seq_axis=seq_axis)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    # the caches are read in place, never written
    np.testing.assert_array_equal(k, k_before)
    np.testing.assert_array_equal(v, v_before)
    return out


@pytest.mark.parametrize("seq_axis", [1, 2])
@pytest.mark.parametrize("keys", [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 2047])
def test_decode_block_and_split_boundaries(rng, keys, seq_axis):
    """Decode of one row (3 units: split-K from 512 keys on) at lengths around the key-block (64) and
    split-chunk boundaries, including a single key; the cache is longer than the row."""
    _run_and_check(rng, 9, 3, 64, keys + 37, [keys - 1], seq_axis=seq_axis)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("seq_axis", [1, 2])
def test_group_sizes_split_k(rng, group, seq_axis):
    """1..8 query heads per KV head, 2 KV heads, one decode row long enough to be split into chunks."""
    _run_and_check(rng, 2 * group, 2, 64, 1300, [1234], seq_axis=seq_axis)


@pytest.mark.parametrize("D", [8, 16, 20, 32, 48, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("seq_axis", [1, 2])
def test_head_sizes(rng, D, seq_axis):
    """Vector path (multiples of 16) and plain-loop path (8, 20: a tail under 8), split and unsplit."""
    _run_and_check(rng, 4, 2, D, 700, [699, 0, 300], seq_axis=seq_axis)
    _run_and_check(rng, 4, 2, D, 700, [650], seq_axis=seq_axis)


@pytest.mark.parametrize("seq_axis", [1, 2])
def test_rows_of_different_lengths_split_k(rng, seq_axis):
    """The longest row sets the split count: the short rows' later chunks are empty (one key, an
    empty cache but for the new token) and must contribute nothing; the long row ends mid-block."""
    _run_and_check(rng, 9, 3, 64, 3000, [2999 - 64 * 5 - 1, 0, 1, 64, 2900], seq_axis=seq_axis)


@pytest.mark.parametrize("seq_axis", [1, 2])
def test_prefill_across_blocks(rng, seq_axis):
    """A block of 70 new tokens (causal inside it) after 190 cached ones, next to a row whose block
    starts at 0: query t reads keys [0, start + t], across key-block boundaries."""
    _run_and_check(rng, 6, 2, 64, 300, [190, 0], T=70, seq_axis=seq_axis)


@pytest.mark.parametrize("seq_axis", [1, 2])
@pytest.mark.parametrize("T", [2, 11, 45])
def test_prefill_in_query_tiles(rng, seq_axis, T):
    """Note [Paged CPU query tiles] over a dense cache: tiles of up to 21 tokens (G = 3) and 32 (G = 2), the last one
    partial, in a cache exactly as long as the keys (no row past the last is read); two rows, one starting at 0."""
    _run_and_check(rng, 9, 3, 64, 37 + T, [37, 0], T=T, seq_axis=seq_axis)
    _run_and_check(rng, 4, 2, 32, 5 + T, [5, 3], T=T, seq_axis=seq_axis)


def test_prefill_tiles_keep_a_later_tokens_values_out(rng):
    """A tile's tokens share each key block, but an inf in token 12's value reaches only tokens 12 on (of that KV
    head's query heads): tokens 0-11 stay finite and equal to the reference."""
    heads, kv_heads, D, T = 9, 3, 64, 20
    k = rng.standard_normal((1, kv_heads, T, D), dtype=np.float32)
    v = rng.standard_normal((1, kv_heads, T, D), dtype=np.float32)
    v[0, 0, 12, 5] = np.inf
    q = rng.standard_normal((1, T, heads * D), dtype=np.float32)
    start = np.zeros(1, np.int64)
    (out,) = ort_session(cache_attention_model(heads, kv_heads, 2)).run(None, {"q": q, "k": k, "v": v, "start": start})
    ref = cache_attention_ref(q, k, v, start, heads, kv_heads, seq_axis=2)
    assert np.isfinite(out[0, :12]).all()
    np.testing.assert_allclose(out[0, :12], ref[0, :12], rtol=2e-5, atol=2e-5)
    assert not np.isfinite(out[0, 12:, :3 * D]).all()
    np.testing.assert_allclose(out[0, :, 3 * D:], ref[0, :, 3 * D:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rising", [True, False])
def test_online_softmax_rescaling(rng, rising):
    """Scores that grow (or shrink) by far more than exp's range along the keys: the running maximum
    changes from block to block and from chunk to chunk, and the merge of the split-K partials must
    weight each chunk by exp(its max - the overall max) (early chunks underflow to 0 when rising)."""
    B, Hkv, C, D = 1, 2, 1500, 64
    k, v = _poisoned(rng, B, C, Hkv, D, np.array([1400]), 1, 2)
    ramp = np.linspace(0.0, 30.0, C, dtype=np.float32)
    k *= (ramp if rising else ramp[::-1])[None, None, :, None]
    out = _run_and_check(rng, 4, 2, D, C, [1400], k=k, v=v, tol=5e-5)
    assert np.abs(out).max() > 0


def test_many_rows_unsplit(rng):
    """Enough units (B * Hkv >= 24) that no split is made: each task normalizes into the output."""
    _run_and_check(rng, 6, 3, 64, 600, list(range(0, 560, 70)) + [599])


@pytest.mark.parametrize("keys", [40, 100, 700])
def test_all_scores_far_below_zero(rng, keys):
    """Every score is about -300 (keys point away from the query): the block maximum must come from
    the real keys only; a padded slot of a partial key block taken as score 0 would flatten the
    softmax (every weight underflowing alike) instead of picking the least negative keys."""
    B, Hkv, D, heads = 1, 1, 64, 2
    q = rng.standard_normal((B, 1, heads * D), dtype=np.float32)
    C = keys + 5
    direction = q[0, 0, :D] / np.linalg.norm(q[0, 0, :D])
    k = np.empty((B, Hkv, C, D), np.float32)
    k[0, 0] = -2400.0 * direction / np.linalg.norm(q[0, 0, :D]) + rng.standard_normal((C, D), dtype=np.float32)
    k[0, 0, keys:] = np.nan
    v = rng.standard_normal((B, Hkv, C, D), dtype=np.float32)
    v[0, 0, keys:] = np.nan
    start = np.array([keys - 1])
    (out,) = ort_session(cache_attention_model(heads, Hkv, 2)).run(None, {"q": q, "k": k, "v": v, "start": start})
    ref = cache_attention_ref(q, k, v, start, heads, Hkv, seq_axis=2)
    s = (k[0, 0, :keys].astype(np.float64) @ q[0, 0, :D].astype(np.float64)) / 8
    assert s.max() < -100, s.max()  # the case is what it says
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("seq_axis", [1, 2])
@pytest.mark.parametrize("keys,starts", [(32768, [32767 - 45]), (8192 + 50, [8191, 100, 8192 + 49, 5000])])
def test_long_context_split_k(rng, keys, starts, seq_axis):
    """Decode at long contexts (Note [CacheAttention CPU split-K], Note [CPU attention native width]):
    one row of 32K keys split over 8 chunks of 64-key blocks, and 4 rows of up to 8K keys; NaN past
    every row's valid length, against the numpy reference."""
    _run_and_check(rng, 9, 3, 64, keys, starts, seq_axis=seq_axis, tol=3e-5)

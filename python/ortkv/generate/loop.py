"""The generation loop: tokenize, prefill, then sample and decode until eos or max_length.

    logits = runner.prefill(prompt_ids)          # every row's prompt in one run
    while not done:
        next = sample(logits)                     # greedy, or temperature / top-k / top-p with a seed
        logits = runner.step(next)                # one token per row, written in place (ortkv)
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import numpy as np

from .._memory import peak_rss_bytes, reset_peak, rss_bytes, rss_bytes_fast
from ..errors import OrtkvError
from .config import Search


@dataclass
class Sampler:
    """Picks the next token of each row from its logits, as onnxruntime-genai and Hugging Face do.

    Note [Sampling semantics]
    greedy (argmax, the lowest id among ties) when do_sample is false, temperature is 0 or top_k is 1;
    otherwise, in this order:
      * temperature T: logits / T (T < 1 sharpens, T > 1 flattens);
      * top_k k: keep the k most likely tokens; 0 keeps all (onnxruntime-genai's meaning, where 0
        selects its top-p-only path); k >= the vocabulary keeps all;
      * top_p p: of what top_k kept, renormalized, keep the smallest most-likely-first set whose mass is
        >= p, never fewer than one token (p = 0 keeps only the most likely; p = 1 keeps all);
      * draw from the kept tokens, renormalized, with this sampler's seeded generator.
    The nucleus cut is computed from the cumulative mass BEFORE each token (a token is kept while the
    mass ahead of it is < p), so rounding in the cumulative sum can never make the cut exceed the
    vocabulary (the old cut `searchsorted(cumsum, p) + 1` did exactly that at p = 1.0 whenever the sum
    rounded below 1, about every other step). Ties in probability are ordered by token id.
    onnxruntime-genai refuses temperature 0 when sampling; ortkv reads it as greedy, as llama.cpp does.
    """

    search: Search
    seed: int = 0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        s = self.search
        return not s.do_sample or s.temperature == 0 or s.top_k == 1

    def kept(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a draw can return for one row of logits, most likely first, and their renormalized
        probabilities (float64, summing to 1)."""
        s = self.search
        row = np.asarray(row, np.float64)
        if np.isnan(row).any() or np.isposinf(row).any():
            bad = int(np.flatnonzero(np.isnan(row) | np.isposinf(row))[0])
            raise OrtkvError(f"the logits hold {row[bad]} at token {bad}: the model produced no usable distribution")
        if self.greedy:
            return np.array([int(row.argmax())]), np.ones(1)
        if np.isneginf(row).all():
            raise OrtkvError("the logits are all -inf: the model produced no usable distribution")
        row = row / s.temperature
        order = np.argsort(-row, kind="stable")  # most likely first, ties by token id
        if 0 < s.top_k < len(order):
            order = order[: s.top_k]
        p = np.exp(row[order] - row[order[0]])  # row[order[0]] is the finite maximum: p[0] = 1
        p /= p.sum()
        if s.top_p < 1.0:
            before = np.cumsum(p) - p  # mass ahead of each token
            keep = max(1, int(np.count_nonzero(before < s.top_p)))
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return order, p

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits)
        if self.greedy:
            if np.isnan(logits).any():  # argmax would return the NaN's index as if it were the best token
                self.kept(logits[np.isnan(logits).any(axis=-1)][0])  # raises, naming the token
            return logits.argmax(axis=-1).astype(np.int64)
        out = np.empty(len(logits), np.int64)
        for b, row in enumerate(logits):
            order, p = self.kept(row)
            c = np.cumsum(p)
            i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
            out[b] = order[min(i, len(order) - 1)]
        return out


@dataclass
class Generation:
    prompt_ids: list[list[int]]
    new_ids: list[list[int]] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    kv_bytes: int = 0
    kv_live_bytes: int = 0  # bytes the tokens fill (kv_bytes is what is resident: committed, preallocated)
    step_s: list[float] = field(default_factory=list)  # each decode step's runner.step time
    peak_device_above_load: int | None = None  # CUDA: peak device memory in use above the loaded model
    kv_bytes_per_step: list[int] = field(default_factory=list)
    rss_per_step: list[int] = field(default_factory=list)
    peak_rss_above_load: int | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(len(p) for p in self.prompt_ids) / self.prefill_s if self.prefill_s else 0.0

    @property
    def median_step_ms(self) -> float:
        return float(np.median(self.step_s)) * 1e3 if self.step_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps * len(self.prompt_ids) / self.decode_s if self.decode_s else 0.0


def check_prompts(prompt_ids: list[list[int]], max_length: int, vocab_size: int | None = None) -> None:
    """Refuse a batch that would generate nothing, or holds a token id outside the vocabulary (the 4-bit
    embedding lookup, GatherBlockQuantized, returns a zero row for one instead of failing). Callers run
    this before loading a model, too."""
    if not prompt_ids:
        raise OrtkvError("no prompt given: nothing to condition on")
    for b, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise OrtkvError(f"prompt {b + 1} of {len(prompt_ids)} is empty (0 tokens): nothing to condition on; "
                             "give some text")
        if vocab_size is not None:
            bad = [int(t) for t in p if not 0 <= int(t) < vocab_size]
            if bad:
                raise OrtkvError(f"prompt {b + 1} of {len(prompt_ids)} holds token id {bad[0]} outside the "
                                 f"vocabulary [0, {vocab_size}); the tokenizer and model.vocab_size disagree")
    longest = max(len(p) for p in prompt_ids)
    if longest >= max_length:
        raise OrtkvError(f"the prompt has {longest} tokens but search.max_length is {max_length}: nothing "
                         "would be generated; raise max_length or shorten the prompt")


def generate(runner, prompt_ids: list[list[int]], search: Search, max_new_tokens: int, eos_id: int, pad_id: int,
             seed: int = 0, on_token=None) -> Generation:
    """Generate for a batch of prompts (of any lengths). ``on_token(row, token_id)`` streams tokens."""
    cfg = getattr(runner, "cfg", None)
    check_prompts(prompt_ids, search.max_length, cfg.model.vocab_size if cfg is not None else None)
    lengths = np.array([len(p) for p in prompt_ids], np.int64)
    longest = int(lengths.max())
    budget = min(max_new_tokens, search.max_length - longest)
    ids = np.full((len(prompt_ids), longest), pad_id, np.int64)
    for b, p in enumerate(prompt_ids):
        ids[b, : len(p)] = p
    sample = Sampler(search, seed)
    g = Generation(prompt_ids=[list(p) for p in prompt_ids], new_ids=[[] for _ in prompt_ids])
    reset = reset_peak()
    start_rss = rss_bytes()  # model loaded, no generation state yet: peaks are measured above this
    device_memory = None
    if cfg is not None and getattr(cfg, "device", "cpu") != "cpu":
        from .runners import DeviceMemory

        device_memory = DeviceMemory(cfg)  # baseline: the model loaded, no caches yet
    runner.start(len(prompt_ids), search.max_length)
    # Note [Greedy on the device]: a CUDA runner picks greedy tokens where its logits are (ArgMax on the
    # device, or onnxruntime-genai's own greedy step), so a step returns [B] ids, not [B, V] float32 logits
    on_device = sample.greedy and getattr(runner, "greedy_on_device", False)
    t0 = time.perf_counter()
    if on_device:
        chosen = runner.prefill_tokens(ids, lengths)
    else:
        logits = runner.prefill(ids, lengths)
    g.prefill_s = time.perf_counter() - t0
    if device_memory is not None:
        device_memory.sample()
    done = np.zeros(len(prompt_ids), bool)
    # Note [No collector in the decode loop]: Python's cyclic garbage collector is paused while the loop runs.
    # The loop allocates a few small objects per step (logits, ids) that reference counting frees at once,
    # but those allocations still trigger the collector, and every ~128 steps a full (oldest-generation)
    # collection walked every object of the process -- the tokenizer, the ONNX model's protobufs -- for 8-17 ms
    # in the middle of a ~22 ms step (float32 SmolLM2 on 2 CPUs). Cycles made during the loop (none are known)
    # are collected when it ends and the collector is switched back on.
    collecting = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for step in range(budget):
            nxt = chosen if on_device else sample(logits)
            for b, tok in enumerate(nxt):
                if done[b]:
                    continue
                g.new_ids[b].append(int(tok))
                if on_token:
                    on_token(b, int(tok))
                if tok == eos_id and len(g.new_ids[b]) >= search.min_length:
                    done[b] = True
            g.kv_bytes_per_step.append(runner.kv_bytes())
            g.rss_per_step.append(rss_bytes_fast())
            if done.all() or step == budget - 1:
                break
            t_step = time.perf_counter()
            if on_device:
                chosen = runner.step_tokens(np.where(done, pad_id, nxt))
            else:
                logits = runner.step(np.where(done, pad_id, nxt))
            g.step_s.append(time.perf_counter() - t_step)
            g.decode_steps += 1
            if device_memory is not None:
                device_memory.sample()
        g.decode_s = time.perf_counter() - t0
    finally:
        if collecting:
            gc.enable()
    g.kv_bytes = runner.kv_bytes()
    g.kv_live_bytes = runner.kv_live_bytes() if hasattr(runner, "kv_live_bytes") else g.kv_bytes
    if device_memory is not None:
        g.peak_device_above_load = device_memory.peak_above_baseline
    if reset:
        g.peak_rss_above_load = peak_rss_bytes() - start_rss
    return g


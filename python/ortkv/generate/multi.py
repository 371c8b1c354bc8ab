"""Many sequences on one page pool: the paged decoder driven by ``ortkv.cache`` (PageCache placements,
the Scheduler), parallel sampling (``num_return_sequences``), beam search (``num_beams``) and
``generate_many`` (many prompts, tokens streamed as they come).

    runner = MultiRunner.from_config(cfg, max_sequences=16)
    for ev in generate_many(["Hello", "The sky is"], runner=runner, max_new_tokens=32, n=4):
        print(ev.request, ev.sample, ev.token)
    beams = beam_search(runner, prompt_ids, num_beams=4, max_new_tokens=16)

Note [Placement runs]
~~~~~~~~~~~~~~~~~~~~~
A ``Placement`` says where each row's new tokens go (page_table and page_fill rows, start). The paged
decoder (built with the page_fill input, Note [Paged decoder]) takes input_ids [B, T] with one T for the
whole batch and writes every one of the T tokens of a row, so rows are grouped by token count
(``Placement.runs()``) and each group is one ORT run on the page_table rows, page_fill rows and starts of
that group: no padding token is ever written into a page. No KV byte is moved before or between runs
(Note [Page metadata]: forks and reorders share pages through fills). The runs of one step are
independent (no two rows write one (page, row), and no row writes a row another sequence sees), so
their order does not matter. If a run fails, the step is cancelled (``PageCache.cancel``: pages it took
go back, fills and marks restored) and the error propagates; nothing is half-admitted.

On CUDA the same runs go through the CUDA execution provider: the pool in a
CUDA arena, the directory the pool's device copy, input ids / starts / page-table rows fed from the host
(small; ORT copies them up), logits [B, T, V] brought back to the host, where the samplers and the beam
scores work in float64 as on the CPU. No CUDA graph here: the batch and T change from step to step.

Note [Beam search on pages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Beams are cache sequences. The prompt is prefilled once on beam 0, which is forked into the others
(every page shared, none copied) with scores (0, -inf, ...), so the first step chooses only among beam
0's continuations (Hugging Face's and onnxruntime-genai's start). Each step:
  1. scores = log_softmax(logits of each beam) + the beam's running score; the 2 x num_beams best of
     all num_beams x vocab candidates, best first (ties: lower beam, then lower token id);
  2. going down that list, a candidate ending in eos (only among the first num_beams) becomes a
     finished hypothesis, scored sum_logprobs / length ** length_penalty, length = prompt + generated
     tokens without the eos (onnxruntime-genai's BeamHypotheses); other candidates fill the next
     num_beams beams;
  3. the search is done when num_beams hypotheses are finished and early_stopping is set, or when the
     best running beam cannot beat the worst kept hypothesis (its score / current length **
     length_penalty <= the worst's; current length = prompt + generated, this step's token included);
     it also ends at max_new_tokens / max_length, and then (only then, as in Hugging Face's finalize)
     the running beams are offered as hypotheses too;
  4. the reorder: ``PageCache.reorder(beams, parents)``: beam i takes over its parent's entries (pages
     and fills). A page-table change: no KV byte moves. Then one decode step admits each beam's new
     token; of beams sharing a partly filled last page (two children of one parent), the first appends
     to it and the others write into a new page each (Note [Page metadata]). No KV byte is ever copied:
     the pool's ``bytes_copied`` stays 0 (BeamStats.bytes_copied_per_step records it per step).
The ``num_return_sequences`` best hypotheses are returned, best first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from ..cache import PageCache, Scheduler
from ..cache.pool_store import PoolPageStore
from ..cache.scheduler import Event
from ..errors import OrtkvError
from ..reference.codecs import KEYS_PER_CHANNEL
from .builder import LOGITS_START
from .config import GenAIConfig, Search
from .loop import Sampler

__all__ = ["BeamResult", "MultiRunner", "beam_search", "generate_many", "sample_many"]


def write_format(cfg: GenAIConfig):
    """The one format pages are written in: ortkv.kv_format (f16 when unset). A policy that changes page
    formats as sequences grow (kv_policy, kv_page_formats) is refused here: shared pages would be
    requantized under other owners (not supported by the many-sequence path yet)."""
    from ..paged import parse_format

    o = cfg.ortkv
    if o.kv_policy or o.kv_page_formats:
        raise OrtkvError("num_return_sequences / num_beams > 1 and generate_many write every page in one format: "
                         "set ortkv.kv_format (or --kv-format) and remove ortkv.kv_policy / ortkv.kv_page_formats")
    fmt = parse_format(o.kv_format or "f16", "ortkv.kv_format")
    if fmt in KEYS_PER_CHANNEL:
        raise OrtkvError(f"ortkv.kv_format = {o.kv_format!r}: a keys-per-channel format is encoded a whole page at "
                         "a time and cannot be written token by token by many sequences; use f16, bf16, int8, "
                         "fp8_e4m3, int4 or int2")
    return fmt


class MultiRunner:
    """The paged decoder over one PagePool whose pages a PageCache owns (Note [Placement runs]).
    ``cache`` (a PageCache), ``store`` (PoolPageStore), ``pool`` (PagePool)."""

    def __init__(self, path, cfg: GenAIConfig, max_sequences: int = 16, max_length: int | None = None,
                 budget_bytes: int | None = None, max_pages: int | None = None, prefix_caching: bool = True):
        from ..paged import PagePool
        from ..session import MutableCacheSession
        from ..vmm import Governor
        from .paged import POOL, _session_options
        from .runners import providers_for, takes_logits_start, weights_resident

        import onnx

        if "page_fill" not in {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}:
            raise OrtkvError(f"MultiRunner: {path} has no page_fill input; the many-sequence path binds each row's "
                             "fills (Note [Page fill]). Build the decoder with to_paged(..., page_fill=True) or use "
                             "paged_model_path(cfg, page_fill=True)")
        if cfg.device == "cpu" and cfg.dtype != "float32":
            raise OrtkvError(f"the many-sequence path runs the paged decoder on the CPU in float32; got dtype "
                             f"{cfg.dtype}: use dtype float32 (or auto) on the CPU, float16 on CUDA")
        self.cfg = cfg
        d, o = cfg.model.decoder, cfg.ortkv
        self.fmt = write_format(cfg)
        self.max_length = int(max_length or cfg.search.max_length)
        ps = o.page_size
        self.pages_per_seq = -(-self.max_length // ps)
        self.layers = d.num_hidden_layers
        self.sess = MutableCacheSession(str(path), sess_options=_session_options(cfg, path, self),
                                        providers=providers_for(cfg))
        weights_resident(cfg, path)
        self._head_from = takes_logits_start(self.sess.session)  # Note [Logits from logits_start] in builder.py
        self.pool = PagePool(self.layers, d.num_key_value_heads, d.head_size, ps,
                             {"float32": np.float32, "float16": np.float16}[cfg.dtype], cfg.device,
                             Governor(budget_bytes or o.arena_budget_bytes),
                             max_pages=max_pages or max_sequences * self.pages_per_seq)
        self.store = PoolPageStore(self.pool)
        key = f"{cfg.ortkv.gguf or cfg.ortkv.source}/{cfg.ortkv.weights}/{self.layers}/{self.fmt.name}".encode()
        # entries: each holds >= 1 token and a write opens at most one page because another sequence held the
        # mark (Note [Page metadata]), so pages + max_length entries never refuse a sequence for fragmentation
        self.cache = PageCache(self.store, ps, self.pages_per_seq, max_sequences, fmt=int(self.fmt), model_key=key,
                               prefix_caching=prefix_caching, max_entries=self.pages_per_seq + self.max_length)
        self._pool_name = POOL
        self.sess.bind_cache(POOL, self.pool.pool)
        self.runs = 0            # ORT runs
        self.tokens_computed = 0  # tokens fed through the model

    @classmethod
    def from_config(cls, cfg: GenAIConfig, log=print, **kw) -> "MultiRunner":
        from .paged import paged_model_path

        return cls(paged_model_path(cfg, log, page_fill=True), cfg, **kw)

    def forward(self, placement, all_logits: bool = False) -> np.ndarray:
        """Run an admitted step (Note [Placement runs]); the caller then calls ``cache.done(placement)``.
        Returns the last position's logits of each row [B, V] (``all_logits``: a list of [T_b, V])."""
        if any(t is None for t in placement.tokens):
            self.cache.cancel(placement)
            raise OrtkvError("MultiRunner.forward: the placement was admitted with token counts; admit token ids "
                             "(the model needs them)")
        try:
            out = [None] * placement.batch
            for rows, t in placement.runs():
                ids = np.stack([placement.tokens[r] for r in rows]).astype(np.int64)
                # Note [Logits from logits_start] in builder.py: the rows of a run have one token count, so only its
                # last position's logits are computed unless every position's are asked for
                head = {LOGITS_START: np.array([ids.shape[1] - 1], np.int64)} \
                    if self._head_from and not all_logits else {}
                (logits,) = self.sess.run(["logits"], {
                    "input_ids": ids, "positions": placement.start[rows],
                    "directory": self.pool.directory_input(),  # Note [Page pool on CUDA]
                    "page_table": np.ascontiguousarray(placement.page_table[rows]),
                    "page_fill": np.ascontiguousarray(placement.page_fill[rows]), **head})
                self.runs += 1
                self.tokens_computed += ids.size
                for j, r in enumerate(rows):
                    out[r] = logits[j] if all_logits else logits[j, -1]
        except BaseException:
            self.cache.cancel(placement)
            raise
        return out if all_logits else np.stack(out)

    def step(self, entries) -> np.ndarray:
        """Admit ``entries`` ({seq: token ids}), run, finish; last logits [B, V] in the entries' order.
        A refusal raises CapacityError with its reason."""
        from ..errors import CapacityError

        p = self.cache.admit(entries)
        if not p:
            raise CapacityError(f"MultiRunner.step: {p.reason}", requested=p.pages_needed)
        logits = self.forward(p)
        self.cache.done(p)
        return logits

    def warm_prefix(self, tokens) -> int:
        """Prefill ``tokens`` (a shared system prompt) once and keep its full pages in the prefix cache
        (unreferenced, evicted LRU under pressure): later prompts that start with them prefill only the
        rest. Returns the tokens now cached (a multiple of page_size)."""
        if not self.cache.prefix_caching:
            raise OrtkvError("MultiRunner.warm_prefix: this runner was built with prefix_caching=False, so no page "
                             "would be kept; build it with prefix_caching=True")
        ids = np.asarray(tokens, np.int64)
        sid = self.cache.fresh_id()
        reused = self.cache.new_sequence(sid, np.append(ids, 0))  # +1: every full page of ids may be a hit
        try:
            if reused < ids.size:
                self.step({sid: ids[reused:]})
        finally:
            self.cache.remove(sid)
        return (ids.size // self.cache.page_size) * self.cache.page_size

    # -- reports -----------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        return self.pool.committed_bytes

    def stats(self) -> dict:
        s = self.pool.stats()
        s.update(page_size=self.pool.page_size, format=self.fmt.name, runs=self.runs,
                 tokens_computed=self.tokens_computed, copies=self.store.copies,
                 prefix_hits=self.cache.prefix.hits, evictions=self.cache.prefix.evictions)
        return s

    def close(self) -> None:
        if self.pool is not None:
            if self.cache._pending is not None:  # a step admitted and never run (an abandoned caller)
                self.cache.cancel(self.cache._pending)
            for s in list(self.cache.sequences):
                self.cache.remove(s)
            self.sess.unbind_cache(self._pool_name)
            self.sess.close()
            self.pool.close()
            self.pool = None


# --- parallel sampling and many prompts through the Scheduler ------------------------------------------
def _forward_sampler(runner: MultiRunner, sample: Sampler):
    def forward(step):
        logits = runner.forward(step.placement)
        out = {}
        for b, row in enumerate(step.rows):
            if row.wants_token:
                draws = sample(np.repeat(logits[b][None], row.draws, axis=0))
                out[row.seq] = draws if row.draws > 1 else int(draws[0])
        return out

    return forward


def generate_many(prompts: Iterable, runner: MultiRunner, max_new_tokens: int, n: int = 1,
                  search: Search | None = None, seed: int = 0, eos_token_id: int | None = None,
                  max_step_tokens: int = 2048, scheduler: Scheduler | None = None) -> Iterator[Event]:
    """Submit every prompt (token ids) to a Scheduler over ``runner``'s cache and yield an ``Event``
    (``request``, ``sample``, ``token``, ``finished``) for every token as it is produced; request ids
    are the prompts' indices. ``n`` samples per prompt share the prompt's pages (fork); ``search``
    (greedy when None) picks tokens with a Sampler seeded by ``seed``. Pass ``scheduler`` to read its
    counters (prefill_tokens, reused_tokens, preemptions) afterwards."""
    search = search or Search()
    sched = scheduler or Scheduler(runner.cache, max_step_tokens=max_step_tokens)
    eos = runner.cfg.model.eos_token_id if eos_token_id is None else eos_token_id
    ids = [[int(t) for t in p] for p in prompts]
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > runner.max_length:
            raise OrtkvError(f"generate_many: prompt {i} has {len(p)} tokens + max_new_tokens {max_new_tokens} > "
                             f"the runner's max_length {runner.max_length}; shorten it or build the runner with "
                             "a larger max_length")
    base = sched._next_req
    for p in ids:
        sched.submit(p, max_new_tokens, n=n, eos_token_id=eos)
    forward = _forward_sampler(runner, Sampler(search, seed))
    for ev in sched.stream(forward):
        yield Event(ev.request - base, ev.sample, ev.token, ev.finished)


def sample_many(prompt_ids, runner: MultiRunner, n: int, max_new_tokens: int, search: Search | None = None,
                seed: int = 0, eos_token_id: int | None = None) -> list[list[int]]:
    """``num_return_sequences`` = n for one prompt: prefill once, fork n, sample each; the n token lists."""
    out = [[] for _ in range(n)]
    for ev in generate_many([prompt_ids], runner, max_new_tokens, n=n, search=search, seed=seed,
                            eos_token_id=eos_token_id):
        out[ev.sample].append(ev.token)
    return out


# --- beam search (Note [Beam search on pages]) ------------------------------------------------------------
@dataclass
class BeamResult:
    tokens: list              # generated tokens (without a final eos)
    score: float              # sum_logprobs / length ** length_penalty
    sum_logprobs: float
    eos: bool                 # ended by eos (else by length)


@dataclass
class BeamStats:
    steps: int = 0
    bytes_copied_per_step: list = field(default_factory=list)  # the pool's counter: 0 (Note [Page metadata])
    copies_per_step: list = field(default_factory=list)        # PoolPageStore.copy calls: 0
    boundary_steps: list = field(default_factory=list)   # steps whose writes start on a page boundary
    pages_held_per_step: list = field(default_factory=list)  # distinct pages owned by the beams after each step
    seconds: float = 0.0
    tokens: int = 0                                       # beam tokens decoded (num_beams per step)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _top_candidates(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k best (beam, token) of scores [num_beams, V], best first, ties by (beam, token)."""
    flat = scores.reshape(-1)
    k = min(k, flat.size)
    part = np.argpartition(-flat, k - 1)[:k]
    thresh = flat[part].min()
    cand = np.flatnonzero(flat >= thresh)            # every tie at the threshold, then a stable order
    cand = cand[np.lexsort((cand, -flat[cand]))][:k]
    v = scores.shape[1]
    return cand // v, cand % v, flat[cand]


class _Hypotheses:
    def __init__(self, num_beams: int, length_penalty: float, early_stopping: bool):
        self.n, self.lp, self.early = num_beams, length_penalty, early_stopping
        self.items: list[BeamResult] = []

    def score(self, sum_logprobs: float, length: int) -> float:
        return sum_logprobs / (length ** self.lp)

    def worst(self) -> float:
        return min(h.score for h in self.items) if self.items else float("inf")

    def add(self, tokens, sum_logprobs: float, length: int, eos: bool) -> None:
        s = self.score(sum_logprobs, length)
        if len(self.items) < self.n or s > self.worst():
            self.items.append(BeamResult(list(tokens), s, sum_logprobs, eos))
            if len(self.items) > self.n:
                self.items.remove(min(self.items, key=lambda h: h.score))

    def done(self, best_running: float, length: int) -> bool:
        if len(self.items) < self.n:
            return False
        if self.early:
            return True
        return self.worst() >= self.score(best_running, length)


def beam_search(runner: MultiRunner, prompt_ids, num_beams: int, max_new_tokens: int,
                length_penalty: float = 1.0, early_stopping: bool = True, num_return_sequences: int = 1,
                eos_token_id: int | None = None, stats: BeamStats | None = None) -> list[BeamResult]:
    """Beam search on the page pool (Note [Beam search on pages]); the ``num_return_sequences`` best
    hypotheses, best first. ``stats`` (a BeamStats) collects bytes copied per step."""
    cache = runner.cache
    prompt = [int(t) for t in prompt_ids]
    eos = runner.cfg.model.eos_token_id if eos_token_id is None else eos_token_id
    if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
        raise OrtkvError(f"beam_search: num_beams = {num_beams}, num_return_sequences = {num_return_sequences}: "
                         "need 1 <= num_return_sequences <= num_beams")
    if not prompt:
        raise OrtkvError("beam_search: empty prompt; give at least one token")
    budget = min(max_new_tokens, runner.max_length - len(prompt))
    if budget < 1:
        raise OrtkvError(f"beam_search: the prompt has {len(prompt)} tokens and the runner holds "
                         f"{runner.max_length} (max_length): nothing would be generated")
    if num_beams > cache.free_slots:
        raise OrtkvError(f"beam_search: {num_beams} beams but the cache has {cache.free_slots} free sequence slots; "
                         "build the runner with max_sequences >= num_beams")
    stats = stats if stats is not None else BeamStats()
    ps = cache.page_size
    t0 = time.perf_counter()
    beams = [cache.fresh_id() for _ in range(num_beams)]
    hyps = _Hypotheses(num_beams, length_penalty, early_stopping)
    try:
        reused = cache.new_sequence(beams[0], prompt)
        logits = runner.step({beams[0]: np.asarray(prompt[reused:], np.int64)})
        cache.fork_n(beams[0], beams[1:])
        logits = np.repeat(logits, num_beams, axis=0)
        scores = np.full(num_beams, -np.inf)
        scores[0] = 0.0
        generated = [[] for _ in range(num_beams)]
        for step in range(budget):
            total = log_softmax(logits) + scores[:, None]
            parents, tokens, cand = _top_candidates(total, 2 * num_beams)
            new_parents, new_tokens, new_scores = [], [], []
            for rank, (b, t, s) in enumerate(zip(parents, tokens, cand)):
                if t == eos:
                    if rank < num_beams:
                        hyps.add(generated[b], float(s), len(prompt) + len(generated[b]), True)
                    continue
                new_parents.append(int(b)), new_tokens.append(int(t)), new_scores.append(float(s))
                if len(new_parents) == num_beams:
                    break
            cur_len = len(prompt) + step + 1
            if hyps.done(max(new_scores, default=-np.inf), cur_len):
                stats.steps = step + 1
                break
            if len(new_parents) < num_beams or step == budget - 1:
                # out of length: the running beams (with their new tokens) compete with the finished ones
                for b, t, s in zip(new_parents, new_tokens, new_scores):
                    hyps.add(generated[b] + [t], s, cur_len, False)
                stats.steps = step + 1
                break
            generated = [generated[b] + [t] for b, t in zip(new_parents, new_tokens)]
            scores = np.array(new_scores)
            cache.reorder(beams, [beams[b] for b in new_parents])
            copied0, copies0 = runner.pool.bytes_copied, runner.store.copies
            stats.boundary_steps.append(cache.length(beams[0]) % ps == 0)
            logits = runner.step({sid: np.array([t], np.int64) for sid, t in zip(beams, new_tokens)})
            stats.bytes_copied_per_step.append(runner.pool.bytes_copied - copied0)
            stats.copies_per_step.append(runner.store.copies - copies0)
            stats.pages_held_per_step.append(len({p for sid in beams for p in cache.pages_of(sid)}))
            stats.tokens += num_beams
    finally:
        for sid in beams:
            if sid in cache.sequences:
                cache.remove(sid)
    stats.seconds = time.perf_counter() - t0
    best = sorted(hyps.items, key=lambda h: -h.score)
    return best[:num_return_sequences]


# --- ortkv generate --cache paged --num-return-sequences N / --num-beams N --------------------------------
def run_multi(cfg: GenAIConfig, prompts: list, prompt_ids: list, tok, log=print, path=None) -> dict:
    """``ortkv generate`` with num_return_sequences or num_beams > 1 (cli.run_one calls it): every prompt
    through one MultiRunner; samples by the Scheduler (all prompts at once), beams prompt by prompt.
    ``path``: the paged decoder's model.onnx (built from the config when None)."""
    from .._memory import peak_rss_bytes, rss_bytes

    s = cfg.search
    n = s.num_return_sequences
    beams = s.num_beams
    width = max(beams, n * len(prompts)) if beams == 1 else beams
    rss0 = rss_bytes()
    if path is None:
        from .paged import paged_model_path

        path = paged_model_path(cfg, log, page_fill=True)
    runner = MultiRunner(path, cfg, max_sequences=width, max_length=s.max_length)
    rss_load = rss_bytes()
    seqs, peak_kv = [], 0
    t0 = time.perf_counter()
    new_tokens = 0
    try:
        if beams > 1:
            for i, p in enumerate(prompt_ids):
                stats = BeamStats()
                res = beam_search(runner, p, beams, min(cfg.ortkv.max_new_tokens, s.max_length - len(p)),
                                  s.length_penalty, s.early_stopping, n, cfg.model.eos_token_id, stats)
                peak_kv = max(peak_kv, runner.kv_bytes())
                new_tokens += stats.tokens
                for j, h in enumerate(res):
                    seqs.append({"prompt": i, "index": j, "new_ids": h.tokens, "text": tok.decode(h.tokens),
                                 "score": h.score, "eos": h.eos})
        else:
            out = {}
            budget = min(cfg.ortkv.max_new_tokens, s.max_length - max(len(p) for p in prompt_ids))
            for ev in generate_many(prompt_ids, runner, budget, n=n, search=s, seed=cfg.ortkv.seed,
                                    eos_token_id=cfg.model.eos_token_id):
                out.setdefault((ev.request, ev.sample), []).append(ev.token)
                peak_kv = max(peak_kv, runner.kv_bytes())
                new_tokens += 1
            for (i, j), ids in sorted(out.items()):
                seqs.append({"prompt": i, "index": j, "new_ids": ids, "text": tok.decode(ids)})
        seconds = time.perf_counter() - t0
        stats = runner.stats()
    finally:
        runner.close()
    return {"variant": "ortkv", "prompts": prompts, "prompt_ids": [list(p) for p in prompt_ids],
            "new_ids": [q["new_ids"] for q in seqs], "texts": [q["text"] for q in seqs], "sequences": seqs,
            "prefill_tok_s": None, "decode_tok_s": new_tokens / seconds if seconds else 0.0, "kv_bytes": peak_kv,
            "seconds": seconds, "tokens": new_tokens,
            "peak_rss_above_load": None, "model_rss": rss_load - rss0, "peak_rss": peak_rss_bytes(),
            "weights": cfg.ortkv.weights, "cache": "paged", "device": cfg.device, "dtype": cfg.dtype,
            "cache_layout": "paged", "cuda_graph": False, "kv_committed_bytes": peak_kv,
            "kv_live_bytes": stats["live_bytes"], "median_step_ms": None, "peak_device_above_load": None,
            "search": {"do_sample": s.do_sample, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                       "max_length": s.max_length, "max_new_tokens": cfg.ortkv.max_new_tokens,
                       "seed": cfg.ortkv.seed, "num_beams": beams, "num_return_sequences": n,
                       "length_penalty": s.length_penalty, "early_stopping": s.early_stopping},
            "kv_bytes_per_step": [], "rss_per_step": [], "paged": stats}


def multi_summary(r: dict) -> str:
    """The summary line of a run_multi result (``ortkv generate`` text output)."""
    s, p = r["search"], r["paged"]
    what = f"{s['num_beams']} beams" if s["num_beams"] > 1 else f"{s['num_return_sequences']} samples per prompt"
    unit = "beam tokens" if s["num_beams"] > 1 else "tokens"
    return (f"[ortkv paged, {what}] {r['tokens']} {unit} in {r['seconds']:.2f} s ({r['decode_tok_s']:.1f}/s, prefill "
            f"included) | KV committed peak {r['kv_bytes'] / 2**20:.1f} MiB ({p['format']} pages of {p['page_size']}) "
            f"| KV bytes copied {p['bytes_copied']} | peak RSS "
            f"{r['peak_rss'] / 2**20:.1f} MiB")

"""Host bookkeeping of ortkv.cache per decode step, and the KV bytes of parallel sampling.

  bookkeeping: 64 sequences near 8,192 cells each (page_size 16, 512 pages per sequence), one new
               token each per step: admit (placement + page table rows) + the valid-length view the
               paged ops take (lengths, position ids, slot mapping) + done (rows written, prefix keys
               of pages that filled); the dense boolean masks timed apart. Median and p90 per step over the steps from 8,000
               to 8,191 cells; the goal is <= 1 ms. Also at 1,024 cells, to show the per-step cost
               does not grow with the cells held.
  prefix:      32 requests sharing a 512-token system prompt: prompt tokens computed.
  beams:       4 beams reordered every step: KV bytes copied.
  memory:      N parallel samples (N = 1, 4, 16) of a P-token prompt, G new tokens each, forked after
               the prefill: KV bytes held (pages x page bytes, SmolLM2-135M F16 pages) vs N full copies
               (what onnxruntime-genai holds: one cache per sequence, at least P + G tokens each).

    python benchmarks/bench_cache_bookkeeping.py [--steps N] [--out benchmarks/results/cache_bookkeeping.md]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ortkv.cache import MemoryPageStore, PageCache

from _report import emit  # benchmarks/ is on sys.path when a script runs

PAGE_SIZE = 16
# SmolLM2-135M: 30 layers, 3 KV heads, head_size 64; one F16 page for all layers = K and V
SMOL_PAGE_BYTES = 30 * 2 * 3 * PAGE_SIZE * 64 * 2


def bench_steps(batch: int, cells: int, steps: int, prefix_caching: bool) -> dict:
    max_pages = cells // PAGE_SIZE
    store = MemoryPageStore(batch * max_pages + 8, PAGE_SIZE, {0: SMOL_PAGE_BYTES})
    cache = PageCache(store, PAGE_SIZE, max_pages, max_sequences=batch, prefix_caching=prefix_caching)
    rng = np.random.default_rng(0)
    start = cells - steps - 1
    for b in range(batch):
        cache.new_sequence(b)
    p = cache.admit({b: rng.integers(0, 49152, start) for b in range(batch)})
    cache.done(p)
    t_admit, t_view, t_done, t_total, t_dense, cpu_total = [], [], [], [], [], []
    for i in range(steps):
        toks = {b: np.array([(i * 7 + b) % 49152]) for b in range(batch)}
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        p = cache.admit(toks)
        t1 = time.perf_counter_ns()
        lengths = p.lengths                  # the valid-length view: with page_table and start, all
        pos = p.position_ids()               # that PagedCacheUpdate / PagedCacheAttention need
        slots = p.slot_mapping()
        t2 = time.perf_counter_ns()
        cache.done(p)
        t3 = time.perf_counter_ns()
        cpu_total.append(time.thread_time_ns() - c0)
        km = p.key_mask()                    # the dense masks, for other kernels (O(cells))
        am = p.attention_mask()
        t4 = time.perf_counter_ns()
        assert p and km.shape == (batch, cells) and am.shape == (batch, 1, cells) and slots.size == batch
        assert int(pos[0, 0]) == start + i and int(lengths[0]) == start + i + 1
        t_admit.append(t1 - t0), t_view.append(t2 - t1), t_done.append(t3 - t2), t_total.append(t3 - t0)
        t_dense.append(t4 - t3)
    us = lambda xs, q=50: np.percentile(xs, q) / 1e3  # noqa: E731
    return dict(admit=us(t_admit), view=us(t_view), done=us(t_done), total=us(t_total),
                p90=us(t_total, 90), dense=us(t_dense), cpu=us(cpu_total), cpu_p90=us(cpu_total, 90),
                cpu_max=us(cpu_total, 100),
                with_dense=us(np.add(t_total, t_dense)), pages=len(store.live))


def memory(prompt: int, new: int, n: int) -> dict:
    pages_per_seq = -(-(prompt + new) // PAGE_SIZE)
    store = MemoryPageStore(n * pages_per_seq + 8, PAGE_SIZE, {0: SMOL_PAGE_BYTES})
    cache = PageCache(store, PAGE_SIZE, pages_per_seq, max_sequences=n, prefix_caching=False)
    cache.new_sequence(0)
    cache.done(cache.admit({0: prompt}))
    cache.fork_n(0, range(1, n))
    for _ in range(new):
        cache.done(cache.admit({s: 1 for s in range(n)}))   # nothing to copy (Note [Page metadata])
    token_bytes = SMOL_PAGE_BYTES // PAGE_SIZE
    held = store.committed_bytes
    ideal = (prompt + n * new) * token_bytes
    copies = n * (prompt + new) * token_bytes
    return dict(held=held, ideal=ideal, copies=copies, slack_pages=(held - ideal) / SMOL_PAGE_BYTES,
                copied=store.bytes_copied, peak=store.peak_committed_bytes)


def shared_prompt(prefix_caching: bool, requests: int = 32, system: int = 512, own: int = 8, new: int = 16) -> dict:
    """32 requests sharing a 512-token system prompt through the Scheduler (request 1 first, alone):
    prompt tokens the model computes."""
    from ortkv.cache import Scheduler
    store = MemoryPageStore(4096, PAGE_SIZE, {0: SMOL_PAGE_BYTES})
    cache = PageCache(store, PAGE_SIZE, 64, max_sequences=64, prefix_caching=prefix_caching)
    sched = Scheduler(cache, max_step_tokens=4096)
    sys_ids = list(range(1000, 1000 + system))
    forward = lambda step: {r.seq: 7 for r in step.rows if r.wants_token}  # noqa: E731
    sched.submit(sys_ids + [1] * own, new)
    sched.complete(s := sched.schedule(), forward(s))
    for i in range(requests - 1):
        sched.submit(sys_ids + [2 + i] * own, new)
    for _ in sched.stream(forward):
        pass
    return dict(prefill=sched.prefill_tokens, reused=sched.reused_tokens, steps=sched.steps)


def beams(beam: int = 4, prompt: int = 1000, steps: int = 256) -> dict:
    """Beam search at the metadata level: each step every beam writes one token, then the beams are
    reordered (random parents, as a beam search keeps the best continuations)."""
    rng = np.random.default_rng(0)
    store = MemoryPageStore(beam * (-(-(prompt + steps) // PAGE_SIZE)) + 8, PAGE_SIZE, {0: SMOL_PAGE_BYTES})
    pages = -(-(prompt + steps) // PAGE_SIZE)
    cache = PageCache(store, PAGE_SIZE, pages, max_sequences=beam, prefix_caching=False,
                      max_entries=pages + steps)  # a beam may open a page per step (Note [Page metadata])
    cache.new_sequence(0)
    cache.done(cache.admit({0: prompt}))
    cache.fork_n(0, range(1, beam))
    full_copy = 0
    for t in range(steps):
        cache.done(cache.admit({b: 1 for b in range(beam)}))   # nothing to copy (Note [Page metadata])
        parents = rng.integers(0, beam, beam).tolist()
        cache.reorder(list(range(beam)), parents)
        full_copy += beam * (prompt + t + 1) * (SMOL_PAGE_BYTES // PAGE_SIZE)  # a cache copy per beam
    return dict(copied=store.bytes_copied, full=full_copy, steps=steps, opened=cache.pages_opened_by_sharing,
                held=len(store.live), peak=store.peak_pages,
                ideal=-(-prompt // PAGE_SIZE) + beam * -(-steps // PAGE_SIZE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=191)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lines = [f"# ortkv.cache host bookkeeping ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             "command: `python benchmarks/bench_cache_bookkeeping.py`", "",
             f"## Per decode step (page_size {PAGE_SIZE}, one new token per sequence; microseconds, median "
             "of the steps; goal <= 1,000 us)", "",
             "admit = placement + page-table rows (one np.take into the step's page-table buffer); "
             "view = valid lengths + position ids + slot mapping (with page_table and start, the mask "
             "form the paged ops take, O(batch)); done = rows written + prefix keys of pages that "
             "filled; total = admit + view + done. dense masks = key mask [batch, cells] + attention "
             "mask [batch, 1, cells] as booleans, O(batch x cells), only for kernels that take a dense "
             "mask (not part of a paged step). The wall-clock columns include whatever else the machine runs "
             "(a shared 2-core machine at a load of 6 deschedules the process for whole 4 ms slices); CPU "
             "time (time.thread_time_ns of admit + view + done) is the work the bookkeeping itself does.", "",
             "| sequences x cells | prefix caching | admit | view | done | total (median) | total p90 | CPU time median / p90 / max | dense masks | total + dense masks | pages held |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, cells in ((64, 8192), (64, 1024), (8, 8192)):
        for pc in (True, False):
            r = bench_steps(batch, cells, min(args.steps, cells - 2), pc)
            lines.append(f"| {batch} x {cells:,} | {'on' if pc else 'off'} | {r['admit']:.0f} | {r['view']:.0f} | "
                         f"{r['done']:.0f} | **{r['total']:.0f}** | {r['p90']:.0f} | {r['cpu']:.0f} / {r['cpu_p90']:.0f} / {r['cpu_max']:.0f} | {r['dense']:.0f} | {r['with_dense']:.0f} | {r['pages']:,} |")
    lines += ["", "## KV bytes of N parallel samples (SmolLM2-135M F16 pages: "
              f"{SMOL_PAGE_BYTES:,} bytes per {PAGE_SIZE}-token page, all 30 layers)", "",
              "Prompt P prefilled once, forked N - 1 times (every page shared), then G new tokens per sample. "
              "held = pages in the store at the end; ideal = (P + N x G) tokens; N copies = N x (P + G) "
              "tokens (one cache per sequence, as onnxruntime-genai holds, which in fact sizes each to "
              "max_length); slack = (held - ideal) in pages (bound: one page per sequence).", "",
              "| P | G | N | held MiB | ideal MiB | N copies MiB | held / N copies | saved | slack pages | KV bytes copied |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mib = 1 / 2**20
    for prompt, new in ((1000, 256), (512, 64)):
        for n in (1, 4, 16):
            m = memory(prompt, new, n)
            assert m["slack_pages"] <= n, m
            lines.append(f"| {prompt} | {new} | {n} | {m['held'] * mib:.1f} | {m['ideal'] * mib:.1f} | "
                         f"{m['copies'] * mib:.1f} | {m['held'] / m['copies']:.2f} | "
                         f"{1 - m['held'] / m['copies']:.0%} | {m['slack_pages']:.2f} | {m['copied']:,} |")
    lines += ["", "KV bytes copied: none (forks share the partly filled prompt page; every sample but the "
              "first to write opens a page of its own, Note [Page metadata])."]
    on, off = shared_prompt(True), shared_prompt(False)
    lines += ["", "## Shared 512-token system prompt, 32 requests (8 own tokens each, 16 new), Scheduler", "",
              "Prompt tokens the model computes (request 1 runs first; requests 2..32 arrive after it).", "",
              "| prefix caching | prompt tokens computed | prompt tokens reused from cache | steps |",
              "|---|---:|---:|---:|",
              f"| on | {on['prefill']:,} | {on['reused']:,} | {on['steps']} |",
              f"| off | {off['prefill']:,} | {off['reused']:,} | {off['steps']} |", "",
              f"With prefix caching, requests 2..32 compute {on['prefill'] - 520:,} prompt tokens: 31 x 8 own "
              "tokens (the system prompt's 32 full pages are reused)."]
    b = beams()
    lines += ["", "## Beam search, 4 beams, 1,000-token prompt, 256 steps (reorder after every step)", "",
              "| KV bytes copied | pages opened because another beam held a shared page's mark | pages held at "
              "the end / peak | prompt pages + each beam's own pages if never shared | a cache copy per beam per "
              "reorder (onnxruntime-genai without share-buffer) |",
              "|---:|---:|---:|---:|---:|",
              f"| {b['copied']:,} | {b['opened']:,} | {b['held']:,} / {b['peak']:,} | {b['ideal']:,} | {b['full']:,} |",
              "", "Random parents (a pessimistic beam search: most steps some beam continues another's page). "
              "A reorder is a page-table change and nothing is ever copied (page fills, Note [Page fill]): a "
              "beam that continues another beam's partly filled last page writes its next token into a new "
              "page instead."]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""Many sequences on one page pool, on the real model (SmolLM2-135M, float32 weights, F16 pages of 16
tokens, the paged decoder on the CPU) through ortkv.generate.multi:

  (a) samples:  N = 1, 4, 16 parallel samples of a P-token prompt (prefilled once, forked), G new
                tokens each: pages and KV bytes held at the last step vs onnxruntime-genai holding N
                copies. GenAI 0.18 refuses num_return_sequences > 1 without beam search ("must be in
                [1, 1]"), so its figure is computed from its cache: N x (P + G) tokens x 2 (K, V) x
                layers x kv_heads x head_size x 4 bytes (float32 model) without the share buffer, and
                N x max_length x the same with it (its default, past_present_share_buffer).
  (b) beams:    4-beam search, P-token prompt, G new tokens: ortkv (page-table reorder) vs
                onnxruntime-genai's CPU beam search on the same weights (its genai decoder), alternated,
                medians; decode steps/s and beam tokens/s (4 per step); KV bytes copied per step by
                ortkv (0: reorders and shared partly filled pages go through page fills, Note [Page
                fill]) and whether both return the same best sequence.
  (c) prefix:   R requests sharing an S-token system prompt (+ a few own tokens each), G new tokens
                each, greedy: the system prompt prefilled once (warm_prefix) and the R requests run by
                the Scheduler in one continuous batch, vs the same R requests one by one with prefix
                caching off; prompt tokens computed, end-to-end seconds (alternated, medians), and
                whether both give the same tokens.

The CPU is shared with other jobs and noisy: every timing is the median of --reps alternated runs.

    python benchmarks/bench_many_sequences.py [--reps 3] [--only beams] [--unfused]
        [--out benchmarks/results/many_sequences_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from ortkv.generate.config import GenAIConfig, Search
from ortkv.generate.models import model_path
from ortkv.generate.multi import BeamStats, MultiRunner, beam_search, generate_many, sample_many
from ortkv.generate.paged import paged_model_path

from _report import emit  # benchmarks/ is on sys.path when a script runs


def _cfg(max_length: int) -> GenAIConfig:
    cfg = GenAIConfig()
    cfg.ortkv.cache = "paged"
    cfg.ortkv.page_size = 16
    cfg.search.max_length = max_length
    return cfg.validate()


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 49000, n).tolist()


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def bench_samples(path, cfg, prompt_len: int, new: int, ns) -> tuple[list[str], dict]:
    d = cfg.model.decoder
    per_token_f32 = 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_size * 4
    prompt = _tokens(prompt_len, 1)
    search = Search(do_sample=True, top_k=50, max_length=cfg.search.max_length)
    rows = [f"| N | pages held | ortkv KV bytes held (MiB, F16 pages) | ortkv committed (MiB) | tokens held / "
            f"N x (P+G) | GenAI N copies (MiB, f32, no share buffer) | GenAI share buffer (MiB, N x max_length "
            f"{cfg.search.max_length}) | ortkv / GenAI (same dtype) |",
            "|---|---|---|---|---|---|---|---|"]
    raw = {}
    for n in ns:
        runner = MultiRunner(path, cfg, max_sequences=n)
        peak = {"live": 0, "pages": 0, "committed": 0}
        fwd = runner.forward

        def spy(placement, all_logits=False, runner=runner, peak=peak, fwd=fwd):
            out = fwd(placement, all_logits)
            st = runner.pool.stats()
            if st["live_bytes"] >= peak["live"]:
                peak.update(live=st["live_bytes"], pages=sum(st["pages"].values()),
                            committed=st["committed_total"])
            return out

        runner.forward = spy
        try:
            sample_many(prompt, runner, n, new, search=search, seed=3, eos_token_id=-1)
            slot = runner.pool.slot_bytes("f16")
        finally:
            runner.close()
        full = n * (prompt_len + new - 1) * per_token_f32      # at the last step: P + G - 1 tokens written
        share = n * cfg.search.max_length * per_token_f32
        cells = peak["pages"] * 16
        f16_equiv = full / 2                                   # N copies in the same 2-byte format
        raw[n] = {"pages": peak["pages"], "live": peak["live"], "committed": peak["committed"], "slot": slot}
        rows.append(f"| {n} | {peak['pages']} | {_mib(peak['live'])} | {_mib(peak['committed'])} | "
                    f"{cells / (n * (prompt_len + new - 1)):.2f} | {_mib(full)} | {_mib(share)} | "
                    f"{peak['live'] / f16_equiv:.2f} |")
    return rows, raw


def _genai_beams(genai_path, prompt, nb, new, reps_out):
    import onnxruntime_genai as og

    config = og.Config(str(genai_path.parent))
    config.clear_providers()
    model = og.Model(config)

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new, num_beams=nb, num_return_sequences=1,
                                  do_sample=False, early_stopping=True, length_penalty=1.0, batch_size=1)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array([prompt], np.int32))
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        dt = time.perf_counter() - t0
        return dt, steps, [int(t) for t in gen.get_sequence(0)][len(prompt):]

    return run


def bench_beams(path, genai_path, cfg, prompt_len: int, new: int, nb: int, reps: int, unfused_path=None):
    """unfused_path: also the many-sequence decoder on the unfused base (Split + 2 RotaryEmbedding +
    PagedCacheUpdate), alternated with the shipped one (fused: PagedRotaryCacheUpdate)."""
    prompt = _tokens(prompt_len, 2)
    runner = MultiRunner(path, cfg, max_sequences=nb, prefix_caching=False)
    unfused = MultiRunner(unfused_path, cfg, max_sequences=nb, prefix_caching=False) if unfused_path else None
    genai = _genai_beams(genai_path, prompt, nb, new, None)
    ours_t, unfused_t, theirs_t, last = [], [], [], {}
    try:
        for _ in range(reps):
            stats = BeamStats()
            t0 = time.perf_counter()
            res = beam_search(runner, prompt, nb, new, num_return_sequences=1, eos_token_id=cfg.model.eos_token_id,
                              stats=stats)
            ours_t.append(time.perf_counter() - t0)
            last["ours"] = (res[0].tokens, stats)
            if unfused is not None:
                t0 = time.perf_counter()
                res_u = beam_search(unfused, prompt, nb, new, num_return_sequences=1,
                                    eos_token_id=cfg.model.eos_token_id, stats=BeamStats())
                unfused_t.append(time.perf_counter() - t0)
                last["unfused"] = res_u[0].tokens
            dt, steps, seq = genai()
            theirs_t.append(dt)
            last["theirs"] = (seq, steps)
    finally:
        runner.close()
        if unfused is not None:
            unfused.close()
    (tokens, stats), (seq, gsteps) = last["ours"], last["theirs"]
    ours, theirs = float(np.median(ours_t)), float(np.median(theirs_t))
    steps = stats.steps
    copied = stats.bytes_copied_per_step
    boundary = [c for c, b in zip(copied, stats.boundary_steps) if b]
    eos = cfg.model.eos_token_id
    rows = ["| | seconds (median of {}) | decode steps | steps/s | beam tokens/s |".format(reps), "|---|---|---|---|---|",
            f"| ortkv (page-table reorder, F16 pages) | {ours:.3f} | {steps} | {steps / ours:.1f} | "
            f"{nb * steps / ours:.1f} |",
            f"| onnxruntime-genai beam search (float32 caches, copied per beam) | {theirs:.3f} | {gsteps} | "
            f"{gsteps / theirs:.1f} | {nb * gsteps / theirs:.1f} |"]
    if unfused_t:
        un = float(np.median(unfused_t))
        rows.insert(3, f"| ortkv, the unfused base (Split + 2 RotaryEmbedding + PagedCacheUpdate) | {un:.3f} | {steps} | "
                       f"{steps / un:.1f} | {nb * steps / un:.1f} |")
    notes = [f"- KV bytes copied by ortkv (the pool's bytes_copied counter, per decode step): total {sum(copied)} over "
             f"{len(copied)} steps (max per step {max(copied, default=0)}; {sum(boundary)} on the {len(boundary)} steps "
             "that start on a page boundary). Reorders are page-table changes and a beam that continues another "
             "beam's partly filled page writes into a page of its own (page_fill, Note [Page fill]).",
             f"- same best sequence as onnxruntime-genai: {tokens == [t for t in seq if t != eos]} "
             f"(ortkv {len(tokens)} tokens, GenAI {len(seq)})."]
    if unfused_t:
        notes.append(f"- the unfused base's best sequence equals the shipped (fused) decoder's: "
                     f"{last['unfused'] == tokens}; fused / unfused time {ours / float(np.median(unfused_t)):.3f}.")
    held = stats.pages_held_per_step
    if held:
        ps = cfg.ortkv.page_size
        full = nb * -(-(prompt_len + steps) // ps)  # pages of nb separate caches at the last step
        peak = max(held)
        notes.append(f"- KV pages held by the {nb} beams: {held[-1]} at the last step (peak {peak}) vs {full} for "
                     f"{nb} separate caches of {prompt_len + steps} tokens: {100 * (1 - held[-1] / full):.0f} % saved "
                     f"({100 * (1 - peak / full):.0f} % at the peak). vLLM reports 38-55 % saved by sharing in beam "
                     "search (Kwon et al., SOSP 2023, section 6.3); GenAI's beam search holds the separate caches.")
    return rows, notes, {"ours_s": ours_t, "unfused_s": unfused_t, "genai_s": theirs_t, "copied": copied,
                         "pages_held": held}


def _genai_requests(genai_path, prompts, new):
    """onnxruntime-genai (CPU, past_present_share_buffer) on the same requests, one by one, greedy: it has no
    prefix cache, so every request prefills its whole prompt. Returns (seconds, tokens per request)."""
    import onnxruntime_genai as og

    config = og.Config(str(genai_path.parent))
    config.clear_providers()
    config.overlay(json.dumps({"search": {"past_present_share_buffer": True}}))
    model = og.Model(config)
    t0 = time.perf_counter()
    out = []
    for p in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(p) + new, do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array([p], np.int32))
        toks = []
        while len(toks) < new and not gen.is_done():
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
        out.append(toks)
    return time.perf_counter() - t0, out


def bench_prefix(path, cfg, system_len: int, own: int, requests: int, new: int, reps: int, genai_path=None):
    system = _tokens(system_len, 4)
    prompts = [system + _tokens(own, 100 + i) for i in range(requests)]
    shared_t, alone_t, genai_t, out = [], [], [], {}
    for _ in range(reps):
        if genai_path is not None:
            dt, toks = _genai_requests(genai_path, prompts, new)
            genai_t.append(dt)
            out["genai"] = toks
        runner = MultiRunner(path, cfg, max_sequences=requests)
        try:
            t0 = time.perf_counter()
            runner.warm_prefix(system)
            got = {}
            for ev in generate_many(prompts, runner, new, eos_token_id=-1, max_step_tokens=4096):
                got.setdefault(ev.request, []).append(ev.token)
            shared_t.append(time.perf_counter() - t0)
            out["shared"] = ([got[i] for i in range(requests)], runner.tokens_computed)
        finally:
            runner.close()
        runner = MultiRunner(path, cfg, max_sequences=1, prefix_caching=False)
        try:
            t0 = time.perf_counter()
            alone = [sample_many(p, runner, 1, new, eos_token_id=-1)[0] for p in prompts]
            alone_t.append(time.perf_counter() - t0)
            out["alone"] = (alone, runner.tokens_computed)
        finally:
            runner.close()
    (sh, sh_tok), (al, al_tok) = out["shared"], out["alone"]
    decode = requests * (new - 1)
    s, a = float(np.median(shared_t)), float(np.median(alone_t))
    same = sum(x == y for x, y in zip(sh, al))
    rows = ["| | prompt tokens computed | seconds end to end (median of {}) | requests/s | new tokens/s |".format(reps),
            "|---|---|---|---|---|",
            f"| shared prefix + continuous batch | {sh_tok - decode} | {s:.2f} | {requests / s:.2f} | "
            f"{requests * new / s:.1f} |",
            f"| one by one, no prefix cache | {al_tok - decode} | {a:.2f} | {requests / a:.2f} | "
            f"{requests * new / a:.1f} |"]
    notes = [f"- {requests} requests of {system_len} shared + {own} own tokens, {new} new tokens each, greedy. "
             f"Requests 2..{requests} computed only their own {own} tokens ({system_len} system tokens once).",
             f"- same tokens as one by one: {same} of {requests} requests (greedy; a difference is a near-tie "
             "flipped by batched vs single-row float32 sums)."]
    if genai_t:
        gt = float(np.median(genai_t))
        rows.append(f"| onnxruntime-genai share-buffer, one by one (no prefix cache) | {requests * (system_len + own)} | "
                    f"{gt:.2f} | {requests / gt:.2f} | {requests * new / gt:.1f} |")
        g_same = sum(x[:len(y)] == y for x, y in zip(sh, out["genai"]))
        notes.append(f"- onnxruntime-genai (its own greedy loop, the genai-format decoder on the same float32 "
                     f"weights): same tokens as ortkv's shared run in {g_same} of {requests} requests; ortkv "
                     f"shared is {gt / s:.2f}x faster end to end.")
    return rows, notes, {"shared_s": shared_t, "alone_s": alone_t, "genai_s": genai_t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--beam-prompt", type=int, default=64)
    ap.add_argument("--beam-new", type=int, default=24)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--own-tokens", type=int, default=16)
    ap.add_argument("--request-new", type=int, default=16)
    ap.add_argument("--only", choices=["samples", "beams", "prefix"], action="append")
    ap.add_argument("--unfused", action="store_true",
                    help="(b) also the many-sequence decoder on the unfused base, alternated with the fused one")
    ap.add_argument("--out")
    a = ap.parse_args()
    cfg = _cfg(1024)
    path = paged_model_path(cfg, page_fill=True)
    lines = ["# Many sequences on one page pool (CPU)", "",
             f"`python benchmarks/bench_many_sequences.py --reps {a.reps}` on {platform.machine()}, "
             f"{platform.processor() or 'cpu'}, 2 cores shared with other jobs (noisy: medians of alternated runs). "
             "SmolLM2-135M float32 weights; ortkv: the paged decoder, F16 pages of 16 tokens on one PagePool, "
             "driven by ortkv.cache; onnxruntime-genai 0.18 on the same weights. "
             f"1-minute load average at the start: {os.getloadavg()[0]:.1f}.", ""]
    raw = {}
    only = set(a.only or ["samples", "beams", "prefix"])
    if "samples" in only:
        rows, raw["samples"] = bench_samples(path, cfg, a.prompt_tokens, a.new_tokens, (1, 4, 16))
        lines += [f"## (a) N parallel samples of a {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens each", "",
                  "KV held at the last step (P + G - 1 tokens written per sample). GenAI's figures are COMPUTED "
                  "from its cache layout (it refuses num_return_sequences > 1 without beams); the last column "
                  "compares bytes in the same 2-byte format (GenAI's N float32 copies / 2).", ""] + rows + [""]
    if "beams" in only:
        genai_path = model_path(cfg, "genai")
        unfused_path = paged_model_path(cfg, page_fill=True, fused_rotary=False) if a.unfused else None
        rows, notes, raw["beams"] = bench_beams(path, genai_path, cfg, a.beam_prompt, a.beam_new, 4, a.reps,
                                                unfused_path)
        lines += [f"## (b) 4-beam search, {a.beam_prompt}-token prompt, {a.beam_new} new tokens", ""] + rows + [""] \
            + notes + [""]
    if "prefix" in only:
        rows, notes, raw["prefix"] = bench_prefix(path, cfg, a.system_tokens, a.own_tokens, a.requests,
                                                  a.request_new, a.reps, genai_path=model_path(cfg, "genai"))
        lines += [f"## (c) {a.requests} requests sharing a {a.system_tokens}-token system prompt", ""] + rows + [""] \
            + notes + [""]
    lines += ["<details><summary>raw</summary>", "", "```", json.dumps(raw, default=str), "```", "", "</details>"]
    return emit("\n".join(lines), a.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""``ortkv generate``: text from the default model (SmolLM2-135M-Instruct) through ortkv, optionally
side by side with onnxruntime-genai (share-buffer and not) and a Concat copy model (--compare)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from .._memory import peak_rss_bytes, rss_bytes
from ..errors import OrtkvError
from .config import GenAIConfig, load_config, set_device
from .runners import RUNNERS

DEFAULT_PROMPT = "The capital of France is"
COMPARE_ROUNDS = 3  # --compare's runs a variant (Note [Compare rounds])


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def resolve_config(path: str | None) -> GenAIConfig:
    if path:
        return load_config(path)
    local = Path("genai_config.json")
    return load_config(local) if local.exists() else GenAIConfig().validate()


class StreamOut:
    """stdout for streamed text; remembers whether its last line is unfinished, so that an error or an
    interrupt printed after streaming started begins on a line of its own (Note [Ctrl-C] in ortkv.cli)."""

    def __init__(self, file=None):
        self.file = file or sys.stdout
        self.open = False

    def write(self, text: str) -> None:
        if text:
            self.file.write(text)
            self.file.flush()
            self.open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.open:
            self.write("\n")


def run_one(cfg: GenAIConfig, variant: str, prompts: list, stream: bool, log=print,
            out: StreamOut | None = None) -> dict:
    """prompts: texts, or lists of token ids (used as they are). The prompts are checked before the
    model is loaded (or built)."""
    from .loop import check_prompts, generate
    from .models import tokenizer_for
    from .runners import make_runner

    out = out or StreamOut()
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p.strip():
            raise OrtkvError(f"prompt {i + 1} of {len(prompts)} is empty: give some text (--prompt TEXT)")
    tok = tokenizer_for(cfg, log=log)
    chat = cfg.ortkv.chat
    texts = [p if isinstance(p, list) else tok.apply_chat([_msg(p)]) if chat else p for p in prompts]
    prompt_ids = [t if isinstance(t, list) else tok.encode(t) for t in texts]
    check_prompts(prompt_ids, cfg.search.max_length, cfg.model.vocab_size)
    if cfg.search.num_beams > 1 or cfg.search.num_return_sequences > 1:  # generate/multi.py
        if variant != "ortkv":
            raise OrtkvError(f"num_beams / num_return_sequences > 1 run on ortkv's page cache, not variant {variant!r}")
        from .multi import run_multi

        return run_multi(cfg, prompts, prompt_ids, tok, log=log)
    rss0 = rss_bytes()
    runner = make_runner(variant, cfg, log=log)
    try:
        rss_load = rss_bytes()
        shown = [""]
        g_ids = [[] for _ in prompts]

        def track(row, t):
            g_ids[row].append(t)
            if stream and row == 0:
                text = tok.decode(g_ids[0])
                out.write(text[len(shown[0]):])
                shown[0] = text

        if stream:
            out.write(tok.decode(prompt_ids[0]) if not chat else prompts[0] + "\n")
        if cfg.ortkv.warmup:  # untimed, as llama.cpp's bench driver warms up (Note [CPU baseline])
            generate(runner, prompt_ids, cfg.search, 2, cfg.model.eos_token_id, cfg.model.pad_token_id,
                     seed=cfg.ortkv.seed)
        g = generate(runner, prompt_ids, cfg.search, cfg.ortkv.max_new_tokens, cfg.model.eos_token_id,
                     cfg.model.pad_token_id, seed=cfg.ortkv.seed, on_token=track)
        if stream:
            out.write("\n")
        paged = runner.paged_stats() if hasattr(runner, "paged_stats") else None
    finally:
        runner.close()
    s = cfg.search
    return {"variant": variant, "prompts": prompts, "prompt_ids": g.prompt_ids, "new_ids": g.new_ids,
            "texts": [tok.decode(ids) for ids in g.new_ids], "prefill_tok_s": g.prefill_tokens_per_s,
            "decode_tok_s": g.decode_tokens_per_s, "kv_bytes": g.kv_bytes,
            "peak_rss_above_load": g.peak_rss_above_load, "model_rss": rss_load - rss0, "peak_rss": peak_rss_bytes(),
            "weights": cfg.ortkv.weights, "cache": cfg.ortkv.cache, "device": cfg.device, "dtype": cfg.dtype,
            "cache_layout": cfg.cache_layout, "cuda_graph": variant == "ortkv" and cfg.device != "cpu" and cfg.cuda_graph,
            "kv_committed_bytes": g.kv_bytes, "kv_live_bytes": g.kv_live_bytes, "median_step_ms": g.median_step_ms,
            "peak_device_above_load": g.peak_device_above_load,
            "search": {"do_sample": s.do_sample, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                       "max_length": s.max_length, "max_new_tokens": cfg.ortkv.max_new_tokens,
                       "seed": cfg.ortkv.seed},
            "kv_bytes_per_step": g.kv_bytes_per_step, "rss_per_step": g.rss_per_step,
            **({"paged": paged} if paged is not None else {})}


def _msg(text):
    from .tokenizer import ChatMessage

    return ChatMessage("user", text)


def summary(r: dict) -> str:
    if r.get("device", "cpu") != "cpu":
        graph = " (CUDA graph)" if r.get("cuda_graph") else ""
        return (f"[{r['variant']} {r['device']} {r['dtype']}] prefill {r['prefill_tok_s']:.1f} tok/s | decode "
                f"{r['decode_tok_s']:.1f} tok/s, {r['median_step_ms']:.2f} ms/step{graph} | KV committed "
                f"{_mib(r['kv_committed_bytes'])} for {_mib(r['kv_live_bytes'])} live | peak device memory above "
                f"load {_mib(r['peak_device_above_load'])}")
    return (f"[{r['variant']}] prefill {r['prefill_tok_s']:.1f} tok/s | decode {r['decode_tok_s']:.1f} tok/s | "
            f"KV resident {_mib(r['kv_bytes'])} | peak RSS above load {_mib(r['peak_rss_above_load'])} | "
            f"peak RSS {_mib(r['peak_rss'])}")


def run_worker(variant: str, cfg_path: str | None, overrides: dict, prompts: list[str]) -> dict:
    # the prompts go through stdin: 32 copies of a 1,024-token prompt passed as one argument exceeded the
    # kernel's per-argument limit (E2BIG, "Argument list too long", at 128 KiB) in `ortkv bench --device cuda`
    cmd = [sys.executable, "-m", "ortkv.generate.cli", "--worker", variant, "--overrides", json.dumps(overrides),
           "--prompts-json", "-"]
    if cfg_path:
        cmd += ["--config", cfg_path]
    out = subprocess.run(cmd, capture_output=True, text=True, input=json.dumps(prompts))
    if out.returncode != 0:
        raise OrtkvError(f"the {variant} worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def apply_overrides(cfg: GenAIConfig, overrides: dict) -> GenAIConfig:
    """Set "section.key" (or "model.decoder.key") values and validate the result."""
    for key, value in overrides.items():
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            if not hasattr(obj, part):
                raise OrtkvError(f"override {key!r}: no section {part!r}")
            obj = getattr(obj, part)
        if not hasattr(obj, name) or not path:
            raise OrtkvError(f"override {key!r}: no such key")
        setattr(obj, name, value)
    return cfg.validate()


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _float_in(low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = GenAIConfig()
    s, o = d.search, d.ortkv
    cfg_default = lambda key, value: f"default: the config's {key}, built in {value}"  # noqa: E731
    p = argparse.ArgumentParser(
        prog="ortkv generate", description=" ".join(__doc__.split()).replace("``", ""),
        epilog="Settings come from --config (else ./genai_config.json, else the built-in defaults); a flag overrides "
               "its key. Models are built on first use (only the variant that runs) and cached in "
               "<cache>/models, <cache> = $ORTKV_CACHE_DIR, else $XDG_CACHE_HOME/ortkv, else ~/.cache/ortkv "
               "(about 650 MB per float32 decoder): "
               "`ortkv cache list` shows them, `ortkv cache rm` removes them. --json prints one "
               "JSON object per run (keys: variant, prompts, prompt_ids, new_ids, texts, prefill_tok_s, "
               "decode_tok_s, kv_bytes, peak_rss_above_load, model_rss, peak_rss, weights, cache, device, dtype, "
               "cache_layout, cuda_graph, kv_committed_bytes, kv_live_bytes, median_step_ms, peak_device_above_load, "
               "search, kv_bytes_per_step, rss_per_step; with --cache paged also paged: pages and committed_bytes per "
               "format, committed_total, bytes_copied, requantized_pages, demoted_pages, policy, page_size).")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"a prompt (repeat for a batch); default: {DEFAULT_PROMPT!r}")
    p.add_argument("--config", metavar="PATH",
                   help="genai_config.json (default: ./genai_config.json if present, else built-in defaults)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's ChatML template "
                   "(ortkv.chat; default: off)")
    p.add_argument("--variant", default="ortkv", choices=RUNNERS, help="which decoder runs (default: ortkv)")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), metavar="N",
                   help="tokens to generate per prompt, >= 1 "
                        f"({cfg_default('ortkv.max_new_tokens', o.max_new_tokens)})")
    p.add_argument("--max-length", type=_int_at_least(2), metavar="N",
                   help="prompt + generated tokens per sequence, <= model.context_length; sizes the KV cache "
                        f"({cfg_default('search.max_length', s.max_length)})")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample with --temperature/--top-k/--top-p; --no-do-sample decodes greedily "
                        f"({cfg_default('search.do_sample', 'false: greedy')})")
    p.add_argument("--temperature", type=_float_in(0, 1e6), metavar="T",
                   help="divide the logits by T; 0 decodes greedily "
                        f"({cfg_default('search.temperature', s.temperature)})")
    p.add_argument("--top-k", type=_int_at_least(0), metavar="K",
                   help=f"sample from the K most likely tokens; 0: all ({cfg_default('search.top_k', s.top_k)})")
    p.add_argument("--top-p", type=_float_in(0, 1), metavar="P",
                   help="sample from the smallest most-likely set of tokens holding probability P (at least one); "
                        f"1: all ({cfg_default('search.top_p', s.top_p)})")
    p.add_argument("--warmup", action="store_true", default=None,
                   help="run an untimed 2-token generation on the same session first, so the decode figures "
                        "leave out ONNX Runtime's first-run costs, as llama.cpp's own bench does "
                        f"({cfg_default('ortkv.warmup', 'off')})")
    p.add_argument("--seed", type=_int_at_least(0), metavar="S",
                   help=f"seed of the sampler's random generator ({cfg_default('ortkv.seed', o.seed)})")
    p.add_argument("--weights", choices=["float32", "q4", "q8"], help="float32 (dequantized), q4 (Q4_1 kept 4-bit "
                   "exactly, CPU only: ortkv.MatMulQ4; the genai variant MatMulNBits + a minimum term) or q8 (the Q4_1 blocks on MatMulNBits' 8-bit grid: no "
                   "minimum term, 2x the weight bytes of q4); every variant uses the same "
                   f"({cfg_default('ortkv.weights', o.weights)})")
    p.add_argument("--device", metavar="DEV", help="cpu, cuda or cuda:N: written into the config's "
                   "model.decoder.session_options.provider_options (onnxruntime-genai's form); every variant runs there "
                   "(default: the config's provider_options, built in: cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16"], help="element type of the models and caches; "
                   f"auto: float32 on the CPU, float16 on CUDA ({cfg_default('ortkv.dtype', o.dtype)})")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA only: capture the ortkv decode step as a CUDA graph and replay it (enable_cuda_graph in "
                        "the CUDA provider options; default: the config's, built in: off)")
    p.add_argument("--cache", choices=["arena", "dense", "paged"],
                   help="ortkv's KV cache: arena (bytes follow the tokens), dense (max_length up front) or paged "
                        f"(pages each in its own format; docs/paged.md) ({cfg_default('ortkv.cache', o.cache)})")
    p.add_argument("--kv-format", choices=["f16", "bf16", "int8", "fp8_e4m3", "int4", "int2", "int4_kc", "int2_kc"],
                   help="--cache paged: one format for every page (ortkv.kv_format; default: f16)")
    p.add_argument("--kv-policy", choices=["recency"],
                   help="--cache paged: recency = the first page and the newest 4 pages f16, older pages int4 "
                        "(ortkv.kv_policy, whose numbers the config may set; default: the config's kv_policy, built in none)")
    p.add_argument("--page-size", type=_int_at_least(1), metavar="N",
                   help=f"--cache paged: tokens per page ({cfg_default('ortkv.page_size', o.page_size)})")
    p.add_argument("--num-return-sequences", type=_int_at_least(1), metavar="N",
                   help="--cache paged: N samples per prompt (prefilled once, the prompt's pages shared by fork), or "
                        f"the N best beams ({cfg_default('search.num_return_sequences', s.num_return_sequences)})")
    p.add_argument("--num-beams", type=_int_at_least(1), metavar="N",
                   help="--cache paged: beam search with N beams, reordered by page table (length_penalty and "
                        f"early_stopping from the config's search section) ({cfg_default('search.num_beams', s.num_beams)})")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of text and a "
                   "summary; messages go to stderr (default: off)")
    p.add_argument("--compare", action="store_true", help="also run GenAI share-buffer, GenAI and the copy "
                   "model on the same prompts and weights, each in its own process, and print ratios (default: off)")
    p.add_argument("--rounds", type=_int_at_least(1), metavar="N",
                   help=f"--compare: run every variant N times, the variants in turn and their order rotated each "
                        f"round, and print the medians with each variant's range (default: {COMPARE_ROUNDS})")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    p.add_argument("--prompts-json", help=argparse.SUPPRESS)
    return p


FLAG_KEYS = {"max_new_tokens": "ortkv.max_new_tokens", "max_length": "search.max_length",
             "do_sample": "search.do_sample", "temperature": "search.temperature", "top_k": "search.top_k",
             "top_p": "search.top_p", "seed": "ortkv.seed", "warmup": "ortkv.warmup", "weights": "ortkv.weights", "dtype": "ortkv.dtype",
             "cache": "ortkv.cache", "kv_format": "ortkv.kv_format", "page_size": "ortkv.page_size",
             "num_return_sequences": "search.num_return_sequences", "num_beams": "search.num_beams"}
RECENCY_DEFAULT = {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4"}


def config_from_args(a) -> tuple[GenAIConfig, dict]:
    """The config file (or defaults) with the command line's flags written onto its keys, validated."""
    overrides = json.loads(a.overrides) if a.overrides else {}
    if a.chat:
        overrides["ortkv.chat"] = True
    for flag, key in FLAG_KEYS.items():
        if getattr(a, flag) is not None:
            overrides[key] = getattr(a, flag)
    if a.kv_policy == "recency":
        base = resolve_config(a.config).ortkv.kv_policy
        overrides["ortkv.kv_policy"] = base or dict(RECENCY_DEFAULT)
    if a.kv_format or a.kv_policy:  # a flag replaces whatever policy the config names
        for key in ("ortkv.kv_format", "ortkv.kv_policy", "ortkv.kv_page_formats"):
            overrides.setdefault(key, "" if key.endswith("format") else {} if key.endswith("policy") else [])
    cfg = apply_overrides(resolve_config(a.config), overrides)
    if a.device is not None or a.cuda_graph is not None:  # Note [Provider options] in config.py
        set_device(cfg, a.device if a.device is not None else cfg.device, a.cuda_graph)
        overrides["model.decoder.session_options"] = json.loads(json.dumps(cfg.model.decoder.session_options))
        cfg = apply_overrides(cfg, {})
    return cfg, overrides


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    out = StreamOut()
    err = lambda *x: print(*x, file=sys.stderr)  # noqa: E731
    try:
        cfg, overrides = config_from_args(a)
        text = sys.stdin.read() if a.prompts_json == "-" else a.prompts_json
        prompts = json.loads(text) if text else (a.prompt or [DEFAULT_PROMPT])
        if a.worker:
            r = run_one(cfg, a.worker, prompts, stream=False, log=err)
            print(json.dumps(r))
            return 0
        unused = [f"--{f.replace('_', '-')}" for f in ("temperature", "top_k", "top_p", "seed")
                  if getattr(a, f) is not None]
        if unused and not cfg.search.do_sample:
            err(f"ortkv generate: note: {', '.join(unused)} take effect only when sampling; add --do-sample "
                "(search.do_sample is false: greedy)")
        if a.rounds is not None and not a.compare:
            err("ortkv generate: note: --rounds takes effect only with --compare")
        log = err if a.json else print
        if a.compare and (cfg.search.num_beams > 1 or cfg.search.num_return_sequences > 1):
            raise OrtkvError("--compare runs one sequence per prompt in every variant; drop --num-beams / "
                             "--num-return-sequences (or set them to 1) to compare")
        r = run_one(cfg, a.variant, prompts, stream=len(prompts) == 1 and not a.json, log=log, out=out)
        if a.json:
            print(json.dumps({**r, "round": 1} if a.compare else r), flush=True)
        else:
            if "sequences" in r:  # num_return_sequences / num_beams > 1 (generate/multi.py)
                what = "beam" if cfg.search.num_beams > 1 else "sample"
                for q in r["sequences"]:
                    print(f"--- {prompts[q['prompt']]!r} {what} {q['index'] + 1}\n{q['text']}")
            elif len(prompts) > 1:
                for prompt, text in zip(prompts, r["texts"]):
                    print(f"--- {prompt!r}\n{text}")
            if "sequences" in r:
                from .multi import multi_summary

                print(multi_summary(r))
            else:
                print(summary(r))
        if a.compare:
            rounds = a.rounds or COMPARE_ROUNDS
            log(f"comparing on the same prompts and weights: {rounds} round{'s' if rounds > 1 else ''} of every "
                "variant, each run in its own process ...")
            runs = {v: [] for v in RUNNERS}
            runs[r["variant"]].append(r)  # this process's run is its variant's first
            for k in range(rounds):
                for v in RUNNERS[k % len(RUNNERS):] + RUNNERS[:k % len(RUNNERS)]:  # Note [Compare rounds]
                    if k == 0 and v == r["variant"]:
                        continue
                    runs[v].append(run_worker(v, a.config, overrides, prompts))
                    if a.json:
                        print(json.dumps({**runs[v][-1], "round": k + 1}), flush=True)
            if not a.json:
                print(compare_table(runs, cfg))
        return 0
    except OrtkvError as exc:
        out.end_line()
        err(f"ortkv generate: error: {exc}")
        return 2
    except KeyboardInterrupt:  # Note [Ctrl-C] in ortkv.cli
        out.end_line()
        err("ortkv generate: interrupted")
        return 130


# Note [Compare rounds]
# ~~~~~~~~~~~~~~~~~~~~~
# One run of 30 new tokens a variant is ~0.5 s of decoding, and on a shared 2-core machine one such run read
# ortkv 64 / 98 / 66 tok/s and the copy model 85 / 61 / 61 in three `--compare`s minutes apart: a single run
# can put any variant ahead. So every variant runs `--rounds` times (3 by default), each run in its own process
# (the first ortkv run is the one that streamed its text here), the variants in turn and their order rotated
# each round so that no variant always runs first or last; the table gives each variant's median decode and
# prefill speed, the range of its decode speeds, ratios of medians, the largest peak RSS above load of its runs,
# and "same tokens" only where every run of it picked GenAI share-buffer's first run's tokens.
def compare_table(runs: dict, cfg: GenAIConfig) -> str:
    """runs: variant -> its runs' result rows (run_one's dicts), GenAI share-buffer's among them."""
    base = runs["genai-share"]
    base_decode = statistics.median(float(x["decode_tok_s"]) for x in base)
    n = min(len(v) for v in runs.values())
    lines = [f"max_length {cfg.search.max_length}, batch {len(base[0]['prompt_ids'])}, "
             f"{len(base[0]['new_ids'][0])} new tokens; median of {n} run{'s' if n > 1 else ''} a variant "
             f"(in turn, each in its own process); ratios against GenAI share-buffer",
             f"{'variant':<13}{'decode tok/s':>14}{'range':>15}{'ratio':>8}{'prefill tok/s':>15}{'KV resident':>14}"
             f"{'peak RSS above load':>22}{'same tokens':>13}"]
    for v, rows in runs.items():
        decode = [float(x["decode_tok_s"]) for x in rows]
        decode_med = statistics.median(decode)
        prefill_med = statistics.median(float(x["prefill_tok_s"]) for x in rows)
        same = all(x["new_ids"] == base[0]["new_ids"] for x in rows)
        peaks = [x["peak_rss_above_load"] for x in rows if x["peak_rss_above_load"] is not None]
        lines.append(f"{v:<13}{decode_med:>14.1f}{f'{min(decode):.1f}-{max(decode):.1f}':>15}"
                     f"{decode_med / base_decode:>7.2f}x{prefill_med:>15.1f}"
                     f"{_mib(rows[0]['kv_bytes']):>14}{_mib(max(peaks) if peaks else None):>22}"
                     f"{'yes' if same else 'NO':>13}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

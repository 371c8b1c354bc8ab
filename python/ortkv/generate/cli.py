"""``ortkv generate``: text from the default model (SmolLM2-135M-Instruct) through ortkv, optionally
side by side with onnxruntime-genai (share-buffer and not) and a Concat copy model (--compare)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .._memory import peak_rss_bytes, rss_bytes
from ..errors import OrtkvError
from .config import GenAIConfig, load_config
from .runners import RUNNERS

DEFAULT_PROMPT = "The capital of France is"


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def resolve_config(path: str | None) -> GenAIConfig:
    if path:
        return load_config(path)
    local = Path("genai_config.json")
    return load_config(local) if local.exists() else GenAIConfig().validate()


def run_one(cfg: GenAIConfig, variant: str, prompts: list, stream: bool, log=print) -> dict:
    """prompts: texts, or lists of token ids (used as they are)."""
    from .loop import generate
    from .models import tokenizer_for
    from .runners import make_runner

    tok = tokenizer_for(cfg, log=log)
    chat = cfg.ortkv.chat
    texts = [p if isinstance(p, list) else tok.apply_chat([_msg(p)]) if chat else p for p in prompts]
    prompt_ids = [t if isinstance(t, list) else tok.encode(t) for t in texts]
    rss0 = rss_bytes()
    runner = make_runner(variant, cfg, log=log)
    rss_load = rss_bytes()
    shown = [""]

    def on_token(row, _tok):
        if stream and row == 0:
            text = tok.decode(g_ids[0])
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    g_ids = [[] for _ in prompts]

    def track(row, t):
        g_ids[row].append(t)
        on_token(row, t)

    if stream:
        sys.stdout.write(tok.decode(prompt_ids[0]) if not chat else prompts[0] + "\n")
    g = generate(runner, prompt_ids, cfg.search, cfg.ortkv.max_new_tokens, cfg.model.eos_token_id,
                 cfg.model.pad_token_id, seed=cfg.ortkv.seed, on_token=track)
    if stream:
        sys.stdout.write("\n")
    runner.close()
    return {"variant": variant, "prompt_ids": g.prompt_ids, "new_ids": g.new_ids,
            "texts": [tok.decode(ids) for ids in g.new_ids], "prefill_tok_s": g.prefill_tokens_per_s,
            "decode_tok_s": g.decode_tokens_per_s, "kv_bytes": g.kv_bytes,
            "peak_rss_above_load": g.peak_rss_above_load, "model_rss": rss_load - rss0, "peak_rss": peak_rss_bytes(),
            "kv_bytes_per_step": g.kv_bytes_per_step, "rss_per_step": g.rss_per_step}


def _msg(text):
    from .tokenizer import ChatMessage

    return ChatMessage("user", text)


def summary(r: dict) -> str:
    return (f"[{r['variant']}] prefill {r['prefill_tok_s']:.1f} tok/s | decode {r['decode_tok_s']:.1f} tok/s | "
            f"KV resident {_mib(r['kv_bytes'])} | peak RSS above load {_mib(r['peak_rss_above_load'])} | "
            f"peak RSS {_mib(r['peak_rss'])}")


def run_worker(variant: str, cfg_path: str | None, overrides: dict, prompts: list[str]) -> dict:
    cmd = [sys.executable, "-m", "ortkv.generate.cli", "--worker", variant, "--overrides", json.dumps(overrides),
           "--prompts-json", json.dumps(prompts)]
    if cfg_path:
        cmd += ["--config", cfg_path]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise OrtkvError(f"the {variant} worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def apply_overrides(cfg: GenAIConfig, overrides: dict) -> GenAIConfig:
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ortkv generate", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: "
                   f"{DEFAULT_PROMPT!r}")
    p.add_argument("--config", help="genai_config.json (default: ./genai_config.json, else built-in defaults)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's ChatML template")
    p.add_argument("--variant", default="ortkv", choices=RUNNERS)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-length", type=int)
    p.add_argument("--weights", choices=["float32", "q4"], help="float32 (dequantized, default) or q4 "
                   "(Q4_1 kept 4-bit through com.microsoft.MatMulNBits); every variant uses the same")
    p.add_argument("--compare", action="store_true", help="also run GenAI share-buffer, GenAI and the copy "
                   "model on the same prompts and weights, each in its own process, and print ratios")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    p.add_argument("--prompts-json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        overrides = json.loads(a.overrides) if a.overrides else {}
        if a.chat:
            overrides["ortkv.chat"] = True
        if a.max_new_tokens is not None:
            overrides["ortkv.max_new_tokens"] = a.max_new_tokens
        if a.max_length is not None:
            overrides["search.max_length"] = a.max_length
        if a.weights is not None:
            overrides["ortkv.weights"] = a.weights
        cfg = apply_overrides(resolve_config(a.config), overrides)
        prompts = json.loads(a.prompts_json) if a.prompts_json else (a.prompt or [DEFAULT_PROMPT])
        if a.worker:
            r = run_one(cfg, a.worker, prompts, stream=False, log=lambda *x: print(*x, file=sys.stderr))
            print(json.dumps(r))
            return 0
        r = run_one(cfg, a.variant, prompts, stream=len(prompts) == 1)
        if len(prompts) > 1:
            for prompt, text in zip(prompts, r["texts"]):
                print(f"--- {prompt!r}\n{text}")
        print(summary(r))
        if a.compare:
            print("comparing on the same prompts and weights (each variant in its own process) ...")
            rows = {r["variant"]: r}
            for v in RUNNERS:
                if v not in rows:
                    rows[v] = run_worker(v, a.config, overrides, prompts)
            print(compare_table(rows, cfg))
        return 0
    except OrtkvError as exc:
        print(f"ortkv generate: error: {exc}", file=sys.stderr)
        return 2


def compare_table(rows: dict, cfg: GenAIConfig) -> str:
    base = rows["genai-share"]
    lines = [f"max_length {cfg.search.max_length}, batch {len(base['prompt_ids'])}, "
             f"{len(base['new_ids'][0])} new tokens; ratios against GenAI share-buffer",
             f"{'variant':<13}{'decode tok/s':>14}{'ratio':>8}{'prefill tok/s':>15}{'KV resident':>14}"
             f"{'peak RSS above load':>22}{'same tokens':>13}"]
    for v, r in rows.items():
        same = r["new_ids"] == base["new_ids"]
        lines.append(f"{v:<13}{r['decode_tok_s']:>14.1f}{r['decode_tok_s'] / base['decode_tok_s']:>7.2f}x"
                     f"{r['prefill_tok_s']:>15.1f}{_mib(r['kv_bytes']):>14}{_mib(r['peak_rss_above_load']):>22}"
                     f"{'yes' if same else 'NO':>13}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

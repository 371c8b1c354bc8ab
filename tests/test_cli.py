"""The ``ortkv`` command line as users of llama.cpp and onnxruntime-genai expect it: sampling flags onto
the config, refusals before the model loads, --json, Ctrl-C, errors on their own line, `ortkv cache`."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

import ortkv
from ortkv.cli import main as cli_main
from ortkv.generate import cache as cache_cli
from ortkv.generate.cli import build_parser, config_from_args

PROMPT = "The capital of France is"
GREEDY = [7042, 30, 198, 198, 504, 2988]  # " Paris.\n\nThe answer" (float32 weights, as on the CPU in test_generate)


def ortkv_cmd(*args, env=None, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "ortkv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, **kw)


# --- top level ---------------------------------------------------------------------------------------------
def test_unknown_option_and_command_name_the_problem(capsys):
    assert cli_main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown option '--bogus'" in err and "options go after a command" in err and "generate" in err
    assert cli_main(["generat"]) == 2
    assert "unknown command 'generat'; did you mean 'generate'?" in capsys.readouterr().err
    assert cli_main(["lib", "extra"]) == 2
    assert "'ortkv lib' takes no arguments" in capsys.readouterr().err
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ortkv {ortkv.__version__}"
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("demo", "generate", "bench", "check", "cache", "lib"))


# --- ortkv generate: flags -----------------------------------------------------------------------------------
def test_help_lists_every_option_with_its_default():
    p = build_parser()
    text = p.format_help()
    shown = [a for a in p._actions if a.help != "==SUPPRESS==" and a.dest != "help"]
    assert len(shown) >= 14
    for action in shown:
        assert action.option_strings[0] in text, action.dest
        assert "default" in action.help, f"{action.option_strings[0]}: no default in its help"
    for flag in ("--temperature", "--top-k", "--top-p", "--seed", "--do-sample", "--no-do-sample", "--json"):
        assert flag in text


def test_sampling_flags_land_on_the_config():
    a = build_parser().parse_args(["--do-sample", "--temperature", "0.7", "--top-k", "0", "--top-p", "0.9",
                                   "--seed", "42", "--max-new-tokens", "5", "--max-length", "512"])
    cfg, overrides = config_from_args(a)
    s = cfg.search
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.max_length) == (True, 0.7, 0, 0.9, 512)
    assert (cfg.ortkv.seed, cfg.ortkv.max_new_tokens) == (42, 5)
    assert overrides["search.top_p"] == 0.9  # what --compare hands its workers
    cfg, _ = config_from_args(build_parser().parse_args(["--no-do-sample"]))
    assert cfg.search.do_sample is False
    assert config_from_args(build_parser().parse_args([]))[0].ortkv.warmup is False
    cfg, overrides = config_from_args(build_parser().parse_args(["--warmup"]))
    assert cfg.ortkv.warmup is True and overrides["ortkv.warmup"] is True  # --compare's workers warm up too


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "-3"], "argument --max-new-tokens: must be >= 1, got -3"),
    (["--top-p", "1.5"], "argument --top-p: must be between 0 and 1, got 1.5"),
    (["--top-p", "nan"], "argument --top-p: must be between 0 and 1, got nan"),
    (["--temperature", "-1"], "argument --temperature: must be between 0 and 1e+06, got -1"),
    (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    (["--seed", "x"], "argument --seed: expected an integer, got 'x'"),
])
def test_bad_flag_values_are_refused_by_name(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_max_length_beyond_context_is_refused_before_loading(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ortkv": {"gguf": str(tmp_path / "absent.gguf")}}))
    assert cli_main(["generate", "--config", str(cfg), "--max-length", "100000"]) == 2
    err = capsys.readouterr().err
    assert "ortkv generate: error: search.max_length = 100000 exceeds model.context_length = 8192" in err


def test_empty_prompt_is_refused_before_the_model_loads(tmp_path, capsys):
    """The config points at a GGUF that does not exist: the empty prompt is reported, not the missing file
    (which is what loading the tokenizer or the model would have met first)."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ortkv": {"gguf": str(tmp_path / "absent.gguf")}}))
    for prompts in (["--prompt", ""], ["--prompt", "hello", "--prompt", "   "]):
        assert cli_main(["generate", "--config", str(cfg), *prompts]) == 2
        err = capsys.readouterr().err
        assert "is empty: give some text (--prompt TEXT)" in err and "does not exist" not in err, err
    assert cli_main(["generate", "--config", str(cfg), "--prompt", "hello"]) == 2  # a real prompt: the file
    assert "absent.gguf does not exist" in capsys.readouterr().err


def test_sampling_flags_without_do_sample_say_so(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ortkv": {"gguf": str(tmp_path / "absent.gguf")}}))
    cli_main(["generate", "--config", str(cfg), "--temperature", "0.5", "--top-p", "0.9"])
    assert "note: --temperature, --top-p take effect only when sampling; add --do-sample" in capsys.readouterr().err
    cli_main(["generate", "--config", str(cfg), "--temperature", "0.5", "--do-sample"])
    assert "note:" not in capsys.readouterr().err


def _row(variant, decode, new_ids=(1, 2, 3)):
    return {"variant": variant, "prompt_ids": [[5, 6]], "new_ids": [list(new_ids)], "decode_tok_s": decode,
            "prefill_tok_s": 2 * decode, "kv_bytes": 3 << 20, "peak_rss_above_load": 1 << 20, "peak_rss": 9 << 20}


def test_compare_runs_every_variant_in_rotated_rounds_and_prints_medians(monkeypatch, capsys):
    """--compare --rounds 3: this process's ortkv run is ortkv's first; every other run is a worker, the
    variants in turn with their order rotated each round; the table gives medians, ranges and ratios of medians."""
    from ortkv.generate import cli as gen_cli

    speeds = {"ortkv": [60.0, 100.0, 70.0], "genai-share": [36.0, 40.0, 30.0], "genai": [35.0, 35.0, 35.0],
              "copy": [50.0, 90.0, 55.0]}
    order = []
    monkeypatch.setattr(gen_cli, "run_one", lambda cfg, v, prompts, **kw: _row(v, speeds[v][0]))

    def worker(v, cfg_path, overrides, prompts):
        order.append(v)
        run = sum(x == v for x in order) - (v != "ortkv")  # this variant's run number, from 0
        return _row(v, speeds[v][run], new_ids=(1, 2, 4) if (v, run) == ("genai", 2) else (1, 2, 3))

    monkeypatch.setattr(gen_cli, "run_worker", worker)
    assert gen_cli.main(["--compare", "--rounds", "3"]) == 0
    assert order == ["genai-share", "genai", "copy",              # round 1 (ortkv ran here, streaming)
                     "genai-share", "genai", "copy", "ortkv",     # round 2: rotated by one
                     "genai", "copy", "ortkv", "genai-share"]     # round 3: by two
    out = capsys.readouterr().out
    assert "median of 3 runs a variant" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in speeds}
    assert rows["ortkv"][1:4] == ["70.0", "60.0-100.0", "1.94x"]  # median 70 / GenAI share-buffer's median 36
    assert rows["genai-share"][1:4] == ["36.0", "30.0-40.0", "1.00x"]
    assert rows["copy"][1:4] == ["55.0", "50.0-90.0", "1.53x"]
    assert rows["ortkv"][-1] == "yes" and rows["copy"][-1] == "yes"
    assert rows["genai"][-1] == "NO"  # one of its three runs picked other tokens


def test_compare_json_prints_every_run_with_its_round(monkeypatch, capsys):
    from ortkv.generate import cli as gen_cli

    monkeypatch.setattr(gen_cli, "run_one", lambda cfg, v, prompts, **kw: _row(v, 10.0))
    monkeypatch.setattr(gen_cli, "run_worker", lambda v, cfg_path, overrides, prompts: _row(v, 20.0))
    assert gen_cli.main(["--compare", "--json", "--rounds", "2"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["variant"], r["round"]) for r in runs] == [
        ("ortkv", 1), ("genai-share", 1), ("genai", 1), ("copy", 1),
        ("genai-share", 2), ("genai", 2), ("copy", 2), ("ortkv", 2)]


def test_rounds_without_compare_says_so(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ortkv": {"gguf": str(tmp_path / "absent.gguf")}}))
    cli_main(["generate", "--config", str(cfg), "--rounds", "2"])
    assert "note: --rounds takes effect only with --compare" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rounds", "0"])
    assert "argument --rounds: must be >= 1, got 0" in capsys.readouterr().err


# --- ortkv generate: runs of the real model ----------------------------------------------------------------------
def test_json_prints_one_object_per_run():
    out = ortkv_cmd("generate", "--json", "--prompt", PROMPT, "--max-new-tokens", "6", "--do-sample", "--top-k", "1",
                    "--seed", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout  # nothing but the object: no streamed text, no summary
    r = json.loads(lines[0])
    for key in ("variant", "prompt_ids", "new_ids", "texts", "prefill_tok_s", "decode_tok_s", "kv_bytes",
                "peak_rss_above_load"):
        assert key in r, key
    assert r["variant"] == "ortkv" and r["prompt_ids"] == [[504, 3575, 282, 4649, 314]]
    assert r["new_ids"] == [GREEDY]  # top_k 1 is greedy
    assert r["texts"][0].startswith(" Paris.") and r["decode_tok_s"] > 0 and r["kv_bytes"] > 0
    assert r["search"] == {"do_sample": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0, "max_length": 2048,
                           "max_new_tokens": 6, "seed": 3}


def test_error_after_streaming_starts_is_on_its_own_line(tmp_path):
    """An arena budget smaller than one commit fails in the prefill, after the prompt was streamed."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ortkv": {"arena_budget_bytes": 4096}}))
    out = subprocess.run([sys.executable, "-m", "ortkv.cli", "generate", "--config", str(cfg), "--prompt", PROMPT],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 2, out.stdout
    assert f"{PROMPT}\nortkv generate: error: " in out.stdout, out.stdout
    assert "Traceback" not in out.stdout


def test_ctrl_c_exits_130_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "ortkv.cli", "generate", "--prompt", PROMPT, "--do-sample",
                             "--temperature", "1.5", "--top-k", "0", "--max-new-tokens", "1500"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen, deadline = b"", time.monotonic() + 240
        while len(seen) <= len(PROMPT) + 2 and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                seen += os.read(proc.stdout.fileno(), 4096)
        assert proc.poll() is None, "generation ended before the interrupt"
        assert seen.startswith(PROMPT.encode()), seen
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"interrupted" in err
    assert (seen + rest).endswith(b"\n")  # the cut line was ended


# --- ortkv cache ---------------------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    models = root / "models"
    (models / "smollm2-135m-q4-v2" / "ortkv").mkdir(parents=True)
    (models / "smollm2-135m-q4-v2" / "ortkv" / "model.onnx").write_bytes(b"x" * 1000)
    (models / "smollm2-135m-q4-v2" / "genai").mkdir()
    (models / "smollm2-135m-q4-v2" / "genai" / "model.onnx").write_bytes(b"x" * 500)
    (models / "smollm2-135m-q4-v2" / ".copy.tmp").mkdir()
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"g" * 3000)
    outside = tmp_path / "keep.txt"
    outside.write_text("not the cache's")
    monkeypatch.setenv("ORTKV_CACHE_DIR", str(root))
    return models


def test_cache_list(cache, capsys):
    assert cli_main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out
    assert "smollm2-135m-q4-v2" in out and "decoders: genai, ortkv (+ 1 interrupted build(s))" in out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out and "2.9 KiB" in out and "total 4.4 KiB in 2 entries" in out
    assert cli_main(["cache", "list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_bytes"] == 4500 and {e["name"] for e in data["entries"]} == {
        "smollm2-135m-q4-v2", "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert cli_main(["cache", "dir"]) == 0 and capsys.readouterr().out.strip() == str(cache)


def test_cache_rm(cache, capsys, tmp_path):
    assert cli_main(["cache", "rm", "smollm2-135m-q4-v2/genai", "--dry-run"]) == 0
    assert "would remove smollm2-135m-q4-v2/genai (500 B)" in capsys.readouterr().out
    assert (cache / "smollm2-135m-q4-v2" / "genai").exists()
    assert cli_main(["cache", "rm", "smollm2-135m-q4-v2/genai"]) == 0
    assert "removed smollm2-135m-q4-v2/genai (500 B)" in capsys.readouterr().out
    assert not (cache / "smollm2-135m-q4-v2" / "genai").exists() and (cache / "smollm2-135m-q4-v2" / "ortkv").exists()
    for bad, message in (("../keep.txt", "is not a cache entry name"), ("/etc", "is not a cache entry name"),
                         ("nope", "no cache entry 'nope'"), ("a/b/c", "is not a cache entry name")):
        assert cli_main(["cache", "rm", bad]) == 2
        assert message in capsys.readouterr().err, bad
    assert cli_main(["cache", "rm"]) == 2
    assert "name the entries to remove, or pass --all" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").exists()
    assert cli_main(["cache", "rm", "--all"]) == 0
    assert "freed" in capsys.readouterr().out
    assert list(cache.iterdir()) == [] and (tmp_path / "keep.txt").exists()
    assert cli_main(["cache", "list"]) == 0 and "(empty)" in capsys.readouterr().out


def test_cache_rm_does_not_follow_a_link_out_of_the_cache(cache, tmp_path, capsys):
    victim = tmp_path / "victim"
    (victim / "ortkv").mkdir(parents=True)
    (cache / "linked").symlink_to(victim, target_is_directory=True)
    assert cli_main(["cache", "rm", "linked/ortkv"]) == 2
    assert "leads outside" in capsys.readouterr().err
    assert cli_main(["cache", "rm", "linked"]) == 0  # the link goes, not what it points at
    assert (victim / "ortkv").exists() and not (cache / "linked").exists()


def test_a_run_builds_only_its_variant(tmp_path, monkeypatch):
    """`--weights q4` (any build) used to build all three decoders when one was missing."""
    from test_untrusted_input import write_gguf

    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.config import GenAIConfig
    from ortkv.generate.models import model_dir, model_path

    monkeypatch.setenv("ORTKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny.gguf", context=64)
    cfg = apply_overrides(GenAIConfig(), {"ortkv.gguf": str(gguf)})
    logs = []
    path = model_path(cfg, "ortkv", log=logs.append)
    root = model_dir(cfg)
    assert path == root / "ortkv" / "model.onnx" and path.exists()
    assert sorted(p.name for p in root.iterdir()) == ["ortkv"]
    assert any(f"cached the ortkv decoder in {root / 'ortkv'}" in line and "ortkv cache" in line for line in logs)
    model_path(cfg, "copy", log=logs.append)
    assert sorted(p.name for p in root.iterdir()) == ["copy", "ortkv"]
    assert cache_cli.entries()[0]["variants"] == ["copy", "ortkv"]

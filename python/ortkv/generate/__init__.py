"""ortkv.generate: genai_config.json-driven generation of a real model (SmolLM2-135M) through ortkv,
with onnxruntime-genai and a Concat copy model as baselines on the same weights."""

from .config import GenAIConfig, load_config

__all__ = ["GenAIConfig", "load_config"]

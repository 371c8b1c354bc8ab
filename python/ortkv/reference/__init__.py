"""numpy references (oracles) for every ortkv op and codec."""

from .cache_attention import cache_attention_ref
from .cache_update import cache_update_ref
from .rotary import rotary_cache_update_ref, rotary_interleaved_ref, swiglu_ref

__all__ = ["cache_attention_ref", "cache_update_ref", "rotary_cache_update_ref", "rotary_interleaved_ref", "swiglu_ref"]

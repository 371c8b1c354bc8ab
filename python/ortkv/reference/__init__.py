"""numpy references (oracles) for every ortkv op and codec."""

from .cache_update import cache_update_ref

__all__ = ["cache_update_ref"]

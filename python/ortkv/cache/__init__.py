"""ortkv.cache: many sequences on one page store. Page metadata apart from storage, admission of a
whole step before the run, forks and beam reorders that share pages, prefix caching and a
continuous-batching scheduler (docs/cache.md; Notes [Page metadata], [Admission], [Prefix hash chain],
[Page store protocol], [Scheduler])."""

from ..errors import CacheProtocolError, CapacityError, SequenceBusyError, SequenceRemovedError
from .pages import PageCache, PageInfo, Placement, Refusal
from .scheduler import Event, Row, Scheduler, Step
from .prefix import PrefixIndex, chain_hashes
from .store import MemoryPageStore, PageStore

__all__ = [
    "CacheProtocolError",
    "CapacityError",
    "MemoryPageStore",
    "PageCache",
    "PageInfo",
    "PageStore",
    "Placement",
    "PrefixIndex",
    "Refusal",
    "SequenceBusyError",
    "Row",
    "Scheduler",
    "SequenceRemovedError",
    "Event",
    "Step",
    "chain_hashes",
]

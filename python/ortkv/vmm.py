"""ortkv.vmm: caches that grow without copying or moving, on CUDA VMM or its host twin.

    gov = Governor(budget_bytes=8 << 30)
    with Arena(64 << 30, device="cuda:0", governor=gov) as arena:   # address space only
        arena.commit(nbytes)                    # memory behind the first nbytes, granule by granule
        cache = arena.view(np.float16, (1, capacity, heads, head_size))
        sess.bind_cache("past_key", cache)      # bound once: the pointer never changes
        ...
        arena.commit(more_bytes)                # grows in place: no copy, same base
        prefix = arena.map_shared_prefix(nbytes)  # same physical memory, read-only, new address

The C++ core (custom_ops/vmm, Note [Arena transactions]) does the work; this module words the
errors, keeps the books of what is exported (Note [Arena exports]) and computes layouts. Backends:
"cpu" (memfd + mmap) and "cuda:N" (cuMem* driver API).

Note [Arena exports]
~~~~~~~~~~~~~~~~~~~~
An arena's memory must never be unmapped under something that still points at it: a numpy view
read after close() kills the process, and a stale view or a still-bound session would write into
the next arena that gets the same addresses. We follow Python's own mmap ("BufferError: cannot
close exported pointers exist"). An arena counts its exports:
  * each view: the _ArenaView holder behind the numpy array (numpy keeps it as the ``.base`` of the
    array and of every array derived from it) or handed to a CUDA consumer; a weakref.finalize on
    the holder returns the export when the last array using it is gone;
  * each session binding: MutableCacheSession.bind_cache takes a lease (ArenaLease) for ANY storage
    inside an arena's range, whatever its kind (numpy, OrtValue, DLPack); unbind_cache, a rebind
    and close() return it.
While one is alive, close() and release() raise ArenaBusyError (a BufferError and an OrtkvError)
naming them and the remedy, and change nothing. Leaving a ``with Arena(...)`` block never raises
for that reason: the arena turns closed at once (commit, view, bind, release refused) but its range
stays reserved AND mapped until the last export is gone, and only then is it unmapped and freed
(by the finalizer of that export). So a view that outlives the block reads the arena's last bytes,
never unmapped pages and never another arena's memory: its addresses cannot be reused while it
lives. Taking an export and closing hold the arena's lock, so a bind racing close() either binds
first (close refuses) or finds the arena closed (bind refuses). Kernels that are running when
release() or close() unmap are covered by the C++ lease (Note [Arena lease] in ortkv/core.h).
"""

from __future__ import annotations

import itertools
import operator
import threading
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from . import _ortkv
from ._storage import Storage, numpy_onnx_type
from .errors import ArenaBusyError, ArenaError, CacheInputError, CapacityError, OrtkvError, StorageError, from_native

__all__ = ["Arena", "ArenaBusyError", "ArenaError", "ArenaKVCache", "ArenaLease", "CacheGeometry", "Governor",
           "LAYOUTS", "Shareability", "committed_bytes_for", "cuda_available", "evaluate_prefix_shareability",
           "live_bytes", "live_fragments"]

_U64 = 1 << 64


def _native(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as exc:
        typed = from_native(exc)
        if typed is exc:
            typed = OrtkvError(str(exc))
        elif isinstance(typed, CacheInputError):  # E_INPUT from the arena: its arguments, not a cache's
            typed = ArenaError(str(typed))
    try:
        raise typed from None
    finally:  # no frame <-> exception cycle: the caller's views must die with its frame, not at the next GC
        del typed


def _u64(where: str, name: str, value) -> int:
    """``value`` as an int in [0, 2**64), or ArenaError naming it."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ArenaError(f"{where}: {name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not 0 <= v < _U64:
        raise ArenaError(f"{where}: {name} must be in [0, 2**64), got {v}")
    return v


def cuda_available() -> tuple[bool, str]:
    """(True, "") where a CUDA arena can be created, else (False, why)."""
    ok, why = _ortkv.cuda_vmm_available()
    return bool(ok), why


class Governor:
    """A byte budget shared by arenas: a commit needs a grant first; refusal is CapacityError."""

    def __init__(self, budget_bytes: int):
        self._native = _ortkv.Governor(_u64("Governor", "budget_bytes", budget_bytes))

    @property
    def budget(self) -> int:
        return self._native.budget

    @property
    def in_use(self) -> int:
        return self._native.in_use

    @property
    def quarantined(self) -> int:
        """Bytes that will never come back (teardown could not synchronize, or a release failed)."""
        return self._native.quarantined

    def __repr__(self) -> str:
        return f"<Governor budget={self.budget} in_use={self.in_use}>"


class Arena:
    """A reserved virtual range; granules are committed on demand and the base never changes.
    close() and release() refuse while views or session bindings are alive; leaving a ``with``
    block defers the free until the last of them is gone (Note [Arena exports])."""

    def __init__(self, reserve_bytes: int, device: str = "cpu", governor: Governor | None = None, *, _native=None):
        self._lock = threading.RLock()  # re-entrant: an export's finalizer may run inside a locked section
        self._exports: dict[int, str] = {}
        self._closing = False
        if _native is not None:
            self._native, self.device, self.governor = _native, device, governor
            _LIVE.add(self)
            return
        kind, index = _parse_device(device)
        reserve_bytes = _u64("Arena", "reserve_bytes", reserve_bytes)
        if reserve_bytes == 0:
            raise ArenaError("Arena: reserve_bytes must be > 0, got 0")
        self._native = _native_arena(reserve_bytes, kind, index, governor)
        self.device = "cpu" if kind == "cpu" else f"cuda:{index}"
        self.governor = governor
        _LIVE.add(self)

    # -- facts ---------------------------------------------------------------------------------
    base = property(lambda self: self._native.base, doc="First address; never changes.")
    granule = property(lambda self: self._native.granule, doc="Commit granularity (queried).")
    reserved_bytes = property(lambda self: self._native.reserved_bytes)
    committed_bytes = property(lambda self: self._native.committed_bytes)
    billed_bytes = property(lambda self: self._native.billed_bytes, doc="Bytes this arena holds from its governor "
                                                                         "(0 for a shared prefix).")
    read_only = property(lambda self: self._native.read_only)
    live_mappings = property(lambda self: self._native.live_mappings)
    quarantined = property(lambda self: self._native.quarantined)

    @property
    def closed(self) -> bool:
        """True once closed, including a close deferred until the last view is gone (then the range is
        still mapped: see ``exports``)."""
        return self._closing or self._native.closed

    @property
    def exports(self) -> list[str]:
        """What keeps this arena's memory in use: live views and session bindings."""
        with self._lock:
            return list(self._exports.values())

    def is_committed(self, offset: int, nbytes: int) -> bool:
        offset = _u64("Arena.is_committed", "offset", offset)
        nbytes = _u64("Arena.is_committed", "nbytes", nbytes)
        if offset + nbytes > self.reserved_bytes:
            raise ArenaError(f"Arena.is_committed: [{offset}, {offset + nbytes}) exceeds the {self.reserved_bytes} "
                             "reserved bytes; ask about a range inside the arena")
        return self._native.is_committed(offset, nbytes)

    # -- exports (Note [Arena exports]) ----------------------------------------------------------
    def _export(self, what: str, *, skip_closed: bool = False) -> int | None:
        with self._lock:
            if self._native.closed and skip_closed:
                return None  # freed: its addresses may belong to another arena now
            if self.closed:
                pending = (f" (freed once its {len(self._exports)} remaining export(s) are gone)"
                           if self._closing else "")
                raise ArenaError(f"{what}: the arena 0x{self.base:x} (+{self.reserved_bytes} bytes) is closed"
                                 f"{pending}; create a new Arena")
            token = next(_export_ids)
            self._exports[token] = what
            return token

    def _unexport(self, token: int) -> None:
        with self._lock:
            self._exports.pop(token, None)
            if not (self._closing and not self._exports and not self._native.closed):
                return
            try:  # the deferred close of a `with` block: the last export is gone
                reason = _native(self._native.close)
            except OrtkvError as exc:
                warnings.warn(f"ortkv: deferred Arena.close failed: {exc}", RuntimeWarning, stacklevel=2)
                return
        if reason:
            _warn_quarantine(reason)

    def _lease(self, what: str) -> "ArenaLease | None":
        token = self._export(what, skip_closed=True)
        return None if token is None else ArenaLease(self, token, what)

    def _refuse_if_exported(self, op: str) -> None:
        if not self._exports:
            return
        shown = list(self._exports.values())
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        raise ArenaBusyError(
            f"Arena.{op}: {len(shown)} export(s) of the arena 0x{self.base:x} (+{self.reserved_bytes} bytes) are "
            f"alive: {'; '.join(shown[:3])}{more}. {op}() would leave them pointing at unmapped memory, so nothing "
            "was done (like mmap's BufferError). Remedy: unbind_cache() or close() those sessions and drop the views "
            "(del), then retry; or leave a `with Arena(...)` block, which frees the range once the last one is gone.")

    # -- operations ----------------------------------------------------------------------------
    def commit(self, nbytes: int, offset: int = 0) -> int:
        """Back every granule overlapping [offset, offset + nbytes); returns the bytes newly committed.
        Atomic: on failure nothing changes (CapacityError when the governor refuses)."""
        nbytes, offset = _u64("Arena.commit", "nbytes", nbytes), _u64("Arena.commit", "offset", offset)
        self._check_open("Arena.commit")
        return _native(self._native.commit, nbytes, offset)

    def commit_many(self, ranges) -> int:
        """Commit several (offset, nbytes) ranges in ONE transaction (one grant; all or nothing)."""
        where = "Arena.commit_many"
        ranges = [(_u64(where, f"offset of range {i}", o), _u64(where, f"nbytes of range {i}", n))
                  for i, (o, n) in enumerate(ranges)]
        self._check_open("Arena.commit_many")
        return _native(self._native.commit_ranges, ranges)

    def _check_open(self, what: str) -> None:
        if self._closing:
            raise ArenaError(f"{what}: the arena is closed (its range is freed once its {len(self._exports)} "
                             "remaining export(s) are gone); create a new Arena")

    def release(self) -> None:
        """Unmap everything and return it to the governor; the range stays reserved (same addresses).
        Refused (ArenaBusyError) while views or session bindings are alive."""
        with self._lock:
            self._check_open("Arena.release")
            self._refuse_if_exported("release")
            _native(self._native.release)

    def close(self) -> None:
        """Synchronize, unmap, free. Refused (ArenaBusyError) while views or session bindings are alive.
        If synchronization fails the arena is quarantined (leaked on purpose)."""
        with self._lock:
            if self._native.closed:
                return
            self._refuse_if_exported("close")
            reason = _native(self._native.close)
        if reason:
            _warn_quarantine(reason)

    def map_shared_prefix(self, nbytes: int) -> "Arena":
        """A read-only Arena whose first nbytes are the SAME physical granules at a new base."""
        nbytes = _u64("Arena.map_shared_prefix", "nbytes", nbytes)
        self._check_open("Arena.map_shared_prefix")
        return Arena(0, self.device, None, _native=_native(self._native.map_shared_prefix, nbytes))

    def view(self, dtype, shape, offset: int = 0):
        """A tensor over [offset, offset + size) of this arena: a numpy array on the host (read-only
        for a shared prefix), an object with __cuda_array_interface__ on CUDA. Both can be bound with
        MutableCacheSession.bind_cache. Only committed bytes may be touched. The arena cannot be
        closed or released while the view (or any array made from it) is alive."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise StorageError(f"Arena.view: shape {list(shape)} has a negative dimension")
        offset = _u64("Arena.view", "offset", offset)
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if offset + nbytes > self.reserved_bytes:
            raise StorageError(f"Arena.view: [{offset}, {offset + nbytes}) is outside the {self.reserved_bytes} "
                               "reserved bytes")
        if offset % dtype.itemsize:
            raise StorageError(f"Arena.view: offset {offset} is not aligned to {dtype} ({dtype.itemsize} bytes)")
        token = self._export(f"view {dtype}{list(shape)} at offset {offset}")
        try:
            holder = _ArenaView(self, dtype, shape, offset, nbytes)
        except BaseException:
            self._unexport(token)
            raise
        weakref.finalize(holder, self._unexport, token)
        return np.asarray(holder) if self.device == "cpu" else holder

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close_when_unused()

    def close_when_unused(self) -> None:
        """Close now, or, while views or session bindings are alive, close to new work at once and free
        the range when the last of them is gone (never ArenaBusyError; Note [Arena exports])."""
        with self._lock:
            if self._native.closed:
                return
            if self._exports:  # deferred: freed by the last export's finalizer
                self._closing = True
                return
        self.close()

    def __repr__(self) -> str:
        kind = "shared prefix (read-only)" if self.read_only else "owner"
        state = " closing" if self._closing and not self._native.closed else (" closed" if self.closed else "")
        return (f"<Arena {self.device} {kind}{state} base=0x{self.base:x} reserved={self.reserved_bytes} "
                f"committed={self.committed_bytes} granule={self.granule}>")


_LIVE: "weakref.WeakSet[Arena]" = weakref.WeakSet()  # for lease_storage's lookup by address
_export_ids = itertools.count(1)


class ArenaLease:
    """One session binding of arena memory (Note [Arena exports]): the arena refuses close() and
    release() until release() is called (or the lease is collected)."""

    def __init__(self, arena: Arena, token: int, what: str):
        self.arena, self.what = arena, what
        self._finalizer = weakref.finalize(self, arena._unexport, token)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()  # runs once

    def __repr__(self) -> str:
        return f"<ArenaLease {self.what!r} {'held' if self.alive else 'released'}>"


def lease_storage(st: Storage, what: str) -> ArenaLease | None:
    """A lease on the arena whose range holds ``st`` (None when it lies in no live arena), taken by
    MutableCacheSession.bind_cache. ArenaError when that arena is closed."""
    for arena in list(_LIVE):
        kind, index = _parse_device(arena.device)
        if (kind, index) != (st.device_type, st.device_id) or arena._native.closed:
            continue
        base = arena.base
        if base <= st.ptr < base + arena.reserved_bytes:
            lease = arena._lease(what)
            if lease is not None:
                return lease
    return None


_warned_quarantine = False


def _warn_quarantine(reason: str) -> None:
    global _warned_quarantine
    if not _warned_quarantine:
        _warned_quarantine = True
        warnings.warn(f"ortkv: {reason}", RuntimeWarning, stacklevel=3)


def _parse_device(device: str) -> tuple[str, int]:
    if not isinstance(device, str):
        raise ArenaError(f"Arena: device must be 'cpu' or 'cuda:N', got {type(device).__name__} {device!r}")
    if device == "cpu":
        return "cpu", 0
    if device == "cuda":
        return "cuda", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ArenaError(f"Arena: device must be 'cpu' or 'cuda:N', got {device!r}")


def _native_arena(reserve: int, kind: str, index: int, governor: Governor | None):
    if kind == "cuda":
        ok, why = cuda_available()
        if not ok:
            raise OrtkvError(f"Arena: cannot create a CUDA arena: {why}")
    return _native(_ortkv.Arena, reserve, kind, index, governor._native if governor else None)


class _ArenaView:
    """Keeps its arena alive for as long as a numpy array (or a CUDA consumer) uses its memory."""

    def __init__(self, arena: Arena, dtype: np.dtype, shape, offset: int, nbytes: int):
        self.arena, self.dtype, self.shape, self.offset, self.nbytes = arena, dtype, shape, offset, nbytes
        self.ptr = arena.base + offset
        iface = {"shape": shape, "typestr": dtype.str, "data": (self.ptr, arena.read_only), "version": 3,
                 "strides": None}
        if dtype.name == "bfloat16":
            iface["descr"] = [("", dtype.str)]
        if arena.device == "cpu":
            self.__array_interface__ = iface
        else:
            self.__cuda_array_interface__ = iface

    def __ortkv_storage__(self) -> Storage:
        kind, index = _parse_device(self.arena.device)
        onnx_type = numpy_onnx_type(self.dtype)
        return Storage(ptr=self.ptr, nbytes=self.nbytes, device_type=kind, device_id=index,
                       onnx_type=onnx_type if onnx_type is not None else -1, shape=self.shape,
                       writable=not self.arena.read_only, contiguous=True, kind="arena view", keepalive=(self,))


# --- layouts ------------------------------------------------------------------------------------
LAYOUTS = ("BNSH", "BSNH", "SBNH", "token-major")


@dataclass(frozen=True)
class CacheGeometry:
    """K and V caches of a whole model: 2 * layers tensors of [batch, kv_heads, capacity, head_size]
    (or its permutation), laid out back to back in one arena."""

    layers: int
    kv_heads: int
    head_size: int
    capacity: int
    batch: int = 1
    dtype_bytes: int = 2

    @property
    def tensors(self) -> int:
        return 2 * self.layers

    @property
    def tensor_bytes(self) -> int:
        return self.batch * self.kv_heads * self.capacity * self.head_size * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def tensor_shape(self, layout: str) -> tuple[int, ...]:
        if layout == "BNSH":
            return (self.batch, self.kv_heads, self.capacity, self.head_size)
        if layout == "BSNH":
            return (self.batch, self.capacity, self.kv_heads, self.head_size)
        if layout == "SBNH":  # seq_axis 0: token-major per tensor
            return (self.capacity, self.batch, self.kv_heads, self.head_size)
        raise OrtkvError(f"layout {layout!r} has no per-tensor shape (token-major interleaves all tensors)")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise OrtkvError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def live_fragments(layout: str, g: CacheGeometry, valid_len: int) -> list[tuple[int, int]]:
    """The contiguous byte runs (offset, size) that hold the first ``valid_len`` tokens.

    BNSH        [t][b][h][s][d]: one run per (tensor, row, head) of valid_len * head_size elements
    BSNH        [t][b][s][h][d]: one run per (tensor, row) of valid_len * heads * head_size elements
    SBNH        [t][s][b][h][d]: one run per tensor of valid_len * batch * heads * head_size elements
    token-major [s][t][b][h][d]: one run of valid_len * (all tensors' bytes per token)
    """
    _check_layout(layout)
    if not 0 <= valid_len <= g.capacity:
        raise OrtkvError(f"valid_len {valid_len} is outside [0, capacity {g.capacity}]")
    if valid_len == 0:
        return []
    es, d, h, c = g.dtype_bytes, g.head_size, g.kv_heads, g.capacity
    if layout == "token-major":
        return [(0, valid_len * g.tensors * g.batch * h * d * es)]
    if layout == "SBNH":
        return [(t * g.tensor_bytes, valid_len * g.batch * h * d * es) for t in range(g.tensors)]
    if layout == "BSNH":
        row = c * h * d * es
        return [(t * g.tensor_bytes + b * row, valid_len * h * d * es) for t in range(g.tensors) for b in range(g.batch)]
    run = c * d * es
    return [(t * g.tensor_bytes + (b * h + hh) * run, valid_len * d * es)
            for t in range(g.tensors) for b in range(g.batch) for hh in range(h)]


def live_bytes(g: CacheGeometry, valid_len: int) -> int:
    return g.tensors * g.batch * g.kv_heads * valid_len * g.head_size * g.dtype_bytes


def _windows(fragments, granule: int) -> list[tuple[int, int]]:
    """Merged [first, last) granule-aligned windows covering the fragments."""
    spans = sorted((off // granule * granule, -(-(off + size) // granule) * granule) for off, size in fragments)
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def committed_bytes_for(layout: str, g: CacheGeometry, valid_len: int, granule: int) -> int:
    """Bytes that must be committed to hold ``valid_len`` tokens: granule x windows with a live byte."""
    return sum(b - a for a, b in _windows(live_fragments(layout, g, valid_len), granule))


@dataclass(frozen=True)
class Shareability:
    shareable: bool
    fragments: int  # contiguous runs of the prefix
    fragment_bytes: int  # bytes of each run
    shareable_granules_per_fragment: int  # whole granules inside the smallest run
    map_operations: int  # multi-map calls a sharer needs (one per run), 0 if not shareable
    reason: str | None = None


def evaluate_prefix_shareability(layout: str, geometry: CacheGeometry, prefix_len: int, granule: int) -> Shareability:
    """Can a prefix of ``prefix_len`` tokens be shared by mapping its physical granules read-only?
    Only whole granules can be mapped, so every contiguous fragment must cover at least one."""
    frags = live_fragments(layout, geometry, prefix_len)
    if not frags:
        return Shareability(False, 0, 0, 0, 0, "an empty prefix has nothing to share")
    whole = [max(0, (off + size) // granule - (-(-off // granule))) for off, size in frags]
    smallest = min(whole)
    size = frags[0][1]
    if smallest == 0:
        per_token = size // prefix_len
        need = -(-granule // per_token)
        return Shareability(
            False, len(frags), size, 0, 0,
            f"layout {layout} splits the prefix into {len(frags)} fragments of {size} bytes; a fragment must "
            f"cover at least one whole {granule}-byte granule to be mapped (needs >= {need} tokens per fragment "
            f"even when aligned); use token-major, or share a longer prefix")
    return Shareability(True, len(frags), size, smallest, len(frags))


# Note [One arena per tensor]
# Committed bytes follow the tokens only as closely as the granule allows, once per contiguous run of live
# bytes (live_fragments). In one arena, BNSH has a run per (tensor, row, head) and BSNH per (tensor, row):
# at 2 MiB CUDA granules SmolLM2 (60 tensors, 3 KV heads) commits 180 granules (360 MiB) before its first
# token at batch 1, and 60 x 32 at batch 32. SBNH [capacity, batch, kv_heads, head_size] makes each tensor's
# live bytes ONE prefix; giving each tensor its own arena (arena_per_tensor, the default for SBNH) makes every
# arena's live bytes one prefix, so committed <= live + one granule per arena, at any batch. ensure() then
# commits whole granules (never chunk_tokens' rounding, which would add up to chunk_tokens tokens per tensor),
# so a decode loop commits once per granule of each tensor. The grant is checked against the governor for
# all arenas before any commits, so a refusal (CapacityError) changes nothing.


class ArenaKVCache:
    """All K and V caches of a model, each tensor a contiguous BNSH, BSNH or SBNH view: in one arena, or
    one arena per tensor (``arena_per_tensor``; the default for SBNH, Note [One arena per tensor]); grows
    with ensure(valid_len), which commits the granules the first valid_len tokens need, rounded up to
    ``chunk_tokens`` (one arena: so that a decode loop commits once per chunk, in one transaction for all
    tensors) or to whole granules (one arena per tensor). Views never move."""

    def __init__(self, geometry: CacheGeometry, layout: str = "BSNH", device: str = "cpu",
                 governor: Governor | None = None, dtype=np.float16, chunk_tokens: int = 128,
                 arena_per_tensor: bool | None = None):
        if layout not in ("BNSH", "BSNH", "SBNH"):
            raise OrtkvError(f"ArenaKVCache layout must be BNSH, BSNH or SBNH (contiguous per tensor), not {layout!r}")
        dtype = np.dtype(dtype)
        if dtype.itemsize != geometry.dtype_bytes:
            raise OrtkvError(f"dtype {dtype} has {dtype.itemsize} bytes but the geometry says {geometry.dtype_bytes}")
        self.geometry, self.layout, self.dtype = geometry, layout, dtype
        self.chunk_tokens = max(1, int(chunk_tokens))
        self.arena_per_tensor = layout == "SBNH" if arena_per_tensor is None else bool(arena_per_tensor)
        if self.arena_per_tensor and layout != "SBNH":
            raise OrtkvError(f"ArenaKVCache: arena_per_tensor needs layout SBNH (one prefix per tensor); {layout} "
                             "has a run per row, so separate arenas would still commit a granule per row")
        self.valid_len = 0
        self.committed_tokens = 0
        shape = geometry.tensor_shape(layout)
        if self.arena_per_tensor:
            self.arena = None
            self.arenas = []
            try:
                for _ in range(geometry.tensors):
                    self.arenas.append(Arena(geometry.tensor_bytes, device, governor))
                self.views = [a.view(dtype, shape) for a in self.arenas]
            except BaseException:
                self.views = []
                for a in self.arenas:
                    a.close_when_unused()
                raise
        else:
            self.arena = Arena(geometry.total_bytes, device, governor)
            self.arenas = [self.arena]
            self.views = [self.arena.view(dtype, shape, t * geometry.tensor_bytes) for t in range(geometry.tensors)]
        self.governor = governor

    @property
    def token_bytes(self) -> int:
        """Bytes one token (of every row) takes in one tensor."""
        g = self.geometry
        return g.batch * g.kv_heads * g.head_size * g.dtype_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes of the valid_len tokens of every tensor and row (what committed bytes are measured against)."""
        return live_bytes(self.geometry, self.valid_len)

    @property
    def granule(self) -> int:
        return self.arenas[0].granule

    def _ensure_per_tensor(self, valid_len: int) -> int:
        g, gran = self.geometry, self.granule
        target_bytes = min(g.tensor_bytes, -(-valid_len * self.token_bytes // gran) * gran)
        need = sum(max(0, target_bytes - a.committed_bytes) for a in self.arenas)
        gov = self.governor
        if gov is not None and need > gov.budget - gov.in_use:
            raise CapacityError(f"ArenaKVCache: {valid_len} tokens need {need} more bytes in {len(self.arenas)} arenas "
                                f"but the governor has {gov.budget - gov.in_use} of its {gov.budget} left; raise "
                                "ortkv.arena_budget_bytes or shorten max_length / the batch",
                                requested=need, capacity=gov.budget - gov.in_use)
        newly = sum(a.commit(target_bytes) for a in self.arenas)
        self.committed_tokens = min(g.capacity, target_bytes // self.token_bytes)
        return newly

    def key(self, layer: int):
        return self.views[2 * layer]

    def value(self, layer: int):
        return self.views[2 * layer + 1]

    def ensure(self, valid_len: int) -> int:
        """Commit what ``valid_len`` tokens need (call before the run that writes them); returns the
        bytes newly committed. Raises CapacityError past the capacity or the governor's budget."""
        g = self.geometry
        if valid_len > g.capacity:
            raise CapacityError(f"ArenaKVCache: {valid_len} tokens exceed the capacity of {g.capacity}",
                                requested=valid_len, capacity=g.capacity)
        self.valid_len = max(self.valid_len, valid_len)
        if valid_len <= self.committed_tokens:
            return 0
        if self.arena_per_tensor:
            return self._ensure_per_tensor(valid_len)
        target = min(g.capacity, -(-valid_len // self.chunk_tokens) * self.chunk_tokens)
        newly = self.arena.commit_many(live_fragments(self.layout, g, target))
        self.committed_tokens = target
        return newly

    @property
    def committed_bytes(self) -> int:
        return sum(a.committed_bytes for a in self.arenas)

    def close(self) -> None:
        """Close the arena(s): ArenaBusyError while views handed out (or sessions bound to them) are alive."""
        self.views = []
        for a in self.arenas:
            a.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close_when_unused()

    def close_when_unused(self) -> None:
        """Arena.close_when_unused: deferred while views are alive, never ArenaBusyError."""
        self.views = []
        for a in self.arenas:
            a.close_when_unused()

"""ortkv.paged: the page pool of a paged KV cache, and the policies that pick each page's format.

    pool = PagePool(num_layers=30, kv_heads=3, head_size=64, page_size=16, logical_dtype=np.float32,
                    governor=Governor(1 << 30), max_pages=1024)
    page = pool.alloc(PageFormat.F16)          # one slot of the F16 slab (commits a granule if needed)
    pool.requantize(page, PageFormat.INT4)     # new INT4 slot, directory rewritten, F16 slot freed
    pool.free(page)                            # the slot goes to the INT4 free list for reuse
    pool.pool, pool.directory                  # bound in place: uint8 [pool_bytes], int64 [max_pages, 2]

    cache = PagedKVCache(pool, batch=2, max_pages_per_seq=64, policy=RecencyPolicy(1, 4, "f16", "int4"))
    cache.reserve(new_lengths)                 # pages for the tokens the next run writes
    ... run PagedCacheUpdate / PagedCacheAttention with pool.pool, pool.directory, cache.page_table ...
    cache.advance(new_lengths)                 # the policy: full pages leaving the window are requantized

Note [Page pool]
~~~~~~~~~~~~~~~~
ONE vmm.Arena holds every page (the physical form agreed for PagedCacheUpdate / PagedCacheAttention,
Note [Page formats]). Its reservation is cut into one slab per format, each at a fixed offset aligned to
2 MiB (the CUDA granule; the host granule divides it), each large enough for ``max_pages`` slots of its
format: address space only. A slot holds one page for every layer, so its size is
``num_layers * LayoutOf(f).page_bytes`` and layer l of a page at slot offset o lives at
``o + l * page_bytes(f)``. A slab grows by committing the granules its next fresh slot touches, under
the governor's budget, when a slot is taken and none is free: nothing is preallocated to a maximum, and
the committed bytes of a slab are its slots in use rounded up to one granule. A freed slot goes to its
slab's free list (lowest offset first, so slabs stay dense) and is taken before the slab grows.
``commit_ahead`` (slots, default 0) makes a slab that must grow commit that many slots beyond the one it needs
(the one alone if the governor refuses the more): the CUDA runner that captures decode graphs sets it, since every
commit costs it a fresh capture (Note [Paged decoder on CUDA]); then a slab holds up to commit_ahead slots more.

The directory (int64 [max_pages, 2] = (format, byte offset of the slot)) is the only thing the kernels
read to find a page; page ids are directory rows, slots are offsets, and the two are independent: a
requantize takes a slot of the new format, converts the page there (``_ortkv.paged_requantize``: decode
and encode each layer, nothing written on refusal), rewrites the page's directory row and frees the old
slot. That is the only copy the pool ever makes, one page, counted in ``bytes_copied``.

When the governor refuses a commit, a slot is first borrowed from a wider slab: from its free list, else
its next fresh slot if already committed (a granule's tail, or commit_ahead); a committed, unused slot at least
as large (the page's format is in the directory, so where it lives does not matter to the kernels). Then, if
``demote_on_refusal``, the pool demotes its oldest unpinned pages one step (F16/BF16 -> INT8, INT8/FP8 ->
INT4), oldest first, until a slot that fits is free; each demotion frees a wide slot that the refused request
can borrow. The arena cannot give granules back
(there is no decommit), so demotion makes room by reusing committed memory, not by returning budget:
the first demotion needs its narrower slot from that slab's free list, its committed granule tail or a
grant, and when none is to be had the request fails with CapacityError naming the numbers. Pinned pages
(sink pages, a page being filled) are never demoted.

Note [Page pool on CUDA]
~~~~~~~~~~~~~~~~~~~~~~~~
``PagePool(device="cuda:N")`` puts the arena on the device (cuMem* VMM, 2 MiB granules): ``pool.pool``
is then the arena's view object (``__cuda_array_interface__``), bound with MutableCacheSession.bind_cache
exactly like a CUDA ArenaKVCache view. The kernels read the directory from device memory (Note [Paged
CUDA]), so the pool keeps two copies of it: ``directory`` (host, int64 [max_pages, 2]), the one the pool's
bookkeeping reads and writes, and ``directory_device`` (an OrtValue on the same device, fed to every run;
its address never changes, as a CUDA graph needs). Every write of a host row (alloc, free, requantize)
marks it dirty; ``directory_input()`` (called before each run) copies the dirty rows' span to the device
in ONE host-to-device copy and returns the OrtValue. Nothing is copied on a step that opened no page and
changed no format. Counted in ``directory_bytes_uploaded``. On the CPU ``directory_input()`` is the host
array itself. Byte helpers that must work on both devices (``read_bytes``, ``write_bytes``,
``copy_bytes``) are cudaMemcpy (libcudart through ctypes) between two device synchronizes, between runs:
the pool is idle when the host touches it, and the copy is complete before the next run is launched,
whatever stream ORT launches it on.

Note [Requantize on a CUDA pool]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A requantize on a CUDA pool runs on the device: ``_ortkv.paged_requantize_cuda`` (Note [Requantize on
CUDA] in custom_ops/kernels/cuda/paged_requantize.cu): the host's codecs and checks, the same bytes as on a
CPU pool, nothing written on refusal, only an 8-byte verdict crossing the bus; ``bytes_staged`` stays 0 and
the destination slot counts in ``bytes_copied``, as on the CPU. A build without the CUDA kernels has no
device function; there a requantize on a CUDA pool stages ONE page through host memory (the source slot
up, ``paged_requantize`` into the destination half of a small host buffer, the destination slot down),
counted in ``bytes_staged``: explicit and visible in ``stats()``, never the cache.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from . import _ortkv
from .errors import CapacityError, OrtkvError, from_native
from .reference.codecs import KEYS_PER_CHANNEL, PageFormat, check_shape, layout
from .vmm import Arena, Governor

__all__ = ["DEMOTE", "FORMAT_NAMES", "ExplicitPolicy", "PagePool", "PagedKVCache", "Policy", "RecencyPolicy",
           "UniformPolicy", "parse_format", "policy_from_config"]

SLAB_ALIGN = 2 << 20  # the CUDA VMM granule; host granules (4 KiB) divide it
FORMAT_NAMES = {"f16": PageFormat.F16, "bf16": PageFormat.BF16, "int8": PageFormat.INT8,
                "fp8_e4m3": PageFormat.FP8_E4M3, "int4": PageFormat.INT4, "int2": PageFormat.INT2,
                "int4_kc": PageFormat.INT4_KC, "int2_kc": PageFormat.INT2_KC}
DEMOTE = {PageFormat.F16: PageFormat.INT8, PageFormat.BF16: PageFormat.INT8,
          PageFormat.INT8: PageFormat.INT4, PageFormat.FP8_E4M3: PageFormat.INT4}
_ONNX_LOGICAL = {"float32": 1, "float16": 10, "bfloat16": 16}
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses


def _cudart():
    from .generate.runners import _cuda_library

    lib = _cuda_library()
    if lib is None:
        raise OrtkvError("PagePool on CUDA: libcudart was not found (the nvidia-cuda-runtime wheel onnxruntime-gpu "
                         "installs, or a CUDA toolkit); install onnxruntime-gpu or put libcudart.so on the "
                         "library path")
    return lib


def _cuda_copy(device: int, dst: int, src: int, nbytes: int, what: str) -> None:
    """cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault) between two cudaDeviceSynchronize calls (Note [Page pool on
    CUDA]): the copy starts after every stream's work and is complete on return, whatever streams ORT uses."""
    import ctypes

    if nbytes == 0:
        return
    lib = _cudart()
    for call, args in (("cudaSetDevice", (ctypes.c_int(device),)),
                       ("cudaDeviceSynchronize", ()),  # whatever stream ORT ran on is done with the pool
                       ("cudaMemcpy", (ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                       ctypes.c_int(_MEMCPY_DEFAULT))),
                       ("cudaDeviceSynchronize", ())):
        rc = getattr(lib, call)(*args)
        if rc != 0:
            raise OrtkvError(f"PagePool.{what}: {call} returned CUDA error {rc} copying {nbytes} bytes "
                             f"(0x{src:x} -> 0x{dst:x}) on cuda:{device}; the pool's bytes may be stale: close it")


def parse_format(fmt, where: str = "page format") -> PageFormat:
    """A PageFormat from a name ("int8"), a PageFormat or its code; one-line error naming ``where``."""
    if isinstance(fmt, str):
        f = FORMAT_NAMES.get(fmt.lower())
        if f is None:
            raise OrtkvError(f"{where} = {fmt!r}: one of {', '.join(repr(n) for n in FORMAT_NAMES)}")
        return f
    try:
        return PageFormat(int(fmt))
    except (TypeError, ValueError):
        raise OrtkvError(f"{where} = {fmt!r}: a format name ({', '.join(FORMAT_NAMES)}) or code 0..7") from None


def _logical_name(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _ONNX_LOGICAL:
        raise OrtkvError(f"PagePool: logical_dtype {dtype!r} must be float32, float16 or bfloat16")
    return name


def _native_requantize(pool_array, src_offset, src_format, dst_offset, dst_format, num_layers, kv_heads,
                       page_size, head_size, logical) -> None:
    """``_ortkv.paged_requantize``: every layer of one page decoded from src and encoded into dst, nothing
    written on refusal (non-finite / unrepresentable values)."""
    fn = getattr(_ortkv, "paged_requantize", None)
    if fn is None:
        raise OrtkvError("PagePool.requantize: this build of ortkv has no _ortkv.paged_requantize (the paged "
                         "cache kernels are not in it); rebuild ortkv from a tree that has them")
    _call_native(fn, pool_array, src_offset, src_format, dst_offset, dst_format, num_layers, kv_heads, page_size,
                 head_size, logical)


def _cuda_requantize_kernel():
    """``_ortkv.paged_requantize_cuda`` (Note [Requantize on a CUDA pool]); None in a build without CUDA kernels."""
    return getattr(_ortkv, "paged_requantize_cuda", None)


def _call_native(fn, *args) -> None:
    try:
        fn(*args)
    except (RuntimeError, ValueError) as exc:
        typed = from_native(exc)
        raise (typed if typed is not exc else OrtkvError(str(exc))) from None


@dataclass
class _Slab:
    fmt: PageFormat
    offset: int  # of the slab in the pool
    slot_bytes: int
    page_bytes: int  # one layer
    capacity: int  # slots reserved
    fresh: int = 0  # slots ever handed out: the next fresh slot
    committed_end: int = 0  # bytes of the slab committed (from its start)
    free: list = field(default_factory=list)  # heap of free slot indices

    def slot_offset(self, i: int) -> int:
        return self.offset + i * self.slot_bytes


class PagePool:
    """Pages of every format on one arena (Note [Page pool]). Not thread-safe: one owner drives it."""

    def __init__(self, num_layers: int, kv_heads: int, head_size: int, page_size: int, logical_dtype=np.float32,
                 device: str = "cpu", governor: Governor | None = None, max_pages: int = 1024,
                 demote_on_refusal: bool = False, commit_ahead: int = 0):
        for key, v in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_size", head_size),
                       ("page_size", page_size), ("max_pages", max_pages)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise OrtkvError(f"PagePool: {key} = {v!r} must be an integer >= 1")
        if not isinstance(commit_ahead, (int, np.integer)) or isinstance(commit_ahead, bool) or commit_ahead < 0:
            raise OrtkvError(f"PagePool: commit_ahead = {commit_ahead!r} must be an integer >= 0 (slots)")
        self.commit_ahead = int(commit_ahead)
        self.num_layers, self.kv_heads, self.head_size, self.page_size = (int(num_layers), int(kv_heads),
                                                                          int(head_size), int(page_size))
        self.max_pages = int(max_pages)
        self.logical = _logical_name(logical_dtype)
        self.wide = PageFormat.BF16 if self.logical == "bfloat16" else PageFormat.F16
        self.demote_on_refusal = bool(demote_on_refusal)
        self.slabs: dict[PageFormat, _Slab] = {}
        offset = 0
        for f in PageFormat:
            try:
                check_shape(f, kv_heads, page_size, head_size)
            except OrtkvError:
                continue  # e.g. INT2 with head_size not a multiple of 4: that format has no slab
            pb = layout(f, kv_heads, page_size, head_size).page_bytes
            slot = self.num_layers * pb
            self.slabs[f] = _Slab(f, offset, slot, pb, self.max_pages)
            offset += -(-slot * self.max_pages // SLAB_ALIGN) * SLAB_ALIGN
        self.arena = Arena(offset, device, governor)
        self.granule = self.arena.granule
        self.pool = self.arena.view(np.uint8, (offset,))
        self.directory = np.full((self.max_pages, 2), -1, np.int64)
        self.device = self.arena.device
        self.device_index = 0 if self.device == "cpu" else int(self.device.split(":")[1])
        self.directory_device = None  # Note [Page pool on CUDA]
        self._dirty: tuple[int, int] | None = None  # [lo, hi) rows of the host directory not yet on the device
        self.directory_bytes_uploaded = 0
        self.bytes_staged = 0
        if self.device != "cpu":
            import onnxruntime as ort

            self.directory_device = ort.OrtValue.ortvalue_from_numpy(self.directory, "cuda", self.device_index)
        self._free_pages = list(range(self.max_pages))  # heap
        self._slot: dict[int, tuple[PageFormat, int]] = {}  # page -> (slab, slot index)
        self._age: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._ages = itertools.count()
        self.bytes_copied = 0
        self.requantized_pages = 0
        self.demoted_pages = 0
        self.page_changes = 0  # frees, pins changed, formats changed (Note [Incremental advance])

    # -- facts ---------------------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        return self.arena.reserved_bytes

    def slot_bytes(self, fmt) -> int:
        return self._slab(parse_format(fmt)).slot_bytes

    def page_bytes(self, fmt) -> int:
        """Bytes of one layer of a page of ``fmt`` (LayoutOf(f).page_bytes)."""
        return self._slab(parse_format(fmt)).page_bytes

    def format_of(self, page: int) -> PageFormat:
        self._check_page(page, "format_of")
        return PageFormat(int(self.directory[page, 0]))

    def offset_of(self, page: int) -> int:
        self._check_page(page, "offset_of")
        return int(self.directory[page, 1])

    @property
    def live_pages(self) -> list[int]:
        return sorted(self._slot)

    def pages_per_format(self) -> dict[str, int]:
        out = {f.name: 0 for f in self.slabs}
        for p in self._slot:
            out[PageFormat(int(self.directory[p, 0])).name] += 1
        return out

    def committed_bytes_per_format(self) -> dict[str, int]:
        """Committed bytes of each slab (granule-rounded)."""
        return {f.name: s.committed_end for f, s in self.slabs.items()}

    @property
    def committed_bytes(self) -> int:
        return self.arena.committed_bytes

    def stats(self) -> dict:
        pages = self.pages_per_format()
        live = sum(n * self.slabs[PageFormat[f]].slot_bytes for f, n in pages.items())
        return {"pages": pages, "live_bytes": live, "committed_bytes": self.committed_bytes_per_format(),
                "committed_total": self.committed_bytes, "bytes_copied": self.bytes_copied,
                "requantized_pages": self.requantized_pages, "demoted_pages": self.demoted_pages,
                "device": self.device, "bytes_staged": self.bytes_staged,
                "directory_bytes_uploaded": self.directory_bytes_uploaded}

    def layer_bytes(self, page: int, layer: int) -> np.ndarray:
        """The bytes of one layer of ``page`` (a view into the pool on the CPU, a host copy on CUDA)."""
        f = self.format_of(page)
        if not 0 <= layer < self.num_layers:
            raise OrtkvError(f"PagePool.layer_bytes: layer {layer} is outside [0, {self.num_layers})")
        pb = self.slabs[f].page_bytes
        start = self.offset_of(page) + layer * pb
        if self.device == "cpu":
            return self.pool[start:start + pb]
        return self.read_bytes(start, pb)

    def slot_contents(self, page: int) -> np.ndarray:
        """A host copy of every layer of ``page`` (its whole slot)."""
        f = self.format_of(page)
        return self.read_bytes(self.offset_of(page), self.slabs[f].slot_bytes)

    # -- bytes on either device (Note [Page pool on CUDA]) ----------------------------------------------
    def _check_range(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.pool_bytes:
            raise OrtkvError(f"PagePool.{what}: [{offset}, +{nbytes}) is outside the pool's {self.pool_bytes} bytes")
        if nbytes and not self.arena.is_committed(offset, nbytes):
            raise OrtkvError(f"PagePool.{what}: [{offset}, +{nbytes}) is not committed; touch only allocated pages")

    def read_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        """A host copy of pool bytes [offset, offset + nbytes) (committed memory only)."""
        self._check_range(offset, nbytes, "read_bytes")
        if self.device == "cpu":
            return np.array(self.pool[offset:offset + nbytes])
        out = np.empty(nbytes, np.uint8)
        _cuda_copy(self.device_index, out.ctypes.data, self.arena.base + offset, nbytes, "read_bytes")
        return out

    def write_bytes(self, offset: int, data) -> None:
        """Pool bytes [offset, offset + len(data)) := data (host bytes; committed memory only)."""
        data = np.ascontiguousarray(np.asarray(data).view(np.uint8).reshape(-1))
        self._check_range(offset, data.size, "write_bytes")
        if self.device == "cpu":
            self.pool[offset:offset + data.size] = data
        else:
            _cuda_copy(self.device_index, self.arena.base + offset, data.ctypes.data, data.size, "write_bytes")

    def copy_bytes(self, dst_offset: int, src_offset: int, nbytes: int) -> None:
        """Pool bytes copied within the pool (a device-to-device copy on CUDA); the caller counts them."""
        self._check_range(src_offset, nbytes, "copy_bytes")
        self._check_range(dst_offset, nbytes, "copy_bytes")
        if self.device == "cpu":
            self.pool[dst_offset:dst_offset + nbytes] = self.pool[src_offset:src_offset + nbytes]
        else:
            base = self.arena.base
            _cuda_copy(self.device_index, base + dst_offset, base + src_offset, nbytes, "copy_bytes")

    def directory_input(self):
        """The directory to feed a run: the host array on the CPU; on CUDA the device OrtValue, after one
        host-to-device copy of the rows changed since the last call (Note [Page pool on CUDA])."""
        if self.directory_device is None:
            return self.directory
        if self._dirty is not None:
            lo, hi = self._dirty
            row = self.directory.itemsize * 2
            _cuda_copy(self.device_index, self.directory_device.data_ptr() + lo * row,
                       self.directory[lo:hi].ctypes.data, (hi - lo) * row, "directory_input")
            self.directory_bytes_uploaded += (hi - lo) * row
            self._dirty = None
        return self.directory_device

    def _set_row(self, page: int, fmt: int, offset: int) -> None:
        self.directory[page] = (fmt, offset)
        if self.directory_device is not None:
            lo, hi = self._dirty if self._dirty is not None else (page, page + 1)
            self._dirty = (min(lo, page), max(hi, page + 1))

    # -- pages ---------------------------------------------------------------------------------------
    def alloc(self, fmt, *, pinned: bool = False) -> int:
        """A new page of ``fmt``: a free slot of its slab, else the slab grows by a granule (governed),
        else (refused) a free slot borrowed from a wider slab, else demotion when enabled (Note [Page
        pool]). CapacityError with the numbers when none works; nothing changes then."""
        fmt = parse_format(fmt)
        self._slab(fmt)
        if not self._free_pages:
            raise CapacityError(f"PagePool.alloc: all {self.max_pages} pages are in use (max_pages); free pages or "
                                f"create the pool with a larger max_pages", requested=1, capacity=self.max_pages)
        where = self._take_slot(fmt, demote=self.demote_on_refusal)
        page = heapq.heappop(self._free_pages)
        self._slot[page] = where
        self._set_row(page, int(fmt), self.slabs[where[0]].slot_offset(where[1]))
        self._age[page] = next(self._ages)
        if pinned:
            self._pinned.add(page)
        return page

    def free(self, page: int) -> None:
        self._check_page(page, "free")
        slab_fmt, slot = self._slot.pop(page)
        heapq.heappush(self.slabs[slab_fmt].free, slot)
        self._set_row(page, -1, -1)
        self._age.pop(page, None)
        self._pinned.discard(page)
        heapq.heappush(self._free_pages, page)
        self.page_changes += 1

    def pin(self, page: int, pinned: bool = True) -> None:
        """Pinned pages are never demoted (sink pages, a page being filled)."""
        self._check_page(page, "pin")
        if (page in self._pinned) != bool(pinned):
            (self._pinned.add if pinned else self._pinned.discard)(page)
            self.page_changes += 1

    def requantize(self, page: int, fmt) -> None:
        """Convert ``page`` to ``fmt``: a slot of the new format, every layer decoded and re-encoded there
        (_ortkv.paged_requantize), the directory row rewritten, the old slot freed. On any error nothing
        changes (the new slot goes back)."""
        self._check_page(page, "requantize")
        fmt = parse_format(fmt)
        self._slab(fmt)
        src_fmt = self.format_of(page)
        if fmt == src_fmt:
            return
        dst = self._take_slot(fmt, demote=False)
        dst_offset = self.slabs[dst[0]].slot_offset(dst[1])
        try:
            if self.device == "cpu":
                _native_requantize(self.pool, self.offset_of(page), int(src_fmt), dst_offset, int(fmt),
                                   self.num_layers, self.kv_heads, self.page_size, self.head_size, self.logical)
            elif (kernel := _cuda_requantize_kernel()) is not None:  # Note [Requantize on a CUDA pool]
                _call_native(kernel, self.device_index, self.arena.base, self.pool_bytes, self.offset_of(page),
                             int(src_fmt), dst_offset, int(fmt), self.num_layers, self.kv_heads, self.page_size,
                             self.head_size, self.logical)
            else:  # a build without the CUDA kernels: one page staged through the host, counted
                self._staged_requantize(self.offset_of(page), src_fmt, dst_offset, fmt)
        except BaseException:
            heapq.heappush(self.slabs[dst[0]].free, dst[1])
            raise
        old = self._slot[page]
        self._slot[page] = dst
        self._set_row(page, int(fmt), dst_offset)
        heapq.heappush(self.slabs[old[0]].free, old[1])
        self.bytes_copied += self.slabs[fmt].slot_bytes
        self.requantized_pages += 1
        self.page_changes += 1

    def _staged_requantize(self, src_offset: int, src_fmt: PageFormat, dst_offset: int, fmt: PageFormat) -> None:
        """Note [Requantize on a CUDA pool] (builds without the CUDA kernels): one page staged through a host
        buffer [source slot | destination slot]."""
        ss, ds = self.slabs[src_fmt].slot_bytes, self.slabs[fmt].slot_bytes
        at = -(-ss // 16) * 16  # the destination half, 16-byte aligned as the codecs want
        buf = np.zeros(at + ds, np.uint8)
        _cuda_copy(self.device_index, buf.ctypes.data, self.arena.base + src_offset, ss, "requantize")
        self.bytes_staged += ss
        _native_requantize(buf, 0, int(src_fmt), at, int(fmt), self.num_layers, self.kv_heads, self.page_size,
                           self.head_size, self.logical)  # raises before the device is touched
        _cuda_copy(self.device_index, self.arena.base + dst_offset, buf[at:].ctypes.data, ds, "requantize")
        self.bytes_staged += ds

    def close(self) -> None:
        """Give the arena back (deferred while a session still binds the pool; Note [Arena exports])."""
        self.pool = None
        self.directory_device = None
        self.arena.close_when_unused()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"<PagePool layers={self.num_layers} kv_heads={self.kv_heads} head_size={self.head_size} "
                f"page_size={self.page_size} pages={len(self._slot)}/{self.max_pages} "
                f"committed={self.committed_bytes}>")

    # -- slots ---------------------------------------------------------------------------------------
    def _slab(self, fmt: PageFormat) -> _Slab:
        slab = self.slabs.get(fmt)
        if slab is None:
            raise OrtkvError(f"PagePool: format {fmt.name} cannot hold pages of head_size {self.head_size} "
                             f"(it packs several channels per byte); use one of "
                             f"{', '.join(f.name for f in self.slabs)}")
        return slab

    def _check_page(self, page, what: str) -> None:
        if not isinstance(page, (int, np.integer)) or int(page) not in self._slot:
            raise OrtkvError(f"PagePool.{what}: page {page!r} is not an allocated page (live pages: "
                             f"{len(self._slot)} of {self.max_pages})")

    def _take_slot(self, fmt: PageFormat, demote: bool) -> tuple[PageFormat, int]:
        slab = self.slabs[fmt]
        if slab.free:
            return fmt, heapq.heappop(slab.free)
        if slab.fresh >= slab.capacity:  # cannot happen while pages <= max_pages; kept as a guard
            raise CapacityError(f"PagePool: the {fmt.name} slab's {slab.capacity} slots are all taken",
                                requested=1, capacity=slab.capacity)
        end = (slab.fresh + 1) * slab.slot_bytes
        if end > slab.committed_end:
            ahead = min(slab.capacity * slab.slot_bytes, end + self.commit_ahead * slab.slot_bytes)
            refused = None
            for target in (ahead, end) if ahead > end else (end,):  # the slots ahead refused: the one alone
                try:
                    self._grow(slab, target)
                    refused = None
                    break
                except CapacityError as exc:
                    refused = exc
            if refused is not None:
                return self._after_refusal(fmt, refused, demote)
        i = slab.fresh
        slab.fresh += 1
        return fmt, i

    def _grow(self, slab: _Slab, end: int) -> None:
        """Commit the slab's bytes up to ``end`` (granule-rounded); CapacityError, nothing committed, if refused."""
        self.arena.commit(end - slab.committed_end, slab.offset + slab.committed_end)
        g = self.granule
        slab.committed_end = -(-end // g) * g

    def _borrow(self, fmt: PageFormat) -> tuple[PageFormat, int] | None:
        """The smallest free committed slot of another slab that holds a page of ``fmt``: a freed one, else a fresh
        one its commit_ahead committed (budget that slab holds and no page uses yet)."""
        need = self.slabs[fmt].slot_bytes
        fits = sorted((s.slot_bytes, f) for f, s in self.slabs.items()
                      if f != fmt and s.slot_bytes >= need and (s.free or self._committed_fresh(s)))
        if not fits:
            return None
        s = self.slabs[fits[0][1]]
        if s.free:
            return s.fmt, heapq.heappop(s.free)
        s.fresh += 1
        return s.fmt, s.fresh - 1

    @staticmethod
    def _committed_fresh(s: _Slab) -> bool:
        """Whether the slab's next fresh slot is already committed (commit_ahead)."""
        return s.fresh < s.capacity and (s.fresh + 1) * s.slot_bytes <= s.committed_end

    def _after_refusal(self, fmt: PageFormat, refused: CapacityError, demote: bool) -> tuple[PageFormat, int]:
        got = self._borrow(fmt)
        if got is not None:
            return got
        demoted = 0
        if demote:
            need = self.slabs[fmt].slot_bytes
            for page in sorted(self._slot, key=self._age.__getitem__):
                pf = self.format_of(page)
                if page in self._pinned or pf not in DEMOTE:
                    continue
                if self.slabs[self._slot[page][0]].slot_bytes < need:
                    continue  # its slot would not hold the refused page
                try:
                    self.requantize(page, DEMOTE[pf])
                except CapacityError:
                    continue  # no room for the narrower copy either
                self.demoted_pages += 1
                demoted += 1
                got = self._borrow(fmt) if not self.slabs[fmt].free else (fmt, heapq.heappop(self.slabs[fmt].free))
                if got is not None:
                    return got
        gov = self.arena.governor
        numbers = (f"budget {gov.budget} bytes, {gov.in_use} in use" if gov is not None else "no governor")
        tried = (f"; demoted {demoted} page(s) one step (pinned pages and INT4/INT2 pages are never demoted) "
                 f"without freeing a slot that fits" if demote else
                 "; enable demotion (demote_on_refusal) to narrow older pages first")
        raise CapacityError(
            f"PagePool.alloc: the governor refused {self.granule}-byte granule(s) for a {fmt.name} page of "
            f"{self.slabs[fmt].slot_bytes} bytes ({numbers}; pool committed {self.committed_bytes} bytes, "
            f"{len(self._slot)} pages live) and no free slot of a wider format fits{tried}; raise the budget or "
            f"free pages", requested=self.slabs[fmt].slot_bytes,
            capacity=getattr(refused, "capacity", None), budget=gov.budget if gov else None,
            in_use=gov.in_use if gov else None) from None


# --- policies -------------------------------------------------------------------------------------------
# Note [Page policies]
# ~~~~~~~~~~~~~~~~~~~~
# A policy names the format each page of a sequence should have, by the page's index in the sequence
# (0 = its first page_size tokens) and the number of pages the sequence has. PagedKVCache asks it when a
# page opens and again whenever the sequence grows (advance):
#   * a page opens in its target format, unless the target is a *_KC format (keys per channel over the
#     page: only encoded whole), then it opens wide (F16, or BF16 for a bfloat16 model) and is requantized
#     when full;
#   * a full page whose format is wider than its target is requantized (one page of the new format, the
#     old slot freed). A page is never widened: precision lost is not restored, so a page demoted under
#     pressure stays narrow.
# Sink pages (RecencyPolicy.sink_pages, KVQuant/StreamingLLM's attention sinks) and the page being filled
# are pinned: PagePool's demotion never touches them.
class Policy:
    sink_pages = 0

    def target(self, index: int, num_pages: int) -> PageFormat:
        raise NotImplementedError

    def retargeted(self, old_pages: int, new_pages: int) -> range:
        """The indices of the pages whose target may differ between a sequence of ``old_pages`` pages and one of
        ``new_pages`` (Note [Incremental advance]); target must be a function of (index, num_pages) alone. This
        default names every page when the count changed; a policy that knows better says less."""
        return range(max(old_pages, new_pages)) if old_pages != new_pages else range(0)

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class UniformPolicy(Policy):
    """One format for every page (``kv_format``)."""

    fmt: PageFormat

    def target(self, index: int, num_pages: int) -> PageFormat:
        return self.fmt

    def retargeted(self, old_pages: int, new_pages: int) -> range:
        return range(0)  # the target does not depend on the count

    def describe(self) -> str:
        return self.fmt.name


@dataclass(frozen=True)
class RecencyPolicy(Policy):
    """The first ``sink_pages`` and the newest ``recent_pages`` pages (the one being filled included) in
    ``recent``, every other page in ``old``: pages leaving the window are requantized."""

    sink_pages: int = 1
    recent_pages: int = 4
    recent: PageFormat = PageFormat.F16
    old: PageFormat = PageFormat.INT4

    def target(self, index: int, num_pages: int) -> PageFormat:
        return self.recent if index < self.sink_pages or index >= num_pages - self.recent_pages else self.old

    def retargeted(self, old_pages: int, new_pages: int) -> range:
        # index i >= sink_pages is recent iff i >= num_pages - recent_pages: it changes side iff it lies between
        # the two counts' window starts
        lo, hi = sorted((old_pages - self.recent_pages, new_pages - self.recent_pages))
        return range(max(self.sink_pages, lo), max(self.sink_pages, hi))

    def describe(self) -> str:
        return f"recency(sink {self.sink_pages}, recent {self.recent_pages} {self.recent.name}, old {self.old.name})"


@dataclass(frozen=True)
class ExplicitPolicy(Policy):
    """Page i of every sequence in ``formats[i]`` (the last entry for pages past the list): for tests."""

    formats: tuple

    def target(self, index: int, num_pages: int) -> PageFormat:
        return self.formats[min(index, len(self.formats) - 1)]

    def retargeted(self, old_pages: int, new_pages: int) -> range:
        return range(0)  # the target does not depend on the count

    def describe(self) -> str:
        return "explicit(" + ", ".join(f.name for f in self.formats) + ")"


_RECENCY_KEYS = {"sink_pages": int, "recent_pages": int, "recent": str, "old": str}


def recency_from_dict(d: dict, where: str = "ortkv.kv_policy") -> RecencyPolicy:
    if not isinstance(d, dict):
        raise OrtkvError(f"{where}: expected an object like {{\"sink_pages\": 1, \"recent_pages\": 4, "
                         f"\"recent\": \"f16\", \"old\": \"int4\"}}, got {d!r}")
    unknown = sorted(set(d) - set(_RECENCY_KEYS))
    if unknown:
        raise OrtkvError(f"{where}: unknown key(s) {unknown}; known: {sorted(_RECENCY_KEYS)}")
    vals = {"sink_pages": 1, "recent_pages": 4, "recent": "f16", "old": "int4", **d}
    for key in ("sink_pages", "recent_pages"):
        v = vals[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) != int(v):
            raise OrtkvError(f"{where}.{key} = {v!r}: expected an integer")
        vals[key] = int(v)
    if vals["sink_pages"] < 0:
        raise OrtkvError(f"{where}.sink_pages = {vals['sink_pages']} must be >= 0")
    if vals["recent_pages"] < 1:
        raise OrtkvError(f"{where}.recent_pages = {vals['recent_pages']} must be >= 1 (the page being filled is "
                         "always recent)")
    recent = parse_format(vals["recent"], f"{where}.recent")
    old = parse_format(vals["old"], f"{where}.old")
    if recent in KEYS_PER_CHANNEL:
        raise OrtkvError(f"{where}.recent = {vals['recent']!r}: the recent window holds the page being filled, "
                         "which a keys-per-channel format cannot take row by row; use f16, bf16, int8, fp8_e4m3, "
                         "int4 or int2")
    return RecencyPolicy(vals["sink_pages"], vals["recent_pages"], recent, old)


def policy_from_config(kv_format: str = "", kv_policy=None, kv_page_formats=None, where: str = "ortkv") -> Policy:
    """The policy the ``ortkv`` section names (exactly one of kv_format / kv_policy / kv_page_formats;
    none: F16 pages)."""
    given = [k for k, v in (("kv_format", kv_format), ("kv_policy", kv_policy), ("kv_page_formats", kv_page_formats))
             if v]
    if len(given) > 1:
        raise OrtkvError(f"{where}: {' and '.join(given)} are both set; a paged cache takes one of kv_format, "
                         "kv_policy, kv_page_formats")
    if kv_policy:
        if not isinstance(kv_policy, dict):
            raise OrtkvError(f"{where}.kv_policy = {kv_policy!r}: expected an object (the recency policy)")
        return recency_from_dict(kv_policy, f"{where}.kv_policy")
    if kv_page_formats:
        if not isinstance(kv_page_formats, (list, tuple)):
            raise OrtkvError(f"{where}.kv_page_formats = {kv_page_formats!r}: expected a list of format names")
        return ExplicitPolicy(tuple(parse_format(f, f"{where}.kv_page_formats[{i}]")
                                    for i, f in enumerate(kv_page_formats)))
    return UniformPolicy(parse_format(kv_format or "f16", f"{where}.kv_format"))


# --- sequences ------------------------------------------------------------------------------------------
# Note [Incremental advance]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# reserve() and advance() run on the host before and after every decode step, so their cost must not grow with
# the tokens a row holds. Walking every page of every row (what they first did) cost 2.4-2.7 ms a step at 8 rows
# of 4K tokens on a 2-core VM, more than the H200's whole decode step. Now:
#   * reserve finds the missing pages of the rows' first ceil(n / page_size) entries with one vectorized compare
#     over the table and opens only those (row by row, page by page, in the order the loop had);
#   * advance applies the policy (requantize a full page wider than its target, pin sink pages, unpin the others)
#     only to the pages whose outcome can have changed since the row was last settled: the pages that filled since
#     (index in [full then, full now)), and those the policy retargets between the row's page counts then and now
#     (Policy.retargeted: none for one format, the pages that left the recent window for RecencyPolicy, every page
#     for a policy that does not say). A row whose settled entries changed in the table, and every row when the
#     pool freed, pinned / unpinned or requantized a page since (PagePool.page_changes: another owner, a user's
#     requantize or pin, a demotion under pressure during reserve), is settled again whole, as before. Every other
#     page would see the same target, format and pin as when it was settled, so its outcome is the same: the result
#     equals the full walk's (tests/test_paged_pool.py compares the two step by step), at O(rows + pages changed) a
#     step.
# A full page's entry that is -1 is an error raised before anything changes.
class PagedKVCache:
    """The page tables of ``batch`` sequences over one PagePool, driven by a Policy (Note [Page
    policies]). ``page_table`` (int32 [batch, max_pages_per_seq], -1 = none) is bound in place."""

    def __init__(self, pool: PagePool, batch: int, max_pages_per_seq: int, policy: Policy | None = None):
        if batch < 1 or max_pages_per_seq < 1:
            raise OrtkvError(f"PagedKVCache: batch = {batch} and max_pages_per_seq = {max_pages_per_seq} must be >= 1")
        self.pool, self.policy = pool, policy or UniformPolicy(pool.wide)
        named = ({self.policy.target(i, 10**6) for i in range(64)} | set(getattr(self.policy, "formats", ())) |
                 {getattr(self.policy, "recent", pool.wide), pool.wide})
        for f in named:
            pool._slab(f)  # every format the policy names must fit the pool's head_size, before any page opens
        self.page_table = np.full((batch, max_pages_per_seq), -1, np.int32)
        self.lengths = np.zeros(batch, np.int64)
        self.capacity = max_pages_per_seq * pool.page_size
        self._cols = np.arange(max_pages_per_seq)
        self._unsettle()

    def _unsettle(self) -> None:
        """Forget what advance settled (Note [Incremental advance]): the next one walks every full page."""
        batch = self.page_table.shape[0]
        self._settled_full = np.zeros(batch, np.int64)   # pages [0, full) of row b were settled ...
        self._settled_pages = np.zeros(batch, np.int64)  # ... for a row of this many pages
        self._settled_table = self.page_table.copy()     # ... holding these entries
        self._settled_changes = -1                       # ... at this PagePool.page_changes (-1: never)

    def _open_format(self, index: int) -> PageFormat:
        f = self.policy.target(index, index + 1)
        return self.pool.wide if f in KEYS_PER_CHANNEL else f

    def reserve(self, new_lengths) -> int:
        """Open the pages rows need to hold ``new_lengths`` tokens (call before the run that writes them);
        returns the pages opened. All or nothing: on CapacityError the pages opened here are freed."""
        new_lengths = np.asarray(new_lengths, np.int64).reshape(-1)
        ps = self.pool.page_size
        if len(new_lengths) != len(self.lengths):
            raise OrtkvError(f"PagedKVCache.reserve: {len(new_lengths)} lengths for a batch of {len(self.lengths)}")
        if new_lengths.max(initial=0) > self.capacity:
            raise CapacityError(f"PagedKVCache.reserve: {int(new_lengths.max())} tokens exceed the {self.capacity} "
                                f"a row holds ({self.page_table.shape[1]} pages of {ps}); raise max_pages_per_seq",
                                requested=int(new_lengths.max()), capacity=self.capacity)
        need = -(-new_lengths // ps)
        missing = (self.page_table < 0) & (self._cols < need[:, None])
        if not missing.any():
            return 0
        return self._open(zip(*np.nonzero(missing)))  # row-major: row by row, page by page

    def _open(self, entries) -> int:
        """Open a page (pinned: being filled) at each (row, index) of ``entries``, in that order; all or nothing."""
        opened: list[tuple[int, int]] = []
        try:
            for b, i in entries:
                b, i = int(b), int(i)
                self.page_table[b, i] = self.pool.alloc(self._open_format(i), pinned=True)
                opened.append((b, i))
        except BaseException:
            for b, i in opened:
                self.pool.free(int(self.page_table[b, i]))
                self.page_table[b, i] = -1
            raise
        return len(opened)

    def advance(self, new_lengths) -> int:
        """The rows now hold ``new_lengths`` tokens (the run wrote them): apply the policy to full pages,
        unpin full non-sink pages; returns the pages requantized. Only the pages whose outcome can have
        changed are visited (Note [Incremental advance])."""
        new_lengths = np.asarray(new_lengths, np.int64).reshape(-1)
        ps, pool, policy, table = self.pool.page_size, self.pool, self.policy, self.page_table
        if len(new_lengths) != len(self.lengths):
            raise OrtkvError(f"PagedKVCache.advance: {len(new_lengths)} lengths for a batch of {len(self.lengths)}")
        full_now, pages_now = new_lengths // ps, -(-new_lengths // ps)
        holes = (table < 0) & (self._cols < full_now[:, None])
        if holes.any():
            b, i = (int(x[0]) for x in np.nonzero(holes))
            raise OrtkvError(f"PagedKVCache.advance: row {b} has {int(new_lengths[b])} tokens but no page {i}; "
                             "reserve() before the run")
        everything = pool.page_changes != self._settled_changes
        moved = ((table != self._settled_table) & (self._cols < self._settled_full[:, None])).any(axis=1)
        changed = 0
        for b in range(len(new_lengths)):
            full, num_pages = int(full_now[b]), int(pages_now[b])
            was_full, was_pages = int(self._settled_full[b]), int(self._settled_pages[b])
            if everything or moved[b]:
                visit = range(full)
            else:
                again = getattr(policy, "retargeted", None)
                again = (again or partial(Policy.retargeted, policy))(was_pages, num_pages)
                visit = [i for i in again if i < min(full, was_full)] + list(range(was_full, full))
            for i in visit:
                page = int(table[b, i])
                want, have = policy.target(i, num_pages), pool.format_of(page)
                if want != have and pool.slot_bytes(want) < pool.slot_bytes(have):
                    pool.requantize(page, want)
                    changed += 1
                pool.pin(page, i < policy.sink_pages)
        self._settled_full, self._settled_pages = full_now, pages_now
        self._settled_table = table.copy()
        self._settled_changes = pool.page_changes
        self.lengths = np.maximum(self.lengths, new_lengths)
        return changed

    def release(self) -> None:
        """Free every page of every row."""
        for page in self.page_table[self.page_table >= 0]:
            self.pool.free(int(page))
        self.page_table.fill(-1)
        self.lengths[:] = 0
        self._unsettle()

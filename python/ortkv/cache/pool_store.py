"""``PoolPageStore``: the page store protocol (Note [Page store protocol]) over a real
``ortkv.paged.PagePool``, so that ``PageCache`` drives the pages the paged ops read.

Note [Pool page store]
~~~~~~~~~~~~~~~~~~~~~~
PageCache page ids ARE PagePool page ids (directory rows): ``alloc`` / ``free`` / ``requantize`` pass
straight through, and a page keeps its id when it is requantized (only its directory row changes), so
the cache's page tables stay valid. ``page_bytes(fmt)`` is the bytes of one page of every layer (a
pool slot), as the protocol wants; PagePool.page_bytes is one layer's.

``copy(src, dst)`` copies the whole slot of ``src`` (every layer, K and V) onto ``dst``'s, both live and
in the same format (on a CUDA pool, one device-to-device cudaMemcpy: PagePool.copy_bytes). PageCache no
longer calls it: forks and reorders share partly filled pages through page fills (Note [Page metadata]),
so no step copies. The bytes are counted in the pool's own ``bytes_copied`` counter (with requantize's),
so "zero bytes copied" is read from one place. The pool's refusal (its governor, or max_pages) is a ``CapacityError`` from ``alloc``,
which PageCache's admission turns into eviction of cold cached pages or a Refusal (Note [Admission]).
"""

from __future__ import annotations

from ..errors import CacheProtocolError
from ..reference.codecs import KEYS_PER_CHANNEL, PageFormat


class PoolPageStore:
    """PageStore over a PagePool (Note [Pool page store]). ``copies`` counts copy() calls."""

    def __init__(self, pool):
        self.pool = pool
        self.copies = 0

    # -- the protocol ------------------------------------------------------------------------------
    def alloc(self, fmt: int) -> int:
        if PageFormat(int(fmt)) in KEYS_PER_CHANNEL:
            raise CacheProtocolError(f"PoolPageStore.alloc: format {PageFormat(int(fmt)).name} encodes keys per "
                                     "channel over a whole page and cannot be written row by row; write pages in "
                                     "f16, bf16, int8, fp8_e4m3, int4 or int2")
        return self.pool.alloc(int(fmt))

    def free(self, page_id: int) -> None:
        self.pool.free(int(page_id))

    def page_bytes(self, fmt: int) -> int:
        return self.pool.slot_bytes(int(fmt))

    def requantize(self, page_id: int, fmt: int) -> None:
        self.pool.requantize(int(page_id), int(fmt))

    def copy(self, src: int, dst: int) -> None:
        pool = self.pool
        live = set(pool.live_pages)
        for bad in (src, dst):
            if bad not in live:
                raise CacheProtocolError(f"PoolPageStore.copy {src} -> {dst}: page {bad} is not live in the pool")
        fs, fd = pool.format_of(src), pool.format_of(dst)
        if fs != fd:
            raise CacheProtocolError(f"PoolPageStore.copy {src} -> {dst}: formats differ ({fs.name} vs {fd.name}); "
                                     "copy-on-write copies a partly filled page into a new page of its own format")
        n = pool.slot_bytes(fs)
        so, do = pool.offset_of(src), pool.offset_of(dst)
        pool.copy_bytes(do, so, n)  # a device-to-device copy on a CUDA pool (Note [Page pool on CUDA])
        pool.bytes_copied += n
        self.copies += 1

    # -- reports -----------------------------------------------------------------------------------
    @property
    def committed_bytes(self) -> int:
        return self.pool.committed_bytes

    @property
    def bytes_copied(self) -> int:
        return self.pool.bytes_copied

    @property
    def live_bytes(self) -> int:
        """Bytes of the live pages' slots (what the tokens hold, without granule rounding)."""
        return self.pool.stats()["live_bytes"]

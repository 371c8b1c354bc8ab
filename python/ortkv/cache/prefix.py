"""Prefix caching: full pages keyed by a hash chain of their tokens, unreferenced ones evicted LRU.

Note [Prefix hash chain]
~~~~~~~~~~~~~~~~~~~~~~~~
A full page k of a sequence is keyed by

    h_k = blake2b(model_key || h_{k-1} || tokens[k*page_size : (k+1)*page_size] as int64 LE), 16 bytes

with h_{-1} = b"". The key therefore names the page's whole prefix, not only its own tokens (the KV of
a token depends on every token before it), and the model key (model, weights, logical dtype, page
format policy, RoPE settings: whatever changes the K/V bytes) keeps two models' pages apart. Only
full pages are keyed: a partly filled page is still being written, and a page's key is registered
after the step that filled it ran (``PageCache.done``), never at admission. A page whose key is
already held by another page (two requests prefilled the same prompt in one step) stays unkeyed;
no content is deduplicated after the fact.

A cached page that no sequence owns stays allocated in the store and sits in an LRU list; a new
sequence whose prompt hashes to it takes it back (refcount 0 -> 1, out of the LRU). When the store
refuses an allocation, admission evicts from the cold end of the LRU (frees the slot, drops the key)
and retries; pages owned by any sequence are never evicted. A page that will be written in place
(its only owner truncated into it and writes again) loses its key first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np


def chain_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, model_key: bytes = b"",
                 previous: bytes = b"", first_page: int = 0, count: int | None = None) -> list[bytes]:
    """Keys of the full pages of ``tokens`` (Note [Prefix hash chain]), starting at page
    ``first_page`` whose predecessor's key is ``previous``; at most ``count`` pages."""
    arr = np.asarray(tokens, dtype="<i8")
    full = arr.size // page_size
    if count is not None:
        full = min(full, first_page + count)
    out, h = [], previous
    for k in range(first_page, full):
        h = hashlib.blake2b(model_key + h + arr[k * page_size:(k + 1) * page_size].tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class PrefixIndex:
    """key -> page id for cached full pages, and the LRU of those no sequence owns."""

    def __init__(self):
        self.by_key: dict[bytes, int] = {}
        self.unreferenced: OrderedDict[int, bytes] = OrderedDict()  # page id -> key, oldest first
        self.hits = 0          # pages reused
        self.evictions = 0

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """The longest run of leading keys that are cached, as page ids."""
        out = []
        for key in keys:
            pid = self.by_key.get(key)
            if pid is None:
                break
            out.append(pid)
        return out

    def register(self, key: bytes, page_id: int) -> bool:
        if key in self.by_key:
            return False
        self.by_key[key] = page_id
        return True

    def forget(self, key: bytes) -> None:
        del self.by_key[key]

    def park(self, page_id: int, key: bytes) -> None:
        """A cached page lost its last owner: keep it, most recently used."""
        self.unreferenced[page_id] = key

    def unpark(self, page_id: int) -> None:
        del self.unreferenced[page_id]

    def pop_coldest(self) -> tuple[int, bytes] | None:
        if not self.unreferenced:
            return None
        page_id, key = self.unreferenced.popitem(last=False)
        del self.by_key[key]
        self.evictions += 1
        return page_id, key

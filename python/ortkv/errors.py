"""The ortkv error family. Every refusal names the tensor and the numbers, and where known the remedy."""

from __future__ import annotations

import re


class OrtkvError(Exception):
    """Base of every error ortkv raises on purpose."""


class AliasError(OrtkvError):
    """An updated cache is not the storage of its cache (pointer identity broken)."""


class ImmutableStorageError(OrtkvError):
    """Storage that must not be written was offered as a cache: a read-only array, an initializer,
    an input not marked READ_WRITE, or a write-protected range."""


class BindingConflictError(OrtkvError):
    """Storage overlaps another live writable binding, or a session's caches are already in use."""


class CapacityError(OrtkvError):
    """A write or commit does not fit. ``requested`` and ``capacity`` carry the numbers."""

    def __init__(self, message: str, requested: int | None = None, capacity: int | None = None, **numbers):
        super().__init__(message)
        self.requested = requested
        self.capacity = capacity
        for key, value in numbers.items():
            setattr(self, key, value)


class GraphCheckError(OrtkvError):
    """A model's alias annotations are inconsistent or unsafe. ``findings`` lists each problem."""

    def __init__(self, message: str, findings: list | None = None):
        super().__init__(message)
        self.findings = list(findings or [])


class StorageError(OrtkvError, ValueError):
    """Storage offered for a cache has the wrong type, shape, device or layout."""


class InputTypeError(OrtkvError, TypeError):
    """A feed (an input that is not a cache) has an element type the model does not declare.
    ``input``, ``expected`` and ``given`` carry the input's name and the two type names."""

    def __init__(self, message: str, input: str | None = None, expected: str | None = None,
                 given: str | None = None):
        super().__init__(message)
        self.input, self.expected, self.given = input, expected, given


class MissingInputError(OrtkvError, ValueError):
    """A run left out a non-cache input of the model (``inputs`` lists them); nothing was run."""

    def __init__(self, message: str, inputs: list[str] | None = None):
        super().__init__(message)
        self.inputs = list(inputs or [])


class CacheInputError(OrtkvError, ValueError):
    """A cache op refused its inputs (shape, type, negative position); the cache is unchanged."""


# --- native status messages ("[ortkv:E_*] ...") -> typed errors ----------------------------------
_NUMBERS = re.compile(r"\[((?:\w+=\d+ ?)+)\]")
_KERNEL_CAPACITY = re.compile(r"position (\d+) \+ n (\d+) = (\d+) exceeds capacity (\d+)")


def from_native(exc: Exception) -> Exception:
    """Turn an exception whose text carries an '[ortkv:E_*]' tag (from a kernel through ONNX Runtime,
    or from the native core) into the matching typed error; return ``exc`` itself otherwise."""
    text = str(exc)
    m = re.search(r"\[ortkv:(E_[A-Z]+)\] (.*)", text, re.S)
    tagged = {"E_CAPACITY": CapacityError, "E_UNCOMMITTED": CapacityError, "E_ALIAS": AliasError,
              "E_READONLY": ImmutableStorageError, "E_INPUT": CacheInputError}
    if not m or m.group(1) not in tagged:
        return exc
    message = m.group(2).strip()
    cls = tagged[m.group(1)]
    if cls is not CapacityError:
        return cls(message)
    numbers = {}
    for group in _NUMBERS.findall(message):
        numbers.update({k: int(v) for k, v in (kv.split("=") for kv in group.split())})
    c = _KERNEL_CAPACITY.search(message)
    if c:
        numbers.update(position=int(c.group(1)), n=int(c.group(2)), requested=int(c.group(3)),
                       capacity=int(c.group(4)))
    if "budget" in numbers:
        numbers.setdefault("capacity", numbers["budget"])
        numbers["retry_hint"] = "retry after other caches release memory, or request fewer bytes"
    return CapacityError(message, **numbers)


class ArenaError(OrtkvError, ValueError):
    """A bad argument to an arena (a size, an offset, a device), or an operation on a closed arena.
    Nothing changed."""


class ArenaBusyError(OrtkvError, BufferError):
    """close() or release() refused: views or session bindings of the arena are alive (Note [Arena
    exports]). Nothing changed."""


class CacheProtocolError(OrtkvError, ValueError):
    """A call to ``ortkv.cache`` out of protocol (an unknown sequence, a bad range, a duplicate id).
    Raised before anything changed: page metadata, page tables and the page store are untouched."""


class SequenceRemovedError(CacheProtocolError):
    """A sequence removed from an ``ortkv.cache.PageCache`` was used again (ids are never reused)."""


class SequenceBusyError(CacheProtocolError):
    """A sequence stepped twice in one step, or a call made while an admitted step is still running
    (finish it with ``done()`` or ``cancel()`` first)."""

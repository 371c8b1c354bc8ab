"""The ortkv error family. Every refusal names the tensor and the numbers, and where known the remedy."""

from __future__ import annotations


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


class CacheInputError(OrtkvError, ValueError):
    """A cache op refused its inputs (shape, type, negative position); the cache is unchanged."""

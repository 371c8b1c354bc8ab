"""ortkv: a KV-cache runtime for ONNX Runtime whose cache updates are provably in place.

    import onnxruntime as ort, ortkv
    so = ort.SessionOptions()
    so.register_custom_ops_library(ortkv.get_library_path())   # ops in domain "ortkv"

or, with the bindings, ownership and pointer checks done for you, ``ortkv.MutableCacheSession``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import (
    AliasError,
    ArenaBusyError,
    ArenaError,
    BindingConflictError,
    CacheInputError,
    CapacityError,
    GraphCheckError,
    ImmutableStorageError,
    InputTypeError,
    MissingInputError,
    OrtkvError,
    StorageError,
)

__version__ = "0.1.0"
DOMAIN = "ortkv"
OPSET = 1


def get_library_path() -> str:
    """Path of the custom-op library for ``SessionOptions.register_custom_ops_library``."""
    path = Path(__file__).with_name("libortkv.so")
    if not path.exists():
        raise OrtkvError(
            f"the ortkv op library is missing at {path}; reinstall ortkv with `pip install .` "
            "from the repository (it builds the library)"
        )
    return str(path)


def __getattr__(name: str):
    # Lazy: importing ortkv must not import onnxruntime until a session is needed.
    if name == "MutableCacheSession":
        from .session import MutableCacheSession

        return MutableCacheSession
    if name == "take_cuda_error":
        from .session import take_cuda_error

        return take_cuda_error
    raise AttributeError(f"module 'ortkv' has no attribute {name!r}")


__all__ = [
    "AliasError",
    "ArenaBusyError",
    "ArenaError",
    "BindingConflictError",
    "CacheInputError",
    "CapacityError",
    "DOMAIN",
    "GraphCheckError",
    "ImmutableStorageError",
    "InputTypeError",
    "MissingInputError",
    "MutableCacheSession",
    "OPSET",
    "OrtkvError",
    "StorageError",
    "get_library_path",
    "take_cuda_error",
]

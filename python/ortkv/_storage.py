"""Normalizes what a user may bind as a cache (numpy array, OrtValue, any DLPack tensor, arena view)
into one description: pointer, bytes, device, ONNX element type, shape, writability, contiguity.
Nothing here copies data."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import StorageError

# ONNX TensorProto element types <-> numpy.
FLOAT, INT64, FLOAT16, BFLOAT16 = 1, 7, 10, 16
ONNX_TYPE_NAMES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
                   9: "bool", 10: "float16", 11: "float64", 16: "bfloat16"}
ELEM_SIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2}
_ORT_TYPE_STRINGS = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(int64)": 7,
                     "tensor(int32)": 6, "tensor(double)": 11, "tensor(uint8)": 2, "tensor(int8)": 3,
                     "tensor(uint16)": 4, "tensor(int16)": 5, "tensor(bool)": 9}


def numpy_onnx_type(dtype: np.dtype, declared: int | None = None) -> int | None:
    """The ONNX element type of a numpy dtype; a uint16 array where bfloat16 is declared holds
    bfloat16 bits (numpy has no bfloat16 of its own)."""
    dtype = np.dtype(dtype)
    if declared == BFLOAT16 and dtype == np.uint16:
        return BFLOAT16
    if dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return BFLOAT16
    table = {np.float32: 1, np.uint8: 2, np.int8: 3, np.uint16: 4, np.int16: 5, np.int32: 6, np.int64: 7,
             np.bool_: 9, np.float16: 10, np.float64: 11}
    return table.get(dtype.type)


@dataclass
class Storage:
    ptr: int
    nbytes: int
    device_type: str  # "cpu" or "cuda"
    device_id: int
    onnx_type: int
    shape: tuple[int, ...]
    writable: bool
    contiguous: bool
    kind: str  # "numpy", "ortvalue", "dlpack"
    ortvalue: Any = None  # set for OrtValue storage: bound as is
    keepalive: tuple = field(default_factory=tuple)
    # Why the storage is not known writable (shown in the refusal), when ``writable`` is False.
    not_writable_because: str = ""
    lease: Any = None  # an ortkv.vmm.ArenaLease while bound, when the storage lies in an arena

    def release_lease(self) -> None:
        """Return the arena lease taken at bind (if any): the arena may close again (Note [Arena exports])."""
        if self.lease is not None:
            self.lease.release()

    @property
    def device_key(self) -> tuple[str, int]:
        return (self.device_type, self.device_id)

    def describe(self) -> str:
        return (f"{self.kind} {ONNX_TYPE_NAMES.get(self.onnx_type, self.onnx_type)}{list(self.shape)} on "
                f"{self.device_type}:{self.device_id} at 0x{self.ptr:x} (+{self.nbytes} bytes)")


def _from_numpy(arr: np.ndarray, declared_type: int | None) -> Storage:
    onnx_type = numpy_onnx_type(arr.dtype, declared_type)
    return Storage(ptr=arr.ctypes.data, nbytes=arr.nbytes, device_type="cpu", device_id=0,
                   onnx_type=onnx_type if onnx_type is not None else -1, shape=tuple(arr.shape),
                   writable=bool(arr.flags.writeable), contiguous=bool(arr.flags.c_contiguous), kind="numpy",
                   keepalive=(arr,))


# Note [Writable OrtValue storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A cache is written in place, so its memory must be KNOWN writable; an OrtValue does not say.
# OrtValue.ortvalue_from_numpy wraps any array, read-only ones included (np.frombuffer over a
# `bytes` object, an np.memmap opened with mode='r'), and ORT writes through it: the bytes object
# changes, the read-only mapping segfaults. What can actually be known about an OrtValue's memory:
#   * host memory made from a numpy array: ORT keeps that array (OrtValue._numpy_obj, the reference
#     that keeps the buffer alive). numpy's writeable flag is the owner's word: numpy refuses to make
#     a view of bytes, of a read-only mapping or of a read-only base writable. We require that array,
#     require that the OrtValue's bytes lie inside it (ORT silently copies a non-contiguous array,
#     and writing the copy would not update the caller's array), and require writeable=True.
#   * any other host OrtValue (allocated by ORT, or imported through OrtValue.from_dlpack, which
#     drops DLPack's read-only flag): nothing says whether the memory may be written. Page protection
#     (/proc/self/maps) is not a proof either: a `bytes` object lives on a writable heap page. Such
#     an OrtValue is refused with the remedy: bind the numpy array or the DLPack tensor itself
#     (ortkv reads their read-only flags), or wrap a writable array with ortvalue_from_numpy. If a
#     future onnxruntime drops `_numpy_obj`, host OrtValues are refused the same way (fail closed).
#   * a DLPack tensor: the producer's word. A versioned capsule carries a read-only flag; an
#     unversioned one cannot, and by convention a producer does not export read-only memory through
#     it (numpy raises BufferError instead). OrtValue.__dlpack__ breaks that convention; its capsules
#     are recognised by their deleter (code of onnxruntime's extension module) and refused like a
#     host OrtValue of unknown provenance. Memory that a third framework imported and re-exports
#     (torch.from_dlpack(ortvalue)) carries that framework's word: the limit of what can be known.
#   * CUDA memory: the allocations an OrtValue holds (cudaMalloc through ORT's allocator, or a
#     DLPack producer's) are mapped read-write; the only read-only device memory in an ortkv process
#     is a shared prefix that ortkv mapped itself and registered in the core (checked at bind and by
#     the kernel). So a CUDA OrtValue is accepted.
# Independently, MutableCacheSession checks the page protection of every host cache that is not an
# arena view (check_host_pages): it catches memory that numpy believes writable but that is mapped
# read-only (an array made over a raw pointer), which would otherwise segfault inside the op.
# The device id comes from OrtValue.__dlpack_device__() (the device name carries no index).
def ortvalue_device(value) -> tuple[str, int]:
    """(device type, device index) of an OrtValue: 'cpu' or 'cuda'."""
    name = value.device_name().lower()
    try:
        dl_type, dl_id = value.__dlpack_device__()
    except (AttributeError, RuntimeError, TypeError):  # an onnxruntime without OrtValue DLPack support
        if name == "cpu":
            return "cpu", 0
        raise StorageError(
            f"an OrtValue on '{name}': this onnxruntime cannot tell which device index holds it "
            "(OrtValue.__dlpack_device__ is missing); bind the tensor through DLPack (a torch or cupy tensor) "
            "instead") from None
    device_type = _dl_device_type(dl_type)
    if device_type is not None:
        return device_type, int(dl_id)
    raise StorageError(f"an OrtValue on '{name}' (DLPack device type {dl_type}) cannot be a cache: cpu or cuda only")


def _ortvalue_host_writable(value, ptr: int, nbytes: int) -> str:
    """'' when the host OrtValue's memory is known writable, else why not (Note [Writable OrtValue storage])."""
    source = getattr(value, "_numpy_obj", None)
    if not isinstance(source, np.ndarray):
        return ("an OrtValue whose host memory is not known writable: it was not made from a numpy array "
                "(ORT allocated it, or it was imported through DLPack, which loses the read-only flag). "
                "Bind the numpy array or the DLPack tensor itself, or make the OrtValue with "
                "OrtValue.ortvalue_from_numpy(writable_array)")
    low, high = np.lib.array_utils.byte_bounds(source) if hasattr(np.lib, "array_utils") else np.byte_bounds(source)
    if nbytes and not (low <= ptr and ptr + nbytes <= high):
        raise StorageError(
            f"the OrtValue at 0x{ptr:x} (+{nbytes} bytes) is not the memory of the numpy array it was made from "
            f"([0x{low:x}, 0x{high:x})): onnxruntime copied it (a non-contiguous array is copied), so an update "
            "would not reach your array. Pass a C-contiguous array (np.ascontiguousarray) and bind that array")
    if not source.flags.writeable:
        return ("an OrtValue made from a read-only numpy array (writeable=False: e.g. np.frombuffer over bytes, "
                "or an np.memmap opened with mode='r'); ortkv writes caches in place and never copies them. "
                "Wrap a writable array (e.g. np.array(x, copy=True))")
    return ""


def _from_ortvalue(value) -> Storage:
    if not value.is_tensor():
        raise StorageError("an OrtValue bound as a cache must be a tensor")
    onnx_type = _ORT_TYPE_STRINGS.get(value.data_type(), -1)
    shape = tuple(value.shape())
    nbytes = int(np.prod(shape, dtype=np.int64)) * ELEM_SIZE.get(onnx_type, 0)
    device_type, device_id = ortvalue_device(value)
    ptr = value.data_ptr()
    why = _ortvalue_host_writable(value, ptr, nbytes) if device_type == "cpu" else ""
    return Storage(ptr=ptr, nbytes=nbytes, device_type=device_type, device_id=device_id, onnx_type=onnx_type,
                   shape=shape, writable=not why, contiguous=True, kind="ortvalue", ortvalue=value,
                   keepalive=(value,), not_writable_because=why)


def _host_mappings(maps_path: str = "/proc/self/maps") -> list[tuple[int, int, str, str]] | None:
    """(lo, hi, perms, path) of every mapping of this process; None where the maps file cannot be read."""
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def _mapping_path(addr: int, maps_path: str = "/proc/self/maps") -> str:
    """The file mapped at host address ``addr`` ('' if anonymous, unknown or unreadable)."""
    return next((path for lo, hi, _, path in _host_mappings(maps_path) or () if lo <= addr < hi), "")


def check_host_pages(ptr: int, nbytes: int, tolerate=None, maps_path: str = "/proc/self/maps") -> str:
    """'' when every byte of host memory [ptr, ptr + nbytes) lies in a writable mapping, else a
    description of the first byte range that does not (read-only, or not mapped at all). A range
    for which ``tolerate(lo, hi)`` is true is skipped (an arena's reserved, uncommitted granules).
    Linux only: where the maps file cannot be read, '' (the storage's own flag is all we know)."""
    if nbytes <= 0:
        return ""
    mappings = _host_mappings(maps_path)
    if mappings is None:
        return ""
    spans = [m for m in mappings if m[1] > ptr and m[0] < ptr + nbytes]
    cursor, end = ptr, ptr + nbytes
    ok = tolerate or (lambda lo, hi: False)
    for lo, hi, perms, path in sorted(spans):
        if lo > cursor and not ok(cursor, lo):
            return f"[0x{cursor:x}, 0x{lo:x}) is not mapped"
        if "w" not in perms and not ok(max(lo, ptr), min(hi, end)):
            return f"[0x{lo:x}, 0x{hi:x}) is mapped {perms} (not writable){' from ' + path if path else ''}"
        cursor = max(cursor, hi)
        if cursor >= end:
            return ""
    return "" if ok(cursor, end) else f"[0x{cursor:x}, 0x{end:x}) is not mapped"


# --- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html), read with ctypes -------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_READ_ONLY = 1
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _dl_device_type(dl_type: int) -> str | None:
    """'cpu' or 'cuda' for a DLPack device type a cache can live on (pinned host memory is host
    memory, managed memory is CUDA's), else None."""
    if dl_type in (_DL_CPU, _DL_CUDA_HOST):
        return "cpu"
    if dl_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        return "cuda"
    return None


_DL_TYPES = {(2, 32): 1, (2, 16): 10, (4, 16): 16, (0, 64): 7, (0, 32): 6, (0, 8): 3, (1, 8): 2, (2, 64): 11}

_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj) -> Storage:
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__()
    except BufferError as exc:  # e.g. numpy refuses to export a read-only array in legacy mode
        raise StorageError(f"the tensor refused to export itself through DLPack: {exc}") from exc
    read_only, why = False, ""
    if _capsule_valid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(_capsule_get(capsule, b"dltensor_versioned"))
        read_only = bool(managed.flags & _DLPACK_READ_ONLY)
    elif _capsule_valid(capsule, b"dltensor"):
        managed = _DLManagedTensor.from_address(_capsule_get(capsule, b"dltensor"))
        # Note [Writable OrtValue storage]: an unversioned capsule cannot say "read-only"; numpy
        # therefore refuses to export read-only memory through one, but OrtValue.__dlpack__ exports
        # whatever it wraps (a read-only array included). Its capsules are recognised by their
        # deleter, which lives in onnxruntime's extension module, and get the OrtValue rule: refused.
        if managed.deleter and "onnxruntime" in _mapping_path(managed.deleter):
            read_only = True
            why = ("a DLPack tensor exported by an onnxruntime OrtValue, whose capsule does not carry the "
                   "read-only flag, so its memory is not known writable. Bind the numpy array (or the OrtValue "
                   "made from a writable numpy array) itself")
    else:
        raise StorageError("__dlpack__ returned no DLPack capsule")
    t = managed.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    onnx_type = _DL_TYPES.get((t.dtype.code, t.dtype.bits), -1) if t.dtype.lanes == 1 else -1
    size = ELEM_SIZE.get(onnx_type, 0)
    contiguous = True
    if t.strides:
        expected = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expected:
                contiguous = False
            expected *= shape[i]
    dev = t.device.device_type
    device_type = _dl_device_type(dev)
    if device_type is None:
        raise StorageError(f"DLPack device type {dev} is not supported (cpu or cuda)")
    # The capsule keeps the producer's buffer alive until it is collected (its destructor calls the
    # deleter because we never rename it "used_dltensor").
    return Storage(ptr=(t.data or 0) + t.byte_offset, nbytes=int(np.prod(shape, dtype=np.int64)) * size,
                   device_type=device_type, device_id=t.device.device_id, onnx_type=onnx_type, shape=shape,
                   writable=not read_only, contiguous=contiguous, kind="dlpack", keepalive=(obj, capsule),
                   not_writable_because=why)


def as_storage(obj, declared_type: int | None = None) -> Storage:
    """Describe ``obj`` without copying it. Raises StorageError for unknown kinds."""
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, declared_type)
    to_storage = getattr(obj, "__ortkv_storage__", None)  # arena views (ortkv.vmm)
    if to_storage is not None:
        return to_storage()
    try:
        import onnxruntime as ort

        if isinstance(obj, ort.OrtValue):
            return _from_ortvalue(obj)
    except ImportError:  # pragma: no cover - onnxruntime is a dependency
        pass
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise StorageError(
        f"cannot bind a {type(obj).__name__} as a cache: pass a numpy array, an onnxruntime.OrtValue, "
        "a DLPack tensor (torch, cupy) or an ortkv arena view"
    )

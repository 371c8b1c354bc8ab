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


def numpy_onnx_type(dtype: np.dtype) -> int | None:
    dtype = np.dtype(dtype)
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
    lease: Any = None  # an ortkv.vmm.ArenaLease while bound, when the storage lies in an arena

    @property
    def device_key(self) -> tuple[str, int]:
        return (self.device_type, self.device_id)

    def describe(self) -> str:
        return (f"{self.kind} {ONNX_TYPE_NAMES.get(self.onnx_type, self.onnx_type)}{list(self.shape)} on "
                f"{self.device_type}:{self.device_id} at 0x{self.ptr:x} (+{self.nbytes} bytes)")


def _from_numpy(arr: np.ndarray, declared_type: int | None) -> Storage:
    onnx_type = numpy_onnx_type(arr.dtype)
    if declared_type == BFLOAT16 and arr.dtype == np.uint16:
        onnx_type = BFLOAT16  # bfloat16 bits held in a uint16 array
    return Storage(ptr=arr.ctypes.data, nbytes=arr.nbytes, device_type="cpu", device_id=0,
                   onnx_type=onnx_type if onnx_type is not None else -1, shape=tuple(arr.shape),
                   writable=bool(arr.flags.writeable), contiguous=bool(arr.flags.c_contiguous), kind="numpy",
                   keepalive=(arr,))


def _from_ortvalue(value) -> Storage:
    if not value.is_tensor():
        raise StorageError("an OrtValue bound as a cache must be a tensor")
    onnx_type = _ORT_TYPE_STRINGS.get(value.data_type(), -1)
    shape = tuple(value.shape())
    nbytes = int(np.prod(shape, dtype=np.int64)) * ELEM_SIZE.get(onnx_type, 0)
    device = value.device_name().lower()
    return Storage(ptr=value.data_ptr(), nbytes=nbytes, device_type="cuda" if "cuda" in device else "cpu",
                   device_id=0, onnx_type=onnx_type, shape=shape, writable=True, contiguous=True,
                   kind="ortvalue", ortvalue=value, keepalive=(value,))


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
    read_only = False
    if _capsule_valid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(_capsule_get(capsule, b"dltensor_versioned"))
        read_only = bool(managed.flags & _DLPACK_READ_ONLY)
    elif _capsule_valid(capsule, b"dltensor"):
        managed = _DLManagedTensor.from_address(_capsule_get(capsule, b"dltensor"))
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
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        device_type = "cpu"
    elif dev in (_DL_CUDA, _DL_CUDA_MANAGED):
        device_type = "cuda"
    else:
        raise StorageError(f"DLPack device type {dev} is not supported (cpu or cuda)")
    # The capsule keeps the producer's buffer alive until it is collected (its destructor calls the
    # deleter because we never rename it "used_dltensor").
    return Storage(ptr=(t.data or 0) + t.byte_offset, nbytes=int(np.prod(shape, dtype=np.int64)) * size,
                   device_type=device_type, device_id=t.device.device_id, onnx_type=onnx_type, shape=shape,
                   writable=not read_only, contiguous=contiguous, kind="dlpack", keepalive=(obj, capsule))


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

"""MutableCacheSession: runs a model whose caches are updated in place, and proves it.

    with ortkv.MutableCacheSession("decoder.onnx") as sess:
        sess.bind_cache("past_key", k_cache)          # numpy, OrtValue, DLPack tensor, arena view
        sess.bind_cache("past_value", v_cache)
        logits, = sess.run(["logits"], {"input_ids": ids, "position": pos})

Each cache is bound through ONE IOBinding as its input AND as its aliased output (the annotations
say which output aliases which input), so the op writes into the caller's storage; after every run
the data pointer of each aliased output is compared with the cache's and a difference raises
AliasError. Nothing here copies a cache.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from . import get_library_path
from ._storage import ONNX_TYPE_NAMES, Storage, as_storage
from .errors import (
    AliasError,
    BindingConflictError,
    ImmutableStorageError,
    OrtkvError,
    StorageError,
    from_native,
)
from .graph import Access, check_model, read_annotations


# --- process-wide registry of live writable bindings -------------------------------------------
@dataclass(frozen=True)
class _Live:
    device: tuple[str, int]
    start: int
    end: int
    session_id: int
    name: str


class _BindingRegistry:
    """Every writable cache binding of every MutableCacheSession in this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: dict[tuple[int, str], _Live] = {}

    def claim(self, session_id: int, name: str, st: Storage) -> None:
        entry = _Live(st.device_key, st.ptr, st.ptr + st.nbytes, session_id, name)
        with self._lock:
            for key, other in self._live.items():
                if key == (session_id, name) or other.device != entry.device or st.nbytes == 0:
                    continue
                if entry.start < other.end and other.start < entry.end:
                    where = "this session" if other.session_id == session_id else f"session #{other.session_id}"
                    raise BindingConflictError(
                        f"cache '{name}': storage [0x{entry.start:x}, 0x{entry.end:x}) on {entry.device[0]}:"
                        f"{entry.device[1]} overlaps cache '{other.name}' of {where} "
                        f"[0x{other.start:x}, 0x{other.end:x}); two writable caches must not share bytes. "
                        "Unbind or close the other one first, or give each cache its own buffer."
                    )
            self._live[(session_id, name)] = entry

    def release(self, session_id: int, name: str | None = None) -> None:
        with self._lock:
            for key in [k for k in self._live if k[0] == session_id and (name is None or k[1] == name)]:
                del self._live[key]

    def count(self) -> int:
        with self._lock:
            return len(self._live)


BINDINGS = _BindingRegistry()
_session_ids = iter(range(1, 1 << 62))


def translate_ort_error(exc: Exception) -> Exception:
    """Turn ORT's exception carrying an '[ortkv:E_*]' message into the typed ortkv error."""
    return from_native(exc)


def _load_model(model) -> tuple[onnx.ModelProto, object]:
    """(the proto to read annotations from, what InferenceSession should load). A path is loaded by
    ORT itself (external weights are not read twice); its proto is read without external data."""
    if isinstance(model, onnx.ModelProto):
        return model, model.SerializeToString()
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model)), bytes(model)
    path = Path(model)
    if not path.exists():
        raise OrtkvError(f"model file {path} does not exist")
    try:
        return onnx.load(str(path), load_external_data=False), str(path)
    except Exception as exc:  # protobuf DecodeError and friends
        raise OrtkvError(f"{path} is not an ONNX model ({type(exc).__name__}: {exc})") from None


class MutableCacheSession:
    """An onnxruntime.InferenceSession whose READ_WRITE inputs are caches updated in place.

    check: "annotations" (default) runs the alias annotation rules at load; "full" also runs the
    alias-aware shape inference (ortkv.graph.check: types, dims and capacities of every value, about
    0.75 s on SmolLM2-135M). Either raises GraphCheckError on an error; ``warnings`` keeps the rest."""

    def __init__(self, model, providers=None, sess_options=None, check: str = "annotations"):
        import onnxruntime as ort

        proto, source = _load_model(model)
        self.model = proto
        self.annotations = read_annotations(proto)
        if check == "full":
            from .graph.check import check as full_check

            self.warnings = full_check(proto, plan=False).raise_for_errors().findings
        elif check == "annotations":
            self.warnings = check_model(proto)  # raises GraphCheckError on any error
        else:
            raise ValueError(f"check must be 'annotations' or 'full', not {check!r}")
        graph = proto.graph
        self._inputs = {vi.name: vi for vi in graph.input}
        self._initializers = {t.name for t in graph.initializer}
        self._caches = [n for n in self.annotations.mutable_inputs() if n not in self._initializers]
        self._alias_outputs: dict[str, list[str]] = {c: [] for c in self._caches}
        for out, cache in self.annotations.aliased_outputs(graph).items():
            self._alias_outputs.setdefault(cache, []).append(out)
        so = sess_options if sess_options is not None else ort.SessionOptions()
        so.register_custom_ops_library(get_library_path())
        self._session = ort.InferenceSession(source, so, providers=providers)
        self._id = next(_session_ids)
        self._bindings: dict[str, Storage] = {}
        self._owners: dict[str, object] = {}
        self._lock = threading.Lock()  # held for a whole run, and while bindings change
        self._closed = False
        self._finalizer = weakref.finalize(self, BINDINGS.release, self._id)

    # -- properties ------------------------------------------------------------------------------
    @property
    def session(self):
        """The underlying onnxruntime.InferenceSession (for inspection; run through this object)."""
        return self._session

    @property
    def caches(self) -> list[str]:
        """Graph inputs marked READ_WRITE: the names bind_cache accepts."""
        return list(self._caches)

    def aliased_outputs(self, cache: str) -> list[str]:
        return list(self._alias_outputs.get(cache, []))

    # -- binding ---------------------------------------------------------------------------------
    def _acquire(self, what: str) -> None:
        if self._closed:
            raise OrtkvError(f"session #{self._id} is closed")
        if not self._lock.acquire(blocking=False):
            raise BindingConflictError(
                f"session #{self._id}: cannot {what}: a run is in progress on this session's caches "
                f"({', '.join(sorted(self._bindings)) or 'none bound'}); concurrent runs on one session are "
                "refused, never interleaved. Wait for it, or use another session with its own caches."
            )

    def bind_cache(self, name: str, storage) -> None:
        """Bind writable storage as cache ``name`` (and as every output aliasing it)."""
        self._acquire(f"bind cache '{name}'")
        try:
            self._bind(name, storage)
        finally:
            self._lock.release()

    def _bind(self, name: str, storage) -> None:
        if name in self._initializers:
            raise ImmutableStorageError(
                f"'{name}' is an initializer (model weights); an initializer is never bound as a writable cache")
        if name not in self._inputs:
            raise StorageError(f"'{name}' is not an input of this model; caches: {self._caches}")
        access = self.annotations.access.get(name)
        if access is not Access.READ_WRITE:
            raise ImmutableStorageError(
                f"input '{name}' is {access.value if access else 'not annotated'}, not READ_WRITE; only inputs "
                f"marked access=READ_WRITE are caches (ortkv.graph.mark_mutable). Caches: {self._caches}")
        tensor_type = self._inputs[name].type.tensor_type
        st = as_storage(storage, tensor_type.elem_type)
        if not st.writable:
            raise ImmutableStorageError(
                f"cache '{name}': the {st.kind} storage is read-only (writeable=False); ortkv writes caches in "
                "place and never copies them. Pass a writable array (e.g. np.array(x, copy=True)).")
        hit = self._read_only_range(st)
        if hit:
            raise ImmutableStorageError(
                f"cache '{name}': storage at 0x{st.ptr:x} overlaps the write-protected range 0x{hit[0]:x} "
                f"(+{hit[1]} bytes) '{hit[2]}' (a read-only mapping)")
        if not st.contiguous:
            raise StorageError(f"cache '{name}': storage is not C-contiguous; bind a contiguous buffer")
        if st.onnx_type != tensor_type.elem_type:
            raise StorageError(
                f"cache '{name}': storage is {ONNX_TYPE_NAMES.get(st.onnx_type, st.onnx_type)} but the model "
                f"declares {ONNX_TYPE_NAMES.get(tensor_type.elem_type, tensor_type.elem_type)}")
        dims = tensor_type.shape.dim
        if len(dims) != len(st.shape) or any(
                d.HasField("dim_value") and d.dim_value != s for d, s in zip(dims, st.shape)):
            declared = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
            raise StorageError(f"cache '{name}': storage shape {list(st.shape)} does not match the declared {declared}")
        if st.device_type == "cuda" and "CUDAExecutionProvider" not in self._session.get_providers():
            raise StorageError(f"cache '{name}': storage is on cuda:{st.device_id} but the session runs on "
                               f"{self._session.get_providers()}; create it with providers=['CUDAExecutionProvider']")
        from .vmm import lease_storage  # arena memory: its close()/release() refuse until unbind (Note [Arena exports])

        st.lease = lease_storage(st, f"cache '{name}' of session #{self._id}")
        try:
            BINDINGS.claim(self._id, name, st)
        except BaseException:
            if st.lease is not None:
                st.lease.release()
            raise
        old = self._bindings.get(name)
        if old is not None and old.lease is not None:
            old.lease.release()
        self._bindings[name] = st
        self._owners[name] = storage

    @staticmethod
    def _read_only_range(st: Storage):
        """A READONLY range (a shared prefix mapping) overlapping the storage, if any. Uncommitted
        arena granules are fine here: a cache grows by commit before the run that needs them."""
        from . import _ortkv

        device = _ortkv.DEVICE_CUDA if st.device_type == "cuda" else _ortkv.DEVICE_CPU
        mask = 1 << _ortkv.RANGE_READONLY
        return _ortkv.find_protected(device, st.device_id, st.ptr, st.nbytes, mask) if st.nbytes else None


    def unbind_cache(self, name: str) -> None:
        self._acquire(f"unbind cache '{name}'")
        try:
            st = self._bindings.pop(name, None)
            if st is not None and st.lease is not None:
                st.lease.release()
            self._owners.pop(name, None)
            BINDINGS.release(self._id, name)
        finally:
            self._lock.release()

    # -- running ---------------------------------------------------------------------------------
    def run(self, output_names=None, feeds=None, run_options=None) -> list:
        """Run once. Caches are bound in place; ``feeds`` hold every other input. Returns the
        requested outputs in order: numpy arrays, or for an aliased output the bound cache object."""
        self._acquire("run")
        try:
            return self._run(output_names, dict(feeds or {}), run_options)
        finally:
            self._lock.release()

    def _run(self, output_names, feeds, run_options) -> list:
        missing = [c for c in self._caches if c not in self._bindings]
        if missing:
            raise OrtkvError(f"cache(s) {missing} are not bound; call bind_cache(name, storage) for each "
                             "(a cache is never fed by value: that would copy it)")
        io = self._session.io_binding()
        alias_names: dict[str, str] = {}
        for name, st in self._bindings.items():
            outs = self._alias_outputs.get(name, [])
            if st.ortvalue is not None:
                io.bind_ortvalue_input(name, st.ortvalue)
                for out in outs:
                    io.bind_ortvalue_output(out, st.ortvalue)
            else:
                io.bind_input(name, st.device_type, st.device_id, st.onnx_type, list(st.shape), st.ptr)
                for out in outs:
                    io.bind_output(out, st.device_type, st.device_id, st.onnx_type, list(st.shape), st.ptr)
            alias_names.update({out: name for out in outs})
        keep = []
        for name, value in feeds.items():
            if name in self._bindings or name in self._caches:
                raise OrtkvError(f"'{name}' is a cache: bind it with bind_cache(), do not pass it in feeds")
            if hasattr(value, "data_ptr") and hasattr(value, "device_name"):  # OrtValue
                io.bind_ortvalue_input(name, value)
            else:
                arr = np.asarray(value, order="C")  # keeps 0-d scalars 0-d
                keep.append(arr)
                io.bind_cpu_input(name, arr)
        if output_names is None:
            output_names = [o.name for o in self._session.get_outputs()]
        bound_order = list(alias_names)
        for name in output_names:
            if name not in alias_names:
                io.bind_output(name, "cpu")
                bound_order.append(name)
        try:
            self._session.run_with_iobinding(io, run_options)
        except Exception as exc:  # ORT raises RuntimeError / its own exception types
            translated = translate_ort_error(exc)
            if translated is exc:
                raise
            raise translated from None
        values = dict(zip(bound_order, io.get_outputs()))
        for out, cache in alias_names.items():
            st = self._bindings[cache]
            got = values[out].data_ptr()
            if got != st.ptr:
                raise AliasError(
                    f"output '{out}' came back at 0x{got:x} but its cache '{cache}' is at 0x{st.ptr:x}: the update "
                    "did not happen in place (ORT gave the op a fresh buffer). The cache may be stale.")
        return [self._owners[alias_names[n]] if n in alias_names else values[n].numpy() for n in output_names]

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            BINDINGS.release(self._id)
            for st in self._bindings.values():
                if st.lease is not None:
                    st.lease.release()
            self._bindings.clear()
            self._owners.clear()
            self._closed = True
            self._session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"caches={self._caches}, bound={sorted(self._bindings)}"
        return f"<MutableCacheSession #{self._id} {state}>"

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

import bisect
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from . import get_library_path
from ._storage import (
    _ORT_TYPE_STRINGS,
    BFLOAT16,
    ELEM_SIZE,
    ONNX_TYPE_NAMES,
    Storage,
    as_storage,
    check_host_pages,
    numpy_onnx_type,
    ortvalue_device,
)
from .errors import (
    AliasError,
    BindingConflictError,
    CapacityError,
    ImmutableStorageError,
    InputTypeError,
    MissingInputError,
    OrtkvError,
    StorageError,
    from_native,
)
from .graph import Access, check_model, read_annotations
from .graph.checker import outer_reads
from .graph.op_contract import safe_node_aliases


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


# Note [Whole-tensor readers of a cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An arena view may be bound while only a prefix of it is committed (the cache grows by commit as
# tokens arrive); the tail is reserved address space with nothing behind it. ortkv's own ops touch
# only [0, position + n), but any other op that consumes the cache, or a value aliasing it (the
# output of CacheUpdate), reads the whole tensor (a ReduceSum, a Cast, a MatMul) and faults inside
# ORT. Only ortkv ops know the valid length, so at load the session lists, per cache, the first
# non-ortkv node that reads it or an alias of it (following CacheUpdate's output and every declared
# output_alias, and reads from If/Loop/Scan bodies), and before every run it asks the core registry
# whether such a cache still has an uncommitted range (one lookup per cache, only for the caches
# that have such a reader; committing may happen between bind and run, so bind cannot decide).
# A hit refuses the run before anything executes. Plain ORT sessions get no such guard.
def _whole_tensor_readers(graph: onnx.GraphProto, caches) -> dict[str, tuple[str, str]]:
    root = {c: c for c in caches}  # value -> the cache whose storage it is
    for node in graph.node:
        for e in safe_node_aliases(node)[0]:  # the op's contract (ortkv ops) and its output_alias annotation
            out_i, in_i = e.output_index, e.input_index
            if in_i < len(node.input) and out_i < len(node.output) and node.input[in_i] in root:
                root[node.output[out_i]] = root[node.input[in_i]]
    readers: dict[str, tuple[str, str]] = {}
    for node in graph.node:
        if node.domain == "ortkv":
            continue
        for name in [*node.input, *sorted(outer_reads(node))]:
            if name in root:
                readers.setdefault(root[name], (node.name or node.op_type, node.op_type))
    return readers


def _ortvalue_nbytes(value) -> int:
    size = getattr(value, "tensor_size_in_bytes", None)
    if size is not None:
        return int(size())
    return int(np.prod(value.shape(), dtype=np.int64)) * ELEM_SIZE.get(value.element_type(), 1)


def _find_protected(device_type: str, device_id: int, ptr: int, nbytes: int, kind: str):
    """(addr, nbytes, label, kind) of the first range of the core's registry of the given kind
    ("READONLY": a shared prefix, "UNCOMMITTED": reserved arena granules) overlapping the span, or None."""
    from . import _ortkv

    device = _ortkv.DEVICE_CUDA if device_type == "cuda" else _ortkv.DEVICE_CPU
    mask = 1 << getattr(_ortkv, f"RANGE_{kind}")
    return _ortkv.find_protected(device, device_id, ptr, nbytes, mask) if nbytes else None


def _registered_uncommitted(lo: int, hi: int) -> bool:
    """Whether host [lo, hi) is wholly covered by ranges the core knows as reserved, uncommitted."""
    while lo < hi:
        hit = _find_protected("cpu", 0, lo, hi - lo, "UNCOMMITTED")
        if not hit or hit[0] > lo:
            return False
        lo = hit[0] + hit[1]
    return True


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
        self._whole_readers = _whole_tensor_readers(graph, self._caches)
        self._feed_types = {i.name: _ORT_TYPE_STRINGS.get(i.type) for i in self._session.get_inputs()}
        # Note [Overridable initializers]
        # An input that is also an initializer (ir_version >= 4) is an overridable default: ORT lists it apart from
        # the inputs (get_overridable_initializers), never requires it (nor does the missing-feed check below), and
        # takes a feed of it. Its declared type checks such a feed as any input's. IOBinding's bind_cpu_input binds a
        # numpy array only to a required input ("Failed to find NodeArg ... in the def list", onnxruntime 1.32), so a
        # numpy feed of one is bound as an OrtValue over the array (no copy). E.g. the decoders' logits_start (Note
        # [Logits from logits_start] in generate/builder.py).
        self._default_types = {i.name: _ORT_TYPE_STRINGS.get(i.type)
                               for i in self._session.get_overridable_initializers()}
        self._onnx_types: dict = {}  # (numpy dtype, declared ONNX type) -> numpy_onnx_type's answer
        # only a session with the CUDA provider can leave a deferred CUDA kernel error (take_cuda_error)
        self._cuda = "CUDAExecutionProvider" in self._session.get_providers()
        self._id = next(_session_ids)
        self._bindings: dict[str, Storage] = {}
        self._io_cache = None  # _plan's tuple, (key, IOBinding, ...): Note [Reused IOBinding]
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
                f"cache '{name}': {st.not_writable_because}." if st.not_writable_because else
                f"cache '{name}': the {st.kind} storage is read-only (writeable=False); ortkv writes caches in "
                "place and never copies them. Pass a writable array (e.g. np.array(x, copy=True)).")
        hit = _find_protected(st.device_type, st.device_id, st.ptr, st.nbytes, "READONLY")
        if hit:  # a shared prefix mapping; uncommitted arena granules are fine here (commit precedes the run)
            raise ImmutableStorageError(
                f"cache '{name}': storage at 0x{st.ptr:x} overlaps the write-protected range 0x{hit[0]:x} "
                f"(+{hit[1]} bytes) '{hit[2]}' (a read-only mapping)")
        # Note [Writable OrtValue storage] (_storage.py). An arena's uncommitted granules are mapped
        # PROT_NONE on purpose: they are registered in the core, and the kernel / run() check them.
        if st.device_type == "cpu":
            bad = check_host_pages(st.ptr, st.nbytes, tolerate=_registered_uncommitted)
            if bad:
                raise ImmutableStorageError(
                    f"cache '{name}': the {st.kind} storage at 0x{st.ptr:x} (+{st.nbytes} bytes) is not writable "
                    f"memory: {bad}. ortkv writes caches in place; bind memory mapped read-write (e.g. a copy, "
                    "np.array(x, copy=True), or an np.memmap opened with mode='r+').")
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
        if 0 in st.shape:
            raise StorageError(
                f"cache '{name}': storage shape {list(st.shape)} has no elements; a cache holds at least one "
                "slot in every dim (a zero capacity cannot take a token). Allocate it with every dim >= 1.")
        if st.device_type == "cuda" and "CUDAExecutionProvider" not in self._session.get_providers():
            raise StorageError(f"cache '{name}': storage is on cuda:{st.device_id} but the session runs on "
                               f"{self._session.get_providers()}; create it with providers=['CUDAExecutionProvider']")
        from .vmm import lease_storage  # arena memory: its close()/release() refuse until unbind (Note [Arena exports])

        st.lease = lease_storage(st, f"cache '{name}' of session #{self._id}")
        try:
            BINDINGS.claim(self._id, name, st)
        except BaseException:
            st.release_lease()
            raise
        old = self._bindings.get(name)
        if old is not None:
            old.release_lease()
        self._bindings[name] = st
        self._io_cache = None  # Note [Reused IOBinding]
        self._owners[name] = storage

    def unbind_cache(self, name: str) -> None:
        self._acquire(f"unbind cache '{name}'")
        try:
            st = self._bindings.pop(name, None)
            self._io_cache = None
            if st is not None:
                st.release_lease()
            self._owners.pop(name, None)
            BINDINGS.release(self._id, name)
        finally:
            self._lock.release()

    # -- running ---------------------------------------------------------------------------------
    def run(self, output_names=None, feeds=None, run_options=None, bound_outputs=None) -> list:
        """Run once. Caches are bound in place; ``feeds`` hold every other input. Returns the
        requested outputs in order: numpy arrays, or for an aliased output the bound cache object.
        ``bound_outputs`` {name: OrtValue}: non-cache outputs written into those (device) OrtValues, which
        are returned as they are (fixed addresses, as a CUDA graph replay needs; no copy to the host)."""
        self._acquire("run")
        try:
            return self._run(output_names, dict(feeds or {}), run_options, dict(bound_outputs or {}))
        finally:
            self._lock.release()

    def _run(self, output_names, feeds, run_options, bound_outputs=None) -> list:
        if output_names is None:
            output_names = [o.name for o in self._session.get_outputs()]
        bound_outputs = bound_outputs or {}
        # Note [Reused IOBinding]: the caches' bindings (two per cache, 120 calls for a 30-layer model) are
        # made once and kept while the bindings, the feed names and the requested outputs stay the same;
        # feeds and non-cache outputs are bound again on every run (a stale feed or a reused output buffer
        # must never survive), and the pointer check below still runs after every run.
        key = (tuple(feeds), tuple(output_names), tuple(bound_outputs))
        plan = self._io_cache
        if plan is None or plan[0] != key:
            self._io_cache = None
            plan = self._plan(key, output_names, feeds, bound_outputs)
        _, io, alias_checks, host_outputs, overlap, positions, alias_names, _ = plan
        self._check_committed()
        keep = []
        same = plan[7]  # name -> the OrtValue fed under it in the plan's last run
        for name, value in feeds.items():
            if same.get(name) is value:
                # the very OrtValue this binding already holds, checked when it was bound: an OrtValue's type,
                # shape and memory cannot change, and the caches cannot change while the plan lives (a bind
                # or unbind drops it), so the type and overlap checks would find what they found then
                continue
            declared = self._feed_types.get(name)
            if declared is None:
                declared = self._default_types.get(name)
            if hasattr(value, "data_ptr") and hasattr(value, "device_name"):  # OrtValue
                self._check_feed_type(name, value.element_type() if value.is_tensor() else None, declared)
                if value.is_tensor():
                    try:
                        device = ortvalue_device(value)
                    except StorageError:  # a device no cache can live on: nothing to overlap
                        device = None
                    if device is not None:
                        self._check_feed_overlap(name, device, value.data_ptr(), _ortvalue_nbytes(value), overlap)
                io.bind_ortvalue_input(name, value)
                same[name] = value
            else:
                same.pop(name, None)
                arr = np.asarray(value, order="C")  # keeps 0-d scalars 0-d
                given = self._onnx_types.get((arr.dtype, declared))
                if given is None:
                    given = self._onnx_types[(arr.dtype, declared)] = numpy_onnx_type(arr.dtype, declared)
                self._check_feed_type(name, given, declared)
                self._check_feed_overlap(name, ("cpu", 0), arr.ctypes.data, arr.nbytes, overlap)
                keep.append(arr)
                if name in self._default_types:  # Note [Overridable initializers]: as an OrtValue over arr, no copy
                    import onnxruntime as ort

                    value = ort.OrtValue.ortvalue_from_numpy(arr)
                    keep.append(value)
                    io.bind_ortvalue_input(name, value)
                elif given == BFLOAT16:  # numpy has no bfloat16: ORT cannot map ml_dtypes' dtype itself
                    io.bind_input(name, "cpu", 0, BFLOAT16, list(arr.shape), arr.ctypes.data)
                else:
                    io.bind_cpu_input(name, arr)
        for name in host_outputs:
            if name in bound_outputs:
                io.bind_ortvalue_output(name, bound_outputs[name])
            else:
                io.bind_output(name, "cpu")
        try:
            self._session.run_with_iobinding(io, run_options)
        except Exception as exc:  # ORT raises RuntimeError / its own exception types
            self._io_cache = None
            report = _failed_run_report(io) if self._cuda else None
            if report is not None:
                raise report  # ORT's failure stays attached as its __context__
            translated = translate_ort_error(exc)
            if translated is exc:
                raise
            raise translated from None
        if self._cuda:
            take_cuda_error()
        values = io.get_outputs_as_ortvaluevector()
        self._check_aliases(values, alias_checks)
        self._io_cache = plan
        result = []
        for n, i in zip(output_names, positions):
            if i < 0:
                result.append(self._owners[alias_names[n]])
            elif n in bound_outputs:
                result.append(bound_outputs[n])
            else:
                result.append(values[i].numpy())
        return result

    # Note [Alias check without wrappers]
    # The post-run check reads every aliased output's data pointer, every run. io.get_outputs() wraps each output
    # in a Python OrtValue first (61 for SmolLM2: ~75 us warm, ~180 us right after a decode step, whose weights
    # have evicted the interpreter's data from the CPU caches); reading each pointer from ORT's own vector
    # (get_outputs_as_ortvaluevector, one call) still costs a pybind11 OrtValue per output (~40 / ~130 us). So
    # the vector hands each output to _ortkv.dlpack_data_ptr as a DLPack capsule, all in one call
    # (to_dlpacks; a capsule shares the tensor, nothing is copied; the callback must consume it, deleter and all,
    # or every output of every run stays allocated: Note [DLPack capsules are consumed]): ~15 us warm, ~115 us
    # right after a step. The comparison is the same: each aliased output's pointer against its cache's, every
    # run; where to_dlpacks is missing or refuses (an ORT build without DLPack, an output that is not a tensor)
    # the pointers are read one OrtValue at a time.
    def _check_aliases(self, values, alias_checks) -> None:
        try:
            from . import _ortkv

            ptrs = values.to_dlpacks(_ortkv.dlpack_data_ptr)  # each capsule read and consumed as it is handed over
            got = [ptrs[i] for i, _, _, _ in alias_checks]
        except Exception:  # no DLPack in this ORT build, or an output DLPack cannot carry: one value at a time
            got = [values[i].data_ptr() for i, _, _, _ in alias_checks]
        for g, (_, out, cache, ptr) in zip(got, alias_checks):
            if g != ptr:
                raise AliasError(
                    f"output '{out}' came back at 0x{g:x} but its cache '{cache}' is at 0x{ptr:x}: the update "
                    "did not happen in place (ORT gave the op a fresh buffer). The cache may be stale.")

    def _plan(self, key, output_names, feeds, bound_outputs) -> tuple:
        """What a run with these feed names and outputs needs beyond the feeds' values, checked and bound once
        (Note [Reused IOBinding]): (key, IOBinding with the caches bound, the alias checks (position in the
        outputs, output, cache, cache pointer), the non-cache outputs to bind on every run, the caches sorted
        by address for the feed overlap check, each requested output's position (-1: a cache), output ->
        cache, the OrtValue feeds bound as they are). Raises before anything is bound when the names are wrong."""
        missing = [c for c in self._caches if c not in self._bindings]
        if missing:
            raise OrtkvError(f"cache(s) {missing} are not bound; call bind_cache(name, storage) for each "
                             "(a cache is never fed by value: that would copy it)")
        alias_names: dict[str, str] = {}
        for name in self._bindings:
            alias_names.update({out: name for out in self._alias_outputs.get(name, [])})
        unfed = [n for n in self._feed_types if n not in feeds and n not in self._bindings and n not in self._caches]
        if unfed:
            raise MissingInputError(f"input(s) {unfed} not fed: every non-cache input of the model needs a value in "
                                    "feeds on every run (nothing is kept from an earlier run). Nothing was run.",
                                    inputs=unfed)
        for name in feeds:
            if name in self._bindings or name in self._caches:
                raise OrtkvError(f"'{name}' is a cache: bind it with bind_cache(), do not pass it in feeds")
        for name in bound_outputs:
            if name in alias_names or name not in output_names:
                raise OrtkvError(f"bound_outputs: '{name}' is {'a cache output' if name in alias_names else 'not requested'}"
                                 f"; bind only requested non-cache outputs ({[n for n in output_names if n not in alias_names]})")
        io = self._session.io_binding()
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
        # ORT lists the outputs in the order they were first bound: the caches' aliases, then the rest in
        # output_names' order (binding a name again keeps its place)
        order = list(alias_names)
        host_outputs = [n for n in output_names if n not in alias_names]
        order += host_outputs
        where = {n: i for i, n in enumerate(order)}
        alias_checks = [(where[out], out, cache, self._bindings[cache].ptr) for out, cache in alias_names.items()]
        overlap: dict[tuple[str, int], tuple[list, list]] = {}
        for cache, st in sorted(self._bindings.items(), key=lambda kv: kv[1].ptr):
            if st.nbytes:
                starts, spans = overlap.setdefault(st.device_key, ([], []))
                starts.append(st.ptr)
                spans.append((st.ptr + st.nbytes, cache))
        positions = [-1 if n in alias_names else where[n] for n in output_names]
        return key, io, alias_checks, host_outputs, overlap, positions, alias_names, {}

    def _check_committed(self) -> None:
        """Note [Whole-tensor readers of a cache]: refuse the run while such a cache has a hole."""
        if not self._whole_readers:
            return
        for cache, (node, op_type) in self._whole_readers.items():
            st = self._bindings[cache]
            hit = _find_protected(st.device_type, st.device_id, st.ptr, st.nbytes, "UNCOMMITTED")
            if hit:
                end = st.ptr + st.nbytes
                lo, hi = max(hit[0], st.ptr), min(hit[0] + hit[1], end)
                committed = lo - st.ptr
                raise CapacityError(
                    f"cache '{cache}' ({st.nbytes} bytes at 0x{st.ptr:x}) is read whole by node '{node}' ({op_type}, "
                    f"not an ortkv op, so it does not know how many tokens are valid), but [0x{lo:x}, 0x{hi:x}) of it "
                    f"({hi - lo} bytes, '{hit[2]}') is not committed: reading it would fault. Nothing was run. "
                    f"Remedy: commit the arena over the whole cache (Arena.commit of its {st.nbytes} bytes at the "
                    "cache's offset) before the run, or read the cache only through ortkv ops.",
                    requested=st.nbytes, capacity=committed)

    def _check_feed_type(self, name: str, given: int | None, declared: int | None) -> None:
        """ORT's own refusal is an untyped RuntimeError without the input's name; this one is typed."""
        if declared is None or given == declared:
            return
        exp = ONNX_TYPE_NAMES.get(declared, str(declared))
        got = ONNX_TYPE_NAMES.get(given, "an unsupported type") if given is not None else "not a tensor"
        np_name = "ml_dtypes.bfloat16" if declared == BFLOAT16 else "np.bool_" if exp == "bool" else f"np.{exp}"
        raise InputTypeError(
            f"input '{name}' is {got} but the model declares {exp}; onnxruntime does not convert feeds. "
            f"Pass {exp} data, e.g. np.asarray(x, dtype={np_name})", input=name, expected=exp, given=got)

    def _check_feed_overlap(self, name: str, device: tuple[str, int], ptr: int, nbytes: int, overlap=None) -> None:
        """A feed sharing bytes with a cache this run writes in place reads torn data (and CacheUpdate's
        values would overlap their destination): refused before the run. ``overlap``: the plan's caches by
        address per device (bound caches never overlap each other, _BindingRegistry.claim), so the only cache
        that can overlap [ptr, ptr + nbytes) is the last one starting below its end: one bisect per feed."""
        if nbytes <= 0:
            return
        if overlap is not None:
            starts, spans = overlap.get(device, ((), ()))
            k = bisect.bisect_left(starts, ptr + nbytes) - 1
            if k < 0 or spans[k][0] <= ptr:
                return
        for cache, st in self._bindings.items():
            if st.device_key == device and st.nbytes and ptr < st.ptr + st.nbytes and st.ptr < ptr + nbytes:
                raise BindingConflictError(
                    f"feed '{name}' [0x{ptr:x}, 0x{ptr + nbytes:x}) on {device[0]}:{device[1]} overlaps cache "
                    f"'{cache}' [0x{st.ptr:x}, 0x{st.ptr + st.nbytes:x}), which this run writes in place; a feed must "
                    "not share memory with a bound cache. Nothing was run. Remedy: pass a copy "
                    "(e.g. np.array(x, copy=True)).")

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            BINDINGS.release(self._id)
            for st in self._bindings.values():
                st.release_lease()
            self._bindings.clear()
            self._io_cache = None
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


# Note [A failed run's device report]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A run that fails on the host (a later node's shape error, an ortkv node's input check) returns while
# the kernels it launched before the failure may still be queued on the device, and ORT does not
# synchronize a failed run. A report such a kernel writes (Note [CUDA deferred errors]) used to land
# after the run had raised and was then raised by the NEXT run, against inputs it was not about. So a
# failed run of a CUDA session first synchronizes its outputs' devices (IOBinding's SynchronizeOutputs:
# the CUDA provider's Sync), then takes the report: when there is one it is raised (it comes from a
# node that ran before the failure, so it is the first thing that went wrong), with ORT's error as its
# __context__; otherwise ORT's error is raised as before. A synchronization that fails (a sticky CUDA
# error) is ignored: ORT's own error says more. SynchronizeOutputs syncs the providers of the nodes that
# produce the graph's outputs (the CUDA provider's Sync is cudaDeviceSynchronize on the session's device);
# a model whose every output comes from a CPU node gets no sync, and a report landing later is then taken
# whole by the next run (Note [Reports taken by their codes]), as before this Note.
def _failed_run_report(io) -> Exception | None:
    try:
        io.synchronize_outputs()
    except Exception:  # see the Note
        pass
    return _take_report()


def _take_report() -> Exception | None:
    """The CUDA kernels' pending report as the typed error (cleared), or None."""
    from . import _ortkv

    msg = _ortkv.cuda_take_error()
    if msg is None:
        return None
    exc = translate_ort_error(RuntimeError(msg))
    return exc if isinstance(exc, OrtkvError) else RuntimeError(msg)


def take_cuda_error() -> None:
    """Raise the error an ortkv CUDA kernel found on the device during the last run (a bad position or
    start, a write into a protected range; Note [CUDA deferred errors] in custom_ops/include/ortkv/core.h),
    as the same typed error the CPU kernels raise, and clear it; ``ortkv.take_cuda_error()`` for an
    application that runs a bare InferenceSession (MutableCacheSession calls it after every run). ORT
    synchronizes the stream at the end of a successful run, so the report is final there. After a run
    that failed, kernels of that run may still be queued: call ``io.synchronize_outputs()`` first, as
    MutableCacheSession does (Note [A failed run's device report]); a report that lands after a take is
    taken whole by the next call or the next Compute of an ortkv CUDA node (Note [Reports taken by their
    codes]). No-op when there is none or the build has no CUDA kernels."""
    exc = _take_report()
    if exc is not None:
        raise exc

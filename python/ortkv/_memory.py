"""Resident-memory readings for the benchmarks and the demo (Linux /proc)."""

from __future__ import annotations

import os


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def rss_bytes() -> int:
    """Current resident set size."""
    return _status_kib("VmRSS") * 1024


_statm = (-1, -1)  # (pid, fd of /proc/<pid>/statm): reopened after a fork, whose child has its own


def rss_bytes_fast() -> int:
    """rss_bytes() (the same figure: /proc/self/statm's resident pages are what VmRSS counts) in ~1 us instead
    of ~20 us: one pread on a descriptor kept open, for the generation loop's reading after every decode step."""
    global _statm
    pid, fd = _statm
    if pid != os.getpid():
        fd = os.open("/proc/self/statm", os.O_RDONLY)  # names this process: a fork's child opens its own
        _statm = (os.getpid(), fd)
    return int(os.pread(fd, 128, 0).split()[1]) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or since reset_peak()."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False if refused."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


# Note [Weights resident at load]
# ONNX Runtime maps a model's external-data file (the weights) into memory and leaves its pages to fault in when a
# node first reads them. The decoders whose projections are ortkv ops (Linear, MatMulQ4) read the weights in place,
# so nothing touched them at load, and the first generation faulted ~520 MB in: `ortkv generate --compare` reported
# that as the float32 ortkv / copy decoders' "peak RSS above load" (522 MiB against GenAI share-buffer's 94, whose
# MatMul weights ORT copies at load), and the prompt's prefill paid the page faults. So the runners fault the
# mapped weights in when the session is made (madvise MADV_POPULATE_READ, Linux >= 5.14; else one read per page),
# as llama.cpp maps its GGUF with MAP_POPULATE: "load" then holds the model, and "above load" the cache and work.
def populate_file_mappings(directory: str) -> int:
    """Fault in every page this process maps from files under `directory`; returns the bytes of those mappings
    (0 where /proc/self/maps is unreadable or nothing is mapped from there)."""
    import ctypes

    root = os.path.realpath(directory).rstrip("/") + "/"
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) == 6 and parts[5].startswith(root) and "r" in parts[1]:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        return 0
    if not ranges:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    madv_populate_read = 22
    for lo, hi in ranges:
        if libc.madvise(lo, hi - lo, madv_populate_read) != 0:  # an older kernel: read one byte per page
            view = (ctypes.c_ubyte * (hi - lo)).from_address(lo)
            for off in range(0, hi - lo, _PAGE):
                view[off]
    return sum(hi - lo for lo, hi in ranges)


# Note [Weights on huge pages]
# A float32 decode step streams its 538 MB of weights once (Note [Linear CPU GEMV]); ONNX Runtime maps them from the
# model's external-data file, so they sit in the page cache in 4 KiB pages: ~131,000 translations a token, and
# every 4 KiB page boundary stops the hardware prefetchers. The bandwidth the goal measures (numpy, which advises huge
# pages for its large arrays) is read through 2 MiB pages. So on the CPU the runners read the initializers that
# ortkv's own ops (and Gather) consume in place into ONE anonymous mapping advised MADV_HUGEPAGE (transparent huge
# pages: "madvise" or "always" in /sys/kernel/mm/transparent_hugepage/enabled) and hand them to the session through
# SessionOptions.add_initializer: ORT then reads that memory in place instead of mapping the file (ORT 1.32:
# add_external_initializers copied them into memory of its own, another 530 MB of 4 KiB pages). Initializers of
# ORT's own MatMul / MatMulNBits stay with ORT (it prepacks them into buffers of its own). The same weights, the same
# bytes resident (anonymous instead of file pages); ORTKV_WEIGHTS_HUGE_PAGES=0 keeps ORT's mapping (A/B runs).
# Measured on the 2-core AMD EPYC VM (numpy max over the float32 decoder's 528 MiB of weights): one thread 27.0 GB/s
# from the file mapping, 31.3 from huge pages; two threads 32.4 vs 33.7.
_INPLACE_CONSUMERS = {("ai.onnx", "Gather"), ("", "Gather")}


def huge_page_weights_enabled() -> bool:
    """ORTKV_WEIGHTS_HUGE_PAGES: unset / "1" = on (Note [Weights on huge pages]), "0" = off; anything else refused."""
    from .errors import OrtkvError

    v = os.environ.get("ORTKV_WEIGHTS_HUGE_PAGES", "")
    if v in ("", "1"):
        return True
    if v == "0":
        return False
    raise OrtkvError(f"environment variable ORTKV_WEIGHTS_HUGE_PAGES={v!r} is not 0 or 1; unset it for the default "
                     "(weights on huge pages on the CPU)")


def anonymous_huge_mapping(nbytes: int):
    """(an anonymous private mapping of at least nbytes, rounded up to 2 MiB; whether madvise(MADV_HUGEPAGE) was
    accepted): Note [Weights on huge pages]."""
    import mmap

    m = mmap.mmap(-1, max(1, -(-nbytes // (2 << 20))) * (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            return m, True
        except OSError:
            pass
    return m, False


def _packed_offsets(sizes) -> tuple[list, int]:
    """(offset of each of `sizes` bytes laid end to end at 64-byte alignment, total bytes)."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // 64) * 64
    return offsets, pos


def add_initializers(so, names: list, arrays: list) -> list:
    """Give `arrays` to SessionOptions `so` as pre-allocated initializers `names` (add_initializer: ORT reads them in
    place; add_external_initializers copied them, +530 MB for the float32 decoder); returns the OrtValues, which must
    stay alive, with the arrays, as long as the session."""
    import onnxruntime as ort

    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
    for name, value in zip(names, values):
        so.add_initializer(name, value)
    return values


def huge_page_copies(arrays: list):
    """(mapping, copies): each array copied into one anonymous_huge_mapping, 64-byte aligned, same dtype and shape;
    keep the mapping alive as long as the copies are used."""
    import numpy as np

    offsets, pos = _packed_offsets(a.nbytes for a in arrays)
    m, _ = anonymous_huge_mapping(pos)
    copies = []
    for a, at in zip(arrays, offsets):
        c = np.frombuffer(m, dtype=a.dtype, count=a.size, offset=at).reshape(a.shape)
        c[...] = a
        copies.append(c)
    return m, copies


class HugePageWeights:
    """The initializers of one model read into one anonymous mapping advised MADV_HUGEPAGE (Note [Weights on huge
    pages]); keep the object alive as long as the session that was given them (`attach`)."""

    def __init__(self, model_path: str):
        import numpy as np
        import onnx
        from onnx import helper

        model = onnx.load(str(model_path), load_external_data=False)
        consumers: dict[str, set] = {}
        for node in model.graph.node:
            for name in node.input:
                consumers.setdefault(name, set()).add((node.domain, node.op_type))
        base = os.path.dirname(os.path.abspath(str(model_path)))
        entries = []
        for init in model.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            users = consumers.get(init.name, set())
            if not users or not all(d == "ortkv" or (d, t) in _INPLACE_CONSUMERS for d, t in users):
                continue
            try:
                dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
            except (KeyError, TypeError, ValueError):
                continue
            info = {e.key: e.value for e in init.external_data}
            entries.append((init.name, dtype, tuple(init.dims), os.path.join(base, info["location"]),
                            int(info.get("offset", 0)), int(info["length"])))
        self.names: list[str] = []
        self.arrays: list = []
        self.values: list = []
        self.nbytes = 0
        self.huge = False
        if not entries:
            self.mapping = None
            return
        offsets, pos = _packed_offsets(e[5] for e in entries)
        self.mapping, self.huge = anonymous_huge_mapping(pos)
        view = memoryview(self.mapping)
        files: dict[str, object] = {}
        try:
            for (name, dtype, dims, path, off, length), at in zip(entries, offsets):
                f = files.get(path)
                if f is None:
                    f = files[path] = open(path, "rb")
                f.seek(off)
                if f.readinto(view[at:at + length]) != length:
                    raise OSError(f"{path}: initializer {name} wants {length} bytes at offset {off}; the file is short")
                count = length // dtype.itemsize
                self.arrays.append(np.frombuffer(self.mapping, dtype=dtype, count=count, offset=at).reshape(dims))
                self.names.append(name)
                self.nbytes += length
        finally:
            for f in files.values():
                f.close()
            view.release()

    def attach(self, so) -> None:
        """Give the arrays to SessionOptions `so` as pre-allocated initializers (add_initializers)."""
        self.values = add_initializers(so, self.names, self.arrays)

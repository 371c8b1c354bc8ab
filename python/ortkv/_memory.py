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

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

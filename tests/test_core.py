"""The op library's packaging contract and the process-global state it shares with Python."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

import ortkv
from conftest import cached_session, digest, run_bound
from ortkv import _ortkv


def test_library_exports_only_register_custom_ops():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", ortkv.get_library_path()], capture_output=True, text=True,
                         check=True).stdout
    symbols = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert symbols == ["RegisterCustomOps"]


def test_op_library_and_extension_share_one_registry(rng):
    """A range protected through the Python extension is refused by the kernel that ORT loaded:
    both reach the same libortkv_core.so."""
    cache = rng.standard_normal((1, 2, 8, 4)).astype(np.float32)
    sess = cached_session(1, 4, -2, False)
    before = digest(cache)
    # head 1, token 2 (16 bytes) is read-only
    rid = _ortkv.protect_range(_ortkv.DEVICE_CPU, 0, cache.ctypes.data + (8 + 2) * 4 * 4, 16, "shared prefix")
    try:
        with pytest.raises(RuntimeError, match=r"\[ortkv:E_READONLY\].*write-protected range .*'shared prefix'"):
            run_bound(sess, cache, np.ones((1, 2, 1, 4), np.float32), 2, 1)
        assert digest(cache) == before
        run_bound(sess, cache, np.full((1, 2, 1, 4), 5, np.float32), 3, 1)  # token 3 is not protected
        assert cache[0, 1, 3, 0] == 5.0
        s = ortkv.MutableCacheSession(ortkv_model())
        with pytest.raises(ortkv.ImmutableStorageError, match=r"write-protected range"):
            s.bind_cache("cache", cache)
    finally:
        assert _ortkv.unprotect_range(rid)
    run_bound(sess, cache, np.ones((1, 2, 1, 4), np.float32), 0, 1)
    assert cache[0, 0, 0, 0] == 1.0


def ortkv_model():
    from conftest import cache_update_model

    return cache_update_model()


def test_core_is_loaded_once():
    code = ("import ortkv, ortkv._ortkv as c, onnxruntime as ort; so = ort.SessionOptions(); "
            "so.register_custom_ops_library(ortkv.get_library_path()); "
            "maps = [l.split()[-1] for l in open('/proc/self/maps') if 'libortkv_core' in l]; "
            "print(len(set(maps)), c.core_instance() != 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "True"]


def test_cuda_build_flag_matches_the_op_library():
    """CUDA_BUILD (the extension's compile flag) must agree with the op library ORT loads: a library
    built without CUDA kernels carries the refusal text of its CPU-only CacheUpdate, a CUDA build does not."""
    with open(ortkv.get_library_path(), "rb") as f:
        cpu_only = b"this build of ortkv has no CUDA kernels" in f.read()
    assert cpu_only is (not _ortkv.CUDA_BUILD)

"""The host side of Note [CUDA deferred errors] without a GPU: a pair of error words in plain host memory,
registered with the core as the op library registers its pinned pages, written as a kernel writes them (numbers,
then the code), taken through ortkv.take_cuda_error(). Each case runs in a child process: the word registry is
process-global and a CUDA test in this process may have registered real words."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent(
    """
    import ctypes, os
    import ortkv
    from ortkv import _ortkv

    class Word(ctypes.Structure):  # ortkv_device_error (ortkv/core.h)
        _fields_ = [("claim", ctypes.c_int32), ("code", ctypes.c_int32), ("label", ctypes.c_int32),
                    ("row", ctypes.c_int32), ("position", ctypes.c_int64), ("n", ctypes.c_int64),
                    ("capacity", ctypes.c_int64), ("hit_addr", ctypes.c_uint64), ("first", ctypes.c_uint64),
                    ("last", ctypes.c_uint64)]

    assert ctypes.sizeof(Word) == 64
    core = ctypes.CDLL(os.path.join(os.path.dirname(ortkv.__file__), "libortkv_core.so"))
    core.ortkv_core_register_label.restype = ctypes.c_int32
    core.ortkv_core_register_label.argtypes = [ctypes.c_char_p] * 3
    words = (Word * 2)()  # [0] CacheUpdate, [1] CacheAttention
    core.ortkv_core_add_device_error(ctypes.byref(words))
    NEGATIVE, CAPACITY = 1, 2

    def numbers(w, label, row, position, n, capacity):  # what a kernel writes before its code
        w.label, w.row, w.position, w.n, w.capacity = label, row, position, n, capacity

    def report(w, code, *fields):  # a whole report: the numbers, then the code
        numbers(w, *fields)
        w.code = code
    """
)


def run_child(body: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_take_cuda_error_raises_the_typed_error_once():
    out = run_child(
        """
        lab = core.ortkv_core_register_label(b"CacheUpdate", b"update_k", b"key_cache")
        ortkv.take_cuda_error()  # nothing reported: does not raise
        report(words[0], CAPACITY, lab, 1, 6, 3, 8)
        try:
            ortkv.take_cuda_error()
        except ortkv.CapacityError as e:
            print("RAISED", e)
        else:
            raise SystemExit("no error raised")
        assert words[0].code == 0 and words[1].code == 0
        assert _ortkv.cuda_take_error() is None  # taken once
        """
    )
    assert "RAISED" in out
    assert "CacheUpdate node 'update_k'" in out
    assert "row 1: position 6 + n 3 = 9 exceeds capacity 8 of 'key_cache'" in out
    assert "Remedy" in out


def test_a_report_whose_code_lands_after_a_take_keeps_its_numbers():
    # Note [Reports taken by their codes]: kernel A reports; kernel B (the value cache's update of the same
    # step, still running after a failed run) writes its numbers; the application takes (A's code); B's code
    # lands after the take. The next take must give B's report, not a code over zeroed numbers.
    out = run_child(
        """
        k = core.ortkv_core_register_label(b"CacheUpdate", b"update_k", b"key_cache")
        v = core.ortkv_core_register_label(b"CacheUpdate", b"update_v", b"value_cache")
        report(words[0], NEGATIVE, k, 2, -4, 1, 64)
        numbers(words[0], v, 5, -9, 1, 64)  # B's numbers, before the take
        first = _ortkv.cuda_take_error()
        words[0].code = NEGATIVE  # B's code, after the take
        second = _ortkv.cuda_take_error()
        print("FIRST", first)
        print("SECOND", second)
        assert _ortkv.cuda_take_error() is None
        """
    )
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("FIRST", "SECOND")))
    assert "is negative" in lines["FIRST"]
    assert lines["SECOND"].startswith("[ortkv:E_"), lines["SECOND"]
    assert "CacheUpdate node 'update_v'" in lines["SECOND"], lines["SECOND"]
    assert "position -9 for row 5 of 'value_cache' is negative" in lines["SECOND"], lines["SECOND"]


def test_a_take_clears_both_words_codes_and_takes_the_update_word_first():
    out = run_child(
        """
        u = core.ortkv_core_register_label(b"CacheUpdate", b"upd", b"cache")
        a = core.ortkv_core_register_label(b"CacheAttention", b"attn", b"cache")
        report(words[1], NEGATIVE, a, 0, -1, 1, 16)
        report(words[0], NEGATIVE, u, 0, -1, 1, 16)
        print("TAKEN", _ortkv.cuda_take_error(), "CODES", words[0].code, words[1].code)
        print("AFTER", _ortkv.cuda_take_error())
        """
    )
    assert "TAKEN [ortkv:E_" in out and "CacheUpdate node 'upd': position -1 for row 0" in out
    assert "CODES 0 0" in out
    assert "AFTER None" in out


def test_a_paged_report_is_taken_with_its_own_message():
    out = run_child(
        """
        p = core.ortkv_core_register_label(b"PagedCacheUpdate", b"pu", b"pool\\ndirectory\\npage_table")
        report(words[0], NEGATIVE, p, 1, -3, 2, 64)
        print("TAKEN", _ortkv.cuda_take_error(), "CODES", words[0].code, words[1].code)
        """
    )
    assert "TAKEN [ortkv:E_" in out
    assert "PagedCacheUpdate node 'pu': position -3 for row 1 is negative; positions start at 0. Nothing was written." in out
    assert "(found on the device by the CUDA kernel and reported after the run" in out
    assert "CODES 0 0" in out


def test_a_failed_run_raises_its_device_report_not_the_next_run():
    # Note [A failed run's device report]: a run fails on the host (a Reshape after the cache update) while a
    # kernel of that run has reported. MutableCacheSession raises that report for THIS run, with ORT's error as
    # its context, and the next run is clean. (The session runs on the CPU here; _cuda marks it as a CUDA session
    # so the failed-run path takes the registered host words, as it takes the pinned pages of the CUDA kernels.)
    out = run_child(
        """
        import numpy as np
        from onnx import TensorProto as TP, helper
        from ortkv.graph import make_cache_update, mark_mutable, set_alias_of

        dims = ["b", "h", "c", "d"]
        g = helper.make_graph(
            [make_cache_update("cache", "values", "position", "updated_cache", name="cu", seq_axis=-2),
             helper.make_node("Reshape", ["updated_cache", "shape"], ["flat"], name="flatten")], "g",
            [helper.make_tensor_value_info("cache", TP.FLOAT, dims),
             helper.make_tensor_value_info("values", TP.FLOAT, ["b", "h", "n", "d"]),
             helper.make_tensor_value_info("position", TP.INT64, ["b"]),
             helper.make_tensor_value_info("shape", TP.INT64, [2])],
            [helper.make_tensor_value_info("updated_cache", TP.FLOAT, dims),
             helper.make_tensor_value_info("flat", TP.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
        mark_mutable(m, "cache")
        set_alias_of(m, "updated_cache", "cache")
        s = ortkv.MutableCacheSession(m)
        s._cuda = True
        s.bind_cache("cache", np.zeros((1, 2, 8, 4), np.float32))
        lab = core.ortkv_core_register_label(b"CacheUpdate", b"cu", b"cache")
        feed = lambda shape: {"values": np.ones((1, 2, 1, 4), np.float32), "position": np.array([3]),
                              "shape": np.array(shape)}
        report(words[0], NEGATIVE, lab, 0, -2, 1, 8)  # the run's kernel reported; the run then fails on the host
        try:
            s.run(["flat"], feed([3, 5]))
        except ortkv.CacheInputError as e:
            print("RAISED", e)
            print("CONTEXT", type(e.__context__).__name__, str(e.__context__).replace("\\n", " ")[:400])
        else:
            raise SystemExit("the failed run did not raise its report")
        print("CODES", words[0].code, words[1].code)
        print("NEXT", s.run(["flat"], feed([8, 8]))[0].shape)  # clean: the report was this run's
        try:
            s.run(["flat"], feed([3, 5]))  # a failed run without a report raises ORT's error
        except ortkv.OrtkvError as e:
            raise SystemExit(f"an ortkv error without a report: {e}")
        except Exception as e:
            print("PLAIN", type(e).__name__, "cannot be reshaped" in str(e))
        """
    )
    assert "RAISED CacheUpdate node 'cu': position -2 for row 0 of 'cache' is negative" in out, out
    assert "CONTEXT" in out and "cannot be reshaped" in out.split("CONTEXT", 1)[1].splitlines()[0], out
    assert "CODES 0 0" in out, out
    assert "NEXT (8, 8)" in out, out
    assert "PLAIN" in out and "True" in out.split("PLAIN", 1)[1].splitlines()[0], out

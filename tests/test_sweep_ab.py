"""benchmarks/cuda/sweep_ab.py: parsing the CUDA sweeps' rows, alternating builds round after round, medians and
ratios (fake sweep binaries; no GPU needed)."""

import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "cuda"))
import sweep_ab  # noqa: E402

PAGED = """pages of 16 tokens
     L   B   R | kernel                        us     GB/s
  8192   1 256 | F16 v3us                     6.91      730   (v3 vs v2 max |diff| 0.00098)
  8192   1 256 | F16 v3us in order            6.80      742   (v3 vs v2 max |diff| 0.00098)
  8192   1 256 | INT8 v3us                    7.12      370   (v3 vs v2 max |diff| 0.31250)
 32768   8  16 | INT8 v3                     45.37     1493   (v3 vs v2 max |diff| 0.87500)
"""
ATTN = """copy: 300.0 us per GiB, 3500 GB/s read+write, SMs 132
heads              L   B      MiB | kernel                             us      GB/s   /copy
 9/3/64         8192   8     24.0 | v3 cl S=4 fits 1                  12.50    2013     57%
   v3 vs v2 max |diff| 0.00049 (|out| ~0.123)
"""


def test_parse_reads_both_sweeps_rows():
    rows = sweep_ab.parse(PAGED)
    assert rows == {("8192 1 256", "F16 v3us"): 6.91, ("8192 1 256", "F16 v3us in order"): 6.80,
                    ("8192 1 256", "INT8 v3us"): 7.12, ("32768 8 16", "INT8 v3"): 45.37}
    assert sweep_ab.parse(ATTN) == {("9/3/64 8192 8 24.0", "v3 cl S=4 fits 1"): 12.50}


def test_parse_diffs_reads_the_checks_on_the_row_or_the_line_after():
    assert sweep_ab.parse_diffs(PAGED) == {("8192 1 256", "F16 v3us"): 0.00098, ("8192 1 256", "F16 v3us in order"):
                                           0.00098, ("8192 1 256", "INT8 v3us"): 0.3125, ("32768 8 16", "INT8 v3"):
                                           0.875}
    assert sweep_ab.parse_diffs(ATTN) == {("9/3/64 8192 8 24.0", "v3 cl S=4 fits 1"): 0.00049}
    assert sweep_ab.parse_diffs("max |diff| 9.0\n") == {}  # before any row: nobody's


def test_rounds_alternate_and_rotate_and_medians_give_ratios():
    calls = []
    us = {"a": [10.0, 11.0, 30.0], "b": [5.0, 6.0, 5.5]}  # per build, per round: a's third round an outlier

    def runner(path, args):
        calls.append((path, tuple(args)))
        t = us[path].pop(0)
        d = {10.0: 1.0, 11.0: 3.0, 30.0: 2.0}.get(t, 0.25)
        return f"  8192   1 256 | INT8 v3us {t:12.2f}      370  max |diff| {d}\n" + ("" if path == "b" else
                                                                     f"  8192   1 256 | F16 v3us {1.0:12.2f}  1\n")

    times, order, diffs = sweep_ab.run_rounds([("main", "a"), ("new", "b")], ["20", "0"], 3, runner,
                                       log=lambda *x, **k: None)
    assert [c[0] for c in calls] == ["a", "b", "b", "a", "a", "b"]  # the first build does not always go first
    assert all(c[1] == ("20", "0") for c in calls)
    assert order == [("8192 1 256", "INT8 v3us"), ("8192 1 256", "F16 v3us")]
    assert diffs == {("8192 1 256", "INT8 v3us"): {"main": 3.0, "new": 0.25}}  # the largest of the rounds
    text = sweep_ab.table(["main", "new"], times, order)
    assert "| 8192 1 256 | INT8 v3us | 11.00 (10.00-30.00) | 5.50 (5.00-6.00) | 0.500 |" in text, text
    assert "| 8192 1 256 | F16 v3us | 1.00 (1.00-1.00) | - | - |" in text, text  # a row one build lacks
    only = sweep_ab.table(["main", "new"], times, order, match="INT8")
    assert "INT8 v3us" in only and "F16 v3us" not in only
    checked = sweep_ab.table(["main", "new"], times, order, diffs=diffs)
    assert "| 8192 1 256 | INT8 v3us | 11.00 (10.00-30.00) | 5.50 (5.00-6.00) | 0.500 | 3.00000 / 0.25000 |" in checked
    assert "| 8192 1 256 | F16 v3us | 1.00 (1.00-1.00) | - | - | - / - |" in checked, checked


def _fake(tmp_path, name, us):
    p = tmp_path / name
    p.write_text(f"#!{sys.executable}\nimport sys\nprint('args', sys.argv[1:])\n"
                 f"print('  8192   1 256 | INT8 v3us {us:10.2f}      370   (v3 vs v2 max |diff| 0.1)')\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_main_runs_the_builds_with_the_sweep_arguments(tmp_path, capsys):
    a, b = _fake(tmp_path, "a", 8.0), _fake(tmp_path, "b", 6.0)
    out = tmp_path / "ab.md"
    assert sweep_ab.main(["--rounds", "2", "--out", str(out), f"main={a}", f"u8={b}", "--", "20", "0", "8"]) == 0
    text = out.read_text()
    assert "| 8192 1 256 | INT8 v3us | 8.00 (8.00-8.00) | 6.00 (6.00-6.00) | 0.750 | 0.10000 / 0.10000 |" in text, text
    assert "-- 20 0 8" in text and text in capsys.readouterr().out


@pytest.mark.parametrize("builds,why", [(["main"], "is not NAME=PATH"), (["a=/x", "a=/y"], "share a name")])
def test_bad_builds_are_refused(builds, why, capsys):
    with pytest.raises(SystemExit):
        sweep_ab.main(builds)
    assert why in capsys.readouterr().err


def test_a_failing_build_stops_the_run_and_says_which(tmp_path, capsys):
    good = _fake(tmp_path, "good", 8.0)
    bad = tmp_path / "bad"
    bad.write_text("#!/bin/sh\necho 'CUDA error: no kernel image' >&2\nexit 3\n")
    bad.chmod(0o755)
    assert sweep_ab.main(["--rounds", "1", f"main={good}", f"new={bad}", "--", "20"]) == 1
    err = capsys.readouterr().err
    assert f"{bad} 20 exited with 3" in err and "no kernel image" in err, err

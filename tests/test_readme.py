"""The README's Python examples run as written (so the README cannot rot), each followed by a check
of what it claims; the examples' model comes from examples/make_cache_update_model.py."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _block(marker: str) -> str:
    hits = [b for b in BLOCKS if marker in b]
    assert len(hits) == 1, f"expected one README python block containing {marker!r}, found {len(hits)}"
    return hits[0]


@pytest.fixture
def in_example_dir(tmp_path, monkeypatch):
    runpy.run_path(str(ROOT / "examples" / "make_cache_update_model.py"), run_name="not_main")["main"](
        ["x", str(tmp_path)])
    assert (tmp_path / "model_with_cacheupdate.onnx").stat().st_size > 0
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_has_exactly_two_setup_commands():
    section = README.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert [c.strip() for c in commands] == [
        'pip install . && ortkv generate --prompt "The capital of France is" --compare',
        'pip install ".[test]" && python -m pytest tests',
    ]


def test_example_script_runs_as_a_command(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "make_cache_update_model.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import onnx

    model = onnx.load(str(tmp_path / "model_with_cacheupdate.onnx"))
    assert 10 <= model.ir_version <= 13
    assert [n.op_type for n in model.graph.node] == ["CacheUpdate"]


def test_plain_onnxruntime_example(in_example_dir):
    ns: dict = {}
    exec(compile(_block("register_custom_ops_library"), "README:plain-ort", "exec"), ns)
    cache = ns["cache"]
    assert np.all(cache[:, :, 0] == 1.0)            # the new token landed in the caller's array ...
    assert np.all(cache[:, :, 1:] == 0.0)           # ... and nothing else was written
    # and the README's claim about a plain run: refused, naming the alias contract
    sess = ns["sess"]
    with pytest.raises(Exception, match=r"ortkv:E_ALIAS"):
        sess.run(None, {"cache": np.zeros((1, 8, 16, 64), np.float32), "values": np.ones((1, 8, 1, 64), np.float32),
                        "position": np.array(0, np.int64)})


def test_mutable_cache_session_example(in_example_dir):
    ns: dict = {}
    exec(compile(_block("MutableCacheSession(\"model_with_cacheupdate.onnx\")"), "README:session", "exec"), ns)
    cache = ns["cache"]
    assert np.all(cache[:, :, :16] == 1.0) and np.all(cache[:, :, 16:] == 0.0)
    assert ns["sess"]._closed


def test_arena_example():
    ns: dict = {}
    exec(compile(_block("from ortkv.vmm import Arena"), "README:arena", "exec"), ns)
    arena, prefix, gov = ns["arena"], ns["prefix"], ns["gov"]
    assert arena.read_only is False and prefix.read_only is True
    assert prefix.committed_bytes >= 1000 * 4 * 64 * 4
    assert gov.in_use <= gov.budget


def test_repository_points_only_at_its_own_files():
    """Docs, code and test skip reasons name files users have: nothing outside the repository."""
    outside = ["../" + "shared", "shared/" + "device", "shared/" + "facts", "shared/" + "design", "shared/" + "data"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout (installed copy): nothing to scan")
    offenders = []
    for rel in tracked.stdout.split():
        path = ROOT / rel
        if path.suffix not in {".py", ".md", ".txt", ".cc", ".h", ".cu", ".cmake", ".toml", ".json"} and rel != "CMakeLists.txt":
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{rel}: {o}" for o in outside if o in text]
    assert not offenders, offenders

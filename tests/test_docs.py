"""The documentation site builds without a warning and documents every public name."""

import os
import pathlib
import re
import subprocess
import sys

import fp8jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_api_reference_lists_every_public_name():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: fp8jax\.(\w+)$", pages, re.MULTILINE))
    assert documented == set(fp8jax.__all__), (
        f"missing: {sorted(set(fp8jax.__all__) - documented)}, "
        f"unknown: {sorted(documented - set(fp8jax.__all__))}"
    )


def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "training" / "index.html").exists()

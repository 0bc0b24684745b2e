"""`import fp8jax` is quiet and starts no JAX backend (issue 37).

With the `h100` extra on a machine without CUDA, `import jax` itself logs "Could not find cuda
drivers" (the CUDA plugin's libraries, loaded by jax's own import: see docs/faq.md), so the
quiet check compares with a bare `import jax` in the same environment: whatever fp8jax adds is
a failure, and where jax prints nothing, so must fp8jax."""

import os
import re
import subprocess
import sys

#: The prefix of an absl log line (`I0000 00:00:1795811963.013332    3335 `): its time and
#: thread differ between two processes, the rest of the line does not.
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ")


def _python(code: str) -> subprocess.CompletedProcess:
    """`python -c code` in a new process with this test's environment."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


def _lines(stderr: str) -> list[str]:
    """`stderr`'s lines without the absl prefixes, comparable across processes."""
    return [ABSL_PREFIX.sub("", line) for line in stderr.splitlines()]


def test_import_prints_nothing_of_its_own():
    """`import fp8jax` writes nothing to stdout, and nothing to stderr beyond what `import
    jax` alone writes: no print, warning or traceback of fp8jax's at import."""
    jax_only, ours = _python("import jax"), _python("import fp8jax")
    assert jax_only.returncode == 0, jax_only.stderr
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == ""
    assert _lines(ours.stderr) == _lines(jax_only.stderr)


def test_import_starts_no_backend():
    """Importing fp8jax and its examples starts no JAX backend (no array is made at import),
    so JAX can still be configured after it: `jax_num_cpu_devices`, which the MoE example's
    `--devices` sets, raises once a backend has started."""
    modules = "fp8jax, fp8jax.examples.moe, fp8jax.examples.deepseek, fp8jax.examples.train_mlp"
    code = f"import {modules}, jax; jax.config.update('jax_num_cpu_devices', 2)"
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""

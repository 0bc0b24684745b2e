"""How the GPU check compiles and times a function: one method for every measurement.

`compile_and_time(fn, args, options, runs)`: `jax.jit` of `fn` over the array leaves of `args`
(modules and other static parts closed over), lowered and compiled once with
`compiler_options=options` (the compile time reported apart), two warm-up calls (one when
`runs` is 1), then `runs` timed runs of `calls` back-to-back calls each, the last one
synchronized with `jax.block_until_ready`; the result is the median run's time divided by
`calls`. Several calls per run let the GPU queue them while Python dispatches the next, so
that a GEMM of a fraction of a millisecond is not timed with its dispatch (tens of
microseconds); train steps take one call per run.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from fp8jax._src.kernels import dispatch

METHOD = (
    "jit, compiled once (compile time apart), 2 warm-up calls, then the median of N runs of "
    "K back-to-back calls, each run ended by block_until_ready, divided by K (GEMMs: K=5; "
    "train steps and the dry run: K=1)"
)


def kernels(dry: bool) -> contextlib.AbstractContextManager:
    """Where native kernels run: Mosaic GPU's interpreter in a dry run, the GPU otherwise.
    Functions must be traced inside."""
    return dispatch.interpreted() if dry else contextlib.nullcontext()


class Compiled:
    """`fn(*args)` compiled for the arrays of `args`: `.run()` calls it, `.hlo` is the
    optimized HLO text, `.compile_s` the seconds lowering and compiling took."""

    def __init__(self, fn: Callable, args: tuple, options: dict[str, Any] | None, dry: bool):
        dynamic, static = eqx.partition(args, eqx.is_array)

        def call(dynamic):
            return eqx.filter(fn(*eqx.combine(dynamic, static)), eqx.is_array)

        began = time.perf_counter()
        with kernels(dry):
            lowered = jax.jit(call).lower(dynamic)
        self.executable = lowered.compile(compiler_options=dict(options or {}))
        self.compile_s = time.perf_counter() - began
        self.dynamic = dynamic

    @property
    def hlo(self) -> str:
        return self.executable.as_text()

    def run(self, calls: int = 1) -> Any:
        """`calls` calls back to back, the last one waited for."""
        out = None
        for _ in range(calls):
            out = self.executable(self.dynamic)
        return jax.block_until_ready(out)


def compile_and_time(
    fn: Callable,
    args: tuple,
    options: dict[str, Any] | None,
    runs: int,
    dry: bool,
    calls: int = 1,
) -> tuple[Compiled, dict[str, float]]:
    """(the compiled call, its timing fields: `compile_s`, `ms` per call (median run),
    `ms_min`, `runs`, `calls_per_run`)."""
    compiled = Compiled(fn, args, options, dry)
    for _ in range(1 if runs <= 1 else 2):
        compiled.run()
    fields = {"compile_s": round(compiled.compile_s, 2), **time_calls(compiled, runs, calls)}
    return compiled, fields


def time_calls(compiled: Compiled, runs: int, calls: int) -> dict[str, float]:
    """`runs` timed runs of `calls` back-to-back calls of a warm `compiled`: `ms` per call
    (median run), `ms_min`, `runs`, `calls_per_run`."""
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        compiled.run(calls)
        times.append((time.perf_counter() - began) / calls)
    return {
        "ms": statistics.median(times) * 1e3,
        "ms_min": min(times) * 1e3,
        "runs": runs,
        "calls_per_run": calls,
    }


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12

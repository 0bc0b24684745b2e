"""Section 2e (issue 38): per-tensor scaling's cast with its transposed copy and amax, the
pass each FP8 operand of a delayed- or current-scaling step takes, three ways side by side.

- `xla`: what the recipes compile to without a kernel: XLA's transposing fusion writing both
  FP8 copies, and its reductions for the amax (in GPU run 6's Llama profile XLA's
  transposing FP8 fusions moved 1.3-2.5 TB/s, an H200's HBM 4.8).
- `triton`: `kernels.cast_transpose` (Pallas Triton, one program a 128 x 128 tile), in its
  default tuning and transposed before the cast (Triton's `ldmatrix` transpose of the BF16
  tile, where the default gathers FP8 bytes one at a time through shared memory).
- `tensor cores`: `kernels.tensor_core_transpose` (Mosaic GPU, session 51): each program
  streams its tiles by TMA, casts one in registers, stores it by TMA, and transposes it with
  one `wgmma` (`I . q^T`), in the configurations of `CONFIGS` (the default first).

At Llama-3-8B's shapes (8,192 tokens): an activation and an output gradient (BF16) and a
weight (its float32 master). Numerics first: each kernel's two copies against a NumPy cast
(the operands are finite: every element must agree) and its amax against NumPy's. Then ms and
GB/s of the bytes the pass must move (read `x`, write two FP8 copies), beside a reference:
`x + 1` in x's dtype, the rate a plain XLA elementwise kernel reaches there. Decision lines:
per shape, the fastest way (the reference's time beside it) and each kernel's ratio to XLA;
the per-tensor recipes take a kernel (`per_tensor_pass.cast_transpose_kernel`) by default
only once it is faster in a step (`llama` section: `delayed-steady-kernel`,
`delayed-steady-tc`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import block_quantize
from fp8jax._src.kernels.tensor_core_transpose import (
    TransposeConfig,
    tensor_core_cast_transpose,
)

from . import timing
from .quantize import E4M3, PER_TENSOR_SCALE, heavy_tailed, per_tensor_kernel, per_tensor_xla
from .record import Recorder
from .timing import compile_and_time

SECTION = "2e per-tensor cast and transpose"
#: label -> (rows, cols, dtype): Llama-3-8B at 8,192 tokens.
SHAPES = {
    "activation 8192x4096 bf16": (8192, 4096, jnp.bfloat16),
    "gradient 8192x14336 bf16": (8192, 14336, jnp.bfloat16),
    "weight 14336x4096 f32": (14336, 4096, jnp.float32),
}
DRY_SHAPES = {"dry 256x384 bf16": (256, 384, jnp.bfloat16)}
#: The tensor-core kernel's configurations the section times, the default first: stages in
#: flight, and programs (one wave at 132; two; short programs of a few tiles).
CONFIGS = {
    "default": TransposeConfig(),
    "2 stages": TransposeConfig(max_concurrent_steps=2),
    "4 stages": TransposeConfig(max_concurrent_steps=4),
    "264 programs": TransposeConfig(max_programs=264),
    "1056 programs": TransposeConfig(max_programs=1056),
}
TRITON = {
    "default": block_quantize.DEFAULT_TUNING,
    "transposed before the cast": block_quantize.ColumnTuning(num_warps=4, transpose_first=True),
}


def _tensor_cores(x: jax.Array, config: TransposeConfig) -> tuple:
    """`quantize.per_tensor_kernel` on the tensor-core kernel in `config`."""
    data, data_t, amax = tensor_core_cast_transpose(
        x, jnp.float32(PER_TENSOR_SCALE), E4M3, config=config
    )
    return data, data_t, jnp.max(amax)


#: A reference beside the ways: `x + 1` in x's dtype, one read and one write, the rate a plain
#: elementwise XLA kernel reaches on this GPU (not a way to quantize).
COPY = "reference: x + 1"


def _copy(x: jax.Array) -> jax.Array:
    return x + jnp.ones((), x.dtype)


def ways(dry: bool) -> dict[str, Any]:
    """`name -> function of x` for every way the section times (`dry`: each kernel's
    default only; traced inside `timing.kernels(dry)`, interpreted in a dry run)."""
    out: dict[str, Any] = {"xla": per_tensor_xla}
    for name, tuning in list(TRITON.items())[: 1 if dry else None]:
        out[f"triton, {name}"] = functools.partial(per_tensor_kernel, tuning=tuning)
    for name, config in list(CONFIGS.items())[: 1 if dry else None]:
        out[f"tensor cores, {name}"] = functools.partial(_tensor_cores, config=config)
    return out


#: Why a dry run on JAX 0.10 skips the tensor-core kernel (its interpreter cannot run it).
REFUSED = "interpreter cannot run wgmma on a transposed view"


def refused(name: str, dry: bool) -> str | None:
    """The reason a dry run skips way `name`, if it does."""
    if dry and name.startswith("tensor cores") and not mosaic_private.interpreter_runs_gpu_path():
        return f"jax {jax.__version__}'s {REFUSED}"
    return None


def numerics(x: jax.Array, fns: dict[str, Any], dry: bool) -> dict:
    """Elements of each kernel's two copies differing from a NumPy cast, and whether its amax
    is NumPy's."""
    host = np.asarray(x, np.float32)
    limit = np.float32(ml_dtypes.finfo(E4M3).max)
    want = np.clip(host * np.float32(PER_TENSOR_SCALE), -limit, limit).astype(E4M3)
    want = want.astype(np.float32)
    differ, amax_ok = {}, {}
    for name, fn in fns.items():
        if name == "xla" or not name.endswith(", default") or refused(name, dry):
            continue
        with timing.kernels(dry):
            data, data_t, amax = jax.jit(fn)(x)
        differ[name] = int(np.sum(np.asarray(data, np.float32) != want)) + int(
            np.sum(np.asarray(data_t, np.float32) != want.T)
        )
        amax_ok[name] = float(amax) == float(np.max(np.abs(host)))
    passed = not any(differ.values()) and all(amax_ok.values())
    return {"elements_differing": differ, "amax_exact": amax_ok, "passed": passed}


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, float]]:
    """Numerics, then the timings; returns `{shape: {way: ms}}`."""
    dry = mode == "dry"
    times: dict[str, dict[str, float]] = {}
    shapes = DRY_SHAPES if dry else SHAPES
    for label, (rows, cols, dtype) in list(shapes.items())[: 1 if mode == "quick" else None]:
        x = heavy_tailed(jax.random.PRNGKey(0), (rows, cols)).astype(dtype)
        fns = ways(dry)
        result = rec.measure(SECTION, f"numerics {label}", functools.partial(numerics, x, fns, dry))
        cell = rec.not_run() if result is None else _numerics_cell(result)
        rec.cell(SECTION, label, "numerics (elements != NumPy; amax)", cell)
        for name, fn in {**fns, COPY: _copy}.items():
            # The pass reads x and writes two FP8 copies; the copy reads and writes x.
            moved = x.size * (2 * x.dtype.itemsize if name == COPY else x.dtype.itemsize + 2)
            measure = functools.partial(_time, fn, x, moved, runs, dry)
            if refused(name, dry):
                measure = functools.partial(dict, skipped=refused(name, dry))
            result = rec.measure(SECTION, f"{label} | {name}", measure)
            if result is not None and "ms" in result:
                times.setdefault(label, {})[name] = result["ms"]
            if result is None:
                text = rec.not_run()
            elif "ms" not in result:
                text = "skipped"
            else:
                text = f"{result['ms']:.3f} ({result['gb_per_s']:.0f} GB/s)"
            rec.cell(SECTION, label, name, text)
    return times


def _time(fn: Any, x: jax.Array, moved: int, runs: int, dry: bool) -> dict:
    _, fields = compile_and_time(fn, (x,), fp8jax.gpu_compiler_options(), runs, dry, calls=5)
    fields["gb_per_s"] = moved / (fields["ms"] * 1e-3) / 1e9
    return fields


def _numerics_cell(result: dict) -> str:
    differ = sum(result["elements_differing"].values())
    exact = "exact" if all(result["amax_exact"].values()) else "differs"
    return f"{differ}; amax {exact}"


def decide(rec: Recorder, times: dict[str, dict[str, float]]) -> None:
    """Per shape: the fastest way, and each kernel's fastest configuration against XLA."""
    for label, t in times.items():
        reference = t.pop(COPY, None)
        if "xla" not in t or len(t) < 2:
            continue
        best = min(t, key=t.get)
        kinds = []
        for kind in ("triton", "tensor cores"):
            mine = {k: v for k, v in t.items() if k.startswith(kind)}
            if mine:
                fastest = min(mine, key=mine.get)
                kinds.append(f"{fastest} {t['xla'] / mine[fastest]:.2f}x")
        copy = f"; {COPY}: {reference:.3f} ms" if reference else ""
        rec.decision(
            f"per-tensor cast+transpose, {label}: fastest {best} ({t[best]:.3f} ms{copy}); "
            f"XLA time / kernel time: " + ", ".join(kinds)
        )

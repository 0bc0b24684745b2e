"""Per-tensor FP8 quantization in one pass (Pallas Triton): the cast, its transposed copy
and the tensor's amax from one read of the operand.

`cast_transpose(x, scale, fmt)` returns what delayed scaling computes of an operand whose
scale is known before the step (its state's): `quantize`'s saturating cast of `x * scale`,
the same FP8 values transposed (the K-major copy cuBLASLt's FP8 GEMM takes for the dgrad or
the wgrad) and each program's `max |x|` (NaN where its tile has a NaN), whose maximum is the
amax the state records. XLA writes the two copies in one fusion but reduces the amax in
kernels of their own, reading the operand again (it fuses no reduction into a transposing
kernel), and on an H200 its transposing FP8 fusions moved 1.3-2.5 TB/s in a Llama step (GPU
run 6's profile), about half of HBM's rate. This kernel is timed against XLA's passes by
the GPU check (`quantize` section) before any recipe calls it.

Each program casts one `block x block` tile (`block_quantize`'s tile, cast and transpose);
shapes must be whole tiles (`block_quantize.fits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ..core.jax_private import shape_like
from . import CAST_TRANSPOSE_NAME
from .block_quantize import (
    DEFAULT_TUNING,
    ColumnTuning,
    bits_max,
    check_format,
    check_tiles,
    check_tuning,
    nan_max,
    over_slabs,
    saturating_cast,
    slab_height,
    transpose,
    triton_call,
)
from .dispatch import interpreting


def _kernel(x_ref, s_ref, q_ref, qt_ref, amax_ref, *, tuning: ColumnTuning):
    block = x_ref.shape[0]
    h = slab_height(tuning, block)
    if h < block:  # one pass, a slab at a time
        scale = s_ref[...]

        def cast(sl, amax):
            x = x_ref[sl, :].astype(jnp.float32)
            q_ref[sl, :] = q = saturating_cast(x, scale, q_ref.dtype)
            first = tuning.transpose_first
            qt_ref[:, sl] = (
                saturating_cast(x.T, scale, q_ref.dtype) if first else transpose(q, tuning)
            )
            return bits_max(amax, nan_max(nan_max(jnp.abs(x), axis=1), axis=0))

        amax = over_slabs(block, h, cast, jnp.float32(0))
        amax_ref[...] = jnp.broadcast_to(amax, (1, 1))
        return
    x = x_ref[...].astype(jnp.float32)
    scale = s_ref[...]  # (1, 1)
    q_ref[...] = q = saturating_cast(x, scale, q_ref.dtype)
    first = tuning.transpose_first
    qt_ref[...] = saturating_cast(x.T, scale, q_ref.dtype) if first else transpose(q, tuning)
    amax_ref[...] = jnp.broadcast_to(nan_max(nan_max(jnp.abs(x), axis=1), axis=0), (1, 1))


@functools.partial(jax.jit, static_argnames=("fmt", "block", "interpret", "tuning"))
def _cast_transpose(x, scale, *, fmt, block, interpret, tuning):
    m, k = x.shape
    tile = (block, block)
    shapes = [
        shape_like((m, k), fmt, x),
        shape_like((k, m), fmt, x),
        shape_like((m // block, k // block), jnp.float32, x),
    ]
    specs = [
        pl.BlockSpec(tile, lambda i, j: (i, j)),
        pl.BlockSpec(tile, lambda i, j: (j, i)),
        pl.BlockSpec((1, 1), lambda i, j: (i, j)),
    ]
    in_specs = [pl.BlockSpec(tile, lambda i, j: (i, j)), pl.BlockSpec((1, 1), lambda i, j: (0, 0))]
    kernel = functools.partial(_kernel, tuning=tuning)
    grid = (m // block, k // block)
    call = triton_call(
        kernel, shapes, specs, in_specs, grid, interpret, CAST_TRANSPOSE_NAME, tuning.num_warps
    )
    return tuple(call(x, jnp.reshape(scale, (1, 1)).astype(jnp.float32)))


def cast_transpose(
    x: Float[Array, "M K"],
    scale: Float[Array, ""],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    interpret: bool | None = None,
    tuning: ColumnTuning = DEFAULT_TUNING,
) -> tuple[Array, Array, Float[Array, "M/block K/block"]]:
    """`x` cast to FP8 `fmt` at the per-tensor `scale` (saturating, as `fp8jax.quantize`:
    inf and NaN become NaN): `data (M, K)`, the same values transposed `data_t (K, M)`, and
    each `block x block` tile's `max |x|` (NaN where it has a NaN), from one read of `x`.
    `interpret`: run in Pallas' interpreter (`None`: as traced); `tuning`: a
    `block_quantize.ColumnTuning`."""
    check_tiles(x, block, CAST_TRANSPOSE_NAME)
    if jnp.size(scale) != 1:
        raise ValueError(
            f"{CAST_TRANSPOSE_NAME}: scale has shape {jnp.shape(scale)}; one per-tensor scale "
            "(a scalar) is expected."
        )
    tuning = check_tuning(tuning, CAST_TRANSPOSE_NAME, block)
    return _cast_transpose(
        x,
        jnp.asarray(scale),
        fmt=check_format(fmt, CAST_TRANSPOSE_NAME),
        block=block,
        interpret=interpreting() if interpret is None else interpret,
        tuning=tuning,
    )

"""Per-tensor FP8 quantization in one pass on Hopper's TMA and tensor cores (Pallas Mosaic
GPU): the cast, its transposed copy and the tensor's amax from one read, as
`cast_transpose` computes them.

`tensor_core_cast_transpose(x, scale, fmt)` returns what `cast_transpose.cast_transpose`
returns (the saturating cast of `x * scale`, the same FP8 values transposed, and partial
amaxes whose maximum is `max |x|`), by another route (`tensor_core_tiles`): each program
streams `x`'s tiles by TMA, casts a tile in registers, stores it by TMA, and transposes it
with one `wgmma`, `I . q^T` (the FP8 tile), cast back to the same FP8 values.

Differences from the other routes, none for finite operands but signed zeros: a -0 in the
transposed copy may come out +0. Where `x` has a NaN or an infinity (its cast is NaN), the
whole row of the transposed tile that holds it is NaN, not one element; the amax is NaN
either way, a step whose gradients the train step's finite check rejects.

The recipes call it inside `per_tensor_pass.cast_transpose_kernel(on_tensor_cores=True)`
only, until a GPU run has timed it (issue 38).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..core.jax_private import shape_like
from . import TENSOR_CORE_TRANSPOSE_NAME
from .quantize_tiles import nan_max, saturating_cast
from .tensor_core_tiles import (  # noqa: F401 - re-exported beside the kernel that takes them
    BLOCK,
    Tile,
    TransposeConfig,
    checked,
    fp8_buffers,
    stages,
    store,
    stream_tiles,
    tile_at,
    tiles_per_program,
    transposed,
)


def _kernel_call(x, scale, *, fmt, batch, config, interpret):
    rows, k = x.shape

    def tile_step(ins, outs, scratch, eye_smem):
        (s_gmem,), (q_gmem, qt_gmem), (q_smem, qt_smem) = ins, outs, scratch
        s = s_gmem[0]

        def step(tile: Tile, x_smem, xv):
            store(saturating_cast(xv, s, fmt), q_smem, tile, tile_at(q_gmem, tile.i, tile.col))
            qt = transposed(eye_smem, q_smem.at[tile.slot])
            store(qt.astype(fmt), qt_smem, tile, tile_at(qt_gmem, tile.transposed(), tile.local))
            return nan_max(jnp.abs(xv), axis=1)  # per row, NaN above inf

        return step, 2

    out_type = (shape_like((rows, k), fmt, x), shape_like((batch * k, rows // batch), fmt, x))
    eye = jnp.asarray(np.eye(BLOCK, dtype=fmt))
    inputs = (jnp.reshape(scale, (1,)).astype(jnp.float32),)
    return stream_tiles(
        x,
        eye,
        inputs,
        name=TENSOR_CORE_TRANSPOSE_NAME,
        out_type=out_type,
        scratch_types=fp8_buffers(fmt),
        tile_step=tile_step,
        batch=batch,
        config=config,
        interpret=interpret,
    )


_jitted = jax.jit(_kernel_call, static_argnames=("fmt", "batch", "config", "interpret"))


def tensor_core_cast_transpose(
    x: Float[Array, "*B M K"],
    scale: Float[Array, ""],
    fmt: jnp.dtype,
    *,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "programs 128"]]:
    """`x` (at most one batch axis; `M`, `K` multiples of 128; a 16- or 32-bit float) cast
    to FP8 `fmt` at the per-tensor `scale` (saturating, as `fp8jax.quantize`): `data` as
    `x`, `data_t` with the last two axes swapped, and partial amaxes (NaN where `x` has a
    NaN) whose maximum is `max |x|`, from one read of `x`. `config`: a `TransposeConfig`;
    `interpret`: run in Mosaic GPU's interpreter (`None`: as traced)."""
    dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
    config, interpret = checked(TENSOR_CORE_TRANSPOSE_NAME, x, fmt, config, dtypes, interpret)
    if jnp.size(scale) != 1:
        raise ValueError(
            f"{TENSOR_CORE_TRANSPOSE_NAME}: scale has shape {jnp.shape(scale)}; expected a scalar."
        )
    batch, (m, k) = (x.shape[0] if x.ndim == 3 else 1), x.shape[-2:]
    flat = jnp.reshape(x, (batch * m, k))
    fields = dict(fmt=jnp.dtype(fmt), batch=batch, config=config, interpret=interpret)
    data, data_t, amaxes = _jitted(flat, jnp.asarray(scale), **fields)
    if x.ndim == 3:
        data, data_t = data.reshape(x.shape), data_t.reshape(batch, k, m)
    return data, data_t, amaxes

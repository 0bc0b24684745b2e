"""DeepSeek-V3's blockwise FP8 quantization in one pass on Hopper's TMA and tensor cores
(Pallas Mosaic GPU; the frame: `tensor_core_tiles`), each kernel returning what its Pallas
Triton twin in `block_quantize` returns:

- `tensor_core_quantize_rows_and_columns(x, fmt, ...)`: `x`'s 1 x 128 tiles along its rows
  and its 128 x 1 tiles along its columns, transposed (an output gradient's copies for the
  dgrad and the wgrad). The rows are cast in registers at their own scales (row amaxes are
  row reductions of the `wgmma` register layout); the columns are the rows of `I . x^T`, one
  BF16 (or float16) `wgmma` against the identity, exact, cast at their own scales.
- `tensor_core_quantize_blocks(w, fmt, ...)`: a weight's 128 x 128 blocks, each at one
  scale (the block's amax: one integer maximum of its rows' bits), and the same FP8 values
  transposed, `I . q^T`; experts' weights, batched or under `vmap`, in one kernel.
- `tensor_core_requantize_columns(data, scale_inv_t, ...)`: a saved FP8 activation's 1 x 128
  tiles dequantized and quantized again in 128 x 1 tiles, transposed (the wgrad's
  activation): `I . q^T`, each column times its row's scale.
- `tensor_core_quantize_rows(x, fmt, ...)`: an activation's 1 x 128 tiles alone; nothing to
  transpose, so TMA alone (no identity, no tensor cores).

Scales are divided exactly rounded (`div.rn.f32`, through `mosaic_private.ieee_divide`:
Mosaic GPU's `/` is `div.full.f32`), as the Triton kernels' and the XLA path's on a CPU;
scales come out chunk-major, as the GEMM kernels read them. For finite operands the same
values as the Triton kernels; a -0 in a transposed copy may come out +0. Where `x` has a
NaN or an inf, `0 * NaN` and `0 * inf` in the tensor cores make its row NaN in every column
of its 128 x 128 tile (then cast at scale 1: their amaxes NaN), where the XLA path does so
for the one column holding it; the amax is NaN either way, a step the train step's finite
check rejects.

The recipes call them inside `choice.tensor_core_quantization()` only, until a GPU run has
timed them (issue 39).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from ..core import mosaic_private
from ..core.jax_private import shape_like
from . import (
    TENSOR_CORE_BLOCKS_NAME,
    TENSOR_CORE_REQUANTIZE_NAME,
    TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
    TENSOR_CORE_ROWS_NAME,
)
from .quantize_tiles import nan_max, saturating_cast, tile_rule, tile_scales
from .tensor_core_tiles import (
    BLOCK,
    Tile,
    TransposeConfig,
    checked,
    fp8_buffers,
    store,
    stream_tiles,
    tile_at,
    transposed,
)


def row_scales(amax: Array, rule: dict) -> tuple[Array, Array]:
    """(scale broadcast over a tile's rows, scale_inv) of rows of `amax`."""
    scale, scale_inv = tile_scales(amax, **rule)
    return lax.broadcast_in_dim(scale, (BLOCK, BLOCK), (0,)), scale_inv  # JAX 0.10: not (128, 1)


def _everywhere_max(amax: Array) -> Array:
    """`nan_max` of row amaxes (`nan_max`'s results), in every row: one integer maximum of
    their bits, broadcast before it is a float again (Mosaic GPU bitcasts vectors only)."""
    bits = jnp.max(lax.bitcast_convert_type(amax, jnp.int32))
    return lax.bitcast_convert_type(jnp.broadcast_to(bits, amax.shape), jnp.float32)


#: What `_blockwise_call` writes: 1 x 128 tiles (`ROWS`), with the 128 x 1 tiles transposed
#: (`ROWS_AND_COLUMNS`), or a weight's 128 x 128 blocks and their transpose (`BLOCKS`).
ROWS, ROWS_AND_COLUMNS, BLOCKS = "rows", "rows and columns", "blocks"


def _blockwise_call(x, *, kind, fmt, batch, max_scale, power_of_two, config, interpret):
    """`x`'s tiles of `kind`, with scales in the layouts the GEMM kernels read
    (`block_quantize`'s)."""
    rows, k = x.shape
    rule = tile_rule(fmt, max_scale, power_of_two, interpret, mosaic=True)
    scales = functools.partial(row_scales, rule=rule)
    copies = 1 if kind == ROWS else 2

    def tile_step(ins, outs, scratch, eye_smem):
        # Per copy (0: x's layout, 1: transposed): its FP8 and scale buffers and outputs.
        copy = [
            (scratch[c], scratch[copies + c], outs[2 * c], outs[2 * c + 1]) for c in range(copies)
        ]

        def write(tile, values, scale_inv, where, c):
            """Copy `c`'s FP8 tile written at tile `where[c]`, its rows' `scale_inv` to
            that copy's chunk-major scales at the tile `where[1 - c]` names (the GEMMs'
            layout: one row a 128-chunk)."""
            data_smem, scale_smem, data_gmem, scale_gmem = copy[c]
            store(values, data_smem, tile, tile_at(data_gmem, *where[c]))
            row, col_tile = where[1 - c]
            store(scale_inv, scale_smem, tile, scale_gmem.at[row, pl.ds(col_tile * BLOCK, BLOCK)])

        def step(tile: Tile, x_smem, xv):
            where = ((tile.i, tile.col), (tile.transposed(), tile.local))
            amax = nan_max(jnp.abs(xv), axis=1)  # per row, NaN above inf
            if kind == BLOCKS:  # the block's amax for every row; the transpose of its values
                scale, scale_inv = scales(_everywhere_max(amax))
                write(tile, saturating_cast(xv, scale, fmt), scale_inv, where, 0)
                qt = transposed(eye_smem, copy[0][0].at[tile.slot]).astype(fmt)
                write(tile, qt, scale_inv, where, 1)
                return amax
            scale, scale_inv = scales(amax)
            write(tile, saturating_cast(xv, scale, fmt), scale_inv, where, 0)
            if kind == ROWS_AND_COLUMNS:  # x's columns: the rows of its transpose, x's tile
                xt = transposed(eye_smem, x_smem)
                scale, scale_inv = scales(nan_max(jnp.abs(xt), axis=1))
                write(tile, saturating_cast(xt, scale, fmt), scale_inv, where, 1)
            return amax

        return step, 2 * copies

    m, f32 = rows // batch, jnp.float32
    out_type = (
        shape_like((rows, k), fmt, x),
        shape_like((batch * k // BLOCK, m), f32, x),
        shape_like((batch * k, m), fmt, x),
        shape_like((rows // BLOCK, k), f32, x),
    )[: 2 * copies]
    scratch = fp8_buffers(fmt)[:copies] + [plgpu.SMEM((2, BLOCK), f32) for _ in range(copies)]
    names = {
        ROWS: TENSOR_CORE_ROWS_NAME,
        ROWS_AND_COLUMNS: TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
        BLOCKS: TENSOR_CORE_BLOCKS_NAME,
    }
    eye = None if kind == ROWS else jnp.asarray(np.eye(BLOCK), fmt if kind == BLOCKS else x.dtype)
    return stream_tiles(
        x,
        eye,
        (),
        name=names[kind],
        out_type=out_type,
        scratch_types=scratch,
        tile_step=tile_step,
        batch=batch,
        config=config,
        interpret=interpret,
    )


def _requantize_call(data, scale_inv_t, *, batch, max_scale, power_of_two, config, interpret):
    """FP8 `data`'s 1 x 128 tiles, dequantized at `scale_inv_t`, in 128 x 1 tiles written
    transposed: `I . q^T` on the tensor cores, each column of it times its row's scale."""
    rows, k = data.shape
    fmt = data.dtype
    rule = tile_rule(fmt, max_scale, power_of_two, interpret, mosaic=True)
    per_column = None if interpret else plgpu.Layout.WGMMA.reduce(0)

    def tile_step(ins, outs, scratch, eye_smem):
        (qt_gmem, st_gmem), (qt_smem, st_smem) = outs, scratch

        def step(tile: Tile, x_smem, xv, s_smem):
            del xv  # an FP8 tile: not loaded into registers
            s = mosaic_private.load(s_smem.at[0], layout=per_column)  # x's rows' scale_inv
            xt = transposed(eye_smem, x_smem) * lax.broadcast_in_dim(s, (BLOCK, BLOCK), (1,))
            amax = nan_max(jnp.abs(xt), axis=1)
            scale, scale_inv = row_scales(amax, rule)
            at = tile_at(qt_gmem, tile.transposed(), tile.local)
            store(saturating_cast(xt, scale, fmt), qt_smem, tile, at)
            store(scale_inv, st_smem, tile, st_gmem.at[tile.i, pl.ds(tile.col * BLOCK, BLOCK)])
            return amax

        return step, 2

    out_type = (
        shape_like((batch * k, rows // batch), fmt, data),
        shape_like((rows // BLOCK, k), jnp.float32, data),
    )
    return stream_tiles(
        data,
        jnp.asarray(np.eye(BLOCK), fmt),
        (),
        name=TENSOR_CORE_REQUANTIZE_NAME,
        out_type=out_type,
        scratch_types=fp8_buffers(fmt)[:1] + [plgpu.SMEM((2, BLOCK), jnp.float32)],
        tile_step=tile_step,
        batch=batch,
        config=config,
        interpret=interpret,
        side=scale_inv_t,
    )


_requantize = jax.jit(
    _requantize_call,
    static_argnames=("batch", "max_scale", "power_of_two", "config", "interpret"),
)
_blockwise = jax.jit(
    _blockwise_call,
    static_argnames=("kind", "fmt", "batch", "max_scale", "power_of_two", "config", "interpret"),
)


def tensor_core_quantize_rows(
    x: Float[Array, "*B M K"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "programs 128"]]:
    """`block_quantize.quantize_rows(x)` on TMA (nothing to transpose: no tensor cores):
    `x`'s 1 x 128 tiles along `K`, FP8 `data` as `x` and chunk-major `scale_inv_t (*B, K /
    128, M)`, and partial amaxes whose maximum is `max |x|` (NaN where `x` has a NaN), from
    one read of `x` (at most one batch axis; `M`, `K` multiples of 128; a 16- or 32-bit
    float). Scales as `BlockwiseScaling.block_scale` (at most `max_scale`; `block` must be
    128). `config`: a `TransposeConfig`; `interpret`: run in Mosaic GPU's interpreter
    (`None`: as traced)."""
    data, scale_t, amaxes = _tiles(
        x, fmt, ROWS, TENSOR_CORE_ROWS_NAME, block, max_scale, power_of_two, config, interpret
    )
    return data, scale_t, amaxes


def tensor_core_quantize_rows_and_columns(
    x: Float[Array, "*B M K"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "programs 128"], Array, Array]:
    """`block_quantize.quantize_rows_and_columns(x)` on TMA and the tensor cores: `x`'s
    1 x 128 tiles along `K` (FP8 `data` as `x`, chunk-major `scale_inv_t (*B, K / 128,
    M)`), partial amaxes whose maximum is `max |x|` (NaN where `x` has a NaN), and its
    128 x 1 tiles along `M` written transposed (`data_t (*B, K, M)`, `scale_inv (*B, M /
    128, K)`), from one read of `x` (at most one batch axis; `M`, `K` multiples of 128;
    BF16 or float16, which the tensor cores transpose exactly). Scales as
    `BlockwiseScaling.block_scale` (at most `max_scale`; `block` must be 128).
    `config`: a `TransposeConfig`; `interpret`: run in Mosaic GPU's interpreter (`None`:
    as traced)."""
    return _tiles(
        x,
        fmt,
        ROWS_AND_COLUMNS,
        TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
        block,
        max_scale,
        power_of_two,
        config,
        interpret,
    )


def _tiles(x, fmt, kind, who, block, max_scale, power_of_two, config, interpret) -> tuple:
    """`_blockwise_call`'s `ROWS` or `ROWS_AND_COLUMNS` of a checked `x (*B, M, K)`: data,
    scale_inv_t, amaxes, and for the columns data_t and their scale_inv, batched as `x`."""
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    dtypes = (jnp.bfloat16, jnp.float16) + ((jnp.float32,) if kind == ROWS else ())
    config, interpret = checked(who, x, fmt, config, dtypes, interpret)
    batch, (m, k) = (x.shape[0] if x.ndim == 3 else 1), x.shape[-2:]
    data, scale_t, *cols, amaxes = _blockwise(
        jnp.reshape(x, (batch * m, k)),
        kind=kind,
        fmt=jnp.dtype(fmt),
        batch=batch,
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )
    lead = x.shape[:-2]
    shapes = (x.shape, (*lead, k // BLOCK, m), (*lead, k, m), (*lead, m // BLOCK, k))
    out = [jnp.reshape(a, s) for a, s in zip((data, scale_t, *cols), shapes, strict=False)]
    return (out[0], out[1], amaxes, *out[2:])


def tensor_core_quantize_blocks(
    w: Float[Array, "*B N K"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "*B K/128 N"], Float[Array, "*B N/128 K"], Array]:
    """`block_quantize.quantize_blocks(w)` on TMA and the tensor cores: a weight `w (N, K)`
    (`N`, `K` multiples of 128; a 16- or 32-bit float) in 128 x 128 blocks, FP8 `data` and
    the same values transposed `data_t (K, N)` (`I . q^T`), each block's scale_inv once per
    row it covers (`rows_t (K / 128, N)` for `data`, `cols (N / 128, K)` for `data_t`), and
    partial amaxes `(programs, 128)` whose maximum is `max |w|` (NaN where `w` has a NaN),
    from one read of `w`. Scales as `BlockwiseScaling.block_scale` (at most `max_scale`;
    `block` must be 128). `config`: a `TransposeConfig`; `interpret`: run in Mosaic GPU's
    interpreter (`None`: as traced).

    Experts' weights `(*B, N, K)`, or `w` under `vmap` (as `Fp8RaggedDot` quantizes them),
    run as one kernel over all of them (one wave of programs, not one grid per weight), each
    output with `w`'s leading axes, the amaxes `(*B, programs / B, 128)`: each weight's
    own (no program spans two)."""
    who = TENSOR_CORE_BLOCKS_NAME
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
    config, interpret = checked(who, w, fmt, config, dtypes, interpret)
    static = dict(
        fmt=jnp.dtype(fmt),
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )

    @custom_vmap
    def blocks(w: Array) -> tuple[Array, ...]:
        return _weight_blocks(w, **static)

    @blocks.def_vmap
    def _rule(axis_size, in_batched, w):
        del axis_size, in_batched  # `w`, the one argument, is mapped (on axis 0)
        # `blocks`, not `_weight_blocks`: under an outer `vmap` this rule runs again.
        return blocks(w), (True,) * 5

    return blocks(w)


def _weight_blocks(w, **static) -> tuple[Array, ...]:
    """`_blockwise_call`'s `BLOCKS` of a checked `w (*lead, N, K)`, the leading axes flattened
    into the kernel's batch and restored in its outputs."""
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    batch = math.prod(lead)
    data, rows_t, data_t, cols, amaxes = _blockwise(
        jnp.reshape(w, (batch * n, k)), kind=BLOCKS, batch=batch, **static
    )
    shapes = ((n, k), (k, n), (k // BLOCK, n), (n // BLOCK, k), (-1, BLOCK))
    out = (data, data_t, rows_t, cols, amaxes)
    return tuple(jnp.reshape(a, (*lead, *s)) for a, s in zip(out, shapes, strict=True))


def tensor_core_requantize_columns(
    data: Array,
    scale_inv_t: Float[Array, "*B K/128 M"],
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Float[Array, "*B M/128 K"]]:
    """`block_quantize.requantize_columns` on TMA and the tensor cores: FP8 `data (*B, M, K)`
    in 1 x 128 tiles (chunk-major `scale_inv_t`, as `quantize_rows` writes it; at most one
    batch axis; `M`, `K` multiples of 128), dequantized and quantized again in 128 x 1
    tiles, written transposed (`data_t (*B, K, M)`, the same FP8 format) with their
    chunk-major `scale_inv (*B, M / 128, K)`, from one read (DeepSeek-V3's wgrad activation,
    from its saved FP8 copy). Scales as `BlockwiseScaling.block_scale` (at most
    `max_scale`; `block` must be 128). `config`: a `TransposeConfig`; `interpret`: run in
    Mosaic GPU's interpreter (`None`: as traced)."""
    who = TENSOR_CORE_REQUANTIZE_NAME
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    config, interpret = checked(who, data, data.dtype, config, fp8, interpret)
    batch, (m, k) = (data.shape[0] if data.ndim == 3 else 1), data.shape[-2:]
    lead = data.shape[:-2]
    if scale_inv_t.shape != (*lead, k // BLOCK, m):
        raise ValueError(
            f"{who}: scale_inv_t has shape {scale_inv_t.shape}; expected "
            f"{(*lead, k // BLOCK, m)} (chunk-major, one scale a row and 128-chunk)."
        )
    data_t, cols, _ = _requantize(
        jnp.reshape(data, (batch * m, k)),
        jnp.reshape(scale_inv_t, (batch * k // BLOCK, m)).astype(jnp.float32),
        batch=batch,
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )
    return jnp.reshape(data_t, (*lead, k, m)), jnp.reshape(cols, (*lead, m // BLOCK, k))

"""Tile quantization in one pass for the block-scaled GEMMs, written in Pallas (Triton).

DeepSeek-V3's recipe quantizes activations and gradients in 1 x 128 tiles along the axis a
GEMM contracts, so each tensor exists in two tilings: along its features for the forward (and
the dgrad), along its tokens, transposed, for the wgrad. XLA computes each tiling as a
block-amax reduction and a separate cast, and the token tiling once more after a transpose:
one tensor read four times. These kernels read it once:

- `quantize_rows(x)`: `x (M, K)` in 1 x `block` tiles along `K`: FP8 data, one scale per row
  and tile, and a NaN-propagating amax per program for the operand's state.
- `quantize_rows_and_columns(x)`: the same, and in the same pass the `block` x 1 tiles along
  `M`, written transposed `(K, M)` (K-major, as the wgrad's kernel takes them): the output
  gradient's two copies.
- `requantize_columns(data, scale_inv)`: an FP8 tensor in 1 x `block` tiles dequantized and
  quantized again in `block` x 1 tiles, transposed: the activation the wgrad takes, from its
  saved FP8 copy (DeepSeek-V3's choice: no high-precision copy is kept).
- `quantize_blocks(w)`: a weight in `block x block` blocks, and the same FP8 values
  transposed (the dgrad's K-major copy), from one read; each block's scale written out once
  per row it covers, in both layouts, as the GEMM kernels read a weight's scales (one per
  row and chunk): no kernel of its own expands them between.

Each program owns one `block x block` tile: its rows' and columns' amaxes are in registers,
so the scales and casts follow without another read (or, in slabs of rows, `ColumnTuning
.slab_rows`, with fewer registers, the columns cast from a second read of the tile from
cache; `quantize_tiles.quantize_tile` walks a tile either way). The math is the XLA path's
(`fp8jax._src.recipes.blocks`) operation for operation: `reference_*` below, side by side,
and the tests hold the two equal bit for bit in the interpreter. Two GPU details matter:
Triton divides float32 approximately (`div.full.f32`), so a scale is divided with
`div.rn.f32` in inline PTX, exactly rounded as the XLA path on a CPU (XLA's own GPU fusions
also divide with `div.full.f32`: on an H100 their scales may differ in the last bit); and
PTX's `max` drops NaNs, so an amax is an integer maximum of the magnitudes' bit patterns,
in which every NaN lies above infinity (`quantize_tiles.nan_max`: one reduction, not two).
The interpreter divides with `/` behind a barrier (IEEE on a CPU): the one step it does not
run as the GPU does.

Pallas' Triton backend, which these kernels are written in, is deprecated from JAX 0.11 on
(JAX's GPU kernels move to Mosaic GPU, whose lowering does not yet reduce a tile over its
rows nor transpose one in registers); where a JAX has removed it, `fits` says no and the
recipes keep the XLA path, with the same numbers.

Scales come out chunk-major, `(K / block, M)` for `M` rows contracted over `K`: the layout
the GEMM kernels read them in (`block_gemm`, `persistent_gemm`), so that no transpose of
them runs between. Shapes must be whole tiles (`fits`); the recipes keep the XLA path for
any other.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

try:  # deprecated from JAX 0.11 on; where JAX has removed it, the recipes keep the XLA path
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a future JAX
    pltriton = None

from ..core.jax_private import shape_like
from . import QUANTIZE_NAMES
from .dispatch import interpreting
from .quantize_config import (  # noqa: F401 - re-exported beside the kernels that take them
    DEFAULT_TUNING,
    NUM_WARPS,
    OTHER_TUNING,
    ColumnTuning,
    check_block,
    check_tuning,
    is_power_of_two,
    slab_height,
)
from .quantize_tiles import (  # noqa: F401 - re-exported: the kernels' shared tile maths
    bits_max,
    cast_columns,
    nan_max,
    over_slabs,
    quantize_tile,
    row_tiles,
    saturating_cast,
    store_columns,
    tile_rule,
    tile_scales,
    transpose,
)

#: Elements an operand may have, over the batch the kernels are mapped over too: Pallas'
#: Triton lowering addresses an array of at most 2**32 bytes with 32-bit element offsets,
#: which overflow past 2**31 - 1 elements (an FP8 copy of 2**31 to 2**32 elements).
MAX_ELEMENTS = 2**31 - 1


def fits(shape: tuple[int, ...], block: int) -> bool:
    """Whether the kernels can quantize `shape`, `(M, K)` or `(*B, M, K)` mapped over `B`:
    whole `block x block` tiles of a power-of-two `block` (Triton's), at most `MAX_ELEMENTS`
    in all, and a JAX that still has Pallas' Triton backend."""
    tiled = is_power_of_two(block) and len(shape) >= 2
    tiled = tiled and all(n > 0 and n % block == 0 for n in shape[-2:])
    return tiled and math.prod(shape) <= MAX_ELEMENTS and pltriton is not None


# --- the kernels ---------------------------------------------------------------------------


def _rows_kernel(x_ref, q_ref, s_ref, amax_ref, *cols_refs, tuning: ColumnTuning, **rule):
    def rows(sl, x):
        q, scale_inv, amax = row_tiles(x, q_ref.dtype, rule)
        q_ref[sl, :], s_ref[:, sl] = q, scale_inv[None, :]
        return amax

    load = lambda sl: x_ref[sl, :].astype(jnp.float32)  # noqa: E731
    block = x_ref.shape[0]
    quantize_tile(load, block, tuning, rule, rows=(rows, amax_ref), columns=cols_refs)


def _columns_kernel(data_ref, s_ref, qt_ref, st_ref, *, tuning: ColumnTuning, **rule):
    def load(sl):  # the saved tiles' values, each row at its 1 x block tile's scale
        scale_inv = s_ref[0, sl]
        return data_ref[sl, :].astype(jnp.float32) * scale_inv[:, None]

    quantize_tile(load, data_ref.shape[0], tuning, rule, columns=(qt_ref, st_ref))


def _specs(block: int, m: int, k: int, fmt: jnp.dtype, columns: bool, like: Array):
    """Output shapes and block specs of the rows kernel over the grid `(M / block, K / block)`."""
    tile, nm, nk = (block, block), m // block, k // block
    shapes = [
        shape_like((m, k), fmt, like),
        shape_like((nk, m), jnp.float32, like),
        shape_like((nm, nk), jnp.float32, like),
    ]
    specs = [
        pl.BlockSpec(tile, lambda i, j: (i, j)),
        pl.BlockSpec((1, block), lambda i, j: (j, i)),
        pl.BlockSpec((1, 1), lambda i, j: (i, j)),
    ]
    if columns:
        column_shapes, column_specs = column_outputs(block, m, k, fmt, like)
        shapes, specs = shapes + column_shapes, specs + column_specs
    return shapes, specs


def column_outputs(block: int, m: int, k: int, fmt: jnp.dtype, like: Array):
    """Output shapes and block specs, over the grid `(M / block, K / block)`, of `block` x 1
    tiles along `M` written transposed: `data_t (K, M)` and chunk-major `scale_inv (M /
    block, K)` (`store_columns`' refs)."""
    shapes = [shape_like((k, m), fmt, like), shape_like((m // block, k), jnp.float32, like)]
    specs = [
        pl.BlockSpec((block, block), lambda i, j: (j, i)),
        pl.BlockSpec((1, block), lambda i, j: (i, j)),
    ]
    return shapes, specs


def check_tiles(x: Array, block: int, name: str) -> None:
    """Raise, naming kernel `name`, where this JAX has no Pallas Triton backend or `x` is not
    made of whole `block x block` tiles."""
    if pltriton is None:  # pragma: no cover - a future JAX
        raise RuntimeError(
            f"{name}: jax {jax.__version__} has no Pallas Triton backend, which this kernel "
            "is written in; the recipes keep the XLA path there."
        )
    check_block(block, name)
    if x.ndim != 2 or not fits(x.shape, block):
        raise ValueError(
            f"{name}: shape {x.shape} is not made of whole {block} x {block} tiles or has "
            f"more than {MAX_ELEMENTS} elements; the kernel takes 2-D operands whose sides "
            "are multiples of the block, of at most that many elements (the recipes keep "
            "the XLA path for others)."
        )


def check_format(fmt: object, name: str) -> jnp.dtype:
    """`fmt` as a dtype; raise, naming kernel `name`, unless it is an 8-bit float (a 16- or
    32-bit one would be a copy scaled up to its own max, an integer one is no format)."""
    dtype = jnp.dtype(fmt)
    if not (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1):
        raise ValueError(
            f"{name}: format {dtype.name}; expected an FP8 format (float8_e4m3fn or "
            "float8_e5m2, say)."
        )
    return dtype


def triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, num_warps=NUM_WARPS):
    """The quantization kernels' `pallas_call` (Triton: `num_warps` warps, one stage)."""
    return pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=grid,
        in_specs=in_specs,
        out_specs=specs,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name=name,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "fmt",
        "block",
        "max_scale",
        "power_of_two",
        "columns",
        "interpret",
        "tuning",
    ),
)
def _quantize(x, *, fmt, block, max_scale, power_of_two, columns, interpret, tuning):
    m, k = x.shape
    shapes, specs = _specs(block, m, k, fmt, columns, x)
    rule = tile_rule(fmt, max_scale, power_of_two, interpret)
    kernel = functools.partial(_rows_kernel, tuning=tuning, **rule)
    in_specs = [pl.BlockSpec((block, block), lambda i, j: (i, j))]
    name = QUANTIZE_NAMES[1 if columns else 0]
    grid = (m // block, k // block)
    call = triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, tuning.num_warps)
    return tuple(call(x))


def _interpret(x: Array, block: int, name: str, interpret: bool | None) -> bool:
    """Check `x` for kernel `name`; whether it runs interpreted (`None`: as traced)."""
    check_tiles(x, block, name)
    return interpreting() if interpret is None else interpret


def _rows(x, fmt, columns, block, max_scale, power_of_two, interpret, tuning=DEFAULT_TUNING):
    """`_quantize` of checked operands."""
    name = QUANTIZE_NAMES[1 if columns else 0]
    tuning = check_tuning(tuning, name, block)
    return _quantize(
        x,
        fmt=check_format(fmt, name),
        block=block,
        max_scale=max_scale,
        power_of_two=power_of_two,
        columns=columns,
        interpret=_interpret(x, block, name, interpret),
        tuning=tuning,
    )


def quantize_rows(
    x: Float[Array, "M K"],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = DEFAULT_TUNING,
) -> tuple[Array, Float[Array, "K/block M"], Float[Array, "M/block K/block"]]:
    """`x` in 1 x `block` tiles along `K`: FP8 `data (M, K)`, `scale_inv_t (K / block, M)`
    (chunk-major) and each program's amax `(M / block, K / block)` (NaN where its tile has
    a NaN), for the operand's state. Scales as `BlockwiseScaling.block_scale` (at most
    `max_scale`). `tuning`: a `ColumnTuning` (its `num_warps` and `slab_rows`)."""
    return _rows(x, fmt, False, block, max_scale, power_of_two, interpret, tuning)


def quantize_rows_and_columns(
    x: Float[Array, "M K"],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = DEFAULT_TUNING,
) -> tuple[Array, Array, Array, Array, Array]:
    """`quantize_rows(x)`'s three outputs and, from the same read of `x`, its `block` x 1
    tiles along `M` transposed: `data_t (K, M)` and its chunk-major `scale_inv (M / block,
    K)`. `tuning`: a `ColumnTuning` (the GPU check's sweep)."""
    return _rows(x, fmt, True, block, max_scale, power_of_two, interpret, tuning)


@functools.partial(
    jax.jit, static_argnames=("block", "max_scale", "power_of_two", "interpret", "tuning")
)
def _requantize(data, scale_inv, *, block, max_scale, power_of_two, interpret, tuning):
    m, k = data.shape
    nm = m // block
    rule = tile_rule(data.dtype, max_scale, power_of_two, interpret)
    kernel = functools.partial(_columns_kernel, tuning=tuning, **rule)
    shapes, specs = column_outputs(block, m, k, data.dtype, data)
    in_specs = [
        pl.BlockSpec((block, block), lambda i, j: (i, j)),
        pl.BlockSpec((1, block), lambda i, j: (j, i)),
    ]
    grid = (nm, k // block)
    name = QUANTIZE_NAMES[2]
    call = triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, tuning.num_warps)
    return tuple(call(data, scale_inv))


def requantize_columns(
    data: Array,
    scale_inv_t: Float[Array, "K/block M"],
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = OTHER_TUNING,
) -> tuple[Array, Float[Array, "M/block K"]]:
    """FP8 `data (M, K)` in 1 x `block` tiles (`scale_inv_t` chunk-major, as `quantize_rows`
    writes it) requantized into `block` x 1 tiles along `M`, transposed: `data_t (K, M)` in
    `data`'s FP8 type and its chunk-major `scale_inv (M / block, K)`. `tuning`: a
    `ColumnTuning` (the GPU check's sweep)."""
    interpret = _interpret(data, block, QUANTIZE_NAMES[2], interpret)
    check_format(data.dtype, QUANTIZE_NAMES[2])
    tuning = check_tuning(tuning, QUANTIZE_NAMES[2], block)
    want = (data.shape[1] // block, data.shape[0])
    if scale_inv_t.shape != want:
        raise ValueError(
            f"requantize_columns: scale_inv_t has shape {scale_inv_t.shape}; data "
            f"{data.shape} in 1 x {block} tiles takes {want} (chunk-major)."
        )
    return _requantize(
        data,
        scale_inv_t.astype(jnp.float32),
        block=block,
        max_scale=max_scale,
        power_of_two=power_of_two,
        interpret=interpret,
        tuning=tuning,
    )


def _square_kernel(
    w_ref, q_ref, qt_ref, rows_ref, cols_ref, amax_ref, *, tuning: ColumnTuning, **rule
):
    if slab_height(tuning, w_ref.shape[0]) < w_ref.shape[0]:
        _square_slabs(w_ref, q_ref, qt_ref, rows_ref, cols_ref, amax_ref, tuning, rule)
        return
    w = w_ref[...].astype(jnp.float32)
    row_amax = nan_max(jnp.abs(w), axis=1)
    # The block's amax in every lane of a vector (Triton's inline PTX takes tensors only).
    amax = jnp.broadcast_to(nan_max(row_amax, axis=0), row_amax.shape)
    scale, scale_inv = tile_scales(amax, **rule)
    q = saturating_cast(w, scale[:, None], q_ref.dtype)
    q_ref[...] = q
    # One scale for the whole block: casting the transposed tile gives the same values.
    if tuning.transpose_first:
        qt_ref[...] = saturating_cast(w.T, scale[:, None], q_ref.dtype)
    else:
        qt_ref[...] = transpose(q, tuning)
    rows_ref[...] = scale_inv[None, :]  # all lanes are equal: the block's scale per row
    cols_ref[...] = scale_inv[None, :]  # and per row of the transposed copy
    amax_ref[...] = jnp.broadcast_to(nan_max(row_amax, axis=0), amax_ref.shape)


def _square_slabs(w_ref, q_ref, qt_ref, rows_ref, cols_ref, amax_ref, tuning, rule):
    """`_square_kernel` in slabs: the block's amax slab by slab, then each slab read again
    to cast both copies at the block's scale."""
    block = w_ref.shape[0]
    h = slab_height(tuning, block)
    load = lambda sl: w_ref[sl, :].astype(jnp.float32)  # noqa: E731
    tile_amax = lambda sl, c: bits_max(c, nan_max(nan_max(jnp.abs(load(sl)), 1), 0))  # noqa: E731
    amax = over_slabs(block, h, tile_amax, jnp.float32(0))
    scale, scale_inv = tile_scales(jnp.broadcast_to(amax, (block,)), **rule)
    slab_scale = tile_scales(jnp.broadcast_to(amax, (h,)), **rule)[0]

    def cast(sl, carry):
        w = load(sl)
        q_ref[sl, :] = q = saturating_cast(w, slab_scale[:, None], q_ref.dtype)
        if tuning.transpose_first:
            qt_ref[:, sl] = saturating_cast(w.T, scale[:, None], q_ref.dtype)
        else:
            qt_ref[:, sl] = transpose(q, tuning)
        return carry

    over_slabs(block, h, cast, 0)
    rows_ref[...] = cols_ref[...] = scale_inv[None, :]
    amax_ref[...] = jnp.broadcast_to(amax, amax_ref.shape)


@functools.partial(
    jax.jit, static_argnames=("fmt", "block", "max_scale", "power_of_two", "interpret", "tuning")
)
def _quantize_square(w, *, fmt, block, max_scale, power_of_two, interpret, tuning):
    n, k = w.shape
    rule = tile_rule(fmt, max_scale, power_of_two, interpret)
    kernel = functools.partial(_square_kernel, tuning=tuning, **rule)
    shapes = [
        shape_like((n, k), fmt, w),
        shape_like((k, n), fmt, w),
        shape_like((k // block, n), jnp.float32, w),
        shape_like((n // block, k), jnp.float32, w),
        shape_like((n // block, k // block), jnp.float32, w),
    ]
    specs = [
        pl.BlockSpec((block, block), lambda i, j: (i, j)),
        pl.BlockSpec((block, block), lambda i, j: (j, i)),
        pl.BlockSpec((1, block), lambda i, j: (j, i)),
        pl.BlockSpec((1, block), lambda i, j: (i, j)),
        pl.BlockSpec((1, 1), lambda i, j: (i, j)),
    ]
    in_specs = [pl.BlockSpec((block, block), lambda i, j: (i, j))]
    grid = (n // block, k // block)
    name = QUANTIZE_NAMES[3]
    call = triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, tuning.num_warps)
    return tuple(call(w))


def quantize_blocks(
    w: Float[Array, "N K"],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = OTHER_TUNING,
) -> tuple[
    Array,
    Array,
    Float[Array, "K/block N"],
    Float[Array, "N/block K"],
    Float[Array, "N/block K/block"],
]:
    """A weight `w (N, K)` in `block x block` blocks: FP8 `data (N, K)`, the same values
    transposed `data_t (K, N)` (the dgrad's K-major copy), their scale_inv chunk-major as the
    GEMM kernels read them, each block's once per row it covers (`rows_t (K / block, N)`
    for `data`, `cols (N / block, K)` for `data_t`), and each block's amax (NaN where it has
    a NaN), from one read of `w`. `tuning`: a `ColumnTuning` (the GPU check's sweep)."""
    tuning = check_tuning(tuning, QUANTIZE_NAMES[3], block)
    return _quantize_square(
        w,
        fmt=check_format(fmt, QUANTIZE_NAMES[3]),
        block=block,
        max_scale=max_scale,
        power_of_two=power_of_two,
        interpret=_interpret(w, block, QUANTIZE_NAMES[3], interpret),
        tuning=tuning,
    )


# --- references: the XLA path's operations, for the tests ----------------------------------


def reference_rows(x, fmt, *, block=128, max_scale, power_of_two=False):
    """`quantize_rows` in plain XLA (the recipe's `block_amax`, `block_scale`, `saturate`)."""
    from ..core.formats import expand_blocks, floor_log2, pow2, saturate

    m, k = x.shape
    tiles = jnp.abs(x.astype(jnp.float32)).reshape(m, k // block, block)
    amax = jnp.max(tiles, axis=-1)
    fmt_max = float(jnp.finfo(fmt).max)
    ok = (amax > 0) & jnp.isfinite(amax)
    scale = jnp.minimum(jnp.where(ok, fmt_max / jnp.where(ok, amax, 1.0), 1.0), max_scale)
    if power_of_two:
        scale = pow2(floor_log2(scale))
    data = saturate(x, expand_blocks(scale, (1, block), x.shape), fmt)
    per_program = jnp.max(amax.reshape(m // block, block, k // block), axis=1)
    return data, (1.0 / scale).T, per_program


def reference_columns(x, fmt, *, block=128, max_scale, power_of_two=False):
    """The `block` x 1 tiles of `x` transposed, in plain XLA: `reference_rows` of `x.T`."""
    data, scale_inv_t, _ = reference_rows(
        x.T, fmt, block=block, max_scale=max_scale, power_of_two=power_of_two
    )
    return data, scale_inv_t

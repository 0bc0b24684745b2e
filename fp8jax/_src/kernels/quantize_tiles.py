"""The tile maths the quantization kernels share (`block_quantize`, `padded_quantize`,
`cast_transpose`, `tensor_core_blocks`): a tile's scales as the recipe computes them, its
saturating cast, its NaN-propagating amaxes, and walking a tile whole or in slabs (`quantize_tile`,
`ColumnTuning.slab_rows`).

Two GPU details matter: Triton and Mosaic GPU divide float32 approximately (`div.full.f32`),
so a scale is divided with `div.rn.f32` in inline PTX (Mosaic GPU's through
`mosaic_private.ieee_divide`), exactly rounded as the XLA path on a CPU; and PTX's
`max` drops NaNs, so an amax is an integer maximum of the magnitudes' bit patterns, in which
every NaN lies above infinity (`nan_max`: one reduction, not two; `bits_max` of two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array

try:  # deprecated from JAX 0.11 on; where JAX has removed it, the recipes keep the XLA path
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a future JAX
    pltriton = None

from .quantize_config import ColumnTuning, slab_height

_EXPONENT_BITS = 0x7F800000
_MAGNITUDE_BITS = 0x7FFFFFFF

# --- the scale of a tile, as the recipe computes it ----------------------------------------


def _divide(a: Array, b: Array, interpret: bool, mosaic: bool = False) -> Array:
    """`a / b` rounded to nearest (IEEE), also in Triton and Mosaic GPU (`mosaic`), whose `/`
    is approximate."""
    if interpret:  # opaque operands: XLA rewrites 1 / (c / x) as an inexact x * (1 / c)
        a, b = lax.optimization_barrier((a, b))
        return a / b
    if mosaic:  # register layout: a row of WGMMA's (`tensor_core_blocks`)
        from jax.experimental.pallas import mosaic_gpu as plgpu

        from ..core import mosaic_private

        layout = plgpu.Layout.WGMMA.reduce(1)
        a, b = (plgpu.layout_cast(v, layout) for v in jnp.broadcast_arrays(a, b))
        return mosaic_private.ieee_divide(a, b, layout)
    (out,) = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def nan_max(magnitude: Array, axis: int | None) -> Array:
    """`max(magnitude)` over `axis` of magnitudes (`|x|`), NaN where a NaN is reduced (PTX's
    `max` drops them). One integer maximum of the float32 bit patterns (sign bits cleared),
    which order non-negative floats as their values and every NaN above infinity (a NaN's
    payload may differ from the one reduced), where a float maximum and a NaN test would be
    two reductions of the tile."""
    bits = lax.bitcast_convert_type(magnitude.astype(jnp.float32), jnp.int32) & _MAGNITUDE_BITS
    return lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def tile_scales(
    amax: Array,
    fmt_max: float,
    max_scale: float,
    power_of_two: bool,
    interpret: bool,
    mosaic: bool = False,
) -> tuple[Array, Array]:
    """(scale, scale_inv) of tiles with `amax`: `BlockwiseScaling.block_scale`'s rule
    (`mosaic`: in a Mosaic GPU kernel, else Triton's)."""
    finite = jnp.abs(amax) < jnp.inf
    ok = (amax > 0.0) & finite
    one = jnp.ones_like(amax)
    fmt_max = jnp.full_like(amax, fmt_max)
    divide = lambda a, b: _divide(a, b, interpret, mosaic)  # noqa: E731
    scale = jnp.where(ok, divide(fmt_max, jnp.where(ok, amax, one)), one)
    scale = jnp.minimum(scale, max_scale)
    if power_of_two:  # 2**floor(log2(scale)) of a normal float32: its exponent bits alone
        bits = lax.bitcast_convert_type(scale, jnp.int32) & _EXPONENT_BITS
        scale = lax.bitcast_convert_type(bits, jnp.float32)
    return scale, divide(one, scale)


def saturating_cast(x: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """`fp8jax.quantize`'s saturating cast of `x * scale` (inf and NaN become NaN)."""
    limit = float(jnp.finfo(dtype).max)
    scaled = jnp.clip(x * scale, -limit, limit)
    return jnp.where(jnp.abs(x) < jnp.inf, scaled, jnp.nan).astype(dtype)


def bits_max(a: Array, b: Array) -> Array:
    """`nan_max` of two amaxes (`nan_max`'s results: NaN above inf)."""
    i32 = lambda v: lax.bitcast_convert_type(v, jnp.int32)  # noqa: E731
    return lax.bitcast_convert_type(jnp.maximum(i32(a), i32(b)), jnp.float32)


def over_slabs(block: int, h: int, body, init):
    """`body(rows, carry)` over a `block`-row tile's slabs of `h` rows (`rows`: a `pl.ds`)."""
    step = lambda i, c: body(pl.ds(pl.multiple_of(i * h, h), h), c)  # noqa: E731
    return lax.fori_loop(0, block // h, step, init)


def quantize_tile(
    load,
    block: int,
    tuning: ColumnTuning,
    rule: dict,
    *,
    rows=None,
    columns=(),
    to_columns=lambda sl, x: x,
) -> None:
    """A `block x block` tile held as `tuning` says, `x = load(sl)` its rows `sl` (their
    float32 values, or what `write` and `to_columns` take: a gather's rows and gaps).
    `rows` `(write, amax_ref)`, if given: `write(sl, x)` writes the rows' 1 x `block` tiles
    and returns their amax, whose maximum goes to `amax_ref`; `columns` `(qt_ref, st_ref)`,
    if given, receive the `block` x 1 tiles of `to_columns(sl, x)` (float32), transposed.
    Whole, from one read; in slabs (`slab_height`), the rows and the column amaxes slab by
    slab, then each slab read again to cast its columns."""
    h = slab_height(tuning, block)
    if h == block:
        x = load(slice(None))
        if rows is not None:
            rows[1][...] = jnp.broadcast_to(rows[0](slice(None), x), rows[1].shape)
        if columns:
            store_columns(to_columns(slice(None), x), *columns, rule, tuning)
        return

    def first(sl, carry):
        x = load(sl)
        amax = carry[0] if rows is None else bits_max(carry[0], rows[0](sl, x))
        if not columns:
            return amax, carry[1]
        return amax, bits_max(carry[1], nan_max(jnp.abs(to_columns(sl, x)), axis=0))

    init = (jnp.float32(0), jnp.zeros((block,), jnp.float32))
    amax, column_amax = over_slabs(block, h, first, init)
    if rows is not None:
        rows[1][...] = jnp.broadcast_to(amax, rows[1].shape)
    if columns:
        scale, scale_inv = tile_scales(column_amax, **rule)

        def second(sl, carry):
            cast_columns(to_columns(sl, load(sl)), scale, columns[0], sl, tuning)
            return carry

        over_slabs(block, h, second, 0)
        columns[1][...] = scale_inv[None, :]


def row_tiles(x: Array, dtype: jnp.dtype, rule: dict) -> tuple[Array, Array, Array]:
    """A float32 tile `x` in 1 x `block` tiles along its columns: its FP8 values, each row's
    scale_inv and the tile's amax (NaN where it has a NaN)."""
    row_amax = nan_max(jnp.abs(x), axis=1)
    scale, scale_inv = tile_scales(row_amax, **rule)
    return saturating_cast(x, scale[:, None], dtype), scale_inv, nan_max(row_amax, axis=0)


def store_columns(x: Array, qt_ref, st_ref, rule: dict, tuning: ColumnTuning) -> None:
    """A float32 tile `x` in `block` x 1 tiles along its rows: the FP8 values written
    transposed to `qt_ref` (as `tuning` says), their scale_inv to `st_ref` (one row)."""
    scale, scale_inv = tile_scales(nan_max(jnp.abs(x), axis=0), **rule)
    cast_columns(x, scale, qt_ref, slice(None), tuning)
    st_ref[...] = scale_inv[None, :]


def cast_columns(x: Array, scale: Array, qt_ref, sl, tuning: ColumnTuning) -> None:
    """Rows `sl` of a tile (`x`, float32) cast at their columns' `scale`, written transposed
    to columns `sl` of `qt_ref` (as `tuning` says)."""
    if tuning.transpose_first:
        qt_ref[:, sl] = saturating_cast(x.T, scale[:, None], qt_ref.dtype)
    else:
        qt_ref[:, sl] = transpose(saturating_cast(x, scale[None, :], qt_ref.dtype), tuning)


def transpose(q: Array, tuning: ColumnTuning) -> Array:
    """`q.T` of an FP8 tile, through BF16 with `tuning.wide_transpose`."""
    return q.astype(jnp.bfloat16).T.astype(q.dtype) if tuning.wide_transpose else q.T


def tile_rule(
    fmt: jnp.dtype, max_scale: float, power_of_two: bool, interpret: bool, mosaic: bool = False
) -> dict:
    """The keyword arguments of `tile_scales` for tiles cast to `fmt` (`mosaic`: in a Mosaic
    GPU kernel)."""
    return dict(
        fmt_max=float(jnp.finfo(fmt).max),
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        interpret=interpret,
        mosaic=mosaic,
    )

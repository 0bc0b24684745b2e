"""An expert layer's wgrad tiles, quantized while gathered into the padded layout (Triton).

The wgrad of a grouped GEMM contracts each expert's tokens in `block` x 1 tiles that must not
mix experts (DeepSeek-V3's layout): the expert-sorted rows are spread so that each expert
starts on a multiple of `block`, zeros between (`gemm/grouped_native.pad_layout`). XLA wrote
that padded copy inside its own quantization, reading the tensor once for the tiles' amaxes
and once to cast it; `block_quantize`'s one-pass kernels would need the padded copy written
first (a pass more: tried, 0.97 GB more on a Mixtral-like layer). These kernels read the
rows through the layout's row map themselves, once:

- `quantize_padded_columns(x, rows)`: the output gradient `x (M, K)`, its rows gathered by
  `rows (P,)`, in `block` x 1 tiles along the padded rows, written transposed `(K, P)`
  (K-major, as the tokens kernel takes it) with chunk-major scales `(P / block, K)`.
- `requantize_padded_columns(data, scale_inv_t, rows)`: the saved FP8 activation in 1 x
  `block` tiles, gathered and requantized into those tiles, from its FP8 values
  (`block_quantize.requantize_columns` through the row map).
- `quantize_rows_and_padded_columns(x, rows)`: the output gradient's two copies from one
  read, as `block_quantize.quantize_rows_and_columns` makes a dense layer's: its 1 x `block`
  tiles along `K` for the dgrad (`quantize_rows`' outputs, in `x`'s own rows) and the
  gathered `block` x 1 tiles for the wgrad. Each program writes the rows copy of the rows it
  gathered: the map must name every row of `x` (below).

`rows[p]` is the row of `x` that padded row `p` holds, or, negative, a row of zeros (a gap).
A gap's `-1 - rows[p]` names a row of `x` whose rows copy the gap's lane writes (and reads:
its columns copy is zeros all the same): `gemm/grouped_native.gather_map` names each row past
the experts' once, then others again (the same values twice). The math is
`block_quantize`'s (its `row_tiles`, `store_columns` and `column_outputs`), and each result
equals the corresponding `block_quantize` kernel run on `x` or on the gathered copy, bit for
bit (`reference_padded_columns` below and the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ..core.jax_private import shape_like
from . import QUANTIZE_NAMES
from .block_quantize import (  # MAX_ELEMENTS: the gathered rows' 32-bit offsets too
    DEFAULT_TUNING,
    MAX_ELEMENTS,
    OTHER_TUNING,
    ColumnTuning,
    check_block,
    check_format,
    check_tuning,
    column_outputs,
    is_power_of_two,
    pltriton,
    quantize_tile,
    reference_columns,
    row_tiles,
    tile_rule,
    triton_call,
)
from .dispatch import interpreting

QUANTIZE_PADDED_NAME, REQUANTIZE_PADDED_NAME = QUANTIZE_NAMES[4:6]
BOTH_PADDED_NAME = QUANTIZE_NAMES[7]


def fits(shape: tuple[int, ...], padded: int, block: int) -> bool:
    """Whether the kernels can gather `padded` rows of a 2-D `shape` into `block` x 1 tiles
    (`block` a power of two, as Triton's arrays): some rows, columns in whole tiles, whole
    tiles of padded rows, operands of at most `MAX_ELEMENTS`, and Pallas' Triton."""
    ok = is_power_of_two(block) and len(shape) == 2 and shape[0] > 0 and shape[1] > 0
    ok = ok and shape[1] % block == 0
    ok = ok and padded > 0 and padded % block == 0
    return ok and max(shape[0], padded) * shape[1] <= MAX_ELEMENTS and pltriton is not None


def _gather(rows_ref, x_ref, j: Array, block: int, sl) -> tuple[Array, Array, Array]:
    """Rows `sl` of this program's gathered rows of column tile `j`, in float32: (values,
    which are real, index)."""
    rows = rows_ref[sl]
    real = rows >= 0
    index = jnp.where(real, rows, -1 - rows)
    # A gap reads the row it names (the interpreter cannot discharge a masked gather) and is
    # zeroed for the columns (`_zeroed`).
    return x_ref[index, pl.ds(j * block, block)].astype(jnp.float32), real, index


def _zeroed(sl, gathered: tuple[Array, Array, Array]) -> Array:
    """The columns' values of `_gather`'s rows: zeros in the gaps."""
    x, real, _ = gathered
    return jnp.where(real[:, None], x, 0.0)


def _quantize_kernel(rows_ref, x_ref, qt_ref, st_ref, *, block: int, tuning: ColumnTuning, **rule):
    load = functools.partial(_gather, rows_ref, x_ref, pl.program_id(1), block)
    quantize_tile(load, block, tuning, rule, columns=(qt_ref, st_ref), to_columns=_zeroed)


def _requantize_kernel(
    rows_ref, data_ref, s_ref, qt_ref, st_ref, *, block: int, tuning: ColumnTuning, **rule
):
    j = pl.program_id(1)

    def load(sl):  # the gathered rows' values, zeros in the gaps
        data, real, index = _gather(rows_ref, data_ref, j, block, sl)
        scale_inv = s_ref[j, index]  # each row's scale of its 1 x block tile in chunk j
        return jnp.where(real[:, None], data * scale_inv[:, None], 0.0)

    quantize_tile(load, block, tuning, rule, columns=(qt_ref, st_ref))


def _both_kernel(
    rows_ref,
    x_ref,
    q_ref,
    s_ref,
    amax_ref,
    qt_ref,
    st_ref,
    *,
    block: int,
    tuning: ColumnTuning,
    **rule,
):
    j = pl.program_id(1)

    # The rows copy of every row gathered, a gap's named row too, so that the programs
    # write every row of `x` (and their amaxes cover it); a row gathered twice gets the same
    # values twice (the interpreter cannot discharge a masked scatter either).
    def rows(sl, gathered):
        x, _, index = gathered
        q, scale_inv, amax = row_tiles(x, q_ref.dtype, rule)
        q_ref[index, pl.ds(j * block, block)] = q
        s_ref[j, index] = scale_inv
        return amax

    load = functools.partial(_gather, rows_ref, x_ref, j, block)
    columns = (qt_ref, st_ref)
    quantize_tile(
        load, block, tuning, rule, rows=(rows, amax_ref), columns=columns, to_columns=_zeroed
    )


def _whole(a: Array) -> pl.BlockSpec:
    """`a` as one block: the kernels index it themselves (the gather)."""
    return pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)


_STATIC = ("fmt", "rows_too", "block", "max_scale", "power_of_two", "interpret", "tuning")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _quantize(x, rows, *, fmt, rows_too, block, max_scale, power_of_two, interpret, tuning):
    (padded,), (m, k) = rows.shape, x.shape
    rule = tile_rule(fmt, max_scale, power_of_two, interpret)
    shapes, specs = column_outputs(block, padded, k, fmt, x)
    body, name = _quantize_kernel, QUANTIZE_PADDED_NAME
    if rows_too:  # quantize_rows' outputs first: the rows copy and its scales whole
        body, name = _both_kernel, BOTH_PADDED_NAME
        rows_copy = [shape_like((m, k), fmt, x), shape_like((k // block, m), jnp.float32, x)]
        amaxes = shape_like((padded // block, k // block), jnp.float32, x)
        shapes = [*rows_copy, amaxes, *shapes]
        specs = [*map(_whole, rows_copy), pl.BlockSpec((1, 1), lambda i, j: (i, j)), *specs]
    kernel = functools.partial(body, block=block, tuning=tuning, **rule)
    in_specs = [pl.BlockSpec((block,), lambda i, j: (i,)), _whole(x)]
    grid = (padded // block, k // block)
    call = triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, tuning.num_warps)
    return tuple(call(rows, x))


def _gathered(x, rows, fmt, rows_too, block, max_scale, power_of_two, interpret, tuning):
    """`_quantize` of checked operands."""
    name = BOTH_PADDED_NAME if rows_too else QUANTIZE_PADDED_NAME
    interpret = _interpret(x, rows, block, name, interpret)
    tuning = check_tuning(tuning, name, block)
    return _quantize(
        x,
        rows.astype(jnp.int32),
        fmt=check_format(fmt, name),
        rows_too=rows_too,
        block=block,
        max_scale=max_scale,
        power_of_two=power_of_two,
        interpret=interpret,
        tuning=tuning,
    )


@functools.partial(
    jax.jit, static_argnames=("block", "max_scale", "power_of_two", "interpret", "tuning")
)
def _requantize(data, scale_inv_t, rows, *, block, max_scale, power_of_two, interpret, tuning):
    (padded,), k = rows.shape, data.shape[1]
    rule = tile_rule(data.dtype, max_scale, power_of_two, interpret)
    kernel = functools.partial(_requantize_kernel, block=block, tuning=tuning, **rule)
    shapes, specs = column_outputs(block, padded, k, data.dtype, data)
    in_specs = [pl.BlockSpec((block,), lambda i, j: (i,)), _whole(data), _whole(scale_inv_t)]
    grid = (padded // block, k // block)
    name, warps = REQUANTIZE_PADDED_NAME, tuning.num_warps
    call = triton_call(kernel, shapes, specs, in_specs, grid, interpret, name, warps)
    return tuple(call(rows, data, scale_inv_t))


def _interpret(x: Array, rows: Array, block: int, name: str, interpret: bool | None) -> bool:
    """Check the operands of kernel `name`; whether it runs interpreted (`None`: as traced)."""
    if pltriton is None:  # pragma: no cover - a future JAX
        raise RuntimeError(
            f"{name}: jax {jax.__version__} has no Pallas Triton backend, which this kernel "
            "is written in; the recipes keep the XLA path there."
        )
    check_block(block, name)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(
            f"{name}: rows has shape {rows.shape} and dtype {rows.dtype}; a 1-D integer row "
            "map (the row each padded row holds, negative for zeros) is expected."
        )
    if not fits(x.shape, rows.shape[0], block):
        raise ValueError(
            f"{name}: {x.shape[0] if x.ndim else 0} rows gathered into {rows.shape[0]} of "
            f"shape {x.shape}: the kernel takes a 2-D operand with rows and a multiple of "
            f"{block} columns, gathered into a multiple of {block} rows (the recipes keep the "
            "XLA path for others)."
        )
    return interpreting() if interpret is None else interpret


def quantize_padded_columns(
    x: Float[Array, "M K"],
    rows: Int[Array, " P"],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = OTHER_TUNING,
) -> tuple[Array, Float[Array, "P/block K"]]:
    """`x`'s rows gathered by `rows` (zeros where negative) in `block` x 1 tiles along them,
    transposed: FP8 `data_t (K, P)` and chunk-major `scale_inv (P / block, K)`, from one
    read of `x`. Scales as `BlockwiseScaling.block_scale` (at most `max_scale`). `tuning`: a
    `block_quantize.ColumnTuning` (the GPU check's sweep)."""
    return _gathered(x, rows, fmt, False, block, max_scale, power_of_two, interpret, tuning)


def requantize_padded_columns(
    data: Array,
    scale_inv_t: Float[Array, "K/block M"],
    rows: Int[Array, " P"],
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = OTHER_TUNING,
) -> tuple[Array, Float[Array, "P/block K"]]:
    """FP8 `data (M, K)` in 1 x `block` tiles (`scale_inv_t` chunk-major), its rows gathered
    by `rows` (zeros where negative) and requantized into `block` x 1 tiles along them,
    transposed: `data_t (K, P)` in `data`'s FP8 type and chunk-major `scale_inv (P / block,
    K)`. `tuning`: a `block_quantize.ColumnTuning` (the GPU check's sweep)."""
    interpret = _interpret(data, rows, block, REQUANTIZE_PADDED_NAME, interpret)
    check_format(data.dtype, REQUANTIZE_PADDED_NAME)
    tuning = check_tuning(tuning, REQUANTIZE_PADDED_NAME, block)
    want = (data.shape[1] // block, data.shape[0])
    if scale_inv_t.shape != want:
        raise ValueError(
            f"requantize_padded_columns: scale_inv_t has shape {scale_inv_t.shape}; data "
            f"{data.shape} in 1 x {block} tiles takes {want} (chunk-major)."
        )
    return _requantize(
        data,
        scale_inv_t.astype(jnp.float32),
        rows.astype(jnp.int32),
        block=block,
        max_scale=max_scale,
        power_of_two=power_of_two,
        interpret=interpret,
        tuning=tuning,
    )


def quantize_rows_and_padded_columns(
    x: Float[Array, "M K"],
    rows: Int[Array, " P"],
    fmt: jnp.dtype,
    *,
    block: int = 128,
    max_scale: float,
    power_of_two: bool = False,
    interpret: bool | None = None,
    tuning: ColumnTuning = DEFAULT_TUNING,
) -> tuple[Array, Array, Array, Array, Array]:
    """`block_quantize.quantize_rows(x)`'s three outputs (FP8 `data (M, K)`, chunk-major
    `scale_inv_t (K / block, M)`, one amax per program, here `(P / block, K / block)`) and
    `quantize_padded_columns(x, rows)`'s two, from one read of `x`. `rows` must name every
    row of `x`, held or (negative, `-1 - r`) a gap's: rows it does not name are left
    unwritten in the first two outputs (`gemm/grouped_native.gather_map` names them all).
    `tuning`: a `block_quantize.ColumnTuning` (the GPU check's sweep; by default the
    rows-and-columns kernel's, which it resembles: 4 warps, measured there in GPU run 6)."""
    return _gathered(x, rows, fmt, True, block, max_scale, power_of_two, interpret, tuning)


# --- reference: the gathered copy, then block_quantize's math in plain XLA -----------------


def gather_rows(x: Array, rows: Int[Array, " P"]) -> Array:
    """`x[rows]` with a row of zeros where `rows` is -1 (the padded layout's copy)."""
    if x.shape[0] == 0:
        return jnp.zeros((rows.shape[0], *x.shape[1:]), x.dtype)
    real = (rows >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(real, x[jnp.maximum(rows, 0)], jnp.zeros((), x.dtype))


def reference_padded_columns(x, rows, fmt, *, block=128, max_scale, power_of_two=False):
    """`quantize_padded_columns` in plain XLA: `reference_columns` of the gathered copy."""
    return reference_columns(
        gather_rows(x, rows), fmt, block=block, max_scale=max_scale, power_of_two=power_of_two
    )

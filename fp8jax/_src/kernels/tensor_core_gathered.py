"""An expert layer's wgrad tiles, gathered into the padded layout, on Hopper's TMA and tensor
cores (Pallas Mosaic GPU): `padded_quantize.quantize_padded_columns` (the output gradient)
and `requantize_padded_columns` (the saved FP8 activation) by another route.

The wgrad of a grouped GEMM contracts each expert's tokens in 128 x 1 tiles that must not mix
experts: the expert-sorted rows spread so that each expert starts on a multiple of 128
(`gemm/grouped_native.pad_layout`). A padded tile of 128 rows holds a run of consecutive rows
of `x` (its expert's), then zeros: `padded_tiles(rows)` reads each tile's first row and row
count off the layout's row map. Each program walks its padded tiles (and their 128-column
chunks) with two TMA loads in flight: a tile's rows come from `x` at any row, into a shared
buffer without the swizzled tiling (Mosaic GPU proves a tiled copy's start a multiple of 8
rows, which an expert's first row is not: `benchmarks/RESULTS.md`, session 53), are masked
past the tile's rows in registers, stored into a tiled buffer and transposed with one BF16
`wgmma` against the identity (`I . x^T`, exact, as `tensor_core_blocks`' columns), each row
of the result (a column of the tile) cast at its own scale, stored by TMA. Rows past `x`'s
end read zeros (TMA's out-of-bounds fill). The same values as the Triton kernel for finite
operands (a -0 may come out +0); a NaN or an inf makes its row of the transposed tile NaN
in every column (`0 * NaN` in the tensor cores), as in `tensor_core_blocks`.

The saved activation's requantization (`tensor_core_requantize_padded_columns`) loads its FP8
tile the same way, with the 128 scales of its rows (from any column of the chunk-major
scales: TMA again), converts it to float16 (exact for both FP8 formats; Hopper converts FP8
to float16 in one instruction, to BF16 through float32), transposes it in float16 and
multiplies each column by its row's scale (zero past the tile's rows): the Triton kernel's
float32 products, then the same cast.

The recipes call it inside `choice.tensor_core_quantization()` only, until a GPU run has
timed it (issue 39).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from ..core import mosaic_private
from ..core.jax_private import shape_like
from . import (
    TENSOR_CORE_BOTH_PADDED_NAME,
    TENSOR_CORE_PADDED_NAME,
    TENSOR_CORE_REQUANTIZE_PADDED_NAME,
)
from .block_gemm import operand_tiling
from .quantize_tiles import bits_max, nan_max, saturating_cast, tile_rule
from .tensor_core_blocks import row_scales
from .tensor_core_tiles import (
    BLOCK,
    Tile,
    TransposeConfig,
    checked,
    fp8_buffers,
    store,
    tile_at,
    tiles_per_program,
    transposed,
)


def padded_tiles(rows: Int[Array, " P"]) -> tuple[Int[Array, " P/128"], Int[Array, " P/128"]]:
    """Each 128-row padded tile's first row of `x` and its rows held, from a row map as
    `gemm/grouped_native.gather_map` writes it (the rows a tile holds are consecutive rows
    of `x` from its first position, gaps after them: an expert's; expert-sorted rows from
    row 0). A tile holding none (past the experts' tiles) starts 128 rows after the one
    before it, the first where the experts' rows end: their windows of 128 rows cover the
    rows past the experts' (the padded layout has a tile of gaps for each 128 of them), which
    `tensor_core_quantize_rows_and_padded_columns` writes the rows copy of."""
    tiles = jnp.reshape(rows, (-1, BLOCK))
    count = jnp.sum(tiles >= 0, axis=1, dtype=jnp.int32)
    empty = count == 0
    past = jnp.sum(count) + BLOCK * (jnp.cumsum(empty, dtype=jnp.int32) - 1)
    return jnp.where(empty, past, tiles[:, 0]).astype(jnp.int32), count


def tensor_core_quantize_padded_columns(
    x: Float[Array, "M K"],
    start: Int[Array, " T"],
    count: Int[Array, " T"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Float[Array, "T K"]]:
    """`padded_quantize.quantize_padded_columns(x, rows)` on TMA and the tensor cores: padded
    tile `t` holds rows `start[t] ... start[t] + count[t] - 1` of `x (M, K)` (BF16 or
    float16, `K` a multiple of 128, `M` at least 128), then zeros (`padded_tiles(rows)`), in
    128 x 1 tiles along the padded rows, written transposed: FP8 `data_t (K, 128 T)` and
    chunk-major `scale_inv (T, K)`. Scales as `BlockwiseScaling.block_scale` (at most
    `max_scale`; `block` must be 128). `config`: a `TransposeConfig` (its `max_programs`;
    two tiles in flight, by hand); `interpret`: run in Mosaic GPU's interpreter (`None`: as
    traced)."""
    rule = dict(max_scale=max_scale, power_of_two=power_of_two, config=config)
    return _gradient(TENSOR_CORE_PADDED_NAME, x, start, count, fmt, block, rule, interpret)


def tensor_core_requantize_padded_columns(
    data: Array,
    scale_inv_t: Float[Array, "K/128 M"],
    start: Int[Array, " T"],
    count: Int[Array, " T"],
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Float[Array, "T K"]]:
    """`padded_quantize.requantize_padded_columns(data, scale_inv_t, rows)` on TMA and the
    tensor cores: FP8 `data (M, K)` in 1 x 128 tiles (chunk-major `scale_inv_t (K / 128,
    M)`, as `quantize_rows` writes it; `M` a multiple of 4, at least 128: TMA's 16-byte
    strides), padded tile `t` holding rows `start[t] ... start[t] + count[t] - 1` of it
    (`padded_tiles(rows)`), dequantized and quantized again in 128 x 1 tiles along the padded
    rows, written transposed: `data_t (K, 128 T)` in `data`'s FP8 format and chunk-major
    `scale_inv (T, K)`. Scales, `config` and `interpret` as
    `tensor_core_quantize_padded_columns`'."""
    who = TENSOR_CORE_REQUANTIZE_PADDED_NAME
    _check_tiles(who, block, start, count)
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
    config, interpret = checked(who, data, data.dtype, config, fp8, interpret, any_rows=True)
    (m, k) = data.shape
    if scale_inv_t.shape != (k // BLOCK, m) or m % 4:
        raise ValueError(
            f"{who}: data {data.shape} with scale_inv_t {scale_inv_t.shape}; expected "
            f"scale_inv_t of shape {(k // BLOCK, m)} (chunk-major) and a multiple of 4 rows "
            "(TMA reads the scales in rows of a multiple of 16 bytes)."
        )
    _check_loads(who)
    return _padded(
        data,
        start.astype(jnp.int32),
        count.astype(jnp.int32),
        scale_inv_t.astype(jnp.float32),
        rows_too=False,
        fmt=jnp.dtype(data.dtype),
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )


def tensor_core_quantize_rows_and_padded_columns(
    x: Float[Array, "M K"],
    start: Int[Array, " T"],
    count: Int[Array, " T"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Float[Array, "K/128 M"], Array, Array, Float[Array, "T K"]]:
    """`padded_quantize.quantize_rows_and_padded_columns` on TMA and the tensor cores: an
    expert layer's output gradient's two copies from one read of `x` (`M` a multiple of 4:
    TMA's 16-byte strides of the scales). `tensor_core_quantize_rows`' three outputs (FP8
    `data (M, K)` in 1 x 128 tiles, chunk-major `scale_inv_t (K / 128, M)`, a row of amaxes
    per program whose maximum is `max |x|`), then `tensor_core_quantize_padded_columns`' two.
    Each padded tile writes the rows copy of the 128 rows from its first (unmasked: a row of
    another expert, or past the experts', gets the values its own tile writes, the same
    bytes), so the tiles' windows must cover every row of `x`: `padded_tiles` of a
    `gather_map` row map's do. Arguments as `tensor_core_quantize_padded_columns`'."""
    rule = dict(max_scale=max_scale, power_of_two=power_of_two, config=config)
    return _gradient(TENSOR_CORE_BOTH_PADDED_NAME, x, start, count, fmt, block, rule, interpret)


def _gradient(who, x, start, count, fmt, block, rule, interpret) -> tuple:
    """Kernel `who` of a 16-bit output gradient `x`, its operands checked: its gathered
    columns, after its rows copy where `who` is the one-read kernel's."""
    rows_too = who == TENSOR_CORE_BOTH_PADDED_NAME
    _check_tiles(who, block, start, count)
    sixteen = (jnp.bfloat16, jnp.float16)
    config, interpret = checked(who, x, fmt, rule["config"], sixteen, interpret, any_rows=True)
    if rows_too and x.shape[0] % 4:
        raise ValueError(
            f"{who}: x has shape {x.shape}; expected a multiple of 4 rows (TMA writes the "
            "rows' scales in rows of a multiple of 16 bytes)."
        )
    _check_loads(who)
    return _padded(
        x,
        start.astype(jnp.int32),
        count.astype(jnp.int32),
        None,
        rows_too=rows_too,
        fmt=jnp.dtype(fmt),
        max_scale=float(rule["max_scale"]),
        power_of_two=bool(rule["power_of_two"]),
        config=config,
        interpret=interpret,
    )


def _check_tiles(who: str, block: int, start: Array, count: Array) -> None:
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    if start.ndim != 1 or start.shape != count.shape or not start.shape[0]:
        raise ValueError(
            f"{who}: start {start.shape} and count {count.shape}; expected one first row "
            "and one row count per padded tile, at least one tile."
        )


def _check_loads(who: str) -> None:
    if not mosaic_private.untiled_wgmma_loads():
        raise NotImplementedError(
            f"{who}: jax {jax.__version__}'s Mosaic GPU cannot load a tile read from any row "
            "(untiled) into the wgmma register layout (JAX 0.11 and later can)."
        )


@functools.partial(
    jax.jit,
    static_argnames=("rows_too", "fmt", "max_scale", "power_of_two", "config", "interpret"),
)
def _padded(x, start, count, scale_t, *, rows_too, fmt, max_scale, power_of_two, config, interpret):
    """The gathered columns of 16-bit `x` (`rows_too`: after the rows copy of each tile's
    128 rows, and each program's row amaxes), or (`scale_t` given) of FP8 `x` dequantized at
    `scale_t`, transposed in `x`'s 16-bit type (float16 for FP8)."""
    (m, k), requantize = x.shape, scale_t is not None
    sixteen = jnp.dtype(jnp.float16 if requantize else x.dtype)
    padded, col_tiles = start.shape[0], k // BLOCK
    tiles = padded * col_tiles
    per = tiles_per_program(config, tiles)
    rule = tile_rule(fmt, max_scale, power_of_two, interpret, mosaic=True)
    layout = None if interpret else plgpu.Layout.WGMMA
    per_column = None if interpret else plgpu.Layout.WGMMA.reduce(0)
    per_row = None if interpret else plgpu.Layout.WGMMA.reduce(1)
    operands = (x, start, count) + ((scale_t,) if requantize else ())
    out_type = [shape_like((k, padded * BLOCK), fmt, x), shape_like((padded, k), jnp.float32, x)]
    scratch_types = [
        plgpu.SMEM((2, BLOCK, BLOCK), x.dtype),  # untiled: loaded from any row
        plgpu.SMEM((2, 1, BLOCK) if requantize else (1,), jnp.float32),  # its scales
        plgpu.Barrier(num_arrivals=1 + requantize, num_barriers=2),
        plgpu.SMEM((BLOCK, BLOCK), sixteen, transforms=operand_tiling(sixteen, BLOCK)),
        plgpu.SMEM((BLOCK, BLOCK), sixteen, transforms=operand_tiling(sixteen, BLOCK)),  # I
        plgpu.Barrier(num_arrivals=1),
        fp8_buffers(fmt)[0],  # one copy
        plgpu.SMEM((2, BLOCK), jnp.float32),
    ]
    if rows_too:  # the rows copy, its chunk-major scales, each program's row amaxes
        rows_out = [shape_like((m, k), fmt, x), shape_like((col_tiles, m), jnp.float32, x)]
        out_type = [*rows_out, shape_like((tiles // per, BLOCK), jnp.float32, x), *out_type]
        scratch_types += [
            plgpu.SMEM((2, BLOCK, BLOCK), fmt),  # untiled: stored at any row
            plgpu.SMEM((2, 1, BLOCK), jnp.float32),
            plgpu.SMEM((BLOCK,), jnp.float32),
        ]
    stores = 4 if rows_too else 2  # TMA stores a tile

    def held(shape, held_layout, rows):  # whether each row (dimension 0) is a tile's row
        iota = lax.broadcasted_iota(jnp.int32, shape, 0)
        if held_layout is not None:
            iota = plgpu.layout_cast(iota, held_layout)
        return iota < rows

    def body(*refs):
        x_gmem, start_gmem, count_gmem = refs[:3]
        s_gmem = refs[3] if requantize else None
        eye_gmem, *outs = refs[len(operands) : len(operands) + 1 + len(out_type)]
        qt_gmem, st_gmem = outs[-2:]
        scratch = refs[len(operands) + 1 + len(out_type) :]
        raw, s_raw, loaded, tiled, eye_smem, eye_loaded, q_smem, s_smem = scratch[:8]
        plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, eye_loaded)
        p = lax.axis_index("p")
        first = p * per
        rq_smem, rs_smem, amax_smem = scratch[8:] if rows_too else (None,) * 3

        def fetch(t, slot):  # tile t's rows, from its first row of x, untiled; its scales
            at, c = pl.multiple_of(start_gmem[t // col_tiles], 1), t % col_tiles
            src = x_gmem.at[pl.ds(at, BLOCK), pl.ds(c * BLOCK, BLOCK)]
            plgpu.copy_gmem_to_smem(src, raw.at[slot], loaded.at[slot])
            if requantize:
                src = s_gmem.at[pl.ds(c, 1), pl.ds(at, BLOCK)]
                plgpu.copy_gmem_to_smem(src, s_raw.at[slot], loaded.at[slot])

        def rows_copy(xv, at, c, slot) -> Array:  # the window's 1 x 128 tiles; their amaxes
            amax = nan_max(jnp.abs(xv), axis=1)
            scale, scale_inv = row_scales(amax, rule)
            rq_smem.at[slot][...] = saturating_cast(xv, scale, fmt)
            rs_smem.at[slot, 0][...] = scale_inv
            plgpu.commit_smem()
            data_gmem, scales_gmem = outs[0], outs[1]
            window = data_gmem.at[pl.ds(at, BLOCK), pl.ds(c * BLOCK, BLOCK)]
            plgpu.copy_smem_to_gmem(rq_smem.at[slot], window)
            plgpu.copy_smem_to_gmem(rs_smem.at[slot], scales_gmem.at[pl.ds(c, 1), pl.ds(at, BLOCK)])
            return amax

        fetch(first, 0)
        plgpu.barrier_wait(eye_loaded)

        def tile(j, amax):  # tile first + j; the amaxes so far (`rows_too`)
            t, slot = first + j, lax.rem(j, 2)

            @pl.when(j + 1 < per)
            def _():
                fetch(t + 1, 1 - slot)

            plgpu.barrier_wait(loaded.at[slot])
            pt, c = t // col_tiles, t % col_tiles
            rows = count_gmem[pt]
            # FP8 to float16 directly (to float32 and back otherwise: Mosaic GPU's).
            xv = mosaic_private.load(raw.at[slot], layout=layout)
            xv = xv.astype(sixteen if requantize else jnp.float32)
            mask = held((BLOCK, BLOCK), layout, rows)
            tiled[...] = jnp.where(mask, xv, 0.0).astype(sixteen)
            plgpu.commit_smem()
            xt = transposed(eye_smem, tiled)  # the tile's columns, as rows
            if requantize:  # each column times its row's scale_inv, zero past the rows
                s = mosaic_private.load(s_raw.at[slot, 0], layout=per_column)
                s = jnp.where(held((BLOCK,), per_column, rows), s, 0.0)
                xt = xt * lax.broadcast_in_dim(s, (BLOCK, BLOCK), (1,))
            scale, scale_inv = row_scales(nan_max(jnp.abs(xt), axis=1), rule)
            # The stores of two tiles ago have read their buffers.
            plgpu.wait_smem_to_gmem(stores, wait_read_only=True)
            where = Tile(slot, pt, c, 0, pt, col_tiles)
            store(saturating_cast(xt, scale, fmt), q_smem, where, tile_at(qt_gmem, c, pt))
            store(scale_inv, s_smem, where, st_gmem.at[pt, pl.ds(c * BLOCK, BLOCK)])
            if rows_too:  # x's tile again, from shared memory (fewer registers live)
                xv = mosaic_private.load(raw.at[slot], layout=layout).astype(jnp.float32)
                amax = bits_max(amax, rows_copy(xv, pl.multiple_of(start_gmem[pt], 1), c, slot))
            return amax

        if rows_too:
            init = jnp.zeros((BLOCK,), jnp.float32)
            init = init if per_row is None else plgpu.layout_cast(init, per_row)
            amax_smem[...] = pl.loop(0, per, init_carry=init)(tile)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(amax_smem, outs[2].at[p])
        else:
            pl.loop(0, per)(lambda j: tile(j, None))
        plgpu.wait_smem_to_gmem(0)

    names = {
        (False, False): TENSOR_CORE_PADDED_NAME,
        (False, True): TENSOR_CORE_REQUANTIZE_PADDED_NAME,
        (True, False): TENSOR_CORE_BOTH_PADDED_NAME,
    }
    body.__name__ = body.__qualname__ = names[rows_too, requantize]
    return plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch_types,
        grid=(tiles // per,),
        grid_names=("p",),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(*operands, jnp.asarray(np.eye(BLOCK), sixteen))

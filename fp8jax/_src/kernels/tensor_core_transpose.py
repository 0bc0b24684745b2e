"""FP8 quantization in one pass on Hopper's TMA and tensor cores (Pallas Mosaic GPU): an
operand's FP8 copy and its transposed copy from one read, per tensor and in DeepSeek-V3's
blockwise tiles.

- `tensor_core_cast_transpose(x, scale, fmt)` returns what `cast_transpose.cast_transpose`
  returns (the saturating cast of `x * scale`, the same FP8 values transposed, and partial
  amaxes whose maximum is `max |x|`).
- `tensor_core_quantize_rows_and_columns(x, fmt, ...)` returns what
  `block_quantize.quantize_rows_and_columns` returns: `x`'s 1 x 128 tiles along its rows and
  its 128 x 1 tiles along its columns, transposed, each tile at its own scale.
- `tensor_core_quantize_blocks(w, fmt, ...)` returns what `block_quantize.quantize_blocks`
  returns: a weight's 128 x 128 blocks, each at its own scale, and the same values
  transposed.

The Pallas Triton kernels and XLA's transposing fusions move their tiles between threads
through shared memory one byte at a time (`benchmarks/quantize_ptx.py`), and ran at 0.6-2.5
TB/s on an H200 (GPU run 6: about half of HBM's rate at best). Here each program streams
`x`'s 128 x 128 tiles by TMA through a pipeline (`_stream`), casts a tile in registers,
writes it to shared memory (whence TMA stores it), and transposes with one `wgmma` against
the identity, which the tensor cores compute exactly (products with 1 and 0, summed in
float32): per tensor and for a weight's blocks (one scale a tile) `I . q^T`, the FP8 tile
read K-major as any `wgmma` operand, cast back to the same FP8 values; for 1 x 128 and
128 x 1 tiles `I . x^T`, the BF16 (or float16) tile, whose rows are `x`'s columns: their
amaxes are row reductions, as the rows' are, and they are cast at their own scales. Stores
by TMA from double-buffered shared memory overlap the next tile's load. Blockwise scales are
divided exactly rounded (`div.rn.f32`, through `mosaic_private.ieee_divide`: Mosaic GPU's
`/` is `div.full.f32`), as the Triton kernels' and the XLA path's on a CPU.

Differences from the other routes, none for finite operands but signed zeros: a -0 in the
transposed copy may come out +0 (`-0 + 0` in the tensor cores; equal values). Where `x`
has a NaN or an infinity, `0 * NaN` and `0 * inf` in the tensor cores make the whole row of
the transposed tile that holds it NaN (per tensor and a weight's blocks), or, in 128 x 1
tiles, every column of its 128 x 128 tile NaN in that row and cast at scale 1 (their amaxes
NaN); the amax is NaN either way, a step whose gradients the train step's finite check
rejects.

Their knobs (`TransposeConfig`) are for the GPU check's `transpose` section; the recipes
call them inside `per_tensor_pass.cast_transpose_kernel(on_tensor_cores=True)` and
`choice.tensor_core_quantization()` only, until a GPU run has timed them (issues 38, 39).
In Mosaic GPU's interpreter they run the GPU's own code from JAX 0.11 on (`wgmma` on a
transposed view); JAX 0.10's refuses.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from ..core import mosaic_private
from ..core.jax_private import shape_like
from . import (
    TENSOR_CORE_BLOCKS_NAME,
    TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
    TENSOR_CORE_TRANSPOSE_NAME,
)
from .block_gemm import operand_tiling
from .dispatch import interpreting
from .persistent_config import H100_SMEM_BYTES, SMEM_RESERVE
from .quantize_tiles import bits_max, nan_max, saturating_cast, tile_rule, tile_scales

#: The tile: 128 x 128, `wgmma`'s K step times four and the TMA box of one program's step.
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class TransposeConfig:
    """`max_programs`: programs at most (one an SM at a time: their shared memory), each
    walking an equal run of consecutive tiles (row-major over `x`'s tiles; the fewest
    programs up to it that divide the tiles evenly, so one wave on an H100's 132 SMs);
    `max_concurrent_steps`: tiles of `x` in flight in the TMA pipeline (32 KB a BF16 tile;
    clipped to what shared memory holds)."""

    max_programs: int = 132
    max_concurrent_steps: int = 3

    def __post_init__(self):
        for name in ("max_programs", "max_concurrent_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransposeConfig: {name}={value!r}; expected an int >= 1.")
        if self.max_concurrent_steps > 4:
            raise ValueError(
                f"TransposeConfig: max_concurrent_steps={self.max_concurrent_steps!r}; "
                "expected at most 4 (shared memory)."
            )


def tiles_per_program(config: TransposeConfig, tiles: int) -> int:
    """The fewest tiles a program walks such that they divide `tiles` and the programs
    number at most `config.max_programs`."""
    return next(d for d in range(-(-tiles // config.max_programs), tiles + 1) if tiles % d == 0)


#: What the kernels' shared memory holds besides `x`'s stages and the identity: two buffers
#: each of the FP8 copies (16 KB a tile), the amax row and four rows of scales, the barriers'
#: reserve.
_FIXED_BYTES = 4 * BLOCK * BLOCK + 5 * BLOCK * 4 + SMEM_RESERVE


def stages(config: TransposeConfig, dtype: jnp.dtype, eye_dtype: jnp.dtype) -> int:
    """`config.max_concurrent_steps`, clipped to the tiles of `dtype` shared memory holds
    beside an identity of `eye_dtype` (a float32 operand: 2)."""
    fixed = _FIXED_BYTES + BLOCK * BLOCK * jnp.dtype(eye_dtype).itemsize
    fit = (H100_SMEM_BYTES - fixed) // (BLOCK * BLOCK * jnp.dtype(dtype).itemsize)
    return max(1, min(config.max_concurrent_steps, fit))


class _Tile(NamedTuple):
    """Where a program's current tile lies: its output buffers' `slot`, its tile row `i`
    and column `col` in the flattened `(B * M, K)`, its batch `b` and tile row `local` in
    that batch, and `row_tiles` (`K / 128`)."""

    slot: Array
    i: Array
    col: Array
    b: Array
    local: Array
    row_tiles: int

    def transposed(self) -> Array:
        """The tile row of the tile's transposed copy in `(B * K, M)`."""
        return self.b * self.row_tiles + self.col


def _stream(x, eye, inputs, *, name, out_type, scratch_types, tile_step, batch, config, interpret):
    """The kernels' common frame: programs over `x`'s 128 x 128 tiles in a TMA pipeline, the
    identity `eye` in shared memory, and as the last output each program's row amaxes (NaN
    above inf). `tile_step(ins, outs, scratch, eye_smem)` returns `(step, stores)`: `step(tile,
    x_smem, xv)` (`xv` the tile in float32, in `wgmma`'s register layout) writes a tile's
    outputs in `stores` TMA copies from double-buffered shared memory and returns its row
    amaxes."""
    rows, k = x.shape
    m = rows // batch
    row_tiles, tiles_per_batch = k // BLOCK, m // BLOCK
    tiles = (rows // BLOCK) * row_tiles
    per = tiles_per_program(config, tiles)
    layout = None if interpret else plgpu.Layout.WGMMA

    def body(x_gmem, eye_gmem, *refs):
        ins, outs = refs[: len(inputs)], refs[len(inputs) : len(inputs) + len(out_type)]
        eye_smem, amax_smem, barrier, *scratch = refs[len(inputs) + len(out_type) + 1 :]
        amax_gmem = refs[len(inputs) + len(out_type)]
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, barrier)
        plgpu.barrier_wait(barrier)
        step_tile, stores = tile_step(ins, outs, scratch, eye_smem)

        def step(indices, x_smem, amax):
            (j,) = indices
            i, col = (p * per + j) // row_tiles, (p * per + j) % row_tiles
            b, local = i // tiles_per_batch, i % tiles_per_batch
            where = _Tile(lax.rem(j, 2), i, col, b, local, row_tiles)
            # The stores of two tiles ago have read their buffers.
            plgpu.wait_smem_to_gmem(stores, wait_read_only=True)
            xv = mosaic_private.load(x_smem, layout=layout).astype(jnp.float32)
            return bits_max(amax, step_tile(where, x_smem, xv))

        init = jnp.zeros((BLOCK,), jnp.float32)
        if not interpret:
            init = plgpu.layout_cast(init, plgpu.Layout.WGMMA.reduce(1))
        amax = plgpu.emit_pipeline(
            step,
            grid=(per,),
            in_specs=[
                plgpu.BlockSpec(
                    (BLOCK, BLOCK),
                    lambda j: ((p * per + j) // row_tiles, (p * per + j) % row_tiles),
                    transforms=operand_tiling(x.dtype, BLOCK),
                )
            ],
            max_concurrent_steps=stages(config, x.dtype, eye.dtype),
            init_carry=init,
        )(x_gmem)
        amax_smem[...] = amax
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(amax_smem, amax_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = body.__qualname__ = name
    return plgpu.kernel(
        body,
        out_type=(*out_type, shape_like((tiles // per, BLOCK), jnp.float32, x)),
        scratch_types=[
            plgpu.SMEM((BLOCK, BLOCK), eye.dtype, transforms=operand_tiling(eye.dtype, BLOCK)),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
            *scratch_types,
        ],
        grid=(tiles // per,),
        grid_names=("p",),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(x, eye, *inputs)


def _transposed(eye_smem, tile_smem) -> Array:
    """`tile_smem`'s 128 x 128 tile transposed, in float32 registers: `I . tile^T` on the
    tensor cores (exact: products with 1 and 0, summed in float32)."""

    def product(acc):
        plgpu.wgmma(acc, eye_smem, tile_smem.transpose((1, 0)))
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC((BLOCK, BLOCK), jnp.float32))


def _store(value, buffers, tile: _Tile, dst) -> None:
    """`value` written to its slot of the double-buffered shared `buffers`, thence by TMA
    to `dst` (a view of an output)."""
    buffers.at[tile.slot][...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buffers.at[tile.slot], dst)


def _fp8_buffers(fmt) -> list:
    """Two double-buffered FP8 tiles in shared memory (the copy and its transpose)."""
    tiling = operand_tiling(fmt, BLOCK)
    return [plgpu.SMEM((2, BLOCK, BLOCK), fmt, transforms=tiling) for _ in range(2)]


def _kernel_call(x, scale, *, fmt, batch, config, interpret):
    rows, k = x.shape

    def tile_step(ins, outs, scratch, eye_smem):
        (s_gmem,), (q_gmem, qt_gmem), (q_smem, qt_smem) = ins, outs, scratch
        s = s_gmem[0]

        def step(tile: _Tile, x_smem, xv):
            _store(saturating_cast(xv, s, fmt), q_smem, tile, _at(q_gmem, tile.i, tile.col))
            qt = _transposed(eye_smem, q_smem.at[tile.slot])
            _store(qt.astype(fmt), qt_smem, tile, _at(qt_gmem, tile.transposed(), tile.local))
            return nan_max(jnp.abs(xv), axis=1)  # per row, NaN above inf

        return step, 2

    out_type = (shape_like((rows, k), fmt, x), shape_like((batch * k, rows // batch), fmt, x))
    eye = jnp.asarray(np.eye(BLOCK, dtype=fmt))
    inputs = (jnp.reshape(scale, (1,)).astype(jnp.float32),)
    return _stream(
        x,
        eye,
        inputs,
        name=TENSOR_CORE_TRANSPOSE_NAME,
        out_type=out_type,
        scratch_types=_fp8_buffers(fmt),
        tile_step=tile_step,
        batch=batch,
        config=config,
        interpret=interpret,
    )


def _at(ref, row_tile, col_tile):
    """The 128 x 128 tile of `ref` at (`row_tile`, `col_tile`)."""
    return ref.at[pl.ds(row_tile * BLOCK, BLOCK), pl.ds(col_tile * BLOCK, BLOCK)]


def _everywhere_max(amax: Array) -> Array:
    """`nan_max` of row amaxes (`nan_max`'s results), in every row: one integer maximum of
    their bits, broadcast before it is a float again (Mosaic GPU bitcasts vectors only)."""
    bits = jnp.max(lax.bitcast_convert_type(amax, jnp.int32))
    return lax.bitcast_convert_type(jnp.broadcast_to(bits, amax.shape), jnp.float32)


def _blockwise_call(x, *, blocks, fmt, batch, max_scale, power_of_two, config, interpret):
    """`x`'s 1 x 128 tiles and its 128 x 1 tiles transposed, or (`blocks`) its 128 x 128
    blocks and the same FP8 values transposed, with scales in the layouts the GEMM kernels
    read (`block_quantize`'s)."""
    rows, k = x.shape
    rule = tile_rule(fmt, max_scale, power_of_two, interpret, mosaic=True)

    def scales(amax):
        """(scale broadcast over a tile's rows, scale_inv) of rows of `amax`."""
        scale, scale_inv = tile_scales(amax, **rule)
        return lax.broadcast_in_dim(scale, (BLOCK, BLOCK), (0,)), scale_inv  # JAX 0.10: 2-D

    def tile_step(ins, outs, scratch, eye_smem):
        q_gmem, s_gmem, qt_gmem, st_gmem = outs
        q_smem = scratch[0]

        def write(tile, values, buffers, scale_inv, where, copy):
            """An FP8 tile of copy `copy` (0: `x`'s layout, 1: transposed) written at tile
            `where[copy]`, its rows' `scale_inv` to that copy's chunk-major scales at the
            tile `where[1 - copy]` names (the GEMMs' layout: one row a 128-chunk)."""
            data_smem, scale_smem = buffers[copy], buffers[2 + copy]
            data_gmem, scale_gmem = (q_gmem, s_gmem) if copy == 0 else (qt_gmem, st_gmem)
            _store(values, data_smem, tile, _at(data_gmem, *where[copy]))
            row, col_tile = where[1 - copy]
            dst = scale_gmem.at[row, pl.ds(col_tile * BLOCK, BLOCK)]
            _store(scale_inv, scale_smem, tile, dst)

        def step(tile: _Tile, x_smem, xv):
            where = ((tile.i, tile.col), (tile.transposed(), tile.local))
            amax = nan_max(jnp.abs(xv), axis=1)  # per row, NaN above inf
            if blocks:  # the block's amax for every row; the transpose of its FP8 values
                scale, scale_inv = scales(_everywhere_max(amax))
                write(tile, saturating_cast(xv, scale, fmt), scratch, scale_inv, where, 0)
                qt = _transposed(eye_smem, q_smem.at[tile.slot]).astype(fmt)
                write(tile, qt, scratch, scale_inv, where, 1)
                return amax
            scale, scale_inv = scales(amax)
            write(tile, saturating_cast(xv, scale, fmt), scratch, scale_inv, where, 0)
            # x's columns are the rows of its transpose, on the tensor cores from x's tile.
            xt = _transposed(eye_smem, x_smem)
            scale, scale_inv = scales(nan_max(jnp.abs(xt), axis=1))
            write(tile, saturating_cast(xt, scale, fmt), scratch, scale_inv, where, 1)
            return amax

        return step, 4

    m, f32 = rows // batch, jnp.float32
    out_type = (
        shape_like((rows, k), fmt, x),
        shape_like((batch * k // BLOCK, m), f32, x),
        shape_like((batch * k, m), fmt, x),
        shape_like((rows // BLOCK, k), f32, x),
    )
    scratch = _fp8_buffers(fmt) + [plgpu.SMEM((2, BLOCK), f32) for _ in range(2)]
    name = TENSOR_CORE_BLOCKS_NAME if blocks else TENSOR_CORE_ROWS_AND_COLUMNS_NAME
    eye = jnp.asarray(np.eye(BLOCK), fmt if blocks else x.dtype)
    return _stream(
        x,
        eye,
        (),
        name=name,
        out_type=out_type,
        scratch_types=scratch,
        tile_step=tile_step,
        batch=batch,
        config=config,
        interpret=interpret,
    )


_jitted = jax.jit(_kernel_call, static_argnames=("fmt", "batch", "config", "interpret"))
_blockwise = jax.jit(
    _blockwise_call,
    static_argnames=("blocks", "fmt", "batch", "max_scale", "power_of_two", "config", "interpret"),
)


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
    config, interpret = _checked(TENSOR_CORE_TRANSPOSE_NAME, x, fmt, config, dtypes, interpret)
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


def _checked(who, x, fmt, config, dtypes, interpret) -> tuple[TransposeConfig, bool]:
    """`config` (`None`: the default) and whether to interpret, once `x`, `fmt` and
    `config` are checked for kernel `who`."""
    config = TransposeConfig() if config is None else config
    if not isinstance(config, TransposeConfig):
        raise TypeError(f"{who}: config={config!r}; expected a TransposeConfig or None.")
    if x.ndim not in (2, 3) or x.shape[-1] % BLOCK or x.shape[-2] % BLOCK or 0 in x.shape:
        raise ValueError(
            f"{who}: x has shape {x.shape}; expected (M, K) or (B, M, K) with M and K "
            f"positive multiples of {BLOCK}."
        )
    if jnp.dtype(x.dtype) not in dtypes:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"{who}: x has dtype {x.dtype}; expected one of {names}.")
    if jnp.dtype(fmt) not in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        raise ValueError(f"{who}: fmt={fmt!r}; expected float8_e4m3fn or float8_e5m2.")
    interpret = interpreting() if interpret is None else interpret
    if interpret and not mosaic_private.interpreter_runs_gpu_path():
        raise NotImplementedError(
            f"{who}: jax {jax.__version__}'s Mosaic GPU interpreter cannot run wgmma on a "
            "transposed shared-memory view (JAX 0.11 and later can)."
        )
    return config, interpret


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
    who = TENSOR_CORE_ROWS_AND_COLUMNS_NAME
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    config, interpret = _checked(who, x, fmt, config, (jnp.bfloat16, jnp.float16), interpret)
    batch, (m, k) = (x.shape[0] if x.ndim == 3 else 1), x.shape[-2:]
    data, scale_t, data_t, cols, amaxes = _blockwise(
        jnp.reshape(x, (batch * m, k)),
        blocks=False,
        fmt=jnp.dtype(fmt),
        batch=batch,
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )
    lead = x.shape[:-2]
    shapes = (x.shape, (*lead, k // BLOCK, m), (*lead, k, m), (*lead, m // BLOCK, k))
    data, scale_t, data_t, cols = (
        jnp.reshape(a, s) for a, s in zip((data, scale_t, data_t, cols), shapes, strict=True)
    )
    return data, scale_t, amaxes, data_t, cols


def tensor_core_quantize_blocks(
    w: Float[Array, "N K"],
    fmt: jnp.dtype,
    *,
    block: int = BLOCK,
    max_scale: float,
    power_of_two: bool = False,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "K/128 N"], Float[Array, "N/128 K"], Array]:
    """`block_quantize.quantize_blocks(w)` on TMA and the tensor cores: a weight `w (N, K)`
    (`N`, `K` multiples of 128; a 16- or 32-bit float) in 128 x 128 blocks, FP8 `data` and
    the same values transposed `data_t (K, N)` (`I . q^T`), each block's scale_inv once per
    row it covers (`rows_t (K / 128, N)` for `data`, `cols (N / 128, K)` for `data_t`), and
    partial amaxes whose maximum is `max |w|` (NaN where `w` has a NaN), from one read of
    `w`. Scales as `BlockwiseScaling.block_scale` (at most `max_scale`; `block` must be
    128). `config`: a `TransposeConfig`; `interpret`: run in Mosaic GPU's interpreter
    (`None`: as traced)."""
    who = TENSOR_CORE_BLOCKS_NAME
    if block != BLOCK:
        raise ValueError(f"{who}: block={block!r}; expected {BLOCK} (the kernel's tile).")
    if w.ndim != 2:
        raise ValueError(f"{who}: w has shape {w.shape}; expected a 2-D weight (N, K).")
    dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
    config, interpret = _checked(who, w, fmt, config, dtypes, interpret)
    data, rows_t, data_t, cols, amaxes = _blockwise(
        w,
        blocks=True,
        fmt=jnp.dtype(fmt),
        batch=1,
        max_scale=float(max_scale),
        power_of_two=bool(power_of_two),
        config=config,
        interpret=interpret,
    )
    return data, data_t, rows_t, cols, amaxes

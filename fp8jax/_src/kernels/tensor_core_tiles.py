"""The frame of fp8jax's quantization kernels on Hopper's TMA and tensor cores (Pallas Mosaic
GPU; `tensor_core_transpose`: per tensor, `tensor_core_blocks`: DeepSeek-V3's blockwise
tiles): programs over an operand's 128 x 128 tiles in a TMA pipeline (`stream_tiles`), each
tile's outputs stored by TMA from double-buffered shared memory while the next tile loads
(`store`), and a tile transposed on the tensor cores (`transposed`).

The Pallas Triton kernels and XLA's transposing fusions move their tiles between threads
through shared memory one byte at a time (`benchmarks/quantize_ptx.py`), and ran at 0.6-2.5
TB/s on an H200 (GPU run 6: about half of HBM's rate at best). Here a tile is transposed
with one `wgmma` against the identity, which the tensor cores compute exactly (products with
1 and 0, summed in float32): `I . t^T`, `t` read K-major from shared memory as any `wgmma`
operand. For finite operands the same values; a -0 may come out +0 (`-0 + 0` in the sum),
and a NaN or an inf (`0 * NaN`, `0 * inf`) makes its whole row of the transposed tile NaN.

Their knobs (`TransposeConfig`) are for the GPU check's `transpose` section. In Mosaic GPU's
interpreter the kernels run the GPU's own code from JAX 0.11 on (`wgmma` on a transposed
view); JAX 0.10's refuses (`checked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array

from ..core import mosaic_private
from ..core.jax_private import shape_like
from .block_gemm import operand_tiling
from .dispatch import interpreting
from .persistent_config import H100_SMEM_BYTES, SMEM_RESERVE
from .quantize_tiles import bits_max

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


def tiles_per_program(config: TransposeConfig, tiles: int, batch: int = 1) -> int:
    """The fewest tiles a program walks such that they divide each of `batch` items' `tiles
    / batch` (a program's tiles lie in one item: its amaxes are that item's) and the
    programs number at most `config.max_programs` (or `batch`, if more: one an item)."""
    each, most = tiles // batch, max(config.max_programs, batch)
    return next(d for d in range(-(-tiles // most), each + 1) if each % d == 0)


#: What the kernels' shared memory holds besides `x`'s stages and the identity: two buffers
#: each of the FP8 copies (16 KB a tile), the amax row and four rows of scales, the barriers'
#: reserve.
_FIXED_BYTES = 4 * BLOCK * BLOCK + 5 * BLOCK * 4 + SMEM_RESERVE


def stages(config: TransposeConfig, dtype: jnp.dtype, eye_dtype: jnp.dtype | None) -> int:
    """`config.max_concurrent_steps`, clipped to the tiles of `dtype` shared memory holds
    beside an identity of `eye_dtype` (`None`: none; a float32 operand: 2)."""
    eye = 0 if eye_dtype is None else BLOCK * BLOCK * jnp.dtype(eye_dtype).itemsize
    fixed = _FIXED_BYTES + eye
    fit = (H100_SMEM_BYTES - fixed) // (BLOCK * BLOCK * jnp.dtype(dtype).itemsize)
    return max(1, min(config.max_concurrent_steps, fit))


class Tile(NamedTuple):
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


def stream_tiles(
    x: Array,
    eye: Array | None,
    inputs: tuple[Array, ...],
    *,
    name: str,
    out_type: tuple[jax.ShapeDtypeStruct, ...],
    scratch_types: list,
    tile_step: Callable,
    batch: int,
    config: TransposeConfig,
    interpret: bool,
    side: Array | None = None,
) -> tuple[Array, ...]:
    """The kernels' frame: programs over `x (B * M, K)`'s 128 x 128 tiles in a TMA pipeline,
    the identity `eye` in shared memory (`None`: a kernel that transposes nothing), and as
    the last output each program's row amaxes (NaN above inf; programs in order, each in
    one of the `batch` items: `tiles_per_program`). `tile_step(ins, outs,
    scratch, eye_smem)` returns `(step, stores)`: `step(tile, x_smem, xv, *side_smem)` (`xv`
    the tile in float32, in `wgmma`'s register layout; `None` for an FP8 `x`) writes a
    tile's outputs in `stores` TMA copies from double-buffered shared memory and returns
    its row amaxes. `side`, if given, is a `(B * K / 128, M)` array whose `(1, 128)` slice
    at `(Tile.transposed(), Tile.local)` comes with each tile through the pipeline
    (`side_smem`, one row)."""
    rows, k = x.shape
    m = rows // batch
    row_tiles, tiles_per_batch = k // BLOCK, m // BLOCK
    tiles = (rows // BLOCK) * row_tiles
    per = tiles_per_program(config, tiles, batch)
    layout = None if interpret else plgpu.Layout.WGMMA
    x_tiling = operand_tiling(x.dtype, BLOCK)
    sides, eyes = (() if side is None else (side,)), (() if eye is None else (eye,))

    def body(x_gmem, *refs):
        eye_gmem = refs[0] if eyes else None
        side_gmem = refs[len(eyes)] if sides else None
        refs = refs[len(eyes) + len(sides) :]
        ins, outs = refs[: len(inputs)], refs[len(inputs) : len(inputs) + len(out_type)]
        amax_gmem = refs[len(inputs) + len(out_type)]
        amax_smem, *scratch = refs[len(inputs) + len(out_type) + 1 :]
        eye_smem = None
        if eyes:
            eye_smem, barrier, *scratch = scratch
            plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, barrier)
            plgpu.barrier_wait(barrier)
        p = lax.axis_index("p")
        step_tile, stores = tile_step(ins, outs, scratch, eye_smem)

        def tile_of(j):
            return (p * per + j) // row_tiles, (p * per + j) % row_tiles

        def side_of(j):
            i, col = tile_of(j)
            return (i // tiles_per_batch) * row_tiles + col, i % tiles_per_batch

        def step(indices, x_smem, *rest):
            (j,) = indices
            *side_smem, amax = rest
            i, col = tile_of(j)
            b, local = i // tiles_per_batch, i % tiles_per_batch
            where = Tile(lax.rem(j, 2), i, col, b, local, row_tiles)
            # The stores of two tiles ago have read their buffers.
            plgpu.wait_smem_to_gmem(stores, wait_read_only=True)
            xv = None
            if jnp.dtype(x.dtype).itemsize > 1:
                xv = mosaic_private.load(x_smem, layout=layout).astype(jnp.float32)
            return bits_max(amax, step_tile(where, x_smem, xv, *side_smem))

        in_specs = [plgpu.BlockSpec((BLOCK, BLOCK), tile_of, transforms=x_tiling)]
        if side is not None:
            in_specs.append(plgpu.BlockSpec((1, BLOCK), side_of))

        init = jnp.zeros((BLOCK,), jnp.float32)
        if not interpret:
            init = plgpu.layout_cast(init, plgpu.Layout.WGMMA.reduce(1))
        amax = plgpu.emit_pipeline(
            step,
            grid=(per,),
            in_specs=in_specs,
            max_concurrent_steps=stages(config, x.dtype, None if eye is None else eye.dtype),
            init_carry=init,
        )(x_gmem, *([side_gmem] if sides else []))
        amax_smem[...] = amax
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(amax_smem, amax_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = body.__qualname__ = name
    return plgpu.kernel(
        body,
        out_type=(*out_type, shape_like((tiles // per, BLOCK), jnp.float32, x)),
        scratch_types=[
            plgpu.SMEM((BLOCK,), jnp.float32),
            *[
                t
                for e in eyes
                for t in (
                    plgpu.SMEM((BLOCK, BLOCK), e.dtype, transforms=operand_tiling(e.dtype, BLOCK)),
                    plgpu.Barrier(num_arrivals=1),
                )
            ],
            *scratch_types,
        ],
        grid=(tiles // per,),
        grid_names=("p",),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(x, *eyes, *sides, *inputs)


def transposed(eye_smem, tile_smem) -> Array:
    """`tile_smem`'s 128 x 128 tile transposed, in float32 registers: `I . tile^T` on the
    tensor cores (exact: products with 1 and 0, summed in float32)."""

    def product(acc):
        plgpu.wgmma(acc, eye_smem, tile_smem.transpose((1, 0)))
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC((BLOCK, BLOCK), jnp.float32))


def store(value, buffers, tile: Tile, dst) -> None:
    """`value` written to its slot of the double-buffered shared `buffers`, thence by TMA
    to `dst` (a view of an output)."""
    buffers.at[tile.slot][...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buffers.at[tile.slot], dst)


def fp8_buffers(fmt) -> list:
    """Two double-buffered FP8 tiles in shared memory (the copy and its transpose)."""
    tiling = operand_tiling(fmt, BLOCK)
    return [plgpu.SMEM((2, BLOCK, BLOCK), fmt, transforms=tiling) for _ in range(2)]


def tile_at(ref, row_tile, col_tile):
    """The 128 x 128 tile of `ref` at (`row_tile`, `col_tile`)."""
    return ref.at[pl.ds(row_tile * BLOCK, BLOCK), pl.ds(col_tile * BLOCK, BLOCK)]


def checked(
    who, x, fmt, config, dtypes, interpret, any_rows: bool = False
) -> tuple[TransposeConfig, bool]:
    """`config` (`None`: the default) and whether to interpret, once `x`, `fmt` and
    `config` are checked for kernel `who` (`any_rows`: `x (M, K)` with any `M` of at least
    one tile, whose tiles start at any row)."""
    config = TransposeConfig() if config is None else config
    if not isinstance(config, TransposeConfig):
        raise TypeError(f"{who}: config={config!r}; expected a TransposeConfig or None.")
    if any_rows and (x.ndim != 2 or x.shape[0] < BLOCK or x.shape[1] % BLOCK or not x.shape[1]):
        raise ValueError(
            f"{who}: x has shape {x.shape}; expected (M, K) with M >= {BLOCK} and K a "
            f"positive multiple of {BLOCK}."
        )
    whole = any_rows or not x.shape[-2] % BLOCK
    if x.ndim not in (2, 3) or x.shape[-1] % BLOCK or not whole or 0 in x.shape:
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

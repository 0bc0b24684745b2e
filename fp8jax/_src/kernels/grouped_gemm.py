"""Grouped (mixture-of-experts) FP8 GEMMs for Hopper (sm_90a), in Pallas Mosaic GPU.

Two kernels cover the three GEMMs of an expert layer:

- `grouped_rows_gemm` (forward and dgrad): the rows of `lhs (M, K)`, sorted by expert and
  unpadded, each times its expert's `rhs (N, K)`. One program per item (`RowItems`,
  `row_items`) and column tile: an item is a `tile_m`-row tile and one expert, read from
  global memory (the expert picks the TMA window of `rhs (G, N, K)`), and it writes that
  expert's rows of the tile and no other, by TMA copies of a power of two rows each (JAX's
  `ragged_dot_mgpu` does the same). A tile holding two experts' rows is run once for each.
- `grouped_tokens_gemm` (wgrad): `out[e] = lhs[:, tokens of e] . rhs[:, tokens of e]^T`,
  both operands `(rows, T)` contracted over their tokens, laid out by the caller so that
  each expert's tokens start on a chunk boundary (DeepGEMM's "contiguous layout", zeros
  between; `fp8jax._src.gemm.grouped_native` makes it); expert `e`'s pipeline runs over its
  own `chunk_count[e]` chunks of `block_k` tokens from `chunk_start[e]` (a run-time trip
  count: an expert with no tokens writes zeros).

Work grows with the tokens (plus at most one tile per expert), not with tokens times
experts as XLA's dense expansion of `lax.ragged_dot` does. Both operands are K-major, as FP8
`wgmma` requires, and of one type, or E5M2 with E4M3 where Mosaic GPU takes the pair (JAX
0.11 on; `block_gemm.wgmma_takes`); 16-bit operands are accepted too, for GEMMs of mixed FP8
formats upcast exactly on JAX 0.10.

Scaling, either:
- per block (`lhs_scale`, `rhs_scale`: one float32 per row and `block_k` chunk): each chunk's
  product is a fresh float32 accumulator, scaled in registers and added (DeepSeek-V3's
  promotion, as in `block_gemm`);
- per item or expert (`item_scale` for rows, `group_scale` for tokens: one float32 each):
  the whole contraction accumulates in one `wgmma` accumulator, multiplied once at the end
  (per-tensor recipes: the activation's scale times the expert's).

As in `block_gemm`, the interpreter (`interpret=True`) runs the GPU's code from JAX 0.11 on;
JAX 0.10's replaces `wgmma` by a float32 `dot_general` of the same FP8 tiles and reads scale
vectors without a register layout (`block_gemm.substitutes`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from ..core import mosaic_private
from . import GROUPED_ROWS_NAME, GROUPED_TOKENS_NAME
from .block_gemm import (
    BLOCK_K,
    TILE_M,
    TILE_N,
    chunk_product,
    copy_rows,
    experts_per_row,
    operand_tiling,
    out_tiling,
    pad_to,
    round_up,
    scale_vector,
    scaled_add,
    store,
    substitutes,
    wgmma_takes,
    zeros_acc,
)
from .dispatch import interpreting

_TYPES = tuple(
    jnp.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16)
)


class RowItems(NamedTuple):
    """The work of the grouped rows kernels, item by item (each an int32 array `(W,)`).

    Item `w` multiplies the `tile_m` rows of `lhs` tile `tile[w]` (rows `tile[w] * tile_m`
    on) by expert `expert[w]`'s `rhs`, and writes rows `[start[w], stop[w])` of that tile's
    output (offsets within the tile) and no other; with `expert[w] = -1` it writes zeros
    there instead. Two items share a tile where it holds two experts' rows (each writes its
    own), so the rows need no padding between experts: `row_items` makes the items of rows
    sorted by expert.
    """

    tile: Int[Array, " W"]
    expert: Int[Array, " W"]
    start: Int[Array, " W"]
    stop: Int[Array, " W"]

    @classmethod
    def of_tiles(cls, tile_expert: Int[Array, " tiles"], tile_m: int = TILE_M) -> RowItems:
        """One item per whole tile, tile `t` multiplied by expert `tile_expert[t]` (-1: a tile
        left unwritten)."""
        expert = jnp.asarray(tile_expert, jnp.int32)
        tiles = jnp.arange(expert.shape[0], dtype=jnp.int32)
        stop = jnp.where(expert >= 0, tile_m, 0).astype(jnp.int32)
        return cls(tiles, expert, jnp.zeros_like(tiles), stop)

    def stacked(self) -> Int[Array, "4 W"]:
        """The items as the kernels read them: one `(4, W)` int32 array."""
        return jnp.stack([jnp.asarray(a, jnp.int32) for a in self])


def row_items(group_sizes: Int[Array, " G"], rows: int, tile_m: int = TILE_M) -> RowItems:
    """The items of `rows` rows sorted by expert, expert `e` holding `group_sizes[e]` of them
    (`RowItems`): each expert's rows cut at the `tile_m`-row tiles of the unpadded layout, a
    tile that holds the end of one expert and the start of the next run once for each.
    Rows past the sum of the sizes get zeros (as from `lax.ragged_dot`). `cdiv(rows,
    tile_m) + G` items (a static count, enough for any sizes); the unused ones write
    nothing."""
    experts = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    # The groups' row ranges, and last, the rows past every expert (written with zeros).
    end = jnp.minimum(jnp.cumsum(sizes), rows)
    end = jnp.concatenate([end, jnp.full((1,), rows, jnp.int32)])
    start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
    first = start // tile_m
    count = jnp.where(end > start, (end - 1) // tile_m - first + 1, 0)
    ends = jnp.cumsum(count)
    item = jnp.arange(math.ceil(rows / tile_m) + experts, dtype=jnp.int32)
    # One comparison per (item, group), in one fusion (a binary search is a loop of kernels).
    # (`searchsorted`'s "compare_all" written out: JAX's fails in a partly manual shard_map.)
    group = jnp.sum(ends[None, :] <= item[:, None], axis=1, dtype=jnp.int32)
    used = group <= experts
    group = jnp.minimum(group, experts)
    tile = first[group] + item - (ends - count)[group]
    origin = tile * tile_m
    lo = jnp.clip(start[group] - origin, 0, tile_m)
    hi = jnp.clip(end[group] - origin, 0, tile_m)
    return RowItems(
        jnp.where(used, tile, 0),
        jnp.where(used & (group < experts), group, -1),
        jnp.where(used, lo, 0),
        jnp.where(used, hi, 0),
    )


def _check_operands(name: str, lhs: Array, rhs: Array, k: int) -> None:
    for what, a in (("lhs", lhs), ("rhs", rhs)):
        if jnp.dtype(a.dtype) not in _TYPES:
            raise ValueError(
                f"{name}: {what} is {a.dtype}; wgmma takes float8_e4m3fn, float8_e5m2, "
                "bfloat16 or float16."
            )
        if a.shape[-1] != k:
            raise ValueError(
                f"{name}: {what} has shape {a.shape}; both operands are contracted over their "
                f"last axis, of size {k}."
            )
    if not wgmma_takes(lhs.dtype, rhs.dtype):
        raise ValueError(
            f"{name}: lhs is {lhs.dtype} and rhs {rhs.dtype}; this JAX's Mosaic GPU wgmma takes "
            "one type for both operands, or E4M3 with E5M2 from JAX 0.11 on (upcast other "
            "mixes of FP8 formats to bfloat16, exactly)."
        )


def scaling_is_blocks(name: str, block: tuple, once: Array | None, what_once: str) -> bool:
    """Whether the block scales (`block`, all given) or the one-scalar scaling (`once`) is
    asked for: exactly one of the two."""
    given = [s is not None for s in block]
    if all(given) and once is None:
        return True
    if not any(given) and once is not None:
        return False
    raise ValueError(
        f"{name}: give either lhs_scale and rhs_scale (block scales) or {what_once} (one scale "
        f"per contraction), not both or neither."
    )


def check_shape(name: str, what: str, a: Array, shape: tuple) -> None:
    if a.shape != shape:
        raise ValueError(f"{name}: {what} has shape {a.shape}; expected {shape}.")


def _accumulated(operands, index_maps, grid, shape, tiling, block_k, steps, substitute) -> Array:
    """`sum_c a_c . b_c^T` over a pipeline of `grid` chunks, in one float32 accumulator (the
    per-tile scaling: nothing to do between chunks)."""
    release = 1 if steps > 1 else 0  # keep a chunk in shared memory while its wgmma runs
    rows = (shape[0], shape[1])
    specs = [
        plgpu.BlockSpec((r, block_k), index, transforms=tiling, delay_release=release)
        for r, index in zip(rows, index_maps, strict=True)
    ]
    if substitute:  # an interpreter without the GPU path (JAX 0.10): the same sum, in registers
        return _summed(operands, index_maps, grid, shape, tiling, block_k, steps, True)

    def scope(acc_ref):
        def step(_, a_tile, b_tile):
            plgpu.wgmma(acc_ref, a_tile, b_tile.transpose((1, 0)))

        plgpu.emit_pipeline(step, grid=grid, in_specs=specs, max_concurrent_steps=steps)(*operands)
        return acc_ref[...]  # waits for the last wgmma

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _summed(operands, index_maps, grid, shape, tiling, block_k, steps, substitute) -> Array:
    """`sum_c a_c . b_c^T` as `_accumulated`, but each chunk's product in a fresh accumulator
    added to a float32 sum in registers (`promote`: FP8 `wgmma` accumulates with less than
    float32's precision, so a long contraction is promoted every chunk, as cuBLASLt does
    without fast accumulation and DeepSeek-V3 every 128 elements)."""
    specs = [
        plgpu.BlockSpec((r, block_k), index, transforms=tiling)
        for r, index in zip(shape, index_maps, strict=True)
    ]

    def step(_, a_tile, b_tile, acc):
        return acc + chunk_product(a_tile, b_tile, shape, substitute)

    return plgpu.emit_pipeline(
        step,
        grid=grid,
        in_specs=specs,
        max_concurrent_steps=steps,
        init_carry=zeros_acc(shape, substitute),
    )(*operands)


def _promoted(operands, index_maps, grid, shape, tiling, block_k, steps, substitute) -> Array:
    """`sum_c (a_c . b_c^T) * sa_c[:, None] * sb_c[None, :]` over a pipeline of `grid`
    chunks: a fresh accumulator per chunk, scaled in registers and added (block scaling).
    `operands`: a, a's scales `(chunks, rows)`, b, b's scales; `index_maps` of a and b's
    tiles `(row block, chunk)`."""
    (a_index, b_index), (tm, tn) = index_maps, shape

    def scales_index(index):
        return lambda c: tuple(reversed(index(c)))

    specs = [
        plgpu.BlockSpec((tm, block_k), a_index, transforms=tiling),
        plgpu.BlockSpec((None, tm), scales_index(a_index)),
        plgpu.BlockSpec((tn, block_k), b_index, transforms=tiling),
        plgpu.BlockSpec((None, tn), scales_index(b_index)),
    ]

    def step(_, a_tile, a_scale, b_tile, b_scale, acc):
        part = chunk_product(a_tile, b_tile, shape, substitute)
        sa, sb = scale_vector(a_scale, 1, substitute), scale_vector(b_scale, 0, substitute)
        return scaled_add(acc, part, sa, sb)

    return plgpu.emit_pipeline(
        step,
        grid=grid,
        in_specs=specs,
        max_concurrent_steps=steps,
        init_carry=zeros_acc(shape, substitute),
    )(*operands)


def grouped_rows_gemm(
    lhs: Array,
    rhs: Array,
    items: RowItems,
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    item_scale: Float[Array, " W"] | None = None,
    out_dtype=jnp.float32,
    tile_m: int = TILE_M,
    tile_n: int = TILE_N,
    block_k: int = BLOCK_K,
    max_concurrent_steps: int = 2,
    promote: bool = False,
    rhs_block_rows: int = 1,
    interpret: bool | None = None,
) -> Array:
    """Each item's rows of `lhs (M, K)` times its expert's `rhs (N, K)`, contracted over `K`.

    `items`: `RowItems` (`row_items` for rows sorted by expert; one program per item and
    column tile); rows no item writes are left unwritten. Scales: `lhs_scale (M, ceil(K /
    block_k))` and `rhs_scale (G, N, ceil(K / block_k))` (per row and chunk, promoted every
    chunk; `(G, ceil(N / rhs_block_rows), chunks)` per block of rows), or `item_scale (W,)`
    (one multiplier per item, the contraction in one `wgmma` accumulator; with `promote`,
    each chunk's product added to a float32 sum in registers). Returns `(M, N)` in
    `out_dtype`. `interpret`: see `block_gemm.block_scaled_gemm`.
    """
    name = "grouped_rows_gemm"
    interpret = interpreting() if interpret is None else interpret
    substitute = substitutes(interpret)
    (m, k), (g, n) = lhs.shape, rhs.shape[:2]
    if rhs.ndim != 3:
        raise ValueError(f"{name}: rhs has shape {rhs.shape}; expected (experts, N, K).")
    _check_operands(name, lhs, rhs, k)
    table = check_items(name, items)
    chunks = math.ceil(k / block_k)
    blocks = scaling_is_blocks(name, (lhs_scale, rhs_scale), item_scale, "item_scale")
    # The last tile may reach past the rows (TMA reads zeros there, and no item writes them);
    # a tile is never larger than the operand, though, and Mosaic GPU's TMA takes the rows of
    # a tiled operand in whole 8-row tiles (jax 0.11: 2,338 rows failed to lower on an H200).
    mp, np_, kp = max(round_up(m, 8), tile_m), round_up(n, tile_n), chunks * block_k
    a = pad_to(lhs, mp, kp)
    b = jax.vmap(lambda w: pad_to(w, np_, kp))(rhs)
    if blocks:
        check_shape(name, "lhs_scale", lhs_scale, (m, chunks))
        rhs_scale = experts_per_row(rhs, rhs_scale, rhs_block_rows, name)
        check_shape(name, "rhs_scale", rhs_scale, (g, n, chunks))
        sa = pad_to(lhs_scale.astype(jnp.float32), mp, chunks).T
        sb = jnp.swapaxes(jax.vmap(lambda s: pad_to(s, np_, chunks))(rhs_scale), 1, 2)
        operands = (table, a, sa, b, sb.astype(jnp.float32))
    else:
        check_shape(name, "item_scale", item_scale, table.shape[1:])
        operands = (table, item_scale.astype(jnp.float32), a, b)
    tiling = operand_tiling(lhs.dtype, block_k)
    steps = min(max_concurrent_steps, chunks)
    shape = (tile_m, tile_n)

    def body(*refs):
        items_gmem, (out_gmem, out_smem) = refs[0], refs[-2:]
        w, j = lax.axis_index("m"), lax.axis_index("n")
        # Scalars read from global memory: the item's tile, expert and rows.
        tile, expert = items_gmem[0, w], items_gmem[1, w]
        start, stop = items_gmem[2, w], items_gmem[3, w]
        index_maps = (lambda c: (tile, c), lambda c: (j, c))

        def write(acc):
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            copy_rows(out_smem, out_gmem, tile * tile_m, start, stop, pl.ds(j * tile_n, tile_n))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(expert >= 0)
        def _():
            if blocks:
                _, a_gmem, sa_gmem, b_gmem, sb_gmem = refs[:-2]
                ops = (a_gmem, sa_gmem, b_gmem.at[expert], sb_gmem.at[expert])
                acc = _promoted(
                    ops, index_maps, (chunks,), shape, tiling, block_k, steps, substitute
                )
            else:
                _, scale_gmem, a_gmem, b_gmem = refs[:-2]
                ops = (a_gmem, b_gmem.at[expert])
                run = _summed if promote else _accumulated
                acc = run(ops, index_maps, (chunks,), shape, tiling, block_k, steps, substitute)
                acc = acc * scale_gmem[w]
            write(acc)

        @pl.when((expert < 0) & (stop > start))  # rows of no expert: zeros
        def _():
            write(jnp.zeros(shape, jnp.float32))

    body.__name__ = body.__qualname__ = GROUPED_ROWS_NAME
    out_dtype = jnp.dtype(out_dtype)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_types=[plgpu.SMEM(shape, out_dtype)],
        grid=(table.shape[1], np_ // tile_n),
        grid_names=("m", "n"),
        interpret=mosaic_private.interpret_params(reads_past_the_end=True) if interpret else None,
    )(*operands)
    return out[:m, :n]


def check_items(name: str, items: RowItems) -> Int[Array, "4 W"]:
    """`items` as the kernels read them (`RowItems.stacked`), or `ValueError` naming `name`
    unless they are four int arrays of one shape `(W,)`, `W >= 1`."""
    if not isinstance(items, RowItems):
        raise ValueError(
            f"{name}: items is {type(items).__name__}; expected RowItems (row_items(group_sizes, "
            "rows) for rows sorted by expert, RowItems.of_tiles(tile_expert) for whole tiles)."
        )
    shapes = {jnp.shape(a) for a in items}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1 or next(iter(shapes))[0] < 1:
        raise ValueError(
            f"{name}: items have shapes {[jnp.shape(a) for a in items]}; expected four arrays "
            "of one shape (W,), W >= 1."
        )
    if any(not jnp.issubdtype(jnp.result_type(a), jnp.integer) for a in items):
        raise ValueError(
            f"{name}: items have dtypes {[str(jnp.result_type(a)) for a in items]}; expected "
            "integers."
        )
    return items.stacked()


def grouped_tokens_gemm(
    lhs: Array,
    rhs: Array,
    chunk_start: Int[Array, " G"],
    chunk_count: Int[Array, " G"],
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    group_scale: Float[Array, " G"] | None = None,
    out_dtype=jnp.float32,
    tile_m: int = TILE_M,
    tile_n: int = TILE_N,
    block_k: int = BLOCK_K,
    max_concurrent_steps: int = 2,
    promote: bool = False,
    interpret: bool | None = None,
) -> Array:
    """`out[e] = lhs[:, tokens of e] . rhs[:, tokens of e]^T` for every expert `e`.

    `lhs (A, T)` and `rhs (B, T)` are contracted over their tokens; `T` is a multiple of
    `block_k`, expert `e`'s tokens the `chunk_count[e]` chunks of `block_k` from chunk
    `chunk_start[e]`. Scales: `lhs_scale (A, T / block_k)` and `rhs_scale (B, T / block_k)`
    (per row and chunk of tokens), or `group_scale (G,)` (one multiplier per expert; with
    `promote`, each chunk's product added to a float32 sum in registers, as `grouped_rows_gemm`).
    Returns `(G, A, B)` in `out_dtype`; an expert with no chunks gets zeros.
    """
    name = "grouped_tokens_gemm"
    interpret = interpreting() if interpret is None else interpret
    substitute = substitutes(interpret)
    (a_rows, t), b_rows, g = lhs.shape, rhs.shape[0], chunk_start.shape[0]
    _check_operands(name, lhs, rhs, t)
    if t % block_k:
        raise ValueError(
            f"{name}: {t} tokens, not a multiple of block_k={block_k}; pad each expert's tokens "
            "to whole chunks."
        )
    chunks = t // block_k
    check_shape(name, "chunk_count", chunk_count, (g,))
    blocks = scaling_is_blocks(name, (lhs_scale, rhs_scale), group_scale, "group_scale")
    ap, bp = round_up(a_rows, tile_m), round_up(b_rows, tile_n)
    a, b = pad_to(lhs, ap, t), pad_to(rhs, bp, t)
    counts = (chunk_start.astype(jnp.int32), chunk_count.astype(jnp.int32))
    if blocks:
        check_shape(name, "lhs_scale", lhs_scale, (a_rows, chunks))
        check_shape(name, "rhs_scale", rhs_scale, (b_rows, chunks))
        sa = pad_to(lhs_scale.astype(jnp.float32), ap, chunks).T
        sb = pad_to(rhs_scale.astype(jnp.float32), bp, chunks).T
        operands = (*counts, a, sa, b, sb)
    else:
        check_shape(name, "group_scale", group_scale, (g,))
        operands = (*counts, group_scale.astype(jnp.float32), a, b)
    tiling = operand_tiling(lhs.dtype, block_k)
    shape = (tile_m, tile_n)

    def body(*refs):
        start_gmem, count_gmem = refs[:2]
        out_gmem, out_smem = refs[-2:]
        e, i, j = lax.axis_index("g"), lax.axis_index("m"), lax.axis_index("n")
        start, grid = start_gmem[e], (count_gmem[e],)  # a run-time trip count
        index_maps = (lambda c: (i, start + c), lambda c: (j, start + c))
        steps = max_concurrent_steps
        if blocks:
            acc = _promoted(refs[2:-2], index_maps, grid, shape, tiling, block_k, steps, substitute)
        else:
            scale_gmem, a_gmem, b_gmem = refs[2:-2]
            ops = (a_gmem, b_gmem)
            run = _summed if promote else _accumulated
            acc = run(ops, index_maps, grid, shape, tiling, block_k, steps, substitute)
            acc = acc * scale_gmem[e]
        window = (e, pl.ds(i * tile_m, tile_m), pl.ds(j * tile_n, tile_n))
        store(acc, out_smem, out_gmem.at[window])

    body.__name__ = body.__qualname__ = GROUPED_TOKENS_NAME
    out_dtype = jnp.dtype(out_dtype)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, ap, bp), out_dtype),
        scratch_types=[plgpu.SMEM(shape, out_dtype, transforms=out_tiling(out_dtype, tile_n))],
        grid=(g, ap // tile_m, bp // tile_n),
        grid_names=("g", "m", "n"),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(*operands)
    return out[:, :a_rows, :b_rows]

"""The grouped GEMMs on fp8jax's Hopper kernels (`fp8jax._src.kernels.grouped_gemm`).

- `native_rows` (forward, dgrad): the rows kernel on the rows as they are, sorted by expert
  (`grouped_gemm.row_items`: a tile holding the end of one expert's rows and the start of
  the next is run once for each, each writing its own rows), no padded copy in or out.
- `native_tokens` (wgrad): contracting over tokens, a chunk of 128 must hold one expert's
  tokens only, so it takes each expert's tokens starting on a chunk boundary: `pad_layout`
  (DeepGEMM's "contiguous layout": expert `e`'s rows moved to start at `sum(roundup(size[f],
  tile) for f < e)`, zeros between). Per-tensor operands are padded here; block-scaled ones
  come padded to their token tiles, quantized as they are gathered (the grouped layer's
  backward). It transposes the FP8 values K-major and runs the tokens kernel.

Either way the kernels' work grows with the tokens (plus at most a tile per expert); XLA's
expansion of `lax.ragged_dot` multiplies it by the number of experts instead.

Per-tensor operands are scaled once per tile (activation scale times the tile's expert's
kernel scale); block-scaled ones per chunk, as in `block_gemm`. A GEMM of E5M2 gradients and
E4M3 values multiplies the pair in one `wgmma` where Mosaic GPU takes it (JAX 0.11 on); on
JAX 0.10, whose `wgmma` takes one type, it runs on both upcast to bfloat16 (exact: every FP8
value is a bfloat16), in the same kernel, at the 16-bit rate.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..kernels import dispatch
from ..kernels.padded_quantize import gather_rows
from ..recipes import QTensor
from ..recipes.block_dot import gather_quantized


class Padded(NamedTuple):
    """Where the rows of an expert-sorted array go in the padded layout.

    - `source (P,)`: the row each padded row holds; `valid (P,)`: whether it holds it (else
      zeros: a gap). Rows past the sum of the group sizes are in no expert's rows; the gaps'
      `source`s name them, each once, then the other rows in turn (so that a kernel
      writing something for each row a padded row names writes every row: `gather_map`).
    - `sizes (G,)`: each expert's padded size, a multiple of the tile.
    """

    source: Int[Array, " P"]
    valid: Bool[Array, " P"]
    sizes: Int[Array, " G"]


def group_at(ends: Int[Array, " G"], positions: Int[Array, " P"]) -> Int[Array, " P"]:
    """The group each position falls in, given the groups' cumulative `ends`; positions past
    the last group get the last one."""
    # One comparison per (position, group), in one fusion: the default method's binary
    # search is a loop of a few kernels per step on a GPU, for a handful of groups.
    # (`searchsorted`'s "compare_all" written out: JAX's fails in a partly manual shard_map.)
    index = jnp.sum(ends[None, :] <= positions.astype(ends.dtype)[:, None], axis=1)
    return jnp.minimum(index, ends.shape[0] - 1).astype(jnp.int32)


def expert_of_rows(group_sizes: Int[Array, " G"], rows: int) -> Int[Array, " rows"]:
    """The expert each row belongs to. Rows past the last group (when the sizes sum to less
    than `rows`) get the last expert; the ragged dot gives them zeros whatever their scale."""
    return group_at(jnp.cumsum(group_sizes), jnp.arange(rows))


def padded_rows(rows: int, experts: int, tile: int) -> int:
    """The (static) number of rows of the padded layout: enough for any group sizes."""
    return max(tile, math.ceil((rows + experts * (tile - 1)) / tile) * tile)


def pad_layout(group_sizes: Int[Array, " G"], rows: int, tile: int) -> Padded:
    """The padded layout of `rows` expert-sorted rows with `group_sizes`, experts starting on
    multiples of `tile`."""
    experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + tile - 1) // tile * tile
    padded_end, end = jnp.cumsum(padded), jnp.cumsum(sizes)
    padded_start, start = padded_end - padded, end - sizes
    position = jnp.arange(padded_rows(rows, experts, tile), dtype=jnp.int32)
    expert = group_at(padded_end, position)
    offset = position - padded_start[expert]
    valid = (offset < sizes[expert]) & (position < padded_end[-1])
    # A gap's ordinal among the gaps (the positions before it less the rows placed before
    # it) names the rows past the groups' sum first.
    gap = end[-1] + position - end[expert]
    last = max(rows - 1, 0)
    source = jnp.where(valid, jnp.clip(start[expert] + offset, 0, last), gap % (last + 1))
    return Padded(source, valid, padded)


def gather_map(layout: Padded) -> Int[Array, " P"]:
    """The row each padded row holds, negative for a gap (`-1 - source`: the row a gap's
    lane of `padded_quantize.quantize_rows_and_padded_columns` writes the rows copy of): the
    row map the gathering kernels take (`kernels/padded_quantize.py`)."""
    return jnp.where(layout.valid, layout.source, -1 - layout.source)


def pad(a: Array, layout: Padded) -> Array:
    """`a (M, ...)` in the padded layout, zeros in the gaps."""
    return gather_rows(a, gather_map(layout))


def pad_quantized(q: QTensor, layout: Padded) -> QTensor:
    """A quantized `(M, C)` tensor in the padded layout: its FP8 rows, and its scales' rows
    when it has one scale per row (tiles of one row: `block_dot.gather_quantized`)."""
    if q.block:
        return gather_quantized(q, gather_map(layout))
    return QTensor(pad(q.data, layout), q.scale_inv, q.block)


def _one_type(a: Array, b: Array) -> tuple[Array, Array]:
    """Both operands in types one `wgmma` takes: as they are (one type, or E5M2 with E4M3
    where this JAX's Mosaic GPU takes the pair: JAX 0.11 on), else both bfloat16 (exact for
    FP8 values, at half the FP8 rate)."""
    from ..kernels.block_gemm import wgmma_takes

    if wgmma_takes(a.dtype, b.dtype):
        return a, b
    return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)


def native_rows(
    lhs: QTensor, rhs: QTensor, group_sizes: Int[Array, " G"], out_dtype, promote: bool = False
) -> Float[Array, "M F"]:
    """The rows GEMM (forward, dgrad) on the rows kernel: `lhs (M, C)` (one scale, or tiles
    of one row) times each row's expert's `rhs (G, F, C)` (one scale per expert, or blocks
    per expert), both contracted on their last axis. Shape `(M, F)` in `out_dtype`. The
    kernel reads the rows and writes the output where they are (`row_items`: a tile shared by
    two experts runs once for each), with no padded copy of either. `promote`: per-tensor
    operands' contraction promoted to float32 every chunk (blocks are promoted every chunk
    anyway)."""
    from ..kernels.block_gemm import expand_rows
    from ..kernels.choice import recipe_grouped_rows_gemm, weight_block_scales_chosen
    from ..kernels.grouped_gemm import TILE_M, row_items

    m, f = lhs.data.shape[0], rhs.data.shape[1]
    if m == 0 or f == 0 or lhs.data.shape[1] == 0:  # no kernel grid (zeros, as lax's)
        return jnp.zeros((m, f), out_dtype)
    items = row_items(group_sizes, m, TILE_M)
    a, b = _one_type(lhs.data, rhs.data)
    if not lhs.block:
        scale = lhs.scale_inv.astype(jnp.float32) * rhs.scale_inv.astype(jnp.float32)
        item_scale = scale[jnp.maximum(items.expert, 0)]
        return recipe_grouped_rows_gemm(
            a, b, items, item_scale=item_scale, out_dtype=out_dtype, promote=promote
        )
    return recipe_grouped_rows_gemm(
        a,
        b,
        items,
        lhs_scale=lhs.scale_inv,
        # Per block of rows as they are (`choice.weight_block_scales`), else per row.
        **(
            dict(rhs_scale=rhs.scale_inv, rhs_block_rows=rhs.block[0])
            if weight_block_scales_chosen()
            else dict(rhs_scale=expand_rows(rhs.scale_inv, f, rhs.block[0]))
        ),
        out_dtype=out_dtype,
        block_k=lhs.block[1],
    )


def native_tokens(
    lhs: QTensor, rhs: QTensor, group_sizes: Int[Array, " G"], out_dtype, promote: bool = False
) -> Float[Array, "G A B"]:
    """The tokens GEMM (wgrad) on the tokens kernel: `lhs (T, A)` and `rhs (T, B)`,
    contracted over their tokens. Block-scaled operands come in the padded layout (each of
    `group_sizes` a multiple of their token tile); per-tensor ones are padded here, to
    chunks of 128 tokens. Shape `(G, A, B)` in `out_dtype`. `promote`: as `native_rows`'s."""
    from ..kernels.choice import recipe_grouped_tokens_gemm
    from ..kernels.grouped_gemm import BLOCK_K

    (t, a_cols), b_cols = lhs.data.shape, rhs.data.shape[1]
    if t == 0 or a_cols == 0 or b_cols == 0:  # no kernel grid (zeros, as lax's)
        return jnp.zeros((group_sizes.shape[0], a_cols, b_cols), out_dtype)
    chunk = lhs.block[0] if lhs.block else BLOCK_K
    if not lhs.block:
        layout = pad_layout(group_sizes, lhs.data.shape[0], chunk)
        lhs, rhs = pad_quantized(lhs, layout), pad_quantized(rhs, layout)
        group_sizes = layout.sizes
    counts = (group_sizes // chunk).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    a, b = dispatch.k_major(lhs.data, -2), dispatch.k_major(rhs.data, -2)  # (A, T), (B, T)
    a, b = _one_type(a, b)
    if not lhs.block:
        scale = lhs.scale_inv.astype(jnp.float32) * rhs.scale_inv.astype(jnp.float32)
        group_scale = jnp.broadcast_to(scale, group_sizes.shape)
        return recipe_grouped_tokens_gemm(
            a, b, starts, counts, group_scale=group_scale, out_dtype=out_dtype, promote=promote
        )
    return recipe_grouped_tokens_gemm(
        a,
        b,
        starts,
        counts,
        lhs_scale=lhs.scale_inv.T,
        rhs_scale=rhs.scale_inv.T,
        out_dtype=out_dtype,
        block_k=chunk,
    )

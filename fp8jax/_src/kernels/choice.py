"""Which block-scaled and grouped kernels the recipes call: the tiled ones (`block_gemm`,
`grouped_gemm`), or the persistent warp-specialized kernels (`persistent_gemm`: dense,
grouped rows and grouped tokens) where a function is traced inside `persistent_kernel()`.

The persistent kernel becomes the default only after a GPU run has checked and timed it
(issue 39); until then this switch lets whole train steps be compiled and timed with it
(`benchmarks/llama_block.py`'s `blockwise-persistent`, the GPU check's grouped section)
without changing any default.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .block_gemm import BLOCK_K, FP8_TYPES, TILE_M, block_scaled_gemm
from .grouped_gemm import RowItems, grouped_rows_gemm, grouped_tokens_gemm
from .persistent_gemm import PersistentConfig, persistent_block_scaled_gemm
from .persistent_grouped import persistent_grouped_rows_gemm, persistent_grouped_tokens_gemm

_CHOSEN: contextvars.ContextVar[PersistentConfig | None] = contextvars.ContextVar(
    "fp8jax_persistent_block_kernel", default=None
)


@contextlib.contextmanager
def persistent_kernel(config: PersistentConfig | None = None) -> Iterator[None]:
    """Functions traced inside run the recipes' block-scaled GEMMs (blockwise, MXFP8 with 128
    chunks, the fused residual kernel) and the expert layers' FP8 grouped GEMMs on the
    persistent kernels in `config` instead of the tiled ones: to measure them in whole train
    steps (`benchmarks/llama_block.py`'s `blockwise-persistent`, the GPU check's grouped
    section) before a GPU run makes them the default."""
    token = _CHOSEN.set(PersistentConfig() if config is None else config)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def recipe_block_gemm(
    lhs: Array,
    lhs_scale: Array,
    terms: Sequence[tuple[Array, Array]],
    *,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
) -> Float[Array, "M N"]:
    """The block-scaled GEMM the recipes call: `block_scaled_gemm` (the tiled kernel), or
    `persistent_block_scaled_gemm` where traced inside `persistent_kernel()` and the chunks
    are 128 wide (the only width it takes)."""
    config = _CHOSEN.get()
    if config is None or block_k != BLOCK_K:
        return block_scaled_gemm(lhs, lhs_scale, terms, out_dtype=out_dtype, block_k=block_k)
    return persistent_block_scaled_gemm(lhs, lhs_scale, terms, out_dtype=out_dtype, config=config)


def _grouped_choice(lhs: Array, block_k: int) -> PersistentConfig | None:
    """The persistent kernels' configuration for a grouped GEMM traced inside
    `persistent_kernel()` whose operands are FP8 and whose chunks are 128 wide (the only
    ones those kernels take); `None`: the tiled kernel."""
    config = _CHOSEN.get()
    if config is None or block_k != BLOCK_K or jnp.dtype(lhs.dtype) not in FP8_TYPES:
        return None
    return config


def recipe_grouped_rows_gemm(
    lhs: Array,
    rhs: Array,
    items: RowItems,
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    item_scale: Float[Array, " W"] | None = None,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
    promote: bool = False,
) -> Float[Array, "M N"]:
    """The grouped rows GEMM the grouped layers call: `grouped_rows_gemm`, or
    `persistent_grouped_rows_gemm` (its warpgroups splitting N) where traced inside
    `persistent_kernel()`, the operands FP8 and the chunks 128 wide. `promote`: a per-tile
    scaled contraction promoted to float32 every chunk (the backward's, as cuBLASLt without
    fast accumulation). `items`: cut at `TILE_M`-row tiles (`grouped_gemm.row_items`)."""
    config = _grouped_choice(lhs, block_k)
    scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, item_scale=item_scale)
    kw = dict(out_dtype=out_dtype, promote=promote)
    if config is None:
        return grouped_rows_gemm(lhs, rhs, items, **scales, **kw, block_k=block_k)
    return persistent_grouped_rows_gemm(
        lhs,
        rhs,
        items,
        **scales,
        **kw,
        # A CTA's rows are one item's: the items' tile rows, the warpgroups splitting N, a
        # cluster (if any) sharing the row tile.
        config=dataclasses.replace(
            config,
            tile_m=TILE_M,
            wg_dimension="n",
            cluster=None if config.cluster == "m" else config.cluster,
        ),
    )


def recipe_grouped_tokens_gemm(
    lhs: Array,
    rhs: Array,
    chunk_start: Int[Array, " G"],
    chunk_count: Int[Array, " G"],
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    group_scale: Float[Array, " G"] | None = None,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
    promote: bool = False,
) -> Float[Array, "G A B"]:
    """The grouped tokens GEMM (wgrad) the grouped layers call: `grouped_tokens_gemm`, or
    `persistent_grouped_tokens_gemm` where traced inside `persistent_kernel()`, the operands
    FP8 and the chunks 128 wide. `promote`: as `recipe_grouped_rows_gemm`'s."""
    config = _grouped_choice(lhs, block_k)
    scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, group_scale=group_scale)
    kw = dict(out_dtype=out_dtype, promote=promote)
    if config is None:
        return grouped_tokens_gemm(
            lhs, rhs, chunk_start, chunk_count, **scales, **kw, block_k=block_k
        )
    return persistent_grouped_tokens_gemm(
        lhs, rhs, chunk_start, chunk_count, **scales, **kw, config=config
    )

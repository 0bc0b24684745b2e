"""The grouped (mixture-of-experts) GEMMs on the persistent warp-specialized kernel of
`persistent_gemm`: an expert layer's rows GEMM (forward and dgrad) and tokens GEMM (wgrad),
what `grouped_gemm`'s tiled kernels compute (the same arguments and results), persistent
over the output tiles so that unused items and uneven or empty experts cost their programs
nothing. The grouped layers' default on a GPU since the GPU check's run 4 (`choice`);
`choice.tiled_kernel()` routes them to `grouped_gemm`'s kernels instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .block_gemm import BLOCK_K, check_operands, experts_per_row, pad_to, round_up
from .dispatch import interpreting
from .grouped_gemm import RowItems, check_items, check_shape, scaling_is_blocks
from .persistent_config import PersistentConfig, grid_programs
from .persistent_gemm import interpretable, run_persistent


def persistent_grouped_rows_gemm(
    lhs: Array,
    rhs: Array,
    items: RowItems,
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    item_scale: Float[Array, " W"] | None = None,
    out_dtype=jnp.float32,
    config: PersistentConfig | None = None,
    promote: bool = False,
    rhs_block_rows: int = 1,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """Each item's rows of `lhs (M, K)` times its expert's `rhs (N, K)` by the persistent
    kernel: `grouped_gemm.grouped_rows_gemm` (an expert layer's forward and dgrad, on rows
    sorted by expert, unpadded: `grouped_gemm.row_items`), persistent over (item, column
    tile) pairs so that an unused item costs its programs nothing.

    Scales, either: `lhs_scale (M, ceil(K / 128))` and `rhs_scale (G, N, ceil(K / 128))` (per
    row and chunk, promoted every chunk; `(G, ceil(N / rhs_block_rows), chunks)` per block of
    rows: one scale per warpgroup tile where a block covers it), or `item_scale (W,)` (one
    multiplier per item, after one accumulation over the whole contraction, or with
    `promote` each chunk's product added to a float32 sum first: per-tensor recipes). Both
    compute warpgroups share each item's rows (`wg_dimension="n"`), `config.tile_m` of them
    (the items' tile). Returns `(M, N)` in `out_dtype`; rows no item writes are left
    unwritten.
    """
    name = "persistent_grouped_rows_gemm"
    config = PersistentConfig(wg_dimension="n") if config is None else config
    interpret = interpretable(name, interpreting() if interpret is None else interpret)
    if config.cluster == "m":
        raise ValueError(
            f"{name}: config.cluster='m'; a cluster's CTAs would hold two items, of different "
            "experts, sharing one rhs tile: use None or 'n'."
        )
    if config.wg_dimension != "n":
        raise ValueError(
            f"{name}: config.wg_dimension={config.wg_dimension!r}; the grouped kernel splits "
            "N between its warpgroups ('n'), so that each CTA's rows are one item's."
        )
    if rhs.ndim != 3 or lhs.ndim != 2:
        raise ValueError(
            f"{name}: lhs {lhs.shape} and rhs {rhs.shape}; expected (M, K) and (experts, N, K)."
        )
    table = check_items(name, items)
    blocks = scaling_is_blocks(name, (lhs_scale, rhs_scale), item_scale, "item_scale")
    (m, k), n = lhs.shape, rhs.shape[1]
    chunks = -(-k // BLOCK_K)
    if blocks:  # one (N, chunks) grid per expert, or `rhs_block_rows` rows a scale
        rhs_scale = experts_per_row(rhs, rhs_scale, rhs_block_rows, name)
    # The operand checks of a block-scaled call, on shapes (of one expert's rhs; stand-ins for
    # the scales of a per-item call).
    f32 = jnp.float32
    sa = lhs_scale if blocks else jax.ShapeDtypeStruct((m, chunks), f32)
    sb = jax.ShapeDtypeStruct(rhs_scale.shape[1:] if blocks else (n, chunks), f32)
    check_operands(name, lhs, sa, [(jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype), sb)], BLOCK_K)
    if not blocks:
        check_shape(name, "item_scale", item_scale, table.shape[1:])
    cluster_n = config.cluster_tile[1]
    # The last tile may reach past the rows (TMA reads zeros there, and no item writes them);
    # a tile is never larger than the operand, though, and TMA takes a tiled operand's rows
    # in whole 8-row tiles (as `grouped_rows_gemm`).
    chunks = round_up(chunks, config.chunks_per_step)  # zeros: a whole last step
    mp, np_, kp = max(round_up(m, 8), config.tile_m), round_up(n, cluster_n), chunks * BLOCK_K
    a, b = pad_to(lhs, mp, kp), jax.vmap(lambda w: pad_to(w, np_, kp))(rhs)
    if blocks:
        operands = [
            table,
            a,
            pad_to(lhs_scale.astype(jnp.float32), mp, chunks).T,
            b,
            jnp.swapaxes(
                jax.vmap(lambda s: pad_to(s.astype(jnp.float32), np_, chunks))(rhs_scale), 1, 2
            ),
        ]
    else:
        operands = [table, item_scale.astype(jnp.float32), a, b]
    out = run_persistent(
        operands,
        1,
        out_shape=(mp, np_),
        out_dtype=jnp.dtype(out_dtype),
        config=config,
        programs=grid_programs(config, table.shape[1] * (np_ // cluster_n)),
        interpret=interpret,
        layout="rows",
        tile_scaled=not blocks,
        promote=promote,
        uniform=(False, blocks and rhs_block_rows % config.tile_n == 0),
    )
    return out[:m, :n]


def persistent_grouped_tokens_gemm(
    lhs: Array,
    rhs: Array,
    chunk_start: Int[Array, " G"],
    chunk_count: Int[Array, " G"],
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    group_scale: Float[Array, " G"] | None = None,
    out_dtype=jnp.float32,
    config: PersistentConfig | None = None,
    promote: bool = False,
    interpret: bool | None = None,
) -> Float[Array, "G A B"]:
    """`out[e] = lhs[:, tokens of e] . rhs[:, tokens of e]^T` for every expert `e` by the
    persistent kernel: `grouped_gemm.grouped_tokens_gemm` (an expert layer's wgrad),
    persistent over (expert, row tile, column tile) triples, each tile's pipeline running
    over its expert's own chunks (a run-time trip count), so that uneven experts cost their
    tokens and an empty one only the zeros it writes; with `config.chained`, over (row
    tile, column tile) pairs, each pair's pipeline running over every expert's chunks.

    `lhs (A, T)` and `rhs (B, T)` are FP8 of one type, contracted over their tokens; `T` a
    multiple of 128, expert `e`'s tokens the `chunk_count[e]` chunks of 128 from chunk
    `chunk_start[e]`. Scales: `lhs_scale (A, T / 128)` and `rhs_scale (B, T / 128)` (per row
    and chunk of tokens, promoted every chunk), or `group_scale (G,)` (one multiplier per
    expert after one accumulation, or with `promote` each chunk's product added to a float32
    sum first: per-tensor recipes). Returns `(G, A, B)` in `out_dtype`.
    """
    name = "persistent_grouped_tokens_gemm"
    config = PersistentConfig() if config is None else config
    interpret = interpretable(name, interpreting() if interpret is None else interpret)
    if lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(
            f"{name}: lhs {lhs.shape} and rhs {rhs.shape}; expected (A, T) and (B, T), both "
            "contracted over their tokens T."
        )
    (a_rows, t), (b_rows, g) = lhs.shape, (rhs.shape[0], chunk_start.shape[0])
    if t % BLOCK_K:
        raise ValueError(
            f"{name}: {t} tokens, not a multiple of {BLOCK_K}; pad each expert's tokens to "
            "whole chunks."
        )
    chunks = t // BLOCK_K
    blocks = scaling_is_blocks(name, (lhs_scale, rhs_scale), group_scale, "group_scale")
    # The operand checks of a block-scaled call (stand-ins for the scales of a per-expert one).
    f32 = jnp.float32
    sa = lhs_scale if blocks else jax.ShapeDtypeStruct((a_rows, chunks), f32)
    sb = rhs_scale if blocks else jax.ShapeDtypeStruct((b_rows, chunks), f32)
    check_operands(name, lhs, sa, [(rhs, sb)], BLOCK_K)
    check_shape(name, "chunk_count", chunk_count, (g,))
    if not blocks:
        check_shape(name, "group_scale", group_scale, (g,))
    cluster_m, cluster_n = config.cluster_tile
    ap, bp = round_up(a_rows, cluster_m), round_up(b_rows, cluster_n)
    counts = [chunk_start.astype(jnp.int32), chunk_count.astype(jnp.int32)]
    a, b = pad_to(lhs, ap, t), pad_to(rhs, bp, t)
    if blocks:  # chunk-major: a pipeline step's scales are one contiguous row of the CTA's rows
        sa, sb = pad_to(sa.astype(f32), ap, chunks).T, pad_to(sb.astype(f32), bp, chunks).T
        operands = [*counts, a, sa, b, sb]
    else:
        operands = [*counts, group_scale.astype(f32), a, b]
    clusters = g * (ap // cluster_m) * (bp // cluster_n)
    out = run_persistent(
        operands,
        1,
        out_shape=(g, ap, bp),
        out_dtype=jnp.dtype(out_dtype),
        config=config,
        programs=grid_programs(config, clusters),
        interpret=interpret,
        layout="tokens",
        tile_scaled=not blocks,
        promote=promote,
    )
    return out[:, :a_rows, :b_rows]

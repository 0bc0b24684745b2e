"""Grouped (mixture-of-experts) FP8 GEMMs for Hopper (sm_90a), in Pallas Mosaic GPU.

Two kernels cover the three GEMMs of an expert layer, on operands laid out by the caller so
that each expert's tokens start on a tile boundary (DeepGEMM's "contiguous layout": every
expert's rows padded with zeros to whole tiles; `fp8jax._src.gemm.grouped_native` makes it):

- `grouped_rows_gemm` (forward and dgrad): `out[tile t] = lhs[tile t] . rhs[e_t]^T`, each
  `tile_m`-row tile of `lhs (M, K)` multiplied by its expert's `rhs (N, K)`; the expert of a
  tile is read from `tile_expert` in global memory and picks the TMA window of `rhs (G, N, K)`;
- `grouped_tokens_gemm` (wgrad): `out[e] = lhs[:, tokens of e] . rhs[:, tokens of e]^T`,
  both operands `(rows, T)` contracted over their tokens; expert `e`'s pipeline runs over its
  own `chunk_count[e]` chunks of `block_k` tokens from `chunk_start[e]` (a run-time trip
  count: an expert with no tokens writes zeros).

Work grows with the tokens (plus at most one padded tile per expert), not with tokens times
experts as XLA's dense expansion of `lax.ragged_dot` does. Both operands are K-major, as FP8
`wgmma` requires, and of one type, or E5M2 with E4M3 where Mosaic GPU takes the pair (JAX
0.11 on; `block_gemm.wgmma_takes`); 16-bit operands are accepted too, for GEMMs of mixed FP8
formats upcast exactly on JAX 0.10.

Scaling, either:
- per block (`lhs_scale`, `rhs_scale`: one float32 per row and `block_k` chunk): each chunk's
  product is a fresh float32 accumulator, scaled in registers and added (DeepSeek-V3's
  promotion, as in `block_gemm`);
- per tile (`tile_scale` for rows, `group_scale` for tokens: one float32 each): the whole
  contraction accumulates in one `wgmma` accumulator, multiplied once at the end (per-tensor
  recipes: the activation's scale times the expert's).

As in `block_gemm`, the interpreter (`interpret=True`) runs the GPU's code from JAX 0.11 on;
JAX 0.10's replaces `wgmma` by a float32 `dot_general` of the same FP8 tiles and reads scale
vectors without a register layout (`block_gemm.substitutes`).
"""

from __future__ import annotations

import math

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
        f"per tile), not both or neither."
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
    tile_expert: Int[Array, " tiles"],
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    tile_scale: Float[Array, " tiles"] | None = None,
    out_dtype=jnp.float32,
    tile_m: int = TILE_M,
    tile_n: int = TILE_N,
    block_k: int = BLOCK_K,
    max_concurrent_steps: int = 2,
    promote: bool = False,
    interpret: bool | None = None,
) -> Array:
    """Row tile `t` of `lhs (M, K)` times `rhs[tile_expert[t]] (N, K)`, contracted over `K`.

    `M` is a multiple of `tile_m`; `tile_expert (M / tile_m,)` int32 in `[0, G)`, or -1 for
    a tile to skip (its output rows are left unwritten: padding past every expert). Scales:
    `lhs_scale (M, ceil(K / block_k))` and `rhs_scale (G, N, ceil(K / block_k))` (per row and
    chunk, promoted every chunk), or `tile_scale (M / tile_m,)` (one multiplier per tile,
    the contraction in one `wgmma` accumulator; with `promote`, each chunk's product added to
    a float32 sum in registers). Returns `(M, N)` in `out_dtype`. `interpret`: see
    `block_gemm.block_scaled_gemm`.
    """
    name = "grouped_rows_gemm"
    interpret = interpreting() if interpret is None else interpret
    substitute = substitutes(interpret)
    (m, k), (g, n) = lhs.shape, rhs.shape[:2]
    if rhs.ndim != 3:
        raise ValueError(f"{name}: rhs has shape {rhs.shape}; expected (experts, N, K).")
    _check_operands(name, lhs, rhs, k)
    if m % tile_m:
        raise ValueError(
            f"{name}: lhs has {m} rows, not a multiple of tile_m={tile_m}; pad each expert's "
            "rows to whole tiles."
        )
    tiles, chunks = m // tile_m, math.ceil(k / block_k)
    check_shape(name, "tile_expert", tile_expert, (tiles,))
    blocks = scaling_is_blocks(name, (lhs_scale, rhs_scale), tile_scale, "tile_scale")
    np_, kp = round_up(n, tile_n), chunks * block_k
    a = pad_to(lhs, m, kp)
    b = jax.vmap(lambda w: pad_to(w, np_, kp))(rhs)
    if blocks:
        check_shape(name, "lhs_scale", lhs_scale, (m, chunks))
        check_shape(name, "rhs_scale", rhs_scale, (g, n, chunks))
        sa = lhs_scale.astype(jnp.float32).T
        sb = jnp.swapaxes(jax.vmap(lambda s: pad_to(s, np_, chunks))(rhs_scale), 1, 2)
        operands = (tile_expert.astype(jnp.int32), a, sa, b, sb.astype(jnp.float32))
    else:
        check_shape(name, "tile_scale", tile_scale, (tiles,))
        operands = (tile_expert.astype(jnp.int32), tile_scale.astype(jnp.float32), a, b)
    tiling = operand_tiling(lhs.dtype, block_k)
    steps = min(max_concurrent_steps, chunks)
    shape = (tile_m, tile_n)

    def body(*refs):
        out_gmem, out_smem = refs[-2:]
        i, j = lax.axis_index("m"), lax.axis_index("n")
        index_maps = (lambda c: (i, c), lambda c: (j, c))
        expert = refs[0][i]  # a scalar read from global memory

        @pl.when(expert >= 0)  # -1: a tile past every expert's rows, left unwritten
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
                acc = acc * scale_gmem[i]
            window = (pl.ds(i * tile_m, tile_m), pl.ds(j * tile_n, tile_n))
            store(acc, out_smem, out_gmem.at[window])

    body.__name__ = body.__qualname__ = GROUPED_ROWS_NAME
    out_dtype = jnp.dtype(out_dtype)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, np_), out_dtype),
        scratch_types=[plgpu.SMEM(shape, out_dtype, transforms=out_tiling(out_dtype, tile_n))],
        grid=(tiles, np_ // tile_n),
        grid_names=("m", "n"),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(*operands)
    return out[:, :n]


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

"""A block-scaled FP8 GEMM for Hopper (sm_90a), written in Pallas Mosaic GPU.

`block_scaled_gemm(lhs, lhs_scale, [(rhs, rhs_scale), ...])` computes

    out[m, n] = sum_t sum_c (lhs[m, c] . rhs_t[n, c]) * lhs_scale[m, c] * rhs_scale_t[n, c]

where `c` runs over chunks of `block_k` (128) elements of the contraction: each chunk's
product is a fresh float32 `wgmma` accumulator, multiplied by the two scales in registers and
added to the running sum (DeepSeek-V3's promotion of the accumulation every 128 elements).
Both operands are K-major (contracted over their last axis), as FP8 `wgmma` requires. Scales
are given per row and chunk: a 1 x 128 tile scale as it is, a 128 x 128 block scale repeated
over its block's rows (`expand_rows`). Several `(rhs, rhs_scale)` terms share each tile of
`lhs` in shared memory: the residual recipe's `A.W_hi * s_hi + A.W_lo * s_lo` in one kernel.

One CTA (one warpgroup) computes a `tile_m x tile_n` output tile; a TMA pipeline streams the
`block_k`-wide tiles of both operands and their scales. Shapes need not be multiples of the
tiles: operands are zero-padded outside the kernel and the output cropped, which leaves the
math that of the unpadded operands. `tile_m=64` keeps every register in place (ptxas
reports no spills); 128-row tiles spill (see `tests/test_kernels.py`).

On a CPU the kernel runs in Mosaic GPU's interpreter (`interpret=True`), slowly, for tests.
From JAX 0.11 on the interpreter runs the GPU's code as it is (`wgmma` on the transposed
view, scale vectors loaded in `wgmma`'s register layout); JAX 0.10's cannot, and there
(`substitutes`) the MMA of a tile is a float32 `dot_general` of the same FP8 tiles and the
scale vectors are read without a register layout; the pipeline, the copies and the
promotion are the kernel's own either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from ..core import mosaic_private
from . import BLOCK_GEMM_NAME
from .dispatch import interpreting

#: Output tile rows and columns of one CTA, and the contraction chunk, by default.
TILE_M, TILE_N, BLOCK_K = 64, 128, 128
#: The FP8 types `wgmma` takes (one for both operands).
FP8_TYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def expand_rows(scale: Array, rows: int, block_rows: int) -> Float[Array, "*B rows chunks"]:
    """Per-block scales `(*B, ceil(rows / block_rows), chunks)` as one scale per row and
    chunk."""
    return jnp.repeat(scale.astype(jnp.float32), block_rows, axis=-2)[..., :rows, :]


def pad_to(a: Array, rows: int, cols: int) -> Array:
    """`a` (2-D) zero-padded to `(rows, cols)`: the kernels' tiles divide their operands."""
    pad_r, pad_c = rows - a.shape[0], cols - a.shape[1]
    return jnp.pad(a, ((0, pad_r), (0, pad_c))) if pad_r or pad_c else a


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, math.ceil(n / multiple) * multiple)


def wgmma_takes(*dtypes: jnp.dtype) -> bool:
    """Whether one `wgmma` multiplies operands of `dtypes`: one type, or E4M3 with E5M2 where
    Mosaic GPU takes the pair (`mosaic_private.mixed_fp8_wgmma`: JAX 0.11 on)."""
    kinds = {jnp.dtype(d) for d in dtypes}
    if len(kinds) <= 1:
        return True
    return kinds <= set(FP8_TYPES) and mosaic_private.mixed_fp8_wgmma()


def check_operands(
    who: str,
    lhs: Array,
    lhs_scale: Array,
    terms: Sequence,
    block_k: int,
    block_rows: tuple[int, int] = (1, 1),
) -> None:
    """Raise `ValueError`, naming `who`, unless the operands are what a block-scaled kernel
    takes: 2-D FP8 of one type contracted over their last axis, one scale per chunk and row
    (per `block_rows` rows: `(lhs, rhs)`, 1 or a 128 x 128 block's 128)."""
    m, k = lhs.shape
    chunks = math.ceil(k / block_k)
    if not terms:
        raise ValueError(f"{who} needs at least one (rhs, rhs_scale) term.")
    check_block_rows(who, block_rows)
    operands = [("lhs", lhs, lhs_scale, m, block_rows[0])] + [
        (f"rhs {i}", rhs, scale, rhs.shape[0] if rhs.ndim == 2 else -1, block_rows[1])
        for i, (rhs, scale) in enumerate(terms)
    ]
    for name, data, scale, rows, per in operands:
        if data.ndim != 2 or data.shape[1] != k:
            raise ValueError(
                f"{who}: {name} has shape {data.shape}; operands must be 2-D and "
                f"contracted over their last axis, of size K={k} like lhs."
            )
        if jnp.dtype(data.dtype) not in FP8_TYPES:
            raise ValueError(
                f"{who}: {name} is {data.dtype}; FP8 wgmma takes float8_e4m3fn or float8_e5m2."
            )
        if scale.shape != (-(-rows // per), chunks):
            rows_per = "row" if per == 1 else f"{per} rows"
            raise ValueError(
                f"{who}: {name}'s scale has shape {scale.shape}; it should hold one scale per "
                f"{rows_per} and {block_k}-chunk of K: {(-(-rows // per), chunks)}."
            )
    dtypes = {jnp.dtype(d.dtype).name for _, d, _, _, _ in operands}
    if not wgmma_takes(*dtypes):
        raise ValueError(
            f"{who}: operands in {sorted(dtypes)}; this JAX's Mosaic GPU wgmma takes one "
            "FP8 type for both operands (mixed E5M2 x E4M3 GEMMs stay on the XLA path)."
        )
    n = terms[0][0].shape[0]
    if any(rhs.shape[0] != n for rhs, _ in terms):
        raise ValueError(
            f"{who}: the rhs terms have rows {[r.shape[0] for r, _ in terms]}; "
            "they must all have the same N."
        )


def check_block_rows(who: str, block_rows: tuple[int, int]) -> None:
    """Raise `ValueError`, naming `who`, unless `block_rows` is two positive ints."""
    if not (
        isinstance(block_rows, tuple)
        and len(block_rows) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_rows)
    ):
        raise ValueError(
            f"{who}: block_rows={block_rows!r}; expected (lhs rows, rhs rows) per scale, two "
            "positive ints: (1, 1) for scales per row, (1, 128) for a 128 x 128-block rhs."
        )


def block_scaled_gemm(
    lhs: Array,
    lhs_scale: Array,
    terms: Sequence[tuple[Array, Array]],
    *,
    out_dtype=jnp.float32,
    tile_m: int = TILE_M,
    tile_n: int = TILE_N,
    block_k: int = BLOCK_K,
    max_concurrent_steps: int = 2,
    block_rows: tuple[int, int] = (1, 1),
    interpret: bool | None = None,
) -> Array:
    """`sum_t (lhs . rhs_t)` with per-row, per-`block_k` scales (see the module docstring).

    `lhs (M, K)` and each `rhs (N, K)` are FP8; `lhs_scale (M, ceil(K / block_k))` and each
    `rhs_scale (N, ceil(K / block_k))` float32 multipliers that turn a chunk's FP8 product
    back into real values (a `QTensor`'s `scale_inv`); with `block_rows=(r_lhs, r_rhs)`
    one per `r` rows instead (`(ceil(M / r_lhs), chunks)`: 128 x 128 blocks' scales).
    Returns `(M, N)` in `out_dtype`. `interpret`: run in Mosaic GPU's interpreter (on a
    CPU); `None` follows [`interpreted`][fp8jax._src.kernels.dispatch.interpreted].
    """
    interpret = interpreting() if interpret is None else interpret
    check_operands("block_scaled_gemm", lhs, lhs_scale, terms, block_k, block_rows)
    lhs_scale, terms = per_row(lhs, lhs_scale, terms, block_rows)
    (m, k), n = lhs.shape, terms[0][0].shape[0]
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, block_k)
    chunks = kp // block_k
    operands = [pad_to(lhs, mp, kp), pad_to(lhs_scale.astype(jnp.float32), mp, chunks).T]
    for rhs, scale in terms:
        operands += [pad_to(rhs, np_, kp), pad_to(scale.astype(jnp.float32), np_, chunks).T]
    out = _kernel(
        operands,
        len(terms),
        out_shape=(mp, np_),
        out_dtype=jnp.dtype(out_dtype),
        tiles=(tile_m, tile_n, block_k),
        steps=min(max_concurrent_steps, chunks),
        interpret=interpret,
    )
    return out[:m, :n]


def experts_per_row(rhs: Array, rhs_scale: Array, block_rows: int, who: str) -> Array:
    """A grouped GEMM's `rhs_scale (G, ceil(N / block_rows), chunks)` as one scale per row
    of each expert's `rhs (G, N, K)`; `ValueError` naming `who` for another shape."""
    check_block_rows(who, (1, block_rows))
    (g, n), chunks = rhs.shape[:2], rhs_scale.shape[-1]
    want = (g, -(-n // block_rows), chunks)
    if rhs_scale.shape != want:
        raise ValueError(
            f"{who}: rhs_scale has shape {rhs_scale.shape}; expected {want} (one scale per "
            f"expert, {block_rows} row(s) and chunk)."
        )
    return expand_rows(rhs_scale, n, block_rows)


def per_row(lhs: Array, lhs_scale: Array, terms: Sequence, block_rows: tuple[int, int]):
    """`lhs_scale` and `terms` with every scale given per row (`expand_rows` of those given
    per `block_rows` rows)."""
    lhs_scale = expand_rows(lhs_scale, lhs.shape[0], block_rows[0])
    return lhs_scale, [(b, expand_rows(sb, b.shape[0], block_rows[1])) for b, sb in terms]


def operand_tiling(dtype, block_k: int) -> tuple:
    """Shared-memory transforms of a `(rows, block_k)` operand tile: 8-row tiles, swizzled."""
    swizzle = plgpu.find_swizzle(block_k * jnp.dtype(dtype).itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def out_tiling(out_dtype, tile_n: int) -> tuple:
    """Shared-memory transforms of a `(tile_m, tile_n)` output tile."""
    bits = jnp.dtype(out_dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(tile_n * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def substitutes(interpret: bool) -> bool:
    """Whether a kernel interpreted (`interpret`) replaces the steps this JAX's interpreter
    cannot run (`scale_vector`, `chunk_product`, `zeros_acc`): JAX 0.10 only."""
    return interpret and not mosaic_private.interpreter_runs_gpu_path()


def scale_vector(ref, axis: int, interpret: bool) -> Array:
    """A tile's scales, laid out to broadcast over the accumulator's `axis` (0: one per
    column, 1: one per row)."""
    if interpret:  # the interpreter has no rule for a load with a register layout
        return ref[...]
    return mosaic_private.load(ref, layout=plgpu.Layout.WGMMA.reduce(axis))


def chunk_product(a_tile, b_tile, shape: tuple[int, int], interpret: bool) -> Array:
    """`a_tile (tile_m, k) . b_tile (tile_n, k)^T` as a fresh float32 accumulator."""
    if interpret:  # nor for wgmma on a transposed shared-memory view
        return lax.dot_general(
            a_tile[...], b_tile[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_tile, b_tile.transpose((1, 0)))
        return acc_ref[...]  # waits for the wgmma

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def scale_product(sa: Array, sb: Array, shape: tuple[int, int]) -> Float[Array, "M N"]:
    """`sa[:, None] * sb[None, :]` over an accumulator of `shape`. A scale that is one for
    the whole tile (a 0-d `sa` or `sb`: a 128 x 128 block's) is multiplied into the other
    first, which spares a multiply per accumulator element."""
    if jnp.ndim(sa) == 0 or jnp.ndim(sb) == 0:
        along = [0] if jnp.ndim(sa) else [1] if jnp.ndim(sb) else []
        return lax.broadcast_in_dim(sa * sb, shape, along)
    return lax.broadcast_in_dim(sa, shape, [0]) * lax.broadcast_in_dim(sb, shape, [1])


def scaled_add(acc: Array, part: Array, sa: Array, sb: Array) -> Array:
    """`acc + part * sa[:, None] * sb[None, :]`: a chunk's product promoted to the sum."""
    return acc + part * scale_product(sa, sb, part.shape)


def promoted_under_wgmma(acc: Array, a_tile, b_tile, sa_ref, sb_ref, sa_at, sb_at, shape) -> Array:
    """`acc` plus a 128-chunk's product (`a_tile (tile_m, 128) . b_tile (tile_n, 128)^T`,
    scales `sa_ref[0, sa_at]`, `sb_ref[0, sb_at]`) with the scales loaded and multiplied
    while its `wgmma` runs: issued first, the scale products next, then waited for, which
    leaves one FMA per accumulator element after the wait (`PersistentConfig`'s
    `scales_under_wgmma`). The same sum as `scaled_add` of `chunk_product`."""

    def mma(part):
        plgpu.wgmma(part, a_tile, b_tile.transpose((1, 0)))
        scale = scale_product(sa_ref[0, sa_at], sb_ref[0, sb_at], shape)
        return acc + mosaic_private.wgmma_load(part, wait_n=0) * scale

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def promoted_pair(acc: Array, a_tile, b_tile, sa_ref, sb_ref, sa_at, sb_at, shape) -> Array:
    """`acc` plus two 128-chunks' products (`a_tile (tile_m, 256) . b_tile (tile_n, 256)^T`,
    scales `sa_ref[j, sa_at]`, `sb_ref[j, sb_at]` for chunk `j`: the tile's rows and
    columns, or one index where a scale covers the tile), both `wgmma` issued first and the
    first promoted while the second runs (`mosaic_private.wgmma_load`)."""
    halves = [pl.ds(0, BLOCK_K), pl.ds(BLOCK_K, BLOCK_K)]

    def pair(*parts):
        for part, half in zip(parts, halves, strict=True):
            plgpu.wgmma(part, a_tile.at[:, half], b_tile.at[:, half].transpose((1, 0)))
        total = acc
        for j, part in enumerate(parts):
            value = mosaic_private.wgmma_load(part, wait_n=1 - j)
            total = scaled_add(total, value, sa_ref[j, sa_at], sb_ref[j, sb_at])
        return total

    return pl.run_scoped(pair, *[plgpu.ACC(shape, jnp.float32)] * 2)


def zeros_acc(shape: tuple[int, int], interpret: bool) -> Array:
    """A float32 accumulator of zeros in registers, in `wgmma`'s layout."""
    acc = jnp.zeros(shape, jnp.float32)
    return acc if interpret else plgpu.layout_cast(acc, plgpu.Layout.WGMMA)


def store(acc: Array, out_smem, dst) -> None:
    """Write the accumulator, in the output's dtype, to the global-memory window `dst`."""
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0)


def copy_rows(out_smem, out_gmem, row0, start, stop, cols) -> None:
    """Copy rows `[start, stop)` of the output tile in `out_smem` (written and committed) to
    rows `row0 + [start, stop)`, columns `cols` of `out_gmem`, and no other row: a tile shared
    by two experts' rows, or holding the output's last rows, stores only its own. TMA copies
    have static shapes, so the rows go as one copy per set bit of `stop - start` (64 rows,
    32, ..., 1), as in JAX's `ragged_dot_mgpu`. `out_smem` is untransformed (a copy may start
    at any row); the caller waits for the copies."""
    size, at = stop - start, start
    bit = 1 << (out_smem.shape[0].bit_length() - 1)
    while bit:

        @pl.when((size & bit) != 0)
        def _(at=at, bit=bit):
            dst = out_gmem.at[pl.ds(row0 + at, bit), cols]
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(at, bit)], dst)

        at = at + (size & bit)
        bit //= 2


def _kernel(operands, n_terms, *, out_shape, out_dtype, tiles, steps, interpret):
    tile_m, tile_n, block_k = tiles
    mp, np_ = out_shape
    chunks = operands[1].shape[0]
    fp8_tiling = operand_tiling(operands[0].dtype, block_k)
    substitute = substitutes(interpret)

    def body(*refs):
        a_gmem, a_scale_gmem, *rest = refs
        b_gmem, (out_gmem, out_smem) = rest[: 2 * n_terms], rest[2 * n_terms :]
        m, n = lax.axis_index("m"), lax.axis_index("n")

        def step(_, a_tile, a_scale, *rest):
            *b_tiles, acc = rest
            sa = scale_vector(a_scale, 1, substitute)
            for t in range(n_terms):
                part = chunk_product(a_tile, b_tiles[2 * t], (tile_m, tile_n), substitute)
                acc = scaled_add(acc, part, sa, scale_vector(b_tiles[2 * t + 1], 0, substitute))
            return acc

        in_specs = [
            plgpu.BlockSpec((tile_m, block_k), lambda c: (m, c), transforms=fp8_tiling),
            plgpu.BlockSpec((None, tile_m), lambda c: (c, m)),
        ]
        for _ in range(n_terms):
            in_specs += [
                plgpu.BlockSpec((tile_n, block_k), lambda c: (n, c), transforms=fp8_tiling),
                plgpu.BlockSpec((None, tile_n), lambda c: (c, n)),
            ]
        acc = plgpu.emit_pipeline(
            step,
            grid=(chunks,),
            in_specs=in_specs,
            max_concurrent_steps=steps,
            init_carry=zeros_acc((tile_m, tile_n), substitute),
        )(a_gmem, a_scale_gmem, *b_gmem)
        store(acc, out_smem, out_gmem.at[pl.ds(m * tile_m, tile_m), pl.ds(n * tile_n, tile_n)])

    body.__name__ = body.__qualname__ = BLOCK_GEMM_NAME
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_types=[
            plgpu.SMEM((tile_m, tile_n), out_dtype, transforms=out_tiling(out_dtype, tile_n))
        ],
        grid=(mp // tile_m, np_ // tile_n),
        grid_names=("m", "n"),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(*operands)

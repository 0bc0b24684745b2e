"""FP8 ragged dots: the three GEMMs of a grouped (mixture-of-experts) layer, on FP8 operands.

Tokens are the rows of the activation, sorted by expert: `group_sizes[e]` consecutive rows
belong to expert `e`. Two shapes of ragged dot cover the three GEMMs:

- **rows** (forward and dgrad): `lhs (M, C) . rhs[e] (F, C)` for each row's expert `e`,
  contracting `C`, into `(M, F)`; `lax.ragged_dot_general` with the rows ragged;
- **tokens** (wgrad): `lhs[rows of e]^T . rhs[rows of e]` for every expert, contracting the
  tokens, into `(G, A, B)`; `lax.ragged_dot_general` with the contracting axis ragged.

Both operands reach the ragged dot as FP8 arrays; the scales are applied to its float32 (or
output-dtype) result. Per-tensor recipes run one ragged dot per GEMM: a row of the forward and
the dgrad is scaled by its own expert's kernel scale, and the wgrad by one scalar. Block
recipes cut the contraction into chunks of their block size and run one ragged dot per chunk
(several chunks per dot as a batch axis, in a `lax.scan` with a float32 accumulator, as
`fp8jax._src.recipes.block_dot.block_dot` does for dense GEMMs), each partial scaled by its
blocks' scales: DeepSeek-V3's promotion of the accumulation to float32 every 128 elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ..core import jax_private
from ..kernels import GROUPED_ROWS_NAME, GROUPED_TOKENS_NAME, dispatch
from ..kernels.partition import Dim, GemmDims
from ..recipes import BlockScaledRecipe, PerTensorRecipe, QTensor, Recipe
from ..recipes.base import Axis
from ..recipes.block_dot import contract_last, pad_to_blocks, quantized_k_major
from .grouped_native import native_rows, native_tokens
from .ragged_dot_general import ragged_dot_general

# lhs (M, C) . rhs (G, F, C): both contract C; rhs grouped on axis 0, lhs ragged on its rows.
_ROWS = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
# lhs (M, A) . rhs (M, B) contracting the ragged rows: output (G, A, B).
_TOKENS = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())


def token_tile(recipe: BlockScaledRecipe) -> int:
    """A block recipe's tile along the tokens (the wgrad's contraction)."""
    return recipe.block_for("input", -2)[0]


def chunk_group_sizes(
    group_sizes: Int[Array, " G"], chunks: int, chunk: int
) -> Int[Array, "chunks G"]:
    """How many rows of each group fall in each chunk of `chunk` consecutive rows."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = jnp.arange(chunks, dtype=ends.dtype)[:, None] * chunk
    hi = lo + chunk
    return jnp.maximum(jnp.minimum(ends, hi) - jnp.maximum(starts, lo), 0)


def _scaled(dot: Callable[[Any], Array], scale: Array, out_dtype: Any, exact_scales: bool) -> Array:
    """`dot(accumulator_dtype) * scale` in `out_dtype`, as `per_tensor_dot` forms it: the FP8
    dot writes `out_dtype` and is scaled there when that is exact (float32, or power-of-two
    scales in a type with float32's range); otherwise in float32, then converted."""
    out_dtype = jnp.dtype(out_dtype)
    f32 = jnp.finfo(jnp.float32)
    direct = out_dtype == f32.dtype or (exact_scales and jnp.finfo(out_dtype).maxexp >= f32.maxexp)
    if direct:
        return dot(out_dtype) * scale.astype(out_dtype)
    return (dot(jnp.float32) * scale).astype(out_dtype)


def _rows_dims(rhs_axis: Axis) -> lax.RaggedDotDimensionNumbers:
    """`_ROWS` for a per-expert `rhs (G, ., .)` contracted on `rhs_axis`."""
    return lax.RaggedDotDimensionNumbers((((1,), (3 + rhs_axis,)), ((), ())), (0,), (0,))


def per_tensor_rows(
    lhs: QTensor,
    rhs: QTensor,
    rhs_axis: Axis,
    group_sizes: Int[Array, " G"],
    experts: Int[Array, " M"],
    precision: Any,
    out_dtype: Any,
    exact_scales: bool,
) -> Float[Array, "M F"]:
    """The rows GEMM of per-tensor FP8 operands: `lhs (M, C)` with one scale, `rhs (G, ., .)`
    with one scale per expert, contracted on `rhs_axis`. Row `m` of the result is scaled by
    `lhs.scale_inv * rhs.scale_inv[experts[m]]`."""
    scale = lhs.scale_inv.astype(jnp.float32) * rhs.scale_inv.astype(jnp.float32)[experts]
    dims = _rows_dims(rhs_axis)

    def dot(dtype: Any) -> Array:
        return ragged_dot_general(lhs.data, rhs.data, group_sizes, dims, precision, dtype)

    return _scaled(dot, scale[:, None], out_dtype, exact_scales)


def per_tensor_tokens(
    lhs: QTensor,
    rhs: QTensor,
    group_sizes: Int[Array, " G"],
    precision: Any,
    out_dtype: Any,
    exact_scales: bool,
) -> Float[Array, "G A B"]:
    """The tokens GEMM of per-tensor FP8 operands `lhs (M, A)`, `rhs (M, B)`: one scalar
    scale for all experts."""
    scale = lhs.scale_inv.astype(jnp.float32) * rhs.scale_inv.astype(jnp.float32)

    def dot(dtype: Any) -> Array:
        return ragged_dot_general(lhs.data, rhs.data, group_sizes, _TOKENS, precision, dtype)

    return _scaled(dot, scale, out_dtype, exact_scales)


def _shared_chunk(a: int, b: int, what: str) -> int:
    if a != b:
        raise ValueError(
            f"grouped block GEMM: the operands' blocks along the {what} are {a} and {b}; both "
            "operands must share the contraction's block size."
        )
    return a


def _chunked(total: int, chunk: int, chunks_per_dot: int | None) -> tuple[int, int]:
    """(chunks of `chunk` in `total`, chunks per dot), the chunk count padded to a multiple of
    the second."""
    n = math.ceil(total / chunk)
    group = n if chunks_per_dot is None else min(chunks_per_dot, n)
    return math.ceil(n / group) * group, group


def _accumulate(partial_sum: Callable[..., Array], xs: tuple, steps: int, shape: tuple) -> Array:
    """`sum(partial_sum(*x) for x in xs)`: one call when `steps` is 1, else a `lax.scan` with
    a float32 accumulator over the leading axis of `xs`."""
    if steps == 1:
        return partial_sum(*(a[0] for a in xs))

    def step(acc: Array, x: tuple) -> tuple[Array, None]:
        return acc + partial_sum(*x), None

    total = jax_private.varying_like(jnp.zeros(shape, jnp.float32), xs)
    return lax.scan(step, total, xs)[0]


def _steps(a: Array, axis: int, group: int) -> Array:
    """`a`'s axis `axis` of `steps * group` chunks as `(steps, ..., group, ...)`."""
    shape = a.shape[:axis] + (a.shape[axis] // group, group) + a.shape[axis + 1 :]
    return jnp.moveaxis(a.reshape(shape), axis, 0)


def block_rows(
    lhs: QTensor,
    rhs: QTensor,
    group_sizes: Int[Array, " G"],
    experts: Int[Array, " M"],
    precision: Any,
    chunks_per_dot: int | None,
) -> Float[Array, "M F"]:
    """The rows GEMM of block-scaled FP8 operands, both contracted on their last axis:
    `lhs (M, C)`, `rhs (G, F, C)` with blocks per expert. One ragged dot per chunk of the
    contraction (`chunks_per_dot` at a time), each float32 partial multiplied by the scales of
    its row's tile and of its row's expert's block, summed in float32."""
    chunk = _shared_chunk(lhs.block[1], rhs.block[1], "contraction")
    (m, c), (g, f) = lhs.data.shape, rhs.data.shape[:2]
    if c == 0:
        return jnp.zeros((m, f), jnp.float32)
    nc, group = _chunked(c, chunk, chunks_per_dot)
    # Chunks first: (chunks, M, B) and (chunks, G, F, B), the group sizes given per chunk.
    # (XLA's GPU ragged-dot rewriter fails its HLO verifier when the batch axis is not the
    # leading one of both operands, or when group_sizes is (G,) with a batch axis.)
    lhs_data = pad_to_blocks(lhs.data, (1, chunk * nc)).reshape(m, nc, chunk)
    lhs_data = jnp.moveaxis(lhs_data, 1, 0)
    rhs_data = pad_to_blocks(rhs.data, (1, chunk * nc)).reshape(g, f, nc, chunk)
    rhs_data = jnp.moveaxis(rhs_data, 2, 0)
    # Scales per (chunk, row); padded chunks (zeros) get scale 0.
    s_lhs = jnp.repeat(lhs.scale_inv.astype(jnp.float32), lhs.block[0], axis=-2)[:m]
    s_rhs = jnp.repeat(rhs.scale_inv.astype(jnp.float32), rhs.block[0], axis=-2)[:, :f]
    s_lhs = jnp.moveaxis(pad_to_blocks(s_lhs, (1, nc)), -1, 0)  # (chunks, M)
    s_rhs = jnp.moveaxis(pad_to_blocks(s_rhs, (1, nc)), -1, 0)  # (chunks, G, F)
    sizes = jnp.broadcast_to(group_sizes, (nc, g))
    dims = lax.RaggedDotDimensionNumbers((((2,), (3,)), ((0,), (0,))), (1,), (1,))

    def partial_sum(lhs_data, rhs_data, s_lhs, s_rhs, sizes) -> Array:
        partial = ragged_dot_general(lhs_data, rhs_data, sizes, dims, precision, jnp.float32)
        # Each row's own expert's block scales, (chunks, M, F): the XLA path's price for
        # per-expert weight scales (a native kernel applies them in registers).
        scales = s_lhs[..., None] * s_rhs[:, experts]
        return jnp.sum(partial * scales, axis=0)

    xs = tuple(_steps(v, 0, group) for v in (lhs_data, rhs_data, s_lhs, s_rhs, sizes))
    return _accumulate(partial_sum, xs, nc // group, (m, f))


def block_tokens(
    lhs: QTensor,
    rhs: QTensor,
    group_sizes: Int[Array, " G"],
    precision: Any,
    chunks_per_dot: int | None,
) -> Float[Array, "G A B"]:
    """The tokens GEMM of block-scaled FP8 operands `lhs (M, A)`, `rhs (M, B)`, both tiled
    along the tokens. One ragged dot per chunk of tokens: the tokens of each expert in the
    chunk contracted, scaled by the chunk's tile scales, summed in float32. The grouped
    layer's backward gives it operands padded so that each expert's tokens fill whole
    chunks (DeepSeek-V3's layout: no tile's amax comes from another expert's tokens); a
    chunk that spans two experts would share its tiles' scales between them."""
    chunk = _shared_chunk(lhs.block[0], rhs.block[0], "tokens")
    (m, a), b, g = lhs.data.shape, rhs.data.shape[1], group_sizes.shape[0]
    if m == 0:
        return jnp.zeros((g, a, b), jnp.float32)
    nm, group = _chunked(m, chunk, chunks_per_dot)
    lhs_data = pad_to_blocks(lhs.data, (chunk * nm, 1)).reshape(nm, chunk, a)
    rhs_data = pad_to_blocks(rhs.data, (chunk * nm, 1)).reshape(nm, chunk, b)
    s_lhs = jnp.repeat(lhs.scale_inv.astype(jnp.float32), lhs.block[1], axis=-1)[:, :a]
    s_rhs = jnp.repeat(rhs.scale_inv.astype(jnp.float32), rhs.block[1], axis=-1)[:, :b]
    s_lhs, s_rhs = (pad_to_blocks(s, (nm, 1)) for s in (s_lhs, s_rhs))
    sizes = chunk_group_sizes(group_sizes, nm, chunk)
    # Chunks as a batch axis: (chunks, T, A) . (chunks, T, B) over a chunk's T tokens,
    # into (G, chunks, A, B).
    dims = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((0,), (0,))), (1,), ())

    def partial_sum(lhs_data: Array, rhs_data: Array, s_lhs: Array, s_rhs: Array, sizes) -> Array:
        partial = ragged_dot_general(lhs_data, rhs_data, sizes, dims, precision, jnp.float32)
        return jnp.sum(partial * s_lhs[None, :, :, None] * s_rhs[None, :, None, :], axis=1)

    xs = tuple(_steps(v, 0, group) for v in (lhs_data, rhs_data, s_lhs, s_rhs, sizes))
    return _accumulate(partial_sum, xs, nm // group, (g, a, b))


def dequantized_rows(
    lhs: QTensor, rhs: QTensor, group_sizes: Int[Array, " G"]
) -> Float[Array, "M F"]:
    """The rows GEMM as one float32 ragged dot of the dequantized operands (the block
    recipes' `dequantized_dot` emulation: the same FP8 values, float32 accumulation)."""
    highest = lax.Precision.HIGHEST  # float32, not TF32, on a GPU
    return ragged_dot_general(
        lhs.dequantize(), rhs.dequantize(), group_sizes, _ROWS, highest, jnp.float32
    )


def dequantized_tokens(
    lhs: QTensor, rhs: QTensor, group_sizes: Int[Array, " G"]
) -> Float[Array, "G A B"]:
    """The tokens GEMM as one float32 ragged dot of the dequantized operands."""
    highest = lax.Precision.HIGHEST
    return ragged_dot_general(
        lhs.dequantize(), rhs.dequantize(), group_sizes, _TOKENS, highest, jnp.float32
    )


def promotes(precision: Any) -> bool:
    """Whether the kernels promote a per-tensor contraction to float32 every chunk: where the
    dot's `precision` asks for more than the default, as the recipes'
    `backward_precision="highest"` (their default) does for the dgrad and wgrad. On cuBLASLt
    that precision turns FP8 fast accumulation off (Transformer Engine's split accumulator
    for gradients); FP8 `wgmma` accumulates with less than float32's precision. An algorithm
    (`lax.DotAlgorithmPreset`, `lax.DotAlgorithm`) asks for more unless it allows imprecise
    (fast) accumulation."""
    if precision is None:
        return False
    precision = jax_private.canonical_precision(precision)
    if isinstance(precision, lax.DotAlgorithm):
        return not precision.allow_imprecise_accumulation
    if isinstance(precision, lax.DotAlgorithmPreset):  # FP8's fast accumulation, or none asked
        fast = (lax.DotAlgorithmPreset.DEFAULT, lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM)
        return precision not in fast
    return any(p != lax.Precision.DEFAULT for p in precision)


def per_tensor_k_major(data: Array, axis: Axis, lhs_dtype: Any) -> Array:
    """A per-tensor expert weight's FP8 `data (G, ., .)` with its contracted `axis` last, for
    the rows kernel. Where the kernel multiplies it in FP8 (with an lhs of `lhs_dtype`), the
    transpose is left free, so that XLA writes the dgrad's copy in the pass that quantizes the
    weight for the forward (one read of the weight, no FP8 transpose: 0.94 GB less on
    moe_cost.py's Mixtral-like layer with E4M3 gradients). Where it upcasts both to BF16
    (E5M2 gradients on JAX 0.10), the transpose stays pinned (`dispatch.k_major`): left free
    there, XLA moved it into the forward's quantization and kept more (+0.9 GB there)."""
    from ..kernels.block_gemm import wgmma_takes

    if axis == -1 or not wgmma_takes(data.dtype, lhs_dtype):
        return dispatch.k_major(data, axis)
    return jnp.swapaxes(data, -1, -2)


def rows_dot(
    recipe: Recipe,
    lhs: QTensor,
    rhs: QTensor,
    rhs_axis: Axis,
    group_sizes: Int[Array, " G"],
    experts: Int[Array, " M"],
    precision: Any,
    out_dtype: Any,
    native: bool | None = False,
) -> Float[Array, "M F"]:
    """The forward (`rhs_axis=-1`) or dgrad (`-2`) of a grouped layer: `lhs (M, C)` (from
    `recipe.quantize`, contracted on its last axis) times each row's expert's `rhs (G, ., .)`
    (quantized per expert, laid out to be contracted on `rhs_axis`), in `out_dtype`. `native`:
    the `dispatch.choose` option for the Hopper kernel (see `grouped_rules.native_choice`)."""

    def native_path(
        lhs: QTensor, rhs: QTensor, group_sizes: Array, experts: Array, out_dtype: Any
    ) -> Array:
        del experts
        if rhs.block:
            rhs = quantized_k_major(rhs, rhs_axis, per_expert=True)
        else:
            rhs = QTensor(per_tensor_k_major(rhs.data, rhs_axis, lhs.data.dtype), rhs.scale_inv)
        return native_rows(lhs, rhs, group_sizes, out_dtype, promotes(precision))

    def xla_path(lhs: QTensor, rhs: QTensor, group_sizes: Array, experts: Array) -> Array:
        if isinstance(recipe, PerTensorRecipe):
            exact = recipe.power_of_two
            return per_tensor_rows(
                lhs, rhs, rhs_axis, group_sizes, experts, precision, out_dtype, exact
            )
        rhs = contract_last(rhs, rhs_axis)
        if recipe.dequantized_dot:
            return dequantized_rows(lhs, rhs, group_sizes).astype(out_dtype)
        out = block_rows(lhs, rhs, group_sizes, experts, precision, recipe.chunks_per_dot)
        return out.astype(out_dtype)

    names = ("g", "n", "k") if rhs_axis == -1 else ("g", "k", "n")
    arrays = _dims(lhs, ("m", "k")) + _dims(rhs, names)
    dims = GemmDims((*arrays, (("g", 1),), (("m", 1),)), ("m", "n"), (len(arrays), "m"))
    operands = (lhs, rhs, group_sizes, experts)
    kernel = {"dims": dims, "out_dtype": out_dtype, "name": GROUPED_ROWS_NAME}
    return dispatch.choose(native, native_path, xla_path, *operands, **kernel)


def tokens_dot(
    recipe: Recipe,
    lhs: QTensor,
    rhs: QTensor,
    group_sizes: Int[Array, " G"],
    precision: Any,
    out_dtype: Any,
    native: bool | None = False,
) -> Float[Array, "G A B"]:
    """The wgrad of a grouped layer: `lhs (M, A)` and `rhs (M, B)`, both laid out to be
    contracted over their tokens (axis -2), multiplied over each expert's tokens. Under a
    block recipe each group size is a multiple of the token tile (the layout of
    `native.pad_layout`, made by the layer's backward)."""

    def native_path(lhs: QTensor, rhs: QTensor, group_sizes: Array, out_dtype: Any) -> Array:
        return native_tokens(lhs, rhs, group_sizes, out_dtype, promotes(precision))

    def xla_path(lhs: QTensor, rhs: QTensor, group_sizes: Array) -> Array:
        if isinstance(recipe, PerTensorRecipe):
            exact = recipe.power_of_two
            return per_tensor_tokens(lhs, rhs, group_sizes, precision, out_dtype, exact)
        if recipe.dequantized_dot:
            return dequantized_tokens(lhs, rhs, group_sizes).astype(out_dtype)
        out = block_tokens(lhs, rhs, group_sizes, precision, recipe.chunks_per_dot)
        return out.astype(out_dtype)

    arrays = _dims(lhs, ("k", "m")) + _dims(rhs, ("k", "n"))
    dims = GemmDims((*arrays, (("g", 1),)), ("g", "m", "n"), (len(arrays), "k"))
    kernel = {"dims": dims, "out_dtype": out_dtype, "name": GROUPED_TOKENS_NAME}
    return dispatch.choose(native, native_path, xla_path, lhs, rhs, group_sizes, **kernel)


def _dims(q: QTensor, names: tuple[str, ...]) -> list[tuple[Dim, ...]]:
    """The axes of `q`'s data (named `names`) and of its scale (one, one per expert, or one
    per block), for running a grouped kernel per shard (`kernels/partition.py`)."""
    data = tuple((n, 1) for n in names)
    if q.scale_inv.ndim == 0:
        return [data, ()]
    if not q.block:  # one scale per expert
        return [data, data[: q.scale_inv.ndim]]
    blocks = (1,) * (len(names) - len(q.block)) + tuple(q.block)
    return [data, tuple((n, b) for n, b in zip(names, blocks, strict=True))]

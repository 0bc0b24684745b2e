"""Block-scaled GEMMs of two [`fp8jax.QTensor`][]s: in plain XLA and on the native kernel;
the blocks of a block-scaled tensor (their amaxes, quantization, tiles and gathered rows).

In plain XLA (`block_dot`) the contraction is cut into chunks of the block size, one FP8 dot
per chunk (one batched dot) gives float32 partial products, each partial is multiplied by its
blocks' scales and the partials are summed in float32: DeepSeek-V3's promotion of the
accumulation every 128 elements. `native_block_dot` runs the same as one Pallas Mosaic GPU
kernel; `dequantized_block_dot` is a float32 emulation for CPU experiments. Dimensions that
are not multiples of a block are padded with zeros inside, which leaves the math exactly
that of the unpadded tensors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ..core import jax_private
from ..core.formats import expand_blocks, saturate
from ..kernels import block_quantize, dispatch, padded_quantize
from .base import Axis, QTensor


def pad_to_blocks(x: Array, block: tuple[int, int]) -> Array:
    """`x (*B, R, C)` zero-padded to whole `block`s of its last two axes."""
    rows, cols = x.shape[-2:]
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    if pad_r or pad_c:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad_r), (0, pad_c)])
    return x


def _blocked(x: Array, block: tuple[int, int]) -> Array:
    """`x (*B, R, C)` zero-padded and viewed as `(*B, nR, bR, nC, bC)`."""
    x = pad_to_blocks(x, block)
    *batch, rows, cols = x.shape
    return x.reshape(*batch, rows // block[0], block[0], cols // block[1], block[1])


def block_amax(x: Array, block: tuple[int, int]) -> Float[Array, "*B nR nC"]:
    """`max(|x|)` over each `block` of the last two axes of `x`, in float32."""
    return jnp.max(jnp.abs(_blocked(x.astype(jnp.float32), block)), axis=(-3, -1))


def quantize_blocks(x: Array, scale: Array, block: tuple[int, int], dtype) -> Array:
    """`x * scale` per block, finite values saturated to the format's max, cast to `dtype`
    (inf and NaN become NaN: [`fp8jax.quantize`][])."""
    return saturate(x, expand_blocks(scale, block, x.shape), dtype)


def gather_quantized(q: QTensor, rows: Int[Array, " P"]) -> QTensor:
    """`q`'s rows gathered by `rows`, FP8 zeros where negative; `q` in tiles of one row."""
    if not q.block or q.block[0] != 1:
        raise ValueError(f"gather_quantized: blocks {q.block} span rows; tiles of one row.")
    if q.scale_inv.shape[0] == 0:  # no rows: all gaps
        scale_inv = jnp.ones((rows.shape[0], *q.scale_inv.shape[1:]), q.scale_inv.dtype)
    else:  # a gap's scale is a real row's (its data are zeros): E8M0 has no zero
        scale_inv = q.scale_inv[jnp.maximum(rows, 0)]
    return QTensor(padded_quantize.gather_rows(q.data, rows), scale_inv, q.block)


def tile(axis: Axis, size: int) -> tuple[int, int]:
    """The `1 x size` tile along the contracted `axis` -1, `size x 1` along -2."""
    return (1, size) if axis == -1 else (size, 1)


def contract_last(q: QTensor, axis: Axis) -> QTensor:
    """`q` with its contracted axis moved last (a transpose of FP8 data and scales)."""
    if axis == -1:
        return q
    return QTensor(jnp.swapaxes(q.data, -1, -2), jnp.swapaxes(q.scale_inv, -1, -2), q.block[::-1])


def block_dot(
    lhs: QTensor,
    rhs: QTensor,
    lhs_axis: Axis,
    rhs_axis: Axis,
    precision,
    chunks_per_dot: int | None = 1,
) -> Float[Array, "*shape"]:
    """Block-scaled GEMM: one FP8 dot per chunk of the contraction, partials scaled and summed
    in float32. Shape `(*B, lhs_free, rhs_free)`.

    The chunks are taken `chunks_per_dot` at a time (one batched dot holding that many
    float32 `(M, N)` partials) in a `lax.scan` with a float32 accumulator. With 1, the default,
    the partial is no larger than a float32 output; `None` takes every chunk in one batched
    dot, whose partials outweigh the output as many times as K has chunks.
    """
    lhs, rhs = contract_last(lhs, lhs_axis), contract_last(rhs, rhs_axis)
    chunk = _shared_chunk(lhs, rhs)
    (*batch, m, k), n = lhs.data.shape, rhs.data.shape[-2]
    nk = math.ceil(k / chunk)
    if nk == 0:  # an empty contraction: the product is zero
        return jnp.zeros((*batch, m, n), jnp.float32)
    group = nk if chunks_per_dot is None else min(chunks_per_dot, nk)
    nk_padded = math.ceil(nk / group) * group
    lhs_data = pad_to_blocks(lhs.data, (1, chunk * nk_padded)).reshape(*batch, m, nk_padded, chunk)
    rhs_data = pad_to_blocks(rhs.data, (1, chunk * nk_padded)).reshape(*batch, n, nk_padded, chunk)
    # Scales per (row, chunk): repeated along the free axis only, padded chunks scale zeros.
    s_lhs = jnp.repeat(lhs.scale_inv.astype(jnp.float32), lhs.block[0], axis=-2)[..., :m, :]
    s_rhs = jnp.repeat(rhs.scale_inv.astype(jnp.float32), rhs.block[0], axis=-2)[..., :n, :]
    s_lhs, s_rhs = (pad_to_blocks(s, (1, nk_padded)) for s in (s_lhs, s_rhs))
    nb = len(batch)
    # Batch over (*B, chunk); contract within the chunk: partials (*B, chunks, M, N).
    dims = (((nb + 2,), (nb + 2,)), ((*range(nb), nb + 1), (*range(nb), nb + 1)))

    def partial_sum(lhs_data, rhs_data, s_lhs, s_rhs):
        partial = lax.dot_general(
            lhs_data, rhs_data, dims, precision=precision, preferred_element_type=jnp.float32
        )
        scales = (
            jnp.swapaxes(s_lhs, -1, -2)[..., :, None] * jnp.swapaxes(s_rhs, -1, -2)[..., None, :]
        )
        return jnp.sum(partial * scales, axis=-3)

    if group == nk_padded:
        return partial_sum(lhs_data, rhs_data, s_lhs, s_rhs)

    def groups(a: Array, axis: int) -> Array:  # (.., nk_padded, ..) -> (steps, .., group, ..)
        a = a.reshape(a.shape[:axis] + (nk_padded // group, group) + a.shape[axis + 1 :])
        return jnp.moveaxis(a, axis, 0)

    def step(total, xs):
        return total + partial_sum(*xs), None

    xs = (
        groups(lhs_data, nb + 1),
        groups(rhs_data, nb + 1),
        groups(s_lhs, nb + 1),
        groups(s_rhs, nb + 1),
    )
    total = jax_private.varying_like(jnp.zeros((*batch, m, n), jnp.float32), xs)
    return lax.scan(step, total, xs)[0]


def native_block_dot(
    lhs: QTensor, rhs: QTensor, lhs_axis: Axis, rhs_axis: Axis, out_dtype=jnp.float32
) -> Array:
    """`block_dot` as one native kernel (Pallas Mosaic GPU, Hopper `wgmma`): the same FP8
    products and per-block scaling, the float32 accumulation promoted every chunk in
    registers, the output written in `out_dtype`. Shape `(*B, lhs_free, rhs_free)`."""
    from ..kernels.block_gemm import expand_rows  # Pallas: imported on use
    from ..kernels.choice import recipe_block_gemm, weight_block_scales_chosen

    # The kernel takes both operands K-major: a wgrad's (and dgrad's) operand is transposed,
    # as FP8 values (`dispatch.k_major`).
    lhs, rhs = quantized_k_major(lhs, lhs_axis), quantized_k_major(rhs, rhs_axis)
    chunk = _shared_chunk(lhs, rhs)
    # Scales per block of rows as they are (`choice.weight_block_scales`), else per row.
    per_block = weight_block_scales_chosen()
    block_rows = (lhs.block[0], rhs.block[0]) if per_block else (1, 1)

    def gemm(a: Array, sa: Array, b: Array, sb: Array) -> Array:
        kw = dict(out_dtype=out_dtype, block_k=chunk, block_rows=block_rows)
        return recipe_block_gemm(a, sa, [(b, sb)], **kw)

    operands = []
    for q in (lhs, rhs):
        scale = q.scale_inv if per_block else expand_rows(q.scale_inv, q.data.shape[-2], q.block[0])
        operands += [q.data, scale]
    if lhs.data.ndim == 3:
        gemm = jax.vmap(gemm)
    return gemm(*operands)


def quantized_k_major(q: QTensor, axis: Axis, per_expert: bool = False) -> QTensor:
    """`contract_last` for the native kernel: the FP8 data transposed as it is held, except
    tiles along the rows that the one-pass kernels wrote K-major (`BlockwiseScaling`'s
    `quantize_both` and `retile`), whose transpose undoes the kernels' own. The weight kernel
    takes 2-D weights: a 3-D one's blocks came from it only quantized `per_expert` (`vmap`
    of the 2-D weights, a grouped layer's)."""
    if axis == -1:
        return q
    # The shape the kernels' choice saw (`fits`): a weight's own where `per_expert`.
    shape = q.data.shape[-2:] if per_expert else q.data.shape
    written_k_major = (
        (q.block[1] == 1 or (q.block[0] == q.block[1] and (q.data.ndim == 2 or per_expert)))
        and block_quantize.fits(shape, q.block[0])
        and dispatch.per_device_gemm(q.data)
    )
    data = jnp.swapaxes(q.data, -1, -2) if written_k_major else dispatch.k_major(q.data, axis)
    return QTensor(data, jnp.swapaxes(q.scale_inv, -1, -2), q.block[::-1])


def _shared_chunk(lhs: QTensor, rhs: QTensor) -> int:
    if lhs.block[1] != rhs.block[1]:
        raise ValueError(
            f"block_dot: lhs contracts in blocks of {lhs.block[1]} but rhs in blocks of "
            f"{rhs.block[1]}; both operands must share the contraction's block size."
        )
    return lhs.block[1]


def dequantized_block_dot(
    lhs: QTensor, rhs: QTensor, lhs_axis: Axis, rhs_axis: Axis
) -> Float[Array, "*shape"]:
    """The block-scaled GEMM as one float32 dot of the dequantized operands.

    The same FP8 values and scales as `block_dot`, and the same products (exact in float32 for
    power-of-two scales), accumulated in float32 over the whole contraction instead of per
    block. Only float32 rounding differs, some 2**20 times finer than E4M3's. On a CPU, where
    no FP8 hardware runs the GEMM anyway, it is faster (MXFP8 trains the main job's GPT
    faster than with one FP8 dot per block: `benchmarks/RESULTS.md`). It is not an
    FP8 GEMM on a GPU.
    Shape `(*B, lhs_free, rhs_free)`.
    """
    lhs, rhs = contract_last(lhs, lhs_axis), contract_last(rhs, rhs_axis)
    _shared_chunk(lhs, rhs)
    nb = lhs.data.ndim - 2
    dims = (((nb + 1,), (nb + 1,)), (tuple(range(nb)), tuple(range(nb))))
    return lax.dot_general(
        lhs.dequantize(),
        rhs.dequantize(),
        dims,
        precision=lax.Precision.HIGHEST,  # float32, not TF32, on a GPU
        preferred_element_type=jnp.float32,
    )

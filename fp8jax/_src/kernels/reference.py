"""Float64 NumPy references of the native kernels' maths, and the error bounds they meet.

Independent of JAX (NumPy and ml_dtypes only), so that they can judge the kernels wherever
these run: in Mosaic GPU's interpreter (`tests/test_kernels.py`,
`tests/test_grouped_native.py`) and on a GPU (`benchmarks/gpu_check`). Each chunk's product
of FP8 (or 16-bit) values is exact in float32 and the test scales are powers of two, so a
kernel differs from these references only by float32 summation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Relative bound of `block_scaled_gemm` against `block_scaled`, elementwise, on the
#: magnitude (`block_scaled` of the operands' absolute values): float32 sums of a few chunks.
BLOCK_RTOL = 4e-6


def f64(a: object) -> np.ndarray:
    """`a` (any array: FP8, BF16, a JAX array) as float64 NumPy values."""
    return np.asarray(a).astype(np.float64)


def _real(data: object, scale: object, block_k: int) -> np.ndarray:
    data = f64(data)
    return data * np.repeat(f64(scale), block_k, axis=1)[:, : data.shape[1]]


def block_scaled(
    lhs: object, lhs_scale: object, terms: Sequence[tuple[object, object]], block_k: int = 128
) -> np.ndarray:
    """`sum_t (lhs * lhs_scale) . (rhs_t * rhs_scale_t)^T`, each scale per row and `block_k`
    chunk of the contraction: `block_scaled_gemm`'s maths, `(M, N)` float64."""
    a = _real(lhs, lhs_scale, block_k)
    return sum(a @ _real(b, sb, block_k).T for b, sb in terms)


def block_scaled_magnitude(
    lhs: object, lhs_scale: object, terms: Sequence[tuple[object, object]], block_k: int = 128
) -> np.ndarray:
    """`block_scaled` of the absolute values: the scale of each output's summation error."""
    return block_scaled(
        np.abs(f64(lhs)), np.abs(f64(lhs_scale)), [(np.abs(f64(b)), s) for b, s in terms], block_k
    )


def float32_sum_bound(terms: int, magnitude: float) -> float:
    """Bound on the float32 rounding of a sum of `terms` exact products of size up to
    `magnitude` (the grouped kernels' tests: `2 K 2^-24 max|want|`)."""
    return 2 * terms * 2.0**-24 * magnitude


def grouped_rows(
    lhs: object,
    rhs: object,
    items: object,
    *,
    lhs_scale: object | None = None,
    rhs_scale: object | None = None,
    item_scale: object | None = None,
    tile_m: int = 64,
    block_k: int = 128,
) -> np.ndarray:
    """`grouped_rows_gemm`'s maths: for each item `(tile, expert, start, stop)` of `items`
    (a `RowItems`), rows `tile * tile_m + [start, stop)` of `lhs (M, K)` times
    `rhs[expert] (N, K)`, each `block_k` chunk scaled per row (`lhs_scale (M, C)`,
    `rhs_scale (G, N, C)`) or the item once (`item_scale (W,)`); zeros for expert -1.
    `(M, N)` float64, NaN in the rows no item writes (the kernel leaves them unwritten)."""
    a, b = f64(lhs), f64(rhs)
    tiles, experts, starts, stops = (np.asarray(x) for x in items)
    m, k = a.shape
    out = np.full((m, b.shape[1]), np.nan)
    for w, (t, e) in enumerate(zip(tiles, experts, strict=True)):
        rows = slice(tile_m * t + starts[w], tile_m * t + stops[w])
        if e < 0:
            out[rows] = 0.0
            continue
        want = np.zeros((rows.stop - rows.start, b.shape[1]))
        for c in range(-(-k // block_k)):
            cols = slice(block_k * c, min(k, block_k * (c + 1)))
            part = a[rows, cols] @ b[e][:, cols].T
            if item_scale is None:
                part *= f64(lhs_scale)[rows, c][:, None] * f64(rhs_scale)[e][:, c]
            want += part
        out[rows] = want if item_scale is None else want * f64(item_scale)[w]
    return out


def grouped_tokens(
    lhs: object,
    rhs: object,
    chunk_start: object,
    chunk_count: object,
    *,
    lhs_scale: object | None = None,
    rhs_scale: object | None = None,
    group_scale: object | None = None,
    block_k: int = 128,
) -> np.ndarray:
    """`grouped_tokens_gemm`'s maths: `out[e] = lhs[:, tokens of e] . rhs[:, tokens of e]^T`
    over expert `e`'s `chunk_count[e]` chunks of `block_k` tokens from `chunk_start[e]`, each
    chunk scaled per row (`lhs_scale (A, C)`, `rhs_scale (B, C)`) or the expert once
    (`group_scale (G,)`). `(G, A, B)` float64; zeros for an expert without chunks."""
    a, b = f64(lhs), f64(rhs)
    start, count = np.asarray(chunk_start), np.asarray(chunk_count)
    out = np.zeros((len(start), a.shape[0], b.shape[0]))
    for e in range(len(start)):
        for c in range(start[e], start[e] + count[e]):
            cols = slice(block_k * c, block_k * (c + 1))
            part = a[:, cols] @ b[:, cols].T
            if group_scale is None:
                part *= f64(lhs_scale)[:, c][:, None] * f64(rhs_scale)[:, c]
            out[e] += part
        if group_scale is not None:
            out[e] *= f64(group_scale)[e]
    return out

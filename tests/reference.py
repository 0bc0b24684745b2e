"""Independent NumPy + ml_dtypes references for the recipes, on canonical GEMMs.

Canonical form: x (M, K) . w (N, K) -> y (M, N); dgrad g (M, N) . w -> (M, K); wgrad
g^T (N, M) . x (M, K) -> (N, K). Everything here is written from the recipes' documented
definitions, element by element with explicit loops over blocks, in float64 except for the
FP8 rounding itself (ml_dtypes) and the float32 product `x * scale` the cast rounds.
"""

import math

import ml_dtypes
import numpy as np

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAX = {name: float(ml_dtypes.finfo(dtype).max) for name, dtype in FORMATS.items()}


def cast(x, scale, fmt):
    """Real value of fp8(x * scale): the float32 product, saturated, rounded by ml_dtypes."""
    with np.errstate(over="ignore"):
        scaled = np.asarray(x, np.float32) * np.asarray(scale, np.float32)
    scaled = np.clip(scaled, -MAX[fmt], MAX[fmt])
    return scaled.astype(FORMATS[fmt]).astype(np.float64)


def qdq_tensor(x, scale, fmt):
    """Real value of a per-tensor FP8 tensor: data * float32(1 / scale), in float32."""
    inverse = np.float32(1.0) / np.float32(scale)
    return (cast(x, scale, fmt).astype(np.float32) * inverse).astype(np.float64)


def current_scale(amax, fmt, previous=1.0, power_of_two=False):
    amax = np.float32(amax)
    if not (amax > 0 and np.isfinite(amax)):
        return np.float32(previous)
    with np.errstate(over="ignore"):
        scale = np.float32(min(np.float32(MAX[fmt]) / amax, 2.0**126))  # inverse stays normal
    if power_of_two:  # the largest power of two not above it
        scale = np.float32(2.0 ** math.floor(math.log2(scale)))
    return scale


def qdq_blocks(x, block, scale_of_amax, fmt="e4m3"):
    """Quantize-dequantize a 2-D `x` block by block; `scale_of_amax(amax) -> (scale, inv)`."""
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape, np.float64)
    rows, cols = x.shape
    for r0 in range(0, rows, block[0]):
        for c0 in range(0, cols, block[1]):
            tile = x[r0 : r0 + block[0], c0 : c0 + block[1]]
            scale, inv = scale_of_amax(np.float32(np.max(np.abs(tile))))
            real = cast(tile, scale, fmt).astype(np.float32) * np.float32(inv)  # as stored
            out[r0 : r0 + block[0], c0 : c0 + block[1]] = real
    return out


def deepseek_scale(power_of_two=False):
    def scale_of_amax(amax):
        scale = current_scale(amax, "e4m3", power_of_two=power_of_two)
        return scale, np.float64(np.float32(1.0) / scale)

    return scale_of_amax


def mx_scale(rounding="ceil"):
    def scale_of_amax(amax):
        if amax > 0:
            if rounding == "ceil":
                exponent = math.ceil(math.log2(float(amax) / 448.0))  # exact in float64
            else:
                exponent = math.floor(math.log2(amax)) - 8
        else:
            exponent = 0
        exponent = min(max(exponent, -126), 127)
        return np.float32(2.0**-exponent), 2.0**exponent

    return scale_of_amax


def blockwise(x, w, g, block=128, power_of_two=False):
    """DeepSeek-V3: forward, dgrad and wgrad from blocks of the documented shapes."""
    s = deepseek_scale(power_of_two)
    xq = qdq_blocks(x, (1, block), s)
    wq = qdq_blocks(w, (block, block), s)
    y = xq @ wq.T
    d_x = qdq_blocks(g, (1, block), s) @ wq
    # wgrad: the activation requantized along tokens from its forward FP8 values.
    x_tokens = qdq_blocks(xq.astype(np.float32), (block, 1), s)
    d_w = qdq_blocks(g, (block, 1), s).T @ x_tokens
    return y, d_x, d_w


def mxfp8(x, w, g, block=32, rounding="ceil"):
    s = mx_scale(rounding)
    xq = qdq_blocks(x, (1, block), s)
    wq = qdq_blocks(w, (1, block), s)
    y = xq @ wq.T
    w_cols = qdq_blocks(w, (block, 1), s)  # kernel along N for dgrad, from the weight itself
    d_x = qdq_blocks(g, (1, block), s) @ w_cols
    x_tokens = qdq_blocks(xq.astype(np.float32), (block, 1), s)
    d_w = qdq_blocks(g, (block, 1), s).T @ x_tokens
    return y, d_x, d_w


def split(v, fmt="e4m3", lo_ratio=None):
    """Residual split: (hi, lo) real values with current per-tensor scales."""
    scale = current_scale(np.max(np.abs(v)), fmt)
    hi = qdq_tensor(v, scale, fmt)
    rest = np.asarray(v, np.float32) - hi.astype(np.float32)
    lo_scale = (
        current_scale(np.max(np.abs(rest)), fmt)
        if lo_ratio is None
        else np.float32(scale * np.float32(lo_ratio))
    )
    return hi, qdq_tensor(rest, lo_scale, fmt)


def residual(
    x, w, g, split_activation=False, dgrad_uses_lo=True, lo_ratio=None, grad_format="e4m3"
):
    w_hi, w_lo = split(w, lo_ratio=lo_ratio)
    if split_activation:
        x_hi, x_lo = split(x)
        y = x_hi @ w_hi.T + x_hi @ w_lo.T + x_lo @ w_hi.T
        x_terms = x_hi + x_lo
    else:
        x_terms = qdq_tensor(x, current_scale(np.max(np.abs(x)), "e4m3"), "e4m3")
        y = x_terms @ (w_hi + w_lo).T
    gq = qdq_tensor(g, current_scale(np.max(np.abs(g)), grad_format), grad_format)
    d_x = gq @ (w_hi + w_lo if dgrad_uses_lo else w_hi)
    d_w = gq.T @ x_terms
    return y, d_x, d_w


def per_tensor_current(x, w, g, power_of_two=True):
    def qdq(v, fmt):
        scale = current_scale(np.max(np.abs(v)), fmt, power_of_two=power_of_two)
        return qdq_tensor(v, scale, fmt)

    xq, wq, gq = qdq(x, "e4m3"), qdq(w, "e4m3"), qdq(g, "e5m2")
    return xq @ wq.T, gq @ wq, gq.T @ xq

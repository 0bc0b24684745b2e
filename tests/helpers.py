"""Independent references for the tests: ml_dtypes rounding and float32/float64 NumPy math."""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
FP8 = {"e4m3": E4M3, "e5m2": E5M2}
# Unit roundoff of each format: half the spacing of its significands (3 or 2 mantissa bits).
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def ref_quantize(x, scale, fmt):
    """`x * scale` rounded to the format, saturating, computed with ml_dtypes."""
    dtype = FP8[fmt]
    limit = float(ml_dtypes.finfo(dtype).max)
    with np.errstate(over="ignore"):  # overflow to inf is expected; it saturates below
        scaled = np.asarray(x, np.float32) * np.float32(scale)
    return np.clip(scaled, -limit, limit).astype(dtype)


def ref_qdq(x, scale, fmt):
    """The real value an FP8 operand stands for: dequantized ml_dtypes rounding, float64."""
    return ref_quantize(x, scale, fmt).astype(np.float64) / np.float64(np.float32(scale))


SIGNIFICAND_BITS = {"e4m3": 4, "e5m2": 3}


def representable(rng, shape, fmt="e4m3", step=0.25):
    """Random values `k * step` with `|k| <= 2**significand_bits`, which `fmt` represents exactly.

    With power-of-two scales, quantizing them is exact, and small dot products of them are
    exact in float32, so FP8 results can be compared with float32 math for equality.
    """
    kmax = 2 ** SIGNIFICAND_BITS[fmt]
    k = rng.integers(-kmax, kmax + 1, size=shape)
    x = (k * step).astype(np.float32)
    assert np.array_equal(x.astype(FP8[fmt]).astype(np.float32), x)
    return x


def matmul_error_bound(x, w_t, sx=1.0, sw=1.0):
    """Worst-case |fp8(x) @ fp8(w).T - x @ w.T| for E4M3 operands with scales sx, sw.

    Per element |v^ - v| <= u|v| + d/scale (u: unit roundoff, d: half the subnormal spacing), so
    |x^ w^ - x w| <= (u|x| + dx)((1+u)|w| + dw) + |x|(u|w| + dw), summed over the contraction.
    """
    u, d = UNIT_ROUNDOFF["e4m3"], 2.0**-10
    X, W = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w_t, np.float64)).T
    dx, dw = d / sx, d / sw
    return (u * X + dx) @ ((1 + u) * W + dw) + X @ (u * W + dw)


def make_train_step(loss_fn, optimizer):
    """The README's train step: FP8 state out of the gradients, optax update, state back in."""
    import equinox as eqx

    import fp8jax

    def step(model, opt_state, *batch):
        loss, grads = fp8jax.filter_value_and_grad(loss_fn)(model, *batch)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    return step

"""Independent references for the tests (ml_dtypes rounding and float32/float64 NumPy math),
and what several test files share."""

import importlib.util
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import fp8jax

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
FP8 = {"e4m3": E4M3, "e5m2": E5M2}
# Unit roundoff of each format: half the spacing of its significands (3 or 2 mantissa bits).
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}

#: Compile options (`jax.jit(..., compiler_options=SAME_BITS)`, `eqx.filter_jit` likewise)
#: under which XLA:CPU computes an expression the same whichever fusion holds it: its fusion
#: emitters, where conftest.py chose the (faster to compile) elemental ones. For tests that
#: compare two programs bit for bit.
SAME_BITS = (
    {"xla_cpu_use_fusion_emitters": True}
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    else {}
)


def compile_flags() -> str:
    """This process's `XLA_FLAGS` without the CPU device count (conftest.py's compile options,
    for a subprocess that sets its own devices)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))


def scales_per_element(q):
    """A QTensor's scale_inv for each element of its data (a per-tensor scale as it is): the
    same for a weight in its blocks (on shards) and in the native kernels' layout (whole on
    one device: each block's scale repeated over the rows of its tiles)."""
    from fp8jax._src.core.formats import expand_blocks

    return expand_blocks(q.scale_inv, q.block, q.data.shape) if q.block else q.scale_inv


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


#: Unit roundoffs of bfloat16 (8 significant bits) and float32 (24).
U_BF16 = 2.0**-8
U_F32 = 2.0**-24


def fp8_linear_reference(x, weight, sx=1.0, sw=1.0):
    """`x^ @ w^.T` and `|x^| @ |w^|.T` in float64, from the E4M3 roundings (ml_dtypes) of
    `x (..., in)` and `weight (out, in)` with scales `sx`, `sw`."""
    xq, wq = ref_qdq(x, sx, "e4m3"), ref_qdq(weight, sw, "e4m3")
    return xq @ wq.T, np.abs(xq) @ np.abs(wq).T


def bf16_gemm_bound(value, magnitude, terms, bias=None):
    """Worst-case |y - (value + bias)| for the BF16 result `y` of an FP8 GEMM (+ a BF16 bias).

    `value` and `magnitude` are the float64 sums of the products of the FP8 operands' real
    values and of their absolute values, `terms` how many products each element sums. The GEMM
    accumulates in float32 (error <= terms * U_F32 * magnitude), applies the dequantization
    factor (three float32 roundings, of the two inverse scales and of their product, at most
    3 U_F32 |value|; none for power-of-two scales) and rounds to BF16 (U_BF16 of the result).
    Adding a BF16 bias rounds once more (a float32 sum, then BF16: U_BF16 + U_F32).
    """
    value, magnitude = np.asarray(value, np.float64), np.asarray(magnitude, np.float64)
    computed = terms * U_F32 * magnitude + 3 * U_F32 * np.abs(value)
    gemm = computed + U_BF16 * (np.abs(value) + computed)
    if bias is None:
        return gemm
    return gemm + (U_BF16 + U_F32) * (np.abs(value + bias) + gemm)


def assert_bf16_linear(y, x, weight, bias, sx, sw):
    """`y` is the FP8 Linear `x @ weight.T + bias` of BF16 `x`, `weight`, `bias` with scales
    `sx`, `sw`, computed in BF16: the float64 product of the E4M3-rounded operands, within one
    BF16 rounding of the GEMM and one of the bias add (`bf16_gemm_bound`; a result that XLA
    kept in float32, skipping a rounding, is within it too)."""
    f32 = [np.asarray(a, np.float32) for a in (x, weight)]
    value, magnitude = fp8_linear_reference(*f32, sx, sw)
    b = 0.0 if bias is None else np.asarray(bias, np.float64)
    bound = bf16_gemm_bound(value, magnitude, f32[1].shape[1], None if bias is None else b)
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - (value + b)), bound + 1e-30)


def run_with_mosaic_dump(script, args, dump):
    """Run the Python `script` with `args` in a fresh CPU process that compiles for a
    deviceless H100 and writes each Mosaic GPU kernel's PTX and ptxas log into `dump`."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "MOSAIC_GPU_DUMP_PTX": "1",
        "MOSAIC_GPU_DUMP_PTXAS": "1",
        "MOSAIC_GPU_DUMP_TO": str(dump),
    }
    command = [sys.executable, "-c", script, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True)


def h100_topology(devices: int = 1):
    """fp8jax's deviceless H100 topology. Skips the test where no JAX CUDA plugin is installed
    (the h100 extra); fails where one is installed but gives none (say, of another version)."""
    from fp8jax._src.observe import deviceless

    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        pytest.skip("deviceless H100 compiles need jax's CUDA plugin (the h100 extra)")
    topology = deviceless.h100_topology(devices)
    assert topology is not None, "a JAX CUDA plugin is installed, but gives no deviceless H100"
    return topology


#: One recipe of each kind, for the tests that run every recipe through a framework adapter
#: (Flax NNX, Flax Linen) against the Equinox path.
RECIPES = {
    "delayed": fp8jax.DelayedScaling(history_len=16),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(block_size=32),
    "mxfp8": fp8jax.MXFP8(),
    "residual": fp8jax.ResidualFP8(),
    # Kernel-shaped state: checks that a Flax kernel (in, out) gets the (out, in) state.
    "residual error feedback": fp8jax.ResidualFP8(error_feedback=True),
}


def assert_examples_not_calling_the_model_are_refused(model, x) -> None:
    """`fp8jax.conversion_plan` and `fp8_linear_layers` refuse an `example` that calls the
    model it closes over instead of the one it is handed, or returns nothing."""
    for convert in (fp8jax.conversion_plan, fp8jax.fp8_linear_layers):
        with pytest.raises(ValueError, match=r"traced no GEMM of the model's layers.*lambda m"):
            convert(model, example=lambda m: model(x))
        with pytest.raises(ValueError, match=r"returned no array.*the model's output"):
            convert(model, example=lambda m: None)

"""Integer and float64 GEMMs are costed at a rate of their own: printing their Cost does not
raise, and their time is their FLOPs at that rate."""

import jax
import jax.numpy as jnp
import pytest
from helpers import h100_topology

import fp8jax
from fp8jax._src.observe.roofline import H100


@pytest.mark.parametrize(
    "dtype, acc, kind",
    [
        (jnp.int8, jnp.int32, "int8"),  # INT8 tensor cores
        (jnp.uint8, jnp.int32, "int32"),  # XLA widens it to an s32 GEMM
        (jnp.int16, jnp.int32, "int32"),
        (jnp.int32, jnp.int32, "int32"),
        (jnp.float64, jnp.float64, "f64"),  # not tf32, as float32 is
        (jnp.bool_, jnp.bool_, "int32"),  # a loop fusion: CUDA cores (was kind 'pred': no peak)
    ],
)
def test_a_gemm_is_costed_at_its_kind_and_printed(dtype, acc, kind):
    h100_topology()
    m, k, n = 256, 512, 1024

    def gemm(a, b):
        return jax.lax.dot(a, b, preferred_element_type=acc)

    spec = jax.ShapeDtypeStruct
    with jax.enable_x64(dtype == jnp.float64):
        report = fp8jax.inspect(gemm, spec((m, k), dtype), spec((k, n), dtype), modes=("cublas",))
    cost = report.cost["cublas"]
    assert dict(cost.flops) == {kind: 2 * m * n * k}
    assert cost.gemm_seconds() == pytest.approx(2 * m * n * k / H100[kind])
    assert "estimate at H100 peaks" in str(cost)


@pytest.mark.parametrize("dtype, kind", [(jnp.complex64, "tf32"), (jnp.complex128, "f64")])
def test_a_complex_gemm_counts_the_real_flops_of_its_parts(dtype, kind):
    """Each complex multiply-add is four real multiplies and four adds: 8 * M * N * K real
    FLOPs, at the rate of its parts' type (cuBLAS runs complex64 as float32, so TF32 under
    JAX's default precision); printing the Cost does not raise."""
    h100_topology()
    m, k, n = 128, 256, 64
    spec = jax.ShapeDtypeStruct
    with jax.enable_x64(dtype == jnp.complex128):
        report = fp8jax.inspect(
            jnp.matmul, spec((m, k), dtype), spec((k, n), dtype), modes=("cublas",)
        )
    cost = report.cost["cublas"]
    real_flops = m * n * k * (4 + 4)  # (a+bi)(c+di): 4 real products, 2 + 2 real sums
    assert dict(cost.flops) == {kind: real_flops}
    assert cost.gemm_seconds() == pytest.approx(real_flops / H100[kind])
    assert "estimate at H100 peaks" in str(cost)

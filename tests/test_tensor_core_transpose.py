"""Per-tensor FP8 quantization in one pass on TMA and the tensor cores
(`kernels.tensor_core_transpose`, Mosaic GPU): bit for bit with a NumPy cast in Mosaic GPU's
interpreter (JAX 0.11 on: the GPU's own code, `wgmma` on the transposed view), a NaN's row
as documented, inside a per-tensor recipe's step as its XLA path, bad input refused by name,
and one Mosaic GPU kernel, counted as quantization, in an H100 compile."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cast_transpose import E4M3, E5M2, np_cast, operand, same

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import TENSOR_CORE_TRANSPOSE_NAME, dispatch
from fp8jax._src.kernels.tensor_core_transpose import (
    TransposeConfig,
    stages,
    tensor_core_cast_transpose,
    tiles_per_program,
)
from fp8jax._src.recipes.per_tensor import skip_warm_start
from fp8jax._src.recipes.per_tensor_pass import cast_transpose_kernel

needs_interpreter = pytest.mark.skipif(
    not mosaic_private.interpreter_runs_gpu_path(),
    reason="this JAX's Mosaic GPU interpreter cannot run wgmma on a transposed view",
)


def transposed_with_nan_rows(q: np.ndarray) -> np.ndarray:
    """`q.T` (float32) as the kernel writes it: within each 128 x 128 tile, a row of `q`
    holding a NaN is NaN whole in the transposed tile (`0 * NaN` in the `wgmma`)."""
    t = np.asarray(q, np.float32).T.copy()
    rows, cols = q.shape
    for c in range(0, cols, 128):
        bad = np.isnan(np.asarray(q[:, c : c + 128], np.float32)).any(axis=1)
        t[c : c + 128, bad] = np.nan
    return t


@needs_interpreter
@pytest.mark.parametrize(
    "shape, dtype, fmt, scale, config",
    [
        # Programs of 3 tiles that cross a row of tiles; inf, NaN and values past E4M3's max.
        ((384, 256), jnp.bfloat16, E4M3, 0.37, TransposeConfig(max_programs=2)),
        # A batch axis, float32 in (two stages fit), a program per tile.
        ((2, 256, 256), jnp.float32, E5M2, 3.1e3, TransposeConfig(max_concurrent_steps=4)),
    ],
)
def test_kernel_casts_as_numpy_bit_for_bit(shape, dtype, fmt, scale, config):
    """The FP8 copy equals a NumPy cast element for element; the transposed copy too, but
    where a row of a tile holds a NaN (the cast of an inf or a NaN); the partial amaxes'
    maximum is `max |x|` (NaN with a NaN)."""
    rng = np.random.default_rng(3)
    x = np.asarray(operand(rng, (int(np.prod(shape[:-1])), shape[-1])), np.float32)
    x = jnp.asarray(x.reshape(shape), dtype)
    data, data_t, amax = tensor_core_cast_transpose(
        x, jnp.float32(scale), fmt, config=config, interpret=True
    )
    assert data.dtype == data_t.dtype == fmt and amax.shape[1] == 128
    for b in range(x.shape[0] if x.ndim == 3 else 1):
        xb = np.asarray(x[b] if x.ndim == 3 else x, np.float32)
        want = np_cast(xb, scale, fmt)
        same(data[b] if x.ndim == 3 else data, want)
        same(data_t[b] if x.ndim == 3 else data_t, transposed_with_nan_rows(want))
    assert np.isnan(np.max(np.asarray(amax)))
    finite = jnp.where(jnp.isfinite(x), x, 0)
    _, _, amax = tensor_core_cast_transpose(finite, jnp.float32(scale), fmt, interpret=True)
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(finite.astype(jnp.float32))))


@needs_interpreter
@pytest.mark.parametrize("case", ["steady state", "current"])
def test_a_per_tensor_step_on_the_kernel_is_its_xla_path(case):
    """Inside `cast_transpose_kernel(on_tensor_cores=True)` a delayed-scaling step in the
    steady state (the amax from the kernel) and a current-scaling one (the amax first, by
    XLA) give the value, gradients and states of XLA's path, bit for bit, through one
    kernel call per operand."""
    from test_cast_transpose import _step

    rng = np.random.default_rng(5)
    x = np.asarray(operand(rng, (256, 384)), np.float32)
    x[-1, 0], x[128, 129] = 1e4, 3.0  # finite: values past E4M3's max saturate
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((384, 128)) * 0.05, jnp.bfloat16)
    recipe = fp8jax.DelayedScaling() if case == "steady state" else fp8jax.CurrentScaling()
    layer = fp8jax.Fp8DotGeneral(recipe)
    layer = jax.tree.map(lambda s: jnp.full_like(s, 0.125) if s.ndim == 0 else s + 1.0, layer)

    def context():
        steady = case == "steady state"
        return skip_warm_start(recorded=True) if steady else contextlib.nullcontext()

    with context():
        want = jax.jit(_step())((layer, x, w))
    step = _step()
    with dispatch.interpreted(), cast_transpose_kernel(on_tensor_cores=True), context():
        jaxpr = str(jax.make_jaxpr(step)((layer, x, w)))
        assert jaxpr.count(f"name={TENSOR_CORE_TRANSPOSE_NAME}") == 3
        got = jax.jit(step)((layer, x, w))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


def test_bad_input_is_refused_by_name():
    x = jnp.ones((256, 384), jnp.bfloat16)
    one = jnp.float32(1)
    for bad, match in [
        (x[:200], r"shape \(200, 384\); expected \(M, K\) or \(B, M, K\)"),
        (x.astype(jnp.int32), "dtype int32; expected bfloat16"),
    ]:
        with pytest.raises(ValueError, match=match):
            tensor_core_cast_transpose(bad, one, E4M3, interpret=False)
    with pytest.raises(ValueError, match="fmt=.*expected float8_e4m3fn"):
        tensor_core_cast_transpose(x, one, jnp.bfloat16, interpret=False)
    with pytest.raises(ValueError, match=r"scale has shape \(2,\)"):
        tensor_core_cast_transpose(x, jnp.ones((2,)), E4M3, interpret=False)
    with pytest.raises(TypeError, match="config=3; expected a TransposeConfig"):
        tensor_core_cast_transpose(x, one, E4M3, config=3, interpret=False)
    for kw in (dict(max_programs=0), dict(max_concurrent_steps=5), dict(max_programs=True)):
        with pytest.raises(ValueError, match="TransposeConfig: max_"):
            TransposeConfig(**kw)
    with pytest.raises(TypeError, match="on_tensor_cores=1; expected a bool"):
        cast_transpose_kernel(on_tensor_cores=1)
    if not mosaic_private.interpreter_runs_gpu_path():
        with pytest.raises(NotImplementedError, match="cannot run wgmma on a transposed"):
            tensor_core_cast_transpose(x, one, E4M3, interpret=True)


def test_programs_and_stages_follow_the_config():
    """The fewest tiles a program that divide the tiles within `max_programs` (one wave on
    132 SMs at the LLM shapes), and stages clipped to shared memory (float32: two)."""
    config = TransposeConfig()
    assert tiles_per_program(config, 64 * 32) == 16  # 8192 x 4096: 128 programs
    assert tiles_per_program(config, 64 * 112) == 56  # 8192 x 14336: 128 programs
    assert tiles_per_program(config, 7) == 1 and tiles_per_program(TransposeConfig(2), 7) == 7
    four = TransposeConfig(max_concurrent_steps=4)
    assert stages(four, jnp.bfloat16) == 4 and stages(four, jnp.float32) == 2


def test_h100_compile_runs_one_mosaic_kernel_counted_as_quantization():
    """For an H100 (deviceless): one Mosaic GPU custom call by the kernel's name, which
    `fp8jax.hlo_cost` files under quantization (its identity a constant, no kernel)."""
    from helpers import h100_topology

    from fp8jax._src.observe import deviceless

    device = h100_topology().devices[0]
    spec = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)

    def cast(x):
        return tensor_core_cast_transpose(x, jnp.float32(2.0), E4M3, interpret=False)

    lowered, _ = deviceless.lower(cast, (spec,), {}, device)
    hlo = lowered.compile(fp8jax.gpu_compiler_options()).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call_target=" in line]
    assert len(calls) == 1 and TENSOR_CORE_TRANSPOSE_NAME in calls[0], calls
    cost = fp8jax.hlo_cost(hlo)
    assert set(cost.bytes) == {"quantize"} and cost.bytes["quantize"] >= 256 * 384 * 4

"""The private Mosaic GPU API fp8jax uses (`fp8jax._src.mosaic_private`): if a JAX release
moves it, these tests say so first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp8jax._src import mosaic_private


def _double(x, interpret):
    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(
        x
    )


def test_interpreter_runs_a_mosaic_gpu_kernel_on_the_cpu():
    x = jnp.arange(128.0, dtype=jnp.float32)
    out = jax.jit(lambda x: _double(x, mosaic_private.interpret_params()))(x)
    np.testing.assert_array_equal(out, 2 * np.arange(128.0))


def test_interpreter_recovers_after_a_kernel_raises():
    """After a kernel fails under the interpreter, `reset_interpreter` lets the next run."""

    def bad(x):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[pl.ds(0, 256)]  # reads past the end

        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((256,), x.dtype),
            interpret=mosaic_private.interpret_params(),
        )(x)

    with pytest.raises(Exception):  # noqa: B017 - whichever error the interpreter raises
        jax.block_until_ready(jax.jit(bad)(jnp.ones(128)))
    mosaic_private.reset_interpreter()
    test_interpreter_runs_a_mosaic_gpu_kernel_on_the_cpu()

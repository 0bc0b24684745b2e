"""The private Mosaic GPU API fp8jax uses, and the public calls whose signature changed
between JAX releases (`fp8jax._src.core.mosaic_private`): if a JAX release moves them, these tests
say so first."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp8jax._src.core import mosaic_private


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


def _gpu_jaxpr(f, *args) -> str:
    """The jaxpr of `f` traced for a GPU (not interpreted): tracing a Mosaic GPU kernel checks
    every Pallas call in its body against this JAX's API, without a GPU or CUDA plugin."""
    return str(jax.make_jaxpr(f)(*args))


def test_load_takes_a_register_layout_on_this_jax():
    """`mosaic_private.load` calls `plgpu.load` as this JAX defines it: JAX 0.10 requires an
    index, 0.11 deprecates it (an error under this suite's warning filter), 0.12 removed it."""

    def scaled(x):
        def body(x_ref, s_ref, o_ref):
            s = mosaic_private.load(s_ref, layout=plgpu.Layout.WGMMA.reduce(1))
            o_ref[...] = x_ref[...] * lax.broadcast_in_dim(s, x_ref.shape, [0])

        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(
            x, jnp.ones(x.shape[0], x.dtype)
        )

    jaxpr = _gpu_jaxpr(scaled, jnp.ones((64, 128)))
    assert re.search(r"\bload\b", jaxpr) and "layout_cast" in jaxpr, jaxpr


@pytest.mark.parametrize("n_terms", [1, 2])
def test_block_gemm_traces_for_the_gpu_on_this_jax(n_terms):
    """The native kernel's GPU path (wgmma on a transposed tile, scale loads in registers),
    which the interpreter tests do not run, traces on this JAX without errors or warnings."""
    from fp8jax._src.kernels.block_gemm import block_scaled_gemm

    a, b = jnp.ones((64, 256), jnp.float8_e4m3fn), jnp.ones((128, 256), jnp.float8_e4m3fn)
    sa, sb = jnp.ones((64, 2)), jnp.ones((128, 2))
    jaxpr = _gpu_jaxpr(
        lambda a, sa, b, sb: block_scaled_gemm(a, sa, [(b, sb)] * n_terms, interpret=False),
        a,
        sa,
        b,
        sb,
    )
    assert len(re.findall(r"\bwgmma_ref\b", jaxpr)) == n_terms, jaxpr  # one per rhs term
    assert len(re.findall(r"\bload\b", jaxpr)) == 1 + n_terms, jaxpr  # scales, in registers


def test_interpreters_from_jax_0_11_run_the_kernels_gpu_code():
    """From JAX 0.11 on, interpreted kernels run the code a GPU runs (`wgmma` on transposed
    views, register layouts): no substitute steps (`block_gemm.substitutes`), so that the
    interpreter tests (run on 0.11 and 0.12 by tests/other_jax.sh) check that code itself.
    A detection that stopped recognizing a newer interpreter would fail here."""
    from fp8jax._src.kernels.block_gemm import substitutes

    newer = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    assert mosaic_private.interpreter_runs_gpu_path() is newer
    assert substitutes(True) is (not newer)
    assert substitutes(False) is False


def test_mixed_fp8_wgmma_says_what_tracing_a_mixed_wgmma_does():
    """`mixed_fp8_wgmma` probes `plgpu.wgmma`'s dtype check; a kernel multiplying E5M2 by
    E4M3, traced for the GPU, agrees: it traces where the probe says yes (JAX 0.11 on) and
    is refused for its "mixed input dtypes" where it says no (0.10)."""

    def mixed(a, b):
        def body(a_ref, b_ref, o_ref):
            def scoped(acc_ref):
                plgpu.wgmma(acc_ref, a_ref, b_ref)
                return acc_ref[...]

            o_ref[...] = pl.run_scoped(scoped, plgpu.ACC((64, 128), jnp.float32))

        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), jnp.float32))(a, b)

    a, b = jnp.ones((64, 64), jnp.float8_e5m2), jnp.ones((64, 128), jnp.float8_e4m3fn)
    if mosaic_private.mixed_fp8_wgmma():
        assert "wgmma" in _gpu_jaxpr(mixed, a, b)
    else:
        with pytest.raises(ValueError, match="(?i)mixed input dtypes"):
            _gpu_jaxpr(mixed, a, b)
    newer = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    assert mosaic_private.mixed_fp8_wgmma() is newer  # as of the releases fp8jax supports


def test_untiled_wgmma_loads_from_jax_0_11():
    """`untiled_wgmma_loads` says yes from JAX 0.11 on, whose Mosaic GPU compiles a load of
    an untiled buffer into the `wgmma` layout (the H100 compile of
    `tests/test_tensor_core_gathered.py`, which 0.10's refuses to compile, checks what it
    says)."""
    newer = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    assert mosaic_private.untiled_wgmma_loads() is newer


def test_ieee_divide_finds_mosaic_gpus_helpers_on_this_jax():
    """`ieee_divide` traces for a GPU (`plgpu.inline_mgpu` with a WGMMA row layout) and the
    two private `FragmentedArray` helpers its body calls exist; its PTX (`div.rn.f32`, not
    `/`'s `div.full.f32`) is read by tests/test_tensor_core_transpose.py's H100 compile."""
    from jax.experimental.mosaic import gpu as mgpu

    assert callable(mgpu.FragmentedArray._pointwise)
    assert callable(mgpu.FragmentedArray._lift_fast_instr("div.rn.f32"))
    layout = plgpu.Layout.WGMMA.reduce(1)

    def divided(a):
        def body(a_ref, o_ref):
            a = mosaic_private.load(a_ref, layout=layout)
            o_ref[...] = mosaic_private.ieee_divide(a, a + 1.0, layout)

        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(a.shape, a.dtype))(a)

    jaxpr = _gpu_jaxpr(divided, jnp.ones((128,), jnp.float32))
    assert "inline_mgpu" in jaxpr, jaxpr

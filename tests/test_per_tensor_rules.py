"""Per-tensor scaling's documented rules where the step-by-step references do not reach:
the warm first step's margin, current scaling's previous scale, the kernel's cast of a state
without a scale; each against the rule computed by hand in NumPy."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ref_qdq

import fp8jax
from fp8jax._src.kernels import dispatch
from fp8jax._src.recipes.per_tensor import skip_warm_start
from fp8jax._src.recipes.per_tensor_pass import cast_transpose_kernel


class Eye(eqx.Module):
    dot: fp8jax.Fp8DotGeneral

    def __call__(self, x):
        return self.dot(x, jnp.eye(x.shape[-1]), (((1,), (0,)), ((), ())))


def rule(amax, margin, power_of_two, fmt_max=448.0):
    """`fmt_max / (amax * 2**margin)` in float32, rounded down to a power of two if asked."""
    scale = np.float32(np.float32(fmt_max) / np.float32(amax)) * np.float32(2.0**-margin)
    return np.float32(2.0 ** math.floor(math.log2(scale))) if power_of_two else scale


@pytest.mark.parametrize("margin, power_of_two", [(2.0, True), (0.5, False), (-1.0, True)])
def test_the_warm_first_step_keeps_the_margin(margin, power_of_two):
    """A fresh layer's first step scales by its own amax with the recipe's margin, as
    `CurrentScaling` would: a margin of 2 over an amax of 3 gives 32, not `448 / 3`'s 128."""
    x = jnp.array([[3.0, -1.0]])
    for recipe in (
        fp8jax.DelayedScaling(margin=margin, power_of_two=power_of_two),
        fp8jax.CurrentScaling(margin=margin, power_of_two=power_of_two),
    ):
        grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x)))(Eye(fp8jax.Fp8DotGeneral(recipe)))
        assert float(grads.dot.input.scale) == rule(3.0, margin, power_of_two), recipe


def test_current_scaling_keeps_the_previous_scale_where_the_amax_is_not_finite():
    """Current scaling keeps the previous scale where the amax is zero or not finite (not
    1.0): an input row `[1000, 0]` beside a row holding inf is cast by the previous 2**-2
    (1000 -> 256 -> 1024), where a scale of 1.0 would saturate it at 448."""
    layer = Eye(fp8jax.Fp8DotGeneral(fp8jax.CurrentScaling()))
    layer = eqx.tree_at(lambda m: m.dot.input.scale, layer, jnp.float32(0.25))
    for x, row in (([[1000.0, 0.0], [0.0, np.inf]], True), ([[0.0, 0.0]], False)):
        x = jnp.array(x)
        y, grads = fp8jax.filter_value_and_grad(lambda m, x=x: m(x)[0, 0], has_aux=False)(layer)
        assert float(grads.dot.input.scale) == 0.25
        if row:
            assert float(y) == ref_qdq(np.float32(1000.0), np.float32(0.25), "e4m3")


def test_the_kernel_casts_a_state_without_a_scale_by_one_where_the_warm_start_is_skipped():
    """Inside `skip_warm_start()` a state without a scale (a fresh layer's 0) is cast by 1.0
    (documented), by the one-pass kernel too: its output is that of the operands rounded to
    E4M3 at scale 1, not of a cast by 0."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 128)).astype(np.float32) * 4
    w = rng.standard_normal((128, 128)).astype(np.float32) * 4
    layer = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=2))
    dims = (((1,), (0,)), ((), ()))
    want = ref_qdq(x, np.float32(1.0), "e4m3") @ ref_qdq(w, np.float32(1.0), "e4m3")
    with dispatch.interpreted(), cast_transpose_kernel("input"), skip_warm_start():
        got = jax.jit(lambda a, b: layer(a, b, dims))(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-4)


def test_a_layer_used_twice_records_the_larger_amax_with_its_margin():
    """Two uses of a current-scaling layer in one step record the larger amax (3) beside the
    scale the rule gives it, margin included: `448 / (3 * 2**2)` -> 32, not 128."""
    layer = Eye(fp8jax.Fp8DotGeneral(fp8jax.CurrentScaling(margin=2.0)))
    a, b = jnp.array([[3.0, 0.0]]), jnp.array([[1.0, 0.5]])
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(a)) + jnp.sum(m(b)))(layer)
    assert float(grads.dot.input.amax_history[0]) == 3.0
    assert float(grads.dot.input.scale) == rule(3.0, 2.0, True)


class Experts(eqx.Module):
    weight: jax.Array
    dot: fp8jax.Fp8RaggedDot

    def __call__(self, x, sizes):
        return self.dot(x, self.weight, sizes)


def test_an_experts_recorded_scale_outlives_its_history_emptied_again():
    """Per expert as per tensor: with a history of one, an expert whose kernel is all zero
    this step keeps the scale recorded before (`448 / 3` -> 128), not 0, so its next step is
    delayed, not warm; the other expert's scale comes from its new amax (`448 / 5` -> 64)."""
    dot = fp8jax.Fp8RaggedDot(fp8jax.DelayedScaling(history_len=1), num_experts=2)
    layer = Experts(jnp.full((2, 2, 2), 3.0), dot)
    x, sizes = jnp.ones((4, 2)), jnp.array([2, 2], jnp.int32)
    for w in (jnp.full((2, 2, 2), 3.0), jnp.stack([jnp.zeros((2, 2)), jnp.full((2, 2), 5.0)])):
        layer = eqx.tree_at(lambda m: m.weight, layer, w)
        grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x, sizes)))(layer)
        layer = eqx.tree_at(lambda m: m.dot, layer, layer.dot.merge(grads.dot))
    want = [rule(3.0, 0.0, True), rule(5.0, 0.0, True)]
    np.testing.assert_array_equal(np.asarray(layer.dot.kernel.scale), want)


class Step(fp8jax.OverwriteWithGradient):
    count: jax.Array


def test_a_module_received_without_arrays_is_kept_whatever_its_merge():
    """A module whose state was not differentiated comes back holding no array: nothing was
    received, so `apply_updates` keeps it, also for a subclass whose merge takes whatever it
    gets (the default), not zeros in its place."""
    model = [Step(jnp.array([7.0, 2.0])), jnp.ones(2)]
    new = fp8jax.apply_updates(model, [None, -jnp.ones(2)], [Step(None), None])
    np.testing.assert_array_equal(np.asarray(new[0].count), [7.0, 2.0])
    np.testing.assert_array_equal(np.asarray(new[1]), [0.0, 0.0])

"""Delayed scaling, step by step, against a hand-rolled Transformer Engine reference."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ref_qdq

import fp8jax


def ref_update(scale, history, new_amax, fmt_max, margin, amax_compute, power_of_two=True):
    """One delayed-scaling step, as Transformer Engine documents it, in float32 NumPy; with
    `power_of_two`, the scale rounded down to a power of two."""
    ref = history.max() if amax_compute == "max" else history[0]
    if ref > 0 and np.isfinite(ref):
        scale = np.float32(np.float32(fmt_max) / ref) * np.float32(2.0**-margin)
        if power_of_two:
            scale = np.float32(2.0 ** math.floor(math.log2(scale)))
    history = np.roll(history, -1)
    history[0] = new_amax
    return np.float32(scale), history


class Layer(eqx.Module):
    weight: jax.Array
    dot: fp8jax.Fp8DotGeneral

    def __call__(self, x):
        return self.dot(x, self.weight, (((1,), (0,)), ((), ())))


@pytest.mark.parametrize(
    "recipe",
    [
        fp8jax.DelayedScaling(history_len=3),
        fp8jax.DelayedScaling(history_len=4, amax_compute="most_recent", margin=1),
        fp8jax.DelayedScaling(history_len=2, margin=2, backward_format="e4m3"),
        fp8jax.DelayedScaling(),
        fp8jax.DelayedScaling(history_len=3, margin=0.5, power_of_two=False),
    ],
    ids=["max-len3", "most_recent-margin1", "e4m3-grads-margin2", "defaults", "exact-scales"],
)
def test_five_steps_match_reference_exactly(recipe, getkey):
    rng = np.random.default_rng(0)
    layer = Layer(jax.random.normal(getkey(), (8, 4)) * 0.3, fp8jax.Fp8DotGeneral(recipe))
    optimizer = optax.sgd(0.5)
    _, trainable = fp8jax.partition_for_grad_overwrite(layer)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(layer, opt_state, x, c):
        # loss = sum(y * c): the output gradient is exactly c.
        grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x) * c))(layer)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates, opt_state = optimizer.update(grads, opt_state)
        return fp8jax.apply_updates(layer, updates, overwrites), opt_state

    fmt_max = {
        "input": 448.0,
        "kernel": 448.0,
        "output_grad": fp8jax.fp8_max(recipe.backward_format),
    }
    ref = {r: (np.float32(1.0), np.zeros(recipe.history_len, np.float32)) for r in fmt_max}
    # Step magnitudes vary a lot; step 2 has an all-zero input (zero amax keeps the scale).
    magnitudes = [1.0, 30.0, 0.0, 0.01, 5.0]
    for t, mag in enumerate(magnitudes):
        x = (rng.standard_normal((16, 8)) * mag).astype(np.float32)
        c = (rng.standard_normal((16, 4)) * 10.0 ** (t - 2)).astype(np.float32)
        amaxes = {
            "input": np.abs(x).max(),
            "kernel": np.abs(np.asarray(layer.weight)).max(),
            "output_grad": np.abs(c).max(),
        }
        layer, opt_state = step(layer, opt_state, x, c)
        for role, (scale, history) in ref.items():
            ref[role] = ref_update(
                scale,
                history.copy(),
                amaxes[role],
                fmt_max[role],
                recipe.margin,
                recipe.amax_compute,
                recipe.power_of_two,
            )
            state = getattr(layer.dot, role)
            np.testing.assert_array_equal(
                np.asarray(state.scale), ref[role][0], err_msg=f"{role} scale, step {t}"
            )
            np.testing.assert_array_equal(
                np.asarray(state.amax_history), ref[role][1], err_msg=f"{role} history, step {t}"
            )
    # The reference really moved: scales left 1.0 and the zero step is in the histories.
    assert all(ref[r][0] != 1.0 for r in ref)


def test_scale_of_step_comes_from_history_before_the_step():
    """At step t the forward quantizes with the scale from history up to t-1."""
    layer = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=4)))
    x0 = jnp.array([[4.0, 0.0]])
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x0)))(layer)
    layer = eqx.tree_at(lambda m: m.dot, layer, layer.dot.merge(grads.dot))
    assert float(layer.dot.input.scale) == 1.0  # history was empty at step 0
    x1 = np.array([[9.0, 0.0]], np.float32)
    y1 = float(layer(x1)[0, 0])
    # Step 1 uses 448 / 4 = 112 (the amax of step 0), rounded down to 64, under which 9.0
    # saturates at 448 / 64 = 7; its own amax would give 448 / 9, rounded down to 32.
    assert y1 == ref_qdq(x1[0, 0], 64.0, "e4m3") == 7.0
    assert ref_qdq(x1[0, 0], 32.0, "e4m3") == 9.0


def test_non_finite_amax_keeps_scale():
    previous = jnp.float32(3.0)
    for bad in (0.0, np.inf, np.nan):
        assert float(fp8jax.compute_scale(jnp.float32(bad), previous, 448.0)) == 3.0
    assert float(fp8jax.compute_scale(jnp.float32(2.0), previous, 448.0, margin=1)) == 112.0
    # A tiny amax would give a scale whose inverse is subnormal: capped at 2**126.
    huge = fp8jax.compute_scale(jnp.float32(1e-37), previous, 448.0)
    assert float(huge) == 2.0**126 and float(1 / huge) > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"amax_compute": "mean"}, "amax_compute"),
        ({"history_len": 0}, "history_len"),
        ({"forward_format": "e3m4"}, "Unknown FP8 format"),
        ({"backward_precision": "fast"}, "backward_precision"),
    ],
)
def test_bad_recipe_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.DelayedScaling(**kwargs)

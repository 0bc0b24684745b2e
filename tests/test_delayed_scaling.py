"""Delayed scaling, step by step, against a hand-rolled Transformer Engine reference."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import ref_qdq

import fp8jax
from fp8jax._src.recipes.per_tensor import next_scales


def ref_update(
    scale, history, new_amax, fmt_max, margin, amax_compute, power_of_two=True, warm_start=False
):
    """One delayed-scaling step, as Transformer Engine documents it, in float32 NumPy; with
    `power_of_two`, the scale rounded down to a power of two; with `warm_start`, a history
    without any amax yet gives way to this step's own."""
    ref = history.max() if amax_compute == "max" else history[0]
    if warm_start and not history.max() > 0:
        ref = new_amax
    if ref > 0 and np.isfinite(ref):
        scale = np.float32(np.float32(fmt_max) / ref) * np.float32(2.0**-margin)
        if power_of_two:
            scale = np.float32(2.0 ** math.floor(math.log2(scale)))
    history = np.roll(history, -1)
    history[0] = new_amax
    return np.float32(scale), history


def ref_next_scale(scale, history, fmt_max, margin, amax_compute, power_of_two, warm_start):
    """The scale the reference's next step uses, as the merged state holds it: 0 ("no amax
    yet") for a warm-starting history without an amax, whose next step scales by its own."""
    if warm_start and not history.max() > 0:
        return np.float32(0.0)
    rules = (fmt_max, margin, amax_compute, power_of_two)
    return ref_update(scale, history.copy(), np.float32(0.0), *rules)[0]


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
        fp8jax.DelayedScaling(history_len=3, warm_start=False),
        fp8jax.DelayedScaling(history_len=4, amax_compute="most_recent", warm_start=False),
    ],
    ids=[
        "max-len3",
        "most_recent-margin1",
        "e4m3-grads-margin2",
        "defaults",
        "exact-scales",
        "te-cold-start",
        "te-cold-start-most_recent",
    ],
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
                recipe.warm_start,
            )
            state = getattr(layer.dot, role)
            want = ref_next_scale(
                *ref[role],
                fmt_max[role],
                recipe.margin,
                recipe.amax_compute,
                recipe.power_of_two,
                recipe.warm_start,
            )
            np.testing.assert_array_equal(
                np.asarray(state.scale), want, err_msg=f"{role} next scale, after step {t}"
            )
            np.testing.assert_array_equal(
                np.asarray(state.amax_history), ref[role][1], err_msg=f"{role} history, step {t}"
            )
            want_inv = 1.0 / np.float64(want) if want > 0 else 1.0
            assert float(state.scale_inv) == np.float32(want_inv), (role, t)
    # The reference really moved: scales left 1.0 and the zero step is in the histories.
    assert all(ref[r][0] != 1.0 for r in ref)


def test_scale_of_step_comes_from_history_before_the_step():
    """At step t the forward quantizes with the scale from history up to t-1."""
    recipe = fp8jax.DelayedScaling(history_len=4, warm_start=False)
    layer = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(recipe))
    x0 = jnp.array([[4.0, 0.0]])
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x0)))(layer)
    assert float(grads.dot.input.scale) == 1.0  # step 0 used TE's 1.0 (empty history)
    layer = eqx.tree_at(lambda m: m.dot, layer, layer.dot.merge(grads.dot))
    assert float(layer.dot.input.scale) == 64.0  # what step 1 uses, kept in the state
    x1 = np.array([[9.0, 0.0]], np.float32)
    y1 = float(layer(x1)[0, 0])
    # Step 1 uses 448 / 4 = 112 (the amax of step 0), rounded down to 64, under which 9.0
    # saturates at 448 / 64 = 7; its own amax would give 448 / 9, rounded down to 32.
    assert y1 == ref_qdq(x1[0, 0], 64.0, "e4m3") == 7.0
    assert ref_qdq(x1[0, 0], 32.0, "e4m3") == 9.0


def test_a_state_without_a_scale_gets_one_unless_warm():
    """Merged, a state with no scale and no amax keeps none with the warm start (0: the
    next step is warm) and gets Transformer Engine's 1.0 without it, whose casts take the
    state's scale as it is (a warm-start checkpoint restored into `warm_start=False`)."""
    empty, history = jnp.zeros((2,)), jnp.zeros((2, 4))
    rules = [(fp8jax.DelayedScaling(history_len=4, warm_start=w), "input") for w in (True, False)]
    np.testing.assert_array_equal(next_scales(empty, history, rules), [0.0, 1.0])
    # A kept scale is kept by both where the history's amax is not usable.
    kept = jnp.full((2,), 8.0)
    np.testing.assert_array_equal(next_scales(kept, history, rules), [0.0, 8.0])


def test_a_warm_state_without_a_scale_casts_by_one_in_a_cold_layer_once_merged(tmp_path):
    """A warm-start state holding no scale (0) restored into a `warm_start=False` layer is
    merged by `load_checkpoint`, and one moved in by hand by `merge`: both then cast by
    Transformer Engine's 1.0 (`scale_inv` 1), not by 0 (every FP8 operand 0)."""
    recipe = fp8jax.DelayedScaling(history_len=2, warm_start=False)
    cold = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(recipe))
    fresh = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=2)))
    fp8jax.save_checkpoint(tmp_path / "warm.eqx", fresh)
    restored = fp8jax.load_checkpoint(tmp_path / "warm.eqx", cold)
    roles = lambda m: (m.dot.input, m.dot.kernel, m.dot.output_grad)  # noqa: E731
    moved = eqx.tree_at(roles, cold, roles(fresh))
    moved = eqx.tree_at(lambda m: m.dot, moved, moved.dot.merge(moved.dot))
    x = np.array([[3.3, -0.7]], np.float32)
    want = ref_qdq(x, 1.0, "e4m3") @ ref_qdq(np.eye(2, dtype=np.float32), 1.0, "e4m3")
    for layer in (restored, moved):
        assert all(float(s.scale) == 1.0 == float(s.scale_inv) for s in roles(layer))
        np.testing.assert_array_equal(np.asarray(layer(x), np.float64), want)


def test_a_state_without_a_scale_stepped_on_zeros_in_a_cold_layer_merges_to_one():
    """A warm-start state holding no scale (0) moved by hand into a `warm_start=False` layer
    and stepped before a merge, on an all-zero input: its merged scale is Transformer
    Engine's 1.0 (the hand-rolled update of TE's initial state, as a merge before the step
    gives), not 2**-126 (every operand of the next steps flushed to zero)."""
    recipe = fp8jax.DelayedScaling(history_len=2, warm_start=False)
    cold = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(recipe))
    fresh = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=2)))
    moved = eqx.tree_at(lambda m: m.dot.input, cold, fresh.dot.input)
    x = np.zeros((1, 2), np.float32)
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x)))(moved)
    merged = moved.dot.merge(grads.dot).input
    scale, history = ref_update(np.float32(1.0), np.zeros(2, np.float32), 0.0, 448.0, 0, "max")
    want = ref_next_scale(scale, history, 448.0, 0, "max", True, False)
    assert want == 1.0
    assert float(merged.scale) == want and float(merged.scale_inv) == 1.0 / want


def test_non_finite_amax_keeps_scale():
    previous = jnp.float32(3.0)
    for bad in (0.0, np.inf, np.nan):
        assert float(fp8jax.compute_scale(jnp.float32(bad), previous, 448.0)) == 3.0
    assert float(fp8jax.compute_scale(jnp.float32(2.0), previous, 448.0, margin=1)) == 112.0
    # A tiny amax would give a scale whose inverse is subnormal: capped at 2**126.
    huge = fp8jax.compute_scale(jnp.float32(1e-37), previous, 448.0)
    assert float(huge) == 2.0**126 and float(1 / huge) > 0


def test_compute_scale_has_a_zero_derivative_in_an_amax_it_does_not_use():
    """Where the amax is zero or not finite the scale is `previous`: its derivative in the amax
    is 0 (not NaN, from dividing by that amax in the branch not taken) and in `previous` 1;
    elsewhere `-fmt_max / amax**2` (-112 at 2), 0 in `previous`."""
    grad = jax.grad(lambda a, p: fp8jax.compute_scale(a, p, 448.0), argnums=(0, 1))
    for bad in (0.0, np.inf, np.nan):
        d_amax, d_previous = grad(jnp.float32(bad), jnp.float32(3.0))
        assert (float(d_amax), float(d_previous)) == (0.0, 1.0), bad
    d_amax, d_previous = grad(jnp.float32(2.0), jnp.float32(3.0))
    assert (float(d_amax), float(d_previous)) == (-448.0 / 2.0**2, 0.0)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_a_large_margin_over_a_large_amax_gives_a_smaller_scale_never_zero(power_of_two):
    """`fmt_max / (amax * 2**margin)` as float32 NumPy computes it (no flush to zero), kept
    within `[2**-126, 2**126]`: a scale below float32's normal range becomes its smallest
    normal (whose inverse is finite), never 0 (an inf inverse: NaN outputs) nor, rounded to a
    power of two, a scale above a smaller margin's."""
    amax = np.float32(1e31)
    scales = []
    for margin in (0, 16, 32):
        got = fp8jax.compute_scale(jnp.float32(amax), jnp.float32(1.0), 448.0, margin, power_of_two)
        want = np.float32(448.0) / amax * np.float32(2.0**-margin)
        want = min(max(float(want), 2.0**-126), 2.0**126)
        if power_of_two:
            want = 2.0 ** math.floor(math.log2(want))
        assert float(got) == want, margin
        scales.append(float(got))
    assert scales == sorted(scales, reverse=True)
    # In a GEMM: the headroom flushes both operands to zero, and the output is zero, not NaN.
    recipe = fp8jax.CurrentScaling(margin=32, power_of_two=power_of_two)
    x, w = jnp.full((2, 4), 1e31), jnp.full((4, 3), 2.0**-30)
    out = fp8jax.Fp8DotGeneral(recipe)(x, w, (((1,), (0,)), ((), ())))
    np.testing.assert_array_equal(out, np.zeros((2, 3)))


@pytest.mark.parametrize("power_of_two", [False, True])
def test_a_margin_over_a_tiny_amax_is_not_lost_to_an_overflowed_quotient(power_of_two):
    """An amax so small that `fmt_max / amax` overflows float32 (below 1.7e-34 for E5M2)
    gave the 2**126 cap whatever the margin: inf times `2**-margin` stays inf. As float64
    computes `fmt_max / amax / 2**margin`, kept within `[2**-126, 2**126]`, instead."""
    amax = np.array([1e-37, 3e-36, 1e-35, 1.7e-34, 2e-30], np.float32)
    for fmt in ("e5m2", "e4m3"):
        fmt_max = fp8jax.fp8_max(fmt)
        for margin in (0, 3, 8.5, 32):
            got = np.asarray(
                fp8jax.compute_scale(jnp.asarray(amax), 1.0, fmt_max, margin, power_of_two)
            )
            want = np.clip(fmt_max / amax.astype(np.float64) / 2.0**margin, 2.0**-126, 2.0**126)
            if power_of_two:
                want = 2.0 ** np.floor(np.log2(want))
                np.testing.assert_array_equal(got, want, err_msg=f"{fmt}, margin {margin}")
            else:
                np.testing.assert_allclose(got, want, rtol=3e-7, err_msg=f"{fmt}, margin {margin}")


def test_compute_scale_takes_arrays_as_documented():
    """`fmt_max` and `power_of_two` may be traced arrays, `margin` a number or a NumPy array
    (its factor `2**-margin` a constant of the trace): under `jit`, as float32 NumPy computes
    it. A traced margin is refused by name."""
    amax = np.array([2.0, 3.0, 1e-3], np.float32)
    margin = np.array([0.0, 1.0, 2.5])
    want = np.float32(448.0) / amax * (2.0**-margin).astype(np.float32)

    @jax.jit
    def scales(amax, fmt_max, power_of_two):
        return fp8jax.compute_scale(amax, jnp.ones(3), fmt_max, margin, power_of_two)

    got = scales(amax, np.float32(448.0), np.zeros(3, bool))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"compute_scale: margin is traced"):
        jax.jit(lambda a, m: fp8jax.compute_scale(a, jnp.ones(3), 448.0, m))(amax, margin)


@pytest.mark.parametrize("margin", [float("nan"), -200, 40.0, np.array([0.0, np.inf])])
def test_compute_scale_refuses_a_margin_no_recipe_takes(margin):
    """A NaN margin gave a NaN scale (NaN outputs) without a word, -200 a NumPy overflow
    warning (2**200 as float32); refused by value, with the range recipes take."""
    with pytest.raises(ValueError, match=r"compute_scale: margin=.*from -32 to 32"):
        fp8jax.compute_scale(jnp.float32(2.0), jnp.float32(1.0), 448.0, margin)
    # The range's ends are taken, as float32 NumPy computes them.
    for ok in (-32, 32):
        got = fp8jax.compute_scale(jnp.float32(2.0), jnp.float32(1.0), 448.0, ok)
        assert float(got) == float(np.float32(224.0) * np.float32(2.0**-ok))


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, np.dtype(jnp.float8_e5m2), "float8_e4m3fn"])
def test_compute_scale_refuses_a_format_for_its_largest_value(fmt):
    """A format in place of its largest value raised Python's "unsupported operand type(s)
    for /" (a dtype divided by an array), naming neither the argument nor the fix."""
    with pytest.raises(TypeError, match=r"compute_scale: fmt_max=.* is a dtype; .*fp8_max"):
        fp8jax.compute_scale(jnp.float32(2.0), jnp.float32(1.0), fmt)
    got = fp8jax.compute_scale(jnp.float32(2.0), jnp.float32(1.0), fp8jax.fp8_max(fmt))
    assert float(got) == float(np.float32(ml_dtypes.finfo(np.dtype(fmt)).max) / np.float32(2.0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_compute_scale_of_a_narrow_amax_is_formed_in_float32(dtype):
    """`compute_scale(jnp.max(jnp.abs(x)), ...)` of a BF16 or float16 `x` divided in that
    dtype: BF16 rounded `448 / amax` to 8 bits (the amax then saturated, 0.4 % over 448) and
    float16 overflowed past 65504 to its 2**126 cap. As float32 NumPy computes it instead."""
    amax = np.concatenate([np.linspace(1.0, 4.0, 97), [1e-3, 2.0**-20]]).astype(dtype)
    wide = amax.astype(np.float32)
    for power_of_two in (False, True):
        got = np.asarray(fp8jax.compute_scale(jnp.asarray(amax), 1.0, 448.0, 0, power_of_two))
        want = np.float32(448.0) / wide
        if power_of_two:
            want = np.exp2(np.floor(np.log2(want.astype(np.float64))))
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
        if power_of_two:
            assert np.all(got.astype(np.float64) * wide <= 448.0)


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


# --- the warm first step ---------------------------------------------------------------------


def _loss(m, x, y):
    # Output gradients below 1e-6: under E5M2's smallest subnormal (2**-16) at scale 1.0.
    return 1e-3 * jnp.mean((jax.vmap(m)(x) - y) ** 2)


def _mlp_first_step_grads(recipe, mlp, x, y):
    loss = _loss

    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    grads = fp8jax.filter_grad(loss)(model, x, y)
    return fp8jax.partition_for_grad_overwrite(grads)


def test_warm_first_step_matches_current_scaling(getkey):
    """A fresh layer's first step scales by each operand's own amax: its weight gradients
    are current scaling's, bit for bit. Scaled by 1.0 (Transformer Engine's cold start), the
    output gradient of this loss (below 1e-6 per element) underflows E5M2 and every weight
    gradient is exactly zero (issue 24: on an MLP 1024 -> 4096 -> 1024 over 2,048 tokens a
    plain MSE's gradient is already that small)."""
    mlp = eqx.nn.MLP(64, 64, 256, 1, activation=jax.nn.gelu, key=getkey())
    x = jax.random.normal(getkey(), (512, 64))
    y = jax.random.normal(getkey(), (512, 64))
    overwrites, warm = _mlp_first_step_grads(fp8jax.DelayedScaling(), mlp, x, y)
    _, current = _mlp_first_step_grads(fp8jax.CurrentScaling(), mlp, x, y)
    _, cold = _mlp_first_step_grads(fp8jax.DelayedScaling(warm_start=False), mlp, x, y)
    reference = eqx.filter_grad(_loss)(mlp, x, y)
    for i in range(2):
        np.testing.assert_array_equal(warm.layers[i].weight, current.layers[i].weight)
        np.testing.assert_array_equal(warm.layers[i].bias, current.layers[i].bias)
        assert not np.any(np.asarray(cold.layers[i].weight))  # lost: the cold start
        ref = np.asarray(reference.layers[i].weight, np.float64)
        err = np.linalg.norm(np.asarray(warm.layers[i].weight, np.float64) - ref)
        assert err / np.linalg.norm(ref) < 0.15  # FP8's error, not a lost gradient
    # The step's scales are the current amaxes', and the amaxes enter the histories.
    for role in ("input", "kernel", "output_grad"):
        leaf = getattr(overwrites.layers[1].dot_general, role)
        fmt_max = 57344.0 if role == "output_grad" else 448.0
        amax = float(leaf.amax_history[0])
        assert amax > 0
        assert float(leaf.scale) == 2.0 ** math.floor(math.log2(fmt_max / amax))


def test_warm_start_lasts_until_the_first_amax():
    """An all-zero first step records amax 0: the history is still empty, so the next step
    is warm too; once an amax is recorded the scale is delayed (it ignores the step's own
    amax), also when later entries are zero (`most_recent` then keeps the previous scale)."""
    recipe = fp8jax.DelayedScaling(history_len=3, amax_compute="most_recent")
    layer = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(recipe))

    used, kept = [], []
    for row in ([[0.0, 0.0]], [[3.0, 0.0]], [[0.0, 0.0]], [[100.0, 0.0]]):
        x = jnp.array(row)
        grads = fp8jax.filter_grad(lambda m, x=x: jnp.sum(m(x)))(layer)
        used.append(float(grads.dot.input.scale))  # the step's scale, in its new state
        layer = eqx.tree_at(lambda m: m.dot, layer, layer.dot.merge(grads.dot))
        kept.append(float(layer.dot.input.scale))  # the scale the next step uses
    # 1.0 (nothing to scale by); warm: 448 / 3 -> 128; delayed: history [3] -> 128;
    # delayed: most recent amax 0 keeps 128 (the step's own 100 would give 4).
    assert used == [1.0, 128.0, 128.0, 128.0]
    # Merged: 0 while no amax is recorded (the next step is warm), then from the history.
    assert kept == [0.0, 128.0, 128.0, 4.0]


def test_a_recorded_scale_outlives_a_history_emptied_again():
    """A zero amax keeps the old scale (the contract, as Transformer Engine): with a history
    of one, an all-zero step leaves a history without an amax, and the merged scale is the
    one recorded before, not 0, so the next step is delayed, not warm (its own amax, 100,
    would give 4)."""
    layer = Layer(jnp.eye(2), fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=1)))
    used, kept = [], []
    for row in ([[3.0, 0.0]], [[0.0, 0.0]], [[100.0, 0.0]]):
        x = jnp.array(row)
        grads = fp8jax.filter_grad(lambda m, x=x: jnp.sum(m(x)))(layer)
        used.append(float(grads.dot.input.scale))
        layer = eqx.tree_at(lambda m: m.dot, layer, layer.dot.merge(grads.dot))
        kept.append(float(layer.dot.input.scale))
    want = 2.0 ** math.floor(math.log2(448.0 / 3.0))  # of the one recorded amax, 3
    assert used == [want, want, want]
    assert kept[:2] == [want, want] and float(layer.dot.input.amax_history[0]) == 100.0


class Experts(eqx.Module):
    weight: jax.Array
    dot: fp8jax.Fp8RaggedDot

    def __call__(self, x, sizes):
        return self.dot(x, self.weight, sizes)


def test_warm_first_step_of_a_grouped_layer_matches_current_scaling():
    """Expert layers too: each expert's kernel, the activation and the output gradient are
    scaled by their own amaxes on the first step, so the expert weights' gradients are current
    scaling's; at scale 1.0 this output gradient underflows E5M2 and they are all zero."""
    rng = np.random.default_rng(5)
    sizes = jnp.array([6, 0, 9, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((18, 32)), jnp.float32)
    w = rng.standard_normal((4, 32, 16)) * 10.0 ** np.arange(-3, 1)[:, None, None]
    w = jnp.asarray(w, jnp.float32)
    c = jnp.asarray(rng.standard_normal((18, 16)) * 1e-7, jnp.float32)

    def first_step(recipe):
        layer = Experts(w, fp8jax.Fp8RaggedDot(recipe, num_experts=4))
        grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x, sizes) * c))(layer)
        return fp8jax.partition_for_grad_overwrite(grads)

    warm_state, warm = first_step(fp8jax.DelayedScaling())
    current_state, current = first_step(fp8jax.CurrentScaling())
    _, cold = first_step(fp8jax.DelayedScaling(warm_start=False))
    np.testing.assert_array_equal(warm.weight, current.weight)
    assert np.any(np.asarray(warm.weight)) and not np.any(np.asarray(cold.weight))
    for role in ("input", "kernel", "output_grad"):
        np.testing.assert_array_equal(
            getattr(warm_state.dot, role).scale, getattr(current_state.dot, role).scale
        )


def test_apply_updates_merges_every_layer_at_once_as_each_would_alone():
    """`apply_updates` merges all FP8 layers together (`merge_many`: stacked states, a few
    kernels); each operand's state must still be taken or kept by the rule alone: taken when
    its scale is positive and its scale and newest amax are finite. Checked against that
    rule in NumPy, with a layer used (taken), unused (zero state: kept), fed an inf (kept,
    counted in telemetry), and one layer object at two places of the tree, each place
    merging its own received state."""
    delayed = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=4), telemetry=True)
    current = fp8jax.Fp8DotGeneral(fp8jax.CurrentScaling())
    rng = np.random.default_rng(0)

    def received(op, kind):
        def state(s):
            n = s.amax_history.shape[-1]
            if kind == "unused":
                return fp8jax.TensorState(jnp.zeros(()), jnp.zeros((n,)))
            hist = rng.uniform(0.5, 2.0, n).astype(np.float32)
            if kind == "inf":
                hist[0] = np.inf
            return fp8jax.TensorState(jnp.float32(rng.choice([2.0, 8.0])), jnp.asarray(hist))

        new = eqx.tree_at(
            lambda m: (m.input, m.kernel, m.output_grad),
            op,
            tuple(state(getattr(op, r)) for r in ("input", "kernel", "output_grad")),
        )
        return new

    model = (delayed, current, delayed, current)
    kinds = ("used", "unused", "inf", "used")
    overwrites = tuple(received(op, k) for op, k in zip(model, kinds, strict=True))
    out = fp8jax.apply_updates(model, None, overwrites)
    for op, new, got, kind in zip(model, overwrites, out, kinds, strict=True):
        for role in ("input", "kernel", "output_grad"):
            old_s, new_s, got_s = (getattr(m, role) for m in (op, new, got))
            scale, newest = float(new_s.scale), float(new_s.amax_history[0])
            take = scale > 0 and np.isfinite(scale) and np.isfinite(newest)
            assert take == (kind == "used"), (kind, role)
            want = new_s if take else old_s
            want_scale = np.asarray(want.scale)
            if isinstance(op.recipe, fp8jax.DelayedScaling):  # the scale its next step uses
                fmt_max = 57344.0 if role == "output_grad" else 448.0
                history = np.asarray(want.amax_history)
                want_scale = ref_next_scale(want_scale, history, fmt_max, 0.0, "max", True, True)
            np.testing.assert_array_equal(got_s.scale, want_scale)
            np.testing.assert_array_equal(got_s.amax_history, want.amax_history)
            # The kept inverse, which delayed scaling's GEMMs take as it is: 1 / the scale
            # kept (1 where that is 0, "no amax yet"), whatever the received state held.
            want_inv = 1.0 / np.float64(want_scale) if want_scale > 0 else 1.0
            np.testing.assert_array_equal(got_s.scale_inv, np.float32(want_inv))
    # Telemetry: the layer fed an inf counts a rejected step; the used one does not.
    assert int(out[2].stats.input.rejected) == 1 and int(out[0].stats.input.rejected) == 0
    # Merged together, as one by one.
    for op, new, got in zip(model, overwrites, out, strict=True):
        alone = op.merge(new)
        for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(a, b)


def test_layers_of_different_delayed_recipes_merge_together_as_each_alone():
    """States of one history length are stacked in `merge_many` whatever their recipe: each
    slot's next scale must follow its own recipe (margin, format, rounding, amax_compute,
    warm start), as merging that layer alone does."""
    recipes = [
        fp8jax.DelayedScaling(history_len=4, margin=1, amax_compute="most_recent"),
        fp8jax.DelayedScaling(history_len=4, power_of_two=False, warm_start=False),
        fp8jax.DelayedScaling(history_len=4, backward_format="e4m3", margin=0.5),
        fp8jax.DelayedScaling(history_len=4),
    ]
    rng = np.random.default_rng(3)

    def received(op, i):
        def state(s):
            hist = rng.uniform(0.01, 30.0, 4).astype(np.float32)
            if i == 3:  # a history still empty: the warm start's "no amax yet"
                hist[:] = 0.0
            if i == 0:
                hist[0] = 0.0  # most_recent sees 0: the scale the step used is kept
            return fp8jax.TensorState(jnp.float32(rng.choice([2.0, 8.0])), jnp.asarray(hist))

        roles = ("input", "kernel", "output_grad")
        return eqx.tree_at(
            lambda m: tuple(getattr(m, r) for r in roles),
            op,
            tuple(state(getattr(op, r)) for r in roles),
        )

    model = [fp8jax.Fp8DotGeneral(r) for r in recipes]
    overwrites = [received(op, i) for i, op in enumerate(model)]
    together = fp8jax.apply_updates(model, None, overwrites)
    for op, new, got in zip(model, overwrites, together, strict=True):
        alone = op.merge(new)
        for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(a, b)
        for role in ("input", "kernel", "output_grad"):  # and as the NumPy reference says
            s = getattr(new, role)
            fmt_max = fp8jax.fp8_max(op.recipe.format(role))
            r = op.recipe
            args = (fmt_max, r.margin, r.amax_compute, r.power_of_two, r.warm_start)
            want = ref_next_scale(np.float32(s.scale), np.asarray(s.amax_history), *args)
            np.testing.assert_array_equal(getattr(got, role).scale, want, err_msg=role)
    assert float(together[3].input.scale) == 0.0  # stays "no amax yet"

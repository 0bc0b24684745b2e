"""The train step's pieces against hand-rolled references, for the slips a mutation run of
`fp8jax/_src/train` found no test for: each test fails with one such one-line slip."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax._src.train.loss_scale import DynamicLossScale, states_finite

DELAYED = fp8jax.Fp8Config(recipe="delayed")
ROLES = ("input", "kernel", "output_grad")


def test_a_dynamic_scale_may_start_at_its_floor():
    """The docs' "the initial scale, at least `min_loss_scale`": equal to it is accepted; a backoff
    there stays at the floor (the reference: max(scale * backoff, floor))."""
    for floor in (1.0, 2.0**-20, float(np.finfo(np.float32).tiny)):
        ls = DynamicLossScale(loss_scale=floor, min_loss_scale=floor, period=2)
        assert float(ls.loss_scale) == floor
        ls = ls.adjust(False)
        assert float(ls.loss_scale) == max(floor * 0.5, floor) == floor
        ls = ls.adjust(True).adjust(True)
        assert float(ls.loss_scale) == 2 * floor


class Branchy(eqx.Module):
    a: eqx.Module
    b: eqx.Module

    def __call__(self, x, take_b):
        h = self.a(x)
        return jax.lax.cond(take_b, lambda: self.b(h), lambda: h[:3])


def _branchy(key):
    ka, kb = jax.random.split(key)
    a = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=ka), DELAYED)
    return Branchy(a, fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 3, key=kb), DELAYED))


def test_an_fp8_layer_in_a_branch_not_taken_is_an_unused_layer(getkey):
    """`lax.cond` gives the FP8 state of a branch not taken the max-combining dtype's zero,
    -inf: make_train_step read it as a non-finite state and skipped the step (grads_finite
    False, no weight moved) every time the branch was not taken. The reference: the same
    gradient of a loss that leaves the layer out (its state's 0, kept by its merge): the
    same trainable gradients and, merged, the same model, bit for bit."""
    model, x = _branchy(getkey()), jax.random.normal(getkey(), (2, 4))

    def branchy(m, x):
        return jnp.mean(jax.vmap(lambda r: m(r, jnp.asarray(False)))(x) ** 2)

    def without_b(m, x):
        return jnp.mean(jax.vmap(lambda r: m.a(r)[:3])(x) ** 2)

    trees = []
    for loss in (branchy, without_b):
        _, grads = fp8jax.filter_value_and_grad(loss)(model, x)
        overwrites, rest = fp8jax.partition_for_grad_overwrite(grads)
        assert bool(states_finite(overwrites)) and bool(fp8jax.all_finite(rest))
        trees.append((rest, fp8jax.apply_updates(model, None, overwrites)))
    for got, want in zip(jax.tree.leaves(trees[0]), jax.tree.leaves(trees[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_branch_not_taken_is_no_rejected_update(getkey):
    """The -inf a layer in a `lax.cond` branch not taken receives is nothing received, not an
    operand that held an inf: telemetry's `rejected` counts neither the step's gradients nor
    the merged model, as for a loss leaving the layer out (0), while a NaN operand is one;
    and the gradients' telemetry is that loss's, figure for figure."""
    config = fp8jax.Fp8Config(recipe="delayed", telemetry=True)
    ka, kb = jax.random.split(getkey())
    model = Branchy(
        fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=ka), config),
        fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 3, key=kb), config),
    )

    def branchy(m, x, take):
        return jnp.mean(jax.vmap(lambda r: m(r, jnp.asarray(take)))(x) ** 2)

    for x, take, want in [
        (jax.random.normal(getkey(), (2, 4)), False, 0),
        (jnp.full((2, 4), jnp.nan), True, 1),
    ]:
        _, grads = fp8jax.filter_value_and_grad(branchy)(model, x, take)
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
        merged = fp8jax.apply_updates(model, None, overwrites)
        for tree in (grads, merged):
            layers = fp8jax.telemetry(tree.b).values()
            counts = [int(np.max(getattr(t, r).rejected)) for t in layers for r in ROLES]
            assert counts and max(counts) == want, (take, counts)
    # The branch not taken reads as a loss leaving the layer out: every figure alike.
    x = jax.random.normal(getkey(), (2, 4))
    left_out = fp8jax.filter_grad(lambda m, x: jnp.mean(jax.vmap(lambda r: m.a(r)[:3])(x) ** 2))
    for got, want in zip(
        jax.tree.leaves(fp8jax.telemetry(fp8jax.filter_grad(branchy)(model, x, False).b)),
        jax.tree.leaves(fp8jax.telemetry(left_out(model, x).b)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


def test_microbatches_tied_at_amax_0_keep_the_recorded_history(getkey):
    """An FP8 layer that ran on zeros in one microbatch (newest amax 0, an earlier step's
    amax of 3 in its history) and did not run in the next (a `lax.cond` branch not taken: a
    state of zeros) tie on the newest amax; the accumulated state is the one that ran, its
    history max 3 (the reference: max |x| of the earlier step), not the zero state's 0."""
    model = _branchy(getkey())

    def loss(m, x, take_b):
        return jnp.mean(jax.vmap(lambda r: m(r, take_b[0]))(x) ** 2)

    x0 = jnp.full((2, 4), 3.0)
    _, grads = fp8jax.filter_value_and_grad(lambda m, x: jnp.sum(jax.vmap(m.b)(x)))(model, x0)
    model = fp8jax.apply_updates(model, None, fp8jax.partition_for_grad_overwrite(grads)[0])
    assert float(jnp.max(model.b.dot_general.input.amax_history)) == 3.0
    take_b = jnp.asarray([True, True, False, False])
    x = jnp.concatenate([jnp.zeros((2, 4)), x0])
    model = eqx.tree_at(lambda m: (m.a.weight, m.a.bias), model, replace_fn=jnp.zeros_like)
    _, grads = eqx.filter_jit(fp8jax.accumulate_gradients(loss, 2))(model, x, take_b)
    history = grads.b.dot_general.input.amax_history
    assert float(history[0]) == 0.0 and float(jnp.max(history)) == 3.0


def test_metrics_report_the_scale_the_step_used(getkey):
    """`StepMetrics.loss_scale` is "the scale this step used", not the adjusted one the state
    carries on: against a hand-rolled schedule (period 1: doubled after each finite step,
    halved after an overflowing one)."""
    model = eqx.nn.Linear(3, 2, key=getkey())

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    step = fp8jax.make_train_step(
        loss, optax.sgd(1e-3), loss_scale=DynamicLossScale(8.0, period=1), compiler_options={}
    )
    state, used, want = step.init(model), [], 8.0
    for x in (jnp.ones((2, 3)), jnp.full((2, 3), jnp.inf), jnp.ones((2, 3))):
        state, metrics = step(state, x)
        used.append(float(metrics.loss_scale))
        want = want * 2 if bool(metrics.grads_finite) else want / 2
        assert float(state.loss_scale.loss_scale) == want
    assert used == [8.0, 16.0, 8.0]


def test_float32_updates_of_bfloat16_parameters_are_stored_in_bfloat16(getkey):
    """`params=bfloat16`: an optimizer whose updates are float32 (here a constant -0.25)
    must not widen the stored parameters, which stay bfloat16 as the policy says, each the
    float64 sum rounded once to bfloat16 (the reference, via ml_dtypes)."""
    model = eqx.nn.Linear(3, 2, key=getkey())

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    def constant(grads, params=None):
        return jax.tree.map(lambda g: jnp.full(g.shape, -0.25, jnp.float32), grads)

    step = fp8jax.make_train_step(
        loss, optax.stateless(constant), policy="params=bfloat16", compiler_options={}
    )
    state = step.init(model)
    before = jax.tree.map(np.asarray, (state.model.weight, state.model.bias))
    for _ in range(2):  # a second step: the state's dtypes still those the step expects
        state, metrics = step(state, jnp.ones((2, 3)))
        assert bool(metrics.grads_finite)
    for got, old in zip((state.model.weight, state.model.bias), before, strict=True):
        assert got.dtype == jnp.bfloat16
        once = (old.astype(np.float64) - 0.25).astype(jnp.bfloat16)
        want = (once.astype(np.float64) - 0.25).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_one_dimensional_batch_arrays_are_cut_into_microbatches(getkey):
    """Labels of shape (batch,) are cut along their axis as `x` is, not passed whole (only
    0-d leaves are): the accumulated loss and gradients are the whole batch's, against one
    `jax.value_and_grad` over it (float32; summation order only)."""
    model = eqx.nn.Linear(3, "scalar", key=getkey())
    x, y = jax.random.normal(getkey(), (8, 3)), jnp.arange(8.0)

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    want_loss, want = jax.value_and_grad(loss)(model, x, y)
    got_loss, got = fp8jax.accumulate_gradients(loss, 4)(model, x, y)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_aux_of_one_microbatch_is_stacked_as_of_several(getkey):
    """With `has_aux`, aux comes back stacked over the microbatches, one of them included:
    a leading axis of 1 over `fun`'s own aux (the reference: `fun` called directly)."""
    model = eqx.nn.Linear(3, 2, key=getkey())
    x = jax.random.normal(getkey(), (4, 3))

    def loss(m, x):
        out = jax.vmap(m)(x)
        return jnp.mean(out**2), {"out": out, "n": 4}

    (_, aux), _ = fp8jax.accumulate_gradients(loss, 1, has_aux=True)(model, x)
    _, want = loss(model, x)
    np.testing.assert_allclose(np.asarray(aux["out"]), np.asarray(want["out"])[None], rtol=1e-6)
    assert jnp.shape(aux["n"]) == (1,) and int(aux["n"][0]) == 4

"""optax and FP8 state side by side: the state is never clipped, decayed or cast."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import make_train_step
from test_delayed_scaling import ref_next_scale, ref_update

import fp8jax


def to_compute_dtype(model, dtype):
    """Cast the model's float parameters to `dtype`, leaving FP8 state alone."""
    state, params = fp8jax.partition_for_grad_overwrite(model)
    params = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, params)
    return eqx.combine(state, params, is_leaf=lambda x: isinstance(x, fp8jax.Fp8DotGeneral))


def test_adamw_after_clipping_with_float32_master_weights(getkey):
    assert tuple(map(int, optax.__version__.split(".")[:3])) >= (0, 2, 7)
    recipe = fp8jax.DelayedScaling(history_len=4)
    mlp = eqx.nn.MLP(8, 2, 32, 2, use_final_bias=False, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    x = jax.random.normal(getkey(), (64, 8)) * 2
    y = jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], axis=1)
    # A tight clip and strong decay: either would visibly change FP8 state if it reached it.
    optimizer = optax.chain(optax.clip_by_global_norm(1e-2), optax.adamw(3e-3, weight_decay=0.5))
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    assert not any(x.shape == (4,) for x in jax.tree.leaves(opt_state))  # no FP8 history

    def loss_fn(model, x, y):
        pred = jax.vmap(to_compute_dtype(model, jnp.bfloat16))(x.astype(jnp.bfloat16))
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    step = eqx.filter_jit(make_train_step(loss_fn, optimizer))

    losses = []
    for _ in range(30):
        before = model
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
        for old_layer, new_layer in zip(before.layers, model.layers, strict=True):
            old, new = old_layer.dot_general, new_layer.dot_general
            # Master weights stay float32 and move.
            assert new_layer.weight.dtype == jnp.float32
            assert not np.array_equal(new_layer.weight, old_layer.weight)
            seen = {
                "kernel": np.abs(
                    np.asarray(old_layer.weight.astype(jnp.bfloat16), np.float32)
                ).max(),
                "output_grad": float(new.output_grad.amax_history[0]),
            }
            if old_layer is before.layers[0]:
                seen["input"] = np.abs(np.asarray(x.astype(jnp.bfloat16), np.float32)).max()
            for role, amax in seen.items():
                o, n = getattr(old, role), getattr(new, role)
                assert n.scale.dtype == n.amax_history.dtype == jnp.float32
                rules = (fp8jax.fp8_max(recipe.format(role)), recipe.margin, recipe.amax_compute)
                # The step used the state's scale (0: no amax yet, so its own: warm start),
                # and the merged state holds the one the next step uses.
                used, want_hist = ref_update(
                    np.asarray(o.scale) if o.scale > 0 else np.float32(1.0),
                    np.asarray(o.amax_history).copy(),
                    amax,
                    *rules,
                    warm_start=recipe.warm_start,
                )
                if o.scale > 0:
                    used = np.asarray(o.scale)
                want_scale = ref_next_scale(used, want_hist, *rules, True, recipe.warm_start)
                np.testing.assert_array_equal(n.scale, want_scale, err_msg=role)
                np.testing.assert_array_equal(n.amax_history, want_hist, err_msg=role)
    assert losses[-1] < 0.8 * losses[0], losses


def test_layer_without_gradient_keeps_its_state(getkey):
    """An unused layer, or one cut off by stop_gradient, receives a zero 'new state'."""
    used = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey()))
    unused = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey()))
    cut = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey()))
    # Give every layer a history already, so "kept" and "reset" are distinguishable (and the
    # scale that history gives: 448 / 2, rounded down to a power of two).
    model = [
        eqx.tree_at(
            lambda m: m.dot_general.input,
            m,
            fp8jax.TensorState(jnp.float32(128.0), jnp.full(1024, 2.0)),
        )
        for m in (used, unused, cut)
    ]
    x = jnp.ones((3, 4))

    def loss(model):
        return jnp.sum(model[0](x)) + jnp.sum(jax.lax.stop_gradient(model[2](x)))

    for grad in (eqx.filter_grad, fp8jax.filter_grad):
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grad(loss)(model))
        new = fp8jax.apply_updates(model, jax.tree.map(jnp.zeros_like, grads), overwrites)
        # 448 / 2, rounded down to a power of two: updated
        assert float(new[0].dot_general.input.scale) == 128.0
        assert float(new[0].dot_general.input.amax_history[0]) == 1.0
        for i in (1, 2):
            for a, b in zip(
                jax.tree.leaves(new[i].dot_general),
                jax.tree.leaves(model[i].dot_general),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b)


def test_combine_by_max_inside_a_custom_gradient(getkey):
    """combine_by_max lets plain jax.grad (inside jit) combine a shared layer's amaxes."""
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 2, key=getkey()))
    params, static = eqx.partition(linear, eqx.is_array)
    x1, x2 = jnp.full((1, 4), 3.0), jnp.full((1, 4), -5.0)

    @jax.jit
    def grads(params):
        def loss(params):
            model = fp8jax.combine_by_max(eqx.combine(params, static))
            return jnp.sum(model(x1)) + jnp.sum(model(x2))

        return jax.grad(loss)(params)

    assert float(grads(params).dot_general.input.amax_history[0]) == 5.0


def _mlp(getkey):
    """Two FP8 Linears of width 32 with delayed scaling, and a batch for them."""
    mlp = eqx.nn.MLP(32, 32, 32, 1, key=getkey())
    recipe = fp8jax.DelayedScaling(history_len=4)
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    x = jax.random.normal(getkey(), (16, 32))
    return model, x, jnp.sin(x)


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_train_step_mask_of_the_whole_model_says_which_tree_it_needs(getkey):
    """A mask built from the whole model (FP8 state included) fails optax's own tree check;
    the error says what tree make_train_step gives the optimizer. A mask built from that
    tree decays the matrices only, as in a hand-rolled step on the trainable part."""
    model, x, y = _mlp(getkey)

    def decaying(mask):
        return optax.chain(optax.add_decayed_weights(0.5, mask), optax.sgd(0.1))

    whole = jax.tree.map(lambda a: eqx.is_array(a) and a.ndim == 2, model)
    step = fp8jax.make_train_step(_mse, decaying(whole))
    try:
        step.init(model)
    except ValueError as error:
        said = "\n".join(getattr(error, "__notes__", []))
    else:
        raise AssertionError("a mask of the whole model was accepted")
    assert "eqx.filter(fp8jax.partition_for_grad_overwrite(model)[1]" in said, said

    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    params = eqx.filter(trainable, eqx.is_inexact_array)
    mask = jax.tree.map(lambda a: a.ndim == 2, params)
    step = fp8jax.make_train_step(_mse, decaying(mask))
    state, _ = step(step.init(model), x, y)
    # The reference: the gradients' SGD step by hand, weight decay on the matrices only.
    _, grads = fp8jax.filter_value_and_grad(_mse)(model, x, y)
    for old, new, grad in zip(model.layers, state.model.layers, grads.layers, strict=True):
        w = np.asarray(old.weight, np.float64)
        want_w = w - 0.1 * (np.asarray(grad.weight, np.float64) + 0.5 * w)
        want_b = np.asarray(old.bias, np.float64) - 0.1 * np.asarray(grad.bias, np.float64)
        np.testing.assert_allclose(new.weight, want_w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(new.bias, want_b, rtol=1e-6, atol=1e-7)
        # The FP8 state: what the gradients' new state merges into, as under plain SGD.
        want = old.dot_general.merge(grad.dot_general)
        for a, b in zip(jax.tree.leaves(new.dot_general), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_multisteps_moves_weights_every_kth_call_and_fp8_state_every_call(getkey):
    """optax.MultiSteps accumulates in the optimizer state: under make_train_step the weights
    take the mean gradient's SGD step every second call, while each call's new FP8 state is
    merged (its amaxes enter the histories), as docs/training.md says."""
    model, x, y = _mlp(getkey)
    batches = [(x, y), (2 * x, jnp.cos(x))]
    optimizer = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2).gradient_transformation()
    step = fp8jax.make_train_step(_mse, optimizer)
    state = step.init(model)
    # The reference: gradients by hand, the FP8 state merged after each, the weights after two.
    ref, grads = model, []
    for i, batch in enumerate(batches):
        state, _ = step(state, *batch)
        _, g = fp8jax.filter_value_and_grad(_mse)(ref, *batch)
        overwrites, g = fp8jax.partition_for_grad_overwrite(g)
        ref = fp8jax.apply_updates(ref, None, overwrites)
        grads.append(g)
        for new, old, want in zip(state.model.layers, model.layers, ref.layers, strict=True):
            for a, b in zip(
                jax.tree.leaves(new.dot_general), jax.tree.leaves(want.dot_general), strict=True
            ):
                np.testing.assert_allclose(a, b, rtol=1e-6)
            if i == 0:
                np.testing.assert_array_equal(new.weight, old.weight)
                np.testing.assert_array_equal(new.bias, old.bias)
    history = state.model.layers[0].dot_general.input.amax_history
    np.testing.assert_allclose(history[:2], [2 * np.abs(x).max(), 0.0], rtol=1e-6)
    assert float(history[-1]) == float(np.abs(x).max())
    for i, (new, old) in enumerate(zip(state.model.layers, model.layers, strict=True)):
        for name in ("weight", "bias"):
            mean = sum(np.asarray(getattr(g.layers[i], name), np.float64) for g in grads) / 2
            want = np.asarray(getattr(old, name), np.float64) - 0.1 * mean
            np.testing.assert_allclose(getattr(new, name), want, rtol=1e-6, atol=1e-7)


def test_apply_if_finite_counts_only_steps_make_train_step_does_not_skip(getkey):
    """A skipped step restores the optimizer state, optax.apply_if_finite's counts included:
    they advance only with skip_nonfinite=False, which lets apply_if_finite decide (a zero
    update for a non-finite gradient; the FP8 state rejects the non-finite amaxes)."""
    model, x, y = _mlp(getkey)
    bad = x.at[0, 0].set(jnp.nan)
    for skip, counted in ((True, 0), (False, 2)):
        optimizer = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5)
        step = fp8jax.make_train_step(_mse, optimizer, skip_nonfinite=skip)
        state = step.init(model)
        for _ in range(2):
            state, metrics = step(state, bad, y)
            assert not bool(metrics.grads_finite)
        assert int(state.opt_state.notfinite_count) == counted
        assert int(state.opt_state.total_notfinite) == counted
        for new, old in zip(state.model.layers, model.layers, strict=True):
            np.testing.assert_array_equal(new.weight, old.weight)
            np.testing.assert_array_equal(new.dot_general.input.amax_history, 0.0)

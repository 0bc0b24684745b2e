"""FP8 layers under jit, vmap, lax.scan, checkpointing and serialisation."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8jax


def assert_trees_close(a, b, rtol=0.0):
    """Equal arrays; `rtol` allows for float32 rounding where XLA may fuse differently."""
    la, lb = (
        jax.tree.leaves(eqx.filter(a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_array)),
    )
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=0)


def train_step(loss_fn):
    """A plain SGD step that applies the FP8 state overwrites."""

    def step(model, *args):
        grads = fp8jax.filter_grad(loss_fn)(model, *args)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -0.1 * g, grads)
        return fp8jax.apply_updates(model, updates, overwrites)

    return step


@pytest.fixture
def mlp(getkey):
    return fp8jax.fp8_linear_layers(eqx.nn.MLP(4, 3, 8, 1, key=getkey()))


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_jit_and_eager_agree(mlp, getkey):
    x, y = jax.random.normal(getkey(), (16, 4)), jax.random.normal(getkey(), (16, 3))
    step = train_step(mse)
    eager, jitted = mlp, mlp
    for _ in range(3):
        eager = step(eager, x, y)
        jitted = eqx.filter_jit(step)(jitted, x, y)
    # jit may fuse float32 ops differently from eager: allow an ulp or two.
    assert_trees_close(eager, jitted, rtol=1e-6)
    # The state did move.
    assert float(jitted.layers[0].dot_general.input.scale) != 1.0


def test_vmap_over_models(getkey):
    """An ensemble: vmap over stacked models, each with its own FP8 state."""
    keys = jax.random.split(getkey(), 3)
    make = eqx.filter_vmap(lambda k: fp8jax.fp8_linear_layers(eqx.nn.MLP(4, 3, 8, 1, key=k)))
    ensemble = make(keys)
    x = jax.random.normal(getkey(), (16, 4))
    xs = x * jnp.array([1.0, 10.0, 100.0])[:, None, None]  # a different amax per member
    y = jnp.zeros((16, 3))
    step = eqx.filter_vmap(train_step(mse), in_axes=(eqx.if_array(0), 0, None))
    new = step(ensemble, xs, y)
    amaxes = new.layers[0].dot_general.input.amax_history[:, 0]
    np.testing.assert_array_equal(amaxes, jnp.max(jnp.abs(xs), axis=(1, 2)))

    def member(tree, i):
        return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)

    single_step = eqx.filter_jit(train_step(mse))  # one compile for the three members
    for i in range(3):
        single = single_step(member(ensemble, i), xs[i], y)
        assert_trees_close(member(new, i), single, rtol=1e-6)


def test_scan_over_stacked_layers_equals_a_loop(getkey):
    """The Equinox pattern: layers stacked with filter_vmap, applied with lax.scan."""
    keys = jax.random.split(getkey(), 3)
    layers = eqx.filter_vmap(lambda k: fp8jax.fp8_linear_layers(eqx.nn.Linear(6, 6, key=k)))(keys)
    params, static = eqx.partition(layers, eqx.is_array)

    def scanned(params, x):
        def body(h, p):
            return jnp.tanh(eqx.combine(p, static)(h)), None

        return jnp.sum(lax.scan(body, x, params)[0] ** 2)

    def looped(params, x):
        for i in range(3):
            layer = jax.tree.map(
                lambda a, i=i: lax.dynamic_index_in_dim(a, i, keepdims=False), params
            )
            x = jnp.tanh(eqx.combine(layer, static)(x))
        return jnp.sum(x**2)

    x = jax.random.normal(getkey(), (5, 6)) * 4
    g_scan = eqx.filter_jit(fp8jax.filter_grad(scanned))(params, x)
    g_loop = eqx.filter_jit(fp8jax.filter_grad(looped))(params, x)
    assert_trees_close(g_scan, g_loop, rtol=1e-6)
    # Each layer recorded its own input amax.
    amax = g_scan.dot_general.input.amax_history[:, 0]
    assert len(set(np.asarray(amax).tolist())) == 3


def test_static_slice_of_state_gets_a_clear_error(getkey):
    keys = jax.random.split(getkey(), 2)
    layers = eqx.filter_vmap(lambda k: fp8jax.fp8_linear_layers(eqx.nn.Linear(6, 6, key=k)))(keys)
    params, static = eqx.partition(layers, eqx.is_array)

    def indexed(params, x):
        return jnp.sum(eqx.combine(jax.tree.map(lambda a: a[0], params), static)(x))

    with pytest.raises(TypeError, match="dynamic_index_in_dim"):
        fp8jax.filter_grad(indexed)(params, jnp.ones((2, 6)))
    # A layer used once per step needs no max-combining: Equinox's own gradient works.
    grads = eqx.filter_grad(indexed)(params, jnp.ones((2, 6)))
    assert float(grads.dot_general.input.amax_history[0, 0]) == 1.0


def test_filter_checkpoint_gives_identical_gradients(mlp, getkey):
    x, y = jax.random.normal(getkey(), (16, 4)), jax.random.normal(getkey(), (16, 3))

    def checkpointed(model, x, y):
        return eqx.filter_checkpoint(mse)(model, x, y)

    plain = eqx.filter_jit(fp8jax.filter_grad(mse))(mlp, x, y)
    remat = eqx.filter_jit(fp8jax.filter_grad(checkpointed))(mlp, x, y)
    assert_trees_close(plain, remat)


def test_serialise_round_trip_keeps_fp8_state(mlp, getkey):
    x, y = jax.random.normal(getkey(), (16, 4)), jax.random.normal(getkey(), (16, 3))
    trained, step = mlp, eqx.filter_jit(train_step(mse))
    for _ in range(2):
        trained = step(trained, x, y)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, trained)
    buffer.seek(0)
    fresh = fp8jax.fp8_linear_layers(eqx.nn.MLP(4, 3, 8, 1, key=getkey()))
    restored = eqx.tree_deserialise_leaves(buffer, fresh)
    assert_trees_close(restored, trained)
    assert float(restored.layers[1].dot_general.output_grad.scale) != 1.0
    np.testing.assert_array_equal(mse(restored, x, y), mse(trained, x, y))

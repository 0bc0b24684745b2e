"""fp8_linear_layers on Haliax models (the haliax extra; skipped where haliax is absent)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import matmul_error_bound

import fp8jax

hax = pytest.importorskip("haliax", reason="needs haliax (the haliax extra)")
hnn = pytest.importorskip("haliax.nn", reason="needs haliax (the haliax extra)")

Embed, Mlp, Batch, Layers = (
    hax.Axis("embed", 8),
    hax.Axis("mlp", 16),
    hax.Axis("batch", 5),
    hax.Axis("layers", 3),
)


class HBlock(eqx.Module):
    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return HBlock(hnn.Linear.init(Embed, Mlp, key=k1), hnn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x):
        return self.down(hax.nn.relu(self.up(x)))


def test_haliax_linear_gets_fp8_dot_general(getkey):
    lin = hnn.Linear.init(Embed, Mlp, key=getkey())
    fp8 = fp8jax.fp8_linear_layers(lin)
    assert isinstance(fp8.dot_general, fp8jax.Fp8DotGeneral)
    assert fp8.weight is lin.weight
    x = hax.random.normal(getkey(), (Batch, Embed))
    got, want = fp8(x), lin(x)
    assert got.axes == want.axes
    w = lin.weight.rearrange((Mlp, Embed)).array
    bound = matmul_error_bound(x.array, w)
    np.testing.assert_array_less(np.abs(got.array - want.array), bound)


def test_haliax_stacked_keeps_one_state_per_layer(getkey):
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    fp8 = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config(targets=["up", "down"]))
    dot = fp8.stacked.up.dot_general
    assert dot.input.scale.shape == (3,) and dot.input.amax_history.shape == (3, 1024)
    x = hax.random.normal(getkey(), (Batch, Embed)) * 3

    def loss(m):
        return hax.sum(m.fold(x) ** 2).scalar()

    grads = fp8jax.filter_grad(loss)(fp8)
    # Layer i's input amax is that of the activation entering it, computed layer by layer.
    h = x
    for i in range(Layers.size):
        layer = fp8.get_layer(i)
        want = float(jnp.max(jnp.abs(h.array)))
        assert float(grads.stacked.up.dot_general.input.amax_history[i, 0]) == want
        h = layer(h)
    np.testing.assert_allclose(loss(fp8), float(hax.sum(h**2).scalar()), rtol=1e-6)
    overwrites, rest = fp8jax.partition_for_grad_overwrite(grads)
    updated = fp8jax.apply_updates(fp8, jax.tree.map(jnp.zeros_like, rest), overwrites)
    amaxes = updated.stacked.up.dot_general.input.amax_history[:, 0]
    assert len(set(np.asarray(amaxes).tolist())) == 3

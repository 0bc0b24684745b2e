"""fp8_linear_layers on Haliax models (the haliax extra; skipped where haliax is absent)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_haliax_quantized_linear_keeps_its_quantization_and_is_named(getkey, kind):
    """A Linear that haliax.quantization quantized already keeps its own quantization, named
    with why in the plan and a warning (its dot_general was replaced, silently); the others
    are converted."""
    from haliax import quantization

    block = HBlock.init(key=getkey())
    up = quantization.quantize_linear_layers(
        block.up, quantization.QuantizationConfig(**{kind: True})
    )
    block = eqx.tree_at(lambda b: b.up, block, up)
    config = fp8jax.Fp8Config(exclude=None)
    why = type(up.dot_general).__name__
    assert fp8jax.conversion_plan(block, config).kept == {
        "up": f"it is quantized by haliax.quantization already ({why})"
    }
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"1 Haliax Linear.*: up\. Build"):
        fp8 = fp8jax.fp8_linear_layers(block, config)
    assert fp8.up is block.up
    assert isinstance(fp8.down.dot_general, fp8jax.Fp8DotGeneral)
    # Excluded by the config anyway: no warning (kept for the config's reason).
    plan = fp8jax.conversion_plan(block, fp8jax.Fp8Config(exclude="up"))
    assert "haliax.quantization" not in plan.kept["up"]


def test_haliax_linear_with_a_dot_general_of_its_own_keeps_it_and_is_named(getkey):
    """A Linear built with a `dot_general` of the user's stays as it is, in high precision,
    named with why in the plan and a warning saying how to convert it (its GEMM was
    replaced by FP8's, silently); one built with `jax.lax.dot_general`, Haliax's default
    GEMM, converts as a default one does."""
    import dataclasses

    from haliax import quantization

    class Doubled(eqx.Module):  # the user's GEMM: lax's, its output doubled
        def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
            return 2 * jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, **kwargs)

    block = HBlock.init(key=getkey())
    block = eqx.tree_at(lambda b: b.up, block, dataclasses.replace(block.up, dot_general=Doubled()))
    config = fp8jax.Fp8Config(exclude=None)
    why = "it has a dot_general of its own (Doubled), which FP8's would replace"
    assert fp8jax.conversion_plan(block, config).kept == {"up": why}
    with pytest.warns(
        fp8jax.Fp8ConversionWarning,
        match=r"1 Haliax Linear.* of their own .*: up\. To convert .*DefaultDotGeneralOp\.init\(\)",
    ):
        fp8 = fp8jax.fp8_linear_layers(block, config)
    assert fp8.up is block.up
    assert isinstance(fp8.down.dot_general, fp8jax.Fp8DotGeneral)
    x = hax.random.normal(getkey(), (Batch, Embed))
    default = dataclasses.replace(block.up, dot_general=quantization.DefaultDotGeneralOp.init())
    np.testing.assert_array_equal(fp8.up(x).array, 2 * default(x).array)
    # What the warning says converts it; so does jax.lax.dot_general, Haliax's default GEMM.
    for op in (quantization.DefaultDotGeneralOp.init(), jax.lax.dot_general):
        plain = eqx.tree_at(lambda b: b.up, block, dataclasses.replace(block.up, dot_general=op))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            converted = fp8jax.fp8_linear_layers(plain, config)
        assert isinstance(converted.up.dot_general, fp8jax.Fp8DotGeneral)


def test_haliax_fp8_layer_kept_trains_as_haliax_trains_it(getkey):
    """A Linear Haliax quantized to FP8 itself, kept by the conversion, trains in
    make_train_step as in Haliax's own loop (its partition_for_grad_overwrite and
    apply_updates): its state is overwritten by its gradient, never given to the optimizer
    (Adam moved it as a parameter: a negative amax, and the loss collapsed)."""
    from haliax import quantization

    lin = hnn.Linear.init(Embed, Mlp, key=getkey())
    lin = quantization.quantize_linear_layers(lin, quantization.QuantizationConfig(fp8=True))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match="haliax.quantization"):
        model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(exclude=None))
    assert model is lin
    x = hax.random.normal(getkey(), (Batch, Embed)) * 3

    def loss(m, x):
        return hax.mean(m(x) ** 2).scalar()

    tx = optax.adam(1e-2)
    step = fp8jax.make_train_step(loss, tx, compiler_options={})
    state = step.init(model)

    def trainable(m):
        return eqx.filter(quantization.partition_for_grad_overwrite(m)[1], eqx.is_inexact_array)

    @eqx.filter_jit
    def haliax_step(m, opt_state, x):
        value, grads = eqx.filter_value_and_grad(loss)(m, x)
        overwrites, grads = quantization.partition_for_grad_overwrite(grads)
        updates, opt_state = tx.update(grads, opt_state, trainable(m))
        return quantization.apply_updates(m, updates, overwrites), opt_state, value

    m, opt_state = model, tx.init(trainable(model))
    for _ in range(3):
        state, metrics = step(state, x)
        m, opt_state, value = haliax_step(m, opt_state, x)
        np.testing.assert_allclose(metrics.loss, value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(m), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert float(state.model.dot_general.input_amax_history[0]) > 0


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


def test_haliax_linear_built_under_vmap_gets_one_state_per_layer(getkey):
    """A Linear built under hax.vmap (a layer axis outside any Stacked) gets one FP8 state
    per layer, as a Stacked's does, and trains under hax.vmap: each layer computes, and
    records, what that layer converted alone does (it got one scalar state and crashed)."""
    keys = jax.random.split(getkey(), Layers.size)
    lin = hax.vmap(hnn.Linear.init, Layers)(Embed, Mlp, key=keys)
    fp8 = fp8jax.fp8_linear_layers(lin)
    assert fp8.dot_general.input.amax_history.shape == (Layers.size, 1024)
    x = hax.random.normal(getkey(), (Layers, Batch, Embed)) * hax.arange(Layers).broadcast_axis(
        (Batch, Embed)
    )

    def loss(m, x):
        return hax.sum(hax.vmap(lambda layer, x: layer(x), Layers)(m, x) ** 2).scalar()

    got, grads = fp8jax.filter_value_and_grad(loss)(fp8, x)
    want = 0.0
    for i in range(Layers.size):
        one = fp8jax.fp8_linear_layers(hnn.Linear.init(Embed, Mlp, key=keys[i]))

        def loss_i(m, xi):
            return hax.sum(m(xi) ** 2).scalar()

        value, grads_i = fp8jax.filter_value_and_grad(loss_i)(one, x[Layers, i])
        want += value
        for a, b in zip(
            jax.tree.leaves(grads.dot_general), jax.tree.leaves(grads_i.dot_general), strict=True
        ):
            np.testing.assert_array_equal(a[i], b)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"a stack of \(3,\) states .* one member at a time"):
        fp8(x)


def test_haliax_stacked_fp8jax_linear_gets_one_state_per_layer(getkey):
    """An fp8jax.Linear built with another GEMM inside a Stacked: its weight carries the
    layer axis already, so its FP8 state is stacked once, and it computes what the same
    stack of eqx.nn.Linears converted computes."""

    class Block(eqx.Module):
        lin: eqx.Module

        @staticmethod
        def init(plain, *, key):
            lin = eqx.nn.Linear(8, 8, key=key)
            if plain:
                return Block(lin)
            return Block(fp8jax.Linear(lin.weight, lin.bias, dot_general=jax.lax.dot_general))

        def __call__(self, x):
            return x + jax.vmap(self.lin)(x)

    keys = jax.random.split(getkey(), Layers.size)
    config = fp8jax.Fp8Config(exclude=None)
    ours = fp8jax.fp8_linear_layers(hnn.Stacked.init(Layers, Block)(False, key=keys), config)
    want = fp8jax.fp8_linear_layers(hnn.Stacked.init(Layers, Block)(True, key=keys), config)
    assert ours.stacked.lin.dot_general.input.amax_history.shape == (3, 1024)
    x = jax.random.normal(getkey(), (4, 8)) * 3

    def loss(m):
        return jnp.sum(m.fold(x) ** 2)

    got, grads = fp8jax.filter_value_and_grad(loss)(ours)
    expected, grads_e = fp8jax.filter_value_and_grad(loss)(want)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(grads.stacked.lin.weight, grads_e.stacked.lin.weight)
    for a, b in zip(
        jax.tree.leaves(grads.stacked.lin.dot_general),
        jax.tree.leaves(grads_e.stacked.lin.dot_general),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_haliax_named_batch_splits_into_microbatches(getkey):
    """A NamedArray batch is cut along its first named axis, each microbatch a NamedArray of
    that axis resized: the same loss and gradients as the plain array cut and named in the
    loss, and make_train_step(microbatches=2) trains on it."""
    model = fp8jax.fp8_linear_layers(hnn.Linear.init(Embed, Mlp, key=getkey()))
    Rows = hax.Axis("batch", 8)
    x = hax.random.normal(getkey(), (Rows, Embed)) * 3

    def loss(m, x):
        return hax.mean(m(x) ** 2).scalar()

    def plain_loss(m, a):
        return loss(m, hax.named(a, (Rows.resize(a.shape[0]), Embed)))

    got, grads = fp8jax.accumulate_gradients(loss, 2)(model, x)
    want, grads_e = fp8jax.accumulate_gradients(plain_loss, 2)(model, x.array)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_e), strict=True):
        np.testing.assert_array_equal(a, b)
    step = fp8jax.make_train_step(loss, optax.sgd(0.0), microbatches=2)
    _, metrics = step(step.init(model), x)
    np.testing.assert_allclose(metrics.loss, want, rtol=1e-6)


def test_a_named_scalar_beside_a_named_batch_goes_whole_to_every_microbatch(getkey):
    """A 0-d NamedArray (a temperature) beside a NamedArray batch: the batch is cut, the
    scalar given whole to each microbatch, as if the loss closed over it."""
    model = fp8jax.fp8_linear_layers(hnn.Linear.init(Embed, Mlp, key=getkey()))
    x = hax.random.normal(getkey(), (hax.Axis("batch", 8), Embed))

    def loss(m, x, t):
        return hax.mean(m(x) ** 2).scalar() * t.scalar()

    got, grads = fp8jax.accumulate_gradients(loss, 2)(model, x, hax.named(jnp.float32(3.0), ()))
    closed = lambda m, x: hax.mean(m(x) ** 2).scalar() * 3.0  # noqa: E731
    want, grads_c = fp8jax.accumulate_gradients(closed, 2)(model, x)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_named_aux_is_stacked_along_a_microbatch_axis(microbatches, getkey):
    """A NamedArray in aux, stacked over the microbatches, gains a leading `microbatch` axis
    (its array and its axes agree), each entry the aux of that microbatch's loss."""
    model = hnn.Linear.init(Embed, Mlp, key=getkey())
    Rows = hax.Axis("batch", 4)
    x = hax.random.normal(getkey(), (Rows, Embed))

    def loss(m, x):
        out = m(x)
        return hax.mean(out**2).scalar(), hax.mean(out, axis="batch")

    (_, aux), _ = fp8jax.accumulate_gradients(loss, microbatches, has_aux=True)(model, x)
    rows = Rows.size // microbatches
    want = [
        loss(model, hax.named(x.array[i * rows : (i + 1) * rows], (Rows.resize(rows), Embed)))[1]
        for i in range(microbatches)
    ]
    assert aux.axes == (hax.Axis("microbatch", microbatches), Mlp)
    assert aux.array.shape == (microbatches, Mlp.size)
    for i, w in enumerate(want):
        np.testing.assert_allclose(aux["microbatch", i].array, w.array, rtol=1e-6)
    if microbatches > 1:
        step = fp8jax.make_train_step(loss, optax.sgd(0.0), has_aux=True, microbatches=2)
        _, metrics = step(step.init(model), x)
        assert metrics.aux.axes == aux.axes
        np.testing.assert_allclose(metrics.aux.array, aux.array, rtol=1e-6)


Experts, Token = hax.Axis("experts", 4), hax.Axis("token", 32)
SIZES = jnp.array([8, 0, 16, 8], jnp.int32)


class HMoE(eqx.Module):
    up: hnn.MoELinear
    down: hnn.MoELinear

    @staticmethod
    def init(*, key, out_first=False):
        k1, k2 = jax.random.split(key)
        return HMoE(
            hnn.MoELinear.init(Experts, Embed, Mlp, key=k1, out_first=out_first),
            hnn.MoELinear.init(Experts, Mlp, Embed, key=k2, use_bias=False),
        )

    def __call__(self, x, sizes):
        return self.down(hax.nn.relu(self.up(x, sizes)), sizes)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
@pytest.mark.parametrize("out_first", [False, True])
def test_haliax_moe_linear_matches_the_grouped_fp8_gemm_bit_for_bit(getkey, recipe, out_first):
    model = HMoE.init(key=getkey(), out_first=out_first)
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    assert isinstance(fp8.up, fp8jax.Fp8MoELinear) and fp8.up.ragged_dot.name == "up"
    x = hax.random.normal(getkey(), (Token, Embed)) * 3
    sizes = hax.named(SIZES, Experts)
    # The same layers as fp8jax's Equinox experts on the raw arrays.
    up_w = model.up.weight.rearrange((Experts, Embed, Mlp)).array
    down_w = model.down.weight.rearrange((Experts, Mlp, Embed)).array
    up = fp8jax.fp8_linear_layers(
        fp8jax.GroupedLinear(4, 8, 16, key=getkey()), fp8jax.Fp8Config(recipe=recipe, exclude=None)
    )
    down = fp8jax.fp8_linear_layers(
        fp8jax.GroupedLinear(4, 16, 8, key=getkey()), fp8jax.Fp8Config(recipe=recipe, exclude=None)
    )
    up, down = (eqx.tree_at(lambda g: g.weight, g, w) for g, w in ((up, up_w), (down, down_w)))

    def ours(m, x):
        return hax.sum(m(x, sizes) ** 2).scalar()

    def theirs(layers, x):
        h = jax.nn.relu(layers[0](x, SIZES) + model.up.bias.array)
        return jnp.sum(layers[1](h, SIZES) ** 2)

    loss, grads = eqx.filter_jit(fp8jax.filter_value_and_grad(ours))(fp8, x)
    loss_e, grads_e = eqx.filter_jit(fp8jax.filter_value_and_grad(theirs))((up, down), x.array)
    np.testing.assert_array_equal(loss, loss_e)
    np.testing.assert_array_equal(
        grads.up.weight.rearrange((Experts, Embed, Mlp)).array, grads_e[0].weight
    )
    for a, b in zip(
        jax.tree.leaves(grads.down.ragged_dot), jax.tree.leaves(grads_e[1].ragged_dot), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    again = fp8jax.fp8_linear_layers(fp8, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    assert again == fp8  # not twice


@pytest.mark.parametrize(
    "axes", [(Embed, Token), (hax.Axis("b", 4), Embed, hax.Axis("s", 8))], ids=str
)
def test_haliax_moe_linear_takes_several_batch_axes_and_in_anywhere(getkey, axes):
    """Fp8MoELinear takes inputs Haliax's MoELinear refuses (In not last, a second batch
    axis), undocumented. As its docstring and docs/moe.md now say: the axes other than In,
    flattened in their order, are the rows, and the output has them in that order, then Out;
    bit for bit fp8jax's Equinox experts on those rows."""
    model = hnn.MoELinear.init(Experts, Embed, Mlp, key=getkey())
    # Haliax starts the bias at zero, which hid it dropped or added twice: make it count.
    bias = hax.random.normal(getkey(), (Mlp,))
    model = eqx.tree_at(lambda m: m.bias, model, bias)
    assert np.all(np.abs(model.bias.array) > 0)
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(exclude=None))
    x = hax.random.normal(getkey(), axes) * 3
    sizes = hax.named(SIZES, Experts)
    with pytest.raises((TypeError, ValueError)):
        model(x, sizes)  # Haliax's own layer refuses these inputs
    others = tuple(a for a in axes if a != Embed)
    rows = x.rearrange((*others, Embed)).array.reshape(-1, Embed.size)
    experts = fp8jax.fp8_linear_layers(
        fp8jax.GroupedLinear(4, 8, 16, key=getkey()), fp8jax.Fp8Config(exclude=None)
    )
    experts = eqx.tree_at(lambda g: g.weight, experts, model.weight.array)
    want = experts(rows, SIZES) + model.bias.array
    got = fp8(x, sizes)
    assert got.axes == (*others, Mlp)
    np.testing.assert_array_equal(got.array.reshape(-1, Mlp.size), want)


def test_haliax_moe_linear_in_a_stacked_model_trains(getkey):
    class Block(eqx.Module):
        moe: HMoE

        @staticmethod
        def init(*, key):
            return Block(HMoE.init(key=key))

        def __call__(self, x):
            return x + self.moe(x, hax.named(SIZES, Experts))

    stack = hnn.Stacked.init(Layers, Block)(key=jax.random.split(getkey(), Layers.size))
    fp8 = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config(recipe="current", exclude=None))
    assert fp8.stacked.moe.up.ragged_dot.kernel.scale.shape == (3, 4)  # layers, experts
    assert sorted(fp8jax.telemetry(fp8)) == ["stacked.moe.down", "stacked.moe.up"]
    x = hax.random.normal(getkey(), (Token, Embed))
    step = fp8jax.make_train_step(
        lambda m, x: hax.mean((m.fold(x) - x * 0.5) ** 2).scalar(),
        __import__("optax").adam(1e-2),
    )
    state = step.init(fp8)
    losses = []
    for _ in range(4):
        state, metrics = step(state, x)
        losses.append(float(metrics.loss))
    assert losses[-1] < losses[0]


def test_haliax_moe_linear_built_under_vmap_gets_one_state_per_layer(getkey):
    """A MoELinear built under hax.vmap (a layer axis outside any Stacked) gets one FP8
    state per layer, as a Linear built so does, and trains under hax.vmap: each layer
    computes, and records, what that layer converted alone does (it got one unstacked state
    and crashed in the vmap)."""
    keys = jax.random.split(getkey(), Layers.size)
    moe = hax.vmap(hnn.MoELinear.init, Layers)(Experts, Embed, Mlp, key=keys)
    config = fp8jax.Fp8Config(exclude=None)
    fp8 = fp8jax.fp8_linear_layers(moe, config)
    assert fp8.ragged_dot.kernel.scale.shape == (Layers.size, Experts.size)
    sizes = hax.named(SIZES, Experts)
    x = hax.random.normal(getkey(), (Layers, Token, Embed))

    def loss(m, x):
        return hax.sum(hax.vmap(lambda layer, x: layer(x, sizes), Layers)(m, x) ** 2).scalar()

    got, grads = fp8jax.filter_value_and_grad(loss)(fp8, x)
    want = 0.0
    for i in range(Layers.size):
        one = fp8jax.fp8_linear_layers(hnn.MoELinear.init(Experts, Embed, Mlp, key=keys[i]), config)

        def loss_i(m, xi):
            return hax.sum(m(xi, sizes) ** 2).scalar()

        value, grads_i = fp8jax.filter_value_and_grad(loss_i)(one, x[Layers, i])
        want += value
        for a, b in zip(
            jax.tree.leaves(grads.ragged_dot), jax.tree.leaves(grads_i.ragged_dot), strict=True
        ):
            np.testing.assert_array_equal(a[i], b)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_haliax_moe_linear_delayed_state_follows_a_hand_rolled_history(getkey):
    """Four training steps of a converted MoELinear (delayed scaling, a history of 3, experts
    of ranges 0.1 to 10, some empty in a step): each expert's kernel history takes its
    weight's amax only in the steps it got tokens, the input's and output gradient's the amax
    over the groups' rows, and every scale is the power of two below fp8_max / max(history)
    (an expert that never got tokens keeps the warm start's 0), as in NumPy."""
    H, fmt_max = 3, {"kernel": 448.0, "input": 448.0, "output_grad": 57344.0}
    lin = hnn.MoELinear.init(Experts, Embed, Mlp, key=getkey(), out_first=True)
    lin = eqx.tree_at(
        lambda m: m.weight, lin, lin.weight * hax.named(jnp.array([1.0, 10.0, 0.1, 3.0]), Experts)
    )
    recipe = fp8jax.DelayedScaling(history_len=H)
    model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    hist = {"kernel": np.zeros((Experts.size, H)), "input": np.zeros(H), "output_grad": np.zeros(H)}

    def roll(h, amax):  # Transformer Engine's: roll by -1, the new amax at 0
        return np.concatenate([[amax], np.roll(h, -1)[1:]])

    @eqx.filter_jit
    def step(m, x, sizes, g):
        grads = fp8jax.filter_grad(lambda m: hax.sum(m(x, sizes) * g).scalar())(m)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        return fp8jax.apply_updates(m, jax.tree.map(lambda d: -0.5 * d, grads), overwrites)

    rng = np.random.default_rng(0)
    for t, sizes in enumerate([[8, 0, 16, 8], [0, 4, 4, 4], [6, 0, 0, 1], [2, 2, 2, 2]]):
        rows = sum(sizes)
        x = rng.standard_normal((Token.size, Embed.size)).astype(np.float32) * (t + 1)
        g = rng.standard_normal((Token.size, Mlp.size)).astype(np.float32) * 1e-3
        w = np.asarray(model.weight.rearrange((Experts, Embed, Mlp)).array)
        for e in np.flatnonzero(sizes):
            hist["kernel"][e] = roll(hist["kernel"][e], np.abs(w[e]).max())
        hist["input"] = roll(hist["input"], np.abs(x[:rows]).max())
        hist["output_grad"] = roll(hist["output_grad"], np.abs(g[:rows]).max())
        sizes = hax.named(np.array(sizes, np.int32), Experts)
        model = step(model, hax.named(x, (Token, Embed)), sizes, hax.named(g, (Token, Mlp)))
        for role, h in hist.items():
            state = getattr(model.ragged_dot, role)
            amax = h.max(-1)
            want = np.where(
                amax > 0, 2.0 ** np.floor(np.log2(fmt_max[role] / np.maximum(amax, 1e-30))), 0
            )
            np.testing.assert_allclose(state.amax_history, h, rtol=1e-7, err_msg=f"{t} {role}")
            np.testing.assert_array_equal(state.scale, want, err_msg=f"{t} {role}")


def test_haliax_moe_linear_records_telemetry_when_asked(getkey):
    """`Fp8Config(telemetry=True)` reaches a Haliax MoELinear's grouped GEMM as it does an
    Equinox GroupedLinear's: each expert's tokens, recorded by a step."""
    model = HMoE.init(key=getkey())
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(exclude=None, telemetry=True))
    assert isinstance(fp8.up.ragged_dot.stats, fp8jax.ExpertStats)
    x = hax.random.normal(getkey(), (Token, Embed))
    sizes = hax.named(SIZES, Experts)
    grads = fp8jax.filter_grad(lambda m: hax.sum(m(x, sizes) ** 2).scalar())(fp8)
    overwrites, rest = fp8jax.partition_for_grad_overwrite(grads)
    stepped = fp8jax.apply_updates(fp8, jax.tree.map(jnp.zeros_like, rest), overwrites)
    stats = fp8jax.telemetry(stepped)
    np.testing.assert_array_equal(stats["up"].tokens, SIZES)
    np.testing.assert_array_equal(stats["down"].tokens, SIZES)


@pytest.mark.parametrize("jit", [False, True])
def test_haliax_moe_linear_refuses_inputs_without_its_in_axis(getkey, jit):
    """Inputs whose `In` axis has another size, or that lack it, are refused naming the
    axis and the size the layer takes, as `MoELinear` refuses them (the rows were reshaped
    to the layer's `In` size: a reshape TypeError, or a ValueError blaming group_sizes)."""
    fp8 = fp8jax.fp8_linear_layers(HMoE.init(key=getkey()), fp8jax.Fp8Config(exclude=None)).up
    sizes = hax.named(jnp.array([1, 1, 1, 1], jnp.int32), Experts)
    call = eqx.filter_jit(lambda m, x, s: m(x, s)) if jit else (lambda m, x, s: m(x, s))
    # A narrower In (4 tokens x 4) reshapes without an error into 2 rows cut at width 8.
    for size in (Embed.size + 4, Embed.size // 2):
        wrong = hax.random.normal(getkey(), (hax.Axis("token", 4), Embed.resize(size)))
        with pytest.raises(ValueError, match=rf"'up'.*embed of size {size}.*embed\({Embed.size}\)"):
            call(fp8, wrong, sizes)
    missing = hax.random.normal(getkey(), (hax.Axis("token", 4), Mlp))
    with pytest.raises(ValueError, match=rf"'up'.*no axis embed.*embed\({Embed.size}\)"):
        call(fp8, missing, sizes)


def test_haliax_moe_linear_refuses_arrays_that_are_not_named(getkey):
    """Plain arrays for the inputs or the group sizes (which `Fp8RaggedDot` and
    `GroupedLinear` take), and group sizes without the experts axis, are refused naming what
    the layer takes, its axes by name and size (they raised AttributeError: no attribute
    'rearrange')."""
    fp8 = fp8jax.fp8_linear_layers(HMoE.init(key=getkey()), fp8jax.Fp8Config(exclude=None)).up
    x = hax.random.normal(getkey(), (Token, Embed))
    sizes = hax.named(SIZES, Experts)
    with pytest.raises(
        TypeError,
        match=rf"'up'.*inputs.*Array.*NamedArray with the In axis {Embed.name}\({Embed.size}\),",
    ):
        fp8(x.array, sizes)
    with pytest.raises(TypeError, match=r"'up'.*group_sizes.*Array.*NamedArray over experts\(4\)"):
        fp8(x, SIZES)
    with pytest.raises(ValueError, match=r"'up'.*group_sizes.*no axis experts.*experts\(4\)"):
        fp8(x, hax.named(SIZES, "other"))


@pytest.mark.parametrize("out_first", [False, True])
def test_haliax_moe_linear_keeps_out_first(getkey, out_first):
    """`MoELinear.out_first` (the weight's layout, read by code exporting the weights) is the
    converted layer's too, also for a stack built under `hax.vmap` (it raised
    AttributeError: 'Fp8MoELinear' object has no attribute 'out_first')."""
    keys = jax.random.split(getkey(), Layers.size)
    stack = hax.vmap(hnn.MoELinear.init, Layers)(Experts, Embed, Mlp, key=keys, out_first=out_first)
    one = hnn.MoELinear.init(Experts, Embed, Mlp, key=getkey(), out_first=out_first)
    for layer in (one, stack):
        fp8 = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(exclude=None))
        assert isinstance(fp8, fp8jax.Fp8MoELinear)
        assert fp8.out_first is layer.out_first is out_first


def test_haliax_moe_linear_refuses_an_expert_exchange_naming_what_takes_one(getkey):
    """An `expert_exchange` plan in place of the group sizes (as a `GroupedLinear` takes
    one) is refused naming the layers that take it and how a Haliax model splits its
    experts (it said only "group_sizes is a ExpertExchange; should be a haliax NamedArray")."""
    from jax.sharding import PartitionSpec as P

    fp8 = fp8jax.fp8_linear_layers(HMoE.init(key=getkey()), fp8jax.Fp8Config(exclude=None)).up
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("expert",), axis_types=auto, devices=jax.devices()[:2])

    def local(x, chosen):
        plan = fp8jax.expert_exchange(chosen, Experts.size, "expert")
        return fp8(hax.named(x, (Token.resize(x.shape[0]), Embed)), plan).array

    f = jax.shard_map(local, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    x = np.ones((4, Embed.size), np.float32)
    with pytest.raises(
        TypeError,
        match=r"'up': group_sizes is an fp8jax.ExpertExchange.*GroupedLinear.*"
        r"\{'experts': 'expert'\}.*NamedArray over experts\(4\)",
    ):
        jax.eval_shape(f, x, np.zeros((4, 1), np.int32))


def test_expert_specs_refuses_a_haliax_moe_linear_by_name(getkey):
    """`expert_specs` splits fp8jax's GroupedLinear experts; a Haliax MoELinear's would be
    left replicated without a word, so it is refused, naming its experts axis."""
    fp8 = fp8jax.fp8_linear_layers(HMoE.init(key=getkey()), fp8jax.Fp8Config(exclude=None))
    with pytest.raises(TypeError, match=r"Haliax MoELinear in FP8 .*named axis 'experts'"):
        fp8jax.expert_specs(fp8, "expert")


@pytest.mark.parametrize("out_first", [True, False])
def test_haliax_linear_with_dict_axis_specs_converts(getkey, out_first):
    """A Linear whose In and Out are Haliax shape dicts (`{"heads": 2, "hd": 4}`, an axis
    spec `Linear.init` takes) converts, and computes the FP8 GEMM of its flattened matrix:
    output and weight gradient are the float64 products of the E4M3 / E5M2 roundings (it
    raised AttributeError: 'dict' object has no attribute 'size')."""
    from reference import per_tensor_current

    In, Out = {"heads": 2, "hd": 4}, {"embed": 6, "part": 2}
    lin = hnn.Linear.init(In, Out, key=getkey(), out_first=out_first)
    fp8 = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(recipe="current", exclude=None))
    assert isinstance(fp8.dot_general, fp8jax.Fp8DotGeneral)
    ins, outs = (
        tuple(hax.Axis(n, s) for n, s in In.items()),
        tuple(hax.Axis(n, s) for n, s in Out.items()),
    )
    x = hax.random.normal(getkey(), (Batch, *ins)) * 3
    g = hax.random.normal(getkey(), (Batch, *outs))

    def loss(m, x):
        return hax.sum(m(x) * g).scalar()

    _, grads = fp8jax.filter_value_and_grad(loss)(fp8, x)
    x2 = np.asarray(x.rearrange((Batch, *ins)).array).reshape(Batch.size, 8)
    w2 = np.asarray(lin.weight.rearrange((*outs, *ins)).array).reshape(12, 8)
    g2 = np.asarray(g.rearrange((Batch, *outs)).array).reshape(Batch.size, 12)
    y, _, dw = per_tensor_current(x2, w2, g2)
    bias = np.asarray(lin.bias.rearrange(outs).array).reshape(12)
    got = np.asarray(fp8(x).rearrange((Batch, *outs)).array).reshape(Batch.size, 12)
    np.testing.assert_allclose(got, y + bias, rtol=1e-6, atol=1e-6)
    got_dw = np.asarray(grads.weight.rearrange((*outs, *ins)).array).reshape(12, 8)
    np.testing.assert_allclose(got_dw, dw, rtol=1e-6, atol=1e-6)


def _haliax_own_fp8_block(getkey, steps):
    """An HBlock quantized to FP8 by `haliax.quantization` itself (history length 4), after
    `steps` of Haliax's own updates (output gradients of growing size; weights kept)."""
    from haliax import quantization

    config = quantization.QuantizationConfig(fp8=True, amax_history_length=4)
    block = quantization.quantize_linear_layers(HBlock.init(key=getkey()), config)
    x = hax.random.normal(getkey(), (Batch, Embed))

    @eqx.filter_jit
    def step(m, size):
        def loss(m):
            return size * hax.sum(m(x) ** 2).scalar()

        overwrites, grads = quantization.partition_for_grad_overwrite(eqx.filter_grad(loss)(m))
        return quantization.apply_updates(m, jax.tree.map(jnp.zeros_like, grads), overwrites)

    for size in [1.0, 3.0, 0.5][:steps]:
        block = step(block, size)
    return block, step


def _haliax_scale(history, fp8_max):
    """Haliax's next scale (`haliax._src.fp8.compute_scale`, margin 0), re-derived in
    NumPy float32: it divides by `1 / (fp8_max / max(history))`; `None` where it keeps the
    old one (a max that is 0 or not finite)."""
    most = np.max(np.asarray(history, np.float32), axis=-1)
    if not (most > 0 and np.isfinite(most)):
        return None
    return np.float32(1) / (np.float32(fp8_max) / most)


@pytest.mark.parametrize("ratio", [0.5, 3.0])
def test_haliax_own_fp8_layers_gradient_states_follow_the_loss_scale(getkey, ratio):
    """`rescale_gradient_states` of layers Haliax quantized itself: the output-gradient amax
    history times `ratio` (float32 products) and the scale Haliax's next step computes from
    it (its formula in NumPy; Haliax's own next step agrees, bit for bit); inputs' and
    kernels' state as they were. It left them alone: after a growth, the next step's largest
    gradients saturated E5M2."""
    model, step = _haliax_own_fp8_block(getkey, steps=3)
    new = fp8jax.rescale_gradient_states(model, ratio)
    for name in ("up", "down"):
        old, op = getattr(model, name).dot_general, getattr(new, name).dot_general
        history = np.asarray(old.output_grad_amax_history)
        assert (history > 0).sum() == 3  # three recorded, one slot still empty
        want = np.float32(history.astype(np.float64) * ratio)
        np.testing.assert_array_equal(np.asarray(op.output_grad_amax_history), want)
        scale = _haliax_scale(want, 57344.0)
        assert np.asarray(op.output_grad_scale).tobytes() == np.float32([scale]).tobytes()
        assert float(scale) == pytest.approx(float(want.max()) / 57344.0, rel=2**-22)
        for field in ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history"):
            assert np.array_equal(getattr(op, field), getattr(old, field)), (name, field)
        # Haliax's next step stores the scale it used, computed from the rescaled history.
        after = getattr(step(new, 1e-3), name).dot_general
        assert np.array_equal(after.output_grad_scale, op.output_grad_scale), name
    # A ratio of 1, and states nothing was recorded in, are left bit for bit.
    bits = lambda t: [np.asarray(a).tobytes() for a in jax.tree.leaves(t)]  # noqa: E731
    assert bits(fp8jax.rescale_gradient_states(model, 1.0)) == bits(model)
    fresh, _ = _haliax_own_fp8_block(getkey, steps=0)
    assert bits(fp8jax.rescale_gradient_states(fresh, 4.0)) == bits(fresh)


def test_make_train_step_rescales_haliax_own_fp8_layers(getkey):
    """`make_train_step` with a `DynamicLossScale` that doubles every step, on a Linear Haliax
    quantized itself: after each step every recorded output-gradient amax is the known output
    gradient's (`c`) times the new loss scale (float32 from `c`), and the scale Haliax's next
    step takes is computed from it (not from amaxes one, two or three loss scales old)."""
    from haliax import quantization

    config = quantization.QuantizationConfig(fp8=True, amax_history_length=4)
    model = quantization.quantize_linear_layers(hnn.Linear.init(Embed, Mlp, key=getkey()), config)
    x = hax.random.normal(getkey(), (Batch, Embed))
    c = hax.random.normal(getkey(), (Batch, Mlp))

    def loss(m, x):
        return hax.sum(m(x) * c).scalar()  # the output gradient: c (times the loss scale)

    scale = fp8jax.DynamicLossScale(2.0**4, period=1)
    step = fp8jax.make_train_step(loss, optax.sgd(0.0), loss_scale=scale, compiler_options={})
    state = step.init(model)
    amax = np.max(np.abs(np.asarray(c.array, np.float32)))
    for i in range(1, 4):
        state, metrics = step(state, x)
        assert bool(metrics.grads_finite)
        loss_scale = np.float32(2.0 ** (4 + i))
        assert float(state.loss_scale.loss_scale) == loss_scale
        op = state.model.dot_general
        history = np.asarray(op.output_grad_amax_history)
        np.testing.assert_array_equal(history[history > 0], [amax * loss_scale] * i)
        want = _haliax_scale(history, 57344.0)
        assert np.asarray(op.output_grad_scale).tobytes() == np.float32([want]).tobytes()


def test_haliax_own_stacked_fp8_layers_rescale_layer_by_layer(getkey):
    """A Stacked block quantized by `haliax.quantization` holds one state per layer
    (`output_grad_amax_history (layers, 4)`, `output_grad_scale (layers, 1)`): each layer's
    scale comes from its own history's max (Haliax's formula in NumPy, and Haliax's next
    step agrees), not from the whole stack's."""
    from haliax import quantization

    config = quantization.QuantizationConfig(fp8=True, amax_history_length=4)
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    model = quantization.quantize_linear_layers(stack, config)
    x = hax.random.normal(getkey(), (Batch, Embed))

    @eqx.filter_jit
    def step(m, size):
        def loss(m):
            return size * hax.sum(m.fold(x) ** 2).scalar()

        overwrites, grads = quantization.partition_for_grad_overwrite(eqx.filter_grad(loss)(m))
        return quantization.apply_updates(m, jax.tree.map(jnp.zeros_like, grads), overwrites)

    for size in (1.0, 2.0):
        model = step(model, size)
    new = fp8jax.rescale_gradient_states(model, 3.0)
    after = step(new, 1e-3)
    for name in ("up", "down"):
        old, op = getattr(model.stacked, name).dot_general, getattr(new.stacked, name).dot_general
        history = np.asarray(op.output_grad_amax_history)
        assert history.shape == (Layers.size, 4)
        want = np.float32(np.asarray(old.output_grad_amax_history, np.float64) * 3.0)
        np.testing.assert_array_equal(history, want)
        scales = np.float32([[_haliax_scale(h, 57344.0)] for h in want])
        assert len(set(scales.ravel().tolist())) == Layers.size  # one per layer
        assert np.asarray(op.output_grad_scale).tobytes() == scales.tobytes()
        next_scale = getattr(after.stacked, name).dot_general.output_grad_scale
        assert np.array_equal(next_scale, op.output_grad_scale), name


def test_haliax_stacked_train_step_state_follows_a_hand_rolled_history(getkey):
    """make_train_step on a converted Stacked model: each layer's kernel and input states,
    step by step, are Transformer Engine's history update (newest amax at index 0, the rest
    rolled) of that layer's own amaxes, and its next scale `448 / max(history)` rounded down
    to a power of two, computed here in float64 from the weights each step saw."""
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    model = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config(exclude=None))
    x = hax.random.normal(getkey(), (Batch, Embed)) * 3

    def loss(m, x):
        return hax.sum(m.fold(x) ** 2).scalar()

    step = fp8jax.make_train_step(loss, optax.sgd(1e-3))
    state = step.init(model)
    n = model.stacked.up.dot_general.kernel.amax_history.shape[-1]
    hist = {k: np.zeros((Layers.size, n)) for k in ("kernel", "input")}
    for _ in range(3):
        w = np.asarray(state.model.stacked.up.weight.array, np.float64)
        amax = {"kernel": np.abs(w).max(axis=(1, 2))}
        h, inputs = x, []
        for i in range(Layers.size):
            inputs.append(np.abs(np.asarray(h.array, np.float64)).max())
            h = state.model.get_layer(i)(h)
        amax["input"] = np.asarray(inputs)
        state, _ = step(state, x)
        dot = state.model.stacked.up.dot_general
        for k, got in (("kernel", dot.kernel), ("input", dot.input)):
            hist[k] = np.concatenate([amax[k][:, None], hist[k][:, 2:], hist[k][:, :1]], axis=1)
            np.testing.assert_array_equal(got.amax_history, hist[k].astype(np.float32))
            largest = hist[k].astype(np.float32).astype(np.float64).max(axis=1)
            np.testing.assert_array_equal(got.scale, 2.0 ** np.floor(np.log2(448.0 / largest)))
    assert len(set(np.asarray(dot.kernel.scale).tolist() + [0.0])) > 1


def test_haliax_policy_casts_the_weight_the_fp8_gemm_quantizes(getkey):
    """A Haliax Linear has no compute dtype: Policy.cast_to_compute casts its weight to BF16
    (not a master kept for the FP8 GEMM, as for fp8jax.Linear), its FP8 state stays float32,
    and its GEMM quantizes that copy; uncast, a float32 weight promotes a BF16 input to a
    float32 output, its GEMM quantizing the master itself."""
    fp8 = fp8jax.fp8_linear_layers(hnn.Linear.init(Embed, Mlp, key=getkey()))
    x = (hax.random.normal(getkey(), (Batch, Embed)) * 3).astype(jnp.bfloat16)
    cast = fp8jax.Policy.from_string("compute=bfloat16").cast_to_compute(fp8)
    assert cast.weight.dtype == jnp.bfloat16 and cast.dot_general.kernel.scale.dtype == jnp.float32

    def rounded(a):
        return a.astype(jnp.bfloat16).astype(jnp.float32)

    copy = eqx.tree_at(lambda m: (m.weight, m.bias), fp8, (rounded(fp8.weight), rounded(fp8.bias)))
    got = cast(x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.array, copy(x.astype(jnp.float32)).array.astype(jnp.bfloat16))
    master = fp8(x)
    assert master.dtype == jnp.float32
    np.testing.assert_array_equal(master.array, fp8(x.astype(jnp.float32)).array)


@pytest.mark.parametrize("take", ["get_layer", "unstacked"])
def test_haliax_stacked_layer_taken_out_in_a_gradient_is_refused_by_name(getkey, take):
    """Stacked.get_layer(i) and unstacked() slice the FP8 state statically, which
    fp8jax.filter_value_and_grad cannot differentiate (README, Known limits): refused with a
    TypeError naming Stacked.fold/scan, the ways that work, which give one state per layer."""
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    model = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config(exclude=None))
    x = hax.random.normal(getkey(), (Batch, Embed))

    def loss(m):
        layer = m.get_layer(1) if take == "get_layer" else m.unstacked()[1]
        return hax.sum(layer(x) ** 2).scalar()

    with pytest.raises(TypeError, match=r"static slice .* Stacked\.fold/scan"):
        fp8jax.filter_value_and_grad(loss)(model)

    def traced(m):  # a traced index (README's way) takes the same layer dynamically
        return hax.sum(m.get_layer(jnp.int32(1))(x) ** 2).scalar()

    grads = fp8jax.filter_grad(traced)(model)
    want = [0.0, float(jnp.max(jnp.abs(x.array))), 0.0]
    np.testing.assert_array_equal(grads.stacked.up.dot_general.input.amax_history[:, 0], want)


def test_haliax_stacked_is_one_layer_to_patterns_and_a_blockseq_is_one_per_layer(getkey):
    """docs/conversion.md: a Stacked's Linears have one path for all their layers, which a
    per-layer pattern cannot reach (refused, naming that path); the same blocks as a
    BlockSeq are reached layer by layer, each FP8 layer with the recipe its pattern gives."""
    keys = jax.random.split(getkey(), Layers.size)
    config = fp8jax.Fp8Config(recipes={r"blocks\.1\..*": "current"}, exclude=None)
    stack = hnn.Stacked.init(Layers, HBlock)(key=keys)
    with pytest.raises(ValueError, match=r"matches no converted layer.*'stacked\.up'"):
        fp8jax.fp8_linear_layers(stack, config)
    seq = fp8jax.fp8_linear_layers(hnn.BlockSeq.init(Layers, HBlock)(key=keys), config)
    recipes = [type(b.up.dot_general.recipe).__name__ for b in seq.blocks]
    assert recipes == ["DelayedScaling", "CurrentScaling", "DelayedScaling"]
    x = hax.random.normal(getkey(), (Batch, Embed))
    h = x
    for block in stack.unstacked():
        h = block(h)
    plain = hnn.BlockSeq.init(Layers, HBlock)(key=keys).fold(x)
    np.testing.assert_allclose(plain.array, h.array, rtol=1e-6)


def test_haliax_vmap_of_a_converted_layer_runs_closed_over_not_as_an_argument(getkey):
    """README, Known limits: hax.vmap maps the FP8 state of a model passed as an argument
    along axis 0, which a single layer's scalars cannot take; closed over, the layer runs
    per example and records the whole batch's amax, as the unmapped call does."""
    plain = hnn.Linear.init(Embed, Mlp, key=getkey())
    model = fp8jax.fp8_linear_layers(plain)
    x = hax.random.normal(getkey(), (Batch, Embed)) * (1 + hax.arange(Batch)).broadcast_axis(Embed)
    assert hax.vmap(lambda m, x: m(x), Batch)(plain, x).axes == (Batch, Mlp)
    with pytest.raises(ValueError, match="rank should be at least 1"):
        hax.vmap(lambda m, x: m(x), Batch)(model, x)

    def loss(m):
        return hax.sum(hax.vmap(lambda x: m(x), Batch)(x) ** 2).scalar()

    got = fp8jax.filter_grad(loss)(model)
    want = float(np.abs(np.asarray(x.array, np.float64)).max())
    assert float(got.dot_general.input.amax_history[0]) == want
    np.testing.assert_array_equal(hax.vmap(lambda x: model(x), Batch)(x).array, model(x).array)


def test_a_named_array_without_the_batch_axis_goes_whole_to_every_microbatch(getkey):
    """A NamedArray without the batch's axis (a mask over the features, shared by every
    example) beside a NamedArray batch was cut along its own first axis. It goes whole, as
    a scalar does: the loss and gradients of the loss closing over it."""
    model = fp8jax.fp8_linear_layers(hnn.Linear.init(Embed, Mlp, key=getkey()))
    x = hax.random.normal(getkey(), (hax.Axis("batch", 8), Embed))
    mask = hax.random.uniform(getkey(), (Mlp,))

    def loss(m, x, mask):
        return hax.mean((m(x) * mask) ** 2).scalar()

    got, grads = fp8jax.accumulate_gradients(loss, 2)(model, x, mask)
    closed = lambda m, x: loss(m, x, mask)  # noqa: E731
    want, grads_c = fp8jax.accumulate_gradients(closed, 2)(model, x)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_array_equal(a, b)


def test_named_microbatches_match_the_whole_batch_step(getkey):
    """The un-microbatched step is the reference: a shared mask without the batch axis goes
    whole, and targets holding the batch axis second, `(mlp, batch)`, are cut along it."""
    model = hnn.Linear.init(Embed, Mlp, key=getkey())  # high precision: equal up to rounding
    Rows = hax.Axis("batch", 8)
    x = hax.random.normal(getkey(), (Rows, Embed))
    targets = hax.random.normal(getkey(), (Mlp, Rows))
    mask = hax.random.uniform(getkey(), (Mlp,))

    def loss(m, x, mask, targets):
        return hax.mean(((m(x) - targets) * mask) ** 2).scalar()

    got, grads = fp8jax.accumulate_gradients(loss, 2)(model, x, mask, targets)
    want, grads_w = eqx.filter_value_and_grad(loss)(model, x, mask, targets)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_batch_axis_is_the_one_most_named_arrays_hold_not_the_first_arrays(getkey):
    """A mask over the features passed first: the batch axis is still the one most of the
    NamedArrays hold (batch: x, targets, weights; mlp: mask, targets), not the first
    array's first axis (which cut the mask and gave every microbatch all of x)."""
    model = hnn.Linear.init(Embed, Mlp, key=getkey())  # high precision: equal up to rounding
    Rows = hax.Axis("batch", 8)
    mask = hax.random.uniform(getkey(), (Mlp,))
    x = hax.random.normal(getkey(), (Rows, Embed))
    targets = hax.random.normal(getkey(), (Rows, Mlp))
    weights = hax.random.uniform(getkey(), (Rows,))

    def loss(m, mask, x, targets, weights):
        return hax.mean(weights * hax.sum(((m(x) - targets) * mask) ** 2, Mlp)).scalar()

    got, grads = fp8jax.accumulate_gradients(loss, 2)(model, mask, x, targets, weights)
    want, grads_w = eqx.filter_value_and_grad(loss)(model, mask, x, targets, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_w), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(targets="0.up"), "0.up"),
        (dict(targets=r"\d+\.up"), r"\d+\.up"),
        (dict(targets=["1.up", "down"]), "1.up"),
        (dict(recipes={"2.up": "current"}), "2.up"),
    ],
    ids=["targets-regex", "targets-any-index", "targets-list", "recipes"],
)
def test_an_index_pattern_on_a_stacked_says_why_it_selects_nothing(kwargs, pattern, getkey):
    """A pattern naming one layer of a Haliax Stacked by index was refused as matching no
    layer, without why: a Stacked's layers are one layer (`stacked.up`), selected whole. The
    error says so and what to use, which selects it."""
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    with pytest.raises(ValueError) as info:
        fp8jax.conversion_plan(stack, fp8jax.Fp8Config(**kwargs))
    message = str(info.value)
    assert f"{pattern!r} names layers of a haliax Stacked by index" in message, message
    assert "one layer, 'stacked.up'" in message and "use 'stacked.up'" in message, message
    plan = fp8jax.conversion_plan(stack, fp8jax.Fp8Config(targets="stacked.up"))
    assert plan.converted == ("stacked.up",)


def test_an_index_exclude_on_a_stacked_says_why_it_keeps_nothing(getkey):
    """An exclude naming one layer of a Stacked by index keeps nothing (warned, listed in
    the plan's `unmatched`), which now says why: the Stacked's layers are one layer."""
    stack = hnn.Stacked.init(Layers, HBlock)(key=jax.random.split(getkey(), Layers.size))
    plan = fp8jax.conversion_plan(stack, fp8jax.Fp8Config(exclude="1.up"))
    (unmatched,) = plan.unmatched
    assert "'1.up' names layers of a haliax Stacked by index" in unmatched, unmatched
    assert "use 'stacked.up'" in unmatched


def test_the_stacked_hint_is_for_a_haliax_stacked_only_and_every_layer_of_it(getkey):
    """The hint that an index pattern names a Stacked's layers looked for a path name
    `stacked`: an Equinox field so named (no Stacked) got it, and a Stacked of 1200 layers
    did not for an index past 1023. It goes by the node: the Stacked's own layer count."""

    class Plain(eqx.Module):
        stacked: list

    plain = Plain([eqx.nn.Linear(2, 2, key=getkey())])
    with pytest.raises(ValueError) as info:
        fp8jax.conversion_plan(plain, fp8jax.Fp8Config(targets="0.0"))
    assert "matches no Linear layer" in str(info.value)
    assert "haliax Stacked" not in str(info.value), info.value
    Many, In, Out = hax.Axis("layers", 1200), hax.Axis("in", 2), hax.Axis("out", 2)
    stack = hnn.Stacked.init(Many, hnn.Linear)(In, Out, key=jax.random.split(getkey(), 1200))
    with pytest.raises(ValueError, match=r"'1100' names layers of a haliax Stacked by index"):
        fp8jax.conversion_plan(stack, fp8jax.Fp8Config(targets="1100"))

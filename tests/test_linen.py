"""Flax Linen: models nobody may edit converted by interception. Numerics against the Equinox
path (every recipe) and against Flax's own Fp8DirectDotGeneralOp, selection by module path,
`nn.scan` and shared modules, the train state, a transformer from a package fp8jax did not
write (recurrentgemma's Griffin) trained unedited, telemetry, checkpoints, the H100 compile."""

import functools
import importlib.util
import pathlib
import re
import warnings
from typing import Any

import equinox as eqx
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import fp8_ops
from flax.training import train_state
from helpers import RECIPES, h100_topology

import fp8jax

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT


def config(recipe: Any = None, **kwargs: Any) -> fp8jax.Fp8Config:
    return fp8jax.Fp8Config(recipe=recipe, exclude=None, keep=(), **kwargs)


class Net(nn.Module):
    """Layers built inside `__call__`, as most Linen code does: nothing to swap beforehand."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="fc1")(x))
        return nn.DenseGeneral(64, name="fc2")(h)


class EqxNet(eqx.Module):
    fc1: Any
    fc2: Any

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def eqx_net(params: dict) -> EqxNet:
    """The same layers in Equinox: Linen's kernel is (in, out), Equinox's weight (out, in)."""

    def linear(p):
        layer = eqx.nn.Linear(*p["kernel"].shape, key=jax.random.key(0))
        return eqx.tree_at(lambda m: (m.weight, m.bias), layer, (p["kernel"].T, p["bias"]))

    return EqxNet(linear(params["fc1"]), linear(params["fc2"]))


def state_of(variables: dict, *path: str) -> fp8jax.Fp8DotGeneral:
    node = variables[OWG]
    for name in path:
        node = node[name]
    return node["fp8jax"]


def assert_same(a: Any, b: Any, *, names: bool = True) -> None:
    if names:
        assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# --- numerics: the Equinox path, bit for bit ----------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_matches_the_equinox_path_bit_for_bit(name):
    x0 = jnp.zeros((2, 16, 64))
    ours = fp8jax.fp8_linear_layers(Net(), config(RECIPES[name]))
    assert isinstance(ours, fp8jax.Fp8Linen)
    variables = ours.init(jax.random.key(0), x0)
    # The parameters are the unconverted model's, at the same paths.
    assert_same(variables["params"], Net().init(jax.random.key(0), x0)["params"])
    theirs = fp8jax.fp8_linear_layers(eqx_net(variables["params"]), config(RECIPES[name]))

    @jax.jit
    def linen_step(variables, x, c):
        return jax.value_and_grad(lambda v, x: jnp.sum(ours.apply(v, x) * c), (0, 1))(
            variables, x
        ) + (ours.apply(variables, x),)

    @eqx.filter_jit
    def eqx_step(model, x, c):
        grads, grad_x = eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1]) * c))((model, x))
        return model(x), grads, grad_x

    rng = np.random.default_rng(0)
    for step in range(2):  # the second step runs with the state the first one produced
        x = jnp.asarray(rng.standard_normal((2, 16, 64)) * (1 + 4 * step), jnp.float32)
        c = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
        _, (grads, grad_x), out = linen_step(variables, x, c)
        out_e, grads_e, grad_x_e = eqx_step(theirs, x, c)
        np.testing.assert_array_equal(out, out_e)
        np.testing.assert_array_equal(grad_x, grad_x_e)
        for layer in ("fc1", "fc2"):
            ours_grads, theirs_grads = grads["params"][layer], getattr(grads_e, layer)
            np.testing.assert_array_equal(ours_grads["kernel"], theirs_grads.weight.T)
            np.testing.assert_array_equal(ours_grads["bias"], theirs_grads.bias)
        variables = {
            "params": variables["params"],
            OWG: fp8jax.apply_updates(variables[OWG], None, grads[OWG]),
        }
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads_e)
        theirs = fp8jax.apply_updates(theirs, None, overwrites)
        for layer in ("fc1", "fc2"):
            assert_same(state_of(variables, layer), getattr(theirs, layer).dot_general)


class Bf16Net(nn.Module):
    """`Net` computing in BF16 on float32 parameters (Linen's `dtype`)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, dtype=jnp.bfloat16, name="fc1")(x))
        return nn.DenseGeneral(64, dtype=jnp.bfloat16, name="fc2")(h)


def test_bf16_layers_quantize_their_float32_masters_as_the_policy_does():
    """Dense layers with a BF16 `dtype` hand their FP8 GEMMs the float32 kernels uncast: bit
    for bit the Equinox path under `fp8jax.Policy`, which leaves FP8 Linears' masters for
    their GEMMs to quantize (value, every gradient, the new state)."""
    x0 = jnp.zeros((2, 16, 64))
    ours = fp8jax.fp8_linear_layers(Bf16Net(), config())
    variables = ours.init(jax.random.key(0), x0)
    theirs = fp8jax.fp8_linear_layers(eqx_net(variables["params"]), config())
    policy = fp8jax.Policy.from_string("params=float32,compute=bfloat16")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)

    def linen_loss(v, x):
        return jnp.sum(ours.apply(v, x).astype(jnp.float32) * c)

    def eqx_loss(mx):
        model, x = policy.cast_to_compute(mx[0]), mx[1].astype(jnp.bfloat16)
        return jnp.sum(model(x).astype(jnp.float32) * c)

    out = ours.apply(variables, x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, policy.cast_to_compute(theirs)(x.astype(jnp.bfloat16)))
    grads, grad_x = jax.jit(jax.grad(linen_loss, (0, 1)))(variables, x)
    grads_e, grad_x_e = eqx.filter_jit(fp8jax.filter_grad(eqx_loss))((theirs, x))
    np.testing.assert_array_equal(grad_x, grad_x_e)
    for layer in ("fc1", "fc2"):
        kernel = grads["params"][layer]["kernel"]
        assert kernel.dtype == jnp.float32
        np.testing.assert_array_equal(kernel, getattr(grads_e, layer).weight.T)
        np.testing.assert_array_equal(grads["params"][layer]["bias"], getattr(grads_e, layer).bias)
        overwrites, _ = fp8jax.partition_for_grad_overwrite(getattr(grads_e, layer))
        assert_same(state_of(grads, layer), overwrites.dot_general)


def promote_three(inputs, kernel, bias, dtype=None, inexact=True):
    """A `promote_dtype` of the signature Linen documents (inputs, kernel, bias, dtype)."""
    return flax.linen.dtypes.promote_dtype(inputs, kernel, bias, dtype=dtype, inexact=inexact)


class Bf16OwnPromote(nn.Module):
    promote: Any = promote_three

    @nn.compact
    def __call__(self, x):
        fc1 = nn.Dense(32, dtype=jnp.bfloat16, promote_dtype=self.promote, name="fc1")
        fc2 = nn.DenseGeneral(64, dtype=jnp.bfloat16, promote_dtype=self.promote, name="fc2")
        return fc2(nn.relu(fc1(x)))


def test_bf16_layers_with_a_promote_dtype_of_their_own_convert():
    """A Dense with a narrower `dtype` and a `promote_dtype` taking (inputs, kernel, bias), as
    Linen documents, was called without its kernel (TypeError: missing 'bias'). It now
    computes as with Linen's own `promote_dtype`: value, gradients and new state."""
    x = jax.random.normal(jax.random.key(0), (2, 16, 64))
    model = fp8jax.fp8_linear_layers(Bf16OwnPromote(), config())
    plain = fp8jax.fp8_linear_layers(Bf16OwnPromote(flax.linen.dtypes.promote_dtype), config())
    variables = model.init(jax.random.key(1), x)

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x).astype(jnp.float32)))

    got, want = loss(model)(variables), loss(plain)(variables)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class Projection(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Einsum((64, 2, 16), "btd,dhk->bthk", name="proj")(x)


@pytest.mark.parametrize("name", ["delayed", "blockwise", "residual error feedback"])
def test_einsum_matches_the_equivalent_linear_bit_for_bit(name):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 64)), jnp.float32)
    ours = fp8jax.fp8_linear_layers(Projection(), config(RECIPES[name]))
    variables = ours.init(jax.random.key(0), x)
    kernel, bias = variables["params"]["proj"]["kernel"], variables["params"]["proj"]["bias"]
    linear = eqx.nn.Linear(64, 32, key=jax.random.key(0))
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias), linear, (kernel.reshape(64, 32).T, bias.reshape(32))
    )
    theirs = fp8jax.fp8_linear_layers(linear, config(RECIPES[name]))
    c = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 2, 16)), jnp.float32)
    out, grads = jax.jit(jax.value_and_grad(lambda v: jnp.sum(ours.apply(v, x) * c)))(variables)
    out_e, grads_e = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(jax.vmap(m))(x) * c.reshape(2, 8, 32)))
    )(theirs)
    np.testing.assert_array_equal(out, out_e)
    np.testing.assert_array_equal(
        grads["params"]["proj"]["kernel"].reshape(64, 32), grads_e.weight.T
    )
    new = fp8jax.apply_updates(state_of(variables, "proj"), None, state_of(grads, "proj"))
    assert_same(new, theirs.dot_general.merge(grads_e.dot_general), names=False)


# --- an independent reference: Flax Linen's Fp8DirectDotGeneralOp ---------------------------


class TwoEinsums(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Einsum((8, 8), "bd,de->be", use_bias=False, name="ok")(x)
        return nn.Einsum((8, 8), "bd,dd->bd", use_bias=False, name="diag")(x)


def test_einsum_with_an_equation_fp8_cannot_run_is_refused_by_the_layers_name():
    """An nn.Einsum whose equation the FP8 einsum refuses (a kernel axis named twice, which
    jnp.einsum takes) is refused naming the layer and how to keep it in high precision, as
    the NNX path names it (it raised the bare equation error, naming no layer)."""
    x = jnp.ones((3, 8))
    plain = TwoEinsums()
    plain.apply(plain.init(jax.random.key(0), x), x)  # jnp.einsum runs it
    model = fp8jax.fp8_linear_layers(plain, fp8jax.Fp8Config(exclude=None, keep=()))
    with pytest.raises(ValueError, match=r"nn.Einsum 'diag': .*repeats an axis.*Exclude it"):
        model.init(jax.random.key(0), x)
    kept = fp8jax.fp8_linear_layers(plain, fp8jax.Fp8Config(exclude="diag", keep=()))
    kept.init(jax.random.key(0), x)


class OneLayer(nn.Module):
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, use_bias=False, dot_general_cls=self.dot_general_cls, name="fc")(x)


def test_delayed_scaling_matches_flax_fp8_direct_dot_general():
    # The same Linen model twice: once with Flax's own FP8 op as its dot_general_cls, once
    # unedited and converted by fp8jax. Flax scales by fp8_max / amax without rounding to a
    # power of two and stores the reciprocal; it scales a fresh history by 1.0: fp8jax's warm
    # start is off. Amax histories agree exactly, outputs to float32 rounding.
    recipe = fp8jax.DelayedScaling(history_len=16, power_of_two=False, warm_start=False)
    flax_model = OneLayer(functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=16))
    ours = fp8jax.fp8_linear_layers(OneLayer(), config(recipe))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    flax_variables = flax_model.init(jax.random.key(0), x)
    variables = ours.init(jax.random.key(0), x)
    assert_same(variables["params"], flax_variables["params"])

    def step(model):
        @jax.jit
        def run(variables, x, c):
            def loss(v):
                out = model.apply(v, x)
                return jnp.sum(out * c), out

            (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables)
            return out, grads[OWG]

        return run

    flax_step, our_step = step(flax_model), step(ours)
    for i in range(4):
        x = jnp.asarray(rng.standard_normal((8, 32)) * 2.0**i, jnp.float32)
        c = jnp.asarray(rng.standard_normal((8, 16)) * 3.0**i, jnp.float32)
        out_flax, flax_state = flax_step(flax_variables, x, c)
        before = state_of(variables, "fc")  # holds the scales this step uses
        out, new_state = our_step(variables, x, c)
        np.testing.assert_allclose(out, out_flax, rtol=2e-6, atol=1e-6)
        flax_variables = {**flax_variables, OWG: flax_state}
        variables = {**variables, OWG: fp8jax.apply_updates(variables[OWG], None, new_state)}
        theirs, state = flax_state["fc"]["Fp8DirectDotGeneralOp_0"], state_of(variables, "fc")
        for role in ("input", "kernel", "output_grad"):
            np.testing.assert_array_equal(
                getattr(state, role).amax_history, theirs[f"{role}_amax_history"]
            )
            # Flax stores the reciprocal of the scale this step used, which fp8jax's state
            # held before the step (after it, it holds the next step's).
            np.testing.assert_allclose(
                getattr(before, role).scale, 1.0 / theirs[f"{role}_scale"][0], rtol=1e-6
            )
        if i:
            assert float(state.input.scale) != 1.0  # the histories are in use


# --- a transformer fp8jax did not write ----------------------------------------------------


def griffin():
    rg = pytest.importorskip("recurrentgemma.jax")
    from recurrentgemma import common

    config = common.GriffinConfig(
        vocab_size=64,
        width=32,
        mlp_expanded_width=64,
        num_heads=2,
        block_types=(common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=16,
        logits_soft_cap=30.0,
    )
    return rg.Griffin(config)  # nn.remat over its blocks, layers built in setup()


def test_recurrentgemma_griffin_trains_unedited():
    model = griffin()
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), (4, 16))
    fp8_model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe="delayed"))
    # recurrentgemma's own Einsum and BlockDiagonalLinear multiply by a parameter `w`, not a
    # kernel: the conversion says so, naming them (its embedder's decoding is the tied head).
    with pytest.warns(fp8jax.Fp8ConversionWarning) as warned:
        variables = fp8_model.init(jax.random.key(0), tokens, positions)
    (message,) = [str(w.message) for w in warned]
    for name in ("blocks.0.mlp_block.ffw_up (Einsum", "rg_lru.a_gate (BlockDiagonalLinear"):
        assert name in message
    assert "embedder" not in message
    plain = model.init(jax.random.key(0), tokens, positions)
    assert_same(variables["params"], plain["params"])  # its checkpoints load as they are

    def loss_fn(apply, variables):
        logits, _ = apply(variables, tokens, positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    # Every nn.Dense of the model (its embedder's decoding is an einsum, not a layer) is FP8.
    layers = [
        f"blocks.{i}.{name}"
        for i, names in (
            (
                0,
                [
                    "mlp_block.ffw_down",
                    "recurrent_block.linear_out",
                    "recurrent_block.linear_x",
                    "recurrent_block.linear_y",
                ],
            ),
            (
                1,
                [
                    "attention_block.proj_final",
                    "attention_block.proj_k",
                    "attention_block.proj_q",
                    "attention_block.proj_v",
                    "mlp_block.ffw_down",
                ],
            ),
        )
        for name in names
    ]
    assert list(fp8jax.telemetry(variables)) == layers
    # The first loss is the float32 model's, to FP8 rounding.
    first = float(loss_fn(fp8_model.apply, variables))
    reference = float(loss_fn(model.apply, plain))
    assert abs(first - reference) < 0.02 * reference

    state = fp8jax.LinenTrainState.create(
        apply_fn=fp8_model.apply, params=variables, tx=optax.adam(1e-2)
    )

    @jax.jit
    def step(state):
        loss, grads = fp8jax.filter_value_and_grad(functools.partial(loss_fn, state.apply_fn))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(6):
        state, loss = step(state)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    for name, layer in fp8jax.telemetry(state.params).items():
        for role in ("input", "kernel", "output_grad"):
            assert float(getattr(layer, role).amax) > 0, (name, role)


# --- which layers: module paths, as Fp8Config chooses Linears ---------------------------------


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="down")(nn.relu(nn.Dense(64, name="up")(x)))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + Mlp(name=f"block{i}")(x)
        return nn.Dense(10, name="head")(x)


def test_layers_are_chosen_by_module_path():
    x = jnp.ones((4, 32))
    # The default: every layer but the head (DEFAULT_EXCLUDE), delayed scaling.
    variables = fp8jax.fp8_linear_layers(Model()).init(jax.random.key(0), x)
    assert list(fp8jax.telemetry(variables)) == [
        "block0.down",
        "block0.up",
        "block1.down",
        "block1.up",
    ]
    assert "head" not in variables[OWG]
    assert isinstance(state_of(variables, "block0", "up").recipe, fp8jax.DelayedScaling)
    # A regex over the dotted path, a per-layer recipe, a list of names.
    cfg = fp8jax.Fp8Config(targets=r"block1\..*", recipes={"block1.down": "current"})
    variables = fp8jax.fp8_linear_layers(Model(), cfg).init(jax.random.key(0), x)
    assert list(fp8jax.telemetry(variables)) == ["block1.down", "block1.up"]
    assert isinstance(state_of(variables, "block1", "down").recipe, fp8jax.CurrentScaling)
    assert isinstance(state_of(variables, "block1", "up").recipe, fp8jax.DelayedScaling)
    cfg = fp8jax.Fp8Config(targets=["up", "head"], exclude=None)
    variables = fp8jax.fp8_linear_layers(Model(), cfg).init(jax.random.key(0), x)
    assert list(fp8jax.telemetry(variables)) == ["block0.up", "block1.up", "head"]


def test_init_says_which_targets_and_recipes_matched_nothing():
    x = jnp.ones((4, 32))
    listing = r"'block0.up'.*'block1.down'.*'head'"
    with pytest.raises(ValueError, match=rf"target 'nope' matches no Linear layer.*{listing}"):
        fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config(targets=["nope"])).init(
            jax.random.key(0), x
        )
    with pytest.raises(ValueError, match=r"targets='block0' matches only modules that are not"):
        fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config(targets="block0")).init(
            jax.random.key(0), x
        )
    with pytest.raises(ValueError, match=r"recipes pattern 'head' matches no converted layer"):
        fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config(recipes={"head": "current"})).init(
            jax.random.key(0), x
        )


def test_an_exclude_naming_a_nested_apply_layer_matches_it():
    """A layer applied by a nested `.apply` (a tied head) stays in high precision anyway;
    an `exclude` naming it matched a layer: no "keeps no layer" warning, the plan says why."""

    class Tied(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, name="fc")(x)
            kernel = self.param("tied", nn.initializers.lecun_normal(), (8, 4))
            head = nn.Dense(4, use_bias=False, name="tied_head")
            return head.apply({"params": {"kernel": kernel}}, h)

    model = fp8jax.fp8_linear_layers(Tied(), fp8jax.Fp8Config(exclude="tied_head", keep=()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = model.plan(jax.random.key(0), jnp.ones((2, 8)))
        model.init(jax.random.key(0), jnp.ones((2, 8)))
    assert plan.converted == ("fc",) and plan.unmatched == ()
    assert plan.kept["tied_head"].startswith("applied by a nested .apply")


def test_init_warns_when_exclude_matches_nothing_as_equinox_does():
    """An `exclude` of the user's that keeps no layer (a typo, a module path that is no
    Linear's) warns at `init` and is printed by the plan, as for Equinox and NNX models (the
    Linen plan dropped it: silent); one that matches a layer does not warn."""
    x = jnp.ones((4, 32))
    for unmatched in ("uup", r"block0"):
        config = fp8jax.Fp8Config(exclude=unmatched)
        plan = fp8jax.fp8_linear_layers(Model(), config).plan(jax.random.key(0), x)
        assert len(plan.converted) == 4 and plan.unmatched
        assert f"matches nothing: exclude={unmatched!r}" in str(plan)
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"keeps no layer in high precision"):
            fp8jax.fp8_linear_layers(Model(), config).init(jax.random.key(0), x)
    config = fp8jax.Fp8Config(exclude=r"block0\..*")
    plan = fp8jax.fp8_linear_layers(Model(), config).plan(jax.random.key(0), x)
    assert plan.converted == ("block1.down", "block1.up") and not plan.unmatched


def test_bad_input_errors():
    x = jnp.ones((4, 32))
    model = fp8jax.fp8_linear_layers(Model())
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(
        ValueError, match=r"no FP8 state for the layer 'block0.up'.*whole variables"
    ):
        model.apply({"params": variables["params"]}, x)
    with pytest.raises(ValueError, match=r"Dense at 'fc' has its own dot_general"):
        fp8jax.fp8_linear_layers(OneLayer(fp8_ops.Fp8DirectDotGeneralOp), config()).init(
            jax.random.key(0), x
        )
    with pytest.raises(TypeError, match=r"module=Net is bound to variables"):
        fp8jax.Fp8Linen(Net().bind(Net().init(jax.random.key(0), jnp.ones((1, 64)))))
    with pytest.raises(TypeError, match=r"got the class Net, not a model: pass an instance, Net"):
        fp8jax.fp8_linear_layers(Net)  # said "found no Linear layer in the tree"
    with pytest.raises(TypeError, match=r"module=dict: should be a flax.linen.Module"):
        fp8jax.Fp8Linen({})
    with pytest.raises(TypeError, match=r"config='delayed': should be an fp8jax.Fp8Config"):
        fp8jax.Fp8Linen(Model(), "delayed")
    state = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"grads should hold 'params' and '_overwrite_with_"):
        state.apply_gradients(grads={"params": variables["params"]})


# --- lifted transforms and shared modules -----------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.relu(nn.Dense(32, name="fc")(x)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        # As MaxText scans its layers: the FP8 collection has a layer axis, as params do.
        stack = nn.scan(
            Block, variable_axes={"params": 0, OWG: 0}, split_rngs={"params": True}, length=3
        )
        return stack(name="layers")(x, None)[0]


class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(name=f"layers{i}")(x, None)[0]
        return x


def test_nn_scan_stacks_the_state_per_layer_like_separate_layers():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    scanned = fp8jax.fp8_linear_layers(Scanned(), config(RECIPES["delayed"]))
    unrolled = fp8jax.fp8_linear_layers(Unrolled(), config(RECIPES["delayed"]))
    variables = scanned.init(jax.random.key(0), x)
    assert state_of(variables, "layers", "fc").input.amax_history.shape == (3, 16)
    layer = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    separate = {
        "params": {f"layers{i}": layer(variables["params"]["layers"], i) for i in range(3)},
        OWG: {f"layers{i}": layer(variables[OWG]["layers"], i) for i in range(3)},
    }

    def grad(model):
        return jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))

    for _ in range(2):
        grads, grads_u = grad(scanned)(variables), grad(unrolled)(separate)
        variables = {**variables, OWG: fp8jax.apply_updates(variables[OWG], None, grads[OWG])}
        separate = {**separate, OWG: fp8jax.apply_updates(separate[OWG], None, grads_u[OWG])}
        stacked = state_of(variables, "layers", "fc")
        for i in range(3):
            theirs = state_of(separate, f"layers{i}", "fc")
            assert_same(layer(stacked, i), theirs, names=False)
            np.testing.assert_array_equal(
                grads["params"]["layers"]["fc"]["kernel"][i],
                grads_u["params"][f"layers{i}"]["fc"]["kernel"],
            )
    # Each layer has its own amaxes.
    assert len(set(np.asarray(stacked.input.amax_history[:, 0]).tolist())) == 3


class ScannedWithoutTheCollection(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return stack(name="layers")(x, None)[0]


def test_nn_scan_without_the_collection_says_what_to_add():
    """An `nn.scan` whose `variable_axes` leaves the FP8 collection out has nowhere to keep
    the state: the error names the layer and the `variable_axes` to give (Flax's own error
    named neither)."""
    model = fp8jax.fp8_linear_layers(ScannedWithoutTheCollection(), config())
    with pytest.raises(ValueError, match=r"'layers\.fc' has no place for its FP8 state") as e:
        model.init(jax.random.key(0), jnp.ones((8, 32)))
    assert f"variable_axes={{'params': 0, {OWG!r}: 0}}" in str(e.value)
    # Excluded, the scanned layer needs no state and the model initialises.
    excluded = fp8jax.fp8_linear_layers(
        ScannedWithoutTheCollection(), fp8jax.Fp8Config(exclude=r".*fc", keep=())
    )
    with pytest.warns(fp8jax.Fp8ConversionWarning):
        variables = excluded.init(jax.random.key(0), jnp.ones((8, 32)))
    assert variables[OWG] == {}  # no FP8 state: it applies in high precision
    reference = ScannedWithoutTheCollection().apply(variables, jnp.ones((8, 32)))
    np.testing.assert_array_equal(excluded.apply(variables, jnp.ones((8, 32))), reference)


class BroadcastScan(nn.Module):
    """One layer run 3 times by `nn.scan`, its parameters broadcast (shared by every step)."""

    collections: tuple = ("params",)
    unrolled: bool = False

    @nn.compact
    def __call__(self, x):
        if self.unrolled:  # the same shared layer called 3 times in a loop
            block = Block(name="layers")
            for _ in range(3):
                x = block(x, None)[0]
            return nn.Dense(4, name="head")(x)
        stack = nn.scan(
            Block, variable_broadcast=list(self.collections), split_rngs={"params": False}, length=3
        )
        return nn.Dense(4, name="head")(stack(name="layers")(x, None)[0])


def test_nn_scan_broadcasting_its_params_says_to_broadcast_the_collection():
    """An `nn.scan` sharing its parameters (`variable_broadcast="params"`) without the FP8
    collection: the error said to give the collection a layer axis in `variable_axes`,
    which a scan with shared parameters has not. It now names `variable_broadcast` with the
    collection; so broadcast, the model computes as the same layer called in a loop (its
    uses combined by max), loss, gradients and new state."""
    x = jax.random.normal(jax.random.key(0), (8, 32))
    model = fp8jax.fp8_linear_layers(BroadcastScan(), config())
    with pytest.raises(ValueError, match=r"'layers\.fc' has no place for its FP8 state") as e:
        model.init(jax.random.key(1), x)
    assert f"variable_broadcast=['params', {OWG!r}]" in str(e.value)
    model = fp8jax.fp8_linear_layers(BroadcastScan(("params", OWG)), config())
    loop = fp8jax.fp8_linear_layers(BroadcastScan(unrolled=True), config())
    variables = model.init(jax.random.key(1), x)
    expected = loop.init(jax.random.key(1), x)
    assert_same(variables, expected)

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(loop)(expected)
    np.testing.assert_array_equal(got[0], want[0])
    assert_same(got[1][OWG], want[1][OWG])
    jax.tree.map(np.testing.assert_allclose, got[1]["params"], want[1]["params"])


class Shared(nn.Module):
    @nn.compact
    def __call__(self, x1, x2):
        fc = nn.Dense(16, use_bias=False, name="fc")
        return fc(x1), fc(x2)


def test_a_shared_module_keeps_the_larger_amax():
    model = fp8jax.fp8_linear_layers(Shared(), config())
    rng = np.random.default_rng(4)
    x1 = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    x2 = 7.0 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c1 = 3.0 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    c2 = 0.5 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    variables = model.init(jax.random.key(0), x1, x2)

    def loss(v):
        y1, y2 = model.apply(v, x1, x2)
        return jnp.sum(y1 * c1) + jnp.sum(y2 * c2)

    _, grads = fp8jax.filter_value_and_grad(loss)(variables)
    state = fp8jax.apply_updates(variables[OWG], None, grads[OWG])["fc"]["fp8jax"]
    assert float(state.input.amax_history[0]) == float(jnp.maximum(abs(x1).max(), abs(x2).max()))
    assert float(state.output_grad.amax_history[0]) == float(
        jnp.maximum(abs(c1).max(), abs(c2).max())
    )
    # Plain jax.grad would add the two new states: it refuses, in Linen's terms.
    with pytest.raises(fp8jax.StateUsedTwiceError, match=r"'fc' runs twice.*filter_value_and_grad"):
        jax.grad(loss)(variables)
    with pytest.raises(fp8jax.StateNotDifferentiatedError, match=r"Differentiate the whole"):
        jax.grad(lambda p: loss({"params": p, OWG: variables[OWG]}))(variables["params"])


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, use_bias=False, name="fc")(x)


class SharedScope(nn.Module):
    """`Inner` called twice, its variables in this module's scope (`nn.share_scope`) or,
    as a reference, in its own."""

    share: bool

    def setup(self):
        self.inner = Inner()
        if self.share:
            nn.share_scope(self, self.inner)

    def __call__(self, x1, x2):
        return self.inner(x1), self.inner(x2)


def test_a_module_in_a_shared_scope_runs_in_fp8_at_every_call():
    """Flax gives a module in a shared scope (`nn.share_scope`) a fresh copy of the root
    scope at its second call: that call is the same layer, in FP8, not a nested `.apply`
    on variables of its own (which runs as written). Its outputs, gradients and new state
    equal the same layer's in a scope of its own, the state's scale that of the larger
    amax (current scaling: float64 E4M3 max over it, rounded down to a power of two)."""
    rng = np.random.default_rng(4)
    x1 = 0.3 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    x2 = 7.0 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c1 = 3.0 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    c2 = 0.01 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    shared = fp8jax.fp8_linear_layers(SharedScope(True), config(recipe="current"))
    variables = shared.init(jax.random.key(0), x1, x2)
    apart = fp8jax.fp8_linear_layers(SharedScope(False), config(recipe="current"))
    got = {}
    for share, model in ((True, shared), (False, apart)):
        if not share:  # the same variables, under the inner module's name
            variables = {c: {"inner": v} for c, v in variables.items()}

        def loss(v, model=model):
            y1, y2 = model.apply(v, x1, x2)
            return jnp.sum(y1 * c1) + jnp.sum(y2 * c2), (y1, y2)

        (_, outs), grads = fp8jax.filter_value_and_grad(loss, has_aux=True)(variables)
        state = fp8jax.apply_updates(variables[OWG], None, grads[OWG])
        got[share] = outs, grads["params"], state if share else state["inner"]
    assert_same(got[True], got[False], names=False)
    state = got[True][2]["fc"]["fp8jax"].input
    assert float(state.amax_history[0]) == float(jnp.abs(x2).max())
    want = 2.0 ** np.floor(np.log2(448.0 / np.float64(state.amax_history[0])))
    assert (float(state.scale), float(state.scale_inv)) == (want, 1 / want)


# --- the train state ----------------------------------------------------------------------


class Optional(nn.Module):
    @nn.compact
    def __call__(self, x, second: bool = True):
        x = nn.Dense(32, name="fc1")(x)
        return nn.Dense(32, name="fc2")(x) if second else x


def test_the_train_state_gives_the_optimizer_the_params_as_optax_on_them_alone():
    """`apply_gradients` updates "params" as optax does on that pytree alone, the params
    passed to `tx.update` (adamw's weight decay reads them)."""
    model = fp8jax.fp8_linear_layers(Optional(), config())
    x = jnp.asarray(np.random.default_rng(7).standard_normal((8, 32)), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    loss = lambda v: jnp.mean(model.apply(v, x, True) ** 2)  # noqa: E731
    _, grads = fp8jax.filter_value_and_grad(loss)(variables)
    tx = optax.adamw(0.1, weight_decay=0.5)
    state = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    params = variables["params"]
    updates, _ = tx.update(grads["params"], tx.init(params), params)
    expected = optax.apply_updates(params, updates)
    assert_same(state.apply_gradients(grads=grads).params["params"], expected)


def test_the_train_state_keeps_the_state_of_a_layer_that_did_not_run():
    model = fp8jax.fp8_linear_layers(Optional(), config())
    x = jnp.asarray(np.random.default_rng(7).standard_normal((8, 32)), jnp.float32)
    variables = model.init(jax.random.key(0), x)

    def step(state, second):
        loss = lambda v: jnp.mean(state.apply_fn(v, x, second) ** 2)  # noqa: E731
        _, grads = fp8jax.filter_value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads)

    ours = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(0.1))
    flax = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(0.1))

    def merged(taken: fp8jax.Fp8DotGeneral) -> fp8jax.Fp8DotGeneral:
        # A received state as merge keeps it: delayed scaling's scale becomes the one its
        # next step uses (from the history); Flax's TrainState keeps the scale just used.
        def role(r):
            s = getattr(taken, r)
            scale = taken.recipe.next_scale(s.scale, s.amax_history, r)
            return fp8jax.TensorState(scale, s.amax_history)

        roles = ("input", "kernel", "output_grad")
        states = [role(r) for r in roles]
        return eqx.tree_at(lambda m: [getattr(m, r) for r in roles], taken, states)

    ours, flax = step(ours, True), step(flax, True)
    assert_same(ours.params["params"], flax.params["params"])  # both layers ran: the same step
    for layer in ("fc1", "fc2"):
        assert_same(state_of(ours.params, layer), merged(state_of(flax.params, layer)))
    ran = state_of(ours.params, "fc2")
    ours, flax = step(ours, False), step(flax, False)
    # fc2 did not run: Flax's TrainState overwrites its state with the zero gradient (scale 0
    # would zero the layer's next output); fp8jax's keeps it. fc1 moved on in both.
    assert_same(state_of(ours.params, "fc2"), ran)
    assert float(state_of(flax.params, "fc2").input.scale) == 0.0
    assert_same(state_of(ours.params, "fc1"), merged(state_of(flax.params, "fc1")))
    assert int(ours.step) == 2
    # The optimizer saw only the params: no moment estimate of a scale.
    assert jax.tree.structure(ours.opt_state[0].mu) == jax.tree.structure(variables["params"])
    # Without FP8 state (the BF16 model beside the FP8 one) it is Flax's TrainState.
    plain = Optional().init(jax.random.key(0), x)
    bf16 = fp8jax.LinenTrainState.create(
        apply_fn=Optional().apply, params=plain, tx=optax.adam(0.1)
    )
    flax = train_state.TrainState.create(
        apply_fn=Optional().apply, params=plain, tx=optax.adam(0.1)
    )
    assert_same(step(bf16, True).params, step(flax, True).params)


def test_the_train_state_of_frozen_variables_keeps_the_state_of_a_layer_that_did_not_run():
    """Variables held in a `FrozenDict` (`flax.core.freeze`, older Linen code) train as a
    dict's: the train state took them for variables without FP8 state and ran Flax's
    `apply_gradients`, which overwrote the state of a layer that did not run with its zero
    gradient (scale 0). Each step now equals the dict's, and the layer keeps its state."""
    from flax.core import freeze, unfreeze

    model = fp8jax.fp8_linear_layers(Optional(), config())
    x = jnp.asarray(np.random.default_rng(7).standard_normal((8, 32)), jnp.float32)
    variables = model.init(jax.random.key(0), x)

    def step(state, second):
        loss = lambda v: jnp.mean(state.apply_fn(v, x, second) ** 2)  # noqa: E731
        _, grads = fp8jax.filter_value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads)

    def create(params):
        return fp8jax.LinenTrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    first = step(create(variables), True)
    ran = state_of(first.params, "fc2")
    want = step(first, False)
    got = step(first.replace(params=freeze(first.params)), False)
    assert_same(state_of(got.params, "fc2"), ran)
    jax.tree.map(np.testing.assert_array_equal, unfreeze(got.params), want.params)


# --- telemetry, checkpoints, the H100 compile ---------------------------------------------------


def test_telemetry_and_a_checkpoint_of_the_train_state(tmp_path):
    model = fp8jax.fp8_linear_layers(Net(), config(telemetry=True))
    x = jnp.asarray(np.random.default_rng(8).standard_normal((8, 64)) * 1e4, jnp.float32)
    variables, tx = model.init(jax.random.key(0), x), optax.adam(0.1)
    state = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    loss = lambda v: jnp.mean(model.apply(v, x) ** 2)  # noqa: E731
    _, grads = fp8jax.filter_value_and_grad(loss)(state.params)
    assert not bool(fp8jax.scales_recorded(state.params))  # the variables, as for a loop's
    state = state.apply_gradients(grads=grads)
    assert bool(fp8jax.scales_recorded(state.params))
    stats = fp8jax.telemetry(state.params)
    assert list(stats) == ["fc1", "fc2"]
    assert float(stats["fc1"].input.amax) == float(abs(x).max())
    assert stats["fc1"].input.saturated is not None
    assert "fc1" in fp8jax.report(state.params, quiet=True)
    fp8jax.save_checkpoint(tmp_path / "state.eqx", state)
    fresh = fp8jax.LinenTrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(1), x), tx=tx
    )
    restored = fp8jax.load_checkpoint(tmp_path / "state.eqx", fresh)
    assert_same(restored, state)


@pytest.mark.skipif(importlib.util.find_spec("orbax") is None, reason="needs orbax-checkpoint")
def test_an_orbax_checkpoint_of_the_train_state_keeps_its_step(tmp_path):
    """`create` set `step` to the Python int 0, which stays one through unjitted steps, and
    the orbax backend saves no Python number: a state saved after two steps came back at
    step 0. The count of steps taken survives the checkpoint now."""
    model = fp8jax.fp8_linear_layers(Net(), config())
    x = jnp.ones((4, 64), jnp.float32)
    tx = optax.sgd(0.1)
    state = fp8jax.LinenTrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=tx
    )
    loss = lambda v: jnp.mean(model.apply(v, x) ** 2)  # noqa: E731
    for _ in range(2):
        state = state.apply_gradients(grads=fp8jax.filter_value_and_grad(loss)(state.params)[1])
    fp8jax.save_checkpoint(tmp_path / "state", state, backend="orbax")
    fresh = fp8jax.LinenTrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(1), x), tx=tx
    )
    restored = fp8jax.load_checkpoint(tmp_path / "state", fresh, backend="orbax")
    assert int(restored.step) == 2
    assert int(restored.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params)).step) == 3


def test_a_linen_train_step_runs_every_targeted_gemm_in_fp8_on_h100():
    h100_topology()
    model = fp8jax.fp8_linear_layers(Model())
    x = jnp.ones((32, 32))
    state = fp8jax.LinenTrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=optax.adamw(1e-3)
    )

    def train_step(state, x, y):
        loss = lambda v: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            state.apply_fn(v, x), y
        ).mean()
        value, grads = fp8jax.filter_value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    y = jax.ShapeDtypeStruct((32,), jnp.int32)
    x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    report = fp8jax.inspect(train_step, state, x, y, modes=("cublas", "default"))
    fp8jax.assert_all_fp8(report)  # cuBLAS mode (fp8jax's compiler options): FP8 tensor cores
    # XLA's default flags: the same GEMMs take FP8 operands, but the Triton kernels the
    # autotuner picks convert them to f16 (read from their PTX): why a plain jax.jit wants
    # fp8jax.gpu_compiler_options (docs/linen.md).
    ours = [g for g in report.gemms["default"] if g.layer is not None]
    assert len(ours) == 11 and all(g.fp8_operands for g in ours)
    assert not any(g.fp8 for g in ours if g.kernel.startswith("triton"))
    for mode in ("cublas", "default"):
        counts = {
            layer: {role: len(gemms) for role, gemms in roles.items()}
            for layer, roles in report.layers(mode).items()
        }
        # The input is not differentiated: block0.up has no dgrad. The head stays BF16.
        assert counts == {
            "block0.up": {"fwd": 1, "wgrad": 1},
            "block0.down": {"fwd": 1, "dgrad": 1, "wgrad": 1},
            "block1.up": {"fwd": 1, "dgrad": 1, "wgrad": 1},
            "block1.down": {"fwd": 1, "dgrad": 1, "wgrad": 1},
        }, mode
    assert report.count("cublas") == (11, 14)


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "linen.md"


def test_the_docs_example_runs(capsys):
    """docs/linen.md's Python blocks, run in order in one namespace, as a reader would. The
    blocks keep their line numbers in docs/linen.md for tracebacks."""
    h100_topology()
    text = DOCS.read_text()
    blocks = [
        (text.count("\n", 0, m.start(1)), m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    ]
    assert len(blocks) == 3  # convert and train, load a checkpoint, inspect
    namespace: dict[str, Any] = {"__name__": "docs_linen"}
    for line, block in blocks:
        exec(compile("\n" * line + block, str(DOCS), "exec"), namespace)
    state, loss = namespace["state"], namespace["loss"]
    out = capsys.readouterr().out
    assert list(fp8jax.telemetry(state.params)) == ["fc1", "fc2"]
    assert out.startswith(fp8jax.report(state.params, quiet=True))
    assert "5 of 8 GEMMs run on FP8 tensor cores" in out
    assert float(loss) < 1.5  # trained: ln(10) = 2.3 at the start
    assert int(state.step) == 100


def test_a_converted_model_converted_again_is_kept_and_a_new_config_said():
    """A converted Linen model converted again is the same object (no Hugging Face wrapper
    error); another config warns, naming the fields that differ; its plan is `.plan`'s."""
    fp8 = fp8jax.fp8_linear_layers(Net(), config())
    assert fp8jax.fp8_linear_layers(fp8, config()) is fp8
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"keeps its config.*differ in recipe\)"):
        assert fp8jax.fp8_linear_layers(fp8, config("current")) is fp8
    with pytest.raises(TypeError, match=r"conversion_plan: a Flax Linen model is traced at init"):
        fp8jax.conversion_plan(fp8)


class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dropout(0.5, deterministic=not train)(nn.Dense(32, name="fc1")(x))
        return nn.Dense(8, name="head")(nn.relu(nn.Dense(32, name="fc2")(h)))


@pytest.mark.parametrize("rngs", ["key", "params only"])
def test_init_with_dropout_on_the_params_key_alone_as_linen_does(rngs):
    """Linen's `make_rng` falls back to the "params" stream: `init(key, x, train=True)` runs a
    Dropout on it. The converted model's init (its planning trace included) takes the same
    arguments, and its parameters are the Linen model's own."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    key = jax.random.key(1)
    given = key if rngs == "key" else {"params": key}
    reference = Dropped().init(given, x, train=True)
    variables = fp8jax.fp8_linear_layers(Dropped()).init(given, x, train=True)
    assert sorted(variables[OWG]) == ["fc1", "fc2"]
    jax.tree.map(np.testing.assert_array_equal, variables["params"], reference["params"])


@pytest.mark.parametrize(
    "mutable", [True, ["params", OWG], ("params", OWG, "intermediates"), ["params"], "params"]
)
def test_init_takes_linens_mutable_argument(mutable):
    """Linen's `init` takes `mutable` (which collections to make); the converted model's
    init raised `TypeError: apply() got multiple values for keyword argument 'mutable'`
    from its planning trace (and, given collections without the FP8 one, blamed a lifted
    transform). It now makes what the Linen model's init makes, FP8 state beside it."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    reference = Dropped().init(jax.random.key(1), x, mutable=mutable)
    variables = fp8jax.fp8_linear_layers(Dropped()).init(jax.random.key(1), x, mutable=mutable)
    assert sorted(variables[OWG]) == ["fc1", "fc2"]
    assert sorted(variables) == sorted({*reference, OWG})
    jax.tree.map(np.testing.assert_array_equal, variables["params"], reference["params"])


class Decoder(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, decode=self.decode)(x)
        return nn.Dense(4, name="head")(y)


def test_a_decoding_model_inits_its_cache_as_linen_does():
    """`init` of an attention layer with `decode=True` on the full-length prompt makes its
    cache (Flax's examples do); the planning trace must take init's path, not decode the
    prompt with the cache it just made. The same layers convert as without `decode`, and the
    cache is the Linen model's own."""
    x = jax.random.normal(jax.random.key(0), (2, 4, 16))
    reference = Decoder(decode=True).init(jax.random.key(1), x)
    variables = fp8jax.fp8_linear_layers(Decoder(decode=True)).init(jax.random.key(1), x)
    training = fp8jax.fp8_linear_layers(Decoder()).init(jax.random.key(1), x)
    jax.tree.map(np.testing.assert_array_equal, variables["cache"], reference["cache"])
    assert jax.tree.structure(variables[OWG]) == jax.tree.structure(training[OWG])
    model = fp8jax.fp8_linear_layers(Decoder(decode=True))
    out, _ = model.apply(variables, x[:, :1], mutable=["cache"])
    assert out.shape == (2, 1, 4) and bool(jnp.all(jnp.isfinite(out)))


class OwnCallDense(nn.Dense):
    """A Dense subclass whose own `__call__` never calls `self.dot_general`."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        return x @ kernel + self.param("bias", self.bias_init, (self.features,))


class InheritedDense(nn.Dense):
    pass


class WithSubclass(nn.Module):
    layer: Any = nn.Dense

    @nn.compact
    def __call__(self, x):
        h = nn.relu(self.layer(32, name="fc1")(x))
        return nn.Dense(8, name="head")(nn.relu(nn.Dense(32, name="fc2")(h)))


@pytest.mark.parametrize("layer", [OwnCallDense, InheritedDense])
def test_a_dense_subclass_converts_as_the_dense_it_computes(layer):
    """A Dense subclass converts (the docs say so), whether or not its `__call__` is Dense's:
    its FP8 state exists, and its loss, gradients and new state equal those of the model with
    a plain `nn.Dense` in its place."""
    x = jax.random.normal(jax.random.key(0), (8, 16))
    model = fp8jax.fp8_linear_layers(WithSubclass(layer), config())
    plain = fp8jax.fp8_linear_layers(WithSubclass(nn.Dense), config())
    variables = model.init(jax.random.key(1), x)
    expected = plain.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == sorted(expected[OWG]) == ["fc1", "fc2", "head"]

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(plain)(expected)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class GatedEinsum(nn.Einsum):
    """An Einsum subclass with a call of its own: an einsum of the input with itself (no
    kernel) gates the einsum with the kernel."""

    @nn.compact
    def __call__(self, inputs, einsum_str=None):
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        gate = jax.nn.sigmoid(jnp.einsum("btd,bsd->bts", inputs, inputs).mean(-1, keepdims=True))
        return jnp.einsum(self.einsum_str, inputs, kernel) * gate


class Gated(nn.Module):
    split: bool = False  # the gate computed outside a plain nn.Einsum

    @nn.compact
    def __call__(self, x):
        if self.split:
            gate = jax.nn.sigmoid(jnp.einsum("btd,bsd->bts", x, x).mean(-1, keepdims=True))
            h = nn.Einsum((16, 16), "btd,de->bte", use_bias=False, name="g")(x) * gate
        else:
            h = GatedEinsum((16, 16), "btd,de->bte", use_bias=False, name="g")(x)
        return nn.Dense(4, name="head")(h)


def test_an_einsum_subclass_with_its_own_call_converts_only_its_kernel_gemm():
    """An `nn.Einsum` subclass with a `__call__` of its own is traced, as the docs say of
    subclasses: only its einsum with the kernel is FP8. Every einsum of its call was
    answered by the layer's FP8 einsum, and init failed (NameInUseError) at the second.
    Its loss, gradients and new state equal those of a plain nn.Einsum with the gate
    computed outside it."""
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    model = fp8jax.fp8_linear_layers(Gated(), config())
    plain = fp8jax.fp8_linear_layers(Gated(split=True), config())
    variables = model.init(jax.random.key(1), x)
    expected = plain.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == sorted(expected[OWG]) == ["g", "head"]

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(plain)(expected)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class KernelTwice(nn.Module):
    """A module multiplying by its own kernel twice in one call."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, 16))
        return jnp.tanh(x @ kernel) @ kernel


class Tied(nn.Module):
    dense: bool = False  # the same products by an nn.Dense called twice

    @nn.compact
    def __call__(self, x):
        if self.dense:
            fc = nn.Dense(16, use_bias=False, name="t")
            h = fc(jnp.tanh(fc(x)))
        else:
            h = KernelTwice(name="t")(x)
        return nn.Dense(4, name="head")(h)


def test_a_module_multiplying_by_its_kernel_twice_in_one_call_shares_one_state():
    """Both GEMMs on a module's own kernel in one call are FP8 with its one state, as a
    Dense called twice is: init failed (NameInUseError: the state declared again for the
    second GEMM). Its loss, gradients and new state (uses combined by max) equal those of
    an nn.Dense called twice."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(Tied(), config())
    plain = fp8jax.fp8_linear_layers(Tied(dense=True), config())
    variables = model.init(jax.random.key(1), x)
    expected = plain.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == sorted(expected[OWG]) == ["head", "t"]

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(plain)(expected)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class KernelDropCount(nn.Module):
    """An own-kernel projection that draws random numbers (Dropout), counts its calls in a
    collection of its own and sows its input."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, 16))
        calls = self.variable("counts", "calls", lambda: jnp.zeros((), jnp.int32))
        if not self.is_initializing():
            calls.value += 1
        self.sow("intermediates", "input", x)
        return nn.Dropout(0.5, deterministic=not train)(x @ kernel)


class WithKernelDropCount(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(4, name="head")(KernelDropCount(name="p")(x, train))


def test_an_own_kernel_module_draws_its_rngs_and_writes_its_collections():
    """The traced call of an own-kernel module had no random streams (a Dropout in it raised
    InvalidRngError) and no mutable collection (init raised ModifyScopeVariableError at its
    counter). Its Dropout now draws from the apply's streams, and its writes land as the
    Linen model's do."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(WithKernelDropCount(), config())
    variables = model.init(jax.random.key(1), x)
    reference = WithKernelDropCount().init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == ["head", "p"]
    assert variables["counts"] == reference["counts"]
    mutable = ["counts", "intermediates"]
    _, got = model.apply(variables, x, mutable=mutable)
    _, want = WithKernelDropCount().apply(reference, x, mutable=mutable)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # Dropout on the FP8 product: each entry is dropped or scaled by 1 / (1 - 0.5).
    kept = model.apply(variables, x, capture_intermediates=True, mutable=mutable)[1]
    kept = kept["intermediates"]["p"]["__call__"][0]
    seen = []
    for key in (2, 3):
        rngs = {"dropout": jax.random.key(key)}
        _, out = model.apply(
            variables, x, True, rngs=rngs, capture_intermediates=True, mutable=mutable
        )
        dropped = out["intermediates"]["p"]["__call__"][0]
        np.testing.assert_array_equal(dropped, jnp.where(dropped == 0, 0, 2 * kept))
        seen.append(np.asarray(dropped == 0))
    assert 0 < seen[0].mean() < 1 and (seen[0] != seen[1]).any()


class KernelThenDense(nn.Module):
    """A module with its own kernel and a Dense inside it."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, 16))
        return nn.Dense(16, name="inner")(jnp.tanh(x @ kernel))


class WithKernelThenDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(KernelThenDense(name="p")(x))


def test_a_dense_inside_an_own_kernel_module_is_said_high_precision():
    """A Dense inside a module with its own kernel runs in that module's traced call, in high
    precision: the plan said FP8 and init gave it FP8 state that stayed at amax 0. It is now
    planned high precision with the reason, holds no state, and the model computes as with
    that Dense excluded."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(WithKernelThenDense(), config())
    excluded = fp8jax.fp8_linear_layers(
        WithKernelThenDense(), fp8jax.Fp8Config(exclude=r"p\.inner", keep=())
    )
    (inner,) = [c for c in model.plan(jax.random.key(1), x).layers if c.path == "p.inner"]
    assert not inner.fp8 and "inside p" in inner.why
    variables = model.init(jax.random.key(1), x)
    expected = excluded.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == sorted(expected[OWG]) == ["head", "p"]
    assert "fp8jax" in variables[OWG]["p"] and "inner" not in variables[OWG]["p"]

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(excluded)(expected)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class NormKernelThenDense(nn.Module):
    """A module with its own kernel and two modules inside it, before and after its GEMM."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="norm")(x)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, 16))
        return nn.Dense(16, name="inner")(jnp.tanh(h @ kernel))


class WithNormKernelThenDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(NormKernelThenDense(name="p")(x))


def test_capture_intermediates_sees_the_modules_inside_an_own_kernel_module():
    """`capture_intermediates=True` captures the modules inside a module with its own kernel,
    as Linen does unconverted: they ran in its traced call, where capture was off (only
    `p.__call__` was captured, not `p.norm` nor `p.inner`). The keys are Linen's; the norm,
    before any FP8 GEMM, captures Linen's value, and the inner Dense the module's output."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(WithNormKernelThenDense(), config())
    variables = model.init(jax.random.key(1), x)
    capture = {"capture_intermediates": True, "mutable": ["intermediates"]}
    want = WithNormKernelThenDense().apply({"params": variables["params"]}, x, **capture)[1]
    got = model.apply(variables, x, **capture)[1]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    p, p_want = got["intermediates"]["p"], want["intermediates"]["p"]
    np.testing.assert_allclose(p["norm"]["__call__"][0], p_want["norm"]["__call__"][0], 1e-6)
    np.testing.assert_array_equal(p["inner"]["__call__"][0], p["__call__"][0])


def test_flax_serialization_writes_and_restores_the_train_state():
    """Flax's own checkpoint format (`flax.serialization`, under `flax.training.checkpoints`)
    writes the train state, FP8 state included, and restores it bit for bit; a target made
    with another config is refused naming the entries."""
    from flax import serialization

    x = jax.random.normal(jax.random.key(0), (8, 16))
    model = fp8jax.fp8_linear_layers(Net(), config())
    variables = model.init(jax.random.key(1), x)
    state = fp8jax.LinenTrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.adam(1e-3)
    )
    grads = fp8jax.filter_value_and_grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(state.params)[1]
    trained = state.apply_gradients(grads=grads)
    restored = serialization.from_bytes(state, serialization.to_bytes(trained))
    want, got = jax.tree.leaves(trained), jax.tree.leaves(restored)
    assert len(want) == len(got) and jax.tree.structure(restored) == jax.tree.structure(trained)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = fp8jax.fp8_linear_layers(Net(), config(telemetry=True)).init(jax.random.key(1), x)
    with pytest.raises(ValueError, match=r"Fp8DotGeneral 'fc1': the saved FP8 state has"):
        serialization.from_bytes(other, serialization.to_bytes(trained.params))


class OnlyAHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="proj")(x)


def test_a_model_init_converted_nothing_applies_and_trains_in_high_precision():
    """`init` that converts no layer (the only Dense is the head, kept) warns that the model
    trains in high precision: its variables then apply, train and checkpoint as the Linen
    model's own (apply refused them, asking for FP8 state that init never made)."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(OnlyAHead())
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"converted no layer.*high precision"):
        variables = model.init(jax.random.key(1), x)
    reference = OnlyAHead().init(jax.random.key(1), x)
    jax.tree.map(np.testing.assert_array_equal, variables["params"], reference["params"])
    np.testing.assert_array_equal(model.apply(variables, x), OnlyAHead().apply(reference, x))
    state = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
    plain = train_state.TrainState.create(
        apply_fn=OnlyAHead().apply, params=reference, tx=optax.sgd(0.1)
    )
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(state.params)
    grads_plain = jax.grad(lambda v: jnp.sum(OnlyAHead().apply(v, x) ** 2))(plain.params)
    jax.tree.map(
        np.testing.assert_array_equal,
        state.apply_gradients(grads=grads).params["params"],
        plain.apply_gradients(grads=grads_plain).params["params"],
    )
    # The parameters alone are still refused: they name no FP8 state at all.
    with pytest.raises(ValueError, match=r"no FP8 state for the layer 'proj'"):
        model.apply({"params": variables["params"]}, x)


class BatchedKernels(nn.Module):
    layer: str = "general"

    @nn.compact
    def __call__(self, x):  # x: (heads, tokens, 32), one kernel per head
        if self.layer == "general":
            return nn.DenseGeneral(16, batch_dims=(0,), name="per_head")(x)
        return nn.Einsum((4, 32, 16), "htd,hde->hte", name="per_head")(x)


@pytest.mark.parametrize("layer", ["general", "einsum"])
def test_a_kernel_with_batch_axes_under_error_feedback_is_said_by_name(layer):
    """A kernel with batch axes has no single (out, in) matrix for the error-feedback state:
    init names the layer and what to do (it said to pass kernel_shape to Fp8DotGeneral,
    which "fp8_linear_layers does for you": the call the user had made). With another recipe
    for that layer, by `recipes`, it converts and computes the unconverted layer's product
    to FP8 rounding."""
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    feedback = fp8jax.ResidualFP8(error_feedback=True)
    model = fp8jax.fp8_linear_layers(BatchedKernels(layer), config(feedback))
    with pytest.raises(ValueError, match=r"'per_head'.*batch axes.*another recipe") as e:
        model.init(jax.random.key(1), x)
    assert "does this for you" not in str(e.value)
    other = config(feedback, recipes={"per_head": "current"})
    model = fp8jax.fp8_linear_layers(BatchedKernels(layer), other)
    variables = model.init(jax.random.key(1), x)
    want = BatchedKernels(layer).apply({"params": variables["params"]}, x)
    # E4M3 rounds each operand to 3 mantissa bits (relative error <= 2^-4 each, two
    # operands): a product's relative error stays below 2^-3 in norm.
    got = model.apply(variables, x)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2**-3


class KernelOnTheLeft(nn.Module):
    """A projection written `kernel^T x` with the kernel as dot_general's left operand."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.1), (x.shape[-1], 32))
        return jax.lax.dot_general(kernel, x, (((0,), (1,)), ((), ()))).T


class LeftThenDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="fc")(nn.relu(KernelOnTheLeft(name="left")(x)))


def test_a_module_with_its_kernel_as_the_left_operand_stays_high_precision_with_a_warning():
    """fp8jax answers the GEMMs taking a module's kernel as their right operand; one taking
    it only as the left was planned FP8 and init then failed ("no GEMM of its call takes it
    as its right operand"). It now stays in high precision, said in the init warning, and
    the model computes as the Linen model does there."""
    x = jax.random.normal(jax.random.key(0), (4, 16))
    model = fp8jax.fp8_linear_layers(LeftThenDense(), config())
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"left.*left operand"):
        variables = model.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == ["fc"]
    reference = LeftThenDense().apply({"params": variables["params"]}, x)
    _, seen = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    left = KernelOnTheLeft().apply({"params": variables["params"]["left"]}, x)
    np.testing.assert_array_equal(seen["intermediates"]["left"]["__call__"][0], left)
    # The FP8 Dense after it: E4M3 operands (3 mantissa bits, relative error <= 2^-4 each).
    got = model.apply(variables, x)
    assert float(jnp.linalg.norm(got - reference) / jnp.linalg.norm(reference)) < 2**-3


class OwnKernel(nn.Module):
    """A projection holding its own `kernel`, as Hugging Face's `FlaxConv1D` does."""

    kernel_init: Any = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (16, x.shape[-1]))
        return jnp.dot(x, kernel.T)


class OwnKernelWithChild(nn.Module):
    """A module multiplying by its own `kernel` that holds a child Dense (its own `kernel`)."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 16))
        return x @ kernel, nn.Dense(16, name="fc")(x)


def test_only_a_modules_own_kernel_gemm_is_fp8_not_a_childs():
    """Only the GEMM on the module's own `params/kernel` is answered in FP8: its child's
    `kernel` (an excluded Dense) is another parameter, whose GEMM runs as unconverted, bit
    for bit (as in NNX's kernel modules)."""
    model = OwnKernelWithChild()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32)), jnp.float32)
    converted = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(exclude="fc", keep=()))
    variables = converted.init(jax.random.key(1), x)
    assert sorted(variables[OWG]) == [fp8jax.__name__]  # the root's state alone
    own, child = converted.apply(variables, x)
    own_ref, child_ref = model.apply({"params": variables["params"]}, x)
    np.testing.assert_array_equal(child, child_ref)
    assert not np.array_equal(own, own_ref)  # FP8, not the float32 GEMM


class BoxedKernels(nn.Module):
    """An own-kernel layer, an `nn.Einsum` and an `nn.Dense`, their kernels with or without
    partitioning metadata (boxed parameters, as sharded Linen models declare them)."""

    boxed: bool = True

    @nn.compact
    def __call__(self, x):
        def init(names):
            lecun = nn.initializers.lecun_normal()
            return nn.with_partitioning(lecun, names) if self.boxed else lecun

        h = nn.relu(OwnKernel(init(("model", None)), name="own")(x))
        h = nn.Einsum((16, 16), "bd,de->be", kernel_init=init((None, "model")), name="ein")(h)
        return nn.Dense(8, kernel_init=init(("model", None)), name="head")(nn.relu(h))


def test_kernels_with_partitioning_metadata_convert_as_plain_ones():
    """Kernels declared with `nn.with_partitioning` (held boxed in the variables) convert as
    the same kernels unboxed: the own-kernel layer was not found (init said "found no Linear
    layer"), and the Einsum's width read the box's shape (a DeprecationWarning, an error
    under -W error). The loss, gradients and new state equal those of the unboxed model."""
    x = jax.random.normal(jax.random.key(0), (8, 32))
    boxed = fp8jax.fp8_linear_layers(BoxedKernels(True), fp8jax.Fp8Config())
    plain = fp8jax.fp8_linear_layers(BoxedKernels(False), fp8jax.Fp8Config())
    variables = boxed.init(jax.random.key(1), x)
    expected = plain.init(jax.random.key(1), x)
    assert isinstance(variables["params"]["own"]["kernel"], nn.Partitioned)
    assert sorted(variables[OWG]) == sorted(expected[OWG]) == ["ein", "own"]
    assert str(boxed.plan(jax.random.key(1), x)) == str(plain.plan(jax.random.key(1), x))

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(boxed)(variables), loss(plain)(expected)
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(got), want)


class WeightNormed(nn.Module):
    """A Dense wrapped in `nn.WeightNorm` (its kernel normalised by `nn.map_variables`)."""

    @nn.compact
    def __call__(self, x):
        h = nn.WeightNorm(nn.Dense(32, name="fc"))(x)
        return nn.Dense(4, name="head")(nn.relu(h))


class Normed(nn.Module):
    """`WeightNormed` with the normalised kernel given as the Dense's own parameter."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(nn.relu(nn.Dense(32, name="fc")(x)))


def test_a_dense_in_weight_norm_runs_in_fp8_on_its_normalised_kernel():
    """`nn.WeightNorm` maps every collection of its layer through its normalisation: it took
    the FP8 state's `kernel` entries for a kernel (init raised IndexError). The Dense now
    runs in FP8 on the weight-normed kernel, its state untouched: output and new state equal
    those of the same FP8 Dense given that kernel, computed here in plain JAX."""
    x = jax.random.normal(jax.random.key(0), (8, 16))
    model = fp8jax.fp8_linear_layers(WeightNormed(), config())
    variables = model.init(jax.random.key(1), x)
    params = variables["params"]
    unconverted = WeightNormed().init(jax.random.key(1), x)["params"]
    assert jax.tree.structure(params) == jax.tree.structure(unconverted)
    v, g = params["fc"]["kernel"], params["WeightNorm_0"]["fc/kernel/scale"]
    kernel = v * jax.lax.rsqrt(jnp.sum(v * v, axis=0, keepdims=True) + 1e-12) * g
    reference = fp8jax.fp8_linear_layers(Normed(), config())
    normed = {
        "params": {**params, "fc": {**params["fc"], "kernel": kernel}},
        OWG: variables[OWG],
    }
    del normed["params"]["WeightNorm_0"]

    def loss(m, v):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))(v)

    (got, grads), (want, expected) = loss(model, variables), loss(reference, normed)
    np.testing.assert_array_equal(got, want)
    assert_same(grads[OWG], expected[OWG])
    assert np.max(state_of(grads, "fc").kernel.amax_history) == np.max(np.abs(kernel))


class TiedBothWays(nn.Module):
    """A kernel multiplied both ways in one call, `x @ kernel` and `h @ kernel.T` (tied)."""

    features: int = 32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, self.features))
        return jnp.tanh(x @ kernel) @ kernel.T


class WithTiedBothWays(nn.Module):
    features: int = 32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(TiedBothWays(self.features, name="t")(x))


def test_a_kernel_used_both_ways_under_error_feedback_gets_linen_advice():
    """One error-feedback state cannot hold a kernel multiplied both ways (its residual is
    kernel-shaped): the error said to build the layer with kernel_shape=..., Equinox's
    constructor argument, which a Linen user never calls. It now names the layer and says
    what a Linen user does: another recipe for it by `recipes`, or `exclude`; with that
    advice followed, it converts and computes the unconverted model to FP8 rounding."""
    x = jax.random.normal(jax.random.key(0), (8, 16))
    feedback = fp8jax.ResidualFP8(error_feedback=True)
    model = fp8jax.fp8_linear_layers(WithTiedBothWays(), config(feedback))
    with pytest.raises(ValueError, match=r"Fp8Linen.*'t'.*recipes=.*exclude") as e:
        model.init(jax.random.key(1), x)
    assert "kernel_shape=" not in str(e.value)
    other = config(feedback, recipes={"t": "current"})
    model = fp8jax.fp8_linear_layers(WithTiedBothWays(), other)
    variables = model.init(jax.random.key(1), x)
    want = WithTiedBothWays().apply({"params": variables["params"]}, x)
    # Each E4M3 product is within 2^-3 in norm (two operands of 3 mantissa bits); tanh is
    # 1-Lipschitz and the head is high precision: two products in a chain stay within 2^-2.
    got = model.apply(variables, x)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2**-2


def test_a_square_kernel_used_both_ways_under_error_feedback_is_refused_too():
    """A square kernel multiplied both ways has one (out, in) shape, so the shape check let
    it through: the two GEMMs' remainders, of W.T and of W, were combined by max into a
    state that is the remainder of neither (measured: off by as much as the remainder
    itself). It is now refused as the non-square one is; a kernel multiplied twice the
    same way still runs, as an nn.Dense called twice does under error feedback."""
    x = jax.random.normal(jax.random.key(0), (8, 16))
    feedback = config(fp8jax.ResidualFP8(error_feedback=True))
    model = fp8jax.fp8_linear_layers(WithTiedBothWays(features=16), feedback)
    with pytest.raises(ValueError, match=r"Fp8Linen.*'t'.*as its transpose.*recipes=.*exclude"):
        model.init(jax.random.key(1), x)
    model = fp8jax.fp8_linear_layers(Tied(), feedback)
    plain = fp8jax.fp8_linear_layers(Tied(dense=True), feedback)
    variables, expected = model.init(jax.random.key(1), x), plain.init(jax.random.key(1), x)

    def loss(m):
        return fp8jax.filter_value_and_grad(lambda v: jnp.sum(m.apply(v, x) ** 2))

    got, want = loss(model)(variables), loss(plain)(expected)
    jax.tree.map(np.testing.assert_array_equal, got, want)


class WithFlaxFp8(nn.Module):
    """A layer with Flax's own FP8 ops (excluded, as the refusal says) beside a plain one:
    both keep their state in the collection `"_overwrite_with_gradient"`."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp, name="flax_fp8")(x)
        return nn.Dense(16, name="ours")(nn.relu(h))


def test_the_train_state_takes_the_new_state_of_flaxs_own_fp8_ops_as_flax_does():
    """Flax's FP8 ops keep plain arrays in the collection: `apply_gradients` raised
    "overwrites has a value where the model has ArrayImpl" for a model holding both."""
    model = fp8jax.fp8_linear_layers(WithFlaxFp8(), fp8jax.Fp8Config(exclude="flax_fp8", keep=()))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((8, 16)), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    assert isinstance(state_of(variables, "ours"), fp8jax.Fp8DotGeneral)
    loss = lambda v: jnp.mean(model.apply(v, x) ** 2)  # noqa: E731
    _, grads = fp8jax.filter_value_and_grad(loss)(variables)
    ours = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(0.1))
    flax = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(0.1))
    ours, flax = ours.apply_gradients(grads=grads), flax.apply_gradients(grads=grads)
    assert_same(ours.params["params"], flax.params["params"])
    # Flax's arrays: the gradient is the new value (Flax's TrainState's overwrite).
    assert_same(ours.params[OWG]["flax_fp8"], grads[OWG]["flax_fp8"])
    assert_same(ours.params[OWG]["flax_fp8"], flax.params[OWG]["flax_fp8"])
    # fp8jax's layer: merged, as without Flax's layer beside it.
    alone = fp8jax.apply_updates(variables[OWG]["ours"], None, grads[OWG]["ours"])
    assert_same(ours.params[OWG]["ours"], alone)


class Trained(nn.Module):
    """A model with a train flag and collections of its own: batch statistics, dropout."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train)(nn.Dense(32, name="fc1")(x))
        h = nn.Dropout(0.5, deterministic=not train)(nn.relu(h))
        return nn.Dense(16, name="fc2")(h)


def test_an_eval_call_reads_the_fp8_state_and_changes_none_of_it():
    model = fp8jax.fp8_linear_layers(Trained(), config())
    x = jnp.asarray(np.random.default_rng(10).standard_normal((8, 32)) * 4, jnp.float32)
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss(v):
        y, updates = model.apply(v, x, mutable=["batch_stats"], rngs={"dropout": jax.random.key(2)})
        return jnp.mean(y**2), updates

    (_, updates), grads = fp8jax.filter_value_and_grad(loss, has_aux=True)(variables)
    state = fp8jax.LinenTrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
    state = state.apply_gradients(grads=grads)
    trained = {**state.params, **updates}  # batch statistics kept as Linen's own
    assert list(trained) == ["params", OWG, "batch_stats"]
    out, after = model.apply(trained, x, train=False, mutable=True)
    assert_same(after[OWG], trained[OWG])  # evaluation records no amax
    assert_same(after["batch_stats"], trained["batch_stats"])
    unconverted = Trained().apply({k: trained[k] for k in ("params", "batch_stats")}, x, False)
    assert not np.array_equal(out, unconverted)  # the layers ran in FP8
    # FP8 rounding, and saturation where eval's activations (running statistics, no dropout)
    # outgrow the amax training recorded: delayed scaling as it is.
    assert float(jnp.linalg.norm(out - unconverted) / jnp.linalg.norm(unconverted)) < 0.2


class Spelled(nn.Module):
    """Layers with Linen's default `dot_general` written out, as older Linen code does."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, dot_general=jax.lax.dot_general, name="fc1")(x))
        return nn.DenseGeneral(64, dot_general=jax.lax.dot_general, name="fc2")(h)


def test_a_layer_with_lax_dot_general_written_out_converts_as_one_without():
    """`dot_general=lax.dot_general` was refused as "its own dot_general"."""
    x = jnp.asarray(np.random.default_rng(11).standard_normal((8, 32)), jnp.float32)
    spelled = fp8jax.fp8_linear_layers(Spelled(), config())
    plain = fp8jax.fp8_linear_layers(Net(), config())
    variables = spelled.init(jax.random.key(0), x)
    assert_same(variables, plain.init(jax.random.key(0), x))
    loss = lambda model: lambda v: jnp.sum(jnp.sin(model.apply(v, x)))  # noqa: E731
    ours = fp8jax.filter_value_and_grad(loss(spelled))(variables)
    assert_same(ours, fp8jax.filter_value_and_grad(loss(plain))(variables))
    # The Equinox path's numbers (the reference for Net's layers).
    model = fp8jax.fp8_linear_layers(eqx_net(variables["params"]), config())
    y = jax.vmap(model)(x)
    np.testing.assert_array_equal(spelled.apply(variables, x), y)

"""Scanned layers and rematerialization: the same FP8 training as the plain model."""

import contextlib
import dataclasses
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SAME_BITS
from jax.ad_checkpoint import print_saved_residuals

import fp8jax
from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss

CONFIG = GPTConfig(vocab=64, layers=2, width=32, heads=4, context=16)


def stack(blocks):
    return jax.tree.map(lambda *a: jnp.stack(a), *blocks)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_scanned_gpt_trains_like_the_unrolled_one(recipe, getkey):
    unrolled = GPT(CONFIG, key=getkey())
    scanned = GPT(dataclasses.replace(CONFIG, scan_layers=True), key=getkey())
    scanned = eqx.tree_at(lambda g: g.blocks, scanned, stack(unrolled.blocks))
    scanned = eqx.tree_at(
        lambda g: (g.embed, g.position, g.norm, g.head),
        scanned,
        (unrolled.embed, unrolled.position, unrolled.norm, unrolled.head),
    )
    config = fp8jax.Fp8Config(recipe=recipe)
    unrolled = fp8jax.fp8_linear_layers(unrolled, config)
    scanned = fp8jax.fp8_linear_layers(scanned, config)
    # One FP8 state per layer, stacked like the weights.
    state = scanned.blocks.mlp.fc1.dot_general.input
    assert state.scale.shape == (CONFIG.layers,)
    tokens = jax.random.randint(getkey(), (4, CONFIG.context + 1), 0, CONFIG.vocab)
    # SGD: updates linear in the gradients (Adam would turn float noise in a near-zero
    # gradient into a full-size step).
    step = fp8jax.make_train_step(next_token_loss, optax.sgd(0.5))
    a, b = step.init(unrolled), step.init(scanned)
    for _ in range(3):
        a, metrics_a = step(a, tokens)
        b, metrics_b = step(b, tokens)
        assert float(metrics_b.loss) == pytest.approx(float(metrics_a.loss), rel=1e-6)
    # Every parameter and every FP8 state, layer by layer.
    stacked = arrays(b.model.blocks)
    for i, block in enumerate(a.model.blocks):
        for u, v in zip([leaf[i] for leaf in stacked], arrays(block), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    amaxes = [
        (blk.mlp.fc1.dot_general.input.amax_history, blk.attn.out.dot_general.output_grad)
        for blk in a.model.blocks
    ]
    np.testing.assert_allclose(
        b.model.blocks.mlp.fc1.dot_general.input.amax_history,
        jnp.stack([h for h, _ in amaxes]),
        rtol=1e-6,
    )
    assert len({float(h[0]) for h, _ in amaxes}) == CONFIG.layers


def mlp_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


POLICIES = {
    "fp8_dots_saveable": fp8jax.fp8_dots_saveable,
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_fp8_operands": fp8jax.save_fp8_operands,
}


# An amax history length that no activation or weight has as a dimension, so that the FP8
# state among the saved residuals is told apart by its shape (the default, 1024, could be a
# layer's width).
HISTORY = 7


@pytest.fixture
def fp8_mlp(getkey):
    mlp = eqx.nn.MLP(64, 64, 256, 1, activation=jax.nn.gelu, key=getkey())
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(history_len=HISTORY))
    return fp8jax.fp8_linear_layers(mlp, config), jax.random.normal(getkey(), (32, 64)) * 3


def is_fp8(x):
    return isinstance(x, fp8jax.Fp8DotGeneral)


def loss_with(policy):
    def loss(model, x):
        if policy is None:
            return mlp_loss(model, x)
        return eqx.filter_checkpoint(mlp_loss, policy=policy)(model, x)

    return loss


@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_policies_give_identical_training(policy, fp8_mlp):
    model, x = fp8_mlp

    # Bit for bit: both compiled with SAME_BITS (the recomputed forward is fused otherwise).
    def grads(policy):
        step = fp8jax.filter_value_and_grad(loss_with(policy))
        return eqx.filter_jit(step, compiler_options=SAME_BITS)(model, x)

    want, got = grads(None), grads(POLICIES[policy])
    for u, v in zip(arrays(got), arrays(want), strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("policy", ["none", "save_fp8_operands"])
def test_remat_under_fp8jax_grad_called_outside_jit(policy, fp8_mlp):
    """Called eagerly, fp8jax's gradient of a rematerialized model is its jitted one (a
    remat saves its max-combining inputs, which an eager caller must never hold)."""
    model, x = fp8_mlp

    def loss(model, x):
        return eqx.filter_checkpoint(mlp_loss, policy=POLICIES[policy])(model, x)

    eager = fp8jax.filter_value_and_grad(loss)(model, x)
    jitted = eqx.filter_jit(fp8jax.filter_value_and_grad(loss))(model, x)
    for u, v in zip(arrays(eager), arrays(jitted), strict=True):
        np.testing.assert_array_equal(u, v)
    assert float(eager[1].layers[0].dot_general.input.amax_history[0]) == float(jnp.abs(x).max())


def residuals(policy, model, x):
    """(dtype, shape) of each value saved for the backward pass, as `print_saved_residuals`
    lists them; arguments, and float32 values shaped like FP8 state (scalar scales and
    `(HISTORY,)` amax histories, the new state the backward pass returns), excluded."""
    params, static = eqx.partition(model, eqx.is_array)
    states = [m for m in jax.tree.leaves(model, is_leaf=is_fp8) if is_fp8(m)]
    state_shapes = {leaf.shape for leaf in jax.tree.leaves(states)}
    assert state_shapes == {(), (HISTORY,)}, state_shapes
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    weights = jax.tree.leaves(eqx.filter(trainable, eqx.is_array))
    assert HISTORY not in {d for leaf in weights for d in leaf.shape} | set(x.shape)

    def f(params, x):
        return loss_with(POLICIES[policy])(eqx.combine(params, static), x)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, params, x)
    found = []
    for line in out.getvalue().splitlines():
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        if "from the argument" in line or (dtype == "f32" and shape in state_shapes):
            continue
        found.append((dtype, shape))
    return sorted(found)


def test_saved_residuals_are_what_each_policy_implies(fp8_mlp):
    model, x = fp8_mlp
    # Saved transposed (`transposed_copies`): activations keep the vmapped axis in front of
    # (features, tokens): (32, features, 1); each kernel is saved as (in, out).
    fp8 = [("f8_e4m3fn", (32, 64, 1)), ("f8_e4m3fn", (32, 256, 1))]
    weights = [("f8_e4m3fn", (256, 64)), ("f8_e4m3fn", (64, 256))]
    # Without remat: the FP8 operands, and what the GELU's derivative needs (float32).
    plain = residuals("none", model, x)
    assert set(fp8 + weights) <= set(plain)
    assert {d for d, _ in plain} == {"f8_e4m3fn", "f32"}
    # nothing_saveable: only the arguments; everything is recomputed in the backward pass.
    assert residuals("nothing_saveable", model, x) == []
    # JAX's dots_saveable sees no dot_general in an FP8 layer (a custom rule): nothing saved,
    # the FP8 GEMMs are recomputed. fp8_dots_saveable keeps their outputs, as dots_saveable
    # keeps a BF16 model's.
    assert residuals("dots_saveable", model, x) == []
    outputs = [("f32", (32, 1, 64)), ("f32", (32, 1, 256))]
    assert residuals("fp8_dots_saveable", model, x) == outputs
    # save_fp8_operands: the FP8 operands and nothing else.
    assert residuals("save_fp8_operands", model, x) == sorted(fp8 + weights)


@pytest.mark.parametrize("policy", ["save_fp8_operands", "fp8_dots_saveable"])
def test_policies_keep_the_routers_choices(policy, getkey):
    """A router's `lax.top_k` runs once, in the forward pass; the backward pass takes its
    choices from the saved residuals instead of recomputing them (a recomputation one rounding
    away could route a token elsewhere: issue 40). JAX's name-only policy recomputes it."""
    experts = fp8jax.GroupedLinear(4, 32, 32, key=getkey())
    experts = fp8jax.fp8_linear_layers(experts, fp8jax.Fp8Config())
    gate = jax.random.normal(getkey(), (32, 4))
    x = jax.random.normal(getkey(), (64, 32))

    def moe(experts, x):
        _, chosen = jax.lax.top_k(x @ gate, 1)
        order = jnp.argsort(chosen[:, 0])
        sizes = jnp.bincount(chosen[:, 0], length=4)
        return jnp.sum(experts(x[order], sizes) ** 2)

    def top_k_count(pol):
        loss = eqx.filter_checkpoint(moe, policy=pol)
        jaxpr = jax.make_jaxpr(eqx.filter_grad(loss))(experts, x)
        return str(jaxpr).count("top_k[")

    assert top_k_count(POLICIES[policy]) == 1
    names_only = jax.checkpoint_policies.save_only_these_names("fp8jax_fp8_operands")
    assert top_k_count(names_only) == 2  # the forward's and the recomputation's
    # The saved residuals include the choices (int32 (64, 1)) and their values.
    params, static = eqx.partition(experts, eqx.is_array)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(
            lambda p, x: eqx.filter_checkpoint(moe, policy=POLICIES[policy])(
                eqx.combine(p, static), x
            ),
            params,
            x,
        )
    assert "i32[64,1]" in out.getvalue()


def test_an_abstract_scanned_model_converts_like_a_concrete_one(getkey):
    """Models of `jax.ShapeDtypeStruct`s (for a deviceless compile of a model too large to
    build) convert with the same structure, shapes and dtypes as the concrete model."""
    config = dataclasses.replace(CONFIG, scan_layers=True)
    concrete = GPT(config, key=getkey())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, concrete
    )
    converted = fp8jax.fp8_linear_layers(concrete)
    shapes = fp8jax.fp8_linear_layers(abstract)
    leaves = [(x.shape, x.dtype) for x in jax.tree.leaves(converted)]
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)] == leaves
    assert isinstance(shapes.blocks.mlp.fc1.weight, jax.ShapeDtypeStruct)
    assert shapes.blocks.mlp.fc1.dot_general.input.scale.shape == (CONFIG.layers,)


def forward_gemms(policy, model, loss, x):
    """How many FP8 GEMM forwards (each quantizing its operands) the gradient of `loss`
    traces, recomputed ones too: calls returning `(out, Residuals)`, as `Gemm.forward`."""
    params, static = eqx.partition(model, eqx.is_array)

    def f(params, x):
        m = eqx.combine(params, static)
        if policy is None:
            return loss(m, x)
        return eqx.filter_checkpoint(loss, policy=policy)(m, x)

    jaxpr = str(jax.make_jaxpr(jax.grad(f))(params, x))
    return jaxpr.count("out_tree=PyTreeDef((*, CustomNode(namedtuple[Residuals]")


def test_save_fp8_operands_recomputes_the_gemms_whose_outputs_the_backward_needs(getkey):
    """What the docs of `save_fp8_operands` promise: the backward pass takes the operands
    of dgrad and wgrad from the saved FP8 copies, but a GEMM whose output it needs (before a
    GELU) runs its forward again from the high-precision input, quantizing it again. Two
    GEMMs in a row (the output of the first is the second's saved FP8 input) run once."""
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(history_len=HISTORY))
    x = jax.random.normal(getkey(), (8, 16))
    c = jax.random.normal(getkey(), (8, 16))

    def chain(model, x):  # Linear -> Linear, the loss linear in the output
        return jnp.sum(jax.vmap(lambda v: model[1](model[0](v)))(x) * c)

    def gelu(model, x):  # Linear -> GELU -> Linear, squared
        return jnp.sum(jax.vmap(lambda v: model[1](jax.nn.gelu(model[0](v))))(x) ** 2)

    linears = [eqx.nn.Linear(16, 16, key=getkey()) for _ in range(2)]
    model = fp8jax.fp8_linear_layers(linears, config)
    layers = len(linears)
    assert forward_gemms(None, model, chain, x) == layers
    assert forward_gemms(fp8jax.save_fp8_operands, model, chain, x) == layers
    nothing = jax.checkpoint_policies.nothing_saveable
    assert forward_gemms(nothing, model, chain, x) == 2 * layers
    # Before a GELU, and squared: both outputs are needed, both forwards run again.
    assert forward_gemms(None, model, gelu, x) == layers
    assert forward_gemms(fp8jax.save_fp8_operands, model, gelu, x) == 2 * layers
    # fp8_dots_saveable keeps the outputs, but the backward quantizes the operands again.
    assert forward_gemms(fp8jax.fp8_dots_saveable, model, chain, x) == 2 * layers
    # Both policies at once: nothing runs again, as without remat.
    both = jax.checkpoint_policies.save_from_both_policies(
        fp8jax.save_fp8_operands, fp8jax.fp8_dots_saveable
    )
    assert forward_gemms(both, model, gelu, x) == layers


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_save_fp8_operands_does_not_run_a_grouped_gemm_again(recipe, getkey):
    """Grouped too: experts then a Linear, the loss linear in the output, run each forward
    once under `save_fp8_operands` (the experts' ran again for their group sizes)."""
    config = fp8jax.Fp8Config(recipe=recipe)
    experts = fp8jax.fp8_linear_layers(fp8jax.GroupedLinear(4, 32, 32, key=getkey()), config)
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=getkey()), config)
    x, c = jax.random.normal(getkey(), (64, 32)), jax.random.normal(getkey(), (64, 32))
    sizes = jnp.array([16, 8, 24, 16])

    def loss(model, x):
        return jnp.sum(jax.vmap(model[1])(model[0](x, sizes)) * c)

    model = (experts, linear)
    assert forward_gemms(None, model, loss, x) == 2
    assert forward_gemms(fp8jax.save_fp8_operands, model, loss, x) == 2
    assert forward_gemms(jax.checkpoint_policies.nothing_saveable, model, loss, x) == 4


@pytest.mark.parametrize("name", ["save_fp8_operands", "fp8_dots_saveable"])
def test_the_remat_policies_show_their_own_name_docstring_and_signature(name):
    """`help(fp8jax.save_fp8_operands)` showed JAX's closure (`policy`, from
    `save_from_both_policies.<locals>`, no docstring, `(prim, *args, **params)`). Each policy
    is named for itself, in fp8jax's module, with its own docstring and a policy's signature."""
    import inspect

    policy = getattr(fp8jax, name)
    assert (policy.__name__, policy.__qualname__) == (name, name)
    assert policy.__module__.startswith("fp8jax.")
    assert policy.__doc__ and "`jax.checkpoint` policy" in policy.__doc__
    params = list(inspect.signature(policy).parameters.values())
    assert [p.kind for p in params] == [
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]
    assert params[0].name == "prim"


def test_fp8_dots_saveable_keeps_what_dots_saveable_keeps_without_fp8(getkey):
    """On a high-precision function `fp8_dots_saveable` is JAX's `dots_saveable`: it keeps
    the outputs of the `dot_general`s, batched ones too, and not a `lax.ragged_dot`'s (the
    module's doc); `save_fp8_operands`, with no FP8 GEMM to name, keeps neither."""
    w, b = jax.random.normal(getkey(), (8, 16)), jax.random.normal(getkey(), (4, 16, 16))
    x, r = jax.random.normal(getkey(), (4, 8)), jax.random.normal(getkey(), (2, 16, 16))

    def f(w, b, x, r):
        h = jax.nn.gelu(x @ w)
        h = jax.nn.gelu(jnp.einsum("bi,bij->bj", h, b))
        h = jax.lax.ragged_dot(h, r, jnp.array([1, 3], jnp.int32))
        return jnp.sum(jnp.sin(h))

    def dots_kept(policy):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(jax.checkpoint(f, policy=policy), w, b, x, r)
        return [line.split(" from ")[0] for line in out.getvalue().splitlines() if "dot" in line]

    want = ["f32[4,16] output of dot_general"] * 2
    assert dots_kept(jax.checkpoint_policies.dots_saveable) == want
    assert dots_kept(fp8jax.fp8_dots_saveable) == want
    assert dots_kept(fp8jax.save_fp8_operands) == []

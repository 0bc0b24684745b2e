"""Flax NNX modules that are Linears without being `nnx.Linear`: a module multiplying its input
by a `kernel` nnx.Param of its own (Hugging Face's FlaxConv1D, `x @ self.kernel[...]`) is
converted by default, its FP8 state kept as an `nnx.Linear`'s, its parameters' paths kept."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import RECIPES

import fp8jax

DIFF = nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State))


def config(recipe=None, **kwargs) -> fp8jax.Fp8Config:
    return fp8jax.Fp8Config(recipe=recipe, exclude=None, keep=(), **kwargs)


class Conv1D(nnx.Module):
    """Hugging Face's FlaxConv1D in NNX: a kernel (features, in), multiplied through
    lax.dot_general, plus a bias."""

    def __init__(self, in_features: int, features: int, rngs: nnx.Rngs):
        self.features = features
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (features, in_features)) * 0.2)
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (features,)) * 0.1)

    def __call__(self, x):
        kernel = self.kernel.get_value()
        y = jax.lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ())))
        return y + self.bias.get_value()


class Net(nnx.Module):
    def __init__(self, layer, rngs: nnx.Rngs):
        self.c_fc = layer(32, 64, rngs=rngs)
        self.c_proj = layer(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.relu(self.c_fc(x)))


def linear_twin(conv: Conv1D) -> nnx.Linear:
    """The same layer as an nnx.Linear: the same weights, the kernel transposed."""
    kernel = conv.kernel.get_value()
    linear = nnx.Linear(kernel.shape[1], kernel.shape[0], rngs=nnx.Rngs(1))
    linear.kernel.set_value(kernel.T)
    linear.bias.set_value(conv.bias.get_value())
    return linear


@nnx.jit
def forward_and_grads(model, x, c):
    def loss(m, x):
        return jnp.sum(m(x) * c)

    grads, grad_x = nnx.grad(loss, argnums=(DIFF, 1))(model, x)
    return model(x), grads, grad_x


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise"])
def test_a_conv1d_matches_the_equivalent_linear_bit_for_bit(name):
    conv = Conv1D(32, 64, nnx.Rngs(0))
    ours = fp8jax.fp8_linear_layers(conv, config(RECIPES[name]))
    theirs = fp8jax.fp8_linear_layers(linear_twin(conv), config(RECIPES[name]))
    assert isinstance(ours, Conv1D) and isinstance(ours.fp8_dot, fp8jax.Fp8NnxDotGeneral)
    assert type(conv) is Conv1D and not hasattr(conv, "fp8_dot")  # the original is kept
    rng = np.random.default_rng(0)
    for step in range(2):  # the second step runs with the state the first one produced
        x = jnp.asarray(rng.standard_normal((2, 16, 32)) * (1 + 4 * step), jnp.float32)
        c = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
        out, grads, grad_x = forward_and_grads(ours, x, c)
        out_l, grads_l, grad_x_l = forward_and_grads(theirs, x, c)
        np.testing.assert_array_equal(out, out_l)
        np.testing.assert_array_equal(grad_x, grad_x_l)
        np.testing.assert_array_equal(grads["kernel"].get_value().T, grads_l["kernel"].get_value())
        np.testing.assert_array_equal(grads["bias"].get_value(), grads_l["bias"].get_value())
        fp8jax.nnx_update_fp8_state(ours, grads)
        fp8jax.nnx_update_fp8_state(theirs, grads_l)
        new, expected = ours.fp8_dot.value(), theirs.dot_general.value()
        assert jax.tree.structure(new) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, b)


class MatMul(nnx.Module):
    """A user's projection: a kernel (in, out) multiplied with `@`."""

    def __init__(self, in_features: int, out_features: int, rngs: nnx.Rngs):
        self.out_features = out_features
        kernel = jax.random.normal(rngs.params(), (in_features, out_features))
        self.kernel = nnx.Param(kernel / np.sqrt(in_features))

    def __call__(self, x):
        return x @ self.kernel.get_value()


class EinsumProjection(nnx.Module):
    """A kernel (out, in) through jnp.einsum, computing in bfloat16."""

    def __init__(self, in_features: int, out_features: int, rngs: nnx.Rngs):
        kernel = jax.random.normal(rngs.params(), (out_features, in_features))
        self.kernel = nnx.Param(kernel / np.sqrt(in_features))

    def __call__(self, x):
        kernel = self.kernel.get_value().astype(jnp.bfloat16)
        return jnp.einsum("...i,oi->...o", x.astype(jnp.bfloat16), kernel).astype(jnp.float32)


class JittedMatMul(MatMul):
    """`MatMul` with its call under `nnx.jit`, as NNX lets a method be jitted."""

    @nnx.jit
    def __call__(self, x):
        return x @ self.kernel.get_value()


def test_a_kernel_module_with_a_jitted_call_converts():
    """A kernel module whose `__call__` is an `nnx.jit`ted method runs in FP8 as the same
    module unjitted does, bit for bit, and its state follows (it failed: its jit wrote into
    the FP8 state's variables from inside the converted call's trace, TraceContextError)."""
    ours = fp8jax.fp8_linear_layers(JittedMatMul(32, 16, nnx.Rngs(0)), config("current"))
    theirs = fp8jax.fp8_linear_layers(MatMul(32, 16, nnx.Rngs(0)), config("current"))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    out, grads, grad_x = forward_and_grads(ours, x, c)
    out_t, grads_t, grad_x_t = forward_and_grads(theirs, x, c)
    np.testing.assert_array_equal(out, out_t)
    np.testing.assert_array_equal(grad_x, grad_x_t)
    np.testing.assert_array_equal(grads["kernel"].get_value(), grads_t["kernel"].get_value())
    fp8jax.nnx_update_fp8_state(ours, grads)
    assert float(ours.fp8_dot.value().input.amax_history[0]) == float(jnp.max(jnp.abs(x)))


class MatMulNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = MatMul(32, 64, rngs)
        self.down = EinsumProjection(64, 32, rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def test_a_matmul_module_trains_with_nnx_train_step():
    model = fp8jax.fp8_linear_layers(MatMulNet(nnx.Rngs(0)), config("delayed"))
    assert sorted(fp8jax.conversion_plan(model, config("delayed")).converted) == ["down", "up"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(nnx.graphdef(model), s)(x))(nnx.state(model)))
    assert jaxpr.count("f8_e4m3fn[32,32]") >= 2  # the GEMMs run in FP8
    y = jnp.tanh(x[:, ::-1])
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
    losses = [float(step(model, optimizer, x, y)) for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0]
    for layer in (model.up, model.down):  # the state followed the gradient
        history = layer.fp8_dot.value().input.amax_history
        assert int(jnp.sum(history > 0)) == 6
    # split/merge and clone keep the FP8 call and state.
    graphdef, state = nnx.split(model)
    merged, cloned = nnx.merge(graphdef, state), nnx.clone(model)
    assert isinstance(cloned.up.fp8_dot, fp8jax.Fp8NnxDotGeneral)
    call = nnx.jit(lambda m: m(x))
    np.testing.assert_array_equal(call(merged), call(model))
    np.testing.assert_array_equal(call(cloned), call(model))


class Embedded(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.wte = nnx.Embed(48, 32, rngs=rngs)
        self.h = Net(Conv1D, rngs)
        self.lm_head = Conv1D(32, 48, rngs)  # width 48: the vocabulary

    def __call__(self, tokens):
        return self.lm_head(self.h(self.wte(tokens)))


def test_the_plan_lists_kernel_modules_and_their_params_keep_their_paths():
    model = Embedded(nnx.Rngs(0))
    plan = fp8jax.conversion_plan(model)
    assert plan.converted == ("h.c_fc", "h.c_proj")
    assert plan.kept["lm_head"].startswith("head")  # roles apply to kernel modules too
    assert {c.kind for c in plan.layers} == {"Conv1D"}
    traced = fp8jax.conversion_plan(model, example=lambda m: m(jnp.arange(8)))
    assert traced.converted == ("h.c_fc", "h.c_proj") and traced.unconverted == ()
    assert fp8jax.conversion_plan(model, fp8jax.Fp8Config(targets=["c_fc"])).converted == (
        "h.c_fc",
    )

    before = nnx.state(model, nnx.Param)
    converted = fp8jax.fp8_linear_layers(model)
    after = nnx.state(converted, nnx.Param)
    assert [p for p, _ in nnx.to_flat_state(before)] == [p for p, _ in nnx.to_flat_state(after)]
    assert not hasattr(converted.lm_head, "fp8_dot")
    assert fp8jax.conversion_plan(converted).converted == ("h.c_fc", "h.c_proj")
    again = fp8jax.fp8_linear_layers(converted)  # converting twice changes nothing
    assert jax.tree.structure(nnx.state(again)) == jax.tree.structure(nnx.state(converted))
    assert type(again.h.c_fc) is type(converted.h.c_fc)


def test_a_kernel_module_gets_the_recipe_its_path_is_given():
    """`Fp8Config(recipes={path: ...})` reaches a kernel module as it does an nnx.Linear:
    the recipe named for `h.c_fc`, the default for `h.c_proj`."""
    cfg = fp8jax.Fp8Config(recipes={"c_fc": "current"})
    model = fp8jax.fp8_linear_layers(Embedded(nnx.Rngs(0)), cfg)
    recipes = [type(m.fp8_dot.recipe) for m in (model.h.c_fc, model.h.c_proj)]
    assert recipes == [fp8jax.CurrentScaling, fp8jax.DelayedScaling]


class DropProjection(nnx.Module):
    """A kernel module with children: dropout (its RNG count advances in the call) and a
    Linear (converted in its own right)."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.2)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.fc = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.drop(x @ self.kernel.get_value()))


def test_a_kernel_modules_call_writes_back_its_variables_and_runs_its_children():
    model = fp8jax.fp8_linear_layers(DropProjection(nnx.Rngs(0)), config("current"))
    assert fp8jax.conversion_plan(model, config()).converted == ("(root)", "fc")
    assert isinstance(model.fc.dot_general, fp8jax.Fp8NnxDotGeneral)
    call = nnx.jit(lambda m, x: m(x))
    x = jnp.ones((4, 32))
    assert not np.array_equal(call(model, x), call(model, x))  # a new dropout mask each call


class WithChild(nnx.Module):
    """A kernel module whose child Linear has a `kernel` too."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.2)
        self.fc = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return x @ self.kernel.get_value(), self.fc(x)


def test_only_the_modules_own_kernel_gemm_is_fp8_not_a_childs():
    """Only the GEMM on the module's own `kernel` is answered in FP8: its child's `kernel`
    (an excluded Linear) is another parameter, whose GEMM runs as unconverted, bit for bit."""
    model = WithChild(nnx.Rngs(0))
    cfg = fp8jax.Fp8Config(exclude="fc", keep=())
    converted = fp8jax.fp8_linear_layers(model, cfg)
    assert fp8jax.conversion_plan(model, cfg).converted == ("(root)",)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32)), jnp.float32)
    own, child = converted(x)
    np.testing.assert_array_equal(child, model.fc(x))
    assert not np.array_equal(own, x @ model.kernel.get_value())  # FP8, not the float32 GEMM


class DropAtCall(nnx.Module):
    """A kernel module whose dropout draws from an `nnx.Rngs` passed to its call."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.2)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
        return self.drop(x @ self.kernel.get_value(), rngs=rngs)


def test_a_kernel_modules_call_advances_an_rngs_passed_to_it():
    """An `nnx.Rngs` passed to a kernel module's call advances as NNX's call advances it, so
    each call draws a new dropout mask, the one the module draws unconverted (its count was
    lost: the same mask every call)."""
    model = DropAtCall(nnx.Rngs(0))
    converted = fp8jax.fp8_linear_layers(model, config("current"))
    x = jnp.ones((4, 32))
    ours, theirs = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
    for _ in range(2):
        out, reference = converted(x, ours), model(x, theirs)
        np.testing.assert_array_equal(out == 0, reference == 0)
    assert int(ours.dropout.count.get_value()) == int(theirs.dropout.count.get_value()) == 2


class Tally(nnx.Object):
    """Plain Python attributes (no Variables) that a call rebinds: no pytree (static)."""

    def __init__(self):
        self.calls = 0


class TallyModule(nnx.Module):
    """The same as a module: a pytree, rebuilt when flattened."""

    def __init__(self):
        self.calls = 0


class Counting(nnx.Module):
    """A kernel module whose call rebinds plain attributes: its own, a child's, and those of
    an NNX object passed to it, as plain NNX lets a call do, eagerly and under nnx.jit."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.2)
        self.calls = 0
        self.tally = Tally()

    def __call__(self, x, seen):
        self.calls += 1
        self.tally.calls += 2
        seen.calls += 3
        return x @ self.kernel.get_value()


@pytest.mark.parametrize("tally", [Tally, TallyModule])
@pytest.mark.parametrize("jit", [False, True])
def test_a_kernel_modules_call_rebinds_plain_attributes_as_nnx_does(jit, tally):
    """The call ran on a copy of the module inside a trace: the module's and its child's
    rebound attributes were lost (0 calls), and an NNX object passed to it raised
    TraceContextError (no pytree) or lost them (a pytree). The reference is the unconverted
    module, called the same way."""
    x = jnp.ones((2, 8))
    counts = []
    for convert in (False, True):
        model, seen = Counting(nnx.Rngs(0)), tally()
        if convert:
            model = fp8jax.fp8_linear_layers(model, config("current"))
        call = nnx.jit(lambda m, x, s: m(x, s)) if jit else (lambda m, x, s: m(x, s))
        call(model, x, seen)
        call(model, x, seen)
        counts.append((model.calls, model.tally.calls, seen.calls))
    assert counts[1] == counts[0]


class KeepsLast(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.2)

    def __call__(self, x):
        self.last = nnx.data(jnp.sum(x))
        return x @ self.kernel.get_value()


def test_a_kernel_modules_call_setting_an_array_attribute_is_refused_by_name():
    """An array attribute the call creates (not a Variable) cannot leave the trace: refused
    with the module and the attribute named (was: 'zip() argument 2 is longer')."""
    model = fp8jax.fp8_linear_layers(KeepsLast(nnx.Rngs(0)), config("current"))
    with pytest.raises(ValueError, match=r"KeepsLast '\(root\)'.*attribute 'last'.*nnx.Variable"):
        model(jnp.ones((2, 8)))


class GatedLinear(nnx.Linear):
    """An nnx.Linear subclass whose call of its own multiplies by its kernel without its
    `dot_general`."""

    def __call__(self, x):
        return jnp.tanh(x @ self.kernel.get_value() + self.bias.get_value())


class Gated(nnx.Module):
    """`GatedLinear`'s call in a module of its own: a kernel module."""

    def __init__(self, linear: nnx.Linear):
        self.kernel = nnx.Param(linear.kernel.get_value())
        self.bias = nnx.Param(linear.bias.get_value())

    def __call__(self, x):
        return jnp.tanh(x @ self.kernel.get_value() + self.bias.get_value())


def test_a_linear_subclass_with_a_call_of_its_own_runs_its_kernel_gemm_in_fp8():
    """An nnx.Linear subclass with a `__call__` of its own, which may never call its
    `dot_general`, converts as a kernel module (its call traced), as the Linen path does:
    the same output and gradients as the same call in a module of its own, its state
    following (it was given an FP8 `dot_general` its call never ran, planned FP8 and in
    high precision, its amax staying 0)."""
    layer = GatedLinear(32, 16, rngs=nnx.Rngs(0))
    ours = fp8jax.fp8_linear_layers(layer, config("current"))
    theirs = fp8jax.fp8_linear_layers(Gated(layer), config("current"))
    assert fp8jax.conversion_plan(layer, config()).converted == ("(root)",)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    out, grads, grad_x = forward_and_grads(ours, x, c)
    out_t, grads_t, grad_x_t = forward_and_grads(theirs, x, c)
    np.testing.assert_array_equal(out, out_t)
    np.testing.assert_array_equal(grad_x, grad_x_t)
    np.testing.assert_array_equal(grads["kernel"].get_value(), grads_t["kernel"].get_value())
    fp8jax.nnx_update_fp8_state(ours, grads)
    assert float(ours.fp8_dot.value().input.amax_history[0]) == float(jnp.max(jnp.abs(x)))


class Scale(nnx.Module):
    """A `kernel` used elementwise: no GEMM."""

    def __init__(self, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (4, 8)))

    def __call__(self, x):
        return x * self.kernel.get_value()


def test_converting_again_with_example_finds_a_kernel_modules_role():
    """The trace of a converted model runs a kernel module's own call in high precision, so a
    Conv1D head converted before (keep=()) is found as the head, as before its conversion."""
    model, x = Net(Conv1D, nnx.Rngs(0)), jnp.ones((2, 32))
    example = lambda m: m(x)  # noqa: E731
    reference = fp8jax.conversion_plan(model, example=example)
    assert reference.kept["c_proj"].startswith("head: ")
    once = fp8jax.fp8_linear_layers(model, config(), example=example)
    plan = fp8jax.conversion_plan(once, example=example)
    assert plan.converted == ("c_fc", "c_proj")
    says = f"c_proj (DelayedScaling; the config: high precision, {reference.kept['c_proj']})"
    assert plan.kept_as_converted == (says,)
    assert type(once.c_proj).__name__ == "Fp8Conv1D"  # the trace used a copy
    np.testing.assert_array_equal(once(x), fp8jax.fp8_linear_layers(model, config())(x))


def test_a_kernel_used_without_a_gemm_is_refused_when_called():
    model = fp8jax.fp8_linear_layers(Scale(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"Scale '\(root\)' holds a 'kernel'.*no GEMM.*Exclude it"):
        model(jnp.ones((4, 8)))


def test_a_recipe_needing_the_kernel_shape_is_refused():
    with pytest.raises(ValueError, match=r"Conv1D 'c_fc'.*only its call tells.*Fp8Config recipes"):
        fp8jax.fp8_linear_layers(
            Net(Conv1D, nnx.Rngs(0)), config(RECIPES["residual error feedback"])
        )


class WithConv(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(4, 8, (3,), rngs=rngs)
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.conv(x))


def test_nnx_conv_is_not_converted():
    model = WithConv(nnx.Rngs(0))
    assert fp8jax.conversion_plan(model, config()).converted == ("fc",)
    converted = fp8jax.fp8_linear_layers(model, config())
    assert type(converted.conv) is nnx.Conv and not hasattr(converted.conv, "fp8_dot")
    np.testing.assert_array_equal(
        converted.conv(jnp.ones((2, 5, 4))), model.conv(jnp.ones((2, 5, 4)))
    )


class StackedConv1D(nnx.Module):
    """Conv1D layers built under nnx.vmap (a kernel (layers, features, in)), applied with
    nnx.scan, then an nnx.Linear."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Conv1D(16, 16, rngs=rngs)

        self.blocks = make(rngs)
        self.fc = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.fc(body(x, self.blocks))


def test_a_stack_of_kernel_modules_stays_in_high_precision_named_with_what_to_do():
    """A stack of kernel modules built under nnx.vmap is not converted; with `example` the
    trace names it, and the advice was to "multiply by a `kernel` nnx.Param of the module's
    own", which it does. It now says the kernel is a stack and what converts per layer."""
    model = StackedConv1D(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)
    plan = fp8jax.conversion_plan(model, config(), example=lambda m: m(x))
    assert plan.converted == ("fc",)
    (unconverted,) = plan.unconverted
    assert unconverted.startswith("blocks (its `kernel` of shape (3, 16, 16) is a stack of")
    assert "build the stacked layers from nnx.Linear" in unconverted
    assert "multiply by a `kernel` nnx.Param" not in unconverted
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"blocks \(its `kernel` of shape"):
        converted = fp8jax.fp8_linear_layers(model, config(), example=lambda m: m(x))
    assert type(converted.blocks) is Conv1D
    # It runs as it was, in high precision: the float64 product, layer by layer.
    expected = np.asarray(x, np.float64)
    kernels, biases = model.blocks.kernel.get_value(), model.blocks.bias.get_value()
    for kernel, bias in zip(np.asarray(kernels, np.float64), np.asarray(biases), strict=True):
        expected = expected @ kernel.T + bias
    np.testing.assert_allclose(converted.blocks.kernel.get_value(), kernels)
    blocks = nnx.scan(lambda x, block: (block(x), None), in_axes=(nnx.Carry, 0))
    np.testing.assert_allclose(blocks(x, converted.blocks)[0], expected, rtol=1e-5, atol=1e-5)


def test_a_stack_of_kernel_modules_is_named_without_example_too():
    """Without `example`, a stack of kernel modules (nnx.vmap) was left in high precision
    silently: no warning, an empty `unconverted`. It is named, with why (no trace tells
    what it does with its kernel) and what to pass, as the conversion with `example` does."""
    model = StackedConv1D(nnx.Rngs(0))
    plan = fp8jax.conversion_plan(model, config())
    assert plan.converted == ("fc",)
    (unconverted,) = plan.unconverted
    assert unconverted.startswith("blocks (its `kernel` of shape (3, 16, 16) is a stack of")
    assert "pass example=" in unconverted
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"blocks \(its `kernel`.*example="):
        converted = fp8jax.fp8_linear_layers(model, config())
    assert type(converted.blocks) is Conv1D

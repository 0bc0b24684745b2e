"""Bad input gets an error naming the value and what would be accepted."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8jax

MATMUL = (((1,), (0,)), ((), ()))


@pytest.fixture
def dot():
    return fp8jax.Fp8DotGeneral()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
def test_integer_inputs(dot, dtype):
    with pytest.raises(TypeError, match=rf"lhs has dtype {jnp.dtype(dtype)}.*floating"):
        dot(jnp.ones((2, 3), dtype), jnp.ones((3, 4)), MATMUL)
    with pytest.raises(TypeError, match=rf"rhs has dtype {jnp.dtype(dtype)}"):
        dot(jnp.ones((2, 3)), jnp.ones((3, 4), dtype), MATMUL)


def test_already_fp8_inputs(dot):
    with pytest.raises(TypeError, match="already float8_e4m3fn"):
        dot(jnp.ones((2, 3), jnp.float8_e4m3fn), jnp.ones((3, 4)), MATMUL)


def test_integer_preferred_element_type(dot):
    with pytest.raises(TypeError, match="preferred_element_type=int32"):
        dot(jnp.ones((2, 3)), jnp.ones((3, 4)), MATMUL, preferred_element_type=jnp.int32)


def test_mismatched_shapes(dot):
    with pytest.raises(ValueError, match=r"lhs \(2, 3\) axis 1 has size 3 but rhs \(5, 4\)"):
        dot(jnp.ones((2, 3)), jnp.ones((5, 4)), MATMUL)


@pytest.mark.parametrize(
    "dims, match",
    [
        ((((2,), (0,)), ((), ())), r"axes \(2,\) must be distinct and within range"),
        ((((0, 0), (0, 1)), ((), ())), "must be distinct"),
        ((((1,), (0,)), ((0,), ())), "1 lhs batch axes but 0 rhs batch axes"),
        ("matmul", "should be"),
    ],
)
def test_bad_dimension_numbers(dot, dims, match):
    with pytest.raises(ValueError, match=match):
        dot(jnp.ones((2, 3)), jnp.ones((3, 3)), dims)


_BAD_GEMMS = {
    "contracting sizes": ("dot", (2, 3), (5, 4), MATMUL),
    "batch sizes": ("dot", (2, 4, 8), (3, 8, 16), (((2,), (1,)), ((0,), (0,)))),
    "axis out of range": ("dot", (2, 3), (3, 4), (((2,), (0,)), ((), ()))),
    "ragged features": ("ragged", (8, 16), (4, 12, 32), (4,)),
    "ragged expert count": ("ragged", (8, 16), (3, 16, 32), (4,)),
    "ragged group_sizes rank": ("ragged", (8, 16), (4, 16, 32), (1, 4)),
    "ragged lhs rank": ("ragged", (2, 8, 16), (4, 16, 32), (4,)),
}


@pytest.mark.parametrize("case", sorted(_BAD_GEMMS))
def test_bad_shapes_raise_what_lax_raises(case):
    """The drop-ins raised only ValueError for operands lax refuses with TypeError, so code
    catching lax's error missed theirs; `OperandShapeError` is both (ValueError as before)."""
    kind, lhs_shape, rhs_shape, extra = _BAD_GEMMS[case]
    lhs, rhs = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    if kind == "dot":
        calls = (jax.lax.dot_general, fp8jax.Fp8DotGeneral())
        args = (lhs, rhs, extra)
    else:
        calls = (jax.lax.ragged_dot, fp8jax.Fp8RaggedDot(num_experts=rhs_shape[0]))
        args = (lhs, rhs, jnp.full(extra, 2, jnp.int32))
    with pytest.raises(Exception) as from_lax:
        calls[0](*args)
    with pytest.raises(fp8jax.OperandShapeError) as ours:
        calls[1](*args)
    assert isinstance(ours.value, type(from_lax.value)), (from_lax.value, ours.value)
    assert isinstance(ours.value, ValueError)


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_derivatives_of_gradients_say_they_are_not_defined(recipe):
    """`jax.hessian` once ended in a bare AssertionError inside the forward, a gradient of a
    gradient in JAX's "Linearization failed"; both now say what is supported. Forward mode
    keeps JAX's own message, which names custom_vjp."""
    d = fp8jax.Fp8DotGeneral(recipe)
    w = jnp.ones((8, 4))

    def f(x):
        return jnp.sum(d(x, w, MATMUL) ** 2)

    x = jnp.ones((2, 8))
    jax.grad(f)(x)  # one reverse-mode derivative: fine
    for derivative in (jax.hessian(f), jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))):
        with pytest.raises(TypeError, match=r"have one reverse-mode derivative .*\(jax.hessian"):
            derivative(x)
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(f, (x,), (x,))


@pytest.mark.parametrize("derivative", ["hessian", "grad of grad"])
def test_derivatives_of_gradients_under_vmap_say_so_too(derivative):
    """Under `jax.vmap` (how an Equinox model meets a batch) the forward rule's operands are
    `vmap`'s tracers around the outer derivative's: `jax.hessian` ended in a bare
    AssertionError and a gradient of a gradient in JAX's "Linearization failed", not the
    TypeError docs/faq.md promises."""
    d = fp8jax.Fp8DotGeneral("current")
    w = jnp.ones((8, 4))

    def f(x):
        return jnp.sum(jax.vmap(lambda row: d(row, w, (((0,), (0,)), ((), ()))))(x) ** 2)

    x = jnp.ones((2, 8))
    jax.grad(f)(x)  # one reverse-mode derivative: fine
    twice = {"hessian": jax.hessian(f), "grad of grad": jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))}
    with pytest.raises(TypeError, match=r"have one reverse-mode derivative .*\(jax.hessian"):
        twice[derivative](x)


@pytest.mark.parametrize("derivative", ["hessian", "grad of grad"])
@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "scan"])
def test_derivatives_of_gradients_of_traced_functions_say_so_too(wrap, derivative):
    """A loss under `jax.jit` (or `jax.checkpoint`, `lax.scan`) is traced before the outer
    derivative reaches it, so the forward rule never saw its tracers: `jax.hessian` ended in
    a bare AssertionError (inside JAX's custom_vmap) and a gradient of a gradient in
    "Linearization failed"; the forward's operands now pass an identity whose derivative
    raises the TypeError docs/faq.md promises."""
    d = fp8jax.Fp8DotGeneral("current")
    w = jnp.ones((8, 4))

    def loss(x):
        return jnp.sum(d(x, w, MATMUL) ** 2)

    f = {
        "jit": jax.jit(loss),
        "checkpoint": jax.checkpoint(loss),
        "scan": lambda x: lax.scan(lambda c, _: (c + loss(x), None), 0.0, length=2)[0],
    }[wrap]
    x = jnp.ones((2, 8))
    jax.grad(f)(x)  # one reverse-mode derivative: fine
    twice = {"hessian": jax.hessian(f), "grad of grad": jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))}
    with pytest.raises(TypeError, match=r"have one reverse-mode derivative .*\(jax.hessian"):
        twice[derivative](x)


def test_forward_mode_raises_as_the_faq_says(getkey):
    """Forward mode through an FP8 GEMM raises as docs/faq.md says: JAX's TypeError naming
    custom_vjp (`jax.jvp`, `jax.jacfwd`, `jax.linearize`'s linear function), except that a
    converted Linear of the default (delayed, stateful) recipe differentiated in its input
    alone raises StateNotDifferentiatedError first, saying reverse mode only."""
    x = jnp.ones((2, 8))
    d = fp8jax.Fp8DotGeneral("current")
    w = jnp.ones((8, 4))
    forward = "can't apply forward-mode autodiff"
    with pytest.raises(TypeError, match=forward):
        jax.jacfwd(lambda x: d(x, w, MATMUL))(x)
    _, tangent = jax.linearize(lambda x: d(x, w, MATMUL), x)
    with pytest.raises(TypeError, match=forward):
        tangent(x)
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=getkey()), fp8jax.Fp8Config(keep=()))
    assert isinstance(linear.dot_general.recipe, fp8jax.DelayedScaling)
    for derivative in (lambda: jax.jvp(linear, (x[0],), (x[0],)), lambda: jax.jacfwd(linear)(x[0])):
        with pytest.raises(
            fp8jax.StateNotDifferentiatedError, match="reverse-mode derivatives only"
        ):
            derivative()
    params, static = eqx.partition(linear, eqx.is_inexact_array)
    with pytest.raises(TypeError, match=forward):  # the state differentiated too
        jax.jacfwd(lambda p: eqx.combine(p, static)(x[0]))(params)


def test_unknown_recipe_and_format():
    with pytest.raises(ValueError, match=r"Unknown recipe 'tensorwise'.*'current', 'delayed'"):
        fp8jax.Fp8DotGeneral("tensorwise")
    with pytest.raises(ValueError, match=r"Unknown FP8 format 'e2m1'"):
        fp8jax.DelayedScaling(backward_format="e2m1")


def test_linear_shape_errors(getkey):
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 3, key=getkey()))
    with pytest.raises(ValueError, match=r"expects x of shape \(\.\.\., 4\); got \(5,\)"):
        linear(jnp.ones(5))
    with pytest.raises(ValueError, match=r"bias has shape \(2,\); should be \(3,\)"):
        fp8jax.Linear(jnp.ones((3, 4)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"weight has shape \(4,\)"):
        fp8jax.Linear(jnp.ones(4), None)


def test_apply_updates_rejects_misplaced_overwrites(getkey):
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 3, key=getkey()))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4))))(linear)
    _, rest = fp8jax.partition_for_grad_overwrite(grads)
    with pytest.raises(ValueError, match="partition_for_grad_overwrite"):
        fp8jax.apply_updates(linear, rest, jax.tree.map(jnp.zeros_like, rest))


def test_the_overwrite_marker_is_abstract_and_its_subclasses_are_made():
    with pytest.raises(TypeError, match="abstract marker"):
        fp8jax.OverwriteWithGradient()

    class State(fp8jax.OverwriteWithGradient):
        value: jax.Array = eqx.field(default_factory=lambda: jnp.zeros(()))

    state = State()
    assert fp8jax.partition_for_grad_overwrite({"s": state})[0]["s"] is state
    # The default merge takes the received value: apply_updates writes it in.
    tree = {"s": state, "w": jnp.ones(2)}
    got = fp8jax.apply_updates(
        tree, {"s": None, "w": jnp.ones(2)}, {"s": State(jnp.float32(5.0)), "w": None}
    )
    assert float(got["s"].value) == 5.0
    np.testing.assert_array_equal(got["w"], [2.0, 2.0])


def test_a_subclass_s_state_read_in_the_loss_gets_an_error_naming_the_way_to_read_it():
    """Inside fp8jax's gradients an `OverwriteWithGradient`'s arrays are in the max-combining
    dtype: summing one failed with the message for a static slice of stacked layers. The
    error names this case too, and the reading it suggests gives Equinox's gradients."""

    class Temperature(fp8jax.OverwriteWithGradient):
        value: jax.Array

        def merge(self, new):
            return self  # moved by hand, never by the gradient

    tree = {"t": Temperature(jnp.full((2,), 2.0)), "w": jnp.arange(3.0)}

    def summed(tree):
        return jnp.sum(tree["w"] ** 2) * jnp.sum(tree["t"].value)

    with pytest.raises(TypeError, match=r"OverwriteWithGradient of your own") as error:
        fp8jax.filter_grad(summed)(tree)
    assert "jax.lax.stop_gradient(x.astype(jnp.float32))" in str(error.value)

    def read(tree):
        t = jax.lax.stop_gradient(tree["t"].value.astype(jnp.float32))
        return jnp.sum(tree["w"] ** 2) * jnp.sum(t)

    got = fp8jax.filter_grad(read)(tree)
    want = eqx.filter_grad(read)(tree)
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["w"], 2 * np.arange(3.0) * 4.0)  # d/dw sum(w^2) * 4
    updated = fp8jax.apply_updates(tree, None, fp8jax.partition_for_grad_overwrite(got)[0])
    assert updated["t"] is tree["t"]  # its merge keeps it


@pytest.mark.parametrize(
    "recipe, says, not_said",
    [
        (
            fp8jax.DelayedScaling(),
            r"Its scales and amax history would stay as they are forever",
            "error feedback",
        ),
        (fp8jax.ResidualFP8(error_feedback=True), r"Its error feedback would stay zero", "amax"),
    ],
)
def test_a_layer_differentiated_without_its_state_says_what_its_recipe_would_lose(
    recipe, says, not_said, getkey
):
    """The error names the recipe's own loss: an error feedback that never moves is not a
    delayed scale that never moves."""
    model = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(16, 8, key=getkey()), fp8jax.Fp8Config(recipe=recipe, exclude=None)
    )
    spec = eqx.tree_at(lambda m: m.weight, jax.tree.map(lambda _: False, model), True)
    weights, rest = eqx.partition(model, spec)
    x = jnp.ones((4, 16))

    def loss(weights, rest):
        return jnp.sum(jax.vmap(eqx.combine(weights, rest))(x))

    with pytest.raises(fp8jax.StateNotDifferentiatedError, match=says) as error:
        jax.grad(loss)(weights, rest)
    assert not_said not in str(error.value)


def test_a_state_built_from_float64_values_is_named_as_such():
    """A TensorState built by hand from NumPy's float64 values was refused as "a cast of the
    whole model or variables reached it", naming a cause the user never had."""
    dot = fp8jax.Fp8DotGeneral("delayed")
    state = fp8jax.TensorState(np.float64(2.0), np.zeros(16))
    dot = eqx.tree_at(lambda d: d.input, dot, state)
    with pytest.raises(TypeError, match=r"\(input\) is float64.*NumPy's float64 values"):
        dot(jnp.ones((2, 3)), jnp.ones((3, 4)), MATMUL)

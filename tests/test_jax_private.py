"""The JAX internals fp8jax relies on (fp8jax/_src/jax_private.py). A failure here means JAX
moved them: fix that module, not the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp8jax._src.core import jax_primitive, jax_private
from fp8jax._src.observe import deviceless


@jax.custom_vjp
def _record(x, state):
    return x


def _record_fwd(x, state):
    return x, jnp.max(jnp.abs(x))


def _record_bwd(amax, g):
    return g, jax_private.to_max_combining(amax)


_record.defvjp(_record_fwd, _record_bwd)


def test_cotangents_combine_by_max():
    def loss(state, xs):
        state = jax_private.to_max_combining(state)
        direct = jnp.sum(_record(xs[0], state)) + jnp.sum(_record(xs[1], state))

        def body(total, x):
            return total + jnp.sum(_record(x, state)), None

        return direct + lax.scan(body, 0.0, xs[2:])[0]

    xs = jnp.array([[1.0, -3.0], [2.0, 0.5], [-7.0, 1.0], [0.0, 4.0]])
    grad = jax.jit(jax.grad(loss))(jnp.float32(0.0), xs)
    assert grad.dtype == jnp.float32 and float(grad) == 7.0


def test_round_trip_and_zero():
    x = jnp.array([0.0, 2.5, 1e30], jnp.float32)

    @jax.jit
    def round_trip(x):
        m = jax_private.to_max_combining(x)
        assert jax_private.is_max_combining(m) and not jax_private.is_max_combining(x)
        zero = jax_private.MAX_F32._rules.zero(jax_private.MAX_F32)
        return jax_private.to_float32(m), jax_private.to_float32(zero)

    back, zero = round_trip(x)
    assert (back == x).all() and float(zero) == float("-inf")


def test_batch_tracer_is_recognised():
    seen = []
    jax.vmap(lambda x: seen.append(jax_private.is_batch_tracer(x)) or x)(jnp.ones(3))
    jax.jit(lambda x: seen.append(jax_private.is_batch_tracer(x)) or x)(jnp.ones(3))
    assert seen == [True, False]
    assert not jax_private.is_batch_tracer(jnp.ones(3))


def test_a_ragged_dot_primitive_is_lax_s_with_the_rules_it_is_given():
    """`jax_primitive.ragged_dot_primitive`: evaluated, jitted (the same program) and its JVP
    as `lax.ragged_dot`; its `vmap` and transposition call the rules given, with the mapped
    operands' axis first and the unknown operand's shape."""
    dims = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
    seen = []

    def batch(size, in_batched, lhs, rhs, sizes, numbers, precision, dtype):
        seen.append(("batch", size, tuple(in_batched), lhs.shape))
        return jnp.stack([dot(a, rhs, sizes, numbers, precision, dtype) for a in lhs]), True

    def transpose(ct, known, lhs_unknown, spec, sizes, numbers, precision, dtype):
        seen.append(("transpose", lhs_unknown, spec.shape, known.shape))
        return jnp.zeros(spec.shape, spec.dtype)

    dot = jax_primitive.ragged_dot_primitive("test_ragged_dot", batch, transpose)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    sizes = jnp.array([3, 2], jnp.int32)

    def ours(x, w):
        return dot(x, w, sizes, dims, None, jnp.float32)

    def lax_s(x, w):
        return lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)

    np.testing.assert_array_equal(ours(x, w), lax_s(x, w))
    assert (
        jax.jit(ours).lower(x, w).as_text().split("\n")[1:]
        == (jax.jit(lax_s).lower(x, w).as_text().split("\n")[1:])
    )
    tangents = (jnp.cos(x), jnp.sin(w))
    for got, want in zip(
        jax.jvp(ours, (x, w), tangents), jax.jvp(lax_s, (x, w), tangents), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    mapped = jax.vmap(ours, (1, None))(jnp.stack([x, 2 * x], 1), w)
    np.testing.assert_array_equal(mapped, [lax_s(x, w), lax_s(2 * x, w)])
    jax.grad(lambda w: jnp.sum(ours(x, w)))(w)
    assert seen == [
        ("batch", 2, (True, False, False), (2, 5, 3)),
        ("transpose", False, w.shape, x.shape),
    ]


def test_varying_axes_inside_shard_map():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    seen = []

    def local(replicated, sharded):
        seen.append((jax_private.varying_axes(replicated), jax_private.varying_axes(sharded)))
        return replicated

    jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(
        jnp.ones(3), jnp.ones(16)
    )
    assert seen == [(frozenset(), frozenset({"data"}))]
    assert jax_private.varying_axes(jnp.ones(3)) == frozenset()


def test_an_eager_shard_map_is_recognised():
    """Where a custom_vjp reaches an eager `shard_map`'s trace: in its body and under a `vmap`
    there; not under `jit`, nor under a gradient (in the body or of the `shard_map`)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    seen = []

    def local(x):
        seen.append(jax_private.eager_shard_map())
        return x

    f = jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    x = jnp.ones(16)
    f(x)
    jax.shard_map(jax.vmap(local), mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
    jax.jit(f)(x)
    jax.grad(lambda x: f(x).sum())(x)
    g = jax.shard_map(
        jax.grad(lambda x: local(x).sum()), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    g(x)
    local(x)
    assert seen == [True, True, False, False, False, False]


def test_differentiation_trace_is_recognised():
    seen = []

    def f(x, y):
        seen.append((jax_private.differentiation_trace(x), jax_private.differentiation_trace(y)))
        return x * y

    jax.grad(f)(1.0, 2.0)
    jax.jit(jax.grad(f))(1.0, 2.0)
    jax.jit(f)(1.0, 2.0)
    (a, b), (c, d), (e, g) = seen
    assert a is not None and b is None  # only x is differentiated
    assert c is not None and d is None
    assert e is None and g is None  # jit alone
    assert jax_private.differentiation_trace(jnp.ones(2)) is None


def test_gradient_under_vmap_tells_vmap_of_grad_from_grad_of_vmap():
    seen = []

    def f(w, x):
        seen.append(jax_private.gradient_under_vmap() is not None)
        return jnp.sum(x * w)

    w, xs = jnp.ones(3), jnp.ones((2, 3))
    jax.vmap(jax.grad(f), in_axes=(None, 0))(w, xs)  # per-example gradients
    jax.vmap(jax.jit(jax.grad(jax.checkpoint(f))), in_axes=(None, 0))(w, xs)  # through jaxprs
    jax.grad(lambda w: jnp.sum(jax.vmap(f, in_axes=(None, 0))(w, xs)))(w)  # a batch in the loss
    jax.vmap(f, in_axes=(None, 0))(w, xs)
    jax.grad(f)(w, xs[0])
    f(w, xs[0])
    assert seen == [True, True, False, False, False, False]


@pytest.mark.parametrize(
    "index",
    [lambda a: a[0], lambda a: jnp.take(a, jnp.array([0]), axis=0)[0]],
    ids=["slice", "take"],
)
def test_static_slices_of_max_combining_state_raise_what_grad_recognises(index):
    """filter_value_and_grad explains JAX's errors for static slices of FP8 state in its own
    words, and only those errors."""
    import equinox as eqx

    import fp8jax
    from fp8jax._src.train.grad import is_static_slice_error

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    stacked = fp8jax.fp8_linear_layers(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(keys))

    def loss(model, x):
        first = jax.tree.map(lambda a: index(a) if eqx.is_array(a) else a, model)
        return jnp.sum(first(x))

    with pytest.raises(TypeError, match="static slice") as error:
        fp8jax.filter_grad(loss)(stacked, jnp.ones((2, 4)))
    assert is_static_slice_error(error.value.__cause__), error.value.__cause__
    assert not is_static_slice_error(ValueError("max_f32 state mixes dtypes"))


def test_tracing_is_recognised():
    seen = []
    assert not jax_private.tracing()
    jax.jit(lambda a: seen.append(jax_private.tracing()) or a)(1.0)
    jax.vmap(lambda a: seen.append(jax_private.tracing()) or a)(jnp.ones(2))
    jax.grad(lambda a: seen.append(jax_private.tracing()) or a)(1.0)
    assert seen == [True, True, True]


def test_a_jaxpr_is_reinterpreted_equation_by_equation():
    """What fp8_autocast takes from JAX: literals, binding an equation (sub-jaxprs included),
    its source context (name scopes) and the jaxprs in its parameters."""

    def f(x):
        with jax.named_scope("outer"):
            y = jnp.sin(x) * 2.0
        return jax.lax.scan(lambda c, _: (c @ c, None), y, None, length=2)[0]

    x = jnp.eye(3) * 0.5
    closed = jax.make_jaxpr(f)(x)
    eqns = closed.jaxpr.eqns
    assert [jax_private.scope_of(e) for e in eqns[:2]] == ["outer", "outer"]
    mul = next(e for e in eqns if e.primitive.name == "mul")
    assert any(jax_private.is_literal(v) for v in mul.invars)
    scan = next(e for e in eqns if e.primitive.name == "scan")
    assert jax_private.scan_counts(scan.params) == (0, 1)
    w = jnp.ones((3, 3))
    two = jax.make_jaxpr(
        lambda x: jax.lax.scan(lambda c, _: ((c[0] @ w, c[1] + 1), None), (x, x), None, length=2)
    )(x)
    assert jax_private.scan_counts(two.jaxpr.eqns[0].params) == (1, 2)  # w, then the carry
    (body,) = jax_private.sub_jaxprs(scan)
    assert [e.primitive.name for e in getattr(body, "jaxpr", body).eqns] == ["dot_general"]
    env = {closed.jaxpr.invars[0]: x}
    for eqn in eqns:
        invals = [v.val if jax_private.is_literal(v) else env[v] for v in eqn.invars]
        with jax_private.equation_context(eqn):
            outs = jax_private.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    np.testing.assert_array_equal(env[closed.jaxpr.outvars[0]], f(x))

    # Under jit the scopes reach the compiled program's op names.
    def rebound(x):
        with jax_private.equation_context(eqns[0]):
            return jax_private.bind_equation(eqns[0], [x])[0]

    assert "outer/sin" in jax.jit(rebound).lower(x).as_text(debug_info=True)


@pytest.mark.skipif(deviceless.h100_topology() is None, reason="no CUDA plugin")
def test_a_triton_kernel_lowers_for_a_deviceless_h100():
    """Pallas Triton asks JAX 0.11+ for its target GPU; `gpu_lowering_target` names the
    topology's H100 there (without it the lowering refuses the CPU it runs on)."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def double(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(1,),
            in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
            out_specs=pl.BlockSpec(x.shape, lambda i: (0, 0)),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        )(x)

    device = deviceless.h100_topology().devices[0]
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    lowered, _ = deviceless.lower(double, (x,), {}, device)
    assert "__gpu$xla.gpu.triton" in lowered.compile().as_text()


def test_a_refusing_primitive_raises_only_where_its_branch_compiles():
    """In a `lax.platform_dependent` branch, the primitive is typed as its `(shape, dtype)`s,
    and compiling that branch (or running it eagerly) raises the caller's error naming the
    platform; a compile that takes another branch never lowers it."""
    refuse = jax_private.refusing_primitive(
        "test_refused", lambda platform: ValueError(f"refused on {platform}")
    )
    shapes = (((2, 3), np.dtype(np.float32)), ((4,), np.dtype(jnp.bfloat16)))

    def refused(x):
        return refuse(shapes)

    def kept(x):
        return [jnp.zeros((2, 3), jnp.float32) + x, jnp.ones((4,), jnp.bfloat16)]

    out = jax.eval_shape(refused, 1.0)
    assert [(o.shape, o.dtype) for o in out] == list(shapes)
    with pytest.raises(ValueError, match="refused on cpu"):
        jax.jit(lambda x: lax.platform_dependent(x, default=refused))(1.0)
    with pytest.raises(ValueError, match="refused on cpu"):
        refused(1.0)
    got = jax.jit(lambda x: lax.platform_dependent(x, cpu=kept, default=refused))(1.0)
    np.testing.assert_array_equal(got[0], np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(got[1], np.ones((4,), jnp.bfloat16))


def test_copies_of_equinox_s_missing_sentinel_are_the_sentinel():
    """Equinox's unflatten tells its `MISSING` by identity; a copy of a treedef holding it
    must unflatten (a converted NNX model's `copy.deepcopy`: tests/test_nnx.py)."""
    import copy
    import pickle

    import equinox as eqx
    from equinox._module._flatten import MISSING

    import fp8jax
    from fp8jax._src.core.jax_private import keep_equinox_missing_on_copy

    keep_equinox_missing_on_copy()
    keep_equinox_missing_on_copy()  # idempotent
    assert copy.deepcopy(MISSING) is MISSING and copy.copy(MISSING) is MISSING
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING
    layer = fp8jax.Fp8DotGeneral("delayed")
    leaves, treedef = jax.tree.flatten(layer)
    copied = jax.tree.unflatten(copy.deepcopy(treedef), leaves)
    assert eqx.tree_equal(copied, layer)


def test_canonical_precision_reads_precision_as_lax_does():
    presets = lax.DotAlgorithmPreset
    assert jax_private.canonical_precision("highest") == (lax.Precision.HIGHEST,) * 2
    assert jax_private.canonical_precision(("high", "default")) == (
        lax.Precision.HIGH,
        lax.Precision.DEFAULT,
    )
    assert jax_private.canonical_precision("F32_F32_F32") is presets.F32_F32_F32
    assert jax_private.canonical_precision(presets.BF16_BF16_F32) is presets.BF16_BF16_F32
    with pytest.raises(ValueError, match="Precision argument must be one of"):
        jax_private.canonical_precision("bogus")

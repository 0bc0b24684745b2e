"""Fp8DotGeneral against float32 math, for general dimension numbers, forward and backward."""

import functools
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import U_F32, UNIT_ROUNDOFF, bf16_gemm_bound, ref_qdq, representable
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

import fp8jax

# (name, lhs shape, rhs shape, dimension_numbers)
CASES = [
    ("mk,kn->mn", (4, 8), (8, 3), (((1,), (0,)), ((), ()))),
    ("mk,nk->mn", (4, 8), (3, 8), (((1,), (1,)), ((), ()))),
    ("km,kn->mn", (8, 4), (8, 3), (((0,), (0,)), ((), ()))),
    ("k,nk->n", (8,), (3, 8), (((0,), (1,)), ((), ()))),
    ("bmk,bkn->bmn", (2, 4, 8), (2, 8, 3), (((2,), (1,)), ((0,), (0,)))),
    ("mbk,kbn->bmn", (4, 2, 8), (8, 2, 3), (((2,), (0,)), ((1,), (1,)))),
    ("bmk,nkb->bmn (batch axes apart)", (2, 4, 8), (3, 8, 2), (((2,), (1,)), ((0,), (2,)))),
    ("mpq,qnp->mn (two contracting)", (4, 5, 6), (6, 3, 5), (((1, 2), (2, 0)), ((), ()))),
    ("bhqd,bhkd->bhqk", (2, 3, 4, 8), (2, 3, 5, 8), (((3,), (3,)), ((0, 1), (0, 1)))),
    ("tsd,dsf->tf", (6, 2, 4), (4, 2, 5), (((1, 2), (1, 0)), ((), ()))),
]
IDS = [c[0] for c in CASES]


def with_state(dot, role, scale=None, amax=None):
    """`dot` with operand `role`'s stored scale and/or newest amax set."""
    state = getattr(dot, role)
    if scale is not None:
        state = eqx.tree_at(lambda s: s.scale, state, jnp.float32(scale))
    if amax is not None:
        state = eqx.tree_at(lambda s: s.amax_history, state, state.amax_history.at[0].set(amax))
    return eqx.tree_at(lambda d: getattr(d, role), dot, state)


def f32_dot(lhs, rhs, dims):
    return lax.dot_general(lhs, rhs, dims, precision=lax.Precision.HIGHEST)


def vjp(fn, lhs, rhs, ct):
    out, pullback = jax.vjp(fn, lhs, rhs)
    return out, *pullback(ct)


def fp8_vjp(dot, dims, lhs, rhs, ct):
    """Output, dgrad and wgrad of `dot`, differentiated together with its state (as training
    does: an FP8 layer whose state is left out of the gradient raises)."""
    out, pullback = jax.vjp(lambda a, b, d: d(a, b, dims), lhs, rhs, dot)
    return out, *pullback(ct)[:2]


def pow2_scale(fmt_max, amax):
    """The default per-tensor scale: `fmt_max / amax` rounded down to a power of two."""
    return np.float32(2.0 ** np.floor(np.log2(np.float32(fmt_max) / np.float32(amax))))


@pytest.mark.parametrize("name, lshape, rshape, dims", CASES, ids=IDS)
def test_exact_on_representable_values(name, lshape, rshape, dims):
    """FP8-representable operands and power-of-two scales: FP8 equals float32 exactly."""
    rng = np.random.default_rng(len(name))
    lhs = representable(rng, lshape)
    rhs = representable(rng, rshape)
    dot = fp8jax.Fp8DotGeneral()
    # Stored scales are used while the amax history is still empty.
    dot = with_state(dot, "input", scale=2.0)
    dot = with_state(dot, "kernel", scale=0.5)
    dot = with_state(dot, "output_grad", scale=4.0)
    out_shape = jax.eval_shape(lambda a, b: f32_dot(a, b, dims), lhs, rhs).shape
    ct = representable(rng, out_shape, fmt="e5m2")

    out, d_lhs, d_rhs = fp8_vjp(dot, dims, lhs, rhs, ct)
    ref, r_lhs, r_rhs = vjp(lambda a, b: f32_dot(a, b, dims), lhs, rhs, ct)
    assert out.shape == ref.shape and d_lhs.shape == lshape and d_rhs.shape == rshape
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(d_lhs, r_lhs)
    np.testing.assert_array_equal(d_rhs, r_rhs)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_mixed_dtype_gradients_are_written_in_their_operands_dtypes(lhs_dtype, rhs_dtype):
    """A float32 operand beside a BF16 one (float32 output, no master): each gradient is one
    rounding of the exact float64 product of the FP8 values into its operand's dtype (a
    dgrad or wgrad written in the other operand's BF16 first would round twice)."""
    rng = np.random.default_rng(3)
    dims = (((1,), (1,)), ((), ()))
    x, w = representable(rng, (16, 16)), representable(rng, (8, 16))
    ct = representable(rng, (16, 8), fmt="e5m2")
    dot = with_state(with_state(fp8jax.Fp8DotGeneral(), "input", scale=2.0), "kernel", scale=0.5)
    dot = with_state(dot, "output_grad", scale=4.0)
    lhs, rhs = jnp.asarray(x, lhs_dtype), jnp.asarray(w, rhs_dtype)
    _, d_lhs, d_rhs = fp8_vjp(dot, dims, lhs, rhs, ct)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, ct))
    assert d_lhs.dtype == lhs.dtype and d_rhs.dtype == rhs.dtype
    np.testing.assert_array_equal(np.asarray(d_lhs), (g64 @ w64).astype(lhs.dtype))
    np.testing.assert_array_equal(np.asarray(d_rhs), (g64.T @ x64).astype(rhs.dtype))


def test_float16_operands_with_a_bfloat16_output_get_float16_gradients():
    """float16 operands and `preferred_element_type=bfloat16`: neither operand is a master
    (wider than the output), so each gradient is one rounding of the float64 product of
    the FP8 values into float16, as lax's transpose writes it, not a BF16 one widened."""
    rng = np.random.default_rng(5)
    dims = (((1,), (1,)), ((), ()))
    x, w = representable(rng, (16, 16)), representable(rng, (8, 16))
    ct = representable(rng, (16, 8), fmt="e5m2")
    dot = with_state(with_state(fp8jax.Fp8DotGeneral(), "input", scale=2.0), "kernel", scale=0.5)
    dot = with_state(dot, "output_grad", scale=4.0)
    lhs, rhs = jnp.asarray(x, jnp.float16), jnp.asarray(w, jnp.float16)
    out, pullback = jax.vjp(
        lambda a, b, d: d(a, b, dims, preferred_element_type=jnp.bfloat16), lhs, rhs, dot
    )
    d_lhs, d_rhs = pullback(jnp.asarray(ct, jnp.bfloat16))[:2]
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, ct))
    assert out.dtype == jnp.bfloat16 and d_lhs.dtype == d_rhs.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(d_lhs), (g64 @ w64).astype(np.float16))
    np.testing.assert_array_equal(np.asarray(d_rhs), (g64.T @ x64).astype(np.float16))


def test_vmap_over_both_operands_matches_lax_per_member():
    """`jax.vmap` over the activation and the kernel (a kernel per member, the layer's state
    shared): the mapped axis folds into the GEMM's batch. Representable values and
    power-of-two current scales make FP8 exact: output and both gradients equal lax's."""
    rng = np.random.default_rng(9)
    dims = (((1,), (1,)), ((), ()))
    xs, ws = representable(rng, (3, 4, 8)), representable(rng, (3, 5, 8))
    ct = representable(rng, (3, 4, 5), fmt="e5m2")
    dot = fp8jax.Fp8DotGeneral("current")

    def mapped(fn):
        return vjp(jax.vmap(lambda x, w: fn(x, w, dims)), xs, ws, ct)

    for got, want in zip(mapped(dot), mapped(f32_dot), strict=True):
        np.testing.assert_array_equal(got, want)


def _format_bound(a, b, a_fmt, b_fmt, a_scale, b_scale, contract):
    """Worst-case |fl8(a) fl8(b) - a b| summed over the contraction, from the formats' unit
    roundoff u and subnormal half-spacing d: |a^ - a| <= u|a| + d/scale."""
    ua, ub = UNIT_ROUNDOFF[a_fmt], UNIT_ROUNDOFF[b_fmt]
    da = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}[a_fmt] / a_scale
    db = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}[b_fmt] / b_scale
    A, B = np.abs(a), np.abs(b)
    return contract(ua * A + da, (1 + ub) * B + db) + contract(A, ub * B + db)


@pytest.mark.parametrize("name, lshape, rshape, dims", CASES, ids=IDS)
def test_random_values_against_ml_dtypes_and_float32(name, lshape, rshape, dims):
    rng = np.random.default_rng(7 + len(name))
    lhs = rng.standard_normal(lshape).astype(np.float32) * 3
    rhs = rng.standard_normal(rshape).astype(np.float32) * 0.2
    ref = f32_dot(lhs, rhs, dims)
    ct = rng.standard_normal(ref.shape).astype(np.float32) * 1e-3
    amax_x, amax_w, amax_g = (np.float32(np.max(np.abs(v))) for v in (lhs, rhs, ct))
    dot = fp8jax.Fp8DotGeneral()
    dot = with_state(dot, "input", amax=amax_x)
    dot = with_state(dot, "kernel", amax=amax_w)
    dot = with_state(dot, "output_grad", amax=amax_g)
    sx, sw, sg = pow2_scale(448, amax_x), pow2_scale(448, amax_w), pow2_scale(57344, amax_g)

    out, d_lhs, d_rhs = fp8_vjp(dot, dims, lhs, rhs, ct)
    _, r_lhs, r_rhs = vjp(lambda a, b: f32_dot(a, b, dims), lhs, rhs, ct)

    def lax64(a, b, d):
        return np.asarray(
            lax.dot_general(
                jnp.asarray(a, jnp.float32),
                jnp.asarray(b, jnp.float32),
                d,
                precision=lax.Precision.HIGHEST,
            )
        )

    # 1. Against the same FP8 roundings done by ml_dtypes: only float32 summation differs.
    xq, wq, gq = ref_qdq(lhs, sx, "e4m3"), ref_qdq(rhs, sw, "e4m3"), ref_qdq(ct, sg, "e5m2")
    mag = lax64(np.abs(xq), np.abs(wq), dims)
    np.testing.assert_array_less(np.abs(out - lax64(xq, wq, dims)), 1e-6 * mag + 1e-30)
    _, ml_lhs, ml_rhs = vjp(
        lambda a, b: f32_dot(a, b, dims),
        xq.astype(np.float32),
        wq.astype(np.float32),
        gq.astype(np.float32),
    )
    for got, want, mags in (
        (
            d_lhs,
            ml_lhs,
            vjp(
                lambda a, b: f32_dot(a, b, dims),
                np.abs(xq).astype(np.float32),
                np.abs(wq).astype(np.float32),
                np.abs(gq).astype(np.float32),
            )[1],
        ),
        (
            d_rhs,
            ml_rhs,
            vjp(
                lambda a, b: f32_dot(a, b, dims),
                np.abs(xq).astype(np.float32),
                np.abs(wq).astype(np.float32),
                np.abs(gq).astype(np.float32),
            )[2],
        ),
    ):
        np.testing.assert_array_less(np.abs(got - want), 1e-5 * np.asarray(mags) + 1e-30)

    # 2. Against float32 math, within the worst case the two formats allow.
    bound = _format_bound(lhs, rhs, "e4m3", "e4m3", sx, sw, lambda a, b: lax64(a, b, dims))
    np.testing.assert_array_less(np.abs(out - ref), bound * (1 + 1e-5) + 1e-30)
    lhs_bound = _grad_bound(
        lambda g, w: vjp(lambda a, b: f32_dot(a, b, dims), lhs, w, g)[1], ct, rhs, sg, sw
    )
    rhs_bound = _grad_bound(
        lambda g, x: vjp(lambda a, b: f32_dot(a, b, dims), x, rhs, g)[2], ct, lhs, sg, sx
    )
    np.testing.assert_array_less(np.abs(d_lhs - r_lhs), lhs_bound * (1 + 1e-5) + 1e-30)
    np.testing.assert_array_less(np.abs(d_rhs - r_rhs), rhs_bound * (1 + 1e-5) + 1e-30)


def _grad_bound(pull, g, other, sg, so):
    """Bound for a backward product of e5m2 `g` and e4m3 `other`, built like the forward's."""
    ug, uo = UNIT_ROUNDOFF["e5m2"], UNIT_ROUNDOFF["e4m3"]
    dg, do = 2.0**-17 / sg, 2.0**-10 / so
    ga, oa = np.abs(g), np.abs(other)
    return np.asarray(pull(ug * ga + dg, (1 + uo) * oa + do)) + np.asarray(pull(ga, uo * oa + do))


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.DelayedScaling(), fp8jax.CurrentScaling(), fp8jax.BlockwiseScaling(), fp8jax.MXFP8()],
    ids=lambda r: type(r).__name__,
)
def test_float64_preferred_type_is_what_dot_general_writes(recipe):
    """Without x64, lax writes float32 for preferred_element_type=float64: so do the FP8
    GEMMs (the block recipes' kernels refused a float64 output they could not write)."""
    x, w = jnp.ones((128, 256)), jnp.ones((256, 128))
    dims = (((1,), (0,)), ((), ()))
    with pytest.warns(UserWarning, match="float64 requested in dot is not available"):
        want = lax.dot_general(x, w, dims, preferred_element_type=jnp.float64).dtype
    dot = fp8jax.Fp8DotGeneral(recipe)
    with pytest.warns(UserWarning, match="float64 requested in jax.lax.dot_general is not"):
        out = dot(x, w, dims, preferred_element_type=jnp.float64)
    assert out.dtype == want == jnp.float32
    with pytest.warns(UserWarning, match="float64 requested"):
        grads = fp8jax.filter_grad(
            lambda d, a: jnp.sum(d(a, w, dims, preferred_element_type=np.float64))
        )(dot, x)
    assert grads is not None


def test_out_sharding_reshards_the_output_as_dot_general_does():
    """`lax.dot_general`'s `out_sharding=` (which Flax's NNX Linear passes to its
    `dot_general`): the FP8 GEMM's output gets the sharding lax's would (it was a
    TypeError); `lax.ragged_dot`'s likewise."""
    spec = jax.sharding.PartitionSpec
    dims = (((1,), (0,)), ((), ()))
    dot = fp8jax.Fp8DotGeneral("current")
    w = jnp.ones((32, 8))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((16, 32)), jax.sharding.NamedSharding(mesh, spec("data")))
        for out in (None, spec(), spec("data", None), spec(None, "data")):
            want = jax.jit(functools.partial(lax.dot_general, out_sharding=out), static_argnums=2)
            got = jax.jit(functools.partial(dot, out_sharding=out), static_argnums=2)
            assert got(x, w, dims).sharding.spec == want(x, w, dims).sharding.spec, out
        np.testing.assert_array_equal(got(x, w, dims), jnp.full((16, 8), 32.0))
    ragged = fp8jax.Fp8RaggedDot("current", num_experts=2)
    ws, sizes = jnp.ones((2, 32, 8)), jnp.array([10, 6], jnp.int32)
    with jax.set_mesh(mesh):
        x = jnp.ones((16, 32))  # lax.ragged_dot's CPU expansion fails on rows split here
        for out in (spec(), spec("data", None), spec(None, "data")):
            want = jax.jit(functools.partial(lax.ragged_dot, out_sharding=out))(x, ws, sizes)
            got = jax.jit(functools.partial(ragged, out_sharding=out))(x, ws, sizes)
            assert got.sharding.spec == want.sharding.spec, out
            np.testing.assert_array_equal(got, jnp.full((16, 8), 32.0))
        # Where lax.ragged_dot needs out_sharding, the tokens keep the rows' sharding.
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec("data")))
        got = eqx.filter_jit(ragged)(x, ws, sizes)
        assert got.sharding.spec == spec("data", None)
        np.testing.assert_array_equal(got, jnp.full((16, 8), 32.0))


EXPLICIT_CASES = [  # lhs, rhs, out_sharding (the contraction split needs one, as for lax)
    (("data", None), (None, "model"), None),
    (("data", "model"), ("model", None), ("data", None)),
    ((None, None), (None, "model"), None),
    (("data", None), ("data", None), None),
]


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise", "mxfp8"])
def test_explicit_mesh_matches_no_mesh_and_lax_shardings(recipe):
    """Under a mesh with Explicit axes (the block recipes raised from `jnp.repeat`, which has
    no sharding rule there): each layout's value, gradients and new state equal the step
    without a mesh, and the output and gradients are sharded as lax.dot_general's are."""
    spec, explicit = jax.sharding.PartitionSpec, jax.sharding.AxisType.Explicit
    dims = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    dot = fp8jax.Fp8DotGeneral(
        fp8jax.BlockwiseScaling(block_size=32) if recipe == "blockwise" else recipe
    )

    def loss(params, out):
        d, x, w = params
        return jnp.sum(d(x, w, dims, out_sharding=out) ** 2)

    step = eqx.filter_jit(fp8jax.filter_value_and_grad(loss))
    want = step((dot, x, w), None)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, explicit))
    with jax.set_mesh(mesh):
        for xs, ws, out in EXPLICIT_CASES:
            out = out and spec(*out)
            args = jax.device_put(x, spec(*xs)), jax.device_put(w, spec(*ws))
            got = step((dot, *args), out)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                # Sums split over devices add in another order: float32 rounding of the sum.
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))
            lax_y = functools.partial(lax.dot_general, dimension_numbers=dims, out_sharding=out)
            y = eqx.filter_jit(lambda d, x, w, out=out: d(x, w, dims, out_sharding=out))
            assert y(dot, *args).sharding == jax.jit(lax_y)(*args).sharding, (xs, ws)
            lax_grads = jax.grad(lambda x, w, f=lax_y: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
            grads = [g.sharding for g in got[1][1:]]
            assert grads == [g.sharding for g in jax.jit(lax_grads)(*args)], (xs, ws)
        split = jax.device_put(x, spec(None, "model")), jax.device_put(w, spec("model", None))
        with pytest.raises(Exception, match="specify the output sharding"):
            eqx.filter_jit(lambda d, x, w: d(x, w, dims))(dot, *split)  # as lax raises


def test_operands_made_outside_an_explicit_mesh_compute_as_without_it():
    """Operands typed on no mesh (made outside it, or NumPy) under a mesh with Explicit axes
    and no `out_sharding`: value, gradients and new state equal the step without a mesh,
    the output and gradients sharded as lax.dot_general's are (it raised "Missing required
    keyword argument: 'out_sharding'")."""
    dims = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    for recipe in ("delayed", fp8jax.BlockwiseScaling(block_size=32)):
        dot = fp8jax.Fp8DotGeneral(recipe)
        loss = lambda p: jnp.sum(p[0](p[1], p[2], dims) ** 2)  # noqa: E731
        step = eqx.filter_jit(fp8jax.filter_value_and_grad(loss))
        want = step((dot, x, w))
        with jax.set_mesh(mesh):
            got = step((dot, x, w))
            y = eqx.filter_jit(lambda d, x, w: d(x, w, dims))(dot, x, w)
            lax_y = jax.jit(lambda x, w: lax.dot_general(x, w, dims))(x, w)
            lax_loss = lambda x, w: jnp.sum(lax.dot_general(x, w, dims) ** 2)  # noqa: E731
            lax_grads = jax.jit(jax.grad(lax_loss, argnums=(0, 1)))(x, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        assert y.sharding.is_equivalent_to(lax_y.sharding, 2), recipe
        for g, lax_g in zip(got[1][1:], lax_grads, strict=True):
            assert g.sharding.is_equivalent_to(lax_g.sharding, 2), recipe


def test_dtypes_follow_dot_general():
    dot = fp8jax.Fp8DotGeneral()
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 3), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    assert dot(x, w, dims).dtype == jnp.bfloat16
    assert dot(x, w, dims, preferred_element_type=jnp.float32).dtype == jnp.float32
    assert dot(x, w.astype(jnp.float32), dims).dtype == jnp.float32
    gx, gw, _ = jax.grad(
        lambda a, b, d: jnp.sum(d(a, b, dims).astype(jnp.float32)), argnums=(0, 1, 2)
    )(x, w, dot)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    # Every pair of dtypes as lax answers it (BF16 with float16 is BF16 there, where
    # jnp.promote_types says float32), for the grouped op too.
    kinds = (jnp.bfloat16, jnp.float16, jnp.float32)
    for a, b in [(a, b) for a in kinds for b in kinds]:
        x, w = jnp.ones((4, 8), a), jnp.ones((8, 3), b)
        assert dot(x, w, dims).dtype == jax.lax.dot_general(x, w, dims).dtype, (a, b)
        ragged = fp8jax.Fp8RaggedDot("current", num_experts=2)
        ws, sizes = jnp.ones((2, 8, 3), b), jnp.array([2, 2])
        assert ragged(x, ws, sizes).dtype == jax.lax.ragged_dot(x, ws, sizes).dtype, (a, b)


def _einsum_reference(spec, x, w, g):
    """Forward, dgrad and wgrad of the einsum `spec` ("mk,kn->mn") on float64 `x`, `w` and the
    output gradient `g`: for each, (value, magnitude: the same sum of absolute values, the
    number of products each element sums)."""
    a, rest = spec.split(",")
    b, c = rest.split("->")
    sizes = dict(zip(a, x.shape, strict=True)) | dict(zip(b, w.shape, strict=True))

    def run(left, right, out, p, q):
        terms = int(np.prod([sizes[i] for i in set(left + right) - set(out)]))
        formula = f"{left},{right}->{out}"
        return np.einsum(formula, p, q), np.einsum(formula, np.abs(p), np.abs(q)), terms

    return run(a, b, c, x, w), run(c, b, a, g, w), run(a, c, b, x, g)


# Plain, batched and two contracting dimensions (each case costs a compile).
BF16_CASES = [c for c in CASES if c[0] in ("mk,nk->mn", "mbk,kbn->bmn", "tsd,dsf->tf")]


@pytest.mark.parametrize("power_of_two", [True, False], ids=["pow2-scales", "exact-scales"])
@pytest.mark.parametrize("name, lshape, rshape, dims", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bfloat16_values_against_fp8_reference(name, lshape, rshape, dims, power_of_two):
    """BF16 operands, output and gradients: every element of the output, dgrad and wgrad is
    the float64 result of the same FP8 values (ml_dtypes rounding with the scales the layer
    used) within one BF16 rounding (`bf16_gemm_bound`). A dequantization factor rounded to
    BF16 would add up to 2**-8 more, the same for every element."""
    rng = np.random.default_rng(11 + len(name))
    lhs = jnp.asarray(rng.standard_normal(lshape) * 3, jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal(rshape) * 0.2, jnp.bfloat16)
    out_shape = jax.eval_shape(lambda a, b: f32_dot(a, b, dims), lhs, rhs).shape
    ct = jnp.asarray(rng.standard_normal(out_shape) * 1e-3, jnp.bfloat16)
    dot = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(power_of_two=power_of_two))
    # Amaxes in the histories, so that the scales are neither 1 nor powers of two by accident.
    for role, v in (("input", lhs), ("kernel", rhs), ("output_grad", ct)):
        dot = with_state(dot, role, amax=float(jnp.max(jnp.abs(v.astype(jnp.float32)))))

    out, pullback = jax.vjp(lambda a, b, d: d(a, b, dims), lhs, rhs, dot)
    d_lhs, d_rhs, new = pullback(ct)
    assert out.dtype == d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    # The state's gradient is its new value: the scale each operand was quantized with.
    sx, sw, sg = (np.float32(getattr(new, r).scale) for r in ("input", "kernel", "output_grad"))
    assert all(s != 1 for s in (sx, sw, sg))
    x, w, g = (np.asarray(v, np.float32) for v in (lhs, rhs, ct))
    xq, wq, gq = ref_qdq(x, sx, "e4m3"), ref_qdq(w, sw, "e4m3"), ref_qdq(g, sg, "e5m2")
    refs = _einsum_reference(name.split()[0], xq, wq, gq)
    for got, (value, magnitude, terms) in zip((out, d_lhs, d_rhs), refs, strict=True):
        error = np.abs(np.asarray(got, np.float64) - value)
        np.testing.assert_array_less(error, bf16_gemm_bound(value, magnitude, terms) + 1e-30)


@pytest.mark.parametrize("recipe_name", ["current", "residual", "blockwise"])
def test_float16_outputs_do_not_overflow(recipe_name):
    """Small float16 values are scaled up to ~448 before the cast: the unscaled FP8 products
    (here about 448**2 * 256 = 5e7) exceed float16's 65504; the result must not."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0.5, 1.0, (16, 256)) * 1e-3, jnp.float16)
    w = jnp.asarray(rng.uniform(0.5, 1.0, (256, 8)) * 1e-3, jnp.float16)
    dims = (((1,), (0,)), ((), ()))
    dot = fp8jax.Fp8DotGeneral(recipe_name)
    out, d_x, d_w = fp8_vjp(dot, dims, x, w, jnp.full((16, 8), 1e-3, jnp.float16))
    assert out.dtype == d_x.dtype == d_w.dtype == jnp.float16
    # The recipe's own float64 reference (ml_dtypes roundings, canonical x (M, K), w (N, K)).
    recipe = dot.recipe
    if recipe_name == "current":
        reference = functools.partial(ref.per_tensor_current, power_of_two=recipe.power_of_two)
    elif recipe_name == "residual":
        reference = ref.residual
    else:
        reference = functools.partial(
            ref.blockwise, block=recipe.block_size, power_of_two=recipe.power_of_two
        )
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32).T
    wants = reference(x32, w32, np.full((16, 8), np.float32(jnp.float16(1e-3))))
    # Every term is positive (the residual recipe's W_lo terms aside, below 2**-4 of W_hi's), so
    # the products summed weigh at most 2 |want|. The GEMMs accumulate and scale in float32
    # (K + 4 roundings of 2**-24 at most), then round to float16: 2**-11 relative, or half the
    # subnormal spacing, 2**-25, below 2**-14 (the gradients, about 1e-5, are subnormal).
    for got, want in zip((out, d_x, d_w.T), wants, strict=True):
        terms = {out.shape: 256, d_x.shape: 8}.get(got.shape, 16)
        bound = 2.0**-11 * np.abs(want) + 2.0**-25 + (terms + 4) * U_F32 * 2 * np.abs(want)
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound)


def test_saves_only_fp8_operands_and_scales(capsys):
    # A history length that no operand has as a dimension: a float32 residual shaped like an
    # operand cannot pass for FP8 state.
    dot = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=7))
    x = jnp.ones((32, 16))
    w = jnp.ones((16, 8))
    print_saved_residuals(lambda a, b, d: jnp.sum(d(a, b, (((1,), (0,)), ((), ())))), x, w, dot)
    saved = capsys.readouterr().out.splitlines()
    residuals = []
    for line in saved:
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        residuals.append((dtype, tuple(int(n) for n in dims.split(",") if n)))
    state = sorted(r for r in residuals if r in (("f32", ()), ("f32", (7,))))
    # The new state (returned by the backward pass as the state's gradient): a scale, its
    # inverse and a history for each of the three operands; and the two FP8 operands' scales.
    assert state == [("f32", ())] * (3 * 2 + 2) + [("f32", (7,))] * 3, saved
    operands = [r for r in residuals if r not in state]
    # The operands in FP8, in whatever layout the GEMM uses (the kernel is saved as (8, 16)).
    assert sorted(d for d, _ in operands) == ["f8_e4m3fn", "f8_e4m3fn"], saved
    assert sorted(int(np.prod(s)) for _, s in operands) == [16 * 8, 32 * 16], saved


def test_forward_uses_the_scale_merged_from_the_history():
    """Delayed scaling: the forward uses the state's scale, which merging the previous step's
    state computed from the history (not this step's amax, and not a scale the history
    would not give)."""
    dims = (((1,), (0,)), ((), ()))
    x, w = jnp.array([[9.0]]), jnp.array([[1.0]])
    fresh = fp8jax.Fp8DotGeneral()
    # A received state whose history holds amax 4: merged, its scale is 448 / 4 = 112, rounded
    # down to 64, whatever scale it came with.
    received = with_state(fresh, "input", scale=1.0, amax=4.0)
    dot = fresh.merge(received)
    assert float(dot.input.scale) == pow2_scale(448, 4.0) == 64.0
    got = dot(x, w, dims)
    # Under 64, 9.0 saturates at 448 / 64 = 7; its own amax (a scale of 32) would not clip.
    assert float(np.asarray(got)[0, 0]) == ref_qdq(np.float32(9.0), 64.0, "e4m3") == 7.0
    assert ref_qdq(np.float32(9.0), pow2_scale(448, 9.0), "e4m3") == 9.0
    # The stored scale is what the forward reads: another one gives another result.
    assert float(np.asarray(with_state(dot, "input", scale=32.0)(x, w, dims))[0, 0]) == 9.0


def test_kernel_shape_may_hold_numpy_integers():
    """`kernel_shape` read off a NumPy array's shape or `np.prod` (NumPy integers) builds the
    same layer as Python ints: the same error-feedback state, the same product."""
    dims = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 3))
    recipe = fp8jax.ResidualFP8(error_feedback=True)
    want = fp8jax.Fp8DotGeneral(recipe, kernel_shape=(3, 8))
    got = fp8jax.Fp8DotGeneral(recipe, kernel_shape=tuple(np.array([3, 8])))
    assert got.kernel.error.shape == want.kernel.error.shape == (3, 8)
    w = w.astype(np.float32)
    np.testing.assert_array_equal(got(x, w, dims), want(x, w, dims))


def test_dimension_numbers_may_name_single_axes_by_int():
    """`lax.dot_general` takes an int for a single axis (`((1, 0), ((), ()))`, and batch axes
    `(0, 0)`); Fp8DotGeneral, called like it, refused them ('should be ... each a tuple of
    ints'). The product equals lax's on FP8-representable values."""
    rng = np.random.default_rng(5)
    lhs, rhs = representable(rng, (2, 4, 8)), representable(rng, (2, 8, 3))
    for x, w, dims in [
        (lhs[0], rhs[0], ((1, 0), ((), ()))),
        (lhs, rhs, ((2, 1), (0, 0))),
        (lhs, rhs, ((np.int64(2), (1,)), ((0,), 0))),
    ]:
        want = f32_dot(x, w, dims)
        np.testing.assert_array_equal(fp8jax.Fp8DotGeneral("current")(x, w, dims), want)


def test_a_state_moved_in_from_a_layer_of_another_recipe_is_refused():
    """A state moved by `eqx.tree_at` runs as it is: one of another history length (or a
    current-scaling state, scale 1 and one amax, in a delayed layer that would warm-start)
    would silently run with that history. Refused; one of the same recipe is taken, its
    scale the cast's."""
    dims = (((1,), (0,)), ((), ()))
    roles = lambda m: (m.input, m.kernel, m.output_grad)  # noqa: E731
    short = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(history_len=2))
    x, w = np.ones((1, 2), np.float32), np.eye(2, dtype=np.float32)
    for other in (fp8jax.DelayedScaling(history_len=4), fp8jax.CurrentScaling()):
        moved = eqx.tree_at(roles, short, roles(fp8jax.Fp8DotGeneral(other)))
        with pytest.raises(ValueError, match=r"its input state is a TensorState with \d amax"):
            moved(x, w, dims)
    state = fp8jax.TensorState(jnp.float32(16), jnp.ones(2))
    trained = eqx.tree_at(lambda m: m.input, short, state)
    moved = eqx.tree_at(roles, fp8jax.Fp8DotGeneral(short.recipe), roles(trained))
    big = np.array([[40.0, 0.5]], np.float32)  # 40 saturates at 448 / 16 = 28 under 16
    want = ref_qdq(big, 16.0, "e4m3") @ w.astype(np.float64)
    assert want[0, 0] == 28.0
    np.testing.assert_array_equal(np.asarray(moved(big, w, dims), np.float64), want)


_DENSE = (((1,), (0,)), ((), ()))
_PREC = lax.Precision.DEFAULT
# (id, keyword arguments of the call, dense or ragged). Where lax refuses an input only by
# accident (a list of two Precisions: it hashes its parameters) or as JAX refuses every list
# argument (group sizes as a list), the ops take it: the documented extensions below.
_LAX_INPUTS = [
    ("f64-dense", {"preferred_element_type": jnp.float64}, "dense"),
    ("np-f64-dense", {"preferred_element_type": np.float64}, "dense"),
    ("py-float-dense", {"preferred_element_type": float}, "dense"),
    ("f32-dense", {"preferred_element_type": jnp.float32}, "dense"),
    ("prec-tuple", {"precision": (_PREC, _PREC)}, "dense"),
    ("prec-str-list", {"precision": ["highest", "highest"]}, "dense"),
    ("prec-enum-list", {"precision": [_PREC, _PREC]}, "dense"),
    ("f64-ragged", {"preferred_element_type": jnp.float64}, "ragged"),
    ("prec-enum-list-ragged", {"precision": [_PREC, _PREC]}, "ragged"),
    ("sizes-list-ragged", {"group_sizes": [2, 4]}, "ragged"),
    ("sizes-tuple-ragged", {"group_sizes": (2, 4)}, "ragged"),
]
_EXTENSIONS = {"prec-enum-list", "prec-enum-list-ragged", "sizes-list-ragged", "sizes-tuple-ragged"}


def _outcome(fn):
    """(the output dtype or the error's type, the categories of the warnings raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = np.dtype(fn().dtype)
        except Exception as e:  # the outcome compared is the error's type
            got = type(e)
    return got, sorted({w.category.__name__ for w in caught})


@pytest.mark.parametrize("case", _LAX_INPUTS, ids=[c[0] for c in _LAX_INPUTS])
def test_the_ops_answer_each_input_as_lax_does(case):
    """Each input as `lax.dot_general` / `lax.ragged_dot` answers it: the output dtype, or
    the error, and the warnings (float64 without x64: lax's UserWarning, then float32); the
    documented extensions are taken where lax refuses. `lax.ragged_dot` fails to lower a
    float64 `preferred_element_type` without x64: there lax's dense answer is the reference."""
    name, kwargs, kind = case
    kwargs = dict(kwargs)
    if kind == "dense":
        x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
        op = fp8jax.Fp8DotGeneral()
        mine = _outcome(lambda: op(x, w, _DENSE, **kwargs))
        want = _outcome(lambda: lax.dot_general(x, w, _DENSE, **kwargs))
    else:
        x, w = jnp.ones((6, 8)), jnp.ones((2, 8, 16))
        sizes = kwargs.pop("group_sizes", jnp.array([2, 4], jnp.int32))
        op = fp8jax.Fp8RaggedDot(num_experts=2)
        mine = _outcome(lambda: op(x, w, sizes, **kwargs))
        if name == "f64-ragged":
            want = _outcome(lambda: lax.dot_general(x, w[0], _DENSE, **kwargs))
        else:
            want = _outcome(lambda: lax.ragged_dot(x, w, sizes, **kwargs))
    if name in _EXTENSIONS:
        assert isinstance(want[0], type) and issubclass(want[0], TypeError)
        assert mine == (np.dtype(np.float32), [])
    else:
        assert mine == want


def test_out_sharding_on_a_mesh_of_auto_axes_is_refused_as_lax_refuses_it():
    """Without Explicit axes, an `out_sharding` naming Auto axes is refused by the FP8 GEMM
    as lax.dot_general refuses it, not dropped (the output left unsharded)."""
    dims = (((1,), (0,)), ((), ()))
    x, w = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    refused = "cannot contain axis names that are of type Auto"
    with pytest.raises(ValueError, match=refused):
        jax.jit(lambda x, w: lax.dot_general(x, w, dims, out_sharding=out))(x, w)
    dot = fp8jax.Fp8DotGeneral("delayed")
    with pytest.raises(ValueError, match=refused):
        eqx.filter_jit(lambda d, x, w: d(x, w, dims, out_sharding=out))(dot, x, w)

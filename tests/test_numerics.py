"""Numerics a careful user checks: BF16 outputs without scale bias, faults that surface, one
rounding for the dgrad's kernel, bounded block partials."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import h100_topology, make_train_step

import fp8jax

RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "current-exact-scale": fp8jax.CurrentScaling(power_of_two=False),
    "blockwise": fp8jax.BlockwiseScaling(block_size=32),
    "mxfp8": fp8jax.MXFP8(),
    "residual": fp8jax.ResidualFP8(),
}
MATMUL_NT = (((1,), (1,)), ((), ()))  # x (M, K) . w (N, K)


def as_f64(q):
    """The real values of a quantized operand (`QTensor` or `QTerms`), in float64."""
    terms = getattr(q, "terms", (q,))
    return sum(np.asarray(t.dequantize(), np.float64) for t in terms)


def role_gemms(recipe, x, w, g, out_dtype):
    """Forward, dgrad and wgrad of one GEMM through the recipe interface, with `out_dtype`
    outputs, each with the float64 product of the very FP8 values it multiplied."""
    state = {r: recipe.init_state(r, w.shape) for r in fp8jax._src.recipes.ROLES}
    q_x, _ = recipe.quantize(x, state["input"], "input", -1)
    q_w, _ = recipe.quantize(w, state["kernel"], "kernel", -1)
    q_wd = recipe.retile(q_w, "kernel", -2, source=w)
    q_g, _ = recipe.quantize(g, state["output_grad"], "output_grad", -1)
    q_gt, _ = recipe.quantize(g, state["output_grad"], "output_grad", -2)
    q_xt = recipe.retile(q_x, "input", -2)
    back = recipe.backward_dot_precision()
    return {
        "fwd": (recipe.dot(q_x, q_w, -1, -1, None, out_dtype), as_f64(q_x) @ as_f64(q_w).T),
        "dgrad": (recipe.dot(q_g, q_wd, -1, -2, back, out_dtype), as_f64(q_g) @ as_f64(q_wd)),
        "wgrad": (recipe.dot(q_gt, q_xt, -2, -2, back, out_dtype), as_f64(q_gt).T @ as_f64(q_xt)),
    }


@pytest.mark.parametrize("name", RECIPES)
def test_bf16_outputs_carry_no_scale_bias(name):
    """A BF16 output against the float64 product of the same FP8 values: only BF16's rounding
    of each element (its unit roundoff, 2**-8 relative), no factor shared by the
    whole output. Several magnitudes move the scales across binades; a scale rounded to
    BF16's 8 bits was off by up to 0.4 % (a least-squares ratio of 0.9985 was measured)."""
    recipe = RECIPES[name]
    rng = np.random.default_rng(0)
    m, k, n = 64, 256, 96
    worst = 0.0
    for magnitude in np.exp(rng.uniform(-4, 4, 6)):
        x = jnp.asarray(rng.standard_normal((m, k)) * magnitude, jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05 / magnitude, jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal((m, n)) * 1e-3 * magnitude, jnp.bfloat16)
        for role, (out, exact) in role_gemms(recipe, x, w, g, jnp.bfloat16).items():
            assert out.dtype == jnp.bfloat16, role
            out = np.asarray(out, np.float64)
            # Elementwise: one BF16 rounding, plus float32 accumulation (tiny).
            mag = np.abs(exact).max()
            np.testing.assert_array_less(
                np.abs(out - exact), 2.0**-8 * np.abs(exact) + 1e-6 * mag, err_msg=role
            )
            ratio = np.sum(out * exact) / np.sum(exact * exact)
            worst = max(worst, abs(ratio - 1.0))
    assert worst < 1e-4, worst  # bias below 0.01 %


ROLES = ("input", "kernel", "output_grad")
FAULT_RECIPES = {n: RECIPES[n] for n in ("delayed", "current", "blockwise", "mxfp8", "residual")}


def faulty(role, value):
    """A model, batch and loss with one `value` (inf or NaN) in operand `role`."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    c = rng.standard_normal((4, 16)).astype(np.float32)  # the output gradient: loss = sum(y c)
    if role == "input":
        x[1, 3] = value
    if role == "output_grad":
        c[2, 5] = value
    return x, c


def fault_model(recipe, role, value):
    linear = eqx.nn.Linear(32, 16, key=jax.random.PRNGKey(0))
    if role == "kernel":
        linear = eqx.tree_at(lambda m: m.weight, linear, linear.weight.at[3, 7].set(value))
    return fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe, telemetry=True))


def loss_fn(model, x, c):
    return jnp.sum(model(x) * c)


# Jitted once for all tests (each recipe compiles once; roles and faults only change data).
STEP = eqx.filter_jit(make_train_step(loss_fn, optax.sgd(0.0)))
GRAD = eqx.filter_jit(fp8jax.filter_grad(loss_fn))


def warm(model):
    """One finite step, so that every state holds something to keep."""
    grads = GRAD(model, *faulty(None, 0.0))
    return fp8jax.apply_updates(model, None, fp8jax.partition_for_grad_overwrite(grads)[0])


def leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", FAULT_RECIPES)
def test_a_fault_reaches_the_output_and_never_the_state(name, role, value):
    """The README's manual loop: the fault shows in the loss or the gradients, the faulty
    operand keeps its state (no inf amax in a history), telemetry counts the rejection."""
    model = warm(fault_model(FAULT_RECIPES[name], "kernel" if role == "kernel" else None, 0))
    if role == "kernel":  # the same warmed state, then one inf or NaN in the weight
        model = eqx.tree_at(lambda m: m.weight, model, model.weight.at[3, 7].set(value))
    x, c = faulty(role, value)
    before = model.dot_general
    opt_state = optax.sgd(0.0).init(None)
    new, _, loss = STEP(model, opt_state, x, c)
    grads = GRAD(model, x, c)
    # The fault is not clipped away: the loss (a faulty forward operand) or the weight's
    # gradient (a faulty output gradient) is not finite.
    if role != "output_grad":
        assert not np.isfinite(float(loss))
    else:
        assert not np.isfinite(np.asarray(grads.weight)).all()
    # The same step with the fault replaced by a zero: what the other operands' state becomes.
    x0, c0 = (np.nan_to_num(v, nan=0.0, posinf=0.0) for v in (x, c))
    clean_model = model
    if role == "kernel":
        clean_model = eqx.tree_at(lambda m: m.weight, model, model.weight.at[3, 7].set(0.0))
    clean = STEP(clean_model, opt_state, x0, c0)[0].dot_general
    after = new.dot_general
    for r in ROLES:
        got = leaves(getattr(after, r))
        assert all(np.isfinite(a).all() for a in got), r
        want = leaves(getattr(before if r == role else clean, r))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=r)
        assert float(getattr(after.stats, r).rejected) == (r == role), r
    text = fp8jax.report(new, quiet=True)
    assert "non-finite steps" in text


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_make_train_step_skips_a_faulty_step_bit_for_bit(name):
    model = warm(fault_model(FAULT_RECIPES[name], None, 0))
    train_step = fp8jax.make_train_step(loss_fn, optax.adam(1e-2))
    state = train_step.init(model)
    clean = faulty(None, 0.0)
    state, metrics = train_step(state, *clean)
    assert bool(metrics.grads_finite)
    for role in ("input", "output_grad"):
        bad_state, metrics = train_step(state, *faulty(role, np.inf))
        assert not bool(metrics.grads_finite)

        # Telemetry counts the rejected update (make_train_step keeps that count); the rest
        # of the model is the state before the step, bit for bit.
        def rejected(m):
            return [getattr(m.dot_general.stats, r).rejected for r in ("input", "output_grad")]

        assert sum(map(float, rejected(bad_state.model))) > sum(map(float, rejected(state.model)))
        kept = eqx.tree_at(rejected, bad_state.model, rejected(state.model))
        for a, b in zip(leaves(kept), leaves(state.model), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(leaves(bad_state.opt_state), leaves(state.opt_state), strict=True):
            np.testing.assert_array_equal(a, b)


def test_delayed_scale_is_not_frozen_by_a_fault():
    """With amax_compute="max", an inf amax in the history would freeze the scale for
    history_len steps; it never gets there, so the next step scales as if it had not been."""
    recipe = fp8jax.DelayedScaling(history_len=4)
    model = warm(fault_model(recipe, None, 0))
    x, c = faulty(None, 0.0)
    bad_x, _ = faulty("input", np.inf)

    def step(model, x):
        grads = GRAD(model, x, c)
        return fp8jax.apply_updates(model, None, fp8jax.partition_for_grad_overwrite(grads)[0])

    with_fault = step(step(model, bad_x), 2 * x)
    without = step(model, 2 * x)
    history = np.asarray(with_fault.dot_general.input.amax_history)
    np.testing.assert_array_equal(history, np.asarray(without.dot_general.input.amax_history))
    assert np.isfinite(history).all() and history[0] == np.abs(2 * x).max()
    assert float(with_fault.dot_general.input.scale) == float(without.dot_general.input.scale)


def dot_output_sizes(jaxpr):
    """Element counts of every `dot_general` result in `jaxpr`, scan bodies included."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes += dot_output_sizes(sub)
    return sizes


@pytest.mark.parametrize("recipe", [fp8jax.BlockwiseScaling(block_size=32), fp8jax.MXFP8()])
def test_block_partials_are_no_larger_than_the_output_by_default(recipe):
    """Forward, dgrad and wgrad of a GEMM whose K, N and M span 8 chunks: by default no dot
    writes more float32 values than the GEMM's output; `chunks_per_dot=None` writes one
    partial per chunk."""
    m, k, n = 256, 256, 256
    x, w, g = (jnp.ones(s, jnp.bfloat16) for s in ((m, k), (n, k), (m, n)))

    def sizes(recipe):
        dot = fp8jax.Fp8DotGeneral(recipe)
        fwd_bwd = jax.grad(lambda d, x, w: jnp.sum(d(x, w, MATMUL_NT) * g), argnums=(0, 1, 2))
        return dot_output_sizes(jax.make_jaxpr(fwd_bwd)(dot, x, w).jaxpr)

    default = sizes(recipe)
    assert len(default) == 3 and max(default) == m * n, default  # fwd, dgrad, wgrad
    assert max(sizes(dataclasses.replace(recipe, chunks_per_dot=None))) == 8 * m * n


@pytest.mark.parametrize("recipe", [fp8jax.BlockwiseScaling(block_size=32), fp8jax.MXFP8()])
def test_dgrad_kernel_is_one_rounding_of_the_weight(recipe):
    """The dgrad contracts the kernel over its outputs: the copy laid out for that is
    quantized from the weight itself, within E4M3's unit roundoff u of each value (plus the
    subnormal spacing of its block), not from the forward's FP8 copy (2u + u**2)."""
    rng = np.random.default_rng(3)
    n, k, block = 96, 128, 32
    w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-2, 2, (n, 1)))
    # One column of outliers: along K every tile holding it has most of its values in E4M3's
    # subnormals; along N the other columns' tiles do not.
    w[:, 5] *= 1e5
    w = w.astype(np.float32)
    state = recipe.init_state("kernel")
    q_w, _ = recipe.quantize(jnp.asarray(w), state, "kernel", -1)
    err = np.abs(as_f64(recipe.retile(q_w, "kernel", -2, source=jnp.asarray(w))) - w)
    u, d = 2.0**-4, 2.0 * 2.0**-10 / 448  # power-of-two scales: twice the subnormal term
    cols = recipe.block_for("kernel", -2)[1]
    tiles = np.abs(w).reshape(n // block, block, k // cols, cols).max(axis=(1, 3))
    amax = np.repeat(np.repeat(tiles, block, axis=0), cols, axis=1)
    np.testing.assert_array_less(err, u * np.abs(w) + d * amax + 1e-30)
    if recipe.block_for("kernel", -1) != recipe.block_for("kernel", -2):
        # From the FP8 values instead (two roundings), the same bound fails: it can fail.
        twice = np.abs(as_f64(recipe.retile(q_w, "kernel", -2)) - w)
        assert (twice > u * np.abs(w) + d * amax).any()


# --- inputs that used to crash, pass silently or mislead --------------------------------


@pytest.mark.parametrize("shape", [(0, 8, 4), (3, 0, 4), (3, 8, 0)], ids=["M=0", "K=0", "N=0"])
@pytest.mark.parametrize("name", FAULT_RECIPES)
def test_zero_size_operands_give_what_dot_general_gives(name, shape):
    m, k, n = shape
    dot = fp8jax.Fp8DotGeneral(FAULT_RECIPES[name], kernel_shape=(n, k), telemetry=True)
    x, w = jnp.ones((m, k)), jnp.ones((n, k))

    def loss(x, w, d):
        return jnp.sum(d(x, w, MATMUL_NT) ** 2)

    out = dot(x, w, MATMUL_NT)
    want = jax.lax.dot_general(x, w, MATMUL_NT)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)
    d_x, d_w, d_dot = jax.grad(loss, argnums=(0, 1, 2))(x, w, dot)
    assert d_x.shape == x.shape and d_w.shape == w.shape
    np.testing.assert_array_equal(d_x, 0.0)
    np.testing.assert_array_equal(d_w, 0.0)
    assert all(np.isfinite(a).all() for a in leaves(d_dot))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8, jnp.bool_])
def test_an_fp8_or_integer_preferred_element_type_is_refused(dtype):
    with pytest.raises(TypeError, match=r"preferred_element_type=.*use float32, bfloat16"):
        fp8jax.Fp8DotGeneral()(jnp.ones((2, 3)), jnp.ones((4, 3)), MATMUL_NT, None, dtype)


def test_complex_inputs_are_refused_as_complex():
    dot = fp8jax.Fp8DotGeneral()
    with pytest.raises(TypeError, match="complex64; FP8 has no complex format") as error:
        dot(jnp.ones((2, 3), jnp.complex64), jnp.ones((4, 3)), MATMUL_NT)
    assert "integer" not in str(error.value)


@pytest.mark.parametrize("targets", [[], ()])
def test_empty_targets_are_refused(targets):
    with pytest.raises(ValueError, match=r"selects no layer.*pass None"):
        fp8jax.Fp8Config(targets=targets)


@pytest.mark.parametrize("name", FAULT_RECIPES)
def test_state_stays_float32_with_x64_enabled(name):
    with jax.enable_x64(True):
        model = fp8jax.fp8_linear_layers(
            eqx.nn.Linear(32, 16, key=jax.random.PRNGKey(0)),
            fp8jax.Fp8Config(recipe=FAULT_RECIPES[name], telemetry=True),
        )
        assert {a.dtype for a in leaves(model.dot_general)} == {np.dtype(np.float32)}
        x, c = faulty(None, 0.0)
        grads = fp8jax.filter_grad(loss_fn)(model, x, c)
        assert {a.dtype for a in leaves(grads.dot_general)} == {np.dtype(np.float32)}
        new = fp8jax.apply_updates(model, None, fp8jax.partition_for_grad_overwrite(grads)[0])
        assert {a.dtype for a in leaves(new.dot_general)} == {np.dtype(np.float32)}


def two_layers(recipe):
    keys = jax.random.split(jax.random.PRNGKey(0))
    mlp = [eqx.nn.Linear(32, 32, key=keys[0]), eqx.nn.Linear(32, 16, key=keys[1])]
    return fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))


def mlp_loss(diff, static, x, c):
    first, second = eqx.combine(diff, static)
    return jnp.sum(second(jax.nn.relu(first(x))) * c)


def test_fine_tuning_without_the_fp8_state_raises_and_with_fp8_state_fixes_it():
    """A filter spec that trains only the second layer's weight: its scales could never move."""
    model = two_layers(fp8jax.DelayedScaling())
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m[1].weight, spec, True)
    x, c = faulty(None, 0.0)
    diff, static = eqx.partition(model, spec)
    with pytest.raises(ValueError, match=r"FP8 layer '1'.*fp8jax.with_fp8_state"):
        jax.grad(mlp_loss)(diff, static, x, c)
    full = fp8jax.with_fp8_state(spec, model)
    assert full[1].weight and not full[1].bias and not full[0].weight
    for layer in full:
        assert all(jax.tree.leaves([getattr(layer.dot_general, r) for r in ROLES]))
    diff, static = eqx.partition(model, full)
    grads = jax.grad(mlp_loss)(diff, static, x, c)
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    new = fp8jax.apply_updates(model, None, overwrites)
    for layer in new:  # both layers recorded their amaxes, the frozen one too
        assert all(float(getattr(layer.dot_general, r).amax_history[0]) > 0 for r in ROLES)


def test_a_layer_a_filter_spec_leaves_out_whole_records_nothing_until_with_fp8_state():
    """A layer that a spec leaves out whole (weights and FP8 state: a frozen first layer, no
    gradient through it) cannot raise as a differentiated one does: its state never leaves
    the step, so it stays as built (history 0, no scale: warm-started every step) and
    `scales_recorded` never holds (docs/training.md). `with_fp8_state(spec, model)` makes it
    record (max |x|, from NumPy), its weights still frozen (no gradient)."""
    model = two_layers(fp8jax.DelayedScaling())
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m[1], spec, jax.tree.map(lambda _: True, spec[1]))
    x, c = faulty(None, 0.0)
    for frozen, want in ((spec, 0.0), (fp8jax.with_fp8_state(spec, model), np.abs(x).max())):
        diff, static = eqx.partition(model, frozen)
        grads = fp8jax.filter_grad(mlp_loss)(diff, static, x, c)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        assert grads[0].weight is None
        new = fp8jax.apply_updates(model, None, overwrites)
        assert float(new[1].dot_general.input.amax_history[0]) > 0
        assert float(new[0].dot_general.input.amax_history[0]) == want
        assert bool(fp8jax.scales_recorded(new)) == bool(want > 0)


def test_a_filter_spec_naming_some_roles_updates_those_and_keeps_the_rest():
    """A filter spec differentiating one role's state (the inputs') left the gradient's FP8
    module with None at the others, and apply_updates crashed stacking them (TypeError:
    stack requires ndarray ... NoneType); the named role records its amax (max |x|, from
    NumPy), the others are kept as they were, bit for bit."""
    x, c = faulty(None, 0.0)
    model = two_layers(fp8jax.DelayedScaling())
    spec = jax.tree.map(lambda _: False, model)
    for i in range(2):
        spec = eqx.tree_at(lambda m, i=i: m[i].weight, spec, True)
        spec = eqx.tree_at(
            lambda m, i=i: m[i].dot_general.input,
            spec,
            jax.tree.map(lambda _: True, model[i].dot_general.input),
        )
    grads = jax.grad(mlp_loss)(*eqx.partition(model, spec), x, c)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    new = fp8jax.apply_updates(model, None, overwrites)
    assert float(new[0].dot_general.input.amax_history[0]) == float(np.abs(x).max())
    for old, kept in zip(model, new, strict=True):
        for r in ("kernel", "output_grad"):
            want, got = getattr(old.dot_general, r), getattr(kept.dot_general, r)
            assert jax.tree.all(jax.tree.map(np.array_equal, want, got)), r


def test_state_left_out_is_fine_where_the_recipe_keeps_none():
    """Current scaling reads no state between steps: leaving it out loses nothing."""
    x, c = faulty(None, 0.0)
    model = two_layers(fp8jax.CurrentScaling())
    spec = eqx.tree_at(lambda m: m[1].weight, jax.tree.map(lambda _: False, model), True)
    grads = jax.grad(mlp_loss)(*eqx.partition(model, spec), x, c)
    assert np.isfinite(np.asarray(grads[1].weight)).all()
    # Its gradient holds FP8 modules without arrays: nothing received, the state kept.
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    new = fp8jax.apply_updates(model, None, overwrites)
    for old, kept in zip(model, new, strict=True):
        for r in ROLES:
            want, got = getattr(old.dot_general, r), getattr(kept.dot_general, r)
            assert jax.tree.all(jax.tree.map(np.array_equal, want, got))


# --- on an H100: one cuBLASLt call per GEMM, writing BF16 with the scale as its alpha -------

CUBLAS_F8 = re.compile(
    r"= \((?P<out>\w+)\[[\d,]*\][^)]*\) custom-call\((?P<operands>[^)]*)\), "
    r'custom_call_target="__cublas\$lt\$matmul\$f8"'
)


def fp8_gemm_calls(hlo):
    """(output element type, operand names) of every cuBLASLt FP8 GEMM of an HLO module, and
    the names of its constants."""
    constants = set(re.findall(r"%(\S+) = \w+\[\] constant\(", hlo))
    calls = [
        (m.group("out"), [o.strip().lstrip("%") for o in m.group("operands").split(",")])
        for m in CUBLAS_F8.finditer(hlo)
    ]
    return calls, constants


@pytest.fixture(scope="module")
def h100():
    return h100_topology()


@pytest.mark.parametrize("remat", [False, True], ids=["gelu", "remat-gelu"])
@pytest.mark.parametrize(
    "recipe, writes",
    [
        (fp8jax.DelayedScaling(), "bf16"),
        (fp8jax.CurrentScaling(), "bf16"),
        (fp8jax.CurrentScaling(power_of_two=False), "f32"),
    ],
    ids=["delayed", "current", "current-exact-scale"],
)
def test_bf16_gemms_are_one_cublaslt_call_with_the_scale_folded(h100, recipe, writes, remat):
    """The MLP train step with BF16 compute, cuBLAS mode: forward, dgrad and wgrad of both
    Linears are one `__cublas$lt$matmul$f8` call each, writing BF16 directly, with the
    scales among its operands (its alpha), not in a pass after it. Scales that are not
    powers of two are applied in float32: the call writes float32 (and XLA converts it)."""
    from fp8jax._src.observe import deviceless

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    mlp = [eqx.nn.Linear(256, 512, key=k1), eqx.nn.Linear(512, 256, key=k2)]
    mlp = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    mlp = fp8jax.Policy.from_string("p=bf16,c=bf16").cast_to_param(mlp)
    gelu = jax.checkpoint(jax.nn.gelu) if remat else jax.nn.gelu

    def loss(model, x):
        return jnp.mean(model[1](gelu(model[0](x))).astype(jnp.float32) ** 2)

    step = make_train_step(loss, optax.sgd(1e-2))
    args = (mlp, optax.sgd(1e-2).init(None), jax.ShapeDtypeStruct((512, 256), jnp.bfloat16))
    lowered, _ = deviceless.lower(step, args, {}, h100.devices[0])
    hlo = lowered.compile(compiler_options=deviceless.MODES["cublas"]).as_text()
    calls, constants = fp8_gemm_calls(hlo)
    # 2 Linears x (fwd, dgrad, wgrad), less the first layer's dgrad (x needs no gradient).
    assert len(calls) == 5, calls
    for out, operands in calls:
        assert out == writes, (out, operands)
        # Operands: a, b, (c: XLA fuses the SGD update into the wgrad), then a's and b's
        # scales; a folded alpha is not the constant 1.
        assert len(operands) in (4, 5) and not set(operands[-2:]) <= constants, operands
    # Five operands: the two wgrads with the SGD update fused in as C, where the GEMM writes
    # the weight's dtype (BF16); a float32 output is converted first, nothing is fused.
    fused = sum(len(operands) == 5 for _, operands in calls)
    assert fused == (2 if writes == "bf16" else 0), calls

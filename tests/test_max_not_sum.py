"""A layer's amax contributions combine by max: shared layers, vmap, microbatches."""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8jax
from fp8jax._src.gemm import vjp as gemm


@pytest.fixture
def linear(getkey):
    return fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=getkey()))


def newest(grads):
    dot = grads.dot_general
    return {r: float(getattr(dot, r).amax_history[0]) for r in ("input", "kernel", "output_grad")}


def amax(*arrays):
    return float(max(np.abs(np.asarray(a)).max() for a in arrays))


def test_layer_used_twice_keeps_the_larger_amax(linear):
    rng = np.random.default_rng(0)
    x1, x2 = (rng.standard_normal((2, 5, 8)) * [[[1.0]], [[7.0]]]).astype(np.float32)
    c1, c2 = (rng.standard_normal((2, 5, 4)) * [[[3.0]], [[0.5]]]).astype(np.float32)

    def twice(m):
        return jnp.sum(m(x1) * c1) + jnp.sum(m(x2) * c2)

    grads = fp8jax.filter_grad(twice)(linear)
    assert newest(grads) == {
        "input": amax(x1, x2),
        "kernel": amax(linear.weight),
        "output_grad": amax(c1, c2),
    }
    # The weight's own gradient still adds up both uses.
    g1 = fp8jax.filter_grad(lambda m: jnp.sum(m(x1) * c1))(linear)
    g2 = fp8jax.filter_grad(lambda m: jnp.sum(m(x2) * c2))(linear)
    np.testing.assert_allclose(grads.weight, g1.weight + g2.weight, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads.bias, g1.bias + g2.bias, rtol=1e-6)


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp8"])
def test_layer_used_twice_pairs_the_scale_with_the_larger_amax(getkey, recipe):
    """Recipes that scale each tensor by its own amax record the amax and the scale it gives.
    Two uses' states combined leaf by leaf by max paired the larger amax with the larger
    scale, that of the smaller amax (an input scale of 256 beside an amax of 7): the state
    must hold the scale of the amax it records, as accumulated microbatches do."""
    config = fp8jax.Fp8Config(recipe=recipe)
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=getkey()), config)
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal((2, 4, 32)) * [[[0.3]], [[7.0]]]).astype(np.float32)
    c1, c2 = (rng.standard_normal((2, 4, 32)) * [[[3.0]], [[0.01]]]).astype(np.float32)

    def twice(m):
        return jnp.sum(jax.vmap(m)(x1) * c1) + jnp.sum(jax.vmap(m)(x2) * c2)

    grads = fp8jax.filter_grad(twice)(linear)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    merged = fp8jax.apply_updates(linear, None, overwrites)
    assert newest(grads)["input"] == amax(x1, x2)
    for tree in (grads, merged):
        for role in ("input", "kernel", "output_grad"):
            state = getattr(tree.dot_general, role)
            e5m2 = recipe == "current" and role == "output_grad"
            fmt_max = float(jnp.finfo(jnp.float8_e5m2 if e5m2 else jnp.float8_e4m3fn).max)
            exact = fmt_max / np.float64(state.amax_history[0])
            want = 2.0 ** np.floor(np.log2(exact)) if recipe == "current" else exact
            np.testing.assert_allclose(float(state.scale), want, rtol=1e-6, err_msg=role)
            np.testing.assert_allclose(float(state.scale_inv), 1 / want, rtol=1e-6, err_msg=role)


def test_a_hand_rolled_gradient_with_combine_by_max_pairs_the_scales_too(getkey):
    """`jax.grad` of a loss that views the model with `fp8jax.combine_by_max` (documented as
    what `filter_value_and_grad` does for you) gives a layer used twice the state
    `filter_grad` gives it: each scale that of the larger amax it records. It held the larger
    scale, that of the smaller amax, beside it."""
    config = fp8jax.Fp8Config(recipe="current")
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=getkey()), config)
    params, static = eqx.partition(linear, eqx.is_inexact_array)
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal((2, 4, 32)) * [[[0.3]], [[7.0]]]).astype(np.float32)
    c1, c2 = (rng.standard_normal((2, 4, 32)) * [[[3.0]], [[0.01]]]).astype(np.float32)

    def twice(m):
        return jnp.sum(jax.vmap(m)(x1) * c1) + jnp.sum(jax.vmap(m)(x2) * c2)

    @jax.jit
    def hand_rolled(params):
        return jax.grad(lambda p: twice(fp8jax.combine_by_max(eqx.combine(p, static))))(params)

    grads = hand_rolled(params)
    library = fp8jax.filter_grad(twice)(linear)
    assert newest(grads)["input"] == amax(x1, x2)
    for role in ("input", "kernel", "output_grad"):
        state = getattr(grads.dot_general, role)
        fmt_max = float(
            jnp.finfo(jnp.float8_e5m2 if role == "output_grad" else jnp.float8_e4m3fn).max
        )
        want = 2.0 ** np.floor(np.log2(fmt_max / np.float64(state.amax_history[0])))
        np.testing.assert_allclose(float(state.scale), want, rtol=1e-6, err_msg=role)
        np.testing.assert_allclose(float(state.scale_inv), 1 / want, rtol=1e-6, err_msg=role)
        for got, expected in zip(
            jax.tree.leaves(state), jax.tree.leaves(getattr(library.dot_general, role)), strict=True
        ):
            np.testing.assert_array_equal(got, expected, err_msg=role)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"split_activation": True, "predict_lo_scale": True},
        {"predict_lo_scale": True},
        {"nf_aware": True},
        {"backward_format": "e5m2"},
    ],
    ids=["plain", "predicted-lo", "predicted-lo-whole-input", "nf-aware", "e5m2-grads"],
)
def test_residual_layer_used_twice_pairs_the_scale_with_the_larger_amax(getkey, options):
    """ResidualFP8 scales each operand by its own amax too (but the kernel under `nf_aware`,
    by 3 standard deviations): two uses' states combined by max put the larger amax beside
    the larger scale, that of the smaller amax (448 beside 7). The state must hold the scale
    of the amax it records, and a predicted W_lo scale that scale's; a scale that is not a
    function of the amax stays the one the kernel's uses computed."""
    recipe = fp8jax.ResidualFP8(**options)
    lin = eqx.nn.Linear(32, 32, key=getkey())
    linear = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(recipe=recipe))
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal((2, 4, 32)) * [[[0.3]], [[7.0]]]).astype(np.float32)
    c1, c2 = (rng.standard_normal((2, 4, 32)) * [[[3.0]], [[0.01]]]).astype(np.float32)

    def twice(m):
        return jnp.sum(jax.vmap(m)(x1) * c1) + jnp.sum(jax.vmap(m)(x2) * c2)

    grads = fp8jax.filter_grad(twice)(linear)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    merged = fp8jax.apply_updates(linear, None, overwrites)
    assert newest(grads) == {
        "input": amax(x1, x2),
        "kernel": amax(lin.weight),
        "output_grad": amax(c1, c2),
    }
    e4m3 = float(jnp.finfo(jnp.float8_e4m3fn).max)
    w = np.float64(lin.weight)
    for tree in (grads, merged):
        dot = tree.dot_general
        for role in ("input", "kernel", "output_grad"):
            state = getattr(dot, role)
            if role == "kernel" and recipe.nf_aware:
                want = e4m3 / (3.0 * w.std())
            else:  # the gradient's scale of its own format's max
                e5m2 = options.get("backward_format") == "e5m2" and role == "output_grad"
                fmax = float(jnp.finfo(jnp.float8_e5m2).max) if e5m2 else e4m3
                want = fmax / np.float64(state.amax_history[0])
            np.testing.assert_allclose(float(state.scale), want, rtol=1e-6, err_msg=role)
        if recipe.predict_lo_scale and recipe.split_activation:
            # W_lo's scale: E4M3's max over half a step of 256..448
            want = float(dot.input.scale) * e4m3 / 16.0
            np.testing.assert_allclose(float(dot.input.lo_scale), want, rtol=1e-6)
        else:  # an operand kept whole records 1 ("1 when unused"), predicted or not
            assert float(dot.input.lo_scale) == 1.0
        assert float(dot.output_grad.lo_scale) == 1.0


@pytest.mark.parametrize("grad", [eqx.filter_grad, fp8jax.filter_grad], ids=["eqx", "fp8jax"])
def test_vmap_over_batch_equals_the_batched_call(linear, grad):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 3, 8)).astype(np.float32)
    x[4, 1, 2] = 40.0  # one example holds the amax
    c = rng.standard_normal((6, 3, 4)).astype(np.float32)

    def batched(m):
        return jnp.sum(m(x) * c)

    def vmapped(m):
        return jnp.sum(jax.vmap(m)(x) * c)

    def vmapped_twice(m):
        return jnp.sum(jax.vmap(jax.vmap(m))(x) * c)

    want = grad(batched)(linear)
    assert newest(want) == {"input": 40.0, "kernel": amax(linear.weight), "output_grad": amax(c)}
    for loss in (vmapped, vmapped_twice):
        got = eqx.filter_jit(grad(loss))(linear)
        for role in ("input", "kernel", "output_grad"):
            for a, b in zip(
                jax.tree.leaves(getattr(got.dot_general, role)),
                jax.tree.leaves(getattr(want.dot_general, role)),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(got.weight, want.weight, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got.bias, want.bias, rtol=1e-6, atol=1e-7)


def test_vmapped_wgrad_is_one_gemm_over_all_tokens(linear):
    """The wgrad of `vmap(model)` contracts over the batch: no per-example outer products."""
    x = jnp.ones((32, 8))

    def loss(m):
        return jnp.sum(jax.vmap(m)(x) ** 2)

    text = eqx.filter_jit(eqx.filter_grad(loss)).lower(linear).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # forward and wgrad, each one GEMM over 32 tokens; the dgrad is unused here (the lowering
    # keeps it or not, by JAX release: XLA removes it)
    assert len(dots) in (2, 3), dots
    wgrad = [d for d in dots if "(tensor<32x4xf8E5M2>, tensor<32x8xf8E4M3FN>)" in d]
    assert len(wgrad) == 1 and "contracting_dims = [0] x [0]" in wgrad[0], wgrad
    assert all("batching_dims" not in d for d in dots), dots


def test_microbatches_in_a_scan_keep_the_max_amax(getkey):
    # Scale 1.0 on the empty history (no warm start): every microbatch is cast with the same
    # scale, so the scan equals one batch exactly. (The warm start casts each microbatch with
    # its own amax on the first step; the histories still get the max: tests/test_accumulate.)
    cold = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(warm_start=False))
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=getkey()), cold)
    rng = np.random.default_rng(2)
    k = 4
    xs = (rng.standard_normal((k, 5, 8)) * np.arange(1, k + 1)[:, None, None]).astype(np.float32)
    cs = (rng.standard_normal((k, 5, 4)) / np.arange(1, k + 1)[:, None, None]).astype(np.float32)

    def accumulated(m):
        def body(total, xc):
            x, c = xc
            return total + jnp.sum(m(x) * c), None

        return lax.scan(body, 0.0, (xs, cs))[0]

    def one_batch(m):
        return jnp.sum(m(xs.reshape(-1, 8)) * cs.reshape(-1, 4))

    got = jax.jit(fp8jax.filter_grad(accumulated))(linear)
    want = fp8jax.filter_grad(one_batch)(linear)
    assert newest(got) == {
        "input": amax(xs),
        "kernel": amax(linear.weight),
        "output_grad": amax(cs),
    }
    for a, b in zip(
        jax.tree.leaves(got.dot_general), jax.tree.leaves(want.dot_general), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got.weight, want.weight, rtol=1e-5, atol=1e-6)


def test_per_example_gradients_are_not_summed(linear):
    """vmap of fp8jax.filter_grad gives each example its own weight gradient."""
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((3, 8)).astype(np.float32)
    cs = rng.standard_normal((3, 4)).astype(np.float32)

    def loss(m, x, c):
        return jnp.sum(m(x) * c)

    per_example = jax.vmap(fp8jax.filter_grad(loss), in_axes=(None, 0, 0))(linear, xs, cs)
    for i in range(3):
        single = fp8jax.filter_grad(loss)(linear, xs[i], cs[i])
        np.testing.assert_allclose(per_example.weight[i], single.weight, rtol=1e-6, atol=1e-7)


def test_per_example_gradients_after_a_call_outside_vmap(linear):
    """vmap of a gradient already traced outside any vmap (same shapes per example) still
    gives each example its own weight gradient: the jitted gradient is not reused from that
    trace, whose GEMMs would fold the mapped axis and sum over it."""
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((3, 8)).astype(np.float32)
    cs = rng.standard_normal((3, 4)).astype(np.float32)

    def loss(m, x, c):
        return jnp.sum(m(x) * c)

    grad = fp8jax.filter_grad(loss)
    singles = [grad(linear, xs[i], cs[i]).weight for i in range(3)]  # traced first
    per_example = jax.vmap(grad, in_axes=(None, 0, 0))(linear, xs, cs).weight
    for i in range(3):
        np.testing.assert_array_equal(per_example[i], singles[i])
        exact = np.outer(cs[i].astype(np.float64), xs[i])  # FP8 operands: within ~20 %
        assert np.linalg.norm(per_example[i] - exact) <= 0.2 * np.linalg.norm(exact)


def test_per_example_gradients_take_the_batch_scales_or_each_its_own_state(getkey):
    """Under vmap(grad) with current scaling each example's weight gradient is quantized with
    the batch's scales, as in a batched step (docs/concepts.md): an example of 1e-3 beside
    one of 300 is not what it would be alone. A state per example (the model mapped too)
    gives each its own scales. Both against NumPy + ml_dtypes on the canonical GEMM."""
    from reference import current_scale, qdq_tensor

    linear = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(8, 4, key=getkey()), fp8jax.Fp8Config(recipe="current", exclude=None)
    )
    xs = np.stack([np.full(8, 1e-3), np.linspace(0.5, 1.0, 8), np.full(8, 300.0)])
    xs = xs.astype(np.float32)
    cs = np.stack([np.full(4, 1e-3), np.linspace(-1.0, 1.0, 4), np.full(4, 2.0)])
    cs = cs.astype(np.float32)

    def loss(m, x, c):
        return jnp.sum(m(x) * c)

    def wgrad(x, c, x_amax, c_amax):  # g^T x with the scales of those amaxes
        xq = qdq_tensor(x, current_scale(x_amax, "e4m3", power_of_two=True), "e4m3")
        gq = qdq_tensor(c, current_scale(c_amax, "e5m2", power_of_two=True), "e5m2")
        return np.outer(gq, xq)

    shared = jax.vmap(fp8jax.filter_grad(loss), in_axes=(None, 0, 0))(linear, xs, cs)
    dynamic, static = eqx.partition(linear, eqx.is_array)
    each = eqx.combine(jax.tree.map(lambda a: jnp.stack([a] * 3), dynamic), static)
    own = eqx.filter_vmap(fp8jax.filter_grad(loss))(each, xs, cs)
    batch_x, batch_c = np.abs(xs).max(), np.abs(cs).max()
    for i in range(3):
        batch = wgrad(xs[i], cs[i], batch_x, batch_c)
        alone = wgrad(xs[i], cs[i], np.abs(xs[i]).max(), np.abs(cs[i]).max())
        np.testing.assert_allclose(shared.weight[i], batch, rtol=1e-6, atol=0)
        np.testing.assert_allclose(own.weight[i], alone, rtol=1e-6, atol=0)
    assert not np.allclose(shared.weight[0], own.weight[0])  # the small example differs


PER_EXAMPLE_RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(block_size=16),
    "mxfp8": fp8jax.MXFP8(),
}


def _grad_of_linear(linear):
    def loss(m, x, c):
        return jnp.sum(jax.vmap(m)(x) * c)

    return lambda x, c: eqx.filter_grad(loss)(linear, x, c).weight


def _grad_of_autocast(linear):
    def loss(w, x, c):
        return jnp.sum((x @ w.T) * c)

    return lambda x, c: jax.grad(fp8jax.fp8_autocast(loss, linear.dot_general.recipe, min_dim=1))(
        linear.weight, x, c
    )


def _grad_through_remat_and_jit(linear):
    def loss(m, x, c):
        return jnp.sum(jax.checkpoint(jax.vmap(m))(x) * c)

    return lambda x, c: eqx.filter_jit(eqx.filter_grad(loss))(linear, x, c).weight


@pytest.mark.parametrize("recipe", PER_EXAMPLE_RECIPES)
@pytest.mark.parametrize("make", [_grad_of_linear, _grad_of_autocast, _grad_through_remat_and_jit])
def test_vmap_of_a_plain_gradient_keeps_each_examples_weight_gradient(getkey, recipe, make):
    """`vmap(grad(loss))` (per-example gradients) with JAX's or Equinox's own gradient: the
    wgrad of a weight the vmap does not map stays per example, where folding the mapped axis
    into the GEMM would give each example the batch's sum."""
    if make is _grad_of_autocast and recipe == "delayed":
        pytest.skip("fp8_autocast refuses recipes with state between steps")
    config = fp8jax.Fp8Config(recipe=PER_EXAMPLE_RECIPES[recipe], exclude=None)
    linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 16, use_bias=False, key=getkey()), config)
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((3, 8, 32)).astype(np.float32)
    cs = rng.standard_normal((3, 8, 16)).astype(np.float32)
    grad = make(linear)
    per_example = jax.vmap(grad)(xs, cs)
    for i in range(3):
        np.testing.assert_allclose(per_example[i], grad(xs[i], cs[i]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plain_grad_of_a_layer_used_twice_names_the_fix(linear, jit):
    """Equinox's gradient would add the two uses' amaxes: an error says what to use."""
    gc.collect()
    # Entries of earlier tests' `checkpoint`/`jit` bodies live as long as JAX caches them.
    before = len(gemm.STATE_USES)
    x = jnp.ones((5, 8))

    def twice(m):
        return jnp.sum(m(x)) + jnp.sum(m(2 * x))

    grad = eqx.filter_grad(twice)
    with pytest.raises(ValueError, match=r"runs twice .* fp8jax.filter_value_and_grad"):
        (eqx.filter_jit(grad) if jit else grad)(linear)
    params, static = eqx.partition(linear, eqx.is_array)
    with pytest.raises(ValueError, match="runs twice"):
        jax.grad(lambda p: twice(eqx.combine(p, static)))(params)
    # The same function under fp8jax's gradient, or called once per use, is fine.
    fp8jax.filter_grad(twice)(linear)
    once = eqx.filter_grad(lambda m: jnp.sum(m(x)))
    for _ in range(2):
        once(linear)
    # What the check remembers goes with the traces it was made in.
    gc.collect()
    assert len(gemm.STATE_USES) <= before


@pytest.mark.parametrize("wrap", ["checkpoint", "checkpoint_policy", "jit"])
def test_plain_grad_sees_a_layer_used_twice_inside_a_remat(linear, wrap):
    """Inside a `jax.checkpoint` body (or a nested `jit`'s) the state is a tracer of the
    body's own trace, not of the gradient's: two uses there add their amaxes all the same
    (they did, silently, where the same loss without remat raised)."""
    x = jnp.ones((5, 8))

    def twice(m):
        return jnp.sum(m(x)) + jnp.sum(m(2 * x))

    transform = {
        "checkpoint": eqx.filter_checkpoint,
        "checkpoint_policy": lambda f: eqx.filter_checkpoint(f, policy=fp8jax.save_fp8_operands),
        "jit": eqx.filter_jit,
    }[wrap]

    def wrapped(m):
        return transform(twice)(m)

    for grad in (eqx.filter_grad(wrapped), eqx.filter_jit(eqx.filter_grad(wrapped))):
        with pytest.raises(
            fp8jax.StateUsedTwiceError, match=r"runs twice .*fp8jax.filter_value_and_grad"
        ):
            grad(linear)
    # fp8jax's gradient keeps the larger use's amax, as without the remat.
    assert newest(fp8jax.filter_grad(wrapped)(linear))["input"] == amax(x, 2 * x)
    assert newest(fp8jax.filter_grad(twice)(linear)) == newest(fp8jax.filter_grad(wrapped)(linear))

    # Differentiated with respect to the input only, nothing adds: a state that should be
    # differentiated is the error to name, as without the remat; a stateless recipe's runs.
    def of_input(layer, x):
        return transform(lambda m, x: jnp.sum(m(x)) + jnp.sum(m(2 * x)))(layer, x)

    with pytest.raises(fp8jax.StateNotDifferentiatedError):
        jax.grad(of_input, argnums=1)(linear, x)
    current = fp8jax.Fp8Config(recipe="current")
    current = fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=jax.random.key(0)), current)
    want = jax.grad(lambda x: jnp.sum(current(x)) + jnp.sum(current(2 * x)))(x)
    np.testing.assert_array_equal(jax.grad(of_input, argnums=1)(current, x), want)


def test_plain_grad_raises_no_false_alarm_on_scans_vmaps_and_remat(getkey):
    """Patterns where each use has its own state, or the layer runs once per trace."""
    keys = jax.random.split(getkey(), 3)
    stacked = fp8jax.fp8_linear_layers(eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys))
    x = jnp.ones((4, 8))

    def scanned(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)

        def body(h, p):
            return jax.nn.relu(eqx.combine(p, static)(h)), None

        return jnp.sum(lax.scan(body, x, params)[0])

    def vmapped_remat(layers, x):
        first = jax.tree.map(lambda a: a[1] if eqx.is_array(a) else a, layers)
        return jnp.sum(jax.vmap(eqx.filter_checkpoint(first))(x))

    for loss in (scanned, vmapped_remat):
        grads = eqx.filter_jit(eqx.filter_grad(loss))(stacked, x)
        assert np.isfinite(np.asarray(grads.weight)).all()


def test_a_shared_reduction_with_several_results_spans_the_batch_as_one_does():
    """`batch_shared` of a reduction with two results: under `vmap` with an unbatched owner
    each spans the whole batch, with a batched owner each member keeps its own (against
    NumPy's reductions of the same arrays)."""
    from fp8jax._src.core.amax import batch_shared

    pair = batch_shared(lambda x: (jnp.max(jnp.abs(x)), jnp.min(x)), "max |x| and min x")
    x = np.arange(-12.0, 12.0, dtype=np.float32).reshape(4, 3, 2) * 1.5
    shared = jax.jit(jax.vmap(jax.vmap(pair, in_axes=(0, None)), in_axes=(0, None)))
    got = shared(x, jnp.ones(()))
    # Unbatched results, which `vmap` then broadcasts over its axes: the batch-wide values.
    np.testing.assert_array_equal(got[0], np.full((4, 3), np.abs(x).max()))
    np.testing.assert_array_equal(got[1], np.full((4, 3), x.min()))
    own = jax.vmap(pair, in_axes=(0, 0))(x, jnp.ones(4))
    np.testing.assert_array_equal(own[0], np.abs(x).reshape(4, -1).max(axis=1))
    np.testing.assert_array_equal(own[1], x.reshape(4, -1).min(axis=1))


def test_amax_and_fraction_of_no_values_are_zero():
    """`amax` and `fraction` of an empty array are 0, as documented: not an error for the max
    of nothing, nor NaN from dividing by no elements; under `vmap` too."""
    from fp8jax._src.core.amax import amax, fraction

    owner = jnp.ones(())
    for shape in [(0,), (3, 0), (0, 4)]:
        assert float(amax(jnp.zeros(shape), owner)) == 0.0, shape
        assert float(fraction(jnp.zeros(shape, bool), owner)) == 0.0, shape
    for reduce, x in ((amax, jnp.zeros((3, 0))), (fraction, jnp.zeros((3, 0), bool))):
        got = jax.vmap(reduce, in_axes=(0, None))(x, owner)
        np.testing.assert_array_equal(got, np.zeros(3, np.float32))


def test_grad_of_a_vmap_over_stacked_layers_keeps_each_layers_own_state(getkey):
    """`grad(vmap(stack))` with delayed scaling: each layer's activation (1 and 50 wide) under
    its own state; the mapped axis may not fold into one GEMM over a state per member. The
    gradients and new states of each layer are those of the layer called alone."""
    config = fp8jax.Fp8Config(recipe="delayed", exclude=None)
    stack = eqx.filter_vmap(lambda k: fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=k), config))(
        jax.random.split(getkey(), 2)
    )
    xs = np.random.default_rng(0).standard_normal((2, 5, 8)) * np.array([1.0, 50.0])[:, None, None]
    xs = xs.astype(np.float32)

    def loss(m, xs):
        return jnp.sum(eqx.filter_vmap(lambda layer, x: jax.vmap(layer)(x))(m, xs))

    def member(tree, i):
        return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)

    new = fp8jax.filter_grad(loss)(stack, xs)
    for i in range(2):
        alone = fp8jax.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x)))(member(stack, i), xs[i])
        got = jax.tree.leaves(member(new, i))
        for a, b in zip(got, jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(a, b)


def test_vmap_over_weights_alone_maps_the_gemm_per_weight(getkey):
    """`vmap` over the weights of a layer (its state and the activation shared): the mapped
    axis is not the activation's, so it may not fold into the activation's rows. The
    weights share one amax (3), so the batch's scales are each one's: each member's output
    is the layer called with that weight alone."""
    config = fp8jax.Fp8Config(recipe="current", exclude=None)
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=getkey()), config)
    rng = np.random.default_rng(1)
    ws = rng.standard_normal((3, 4, 8))
    ws *= 3.0 / np.abs(ws).max(axis=(1, 2), keepdims=True)
    ws, x = ws.astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)

    def call(w):
        return jax.vmap(eqx.tree_at(lambda m: m.weight, layer, w))(x)

    got = jax.vmap(call)(ws)
    for i in range(3):
        np.testing.assert_array_equal(got[i], call(ws[i]))

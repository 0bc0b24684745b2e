"""Gradient accumulation: k microbatches against one step over the whole batch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SAME_BITS

import fp8jax


def problem(getkey, recipe="delayed", n=64):
    mlp = eqx.nn.MLP(8, 2, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    # Rows of very different magnitudes: each microbatch has its own amax.
    x = jax.random.normal(getkey(), (n, 8)) * jnp.exp(jnp.linspace(-2, 2, n))[:, None]
    y = jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], axis=1)
    return model, x, y


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def split(grads):
    state, rest = fp8jax.partition_for_grad_overwrite(grads)
    return jax.tree.leaves(state), jax.tree.leaves(rest)


@pytest.mark.parametrize("warm_start", [False, True])
def test_matches_one_step_over_the_whole_batch(getkey, warm_start):
    """Delayed scaling: every microbatch is cast with the scales of the state, exactly as the
    whole batch would be. With the warm start, the first step (empty histories) casts each
    microbatch with its own amax, as current scaling does; the histories still record the
    whole batch's amax, so every later step matches exactly."""
    recipe = fp8jax.DelayedScaling(warm_start=warm_start)
    model, x, y = problem(getkey, recipe)
    whole = eqx.filter_jit(fp8jax.filter_value_and_grad(mse))
    accumulated = eqx.filter_jit(fp8jax.accumulate_gradients(mse, 4))
    for step in range(3):  # later steps run with histories filled by the first
        loss_1, grads_1 = whole(model, x, y)
        loss_k, grads_k = accumulated(model, x, y)
        if warm_start and step == 0:
            for a, b in zip(grads_k.layers, grads_1.layers, strict=True):
                for role in ("input", "kernel", "output_grad"):
                    np.testing.assert_array_equal(
                        getattr(a.dot_general, role).amax_history,
                        getattr(b.dot_general, role).amax_history,
                    )
            overwrites, _ = fp8jax.partition_for_grad_overwrite(grads_1)
            model = fp8jax.apply_updates(model, None, overwrites)
            continue
        assert float(loss_k) == pytest.approx(float(loss_1), rel=1e-6)
        state_1, rest_1 = split(grads_1)
        state_k, rest_k = split(grads_k)
        for a, b in zip(rest_k, rest_1, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
        # The same tensors reach the FP8 casts (the output gradients too, since each
        # microbatch's loss is divided by k): the state is that of the whole batch.
        for a, b in zip(state_k, state_1, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads_k)
        model = fp8jax.apply_updates(model, None, overwrites)


def test_current_scaling_records_the_whole_batch_amax(getkey):
    """Current scaling casts each microbatch with its own amax (so the numbers differ from one
    whole-batch step by FP8 rounding); the state still records the whole batch's amax."""
    model, x, y = problem(getkey, "current")
    _, grads_1 = eqx.filter_jit(fp8jax.filter_value_and_grad(mse))(model, x, y)
    _, grads_k = eqx.filter_jit(fp8jax.accumulate_gradients(mse, 4))(model, x, y)
    for a, b in zip(grads_k.layers, grads_1.layers, strict=True):
        np.testing.assert_array_equal(
            a.dot_general.input.amax_history, b.dot_general.input.amax_history
        )
        np.testing.assert_array_equal(
            a.dot_general.kernel.amax_history, b.dot_general.kernel.amax_history
        )
    assert float(grads_k.layers[0].dot_general.input.amax_history[0]) == float(jnp.max(abs(x)))


def test_history_gets_the_largest_microbatch_amax_once(getkey):
    model, x, y = problem(getkey, fp8jax.DelayedScaling(history_len=4))
    _, grads = eqx.filter_jit(fp8jax.accumulate_gradients(mse, 4))(model, x, y)
    history = grads.layers[0].dot_general.input.amax_history
    amaxes = [float(jnp.max(jnp.abs(part))) for part in jnp.split(x, 4)]
    assert float(history[0]) == max(amaxes)
    assert np.all(np.asarray(history[1:]) == 0)  # rolled once, not four times


def test_train_step_with_microbatches(getkey):
    model, x, y = problem(getkey)
    optimizer = optax.adam(1e-2)
    whole = fp8jax.make_train_step(mse, optimizer)
    micro = fp8jax.make_train_step(mse, optimizer, microbatches=4)
    a, b = whole.init(model), micro.init(model)
    for _ in range(3):
        a, metrics_a = whole(a, x, y)
        b, metrics_b = micro(b, x, y)
        assert float(metrics_b.loss) == pytest.approx(float(metrics_a.loss), rel=1e-5)
    for u, v in zip(
        jax.tree.leaves(eqx.filter(b.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(a.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)


def test_aux_is_stacked_over_microbatches(getkey):
    model, x, y = problem(getkey)

    def with_aux(model, x, y):
        return mse(model, x, y), jnp.mean(x)

    (loss, aux), _ = fp8jax.accumulate_gradients(with_aux, 4, has_aux=True)(model, x, y)
    np.testing.assert_allclose(aux, jnp.mean(x.reshape(4, 16, 8), axis=(1, 2)), rtol=1e-6)
    assert float(loss) == pytest.approx(float(mse(model, x, y)), rel=1e-5)
    # One microbatch stacks its aux too (it came back unstacked, shape ()), and a NumPy
    # integer is a count of microbatches (it was refused as "not an int >= 1").
    (_, one), _ = fp8jax.accumulate_gradients(with_aux, np.int64(1), has_aux=True)(model, x, y)
    assert one.shape == (1,)  # assert_array_equal broadcasts a shape-() aux: not enough
    np.testing.assert_array_equal(one, jnp.mean(x)[None])
    (_, two), _ = fp8jax.accumulate_gradients(with_aux, np.int64(2), has_aux=True)(model, x, y)
    assert two.shape == (2,)
    step = fp8jax.make_train_step(mse, optax.sgd(0.1), microbatches=np.int32(2))
    assert step.microbatches == 2 and type(step.microbatches) is int


def test_accumulation_errors(getkey):
    model, x, y = problem(getkey)
    with pytest.raises(ValueError, match="microbatches=0"):
        fp8jax.accumulate_gradients(mse, 0)
    with pytest.raises(ValueError, match="size 64 does not split into 5"):
        fp8jax.accumulate_gradients(mse, 5)(model, x, y)
    with pytest.raises(ValueError, match="microbatches=2.5"):
        fp8jax.make_train_step(mse, optax.sgd(0.1), microbatches=2.5)
    # has_aux with a scalar loss: the message names what came back, not a tracer's class.
    step = fp8jax.make_train_step(mse, optax.sgd(0.1), has_aux=True)
    with pytest.raises(ValueError, match=r"returned an array of shape \(\), not a pair"):
        step(step.init(model), x, y)


@pytest.mark.parametrize("batch", [(), (None,), ({},)])
def test_microbatches_of_a_batch_without_arrays_are_refused_by_name(batch, getkey):
    model, _, _ = problem(getkey)

    def loss(model, *batch):
        return jnp.sum(model.layers[0].weight ** 2)

    for run in (
        fp8jax.accumulate_gradients(loss, 2),
        fp8jax.make_train_step(loss, optax.sgd(0.1), microbatches=2),
    ):
        state = run.init(model) if hasattr(run, "init") else model
        with pytest.raises(ValueError, match="microbatches=2: the batch holds no array to split"):
            run(state, *batch)


def test_a_loss_not_matching_has_aux_is_refused_by_name(getkey):
    model, x, y = problem(getkey)

    def pair(model, x, y):
        return mse(model, x, y), jnp.zeros(())

    with pytest.raises(TypeError, match=r"has_aux=True\): fun returned an array of shape \(\)"):
        fp8jax.accumulate_gradients(mse, 2, has_aux=True)(model, x, y)
    with pytest.raises(TypeError, match="fun returned a tuple of 2, not a scalar loss"):
        fp8jax.accumulate_gradients(pair, 2)(model, x, y)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_unrolled_microbatches_compute_what_the_scan_does(getkey, recipe):
    """`unroll` changes how XLA runs the microbatches, not what they compute (3 microbatches:
    the first traced apart, the other two unrolled): the FP8 state
    bit for bit with the rolled scan's, the loss and gradients within float32 rounding of
    their largest element (XLA may sum a float32 GEMM in another order in straight-line code:
    seen, 2^-25 of it; an FP8 value rounded the other way would be 2^-4)."""
    model, x, y = problem(getkey, recipe, n=48)

    def run(unroll):
        step = fp8jax.accumulate_gradients(mse, 3, unroll=unroll)
        return eqx.filter_jit(step, compiler_options=SAME_BITS or None)(model, x, y)

    (loss, grads) = run(1)
    state, rest = split(grads)
    (loss_u, grads_u) = run(True)
    state_u, rest_u = split(grads_u)
    for a, b in zip(state_u, state, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip([loss_u, *rest_u], [loss, *rest], strict=True):
        bound = 2.0**-20 * float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=bound)


def test_unroll_takes_numpy_integers_as_microbatches_does(getkey):
    """lax.scan's unroll, like microbatches, may be a NumPy integer: the same step as the int."""
    model, x, y = problem(getkey, n=8)
    want = fp8jax.accumulate_gradients(mse, 2, unroll=2)(model, x, y)
    got = fp8jax.accumulate_gradients(mse, np.int32(2), unroll=np.int64(2))(model, x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    step = fp8jax.make_train_step(
        mse, optax.sgd(0.1), microbatches=np.int64(2), unroll_microbatches=np.int64(2)
    )
    _, metrics = step(step.init(model), x, y)
    np.testing.assert_allclose(metrics.loss, want[0], rtol=1e-6)


def test_unrolled_microbatches_quantize_each_weight_once_on_h100():
    """Why `unroll` exists: compiled for an H100, the scan quantizes a blockwise weight in
    every microbatch (its one-pass weight kernel runs 4 times); unrolled, XLA computes it
    once for all 4 (and the step moves fewer bytes)."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless

    layer = eqx.nn.Linear(256, 512, key=jax.random.PRNGKey(0))
    model = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(recipe="blockwise"))
    model = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) and a.ndim == 2 else a,
        model,
    )
    x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)

    def weight_kernels(unroll):
        step = fp8jax.accumulate_gradients(loss, 4, unroll=unroll)
        lowered, _ = deviceless.lower(step, (model, x), {}, deviceless.h100_topology().devices[0])
        cost = fp8jax.hlo_cost(lowered.compile().as_text())
        runs = sum(k.runs for k in cost.kernels if "fp8jax_quantize_blocks" in k.op_name)
        return runs, cost.total_bytes

    (rolled, rolled_bytes), (unrolled, unrolled_bytes) = weight_kernels(1), weight_kernels(True)
    assert (rolled, unrolled) == (4, 1)
    assert unrolled_bytes < rolled_bytes


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp8"])
def test_state_pairs_the_scale_with_the_recorded_amax(getkey, recipe):
    """Recipes that scale each tensor by its own amax record that amax and the scale it gives.
    Accumulated, the state is the largest microbatch's, as one step over the whole batch: the
    scale came from the smallest microbatch's amax, the amax from the largest (a scale 128x
    too large beside its amax in telemetry and in the layer's merged state)."""
    model, x, y = problem(getkey, recipe)
    _, grads = eqx.filter_jit(fp8jax.accumulate_gradients(mse, 4))(model, x, y)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    merged = fp8jax.apply_updates(model, None, overwrites)
    # The first layer's input is x itself: its amax, independently, is max |x|.
    assert float(grads.layers[0].dot_general.input.amax_history[0]) == float(jnp.max(abs(x)))
    for tree in (grads, merged):
        for layer in tree.layers:
            for role in ("input", "kernel", "output_grad"):
                state = getattr(layer.dot_general, role)
                e5m2 = recipe == "current" and role == "output_grad"
                fmt_max = float(jnp.finfo(jnp.float8_e5m2 if e5m2 else jnp.float8_e4m3fn).max)
                exact = fmt_max / np.float64(state.amax_history[0])
                want = 2.0 ** np.floor(np.log2(exact)) if recipe == "current" else exact
                np.testing.assert_allclose(float(state.scale), want, rtol=1e-6, err_msg=role)
                if tree is merged:
                    np.testing.assert_allclose(float(state.scale_inv), 1 / want, rtol=1e-6)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_one_microbatch_refuses_a_loss_not_matching_has_aux_as_several_do(getkey, microbatches):
    """One microbatch runs no scan, but checks what `fun` returns as several do: the error
    names what came back and the fix (it was JAX's, naming a tracer)."""
    model, x, y = problem(getkey, n=12)

    def pair(model, x, y):
        return mse(model, x, y), jnp.zeros(())

    with pytest.raises(TypeError, match=r"has_aux=True\): fun returned an array of shape \(\)"):
        fp8jax.accumulate_gradients(mse, microbatches, has_aux=True)(model, x, y)
    with pytest.raises(TypeError, match="fun returned a tuple of 2, not a scalar loss"):
        fp8jax.accumulate_gradients(pair, microbatches)(model, x, y)
    # The loss and gradients of one microbatch are those of one whole-batch step, bit for bit.
    loss, grads = fp8jax.accumulate_gradients(mse, 1)(model, x, y)
    want_loss, want = fp8jax.filter_value_and_grad(mse)(model, x, y)
    assert float(loss) == float(want_loss)
    for u, v in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(u, v)


def test_a_batch_that_does_not_split_is_refused_naming_the_argument_and_the_counts(getkey):
    model, x, y = problem(getkey, n=12)
    # The counts that would split 12 rows, found by trial here.
    fits = [k for k in range(1, 13) if 12 % k == 0]
    with pytest.raises(ValueError) as error:
        fp8jax.accumulate_gradients(mse, 5)(model, x, y)
    text = str(error.value)
    assert "microbatches=5: batch argument [0]: a batch axis of size 12" in text
    assert "does not split into 5 equal microbatches" in text
    assert ", ".join(map(str, fits[:-1])) + f" or {fits[-1]}" in text
    with pytest.raises(ValueError, match=r"batch argument \[1\]\['y'\]: a batch axis of size 6 "):
        fp8jax.accumulate_gradients(lambda m, x, d: mse(m, x, d["y"]), 4)(model, x, {"y": y[:6]})


@pytest.mark.parametrize("microbatches", [1, 2])
def test_batch_arguments_passed_by_keyword_are_refused_by_name(getkey, microbatches):
    """Keyword arguments were refused as `mse() got an unexpected keyword argument 'y'`,
    though `mse` takes `y`: the error now says that the batch goes positionally."""
    model, x, y = problem(getkey, n=8)
    run = fp8jax.accumulate_gradients(mse, microbatches)
    with pytest.raises(TypeError, match=r"accumulate_gradients: keyword argument\(s\) y"):
        run(model, x, y=y)
    loss, _ = run(model, x, y)  # positionally, as the error asks
    assert float(loss) == pytest.approx(float(mse(model, x, y)), rel=1e-6)


@pytest.mark.parametrize("temperature", [2.0, np.float32(2.0)])
def test_a_scalar_beside_the_batch_goes_whole_to_every_microbatch(getkey, temperature):
    """A scalar batch argument (a temperature) was refused as 'must be an array with a leading
    batch axis', though the step without microbatches takes it: it has no batch axis to cut,
    so each microbatch gets it whole. Against the microbatches' steps run by hand, each on
    its half of the loss (as the whole batch's output gradients are halves of a half's):
    gradients summed, the FP8 state's newest amax their max."""
    recipe = fp8jax.DelayedScaling(warm_start=False)
    model, x, y = problem(getkey, recipe, n=8)

    def loss(model, x, t, y):
        return mse(model, x, y) * t

    loss_k, grads_k = fp8jax.accumulate_gradients(loss, 2)(model, x, temperature, y)
    half = fp8jax.filter_value_and_grad(lambda *args: loss(*args) / 2)
    parts = [half(model, x[i : i + 4], 2.0, y[i : i + 4]) for i in (0, 4)]
    assert float(loss_k) == pytest.approx(sum(float(p[0]) for p in parts), rel=1e-6)
    (state_a, rest_a), (state_b, rest_b) = (split(p[1]) for p in parts)
    state_k, rest_k = split(grads_k)
    for got, a, b in zip(rest_k, rest_a, rest_b, strict=True):
        np.testing.assert_allclose(got, np.float64(a) + np.float64(b), rtol=1e-5, atol=1e-7)
    amaxes = [s for s in state_k if s.ndim == 1]  # the histories' newest amax, first
    wanted = [np.maximum(a, b) for a, b in zip(state_a, state_b, strict=True) if a.ndim == 1]
    assert len(amaxes) == 9  # input, kernel and output gradient of each of three layers
    for got, want in zip(amaxes, wanted, strict=True):
        np.testing.assert_array_equal(got[0], want[0])
    step = fp8jax.make_train_step(loss, optax.sgd(0.1), microbatches=2)
    _, metrics = step(step.init(model), x, temperature, y)
    assert float(metrics.loss) == pytest.approx(float(loss_k), rel=1e-6)

"""make_train_step: policies, loss scaling and skipped steps, against the explicit pieces."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import U_BF16, U_F32, assert_bf16_linear, h100_topology, make_train_step

import fp8jax


def data(key, n=64):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, 8))
    y = jnp.tanh(x @ jax.random.normal(kw, (8, 1)))
    return x, y


def mse(model, x, y):
    pred = jax.vmap(model)(x.astype(jnp.result_type(model.layers[0].weight)))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def bits(tree):
    """Every array leaf as raw bytes: equal bits, not merely equal values (NaN included)."""
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_matches_the_explicit_step(getkey):
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed"))
    x, y = data(getkey())
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    train_step = fp8jax.make_train_step(mse, optimizer)
    state = train_step.init(model)
    explicit = eqx.filter_jit(make_train_step(mse, optimizer))
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    for _ in range(4):
        state, metrics = train_step(state, x, y)
        model, opt_state, loss = explicit(model, opt_state, x, y)
        assert float(metrics.loss) == pytest.approx(float(loss), rel=1e-6)
        assert bool(metrics.grads_finite)
    got = jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    states = [m.dot_general for m in state.model.layers]
    refs = [m.dot_general for m in model.layers]
    for a, b in zip(states, refs, strict=True):  # amaxes exactly: same tensors, same casts
        np.testing.assert_array_equal(a.input.amax_history, b.input.amax_history)
    assert int(state.step) == 4


def test_bfloat16_compute_keeps_float32_masters_and_state(getkey):
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp)
    x, y = data(getkey())
    seen = []

    def loss_fn(model, x, y):
        seen.append(model.layers[0].weight.dtype)
        seen.append(model.layers[0].dot_general.input.scale.dtype)
        seen.append(model.layers[0].compute_dtype)
        assert x.dtype == jnp.bfloat16  # the batch cast with the model
        pred = jax.vmap(model)(x)
        # The same forward layer by layer, for the check of each layer's numerics below.
        trace, h = [], x
        for i, layer in enumerate(model.layers):
            out = jax.vmap(layer)(h)
            trace.append((h, out))
            h = model.activation(out) if i + 1 < len(model.layers) else out
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2), (trace, pred)

    train_step = fp8jax.make_train_step(
        loss_fn,
        optax.adam(1e-2),
        policy="params=float32,compute=bfloat16,output=float32",
        has_aux=True,
    )
    state = train_step.init(model)
    losses = []
    for step in range(20):
        before = state.model
        state, metrics = train_step(state, x, y)
        losses.append(float(metrics.loss))
        if step >= 2:
            continue
        # Steps 0 (scales 1: empty histories) and 1 (scales from step 0's amaxes): each
        # layer's BF16 output is the float64 product of its E4M3-rounded BF16 operands.
        trace, pred = metrics.aux
        assert pred.dtype == jnp.bfloat16 and before.activation is jax.nn.relu
        for old, new, (layer_in, layer_out) in zip(
            before.layers, state.model.layers, trace, strict=True
        ):
            assert layer_in.dtype == layer_out.dtype == jnp.bfloat16
            # The new state's scales are the ones this step quantized with.
            sx, sw = float(new.dot_general.input.scale), float(new.dot_general.kernel.scale)
            # The weight quantized from its float32 master (the policy leaves FP8 layers'
            # weights uncast), the bias cast.
            assert_bf16_linear(
                layer_out, layer_in, old.weight, old.bias.astype(jnp.bfloat16), sx, sw
            )
        np.testing.assert_array_equal(trace[-1][1], pred)
        # The float32 loss of the predictions: 64 squares summed, then divided. XLA may feed
        # it the predictions before their BF16 rounding (excess precision), off by d <= u|p|
        # each, which moves a square (p - y)**2 by at most (2|p - y| + d) d. The targets
        # reach the loss in BF16, cast with the rest of the batch.
        y16 = np.asarray(y.astype(jnp.bfloat16), np.float64)
        p, r = np.asarray(pred, np.float64), np.asarray(pred, np.float64) - y16
        want, d = np.mean(r**2), U_BF16 * np.abs(p) / (1 - U_BF16)
        bound = np.mean((2 * np.abs(r) + d) * d) + (len(x) + 2) * U_F32 * want
        assert abs(float(metrics.loss) - want) <= bound
    # Compute cast, but the FP8 layers' masters, which their GEMMs quantize (the layers
    # compute in BF16); FP8 state left alone (float32, viewed in the max-combining dtype).
    assert seen[0] == jnp.float32 and str(seen[1]) == "max_f32" and seen[2] == jnp.bfloat16
    assert metrics.loss.dtype == jnp.float32
    assert state.model.layers[0].weight.dtype == jnp.float32
    assert state.model.layers[0].dot_general.kernel.amax_history.dtype == jnp.float32
    # The masters keep what BF16 cannot hold: Adam's steps of 1e-2 on weights of about 0.3.
    for layer in state.model.layers:
        w = np.asarray(layer.weight)
        assert np.any(w != w.astype(jnp.bfloat16).astype(np.float32))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_float16_gradients_underflow_without_loss_scaling(fp8, getkey):
    """A loss this small (a mean over many tokens, say) has float16 gradients below 2**-24."""
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp) if fp8 else mlp
    x, y = data(getkey())

    def tiny_loss(model, x, y):
        return 1e-7 * mse(model, x, y)

    policy = "params=float32,compute=float16,output=float32"
    results = {}
    for name, scale in (("none", None), ("dynamic", fp8jax.DynamicLossScale())):
        train_step = fp8jax.make_train_step(
            tiny_loss, optax.adam(1e-2), policy=policy, loss_scale=scale
        )
        state = train_step.init(model)
        first = None
        for _ in range(40):
            state, metrics = train_step(state, x, y)
            first = float(metrics.loss) if first is None else first
            assert bool(metrics.grads_finite)
        results[name] = (first, float(metrics.loss), state)
    first, last, state = results["none"]
    unchanged = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    # Every gradient flushed to zero: Adam never moved a weight.
    before = jax.tree.leaves(eqx.filter(fp8jax.Policy().cast_to_param(model), eqx.is_inexact_array))
    weights = [(a, b) for a, b in zip(unchanged, before, strict=True) if a.ndim == 2]
    assert all(np.array_equal(a, b) for a, b in weights)
    first, last, state = results["dynamic"]
    assert last < 0.3 * first
    assert float(state.loss_scale.loss_scale) == 2.0**15  # never overflowed: no backoff
    assert int(state.loss_scale.skipped_steps) == 0


@pytest.mark.parametrize("scale", [2.0**15, 2.0**16, 2.0**24])
def test_a_float16_output_takes_a_loss_scale_past_its_max(scale, getkey):
    """With `output=float16` the loss was cast to float16 and then scaled in it: the scaled
    loss's gradient with respect to that float16 loss is the scale, inf past float16's max
    (65504), and every gradient was inf. The loss as loss_fn returned it (float32) is scaled
    now, and the step matches SGD on the float64 gradient computed by hand."""
    model, x, train_step = _linear_step(getkey, "float16", fp8jax.StaticLossScale(scale))
    state, metrics = train_step(train_step.init(model), x)
    assert bool(metrics.grads_finite) and metrics.loss.dtype == jnp.float16
    out = _check_sgd_by_hand(model, x, state.model)
    assert float(metrics.loss) == np.float16(np.mean(out**2))


_LR = 1e-2


def _linear_step(getkey, output, loss_scale):
    """A Linear, its batch, and an SGD step of `mean(out**2)` under `output`'s policy."""
    model = eqx.nn.Linear(8, 2, key=getkey())
    x = jax.random.normal(getkey(), (16, 8))

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    policy = f"params=float32,compute=float32,output={output}"
    step = fp8jax.make_train_step(loss_fn, optax.sgd(_LR), policy=policy, loss_scale=loss_scale)
    return model, x, step


def _check_sgd_by_hand(before, x, after):
    """`after` is `before` after one SGD step on the float64 gradient computed by hand;
    returns the float64 outputs."""
    w, b, x64 = (np.asarray(a, np.float64) for a in (before.weight, before.bias, x))
    out = x64 @ w.T + b
    d_out = 2 * out / out.size  # d mean(out**2) / d out
    np.testing.assert_allclose(after.weight, w - _LR * d_out.T @ x64, rtol=1e-6)
    np.testing.assert_allclose(after.bias, b - _LR * d_out.sum(0), rtol=1e-6)
    return out


@pytest.mark.parametrize("make", [fp8jax.StaticLossScale, fp8jax.DynamicLossScale])
def test_a_bfloat16_output_leaves_a_loss_scale_unrounded(make, getkey):
    """With `output=bfloat16` the loss was scaled in bfloat16: the gradient reaching
    loss_fn's float32 loss was the scale rounded to 8 bits (3000 -> 3008), and every
    gradient was 0.27 % too large after unscaling. Three SGD steps match SGD on the float64
    gradient computed by hand."""
    model, x, train_step = _linear_step(getkey, "bfloat16", make(3000.0))
    state = train_step.init(model)
    for _ in range(3):
        before = state.model
        state, metrics = train_step(state, x)
        assert bool(metrics.grads_finite) and float(metrics.loss_scale) == 3000.0
        _check_sgd_by_hand(before, x, state.model)


@pytest.mark.parametrize("where", ["gradient", "activation"])
@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_nonfinite_steps_are_skipped_with_nothing_changed(where, value, getkey):
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed"))
    x, y = data(getkey())

    def loss_fn(model, x, y, poison):
        # poison = 0 normally; inf or nan gives the first weight a non-finite gradient.
        return mse(model, x, y) + poison * jnp.sum(model.layers[0].weight)

    train_step = fp8jax.make_train_step(
        loss_fn,
        optax.adamw(1e-2),
        policy="params=float32,compute=float16,output=float32",
        loss_scale=fp8jax.DynamicLossScale(),
    )
    state = train_step.init(model)
    for _ in range(3):  # a few good steps first: Adam moments and FP8 histories are not zero
        state, metrics = train_step(state, x, y, 0.0)
    assert float(state.loss_scale.loss_scale) == 2.0**15 and bool(metrics.grads_finite)
    bad_x = x.at[3, 1].set(value) if where == "activation" else x
    poison = value if where == "gradient" else 0.0
    new, metrics = train_step(state, bad_x, y, poison)
    assert not bool(metrics.grads_finite)
    assert float(new.loss_scale.loss_scale) == 2.0**14  # backed off by half
    # Weights, optimizer state and FP8 state as they were, bit for bit, but for delayed
    # scaling's output-gradient histories, which follow the loss scale (halved).
    assert bits((new.model, new.opt_state)) != bits((state.model, state.opt_state))
    kept = fp8jax.rescale_gradient_states(state.model, 0.5)
    assert bits((new.model, new.opt_state)) == bits((kept, state.opt_state))
    assert int(new.loss_scale.skipped_steps) == 1 and int(new.loss_scale.counter) == 0
    assert int(new.step) == int(state.step) + 1
    # And training goes on from there.
    after, metrics = train_step(new, x, y, 0.0)
    assert bool(metrics.grads_finite)
    assert bits(after.model) != bits(new.model)


@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_a_skipped_step_counts_its_rejected_fp8_updates(value, getkey):
    """A step skipped because an FP8 operand held an inf or NaN keeps everything as it was
    but telemetry's counts of rejected updates, which count it as the layers' own merge does
    (the explicit step, which skips nothing). The skip reverted them too: the report's
    "non-finite steps" stayed 0 under make_train_step."""
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(telemetry=True))
    x, y = data(getkey())
    bad_x = x.at[3, 1].set(value)
    optimizer = optax.sgd(1e-2)
    train_step = fp8jax.make_train_step(mse, optimizer)
    explicit = eqx.filter_jit(make_train_step(mse, optimizer))
    state, _ = train_step(train_step.init(model), x, y)

    def counts(model):
        return {
            (name, role): np.asarray(getattr(layer, role).rejected)
            for name, layer in fp8jax.telemetry(model).items()
            for role in ("input", "kernel", "output_grad")
        }

    def rest(model):  # every leaf but the counts, as raw bytes
        leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
        return [
            np.asarray(a).tobytes()
            for path, a in leaves
            if not jax.tree_util.keystr(path).endswith(".rejected")
        ]

    for n in (1, 2):
        reference = explicit(state.model, state.opt_state, bad_x, y)[0]
        new, metrics = train_step(state, bad_x, y)
        assert not bool(metrics.grads_finite)
        got, want = counts(new.model), counts(reference)
        assert want[("layers.0", "input")] == n  # the faulty operand, counted each time
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
        assert rest(new.model) == rest(state.model)
        state = new


def test_aux_output_and_metrics(getkey):
    model = eqx.nn.MLP(8, 1, 16, 1, key=getkey())
    x, y = data(getkey())

    def loss_fn(model, x, y):
        loss = mse(model, x, y)
        return loss, {"double": 2 * loss}

    train_step = fp8jax.make_train_step(loss_fn, optax.sgd(0.1), has_aux=True)
    state, metrics = train_step(train_step.init(model), x, y)
    assert float(metrics.aux["double"]) == pytest.approx(2 * float(metrics.loss))
    assert float(metrics.loss_scale) == 1.0


def test_optimizer_reading_the_loss_gets_it_as_value(getkey):
    """An optax transformation that reads the loss (optax's extra argument `value`) gets the
    step's loss, as in the same step written with optax by hand."""
    mlp = eqx.nn.MLP(8, 1, 16, 1, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed"))
    x, y = data(getkey())
    # rtol=0.5: any step that does not halve the loss is a plateau; the scale then halves.
    plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5, rtol=0.5)
    optimizer = optax.chain(optax.sgd(0.1), plateau)
    train_step = fp8jax.make_train_step(mse, optimizer)
    state = train_step.init(model)

    @eqx.filter_jit
    def by_hand(model, opt_state, x, y):
        loss, grads = fp8jax.filter_value_and_grad(mse)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        params = eqx.filter(fp8jax.partition_for_grad_overwrite(model)[1], eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    opt_state = optimizer.init(
        eqx.filter(fp8jax.partition_for_grad_overwrite(model)[1], eqx.is_inexact_array)
    )
    for _ in range(4):
        state, metrics = train_step(state, x, y)
        model, opt_state, loss = by_hand(model, opt_state, x, y)
        assert float(metrics.loss) == pytest.approx(float(loss), rel=1e-6)
    assert float(state.opt_state[1].scale) == float(opt_state[1].scale) < 1.0
    got = jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_aux_over_microbatches_is_stacked_numbers_too(getkey):
    """Over microbatches aux is stacked: a Python number among it (a count) becomes an array
    of one per microbatch; a leaf that is no number is named."""
    model = eqx.nn.MLP(8, 1, 16, 1, key=getkey())
    x, y = data(getkey())

    def loss_fn(model, x, y):
        return mse(model, x, y), {"rows": x.shape[0], "loss": mse(model, x, y)}

    step = fp8jax.make_train_step(loss_fn, optax.sgd(0.1), has_aux=True, microbatches=4)
    _, metrics = step(step.init(model), x, y)
    np.testing.assert_array_equal(metrics.aux["rows"], [16] * 4)
    assert float(jnp.mean(metrics.aux["loss"])) == pytest.approx(float(metrics.loss))
    step = fp8jax.make_train_step(
        lambda m, x, y: (mse(m, x, y), {"tag": "hi"}), optax.sgd(0.1), has_aux=True, microbatches=2
    )
    with pytest.raises(TypeError, match=r"microbatches=2\): aux\['tag'\] is a str"):
        step(step.init(model), x, y)


def test_a_jmp_policy_is_refused_naming_its_type_and_its_dtypes():
    """jmp's Policy prints as "Policy(...)": the error said "policy=Policy(...): should be a
    Policy". It now says whose Policy it is and gives the fp8jax spec of its dtypes."""
    jmp = pytest.importorskip("jmp")
    theirs = jmp.get_policy("p=f32,c=bf16,o=f16")
    with pytest.raises(TypeError, match=r"is a jmp\..*Policy, not an fp8jax\.Policy") as info:
        fp8jax.make_train_step(mse, optax.sgd(0.1), policy=theirs)
    spec = str(info.value).rsplit("dtypes are ", 1)[1].strip(".'")
    with pytest.raises(TypeError, match=r"Policy'> is a type, .* pass an instance\.$"):
        fp8jax.make_train_step(mse, optax.sgd(0.1), policy=fp8jax.Policy)  # the class
    ours = fp8jax.Policy.from_string(spec)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    )


def test_train_step_errors(getkey):
    model = eqx.nn.MLP(8, 1, 16, 1, key=getkey())
    x, y = data(getkey())
    with pytest.raises(TypeError, match="policy=3"):
        fp8jax.make_train_step(mse, optax.sgd(0.1), policy=3)
    with pytest.raises(TypeError, match="loss_scale=2.0"):
        fp8jax.make_train_step(mse, optax.sgd(0.1), loss_scale=2.0)
    with pytest.raises(TypeError, match="optimizer="):
        fp8jax.make_train_step(mse, lambda g: g)
    train_step = fp8jax.make_train_step(lambda m, x, y: jax.vmap(m)(x), optax.sgd(0.1))
    with pytest.raises(ValueError, match="scalar loss"):
        train_step(train_step.init(model), x, y)
    pair = fp8jax.make_train_step(lambda m, x, y: (mse(m, x, y), {}), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"returned a tuple of 2.*pass has_aux=True"):
        pair(pair.init(model), x, y)
    with pytest.raises(TypeError, match="train_step.init"):
        train_step(model, x, y)


def test_compiles_with_fp8jax_s_gpu_options_by_default(getkey, tmp_path):
    """The step's own executable gets the options (nothing global): XLA records them in the
    debug options it dumps, on the CPU as on a GPU."""
    model = fp8jax.fp8_linear_layers(eqx.nn.MLP(8, 1, 32, 2, key=getkey()))
    x, y = data(getkey())
    default = fp8jax.make_train_step(mse, optax.sgd(1e-2))
    assert dict(default.compiler_options) == fp8jax.gpu_compiler_options()
    dumped = fp8jax.make_train_step(
        mse,
        optax.sgd(1e-2),
        compiler_options={**fp8jax.gpu_compiler_options(), "xla_dump_to": str(tmp_path)},
    )
    state, _ = dumped(dumped.init(model), x, y)
    (options,) = [p for p in tmp_path.iterdir() if p.name.endswith("_step.debug_options")]
    assert "xla_gpu_enable_triton_gemm: false" in options.read_text()
    # Traced for cuBLAS, the step compiles with XLA's dot merger off (`traced_options`).
    assert "xla_gpu_dot_merger_threshold_mb: 0" in options.read_text()
    # The same step with XLA's defaults gives the same numbers (on a CPU the option is moot).
    plain = fp8jax.make_train_step(mse, optax.sgd(1e-2), compiler_options={})
    expected, _ = plain(plain.init(model), x, y)
    assert bits(state.model) == bits(expected.model)
    # Inside the caller's own jit the step is part of the caller's executable (JAX refuses
    # options on a nested jit); same numbers.
    nested, _ = eqx.filter_jit(lambda s: default(s, x, y))(default.init(model))
    assert bits(nested.model) == bits(expected.model)
    # A NumPy flag (read from a config array) is its Python value: Triton GEMMs turned off by
    # np.False_ trace the step for cuBLAS as False does (the check is by identity).
    numpy_flags = fp8jax.make_train_step(
        mse, optax.sgd(1e-2), compiler_options={"xla_gpu_enable_triton_gemm": np.False_}
    )
    (flag,) = dict(numpy_flags.compiler_options).values()
    assert flag is False
    for bad in ([("xla_gpu_enable_triton_gemm", False)], {"xla_dump_to": None}, {1: True}):
        with pytest.raises(TypeError, match="compiler_options="):
            fp8jax.make_train_step(mse, optax.sgd(1e-2), compiler_options=bad)


def test_steps_traced_for_cublas_compile_without_the_dot_merger():
    """`traced_for` traces a step for cuBLAS where its options turn Triton GEMMs off and do
    not turn XLA's dot merger on; `traced_options` then adds the merger off (it would make
    BF16 GEMMs of a shared layer's FP8 ones: test_lowering) and otherwise keeps the options
    as given."""
    from fp8jax._src.core.compile_options import (
        DOT_MERGER,
        is_cublas_traced,
        traced_for,
        traced_options,
    )

    gpu = fp8jax.gpu_compiler_options()
    on = {**gpu, DOT_MERGER: 32}
    triton = {"xla_gpu_enable_triton_gemm": True}
    cases = {  # options: (traced for cuBLAS, compiled with)
        "gpu_compiler_options": (gpu, True, {**gpu, DOT_MERGER: 0}),
        "merger off already": ({**gpu, DOT_MERGER: 0}, True, {**gpu, DOT_MERGER: 0}),
        "merger on": (on, False, on),
        "XLA defaults": ({}, False, {}),
        "Triton GEMMs on": (triton, False, triton),
    }
    for name, (options, cublas, compiled) in cases.items():
        assert traced_for(options, is_cublas_traced)() is cublas, name
        assert traced_options(options) == compiled, name
    assert DOT_MERGER not in gpu  # a user's own jit with these options keeps XLA's default


def test_gpu_options_are_triton_gemms_off_in_a_new_dict_each_call():
    """`gpu_compiler_options` is Triton GEMMs off, in a new dict each call (adding to it is
    safe, its doc says), and `gpu_xla_flags` that option as its doc's shell line spells it."""
    options = fp8jax.gpu_compiler_options()
    assert options == {"xla_gpu_enable_triton_gemm": False}
    options["xla_dump_to"] = "/nowhere"
    assert fp8jax.gpu_compiler_options() == {"xla_gpu_enable_triton_gemm": False}
    assert fp8jax.gpu_xla_flags() == "--xla_gpu_enable_triton_gemm=false"


def test_fp8_states_are_checked_finite_together_on_h100(monkeypatch):
    """The step checks its new FP8 states for inf and NaN in one reduction over the small
    leaves (`states_finite`): on a deviceless H100, fewer kernels in both programs than
    with a reduction per leaf (the check before session 45), the same GEMMs."""
    from fp8jax._src.train import loss_scale, step

    h100_topology()
    mlp = eqx.filter_eval_shape(eqx.nn.MLP, 256, 256, 1024, 2, key=jax.random.key(0))
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed", exclude=None))
    train_step = fp8jax.make_train_step(mse, optax.adam(1e-3))
    state = eqx.filter_eval_shape(train_step.init, model)
    x, y = (jax.ShapeDtypeStruct((512, 256), jnp.float32) for _ in range(2))

    def kernels():
        report = fp8jax.inspect(train_step, state, x, y, modes=("cublas",))
        return [
            (len(r.cost["cublas"].kernels), r.count("cublas")) for r in (report, report.first_steps)
        ]

    together = kernels()
    per_leaf = lambda states: loss_scale.all_finite(jax.tree.leaves(states))  # noqa: E731
    monkeypatch.setattr(step, "states_finite", per_leaf)
    alone = kernels()
    assert [c for _, c in together] == [c for _, c in alone] == [(8, 8)] * 2  # 3 Linears
    assert all(a < b for (a, _), (b, _) in zip(together, alone, strict=True)), (together, alone)


def test_gpu_options_as_flags_are_accepted_by_xla():
    """`gpu_xla_flags` spells the same options; XLA aborts on unknown flags, so a process
    started with them and compiling a step proves them valid."""
    import os
    import subprocess
    import sys

    flags = fp8jax.gpu_xla_flags()
    parsed = dict(flag.removeprefix("--").split("=") for flag in flags.split())
    options = fp8jax.gpu_compiler_options()
    assert parsed == {k: str(v).lower() for k, v in options.items()}
    code = "import jax, jax.numpy as jnp; print(jax.jit(lambda a: a @ a)(jnp.eye(2))[0, 0])"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "1.0", run.stderr[-2000:]
    bad = {**env, "XLA_FLAGS": "--xla_gpu_enable_triton_gemm_not_a_flag=false"}
    run = subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True)
    assert run.returncode != 0  # the check above can fail


def test_gpu_xla_flags_as_documented_keep_the_user_s_own_flags():
    """The line `gpu_xla_flags`'s docstring gives for setting `XLA_FLAGS` keeps the flags a
    user set before (here 3 CPU devices) and adds fp8jax's: run as written, in a process
    started with the user's flags."""
    import os
    import re
    import subprocess
    import sys

    line = re.search(r'`(os\.environ\["XLA_FLAGS"\] = [^`]*)`', fp8jax.gpu_xla_flags.__doc__)
    assert line is not None, fp8jax.gpu_xla_flags.__doc__
    code = (
        f"import os, fp8jax\n{line[1]}\nimport jax\n"
        "print(jax.device_count(), os.environ['XLA_FLAGS'])"
    )
    user = "--xla_force_host_platform_device_count=3"
    env = {**os.environ, "XLA_FLAGS": user, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    count, flags = run.stdout.strip().splitlines()[-1].split(" ", 1)
    assert count == "3", run.stdout  # the user's flag still holds
    assert flags.split() == [user, *fp8jax.gpu_xla_flags().split()]


BF16_POLICY = "params=float32,compute=bfloat16,output=float32"


class ConvNet(eqx.Module):
    """A convolutional stem (left as it is) and an MLP head (FP8 after fp8_linear_layers)."""

    conv: eqx.nn.Conv2d
    head: eqx.nn.MLP

    def __init__(self, key):
        kc, kh = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=kc)
        self.head = eqx.nn.MLP(2 * 6 * 6, 4, 16, 1, key=kh)

    def __call__(self, image):
        return self.head(jax.nn.relu(self.conv(image)).ravel())


def images(key, n=8):
    """Float32 images `(n, 1, 6, 6)` and int32 labels in [0, 4)."""
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, 1, 6, 6)), jax.random.randint(ky, (n,), 0, 4)


def cross_entropy(model, x, labels):
    logits = jax.vmap(model)(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_float32_batch_meets_a_bfloat16_conv_stem(getkey):
    """The float32 images are cast with the model: the step is the explicit one on
    `policy.cast_to_compute(model)` and `x.astype(bfloat16)`, labels as they are."""
    model = fp8jax.fp8_linear_layers(ConvNet(getkey()))
    x, labels = images(getkey())
    policy = fp8jax.Policy.from_string(BF16_POLICY)
    optimizer = optax.adam(1e-2)
    train_step = fp8jax.make_train_step(cross_entropy, optimizer, policy=BF16_POLICY)
    state = train_step.init(model)

    def by_hand(model, x, labels):
        return cross_entropy(policy.cast_to_compute(model), x.astype(jnp.bfloat16), labels)

    explicit = eqx.filter_jit(make_train_step(by_hand, optimizer))
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    for _ in range(3):
        state, metrics = train_step(state, x, labels)
        model, opt_state, loss = explicit(model, opt_state, x, labels)
        assert metrics.loss.dtype == jnp.float32 and np.isfinite(float(metrics.loss))
        assert float(metrics.loss) == pytest.approx(float(loss), rel=1e-6)
    assert state.model.conv.weight.dtype == jnp.float32  # masters stay float32
    got = jax.tree.leaves(eqx.filter(state.model, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_batch_cast_touches_floating_arrays_only(microbatches, getkey):
    """Float32 leaves of any pytree reach loss_fn in bfloat16, each microbatch's slice too;
    int32 labels, booleans, FP8 arrays and Python numbers arrive as they were given."""
    model = fp8jax.fp8_linear_layers(ConvNet(getkey()))
    x, labels = images(getkey())
    extras = {
        "mask": labels > 0,
        "fp8": x.astype(jnp.float8_e4m3fn),
        "weights": [jnp.ones(len(x)), jnp.ones(len(x), jnp.float16)],
    }
    seen = {}

    def loss_fn(model, x, labels, extras, *scalar):
        # At trace time: the values loss_fn is traced with, as the step hands them over.
        seen.update(x=x, labels=labels, mask=extras["mask"], fp8=extras["fp8"], scalar=scalar)
        seen["w32"], seen["w16"] = extras["weights"]
        return cross_entropy(model, x, labels)

    train_step = fp8jax.make_train_step(
        loss_fn, optax.adam(1e-2), policy=BF16_POLICY, microbatches=microbatches
    )
    scalar = (0.5,)  # a scalar goes whole to every microbatch
    state, metrics = train_step(train_step.init(model), x, labels, extras, *scalar)
    assert np.isfinite(float(metrics.loss))
    assert seen["x"].dtype == jnp.bfloat16 and seen["x"].shape == (8 // microbatches, 1, 6, 6)
    assert seen["w32"].dtype == seen["w16"].dtype == jnp.bfloat16
    assert seen["labels"].dtype == jnp.int32 and seen["mask"].dtype == jnp.bool_
    assert seen["fp8"].dtype == jnp.float8_e4m3fn
    assert seen["labels"].shape == seen["fp8"].shape[:1] == (8 // microbatches,)
    assert seen["scalar"] == scalar and all(type(s) is float for s in seen["scalar"])
    # The caller's arrays are not changed (nor could they be): the cast is inside the step.
    assert x.dtype == jnp.float32 and extras["weights"][1].dtype == jnp.float16


def test_cast_batch_false_passes_the_batch_as_given(getkey):
    """Without the cast the float32 images meet the bfloat16 conv weights: JAX refuses."""
    model = fp8jax.fp8_linear_layers(ConvNet(getkey()))
    x, labels = images(getkey())
    seen = []

    def loss_fn(model, x, labels):
        seen.append((x.dtype, labels.dtype))
        return cross_entropy(model, x, labels)

    train_step = fp8jax.make_train_step(
        loss_fn, optax.adam(1e-2), policy=BF16_POLICY, cast_batch=False
    )
    with pytest.raises(TypeError, match="conv_general_dilated requires arguments to have the same"):
        train_step(train_step.init(model), x, labels)
    assert seen == [(jnp.float32, jnp.int32)]
    # A loss that casts its inputs itself (and keeps float32 targets) trains as before.
    train_step = fp8jax.make_train_step(
        lambda m, x, labels: cross_entropy(m, x.astype(jnp.bfloat16), labels),
        optax.adam(1e-2),
        policy=BF16_POLICY,
        cast_batch=False,
    )
    _, metrics = train_step(train_step.init(model), x, labels)
    assert np.isfinite(float(metrics.loss))


@pytest.mark.parametrize("bad", ["yes", 1, None, np.array([True])])
def test_cast_batch_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=re.escape(f"cast_batch={bad!r}: should be True or False")):
        fp8jax.make_train_step(cross_entropy, optax.sgd(0.1), cast_batch=bad)


def test_unrolled_microbatches_reach_the_accumulation(getkey, monkeypatch):
    """`make_train_step(unroll_microbatches=...)` is `accumulate_gradients`' `unroll` (what
    unrolling computes is tested in test_accumulate.py): passed through as given, and two
    steps train the model as the rolled step does within float32 rounding."""
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed"))
    x, y = data(getkey())
    seen = []
    real = fp8jax._src.train.step.accumulate_gradients

    def spy(*args, **kwargs):
        seen.append(kwargs.get("unroll"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8jax._src.train.step, "accumulate_gradients", spy)
    states = {}
    for unroll in (1, True):
        train_step = fp8jax.make_train_step(
            mse, optax.sgd(1e-2), microbatches=4, unroll_microbatches=unroll
        )
        state = train_step.init(model)
        for _ in range(2):
            state, _ = train_step(state, x, y)
        states[unroll] = state
    assert seen == [1, True]  # traced once per step function (two steps: the warm start)
    got = jax.tree.leaves(eqx.filter(states[True].model, eqx.is_array))
    want = jax.tree.leaves(eqx.filter(states[1].model, eqx.is_array))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-20 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("rescaled", [True, False])
def test_a_growing_loss_scale_saturates_no_output_gradient(rescaled, getkey, monkeypatch):
    """A `DynamicLossScale` that doubles every step (`period=1`), delayed scaling: the step
    rescales the output-gradient histories with the loss scale, so no step's gradients
    saturate E5M2. With the rescaling taken out (the step as it was), every step after the
    first saturates some: what the test would see if the step forgot it."""
    if not rescaled:
        from fp8jax._src.train import step as step_module

        monkeypatch.setattr(step_module, "rescale_gradient_states", lambda tree, ratio: tree)
    mlp = eqx.nn.MLP(8, 1, 32, 2, key=getkey())
    config = fp8jax.Fp8Config(recipe="delayed", telemetry=True, exclude=None)
    model = fp8jax.fp8_linear_layers(mlp, config)
    step = fp8jax.make_train_step(
        mse, optax.sgd(1e-3), loss_scale=fp8jax.DynamicLossScale(2.0**4, period=1)
    )
    state = step.init(model)
    saturated = []
    for i in range(4):
        state, metrics = step(state, *data(jax.random.key(i)))
        assert bool(metrics.grads_finite)
        stats = fp8jax.telemetry(state.model)
        saturated.append(max(float(s.output_grad.saturated) for s in stats.values()))
    assert float(state.loss_scale.loss_scale) == 2.0**8  # grew every step
    if rescaled:
        assert saturated == [0.0] * 4, saturated
    else:
        assert saturated[0] == 0.0 and all(s > 0 for s in saturated[1:]), saturated


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.CurrentScaling(), fp8jax.ResidualFP8(error_feedback=True)],
    ids=["current", "residual"],
)
def test_rescaled_recorded_gradient_states_change_no_training_number(recipe, monkeypatch):
    """Recipes that scale each step's output gradient by its own amax only record it: the
    step's rescaling with a loss scale that grows, then backs off (telemetry's units), must
    leave every loss, weight and the states their steps read (ResidualFP8's carried kernel
    error) bit for bit as a run without it; only the recorded output-gradient amaxes
    differ."""
    from fp8jax._src.train import step as step_module

    mlp = eqx.nn.MLP(8, 1, 16, 1, key=jax.random.key(0))
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    batches = [data(jax.random.key(i), n=16) for i in range(4)]
    batches[2] = (batches[2][0].at[0, 0].set(jnp.inf), batches[2][1])  # an overflow: backoff
    runs = {}
    for rescaled in (True, False):
        if not rescaled:
            monkeypatch.setattr(step_module, "rescale_gradient_states", lambda tree, ratio: tree)
        scale = fp8jax.DynamicLossScale(2.0**4, period=1)
        step = fp8jax.make_train_step(mse, optax.sgd(1e-2), loss_scale=scale)
        state = step.init(model)
        losses = []
        for batch in batches:
            state, metrics = step(state, *batch)
            losses.append(metrics.loss)
        ops = [layer.dot_general for layer in state.model.layers]
        read = [(op.input, op.kernel, op.output_grad.amax_history) for op in ops]
        runs[rescaled] = (losses, [(m.weight, m.bias) for m in state.model.layers], read)
        assert float(state.loss_scale.loss_scale) == 2.0**6  # 2**4, x2, x2, /2, x2
    assert bits(runs[True][:2]) == bits(runs[False][:2])
    assert bits([r[:2] for r in runs[True][2]]) == bits([r[:2] for r in runs[False][2]])
    # What the rescaling is for: the recorded amaxes in the latest loss scale's units.
    assert bits([r[2] for r in runs[True][2]]) != bits([r[2] for r in runs[False][2]])


def test_numpy_bools_are_the_bools_they_hold(getkey):
    """make_train_step refused has_aux / skip_nonfinite / cast_batch = np.True_ (a flag read
    from a config array) where Fp8Config, fp8_linear_layers and the GEMMs take a NumPy bool
    as the bool it holds; the step built from them is the one built from Python bools."""
    mlp = eqx.nn.MLP(8, 1, 16, 1, key=getkey())
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="delayed"))
    x, y = data(getkey(), n=8)

    def loss(m, x, y):
        value = mse(m, x, y)
        return value, {"loss": value}

    states = []
    for flag in (True, np.True_):
        step = fp8jax.make_train_step(
            loss,
            optax.sgd(0.1),
            has_aux=flag,
            skip_nonfinite=flag,
            cast_batch=flag,
            microbatches=2,
            unroll_microbatches=flag,
        )
        states.append(step(step.init(model), x, y))
    assert bits(states[0]) == bits(states[1])
    assert states[1][1].aux["loss"].shape == (2,)  # has_aux taken: aux stacked per microbatch

"""Loss scaling: the dynamic schedule against a reference, FP8 state left alone, jit and scan."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax._src.train.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
    states_finite,
)

F32_MAX = float(np.finfo(np.float32).max)


def reference_schedule(flags, loss_scale, period, factor, backoff, min_loss_scale):
    """The dynamic loss scale's documented rule, step by step in plain Python."""
    counter = skipped = total = 0
    trajectory = []
    for finite in flags:
        if finite:
            counter += 1
            if counter >= period:
                if loss_scale * factor <= F32_MAX:  # growth only while finite in float32
                    loss_scale *= factor
                counter = 0
        else:
            loss_scale = max(loss_scale * backoff, min_loss_scale)
            counter = 0
            skipped += 1
        total += 1
        trajectory.append((loss_scale, counter, skipped, total))
    return trajectory


def _state(ls):
    return (float(ls.loss_scale), int(ls.counter), int(ls.skipped_steps), int(ls.total_steps))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_schedule_matches_reference_step_by_step(seed):
    rng = np.random.default_rng(seed)
    flags = rng.random(300) < 0.7  # 30% overflowing steps: the floor is hit, growth happens
    config = dict(period=3, factor=2.0, backoff=0.5, min_loss_scale=1.0)
    expected = reference_schedule(flags, 16.0, **config)
    scales = [s for s, *_ in expected]
    assert min(scales) == 1.0 and max(scales) > 16.0  # the floor and growth are both exercised

    ls = DynamicLossScale(loss_scale=16.0, **config)
    adjust = eqx.filter_jit(lambda ls, f: ls.adjust(f))
    for step, (finite, want) in enumerate(zip(flags, expected, strict=True)):
        ls = adjust(ls, jnp.asarray(finite))
        assert _state(ls) == want, f"step {step}"
        assert ls.loss_scale.dtype == jnp.float32
        assert ls.counter.dtype == ls.skipped_steps.dtype == ls.total_steps.dtype == jnp.int32
    np.testing.assert_allclose(ls.overflow_rate, np.mean(~flags), rtol=1e-6)

    # The same schedule as one lax.scan: the module is a carry.
    def body(ls, finite):
        ls = ls.adjust(finite)
        return ls, (ls.loss_scale, ls.counter, ls.skipped_steps, ls.total_steps)

    start = DynamicLossScale(loss_scale=16.0, **config)
    final, history = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(start, jnp.asarray(flags))
    np.testing.assert_array_equal(np.stack([np.asarray(h) for h in history], 1), expected)
    assert _state(final) == expected[-1]


def test_backoff_with_uneven_factors_and_floor():
    flags = [False] * 6 + [True] * 8 + [False]
    config = dict(period=2, factor=3.0, backoff=0.25, min_loss_scale=0.5)
    expected = reference_schedule(flags, 100.0, **config)
    ls = DynamicLossScale(loss_scale=100.0, **config)
    for finite, want in zip(flags, expected, strict=True):
        ls = ls.adjust(finite)
        got = _state(ls)
        assert got[1:] == want[1:]
        assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert expected[5][0] == 0.5  # floored


def test_growth_capped_at_float32_overflow():
    ls = DynamicLossScale(loss_scale=2.0**127, period=1)
    ls = ls.adjust(True)
    assert float(ls.loss_scale) == 2.0**127  # 2**128 is inf in float32
    assert int(ls.counter) == 0  # the count restarts even though the scale was kept
    assert bool(jnp.isfinite(ls.loss_scale))

    ls = DynamicLossScale(loss_scale=2.0**126, period=2, factor=3.0)
    trajectory = [float(ls.loss_scale)]
    for _ in range(6):
        ls = jax.jit(lambda ls: ls.adjust(jnp.asarray(True)))(ls)
        trajectory.append(float(ls.loss_scale))
    grown = float(np.float32(3.0 * 2.0**126))  # 1.5 * 2**127 < float32 max: allowed once
    assert trajectory == [2.0**126, 2.0**126, grown, grown, grown, grown, grown]
    # And it still backs off from the cap.
    assert float(ls.adjust(False).loss_scale) == pytest.approx(grown * 0.5)


def test_overflow_rate_and_initial_state():
    ls = DynamicLossScale()
    assert _state(ls) == (2.0**15, 0, 0, 0)
    assert (ls.period, ls.factor, ls.backoff, ls.min_loss_scale) == (2000, 2.0, 0.5, 1.0)
    assert float(ls.overflow_rate) == 0.0
    for finite in [True, False, False, True]:
        ls = ls.adjust(finite)
    assert float(ls.overflow_rate) == 0.5
    assert float(ls.loss_scale) == 2.0**13
    assert isinstance(ls, LossScale)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(period=0), ValueError, "period=0 should be an integer >= 1"),
        (dict(period=2.0), ValueError, "period=2.0 should be an integer >= 1"),
        (dict(period=True), ValueError, "period=True should be an integer >= 1"),
        (dict(factor=1.0), ValueError, "factor=1.0 should be a number > 1"),
        (dict(factor=0.5), ValueError, "factor=0.5 should be a number > 1"),
        (dict(factor=math.inf), ValueError, "factor=inf should be finite in float32"),
        (dict(factor="2"), TypeError, "factor='2' should be a real number"),
        (dict(backoff=1.0), ValueError, r"backoff=1.0 should be a number in \(0, 1\)"),
        (dict(backoff=0.0), ValueError, r"backoff=0.0 should be a number in \(0, 1\)"),
        (dict(backoff=-0.5), ValueError, r"backoff=-0.5 should be a number in \(0, 1\)"),
        # 1 (or 0) once rounded to float32, which the scale is computed in: it would never
        # grow (never back off, every overflowing step skipped at the same scale).
        (dict(factor=1 + 1e-9), ValueError, r"factor=1.000000001 should be a number > 1"),
        (dict(backoff=1 - 1e-9), ValueError, r"backoff=0.999999999 should be a number in \(0, 1"),
        (dict(backoff=1e-50), ValueError, r"backoff=1e-50 should be a number in \(0, 1"),
        (dict(min_loss_scale=0.0), ValueError, "min_loss_scale=0.0 should be a number > 0"),
        (dict(min_loss_scale=-1), ValueError, "min_loss_scale=-1 should be a number > 0"),
        # 0 in float32, and a subnormal that CPUs and TPUs flush to 0: the scale would reach 0.
        (dict(min_loss_scale=1e-50), ValueError, "min_loss_scale=1e-50 should be at least"),
        (dict(min_loss_scale=1e-40), ValueError, "min_loss_scale=1e-40 should be at least"),
        (dict(loss_scale=0.5), ValueError, "loss_scale=0.5 should be at least min_loss_scale=1.0"),
        (dict(loss_scale=2.0**200), ValueError, "should be finite in float32"),
        (dict(loss_scale=math.nan), ValueError, "loss_scale=nan should be finite in float32"),
        (dict(loss_scale=jnp.ones(2)), TypeError, "should be a real number"),
    ],
)
def test_dynamic_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScale(**kwargs)


def test_static_and_noop():
    with pytest.raises(ValueError, match="loss_scale=0.0 should be positive"):
        StaticLossScale(0.0)
    with pytest.raises(ValueError, match="loss_scale=-2 should be positive"):
        StaticLossScale(-2)
    with pytest.raises(ValueError, match="should be finite in float32"):
        StaticLossScale(math.inf)
    tiny = float(np.finfo(np.float32).tiny)  # float32's smallest normal
    for value in (1e-50, 1e-40, tiny / 2):  # 0 in float32, or flushed to 0 on CPUs and TPUs
        with pytest.raises(ValueError, match=f"loss_scale={value!r} should be at least"):
            StaticLossScale(value)
    floor = StaticLossScale(tiny)  # the smallest accepted: products >= 2**-126 round-trip
    np.testing.assert_array_equal(floor.unscale(floor.scale(jnp.asarray([3.0, 1024.0]))), [3, 1024])
    low = DynamicLossScale(loss_scale=1.0, min_loss_scale=tiny, period=10)
    for _ in range(200):
        low = low.adjust(False)
    assert float(low.loss_scale) == tiny

    static = StaticLossScale(2.0**10)
    assert static.loss_scale.dtype == jnp.float32
    assert static.adjust(False) is static and static.adjust(True) is static
    np.testing.assert_array_equal(static.scale(jnp.full(3, 3.0, jnp.float16)), [3072.0] * 3)

    noop = NoOpLossScale()
    tree = {"g": jnp.ones(3, jnp.float16), "n": 3}
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree
    assert noop.adjust(jnp.asarray(False)) is noop
    assert float(noop.loss_scale) == 1.0 and noop.loss_scale.dtype == jnp.float32
    # A constructed-in-jit static scale (traced value) is accepted.
    assert float(jax.jit(lambda s: StaticLossScale(s).loss_scale)(4.0)) == 4.0


@pytest.mark.parametrize("ls", [NoOpLossScale(), StaticLossScale(2.0), DynamicLossScale()])
def test_adjust_wants_a_boolean_scalar(ls):
    with pytest.raises(TypeError, match="grads_finite has dtype int32 and shape"):
        ls.adjust(jnp.asarray(1))
    with pytest.raises(TypeError, match=r"grads_finite has dtype bool and shape \(2,\)"):
        ls.adjust(jnp.asarray([True, True]))


def _fp8_layer_with_odd_state():
    """An Fp8DotGeneral whose state holds values a scale or cast would visibly change."""
    layer = fp8jax.Fp8DotGeneral()
    weird = jnp.asarray([jnp.inf, jnp.nan, 3.0, 1e-30] + [0.0] * 1020, jnp.float32)
    return eqx.tree_at(lambda m: m.input.amax_history, layer, weird)


def _grads():
    return {
        "f16": jnp.asarray([2.0**10, -3.0 * 2.0**5, 0.0, 65504.0], jnp.float16),
        "bf16": jnp.asarray([2.0**20, -1.5], jnp.bfloat16),
        "f32": jnp.asarray([1.0, 2.0**-100], jnp.float32),
        "int": jnp.arange(3, dtype=jnp.int32),
        "none": None,
        "python": 7.0,
        "fp8": _fp8_layer_with_odd_state(),
    }


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_fp8_untouched(before, after):
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert _same_bits(x, y)
    assert jax.tree.structure(before) == jax.tree.structure(after)


@pytest.mark.parametrize("jit", [False, True])
def test_unscale_and_scale_keep_dtypes_and_leave_fp8_state(jit):
    scale = 2.0**15
    ls = DynamicLossScale(loss_scale=scale)
    grads = _grads()
    unscale = eqx.filter_jit(lambda ls, g: ls.unscale(g)) if jit else (lambda ls, g: ls.unscale(g))
    out = unscale(ls, grads)
    for name in ("f16", "bf16", "f32"):
        assert out[name].dtype == grads[name].dtype
        want = (np.asarray(grads[name], np.float64) / scale).astype(grads[name].dtype)
        assert _same_bits(out[name], want), name
    assert out["int"].dtype == jnp.int32 and _same_bits(out["int"], grads["int"])
    assert out["none"] is None and out["python"] == 7.0
    _assert_fp8_untouched(grads["fp8"], out["fp8"])
    if not jit:
        assert out["fp8"] is grads["fp8"]

    scale_fn = eqx.filter_jit(lambda ls, g: ls.scale(g)) if jit else (lambda ls, g: ls.scale(g))
    scaled = scale_fn(ls, {k: v for k, v in grads.items() if k != "f16"})
    assert scaled["bf16"].dtype == jnp.bfloat16
    assert _same_bits(scaled["f32"], np.asarray([scale, 2.0**-85], np.float32))
    _assert_fp8_untouched(grads["fp8"], scaled["fp8"])


def test_unscale_computes_the_reciprocal_in_float32():
    # 1 / 2**25 is below float16's smallest subnormal (2**-24): multiplying in float16 would
    # zero every gradient. In float32 the product 2**10 / 2**25 = 2**-15 is a float16 subnormal.
    ls = StaticLossScale(2.0**25)
    out = ls.unscale(jnp.asarray([2.0**10, -(2.0**12)], jnp.float16))
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [2.0**-15, -(2.0**-13)])


@pytest.mark.parametrize("scale", [2.0**100, 2.0**127, float(np.float32(1.5 * 2.0**127)), 3e37])
@pytest.mark.parametrize("jit", [False, True])
def test_unscale_past_2_126_where_the_inverse_is_subnormal(scale, jit):
    # DynamicLossScale grows up to float32's max; 1 / scale past 2**126 is a float32
    # subnormal, which CPUs and TPUs flush to zero: the gradients must not become 0.
    ls = DynamicLossScale(loss_scale=scale)
    grads = {
        "f32": jnp.asarray([0.75, -1e-3, 1.25], jnp.float32),
        "bf16": jnp.ones(2, jnp.bfloat16),
    }
    scaled = ls.scale(grads)
    unscale = eqx.filter_jit(lambda ls, g: ls.unscale(g)) if jit else (lambda ls, g: ls.unscale(g))
    out = unscale(ls, scaled)
    for key, x in scaled.items():
        # float64 reference; the inverse and the product are each rounded once.
        want = np.asarray(x, np.float64) / np.float64(np.float32(scale))
        rtol = 2 * float(jnp.finfo(x.dtype).eps)
        np.testing.assert_allclose(np.asarray(out[key], np.float64), want, rtol=rtol)
        assert out[key].dtype == x.dtype


def test_unscale_real_fp8_gradients():
    """Through fp8jax.filter_grad: the FP8 state received as a gradient is not unscaled."""
    model = fp8jax.fp8_linear_layers(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (5, 4))
    ls = DynamicLossScale(loss_scale=2.0**12)

    def loss_fn(model):
        return ls.scale(jnp.mean(jax.vmap(model)(x) ** 2))

    grads = fp8jax.filter_grad(loss_fn)(model)
    unscaled = ls.unscale(grads)
    is_fp8 = lambda x: isinstance(x, fp8jax.Fp8DotGeneral)  # noqa: E731
    fp8_in = [x for x in jax.tree.leaves(grads, is_leaf=is_fp8) if is_fp8(x)]
    fp8_out = [x for x in jax.tree.leaves(unscaled, is_leaf=is_fp8) if is_fp8(x)]
    assert len(fp8_in) == 2
    for a, b in zip(fp8_in, fp8_out, strict=True):
        _assert_fp8_untouched(a, b)
    w, w_unscaled = grads.layers[0].weight, unscaled.layers[0].weight
    assert _same_bits(w_unscaled, np.asarray(w) / np.float32(2.0**12))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite_detects_inf_and_nan(dtype, bad):
    tree = {"a": jnp.ones((2, 3), dtype), "b": [jnp.zeros(4, jnp.float32), None], "i": 3}
    check = jax.jit(all_finite)
    assert bool(all_finite(tree)) and bool(check(tree))
    bad_tree = eqx.tree_at(lambda t: t["a"], tree, tree["a"].at[1, 2].set(bad))
    assert not bool(all_finite(bad_tree))
    assert not bool(check(bad_tree))
    assert all_finite(bad_tree).dtype == jnp.bool_ and all_finite(bad_tree).shape == ()


def test_all_finite_skips_fp8_state_ints_none_and_empty():
    grads = _grads()  # its FP8 state holds inf and nan
    assert bool(all_finite(grads))
    assert bool(jax.jit(all_finite)({k: v for k, v in grads.items() if k != "python"}))
    assert bool(all_finite({})) and bool(all_finite(None)) and bool(all_finite([None, 1.0]))
    assert bool(all_finite(np.asarray([1.0, 2.0])))
    assert not bool(all_finite(np.asarray([1.0, np.nan])))
    assert not bool(all_finite({"g": grads["f32"] * jnp.inf, "fp8": grads["fp8"]}))
    assert not bool(all_finite(jnp.asarray([1 + 1j, complex(jnp.inf, 0)], jnp.complex64)))


def test_states_finite_is_every_leaf_finite():
    """`states_finite` (the small leaves checked together, a kernel-shaped one alone) against
    each leaf checked in float64: a +inf or NaN in any one leaf, of any float dtype, is
    seen; -inf, the max-combining zero a layer in a `lax.cond` branch not taken receives
    (nothing received), is not; integer leaves and `None` are skipped."""
    rng = np.random.default_rng(16)
    leaves = {
        "scale": jnp.float32(0.5),
        "history": jnp.asarray(rng.standard_normal(1024), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal(7), jnp.bfloat16),
        "f16": jnp.asarray(rng.standard_normal((3, 5)), jnp.float16),
        "error": jnp.asarray(rng.standard_normal((300, 300)), jnp.bfloat16),  # > SMALL_STATE
        "count": jnp.arange(4),
        "none": None,
    }
    floats = [
        k for k, v in leaves.items() if v is not None and jnp.issubdtype(v.dtype, jnp.floating)
    ]
    check = jax.jit(states_finite)

    def reference(tree):
        floating = [v for v in jax.tree.leaves(tree) if jnp.issubdtype(v.dtype, jnp.floating)]
        wide = [np.asarray(v, np.float64) for v in floating]
        return all(not np.any(np.isnan(a) | (a == np.inf)) for a in wide)

    assert bool(states_finite(leaves)) and bool(check(leaves)) and reference(leaves)
    for name in floats:
        for bad in (np.inf, -np.inf, np.nan):
            flat = leaves[name].reshape(-1)
            poisoned = {
                **leaves,
                name: flat.at[flat.size // 2].set(bad).reshape(leaves[name].shape),
            }
            seen = not reference(poisoned)
            assert seen == (bad != -np.inf)
            assert bool(states_finite(poisoned)) != seen, (name, bad)
            assert bool(check(poisoned)) != seen, (name, bad)
    assert bool(states_finite({})) and bool(states_finite(None))


def _special_values(dtype):
    """Values whose bits a lossy select would change: NaN payloads, -0.0, subnormals, inf."""
    bits_dtype = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    finfo = jnp.finfo(dtype)
    values = np.asarray(
        [0.0, -0.0, np.inf, -np.inf, float(finfo.smallest_subnormal), float(finfo.max), 1.0],
        dtype,
    )
    if np.dtype(dtype) == np.dtype(jnp.bfloat16):
        nans = [0x7FC1, 0x7F81, 0xFFC3]  # quiet with payload, signalling, negative
    elif np.dtype(dtype) == np.dtype(jnp.float16):
        nans = [0x7E01, 0x7C01, 0xFE03]
    else:
        nans = [0x7FC00123, 0x7F800001, 0xFFC00005]
    nan_payload = np.asarray(nans, bits_dtype)
    return np.concatenate([values, nan_payload.view(dtype)])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32, jnp.bfloat16])
def test_select_tree_is_bit_identical(dtype):
    a = _special_values(dtype)
    b = np.roll(a, 3)
    on_true = {"x": jnp.asarray(a), "n": np.asarray([1, 2], np.int8), "cfg": "relu", "k": None}
    on_false = {"x": jnp.asarray(b), "n": np.asarray([3, 4], np.int8), "cfg": "relu", "k": None}
    select = jax.jit(select_tree)
    for pred, want in [(True, on_true), (False, on_false)]:
        for fn in (select_tree, lambda p, t, f: select(p, *eqx.partition((t, f), eqx.is_array)[0])):
            out = fn(pred, on_true, on_false)
            assert _same_bits(out["x"], want["x"])
            assert _same_bits(out["n"], want["n"])
        out = select_tree(jnp.asarray(pred), on_true, on_false)
        assert out["cfg"] == "relu" and out["k"] is None


def test_select_tree_of_models_and_optimizer_state():
    old = _fp8_layer_with_odd_state()
    new = fp8jax.Fp8DotGeneral()
    pick = eqx.filter_jit(select_tree)
    _assert_fp8_untouched(old, pick(jnp.asarray(False), new, old))
    _assert_fp8_untouched(new, pick(jnp.asarray(True), new, old))
    ls = DynamicLossScale(period=3)
    assert _state(select_tree(False, ls.adjust(True), ls)) == _state(ls)


def test_the_documented_skip_keeps_the_counts_of_rejected_fp8_updates():
    """The loop of this module's docstring (select_tree skipping a step whose gradients
    overflowed) keeps telemetry's count of rejected updates: a step whose input held an inf
    is skipped, and counted (it was reverted with the model, so the count stayed 0)."""
    import optax

    lin = eqx.nn.Linear(16, 4, key=jax.random.PRNGKey(0))
    model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(telemetry=True))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, loss_scale, x):
        def loss(m):
            return loss_scale.scale(jnp.mean(jax.vmap(m)(x)))  # a finite output gradient

        grads = fp8jax.filter_grad(loss)(model)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        grads = loss_scale.unscale(grads)
        finite = fp8jax.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, model)
        new_model = fp8jax.apply_updates(model, updates, overwrites)
        model, opt_state = select_tree(finite, (new_model, new_opt_state), (model, opt_state))
        return model, opt_state, loss_scale.adjust(finite)

    good = np.ones((8, 16), np.float32)
    bad = good.copy()
    bad[2, 3] = np.inf
    loss_scale, faults = DynamicLossScale(), 0
    for x in (good, bad, good, bad, bad):
        before = model
        model, opt_state, loss_scale = step(model, opt_state, loss_scale, x)
        faults += int(not np.isfinite(x).all())
        stats = model.dot_general.stats
        assert float(stats.input.rejected) == faults
        assert float(stats.kernel.rejected) == 0 == float(stats.output_grad.rejected)
        if not np.isfinite(x).all():  # skipped: all else as it was
            assert _same_bits(model.weight, before.weight)
            assert _same_bits(model.dot_general.input.scale, before.dot_general.input.scale)
    assert int(loss_scale.skipped_steps) == faults == 3
    # A model filtered without the counts (its weights only) is selected as before.
    weights = eqx.filter(model, lambda x: x is model.weight)
    assert _same_bits(select_tree(False, weights, weights).weight, model.weight)


def test_select_tree_errors():
    with pytest.raises(ValueError, match="different structures"):
        select_tree(True, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
    with pytest.raises(ValueError, match="different structures"):
        select_tree(True, DynamicLossScale(period=2), DynamicLossScale(period=3))
    with pytest.raises(ValueError, match=r"at \['a'\], on_true is float32\[2\] and on_false is "):
        select_tree(True, {"a": jnp.ones(2)}, {"a": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"on_true is float32\[2\] and on_false is bfloat16\[2\]"):
        select_tree(True, {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"at \[0\], one tree has an array and the other float"):
        select_tree(True, [jnp.ones(2)], [1.0])
    with pytest.raises(ValueError, match="the non-array leaves 'relu' and 'gelu' differ"):
        select_tree(True, ["relu"], ["gelu"])
    with pytest.raises(TypeError, match="pred has dtype float32 and shape"):
        select_tree(jnp.asarray(1.0), [1], [1])
    with pytest.raises(TypeError, match=r"pred has dtype bool and shape \(2,\)"):
        select_tree(jnp.asarray([True, False]), [1], [1])


def _recorded_mlp(recipe, key):
    """An FP8 MLP after one train step: every state recorded (gradients times 2**10)."""
    mlp = eqx.nn.MLP(8, 4, 32, 2, key=key)
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    x = jax.random.normal(jax.random.key(1), (64, 8))

    def loss(m):
        return 2.0**10 * jnp.mean(jax.vmap(m)(x) ** 2)

    _, grads = fp8jax.filter_value_and_grad(loss)(model)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    return fp8jax.apply_updates(model, jax.tree.map(jnp.zeros_like, grads), overwrites)


def bits_of(tree):
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def _ops(model):
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, fp8jax.Fp8DotGeneral))
    return [x for x in leaves if isinstance(x, fp8jax.Fp8DotGeneral)]


@pytest.mark.parametrize("power_of_two", [True, False])
@pytest.mark.parametrize("ratio", [2.0, 0.5, 3.0])
def test_rescaled_gradient_states_are_recorded_gradients_times_the_ratio(ratio, power_of_two):
    """The output-gradient history times `ratio` (exact for powers of two), and the scale the
    next step uses computed from it by hand in float64 (`fmt_max / amax`, rounded down to a
    power of two); the inputs' and kernels' states bit for bit as they were."""
    recipe = fp8jax.DelayedScaling(power_of_two=power_of_two, history_len=4)
    model = _recorded_mlp(recipe, jax.random.key(0))
    new = fp8jax.rescale_gradient_states(model, ratio)
    e5m2_max = float(jnp.finfo(jnp.float8_e5m2).max)
    for old_op, op in zip(_ops(model), _ops(new), strict=True):
        old_history = np.asarray(old_op.output_grad.amax_history, np.float64)
        assert old_history[0] > 0  # recorded
        history = np.asarray(op.output_grad.amax_history, np.float64)
        np.testing.assert_array_equal(history, np.float32(old_history * ratio))
        want = e5m2_max / history.max()
        if power_of_two:
            want = 2.0 ** math.floor(math.log2(want))
        np.testing.assert_allclose(float(op.output_grad.scale), want, rtol=2**-23)
        assert float(op.output_grad.scale_inv) == pytest.approx(1 / want, rel=2**-22)
        assert bits_of(op.input) == bits_of(old_op.input)
        assert bits_of(op.kernel) == bits_of(old_op.kernel)


def test_rescaling_leaves_what_it_should_as_it_was():
    """A ratio of 1 and unrecorded states (scale 0: the warm start still waits) are left bit
    for bit; a ratio must be a scalar. Recipes that scale each step by its own amax keep
    their inputs' and kernels' states, and record the output gradient's amax times the
    ratio beside its scale (their next step reads neither: telemetry, in the new loss
    scale's units)."""
    key = jax.random.key(0)
    model = _recorded_mlp(fp8jax.DelayedScaling(), key)
    assert bits_of(fp8jax.rescale_gradient_states(model, 1.0)) == bits_of(model)
    fresh = fp8jax.fp8_linear_layers(eqx.nn.MLP(8, 4, 32, 2, key=key), fp8jax.Fp8Config())
    rescaled = fp8jax.rescale_gradient_states(fresh, 4.0)
    assert [float(op.output_grad.scale) for op in _ops(rescaled)] == [0.0] * 3
    current = _recorded_mlp(fp8jax.CurrentScaling(), key)
    rescaled = eqx.filter_jit(fp8jax.rescale_gradient_states)(current, 2.0)
    for old_op, op in zip(_ops(current), _ops(rescaled), strict=True):
        amax = 2 * np.float64(old_op.output_grad.amax_history[0])
        assert float(op.output_grad.amax_history[0]) == amax
        want = 2.0 ** math.floor(math.log2(float(jnp.finfo(jnp.float8_e5m2).max) / amax))
        assert (float(op.output_grad.scale), float(op.output_grad.scale_inv)) == (want, 1 / want)
        assert bits_of((op.input, op.kernel)) == bits_of((old_op.input, old_op.kernel))
    assert bits_of(fp8jax.rescale_gradient_states(current, 1.0)) == bits_of(current)
    with pytest.raises(ValueError, match=r"ratio has shape \(2,\)"):
        fp8jax.rescale_gradient_states(model, jnp.ones(2))
    # A ratio that is not positive and finite would put a non-finite or negative amax in the
    # history: refused, and, traced, changes nothing.
    jitted = eqx.filter_jit(fp8jax.rescale_gradient_states)
    for bad in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=f"ratio={bad!r}: should be positive and finite"):
            fp8jax.rescale_gradient_states(model, bad)
        assert bits_of(jitted(model, jnp.float32(bad))) == bits_of(model)
    assert bits_of(jitted(model, jnp.float32(2.0))) != bits_of(model)


def test_a_linen_models_variables_are_rescaled_as_its_layers():
    """Linen keeps each FP8 layer's `Fp8DotGeneral` in a collection of its variables: the
    variables rescale as the Equinox layer holding the same state does."""
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(32)(x)))  # the first Dense made is the head

    model = fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config())
    x = jax.random.normal(jax.random.key(0), (16, 16))
    variables = model.init(jax.random.key(1), x)
    loss = lambda v: 2.0**8 * jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
    _, grads = fp8jax.filter_value_and_grad(loss)(variables)
    (op,) = [
        leaf
        for leaf in jax.tree.leaves(grads, is_leaf=lambda t: isinstance(t, fp8jax.Fp8DotGeneral))
        if isinstance(leaf, fp8jax.Fp8DotGeneral)
    ]
    recorded = {**variables, "_overwrite_with_gradient": {"Dense_1": {"fp8jax": op}}}
    assert float(op.output_grad.amax_history[0]) > 0
    rescaled = fp8jax.rescale_gradient_states(recorded, 4.0)
    (got,) = _ops(rescaled)
    (want,) = _ops(fp8jax.rescale_gradient_states(op, 4.0))
    assert bits_of(got) == bits_of(want) and bits_of(got) != bits_of(op)


def test_an_nnx_model_is_refused_by_name():
    """An NNX model's FP8 layers hold `nnx.Variable`s: refused naming the layer, not a
    comparison error from inside the scale's computation."""
    from flax import nnx

    model = fp8jax.fp8_linear_layers(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), fp8jax.Fp8Config())
    with pytest.raises(TypeError, match="rescale_gradient_states: layer .* Flax NNX model"):
        fp8jax.rescale_gradient_states(model, 2.0)

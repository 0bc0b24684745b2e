"""Optimizer state stored in bfloat16: dtypes, error bounds against float32 AdamW, a numpy
reference, and the measured stall of Adam's second moment under round-to-nearest storage."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fp8jax._src.train.optim import low_precision_state

U_BF16 = 2.0**-8  # bfloat16 unit roundoff: 8 significant bits, |round(x) - x| <= 2**-8 |x|
U_F32 = 2.0**-24
B1, B2, EPS = 0.9, 0.999, 1e-8


def _params(key, n=256):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (n // 4, 4)), "b": jax.random.normal(k2, (4,))}


def _adam_states(state):
    """The ScaleByAdamState inside an (adamw) optimizer state."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (found,) = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
    return found


def test_state_dtypes():
    params = _params(jax.random.key(0))
    optimizer = low_precision_state(optax.adamw(1e-3, weight_decay=1e-2))
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state1 = optimizer.update(grads, state, params)
    _, state2 = jax.jit(optimizer.update)(grads, state1, params)
    for s in (state, state1, state2):
        adam = _adam_states(s)
        assert adam.count.dtype == jnp.int32
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((adam.mu, adam.nu)))
        assert jax.tree.structure(s) == jax.tree.structure(optax.adamw(1e-3).init(params))
    assert int(_adam_states(state2).count) == 2


def test_scalars_ints_and_extra_args_pass_through():
    params = _params(jax.random.key(0))
    # inject_hyperparams keeps the learning rate as a 0-d float32 leaf: not rounded.
    inner = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=3e-4)
    )
    optimizer = low_precision_state(inner)
    state = optimizer.init(params)
    lr = state[1].hyperparams["learning_rate"]
    assert lr.dtype == jnp.float32 and float(lr) == float(np.float32(3e-4))
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = optimizer.update(grads, state, params)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    assert state[1].hyperparams["learning_rate"].dtype == jnp.float32
    assert _adam_states(state).count.dtype == jnp.int32
    # Extra arguments reach transformations that take them.
    plateau = low_precision_state(optax.contrib.reduce_on_plateau())
    p_state = plateau.init(params)
    _, p_state = plateau.update(grads, p_state, params, value=jnp.asarray(1.0))
    assert float(p_state.best_value) == 1.0  # initialised to inf; the value got through


def test_complex_state_is_kept_as_the_docstring_says():
    """Complex leaves are kept: SGD momentum of complex parameters stays complex64 and the
    update is optax's own (cast to bfloat16, it lost its imaginary part)."""
    params = {"w": jnp.asarray([1 + 2j, -3 + 0.5j], jnp.complex64)}
    grads = {"w": jnp.asarray([0.25 - 1j, 2 + 3j], jnp.complex64)}
    inner = optax.sgd(0.1, momentum=0.9)
    optimizer = low_precision_state(inner)
    state, want_state = optimizer.init(params), inner.init(params)
    for _ in range(2):
        updates, state = optimizer.update(grads, state, params)
        want, want_state = inner.update(grads, want_state, params)
    trace = jax.tree.leaves(state)[0]
    assert trace.dtype == jnp.complex64
    np.testing.assert_array_equal(trace, jax.tree.leaves(want_state)[0])
    np.testing.assert_array_equal(updates["w"], want["w"])


def test_an_update_the_inner_optimizer_gives_narrower_is_not_widened():
    """Updates are only narrowed: plain SGD gives bfloat16 gradients' updates in bfloat16
    beside float32 parameters, and so does the wrapper (widening them to float32 passed)."""
    params = {"w": jnp.asarray([1.0, -2.0, 3.0], jnp.float32)}
    grads = {"w": jnp.asarray([0.5, 1.5, -0.25], jnp.bfloat16)}
    inner = optax.sgd(0.1)
    got, _ = low_precision_state(inner).update(
        grads, low_precision_state(inner).init(params), params
    )
    want, _ = inner.update(grads, inner.init(params), params)
    assert got["w"].dtype == want["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(got["w"], want["w"])


def test_argument_errors():
    with pytest.raises(ValueError, match="dtype=<class 'jax.numpy.int8'> should be a floating"):
        low_precision_state(optax.adam(1e-3), jnp.int8)
    with pytest.raises(ValueError, match="dtype='nope' should be a floating dtype"):
        low_precision_state(optax.adam(1e-3), "nope")
    # float128 is floating, but JAX's type promotion refused it without naming the argument.
    with pytest.raises(ValueError, match="dtype='float128' is float128, of which JAX has no"):
        low_precision_state(optax.adam(1e-3), "float128")
    with pytest.raises(TypeError, match="should be an optax GradientTransformation"):
        low_precision_state(lambda g: g)


@pytest.mark.parametrize("name", ["f8", "FP8", "float8"])
def test_ambiguous_f8_is_refused_and_dtype_names_are_read_as_elsewhere(name):
    """`dtype="f8"` stored the state in float64 (NumPy's reading: 4x bfloat16's memory), where
    an FP8 reader means FP8; fp8jax's own dtype arguments refuse it, so does this. "bf16",
    which they take, was refused here."""
    with pytest.raises(ValueError, match=rf"dtype='{name}' is ambiguous"):
        low_precision_state(optax.adam(1e-3), name)
    params = {"w": jnp.ones(3)}
    for alias, dtype in [("bf16", jnp.bfloat16), ("BF16", jnp.bfloat16), ("f32", jnp.float32)]:
        state = low_precision_state(optax.sgd(0.1, momentum=0.9), alias).init(params)
        assert {x.dtype for x in jax.tree.leaves(state)} == {np.dtype(dtype)}


@pytest.mark.parametrize("pass_params", [True, False])
def test_bfloat16_params_get_bfloat16_updates_as_from_the_inner_optimizer(pass_params):
    """bfloat16 parameters: optax's own Adam/SGD give bfloat16 updates (their state has the
    parameters' dtype), so `eqx.apply_updates` keeps the parameters bfloat16. The wrapper
    returned float32 updates (computed from the float32 state), which promoted the parameters
    to float32: a `lax.scan` over steps refused its carry. The updates now have the inner
    optimizer's dtype: float32 arithmetic, rounded once (ml_dtypes) to bfloat16."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params(jax.random.key(7)))
    grads = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _grads_seq(jax.random.key(8), params, 3))
    inners = [optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)]
    inners += [optax.adamw(1e-3)] if pass_params else []  # weight decay needs the parameters
    for inner in inners:
        optimizer = low_precision_state(inner)
        first = jax.tree.map(lambda g: g[0], grads)
        plain, _ = inner.update(first, inner.init(params), params if pass_params else None)
        got, _ = optimizer.update(first, optimizer.init(params), params if pass_params else None)
        # The documented computation: optax on the gradients and parameters as given, its
        # state (zero: exact) in float32; the update then rounded once to bfloat16.
        params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        want32, _ = inner.update(first, inner.init(params32), params if pass_params else None)
        for name in params:
            assert got[name].dtype == plain[name].dtype == jnp.bfloat16
            want = np.asarray(want32[name]).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(np.asarray(got[name]), want)

        def step(carry, g, optimizer=optimizer):
            p, state = carry
            updates, state = optimizer.update(g, state, p if pass_params else None)
            return (eqx.apply_updates(p, updates), state), None

        (trained, state), _ = jax.lax.scan(step, (params, optimizer.init(params)), grads)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(trained))
    # Parameters not shaped as the gradients, which optax's Adam never reads, are accepted.
    more = {**params, "extra": jnp.ones(3)}
    optimizer = low_precision_state(optax.adam(1e-3))
    updates, _ = optimizer.update(first, optimizer.init(params), more if pass_params else None)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))


def test_bfloat16_gradients_of_float32_params_get_float32_updates_only_with_params():
    """Documented: with `params`, bfloat16 gradients of float32 parameters get float32 updates,
    optax's own bit for bit; without them the stored bfloat16 state does not tell the
    parameters' dtype and the updates are optax's float32 ones rounded once to bfloat16."""
    params = _params(jax.random.key(3))
    grads = jax.tree.map(
        lambda g: g[0].astype(jnp.bfloat16), _grads_seq(jax.random.key(4), params, 1)
    )
    for inner in [optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)]:
        want, _ = inner.update(grads, inner.init(params), None)  # float32 state: optax's own
        optimizer = low_precision_state(inner)
        with_params, _ = optimizer.update(grads, optimizer.init(params), params)
        without, _ = optimizer.update(grads, optimizer.init(params), None)
        for name in params:
            assert want[name].dtype == with_params[name].dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(with_params[name]), np.asarray(want[name]))
            assert without[name].dtype == jnp.bfloat16
            rounded = np.asarray(want[name]).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(np.asarray(without[name]), rounded)


@pytest.mark.parametrize(
    "inner, param_dtype, storage",
    [
        (optax.adam(1e-3, mu_dtype=jnp.bfloat16), jnp.float32, jnp.float32),  # mu narrower
        (optax.adam(1e-3), jnp.bfloat16, jnp.float32),  # moments of bfloat16 parameters
        (optax.sgd(1e-2, momentum=0.9), jnp.float8_e4m3fn, jnp.bfloat16),  # FP8 leaves
    ],
)
def test_state_the_inner_optimizer_keeps_narrower_is_not_widened(inner, param_dtype, storage):
    """`init` casts the inner state *down* to the storage dtype: a leaf the inner optimizer
    keeps narrower keeps its dtype. It was cast up (bfloat16 mu under dtype=float32: a third
    more memory than optax's own state; FP8 leaves to bfloat16), every step."""
    params = jax.tree.map(lambda p: p.astype(param_dtype), _params(jax.random.key(9)))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
    optimizer = low_precision_state(inner, storage)
    own, state = inner.init(params), optimizer.init(params)
    own_dtypes = jax.tree.map(lambda x: x.dtype, own)
    assert jax.tree.map(lambda x: x.dtype, state) == own_dtypes
    assert sum(x.nbytes for x in jax.tree.leaves(state)) == sum(
        x.nbytes for x in jax.tree.leaves(own)
    )
    _, state1 = optimizer.update(grads, state, params)
    _, own1 = inner.update(grads, own, params)
    _, state2 = jax.jit(optimizer.update)(grads, state1, params)
    for s in (state1, state2):
        assert jax.tree.map(lambda x: x.dtype, s) == own_dtypes
    # From zero state, optax's first step is float32 arithmetic rounded once: the same.
    assert eqx.tree_equal(state1, own1)


def _run(optimizer, params, grads_seq):
    """Updates and Adam moments after each step (moments as the optimizer stores them)."""
    state = optimizer.init(params)

    def step(state, grads):
        updates, state = optimizer.update(grads, state, params)
        adam = _adam_states(state)
        return state, (updates, adam.mu, adam.nu)

    return jax.jit(lambda s, g: jax.lax.scan(step, s, g))(state, grads_seq)[1]


def _grads_seq(key, params, steps):
    keys = jax.random.split(key, steps)
    return jax.tree.map(lambda p: jnp.stack([jax.random.normal(k, p.shape) for k in keys]), params)


def test_updates_within_bf16_error_bound_of_float32_adamw():
    lr, wd, steps = 1e-3, 1e-2, 10
    params = _params(jax.random.key(0))
    grads = _grads_seq(jax.random.key(1), params, steps)
    ref_updates, ref_mu, ref_nu = _run(optax.adamw(lr, B1, B2, EPS, weight_decay=wd), params, grads)
    low_updates, low_mu, low_nu = _run(
        low_precision_state(optax.adamw(lr, B1, B2, EPS, weight_decay=wd)), params, grads
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((low_mu, low_nu)))

    # First-order error propagation along the float32 trajectory. The update at step t is
    # computed in float32 from the moments stored (rounded) at steps 1..t-1; each rounding
    # errs by at most U_BF16 relative and decays by b per step afterwards, so
    #   |dmu_t| <= U * sum_{k<t} b1**(t-k) |mu_k|,   |dnu_t| <= U * sum_{k<t} b2**(t-k) nu_k.
    # The update lr * (mu_t / c1) / (sqrt(nu_t / c2) + eps), with c = 1 - b**t, then moves by
    #   lr * (|dmu| / (c1 (s + eps)) + |mu| / c1 * |dnu| / (2 c2 s (s + eps)**2)),  s = sqrt(nu/c2).
    # Second-order terms are O(U) = 0.4% of these (dnu/nu <= 9 U after 10 steps): 10% slack
    # covers them. Both runs round the same float32 operations on different inputs: 32 float32
    # ulps of the update's magnitude cover that. The weight-decay term is computed identically.
    for name in params:
        mu, nu = np.asarray(ref_mu[name], np.float64), np.asarray(ref_nu[name], np.float64)
        ref, low = np.asarray(ref_updates[name]), np.asarray(low_updates[name])
        p = np.asarray(params[name], np.float64)
        dmu, dnu = np.zeros_like(mu[0]), np.zeros_like(nu[0])
        worst = 0.0
        for t in range(1, steps + 1):
            i = t - 1
            c1, c2 = 1 - B1**t, 1 - B2**t
            s = np.sqrt(nu[i] / c2)
            first_order = lr * (
                dmu / (c1 * (s + EPS)) + np.abs(mu[i]) / c1 * dnu / (2 * c2 * s * (s + EPS) ** 2)
            )
            f32_noise = 32 * U_F32 * lr * (np.abs(mu[i]) / c1 / (s + EPS) + wd * np.abs(p))
            bound = 1.1 * first_order + f32_noise
            err = np.abs(low[i].astype(np.float64) - ref[i])
            assert np.all(err <= bound), (name, t, np.max(err / bound))
            worst = max(worst, float(np.max(err / bound)))
            # Errors carried into step t + 1.
            dmu = B1 * (dmu + U_BF16 * np.abs(mu[i]))
            dnu = B2 * (dnu + U_BF16 * nu[i])
        # The bound is not vacuous: the updates do differ, by a sizeable part of it.
        assert worst > 0.05, worst
        print(f"\n{name}: largest error / bound = {worst:.3f}")
        assert np.max(np.abs(low - ref)) > 0


def _to_bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _numpy_adamw_bf16(params, grads_seq, lr, wd, steps):
    """AdamW in float32 numpy with the moments rounded to bfloat16 after each step (optax's
    operation order: (1 - b) * g + b * m, and m / (1 - b**t) / (sqrt(v / (1 - b2**t)) + eps))."""
    f = np.float32
    p = np.asarray(params, f)
    mu, nu = np.zeros_like(p), np.zeros_like(p)
    out_updates, out_mu, out_nu, out_size = [], [], [], []
    for t in range(1, steps + 1):
        g = np.asarray(grads_seq[t - 1], f)
        mu = f(1 - B1) * g + f(B1) * mu
        nu = f(1 - B2) * (g * g) + f(B2) * nu
        c1 = f(1) - f(B1) ** f(t)
        c2 = f(1) - f(B2) ** f(t)
        update = (mu / c1) / (np.sqrt(nu / c2) + f(EPS))
        out_size.append(f(lr) * (np.abs(update) + f(wd) * np.abs(p)))  # before cancellation
        update = -f(lr) * (update + f(wd) * p)
        mu, nu = _to_bf16(mu), _to_bf16(nu)
        out_updates.append(update)
        out_mu.append(mu)
        out_nu.append(nu)
    return tuple(np.stack(x) for x in (out_updates, out_mu, out_nu, out_size))


def test_matches_numpy_reference_with_bf16_rounded_moments():
    lr, wd, steps = 1e-3, 1e-2, 10
    params = _params(jax.random.key(2))
    grads = _grads_seq(jax.random.key(3), params, steps)
    scale = jnp.exp(jax.random.uniform(jax.random.key(4), (steps, 64, 4), minval=-5, maxval=5))
    grads = {"w": grads["w"] * scale, "b": grads["b"]}  # magnitudes over four decades
    low_updates, low_mu, low_nu = _run(
        low_precision_state(optax.adamw(lr, B1, B2, EPS, weight_decay=wd)), params, grads
    )
    for name in params:
        want_updates, want_mu, want_nu, size = _numpy_adamw_bf16(
            params[name], np.asarray(grads[name]), lr, wd, steps
        )
        # The stored moments: the same float32 operations, rounded once: bit for bit.
        np.testing.assert_array_equal(np.asarray(low_mu[name], np.float32), want_mu)
        np.testing.assert_array_equal(np.asarray(low_nu[name], np.float32), want_nu)
        # The updates: float32 roundings, and XLA's pow may differ from numpy's by an ulp of
        # b**t, which 1 - b**t amplifies by b**t / (1 - b**t). Relative to the size of the
        # Adam and weight-decay terms, before they cancel in the sum.
        for t in range(1, steps + 1):
            pow_err = np.finfo(np.float32).eps * (B1**t / (1 - B1**t) + B2**t / (1 - B2**t) / 2)
            err = np.abs(np.asarray(low_updates[name][t - 1], np.float64) - want_updates[t - 1])
            assert np.all(err <= (2 * pow_err + 16 * U_F32) * size[t - 1]), (name, t)


def _constant_gradient_run(storage, magnitudes, phases):
    """Adam (b2 = 0.999) on constant gradients; nu and updates after every step.

    `phases`: `[(steps, gradient multiplier), ...]` run one after the other."""
    optimizer = optax.adam(1e-3, B1, B2, EPS)
    if storage is not None:
        optimizer = low_precision_state(optimizer, storage)
    params = jnp.zeros_like(magnitudes)
    grads = jnp.concatenate(
        [jnp.broadcast_to(m * magnitudes, (n, len(magnitudes))) for n, m in phases]
    )
    state = optimizer.init(params)

    def step(state, g):
        updates, state = optimizer.update(g, state, params)
        return state, (state[0].nu.astype(jnp.float32), updates)

    nu, updates = jax.jit(lambda s, g: jax.lax.scan(step, s, g))(state, grads)[1]
    return np.asarray(nu, np.float64), np.asarray(updates, np.float64)


MAGNITUDES = jnp.asarray(2.0 ** np.linspace(-6, 2, 64), jnp.float32)  # across 8 binades


def test_second_moment_stalls_under_steady_gradients():
    """With bfloat16 storage, nu stops growing far below g**2; float32 reaches 0.95 g**2.

    A stored nu is left unchanged when the step 0.001 * (g**2 - nu) is under half an ulp of nu,
    which is between 2**-9 and 2**-8 of nu. So the stall point v satisfies
    0.001 * (g**2 - v) <= 2**-8 v, i.e. v >= g**2 / (1 + 2**-8 / 0.001) = g**2 / 4.9; and the
    value before it still moved, 0.001 * (g**2 - v') > 2**-9 v', so v' < g**2 / 2.95 and
    v <= v' (1 + 2**-8) + 0.001 g**2. The float32 run passes g**2 / 2.95 at t ~ 420, so by
    step 1000 every stored nu has stalled."""
    steps = 3000
    g2 = np.asarray(MAGNITUDES, np.float64) ** 2
    nu32, upd32 = _constant_gradient_run(None, MAGNITUDES, [(steps, 1.0)])
    nu16, upd16 = _constant_gradient_run(jnp.bfloat16, MAGNITUDES, [(steps, 1.0)])

    # float32: the closed form (1 - b2**t) g**2, within accumulated float32 rounding
    # (each step's error is damped by b2: at most ~1 / (1 - b2) = 1000 ulps, 4 per step).
    np.testing.assert_allclose(nu32[-1], (1 - B2**steps) * g2, rtol=4 * U_F32 / (1 - B2))

    # bfloat16: stalled by step 1000, inside the predicted band.
    assert np.all(nu16[999:] == nu16[-1])
    lower = 1 / (1 + 2.0**-8 / (1 - B2))
    upper = (1 + 2.0**-8) / (1 + 2.0**-9 / (1 - B2)) + (1 - B2)
    ratio = nu16[-1] / g2
    assert np.all((lower <= ratio) & (ratio <= upper)), (ratio.min(), ratio.max())
    # A fixed point of "update in float32, store in bfloat16".
    f = np.float32
    again = _to_bf16(f(1 - B2) * np.float32(g2) + f(B2) * np.float32(nu16[-1]))
    np.testing.assert_array_equal(again, np.float32(nu16[-1]))
    # Hence bias-corrected updates 1.6-2.2 times float32's: sqrt(0.95 / ratio) times the stalled
    # mu's shortfall (mu stalls 2-4% below g: 0.1 (g - mu) <= 2**-8 mu).
    update_ratio = upd16[-1] / upd32[-1]
    mu_low = 1 / (1 + 2.0**-8 / (1 - B1))
    assert np.all(update_ratio >= mu_low * np.sqrt((1 - B2**steps) / upper))
    assert np.all(update_ratio <= np.sqrt((1 - B2**steps) / lower) * (1 + 2.0**-8))
    last_change = [int(np.max(np.nonzero(np.diff(nu16[:, i]))[0])) + 2 for i in range(len(g2))]
    print(
        f"\nsteady |g|, {steps} steps: float32 nu/g^2 = {(nu32[-1] / g2).min():.4f}-"
        f"{(nu32[-1] / g2).max():.4f}; bfloat16 nu/g^2 = {ratio.min():.4f}-{ratio.max():.4f} "
        f"(median {np.median(ratio):.4f}), last change at step {min(last_change)}-"
        f"{max(last_change)}; update bf16/f32 = {update_ratio.min():.3f}-{update_ratio.max():.3f}"
    )


def test_second_moment_never_decays():
    """After a burst of large gradients, bfloat16 nu keeps its peak: a step lowers nu by at most
    (1 - b2) nu = 0.1% of it, below half an ulp (>= 2**-9 = 0.195%). float32 decays by b2**t."""
    burst, quiet = 500, 2000
    phases = [(burst, 1.0), (quiet, 0.1)]
    g2 = np.asarray(MAGNITUDES, np.float64) ** 2
    nu32, _ = _constant_gradient_run(None, MAGNITUDES, phases)
    nu16, _ = _constant_gradient_run(jnp.bfloat16, MAGNITUDES, phases)

    peak32 = (1 - B2**burst) * g2
    want32 = B2**quiet * peak32 + (1 - B2**quiet) * 0.01 * g2
    np.testing.assert_allclose(nu32[burst - 1], peak32, rtol=4 * U_F32 / (1 - B2))
    np.testing.assert_allclose(nu32[-1], want32, rtol=4 * U_F32 / (1 - B2))
    assert np.all(np.diff(nu16, axis=0) >= 0)  # never decreases, at any step
    assert np.all(nu16[-1] == nu16[burst - 1])  # the quiet phase changed nothing
    print(
        f"\nburst {burst} steps at g, {quiet} at g/10: float32 nu end/peak = "
        f"{(nu32[-1] / nu32[burst - 1]).min():.4f}-{(nu32[-1] / nu32[burst - 1]).max():.4f}; "
        f"bfloat16 nu end/peak = {(nu16[-1] / nu16[burst - 1]).min():.4f}-"
        f"{(nu16[-1] / nu16[burst - 1]).max():.4f}"
    )


def test_float32_storage_is_exact():
    """dtype=float32 is the inner optimizer, bit for bit."""
    params = _params(jax.random.key(5))
    grads = _grads_seq(jax.random.key(6), params, 5)
    ref = _run(optax.adamw(1e-3), params, grads)
    same = _run(low_precision_state(optax.adamw(1e-3), jnp.float32), params, grads)
    assert eqx.tree_equal(ref, same)


def test_float16_storage_warns_of_the_second_moments_it_flushes():
    """float16 storage flushes Adam's nu of gradients below about 5.5e-3 to 0 (below its
    smallest subnormal), so updates grow toward lr / sqrt(1 - b2): measured here, and warned
    of where the wrapper is made."""
    grads = jnp.asarray([1e-2, 3e-3, 1e-3, 1e-4], jnp.float32)
    with pytest.warns(UserWarning, match="float16 flushes values below 3e-8"):
        nu, updates = _constant_gradient_run(jnp.float16, grads, [(300, 1.0)])
    assert nu[-1, 0] > 0 and np.all(nu[-1, 1:] == 0)  # (1 - b2) g**2 < 3e-8 flushed
    nu32, updates32 = _constant_gradient_run(None, grads, [(300, 1.0)])
    # 16x at step 300 (the bias correction 1 - b2**300), toward 32x later.
    assert np.all(np.abs(updates[-1, 1:]) > 10 * np.abs(updates32[-1, 1:]))


def test_float16_warning_states_the_gradient_below_which_nu_is_stored_as_0():
    """The warning (and the docstring) said Adam's nu of a gradient below about 7e-3 is stored
    as 0; from 5.5e-3 up it is not (float16 rounds (1 - b2) g**2 >= 2**-25, half its smallest
    subnormal, up to that subnormal). The stated gradient is the one ml_dtypes' rounding of
    the first step's nu gives, and the optimizer flushes just below it, not just above."""
    with pytest.warns(UserWarning, match="float16 flushes") as record:
        low_precision_state(optax.adam(1e-3), jnp.float16)
    message = str(record[0].message)
    stated = float(re.search(r"gradient below about ([0-9.]+e-[0-9]+)", message).group(1))
    # nu after the first step from 0: float32 (1 - b2) * g**2 rounded to float16; 0 stays 0.
    g = np.geomspace(1e-3, 1e-2, 4001, dtype=np.float32)
    stored = (np.float32(1 - B2) * g * g).astype(np.float16)
    threshold = float(g[stored > 0][0])
    assert abs(stated / threshold - 1) < 0.02, (stated, threshold)
    grads = jnp.asarray([0.98 * threshold, 1.02 * threshold], jnp.float32)
    with pytest.warns(UserWarning, match="float16 flushes"):
        nu, _ = _constant_gradient_run(jnp.float16, grads, [(50, 1.0)])
    assert nu[-1, 0] == 0 and nu[-1, 1] > 0


def test_schedule_free_z_stalls_in_bfloat16_and_the_documented_recipe_keeps_it_float32():
    """Schedule-free's `z` is a copy of the parameters: in bfloat16, a step below half an ulp of
    z (lr 1e-3 against 2**-8 for z in [1, 2)) rounds back to the stored z, which never moves.
    The documented recipe wraps only the base optimizer: z stays float32 and the parameters
    follow a float64 reference of schedule-free AdamW whose nu is rounded to bfloat16."""
    lr, b1, steps = 1e-3, 0.9, 20
    p0 = np.linspace(1.0, 1.9, 8).astype(ml_dtypes.bfloat16).astype(np.float32)
    g = np.linspace(0.1, 0.9, 8).astype(np.float32)
    params, grads = {"w": jnp.asarray(p0)}, {"w": jnp.asarray(g)}

    def run(optimizer):
        state, p = optimizer.init(params), params
        for _ in range(steps):
            updates, state = optimizer.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return np.asarray(p["w"], np.float64), state

    whole_p, whole = run(low_precision_state(optax.contrib.schedule_free_adamw(lr, b1=b1)))
    assert whole.z["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(whole.z["w"], np.float32), p0)  # stalled

    base = optax.chain(  # as the docstring shows
        low_precision_state(optax.scale_by_rms(B2, EPS, eps_in_sqrt=False, bias_correction=True)),
        optax.add_decayed_weights(0.0),
        optax.scale_by_learning_rate(lr),
    )
    recipe = optax.contrib.schedule_free(base, learning_rate=lr, b1=b1)
    got, state = run(recipe)
    assert state.z["w"].dtype == jnp.float32
    # float64 reference: nu computed in float32 from the stored one and stored in bfloat16
    # (the step's update uses it unrounded); z, x, y in float64.
    nu, z, x, y = np.zeros_like(g), p0.astype(np.float64), p0.astype(np.float64), None
    for t in range(1, steps + 1):
        nu32 = np.float32(1 - B2) * g * g + np.float32(B2) * nu
        z = z - lr * g / (np.sqrt(nu32 / (1 - B2**t)) + EPS)
        nu = _to_bf16(nu32)
        x = (1 - 1 / t) * x + z / t  # weight lr**2 each step: c_t = 1 / t
        y = b1 * x + (1 - b1) * z
    np.testing.assert_allclose(got - p0, y - p0, rtol=1e-4)
    assert np.all(np.abs(whole_p - y) > 10 * np.abs(got - y))  # the stall's error, not noise

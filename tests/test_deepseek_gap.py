"""The paper's FP8 emulation of benchmarks/deepseek_gap.py (issue 40): it is fp8jax's blockwise
recipe where both claim the same thing, each switch does what it says, and the helpers that
turn models into experiments keep the weights."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax.examples.deepseek_model import DeepSeekConfig, DeepSeekV3, deepseek_loss

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gap():
    spec = importlib.util.spec_from_file_location(
        "deepseek_gap", ROOT / "benchmarks" / "deepseek_gap.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations there
    spec.loader.exec_module(module)
    return module


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _grads(layer, args, ct, grad=eqx.filter_grad):
    def loss(pair):
        m, a = pair
        return jnp.sum(m(*a).astype(jnp.float32) * ct)

    g = grad(loss)((layer, args))
    return layer(*args), g[1][0], g[0].weight


def _with_dot(layer, dot):
    if isinstance(layer, fp8jax.GroupedLinear):
        return eqx.tree_at(lambda m: m.ragged_dot, layer, dot, is_leaf=lambda v: v is None)
    return fp8jax.Linear(layer.weight, None, dot_general=dot)


def _cases():
    k = jax.random.split(jax.random.PRNGKey(3), 5)
    x = (jax.random.normal(k[0], (300, 200)) * 3).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (260, 200)) * 0.05  # float32: dw compared to f32 rounding
    dense = (
        fp8jax.Linear(w, None, dot_general=jax.lax.dot_general),
        (x,),
        jax.random.normal(k[2], (300, 260)) * 1e-3,
    )
    sizes = jnp.array([100, 0, 37, 300, 63], jnp.int32)  # an empty expert, uneven tiles
    xg = (jax.random.normal(k[3], (500, 200)) * 3).astype(jnp.bfloat16)
    layer = fp8jax.GroupedLinear(5, 200, 260, key=k[4])
    grouped = (layer, (xg, sizes), jax.random.normal(k[2], (500, 260)) * 1e-3)
    return {"dense": dense, "grouped": grouped}


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_emulation_is_fp8jax_blockwise(gap, kind, pow2):
    """Every pass on, the wgrad from the FP8 cache: the paper's GEMMs as written in the
    benchmark and fp8jax's `BlockwiseScaling` give the same forward and dgrad to the bit and
    the same wgrad to float32 rounding (summation order, `q / s` against `q * (1 / s)`), with
    exact and with power-of-two scales (powers of two exactly: XLA's `exp2` is not, and a
    scale a rounding off a power of two breaks E4M3's ties, frequent in BF16 values, one way)."""
    base, args, ct = _cases()[kind]
    recipe = fp8jax.BlockwiseScaling(dequantized_dot=True, power_of_two=pow2)
    lib_dot = (
        fp8jax.Fp8RaggedDot(recipe, num_experts=5)
        if kind == "grouped"
        else fp8jax.Fp8DotGeneral(recipe)
    )
    make = gap.EmulatedRagged if kind == "grouped" else gap.EmulatedDot
    emu_dot = make(gap.Passes(pow2=pow2))
    y0, dx0, dw0 = _grads(_with_dot(base, lib_dot), args, ct, fp8jax.filter_grad)
    y1, dx1, dw1 = _grads(_with_dot(base, emu_dot), args, ct)
    assert _rel(y1, y0) == 0.0
    assert _rel(dx1, dx0) == 0.0
    assert _rel(dw1, dw0) < 2e-5
    # ... and it is FP8: far from the high-precision GEMM.
    y2, dx2, dw2 = _grads(_with_dot(base, None) if kind == "grouped" else base, args, ct)
    assert _rel(y1, y2) > 1e-2 and _rel(dw1, dw2) > 1e-2


@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_switched_off_passes_are_high_precision(gap, kind):
    """A pass switched off equals the high-precision GEMM's; one switched on does not."""
    base, args, ct = _cases()[kind]
    make = gap.EmulatedRagged if kind == "grouped" else gap.EmulatedDot
    plain = _with_dot(base, None) if kind == "grouped" else base
    y, dx, dw = _grads(plain, args, ct)
    off = gap.Passes(forward=False, dgrad=False, wgrad=False)
    y0, dx0, dw0 = _grads(_with_dot(base, make(off)), args, ct)
    assert _rel(y0, y) < 1e-2 and _rel(dx0, dx) < 1e-2 and _rel(dw0, dw) < 1e-5
    for field, idx in (("forward", 0), ("dgrad", 1), ("wgrad", 2)):
        on = gap.Passes(**{f: f == field for f in ("forward", "dgrad", "wgrad")})
        got = _grads(_with_dot(base, make(on)), args, ct)
        ref = (y, dx, dw)
        assert _rel(got[idx], ref[idx]) > 1e-2, field
        for other in {0, 1, 2} - {idx} - ({1, 2} if idx == 0 else set()):
            assert _rel(got[other], ref[other]) < 1e-2, (field, other)


def test_quantizers_against_ml_dtypes(gap):
    """1 x 128 tiles, 128 x 128 blocks and 128 x 1 tiles (by row index) round as ml_dtypes'
    E4M3 at `448 / amax` of their tile (to float32 rounding of the scale: a different E4M3
    rounding would be 2**-4 off); pow2 scales are powers of two."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 300)).astype(np.float32) * np.exp(rng.standard_normal((200, 1)))

    def ref(t):
        scale = np.float32(448.0) / np.max(np.abs(t))
        return (t * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale

    want = np.concatenate(
        [
            np.concatenate([ref(x[r : r + 1, c : c + 128]) for c in range(0, 300, 128)], 1)
            for r in range(200)
        ]
    )
    np.testing.assert_allclose(np.asarray(gap.rows(jnp.asarray(x), False)), want, rtol=1e-6)
    blk = np.asarray(gap.blocks(jnp.asarray(x), False))
    np.testing.assert_allclose(blk[128:, 256:], ref(x[128:, 256:]), rtol=1e-6)
    tile = jnp.arange(200) // 128
    col = np.asarray(gap.columns(jnp.asarray(x), tile, 2, False))
    np.testing.assert_allclose(col[:128, 5:6], ref(x[:128, 5:6]), rtol=1e-6)
    tile = x[7:8, 128:256]
    scale = np.float32(2.0 ** np.floor(np.log2(448.0 / np.max(np.abs(tile)))))
    exact = (tile * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale
    np.testing.assert_array_equal(np.asarray(gap.rows(jnp.asarray(x), True))[7:8, 128:256], exact)


def test_emulate_and_strip_keep_the_weights(gap):
    """`emulate` converts the named groups only; `strip` gives back a model with the same
    weights and the high-precision loss; the router and the head are never touched."""
    config = DeepSeekConfig(vocab=64, context=16, layers=2, experts=4)
    model = DeepSeekV3(config, key=jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, 64)
    emulated = gap.emulate(model, {"routed_up": gap.Passes(), "mla_down": gap.Passes()})
    moe = emulated.blocks[1].ffn
    assert isinstance(moe.up.ragged_dot, gap.EmulatedRagged) and moe.down.ragged_dot is None
    assert isinstance(emulated.blocks[0].attn.q_down, fp8jax.Linear)
    assert isinstance(emulated.blocks[0].attn.q_up, eqx.nn.Linear)
    assert isinstance(moe.gate, eqx.nn.Linear) and isinstance(emulated.head, eqx.nn.Linear)
    loss = lambda m: float(deepseek_loss(m, tokens)[0])  # noqa: E731
    assert loss(emulated) != loss(model)
    assert loss(gap.strip(emulated)) == pytest.approx(loss(model), rel=1e-6)
    converted = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe="blockwise"))
    assert loss(gap.strip(converted)) == pytest.approx(loss(model), rel=1e-6)
    with pytest.raises(ValueError, match="unknown groups"):
        gap.emulate(model, {"attention": gap.Passes()})


def test_vs_table(gap):
    """Gaps in % of the same seed's BF16 and float32 losses, mean and spread over seeds."""
    table = gap.vs_table({"bf16": [2.0, 1.0], "fp32": [1.0, 2.0], "x": [2.02, 1.01]})
    row = next(line for line in table.splitlines() if line.startswith("| x "))
    assert "+1.00, +1.00 | +1.00 | 0.00" in row
    assert "+102.00, -49.50" in row


def test_shadow_loss_routes_as_told(gap):
    """Routed by its own forward's routes, `shadow_loss` is `deepseek_loss` (value, gradient,
    loads); routed by another forward's routes, it sends the tokens to those experts only (no
    gradient reaches the others) while the affinities stay its own."""
    config = DeepSeekConfig(vocab=64, context=16, layers=2, experts=4, remat=True)
    model = DeepSeekV3(config, key=jax.random.PRNGKey(0))
    bias = jnp.array([0.3, -0.2, 0.0, 0.1])  # a bias that moves routes, as training leaves one
    model = eqx.tree_at(lambda m: m.blocks[1].ffn.balance.bias, model, bias)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 64)

    own = eqx.filter_jit(eqx.filter_value_and_grad(gap.shadow_loss(lambda m: m), has_aux=True))
    plain = eqx.filter_jit(eqx.filter_value_and_grad(deepseek_loss, has_aux=True))
    (l1, load1), g1 = own(model, tokens)
    (l0, load0), g0 = plain(model, tokens)
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)
    np.testing.assert_array_equal(load1.routed, load0.routed)
    np.testing.assert_array_equal(load1.unbiased, load0.unbiased)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    # Routes of another forward: here one whose bias sends every token to experts 2 and 3.
    def forced(m):
        return eqx.tree_at(lambda m: m.blocks[1].ffn.balance.bias, m, jnp.array([-2.0, -2, 2, 2]))

    shadow = eqx.filter_jit(eqx.filter_value_and_grad(gap.shadow_loss(forced), has_aux=True))
    (l2, load2), g2 = shadow(model, tokens)
    np.testing.assert_array_equal(load2.routed[0], [0, 0, 64, 64])
    np.testing.assert_array_equal(load2.unbiased, load0.unbiased)  # affinities: the model's
    assert float(l2) != pytest.approx(float(l0), rel=1e-6)
    assert not jnp.any(g2.blocks[1].ffn.up.weight[:2]) and jnp.all(
        jnp.any(g0.blocks[1].ffn.up.weight[:2] != 0, axis=(1, 2))
    )

"""FP8 layers fed their float32 masters: `fp8jax.Policy.cast_to_compute` leaves an FP8
Linear's weight uncast (`Linear.compute_dtype`), its GEMM quantizes the master in one pass and
writes the weight's gradient as the gradient of a BF16 copy would be (`Static.gradient_dtypes`)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import U_F32, assert_bf16_linear

import fp8jax
from fp8jax._src.observe import deviceless

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
POLICY = fp8jax.Policy.from_string("params=float32,compute=bfloat16")


def _fp8_linear(n_in, n_out, recipe="delayed", key=0, bias=True):
    linear = eqx.nn.Linear(n_in, n_out, use_bias=bias, key=jax.random.key(key))
    return fp8jax.Linear.from_eqx(linear, fp8jax.Fp8DotGeneral(recipe))


def _user_cast(tree):
    """Every float but FP8 state in BF16, as a user's own `jax.tree.map` casts a model."""
    is_state = lambda x: isinstance(x, fp8jax.OverwriteWithGradient)  # noqa: E731
    cast = lambda x: x if is_state(x) or not eqx.is_inexact_array(x) else x.astype(BF16)  # noqa: E731
    return jax.tree.map(cast, tree, is_leaf=is_state)


def test_policy_keeps_only_fp8_layers_masters():
    fp8 = _fp8_linear(8, 4)
    model = {
        "fp8": fp8,
        "plain": fp8jax.Linear(fp8.weight, fp8.bias, dot_general=jax.lax.dot_general),
        "eqx": eqx.nn.Linear(8, 4, key=jax.random.key(1)),
    }
    compute = POLICY.cast_to_compute(model)
    assert compute["fp8"].weight is fp8.weight  # the master itself, never copied
    assert compute["fp8"].bias.dtype == BF16 and compute["fp8"].compute_dtype == BF16
    assert eqx.tree_equal(compute["fp8"].dot_general, fp8.dot_general)  # FP8 state untouched
    assert compute["plain"].weight.dtype == BF16 and compute["plain"].compute_dtype is None
    assert compute["eqx"].weight.dtype == BF16
    # Run in BF16: the output in the compute dtype, not the promotion of BF16 and float32.
    x = jnp.ones((3, 8), BF16)
    assert compute["fp8"](x).dtype == BF16 and compute["plain"](x).dtype == BF16
    # Back to the param dtype: the master as it was (the bias rounded), the layer told nothing.
    back = POLICY.cast_to_param(compute)
    assert back["fp8"].compute_dtype is None and back["fp8"].weight is fp8.weight
    assert eqx.tree_equal(back["fp8"].dot_general, fp8.dot_general)
    # Nothing to keep where the weight is not wider than the compute dtype.
    for policy, stored in (("p=bf16,c=f32", BF16), ("p=f32,c=f32", F32)):
        layer = fp8jax.Policy.from_string(policy).cast_to_param(fp8)
        cast = fp8jax.Policy.from_string(policy).cast_to_compute(layer)
        assert cast.compute_dtype is None and cast.weight.dtype == np.promote_types(stored, F32)


def test_stacked_layers_keep_their_masters():
    """Linears built under `eqx.filter_vmap` (a scanned stack, weights `(layers, out, in)`)
    converted: the cast keeps the stacked masters, and each layer computes in BF16."""
    make = lambda k: eqx.nn.Linear(8, 4, key=k)  # noqa: E731
    stack = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), 3))
    stack = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config())
    cast = POLICY.cast_to_compute(stack)
    assert cast.weight is stack.weight and cast.weight.shape == (3, 4, 8)
    assert cast.compute_dtype == BF16 and cast.bias.dtype == BF16
    xs = jnp.ones((3, 2, 8), BF16)
    assert eqx.filter_vmap(lambda layer, x: layer(x))(cast, xs).dtype == BF16
    abstract = eqx.filter_eval_shape(POLICY.cast_to_compute, stack)
    assert abstract.compute_dtype == BF16 and abstract.weight.dtype == F32
    assert POLICY.cast_to_param(cast).with_compute_dtype(BF16).compute_dtype == BF16


def test_linear_compute_dtype():
    layer = fp8jax.Linear(jnp.ones((4, 8)), None, compute_dtype="bfloat16")
    assert layer.compute_dtype == BF16
    with pytest.raises(ValueError, match=r"compute_dtype='int8' is int8, not a floating"):
        fp8jax.Linear(jnp.ones((4, 8)), None, compute_dtype="int8")
    with pytest.raises(ValueError, match=r"compute_dtype='nonsense' is not a dtype"):
        fp8jax.Linear(jnp.ones((4, 8)), None, compute_dtype="nonsense")


def test_a_float32_bias_does_not_widen_the_compute_dtype():
    """`with_compute_dtype(bf16)` on a float32 layer with a bias: the output is BF16, as
    documented, and bit for bit what `Policy.cast_to_compute` (which casts the bias) gives
    (the float32 bias promoted the output back to float32)."""
    fp8 = _fp8_linear(8, 4)
    x = jax.random.normal(jax.random.key(1), (3, 8)).astype(BF16)
    y = fp8.with_compute_dtype(BF16)(x)
    assert y.dtype == BF16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(POLICY.cast_to_compute(fp8)(x)))
    plain = fp8jax.Linear(fp8.weight, fp8.bias, dot_general=jax.lax.dot_general)
    assert plain.with_compute_dtype(BF16)(x).dtype == BF16


def _loss(cast, layer, x, c):
    """A loss linear in the layer's output: its output gradient is `c` whatever the forward."""
    return jnp.sum(cast(layer)(x.astype(BF16)).astype(F32) * c)


def test_master_quantized_once_and_its_gradient_a_bf16_copys():
    """Delayed scaling's first step (the warm start: each operand scaled by its own amax). The
    policy's layer records the master's amax, quantizes the master (float64 reference of its
    E4M3 rounding), and its weight gradient is, bit for bit, the gradient a user's BF16 copy
    gets (the same FP8 gradient and activation), in float32."""
    layer = _fp8_linear(256, 64, bias=False)
    x = jax.random.normal(jax.random.key(2), (32, 256))
    c = jax.random.normal(jax.random.key(3), (32, 64))
    grads = {}
    for name, cast in (("policy", POLICY.cast_to_compute), ("user", _user_cast)):
        grads[name] = fp8jax.filter_grad(functools.partial(_loss, cast))(layer, x, c)
    master = np.asarray(layer.weight)
    amax = {name: np.float32(g.dot_general.kernel.amax_history[0]) for name, g in grads.items()}
    assert amax["policy"] == np.max(np.abs(master))
    assert amax["user"] == np.max(np.abs(master.astype(BF16).astype(F32)))
    assert amax["policy"] != amax["user"]  # the test tells the two apart
    d_w = {name: g.weight for name, g in grads.items()}
    assert d_w["policy"].dtype == d_w["user"].dtype == F32
    np.testing.assert_array_equal(np.asarray(d_w["policy"]), np.asarray(d_w["user"]))
    # The forward from the master, within its BF16 output's bound.
    y = POLICY.cast_to_compute(layer)(x.astype(BF16))
    assert y.dtype == BF16
    sx, sw = (
        float(fp8jax.compute_scale(jnp.max(jnp.abs(t)), 1.0, 448.0, power_of_two=True))
        for t in (x.astype(BF16).astype(F32), layer.weight)
    )
    assert_bf16_linear(y, x.astype(BF16), master, None, sx, sw)


def test_blockwise_master_against_the_reference():
    """A blockwise `Fp8DotGeneral` of BF16 activations and a float32 weight, its output in
    BF16: the recipe's float64 reference (tests/reference.py) on the master, within the
    float32 accumulation and one BF16 rounding; the weight's gradient in float32 holds BF16
    values (written in the output's dtype)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0.5, 1.0, (16, 256)), BF16)
    w = jnp.asarray(rng.uniform(0.5, 1.0, (256, 128)), F32)  # (K, N): x @ w
    g = jnp.asarray(rng.uniform(0.5, 1.0, (16, 128)), BF16)
    dot = fp8jax.Fp8DotGeneral("blockwise")
    dims = (((1,), (0,)), ((), ()))
    out, pullback = jax.vjp(lambda a, b: dot(a, b, dims, preferred_element_type=BF16), x, w)
    d_x, d_w = pullback(g)
    assert (out.dtype, d_x.dtype, d_w.dtype) == (BF16, BF16, F32)
    np.testing.assert_array_equal(np.asarray(d_w), np.asarray(d_w.astype(BF16).astype(F32)))
    recipe = dot.recipe
    wants = ref.blockwise(
        np.asarray(x, np.float32),
        np.asarray(w).T,
        np.asarray(g, np.float32),
        block=recipe.block_size,
        power_of_two=recipe.power_of_two,
    )
    # Every term positive: the products summed weigh |want|.
    for got, want, terms in zip((out, d_x, d_w.T), wants, (256, 128, 16), strict=True):
        bound = 2.0**-8 * np.abs(want) + (terms + 4) * U_F32 * 2 * np.abs(want)
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), bound)


def _h100_step(cast):
    def step(layer, x):
        loss = lambda lay, x: jnp.mean(cast(lay)(x).astype(F32) ** 2)  # noqa: E731
        _, grads = fp8jax.filter_value_and_grad(loss)(layer, x)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda d: -1e-3 * d, grads)
        return fp8jax.apply_updates(layer, updates, overwrites)

    return step


def test_h100_blockwise_master_saves_its_cast():
    """Deviceless H100, blockwise on fp8jax's kernels, an SGD step: the policy's step has no
    BF16 copy of the weight (one kernel fewer) and moves 4 bytes a weight less (the cast read
    4 and wrote 2, the weight kernel read those 2; it reads the master's 4), all else equal."""
    if deviceless.h100_topology() is None:
        pytest.skip("no deviceless H100 compile on this machine")
    n, k = 512, 256
    layer = _fp8_linear(k, n, "blockwise", bias=False)
    x = jax.ShapeDtypeStruct((256, k), BF16)
    device = deviceless.h100_topology().devices[0]
    costs = {}
    for name, cast in (("policy", POLICY.cast_to_compute), ("user", _user_cast)):
        lowered, _ = deviceless.lower(_h100_step(cast), (layer, x), {}, device)
        costs[name] = fp8jax.hlo_cost(lowered.compile(fp8jax.gpu_compiler_options()).as_text())
    kernels = {name: [c.op_name for c in cost.kernels] for name, cost in costs.items()}
    casts = [
        op
        for op in kernels["user"]
        if op.endswith("convert_element_type") and "transpose" not in op
    ]
    assert len(casts) == 1 and len(kernels["policy"]) == len(kernels["user"]) - 1
    assert not [op for op in kernels["policy"] if op == casts[0]]
    total = {name: sum(cost.bytes.values()) for name, cost in costs.items()}
    assert total["user"] - total["policy"] == 4 * n * k


def test_grouped_layers_keep_their_masters():
    """An FP8 `GroupedLinear`'s experts: the cast keeps the float32 master (a stacked one
    too) and the layer computes in BF16; its value is that of the same layer given the
    master with `compute_dtype` set, and a high-precision one is cast as before."""
    experts = fp8jax.GroupedLinear(4, 128, 128, key=jax.random.key(0))
    fp8 = eqx.tree_at(lambda m: m.ragged_dot, experts, fp8jax.Fp8RaggedDot(num_experts=4))
    cast = POLICY.cast_to_compute({"fp8": fp8, "plain": experts})
    assert cast["fp8"].weight is fp8.weight and cast["fp8"].compute_dtype == BF16
    assert cast["plain"].weight.dtype == BF16 and cast["plain"].compute_dtype is None
    x, sizes = jnp.ones((64, 128), BF16), jnp.array([16, 0, 40, 8])
    y = cast["fp8"](x, sizes)
    assert y.dtype == BF16 and cast["plain"](x, sizes).dtype == BF16
    given = fp8jax.GroupedLinear(
        4, 128, 128, weight=fp8.weight, ragged_dot=fp8.ragged_dot, compute_dtype="bf16"
    )
    np.testing.assert_array_equal(np.asarray(given(x, sizes), F32), np.asarray(y, F32))
    # The master's gradient: float32, BF16 values (written in the compute dtype).
    x = jax.random.normal(jax.random.key(2), (64, 128), BF16)
    c = jax.random.normal(jax.random.key(3), (64, 128))
    loss = lambda m, x: jnp.sum(POLICY.cast_to_compute(m)(x, sizes).astype(F32) * c)  # noqa: E731
    d_w = fp8jax.filter_grad(loss)(fp8, x).weight
    assert d_w.dtype == F32 and np.any(np.asarray(d_w) != 0)
    np.testing.assert_array_equal(np.asarray(d_w), np.asarray(d_w.astype(BF16).astype(F32)))
    stack = eqx.filter_vmap(lambda k: fp8jax.GroupedLinear(4, 128, 128, key=k))(
        jax.random.split(jax.random.key(1), 2)
    )
    stack = fp8jax.fp8_linear_layers(stack, fp8jax.Fp8Config())
    stacked = POLICY.cast_to_compute(stack)
    assert stacked.weight is stack.weight and stacked.weight.shape == (2, 4, 128, 128)
    assert stacked.compute_dtype == BF16
    with pytest.raises(TypeError, match="give key .* or weight .*, not neither"):
        fp8jax.GroupedLinear(4, 128, 128)
    with pytest.raises(TypeError, match="not both"):
        fp8jax.GroupedLinear(4, 128, 128, key=jax.random.key(0), weight=fp8.weight)
    with pytest.raises(ValueError, match=r"weight of shape \(4, 128, 64\): should be"):
        fp8jax.GroupedLinear(4, 128, 128, weight=jnp.ones((4, 128, 64)))

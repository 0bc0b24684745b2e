"""fp8jax's native block-scaled FP8 GEMM (Pallas Mosaic GPU): numerics in Mosaic GPU's
interpreter against float32 references and the XLA path, the recipe's choice of path, and the
deviceless H100 compile (FP8 `wgmma` in the PTX, no register spills, every GEMM counted FP8).
"""

import dataclasses
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import run_with_mosaic_dump

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import dispatch, reference
from fp8jax._src.kernels.block_gemm import block_scaled_gemm, expand_rows
from fp8jax._src.recipes.block_dot import block_dot, native_block_dot

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
#: E5M2 times E4M3 in one wgmma: JAX 0.11 on (`mosaic_private.mixed_fp8_wgmma`); refused on 0.10.
MIXED = pytest.mark.skipif(
    not mosaic_private.mixed_fp8_wgmma(), reason="this JAX's wgmma takes one FP8 type"
)
ONE_TYPE = pytest.mark.skipif(
    mosaic_private.mixed_fp8_wgmma(), reason="this JAX's wgmma takes E5M2 with E4M3"
)


def fp8_operand(rng, rows, k, dtype=E4M3, block_k=128):
    """FP8 data (rows, k) and one power-of-two scale per row and chunk."""
    data = rng.standard_normal((rows, k)) * 4
    chunks = -(-k // block_k)
    scale = 2.0 ** rng.integers(-4, 4, (rows, chunks))
    return jnp.asarray(data, dtype), jnp.asarray(scale, jnp.float32)


@pytest.mark.parametrize(
    "m, n, k, n_terms, formats",
    [
        (64, 128, 256, 1, (E4M3, E4M3)),  # one tile, two chunks
        (70, 130, 300, 1, (E5M2, E5M2)),  # odd shapes: padding inside; a gradient's format
        (33, 140, 128, 2, (E4M3, E4M3)),  # the residual form: two weights share each A tile
        (65, 20, 200, 3, (E4M3, E4M3)),
        pytest.param(70, 130, 300, 1, (E5M2, E4M3), marks=MIXED),  # a gradient times a weight
    ],
)
def test_kernel_matches_float64_reference_in_the_interpreter(m, n, k, n_terms, formats):
    """Each chunk's FP8 product is exact in float32 and scaled by powers of two: the kernel
    differs from the float64 reference only by float32 summation."""
    rng = np.random.default_rng(m + n + k)
    lhs, lhs_scale = fp8_operand(rng, m, k, formats[0])
    terms = [fp8_operand(rng, n, k, formats[1]) for _ in range(n_terms)]
    out = jax.jit(lambda *a: block_scaled_gemm(a[0], a[1], a[2], interpret=True))(
        lhs, lhs_scale, terms
    )
    want = reference.block_scaled(lhs, lhs_scale, terms)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    magnitude = reference.block_scaled_magnitude(lhs, lhs_scale, terms)
    np.testing.assert_array_less(
        np.abs(np.asarray(out, np.float64) - want), reference.BLOCK_RTOL * magnitude + 1e-30
    )


def test_kernel_writes_bf16_rounded_from_float32():
    rng = np.random.default_rng(1)
    lhs, lhs_scale = fp8_operand(rng, 64, 128)
    rhs, rhs_scale = fp8_operand(rng, 128, 128)
    gemm = jax.jit(
        lambda out_dtype: block_scaled_gemm(
            lhs, lhs_scale, [(rhs, rhs_scale)], out_dtype=out_dtype, interpret=True
        ),
        static_argnums=0,
    )
    f32, bf16 = gemm(jnp.float32), gemm(jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32).astype(ml_dtypes.bfloat16))


def test_expand_rows_repeats_block_scales_per_row():
    scale = jnp.arange(6.0).reshape(3, 2)  # 3 blocks of 128 rows, 2 chunks
    rows = expand_rows(scale, 300, 128)
    assert rows.shape == (300, 2)
    picks = np.array([0, 127, 128, 255, 256, 299])
    np.testing.assert_array_equal(rows[picks], scale[picks // 128])
    batched = expand_rows(jnp.stack([scale, 2 * scale]), 130, 128)
    assert batched.shape == (2, 130, 2) and float(batched[1, 129, 1]) == 2 * float(scale[1, 1])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(lhs=jnp.zeros((64, 128), jnp.bfloat16)), "FP8 wgmma takes"),
        (dict(lhs_scale=jnp.ones((64, 2))), "one scale per row and 128-chunk"),
        (dict(rhs=jnp.zeros((128, 256), E4M3)), "contracted over their last axis"),
        (dict(terms=[]), "at least one"),
        pytest.param(dict(lhs=jnp.zeros((64, 128), E5M2)), "one FP8 type", marks=ONE_TYPE),
    ],
)
def test_kernel_rejects_bad_operands(bad, match):
    args = dict(
        lhs=jnp.zeros((64, 128), E4M3),
        lhs_scale=jnp.ones((64, 1)),
        rhs=jnp.zeros((128, 128), E4M3),
    )
    args.update(bad)
    terms = bad.get("terms", [(args["rhs"], jnp.ones((args["rhs"].shape[0], 1)))])
    with pytest.raises(ValueError, match=match):
        block_scaled_gemm(args["lhs"], args["lhs_scale"], terms, interpret=True)


# --- the recipe's three GEMMs -------------------------------------------------------------


def _quantized(recipe, x, role, axis):
    state = recipe.init_state(role)
    return recipe.quantize(x, state, role, axis)[0]


@pytest.mark.parametrize("block_size", [128, 64])
def test_native_block_dot_matches_the_xla_path_in_every_layout(block_size):
    """Forward (tiles x blocks over K), dgrad (the kernel retiled for its other contraction)
    and wgrad (both operands in 128 x 1 tiles over the tokens): the same FP8 products and
    scales as `block_dot`, float32 summation order aside."""
    recipe = fp8jax.BlockwiseScaling(block_size=block_size, native_kernel=False)
    rng = np.random.default_rng(block_size)
    m, k, n = 70, 200, 150
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((m, n)) * 1e-3, jnp.float32)
    q_x, q_w, q_g = (
        _quantized(recipe, x, "input", -1),
        _quantized(recipe, w, "kernel", -1),
        _quantized(recipe, g, "output_grad", -1),
    )
    cases = {
        "fwd": (q_x, q_w, -1, -1),
        "dgrad": (q_g, recipe.retile(q_w, "kernel", -2, source=w), -1, -2),
        "wgrad": (
            recipe.retile(q_g, "output_grad", -2, source=g),
            recipe.retile(q_x, "input", -2),
            -2,
            -2,
        ),
    }
    for name, (lhs, rhs, la, ra) in cases.items():
        with dispatch.interpreted():
            native = jax.jit(lambda a, b, la=la, ra=ra: native_block_dot(a, b, la, ra))(lhs, rhs)
        xla = block_dot(lhs, rhs, la, ra, jax.lax.Precision.HIGHEST)
        magnitude = block_dot(
            jax.tree.map(jnp.abs, lhs), jax.tree.map(jnp.abs, rhs), la, ra, "highest"
        )
        assert native.shape == xla.shape, name
        np.testing.assert_array_less(np.abs(native - xla), 2e-6 * magnitude + 1e-30, err_msg=name)


def _linear_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


def _run(native, x, linear, block_size=128):
    recipe = fp8jax.BlockwiseScaling(block_size=block_size, native_kernel=native)
    model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
    with dispatch.interpreted():
        return jax.jit(fp8jax.filter_value_and_grad(_linear_loss))(model, x)


def test_blockwise_linear_trains_the_same_with_the_native_kernel(getkey):
    """A Linear with odd sizes, forward and backward: loss, weight and bias gradients and the
    FP8 state from the native kernels (interpreted) against the XLA path."""
    linear = eqx.nn.Linear(200, 150, key=getkey())
    x = jax.random.normal(getkey(), (70, 200))
    (loss_n, grads_n), (loss_x, grads_x) = _run(None, x, linear), _run(False, x, linear)
    np.testing.assert_allclose(loss_n, loss_x, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_n), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.BlockwiseScaling(native_kernel=True), fp8jax.ResidualFP8(native_kernel=True)],
    ids=["blockwise", "residual"],
)
def test_native_kernels_take_an_empty_batch(getkey, recipe):
    """A batch of no rows on the native kernels (interpreted): the loss and every gradient are
    the empty sums a float64 product gives (zeros). The kernels' grids had no tile, and
    the interpreter raised `ZeroDivisionError`."""
    linear = eqx.nn.Linear(128, 256, key=getkey())
    x = jnp.zeros((0, 128))
    model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
    with dispatch.interpreted():
        loss, grads = jax.jit(fp8jax.filter_value_and_grad(_linear_loss))(model, x)
    x64, w64 = np.asarray(x, np.float64), np.asarray(linear.weight, np.float64)
    y64 = x64 @ w64.T + np.asarray(linear.bias, np.float64)
    g64 = 2 * y64  # d(sum y**2)/dy
    assert float(loss) == float(np.sum(y64**2))
    np.testing.assert_array_equal(grads.weight, g64.T @ x64)
    np.testing.assert_array_equal(grads.bias, g64.sum(axis=0))


def test_choose_takes_the_xla_path_for_an_empty_operand():
    """An operand of no rows, or a call inside `empty_batch` (a `vmap` of no members), takes
    the XLA path even with `True`: no kernel grid is empty."""

    def native(a, out_dtype):
        raise AssertionError("the kernel ran on an empty operand")

    def xla(a):
        return a @ a.T

    empty = jnp.zeros((0, 128))
    assert dispatch.choose(True, native, xla, empty).shape == (0, 0)
    with dispatch.empty_batch():
        assert dispatch.choose(True, native, xla, jnp.ones((2, 3))).shape == (2, 2)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # every GEMM fused
        # Fused forward; the E5M2 x E4M3 backward fused from JAX 0.11 on, cuBLASLt on 0.10.
        dict(backward_format="e5m2"),
        dict(split_activation=True),
        dict(dgrad_uses_lo=False),
    ],
)
def test_residual_linear_trains_the_same_with_the_fused_kernel(getkey, options):
    """ResidualFP8 with its terms fused per left operand (interpreted) against the XLA path's
    separate GEMMs: the same products, float32 summation order aside."""
    linear = eqx.nn.Linear(200, 150, key=getkey())
    x = jax.random.normal(getkey(), (70, 200))

    def run(native):
        recipe = fp8jax.ResidualFP8(native_kernel=native, **options)
        model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
        with dispatch.interpreted():
            return jax.jit(fp8jax.filter_value_and_grad(_linear_loss))(model, x)

    (loss_n, grads_n), (loss_x, grads_x) = run(True), run(False)
    np.testing.assert_allclose(loss_n, loss_x, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_n), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(jnp.max(jnp.abs(b))))


def test_native_kernel_folds_a_vmapped_weight_into_a_batch(getkey):
    """Mapped weights (an ensemble) become a batched canonical GEMM: the kernel is vmapped."""
    linears = eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 128, key=k))(
        jax.random.split(getkey(), 2)
    )
    x = jax.random.normal(getkey(), (2, 64, 64))

    def run(native):
        recipe = fp8jax.BlockwiseScaling(native_kernel=native)

        def loss(model, x):
            return jnp.sum(eqx.filter_vmap(lambda m, xs: jax.vmap(m)(xs))(model, x) ** 2)

        model = eqx.filter_vmap(
            lambda lin: fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(recipe=recipe))
        )(linears)
        with dispatch.interpreted():
            return jax.jit(fp8jax.filter_value_and_grad(loss))(model, x)

    (loss_n, grads_n), (loss_x, grads_x) = run(True), run(False)
    np.testing.assert_allclose(loss_n, loss_x, rtol=1e-6)
    np.testing.assert_allclose(grads_n.weight, grads_x.weight, rtol=2e-5, atol=1e-6)


# --- which path runs --------------------------------------------------------------------------


def test_cpu_compiles_keep_the_xla_path(getkey):
    """Outside the interpreter, the default choice compiles no Mosaic kernel on a CPU, and
    computes exactly what the forced XLA path does."""
    linear = eqx.nn.Linear(128, 128, key=getkey())
    x = jax.random.normal(getkey(), (64, 128))
    texts, losses = [], []
    for native in (None, False):
        recipe = fp8jax.BlockwiseScaling(native_kernel=native)
        model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
        step = jax.jit(fp8jax.filter_value_and_grad(_linear_loss))
        texts.append(step.lower(model, x).compile().as_text())
        losses.append(step(model, x)[0])
    assert not any("mosaic" in text for text in texts)
    assert float(losses[0]) == float(losses[1])
    assert not dispatch.local_gpus_lack_hopper()  # no GPU here


@pytest.mark.parametrize(
    "recipe",
    [fp8jax.BlockwiseScaling(native_kernel=True), fp8jax.ResidualFP8(native_kernel=True)],
    ids=["blockwise", "residual"],
)
def test_a_forced_kernel_compiled_for_a_cpu_is_refused_naming_the_option(getkey, recipe):
    """`native_kernel=True` compiled for a CPU (outside the interpreter): a `ValueError` that
    names the option, the platform and what is accepted, jitted or not. Pallas raised "Only
    interpret mode is supported on CPU backend" from inside a quantization kernel."""
    linear = eqx.nn.Linear(128, 128, key=getkey())
    x = jax.random.normal(getkey(), (64, 128))
    model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
    match = "native_kernel=True: .* compiled for cpu. Use native_kernel=None"
    with pytest.raises(ValueError, match=match):
        jax.jit(fp8jax.filter_value_and_grad(_linear_loss))(model, x)
    with pytest.raises(ValueError, match=match):
        model(x[0])


def test_float64_blockwise_linear_runs_the_kernels_float32_output_widened(getkey):
    """A float64 model (`jax_enable_x64` on): the default choice on a CPU computes what the
    forced XLA path does, and the kernel (interpreted), which writes at most 32-bit outputs,
    its float32 result widened, close to the XLA path. The kernel's float64 output buffer
    took a float32 value (x64 is off inside it) and every float64 blockwise GEMM raised."""
    with jax.enable_x64(True):
        linear = eqx.nn.Linear(128, 128, key=getkey(), dtype=jnp.float64)
        x = jax.random.normal(getkey(), (64, 128), jnp.float64)
        runs = {}
        for native in (None, False, True):
            recipe = fp8jax.BlockwiseScaling(native_kernel=native)
            model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
            step = jax.jit(fp8jax.filter_value_and_grad(_linear_loss))
            if native:
                with dispatch.interpreted():
                    runs[native] = step(model, x)
            else:
                runs[native] = step(model, x)
        (loss_x, grads_x) = runs[False]
        assert loss_x.dtype == grads_x.weight.dtype == jnp.float64
        for native in (None, True):
            loss, grads = runs[native]
            assert loss.dtype == grads.weight.dtype == jnp.float64
            if native is None:
                assert float(loss) == float(loss_x)
                np.testing.assert_array_equal(grads.weight, grads_x.weight)
            else:
                np.testing.assert_allclose(loss, loss_x, rtol=1e-6)
                np.testing.assert_allclose(
                    grads.weight,
                    grads_x.weight,
                    rtol=2e-5,
                    atol=2e-6 * float(jnp.max(jnp.abs(grads_x.weight))),
                )


def test_choose_follows_the_option():
    calls = []

    def native(a, out_dtype):
        calls.append("native")
        return (a + 1).astype(out_dtype)

    def xla(a):
        calls.append("xla")
        return a + 2

    one = jnp.ones(())
    assert float(dispatch.choose(False, native, xla, one)) == 3 and calls == ["xla"]
    calls.clear()
    with dispatch.interpreted():
        assert float(dispatch.choose(True, native, xla, one)) == 2 and calls == ["native"]
    calls.clear()
    # Forced, compiled for CUDA only: a CPU's compile or eager run is refused.
    with pytest.raises(ValueError, match="native_kernel=True: .* compiled for cpu"):
        dispatch.choose(True, native, xla, one)
    with pytest.raises(ValueError, match="native_kernel=True: .* compiled for cpu"):
        jax.jit(lambda a: dispatch.choose(True, native, xla, a))(one)
    calls.clear()
    with dispatch.interpreted():
        assert dispatch.interpreting()
        dispatch.choose(None, native, xla, one)
    assert calls == ["native"] and not dispatch.interpreting()
    calls.clear()
    # Default: both traced (lax.platform_dependent), the CPU runs the XLA branch.
    assert float(jax.jit(lambda a: dispatch.choose(None, native, xla, a))(one)) == 3
    assert sorted(calls) == ["native", "xla"]


def _traced_branches():
    """`(calls, native, xla)`: a kernel and an XLA branch for `dispatch.choose` that note in
    `calls` each trace of theirs; new functions each time, as lax caches a branch's trace by
    its function."""
    calls = []

    def native(a, out_dtype):
        calls.append("native")
        return a.astype(out_dtype)

    def xla(a):
        calls.append("xla")
        return a

    return calls, native, xla


def test_native_kernels_by_default_only_where_every_local_gpu_is_a_hopper(monkeypatch):
    """`native_kernel=None`: the kernels where every local GPU is a Hopper (compute
    capability 9.0, or 9.0a), none where one is not (an A100, a Blackwell); a machine with no
    GPU leaves the choice to the compile's platform (`lax.platform_dependent`)."""
    import types

    def devices(*capabilities):
        gpus = [types.SimpleNamespace(platform="gpu", compute_capability=c) for c in capabilities]
        return [types.SimpleNamespace(platform="cpu"), *gpus]

    for capabilities, lacks in [
        ((), False),
        (("9.0",), False),
        (("9.0a", "9.0"), False),
        (("8.0",), True),
        (("9.0", "8.9"), True),
        (("10.0",), True),
    ]:
        monkeypatch.setattr(jax, "local_devices", lambda c=capabilities: devices(*c))
        assert dispatch.local_gpus_lack_hopper() == lacks, capabilities
        calls, native, xla = _traced_branches()
        jax.jit(lambda a, n=native, x=xla: dispatch.choose(None, n, x, a))(jnp.ones(()))
        assert sorted(calls) == (["xla"] if lacks else ["native", "xla"]), capabilities


def test_a_gemm_partitioned_by_xla_is_told_apart():
    """Operands on a mesh axis that XLA partitions (plain `jit`, sharded arrays): an opaque
    kernel would make XLA gather them, so `choose` runs it per shard there
    (`tests/test_scaling_out.py`), or takes the XLA path for a GEMM without a partitioning
    rule. One device's data (no mesh, or inside `shard_map`) takes the kernel as it is."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P("data")))
    seen = {}

    def probe(name):
        def f(a):
            seen[name] = dispatch.per_device_gemm(a)
            return a

        return f

    jax.jit(probe("sharded"))(x)
    jax.jit(probe("one device"))(jnp.ones((64, 128)))
    jax.jit(jax.shard_map(probe("shard_map"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        x
    )
    # A mesh whose axes are each of one device: nothing for XLA to partition.
    single = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    jax.jit(probe("mesh of one"))(jax.device_put(jnp.ones((64, 128)), NamedSharding(single, P())))
    assert seen == {"sharded": False, "one device": True, "shard_map": True, "mesh of one": True}
    # `choose` without a partitioning rule (`dims`): the XLA path on a partitioned mesh (the
    # kernel never traced), the kernel's CUDA branch beside it on one device's shards.
    for name, on_mesh in [("sharded", True), ("shard_map", False)]:
        calls, native, xla = _traced_branches()

        def gemm(a, n=native, x=xla):
            return dispatch.choose(None, n, x, a)

        if on_mesh:
            jax.jit(gemm)(x)
        else:
            jax.jit(jax.shard_map(gemm, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
        assert sorted(calls) == (["xla"] if on_mesh else ["native", "xla"]), name
    # Forced, the kernel there too (refused, compiled for a CPU).
    with pytest.raises(ValueError, match="native_kernel=True: .* compiled for cpu"):
        jax.jit(lambda a: dispatch.choose(True, lambda a, out_dtype: a, lambda a: a, a))(x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(native_kernel="yes"), "native_kernel='yes'"),
        (dict(native_kernel=True, dequantized_dot=True), "choose one"),
        (dict(native_kernel=True, block_size=32), "block sizes \\[64, 128\\]"),
    ],
)
def test_bad_native_kernel_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.BlockwiseScaling(**kwargs)


def test_residual_native_kernel_option_is_checked_and_the_xla_path_by_default():
    # Two cuBLASLt calls by default (faster than the fused kernel on an H200); E4M3 gradients
    # by default: Mosaic GPU's wgmma takes one FP8 type, so only then is every GEMM of the
    # recipe fused where `native_kernel=None` chooses the kernel.
    recipe = fp8jax.ResidualFP8()
    assert recipe.native_kernel is False and recipe.backward_format == "e4m3"
    with pytest.raises(ValueError, match="native_kernel='auto'"):
        fp8jax.ResidualFP8(native_kernel="auto")


# --- the H100 compile ------------------------------------------------------------------------

H100_SCRIPT = """
import glob, json, os, re, sys
import equinox as eqx, jax, jax.numpy as jnp
import fp8jax

key = jax.random.PRNGKey(0)
k1, k2 = jax.random.split(key)
mlp = eqx.nn.Sequential([eqx.nn.Linear(256, 512, key=k1), eqx.nn.Lambda(jax.nn.gelu),
                         eqx.nn.Linear(512, 200, key=k2)])
recipe = getattr(fp8jax, sys.argv[1])(native_kernel=None)  # the choice made on Hopper
model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
x = jax.ShapeDtypeStruct((300, 256), jnp.bfloat16)

def step(model, x):
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)
    return fp8jax.filter_value_and_grad(loss)(model, x)

report = fp8jax.inspect(step, model, x, modes=("cublas",))
dump = os.environ["MOSAIC_GPU_DUMP_TO"]
ptxas = [open(f).read() for f in glob.glob(os.path.join(dump, "*.ptxas"))]
spill = re.compile(r"(\\d+) bytes spill (?:stores|loads)")
spills = [[int(n) for n in spill.findall(log)] for log in ptxas]
print(json.dumps({
    "gemms": [(g.layer, g.role, g.kernel, g.fp8, g.mma) for g in report.gemms["cublas"]],
    "spills": spills,
    "serialized": sum(log.count("C7514") for log in ptxas),
}))
"""


@pytest.mark.parametrize("recipe", ["BlockwiseScaling", "ResidualFP8"])
def test_deviceless_h100_train_step_runs_every_gemm_in_the_native_kernel(tmp_path, recipe):
    """The default choice in a compile for an H100: the forward, dgrad and wgrad of both
    Linears are Mosaic GPU kernels whose PTX multiplies FP8 with `wgmma` (E4M3 for both
    recipes' defaults), the inspector counts them as FP8 GEMMs, and ptxas spills no
    register nor serializes a `wgmma` (its warning C7514)."""
    pytest.importorskip("jax_cuda12_plugin")
    run = run_with_mosaic_dump(H100_SCRIPT, [recipe], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    gemms = seen["gemms"]
    # The first layer's dgrad is not computed: its input needs no gradient.
    want = {("0", "fwd"), ("0", "wgrad"), ("2", "fwd"), ("2", "dgrad"), ("2", "wgrad")}
    assert {(layer.split(".")[-1], role) for layer, role, *_ in gemms} == want, gemms
    for layer, role, kernel, fp8, mma in gemms:
        assert fp8, (layer, role, kernel, mma)
        assert kernel == "pallas mosaic gpu", (layer, role, kernel, mma)
        fp8_mma = re.compile(r"wgmma\.mma_async\..*\.(e4m3|e5m2)\.(e4m3|e5m2)$")
        assert any(fp8_mma.match(m) for m in mma), mma
    assert seen["spills"] and all(s and not any(s) for s in seen["spills"]), seen["spills"]
    assert seen["serialized"] == 0, seen


@pytest.mark.parametrize(
    "recipe",
    [
        fp8jax.BlockwiseScaling(),
        fp8jax.ResidualFP8(native_kernel=None),  # every GEMM native (E4M3 gradients)
    ],
    ids=["blockwise", "residual"],
)
def test_native_kernels_transpose_fp8_values_not_bf16_activations(getkey, recipe):
    """The kernels take both operands K-major, so the wgrad's operands are transposed. That
    transpose must be of the FP8 values: left to itself, XLA's layout assignment moves it up
    through the quantization into the BF16 producers (bias, GELU and its backward), which then
    compute transposed and leave BF16 copies in both layouts (on benchmarks/peers.py's MLP,
    44 MiB of H100 temp memory for blockwise instead of 39). Compiled for an H100, no BF16
    array of the MLP's hidden activation may be held transposed."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless
    from fp8jax.examples.gpt import MLP

    topology = deviceless.h100_topology()
    tokens, width = 512, 256
    mlp = fp8jax.fp8_linear_layers(
        MLP(width, 4, False, key=getkey()), fp8jax.Fp8Config(recipe=recipe)
    )
    x = jax.ShapeDtypeStruct((tokens, width), jnp.float32)

    def step(model, x):
        # The input made in BF16 here, as by a layer in front: a producer XLA could transpose.
        loss = lambda m, x: jnp.mean(m(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)  # noqa: E731
        return fp8jax.filter_grad(loss)(model, x)

    lowered, _ = deviceless.lower(step, (mlp, x), {}, topology.devices[0])
    entry = lowered.compile().as_text().split("\nENTRY")[1]
    assert "mosaic_gpu" in entry  # the kernels run here
    held = set()
    for features in (width, 4 * width):  # the input, the hidden activation
        pattern = rf"bf16\[{features},{tokens}\]|bf16\[{tokens},{features}\]\{{0,1\}}"
        held |= set(re.findall(pattern, entry))
    assert not held, sorted(held)


def test_residual_fused_kernel_takes_about_delayed_scalings_h100_temp_memory(getkey):
    """Issue 14's memory target on benchmarks/peers.py's MLP step (1024 -> 4096 -> 1024, 2,048
    tokens, float32 masters cast to BF16 in the loss, an SGD update), compiled for an H100 in
    cuBLAS mode: the residual recipe's fused kernel (`native_kernel=None`, E4M3 gradients)
    takes at most 1.1x delayed scaling's temp memory. Its XLA path, the default since the
    kernel measured slower on an H200, sums two cuBLASLt products in a float32 buffer and
    takes more (1.72x when measured): the price of the default, documented."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless
    from fp8jax.examples.gpt import MLP

    device = deviceless.h100_topology().devices[0]
    policy = fp8jax.Policy.from_string("params=float32,compute=bfloat16,output=float32")
    base = MLP(1024, 4, False, key=getkey())
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.float32)

    def step(model, x):
        def loss(m, x):
            out = policy.cast_to_compute(m)(x.astype(jnp.bfloat16))
            return jnp.mean(out.astype(jnp.float32) ** 2)

        overwrites, grads = fp8jax.partition_for_grad_overwrite(fp8jax.filter_grad(loss)(model, x))
        return fp8jax.apply_updates(model, jax.tree.map(lambda g: -1e-3 * g, grads), overwrites)

    def temp(recipe):
        model = fp8jax.fp8_linear_layers(base, fp8jax.Fp8Config(recipe=recipe))
        lowered, _ = deviceless.lower(step, (model, x), {}, device)
        compiled = lowered.compile(compiler_options=fp8jax.gpu_compiler_options())
        return compiled.memory_analysis().temp_size_in_bytes

    delayed = temp(fp8jax.DelayedScaling())
    assert temp(fp8jax.ResidualFP8(native_kernel=None)) <= 1.1 * delayed
    assert temp(fp8jax.ResidualFP8()) > 1.1 * delayed
    assert temp(fp8jax.ResidualFP8(backward_format="e5m2")) > 1.1 * delayed


@pytest.mark.parametrize(
    "recipe",
    [
        fp8jax.BlockwiseScaling(format_name="e4m3fnuz"),
        fp8jax.ResidualFP8(
            forward_format="e4m3fnuz", backward_format="e5m2fnuz", native_kernel=None
        ),
    ],
    ids=["blockwise", "residual"],
)
def test_fnuz_formats_compiled_for_an_h100_take_the_xla_path(getkey, recipe):
    """AMD's fnuz formats with `native_kernel=None`, compiled for an H100: the kernel was
    chosen and raised "block_scaled_gemm: lhs is float8_e4m3fnuz; FP8 wgmma takes
    float8_e4m3fn or float8_e5m2". `None` means the kernel where it runs and the XLA path
    elsewhere: such a step now compiles, with no Mosaic kernel, as with `native_kernel=False`;
    `native_kernel=True` with them is refused when the recipe is made, naming the format."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless

    linear = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(128, 128, key=getkey()), fp8jax.Fp8Config(recipe=recipe)
    )
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    step = fp8jax.filter_value_and_grad(_linear_loss)
    lowered, _ = deviceless.lower(step, (linear, x), {}, deviceless.h100_topology().devices[0])
    assert "mosaic" not in lowered.compile().as_text()
    with pytest.raises(ValueError, match=r"native_kernel=True.*fnuz.*'e4m3'"):
        dataclasses.replace(recipe, native_kernel=True)


@pytest.mark.parametrize(
    "recipe",
    [
        fp8jax.BlockwiseScaling(format_name="e4m3fnuz"),
        fp8jax.CurrentScaling(forward_format="e4m3fnuz", backward_format="e5m2fnuz"),
    ],
    ids=["blockwise", "current"],
)
def test_fnuz_expert_gemms_compiled_for_an_h100_take_the_xla_path(recipe):
    """The grouped (expert) GEMMs of a recipe in AMD's fnuz formats, compiled for an H100:
    the grouped kernels were chosen and raised "grouped_rows_gemm: lhs is float8_e4m3fnuz;
    wgmma takes float8_e4m3fn, float8_e5m2, ...". They now take XLA's path (no Mosaic
    kernel), and a layer forcing the kernels is refused naming the formats it takes."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless

    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=4)

    def step(x, w, sizes):
        loss = lambda x, w: dot(x, w, sizes).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, (0, 1))(x, w)

    args = (
        jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 128, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    lowered, _ = deviceless.lower(step, args, {}, deviceless.h100_topology().devices[0])
    assert "mosaic" not in lowered.compile().as_text()
    with pytest.raises(ValueError, match=r"native_kernel=True.*not AMD's fnuz formats"):
        fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=True)

"""Per-tensor FP8 quantization in one pass (`kernels.cast_transpose`, Pallas Triton): bit for
bit with the recipes' saturating cast and a NumPy reference in Pallas' interpreter, its
amax per tile, bad input refused by name, and one Triton kernel in an H100 compile."""

import contextlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax._src.core.formats import saturate
from fp8jax._src.kernels import CAST_TRANSPOSE_NAME, dispatch
from fp8jax._src.kernels.block_quantize import ColumnTuning
from fp8jax._src.kernels.cast_transpose import cast_transpose
from fp8jax._src.observe import deviceless
from fp8jax._src.recipes.per_tensor import skip_warm_start
from fp8jax._src.recipes.per_tensor_pass import (
    cast_transpose_chosen,
    cast_transpose_kernel,
    fits,
)

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def operand(rng, shape):
    """BF16 rows over many binades, a zero tile, values past the formats' max, inf and NaN."""
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal((shape[0], 1)) * 3)
    x[: shape[0] // 2, -(shape[1] // 3) :] = 0.0
    x[1, 2], x[-1, 0], x[shape[0] // 2, 129] = 1e30, np.inf, np.nan
    return jnp.asarray(x, jnp.bfloat16)


def np_cast(x, scale, fmt):
    """The saturating cast in NumPy: float32 product, clipped at the format's max, rounded to
    nearest even by ml_dtypes; inf and NaN become NaN."""
    x = np.asarray(x, np.float32)
    limit = np.float32(ml_dtypes.finfo(fmt).max)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.clip(x * np.float32(scale), -limit, limit)
    return np.where(np.isfinite(x), scaled, np.nan).astype(fmt)


def same(got, want):
    got, want = np.asarray(got).astype(np.float32), np.asarray(want).astype(np.float32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN where the other has NaN


@pytest.mark.parametrize("fmt, scale", [(E4M3, 0.37), (E5M2, 3.1e3)])
@pytest.mark.parametrize(
    "tuning",
    [
        ColumnTuning(num_warps=4),
        ColumnTuning(transpose_first=True),
        ColumnTuning(wide_transpose=True),
        ColumnTuning(num_warps=4, slab_rows=32),
        ColumnTuning(slab_rows=16, transpose_first=True),
    ],
)
def test_kernel_casts_as_the_recipes_and_numpy_bit_for_bit(fmt, scale, tuning):
    """The data and its transposed copy equal `formats.saturate` (the recipes' cast) and a
    NumPy cast element for element; each tile's amax is its `max |x|` (NaN with a NaN)."""
    rng = np.random.default_rng(7)
    x = operand(rng, (256, 384))
    data, data_t, amax = cast_transpose(x, jnp.float32(scale), fmt, interpret=True, tuning=tuning)
    assert data.dtype == data_t.dtype == fmt and amax.shape == (2, 3)
    same(data, saturate(x, jnp.float32(scale), fmt))
    same(data, np_cast(x, scale, fmt))
    same(data_t, np_cast(x, scale, fmt).T)
    tiles = np.abs(np.asarray(x, np.float32)).reshape(2, 128, 3, 128).transpose(0, 2, 1, 3)
    same(amax, tiles.reshape(2, 3, -1).max(-1))
    assert np.isnan(amax[1, 1]) and np.isinf(amax[1, 0])


def test_kernel_refuses_what_it_cannot_cast():
    x = jnp.ones((256, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"shape \(200, 384\) is not made of whole 128"):
        cast_transpose(x[:200], jnp.float32(1), E4M3, interpret=True)
    with pytest.raises(ValueError, match=r"scale has shape \(2,\)"):
        cast_transpose(x, jnp.ones((2,)), E4M3, interpret=True)
    with pytest.raises(ValueError, match="num_warps a power of two"):
        cast_transpose(x, jnp.float32(1), E4M3, interpret=True, tuning=ColumnTuning(num_warps=6))


def test_h100_compile_runs_one_triton_kernel_counted_as_quantization():
    """For an H100 (deviceless): one Triton kernel by its name, which `fp8jax.hlo_cost`
    files under quantization."""
    if deviceless.h100_topology() is None:
        pytest.skip("no deviceless H100 compile on this machine")
    spec = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)

    def cast(x):
        return cast_transpose(x, jnp.float32(2.0), E4M3, interpret=False)

    lowered, _ = deviceless.lower(cast, (spec,), {}, deviceless.h100_topology().devices[0])
    hlo = lowered.compile(fp8jax.gpu_compiler_options()).as_text()
    calls = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 and re.search(f"{CAST_TRANSPOSE_NAME}/pallas_call", calls[0])
    # Read 2 bytes and write 2 an element (amax tiles and the scale aside): quantization.
    cost = fp8jax.hlo_cost(hlo)
    assert set(cost.bytes) == {"quantize"} and cost.bytes["quantize"] >= 256 * 384 * 4


def _step():
    """A fresh value-and-grad of an FP8 `dot_general`."""

    def loss(args):
        layer, x, w = args
        return jnp.sum(jnp.sin(layer(x, w, (((x.ndim - 1,), (0,)), ((), ()))).astype(jnp.float32)))

    return fp8jax.filter_value_and_grad(loss)


def _kernel_calls(jaxpr) -> int:
    return str(jaxpr).count(f"name={CAST_TRANSPOSE_NAME}")


#: Per-tensor recipes, by how the scale of a step is chosen: known before the step (delayed
#: scaling without its warm start, or in the train step's steady state), or from this step's
#: amax (the warm start of a fresh state, current scaling).
CASES = {
    "cold": (fp8jax.DelayedScaling(warm_start=False), False),
    "steady state": (fp8jax.DelayedScaling(), True),
    "warm start": (fp8jax.DelayedScaling(), False),
    "current": (fp8jax.CurrentScaling(), False),
}


@pytest.mark.parametrize(
    "roles, calls", [(("input", "kernel", "output_grad"), 3), (("output_grad",), 1)]
)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_tensor_recipes_quantize_in_one_pass_as_their_xla_path(roles, calls, case, dtype):
    """Inside `cast_transpose_kernel(roles)` per-tensor recipes quantize those operands with
    the kernel (both copies, and the amax where the scale need not wait for it), in the
    interpreter as on a Hopper GPU: one call per operand, and the step's value, gradients
    and new states (amax histories, scales) equal XLA's path bit for bit, a tile with an
    inf and values past E4M3's max among the input's."""
    recipe, steady = CASES[case]
    rng = np.random.default_rng(5)
    x = np.asarray(operand(rng, (256, 384)), np.float32)
    x[-1, 0], x[128, 129] = 1e4, 3.0  # the inf and NaN out: a loss must stay finite
    x = jnp.asarray(x, dtype)
    w = jnp.asarray(rng.standard_normal((384, 128)) * 0.05, dtype)
    layer = fp8jax.Fp8DotGeneral(recipe)
    if case != "warm start":  # a fresh state's scale is 0 there: scaled by this step's amax
        # A step's state: scales 2**-3 (inputs past E4M3's max saturate), one amax recorded.
        layer = jax.tree.map(lambda s: jnp.full_like(s, 0.125) if s.ndim == 0 else s + 1.0, layer)

    def setting():
        return skip_warm_start(recorded=True) if steady else contextlib.nullcontext()

    with setting():
        want = jax.jit(_step())((layer, x, w))
    step = _step()
    with dispatch.interpreted(), cast_transpose_kernel(roles), setting():
        assert _kernel_calls(jax.make_jaxpr(step)((layer, x, w))) == calls
        got = jax.jit(step)((layer, x, w))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)
    assert np.isfinite(np.asarray(got[0]))


@pytest.mark.parametrize("form", ["ensemble", "one weight", "a weight each"])
def test_vmapped_layers_quantize_in_one_pass_as_their_xla_path(form):
    """Under `vmap`: an ensemble of layers (each its own state: the kernel runs per member),
    one layer over a batch with one weight (the batch folded into the GEMM's rows) or a
    weight each (into a batch of GEMMs: the kernel mapped over it); the same bits as XLA's
    path, the states' amaxes batch-wide where the state is shared."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 256, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 256, 128)) * 0.05, jnp.float32)
    recipe = fp8jax.DelayedScaling(warm_start=False)
    dims = (((1,), (0,)), ((), ()))
    if form == "ensemble":
        layer = jax.vmap(lambda _: fp8jax.Fp8DotGeneral(recipe))(jnp.arange(2))
        # Members with other scales: 1 and 2**-2.
        member = jnp.asarray([1.0, 0.25])
        layer = jax.tree.map(lambda s: s * member.reshape((2,) + (1,) * (s.ndim - 1)), layer)
    else:
        layer = fp8jax.Fp8DotGeneral(recipe)

    def make():
        def loss(args):
            layer, x, w = args
            if form == "ensemble":
                y = jax.vmap(lambda lay, x, w: lay(x, w, dims))(layer, x, w)
            elif form == "one weight":
                y = jax.vmap(lambda x: layer(x, w[0], dims))(x)
            else:
                y = jax.vmap(lambda x, w: layer(x, w, dims))(x, w)
            return jnp.sum(jnp.sin(y))

        return fp8jax.filter_value_and_grad(loss)

    want = jax.jit(make())((layer, x, w))
    step = make()
    with dispatch.interpreted(), cast_transpose_kernel():
        assert _kernel_calls(jax.make_jaxpr(step)((layer, x, w))) == 3
        got = jax.jit(step)((layer, x, w))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


@pytest.mark.parametrize("case", ["partial tiles", "not chosen"])
def test_the_kernel_is_left_out_where_it_cannot_serve(case):
    """XLA's path where the operands are not whole tiles, and outside the setting; and only
    16- and 32-bit floats of at most one batch axis go to the kernel."""
    assert fits(jnp.zeros((256, 128), jnp.float16)) and fits(jnp.zeros((2, 128, 128)))
    assert not fits(np.zeros((256, 128), np.float64))
    assert not fits(jnp.zeros((2, 2, 128, 128))) and not fits(jnp.zeros((128,)))
    rng = np.random.default_rng(6)
    rows, cols = (200, 100) if case == "partial tiles" else (256, 128)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, cols)) * 0.05, jnp.bfloat16)
    layer = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(warm_start=False))
    context = contextlib.nullcontext() if case == "not chosen" else cast_transpose_kernel()
    with dispatch.interpreted(), context:
        jaxpr = jax.make_jaxpr(_step())((layer, x, w))
    assert _kernel_calls(jaxpr) == 0


def test_quantize_transposed_returns_the_copy_its_pass_wrote():
    """`Recipe.quantize_transposed`: `quantize(x, state, role, -1)` and `None` by default
    (the caller transposes); inside `cast_transpose_kernel()` a per-tensor recipe's
    transposed copy (XLA's path on a CPU), the same values swapped, the same state."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((256, 384)), jnp.bfloat16)
    for recipe in (fp8jax.DelayedScaling(warm_start=False), fp8jax.BlockwiseScaling()):
        state = recipe.init_state("input")
        q, q_t, new = recipe.quantize_transposed(x, state, "input")
        want, want_state = recipe.quantize(x, state, "input", -1)
        assert q_t is None
        same(q.data, want.data)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want_state), strict=True):
            same(a, b)
    recipe = fp8jax.DelayedScaling(warm_start=False)
    with cast_transpose_kernel("input"):
        q, q_t, new = recipe.quantize_transposed(x, recipe.init_state("input"), "input")
        assert recipe.quantize_transposed(x, recipe.init_state("kernel"), "kernel")[1] is None
    same(q_t.data, np.asarray(q.data).T)
    same(q_t.scale_inv, q.scale_inv)


def test_cast_transpose_kernel_takes_roles():
    with cast_transpose_kernel("kernel"):
        assert cast_transpose_chosen("kernel") and not cast_transpose_chosen("input")
    assert not cast_transpose_chosen("kernel")
    for bad in ((), ("weights",), "weights"):
        with pytest.raises(ValueError, match="cast_transpose_kernel: roles=.*expected one role"):
            cast_transpose_kernel(bad)

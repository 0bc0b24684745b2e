"""An expert layer's wgrad tiles quantized as they are gathered into the padded layout
(`kernels/padded_quantize.py`, Pallas Triton): bit for bit with a NumPy reference of the
gathered copy in Pallas' interpreter, inside `BlockwiseScaling` and a blockwise
`Fp8RaggedDot` against their XLA path, and on a deviceless H100 compile."""

import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax._src.gemm.grouped_native import gather_map, pad_layout
from fp8jax._src.kernels import dispatch, padded_quantize
from fp8jax._src.kernels.quantize_config import ColumnTuning
from fp8jax._src.observe import deviceless
from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
INV_448 = np.float32(1) / np.float32(448)  # a tile of ones: scale 448 (E4M3's max)
NAMES = ("fp8jax_quantize_padded_columns", "fp8jax_requantize_padded_columns")
BOTH = "fp8jax_quantize_rows_and_padded_columns"


def row_map(sizes, block):
    """The padded layout's row map of expert-sorted rows with `sizes`, built here by hand:
    each expert's rows from a multiple of `block`, -1 between, in a static `P` rows."""
    rows, start = [], 0
    for n in sizes:
        rows += list(range(start, start + n)) + [-1] * (-n % block)
        start += n
    padded = -(-(sum(sizes) + len(sizes) * (block - 1)) // block) * block
    return np.array(rows + [-1] * (padded - len(rows)), np.int32)


def heavy_tailed(rng, shape):
    """Rows spanning many binades, values past E4M3's max, a NaN and an inf."""
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal((shape[0], 1)) * 4)
    x[1, 2], x[-1, 0] = 1e30, np.inf
    x[shape[0] // 2, 1] = np.nan
    return x.astype(np.float32)


def np_rows(x, fmt, block, power_of_two):
    """`x` in 1 x `block` tiles along its columns in NumPy (float32 math, ml_dtypes
    rounding): data (M, K) and chunk-major scale_inv (K / block, M)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    amax = np.abs(x).reshape(m, k // block, block).max(-1)  # NaN where a tile has one
    fmt_max = np.float32(ml_dtypes.finfo(fmt).max)
    ok = (amax > 0) & np.isfinite(amax)
    with np.errstate(invalid="ignore"):
        scale = np.where(ok, fmt_max / np.where(ok, amax, 1), 1).astype(np.float32)
    scale = np.minimum(scale, np.float32(MAX_SCALE))
    if power_of_two:
        scale = np.exp2(np.floor(np.log2(scale))).astype(np.float32)
    with np.errstate(invalid="ignore"):
        scaled = np.clip(x * np.repeat(scale, block, axis=1), -fmt_max, fmt_max)
    data = np.where(np.isfinite(x), scaled, np.nan).astype(fmt)
    return data, (np.float32(1) / scale).T


def np_columns(x, rows, fmt, block, power_of_two):
    """`x`'s rows gathered by `rows` (zeros where negative) in `block` x 1 tiles along them,
    transposed, in NumPy: data_t (K, P), scale_inv (P / block, K), as `np_rows` of the
    gathered copy's transpose."""
    x = np.asarray(x, np.float32)
    g = np.where((rows >= 0)[:, None], x[np.maximum(rows, 0)], 0).astype(np.float32)
    return np_rows(g.T, fmt, block, power_of_two)


def same(a, b):
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)


CASES = [
    ((70, 0, 130, 5), 256, E4M3, 128, False),
    ((70, 0, 130, 5), 256, E4M3, 128, True),
    ((3, 64, 0, 40), 128, E5M2, 64, False),
]


@pytest.mark.parametrize("sizes, k, fmt, block, power_of_two", CASES)
@pytest.mark.parametrize("slab_rows", [None, 32], ids=["whole tiles", "slabs"])
def test_kernels_match_a_numpy_reference_of_the_gathered_copy(
    sizes, k, fmt, block, power_of_two, slab_rows
):
    """Whole tiles and in slabs of 32 gathered rows (`ColumnTuning.slab_rows`)."""
    rng = np.random.default_rng(sum(sizes) + block)
    rows = row_map(sizes, block)
    x = heavy_tailed(rng, (sum(sizes) + 3, k))  # rows past the experts' are never read
    x[-3:] = 1e38
    rule = dict(block=block, max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True)
    rule["tuning"] = ColumnTuning(slab_rows=slab_rows)
    xb = jnp.asarray(x, jnp.bfloat16)
    got = padded_quantize.quantize_padded_columns(xb, jnp.asarray(rows), fmt, **rule)
    for a, b in zip(got, np_columns(xb, rows, fmt, block, power_of_two), strict=True):
        same(a, b)
    # From FP8 tiles of one row (the saved activation): the dequantized values, gathered.
    finite = np.nan_to_num(x, nan=0.0, posinf=0.0)
    amax = np.abs(finite).reshape(len(x), k // block, block).max(-1)
    scale_inv = np.where(amax > 0, amax / 448, 1).astype(np.float32)  # any positive scales
    data = (finite / np.repeat(scale_inv, block, axis=1)).astype(fmt)
    again = padded_quantize.requantize_padded_columns(
        jnp.asarray(data), jnp.asarray(scale_inv.T), jnp.asarray(rows), **rule
    )
    real = data.astype(np.float32) * np.repeat(scale_inv, block, axis=1)
    for a, b in zip(again, np_columns(real, rows, fmt, block, power_of_two), strict=True):
        same(a, b)


@pytest.mark.parametrize("sizes, k, fmt, block, power_of_two", CASES)
@pytest.mark.parametrize("past", [0, 3], ids=["every row grouped", "rows past the groups"])
@pytest.mark.parametrize("slab_rows", [None, 16], ids=["whole tiles", "slabs"])
def test_rows_and_padded_columns_match_numpy_in_one_kernel(
    sizes, k, fmt, block, power_of_two, past, slab_rows
):
    """The output gradient's two copies from one read: its 1 x `block` tiles in its own
    rows (every row, those past the experts' included, which only the gaps name) and its
    gathered `block` x 1 tiles; the programs' amaxes reduce to `x`'s, NaN included. Also
    in slabs of 16 gathered rows (`ColumnTuning.slab_rows`)."""
    rng = np.random.default_rng(sum(sizes) + block + past)
    m = sum(sizes) + past
    x = jnp.asarray(heavy_tailed(rng, (m, k)), jnp.bfloat16)
    rows = gather_map(pad_layout(jnp.asarray(sizes), m, block))
    rule = dict(block=block, max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True)
    rule["tuning"] = ColumnTuning(num_warps=4, slab_rows=slab_rows)
    data, scale_t, amaxes, data_t, cols = padded_quantize.quantize_rows_and_padded_columns(
        x, rows, fmt, **rule
    )
    for a, b in zip((data, scale_t), np_rows(x, fmt, block, power_of_two), strict=True):
        same(a, b)
    assert data.dtype == fmt and data_t.dtype == fmt
    want = np_columns(x, np.asarray(rows), fmt, block, power_of_two)
    for a, b in zip((data_t, cols), want, strict=True):
        same(a, b)
    assert amaxes.shape == (rows.shape[0] // block, k // block) and np.isnan(jnp.max(amaxes))
    # Without the NaN: the inf of the last row (past the groups with `past`) is the amax.
    no_nan = x.at[jnp.isnan(x)].set(0)
    amaxes = padded_quantize.quantize_rows_and_padded_columns(no_nan, rows, fmt, **rule)[2]
    assert jnp.max(amaxes) == jnp.inf and no_nan[-1, 0] == jnp.inf


def test_gaps_are_zeros_and_nans_stay_in_their_tile():
    rows = row_map((3, 5), 128)
    x = jnp.ones((8, 128), jnp.float32).at[6, 7].set(jnp.nan)
    data_t, scale_inv = padded_quantize.quantize_padded_columns(
        x, jnp.asarray(rows), E4M3, max_scale=MAX_SCALE, interpret=True
    )
    data = np.asarray(data_t, np.float32).T
    np.testing.assert_array_equal(data[3:128], 0.0)  # the first expert's gap
    assert np.isnan(data[128 + 3, 7])  # row 6 sits at 128 + 3
    # A NaN tile keeps scale 1 (the recipe's rule); the other tiles of the expert their own.
    assert scale_inv[1, 7] == 1 and np.all(np.delete(scale_inv[1], 7) == INV_448)
    np.testing.assert_array_equal(scale_inv[0], INV_448)  # a tile of ones, gaps ignored


def test_fits_only_whole_tiles_of_addressable_size():
    assert padded_quantize.fits((100, 256), 384, 128)
    assert not padded_quantize.fits((100, 200), 384, 128)  # columns not in whole tiles
    assert not padded_quantize.fits((100, 256), 300, 128)  # padded rows not whole tiles
    assert not padded_quantize.fits((0, 256), 128, 128)  # no rows to read
    assert not padded_quantize.fits((2**22, 1024), 2**22, 128)  # past 32-bit offsets


def test_kernels_refuse_what_they_cannot_gather():
    ones = jnp.ones((100, 256))
    with pytest.raises(ValueError, match=r"gathered into 200 of shape \(100, 256\)"):
        padded_quantize.quantize_padded_columns(ones, jnp.zeros(200, jnp.int32), E4M3, max_scale=1)
    with pytest.raises(ValueError, match=r"rows has shape \(2, 128\)"):
        padded_quantize.quantize_padded_columns(
            ones, jnp.zeros((2, 128), jnp.int32), E4M3, max_scale=1
        )
    with pytest.raises(ValueError, match=r"scale_inv_t has shape \(100, 2\).*takes \(2, 100\)"):
        padded_quantize.requantize_padded_columns(
            jnp.ones((100, 256), E4M3), jnp.ones((100, 2)), jnp.zeros(128, jnp.int32), max_scale=1
        )


@pytest.mark.parametrize("power_of_two", [False, True])
def test_blockwise_recipe_gathers_as_its_xla_path(power_of_two):
    """Under the interpreter `BlockwiseScaling` takes the kernels (where a Hopper GPU would);
    its gathered tiles equal the XLA path's (`native_kernel=False`) bit for bit: the output
    gradient from high precision, the activation requantized from its saved FP8 tiles."""
    rng = np.random.default_rng(5)
    rows = jnp.asarray(row_map((70, 0, 130, 5), 128))
    x = jnp.asarray(heavy_tailed(rng, (205, 256)), jnp.bfloat16)
    xla = fp8jax.BlockwiseScaling(power_of_two=power_of_two, native_kernel=False)
    kernel = fp8jax.BlockwiseScaling(power_of_two=power_of_two)
    state = xla.init_state("input")

    def run(recipe):
        q, _ = recipe.quantize(x, state, "input", -1)
        return recipe.quantize_gathered(x, rows, "output_grad"), recipe.retile_gathered(
            q, rows, "input"
        )

    def both(recipe):  # the gradient's two copies and its new state, rows past the groups
        return recipe.quantize_both_gathered(x_past, covering, state, "output_grad")

    x_past = jnp.concatenate([x, 2 * x[:3]])  # 3 rows past the experts': the state sees them
    covering = gather_map(pad_layout(jnp.asarray([70, 0, 130, 5]), x_past.shape[0], 128))
    want = jax.jit(lambda: (run(xla), both(xla)))()
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(lambda: (run(kernel), both(kernel)))())
        got = jax.jit(lambda: (run(kernel), both(kernel)))()
    assert all(name in jaxpr for name in (*NAMES, BOTH))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)
    assert got[0][0].block == got[0][1].block == got[1][1].block == (128, 1)
    assert got[1][0].block == (1, 128)


def test_blockwise_expert_layer_trains_as_its_xla_path_with_the_gathering_kernels():
    """A blockwise `Fp8RaggedDot` whose GEMMs run on the XLA path and whose wgrad operands
    are gathered by the kernels: value, gradients and new state equal the all-XLA step bit
    for bit, the expert without tokens included."""
    rng = np.random.default_rng(11)
    sizes = jnp.array([70, 0, 130, 5], jnp.int32)
    x = jnp.asarray(heavy_tailed(rng, (205, 256)), jnp.float32)
    x = jnp.nan_to_num(x, nan=0.0, posinf=0.0)
    w = jnp.asarray(rng.standard_normal((4, 256, 128)) * 0.05, jnp.float32)

    def loss(args):
        dot, x, w = args
        return jnp.sum(jnp.sin(dot(x, w, sizes)))

    step = fp8jax.filter_value_and_grad(loss)

    def layer(native_kernel):
        recipe = fp8jax.BlockwiseScaling(native_kernel=native_kernel)
        return fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=False)

    want = jax.jit(step)((layer(False), x, w))
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(step)((layer(None), x, w)))
        got = jax.jit(step)((layer(None), x, w))
    # The output gradient's two copies in one kernel, the activation requantized in another.
    assert all(name in jaxpr for name in (BOTH, NAMES[1]))
    assert NAMES[0] not in jaxpr and not re.search(r"fp8jax_quantize_rows\b", jaxpr)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)
    np.testing.assert_array_equal(got[1][2][1], 0.0)  # no tokens: no weight gradient


def read(path):
    with open(path) as f:
        return f.read()


@pytest.mark.skipif(deviceless.h100_topology() is None, reason="no CUDA plugin")
def test_h100_compile_gathers_in_three_triton_kernels():
    """The three kernels compiled for an H100: Triton kernels whose scales divide exactly
    (`div.rn.f32`, as the CPU's XLA path) and that spill nothing."""

    def both(x, data, scale_inv_t, rows):
        rule = dict(max_scale=MAX_SCALE, interpret=False)
        return (
            padded_quantize.quantize_padded_columns(x, rows, E4M3, **rule),
            padded_quantize.requantize_padded_columns(data, scale_inv_t, rows, **rule),
            padded_quantize.quantize_rows_and_padded_columns(x, rows, E4M3, **rule),
        )

    spec = jax.ShapeDtypeStruct
    args = (
        spec((1000, 512), jnp.bfloat16),
        spec((1000, 512), E4M3),
        spec((4, 1000), jnp.float32),
        spec((1536,), jnp.int32),
    )
    lowered, _ = deviceless.lower(both, args, {}, deviceless.h100_topology().devices[0])
    with tempfile.TemporaryDirectory() as folder:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": folder, "xla_dump_emitter_re": "^ptx$"}
        )
        files = glob.glob(f"{folder}/**/*.ptx", recursive=True)
        ptx = [text for text in map(read, files) if re.search(r"\.entry fp8jax_\w*quantize", text)]
    hlo = compiled.as_text()
    assert all(f"{name}/pallas_call" in hlo for name in (*NAMES, BOTH))
    assert len(ptx) == 3
    for text in ptx:
        assert "div.rn.f32" in text and "div.full.f32" not in text and ".local" not in text

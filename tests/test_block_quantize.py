"""One-pass tile quantization for DeepSeek-V3's blockwise recipe (Pallas Triton kernels):
bit for bit with the recipe's XLA path in Pallas' interpreter, inside `BlockwiseScaling`
(quantize, the output gradient's two copies, the wgrad's retiling), and on a deviceless H100
compile (one kernel per tensor, IEEE division in its PTX, no transpose of its outputs)."""

import contextlib
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax._src.core import jax_private
from fp8jax._src.kernels import block_quantize, dispatch, padded_quantize, quantize_config
from fp8jax._src.observe import deviceless
from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
KERNELS = (
    "fp8jax_quantize_blocks",
    "fp8jax_quantize_rows",
    "fp8jax_quantize_rows_and_columns",
    "fp8jax_requantize_columns",
)


def heavy_tailed(rng, shape, dtype=jnp.bfloat16):
    """Rows spanning many binades, a zero tile, and values past E4M3's max."""
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal((shape[0], 1)) * 4)
    x[: shape[0] // 2, -(shape[1] // 3) :] = 0.0
    x[1, 2] = 1e30
    return jnp.asarray(x, dtype)


def same(a, b):
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def np_scales(amax: np.ndarray, fmt, power_of_two: bool) -> np.ndarray:
    """Tiles' scales from their amaxes in NumPy (float32), `BlockwiseScaling`'s rule: the
    format's max over the amax (1 where it is 0 or not finite), at most `MAX_SCALE`."""
    fmt_max = np.float32(ml_dtypes.finfo(fmt).max)
    ok = (amax > 0) & np.isfinite(amax)
    with np.errstate(over="ignore"):  # a tiny amax: past float32, capped below
        scale = np.where(ok, fmt_max / np.where(ok, amax, 1), 1).astype(np.float32)
    scale = np.minimum(scale, np.float32(MAX_SCALE))
    if power_of_two:
        scale = np.exp2(np.floor(np.log2(scale))).astype(np.float32)
    return scale


def np_reference_rows(x, fmt, block, power_of_two):
    """1 x `block` tiles of `x` in NumPy (float32 math, ml_dtypes rounding), independent of
    fp8jax: data, chunk-major scale_inv, each program's amax."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    amax = np.abs(x).reshape(m, k // block, block).max(-1)
    scale = np_scales(amax, fmt, power_of_two)
    fmt_max = np.float32(ml_dtypes.finfo(fmt).max)
    scaled = np.clip(x * np.repeat(scale, block, axis=1), -fmt_max, fmt_max)
    data = np.where(np.isfinite(x), scaled, np.nan).astype(fmt)
    programs = amax.reshape(m // block, block, k // block).max(1)
    return data, (np.float32(1) / scale).T, programs


@pytest.mark.parametrize(
    "shape, fmt, block, power_of_two",
    [
        ((256, 384), E4M3, 128, False),
        ((256, 384), E4M3, 128, True),
        ((128, 192), E5M2, 64, False),
    ],
)
@pytest.mark.parametrize("slab_rows", [None, 32], ids=["whole tiles", "slabs"])
def test_kernels_match_a_numpy_reference_bit_for_bit(shape, fmt, block, power_of_two, slab_rows):
    """Whole tiles and in slabs of 32 rows (`ColumnTuning.slab_rows`: two reads of a tile
    for its columns), every output as NumPy's."""
    rng = np.random.default_rng(sum(shape) + block)
    x = heavy_tailed(rng, shape)
    rule = dict(block=block, max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True)
    rule["tuning"] = block_quantize.ColumnTuning(num_warps=4, slab_rows=slab_rows)
    data, scale_t, programs, data_t, cols_t = block_quantize.quantize_rows_and_columns(
        x, fmt, **rule
    )
    want = np_reference_rows(x, fmt, block, power_of_two)
    for got, ref in zip((data, scale_t, programs), want, strict=True):
        same(got, ref)
    # The columns are the rows of the transpose, written K-major.
    columns = np_reference_rows(x.T, fmt, block, power_of_two)[:2]
    for got, ref in zip((data_t, cols_t), columns, strict=True):
        same(got, ref)
    for got, ref in zip(block_quantize.quantize_rows(x, fmt, **rule), want, strict=True):
        same(got, ref)
    # Requantized from the FP8 tiles (V3's wgrad operand): the dequantized values' columns.
    again = block_quantize.requantize_columns(data, scale_t, **rule)
    real = np.asarray(data, np.float32) * np.repeat(np.asarray(scale_t).T, block, axis=1)
    for got, ref in zip(
        again, np_reference_rows(real.T, fmt, block, power_of_two)[:2], strict=True
    ):
        same(got, ref)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_tiles_too_small_for_the_formats_range_take_the_capped_scale(power_of_two):
    """A 128 x 128 tile of values near float32's smallest normals: `fmt_max / amax` is past
    float32's range, so each of its scales is capped at `MAX_SCALE` (its inverse stays
    normal, its FP8 values are those of `x * MAX_SCALE`), in every kernel, as NumPy's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 256))
    # Normal float32 (no flush of subnormals), at most 2**-121: 448 / amax overflows float32.
    x[:, :128] = np.sign(x[:, :128]) * 2.0 ** rng.uniform(-125, -121, (128, 128))
    x = jnp.asarray(x, jnp.bfloat16)
    rule = dict(block=128, max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True)
    data, scale_t, _, data_t, cols_t = block_quantize.quantize_rows_and_columns(x, E4M3, **rule)
    want = np_reference_rows(x, E4M3, 128, power_of_two)
    assert np.all(want[1][0] == np.float32(1 / MAX_SCALE))  # the tiny tiles' scales: capped
    same(data, want[0])
    same(scale_t, want[1])
    columns = np_reference_rows(x.T, E4M3, 128, power_of_two)[:2]
    for got, ref in zip((data_t, cols_t), columns, strict=True):
        same(got, ref)
    # A weight's 128 x 128 blocks: one (capped) scale for the tiny block.
    w = np.asarray(x, np.float32)
    blocks = np_scales(np.abs(w).reshape(1, 128, 2, 128).max((1, 3)), E4M3, power_of_two)
    scale = np.repeat(blocks, 128, axis=1)
    fmt_max = np.float32(ml_dtypes.finfo(E4M3).max)
    want_w = np.clip(w * np.repeat(scale, 128, axis=0), -fmt_max, fmt_max).astype(E4M3)
    w_data, _, rows_t, _, _ = block_quantize.quantize_blocks(x, E4M3, **rule)
    same(w_data, want_w)
    same(rows_t, (np.float32(1) / np.repeat(blocks, 128, axis=0)).T)


def _transposing_kernels():
    """Each kernel that writes a transposed copy, as `its name -> f(x, **options)`."""
    rule = dict(max_scale=MAX_SCALE)
    # A row map with a gap of 28 rows, each naming a row no padded row holds (`gather_map`).
    rows = jnp.asarray(np.r_[np.arange(100), -1 - np.arange(100, 128), np.arange(128, 256)])

    def saved(x, interpret):  # the rows kernel's copy, as the requantizing kernels read it
        return block_quantize.quantize_rows(x, E4M3, **rule, interpret=interpret)[:2]

    def both(x, **k):
        return block_quantize.quantize_rows_and_columns(x, E4M3, **rule, **k)

    def requantize(x, **k):
        return block_quantize.requantize_columns(*saved(x, k["interpret"]), **rule, **k)

    def blocks(x, **k):
        return block_quantize.quantize_blocks(x, E4M3, **rule, **k)

    def padded(x, **k):
        return padded_quantize.quantize_padded_columns(x, rows, E4M3, **rule, **k)

    def padded_requantize(x, **k):
        data, scale_t = saved(x, k["interpret"])
        return padded_quantize.requantize_padded_columns(data, scale_t, rows, **rule, **k)

    def padded_both(x, **k):
        return padded_quantize.quantize_rows_and_padded_columns(x, rows, E4M3, **rule, **k)

    names = block_quantize.QUANTIZE_NAMES[1:6] + block_quantize.QUANTIZE_NAMES[7:8]
    kernels = (both, requantize, blocks, padded, padded_requantize, padded_both)
    return dict(zip(names, kernels, strict=True))


def test_column_tunings_compute_the_same_and_lower_for_an_h100():
    """The GPU check's sweep of the transposing kernels (`ColumnTuning`): with another warp
    count and the float32 tile transposed before the cast, each writes the same FP8 values
    and scales as in its default (interpreted), and refuses a bad tuning by name; the
    tunings compile for an H100 (Triton, deviceless)."""
    rng = np.random.default_rng(11)
    x = heavy_tailed(rng, (256, 384))
    # Warps change nothing interpreted; the order of cast and transpose and the width of
    # the transposed tile do.
    tunings = [
        block_quantize.ColumnTuning(num_warps=2, transpose_first=True),
        block_quantize.ColumnTuning(num_warps=4, wide_transpose=True),
        # in slabs: the rows slab by slab, the columns from a second read of each
        block_quantize.ColumnTuning(num_warps=4, slab_rows=32),
        block_quantize.ColumnTuning(num_warps=8, slab_rows=16, wide_transpose=True),
        block_quantize.ColumnTuning(num_warps=2, slab_rows=64, transpose_first=True),
    ]
    for default in (block_quantize.DEFAULT_TUNING, block_quantize.OTHER_TUNING):
        assert not default.transpose_first and not default.wide_transpose
    both = block_quantize.ColumnTuning(transpose_first=True, wide_transpose=True)
    kernels = _transposing_kernels()
    for kernel in kernels.values():
        want = kernel(x, interpret=True)
        for tuning in tunings:
            for a, b in zip(kernel(x, interpret=True, tuning=tuning), want, strict=True):
                same(a, b)
        with pytest.raises(ValueError, match="num_warps a power of two"):
            kernel(x, interpret=True, tuning=block_quantize.ColumnTuning(num_warps=3))
        with pytest.raises(ValueError, match="choose one"):
            kernel(x, interpret=True, tuning=both)
        for rows in (3, 0, True):
            with pytest.raises(ValueError, match="slab_rows should be None or a power of two"):
                kernel(x, interpret=True, tuning=block_quantize.ColumnTuning(slab_rows=rows))
    if deviceless.h100_topology() is None:
        return
    device = deviceless.h100_topology().devices[0]
    spec = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)

    # The two ways a tuning reaches the PTX: store_columns (every kernel but the weight's)
    # and the weight kernel's own transposed cast (compiles take seconds: CI time).
    compiled = [name for name in kernels if "rows_and_columns" in name or "blocks" in name]

    def each(x):
        return [kernels[name](x, interpret=False, tuning=tunings[0]) for name in compiled]

    hlo = deviceless.lower(each, (spec,), {}, device)[0].compile().as_text()
    assert len(compiled) == 2 and all(name in hlo for name in compiled)
    assert hlo.count("num_warps = 2 : i32") == 2  # each kernel in its tuning


@pytest.mark.skipif(deviceless.h100_topology() is None, reason="no CUDA plugin")
def test_wide_transpose_moves_no_single_bytes_through_shared_memory():
    """`ColumnTuning(wide_transpose=True)` compiled for an H100: the rows-and-columns
    kernel transposes its FP8 tile widened to BF16 with `ldmatrix ... .trans`, not one
    `ld.shared.b8` per byte as in the default (where Triton gathers the FP8 tile), and still
    divides exactly and spills nothing."""
    ptx = rows_and_columns_ptx(block_quantize.ColumnTuning(num_warps=4, wide_transpose=True))
    assert "ld.shared.b8" not in ptx and re.search(r"ldmatrix\.[\w.]*\.trans", ptx)
    assert "div.rn.f32" in ptx and ".local" not in ptx


def rows_and_columns_ptx(tuning: block_quantize.ColumnTuning) -> str:
    """The PTX of the rows-and-columns kernel in `tuning`, compiled for an H100 (one kernel)."""

    def both(x):
        rule = dict(max_scale=MAX_SCALE, interpret=False, tuning=tuning)
        return block_quantize.quantize_rows_and_columns(x, E4M3, **rule)

    spec = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    lowered, _ = deviceless.lower(both, (spec,), {}, deviceless.h100_topology().devices[0])
    with tempfile.TemporaryDirectory() as folder:
        lowered.compile(compiler_options={"xla_dump_to": folder, "xla_dump_emitter_re": "^ptx$"})
        files = glob.glob(f"{folder}/**/*.ptx", recursive=True)
        ptx = [text for text in map(read, files) if re.search(r"\.entry fp8jax_\w*quantize", text)]
    assert len(ptx) == 1
    return ptx[0]


@pytest.mark.skipif(deviceless.h100_topology() is None, reason="no CUDA plugin")
def test_slabs_lower_for_an_h100_dividing_exactly_without_spills():
    """The rows-and-columns kernel in slabs of 32 rows (`ColumnTuning(slab_rows=32)`)
    compiled for an H100: one Triton kernel walking its tile in loops (backward branches in
    its PTX, none in the whole tile's), dividing with `div.rn.f32`, spilling nothing."""

    slabs = rows_and_columns_ptx(block_quantize.ColumnTuning(num_warps=4, slab_rows=32))
    whole = rows_and_columns_ptx(block_quantize.DEFAULT_TUNING)
    assert "div.rn.f32" in slabs and ".local" not in slabs
    assert backward_branches(slabs) >= 2 and backward_branches(whole) == 0


def backward_branches(ptx: str) -> int:
    """Branches to a label above them in `ptx`: a loop's."""
    labels = {m.group(1): m.start() for m in re.finditer(r"^\$(\w+):", ptx, re.M)}
    jumps = re.finditer(r"bra(?:\.uni)?\s+\$(\w+);", ptx)
    return sum(labels[m.group(1)] < m.start() for m in jumps)


def test_kernels_propagate_nan_and_inf():
    """An inf or NaN becomes NaN in the data, and the program's amax shows it (the state
    then rejects the step), although PTX's `max` would drop a NaN."""
    x = np.ones((128, 256), np.float32)
    x[3, 4], x[5, 200] = np.nan, np.inf
    x[5, 201] = 1e3  # beside the inf, at its tile's scale 1: saturated to 448, as NumPy's
    rule = dict(max_scale=MAX_SCALE, interpret=True)
    data, scale_t, programs, data_t, _ = block_quantize.quantize_rows_and_columns(
        jnp.asarray(x), E4M3, **rule
    )
    same(data, np_reference_rows(x, E4M3, 128, False)[0])
    data = np.asarray(data, np.float32)
    assert np.isnan(data[3, 4]) and np.isnan(data[5, 200]) and np.isnan(data_t[4, 3].astype(float))
    assert np.isnan(programs[0, 0]) and np.isinf(programs[0, 1])
    # Finite rows keep their own scales.
    assert np.all(np.isfinite(np.asarray(scale_t)[:, 0]))


def _kernel_reductions(fn, *args) -> int:
    """`reduce_max` operations inside the Pallas kernels `fn` calls (its traced jaxpr)."""

    def count(jaxpr, inside: bool) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += inside and eqn.primitive.name == "reduce_max"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                total += count(sub, inside or eqn.primitive.name == "pallas_call")
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr, False)


def test_each_tile_amax_is_one_reduction_per_direction():
    """A tile's amaxes (its rows', its columns', the program's) are one integer maximum each
    of the magnitudes' bit patterns, NaN-propagating by itself (`nan_max`), where a float
    maximum and a NaN test were two: 3 reductions in the rows-and-columns kernel (6 before),
    2 in the per-tensor cast-and-transpose (4). A negative NaN counts as a NaN."""
    from fp8jax._src.kernels.cast_transpose import cast_transpose

    x = jnp.zeros((256, 256), jnp.bfloat16)
    rule = dict(max_scale=MAX_SCALE, interpret=True)
    rows_and_columns = _kernel_reductions(
        lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **rule), x
    )
    per_tensor = _kernel_reductions(
        lambda x: cast_transpose(x, jnp.float32(1.0), E4M3, interpret=True), x
    )
    assert (rows_and_columns, per_tensor) == (3, 2)
    negative_nan = np.array([0xFFC00000], np.uint32).view(np.float32)[0]
    magnitudes = jnp.asarray([[1.0, negative_nan, 3.0], [2.0, np.inf, 0.5]], jnp.float32)
    got = np.asarray(block_quantize.nan_max(jnp.abs(magnitudes), axis=1))
    assert np.isnan(got[0]) and got[1] == np.inf
    assert float(block_quantize.nan_max(jnp.asarray([0.0, 2.5, 1e-40]), axis=None)) == 2.5


@pytest.mark.parametrize("fmt, block, power_of_two", [(E4M3, 128, False), (E5M2, 64, True)])
def test_weight_kernel_matches_the_recipes_xla_path(fmt, block, power_of_two):
    """128 x 128 blocks (one scale each, written once per row of both layouts) and the
    transposed copy the dgrad takes, equal to `BlockwiseScaling`'s XLA quantization (jitted:
    XLA's CPU division, which the interpreter shares, is not always correctly rounded for
    vectors; the GPU kernel divides exactly)."""
    rng = np.random.default_rng(block)
    w = heavy_tailed(rng, (2 * block, 3 * block))
    recipe = fp8jax.BlockwiseScaling(
        block_size=block, power_of_two=power_of_two, format_name=fmt.name, native_kernel=False
    )
    q = jax.jit(lambda w: recipe._quantize(w, "kernel", -1))(w)
    data, data_t, rows_t, cols, amax = block_quantize.quantize_blocks(
        w, fmt, block=block, max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True
    )
    same(data, q.data)
    same(data_t, q.data.T)
    blocks = np.asarray(q.scale_inv)  # (2, 3): block (i, j) covers rows i, columns j
    same(rows_t, np.repeat(blocks, block, axis=0).T)  # (K / block, N): each weight row's
    same(cols, np.repeat(blocks, block, axis=1))  # (N / block, K): each data_t row's
    want = np.abs(np.asarray(w, np.float32)).reshape(2, block, 3, block).max((1, 3))
    same(amax, want)


def test_kernels_refuse_shapes_they_cannot_tile():
    with pytest.raises(ValueError, match=r"shape \(100, 256\) is not made of whole 128 x 128"):
        block_quantize.quantize_rows(jnp.ones((100, 256)), E4M3, max_scale=1.0, interpret=True)
    data = jnp.ones((128, 256), E4M3)
    with pytest.raises(ValueError, match=r"scale_inv_t has shape \(128, 2\).*takes \(2, 128\)"):
        block_quantize.requantize_columns(data, jnp.ones((128, 2)), max_scale=1.0)


def test_operands_past_32_bit_offsets_keep_the_xla_path():
    """Pallas' Triton lowering addresses an array of at most 2**32 bytes with 32-bit element
    offsets, which overflow past 2**31 - 1 elements: an FP8 copy of a 16384 x 151552 output
    gradient (a vocabulary's) would be written out of bounds. `fits` says no there (over a
    batch the kernels map over too), the kernels refuse it by name, and the blockwise recipe
    keeps its XLA path (traced only: nothing is allocated)."""
    int32_max = int(np.iinfo(np.int32).max)
    big = (16384, 151552)
    assert big[0] * big[1] > int32_max and not block_quantize.fits(big, 128)
    assert not block_quantize.fits((2, 16384, 65536), 128)  # 2**30 a member, 2**31 in all
    assert block_quantize.fits((128 * 16383, 1024), 128)  # 2**31 - 2**17 elements
    spec = jax.ShapeDtypeStruct(big, jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"{big[0]}, {big[1]}\).*more than {int32_max} el"):
        block_quantize.quantize_rows(spec, E4M3, max_scale=1.0, interpret=True)
    recipe = fp8jax.BlockwiseScaling()
    state = recipe.init_state("output_grad")

    def kernels(shape):
        with dispatch.interpreted():
            both = jax.make_jaxpr(lambda g: recipe.quantize_both(g, state, "output_grad"))
            return str(both(jax.ShapeDtypeStruct(shape, jnp.bfloat16))).count("pallas_call")

    assert kernels((256, 256)) == 1 and kernels(big) == 0 and kernels((2, 16384, 65536)) == 0


def test_kernels_refuse_targets_that_are_not_fp8():
    """The kernels cast to FP8: a BF16 or float32 `fmt` (or data to requantize) was taken,
    and 3.0 came out as 2.55e38 (a copy scaled to BF16's max). Each kernel names the format
    it was given; the FP8 formats still run."""
    x = jnp.full((128, 128), 3.0, jnp.float32)
    rows = jnp.arange(128)
    rule = dict(max_scale=MAX_SCALE, interpret=True)
    from fp8jax._src.kernels.cast_transpose import cast_transpose

    scale_t = jnp.ones((1, 128))
    calls = (
        lambda f: block_quantize.quantize_rows(x, f, **rule),
        lambda f: block_quantize.quantize_rows_and_columns(x, f, **rule),
        lambda f: block_quantize.quantize_blocks(x, f, **rule),
        lambda f: padded_quantize.quantize_padded_columns(x, rows, f, **rule),
        lambda f: padded_quantize.quantize_rows_and_padded_columns(x, rows, f, **rule),
        lambda f: cast_transpose(x, 1.0, f, interpret=True),
        lambda f: block_quantize.requantize_columns(x.astype(f), scale_t, **rule),
        lambda f: padded_quantize.requantize_padded_columns(x.astype(f), scale_t, rows, **rule),
    )
    for fmt in (jnp.bfloat16, jnp.float32, jnp.int8):
        for call in calls:
            with pytest.raises(ValueError, match=rf"format {jnp.dtype(fmt).name}; expected an FP8"):
                call(fmt)
    data = block_quantize.quantize_rows(x, E5M2, **rule)[0]
    assert data.dtype == E5M2 and float(data[0, 0]) == float(ml_dtypes.finfo(E5M2).max)


def test_fits_only_blocks_triton_can_lower():
    """Pallas' Triton lowering takes arrays of power-of-two sizes only (an H100 compile of a
    96-wide tile raised "requires ... a power of 2"): `fits` said yes to 192 x 192 in blocks
    of 96, and the interpreter ran it. Both predicates now say no, and each kernel names the
    block (0 raised ZeroDivisionError)."""
    assert block_quantize.fits((128, 256), 64) and padded_quantize.fits((100, 256), 128, 64)
    for block in (96, 0, True, 128.0):
        assert not block_quantize.fits((192, 192), block)
        assert not padded_quantize.fits((192, 192), 192, block)
    x, rows = jnp.ones((192, 192), jnp.float32), jnp.arange(192)
    rule = dict(max_scale=1.0, interpret=True)
    for block in (96, 0):
        calls = (
            lambda b: block_quantize.quantize_rows(x, E4M3, block=b, **rule),
            lambda b: block_quantize.quantize_blocks(x, E4M3, block=b, **rule),
            lambda b: padded_quantize.quantize_padded_columns(x, rows, E4M3, block=b, **rule),
        )
        for call in calls:
            with pytest.raises(ValueError, match=rf"block={block}; expected a power of two"):
                call(block)


def test_tunings_refuse_warps_triton_cannot_take():
    """`num_warps` is a whole number of warps, a power of two up to 32: `True` and `4.0`
    (equal to 1 and 4 in a tuple's `in`) were taken and passed on to Triton."""
    x = jnp.ones((128, 128), jnp.float32)
    for warps in (True, 4.0, 3, 64, 0):
        tuning = block_quantize.ColumnTuning(num_warps=warps)
        with pytest.raises(ValueError, match=rf"num_warps={warps!r}.*power of two from 1"):
            block_quantize.quantize_rows(x, E4M3, max_scale=1.0, interpret=True, tuning=tuning)


def test_quantize_slabs_sets_the_rows_of_tunings_that_name_none():
    """`quantize_slabs(rows)` fills `slab_rows` where a tuning leaves it `None`, inside only,
    and refuses what is not a power of two by name."""
    mine = block_quantize.ColumnTuning(slab_rows=64)
    with quantize_config.quantize_slabs(16):
        assert quantize_config.resolved(block_quantize.DEFAULT_TUNING).slab_rows == 16
        assert quantize_config.resolved(mine) == mine
        assert quantize_config.slab_height(quantize_config.resolved(mine), 32) == 32
    assert quantize_config.resolved(block_quantize.DEFAULT_TUNING).slab_rows is None
    for rows in (0, 24, True, 16.0):
        with pytest.raises(ValueError, match=r"quantize_slabs: rows=.*power of two"):
            quantize_config.quantize_slabs(rows)


def kernel_loops(jaxpr) -> list[tuple[str, int]]:
    """Each Pallas kernel that `jaxpr` calls, by name, with the loops in its body."""

    def inner(j):
        for eqn in j.eqns:
            for sub in jax_private.sub_jaxprs(eqn):
                yield eqn, jax_private.jaxpr_parts(sub)[0]

    def loops(j):
        own = sum(e.primitive.name in ("while", "scan") for e in j.eqns)
        return own + sum(loops(s) for _, s in inner(j))

    def kernels(j):
        for eqn, sub in inner(j):
            if eqn.primitive.name == "pallas_call":
                yield sub.debug_info.func_src_info.split()[0], loops(sub)
            else:
                yield from kernels(sub)

    return sorted(kernels(jaxpr))


def read(path):
    with open(path) as f:
        return f.read()


def states(recipe, role):
    return recipe.init_state(role)


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_blockwise_recipe_quantizes_as_its_xla_path(power_of_two, batch):
    """Under the interpreter the recipe takes the kernels (where a Hopper GPU would): its
    tensors and new state equal the XLA path's (`native_kernel=False`), for the forward's
    activation, the output gradient's two copies, and the wgrad's retiled activation; the
    weight's two copies hold the same FP8 values, each block's scale repeated over the tiles
    along the contracted axis (the layout the GEMM kernels read)."""
    rng = np.random.default_rng(7)
    x = (
        heavy_tailed(rng, (*batch, 256, 384))
        if not batch
        else jnp.stack([heavy_tailed(rng, (256, 384)) for _ in range(batch[0])])
    )
    xla = fp8jax.BlockwiseScaling(power_of_two=power_of_two, native_kernel=False)
    kernel = fp8jax.BlockwiseScaling(power_of_two=power_of_two)
    state = states(xla, "input")

    w = x if not batch else x[0]  # weights are 2-D

    def run(recipe):
        q, new = recipe.quantize(x, state, "input", -1)
        g, g_rows, new_g = recipe.quantize_both(x, state, "output_grad")
        q_w, new_w = recipe.quantize(w, state, "kernel", -1)
        q_w_t = recipe.retile(q_w, "kernel", -2, source=w)
        return q, new, g, g_rows, new_g, recipe.retile(q, "input", -2), q_w, new_w, q_w_t

    want = jax.jit(lambda: run(xla))()
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(lambda: run(kernel))())
        got = jax.jit(lambda: run(kernel))()
    for kernel_name in KERNELS:
        assert kernel_name in jaxpr
    (*got, got_w, new_w, got_w_t), (*want, want_w, want_new_w, want_w_t) = got, want
    for a, b in zip(
        jax.tree.leaves((got, new_w)), jax.tree.leaves((want, want_new_w)), strict=True
    ):
        same(a, b)
    assert got[3].block == want[3].block == (128, 1)
    blocks = np.asarray(want_w.scale_inv)  # (2, 3) blocks of 128 x 128
    assert want_w.block == want_w_t.block == (128, 128)
    assert got_w.block == (1, 128) and got_w_t.block == (128, 1)
    same(got_w.data, want_w.data)
    same(got_w_t.data, want_w_t.data)
    same(got_w.scale_inv, np.repeat(blocks, 128, axis=0))
    same(got_w_t.scale_inv, np.repeat(blocks, 128, axis=1))
    for g, w in ((got_w, want_w), (got_w_t, want_w_t)):
        same(g.dequantize(), w.dequantize())


@pytest.mark.parametrize("slabs", [False, True], ids=["whole tiles", "quantize_slabs"])
def test_blockwise_linear_trains_as_its_xla_path_with_the_quantization_kernels(slabs):
    """A blockwise Fp8DotGeneral's value and gradients (weights, input, new state) with the
    one-pass kernels, the GEMMs on the XLA path, equal the all-XLA step bit for bit; also
    traced inside `quantize_slabs(32)`, where every kernel walks its tiles in a loop."""
    rng = np.random.default_rng(3)
    x = heavy_tailed(rng, (256, 256), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 384)) * 0.05, jnp.float32)
    xla = fp8jax.BlockwiseScaling(native_kernel=False)
    layer = fp8jax.Fp8DotGeneral(xla)

    def loss(args):
        layer, x, w = args
        y = layer(x, w, (((1,), (0,)), ((), ())))
        return jnp.sum(jnp.sin(y))

    step = fp8jax.filter_value_and_grad(loss)
    want = jax.jit(step)((layer, x, w))
    # The quantization on the kernels, the GEMMs on the XLA path: the interpreter's GEMM
    # sums in another order, which the GPU check compares against float64 instead.
    real_dot = fp8jax.BlockwiseScaling.dot

    def xla_dot(self, *args, **kwargs):
        return real_dot(xla, *args, **kwargs)

    context = quantize_config.quantize_slabs(32) if slabs else contextlib.nullcontext()
    with dispatch.interpreted(), pytest.MonkeyPatch.context() as patch, context:
        patch.setattr(fp8jax.BlockwiseScaling, "dot", xla_dot)
        args = (fp8jax.Fp8DotGeneral(fp8jax.BlockwiseScaling()), x, w)
        closed = jax.make_jaxpr(step)(args)
        got = jax.jit(step)(args)
    for kernel_name in KERNELS:
        assert kernel_name in str(closed)
    # Loops in the kernels' bodies only in slabs: the rows kernel's one, two (a first and
    # a second read) in the others.
    loops = dict(kernel_loops(closed.jaxpr))
    assert set(loops) == set(KERNELS)
    assert loops == {k: (1 if k.endswith("_rows") else 2) if slabs else 0 for k in KERNELS}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


@pytest.mark.skipif(deviceless.h100_topology() is None, reason="no CUDA plugin")
def test_h100_compile_quantizes_each_tensor_in_one_kernel():
    """A blockwise MLP step compiled for an H100: activations, gradients and weights are
    quantized by the one-pass kernels (IEEE division in their PTX, no spills), no FP8
    tensor is transposed by a kernel of its own (the kernels write the K-major copies), and
    no weight's block scales are expanded by one (its kernel writes them as the GEMMs read
    them)."""

    def step(w1, w2, x):
        def loss(w1, w2, x):
            l1 = fp8jax.Fp8DotGeneral(fp8jax.BlockwiseScaling())
            l2 = fp8jax.Fp8DotGeneral(fp8jax.BlockwiseScaling())
            dims = (((1,), (0,)), ((), ()))
            h = jax.nn.relu(l1(x, w1, dims).astype(jnp.bfloat16))
            return jnp.sum(l2(h, w2, dims).astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(w1, w2, x)

    spec = jax.ShapeDtypeStruct
    args = (
        spec((512, 1024), jnp.bfloat16),
        spec((1024, 512), jnp.bfloat16),
        spec((1024, 512), jnp.bfloat16),
    )
    lowered, _ = deviceless.lower(step, args, {}, deviceless.h100_topology().devices[0])
    with tempfile.TemporaryDirectory() as folder:
        compiled = lowered.compile(
            compiler_options={
                **fp8jax.gpu_compiler_options(),
                "xla_dump_to": folder,
                "xla_dump_emitter_re": "^ptx$",  # JAX 0.11+ dumps PTX only where asked
            }
        )
        files = glob.glob(f"{folder}/**/*.ptx", recursive=True)
        ptx = [text for text in map(read, files) if re.search(r"\.entry fp8jax_\w*quantize", text)]
    hlo = compiled.as_text()
    calls = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line]
    names = [re.search(r"(fp8jax_(?:re)?quantize_\w+)/pallas_call", c).group(1) for c in calls]
    # x and h in rows (forward), both gradients in rows and columns, x and h requantized.
    assert sorted(set(names)) == list(KERNELS)
    assert names.count("fp8jax_quantize_blocks") == 2  # one per weight: retile's call merged
    # IEEE division, as the CPU's XLA path (XLA's GPU fusions divide with div.full.f32).
    assert len(ptx) == 8  # x, h; both gradients (two tilings each); x, h requantized; w1, w2
    for text in ptx:
        assert "div.rn.f32" in text and "div.full.f32" not in text and ".local" not in text
    transpose_kernel = re.compile(r"^\s*%\S*transpose\S* = f8\w+\[[^\]]*\]\{[^}]*\} fusion\(")
    transposes = [line for line in hlo.splitlines() if transpose_kernel.search(line)]
    assert not transposes, transposes
    expand_kernel = re.compile(r"^\s*%\S*broadcast\S* = f32\[[^\]]*\]\{[^}]*\} fusion\(")
    expansions = [line for line in hlo.splitlines() if expand_kernel.search(line)]
    assert not expansions, expansions

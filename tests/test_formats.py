import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import E4M3, E5M2, ref_quantize
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fp8jax


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("e4m3", jnp.float8_e4m3fn),
        ("E4M3", jnp.float8_e4m3fn),
        ("float8_e4m3fn", jnp.float8_e4m3fn),
        ("e5m2", jnp.float8_e5m2),
        ("e4m3fnuz", jnp.float8_e4m3fnuz),
        ("e5m2fnuz", jnp.float8_e5m2fnuz),
        (jnp.float8_e5m2, jnp.float8_e5m2),
    ],
)
def test_fp8_dtype_names(name, dtype):
    assert fp8jax.fp8_dtype(name) == np.dtype(dtype)


@pytest.mark.parametrize("recipe", [fp8jax.CurrentScaling, fp8jax.DelayedScaling])
def test_ocp_and_fnuz_formats_are_not_mixed(recipe):
    """An OCP format for one role and AMD's fnuz for another built, then failed in the first
    backward GEMM (`dot_general` of e5m2fnuz and e5m2); refused where the recipe is made."""
    for forward, backward in [("e5m2", "e5m2fnuz"), ("e5m2fnuz", "e5m2"), ("e4m3", "e5m2fnuz")]:
        with pytest.raises(ValueError, match=rf"forward_format='{forward}' with backward_forma"):
            recipe(forward_format=forward, backward_format=backward)
    fnuz = recipe(forward_format="e4m3fnuz", backward_format="e5m2fnuz")
    d = fp8jax.Fp8DotGeneral(
        fp8jax.CurrentScaling(
            **{"forward_format": fnuz.forward_format, "backward_format": fnuz.backward_format}
        )
    )
    x, w = jnp.ones((4, 16)), jnp.ones((16, 8))
    grad = jax.grad(lambda x: d(x, w, (((1,), (0,)), ((), ()))).sum())(x)
    np.testing.assert_array_equal(grad, np.full((4, 16), 8.0))


@pytest.mark.parametrize(
    "fmt",
    ["e4m3", "e5m2", "E4M3FNUZ", "float8_e5m2fnuz", jnp.float8_e4m3fn, jnp.float8_e4m3fnuz],
)
def test_amd_format_is_the_formats_with_nan_where_minus_zero_would_be(fmt):
    """The one predicate that keeps AMD's fnuz formats off Hopper's wgmma, against the formats'
    own bits: fnuz ("finite, no negative zero") reads 0x80 as NaN, the OCP formats as -0."""
    from fp8jax._src.core.formats import amd_format

    minus_zero_bits = np.array(0x80, np.uint8).view(fp8jax.fp8_dtype(fmt))
    assert amd_format(fmt) == bool(np.isnan(minus_zero_bits.astype(np.float32)))


def test_fp8_max_matches_ml_dtypes():
    assert fp8jax.fp8_max("e4m3") == float(ml_dtypes.finfo(E4M3).max) == 448.0
    assert fp8jax.fp8_max("e5m2") == float(ml_dtypes.finfo(E5M2).max) == 57344.0


@pytest.mark.parametrize("bad", ["e4m4", "fp8", jnp.float32, jnp.bfloat16, "int8"])
def test_unknown_format_names_value_and_choices(bad):
    with pytest.raises(ValueError, match=r"Unknown FP8 format .*should be one of"):
        fp8jax.fp8_dtype(bad)


@pytest.mark.parametrize(
    "other", [jnp.float8_e3m4, jnp.float8_e8m0fnu, "float8_e4m3", jnp.float8_e4m3b11fnuz]
)
def test_other_8_bit_floats_are_refused_by_name_with_the_accepted_dtypes(other):
    """JAX's other 8-bit floats were "Unknown FP8 format <class ...>", told to pass "the
    matching jnp.float8_* dtype", which they are; refused by name, the accepted dtypes listed
    (`float8_e4m3`, IEEE-like, is not `float8_e4m3fn`)."""
    name = np.dtype(other).name
    accepted = r"float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz\)"
    with pytest.raises(ValueError, match=rf"^{name} is not an FP8 format .*{accepted}"):
        fp8jax.fp8_dtype(other)
    with pytest.raises(ValueError, match=rf"^{name} is not an FP8 format"):
        fp8jax.quantize(np.ones(2, np.float32), 1.0, other)


@pytest.mark.parametrize("fmt, dtype", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_quantize_rounds_like_ml_dtypes(fmt, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096).astype(np.float32) * 30
    for scale in (1.0, 3.7, 0.01):
        got = np.asarray(fp8jax.quantize(x, scale, fmt))
        assert got.dtype == dtype
        np.testing.assert_array_equal(
            got.astype(np.float32), ref_quantize(x, scale, fmt).astype(np.float32)
        )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_saturates_finite_values_and_passes_faults_on(fmt):
    limit = fp8jax.fp8_max(fmt)
    x = np.array([1e30, -1e30, 2 * limit, np.inf, -np.inf, np.nan], np.float32)
    got = np.asarray(fp8jax.quantize(x, 1.0, fmt)).astype(np.float32)
    np.testing.assert_array_equal(got[:3], [limit, -limit, limit])
    # An inf or NaN is a fault upstream: it becomes NaN (E4M3 has no inf), never the max.
    assert np.isnan(got[3:]).all()
    # A finite value whose scaled product overflows float32 is no fault: it saturates.
    assert float(np.asarray(fp8jax.quantize(np.float32(3e38), 10.0, fmt), np.float32)) == limit


def test_dequantize_inverts_scale():
    x = np.array([1.0, -2.5, 0.125], np.float32)
    q = fp8jax.quantize(x, 4.0, "e4m3")
    np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(q, 4.0)), x)


@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=64),
    st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
    st.sampled_from(["e4m3", "e5m2"]),
)
def test_quantize_of_finite_values_is_finite_and_nearest(values, scale, fmt):
    x = np.asarray(values, np.float32)
    q = np.asarray(fp8jax.quantize(x, scale, fmt)).astype(np.float64)
    assert np.all(np.isfinite(q))
    ref = ref_quantize(x, scale, fmt).astype(np.float64)
    np.testing.assert_array_equal(q, ref)


def test_widen_is_exact_for_every_bfloat16():
    """`widen` (integer shifts, kept by XLA) gives the float32 value of every BF16 bit
    pattern, as a plain cast does; NaNs stay NaN."""
    from fp8jax._src.core.formats import widen

    bits = np.arange(2**16, dtype=np.uint16)
    x = jnp.asarray(bits.view(ml_dtypes.bfloat16))
    got, want = np.asarray(widen(x)), np.asarray(x.astype(jnp.float32))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert widen(jnp.ones(3, jnp.float16)).dtype == jnp.float32


def test_floor_log2_is_exact_for_every_float32_magnitude():
    """`floor_log2` against float64 `log2`: powers of two and their neighbours over every
    normal float32, and inside `shard_map` (typed as its input: the bits path)."""
    from fp8jax._src.core.formats import floor_log2

    powers = np.float32(2.0) ** np.arange(-125, 128, dtype=np.float64).astype(np.float32)
    x = np.concatenate(
        [powers, np.nextafter(powers, np.float32(np.inf)), np.nextafter(powers, np.float32(0))]
    )
    x = x[(x > 0) & np.isfinite(x)].astype(np.float32)
    want = np.floor(np.log2(x.astype(np.float64))).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(floor_log2(jnp.asarray(x))), want)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.shard_map(
        lambda v: floor_log2(v) - 1, mesh=mesh, in_specs=P("d"), out_specs=P("d")
    )
    cut = x[: len(x) // 8 * 8]
    np.testing.assert_array_equal(np.asarray(sharded(jnp.asarray(cut))), want[: len(cut)] - 1)
    # The bits path reads a subnormal's exponent from its mantissa's highest set bit.
    tiny = (2.0 ** np.arange(-149, -126, dtype=np.float64)).astype(np.float32)
    tiny = np.concatenate([tiny, np.nextafter(tiny, np.float32(1)), [np.float32(2.0**-126)]])
    tiny = tiny[: len(tiny) // 8 * 8]
    want = np.floor(np.log2(tiny.astype(np.float64))).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(sharded(jnp.asarray(tiny))), want - 1)


@pytest.mark.parametrize("shape", [(8, 12), (4, 4), (3, 16, 8), (2, 2, 4, 20)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8])
def test_transpose_in_words_moves_every_byte_as_swapaxes(shape, dtype):
    """Every one of the 256 bit patterns (NaNs and negative zeros of the FP8 formats
    included) lands where `swapaxes` puts it, under `jit` as in a step, batch axes kept."""
    from fp8jax._src.core.formats import transpose_in_words

    size = int(np.prod(shape))
    bits = np.resize(np.random.default_rng(0).permutation(256), size).astype(np.uint8)
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits.reshape(shape)), dtype)
    got = jax.jit(transpose_in_words)(x)
    want = jnp.swapaxes(x, -1, -2)
    assert got.shape == want.shape and got.dtype == want.dtype
    as_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))  # noqa: E731
    np.testing.assert_array_equal(as_bits(got), as_bits(want))


def test_transpose_in_words_leaves_other_shapes_and_dtypes_to_swapaxes():
    from fp8jax._src.core.formats import transpose_in_words

    bools = jnp.asarray(np.random.default_rng(0).integers(0, 2, (2, 4, 8)), bool)
    for x in (jnp.zeros((6, 8), jnp.float8_e4m3fn), jnp.arange(32.0).reshape(4, 8), bools):
        np.testing.assert_array_equal(transpose_in_words(x), np.swapaxes(np.asarray(x), -1, -2))
        jaxpr = str(jax.make_jaxpr(transpose_in_words)(x))
        assert "bitcast_convert_type" not in jaxpr
    assert "bitcast_convert_type" in str(
        jax.make_jaxpr(transpose_in_words)(jnp.zeros((8, 8), jnp.float8_e4m3fn))
    )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_saturates_float64_beyond_float32_range(fmt):
    """Under `jax_enable_x64`, a finite float64 too large for float32 became inf in the
    float32 cast, then NaN (a "fault"); it saturates like any other finite value."""
    limit = fp8jax.fp8_max(fmt)
    x = np.array([1e300, -1e300, 1e39, 1.5, np.inf, np.nan], np.float64)
    with jax.enable_x64(True):
        for scale in (1.0, 1e-30):
            got = np.asarray(fp8jax.quantize(jnp.asarray(x), scale, fmt)).astype(np.float64)
            # float64 reference: the exact product, saturated, rounded by ml_dtypes.
            with np.errstate(invalid="ignore"):
                want = np.clip(x * scale, -limit, limit).astype({"e4m3": E4M3, "e5m2": E5M2}[fmt])
            want = np.where(np.isfinite(x), want.astype(np.float64), np.nan)
            np.testing.assert_array_equal(got, want)
    # Its amax is finite too (float32's max, as NumPy clips it), not inf: no fault is
    # reported, no state update rejected, for a value that quantize saturates.
    from fp8jax._src.core.amax import amax

    with jax.enable_x64(True):
        got = float(amax(jnp.asarray(x[:4]), jnp.zeros(())))
    assert got == float(np.clip(np.max(np.abs(x[:4])), 0, np.finfo(np.float32).max))
    # Without x64, a NumPy float64 (or a Python float) is cast to float32 on the way in.
    got = np.asarray(fp8jax.quantize(x, 1.0, fmt)).astype(np.float64)
    np.testing.assert_array_equal(got, [limit, -limit, limit, 1.5, np.nan, np.nan])
    assert float(np.asarray(fp8jax.quantize(1e300, 1.0, fmt), np.float64)) == limit


@pytest.mark.parametrize(
    "shape, scale_shape",
    [((3,), (4, 3)), ((3,), (3, 1, 1)), ((3,), (4,)), ((4, 6), (2, 3))],  # last: 2 x 2 blocks
)
def test_scale_that_does_not_broadcast_to_the_values_is_refused(shape, scale_shape):
    """A scale of shape (4, 3) broadcast `quantize(x (3,), ...)` to 12 values without a
    word; one of a wrong size failed in jnp's broadcasting, naming neither operand."""
    x, scale = np.ones(shape, np.float32), np.ones(scale_shape, np.float32)
    message = rf"scale of shape \({scale_shape[0]},.* the values' shape \({shape[0]},"
    with pytest.raises(ValueError, match=message):
        fp8jax.quantize(x, scale, "e4m3")
    with pytest.raises(ValueError, match=message):
        fp8jax.dequantize(x.astype(E4M3), scale)


def test_scales_that_broadcast_to_the_values_scale_each_value():
    """Per-row and per-column scales, against float64 NumPy broadcasting and ml_dtypes."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 6)) * 40).astype(np.float32)
    for scale in (np.float32(0.5), np.exp2(np.arange(4.0))[:, None], np.exp2(-np.arange(6.0))):
        scale = np.asarray(scale, np.float32)
        q = fp8jax.quantize(x, scale, "e4m3")
        assert q.shape == x.shape
        want = np.clip(x.astype(np.float64) * scale, -448, 448).astype(E4M3)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
        back = want.astype(np.float64) / scale
        np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(q, scale)), back)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn, "int8", jnp.bool_])
def test_dequantize_refuses_a_dtype_that_cannot_hold_the_values(dtype):
    """`dequantize(q, 4.0, jnp.int32)` truncated 0.375 to 0 without a word, an FP8 dtype
    rounded the values again; refused, naming the dtype and the accepted ones."""
    q = fp8jax.quantize(np.array([1.5, -0.5], np.float32), 4.0, "e4m3")
    with pytest.raises(ValueError, match=r"dequantize: dtype=.*; use float32"):
        fp8jax.dequantize(q, 4.0, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, "bf16"])
def test_dequantize_casts_to_the_floating_dtype_asked_for(dtype):
    x = np.array([1.5, -0.5, 100.0], np.float32)
    q = fp8jax.quantize(x, 4.0, "e4m3")
    got = fp8jax.dequantize(q, 4.0, dtype)
    want = (np.asarray(q).astype(np.float64) / 4.0).astype(np.dtype(got.dtype))
    assert got.dtype == ({"bf16": jnp.bfloat16}.get(dtype, dtype))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_qtensor_dequantize_scales_each_block_and_refuses_other_scale_shapes():
    """`QTensor.dequantize` against float64 NumPy, block by block (a ragged last block too);
    a `scale_inv` of one value per element (blocks (2, 2)) was repeated over 2 x 2 elements
    and cut, scaling the wrong values without a word."""
    rng = np.random.default_rng(2)
    data = (rng.standard_normal((5, 7)) * 50).astype(E4M3)
    scale_inv = np.exp2(rng.integers(-4, 4, (3, 4))).astype(np.float32)
    got = fp8jax.QTensor(jnp.asarray(data), jnp.asarray(scale_inv), (2, 2)).dequantize()
    rows, cols = np.indices(data.shape)
    want = data.astype(np.float64) * scale_inv[rows // 2, cols // 2]
    np.testing.assert_array_equal(np.asarray(got), want)
    for bad in [(5, 7), (2, 4), (1, 3, 4)]:
        q = fp8jax.QTensor(jnp.asarray(data), jnp.ones(bad), (2, 2))
        with pytest.raises(ValueError, match=rf"needs scale_inv of shape \(3, 4\).*not \({bad[0]}"):
            q.dequantize()
    with pytest.raises(ValueError, match=r"scale of shape \(2, 5, 7\) does not broadcast"):
        fp8jax.QTensor(jnp.asarray(data), jnp.ones((2, 5, 7))).dequantize()


@pytest.mark.parametrize("cols", [3, 5])
def test_qtensor_dequantize_scales_each_batch_member_by_its_own_scale(cols):
    """A per-tensor scale per batch member, `scale_inv (E,)` for `data (E, K, N)` (a grouped
    layer's kernel, quantized per expert), was broadcast over the last axis: N == E scaled
    column j by expert j's scale, any other N was refused. Against float64 NumPy."""
    data = (np.random.default_rng(3).standard_normal((3, 4, cols)) * 50).astype(E4M3)
    scale_inv = np.array([0.5, 2.0, 8.0], np.float32)
    got = fp8jax.QTensor(jnp.asarray(data), jnp.asarray(scale_inv)).dequantize()
    want = data.astype(np.float64) * scale_inv.astype(np.float64)[:, None, None]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("x_dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("fmt, dtype", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_gradient_through_quantize_is_as_documented(fmt, dtype, x_dtype):
    """The docstring's gradient: `scale * fp8(g / scale)` where `x * scale` is in range (the
    cotangent of an FP8 array is FP8), 0 where it saturates; the documented straight-through
    form gives the float32 cotangent itself. In `x`'s dtype, BF16's too (widened by bit
    shifts, which alone would pass no gradient)."""
    scale = np.float32(4.0)
    x = jnp.asarray(np.array([1.0, -2.0, 0.5, 3.0, 3e4]), x_dtype)  # the last saturates
    g = np.array([0.1001, 3.3, 1e-12, 1e9, 5.0], np.float32)  # 1e-12 underflows, 1e9 overflows

    def loss(x, quantized):
        y = fp8jax.dequantize(fp8jax.quantize(x, scale, fmt), scale)
        y = y if quantized else x + jax.lax.stop_gradient(y - x)
        return jnp.sum(y * g)

    got = np.asarray(jax.grad(loss)(x, True)).astype(np.float64)
    want = (scale * (g / scale).astype(dtype).astype(np.float64)).astype(x_dtype)
    np.testing.assert_array_equal(got[:3], want[:3].astype(np.float64))
    assert got[1] != g[1] and got[2] == 0.0  # rounded; below the smallest subnormal
    assert not got[3] == g[3]  # past the format's max: no usable gradient
    assert got[4] == 0.0  # saturated
    with np.errstate(over="ignore"):  # float16's: 1e9 is inf
        g_in_x_dtype = g.astype(x_dtype)
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x, False)), g_in_x_dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_float64_next_to_a_midpoint_rounds_to_the_nearest_fp8_value(fmt):
    """A float64 just past a midpoint of the format (`1.0625 + 1e-12` in E4M3) rounded to
    float32's midpoint first, then to even: the FP8 value on the wrong side. ml_dtypes
    rounds the float64 itself, from NumPy (cast to float32 on the way in) and under x64."""
    dtype = fp8jax.fp8_dtype(fmt)
    grid = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64))
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([mids + np.abs(mids) * 2.0**-40, mids - np.abs(mids) * 2.0**-40, grid])
    # Not those that round to zero: XLA:CPU's elemental emitters (conftest's flags, JAX 0.10)
    # turn a negative one into fnuz's NaN (0x80), with or without float64.
    x = x[np.abs(x) > 2 * float(jnp.finfo(dtype).smallest_subnormal)]
    for scale in (1.0, 0.5):
        want = (x * scale).astype(dtype).view(np.uint8)
        got = np.asarray(fp8jax.quantize(x, scale, fmt)).view(np.uint8)
        np.testing.assert_array_equal(got, want)
        with jax.enable_x64(True):
            quantize = jax.jit(lambda v: fp8jax.quantize(v, scale, fmt))  # noqa: B023
            got = np.asarray(quantize(jnp.asarray(x))).view(np.uint8)
        np.testing.assert_array_equal(got, want)


def test_integer_and_long_double_values_saturate_and_complex_values_are_refused():
    """A NumPy int64 of 2**40 became 0 (JAX holds it as int32, wrapped), and `1 + 2j` became 1
    (the imaginary part dropped without a word)."""
    x = np.array([2**40, 3, -(2**33), 7], np.int64)
    want = np.clip(x.astype(np.float64), -57344.0, 57344.0).astype(E5M2).astype(np.float64)
    got = np.asarray(fp8jax.quantize(x, 1.0, "e5m2")).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    for z in (np.array([1 + 2j], np.complex64), jnp.array([1 + 2j])):
        with pytest.raises(ValueError, match="x of dtype complex64 has no FP8 value"):
            fp8jax.quantize(z, 1.0, "e5m2")
    with pytest.raises(ValueError, match="x of dtype <U1 has no FP8 value"):
        fp8jax.quantize(np.array(["a"]), 1.0, "e5m2")  # was a TypeError of JAX's "stage"
    # NumPy's long double, which JAX has no arrays of (a TypeError too), rounds as float64 does.
    wide = np.array([1.0625 + 2.0**-40, 1e300, -3.0], np.longdouble)
    want = np.clip(wide.astype(np.float64), -57344, 57344).astype(E5M2).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(fp8jax.quantize(wide, 1.0, "e5m2"), np.float64), want)

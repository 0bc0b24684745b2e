"""An expert layer's gathered 128 x 1 tiles on TMA and the tensor cores
(`kernels.tensor_core_gathered`, Mosaic GPU; the output gradient's from 16 bits, the saved
activation's from its FP8 tiles): as an independent NumPy gather-and-quantize in Mosaic
GPU's interpreter (JAX 0.11 on: the GPU's own code; bit for bit but a NaN's payload and
a transposed zero's sign, a NaN's row as documented), the padded layout's tiles read off its
row map, inside the blockwise recipe as its Triton kernels, bad input refused by name, and
one Mosaic GPU kernel, counted as quantization, in an H100 compile."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_padded_quantize import heavy_tailed, np_columns, np_rows, row_map
from test_tensor_core_transpose import nan_rows_across_tiles, needs_interpreter, same, same_bits

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.gemm.grouped_native import gather_map, pad_layout
from fp8jax._src.kernels import (
    TENSOR_CORE_BLOCKS_NAME,
    TENSOR_CORE_BOTH_PADDED_NAME,
    TENSOR_CORE_PADDED_NAME,
    TENSOR_CORE_REQUANTIZE_PADDED_NAME,
    TENSOR_CORE_ROWS_NAME,
    dispatch,
)
from fp8jax._src.kernels.choice import tensor_core_quantization
from fp8jax._src.kernels.tensor_core_gathered import (
    padded_tiles,
    tensor_core_quantize_padded_columns,
    tensor_core_quantize_rows_and_padded_columns,
    tensor_core_requantize_padded_columns,
)
from fp8jax._src.kernels.tensor_core_tiles import TransposeConfig
from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def test_padded_tiles_read_each_tiles_first_row_and_rows_off_the_row_map():
    """An expert's tiles start at its rows' first and run consecutively; its last tile holds
    the rest; tiles of gaps hold none, their windows after the experts' rows."""
    start, count = padded_tiles(jnp.asarray(row_map((300, 0, 130, 5), 128)))
    assert start.tolist()[:6] == [0, 128, 256, 300, 428, 430] and start.dtype == jnp.int32
    assert count.tolist()[:6] == [128, 128, 44, 128, 2, 5]
    # Tiles of gaps: windows of 128 rows from the experts' end (the rows past theirs).
    gaps = len(count) - 6
    assert gaps > 0 and set(count.tolist()[6:]) == {0}
    assert start.tolist()[6:] == [435 + 128 * i for i in range(gaps)]


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * NaN, as said
@pytest.mark.parametrize(
    "sizes, past, dtype, fmt, power_of_two, config",
    [
        # Programs of 3 tiles across tiles and experts; an expert without rows; a tile past
        # x's end (TMA's zeros).
        ((300, 0, 130, 270), 0, jnp.bfloat16, E4M3, False, TransposeConfig(max_programs=3)),
        # Rows past the experts' (never gathered); float16, power-of-two scales, a program a
        # tile.
        ((70, 0, 130, 5), 100, jnp.float16, E5M2, True, TransposeConfig(max_programs=1000)),
    ],
)
def test_gathered_columns_quantize_as_numpy(sizes, past, dtype, fmt, power_of_two, config):
    """Each padded tile's rows of `x` (an expert's, from any row), in 128 x 1 tiles
    transposed, and their scales equal an independent NumPy gather and quantization, bit for
    bit but a NaN's payload, with a non-finite value's row NaN as documented."""
    rng = np.random.default_rng(sum(sizes) + past)
    m = sum(sizes) + past
    x = jnp.asarray(heavy_tailed(rng, (m, 256))).astype(dtype)  # a NaN and an inf among rows
    rows = gather_map(pad_layout(jnp.asarray(sizes), m, 128))
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two)
    got = tensor_core_quantize_padded_columns(
        x, *padded_tiles(rows), fmt, **rule, config=config, interpret=True
    )
    host, rows_np = np.asarray(x, np.float32), np.asarray(rows)
    gathered = np.where((rows_np >= 0)[:, None], host[np.maximum(rows_np, 0)], 0)
    # As the tensor cores transpose it: a gathered row holding a NaN or an inf NaN whole
    # within its 128 columns (`0 * NaN` in the `wgmma`), those columns then at scale 1.
    gathered = nan_rows_across_tiles(gathered.astype(np.float32))
    padded = np.arange(len(rows_np))
    want_t, want_scales = np_columns(gathered, padded, fmt, 128, power_of_two)
    same(got[0], want_t)
    same_bits(got[1], want_scales)
    assert np.isnan(np.asarray(got[0], np.float32)).any()  # the NaN and the inf gathered


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * NaN, as said
@pytest.mark.parametrize(
    "sizes, past, dtype, fmt, power_of_two, config",
    [
        # Programs of 3 tiles across tiles and experts; an expert without rows.
        ((300, 0, 130, 270), 0, jnp.bfloat16, E4M3, False, TransposeConfig(max_programs=3)),
        # 303 rows past the experts' (three tiles of gaps cover them); a program a tile.
        ((70, 0, 130, 5), 303, jnp.float16, E5M2, True, TransposeConfig(max_programs=1000)),
    ],
)
def test_rows_and_gathered_columns_from_one_read_are_numpy(
    sizes, past, dtype, fmt, power_of_two, config
):
    """The output gradient's rows copy of every row of `x` (the tiles' windows, past the
    experts' too), its scales and amax, and its gathered columns equal an independent
    NumPy quantization of `x` and of its gathered copy, bit for bit but a NaN's payload (the
    columns' NaN rows as documented)."""
    rng = np.random.default_rng(sum(sizes) + past + 1)
    m = sum(sizes) + past
    x = jnp.asarray(heavy_tailed(rng, (m, 256))).astype(dtype)  # a NaN and an inf among rows
    rows = gather_map(pad_layout(jnp.asarray(sizes), m, 128))
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two, config=config, interpret=True)
    got = tensor_core_quantize_rows_and_padded_columns(x, *padded_tiles(rows), fmt, **rule)
    host, rows_np = np.asarray(x, np.float32), np.asarray(rows)
    want_data, want_scale_t = np_rows(host, fmt, 128, power_of_two)
    same_bits(got[0], want_data)
    same_bits(got[1], want_scale_t)
    assert np.isnan(float(jnp.max(got[2])))  # the NaN's row: max |x| is NaN
    finite = np.where(np.isfinite(host), host, 0)
    got_finite = tensor_core_quantize_rows_and_padded_columns(
        jnp.asarray(finite, dtype), *padded_tiles(rows), fmt, **rule
    )
    assert float(jnp.max(got_finite[2])) == np.max(np.abs(finite))
    gathered = np.where((rows_np >= 0)[:, None], host[np.maximum(rows_np, 0)], 0)
    gathered = nan_rows_across_tiles(gathered.astype(np.float32))
    want_t, want_scales = np_columns(gathered, np.arange(len(rows_np)), fmt, 128, power_of_two)
    same(got[3], want_t)
    same_bits(got[4], want_scales)


def saved_activation(rng, m, k, fmt):
    """An FP8 activation `(m, k)` in 1 x 128 tiles at scales that are not powers of two
    (their products round), with a NaN (E4M3) or an inf (E5M2) in row 1, and its
    chunk-major `scale_inv_t (k / 128, m)`."""
    from test_block_quantize import heavy_tailed as finite_heavy_tailed

    x = np.asarray(finite_heavy_tailed(rng, (m, k)), np.float32)
    amax = np.abs(x).reshape(m, k // 128, 128).max(-1)
    spread = rng.uniform(1, 1.1, amax.shape)
    scale_inv = (np.where(amax > 0, amax, 1) / 400 * spread).astype(np.float32)
    data = (x / np.repeat(scale_inv, 128, axis=1)).astype(fmt)
    data[1, 3] = np.nan if fmt == E4M3 else np.inf
    return data, scale_inv.T.copy()


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * NaN, as said
@pytest.mark.parametrize(
    "sizes, past, fmt, power_of_two, config",
    [
        # Programs of 3 tiles across tiles and experts; an expert without rows; the last
        # expert's tile past the activation's end (TMA's zeros).
        ((300, 0, 130, 270), 0, E4M3, False, TransposeConfig(max_programs=3)),
        # Rows past the experts' (never gathered; NaN data and scales there); power-of-two
        # scales, a program a tile.
        ((70, 0, 130, 5), 103, E5M2, True, TransposeConfig(max_programs=1000)),
    ],
)
def test_gathered_requantization_is_numpy(sizes, past, fmt, power_of_two, config):
    """A saved FP8 activation's padded tiles (an expert's rows, from any row, dequantized at
    their rows' scales), requantized in 128 x 1 tiles transposed, equal an independent
    NumPy gather, float32 product and quantization, bit for bit but a NaN's payload, a
    non-finite value's row NaN as documented; rows and scales not gathered reach no
    output."""
    rng = np.random.default_rng(sum(sizes) + past)
    m = sum(sizes) + past
    data, scale_inv_t = saved_activation(rng, m, 256, fmt)
    if past:
        data[-past:], scale_inv_t[:, -past:] = np.nan, np.nan
    rows = gather_map(pad_layout(jnp.asarray(sizes), m, 128))
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two, config=config, interpret=True)
    tiles = padded_tiles(rows)
    got = tensor_core_requantize_padded_columns(
        jnp.asarray(data), jnp.asarray(scale_inv_t), *tiles, **rule
    )
    real = data.astype(np.float32) * np.repeat(scale_inv_t.T, 128, axis=1)
    rows_np = np.asarray(rows)
    gathered = np.where((rows_np >= 0)[:, None], real[np.maximum(rows_np, 0)], 0)
    gathered = nan_rows_across_tiles(gathered.astype(np.float32))
    want_t, want_scales = np_columns(gathered, np.arange(len(rows_np)), fmt, 128, power_of_two)
    same(got[0], want_t)
    same_bits(got[1], want_scales)
    assert np.isnan(np.asarray(got[0], np.float32)).any()  # row 1's NaN or inf, gathered


@needs_interpreter
@pytest.mark.parametrize("both", [True, False], ids=["rows and gathered columns", "gathered"])
def test_blockwise_expert_gradients_on_the_tensor_cores_are_the_triton_kernels(both):
    """Inside `tensor_core_quantization()` an expert layer's output gradient (its rows copy,
    gathered columns copy and new state; or the gathered columns alone) equals the Triton
    kernel's, through one Mosaic GPU kernel; outside it, the Triton kernel, once."""
    from test_block_quantize import heavy_tailed as finite_heavy_tailed

    rng = np.random.default_rng(41)
    m = 388  # rows past the experts' 205 (the rows copy covers them), no whole 128-row tiles
    x = finite_heavy_tailed(rng, (m, 256))
    rows = gather_map(pad_layout(jnp.asarray([70, 0, 130, 5]), m, 128))
    recipe = fp8jax.BlockwiseScaling(power_of_two=True)
    state = recipe.init_state("output_grad")

    def quantized(x, rows):
        if both:
            return recipe.quantize_both_gathered(x, rows, state, "output_grad")
        return recipe.quantize_gathered(x, rows, "output_grad")

    with dispatch.interpreted():  # a new function for each trace: jit's cache has no context
        want_jaxpr = str(jax.make_jaxpr(lambda *a: quantized(*a))(x, rows))
        want = jax.jit(lambda *a: quantized(*a))(x, rows)
        with tensor_core_quantization():
            jaxpr = str(jax.make_jaxpr(lambda *a: quantized(*a))(x, rows))
            got = jax.jit(lambda *a: quantized(*a))(x, rows)
    triton = "fp8jax_quantize_rows_and_padded_columns" if both else "fp8jax_quantize_padded"
    assert want_jaxpr.count(f"name={triton}") == 1 and "tensor_core" not in want_jaxpr
    mosaic = TENSOR_CORE_BOTH_PADDED_NAME if both else TENSOR_CORE_PADDED_NAME
    assert jaxpr.count(f"name={mosaic}") == 1 and jaxpr.count("name=fp8jax_") == 1, jaxpr
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same_bits(a, b)


@needs_interpreter
def test_blockwise_expert_activation_on_the_tensor_cores_is_the_triton_kernel():
    """Inside `tensor_core_quantization()` an expert layer's saved activation, gathered for
    the wgrad (`retile_gathered`), equals the Triton kernel's, through the Mosaic GPU
    kernel; outside it, the Triton kernel."""
    rng = np.random.default_rng(43)
    m = 388  # rows past the experts' 205, not whole 128-row tiles
    data, scale_inv_t = saved_activation(rng, m, 256, E4M3)
    data[1, 3] = 1.0  # finite: the Triton kernel's NaN would stay in its column
    q = fp8jax.QTensor(jnp.asarray(data), jnp.asarray(scale_inv_t.T), (1, 128))
    rows = gather_map(pad_layout(jnp.asarray([70, 0, 130, 5]), m, 128))
    recipe = fp8jax.BlockwiseScaling()

    def retiled(q, rows):
        return recipe.retile_gathered(q, rows, "input")

    with dispatch.interpreted():  # a new function for each trace: jit's cache has no context
        want_jaxpr = str(jax.make_jaxpr(lambda *a: retiled(*a))(q, rows))
        want = jax.jit(lambda *a: retiled(*a))(q, rows)
        with tensor_core_quantization():
            jaxpr = str(jax.make_jaxpr(lambda *a: retiled(*a))(q, rows))
            got = jax.jit(lambda *a: retiled(*a))(q, rows)
    assert want_jaxpr.count("name=fp8jax_requantize_padded_columns") == 1
    assert "tensor_core" not in want_jaxpr
    assert jaxpr.count(f"name={TENSOR_CORE_REQUANTIZE_PADDED_NAME}") == 1, jaxpr
    assert "name=fp8jax_requantize" not in jaxpr
    assert tuple(got.block) == tuple(want.block)
    same(got.data, want.data)  # in value: the saved tiles' -0s may come out +0
    same_bits(got.scale_inv, want.scale_inv)


@needs_interpreter
def test_blockwise_expert_layer_on_the_tensor_cores_trains_as_on_the_triton_kernels():
    """A BF16 blockwise `Fp8RaggedDot` (GEMMs on the XLA path) traced inside
    `tensor_core_quantization()` quantizes every operand on the Mosaic GPU kernels (the
    experts' weights in one kernel, the activation's rows, the output gradient's two copies
    from one read, the saved activation gathered) and no Triton kernel; its value,
    gradients and new state equal the step on the Triton kernels', in value (a transposed
    -0 may come out +0), the expert without tokens included."""
    rng = np.random.default_rng(12)
    sizes = jnp.array([70, 0, 130, 56], jnp.int32)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 256, 256)) * 0.05, jnp.bfloat16)
    dot = fp8jax.Fp8RaggedDot(fp8jax.BlockwiseScaling(), num_experts=4, native_kernel=False)

    def loss(args):
        dot, x, w = args
        return jnp.sum(jnp.sin(dot(x, w, sizes).astype(jnp.float32)))

    def traced():
        step = fp8jax.filter_value_and_grad(lambda a: loss(a))
        kernels = re.findall(r"name=(fp8jax_\w+)", str(jax.make_jaxpr(step)((dot, x, w))))
        return jax.jit(step)((dot, x, w)), {k for k in kernels if "quantize" in k}

    with dispatch.interpreted():
        want, triton = traced()
        with tensor_core_quantization():
            got, kernels = traced()
    assert triton == {f"fp8jax_{k}" for k in ("quantize_blocks", "quantize_rows")} | {
        f"fp8jax_{k}_padded_columns" for k in ("quantize_rows_and", "requantize")
    }, triton
    assert kernels == {
        TENSOR_CORE_BLOCKS_NAME,
        TENSOR_CORE_ROWS_NAME,
        TENSOR_CORE_BOTH_PADDED_NAME,
        TENSOR_CORE_REQUANTIZE_PADDED_NAME,
    }, kernels
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)
    np.testing.assert_array_equal(np.asarray(got[1][2][1], np.float32), 0.0)  # no tokens


def test_bad_input_is_refused_by_name():
    x = jnp.ones((256, 384), jnp.bfloat16)
    start, count = jnp.zeros((3,), jnp.int32), jnp.full((3,), 128, jnp.int32)
    call = tensor_core_quantize_padded_columns
    rule = dict(max_scale=MAX_SCALE, interpret=False)
    cases = [
        (lambda: call(x, start, count, E4M3, block=64, **rule), "block=64"),
        (lambda: call(x[:, :300], start, count, E4M3, **rule), r"\(256, 300\)"),
        (lambda: call(x[:100], start, count, E4M3, **rule), r"\(100, 384\)"),
        (lambda: call(x.astype(jnp.float32), start, count, E4M3, **rule), "float32"),
        (lambda: call(x, start, count, jnp.bfloat16, **rule), "fmt="),
        (lambda: call(x, start, count[:2], E4M3, **rule), r"start \(3,\) and count \(2,\)"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=TENSOR_CORE_PADDED_NAME + ".*" + match):
            fn()
    with pytest.raises(TypeError, match="config=3"):
        call(x, start, count, E4M3, config=3, **rule)
    data, scale_t = x.astype(E4M3), jnp.ones((3, 256))
    call = tensor_core_requantize_padded_columns
    cases = [
        (lambda: call(data, scale_t, start, count, block=64, **rule), "block=64"),
        (lambda: call(x, scale_t, start, count, **rule), "bfloat16"),
        (lambda: call(data, scale_t[:2], start, count, **rule), r"\(2, 256\).*\(3, 256\)"),
        (lambda: call(data[:130], scale_t[:, :130], start, count, **rule), "multiple of 4"),
        (lambda: call(data, scale_t, start[:1], count, **rule), r"start \(1,\)"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=TENSOR_CORE_REQUANTIZE_PADDED_NAME + ".*" + match):
            fn()


def _gathered(x, start, count):
    return tensor_core_quantize_padded_columns(
        x, start, count, E4M3, max_scale=MAX_SCALE, interpret=False
    )


def _both(x, start, count):
    return tensor_core_quantize_rows_and_padded_columns(
        x, start, count, E4M3, max_scale=MAX_SCALE, interpret=False
    )


def _requantized(data, scale_t, start, count):
    return tensor_core_requantize_padded_columns(
        data, scale_t, start, count, max_scale=MAX_SCALE, interpret=False
    )


@pytest.mark.parametrize(
    "name, kernel, operands, divisions",
    [
        (TENSOR_CORE_PADDED_NAME, _gathered, [((700, 256), jnp.bfloat16)], 8),
        (
            TENSOR_CORE_REQUANTIZE_PADDED_NAME,
            _requantized,
            [((700, 256), E4M3), ((2, 700), None)],
            8,
        ),
        # The rows' scales too.
        (TENSOR_CORE_BOTH_PADDED_NAME, _both, [((700, 256), jnp.bfloat16)], 16),
    ],
    ids=["gathered", "requantized", "rows and gathered"],
)
def test_h100_compile_runs_one_mosaic_kernel_counted_as_quantization(
    name, kernel, operands, divisions, tmp_path, monkeypatch
):
    """For an H100 (deviceless): one Mosaic GPU call by the kernel's name, counted by
    `fp8jax.hlo_cost` as quantization; the scales divided exactly rounded (`div.rn.f32`),
    no spills. JAX 0.10, whose Mosaic GPU cannot compile it, refuses it by name."""
    from helpers import h100_topology

    from fp8jax._src.observe import deviceless

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    specs = tuple(jax.ShapeDtypeStruct(shape, dtype or jnp.float32) for shape, dtype in operands)
    specs += (jax.ShapeDtypeStruct((10,), jnp.int32),) * 2
    device = h100_topology().devices[0]
    if not mosaic_private.untiled_wgmma_loads():  # JAX 0.10: refused by name
        with pytest.raises(NotImplementedError, match=name + ".*JAX 0.11"):
            deviceless.lower(kernel, specs, {}, device)
        return
    lowered, _ = deviceless.lower(kernel, specs, {}, device)
    hlo = lowered.compile(fp8jax.gpu_compiler_options()).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call_target=" in line]
    assert len(calls) == 1 and name in calls[0], calls
    cost = fp8jax.hlo_cost(hlo)
    assert set(cost.bytes) == {"quantize"} and cost.bytes["quantize"] >= 700 * 256
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert collections.Counter(re.findall(r"\bdiv\.[\w.]+", ptx)) == {"div.rn.f32": divisions}
    ptxas = "".join(p.read_text() for p in tmp_path.glob("*.ptxas"))
    assert re.findall(r"(\d+) bytes spill", ptxas) == ["0", "0"], ptxas


def test_gathered_tiles_take_the_tensor_cores_only_where_documented(monkeypatch):
    """`choice.gathers_on_tensor_cores`, by the documented rule: inside
    `tensor_core_quantization()`, a 16-bit `x` (or the types given) of at least 128 rows, a
    multiple of 4, block 128, on a JAX whose Mosaic GPU compiles the kernels."""
    from fp8jax._src.core import mosaic_private
    from fp8jax._src.kernels import choice

    monkeypatch.setattr(mosaic_private, "untiled_wgmma_loads", lambda: True)

    def takes(rows, dtype=jnp.bfloat16, block=128, *types):
        x = jax.ShapeDtypeStruct((rows, 256), dtype)
        return choice.gathers_on_tensor_cores(x, block, *types)

    assert not takes(128)  # outside the context
    with tensor_core_quantization():
        assert takes(128) and takes(132) and takes(256, jnp.float16)
        assert not takes(124) and not takes(130) and not takes(256, block=64)
        assert not takes(256, jnp.float32) and not takes(256, jnp.float8_e4m3fn)
        assert takes(256, jnp.float8_e4m3fn, 128, (jnp.dtype(jnp.float8_e4m3fn),))
        monkeypatch.setattr(mosaic_private, "untiled_wgmma_loads", lambda: False)
        assert not takes(128)

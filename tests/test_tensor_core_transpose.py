"""FP8 quantization in one pass on TMA and the tensor cores (`kernels.tensor_core_transpose`,
Mosaic GPU), per tensor and in DeepSeek-V3's 1 x 128 and 128 x 1 tiles: as NumPy in Mosaic
GPU's interpreter (JAX 0.11 on: the GPU's own code, `wgmma` on the transposed view; bit for
bit but a NaN's payload and, in the transposed copy, a zero's sign), a NaN's row as
documented, inside a per-tensor recipe's step and the blockwise recipe's quantization as
their XLA paths, bad input refused by name, and one Mosaic GPU kernel, counted as
quantization, in an H100 compile."""

import collections
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_cast_transpose import E4M3, E5M2, np_cast, operand, same

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import (
    TENSOR_CORE_BLOCKS_NAME,
    TENSOR_CORE_REQUANTIZE_NAME,
    TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
    TENSOR_CORE_ROWS_NAME,
    TENSOR_CORE_TRANSPOSE_NAME,
    dispatch,
)
from fp8jax._src.kernels.choice import tensor_core_quantization
from fp8jax._src.kernels.tensor_core_blocks import (
    tensor_core_quantize_blocks,
    tensor_core_quantize_rows,
    tensor_core_quantize_rows_and_columns,
    tensor_core_requantize_columns,
)
from fp8jax._src.kernels.tensor_core_transpose import (
    TransposeConfig,
    stages,
    tensor_core_cast_transpose,
    tiles_per_program,
)
from fp8jax._src.recipes.per_tensor import skip_warm_start
from fp8jax._src.recipes.per_tensor_pass import cast_transpose_kernel

needs_interpreter = pytest.mark.skipif(
    not mosaic_private.interpreter_runs_gpu_path(),
    reason="this JAX's Mosaic GPU interpreter cannot run wgmma on a transposed view",
)


def transposed_with_nan_rows(q: np.ndarray) -> np.ndarray:
    """`q.T` (float32) as the kernel writes it: within each 128 x 128 tile, a row of `q`
    holding a NaN is NaN whole in the transposed tile (`0 * NaN` in the `wgmma`)."""
    t = np.asarray(q, np.float32).T.copy()
    rows, cols = q.shape
    for c in range(0, cols, 128):
        bad = np.isnan(np.asarray(q[:, c : c + 128], np.float32)).any(axis=1)
        t[c : c + 128, bad] = np.nan
    return t


@needs_interpreter
@pytest.mark.parametrize(
    "shape, dtype, fmt, scale, config",
    [
        # Programs of 3 tiles that cross a row of tiles; inf, NaN and values past E4M3's max.
        ((384, 256), jnp.bfloat16, E4M3, 0.37, TransposeConfig(max_programs=2)),
        # A batch axis, float32 in (two stages fit), a program per tile.
        ((2, 256, 256), jnp.float32, E5M2, 3.1e3, TransposeConfig(max_concurrent_steps=4)),
    ],
)
def test_kernel_casts_as_numpy(shape, dtype, fmt, scale, config):
    """The FP8 copy equals a NumPy cast element for element (in value: a -0 may come out +0
    in the transposed copy, `-0 + 0` in the `wgmma`); the transposed copy too, but where a
    row of a tile holds a NaN (the cast of an inf or a NaN); the partial amaxes' maximum is
    `max |x|` (NaN with a NaN)."""
    rng = np.random.default_rng(3)
    x = np.asarray(operand(rng, (int(np.prod(shape[:-1])), shape[-1])), np.float32)
    x = jnp.asarray(x.reshape(shape), dtype)
    data, data_t, amax = tensor_core_cast_transpose(
        x, jnp.float32(scale), fmt, config=config, interpret=True
    )
    assert data.dtype == data_t.dtype == fmt and amax.shape[1] == 128
    for b in range(x.shape[0] if x.ndim == 3 else 1):
        xb = np.asarray(x[b] if x.ndim == 3 else x, np.float32)
        want = np_cast(xb, scale, fmt)
        same(data[b] if x.ndim == 3 else data, want)
        same(data_t[b] if x.ndim == 3 else data_t, transposed_with_nan_rows(want))
    assert np.isnan(np.max(np.asarray(amax)))
    finite = jnp.where(jnp.isfinite(x), x, 0)
    _, _, amax = tensor_core_cast_transpose(finite, jnp.float32(scale), fmt, interpret=True)
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(finite.astype(jnp.float32))))


@needs_interpreter
@pytest.mark.parametrize("case", ["steady state", "current"])
def test_a_per_tensor_step_on_the_kernel_is_its_xla_path(case):
    """Inside `cast_transpose_kernel(on_tensor_cores=True)` a delayed-scaling step in the
    steady state (the amax from the kernel) and a current-scaling one (the amax first, by
    XLA) give the value, gradients and states of XLA's path (in value), through one kernel
    call per operand."""
    from test_cast_transpose import _step

    rng = np.random.default_rng(5)
    x = np.asarray(operand(rng, (256, 384)), np.float32)
    x[-1, 0], x[128, 129] = 1e4, 3.0  # finite: values past E4M3's max saturate
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((384, 128)) * 0.05, jnp.bfloat16)
    recipe = fp8jax.DelayedScaling() if case == "steady state" else fp8jax.CurrentScaling()
    layer = fp8jax.Fp8DotGeneral(recipe)
    layer = jax.tree.map(lambda s: jnp.full_like(s, 0.125) if s.ndim == 0 else s + 1.0, layer)

    def context():
        steady = case == "steady state"
        return skip_warm_start(recorded=True) if steady else contextlib.nullcontext()

    with context():
        want = jax.jit(_step())((layer, x, w))
    step = _step()
    with dispatch.interpreted(), cast_transpose_kernel(on_tensor_cores=True), context():
        jaxpr = str(jax.make_jaxpr(step)((layer, x, w)))
        assert jaxpr.count(f"name={TENSOR_CORE_TRANSPOSE_NAME}") == 3
        got = jax.jit(step)((layer, x, w))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


def nan_rows_across_tiles(x: np.ndarray) -> np.ndarray:
    """`x` (float32) as the tensor cores transpose it: within each 128 x 128 tile, a row
    holding a NaN or an inf is NaN whole (`0 * NaN`, `0 * inf` in the `wgmma`)."""
    x = x.copy()
    for c in range(0, x.shape[1], 128):
        x[~np.isfinite(x[:, c : c + 128]).all(axis=1), c : c + 128] = np.nan
    return x


def same_bits(got, want) -> None:
    """Equal values (NaN where the other has NaN) and equal bits where finite (a NaN's
    payload may differ)."""
    same(got, want)
    got, want = np.asarray(got), np.asarray(want)
    finite = np.isfinite(want.astype(np.float32))
    view = np.uint8 if want.dtype.itemsize == 1 else np.uint32
    np.testing.assert_array_equal(got.view(view)[finite], want.view(view)[finite])


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * inf, as said
@pytest.mark.parametrize(
    "shape, dtype, fmt, power_of_two, config",
    [
        # Programs of 3 tiles that cross a row of tiles; inf, NaN and values past E4M3's max.
        ((384, 256), jnp.bfloat16, E4M3, False, TransposeConfig(max_programs=2)),
        # A batch axis, float16 in (1e30 an inf there), power-of-two scales, 3 stages fit.
        ((2, 256, 384), jnp.float16, E5M2, True, TransposeConfig(max_concurrent_steps=4)),
    ],
)
def test_rows_and_columns_quantize_as_numpy(shape, dtype, fmt, power_of_two, config):
    """The 1 x 128 tiles (FP8 bits and scales; also from `tensor_core_quantize_rows`, of
    `x` and of `x` in float32) equal an independent NumPy quantization
    (`test_block_quantize.np_reference_rows`); the 128 x 1 tiles, transposed, too, but where
    a row of a 128 x 128 tile holds a NaN or an inf (then NaN whole in that tile, as the
    module documents); the partial amaxes' maximum is `max |x|` (NaN with a NaN)."""
    from test_block_quantize import MAX_SCALE, np_reference_rows

    rng = np.random.default_rng(11)
    x = np.asarray(operand(rng, (int(np.prod(shape[:-1])), shape[-1])), np.float32)
    x = jnp.asarray(x.reshape(shape)).astype(dtype)  # in float16, 1e30 becomes inf
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two)
    data, scale_t, amax, data_t, cols = tensor_core_quantize_rows_and_columns(
        x, fmt, **rule, config=config, interpret=True
    )
    assert data.dtype == data_t.dtype == fmt and amax.shape[1] == 128
    # The rows alone (on TMA, no tensor cores), as float32 too: the same rows.
    rows_only = [
        tensor_core_quantize_rows(v, fmt, **rule, config=config, interpret=True)
        for v in (x, x.astype(jnp.float32))
    ]
    for b in range(x.shape[0] if x.ndim == 3 else 1):
        at = (b,) if x.ndim == 3 else ()
        xb = np.asarray(x[at], np.float32)
        want, want_scale_t, _ = np_reference_rows(xb, fmt, 128, power_of_two)
        for got, got_scale_t, _ in [(data, scale_t, amax), *rows_only]:
            same_bits(got[at], want)
            same_bits(got_scale_t[at], want_scale_t)
        want_t, want_cols, _ = np_reference_rows(
            nan_rows_across_tiles(xb).T, fmt, 128, power_of_two
        )
        same(data_t[at], want_t)  # values: a -0 may come out +0 from the tensor cores
        same_bits(cols[at], want_cols)
    assert all(np.isnan(np.max(np.asarray(a))) for a in (amax, *(r[2] for r in rows_only)))
    finite = jnp.where(jnp.isfinite(x), x, 0)
    *_, amax, _, _ = tensor_core_quantize_rows_and_columns(finite, fmt, **rule, interpret=True)
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(finite.astype(jnp.float32))))


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * NaN, as said
@pytest.mark.parametrize(
    "shape, fmt, power_of_two, config",
    [
        ((384, 256), E4M3, False, TransposeConfig(max_programs=2)),
        ((2, 256, 384), E5M2, True, TransposeConfig()),
    ],
)
def test_requantized_columns_as_numpy(shape, fmt, power_of_two, config):
    """A saved FP8 copy's 1 x 128 tiles (NumPy's, of an operand with inf and NaN) in 128 x 1
    tiles, transposed: as NumPy's quantization of the dequantized values, but where a row
    of a 128 x 128 tile holds a NaN (NaN whole in that tile, as for the output gradient's
    columns); scales bit for bit."""
    from test_block_quantize import np_reference_rows

    rng = np.random.default_rng(19)
    x = np.asarray(operand(rng, (int(np.prod(shape[:-1])), shape[-1])), np.float32)
    x = x.reshape(shape)
    saved = [np_reference_rows(xb, fmt, 128, power_of_two)[:2] for xb in x.reshape(-1, *shape[-2:])]
    data = np.stack([d for d, _ in saved]).reshape(shape)
    scale_t = np.stack([s for _, s in saved]).reshape(*shape[:-2], shape[-1] // 128, shape[-2])
    data_t, cols = tensor_core_requantize_columns(
        jnp.asarray(data),
        jnp.asarray(scale_t),
        max_scale=2.0**16,
        power_of_two=power_of_two,
        config=config,
        interpret=True,
    )
    assert data_t.dtype == fmt and data_t.shape == (*shape[:-2], shape[-1], shape[-2])
    for b, (d, s) in enumerate(saved):
        at = (b,) if len(shape) == 3 else ()
        values = np.asarray(d, np.float32) * np.repeat(s.T, 128, axis=1)  # dequantized
        want_t, want_cols, _ = np_reference_rows(
            nan_rows_across_tiles(values).T, fmt, 128, power_of_two
        )
        same(data_t[at], want_t)
        same_bits(cols[at], want_cols)


def np_blocks(w: np.ndarray, fmt, power_of_two: bool) -> tuple[np.ndarray, ...]:
    """128 x 128 blocks of `w` (float32) in NumPy, independent of fp8jax: FP8 data, each
    block's scale_inv once per row it covers (chunk-major, `(K / 128, N)`, and for the
    transposed copy `(N / 128, K)`)."""
    from test_block_quantize import np_scales

    n, k = w.shape
    amax = np.abs(w).reshape(n // 128, 128, k // 128, 128).max((1, 3))
    scale = np_scales(amax, fmt, power_of_two)
    fmt_max = np.float32(ml_dtypes.finfo(fmt).max)
    full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.clip(w * full, -fmt_max, fmt_max)
    data = np.where(np.isfinite(w), scaled, np.nan).astype(fmt)
    scale_inv = np.float32(1) / scale
    return data, np.repeat(scale_inv, 128, axis=0).T, np.repeat(scale_inv, 128, axis=1)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # 0 * NaN, as said
@pytest.mark.parametrize(
    "dtype, fmt, power_of_two, config",
    [
        (jnp.float32, E4M3, False, TransposeConfig(max_programs=2)),
        (jnp.bfloat16, E5M2, True, TransposeConfig()),
    ],
)
def test_weight_blocks_quantize_as_numpy(dtype, fmt, power_of_two, config):
    """A weight's blocks and their transpose equal an independent NumPy quantization, bit
    for bit but a NaN's payload and the transposed copy's zero signs and NaN rows (as the
    per-tensor kernel's); each block's scale once per row it covers in both layouts; the
    partial amaxes' maximum is `max |w|` (NaN with a NaN)."""
    from test_block_quantize import MAX_SCALE

    rng = np.random.default_rng(13)
    w = jnp.asarray(np.asarray(operand(rng, (384, 256)), np.float32)).astype(dtype)
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two)
    data, data_t, rows_t, cols, amax = tensor_core_quantize_blocks(
        w, fmt, **rule, config=config, interpret=True
    )
    want, want_rows_t, want_cols = np_blocks(np.asarray(w, np.float32), fmt, power_of_two)
    same_bits(data, want)
    same(data_t, transposed_with_nan_rows(want))
    same_bits(rows_t, want_rows_t)
    same_bits(cols, want_cols)
    assert np.isnan(np.max(np.asarray(amax)))
    finite = jnp.where(jnp.isfinite(w), w, 0)
    *_, amax = tensor_core_quantize_blocks(finite, fmt, **rule, interpret=True)
    assert float(jnp.max(amax)) == float(jnp.max(jnp.abs(finite.astype(jnp.float32))))


@needs_interpreter
@pytest.mark.parametrize("power_of_two", [False, True])
def test_tiles_too_small_for_the_formats_range_take_the_capped_scale(power_of_two):
    """A 128 x 128 tile of normal values at most 2**-121 (`fmt_max / amax` overflows
    float32): its row, column and block scales are capped at `MAX_SCALE`, as NumPy's."""
    from test_block_quantize import MAX_SCALE, np_reference_rows

    rng = np.random.default_rng(5)
    x = rng.standard_normal((128, 256))
    x[:, :128] = np.sign(x[:, :128]) * 2.0 ** rng.uniform(-125, -121, (128, 128))
    x = jnp.asarray(x, jnp.bfloat16)
    xf = np.asarray(x, np.float32)
    rule = dict(max_scale=MAX_SCALE, power_of_two=power_of_two, interpret=True)
    data, scale_t, _, data_t, cols = tensor_core_quantize_rows_and_columns(x, E4M3, **rule)
    want, want_scale_t, _ = np_reference_rows(xf, E4M3, 128, power_of_two)
    assert np.all(want_scale_t[0] == np.float32(1 / MAX_SCALE))  # capped
    same_bits(data, want)
    same_bits(scale_t, want_scale_t)
    want_t, want_cols, _ = np_reference_rows(xf.T, E4M3, 128, power_of_two)
    same(data_t, want_t)
    same_bits(cols, want_cols)
    w_data, _, rows_t, w_cols, _ = tensor_core_quantize_blocks(x, E4M3, **rule)
    for got, ref in zip((w_data, rows_t, w_cols), np_blocks(xf, E4M3, power_of_two), strict=True):
        same_bits(got, ref)


@needs_interpreter
def test_experts_weight_blocks_are_one_kernel_of_each_weights_blocks():
    """Experts' weights `(E, N, K)`, batched or under `vmap` (nested too), quantize as each
    weight alone, bit for bit, through one kernel by its name; each expert's partial amaxes
    are its own, also where a program would have spanned two experts (3 programs at most
    over 2 x 6 tiles)."""
    from test_block_quantize import heavy_tailed

    rng = np.random.default_rng(31)
    # The second expert's amax above every block of the first.
    w = jnp.stack([heavy_tailed(rng, (256, 384)) * 64.0**e for e in range(2)])
    call = functools.partial(
        tensor_core_quantize_blocks,
        fmt=E4M3,
        max_scale=2.0**16,
        config=TransposeConfig(max_programs=3),
        interpret=True,
    )
    alone = [call(w[e]) for e in range(2)]
    jaxpr = str(jax.make_jaxpr(jax.vmap(call))(w))
    assert jaxpr.count(f"name={TENSOR_CORE_BLOCKS_NAME}") == 1 and "batched_body" not in jaxpr
    nested = jax.vmap(jax.vmap(call))(jnp.stack([w, w[::-1]]))
    reversed_ = [a[1][::-1] for a in nested]  # the outer axis' second member: w[::-1]
    for got in (call(w), jax.vmap(call)(w), [a[0] for a in nested], reversed_):
        for e in range(2):
            for a, b in zip([g[e] for g in got[:4]], alone[e][:4], strict=True):
                same_bits(a, b)
            amax = float(jnp.max(jnp.abs(w[e].astype(jnp.float32))))
            assert got[4][e].shape == (1, 128) and float(jnp.max(got[4][e])) == amax


@needs_interpreter
def test_experts_blockwise_weights_on_the_tensor_cores_are_the_triton_kernels():
    """Inside `tensor_core_quantization()` the blockwise recipe's experts' weights, each with
    its own state and `vmap`ped as `Fp8RaggedDot` quantizes them, equal the Pallas Triton
    kernel's copies and states, through one tensor-core kernel for all experts."""
    from test_block_quantize import heavy_tailed

    recipe = fp8jax.BlockwiseScaling(power_of_two=True)
    states = jax.vmap(lambda _: recipe.init_state("kernel"))(jnp.arange(3))
    rng = np.random.default_rng(37)
    w = jnp.stack([heavy_tailed(rng, (256, 384)) * 4.0**e for e in range(3)])

    def copies(w, state):
        q, new = recipe.quantize(w, state, "kernel", -1)
        return q, new, recipe.retile(q, "kernel", -2, source=w)

    # A new function for each trace: jit's cache does not see the context.
    with dispatch.interpreted():
        want = jax.jit(lambda w, s: jax.vmap(copies)(w, s))(w, states)
        with tensor_core_quantization():
            jaxpr = str(jax.make_jaxpr(lambda w, s: jax.vmap(copies)(w, s))(w, states))
            got = jax.jit(lambda w, s: jax.vmap(copies)(w, s))(w, states)
    assert jaxpr.count(f"name={TENSOR_CORE_BLOCKS_NAME}") == 1, jaxpr
    assert "fp8jax_quantize_blocks" not in jaxpr and "batched_body" not in jaxpr
    assert len(set(np.asarray(got[1].amax_history[:, 0]).tolist())) == 3  # the experts' own
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


@needs_interpreter
@pytest.mark.parametrize("batch", [(), (2,)])
def test_blockwise_output_gradient_on_the_tensor_cores_is_its_xla_path(batch):
    """Inside `tensor_core_quantization()` the blockwise recipe's output gradient (both
    copies and the new state) from the tensor-core kernel, one call, equals its XLA path bit
    for bit; a float32 one keeps the Pallas Triton kernel (`wgmma` would round it to TF32)."""
    from test_block_quantize import heavy_tailed

    rng = np.random.default_rng(7)
    x = jnp.stack([heavy_tailed(rng, (256, 384)) for _ in range(batch[0] if batch else 1)])
    x = x if batch else x[0]
    xla = fp8jax.BlockwiseScaling(power_of_two=True, native_kernel=False)
    state = xla.init_state("output_grad")
    kernel = fp8jax.BlockwiseScaling(power_of_two=True)
    for operand_ in (x, x.astype(jnp.float32)):
        want = jax.jit(lambda v: xla.quantize_both(v, state, "output_grad"))(operand_)
        with dispatch.interpreted(), tensor_core_quantization():
            step = lambda v: kernel.quantize_both(v, state, "output_grad")  # noqa: E731
            jaxpr = str(jax.make_jaxpr(step)(operand_))
            got = jax.jit(step)(operand_)
        on_tensor_cores = operand_.dtype == jnp.bfloat16
        assert jaxpr.count(f"name={TENSOR_CORE_ROWS_AND_COLUMNS_NAME}") == on_tensor_cores
        assert ("fp8jax_quantize_rows_and_columns" in jaxpr) != on_tensor_cores
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            same(a, b)


def test_float64_blockwise_operands_inside_tensor_core_quantization_run():
    """Under `jax_enable_x64`, a float64 activation or weight inside
    `tensor_core_quantization()` raised "x has dtype float64" while tracing the CUDA branch
    (on a CPU too): the tensor-core kernels read 16- and 32-bit floats only. Such operands
    take the Triton kernels (which read any float) and quantize as the XLA path."""
    recipe = fp8jax.BlockwiseScaling(power_of_two=True)
    xla = fp8jax.BlockwiseScaling(power_of_two=True, native_kernel=False)
    x = np.random.default_rng(3).standard_normal((128, 256)) * 100

    def copies(r, x):
        rows = r.quantize(x, r.init_state("input"), "input", -1)[0]
        weight = r.quantize(x, r.init_state("kernel"), "kernel", -1)[0]
        return rows.data, rows.scale_inv, weight.dequantize()

    with jax.enable_x64(True):
        x = jnp.asarray(x, jnp.float64)
        with tensor_core_quantization():
            got = jax.jit(lambda x: copies(recipe, x))(x)
        want = jax.jit(lambda x: copies(xla, x))(x)
    for a, b in zip(got, want, strict=True):
        same(a, b)


@needs_interpreter
def test_blockwise_weight_on_the_tensor_cores_is_the_triton_kernels():
    """Inside `tensor_core_quantization()` a blockwise weight's two GEMM copies (forward and
    dgrad: FP8 values, scales laid out per row as the GEMM kernels read them) and new state
    equal the Pallas Triton kernel's (itself tested against the XLA path), through one
    tensor-core kernel call, for float32 and BF16 weights."""
    from test_block_quantize import heavy_tailed

    recipe = fp8jax.BlockwiseScaling(power_of_two=True)
    state = recipe.init_state("kernel")

    def copies(w):
        q, new = recipe.quantize(w, state, "kernel", -1)
        return q, new, recipe.retile(q, "kernel", -2, source=w)

    for dtype in (jnp.float32, jnp.bfloat16):
        w = heavy_tailed(np.random.default_rng(17), (384, 256), dtype)
        # A new function for each trace: jit's cache does not see the context.
        with dispatch.interpreted():
            want = jax.jit(lambda w: copies(w))(w)
            with tensor_core_quantization():
                jaxpr = str(jax.make_jaxpr(lambda w: copies(w))(w))
                got = jax.jit(lambda w: copies(w))(w)
        assert jaxpr.count(f"name={TENSOR_CORE_BLOCKS_NAME}") == 1, jaxpr
        assert "fp8jax_quantize_blocks" not in jaxpr
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            same(a, b)


@needs_interpreter
@pytest.mark.parametrize("batch", [(), (2,)])
def test_blockwise_wgrad_activation_on_the_tensor_cores_is_the_triton_kernels(batch):
    """Inside `tensor_core_quantization()` the blockwise recipe's activation (1 x 128 tiles,
    on TMA) and its saved copy retiled for the wgrad (128 x 1 tiles, from the FP8 copy)
    equal the Pallas Triton kernels' (themselves tested against the XLA path), one Mosaic
    GPU kernel call each, 2-D and batched."""
    from test_block_quantize import heavy_tailed

    rng = np.random.default_rng(23)
    x = jnp.stack([heavy_tailed(rng, (256, 384)) for _ in range(batch[0] if batch else 1)])
    x = x if batch else x[0]
    recipe = fp8jax.BlockwiseScaling()
    state = recipe.init_state("input")

    def retiled(x):
        q, new = recipe.quantize(x, state, "input", -1)
        return q, new, recipe.retile(q, "input", -2)

    with dispatch.interpreted():  # a new function for each trace: jit's cache has no context
        want = jax.jit(lambda x: retiled(x))(x)
        with tensor_core_quantization():
            jaxpr = str(jax.make_jaxpr(lambda x: retiled(x))(x))
            got = jax.jit(lambda x: retiled(x))(x)
    for name in (TENSOR_CORE_ROWS_NAME, TENSOR_CORE_REQUANTIZE_NAME):
        assert jaxpr.count(f"name={name}") == 1, jaxpr
    assert "fp8jax_requantize_columns" not in jaxpr and "fp8jax_quantize_rows" not in jaxpr
    assert got[2].block == want[2].block == (128, 1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


@needs_interpreter
def test_a_blockwise_linear_step_on_the_tensor_cores_is_the_triton_kernels():
    """A BF16 blockwise Fp8DotGeneral's value and gradients (weight, input, new state) with
    every quantization pass on the Mosaic GPU kernels equal the step on the Triton kernels
    (the GEMMs on the XLA path in both: the interpreter's GEMM sums in another order): all
    four Mosaic kernels in its program, no Triton one."""
    from test_block_quantize import heavy_tailed

    rng = np.random.default_rng(29)
    x = heavy_tailed(rng, (256, 256))
    w = jnp.asarray(rng.standard_normal((256, 384)) * 0.05, jnp.bfloat16)
    xla = fp8jax.BlockwiseScaling(native_kernel=False)

    def loss(args):
        layer, x, w = args
        return jnp.sum(jnp.sin(layer(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32)))

    def step():
        return fp8jax.filter_value_and_grad(loss)

    real_dot = fp8jax.BlockwiseScaling.dot
    args = (fp8jax.Fp8DotGeneral(fp8jax.BlockwiseScaling()), x, w)
    with dispatch.interpreted(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8jax.BlockwiseScaling, "dot", lambda _, *a, **k: real_dot(xla, *a, **k))
        want = jax.jit(step())(args)
        with tensor_core_quantization():
            jaxpr = str(jax.make_jaxpr(step())(args))
            got = jax.jit(step())(args)
    names = (
        TENSOR_CORE_ROWS_NAME,
        TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
        TENSOR_CORE_BLOCKS_NAME,
        TENSOR_CORE_REQUANTIZE_NAME,
    )
    assert all(f"name={name}" in jaxpr for name in names), jaxpr
    assert "name=fp8jax_quantize" not in jaxpr and "name=fp8jax_requantize" not in jaxpr
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        same(a, b)


def test_bad_input_is_refused_by_name():
    x = jnp.ones((256, 384), jnp.bfloat16)
    one = jnp.float32(1)
    for bad, match in [
        (x[:200], r"shape \(200, 384\); expected \(M, K\) or \(B, M, K\)"),
        (x.astype(jnp.int32), "dtype int32; expected one of bfloat16, float16, float32"),
    ]:
        with pytest.raises(ValueError, match=match):
            tensor_core_cast_transpose(bad, one, E4M3, interpret=False)
    with pytest.raises(ValueError, match="fmt=.*expected float8_e4m3fn"):
        tensor_core_cast_transpose(x, one, jnp.bfloat16, interpret=False)
    with pytest.raises(ValueError, match=r"scale has shape \(2,\)"):
        tensor_core_cast_transpose(x, jnp.ones((2,)), E4M3, interpret=False)
    with pytest.raises(TypeError, match="config=3; expected a TransposeConfig"):
        tensor_core_cast_transpose(x, one, E4M3, config=3, interpret=False)
    for kw in (dict(max_programs=0), dict(max_concurrent_steps=5), dict(max_programs=True)):
        with pytest.raises(ValueError, match="TransposeConfig: max_"):
            TransposeConfig(**kw)
    with pytest.raises(TypeError, match="on_tensor_cores=1; expected a bool"):
        cast_transpose_kernel(on_tensor_cores=1)
    rows_and_columns = functools.partial(
        tensor_core_quantize_rows_and_columns, max_scale=2.0**16, interpret=False
    )
    with pytest.raises(ValueError, match="dtype float32; expected one of bfloat16, float16"):
        rows_and_columns(x.astype(jnp.float32), E4M3)
    with pytest.raises(ValueError, match="block=64; expected 128"):
        rows_and_columns(x, E4M3, block=64)
    with pytest.raises(ValueError, match="quantize_rows: x has dtype int32; expected one of"):
        tensor_core_quantize_rows(x.astype(jnp.int32), E4M3, max_scale=2.0**16)
    with pytest.raises(ValueError, match=r"shape \(2, 2, 256, 384\)"):
        rows_and_columns(jnp.ones((2, 2, 256, 384), jnp.bfloat16), E4M3)
    fp8 = x.astype(E4M3)
    with pytest.raises(ValueError, match="dtype bfloat16; expected one of float8_e4m3fn"):
        tensor_core_requantize_columns(x, jnp.ones((3, 256)), max_scale=2.0**16)
    with pytest.raises(ValueError, match=r"scale_inv_t has shape \(256, 3\); expected \(3, 256\)"):
        tensor_core_requantize_columns(fp8, jnp.ones((256, 3)), max_scale=2.0**16)
    if not mosaic_private.interpreter_runs_gpu_path():
        for call in (
            lambda: tensor_core_cast_transpose(x, one, E4M3, interpret=True),
            lambda: rows_and_columns(x, E4M3, interpret=True),
        ):
            with pytest.raises(NotImplementedError, match="cannot run wgmma on a transposed"):
                call()


def test_programs_and_stages_follow_the_config():
    """The fewest tiles a program that divide the tiles within `max_programs` (one wave on
    132 SMs at the LLM shapes), and stages clipped to shared memory (float32: two)."""
    config = TransposeConfig()
    assert tiles_per_program(config, 64 * 32) == 16  # 8192 x 4096: 128 programs
    assert tiles_per_program(config, 64 * 112) == 56  # 8192 x 14336: 128 programs
    assert tiles_per_program(config, 7) == 1 and tiles_per_program(TransposeConfig(2), 7) == 7
    # Batched (experts' weights): no program spans two items.
    assert tiles_per_program(config, 8 * 112 * 32, batch=8) == 224  # Mixtral's up: 128
    assert tiles_per_program(config, 64 * 11 * 16, batch=64) == 88  # 64 x 1408 x 2048: 128
    assert tiles_per_program(TransposeConfig(3), 12, batch=2) == 6  # not 4 (tiles 4-7)
    assert tiles_per_program(TransposeConfig(3), 5 * 4, batch=5) == 4  # one an item
    four = TransposeConfig(max_concurrent_steps=4)
    assert stages(four, jnp.bfloat16, E4M3) == 4 and stages(four, jnp.float32, E4M3) == 2
    assert stages(four, jnp.bfloat16, jnp.bfloat16) == 3  # a BF16 identity: 16 KB more


def test_h100_compile_of_experts_weights_is_one_kernel_counted_as_quantization():
    """For an H100 (deviceless): experts' weights `vmap`ped through the weight kernel compile
    to one Mosaic GPU call by its name (not a batched grid, which JAX names `batched_body`),
    which `fp8jax.hlo_cost` files under quantization with every expert's bytes."""
    from helpers import h100_topology

    from fp8jax._src.observe import deviceless

    device = h100_topology().devices[0]
    spec = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    blocks = functools.partial(
        tensor_core_quantize_blocks, fmt=E4M3, max_scale=2.0**16, interpret=False
    )
    lowered, _ = deviceless.lower(jax.vmap(blocks), (spec,), {}, device)
    hlo = lowered.compile(fp8jax.gpu_compiler_options()).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call_target=" in line]
    assert len(calls) == 1 and TENSOR_CORE_BLOCKS_NAME in calls[0], calls
    cost = fp8jax.hlo_cost(hlo)
    assert set(cost.bytes) == {"quantize"} and cost.bytes["quantize"] >= 4 * 256 * 384 * 4


@pytest.mark.parametrize(
    "name",
    [
        TENSOR_CORE_TRANSPOSE_NAME,
        TENSOR_CORE_ROWS_AND_COLUMNS_NAME,
        TENSOR_CORE_BLOCKS_NAME,
        TENSOR_CORE_REQUANTIZE_NAME,
        TENSOR_CORE_ROWS_NAME,
    ],
)
def test_h100_compile_runs_one_mosaic_kernel_counted_as_quantization(name, tmp_path, monkeypatch):
    """For an H100 (deviceless): one Mosaic GPU custom call by the kernel's name, which
    `fp8jax.hlo_cost` files under quantization (its identity a constant, no kernel); the
    blockwise kernel's scales divided exactly rounded in its PTX (`div.rn.f32`: Mosaic GPU's
    `/` is `div.full.f32`)."""
    from helpers import h100_topology

    from fp8jax._src.observe import deviceless

    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")

    device = h100_topology().devices[0]
    requantize = name == TENSOR_CORE_REQUANTIZE_NAME  # a saved FP8 copy and its scales
    spec = jax.ShapeDtypeStruct((256, 384), E4M3 if requantize else jnp.bfloat16)
    scale_t = jax.ShapeDtypeStruct((3, 256), jnp.float32)
    rule = dict(max_scale=2.0**16, interpret=False)

    def cast(x, scale_t):
        if name == TENSOR_CORE_TRANSPOSE_NAME:
            return tensor_core_cast_transpose(x, jnp.float32(2.0), E4M3, interpret=False)
        if name == TENSOR_CORE_BLOCKS_NAME:
            return tensor_core_quantize_blocks(x, E4M3, **rule)
        if requantize:
            return tensor_core_requantize_columns(x, scale_t, **rule)
        if name == TENSOR_CORE_ROWS_NAME:
            return tensor_core_quantize_rows(x, E4M3, **rule)
        return tensor_core_quantize_rows_and_columns(x, E4M3, **rule)

    lowered, _ = deviceless.lower(cast, (spec, scale_t), {}, device)
    hlo = lowered.compile(fp8jax.gpu_compiler_options()).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call_target=" in line]
    assert len(calls) == 1 and name in calls[0], calls
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    divisions = collections.Counter(re.findall(r"\bdiv\.[\w.]+", ptx))
    # Blockwise: two divisions a scale (scale, scale_inv), per row a thread holds, of each
    # copy's; a weight's block: one scale, computed once.
    rounded = {
        "div.rn.f32": {
            TENSOR_CORE_BLOCKS_NAME: 2,
            TENSOR_CORE_REQUANTIZE_NAME: 8,
            TENSOR_CORE_ROWS_NAME: 8,
        }.get(name, 16)
    }
    assert divisions == ({} if name == TENSOR_CORE_TRANSPOSE_NAME else rounded)
    cost = fp8jax.hlo_cost(hlo)
    one_copy = requantize or name == TENSOR_CORE_ROWS_NAME
    moved = 256 * 384 * (2 if one_copy else 4)  # read x, write two FP8 copies (or one)
    assert set(cost.bytes) == {"quantize"} and cost.bytes["quantize"] >= moved

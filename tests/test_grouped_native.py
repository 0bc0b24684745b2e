"""fp8jax's grouped FP8 GEMM kernels (Pallas Mosaic GPU) for mixtures of experts.

- the padded layout and the rows kernels' items against hand-rolled NumPy ones;
- both kernels in Mosaic GPU's interpreter against float64 NumPy references, with uneven and
  empty groups, per-chunk and per-tile scaling, FP8 and 16-bit operands;
- `Fp8RaggedDot` on the kernels (interpreted) against its XLA path, every native recipe,
  under `vmap` too;
- the deviceless H100 compile of an MoE training step: every expert GEMM (forward, dgrad,
  wgrad) in the kernels with FP8 `wgmma` in the PTX, no register spills, no ragged dot left,
  and GEMM work that grows with the tokens, not tokens times experts.
"""

import json
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_with_mosaic_dump
from jax import lax

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.gemm import grouped_native as native
from fp8jax._src.gemm import grouped_rules as grouped_dots
from fp8jax._src.kernels import reference
from fp8jax._src.kernels.dispatch import interpreted
from fp8jax._src.kernels.grouped_gemm import (
    RowItems,
    grouped_rows_gemm,
    grouped_tokens_gemm,
    row_items,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


# --- the padded layout --------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, rows",
    [([5, 0, 9, 3], 17), ([0, 0, 0, 4], 4), ([64, 1, 0, 63], 128), ([2, 3, 0, 1], 9)],
)
def test_pad_layout_starts_each_expert_on_a_tile(sizes, rows):
    """Hand-rolled: expert e's rows at sum(roundup(size[f], tile), f < e) on, zeros between;
    rows past the groups (`rows` > sum) are not placed."""
    tile = 8
    sizes = np.array(sizes, np.int32)
    layout = native.pad_layout(jnp.asarray(sizes), rows, tile)
    x = np.arange(1, rows + 1, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    padded = np.asarray(native.pad(jnp.asarray(x), layout))
    want = np.zeros_like(padded)
    start, at = 0, 0
    for size in sizes:
        want[at : at + size] = x[start : start + size]
        start, at = start + size, at + -(-size // tile) * tile
    assert padded.shape[0] % tile == 0 and padded.shape[0] >= at
    np.testing.assert_array_equal(padded, want)
    np.testing.assert_array_equal(layout.sizes, -(-sizes // tile) * tile)
    # The row map names every row: the held ones, then (negative) the rest by the gaps,
    # each row past the groups once before any row is named twice.
    rows_map = np.asarray(native.gather_map(layout))
    held = rows_map[rows_map >= 0]
    named = -1 - rows_map[rows_map < 0]
    np.testing.assert_array_equal(np.sort(held), np.arange(sizes.sum()))
    past = rows - sizes.sum()
    np.testing.assert_array_equal(named[:past], np.arange(sizes.sum(), rows))
    assert set(named) <= set(range(rows))


def test_rows_past_the_groups_belong_to_the_last_expert():
    """`expert_of_rows`: rows 0-1 expert 0, none of expert 1, rows 2-4 expert 2, and the
    rows past the sizes' sum (5, 6) the last expert too, by hand."""
    got = native.expert_of_rows(jnp.array([2, 0, 3], jnp.int32), 7)
    assert np.asarray(got).tolist() == [0, 0, 2, 2, 2, 2, 2]


def test_the_native_gemms_give_zeros_for_an_empty_contraction_themselves():
    """Called directly (not through `dispatch.choose`, which keeps empty operands off the
    kernels), the grouped GEMMs give lax's zeros for no contracted columns or tokens."""
    e4m3 = jnp.float8_e4m3fn
    lhs = fp8jax.QTensor(jnp.zeros((64, 0), e4m3), jnp.ones(()))
    rhs = fp8jax.QTensor(jnp.zeros((2, 128, 0), e4m3), jnp.ones((2,)))
    sizes = jnp.array([30, 34], jnp.int32)
    with interpreted():
        out = native.native_rows(lhs, rhs, sizes, jnp.float32)
    np.testing.assert_array_equal(out, np.zeros((64, 128)))


@pytest.mark.parametrize(
    "sizes, rows",
    [([70, 0, 130], 237), ([64, 64], 128), ([0, 0, 5], 5), ([1, 1, 1, 1], 70), ([0, 3], 200)],
)
def test_row_items_write_each_row_once_with_its_expert(sizes, rows):
    """Hand-rolled: every row of expert e is written by exactly one item, of expert e and of
    the row's own 64-row tile; rows past the experts by one item of expert -1 (zeros); the
    items fit their static count, and an item of an expert covers one tile's rows of it."""
    tile = 64
    items = [np.asarray(a) for a in row_items(jnp.asarray(sizes, jnp.int32), rows, tile)]
    assert all(a.shape == (-(-rows // tile) + len(sizes),) for a in items)
    owner = np.repeat(np.arange(len(sizes) + 1), [*sizes, rows - sum(sizes)])
    owner[owner == len(sizes)] = -1
    written = np.zeros(rows, int)
    for t, e, start, stop in zip(*items, strict=True):
        assert 0 <= start <= stop <= tile
        written[tile * t + start : tile * t + stop] += 1
        np.testing.assert_array_equal(owner[tile * t + start : tile * t + stop], e)
    np.testing.assert_array_equal(written, 1)


# --- the kernels in the interpreter ---------------------------------------------------------

G, K, N = 3, 200, 136  # K: two chunks, the second partial; N: two column tiles, padded
# Unpadded rows: expert 0's end and expert 2's start share a tile, expert 1 has none, rows
# past the experts (zeros), the last tile partial.
ROW_SIZES, M = np.array([70, 0, 130], np.int32), 237


def scales(rng, shape):
    return jnp.asarray(2.0 ** rng.integers(-3, 4, shape), jnp.float32)


@pytest.mark.parametrize("scaling", ["blocks", "item", "item, promoted"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2, jnp.bfloat16])
def test_rows_kernel_matches_float64_in_the_interpreter(scaling, dtype):
    """Block scales promoted per chunk; one scale per item after one accumulation, or with
    `promote` (the backward's) each chunk's product added to a float32 sum. Each item writes
    its own rows of a tile and no other (a row written by the wrong item, or twice with the
    wrong expert, fails); rows of no expert are zeros."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((M, K)) * 3, dtype)
    rhs = jnp.asarray(rng.standard_normal((G, N, K)), dtype)
    items = row_items(jnp.asarray(ROW_SIZES), M)
    chunks = -(-K // 128)
    if scaling == "blocks":
        kw = {"lhs_scale": scales(rng, (M, chunks)), "rhs_scale": scales(rng, (G, N, chunks))}
    else:
        kw = {"item_scale": scales(rng, items.tile.shape)}
    promote = scaling == "item, promoted"
    with interpreted():
        out = jax.jit(lambda *a: grouped_rows_gemm(*a, **kw, promote=promote))(lhs, rhs, items)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    want = reference.grouped_rows(lhs, rhs, items, **kw)
    assert not np.isnan(want).any()  # every row written
    np.testing.assert_array_equal(out[ROW_SIZES.sum() :], 0.0)
    for e, rows in enumerate(np.split(np.arange(M), np.cumsum(ROW_SIZES))[:G]):
        if not rows.size:
            continue
        # Exact products, float32 sums of K terms.
        bound = reference.float32_sum_bound(K, np.abs(want[rows]).max())
        np.testing.assert_array_less(np.abs(f64(out[rows]) - want[rows]), bound + 1e-30, e)


def test_rows_kernel_runs_any_items_in_the_interpreter():
    """Items in any order, a tile split between two experts, zeros for expert -1, an unused
    item (nothing written), and whole tiles (`RowItems.of_tiles`, a tile left unwritten)."""
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((192, K)), E4M3)
    rhs = jnp.asarray(rng.standard_normal((G, N, K)), E4M3)
    table = [[2, 0, 0, 1, 0], [1, 2, 0, -1, 0], [0, 0, 10, 5, 0], [64, 10, 64, 9, 0]]
    items = RowItems(*(jnp.asarray(a, jnp.int32) for a in table))
    tiles = RowItems.of_tiles(jnp.asarray([2, -1, 0], jnp.int32))
    with interpreted():
        for each in (items, tiles):
            scale = jnp.ones(each.tile.shape, jnp.float32)
            out = f64(grouped_rows_gemm(lhs, rhs, each, item_scale=scale))
            want = reference.grouped_rows(lhs, rhs, each, item_scale=scale)
            written = ~np.isnan(want)
            bound = reference.float32_sum_bound(K, np.abs(want[written]).max())
            np.testing.assert_array_less(np.abs(out[written] - want[written]), bound)
    assert written[:64].all() and not written[64:128].any() and written[128:].all()


@pytest.mark.parametrize("scaling", ["blocks", "group", "group, promoted"])
def test_tokens_kernel_matches_float64_in_the_interpreter(scaling):
    """Each expert contracts its own chunks of tokens; an expert with none gets zeros."""
    rng = np.random.default_rng(1)
    a_rows, b_rows, chunks = 72, 140, 5
    t = 128 * chunks
    lhs = jnp.asarray(rng.standard_normal((a_rows, t)) * 2, E4M3)
    rhs = jnp.asarray(rng.standard_normal((b_rows, t)), E4M3)
    start, count = np.array([0, 2, 2], np.int32), np.array([2, 0, 3], np.int32)
    if scaling == "blocks":
        kw = {
            "lhs_scale": scales(rng, (a_rows, chunks)),
            "rhs_scale": scales(rng, (b_rows, chunks)),
        }
    else:  # each expert's own (distinct: a scale read from another expert's fails)
        kw = {"group_scale": jnp.asarray([4.0, 0.5, 0.25], jnp.float32)}
    promote = scaling == "group, promoted"
    with interpreted():
        out = jax.jit(lambda *a: grouped_tokens_gemm(*a, **kw, promote=promote))(
            lhs, rhs, jnp.asarray(start), jnp.asarray(count)
        )
    assert out.shape == (G, a_rows, b_rows)
    want = reference.grouped_tokens(lhs, rhs, start, count, **kw)
    for e in range(G):
        if not count[e]:
            np.testing.assert_array_equal(out[e], 0.0)
            continue
        bound = reference.float32_sum_bound(t, np.abs(want[e]).max())
        np.testing.assert_array_less(np.abs(f64(out[e]) - want[e]), bound)


def test_kernels_reject_bad_operands():
    lhs, rhs = jnp.zeros((64, 128), E4M3), jnp.zeros((2, 128, 128), E4M3)
    experts, one = RowItems.of_tiles(jnp.zeros((1,), jnp.int32)), jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match="lhs is bfloat16 and rhs float8_e4m3fn"):
        grouped_rows_gemm(lhs.astype(jnp.bfloat16), rhs, experts, item_scale=one)
    if not mosaic_private.mixed_fp8_wgmma():  # JAX 0.10: one type per wgmma
        with pytest.raises(ValueError, match="lhs is float8_e5m2 and rhs float8_e4m3fn"):
            grouped_rows_gemm(lhs.astype(E5M2), rhs, experts, item_scale=one)
    with pytest.raises(ValueError, match="lhs is float32; wgmma takes"):
        grouped_rows_gemm(lhs.astype(jnp.float32), rhs, experts, item_scale=one)
    with pytest.raises(ValueError, match="items is ndarray; expected RowItems"):
        grouped_rows_gemm(lhs, rhs, np.zeros((1,), np.int32), item_scale=one)
    with pytest.raises(ValueError, match="items have shapes .*expected four arrays"):
        grouped_rows_gemm(lhs, rhs, experts._replace(stop=jnp.zeros(2, jnp.int32)), item_scale=one)
    with pytest.raises(ValueError, match="items have dtypes .*expected integers"):
        grouped_rows_gemm(lhs, rhs, experts._replace(stop=jnp.ones(1)), item_scale=one)
    with pytest.raises(ValueError, match="either lhs_scale and rhs_scale .* or item_scale"):
        grouped_rows_gemm(lhs, rhs, experts)
    with pytest.raises(ValueError, match="item_scale has shape \\(2,\\); expected \\(1,\\)"):
        grouped_rows_gemm(lhs, rhs, experts, item_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="rhs has shape \\(128, 128\\); expected \\(experts"):
        grouped_rows_gemm(lhs, rhs[0], experts, item_scale=one)
    counts = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="100 tokens, not a multiple of block_k=128"):
        grouped_tokens_gemm(
            jnp.zeros((8, 100), E4M3), jnp.zeros((8, 100), E4M3), counts, counts,
            group_scale=jnp.ones((2,)),
        )  # fmt: skip
    with pytest.raises(ValueError, match="group_scale has shape \\(3,\\); expected \\(2,\\)"):
        grouped_tokens_gemm(lhs, lhs, counts, counts, group_scale=jnp.ones((3,)))


# --- the layer on the kernels against its XLA path ------------------------------------------

SIZES = np.array([70, 0, 130, 5], np.int32)  # uneven, one expert without tokens
FEATURES_IN, FEATURES_OUT = 96, 80

RECIPES = {
    "delayed": fp8jax.DelayedScaling(),  # E5M2 gradients: dgrad, wgrad upcast to BF16
    "delayed-e4m3": fp8jax.DelayedScaling(backward_format="e4m3"),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
    "blockwise-64": fp8jax.BlockwiseScaling(block_size=64),
}


def layer_data(seed, sizes=SIZES):
    rng = np.random.default_rng(seed)
    m = int(np.sum(sizes))
    x = (rng.standard_normal((m, FEATURES_IN)) * 3).astype(np.float32)
    w = rng.standard_normal((len(sizes), FEATURES_IN, FEATURES_OUT)).astype(np.float32)
    w *= np.array([0.01, 1.0, 30.0, 0.3], np.float32)[:, None, None]
    g = (rng.standard_normal((m, FEATURES_OUT)) * 1e-3).astype(np.float32)
    return x, w, g


def step(dot, x, w, g, sizes):
    y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
    new, d_x, d_w = vjp(g)
    return y, d_x, d_w, new


def both_paths(recipe, x, w, g, sizes, native_step=step):
    """(native, XLA) results of one step; the native one traced for the interpreter."""
    experts = np.shape(sizes)[-1]
    on = fp8jax.Fp8RaggedDot(recipe, num_experts=experts, native_kernel=True)
    off = fp8jax.Fp8RaggedDot(recipe, num_experts=experts, native_kernel=False)
    sizes = jnp.asarray(sizes)
    with interpreted():
        got = eqx.filter_jit(native_step)(on, x, w, g, sizes)
    want = eqx.filter_jit(native_step)(off, x, w, g, sizes)
    return got, want


def assert_close(got, want, terms):
    """Equal but for float32 summation order over `terms` products."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = f64(a), f64(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * terms * 2.0**-24 * np.abs(b).max())


@pytest.mark.parametrize("name", RECIPES)
def test_layer_on_the_kernels_matches_its_xla_path(name):
    x, w, g = layer_data(2)
    (y, d_x, d_w, new), (y0, d_x0, d_w0, new0) = both_paths(RECIPES[name], x, w, g, SIZES)
    assert_close(y, y0, FEATURES_IN)
    assert_close(d_x, d_x0, FEATURES_OUT)
    assert_close(d_w, d_w0, int(SIZES.sum()))
    np.testing.assert_array_equal(d_w[1], 0.0)  # the expert without tokens
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new0), strict=True):
        np.testing.assert_array_equal(a, b)  # the same state: quantization is shared


@pytest.mark.parametrize("kernel", ["rows", "tokens"])
def test_promote_sums_each_chunk_in_float32_registers_on_the_gpu_path(kernel):
    """Traced for the GPU (the code the interpreter tests cannot tell apart: it sums in
    float32 either way), `promote` adds each chunk's `wgmma` product to a float32 (64, 128)
    register sum; without it the chunks accumulate in the `wgmma` accumulator."""
    lhs, experts = jnp.ones((128, 256), E4M3), jnp.zeros(2, jnp.int32)

    def traced(promote):
        if kernel == "rows":
            call = lambda a, b, s: grouped_rows_gemm(  # noqa: E731
                a, b, RowItems.of_tiles(experts), item_scale=s, promote=promote, interpret=False
            )
            args = (lhs, jnp.ones((2, 128, 256), E4M3), jnp.ones(2))
        else:
            counts = jnp.ones(2, jnp.int32)
            call = lambda a, b, s: grouped_tokens_gemm(  # noqa: E731
                a, b, counts, counts, group_scale=s, promote=promote, interpret=False
            )
            args = (lhs, lhs, jnp.ones(2))
        return str(jax.make_jaxpr(call)(*args))

    register_sums = re.compile(r"f32\[64,128\][^\n]*= add ")
    assert register_sums.search(traced(True))
    assert not register_sums.search(traced(False))


@pytest.mark.parametrize("backward_precision", ["highest", "default"])
def test_backward_precision_decides_whether_the_kernels_promote(monkeypatch, backward_precision):
    """A per-tensor layer's forward accumulates in `wgmma` (cuBLASLt's fast accumulation);
    with `backward_precision="highest"` (the default, which turns fast accumulation off on
    cuBLASLt) the dgrad and wgrad kernels promote every chunk to float32; with "default"
    they do not."""
    from fp8jax._src.kernels import choice

    seen = []

    def spy(real, kind):
        def call(*args, promote=False, **kwargs):
            seen.append((kind, promote))
            return real(*args, promote=promote, **kwargs)

        return call

    monkeypatch.setattr(
        choice, "recipe_grouped_rows_gemm", spy(choice.recipe_grouped_rows_gemm, "rows")
    )
    monkeypatch.setattr(
        choice, "recipe_grouped_tokens_gemm", spy(choice.recipe_grouped_tokens_gemm, "tokens")
    )
    x, w, g = layer_data(4)
    recipe = fp8jax.DelayedScaling(backward_format="e4m3", backward_precision=backward_precision)
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=len(SIZES), native_kernel=True)
    with interpreted():  # traced afresh (a jitted step may come from another test's cache)
        jax.make_jaxpr(step)(dot, x, w, g, jnp.asarray(SIZES))
    highest = backward_precision == "highest"
    assert seen == [("rows", False), ("rows", highest), ("tokens", highest)], seen


def test_layer_on_the_kernels_in_bfloat16():
    x, w, g = (a.astype(jnp.bfloat16) for a in layer_data(3))
    (y, d_x, d_w, _), (y0, d_x0, d_w0, _) = both_paths(fp8jax.CurrentScaling(), x, w, g, SIZES)
    assert (y.dtype, d_x.dtype, d_w.dtype) == (jnp.bfloat16,) * 3
    for a, b in ((y, y0), (d_x, d_x0), (d_w, d_w0)):
        # Power-of-two scales: both round the same float32 values to BF16, but for summation.
        np.testing.assert_allclose(f64(a), f64(b), rtol=2.0**-7, atol=1e-6 * float(f64(b).max()))


def test_vmapped_layer_folds_into_one_native_grouped_gemm():
    """Under `vmap`, the members' tokens fold into one expert order and run in the kernels
    (the custom batching rules), as on the XLA path."""
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3], [3, 0, 3, 6]], np.int32)
    rng = np.random.default_rng(4)
    xs = (rng.standard_normal((3, 12, FEATURES_IN)) * 2).astype(np.float32)
    cs = rng.standard_normal((3, 12, FEATURES_OUT)).astype(np.float32)
    w = rng.standard_normal((4, FEATURES_IN, FEATURES_OUT)).astype(np.float32)

    def batched(dot, x, w, g, sizes):
        def loss(params):
            dot, w = params
            ys = jax.vmap(lambda x, s: dot(x, w, s))(x, sizes)
            return jnp.sum(ys * g)

        return fp8jax.filter_grad(loss)((dot, w))

    got, want = both_paths(fp8jax.DelayedScaling(backward_format="e4m3"), xs, w, cs, sizes, batched)
    assert_close(got[1], want[1], 36)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_no_tokens_at_all(recipe):
    """A batch that routed no token: zero gradients for every expert on both paths (the
    padded layout of no rows is all gaps)."""
    x, w = jnp.zeros((0, FEATURES_IN)), jnp.ones((4, FEATURES_IN, FEATURES_OUT))
    g = jnp.zeros((0, FEATURES_OUT))
    (y, d_x, d_w, _), (y0, d_x0, d_w0, _) = both_paths(recipe, x, w, g, np.zeros(4, np.int32))
    assert y.shape == y0.shape == (0, FEATURES_OUT) and d_x.shape == (0, FEATURES_IN)
    np.testing.assert_array_equal(d_w, 0.0)
    np.testing.assert_array_equal(d_w0, 0.0)


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise"])
@pytest.mark.parametrize("shape", [(0, FEATURES_OUT), (FEATURES_IN, 0)], ids=["K=0", "N=0"])
def test_an_empty_contraction_or_output_gives_zeros_as_lax(recipe, shape):
    """No features in (K = 0) or out: the per-tensor recipes' native kernels were traced with
    an empty grid and failed ("grid=(0,)"); now both paths give lax.ragged_dot's zeros, and
    gradients of the shapes of x and w."""
    features_in, features_out = shape
    x = jnp.ones((8, features_in))
    w = jnp.ones((4, features_in, features_out))
    g = jnp.ones((8, features_out))
    sizes = np.array([2, 2, 2, 2], np.int32)
    want = jax.lax.ragged_dot(x, w, jnp.asarray(sizes))
    for y, d_x, d_w, _ in both_paths(recipe, x, w, g, sizes):
        assert y.shape == want.shape and d_x.shape == x.shape and d_w.shape == w.shape
        for a in (y, d_x, d_w):
            np.testing.assert_array_equal(a, 0.0)


def test_cpu_compiles_keep_the_xla_path():
    """The default (`native_kernel=None`) compiles no Mosaic kernel on a CPU and computes
    exactly what the forced XLA path does; the layer follows BlockwiseScaling's own option
    when it has none."""
    x, w, g = layer_data(5)
    results, texts = [], []
    for native_kernel in (None, False):
        dot = fp8jax.Fp8RaggedDot(num_experts=4, native_kernel=native_kernel)
        params, static = eqx.partition(dot, eqx.is_array)
        jitted = jax.jit(lambda p, *a, static=static: step(eqx.combine(p, static), *a))
        texts.append(jitted.lower(params, x, w, g, jnp.asarray(SIZES)).compile().as_text())
        results.append(eqx.filter_jit(step)(dot, x, w, g, jnp.asarray(SIZES)))
    assert not any("mosaic" in text for text in texts)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="grouped_native_kernel='auto': should be None"):
        fp8jax.Fp8Config(grouped_native_kernel="auto")
    model = fp8jax.fp8_linear_layers(
        fp8jax.GroupedLinear(4, 8, 8, key=jax.random.PRNGKey(0)),
        fp8jax.Fp8Config(grouped_native_kernel=False),
    )
    assert model.ragged_dot.native_kernel is False
    off = fp8jax.BlockwiseScaling(native_kernel=False)
    assert grouped_dots.native_choice(off, None) is False
    assert grouped_dots.native_choice(off, True) is True
    assert grouped_dots.native_choice(fp8jax.MXFP8(), None) is False
    assert grouped_dots.native_choice(fp8jax.DelayedScaling(), None) is None


# --- the H100 compile -----------------------------------------------------------------------

H100_SCRIPT = """
import glob, json, os, re, sys
import jax, jax.numpy as jnp
import fp8jax
from fp8jax._src.observe import deviceless
from fp8jax.examples import moe_model as moe

recipe = {"delayed": fp8jax.DelayedScaling(),
          "delayed-e4m3": fp8jax.DelayedScaling(backward_format="e4m3"),
          "blockwise": fp8jax.BlockwiseScaling()}[sys.argv[1]]
native = {"auto": None, "xla": False, "persistent": None}[sys.argv[2]]
model = moe.MoEModel(width=256, hidden=512, experts=8, top_k=2, key=jax.random.PRNGKey(0))
config = fp8jax.Fp8Config(targets=["up", "down"], recipe=recipe, grouped_native_kernel=native)
model = fp8jax.fp8_linear_layers(model, config)
x = jax.ShapeDtypeStruct((1024, 16), jnp.bfloat16)

def step(model, x):
    loss = lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2)
    return fp8jax.filter_value_and_grad(loss)(model)

if sys.argv[2] == "persistent":  # traced on issue 39's persistent kernels
    from fp8jax._src.kernels.choice import persistent_kernel
    step = persistent_kernel()(step)
report = fp8jax.inspect(step, model, x, modes=("cublas",), merge_dots=False)
device = deviceless.h100_topology().devices[0]
lowered, _ = deviceless.lower(step, (model, x), {}, device)
hlo = lowered.compile().as_text()
ragged = lowered.as_text().count("chlo.ragged_dot")  # before XLA expands them
cost = fp8jax.hlo_cost(hlo)
experts = sum(k.flops * k.runs for k in cost.kernels if "fp8jax[moe." in k.op_name)
spill = re.compile(r"(\\d+) bytes spill (?:stores|loads)")
dump = os.environ.get("MOSAIC_GPU_DUMP_TO")
logs = [open(f).read() for f in glob.glob(os.path.join(dump, "*.ptxas"))] if dump else []
spills = [[int(n) for n in spill.findall(log)] for log in logs]
print(json.dumps({
    "gemms": [(g.layer, g.role, g.kernel, g.fp8, g.mma) for g in report.gemms["cublas"]],
    "ragged": ragged,
    "expert_flops": experts,
    "spills": spills,
    "serialized": sum(log.count("C7514") for log in logs),
}))
"""

#: The script's MoE step: 1,024 tokens, top-2 of 8 experts, 256 -> 512 -> 256.
ASSIGNMENTS, WIDTH, HIDDEN = 2048, 256, 512
#: Forward, dgrad and wgrad of both expert layers, each expert on its own tokens only.
IDEAL_FLOPS = 3 * 2 * (2 * ASSIGNMENTS * WIDTH * HIDDEN)


@pytest.fixture(scope="module")
def h100_runs(tmp_path_factory):
    pytest.importorskip("jax_cuda12_plugin")
    runs = {}

    def run(recipe, native):
        if (recipe, native) not in runs:
            dump = tmp_path_factory.mktemp("mosaic")
            done = run_with_mosaic_dump(H100_SCRIPT, [recipe, native], dump)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[recipe, native] = json.loads(done.stdout.strip().splitlines()[-1])
        return runs[recipe, native]

    return run


EXPERT_GEMMS = {(layer, role) for layer in ("moe.up", "moe.down") for role in ("fwd", "dgrad")}
EXPERT_GEMMS |= {("moe.up", "wgrad"), ("moe.down", "wgrad")}
FP8_MMA = re.compile(r"wgmma\.mma_async\..*\.(e4m3|e5m2)\.(e4m3|e5m2)$")


@pytest.mark.parametrize(
    "recipe, kernels",
    # Blockwise on the persistent kernels, a GPU's default (the tiled ones lower in
    # test_h100_expert_weights_reach_the_kernels_without_an_fp8_transpose; CI time).
    [("delayed-e4m3", "auto"), ("blockwise", "persistent")],
)
def test_h100_runs_every_expert_gemm_in_the_fp8_kernels(h100_runs, recipe, kernels):
    """E4M3 gradients (or blockwise scaling): forward, dgrad and wgrad of both expert layers
    are Mosaic GPU kernels whose PTX multiplies FP8 with `wgmma`; ptxas spills nothing and
    serializes no `wgmma` (its warning C7514); no ragged dot is left for XLA to expand. So
    also on the persistent kernels (traced inside `persistent_kernel()`: rows and tokens),
    whose FLOPs `hlo_cost` counts as the grouped GEMMs they are (each expert's tokens, not a
    dense GEMM over all experts)."""
    seen = h100_runs(recipe, kernels)
    if kernels == "persistent":
        assert IDEAL_FLOPS <= seen["expert_flops"] <= 1.6 * IDEAL_FLOPS, (
            seen["expert_flops"] / IDEAL_FLOPS
        )
    experts = [g for g in seen["gemms"] if g[0] and g[0].startswith("moe.")]
    assert {(layer, role) for layer, role, *_ in experts} == EXPERT_GEMMS, experts
    for layer, role, kernel, fp8, mma in experts:
        assert kernel == "pallas mosaic gpu" and fp8, (layer, role, kernel, mma)
        assert mma and all(FP8_MMA.match(m) for m in mma), mma
    assert seen["ragged"] == 0
    assert seen["spills"] and all(s and not any(s) for s in seen["spills"]), seen["spills"]
    assert seen["serialized"] == 0, seen


def test_h100_e5m2_gradients_run_dgrad_and_wgrad_in_fp8_where_wgmma_takes_the_pair(h100_runs):
    """Delayed scaling's default E5M2 gradients: where this JAX's Mosaic GPU `wgmma` takes
    E5M2 with E4M3 (JAX 0.11 on), the dgrad and wgrad multiply them in FP8 (`e5m2.e4m3`, or
    `e4m3.e5m2` for the wgrad's activation times gradient); on JAX 0.10, whose `wgmma` takes
    one type, they run in the same kernels on BF16 upcasts (exact, honestly not FP8). The
    forward is E4M3 either way. Each GEMM's PTX is its own kernel's: the dgrad's lhs is the
    gradient (`e5m2.e4m3`), the wgrad's the activation (`e4m3.e5m2`), whatever order XLA
    schedules the backward's kernels in (`fp8jax.inspect` matches Mosaic's dumps to the calls
    in program order)."""
    seen = h100_runs("delayed", "auto")
    experts = [g for g in seen["gemms"] if g[0] and g[0].startswith("moe.")]
    assert {(layer, role) for layer, role, *_ in experts} == EXPERT_GEMMS
    mixed = mosaic_private.mixed_fp8_wgmma()
    for layer, role, kernel, fp8, mma in experts:
        assert kernel == "pallas mosaic gpu", (layer, role, kernel)
        assert fp8 == (role == "fwd" or mixed), (layer, role, mma)
        if role == "fwd":
            want = (".e4m3.e4m3",)
        else:
            want = {"dgrad": (".e5m2.e4m3",), "wgrad": (".e4m3.e5m2",)}[role]
            want = want if mixed else (".bf16.bf16",)
        assert mma and all(m.endswith(want) for m in mma), (layer, role, mma)


def test_h100_expert_work_grows_with_tokens_not_tokens_times_experts(h100_runs):
    """The kernels' GEMM FLOPs (their padded static shapes: an upper bound on the work; the
    persistent kernels, a GPU's default) are within 1.6x of the experts' own FLOPs (each
    expert's rows padded to whole tiles); XLA's path, which expands each ragged dot into a
    dense GEMM over all experts, does about the number of experts (8) times as much."""
    native_flops = h100_runs("blockwise", "persistent")["expert_flops"]
    xla_flops = h100_runs("blockwise", "xla")["expert_flops"]
    assert IDEAL_FLOPS <= native_flops <= 1.6 * IDEAL_FLOPS, native_flops / IDEAL_FLOPS
    assert xla_flops >= 6 * IDEAL_FLOPS, xla_flops / IDEAL_FLOPS
    assert h100_runs("blockwise", "xla")["ragged"] > 0  # what the kernels replace


def test_the_moe_page_quotes_the_expert_flops_this_compile_counts(h100_runs):
    """docs/moe.md said `hlo_cost` counts 1.33x the experts' own FLOPs on this compile, an
    older kernels' padding; it counts 7/6 (1.17x) now, and 9.33x on XLA's path. The page's
    figures are this compile's, rounded to the digits it quotes."""
    native = h100_runs("blockwise", "persistent")["expert_flops"] / IDEAL_FLOPS
    xla = h100_runs("blockwise", "xla")["expert_flops"] / IDEAL_FLOPS
    page = " ".join((pathlib.Path(__file__).parents[1] / "docs" / "moe.md").read_text().split())
    ((kernels, dense),) = re.findall(
        r"`fp8jax.hlo_cost` counts ([\d.]+)x the experts' own FLOPs .*? against ([\d.]+)x for "
        r"XLA's path",
        page,
    )
    assert (kernels, dense) == (f"{native:.2f}", f"{xla:.1f}"), (kernels, dense, native, xla)


@pytest.mark.parametrize("recipe", ["blockwise", "delayed-e4m3"])
def test_h100_expert_weights_reach_the_kernels_without_an_fp8_transpose(recipe):
    """Blockwise expert weights are quantized per expert, as stored, by the weight kernel,
    which writes each expert's blocks in both layouts in one pass: the forward's (K-major)
    and the dgrad's. On a compile for an H100 both GEMMs take their copy as written: no
    kernel transposes an expert weight, FP8 or BF16 (before: per layer, the BF16 weight once
    and its FP8 copies twice, 3.76 GB on moe_cost.py's Mixtral layer). Nor the wgrad's
    operands: the padded kernels gather and quantize them into 128 x 1 tiles written K-major
    (before, XLA quantized and transposed them), the output gradient's dgrad copy in the
    same read. Per-tensor weights multiplied in FP8 (E4M3
    gradients): XLA writes the dgrad's copy in the pass that quantizes the forward's (before,
    a kernel transposed each expert's FP8 weight in the backward)."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.observe import deviceless

    dot = fp8jax.Fp8RaggedDot(RECIPES[recipe], num_experts=4)
    w = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
    sizes = jnp.array([256, 256, 384, 128], jnp.int32)

    def step(dot, x, w):
        loss = lambda dxw: jnp.mean(dxw[0](dxw[1], dxw[2], sizes).astype(jnp.float32) ** 2)  # noqa: E731
        return fp8jax.filter_grad(loss)((dot, x, w))

    lowered, _ = deviceless.lower(step, (dot, x, w), {}, deviceless.h100_topology().devices[0])
    entry = lowered.compile().as_text().split("\nENTRY")[1]
    assert "mosaic_gpu" in entry  # the grouped kernels run here
    transposed = re.findall(r"%\S*transpose\S* = (\w+\[[^\]]*\])", entry)
    assert not [t for t in transposed if t.count(",") == 2], transposed  # (G, ., .) weights
    if recipe == "blockwise":  # nor the wgrad's operands
        assert not transposed, transposed
        # The output gradient's two copies from one kernel, the activation's from another.
        for name in ("quantize_rows_and_padded_columns", "requantize_padded_columns"):
            assert f"fp8jax_{name}/pallas_call" in entry
        assert "fp8jax_quantize_padded_columns/" not in entry


@pytest.mark.parametrize("persistent", [False, True], ids=["tiled", "persistent"])
def test_h100_lowers_rows_that_fill_no_whole_8_row_tile(persistent):
    """A layer whose tokens (here 2,338) are not a multiple of 8 lowers for an H100, on
    the tiled and on the persistent kernels: Mosaic GPU's TMA takes a tiled operand's rows in
    whole 8-row tiles, so the kernels pad them (the grouped layer failed to lower on an H200
    at the GPU check's 2,338 rows, run 4)."""
    pytest.importorskip("jax_cuda12_plugin")
    from fp8jax._src.kernels.choice import persistent_kernel, tiled_kernel
    from fp8jax._src.observe import deviceless

    sizes = jnp.array([700, 0, 1300, 5, 333], jnp.int32)
    dot = fp8jax.Fp8RaggedDot(fp8jax.BlockwiseScaling(), num_experts=5)
    x = jax.ShapeDtypeStruct((2338, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5, 256, 384), jnp.bfloat16)

    def step(dot, x, w):
        loss = lambda dxw: jnp.mean(dxw[0](dxw[1], dxw[2], sizes).astype(jnp.float32) ** 2)  # noqa: E731
        return fp8jax.filter_grad(loss)((dot, x, w))

    with persistent_kernel() if persistent else tiled_kernel():
        lowered, _ = deviceless.lower(step, (dot, x, w), {}, deviceless.h100_topology().devices[0])
    entry = lowered.compile().as_text().split("\nENTRY")[1]
    kernels = set(re.findall(r"fp8jax_grouped_\w+_gemm\w*", entry))
    want = ("_persistent" if persistent else "") + "_mosaic_gpu"
    assert {f"fp8jax_grouped_{kind}_gemm{want}" for kind in ("rows", "tokens")} <= kernels


@pytest.mark.parametrize(
    "precision, promote",
    [
        (None, False),
        ("default", False),
        (("default", "highest"), True),
        (lax.Precision.HIGHEST, True),
        (lax.DotAlgorithmPreset.DEFAULT, False),
        (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM, False),
        ("ANY_F8_ANY_F8_F32", True),
        (lax.DotAlgorithmPreset.F32_F32_F32, True),
    ],
)
def test_the_kernels_promote_where_the_precision_asks_for_more(precision, promote):
    """Every precision `lax.ragged_dot` takes tells the kernels whether to promote each chunk
    (an algorithm preset raised "... is not a valid Precision"): an algorithm with FP8's fast
    accumulation or none asked does not, as the default precision does not."""
    from fp8jax._src.gemm.grouped_dots import promotes

    assert promotes(precision) is promote

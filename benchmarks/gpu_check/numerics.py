"""Section 1: every native kernel's numerics, against float64 NumPy and against the XLA path.

Operands are FP8 (or BF16) values with power-of-two scales: each chunk's product is exact
in float32, so a kernel may differ from the float64 reference (`fp8jax._src.kernels.reference`)
only by float32 summation, and from the XLA path only by summation order. The bounds are the
interpreter tests' (`tests/test_kernels.py`, `tests/test_grouped_native.py`). Shapes are odd
where the kernels take that (M, N, K not multiples of their tiles), expert groups uneven and
one empty. The quantization kernels (Triton) are checked bit for bit against IEEE NumPy at a
small shape (`quantization`: the quantize section's check, run in every call with numerics).
"""

from __future__ import annotations

import contextlib
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

import fp8jax
from fp8jax._src.kernels import reference
from fp8jax._src.kernels.block_gemm import block_scaled_gemm
from fp8jax._src.kernels.choice import chained_pipelines, persistent_kernel, tiled_kernel
from fp8jax._src.kernels.grouped_gemm import grouped_rows_gemm, grouped_tokens_gemm, row_items
from fp8jax._src.recipes.block_dot import block_dot, native_block_dot
from fp8jax._src.recipes.residual import QTerms, native_residual_dot

from . import quantize
from .record import Recorder
from .timing import kernels

SECTION = "1 numerics"
#: The interpreter's MMA is an exact float32 dot; Hopper's FP8 `wgmma` is reported to keep
#: about 14 bits while it accumulates a 128-element chunk (DeepSeek-V3), which could exceed
#: the tests' float32 bounds by itself: up to 128 x 2^-14 = 2^-7 of the magnitude. Beyond
#: that, an error is the kernel's (a wrong tile, expert or scale is of order 1).
WGMMA_REL = 2.0**-7
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The odd shapes of one run: (M, N, K) of the dense kernels, the experts' row counts
    and the rows (M) of the rows kernel, the chunk counts of the tokens kernel, the grouped
    layer's sizes."""

    dense: tuple[int, int, int]
    residual: tuple[int, int, int]
    rows_nk: tuple[int, int]
    row_sizes: tuple[int, ...]
    rows: int
    tokens_ab: tuple[int, int]
    chunk_count: tuple[int, ...]
    layer_sizes: tuple[int, ...]
    layer_features: tuple[int, int]


GPU = Shapes(
    dense=(1000, 1500, 1100),
    residual=(777, 1000, 900),
    rows_nk=(1000, 1100),
    row_sizes=(70, 0, 300, 129, 1, 64),
    rows=600,
    tokens_ab=(520, 1000),
    chunk_count=(3, 0, 5, 1),
    layer_sizes=(700, 0, 1300, 5, 333),
    layer_features=(1000, 900),
)
DRY = Shapes(
    dense=(40, 130, 200),
    residual=(33, 70, 150),
    rows_nk=(72, 200),
    row_sizes=(20, 0, 45),
    rows=70,
    tokens_ab=(40, 72),
    chunk_count=(1, 0, 2),
    layer_sizes=(20, 0, 45, 5),
    layer_features=(72, 40),
)


def f64(a: ArrayLike) -> np.ndarray:
    return reference.f64(jnp.asarray(a, jnp.float32))


def _values(rng, shape, dtype, spread=4.0):
    return jnp.asarray(rng.standard_normal(shape) * spread, dtype)


def _pow2(rng, shape):
    return jnp.asarray(2.0 ** rng.integers(-4, 4, shape), jnp.float32)


def compare(got: ArrayLike, want: ArrayLike, bound: ArrayLike | float) -> dict:
    """Max error relative to max |want|, and whether every element is within `bound`."""
    got, want = f64(got), np.asarray(want, np.float64)
    error = np.abs(got - want)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return {
        "max_rel_err": float(error.max(initial=0.0)) / scale,
        "within_bound": bool(np.all(error <= np.asarray(bound) + 1e-30)),
    }


def _result(vs_f64: dict | None, vs_xla: dict | None, shape: str, bound: str) -> dict:
    parts = [v for v in (vs_f64, vs_xla) if v is not None]
    return {
        "shape": shape,
        "bound": bound,
        "rel_err_vs_f64": vs_f64["max_rel_err"] if vs_f64 else None,
        "rel_err_vs_xla": vs_xla["max_rel_err"] if vs_xla else None,
        "passed": all(p["within_bound"] for p in parts),
        "within_wgmma_bound": all(p["max_rel_err"] <= WGMMA_REL for p in parts),
    }


def block_gemm(shapes: Shapes, fmt: DTypeLike, dry: bool) -> dict:
    """`block_scaled_gemm` (1 x 128 scales on both operands) against float64 and against
    `block_dot`, the blockwise recipe's XLA path, on the same FP8 operands and scales."""
    rng = np.random.default_rng(0)
    m, n, k = shapes.dense
    chunks = -(-k // 128)
    lhs, ls = _values(rng, (m, k), fmt), _pow2(rng, (m, chunks))
    rhs, rs = _values(rng, (n, k), fmt), _pow2(rng, (n, chunks))
    with kernels(dry):
        out = jax.jit(lambda *a: block_scaled_gemm(a[0], a[1], [(a[2], a[3])]))(lhs, ls, rhs, rs)
    xla = jax.jit(
        lambda *a: block_dot(
            fp8jax.QTensor(a[0], a[1], (1, 128)),
            fp8jax.QTensor(a[2], a[3], (1, 128)),
            -1,
            -1,
            HIGHEST,
        )
    )(lhs, ls, rhs, rs)
    want = reference.block_scaled(lhs, ls, [(rhs, rs)])
    magnitude = reference.block_scaled_magnitude(lhs, ls, [(rhs, rs)])
    return _result(
        compare(out, want, reference.BLOCK_RTOL * magnitude),
        compare(out, xla, reference.BLOCK_RTOL * magnitude),
        f"{m}x{n}x{k} {jnp.dtype(fmt).name}",
        f"|err| <= {reference.BLOCK_RTOL:g} * |A| |B| (elementwise)",
    )


def blockwise_recipe(shapes: Shapes, dry: bool) -> dict:
    """The blockwise recipe's three GEMMs on the kernel (`native_block_dot`: 1 x 128 tiles
    times 128 x 128 blocks, and the retiled dgrad and wgrad) against its XLA path; on a GPU
    the recipes' default kernel, the persistent one since run 4 (`choice`)."""
    recipe = fp8jax.BlockwiseScaling(native_kernel=False)
    rng = np.random.default_rng(1)
    m, n, k = shapes.dense
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((m, n)) * 1e-3, jnp.float32)

    def operands(x, w, g):  # traced once: eager quantization is slow on a CPU
        def q(v, role):
            return recipe.quantize(v, recipe.init_state(role), role, -1)[0]

        q_x, q_w, q_g = q(x, "input"), q(w, "kernel"), q(g, "output_grad")
        return {
            "fwd": (q_x, q_w),
            "dgrad": (q_g, recipe.retile(q_w, "kernel", -2, source=w)),
            "wgrad": (
                recipe.retile(q_g, "output_grad", -2, source=g),
                recipe.retile(q_x, "input", -2),
            ),
        }

    axes = {"fwd": (-1, -1), "dgrad": (-1, -2), "wgrad": (-2, -2)}
    cases = {k: (*v, *axes[k]) for k, v in jax.jit(operands)(x, w, g).items()}
    worst, passed = 0.0, True
    for lhs, rhs, la, ra in cases.values():
        with kernels(dry):
            got = jax.jit(lambda a, b, la=la, ra=ra: native_block_dot(a, b, la, ra))(lhs, rhs)
        xla_path = jax.jit(lambda a, b, la=la, ra=ra: block_dot(a, b, la, ra, HIGHEST))
        xla = xla_path(lhs, rhs)
        magnitude = f64(xla_path(*jax.tree.map(jnp.abs, (lhs, rhs))))
        result = compare(got, xla, 2e-6 * magnitude)
        worst, passed = max(worst, result["max_rel_err"]), passed and result["within_bound"]
    return _result(
        None,
        {"max_rel_err": worst, "within_bound": passed},
        f"{m}x{n}x{k} fwd, dgrad, wgrad",
        "|err| <= 2e-6 * |A| |B| vs the XLA path (the kernel tests' bound)",
    )


def residual(shapes: Shapes, dry: bool) -> dict:
    """The residual recipe's fused kernel (`A.W_hi s_hi + A.W_lo s_lo`, one kernel) against
    float64 and against its XLA path (two cuBLASLt-form FP8 dots summed in float32)."""
    rng = np.random.default_rng(2)
    m, n, k = shapes.residual
    a = fp8jax.QTensor(_values(rng, (m, k), E4M3), jnp.float32(0.25))
    hi = fp8jax.QTensor(_values(rng, (n, k), E4M3), jnp.float32(2.0**-6))
    lo = fp8jax.QTensor(_values(rng, (n, k), E4M3), jnp.float32(2.0**-11))
    lhs, rhs = QTerms((a,)), QTerms((hi, lo))
    with kernels(dry):
        got = jax.jit(lambda a, b: native_residual_dot(a, b, -1, -1))(lhs, rhs)
    xla_recipe = fp8jax.ResidualFP8(native_kernel=False)
    xla = jax.jit(lambda a, b: xla_recipe.dot(a, b, -1, -1, HIGHEST))(lhs, rhs)
    chunks = -(-k // 128)

    def rows(q, r):
        return np.full((r, chunks), float(q.scale_inv))

    terms = [(hi.data, rows(hi, n)), (lo.data, rows(lo, n))]
    want = reference.block_scaled(a.data, rows(a, m), terms)
    magnitude = reference.block_scaled_magnitude(a.data, rows(a, m), terms)
    return _result(
        compare(got, want, reference.BLOCK_RTOL * magnitude),
        compare(got, xla, reference.BLOCK_RTOL * magnitude),
        f"{m}x{n}x{k}, 2 terms",
        f"|err| <= {reference.BLOCK_RTOL:g} * |A| (|W_hi| + |W_lo|) (elementwise)",
    )


def rows_kernel(shapes: Shapes, scaling: str, dtype: DTypeLike, dry: bool) -> dict:
    """`grouped_rows_gemm` against float64 on unpadded rows (`row_items`): experts sharing
    tiles, an expert without rows, rows past every expert (zeros), the last tile partial,
    K and N not multiples of the tiles."""
    rng = np.random.default_rng(3)
    sizes = np.asarray(shapes.row_sizes, np.int32)
    g, (n, k), m = len(sizes), shapes.rows_nk, shapes.rows
    chunks = -(-k // 128)
    lhs, rhs = _values(rng, (m, k), dtype, 3.0), _values(rng, (g, n, k), dtype, 1.0)
    items = row_items(jnp.asarray(sizes), m)
    if scaling == "blocks":
        kw = {"lhs_scale": _pow2(rng, (m, chunks)), "rhs_scale": _pow2(rng, (g, n, chunks))}
    else:
        kw = {"item_scale": _pow2(rng, items.tile.shape)}
    with kernels(dry):
        out = jax.jit(lambda *a: grouped_rows_gemm(*a, **kw))(lhs, rhs, items)
    want = reference.grouped_rows(lhs, rhs, items, **kw)
    bound = np.zeros_like(want)
    for rows in np.split(np.arange(m), np.cumsum(sizes))[:g]:  # per expert, as the test
        if rows.size:
            bound[rows] = reference.float32_sum_bound(k, np.abs(want[rows]).max())
    return _result(
        compare(np.asarray(out), want, bound),
        None,
        f"{m}x{n}x{k} {jnp.dtype(dtype).name}, experts' rows {sizes.tolist()}, {scaling}",
        "|err| <= 2 K 2^-24 max|expert's rows| (float32 sums); zeros past the experts",
    )


def tokens_kernel(shapes: Shapes, scaling: str, dry: bool) -> dict:
    """`grouped_tokens_gemm` against float64: uneven chunk counts, one expert with none
    (zeros)."""
    rng = np.random.default_rng(4)
    count = np.asarray(shapes.chunk_count, np.int32)
    start = (np.cumsum(count) - count).astype(np.int32)
    (a_rows, b_rows), g, t = shapes.tokens_ab, len(count), 128 * int(count.sum())
    lhs, rhs = _values(rng, (a_rows, t), E4M3, 2.0), _values(rng, (b_rows, t), E4M3, 1.0)
    chunks = t // 128
    if scaling == "blocks":
        kw = {"lhs_scale": _pow2(rng, (a_rows, chunks)), "rhs_scale": _pow2(rng, (b_rows, chunks))}
    else:
        kw = {"group_scale": _pow2(rng, (g,))}
    with kernels(dry):
        out = jax.jit(lambda *a: grouped_tokens_gemm(*a, **kw))(
            lhs, rhs, jnp.asarray(start), jnp.asarray(count)
        )
    want = reference.grouped_tokens(lhs, rhs, start, count, **kw)
    bound = np.stack([reference.float32_sum_bound(t, np.abs(w).max()) + 0 * w for w in want])
    return _result(
        compare(out, want, bound),
        None,
        f"({a_rows}, {b_rows}) over {t} tokens, chunks per expert {count.tolist()}, {scaling}",
        "|err| <= 2 T 2^-24 max|expert| (float32 sums); zeros for the empty expert",
    )


def grouped_layer(
    shapes: Shapes, recipe: fp8jax.Recipe, dry: bool, persistent=False, chained=False
) -> dict:
    """`Fp8RaggedDot` forward, dgrad and wgrad on the kernels against its XLA path (the same
    quantization; float32 summation order aside), with an expert that gets no token. With
    `persistent`, on issue 39's persistent kernels (rows and tokens, `persistent_kernel()`:
    the layers' default on a GPU since run 4), else on the tiled ones (`tiled_kernel()`);
    with `chained` too, their programs' tiles chained (`chained_pipelines()`: the tokens
    GEMM streamed)."""
    sizes = np.asarray(shapes.layer_sizes, np.int32)
    fin, fout = shapes.layer_features
    rng = np.random.default_rng(5)
    m = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((m, fin)) * 3, jnp.float32)
    spread = np.geomspace(0.01, 30.0, len(sizes))[:, None, None]
    w = jnp.asarray(rng.standard_normal((len(sizes), fin, fout)) * spread, jnp.float32)
    g = jnp.asarray(rng.standard_normal((m, fout)) * 1e-3, jnp.float32)

    def step(dot, x, w, g, sizes):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        return (y, *vjp(g)[1:])

    def run(native_kernel, *contexts):
        dot = fp8jax.Fp8RaggedDot(recipe, num_experts=len(sizes), native_kernel=native_kernel)
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            return eqx.filter_jit(step)(dot, x, w, g, jnp.asarray(sizes))

    chosen = [persistent_kernel() if persistent else tiled_kernel()]
    if chained:
        chosen.append(chained_pipelines())
    got, want = run(True, kernels(dry), *chosen), run(False, kernels(False))
    worst, passed = 0.0, True
    for a, b, terms in zip(got, want, (fin, fout, m), strict=True):
        bound = 2 * reference.float32_sum_bound(terms, np.abs(f64(b)).max(initial=0.0))
        result = compare(a, b, bound)
        worst, passed = max(worst, result["max_rel_err"]), passed and result["within_bound"]
    empty = bool(np.all(f64(got[2])[sizes == 0] == 0.0))
    return _result(
        None,
        {"max_rel_err": worst, "within_bound": passed and empty},
        f"sizes {sizes.tolist()}, {fin} -> {fout}, fwd + dgrad + wgrad",
        "|err| <= 4 terms 2^-24 max|XLA| (the tests' bound); zero wgrad for the empty expert",
    )


def quantization(dry: bool) -> dict:
    """The quantization kernels against IEEE NumPy at a small shape, so that every GPU run
    checks them (`quantize.numerics`, which the quantize section repeats at LLM shapes):
    each kernel in its default (since session 39 the weight's blocks too), the sweep's
    widened transpose and slabs of rows (session 39), and the expert layer's gradient in one
    kernel (`quantize_rows_and_padded_columns`, its default since session 38). Elements that
    differ must be none."""
    result = quantize.numerics((256, 384) if dry else (2048, 1024), dry)
    differing = result["kernel_elements_differing_from_ieee"]
    return {
        "shape": f"{result['shape']}, elements != IEEE: {sum(differing.values())}",
        "bound": "bit for bit with IEEE NumPy",
        "rel_err_vs_f64": None,
        "rel_err_vs_xla": None,
        "passed": result["passed"],
        "within_wgmma_bound": False,  # no wgmma: any difference from IEEE is a failure
        "differing": differing,
    }


#: Items the quick run leaves out: another format or recipe on the same code paths.
QUICK_SKIPS = (
    "block_gemm e5m2",
    "grouped rows, bf16 operands",
    "grouped layer, delayed e4m3",
    "grouped layer, delayed e4m3, persistent kernels",
    "grouped layer, delayed e4m3, chained persistent kernels",
)
#: Items the dry run leaves out: the same code paths as others (in another format, or
#: through a recipe), each interpreted kernel costing seconds.
DRY_SKIPS = (
    "block_gemm e5m2",
    "grouped rows, bf16 operands",
    "block_gemm in the blockwise recipe",  # and the recipe-level items, which the kernel
    "grouped layer, blockwise",  # tests interpret already
    "grouped layer, delayed e4m3",
    "grouped layer, delayed (e5m2 gradients)",
    # JAX 0.10's interpreter cannot run the persistent kernels (tests/test_persistent_gemm.py
    # interprets them under 0.11 and later)
    "grouped layer, blockwise, persistent kernels",
    "grouped layer, delayed e4m3, persistent kernels",
    "grouped layer, blockwise, chained persistent kernels",
    "grouped layer, delayed e4m3, chained persistent kernels",
)


def words_step(dry: bool) -> dict:
    """A per-tensor MLP's gradients and new state on the GPU's path (K-major operands, the
    output gradients' copies transposed apart) with the copies transposed in 32-bit words
    (`transposes_in_words`) against the same step without: the same bytes, so every
    element equal (bound 0)."""
    from fp8jax._src.recipes.per_tensor import transposes_in_words
    from fp8jax.examples.gpt import MLP

    width, tokens = (64, 128) if dry else (512, 1024)
    recipe = fp8jax.DelayedScaling(warm_start=False)  # the steady state's cast and copies
    model = fp8jax.fp8_linear_layers(
        MLP(width, 1, False, key=jax.random.key(0)), fp8jax.Fp8Config(recipe=recipe)
    )
    x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.bfloat16)

    def grads(words: bool):
        def loss(m, x):
            return jnp.mean(m(x).astype(jnp.float32) ** 2)

        with transposes_in_words() if words else contextlib.nullcontext():
            return eqx.filter_jit(fp8jax.filter_grad(loss))(model, x)

    leaves = [jax.tree.leaves(eqx.filter(grads(w), eqx.is_array)) for w in (True, False)]
    got = np.concatenate([f64(a).ravel() for a in leaves[0]])
    want = np.concatenate([f64(a).ravel() for a in leaves[1]])
    same = compare(got, want, 0.0)
    return _result(None, same, f"MLP {width} -> {4 * width}, {tokens} tokens", "0 (same bytes)")


def run(rec: Recorder, mode: str) -> None:
    """Every kernel's numerics, each a measurement of its own (`mode`: full, quick, dry)."""
    dry = mode == "dry"
    shapes = DRY if dry else GPU
    items = {
        "block_gemm e4m3": lambda: block_gemm(shapes, E4M3, dry),
        "block_gemm e5m2": lambda: block_gemm(shapes, E5M2, dry),
        "block_gemm in the blockwise recipe": lambda: blockwise_recipe(shapes, dry),
        "fused residual kernel": lambda: residual(shapes, dry),
        "per-tensor step, transposes in words": lambda: words_step(dry),
        "quantization kernels vs IEEE": lambda: quantization(dry),
        "grouped rows, block scales": lambda: rows_kernel(shapes, "blocks", E4M3, dry),
        "grouped rows, item scale": lambda: rows_kernel(shapes, "item", E4M3, dry),
        "grouped rows, bf16 operands": lambda: rows_kernel(shapes, "item", jnp.bfloat16, dry),
        "grouped tokens, block scales": lambda: tokens_kernel(shapes, "blocks", dry),
        "grouped tokens, group scale": lambda: tokens_kernel(shapes, "group", dry),
        "grouped layer, blockwise": lambda: grouped_layer(shapes, fp8jax.BlockwiseScaling(), dry),
        "grouped layer, delayed e4m3": lambda: grouped_layer(
            shapes, fp8jax.DelayedScaling(backward_format="e4m3"), dry
        ),
        # The default recipe: E5M2 gradients times E4M3 in one wgmma from JAX 0.11 on.
        "grouped layer, delayed (e5m2 gradients)": lambda: grouped_layer(
            shapes, fp8jax.DelayedScaling(), dry
        ),
        "grouped layer, blockwise, persistent kernels": lambda: grouped_layer(
            shapes, fp8jax.BlockwiseScaling(), dry, persistent=True
        ),
        "grouped layer, delayed e4m3, persistent kernels": lambda: grouped_layer(
            shapes, fp8jax.DelayedScaling(backward_format="e4m3"), dry, persistent=True
        ),
        "grouped layer, blockwise, chained persistent kernels": lambda: grouped_layer(
            shapes, fp8jax.BlockwiseScaling(), dry, persistent=True, chained=True
        ),
        "grouped layer, delayed e4m3, chained persistent kernels": lambda: grouped_layer(
            shapes,
            fp8jax.DelayedScaling(backward_format="e4m3"),
            dry,
            persistent=True,
            chained=True,
        ),
    }
    for name in {"dry": DRY_SKIPS, "quick": QUICK_SKIPS}.get(mode, ()):
        del items[name]
    for name, fn in items.items():
        result = rec.measure(SECTION, name, fn)
        if result is None:
            rec.cell(SECTION, name, "result", rec.not_run())
            continue
        verdict = "pass" if result["passed"] else "FAIL"
        if not result["passed"] and result["within_wgmma_bound"]:
            verdict += " (within the wgmma accumulation bound)"
        rec.cell(SECTION, name, "result", verdict)
        for column, key in (("rel err vs f64", "rel_err_vs_f64"), ("vs XLA", "rel_err_vs_xla")):
            value = result[key]
            rec.cell(SECTION, name, column, "-" if value is None else f"{value:.1e}")
        rec.cell(SECTION, name, "shape", result["shape"])

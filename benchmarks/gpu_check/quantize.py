"""Section 2d (issue 39, deliverable 3): the one-pass quantization kernels of DeepSeek-V3's
blockwise recipe (`fp8jax._src.kernels.block_quantize`) on the GPU.

1. Numerics: each kernel at an LLM-sized shape with heavy-tailed data, bit for bit against an
   IEEE NumPy reference computed on the host (the kernels divide with `div.rn.f32`); beside
   it, how many elements of XLA's own GPU quantization (the recipe's XLA path, whose fusions
   divide with `div.full.f32`) differ from the same reference. So also the padded kernels
   (`padded_quantize`: an expert layer's wgrad tiles, gathered into the padded layout of
   eight uneven experts) against the reference of the gathered copy, and the expert
   layer's gradient in one kernel (`quantize_rows_and_padded_columns`: its rows and its
   gathered columns) against both references.
2. Timing: what the recipe quantizes per Linear, by the kernels and by its XLA path, side by
   side at Llama-3-8B's shapes (8,192 tokens): an activation in rows (forward), the output
   gradient in rows and columns (dgrad and wgrad), the saved activation requantized into
   columns (wgrad) and a weight with its dgrad copy, and the two gathered into an expert
   layer's padded layout (the gradient also with its rows in one kernel, as the expert
   layer's backward runs it since session 38; a decision line compares it with the rows and
   the gathered columns apart): ms and GB/s of the bytes each must move.
   Beside them, delayed scaling's per-tensor cast with its transposed copy and amax: XLA's
   fusion and reductions (`per_tensor_xla`) against one pass of `cast_transpose` (issue 38:
   XLA's transposing FP8 fusions moved 1.3-2.5 TB/s in run 6's Llama profile).
3. Sweep (full run): each kernel that writes a transposed copy, alone, in each of its
   `TUNINGS` (`block_quantize.ColumnTuning`: warps per program; for the per-tensor cast also
   transposing before the cast, the only kernel where that compiles to other instructions;
   for all but the weight's, the FP8 tile widened to BF16 to transpose, `wide_transpose`,
   which replaces the byte-wise gather through shared memory by `ldmatrix`; since session
   39 every kernel, the rows kernel too, in slabs of rows, `slab_rows`: fewer registers,
   more programs per SM). Run 6 swept the rows-and-columns kernel (4 warps: 1.5-1.7x faster
   than 8, and so its default since); the others are swept from then on. The fastest tuning
   per kernel is a decision line.

The decision input says whether the kernels are the faster path at every shape (they are the
recipe's default on Hopper since this section was written; a slower kernel is reported).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp8jax
from fp8jax._src.core.formats import saturate
from fp8jax._src.kernels import block_quantize, padded_quantize
from fp8jax._src.kernels.cast_transpose import cast_transpose
from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE

from . import timing
from .record import Recorder
from .timing import compile_and_time

SECTION = "2d quantization kernels"
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
RULE = dict(max_scale=MAX_SCALE)

#: (rows, cols) per case: Llama-3-8B at 8,192 tokens (width 4096, SwiGLU 14336).
SHAPES = {
    "activation 8192x4096": (8192, 4096),
    "gradient 8192x14336": (8192, 14336),
    "weight 14336x4096": (14336, 4096),
}
DRY_SHAPES = {"dry 256x384": (256, 384)}
#: Widened to BF16 to transpose (session 38): `ldmatrix` where the default gathers bytes.
_WIDE = block_quantize.ColumnTuning(num_warps=4, wide_transpose=True)
#: In slabs of rows (session 39): a program holds 32 (16) rows of its tile at a time, 32-128
#: registers a thread where whole tiles take 96-255 (ptxas; `quantize_ptx.py`), so four to
#: ten programs share an SM where one to five did.
_SLABS = (
    block_quantize.ColumnTuning(num_warps=4, slab_rows=32),
    block_quantize.ColumnTuning(num_warps=8, slab_rows=16),
)
_OTHER = (block_quantize.OTHER_TUNING, block_quantize.ColumnTuning(num_warps=4), _WIDE, *_SLABS)
_FOUR_WARPS = (
    block_quantize.DEFAULT_TUNING,
    block_quantize.ColumnTuning(num_warps=8),
    _WIDE,
    *_SLABS,
)
#: Per transposing kernel (as `_alone` calls it), the configurations the sweep times, its
#: default first. Transposed before the cast (`transpose_first`), every block-scaled kernel
#: compiles to the same instructions as after it (Triton moves the transpose back behind the
#: per-column scaling; `benchmarks/quantize_ptx.py`, session 36), so none is timed twice; the
#: per-tensor cast transposed first takes Triton's `ldmatrix` transpose of the BF16 tile
#: instead of gathering its FP8 bytes one at a time, another kernel, which the sweep times.
#: Every kernel but the weight's (which gathers no bytes) is also timed widened to BF16 to
#: transpose (`wide_transpose`: `ldmatrix`, read in quantize_ptx.py's PTX; session 38).
#: Since session 39 each also in slabs of rows (`_SLABS`), and the rows kernel (which
#: writes no transposed copy) in those alone.
TUNINGS = {
    "rows+columns": _FOUR_WARPS,
    "rows": (block_quantize.DEFAULT_TUNING, *_SLABS),
    "requantize": _OTHER,
    "weight": (*_OTHER[:2], *_SLABS),  # no byte gathers to widen away (quantize_ptx.py)
    "gathered columns": _OTHER,
    "gathered requantize": _OTHER,
    "rows+gathered columns": _FOUR_WARPS,
    "per-tensor cast": (
        *_FOUR_WARPS,
        block_quantize.ColumnTuning(num_warps=4, transpose_first=True),
    ),
}
#: Delayed scaling's per-tensor scale in the per-tensor cases (any scale would do).
PER_TENSOR_SCALE = 0.37


def per_tensor_xla(x: jax.Array) -> tuple[jax.Array, ...]:
    """What delayed scaling's step does to an operand with a transposed copy: the saturating
    cast and its transpose (one XLA fusion) and the amax (XLA's reductions)."""
    q = saturate(x, jnp.float32(PER_TENSOR_SCALE), E4M3)
    return q, q.T, jnp.max(jnp.abs(x))


def per_tensor_kernel(x: jax.Array, tuning=block_quantize.DEFAULT_TUNING) -> tuple:
    """The same by `cast_transpose`, its amax tiles reduced by XLA."""
    data, data_t, amax = cast_transpose(x, jnp.float32(PER_TENSOR_SCALE), E4M3, tuning=tuning)
    return data, data_t, jnp.max(amax)


def tuning_name(kernel: str, tuning: block_quantize.ColumnTuning) -> str:
    """A kernel in a `ColumnTuning`, as the sweep's case name."""
    order = "transposed before the cast" if tuning.transpose_first else "cast, then transposed"
    order = "" if kernel == "rows" else ", " + order  # no transposed copy
    order += " in BF16" if tuning.wide_transpose else ""
    order += f", {tuning.slab_rows}-row slabs" if tuning.slab_rows else ""
    return f"{kernel} kernel alone, {tuning.num_warps} warps{order}"


def heavy_tailed(key: Any, shape: tuple[int, int]) -> jax.Array:
    """BF16 values over many binades per row, zero tiles, one value past E4M3's max."""
    kx, ks = jax.random.split(key)
    rows = jnp.exp(jax.random.normal(ks, (shape[0], 1)) * 3)
    x = jax.random.normal(kx, shape) * rows
    x = x.at[: shape[0] // 2, -(shape[1] // 3) :].set(0.0).at[1, 2].set(1e30)
    return x.astype(jnp.bfloat16)


def ieee_rows(x: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """1 x `block` tiles of `x` in NumPy float32 (IEEE division, ml_dtypes rounding):
    (FP8 data as float32, chunk-major scale_inv)."""
    m, k = x.shape
    amax = np.abs(x).reshape(m, k // block, block).max(-1)
    fmt_max = np.float32(ml_dtypes.finfo(E4M3).max)
    ok = (amax > 0) & np.isfinite(amax)
    scale = np.minimum(np.where(ok, fmt_max / np.where(ok, amax, 1), 1), np.float32(MAX_SCALE))
    scale = scale.astype(np.float32)
    scaled = np.clip(x * np.repeat(scale, block, axis=1), -fmt_max, fmt_max)
    data = np.where(np.isfinite(x), scaled, np.nan).astype(E4M3).astype(np.float32)
    return data, (np.float32(1) / scale).T


def ieee_blocks(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """`block x block` blocks of `w` in NumPy float32, as `ieee_rows`: (FP8 data as
    float32, scale_inv per block `(N / block, K / block)`)."""
    n, k = w.shape
    amax = np.abs(w).reshape(n // block, block, k // block, block).max((1, 3))
    fmt_max = np.float32(ml_dtypes.finfo(E4M3).max)
    ok = (amax > 0) & np.isfinite(amax)
    scale = np.minimum(np.where(ok, fmt_max / np.where(ok, amax, 1), 1), np.float32(MAX_SCALE))
    scale = scale.astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)
    scaled = np.clip(w * full, -fmt_max, fmt_max)
    data = np.where(np.isfinite(w), scaled, np.nan).astype(E4M3).astype(np.float32)
    return data, np.float32(1) / scale


def row_map(rows: int, block: int = 128) -> np.ndarray:
    """The padded layout's row map of `rows` expert-sorted rows over eight uneven experts
    (one without tokens): each expert from a multiple of `block`, -1 between."""
    weights = np.array([5, 0, 3, 1, 7, 2, 6, 4], np.float64)
    sizes = np.floor(rows * weights / weights.sum()).astype(int)
    sizes[0] += rows - sizes.sum()
    out, start = [], 0
    for n in sizes:
        out += list(range(start, start + n)) + [-1] * (-n % block)
        start += n
    padded = -(-(rows + len(sizes) * (block - 1)) // block) * block
    return np.array(out + [-1] * (padded - len(out)), np.int32)


def _gathered(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.where((rows >= 0)[:, None], x[np.maximum(rows, 0)], 0).astype(np.float32)


def _differ(got: Any, want: np.ndarray) -> int:
    got = np.asarray(got).astype(np.float32)
    return int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))


def numerics(shape: tuple[int, int], dry: bool) -> dict:
    """Rows and columns (the gradient's kernel), the requantized columns, a weight's blocks
    and the per-tensor cast, against NumPy; the recipe's XLA path against the same; the
    sweep's widened transpose and slabs too."""
    x = heavy_tailed(jax.random.PRNGKey(1), shape)
    interpret = dry
    kernel = jax.jit(
        lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, interpret=interpret, **RULE)
    )
    data, scale_t, _, data_t, cols_t = kernel(x)
    # The sweep's widened transpose (`wide_transpose`) writes the same columns.
    wide = jax.jit(
        lambda x: block_quantize.quantize_rows_and_columns(
            x, E4M3, interpret=interpret, tuning=_WIDE, **RULE
        )
    )(x)
    # In slabs of 32 rows (session 39): the same rows and columns.
    slabs = jax.jit(
        lambda x: block_quantize.quantize_rows_and_columns(
            x, E4M3, interpret=interpret, tuning=_SLABS[0], **RULE
        )
    )(x)
    again = jax.jit(
        lambda d, s: block_quantize.requantize_columns(d, s, interpret=interpret, **RULE)
    )(data, scale_t)
    xla = fp8jax.BlockwiseScaling(native_kernel=False)
    q_xla = jax.jit(lambda x: xla._quantize(x, "input", -1))(x)
    host = np.asarray(x, np.float32)
    rows, scales = ieee_rows(host)
    cols, col_scales = ieee_rows(host.T)
    real = np.asarray(data, np.float32) * np.repeat(np.asarray(scale_t).T, 128, axis=1)
    req, req_scales = ieee_rows(real.T)
    # The padded kernels: the gradient and the saved activation gathered (wgrad tiles).
    padded = row_map(shape[0])
    gathered = jax.jit(
        lambda x, d, s, r: (
            padded_quantize.quantize_padded_columns(x, r, E4M3, interpret=interpret, **RULE),
            padded_quantize.requantize_padded_columns(d, s, r, interpret=interpret, **RULE),
        )
    )
    (p_data, p_scales), (pr_data, pr_scales) = gathered(x, data, scale_t, jnp.asarray(padded))
    p_want, p_want_scales = ieee_rows(_gathered(host, padded).T)
    pr_want, pr_want_scales = ieee_rows(_gathered(real, padded).T)
    # The gradient's two copies of an expert layer in one kernel: its rows and its gathered
    # columns (every row held by the map: the gaps name row 0, written twice alike).
    b_data, b_scale_t, _, b_data_t, b_cols = jax.jit(
        lambda x, r: padded_quantize.quantize_rows_and_padded_columns(
            x, r, E4M3, interpret=interpret, **RULE
        )
    )(x, jnp.asarray(padded))
    s_data, s_scale_t, _, s_data_t, s_cols = jax.jit(
        lambda x, r: padded_quantize.quantize_rows_and_padded_columns(
            x, r, E4M3, interpret=interpret, tuning=_SLABS[1], **RULE
        )
    )(x, jnp.asarray(padded))
    # The per-tensor kernel: a product and a rounding, as NumPy's (no division); in slabs too.
    per_tensor, per_tensor_slabs = (
        jax.jit(
            lambda x, t=t: cast_transpose(
                x, jnp.float32(PER_TENSOR_SCALE), E4M3, interpret=interpret, tuning=t
            )
        )(x)
        for t in (block_quantize.DEFAULT_TUNING, _SLABS[1])
    )
    # A weight's 128 x 128 blocks and its dgrad copy, whole and in slabs (session 39).
    blocks = [
        jax.jit(
            lambda x, t=t: block_quantize.quantize_blocks(
                x, E4M3, interpret=interpret, tuning=t, **RULE
            )
        )(x)
        for t in (block_quantize.OTHER_TUNING, _SLABS[0])
    ]
    w_data, w_scale = ieee_blocks(host)

    def weight_differ(got: tuple) -> int:
        scales = (np.repeat(w_scale, 128, axis=0).T, np.repeat(w_scale, 128, axis=1))
        return sum(_differ(a, b) for a, b in zip(got[:4], (w_data, w_data.T, *scales), strict=True))

    limit = np.float32(ml_dtypes.finfo(E4M3).max)
    cast = np.clip(host * np.float32(PER_TENSOR_SCALE), -limit, limit)
    cast = np.where(np.isfinite(host), cast, np.nan).astype(E4M3).astype(np.float32)
    differ = {
        "per-tensor cast": _differ(per_tensor[0], cast) + _differ(per_tensor[1], cast.T),
        "per-tensor cast, 16-row slabs": _differ(per_tensor_slabs[0], cast)
        + _differ(per_tensor_slabs[1], cast.T),
        "weight blocks": weight_differ(blocks[0]),
        "weight blocks, 32-row slabs": weight_differ(blocks[1]),
        "rows": _differ(data, rows) + _differ(scale_t, scales),
        "columns": _differ(data_t, cols) + _differ(cols_t, col_scales),
        "columns, widened to transpose": _differ(wide[3], cols) + _differ(wide[4], col_scales),
        "requantized": _differ(again[0], req) + _differ(again[1], req_scales),
        "padded columns": _differ(p_data, p_want) + _differ(p_scales, p_want_scales),
        "padded, requantized": _differ(pr_data, pr_want) + _differ(pr_scales, pr_want_scales),
        "rows and padded columns": _differ(b_data, rows)
        + _differ(b_scale_t, scales)
        + _differ(b_data_t, p_want)
        + _differ(b_cols, p_want_scales),
        "rows and columns, 32-row slabs": _differ(slabs[0], rows)
        + _differ(slabs[1], scales)
        + _differ(slabs[3], cols)
        + _differ(slabs[4], col_scales),
        "rows and padded columns, 16-row slabs": _differ(s_data, rows)
        + _differ(s_scale_t, scales)
        + _differ(s_data_t, p_want)
        + _differ(s_cols, p_want_scales),
    }
    return {
        "shape": f"{shape[0]}x{shape[1]}",
        "kernel_elements_differing_from_ieee": differ,
        "xla_path_elements_differing_from_ieee": _differ(q_xla.data, rows)
        + _differ(q_xla.scale_inv.T, scales),
        "passed": not any(differ.values()),
    }


def recipe_passes(recipe: Any) -> dict[str, tuple[Any, int]]:
    """name -> (function of one tensor, bytes it must move per element of that tensor): the
    passes `recipe` quantizes a step's tensors in (section 2f takes the blockwise recipe's
    XLA path from here)."""
    state = recipe.init_state("input")

    def rows(x):
        return recipe.quantize(x, state, "input", -1)

    def both(g):
        return recipe.quantize_both(g, state, "output_grad")

    def requantize(x):
        q, _ = recipe.quantize(x, state, "input", -1)
        q = jax.lax.optimization_barrier(q)  # the saved copy, as the backward reads it
        return recipe.retile(q, "input", -2)

    def weight(w):
        q, _ = recipe.quantize(w, state, "kernel", -1)
        return q, recipe.retile(q, "kernel", -2, source=w)

    def gathered(g):
        return recipe.quantize_gathered(g, jnp.asarray(row_map(g.shape[0])), "output_grad")

    def both_gathered(g):
        rows = jnp.asarray(row_map(g.shape[0]))
        return recipe.quantize_both_gathered(g, rows, state, "output_grad")

    def requantize_gathered(x):
        q, _ = recipe.quantize(x, state, "input", -1)
        q = jax.lax.optimization_barrier(q)
        return recipe.retile_gathered(q, jnp.asarray(row_map(x.shape[0])), "input")

    per_tensor = per_tensor_xla if recipe.native_kernel is False else per_tensor_kernel
    # Bytes per element: read BF16 (2) and write FP8 (1 per copy).
    return {
        "per-tensor cast+transpose+amax": (per_tensor, 4),
        "rows": (rows, 3),
        "rows+columns": (both, 4),
        "rows, requantized": (requantize, 5),
        "weight + dgrad copy": (weight, 4),
        "gathered columns": (gathered, 3),
        "rows+gathered columns": (both_gathered, 4),
        "rows, gathered requantized": (requantize_gathered, 5),
    }


#: The sweep's kernels that requantize the rows kernel's FP8 copy (the others take BF16 `x`).
REQUANTIZING = ("requantize", "gathered requantize")


def transposing_kernel(kernel: str, tuning: block_quantize.ColumnTuning, rows: int) -> Any:
    """Kernel `kernel` of `TUNINGS` in `tuning` (each writes a transposed copy, but the rows
    kernel), as a function of a BF16 `x (rows, K)` or, for the `REQUANTIZING` ones, of the
    rows kernel's `(data, scale_inv_t)` of it."""
    t = dict(tuning=tuning, **RULE)
    row_ids = jnp.asarray(row_map(rows))
    calls = {
        "rows+columns": functools.partial(block_quantize.quantize_rows_and_columns, fmt=E4M3),
        "rows": functools.partial(block_quantize.quantize_rows, fmt=E4M3),
        "requantize": block_quantize.requantize_columns,
        "weight": functools.partial(block_quantize.quantize_blocks, fmt=E4M3),
        "gathered columns": functools.partial(
            padded_quantize.quantize_padded_columns, rows=row_ids, fmt=E4M3
        ),
        "gathered requantize": functools.partial(
            padded_quantize.requantize_padded_columns, rows=row_ids
        ),
        "rows+gathered columns": functools.partial(
            padded_quantize.quantize_rows_and_padded_columns, rows=row_ids, fmt=E4M3
        ),
    }
    if kernel == "per-tensor cast":
        return functools.partial(per_tensor_kernel, tuning=tuning)
    return functools.partial(calls[kernel], **t)


def _alone(kernel: str, tuning: block_quantize.ColumnTuning, x: jax.Array, dry: bool) -> tuple:
    """Kernel `kernel` called directly in `tuning` (on a GPU; interpreted in the dry run):
    (function, its arguments from `x`, bytes it moves per element of `x`). The requantizing
    kernels read the rows kernel's copy of `x`, made beforehand."""
    fn = transposing_kernel(kernel, tuning, x.shape[0])
    if kernel in REQUANTIZING:
        with timing.kernels(dry):
            saved = jax.jit(lambda x: block_quantize.quantize_rows(x, E4M3, **RULE)[:2])(x)
        return fn, saved, 2
    return fn, (x,), 3 if kernel in ("gathered columns", "rows") else 4


def _time(name: str, fn: Any, args: tuple, moved: int, runs: int, dry: bool) -> dict:
    _, fields = compile_and_time(fn, args, fp8jax.gpu_compiler_options(), runs, dry, calls=5)
    fields["gb_per_s"] = moved * args[0].size / (fields["ms"] * 1e-3) / 1e9
    return fields


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, float]]:
    """Numerics, then the timings; returns `{shape: {path: case: ms}}`."""
    dry = mode == "dry"
    times: dict[str, dict[str, float]] = {}
    for label, shape in (DRY_SHAPES if dry else SHAPES).items():
        result = rec.measure(SECTION, f"numerics {label}", functools.partial(numerics, shape, dry))
        rec.cell(SECTION, label, "numerics (elements != IEEE)", _numerics_cell(rec, result))
        x = heavy_tailed(jax.random.PRNGKey(0), shape)
        paths = {
            "kernels": fp8jax.BlockwiseScaling(),
            "xla": fp8jax.BlockwiseScaling(native_kernel=False),
        }
        ms = times.setdefault(label, {})
        cases = [
            (path, case, fn, (x,), moved)
            for path, recipe in paths.items()
            for case, (fn, moved) in recipe_passes(recipe).items()
        ]
        # Quick: one case; dry: each kernel's default (every call built); full: all.
        sweep = list(TUNINGS.items())[: 1 if mode == "quick" else None]
        for kernel, tunings in sweep:
            for tuning in tunings[: None if mode == "full" else 1]:
                call = _alone(kernel, tuning, x, dry)
                cases.append(("sweep", tuning_name(kernel, tuning), *call))
        for path, case, fn, args, moved in cases:
            measure = functools.partial(_time, case, fn, args, moved, runs, dry)
            result = rec.measure(SECTION, f"{label} | {path}: {case}", measure)
            if result is not None and "ms" in result:
                ms[f"{path}: {case}"] = result["ms"]
            text = (
                rec.not_run()
                if result is None
                else (f"{result['ms']:.3f} ({result['gb_per_s']:.0f} GB/s)")
            )
            rec.cell(SECTION, label, f"{path}: {case}", text)
    return times


def _numerics_cell(rec: Recorder, result: dict | None) -> str:
    if result is None:
        return rec.not_run()
    kernel = sum(result["kernel_elements_differing_from_ieee"].values())
    return f"kernels {kernel}, xla {result['xla_path_elements_differing_from_ieee']}"


def decide(rec: Recorder, times: dict[str, dict[str, float]]) -> None:
    """Per shape and case, the time ratio XLA path / kernels."""
    for label, t in times.items():
        ratios = []
        for key, ms in t.items():
            path, case = key.split(": ")
            if path == "kernels" and f"xla: {case}" in t:
                ratios.append(f"{case} {t[f'xla: {case}'] / ms:.2f}x")
        if ratios:
            rec.decision(
                f"quantization kernels, {label} (XLA time / kernel time): " + ", ".join(ratios)
            )
        apart = [t.get(f"kernels: {case}") for case in ("rows", "gathered columns")]
        together = t.get("kernels: rows+gathered columns")
        if together and all(apart):
            rec.decision(
                f"quantization kernels, {label}: an expert layer's gradient, rows and gathered "
                f"columns apart / in one kernel: {sum(apart) / together:.2f}x"
            )
        for kernel, tunings in TUNINGS.items():
            names = [tuning_name(kernel, tuning) for tuning in tunings]
            swept = {n: t[f"sweep: {n}"] for n in names if f"sweep: {n}" in t}
            default = swept.get(names[0])
            if len(swept) < 2 or not default:
                continue
            best = min(swept, key=swept.get)
            rec.decision(
                f"quantization kernels, {label}: fastest {best} ({swept[best]:.3f} ms; the "
                f"default / it: {default / swept[best]:.2f}x)"
            )

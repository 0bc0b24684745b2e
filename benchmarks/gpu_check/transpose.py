"""Sections 2e and 2f (issues 38 and 39): an operand's FP8 cast with its transposed copy, the
pass each FP8 operand of a step takes, three ways side by side, for per-tensor scaling (2e,
`--sections transpose`) and for DeepSeek-V3's blockwise tiles (2f, `--sections blockwise`).

Per-tensor (delayed and current scaling: one scale, the amax of the tensor):

- `xla`: what the recipes compile to without a kernel: XLA's transposing fusion writing both
  FP8 copies, and its reductions for the amax (in GPU run 6's Llama profile XLA's
  transposing FP8 fusions moved 1.3-2.5 TB/s, an H200's HBM 4.8).
- `triton`: `kernels.cast_transpose` (Pallas Triton, one program a 128 x 128 tile), in its
  default tuning and transposed before the cast (Triton's `ldmatrix` transpose of the BF16
  tile, where the default gathers FP8 bytes one at a time through shared memory).
- `tensor cores`: `kernels.tensor_core_transpose` (Mosaic GPU, session 51): each program
  streams its tiles by TMA, casts one in registers, stores it by TMA, and transposes it with
  one `wgmma` (`I . q^T`), in the configurations of `CONFIGS` (the default first).

Blockwise (`blockwise ...`, the BF16 operands: the output gradient's 1 x 128 tiles for the
dgrad and its 128 x 1 tiles, transposed, for the wgrad): the recipe's XLA path, the Pallas
Triton kernel (`block_quantize.quantize_rows_and_columns`, the default on Hopper; 0.66-0.73x
XLA's time in run 6 at 8 warps, 1.05-1.29x faster than XLA at 4) and the tensor-core kernel
(`tensor_core_quantize_rows_and_columns`, session 52: the columns from `I . x^T`, BF16, on the
tensor cores) in the same `CONFIGS`. A weight's 128 x 128 blocks and their transpose for
the dgrad (`blockwise weight ...`, the weight shape) the same three ways: the XLA path,
`block_quantize.quantize_blocks` (1.09-1.32x faster than XLA in run 6) and
`tensor_core_quantize_blocks` (the FP8 block transposed by `I . q^T`, as per tensor). And
at the activation's shape its saved FP8 copy (1 x 128 tiles) requantized into the wgrad's
128 x 1 tiles, transposed (`blockwise requantized ...`): the XLA path,
`block_quantize.requantize_columns` (0.98x XLA's time in run 6) and
`tensor_core_requantize_columns` (`I . q^T`, each column times its row's scale), and the
activation's 1 x 128 tiles alone (`blockwise rows ...`, the forward's copy: the XLA path,
`block_quantize.quantize_rows`, and `tensor_core_quantize_rows`, which transposes nothing
and so runs on TMA alone, named "tensor cores" with its family). And the Mixtral-like MoE
layer's experts' weights (`blockwise experts' weights ...`, 8 x 14336 x 4096 BF16, session
53) in their blocks, the three ways `vmap`ped over the experts as `Fp8RaggedDot` quantizes
them (the tensor-core kernel then one kernel for all experts; 3.82 GB of that layer's step
outside its GEMMs, `moe_cost.py`), numerics on the first and last experts. And at the
gradient's shape its rows gathered into an expert layer's padded layout (eight uneven
experts, `quantize.row_map`) in 128 x 1 tiles, transposed (`blockwise gathered ...`): the
XLA path, `padded_quantize.quantize_padded_columns` and `tensor_core_quantize_padded_columns`
(session 53: each padded tile's rows by TMA from the expert's row, untiled, masked, `I .
x^T`; its programs as `CONFIGS`', two tiles in flight by hand). And at the activation's
shape its saved FP8 copy gathered so and requantized (`blockwise gathered requantized ...`):
the XLA path, `padded_quantize.requantize_padded_columns` and
`tensor_core_requantize_padded_columns` (session 54: the FP8 tile and its rows' scales by
TMA from any row, in float16 through `I . x^T`, each column times its row's scale). And at
the gradient's shape its two copies for an expert layer from one read (`blockwise
rows+gathered ...`): the XLA path, `padded_quantize.quantize_rows_and_padded_columns` and
`tensor_core_quantize_rows_and_padded_columns` (session 54: each padded tile writing the
rows copy of its window too).

At Llama-3-8B's shapes (8,192 tokens): an activation and an output gradient (BF16) and a
weight (its float32 master). Numerics first: each kernel's copies (and, for
the blockwise ones, their scales) against NumPy with IEEE division (the operands are finite:
every element must agree; a -0 the tensor cores transpose may come out +0, equal in value)
and its amax against NumPy's. Then ms and GB/s of the bytes the pass must move (read `x`,
write two FP8 copies), beside a reference: `x + 1` in x's dtype, the rate a plain XLA
elementwise kernel reaches there. Decision lines: per shape and scaling, the fastest way (the
reference's time beside it) and each kernel's ratio to XLA; the recipes take a kernel
(`per_tensor_pass.cast_transpose_kernel`, `choice.tensor_core_quantization`) by default only
once it is faster in a step (`llama` section: `delayed-steady-kernel`, `delayed-steady-tc`,
`blockwise-tc`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp8jax
from fp8jax._src.core import mosaic_private

from . import timing
from .quantize import E4M3, PER_TENSOR_SCALE, heavy_tailed, ieee_blocks, ieee_rows, row_map
from .record import Recorder
from .timing import compile_and_time
from .transpose_ways import (  # noqa: F401 - CONFIGS: transpose_ptx.py reads it here
    BLOCKS,
    BLOCKWISE,
    CONFIGS,
    EXPERTS,
    GATHERED,
    GATHERED_REQUANTIZED,
    OF_SAVED,
    PREFIXES,
    ROWS,
    ROWS_GATHERED,
    family,
    saved_copy,
    ways,
)

SECTION = "2e cast and transpose"
#: The blockwise ways, a section of their own (`--sections blockwise`: the GPU check's call
#: for issue 39 runs them, call 1 the per-tensor ones).
BLOCKWISE_SECTION = "2f blockwise quantization kernels"
#: label -> (rows, cols, dtype): Llama-3-8B at 8,192 tokens.
SHAPES = {
    "activation 8192x4096 bf16": (8192, 4096, jnp.bfloat16),
    "gradient 8192x14336 bf16": (8192, 14336, jnp.bfloat16),
    "weight 14336x4096 f32": (14336, 4096, jnp.float32),
}
DRY_SHAPES = {
    "dry 256x384 bf16": (256, 384, jnp.bfloat16),
    "dry weight 256x384 f32": (256, 384, jnp.float32),
}
#: label -> (experts, rows, cols, dtype), the blockwise section only: the Mixtral-like MoE
#: layer's `up` weights (BF16, as `moe_cost.py`'s layer holds them), `vmap`ped over the
#: experts as `Fp8RaggedDot` quantizes them.
EXPERT_SHAPES = {"experts 8x14336x4096 bf16": (8, 14336, 4096, jnp.bfloat16)}
DRY_EXPERT_SHAPES = {"dry experts 2x256x384 bf16": (2, 256, 384, jnp.bfloat16)}

#: A reference beside the ways: `x + 1` in x's dtype, one read and one write, the rate a plain
#: elementwise XLA kernel reaches on this GPU (not a way to quantize).
COPY = "reference: x + 1"


def _copy(x: jax.Array) -> jax.Array:
    return x + jnp.ones((), x.dtype)


#: Why a dry run on JAX 0.10 skips the tensor-core kernel (its interpreter cannot run it).
REFUSED = "interpreter cannot run wgmma on a transposed view"


def refused(name: str, dry: bool) -> str | None:
    """The reason a dry run skips way `name`, if it does."""
    if dry and "tensor cores" in name and not mosaic_private.interpreter_runs_gpu_path():
        return f"jax {jax.__version__}'s {REFUSED}"
    return None


def numerics(x: jax.Array, fns: dict[str, Any], dry: bool, saved: tuple | None = None) -> dict:
    """Elements of each kernel's copies (and, blockwise, scales) differing from NumPy, and
    whether its amax is NumPy's."""
    host = np.asarray(x, np.float32)
    limit = np.float32(ml_dtypes.finfo(E4M3).max)
    cast = np.clip(host * np.float32(PER_TENSOR_SCALE), -limit, limit).astype(E4M3)
    cast = cast.astype(np.float32)
    differ, amax_ok = {}, {}
    for name, fn in fns.items():
        if not name.endswith(", default") or refused(name, dry):
            continue
        with timing.kernels(dry):
            got = jax.jit(fn)(*(saved if name.startswith(OF_SAVED) else (x,)))
        if name.startswith(OF_SAVED):  # columns (K, M or P), their scales; no amax
            data, scale_inv_t = (np.asarray(a, np.float32) for a in saved)
            values = data * np.repeat(scale_inv_t.T, 128, axis=1)
            if name.startswith(GATHERED_REQUANTIZED):
                rows = row_map(values.shape[0])
                values = np.where((rows >= 0)[:, None], values[np.maximum(rows, 0)], 0)
            pairs = zip(got, ieee_rows(values.T.astype(np.float32)), strict=True)
            differ[name] = sum(int(np.sum(np.asarray(g, np.float32) != w)) for g, w in pairs)
            continue
        if name.startswith(ROWS):  # rows, scales; the amax
            got, want = (*got[:2], jnp.max(got[2])), ieee_rows(host)
        elif name.startswith(BLOCKS):  # blocks, transposed, their scales per row; the amax
            want, got = _ieee_weight(host), (*got[:4], jnp.max(got[4]))
        elif name.startswith(EXPERTS):  # the same of the first and last experts (NumPy's time)
            each = [_ieee_weight(host[e]) for e in (0, -1)]
            want = tuple(np.stack(a) for a in zip(*each, strict=True))
            got = (*(g[np.array([0, -1])] for g in got[:4]), jnp.max(got[4]))
        elif name.startswith(ROWS_GATHERED):  # rows, scales, amaxes, gathered columns, scales
            rows = row_map(host.shape[0])
            gathered = np.where((rows >= 0)[:, None], host[np.maximum(rows, 0)], 0)
            got = (got[0], got[1], got[3], got[4], jnp.max(got[2]))
            want = (*ieee_rows(host), *ieee_rows(gathered.T.astype(np.float32)))
        elif name.startswith(GATHERED):  # gathered columns (K, P), scales; no amax
            rows = row_map(host.shape[0])
            gathered = np.where((rows >= 0)[:, None], host[np.maximum(rows, 0)], 0)
            pairs = zip(got, ieee_rows(gathered.T.astype(np.float32)), strict=True)
            differ[name] = sum(int(np.sum(np.asarray(g, np.float32) != w)) for g, w in pairs)
            continue
        elif name.startswith(BLOCKWISE):  # rows, scales; columns (K, M), scales; the amax
            got = (got[0], got[1], got[3], got[4], jnp.max(got[2]))
            want = (*ieee_rows(host), *ieee_rows(host.T))
        else:
            want = (cast, cast.T)
        pairs = zip(got[: len(want)], want, strict=True)
        differ[name] = sum(int(np.sum(np.asarray(g, np.float32) != w)) for g, w in pairs)
        amax_ok[name] = float(got[-1]) == float(np.max(np.abs(host)))
    passed = not any(differ.values()) and all(amax_ok.values())
    return {"elements_differing": differ, "amax_exact": amax_ok, "passed": passed}


def _ieee_weight(w: np.ndarray) -> tuple[np.ndarray, ...]:
    """A weight's blocks and their transpose, each block's scale_inv once per row it covers
    in both layouts (`ieee_blocks`)."""
    data, scale_inv = ieee_blocks(w)
    rows_t = np.repeat(scale_inv, 128, axis=0).T
    return data, data.T, rows_t, np.repeat(scale_inv, 128, axis=1)


def run(
    rec: Recorder, mode: str, runs: int, blockwise: bool = False
) -> dict[str, dict[str, float]]:
    """Numerics, then the timings, of the per-tensor ways (`SECTION`) or the blockwise ones
    (`BLOCKWISE_SECTION`); returns `{shape: {way: ms}}`."""
    dry = mode == "dry"
    section = BLOCKWISE_SECTION if blockwise else SECTION
    times: dict[str, dict[str, float]] = {}
    shapes = {k: (1, *v) for k, v in (DRY_SHAPES if dry else SHAPES).items()}
    shapes = list(shapes.items())[: 1 if mode == "quick" else None]
    if blockwise and mode != "quick":
        shapes += list((DRY_EXPERT_SHAPES if dry else EXPERT_SHAPES).items())
    for label, (experts, rows, cols, dtype) in shapes:
        x = heavy_tailed(jax.random.PRNGKey(0), (experts * rows, cols)).astype(dtype)
        many = label in EXPERT_SHAPES or label in DRY_EXPERT_SHAPES
        x = x.reshape(experts, rows, cols) if many else x
        requantized = blockwise and label.startswith(("activation", "dry 256"))
        gathered = blockwise and label.startswith(("gradient", "dry 256"))
        fns = ways(
            dry,
            dtype,
            weight="weight" in label,
            requantized=requantized,
            experts=many,
            gathered=gathered,
        )
        fns = {k: v for k, v in fns.items() if bool(family(k)) == blockwise}
        if dry and not blockwise and "weight" in label:
            continue  # the dry weight shape is the blockwise section's (CI time)
        saved = saved_copy(x, dry) if requantized else None
        cell = _check(rec, section, label, x, fns, dry, saved)
        rec.cell(section, label, "numerics (elements != NumPy; amax)", cell)
        for name, fn in {**fns, COPY: _copy}.items():
            # The pass reads x and writes two FP8 copies (requantized: reads and writes one);
            # the copy reads and writes x.
            moved = x.size * (2 * x.dtype.itemsize if name == COPY else x.dtype.itemsize + 2)
            args = (x,)
            if name.startswith(OF_SAVED):  # read and write one FP8 copy
                moved, args = 2 * x.size, saved
            elif name.startswith((ROWS, GATHERED)):  # one FP8 copy
                moved = x.size * (x.dtype.itemsize + 1)
            measure = functools.partial(_time, fn, args, moved, runs, dry)
            if refused(name, dry):
                measure = functools.partial(dict, skipped=refused(name, dry))
            result = rec.measure(section, f"{label} | {name}", measure)
            if result is not None and "ms" in result:
                times.setdefault(label, {})[name] = result["ms"]
            if result is None:
                text = rec.not_run()
            elif "ms" not in result:
                text = "skipped"
            else:
                text = f"{result['ms']:.3f} ({result['gb_per_s']:.0f} GB/s)"
            rec.cell(section, label, name, text)
    return times


def _time(fn: Any, args: tuple, moved: int, runs: int, dry: bool) -> dict:
    _, fields = compile_and_time(fn, args, fp8jax.gpu_compiler_options(), runs, dry, calls=5)
    fields["gb_per_s"] = moved / (fields["ms"] * 1e-3) / 1e9
    return fields


def _check(
    rec: Recorder, section: str, label: str, x: Any, fns: dict, dry: bool, saved: tuple | None
) -> str:
    """`numerics` of the ways: XLA's and Triton's in one measurement, each way on the tensor
    cores (never run on a GPU before run 7) in one of its own, named with it, so that a
    crash or hang there puts that kernel alone under suspicion (`record.families`); the
    summary's cell of all of them."""
    new = [k for k in fns if "tensor cores" in k and k.endswith(", default")]
    groups = [("", {k: v for k, v in fns.items() if k not in new})]
    groups += [(f" | {k}", {k: fns[k]}) for k in new if not refused(k, dry)]
    merged: dict[str, dict] = {"elements_differing": {}, "amax_exact": {}}
    missing = 0
    for suffix, chosen in groups:
        check = functools.partial(numerics, x, chosen, dry, saved)
        result = rec.measure(section, f"numerics {label}{suffix}", check)
        if result is None:
            missing += 1
            continue
        for key, found in merged.items():
            found.update(result[key])
    if missing == len(groups):
        return rec.not_run()
    cell = _numerics_cell(merged)
    return f"{cell}; {missing} not run" if missing else cell


def _numerics_cell(result: dict) -> str:
    differ = sum(result["elements_differing"].values())
    exact = "exact" if all(result["amax_exact"].values()) else "differs"
    return f"{differ}; amax {exact}"


def decide(rec: Recorder, times: dict[str, dict[str, float]]) -> None:
    """Per shape and scaling: the fastest way, and each kernel's fastest configuration
    against XLA."""
    for label, t in times.items():
        reference = t.pop(COPY, None)
        copy = f"; {COPY}: {reference:.3f} ms" if reference else ""
        families = {"per-tensor cast+transpose": {}, **{p.strip(): {} for p in PREFIXES}}
        for k, v in t.items():  # by the longest prefix
            prefix = family(k)
            families[prefix.strip() or "per-tensor cast+transpose"][k[len(prefix) :]] = v
        for what, mine in families.items():
            if "xla" not in mine or len(mine) < 2:
                continue
            best, kinds = min(mine, key=mine.get), []
            for kind in ("triton", "tensor cores"):
                ours = {k: v for k, v in mine.items() if k.startswith(kind)}
                if ours:
                    fastest = min(ours, key=ours.get)
                    kinds.append(f"{fastest} {mine['xla'] / ours[fastest]:.2f}x")
            rec.decision(
                f"{what}, {label}: fastest {best} ({mine[best]:.3f} ms{copy}); "
                f"XLA time / kernel time: " + ", ".join(kinds)
            )

"""Section 3b: the MoE layer's train step against BF16 on JAX's own grouped kernels (issue 39).

Issue 39's target: an MoE layer step (8 experts of 14336, 8,192 tokens, top-2) with blockwise
FP8 at most 0.75x of the same layer in BF16 through JAX's Pallas Mosaic GPU grouped kernels.
XLA's `lax.ragged_dot` (section 3's BF16) is no such yardstick: on an H100 it is not a grouped
kernel. So the layer (`moe_cost.py`'s Mixtral-like MoE: width 4096, 8 experts of 14336, top-2,
8,192 tokens; its step: loss and gradients of the layer and of its input) runs as:

- `bf16`: its experts' GEMMs through `lax.ragged_dot`, as XLA compiles it;
- `bf16 jax mgpu`: the same GEMMs on JAX's kernels (`ragged_dot_mgpu` for the forward and
  the dgrad, `transposed_ragged_dot_mgpu` for the wgrad) through `JaxGroupedBF16`, a custom
  VJP with `lax.ragged_dot`'s signature; its loss and gradients are checked against `bf16`'s
  on the same arrays before it is timed (a wrong yardstick would flatter or wrong FP8);
- `blockwise` (fp8jax's default: issue 39's persistent grouped kernels since run 4),
  `blockwise-tiled` (the tiled grouped kernels, traced inside `tiled_kernel()`),
  `delayed-e4m3` (per-tensor, E4M3 gradients), `blockwise-tile-scales` (the persistent
  kernels given the experts' weight scales once per block: `weight_block_scales()`) and
  `blockwise-chained` (each program's tiles chained into one pipeline:
  `chained_pipelines()`) and `blockwise-slabs` (the quantization kernels holding 32 rows
  of a tile at a time: `quantize_slabs(32)`, session 39), `blockwise-tc` (the experts'
  weight blocks, the activations' tiles, the output gradient's two copies and, since
  session 54, the saved activation's gathered copy quantized on the Mosaic GPU kernels:
  `tensor_core_quantization()`, session 53).

Each step is compiled with `fp8jax.gpu_compiler_options()` and timed as every step of the
check (`timing.compile_and_time`), given as a ratio to both BF16 steps of the same run. JAX's
kernels need a GPU (or JAX 0.11's Mosaic GPU interpreter, where `tests/test_gpu_check.py`
checks `JaxGroupedBF16` against `lax.ragged_dot`): the dry run skips them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import moe_cost
from jaxtyping import Array

import fp8jax
from fp8jax._src.kernels.choice import (
    chained_pipelines,
    tensor_core_quantization,
    tiled_kernel,
    weight_block_scales,
)
from fp8jax._src.kernels.quantize_config import quantize_slabs

from .options import MOE_VARIANTS
from .record import Recorder
from .timing import compile_and_time

SECTION = "3b MoE layer"
#: Rows of a tile the quantization kernels hold at a time in `blockwise-slabs` (ptxas, jax
#: 0.11.2: 32-128 registers a thread in each kernel's warps, whole tiles 116-255; quantize_ptx.py).
SLAB_ROWS = 32
CUBLAS = fp8jax.gpu_compiler_options()
#: mode -> variants; the two BF16 steps first: the others' references.
VARIANTS = MOE_VARIANTS
RECIPES = {
    "blockwise": fp8jax.BlockwiseScaling(),
    "blockwise-tiled": fp8jax.BlockwiseScaling(),
    "blockwise-tile-scales": fp8jax.BlockwiseScaling(),
    "blockwise-chained": fp8jax.BlockwiseScaling(),
    "blockwise-slabs": fp8jax.BlockwiseScaling(),
    "blockwise-tc": fp8jax.BlockwiseScaling(),
    "delayed-e4m3": fp8jax.DelayedScaling(backward_format="e4m3"),
}
#: Variants traced inside a context: the tiled grouped kernels, the experts' weight scales
#: once per 128 x 128 block (one per warpgroup tile of the rows GEMM), each program's tiles
#: chained into one pipeline (the tokens GEMM: every expert's chunks at a tile position),
#: the quantization kernels in slabs of `SLAB_ROWS` rows, the quantization on TMA and the
#: tensor cores.
CONTEXTS = {
    "blockwise-tiled": tiled_kernel,
    "blockwise-tile-scales": weight_block_scales,
    "blockwise-chained": chained_pipelines,
    "blockwise-slabs": lambda: quantize_slabs(SLAB_ROWS),
    "blockwise-tc": tensor_core_quantization,
}
#: Seconds of the budget one compile and timing of the layer's step may need on a GPU.
NEED_S = 20.0
#: The JAX kernels' step against `lax.ragged_dot`'s: each leaf of the loss and gradients
#: within this fraction of its largest magnitude (both round every GEMM's output to BF16,
#: summing in other orders: a few BF16 ulps, 2^-8 each, carried through the layer).
MATCH_BOUND = 2.0**-5


def shape(mode: str) -> dict[str, int]:
    """The layer's shape: `moe_cost.SHAPES["mixtral"]`, fewer tokens in the quick run, tiny in
    the dry run."""
    s = dict(moe_cost.SHAPES["mixtral"])
    if mode == "dry":
        s.update(tokens=64, width=128, hidden=256, experts=4)
    elif mode == "quick":
        s.update(tokens=4096)
    return s


def arguments(s: dict[str, int], name: str) -> tuple[Any, Array]:
    """`(layer, x)` of variant `name`, parameters and input in BF16."""
    if name in ("bf16", "bf16 jax mgpu"):
        layer = moe_cost.make_model(s, None, None)
        if name == "bf16 jax mgpu":
            layer = moe_cost.with_jax_kernels(layer)
    elif name in RECIPES:
        layer = moe_cost.make_model(s, RECIPES[name], None)
    else:
        raise ValueError(f"MoE variant {name!r}: should be one of {VARIANTS['full']}")
    x = jax.random.normal(jax.random.PRNGKey(1), (s["tokens"], s["width"]), jnp.bfloat16)
    return layer, x


def step(name: str):
    """`moe_cost.moe_step`, traced inside its variant's context of `CONTEXTS`, if any."""
    if name not in CONTEXTS:
        return moe_cost.moe_step
    return moe_cost.inside(CONTEXTS[name], moe_cost.moe_step)


def mismatch(out: Any, reference: Any) -> float:
    """The largest difference between two steps' outputs (loss and gradients), leaf by leaf
    relative to the reference leaf's largest magnitude (in float32, where the leaves are)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        scale = float(jnp.max(jnp.abs(b))) or 1.0
        worst = max(worst, float(jnp.max(jnp.abs(a - b))) / scale)
    return worst


def _time(s: dict, name: str, runs: int, dry: bool, kept: dict) -> dict[str, Any]:
    if dry and name == "bf16 jax mgpu":
        return {"skipped": "JAX's grouped kernels take no interpreter option: GPU only"}
    args = arguments(s, name)
    compiled, fields = compile_and_time(step(name), args, CUBLAS, runs, dry)
    if name == "bf16":
        kept["bf16"] = compiled.run()
    elif name == "bf16 jax mgpu":
        error = mismatch(compiled.run(), kept["bf16"]) if "bf16" in kept else float("nan")
        fields.update(max_error_vs_ragged_dot=error, bound=MATCH_BOUND)
        fields["passed"] = bool(error <= MATCH_BOUND)
    fields["estimate_ms"] = fp8jax.hlo_cost(compiled.hlo).estimate_seconds() * 1e3
    return fields


def run(rec: Recorder, mode: str, runs: int, variants: list[str] | None = None) -> dict[str, float]:
    """Time the layer's `variants` (default: the mode's, `VARIANTS`); returns `{variant:
    ms}`. A dry run keeps to its own (its FP8 steps would interpret every grouped kernel)."""
    s = shape(mode)
    if variants is None or mode == "dry":
        variants = VARIANTS[mode]
    text = "{tokens} tokens, width {width}, {experts} experts of {hidden}, top-{top_k}"
    rec.cell(SECTION, "shape", "MoE layer", text.format(**s))
    times: dict[str, float] = {}
    kept: dict[str, Any] = {}
    for name in variants:
        measure = functools.partial(_time, s, name, runs, mode == "dry", kept)
        fields = rec.measure(SECTION, name, measure, need_s=NEED_S)
        if fields is None or "skipped" in fields:
            rec.cell(SECTION, name, "MoE layer", "skipped" if fields else rec.not_run())
            continue
        if fields.get("passed") is False:  # a wrong yardstick is no yardstick
            rec.cell(SECTION, name, "MoE layer", f"FAILED: {fields['max_error_vs_ragged_dot']:.2e}")
            continue
        times[name] = fields["ms"]
        ratios = [f"{fields['ms']:.3f} ms"]
        for base in ("bf16", "bf16 jax mgpu"):
            if base in times and base != name:
                ratios.append(f"{fields['ms'] / times[base]:.2f}x {base}")
        rec.cell(SECTION, name, "MoE layer", ", ".join(ratios))
    kept.clear()
    return times


def decide(rec: Recorder, times: dict[str, float]) -> None:
    """Issue 39's MoE target as a decision input: blockwise FP8 over BF16 on JAX's kernels."""
    base = times.get("bf16 jax mgpu")
    for name in ("blockwise", "blockwise-tc", "blockwise-tiled"):
        if base and name in times:
            rec.decision(
                f"MoE layer step: {name} / bf16 jax mgpu: {times[name] / base:.2f}x "
                "(issue 39's target: at most 0.75x)"
            )

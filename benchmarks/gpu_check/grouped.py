"""Section 2b: grouped (mixture-of-experts) GEMMs at DeepSeek-V3's expert shapes.

Expert width 7168, expert hidden 2048, 16 experts on this GPU, 8,192 rows (tokens times
their experts, routed to this GPU), uneven group sizes with one empty expert. Rows GEMMs
(forward and dgrad: `(M, K) x expert (N, K)`), for the up (7168 -> 2048) and down (2048 ->
7168) projections, and the tokens GEMM (wgrad: `(T, A)^T (T, B)` per expert). Variants:

- `bf16 lax.ragged_dot`: JAX's ragged dot as XLA compiles it;
- `bf16 jax mgpu kernel`: JAX's own Pallas Mosaic GPU grouped kernels
  (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`), with a
  configuration from their autotuning grids (GPU only: they take no interpreter option);
- `bf16 fp8jax kernel`: fp8jax's grouped kernels on BF16 operands;
- `fp8 per-tensor kernel` / `fp8 blockwise kernel`: fp8jax's tiled grouped kernels as the
  layers call them inside `tiled_kernel()` (`native_rows` / `native_tokens`, padding to the
  tiled layout included); `, promoted`: the per-tensor kernels as the backward calls them
  (each chunk added to a float32 sum: `backward_precision="highest"`);
- `fp8 per-tensor persistent kernel` / `fp8 blockwise persistent kernel` (GPU runs only):
  the same rows and tokens GEMMs on the persistent warp-specialized kernels of issue 39, the
  layers' default since run 4 (`persistent_kernel()`: each in its configuration of
  `choice.DEFAULT_CONFIGS`), and in the full run the blockwise ones in each `SWEEP`
  configuration (`fp8 blockwise persistent <changed fields>`), the rows GEMMs also with the
  experts' weight scales once per 128 x 128 block (`..., weight scales per block`:
  `weight_block_scales()`), in the default and chained.

TFLOP/s count the real tokens' FLOPs only (2 x rows x N x K), not the padding.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import moe_cost
import numpy as np
from jax import lax

import fp8jax
from fp8jax._src.gemm import grouped_native as native
from fp8jax._src.kernels.choice import persistent_kernel, tiled_kernel, weight_block_scales
from fp8jax._src.kernels.persistent_gemm import PersistentConfig

from .block_kernels import describe
from .record import Recorder
from .timing import compile_and_time, tflops

SECTION = "2 GEMMs (grouped)"
E4M3, BF16 = jnp.float8_e4m3fn, jnp.bfloat16
CUBLAS = fp8jax.gpu_compiler_options()
EXPERTS, WIDTH, HIDDEN = 16, 7168, 2048
#: JAX kernels' configurations: (block_m, block_n, block_k, max_concurrent_steps,
#: grid_block_n), from the grids their `main` autotunes over.
JAX_CONFIGS = (moe_cost.JAX_CONFIG, (64, 256, 64, 4, 2))
#: The persistent grouped kernels' configurations the full run times beside their default
#: (blockwise; `block_kernels.describe` names them): the rows kernel's warpgroups always
#: split N and its CTA rows are one item's (`choice.recipe_grouped_rows_gemm`).
SWEEP = {
    "rows": (
        PersistentConfig(grid_minor_dim="m"),
        PersistentConfig(cluster="n"),
        PersistentConfig(chunks_per_step=2),
        PersistentConfig(grid_minor_dim="m", chunks_per_step=2),
        PersistentConfig(chained=True),
        PersistentConfig(grid_minor_dim="m", chained=True),
        PersistentConfig(scales_under_wgmma=True),  # session 50: SASS turnaround 222 -> 150
    ),
    "tokens": (
        PersistentConfig(),  # the default before run 4; now wg_dimension="n"
        PersistentConfig(wg_dimension="n", max_concurrent_steps=3),
        PersistentConfig(grid_minor_dim="m"),
        PersistentConfig(cluster="m"),
        PersistentConfig(wg_dimension="n", chained=True),
        PersistentConfig(wg_dimension="n", scales_under_wgmma=True),  # SASS: 197 -> 128
    ),
}


def group_sizes(rows: int, experts: int, multiple: int = 1) -> np.ndarray:
    """Uneven sizes summing to `rows` (each a multiple of `multiple`), expert 1 empty."""
    weights = np.random.default_rng(0).dirichlet(np.ones(experts))
    weights[1] = 0.0
    units = rows // multiple
    sizes = np.floor(weights / weights.sum() * units).astype(np.int32)
    sizes[0] += units - sizes.sum()
    return sizes * multiple


def _rows_operands(m: int, k: int, n: int, g: int) -> dict[str, Any]:
    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x = jax.random.normal(kx, (m, k), BF16)
        w = jax.random.normal(kw, (g, n, k), BF16)  # K-major, as the kernels take it
        one = jnp.float32(1.0)
        block = fp8jax.BlockwiseScaling()
        q_x = block.quantize(x, block.init_state("input"), "input", -1)[0]
        q_w = jax.vmap(lambda v: block.quantize(v, block.init_state("kernel"), "kernel", -1)[0])(w)
        return {
            "bf16": (x, w),
            "bf16 kn": (x, jnp.swapaxes(w, 1, 2)),  # lax.ragged_dot's (G, K, N)
            "bf16 q": (fp8jax.QTensor(x, one), fp8jax.QTensor(w, jnp.ones((g,)))),
            "fp8": (
                fp8jax.QTensor(x.astype(E4M3), one),
                fp8jax.QTensor(w.astype(E4M3), jnp.ones((g,))),
            ),
            "block": (q_x, q_w),
        }

    return make(jax.random.PRNGKey(1))


def _tokens_operands(t: int, a: int, b: int) -> dict[str, Any]:
    @jax.jit
    def make(key):
        kg, kx = jax.random.split(key)
        lhs = jax.random.normal(kg, (t, a), BF16)
        rhs = jax.random.normal(kx, (t, b), BF16)
        one = jnp.float32(1.0)
        block = fp8jax.BlockwiseScaling()

        def tiles(v, role):  # 128 x 1 tiles over the tokens, as the wgrad's operands
            return block.quantize(v, block.init_state(role), role, -2)[0]

        return {
            "bf16": (lhs, rhs),
            "bf16 q": (fp8jax.QTensor(lhs, one), fp8jax.QTensor(rhs, one)),
            "fp8": (fp8jax.QTensor(lhs.astype(E4M3), one), fp8jax.QTensor(rhs.astype(E4M3), one)),
            "block": (tiles(lhs, "output_grad"), tiles(rhs, "input")),
        }

    return make(jax.random.PRNGKey(2))


def _ragged_rows(x, w, sizes):
    return lax.ragged_dot(x, w, sizes, preferred_element_type=BF16)


def _ragged_tokens(lhs, rhs, sizes):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return lax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=BF16)


def _jax_rows(config):
    return lambda x, w, sizes: moe_cost.jax_rows(config, x, w, sizes, transpose_rhs=True)


def _jax_tokens(config):
    return lambda lhs, rhs, sizes: moe_cost.jax_tokens(config, lhs, rhs, sizes)


def _ours_rows(lhs, rhs, sizes, promote=False):
    with tiled_kernel():  # traced inside: the rows GEMM on the tiled kernel
        return native.native_rows(lhs, rhs, sizes, BF16, promote)


def _persistent_rows(lhs, rhs, sizes, config=None, promote=False, per_block=False):
    # Traced inside: the rows GEMM on issue 39's kernel; with `per_block`, the experts'
    # weight scales once per 128 x 128 block (one per warpgroup tile).
    blocks = weight_block_scales() if per_block else contextlib.nullcontext()
    with persistent_kernel(config), blocks:
        return native.native_rows(lhs, rhs, sizes, BF16, promote)


def _ours_tokens(lhs, rhs, sizes, promote=False):
    with tiled_kernel():  # traced inside: the tokens GEMM on the tiled kernel
        return native.native_tokens(lhs, rhs, sizes, BF16, promote)


def _persistent_tokens(lhs, rhs, sizes, config=None, promote=False):
    with persistent_kernel(config):  # traced inside: the tokens GEMM on issue 39's kernel
        return native.native_tokens(lhs, rhs, sizes, BF16, promote)


def _variants(kind: str, mode: str) -> dict[str, tuple]:
    """name -> (function, operands key, sizes multiple of): the variants of `kind`."""
    ragged, ours, jax_kernel = {
        "rows": (_ragged_rows, _ours_rows, _jax_rows),
        "tokens": (_ragged_tokens, _ours_tokens, _jax_tokens),
    }[kind]
    variants = {"bf16 lax.ragged_dot": (ragged, "bf16 kn" if kind == "rows" else "bf16", 1)}
    configs = JAX_CONFIGS if mode == "full" else JAX_CONFIGS[:1]
    for config in configs:
        variants[f"bf16 jax mgpu kernel {config}"] = (jax_kernel(config), "bf16", 1)
    variants["bf16 fp8jax kernel"] = (ours, "bf16 q", 1)
    variants["fp8 per-tensor kernel"] = (ours, "fp8", 1)
    # The backward's form: each chunk promoted to a float32 sum (backward_precision="highest").
    promoted = functools.partial(ours, promote=True)
    variants["fp8 per-tensor kernel, promoted"] = (promoted, "fp8", 1)
    # Block-scaled wgrad operands come padded to their 128-token tiles (as from the layer).
    variants["fp8 blockwise kernel"] = (ours, "block", 128 if kind == "tokens" else 1)
    if mode != "dry":  # its interpreter tests: tests/test_persistent_gemm.py
        persistent = _persistent_rows if kind == "rows" else _persistent_tokens
        variants["fp8 per-tensor persistent kernel"] = (persistent, "fp8", 1)
        promoted = functools.partial(persistent, promote=True)
        variants["fp8 per-tensor persistent kernel, promoted"] = (promoted, "fp8", 1)
        multiple = 128 if kind == "tokens" else 1
        variants["fp8 blockwise persistent kernel"] = (persistent, "block", multiple)
        for config in SWEEP[kind] if mode == "full" else ():
            name = f"fp8 blockwise {describe(config)}"
            variants[name] = (functools.partial(persistent, config=config), "block", multiple)
        if kind == "rows" and mode == "full":  # the weights' scales once per block (and
            # chained): what the MoE layer's `blockwise-tile-scales` runs
            per_block = functools.partial(persistent, per_block=True)
            name = "fp8 blockwise persistent default, weight scales per block"
            variants[name] = (per_block, "block", 1)
            chained = PersistentConfig(chained=True)
            name = "fp8 blockwise persistent chained=True, weight scales per block"
            variants[name] = (functools.partial(per_block, config=chained), "block", 1)
    if mode == "dry":  # one kernel each: the interpreter takes seconds a kernel (section 1
        # checks both kernels' every scaling)
        del variants["bf16 fp8jax kernel"], variants["fp8 blockwise kernel"]
        del variants["fp8 per-tensor kernel, promoted"]
    return variants


def _time(
    fn, key: str, variant: str, case: tuple, sizes: np.ndarray, ops: dict, ms: dict, runs: int,
    dry: bool,
) -> dict:  # fmt: skip
    """Time one variant of `case` (kind, rows, K, N, experts); operands made on first use."""
    kind, m, k, n, g = case
    if dry and "jax mgpu" in variant:
        return {"skipped": "JAX's kernel takes no interpreter option: GPU only"}
    if not ops:
        ops.update(_rows_operands(m, k, n, g) if kind == "rows" else _tokens_operands(m, k, n))
    args = (*ops[key], jnp.asarray(sizes))
    _, fields = compile_and_time(fn, args, CUBLAS, runs, dry, calls=1 if dry else 5)
    ms[variant] = fields["ms"]
    fields["tflops"] = tflops(2 * int(sizes.sum()) * n * k, fields["ms"])
    bf16 = ms.get("bf16 lax.ragged_dot")
    if bf16:
        fields["speedup_vs_bf16_ragged_dot"] = bf16 / fields["ms"]
    fields["group_sizes"] = sizes.tolist()
    return fields


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, float]]:
    """Time every grouped variant; returns `{shape label: {variant: ms}}`."""
    dry = mode == "dry"
    g, width, hidden = (3, 128, 128) if dry else (EXPERTS, WIDTH, HIDDEN)
    token_counts = (128,) if dry else (8192,)
    cases = []
    for m in token_counts:
        cases += [
            ("rows", f"grouped fwd up {width}->{hidden}", m, width, hidden),
            ("rows", f"grouped fwd down {hidden}->{width}", m, hidden, width),
            ("tokens", f"grouped wgrad ({hidden}, {width})", m, hidden, width),
        ]
    if dry:  # one rows and one tokens case: the interpreter takes seconds a kernel
        cases = [c for c in cases if "down" not in c[1]]
    times: dict[str, dict[str, float]] = {}
    for kind, name, m, k, n in cases:
        label = f"{name}, {m} rows, {g} experts"
        ms = times.setdefault(label, {})
        ops: dict[str, Any] = {}
        for variant, (fn, key, multiple) in _variants(kind, mode).items():
            sizes = group_sizes(m, g, multiple)
            case = (kind, m, k, n, g)
            measure = functools.partial(_time, fn, key, variant, case, sizes, ops, ms, runs, dry)
            result = rec.measure(SECTION, f"{label} | {variant}", measure)
            if result is not None and "ms" in result:  # (also a recorded one's)
                ms[variant] = result["ms"]
            if result is None or "skipped" in result:
                rec.cell(SECTION, label, variant, "GPU only" if result else rec.not_run())
                continue
            speed = result.get("speedup_vs_bf16_ragged_dot")
            text = f"{result['ms']:.3f} ({result['tflops']:.0f}"
            rec.cell(SECTION, label, variant, text + (f", {speed:.2f}x)" if speed else ")"))
    return times

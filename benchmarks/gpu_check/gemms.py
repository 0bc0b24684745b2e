"""Section 2a: dense GEMMs at LLM shapes, every variant side by side in one run.

`out (M, N) = x (M, K) . w (N, K)^T` in BF16 output, M the tokens:

- `bf16`: `lax.dot_general` of BF16 operands;
- `fp8 cuBLASLt`: `per_tensor_dot` (FP8 operands into `dot_general` with a BF16 preferred
  type, the scale applied after: the form fp8jax's per-tensor recipes emit), compiled with
  `fp8jax.gpu_compiler_options()` (Triton GEMMs off: one cuBLASLt FP8 call); `fp8 XLA
  default` is the same op under XLA's default options (Triton may take it);
- `block kernel` / `blockwise XLA`: the blockwise recipe's GEMM (1 x 128 tiles times
  128 x 128 blocks) on fp8jax's Mosaic GPU kernel / on its XLA path;
- `residual fused` / `residual 2x cuBLASLt`: the residual recipe's `A.W_hi + A.W_lo` in one
  kernel / as two cuBLASLt FP8 calls summed in float32 (its XLA path). TFLOP/s count
  2MNK once: the work of the one product they stand for.

Then, in the full run, the block kernel's tile configurations on one shape.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import fp8jax
from fp8jax._src.kernels.block_gemm import block_scaled_gemm, expand_rows
from fp8jax._src.recipes.base import per_tensor_dot
from fp8jax._src.recipes.residual import QTerms

from .record import Recorder
from .timing import compile_and_time, tflops

SECTION = "2 GEMMs (dense)"
E4M3, BF16 = jnp.float8_e4m3fn, jnp.bfloat16
CUBLAS = fp8jax.gpu_compiler_options()

#: (name, K, N) of the dense GEMMs: Llama-3-8B's MLP and DeepSeek-V3's 7168-wide GEMMs.
SHAPES = {
    "llama8b mlp up 4096->14336": (4096, 14336),
    "llama8b mlp down 14336->4096": (14336, 4096),
    "dsv3 7168->18432": (7168, 18432),
    "dsv3 18432->7168": (18432, 7168),
}
QUICK_SHAPES = ("llama8b mlp up 4096->14336", "dsv3 7168->18432")
TOKENS, QUICK_TOKENS = (4096, 16384), (8192,)
DRY_SHAPES = {"dry 128->128": (128, 128)}  # one tile, one chunk: the interpreter is slow
DRY_TOKENS = (64,)
#: Block kernel configurations: (tile_m, tile_n, max_concurrent_steps); the first is the
#: default. 128-row tiles spill registers in the deviceless compile (`block_gemm`).
TILES = ((64, 128, 2), (64, 128, 4), (128, 128, 2), (64, 256, 2))


def _operands(m: int, k: int, n: int) -> dict[str, Any]:
    """Every variant's operands, made on the device: BF16 values, their per-tensor FP8
    casts (unit scales), the blockwise recipe's tiles and blocks, a residual pair."""

    @jax.jit
    def make(key):
        kx, kw, kl = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), BF16)
        w = jax.random.normal(kw, (n, k), BF16)
        lo = jax.random.normal(kl, (n, k), BF16)
        one = jnp.float32(1.0)
        block = fp8jax.BlockwiseScaling()
        q_x = block.quantize(x, block.init_state("input"), "input", -1)[0]
        q_w = block.quantize(w, block.init_state("kernel"), "kernel", -1)[0]
        x8, w8 = fp8jax.QTensor(x.astype(E4M3), one), fp8jax.QTensor(w.astype(E4M3), one)
        lo8 = fp8jax.QTensor(lo.astype(E4M3), jnp.float32(2.0**-5))
        return {
            "bf16": (x, w),
            "fp8": (x8, w8),
            "block": (q_x, q_w),
            "residual": (QTerms((x8,)), QTerms((w8, lo8))),
        }

    return make(jax.random.PRNGKey(0))


def _bf16(x, w):
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=BF16)


def _fp8(a, b):
    return per_tensor_dot(a, b, -1, -1, None, BF16, exact_scales=True)


def _recipe_dot(recipe):
    return lambda a, b: recipe.dot(a, b, -1, -1, None, BF16)


#: name -> (function, operands key, compiler options)
VARIANTS = {
    "bf16": (_bf16, "bf16", CUBLAS),
    "fp8 cuBLASLt": (_fp8, "fp8", CUBLAS),
    "fp8 XLA default": (_fp8, "fp8", {}),
    "block kernel": (_recipe_dot(fp8jax.BlockwiseScaling(native_kernel=True)), "block", CUBLAS),
    "blockwise XLA": (_recipe_dot(fp8jax.BlockwiseScaling(native_kernel=False)), "block", CUBLAS),
    "residual fused": (_recipe_dot(fp8jax.ResidualFP8(native_kernel=True)), "residual", CUBLAS),
    "residual 2x cuBLASLt": (
        _recipe_dot(fp8jax.ResidualFP8(native_kernel=False)),
        "residual",
        CUBLAS,
    ),
}


def _time(
    fn, options, key: str, variant: str, shape: tuple[int, int, int], ops: dict, ms: dict,
    runs: int, dry: bool,
) -> dict:  # fmt: skip
    """Time one variant at `shape` (M, K, N); operands made on first use, kept in `ops`."""
    m, k, n = shape
    if not ops:
        ops.update(_operands(m, k, n))
    _, fields = compile_and_time(fn, ops[key], options, runs, dry, calls=1 if dry else 5)
    ms[variant] = fields["ms"]
    fields["tflops"] = tflops(2 * m * n * k, fields["ms"])
    if "bf16" in ms:
        fields["speedup_vs_bf16"] = ms["bf16"] / fields["ms"]
    fields["options"] = options
    fields["shape"] = f"M={m} K={k} N={n}"
    return fields


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, float]]:
    """Time every variant at every shape; returns `{shape label: {variant: ms}}`."""
    dry = mode == "dry"
    shapes = DRY_SHAPES if dry else SHAPES
    if mode == "quick":
        shapes = {name: SHAPES[name] for name in QUICK_SHAPES}
    tokens = {"dry": DRY_TOKENS, "quick": QUICK_TOKENS}.get(mode, TOKENS)
    times: dict[str, dict[str, float]] = {}
    for name, (k, n) in shapes.items():
        for m in tokens:
            label = f"{name}, {m} tokens"
            ops: dict[str, Any] = {}
            ms = times.setdefault(label, {})
            for variant, (fn, key, options) in VARIANTS.items():
                measure = functools.partial(
                    _time, fn, options, key, variant, (m, k, n), ops, ms, runs, dry
                )
                result = rec.measure(SECTION, f"{label} | {variant}", measure)
                if result is not None and "ms" in result:  # (also a recorded one's)
                    ms[variant] = result["ms"]
                rec.cell(SECTION, label, variant, cell(rec, result))
            ops.clear()
    if mode == "full":
        _tiles(rec, runs, times)
    return times


def cell(rec: Recorder, result: dict | None) -> str:
    """`ms (TFLOP/s, speed-up over BF16)` of a result ("skipped" for one skipped)."""
    if result is None:
        return rec.not_run()
    if "skipped" in result:
        return "skipped"
    speed = result.get("speedup_vs_bf16")
    return f"{result['ms']:.3f} ({result['tflops']:.0f}" + (f", {speed:.2f}x)" if speed else ")")


def _tiles(rec: Recorder, runs: int, times: dict) -> None:
    """The block kernel alone (scales expanded per row beforehand) in each `TILES` config,
    on the DeepSeek-V3 7168 -> 18432 GEMM at 16,384 tokens."""
    m, (k, n) = 16384, SHAPES["dsv3 7168->18432"]
    ops: dict[str, Any] = {}
    label = f"block kernel tiles, M={m} K={k} N={n}"
    ms = times.setdefault(label, {})
    for config in TILES:
        name = "tiles {}x{}, {} steps".format(*config)
        measure = functools.partial(_time_tiles, config, (m, k, n), ops, ms, runs)
        result = rec.measure(SECTION, f"{label} | {name}", measure)
        if result is not None and "ms" in result:  # (also a recorded one's)
            ms[str(config)] = result["ms"]
        rec.cell(SECTION, f"block kernel alone, M={m} K={k} N={n}", name, cell(rec, result))


def _time_tiles(
    config: tuple[int, int, int], shape: tuple[int, int, int], ops: dict, ms: dict, runs: int
) -> dict:
    """Time the block kernel alone in one tile configuration."""
    (tile_m, tile_n, steps), (m, k, n) = config, shape

    def gemm(a, sa, b, sb):
        return block_scaled_gemm(
            a, sa, [(b, sb)], out_dtype=BF16, tile_m=tile_m, tile_n=tile_n,
            max_concurrent_steps=steps,
        )  # fmt: skip

    if not ops:
        q_x, q_w = _operands(m, k, n)["block"]
        ops["args"] = (q_x.data, q_x.scale_inv, q_w.data, expand_rows(q_w.scale_inv, n, 128))
    _, fields = compile_and_time(gemm, ops["args"], CUBLAS, runs, False, calls=5)
    ms[str(config)] = fields["ms"]
    fields["tflops"] = tflops(2 * m * n * k, fields["ms"])
    return fields

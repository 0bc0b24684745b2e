"""Section 2c (issue 39): the persistent warp-specialized block-scaled kernel, its numerics
against float64 and its tuning sweep beside what it must beat.

1. Numerics: `persistent_block_scaled_gemm` in several `PersistentConfig`s at odd shapes
   (padding), E4M3 and E5M2, one and two terms (the residual form), float32 and BF16 out,
   against the float64 reference: the check a rewritten kernel passes on a GPU before it
   becomes the recipes' default.
2. Sweep: at Llama-3-8B's MLP up GEMM (8192 x 4096 -> 14336) and DeepSeek-V3's 7168 -> 18432
   (16,384 tokens), each `SWEEP` configuration of the persistent kernel beside the tiled
   block kernel (`block_scaled_gemm`, its default tiles), per-tensor FP8 through cuBLASLt
   and BF16: ms, TFLOP/s, and each output's largest difference to the tiled kernel's (the
   same maths: only float32 summation order differs). The block kernels take the weight's
   scales per 128 x 128 block, as the recipes give them inside `choice.weight_block_scales()`
   (one scale per warpgroup tile and chunk); `PER_ROW` configurations take them repeated per
   row, as the recipes do by default (a vector of scales per tile and chunk; a wgrad's two
   operands always). Beside them (session 37), the default configuration
   without block scales (`..., no block scales: ...`, `_unscaled`: one scale per row tile,
   the contraction in the `wgmma` accumulator alone, or each chunk's product added to a
   float32 sum): the kernel's pipeline and epilogue without the promotion's scales, so that
   a shortfall of the block kernel can be put on its structure or on its promotion.

The decision inputs name the fastest configuration per shape and its ratio to the tiled
kernel (issue 39's target is 1,150 TFLOP/s at both shapes), the rates with the scales per
row and without block scales.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import reference
from fp8jax._src.kernels.block_gemm import block_scaled_gemm
from fp8jax._src.kernels.choice import DEFAULT_CONFIGS
from fp8jax._src.kernels.dispatch import interpreting
from fp8jax._src.kernels.persistent_config import PersistentConfig, grid_programs
from fp8jax._src.kernels.persistent_gemm import persistent_block_scaled_gemm, run_persistent
from fp8jax._src.recipes.base import per_tensor_dot

from .gemms import cell
from .numerics import WGMMA_REL, compare
from .record import Recorder
from .timing import compile_and_time, tflops

SECTION = "2c block kernels (persistent)"
E4M3, E5M2, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
CUBLAS = fp8jax.gpu_compiler_options()

#: (M, K, N) of the sweep: Llama-3-8B's MLP up at 8,192 tokens, DeepSeek-V3's 7168 -> 18432
#: at 16,384 tokens (the issue's shapes).
SHAPES = {"llama8b up": (8192, 4096, 14336), "dsv3 7168->18432": (16384, 7168, 18432)}
DRY_SHAPES = {"dry": (256, 256, 256)}

#: Configurations swept, the default first. 64 x 128 per warpgroup is what fits the
#: registers without spills (64 x 192 and 64 x 256 spill in the deviceless compile, 128 x 128
#: exceeds shared memory with 4 stages). Runs 4-6 (H200) measured the pipeline depth (3 or 5
#: stages: slower than 4) and the clusters' multicast (slower) and chose the tile order
#: (`choice.DEFAULT_CONFIGS`: `grid_minor_dim="m", grid_tile_width=8`); since session 32
#: the sweep times two chunks a step (`chunks_per_step=2`: the first chunk promoted while the
#: second's `wgmma` runs) beside it, and since session 37 the tiles of each program chained
#: into one pipeline (`chained=True`: the next tile's first chunks load while the last tile
#: is promoted and stored), since session 50 each chunk's scales multiplied while its `wgmma`
#: runs (`scales_under_wgmma=True`) and three compute warpgroups (`compute_wgs=3`: 192 x 128
#: CTA tiles, 152 registers a thread, which the weight's scales per block fit, not per row).
#: Every one compiles for an H100 at both shapes (deviceless, JAX 0.11.2) without spills.
SWEEP = (
    PersistentConfig(),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8),
    PersistentConfig(grid_tile_width=4),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=16),
    PersistentConfig(wg_dimension="n", grid_minor_dim="m", grid_tile_width=8),
    PersistentConfig(chunks_per_step=2),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, chunks_per_step=2),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=16, chunks_per_step=2),
    PersistentConfig(wg_dimension="n", grid_minor_dim="m", grid_tile_width=8, chunks_per_step=2),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, chained=True),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, chunks_per_step=2, chained=True),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, scales_under_wgmma=True),
    PersistentConfig(compute_wgs=3, grid_minor_dim="m", grid_tile_width=8),
    PersistentConfig(compute_wgs=3, grid_minor_dim="m", grid_tile_width=8, scales_under_wgmma=True),
)
#: Configurations also timed with the weight's scales given per row (before session 33; the
#: recipes' default, and the wgrad's form, both operands per row), since session 49 also
#: with two chunks a step, since session 50 with the scales multiplied while the `wgmma`
#: runs: in SASS the per-row promotion keeps a warpgroup from the tensor cores 190 cycles a
#: chunk against the other's 256, 255 a step of two against 512, 124 with the scales
#: under the `wgmma` (`benchmarks/promotion_sass.py`).
PER_ROW = (
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, chunks_per_step=2),
    PersistentConfig(grid_minor_dim="m", grid_tile_width=8, scales_under_wgmma=True),
)
DRY_SWEEP = (
    PersistentConfig(num_sms=2),
    PersistentConfig(wg_dimension="n", num_sms=2),
    PersistentConfig(cluster="n", num_sms=4),
)

#: Numerics cases: (M, N, K, terms, FP8 type, output type, rows per scale of lhs and rhs
#: (128: 128 x 128 blocks, each one scale per warpgroup tile), config).
CASES = (
    (1000, 1500, 1100, 1, E4M3, jnp.float32, (1, 1), PersistentConfig()),
    (1000, 1500, 1100, 1, E5M2, jnp.float32, (1, 1), PersistentConfig(wg_dimension="n")),
    (777, 1000, 900, 2, E4M3, jnp.float32, (1, 1), PersistentConfig(grid_minor_dim="m")),
    (1000, 1500, 1100, 1, E4M3, BF16, (1, 1), PersistentConfig(max_concurrent_steps=3)),
    (1000, 1500, 1100, 1, E4M3, jnp.float32, (1, 1), PersistentConfig(chunks_per_step=2)),
    (777, 1000, 900, 2, E5M2, BF16, (1, 1), PersistentConfig(chunks_per_step=2)),
    (1000, 1500, 1100, 1, E4M3, jnp.float32, (1, 128), PersistentConfig(grid_minor_dim="m")),
    (777, 1000, 900, 2, E4M3, BF16, (128, 128), PersistentConfig(chunks_per_step=2)),
    (1000, 1500, 1100, 1, E5M2, jnp.float32, (128, 128), PersistentConfig(wg_dimension="n")),
    # each program's tiles chained into one pipeline (9 chunks a tile: 3 stages)
    (1000, 1500, 1100, 1, E4M3, BF16, (1, 1), PersistentConfig(chained=True)),
    (
        777,
        1000,
        900,
        2,
        E5M2,
        jnp.float32,
        (1, 128),
        PersistentConfig(chunks_per_step=2, chained=True),
    ),
    # each chunk's scales multiplied while its wgmma runs: per row, the residual form; blocks
    (777, 1000, 900, 2, E4M3, BF16, (1, 1), PersistentConfig(scales_under_wgmma=True)),
    (1000, 1500, 1100, 1, E5M2, jnp.float32, (1, 128), PersistentConfig(scales_under_wgmma=True)),
    # three compute warpgroups: blocks (the last CTA row's third warpgroup unwritten); per row
    (1000, 1500, 1100, 1, E4M3, BF16, (1, 128), PersistentConfig(compute_wgs=3)),
    (777, 1000, 900, 2, E5M2, jnp.float32, (1, 1), PersistentConfig(compute_wgs=3)),
)
DRY_CASES = (
    (70, 130, 300, 1, E4M3, jnp.float32, (1, 1), PersistentConfig(num_sms=2)),
    (40, 260, 256, 2, E5M2, BF16, (1, 128), PersistentConfig(scales_under_wgmma=True, num_sms=2)),
)


def describe(config: PersistentConfig) -> str:
    """A configuration as a short label (its fields that differ from the default)."""
    default = PersistentConfig()
    changed = {k: v for k, v in vars(config).items() if k != "num_sms" and getattr(default, k) != v}
    return "persistent " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "default")


def _operand(rng: np.random.Generator, rows: int, k: int, fmt, per: int) -> tuple[Any, Any]:
    """FP8 data and a power-of-two scale per `per` rows and 128-chunk."""
    data = jnp.asarray(rng.standard_normal((rows, k)) * 4, fmt)
    scale = jnp.asarray(2.0 ** rng.integers(-4, 4, (-(-rows // per), -(-k // 128))), jnp.float32)
    return data, scale


def numerics_case(case: tuple, interpret: bool) -> dict:
    """One numerics case against float64: the output's error relative to the magnitude."""
    m, n, k, n_terms, fmt, out_dtype, block_rows, config = case
    rng = np.random.default_rng(m + n + k + n_terms)
    lhs, lhs_scale = _operand(rng, m, k, fmt, block_rows[0])
    terms = [_operand(rng, n, k, fmt, block_rows[1]) for _ in range(n_terms)]
    out = jax.jit(
        lambda *a: persistent_block_scaled_gemm(
            *a, out_dtype=out_dtype, config=config, block_rows=block_rows, interpret=interpret
        )
    )(lhs, lhs_scale, terms)

    def per_row(scale, per, rows):  # the reference's scales: one per row
        return np.repeat(np.asarray(scale), per, axis=0)[:rows]

    lhs_scale = per_row(lhs_scale, block_rows[0], m)
    terms = [(b, per_row(sb, block_rows[1], n)) for b, sb in terms]
    want = reference.block_scaled(lhs, lhs_scale, terms)
    magnitude = reference.block_scaled_magnitude(lhs, lhs_scale, terms)
    # A BF16 output adds one rounding of its own: 2^-8 of each value.
    rtol = reference.BLOCK_RTOL if out_dtype == jnp.float32 else reference.BLOCK_RTOL + 2.0**-8
    got = compare(out, want, rtol * magnitude)
    return {
        "shape": f"{m}x{n}x{k}, {n_terms} term(s), {jnp.dtype(fmt).name} -> "
        f"{jnp.dtype(out_dtype).name}, rows per scale {block_rows}",
        "config": describe(config),
        "bound": f"|err| <= {rtol:g} * |A| |B| (elementwise)",
        "rel_err_vs_f64": got["max_rel_err"],
        "passed": got["within_bound"],
        "within_wgmma_bound": got["max_rel_err"] <= WGMMA_REL,
    }


def _sweep_operands(m: int, k: int, n: int) -> dict[str, Any]:
    """The blockwise recipe's operands (1 x 128 tiles, 128 x 128 blocks; `"block per row"`:
    the blocks' scales repeated per row), per-tensor FP8 casts and BF16 values, made on the
    device."""

    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x = jax.random.normal(kx, (m, k), BF16)
        w = jax.random.normal(kw, (n, k), BF16)
        block = fp8jax.BlockwiseScaling()
        q_x = block.quantize(x, block.init_state("input"), "input", -1)[0]
        q_w = block.quantize(w, block.init_state("kernel"), "kernel", -1)[0]
        # The weight's 128 x 128 blocks' scales, once per block and repeated per row (the
        # one-pass quantization gives the latter: its tiles along K, `BlockwiseScaling`).
        if q_w.block == (128, 128):
            blocks, w_scale = q_w.scale_inv, jnp.repeat(q_w.scale_inv, 128, axis=0)[:n]
        else:
            blocks, w_scale = q_w.scale_inv[::128], q_w.scale_inv
        one = jnp.float32(1.0)
        return {
            "block": (q_x.data, q_x.scale_inv, q_w.data, blocks),
            "block per row": (q_x.data, q_x.scale_inv, q_w.data, w_scale),
            "fp8": (fp8jax.QTensor(x.astype(E4M3), one), fp8jax.QTensor(w.astype(E4M3), one)),
            "fp8 data": (x.astype(E4M3), w.astype(E4M3)),
            "bf16": (x, w),
        }

    return make(jax.random.PRNGKey(0))


def _variants(
    sweep: tuple, per_row: tuple = (), unscaled: PersistentConfig | None = None
) -> dict[str, tuple]:
    """name -> (function, operands key); `unscaled`: the configuration also timed without
    block scales (`_unscaled`), one accumulation, summed per chunk, and chained."""

    def bf16(x, w):
        return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=BF16)

    def fp8(a, b):
        return per_tensor_dot(a, b, -1, -1, None, BF16, exact_scales=True)

    def tiled(a, sa, b, sb):
        return block_scaled_gemm(a, sa, [(b, sb)], out_dtype=BF16, block_rows=(1, 128))

    variants = {"bf16": (bf16, "bf16"), "fp8 cuBLASLt": (fp8, "fp8"), "tiled": (tiled, "block")}
    for config in sweep:
        variants[describe(config)] = (functools.partial(_persistent, config=config), "block")
    for config in per_row:
        gemm = functools.partial(_persistent, config=config, block_rows=(1, 1))
        variants[describe(config) + ", scales per row"] = (gemm, "block per row")
    if unscaled:  # where the block kernel's time goes: its pipeline without the promotion
        chained = dataclasses.replace(unscaled, chained=True)
        for config, promote, what in (
            (unscaled, False, "one accumulation"),
            (unscaled, True, "summed per chunk"),
            (chained, False, "one accumulation"),
        ):
            gemm = functools.partial(_unscaled, config=config, promote=promote)
            variants[f"{describe(config)}, {UNSCALED}: {what}"] = (gemm, "fp8 data")
    return variants


#: The diagnostic variants' mark: the persistent kernel with one scale per row tile, no block
#: scales (not a recipe's GEMM; `decide` leaves them out of the sweep's choice).
UNSCALED = "no block scales"


def _unscaled(a, b, *, config, promote):
    """The persistent kernel's pipeline with one scale per row tile instead of block scales
    (the per-tensor grouped GEMMs' form, on the dense layout): the contraction accumulated by
    `wgmma` alone (`promote=False`), or each chunk's product added to a float32 sum (`True`:
    the promotion without its scales). Beside the block-scaled kernel, what its scales cost."""
    (m, _), n = a.shape, b.shape[0]
    cluster_m, cluster_n = config.cluster_tile
    kw = dict(out_dtype=jnp.dtype(BF16), config=config, interpret=interpreting(), promote=promote)
    programs = grid_programs(config, (m // cluster_m) * (n // cluster_n))
    scales = jnp.ones((m // config.cta_tile[0],), jnp.float32)
    return run_persistent(
        [scales, a, b], 1, out_shape=(m, n), programs=programs, tile_scaled=True, **kw
    )


def _persistent(a, sa, b, sb, *, config, block_rows=(1, 128)):
    kw = dict(out_dtype=BF16, config=config, block_rows=block_rows)
    return persistent_block_scaled_gemm(a, sa, [(b, sb)], **kw)


def _time(name, fn, key, shape, ops, ms, outputs, runs, dry) -> dict:
    """Time variant `name` at `shape` (M, K, N); a block kernel's output is compared with the
    tiled kernel's, an unscaled one's with cuBLASLt's per-tensor FP8 product of the same
    values (kept in `outputs`)."""
    m, k, n = shape
    if not ops:
        ops.update(_sweep_operands(m, k, n))
    compiled, fields = compile_and_time(fn, ops[key], CUBLAS, runs, dry, calls=1 if dry else 5)
    ms[name] = fields["ms"]
    fields["tflops"] = tflops(2 * m * n * k, fields["ms"])
    fields["shape"] = f"M={m} K={k} N={n}"
    if "bf16" in ms:
        fields["speedup_vs_bf16"] = ms["bf16"] / fields["ms"]
    # Each block kernel against the tiled one, each unscaled one against cuBLASLt's product.
    reference = (
        "tiled" if key.startswith("block") else "fp8 cuBLASLt" if key == "fp8 data" else None
    )
    if reference or name == "fp8 cuBLASLt":
        out = np.asarray(compiled.run(), np.float64)
        if name in ("tiled", "fp8 cuBLASLt"):
            outputs[name] = out
        elif reference in outputs:
            ref = outputs[reference]
            # Both BF16 roundings of one float32 sum, in a different order: a few BF16 ulps.
            diff = float(np.abs(out - ref).max() / np.abs(ref).max())
            fields[f"max_rel_diff_vs_{reference.split()[0]}"] = diff
            fields["passed"] = diff <= 2.0**-6
    return fields


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, float]]:
    """Numerics, then the sweep; returns `{shape label: {variant: ms}}`."""
    dry = mode == "dry"
    # JAX 0.10's interpreter cannot run the persistent kernel (`persistent_gemm`): a dry run
    # there times the other variants and records the kernel's items as skipped.
    refused = None
    if dry and not mosaic_private.interpreter_runs_gpu_path():
        refused = f"jax {jax.__version__}'s interpreter cannot run the persistent kernel"
    for case in DRY_CASES if dry else CASES:
        measure = functools.partial(numerics_case, case, dry)
        if refused:
            measure = functools.partial(dict, skipped=refused)
        # Named with its configuration: a crash or hang puts it under suspicion in the sweep.
        name = f"numerics {case[:4]}, {case[6]} | {describe(case[-1])}"
        result = rec.measure(SECTION, name, measure)
        row = f"numerics {case[0]}x{case[1]}x{case[2]}, {case[3]} term(s)"
        row += "" if case[6] == (1, 1) else f", rows per scale {case[6]}"
        text = rec.not_run() if result is None else f"{result.get('rel_err_vs_f64', 0):.1e}"
        rec.cell(SECTION, row, describe(case[-1]), "skipped" if refused else text)
    times: dict[str, dict[str, float]] = {}
    for label, shape in (DRY_SHAPES if dry else SHAPES).items():
        ops: dict[str, Any] = {}
        outputs: dict[str, np.ndarray] = {}
        ms = times.setdefault(label, {})
        sweep = (DRY_SWEEP, DRY_SWEEP[:1]) if dry else (SWEEP, PER_ROW)
        # The unscaled pipeline in the recipes' default configuration (dry: a DRY_SWEEP one).
        unscaled = DRY_SWEEP[1] if dry else DEFAULT_CONFIGS["dense"]
        for name, (fn, key) in _variants(*sweep, unscaled).items():
            measure = functools.partial(_time, name, fn, key, shape, ops, ms, outputs, runs, dry)
            if refused and name.startswith("persistent"):
                measure = functools.partial(dict, skipped=refused)
            result = rec.measure(SECTION, f"{label} | {name}", measure)
            if result is not None and "ms" in result:  # (also a recorded one's)
                ms[name] = result["ms"]
            rec.cell(SECTION, label, name, cell(rec, result))
        ops.clear()
        outputs.clear()
    return times


def decide(rec: Recorder, times: dict[str, dict[str, float]]) -> None:
    """The fastest persistent configuration per shape, against the tiled kernel."""
    for label, t in times.items():
        swept = {
            k: v
            for k, v in t.items()
            if k.startswith("persistent") and "per row" not in k and UNSCALED not in k
        }
        if not swept or "tiled" not in t:
            continue
        best = min(swept, key=swept.get)
        m, k, n = (SHAPES | DRY_SHAPES)[label]
        rec.decision(
            f"block kernels, {label}: fastest {best}, {swept[best]:.3f} ms "
            f"({tflops(2 * m * n * k, swept[best]):.0f} TFLOP/s; target 1150); tiled kernel "
            f"{t['tiled']:.3f} ms: time ratio tiled / persistent {t['tiled'] / swept[best]:.2f}"
        )
        per_row = {k: v for k, v in t.items() if k.endswith("scales per row")}
        if per_row:  # the recipes' default scales, the wgrad's form: one or two chunks a step
            rates = ", ".join(
                f"{name}: {tflops(2 * m * n * k, v):.0f}" for name, v in per_row.items()
            )
            rec.decision(f"block kernels, {label}: TFLOP/s with scales per row: {rates}")
        unscaled = {k: v for k, v in t.items() if UNSCALED in k}
        if unscaled:  # the same configuration with and without its block scales
            rates = ", ".join(
                f"{name}: {tflops(2 * m * n * k, v):.0f}" for name, v in unscaled.items()
            )
            rec.decision(f"block kernels, {label}: TFLOP/s without block scales: {rates}")

"""The persistent warp-specialized block-scaled FP8 GEMM (Pallas Mosaic GPU, issue 39): the
code a GPU runs, `wgmma` on the transposed rhs view included, in Mosaic GPU's interpreter
(JAX 0.11 and later: `tests/other_jax.sh`) against float64; its tuning knobs; and the
deviceless H100 compile (warp-specialized, FP8 `wgmma`, no register spills)."""

import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import run_with_mosaic_dump

import fp8jax
from fp8jax._src.core import mosaic_private
from fp8jax._src.kernels import BLOCK_GEMM_NAME, choice, dispatch, reference
from fp8jax._src.kernels.choice import persistent_kernel, weight_block_scales
from fp8jax._src.kernels.grouped_gemm import RowItems, row_items
from fp8jax._src.kernels.persistent_config import (
    PersistentConfig,
    chain_state,
    chained_stages,
    grid_programs,
    pipeline_stages,
    running_first,
    token_steps,
)
from fp8jax._src.kernels.persistent_gemm import (
    PERSISTENT_GEMM_NAME,
    PERSISTENT_ROWS_NAME,
    PERSISTENT_TOKENS_NAME,
    persistent_block_scaled_gemm,
)
from fp8jax._src.kernels.persistent_grouped import (
    persistent_grouped_rows_gemm,
    persistent_grouped_tokens_gemm,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

needs_interpreter = pytest.mark.skipif(
    not mosaic_private.interpreter_runs_gpu_path(),
    reason=f"jax {jax.__version__}'s Mosaic GPU interpreter has no wgmma on a transposed view "
    "(run by tests/other_jax.sh on JAX 0.11 and later)",
)


def fp8_operand(rng, rows, k, dtype=E4M3):
    """FP8 data (rows, k) and one power-of-two scale per row and 128-chunk."""
    data = rng.standard_normal((rows, k)) * 4
    scale = 2.0 ** rng.integers(-4, 4, (rows, -(-k // 128)))
    return jnp.asarray(data, dtype), jnp.asarray(scale, jnp.float32)


@needs_interpreter
@pytest.mark.parametrize(
    "m, n, k, n_terms, fmt, config",
    [
        # one CTA tile (two warpgroups' halves along M), two chunks
        (128, 128, 256, 1, E4M3, PersistentConfig(num_sms=1)),
        # odd shapes (padding), a gradient's format, the warpgroups split along N
        (70, 130, 300, 1, E5M2, PersistentConfig(wg_dimension="n", num_sms=2)),
        # the residual form (two weights share each lhs tile); 6 tiles on 4 programs, snake
        # order along M in bands of 2, a 2-stage pipeline over 3 chunks
        (
            300,
            260,
            384,
            2,
            E4M3,
            PersistentConfig(
                num_sms=4, max_concurrent_steps=2, grid_minor_dim="m", grid_tile_width=2
            ),
        ),
        # one row of tiles (the persistent loop walks it in order), one chunk
        (40, 520, 128, 1, E4M3, PersistentConfig(num_sms=3)),
        # clusters of two CTAs sharing (multicasting) the rhs tile, then the lhs tile
        (300, 500, 384, 1, E4M3, PersistentConfig(cluster="m", num_sms=4)),
        (300, 500, 384, 1, E4M3, PersistentConfig(cluster="n", wg_dimension="n", num_sms=4)),
        # two chunks a step, the first promoted while the second's wgmma runs: three chunks
        # padded to four, the residual form
        (70, 130, 300, 2, E4M3, PersistentConfig(chunks_per_step=2, num_sms=2)),
        # each chunk's scales loaded and multiplied while its wgmma runs, the residual form
        (70, 130, 300, 2, E4M3, PersistentConfig(scales_under_wgmma=True, num_sms=2)),
        # three compute warpgroups (192-row CTA tiles): the last one's third warpgroup has
        # no output rows (300 rows: 320 written, not 384)
        (300, 260, 384, 1, E4M3, PersistentConfig(compute_wgs=3, num_sms=3)),
        # each program's tiles chained into one pipeline: 9 tiles on 4 programs (3, 2, 2, 2),
        # 6 chunks a tile in 3 stages (4 would not divide them)
        (300, 260, 768, 1, E4M3, PersistentConfig(num_sms=4, chained=True)),
        # chained with two chunks a step and clusters multicasting the rhs tile, the residual
        # form; 4 tiles on 3 programs: one of them runs a single tile (its pipeline's start)
        (
            300,
            250,
            512,
            2,
            E5M2,
            PersistentConfig(chunks_per_step=2, cluster="m", chained=True, num_sms=3),
        ),
    ],
)
def test_kernel_matches_float64_reference_in_the_interpreter(m, n, k, n_terms, fmt, config):
    """Each chunk's FP8 product is exact in float32 and the scales are powers of two: the
    kernel differs from the float64 reference only by float32 summation, wherever a tile,
    chunk, term or scale lands (a swapped scale axis or a wrong tile fails by far more)."""
    rng = np.random.default_rng(m + n + k)
    lhs, lhs_scale = fp8_operand(rng, m, k, fmt)
    terms = [fp8_operand(rng, n, k, fmt) for _ in range(n_terms)]
    out = jax.jit(
        lambda *a: persistent_block_scaled_gemm(a[0], a[1], a[2], config=config, interpret=True)
    )(lhs, lhs_scale, terms)
    want = reference.block_scaled(lhs, lhs_scale, terms)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    magnitude = reference.block_scaled_magnitude(lhs, lhs_scale, terms)
    np.testing.assert_array_less(
        np.abs(np.asarray(out, np.float64) - want), reference.BLOCK_RTOL * magnitude + 1e-30
    )


@needs_interpreter
@pytest.mark.parametrize(
    "block_rows, n_terms, config",
    [
        # a 128 x 128-block weight as rhs: one scale per warpgroup tile (tile_n 128)
        ((1, 128), 1, PersistentConfig(num_sms=4)),
        # both operands in blocks, the warpgroups splitting N, two chunks a step (the pair's
        # scalar scales), the residual form
        ((128, 128), 2, PersistentConfig(wg_dimension="n", chunks_per_step=2, num_sms=3)),
        # lhs blocks (tile_m 64 in 128-row blocks); rhs blocks wider than no tile: vectors
        ((128, 64), 1, PersistentConfig(tile_n=256, num_sms=2)),
        # the rhs blocks' scales (and the lhs rows') multiplied while the wgmma runs
        ((1, 128), 2, PersistentConfig(scales_under_wgmma=True, num_sms=3)),
        # three compute warpgroups splitting N (64 x 192 CTA tiles), a scale per tile
        ((1, 128), 1, PersistentConfig(compute_wgs=3, wg_dimension="n", tile_n=64, num_sms=2)),
        # lhs blocks of 64 rows, the warpgroups splitting M: one scale per warpgroup, each its
        # own block's (the second warpgroup's is not the CTA's first row's)
        ((64, 1), 1, PersistentConfig(num_sms=2)),
    ],
)
def test_block_scales_given_per_block_match_float64(block_rows, n_terms, config):
    """Scales given per 128 x 128 block (`block_rows`), each block's different: the kernel
    reads one scale for a warpgroup's tile where a block covers it, a vector elsewhere, and
    matches float64 with the scales repeated over each block's rows. A scale read from
    another tile's block or chunk fails by far more than the bound."""
    m, n, k = 300, 260, 384
    rng = np.random.default_rng(7)

    def operand(rows, per):
        data, _ = fp8_operand(rng, rows, k)
        scale = 2.0 ** rng.integers(-6, 6, (-(-rows // per), k // 128))
        return data, jnp.asarray(scale, jnp.float32)

    lhs, lhs_scale = operand(m, block_rows[0])
    terms = [operand(n, block_rows[1]) for _ in range(n_terms)]
    out = jax.jit(
        lambda *a: persistent_block_scaled_gemm(
            *a, config=config, block_rows=block_rows, interpret=True
        )
    )(lhs, lhs_scale, terms)

    def rows(scale, per, count):
        return np.repeat(np.asarray(scale), per, axis=0)[:count]

    sa = rows(lhs_scale, block_rows[0], m)
    per_row = [(b, rows(sb, block_rows[1], n)) for b, sb in terms]
    want = reference.block_scaled(lhs, sa, per_row)
    magnitude = reference.block_scaled_magnitude(lhs, sa, per_row)
    np.testing.assert_array_less(
        np.abs(np.asarray(out, np.float64) - want), reference.BLOCK_RTOL * magnitude + 1e-30
    )


@needs_interpreter
def test_kernel_writes_bf16_rounded_from_float32():
    rng = np.random.default_rng(1)
    lhs, lhs_scale = fp8_operand(rng, 128, 256)
    rhs, rhs_scale = fp8_operand(rng, 256, 256)
    config = PersistentConfig(num_sms=2)
    gemm = jax.jit(
        lambda out_dtype: persistent_block_scaled_gemm(
            lhs, lhs_scale, [(rhs, rhs_scale)], out_dtype=out_dtype, config=config, interpret=True
        ),
        static_argnums=0,
    )
    f32, bf16 = gemm(jnp.float32), gemm(jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32).astype(ml_dtypes.bfloat16))


@pytest.mark.skipif(
    mosaic_private.interpreter_runs_gpu_path(), reason="this interpreter can run it"
)
def test_an_interpreter_without_transposed_wgmma_is_refused_by_name():
    rng = np.random.default_rng(2)
    lhs, lhs_scale = fp8_operand(rng, 64, 128)
    with pytest.raises(NotImplementedError, match="transposed shared-memory view"):
        persistent_block_scaled_gemm(lhs, lhs_scale, [(lhs, lhs_scale)], interpret=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tile_m=32), "tile_m=32"),
        (dict(tile_n=100), "tile_n=100"),
        (dict(wg_dimension="k"), "wg_dimension='k'"),
        (dict(grid_minor_dim=1), "grid_minor_dim=1"),
        (dict(max_concurrent_steps=0), "max_concurrent_steps=0"),
        (dict(grid_tile_width=True), "grid_tile_width=True"),
        (dict(num_sms=0), "num_sms=0"),
        (dict(cluster="k"), "cluster='k'"),
        (dict(chunks_per_step=4), "chunks_per_step=4"),
        (dict(chained=1), "chained=1"),
        (dict(scales_under_wgmma=None), "scales_under_wgmma=None"),
        (dict(compute_wgs=4), "compute_wgs=4"),
        (dict(compute_wgs=3, wg_dimension="n"), r"\(64, 384\) .* exceeds the 256 rows"),
        (dict(tile_m=192), r"\(384, 128\) .* exceeds the 256 rows"),
        (dict(scales_under_wgmma=True, chunks_per_step=2), "takes chunks_per_step=1, not 2"),
    ],
)
def test_bad_configs_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PersistentConfig(**kwargs)


def test_chained_pipelines_take_the_most_stages_that_divide_a_tiles_steps():
    """JAX chains pipelines whose stages divide their steps: the most up to the configured
    stages, none (0: unchained) where no count from 2 divides them or `chained` is off."""
    on, off = PersistentConfig(chained=True), PersistentConfig()
    assert [chained_stages(on, 4, steps) for steps in (32, 56, 6, 9, 5, 7)] == [4, 4, 3, 3, 0, 0]
    assert chained_stages(on, 2, 4) == 2 and chained_stages(on, 1, 4) == 0
    assert chained_stages(off, 4, 32) == 0


def test_running_first_puts_the_items_of_an_expert_first_and_counts_them():
    """The chained rows kernel's item order: those of an expert first, each group in its
    order, and their count in a fifth row."""
    items = RowItems.of_tiles(jnp.array([2, -1, 0, -1, 1, 0], jnp.int32), 64).stacked()
    got = np.asarray(running_first(items))
    assert got[:4, :4].tolist() == np.asarray(items)[:, [0, 2, 4, 5]].tolist()
    assert got[1].tolist() == [2, 0, 1, 0, -1, -1] and got[4].tolist() == [4] * 6


def test_token_steps_run_every_experts_chunks_in_expert_order():
    """The streamed tokens kernel's steps: each expert's chunks from its start, experts in
    order (an empty one has none), flags at each expert's first (1) and last (2) step, the
    counts' sum appended; the steps past it unused."""
    start, count = jnp.array([0, 3, 5, 3], jnp.int32), jnp.array([3, 0, 1, 2], jnp.int32)
    table, counts = (np.asarray(a) for a in token_steps(start, count, 6))
    assert table.shape == (3, 24) and counts.tolist() == [3, 0, 1, 2, 6]
    assert table[0, :6].tolist() == [0, 1, 2, 5, 3, 4]
    assert table[1, :6].tolist() == [0, 0, 0, 2, 3, 3]
    assert table[2, :6].tolist() == [1, 0, 2, 3, 1, 2]
    # Counts outside 0..chunks are taken at the nearest bound: the steps fit the table.
    _, counts = token_steps(jnp.zeros((2,), jnp.int32), jnp.array([-1, 9], jnp.int32), 4)
    assert np.asarray(counts).tolist() == [0, 4, 4]


def test_cta_tile_doubles_along_the_warpgroup_split_and_the_cluster():
    assert PersistentConfig().cta_tile == (128, 128)
    assert PersistentConfig(wg_dimension="n", tile_n=64).cta_tile == (64, 128)
    assert PersistentConfig(cluster="m").cluster_tile == (256, 128)
    assert PersistentConfig(cluster="n", wg_dimension="n").cluster_tile == (64, 512)


def test_bad_operands_are_refused_naming_the_kernel():
    rng = np.random.default_rng(3)
    lhs, lhs_scale = fp8_operand(rng, 64, 256)
    rhs, rhs_scale = fp8_operand(rng, 128, 256)
    with pytest.raises(ValueError, match="persistent_block_scaled_gemm: rhs 0's scale"):
        persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs, lhs_scale)])
    with pytest.raises(ValueError, match="persistent_block_scaled_gemm: rhs 0 is bfloat16"):
        persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs.astype(jnp.bfloat16), rhs_scale)])
    # Scales per 128-row block must be given per block (one for 128 rows), as two ints.
    with pytest.raises(ValueError, match=r"rhs 0's scale has shape \(128, 2\); .* per 128 row"):
        persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs, rhs_scale)], block_rows=(1, 128))
    with pytest.raises(ValueError, match=r"block_rows=\(1, 0\); expected"):
        persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs, rhs_scale)], block_rows=(1, 0))
    if not mosaic_private.mixed_fp8_wgmma():  # JAX 0.10: one FP8 type per wgmma
        with pytest.raises(ValueError, match="persistent_block_scaled_gemm: operands in"):
            persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs.astype(E5M2), rhs_scale)])


H100_SCRIPT = """
import glob, json, os, re, sys
import jax, jax.numpy as jnp
from fp8jax._src.observe import deviceless
from fp8jax._src.kernels.persistent_gemm import PersistentConfig, persistent_block_scaled_gemm
from fp8jax._src.kernels.persistent_grouped import persistent_grouped_tokens_gemm

m, n, k = 1024, 2048, 1024
f8, S = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
args = (S((m, k), f8), S((m, k // 128), jnp.float32), S((n, k), f8), S((n, k // 128), jnp.float32))
config = PersistentConfig(**json.loads(sys.argv[1]))
if sys.argv[2] == "dense":
    gemm = lambda a, sa, b, sb: persistent_block_scaled_gemm(
        a, sa, [(b, sb)], out_dtype=jnp.bfloat16, config=config)
elif sys.argv[2] == "dense-blocks":  # the rhs a weight in 128 x 128 blocks
    args = args[:3] + (S((n // 128, k // 128), jnp.float32),)
    gemm = lambda a, sa, b, sb: persistent_block_scaled_gemm(
        a, sa, [(b, sb)], out_dtype=jnp.bfloat16, config=config, block_rows=(1, 128))
else:  # the tokens kernel (wgrad) of 8 experts over the same operands, block or group scales
    counts = (S((8,), jnp.int32),) * 2
    args = args + counts + (S((8,), jnp.float32),)
    def gemm(a, sa, b, sb, start, count, group_scale):
        scales = dict(group_scale=group_scale) if sys.argv[2] == "tokens-group" else dict(
            lhs_scale=sa, rhs_scale=sb)
        return persistent_grouped_tokens_gemm(
            a, b, start, count, **scales, out_dtype=jnp.float32, config=config)
lowered, _ = deviceless.lower(gemm, args, {}, deviceless.h100_topology().devices[0])
lowered.compile()
dump = os.environ["MOSAIC_GPU_DUMP_TO"]
ptx = [open(f).read() for f in glob.glob(os.path.join(dump, "*.ptx"))]
ptxas = [open(f).read() for f in glob.glob(os.path.join(dump, "*.ptxas"))]
print(json.dumps({
    "entries": [e for t in ptx for e in re.findall(r"\\.entry (\\w+)", t)],
    "mma": sorted({i for t in ptx for i in re.findall(r"wgmma\\.mma_async[\\w.]*", t)}),
    "setmaxnreg": sorted({i for t in ptx for i in re.findall(r"setmaxnreg\\.\\w+\\S*\\s+\\d+", t)}),
    "spills": [[int(s) for s in re.findall(r"(\\d+) bytes spill", t)] for t in ptxas],
    "serialized": sum(t.count("C7514") for t in ptxas),
    "mul": sum(len(re.findall(r"\\bmul\\.(?:rn\\.)?f32", t)) for t in ptx),
    "fma": sum(len(re.findall(r"\\bfma\\.rn\\.f32", t)) for t in ptx),
    "waits": sorted(
        {int(i) for t in ptx for i in re.findall(r"wgmma\\.wait_group\\S*\\s+(\\d+)", t)}
    ),
}))
"""


@pytest.mark.parametrize(
    "config, kind",
    [
        ({}, "dense"),
        # one compile (CI time): also each program's tiles chained into one pipeline
        ({"wg_dimension": "n", "chunks_per_step": 2, "chained": True}, "dense"),
        ({"cluster": "m", "scales_under_wgmma": True, "compute_wgs": 3}, "dense-blocks"),
        ({}, "tokens"),
        ({"cluster": "m", "chained": True}, "tokens-group"),
    ],
    ids=[
        "default",
        "wg n, two a step, chained",
        "cluster m, rhs blocks, scales under wgmma, three warpgroups",
        "tokens",
        "tokens per-expert cluster m, streamed",
    ],
)
def test_deviceless_h100_compile_is_warp_specialized_fp8_wgmma_without_spills(
    tmp_path, config, kind
):
    """What Mosaic GPU makes of the kernel for an H100, read from its PTX: FP8 `wgmma` (E4M3
    operands, float32 accumulator), registers moved between the memory and compute
    warpgroups (`setmaxnreg`: warp specialization), and no register spilled by ptxas. Also
    for the grouped tokens kernel (the wgrad: a run-time trip count per expert). A weight's
    128 x 128 block scales promote each chunk with one FMA per accumulator element, where
    scales per row cost a multiply more."""
    pytest.importorskip("jax_cuda12_plugin")
    run = run_with_mosaic_dump(H100_SCRIPT, [json.dumps(config), kind], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    name = PERSISTENT_GEMM_NAME if kind.startswith("dense") else PERSISTENT_TOKENS_NAME
    assert any(name in e for e in seen["entries"]), seen["entries"]
    assert seen["mma"] and all(".f32.e4m3.e4m3" in i for i in seen["mma"]), seen["mma"]
    # The memory warpgroup gives registers up, the compute warpgroups take them.
    kinds = {s.split(".")[1] for s in seen["setmaxnreg"]}
    assert kinds == {"inc", "dec"}, seen["setmaxnreg"]
    assert seen["spills"] and all(s and not any(s) for s in seen["spills"]), seen["spills"]
    # ptxas keeps the wgmma pipelined: no "wgmma.mma_async instructions are serialized"
    # (C7514, as when an accumulator is read while its wgmma may be in flight: an experiment
    # that kept one in flight across pipeline steps got it, session 36).
    assert seen["serialized"] == 0, seen
    # Two chunks a step: the first chunk's product read with the second's wgmma in flight
    # (where JAX can wait for fewer than all: 0.11 on).
    overlap = config.get("chunks_per_step") == 2 and mosaic_private.wgmma_partial_waits()
    assert (1 in seen["waits"]) == overlap and 0 in seen["waits"], seen["waits"]
    # Promotion: one FMA per element; a multiply per element too unless one scale covers it.
    if kind == "dense":
        assert seen["fma"] >= 64 and seen["mul"] >= seen["fma"], seen
    elif kind == "dense-blocks":
        assert seen["fma"] >= 64 and 16 * seen["mul"] <= seen["fma"], seen


@needs_interpreter
def test_the_gpu_checks_kernels_section_runs_dry(tmp_path):
    """`benchmarks/gpu_check --sections kernels` as a lent GPU will run it, on tiny shapes in
    the interpreter: its float64 numerics pass, every swept configuration computes what the
    tiled kernel computes, and the pipeline without block scales what cuBLASLt's per-tensor
    product computes. So does its `transpose` section (the tensor-core kernels, per-tensor,
    blockwise tiles, a weight's blocks and a saved copy requantized: their copies as
    NumPy's, timed beside XLA's and the Triton kernels'; since session 53 also an expert
    layer's gathered copy and experts' weights together, since session 54 its saved
    activation's gathered copy and its gradient's two copies from one read)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--dry-run"]
    command += ["--sections", "kernels,transpose,blockwise", "--out", str(tmp_path)]
    command += ["--budget-s", "550"]  # a slow or busy machine must not skip (170 s alone)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    results = [r for r in map(json.loads, lines) if r["name"] != "(section)"]
    assert results and all(r["status"] == "ok" for r in results), results
    transposed = [r for r in results if r["section"].startswith(("2e ", "2f "))]
    ways = ("triton, default", "tensor cores, default")
    # Per tensor (the dry BF16 shape), then blockwise (it and the dry weight).
    gathered = (
        "blockwise gathered ",
        "blockwise rows+gathered ",
        "blockwise gathered requantized ",
    )
    kinds = (("",), ("blockwise ", *gathered, "blockwise rows ", "blockwise requantized "))
    kinds += (("blockwise weight ",), ("blockwise experts' weights ",))
    checked: dict[tuple, dict] = {}  # (section, shape) -> way -> elements differing: XLA's and
    for r in transposed:  # Triton's ways in one measurement, each tensor-core way in its own
        if r["name"].startswith("numerics"):
            shape = (r["section"], r["name"].split(" | ")[0])
            checked.setdefault(shape, {}).update(r["elements_differing"])
    assert list(checked.values()) == [
        {f"{kind}{way}": 0 for kind in shape for way in ways}
        for shape in kinds  # a BF16 operand, a weight, experts' weights
    ], transposed
    for kind in {kind for shape in kinds for kind in shape}:
        timed = f"| {kind}tensor cores, default"
        assert any(r["name"].endswith(timed) and "ms" in r for r in transposed), timed
    results = [r for r in results if r not in transposed]
    numerics = [r for r in results if r["name"].startswith("numerics")]
    assert len(numerics) == 2 and all(r["passed"] for r in numerics), numerics
    swept = [  # (the numerics cases' names end with their configuration)
        r
        for r in results
        if "| persistent" in r["name"] and "no block scales" not in r["name"] and r not in numerics
    ]
    # DRY_SWEEP: the default, the warpgroups split along N, a cluster sharing the lhs tile
    # (the weight's scales per block), and the default with them per row
    assert len(swept) == 4 and all(r["max_rel_diff_vs_tiled"] < 1e-2 for r in swept), swept
    assert sum(r["name"].endswith("scales per row") for r in swept) == 1, swept
    # The pipeline without block scales (one accumulation, summed per chunk, chained): each
    # computes cuBLASLt's per-tensor product of the same FP8 values.
    unscaled = [r for r in results if "no block scales" in r["name"]]
    assert len(unscaled) == 3 and all(r["max_rel_diff_vs_fp8"] < 1e-2 for r in unscaled), unscaled
    decisions = (tmp_path / "decisions.txt").read_text()
    assert "block kernels, dry: fastest persistent" in decisions, decisions
    assert "block kernels, dry: TFLOP/s with scales per row: persistent" in decisions, decisions


def spy_on(monkeypatch, kernel: str, argument: str) -> list:
    """The values of `argument` in each call `choice` makes of `kernel`, from now on."""
    real, seen = getattr(choice, kernel), []

    def spy(*args, **kwargs):
        seen.append(kwargs.get(argument, inspect.signature(real).parameters[argument].default))
        return real(*args, **kwargs)

    monkeypatch.setattr(choice, kernel, spy)
    return seen


def _linear_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


@needs_interpreter
@pytest.mark.parametrize(
    "recipe, per_block",
    [
        (fp8jax.BlockwiseScaling(native_kernel=True), False),
        (fp8jax.BlockwiseScaling(native_kernel=True), True),
        (fp8jax.ResidualFP8(native_kernel=True), False),  # two weights share each lhs tile
    ],
    ids=["blockwise", "blockwise, weight scales per block", "residual"],
)
def test_recipes_train_the_same_on_the_persistent_kernel(getkey, monkeypatch, recipe, per_block):
    """A Linear with odd sizes, forward, dgrad and wgrad on the persistent kernel (traced
    inside `persistent_kernel`, interpreted) against the recipe's XLA path: loss, gradients
    and FP8 state alike, float32 summation order aside; and the step's program does call the
    persistent kernel. Also with the weight's scales given once per 128 x 128 block
    (`weight_block_scales`: one scale per warpgroup tile in the forward and dgrad; a weight
    of whole blocks, which the one-pass kernel quantizes)."""
    linear = eqx.nn.Linear(*((256, 256) if per_block else (200, 150)), key=getkey())
    x = jax.random.normal(getkey(), (70, linear.in_features))
    seen = spy_on(monkeypatch, "persistent_block_scaled_gemm", "block_rows")
    model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
    xla_model = fp8jax.fp8_linear_layers(
        linear, fp8jax.Fp8Config(recipe=dataclasses.replace(recipe, native_kernel=False))
    )
    step = fp8jax.filter_value_and_grad(_linear_loss)
    blocks = weight_block_scales() if per_block else contextlib.nullcontext()
    with dispatch.interpreted(), persistent_kernel(PersistentConfig(num_sms=2)), blocks:
        jaxpr = str(jax.make_jaxpr(step)(model, x))
        loss_n, grads_n = jax.jit(step)(model, x)
    assert PERSISTENT_GEMM_NAME in jaxpr
    # The forward's and dgrad's weight per block of 128 rows (once per trace), the wgrad's
    # operands per row; by default all per row.
    rows = [(1, 128), (1, 128), (1, 1)] if per_block else [(1, 1)] * 3
    assert sorted(seen, reverse=True) == sorted(rows * 2, reverse=True), seen
    loss_x, grads_x = jax.jit(step)(xla_model, x)
    np.testing.assert_allclose(loss_n, loss_x, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_n), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * float(jnp.max(jnp.abs(b))))


def test_interpreted_recipes_keep_the_tiled_kernel_unless_a_context_chooses(getkey):
    """Traced for the interpreter (the tests), the recipes call the tiled kernel: JAX 0.10's
    interpreter cannot run the persistent one, whose tests choose it explicitly."""
    linear = eqx.nn.Linear(256, 128, key=getkey())
    recipe = fp8jax.BlockwiseScaling(native_kernel=True)
    model = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=recipe))
    x = jax.random.normal(getkey(), (64, 256))
    with dispatch.interpreted():
        jaxpr = str(jax.make_jaxpr(fp8jax.filter_value_and_grad(_linear_loss))(model, x))
    assert BLOCK_GEMM_NAME in jaxpr and PERSISTENT_GEMM_NAME not in jaxpr


def _chosen_configs(monkeypatch, context) -> dict:
    """The configuration each kind of GEMM gets from `choice` when traced (not interpreted)
    inside `context`: dense, grouped rows and grouped tokens; `None` for a tiled kernel."""
    from fp8jax._src.kernels import choice

    seen: dict = {}

    def spy(kind, real):
        def call(*args, config, **kwargs):
            seen[kind] = config
            return real(*args, config=config, **kwargs)

        call.seen = seen  # what it saw, also after this function returned
        return call

    def tiled(kind, real):
        def call(*args, **kwargs):
            seen[kind] = None
            return real(*args, **kwargs)

        return call

    for kind, name in [
        ("dense", "persistent_block_scaled_gemm"),
        ("rows", "persistent_grouped_rows_gemm"),
        ("tokens", "persistent_grouped_tokens_gemm"),
    ]:
        monkeypatch.setattr(choice, name, spy(kind, getattr(choice, name)))
    for kind, name in [
        ("dense", "block_scaled_gemm"),
        ("rows", "grouped_rows_gemm"),
        ("tokens", "grouped_tokens_gemm"),
    ]:
        monkeypatch.setattr(choice, name, tiled(kind, getattr(choice, name)))
    a = jax.ShapeDtypeStruct((256, 256), E4M3)
    s = jax.ShapeDtypeStruct((256, 2), jnp.float32)
    items = row_items(jnp.array([100, 0, 156], jnp.int32), 256)
    ws = jax.ShapeDtypeStruct((3, 128, 256), E4M3)
    wss = jax.ShapeDtypeStruct((3, 128, 2), jnp.float32)
    starts, counts = jnp.array([0, 1, 1], jnp.int32), jnp.array([1, 0, 1], jnp.int32)
    with context:
        jax.eval_shape(lambda a, s: choice.recipe_block_gemm(a, s, [(a, s)]), a, s)
        jax.eval_shape(
            lambda a, s, w, ws: choice.recipe_grouped_rows_gemm(
                a, w, items, lhs_scale=s, rhs_scale=ws
            ),
            a,
            s,
            ws,
            wss,
        )
        jax.eval_shape(
            lambda a, s: choice.recipe_grouped_tokens_gemm(
                a, a, starts, counts, lhs_scale=s, rhs_scale=s
            ),
            a,
            s,
        )
    return seen


def test_gpu_traces_take_the_persistent_kernels_in_the_swept_configurations(monkeypatch):
    """Traced on a GPU machine with no context, each GEMM runs on its persistent kernel in the
    configuration of `choice.DEFAULT_CONFIGS` (the GPU check's fastest, run 4; the rows
    kernel's CTA rows and warpgroups fixed by its items); `tiled_kernel()` takes the tiled
    kernels; `persistent_kernel(config)` gives one configuration to all three;
    `chained_pipelines()` chains whichever each has."""
    import contextlib

    from fp8jax._src.kernels import choice
    from fp8jax._src.kernels.block_gemm import TILE_M

    monkeypatch.setattr(choice, "on_gpu", lambda: True)  # as traced on a GPU machine
    got = _chosen_configs(monkeypatch, contextlib.nullcontext())
    assert got["dense"] == choice.DEFAULT_CONFIGS["dense"] != PersistentConfig()
    assert got["tokens"] == choice.DEFAULT_CONFIGS["tokens"]
    rows = dataclasses.replace(choice.DEFAULT_CONFIGS["rows"], tile_m=TILE_M, wg_dimension="n")
    assert got["rows"] == rows
    assert _chosen_configs(monkeypatch, choice.tiled_kernel()) == dict.fromkeys(got)
    mine = PersistentConfig(max_concurrent_steps=3)
    got = _chosen_configs(monkeypatch, persistent_kernel(mine))
    assert got["dense"] == got["tokens"] == mine
    # Two chunks a step where a GEMM can take them (block scales, the chunks known when
    # traced); the tokens GEMM takes one.
    pair = PersistentConfig(chunks_per_step=2)
    got = _chosen_configs(monkeypatch, persistent_kernel(pair))
    assert got["dense"].chunks_per_step == got["rows"].chunks_per_step == 2
    assert got["tokens"] == dataclasses.replace(pair, chunks_per_step=1)
    # `chained_pipelines()`: each GEMM's configuration as it would be, chained; alone, and
    # over a configuration of the user's.
    chained = _chosen_configs(monkeypatch, choice.chained_pipelines())
    assert chained["dense"] == dataclasses.replace(choice.DEFAULT_CONFIGS["dense"], chained=True)
    assert chained["tokens"] == dataclasses.replace(choice.DEFAULT_CONFIGS["tokens"], chained=True)
    assert chained["rows"] == dataclasses.replace(rows, chained=True)
    with persistent_kernel(mine):
        got = _chosen_configs(monkeypatch, choice.chained_pipelines())
    assert got["dense"] == got["tokens"] == dataclasses.replace(mine, chained=True)
    # Three compute warpgroups only where a scale covers a warpgroup's tile (a weight's
    # blocks): with scales per row on both sides each GEMM takes two (three would spill).
    three = PersistentConfig(compute_wgs=3)
    got = _chosen_configs(monkeypatch, persistent_kernel(three))
    assert all(c == dataclasses.replace(c, compute_wgs=2) for c in got.values()), got
    blocks = jax.ShapeDtypeStruct((2, 2), jnp.float32)  # 256 rows in 128-row blocks
    with persistent_kernel(three):
        jax.eval_shape(
            lambda a, s, b: choice.recipe_block_gemm(a, s, [(a, b)], block_rows=(1, 128)),
            jax.ShapeDtypeStruct((256, 256), E4M3),
            jax.ShapeDtypeStruct((256, 2), jnp.float32),
            blocks,
        )
    assert choice.persistent_block_scaled_gemm.seen["dense"].compute_wgs == 3
    a, w = jax.ShapeDtypeStruct((256, 256), E4M3), jax.ShapeDtypeStruct((3, 128, 256), E4M3)
    items = row_items(jnp.array([100, 0, 156], jnp.int32), 256)
    with persistent_kernel(pair):  # per-item scales: one chunk a step (two would raise)
        jax.eval_shape(
            lambda a, w: choice.recipe_grouped_rows_gemm(
                a, w, items, item_scale=jnp.ones(items.tile.shape)
            ),
            a,
            w,
        )
    with pytest.raises(TypeError, match="config='fast'; expected a PersistentConfig"):
        persistent_kernel("fast")


@needs_interpreter
@pytest.mark.parametrize(
    "scaling",
    [
        "blocks",
        "weight blocks, two a step",
        "item",
        "item, promoted",
        "blocks, chained",
        "item, chained",
        "blocks, scales under wgmma",
        "weight blocks, three warpgroups",
    ],
)
def test_grouped_rows_kernel_matches_float64_on_unpadded_rows(scaling):
    """Each expert's rows times its weight, on the rows as they are (`row_items`): experts'
    ends sharing tiles, expert 1 without rows, rows past every expert (zeros), the last tile
    partial; persistent over 9 x 2 (item, column tile) pairs on 3 programs. Block scales
    promoted per chunk (also two chunks a step, three padded to four, with the weights'
    scales per 128 x 128 block: one per warpgroup tile), or one scale per item applied to
    the whole accumulation. Also with each program's tiles chained into one pipeline (3
    chunks, 3 stages), and with the block scales multiplied while each `wgmma` runs."""
    rng = np.random.default_rng(4)
    sizes = np.array([100, 0, 150, 30], np.int32)
    m = 300
    lhs, lhs_scale = fp8_operand(rng, m, 300)
    pairs = [fp8_operand(rng, 200, 300) for _ in range(4)]
    rhs, rhs_scale = jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])
    expert_scale = jnp.asarray(2.0 ** rng.integers(-4, 4, len(sizes)), jnp.float32)
    items = row_items(jnp.asarray(sizes), m)
    blocks, per_block = "blocks" in scaling, {}
    if scaling.startswith("weight blocks"):  # each expert's 2 x 3 blocks' scales, all differ
        rhs_scale = jnp.asarray(2.0 ** rng.integers(-6, 6, (4, 2, 3)), jnp.float32)
        scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale)
        per_block = dict(rhs_block_rows=128)
        rhs_scale = jnp.repeat(rhs_scale, 128, axis=1)[:, :200]  # the reference's, per row
    elif blocks:
        scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    else:
        scales = dict(item_scale=expert_scale[jnp.maximum(items.expert, 0)])
    per_step = 2 if scaling.endswith("a step") else 1
    config = PersistentConfig(
        wg_dimension="n",
        num_sms=3,
        chunks_per_step=per_step,
        chained="chained" in scaling,
        scales_under_wgmma="under" in scaling,
        compute_wgs=3 if "three" in scaling else 2,
        tile_n=64 if "three" in scaling else 128,  # three along N: 192 columns a CTA
    )
    kw = dict(config=config, promote=scaling == "item, promoted", interpret=True, **per_block)
    out = jax.jit(lambda a, b, i, s: persistent_grouped_rows_gemm(a, b, i, **s, **kw))(
        lhs, rhs, items, scales
    )
    assert out.shape == (m, 200)
    np.testing.assert_array_equal(out[sizes.sum() :], 0.0)
    for e, rows in enumerate(np.split(np.arange(m), np.cumsum(sizes))[: len(sizes)]):
        if not rows.size:
            continue
        if blocks:
            sa, terms = lhs_scale[rows], [(rhs[e], rhs_scale[e])]
        else:  # the expert's scale on every row, unit scales on the weight
            sa = jnp.full(lhs_scale[rows].shape, expert_scale[e])
            terms = [(rhs[e], jnp.ones_like(rhs_scale[e]))]
        want = reference.block_scaled(lhs[rows], sa, terms)
        magnitude = reference.block_scaled_magnitude(lhs[rows], sa, terms)
        np.testing.assert_array_less(
            np.abs(np.asarray(out[rows], np.float64) - want),
            reference.BLOCK_RTOL * magnitude + 1e-30,
            err_msg=f"expert {e}",
        )


@needs_interpreter
def test_chained_rows_kernel_runs_whole_tiles_between_unwritten_ones():
    """Chained, the rows kernel reorders its items, those of an expert first (a tile left
    unwritten between them runs no pipeline and must not end or start the chain): whole
    64-row tiles of three experts among unwritten ones, 8 x 2 tiles on 3 programs, each tile
    as the float64 reference of its expert."""
    rng = np.random.default_rng(7)
    lhs, lhs_scale = fp8_operand(rng, 512, 256)
    pairs = [fp8_operand(rng, 256, 256) for _ in range(3)]
    rhs, rhs_scale = jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])
    tile_expert = np.array([2, -1, 0, -1, 1, 0, -1, 2], np.int32)
    config = PersistentConfig(wg_dimension="n", num_sms=3, chained=True)
    out = jax.jit(
        lambda a, sa, b, sb: persistent_grouped_rows_gemm(
            a,
            b,
            RowItems.of_tiles(jnp.asarray(tile_expert), 64),
            lhs_scale=sa,
            rhs_scale=sb,
            config=config,
            interpret=True,
        )
    )(lhs, lhs_scale, rhs, rhs_scale)
    for tile in np.flatnonzero(tile_expert >= 0):
        e, rows = tile_expert[tile], tile * 64 + np.arange(64)
        terms = [(rhs[e], rhs_scale[e])]
        want = reference.block_scaled(lhs[rows], lhs_scale[rows], terms)
        magnitude = reference.block_scaled_magnitude(lhs[rows], lhs_scale[rows], terms)
        np.testing.assert_array_less(
            np.abs(np.asarray(out[rows], np.float64) - want),
            reference.BLOCK_RTOL * magnitude + 1e-30,
            err_msg=f"tile {tile}",
        )


def test_grouped_rows_kernel_refuses_bad_input_by_name():
    rng = np.random.default_rng(5)
    lhs, lhs_scale = fp8_operand(rng, 128, 256)
    rhs, rhs_scale = fp8_operand(rng, 128, 256)
    rhs, rhs_scale = rhs[None], rhs_scale[None]
    experts = RowItems.of_tiles(jnp.zeros((2,), jnp.int32))
    kwargs = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    with pytest.raises(ValueError, match="wg_dimension='m'"):
        persistent_grouped_rows_gemm(lhs, rhs, experts, config=PersistentConfig(), **kwargs)
    with pytest.raises(ValueError, match="cluster='m'"):
        config = PersistentConfig(wg_dimension="n", cluster="m")
        persistent_grouped_rows_gemm(lhs, rhs, experts, config=config, **kwargs)
    with pytest.raises(ValueError, match="items is ndarray; expected RowItems"):
        persistent_grouped_rows_gemm(lhs, rhs, np.zeros((3,), np.int32), **kwargs)
    with pytest.raises(ValueError, match="items have shapes"):
        bad = experts._replace(tile=jnp.zeros((3,), jnp.int32))
        persistent_grouped_rows_gemm(lhs, rhs, bad, **kwargs)
    with pytest.raises(ValueError, match="rhs_scale has shape"):
        persistent_grouped_rows_gemm(lhs, rhs, experts, lhs_scale=lhs_scale, rhs_scale=rhs_scale[0])
    with pytest.raises(ValueError, match=r"\(1, 128, 2\); expected \(1, 1, 2\) .* 128 row"):
        persistent_grouped_rows_gemm(lhs, rhs, experts, **kwargs, rhs_block_rows=128)
    with pytest.raises(ValueError, match="not both or neither"):
        persistent_grouped_rows_gemm(lhs, rhs, experts, **kwargs, item_scale=jnp.ones((2,)))
    with pytest.raises(ValueError, match="item_scale has shape \\(3,\\)"):
        persistent_grouped_rows_gemm(lhs, rhs, experts, item_scale=jnp.ones((3,)))
    with pytest.raises(ValueError, match="chunks_per_step=2, which only the block-scaled"):
        config = PersistentConfig(wg_dimension="n", chunks_per_step=2)
        persistent_grouped_rows_gemm(lhs, rhs, experts, item_scale=jnp.ones((2,)), config=config)


@needs_interpreter
@pytest.mark.parametrize(
    "scaling, fmt, config",
    [
        # 3 experts x 2 x 2 tiles on 5 programs; a 2-stage pipeline over 1-3 chunks
        ("blocks", E4M3, PersistentConfig(num_sms=5, max_concurrent_steps=2)),
        ("group", E5M2, PersistentConfig(num_sms=5, max_concurrent_steps=2)),
        ("group, promoted", E4M3, PersistentConfig(num_sms=5, max_concurrent_steps=2)),
        # the warpgroups split along N, snake order along M, clusters sharing the rhs tile
        (
            "blocks",
            E4M3,
            PersistentConfig(wg_dimension="n", grid_minor_dim="m", cluster="m", num_sms=4),
        ),
        # streamed: every expert's chunks at a tile position in one pipeline, each expert's
        # sum fresh at its first chunk and stored at its last; 2 x 2 positions on 3 programs
        ("blocks", E4M3, PersistentConfig(num_sms=3, max_concurrent_steps=2, chained=True)),
        ("group", E5M2, PersistentConfig(num_sms=3, chained=True)),
        ("group, promoted", E4M3, PersistentConfig(num_sms=3, chained=True)),
        (
            "blocks",
            E5M2,
            PersistentConfig(wg_dimension="n", cluster="m", chained=True, num_sms=2),
        ),
        # streamed with each chunk's scales multiplied while its wgmma runs, three compute
        # warpgroups
        (
            "blocks",
            E4M3,
            PersistentConfig(num_sms=3, chained=True, scales_under_wgmma=True, compute_wgs=3),
        ),
    ],
)
def test_grouped_tokens_kernel_matches_float64_with_an_empty_expert(scaling, fmt, config):
    """Each expert contracts its own chunks of tokens (uneven: 3, 0, 1 and 2 chunks, out of
    order), persistent over (expert, tile) triples, each pipeline's trip count read at run
    time; the empty expert's tiles get zeros. Within the float32-summation bound of float64
    (a chunk of another expert, a missing one or a swapped scale fails by far more)."""
    rng = np.random.default_rng(7)
    a_rows, b_rows, chunks = 150, 200, 6
    lhs, lhs_scale = fp8_operand(rng, a_rows, 128 * chunks, fmt)
    rhs, rhs_scale = fp8_operand(rng, b_rows, 128 * chunks, fmt)
    start, count = np.array([0, 3, 5, 3], np.int32), np.array([3, 0, 1, 2], np.int32)
    if scaling == "blocks":
        scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    else:
        scales = dict(group_scale=jnp.asarray(2.0 ** rng.integers(-4, 4, 4), jnp.float32))
    kw = dict(config=config, promote=scaling == "group, promoted", interpret=True)
    out = jax.jit(lambda *a: persistent_grouped_tokens_gemm(*a, **scales, **kw))(
        lhs, rhs, jnp.asarray(start), jnp.asarray(count)
    )
    assert out.shape == (4, a_rows, b_rows)
    want = reference.grouped_tokens(lhs, rhs, start, count, **scales)
    for e in range(4):
        if not count[e]:
            np.testing.assert_array_equal(np.asarray(out[e]), 0.0)
            continue
        bound = reference.float32_sum_bound(128 * count[e], np.abs(want[e]).max())
        np.testing.assert_array_less(np.abs(np.asarray(out[e], np.float64) - want[e]), bound)


def test_grouped_tokens_kernel_refuses_bad_input_by_name():
    rng = np.random.default_rng(8)
    lhs, lhs_scale = fp8_operand(rng, 64, 256)
    counts = jnp.zeros((2,), jnp.int32)
    kwargs = dict(lhs_scale=lhs_scale, rhs_scale=lhs_scale)
    call = persistent_grouped_tokens_gemm
    with pytest.raises(ValueError, match="persistent_grouped_tokens_gemm: 200 tokens"):
        call(lhs[:, :200], lhs[:, :200], counts, counts, group_scale=jnp.ones((2,)))
    with pytest.raises(ValueError, match="not both or neither"):
        call(lhs, lhs, counts, counts, **kwargs, group_scale=jnp.ones((2,)))
    with pytest.raises(ValueError, match="chunk_count has shape \\(3,\\)"):
        call(lhs, lhs, counts, jnp.zeros((3,), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match="group_scale has shape \\(1,\\)"):
        call(lhs, lhs, counts, counts, group_scale=jnp.ones((1,)))
    with pytest.raises(ValueError, match="expected \\(A, T\\) and \\(B, T\\)"):
        call(lhs, lhs[None], counts, counts, **kwargs)
    if not mosaic_private.mixed_fp8_wgmma():  # JAX 0.10: one FP8 type per wgmma
        with pytest.raises(ValueError, match="operands in \\[.float8_e4m3fn., .float8_e5m2.\\]"):
            call(lhs, lhs.astype(E5M2), counts, counts, **kwargs)


@needs_interpreter
@pytest.mark.parametrize(
    "recipe, per_block, chained",
    [
        (fp8jax.BlockwiseScaling(), True, False),
        (fp8jax.DelayedScaling(backward_format="e4m3"), False, False),
        (fp8jax.BlockwiseScaling(), False, True),
        (fp8jax.DelayedScaling(backward_format="e4m3"), False, True),
    ],
    ids=[
        "blockwise, weight scales per block",
        "delayed-e4m3",
        "blockwise, chained",
        "delayed-e4m3, chained",
    ],
)
def test_an_expert_layer_trains_the_same_on_the_persistent_kernels(
    monkeypatch, recipe, per_block, chained
):
    """Fp8RaggedDot, uneven experts and one without tokens: forward and dgrad on the
    persistent grouped rows kernel, the wgrad on the persistent tokens kernel (block scales,
    or per-tensor scales per tile and per expert; traced inside `persistent_kernel`,
    interpreted), against the layer's XLA path. Blockwise with the experts' weight scales
    once per 128 x 128 block (`weight_block_scales`: one per warpgroup tile; per row, the
    default, is test_grouped_native's). Also with each program's tiles chained (the wgrad
    streamed over the experts)."""
    sizes = jnp.asarray([70, 0, 130, 5], jnp.int32)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((205, 256)) * 3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 256, 192)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((205, 192)) * 1e-3, jnp.float32)

    def step(dot, x, w):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        return y, *vjp(g)[1:]

    on = fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=True)
    off = fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=False)
    seen = spy_on(monkeypatch, "persistent_grouped_rows_gemm", "rhs_block_rows")
    blocks = weight_block_scales() if per_block else contextlib.nullcontext()
    config = PersistentConfig(num_sms=2, chained=chained)
    with dispatch.interpreted(), persistent_kernel(config), blocks:
        jaxpr = str(jax.make_jaxpr(step)(on, x, w))
        got = eqx.filter_jit(step)(on, x, w)
    assert PERSISTENT_ROWS_NAME in jaxpr and PERSISTENT_TOKENS_NAME in jaxpr
    # The forward's and dgrad's expert weights per block of 128 rows where chosen (or per
    # tile: no block scales), twice traced.
    assert seen == [128 if per_block else 1] * 4, seen
    want = eqx.filter_jit(step)(off, x, w)
    for a, b, terms in zip(got, want, (256, 192, 205), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * terms * 2.0**-24 * np.abs(b).max())


def test_the_persistent_kernels_take_fp8_in_128_chunks_and_never_the_interpreter(monkeypatch):
    """The documented choice (`kernels/choice.py`): on a GPU the persistent kernels, except
    where the chunks are not 128 wide, or a grouped GEMM's operands are not FP8 (the
    bfloat16 pair of JAX 0.10's mixed E5M2 x E4M3): the tiled kernels there. Traced for the
    interpreter the GEMMs are not on a GPU, even on a GPU machine."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choice.on_gpu() and choice.persistent_config("dense") is not None
    with dispatch.interpreted():
        assert not choice.on_gpu() and choice.persistent_config("dense") is None
    taken = []
    for name in ("persistent_block_scaled_gemm", "block_scaled_gemm"):
        monkeypatch.setattr(choice, name, lambda *a, _n=name, **k: taken.append(_n))
    for name in ("persistent_grouped_rows_gemm", "grouped_rows_gemm"):
        monkeypatch.setattr(choice, name, lambda *a, _n=name, **k: taken.append(_n))
    for name in ("persistent_grouped_tokens_gemm", "grouped_tokens_gemm"):
        monkeypatch.setattr(choice, name, lambda *a, _n=name, **k: taken.append(_n))
    a8, s = jnp.zeros((256, 256), E4M3), jnp.ones((256, 2), jnp.float32)
    s64 = jnp.ones((256, 4), jnp.float32)
    choice.recipe_block_gemm(a8, s, [(a8, s)])
    choice.recipe_block_gemm(a8, s64, [(a8, s64)], block_k=64)
    assert taken == ["persistent_block_scaled_gemm", "block_scaled_gemm"]
    items = row_items(jnp.array([100, 156], jnp.int32), 256)
    w8, ws = jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 128, 2), jnp.float32)
    taken.clear()
    for lhs, w, block_k in [(a8, w8, 128), (a8.astype(jnp.bfloat16), w8, 128), (a8, w8, 64)]:
        choice.recipe_grouped_rows_gemm(lhs, w, items, lhs_scale=s, rhs_scale=ws, block_k=block_k)
    assert taken == ["persistent_grouped_rows_gemm"] + ["grouped_rows_gemm"] * 2
    taken.clear()
    starts, counts = jnp.array([0, 1], jnp.int32), jnp.array([1, 1], jnp.int32)
    for lhs, block_k in [(a8, 128), (a8.astype(jnp.bfloat16), 128), (a8, 64)]:
        choice.recipe_grouped_tokens_gemm(
            lhs, lhs, starts, counts, lhs_scale=s, rhs_scale=s, block_k=block_k
        )
    assert taken == ["persistent_grouped_tokens_gemm"] + ["grouped_tokens_gemm"] * 2


def test_grouped_gemms_fit_a_users_configuration_to_their_rows_and_scales(monkeypatch):
    """Inside `persistent_kernel(config)` the grouped rows GEMM takes 64-row CTA tiles
    (`TILE_M`: one item's rows) split along N, with no cluster along M, and three warpgroups
    only where a scale covers a warpgroup's tile (one per item, or blocks of 64 weight rows
    here) and three tiles along N fit a TMA box's 256; the tokens GEMM three only with one
    scale per expert. Each expected configuration written out by hand."""
    monkeypatch.setattr(choice, "on_gpu", lambda: True)
    seen = []
    for name in ("persistent_grouped_rows_gemm", "persistent_grouped_tokens_gemm"):
        monkeypatch.setattr(choice, name, lambda *a, config, **k: seen.append(config))
    a8, s = jnp.zeros((256, 256), E4M3), jnp.ones((256, 2), jnp.float32)
    items = row_items(jnp.array([100, 156], jnp.int32), 256)
    w8, ws = jnp.zeros((2, 128, 256), E4M3), jnp.ones((2, 128, 2), jnp.float32)
    wide = PersistentConfig(tile_m=128, tile_n=64, wg_dimension="n", compute_wgs=3)
    with persistent_kernel(wide):
        choice.recipe_grouped_rows_gemm(a8, w8, items, item_scale=jnp.ones(items.tile.shape))
        choice.recipe_grouped_rows_gemm(a8, w8, items, lhs_scale=s, rhs_scale=ws)
        blocks = jnp.ones((2, 2, 2), jnp.float32)  # 64-row blocks of each expert's weight
        choice.recipe_grouped_rows_gemm(
            a8, w8, items, lhs_scale=s, rhs_scale=blocks, rhs_block_rows=64
        )
    rows = dict(tile_m=64, tile_n=64, wg_dimension="n")
    assert seen == [
        PersistentConfig(**rows, compute_wgs=3),
        PersistentConfig(**rows, compute_wgs=2),
        PersistentConfig(**rows, compute_wgs=3),
    ]
    seen.clear()
    # Three warpgroups along M (64 rows each) with a cluster along M: the rows GEMM's tile
    # is split along N instead, where three 128-column tiles exceed 256, and unclustered.
    with persistent_kernel(PersistentConfig(compute_wgs=3, cluster="m")):
        choice.recipe_grouped_rows_gemm(a8, w8, items, item_scale=jnp.ones(items.tile.shape))
    assert seen == [PersistentConfig(wg_dimension="n", compute_wgs=2)]
    seen.clear()
    starts, counts = jnp.array([0, 1], jnp.int32), jnp.array([1, 1], jnp.int32)
    with persistent_kernel(wide):
        choice.recipe_grouped_tokens_gemm(a8, a8, starts, counts, group_scale=jnp.ones(2))
        choice.recipe_grouped_tokens_gemm(a8, a8, starts, counts, lhs_scale=s, rhs_scale=s)
    assert seen == [wide, dataclasses.replace(wide, compute_wgs=2)]


def test_pipeline_stages_fit_shared_memory_as_counted_by_hand():
    """Stages: the configured ones, no more than the steps (chunks over `chunks_per_step`),
    nor than fit in 232,448 - 1,024 bytes beside the output tiles; a stage holds each CTA
    operand tile's 128-chunk in FP8 (`(cta_m + terms * cta_n) * 128` bytes) and, with scales
    per row, a float32 scale per row (`4 * rows`); times `chunks_per_step`."""
    room = 232_448 - 1_024
    f32, bf16 = jnp.float32, jnp.bfloat16
    rows_n = PersistentConfig(wg_dimension="n")  # a 64 x 256 CTA tile: 320 rows a stage
    # (320 * 128 + 4 * 320) = 42,240 a stage beside 2 * 64 * 128 * 4 = 65,536: 3 fit.
    assert room - 65_536 - 3 * 42_240 >= 0 > room - 65_536 - 4 * 42_240
    assert pipeline_stages(rows_n, 16, 1, False, f32) == 3
    assert pipeline_stages(rows_n, 16, 1, True, f32) == 4  # 40,960 a stage: 4 fit
    assert pipeline_stages(rows_n, 16, 1, False, bf16) == 4  # 32,768 of output
    assert pipeline_stages(rows_n, 2, 1, False, bf16) == 2  # two chunks, two stages
    # Two chunks a step (128 x 128 tile, 256 rows): 2 * 33,792 a stage beside 32,768: 2
    # fit; 3 chunks make one step.
    pair = PersistentConfig(chunks_per_step=2)
    assert pipeline_stages(pair, 16, 1, False, bf16) == 2
    assert pipeline_stages(pair, 3, 1, False, bf16) == 1
    # Two rhs terms (the fused residual): 384 rows, 50,688 a stage beside 65,536: 3 fit.
    assert pipeline_stages(PersistentConfig(), 16, 2, False, f32) == 3
    # Three warpgroups (192 x 128, tile scales): 40,960 a stage beside 98,304: 3 fit.
    assert pipeline_stages(PersistentConfig(compute_wgs=3), 16, 1, True, f32) == 3
    # 128 x 128 warpgroup tiles (256 x 128): 50,688 a stage beside 131,072 leaves 100,352,
    # one stage (two would fit but for the 1,024 reserved).
    assert pipeline_stages(PersistentConfig(tile_m=128), 16, 1, False, f32) == 1
    # 256 x 192: 2 * 128 * 192 * 4 = 196,608 of output leaves 34,816, under one stage's
    # 448 * 132 = 59,136: none fits.
    with pytest.raises(ValueError, match="does not fit in shared memory"):
        pipeline_stages(PersistentConfig(tile_m=128, tile_n=192), 16, 1, False, f32)


def test_persistent_grid_takes_a_program_per_sm_or_sm_pair_up_to_the_tiles():
    config = PersistentConfig(num_sms=132)
    assert [grid_programs(config, c) for c in (1000, 132, 10, 0)] == [132, 132, 10, 1]
    assert grid_programs(PersistentConfig(num_sms=132, cluster="m"), 1000) == 66
    assert grid_programs(PersistentConfig(), 1000) == 132  # no GPU here: an H100's SMs


def test_chain_state_starts_the_first_tile_and_stops_the_last():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    stage = plgpu.PipelinePipeline
    start, steady, stop = int(stage.START), int(stage.STEADY), int(stage.STOP)
    got = chain_state(jnp.arange(4), jnp.int32(4))
    assert np.asarray(got).tolist() == [start, steady, steady, stop]
    assert int(chain_state(jnp.int32(0), jnp.int32(1))) == start

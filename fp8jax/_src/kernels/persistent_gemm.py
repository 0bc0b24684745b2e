"""The block-scaled FP8 GEMM for Hopper (sm_90a) on the structure that reaches the hardware:
persistent and warp-specialized, in Pallas Mosaic GPU.

`persistent_block_scaled_gemm(lhs, lhs_scale, [(rhs, rhs_scale), ...])` computes what
[`block_scaled_gemm`][fp8jax._src.kernels.block_gemm.block_scaled_gemm] computes (the same
arguments, padding and result):

    out[m, n] = sum_t sum_c (lhs[m, c] . rhs_t[n, c]) * lhs_scale[m, c] * rhs_scale_t[n, c]

with `c` running over 128-element chunks of the contraction, each chunk's `wgmma` product
promoted into a float32 sum with its two scales (DeepSeek-V3's scheme). What differs is how
the GPU gets there, the structure of JAX's Pallas Hopper matmul
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`) and of DeepGEMM:

- **Persistent**: one program per SM (`PersistentConfig.num_sms`) walks the output tiles in a
  planar snake (`grid_minor_dim`, `grid_tile_width`), so that no tile waits for a program
  launch; each tile fills its pipeline anew, or with `chained` a program's tiles run as one
  pipeline (the next tile's first chunks load while the last tile is promoted and stored;
  the grouped tokens GEMM's experts' tiles at one position, streamed).
- **Warp-specialized**: a memory warpgroup streams the FP8 tiles and scale vectors by TMA
  through `max_concurrent_steps` shared-memory stages; two (or `compute_wgs` 3) compute
  warpgroups each own a `tile_m x tile_n` part of the CTA's tile (`wg_dimension`). While
  one scales and adds a chunk's product (one scale, not a vector, where a 128 x 128 block's
  covers its tile), the others' `wgmma` run.
- **K-major operands**: both operands arrive contracted over their last axis, as FP8 `wgmma`
  requires; the rhs tile is transposed in shared memory (a view, no data movement).
- **Epilogue by TMA**: each compute warpgroup writes its tile through shared memory.

The same kernel runs an expert layer's grouped GEMMs (`persistent_grouped`), with block
scales or, for per-tensor recipes, one scale per item (or expert): the rows GEMM (forward,
dgrad: an item's row tile times its expert's weight, writing the expert's rows;
`grouped_gemm.RowItems`) and the tokens GEMM (wgrad: over (expert, tile) triples, each
over its expert's chunks of tokens, a run-time trip count; no tokens: zeros).

`PersistentConfig` holds the tuning knobs, swept by `benchmarks/gpu_check` (`kernels`). The
recipes' default on a GPU since the check's run 4 (float64 errors as the tiled kernel's,
1.47-1.52x faster than it at the LLM shapes), in `choice.DEFAULT_CONFIGS`; functions traced
in `choice.tiled_kernel()` take the tiled kernels instead.

On a CPU the kernel runs in Mosaic GPU's interpreter (`interpret=True`), exactly the code a
GPU runs, `wgmma` on the transposed view included, from JAX 0.11 on
(`mosaic_private.interpreter_runs_gpu_path`). JAX 0.10's cannot (and stalls now and then on
the pipeline): there the kernel refuses to be interpreted rather than check a substitute.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from ..core import mosaic_private
from . import BLOCK_GEMM_NAME, GROUPED_ROWS_NAME, GROUPED_TOKENS_NAME
from .block_gemm import (
    BLOCK_K,
    check_operands,
    chunk_product,
    copy_rows,
    operand_tiling,
    out_tiling,
    pad_to,
    per_row,
    promoted_pair,
    promoted_under_wgmma,
    round_up,
    scaled_add,
)
from .dispatch import interpreting
from .persistent_config import (
    PersistentConfig,
    chain_state,
    chained_stages,
    grid_programs,
    pipeline_stages,
    running_first,
    token_steps,
)

#: The kernels' names: in their PTX and the HLO's op_name, where `fp8jax.hlo_cost` counts
#: each as the GEMM it is (block-scaled, grouped rows, grouped tokens).
PERSISTENT_GEMM_NAME = f"{BLOCK_GEMM_NAME}_persistent"
PERSISTENT_ROWS_NAME = f"{GROUPED_ROWS_NAME}_persistent"
PERSISTENT_TOKENS_NAME = f"{GROUPED_TOKENS_NAME}_persistent"


def persistent_block_scaled_gemm(
    lhs: Array,
    lhs_scale: Array,
    terms: Sequence[tuple[Array, Array]],
    *,
    out_dtype=jnp.float32,
    config: PersistentConfig | None = None,
    block_rows: tuple[int, int] = (1, 1),
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """`sum_t (lhs . rhs_t)` with per-row, per-128-chunk scales, by the persistent
    warp-specialized kernel (see the module docstring).

    `lhs (M, K)` and each `rhs (N, K)` are FP8 of one type; `lhs_scale (M, ceil(K / 128))`
    and each `rhs_scale (N, ceil(K / 128))` float32 multipliers (a `QTensor`'s `scale_inv`),
    or with `block_rows=(r_lhs, r_rhs)` one per `r` rows (`(ceil(M / r_lhs), chunks)`: a
    128 x 128 block's): where a warpgroup's tile lies in one block, its promotion reads one
    scale, not a vector. Returns `(M, N)` in `out_dtype`. `interpret`: run in Mosaic GPU's
    interpreter; `None` follows [`interpreted`][fp8jax._src.kernels.dispatch.interpreted].
    """
    config = PersistentConfig() if config is None else config
    who = "persistent_block_scaled_gemm"
    interpret = interpretable(who, interpreting() if interpret is None else interpret)
    check_operands(who, lhs, lhs_scale, terms, BLOCK_K, block_rows)
    lhs_scale, terms = per_row(lhs, lhs_scale, terms, block_rows)
    (m, k), n = lhs.shape, terms[0][0].shape[0]
    cluster_m, cluster_n = config.cluster_tile
    kp = round_up(k, BLOCK_K * config.chunks_per_step)  # zeros: a whole last step
    mp, np_, chunks = round_up(m, cluster_m), round_up(n, cluster_n), kp // BLOCK_K
    # Scales chunk-major: a pipeline step's scales are one contiguous row of the CTA's rows.
    # Three warpgroups: rows padded to 64 (TMA loads zeros past them; rowless tiles unstored).
    ma = round_up(m, config.tile_m) if config.compute_wgs == 3 else mp
    operands = [pad_to(lhs, ma, kp), pad_to(lhs_scale.astype(jnp.float32), ma, chunks).T]
    for rhs, scale in terms:
        operands += [pad_to(rhs, np_, kp), pad_to(scale.astype(jnp.float32), np_, chunks).T]
    clusters = (mp // cluster_m) * (np_ // cluster_n)
    out = run_persistent(
        operands,
        len(terms),
        out_shape=(mp, np_),
        out_dtype=jnp.dtype(out_dtype),
        config=config,
        programs=grid_programs(config, clusters),
        interpret=interpret,
        uniform=(block_rows[0] % config.tile_m == 0, block_rows[1] % config.tile_n == 0),
        out_rows=None if ma == mp else ma,  # two warpgroups: padded, as GPUs ran them
    )
    return out[:m, :n]


def interpretable(who: str, interpret: bool) -> bool:
    """`interpret`, or `NotImplementedError` naming `who` where this JAX's interpreter cannot
    run the persistent kernels (see the module docstring)."""
    if interpret and not mosaic_private.interpreter_runs_gpu_path():
        raise NotImplementedError(
            f"{who}: jax {jax.__version__}'s Mosaic GPU interpreter cannot run wgmma on a "
            "transposed shared-memory view (JAX 0.11 and later can); run the kernel on a "
            "Hopper GPU, or interpret it under a newer JAX."
        )
    return interpret


def run_persistent(
    operands,
    n_terms,
    *,
    out_shape,
    out_dtype,
    config,
    programs,
    interpret,
    layout="dense",
    tile_scaled=False,
    promote=False,
    uniform=(False, False),
    out_rows=None,
):
    """The kernel over `operands`, by `layout`:

    - `"dense"`: `a, sa, (b, sb) * n_terms`, output `(M, N)`;
    - `"rows"`: `items, a, sa, b, sb` where `b (G, N, K)` and `sb (G, chunks, N)` hold every
      expert's operand and `items (4, W)` the rows kernels' work (`grouped_gemm.RowItems`,
      stacked): item `w`'s CTA row tile is `lhs` tile `items[0, w]`, multiplied by expert
      `items[1, w]`'s operand (-1: zeros), and it writes rows `items[2, w]` to `items[3, w]`
      of it (through an untransformed shared-memory tile, `block_gemm.copy_rows`); chained,
      the items of an expert first (`running_first`): only they chain their pipelines;
    - `"tokens"`: `chunk_start, chunk_count, a, sa, b, sb` with `a (A, T)`, `b (B, T)`: output
      `(G, A, B)`, expert `e`'s tiles contracted over its `chunk_count[e]` chunks from
      `chunk_start[e]` (a run-time trip count; an expert without chunks gets zeros);
      chained, streamed: one pipeline per tile position over every expert's chunks
      (`token_steps`).

    With `tile_scaled` the block scales `sa`, `sb` give way to one scale per item (`"rows"`:
    `item_scale`, after `items`) or per expert (`"tokens"`: `group_scale`, after the
    counts): the whole contraction in one `wgmma` accumulator multiplied by it at the end
    (per-tensor recipes), or with `promote` each chunk's product added to a float32 sum in
    registers first (FP8 `wgmma` accumulates with less than float32's precision).
    `uniform`: whether `sa` (`sb`) holds one value over each warpgroup's rows (columns).
    `out_rows` (`"dense"`): the output's rows, a multiple of `tile_m` that the padded
    `out_shape` may exceed: a warpgroup's tile past them is not written."""
    tm, tn = config.tile_m, config.tile_n
    cta_m, cta_n = config.cta_tile
    per_step = config.chunks_per_step
    if per_step != 1 and (layout == "tokens" or tile_scaled):
        raise ValueError(
            f"persistent kernel: {config} takes chunks_per_step={per_step}, which only the "
            "block-scaled dense and grouped rows GEMMs have (each expert's chunks of tokens "
            "in the tokens GEMM are counted at run time); use 1 here."
        )
    lead = {"dense": 0, "rows": 1, "tokens": 2}[layout]
    ragged = layout == "rows"
    a_index = lead + (1 if tile_scaled else 0)
    chunks = -(-operands[a_index].shape[1] // BLOCK_K)
    steps = pipeline_stages(config, chunks, n_terms, tile_scaled, out_dtype)
    chained = 0 if layout == "tokens" else chained_stages(config, steps, chunks // per_step)
    steps = chained or steps
    if chained and layout == "rows":
        operands = [running_first(operands[0]), *operands[1:]]
    streamed = config.chained and layout == "tokens"
    if streamed:
        operands = [*token_steps(operands[0], operands[1], chunks), *operands[2:]]
    cluster_m, cluster_n = config.cluster_tile
    mp, np_ = out_shape[-2:]
    # Rows: one step per item (its tile read from the table); else per cluster row tile.
    m_iters = operands[0].shape[1] if layout == "rows" else mp // cluster_m
    n_iters = np_ // cluster_n
    groups = out_shape[0] if layout == "tokens" else 1
    # The operand tile the two CTAs of a cluster share, loaded once and multicast.
    share_a = ("cluster",) if config.cluster == "n" else ()
    share_b = ("cluster",) if config.cluster == "m" else ()
    fp8_tiling = operand_tiling(operands[a_index].dtype, BLOCK_K)
    minor = 1 if config.grid_minor_dim == "n" else 0

    def walk(index, shape):  # the tile of the loop's `index`, in `shape` tiles
        if isinstance(shape[0], int) and shape[0] == 1 or shape[1] == 1:  # in order
            # (planar_snake's integer maths divides by zero there, which crashes XLA's CPU
            # compile of the interpreted kernel in JAX 0.10)
            return (index, 0) if shape[1] == 1 else (0, index)
        return plgpu.planar_snake(index, shape, minor, config.grid_tile_width)

    def pipeline(step, context, grid=(chunks // per_step,), first=0, state=None, table=None):
        # Chunks `first, first + 1, ...` of the contraction, `grid` of them (a run-time count
        # for the tokens layout: then the pipeline's trip count is dynamic), or step `c`'s
        # chunk `table[0, c]` (`token_steps`).
        at = (lambda c: first + c) if table is None else (lambda c: table[0, c])  # noqa: E731

        def tile_spec(rows, share):
            return plgpu.BlockSpec(
                (rows, BLOCK_K * per_step),
                lambda c: (0, at(c)),
                transforms=fp8_tiling,
                collective_axes=share,
            )

        def scale_spec(rows, share):
            spec = (per_step, rows)
            return plgpu.BlockSpec(spec, lambda c: (at(c), 0), collective_axes=share)

        if tile_scaled:
            specs = [tile_spec(cta_m, share_a), tile_spec(cta_n, share_b)]
        else:
            specs = [tile_spec(cta_m, share_a), scale_spec(cta_m, share_a)]
            for _ in range(n_terms):
                specs += [tile_spec(cta_n, share_b), scale_spec(cta_n, share_b)]
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=grid,
            memory_registers=40,
            in_specs=specs,
            wg_axis="wg",
            num_compute_wgs=config.compute_wgs,
            max_concurrent_steps=steps,
            compute_context=context,
            pipeline_state=state,
        )

    def body(*refs):
        counts, refs = refs[:lead], refs[lead:]
        scales, refs = (refs[0], refs[1:]) if tile_scaled else (None, refs)
        if tile_scaled:
            a_gmem, b, out_gmem = refs
            a_refs, b_gmem = [a_gmem], [b]
        else:
            a_gmem, sa_gmem, *rest = refs
            a_refs, b_gmem, out_gmem = [a_gmem, sa_gmem], rest[: 2 * n_terms], rest[2 * n_terms]
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on it
        one_b = [b.at[0] for b in b_gmem] if layout == "rows" else b_gmem

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(*a_refs, *one_b),
            # Rows: copies of some rows, from any row (untransformed).
            out_smem=plgpu.SMEM(
                (config.compute_wgs, tm, tn),
                out_dtype,
                transforms=() if ragged else out_tiling(out_dtype, tn),
            ),
            collective_axes="wg",
        )
        def scope(allocations, out_smem):
            wg = lax.axis_index("wg")

            loop = (1 if streamed else groups) * m_iters * n_iters  # streamed: positions

            @plgpu.nd_loop((loop,), collective_axes="sm")
            def tile(info):
                (index,) = info.index
                group, index = index // (m_iters * n_iters), index % (m_iters * n_iters)
                running = info.num_local_steps  # this program's tiles that run a pipeline
                if chained and ragged:  # those of the items that do first, then the rest
                    items, program = counts[0][4, 0], lax.axis_index("sm")
                    first, rest = items * n_iters, jnp.maximum(index - items * n_iters, 0)
                    shape = (jnp.maximum(items, 1), n_iters)
                    mi, ni = walk(jnp.minimum(index, shape[0] * n_iters - 1), shape)
                    mi = jnp.where(index < first, mi, items + rest // n_iters)
                    ni = jnp.where(index < first, ni, rest % n_iters)
                    running = (first - program + lax.axis_size("sm") - 1) // lax.axis_size("sm")
                else:
                    mi, ni = walk(index, (m_iters, n_iters))
                cta = lax.axis_index("cluster")
                if config.cluster == "m":
                    mi = mi * 2 + cta
                elif config.cluster == "n":
                    ni = ni * 2 + cta
                row_tile = mi
                if ragged:  # scalars read from global memory: the item's tile, expert, rows
                    row_tile, expert = counts[0][0, mi], counts[0][1, mi]
                    start, stop = counts[0][2, mi], counts[0][3, mi]
                cta_rows, cta_cols = pl.ds(row_tile * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
                if config.wg_dimension == "m":
                    rows, cols = pl.ds(wg * tm, tm), pl.ds(0, tn)
                else:
                    rows, cols = pl.ds(0, tm), pl.ds(wg * tn, tn)
                # Block scales: a vector per tile, or one scale where it covers the tile.
                sa_at = rows.start if uniform[0] else rows
                sb_at = cols.start if uniform[1] else cols

                def store(acc, at=group):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copy
                    out_smem[wg] = acc.astype(out_dtype)
                    plgpu.commit_smem()
                    if ragged:  # the item's rows only (the warpgroups split N: tm == cta_m)
                        out_cols = pl.ds(ni * cta_n + wg * tn, tn)
                        copy_rows(out_smem.at[wg], out_gmem, row_tile * tm, start, stop, out_cols)
                    else:
                        out_tile = out_gmem.at[at] if layout == "tokens" else out_gmem
                        out_tile = out_tile.at[cta_rows, cta_cols].at[rows, cols]
                        copy = lambda: plgpu.copy_smem_to_gmem(out_smem.at[wg], out_tile)  # noqa: E731
                        if out_rows is None or out_rows >= mp:
                            copy()
                        else:  # a warpgroup's tile of no output rows is not written
                            pl.when(row_tile * cta_m + rows.start < out_rows)(copy)

                tile_scale = lambda: scales[group if layout == "tokens" else mi]  # noqa: E731

                def promoted(run):  # block scales: a fresh product per chunk, promoted
                    store(run(jnp.zeros((tm, tn), jnp.float32)))

                def summed(run):  # one scale per tile, each chunk's product promoted
                    store(run(jnp.zeros((tm, tn), jnp.float32)) * tile_scale())

                def accumulated(run):  # one scale per tile: one accumulator throughout
                    def scoped(acc_ref):
                        run(acc_ref)
                        store(acc_ref[...] * tile_scale())  # waits for the last wgmma

                    pl.run_scoped(scoped, plgpu.ACC((tm, tn), jnp.float32))

                def promote_step(_, a_smem, sa_smem, *rest):
                    *b_smem, acc = rest
                    if config.scales_under_wgmma:
                        for t in range(n_terms):
                            tile_b, sb_smem = b_smem[2 * t].at[cols], b_smem[2 * t + 1]
                            args = (a_smem.at[rows], tile_b, sa_smem, sb_smem, sa_at, sb_at)
                            acc = promoted_under_wgmma(acc, *args, (tm, tn))
                        return acc
                    sa = sa_smem[0, sa_at]
                    for t in range(n_terms):
                        tile_b, sb = b_smem[2 * t].at[cols], b_smem[2 * t + 1][0, sb_at]
                        # The GPU's own path (wgmma on the transposed view) in the interpreter too.
                        part = chunk_product(a_smem.at[rows], tile_b, (tm, tn), interpret=False)
                        acc = scaled_add(acc, part, sa, sb)
                    return acc

                def promote_pair_step(_, a_smem, sa_smem, *rest):
                    *b_smem, acc = rest
                    for t in range(n_terms):
                        tile_b, sb = b_smem[2 * t].at[cols], b_smem[2 * t + 1]
                        args = (a_smem.at[rows], tile_b, sa_smem, sb, sa_at, sb_at, (tm, tn))
                        acc = promoted_pair(acc, *args)
                    return acc

                def sum_step(_, a_smem, b_smem, acc):
                    part = chunk_product(a_smem.at[rows], b_smem.at[cols], (tm, tn), False)
                    return acc + part

                def accumulate_step(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.at[cols].transpose((1, 0)))
                    plgpu.wgmma_wait(0)  # before the stage's shared memory is released
                    return acc_ref

                def stream(step, finish):  # each expert's sum fresh at its first chunk of
                    # the stream, `finish`ed and stored at its last (`token_steps`' flags)
                    def streamed_step(indices, *refs):
                        *smem, acc = refs
                        expert, flags = counts[0][1, indices[0]], counts[0][2, indices[0]]
                        acc = lax.cond(flags & 1, jnp.zeros_like, lambda a: a, acc)
                        acc = step(indices, *smem, acc)

                        @pl.when(flags & 2 != 0)
                        def _():
                            store(finish(acc, expert), expert)

                        return acc

                    return streamed_step

                def run_tile(b_refs, **chunked):
                    if chained and not streamed:
                        chunked["state"] = chain_state(info.local_index, running)
                    args = [a_gmem.at[cta_rows]]
                    finish = lambda acc, e: acc  # noqa: E731 - streamed: an expert's tile
                    if tile_scaled:
                        args += [b_refs[0].at[cta_cols]]
                        # Streamed, each chunk's product is added to a float32 sum: the
                        # accumulator is not zeroed mid-pipeline (which Mosaic GPU's
                        # interpreter cannot run).
                        if promote or streamed:
                            step, context = sum_step, summed
                            finish = lambda acc, e: acc * scales[e]  # noqa: E731
                        else:
                            step, context = accumulate_step, accumulated
                    else:
                        args += [sa_gmem.at[:, cta_rows]]
                        for t in range(n_terms):
                            args += [b_refs[2 * t].at[cta_cols], b_refs[2 * t + 1].at[:, cta_cols]]
                        step = promote_pair_step if per_step == 2 else promote_step
                        context = promoted
                    if streamed:  # each expert's tile stored inside the pipeline
                        step = stream(step, finish)
                        context = lambda run: run(jnp.zeros((tm, tn), jnp.float32))  # noqa: E731
                    pipeline(step, context, **chunked)(*args, allocations=allocations)

                if layout == "dense":
                    run_tile(b_gmem)
                elif layout == "rows":

                    @pl.when(expert >= 0)
                    def _():
                        run_tile([b.at[expert] for b in b_gmem])

                    @pl.when(
                        (expert < 0) & (stop > start) & (wg < config.compute_wgs)
                    )  # rows of no expert
                    def _():
                        store(jnp.zeros((tm, tn), jnp.float32))

                elif streamed:  # every expert's chunks in one pipeline, then zeros
                    total = counts[1][groups]

                    @pl.when(total > 0)
                    def _():
                        run_tile(b_gmem, grid=(total,), table=counts[0])

                    @pl.loop(0, groups)
                    def _(e):
                        @pl.when((counts[1][e] == 0) & (wg < config.compute_wgs))
                        def _():
                            store(jnp.zeros((tm, tn), jnp.float32), e)

                else:
                    first, count = counts[0][group], counts[1][group]

                    @pl.when(count > 0)
                    def _():
                        run_tile(b_gmem, grid=(count,), first=first)

                    @pl.when(
                        (count == 0) & (wg < config.compute_wgs)
                    )  # the compute warpgroups write zeros
                    def _():
                        store(jnp.zeros((tm, tn), jnp.float32))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    name = {"dense": PERSISTENT_GEMM_NAME, "rows": PERSISTENT_ROWS_NAME}
    body.__name__ = body.__qualname__ = name.get(layout, PERSISTENT_TOKENS_NAME)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(
            out_shape if out_rows is None else (min(out_rows, mp), np_), out_dtype
        ),
        grid=(programs,),
        grid_names=("sm",),
        cluster=(1 if config.cluster is None else 2,),
        cluster_names=("cluster",),
        num_threads=config.compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_private.interpret_params(ragged) if interpret else None,
    )(*operands)

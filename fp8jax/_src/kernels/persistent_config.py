"""The persistent kernels' tuning (`PersistentConfig`) and what follows from it on an H100:
the programs of the persistent grid and the stages of the TMA pipeline, beside the kernels
of `persistent_gemm` and `persistent_grouped` that take it; and the tables the grouped
kernels' programs walk (`running_first`, `token_steps`, `chain_state`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Int

from .block_gemm import BLOCK_K

#: Streaming multiprocessors of an H100 SXM: the programs of the persistent grid where the
#: device cannot be asked (a deviceless compile).
H100_SMS = 132

#: Shared memory one CTA may use on an H100 (227 KiB), and what the pipeline's barriers and
#: the tiles' alignment take beside the operand stages and output tiles.
H100_SMEM_BYTES = 232_448
SMEM_RESERVE = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentConfig:
    """Tuning of the persistent kernel (`persistent_block_scaled_gemm` and the grouped GEMMs of
    `persistent_grouped`).

    **Arguments:**

    - `tile_m`, `tile_n`: the output tile of one compute warpgroup (default 64 x 128: two
      float32 accumulators of it fit in a warpgroup's registers without spills).
    - `wg_dimension`: `"m"` (default) or `"n"`: the axis along which the two compute
      warpgroups split the CTA's tile (`2 tile_m x tile_n` or `tile_m x 2 tile_n`); the other
      operand's tile is shared by both.
    - `max_concurrent_steps`: shared-memory stages of the TMA pipeline (default 4; fewer
      where the GEMM has fewer chunks, or where they would not fit in shared memory beside
      the output tiles: 3 for the grouped rows kernel's 64 x 256 CTA tile writing float32).
    - `grid_minor_dim` (`"n"` or `"m"`), `grid_tile_width`: the order in which the
      persistent programs walk the output tiles (`plgpu.planar_snake`): consecutive tiles
      along the minor axis, in bands `grid_tile_width` tiles wide, so that tiles running
      together share operand tiles in L2.
    - `cluster`: `None` (default), `"m"` or `"n"`: pairs of CTAs (a cluster of two) side by
      side along that axis, the operand tile they share loaded once by TMA and multicast to
      both (`"m"`: the rhs tile, `"n"`: the lhs tile).
    - `num_sms`: programs of the persistent grid; `None`: the GPU's SM count (132 for a
      deviceless H100 compile).
    - `chunks_per_step`: 128-chunks per pipeline step, 1 (default) or 2 (block scales; dense
      and grouped rows GEMMs): both chunks' `wgmma` issued, the first promoted while the
      second runs (`block_gemm.promoted_pair`), so that the tensor cores have work while the
      scales are applied. The same sums in the same order.
    - `chained`: a program's tiles run as one pipeline (`emit_pipeline_warp_specialized`'s
      `pipeline_state`): the memory warpgroup loads the next tile's first chunks while the
      compute warpgroups promote and store the last, where unchained each tile fills its
      pipeline anew and the tensor cores wait for its first loads. JAX chains pipelines of a
      static trip count whose stages divide it: the dense and grouped rows GEMMs, with the
      most stages up to `max_concurrent_steps` that divide a tile's steps (unchained where
      none from 2 does), the same sums in the same order. The tokens GEMM (each expert's
      trip count known at run time) streams instead: at each tile position one pipeline runs
      over every expert's chunks, each expert's sum started afresh at its first chunk and
      stored at its last (with one scale per expert, each chunk's product added to a float32
      sum, as with `promote`).
    - `compute_wgs`: compute warpgroups of a CTA, 2 (default) or 3, each owning a `tile_m x
      tile_n` part of its tile along `wg_dimension` (a 192 x 128 CTA tile with 3): the
      operand tile they share is loaded once for more of them (a sixth less traffic from L2
      per FLOP than 128 x 128), and while one promotes its chunk two others' `wgmma` can
      keep the tensor cores busy. Their registers: 152 a thread where 2 take 232 (JAX's
      split of 512 less the memory warpgroup's 40), which fits a weight's scales per 128 x
      128 block without spills, not scales per row (124 bytes spilled at 64 x 128): the
      recipes' GEMMs take three only there (`choice.warpgroups`). A CTA tile is at most
      256 along each axis (a TMA copy's box).
    - `scales_under_wgmma`: with block scales and one chunk a step, a chunk's scales are
      loaded and multiplied while its `wgmma` runs, which leaves one FMA per accumulator
      element between the wait and the next chunk's `wgmma`; by default (`False`) they are
      loaded before the issue and multiplied once the product is there (ptxas puts those
      products among the chunk's `wgmma` issues: session 49's SASS reading). The same sums.
    """

    tile_m: int = 64
    tile_n: int = 128
    wg_dimension: str = "m"
    max_concurrent_steps: int = 4
    grid_minor_dim: str = "n"
    grid_tile_width: int = 1
    cluster: str | None = None
    num_sms: int | None = None
    chunks_per_step: int = 1
    chained: bool = False
    scales_under_wgmma: bool = False
    compute_wgs: int = 2

    def __post_init__(self) -> None:
        for name in ("tile_m", "tile_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value not in (64, 128, 192, 256):
                raise ValueError(
                    f"PersistentConfig: {name}={value!r}; should be 64, 128, 192 or 256 "
                    "(wgmma's M is 64 per instruction, and N a multiple of 64 here)."
                )
        for name in ("wg_dimension", "grid_minor_dim"):
            if getattr(self, name) not in ("m", "n"):
                raise ValueError(
                    f"PersistentConfig: {name}={getattr(self, name)!r}; should be 'm' or 'n'."
                )
        if self.chunks_per_step not in (1, 2) or isinstance(self.chunks_per_step, bool):
            raise ValueError(
                f"PersistentConfig: chunks_per_step={self.chunks_per_step!r}; should be 1 or 2."
            )
        if self.compute_wgs not in (2, 3) or isinstance(self.compute_wgs, bool):
            raise ValueError(
                f"PersistentConfig: compute_wgs={self.compute_wgs!r}; should be 2 or 3."
            )
        if max(self.cta_tile) > 256:
            raise ValueError(
                f"PersistentConfig: a CTA tile of {self.cta_tile} (compute_wgs="
                f"{self.compute_wgs}, wg_dimension={self.wg_dimension!r}) exceeds the 256 rows "
                "a TMA copy takes; use smaller tiles or fewer warpgroups along that axis."
            )
        for name in ("chained", "scales_under_wgmma"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"PersistentConfig: {name}={getattr(self, name)!r}; should be a bool."
                )
        if self.scales_under_wgmma and self.chunks_per_step != 1:
            raise ValueError(
                "PersistentConfig: scales_under_wgmma=True takes chunks_per_step=1, not "
                f"{self.chunks_per_step} (two chunks a step promote the first while the "
                "second's wgmma runs already)."
            )
        if self.cluster not in (None, "m", "n"):
            raise ValueError(
                f"PersistentConfig: cluster={self.cluster!r}; should be None, 'm' or 'n'."
            )
        for name in ("max_concurrent_steps", "grid_tile_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PersistentConfig: {name}={value!r}; should be a positive int.")
        if self.num_sms is not None and (
            not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool) or self.num_sms < 1
        ):
            raise ValueError(
                f"PersistentConfig: num_sms={self.num_sms!r}; should be a positive int or None."
            )

    @property
    def cta_tile(self) -> tuple[int, int]:
        """The output tile of one CTA (both compute warpgroups)."""
        if self.wg_dimension == "m":
            return self.compute_wgs * self.tile_m, self.tile_n
        return self.tile_m, self.compute_wgs * self.tile_n

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """The output tile of one cluster (the unit the operands are padded to)."""
        m, n = self.cta_tile
        return m * (2 if self.cluster == "m" else 1), n * (2 if self.cluster == "n" else 1)


def sm_count() -> int:
    """The SMs of the default GPU, or `H100_SMS` where there is none (a deviceless compile,
    the interpreter)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H100_SMS
    return int(getattr(device, "core_count", 0) or H100_SMS)


def grid_programs(config: PersistentConfig, clusters: int) -> int:
    """Clusters of the persistent grid: one per SM (per pair of SMs with `cluster`), no more
    than there are output tiles (cluster tiles) to share."""
    per_cluster = 1 if config.cluster is None else 2
    return max(1, min((config.num_sms or sm_count()) // per_cluster, clusters))


def pipeline_stages(
    config: PersistentConfig, chunks: int, n_terms: int, tile_scaled: bool, out_dtype
) -> int:
    """The pipeline's stages: `config.max_concurrent_steps`, no more than there are chunks,
    nor than fit in an H100's shared memory beside the output tiles (4 stages of the grouped
    rows kernel's 64 x 256 CTA tile and a float32 output overflow it by 2 KB)."""
    rows = config.cta_tile[0] + n_terms * config.cta_tile[1]
    per_stage = rows * BLOCK_K + (0 if tile_scaled else 4 * rows)  # FP8 tiles, f32 scales
    per_stage *= config.chunks_per_step
    out = config.compute_wgs * config.tile_m * config.tile_n * jnp.dtype(out_dtype).itemsize
    fit = (H100_SMEM_BYTES - SMEM_RESERVE - out) // per_stage
    if fit < 1:
        raise ValueError(
            f"persistent kernel: {config} with a {jnp.dtype(out_dtype).name} output does not "
            f"fit in shared memory ({H100_SMEM_BYTES} bytes); use smaller tiles."
        )
    return min(config.max_concurrent_steps, chunks // config.chunks_per_step, fit)


def chained_stages(config: PersistentConfig, stages: int, steps: int) -> int:
    """The stages of a pipeline chained over tiles of `steps` steps each (`config.chained`):
    the most, up to `stages`, that divide `steps` (JAX chains no other), or 0 for an
    unchained pipeline (`config.chained` off, or no count from 2 to `stages` divides)."""
    if not config.chained:
        return 0
    return next((s for s in range(stages, 1, -1) if steps % s == 0), 0)


def running_first(items: Int[Array, "4 W"]) -> Int[Array, "5 W"]:
    """The rows kernel's items with those of an expert first (in their order) and a fifth row
    holding how many they are: a chained pipeline runs over their tiles alone."""
    items = items[:, jnp.argsort(items[1] < 0, stable=True)]
    running = jnp.sum(items[1] >= 0, dtype=jnp.int32)
    return jnp.concatenate([items, jnp.full((1, items.shape[1]), running, jnp.int32)])


def token_steps(
    start: Int[Array, " G"], count: Int[Array, " G"], chunks: int
) -> tuple[Int[Array, "3 L"], Int[Array, " G+1"]]:
    """The streamed tokens kernel's steps: every expert's chunks one after the other, as
    `(3, G * chunks)` rows (the step's chunk, its expert, flags: 1 its expert's first, 2 its
    last; past the last step unused), and the counts with their sum appended. A count is
    taken between 0 and `chunks` (all the tokens), so that the steps fit the table."""
    experts = count.shape[0]
    count = jnp.clip(count, 0, chunks)
    ends = jnp.cumsum(count)
    step = jnp.arange(experts * chunks, dtype=jnp.int32)
    # (`searchsorted`'s "compare_all" written out: JAX's fails in a partly manual shard_map.)
    expert = jnp.minimum((ends[None, :] <= step[:, None]).sum(1, dtype=jnp.int32), experts - 1)
    begin = (ends - count)[expert]
    flags = (step == begin).astype(jnp.int32) + 2 * (step == ends[expert] - 1).astype(jnp.int32)
    table = jnp.stack([start[expert] + step - begin, expert, flags]).astype(jnp.int32)
    return table, jnp.concatenate([count, ends[-1:]]).astype(jnp.int32)


def chain_state(local: Array, running: Array) -> Array:
    """The `pipeline_state` of a program's `local`-th tile of the `running` that chain their
    pipelines: `START` (prologue) for the first, `STOP` (waits out the last stages) for the
    last, `STEADY` between."""
    stage = plgpu.PipelinePipeline
    steady = jnp.where(local == running - 1, int(stage.STOP), int(stage.STEADY))
    return jnp.where(local == 0, int(stage.START), steady)

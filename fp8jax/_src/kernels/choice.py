"""Which block-scaled and grouped kernels the recipes call: the persistent warp-specialized
kernels (`persistent_gemm`: dense, grouped rows and grouped tokens), or the tiled ones
(`block_gemm`, `grouped_gemm`).

On a GPU the persistent kernels are the default, each in the configuration the GPU check's
sweep chose (H200, run 4: the dense kernel 1.07-1.15x faster than in `PersistentConfig()`
and 1.47-1.52x faster than the tiled one at 8192 x 4096 -> 14336 and 7168 -> 18432, with
the same results on the GPU: no element of the Llama shapes' products differed). Functions
traced inside `tiled_kernel()` take the tiled kernels instead (to time them, or where a
persistent grid does not suit), and inside `persistent_kernel(config)` one configuration of
the user's for all three. Elsewhere, kernels traced for the interpreter
(`dispatch.interpreted()`, the tests: JAX 0.10's interpreter cannot run the persistent
kernels) or for a deviceless compile on a machine without a GPU (the inspector, the tests'
H100 compiles: the persistent kernels take about twice as long to compile) are the tiled
ones unless a context chooses; both kernels leave the rest of a step alike (kernels, bytes,
memory: `benchmarks/llama_block.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core import mosaic_private
from ..core.contexts import Setting, setting
from .block_gemm import BLOCK_K, FP8_TYPES, TILE_M, block_scaled_gemm
from .block_quantize import (
    quantize_blocks,
    quantize_rows,
    quantize_rows_and_columns,
    requantize_columns,
)
from .dispatch import interpreting
from .grouped_gemm import RowItems, grouped_rows_gemm, grouped_tokens_gemm
from .padded_quantize import (
    quantize_padded_columns,
    quantize_rows_and_padded_columns,
    requantize_padded_columns,
)
from .persistent_config import PersistentConfig
from .persistent_gemm import persistent_block_scaled_gemm
from .persistent_grouped import persistent_grouped_rows_gemm, persistent_grouped_tokens_gemm
from .tensor_core_blocks import (
    tensor_core_quantize_blocks,
    tensor_core_quantize_rows,
    tensor_core_quantize_rows_and_columns,
    tensor_core_requantize_columns,
)
from .tensor_core_gathered import (
    padded_tiles,
    tensor_core_quantize_padded_columns,
    tensor_core_quantize_rows_and_padded_columns,
    tensor_core_requantize_padded_columns,
)
from .tensor_core_tiles import BLOCK as TENSOR_CORE_BLOCK

#: The persistent kernels' configurations when no context chooses one, by GEMM: the fastest
#: of the GPU check's sweep on an H200 (run 4, `benchmarks/results/gpu_check/h200_run4_*`).
#: Dense: 880 / 841 TFLOP/s at 8192 x 4096 -> 14336 / 7168 -> 18432 against 821 / 731 for
#: `PersistentConfig()`. Grouped rows: `PersistentConfig()` (the fastest at 2048 -> 7168; 2 %
#: behind `grid_minor_dim="m"` at 7168 -> 2048). Grouped tokens (wgrad): `wg_dimension="n"`,
#: 0.499 against 0.550 ms at (2048, 7168) over 8,192 rows. The grouped choices are within
#: run-to-run noise (run 5 timed these 0.3-0.6 ms GEMMs up to 18 % apart from run 4, and
#: ranked the configurations otherwise).
DEFAULT_CONFIGS = {
    "dense": PersistentConfig(grid_minor_dim="m", grid_tile_width=8),
    "rows": PersistentConfig(),
    "tokens": PersistentConfig(wg_dimension="n"),
}

#: The 16-bit types the tensor cores transpose exactly (an output gradient's).
SIXTEEN = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: The types the tensor-core kernels read (an activation's, a weight's); others (float64
#: under `jax_enable_x64`) take the Triton kernels, which read any float.
READS = (*SIXTEEN, jnp.dtype(jnp.float32))

#: A context's choice: a configuration, `_TILED`, `_PERSISTENT` (each GEMM in its default
#: configuration) or `_DEFAULT` (no context: see the module).
_TILED, _PERSISTENT, _DEFAULT = "tiled", "persistent", "default"
_CHOSEN: Setting[PersistentConfig | str] = Setting("fp8jax_block_kernel_choice", _DEFAULT)
_WEIGHT_BLOCKS: Setting[bool] = Setting("fp8jax_weight_scales_per_block", False)
_CHAINED: Setting[bool] = Setting("fp8jax_chained_pipelines", False)
_TENSOR_CORES: Setting[bool] = Setting("fp8jax_tensor_core_quantization", False)


def persistent_kernel(
    config: PersistentConfig | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Functions traced inside run the recipes' block-scaled GEMMs (blockwise, MXFP8 with 128
    chunks, the fused residual kernel) and the expert layers' FP8 grouped GEMMs on the
    persistent kernels, all in `config` (`None`: each in its default of `DEFAULT_CONFIGS`),
    interpreted ones included: to sweep a configuration in whole train steps, or to test the
    persistent kernels in the interpreter. A GEMM that cannot take two chunks a step (the
    tokens GEMM, per-tensor scales) takes one where `config.chunks_per_step` is 2."""
    if config is not None and not isinstance(config, PersistentConfig):
        raise TypeError(
            f"persistent_kernel: config={config!r}; expected a PersistentConfig or None."
        )
    return setting(_CHOSEN, _PERSISTENT if config is None else config)


def tiled_kernel() -> contextlib.AbstractContextManager[None]:
    """Functions traced inside run the recipes' block-scaled and grouped GEMMs on the tiled
    kernels (`block_gemm`, `grouped_gemm`: one program per output tile), the default before
    issue 39's persistent kernels: to time them against those (`benchmarks/llama_block.py`'s
    `blockwise-tiled`, the GPU check)."""
    return setting(_CHOSEN, _TILED)


def weight_block_scales() -> contextlib.AbstractContextManager[None]:
    """Functions traced inside give the block-scaled GEMMs (dense and grouped rows) a weight's
    128 x 128 block scales once per block: the persistent kernels then read one scale per
    warpgroup tile and chunk (`block_rows`: half the promotion's FP32 instructions), where
    by default each block's scale comes repeated per row of its tiles, as the one-pass
    quantization writes them (no fusion between it and the GEMM; inside, a small XLA fusion
    per weight GEMM repeats them for the kernel's pipeline). Issue 39: the default once a GPU
    run has checked and timed it (`benchmarks/llama_block.py`'s `blockwise-tile-scales`)."""
    return setting(_WEIGHT_BLOCKS, True)


def chained_pipelines() -> contextlib.AbstractContextManager[None]:
    """Functions traced inside run the persistent kernels with each program's tiles chained
    into one pipeline (`PersistentConfig.chained`) in whatever configuration they take
    otherwise (the defaults, or `persistent_kernel`'s): the next tile's first chunks load
    while the last tile is promoted and stored (the grouped tokens GEMM: every expert's
    chunks at a tile position in one pipeline). Issue 39: the default once a GPU run has
    timed it (`benchmarks/llama_block.py`'s `blockwise-chained`, the MoE layer's)."""
    return setting(_CHAINED, True)


def tensor_core_quantization() -> contextlib.AbstractContextManager[None]:
    """Functions traced inside quantize the blockwise recipe's tensors on TMA and the tensor
    cores (`tensor_core_blocks`, Mosaic GPU: its interpreter from JAX 0.11 on) where the
    block is 128: an activation's 1 x 128 tiles (on TMA alone), the output gradient's two
    copies (1 x 128 and 128 x 1 tiles, `BlockwiseScaling.quantize_both`; a BF16 or float16
    gradient), a weight's 128 x 128 blocks with their transpose (experts' weights in one
    kernel), a saved activation's 128 x 1 tiles for the wgrad, and an expert layer's
    output gradient's two copies (its rows and its gathered tiles, from one read) and saved
    activation's copy gathered into the padded layout (`tensor_core_gathered`, JAX 0.11
    on); elsewhere the Pallas Triton kernels (`block_quantize`, `padded_quantize`).
    The same values for finite operands (in value: a -0 in a transposed copy may come out
    +0). Issue 39: the default once a GPU run has timed it (`benchmarks/llama_block.py`'s
    `blockwise-tc`, the MoE layer's). Like every fp8jax setting, part of JAX's cache keys:
    a function traced outside is traced again inside (`core.contexts`)."""
    return setting(_TENSOR_CORES, True)


def recipe_rows_and_columns(
    x: Float[Array, "*B M K"], fmt: jnp.dtype, *, block: int, max_scale: float, power_of_two: bool
) -> tuple[Array, Array, Float[Array, ""], Array, Array]:
    """`x`'s 1 x `block` and `block` x 1 tiles from one read, as `BlockwiseScaling` takes
    them: FP8 `data` and `scale_inv (*B, M, K / block)`, `max |x|` (NaN with a NaN),
    `data_t (*B, M, K)` (the column tiles' values, K-major in memory: the kernel's
    `(K, M)` transposed back, which the GEMM's caller transposes again, XLA folding both)
    and `scale_inv (*B, M / block, K)`. On the kernel `tensor_core_quantization()` chooses."""
    rule = dict(block=block, max_scale=max_scale, power_of_two=power_of_two)
    swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    sixteen = jnp.dtype(x.dtype) in SIXTEEN
    if _TENSOR_CORES.get() and sixteen and block == TENSOR_CORE_BLOCK:
        data, scale_t, amaxes, data_t, cols = tensor_core_quantize_rows_and_columns(x, fmt, **rule)
    else:
        call = functools.partial(quantize_rows_and_columns, fmt=fmt, **rule)
        data, scale_t, amaxes, data_t, cols = (jax.vmap(call) if x.ndim == 3 else call)(x)
    # One amax per program (NaN-propagating): their max is `x`'s.
    return data, swap(scale_t), jnp.max(amaxes), swap(data_t), cols


def recipe_quantize_rows(
    x: Float[Array, "*B M K"], fmt: jnp.dtype, *, block: int, max_scale: float, power_of_two: bool
) -> tuple[Array, Array, Float[Array, ""]]:
    """`x`'s 1 x `block` tiles, as `BlockwiseScaling` takes them: FP8 `data`, `scale_inv
    (*B, M, K / block)` and `max |x|` (NaN with a NaN). On the kernel
    `tensor_core_quantization()` chooses (block 128 and a type of `READS`: Mosaic GPU's, on
    TMA)."""
    rule = dict(block=block, max_scale=max_scale, power_of_two=power_of_two)
    if _TENSOR_CORES.get() and block == TENSOR_CORE_BLOCK and jnp.dtype(x.dtype) in READS:
        data, scale_t, amaxes = tensor_core_quantize_rows(x, fmt, **rule)
    else:
        call = functools.partial(quantize_rows, fmt=fmt, **rule)
        data, scale_t, amaxes = (jax.vmap(call) if x.ndim == 3 else call)(x)
    # One amax per program (NaN-propagating): their max is `x`'s.
    return data, jnp.swapaxes(scale_t, -1, -2), jnp.max(amaxes)


def recipe_requantize_columns(
    data: Array,
    scale_inv: Float[Array, "*B M K/block"],
    *,
    block: int,
    max_scale: float,
    power_of_two: bool,
) -> tuple[Array, Float[Array, "*B M/block K"]]:
    """A saved FP8 activation `data (*B, M, K)` in 1 x `block` tiles (`scale_inv` as the
    recipe holds it) in `block` x 1 tiles, as `BlockwiseScaling` takes them: the FP8 values
    `(*B, M, K)` (the kernel's `(K, M)` transposed back, which the GEMM's caller transposes
    again, XLA folding both) and chunk-major `scale_inv (*B, M / block, K)`. On the kernel
    `tensor_core_quantization()` chooses (block 128)."""
    rule = dict(block=block, max_scale=max_scale, power_of_two=power_of_two)
    swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
    if _TENSOR_CORES.get() and block == TENSOR_CORE_BLOCK:
        data_t, cols = tensor_core_requantize_columns(data, swap(scale_inv), **rule)
    else:
        call = functools.partial(requantize_columns, **rule)
        data_t, cols = (jax.vmap(call) if data.ndim == 3 else call)(data, swap(scale_inv))
    return swap(data_t), cols


def recipe_quantize_blocks(
    w: Float[Array, "N K"], fmt: jnp.dtype, *, block: int, max_scale: float, power_of_two: bool
) -> tuple[Array, Array, Array, Array, Array]:
    """`block_quantize.quantize_blocks(w)`'s five outputs (a weight's blocks, their transpose,
    their scales in both layouts, amaxes whose max is `max |w|`), on the kernel
    `tensor_core_quantization()` chooses (block 128 and a type of `READS`)."""
    rule = dict(block=block, max_scale=max_scale, power_of_two=power_of_two)
    if _TENSOR_CORES.get() and block == TENSOR_CORE_BLOCK and jnp.dtype(w.dtype) in READS:
        return tensor_core_quantize_blocks(w, fmt, **rule)
    return quantize_blocks(w, fmt, **rule)


def gathers_on_tensor_cores(x: Array, block: int, dtypes: tuple = SIXTEEN) -> bool:
    """Whether an expert layer's gathered tiles of `x` take the tensor-core kernels: inside
    `tensor_core_quantization()`, `x` of `dtypes` (16-bit: exact in the tensor cores; FP8,
    a saved activation) with at least 128 rows and a multiple of 4 (TMA's 16-byte strides
    of the rows' scales), block 128, a JAX whose Mosaic GPU compiles the kernels."""
    rows = x.shape[0] >= TENSOR_CORE_BLOCK and x.shape[0] % 4 == 0
    kernel = block == TENSOR_CORE_BLOCK and mosaic_private.untiled_wgmma_loads()
    return _TENSOR_CORES.get() and jnp.dtype(x.dtype) in dtypes and rows and kernel


def recipe_gathered(
    x: Float[Array, "M K"], rows: Int[Array, " P"], fmt: jnp.dtype, **rule
) -> tuple[Array, Float[Array, "P/block K"]]:
    """`padded_quantize.quantize_padded_columns(x, rows)` (an expert layer's gathered
    `block` x 1 tiles, transposed, and their scales), on the kernel
    `tensor_core_quantization()` chooses (`rows` as `gather_map` writes it)."""
    if gathers_on_tensor_cores(x, rule["block"]):
        return tensor_core_quantize_padded_columns(x, *padded_tiles(rows), fmt, **rule)
    return quantize_padded_columns(x, rows, fmt, **rule)


def recipe_both_gathered(
    x: Float[Array, "M K"], rows: Int[Array, " P"], fmt: jnp.dtype, **rule
) -> tuple[Array, Array, Array, Array, Array]:
    """`padded_quantize.quantize_rows_and_padded_columns(x, rows)`'s five outputs (the rows
    copy, its chunk-major scales, amaxes whose maximum is `max |x|`, the gathered columns
    copy and its scales), from one read of `x`. Inside `tensor_core_quantization()` the
    Mosaic GPU kernel `tensor_core_quantize_rows_and_padded_columns` (`rows` as `gather_map`
    writes it: its tiles' windows cover every row of `x`)."""
    if gathers_on_tensor_cores(x, rule["block"]):
        tiles = padded_tiles(rows)
        return tensor_core_quantize_rows_and_padded_columns(x, *tiles, fmt, **rule)
    return quantize_rows_and_padded_columns(x, rows, fmt, **rule)


def recipe_requantize_gathered(
    data: Array, scale_inv_t: Float[Array, "K/block M"], rows: Int[Array, " P"], **rule
) -> tuple[Array, Float[Array, "P/block K"]]:
    """`padded_quantize.requantize_padded_columns(data, scale_inv_t, rows)` (a saved FP8
    activation's gathered `block` x 1 tiles, transposed, and their scales), on the kernel
    `tensor_core_quantization()` chooses (`rows` as `gather_map` writes it)."""
    if gathers_on_tensor_cores(data, rule["block"], FP8_TYPES):
        start, count = padded_tiles(rows)
        return tensor_core_requantize_padded_columns(data, scale_inv_t, start, count, **rule)
    return requantize_padded_columns(data, scale_inv_t, rows, **rule)


def tensor_core_quantization_chosen() -> bool:
    """Whether blockwise quantization traced now takes the tensor-core kernels
    (`tensor_core_quantization`)."""
    return _TENSOR_CORES.get()


def weight_block_scales_chosen() -> bool:
    """Whether GEMMs traced now take weights' block scales once per block
    (`weight_block_scales`)."""
    return _WEIGHT_BLOCKS.get()


def on_gpu() -> bool:
    """Whether kernels traced now run on this machine's GPU: not interpreted, and JAX's
    default backend a GPU (a deviceless compile on a CPU machine is not)."""
    return not interpreting() and jax.default_backend() == "gpu"


def persistent_config(kind: str) -> PersistentConfig | None:
    """The persistent kernel's configuration for a GEMM of `kind` (a key of
    `DEFAULT_CONFIGS`) traced now; `None`: the tiled kernel."""
    choice = _CHOSEN.get()
    if choice == _TILED or (choice == _DEFAULT and not on_gpu()):
        return None
    config = choice if isinstance(choice, PersistentConfig) else DEFAULT_CONFIGS[kind]
    return dataclasses.replace(config, chained=True) if _CHAINED.get() else config


def recipe_block_gemm(
    lhs: Array,
    lhs_scale: Array,
    terms: Sequence[tuple[Array, Array]],
    *,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
    block_rows: tuple[int, int] = (1, 1),
) -> Float[Array, "M N"]:
    """The block-scaled GEMM the recipes call: `persistent_block_scaled_gemm` where the chunks
    are 128 wide (the only width it takes) and no context or the interpreter chooses the
    tiled kernel (see the module), else `block_scaled_gemm` (the tiled kernel). Scales per
    `block_rows` rows of each operand, as both kernels take them."""
    config = persistent_config("dense")
    kw = dict(out_dtype=out_dtype, block_rows=block_rows)
    if config is None or block_k != BLOCK_K:
        return block_scaled_gemm(lhs, lhs_scale, terms, **kw, block_k=block_k)
    tile = block_rows[0] % config.tile_m == 0 or block_rows[1] % config.tile_n == 0
    config = dataclasses.replace(config, compute_wgs=warpgroups(config, tile))
    return persistent_block_scaled_gemm(lhs, lhs_scale, terms, **kw, config=config)


def warpgroups(config: PersistentConfig, tile_scale: bool, wg_dimension: str | None = None) -> int:
    """The compute warpgroups a recipe's GEMM takes in `config`: its three only where an
    operand has one scale per warpgroup tile (`tile_scale`: a weight's 128 x 128 blocks, or
    one per item or expert; three warpgroups' 152 registers a thread hold a vector of scales
    on one side only, `PersistentConfig.compute_wgs`) and three tiles along `wg_dimension`
    (the config's by default) fit a TMA copy's 256 rows; else two."""
    along = config.tile_m if (wg_dimension or config.wg_dimension) == "m" else config.tile_n
    return 3 if config.compute_wgs == 3 and tile_scale and 3 * along <= 256 else 2


def _grouped_choice(kind: str, lhs: Array, block_k: int) -> PersistentConfig | None:
    """The persistent kernels' configuration for a grouped GEMM of `kind` ("rows" or
    "tokens") whose operands are FP8 and whose chunks are 128 wide (the only ones those
    kernels take); `None`: the tiled kernel."""
    config = persistent_config(kind)
    if config is None or block_k != BLOCK_K or jnp.dtype(lhs.dtype) not in FP8_TYPES:
        return None
    return config


def recipe_grouped_rows_gemm(
    lhs: Array,
    rhs: Array,
    items: RowItems,
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    item_scale: Float[Array, " W"] | None = None,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
    promote: bool = False,
    rhs_block_rows: int = 1,
) -> Float[Array, "M N"]:
    """The grouped rows GEMM the grouped layers call: `persistent_grouped_rows_gemm` (its
    warpgroups splitting N) where the operands are FP8, the chunks 128 wide and the tiled
    kernel not chosen (see the module), else `grouped_rows_gemm`. `promote`: a per-tile
    scaled contraction promoted to float32 every chunk (the backward's, as cuBLASLt without
    fast accumulation). `items`: cut at `TILE_M`-row tiles (`grouped_gemm.row_items`).
    `rhs_block_rows`: rows of each expert's `rhs` per scale of `rhs_scale`."""
    config = _grouped_choice("rows", lhs, block_k)
    scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, item_scale=item_scale)
    kw = dict(out_dtype=out_dtype, promote=promote, rhs_block_rows=rhs_block_rows)
    if config is None:
        return grouped_rows_gemm(lhs, rhs, items, **scales, **kw, block_k=block_k)
    tile = item_scale is not None or rhs_block_rows % config.tile_n == 0
    return persistent_grouped_rows_gemm(
        lhs,
        rhs,
        items,
        **scales,
        **kw,
        # A CTA's rows are one item's: the items' tile rows, the warpgroups splitting N, a
        # cluster (if any) sharing the row tile.
        config=dataclasses.replace(
            config,
            tile_m=TILE_M,
            wg_dimension="n",
            cluster=None if config.cluster == "m" else config.cluster,
            chunks_per_step=config.chunks_per_step if item_scale is None else 1,
            compute_wgs=warpgroups(config, tile, "n"),
        ),
    )


def recipe_grouped_tokens_gemm(
    lhs: Array,
    rhs: Array,
    chunk_start: Int[Array, " G"],
    chunk_count: Int[Array, " G"],
    *,
    lhs_scale: Array | None = None,
    rhs_scale: Array | None = None,
    group_scale: Float[Array, " G"] | None = None,
    out_dtype=jnp.float32,
    block_k: int = BLOCK_K,
    promote: bool = False,
) -> Float[Array, "G A B"]:
    """The grouped tokens GEMM (wgrad) the grouped layers call:
    `persistent_grouped_tokens_gemm` where the operands are FP8, the chunks 128 wide and the
    tiled kernel not chosen (see the module), else `grouped_tokens_gemm`. `promote`: as
    `recipe_grouped_rows_gemm`'s."""
    config = _grouped_choice("tokens", lhs, block_k)
    scales = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, group_scale=group_scale)
    kw = dict(out_dtype=out_dtype, promote=promote)
    if config is None:
        return grouped_tokens_gemm(
            lhs, rhs, chunk_start, chunk_count, **scales, **kw, block_k=block_k
        )
    # Chunk counts known at run time; block scales per row on both sides, or one per expert.
    config = dataclasses.replace(
        config, chunks_per_step=1, compute_wgs=warpgroups(config, group_scale is not None)
    )
    return persistent_grouped_tokens_gemm(
        lhs, rhs, chunk_start, chunk_count, **scales, **kw, config=config
    )

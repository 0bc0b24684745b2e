"""The ways sections 2e and 2f time (`transpose.py`): each kernel's function of `x` (or of
its saved FP8 copy), per tensor and blockwise, by family, in the configurations of
`CONFIGS`; `ways` builds the table of them for a shape."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax._src.kernels import block_quantize, padded_quantize
from fp8jax._src.kernels.tensor_core_blocks import (
    tensor_core_quantize_blocks,
    tensor_core_quantize_rows,
    tensor_core_quantize_rows_and_columns,
    tensor_core_requantize_columns,
)
from fp8jax._src.kernels.tensor_core_gathered import (
    padded_tiles,
    tensor_core_quantize_padded_columns,
    tensor_core_quantize_rows_and_padded_columns,
    tensor_core_requantize_padded_columns,
)
from fp8jax._src.kernels.tensor_core_transpose import (
    TransposeConfig,
    stages,
    tensor_core_cast_transpose,
)

from . import timing
from .quantize import (
    E4M3,
    PER_TENSOR_SCALE,
    RULE,
    per_tensor_kernel,
    per_tensor_xla,
    recipe_passes,
    row_map,
)

#: The tensor-core kernel's configurations the section times, the default first: stages in
#: flight, and programs (one wave at 132; two; short programs of a few tiles).
CONFIGS = {
    "default": TransposeConfig(),
    "2 stages": TransposeConfig(max_concurrent_steps=2),
    "4 stages": TransposeConfig(max_concurrent_steps=4),
    "264 programs": TransposeConfig(max_programs=264),
    "1056 programs": TransposeConfig(max_programs=1056),
}
TRITON = {
    "default": block_quantize.DEFAULT_TUNING,
    "transposed before the cast": block_quantize.ColumnTuning(num_warps=4, transpose_first=True),
}


def _tensor_cores(x: jax.Array, config: TransposeConfig) -> tuple:
    """`quantize.per_tensor_kernel` on the tensor-core kernel in `config`."""
    data, data_t, amax = tensor_core_cast_transpose(
        x, jnp.float32(PER_TENSOR_SCALE), E4M3, config=config
    )
    return data, data_t, jnp.max(amax)


#: The blockwise ways' names begin so: an output gradient's 1 x 128 and 128 x 1 tiles (16-bit
#: shapes), a weight's 128 x 128 blocks (the weight shapes).
BLOCKWISE, BLOCKS = "blockwise ", "blockwise weight "
#: And a saved FP8 activation's 1 x 128 tiles requantized into the wgrad's 128 x 1 tiles
#: (the BF16 activation shape): functions of `(data, scale_inv_t)`, not of `x`.
REQUANTIZED = "blockwise requantized "
#: And its 1 x 128 tiles alone (the forward's copy; "tensor cores": the Mosaic GPU kernel,
#: which has nothing to transpose and so runs on TMA alone).
ROWS = "blockwise rows "
#: And experts' weights (`EXPERT_SHAPES`), each in its blocks, the three ways `vmap`ped over
#: the experts (the tensor-core kernel: one kernel for all, session 53; Triton's: a grid axis
#: more).
EXPERTS = "blockwise experts' weights "
#: And an expert layer's output gradient gathered into the padded layout (eight uneven
#: experts, `quantize.row_map`) in 128 x 1 tiles, transposed (the gradient's shape; the
#: tensor-core kernel: `tensor_core_gathered`, session 53).
GATHERED = "blockwise gathered "
#: And an expert layer's saved FP8 activation (as `saved_copy`) gathered so and requantized
#: (the activation's shape; the tensor-core kernel: `tensor_core_gathered`, session 54).
GATHERED_REQUANTIZED = "blockwise gathered requantized "
#: And its two copies for an expert layer from one read: its 1 x 128 tiles and its gathered
#: 128 x 1 tiles (the gradient's shape; the tensor-core kernel: session 54).
ROWS_GATHERED = "blockwise rows+gathered "
#: The families of functions of the saved copy `(data, scale_inv_t)`, not of `x`.
OF_SAVED = (REQUANTIZED, GATHERED_REQUANTIZED)
#: The families by prefix, the longest first.
PREFIXES = (
    GATHERED_REQUANTIZED,
    ROWS_GATHERED,
    REQUANTIZED,
    EXPERTS,
    GATHERED,
    BLOCKS,
    ROWS,
    BLOCKWISE,
)
#: The families whose kernels read a padded tile's rows from any row (two tiles in flight by
#: hand: `CONFIGS`' stages do not apply).
BY_HAND = (GATHERED, GATHERED_REQUANTIZED, ROWS_GATHERED)


#: The blockwise recipe's XLA path for an output gradient's two copies, an activation's
#: 1 x 128 tiles and a weight's two copies (forward and dgrad): `quantize.recipe_passes`'.
_XLA_PASSES = {
    k: fn for k, (fn, _) in recipe_passes(fp8jax.BlockwiseScaling(native_kernel=False)).items()
}
_blockwise_xla, _rows_xla = _XLA_PASSES["rows+columns"], _XLA_PASSES["rows"]
_blocks_xla = _XLA_PASSES["weight + dgrad copy"]
_gathered_xla = _XLA_PASSES["gathered columns"]
_rows_gathered_xla = _XLA_PASSES["rows+gathered columns"]


def _gathered_triton(x: jax.Array) -> tuple:
    rows = jnp.asarray(row_map(x.shape[0]))
    return padded_quantize.quantize_padded_columns(x, rows, E4M3, **RULE)


def _gathered_tensor_cores(x: jax.Array, config: TransposeConfig) -> tuple:
    start, count = padded_tiles(jnp.asarray(row_map(x.shape[0])))
    return tensor_core_quantize_padded_columns(x, start, count, E4M3, **RULE, config=config)


def _rows_gathered_triton(x: jax.Array) -> tuple:
    rows = jnp.asarray(row_map(x.shape[0]))
    return padded_quantize.quantize_rows_and_padded_columns(x, rows, E4M3, **RULE)


def _rows_gathered_tensor_cores(x: jax.Array, config: TransposeConfig) -> tuple:
    start, count = padded_tiles(jnp.asarray(row_map(x.shape[0])))
    return tensor_core_quantize_rows_and_padded_columns(
        x, start, count, E4M3, **RULE, config=config
    )


def _gathered_requantized_xla(data: jax.Array, scale_inv_t: jax.Array) -> Any:
    """The blockwise recipe's XLA path for the wgrad's gathered copy of a saved activation."""
    recipe = fp8jax.BlockwiseScaling(native_kernel=False)
    q = fp8jax.QTensor(data, scale_inv_t.T, (1, 128))
    return recipe.retile_gathered(q, jnp.asarray(row_map(data.shape[0])), "input")


def _gathered_requantized_triton(data: jax.Array, scale_inv_t: jax.Array) -> tuple:
    rows = jnp.asarray(row_map(data.shape[0]))
    return padded_quantize.requantize_padded_columns(data, scale_inv_t, rows, **RULE)


def _gathered_requantized_tensor_cores(data, scale_inv_t, config: TransposeConfig) -> tuple:
    start, count = padded_tiles(jnp.asarray(row_map(data.shape[0])))
    return tensor_core_requantize_padded_columns(
        data, scale_inv_t, start, count, **RULE, config=config
    )


def _blockwise_triton(x: jax.Array) -> tuple:
    return block_quantize.quantize_rows_and_columns(x, E4M3, **RULE)


def _blockwise_tensor_cores(x: jax.Array, config: TransposeConfig) -> tuple:
    return tensor_core_quantize_rows_and_columns(x, E4M3, **RULE, config=config)


def _requantized_xla(data: jax.Array, scale_inv_t: jax.Array) -> Any:
    """The blockwise recipe's XLA path for the wgrad's copy of a saved activation."""
    recipe = fp8jax.BlockwiseScaling(native_kernel=False)
    return recipe.retile(fp8jax.QTensor(data, scale_inv_t.T, (1, 128)), "input", -2)


def _requantized_triton(data: jax.Array, scale_inv_t: jax.Array) -> tuple:
    return block_quantize.requantize_columns(data, scale_inv_t, **RULE)


def _requantized_tensor_cores(data, scale_inv_t, config: TransposeConfig) -> tuple:
    return tensor_core_requantize_columns(data, scale_inv_t, **RULE, config=config)


def _rows_triton(x: jax.Array) -> tuple:
    return block_quantize.quantize_rows(x, E4M3, **RULE)


def _rows_mosaic(x: jax.Array, config: TransposeConfig) -> tuple:
    return tensor_core_quantize_rows(x, E4M3, **RULE, config=config)


def saved_copy(x: jax.Array, dry: bool) -> tuple[jax.Array, jax.Array]:
    """`x`'s 1 x 128 tiles as the forward saves them: FP8 data, chunk-major scale_inv."""
    with timing.kernels(dry):
        return jax.jit(lambda x: block_quantize.reference_rows(x, E4M3, **RULE)[:2])(x)


def _blocks_triton(w: jax.Array) -> tuple:
    return block_quantize.quantize_blocks(w, E4M3, **RULE)


def _blocks_tensor_cores(w: jax.Array, config: TransposeConfig) -> tuple:
    return tensor_core_quantize_blocks(w, E4M3, **RULE, config=config)


def ways(
    dry: bool,
    dtype: jnp.dtype,
    weight: bool,
    requantized: bool = False,
    experts: bool = False,
    gathered: bool = False,
) -> dict[str, Any]:
    """`name -> function of x` for every way the section times at an `x` of `dtype` (`dry`:
    each kernel's default only; traced inside `timing.kernels(dry)`, interpreted in a dry
    run): per tensor; blockwise, a 16-bit `x`'s tiles (the tensor cores transpose BF16
    exactly), a `weight`'s blocks, and where `requantized` its saved copy's 128 x 1 tiles
    and gathered into the padded layout (functions of `saved_copy(x)`), and where
    `gathered` its rows gathered into the padded layout. `experts`: `x` is experts' weights
    `(E, N, K)`, and the ways are the weight's blocks `vmap`ped over them (each kernel's
    default only)."""
    if experts:
        out = {f"{EXPERTS}xla": jax.vmap(_blocks_xla)}
        out[f"{EXPERTS}triton, default"] = jax.vmap(_blocks_triton)
        tensor_cores = functools.partial(_blocks_tensor_cores, config=TransposeConfig())
        out[f"{EXPERTS}tensor cores, default"] = jax.vmap(tensor_cores)
        return out
    out: dict[str, Any] = {"xla": per_tensor_xla}
    for name, tuning in list(TRITON.items())[: 1 if dry else None]:
        out[f"triton, {name}"] = functools.partial(per_tensor_kernel, tuning=tuning)
    for name, config in distinct_configs(dry, dtype, E4M3):
        out[f"tensor cores, {name}"] = functools.partial(_tensor_cores, config=config)
    blockwise = None
    if weight:
        blockwise = (BLOCKS, _blocks_xla, _blocks_triton, _blocks_tensor_cores, E4M3)
    elif jnp.dtype(dtype).itemsize == 2:
        blockwise = (BLOCKWISE, _blockwise_xla, _blockwise_triton, _blockwise_tensor_cores, dtype)
    families = [] if blockwise is None else [blockwise]
    if gathered:
        families.append((GATHERED, _gathered_xla, _gathered_triton, _gathered_tensor_cores, dtype))
        both = (_rows_gathered_xla, _rows_gathered_triton, _rows_gathered_tensor_cores)
        families.append((ROWS_GATHERED, *both, dtype))
    if requantized:
        families.append((ROWS, _rows_xla, _rows_triton, _rows_mosaic, None))
        families.append(
            (REQUANTIZED, _requantized_xla, _requantized_triton, _requantized_tensor_cores, E4M3)
        )
        gathered_ways = (_gathered_requantized_triton, _gathered_requantized_tensor_cores)
        families.append((GATHERED_REQUANTIZED, _gathered_requantized_xla, *gathered_ways, None))
    for prefix, xla, triton, tensor_cores, eye in families:
        out[f"{prefix}xla"], out[f"{prefix}triton, default"] = xla, triton
        operand = E4M3 if prefix in OF_SAVED else dtype
        for name, config in distinct_configs(dry, operand, eye):
            if (
                prefix in BY_HAND
                and config.max_concurrent_steps != CONFIGS["default"].max_concurrent_steps
            ):
                continue  # two tiles in flight by hand: the stages do not apply
            if prefix in (GATHERED_REQUANTIZED, ROWS_GATHERED) and name != "default":
                continue  # the call's budget: the gathered family sweeps the programs
            out[f"{prefix}tensor cores, {name}"] = functools.partial(tensor_cores, config=config)
    return out


def distinct_configs(dry: bool, dtype: jnp.dtype, eye: jnp.dtype) -> list:
    """`CONFIGS`' items (the default alone where `dry`) but those that run as an earlier
    one: the same programs and stages once clipped to shared memory (a float32 operand or
    the blockwise kernel's BF16 identity leave room for fewer)."""
    seen, out = set(), []
    for name, config in list(CONFIGS.items())[: 1 if dry else None]:
        key = (config.max_programs, stages(config, dtype, eye))
        if key not in seen:
            seen.add(key)
            out.append((name, config))
    return out


def family(name: str) -> str:
    """The prefix of way `name` (of `PREFIXES`; "" per tensor)."""
    return next((p for p in PREFIXES if name.startswith(p)), "")

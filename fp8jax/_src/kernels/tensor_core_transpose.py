"""Per-tensor FP8 quantization in one pass on Hopper's TMA and tensor cores (Pallas Mosaic
GPU): the cast, its transposed copy and the tensor's amax from one read, as
`cast_transpose` computes them.

`tensor_core_cast_transpose(x, scale, fmt)` returns what `cast_transpose.cast_transpose`
returns (the saturating cast of `x * scale`, the same FP8 values transposed, and partial
amaxes whose maximum is `max |x|`), by another route. The Pallas Triton kernel and XLA's
transposing fusions move their tiles between threads through shared memory one byte at a
time (`benchmarks/quantize_ptx.py`), and ran at 0.6-2.5 TB/s on an H200 (GPU run 6: about
half of HBM's rate at best). Here each program streams `x`'s 128 x 128 tiles by TMA
through a pipeline, casts a tile in registers, writes it to shared memory (whence TMA
stores it), and transposes it with one `wgmma`: `I . q^T`, the identity times the FP8 tile
read K-major as any `wgmma` operand, which the tensor cores compute exactly (products of
FP8 values with 1 and 0, summed in float32). The transposed tile is cast back to FP8 (the
same values) and stored by TMA while the next tile loads.

One difference from the other routes: where `x` has a NaN or an infinity (its cast is
NaN), `0 * NaN` in the tensor cores makes the whole row of the transposed tile that holds
it NaN, not one element; the amax is NaN either way, a step whose gradients the train
step's finite check rejects. Finite operands give the same bits.

Its knobs (`TransposeConfig`) are for the GPU check's `transpose` section; the
recipes call it inside `per_tensor_pass.cast_transpose_kernel(on_tensor_cores=True)` only,
until a GPU run has timed it (issue 38). In Mosaic GPU's interpreter it runs the GPU's own
code from JAX 0.11 on (`wgmma` on a transposed view); JAX 0.10's refuses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from ..core import mosaic_private
from ..core.jax_private import shape_like
from . import TENSOR_CORE_TRANSPOSE_NAME
from .block_gemm import operand_tiling
from .dispatch import interpreting
from .persistent_config import H100_SMEM_BYTES, SMEM_RESERVE
from .quantize_tiles import bits_max, nan_max, saturating_cast

#: The tile: 128 x 128, `wgmma`'s K step times four and the TMA box of one program's step.
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class TransposeConfig:
    """`max_programs`: programs at most (one an SM at a time: their shared memory), each
    walking an equal run of consecutive tiles (row-major over `x`'s tiles; the fewest
    programs up to it that divide the tiles evenly, so one wave on an H100's 132 SMs);
    `max_concurrent_steps`: tiles of `x` in flight in the TMA pipeline (32 KB a BF16 tile;
    clipped to what shared memory holds)."""

    max_programs: int = 132
    max_concurrent_steps: int = 3

    def __post_init__(self):
        for name in ("max_programs", "max_concurrent_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransposeConfig: {name}={value!r}; expected an int >= 1.")
        if self.max_concurrent_steps > 4:
            raise ValueError(
                f"TransposeConfig: max_concurrent_steps={self.max_concurrent_steps!r}; "
                "expected at most 4 (shared memory)."
            )


def tiles_per_program(config: TransposeConfig, tiles: int) -> int:
    """The fewest tiles a program walks such that they divide `tiles` and the programs
    number at most `config.max_programs`."""
    return next(d for d in range(-(-tiles // config.max_programs), tiles + 1) if tiles % d == 0)


#: What this kernel's shared memory holds besides `x`'s stages: the identity and two buffers
#: each of the FP8 copies (16 KB a tile), the amax row, the barriers' reserve.
_FIXED_BYTES = 5 * BLOCK * BLOCK + 4 * BLOCK + SMEM_RESERVE


def stages(config: TransposeConfig, dtype: jnp.dtype) -> int:
    """`config.max_concurrent_steps`, clipped to the tiles of `dtype` shared memory holds
    (a float32 operand: 2)."""
    fit = (H100_SMEM_BYTES - _FIXED_BYTES) // (BLOCK * BLOCK * jnp.dtype(dtype).itemsize)
    return max(1, min(config.max_concurrent_steps, fit))


def _kernel_call(x, scale, *, fmt, batch, config, interpret):
    rows, k = x.shape
    m = rows // batch
    row_tiles, tiles_per_batch = k // BLOCK, m // BLOCK
    tiles = (rows // BLOCK) * row_tiles
    per = tiles_per_program(config, tiles)
    x_tiling, q_tiling = operand_tiling(x.dtype, BLOCK), operand_tiling(fmt, BLOCK)
    layout = None if interpret else plgpu.Layout.WGMMA

    def body(x_gmem, s_gmem, eye_gmem, q_gmem, qt_gmem, amax_gmem, *scratch):
        eye_smem, q_smem, qt_smem, amax_smem, barrier = scratch
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, barrier)
        plgpu.barrier_wait(barrier)
        s = s_gmem[0]

        def step(indices, x_smem, amax):
            (j,) = indices
            slot, i, col = lax.rem(j, 2), (p * per + j) // row_tiles, (p * per + j) % row_tiles
            b, local = i // tiles_per_batch, i % tiles_per_batch
            # The stores of two tiles ago (two copies each) have read their buffers.
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)
            xv = mosaic_private.load(x_smem, layout=layout).astype(jnp.float32)
            amax = bits_max(amax, nan_max(jnp.abs(xv), axis=1))  # per row, NaN above inf
            q_smem.at[slot][...] = saturating_cast(xv, s, fmt)
            plgpu.commit_smem()
            dst = q_gmem.at[pl.ds(i * BLOCK, BLOCK), pl.ds(col * BLOCK, BLOCK)]
            plgpu.copy_smem_to_gmem(q_smem.at[slot], dst)

            def transposed(acc):
                plgpu.wgmma(acc, eye_smem, q_smem.at[slot].transpose((1, 0)))
                return acc[...]

            qt = pl.run_scoped(transposed, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
            qt_smem.at[slot][...] = qt.astype(fmt)
            plgpu.commit_smem()
            at = (b * row_tiles + col) * BLOCK
            dst = qt_gmem.at[pl.ds(at, BLOCK), pl.ds(local * BLOCK, BLOCK)]
            plgpu.copy_smem_to_gmem(qt_smem.at[slot], dst)
            return amax

        init = jnp.zeros((BLOCK,), jnp.float32)
        if not interpret:
            init = plgpu.layout_cast(init, plgpu.Layout.WGMMA.reduce(1))
        amax = plgpu.emit_pipeline(
            step,
            grid=(per,),
            in_specs=[
                plgpu.BlockSpec(
                    (BLOCK, BLOCK),
                    lambda j: ((p * per + j) // row_tiles, (p * per + j) % row_tiles),
                    transforms=x_tiling,
                )
            ],
            max_concurrent_steps=stages(config, x.dtype),
            init_carry=init,
        )(x_gmem)
        amax_smem[...] = amax
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(amax_smem, amax_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = body.__qualname__ = TENSOR_CORE_TRANSPOSE_NAME
    return plgpu.kernel(
        body,
        out_type=(
            shape_like((rows, k), fmt, x),
            shape_like((batch * k, m), fmt, x),
            shape_like((tiles // per, BLOCK), jnp.float32, x),
        ),
        scratch_types=[
            plgpu.SMEM((BLOCK, BLOCK), fmt, transforms=q_tiling),
            plgpu.SMEM((2, BLOCK, BLOCK), fmt, transforms=q_tiling),
            plgpu.SMEM((2, BLOCK, BLOCK), fmt, transforms=q_tiling),
            plgpu.SMEM((BLOCK,), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
        ],
        grid=(tiles // per,),
        grid_names=("p",),
        interpret=mosaic_private.interpret_params() if interpret else None,
    )(x, jnp.reshape(scale, (1,)).astype(jnp.float32), jnp.asarray(np.eye(BLOCK, dtype=fmt)))


_jitted = jax.jit(_kernel_call, static_argnames=("fmt", "batch", "config", "interpret"))


def tensor_core_cast_transpose(
    x: Float[Array, "*B M K"],
    scale: Float[Array, ""],
    fmt: jnp.dtype,
    *,
    config: TransposeConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Float[Array, "programs 128"]]:
    """`x` (at most one batch axis; `M`, `K` multiples of 128; a 16- or 32-bit float) cast
    to FP8 `fmt` at the per-tensor `scale` (saturating, as `fp8jax.quantize`): `data` as
    `x`, `data_t` with the last two axes swapped, and partial amaxes (NaN where `x` has a
    NaN) whose maximum is `max |x|`, from one read of `x`. `config`: a `TransposeConfig`;
    `interpret`: run in Mosaic GPU's interpreter (`None`: as traced)."""
    who = TENSOR_CORE_TRANSPOSE_NAME
    config = TransposeConfig() if config is None else config
    if not isinstance(config, TransposeConfig):
        raise TypeError(f"{who}: config={config!r}; expected a TransposeConfig or None.")
    if x.ndim not in (2, 3) or x.shape[-1] % BLOCK or x.shape[-2] % BLOCK or 0 in x.shape:
        raise ValueError(
            f"{who}: x has shape {x.shape}; expected (M, K) or (B, M, K) with M and K "
            f"positive multiples of {BLOCK}."
        )
    if jnp.dtype(x.dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"{who}: x has dtype {x.dtype}; expected bfloat16, float16 or float32.")
    if jnp.dtype(fmt) not in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        raise ValueError(f"{who}: fmt={fmt!r}; expected float8_e4m3fn or float8_e5m2.")
    if jnp.size(scale) != 1:
        raise ValueError(f"{who}: scale has shape {jnp.shape(scale)}; expected a scalar.")
    interpret = interpreting() if interpret is None else interpret
    if interpret and not mosaic_private.interpreter_runs_gpu_path():
        raise NotImplementedError(
            f"{who}: jax {jax.__version__}'s Mosaic GPU interpreter cannot run wgmma on a "
            "transposed shared-memory view (JAX 0.11 and later can)."
        )
    batch, (m, k) = (x.shape[0] if x.ndim == 3 else 1), x.shape[-2:]
    flat = jnp.reshape(x, (batch * m, k))
    fields = dict(fmt=jnp.dtype(fmt), batch=batch, config=config, interpret=interpret)
    data, data_t, amaxes = _jitted(flat, jnp.asarray(scale), **fields)
    if x.ndim == 3:
        data, data_t = data.reshape(x.shape), data_t.reshape(batch, k, m)
    return data, data_t, amaxes

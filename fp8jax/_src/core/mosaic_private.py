"""The private corner of Pallas Mosaic GPU that fp8jax uses, in one place.

Mosaic GPU's interpreter, which runs a `plgpu.kernel` on a CPU by simulating shared memory,
TMA copies and `wgmma`, is not exported by JAX (0.10): its parameters live in
`jax._src.pallas.mosaic_gpu.interpret`. fp8jax uses it only to check its native kernels'
numerics without a GPU. If a JAX release moves it, this module (and its test,
`tests/test_mosaic_private.py`) is the one place to change.

It also holds the public Mosaic GPU calls whose signature changed between the JAX releases
fp8jax supports (0.10 to 0.12), each adapted by the shape of the API, not by version number:

- `plgpu.load(ref, idx, *, layout)` took the index as a required argument in JAX 0.10,
  deprecated it in 0.11 (a `DeprecationWarning`) and dropped it in 0.12 (`load(ref, *,
  layout)`): `load` below passes it only where it is required.
- Whether the interpreter runs the kernels' GPU code as it is (`interpreter_runs_gpu_path`,
  from the shape of its internals: JAX 0.11 on).
- Whether `plgpu.wgmma` takes an E4M3 operand with an E5M2 one (`mixed_fp8_wgmma`: PTX
  `wgmma` has independent A and B types; JAX 0.11 on accepts the pair, 0.10 refuses it).
- `plgpu.wgmma_accumulator_load(acc, wait_n=...)` (JAX 0.11 on) reads a `wgmma`
  accumulator once at most `wait_n` `wgmma` groups are in flight; 0.10 has only `acc[...]`,
  which waits for all of them: `wgmma_load` below.
- Whether a buffer filled from any row (untiled) loads into the `wgmma` register layout
  (`untiled_wgmma_loads`: JAX 0.11 on).
- `plgpu.transpose_ref(ref, perm)` is deprecated since 0.11: the kernels call
  `ref.transpose(perm)`, which it wraps in every supported release (what
  `tests/test_mosaic_private.py` traces for the GPU).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def interpret_params(reads_past_the_end: bool = False) -> Any:
    """Parameters that make `plgpu.kernel(..., interpret=...)` run on the CPU.

    A read past the end of an operand raises, unless `reads_past_the_end`: then it reads
    NaNs, where a GPU's TMA reads zeros (a kernel whose last tile reaches past the rows and
    writes none of them; NaNs, should they reach a written value, show it).

    Raises `ImportError` naming the JAX version when this JAX has no Mosaic GPU interpreter.
    """
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as error:  # pragma: no cover - depends on the installed JAX
        import jax

        raise ImportError(
            f"jax {jax.__version__} has no Mosaic GPU interpreter at "
            "jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams; fp8jax's native "
            "kernels can then be checked only on a GPU."
        ) from error
    if reads_past_the_end:
        return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    return InterpretGPUParams()


@functools.cache
def interpreter_runs_gpu_path() -> bool:
    """Whether Mosaic GPU's interpreter runs a Hopper kernel's own code: `wgmma` through a
    transposed shared-memory view (`plgpu.wgmma(acc, a, b.transpose((1, 0)))`, how FP8
    `wgmma` takes a K-major rhs), loads into a register layout and layout casts.

    JAX 0.11's interpreter does (it resolves a view's transforms into one buffer range and
    permutation, `to_access` in its utilities); 0.10's reads only index transforms and has no
    rule for the register layouts, so kernels interpreted there replace those steps
    (`fp8jax._src.kernels.block_gemm.substitutes`).
    """
    try:
        from jax._src.pallas.mosaic.interpret import utils
    except ImportError:  # pragma: no cover - depends on the installed JAX
        return False
    return hasattr(utils, "to_access")


def wgmma_partial_waits() -> bool:
    """Whether this JAX reads a `wgmma` accumulator while later `wgmma` groups are still in
    flight (`plgpu.wgmma_accumulator_load`: JAX 0.11 on)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return hasattr(plgpu, "wgmma_accumulator_load")


def untiled_wgmma_loads() -> bool:
    """Whether Mosaic GPU loads a shared-memory buffer without the swizzled tiling (what a
    TMA copy from any row fills) into the `wgmma` register layout: JAX 0.11 on (0.10's
    layout inference raises `TransferPlanDerivationError`, "Failed to synthesize a transfer
    pattern that avoids bank conflicts", read in a deviceless compile of 0.10.2). Known by
    the change to `wgmma` that came with it (`mixed_fp8_wgmma`: 0.11 on)."""
    return mixed_fp8_wgmma()


def wgmma_load(acc_ref: Any, wait_n: int) -> Any:
    """The value of `wgmma` accumulator `acc_ref` once at most `wait_n` `wgmma` groups are in
    flight (all of them finished where this JAX cannot wait for fewer)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not wgmma_partial_waits():
        return acc_ref[...]
    return plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)


def reset_interpreter() -> None:
    """Clear the interpreter's simulated GPU state. JAX requires it after a kernel raised
    under interpretation, before the next one runs in the same process."""
    from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


@functools.cache
def _load_takes_index() -> bool:
    """Whether `plgpu.load` requires its index argument (JAX 0.10) rather than taking the
    reference alone (0.11 deprecates the index, 0.12 removed it)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def load(ref: Any, *, layout: Any = None) -> Any:
    """`plgpu.load` of the whole `ref` into registers in `layout`, on every supported JAX."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _load_takes_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


@functools.cache
def mixed_fp8_wgmma() -> bool:
    """Whether Pallas Mosaic GPU's `wgmma` multiplies an E4M3 operand by an E5M2 one (JAX
    0.11 on), rather than refusing "mixed input dtypes" (0.10). Probed by the check itself:
    `plgpu.wgmma` on stand-ins of the right shapes fails at once on a JAX that refuses the
    pair, and later (on the stand-ins) on one that takes it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    acc = jax.ShapeDtypeStruct((64, 128), jnp.float32)  # stand-ins: a shape and a dtype
    a = jax.ShapeDtypeStruct((64, 32), jnp.float8_e5m2)
    b = jax.ShapeDtypeStruct((32, 128), jnp.float8_e4m3fn)
    try:
        plgpu.wgmma(acc, a, b)
    except Exception as error:  # noqa: BLE001 - the stand-ins fail past the dtype check
        return "mixed input dtypes" not in str(error).lower()
    return True  # pragma: no cover - a JAX that binds the stand-ins


def ieee_divide(a: Any, b: Any, layout: Any) -> Any:
    """`a / b` of float32 arrays in register `layout`, rounded to nearest (PTX `div.rn.f32`)
    inside a Mosaic GPU kernel, where `/` lowers to the approximate `div.full.f32` (as XLA's
    GPU fusions divide). Through `plgpu.inline_mgpu` and two private helpers of Mosaic GPU's
    `FragmentedArray` (`_pointwise`, `_lift_fast_instr`: an instruction a register)."""
    import jax.numpy as jnp
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    out = plgpu.ShapeDtypeStruct(a.shape, jnp.float32, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout, layout), return_type=out)
    def divide(_, x: Any, y: Any) -> Any:
        return x._pointwise(mgpu.FragmentedArray._lift_fast_instr("div.rn.f32"), y)

    return divide(a, b)

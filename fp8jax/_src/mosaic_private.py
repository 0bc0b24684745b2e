"""The private corner of Pallas Mosaic GPU that fp8jax uses, in one place.

Mosaic GPU's interpreter, which runs a `plgpu.kernel` on a CPU by simulating shared memory,
TMA copies and `wgmma`, is not exported by JAX (0.10): its parameters live in
`jax._src.pallas.mosaic_gpu.interpret`. fp8jax uses it only to check its native kernels'
numerics without a GPU. If a JAX release moves it, this module (and its test,
`tests/test_mosaic_private.py`) is the one place to change.
"""

from __future__ import annotations

from typing import Any


def interpret_params() -> Any:
    """Parameters that make `plgpu.kernel(..., interpret=...)` run on the CPU.

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
    return InterpretGPUParams()


def reset_interpreter() -> None:
    """Clear the interpreter's simulated GPU state. JAX requires it after a kernel raised
    under interpretation, before the next one runs in the same process."""
    from jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()

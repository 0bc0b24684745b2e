"""The XLA options that make FP8 GEMMs run on an H100's FP8 tensor cores.

Under XLA's default flags a GPU GEMM may become a generated Triton kernel. Compiled for an
H100 without a GPU to autotune, XLA's default Triton tiles (16 x 8, two warps) convert FP8
operands to f16 and multiply with `mma.sync ... f16`: FP16 tensor cores, whatever the operand
types say. Larger tiles give FP8 `wgmma`; on a GPU the autotuner picks one by timing, so
which runs is left to chance. With Triton GEMMs off, every FP8 GEMM is one cuBLASLt FP8 call
(`__cublas$lt$matmul$f8`), FP8 tensor cores by construction. MaxText's GPU configurations
set the same flag. [`fp8jax.make_train_step`][] compiles with these options;
[`fp8jax.inspect`][fp8jax.observe.inspect] shows the difference (its `"cublas"` and
`"default"` modes).

The options belong to one executable (`jax.jit(..., compiler_options=...)`), not to the
process; they are ignored on CPUs and TPUs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

import numpy as np

from .contexts import Setting, setting

P = ParamSpec("P")
R = TypeVar("R")

_OPTIONS: dict[str, Any] = {"xla_gpu_enable_triton_gemm": False}

#: XLA's dot merger joins independent dots that share an operand into one dot over the other
#: operands concatenated. Two FP8 GEMMs traced inside `cublas_traced()` that share an operand
#: (a layer called twice, or microbatches, share a weight's FP8 copy) each carry their scale
#: inverses (`dot(x8 * sx_inv, w8 * sw_inv)`), so the merged dot's operand is a concatenation
#: of dequantized copies, and the merged GEMM runs in BF16. A step traced so compiles with
#: the merger off (`traced_options`).
DOT_MERGER = "xla_gpu_dot_merger_threshold_mb"

_CUBLAS_TRACED: Setting[bool] = Setting("fp8jax_cublas_traced", False)
_CUBLAS_READS: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "fp8jax_cublas_reads", default=None
)


def gpu_compiler_options() -> dict[str, Any]:
    """XLA options that route every FP8 GEMM to cuBLASLt's FP8 kernel on GPUs.

    For `jax.jit(..., compiler_options=...)`, `eqx.filter_jit(..., compiler_options=...)` or
    `jitted.lower(...).compile(compiler_options=...)`: per executable, nothing global. A new
    dict each call, so adding to it is safe.

    ```python
    step = jax.jit(train_step, compiler_options=fp8jax.gpu_compiler_options())
    ```
    """
    return dict(_OPTIONS)


def gpu_xla_flags() -> str:
    """The same options as `XLA_FLAGS` text, for the whole process (every executable).

    Add them to the flags already there, before jax starts (assigning them alone drops
    yours; of a flag given twice XLA keeps the last):
    `os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fp8jax.gpu_xla_flags()}"`,
    or in the shell:
    `XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_triton_gemm=false" python train.py`.
    """
    return " ".join(
        f"--{name}={str(value).lower() if isinstance(value, bool) else value}"
        for name, value in _OPTIONS.items()
    )


def checked_compiler_options(who: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """`options` as a dict of XLA options for a train step's executable, with `None` meaning
    [`fp8jax.gpu_compiler_options`][]. Raises `TypeError` naming `who` for anything but a dict
    from option names to bool, int, float or str values."""
    if options is None:
        return gpu_compiler_options()
    if isinstance(options, Mapping):
        # NumPy scalars (a flag read from a config array, say) as the Python values they
        # hold: `triton_gemms_off` compares by identity with False.
        options = {k: v.item() if isinstance(v, np.generic) else v for k, v in options.items()}
    if not isinstance(options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, bool | int | float | str) for k, v in options.items()
    ):
        raise TypeError(
            f"{who}: compiler_options={options!r}: should be a dict from XLA option names to "
            "bool, int, float or str values (e.g. fp8jax.gpu_compiler_options()), or None."
        )
    return dict(options)


def triton_gemms_off(options: Mapping[str, Any]) -> bool:
    """Whether an executable compiled with `options` runs every GEMM on cuBLAS (Triton GEMMs
    turned off, as [`fp8jax.gpu_compiler_options`][] does)."""
    return options.get("xla_gpu_enable_triton_gemm", True) is False


def cublas_traced() -> contextlib.AbstractContextManager[None]:
    """Per-tensor FP8 GEMMs traced inside are compiled with Triton GEMMs off
    ([`fp8jax.gpu_compiler_options`][]; [`fp8jax.make_train_step`][] and
    [`fp8jax.nnx_train_step`][] trace their steps so: `traced_for`).

    Delayed scaling's GEMMs then take the scales' inverses as its state keeps them, each on
    its operand, which XLA's cuBLAS rewriter makes cuBLASLt's own a/b scales: one kernel per
    GEMM, where their product as one factor is a second, small kernel. Under XLA's default
    flags that form would be a BF16 Triton GEMM of two dequantized copies, so it is used only
    where the compile is known to turn Triton GEMMs off (`benchmarks/gemm_scale_forms.py`),
    and XLA's dot merger too (`traced_options`).
    """
    return setting(_CUBLAS_TRACED, True)


def is_cublas_traced() -> bool:
    """Whether the caller is being traced inside `cublas_traced()` (a read that
    `cublas_reads()` records)."""
    reads = _CUBLAS_READS.get()
    if reads is not None:
        reads.append(True)
    return _CUBLAS_TRACED.get()


@contextlib.contextmanager
def cublas_reads() -> Iterator[list[bool]]:
    """A list that grows by one for each `is_cublas_traced()` read inside the `with`. A
    function traced inside without a read is traced the same inside `cublas_traced()` or
    outside: nothing it traced asked. The inspector lowers such a train step once for both
    modes."""
    reads: list[bool] = []
    token = _CUBLAS_READS.set(reads)
    try:
        yield reads
    finally:
        _CUBLAS_READS.reset(token)


def _for_cublas(options: Mapping[str, Any]) -> bool:
    # Triton GEMMs off, and XLA's dot merger not turned on by the caller (`DOT_MERGER`).
    return triton_gemms_off(options) and options.get(DOT_MERGER, 0) == 0


def traced_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options a step `traced_for(options, ...)` compiles with: `options`, and XLA's dot
    merger off where the step is traced for cuBLAS (`DOT_MERGER`)."""
    return {**options, DOT_MERGER: 0} if _for_cublas(options) else dict(options)


def traced_for(options: Mapping[str, Any], fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, traced for an executable compiled with `traced_options(options)`: inside
    `cublas_traced()` where they turn Triton GEMMs off (and the caller has not turned XLA's
    dot merger on), else as it is (fp8jax's train steps jit so)."""
    if not _for_cublas(options):
        return fn

    @functools.wraps(fn)
    def traced(*args: P.args, **kwargs: P.kwargs) -> R:
        with cublas_traced():
            return fn(*args, **kwargs)

    return traced

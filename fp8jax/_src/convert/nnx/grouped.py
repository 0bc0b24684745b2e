"""The experts of a mixture of experts in Flax NNX: `NnxGroupedLinear` (stacked expert
kernels, an injectable `ragged_dot`) and its FP8 `ragged_dot`, `Fp8NnxRaggedDot`, whose
per-expert state lives in [`fp8jax.Fp8State`][] variables."""

from __future__ import annotations

from typing import Any, final

import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, Int

from ...core.formats import float_dtype
from ...layers.grouped import check_grouped_linear_args, high_precision_ragged_dot
from ...ops.ragged_dot import Fp8RaggedDot
from .layers import AbstractFp8NnxDot, fp8_variables


@final
class Fp8NnxRaggedDot(AbstractFp8NnxDot):
    """`jax.lax.ragged_dot` as FP8 grouped GEMMs, for Flax NNX: an [`fp8jax.Fp8RaggedDot`][]
    (a kernel scale per expert) whose state lives in [`fp8jax.Fp8State`][] variables.

    The `ragged_dot` of an [`fp8jax.NnxGroupedLinear`][] ([`fp8jax.fp8_linear_layers`][]
    puts it there). Each call rebuilds the `Fp8RaggedDot` from the variables and calls it:
    the numerics of fp8jax's Equinox experts.

    **Arguments:** as for [`fp8jax.Fp8RaggedDot`][]: `recipe`, `num_experts`, `name`,
    `telemetry`, `native_kernel`.
    """

    def __init__(
        self,
        recipe: Any = None,
        *,
        num_experts: int,
        name: str = "",
        telemetry: bool = False,
        native_kernel: bool | None = None,
    ):
        op = Fp8RaggedDot(
            recipe,
            num_experts=num_experts,
            name=name,
            telemetry=telemetry,
            native_kernel=native_kernel,
        )
        self.state = nnx.data(fp8_variables(op))

    def __call__(
        self,
        lhs: Float[ArrayLike, "tokens fan_in"],
        rhs: Float[ArrayLike, "experts fan_in fan_out"],
        group_sizes: Int[ArrayLike, " experts"],
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
    ) -> Float[Array, "tokens fan_out"]:
        """`lax.ragged_dot(lhs, rhs, group_sizes, ...)` as an FP8 grouped GEMM."""
        return self._dot_general(lhs, rhs, group_sizes, precision, preferred_element_type)


@final
class NnxGroupedLinear(nnx.Module):
    """The experts' Linears of a mixture of experts, for Flax NNX: `y[rows of e] = x[rows of
    e] @ kernel[e]` for every expert `e`, on tokens sorted by expert, as one grouped GEMM.

    The NNX counterpart of [`fp8jax.GroupedLinear`][]: the kernel is an `nnx.Param` of shape
    `(num_experts, in_features, out_features)` (`lax.ragged_dot`'s layout), each expert's
    initialised like `nnx.Linear`'s default (LeCun normal: a normal truncated at two
    standard deviations, of variance `1/in_features`); `ragged_dot` is the GEMM,
    `jax.lax.ragged_dot` until [`fp8jax.fp8_linear_layers`][] puts an
    [`fp8jax.Fp8NnxRaggedDot`][] there (targets, exclusions and recipes by path, as for
    `nnx.Linear`). No bias. `param_dtype` is the kernel's dtype, `dtype` (`None`: no cast) the
    one the tokens and the kernel are cast to for the GEMM: floating dtypes (a `ValueError`
    refuses others). With an `Fp8NnxRaggedDot` and a `dtype` narrower than `param_dtype`,
    the kernel is not cast: the FP8 GEMM quantizes the master and returns `dtype`, as for
    `nnx.Linear`.

    ```python
    up = fp8jax.NnxGroupedLinear(8, 64, 256, rngs=nnx.Rngs(0))
    h = up(x_sorted, group_sizes)  # (tokens, 256)
    ```
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: DTypeLike = jnp.float32,
        dtype: DTypeLike | None = None,
        ragged_dot: Any = None,
    ):
        shape = (num_experts, in_features, out_features)
        shape = check_grouped_linear_args(
            "NnxGroupedLinear", shape, ragged_dot, grouped_op="fp8jax.Fp8NnxRaggedDot", nnx=True
        )
        param_dtype = float_dtype(param_dtype, "NnxGroupedLinear param_dtype")
        if dtype is not None:
            dtype = float_dtype(dtype, "NnxGroupedLinear dtype")
        # nnx.Linear's default (LeCun normal: truncated at 2 standard deviations, variance
        # 1/in_features), each expert's with its own fan-in: the experts axis is a batch axis.
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        kernel = init(rngs.params(), shape, param_dtype)
        self.kernel = nnx.Param(kernel)
        self.ragged_dot = nnx.data(ragged_dot)
        self.num_experts, self.in_features, self.out_features = shape
        self.dtype = dtype

    def __call__(
        self, x: Float[Array, "tokens fan_in"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "tokens fan_out"]:
        """`x (tokens, in_features)`, its rows sorted by expert; `group_sizes (num_experts,)`
        integers >= 0 summing to at most `tokens` (rows past their sum get zeros), as for
        [`fp8jax.GroupedLinear`][]. Computes in `dtype` when given."""
        kernel = self.kernel.get_value()
        x = jnp.asarray(x)
        if self.dtype is not None and isinstance(self.ragged_dot, Fp8NnxRaggedDot):
            if jnp.dtype(self.dtype).itemsize < kernel.dtype.itemsize:
                # As `nnx.Linear`'s FP8 GEMM: the master quantized in one pass, not a cast
                # copy quantized again; the output (and the kernel's gradient) in `dtype`.
                x = x.astype(self.dtype)
                return self.ragged_dot(x, kernel, group_sizes, preferred_element_type=self.dtype)
        if self.dtype is not None:
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if self.ragged_dot is not None:
            return self.ragged_dot(x, kernel, group_sizes)
        return high_precision_ragged_dot("NnxGroupedLinear", x, kernel, group_sizes, None)

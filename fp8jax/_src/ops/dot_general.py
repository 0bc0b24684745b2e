"""`Fp8DotGeneral`: a drop-in, stateful replacement for `jax.lax.dot_general`."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array

from ..core.explicit import explicit_mesh, on_auto_axes
from ..core.stats import Fp8Stats
from ..gemm.dense import fp8_dot_general, normalize_dimension_numbers
from ..recipes import Recipe, TensorState, recipe_from
from .base import AbstractFp8Op, merge_stats


class Fp8DotGeneral(AbstractFp8Op):
    """`jax.lax.dot_general` computed as FP8 GEMMs, with its scaling state.

    Call it exactly like `lax.dot_general`. The forward quantizes both operands (E4M3 by
    default) and multiplies real FP8 arrays; a `custom_vjp` saves only those FP8 operands and
    their scales, quantizes the incoming gradient (E5M2 by default) and computes dgrad and wgrad
    as FP8 x FP8 dots.

    An operand wider than the other and than the output (a float32 master weight beside
    BF16 activations, `preferred_element_type=jnp.bfloat16`: what [`fp8jax.Policy`][] makes
    of an FP8 layer) is quantized from its own values in one pass, and its gradient is
    written in the output's dtype and widened, as the gradient of a cast to it would be.

    The state (a [`fp8jax.TensorState`][] each for `input`, `kernel` and `output_grad`) is
    updated by the gradient: the "gradient" of this module is its new value. Split it out with
    [`fp8jax.partition_for_grad_overwrite`][] and write it back with
    [`fp8jax.apply_updates`][].

    **Arguments:**

    - `recipe`: a [`fp8jax.DelayedScaling`][] (the default) or another recipe, or its name.
    - `kernel_shape`: `(N, K)`, the kernel as a matrix with its contracted axes last; only
      recipes that keep weight-shaped state need it (`ResidualFP8(error_feedback=True)`),
      and they take no kernel with batch dimensions (one matrix per batch entry).
    - `name`: the layer's path, e.g. `"blocks.0.mlp.fc1"` (set by `fp8_linear_layers`). The
      GEMMs run under the name scope `fp8jax[<name>]/fwd` (`dgrad`, `wgrad`), which is how
      [`fp8jax.inspect`][fp8jax.observe.inspect] attributes compiled GEMMs to layers.
    - `telemetry`: also keep [`fp8jax.Fp8Stats`][] (the fractions of each operand saturated and
      flushed to zero at the latest step) in `stats`; see [`fp8jax.telemetry`][]. It costs
      two extra reductions over each operand, which XLA fuses with the amax.

    ```python
    dot = fp8jax.Fp8DotGeneral()
    y = dot(x, w, (((1,), (0,)), ((), ())))   # x @ w, in FP8
    ```
    """

    input: TensorState
    kernel: TensorState
    output_grad: TensorState
    stats: Fp8Stats | None
    recipe: Recipe = eqx.field(static=True)
    name: str = eqx.field(static=True)

    stands_for: ClassVar[str] = "jax.lax.dot_general"
    accumulation: ClassVar[str] = (
        "the GEMM accumulates in float32 and writes that type; an FP8 output would be cast "
        "without a scale or saturation"
    )

    def __init__(
        self,
        recipe: Recipe | str | None = None,
        kernel_shape: tuple[int, int] | None = None,
        name: str = "",
        telemetry: bool = False,
    ):
        if isinstance(telemetry, np.bool_):  # the bool it holds, as Fp8Config takes it
            telemetry = bool(telemetry)
        if not isinstance(telemetry, bool):
            raise TypeError(f"Fp8DotGeneral: telemetry={telemetry!r}: should be True or False.")
        if not isinstance(name, str):
            raise TypeError(f"Fp8DotGeneral: name={name!r}: should be a str (the layer's path).")
        if kernel_shape is not None and (
            not isinstance(kernel_shape, tuple | list)
            or len(kernel_shape) != 2
            or not all(
                isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0
                for d in kernel_shape
            )
        ):
            raise ValueError(
                f"Fp8DotGeneral: kernel_shape={kernel_shape!r}: should be None or "
                "(out_features, in_features), two ints >= 0: the kernel as a matrix with its "
                "contracted axes last."
            )
        if kernel_shape is not None:
            kernel_shape = tuple(int(d) for d in kernel_shape)
        self.recipe = recipe_from(recipe)
        self.name = name
        self.stats = Fp8Stats.zeros() if telemetry else None
        self.input = self.recipe.init_state("input")
        self.kernel = self.recipe.init_state("kernel", kernel_shape)
        self.output_grad = self.recipe.init_state("output_grad")

    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        *,
        out_sharding: Any = None,
    ) -> Array:
        """**Arguments:** as `jax.lax.dot_general`'s; `out_sharding` reshards the output.
        `precision` may also be a list of two (lax takes two `lax.Precision`s only as a
        tuple); a float64 `preferred_element_type` without x64 is float32, with lax's warning.

        **Returns:** the product, in `preferred_element_type` (default: the type
        `lax.dot_general` gives `lhs` and `rhs`).
        """
        lhs_dtype = self._input_dtype("lhs", lhs)
        rhs_dtype = self._input_dtype("rhs", rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        dims = normalize_dimension_numbers(dimension_numbers, lhs.shape, rhs.shape)
        out_dtype = self._output_dtype(lhs_dtype, rhs_dtype, preferred_element_type)
        if isinstance(precision, list):
            precision = tuple(precision)
        explicit = explicit_mesh(lhs, rhs) is not None
        if explicit:  # lax's output sharding, or its error
            out_sharding = jax.eval_shape(
                functools.partial(
                    lax.dot_general,
                    dimension_numbers=dims,
                    preferred_element_type=out_dtype,
                    out_sharding=out_sharding,
                ),
                lhs,
                rhs,
            ).sharding

        def compute(lhs: Array, rhs: Array, states: Any) -> Array:
            with self._name_scope():
                return fp8_dot_general(
                    self.recipe, dims, precision, out_dtype, lhs, rhs, states, self.name
                )

        states = self._states()
        return on_auto_axes(compute, lhs, rhs, states, out_sharding=out_sharding, explicit=explicit)

    @property
    def _where(self) -> str:
        return "Fp8DotGeneral"

    def _merge_stats(self, new: Fp8Stats, received: dict) -> Fp8Stats:
        return merge_stats(self.stats, new, received)

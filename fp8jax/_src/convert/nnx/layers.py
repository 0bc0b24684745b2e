"""The FP8 layers of Flax NNX: `Fp8State`, the variable type of FP8 state, and the layers
holding it, `Fp8NnxDotGeneral` (an `nnx.Linear`'s `dot_general`) and `Fp8NnxEinsum` (an
`nnx.Einsum`'s `einsum_op`)."""

from __future__ import annotations

import abc
from typing import Any, final

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array

from ...core.errors import (
    Fp8StateError,
    OperandShapeError,
    StateErrorWording,
    reword_state_error,
)
from ...core.explicit import resharded
from ...core.jax_private import keep_equinox_missing_on_copy
from ...core.updates import register_state_variable
from ...ops.base import state_tags
from ...ops.dot_general import Fp8DotGeneral
from ..config import stacked_dot_general
from ..einsum import fp8_einsum

# A converted model's graphdef holds its FP8 layers' Equinox treedefs: `copy.deepcopy(model)`.
keep_equinox_missing_on_copy()

#: The NNX words of a state error of the Equinox layer (whose advice is Equinox's).
_NNX_WORDING = StateErrorWording(
    unnamed="An Fp8NnxDotGeneral",
    reuse="a shared or reused layer, a loop",
    grad="nnx.grad / nnx.value_and_grad",
    combine="Use fp8jax.nnx_value_and_grad (or fp8jax.nnx_train_step)",
    state="fp8jax.Fp8State",
    differentiate=(
        ". Differentiate it along with the Params: "
        "fp8jax.nnx_value_and_grad(loss_fn), or nnx.grad(loss_fn, "
        "argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))."
    ),
)


@final
@register_state_variable
class Fp8State(nnx.Variable):
    """The FP8 scaling state of a converted NNX layer: a scale, an amax history, telemetry.

    A variable type of its own, so that filters tell it from what is trained: an
    `nnx.Optimizer(model, tx, wrt=nnx.Param)` leaves it alone, and
    `nnx.state(model, fp8jax.Fp8State)` selects it (to checkpoint it, or inspect it). Its
    gradient is its new value; [`fp8jax.nnx_update_fp8_state`][] writes that back. Its
    `fp8_layer` metadata names its layer and recipe, which a checkpoint of an `nnx.State`
    records (and checks on restoring) as it does a model's.
    """


def fp8_variables(op: Any) -> Any:
    """`op` with each array of its state in an [`fp8jax.Fp8State`][] variable, which names the
    op (its `fp8_layer` metadata): an `nnx.State` of the variables still says which FP8 layers
    it holds and their recipes, as a checkpoint of it records them."""
    return jax.tree.map(lambda x, tag: Fp8State(x, fp8_layer=tag), op, state_tags(op))


def is_variable(x: Any) -> bool:
    """Whether `x` is an `nnx.Variable` (an `is_leaf` that stops at variables)."""
    return isinstance(x, nnx.Variable)


def _check_stacked(stacked: Any) -> tuple[int, ...]:
    if not isinstance(stacked, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in stacked
    ):
        raise ValueError(
            f"Fp8NnxDotGeneral: stacked={stacked!r}: should be a tuple of ints >= 1, the "
            "leading shape of a stack of layers (e.g. (12,) for 12 layers built with "
            "nnx.vmap), or () for one layer."
        )
    return stacked


class AbstractFp8NnxDot(nnx.Module):
    """An FP8 NNX layer: an [`fp8jax.Fp8DotGeneral`][] whose state lives in
    [`fp8jax.Fp8State`][] variables. Its subclasses give it a call: `lax.dot_general`'s
    ([`fp8jax.Fp8NnxDotGeneral`][]) or `jnp.einsum`'s ([`fp8jax.Fp8NnxEinsum`][])."""

    def __init__(
        self,
        recipe: Any = None,
        kernel_shape: tuple[int, int] | None = None,
        name: str = "",
        telemetry: bool = False,
        *,
        stacked: tuple[int, ...] = (),
    ):
        stacked = _check_stacked(stacked)
        dot = Fp8DotGeneral(recipe, kernel_shape, name, telemetry)
        if stacked:
            dot = stacked_dot_general(dot.recipe, stacked, kernel_shape, name, telemetry)
        self.state = nnx.data(fp8_variables(dot))

    @property
    def recipe(self) -> Any:
        """The layer's scaling recipe."""
        return self.state.recipe

    @property
    def name(self) -> str:
        """The layer's path, as `fp8_linear_layers` set it."""
        return self.state.name

    def value(self) -> Fp8DotGeneral:
        """The `Fp8DotGeneral` holding the variables' current values (arrays)."""
        return jax.tree.map(lambda v: v.get_value(), self.state, is_leaf=is_variable)

    def set_value(self, dot: Fp8DotGeneral) -> None:
        """Write the array leaves of `dot` (shaped like [`value`][fp8jax.Fp8NnxDotGeneral.value])
        into the variables."""
        if jax.tree.structure(dot) != jax.tree.structure(self.value()):
            raise ValueError(
                f"Fp8NnxDotGeneral.set_value: got a {type(dot).__name__} of structure "
                f"{jax.tree.structure(dot)}; pass one shaped like this layer's value() (the "
                "same recipe and telemetry setting)."
            )
        own = jax.tree_util.tree_flatten_with_path(self.value())[0]
        for (path, old), new in zip(own, jax.tree.leaves(dot), strict=True):
            shape, dtype = jnp.shape(new), jnp.result_type(new)
            if shape != jnp.shape(old) or dtype != old.dtype:
                raise ValueError(
                    f"Fp8NnxDotGeneral.set_value: {jax.tree_util.keystr(path)} of the "
                    f"{type(dot).__name__} given is {dtype}{list(shape)}, where this layer's is "
                    f"{old.dtype}{list(jnp.shape(old))}; pass one shaped like this layer's "
                    "value() (a stacked layer's state has its stack's leading axes)."
                )
        variables = jax.tree.leaves(self.state, is_leaf=is_variable)
        for variable, new in zip(variables, jax.tree.leaves(dot), strict=True):
            variable.set_value(new)

    @abc.abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Array:
        """The layer's call: `lax.dot_general`'s or `jnp.einsum`'s."""

    def _dot_general(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: Any,
        precision: Any,
        preferred_element_type: DTypeLike | None,
    ) -> Array:
        """The FP8 GEMM of the variables' current state, its state errors said in NNX terms."""
        try:
            return self.value()(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        except Fp8StateError as e:
            raise reword_state_error(e, self.name, _NNX_WORDING) from e

    def _named(self, error: Exception) -> Exception:
        """`error` (a plain `ValueError`, `TypeError` or `OperandShapeError` of the layer's
        call: operands it cannot take, an equation it refuses) led by the layer's path, which
        says which of a model's layers raised; other errors (state errors, and those the op
        names already) as they are."""
        if not self.name or type(error) not in (ValueError, TypeError, OperandShapeError):
            return error
        prefix = f"FP8 layer {self.name!r}: "
        return error if str(error).startswith(prefix) else type(error)(f"{prefix}{error}")


@final
class Fp8NnxDotGeneral(AbstractFp8NnxDot):
    """`jax.lax.dot_general` as FP8 GEMMs, for Flax NNX: an [`fp8jax.Fp8DotGeneral`][]
    whose state lives in [`fp8jax.Fp8State`][] variables.

    Pass it as the `dot_general` of an `nnx.Linear` (or let
    [`fp8jax.fp8_linear_layers`][] do it). Each call rebuilds the `Fp8DotGeneral` from the
    variables' current values and calls it, so the numerics are exactly those of fp8jax's
    Equinox layers: FP8 operands, a `custom_vjp` whose residuals are the FP8 operands, the
    new state returned as the state's gradient.

    **Arguments:**

    - `recipe`, `kernel_shape`, `name`, `telemetry`: as for [`fp8jax.Fp8DotGeneral`][].
    - `stacked`: the leading shape of a stack of layers (an `nnx.Linear` built under
      `nnx.vmap` to be applied with `nnx.scan`, its kernel `(*stacked, in, out)`): one state
      per layer, stacked the same way. `()` for one layer.

    **Attributes:** `state`, the `Fp8DotGeneral` whose array leaves are `Fp8State`
    variables (its paths read `state.input.amax_history`, `state.kernel.scale`, ...).

    ```python
    layer = nnx.Linear(512, 512, dot_general=fp8jax.Fp8NnxDotGeneral(), rngs=nnx.Rngs(0))
    ```
    """

    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        out_sharding: Any = None,
    ) -> Array:
        """`lax.dot_general(lhs, rhs, dimension_numbers, ...)` as an FP8 GEMM."""
        try:
            out = self._dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        except (ValueError, TypeError) as e:
            raise self._named(e) from e
        return resharded(out, out_sharding)


@final
class Fp8NnxEinsum(AbstractFp8NnxDot):
    """[`fp8jax.Fp8NnxDotGeneral`][]'s FP8 GEMM and state with the call of `jnp.einsum`, for
    the `einsum_op` of an `nnx.Einsum`.

    The equation must have two operands, the input then the kernel, each axis named once
    per operand, every axis of one operand only kept in the output (no implicit sums).
    Contracted axes go into the FP8 GEMM's contraction, axes of both operands kept in the
    output into its batch, and the result is transposed to the output's order. Unlike
    `jnp.einsum(..., _dot_general=...)`, which may swap the operands, the kernel always
    takes the kernel's role (its recipe's format, block shape and state).
    """

    def __call__(
        self,
        subscripts: str,
        lhs: ArrayLike,
        rhs: ArrayLike,
        *,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        out_sharding: Any = None,
    ) -> Array:
        """`jnp.einsum(subscripts, lhs, rhs, ...)` as one FP8 `dot_general`."""
        try:
            out = fp8_einsum(
                self._dot_general, subscripts, lhs, rhs, precision, preferred_element_type
            )
        except (ValueError, TypeError) as e:
            raise self._named(e) from e
        return resharded(out, out_sharding)

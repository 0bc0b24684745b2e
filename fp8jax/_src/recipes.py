"""Scaling recipes: how each operand of an FP8 GEMM is scaled, cast and multiplied.

A recipe is a frozen dataclass of Python configuration. Its methods are pure functions of
arrays, called by the GEMM paths of [`fp8jax.Fp8DotGeneral`][] in this order:

1. `scaling(x, state, role)`: the scale to use for `x` now, and the role's new state;
2. `quantize(x, scale, role, contracting)`: an FP8 [`QTensor`][] laid out for a GEMM that
   contracts the axes `contracting` of `x`;
3. `retile(q, contracting)`: the same tensor laid out for another contraction (the wgrad
   contracts the activation over its tokens, not its features), without a high-precision copy;
4. `dot(lhs, rhs, dimension_numbers, precision)`: the float32 product of two `QTensor`s.

Per-tensor recipes share 2-4; block-scaled recipes override them. The forward, dgrad and wgrad
never need to know which recipe they run.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .amax import amax
from .formats import FormatLike, fp8_dtype, fp8_max, quantize

Role = Literal["input", "kernel", "output_grad"]
ROLES: tuple[Role, ...] = ("input", "kernel", "output_grad")

_PRECISIONS = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}


class TensorState(eqx.Module):
    """Scaling state of one operand of an FP8 GEMM (input, kernel or output gradient).

    **Fields:**

    - `scale`: the scale used at the latest step; values are multiplied by it before the cast
      (Transformer Engine's convention; Flax stores `1 / scale`).
    - `amax_history`: recent amaxes, newest at index 0, the second newest at the end
      (Transformer Engine rolls by -1, then writes index 0).
    """

    scale: Float[Array, ""]
    amax_history: Float[Array, " history"]


class QTensor(eqx.Module):
    """An FP8 tensor and what turns it back into real values: `data * scale_inv`.

    `scale_inv` is a float32 scalar for per-tensor recipes; block recipes may give it a shape
    and record their layout in further fields.
    """

    data: Array
    scale_inv: Array


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}: should be one of {list(allowed)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe(abc.ABC):
    """Interface every scaling recipe implements. See the module docstring.

    `backward_precision` is the precision of the dgrad and wgrad dots: `"highest"` (the
    default) turns off cuBLASLt's fast FP8 accumulation on H100, as Transformer Engine does for
    gradients; `"default"` allows it. The forward dot uses the caller's `precision`.
    """

    backward_precision: str = "highest"

    def __post_init__(self) -> None:
        _check_choice("backward_precision", self.backward_precision, tuple(_PRECISIONS))

    def backward_dot_precision(self) -> lax.Precision:
        """`backward_precision` as a `lax.Precision`."""
        return _PRECISIONS[self.backward_precision]

    @abc.abstractmethod
    def format(self, role: Role) -> jnp.dtype:
        """The FP8 dtype of operand `role`."""

    @abc.abstractmethod
    def init_state(self, role: Role) -> TensorState:
        """Fresh state for operand `role`."""

    @abc.abstractmethod
    def scaling(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        """The scale to quantize `x` with now, and the state to keep for the next step.

        `state` holds float32 arrays. The new state must be a pure function of `state` and of
        the amax of `x` taken with [`fp8jax._src.amax.amax`][] (so that `vmap` and several
        uses of one layer combine by max).
        """

    @abc.abstractmethod
    def quantize(self, x: Array, scale: Array, role: Role, contracting: tuple[int, ...]) -> QTensor:
        """`x` as FP8, laid out for a GEMM contracting its axes `contracting`."""

    @abc.abstractmethod
    def retile(self, q: QTensor, contracting: tuple[int, ...]) -> QTensor:
        """`q` laid out for a GEMM contracting its axes `contracting` instead."""

    @abc.abstractmethod
    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        dimension_numbers: lax.DotDimensionNumbers,
        precision: lax.Precision | None,
    ) -> Float[Array, ...]:
        """The float32 result of `dot_general` on the real values of `lhs` and `rhs`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensorRecipe(Recipe):
    """Shared machinery of recipes with one scale per tensor.

    A GEMM is `dot_general(x8, w8, preferred_element_type=float32) * (1 / (sx * sw))`: real FP8
    operands reach `lax.dot_general`, which XLA's GPU compiler turns into an FP8 GEMM.
    """

    forward_format: FormatLike = "e4m3"
    backward_format: FormatLike = "e5m2"

    def __post_init__(self) -> None:
        super().__post_init__()
        fp8_dtype(self.forward_format)
        fp8_dtype(self.backward_format)

    def format(self, role: Role) -> jnp.dtype:
        return fp8_dtype(self.backward_format if role == "output_grad" else self.forward_format)

    def quantize(self, x: Array, scale: Array, role: Role, contracting: tuple[int, ...]) -> QTensor:
        del contracting
        return QTensor(quantize(x, scale, self.format(role)), 1.0 / scale)

    def retile(self, q: QTensor, contracting: tuple[int, ...]) -> QTensor:
        del contracting
        return q

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        dimension_numbers: lax.DotDimensionNumbers,
        precision: lax.Precision | None,
    ) -> Float[Array, ...]:
        out = lax.dot_general(
            lhs.data,
            rhs.data,
            dimension_numbers,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return out * (lhs.scale_inv * rhs.scale_inv)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling(PerTensorRecipe):
    """Per-tensor delayed scaling, as in Transformer Engine.

    The scale used at step `t` comes from the amax history *before* step `t`; the amax of
    step `t` then enters the history. With `amax = max(history)` (or `history[0]` for
    `amax_compute="most_recent"`):

    `scale = fp8_max / (amax * 2**margin)`, kept unchanged when `amax` is zero or not finite.

    **Arguments:**

    - `history_len`: amaxes remembered (default 1024).
    - `amax_compute`: `"max"` or `"most_recent"`.
    - `margin`: leave `2**margin` of headroom below the format's max.
    - `forward_format`: format of inputs and kernels (`"e4m3"`).
    - `backward_format`: format of output gradients (`"e5m2"`; `"e4m3"` is allowed).
    - `backward_precision`: precision of the dgrad and wgrad dots, `"highest"` (no fast
      accumulation on H100, as Transformer Engine does for gradients) or `"default"`.
    """

    history_len: int = 1024
    amax_compute: str = "max"
    margin: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len={self.history_len!r}: should be an int >= 1.")
        _check_choice("amax_compute", self.amax_compute, ("max", "most_recent"))

    def init_state(self, role: Role) -> TensorState:
        return TensorState(
            scale=jnp.ones((), jnp.float32),
            amax_history=jnp.zeros((self.history_len,), jnp.float32),
        )

    def scaling(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        history = state.amax_history
        if self.amax_compute == "max":
            ref = jnp.max(history, axis=-1)
        else:
            ref = history[..., 0]
        scale = compute_scale(ref, state.scale, fp8_max(self.format(role)), self.margin)
        new_amax = amax(x, state.scale)
        new_history = jnp.roll(history, -1, axis=-1).at[..., 0].set(new_amax)
        return scale, TensorState(scale, new_history)


def compute_scale(
    amax_value: Float[Array, ""],
    previous: Float[Array, ""],
    fmt_max: float,
    margin: float = 0.0,
) -> Float[Array, ""]:
    """`fmt_max / (amax * 2**margin)`, or `previous` where `amax` is zero or not finite.

    A scale that overflows float32 (a denormal amax) is clamped to float32's max.
    """
    fresh = (fmt_max / amax_value) / (2.0**margin)
    fresh = jnp.minimum(fresh, jnp.finfo(jnp.float32).max)
    ok = (amax_value > 0.0) & jnp.isfinite(amax_value)
    return jnp.where(ok, fresh, previous)


_RECIPES: dict[str, type[Recipe]] = {"delayed": DelayedScaling}


def recipe_from(spec: Recipe | str | None) -> Recipe:
    """A recipe instance from an instance, a name (`"delayed"`) or `None` (the default)."""
    if spec is None:
        return DelayedScaling()
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str) and spec in _RECIPES:
        return _RECIPES[spec]()
    raise ValueError(
        f"Unknown recipe {spec!r}: should be a fp8jax recipe instance or one of {sorted(_RECIPES)}."
    )

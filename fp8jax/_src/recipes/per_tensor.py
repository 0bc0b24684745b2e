"""Per-tensor recipes: one scale per operand, delayed (from a history) or current."""

from __future__ import annotations

import abc
import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from ..formats import fp8_max, quantize
from .base import Axis, HybridFormats, QTensor, Role, TensorState, check_choice, per_tensor_dot

#: The largest scale: its inverse, 2**-126, is float32's smallest normal number.
MAX_SCALE: float = 2.0**126


def compute_scale(
    amax_value: Float[Array, ""],
    previous: Float[Array, ""],
    fmt_max: float,
    margin: float = 0.0,
) -> Float[Array, ""]:
    """`fmt_max / (amax * 2**margin)`, or `previous` where `amax` is zero or not finite.

    A tiny amax would give a scale whose inverse is a subnormal float32, which XLA flushes to
    zero; scales are therefore capped at `2**126` (`MAX_SCALE`).
    """
    fresh = (fmt_max / amax_value) / (2.0**margin)
    fresh = jnp.minimum(fresh, MAX_SCALE)
    ok = (amax_value > 0.0) & jnp.isfinite(amax_value)
    return jnp.where(ok, fresh, previous)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensorRecipe(HybridFormats):
    """Shared machinery of recipes with one scale per tensor.

    A GEMM is `dot_general(x8, w8, preferred_element_type=float32) * (1 / (sx * sw))`: real FP8
    operands reach `lax.dot_general`, which XLA's GPU compiler turns into an FP8 GEMM.
    Subclasses say how the scale is chosen (`scale_for`).

    **Arguments:** `forward_format` (inputs and kernels, `"e4m3"`), `backward_format` (output
    gradients, `"e5m2"`; `"e4m3"` is allowed), and those of [`fp8jax.Recipe`][].
    """

    @abc.abstractmethod
    def scale_for(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        """The scale to quantize `x` with now, and the state to keep."""

    def quantize(
        self, x: Array, state: TensorState, role: Role, axis: Axis
    ) -> tuple[QTensor, TensorState]:
        del axis
        scale, new_state = self.scale_for(x, state, role)
        return QTensor(quantize(x, scale, self.format(role)), 1.0 / scale), new_state

    def retile(self, q: QTensor, role: Role, axis: Axis) -> QTensor:
        del role, axis
        return q

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        return per_tensor_dot(lhs, rhs, lhs_axis, rhs_axis, precision, out_dtype)


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
    - the formats and options of [`fp8jax.PerTensorRecipe`][].

    ```python
    recipe = fp8jax.DelayedScaling(history_len=16, amax_compute="most_recent")
    ```
    """

    history_len: int = 1024
    amax_compute: str = "max"
    margin: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len={self.history_len!r}: should be an int >= 1.")
        check_choice("amax_compute", self.amax_compute, ("max", "most_recent"))

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> TensorState:
        return TensorState(
            scale=jnp.ones((), jnp.float32),
            amax_history=jnp.zeros((self.history_len,), jnp.float32),
        )

    def scale_for(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        history = state.amax_history
        ref = jnp.max(history, axis=-1) if self.amax_compute == "max" else history[..., 0]
        scale = compute_scale(ref, state.scale, fp8_max(self.format(role)), self.margin)
        new_history = jnp.roll(history, -1, axis=-1).at[..., 0].set(self.amax(x, state.scale))
        return scale, TensorState(scale, new_history)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurrentScaling(PerTensorRecipe):
    """Per-tensor current scaling: each tensor is scaled by its own amax, in the same step.

    `scale = fp8_max / (amax * 2**margin)` (the previous scale where the amax is zero or not
    finite). The amax is global: under `jit` with sharded arrays XLA reduces across devices;
    inside `shard_map`, name the mesh axes in `axis_names` to get a `pmax`. Under
    `jax.vmap(model)(batch)` it spans the whole batch. The state keeps the latest scale and
    amax, for telemetry.

    **Arguments:** `margin`, and those of [`fp8jax.PerTensorRecipe`][].
    """

    margin: float = 0.0

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> TensorState:
        return TensorState(scale=jnp.ones((), jnp.float32), amax_history=jnp.zeros((1,)))

    def scale_for(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        current = self.amax(x, state.scale)
        scale = compute_scale(current, state.scale, fp8_max(self.format(role)), self.margin)
        return scale, TensorState(scale, state.amax_history.at[..., 0].set(current))

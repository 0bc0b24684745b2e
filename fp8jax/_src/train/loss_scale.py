"""Loss scaling for float16 training, as Equinox modules that pass through `jit` and `scan`.

float16 gradients underflow below 2**-24. Multiplying the loss by a large scale before the
backward pass lifts them into range; dividing the gradients by it afterwards restores them.
A [`fp8jax.DynamicLossScale`][] grows the scale while gradients stay finite and backs off when
they overflow (the JMP design). FP8 state ([`fp8jax.OverwriteWithGradient`][] modules) is never
scaled, unscaled or inspected: its "gradient" is its new value, not a derivative.

```python
def step(model, opt_state, loss_scale, batch):
    grads = fp8jax.filter_grad(lambda m: loss_scale.scale(loss_fn(m, batch)))(model)
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    grads = loss_scale.unscale(grads)
    finite = fp8jax.all_finite(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, model)
    new_model = fp8jax.apply_updates(model, updates, overwrites)
    model, opt_state = fp8jax.select_tree(
        finite, (new_model, new_opt_state), (model, opt_state)
    )   # skip the step when the gradients overflowed
    new_loss_scale = loss_scale.adjust(finite)
    # Delayed scaling's gradient histories follow the loss scale.
    ratio = new_loss_scale.loss_scale / loss_scale.loss_scale
    model = fp8jax.rescale_gradient_states(model, ratio)
    return model, opt_state, new_loss_scale
```
"""

# No `from __future__ import annotations`: Equinox reads the AbstractVar annotation.
import abc
import math
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from ..core.updates import haliax_fp8_op, is_fp8_state
from ..ops.base import AbstractFp8Op, checked_ratio, received_finite, rescaled_gradient_state
from ..recipes import ResidualState, TensorState
from .select import select_tree as select_tree

T = TypeVar("T")
L = TypeVar("L", bound="LossScale")

_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
# float32's smallest normal, 2**-126: a smaller scale is 0 in float32, or a subnormal that
# CPUs and TPUs flush to 0 (the loss scaled to 0, the gradients unscaled to NaN).
_F32_TINY = float(np.finfo(np.float32).tiny)
_TINY_WHY = "2**-126, float32's smallest normal number; smaller ones are 0 on CPUs and TPUs"


def _is_inexact_array(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _map_inexact(f: Any, tree: T) -> T:
    """`f` applied to the floating-point (and complex) array leaves of `tree`; FP8 state and
    every other leaf are returned as they are."""

    def apply(x: Any) -> Any:
        if is_fp8_state(x) or not _is_inexact_array(x):
            return x
        return f(x)

    return jax.tree.map(apply, tree, is_leaf=is_fp8_state)


def _multiply(tree: T, *factors: Float[Array, ""]) -> T:
    """Each inexact leaf times each of `factors` in turn, computed in at least float32, cast
    back to its dtype once."""

    def mul(x: Array) -> Array:
        dtype = jnp.promote_types(x.dtype, jnp.float32)
        out = jnp.asarray(x, dtype)
        for factor in factors:
            out = out * factor.astype(dtype)
        return out.astype(x.dtype)

    return _map_inexact(mul, tree)


def _flag(grads_finite: ArrayLike, who: str) -> Bool[Array, ""]:
    try:
        flag = jnp.asarray(grads_finite)
    except (TypeError, ValueError):
        raise TypeError(
            f"{who}.adjust: grads_finite={grads_finite!r} should be a boolean scalar, e.g. "
            "fp8jax.all_finite(grads)."
        ) from None
    if flag.dtype != jnp.bool_ or flag.shape != ():
        raise TypeError(
            f"{who}.adjust: grads_finite has dtype {flag.dtype} and shape {flag.shape}; it should "
            "be a boolean scalar, e.g. fp8jax.all_finite(grads)."
        )
    return flag


def _number(name: str, value: Any, who: str) -> float | None:
    """`value` as a Python float, or `None` if it is traced (it cannot be checked then)."""
    if isinstance(value, bool | str | bytes) or jnp.shape(value) != ():
        raise TypeError(f"{who}: {name}={value!r} should be a real number.")
    try:
        out = float(value)
    except jax.errors.ConcretizationTypeError:
        return None
    except (TypeError, ValueError):
        raise TypeError(f"{who}: {name}={value!r} should be a real number.") from None
    if not math.isfinite(out) or abs(out) > _F32_MAX:
        raise ValueError(f"{who}: {name}={value!r} should be finite in float32.")
    return out


class LossScale(eqx.Module):
    """Interface of the loss scales: scale the loss, unscale the gradients, adjust.

    Subclasses hold `loss_scale`, a float32 scalar array, and define `adjust`. `scale` and
    `unscale` act on the floating-point array leaves of a pytree only, each computed in at least
    float32 and cast back to the leaf's dtype; FP8 state ([`fp8jax.OverwriteWithGradient`][]
    modules, an NNX gradient's [`fp8jax.Fp8State`][] entries), integer arrays, `None` and
    non-array leaves are returned as they are.

    ```python
    scaled_loss = loss_scale.scale(loss)
    grads = loss_scale.unscale(grads)
    loss_scale = loss_scale.adjust(fp8jax.all_finite(grads))
    ```
    """

    loss_scale: eqx.AbstractVar[Float[Array, ""]]

    def scale(self, tree: T) -> T:
        """`tree` (usually the loss) multiplied by the loss scale, each leaf in its dtype. A
        float16 loss's gradient is the scale in float16: inf past 65504 (a bfloat16 loss's, the
        scale rounded to 8 bits); scale a float32 loss.

        ```python
        grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params)
        ```
        """
        return _multiply(tree, jnp.asarray(self.loss_scale, jnp.float32))

    def unscale(self, tree: T) -> T:
        """`tree` (usually the gradients) divided by the loss scale, each leaf in its dtype.

        Multiplies by `1 / loss_scale` computed in float32 (exact for the power-of-two scales
        [`fp8jax.DynamicLossScale`][] uses), so a float16 gradient is not rounded twice. Past
        2**64 it multiplies by 2**-64 and then by `2**64 / loss_scale` (the same product): the
        inverse of a scale past 2**126 is a float32 subnormal, which CPUs and TPUs flush to 0.

        ```python
        grads = loss_scale.unscale(grads)
        ```
        """
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        big = scale > 2.0**64
        first = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
        return _multiply(tree, first, 1.0 / (scale * first))

    @abc.abstractmethod
    def adjust(self: L, grads_finite: Bool[ArrayLike, ""]) -> L:
        """The loss scale for the next step, given whether this step's gradients were finite.
        A scale that never changes returns itself: [`fp8jax.make_train_step`][] then leaves
        delayed scaling's gradient histories as they are ([`fp8jax.rescale_gradient_states`][]).

        ```python
        loss_scale = loss_scale.adjust(fp8jax.all_finite(grads))
        ```
        """


class NoOpLossScale(LossScale):
    """No loss scaling: `scale` and `unscale` return the tree unchanged (not even cast).

    Use it where the code path expects a loss scale but the model trains in float32 or
    bfloat16, whose exponent range needs none.

    ```python
    loss_scale = fp8jax.NoOpLossScale()
    assert loss_scale.unscale(grads) is grads
    ```
    """

    @property
    def loss_scale(self) -> Float[Array, ""]:
        """1.0: nothing is scaled."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        """`tree` as it is."""
        return tree

    def unscale(self, tree: T) -> T:
        """`tree` as it is."""
        return tree

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "NoOpLossScale":
        """Itself: the scale never changes (`grads_finite` checked all the same)."""
        _flag(grads_finite, "NoOpLossScale")
        return self


class StaticLossScale(LossScale):
    """A constant loss scale.

    **Arguments:**

    - `loss_scale`: a number from 2**-126 (float32's smallest normal) to float32's max;
      powers of two scale exactly.

    ```python
    loss_scale = fp8jax.StaticLossScale(2.0**12)
    ```
    """

    loss_scale: Float[Array, ""]

    def __init__(self, loss_scale: float | Float[ArrayLike, ""]):
        value = _number("loss_scale", loss_scale, "StaticLossScale")
        if value is not None and value <= 0:
            raise ValueError(f"StaticLossScale: loss_scale={loss_scale!r} should be positive.")
        if value is not None and value < _F32_TINY:
            raise ValueError(
                f"StaticLossScale: loss_scale={loss_scale!r} should be at least {_TINY_WHY}."
            )
        self.loss_scale = jnp.asarray(loss_scale, jnp.float32)

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "StaticLossScale":
        """Itself: a static scale never changes (`grads_finite` checked all the same)."""
        _flag(grads_finite, "StaticLossScale")
        return self


class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off when they overflow.

    After `period` consecutive finite steps the scale is multiplied by `factor` (unless that
    would overflow float32; the count restarts either way). A step with non-finite gradients
    multiplies it by `backoff`, never below `min_loss_scale`, restarts the count and is counted
    in `skipped_steps`. Everything is a JAX array, so `adjust` needs no host sync and the module
    can be a `jit` argument or a `lax.scan` carry.

    **Arguments:**

    - `loss_scale`: the initial scale, at least `min_loss_scale`.
    - `period`: finite steps between growths, an integer >= 1.
    - `factor`: the growth factor, > 1 (in float32, which the scale is computed in).
    - `backoff`: the factor applied on overflow, in (0, 1) (in float32).
    - `min_loss_scale`: the floor of the scale, at least 2**-126 (float32's smallest normal).

    **Fields:** `loss_scale` (float32), and int32 counters: `counter` (finite steps since the
    last growth or backoff), `skipped_steps` (steps with non-finite gradients) and `total_steps`.
    The configuration is static.

    ```python
    loss_scale = fp8jax.DynamicLossScale(period=1000)
    loss_scale = loss_scale.adjust(fp8jax.all_finite(grads))
    ```
    """

    loss_scale: Float[Array, ""]
    counter: Int[Array, ""]
    skipped_steps: Int[Array, ""]
    total_steps: Int[Array, ""]
    period: int = eqx.field(static=True)
    factor: float = eqx.field(static=True)
    backoff: float = eqx.field(static=True)
    min_loss_scale: float = eqx.field(static=True)

    def __init__(
        self,
        loss_scale: float | Float[ArrayLike, ""] = 2.0**15,
        period: int = 2000,
        factor: float = 2.0,
        backoff: float = 0.5,
        min_loss_scale: float = 1.0,
    ):
        who = "DynamicLossScale"
        if (
            isinstance(period, bool)
            or not isinstance(period, int | np.integer)
            or not 1 <= period <= _INT32_MAX
        ):
            # The step counter is an int32 array: a larger period could never be reached.
            raise ValueError(
                f"{who}: period={period!r} should be an integer >= 1 and <= {_INT32_MAX} "
                "(the step counter is int32)."
            )
        # Compared in float32, which the scale is multiplied in: 1 + 1e-9 is 1 there.
        factor_ = _number("factor", factor, who)
        if factor_ is None or np.float32(factor_) <= 1:
            raise ValueError(f"{who}: factor={factor!r} should be a number > 1 in float32.")
        backoff_ = _number("backoff", backoff, who)
        if backoff_ is None or not 0 < np.float32(backoff_) < 1:
            raise ValueError(f"{who}: backoff={backoff!r} should be a number in (0, 1) in float32.")
        min_ = _number("min_loss_scale", min_loss_scale, who)
        if min_ is None or min_ <= 0:
            raise ValueError(f"{who}: min_loss_scale={min_loss_scale!r} should be a number > 0.")
        if min_ < _F32_TINY:
            raise ValueError(
                f"{who}: min_loss_scale={min_loss_scale!r} should be at least {_TINY_WHY}."
            )
        initial = _number("loss_scale", loss_scale, who)
        if initial is not None and initial < min_:
            raise ValueError(
                f"{who}: loss_scale={loss_scale!r} should be at least "
                f"min_loss_scale={min_loss_scale!r}."
            )
        self.period = int(period)
        self.factor = factor_
        self.backoff = backoff_
        self.min_loss_scale = min_
        self.loss_scale = jnp.asarray(loss_scale, jnp.float32)
        self.counter = jnp.zeros((), jnp.int32)
        self.skipped_steps = jnp.zeros((), jnp.int32)
        self.total_steps = jnp.zeros((), jnp.int32)

    def adjust(self, grads_finite: Bool[ArrayLike, ""]) -> "DynamicLossScale":
        """The scale grown after `period` finite steps or backed off after a non-finite one."""
        finite = _flag(grads_finite, "DynamicLossScale")
        counter = self.counter + 1
        grow = counter >= self.period
        grown = self.loss_scale * self.factor
        kept = jnp.where(grow & jnp.isfinite(grown), grown, self.loss_scale)
        backed_off = jnp.maximum(self.loss_scale * self.backoff, self.min_loss_scale)
        return eqx.tree_at(
            lambda s: (s.loss_scale, s.counter, s.skipped_steps, s.total_steps),
            self,
            (
                jnp.where(finite, kept, backed_off).astype(jnp.float32),
                jnp.where(finite & ~grow, counter, 0).astype(jnp.int32),
                self.skipped_steps + (~finite).astype(jnp.int32),
                self.total_steps + 1,
            ),
        )

    @property
    def overflow_rate(self) -> Float[Array, ""]:
        """The fraction of steps so far whose gradients were not finite (0 before any step).

        ```python
        print(f"skipped {float(loss_scale.overflow_rate):.1%} of steps")
        ```
        """
        total = jnp.maximum(self.total_steps, 1).astype(jnp.float32)
        return self.skipped_steps.astype(jnp.float32) / total


def rescale_gradient_states(tree: T, ratio: Float[ArrayLike, ""]) -> T:
    """`tree` with each layer's output-gradient state as if its recorded gradients had been
    `ratio` times as large: the amax history times `ratio`, and the scale computed again from
    it (delayed scaling's: the scale the next step uses, as the layer's merge computes it).

    A loss scale multiplies every output gradient, and delayed scaling's history records them
    scaled. When a [`fp8jax.DynamicLossScale`][] grows (x2), the next step's gradients would be
    twice what the history allows and the largest would saturate for that step; after a
    backoff they would use a scale one bit short until the history forgets. Call this with
    `new_loss_scale / old_loss_scale` when the scale changes ([`fp8jax.make_train_step`][]
    does). Current scaling, the block recipes and ResidualFP8 scale each step's gradients by
    their own amax, which their state only records: rescaled, it is in the new loss scale's
    units, so that [`fp8jax.report`][] given that scale prints the latest step's gradients
    (it printed them divided by the ratio). Unrecorded states are left as they are (a scale
    of 0 stays 0: the warm start still waits).

    **Arguments:**

    - `tree`: an Equinox model, a Flax Linen model's variables, or any pytree holding
      [`fp8jax.Fp8DotGeneral`][] and [`fp8jax.Fp8RaggedDot`][] layers (stacked ones too), or
      Haliax's own (`haliax.quantization.Fp8DotGeneralOp`: its history times `ratio`, its
      scale Haliax's next from it, `history max / e5m2 max`). A Flax NNX model is refused
      (`TypeError`; use [`fp8jax.nnx_rescale_gradient_states`][]): its layers hold
      `nnx.Variable`s, and its `nnx.state` holds arrays, not layers (nothing is found).
    - `ratio`: a positive, finite float32 scalar; 1 changes nothing (bit for bit). Any
      other value raises `ValueError`, or, traced (inside `jit`), changes nothing.

    ```python
    new_loss_scale = loss_scale.adjust(finite)
    ratio = new_loss_scale.loss_scale / loss_scale.loss_scale
    model = fp8jax.rescale_gradient_states(model, ratio)
    ```
    """
    ratio, keep = checked_ratio(ratio, "rescale_gradient_states")
    kinds = (AbstractFp8Op, *haliax_fp8_op())

    def rescale(op: Any) -> Any:
        state = op.output_grad if isinstance(op, AbstractFp8Op) else None
        if isinstance(state, TensorState | ResidualState) and not eqx.is_array(state.amax_history):
            # An NNX model's layers hold their arrays in `nnx.Variable`s.
            raise TypeError(
                f"rescale_gradient_states: layer {op.name!r} holds its state in "
                f"{type(state.amax_history).__name__}s, not arrays (a Flax NNX "
                "model?); it takes Equinox models and Flax Linen variables. For an NNX "
                "model, fp8jax.nnx_rescale_gradient_states(model, ratio) rescales in place."
            )
        return rescaled_gradient_state(op, ratio, keep) if isinstance(op, kinds) else op

    return jax.tree.map(rescale, tree, is_leaf=lambda x: isinstance(x, kinds))


def all_finite(tree: Any) -> Bool[Array, ""]:
    """Whether every floating-point array leaf of `tree` is finite (no inf, no NaN).

    FP8 state ([`fp8jax.OverwriteWithGradient`][] modules, NNX's [`fp8jax.Fp8State`][]
    entries) is not inspected: what it receives
    through the gradient is a state, not a derivative, and its `merge` decides what to keep.
    Integer arrays, `None` and non-array leaves are skipped; an empty tree is finite.

    **Returns:** a boolean scalar array (no host sync; usable under `jit`).

    ```python
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    finite = fp8jax.all_finite(grads)
    ```
    """
    leaves = [
        x
        for x in jax.tree.leaves(tree, is_leaf=is_fp8_state)
        if not is_fp8_state(x) and _is_inexact_array(x)
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


#: FP8 state leaves up to this size are checked together by `states_finite`.
SMALL_STATE = 1 << 16


def states_finite(states: Any) -> Bool[Array, ""]:
    """Whether every floating-point array leaf of `states` (the new FP8 state a step
    received: `partition_for_grad_overwrite`'s first output) holds no NaN and no +inf: the
    small ones (scales, amax histories, telemetry) checked by one reduction over their
    concatenation, one kernel where a reduction each took one or two per leaf; larger ones
    (an error-feedback state shaped like its kernel) each alone. -inf, what a layer in a
    `lax.cond` branch not taken receives (the max-combining zero: nothing received), is no
    overflow: a step skipped on it would skip every step that branch is not taken."""
    leaves = [x for x in jax.tree.leaves(states) if _is_inexact_array(x)]
    small = [jnp.ravel(x) for x in leaves if x.size <= SMALL_STATE]
    rest = [x for x in leaves if x.size > SMALL_STATE]
    if small:
        dtype = jnp.result_type(*small)
        rest.append(jnp.concatenate([x.astype(dtype) for x in small]))
    if not rest:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(received_finite(x)) for x in rest]))

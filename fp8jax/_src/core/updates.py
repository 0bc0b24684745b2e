"""State that leaves the step through the gradient, and how optax updates coexist with it.

A module marked [`fp8jax.OverwriteWithGradient`][] receives, as its "gradient", its own new
value. [`fp8jax.partition_for_grad_overwrite`][] splits those modules out of a gradient tree
before the optimizer sees it (so they are never clipped, decayed, scaled or cast), and
[`fp8jax.apply_updates`][] writes them back after the optimizer's update:

```python
overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
updates, opt_state = optimizer.update(grads, opt_state, params)
model = fp8jax.apply_updates(model, updates, overwrites)
```
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

T = TypeVar("T")


class OverwriteWithGradient(eqx.Module):
    """Marker for state whose gradient *is* its new value, to overwrite rather than add.

    Subclasses may override [`fp8jax.OverwriteWithGradient.merge`][] to decide, leaf by leaf,
    whether a received value is taken, and
    [`merge_many`][fp8jax.OverwriteWithGradient.merge_many] to merge many modules at once.
    Abstract: only subclasses are made.

    Inside [`fp8jax.filter_value_and_grad`][] a subclass's floating arrays are viewed in a
    dtype whose cotangents combine by max (as FP8 state's), on which JAX's arithmetic and
    slices fail: read one as `jax.lax.stop_gradient(x.astype(jnp.float32))`. Its gradient is
    then zero, and the default `merge` takes it: a subclass whose state the gradient does not
    move overrides `merge` to keep its own.
    """

    def __check_init__(self) -> None:
        if type(self) is OverwriteWithGradient:
            raise TypeError(
                "OverwriteWithGradient is an abstract marker: subclass it (an eqx.Module "
                "holding the state whose gradient is its new value) and make the subclass."
            )

    def merge(self: T, new: T) -> T:
        """The state to keep, given the value `new` received through the gradient."""
        return new

    @classmethod
    def merge_many(cls, pairs: list[tuple[Any, Any]]) -> list[Any]:
        """`[old.merge(new) for old, new in pairs]`, the modules all of this class: a
        subclass may merge many modules' state at once (in a few kernels, not a few per
        module)."""
        return [old.merge(new) for old, new in pairs]


def _haliax_type(name: str) -> tuple[type, ...]:
    """`haliax.quantization.<name>` as an `isinstance` tuple if haliax is imported (empty
    otherwise): looked up, never imported."""
    found = getattr(sys.modules.get("haliax.quantization"), name, None)
    return (found,) if isinstance(found, type) else ()


def _foreign_markers() -> tuple[type, ...]:
    """Other libraries' markers of state that the gradient overwrites: Haliax's (its own FP8
    and int8 `dot_general`s, which a model converted by fp8jax keeps)."""
    return _haliax_type("OverwriteWithGradient")


def haliax_fp8_op() -> tuple[type, ...]:
    """Haliax's own FP8 op (`haliax.quantization.Fp8DotGeneralOp`) if haliax is imported, as
    an `isinstance` tuple (empty otherwise)."""
    return _haliax_type("Fp8DotGeneralOp")


def is_overwrite(x: Any) -> bool:
    """Whether `x` is FP8 state that the gradient overwrites (a pytree `is_leaf` test):
    fp8jax's, or Haliax's own (`haliax.quantization.OverwriteWithGradient`)."""
    return isinstance(x, (OverwriteWithGradient, *_foreign_markers()))


#: Variable types of other frameworks holding fp8jax's FP8 state (NNX's `Fp8State`),
#: registered by their adapter (`register_state_variable`).
_STATE_VARIABLES: list[type] = []


def register_state_variable(cls: type) -> type:
    """Mark `cls`, a framework's variable type holding FP8 state, as `is_fp8_state`'s (a
    class decorator): loss scaling leaves its values alone in a gradient tree."""
    _STATE_VARIABLES.append(cls)
    return cls


def is_fp8_state(x: Any) -> bool:
    """Whether `x` is FP8 state: an `is_overwrite` module, or a registered variable holding
    some (an NNX `Fp8State` in a gradient `nnx.State`), whose values are new states."""
    return is_overwrite(x) or isinstance(x, tuple(_STATE_VARIABLES))


def partition_for_grad_overwrite(tree: T) -> tuple[T, T]:
    """Split `tree` into `(overwrites, rest)`: the [`fp8jax.OverwriteWithGradient`][]
    modules (and Haliax's own, of a layer quantized by `haliax.quantization`), and
    everything else, each with `None` where the other has a value.

    Apply it to the gradients (to keep FP8 state away from the optimizer) and to the model (to
    initialise the optimizer on the trainable part only, which optax >= 0.2.7 requires).

    ```python
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    ```
    """
    return eqx.partition(tree, is_overwrite, is_leaf=is_overwrite)


def with_fp8_state(filter_spec: Any, model: T) -> T:
    """`filter_spec` extended to the FP8 state of `model`: a tree of bools shaped like
    `model`, `True` where `filter_spec` selects a leaf or the leaf belongs to an
    [`fp8jax.OverwriteWithGradient`][] module.

    Fine-tuning code often differentiates only part of a model, chosen by an Equinox filter
    spec. FP8 state must be differentiated too: its new value leaves the step as its
    gradient, and a layer with delayed scaling whose state is left out raises rather than
    keep its scales at their initial value forever; one left out whole, through which no
    gradient flows (a frozen first layer), cannot raise, and records nothing without it.
    Pass the result wherever the spec went.

    **Arguments:**

    - `filter_spec`: anything `eqx.partition(model, filter_spec)` accepts (a bool, a
      callable such as `eqx.is_inexact_array`, or a tree of them).
    - `model`: the model the spec is for.

    ```python
    spec = eqx.tree_at(lambda m: m.head.weight, jax.tree.map(lambda _: False, model), True)
    diff, static = eqx.partition(model, fp8jax.with_fp8_state(spec, model))
    ```
    """
    chosen, _ = eqx.partition(model, filter_spec)
    overwrites, _ = partition_for_grad_overwrite(model)

    def flag(picked: Any, state: Any) -> bool:
        return picked is not None or eqx.is_inexact_array(state)

    return jax.tree.map(flag, chosen, overwrites, is_leaf=lambda x: x is None)


def apply_updates(model: T, updates: Any, overwrites: Any) -> T:
    """`eqx.apply_updates(model, updates)`, with FP8 state replaced by `overwrites`.

    **Arguments:**

    - `model`: the model, FP8 state included.
    - `updates`: the optimizer's updates, `None` at FP8 state (as `partition_for_grad_overwrite`
      leaves the gradients); or `None` altogether to take only the new FP8 state.
    - `overwrites`: the first output of `partition_for_grad_overwrite(grads)`.

    **Returns:** the updated model. Each FP8 module decides through its `merge` which received
    values it takes: an `Fp8DotGeneral` that got no gradient this step (unused, or its output
    cut off by `stop_gradient`) keeps its state. The modules of one class are merged together
    (their class's `merge_many`), so that XLA writes every layer's state in a few kernels.
    """

    if updates is None:
        updates = jax.tree.map(lambda _: None, model, is_leaf=is_overwrite)

    def is_leaf(x: Any) -> bool:
        return x is None or is_overwrite(x)

    def received(leaf: Any, over: Any) -> Any:
        # A module whose state was not differentiated (a filter spec without
        # `with_fp8_state`) comes back holding no array: nothing received. One with part of
        # it (a filter spec naming some roles) gets a zero there, as a role that got no
        # gradient, which its merge keeps.
        if not isinstance(leaf, OverwriteWithGradient) or over is None:
            return over
        if not any(map(eqx.is_array, jax.tree.leaves(over))):
            return None
        return jax.tree.map(
            lambda o, n: jnp.zeros_like(o) if n is None and eqx.is_array(o) else n, leaf, over
        )

    overwrites = jax.tree.map(received, model, overwrites, is_leaf=is_leaf)

    # Every received module merged up front, those of one class together (`merge_many`),
    # then handed out in the order the tree is walked.
    pairs: dict[type, list[tuple[Any, Any]]] = {}

    def collect(leaf: Any, over: Any) -> None:
        if isinstance(leaf, OverwriteWithGradient) and over is not None:
            pairs.setdefault(type(leaf), []).append((leaf, over))

    jax.tree.map(collect, model, overwrites, is_leaf=is_leaf)
    merged = {cls: iter(cls.merge_many(group)) for cls, group in pairs.items()}

    def update(leaf: Any, upd: Any, over: Any) -> Any:
        if isinstance(leaf, OverwriteWithGradient):
            return leaf if over is None else next(merged[type(leaf)])
        if is_overwrite(leaf):  # Haliax's: the received value, as Haliax's apply_updates
            return leaf if over is None else over
        if over is not None:
            raise ValueError(
                f"overwrites has a value where the model has {type(leaf).__name__}, not an "
                "OverwriteWithGradient module: pass the first output of "
                "partition_for_grad_overwrite(grads)."
            )
        return eqx.apply_updates(leaf, upd)

    return jax.tree.map(update, model, updates, overwrites, is_leaf=is_leaf)

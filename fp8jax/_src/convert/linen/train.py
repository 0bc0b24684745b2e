"""Training FP8 Flax Linen models: [`fp8jax.LinenTrainState`][], Flax's `TrainState` whose
`apply_gradients` merges the new FP8 state instead of overwriting it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from ...core.updates import apply_updates, is_overwrite, partition_for_grad_overwrite
from .convert import COLLECTION


class LinenTrainState(train_state.TrainState):
    """Flax's `TrainState` for an [`fp8jax.Fp8Linen`][] model: `params` holds the whole
    variables (`"params"` and the FP8 state), the optimizer sees only `"params"`.

    `create` initialises the optimizer on `params["params"]`, as Flax's `TrainState` does
    for its FP8 ops. `apply_gradients(grads=...)` updates `"params"` with the optimizer and
    takes the FP8 state from the gradient through each layer's
    [`merge`][fp8jax.Fp8DotGeneral.merge]: a layer that did not run this step, or whose
    operand held an inf or NaN, keeps its state (Flax's `TrainState` would overwrite it with
    the zero or non-finite gradient). The arrays that Flax's own FP8 ops keep in the same
    collection (a layer with `Fp8DirectDotGeneralOp`, excluded from the conversion) take
    their gradient as their new value, as Flax's `TrainState` does. Other collections are
    left as they are. Without FP8 state (a model trained in BF16 beside the FP8 one), it is
    Flax's `TrainState`.

    ```python
    state = fp8jax.LinenTrainState.create(apply_fn=fp8_model.apply, params=variables, tx=tx)
    loss, grads = fp8jax.filter_value_and_grad(loss_fn)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    ```
    """

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> LinenTrainState:
        """Flax's `create`, with `step` a 0-d int32 array, not the Python int 0: the orbax
        backend of [`fp8jax.save_checkpoint`][] saves no Python number, and a state stepped
        outside `jit` (where `step` stays an int) would resume at step 0."""
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        return state.replace(step=jnp.zeros((), jnp.int32))

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> LinenTrainState:
        """The state after one step of `grads` (the gradients of `params`, FP8 state
        included), `step` advanced; `kwargs` replace other fields."""
        if not isinstance(self.params, Mapping) or COLLECTION not in self.params:
            return super().apply_gradients(grads=grads, **kwargs)  # no FP8 state: Flax's
        if not isinstance(grads, Mapping) or COLLECTION not in grads or "params" not in grads:
            raise ValueError(
                f"LinenTrainState.apply_gradients: grads should hold 'params' and {COLLECTION!r} "
                "(the gradients of the whole variables); got "
                f"{sorted(grads) if isinstance(grads, Mapping) else type(grads).__name__}."
            )
        updates, opt_state = self.tx.update(grads["params"], self.opt_state, self.params["params"])
        params = dict(self.params)
        params["params"] = optax.apply_updates(self.params["params"], updates)
        ours, flaxs = partition_for_grad_overwrite(grads[COLLECTION])
        merged = apply_updates(self.params[COLLECTION], None, ours)
        # Flax's FP8 ops' arrays (None in `ours`): their gradient is their new value.
        params[COLLECTION] = jax.tree.map(
            lambda new, flax: new if flax is None else flax,
            merged,
            flaxs,
            is_leaf=lambda x: x is None or is_overwrite(x),
        )
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)

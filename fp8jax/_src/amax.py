"""The amax of a tensor, taken over every axis its FP8 state is shared across.

The usual Equinox call is `jax.vmap(model)(batch)`: each example sees one row, while the FP8
state (unbatched) belongs to the whole batch. Left alone, JAX would give each row its own amax
and then *sum* the state's cotangent over the mapped axis. `amax` has a custom batching rule:
when the state it belongs to is not batched, it reduces over the mapped axis too and returns an
unbatched result, so the state sees the batch-wide max, exactly as without `vmap`. When the
state is batched (a `vmap` over an ensemble or over stacked layers), each member keeps its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float


def _amax(x: Array, owner: Array) -> Array:
    del owner
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


@custom_vmap
def amax(x: Float[Array, "*shape"], owner: Float[Array, "*shape"]) -> Float[Array, ""]:
    """`max(|x|)` in float32, batch-wide under `vmap` unless `owner` is batched.

    **Arguments:**

    - `x`: any floating array.
    - `owner`: a leaf of the FP8 state the amax is for. Only whether it is batched matters.
    """
    return _amax(x, owner)


@amax.def_vmap
def _amax_vmap(axis_size, in_batched, x, owner):
    x_batched, owner_batched = in_batched
    if owner_batched:
        in_axes = (0 if x_batched else None, 0)
        # Each member of the mapped axis has its own state. (`_amax`, not `amax`: vmapping the
        # custom_vmap function itself would call this rule again.)
        return jax.vmap(_amax, in_axes=in_axes)(x, owner), True
    # The state is shared by every member of the mapped axis: reduce over it as well.
    return amax(x, owner), False

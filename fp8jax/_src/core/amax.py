"""The amax of a tensor, taken over every axis its FP8 state is shared across.

The usual Equinox call is `jax.vmap(model)(batch)`: each example sees one row, while the FP8
state (unbatched) belongs to the whole batch. Left alone, JAX would give each row its own amax
and then *sum* the state's cotangent over the mapped axis. `amax` has a custom batching rule:
when the state it belongs to is not batched, it reduces over the mapped axis too and returns an
unbatched result, so the state sees the batch-wide max, exactly as without `vmap`. When the
state is batched (a `vmap` over an ensemble or over stacked layers), each member keeps its own.
`fraction` (telemetry's saturation and underflow rates) follows the same rule.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Bool, Float


def _shared_reduction(reduce: Callable[[Array], Array], doc: str) -> Callable[..., Array]:
    """`reduce(x)` as `f(x, owner)`, reducing over a `vmap`ped axis too unless `owner` (a leaf
    of the FP8 state the result is for; only whether it is batched matters) is batched."""

    def plain(x: Array, owner: Array) -> Array:
        del owner
        return reduce(x)

    @custom_vmap
    def shared(x: Array, owner: Array) -> Array:
        return plain(x, owner)

    @shared.def_vmap
    def _rule(axis_size, in_batched, x, owner):
        x_batched, owner_batched = in_batched
        if owner_batched:
            # Each member of the mapped axis has its own state. (`plain`, not `shared`:
            # vmapping the custom_vmap function itself would call this rule again.)
            return jax.vmap(plain, in_axes=(0 if x_batched else None, 0))(x, owner), True
        # The state is shared by every member of the mapped axis: reduce over it as well.
        return shared(x, owner), False

    shared.__doc__ = doc
    return shared


amax: Callable[[Float[Array, "*shape"], Array], Float[Array, ""]] = _shared_reduction(
    lambda x: jnp.max(jnp.abs(x), initial=0.0).astype(jnp.float32),
    """`max(|x|)` in float32 (0 for an empty `x`), batch-wide under `vmap` unless `owner` is
    batched.

    Reduced in `x`'s own dtype (exact: `abs` and `max` do not round) and widened afterwards:
    widening a BF16 `x` first would let XLA read the float32 value it was rounded from (see
    `fp8jax._src.core.formats.widen`), a float32 intermediate of twice the bytes.

    **Arguments:**

    - `x`: any floating array.
    - `owner`: a leaf of the FP8 state the amax is for. Only whether it is batched matters.
    """,
)

fraction: Callable[[Bool[Array, "*shape"], Array], Float[Array, ""]] = _shared_reduction(
    lambda mask: jnp.sum(mask.astype(jnp.float32)) / max(mask.size, 1),
    """The fraction of `mask` that is true (0 for an empty `mask`), batch-wide under `vmap`
    unless `owner` is batched (every member holds as many elements, so that is the mean over
    all of them). The telemetry
    counterpart of `amax`: a statistic of FP8 state describes the whole batch it belongs to.
    """,
)

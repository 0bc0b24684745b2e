"""Reductions that span every axis the FP8 state they are for is shared across.

The usual Equinox call is `jax.vmap(model)(batch)`: each example sees one row, while the FP8
state (unbatched) belongs to the whole batch. Left alone, JAX would give each row its own amax
and then *sum* the state's cotangent over the mapped axis. `batch_shared` gives a reduction a
custom batching rule: when the state it belongs to is not batched, it spans the mapped axis
too and returns an unbatched result, so the state sees the batch-wide value, exactly as
without `vmap`. When the state is batched (a `vmap` over an ensemble or over stacked layers),
each member keeps its own. `amax`, `fraction` (telemetry's saturation and underflow rates)
and the grouped GEMM's per-expert token counts are such reductions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Bool, Float

from .formats import within_float32


def owner(state: Any) -> Array:
    """A leaf of FP8 `state`: what tells a `batch_shared` reduction whose batch it spans."""
    return jax.tree.leaves(state)[0]


def batch_shared(
    reduce: Callable[[Array], Array],
    doc: str,
    combine: Callable[[Array], Array] | None = None,
) -> Callable[[Array, Array], Array]:
    """`reduce(x)` as `f(x, owner)`, spanning a `vmap`ped axis of `x` too unless `owner` (a
    leaf of the FP8 state the result is for; only whether it is batched matters) is batched.

    `combine` folds the mapped axis (leading) of `x` first; without it, `reduce` spans it
    (a reduction over every axis). `reduce` may return several results (a tuple or any
    pytree of arrays): each is batched as the one would be."""

    def plain(x: Array, owner: Array) -> Array:
        del owner
        return reduce(x)

    @custom_vmap
    def shared(x: Array, owner: Array) -> Array:
        return plain(x, owner)

    @shared.def_vmap
    def _rule(axis_size, in_batched, x, owner):
        del axis_size
        x_batched, owner_batched = in_batched
        if owner_batched:
            # Each member of the mapped axis has its own state. (`plain`, not `shared`:
            # vmapping the custom_vmap function itself would call this rule again.)
            out = jax.vmap(plain, in_axes=(0 if x_batched else None, 0))(x, owner)
            return out, jax.tree.map(lambda _: True, out)
        # The state is shared by every member of the mapped axis: reduce over it as well.
        if x_batched and combine is not None:
            x = combine(x)
        out = shared(x, owner)
        return out, jax.tree.map(lambda _: False, out)

    shared.__doc__ = doc
    return shared


def local_amax(x: Float[Array, "*shape"]) -> Float[Array, ""]:
    """`max(|x|)` in float32 (0 for an empty `x`) of this call's `x` alone: `amax`'s
    reduction without the spans over a batch or mesh axes (`fp8jax.Recipe.amax` adds them),
    for the XLA twins of kernels that return a tensor's amax. A finite float64 `x` beyond
    float32's range gives float32's max, not inf (a fault): `quantize` saturates it."""
    return within_float32(jnp.max(jnp.abs(x), initial=0.0), jnp).astype(jnp.float32)


amax: Callable[[Float[Array, "*shape"], Array], Float[Array, ""]] = batch_shared(
    local_amax,
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

fraction: Callable[[Bool[Array, "*shape"], Array], Float[Array, ""]] = batch_shared(
    lambda mask: jnp.sum(mask.astype(jnp.float32)) / max(mask.size, 1),
    """The fraction of `mask` that is true (0 for an empty `mask`), batch-wide under `vmap`
    unless `owner` is batched (every member holds as many elements, so that is the mean over
    all of them). The telemetry
    counterpart of `amax`: a statistic of FP8 state describes the whole batch it belongs to.
    """,
)

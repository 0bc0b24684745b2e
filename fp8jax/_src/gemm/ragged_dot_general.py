"""`ragged_dot_general`: `lax.ragged_dot_general` under `vmap` when some operands are not mapped.

A shim for a gap of JAX 0.10, which batches a ragged dot only when all three operands are
mapped on axis 0; the grouped GEMMs' kernels usually are not. `ragged_dot` is the
high-precision `lax.ragged_dot` built on it, differentiable, for layers without FP8.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ..core import jax_private

# lax.ragged_dot: lhs (M, K) rows ragged, rhs (G, K, N): output (M, N).
_RAGGED = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
# Its dgrad: g (M, N) rows ragged, rhs (G, K, N) contracted on N: output (M, K).
_DGRAD = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
# Its wgrad: lhs (M, K) . g (M, N) contracting the ragged rows: output (G, K, N).
_WGRAD = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())


def _prefix_dims(dims: lax.RaggedDotDimensionNumbers, lhs_ndim: int) -> list[int]:
    """The lhs axes a full `group_sizes` spans before its group axis (`lax.ragged_dot_general`:
    the batch axes, then the non-contracting or contracting axes outer to the ragged one)."""
    (contract, _), (batch, _) = dims.dot_dimension_numbers
    (ragged,) = dims.lhs_ragged_dimensions
    if ragged in contract:
        return [*batch, *contract[: list(contract).index(ragged)]]
    free = [a for a in range(lhs_ndim) if a not in contract and a not in batch]
    return [*batch, *free[: free.index(ragged)]]


def _with_batch_axis(dims: lax.RaggedDotDimensionNumbers) -> lax.RaggedDotDimensionNumbers:
    """`dims` for operands with a new leading batch axis."""
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers

    def up(axes: Any) -> tuple[int, ...]:
        return tuple(a + 1 for a in axes)

    return lax.RaggedDotDimensionNumbers(
        ((up(lc), up(rc)), ((0, *up(lb)), (0, *up(rb)))),
        up(dims.lhs_ragged_dimensions),
        up(dims.rhs_group_dimensions),
    )


def ragged_dot_general(
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dims: lax.RaggedDotDimensionNumbers,
    precision: Any,
    preferred_element_type: Any,
) -> Array:
    """`lax.ragged_dot_general`, also under `vmap` when some operands are not mapped.

    JAX 0.10 batches a ragged dot only when all three operands are mapped on axis 0 (else
    "ragged_dot vmap over any dim but 0 - NYI"); the experts' kernels usually are not. The
    mapped axis becomes a batch axis of the ragged dot (merged into its leading batch axis
    when it has one), the unmapped operands broadcast along it; nested `vmap`s are handled
    one level at a time."""

    def plain(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return lax.ragged_dot_general(
            lhs,
            rhs,
            group_sizes,
            dims,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )

    @custom_vmap
    def dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return plain(lhs, rhs, group_sizes)

    @dot.def_vmap
    def _rule(axis_size, in_batched, lhs, rhs, group_sizes):
        lhs, rhs, group_sizes = (
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip((lhs, rhs, group_sizes), in_batched, strict=True)
        )
        contracting = dims.lhs_ragged_dimensions[0] in dims.dot_dimension_numbers[0][0]
        if dims.dot_dimension_numbers[1] == ((0,), (0,)):
            # Already batched on axis 0 of both: the mapped axis joins that batch axis (XLA's
            # GPU ragged-dot rewriter mis-shapes a ragged dot with two batch axes).
            batch = lhs.shape[1]
            if group_sizes.ndim == 2:  # (mapped, G): one set of sizes for the whole batch
                group_sizes = jnp.broadcast_to(
                    group_sizes[:, None], (axis_size, batch, group_sizes.shape[-1])
                )
            lhs, rhs, group_sizes = (
                a.reshape((axis_size * batch, *a.shape[2:])) for a in (lhs, rhs, group_sizes)
            )
            out = ragged_dot_general(lhs, rhs, group_sizes, dims, precision, preferred_element_type)
            if contracting:  # groups first: (G, mapped * batch, ...)
                out = out.reshape((out.shape[0], axis_size, batch, *out.shape[2:]))
                return jnp.moveaxis(out, 1, 0), True
            return out.reshape((axis_size, batch, *out.shape[1:])), True
        batched_dims = _with_batch_axis(dims)
        if group_sizes.ndim == 2:  # (mapped, G), broadcast over the rest of the prefix
            prefix = _prefix_dims(batched_dims, lhs.ndim)
            shape = (*(lhs.shape[a] for a in prefix), group_sizes.shape[-1])
            extra = (1,) * (len(prefix) - 1)
            group_sizes = jnp.broadcast_to(
                group_sizes.reshape(axis_size, *extra, group_sizes.shape[-1]), shape
            )
        out = ragged_dot_general(
            lhs, rhs, group_sizes, batched_dims, precision, preferred_element_type
        )
        if contracting:
            out = jnp.moveaxis(out, 1, 0)  # contracting mode puts the groups first
        return out, True

    return dot(lhs, rhs, group_sizes)


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array, preferred_element_type: Any) -> Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=...)` in high precision,
    also under `vmap` when some operands are not mapped.

    Outside any `vmap` it is `lax.ragged_dot` itself (every derivative JAX takes of it).
    Traced under a `vmap`, it is a `custom_vjp` whose forward, dgrad and wgrad are
    [`ragged_dot_general`][]s, so that the `vmap` may map it, its gradient (`grad(vmap(f))`)
    or be a gradient's (`vmap(grad(f))`, per-example gradients); forward mode and second
    derivatives under the `vmap` are not supported (nor were they by `lax.ragged_dot`)."""
    if not jax_private.under_vmap():
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    @jax.custom_vjp
    def dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return ragged_dot_general(lhs, rhs, group_sizes, _RAGGED, None, preferred_element_type)

    def forward(lhs: Array, rhs: Array, group_sizes: Array) -> tuple[Array, Any]:
        return dot(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def backward(residuals: Any, g: Array) -> tuple[Array, Array, None]:
        lhs, rhs, group_sizes = residuals
        d_lhs = ragged_dot_general(g, rhs, group_sizes, _DGRAD, None, lhs.dtype)
        d_rhs = ragged_dot_general(lhs, g, group_sizes, _WGRAD, None, rhs.dtype)
        return d_lhs, d_rhs, None

    dot.defvjp(forward, backward)
    return dot(lhs, rhs, group_sizes)

"""`ragged_dot_general`: `lax.ragged_dot_general` under `vmap` when some operands are not mapped.

A shim for a gap of JAX 0.10, which batches a ragged dot only when all three operands are
mapped on axis 0; the grouped GEMMs' kernels usually are not. `ragged_dot` is the
high-precision `lax.ragged_dot` for layers without FP8: a primitive batched by the same rule,
differentiable in both modes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ..core.jax_primitive import ragged_dot_primitive

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


def _map(
    dot: Any,
    dims: lax.RaggedDotDimensionNumbers,
    axis_size: int,
    in_batched: Any,
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
) -> tuple[Array, bool]:
    """The `vmap` rule of a ragged dot `dot(lhs, rhs, group_sizes, dims)` (mapped operands'
    axis first): the mapped axis becomes a batch axis of the ragged dot (merged into its
    leading batch axis when it has one), the unmapped operands broadcast along it."""
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
        out = dot(lhs, rhs, group_sizes, dims)
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
    out = dot(lhs, rhs, group_sizes, batched_dims)
    if contracting:
        out = jnp.moveaxis(out, 1, 0)  # contracting mode puts the groups first
    return out, True


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

    @custom_vmap
    def dot(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
        return lax.ragged_dot_general(
            lhs,
            rhs,
            group_sizes,
            dims,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )

    @dot.def_vmap
    def _rule(axis_size, in_batched, lhs, rhs, group_sizes):
        def again(lhs: Array, rhs: Array, group_sizes: Array, dims: Any) -> Array:
            return ragged_dot_general(
                lhs, rhs, group_sizes, dims, precision, preferred_element_type
            )

        return _map(again, dims, axis_size, in_batched, lhs, rhs, group_sizes)

    return dot(lhs, rhs, group_sizes)


def _map_primitive(
    axis_size: int,
    in_batched: Any,
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    dims: lax.RaggedDotDimensionNumbers,
    precision: Any,
    preferred_element_type: Any,
) -> tuple[Array, bool]:
    def again(lhs: Array, rhs: Array, group_sizes: Array, dims: Any) -> Array:
        return _DOT(lhs, rhs, group_sizes, dims, precision, preferred_element_type)

    return _map(again, dims, axis_size, in_batched, lhs, rhs, group_sizes)


def _transpose(
    ct: Array,
    known: Array,
    lhs_unknown: bool,
    spec: jax.ShapeDtypeStruct,
    group_sizes: Array,
    dims: lax.RaggedDotDimensionNumbers,
    precision: Any,
    preferred_element_type: Any,
) -> Array:
    """The cotangent of one operand of a forward, dgrad or wgrad (`_RAGGED`, `_DGRAD`,
    `_WGRAD`, or one of them with a leading batch axis): one of the other two, the three
    being the one trilinear form `sum x[m, k] g[m, n] w[group of m, k, n]`; computed in the
    `preferred_element_type` and cast to the operand's dtype, as `lax.ragged_dot`'s."""
    batched = dims.dot_dimension_numbers[1] != ((), ())

    def dot(lhs: Array, rhs: Array, numbers: lax.RaggedDotDimensionNumbers) -> Array:
        numbers = _with_batch_axis(numbers) if batched else numbers
        out = _DOT(lhs, rhs, group_sizes, numbers, precision, preferred_element_type)
        return out.astype(spec.dtype)

    def as_weight(a: Array) -> Array:  # a batched wgrad's output has its groups first
        return jnp.moveaxis(a, 1, 0) if batched else a

    base = _with_batch_axis if batched else (lambda numbers: numbers)
    if dims == base(_RAGGED):  # y = x . w
        return dot(ct, known, _DGRAD) if lhs_unknown else as_weight(dot(known, ct, _WGRAD))
    if dims == base(_DGRAD):  # dx = g . w^T
        return dot(ct, known, _RAGGED) if lhs_unknown else as_weight(dot(ct, known, _WGRAD))
    if dims == base(_WGRAD):  # dw = x^T . g
        ct = as_weight(ct)
        return dot(known, ct, _DGRAD) if lhs_unknown else dot(known, ct, _RAGGED)
    raise NotImplementedError(f"no transpose of a ragged dot with {dims}")


# Named as lax's, with its parameters: what reads a jaxpr's GEMMs by name (fp8_autocast,
# the roles of a model's layers) takes it as one.
_DOT = ragged_dot_primitive("ragged_dot_general", _map_primitive, _transpose)


def ragged_dot(lhs: Array, rhs: Array, group_sizes: Array, preferred_element_type: Any) -> Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=...)` in high precision,
    under every JAX transform, also under `vmap` when some operands are not mapped.

    A primitive of its own (`core.jax_primitive`) that compiles to `lax.ragged_dot`'s
    program, whose `vmap` is [`ragged_dot_general`][]'s rule and whose JVP and transposes
    are its forward, dgrad and wgrad, each again that primitive: `vmap`, `grad`, `jvp`,
    `linearize`, `jacrev`, `jacfwd`, `hessian` and their compositions (per-example
    gradients, `grad(vmap(f))`, `vmap` of a `vjp`) all apply, whatever the trace a
    `jit`ted function was first traced under."""
    return _DOT(lhs, rhs, group_sizes, _RAGGED, None, preferred_element_type)

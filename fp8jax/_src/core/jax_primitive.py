"""A JAX primitive for `lax.ragged_dot_general` whose batching and transposition are fp8jax's.

JAX internals, beside `jax_private` (`tests/test_jax_private.py` exercises it): JAX 0.10
batches `lax.ragged_dot_general` only with every operand mapped on axis 0, and transposes it
only in one of its modes. [`ragged_dot_primitive`][] makes a primitive that evaluates,
abstract-evaluates and lowers as `lax.ragged_dot_general` (the compiled program is the
same), is bilinear in its two matrices (JVP and linearization), and takes its batching and
transposition from rules written with public values only. What JAX derives from it is again
the primitive, so every transform composes, whatever the trace a function was first traced
under (`jit`'s caches do not know it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import lax as lax_internal

#: `batch(axis_size, in_batched, lhs, rhs, group_sizes, dims, precision,
#: preferred_element_type) -> (out, out_batched)`, the mapped operands' axis first (as a
#: `jax.custom_batching.custom_vmap` rule).
BatchRule = Callable[..., tuple[Any, bool]]
#: `transpose(ct, known, lhs_unknown, shape_dtype, group_sizes, dims, precision,
#: preferred_element_type) -> cotangent` of the operand (`lhs` if `lhs_unknown`, else `rhs`)
#: whose `jax.ShapeDtypeStruct` is given.
TransposeRule = Callable[..., Any]


def ragged_dot_primitive(
    name: str, batch: BatchRule, transpose: TransposeRule
) -> Callable[..., Any]:
    """A new primitive `name` computing `lax.ragged_dot_general(lhs, rhs, group_sizes, dims,
    precision=..., preferred_element_type=...)`, its `vmap` by `batch`, its transposition by
    `transpose`, and its JVP `prim(d_lhs, rhs) + prim(lhs, d_rhs)`. Returns its bind,
    `(lhs, rhs, group_sizes, dims, precision, preferred_element_type) -> out`."""
    prim = core.Primitive(name)

    def bind_(*operands: Any, **params: Any) -> Any:
        # As `lax.ragged_dot_general` binds: inside `shard_map`, an operand varying over fewer
        # manual axes than the others is cast to vary over theirs.
        return prim.bind(*core.auto_insert_reshard(*operands), **params)

    def bind(lhs: Any, rhs: Any, group_sizes: Any, dims: Any, precision: Any, dtype: Any) -> Any:
        return bind_(
            lhs,
            rhs,
            group_sizes,
            ragged_dot_dimension_numbers=dims,
            precision=lax_internal.canonicalize_precision(precision),
            preferred_element_type=None if dtype is None else jnp.dtype(dtype),
        )

    def compute(lhs: Any, rhs: Any, group_sizes: Any, *, ragged_dot_dimension_numbers, **params):
        return lax.ragged_dot_general(
            lhs,
            rhs,
            group_sizes,
            ragged_dot_dimension_numbers,
            **params,
        )

    def abstract_eval(lhs: Any, rhs: Any, group_sizes: Any, **params: Any) -> Any:
        return lax_internal.ragged_dot_general_p.abstract_eval(
            lhs,
            rhs,
            group_sizes,
            group_offset=None,
            out_sharding=None,
            **params,
        )

    def batch_rule(args: Any, axes: Any, **params: Any) -> tuple[Any, int]:
        size = next(a.shape[d] for a, d in zip(args, axes, strict=True) if d is not None)
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, axes, strict=True)]
        in_batched = [d is not None for d in axes]
        out, batched = batch(
            size,
            in_batched,
            *args,
            params["ragged_dot_dimension_numbers"],
            params["precision"],
            params["preferred_element_type"],
        )
        return out, 0 if batched else batching.not_mapped

    def jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
        lhs, rhs, group_sizes = primals
        d_lhs, d_rhs, _ = tangents
        out = bind_(lhs, rhs, group_sizes, **params)
        parts = [
            bind_(a, b, group_sizes, **params)
            for a, b, tangent in ((d_lhs, rhs, d_lhs), (lhs, d_rhs, d_rhs))
            if type(tangent) is not ad.Zero
        ]
        if not parts:  # JAX does not ask: some tangent is nonzero
            return out, jnp.zeros_like(out)
        return out, parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def transpose_rule(ct: Any, lhs: Any, rhs: Any, group_sizes: Any, **params: Any) -> list:
        if type(ct) is ad.Zero or ad.is_undefined_primal(group_sizes):
            return [None, None, None]
        lhs_unknown = ad.is_undefined_primal(lhs)
        unknown, known = (lhs, rhs) if lhs_unknown else (rhs, lhs)
        aval = unknown.aval
        spec = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        out = transpose(
            ct,
            known,
            lhs_unknown,
            spec,
            group_sizes,
            params["ragged_dot_dimension_numbers"],
            params["precision"],
            params["preferred_element_type"],
        )
        return [out, None, None] if lhs_unknown else [None, out, None]

    prim.def_impl(compute)
    prim.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(compute, multiple_results=False))
    batching.primitive_batchers[prim] = batch_rule
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose_rule
    return bind

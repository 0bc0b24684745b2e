"""What an FP8 cast did to a tensor: the fractions of its values saturated and flushed to zero.

Layers built with `telemetry=True` compute these for their input, kernel and output gradient at
every step and return them through the gradient, with the rest of their state: no host sync.
"""

# No `from __future__ import annotations`: Equinox reads the AbstractVar annotations.
import functools
import operator
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from . import jax_private
from .amax import fraction
from .formats import (
    FormatLike,
    expand_blocks,
    overflow_threshold,
    ties_overflow,
    within_float32,
)


class OperandStats(eqx.Module):
    """How the latest cast to FP8 treated one operand.

    **Fields:**

    - `saturated`: the fraction of values whose scaled magnitude was beyond the format's range
      (above its max plus half a step there, or at it where rounding to nearest even goes up:
      E5M2's 61440), so the saturating cast clipped them to the max.
    - `underflow`: the fraction of nonzero values that became zero (flushed below the format's
      smallest subnormal).
    - `rejected`: how many steps so far the operand held an inf or NaN, so that its state
      update was rejected (the layer kept its previous scale and history). A running count,
      as a float32.

    Where a layer runs several times in a step (microbatches, a layer called twice), the
    fractions combine as its amax does, by max: the worst call's, not the fraction over all of
    the step's values (a step over 2 microbatches, one saturating 92 % of its values and the
    other none, reports 0.92 where one step over the whole batch would report 0.46).
    """

    saturated: Float[Array, ""]
    underflow: Float[Array, ""]
    rejected: Float[Array, ""]

    @classmethod
    def zeros(cls) -> "OperandStats":
        """Statistics of no tensor yet."""
        return cls(*(jnp.zeros((), jnp.float32) for _ in range(3)))


class AbstractStats(eqx.Module):
    """[`fp8jax.OperandStats`][] of the three operands of one FP8 GEMM: the base of
    [`fp8jax.Fp8Stats`][] (a dense layer's) and [`fp8jax.ExpertStats`][] (a grouped layer's)."""

    input: eqx.AbstractVar[OperandStats]
    kernel: eqx.AbstractVar[OperandStats]
    output_grad: eqx.AbstractVar[OperandStats]


class Fp8Stats(AbstractStats):
    """[`fp8jax.OperandStats`][] of the three operands of one FP8 GEMM."""

    input: OperandStats
    kernel: OperandStats
    output_grad: OperandStats

    @classmethod
    def zeros(cls) -> "Fp8Stats":
        """Statistics of no step yet."""
        return cls(OperandStats.zeros(), OperandStats.zeros(), OperandStats.zeros())


class ExpertStats(AbstractStats):
    """A grouped layer's statistics: those of [`fp8jax.Fp8Stats`][] with the kernel's fields per
    expert (`kernel.saturated (experts,)`), and `tokens (experts,)`: how many rows (token
    assignments) each expert got at the latest step (summed over the layer's calls, when it
    runs several times in a step: microbatches, a layer called twice)."""

    input: OperandStats
    kernel: OperandStats
    output_grad: OperandStats
    tokens: Float[Array, " experts"]

    @classmethod
    def zeros_for(cls, experts: int) -> "ExpertStats":
        """Statistics of no step yet, for `experts` experts."""
        per_expert = OperandStats(*(jnp.zeros((experts,), jnp.float32) for _ in range(3)))
        tokens = jnp.zeros((experts,), jnp.float32)  # float32 under x64 too, as steps record
        return cls(OperandStats.zeros(), per_expert, OperandStats.zeros(), tokens)


def _is_expert_stats(x: Any) -> bool:
    return isinstance(x, ExpertStats)


def max_combining_view(state: Any) -> Any:
    """FP8 `state` with its floating leaves viewed in the max-combining dtype, so that each use
    of a layer contributes its amax by max; but the tokens each expert got
    (`ExpertStats.tokens`), which add: a layer called on two batches got both's tokens."""

    def view(x: Any) -> Any:
        if eqx.is_inexact_array(x) and not jax_private.is_max_combining(x):
            return jax_private.to_max_combining(x)
        return x

    def node(x: Any) -> Any:
        if not _is_expert_stats(x):
            return view(x)
        return eqx.tree_at(lambda s: s.tokens, jax.tree.map(view, x), x.tokens)

    return jax.tree.map(node, state, is_leaf=_is_expert_stats)


def combine_states(a: Any, b: Any) -> Any:
    """Two steps' (microbatches') FP8 states as one: each leaf the max, but the tokens each
    expert got, summed, as [`max_combining_view`][] combines the uses in one step."""

    def node(x: Any, y: Any) -> Any:
        if not _is_expert_stats(x):
            return jnp.maximum(x, y)
        most = jax.tree.map(jnp.maximum, x, y)
        return eqx.tree_at(lambda s: s.tokens, most, x.tokens + y.tokens)

    return jax.tree.map(node, a, b, is_leaf=_is_expert_stats)


def cast_statistics(
    x: Array,
    terms: Sequence,
    fmt: FormatLike,
    owner: Array,
    axis_names: tuple[str, ...] = (),
) -> OperandStats:
    """The [`fp8jax.OperandStats`][] of `x` cast to FP8 as `terms` (`rejected` is 0 here:
    [`fp8jax.Fp8DotGeneral.merge`][] counts rejected updates).

    **Arguments:**

    - `x`: the high-precision tensor, `(*B, rows, cols)`.
    - `terms`: its FP8 terms (`QTensor`s laid out like `x`); the first one carries the
      magnitude, so saturation is judged on it. A value underflows when every term is zero.
    - `fmt`: the first term's format.
    - `owner`, `axis_names`: as for [`fp8jax.Recipe.amax`][]: whose batch the fractions span,
      and the mesh axes to average over inside `shard_map`.
    """
    first = terms[0]
    scale_inv = first.scale_inv.astype(jnp.float32)
    if first.block:
        scale_inv = expand_blocks(scale_inv, first.block, x.shape)
    # A finite float64 beyond float32's range is saturated, not inf.
    magnitude = within_float32(jnp.abs(x), jnp).astype(jnp.float32)
    # Only finite values are clipped; an inf or NaN is passed on as NaN (see `saturate`).
    limit = overflow_threshold(fmt) * scale_inv
    beyond = magnitude >= limit if ties_overflow(fmt) else magnitude > limit
    saturated = jnp.isfinite(magnitude) & beyond
    all_zero = functools.reduce(operator.and_, [t.data == 0 for t in terms])
    nonzero = x != 0  # in x's dtype: a float64 below float32's range is nonzero too
    values = (fraction(saturated, owner), fraction(all_zero & nonzero, owner))
    if axis_names:
        values = tuple(lax.pmean(v, axis_names) for v in values)
    return OperandStats(*values, jnp.zeros((), jnp.float32))

"""`GroupedLinear`: the experts' Linears of a mixture of experts, stacked, with an injectable
ragged dot (`lax.ragged_dot` until [`fp8jax.fp8_linear_layers`][] makes it FP8)."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..core.explicit import explicit_mesh, on_auto_axes
from ..core.formats import float_dtype
from ..core.jax_private import varying_axes
from ..gemm.exchange import ExpertExchange
from ..gemm.ragged_dot_general import ragged_dot
from ..ops.base import AbstractFp8Op
from ..ops.ragged_dot import (
    Fp8RaggedDot,
    check_dispatch_args,
    check_ragged_dot_args,
    listed_sizes,
    rows_by_outputs,
    widened_group_sizes,
)
from .linear import one_of_stack
from .moe_linear import Fp8MoELinear


def check_grouped_linear_args(
    where: str,
    shape: tuple[Any, Any, Any],
    ragged_dot: Any,
    *,
    example: str = "",
    grouped_op: str = "fp8jax.Fp8RaggedDot",
    nnx: bool = False,
) -> tuple[int, int, int]:
    """Check the arguments of a grouped Linear (`where` names it in the errors): `shape`, its
    `(num_experts, in_features, out_features)`, ints >= 1 (NumPy's too; `ValueError`);
    `ragged_dot`, `None` or a callable (`TypeError`, whose advice ends with `example`), not
    a dense layer's FP8 GEMM (an `Fp8DotGeneral`, or an NNX layer holding one in `state`:
    `TypeError`, naming `grouped_op`), nor the other framework's FP8 grouped GEMM (`nnx`:
    the layer is Flax NNX's, whose is an NNX layer holding an `Fp8RaggedDot` in `state`;
    else Equinox's, whose is the `Fp8RaggedDot` itself: `TypeError`, naming `grouped_op`),
    nor one built for another expert count (`ValueError`). Returns `shape` as Python ints."""
    for name, value in zip(("num_experts", "in_features", "out_features"), shape, strict=True):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{where} {name}={value!r}: should be an int >= 1.")
    if ragged_dot is not None and not callable(ragged_dot):
        raise TypeError(
            f"{where} ragged_dot={ragged_dot!r}: should be None (jax.lax.ragged_dot) or a "
            f"callable with its signature{example}."
        )
    op = getattr(ragged_dot, "state", ragged_dot)  # an NNX FP8 layer holds its op there
    if isinstance(op, AbstractFp8Op) and not isinstance(op, Fp8RaggedDot):
        raise TypeError(
            f"{where} ragged_dot={type(ragged_dot).__name__}: a dense layer's FP8 GEMM (for "
            f"{op.stands_for}); a grouped layer's is a {grouped_op}(recipe, num_experts=...), "
            "the FP8 jax.lax.ragged_dot."
        )
    if isinstance(op, Fp8RaggedDot) and (op is not ragged_dot) != nnx:
        # Its state would not be trained: Equinox's leaves through the gradient, NNX's in
        # `Fp8State` variables (the step raised an unrelated error, or none at all).
        held, wanted = ("an Equinox", "an NNX") if nnx else ("a Flax NNX", "an Equinox")
        raise TypeError(
            f"{where} ragged_dot={type(ragged_dot).__name__}: {held} layer's FP8 grouped GEMM, "
            f"whose state {wanted} layer does not update; {where}'s is a {grouped_op}(recipe, "
            "num_experts=...)."
        )
    if isinstance(op, Fp8RaggedDot) and op.num_experts != shape[0]:
        raise ValueError(
            f"{where} num_experts={int(shape[0])} but ragged_dot={type(ragged_dot).__name__} "
            f"was built for num_experts={op.num_experts}; they should be equal (a kernel scale "
            "per expert)."
        )
    return (int(shape[0]), int(shape[1]), int(shape[2]))


class GroupedLinear(eqx.Module):
    """`y[rows of e] = x[rows of e] @ weight[e]` for every expert `e`: one Linear per expert
    (no bias), applied to tokens sorted by expert, as one grouped GEMM.

    `ragged_dot` is the GEMM: `None` runs `jax.lax.ragged_dot` in high precision;
    [`fp8jax.fp8_linear_layers`][] puts an [`fp8jax.Fp8RaggedDot`][] there (the expert
    counterpart of a Linear's `dot_general`), with the same [`fp8jax.Fp8Config`][] targets,
    exclusions and per-layer recipes as dense layers.

    **Arguments:**

    - `num_experts`, `in_features`, `out_features`: the weight is
      `(num_experts, in_features, out_features)`, `lax.ragged_dot`'s layout. Each expert's
      weight is initialised like `eqx.nn.Linear`'s, uniform in `+-1/sqrt(in_features)`.
    - `key`: a PRNG key; `dtype`: the new weight's dtype (float32 by default; a floating
      dtype or its name, as `compute_dtype`).
    - `ragged_dot`: `None` (high precision) or a callable with `lax.ragged_dot`'s signature,
      e.g. `fp8jax.Fp8RaggedDot("blockwise", num_experts=8)`.
    - `weight`: a weight of that shape to use instead of a new one (then no `key`).
    - `compute_dtype`: as [`fp8jax.Linear`][]'s: `None` (the output's dtype is the
      promotion of the tokens' and the weight's), or the output's dtype where the weight is
      a wider master that [`fp8jax.Policy`][]'s `cast_to_compute` left for the FP8 GEMM to
      quantize (in high precision, `lax.ragged_dot`'s `preferred_element_type`).

    ```python
    up = fp8jax.GroupedLinear(8, 64, 256, key=key)
    h = up(x_sorted, group_sizes)   # (tokens, 256)
    ```
    """

    weight: Float[Array, "experts fan_in fan_out"]
    ragged_dot: Fp8RaggedDot | None
    num_experts: int = eqx.field(static=True)
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    compute_dtype: np.dtype | None = eqx.field(static=True)

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        key: PRNGKeyArray | None = None,
        dtype: DTypeLike | None = None,
        ragged_dot: Any = None,
        weight: Float[Array, "experts fan_in fan_out"] | None = None,
        compute_dtype: DTypeLike | None = None,
    ):
        shape = check_grouped_linear_args(
            "GroupedLinear",
            (num_experts, in_features, out_features),
            ragged_dot,
            example=", e.g. fp8jax.Fp8RaggedDot(num_experts=...)",
        )
        num_experts, in_features, out_features = shape
        if dtype is not None:
            dtype = float_dtype(dtype, "GroupedLinear dtype")
        if (key is None) == (weight is None):
            raise TypeError(
                "GroupedLinear: give key (a PRNG key, for a new weight) or weight (of shape "
                f"{shape}), not {'both' if key is not None else 'neither'}."
            )
        if weight is None:
            dtype = jnp.float32 if dtype is None else dtype
            bound = 1.0 / math.sqrt(in_features)
            weight = jax.random.uniform(key, shape, dtype, -bound, bound)
        elif tuple(getattr(weight, "shape", ())) != shape:
            raise ValueError(
                f"GroupedLinear weight of shape {getattr(weight, 'shape', type(weight))}: "
                f"should be (num_experts, in_features, out_features) = {shape}."
            )
        elif not jnp.issubdtype(weight.dtype, jnp.floating):
            raise TypeError(
                f"GroupedLinear weight has dtype {weight.dtype}; should be a floating dtype "
                "(float32, bfloat16, float16), as a Linear's."
            )
        elif dtype is not None and np.dtype(dtype) != weight.dtype:
            raise TypeError(
                f"GroupedLinear dtype={np.dtype(dtype)} is a new weight's, but weight of "
                f"{weight.dtype} was given: cast it (weight.astype(dtype)), or leave dtype out."
            )
        self.weight = weight
        self.ragged_dot = ragged_dot
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = (
            None
            if compute_dtype is None
            else float_dtype(compute_dtype, "GroupedLinear compute_dtype")
        )

    def with_compute_dtype(self, compute_dtype: DTypeLike | None) -> GroupedLinear:
        """This layer, its output in `compute_dtype` (`None`: the promotion), all else as it
        is; also a stack of layers (weights `(*layers, experts, fan_in, fan_out)`)."""
        one = GroupedLinear(
            self.num_experts,
            self.in_features,
            self.out_features,
            weight=one_of_stack(self.weight, len(self.weight.shape) - 3),
            compute_dtype=compute_dtype,
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.ragged_dot),
            one,
            (self.weight, self.ragged_dot),
            is_leaf=lambda x: x is None,
        )

    def __call__(
        self,
        x: Float[Array, "tokens fan_in"],
        group_sizes: Int[Array, " experts"] | ExpertExchange,
    ) -> Float[Array, "rows fan_out"]:
        """**Arguments:** `x (tokens, in_features)`, its rows sorted by expert;
        `group_sizes (num_experts,)`, integers >= 0 (an array, NumPy's or a list) summing to
        at most `tokens`: rows past their sum get zeros, as from `lax.ragged_dot` (sizes known
        at trace time are checked; see [`fp8jax.Fp8RaggedDot`][]).

        Under expert parallelism (inside `shard_map`, the weight this device's experts),
        `group_sizes` is an [`fp8jax.ExpertExchange`][] and `x` this device's tokens in
        their own order: they are dispatched to their experts' devices first (an FP8 layer
        quantizes them first and sends FP8) and the result is the rows this device's experts
        received, in expert order (`exchange.capacity` rows; give them to the next grouped
        layer with `exchange.group_sizes`, and back with `exchange.combine`).

        **Returns:** `(tokens, out_features)`; dispatched, `(exchange.capacity,
        out_features)`.
        """
        if self.ragged_dot is not None:
            if self.compute_dtype is None:
                return self.ragged_dot(x, self.weight, group_sizes)
            return self.ragged_dot(
                x, self.weight, group_sizes, preferred_element_type=self.compute_dtype
            )
        return high_precision_ragged_dot(
            "GroupedLinear", x, self.weight, group_sizes, self.compute_dtype
        )


def high_precision_ragged_dot(
    where: str, x: Any, weight: Array, group_sizes: Any, dtype: DTypeLike | None
) -> Array:
    """A grouped layer's GEMM without an FP8 `ragged_dot`: `lax.ragged_dot` in `dtype` (its
    `preferred_element_type`), taking group sizes as `Fp8RaggedDot` does (a list, a narrow
    integer dtype widened, or an `ExpertExchange` whose dispatched rows it multiplies); also
    under `jax.vmap` with the weight (or any operand) not mapped, under every derivative JAX
    takes (`gemm.ragged_dot_general.ragged_dot`), and under a mesh with
    Explicit axes as `Fp8RaggedDot` does: there `lax.ragged_dot` requires an `out_sharding`,
    which its JVP drops and its expansion fails with for split rows, so it runs with those
    axes Auto, its output's rows split as `x`'s, its columns as the weight's outputs."""
    x = jnp.asarray(x)
    group_sizes = listed_sizes(group_sizes)
    if isinstance(group_sizes, ExpertExchange):
        check_dispatch_args(
            where, x.shape, weight.shape, group_sizes, rhs_axes=varying_axes(weight)
        )
        x, group_sizes = group_sizes.dispatch(x), group_sizes.group_sizes
    check_ragged_dot_args(where, jnp.shape(x), weight.shape, group_sizes)
    sizes = widened_group_sizes(group_sizes)  # int8's offsets would overflow
    explicit = explicit_mesh(x, weight, sizes) is not None

    def compute(x: Array, weight: Array, sizes: Any) -> Array:
        return ragged_dot(x, weight, sizes, dtype)

    out_sharding = rows_by_outputs(x, weight) if explicit else None
    return on_auto_axes(compute, x, weight, sizes, out_sharding=out_sharding, explicit=explicit)


def expert_specs(model: Any, axis: str) -> Any:
    """The `PartitionSpec`s that split `model`'s experts over mesh axis `axis` (expert
    parallelism, for `shard_map`'s `in_specs`): `P(axis)` for every
    [`fp8jax.GroupedLinear`][]'s weight and the per-expert leaves of its FP8 layer (the
    kernel's state and statistics, the tokens per expert; layers stacked with
    `eqx.filter_vmap` split on their experts axis, behind the stack's: `P(None, axis)`),
    `P()` for every other array
    (replicated: the router, attention, norms, the activations' FP8 state); `None` for what
    is not an array. The same tree structure as `model`, whose arrays may be
    `jax.ShapeDtypeStruct`s (an abstract model, for a compile without devices). A Haliax
    `MoELinear` in FP8 ([`fp8jax.Fp8MoELinear`][]) raises a `TypeError`: Haliax splits its
    named experts axis by its own axis mapping.

    ```python
    specs = fp8jax.expert_specs(model, "expert")
    loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P())
    ```
    """
    if not isinstance(axis, str):
        raise TypeError(f"expert_specs: axis={axis!r}: should be a mesh axis name (a str).")
    split: dict[int, int] = {}  # id of a per-expert leaf -> the stack axes in front of its experts

    def per_expert(layer: GroupedLinear) -> list[Any]:
        leaves = [layer.weight]
        dot = layer.ragged_dot
        if isinstance(dot, Fp8RaggedDot):
            leaves += jax.tree.leaves(dot.kernel)
            if dot.stats is not None:
                leaves += jax.tree.leaves((dot.stats.kernel, dot.stats.tokens))
        return leaves

    def is_layer(n: Any) -> bool:
        return isinstance(n, GroupedLinear | Fp8MoELinear)

    for layer in jax.tree.leaves(model, is_leaf=is_layer):
        if isinstance(layer, Fp8MoELinear):
            raise TypeError(
                f"expert_specs: the model holds a Haliax MoELinear in FP8 (its experts the "
                f"named axis {layer.Experts.name!r}); expert_specs splits fp8jax.GroupedLinear "
                "experts for shard_map. Split a Haliax model's experts by its axis mapping "
                f"(e.g. {{{layer.Experts.name!r}: {axis!r}}}) instead."
            )
        if isinstance(layer, GroupedLinear):
            # Layers stacked by `eqx.filter_vmap` lead with their stack axes: (*L, E, in, out).
            lead = max(len(layer.weight.shape) - 3, 0)
            split.update((id(a), lead) for a in per_expert(layer))

    def spec(leaf: Any) -> Any:
        if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
            return None
        if id(leaf) not in split:
            return P()
        return P(*(None,) * split[id(leaf)], axis)

    return jax.tree.map(spec, model)

"""The grouped FP8 GEMM: forward, dgrad and wgrad of `lax.ragged_dot`, and its batching rule.

The grouped counterpart of `dense.py`, for `lax.ragged_dot`'s signature: `x (M, K)` with its
rows sorted by expert, the experts' kernels `w (G, K, N)`, `group_sizes (G,)`.

- forward: `out[rows of e] = x[rows of e] @ w[e]`, a ragged dot of FP8 operands
  (`grouped_dots.py`);
- dgrad: `d_x[rows of e] = g[rows of e] @ w[e]^T`, the same shape of ragged dot;
- wgrad: `d_w[e] = x[rows of e]^T @ g[rows of e]`, a ragged dot contracting the tokens.

The kernel is quantized per expert (the recipe's `quantize`, `vmap`ped over the experts: one
scale, or one set of blocks, and one state per expert); the activation and the output
gradient as one tensor each. Residuals are the FP8 operands, their scales and `group_sizes`.
State leaves through the gradient, as for dense layers (the custom_vjp is `vjp.py`'s).

An expert that got no tokens in a step returns a zero kernel state (the "nothing received"
of [`fp8jax.Fp8RaggedDot.merge`][]): its weight took part in no GEMM, so it keeps its scale
and history, as a dense layer that did not run does. Under `jax.vmap`, an expert counts as
used when any member of the mapped axis gave it tokens (the state is shared by the batch).

Under `jax.vmap(model)(batch)`, with the kernels and the state not mapped, the batching rules
(`batching.py`) fold the mapped axis into the rows, as for dense layers: the
tokens of all members are put in one expert order (each expert's tokens member after
member), one grouped GEMM runs on them, and the wgrad is one grouped GEMM over all tokens
instead of a weight gradient per member, summed afterwards. Other mapped cases (stacked
state, per-example gradients) run per member.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int

from ..core import jax_private
from ..core.amax import batch_shared, fraction, owner
from ..core.stats import ExpertStats
from ..recipes import BlockScaledRecipe, BlockwiseScaling, Recipe
from ..recipes.base import Axis
from .batching import Fold, folding_backward, folding_forward, may_fold, state_of, unbatched
from .exchange import ExpertExchange
from .grouped_dots import rows_dot, token_tile, tokens_dot
from .grouped_native import expert_of_rows, gather_map, pad_layout
from .vjp import Gemm, States, Static, fp8_gemm, prepare

#: How the errors of the shared checks name a grouped layer without a name.
KIND = "Fp8RaggedDot"


class Residuals(NamedTuple):
    """What the forward of one FP8 grouped GEMM saves for its backward: the quantized
    activation (contracted on its features) and the quantized kernels (per expert, laid out
    for the dgrad), the group sizes, the new state of the input and of the kernels (returned
    as their cotangents), the output gradient's state as it came in, and with telemetry the
    input's and kernels' cast statistics (the kernels' per expert). Only `q_x` and
    `group_sizes` can carry a folded `vmap` axis."""

    q_x: Any
    q_w: Any
    group_sizes: Array
    new_input: Any
    new_kernel: Any
    grad_state: Any
    stats: Any = None
    plan: Any = None


#: The residuals made from one operand each, in the forward's order: they carry a mapped axis
#: where their operand does. The others are state, which spans it.
_OPERAND_FIELDS = ("q_x", "q_w", "group_sizes")


has_tokens = batch_shared(
    lambda sizes: sizes > 0,
    "Which experts got tokens (in any member of a `vmap`ped axis sharing `owner`'s state).",
    # An empty mapped axis gave no expert tokens.
    combine=functools.partial(jnp.max, initial=0, axis=0),
)
token_counts = batch_shared(
    lambda sizes: sizes.astype(jnp.float32),
    "The tokens each expert got, as float32 statistics (summed over a `vmap`ped axis "
    "sharing `owner`'s state).",
    combine=functools.partial(jnp.sum, axis=0),
)


def _rows_held(rows: int, group_sizes: Array) -> Bool[Array, " rows"]:
    """Which of `rows` rows hold tokens: the first `sum(group_sizes)` (the rest are a
    receive buffer's padding, or rows the docs allow past the groups)."""
    return jnp.arange(rows) < jnp.sum(group_sizes)


def _held_only(x: Array, group_sizes: Array) -> Array:
    """`x (rows, cols)` with its rows past the groups zeroed, so they set no per-tensor
    scale of the rows that hold tokens (a block recipe's tiles are per row already)."""
    held = _rows_held(x.shape[0], group_sizes)
    return jnp.where(held[:, None], x, jnp.zeros((), x.dtype))


def _token_statistics(
    recipe: Any, x: Array, q: Any, role: str, owner_leaf: Array, group_sizes: Array
) -> Any:
    """`recipe.statistics` of a grouped operand `x (rows, cols)` over its rows that hold
    tokens, the first `sum(group_sizes)`: the rows past them (an expert-parallel receive
    buffer's padding, sized for the worst case) are no values of the step, and counted
    they would divide its fractions by the buffer's slack."""
    held = _rows_held(x.shape[0], group_sizes)
    stats = recipe.statistics(_held_only(x, group_sizes), q, role, owner_leaf)
    # The rows held, as a fraction spanning what the statistics span (a vmapped batch, and
    # the mesh axes of `axis_names`): the statistics' fractions over it are over held rows.
    share = fraction(held, owner_leaf)
    if recipe.axis_names:
        share = lax.pmean(share, recipe.axis_names)
    share = jnp.where(share > 0, share, 1.0)
    return type(stats)(stats.saturated / share, stats.underflow / share, stats.rejected)


def _only_used(state: Any, used: Bool[Array, " G"]) -> Any:
    """Per-expert `state` with the experts that got no tokens zeroed (nothing received)."""

    def keep(a: Array) -> Array:
        mask = jnp.reshape(used, used.shape + (1,) * (a.ndim - used.ndim))
        return jnp.where(mask, a, jnp.zeros_like(a))

    return jax.tree.map(keep, state)


def _per_expert(fn: Any, *args: Any) -> Any:
    """`fn` mapped over the leading (expert) axis of every argument."""
    return jax.vmap(fn)(*args)


def _forward(
    recipe: Recipe,
    native: bool | None,
    precision: Any,
    out_dtype: np.dtype,
    x: Array,
    w: Array,
    group_sizes: Array,
    states: States,
):
    if not isinstance(recipe, BlockScaledRecipe):  # rows past the groups set no scale
        x = _held_only(x, group_sizes)
    q_x, new_input = recipe.quantize(x, states.input, "input", -1)
    input_stats = None
    if states.stats is not None:
        input_stats = _token_statistics(recipe, x, q_x, "input", owner(states.input), group_sizes)
    return _experts_forward(
        recipe, native, precision, out_dtype, q_x, new_input, input_stats, w, group_sizes, states
    )


def _experts_forward(
    recipe: Recipe,
    native: bool | None,
    precision: Any,
    out_dtype: np.dtype,
    q_x: Any,
    new_input: Any,
    input_stats: Any,
    w: Array,
    group_sizes: Array,
    states: States,
):
    """The forward from the quantized activation `q_x` (rows sorted by expert) on."""
    kernels = _kernels(recipe, w)
    fwd_axis, dgrad_axis = _weight_axes(recipe)
    w_c = w if fwd_axis == -2 else jnp.swapaxes(w, -1, -2)
    q_w, new_kernel = _per_expert(
        lambda w, s: kernels.quantize(w, s, "kernel", fwd_axis), w_c, states.kernel
    )
    experts = expert_of_rows(group_sizes, q_x.data.shape[0])
    with jax.named_scope("fwd"):
        out = rows_dot(
            recipe, q_x, q_w, fwd_axis, group_sizes, experts, precision, out_dtype, native
        )
    # As for dense layers: keep what follows out of the GEMM's epilogue (see dense.py).
    out = lax.optimization_barrier(out)
    used = has_tokens(group_sizes, owner(states.kernel))
    stats = None
    if states.stats is not None:
        # Per expert for the kernels (each its own scale); an expert without tokens reports
        # nothing received, as its state does.
        kernel_stats = _per_expert(
            lambda w, q, s: kernels.statistics(w, q, "kernel", owner(s)),
            w_c,
            q_w,
            states.kernel,
        )
        stats = (
            input_stats,
            _only_used(kernel_stats, used),
            token_counts(group_sizes, states.stats.tokens),
        )
    # The dgrad's copy of each kernel, from the high-precision weight (one rounding).
    q_w = _per_expert(lambda q, w: kernels.retile(q, "kernel", dgrad_axis, source=w), q_w, w_c)
    return out, Residuals(
        q_x=q_x,
        q_w=q_w,
        group_sizes=group_sizes,
        new_input=new_input,
        new_kernel=_only_used(new_kernel, used),
        grad_state=states.output_grad,
        stats=stats,
    )


def _backward(
    recipe: Recipe,
    native: bool | None,
    lhs_dtype: np.dtype,
    rhs_dtype: np.dtype,
    residuals: Residuals,
    g: Array,
):
    # Copies of the FP8 operands in their other layout are made here, not kept from the
    # forward (see dense.py's backward).
    q_x, q_w = lax.optimization_barrier(residuals.q_x), lax.optimization_barrier(residuals.q_w)
    group_sizes, plan = residuals.group_sizes, residuals.plan
    activations = _activations(recipe, plan)
    back = recipe.backward_dot_precision()
    experts = expert_of_rows(group_sizes, g.shape[0])
    rows = q_g_tokens = None
    if isinstance(recipe, BlockScaledRecipe):
        # The wgrad's operands with each expert's tokens padded to whole tiles (zeros
        # between): each token tile holds one expert's tokens, as in DeepSeek-V3. The recipe
        # quantizes them as it gathers them, the output gradient's copy for the dgrad in
        # the same read.
        layout = pad_layout(group_sizes, g.shape[0], token_tile(recipe))
        rows, padded_sizes = gather_map(layout), layout.sizes
        q_g, q_g_tokens, new_grad = activations.quantize_both_gathered(
            g, rows, residuals.grad_state, "output_grad"
        )
    else:  # as the forward's input: rows past the groups set no scale
        g = _held_only(g, group_sizes)
        q_g, new_grad = activations.quantize(g, residuals.grad_state, "output_grad", -1)
    stats = residuals.stats
    if stats is not None:
        grad_stats = _token_statistics(
            activations, g, q_g, "output_grad", owner(residuals.grad_state), group_sizes
        )
        input_stats, kernel_stats, tokens = stats
        stats = ExpertStats(input_stats, kernel_stats, grad_stats, tokens)
    with jax.named_scope("dgrad"):
        dgrad_axis = _weight_axes(recipe)[1]
        d_x = rows_dot(recipe, q_g, q_w, dgrad_axis, group_sizes, experts, back, lhs_dtype, native)
    if rows is None:
        q_g_tokens, _ = activations.quantize(g, residuals.grad_state, "output_grad", -2)
    with jax.named_scope("wgrad"):
        if rows is None:
            q_x = recipe.retile(q_x, "input", -2)
        else:  # the activation's tiles and the experts' sizes in the padded layout
            q_x, group_sizes = recipe.retile_gathered(q_x, rows, "input"), padded_sizes
        d_w = tokens_dot(recipe, q_x, q_g_tokens, group_sizes, back, rhs_dtype, native)
    if plan is not None:
        d_x = plan.gradient_back(d_x)
    return d_x, d_w, States(residuals.new_input, residuals.new_kernel, new_grad, stats)


# --- expert parallelism: the activation quantized, then dispatched ------------------------


def _activations(recipe: Recipe, plan: ExpertExchange | None) -> Recipe:
    """The recipe of the activation and the output gradient. Dispatched, each device holds
    some of the tokens: their amaxes are taken over the exchange's axis too (global, as on
    one device)."""
    if plan is None or plan.axis_name in recipe.axis_names:
        return recipe
    return dataclasses.replace(recipe, axis_names=(*recipe.axis_names, plan.axis_name))


def _weight_axes(recipe: Recipe) -> tuple[Axis, Axis]:
    """The axes each expert's kernel `(K, N)` is contracted on as the forward and the dgrad
    read it quantized. Blockwise: K (-2) and N (-1) as stored, the weight kernel writing both
    layouts (square blocks); else the forward's copy made with K moved last (-1: a per-tensor
    cast fuses that transpose) and the dgrad's contracted on its -2."""
    return (-2, -1) if isinstance(recipe, BlockwiseScaling) else (-1, -2)


def _kernels(recipe: Recipe, w: Array) -> Recipe:
    """The recipe of the experts' kernels: their amaxes are never taken over a mesh axis the
    experts are split over (inside `shard_map`: each device's experts are its own tensors,
    with their own scales), only over the axes that hold copies of them."""
    split = jax_private.varying_axes(w)
    axes = tuple(a for a in recipe.axis_names if a not in split)
    return recipe if axes == recipe.axis_names else dataclasses.replace(recipe, axis_names=axes)


def _dispatched_forward(
    recipe: Recipe,
    native: bool | None,
    precision: Any,
    out_dtype: np.dtype,
    x: Array,
    w: Array,
    plan: ExpertExchange,
    states: States,
):
    """The forward of a dispatched grouped GEMM: this device's tokens `x` quantized (global
    amaxes), their FP8 rows and scales sent to the devices of their experts, and this
    device's experts run on the rows they received."""
    activations = _activations(recipe, plan)
    q_x, new_input = activations.quantize(x, states.input, "input", -1)
    input_stats = None
    if states.stats is not None:
        input_stats = activations.statistics(x, q_x, "input", owner(states.input))
    with jax.named_scope("dispatch"):
        q_x = plan.dispatch_quantized(q_x)
    out, residuals = _experts_forward(
        recipe,
        native,
        precision,
        out_dtype,
        q_x,
        new_input,
        input_stats,
        w,
        plan.group_sizes,
        states,
    )
    return out, residuals._replace(plan=plan)


# --- folding a vmapped axis into the rows --------------------------------------------------


def fold_positions(group_sizes: Int[Array, "V G"], rows: int) -> Int[Array, "V rows"]:
    """Where each member's row goes when the rows of `V` members, each sorted by expert, are
    put in one expert order: expert 0's rows of member 0, of member 1, ..., then expert 1's.
    Rows past a member's groups go last."""
    ends = jnp.cumsum(group_sizes, axis=1)
    starts = ends - group_sizes
    totals = jnp.sum(group_sizes, axis=0)
    first = jnp.cumsum(totals) - totals  # where each expert's rows begin, folded
    earlier = jnp.cumsum(group_sizes, axis=0) - group_sizes  # its rows in earlier members
    expert = jax.vmap(lambda sizes: expert_of_rows(sizes, rows))(group_sizes)
    row = jnp.arange(rows, dtype=group_sizes.dtype)[None, :]

    def per_row(a: Array) -> Array:
        return jnp.take_along_axis(a, expert, axis=1)

    inside = first[expert] + per_row(earlier) + row - per_row(starts)
    used = ends[:, -1:]
    spare = rows - used
    past = jnp.sum(totals) + (jnp.cumsum(spare, axis=0) - spare) + row - used
    return jnp.where(row < used, inside, past)


def _fold(a: Array, positions: Array) -> Array:
    """`a (V, rows, ...)` as `(V * rows, ...)` in the folded order."""
    flat = positions.reshape(-1)
    order = jnp.zeros_like(flat).at[flat].set(jnp.arange(flat.shape[0], dtype=flat.dtype))
    return a.reshape((-1, *a.shape[2:]))[order]


def _unfold(a: Array, positions: Array) -> Array:
    """Undo `_fold`."""
    return a[positions.reshape(-1)].reshape((*positions.shape, *a.shape[1:]))


def _spans_rows(leaf: Array, rows: int) -> bool:
    """Whether a leaf of a quantized activation has one entry per row (its data, tile scales;
    not a per-tensor scale)."""
    return leaf.ndim == 2 and leaf.shape[0] == rows


def _refuse_forward(in_batched: list, *args: Any) -> None:
    """A mapping the forward cannot take, folded or mapped per member (per-example
    gradients): the experts' weights mapped with one state for all members."""
    del args
    _, w_b, _, states_b = in_batched
    if w_b and not any(jax.tree.leaves(states_b.kernel)):
        # Each member's experts quantized by one shared per-expert state: their amaxes would
        # need a span over the mapped axis per expert, which this GEMM does not take.
        raise NotImplementedError(
            "Fp8RaggedDot under jax.vmap with the experts' weights (rhs) mapped and the layer's "
            "state not: members with their own weights need their own FP8 state. Map the "
            "layer too (an ensemble: jax.vmap over the layer and its weights together), or "
            "map only the activation and group sizes."
        )


def _fold_forward(axis_size: int, in_batched: list, x, w, group_sizes, states) -> Fold | None:
    """The forward's fold: the members' rows in one expert order, when only the activation
    (and the group sizes) are mapped (`_refuse_forward` has checked the mapping)."""
    x_b, w_b, sizes_b, states_b = in_batched
    if sizes_b and not x_b:
        # Each member zeroes the rows past its own groups (`_held_only`): its FP8 activation
        # is its own, as if the activation were mapped too.
        x, x_b = jnp.broadcast_to(x, (axis_size, *x.shape)), True
    if not may_fold(x_b, states_b) or w_b:
        return None
    if not sizes_b:
        group_sizes = jnp.broadcast_to(group_sizes, (axis_size, *group_sizes.shape))
    rows = x.shape[1]
    positions = fold_positions(group_sizes, rows)
    folded_rows = axis_size * rows

    def unfold(outs: tuple[Array, Residuals]):
        out, residuals = outs
        # The activation's rows back in member order (FP8 values and their tile scales), and
        # the members' own group sizes: the backward folds them again. The rest spans the
        # mapped axis.
        q_x = jax.tree.map(
            lambda a: _unfold(a, positions) if _spans_rows(a, folded_rows) else a, residuals.q_x
        )
        q_x_b = jax.tree.map(lambda a: _spans_rows(a, folded_rows), residuals.q_x)
        residuals = residuals._replace(q_x=q_x, group_sizes=group_sizes)
        flags = unbatched(residuals)._replace(q_x=q_x_b, group_sizes=True)
        return (_unfold(out, positions), residuals), (True, flags)

    return (_fold(x, positions), w, jnp.sum(group_sizes, axis=0), states), unfold


def _fold_backward(axis_size: int, in_batched: list, residuals: Residuals, g) -> Fold | None:
    """The backward's fold: the saved activation's and the gradient's rows in one expert
    order again; the wgrad is then one grouped GEMM over all members' tokens."""
    del axis_size
    res_b, g_b = in_batched
    x_b, w_b = any(jax.tree.leaves(res_b.q_x)), any(jax.tree.leaves(res_b.q_w))
    states_b = state_of(res_b, _OPERAND_FIELDS)
    if not (may_fold(x_b, states_b) and not w_b and res_b.group_sizes and g_b):
        return None
    positions = fold_positions(residuals.group_sizes, g.shape[1])
    q_x = jax.tree.map(lambda a, b: _fold(a, positions) if b else a, residuals.q_x, res_b.q_x)
    folded = residuals._replace(q_x=q_x, group_sizes=jnp.sum(residuals.group_sizes, axis=0))

    def unfold(outs: tuple[Array, Array, States]):
        d_x, d_w, new_states = outs
        return (_unfold(d_x, positions), d_w, new_states), (True, False, unbatched(new_states))

    return (folded, _fold(g, positions)), unfold


def _gemm(recipe: Recipe, native: bool | None, precision: Any, static: Static) -> Gemm:
    """The grouped GEMM of one call, for the shared custom_vjp."""
    forward = functools.partial(_forward, recipe, native, precision, static.out)
    backward = functools.partial(_backward, recipe, native, *static.gradient_dtypes())
    return Gemm(
        recipe,
        folding_forward(
            forward,
            _fold_forward,
            Residuals,
            _OPERAND_FIELDS,
            static.gradient_vmaps,
            _refuse_forward,
        ),
        folding_backward(backward, _fold_backward, _OPERAND_FIELDS, static.gradient_vmaps),
    )


def _dispatched_gemm(recipe: Recipe, native: bool | None, precision: Any, static: Static) -> Gemm:
    """The dispatched grouped GEMM of one call (not foldable under `vmap`)."""
    forward = functools.partial(_dispatched_forward, recipe, native, precision, static.out)
    backward = functools.partial(_backward, recipe, native, *static.gradient_dtypes())
    return Gemm(recipe, forward, backward)


def fp8_dispatched_ragged_dot(
    recipe: Recipe,
    precision: Any,
    out_dtype: np.dtype,
    lhs: Array,
    rhs: Array,
    plan: ExpertExchange,
    states: States,
    name: str = "",
    native: bool | None = False,
) -> Array:
    """`lax.ragged_dot(plan.dispatch(lhs), rhs, plan.group_sizes)` as FP8 grouped GEMMs,
    with the activation quantized before the exchange: the FP8 rows and their scales cross
    the mesh, not `lhs`'s. `lhs (tokens, K)` is this device's tokens, `rhs` its experts'
    kernels; the gradient of `lhs` comes back through the exchange (in `lhs`'s dtype).
    Otherwise as `fp8_ragged_dot`."""
    operands = (lhs, rhs)
    (lhs, rhs), static = prepare(operands, states, out_dtype, name, KIND)
    gemm = _dispatched_gemm(recipe, native, precision, static)
    return fp8_gemm(gemm, static, lhs, rhs, (plan,), states)


def fp8_ragged_dot(
    recipe: Recipe,
    precision: Any,
    out_dtype: np.dtype,
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    states: States,
    name: str = "",
    native: bool | None = False,
) -> Array:
    """`lax.ragged_dot(lhs, rhs, group_sizes)` as FP8 grouped GEMMs under `recipe`.

    `states` holds the input's and output gradient's state (per tensor) and the kernel's
    (one per expert, stacked on a leading axis). Differentiating it computes dgrad and wgrad
    in FP8 and returns the new `states` as their cotangent, in the dtype `states` came in.
    `name` names the layer in errors; `native` is the `dispatch.choose` option of the Hopper
    kernels (`grouped_rules.native_choice`). The arguments are checked by the caller.
    """
    operands = (lhs, rhs, group_sizes)
    (lhs, rhs, group_sizes), static = prepare(operands, states, out_dtype, name, KIND)
    gemm = _gemm(recipe, native, precision, static)
    return fp8_gemm(gemm, static, lhs, rhs, (group_sizes,), states)

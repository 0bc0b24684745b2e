"""The batching rules of the FP8 GEMMs: a `vmap`ped axis folded into one GEMM, or mapped.

Under `jax.vmap(model)(batch)` JAX would run the forward and backward once per example: the
wgrad of an unbatched weight would become a batched outer product, summed afterwards, not a
GEMM, and block recipes would see one token at a time. The GEMMs' custom batching rules fold
the mapped axis into the GEMM instead, so the wgrad is one FP8 GEMM over all tokens. How it
folds is each GEMM's own (`dense`: into its rows or its batch; `grouped`: into its rows, in
one expert order); the skeleton around it is shared: decide, fold, call, unfold, or else map
the GEMM per member.

The residuals of both GEMMs are NamedTuples: a field made from each operand of the forward
(`operand_fields`, named in the operands' order), which carries the mapped axis where its
operand does, and the state, which spans it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
from jax.custom_batching import custom_vmap

from ..core.contexts import Setting, setting
from ..core.jax_private import GradientUnderVmap
from ..kernels import dispatch

_PER_EXAMPLE: Setting[bool] = Setting("fp8jax_per_example", False)


@contextlib.contextmanager
def per_example_gradients() -> Iterator[None]:
    """Trace gradients that a `vmap` maps (per-example gradients): a trace of its own in
    JAX's caches, whose GEMMs a `vmap` that nothing else tells apart maps per member.

    Folding is what makes `grad(vmap(model))` run its wgrad as one GEMM; under
    `vmap(grad(...))` it would sum what must stay per example. Which of a call's `vmap`s
    are below its gradient is read from JAX's traces (`Static.gradient_vmaps`);
    [`fp8jax.filter_value_and_grad`][] enters this when it is itself being vmapped, so
    that its jitted gradient is not reused from a trace made outside any `vmap`.
    """
    with setting(_PER_EXAMPLE, True):
        yield


def per_example_traced() -> bool:
    """Whether this is traced inside [`per_example_gradients`][]."""
    return _PER_EXAMPLE.get()


def may_fold(x_batched: bool, states_batched: Any) -> bool:
    """Whether a mapped axis may fold into a GEMM at all: the activation carries it and the
    state (flags `states_batched`) is shared by the whole batch."""
    return x_batched and not any(jax.tree.leaves(states_batched))


def _maps_a_gradient(gradient_vmaps: GradientUnderVmap | None) -> bool:
    """In a `custom_vmap` rule: whether its `vmap` maps a whole gradient (per-example
    gradients), by the traces of the call (`gradient_vmaps`), else by the context."""
    if gradient_vmaps is not None:
        return gradient_vmaps.vmap_is_below()
    return per_example_traced()


def unbatched(tree: Any) -> Any:
    """Batched flags for `tree`: none of its leaves carries the mapped axis."""
    return jax.tree.map(lambda _: False, tree)


def state_of(residual_flags: NamedTuple, operand_fields: tuple[str, ...]) -> NamedTuple:
    """The batched flags of residuals with those of `operand_fields` cleared: what is left
    is the state's."""
    return residual_flags._replace(**dict.fromkeys(operand_fields, False))


#: What a GEMM's fold returns: the folded arguments, and how to unfold the results (into
#: `(results, batched flags)`).
Fold = tuple[tuple[Any, ...], Callable[[Any], tuple[Any, Any]]]
#: `fold(axis_size, in_batched, *args)`: a `Fold`, or `None` to map the GEMM per member.
FoldRule = Callable[..., Fold | None]
#: `refuse(in_batched, *args)`: raises for a mapping the GEMM cannot take, folded or not.
RefuseRule = Callable[..., None]


def _axis(batched: bool) -> int | None:
    return 0 if batched else None


def _batched(out_axes: Any, outs: Any) -> Any:
    """Per-leaf batched flags of `outs` from a (prefix) tree of vmap `out_axes`."""
    return jax.tree.map(
        lambda axis, sub: jax.tree.map(lambda _: axis is not None, sub),
        out_axes,
        outs,
        is_leaf=lambda a: a is None or isinstance(a, int),
    )


def _folding(
    raw: Callable[..., Any],
    fold: FoldRule,
    member_axes: Callable[[list], Any],
    gradient_vmaps: GradientUnderVmap | None,
    refuse: RefuseRule | None = None,
) -> Callable[..., Any]:
    """`raw` as a `custom_vmap`: under `vmap`, folded as `fold` says (never when the `vmap`
    maps a whole gradient, `_maps_a_gradient`), else mapped per member with the out_axes
    `member_axes(in_batched)`; `refuse` first checks the mapping either way."""

    @custom_vmap
    def call(*args):
        return raw(*args)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        if refuse is not None:
            refuse(in_batched, *args)
        per_member = _maps_a_gradient(gradient_vmaps)
        folded = None if per_member else fold(axis_size, in_batched, *args)
        if folded is None:
            out_axes = member_axes(in_batched)
            in_axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
            # A `vmap` of no members maps the XLA path: a kernel has no tile to run.
            empty = dispatch.empty_batch() if axis_size == 0 else contextlib.nullcontext()
            with empty:
                outs = jax.vmap(raw, in_axes=in_axes, out_axes=out_axes)(*args)
            return outs, _batched(out_axes, outs)
        args, unfold = folded
        return unfold(call(*args))

    return call


def folding_forward(
    raw: Callable[..., Any],
    fold: FoldRule,
    residuals: type,
    operand_fields: tuple[str, ...],
    gradient_vmaps: GradientUnderVmap | None = None,
    refuse: RefuseRule | None = None,
) -> Callable[..., Any]:
    """A GEMM's forward `raw(x, w, *rest, states) -> (out, residuals)` with its batching rule
    (never folded by a `vmap` below the gradient, of those in `gradient_vmaps`); `refuse`
    raises for mappings it cannot take, folded or mapped per member (per-example gradients).

    Mapped per member, unbatched state stays unbatched (its amaxes span the mapped axis), and
    so does the residual field `operand_fields[i]` when operand `i` is not mapped.
    """

    def member_axes(in_batched: list) -> Any:
        *operands_b, states_b = in_batched
        stacked = any(jax.tree.leaves(states_b))  # each member its own state
        axes = residuals(**dict.fromkeys(residuals._fields, _axis(stacked)))
        mapped = {f: _axis(b or stacked) for f, b in zip(operand_fields, operands_b, strict=True)}
        return (0, axes._replace(**mapped))

    return _folding(raw, fold, member_axes, gradient_vmaps, refuse)


def folding_backward(
    raw: Callable[..., Any],
    fold: FoldRule,
    operand_fields: tuple[str, ...],
    gradient_vmaps: GradientUnderVmap | None = None,
) -> Callable[..., Any]:
    """A GEMM's backward `raw(residuals, g) -> (d_x, d_w, new_states)` with its batching
    rule (as `folding_forward`'s). Mapped per member, the new state is batched where the
    residual state was."""

    def member_axes(in_batched: list) -> Any:
        state = state_of(in_batched[0], operand_fields)
        return (0, 0, _axis(any(jax.tree.leaves(state))))

    return _folding(raw, fold, member_axes, gradient_vmaps)

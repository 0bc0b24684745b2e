"""Gradient accumulation over microbatches: gradients averaged, FP8 state of the largest amax.

Each microbatch runs its own forward and backward (one microbatch's activations live at a
time), under `lax.scan`. Its loss is divided by the number of microbatches before it is
differentiated, so the output gradients reaching each FP8 layer are those of the full batch,
element for element: the FP8 state of the accumulated step (the max of the microbatches'
amaxes) is that of one step over the whole batch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..core.stats import ExpertStats, combine_states
from ..core.updates import is_overwrite, partition_for_grad_overwrite
from ..recipes import ResidualState, TensorState
from .grad import filter_value_and_grad


def _named_array() -> type | tuple[()]:
    """Haliax's `NamedArray` where Haliax is loaded (looked up, never imported), else `()`:
    an `isinstance` test that no value passes."""
    haliax = sys.modules.get("haliax")
    return () if haliax is None else haliax.NamedArray


def _whole(x: Any) -> bool:
    """Whether batch leaf `x` goes whole to every microbatch: a scalar (a Python or NumPy
    number, a 0-d array, a step count or temperature beside the batch) or another non-array
    leaf, which has no batch axis to cut."""
    return not eqx.is_array(x) or jnp.ndim(x) == 0


def _split(x: Any, microbatches: int, where: str) -> Any:
    """`x` cut into `microbatches` slices along its first axis, stacked; `where` names it
    among the batch arguments (`[1]['y']`) for the errors."""
    size = x.shape[0]
    if size % microbatches:
        counts = [str(k) for k in range(1, size + 1) if size % k == 0]
        fits = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} or {counts[-1]}"
        raise ValueError(
            f"microbatches={microbatches}: batch argument {where}: a batch axis of size "
            f"{size} does not split into {microbatches} equal microbatches; it splits into "
            f"{fits}. Pass one of those, or a batch whose size is a multiple of {microbatches}."
        )
    return x.reshape((microbatches, x.shape[0] // microbatches) + x.shape[1:])


def _batch_axis_name(batch: Any, named: Any) -> str | None:
    """The batch's axis name among its Haliax `NamedArray`s: of their first axes' names,
    the one the most of them hold (ties: the earliest in the batch), or None for none."""
    arrays = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, named))
    arrays = [x for x in arrays if isinstance(x, named) and x.axes]
    firsts = list(dict.fromkeys(x.axes[0].name for x in arrays))
    if not firsts:
        return None
    return max(firsts, key=lambda n: sum(n in x.shape for x in arrays))


def _split_batch(batch: Any, microbatches: int) -> tuple[Any, Any]:
    """`batch` as `(cut, whole)`: every array of it with an axis cut along its first axis
    into `microbatches` slices, stacked (None elsewhere), and the leaves that go whole to
    every microbatch (`_whole`; None elsewhere). A Haliax `NamedArray` (looked up, never
    imported) is cut along the batch's axis (`_batch_axis_name`), or goes whole without it:
    its axes become a slice's, that axis resized, so that each slice is a `NamedArray`
    again."""
    named = _named_array()

    def split(path: Any, x: Any) -> Any:
        where = jax.tree_util.keystr(path)
        if not isinstance(x, named):
            return _split(x, microbatches, where)
        at = [a.name for a in x.axes].index(batch_axis)  # not first: cut there all the same
        array = _split(jnp.moveaxis(x.array, at, 0), microbatches, where)
        axes = list(x.axes)
        axes[at] = axes[at].resize(axes[at].size // microbatches)
        return type(x).tree_unflatten(tuple(axes), (jnp.moveaxis(array, 1, at + 1),))

    def is_leaf(x: Any) -> bool:
        return isinstance(x, named)

    batch_axis = _batch_axis_name(batch, named)

    def cut(x: Any) -> bool:
        if isinstance(x, named) and batch_axis is not None and batch_axis not in x.shape:
            return False  # no batch axis (a mask over the features): whole, as a scalar
        return not _whole(x.array if isinstance(x, named) else x)

    whole = eqx.filter(batch, lambda x: not cut(x), is_leaf=is_leaf)
    to_cut = eqx.filter(batch, cut, is_leaf=is_leaf)
    if not jax.tree.leaves(to_cut):
        raise ValueError(
            f"microbatches={microbatches}: the batch holds no array to split (the loss was "
            "given no batch arguments, or only scalars, None and empty containers); pass the "
            "batch, an array with a leading batch axis, or use microbatches=1."
        )
    cut_batch = jax.tree_util.tree_map_with_path(split, to_cut, is_leaf=is_leaf)
    return cut_batch, whole


def _with_whole(micro: Any, whole: Any) -> Any:
    """A microbatch's cut arrays and the leaves every microbatch gets whole, as one batch."""
    return eqx.combine(micro, whole, is_leaf=lambda x: isinstance(x, _named_array()))


def _stacked(first: Any, rest: Any, microbatches: int) -> Any:
    """The first microbatch's aux and the scan's stack of the rest's (`None` for none) as one
    stack. A Haliax `NamedArray` gains a leading `microbatch` axis: the scan stacks its array
    but leaves its axes, which would no longer match it."""
    named = _named_array()

    def stack(a: Any, b: Any = None) -> Any:
        if isinstance(a, named):
            array = stack(a.array, None if b is None else b.array)
            axis = sys.modules["haliax"].Axis("microbatch", microbatches)
            return type(a).tree_unflatten((axis, *a.axes), (array,))
        return a[None] if b is None else jnp.concatenate([a[None], b])

    if rest is None:
        return jax.tree.map(stack, first, is_leaf=lambda x: isinstance(x, named))
    return jax.tree.map(stack, first, rest, is_leaf=lambda x: isinstance(x, named))


def _is_scaled(x: Any) -> bool:
    return isinstance(x, TensorState | ResidualState)


def _is_state_node(x: Any) -> bool:
    return _is_scaled(x) or isinstance(x, ExpertStats)


def _larger(total: Any, new: Any) -> Any:
    """Of two states of one operand, that with the larger newest amax, whole; their max leaf
    by leaf where the amaxes tie (a zero state, of a use that did not run, then loses).

    A scale is a function of its amax: the max of the scales, beside the max of the
    amaxes, paired the smallest microbatch's scale with the largest's amax. Per leading
    index (an expert's kernel)."""
    if not _is_scaled(total):  # statistics: by max, an expert's tokens summed
        return combine_states(total, new)
    a, b = total.amax_history[..., 0], new.amax_history[..., 0]

    def pick(t: Array, n: Array) -> Array:
        def flag(f: Array) -> Array:
            return jnp.reshape(f, f.shape + (1,) * (t.ndim - f.ndim))

        return jnp.where(flag(b > a), n, jnp.where(flag(a > b), t, jnp.maximum(t, n)))

    return jax.tree.map(pick, total, new)


def _combine(total: Any, new: Any) -> Any:
    """Sum the trainable gradients; of the FP8 state keep, operand by operand, the state of
    the larger amax (`_larger`), and the max of other leaves (statistics; an expert's tokens
    are summed)."""
    total_state, total_rest = partition_for_grad_overwrite(total)
    new_state, new_rest = partition_for_grad_overwrite(new)
    rest = jax.tree.map(jnp.add, total_rest, new_rest)
    state = jax.tree.map(_larger, total_state, new_state, is_leaf=_is_state_node)
    return eqx.combine(state, rest, is_leaf=is_overwrite)


def _described(x: Any) -> str:
    """`x` named for an error: an array by its shape, anything else by its type."""
    return f"an array of shape {jnp.shape(x)}" if eqx.is_array(x) else f"a {type(x).__name__}"


def is_count(value: Any) -> bool:
    """Whether `value` is a whole number >= 1 (a Python or NumPy integer, not a bool)."""
    return (
        not isinstance(value, bool | np.bool_)
        and isinstance(value, int | np.integer)
        and value >= 1
    )


def check_unroll(what: str, unroll: Any) -> int | bool:
    """`unroll` as a scan's (an int >= 1, a NumPy integer as an int, or a bool, a NumPy
    one as a bool); a `ValueError` naming `what` for anything else."""
    if isinstance(unroll, bool | np.bool_) or is_count(unroll):
        return bool(unroll) if isinstance(unroll, bool | np.bool_) else int(unroll)
    raise ValueError(
        f"{what}={unroll!r} should be an int >= 1 (microbatches per iteration of the "
        "scan) or True (all of them), as lax.scan's unroll."
    )


def stackable_aux(aux: Any, caller: str) -> Any:
    """`aux` with each leaf an array, to be stacked over microbatches; `caller` names who
    asks, in the error for a leaf that is neither an array nor a number."""

    def leaf(path: Any, x: Any) -> Array:
        if isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
            return jnp.asarray(x)
        raise TypeError(
            f"{caller}: aux{jax.tree_util.keystr(path)} is a {type(x).__name__}; aux is "
            "stacked over the microbatches, so each of its leaves must be an array or a number."
        )

    return jax.tree_util.tree_map_with_path(leaf, aux)


def accumulate_gradients(
    fun: Callable[..., Any],
    microbatches: int,
    *,
    has_aux: bool = False,
    unroll: int | bool = 1,
) -> Callable[..., tuple[Any, Any]]:
    """`fp8jax.filter_value_and_grad(fun)`, computed over `microbatches` slices of the batch.

    **Arguments:**

    - `fun`: `fun(model, *batch) -> loss` (a mean over the batch), or `(loss, aux)` with
      `has_aux`.
    - `microbatches`: how many equal slices to cut every array of the batch arguments into
      along its first axis (a Haliax `NamedArray`'s batch axis, resized in each slice);
      they run one after another in a `lax.scan`, so activation memory is that of one.
      Scalars (Python and NumPy numbers, 0-d arrays: a step count, a temperature) and other
      non-array leaves go whole to every microbatch, a PRNG key too (every microbatch then
      draws the same dropout mask: pass one key per example, `(batch,)`, to have them cut);
      so does a `NamedArray` without the batch's axis name (of the NamedArrays' first axes,
      the one most of them hold; a NamedArray holding it elsewhere is cut there): a mask
      over features. A plain array without the batch axis (a table) would be cut too:
      close over it in `fun`.
    - `unroll`: the scan's `unroll` (`lax.scan`'s: an int >= 1, or `True` for all of them).
      XLA does not hoist the weights' quantization out of the scan (seen in H100 compiles):
      each microbatch quantizes every FP8 weight again (the same values). Unrolled, the
      microbatches are straight-line code in which XLA computes each weight's FP8 copies
      once (its common-subexpression elimination) and keeps them: the cost is temp memory
      and compile time. On an H100 compile of an MoE layer (`benchmarks/moe_cost.py
      --microbatches 4 --unroll`, Mixtral-like, an estimate) `unroll=True` cut the blockwise
      step's non-GEMM HBM bytes from 40.0 to 21.0 GB (the weights' quantization from 15.3 to
      3.8 GB) and grew its temp memory from 1.9 to 2.7 GiB.

    **Returns:** a function `(model, *batch) -> (loss, grads)`, the batch passed
    positionally (`((loss, aux), grads)` with
    `has_aux`, `aux` stacked over microbatches, a Haliax `NamedArray` along a new leading
    `microbatch` axis): the loss and the trainable gradients averaged
    over microbatches, and of each operand's FP8 state that of the microbatch with the
    largest amax (its scale with it, as one step over the whole batch records them; delayed
    scaling's history gets that amax once; statistics by max, the tokens each expert got
    summed). The microbatches' gradients are summed in the gradients' own dtype (the
    parameters'): with float32 parameters the sum differs from the whole batch's by float32
    summation order, but with bfloat16 parameters each addition rounds to bfloat16, an error
    that grows with the number of microbatches. Keep float32 master weights (a
    [`fp8jax.Policy`][] with float32 parameters and a bfloat16 compute dtype) to accumulate
    in float32. With delayed scaling every microbatch is cast with the same scales, so the
    result is that of the whole batch up to that summation (from the second step: on the
    first, an empty history casts each microbatch with its own amax, the warm start);
    recipes that scale each tensor by its own amax (current, blockwise, MXFP8, residual)
    cast each microbatch by its own, which differs from the whole batch by FP8 rounding.

    ```python
    loss, grads = fp8jax.accumulate_gradients(loss_fn, 4)(model, x, y)
    ```
    """
    if not callable(fun):
        raise TypeError(
            f"accumulate_gradients: fun={fun!r} is not callable; it should be "
            "fun(model, *batch) -> loss."
        )
    if not is_count(microbatches):
        raise ValueError(
            f"accumulate_gradients: microbatches={microbatches!r} should be an int >= 1."
        )
    microbatches = int(microbatches)
    if not isinstance(has_aux, bool | np.bool_):  # a NumPy bool: the bool it holds
        raise TypeError(f"accumulate_gradients: has_aux={has_aux!r} should be True or False.")
    has_aux = bool(has_aux)
    unroll = check_unroll("accumulate_gradients: unroll", unroll)

    def scaled(model: Any, *batch: Any) -> Any:
        out = fun(model, *batch)
        pair = isinstance(out, tuple | list)
        if has_aux and not (pair and len(out) == 2):
            got = f"a {type(out).__name__} of {len(out)}" if pair else _described(out)
            raise TypeError(
                f"accumulate_gradients(has_aux=True): fun returned {got}, not a pair "
                "(loss, aux); return both, or drop has_aux."
            )
        if not has_aux and pair:
            raise TypeError(
                f"accumulate_gradients: fun returned a {type(out).__name__} of {len(out)}, not "
                "a scalar loss; for (loss, aux), pass has_aux=True."
            )
        if has_aux:
            loss, aux = out
            return loss / microbatches, stackable_aux(aux, "accumulate_gradients(has_aux=True)")
        return out / microbatches

    value_and_grad = filter_value_and_grad(scaled, has_aux=has_aux)

    @functools.wraps(fun)
    def run(model: Any, *batch: Any, **keywords: Any) -> tuple[Any, Any]:
        if keywords:
            raise TypeError(
                f"accumulate_gradients: keyword argument(s) {', '.join(keywords)}: the batch "
                "arguments are cut into microbatches along their first axis and must be "
                "passed positionally, after the model (run(model, x, y))."
            )
        if microbatches == 1:
            # `fun` checked as for several (its loss divided by 1: exactly itself).
            value, grads = value_and_grad(model, *batch)
            if has_aux:  # stacked over its one microbatch, as over several
                value = (value[0], _stacked(value[1], None, 1))
            return value, grads
        slices, whole = _split_batch(batch, microbatches)
        first = jax.tree.map(lambda x: x[0], slices)
        rest = jax.tree.map(lambda x: x[1:], slices)
        value, grads = value_and_grad(model, *_with_whole(first, whole))

        def body(carry: Any, micro: Any) -> tuple[Any, Any]:
            value, grads = carry
            new_value, new_grads = value_and_grad(model, *_with_whole(micro, whole))
            aux = new_value[1] if has_aux else None
            if has_aux:
                value = (value[0] + new_value[0], value[1])
            else:
                value = value + new_value
            return (value, _combine(grads, new_grads)), aux

        dynamic, static = eqx.partition((value, grads), eqx.is_array)

        def array_body(carry: Any, micro: Any) -> tuple[Any, Any]:
            (value, grads), aux = body(eqx.combine(carry, static), micro)
            return eqx.filter((value, grads), eqx.is_array), aux

        dynamic, auxes = jax.lax.scan(array_body, dynamic, rest, unroll=unroll)
        value, grads = eqx.combine(dynamic, static)
        if has_aux:
            value = (value[0], _stacked(value[1], auxes, microbatches))
        return value, grads

    return run

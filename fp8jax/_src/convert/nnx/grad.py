"""Gradients of FP8 Flax NNX models (`nnx_value_and_grad`): the FP8 state's uses combine by
max, each recorded scale paired with its largest amax; the state a layer received, checked
against its own (`received_op`, which `nnx_update_fp8_state` writes)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from ...core import jax_private
from ...ops.base import with_recorded_scales
from .layers import AbstractFp8NnxDot, Fp8State, is_variable


def _fp8_variables(tree: Any) -> list[Fp8State]:
    return [node for _, node in nnx.iter_graph(tree, graph=True) if isinstance(node, Fp8State)]


def _token_variables(model: Any) -> set[int]:
    """The ids of the variables holding the tokens each expert got (`ExpertStats.tokens`)."""
    nodes = nnx.iter_graph(model, graph=True)
    layers = [node for _, node in nodes if isinstance(node, AbstractFp8NnxDot)]
    return {id(n.state.stats.tokens) for n in layers if hasattr(n.state.stats, "tokens")}


def _traced(leaf: Any) -> bool:
    """Whether `nnx_value_and_grad`'s jit traces an argument's leaf: arrays, numbers (a step
    count or a rate, which would recompile every call as static values) and NNX objects;
    other values (a Python bool or str a loss branches on) stay static."""
    if isinstance(leaf, bool):
        return False
    number = isinstance(leaf, int | float | complex)
    array = isinstance(leaf, jax.Array | np.ndarray | np.generic)
    return number or array or nnx.graph.is_graph_node(leaf)


@dataclasses.dataclass(frozen=True)
class _Static:
    """The arguments of a call but their traced leaves: the structure and the static values."""

    treedef: Any
    mask: tuple[bool, ...]
    values: tuple[Any, ...]

    @staticmethod
    def split(tree: Any) -> tuple[list, _Static]:
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_traced)
        mask = tuple(map(_traced, leaves))
        static = tuple(x for x, t in zip(leaves, mask, strict=True) if not t)
        return [x for x, t in zip(leaves, mask, strict=True) if t], _Static(treedef, mask, static)

    def merge(self, traced: list) -> Any:
        dynamic, static = iter(traced), iter(self.values)
        leaves = [next(dynamic) if t else next(static) for t in self.mask]
        return jax.tree.unflatten(self.treedef, leaves)


def nnx_value_and_grad(
    fun: Callable[..., Any], *, wrt: Any = nnx.Param, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`nnx.value_and_grad` for FP8 NNX models: differentiates the first argument's `wrt`
    variables and its [`fp8jax.Fp8State`][], whose uses combine by max.

    The gradient is an `nnx.State` holding the `wrt` gradients and, for each `Fp8State`, its
    new value (for a layer used several times, the largest amax and, where its recipe
    records one, the scale of that amax beside it, as [`fp8jax.filter_value_and_grad`][]
    gives them). Pass it to [`fp8jax.nnx_update_fp8_state`][] and to `optimizer.update` (an
    `nnx.Optimizer` with the same `wrt` ignores the `Fp8State`).

    Plain `nnx.value_and_grad(fun, argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))`
    gives the same result when each FP8 layer runs once per step. When one runs several
    times (a shared layer, a loop, `nnx.scan` over microbatches), JAX would add the
    cotangents of its state, that is, add amaxes; this function views the state in a
    float32 dtype whose cotangents combine by `max` for the duration of `fun` (so the
    history gets the largest amax), and restores it after. Plain `nnx.value_and_grad` raises
    for a layer called twice in one trace, and adds silently across `nnx.scan` iterations.

    `fun` is traced under `nnx.jit` (the max-combining dtype exists only in traced code);
    inside your own `nnx.jit`ted step that costs nothing. Called outside one, arrays and NNX
    objects among the arguments are traced, and Python numbers as `jax.jit` traces them;
    other values (a Python bool or str the loss branches on) are static (a new value
    recompiles).

    **Arguments:**

    - `fun`: `fun(model, *args, **kwargs)`, returning a scalar loss (or `(loss, aux)` with
      `has_aux=True`).
    - `wrt`: an NNX filter for the trained variables; `nnx.Param` by default.
    - `has_aux`: as for `nnx.value_and_grad`.

    ```python
    loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
    ```
    """
    if not callable(fun):
        raise TypeError(f"nnx_value_and_grad: fun={fun!r} is not callable.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"nnx_value_and_grad: has_aux={has_aux!r} should be True or False.")
    try:
        nnx.filterlib.to_predicate(wrt)
    except (TypeError, ValueError):  # Flax's own message fails to format (`{wrt:!r}`)
        raise TypeError(
            f"nnx_value_and_grad: wrt={wrt!r} is not an NNX filter; pass one as to "
            "nnx.Optimizer: a Variable type (nnx.Param), a tuple of them, or nnx.All(...), "
            "nnx.PathContains(...), ..."
        ) from None

    @functools.wraps(fun)
    def with_max_state(model: Any, *args: Any, **kwargs: Any) -> Any:
        variables = _fp8_variables(model)
        tokens = _token_variables(model)
        originals = [v.get_value() for v in variables]
        for variable, value in zip(variables, originals, strict=True):
            if id(variable) not in tokens:  # they add across uses (max_combining_view)
                variable.set_value(jax.tree.map(jax_private.to_max_combining, value))
        try:
            return fun(model, *args, **kwargs)
        finally:
            for variable, value in zip(variables, originals, strict=True):
                variable.set_value(value)

    value_and_grad = nnx.value_and_grad(
        with_max_state,
        argnums=nnx.DiffState(0, (wrt, Fp8State)),
        has_aux=has_aux,
        graph=True,  # DiffState needs graph mode; the user's own code runs in theirs
        graph_updates=True,
    )

    def paired(model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        value, grads = value_and_grad(model, *args, **kwargs)
        _pair_recorded_scales(model, grads)
        return value, grads

    def split_call(traced: list, static: _Static) -> tuple[Any, Any]:
        args, kwargs = static.merge(traced)
        return paired(*args, **kwargs)

    jitted = nnx.jit(split_call, static_argnums=1, graph=True, graph_updates=True)

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not args:
            raise TypeError("nnx_value_and_grad: call it with the model as first argument.")
        if jax_private.tracing():
            return paired(*args, **kwargs)
        return jitted(*_Static.split((args, kwargs)))

    return run


def sub_state(grads: Any, path: tuple[Any, ...]) -> Any:
    """The entry of `grads` (an `nnx.State`) at `path`, or `None` where it has none."""
    node = grads
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _flat(tree: Any) -> dict[str, Any]:
    """Each `Fp8State` of `tree` (an `nnx.State`, or a layer's `state`), by its dotted path."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p): v for p, v in flat}


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """The shape of each `Fp8State` of `tree`, by its dotted path."""
    return {
        path: tuple(jax.numpy.shape(v.get_value() if is_variable(v) else v))
        for path, v in _flat(tree).items()
    }


def received_op(layer: AbstractFp8NnxDot, received: Any, path: tuple[Any, ...]) -> Any:
    """The state `received` for `layer`, refused unless shaped as its own: another model's
    (another recipe, history length or telemetry setting) would be broadcast into its arrays,
    or fail in NNX's words."""
    ours, theirs = _shapes(layer.state), _shapes(received)
    if ours != theirs:
        where = layer.name or ".".join(str(p) for p in path)
        key = min(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise ValueError(
            f"nnx_update_fp8_state: the gradients' Fp8State {key!r} of the FP8 layer at "
            f"{where!r} is {theirs.get(key, 'absent')}, where the layer's is "
            f"{ours.get(key, 'absent')}: they are another model's gradients (another recipe "
            "or telemetry setting). Pass the gradients of this model."
        )
    new = nnx.clone(layer, graph=True)
    nnx.update(new, nnx.State({"state": received}))
    return new.value()


def _pair_recorded_scales(model: Any, grads: Any) -> None:
    """`grads`' FP8 states (`nnx_value_and_grad`'s), in place, each given the scales its
    recipe records beside its amaxes (`with_recorded_scales`: a layer's uses combine by
    max, the largest amax beside the largest scale), as `fp8jax.filter_value_and_grad`'s
    are. A layer whose recipe records none (delayed scaling) is left as it is: no op."""
    for path, layer in nnx.iter_graph(model, graph=True):
        received = sub_state(grads, (*path, "state"))
        if not isinstance(layer, AbstractFp8NnxDot) or received is None:
            continue
        op = received_op(layer, received, path)
        paired = with_recorded_scales(op)
        if paired is op:
            continue
        new = nnx.clone(layer, graph=True)
        new.set_value(paired)
        fresh = _flat(new.state)
        for key, variable in _flat(received).items():
            variable.set_value(fresh[key].get_value())

"""A restored state's FP8 layers made ready to train: an older checkpoint's states given
their `scale_inv`, a NaN or inf in an amax history dropped, every layer merged with its
own state, a NaN or inf left warned of."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..recipes import ResidualState, TensorState
from .checkpoint_record import is_layer, layer_tag

T = TypeVar("T")


class _StoredTensorState(eqx.Module):
    """A [`fp8jax.TensorState`][] as checkpoints stored it before it kept `scale_inv`: the
    same leaves, under the same names, less that one."""

    scale: Array
    amax_history: Array


def _is_tensor_state(x: Any) -> bool:
    return type(x) is TensorState


def as_stored(like: T) -> T:
    """`like` with each `TensorState` as a checkpoint written before it kept `scale_inv`
    holds it, to restore such a checkpoint into."""

    def stored(state: Any) -> Any:
        if not _is_tensor_state(state):
            return state
        return _StoredTensorState(state.scale, state.amax_history)

    return jax.tree.map(stored, like, is_leaf=_is_tensor_state)


def _is_state(x: Any) -> bool:
    return isinstance(x, TensorState | ResidualState | _StoredTensorState)


#: The fields of `TensorState` and `ResidualState`, as an `nnx.State` names their variables.
_FIELDS = frozenset(f.name for c in (TensorState, ResidualState) for f in dataclasses.fields(c))


def _state_leaves(state: Any) -> list[tuple[str, str, Array]]:
    """Each floating array of an FP8 layer's state in `state`: its path, its field's name
    (`amax_history`, `scale`, ...) and the array; in an `nnx.State` (variables, no layer),
    each `Fp8State` variable of such a field."""

    def is_leaf(x: Any) -> bool:
        return _is_state(x) or layer_tag(x) is not None

    leaves = []
    for where, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_leaf)[0]:
        if layer_tag(node) is not None:
            keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in where]
            value = node.get_value()
            if keys and keys[-1] in _FIELDS and "stats" not in keys and eqx.is_array(value):
                if jnp.issubdtype(value.dtype, jnp.floating):
                    leaves.append((jax.tree_util.keystr(where), keys[-1], value))
            continue
        if not _is_state(node):
            continue
        for inner, a in jax.tree_util.tree_flatten_with_path(node)[0]:
            if eqx.is_array(a) and jnp.issubdtype(a.dtype, jnp.floating):
                field = getattr(inner[0], "name", "")
                leaves.append((jax.tree_util.keystr((*where, *inner)), field, a))
    return leaves


def _non_finite(state: Any) -> list[tuple[str, str, Array, int, float]]:
    """Each floating array of an FP8 layer's state in `state` holding a NaN or an inf: as
    `_state_leaves` gives it, with its first such entry (flat index) and that entry's value.
    The arrays a process holds whole are read in one transfer and checked on the host (a
    model's thousands of small states: no op each); others (split over processes) on device."""
    leaves = _state_leaves(state)
    whole = [a if getattr(a, "is_fully_addressable", True) else None for _, _, a in leaves]
    found = []
    for (name, field, a), host in zip(leaves, jax.device_get(whole), strict=True):
        if host is None:
            if bool(jnp.all(jnp.isfinite(a))):
                continue
            flat = jnp.ravel(a)
            first = int(jnp.argmin(jnp.isfinite(flat)))
            found.append((name, field, a, first, float(flat[first])))
            continue
        flat = np.asarray(host, np.float64).ravel()
        bad = np.flatnonzero(~np.isfinite(flat))
        if bad.size:
            found.append((name, field, a, int(bad[0]), float(flat[bad[0]])))
    return found


def _warn(path: os.PathLike | str, name: str, first: int, value: float, done: str) -> None:
    warnings.warn(
        f"load_checkpoint: {os.fspath(path)!r}'s FP8 state {name} holds {value} (flat index "
        f"{first}), which training never records: {done}",
        RuntimeWarning,
        stacklevel=5,
    )


def without_non_finite_amaxes(state: T, path: os.PathLike | str) -> tuple[T, bool]:
    """`state` with each NaN or inf in an FP8 layer's amax history set to 0, no amax
    recorded, as a step's own non-finite amax is never recorded (`received_state`); warned
    of, naming the leaf. Training never records one, so the checkpoint was changed after it
    was written; kept, it would make every step non-finite (each step's new state rolls it
    along) and `make_train_step` skip them all. Also whether another leaf (a scale) holds
    one: `warn_non_finite` then looks again once the state is merged."""
    found = _non_finite(state)
    bad = set()
    for name, field, a, first, value in found:
        if field == "amax_history":
            bad.add(id(a))
            _warn(path, name, first, value, "each such entry is set to 0 (no amax recorded).")
    state = jax.tree.map(lambda a: jnp.where(jnp.isfinite(a), a, 0) if id(a) in bad else a, state)
    return state, len(bad) < len(found)


def warn_non_finite(state: Any, path: os.PathLike | str) -> None:
    """Warn of a NaN or an inf left in a restored, merged FP8 layer's state (a scale that no
    history recomputes), naming the leaf; loaded as it is."""
    for name, _, _, first, value in _non_finite(state):
        _warn(path, name, first, value, "loaded as it is.")


def settled(state: T) -> T:
    """`state` with each FP8 layer merged with its own state: delayed scaling's scales
    recomputed from the restored histories. A no-op for a checkpoint of this version, whose
    scales are the ones their next step uses; one written before fp8jax kept that scale
    (its states held the scale of the step before) then resumes with the same scales as
    if it had never stopped. States restored without `scale_inv` (an older checkpoint) get
    it from their scale first."""

    def with_inverse(state: Any) -> Any:
        if not isinstance(state, _StoredTensorState):
            return state
        return TensorState(state.scale, state.amax_history)

    def is_stored(node: Any) -> bool:
        return isinstance(node, _StoredTensorState)

    state = jax.tree.map(with_inverse, state, is_leaf=is_stored)
    return jax.tree.map(lambda n: _merged(n) if is_layer(n) else n, state, is_leaf=is_layer)


def _is_variable(x: Any) -> bool:
    """Whether `x` is a Flax NNX variable (an FP8 NNX layer's state holds its arrays in them)."""
    return hasattr(x, "get_value") and hasattr(x, "set_value")


def _merged(layer: Any) -> Any:
    """`layer` merged with its own state; an NNX layer's variables (the restored copies) set
    to the merged values in place."""
    if not any(map(_is_variable, jax.tree.leaves(layer, is_leaf=_is_variable))):
        return layer.merge(layer)
    values = jax.tree.map(lambda v: v.get_value(), layer, is_leaf=_is_variable)
    merged = values.merge(values)
    jax.tree.map(lambda v, m: v.set_value(m), layer, merged, is_leaf=_is_variable)
    return layer

"""The arrays of an orbax checkpoint: the tree handed to orbax's `StandardCheckpointer`, and
read back, for any state the Equinox backend saves too. Orbax refuses a zero-size array
(it holds no data: left out, restored as one of `like`'s shape), a tree with no array (none
saved), and a bare array (saved in a dict); it reads a NumPy scalar in `like` as a value
(read as a 0-d array)."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import jax
import numpy as np

from .checkpoint_record import is_array_like

_ROOT = "array"  # the key of a bare array (a state that is one array) in the saved tree


def _stored(arrays: Any) -> Any:
    """What orbax saves of `arrays` (a state's arrays, None elsewhere; or their abstract
    shapes), or None if that is nothing."""
    tree = jax.tree.map(lambda a: None if math.prod(a.shape) == 0 else a, arrays)
    if not jax.tree.leaves(tree):
        return None
    return {_ROOT: tree} if is_array_like(tree) else tree


def _collision(ocp: Any, stored: Any) -> tuple[str, str, str] | None:
    """Two leaves of `stored` that have one orbax name (their keys joined with '.':
    `{"a.b": x, "a": {"b": y}}`), and that name, or None: orbax keeps one array for both."""
    seen: dict[str, str] = {}
    for where, _ in jax.tree_util.tree_flatten_with_path(stored)[0]:
        name, leaf = ".".join(ocp.tree.str_keypath(where)), jax.tree_util.keystr(where)
        if name in seen:
            return seen[name], leaf, name
        seen[name] = leaf
    return None


def _check_names(ocp: Any, stored: Any) -> None:
    """Raise `ValueError` if two leaves of `stored` have one orbax name, under which orbax
    would keep one array for both."""
    found = _collision(ocp, stored)
    if found is not None:
        first, second, name = found
        raise ValueError(
            f"save_checkpoint: backend='orbax' would store leaves {first} and {second} "
            f"under one name, {name!r} (orbax joins a leaf's keys with '.'), one array "
            "for both; nothing was written. Rename one of those keys, or use "
            "backend='equinox'."
        )


def _abstract(ocp: Any, arrays: Any) -> Any:
    """The shapes, dtypes and shardings of `arrays` that orbax restores into (a NumPy
    scalar, saved as an array, read as a 0-d array)."""

    def shape_of(a: Any) -> Any:
        return ocp.utils.to_shape_dtype_struct(np.asarray(a) if isinstance(a, np.generic) else a)

    return jax.tree.map(shape_of, arrays)


def check_restorable(ocp: Any, arrays: Any) -> None:
    """Raise `ValueError` if two leaves of `arrays` (a target's) have one orbax name: orbax
    would read one stored array into both (a checkpoint saved before saves refused them)."""
    found = _collision(ocp, _stored(_abstract(ocp, arrays)))
    if found is not None:
        first, second, name = found
        raise ValueError(
            f"load_checkpoint: backend='orbax' would read leaves {first} and {second} of "
            f"`like` from one name, {name!r} (orbax joins a leaf's keys with '.'), one array "
            "into both; nothing was read. A checkpoint of such a state (saved before "
            "save_checkpoint refused it) holds one array for both, the other lost: rename "
            "one of those keys in the state you save, or use backend='equinox'."
        )


def save_arrays(ocp: Any, directory: pathlib.Path, arrays: Any) -> None:
    """Save `arrays` with orbax at `directory` (its parent created if nothing is saved)."""
    stored = _stored(arrays)
    _check_names(ocp, stored)
    if stored is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        return
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, stored)
        checkpointer.wait_until_finished()


def restore_arrays(ocp: Any, directory: pathlib.Path, arrays: Any) -> Any:
    """The arrays `save_arrays` saved at `directory`, as orbax restores them into the shapes,
    dtypes and shardings of `arrays` (zero-size ones as zeros, on the host)."""
    abstract = _abstract(ocp, arrays)
    stored = _stored(abstract)
    read = None
    if stored is not None:
        with ocp.StandardCheckpointer() as checkpointer:
            read = checkpointer.restore(directory, stored)
    if is_array_like(abstract) and read is not None:
        read = read[_ROOT]
    if read is None:
        read = jax.tree.map(lambda _: None, abstract)

    def filled(value: Any, like: Any) -> Any:  # (None and None where `like` holds no array)
        return value if like is None or math.prod(like.shape) else np.zeros(like.shape, like.dtype)

    return jax.tree.map(filled, read, abstract, is_leaf=lambda x: x is None)

"""Where a checkpoint's arrays live: gathered whole from other processes' devices for the
Equinox file, which process 0 alone writes; placed, on reading, as the `like` state's arrays
are (their shardings, committed or not)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


def placed_as(value: Any, like: jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic) -> Any:
    """`value` (NumPy, or an array restored elsewhere) placed as `like` is: with its sharding,
    or, where `like` is uncommitted (a scalar `jnp.zeros` of an optimizer's or a train
    state's, on the default device), uncommitted too, so that `jit` still places it beside
    arrays sharded over several devices (committed to one device, it would refuse them); as
    NumPy where `like` is NumPy (a scalar where it is one)."""
    if isinstance(like, np.ndarray):
        return np.asarray(value)
    if isinstance(like, np.generic):
        return np.asarray(value, like.dtype)[()]
    sharding = like.sharding
    if isinstance(value, jax.Array):  # orbax's, restored with `like`'s sharding already
        if isinstance(like, jax.Array):
            return value if like.committed else jnp.asarray(np.asarray(value))
        if isinstance(sharding, jax.sharding.Sharding) and len(sharding.device_set) > 1:
            return value
        value = np.asarray(value)  # (committed) on one device: placed as an Equinox read is
    if isinstance(like, jax.ShapeDtypeStruct) and (
        not isinstance(sharding, jax.sharding.Sharding) or len(sharding.device_set) == 1
    ):
        # Abstract, on one device or none said (`eval_shape` says the default one for what is
        # made uncommitted, a step's count): on the default device, uncommitted; on another
        # device that `like` names, there.
        value = jnp.asarray(value)
        if isinstance(sharding, jax.sharding.Sharding) and sharding.device_set != value.devices():
            return jax.device_put(value, sharding)
        return value
    if isinstance(like, jax.Array) and not like.committed:
        return jnp.asarray(np.asarray(value))
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def on_concrete_mesh(like: Any) -> Any:
    """`like` with each `jax.ShapeDtypeStruct` sharded on an abstract mesh (`eval_shape` of
    arrays on a mesh of Explicit axes names no devices) sharded on `jax.set_mesh`'s mesh,
    of which it is the abstract one; `ValueError` naming the first leaf if none is set."""
    mesh = jax.sharding.get_mesh()

    def concrete(path: Any, x: Any) -> Any:
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
        if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(
            sharding.mesh, jax.sharding.AbstractMesh
        ):
            return x
        if mesh.empty or mesh.abstract_mesh != sharding.mesh:
            raise ValueError(
                f"load_checkpoint: leaf {jax.tree_util.keystr(path)} of `like` is sharded on "
                f"an abstract mesh ({sharding.mesh}: eval_shape of arrays on a mesh of "
                "Explicit axes), which names no devices; nothing was read. Load under "
                "`jax.set_mesh(mesh)` of that mesh, or give `like` shardings on a concrete one."
            )
        placed = jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed, weak_type=x.weak_type)

    return jax.tree_util.tree_map_with_path(concrete, like)


def gather(state: Any) -> Any:
    """`state` with each array that spans other processes' devices gathered to NumPy (a
    collective: every process calls it)."""
    return jax.tree.map(
        lambda a: (
            multihost_utils.process_allgather(a, tiled=True)
            if isinstance(a, jax.Array) and not a.is_fully_addressable
            else a
        ),
        state,
    )


def on_process_zero(what: str, write: Callable[[], None]) -> None:
    """Run `write()` on process 0 alone; every process returns when it has finished, and raises
    if it failed (a collective: every process calls it)."""
    if jax.process_count() == 1:
        write()
        return
    error = None
    if jax.process_index() == 0:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
    ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if error is not None:
        raise error
    if not ok:
        raise RuntimeError(f"save_checkpoint: process 0 failed to {what}; its error says why.")

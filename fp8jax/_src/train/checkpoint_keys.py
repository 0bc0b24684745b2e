"""PRNG keys in checkpoints: a key array stored as its raw data (NumPy has no dtype for a
key) and wrapped again on reading, with the key's implementation and sharding."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .checkpoint_record import fp8_record, is_array_like


def _is_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (`jax.random.key`; an NNX model's `nnx.Rngs`
    hold them), or an abstract one."""
    return is_array_like(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_types(tree: Any) -> dict[str, str]:
    """The type of each PRNG key array in `tree` (`key<fry>`, `key<rbg>`), by its path."""
    return {
        jax.tree_util.keystr(path): str(x.dtype)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if _is_key(x)
    }


def keys_as_data(tree: Any) -> Any:
    """`tree` with each PRNG key array as its raw data (`jax.random.key_data`, uint32), which
    a checkpoint holds as it holds any array (NumPy has no dtype for a key)."""

    def data(x: Any) -> Any:
        if not _is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            shaped = jax.eval_shape(jax.random.key_data, x)
            sharding = x.sharding  # of the keys; the data's trailing axes are whole
            if isinstance(sharding, NamedSharding):
                spec = (*sharding.spec, *(None,) * (shaped.ndim - len(sharding.spec)))
                sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
            elif not isinstance(sharding, SingleDeviceSharding):
                sharding = None  # (eval_shape's is on an abstract mesh: unreadable)
            return jax.ShapeDtypeStruct(shaped.shape, shaped.dtype, sharding=sharding)
        return jax.random.key_data(x)

    return jax.tree.map(data, tree)


def keys_from_data(restored: Any, target: Any) -> Any:
    """`restored` (read into `keys_as_data(target)`) with the data of each of `target`'s
    PRNG keys wrapped as a key again, of that key's implementation."""

    def key_impl(like: Any) -> Any:
        if isinstance(like, jax.Array):
            return jax.random.key_impl(like)
        found = []  # an abstract key: its implementation, as JAX sees it in a trace
        jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), like)
        return found[0]

    def key(value: Any, like: Any) -> Any:
        return jax.random.wrap_key_data(value, impl=key_impl(like)) if _is_key(like) else value

    return jax.tree.map(key, restored, target)


def keyed_record(tree: Any, data: Any = None) -> dict[str, Any]:
    """`fp8_record` of `tree` as a checkpoint holds it, PRNG keys as their data, with each
    key's type (`key<fry>`) by its path, which a mismatch names. `data`: `keys_as_data(tree)`,
    where the caller has it already (not converted twice)."""
    keys = key_types(tree)
    data = keys_as_data(tree) if data is None else data
    return fp8_record(data) | ({"keys": keys} if keys else {})

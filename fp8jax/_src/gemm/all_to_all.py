"""`jax.lax.ragged_all_to_all` for the expert exchange (`exchange.py`), with the emulation
that XLA:CPU needs: it has no ragged all-to-all, so there the exchange is an `all_to_all` of
one slot per device pair with the primitive's result (tests run on CPU devices; a compile for
GPUs takes the primitive)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from ..core import jax_private


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`lax.ragged_all_to_all`'s result, from an `all_to_all` of one slot of
    `operand.shape[0]` rows per device pair (XLA:CPU has no ragged all-to-all)."""
    rows = operand.shape[0]
    slot = jnp.arange(rows, dtype=input_offsets.dtype)
    source = jnp.clip(input_offsets[:, None] + slot, 0, max(rows - 1, 0))  # (P, rows)
    sent = jnp.where(
        (slot < send_sizes[:, None]).reshape(source.shape + (1,) * (operand.ndim - 1)),
        operand[source],
        jnp.zeros((), operand.dtype),
    )
    got = lax.all_to_all(sent, axis_name, 0, 0)  # got[i]: device i's slot for this device
    where = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # its offsets here
    target = where[:, None] + slot
    target = jnp.where(slot < recv_sizes[:, None], target, output.shape[0])  # dropped
    flat = got.reshape((-1,) + operand.shape[1:])
    return output.at[target.reshape(-1)].set(flat, mode="drop")


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`, which XLA:CPU lacks: emulated there (same result)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    # The primitive's result varies as its `output` does; the emulation's as all of them.
    varying = frozenset({axis_name}).union(*(jax_private.varying_axes(a) for a in args))
    missing = tuple(sorted(varying - jax_private.varying_axes(output)))
    if missing:
        output = lax.pcast(output, missing, to="varying")
    args = (operand, output, *args[2:])
    real = functools.partial(lax.ragged_all_to_all, axis_name=axis_name)
    cpu = functools.partial(_emulated_ragged_all_to_all, axis_name=axis_name)
    return lax.platform_dependent(*args, cpu=cpu, default=real)

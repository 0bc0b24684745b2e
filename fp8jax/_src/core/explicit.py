"""Meshes with Explicit axes: what an FP8 GEMM or an expert exchange runs with them made Auto,
where JAX has no Explicit sharding rule for an operation (a ragged dot, a sort over a split
axis, a gather or scatter of split rows, a kernel call)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array


def resharded(out: Array, out_sharding: Any) -> Array:
    """`out` resharded to `out_sharding`, the argument of `lax.dot_general` and
    `lax.ragged_dot` (a `NamedSharding`, or a `PartitionSpec` under `jax.set_mesh`), or as
    it is for `None`."""
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def explicit_mesh(*arrays: Any) -> Any:
    """The mesh with Explicit axes that `arrays` are typed on (or that `jax.set_mesh` gives),
    `None` where there is none."""
    meshes = [jax.typeof(a).sharding.mesh for a in arrays if isinstance(a, jax.Array)]
    for mesh in [*meshes, jax.sharding.get_abstract_mesh()]:
        if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def split_evenly(entry: Any, size: int, mesh: Any) -> Any:
    """`PartitionSpec` entry `entry` (mesh axes of `mesh`) for an array axis of `size`, or
    `None` (not split) where those axes' devices do not divide `size`, as Explicit sharding
    requires (the rows an expert exchange receives: its capacity, any number)."""
    names = entry if isinstance(entry, tuple) else () if entry is None else (entry,)
    return entry if size % math.prod(mesh.shape[n] for n in names) == 0 else None


def _gradient_on_mesh(x: Any) -> Any:
    """`x`, its gradient (if a float array) typed on the mesh in scope, replicated, as lax's
    transposes type the gradients of operands typed on no mesh; computed off the mesh, it
    would be typed on none."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
        return _replicated_gradient(x)
    return x


@jax.custom_vjp
def _replicated_gradient(x: Array) -> Array:
    return x


_replicated_gradient.defvjp(
    lambda x: (x, None), lambda _, g: (jax.sharding.reshard(g, jax.sharding.PartitionSpec()),)
)


def on_auto_axes(
    compute: Callable[..., Array], *operands: Any, out_sharding: Any, explicit: bool
) -> Array:
    """`compute(*operands)` with the output sharded as `out_sharding` says. Under a mesh with
    Explicit axes (`explicit`: `explicit_mesh` of the GEMM's operands), `compute` runs with
    them as Auto axes: XLA then partitions the FP8 GEMMs, their quantization and their
    kernels as under an automatic mesh, where JAX has no sharding rule for several of them
    (a ragged dot, `jnp.repeat` of block scales, a kernel call, an expert exchange's sort and
    its gathers of split rows). There `out_sharding` `None` says that the operands are typed
    on no mesh (made outside it), as lax then types its output: `compute` runs off the mesh,
    its output's sharding left to XLA as lax's is."""
    if not explicit:
        return resharded(compute(*operands), out_sharding)
    if out_sharding is None:
        # Off the mesh: in its scope the FP8 GEMM's output would be typed replicated on it
        # (a scale broadcast there is), where lax's is on none (a nested jit's out_shardings
        # then decide it). Its gradients are typed on the mesh as lax's transposes type them.
        operands = jax.tree.map(_gradient_on_mesh, operands)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return compute(*operands)
    arrays, rest = eqx.partition(operands, lambda x: isinstance(x, jax.Array))

    def run(arrays: Any) -> Array:
        return compute(*eqx.combine(arrays, rest))

    # Only the Explicit axes become Auto: inside a `shard_map` over some of the mesh's axes
    # the others are Manual, which JAX cannot make Auto (its default, every axis, raises).
    mesh = jax.sharding.get_abstract_mesh()
    axes = None
    if not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types:
        kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
        axes = tuple(n for n, t in kinds if t == jax.sharding.AxisType.Explicit)
    call = jax.sharding.auto_axes(run, axes=axes, out_sharding=out_sharding)
    if axes is not None:
        # There the backward's residuals, typed on the Auto axes, fail `shard_map`'s
        # linearization ("context mesh ... should match the aval mesh"): the GEMM's forward
        # is computed again in the backward from the operands instead.
        call = jax.checkpoint(call)
    return call(arrays)

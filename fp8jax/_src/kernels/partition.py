"""Native GEMM kernels under `jit` sharding: every device runs the kernel on its own shards.

A kernel is an opaque call to XLA's partitioner: on operands sharded over a mesh, XLA would
gather them and compute the whole product on every device. `per_shard` wraps the call in
`jax.experimental.custom_partitioning`. Sharding propagation sees a GEMM (a Shardy rule names
its factors: batch `b`, the lhs's free axis `m`, the rhs's `n`, the contraction `k`); once
XLA has propagated the shardings of the operands, `choose_axes` decides, per factor, the mesh
axes each device's kernel keeps:

- `b` and `m` keep the activation's sharding (data parallelism: never gather activations);
- `k` stays sharded only where both operands shard it alike (a tensor-parallel row-split
  Linear, or a wgrad contracting tokens split over the data axis): each device contracts
  its slice and the partial sums are added across devices (reduce-scattered into the
  output's sharding where XLA wants it split, as an FSDP weight gradient);
- `n` keeps the rhs's sharding (a column-split Linear), less the axes already taken;
- anything else is gathered by XLA before the kernel: an FSDP weight sharded along axes that
  also shard the activation's rows, or a block-scaled operand whose shards would split its
  scale blocks (a shard must hold whole blocks of every operand, with their scales).

The operands are gathered as they are given: FP8 data and scales, never a high-precision
copy. A program that hands several kernels the same FP8 weight (the forward and the dgrad)
lets XLA gather it once for both.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ..core import jax_private

_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8jax_per_shard", default=False)


def inside() -> bool:
    """Whether this traces the GEMM of one device inside `per_shard` (on its shards: no
    further partitioning)."""
    return _INSIDE.get()


#: The factors of a GEMM, in the order in which they claim mesh axes.
FACTORS = ("b", "m", "k", "n")

#: One axis of an operand array: its factor and how many of the factor's elements one entry
#: spans (1 for data; a scale's block or chunk size).
Dim = tuple[str, int]


class GemmDims(NamedTuple):
    """The axes of a GEMM's operands, one `Dim` tuple per array (in `jax.tree.leaves` order
    of the operands; `()` for a scalar), and the output's factors (`b`, `m`, `n`, `g` as
    present). The first array is the lhs's data, the first array holding `n` the rhs's.

    A grouped GEMM (mixture of experts) names its experts `g` (never split: the experts'
    weights are gathered) and gives `ragged`: the index of its group-sizes array and the
    factor its groups run along (`m`, the rows of a forward or dgrad; `k`, the tokens a
    wgrad contracts). A device holding a slice of that factor computes its groups' sizes
    within the slice."""

    operands: tuple[tuple[Dim, ...], ...]
    out: tuple[str, ...]
    ragged: tuple[int, str] | None = None


def _spec_axes(spec: P, dim: int) -> tuple[str, ...]:
    entry = tuple(spec)[dim] if dim < len(tuple(spec)) else None
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def choose_axes(
    dims: GemmDims,
    shapes: Sequence[tuple[int, ...]],
    specs: Sequence[P | None],
    mesh_shape: Mapping,
) -> dict[str, tuple[str, ...]]:
    """The mesh axes each factor keeps on every device (see the module docstring), from the
    shapes and partition specs of the operand arrays that XLA propagated."""
    proposed: dict[str, list[tuple[str, ...]]] = {f: [] for f in (*FACTORS, "g")}
    sizes: dict[str, int] = {}
    for array_dims, shape, spec in zip(dims.operands, shapes, specs, strict=True):
        spec = P() if spec is None else spec  # no mesh sharding (uneven): taken as unsplit
        for d, (factor, block) in enumerate(array_dims):
            if block == 1:
                proposed[factor].append(_spec_axes(spec, d))
                sizes[factor] = shape[d]
    # Batch and rows as the lhs (the activation, first) has them, columns as the first rhs
    # array; the contraction only where every array splits it alike.
    first = {f: (p[0] if p else ()) for f, p in proposed.items() if f in FACTORS}
    k = proposed["k"]
    first["k"] = k[0] if k and all(p == k[0] for p in k) else ()
    taken: set[str] = set()
    chosen: dict[str, tuple[str, ...]] = {}
    for factor in FACTORS:
        axes = tuple(a for a in first[factor] if a not in taken and mesh_shape[a] > 1)
        if axes and not _divides(factor, axes, dims, shapes, sizes, mesh_shape):
            axes = ()
        chosen[factor] = axes
        taken.update(axes)
    chosen["g"] = ()
    return chosen


def _divides(factor, axes, dims, shapes, sizes, mesh_shape) -> bool:
    """Whether every array holding `factor` splits evenly over `axes`, each shard holding
    whole blocks of a scale (and its data the elements of those blocks)."""
    ways = math.prod(mesh_shape[a] for a in axes)
    for array_dims, shape in zip(dims.operands, shapes, strict=True):
        for d, (f, block) in enumerate(array_dims):
            if f != factor:
                continue
            if shape[d] % ways or (block > 1 and sizes.get(factor, 0) % (ways * block)):
                return False
    return True


def _sharding(mesh, array_dims: tuple[Dim, ...], chosen) -> NamedSharding:
    return NamedSharding(mesh, P(*(chosen[f] or None for f, _ in array_dims)))


def _scatter(result_shape, out_axes, split, mesh) -> tuple[int, tuple[str, ...]] | None:
    """The output axis to reduce-scatter a split contraction's partial sums along, and over
    which of its mesh axes: the first output axis that XLA wants split over some of them and
    that divides evenly. `None`: all-reduce."""
    spec = jax_private.spec_of(result_shape.sharding, mesh, len(result_shape.shape)) or P()
    for d, size in enumerate(result_shape.shape):
        axes = tuple(a for a in _spec_axes(spec, d) if a in split)
        if axes and not out_axes[d] and size % math.prod(mesh.shape[a] for a in axes) == 0:
            return d, axes
    return None


def local_group_sizes(group_sizes: Array, start: Array, length: int) -> Array:
    """How many of each group's rows (groups laid end to end, in order) fall in the slice
    `[start, start + length)`."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    stop = start + length
    return (jnp.clip(ends, start, stop) - jnp.clip(starts, start, stop)).astype(group_sizes.dtype)


def _local_groups(leaves, dims: GemmDims, chosen, mesh) -> list:
    """`leaves` (one device's) with the group sizes of its slice of the ragged factor."""
    where, factor = dims.ragged
    axes = chosen[factor]
    index = 0  # this device's slice: mesh axes in the order the spec lists them
    for a in axes:
        index = index * mesh.shape[a] + lax.axis_index(a)
    length = next(
        leaf.shape[d]
        for leaf, array_dims in zip(leaves, dims.operands, strict=True)
        for d, (f, block) in enumerate(array_dims)
        if f == factor and block == 1
    )
    leaves = list(leaves)
    leaves[where] = local_group_sizes(leaves[where], index * length, length)
    return leaves


def _rule(dims: GemmDims) -> tuple[str, tuple[str, ...]]:
    """The Shardy rule of the GEMM, and its factors that propagation must leave unsplit: a
    scale's blocked axes (split only by `choose_axes`, whole blocks per shard; propagated,
    Shardy could split 2 blocks over 4 devices, which JAX cannot express)."""

    def name(factor: str, block: int) -> str:
        return factor if block == 1 else f"{factor}{block}"

    operands = ", ".join(" ".join(name(*d) for d in a) for a in dims.operands)
    blocked = sorted({name(*d) for a in dims.operands for d in a if d[1] > 1})
    return f"{operands} -> {' '.join(dims.out)}", tuple(blocked)


def per_shard(gemm: Callable[..., Array], dims: GemmDims, out_dtype: Any, *operands: Any) -> Array:
    """`gemm(*operands, out_dtype=out_dtype)`, run by every device on its shards of
    `operands` (pytrees of arrays laid out as `dims` says) when the program is partitioned.

    On one device it is the call itself. Where the contraction is split, each device's
    kernel writes partial sums in `out_dtype`, added across devices as XLA adds those of its
    own sharded dots: reduce-scattered where the output is wanted split, else all-reduced.
    """
    leaves, tree = jax.tree.flatten(operands)
    if len(leaves) != len(dims.operands):
        raise ValueError(
            f"per_shard: {len(leaves)} operand arrays but dims describe {len(dims.operands)}."
        )

    def call(*leaves: Array) -> Array:
        token = _INSIDE.set(True)  # what `gemm` traces runs on one device's data
        try:
            return gemm(*tree.unflatten(leaves), out_dtype=out_dtype)
        finally:
            _INSIDE.reset(token)

    def decide(mesh, arg_shapes):
        shapes = [a.shape for a in arg_shapes]
        specs = [jax_private.spec_of(a.sharding, mesh, len(a.shape)) for a in arg_shapes]
        return choose_axes(dims, shapes, specs, dict(mesh.shape))

    def partition(mesh, arg_shapes, result_shape):
        chosen = decide(mesh, arg_shapes)
        arg_shardings = tuple(_sharding(mesh, d, chosen) for d in dims.operands)
        out_axes = [chosen[f] for f in dims.out]
        split = chosen["k"]
        # Partial sums of a split contraction are reduce-scattered where XLA wants the output
        # split over those axes (an FSDP wgrad, summed over the tokens' shards into the
        # weight's), and all-reduced otherwise.
        scatter = _scatter(result_shape, out_axes, split, mesh)
        if scatter is not None:
            out_axes[scatter[0]] = scatter[1]
        rest = tuple(a for a in split if scatter is None or a not in scatter[1])
        out_sharding = NamedSharding(mesh, P(*(a or None for a in out_axes)))

        def lower(*leaves: Array) -> Array:
            if dims.ragged is not None and chosen[dims.ragged[1]]:
                leaves = _local_groups(leaves, dims, chosen, mesh)
            out = call(*leaves)
            if scatter is not None:
                out = lax.psum_scatter(out, scatter[1], scatter_dimension=scatter[0], tiled=True)
            return lax.psum(out, rest) if rest else out

        return mesh, lower, out_sharding, arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        chosen = decide(mesh, arg_shapes)
        return NamedSharding(mesh, P(*(chosen[f] or None for f in dims.out)))

    # Shardings as XLA gives them: JAX could not turn a scale split unevenly into a
    # NamedSharding (and `choose_axes` reads only the data's).
    wrapped = custom_partitioning(call)
    rule, unsplit = _rule(dims)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
        need_replication_factors=unsplit,
        decode_shardings=False,
    )
    return wrapped(*leaves)


def gathered_for(dims: GemmDims, lhs: Any, rhs: Any) -> Any:
    """`rhs` laid out as `per_shard`'s GEMM of `lhs` and `rhs` takes it (a pytree of arrays
    as `dims` describes, the lhs's first): gathered over the mesh axes that the GEMM would
    gather it over (an FSDP weight), kept split where the GEMM keeps it split (a
    tensor-parallel one). `lhs` is read for its sharding only and never moves.

    A GEMM's operand gathered by XLA for the GEMM is not a value of the program: a backward
    pass that needs the same operand (the dgrad's weight) gathers it again wherever it
    cannot share the forward's collective (a backward loop over layers). The value this
    returns is the gathered operand itself, which the backward can keep (a scan residual).
    On one device it is `rhs`."""
    lhs_leaves = jax.tree.leaves(lhs)
    rhs_leaves, tree = jax.tree.flatten(rhs)
    leaves = [*lhs_leaves, *rhs_leaves]
    if len(leaves) != len(dims.operands):
        raise ValueError(
            f"gathered_for: {len(leaves)} operand arrays but dims describe {len(dims.operands)}."
        )
    first = len(lhs_leaves)

    def call(*leaves: Array) -> tuple[Array, ...]:
        return tuple(leaves[first:])

    def shardings(mesh, arg_shapes):
        shapes = [a.shape for a in arg_shapes]
        specs = [jax_private.spec_of(a.sharding, mesh, len(a.shape)) for a in arg_shapes]
        chosen = choose_axes(dims, shapes, specs, dict(mesh.shape))
        lhs = tuple(a.sharding for a in arg_shapes[:first])  # left as they are
        rhs = tuple(_sharding(mesh, d, chosen) for d in dims.operands[first:])
        return lhs, rhs

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        lhs, rhs = shardings(mesh, arg_shapes)
        return mesh, call, rhs, (*lhs, *rhs)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return shardings(mesh, arg_shapes)[1]

    rule, unsplit = _rule(dims)
    operands = rule.split("->")[0]
    # The result's own factors (`o` prefixed): tied to the operand's, propagation would
    # give it the operand's sharding (split over the FSDP axis), undoing the gather.
    results = ", ".join(
        " ".join(f"o{f}" if b == 1 else f"o{f}{b}" for f, b in a) for a in dims.operands[first:]
    )
    wrapped = custom_partitioning(call)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{operands}-> {results}",
        need_replication_factors=unsplit,
        decode_shardings=False,
    )
    return tree.unflatten(wrapped(*leaves))

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

Each device's GEMM is traced by XLA's partitioner, on its compile thread, in the context the
call was traced in. For tests, `recording` keeps what the partitioner decided for every GEMM
(`ShardPlan`) and `replaying` runs the same function on one device as those plans say
(`emulated`): Mosaic GPU's interpreter cannot run inside a partitioned program, and so the
kernels themselves are checked on every device's shards (`dispatch.run_interpreted`).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ..core import contexts, jax_private

_INSIDE: contexts.Setting[bool] = contexts.Setting("fp8jax_per_shard", False)
_NO_MESH = jax.sharding.AbstractMesh((), ())


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


def scatter_axis(result_shape, out_axes, split, mesh) -> tuple[int, tuple[str, ...]] | None:
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


def local_groups(leaves, dims: GemmDims, chosen, mesh, coords=None) -> list:
    """`leaves` (one device's) with the group sizes of its slice of the ragged factor; the
    device's mesh coordinates are `coords` (axis name -> index), or its own (`axis_index`)."""
    where, factor = dims.ragged
    axes = chosen[factor]
    index = 0  # this device's slice: mesh axes in the order the spec lists them
    for a in axes:
        index = index * mesh.shape[a] + (lax.axis_index(a) if coords is None else coords[a])
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


class ShardPlan(NamedTuple):
    """What every device computes for one `per_shard` GEMM once XLA has propagated its
    operands' shardings: the mesh axes each factor keeps (`chosen`), the operand arrays' and
    the output's specs, and how a split contraction's partial sums are added (reduce-scattered
    along output axis `scatter[0]` over `scatter[1]`, all-reduced over `rest`)."""

    mesh: Any
    chosen: dict[str, tuple[str, ...]]
    in_specs: tuple[P, ...]
    out_spec: P
    scatter: tuple[int, tuple[str, ...]] | None
    rest: tuple[str, ...]


def _plan(dims: GemmDims, mesh, arg_shapes, result_shape) -> ShardPlan:
    shapes = [a.shape for a in arg_shapes]
    specs = [jax_private.spec_of(a.sharding, mesh, len(a.shape)) for a in arg_shapes]
    chosen = choose_axes(dims, shapes, specs, dict(mesh.shape))
    out_axes = [chosen[f] for f in dims.out]
    split = chosen["k"]
    # Partial sums of a split contraction are reduce-scattered where XLA wants the output
    # split over those axes (an FSDP wgrad, summed over the tokens' shards into the weight's),
    # and all-reduced otherwise.
    scatter = None if result_shape is None else scatter_axis(result_shape, out_axes, split, mesh)
    if scatter is not None:
        out_axes[scatter[0]] = scatter[1]
    rest = tuple(a for a in split if scatter is None or a not in scatter[1])
    in_specs = tuple(_sharding(mesh, d, chosen).spec for d in dims.operands)
    return ShardPlan(mesh, chosen, in_specs, P(*(a or None for a in out_axes)), scatter, rest)


def _per_device(call: Callable[..., Array], dims: GemmDims, plan: ShardPlan, *leaves: Array):
    """One device's GEMM on its shards `leaves`, its partial sums added across devices."""
    if dims.ragged is not None and plan.chosen[dims.ragged[1]]:
        leaves = local_groups(leaves, dims, plan.chosen, plan.mesh)
    out = call(*leaves)
    if plan.scatter is not None:
        axis, axes = plan.scatter
        out = lax.psum_scatter(out, axes, scatter_dimension=axis, tiled=True)
    return lax.psum(out, plan.rest) if plan.rest else out


class _Replay:
    """The plans `replaying` hands out, in the order their GEMMs are traced."""

    def __init__(self, plans: Sequence[ShardPlan | None]):
        self.plans = list(plans)
        self.used = 0

    def next(self) -> ShardPlan | None:
        if self.used == len(self.plans):
            raise RuntimeError(
                f"replaying {len(self.plans)} recorded GEMM plans: this trace has more GEMMs "
                "than the recorded one (trace the same function on the same arguments)."
            )
        self.used += 1
        return self.plans[self.used - 1]


_PLANS: contextvars.ContextVar[list | _Replay | None] = contextvars.ContextVar(
    "fp8jax_shard_plans", default=None
)


def replays() -> bool:
    """Whether GEMMs traced here replay recorded plans (see `replaying`)."""
    return isinstance(_PLANS.get(), _Replay)


def record_local() -> None:
    """Note, where plans are being recorded, a GEMM that runs on one device's data as it is
    (no `per_shard`): its plan is `None`."""
    plans = _PLANS.get()
    if isinstance(plans, list) and not inside():  # not the GEMMs of one device's trace
        plans.append(None)


@contextlib.contextmanager
def recording() -> Iterator[list[ShardPlan | None]]:
    """GEMMs traced inside (`per_shard`, `record_local`) append their plan to the yielded
    list, in trace order: XLA's partitioner fills a `per_shard` GEMM's `ShardPlan` in when it
    compiles the program (it stays `None` where XLA removed the GEMM first, or where the GEMM
    runs on one device's data)."""
    plans: list[ShardPlan | None] = []
    token = _PLANS.set(plans)
    try:
        yield plans
    finally:
        _PLANS.reset(token)


@contextlib.contextmanager
def replaying(plans: Sequence[ShardPlan | None]) -> Iterator[_Replay]:
    """`per_shard` GEMMs traced inside, in a program on one device, compute what the
    partitioned program recorded in `plans` computes (same function, same arguments, in
    trace order): each device's GEMM on its shards in turn, the partial sums added, the
    output assembled (`emulated`). For kernels that cannot run in a partitioned program
    (Mosaic GPU's interpreter simulates one GPU through ordered host callbacks). The yielded
    object counts the plans used (`used`)."""
    replay = _Replay(plans)
    token = _PLANS.set(replay)
    try:
        yield replay
    finally:
        _PLANS.reset(token)


def _shard(x: Array, spec: P, mesh_shape: Mapping, coords: Mapping) -> Array:
    """The block of `x` that the device at mesh coordinates `coords` holds under `spec`."""
    for d in range(x.ndim):
        axes = _spec_axes(spec, d)
        if not axes:
            continue
        index, ways = 0, 1
        for a in axes:
            index, ways = index * mesh_shape[a] + coords[a], ways * mesh_shape[a]
        size = x.shape[d] // ways
        x = lax.slice_in_dim(x, index * size, (index + 1) * size, axis=d)
    return x


def emulated(
    call: Callable[..., Array], dims: GemmDims, plan: ShardPlan | None, leaves: Sequence[Array]
) -> Array:
    """`call` (one device's GEMM) run on one device as the partitioned program that `plan`
    describes runs it: on every distinct device's shards in turn (`lax.map`: one trace), the
    partial sums of a split contraction added, the blocks assembled into the whole output
    (what the reduce-scatter or all-reduce leaves, gathered). `None`: `call(*leaves)`."""
    if plan is None:
        return call(*leaves)
    mesh_shape = dict(plan.mesh.shape)
    out_axes = [plan.chosen[f] for f in dims.out]
    split = plan.chosen["k"]
    axes = [a for group in (*out_axes, split) for a in group]  # one device per combination
    devices = [
        dict(zip(axes, c, strict=True))
        for c in itertools.product(*(range(mesh_shape[a]) for a in axes))
    ]
    shards = []
    for coords in devices:
        specs = zip(leaves, plan.in_specs, strict=True)
        mine = [_shard(x, spec, mesh_shape, coords) for x, spec in specs]
        if dims.ragged is not None and plan.chosen[dims.ragged[1]]:
            mine = local_groups(mine, dims, plan.chosen, plan.mesh, coords)
        shards.append(mine)
    stacked = [jnp.stack(arrays) for arrays in zip(*shards, strict=True)]
    outs = lax.map(lambda xs: call(*xs), stacked)
    outs = outs.reshape(*(mesh_shape[a] for a in axes), *outs.shape[1:])
    n_out = len(axes) - len(split)
    if split:
        outs = jnp.sum(outs, axis=tuple(range(n_out, len(axes))), dtype=outs.dtype)
    # Each output axis preceded by its mesh axes, then merged: the blocks in mesh order.
    perm, lead = [], 0
    for d, group in enumerate(out_axes):
        perm += [*range(lead, lead + len(group)), n_out + d]
        lead += len(group)
    local = outs.shape[n_out:]
    shape = [math.prod(mesh_shape[a] for a in g) * n for g, n in zip(out_axes, local, strict=True)]
    return outs.transpose(perm).reshape(shape)


def per_shard(
    gemm: Callable[..., Array], dims: GemmDims, out_dtype: Any, *operands: Any, name: str = ""
) -> Array:
    """`gemm(*operands, out_dtype=out_dtype)`, run by every device on its shards of
    `operands` (pytrees of arrays laid out as `dims` says) when the program is partitioned.

    XLA's partitioner gives what each device runs the metadata of the partitioned call, the
    name scopes of `gemm` dropped: `name` (a kernel's, where `gemm` runs one) is the scope the
    call is made in, so that the kernel's op name still holds it.

    On one device it is the call itself. Where the contraction is split, each device's
    kernel writes partial sums in `out_dtype`, added across devices as XLA adds those of its
    own sharded dots: reduce-scattered where the output is wanted split, else all-reduced.
    """
    leaves, tree = jax.tree.flatten(operands)
    if len(leaves) != len(dims.operands):
        raise ValueError(
            f"per_shard: {len(leaves)} operand arrays but dims describe {len(dims.operands)}."
        )
    # XLA's partitioner traces `call` later, on a thread of its own: it runs in the settings
    # traced here (`dispatch.interpreted()`, `choice.persistent_kernel()`).
    run = contexts.carried()

    def call(*leaves: Array) -> Array:
        def traced() -> Array:
            with contexts.setting(_INSIDE, True):  # what `gemm` traces runs on one device
                return gemm(*tree.unflatten(leaves), out_dtype=out_dtype)

        return run(traced)

    plans = _PLANS.get()
    if isinstance(plans, _Replay):
        return emulated(call, dims, plans.next(), leaves)
    slot = None
    if plans is not None:
        slot = len(plans)
        plans.append(None)

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(dims, mesh, arg_shapes, result_shape)
        if slot is not None:
            plans[slot] = plan
        shardings = tuple(NamedSharding(mesh, spec) for spec in plan.in_specs)

        def lower(*leaves: Array) -> Array:
            # One device's program: no mesh of explicit axes, which a partition traced in
            # `jax.set_mesh`'s scope would take up, leaving sharding ops in it that nothing
            # partitions (XLA fails: "untyped custom call to Sharding").
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                return _per_device(call, dims, plan, *leaves)

        return mesh, lower, NamedSharding(mesh, plan.out_spec), shardings

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        chosen = _plan(dims, mesh, arg_shapes, None).chosen
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
    with jax.named_scope(name) if name else contextlib.nullcontext():
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

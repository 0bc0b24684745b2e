"""Which Linears are heads or routers, found by their role rather than their name.

FP8 pays on the GEMMs inside a model's blocks and hurts where a few values decide much: the
output head (a vocabulary-wide softmax over logits) and the router of a mixture of experts (a
top-k over a handful of affinities). Names do not tell them apart (`gate` is a SwiGLU gate in
Llama and the router in Mixtral; a head may be `lm_head`, `output` or `Dense_12`), so the
default conversion keeps a Linear in high precision for its role:

- **head**: its output is the model's output, reached through no other GEMM and feeding none
  (found from a trace of the model's call); without a trace, its output width is the
  vocabulary, the row count of the model's largest embedding table, and it is not one of a
  repeated block's layers (found from shapes and the model's structure).
- **router**: its output reaches a top-k, arg-max or sort (the expert choice; from a trace);
  or, no head, its output width is the expert count of an expert layer in the module it
  belongs to or in one below (from shapes).

The trace is a jaxpr of the model's call with its parameters as inputs: a GEMM belongs to
the layer whose weight is one of its operands (through casts, transposes, reshapes and
slices of it, e.g. one layer of a stacked scan), and its output is followed through every
equation until the next GEMM. This module knows no framework; each adapter tells it which
parameter belongs to which layer and what shapes the layers have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, final

from ..core import jax_private

Path = tuple[str, ...]

#: Primitives that run a GEMM: a weight among their operands makes them that layer's.
#: (Convolutions are not converted, and are followed like any other equation.)
GEMMS = frozenset({"dot_general", "ragged_dot_general", "ragged_dot"})
#: Primitives that choose among their input's entries: what feeds them routes.
CHOICES = frozenset({"top_k", "approx_top_k", "argmax", "argmin", "sort"})
#: Primitives whose first operand's values pass through unchanged (a view of a weight is the
#: weight for the purpose of finding its GEMM).
VIEWS = frozenset(
    {
        "convert_element_type",
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "reduce_precision",
        "slice",
        "dynamic_slice",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "device_put",
        "optimization_barrier",
        "name",  # jax.ad_checkpoint.checkpoint_name (Haliax's Stacked names what it scans)
        "pvary",  # inside shard_map, a replicated weight meeting a device's block of the batch
    }
)

#: Views that keep their operand's axes (its values cast, copied or named): the weight's.
SAME_AXES = VIEWS - {"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims"}
SAME_AXES -= {"slice", "dynamic_slice"}

#: Primitives that scale their first operand by their second: a weight times (or over) a
#: scalar is that weight too (Haliax's Linear multiplies its weight by its reparametrization's
#: scale, 1.0).
SCALINGS = frozenset({"mul", "div"})


@final
@dataclasses.dataclass(frozen=True)
class Dataflow:
    """What a trace of a model's call says about its layers' GEMMs.

    - `gemms`: each owner (a layer's path) whose parameters are an operand of a GEMM, with
      the number of such GEMMs.
    - `to_output`: owners whose GEMM output reaches the model's output through no other GEMM.
    - `feeds_gemm`: owners whose GEMM output reaches another GEMM's operand.
    - `feeds_choice`: owners whose GEMM output reaches a top-k, arg-max or sort.
    """

    gemms: Mapping[Path, int]
    to_output: frozenset[Path]
    feeds_gemm: frozenset[Path]
    feeds_choice: frozenset[Path]

    def is_head(self, path: Path) -> bool:
        """The layer's GEMM is the last before the model's output."""
        return path in self.to_output and path not in self.feeds_gemm

    def is_router(self, path: Path) -> bool:
        """The layer's GEMM output decides a top-k or arg-max: it routes."""
        return path in self.feeds_choice

    def keeps(self, path: Path) -> bool:
        """Whether the GEMM on a module's weights is a head's or a router's (a tied head's,
        on an embedding table): high precision by role, nothing to convert."""
        return self.is_head(path) or self.is_router(path)


@dataclasses.dataclass
class _Value:
    origin: Path | None = None  # the layer whose weight this is a view of
    taint: frozenset[Path] = frozenset()  # layers whose GEMM output reaches it, no GEMM between
    axes: tuple[int, ...] | None = None  # its axes as the weight's, where only transposes tell


_NOTHING = _Value()


class _Tracer:
    """Follows origins and GEMM outputs through a jaxpr and the jaxprs inside it."""

    def __init__(self) -> None:
        #: Each owner's GEMM equations (by `id`: a loop body is followed more than once).
        self.gemms: dict[Path, set[int]] = {}
        self.feeds_gemm: set[Path] = set()
        self.feeds_choice: set[Path] = set()
        #: Each GEMM equation met (by `id`) with its operands' owners (lhs, rhs).
        self.operands: dict[int, tuple[Path | None, Path | None]] = {}
        #: Each GEMM's right operand as its weight's axes: (free, contracted), or `None`.
        self.rhs_layouts: dict[int, tuple[tuple[int, ...], ...] | None] = {}

    def run(self, jaxpr: Any, inputs: Sequence[_Value]) -> list[_Value]:
        env: dict[Any, _Value] = {}

        def read(v: Any) -> _Value:
            return _NOTHING if jax_private.is_literal(v) else env.get(v, _NOTHING)

        for var, value in zip(jaxpr.invars, inputs, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars])
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        taint = frozenset().union(*(v.taint for v in ins))
        if name in GEMMS:
            self.feeds_gemm |= taint
            owners = {v.origin for v in ins[:2] if v.origin is not None}
            self.operands[id(eqn)] = (ins[0].origin, ins[1].origin if len(ins) > 1 else None)
            if name == "dot_general" and ins[1].axes is not None:
                self.rhs_layouts[id(eqn)] = _layout(ins[1].axes, eqn.params["dimension_numbers"])
            for owner in owners:
                self.gemms.setdefault(owner, set()).add(id(eqn))
            return [_Value(None, frozenset(owners))] * n_out
        if name in CHOICES:
            self.feeds_choice |= taint
        if name in VIEWS and ins:
            axes = ins[0].axes
            if name == "transpose" and axes is not None:
                axes = tuple(axes[i] for i in eqn.params["permutation"])
            elif name not in SAME_AXES:
                axes = None
            return [_Value(ins[0].origin, taint, axes)] * n_out
        if name in SCALINGS:
            shapes = [getattr(getattr(v, "aval", None), "shape", None) for v in eqn.invars]
            scaled = 0 if shapes[1] == () else 1 if name == "mul" and shapes[0] == () else None
            if scaled is not None and shapes[scaled] != ():
                return [_Value(ins[scaled].origin, taint, ins[scaled].axes)] * n_out
        subs = jax_private.sub_jaxprs(eqn)
        if subs:
            mapped = self.nested(eqn, ins, subs)
            if mapped is not None:
                return mapped
        return [_Value(None, taint)] * n_out

    def closed(self, sub: Any, ins: Sequence[_Value]) -> list[_Value]:
        jaxpr, consts = jax_private.jaxpr_parts(sub)
        lead = [_NOTHING] * (len(jaxpr.invars) - len(ins))  # an open jaxpr's constants
        return self.run(jaxpr, [*lead, *ins][-len(jaxpr.invars) :] if jaxpr.invars else [])

    def nested(self, eqn: Any, ins: list[_Value], subs: list) -> list[_Value] | None:
        """The outputs of an equation that holds jaxprs, its inputs mapped onto theirs."""
        name, params = eqn.primitive.name, eqn.params
        if name == "scan":
            n_consts, n_carry = jax_private.scan_counts(params)
            return self.loop(
                params["jaxpr"], ins[:n_consts], ins[n_consts : n_consts + n_carry],
                ins[n_consts + n_carry :], len(eqn.outvars),
            )  # fmt: skip
        if name == "while":
            nc, nb = params["cond_nconsts"], params["body_nconsts"]
            carry = ins[nc + nb :]
            outs = self.loop(params["body_jaxpr"], ins[nc : nc + nb], carry, [], len(carry))
            self.closed(params["cond_jaxpr"], [*ins[:nc], *outs])  # every pass's carry
            return outs
        if name == "cond":
            outs = [self.closed(b, ins[1:]) for b in params["branches"]]
            return [_merge(*vs) for vs in zip(*outs, strict=True)]
        for sub in subs:
            jaxpr, _ = jax_private.jaxpr_parts(sub)
            if len(jaxpr.invars) >= len(ins) and len(jaxpr.outvars) == len(eqn.outvars):
                return self.closed(sub, ins)
        return None

    def loop(
        self, body: Any, consts: list[_Value], carry: list[_Value], xs: list[_Value], n_out: int
    ) -> list[_Value]:
        """A loop body run until what its carry holds no longer grows."""
        carry = list(carry)
        for _ in range(8):
            outs = self.closed(body, [*consts, *carry, *xs])
            grown = [_merge(c, o) for c, o in zip(carry, outs[: len(carry)], strict=True)]
            if all(g.taint == c.taint for g, c in zip(grown, carry, strict=True)):
                break
            carry = grown
        return [*grown, *outs[len(carry) :]][:n_out]


def _merge(*values: _Value) -> _Value:
    origins = {v.origin for v in values}
    origin = origins.pop() if len(origins) == 1 else None
    axes = {v.axes for v in values}
    return _Value(
        origin,
        frozenset().union(*(v.taint for v in values)),
        axes.pop() if len(axes) == 1 else None,
    )


def _layout(axes: tuple[int, ...], dimension_numbers: Any) -> tuple[tuple[int, ...], ...] | None:
    """A GEMM's right operand, whose axes are its weight's `axes`, as the weight's (free,
    contracted) axes in the GEMM's order; `None` with batch axes."""
    (_, contracting), (_, batch) = dimension_numbers
    if batch:
        return None
    free = [axes[i] for i in range(len(axes)) if i not in contracting]
    return tuple(free), tuple(axes[i] for i in contracting)


def check_example_ran(closed_jaxpr: Any, flow: Dataflow, layers: Sequence[Path]) -> None:
    """Raise if a model's `example`, traced to `closed_jaxpr` (its [`Dataflow`][] `flow`),
    returned no array or ran none of the GEMMs of `layers`: it called a model it closes over,
    not the one it is handed, and no head could be found."""
    if not jax_private.jaxpr_parts(closed_jaxpr)[0].outvars:
        raise ValueError(
            "fp8_linear_layers: example returned no array; return the model's output (e.g. "
            "example=lambda m: jax.vmap(m)(x)), through which the trace finds the head."
        )
    if layers and not any(p in flow.gemms for p in layers):
        raise ValueError(
            "fp8_linear_layers: example traced no GEMM of the model's layers: it must call "
            "the model it is given (example=lambda m: m(x)), not a model it closes over."
        )


def dataflow(closed_jaxpr: Any, owners: Sequence[Path | None]) -> Dataflow:
    """The [`Dataflow`][] of a traced model call.

    **Arguments:**

    - `closed_jaxpr`: `jax.make_jaxpr` of the model's call as a function of its parameters
      (other inputs closed over).
    - `owners`: for each input of the jaxpr, the path of the layer it is a parameter of, or
      `None` (not a parameter of any layer).
    """
    jaxpr, consts = jax_private.jaxpr_parts(closed_jaxpr)
    if len(owners) != len(jaxpr.invars):
        raise ValueError(
            f"dataflow: {len(owners)} owners for a jaxpr of {len(jaxpr.invars)} inputs."
        )
    del consts
    tracer = _Tracer()
    outs = tracer.run(jaxpr, [_Value(o) for o in owners])
    return Dataflow(
        gemms={owner: len(eqns) for owner, eqns in tracer.gemms.items()},
        to_output=frozenset().union(*(v.taint for v in outs)),
        feeds_gemm=frozenset(tracer.feeds_gemm),
        feeds_choice=frozenset(tracer.feeds_choice),
    )


def gemm_operands(
    closed_jaxpr: Any, owners: Sequence[Path | None]
) -> dict[int, tuple[Path | None, Path | None]]:
    """Each GEMM equation of `closed_jaxpr` and the jaxprs inside it, by `id`, with the
    owners of its two operands (see [`dataflow`][]): which GEMMs multiply by whose weight."""
    jaxpr, _ = jax_private.jaxpr_parts(closed_jaxpr)
    tracer = _Tracer()
    tracer.run(jaxpr, [_Value(o) for o in owners])
    return tracer.operands


def gemm_rhs_layouts(
    closed_jaxpr: Any, owners: Sequence[Path | None]
) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Each `dot_general` of `closed_jaxpr` (and the jaxprs inside it) whose right operand is
    a weight, or a transpose or cast of it, by `id`: that operand as the weight's (free,
    contracted) axes in the GEMM's order (`x @ w` and `h @ w.T` differ for a square `w`).
    A GEMM whose operand passed through another view (a reshape) is left out."""
    jaxpr, _ = jax_private.jaxpr_parts(closed_jaxpr)
    tracer = _Tracer()
    inputs = [
        _Value(o, axes=None if o is None else tuple(range(len(v.aval.shape))))
        for o, v in zip(owners, jaxpr.invars, strict=True)
    ]
    tracer.run(jaxpr, inputs)
    return {k: v for k, v in tracer.rhs_layouts.items() if v is not None}


@final
@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What shapes alone say about a model: its embedding tables' row counts (the largest is
    the vocabulary) and its expert layers' expert counts, each by path; `distinct`: the
    paths of sequences whose entries are distinct layers, no repeated block (an
    `eqx.nn.Shared`'s `pytree`, the tied layers)."""

    embeddings: Mapping[Path, int] = dataclasses.field(default_factory=dict)
    experts: Mapping[Path, int] = dataclasses.field(default_factory=dict)
    distinct: frozenset[Path] = frozenset()

    @property
    def vocabulary(self) -> tuple[Path, int] | None:
        """The largest embedding table, `(path, rows)`, or `None` without one."""
        if not self.embeddings:
            return None
        path = max(sorted(self.embeddings), key=lambda p: self.embeddings[p])
        return path, self.embeddings[path]


def repeated(path: Path, stacked: bool = False, distinct: frozenset[Path] = frozenset()) -> bool:
    """Whether a layer is one of a repeated block's (an index in its path, or a stack of
    layers): a model's head appears once, outside its blocks. An index into a sequence of
    `distinct` (by its path: an `eqx.nn.Shared`'s tied layers) is no block's."""
    return stacked or any(n.isdigit() and path[:i] not in distinct for i, n in enumerate(path))


def role_of(
    path: Path,
    out_width: int | None,
    shapes: ModelShapes,
    flow: Dataflow | None,
    stacked: bool = False,
) -> str | None:
    """Why the Linear at `path` (`out_width` outputs; `stacked`: a stack of layers) stays in
    high precision by its role: a sentence starting "head" or "router", or `None`."""
    if flow is not None and flow.is_router(path):
        return "router: its output feeds a top-k / arg-max (the expert choice)"
    if flow is not None and path in flow.gemms:
        if flow.is_head(path):
            return "head: its output is the model's output (the last GEMM before it)"
        return None  # the trace knows better than widths (where it found the layer's GEMM)
    vocabulary = shapes.vocabulary
    once = not repeated(path, stacked, shapes.distinct)
    if vocabulary is not None and out_width == vocabulary[1] and once:
        return (
            f"head: its {out_width} outputs span the vocabulary of embedding "
            f"{'.'.join(vocabulary[0])!r}"
        )
    for expert_path, count in sorted(shapes.experts.items()):
        # A router is a layer of the module holding the experts (the MoE block's gate).
        if out_width == count and expert_path[: len(path) - 1] == path[:-1]:
            return f"router: its {out_width} outputs are the experts of {'.'.join(expert_path)!r}"
    return None


def owner_of(leaf_path: Path, layers: Sequence[Path]) -> Path:
    """The layer a parameter at `leaf_path` belongs to: the longest layer path it lies
    under, else the parameter's parent (a module that is not a convertible layer)."""
    best: Path | None = None
    for layer in layers:
        if leaf_path[: len(layer)] == layer and (best is None or len(layer) > len(best)):
            best = layer
    return best if best is not None else leaf_path[:-1]

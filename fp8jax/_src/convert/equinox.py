"""The Equinox and Haliax adapter of model conversion: finds the Linears of a pytree and gives
the chosen ones FP8 state. Haliax is looked up, never imported: it is an optional extra."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ..layers.grouped import GroupedLinear, high_precision_ragged_dot
from ..layers.linear import Linear, one_of_stack
from ..layers.moe_linear import Fp8MoELinear
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot
from .config import Fp8Config, dotted, stacked_dot_general
from .plan import (
    ConversionPlan,
    Converted,
    Fp8ConversionWarning,
    announce,
    decide,
)
from .roles import Dataflow, ModelShapes, check_example_ran, dataflow, owner_of

T = TypeVar("T")


def _key_name(key: Any) -> str:
    match key:
        case GetAttrKey(name=name):
            return str(name)
        case SequenceKey(idx=idx) | FlattenedIndexKey(key=idx):
            return str(idx)
        case DictKey(key=k):
            return str(k)
        case _:
            return str(key)


def _haliax_nn() -> Any:
    """`haliax.nn` if the user imported haliax (its modules can only be in the tree then)."""
    if "haliax" not in sys.modules:
        return None
    import haliax.nn as hnn

    return hnn


def _kind(node: Any, hnn: Any) -> str | None:
    if isinstance(node, eqx.nn.Linear | Linear):
        return "linear"
    if isinstance(node, GroupedLinear | Fp8MoELinear):
        return "grouped"
    if hnn is not None:
        if isinstance(node, hnn.Linear):
            return "linear"
        if isinstance(node, hnn.Stacked):
            return "stacked"
        if isinstance(node, hnn.MoELinear):
            return "moe"
    return None


def _children(node: Any) -> list[tuple[Any, Any]]:
    """The direct children of a pytree node with their keys (none for a leaf)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and flat[0][0] == ():
        return []
    return [(path[0], child) for path, child in flat]


def _walk(node: Any, path: tuple[str, ...], hnn: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every pytree node with its path, not descending into Linears."""
    yield path, node
    if _kind(node, hnn) in ("linear", "grouped", "moe") or isinstance(node, jax.Array):
        return
    for key, child in _children(node):
        yield from _walk(child, path + (_key_name(key),), hnn)


def _haliax_own_gemm(linears: list[tuple[tuple[str, ...], Any]], hnn: Any) -> dict[Any, str]:
    """The Haliax Linears with a `dot_general` other than Haliax's default GEMM (or
    `jax.lax.dot_general`) and fp8jax's: quantized by `haliax.quantization` already (its int8
    or FP8 one), or the user's. Each with why it keeps it: replaced, it would be lost."""
    found = {}
    for path, node in linears:
        if hnn is None or not isinstance(node, hnn.Linear):
            continue
        op = node.dot_general
        name = type(op).__name__
        if op is jax.lax.dot_general or _is_fp8_op(op) or name == "DefaultDotGeneralOp":
            continue
        if type(op).__module__.startswith("haliax."):
            found[path] = f"it is quantized by haliax.quantization already ({name})"
        else:
            found[path] = f"it has a dot_general of its own ({name}), which FP8's would replace"
    return found


def _is_fp8_op(x: Any) -> bool:
    return isinstance(x, Fp8DotGeneral | Fp8RaggedDot)


def _converted(linears: list[tuple[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Converted]:
    """The layers in FP8 already: each one's recipe and whether it records telemetry."""
    found = {}
    for path, node in linears:
        for op in (getattr(node, "dot_general", None), getattr(node, "ragged_dot", None)):
            if isinstance(op, Fp8DotGeneral | Fp8RaggedDot):
                found[path] = (op.recipe, op.stats is not None)
    return found


def _tied(node: Any) -> bool:
    """Whether a layer's weight is not an array of its own: tied to another layer's by
    `eqx.nn.Shared`, which puts a node standing for it in its place."""
    return not hasattr(getattr(node, "weight", None), "shape")


def _axis_sizes(spec: Any) -> dict[str, int]:
    """A Haliax axis spec's sizes by name: an `Axis`, a sequence of them, or a shape dict
    (`{"heads": 8, "head_dim": 64}`)."""
    if isinstance(spec, dict):
        return dict(spec)
    axes = spec if isinstance(spec, tuple | list) else (spec,)
    return {a.name: a.size for a in axes}


def _kernel_shape(linear: Any) -> tuple[int, int]:
    """The Linear's weight as the canonical `(N, K)` matrix (contracted axes last); one
    layer's, for a stack of them."""
    if isinstance(linear, eqx.nn.Linear | Linear):
        return tuple(linear.weight.shape[-2:])
    return tuple(math.prod(_axis_sizes(spec).values()) for spec in (linear.Out, linear.In))


def _stack_shape(linear: Any) -> tuple[int, ...]:
    """The sizes of a Linear's weight axes that are not its matrix's: a stack of layers
    (a Haliax `Stacked`'s, or built under a vmap), in the weight's order, outermost first."""
    if isinstance(linear, eqx.nn.Linear | Linear):
        return tuple(linear.weight.shape[:-2])
    names = {**_axis_sizes(linear.In), **_axis_sizes(linear.Out)}
    return tuple(a.size for a in linear.weight.axes if a.name not in names)


def _stacked_eqx_linear(linear: eqx.nn.Linear, config: Fp8Config, path: tuple[str, ...]) -> Linear:
    """`Linear.from_eqx(linear)`, also for a stack of Linears (the Equinox pattern for scanned
    layers: built under `eqx.filter_vmap`, weights `(*layers, out, in)`), with FP8 state
    stacked the same way (one state per layer)."""
    lead = linear.weight.shape[:-2]
    kernel_shape = tuple(linear.weight.shape[-2:])
    dot = stacked_dot_general(
        config.recipe_for(path), lead, kernel_shape, ".".join(path), config.telemetry
    )
    if not lead:
        return Linear.from_eqx(linear, dot)

    one = Linear.from_eqx(
        eqx.tree_at(
            lambda m: (m.weight, m.bias),
            linear,
            (one_of_stack(linear.weight, len(lead)), one_of_stack(linear.bias, len(lead))),
            is_leaf=lambda x: x is None,
        ),
        None,
    )
    return eqx.tree_at(
        lambda m: (m.weight, m.bias, m.dot_general),
        one,
        (linear.weight, linear.bias, dot),
        is_leaf=lambda x: x is None,
    )


def _fp8_grouped(layer: GroupedLinear, config: Fp8Config, path: tuple[str, ...]) -> GroupedLinear:
    """`layer` with an `Fp8RaggedDot` as its `ragged_dot`, its state stacked like the weight
    when the layer is a stack of them (weights `(*layers, experts, in, out)`)."""
    lead = layer.weight.shape[:-3]
    dot = Fp8RaggedDot(
        config.recipe_for(path),
        num_experts=layer.weight.shape[-3],
        name=".".join(path),
        telemetry=config.telemetry,
        native_kernel=config.grouped_native_kernel,
    )
    dot = jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), dot)
    return eqx.tree_at(lambda m: m.ragged_dot, layer, dot, is_leaf=lambda x: x is None)


def _fp8_moe(layer: Any, config: Fp8Config, path: tuple[str, ...]) -> Fp8MoELinear:
    """Haliax's `MoELinear` as an [`fp8jax.Fp8MoELinear`][], with the same weight, bias and
    axes; a stack of them (inside a `Stacked`, or built under `hax.vmap`: weight axes beyond
    `Experts`, `In` and `Out`) gets its FP8 state stacked the same way (one per layer)."""
    name = ".".join(path)
    for role in ("In", "Out", "Experts"):
        if isinstance(getattr(layer, role), tuple | list):
            raise ValueError(
                f"fp8_linear_layers: the haliax MoELinear {name!r} has several {role} axes "
                f"({getattr(layer, role)!r}); fp8jax converts one In, one Out and one "
                "Experts axis. Exclude it, or flatten the axes."
            )
    dot = Fp8RaggedDot(
        config.recipe_for(path),
        num_experts=layer.Experts.size,
        name=name,
        telemetry=config.telemetry,
        native_kernel=config.grouped_native_kernel,
    )
    names = {layer.Experts.name, layer.In.name, layer.Out.name}
    lead = tuple(a.size for a in layer.weight.axes if a.name not in names)
    dot = jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), dot)
    return Fp8MoELinear(layer.weight, layer.bias, dot, layer.Experts, layer.In, layer.Out)


def _out_width(node: Any, kind: str | None) -> int | None:
    """How many outputs a Linear or expert layer has (its GEMM's `N`)."""
    if kind == "linear":
        return _kernel_shape(node)[0]
    if isinstance(node, GroupedLinear):
        return node.weight.shape[-1]
    if kind in ("grouped", "moe"):
        return node.Out.size
    return None


def _shapes(nodes: list[tuple[tuple[str, ...], Any]], hnn: Any) -> ModelShapes:
    """The embedding tables' row counts and the expert layers' expert counts of a tree."""
    embeddings, experts, distinct = {}, {}, set()
    for path, node in nodes:
        if isinstance(node, eqx.nn.Shared):
            distinct.add((*path, "pytree"))  # its tied layers, no repeated block's
        elif isinstance(node, eqx.nn.Embedding):
            # A table tied to a head's weight (`eqx.nn.Shared`) has its rows all the same.
            embeddings[path] = node.num_embeddings
        elif hnn is not None and isinstance(node, hnn.Embedding):
            embeddings[path] = node.Vocab.size
        elif isinstance(node, GroupedLinear):
            experts[path] = node.weight.shape[-3]
        elif _kind(node, hnn) == "moe" or isinstance(node, Fp8MoELinear):
            experts[path] = node.Experts.size
    return ModelShapes(embeddings, experts, frozenset(distinct))


@final
class _HighPrecision(eqx.Module):
    """An FP8 op's GEMM in high precision, in its place while a model converted already is
    traced: the trace follows a weight to its GEMM through views of it, never through its
    quantization, so that it finds an FP8 layer's role as it found the layer's before."""

    ragged: bool = eqx.field(static=True)

    def __call__(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> Any:
        return (_ragged_dot if self.ragged else jax.lax.dot_general)(lhs, rhs, *args, **kwargs)


def _ragged_dot(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: Any = None,
    out_sharding: Any = None,
) -> Any:
    """`Fp8RaggedDot`'s call in high precision (its group sizes taken as it takes them)."""
    del precision, group_offset, out_sharding
    return high_precision_ragged_dot("Fp8RaggedDot", lhs, rhs, group_sizes, preferred_element_type)


def _trace(
    tree: Any, example: Callable[[Any], Any], layers: list[tuple[str, ...]], own: list
) -> Dataflow:
    """The dataflow of `example(tree)`, each array leaf of `tree` owned by its layer, FP8
    layers traced with their GEMM in high precision; `example` must run a GEMM of one of
    the layers `own` (those not tied to another)."""
    tree = jax.tree.map(
        lambda x: _HighPrecision(isinstance(x, Fp8RaggedDot)) if _is_fp8_op(x) else x,
        tree,
        is_leaf=_is_fp8_op,
    )
    # An abstract model's weights (`eqx.filter_eval_shape`) are traced as its arrays would be.
    params, static = eqx.partition(
        tree, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    owners = [owner_of(tuple(_key_name(k) for k in path), layers) for path, _ in flat]

    def call(leaves: list) -> Any:
        return example(eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static))

    closed = jax.make_jaxpr(call)([x for _, x in flat])
    flow = dataflow(closed, owners)
    check_example_ran(closed, flow, own)
    return flow


def equinox_plan(
    tree: Any, config: Fp8Config, example: Callable[[Any], Any] | None = None
) -> tuple[ConversionPlan, set[tuple[str, ...]]]:
    """Which Linears and expert layers of an Equinox or Haliax `tree` `config` converts, and
    why the others stay in high precision (roles from `example`'s trace when given): the plan
    and the converted layers' paths."""
    hnn = _haliax_nn()
    nodes = list(_walk(tree, (), hnn))
    kinds = {p: _kind(n, hnn) for p, n in nodes}
    linears = [(p, n) for p, n in nodes if kinds[p] in ("linear", "grouped", "moe")]
    layer_paths = [p for p, _ in linears]
    shapes = _shapes(nodes, hnn)
    tied = {p for p, n in linears if _tied(n)}
    converted = _converted(linears)
    # The layers whose GEMM a trace sees: not tied to another.
    own = [p for p in layer_paths if p not in tied]
    flow = None if example is None else _trace(tree, example, layer_paths, own)
    # A Haliax `Stacked`'s layers: by the node, not by a path name (an Equinox field may be
    # called `stacked`).
    stacks = [p for p in kinds if kinds[p] == "stacked"]
    widths = {
        p: (
            None if p in tied else _out_width(n, "linear"),
            any(p[: len(s)] == s for s in stacks) or (p not in tied and bool(_stack_shape(n))),
        )
        for p, n in linears
        if kinds[p] == "linear"  # experts are never heads or routers
    }
    kept = {p: "its weight is another layer's (eqx.nn.Shared)" for p in tied}
    kept.update(_haliax_own_gemm(linears, hnn))
    for p, n in linears:
        dtype = getattr(getattr(n, "weight", None), "dtype", None)
        if p not in tied and dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            kept[p] = f"its weight is {dtype}, not a floating dtype FP8 could round"
        elif isinstance(n, eqx.nn.Linear) and type(n) is not eqx.nn.Linear:
            kept[p] = (
                f"it is a {type(n).__name__}, a subclass of eqx.nn.Linear: fp8jax.Linear "
                "would drop its own call and fields (run it under fp8jax.fp8_autocast)"
            )
    return decide(
        config,
        nodes,
        linears,
        lambda n: isinstance(n, eqx.Module),
        widths=widths,
        shapes=shapes,
        flow=flow,
        kinds={p: type(n).__name__ for p, n in linears},
        advice=lambda p: (
            "write its GEMM as an eqx.nn.Linear, or run the model under fp8jax.fp8_autocast"
        ),
        converted=converted,
        kept=kept,
        stacks={p: n.Block.size for p, n in nodes if kinds[p] == "stacked"},
    )


def fp8_equinox_linear_layers(
    tree: T,
    config: Fp8Config,
    example: Callable[[T], Any] | None = None,
    explain: bool = False,
) -> T:
    """The Equinox and Haliax branch of [`fp8jax.fp8_linear_layers`][]: `tree` with its chosen
    `eqx.nn.Linear`s as [`fp8jax.Linear`][]s, its chosen Haliax `Linear`s (also inside a
    `Stacked`) with an [`fp8jax.Fp8DotGeneral`][] and its chosen [`fp8jax.GroupedLinear`][]s
    with an [`fp8jax.Fp8RaggedDot`][]; any other pytree node is kept."""
    hnn = _haliax_nn()
    plan, chosen = equinox_plan(tree, config, example)
    announce(plan, explain, "Equinox" if hnn is None else "Equinox/Haliax")
    linears = [(p, n) for p, n in _walk(tree, (), hnn) if _kind(n, hnn) == "linear"]
    own = _haliax_own_gemm(linears, hnn)
    kept = [dotted(p) for p, why in own.items() if plan.kept.get(dotted(p)) == why]
    quantized = [p for p in kept if "haliax.quantization" in plan.kept[p]]
    if quantized:
        warnings.warn(
            f"fp8_linear_layers: {len(quantized)} Haliax Linear(s) quantized by "
            f"haliax.quantization already keep that quantization, not FP8: "
            f"{', '.join(quantized)}. Build them without "
            "haliax.quantization.quantize_linear_layers for fp8jax's FP8.",
            Fp8ConversionWarning,
            stacklevel=3,
        )
    users = [p for p in kept if p not in quantized]
    if users:
        warnings.warn(
            f"fp8_linear_layers: {len(users)} Haliax Linear(s) with a dot_general of their own "
            f"keep it, in high precision, not FP8: {', '.join(users)}. To convert one, give "
            "it Haliax's default GEMM first: dataclasses.replace(layer, "
            "dot_general=haliax.quantization.DefaultDotGeneralOp.init()).",
            Fp8ConversionWarning,
            stacklevel=3,
        )

    def convert(path: tuple[str, ...], node: Any) -> Any:
        kind = _kind(node, hnn)
        if kind == "linear":
            if path not in chosen:  # kept, or FP8 already
                return node
            if isinstance(node, eqx.nn.Linear):
                return _stacked_eqx_linear(node, config, path)
            if isinstance(node, Linear):  # fp8jax's, built with another GEMM
                lead = node.weight.shape[:-2]  # a stack's axes, a Stacked's among them
                shape = tuple(node.weight.shape[-2:])
                recipe = config.recipe_for(path)
                dot = stacked_dot_general(recipe, lead, shape, ".".join(path), config.telemetry)
                return eqx.tree_at(lambda m: m.dot_general, node, dot)
            # One state per layer of a stack (a Stacked's, or a vmap's): the weight's other axes.
            dot = stacked_dot_general(
                config.recipe_for(path),
                _stack_shape(node),
                _kernel_shape(node),
                ".".join(path),
                config.telemetry,
            )
            return dataclasses.replace(node, dot_general=dot)
        if kind == "grouped":
            return node if path not in chosen else _fp8_grouped(node, config, path)
        if kind == "moe":
            return node if path not in chosen else _fp8_moe(node, config, path)
        if kind == "stacked":
            inner = convert(path + ("stacked",), node.stacked)
            return dataclasses.replace(node, stacked=inner)
        if isinstance(node, jax.Array):
            return node
        children = _children(node)
        if not children:
            return node
        new = [convert(path + (_key_name(k),), c) for k, c in children]
        if all(n is c for n, (_, c) in zip(new, children, strict=True)):
            return node  # nothing converted below: keep the very same object
        treedef = jax.tree_util.tree_structure(node, is_leaf=lambda x: x is not node)
        return jax.tree_util.tree_unflatten(treedef, new)

    return convert((), tree)

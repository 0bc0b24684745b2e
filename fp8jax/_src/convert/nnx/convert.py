"""The Flax NNX adapter of model conversion: finds the `nnx.Linear`s, `nnx.LinearGeneral`s
(`nnx.MultiHeadAttention`'s projections among them), `nnx.Einsum`s and modules multiplying
by a `kernel` of their own (see `kernel.py`) of an NNX model and gives the chosen ones an FP8
`dot_general`, `einsum_op` or call."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ROOT, Fp8Config, dotted
from ..einsum import check_einsum, einsum_kernel_shape
from ..plan import ConversionPlan, Converted, Fp8ConversionWarning, announce, decide
from ..roles import Dataflow, ModelShapes, check_example_ran, dataflow, owner_of
from .grouped import Fp8NnxRaggedDot, NnxGroupedLinear
from .kernel import (
    FP8_DOT,
    KERNEL,
    NOT_LINEAR,
    convert_kernel_module,
    has_kernel,
    kernel_out_width,
    original_class,
)
from .layers import AbstractFp8NnxDot, Fp8NnxDotGeneral, Fp8NnxEinsum

M = TypeVar("M")


#: The layers converted by giving them an FP8 GEMM op, by their class's call.
_LAYERS = ((nnx.Linear, "linear"), (nnx.LinearGeneral, "general"), (nnx.Einsum, "einsum"))


def _kind(node: Any) -> str | None:
    for cls, kind in _LAYERS:
        if isinstance(node, cls):
            # A subclass with a `__call__` of its own may never call its GEMM op: with a
            # matrix kernel, it is converted as a kernel module, by tracing its call.
            if type(node).__call__ is cls.__call__ or not has_kernel(node):
                return kind
            return "kernel"
    if isinstance(node, NnxGroupedLinear):
        return "experts"
    if has_kernel(node):
        return "kernel"  # a module multiplying by its own kernel: converted by its call
    return None


def _fp8_op(node: Any) -> Any:
    """The FP8 op a layer converted already holds, or None."""
    for attr in ("dot_general", "einsum_op", "ragged_dot", FP8_DOT):
        op = getattr(node, attr, None)
        if isinstance(op, AbstractFp8NnxDot):
            return op
    return None


def _converted(layers: list[tuple[tuple[str, ...], Any]]) -> dict[tuple[str, ...], Converted]:
    """The layers in FP8 already: each one's recipe and whether it records telemetry."""
    found = {}
    for path, layer in layers:
        op = _fp8_op(layer)
        if op is not None:
            found[path] = (op.recipe, op.state.stats is not None)
    return found


def _graph_nodes(model: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every node of an NNX graph with its dotted-path parts, outside layers (a kernel
    module's children are kept: they may be layers) and NNX's own bookkeeping attributes,
    each shared node once (under its first path)."""
    nodes = []
    for path, node in nnx.iter_graph(model, graph=True):
        parts = tuple(str(p) for p in path)
        if any(p.startswith(("_pytree__", "_object__")) for p in parts):
            continue
        nodes.append((parts, node))
    nodes.sort(key=lambda item: item[0])
    layers = [p for p, n in nodes if _kind(n) not in (None, "kernel")]
    return [
        (p, n)
        for p, n in nodes
        if not any(len(p) > len(lp) and p[: len(lp)] == lp for lp in layers)
    ]


#: A layer's GEMM attribute, by kind, and the values Flax builds it with.
_OWN_OPS = {
    "linear": ("dot_general", (None, jax.lax.dot_general)),
    "general": ("dot_general", (None, jax.lax.dot_general)),
    "einsum": ("einsum_op", (None, jnp.einsum)),
}


def _own_gemm(layers: list[tuple[tuple[str, ...], Any]]) -> dict[tuple[str, ...], str]:
    """The layers built with a GEMM op of the user's (a `dot_general`, an `einsum_op`, a
    LinearGeneral's `dot_general_cls`: a quantization library's, a wrapper), each with why
    it keeps it: FP8's would replace it."""
    found = {}
    for path, layer in layers:
        attr, defaults = _OWN_OPS.get(_kind(layer), (None, ()))
        if attr is None or _fp8_op(layer) is not None:
            continue
        if _kind(layer) == "general" and layer.dot_general_cls is not None:
            attr, op = "dot_general_cls", layer.dot_general_cls  # its call prefers it
        else:
            op = getattr(layer, attr)
            if any(op is d for d in defaults):
                continue
        what = getattr(op, "__name__", type(op).__name__)
        article = "an" if attr == "einsum_op" else "a"
        found[path] = f"it has {article} {attr} of its own ({what}), which FP8's would replace"
    return found


def _not_floating(layers: list[tuple[tuple[str, ...], Any]]) -> dict[tuple[str, ...], str]:
    """The layers whose kernel is not a floating dtype (an integer one, quantized already; a
    complex one), each with why it stays in high precision, as the Equinox path keeps them:
    FP8 has no format for it (an int8 kernel in FP8 lost its exact values to FP8's rounding;
    a complex one raised at its call)."""
    found = {}
    for path, layer in layers:
        kernel = getattr(layer, KERNEL, None)
        dtype = getattr(getattr(kernel, "get_value", lambda: None)(), "dtype", None)
        if _fp8_op(layer) is None and dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            found[path] = f"its kernel is {dtype}, not a floating dtype FP8 could round"
    return found


def _stacked_experts(layers: list[tuple[tuple[str, ...], Any]]) -> dict[tuple[str, ...], str]:
    """The `NnxGroupedLinear`s built under `nnx.vmap` (a kernel of more than three axes), each
    with why it stays in high precision: their FP8 `ragged_dot` holds one layer's experts.
    (Their conversion raised, whatever the config, and the model's other layers with it.)"""
    found = {}
    for path, layer in layers:
        if _kind(layer) != "experts" or _fp8_op(layer) is not None:
            continue
        shape = tuple(layer.kernel.get_value().shape)
        if len(shape) != 3:
            found[path] = (
                f"its kernel {shape} is a stack of expert layers (nnx.vmap), which fp8jax's "
                "NNX experts do not convert: build each layer's NnxGroupedLinear apart"
            )
    return found


def _fp8_layer(path: tuple[str, ...], layer: Any, config: Fp8Config) -> AbstractFp8NnxDot:
    recipe = config.recipe_for(path)
    name = ".".join(path)
    shown = repr(name) if name else ROOT  # how errors name it: as plans print its path
    kernel = layer.kernel.get_value()
    if _kind(layer) == "linear":
        # nnx.Linear's kernel is (*stacked, in, out); the canonical matrix is (out, in).
        stacked, shape = tuple(kernel.shape[:-2]), (kernel.shape[-1], kernel.shape[-2])
        return Fp8NnxDotGeneral(recipe, shape, name, config.telemetry, stacked=stacked)
    if _kind(layer) == "experts":
        if kernel.ndim != 3:
            raise ValueError(
                f"fp8_linear_layers: the NnxGroupedLinear {shown} has a kernel of shape "
                f"{tuple(kernel.shape)}; stacked expert layers (nnx.vmap) are not converted."
            )
        return Fp8NnxRaggedDot(
            recipe,
            num_experts=kernel.shape[0],
            name=name,
            telemetry=config.telemetry,
            native_kernel=config.grouped_native_kernel,
        )
    if _kind(layer) == "general":
        # Its kernel is (*stacked, *batch, *in, *out): one (out, in) matrix unless it has
        # batch axes (a kernel per batch entry).
        n_batch, n_in = len(layer.batch_axis), len(layer.in_features)
        n_out = len(layer.out_features)
        n_stacked = kernel.ndim - n_batch - n_in - n_out
        stacked = tuple(kernel.shape[:n_stacked])
        if not n_batch:
            shape = (math.prod(layer.out_features), math.prod(layer.in_features))
            return Fp8NnxDotGeneral(recipe, shape, name, config.telemetry, stacked=stacked)
        try:
            return Fp8NnxDotGeneral(recipe, None, name, config.telemetry, stacked=stacked)
        except ValueError as e:
            what = f"nnx.LinearGeneral {shown} (batch_axis={dict(layer.batch_axis)}"
            raise _batch_axes_refused(what, kernel.shape, recipe, e) from None
    # Its kernel is (*stacked, *kernel_shape): a stack built under nnx.vmap has one per layer.
    own = _einsum_kernel(layer)
    stacked = tuple(kernel.shape[: kernel.ndim - len(own)])
    if isinstance(layer.einsum_str, str):
        try:
            check_einsum(layer.einsum_str, len(own))
        except ValueError as e:
            raise ValueError(
                f"fp8_linear_layers: nnx.Einsum {shown} ({layer.einsum_str!r}, kernel "
                f"{tuple(kernel.shape)}): {e} Exclude it (Fp8Config targets or exclude) to keep "
                "it in high precision."
            ) from None
    shape = einsum_kernel_shape(layer.einsum_str, own)
    try:
        return Fp8NnxEinsum(recipe, shape, name, config.telemetry, stacked=stacked)
    except ValueError as e:
        what = f"nnx.Einsum {shown} ({layer.einsum_str!r}"
        raise _batch_axes_refused(what, kernel.shape, recipe, e) from None


def _batch_axes_refused(
    what: str, kernel_shape: tuple[int, ...], recipe: Any, error: Exception
) -> ValueError:
    """The refusal of `recipe`'s state of a kernel's `(out, in)` shape (`ResidualFP8`'s
    error feedback) for the layer `what` names, whose kernel has batch axes: why, and what to
    do instead (the recipe's own `error` advises `Fp8DotGeneral`'s `kernel_shape`)."""
    where = f"fp8_linear_layers: {what}, kernel {tuple(kernel_shape)})"
    if not getattr(recipe, "error_feedback", False):
        return ValueError(f"{where}: {error}")
    return ValueError(
        f"{where}: its recipe, "
        f"{type(recipe).__name__} with error feedback, keeps the kernel's quantization error "
        "as state of the kernel's (out, in) shape, and this kernel has batch axes, so it has "
        "no single (out, in) matrix: convert it with another recipe (Fp8Config recipes), or "
        "exclude it."
    )


def _einsum_kernel(layer: Any) -> tuple[int, ...]:
    """The kernel shape of one of an `nnx.Einsum`'s layers: its `kernel_shape`, without the
    leading axes of a stack built under `nnx.vmap`."""
    shape = tuple(layer.kernel.get_value().shape)
    own = getattr(layer, "kernel_shape", None)
    if isinstance(own, tuple) and len(own) <= len(shape) and shape[len(shape) - len(own) :] == own:
        return own
    return shape


@dataclasses.dataclass(frozen=True)
class _PromoteAllButKernel:
    """An NNX layer's `promote_dtype` that leaves its kernel (the second of its arguments) as
    it is: the FP8 GEMM quantizes the float32 master itself (`_quantize_masters`). The
    promotion is given every argument, `(inputs, kernel, bias)`, as a user's of NNX's
    documented signature needs; its cast kernel is unused (XLA drops the cast)."""

    promote: Callable[..., Any]

    def __call__(self, args: tuple[Any, ...], **kwargs: Any) -> tuple[Any, ...]:
        promoted = self.promote(args, **kwargs)
        return (promoted[0], args[1], *promoted[2:])


def _quantize_masters(layer: Any) -> None:
    """An FP8 `nnx.Linear` or `nnx.LinearGeneral` computing in a `dtype` narrower than its
    kernel's (`param_dtype=float32, dtype=bfloat16`): its kernel reaches the FP8 GEMM uncast,
    to be quantized from the master in one pass where a cast would write a BF16 copy for the
    quantization to read again, and the GEMM returns `dtype` (its `preferred_element_type`;
    the kernel's gradient is written in it, as a cast's would be). A layer whose
    `preferred_element_type` is set already is left as it is."""
    dtype = getattr(layer, "dtype", None)
    if dtype is None or getattr(layer, "preferred_element_type", dtype) is not None:
        return
    if not hasattr(layer, "promote_dtype"):
        return
    kernel = np.dtype(layer.kernel.get_value().dtype)
    if not jnp.issubdtype(kernel, jnp.floating) or np.dtype(dtype).itemsize >= kernel.itemsize:
        return
    layer.promote_dtype = _PromoteAllButKernel(layer.promote_dtype)
    layer.preferred_element_type = dtype


def _out_width(layer: Any) -> int | None:
    kind = _kind(layer)
    if kind == "kernel":
        return kernel_out_width(layer)
    kernel = layer.kernel.get_value()
    if kind in ("linear", "experts"):
        return kernel.shape[-1]
    if kind == "general":
        return math.prod(layer.out_features)
    shape = einsum_kernel_shape(layer.einsum_str, _einsum_kernel(layer))
    return None if shape is None else shape[0]


def _shapes(nodes: list[tuple[tuple[str, ...], Any]]) -> ModelShapes:
    embeddings = {p: n.num_embeddings for p, n in nodes if isinstance(n, nnx.Embed)}
    experts = {
        p: n.kernel.get_value().shape[-3] for p, n in nodes if isinstance(n, NnxGroupedLinear)
    }
    return ModelShapes(embeddings, experts)


def _in_high_precision(model: Any) -> Any:
    """A copy of `model` whose FP8 layers have their high-precision GEMM back: a trace
    follows a kernel to its GEMM through views of it, never through its quantization, so that
    it finds an FP8 layer's role as it found the layer's before (conversion replaced only the
    default GEMM: `lax.dot_general`, `jnp.einsum`, `lax.ragged_dot`, or the module's call)."""
    model = nnx.clone(model, graph=True)
    for _, node in _graph_nodes(model):
        for attr, plain in _PLAIN.items():
            if isinstance(getattr(node, attr, None), AbstractFp8NnxDot):
                delattr(node, attr)  # a static attribute again, as before conversion
                setattr(node, attr, plain)
        if isinstance(getattr(node, "__dict__", {}).get(FP8_DOT), AbstractFp8NnxDot):
            delattr(node, FP8_DOT)
            object.__setattr__(node, "__class__", original_class(node))
    return model


#: The GEMM attribute of each convertible NNX layer, and its high-precision default.
_PLAIN: dict[str, Any] = {
    "dot_general": jax.lax.dot_general,
    "einsum_op": jnp.einsum,
    "ragged_dot": None,
}


def _trace(
    model: Any, example: Callable[[Any], Any], layers: list[tuple[str, ...]], own: list
) -> Dataflow:
    """The dataflow of `example(model)`, each variable owned by its layer, FP8 layers traced
    with their GEMM in high precision; `example` must run a GEMM of one of the layers `own`."""
    graphdef, state = nnx.split(_in_high_precision(model))
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in p) for p, _ in flat]
    owners = [owner_of(n[:-1] if n[-1] == "value" else n, layers) for n in names]

    def call(leaves: list) -> Any:
        return example(nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)))

    closed = jax.make_jaxpr(call)([x for _, x in flat])
    flow = dataflow(closed, owners)
    check_example_ran(closed, flow, own)
    return flow


def _stacked_kernel(node: Any) -> tuple[int, ...] | None:
    """The shape of a module's own `kernel` `nnx.Param` of more than two axes (a stack of
    kernel modules built under `nnx.vmap`, or a convolution's of the user's), else None."""
    kernel = vars(node).get(KERNEL) if isinstance(node, nnx.Module) else None
    if isinstance(node, NOT_LINEAR) or not isinstance(kernel, nnx.Param):
        return None
    shape = tuple(getattr(kernel.get_value(), "shape", ()))
    return shape if len(shape) > 2 else None


def _untraced_stacks(nodes: list[tuple[tuple[str, ...], Any]]) -> tuple[str, ...]:
    """The modules holding a stack of kernels, for a plan made without `example`: no trace
    tells whether they multiply by it, and they stay in high precision whatever they do."""
    return tuple(
        f"{dotted(p)} ({_advice(n)}; without example= fp8jax cannot tell "
        "whether it multiplies by it or is a convolution: pass example=lambda m: m(x) to "
        "have the trace say)"
        for p, n in nodes
        if _kind(n) is None and _stacked_kernel(n) is not None
    )


def _advice(node: Any) -> str:
    """What to do with a module whose GEMMs on its own weights stay in high precision. A stack
    of modules multiplying by their own `kernel` (built under `nnx.vmap`: a kernel of more
    than two axes) does so already, which converts one such module but not a stack: NNX's
    layers are what converts per layer of a stack."""
    shape = _stacked_kernel(node)
    if shape is not None:
        return (
            f"its `kernel` of shape {shape} is a stack of kernels "
            "(modules built under nnx.vmap?), which is not converted: build the stacked "
            "layers from nnx.Linear, nnx.LinearGeneral or nnx.Einsum (one FP8 state per "
            "layer), or run it under fp8jax.fp8_autocast"
        )
    return (
        "write its GEMM as an nnx.Linear, nnx.LinearGeneral or nnx.Einsum, "
        "or multiply by a `kernel` nnx.Param of the module's own, or run it under "
        "fp8jax.fp8_autocast"
    )


def _kind_name(node: Any) -> str:
    """A layer's class as the plan names it: NNX's by `nnx.`, fp8jax's experts by `fp8jax.`,
    a kernel module's by its own class's name."""
    if _kind(node) == "kernel":
        return original_class(node).__name__
    if _kind(node) == "experts":
        return f"fp8jax.{type(node).__name__}"
    return f"nnx.{type(node).__name__}"


def nnx_plan(
    model: Any, config: Fp8Config, example: Callable[[Any], Any] | None = None
) -> tuple[ConversionPlan, set[tuple[str, ...]], list[tuple[tuple[str, ...], Any]]]:
    """Which layers of an NNX `model` `config` converts and why the others stay in high
    precision: the plan, the converted paths, and the layers with their paths."""
    nodes = _graph_nodes(model)
    layers = [(p, n) for p, n in nodes if _kind(n) is not None]
    paths = [p for p, _ in layers]
    shapes = _shapes(nodes)
    converted = _converted(layers)
    flow = None if example is None else _trace(model, example, paths, paths)
    widths = {
        p: (_out_width(n), _kind(n) == "linear" and n.kernel.get_value().ndim > 2)
        for p, n in layers
        if _kind(n) != "experts"  # experts are never heads or routers
    }
    kinds = {p: _kind_name(n) for p, n in layers}
    plan, chosen = decide(
        config,
        nodes,
        layers,
        lambda n: isinstance(n, nnx.Module),
        widths=widths,
        shapes=shapes,
        flow=flow,
        kinds=kinds,
        advice=lambda p: _advice(dict(nodes).get(p)),
        converted=converted,
        kept={**_own_gemm(layers), **_stacked_experts(layers), **_not_floating(layers)},
    )
    if example is None:
        unconverted = plan.unconverted + _untraced_stacks(nodes)
        plan = dataclasses.replace(plan, unconverted=unconverted)
    return plan, chosen, layers


def fp8_nnx_linear_layers(
    model: M,
    config: Fp8Config | None = None,
    example: Callable[[M], Any] | None = None,
    explain: bool = False,
) -> M:
    """The NNX branch of [`fp8jax.fp8_linear_layers`][]: a copy of `model` whose chosen
    `nnx.Linear`s and `nnx.LinearGeneral`s get an [`fp8jax.Fp8NnxDotGeneral`][] as
    `dot_general`, whose chosen `nnx.Einsum`s an [`fp8jax.Fp8NnxEinsum`][] as
    `einsum_op`, and whose chosen modules multiplying by their own `kernel` an
    `Fp8NnxDotGeneral` as `fp8_dot`, which their call's GEMMs on the kernel run on."""
    config = Fp8Config() if config is None else config
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"fp8_linear_layers: model={type(model).__name__}: the NNX path converts an nnx.Module."
        )
    # New variables, the same arrays: the caller's model is kept.
    model = nnx.clone(model, graph=True)
    plan, chosen, layers = nnx_plan(model, config, example)
    announce(plan, explain, "Flax NNX")
    own = [dotted(p) for p, why in _own_gemm(layers).items() if plan.kept.get(dotted(p)) == why]
    if own:
        warnings.warn(
            f"fp8_linear_layers: {len(own)} NNX layer(s) with a GEMM op of their own keep it, "
            f"in high precision, not FP8: {', '.join(own)}. To convert one, give it NNX's "
            "default first: layer.dot_general = jax.lax.dot_general (an nnx.Einsum's "
            "layer.einsum_op = jnp.einsum; a LinearGeneral's layer.dot_general_cls = None).",
            Fp8ConversionWarning,
            stacklevel=3,
        )
    for path, layer in layers:
        if path not in chosen:  # kept, or FP8 already
            continue
        if _kind(layer) == "kernel":
            convert_kernel_module(layer, path, config)
            continue
        dot = _fp8_layer(path, layer, config)
        if _kind(layer) in ("linear", "general"):
            layer.dot_general = nnx.data(dot)
            _quantize_masters(layer)
        elif _kind(layer) == "experts":
            layer.ragged_dot = nnx.data(dot)
        else:
            layer.einsum_op = nnx.data(dot)
    return model

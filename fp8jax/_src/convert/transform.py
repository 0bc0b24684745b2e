"""`fp8_linear_layers`: turn chosen Linear layers of a model into FP8 layers."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ..layers.grouped import GroupedLinear
from ..layers.linear import Linear
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot
from ..recipes import Recipe, recipe_from

T = TypeVar("T")

#: Linears left in high precision by default, matched against the last name of their path:
#: output heads, MoE routers and gates. Embeddings and norms are never Linears.
DEFAULT_EXCLUDE: str = r"(lm_)?head|unembed(ding)?|logits|classifier|router|gate"


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    r"""Which Linear layers [`fp8jax.fp8_linear_layers`][] converts, and how.

    **Arguments:**

    - `targets`: `None` (every Linear not excluded), a list of names (a Linear matches when its
      last path component, e.g. `"fc1"`, or its whole dotted path, e.g. `"blocks.0.mlp.fc1"`,
      is listed), or a regular expression that must match the whole dotted path
      (`r".*mlp.*"`).
    - `recipe`: the scaling recipe of converted layers, an instance or a name (`"delayed"`,
      `"current"`, `"blockwise"`, `"mxfp8"`, `"residual"`).
    - `recipes`: per-layer overrides, a mapping from patterns to recipes. A pattern matches a
      layer as a target name or regex does; the first matching pattern wins, layers matched by
      none get `recipe`.
    - `exclude`: a regular expression matched against the last path component; matching
      Linears stay in high precision even when targeted. Defaults to [`fp8jax.DEFAULT_EXCLUDE`][]
      (heads, routers, gates). Pass `None` to exclude nothing.
    - `telemetry`: converted layers also keep saturation and underflow statistics
      ([`fp8jax.Fp8Stats`][]), read with [`fp8jax.telemetry`][].
    - `grouped_native_kernel`: the `native_kernel` of converted expert layers
      ([`fp8jax.Fp8RaggedDot`][]): `None` (fp8jax's grouped GEMM kernels where compiled for
      Hopper, XLA's `ragged_dot` elsewhere), `True` (the kernels) or `False` (XLA's path).

    ```python
    config = fp8jax.Fp8Config(
        recipe="blockwise",
        recipes={r".*attn\.output_proj": "residual", r"blocks\.11\..*": "residual"},
    )
    ```
    """

    targets: str | Sequence[str] | None = None
    recipe: Recipe | str | None = None
    recipes: Mapping[str, Recipe | str] | None = None
    exclude: str | None = DEFAULT_EXCLUDE
    telemetry: bool = False
    grouped_native_kernel: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.telemetry, bool):
            raise ValueError(f"Fp8Config telemetry={self.telemetry!r}: should be True or False.")
        if self.grouped_native_kernel is not None and not isinstance(
            self.grouped_native_kernel, bool
        ):
            raise ValueError(
                f"Fp8Config grouped_native_kernel={self.grouped_native_kernel!r}: should be None "
                "(the kernels on Hopper), True or False."
            )
        targets = self.targets
        if isinstance(targets, str):
            _compile("targets", targets)
        elif targets is not None:
            if not isinstance(targets, Sequence) or not all(isinstance(t, str) for t in targets):
                raise ValueError(
                    f"Fp8Config targets={targets!r}: should be None, a regex string or a list "
                    "of layer names."
                )
            object.__setattr__(self, "targets", tuple(targets))
            if not self.targets:
                raise ValueError(
                    f"Fp8Config targets={targets!r} selects no layer, so fp8_linear_layers "
                    "would convert nothing: pass None to convert every Linear (bar `exclude`), "
                    "or name at least one layer."
                )
        if self.exclude is not None:
            if not isinstance(self.exclude, str):
                raise ValueError(
                    f"Fp8Config exclude={self.exclude!r}: should be a regular expression "
                    "(a str, matched against the last name of a Linear's path) or None."
                )
            _compile("exclude", self.exclude)
        object.__setattr__(self, "recipe", recipe_from(self.recipe))
        if self.recipes is not None:
            if not isinstance(self.recipes, Mapping):
                raise ValueError(
                    f"Fp8Config recipes={self.recipes!r}: should be a mapping from layer "
                    "patterns to recipes."
                )
            for pattern in self.recipes:
                if not isinstance(pattern, str):
                    raise ValueError(
                        f"Fp8Config recipes pattern {pattern!r}: should be a str, a layer name "
                        "or a regular expression."
                    )
                _compile("recipes pattern", pattern)
            resolved = tuple((p, recipe_from(r)) for p, r in self.recipes.items())
            object.__setattr__(self, "recipes", resolved)

    def recipe_for(self, path: tuple[str, ...]) -> Recipe:
        """The recipe of the layer at `path`: the first matching override, else `recipe`."""
        for pattern, recipe in self.recipes or ():
            if _matches(pattern, path):
                return recipe
        return self.recipe


def _matches(pattern: str, path: tuple[str, ...]) -> bool:
    """A name or regex `pattern` against a layer path: the last name, or the whole path."""
    return (bool(path) and path[-1] == pattern) or re.fullmatch(pattern, ".".join(path)) is not None


def _compile(name: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Fp8Config {name}={pattern!r} is not a valid regex: {e}.") from None


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


def _flax_nnx() -> Any:
    """`flax.nnx` if the user imported it (an NNX model can only exist then); flax is an
    optional extra, never imported otherwise."""
    if "flax.nnx" not in sys.modules:
        return None
    from flax import nnx

    return nnx


def _haliax_nn() -> Any:
    """`haliax.nn` if the user imported haliax (its modules can only be in the tree then)."""
    if "haliax" not in sys.modules:
        return None
    import haliax.nn as hnn

    return hnn


def _kind(node: Any, hnn: Any) -> str | None:
    if isinstance(node, eqx.nn.Linear | Linear):
        return "linear"
    if isinstance(node, GroupedLinear):
        return "grouped"
    if hnn is not None:
        if isinstance(node, hnn.Linear):
            return "linear"
        if isinstance(node, hnn.Stacked):
            return "stacked"
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
    if _kind(node, hnn) in ("linear", "grouped") or isinstance(node, jax.Array):
        return
    for key, child in _children(node):
        yield from _walk(child, path + (_key_name(key),), hnn)


def _is_fp8(linear: Any) -> bool:
    return (
        isinstance(linear, Linear)
        or isinstance(getattr(linear, "dot_general", None), Fp8DotGeneral)
        or isinstance(getattr(linear, "ragged_dot", None), Fp8RaggedDot)
    )


def _kernel_shape(linear: Any) -> tuple[int, int]:
    """The Linear's weight as the canonical `(N, K)` matrix (contracted axes last)."""
    if isinstance(linear, eqx.nn.Linear | Linear):
        return tuple(linear.weight.shape)

    def size(spec: Any) -> int:
        axes = spec if isinstance(spec, tuple | list) else (spec,)
        return math.prod(a.size for a in axes)

    return (size(linear.Out), size(linear.In))


def _stacked_dot_general(
    recipe: Recipe,
    batch_shape: tuple[int, ...],
    kernel_shape: tuple[int, int],
    name: str,
    telemetry: bool,
) -> Fp8DotGeneral:
    """A fresh `Fp8DotGeneral` with state for each layer of a (nested) `Stacked`."""
    dot = Fp8DotGeneral(recipe, kernel_shape, name, telemetry)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, batch_shape + x.shape), dot)


def _stacked_eqx_linear(linear: eqx.nn.Linear, config: Fp8Config, path: tuple[str, ...]) -> Linear:
    """`Linear.from_eqx(linear)`, also for a stack of Linears (the Equinox pattern for scanned
    layers: built under `eqx.filter_vmap`, weights `(*layers, out, in)`), with FP8 state
    stacked the same way (one state per layer)."""
    lead = linear.weight.shape[:-2]
    kernel_shape = tuple(linear.weight.shape[-2:])
    dot = _stacked_dot_general(
        config.recipe_for(path), lead, kernel_shape, ".".join(path), config.telemetry
    )
    if not lead:
        return Linear.from_eqx(linear, dot)

    def first(x: Any) -> Any:  # one layer's array (or its shape, for an abstract model)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[len(lead) :], x.dtype)
        return x[(0,) * len(lead)]

    one = Linear.from_eqx(
        eqx.tree_at(
            lambda m: (m.weight, m.bias),
            linear,
            (first(linear.weight), None if linear.bias is None else first(linear.bias)),
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


def fp8_linear_layers(tree: T, config: Fp8Config | None = None) -> T:
    """Convert the Linear layers of `tree` selected by `config` into FP8 layers.

    - `eqx.nn.Linear` (including those inside `eqx.nn.MLP` and `eqx.nn.MultiheadAttention`)
      becomes a [`fp8jax.Linear`][] with the same weight and bias.
    - `haliax.nn.Linear` gets a [`fp8jax.Fp8DotGeneral`][] as its `dot_general`; inside a
      `haliax.nn.Stacked`, the FP8 state is stacked along the layer axis (one per layer).
    - Stacked `eqx.nn.Linear`s (weights `(*layers, out, in)`, built with `eqx.filter_vmap` to
      be applied in a `lax.scan`) get FP8 state stacked the same way.
    - The experts of a mixture of experts, [`fp8jax.GroupedLinear`][], get an
      [`fp8jax.Fp8RaggedDot`][] (per-expert kernel state) as their `ragged_dot`; they are
      targeted, excluded and given recipes by name like Linears. Routers and gates are
      Linears, excluded by default. Their recipe must be one with a grouped GEMM (delayed,
      current, blockwise, MXFP8); `telemetry` is not kept for them.
    - In a Flax NNX model (an `nnx.Module`, with the `nnx` extra), `nnx.Linear` gets a
      [`fp8jax.Fp8NnxDotGeneral`][] as its `dot_general` and `nnx.Einsum` an
      [`fp8jax.Fp8NnxEinsum`][] as its `einsum_op`, their state in [`fp8jax.Fp8State`][]
      variables (stacked for an `nnx.vmap`-built stack). The result is a converted copy that
      shares the weights' arrays; `tree` is left as it was. See the Flax NNX guide.
    - Layers already in FP8 are left as they are, so applying this twice does not wrap twice.

    **Arguments:**

    - `tree`: a model (any pytree).
    - `config`: an [`fp8jax.Fp8Config`][]; the default converts every Linear except those
      matching `DEFAULT_EXCLUDE` (heads, routers, gates) with delayed scaling.

    **Returns:** the model with FP8 layers.

    **Raises:** `ValueError` if a target matches no Linear (the message lists the Linears that
    exist) or names something that is not a Linear.

    ```python
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r".*mlp.*"))
    ```
    """
    config = Fp8Config() if config is None else config
    if not isinstance(config, Fp8Config):
        raise TypeError(f"config={config!r}: should be an fp8jax.Fp8Config or None.")
    nnx = _flax_nnx()
    if nnx is not None and isinstance(tree, nnx.Module):
        from .nnx import fp8_nnx_linear_layers

        return fp8_nnx_linear_layers(tree, config)
    hnn = _haliax_nn()
    nodes = list(_walk(tree, (), hnn))
    linears = [(p, n) for p, n in nodes if _kind(n, hnn) in ("linear", "grouped")]
    chosen = choose_layers(config, nodes, linears, lambda n: isinstance(n, eqx.Module))

    def convert(path: tuple[str, ...], node: Any, batch_shape: tuple[int, ...]) -> Any:
        kind = _kind(node, hnn)
        if kind == "linear":
            if path not in chosen or _is_fp8(node):
                return node
            if isinstance(node, eqx.nn.Linear):
                return _stacked_eqx_linear(node, config, path)
            dot = _stacked_dot_general(
                config.recipe_for(path),
                batch_shape,
                _kernel_shape(node),
                ".".join(path),
                config.telemetry,
            )
            return dataclasses.replace(node, dot_general=dot)
        if kind == "grouped":
            return node if path not in chosen or _is_fp8(node) else _fp8_grouped(node, config, path)
        if kind == "stacked":
            inner = convert(path + ("stacked",), node.stacked, batch_shape + (node.Block.size,))
            return dataclasses.replace(node, stacked=inner)
        if isinstance(node, jax.Array):
            return node
        children = _children(node)
        if not children:
            return node
        new = [convert(path + (_key_name(k),), c, batch_shape) for k, c in children]
        if all(n is c for n, (_, c) in zip(new, children, strict=True)):
            return node  # nothing converted below: keep the very same object
        treedef = jax.tree_util.tree_structure(node, is_leaf=lambda x: x is not node)
        return jax.tree_util.tree_unflatten(treedef, new)

    return convert((), tree, ())


def choose_layers(
    config: Fp8Config,
    nodes: list[tuple[tuple[str, ...], Any]],
    linears: list[tuple[tuple[str, ...], Any]],
    is_module: Callable[[Any], bool],
) -> set[tuple[str, ...]]:
    """The paths of the Linears that `config` converts, after checking that every target and
    per-layer recipe pattern selects something.

    Shared by every framework's conversion. `nodes` are all the nodes of the model with their
    paths (for the messages naming what a target matched instead), `linears` the convertible
    layers among them, and `is_module` tells a module of the framework from other nodes.
    """
    exclude = None if config.exclude is None else re.compile(config.exclude)

    def targeted(path: tuple[str, ...]) -> bool:
        dotted = ".".join(path)
        if config.targets is None:
            return True
        if isinstance(config.targets, str):
            return re.fullmatch(config.targets, dotted) is not None
        return dotted in config.targets or (bool(path) and path[-1] in config.targets)

    def excluded(path: tuple[str, ...]) -> bool:
        return exclude is not None and bool(path) and exclude.fullmatch(path[-1]) is not None

    _check_targets(config, nodes, linears, targeted, excluded, is_module)
    chosen = {p for p, _ in linears if targeted(p) and not excluded(p)}
    for pattern, _ in config.recipes or ():
        if not any(_matches(pattern, p) for p in chosen):
            listing = ", ".join(repr(".".join(p)) for p in sorted(chosen)) or "none"
            raise ValueError(
                f"Fp8Config recipes pattern {pattern!r} matches no converted layer. "
                f"Converted layers: {listing}."
            )
    return chosen


def _check_targets(config: Fp8Config, nodes, linears, targeted, excluded, is_module) -> None:
    linear_paths = [".".join(p) for p, _ in linears]
    listing = ", ".join(repr(p) for p in linear_paths) or "none"
    if not linears:
        raise ValueError(
            "fp8_linear_layers found no Linear layer in the tree. It converts eqx.nn.Linear, "
            "haliax.nn.Linear, fp8jax.GroupedLinear (experts) and, in an nnx.Module, "
            "flax.nnx.Linear and flax.nnx.Einsum."
        )
    if config.targets is None:
        return
    if isinstance(config.targets, str):
        hits = [p for p, _ in linears if targeted(p)]
        if not hits:
            others = [
                f"'{'.'.join(p)}' ({type(n).__name__})"
                for p, n in nodes
                if p and re.fullmatch(config.targets, ".".join(p)) and is_module(n)
            ]
            if others:
                raise ValueError(
                    f"Fp8Config targets={config.targets!r} matches only modules that are not "
                    f"Linear: {', '.join(others)}. Linear layers: {listing}."
                )
            raise ValueError(
                f"Fp8Config targets={config.targets!r} matches no Linear layer (the regex must "
                f"match the whole dotted path). Linear layers: {listing}."
            )
        _check_excluded(config, [p for p in hits if excluded(p)], hits)
        return
    for name in config.targets:
        hits = [p for p, _ in linears if ".".join(p) == name or (p and p[-1] == name)]
        if hits:
            _check_excluded(config, [p for p in hits if excluded(p)], hits)
            continue
        others = [(p, n) for p, n in nodes if p and (".".join(p) == name or p[-1] == name)]
        if others:
            p, n = others[0]
            raise ValueError(
                f"Fp8Config target {name!r} names '{'.'.join(p)}', a {type(n).__name__}, not a "
                f"Linear layer. Linear layers: {listing}."
            )
        raise ValueError(
            f"Fp8Config target {name!r} matches no Linear layer. Linear layers: {listing}."
        )


def _check_excluded(config: Fp8Config, blocked: list, hits: list) -> None:
    if blocked and len(blocked) == len(hits):
        names = ", ".join(repr(".".join(p)) for p in blocked)
        raise ValueError(
            f"Fp8Config targets={config.targets!r} selects only {names}, which "
            f"exclude={config.exclude!r} keeps in high precision. Pass exclude=None (or a "
            "narrower pattern) to convert them."
        )

"""The framework-neutral core of model conversion: which layers to convert and how
(`Fp8Config`, `choose_layers`; the roles that keep a head or a router in high precision are
found in `roles.py`), and the FP8 state of a (stacked) layer. Every framework's
adapter builds on it; it knows no framework."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, final

import jax
import jax.numpy as jnp
import numpy as np

from ..ops.dot_general import Fp8DotGeneral
from ..recipes import Recipe, recipe_from

DEFAULT_EXCLUDE: str = r"(lm_)?head|unembed(ding)?|logits|classifier|router"
"""Linears left in high precision by default by their name, matched against the last name of
their path: names that only heads and routers bear (`head`, `lm_head`, `unembed`,
`unembedding`, `logits`, `classifier`, `router`). Ambiguous names (`gate`: a SwiGLU gate in
Llama, the router in Mixtral; `output`; Linen's `Dense_N`) are left to the roles
(`Fp8Config.keep`). Embeddings and norms are never Linears."""
#: The roles a Linear can be kept in high precision for (see `fp8jax.Fp8Config`'s `keep`).
ROLES: tuple[str, ...] = ("head", "router")


@final
@dataclasses.dataclass(frozen=True)
class Fp8Config:
    r"""Which Linear layers [`fp8jax.fp8_linear_layers`][] converts, and how.

    **Arguments:**

    - `targets`: `None` (every Linear not excluded), a list or set of names (a Linear matches
      when its last path component, e.g. `"fc1"`, or its whole dotted path, e.g.
      `"blocks.0.mlp.fc1"`, is listed; held as a sorted tuple), or a regular expression that
      must match the whole dotted path (`r".*mlp.*"`). A bare Linear's path is `"(root)"`, as
      plans print it, in targets, `exclude` and `recipes` (also as one alternative of a regex,
      `"(root)|head"`, its parentheses read literally). Paths join names with ".", so a dict
      key holding a "." (`"a.b"`) prints, and is selected, as the nesting `{"a": {"b": ...}}`
      is.
    - `recipe`: the scaling recipe of converted layers, an instance or a name (`"delayed"`,
      `"current"`, `"blockwise"`, `"mxfp8"`, `"residual"`).
    - `recipes`: per-layer overrides, a mapping from patterns to recipes. A pattern matches a
      layer as a target name or regex does; the first matching pattern wins, layers matched by
      none get `recipe`. A pattern that matches no converted layer (none at all, or only
      layers that stay in high precision) raises, naming those layers and why they stay.
    - `exclude`: a regular expression that must match a Linear's last path component
      (`"head"`) or its whole dotted path (`r"blocks\.11\..*"`); matching Linears stay in
      high precision even when targeted. Defaults to [`fp8jax.DEFAULT_EXCLUDE`][] (names only
      heads and routers bear); a pattern of yours replaces it (add it with `"|"` to keep
      both). Pass `None` to exclude nothing by name. One that matches no layer warns.
    - `keep`: the roles whose Linears stay in high precision, whatever their name:
      `"head"` (the output head: its output is the model's output, or its width is the
      vocabulary) and `"router"` (a mixture of experts' router: its output feeds the top-k
      expert choice, or its width is the expert count and it is a Linear of the module holding
      the experts or one above it, not a head), a tuple or set. Default both; `()`
      converts heads and routers too. A Linear named in a list of `targets` is converted
      whatever its role. How roles are found: the Conversion guide ("Which layers become
      FP8").
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

    targets: str | Sequence[str] | Set[str] | None = None
    recipe: Recipe | str | None = None
    recipes: Mapping[str, Recipe | str] | None = None
    exclude: str | None = DEFAULT_EXCLUDE
    keep: Sequence[str] | Set[str] = ROLES
    telemetry: bool = False
    grouped_native_kernel: bool | None = None

    def __post_init__(self) -> None:
        for name in ("telemetry", "grouped_native_kernel"):  # a NumPy bool is the bool it holds
            if isinstance(getattr(self, name), np.bool_):
                object.__setattr__(self, name, bool(getattr(self, name)))
        if not isinstance(self.telemetry, bool):
            raise ValueError(f"Fp8Config telemetry={self.telemetry!r}: should be True or False.")
        if self.grouped_native_kernel is not None and not isinstance(
            self.grouped_native_kernel, bool
        ):
            raise ValueError(
                f"Fp8Config grouped_native_kernel={self.grouped_native_kernel!r}: should be None "
                "(the kernels on Hopper), True or False."
            )
        keep = self.keep
        if (
            isinstance(keep, str)
            or not isinstance(keep, Sequence | Set)
            or not all(isinstance(k, str) for k in keep)
            or set(keep) - set(ROLES)
        ):
            raise ValueError(
                f"Fp8Config keep={keep!r}: should be a tuple of roles among {ROLES!r} "
                "(or a set; () keeps no layer for its role)."
            )
        # A set of roles, held in `ROLES`' order: equal, hashed and printed alike however given.
        object.__setattr__(self, "keep", tuple(r for r in ROLES if r in keep))
        targets = self.targets
        if isinstance(targets, str):
            _compile("targets", targets)
        elif targets is not None:
            if not isinstance(targets, Sequence | Set) or not all(
                isinstance(t, str) for t in targets
            ):
                raise ValueError(
                    f"Fp8Config targets={targets!r}: should be None, a regex string or a list "
                    "of layer names (or a set)."
                )
            # A set of names, held sorted: equal, hashed and printed alike however given.
            object.__setattr__(self, "targets", tuple(sorted(set(targets))))
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
                    "(a str, matched against a Linear's last name or its whole dotted path; "
                    "join names with '|') or None."
                )
            _compile("exclude", self.exclude)
        object.__setattr__(self, "recipe", recipe_from(self.recipe))
        if self.recipes is not None:
            recipes = self.recipes
            if _is_pairs(recipes):  # as the config holds them (`dataclasses.replace`)
                recipes = dict(recipes)
            if not isinstance(recipes, Mapping):
                raise ValueError(
                    f"Fp8Config recipes={self.recipes!r}: should be a mapping from layer "
                    "patterns to recipes."
                )
            for pattern, recipe in recipes.items():
                if not isinstance(pattern, str):
                    raise ValueError(
                        f"Fp8Config recipes pattern {pattern!r}: should be a str, a layer name "
                        "or a regular expression."
                    )
                _compile("recipes pattern", pattern)
                if recipe is None:
                    raise ValueError(
                        f"Fp8Config recipes pattern {pattern!r}: recipe None; give a recipe or "
                        "its name (to keep the layers in high precision, leave them out of "
                        "`targets` or match them with `exclude`)."
                    )
            resolved = tuple((p, _recipe_of(p, r)) for p, r in recipes.items())
            # No override is `None`'s config: equal, hashed and printed alike.
            object.__setattr__(self, "recipes", resolved or None)

    def selects(self, path: tuple[str, ...]) -> bool:
        """Whether the Linear at `path` (its names, outermost first) is converted: targeted
        and not excluded."""
        return self.targets_path(path) and not self.excludes(path)

    def targets_path(self, path: tuple[str, ...]) -> bool:
        """Whether `targets` names the Linear at `path` (before `exclude`)."""
        if self.targets is None:
            return True
        if isinstance(self.targets, str):
            return _fullmatch(self.targets, path)
        return self.names(path)

    def names(self, path: tuple[str, ...]) -> bool:
        """Whether a list of `targets` names the Linear at `path` explicitly (its last name or
        its whole path), which converts it whatever its role."""
        if self.targets is None or isinstance(self.targets, str):
            return False
        return any(_matches_name(name, path) for name in self.targets)

    def excludes(self, path: tuple[str, ...]) -> bool:
        """Whether `exclude` keeps the Linear at `path` in high precision."""
        if self.exclude is None:
            return False
        last = bool(path) and re.fullmatch(self.exclude, path[-1]) is not None
        return last or _fullmatch(self.exclude, path)

    def recipe_for(self, path: tuple[str, ...]) -> Recipe:
        """The recipe of the layer at `path`: the first matching override, else `recipe`."""
        for pattern, recipe in self.recipes or ():
            if _matches(pattern, path):
                return recipe
        return self.recipe


def _is_pairs(x: Any) -> bool:
    """Whether `x` is a tuple of `(pattern, recipe)` pairs, the form a config holds."""
    return isinstance(x, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in x
    )


#: The name of the model's root as a layer (a bare Linear), as plans print its path.
ROOT = "(root)"


def dotted(path: tuple[str, ...]) -> str:
    """A layer's path as plans print it: its names joined by ".", the root's `ROOT`."""
    return ".".join(path) or ROOT


def _fullmatch(pattern: str, path: tuple[str, ...]) -> bool:
    """Whether the regex `pattern` matches the whole dotted path of the layer at `path`; the
    root's is `ROOT`, which a pattern names as it is printed, also as one alternative
    (`"(root)|head"`, its parentheses read literally)."""
    if path:
        return re.fullmatch(pattern, ".".join(path)) is not None
    if pattern == ROOT or re.fullmatch(pattern, ROOT) is not None:
        return True
    try:
        return re.fullmatch(pattern.replace(ROOT, re.escape(ROOT)), ROOT) is not None
    except re.error:
        return False


def _matches_name(name: str, path: tuple[str, ...]) -> bool:
    """Whether a list's target `name` names the layer at `path`: its last name, its whole
    path, or the root's."""
    return dotted(path) == name or (bool(path) and path[-1] == name)


def _matches(pattern: str, path: tuple[str, ...]) -> bool:
    """A name or regex `pattern` against a layer path: the last name, or the whole path."""
    return (bool(path) and path[-1] == pattern) or _fullmatch(pattern, path)


def _recipe_of(pattern: str, recipe: Recipe | str) -> Recipe:
    """`recipe_from(recipe)`, its error naming the `recipes` pattern it was given for."""
    try:
        return recipe_from(recipe)
    except ValueError as e:
        raise ValueError(f"Fp8Config recipes pattern {pattern!r}: {e}") from None


def _compile(name: str, pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Fp8Config {name}={pattern!r} is not a valid regex: {e}.") from None


def choose_layers(
    config: Fp8Config,
    nodes: list[tuple[tuple[str, ...], Any]],
    linears: list[tuple[tuple[str, ...], Any]],
    is_module: Callable[[Any], bool],
    roles: Mapping[tuple[str, ...], str] | None = None,
    kept: Mapping[tuple[str, ...], str] | None = None,
    stacks: Mapping[tuple[str, ...], int] | None = None,
) -> dict[tuple[str, ...], str]:
    """Each Linear's fate under `config`: `"fp8"` or why it stays in high precision, after
    checking that every target and per-layer recipe pattern selects something.

    Shared by every framework's conversion. `nodes` are all the nodes of the model with their
    paths (for the messages naming what a target matched instead), `linears` the convertible
    layers among them, `is_module` tells a module of the framework from other nodes,
    `roles` gives the layers with a role (`"head: ..."`, `"router: ..."`, see
    `convert/roles.py`) and `kept` the layers that stay in high precision whatever the
    config, each with why (a tied weight, a complex one, ...); `stacks` the paths of the
    Haliax `Stacked`s with their layer counts (for `stack_hint`).
    """
    stacks = stacks or {}
    _check_targets(config, nodes, linears, is_module, stacks)
    roles = roles or {}
    fates = {}
    for path, _ in linears:
        role = roles.get(path)
        if not config.targets_path(path):
            fates[path] = f"not targeted (targets={config.targets!r})"
        elif role is not None and role.split(":")[0] in config.keep and not config.names(path):
            fates[path] = role
        elif config.excludes(path):
            fates[path] = f"excluded by name (exclude={config.exclude!r})"
        else:
            fates[path] = (kept or {}).get(path, "fp8")
    chosen = {p for p, fate in fates.items() if fate == "fp8"}
    for pattern, _ in config.recipes or ():
        if not any(_matches(pattern, p) for p in chosen):
            listing = ", ".join(repr(dotted(p)) for p in sorted(chosen)) or "none"
            matched = [f"{dotted(p)!r} ({fates[p]})" for p in sorted(fates) if _matches(pattern, p)]
            stay = "stays" if len(matched) == 1 else "stay"
            only = f": only {', '.join(matched)}, which {stay} in high precision" if matched else ""
            raise ValueError(
                f"Fp8Config recipes pattern {pattern!r} matches no converted layer{only}. "
                f"Converted layers: {listing}." + stack_hint(pattern, linears, stacks)
            )
    return fates


def _check_targets(config: Fp8Config, nodes, linears, is_module, stacks) -> None:
    targeted, excluded = config.targets_path, config.excludes
    listing = ", ".join(repr(dotted(p)) for p, _ in linears) or "none"
    if not linears:
        raise ValueError(
            "fp8_linear_layers found no Linear layer in the tree. It converts eqx.nn.Linear, "
            "haliax.nn.Linear, haliax.nn.MoELinear, fp8jax.GroupedLinear (experts) and, in an "
            "nnx.Module, flax.nnx.Linear, LinearGeneral, Einsum and modules multiplying by a "
            "`kernel` Param of their own (Flax Linen models: fp8jax.Fp8Linen). A model "
            "computing `x @ w` on its own arrays: fp8jax.fp8_autocast."
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
                + stack_hint(config.targets, linears, stacks)
            )
        _check_excluded(config, [p for p in hits if excluded(p)], hits)
        return
    for name in config.targets:
        hits = [p for p, _ in linears if _matches_name(name, p)]
        if hits:
            _check_excluded(config, [p for p in hits if excluded(p)], hits, name)
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
            + stack_hint(name, linears, stacks)
        )


def stack_hint(pattern: str, linears: list, stacks: Mapping[tuple[str, ...], int]) -> str:
    """Why `pattern` selects no layer where it names one layer of a Haliax `Stacked` by its
    index (`blocks.0.up`): the stack's layers are one layer (`blocks.stacked.up`). `stacks`:
    the Stacked modules' paths (found by type, not by the field name `stacked`) and layer
    counts. Only on the error's path: its many matches cost nothing."""
    for path, _ in linears:
        inside = [(len(s), n) for s, n in stacks.items() if path[: len(s) + 1] == (*s, "stacked")]
        indices = (
            (*path[:at], str(i), *path[at + 1 :]) for at, count in inside for i in range(count)
        )
        if any(_matches(pattern, indexed) for indexed in indices):
            whole = ".".join(path)
            return (
                f" {pattern!r} names layers of a haliax Stacked by index, but a Stacked's "
                f"layers are one layer, {whole!r} (one FP8 state per layer), which a config "
                f"selects whole: use {whole!r}, or build the layers you would choose among "
                "as separate modules."
            )
    return ""


def _check_excluded(config: Fp8Config, blocked: list, hits: list, name: str = "") -> None:
    """Refuse a target (the regex, or one `name` of a list) whose every layer `exclude`
    keeps in high precision."""
    if blocked and len(blocked) == len(hits):
        names = ", ".join(repr(".".join(p)) for p in blocked)
        what = f"target {name!r}" if name else f"targets={config.targets!r}"
        raise ValueError(
            f"Fp8Config {what} selects only {names}, which exclude={config.exclude!r} keeps "
            "in high precision. Pass exclude=None (or a narrower pattern) to convert them."
        )


def stacked_dot_general(
    recipe: Recipe,
    batch_shape: tuple[int, ...],
    kernel_shape: tuple[int, int],
    name: str,
    telemetry: bool,
) -> Fp8DotGeneral:
    """A fresh `Fp8DotGeneral` with one state per layer of a stack of `batch_shape` layers
    (a Haliax `Stacked`, an `eqx.filter_vmap` or `nnx.vmap` stack); `()` for one layer."""
    dot = Fp8DotGeneral(recipe, kernel_shape, name, telemetry)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, batch_shape + x.shape), dot)

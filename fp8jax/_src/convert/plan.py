"""What a conversion did and why: [`fp8jax.ConversionPlan`][], and the warnings that keep a
conversion from being silent (nothing converted; GEMMs in modules fp8jax cannot convert)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, final

from ..gemm import grouped_rules
from .config import DEFAULT_EXCLUDE, ROLES, Fp8Config, choose_layers, dotted, stack_hint
from .roles import Dataflow, ModelShapes, role_of


class Fp8ConversionWarning(UserWarning):
    """A conversion left GEMMs in high precision that the user may have wanted in FP8."""


@final
@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer of a [`fp8jax.ConversionPlan`][]: its dotted `path` (a bare layer's:
    `(root)`), its `kind` (the class it is), whether it runs in FP8 (`fp8`) and `why`: the
    recipe, or why it stays in high precision (its role, its name, not targeted, ...)."""

    path: str
    kind: str
    fp8: bool
    why: str


@final
@dataclasses.dataclass(frozen=True)
class ConversionPlan:
    """Which layers [`fp8jax.fp8_linear_layers`][] converts and why the others stay in high
    precision. Printed by `fp8_linear_layers(..., explain=True)` (a Linen model: at
    `init`), returned by [`fp8jax.conversion_plan`][], listed by [`fp8jax.report`][]'s
    `plan`.

    - `layers`: a [`fp8jax.LayerChoice`][] per convertible layer, in path order.
    - `unconverted`: modules whose own weights enter a GEMM that fp8jax cannot convert
      (found from a trace of the model's call; without one, NNX modules holding a stack of
      kernels, which no conversion converts), each with what to do.
    - `traced`: whether roles were found from a trace of the model's call (else from shapes
      and names only).
    - `kept_as_converted`: layers in FP8 already that the config would convert otherwise
      (another recipe or telemetry, or high precision), each with both: they keep their
      recipe and state, as a conversion leaves FP8 layers as they are.
    - `unmatched`: what the config asks that changed no layer: an `exclude` of the user's
      that matches no layer.
    """

    layers: tuple[LayerChoice, ...]
    unconverted: tuple[str, ...] = ()
    traced: bool = False
    kept_as_converted: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()

    @property
    def converted(self) -> tuple[str, ...]:
        """The paths of the layers that run in FP8 (as printed: a bare layer's is `(root)`)."""
        return tuple(c.path for c in self.layers if c.fp8)

    @property
    def kept(self) -> dict[str, str]:
        """The layers that stay in high precision, each with why."""
        return {c.path: c.why for c in self.layers if not c.fp8}

    def __str__(self) -> str:
        width = max([len(c.path) for c in self.layers] + [5])
        kind = max([len(c.kind) for c in self.layers] + [4])
        how = "from a trace of the model's call" if self.traced else "from shapes and names"
        lines = [
            f"fp8jax conversion: {len(self.converted)} of {len(self.layers)} layers in FP8 "
            f"(roles {how})",
            f"{'layer':<{width}}  {'kind':<{kind}}  precision",
        ]
        for c in self.layers:
            what = f"FP8 ({c.why})" if c.fp8 else f"high: {c.why}"
            lines.append(f"{c.path:<{width}}  {c.kind:<{kind}}  {what}")
        lines += [f"not convertible: {u}" for u in self.unconverted]
        lines += [f"FP8 already, kept as it is: {k}" for k in self.kept_as_converted]
        lines += [f"matches nothing: {u}" for u in self.unmatched]
        return "\n".join(lines)


#: A layer in FP8 already: its recipe, and whether it records telemetry.
Converted = tuple[Any, bool]


def differing_fields(a: Any, b: Any) -> list[str]:
    """The fields in which two dataclasses of one class (recipes, configs) differ."""
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def _show(recipe: Any, other: Any) -> str:
    """`recipe`'s class, with the fields where it differs from `other` of the same class."""
    name = type(recipe).__name__
    if type(other) is not type(recipe) or not dataclasses.is_dataclass(recipe):
        return name
    diff = [f"{k}={getattr(recipe, k)!r}" for k in differing_fields(recipe, other)]
    return f"{name}({', '.join(diff)})" if diff else name


def _differs(config: Fp8Config, path: tuple[str, ...], fate: str, has: Converted) -> str | None:
    """How `config` would convert the FP8 layer at `path` otherwise, or None."""
    recipe, telemetry = has
    wanted = config.recipe_for(path) if fate == "fp8" else None
    name = f"{dotted(path)} ({_show(recipe, wanted)}"
    if wanted is None:
        return f"{name}; the config: high precision, {fate})"
    if wanted != recipe:
        return f"{name}; the config: {_show(wanted, recipe)})"
    if telemetry != config.telemetry:
        return f"{name}, telemetry={telemetry}; the config: telemetry={config.telemetry})"
    return None


def make_plan(
    config: Fp8Config,
    fates: Mapping[tuple[str, ...], str],
    kinds: Mapping[tuple[str, ...], str],
    unconverted: Iterable[str] = (),
    traced: bool = False,
    converted: Mapping[tuple[str, ...], Converted] | None = None,
    stacks: Mapping[tuple[str, ...], int] | None = None,
) -> ConversionPlan:
    """The plan of `fates` (from `choose_layers`), each layer's recipe named; the layers in
    `converted` (FP8 already) with the recipe they have; `stacks` as `choose_layers`'."""
    converted = converted or {}
    layers, kept = [], []
    for path in sorted(fates):
        fp8 = fates[path] == "fp8" or path in converted
        if path in converted:
            why = type(converted[path][0]).__name__
            differs = _differs(config, path, fates[path], converted[path])
            kept += [differs] if differs else []
        else:
            why = type(config.recipe_for(path)).__name__ if fp8 else fates[path]
        layers.append(LayerChoice(dotted(path), kinds[path], fp8, why))
    unmatched = []
    if config.exclude not in (None, DEFAULT_EXCLUDE) and not any(map(config.excludes, fates)):
        hint = stack_hint(config.exclude, [(p, None) for p in fates], stacks or {}).rstrip(".")
        unmatched.append(
            f"exclude={config.exclude!r} (it must match a layer's last name or its whole "
            "dotted path) keeps no layer in high precision; it replaces DEFAULT_EXCLUDE"
            + (f";{hint}" if hint else "")
        )
    return ConversionPlan(tuple(layers), tuple(unconverted), traced, tuple(kept), tuple(unmatched))


def decide(
    config: Fp8Config,
    nodes: list[tuple[tuple[str, ...], Any]],
    layers: list[tuple[tuple[str, ...], Any]],
    is_module: Callable[[Any], bool],
    *,
    widths: Mapping[tuple[str, ...], tuple[int | None, bool]],
    shapes: ModelShapes,
    flow: Dataflow | None,
    kinds: Mapping[tuple[str, ...], str],
    advice: Callable[[tuple[str, ...]], str],
    converted: Mapping[tuple[str, ...], Converted] | None = None,
    kept: Mapping[tuple[str, ...], str] | None = None,
    stacks: Mapping[tuple[str, ...], int] | None = None,
) -> tuple[ConversionPlan, set[tuple[str, ...]]]:
    """Every adapter's decision, in one place: each layer's role (`widths` gives a Linear's
    output width and whether it is a stack of layers; layers absent from it, experts, have
    no role), its fate under `config`, and the modules whose GEMMs the trace `flow` found
    outside every layer, embedding, head and router (`advice(path)` says what to do with
    one). `converted`: the layers in FP8 already, which stay as they are; `kept`: the layers
    that stay in high precision whatever the config, each with why (one the config does not
    decide: a tied weight, a complex one); `stacks`: the Haliax `Stacked`s' paths and layer
    counts. Returns the plan and the paths of the layers to
    convert."""
    roles = {}
    for path, _ in layers:
        if path in widths:
            role = role_of(path, widths[path][0], shapes, flow, widths[path][1])
            if role is not None:
                roles[path] = role
    kept = {p: why for p, why in (kept or {}).items() if p not in (converted or {})}
    fates = choose_layers(config, nodes, layers, is_module, roles, kept, stacks)
    for path, fate in fates.items():
        if fate == "fp8" and path not in widths and path not in (converted or {}):
            # An expert layer: refused now, as its conversion would refuse it, not planned.
            grouped_rules.check_recipe(
                config.recipe_for(path), ".".join(path), config.grouped_native_kernel
            )
    unconverted = []
    if flow is not None:
        known = {p for p, _ in layers} | set(shapes.embeddings)
        unconverted = [
            f"{dotted(p)} ({advice(p)})"
            for p in sorted(flow.gemms)
            if p not in known and not flow.keeps(p)
        ]
    plan = make_plan(config, fates, kinds, unconverted, flow is not None, converted, stacks)
    converted = converted or {}
    return plan, {p for p, fate in fates.items() if fate == "fp8" and p not in converted}


def announce(plan: ConversionPlan, explain: bool, framework: str, stacklevel: int = 4) -> None:
    """Print `plan` when asked; warn when it converts nothing, leaves GEMMs it cannot
    convert or keeps FP8 layers the config would convert otherwise, naming them and what to
    do. `stacklevel`: the warnings' (by default, `fp8_linear_layers`' caller)."""
    if explain:
        print(plan)
    if plan.unconverted:
        warnings.warn(
            f"fp8_linear_layers: {len(plan.unconverted)} module(s) of this {framework} model "
            "run GEMMs on their own weights that fp8jax does not convert, so they stay in "
            "high precision: " + "; ".join(plan.unconverted) + ".",
            Fp8ConversionWarning,
            stacklevel=stacklevel,
        )
    if plan.kept_as_converted:
        warnings.warn(
            f"fp8_linear_layers: {len(plan.kept_as_converted)} layer(s) of this {framework} "
            "model are in FP8 already and keep their recipe and state, not this config's: "
            + "; ".join(plan.kept_as_converted)
            + ". To change them, convert the model as it was before its first conversion.",
            Fp8ConversionWarning,
            stacklevel=stacklevel,
        )
    for what in plan.unmatched:
        warnings.warn(
            f"fp8_linear_layers: Fp8Config {what}.", Fp8ConversionWarning, stacklevel=stacklevel
        )
    if not plan.converted:
        kept = "; ".join(f"{c.path}: {c.why}" for c in plan.layers)
        advice = (
            "Pass Fp8Config(keep=()) to convert heads and routers, exclude=None to ignore "
            "names, or name the layers in targets."
            if any(map(_config_kept, plan.layers))
            else "No Fp8Config converts these: each stays for what it is, as said."
        )
        warnings.warn(
            f"fp8_linear_layers converted no layer of this {framework} model, so it trains "
            f"in high precision. Its layers: {kept or 'none'}. {advice}",
            Fp8ConversionWarning,
            stacklevel=stacklevel,
        )


def _config_kept(layer: LayerChoice) -> bool:
    """Whether the config keeps `layer` in high precision (its targets, exclude or keep),
    not what the layer is (a tied or non-floating weight, a subclass, a GEMM of its own)."""
    why = layer.why
    return why.startswith(("not targeted", "excluded by name")) or why.split(":")[0] in ROLES

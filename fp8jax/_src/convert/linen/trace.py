"""The conversion plan of a Flax Linen model, made before its `init`: which layers it runs
(an abstract `init` under a recording interceptor) and its dataflow (a jaxpr of `apply` over
the abstract variables), from which roles and GEMM-bearing modules are read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn

from ..autocast import array_arguments
from ..config import Fp8Config
from ..plan import ConversionPlan, LayerChoice, decide
from ..roles import ModelShapes, dataflow, gemm_operands, owner_of
from .generic import KERNEL


def _abstract(fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`jax.eval_shape(fun, *args, **kwargs)` with only the array leaves abstract (flags
    such as `deterministic=True` stay Python values)."""
    values, fill, _ = array_arguments(args, kwargs)
    return jax.eval_shape(lambda *v: fun(*fill(v)[0], **fill(v)[1]), *values)


def _names(path: Any) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def linen_plan(
    module: nn.Module,
    config: Fp8Config,
    record: Callable[[], tuple[Any, Any]],
    rngs: Any,
    args: tuple,
    kwargs: dict,
) -> tuple[ConversionPlan, frozenset[tuple[str, ...]]]:
    """The plan of `module.init(rngs, *args, **kwargs)` and the paths it converts.

    `record()` gives `(seen, interceptor)`: a fresh record of what a run sees and the
    planning interceptor that fills it.
    """
    seen, interceptor = record()
    with nn.intercept_methods(interceptor):
        variables = _abstract(module.init, (rngs, *args), kwargs)
    # `init`'s streams, "params" kept: Linen's `make_rng` falls back to it for a stream not
    # given (`init(key, x, train=True)` gives Dropout its key), and so must the trace.
    apply_rngs = dict(rngs) if isinstance(rngs, Mapping) else {"params": rngs}
    # `init`'s own `mutable` (which collections it makes) is not the trace's: it makes all.
    apply_kwargs = {k: v for k, v in kwargs.items() if k != "mutable"}

    def call(variables: Any) -> Any:
        # The parameters alone, every collection mutable: the other collections are made
        # again as `init` made them, so the call takes `init`'s path (an attention layer
        # with `decode=True` given its cache would take a decoding step on the prompt).
        params = {k: v for k, v in variables.items() if k == "params"}
        return module.apply(params, *args, rngs=apply_rngs, mutable=True, **apply_kwargs)[0]

    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    layer_paths = sorted(seen.layers)
    kernels = sorted(p for p in seen.kernels if p not in seen.layers)
    owners = [owner_of(_names(p)[1:], layer_paths + kernels) for p, _ in flat]
    closed = jax.make_jaxpr(call)(variables)
    flow = dataflow(closed, owners)
    # Modules with a kernel of their own that a GEMM takes as its right operand (what the
    # conversion answers in FP8, `generic.py`): Linears by their role.
    right = {rhs for _, rhs in gemm_operands(closed, owners).values()}
    generic = {p: seen.kernels[p] for p in kernels if p in flow.gemms and p in right}
    layers = {**{p: seen.layers[p] for p in layer_paths}, **generic}
    widths = {p: (w, False) for p, w in seen.widths.items()}
    for path, mod in generic.items():
        features = getattr(mod, "features", None)
        widths[path] = (features if isinstance(features, int) else None, False)
    kinds = {p: f"nn.{type(m).__name__}" if p in seen.layers else type(m).__name__
             for p, m in layers.items()}  # fmt: skip
    plan, chosen = decide(
        config,
        sorted(seen.modules.items()),
        sorted(layers.items()),
        lambda n: True,
        widths=widths,
        shapes=ModelShapes(dict(seen.embeddings), {}),
        flow=flow,
        kinds=kinds,
        advice=lambda p: (
            f"{type(seen.modules.get(p)).__name__}: its {KERNEL!r} enters GEMMs only as their "
            "left operand; multiply the input by it (x @ kernel), or run the model under "
            "fp8jax.fp8_autocast"
            if p in seen.kernels
            else f"{type(seen.modules.get(p)).__name__}: its weights enter a GEMM but "
            f"it holds no {KERNEL!r} parameter; name it {KERNEL!r}, use nn.Dense, or run the "
            "model under fp8jax.fp8_autocast"
        ),
    )
    # A layer inside a chosen module with its own kernel runs in that module's traced call,
    # where only GEMMs on the module's kernel are answered in FP8 (`generic.py`): it stays in
    # high precision, said, rather than hold FP8 state its GEMM never uses.
    owners = [p for p in generic if p in chosen]

    def owner(path: tuple[str, ...]) -> tuple[str, ...] | None:
        return next((o for o in owners if len(path) > len(o) and path[: len(o)] == o), None)

    chosen = [p for p in chosen if owner(p) is None]
    inner = {".".join(p): ".".join(o) for p in layers if (o := owner(p)) is not None}
    plan = dataclasses.replace(
        plan,
        layers=tuple(
            LayerChoice(
                c.path,
                c.kind,
                False,
                f"inside {inner[c.path]}, whose own {KERNEL!r} makes its call traced: "
                f"only that kernel's GEMMs are FP8; exclude {inner[c.path]} to convert this",
            )
            if c.fp8 and c.path in inner
            else c
            for c in plan.layers
        ),
    )
    nested = tuple(
        LayerChoice(
            name,
            f"nn.{type(m).__name__}",
            False,
            "applied by a nested .apply on variables of its own (a tied head): no place "
            "for FP8 state",
        )
        for name, m in sorted(seen.nested.items())
    )
    # An `exclude` naming a nested-apply layer (kept anyway) matches a layer: no warning.
    unmatched = plan.unmatched
    if any(config.excludes(tuple(c.path.split("."))) for c in nested):
        unmatched = ()
    plan = dataclasses.replace(plan, layers=plan.layers + nested, unmatched=unmatched)
    return plan, frozenset(chosen)

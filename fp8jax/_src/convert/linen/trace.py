"""The conversion plan of a Flax Linen model, made before its `init`: which layers it runs
(an abstract `init` under a recording interceptor) and its dataflow (a jaxpr of `apply` over
the abstract variables), from which roles and GEMM-bearing modules are read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn

from ..config import Fp8Config, choose_layers
from ..plan import ConversionPlan, LayerChoice, make_plan
from ..roles import ModelShapes, dataflow, owner_of, role_of
from .generic import KERNEL


def _abstract(fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`jax.eval_shape(fun, *args, **kwargs)` with only the array leaves abstract (flags
    such as `deterministic=True` stay Python values)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def flat(*values: Any) -> Any:
        filled = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            filled[i] = value
        a, k = jax.tree.unflatten(treedef, filled)
        return fun(*a, **k)

    return jax.eval_shape(flat, *[leaves[i] for i in dynamic])


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
    apply_rngs = {k: v for k, v in rngs.items() if k != "params"} if isinstance(rngs, dict) else {}

    def call(variables: Any) -> Any:
        return module.apply(variables, *args, rngs=apply_rngs, mutable=True, **kwargs)[0]

    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    layer_paths = sorted(seen.layers)
    kernels = sorted(p for p in seen.kernels if p not in seen.layers)
    owners = [owner_of(_names(p)[1:], layer_paths + kernels) for p, _ in flat]
    flow = dataflow(jax.make_jaxpr(call)(variables), owners)

    # Modules with a kernel of their own whose kernel enters a GEMM: Linears by their role.
    generic = {p: seen.kernels[p] for p in kernels if p in flow.gemms}
    layers = {**{p: seen.layers[p] for p in layer_paths}, **generic}
    widths = dict(seen.widths)
    for path, mod in generic.items():
        features = getattr(mod, "features", None)
        widths[path] = features if isinstance(features, int) else None
    shapes = ModelShapes(dict(seen.embeddings), {})
    roles = {}
    for path in layers:
        role = role_of(path, widths.get(path), shapes, flow)
        if role is not None:
            roles[path] = role
    fates = choose_layers(
        config, sorted(seen.modules.items()), sorted(layers.items()), lambda n: True, roles
    )
    unconverted = [
        f"{'.'.join(p) or '(root)'} ({type(seen.modules.get(p)).__name__}: its weights enter "
        f"a GEMM but it holds no {KERNEL!r} parameter; name it {KERNEL!r}, use nn.Dense, or "
        "run the model under fp8jax.fp8_autocast)"
        for p in sorted(flow.gemms)
        if p not in layers and p not in seen.embeddings and not flow.keeps(p)
    ]
    kinds = {p: f"nn.{type(m).__name__}" if p in seen.layers else type(m).__name__
             for p, m in layers.items()}  # fmt: skip
    plan = make_plan(config, fates, kinds, unconverted, traced=True)
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
    plan = ConversionPlan(plan.layers + nested, plan.unconverted, plan.traced)
    return plan, frozenset(p for p, fate in fates.items() if fate == "fp8")

"""`fp8_linear_layers`: turn chosen Linear layers of a model into FP8 layers, by handing the
model to its framework's adapter (Flax NNX, else Equinox and Haliax)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from ..recipes import RECIPES, Recipe
from .config import ROOT, Fp8Config
from .equinox import equinox_plan, fp8_equinox_linear_layers
from .plan import ConversionPlan, Fp8ConversionWarning, differing_fields

T = TypeVar("T")


def _flax(api: str) -> Any:
    """`flax.nnx` or `flax.linen` if the user imported it (a model of it can only exist
    then); flax is an optional extra, never imported otherwise."""
    return sys.modules.get(f"flax.{api}")


def _fp8_linen(tree: Any) -> bool:
    """Whether `tree` is a Linen model converted already (an `fp8jax.Fp8Linen`)."""
    if _flax("linen") is None:
        return False
    from .linen.convert import Fp8Linen

    return isinstance(tree, Fp8Linen)


def _check(tree: Any, config: Any, example: Any, explain: Any) -> Fp8Config:
    config = Fp8Config() if config is None else config
    if not isinstance(config, Fp8Config):
        hint, shown = "", repr(config)
        if isinstance(config, type) and issubclass(config, Fp8Config | Recipe):
            what = f"fp8jax.Fp8Config(recipe={config.__name__}())"
            if issubclass(config, Fp8Config):
                what = "fp8jax.Fp8Config() (its fields as arguments)"
            hint, shown = f"; pass an instance, {what}", f"{config.__name__} (the class)"
        elif isinstance(config, Recipe) or (isinstance(config, str) and config in RECIPES):
            hint = f"; for that recipe, pass fp8jax.Fp8Config(recipe={config!r})"
        elif isinstance(config, str):  # a regex of layer names, as `targets` takes
            hint = f"; to convert only the layers it names, fp8jax.Fp8Config(targets={config!r})"
        elif isinstance(config, dict):  # its fields, as a config file holds them
            hint = "; for a dict of its fields, pass fp8jax.Fp8Config(**config)"
        raise TypeError(f"config={shown}: should be an fp8jax.Fp8Config or None{hint}.")
    if example is not None and not callable(example):
        raise TypeError(
            f"example={example!r}: should be None or a function that calls the model on "
            "example inputs, e.g. lambda m: jax.vmap(m)(x)."
        )
    if not isinstance(explain, bool):
        raise TypeError(f"explain={explain!r}: should be True or False.")
    if isinstance(tree, type):  # `fp8_linear_layers(MLP)`: nothing built, no layer to find
        raise TypeError(
            f"fp8_linear_layers: got the class {tree.__name__}, not a model: pass an instance, "
            f"{tree.__name__}(...)."
        )
    _check_nnx_container(tree)
    linen = _flax("linen")
    module = getattr(tree, "module", None)
    wrapper = linen is not None and isinstance(module, linen.Module) and not _fp8_linen(tree)
    if wrapper and not isinstance(tree, linen.Module):
        raise TypeError(
            f"fp8_linear_layers: {type(tree).__name__} is a wrapper around a Flax Linen model "
            "(a Hugging Face Flax model?): pass its `.module` (the nn.Module) and use its "
            "`.params` as the variables' 'params': fp8_model = "
            "fp8jax.fp8_linear_layers(model.module); variables = fp8_model.init(key, "
            "*inputs); variables['params'] = model.params."
        )
    return config


def _check_nnx_container(tree: Any) -> None:
    """Refuse what holds Flax NNX objects without being an `nnx.Module` (a dict or list of
    modules, an `nnx.State`, a `(graphdef, state)` split): the NNX path converts a module, and
    the Equinox path would find no Linear in it."""
    nnx = _flax("nnx")
    if nnx is None or isinstance(tree, nnx.Module):
        return
    kinds = (nnx.Module, nnx.Variable, nnx.GraphDef)
    held = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, kinds)
        )[0]
        if isinstance(x, kinds)
    ]
    if not held and not isinstance(tree, nnx.GraphDef):
        return
    path, first = held[0] if held else ((), tree)
    raise TypeError(
        f"fp8_linear_layers: model is a {type(tree).__name__} holding Flax NNX objects (its "
        f"{type(first).__name__} at {jax.tree_util.keystr(path) or ROOT!r}), not an "
        "nnx.Module; the NNX path converts a module: hold several in an nnx.List, an nnx.Dict "
        "or a module of yours, and convert a model before nnx.split / nnx.state (or "
        "nnx.merge it first)."
    )


def fp8_linear_layers(
    tree: T,
    config: Fp8Config | None = None,
    *,
    example: Callable[[T], Any] | None = None,
    explain: bool = False,
) -> T:
    """Convert the Linear layers of `tree` selected by `config` into FP8 layers.

    - `eqx.nn.Linear` (including those inside `eqx.nn.MLP` and `eqx.nn.MultiheadAttention`)
      becomes a [`fp8jax.Linear`][] with the same weight and bias.
    - `haliax.nn.Linear` gets a [`fp8jax.Fp8DotGeneral`][] as its `dot_general`; inside a
      `haliax.nn.Stacked`, or built under `hax.vmap` (weight axes beyond `In` and `Out`),
      the FP8 state is stacked along the layer axis (one per layer).
      One quantized by `haliax.quantization` already keeps that quantization (with a warning).
    - Stacked `eqx.nn.Linear`s (weights `(*layers, out, in)`, built with `eqx.filter_vmap` to
      be applied in a `lax.scan`) get FP8 state stacked the same way. A stack is called one
      layer at a time (under a `vmap` or `scan` over its axis); a call on the whole stack
      raises, naming that.
    - The experts of a mixture of experts, [`fp8jax.GroupedLinear`][], get an
      [`fp8jax.Fp8RaggedDot`][] (per-expert kernel state) as their `ragged_dot`; they are
      targeted, excluded and given recipes by name like Linears. Routers are Linears, kept
      in high precision by default (by their role, and by name). Their recipe must be one
      with a grouped GEMM (delayed, current, blockwise, MXFP8).
    - In a Flax NNX model (an `nnx.Module`, with the `nnx` extra), `nnx.Linear` and
      `nnx.LinearGeneral` (so `nnx.MultiHeadAttention`'s projections) get a
      [`fp8jax.Fp8NnxDotGeneral`][] as their `dot_general` and `nnx.Einsum` an
      [`fp8jax.Fp8NnxEinsum`][] as its `einsum_op`, their state in [`fp8jax.Fp8State`][]
      variables (stacked for an `nnx.vmap`-built stack). The result is a converted copy that
      shares the weights' arrays; `tree` is left as it was. See the Flax NNX guide.
    - A Flax Linen model (an `nn.Module`) becomes an [`fp8jax.Fp8Linen`][]: its `init` and
      `apply` run the model's own code with its chosen `nn.Dense`, `nn.DenseGeneral` and
      `nn.Einsum` layers as FP8 GEMMs, the FP8 state in the variable collection
      `"_overwrite_with_gradient"`. See the Flax Linen guide.
    - Layers already in FP8 (and a Linen model converted already) are left as they are,
      their recipe and state kept, so applying this twice does not wrap twice; where
      `config` would convert one otherwise, a `fp8jax.Fp8ConversionWarning` names it
      (`ConversionPlan.kept_as_converted`).

    **Arguments:**

    - `tree`: a model (any pytree).
    - `config`: an [`fp8jax.Fp8Config`][]; the default converts every Linear with delayed
      scaling but the output head and MoE routers, found by their role (`Fp8Config.keep`),
      and layers named like them (`DEFAULT_EXCLUDE`).
    - `example`: optionally a function calling the model on example inputs
      (`lambda m: jax.vmap(m)(x)`; traced, never run). With it the roles come from the
      model's dataflow: the head is the layer whose GEMM is the last before the output, a
      router the layer whose output feeds a top-k. Without it, from shapes: a layer as wide
      as the largest embedding table is a head, one as wide as an expert layer's expert
      count, in the module holding the experts or one above it, a router. A Linen model is
      always traced (at `init`).
    - `explain`: print which layers run in FP8 and why the others do not (a
      [`fp8jax.ConversionPlan`][]; a Linen model prints it at `init`).

    **Returns:** the model with FP8 layers.

    **Raises:** `ValueError` if the model holds no Linear at all (only convolutions, say: the
    message names the layers fp8jax converts), if a target matches no Linear (the message
    lists the Linears that exist) or names something that is not a Linear. Warns
    (`fp8jax.Fp8ConversionWarning`) when its Linears are all kept in high precision, when an
    `exclude` of yours matches no layer, or when
    `example`'s trace finds modules whose GEMMs fp8jax cannot convert.

    ```python
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r".*mlp.*"))
    ```
    """
    if isinstance(explain, np.bool_):  # a NumPy bool is the bool it holds, as in Fp8Config
        explain = bool(explain)
    config = _check(tree, config, example, explain)
    nnx, linen = _flax("nnx"), _flax("linen")
    if _fp8_linen(tree):  # as FP8 layers are, a converted model is left as it is
        if tree.config != config:
            warnings.warn(
                "fp8_linear_layers: this Flax Linen model is converted already "
                "(fp8jax.Fp8Linen) and keeps its config, not this one (they differ in "
                f"{', '.join(differing_fields(tree.config, config))}). To change it, convert the "
                "model it wraps, fp8_linear_layers(fp8_model.module, config), and init again.",
                Fp8ConversionWarning,
                stacklevel=2,
            )
        return tree
    if nnx is not None and isinstance(tree, nnx.Module):
        from .nnx.convert import fp8_nnx_linear_layers

        return fp8_nnx_linear_layers(tree, config, example, explain)
    if linen is not None and isinstance(tree, linen.Module):
        from .linen.convert import Fp8Linen

        if example is not None:
            raise TypeError(
                "fp8_linear_layers: example= is for Equinox, Haliax and NNX models; a Linen "
                "model is traced at init, with init's own arguments."
            )
        return Fp8Linen(tree, config, explain=explain)
    return fp8_equinox_linear_layers(tree, config, example, explain)


def conversion_plan(
    tree: Any,
    config: Fp8Config | None = None,
    *,
    example: Callable[[Any], Any] | None = None,
) -> ConversionPlan:
    """Which layers [`fp8jax.fp8_linear_layers`][] would convert and why the others would
    stay in high precision, without converting: a [`fp8jax.ConversionPlan`][] (print it for
    a table). Arguments as for `fp8_linear_layers`; an Equinox or Haliax model may be
    abstract (built under `eqx.filter_eval_shape`), with an `example` too. For a Flax Linen
    model, which is traced at `init`, call
    `fp8_linear_layers(model, config).plan(rngs, *init_args)` instead.

    ```python
    print(fp8jax.conversion_plan(model, example=lambda m: jax.vmap(m)(tokens)))
    ```
    """
    config = _check(tree, config, example, False)
    nnx, linen = _flax("nnx"), _flax("linen")
    if nnx is not None and isinstance(tree, nnx.Module):
        from .nnx.convert import nnx_plan

        return nnx_plan(tree, config, example)[0]
    if _fp8_linen(tree) or linen is not None and isinstance(tree, linen.Module):
        raise TypeError(
            "conversion_plan: a Flax Linen model is traced at init; call "
            "fp8jax.fp8_linear_layers(model, config).plan(rngs, *init_args)."
        )
    return equinox_plan(tree, config, example)[0]

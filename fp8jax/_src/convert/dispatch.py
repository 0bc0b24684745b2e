"""`fp8_linear_layers`: turn chosen Linear layers of a model into FP8 layers, by handing the
model to its framework's adapter (Flax NNX, else Equinox and Haliax)."""

from __future__ import annotations

import sys
from typing import Any, TypeVar

from .config import Fp8Config
from .equinox import fp8_equinox_linear_layers

T = TypeVar("T")


def _flax(api: str) -> Any:
    """`flax.nnx` or `flax.linen` if the user imported it (a model of it can only exist
    then); flax is an optional extra, never imported otherwise."""
    return sys.modules.get(f"flax.{api}")


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
    nnx, linen = _flax("nnx"), _flax("linen")
    if nnx is not None and isinstance(tree, nnx.Module):
        from .nnx.convert import fp8_nnx_linear_layers

        return fp8_nnx_linear_layers(tree, config)
    if linen is not None and isinstance(tree, linen.Module):
        from .linen.convert import Fp8Linen

        return Fp8Linen(tree, config)
    return fp8_equinox_linear_layers(tree, config)

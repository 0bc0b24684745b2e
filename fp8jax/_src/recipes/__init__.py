"""Scaling recipes behind one interface (see `base.py`)."""

from __future__ import annotations

from .base import ROLES, Axis, HybridFormats, QTensor, Recipe, Role, TensorState
from .blocks import BlockScaledRecipe, BlockwiseScaling
from .mxfp8 import MXFP8
from .per_tensor import CurrentScaling, DelayedScaling, PerTensorRecipe
from .per_tensor_scale import compute_scale
from .residual import QTerms, ResidualFP8, ResidualState

RECIPES: dict[str, type[Recipe]] = {
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "blockwise": BlockwiseScaling,
    "mxfp8": MXFP8,
    "residual": ResidualFP8,
}


def recipe_from(spec: Recipe | str | None) -> Recipe:
    """A recipe instance from an instance, a name (`"delayed"`, `"current"`, `"blockwise"`,
    `"mxfp8"`, `"residual"`) or `None` (delayed scaling)."""
    if spec is None:
        return DelayedScaling()
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str) and spec in RECIPES:
        return RECIPES[spec]()
    if isinstance(spec, type) and issubclass(spec, Recipe):
        raise ValueError(
            f"recipe={spec.__name__} is a recipe class; pass an instance, {spec.__name__}() "
            f"(its fields as arguments), or a name: one of {sorted(RECIPES)}."
        )
    raise ValueError(
        f"Unknown recipe {spec!r}: should be a fp8jax recipe instance or one of {sorted(RECIPES)}."
    )


__all__ = [
    "MXFP8",
    "RECIPES",
    "ROLES",
    "Axis",
    "BlockScaledRecipe",
    "BlockwiseScaling",
    "CurrentScaling",
    "DelayedScaling",
    "HybridFormats",
    "PerTensorRecipe",
    "QTensor",
    "QTerms",
    "Recipe",
    "ResidualFP8",
    "ResidualState",
    "Role",
    "TensorState",
    "compute_scale",
    "recipe_from",
]

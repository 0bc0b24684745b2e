"""Which recipes have an FP8 grouped GEMM, and which of those run on the Hopper kernels."""

from __future__ import annotations

from ..core.formats import amd_format
from ..kernels import dispatch
from ..recipes import ROLES, BlockScaledRecipe, BlockwiseScaling, PerTensorRecipe, Recipe
from ..recipes.blocks import NATIVE_BLOCK_SIZES

#: Recipes with an FP8 grouped GEMM, by name.
SUPPORTED = "DelayedScaling, CurrentScaling, BlockwiseScaling and MXFP8"


def check_recipe(recipe: Recipe, name: str = "", native_kernel: bool | None = None) -> None:
    """Raise `ValueError` unless `recipe` has an FP8 grouped GEMM here (and a native one when
    `native_kernel` is True)."""
    layer = f"FP8 grouped layer {name!r}" if name else "Fp8RaggedDot"
    if not isinstance(recipe, PerTensorRecipe | BlockScaledRecipe):
        raise ValueError(
            f"{layer}: recipe {type(recipe).__name__} has no FP8 grouped GEMM; use one of "
            f"{SUPPORTED} (with fp8_linear_layers, give the expert layers one of these in "
            "Fp8Config(recipes={...}))."
        )
    dispatch.check_native_kernel(native_kernel)
    if native_kernel and not has_native(recipe):
        raise ValueError(
            f"{layer}: native_kernel=True, but {recipe!r} has no native grouped GEMM; the "
            "kernels take DelayedScaling, CurrentScaling and BlockwiseScaling (block_size "
            f"in {list(NATIVE_BLOCK_SIZES)}, dequantized_dot=False), in E4M3 and E5M2 (not "
            "AMD's fnuz formats). Use native_kernel=None or False."
        )


def has_native(recipe: Recipe) -> bool:
    """Whether `recipe`'s grouped GEMMs can run on the Hopper kernels (whose `wgmma` takes
    no fnuz format, AMD's)."""
    if any(amd_format(recipe.format(role)) for role in ROLES):
        return False
    if isinstance(recipe, PerTensorRecipe):
        return True
    return (
        isinstance(recipe, BlockwiseScaling)
        and not recipe.dequantized_dot
        and recipe.block_size in NATIVE_BLOCK_SIZES
    )


def native_choice(recipe: Recipe, native_kernel: bool | None) -> bool | None:
    """The `dispatch.choose` option of a grouped layer's GEMMs: the layer's `native_kernel`
    where given, else the recipe's (`BlockwiseScaling.native_kernel`), else `None` (the
    kernels on Hopper); always False for recipes without them."""
    if not has_native(recipe):
        return False
    if native_kernel is None and isinstance(recipe, BlockwiseScaling):
        return recipe.native_kernel
    return native_kernel

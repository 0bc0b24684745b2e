"""The Llama block's variant names (`llama_block.py`), without JAX: the GPU check's
supervisor refuses a misspelt `--llama-variants` before its child spends seconds importing
JAX."""

from __future__ import annotations

#: The recipes' names, `llama_block.RECIPES`' keys (`llama_block` checks them at import).
RECIPE_NAMES = (
    "delayed", "current", "blockwise", "mxfp8", "residual", "delayed-cold", "delayed-steady",
    "delayed-cond", "delayed-apart", "delayed-steady-apart", "delayed-steady-apart-acts",
    "delayed-steady-fused", "delayed-steady-words", "delayed-steady-apart-words",
    "delayed-steady-kernel", "delayed-steady-kernel-acts", "delayed-steady-kernel-grads",
    "delayed-steady-apart-kernel-grads", "current-apart", "current-apart-grads",
    "current-kernel", "current-kernel-grads", "delayed-steady-tc", "delayed-steady-tc-grads",
    "delayed-steady-apart-tc-grads", "current-tc", "blockwise-tiled", "blockwise-pairs",
    "blockwise-tile-scales", "blockwise-tile-scales-three", "blockwise-chained",
    "blockwise-slabs", "blockwise-tc", "delayed-steady-masters",
    "delayed-steady-kernel-masters", "current-kernel-masters", "blockwise-masters",
    "blockwise-tc-masters",
)  # fmt: skip

#: A variant's name with this suffix: the same variant with its FP8 states kept between steps
#: stacked in a few arrays (`Packed`), to time what FP8's state arrays cost the host's launch
#: of a step (FP8's step takes 73 arrays in and gives 74 out, BF16's 10 and 11).
PACKED = "-packed"
#: A variant's name with this suffix: the same variant timed with the FP8 states of a fresh
#: model, as the GPU runs before session 41 timed every variant. Delayed-scaling variants take
#: recorded states otherwise (`recorded_states`): a fresh state casts with 1.0 without the warm
#: start, where this loss's output gradients (2 y / N, N = 8 or 16 million elements: under
#: 1e-6) flush to zero in E5M2, and with 0 where the warm start is skipped, which zeroes every
#: operand; the GEMMs then multiply zeros, faster than a training run's data.
FRESH = "-fresh"


def base_name(name: str) -> str:
    """`name` without `FRESH` and `PACKED`."""
    return name.removesuffix(FRESH).removesuffix(PACKED)


def unknown(names: list[str]) -> list[str]:
    """The names of `names` that are no variant: neither `bf16` nor a recipe's name, with
    `PACKED`, `FRESH` or both appended in that order."""
    return [n for n in names if n != "bf16" and base_name(n) not in RECIPE_NAMES]


def accepted() -> str:
    """What a variant's name may be, for an error message."""
    return (
        f"bf16 or one of {','.join(RECIPE_NAMES)}, each but bf16 also with {PACKED!r}, "
        f"{FRESH!r} or both appended, in that order"
    )

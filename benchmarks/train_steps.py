"""Models, recipes and train steps shared by the benchmarks.

It imports fp8jax and its examples only (no peer library, no environment settings), so that
`gpu_check` can use the same steps as `peers.py`, `cost_model.py` and `moe_cost.py` on a GPU
machine where Haliax is not installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.examples.gpt import MLP

#: The recipes every benchmark compares against BF16, by name.
RECIPES: dict[str, fp8jax.Recipe] = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
    "mxfp8": fp8jax.MXFP8(),
    # The fused kernel on Hopper, as the published tables measured it (the recipe's default
    # since the H200 run is its XLA path, `residual-xla` where a benchmark compares the two).
    "residual": fp8jax.ResidualFP8(native_kernel=None),
}

#: GPT shapes of `cost_model.py` (all `scan_layers=True`); `ffn=None`: the example's GELU
#: MLP of 4 x width; `vocab=None`: one block alone.
GPT_SHAPES: dict[str, dict[str, Any]] = {
    "1B": dict(width=2048, heads=16, layers=24, context=2048, batch=4, vocab=50304, ffn=None),
    "8B": dict(width=4096, heads=32, layers=32, context=4096, batch=2, vocab=128256, ffn=14336),
    "70B-block": dict(width=8192, heads=64, layers=1, context=4096, batch=2, vocab=None, ffn=28672),
}


def _fp8_state(node: Any) -> bool:
    return isinstance(node, fp8jax.OverwriteWithGradient)


def to_bf16(model: Any, is_state: Callable[[Any], bool] = _fp8_state) -> Any:
    """Float parameters in BF16; FP8 state (nodes where `is_state` holds) untouched."""

    def cast(node):
        if is_state(node):
            return node
        return node.astype(jnp.bfloat16) if eqx.is_inexact_array(node) else node

    return jax.tree.map(cast, model, is_leaf=is_state)


def train_step(
    loss: Callable[..., jax.Array],
    value_and_grad: Callable = fp8jax.filter_value_and_grad,
    split: Callable = fp8jax.partition_for_grad_overwrite,
    apply: Callable = fp8jax.apply_updates,
    cast: Callable[[Any], Any] = to_bf16,
) -> Callable:
    """`step(model, *batch) -> (new model, loss)`: float32 masters cast to BF16 in the loss,
    the FP8 state written back from the gradient, plain SGD on the rest (the benchmarks' step:
    the same for every variant, so only the GEMMs differ)."""

    def step(model, *batch):
        value, grads = value_and_grad(lambda m, *b: loss(cast(m), *b))(model, *batch)
        overwrites, grads = split(grads)
        updates = jax.tree.map(lambda g: -1e-3 * g, grads)
        return apply(model, updates, overwrites), value

    return step


def variant(model: Any, name: str) -> Any:
    """`model` as variant `name`: `"bf16"` (as it is) or `"fp8jax <recipe>"` (its Linears
    converted by `fp8jax.fp8_linear_layers` with `RECIPES[<recipe>]`)."""
    if name == "bf16":
        return model
    recipe = name.split()[-1]
    if not name.startswith("fp8jax ") or recipe not in RECIPES:
        raise ValueError(
            f"variant {name!r}: should be 'bf16' or 'fp8jax <recipe>', recipe in {list(RECIPES)}"
        )
    return fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPES[recipe]))


def mse(model: Any, x: jax.Array) -> jax.Array:
    """Mean square of `model(x)`, activations in BF16 like the parameters."""
    return jnp.mean(model(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)


def mlp_case(
    width: int = 1024, ratio: int = 4, tokens: int = 2048, remat_gelu: bool = False
) -> tuple[MLP, Callable, tuple[jax.Array]]:
    """peers.py's MLP (`width -> ratio * width -> width`, GELU) with its loss and input."""
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (tokens, width), jnp.float32)
    return MLP(width, ratio, remat_gelu, key=key), mse, (x,)


def block_loss(block: Any, x: jax.Array) -> jax.Array:
    """Mean square of one block's output, over a batch of sequences."""
    return jnp.mean(jax.vmap(block)(x).astype(jnp.float32) ** 2)


#: `fp8jax.Policy`'s cast to BF16, which leaves FP8 layers' float32 weights as they are for
#: their GEMMs to quantize from the masters (`Policy.cast_to_compute`).
POLICY_BF16 = fp8jax.Policy(compute_dtype=jnp.bfloat16).cast_to_compute


def block_step(
    loss: Callable[..., jax.Array] = block_loss, cast: Callable[[Any], Any] = to_bf16
) -> Callable:
    """`train_step` for one block (BF16 compute, plain SGD), differentiating the block's input
    too, as inside a stack, and returning that gradient. `cast`: how the float32 masters
    become the step's BF16 parameters (a user's cast of every float, `to_bf16`, or
    `POLICY_BF16`)."""

    def step(block, x):
        value, (grads, dx) = fp8jax.filter_value_and_grad(
            lambda pair: loss(cast(pair[0]), pair[1])
        )((block, x))
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -1e-3 * g, grads)
        return fp8jax.apply_updates(block, updates, overwrites), value, dx

    return step


def positive_int(text: str) -> int:
    """An argparse `type`: a count of at least 1 (steps, rounds), refused otherwise before
    anything compiles, not as a division by zero after."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: should be an integer of at least 1")
    return value


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A Markdown table of `rows` under `header`, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join(
        [
            fmt(header) + " |",
            "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(fmt(r) + " |" for r in rows),
        ]
    )

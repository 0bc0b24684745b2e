"""What a fresh model's FP8 states make of the Llama block benchmark's operands, on the CPU.

    JAX_PLATFORMS=cpu python benchmarks/fresh_states.py [--sizes 1B,8B] \
        | tee benchmarks/results/fresh_states.txt

The GPU check's Llama section (`gpu_check/llama.py`) timed every variant before session 41
on the states of a fresh model. Delayed scaling without its warm start (`delayed-cold`) then
casts every operand with the scale 1.0, and the step's output gradient, the gradient of the
benchmark's loss (the mean square of the block's output `y` over `N` elements: `2 y / N`),
is far below E5M2's smallest subnormal (2^-16) at these sizes: it flushes to zero, and so
do the dgrads behind it. The variants that skip the warm start (`delayed-steady` and its
kin) cast with a fresh state's scale 0: every operand is zero. Their GEMMs then multiply
zeros, which a GPU does faster than a training run's data. This script measures the first:
the block's BF16 output on the CPU, its output gradient cast to E5M2 with the scale 1.0 and
with the scale delayed scaling records for it (`fp8jax.compute_scale` of its amax), and the
fraction of elements each keeps nonzero; and the weights cast to E4M3 with the scale 1.0
(subnormal where a recorded scale would keep them normal). Since session 41
`llama_block.arguments` gives delayed-scaling variants recorded states
(`llama_block.recorded_states`); a name ending in `-fresh` (`llama_block.FRESH`) keeps the
old, fresh ones, to time the difference.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import llama_block
import ml_dtypes
import numpy as np
import train_steps

import fp8jax
from fp8jax._src.core.formats import fp8_max


def output_gradient(size: str) -> np.ndarray:
    """The block's output gradient in the benchmark's step (BF16, `2 y / N`), at init."""
    block = llama_block.make_block(size, "xla")
    x = llama_block.inputs(size)
    y = jax.jit(lambda b, x: b(x))(train_steps.to_bf16(block), x)
    g = jax.grad(lambda y: jnp.mean(y.astype(jnp.float32) ** 2))(y)
    return np.asarray(g.astype(jnp.float32))


def kept(g: np.ndarray, scale: float) -> float:
    """Fraction of `g * scale` that E5M2 keeps nonzero (round to nearest, as XLA casts)."""
    q = (g * np.float32(scale)).astype(ml_dtypes.float8_e5m2)
    return float(np.count_nonzero(q.astype(np.float32))) / g.size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1B,8B")
    args = parser.parse_args(argv)
    llama_block.check_names(parser, args.sizes.split(","))
    print(f"jax {jax.__version__}; the Llama block's output gradient at init, cast to E5M2")
    print()
    header = [
        "block",
        "N elements",
        "max abs gradient",
        "E5M2 smallest subnormal",
        "nonzero with scale 1.0 (fresh state)",
        "recorded scale",
        "nonzero with it",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for size in args.sizes.split(","):
        g = output_gradient(size)
        amax = float(np.max(np.abs(g)))
        scale = float(
            fp8jax.compute_scale(jnp.float32(amax), 1.0, fp8_max("e5m2"), power_of_two=True)
        )
        tiny = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).smallest_subnormal)
        print(
            f"| {size} | {g.size:,} | {amax:.3g} | {tiny:.3g} | {kept(g, 1.0):.4%} | "
            f"2^{int(np.log2(scale))} | {kept(g, scale):.2%} |",
            flush=True,
        )
    for size in args.sizes.split(","):
        weights(size)


def weights(size: str) -> None:
    """Each Linear's weight (BF16, at init) cast to E4M3 with the scale 1.0 and with the scale
    delayed scaling records: the fractions that are zero and subnormal (under 2^-6)."""
    block = llama_block.make_block(size, "xla")
    print(f"\n{size} block: weights cast to E4M3, zero / subnormal")
    print("\n| weight | scale 1.0 (fresh state) | recorded scale |\n|---|---|---|")
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        w = np.asarray(getattr(block, name).weight.astype(jnp.bfloat16).astype(jnp.float32))
        amax = jnp.float32(np.max(np.abs(w)))
        scale = float(fp8jax.compute_scale(amax, 1.0, fp8_max("e4m3"), power_of_two=True))
        cells = []
        for s in (1.0, scale):
            q = (w * np.float32(s)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            zero = np.mean(q == 0)
            subnormal = np.mean((q != 0) & (np.abs(q) < 2.0**-6))
            cells.append(f"{zero:.1%} / {subnormal:.1%}")
        print(f"| {name} | {cells[0]} | {cells[1]} (2^{int(np.log2(scale))}) |", flush=True)


if __name__ == "__main__":
    main()

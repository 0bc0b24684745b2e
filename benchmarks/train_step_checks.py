"""The Llama block through `fp8jax.make_train_step`: its finiteness checks, compiled for an
H100 without one (not timed).

    python benchmarks/train_step_checks.py | tee benchmarks/results/train_step_checks.txt

`llama_block.py` compiles the block's gradient and FP8 state merge alone (the step a custom
loop writes). `make_train_step` adds its policy casts, a check that every gradient and
every new FP8 state is finite, and the select that skips a step that is not. Until session
45 each FP8 state leaf (every operand's scale and amax history) was checked by a reduction
of its own; `states_finite` checks the small ones in one. The Llama-3 block of
`llama_block.py` (attention the stand-in), BF16 parameters and compute, AdamW, per variant:
kernels of each program of the step, and its GEMMs (FP8, all).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import llama_block  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.train import loss_scale, step  # noqa: E402

POLICY = "params=bfloat16,compute=bfloat16,output=float32"


def per_leaf(states: object) -> jax.Array:
    """The check before session 45: a reduction per FP8 state leaf."""
    return loss_scale.all_finite(jax.tree.leaves(states))


def kernels(size: str, name: str) -> tuple[str, str, str]:
    """Kernels of the recorded and the first program of variant `name`'s step, its GEMMs."""
    block, x = llama_block.arguments(size, name, "stand-in", abstract=True)
    train_step = fp8jax.make_train_step(llama_block.loss, optax.adamw(1e-3), policy=POLICY)
    state = eqx.filter_eval_shape(train_step.init, block)
    report = fp8jax.inspect(train_step, state, x, modes=("cublas",))
    first = report.first_steps
    fp8, total = report.count("cublas")
    return (
        str(len(report.cost["cublas"].kernels)),
        "-" if first is None else str(len(first.cost["cublas"].kernels)),
        f"{fp8} of {total} FP8",
    )


def main() -> None:
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode; make_train_step, AdamW, {POLICY}")
    for size in ("1B", "8B"):
        rows = [["bf16", "", *kernels(size, "bf16")]]
        rows.append(["delayed", "together (now)", *kernels(size, "delayed")])
        step.states_finite = per_leaf
        try:
            rows.append(["delayed", "a reduction per leaf (before)", *kernels(size, "delayed")])
        finally:
            step.states_finite = loss_scale.states_finite
        header = ["variant", "FP8 states checked", "kernels, recorded", "first steps", "GEMMs"]
        print(f"\n{size} block, {llama_block.SHAPES[size]}\n")
        print(table(rows, header), flush=True)


if __name__ == "__main__":
    main()

"""FP8 GEMMs that share an operand, and XLA's dot merger: compiled for an H100 without one.

    python benchmarks/shared_operands.py | tee benchmarks/results/shared_operands.txt

XLA's dot merger joins independent dots that share an operand into one dot over the other
operands concatenated. Two tables, read from the compiled HLO (not timed):

1. **A layer called twice** (`Twice`: one 512 -> 512 Linear on two inputs of 1,024 tokens
   behind a learned gain, so its forwards and dgrads share the weight's FP8 copy; the steps
   are tests/test_lowering.py's `shared_weight_step`) and **a step over 2 microbatches**
   (`fp8jax.examples.gpt.MLP(512)` through
   `fp8jax.accumulate_gradients`, 2,048 tokens: XLA unrolls so short a scan, and each weight's
   FP8 copy serves both microbatches), per recipe, in the train step's first program
   (`warm`) and in its program once every scale is recorded (`steady`, inside
   `skip_warm_start(recorded=True)`), traced for cuBLAS as `fp8jax.make_train_step` traces
   them (`traced_for`) and compiled with
   `fp8jax.gpu_compiler_options()` alone (`merger on`: the train steps before session 44) or
   with the options they compile with now (`traced_options`: the merger off). Each GEMM of
   the step as `8` (FP8 operands) or `b` (not). Block recipes are left out: on an H100 their
   GEMMs are fp8jax's kernels, custom calls XLA does not merge.
2. **The Llama-3 block** (`llama_block.py`'s steps, both sizes): kernels, non-GEMM bytes and
   temp memory with the merger on and off; and `delayed-steady` with the input states of
   q, k and v (and of gate and up) tied to one (`-tied`): the three casts of one input then
   compute the same FP8 values from the same scale, which XLA computes once (the upper bound
   of Linears sharing their input's scaling; not an fp8jax feature).
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import llama_block  # noqa: E402
from test_lowering import shared_weight_step  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.core.compile_options import traced_for, traced_options  # noqa: E402

RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "delayed, warm_start=False": fp8jax.DelayedScaling(warm_start=False),
    "current": fp8jax.CurrentScaling(),
    "mxfp8": fp8jax.MXFP8(),
    "residual": fp8jax.ResidualFP8(),
}
GPU = fp8jax.gpu_compiler_options()
#: The options compared: the train steps' before session 44, and now.
OPTIONS = {"merger on": GPU, "merger off (train steps now)": traced_options(GPU)}
TIED = "-tied"


#: The cases (tests/test_lowering.py's `shared_weight_step`), as the tables name them.
CASES = {"layer called twice": "layer-called-twice", "2 microbatches": "microbatches"}


def case_gemms(case: str, recipe: fp8jax.Recipe, steady: bool, options: dict[str, Any]) -> str:
    """The GEMMs of `case`'s step with `recipe` (its first program, or with `steady` the one
    once every scale is recorded), traced for cuBLAS as `make_train_step` traces it and
    compiled with `options`: `8` or `b` each."""
    model, args, step, _ = shared_weight_step(CASES[case], jax.random.key(0), recipe, steady)
    report = fp8jax.inspect(
        traced_for(GPU, step), model, *args, modes=("cublas",), compiler_options=options
    )
    return "".join("8" if g.fp8 else "b" for g in report.gemms["cublas"])


def tie(block: Any) -> Any:
    """`block` with k's and v's input states q's, and up's gate's (the same arrays)."""
    q, gate = block.q.dot_general.input, block.gate.dot_general.input
    block = eqx.tree_at(lambda b: (b.k.dot_general.input, b.v.dot_general.input), block, (q, q))
    return eqx.tree_at(lambda b: b.up.dot_general.input, block, gate)


def llama_split(size: str, name: str, options: dict[str, Any]) -> llama_block.Split:
    """`llama_block`'s variant `name` (`TIED` appended: its states tied by `tie` inside the
    step) of block `size`, compiled for an H100 with `options`."""
    prepare = tie if name.endswith(TIED) else None
    lowered = llama_block.lower_deviceless(size, name.removesuffix(TIED), prepare)
    return llama_block.split(lowered.compile(compiler_options=options))


def main() -> None:
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode\n")
    print("GEMMs sharing a weight: each GEMM of the train step, 8 = FP8 operands, b = not\n")
    rows = [
        [
            case,
            name,
            program,
            *(case_gemms(case, r, program == "steady", o) for o in OPTIONS.values()),
        ]
        for case in CASES
        for name, r in RECIPES.items()
        for program in ("warm", "steady")
    ]
    print(table(rows, ["case", "recipe", "program", *OPTIONS]), flush=True)
    for size in ("1B", "8B"):
        rows = []
        for name in ("bf16", "delayed-steady", "delayed-steady" + TIED, "current"):
            for label, options in OPTIONS.items():
                s = llama_split(size, name, options)
                rows.append(
                    [
                        name,
                        label,
                        str(s.kernel_count),
                        str(s.kernels.get("GEMM fp8", 0)),
                        str(s.kernels.get("GEMM bf16", 0)),
                        f"{sum(s.non_gemm_bytes.values()) / 1e9:.2f}",
                        f"{s.temp_bytes / 2**20:.1f}",
                    ]
                )
        header = ["variant", "options", "kernels", "FP8 GEMMs", "BF16 GEMMs", "non-GEMM GB"]
        print(f"\nLlama-3 {size} block's step\n")
        print(table(rows, [*header, "temp MiB"]), flush=True)


if __name__ == "__main__":
    main()

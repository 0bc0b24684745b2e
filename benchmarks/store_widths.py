"""How wide each non-GEMM kernel of the Llama block's step writes to global memory, read from the
PTX of the step compiled for an H100 without one.

    JAX_PLATFORMS=cpu python benchmarks/store_widths.py [--size 1B] [--variants ...] \
        | tee benchmarks/results/store_widths.txt

GPU run 6 measured XLA's transposing casts (an operand's FP8 copy and its transposed copy from
one fusion) at 1.77 TB/s, its reductions at 4.0 and its FP8 transposes at 2.9
(`profile_rates.py`). The PTX says how each kernel stores: this prints, per class of
`profile_rates.kernel_class` and variant, the kernels, their global store instructions in the
PTX (each thread's, as unrolled) by width, and the bytes a store moves on average (a kernel XLA
compiles once and runs several times counted once). XLA writes
8-bit values through `st.global.b8` where its transpose emitter handles the fusion, and in
vectors elsewhere. Read from the compile, not timed.
"""

from __future__ import annotations

import argparse
import collections
import sys

import jax
import llama_block
import profile_rates
from gpu_check.profile import kernel_name
from train_steps import table

import fp8jax
from fp8jax._src.observe.ptx import compile_with_ptx

VARIANTS = (
    "delayed-steady-fused",
    "delayed-steady",
    "delayed-steady-words",
    "delayed-steady-apart",
    "delayed-steady-apart-words",
    "delayed-steady-kernel-grads",
    "current",
)


def compiled_stores(size: str, name: str) -> tuple[dict, dict[str, collections.Counter[int]]]:
    """The variant's non-GEMM kernels (`hlo_cost`'s, by trace name) and each PTX entry's
    global stores by width (`fp8jax`'s PTX reader, `ptx.Kernel.stores`)."""
    lowered = llama_block.lower_deviceless(size, name)
    compiled, _, ptx = compile_with_ptx(lowered, fp8jax.gpu_compiler_options())
    cost = fp8jax.hlo_cost(compiled.as_text())
    kernels = {kernel_name(k.name): k for k in cost.kernels if k.category is not None}
    return kernels, {entry: collections.Counter(dict(k.stores)) for entry, k in ptx.items()}


def rows_for(size: str, name: str) -> list[list[str]]:
    kernels, stores = compiled_stores(size, name)
    per_class: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    count: collections.Counter[str] = collections.Counter()
    for trace_name, kernel in kernels.items():
        if trace_name not in stores:
            continue  # a kernel XLA compiled once for several instructions
        cls = profile_rates.kernel_class(kernel.name)
        per_class[cls] += stores[trace_name]
        count[cls] += 1
    for entry, widths in stores.items():  # fp8jax's Pallas kernels, by their own names
        if entry.startswith("fp8jax_"):
            per_class["fp8jax kernel"] += widths
            count["fp8jax kernel"] += 1
    rows = []
    for cls in profile_rates.CLASSES:
        widths = per_class.get(cls)
        if not widths:
            continue
        moved, instructions = sum(w * n for w, n in widths.items()), sum(widths.values())
        spread = ", ".join(f"{n} x {w} B" for w, n in sorted(widths.items()))
        rows.append([size, name, cls, str(count[cls]), spread, f"{moved / instructions:.1f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1B", choices=("8B", "1B", "dry"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    llama_block.check_names(parser, [args.size], [n.strip() for n in args.variants.split(",")])
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode")
    print("global stores of the non-GEMM kernels by class (profile_rates.kernel_class: by the")
    print("fusion's name), as the PTX writes them per thread\n")
    rows = [r for name in args.variants.split(",") for r in rows_for(args.size, name.strip())]
    header = ["block", "variant", "class", "kernels (own PTX)", "stores by width", "bytes a store"]
    print(table(rows, header))


if __name__ == "__main__":
    sys.exit(main())

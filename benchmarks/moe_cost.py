"""An estimate of an MoE layer's train step on an H100: XLA's ragged dots against fp8jax's
grouped FP8 kernels, from compiled HLO.

    python benchmarks/moe_cost.py [--shapes mixtral,fine] | tee benchmarks/results/moe_cost.txt

What it measures: one mixture-of-experts MLP (`fp8jax.examples.moe_model.MoE`: a router, top-k
routing with sorted tokens, two grouped GEMMs `up` and `down` with a GELU between), its
forward and backward on BF16 parameters and a BF16 input, compiled for an H100 without a GPU
(cuBLAS mode, as `cost_model.py`). `fp8jax.hlo_cost` reads the optimized HLO: GEMM FLOPs per
precision (fp8jax's kernels by their padded shapes: an upper bound of their work) and the
HBM bytes of every other kernel. Step time = GEMM FLOPs at the H100 SXM dense peak of their
kind (FP8 1,979, BF16 989 TFLOP/s; fp8jax's block-promoted kernels at a published 1,234) +
non-GEMM bytes at 3.35 TB/s, no overlap. Temp memory is XLA's buffer assignment.

This is an ESTIMATE, not a measurement: nothing runs on a GPU, and the kernels have never
been timed. The FLOP counts are exact for what each program asks the hardware to compute.

Shapes (one GPU's share of a layer, 8,192 tokens):

- `mixtral`: Mixtral-8x7B-like: width 4096, 8 experts of hidden 14336, top-2.
- `fine`: fine-grained (DeepSeek-like): width 2048, 64 experts of hidden 1408, top-6.

Variants: `bf16` (`lax.ragged_dot`, which XLA expands into a dense GEMM over all experts),
`bf16 grouped (analytic)` (a line of arithmetic, not a compile: the experts' own FLOPs at the
BF16 peak, the yardstick a BF16 grouped kernel would approach), and FP8 on XLA's path
(`grouped_native_kernel=False`) or fp8jax's kernels: delayed scaling (E5M2 gradients: dgrad
and wgrad run in the kernels on BF16 upcasts), delayed with `backward_format="e4m3"`, and
blockwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from train_steps import table, to_bf16  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax._src.observe.cost import hlo_cost  # noqa: E402
from fp8jax._src.observe.roofline import H100, Cost  # noqa: E402
from fp8jax.examples.moe_model import MoE  # noqa: E402

SHAPES = {
    "mixtral": {"tokens": 8192, "width": 4096, "hidden": 14336, "experts": 8, "top_k": 2},
    "fine": {"tokens": 8192, "width": 2048, "hidden": 1408, "experts": 64, "top_k": 6},
}
#: name -> (recipe, grouped_native_kernel); `None` recipe: BF16, no conversion.
VARIANTS = {
    "bf16": (None, None),
    "fp8 delayed, XLA": (fp8jax.DelayedScaling(), False),
    "fp8 delayed, kernels": (fp8jax.DelayedScaling(), None),
    "fp8 delayed e4m3, kernels": (fp8jax.DelayedScaling(backward_format="e4m3"), None),
    "fp8 blockwise, XLA": (fp8jax.BlockwiseScaling(), False),
    "fp8 blockwise, kernels": (fp8jax.BlockwiseScaling(), None),
}
#: CUB radix sort (the routing's argsort) asks the CUDA runtime for scratch sizes at compile
#: time, which a deviceless compile has not: XLA's own sort instead.
OPTIONS = {**deviceless.MODES["cublas"], "xla_gpu_enable_cub_radix_sort": False}


def make_model(shape: dict, recipe: fp8jax.Recipe | None, native: bool | None):
    """The MoE layer of `shape`, parameters in BF16: BF16 (`recipe=None`) or its experts in
    FP8 with `recipe` and `grouped_native_kernel=native`."""
    key = jax.random.PRNGKey(0)
    model = MoE(shape["width"], shape["hidden"], shape["experts"], shape["top_k"], key=key)
    if recipe is not None:
        config = fp8jax.Fp8Config(
            targets=["up", "down"], recipe=recipe, grouped_native_kernel=native
        )
        model = fp8jax.fp8_linear_layers(model, config)
    return to_bf16(model)


def moe_step(model, x):
    """Loss and gradients of the layer and of its input too, as inside a stack of layers
    (else `up`'s dgrad is dead)."""
    loss = lambda mx: jnp.mean(mx[0](mx[1]).astype(jnp.float32) ** 2)  # noqa: E731
    return fp8jax.filter_value_and_grad(loss)((model, x))


def build(shape: dict, name: str):
    x = jax.ShapeDtypeStruct((shape["tokens"], shape["width"]), jnp.bfloat16)
    return moe_step, (eqx.filter_eval_shape(make_model, shape, *VARIANTS[name]), x)


def compile_cost(shape: dict, name: str) -> tuple[Cost, int, float]:
    """(cost, temp bytes, compile seconds) of variant `name`."""
    step, args = build(shape, name)
    device = deviceless.h100_topology().devices[0]
    start = time.perf_counter()
    lowered, _ = deviceless.lower(step, args, {}, device)
    compiled = lowered.compile(compiler_options=OPTIONS)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return hlo_cost(compiled.as_text()), temp, time.perf_counter() - start


def experts_flops(shape: dict) -> int:
    """Forward, dgrad and wgrad of both expert GEMMs, each expert on its own tokens only."""
    assignments = shape["tokens"] * shape["top_k"]
    return 3 * 2 * (2 * assignments * shape["width"] * shape["hidden"])


def report(title: str, shape: dict) -> None:
    ideal = experts_flops(shape)
    print(f"\n## {title}: {shape}")
    print(f"experts' own GEMM FLOPs (fwd + dgrad + wgrad, both layers): {ideal / 1e12:.3f} T")
    rows, base = [], None
    for name in VARIANTS:
        cost, temp, seconds = compile_cost(shape, name)
        print(f"  compiled {name} in {seconds:.0f} s", file=sys.stderr)
        estimate = cost.estimate_seconds()
        base = estimate if base is None else base
        kinds = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in sorted(cost.flops.items()))
        rows.append(
            [
                name,
                f"{cost.gemm_flops / ideal:.2f}x",
                kinds,
                f"{cost.total_bytes / 1e9:.2f}",
                f"{cost.gemm_seconds() * 1e3:.2f}",
                f"{estimate * 1e3:.2f}",
                f"{estimate / base:.2f}",
                f"{temp / 2**20:.0f}",
            ]
        )
    analytic = ideal / H100["bf16"]
    rows.append(
        ["bf16 grouped (analytic)", "1.00x", f"bf16 {ideal / 1e12:.2f}", "-",
         f"{analytic * 1e3:.2f}", "-", "-", "-"]
    )  # fmt: skip
    header = [
        "variant",
        "GEMM FLOPs / experts' own",
        "TFLOP by kind",
        "non-GEMM GB",
        "GEMM ms",
        "est. ms",
        "vs bf16",
        "temp MiB",
    ]
    print(table(rows, header))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    if deviceless.h100_topology() is None:
        raise SystemExit("needs the h100 extra: pip install -e '.[h100]'")
    print(f"jax {jax.__version__}; deviceless H100 compile, cuBLAS mode; an ESTIMATE (see the")
    print("module docstring): GEMM FLOPs at H100 peaks plus non-GEMM bytes at 3.35 TB/s.")
    for name in args.shapes.split(","):
        report(name, SHAPES[name])


if __name__ == "__main__":
    main()

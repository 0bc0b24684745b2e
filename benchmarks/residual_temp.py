"""H100 temp memory of the residual recipe's train step against delayed scaling's, today's defaults.

    python benchmarks/residual_temp.py

peers.py's MLP step (1024 -> 4096 -> 1024 over 2,048 tokens, float32 masters cast to BF16 in
the loss, plain SGD, no donation: `train_steps.train_step`) compiled for an H100 without a GPU
(`fp8jax.inspect`, both XLA modes); each figure is the executable's
`memory_analysis().temp_size_in_bytes`. Variants: BF16, `DelayedScaling()`,
`BlockwiseScaling()` (its native kernel), `ResidualFP8()`
(its default: the XLA path, two cuBLASLt calls summed in float32, E4M3 gradients),
`ResidualFP8(native_kernel=None)` (the fused kernel) and `ResidualFP8(backward_format="e5m2")`
(the XLA path with E5M2 gradients, the form `docs/recipes.md` first measured). Output:
`results/residual_temp.txt`.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import fp8jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_steps import mlp_case, table, train_step  # noqa: E402

VARIANTS = {
    "bf16": None,
    "delayed": fp8jax.DelayedScaling(),
    "blockwise (native kernel)": fp8jax.BlockwiseScaling(),
    "residual (default: XLA path, E4M3 gradients)": fp8jax.ResidualFP8(),
    "residual native_kernel=None (fused kernel)": fp8jax.ResidualFP8(native_kernel=None),
    "residual backward_format='e5m2' (XLA path)": fp8jax.ResidualFP8(backward_format="e5m2"),
}
MODES = ("cublas", "default")


def main() -> None:
    model, loss, batch = mlp_case()
    step = train_step(loss)
    temps = {}
    for name, recipe in VARIANTS.items():
        m = (
            model
            if recipe is None
            else fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe))
        )
        report = fp8jax.inspect(step, m, *batch, modes=MODES)
        temps[name] = [report.memory[mode].temp_size_in_bytes for mode in MODES]
    rows = [
        [name]
        + [
            f"{t / 2**20:.1f} ({t / b:.2f}x BF16, {t / d:.2f}x delayed)"
            for t, b, d in zip(t_, temps["bf16"], temps["delayed"], strict=True)
        ]
        for name, t_ in temps.items()
    ]
    print(
        f"# H100 temp memory, MLP 1024-4096-1024 x 2048 tokens, SGD step (jax {jax.__version__}; "
        "deviceless H100 compile, memory_analysis().temp_size_in_bytes)"
    )
    print(table(rows, ["variant", "cuBLAS mode MiB", "default mode MiB"]))


if __name__ == "__main__":
    main()

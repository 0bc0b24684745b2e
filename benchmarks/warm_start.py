"""Delayed scaling's first steps: a scale of 1.0 (Transformer Engine) against the warm start.

    python benchmarks/warm_start.py | tee benchmarks/results/warm_start.txt

A fresh delayed-scaling layer has an empty amax history. Transformer Engine, Flax and Haliax
scale it by 1.0 until an amax is recorded; fp8jax's default (`DelayedScaling(warm_start=True)`)
scales it by the tensor's own amax for that step, as current scaling does.

Numerics: an MLP 1024 -> 4096 -> 1024 (GELU) over 2,048 tokens with an MSE loss (issue 24's
case), trained three SGD steps from the same weights with each variant. At every step the FP8
weight gradients are compared with float64 gradients of the same weights and batch (relative
Frobenius error; 1.0 means nothing of the gradient survived). Then the cost: peers.py's MLP
train step compiled for an H100 without a GPU (cuBLAS mode and XLA's defaults), warm start on
and off: temp memory (`memory_analysis`) and `fp8jax.hlo_cost`'s non-GEMM bytes and estimated
step time (an ESTIMATE at H100 peaks, nothing runs on a GPU), and where the bytes go: per
category, and the kernels of 16 MB or more.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe.roofline import CATEGORIES  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import train_steps  # noqa: E402

VARIANTS = {
    "delayed, scale 1.0 (warm_start=False: TE, Flax, Haliax)": fp8jax.DelayedScaling(
        warm_start=False
    ),
    "delayed, warm start (default)": fp8jax.DelayedScaling(),
    "current scaling": fp8jax.CurrentScaling(),
}


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _float64_grads(mlp, x, y):
    """Gradients of the high-precision MLP in float64 NumPy terms (jax_enable_x64 off: the
    float64 maths is done by NumPy on the float32 weights)."""
    w1, b1 = (np.asarray(a, np.float64) for a in (mlp.layers[0].weight, mlp.layers[0].bias))
    w2, b2 = (np.asarray(a, np.float64) for a in (mlp.layers[1].weight, mlp.layers[1].bias))
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    pre = x @ w1.T + b1
    cdf = 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3)))
    h = pre * cdf  # jax.nn.gelu's default tanh approximation
    out = h @ w2.T + b2
    g_out = 2 * (out - y) / out.size
    g_w2 = g_out.T @ h
    g_h = g_out @ w2
    t = np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre**3))
    d_gelu = 0.5 * (1 + t) + 0.5 * pre * (1 - t**2) * np.sqrt(2 / np.pi) * (
        1 + 3 * 0.044715 * pre**2
    )
    g_w1 = (g_h * d_gelu).T @ x
    return (g_w1, g_w2), float(np.abs(g_out).max())


def numerics(steps: int = 3) -> None:
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    mlp = eqx.nn.MLP(1024, 1024, 4096, 1, activation=jax.nn.gelu, key=k1)
    x = jax.random.normal(k2, (2048, 1024))
    y = jax.random.normal(k3, (2048, 1024))
    print("## First steps' weight gradients against float64 (relative Frobenius error)\n")
    print("MLP 1024 -> 4096 -> 1024 (GELU), 2,048 tokens, MSE, SGD lr 0.1\n")
    print("| variant | step | fc1 | fc2 | max output gradient |")
    print("|---|---|---|---|---|")

    @eqx.filter_jit
    def step(model, x, y):
        grads = fp8jax.filter_grad(_loss)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -0.1 * g, grads)
        return fp8jax.apply_updates(model, updates, overwrites), grads

    for name, recipe in VARIANTS.items():
        model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
        for t in range(steps):
            plain = eqx.tree_at(
                lambda m: (m.layers[0].weight, m.layers[1].weight),
                mlp,
                (model.layers[0].weight, model.layers[1].weight),
            )
            plain = eqx.tree_at(
                lambda m: (m.layers[0].bias, m.layers[1].bias),
                plain,
                (model.layers[0].bias, model.layers[1].bias),
            )
            (r1, r2), g_max = _float64_grads(plain, x, y)
            model, grads = step(model, x, y)
            errs = []
            for ours, ref in ((grads.layers[0].weight, r1), (grads.layers[1].weight, r2)):
                ours = np.asarray(ours, np.float64)
                errs.append(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
            print(f"| {name} | {t + 1} | {errs[0]:.3f} | {errs[1]:.3f} | {g_max:.2e} |")
    print(
        "\nE5M2's smallest subnormal is 2**-16 = 1.5e-05: at scale 1.0 every output gradient "
        "of this loss rounds to zero."
    )


def cost() -> None:
    mlp, mse, batch = train_steps.mlp_case()
    print("\n## Cost: peers.py's MLP train step, deviceless H100 (an ESTIMATE)\n")
    print("| warm_start | mode | temp MiB | non-GEMM MB | estimated step µs |")
    print("|---|---|---|---|---|")
    kernels = []
    for warm in (False, True):
        train_steps.RECIPES["delayed"] = fp8jax.DelayedScaling(warm_start=warm)
        model = train_steps.variant(mlp, "fp8jax delayed")
        report = fp8jax.inspect(
            train_steps.train_step(mse), model, *batch, modes=("cublas", "default")
        )
        for mode in ("cublas", "default"):
            c = report.cost[mode]
            temp = report.memory[mode].temp_size_in_bytes / 2**20
            print(
                f"| {warm} | {mode} | {temp:.1f} | {c.total_bytes / 1e6:.1f} | "
                f"{c.estimate_seconds() * 1e6:.1f} |"
            )
            kernels.append((warm, mode, c))
    print("\n## Where the bytes go: non-GEMM MB by category, and the kernels of 16 MB or more\n")
    print(f"| warm_start | mode | {' | '.join(CATEGORIES)} | kernels of 16 MB or more (MB) |")
    print("|---|---|" + "---|" * len(CATEGORIES) + "---|")
    for warm, mode, c in kernels:
        big = ", ".join(
            f"{k.name} ({k.category}) {k.bytes * k.runs / 1e6:.1f}"
            for k in c.kernels
            if k.category is not None and k.bytes * k.runs >= 16e6
        )
        split = " | ".join(f"{c.bytes.get(cat, 0) / 1e6:.1f}" for cat in CATEGORIES)
        print(f"| {warm} | {mode} | {split} | {big} |")


if __name__ == "__main__":
    numerics()
    cost()

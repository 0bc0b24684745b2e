"""Train a small MLP in FP8 next to a float32 copy, printing loss and FP8 scales per step.

    python -m fp8jax.examples.train_mlp [--steps 30] [--batch 256] [--width 256]

The task: regress the output of a fixed random "teacher" network. Both students start from the
same weights; the FP8 one has every hidden Linear converted by `fp8jax.fp8_linear_layers` (the
output head stays in float32, as by default). Each row prints both losses and, for the first
FP8 layer, the scales of its input, kernel and output gradient (values are multiplied by them
before the cast to FP8, so a scale of 448 / amax fills E4M3's range).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import fp8jax
from fp8jax.examples.gpt import check_seeds


def make_data(key: jax.Array, n: int, dim: int) -> tuple[jax.Array, jax.Array]:
    k_teacher, k_x = jax.random.split(key)
    teacher = eqx.nn.MLP(dim, 4, 64, 2, activation=jnp.tanh, key=k_teacher)
    x = jax.random.normal(k_x, (n, dim))
    return x, jax.vmap(teacher)(x)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: should be >= 1.")
    check_seeds(parser, "--seed", [args.seed])

    key = jax.random.PRNGKey(args.seed)
    k_data, k_model = jax.random.split(key)
    x, y = make_data(k_data, args.batch, 32)
    model = eqx.nn.MLP(32, 4, args.width, 3, activation=jax.nn.gelu, key=k_model)
    # The MLP's last Linear is its output head: name-based exclusion can't see that (it is
    # `layers.3`), so target the hidden layers explicitly.
    fp8_model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r"layers\.[0-2]"))

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def init(model):
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        return optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = fp8jax.filter_value_and_grad(loss_fn)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    states = {"fp32": (model, init(model)), "fp8": (fp8_model, init(fp8_model))}
    print(
        f"{'step':>4}  {'loss fp32':>10}  {'loss fp8':>10}  "
        f"{'input scale':>11}  {'kernel scale':>12}  {'grad scale':>12}"
    )
    start = time.perf_counter()
    losses: dict[str, float] = {}
    for i in range(args.steps):
        for name, (m, s) in states.items():
            m, s, loss = step(m, s, x, y)
            states[name] = (m, s)
            losses[name] = float(loss)
        dot = states["fp8"][0].layers[0].dot_general
        print(
            f"{i:>4}  {losses['fp32']:>10.5f}  {losses['fp8']:>10.5f}  "
            f"{float(dot.input.scale):>11.4g}  {float(dot.kernel.scale):>12.4g}  "
            f"{float(dot.output_grad.scale):>12.4g}"
        )
    elapsed = time.perf_counter() - start
    rel = (losses["fp8"] - losses["fp32"]) / losses["fp32"]
    print(
        f"final loss: fp32 {losses['fp32']:.5f}, fp8 {losses['fp8']:.5f} "
        f"(relative difference {rel:+.2%}); {args.steps} steps in {elapsed:.1f}s on "
        f"{jax.devices()[0].platform}"
    )
    return losses


if __name__ == "__main__":
    main()

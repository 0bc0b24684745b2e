"""Classify real handwritten digits with an MLP whose hidden layers run in FP8.

    python -m fp8jax.examples.digits [--steps 400] [--recipe delayed]

The data are scikit-learn's 1,797 8 x 8 digit images (they ship inside the package: nothing
is downloaded), split 80 / 20 into train and test. The same MLP, from the same initial
weights, is trained twice with AdamW in BF16 compute: once as is and once with its hidden
Linears in FP8 (the output layer, a classifier head, stays in BF16). It prints both test
accuracies and losses.
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax.examples.gpt import check_lr, check_seeds

POLICY = "params=float32,compute=bfloat16,output=float32"


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(x_train, y_train, x_test, y_test)`: pixels scaled to [0, 1], integer labels."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits  # noqa: PLC0415
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "The digits example needs scikit-learn: pip install 'fp8jax[demo]'."
        ) from e
    images, labels = sklearn_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    images, labels = images[order].astype(np.float32) / 16.0, labels[order].astype(np.int32)
    cut = int(0.8 * len(labels))
    return images[:cut], labels[:cut], images[cut:], labels[cut:]


def cross_entropy(model: eqx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x.astype(jnp.bfloat16)).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def accuracy(model: eqx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    model = fp8jax.Policy.from_string(POLICY).cast_to_compute(model)
    logits = jax.vmap(model)(x.astype(jnp.bfloat16))
    return jnp.mean(jnp.argmax(logits, axis=1) == y)


def train(model, data, args) -> tuple[float, float]:
    x_train, y_train, x_test, y_test = data
    optimizer = optax.adamw(args.lr)
    step = fp8jax.make_train_step(cross_entropy, optimizer, policy=POLICY)
    state = step.init(model)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
        batch = rng.integers(0, len(y_train), size=args.batch)
        state, _ = step(state, x_train[batch], y_train[batch])
    test_loss = eqx.filter_jit(cross_entropy)(
        fp8jax.Policy.from_string(POLICY).cast_to_compute(state.model), x_test, y_test
    )
    return float(eqx.filter_jit(accuracy)(state.model, x_test, y_test)), float(test_loss)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--recipe",
        default="delayed",
        help="the FP8 run's recipe: delayed, current, blockwise, mxfp8 or residual "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: should be >= 1.")
    check_lr(parser, args.lr)
    check_seeds(parser, "--seed", [args.seed])
    try:
        fp8jax.Fp8Config(recipe=args.recipe)
    except ValueError as e:
        parser.error(f"--recipe {args.recipe}: {e}")
    data = load_digits(args.seed)
    mlp = eqx.nn.MLP(64, 10, args.width, 2, key=jax.random.PRNGKey(args.seed))
    # layers.2 is the classifier head: keep it out of FP8.
    config = fp8jax.Fp8Config(targets=r"layers\.[01]", recipe=args.recipe)
    results = {"bf16": train(mlp, data, args)}
    results[args.recipe] = train(fp8jax.fp8_linear_layers(mlp, config), data, args)
    print(f"{len(data[1])} training and {len(data[3])} test images, {args.steps} steps")
    for name, (acc, loss) in results.items():
        print(f"{name:>10}: test accuracy {100 * acc:.1f} %, test loss {loss:.4f}")
    return results


if __name__ == "__main__":
    main()

"""fp8jax against Qwix's FP8 training over a run: a byte-level GPT in Flax NNX on the Bible.

    pip install -e ".[peers,demo]"
    python benchmarks/peers_qwix_train.py [--seeds 0,1,2] \
        | tee benchmarks/results/peers_qwix_train.txt

`peers_qwix.py` compares one step (kernels, bytes, each GEMM's error); this trains. The main
job's setting (`fp8jax.examples.train_gpt`: 2 blocks of width 128, 4 heads, context 64, batch
16, 300 steps of AdamW with warmup and cosine decay, gradients clipped at 1.0, the King
James Bible's bytes, its last 5 % held out) in Flax NNX, which Qwix converts: pre-norm
blocks with `q`, `k`, `v`, `o` and a SwiGLU `gate` / `up` / `down`, float32 parameters
computed in BF16 (`dtype`). FP8 in the blocks' seven Linears only, the same ones for both
libraries (fp8jax: `fp8_linear_layers`, whose default leaves the `head` alone; Qwix: a
`QtRule` whose `module_path` names them; the attention's own products stay BF16 in both).
Each variant sees the same batches; the validation loss is the mean of 8 held-out batches
after the last step, its gap to BF16's in the same seed. On the CPU (XLA computes FP8 dots
exactly there); nothing timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from peers_qwix import FP8, GRAD, qwix  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.examples.data import kjv_bytes, sample, split  # noqa: E402

WIDTH, HEADS, LAYERS, CONTEXT, BATCH, STEPS, LR = 128, 4, 2, 64, 16, 300, 3e-3
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
VARIANTS = ("bf16", "fp8jax delayed", "fp8jax current", "qwix (per channel)", "qwix per tensor")


class Block(nnx.Module):
    """A pre-norm Llama-style block: causal attention, then a SwiGLU feed-forward."""

    def __init__(self, rngs: nnx.Rngs):
        linear = dict(use_bias=False, dtype=jnp.bfloat16, rngs=rngs)
        self.norm1 = nnx.RMSNorm(WIDTH, dtype=jnp.bfloat16, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(WIDTH, WIDTH, **linear) for _ in range(4))
        self.norm2 = nnx.RMSNorm(WIDTH, dtype=jnp.bfloat16, rngs=rngs)
        self.gate, self.up = (nnx.Linear(WIDTH, 4 * WIDTH, **linear) for _ in range(2))
        self.down = nnx.Linear(4 * WIDTH, WIDTH, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        n = self.norm1(x)
        q, k, v = (p(n).reshape(b, t, HEADS, -1) for p in (self.q, self.k, self.v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.o(mixed.reshape(b, t, -1))
        n = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(n)) * self.up(n))


class GPT(nnx.Module):
    """Bytes in, next-byte logits out."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, WIDTH, dtype=jnp.bfloat16, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CONTEXT, WIDTH)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(WIDTH, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 256, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[...].astype(jnp.bfloat16)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss(model: GPT, tokens: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy of `tokens (batch, context + 1)`."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def plain_step(model: GPT, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    """BF16's and Qwix's step."""
    value, grads = nnx.value_and_grad(loss)(model, tokens)
    optimizer.update(model, grads)
    return value


def build(name: str, seed: int) -> tuple[GPT, Callable[..., Any]]:
    """Variant `name`'s model (seed `seed`) and its train step `step(model, optimizer, tokens)`."""
    model = GPT(nnx.Rngs(seed))
    if name.startswith("fp8jax"):
        recipe = fp8jax.DelayedScaling() if name.endswith("delayed") else fp8jax.CurrentScaling()
        model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe))
        return model, fp8jax.nnx_train_step(loss)
    if name.startswith("qwix"):
        rule = qwix.QtRule(
            module_path=rf"blocks/\d+/({'|'.join(LINEARS)})",
            weight_qtype=FP8,
            act_qtype=FP8,
            bwd_qtype=GRAD,
            disable_channelwise_axes=name.endswith("per tensor"),
        )
        # Qwix runs an NNX model once to intercept its ops; the values do not matter.
        tokens = jnp.zeros((1, CONTEXT), jnp.int32)
        model = qwix.quantize_model(model, qwix.QtProvider([rule]), tokens)
    return model, plain_step


def train(name: str, seed: int, data: tuple[np.ndarray, np.ndarray]) -> float:
    """Variant `name`'s validation loss after `STEPS` steps from seed `seed`."""
    model, step = build(name, seed)
    warmup = STEPS // 10
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, warmup, STEPS)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(seed)  # the same batches for every variant
    for _ in range(STEPS):
        step(model, optimizer, jnp.asarray(sample(data[0], rng, BATCH, CONTEXT)))
    val_rng = np.random.default_rng(seed + 1)
    evaluate = nnx.jit(loss)
    batches = [sample(data[1], val_rng, BATCH, CONTEXT) for _ in range(8)]
    return float(np.mean([float(evaluate(model, jnp.asarray(b))) for b in batches]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: should be comma-separated integers, e.g. 0,1")
    if qwix is None:
        raise SystemExit("peers_qwix_train.py needs qwix: pip install -e '.[peers,demo]'")
    data = split(kjv_bytes())
    vals = {name: [train(name, seed, data) for seed in seeds] for name in VARIANTS}
    gaps = {
        name: [100 * (v / b - 1) for v, b in zip(vals[name], vals["bf16"], strict=True)]
        for name in vals
    }
    rows = [
        [name, *(f"{v:.4f} ({g:+.2f} %)" for v, g in zip(vals[name], gaps[name], strict=True)),
         f"{np.mean(gaps[name]):+.2f} %"]
        for name in VARIANTS
    ]  # fmt: skip
    print(f"jax {jax.__version__}; {LAYERS} x {WIDTH}, context {CONTEXT}, batch {BATCH}, "
          f"{STEPS} steps; validation loss after the last step (gap to BF16's)\n")  # fmt: skip
    print(table(rows, ["variant", *(f"seed {s}" for s in seeds), "mean gap"]), flush=True)


if __name__ == "__main__":
    main()

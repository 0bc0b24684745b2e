"""A small GPT in Equinox, the model of fp8jax's examples, benchmarks and inspector tests.

Token and position embeddings and the output head stay in high precision; the attention and
MLP Linears are the ones `fp8jax.fp8_linear_layers` converts by default (the head is excluded
by name). Call it on one sequence of token ids and `jax.vmap` over the batch, as usual in
Equinox.

```python
model = GPT(GPTConfig(vocab=256, layers=2, width=64, heads=4, context=64), key=key)
model = fp8jax.fp8_linear_layers(model)
logits = jax.vmap(model)(tokens)  # (batch, context, vocab)
```
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import fp8jax


def dense(layer: eqx.Module, x: Float[Array, "seq width"]) -> Float[Array, "seq out"]:
    """A Linear on every row of `x`: `fp8jax.Linear` takes all rows at once, an
    `eqx.nn.Linear` is vmapped (both give one GEMM; see fp8jax's vmap folding)."""
    return layer(x) if isinstance(layer, fp8jax.Linear) else jax.vmap(layer)(x)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a [`GPT`][]. `remat_gelu` recomputes the MLP's GELU in the backward pass
    (`jax.checkpoint`), the case that breaks XLA's FP8 cuBLAS epilogue fusion. `scan_layers`
    stacks the blocks (`eqx.filter_vmap`) and applies them with `lax.scan`: one block is
    compiled, whatever the depth."""

    vocab: int = 256
    layers: int = 2
    width: int = 64
    heads: int = 4
    context: int = 64
    mlp_ratio: int = 4
    remat_gelu: bool = False
    scan_layers: bool = False


def check_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, more: tuple[str, ...] = ()
) -> None:
    """Refuse, as `parser` errors, the GPT and training flags of the examples' command lines
    (`--steps`, `--layers`, `--width`, `--heads`, `--context`, `--batch`, and the integer
    flags `more`) that no run could take: counts below 1, heads that do not divide the
    width, a learning rate (`--lr`) not positive and finite."""
    for name in ("steps", "layers", "width", "heads", "context", "batch", *more):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: should be >= 1.")
    if args.width % args.heads:
        parser.error(f"--heads {args.heads}: should divide --width {args.width}.")
    check_lr(parser, args.lr)


def check_lr(parser: argparse.ArgumentParser, lr: float) -> None:
    """Refuse, as a `parser` error, a learning rate no run could train with: zero, negative,
    inf or NaN (the losses would stay put, climb, or turn NaN at the first update)."""
    if not 0 < lr < math.inf:
        parser.error(f"--lr {lr}: should be > 0 and finite.")


def check_seeds(parser: argparse.ArgumentParser, flag: str, seeds: list[int]) -> None:
    """Refuse, as a `parser` error naming `flag`, a seed outside [0, 2**32): NumPy's batch
    sampler takes no negative one ('expected non-negative integer' as the first run started),
    `jax.random.PRNGKey` keeps a seed's low 32 bits (2**32 built seed 0's model) and raised
    OverflowError from 2**63."""
    for seed in seeds:
        if not 0 <= seed < 2**32:
            parser.error(
                f"{flag} {seed}: should be >= 0 and < 2**32 (NumPy's batch sampler takes no "
                "negative seed; jax.random.PRNGKey keeps a seed's low 32 bits)."
            )


class Attention(eqx.Module):
    """Causal multi-head self-attention with separate query, key, value and output Linears."""

    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query = eqx.nn.Linear(width, width, key=kq)
        self.key = eqx.nn.Linear(width, width, key=kk)
        self.value = eqx.nn.Linear(width, width, key=kv)
        self.out = eqx.nn.Linear(width, width, key=ko)
        self.heads = heads

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        seq, width = x.shape
        split = lambda h: h.reshape(seq, self.heads, width // self.heads)  # noqa: E731
        q, k, v = (split(dense(proj, x)) for proj in (self.query, self.key, self.value))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(width // self.heads).astype(x.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        # Softmax in at least float32 (BF16 scores are upcast; float64 ones stay float64).
        upcast = jnp.promote_types(scores.dtype, jnp.float32)
        weights = jax.nn.softmax(scores.astype(upcast), axis=-1).astype(x.dtype)
        mixed = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, width)
        return dense(self.out, mixed)


class MLP(eqx.Module):
    """`fc2(gelu(fc1(x)))`, with the GELU optionally recomputed in the backward pass."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    remat_gelu: bool = eqx.field(static=True)

    def __init__(self, width: int, ratio: int, remat_gelu: bool, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(width, ratio * width, key=k1)
        self.fc2 = eqx.nn.Linear(ratio * width, width, key=k2)
        self.remat_gelu = remat_gelu

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        gelu = jax.checkpoint(jax.nn.gelu) if self.remat_gelu else jax.nn.gelu
        return dense(self.fc2, gelu(dense(self.fc1, x)))


class Block(eqx.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    attn_norm: eqx.nn.LayerNorm
    attn: Attention
    mlp_norm: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attn_norm = eqx.nn.LayerNorm(config.width)
        self.attn = Attention(config.width, config.heads, key=ka)
        self.mlp_norm = eqx.nn.LayerNorm(config.width)
        self.mlp = MLP(config.width, config.mlp_ratio, config.remat_gelu, key=km)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        x = x + self.attn(jax.vmap(self.attn_norm)(x))
        return x + self.mlp(jax.vmap(self.mlp_norm)(x))


class GPT(eqx.Module):
    """Token ids `(seq,)` to next-token logits `(seq, vocab)`."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: list[Block] | Block
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    scan_layers: bool = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        ke, kp, kh, *kb = jax.random.split(key, 3 + config.layers)
        self.embed = eqx.nn.Embedding(config.vocab, config.width, key=ke)
        self.position = eqx.nn.Embedding(config.context, config.width, key=kp)
        if config.scan_layers:
            self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(jnp.stack(kb))
        else:
            self.blocks = [Block(config, key=k) for k in kb]
        self.scan_layers = config.scan_layers
        self.norm = eqx.nn.LayerNorm(config.width)
        self.head = eqx.nn.Linear(config.width, config.vocab, use_bias=False, key=kh)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        if tokens.ndim != 1 or tokens.shape[0] > self.position.num_embeddings:
            # An index past the position table is clamped by JAX: the extra tokens would all
            # get the last position's embedding.
            raise ValueError(
                f"GPT: tokens of shape {tokens.shape}; it takes one sequence (seq,) of at most "
                f"{self.position.num_embeddings} tokens (GPTConfig.context); vmap over a batch."
            )
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(jnp.arange(tokens.shape[0]))
        if self.scan_layers:
            params, static = eqx.partition(self.blocks, eqx.is_array)

            def step(x: Array, block_params: Block) -> tuple[Array, None]:
                return eqx.combine(block_params, static)(x), None

            x, _ = jax.lax.scan(step, x, params)
        else:
            for block in self.blocks:
                x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def next_token_loss(model: GPT, tokens: Int[Array, "batch seq"]) -> Float[Array, ""]:
    """Mean cross-entropy (nats) of predicting `tokens[:, 1:]` from `tokens[:, :-1]`, in at
    least float32 (a float64 model's loss is not rounded to float32)."""
    logits = jax.vmap(model)(tokens[:, :-1])
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)

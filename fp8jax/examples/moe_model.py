"""A mixture-of-experts block in Equinox, its expert GEMMs in FP8, and an MoE GPT.

The router (`gate`, an `eqx.nn.Linear`) scores every expert for every token; each token goes
to its `top_k` experts, weighted by their renormalised softmax scores. The tokens are sorted
by expert, so that each expert's tokens are consecutive rows, and the experts' MLPs run as two
grouped GEMMs (`up`, `down`: [`fp8jax.GroupedLinear`][], stacked weights
`(experts, in, out)`, `lax.ragged_dot`). The outputs are scattered back to their tokens and
summed with the routing weights.

[`fp8jax.fp8_linear_layers`][] turns the expert GEMMs into FP8 grouped GEMMs
([`fp8jax.Fp8RaggedDot`][], a state per expert); the router stays in high precision (found
by its role: its width is the expert count):

```python
model = MoEModel(width=32, hidden=64, experts=4, top_k=2, key=key)
model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipes={"down": "blockwise"}))
```

`moe_gpt` is the GPT of `fp8jax.examples.gpt` with each MLP an `MoE`. The experiments that
train these models are `fp8jax.examples.moe`.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import fp8jax
from fp8jax.examples.gpt import GPT, GPTConfig


class Routing(eqx.Module):
    """Where each of `tokens * top_k` assignments goes: `order` sorts them by expert,
    `token` is the token of each sorted assignment, `weight` its routing weight, and
    `group_sizes` the number of assignments of each expert."""

    order: Int[Array, " assignments"]
    token: Int[Array, " assignments"]
    weight: Float[Array, " assignments"]
    group_sizes: Int[Array, " experts"]


def top_k_experts(
    logits: Float[Array, "tokens experts"], top_k: int
) -> tuple[Int[Array, "tokens top_k"], Float[Array, "tokens top_k"]]:
    """Each token's `top_k` best experts and their weights: the softmax scores renormalised
    over the chosen ones."""
    scores, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return chosen, scores / jnp.sum(scores, axis=-1, keepdims=True)


def route(logits: Float[Array, "tokens experts"], top_k: int) -> Routing:
    """Top-k routing (`top_k_experts`), the assignments sorted by expert."""
    chosen, scores = top_k_experts(logits, top_k)
    return sort_assignments(chosen, scores, logits.shape[-1])


def sort_assignments(
    chosen: Int[Array, "tokens top_k"], weights: Float[Array, "tokens top_k"], experts: int
) -> Routing:
    """Each token's chosen experts and routing weights as `Routing`: the `tokens * top_k`
    assignments sorted by expert (stable: a token's rows keep the token order)."""
    top_k = chosen.shape[-1]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return Routing(
        order=order,
        token=order // top_k,
        weight=weights.reshape(-1)[order],
        group_sizes=jnp.bincount(flat, length=experts).astype(jnp.int32),
    )


class MoE(eqx.Module):
    """A mixture-of-experts MLP: `x (tokens, width) -> (tokens, width)`.

    **Fields:** `gate` (the router, `width -> experts`), `up` (`experts x width -> hidden`),
    `down` (`experts x hidden -> width`), `top_k` (experts per token), `expert_axis`: `None`
    (all experts on one device), or the mesh axis the experts are split over (expert
    parallelism: call it inside `shard_map`, `up` and `down` holding this device's experts
    and their FP8 state; each device routes its own tokens and
    [`fp8jax.expert_exchange`][] moves them, FP8 where `up` is an FP8 layer), `activation`
    (between `up` and `down`; GELU by default), `fp8_backward` and `capacity` (expert
    parallel: see `fp8jax.expert_exchange`).
    """

    gate: eqx.nn.Linear
    up: fp8jax.GroupedLinear
    down: fp8jax.GroupedLinear
    top_k: int = eqx.field(static=True)
    expert_axis: str | None = eqx.field(static=True)
    activation: Callable[[Array], Array] = eqx.field(static=True)
    fp8_backward: bool = eqx.field(static=True)
    capacity: int | None = eqx.field(static=True)

    def __init__(
        self,
        width: int,
        hidden: int,
        experts: int,
        top_k: int,
        *,
        key: PRNGKeyArray,
        expert_axis: str | None = None,
        activation: Callable[[Array], Array] = jax.nn.gelu,
        fp8_backward: bool = False,
        capacity: int | None = None,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(width, experts, use_bias=False, key=kg)
        self.up = fp8jax.GroupedLinear(experts, width, hidden, key=ku)
        self.down = fp8jax.GroupedLinear(experts, hidden, width, key=kd)
        self.top_k = top_k
        self.expert_axis = expert_axis
        self.activation = activation
        self.fp8_backward = fp8_backward
        self.capacity = capacity

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        if self.expert_axis is not None:
            return self._expert_parallel(x)
        routing = route(jax.vmap(self.gate)(x), self.top_k)
        h = self.activation(self.up(x[routing.token], routing.group_sizes))
        y = self.down(h, routing.group_sizes) * routing.weight[:, None].astype(h.dtype)
        return jnp.zeros_like(x).at[routing.token].add(y.astype(x.dtype))

    def _expert_parallel(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        """This device's tokens through the experts of every device: dispatched (FP8 from an
        FP8 `up`), this device's experts run on the rows they received, combined back
        (BF16) with the routing weights."""
        chosen, weights = top_k_experts(jax.vmap(self.gate)(x), self.top_k)
        plan = fp8jax.expert_exchange(
            chosen,
            self.up.num_experts,
            self.expert_axis,
            capacity=self.capacity,
            fp8_backward=self.fp8_backward,
        )
        h = self.activation(self.up(x, plan))
        y = self.down(h, plan.group_sizes)
        return plan.combine(y, weights).astype(x.dtype)


class MoEModel(eqx.Module):
    """`inputs -> embed -> x + MoE(norm(x)) -> head`: a residual MoE block between two
    Linears (the head stays in high precision by name; `embed` is converted too)."""

    embed: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    moe: MoE
    head: eqx.nn.Linear

    def __init__(
        self,
        width: int = 32,
        hidden: int = 64,
        experts: int = 4,
        top_k: int = 2,
        inputs: int = 16,
        outputs: int = 8,
        *,
        key: PRNGKeyArray,
    ):
        ke, km, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(inputs, width, key=ke)
        self.norm = eqx.nn.LayerNorm(width)
        self.moe = MoE(width, hidden, experts, top_k, key=km)
        self.head = eqx.nn.Linear(width, outputs, key=kh)

    def __call__(self, x: Float[Array, "tokens inputs"]) -> Float[Array, "tokens outputs"]:
        x = dense(self.embed, x)
        x = x + self.moe(jax.vmap(self.norm)(x))
        return dense(self.head, x)


def dense(layer: eqx.Module, x: Array) -> Array:
    """`layer` on tokens `x`: an `fp8jax.Linear` takes them all, an `eqx.nn.Linear` one at a
    time (vmapped)."""
    return layer(x) if isinstance(layer, fp8jax.Linear) else jax.vmap(layer)(x)


def mse(model: MoEModel, x: Array, y: Array) -> Array:
    """Mean squared error of `model` on tokens `x` with targets `y`."""
    return jnp.mean((model(x) - y) ** 2)


def teacher_data(tokens: int, seed: int = 0, inputs: int = 16, outputs: int = 8):
    """A synthetic regression task: targets from a fixed random MoE model (the teacher)."""
    kx, kt = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (tokens, inputs))
    teacher = MoEModel(inputs=inputs, outputs=outputs, key=kt)
    return x, jax.lax.stop_gradient(teacher(x))


# --- a mixture-of-experts GPT ---------------------------------------------------------------


def moe_gpt(
    config: GPTConfig,
    experts: int,
    top_k: int,
    *,
    key: PRNGKeyArray,
    expert_axis: str | None = None,
    fp8_backward: bool = False,
) -> GPT:
    """`GPT(config, key=key)` with each block's MLP replaced by an `MoE` of `experts` experts,
    `top_k` per token, each `mlp_ratio * width // top_k` wide: a token's expert FLOPs are the
    dense MLP's. Everything else (embeddings, attention, norms, head) is the dense GPT's, with
    the same weights. Run it with `moe_gpt_forward` (a batch at once), not `jax.vmap(model)`:
    the router and the grouped GEMMs take all tokens of the batch together. `expert_axis`,
    `fp8_backward`: the MoE blocks' (see `MoE`), for expert parallelism; the weights are
    the same."""
    if config.scan_layers:
        raise ValueError("moe_gpt: scan_layers=True is not supported; use a list of blocks.")
    model = GPT(config, key=key)
    hidden = config.mlp_ratio * config.width // top_k
    keys = jax.random.split(jax.random.fold_in(key, 1), config.layers)
    options = {"expert_axis": expert_axis, "fp8_backward": fp8_backward}
    moes = [MoE(config.width, hidden, experts, top_k, key=k, **options) for k in keys]
    return eqx.tree_at(lambda m: [b.mlp for b in m.blocks], model, moes)


def moe_gpt_forward(
    model: GPT, tokens: Int[Array, "batch seq"]
) -> tuple[Float[Array, "batch seq vocab"], Int[Array, "layers experts"]]:
    """The logits of a `moe_gpt` model on a batch, and the tokens each block's router sent to
    each expert (a token counts once for each of its `top_k` experts).

    Attention runs per sequence, as in `GPT`; each MoE block routes the tokens of the whole
    batch, `(batch * seq, width)`, as MoE layers do: one grouped GEMM per expert layer (JAX
    has no batching rule for `lax.ragged_dot` with an unbatched kernel, so BF16 could not be
    vmapped over the sequences anyway).
    """
    if tokens.ndim != 2 or tokens.shape[1] > model.position.num_embeddings:
        # An index past the position table is clamped by JAX (the last position's embedding).
        raise ValueError(
            f"moe_gpt_forward: tokens of shape {tokens.shape}; it takes a batch (batch, seq) "
            f"of sequences of at most {model.position.num_embeddings} tokens (the context)."
        )
    per_token = lambda f: jax.vmap(jax.vmap(f))  # noqa: E731
    positions = jax.vmap(model.position)(jnp.arange(tokens.shape[1]))
    x = per_token(model.embed)(tokens) + positions
    counts = []
    for block in model.blocks:
        x = x + jax.vmap(block.attn)(per_token(block.attn_norm)(x))
        h = per_token(block.mlp_norm)(x).reshape(-1, x.shape[-1])
        counts.append(route(jax.vmap(block.mlp.gate)(h), block.mlp.top_k).group_sizes)
        x = x + block.mlp(h).reshape(x.shape)
    return per_token(model.head)(per_token(model.norm)(x)), jnp.stack(counts)


def moe_gpt_loss(
    model: GPT, tokens: Int[Array, "batch seq"]
) -> tuple[Float[Array, ""], Int[Array, "layers experts"]]:
    """`next_token_loss` of a `moe_gpt` model, and its tokens per expert (the aux output)."""
    logits, counts = moe_gpt_forward(model, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked), counts

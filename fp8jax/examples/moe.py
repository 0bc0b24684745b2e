"""A mixture-of-experts block in Equinox, and its expert GEMMs in FP8.

The router (`gate`, an `eqx.nn.Linear`) scores every expert for every token; each token goes
to its `top_k` experts, weighted by their renormalised softmax scores. The tokens are sorted
by expert, so that each expert's tokens are consecutive rows, and the experts' MLPs run as two
grouped GEMMs (`up`, `down`: [`fp8jax.GroupedLinear`][], stacked weights
`(experts, in, out)`, `lax.ragged_dot`). The outputs are scattered back to their tokens and
summed with the routing weights.

[`fp8jax.fp8_linear_layers`][] turns the expert GEMMs into FP8 grouped GEMMs
([`fp8jax.Fp8RaggedDot`][], a state per expert); the router stays in high precision (`gate`
and `router` are excluded by default):

```python
model = MoEModel(width=32, hidden=64, experts=4, top_k=2, key=key)
model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipes={"down": "blockwise"}))
```

`python -m fp8jax.examples.moe` trains it on a synthetic regression task, in FP8 and in high
precision, and prints both losses.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import fp8jax


class Routing(eqx.Module):
    """Where each of `tokens * top_k` assignments goes: `order` sorts them by expert,
    `token` is the token of each sorted assignment, `weight` its routing weight, and
    `group_sizes` the number of assignments of each expert."""

    order: Int[Array, " assignments"]
    token: Int[Array, " assignments"]
    weight: Float[Array, " assignments"]
    group_sizes: Int[Array, " experts"]


def route(logits: Float[Array, "tokens experts"], top_k: int) -> Routing:
    """Top-k routing: each token's `top_k` best experts, weighted by their softmax scores
    renormalised over the chosen ones, sorted by expert."""
    experts = logits.shape[-1]
    scores, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    scores = scores / jnp.sum(scores, axis=-1, keepdims=True)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return Routing(
        order=order,
        token=order // top_k,
        weight=scores.reshape(-1)[order],
        group_sizes=jnp.bincount(flat, length=experts).astype(jnp.int32),
    )


class MoE(eqx.Module):
    """A mixture-of-experts MLP: `x (tokens, width) -> (tokens, width)`.

    **Fields:** `gate` (the router, `width -> experts`), `up` (`experts x width -> hidden`),
    `down` (`experts x hidden -> width`), `top_k` (experts per token).
    """

    gate: eqx.nn.Linear
    up: fp8jax.GroupedLinear
    down: fp8jax.GroupedLinear
    top_k: int = eqx.field(static=True)

    def __init__(self, width: int, hidden: int, experts: int, top_k: int, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(width, experts, use_bias=False, key=kg)
        self.up = fp8jax.GroupedLinear(experts, width, hidden, key=ku)
        self.down = fp8jax.GroupedLinear(experts, hidden, width, key=kd)
        self.top_k = top_k

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        routing = route(jax.vmap(self.gate)(x), self.top_k)
        h = jax.nn.gelu(self.up(x[routing.token], routing.group_sizes))
        y = self.down(h, routing.group_sizes) * routing.weight[:, None].astype(h.dtype)
        return jnp.zeros_like(x).at[routing.token].add(y.astype(x.dtype))


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
        x = _dense(self.embed, x)
        x = x + self.moe(jax.vmap(self.norm)(x))
        return _dense(self.head, x)


def _dense(layer: eqx.Module, x: Array) -> Array:
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


def train(model: MoEModel, x: Array, y: Array, steps: int = 50, lr: float = 3e-3) -> list[float]:
    """Adam on `mse`, FP8 state written back each step; returns the losses."""
    optimizer = optax.adam(lr)
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = fp8jax.filter_value_and_grad(mse)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    return losses


def main(steps: int = 100) -> dict[str, list[float]]:
    x, y = teacher_data(512)
    model = MoEModel(key=jax.random.PRNGKey(1))
    runs = {
        "high precision": model,
        "fp8 delayed": fp8jax.fp8_linear_layers(model),
        "fp8 blockwise": fp8jax.fp8_linear_layers(
            model, fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(block_size=16))
        ),
    }
    losses = {name: train(m, x, y, steps) for name, m in runs.items()}
    for name, curve in losses.items():
        print(f"{name:>15}: loss {curve[0]:.4f} -> {curve[-1]:.4f} ({np.argmin(curve)} best)")
    return losses


if __name__ == "__main__":
    main()

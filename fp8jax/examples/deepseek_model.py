"""DeepSeek-V3 in miniature: multi-head latent attention and DeepSeekMoE, in Equinox.

The architecture of DeepSeek-V3 (arXiv:2412.19437, section 2.1; MLA from DeepSeek-V2,
arXiv:2405.04434, section 2.1), small enough to train on a CPU:

- **Multi-head latent attention** (`MultiHeadLatentAttention`, V3 equations 1-11): queries
  through a low-rank down- and up-projection, keys and values up-projected from one compressed
  latent, each latent RMS-normalised, and a decoupled RoPE key shared by all heads. The
  up-projections are applied as in training (keys and values made for every head), not absorbed
  into the query and output projections as for inference.
- **DeepSeekMoE** (`DeepSeekMoE`, equations 12-16): shared experts every token goes through, and
  fine-grained routed experts; top-k by sigmoid affinity, the chosen affinities normalised to
  the gating weights, and auxiliary-loss-free balancing: a per-expert bias that only selects
  (`BalanceBias`), moved after each step from the experts' load (`update_balance`), never by the
  gradient.
- The first `dense_layers` blocks have a dense SwiGLU FFN, the others DeepSeekMoE.

FP8 as DeepSeek-V3 trains it (section 3.3 and the framework of `../shared/seeds/002`) is
`fp8_config`: [`fp8jax.fp8_linear_layers`][] with blockwise scaling (1 x 128 activation tiles,
128 x 128 weight blocks, E4M3 everywhere) converts every Linear of MLA, the FFNs and the shared
experts, and the routed experts' grouped GEMMs; the embedding, the output head, the router
(`gate`), the norms and the attention core stay in high precision. `remat=True` saves only the
FP8 operands of those GEMMs for the backward ([`fp8jax.save_fp8_operands`][]) and recomputes the
rest, as V3 caches FP8 activations and recomputes its norms and up-projections.

```python
config = DeepSeekConfig()
model = fp8jax.fp8_linear_layers(DeepSeekV3(config, key=key), fp8_config())
(loss, load), grads = fp8jax.filter_value_and_grad(deepseek_loss, has_aux=True)(model, tokens)
model = update_balance(model, load.routed)   # after the step, outside the gradient
```

Left out of the miniature, as not FP8's business: multi-token prediction, node-limited
routing, the sequence-wise auxiliary loss (V3's alpha = 0.0001) and the routed experts' output
scale (2.5 in V3's released code; the gating weights here sum to 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import fp8jax
from fp8jax.examples.gpt import dense
from fp8jax.examples.moe_model import sort_assignments


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """Shape of a `DeepSeekV3` (DeepSeek-V3's own values in brackets).

    `width` (7168), `layers` (61), `dense_layers`: the first blocks with a dense FFN (3),
    `heads` (128), `q_rank`: the query latent d_c' (1536), `kv_rank`: the key-value latent d_c
    (512), `head_dim`: d_h of the non-RoPE part of a query and key, per head (128), `rope_dim`:
    d_h^R of the decoupled RoPE query and key (64), `value_dim`: per head (128),
    `dense_hidden`: the dense FFN's (18432), `experts`: routed experts N_r (256),
    `shared_experts` N_s (1), `top_k` K_r (8), `expert_hidden` (2048), `rope_theta`, `vocab`,
    `context`, `remat`: save only the FP8 GEMMs' operands for the backward (see the module).
    """

    vocab: int = 256
    context: int = 64
    width: int = 128
    layers: int = 3
    dense_layers: int = 1
    heads: int = 4
    q_rank: int = 96
    kv_rank: int = 64
    head_dim: int = 32
    rope_dim: int = 16
    value_dim: int = 32
    dense_hidden: int = 512
    experts: int = 8
    shared_experts: int = 1
    top_k: int = 2
    expert_hidden: int = 128
    rope_theta: float = 10000.0
    remat: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("rope_theta", "remat"):
                continue
            low = 0 if field.name in ("dense_layers", "shared_experts") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"DeepSeekConfig {field.name}={value!r}: should be an int >= {low}."
                )
        if self.dense_layers > self.layers:
            raise ValueError(
                f"DeepSeekConfig dense_layers={self.dense_layers} > layers={self.layers}: at "
                "most every block can be dense."
            )
        if self.top_k > self.experts:
            raise ValueError(
                f"DeepSeekConfig top_k={self.top_k} > experts={self.experts}: a token cannot "
                "choose more experts than there are."
            )
        if self.rope_dim % 2:
            raise ValueError(
                f"DeepSeekConfig rope_dim={self.rope_dim}: RoPE rotates pairs; give an even size."
            )


def rope(x: Float[Array, "seq *heads dim"], theta: float) -> Float[Array, "seq *heads dim"]:
    """Rotary position embedding (RoFormer, arXiv:2104.09864, equation 34, as DeepSeek's code
    applies it) of `x` at positions `0 .. seq - 1`: each pair `(x[2i], x[2i + 1])` rotated by
    the angle `position * theta ** (-2i / dim)`, in float32."""
    seq, dim = x.shape[0], x.shape[-1]
    freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    angles = angles.reshape(seq, *([1] * (x.ndim - 2)), dim // 2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def rms_norm(norm: eqx.nn.RMSNorm, x: Float[Array, "*rows dim"]) -> Float[Array, "*rows dim"]:
    """`norm` on every row of `x`."""
    flat = x.reshape(-1, x.shape[-1])
    return jax.vmap(norm)(flat).reshape(x.shape)


@final
class MultiHeadLatentAttention(eqx.Module):
    """Causal multi-head latent attention on one sequence, `(seq, width) -> (seq, width)`.

    With `h_t` a token's input, DeepSeek-V3's equations (section 2.1.1):

    - (1) `c_t^KV = W^DKV h_t`, the key-value latent (`kv_down`, first `kv_rank` outputs),
      RMS-normalised (`kv_norm`);
    - (2) `k_t^C = W^UK c_t^KV` and (5) `v_t^C = W^UV c_t^KV`, every head's keys and values
      (`kv_up`: `W^UK` and `W^UV` as one Linear);
    - (3) `k_t^R = RoPE(W^KR h_t)`, one RoPE key for all heads (`kv_down`, last `rope_dim`
      outputs: `W^DKV` and `W^KR` as one Linear);
    - (6) `c_t^Q = W^DQ h_t` (`q_down`), RMS-normalised (`q_norm`);
    - (7) `q_t^C = W^UQ c_t^Q` and (8) `q_t^R = RoPE(W^QR c_t^Q)` (`q_up`, both as one Linear);
    - (4), (9) `k_{t,i} = [k_{t,i}^C; k_t^R]`, `q_{t,i} = [q_{t,i}^C; q_{t,i}^R]`;
    - (10) `o_{t,i} = sum_j softmax_j(q_{t,i} . k_{j,i} / sqrt(d_h + d_h^R)) v_{j,i}^C` over
      `j <= t`, the attention core, in the compute dtype with a float32 softmax;
    - (11) `u_t = W^O [o_{t,1}; ...; o_{t,n_h}]` (`out`).
    """

    q_down: eqx.nn.Linear
    q_norm: eqx.nn.RMSNorm
    q_up: eqx.nn.Linear
    kv_down: eqx.nn.Linear
    kv_norm: eqx.nn.RMSNorm
    kv_up: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    value_dim: int = eqx.field(static=True)
    kv_rank: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)

    def __init__(self, config: DeepSeekConfig, *, key: PRNGKeyArray):
        c = config
        kq1, kq2, kkv1, kkv2, ko = jax.random.split(key, 5)
        linear = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=False, key=k)  # noqa: E731
        self.q_down = linear(c.width, c.q_rank, kq1)
        self.q_norm = eqx.nn.RMSNorm(c.q_rank, use_bias=False)
        self.q_up = linear(c.q_rank, c.heads * (c.head_dim + c.rope_dim), kq2)
        self.kv_down = linear(c.width, c.kv_rank + c.rope_dim, kkv1)
        self.kv_norm = eqx.nn.RMSNorm(c.kv_rank, use_bias=False)
        self.kv_up = linear(c.kv_rank, c.heads * (c.head_dim + c.value_dim), kkv2)
        self.out = linear(c.heads * c.value_dim, c.width, ko)
        self.heads, self.head_dim, self.rope_dim = c.heads, c.head_dim, c.rope_dim
        self.value_dim, self.kv_rank, self.rope_theta = c.value_dim, c.kv_rank, c.rope_theta

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        seq = x.shape[0]
        c_q = rms_norm(self.q_norm, dense(self.q_down, x))  # (6)
        q = dense(self.q_up, c_q).reshape(seq, self.heads, self.head_dim + self.rope_dim)
        q_c, q_r = jnp.split(q, [self.head_dim], axis=-1)  # (7), (8)
        kv = dense(self.kv_down, x)
        c_kv, k_r = jnp.split(kv, [self.kv_rank], axis=-1)
        c_kv = rms_norm(self.kv_norm, c_kv)  # (1)
        k_r = rope(k_r, self.rope_theta)  # (3): one key for every head
        kv = dense(self.kv_up, c_kv).reshape(seq, self.heads, self.head_dim + self.value_dim)
        k_c, v = jnp.split(kv, [self.head_dim], axis=-1)  # (2), (5)
        q = jnp.concatenate([q_c, rope(q_r, self.rope_theta)], axis=-1)  # (9)
        k_r = jnp.broadcast_to(k_r[:, None, :], (seq, self.heads, self.rope_dim))
        k = jnp.concatenate([k_c, k_r], axis=-1)  # (4)
        scale = jnp.sqrt(jnp.asarray(self.head_dim + self.rope_dim, jnp.float32))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / scale.astype(q.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        o = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, self.heads * self.value_dim)
        return dense(self.out, o)  # (11)


@final
class SwiGLU(eqx.Module):
    """`down(silu(a) * b)` with `[a; b] = up(x)`: DeepSeek's FFN (dense, and each expert's),
    the two input projections as one Linear."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, *, key: PRNGKeyArray):
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(width, 2 * hidden, use_bias=False, key=ku)
        self.down = eqx.nn.Linear(hidden, width, use_bias=False, key=kd)

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        a, b = jnp.split(dense(self.up, x), 2, axis=-1)
        return dense(self.down, jax.nn.silu(a) * b)


@final
class BalanceBias(fp8jax.OverwriteWithGradient):
    """The per-expert bias `b_i` of auxiliary-loss-free balancing (V3 equation 16): added to
    the affinities to choose the top-k experts only, never to the gating weights, and moved by
    `update_balance` from the load, not by the gradient. An `OverwriteWithGradient` (as FP8
    state is) whose `merge` keeps it, so that optimizers and `fp8jax.make_train_step` leave it
    alone."""

    bias: Float[Array, " experts"]

    def merge(self, new: BalanceBias) -> BalanceBias:
        """Keep the bias: the gradient does not move it (`update_balance` does)."""
        return self


@final
class Load(eqx.Module):
    """Tokens per routed expert in each MoE block of a forward pass: `routed` as the tokens
    were sent (top-k of affinity plus bias), `unbiased` where the affinities alone would have
    sent them (top-k without the bias). A token counts once for each of its experts."""

    routed: Int[Array, "moe_layers experts"]
    unbiased: Int[Array, "moe_layers experts"]


@final
class DeepSeekMoE(eqx.Module):
    """DeepSeekMoE on tokens `(tokens, width) -> (tokens, width)`, and its load.

    V3 equations (12)-(16) (section 2.1.2), `u_t` a token's input:

    - (15) `s_{i,t} = sigmoid(u_t . e_i)`: affinity to routed expert `i` (`gate`, float32);
    - (16) expert `i` is chosen when `s_{i,t} + b_i` is among the `top_k` largest
      (`balance.bias`: selection only);
    - (13), (14) `g_{i,t} = s_{i,t} / sum_{j chosen} s_{j,t}` for a chosen expert, else 0;
    - (12) `h_t = sum_{shared} FFN_i^(s)(u_t) + sum_i g_{i,t} FFN_i^(r)(u_t)` (the residual
      `u_t +` is the block's).

    The routed experts are SwiGLU FFNs as two grouped GEMMs over the tokens sorted by expert
    (`up`: each expert's two input projections as one, `down`), [`fp8jax.GroupedLinear`][];
    the shared experts are one `SwiGLU` `shared_experts * expert_hidden` wide (the same FLOPs
    as N_s separate ones, one GEMM each way).
    """

    gate: eqx.nn.Linear
    balance: BalanceBias
    up: fp8jax.GroupedLinear
    down: fp8jax.GroupedLinear
    shared: SwiGLU | None
    top_k: int = eqx.field(static=True)

    def __init__(self, config: DeepSeekConfig, *, key: PRNGKeyArray):
        c = config
        kg, ku, kd, ks = jax.random.split(key, 4)
        self.gate = eqx.nn.Linear(c.width, c.experts, use_bias=False, key=kg)
        self.balance = BalanceBias(jnp.zeros(c.experts, jnp.float32))
        self.up = fp8jax.GroupedLinear(c.experts, c.width, 2 * c.expert_hidden, key=ku)
        self.down = fp8jax.GroupedLinear(c.experts, c.expert_hidden, c.width, key=kd)
        hidden = c.shared_experts * c.expert_hidden
        self.shared = SwiGLU(c.width, hidden, key=ks) if c.shared_experts else None
        self.top_k = c.top_k

    def __call__(
        self,
        u: Float[Array, "tokens width"],
        chosen: Int[Array, "tokens top_k"] | None = None,
    ) -> tuple[Float[Array, "tokens width"], Int[Array, "2 experts"]]:
        """The MoE's output, and its load: tokens per expert as routed and without the bias.
        `chosen`, if given, are the experts each token goes to instead of (16)'s (an
        experiment's routing: `benchmarks/deepseek_gap.py`); the gating weights stay (13)'s."""
        experts = self.up.num_experts
        s = jax.nn.sigmoid(jax.vmap(self.gate)(u).astype(jnp.float32))  # (15)
        if chosen is None:
            bias = jax.lax.stop_gradient(self.balance.bias).astype(jnp.float32)
            _, chosen = jax.lax.top_k(s + bias, self.top_k)  # (16)
        g = jnp.take_along_axis(s, chosen, axis=-1)
        g = g / jnp.sum(g, axis=-1, keepdims=True)  # (13), (14)
        routing = sort_assignments(chosen, g, experts)
        a, b = jnp.split(self.up(u[routing.token], routing.group_sizes), 2, axis=-1)
        y = self.down(jax.nn.silu(a) * b, routing.group_sizes)
        y = y * routing.weight[:, None].astype(y.dtype)
        h = jnp.zeros_like(u).at[routing.token].add(y.astype(u.dtype))
        if self.shared is not None:
            h = h + self.shared(u)
        _, unbiased = jax.lax.top_k(s, self.top_k)
        counts = jnp.bincount(unbiased.reshape(-1), length=experts).astype(jnp.int32)
        return h, jnp.stack([routing.group_sizes, counts])


@final
class Block(eqx.Module):
    """`x + MLA(norm(x))`, then `x + FFN(norm(x))`, the FFN dense or DeepSeekMoE; RMSNorm."""

    attn_norm: eqx.nn.RMSNorm
    attn: MultiHeadLatentAttention
    ffn_norm: eqx.nn.RMSNorm
    ffn: SwiGLU | DeepSeekMoE

    def __init__(self, config: DeepSeekConfig, moe: bool, *, key: PRNGKeyArray):
        ka, kf = jax.random.split(key)
        self.attn_norm = eqx.nn.RMSNorm(config.width, use_bias=False)
        self.attn = MultiHeadLatentAttention(config, key=ka)
        self.ffn_norm = eqx.nn.RMSNorm(config.width, use_bias=False)
        if moe:
            self.ffn = DeepSeekMoE(config, key=kf)
        else:
            self.ffn = SwiGLU(config.width, config.dense_hidden, key=kf)

    def __call__(
        self, x: Float[Array, "batch seq width"]
    ) -> tuple[Float[Array, "batch seq width"], Int[Array, "2 experts"] | None]:
        """The block on a batch of sequences; attention per sequence, the FFN on all tokens
        at once (the router and the grouped GEMMs take the whole batch). Also the MoE's load
        (`None` for a dense block)."""
        x = x + jax.vmap(self.attn)(rms_norm(self.attn_norm, x))
        h = rms_norm(self.ffn_norm, x).reshape(-1, x.shape[-1])
        if isinstance(self.ffn, DeepSeekMoE):
            y, load = self.ffn(h)
        else:
            y, load = self.ffn(h), None
        return x + y.reshape(x.shape), load


@final
class DeepSeekV3(eqx.Module):
    """Token ids `(batch, seq)` to next-token logits `(batch, seq, vocab)` and the MoE
    blocks' `Load`: embedding, `layers` blocks (the first `dense_layers` dense), RMSNorm, head.
    Takes a batch, not one sequence: do not `jax.vmap` it (see `Block`)."""

    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear
    remat: bool = eqx.field(static=True)

    def __init__(self, config: DeepSeekConfig, *, key: PRNGKeyArray):
        ke, kh, *kb = jax.random.split(key, 2 + config.layers)
        self.embed = eqx.nn.Embedding(config.vocab, config.width, key=ke)
        self.blocks = [Block(config, i >= config.dense_layers, key=k) for i, k in enumerate(kb)]
        self.norm = eqx.nn.RMSNorm(config.width, use_bias=False)
        self.head = eqx.nn.Linear(config.width, config.vocab, use_bias=False, key=kh)
        self.remat = config.remat

    def __call__(
        self, tokens: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq vocab"], Load]:
        x = jax.vmap(jax.vmap(self.embed))(tokens)
        loads = []
        for block in self.blocks:
            if self.remat:
                block = eqx.filter_checkpoint(block, policy=fp8jax.save_fp8_operands)
            x, load = block(x)
            if load is not None:
                loads.append(load)
        logits = jax.vmap(self.head)(rms_norm(self.norm, x).reshape(-1, x.shape[-1]))
        experts = self.blocks[-1].ffn.up.num_experts if loads else 0
        stacked = jnp.stack(loads) if loads else jnp.zeros((0, 2, experts), jnp.int32)
        load = Load(routed=stacked[:, 0], unbiased=stacked[:, 1])
        return logits.reshape(*x.shape[:-1], -1), load


def deepseek_loss(
    model: DeepSeekV3, tokens: Int[Array, "batch seq"]
) -> tuple[Float[Array, ""], Load]:
    """Mean cross-entropy of predicting `tokens[:, 1:]` from `tokens[:, :-1]` (float32), and
    the MoE blocks' `Load` (the aux output for `fp8jax.make_train_step(..., has_aux=True)`)."""
    logits, load = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked), load


def moe_layers(model: DeepSeekV3) -> list[DeepSeekMoE]:
    """The model's DeepSeekMoE layers, in block order."""
    return [b.ffn for b in model.blocks if isinstance(b.ffn, DeepSeekMoE)]


def update_balance(
    model: DeepSeekV3, routed: Int[Array, "moe_layers experts"], speed: float = 1e-3
) -> DeepSeekV3:
    """Auxiliary-loss-free balancing, after a step (V3 section 2.1.2): each MoE layer's bias
    `b_i` goes down by `speed` (V3's gamma) where expert `i` got more than the mean load of
    the step's tokens (`routed`, `Load.routed` of the step), up by `speed` where it got less."""
    layers = moe_layers(model)
    routed = jnp.asarray(routed)
    if routed.shape != (len(layers), layers[0].up.num_experts if layers else 0):
        raise ValueError(
            f"update_balance: routed has shape {routed.shape}; the model has {len(layers)} MoE "
            "layers: pass Load.routed of the step, (MoE layers, experts)."
        )
    if isinstance(speed, int | float) and not 0 <= speed < math.inf:  # traced: unchecked
        raise ValueError(f"update_balance: speed={speed!r}: should be a finite number >= 0.")
    load = routed.astype(jnp.float32)
    step = speed * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    new = [BalanceBias(m.balance.bias + step[i]) for i, m in enumerate(layers)]
    return eqx.tree_at(lambda m: [layer.balance for layer in moe_layers(m)], model, new)


def fp8_config(
    telemetry: bool = False, dequantized_dot: bool = False, power_of_two: bool = False
) -> fp8jax.Fp8Config:
    """DeepSeek-V3's FP8: blockwise scaling (E4M3, 1 x 128 tiles, 128 x 128 weight blocks) on
    every Linear and expert GEMM but the head and the router (`gate`), which the default
    conversion keeps in high precision by their role (vocabulary-wide, expert-count-wide; the
    head by name too; where a Linear is as wide as the expert count, convert with `example=`:
    `fp8jax.examples.deepseek.convert_fp8`). `telemetry`: see `fp8jax.Fp8Config`;
    `dequantized_dot`: the CPU emulation of the block GEMMs (see `fp8jax.BlockwiseScaling`);
    `power_of_two`: every tile's and block's scale an integral power of two, as V3 scales the
    activations it requantizes from 1 x 128 to 128 x 1 tiles (section 3.3.3), instead of
    `448 / amax` exactly. Issue 40 measured both on this miniature: they train alike
    (`benchmarks/RESULTS.md`, "Where DeepSeek-V3's FP8 lost loss")."""
    recipe = fp8jax.BlockwiseScaling(dequantized_dot=dequantized_dot, power_of_two=power_of_two)
    return fp8jax.Fp8Config(recipe=recipe, telemetry=telemetry)

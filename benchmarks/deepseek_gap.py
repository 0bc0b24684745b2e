"""Where DeepSeek-V3 in miniature loses validation loss to FP8 (issue 40).

    python benchmarks/deepseek_gap.py gradients [--steps 100] [--variants "all,forward only"]
    python benchmarks/deepseek_gap.py routing [--variants ...]
    python benchmarks/deepseek_gap.py remat [--steps 100]
    python benchmarks/deepseek_gap.py tiles
    python benchmarks/deepseek_gap.py train --seeds 0 1 2 3 4 --variants fp8,fp8-pow2 \
        [--width 256] [--steps 400] [--all-dense] [--cross-eval]

An independent emulation of DeepSeek-V3's FP8 GEMMs, written here from the paper (not with
fp8jax's recipes), each pass and GEMM group switchable on its own:

- forward `y = x w`: `x` in 1 x 128 tiles along its features, `w` in 128 x 128 blocks;
- dgrad `dx = g w^T`: `g` in 1 x 128 tiles along the output features, `w` in 128 x 128 blocks;
- wgrad `dw = x^T g`: both in 128 x 1 tiles along the tokens (for an expert, its own tokens:
  no tile holds two experts' tokens); `x` requantized from the FP8 copy the forward cached (V3's
  "dequantized, transposed, re-quantized into 128x1 tiles", section 3.5.2), or, with
  `cache="high"`, from the BF16 activation (one rounding).

Each tile's scale is `448 / amax` (E4M3's max over the tile's largest magnitude), or with
`pow2` the largest power of two not above it (V3's "integral power of 2" scales, which make
the 1 x 128 -> 128 x 1 requantization exact). Products and sums in float32; a switched-off
pass runs on the unquantized operands. With every pass on and `cache="fp8"`, the emulation is
fp8jax's `BlockwiseScaling` (tested: tests/test_deepseek_gap.py).

`gradients`: from one model state (the float32 run of seed 0 after `--steps` steps), the
relative error of the whole gradient (and per parameter group) to the float32 gradient, for
BF16 and for FP8 in each pass and group: which quantization puts the most error into the
update. `routing`: the token routings each variant's forward changes against float32's.
`remat`: the routings a checkpointed block's recomputation in the backward pass changes, and
what that does to the gradient, before and after fp8jax's policies saved the router's choices.
`tiles`: E4M3 tile error with exact and power-of-two scales. `train`: the miniature trained
with fp8jax's recipe (`fp8`, `fp8-pow2`) or the emulation in chosen passes and groups (a
`VARIANTS` name), over seeds, next to the same seed's BF16 and float32 runs
(`fp8jax.examples.deepseek`'s loop), all scored on one validation set. Variant names with
spaces go in quotes, comma-separated.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.examples import deepseek  # noqa: E402
from fp8jax.examples.deepseek_model import DeepSeekMoE, DeepSeekV3, SwiGLU  # noqa: E402

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128


# --- quantization, from the paper -----------------------------------------------------------


def _scale(amax: jax.Array, pow2: bool) -> jax.Array:
    ok = amax > 0
    scale = jnp.where(ok, E4M3_MAX / jnp.where(ok, amax, 1.0), 1.0)
    if not pow2:
        return scale
    _, exponent = jnp.frexp(scale)  # scale = m * 2**e, m in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(scale), exponent - 1)  # exactly (XLA's exp2 is not)


def _round(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x` through E4M3 at `scale` (broadcast to `x`) and back, in float32."""
    q = jnp.clip(x * scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q.astype(jnp.float32) / scale


def rows(x: jax.Array, pow2: bool) -> jax.Array:
    """`x (R, C)` quantized in 1 x 128 tiles along C (dequantized, float32)."""
    x = x.astype(jnp.float32)
    r, c = x.shape
    pad = -c % TILE
    t = jnp.pad(x, ((0, 0), (0, pad))).reshape(r, -1, TILE)
    scale = _scale(jnp.max(jnp.abs(t), axis=-1, keepdims=True), pow2)
    return _round(t, scale).reshape(r, c + pad)[:, :c]


def blocks(w: jax.Array, pow2: bool) -> jax.Array:
    """`w (R, C)` quantized in 128 x 128 blocks."""
    w = w.astype(jnp.float32)
    r, c = w.shape
    pr, pc = -r % TILE, -c % TILE
    b = jnp.pad(w, ((0, pr), (0, pc))).reshape((r + pr) // TILE, TILE, (c + pc) // TILE, TILE)
    scale = _scale(jnp.max(jnp.abs(b), axis=(1, 3), keepdims=True), pow2)
    return _round(b, scale).reshape(r + pr, c + pc)[:r, :c]


def columns(x: jax.Array, tile_of_row: jax.Array, tiles: int, pow2: bool) -> jax.Array:
    """`x (R, C)` quantized in 128 x 1 tiles along R: row `i` in tile `tile_of_row[i]`."""
    x = x.astype(jnp.float32)
    amax = jax.ops.segment_max(jnp.abs(x), tile_of_row, num_segments=tiles)
    return _round(x, _scale(amax, pow2)[tile_of_row])


@dataclasses.dataclass(frozen=True)
class Passes:
    """Which passes of a GEMM run in (emulated) FP8, and how.

    `forward`, `dgrad`, `wgrad`: that pass's operands quantized; `cache`: where the wgrad's
    activation comes from, `"fp8"` (the forward's FP8 copy, requantized: V3) or `"high"` (the
    activation itself); `pow2`: power-of-two scales."""

    forward: bool = True
    dgrad: bool = True
    wgrad: bool = True
    cache: str = "fp8"
    pow2: bool = False


def _linear(p: Passes, x: jax.Array, w: jax.Array) -> jax.Array:
    """`x (T, K) @ w (N, K)^T` with `p`'s FP8 passes, output in `x`'s and `w`'s dtype."""
    out_dtype = jnp.result_type(x, w)

    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        xq = rows(x, p.pow2) if p.forward else x.astype(jnp.float32)
        wq = blocks(w, p.pow2) if p.forward else w.astype(jnp.float32)
        y = jnp.dot(xq, wq.T, precision=lax.Precision.HIGHEST)
        cached = xq if p.forward and p.cache == "fp8" else x.astype(jnp.float32)
        return y.astype(out_dtype), (x, w, cached)

    def bwd(res, g):
        x, w, cached = res
        g = g.astype(jnp.float32)
        gd = rows(g, p.pow2) if p.dgrad else g
        wd = blocks(w, p.pow2) if p.dgrad else w.astype(jnp.float32)
        dx = jnp.dot(gd, wd, precision=lax.Precision.HIGHEST)
        if p.wgrad:
            tile = jnp.arange(g.shape[0]) // TILE
            tiles = -(-g.shape[0] // TILE)
            gw, xw = (columns(a, tile, tiles, p.pow2) for a in (g, cached))
        else:
            gw, xw = g, x.astype(jnp.float32)
        dw = jnp.dot(gw.T, xw, precision=lax.Precision.HIGHEST)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    f.defvjp(fwd, bwd)
    return f(x, w)


def _grouped(p: Passes, x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`lax.ragged_dot(x (T, K), w (G, K, N), group_sizes)` with `p`'s FP8 passes."""
    out_dtype = jnp.result_type(x, w)
    experts = w.shape[0]

    def per_expert(fn, w):  # 128 x 128 blocks of each expert's (K, N)
        return jax.vmap(lambda m: fn(m, p.pow2))(w)

    def ragged(a, b, sizes):
        return lax.ragged_dot(a, b, sizes, precision=lax.Precision.HIGHEST)

    @jax.custom_vjp
    def f(x, w, sizes):
        return fwd(x, w, sizes)[0]

    def fwd(x, w, sizes):
        xq = rows(x, p.pow2) if p.forward else x.astype(jnp.float32)
        wq = per_expert(blocks, w) if p.forward else w.astype(jnp.float32)
        cached = xq if p.forward and p.cache == "fp8" else x.astype(jnp.float32)
        return ragged(xq, wq, sizes).astype(out_dtype), (x, w, cached, sizes)

    def bwd(res, g):
        x, w, cached, sizes = res
        g = g.astype(jnp.float32)
        gd = rows(g, p.pow2) if p.dgrad else g
        wd = per_expert(blocks, w) if p.dgrad else w.astype(jnp.float32)
        dx = ragged(gd, jnp.swapaxes(wd, -1, -2), sizes)
        if p.wgrad:
            # 128 x 1 tiles within each expert's tokens.
            t = g.shape[0]
            expert = jnp.repeat(jnp.arange(experts), sizes, total_repeat_length=t)
            start = jnp.cumsum(sizes) - sizes
            per = -(-t // TILE) + 1
            tile = expert * per + (jnp.arange(t) - start[expert]) // TILE
            gw, xw = (columns(a, tile, experts * per, p.pow2) for a in (g, cached))
        else:
            gw, xw = g, x.astype(jnp.float32)
        # d_w[e] = x_e^T g_e: the transpose of the ragged dot in w.
        zeros = jnp.zeros(w.shape, jnp.float32)
        dw = jax.vjp(lambda v: ragged(xw, v, sizes), zeros)[1](gw)[0]
        return dx.astype(x.dtype), dw.astype(w.dtype), None

    f.defvjp(fwd, bwd)
    return f(x, w, group_sizes)


class EmulatedDot(eqx.Module):
    """A `dot_general` for `fp8jax.Linear` (`x (..., K) . w (N, K)`) with `passes` emulated."""

    passes: Passes = eqx.field(static=True)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (lc, rc), _ = dimension_numbers
        if tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (1,):
            raise ValueError(f"EmulatedDot: dimension_numbers {dimension_numbers} not a Linear's.")
        flat = lhs.reshape(-1, lhs.shape[-1])
        return _linear(self.passes, flat, rhs).reshape(*lhs.shape[:-1], rhs.shape[0])


class EmulatedRagged(eqx.Module):
    """A `ragged_dot` for `fp8jax.GroupedLinear` with `passes` emulated."""

    passes: Passes = eqx.field(static=True)

    def __call__(self, x, w, group_sizes):
        return _grouped(self.passes, x, w, group_sizes)


#: The GEMM groups of the issue: which layers of a `DeepSeekV3` each holds.
GROUPS = ("mla_down", "mla_up", "attn_out", "dense_ffn", "shared", "routed_up", "routed_down")


def emulate(model: DeepSeekV3, passes: dict[str, Passes]) -> DeepSeekV3:
    """`model` with the GEMMs of each group named in `passes` emulated in FP8 (the others,
    the router and the head untouched)."""
    unknown = set(passes) - set(GROUPS)
    if unknown:
        raise ValueError(f"emulate: unknown groups {sorted(unknown)}; choose among {GROUPS}.")

    def linear(layer: eqx.nn.Linear, group: str) -> Any:
        if group not in passes:
            return layer
        return fp8jax.Linear.from_eqx(layer, dot_general=EmulatedDot(passes[group]))

    def grouped(layer: fp8jax.GroupedLinear, group: str) -> fp8jax.GroupedLinear:
        if group not in passes:
            return layer
        return eqx.tree_at(
            lambda g: g.ragged_dot,
            layer,
            EmulatedRagged(passes[group]),
            is_leaf=lambda v: v is None,
        )

    blocks_ = []
    for block in model.blocks:
        a = block.attn
        a = eqx.tree_at(
            lambda m: (m.q_down, m.kv_down, m.q_up, m.kv_up, m.out),
            a,
            (
                linear(a.q_down, "mla_down"),
                linear(a.kv_down, "mla_down"),
                linear(a.q_up, "mla_up"),
                linear(a.kv_up, "mla_up"),
                linear(a.out, "attn_out"),
            ),
        )
        ffn = block.ffn
        if isinstance(ffn, SwiGLU):
            ffn = eqx.tree_at(
                lambda m: (m.up, m.down),
                ffn,
                (linear(ffn.up, "dense_ffn"), linear(ffn.down, "dense_ffn")),
            )
        elif isinstance(ffn, DeepSeekMoE):
            ffn = eqx.tree_at(
                lambda m: (m.up, m.down),
                ffn,
                (grouped(ffn.up, "routed_up"), grouped(ffn.down, "routed_down")),
            )
            if ffn.shared is not None:
                s = ffn.shared
                ffn = eqx.tree_at(
                    lambda m: (m.shared.up, m.shared.down),
                    ffn,
                    (linear(s.up, "shared"), linear(s.down, "shared")),
                )
        blocks_.append(eqx.tree_at(lambda b: (b.attn, b.ffn), block, (a, ffn)))
    return eqx.tree_at(lambda m: m.blocks, model, blocks_)


# --- the gradient's error, per pass and group -----------------------------------------------

#: The variants of `gradients` and `train`: name -> (passes, groups). `all`: V3's FP8.
VARIANTS: dict[str, tuple[Passes, tuple[str, ...]]] = {
    "all": (Passes(), GROUPS),
    "wgrad from BF16": (Passes(cache="high"), GROUPS),
    "pow2 scales": (Passes(pow2=True), GROUPS),
    "forward only": (Passes(dgrad=False, wgrad=False), GROUPS),
    "dgrad only": (Passes(forward=False, wgrad=False), GROUPS),
    "wgrad only": (Passes(forward=False, dgrad=False), GROUPS),
    "pow2 forward only": (Passes(dgrad=False, wgrad=False, pow2=True), GROUPS),
    **{f"{group} only": (Passes(), (group,)) for group in GROUPS},
    **{f"pow2 {group} only": (Passes(pow2=True), (group,)) for group in GROUPS},
}

#: Parameter groups of the gradient's error report: (name, regex on the parameter's path).
PARAMETER_GROUPS = (
    ("embed", r"embed"),
    ("MLA", r"attn\."),
    ("dense FFN", r"blocks\.0\.ffn"),
    ("router", r"ffn\.gate"),
    ("routed experts", r"ffn\.(up|down)\.weight"),
    ("shared expert", r"ffn\.shared"),
    ("norms", r"norm"),
    ("head", r"^head"),
)


def variant_model(model: DeepSeekV3, name: str) -> DeepSeekV3:
    """`model` with `VARIANTS[name]`'s emulated FP8 (`"bf16"`: untouched)."""
    if name == "bf16":
        return model
    passes, groups = VARIANTS[name]
    return emulate(model, dict.fromkeys(groups, passes))


def _paths(tree: Any) -> list[tuple[str, jax.Array]]:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_inexact_array))
    return [(jax.tree_util.keystr(p, simple=True, separator="."), v) for p, v in leaves]


def gradient(model: DeepSeekV3, policy: fp8jax.Policy, batches: list[np.ndarray]) -> list:
    """The mean gradient over `batches` of the loss in `policy`'s compute dtype, w.r.t. the
    float32 parameters, as `(path, array)` pairs."""

    @eqx.filter_jit
    def grad(model, tokens):
        return eqx.filter_grad(
            lambda m: deepseek.deepseek_loss(policy.cast_to_compute(m), tokens)[0]
        )(model)

    total = None
    for tokens in batches:
        g = grad(model, jnp.asarray(tokens))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return [(p, np.asarray(v, np.float64) / len(batches)) for p, v in _paths(total)]


def errors(grads: list, reference: list) -> dict[str, float]:
    """Relative error `|g - ref| / |ref|` of the whole gradient and of each parameter group."""
    import re

    ref = dict(reference)
    missing = [path for path, _ in grads if path not in ref and path.endswith("weight")]
    if missing:
        raise ValueError(f"errors: no reference gradient for {missing[:3]}")
    out = {}
    for name, pattern in (("all", r".*"), *PARAMETER_GROUPS):
        num = den = 0.0
        for path, g in grads:  # FP8 layers' own state (no reference) left out
            if path in ref and re.search(pattern, path):
                r = ref[path]
                num += float(np.sum((g - r) ** 2))
                den += float(np.sum(r**2))
        out[name] = np.sqrt(num / den) if den else float("nan")
    return out


def trained_state(steps: int, batches: int, validation: bool) -> tuple[DeepSeekV3, list, Any]:
    """The state `gradients` and `routing` measure at: the float32 run of seed 0 after
    `steps` steps, `batches` batches (from the validation split if `validation`, else the
    training split; always the same ones), and the job's arguments."""
    from fp8jax.examples.data import kjv_bytes, sample, split

    train_args = deepseek.parse(["--kjv", "--steps", str(steps), "--seeds", "0"])
    data = split(kjv_bytes())
    trained = deepseek.train(deepseek.config_of(train_args), "fp32", data, train_args, 0).model
    rng = np.random.default_rng(1234)
    source = data[1] if validation else data[0]
    drawn = [sample(source, rng, train_args.batch, train_args.context) for _ in range(batches)]
    return trained, drawn, train_args


def run_gradients(args: argparse.Namespace) -> None:
    """The `gradients` command (see the module)."""
    trained, batches, train_args = trained_state(args.steps, args.batches, validation=False)
    fp32 = fp8jax.Policy.from_string(deepseek.FP32_POLICY)
    bf16 = fp8jax.Policy.from_string(deepseek.POLICY)
    reference = gradient(trained, fp32, batches)
    names = ["bf16", *(args.variants or VARIANTS)]
    print(
        f"Relative error of the gradient (mean over {args.batches} batches of {train_args.batch} "
        f"x {train_args.context} bytes) to the float32 gradient, at the float32 run of seed 0 "
        f"after {args.steps} steps; BF16 compute, FP8 emulated where named:"
    )
    header = ["all", *(n for n, _ in PARAMETER_GROUPS)]
    print("| variant | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    for name in names:
        e = errors(gradient(variant_model(trained, name), bf16, batches), reference)
        print(f"| {name} | " + " | ".join(f"{e[h]:.4f}" for h in header) + " |", flush=True)


def strip(model: DeepSeekV3) -> DeepSeekV3:
    """`model` with every FP8 layer (fp8jax's or emulated) back in high precision: each
    `fp8jax.Linear` an `eqx.nn.Linear` of the same weight, each `GroupedLinear` without its
    ragged dot. The same weights, evaluated without FP8."""

    def plain(layer: Any) -> Any:
        if isinstance(layer, fp8jax.Linear):
            out, fan_in = layer.weight.shape
            linear = eqx.nn.Linear(fan_in, out, use_bias=False, key=jax.random.PRNGKey(0))
            return eqx.tree_at(lambda m: m.weight, linear, layer.weight)
        if isinstance(layer, fp8jax.GroupedLinear):
            return eqx.tree_at(lambda m: m.ragged_dot, layer, None)
        return layer

    is_layer = lambda x: isinstance(x, fp8jax.Linear | fp8jax.GroupedLinear)  # noqa: E731
    return jax.tree.map(plain, model, is_leaf=is_layer)


def validation(model: DeepSeekV3, policy: fp8jax.Policy, batches: list[np.ndarray]) -> float:
    """The mean loss over `batches` in `policy`'s compute dtype (the job's validation)."""
    loss = eqx.filter_jit(lambda m, t: deepseek.deepseek_loss(policy.cast_to_compute(m), t)[0])
    return float(np.mean([float(loss(model, jnp.asarray(b))) for b in batches]))


def cross_evaluations(
    run: deepseek.Run, policy: fp8jax.Policy, batches: list[np.ndarray]
) -> tuple[float, float]:
    """The final validation loss of `run`'s weights with a high-precision forward (every GEMM
    in `policy`'s compute dtype) and with V3's FP8 forward (emulated in every group)."""
    high = strip(run.model)
    fp8 = fp8_forward(high)
    return validation(high, policy, batches), validation(fp8, policy, batches)


def routes(model: DeepSeekV3, tokens: jax.Array) -> list[jax.Array]:
    """Each MoE block's chosen experts `(tokens, top_k)` (sorted) on `tokens (batch, seq)`:
    the model's forward up to every router (as `DeepSeekV3.__call__`, without the head)."""
    from fp8jax.examples.deepseek_model import rms_norm

    x = jax.vmap(jax.vmap(model.embed))(tokens)
    chosen = []
    for block in model.blocks:
        x = x + jax.vmap(block.attn)(rms_norm(block.attn_norm, x))
        h = rms_norm(block.ffn_norm, x).reshape(-1, x.shape[-1])
        if isinstance(block.ffn, DeepSeekMoE):
            moe = block.ffn
            s = jax.nn.sigmoid(jax.vmap(moe.gate)(h).astype(jnp.float32))
            _, top = jax.lax.top_k(s + moe.balance.bias, moe.top_k)
            chosen.append(jnp.sort(top, axis=-1))
            y, _ = moe(h)
        else:
            y = block.ffn(h)
        x = x + y.reshape(x.shape)
    return chosen


def routed_forward(
    model: DeepSeekV3, tokens: jax.Array, chosen: list[jax.Array]
) -> tuple[jax.Array, Any]:
    """`DeepSeekV3.__call__` with each MoE block's experts given (`chosen[i]`, `(tokens,
    top_k)`, e.g. `routes` of another forward) instead of chosen from this forward's
    affinities; the gating weights are this forward's affinities at the given experts."""
    from fp8jax.examples.deepseek_model import Load, rms_norm

    def run(block, x, top):
        x = x + jax.vmap(block.attn)(rms_norm(block.attn_norm, x))
        h = rms_norm(block.ffn_norm, x).reshape(-1, x.shape[-1])
        if isinstance(block.ffn, DeepSeekMoE):
            y, load = block.ffn(h, top)
        else:
            y, load = block.ffn(h), None
        return x + y.reshape(x.shape), load

    if model.remat:
        run = eqx.filter_checkpoint(run, policy=fp8jax.save_fp8_operands)
    x = jax.vmap(jax.vmap(model.embed))(tokens)
    loads, given = [], iter(chosen)
    for block in model.blocks:
        top = next(given) if isinstance(block.ffn, DeepSeekMoE) else None
        x, load = run(block, x, top)
        if load is not None:
            loads.append(load)
    logits = jax.vmap(model.head)(rms_norm(model.norm, x).reshape(-1, x.shape[-1]))
    stacked = jnp.stack(loads)
    return logits.reshape(*x.shape[:-1], -1), Load(routed=stacked[:, 0], unbiased=stacked[:, 1])


def shadow_loss(router: Any) -> Any:
    """A `deepseek_loss` whose MoE blocks route as `router(model)` would (its forward's
    `routes`, no gradient) while every other number comes from `model`'s own forward: FP8
    computing with BF16's routes (`router=strip`), or BF16 with FP8's."""

    def loss(model: DeepSeekV3, tokens: jax.Array):
        inputs = tokens[:, :-1]
        chosen = jax.lax.stop_gradient(routes(router(model), inputs))
        logits, load = routed_forward(model, inputs, chosen)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), load

    return loss


def fp8_forward(model: DeepSeekV3) -> DeepSeekV3:
    """`model` with V3's FP8 forward emulated in every group (no backward: for `routes`)."""
    return emulate(model, dict.fromkeys(GROUPS, Passes(dgrad=False, wgrad=False)))


def flip_rate(
    a: DeepSeekV3, policy_a: fp8jax.Policy, b: DeepSeekV3, policy_b: fp8jax.Policy, batches: list
) -> float:
    """The share of token routings (a token's set of experts in one MoE block) that differ
    between model `a` in `policy_a`'s compute dtype and `b` in `policy_b`'s, over `batches`."""

    def fn(policy):
        return eqx.filter_jit(lambda m, t: routes(policy.cast_to_compute(m), t))

    fa, fb = fn(policy_a), fn(policy_b)
    differ = total = 0
    for tokens in batches:
        t = jnp.asarray(tokens)
        for ra, rb in zip(fa(a, t), fb(b, t), strict=True):
            differ += int(jnp.sum(jnp.any(ra != rb, axis=-1)))
            total += ra.shape[0]
    return differ / total


# --- routes recomputed under remat -------------------------------------------------------------

#: The remat policy of fp8jax before issue 40: the FP8 operands saved, a router's `top_k`
#: recomputed in the backward pass.
NAMES_ONLY = jax.checkpoint_policies.save_only_these_names("fp8jax_fp8_operands")


@contextlib.contextmanager
def remat_policy(policy: Any):
    """`DeepSeekV3`'s blocks checkpointed with `policy` instead of `fp8jax.save_fp8_operands`
    (the model reads that name when it is traced)."""
    saved = fp8jax.save_fp8_operands
    fp8jax.save_fp8_operands = policy
    try:
        yield
    finally:
        fp8jax.save_fp8_operands = saved


def with_remat(model: DeepSeekV3, remat: bool) -> DeepSeekV3:
    """`model` with its blocks checkpointed (`remat`) or not: the same weights."""
    copy = jax.tree.map(lambda x: x, model)
    object.__setattr__(copy, "remat", remat)
    return copy


def recomputed_routes_changed(
    model: DeepSeekV3, policy: fp8jax.Policy, batches: list[np.ndarray]
) -> float:
    """The share of routings (token x MoE block) that the backward pass's recomputation of a
    checkpointed block chose differently from the forward pass (0 without remat): every
    `sort_assignments` call's experts recorded, each recomputation paired with the forward's
    of its block (the nearest: another block's routes differ almost everywhere)."""
    from fp8jax.examples import deepseek_model

    seen: list[np.ndarray] = []
    original = deepseek_model.sort_assignments

    def recording(chosen, weights, experts):
        jax.debug.callback(lambda c: seen.append(np.sort(np.asarray(c), axis=-1)), chosen)
        return original(chosen, weights, experts)

    grad = eqx.filter_jit(
        eqx.filter_grad(lambda m, t: deepseek.deepseek_loss(policy.cast_to_compute(m), t)[0])
    )
    changed = total = 0
    deepseek_model.sort_assignments = recording
    try:
        for tokens in batches:
            seen.clear()
            jax.block_until_ready(grad(model, jnp.asarray(tokens)))
            layers = len(deepseek_model.moe_layers(model))
            if len(seen) == layers:  # no recomputation
                continue
            if len(seen) != 2 * layers:
                raise RuntimeError(f"{len(seen)} routings recorded for {layers} MoE blocks")
            differ = lambda a, b: int(np.sum(np.any(a != b, axis=-1)))  # noqa: E731
            for i, a in enumerate(seen):  # each routing against its nearest other
                changed += min(differ(a, b) for j, b in enumerate(seen) if j != i)
                total += a.shape[0]
    finally:
        deepseek_model.sort_assignments = original
    return changed / total if total else 0.0


def run_remat(args: argparse.Namespace) -> None:
    """The `remat` command: at the float32 run of seed 0 after `--steps` steps, for BF16 and
    fp8jax's FP8 (`fp8_config()`), the routings the backward pass's recomputation changed and
    the gradient's error to float32's (without remat), with the blocks not checkpointed,
    checkpointed saving nothing (everything recomputed, routes too), checkpointed with the FP8
    operands saved and the routes recomputed (fp8jax before issue 40), and checkpointed with
    `fp8jax.save_fp8_operands` (the routes saved)."""
    from fp8jax.examples.deepseek_model import fp8_config

    trained, batches, _ = trained_state(args.steps, args.batches, validation=False)
    fp32 = fp8jax.Policy.from_string(deepseek.FP32_POLICY)
    bf16 = fp8jax.Policy.from_string(deepseek.POLICY)
    reference = gradient(with_remat(trained, False), fp32, batches)
    fp8 = fp8jax.fp8_linear_layers(trained, fp8_config(dequantized_dot=True))
    print(
        f"At the float32 run of seed 0 after {args.steps} steps, {args.batches} training "
        "batches: routings the backward pass's recomputation changed, and the relative error "
        "of the gradient (mean over the batches) to float32's; BF16 compute, FP8 fp8jax's "
        "blockwise recipe:"
    )
    print("| run | blocks | routings changed | gradient error |")
    print("|---|---|---|---|")
    setups = (
        ("not checkpointed", False, fp8jax.save_fp8_operands),
        ("checkpointed, nothing saved", True, jax.checkpoint_policies.nothing_saveable),
        ("checkpointed, routes recomputed (before)", True, NAMES_ONLY),
        ("checkpointed, fp8jax.save_fp8_operands", True, fp8jax.save_fp8_operands),
    )
    for name, model in (("bf16", trained), ("fp8", fp8)):
        for label, remat, policy in setups:
            with remat_policy(policy):
                m = with_remat(model, remat)
                changed = recomputed_routes_changed(m, bf16, batches)
                err = errors(gradient(m, bf16, batches), reference)["all"]
            print(f"| {name} | {label} | {100 * changed:.2f} % | {err:.4f} |", flush=True)


def run_routing(args: argparse.Namespace) -> None:
    """The `routing` command: at the float32 run of seed 0 after `--steps` steps, the share
    of routings that differ from the float32 forward's, for BF16 and the FP8 variants."""
    trained, batches, _ = trained_state(args.steps, args.batches, validation=True)
    fp32 = fp8jax.Policy.from_string(deepseek.FP32_POLICY)
    bf16 = fp8jax.Policy.from_string(deepseek.POLICY)
    print(
        f"Routings (token x MoE block) that differ from the float32 forward's, at the float32 "
        f"run of seed 0 after {args.steps} steps, {args.batches} validation batches; BF16 "
        "compute, FP8 emulated where named (the forward's, the only one routing sees):"
    )
    print("| forward | routings changed |")
    print("|---|---|")
    for name in ["bf16", *(args.variants or ["all", "pow2 scales"])]:
        rate = flip_rate(variant_model(trained, name), bf16, trained, fp32, batches)
        print(f"| {name} | {100 * rate:.2f} % |", flush=True)


#: `train`'s runs of fp8jax's own recipe: `fp8_config()` (exact scales, `448 / amax`) and
#: with power-of-two scales; and the route swaps: fp8jax's FP8 routed as the same weights'
#: BF16 forward routes, and BF16 routed as their FP8 forward (emulated) routes.
LIBRARY = ("fp8", "fp8-pow2", "fp8 bf16-routes", "bf16 fp8-routes")


def run_train(args: argparse.Namespace) -> None:
    """The `train` command (see the module): per seed the BF16 and float32 runs of
    `fp8jax.examples.deepseek`, its FP8 run (fp8jax's recipe, `fp8`) if asked, and each
    emulated variant (BF16 compute, FP8 where the variant says); then each variant's final
    validation loss against BF16's and float32's of the same seed, over the seeds."""
    from fp8jax.examples.data import kjv_bytes, sample, split

    argv = ["--kjv", "--steps", str(args.steps), "--block-dot", "dequantized"]
    argv += ["--width", str(args.width), "--balance-speed", str(args.balance_speed)]
    argv += ["--lr", str(args.lr)]
    train_args = deepseek.parse(argv)
    config = deepseek.config_of(train_args)
    if args.all_dense:  # no router: does FP8 cost as much without routing?
        config = dataclasses.replace(config, dense_layers=config.layers)
    data = split(kjv_bytes())
    names = ["bf16", "fp32", *args.variants]
    print(
        f"DeepSeek-V3 in miniature{' with every block dense' if args.all_dense else ''}, width "
        f"{args.width}, {args.steps} steps, learning rate {args.lr}, balance speed "
        f"{args.balance_speed}, seeds {args.seeds}: "
        "final validation "
        f"loss of each run against the same seed's BF16 and float32 runs (variants: "
        f"{', '.join(args.variants)}; fp8 and fp8-pow2 are fp8jax's blockwise recipe with "
        "exact and power-of-two scales, the others the emulation)",
        flush=True,
    )
    val: dict[str, list[float]] = {n: [] for n in names}
    curves: dict[str, list[list[float]]] = {n: [] for n in names}
    high: dict[str, list[float]] = {n: [] for n in names}
    fp8: dict[str, list[float]] = {n: [] for n in names}
    # One large validation set for every run (the job's own is 8 batches per seed).
    val_rng = np.random.default_rng(2026)
    batches = [
        sample(data[1], val_rng, train_args.batch, train_args.context)
        for _ in range(args.val_batches)
    ]
    pow2_args = deepseek.parse([*argv, "--power-of-two"])
    for seed in args.seeds:
        for name in names:
            if name in ("bf16", "fp32", "fp8"):  # the job's own runs
                run = deepseek.train(config, name, data, train_args, seed)
            elif name == "fp8-pow2":
                run = deepseek.train(config, "fp8", data, pow2_args, seed)
            elif name == "fp8 bf16-routes":
                loss = shadow_loss(strip)
                run = deepseek.train(config, "fp8", data, train_args, seed, loss=loss)
            elif name == "bf16 fp8-routes":
                loss = shadow_loss(fp8_forward)
                run = deepseek.train(config, "bf16", data, train_args, seed, loss=loss)
            else:
                convert = lambda m, name=name: variant_model(m, name)  # noqa: E731
                run = deepseek.train(config, "bf16", data, train_args, seed, convert=convert)
            policy = deepseek.FP32_POLICY if name == "fp32" else deepseek.POLICY
            val[name].append(validation(run.model, fp8jax.Policy.from_string(policy), batches))
            curves[name].append(run.val)
            eval_steps = [s + 1 for s in run.val_steps]
            line = f"seed {seed} {name}: validation loss {val[name][-1]:.4f}"
            if not args.all_dense:
                line += f"; {balance_summary(run)}"
            if args.cross_eval:
                h, f = cross_evaluations(run, fp8jax.Policy.from_string(policy), batches)
                high[name].append(h)
                fp8[name].append(f)
                line += f"; its weights with a high-precision forward {h:.4f}, FP8 forward {f:.4f}"
            print(line, flush=True)
    print()
    print(
        f"As trained (each run's validation loss in its own precision, {args.val_batches} "
        f"batches of {train_args.batch} x {train_args.context} bytes, the same for every run):"
    )
    print(vs_table(val))
    print()
    print(
        "During training (the job's 8 validation batches of each seed, every 50 steps): each "
        "run's validation loss against BF16's of the same seed, mean over seeds (%):"
    )
    print(curve_table(curves, eval_steps))
    if args.cross_eval:
        print()
        print("The same weights, every run evaluated with a high-precision forward:")
        print(vs_table(high))
        print()
        print("The same weights, every run evaluated with V3's FP8 forward (emulated):")
        print(vs_table(fp8))


def balance_summary(run: deepseek.Run) -> str:
    """The balancing biases a run ended with (per MoE layer, largest minus smallest) and its
    last steps' load imbalance as routed and as the affinities alone route (`imbalance`)."""
    from fp8jax.examples.deepseek_model import moe_layers

    spread = [float(jnp.ptp(m.balance.bias)) for m in moe_layers(run.model)]
    return (
        f"bias spread {', '.join(f'{x:.2f}' for x in spread)}; max/mean load routed "
        f"{deepseek.imbalance(run.routed):.2f}, unbiased {deepseek.imbalance(run.unbiased):.2f}"
    )


def vs_table(val: dict[str, list[float]]) -> str:
    """Each run's final validation loss against BF16's and float32's of the same seed, in %:
    per seed, mean and standard deviation over seeds."""
    bf16, fp32 = np.array(val["bf16"]), np.array(val["fp32"])
    lines = [
        "| run | vs BF16 per seed (%) | mean | std | vs float32 per seed (%) | mean | std |",
        "|---|---|---|---|---|---|---|",
    ]
    std = lambda a: f"{np.std(a, ddof=1):.2f}" if len(a) > 1 else "-"  # noqa: E731
    for name, v in val.items():
        if name == "bf16":
            continue
        v = np.array(v)
        a, b = 100 * (v - bf16) / bf16, 100 * (v - fp32) / fp32
        lines.append(
            f"| {name} | {', '.join(f'{x:+.2f}' for x in a)} | {np.mean(a):+.2f} | {std(a)} | "
            f"{', '.join(f'{x:+.2f}' for x in b)} | {np.mean(b):+.2f} | {std(b)} |"
        )
    return "\n".join(lines)


def curve_table(curves: dict[str, list[list[float]]], steps: list[int]) -> str:
    """Each run's validation loss against BF16's of the same seed at each evaluated step, in %,
    mean over seeds: when the gap opens."""
    bf16 = np.array(curves["bf16"])
    lines = ["| run | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines.append("|---|" + "---|" * len(steps))
    for name, c in curves.items():
        if name != "bf16":
            g = np.mean(100 * (np.array(c) - bf16) / bf16, axis=0)
            lines.append(f"| {name} | " + " | ".join(f"{x:+.2f}" for x in g) + " |")
    return "\n".join(lines)


def run_tiles(args: argparse.Namespace) -> None:
    """The `tiles` command: the relative RMS error of 1 x 128 E4M3 tiles on synthetic data,
    exact against power-of-two scales (where a tile's largest value lands in the format)."""
    rng = np.random.default_rng(0)
    data = {
        "normal": rng.standard_normal((4096, 256)),
        "Student t, 3 degrees (heavy tails)": rng.standard_t(3, (4096, 256)),
        "uniform": rng.uniform(-1, 1, (4096, 256)),
    }
    print("Relative RMS error of 1 x 128 E4M3 tiles (BF16 values, 4096 x 256):")
    print("| data | 448 / amax | power of two |")
    print("|---|---|---|")
    for name, x in data.items():
        x = jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
        err = [float(jnp.sqrt(jnp.mean((rows(x, p) - x) ** 2) / jnp.mean(x**2))) for p in (0, 1)]
        print(f"| {name} | {100 * err[0]:.2f} % | {100 * err[1]:.2f} % |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    grads = sub.add_parser("gradients", help="the gradient's error per pass and group")
    grads.add_argument("--steps", type=int, default=100)
    grads.add_argument("--batches", type=int, default=8)
    grads.add_argument("--variants", type=lambda s: s.split(","), default=None)
    sub.add_parser("tiles", help="E4M3 tile error, exact against power-of-two scales")
    routing = sub.add_parser("routing", help="routings the FP8 forward changes")
    routing.add_argument("--steps", type=int, default=100)
    routing.add_argument("--batches", type=int, default=16)
    routing.add_argument("--variants", type=lambda s: s.split(","), default=None)
    remat = sub.add_parser("remat", help="routes the backward's recomputation changes")
    remat.add_argument("--steps", type=int, default=100)
    remat.add_argument("--batches", type=int, default=4)
    train = sub.add_parser("train", help="train variants over seeds against BF16 and float32")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    train.add_argument("--variants", type=lambda s: s.split(","), default=["fp8", "fp8-pow2"])
    train.add_argument("--val-batches", type=int, default=64)
    train.add_argument("--width", type=int, default=128, help="the model's width (128)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    train.add_argument(
        "--balance-speed", type=float, default=1e-2, help="the balancing bias's step (1e-2)"
    )
    train.add_argument(
        "--all-dense", action="store_true", help="every block's FFN dense (no MoE, no router)"
    )
    train.add_argument(
        "--cross-eval",
        action="store_true",
        help="also evaluate every run's weights with a high-precision and an FP8 forward",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if getattr(args, "variants", None):
        unknown = [v for v in args.variants if v not in VARIANTS and v not in LIBRARY]
        if unknown:
            sys.exit(f"--variants: unknown {unknown}; choose among {list(VARIANTS)}")
    if args.command == "gradients":
        run_gradients(args)
    elif args.command == "tiles":
        run_tiles(args)
    elif args.command == "routing":
        run_routing(args)
    elif args.command == "remat":
        run_remat(args)
    else:
        run_train(args)


if __name__ == "__main__":
    main()

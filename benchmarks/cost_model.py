"""An estimate of the FP8/BF16 train-step time of GPT models on an H100, from compiled HLO.

    python benchmarks/cost_model.py [--models 1B,8B,70B-block] [--variants bf16,delayed,...]
        [--attention compiled,flash] | tee benchmarks/results/cost_model.txt
    python benchmarks/cost_model.py --sharded 8B,70B-block,70B-block-fsdp64
        [--variants bf16,delayed,...] | tee benchmarks/results/cost_model_sharded.txt

What it measures: each train step (peers.py's: BF16 compute through `to_bf16`, plain SGD on
float32 masters) is compiled for an H100 without a GPU (cuBLAS mode: Triton GEMMs off, so every
GEMM is a cuBLAS call and an FP8 one is `__cublas$lt$matmul$f8`), and `fp8jax.hlo_cost` reads
the optimized HLO: GEMM FLOPs per precision, and the HBM bytes of every other kernel, per
category (quantize, amax, block partials, transpose/copy, rest), loops multiplied by their
trip counts. Step time = GEMM FLOPs at the H100 SXM dense peak of their precision (FP8 1979,
BF16 989 TFLOP/s) + non-GEMM bytes at 3.35 TB/s, with no overlap, no launch overhead and peak
efficiency everywhere.

This is an ESTIMATE, not a measurement: nothing runs on a GPU. Real kernels reach 60-80 % of
the GEMM peak and overlap little of the memory-bound work, so the ratios say which way FP8
moves the step and by about how much, not the wall time.

Models (all `scan_layers=True`, so one block is compiled and the loop's trip count counts it):

- `1B`: `fp8jax.examples.gpt` with peers.py's `estimate()` shape: 24 layers, width 2048, 16
  heads, context 2048, batch 4 (8,192 tokens), vocab 50304; GELU MLP of 4 x width.
- `8B`: Llama-3-8B-like: the example GPT's embeddings, LayerNorms, multi-head attention (32
  heads of 128; Llama's grouped-query K/V projections would be 4x smaller) and head, with a
  SwiGLU MLP of 14336 (`gate_proj`, `up_proj`, `down_proj`, no biases), 32 layers, vocab
  128256, context 4096 x batch 2 = 8,192 tokens.
- `70B-block`: one block at Llama-70B width: width 8192, 64 heads, SwiGLU 28672, context 4096
  x batch 2 = 8,192 tokens. The block alone: its input is a BF16 activation whose gradient is
  computed (as inside a stack), its loss the mean square of its output (one extra read of the
  output and one write of its gradient, the same for every variant); no embeddings, no head.

Attention, two columns:

- `as compiled`: the example's attention as XLA compiles it: scores, causal mask and softmax
  materialized (float32 scores; cuDNN flash attention does not compile without a GPU).
- `flash (analytic)`: the attention core (scores, softmax, weighted sum) replaced by a
  stand-in `o = q * k + v` with the same shapes and gradients, compiled; then flash attention
  added by formula, per layer, B batch, H heads, S context, D head width:
  FLOPs forward 4 B H S^2 D / 2 (causal), backward 2.5 x forward (FlashAttention-2: five
  matmuls to two), at the BF16 peak; bytes forward Q, K, V read, O written, logsumexp (float32,
  B H S) written; backward Q, K, V, O, dO and logsumexp read, dQ, dK, dV written (BF16).
  The stand-in's own kernels (at most Q, K, V read and O written forward; dO, Q, K read and
  dQ, dK, dV written backward) stay in the count too, so this column slightly overstates the
  non-GEMM bytes of every variant alike; the bytes of kernels named after the stand-in are
  printed under each table.

XLA's rematerialization pass is turned off (`xla_disable_hlo_passes=rematerialization`): the 8B
step cannot fit one H100 (its float32 masters and their updated copies alone are 70 GB; the
naive attention's saved scores push the 1B step near 80 GB too), and XLA then recomputes parts
of the backward without reaching its limit, adding up to 300 GB of traffic to the 8B BF16 step
and less to the FP8 ones. With the pass off, each step costs what it computes: the per-GPU
work of a run sharded to fit (collectives not counted).

Variants: `bf16` (no FP8) and `fp8jax <recipe>` for delayed, current, blockwise, mxfp8 and
residual, made by peers.py's `variant` (`fp8jax.fp8_linear_layers`, default targets: every
attention and MLP Linear, not the head). A compile for an H100 runs blockwise GEMMs as
fp8jax's native Mosaic GPU kernel, counted at a published block-scaled FP8 GEMM throughput
(`fp8jax._src.observe.roofline.H100["fp8 block"]`, 1,234 TFLOP/s); `blockwise-xla` is the same
recipe on its XLA path (`native_kernel=False`). The `residual` rows fuse the terms that share
a left operand in one kernel (`native_kernel=None`), every GEMM with its E4M3 gradients;
`residual-xla` is the recipe's default, its XLA path (two cuBLASLt FP8 calls per term pair,
summed in float32).

Sharded runs (`--sharded`, per GPU, flash attention (analytic) only): the step compiled for a
deviceless mesh of H100s (`fp8jax.h100_mesh`; more than 8 GPUs are nodes of 8), every
Linear's and Embedding's weight (float32 master) sharded on its input axis over the FSDP axis,
biases, norms and FP8 state replicated, the tokens sharded over every mesh axis with the
single-GPU batch on each GPU. The batch is mapped with `jax.vmap(spmd_axis_name=...)` and the
benchmark's own modules (SwiGLU, the attention stand-in) pin each sequence's activations to
its GPU (`per_sequence`): without that, XLA's partitioner shards activations over the weights'
axis and moves whole activations instead of weights. XLA then gathers each weight where it is
used (once in the forward pass, again for the dgrad inside the layer scan) and reduce-scatters
its gradient. `fp8jax.hlo_cost` counts each collective's bytes per GPU by the ring model over
NVLink (450 GB/s each way, within a node) or InfiniBand (50 GB/s per GPU, across nodes), peak
link rates. Columns: all-gather bytes split into FP8 arrays and the rest (BF16 weights, the
head), so that gathering FP8 weights once per step rather than twice shows; the step with no
overlap (compute + communication) and with collectives wholly overlapped (the larger).

- `8B`: FSDP over one node of 8 (`{"data": 8}`), 16 x 4096 tokens in all.
- `70B-block`: 64 GPUs, 8 nodes, `{"data": 8, "fsdp": 8}`: FSDP within each node and data
  parallel across nodes (hybrid sharding), so that the per-layer gathers and scatters stay on
  NVLink and only the 1/8 gradient shards are all-reduced over InfiniBand; 128 x 4096 tokens.
- `70B-block-fsdp64`: the same block with FSDP over all 64 (`{"fsdp": 64}`): every gather and
  scatter crosses InfiniBand. The comparison is why the 64-GPU run above is hybrid.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_steps import GPT_SHAPES, RECIPES, block_step, table, train_step, variant  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax._src.observe.cost import hlo_cost  # noqa: E402
from fp8jax._src.observe.roofline import (  # noqa: E402
    CATEGORIES,
    GPUS_PER_NODE,
    H100,
    LINKS,
    Cost,
)
from fp8jax.examples.gpt import GPT, Attention, Block, GPTConfig, dense, next_token_loss  # noqa: E402

# Blockwise on its XLA path, beside the native kernel that a compile for an H100 takes by
# default (added to train_steps.RECIPES, which `variant` reads, in this process
# only); the residual recipe on its XLA path (its default), beside its fused kernel.
RECIPES["blockwise-xla"] = fp8jax.BlockwiseScaling(native_kernel=False)
RECIPES["residual-xla"] = fp8jax.ResidualFP8(native_kernel=False)
# Sharded runs only: the same recipes with the weight gathered again for the dgrad
# (`weight_gather="per_gemm"`, the memory-saving mode) beside the default gather-once.
PER_GEMM = {
    f"{name}-per-gemm": dataclasses.replace(RECIPES[name], weight_gather="per_gemm")
    for name in ("delayed", "blockwise", "residual")
}
RECIPES.update(PER_GEMM)

STAND_IN = "attention_stand_in"
#: `--attention`'s values: the attention as compiled, or flash attention added by formula.
ATTENTIONS = ("compiled", "flash")
# The mesh of a sharded run, while one is built (see `sharded_activations`): the benchmark's
# own modules then keep their activations whole per sequence, each GPU holding its sequences.
_MESH: list = []
# cuBLAS mode, without XLA's rematerialization (see the module docstring).
OPTIONS = {**deviceless.MODES["cublas"], "xla_disable_hlo_passes": "rematerialization"}


# --- models -------------------------------------------------------------------------------


class SwiGLU(eqx.Module):
    """Llama's MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases. (`gate_proj`, not
    `gate`: fp8jax's default exclusion keeps Linears named `gate`, MoE routers, in BF16.)"""

    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, *, key):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = eqx.nn.Linear(width, hidden, use_bias=False, key=kg)
        self.up_proj = eqx.nn.Linear(width, hidden, use_bias=False, key=ku)
        self.down_proj = eqx.nn.Linear(hidden, width, use_bias=False, key=kd)

    def __call__(self, x):
        x = per_sequence(x)
        hidden = per_sequence(jax.nn.silu(dense(self.gate_proj, x)) * dense(self.up_proj, x))
        return per_sequence(dense(self.down_proj, hidden))


class StandInAttention(eqx.Module):
    """The example's attention with its core (scores, softmax, mix) replaced by `q * k + v`:
    the same Linears, shapes and gradient paths, for flash attention to be added by formula."""

    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __call__(self, x):
        x = per_sequence(x)
        q, k, v = (per_sequence(dense(proj, x)) for proj in (self.query, self.key, self.value))
        with jax.named_scope(STAND_IN):
            # q * k, not q + k: XLA would fold the sum's dgrad into one GEMM on the summed
            # weights, dropping two of the three dgrad GEMMs that real attention has.
            mixed = q * k + v
        return per_sequence(dense(self.out, mixed))


def per_sequence(x):
    """`x`, one sequence's activation, whole on the GPU that holds the sequence (in a sharded
    run, under `jax.vmap(..., spmd_axis_name=...)` over the batch; as it is otherwise).
    Without it XLA's partitioner may shard activations over the weights' axis and gather
    whole activations (gigabytes) instead of weights."""
    if not _MESH:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(_MESH[0], P()))


def stand_in(model):
    """`model` with every `Attention` replaced by a `StandInAttention` of the same Linears."""

    def swap(node):
        if isinstance(node, Attention):
            return StandInAttention(node.query, node.key, node.value, node.out, node.heads)
        return node

    return jax.tree.map(swap, model, is_leaf=lambda x: isinstance(x, Attention))


def llama_block(config: GPTConfig, ffn: int, key):
    block = Block(dataclasses.replace(config, mlp_ratio=1), key=key)  # MLP replaced below
    return eqx.tree_at(lambda b: b.mlp, block, SwiGLU(config.width, ffn, key=key))


def llama(config: GPTConfig, ffn: int, key):
    """The example GPT with SwiGLU blocks (stacked for `scan_layers`)."""
    model = GPT(dataclasses.replace(config, layers=1), key=key)  # blocks replaced below
    keys = jax.random.split(key, config.layers)
    blocks = eqx.filter_vmap(lambda k: llama_block(config, ffn, k))(keys)
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


MODELS = GPT_SHAPES


def build(shape: dict, name: str, flash: bool):
    """(step, abstract arguments) of model `shape` in variant `name`."""
    config = GPTConfig(
        vocab=shape["vocab"] or 2,
        layers=shape["layers"],
        width=shape["width"],
        heads=shape["heads"],
        context=shape["context"],
        scan_layers=True,
    )
    key = jax.random.PRNGKey(0)
    batch, context = shape["batch"], shape["context"]

    def make():
        if shape["vocab"] is None:
            model = llama_block(config, shape["ffn"], key)
        elif shape["ffn"] is None:
            model = GPT(config, key=key)
        else:
            model = llama(config, shape["ffn"], key)
        return variant(stand_in(model) if flash else model, name)

    model = eqx.filter_eval_shape(make)
    if shape["vocab"] is None:
        x = jax.ShapeDtypeStruct((batch, context, shape["width"]), jnp.bfloat16)
        return block_step(), (model, x)
    tokens = jax.ShapeDtypeStruct((batch, context + 1), jnp.int32)
    return train_step(next_token_loss), (model, tokens)


def flash_cost(shape: dict) -> Cost:
    """Flash attention of every layer, by formula (see the module docstring)."""
    b, s, h = shape["batch"], shape["context"], shape["heads"]
    d = shape["width"] // h
    forward = 4 * b * h * s * s * d // 2  # causal: half the score matrix
    flops = forward + 5 * forward // 2
    tensor = b * s * h * d * 2  # one of Q, K, V, O, dO, dQ, ... in BF16
    lse = b * h * s * 4
    forward_bytes = 4 * tensor + lse  # Q, K, V read; O, logsumexp written
    backward_bytes = 5 * tensor + lse + 3 * tensor  # Q, K, V, O, dO, lse read; dQ, dK, dV
    return shape["layers"] * Cost({"bf16": flops}, {"rest": forward_bytes + backward_bytes})


# --- sharded: FSDP ------------------------------------------------------------------------

#: The sharded runs: model, mesh, the mesh axis the weights are sharded over. Tokens are
#: sharded over every axis, each GPU holding the single-GPU run's batch (the global batch is
#: that times the GPUs).
SHARDED = {
    # FSDP over one node: every weight gathered and its gradient scattered over NVLink.
    "8B": ("8B", {"data": 8}, "data"),
    # Hybrid sharding, 8 nodes of 8: FSDP within each node (the per-layer weight gathers and
    # gradient scatters stay on NVLink), data parallel across nodes (only the gradient of
    # each GPU's 1/8 shard is all-reduced over InfiniBand).
    "70B-block": ("70B-block", {"data": 8, "fsdp": 8}, "fsdp"),
    # Plain FSDP over all 64: every gather and scatter crosses InfiniBand (for comparison).
    "70B-block-fsdp64": ("70B-block", {"fsdp": 64}, "fsdp"),
}
_WEIGHTED = (eqx.nn.Linear, eqx.nn.Embedding, fp8jax.Linear)


def fsdp(model, mesh, axis: str):
    """`model` (abstract) with every Linear's and Embedding's weight sharded on its last
    (input) axis over `axis`; the rest (biases, norms, FP8 state) stays replicated."""

    def place(node):
        if not isinstance(node, _WEIGHTED):
            return node
        w = node.weight
        spec = P(*[None] * (w.ndim - 1), axis)
        sharded = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, spec))
        return eqx.tree_at(lambda n: n.weight, node, sharded)

    return jax.tree.map(place, model, is_leaf=lambda x: isinstance(x, _WEIGHTED))


def sharded_step(shape: dict, axes: tuple[str, ...]):
    """The train step of `shape` with its batch mapped by `jax.vmap(spmd_axis_name=axes)`: a
    sequence's activations stay on the GPU of its batch shard (`per_sequence`)."""
    if shape["vocab"] is None:
        return block_step(
            lambda block, x: jnp.mean(
                jax.vmap(block, spmd_axis_name=axes)(x.astype(jnp.bfloat16)).astype(jnp.float32)
                ** 2
            )
        )

    def loss(model, tokens):
        logits = jax.vmap(model, spmd_axis_name=axes)(tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return train_step(loss)


def compile_sharded(run: str, name: str) -> tuple[Cost, float, int]:
    """The per-GPU cost of model `run`'s step, variant `name`, sharded as `SHARDED[run]`
    says (flash attention's stand-in compiled; flash's own cost added by the caller), the
    compile's seconds, and the bytes each GPU sends to gather every weight of its fp8jax
    layers once in FP8 (0 for BF16)."""
    model_name, axes, axis = SHARDED[run]
    mesh = fp8jax.h100_mesh(axes)
    shape = MODELS[model_name]
    _, (model, data) = build(dict(shape, batch=shape["batch"] * mesh.size), name, True)
    model = fsdp(model, mesh, axis)
    layers = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, fp8jax.Linear))
    elements = sum(math.prod(x.weight.shape) for x in layers if isinstance(x, fp8jax.Linear))
    once = elements * (axes[axis] - 1) // axes[axis]
    batch = NamedSharding(mesh, P(tuple(axes)))
    data = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=batch)
    step = sharded_step(shape, tuple(axes))
    start = time.perf_counter()
    _MESH.append(mesh)
    try:
        lowered, _ = deviceless.lower(
            step, (model, data), {}, deviceless.h100_topology().devices[0]
        )
    finally:
        _MESH.clear()
    cost = hlo_cost(lowered.compile(compiler_options=OPTIONS).as_text())
    if cost.unknown_trip_counts:
        print(f"  (loops counted once: {cost.unknown_trip_counts})", file=sys.stderr)
    return cost, time.perf_counter() - start, once


def gathered(cost: Cost) -> tuple[int, int]:
    """All-gather bytes each GPU sends: (of FP8 arrays, of the others)."""
    fp8 = sum(
        c.wire_bytes * c.runs
        for c in cost.collectives
        if c.op == "all-gather" and c.dtype.startswith("f8")
    )
    return fp8, cost.communication.get("all-gather", 0) - fp8


def report_sharded(title: str, costs: dict[str, Cost], once: dict[str, int]) -> None:
    base = costs["bf16"]
    rows = []
    for name, cost in costs.items():
        fp8_gather, other_gather = gathered(cost)
        per_weight = f"{fp8_gather / once[name]:.2f}" if once[name] else "-"
        fp8 = cost.flops.get("fp8", 0) + cost.flops.get("fp8 block", 0)
        compute = cost.gemm_seconds() + cost.memory_seconds()
        rest = cost.communication_bytes - sum(
            cost.communication.get(op, 0) for op in ("all-gather", "reduce-scatter", "all-reduce")
        )
        rows.append(
            [
                name,
                f"{fp8 / 1e12:.1f}{' (block kernel)' if cost.flops.get('fp8 block') else ''}"
                f" / {cost.flops.get('bf16', 0) / 1e12:.1f}",
                f"{cost.total_bytes / 1e9:.1f}",
                f"{fp8_gather / 1e9:.2f} + {other_gather / 1e9:.2f}",
                per_weight,
                f"{cost.communication.get('reduce-scatter', 0) / 1e9:.2f}",
                f"{cost.communication.get('all-reduce', 0) / 1e9:.2f}",
                f"{rest / 1e9:.2f}",
                " / ".join(f"{cost.link_bytes.get(link, 0) / 1e9:.2f}" for link in LINKS),
                f"{cost.communication_seconds() * 1e3:.1f}",
                f"{compute * 1e3:.1f}",
                f"{cost.estimate_seconds() * 1e3:.1f}",
                f"{cost.estimate_seconds(overlap=True) * 1e3:.1f}",
                f"{cost.estimate_seconds() / base.estimate_seconds():.2f} / "
                f"{cost.estimate_seconds(overlap=True) / base.estimate_seconds(overlap=True):.2f}",
            ]
        )
    header = [
        "variant",
        "FP8 / BF16 TFLOP",
        "non-GEMM GB",
        "all-gather GB (FP8 + other)",
        "FP8 gathers per weight",
        "reduce-scatter GB",
        "all-reduce GB",
        "other coll. GB",
        "NVLink / IB GB",
        "comm. ms (est.)",
        "compute ms",
        "step ms, no overlap",
        "step ms, overlapped",
        "x BF16 (no overlap / overlapped)",
    ]
    print(f"\n### {title}\n")
    print(table(rows, header))


def main_sharded(runs: list[str], names: list[str]) -> None:
    print(
        f"# Cost model, sharded: estimated per-GPU H100 step time and communication from "
        f"compiled HLO (jax {jax.__version__}; an ESTIMATE, not a measurement)"
    )
    print(
        f"\nPeaks: FP8 {H100['fp8'] / 1e12:.0f}, BF16 {H100['bf16'] / 1e12:.0f} TFLOP/s, HBM "
        f"{H100['hbm'] / 1e12:.2f} TB/s; links one way per GPU: NVLink {H100['nvlink'] / 1e9:.0f} "
        f"GB/s, InfiniBand {H100['infiniband'] / 1e9:.0f} GB/s (peak rates). Bytes in GB (1e9) "
        "per GPU per train step; collectives: the bytes each GPU sends, ring model. Flash "
        "attention (analytic); cuBLAS GEMMs, XLA rematerialization off. `compute` = GEMMs at "
        "peak + non-GEMM bytes at HBM peak; `no overlap` = compute + communication; "
        "`overlapped` = max(compute, communication)."
    )
    for run in runs:
        model_name, axes, axis = SHARDED[run]
        shape = MODELS[model_name]
        devices = math.prod(axes.values())
        nodes = max(1, devices // GPUS_PER_NODE)
        print(
            f"\n## {run}: the {model_name} model on {devices} H100s ({nodes} node(s) of "
            f"{min(devices, GPUS_PER_NODE)}), mesh {axes}, weights sharded over {axis!r}, "
            f"tokens over {tuple(axes)}: {shape['batch']} x {shape['context']} tokens per GPU"
        )
        costs, once = {}, {}
        for name in names:
            print(f"  ... {run} {name}", file=sys.stderr, flush=True)
            cost, seconds, once[name] = compile_sharded(run, name)
            print(f"      compiled in {seconds:.0f} s", file=sys.stderr, flush=True)
            costs[name] = cost + flash_cost(shape)
        report_sharded(f"{run}, per GPU", costs, once)


# --- report -------------------------------------------------------------------------------


def compile_cost(shape: dict, name: str, flash: bool) -> tuple[Cost, float]:
    step, args = build(shape, name, flash)
    topology = deviceless.h100_topology()
    start = time.perf_counter()
    lowered, _ = deviceless.lower(step, args, {}, topology.devices[0])
    text = lowered.compile(compiler_options=OPTIONS).as_text()
    cost = hlo_cost(text)
    if cost.unknown_trip_counts:
        print(f"  (loops counted once: {cost.unknown_trip_counts})", file=sys.stderr)
    if any(".remat" in k.name for k in cost.kernels):
        print("  (XLA rematerialized some kernels, counted here)", file=sys.stderr)
    return cost, time.perf_counter() - start


def report(title: str, shape: dict, costs: dict[str, Cost], stand_in_bytes: dict) -> None:
    base = costs["bf16"]
    rows = []
    for name, cost in costs.items():
        gemm_s, memory_s = cost.gemm_seconds(), cost.memory_seconds()
        other = {k: v for k, v in cost.flops.items() if k not in ("fp8", "fp8 block", "bf16")}
        fp8 = cost.flops.get("fp8", 0) + cost.flops.get("fp8 block", 0)
        block = " (block kernel)" if cost.flops.get("fp8 block") else ""
        rows.append(
            [
                name,
                f"{fp8 / 1e12:.1f}{block}",
                f"{cost.flops.get('bf16', 0) / 1e12:.1f}"
                + "".join(f" +{v / 1e12:.2f} {k}" for k, v in other.items()),
                *(f"{cost.bytes.get(c, 0) / 1e9:.1f}" for c in CATEGORIES),
                f"{cost.total_bytes / 1e9:.1f} ({cost.total_bytes / base.total_bytes:.2f}x)",
                f"{gemm_s * 1e3:.1f} + {memory_s * 1e3:.1f}",
                f"{(gemm_s + memory_s) * 1e3:.1f}",
                f"{cost.estimate_seconds() / base.estimate_seconds():.2f}",
            ]
        )
    header = [
        "variant",
        "FP8 TFLOP",
        "BF16 TFLOP",
        *(f"{c} GB" for c in CATEGORIES),
        "non-GEMM GB (x BF16)",
        "GEMM + other ms",
        "est. step ms",
        "est. x BF16",
    ]
    print(f"\n### {title}\n")
    print(table(rows, header))
    if stand_in_bytes:
        most = max(stand_in_bytes.values())
        print(
            f"\n(kernels named after the stand-in core: at most {most / 1e9:.2f} GB per step, "
            "counted in the table besides flash's own bytes)"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated, among bf16 and the recipes (default: all; the *-per-gemm ones "
        "with --sharded only, where they differ)",
    )
    parser.add_argument(
        "--attention", default="compiled,flash", help=f"comma-separated, among {ATTENTIONS}"
    )
    parser.add_argument(
        "--sharded",
        default=None,
        help=f"comma-separated sharded runs among {list(SHARDED)} (instead of --models)",
    )
    args = parser.parse_args(argv)
    models = args.models.split(",")
    variants = args.variants or ",".join(
        ["bf16", *(r for r in RECIPES if args.sharded or r not in PER_GEMM)]
    )
    names = [n if n == "bf16" else f"fp8jax {n}" for n in variants.split(",")]
    attentions = args.attention.split(",")
    for a in attentions:
        if a not in ATTENTIONS:
            parser.error(f"--attention: unknown {a!r}; choose among {', '.join(ATTENTIONS)}")
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown model {m!r}; choose among {sorted(MODELS)}")
    for n in names:
        if n != "bf16" and n.split()[1] not in RECIPES:
            parser.error(f"--variants: unknown variant {n!r}; choose among bf16, {list(RECIPES)}")
    if "bf16" not in names:
        names.insert(0, "bf16")  # the baseline of every ratio
    if deviceless.h100_topology() is None:
        sys.exit("needs the h100 extra (jax-cuda12-plugin, jax-cuda12-pjrt): pip install '.[h100]'")
    if args.sharded:
        runs = args.sharded.split(",")
        for r in runs:
            if r not in SHARDED:
                parser.error(f"--sharded: unknown run {r!r}; choose among {list(SHARDED)}")
        return main_sharded(runs, names)
    print(
        f"# Cost model: estimated H100 step time from compiled HLO (jax {jax.__version__}; "
        "an ESTIMATE, not a measurement)"
    )
    print(
        f"\nPeaks: FP8 {H100['fp8'] / 1e12:.0f}, BF16 {H100['bf16'] / 1e12:.0f} TFLOP/s, HBM "
        f"{H100['hbm'] / 1e12:.2f} TB/s; no overlap. Bytes in GB (1e9), per train step. "
        "cuBLAS GEMMs, XLA rematerialization off."
    )
    summary = []
    for model in models:
        shape = MODELS[model]
        tokens = shape["batch"] * shape["context"]
        print(
            f"\n## {model}: width {shape['width']}, {shape['heads']} heads, "
            f"{shape['layers']} layer(s), MLP {shape['ffn'] or 4 * shape['width']}"
            f"{' SwiGLU' if shape['ffn'] else ' GELU'}, {shape['batch']} x {shape['context']} = "
            f"{tokens} tokens, vocab {shape['vocab'] or '- (block only)'}"
        )
        ratios = {}
        for attention in attentions:
            flash = attention == "flash"
            costs, stand_in_bytes = {}, {}
            for name in names:
                print(f"  ... {model} {attention} {name}", file=sys.stderr, flush=True)
                cost, seconds = compile_cost(shape, name, flash)
                print(f"      compiled in {seconds:.0f} s", file=sys.stderr, flush=True)
                if flash:
                    stand_in_bytes[name] = sum(
                        k.bytes * k.runs for k in cost.kernels if STAND_IN in k.op_name
                    )
                    cost = cost + flash_cost(shape)
                costs[name] = cost
            title = "attention as compiled" if not flash else "flash attention (analytic)"
            report(f"{model}, {title}", shape, costs, stand_in_bytes)
            base = costs["bf16"]
            for name, cost in costs.items():
                ratios.setdefault(name, {})[attention] = (
                    cost.estimate_seconds() / base.estimate_seconds(),
                    cost.total_bytes / base.total_bytes,
                )
        for name, by in ratios.items():
            summary.append(
                [model, name]
                + [
                    f"{by[a][0]:.2f} (non-GEMM {by[a][1]:.2f}x)" if a in by else "-"
                    for a in ATTENTIONS
                ]
            )
    print("\n## Summary: estimated step time, FP8 / BF16 (an estimate)\n")
    print(table(summary, ["model", "variant", "attention as compiled", "flash attention"]))


if __name__ == "__main__":
    main()

"""An estimate of an MoE layer's train step on an H100: XLA's ragged dots against fp8jax's
grouped FP8 kernels, from compiled HLO.

    python benchmarks/moe_cost.py [--shapes mixtral,fine] | tee benchmarks/results/moe_cost.txt
    python benchmarks/moe_cost.py --expert-parallel | tee benchmarks/results/moe_cost_ep.txt
    python benchmarks/moe_cost.py --shapes mixtral --microbatches 4 [--unroll]

What it measures: one mixture-of-experts MLP (`fp8jax.examples.moe_model.MoE`: a router, top-k
routing with sorted tokens, two grouped GEMMs `up` and `down` with a GELU between), its
forward and backward on BF16 parameters and a BF16 input, compiled for an H100 without a GPU
(cuBLAS mode, as `cost_model.py`). `fp8jax.hlo_cost` reads the optimized HLO: GEMM FLOPs per
precision (fp8jax's kernels by their padded shapes: an upper bound of their work) and the
HBM bytes of every other kernel. Step time = GEMM FLOPs at the H100 SXM dense peak of their
kind (FP8 1,979, BF16 989 TFLOP/s; fp8jax's block-promoted kernels at a published 1,234) +
non-GEMM bytes at 3.35 TB/s, no overlap. Temp memory is XLA's buffer assignment; kernels
are the step's kernel launches (a loop's body counted once per trip).

This is an ESTIMATE, not a measurement: nothing runs on a GPU, and the kernels have never
been timed. The FLOP counts are exact for what each program asks the hardware to compute.

Shapes (one GPU's share of a layer, 8,192 tokens):

- `mixtral`: Mixtral-8x7B-like: width 4096, 8 experts of hidden 14336, top-2.
- `fine`: fine-grained (DeepSeek-like): width 2048, 64 experts of hidden 1408, top-6.

Variants: `bf16` (`lax.ragged_dot`, which XLA expands into a dense GEMM over all experts),
`bf16, JAX grouped kernels` (the yardstick of issue 39: the experts' GEMMs on JAX's own Pallas
Mosaic GPU kernels, `ragged_dot_mgpu` and `transposed_ragged_dot_mgpu`, behind a custom VJP,
`JaxGroupedBF16`; `hlo_cost` cannot read those opaque calls, so they count as BF16 GEMMs of
the experts' own FLOPs each, `as_gemms`), and FP8 on XLA's path
(`grouped_native_kernel=False`) or fp8jax's kernels: delayed scaling (E5M2 gradients: dgrad
and wgrad run in the kernels on BF16 upcasts), delayed with `backward_format="e4m3"`, and
blockwise, on the Pallas Triton quantization kernels (the default) and inside
`choice.tensor_core_quantization()` (the weights' blocks, the activations' tiles, the
output gradient's two copies and, since session 54, the saved activation's gathered copy on
the Mosaic GPU kernels, `kernels/tensor_core_blocks.py` and `tensor_core_gathered.py`).

Expert parallel (`--expert-parallel`): the same layer with its experts split over 8 H100s
(one node: the exchanges on NVLink) and over 16 (two nodes: every exchange counted at
InfiniBand's rate, pessimistic, since part of it stays in a node), 8,192 tokens per GPU,
`fp8jax.examples.moe_model.MoE(expert_axis="expert")` inside `shard_map`: each GPU routes
its tokens, `fp8jax.expert_exchange` sends them to their experts' GPUs with
`ragged_all_to_all` and back. Each GPU's buffer holds 1.25x its balanced share of rows
(`capacity`: a capacity factor of 1.25; the kernels' work and the cost model follow the
buffer, so the default worst case, every token on one GPU, would count 8-16x the GEMMs).
A ragged all-to-all is counted as the smaller of its rows to send and its buffer, of which
`(n-1)/n` leave the GPU (uniform routing: an estimate; real routing is uneven). Variants:
BF16 (`lax.ragged_dot` over each GPU's experts, BF16 exchanges), and FP8 dispatch with
fp8jax's grouped kernels (delayed scaling with E4M3 gradients; blockwise; blockwise with the
backward's exchanges in FP8 too, `fp8_backward=True`). Columns: the exchanges' bytes per
GPU by dtype, their time at the link's peak, and the step with no overlap (compute +
communication) and wholly overlapped (the larger). XLA expands the BF16 `ragged_dot` into a
dense GEMM over each GPU's experts (8 local experts: 8x the FLOPs), so a row `bf16 grouped
(analytic GEMMs)` gives the yardstick a BF16 grouped kernel would approach: the experts' own
FLOPs at the BF16 peak, the BF16 program's other bytes and exchanges; the last column
compares with it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, Int  # noqa: E402
from train_steps import table, to_bf16  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.kernels import QUANTIZE_NAMES, TENSOR_CORE_BLOCKS_NAME  # noqa: E402
from fp8jax._src.kernels.choice import tensor_core_quantization  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax._src.observe.cost import hlo_cost  # noqa: E402
from fp8jax._src.observe.roofline import H100, LINKS, Cost  # noqa: E402
from fp8jax.examples.moe_model import MoE  # noqa: E402

SHAPES = {
    "mixtral": {"tokens": 8192, "width": 4096, "hidden": 14336, "experts": 8, "top_k": 2},
    "fine": {"tokens": 8192, "width": 2048, "hidden": 1408, "experts": 64, "top_k": 6},
}
#: BF16 with the experts' GEMMs on JAX's own grouped kernels (`with_jax_kernels`).
JAX_VARIANT = "bf16, JAX grouped kernels"
#: Blockwise with its quantization on the Mosaic GPU kernels (traced inside
#: `choice.tensor_core_quantization()`).
TENSOR_CORE_VARIANT = "fp8 blockwise, kernels, tensor-core quantization"
#: name -> (recipe, grouped_native_kernel); `None` recipe: BF16, no conversion.
VARIANTS = {
    "bf16": (None, None),
    JAX_VARIANT: (None, None),
    "fp8 delayed, XLA": (fp8jax.DelayedScaling(), False),
    "fp8 delayed, kernels": (fp8jax.DelayedScaling(), None),
    "fp8 delayed e4m3, kernels": (fp8jax.DelayedScaling(backward_format="e4m3"), None),
    "fp8 blockwise, XLA": (fp8jax.BlockwiseScaling(), False),
    "fp8 blockwise, kernels": (fp8jax.BlockwiseScaling(), None),
    TENSOR_CORE_VARIANT: (fp8jax.BlockwiseScaling(), None),
}
#: CUB radix sort (the routing's argsort) asks the CUDA runtime for scratch sizes at compile
#: time, which a deviceless compile has not: XLA's own sort instead.
OPTIONS = {**deviceless.MODES["cublas"], "xla_gpu_enable_cub_radix_sort": False}


# --- BF16 on JAX's own grouped kernels: the yardstick --------------------------------------

#: JAX's kernels' configuration: (block_m, block_n, block_k, max_concurrent_steps,
#: grid_block_n); the first the GPU check's grouped section times (`gpu_check.grouped`).
JAX_CONFIG = (128, 128, 64, 4, 1)
#: The name scope of JAX's kernels in `JaxGroupedBF16`: how `as_gemms` finds them in the HLO.
JAX_KERNELS_SCOPE = "jax_grouped_bf16"


def jax_rows(config: tuple, x: Array, w: Array, sizes: Array, transpose_rhs: bool) -> Array:
    """JAX's BF16 grouped rows GEMM (`ragged_dot_mgpu`) in `config`, `w (G, K, N)` or, with
    `transpose_rhs`, `(G, N, K)`."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    bm, bn, bk, steps, grid_n = config
    with jax.named_scope(JAX_KERNELS_SCOPE):
        return ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk,
            max_concurrent_steps=steps, grid_block_n=grid_n, transpose_rhs=transpose_rhs,
        )  # fmt: skip


def jax_tokens(config: tuple, lhs: Array, rhs: Array, sizes: Array) -> Array:
    """JAX's BF16 grouped tokens GEMM (`transposed_ragged_dot_mgpu`) in `config`: each
    expert's `lhs (T, A)` rows against its `rhs (T, B)` rows, `(G, A, B)`."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    bm, bn, bk, steps, grid_n = config
    with jax.named_scope(JAX_KERNELS_SCOPE):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, rhs, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk,
            max_concurrent_steps=steps, grid_block_n=grid_n,
        )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_dot(config: tuple, x: Array, w: Array, sizes: Array) -> Array:
    return jax_rows(config, x, w, sizes, transpose_rhs=False)


def _forward(config: tuple, x: Array, w: Array, sizes: Array) -> tuple[Array, tuple]:
    return jax_rows(config, x, w, sizes, transpose_rhs=False), (x, w, sizes)


def _backward(config: tuple, residuals: tuple, g: Array) -> tuple:
    x, w, sizes = residuals
    # dgrad: g (M, N) . w[e] (K, N) over N, which the rows kernel takes as a transposed rhs;
    # wgrad: x (M, K)^T . g (M, N) over each expert's rows.
    d_x = jax_rows(config, g, w, sizes, transpose_rhs=True)
    d_w = jax_tokens(config, x, g, sizes)
    return d_x, d_w, None


_ragged_dot.defvjp(_forward, _backward)


class JaxGroupedBF16(eqx.Module):
    """`lax.ragged_dot(x, w, group_sizes)` and its gradients on JAX's BF16 grouped kernels:
    the yardstick of issue 39's MoE target, for `fp8jax.GroupedLinear(ragged_dot=...)`.

    `x (M, K)` and `w (experts, K, N)` of one dtype (BF16), `M` the sum of `group_sizes`;
    `K` and `N` multiples of the configuration's blocks (JAX's kernels raise otherwise).
    """

    config: tuple[int, int, int, int, int] = eqx.field(static=True, default=JAX_CONFIG)

    def __call__(
        self,
        x: Float[Array, "rows fan_in"],
        w: Float[Array, "experts fan_in fan_out"],
        group_sizes: Int[Array, " experts"],
    ) -> Float[Array, "rows fan_out"]:
        return _ragged_dot(self.config, x, w, jnp.asarray(group_sizes, jnp.int32))


def with_jax_kernels(model: MoE) -> MoE:
    """A BF16 `model` with its experts' GEMMs on JAX's grouped kernels (`JaxGroupedBF16`)."""
    return eqx.tree_at(
        lambda m: (m.up.ragged_dot, m.down.ragged_dot),
        model,
        (JaxGroupedBF16(), JaxGroupedBF16()),
        is_leaf=lambda v: v is None,
    )


@contextlib.contextmanager
def sms_of(device: Any) -> Iterator[None]:
    """JAX's wgrad kernel sizes its grid by `jax.devices()[0].core_count`, which a CPU process
    has not: inside, it reads `device`'s (a deviceless compile's H100: 132 SMs)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as module

    class Devices:
        def __getattr__(self, name: str) -> Any:
            return getattr(jax, name)

        @staticmethod
        def devices(*_: Any) -> list:
            return [device]

    module.jax = Devices()
    try:
        yield
    finally:
        module.jax = jax


def jax_kernels(cost: Cost) -> list:
    """The kernels of `cost` that are JAX's grouped GEMMs: the custom calls under
    `JAX_KERNELS_SCOPE` (beside them, the wrappers' own small XLA kernels: group offsets)."""
    return [k for k in cost.kernels if JAX_KERNELS_SCOPE in k.op_name and k.op == "custom-call"]


def as_gemms(cost: Cost, flops_per_run: int) -> Cost:
    """`cost` with JAX's grouped kernels (under `JAX_KERNELS_SCOPE`: opaque Mosaic GPU calls,
    which `hlo_cost` counts as non-GEMM kernels) counted as BF16 GEMMs of `flops_per_run`
    each run (the layer's six, forward, dgrad and wgrad of `up` and `down`, do the same
    work: `2 x rows x width x hidden`, their padding to tiles left out), their bytes out of
    the non-GEMM bytes."""
    ours = jax_kernels(cost)
    if not ours:
        raise ValueError(f"no kernel under {JAX_KERNELS_SCOPE!r} in the compiled step")
    moved = {}
    for k in ours:
        moved[k.category] = moved.get(k.category, 0) + k.bytes * k.runs
    flops = flops_per_run * sum(k.runs for k in ours)
    return dataclasses.replace(
        cost,
        flops={**cost.flops, "bf16": cost.flops.get("bf16", 0) + flops},
        bytes={c: b - moved.get(c, 0) for c, b in cost.bytes.items()},
    )


def make_model(shape: dict, recipe: fp8jax.Recipe | None, native: bool | None):
    """The MoE layer of `shape`, parameters in BF16: BF16 (`recipe=None`) or its experts in
    FP8 with `recipe` and `grouped_native_kernel=native`."""
    key = jax.random.PRNGKey(0)
    model = MoE(shape["width"], shape["hidden"], shape["experts"], shape["top_k"], key=key)
    if recipe is not None:
        config = fp8jax.Fp8Config(
            targets=["up", "down"], recipe=recipe, grouped_native_kernel=native
        )
        model = fp8jax.fp8_linear_layers(model, config)
    return to_bf16(model)


def moe_step(model, x):
    """Loss and gradients of the layer and of its input too, as inside a stack of layers
    (else `up`'s dgrad is dead)."""
    loss = lambda mx: jnp.mean(mx[0](mx[1]).astype(jnp.float32) ** 2)  # noqa: E731
    return fp8jax.filter_value_and_grad(loss)((model, x))


def accumulated_step(microbatches: int, unroll: bool = False):
    """The layer's loss and gradients through `fp8jax.accumulate_gradients` over
    `microbatches` slices of the tokens (a `lax.scan`, unrolled with `unroll`): the layer's
    gradients only, so `up`'s dgrad is dead here."""
    loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
    return fp8jax.accumulate_gradients(loss, microbatches, unroll=unroll)


def build(shape: dict, name: str, microbatches: int = 1, unroll: bool = False):
    x = jax.ShapeDtypeStruct((shape["tokens"], shape["width"]), jnp.bfloat16)
    model = eqx.filter_eval_shape(make_model, shape, *VARIANTS[name])
    step = moe_step if microbatches == 1 else accumulated_step(microbatches, unroll)
    if name == TENSOR_CORE_VARIANT:
        step = inside(tensor_core_quantization, step)
    return step, (with_jax_kernels(model) if name == JAX_VARIANT else model, x)


def inside(context, step):
    """`step`, traced inside `context()`."""

    def traced(*args: Any) -> Any:
        with context():
            return step(*args)

    return traced


def compile_cost(
    shape: dict, name: str, microbatches: int = 1, unroll: bool = False
) -> tuple[Cost, int, float]:
    """(cost, temp bytes, compile seconds) of variant `name`."""
    step, args = build(shape, name, microbatches, unroll)
    device = deviceless.h100_topology().devices[0]
    start = time.perf_counter()
    with sms_of(device):
        lowered, _ = deviceless.lower(step, args, {}, device)
    compiled = lowered.compile(compiler_options=OPTIONS)
    temp = compiled.memory_analysis().temp_size_in_bytes
    cost = hlo_cost(compiled.as_text())
    if name == JAX_VARIANT:
        # Each kernel run: one of the six GEMMs over one microbatch's rows.
        cost = as_gemms(cost, experts_flops(shape) // 6 // microbatches)
    return cost, temp, time.perf_counter() - start


def experts_flops(shape: dict) -> int:
    """Forward, dgrad and wgrad of both expert GEMMs, each expert on its own tokens only."""
    assignments = shape["tokens"] * shape["top_k"]
    return 3 * 2 * (2 * assignments * shape["width"] * shape["hidden"])


def weight_quantization_bytes(cost: Cost) -> int:
    """HBM bytes of the blockwise expert weights' quantization kernels (`quantize_blocks`,
    Triton's or Mosaic GPU's), every run counted."""
    names = (QUANTIZE_NAMES[3], TENSOR_CORE_BLOCKS_NAME)
    return sum(k.bytes * k.runs for k in cost.kernels if any(n in k.op_name for n in names))


def report(title: str, shape: dict, microbatches: int = 1, unroll: bool = False) -> None:
    ideal = experts_flops(shape)
    print(f"\n## {title}: {shape}")
    if microbatches > 1:
        print(
            f"through fp8jax.accumulate_gradients over {microbatches} microbatches"
            f"{', unroll=True' if unroll else ''} (`up`'s dgrad dead: the layer's gradients only)"
        )
    print(f"experts' own GEMM FLOPs (fwd + dgrad + wgrad, both layers): {ideal / 1e12:.3f} T")
    compiled = {}
    for name in VARIANTS:
        cost, temp, seconds = compile_cost(shape, name, microbatches, unroll)
        print(f"  compiled {name} in {seconds:.0f} s", file=sys.stderr)
        compiled[name] = (cost, temp)
    base, grouped = (compiled[n][0].estimate_seconds() for n in ("bf16", JAX_VARIANT))
    rows = []
    for name, (cost, temp) in compiled.items():
        estimate = cost.estimate_seconds()
        kinds = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in sorted(cost.flops.items()))
        rows.append(
            [
                name,
                f"{cost.gemm_flops / ideal:.2f}x",
                kinds,
                f"{cost.total_bytes / 1e9:.2f}",
                f"{cost.gemm_seconds() * 1e3:.2f}",
                f"{estimate * 1e3:.2f}",
                f"{estimate / base:.2f}",
                f"{estimate / grouped:.2f}",
                f"{temp / 2**20:.0f}",
                str(sum(k.runs for k in cost.kernels)),
                f"{weight_quantization_bytes(cost) / 1e9:.2f}",
            ]
        )
    header = [
        "variant",
        "GEMM FLOPs / experts' own",
        "TFLOP by kind",
        "non-GEMM GB",
        "GEMM ms",
        "est. ms",
        "vs bf16",
        "vs JAX kernels",
        "temp MiB",
        "kernels",
        "block weight quantization GB",
    ]
    print(table(rows, header))


# --- expert parallel -------------------------------------------------------------------------

#: The meshes of the expert-parallel runs: the experts split over all of it.
EP_MESHES = {"8 H100s, 1 node": {"expert": 8}, "16 H100s, 2 nodes": {"expert": 16}}
#: name -> (recipe, fp8_backward); `None` recipe: BF16.
EP_VARIANTS = {
    "bf16": (None, False),
    "fp8 dispatch, delayed e4m3": (fp8jax.DelayedScaling(backward_format="e4m3"), False),
    "fp8 dispatch, blockwise": (fp8jax.BlockwiseScaling(), False),
    "fp8 dispatch + fp8 backward, blockwise": (fp8jax.BlockwiseScaling(), True),
}
CAPACITY_FACTOR = 1.25


def make_ep_model(shape: dict, devices: int, recipe, fp8_backward: bool):
    """The MoE layer of `shape`, experts split over mesh axis `"expert"` of `devices` GPUs,
    parameters in BF16; FP8 (`recipe`, amaxes over the axis) unless `recipe` is None."""
    assignments = shape["tokens"] * shape["top_k"]
    model = MoE(
        shape["width"],
        shape["hidden"],
        shape["experts"],
        shape["top_k"],
        key=jax.random.PRNGKey(0),
        expert_axis="expert",
        fp8_backward=fp8_backward,
        capacity=math.ceil(CAPACITY_FACTOR * assignments),
    )
    if recipe is not None:
        recipe = dataclasses.replace(recipe, axis_names=("expert",))
        config = fp8jax.Fp8Config(targets=["up", "down"], recipe=recipe)
        model = fp8jax.fp8_linear_layers(model, config)
    return to_bf16(model)


def ep_step(mesh):
    """Loss and gradients of the expert-parallel layer and of its input."""

    def loss(model_and_x):
        model, x = model_and_x
        params, static = eqx.partition(model, eqx.is_array)

        def local(params, x):
            out = eqx.combine(params, static)(x)
            return jax.lax.pmean(jnp.mean(out.astype(jnp.float32) ** 2), "expert")

        specs = fp8jax.expert_specs(params, "expert")
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P())(
            params, x
        )

    return lambda model, x: fp8jax.filter_value_and_grad(loss)((model, x))


def compile_ep(shape: dict, axes: dict, name: str) -> tuple[Cost, float]:
    mesh = fp8jax.h100_mesh(axes)
    devices = mesh.size
    model = eqx.filter_eval_shape(make_ep_model, shape, devices, *EP_VARIANTS[name])
    specs = fp8jax.expert_specs(model, "expert")
    model = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        model,
        specs,
    )
    rows = NamedSharding(mesh, P("expert"))
    x = jax.ShapeDtypeStruct(
        (devices * shape["tokens"], shape["width"]), jnp.bfloat16, sharding=rows
    )
    start = time.perf_counter()
    lowered, _ = deviceless.lower(
        ep_step(mesh), (model, x), {}, deviceless.h100_topology().devices[0]
    )
    cost = hlo_cost(lowered.compile(compiler_options=OPTIONS).as_text())
    return cost, time.perf_counter() - start


def exchanged(cost: Cost) -> dict[str, float]:
    """Ragged all-to-all bytes each GPU sends, by element type."""
    out: dict[str, float] = {}
    for c in cost.collectives:
        if c.op == "ragged-all-to-all":
            out[c.dtype] = out.get(c.dtype, 0) + c.wire_bytes * c.runs
    return out


def report_ep(title: str, shape: dict) -> None:
    print(f"\n## {title}, expert parallel: {shape} per GPU, capacity factor {CAPACITY_FACTOR}")
    for mesh_name, axes in EP_MESHES.items():
        if shape["experts"] % axes["expert"]:
            print(f"\n### {mesh_name}\n\n{shape['experts']} experts do not split over it.")
            continue
        rows, base = [], None
        for name in EP_VARIANTS:
            cost, seconds = compile_ep(shape, axes, name)
            print(f"  compiled {title} {mesh_name} {name} in {seconds:.0f} s", file=sys.stderr)
            sent = exchanged(cost)
            fp8 = sum(v for k, v in sent.items() if k.startswith("f8"))
            compute = cost.gemm_seconds() + cost.memory_seconds()
            no_overlap, overlap = cost.estimate_seconds(), cost.estimate_seconds(overlap=True)
            base = (no_overlap, overlap) if base is None else base
            kinds = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in sorted(cost.flops.items()))
            if name == "bf16":  # XLA's ragged_dot over the GPU's experts; and the yardstick
                own = experts_flops(shape) / H100["bf16"]
                grouped = (own + cost.memory_seconds(), cost.communication_seconds())
                yardstick = (sum(grouped), max(grouped))
            rows.append(
                [
                    name,
                    kinds,
                    f"{cost.total_bytes / 1e9:.2f}",
                    f"{fp8 / 1e6:.1f} + {sent.get('f32', 0) / 1e6:.1f} + "
                    f"{sent.get('bf16', 0) / 1e6:.1f}",
                    " / ".join(f"{cost.link_bytes.get(k, 0) / 1e6:.1f}" for k in LINKS),
                    f"{cost.communication_seconds() * 1e3:.2f}",
                    f"{compute * 1e3:.2f}",
                    f"{no_overlap * 1e3:.2f}",
                    f"{overlap * 1e3:.2f}",
                    f"{no_overlap / base[0]:.2f} / {overlap / base[1]:.2f}",
                    f"{no_overlap / yardstick[0]:.2f} / {overlap / yardstick[1]:.2f}",
                ]
            )
            if name == "bf16":
                rows.append(
                    [
                        "bf16 grouped (analytic GEMMs)",
                        f"bf16 {experts_flops(shape) / 1e12:.2f}",
                        f"{cost.total_bytes / 1e9:.2f}",
                        rows[-1][3],
                        rows[-1][4],
                        rows[-1][5],
                        f"{grouped[0] * 1e3:.2f}",
                        f"{yardstick[0] * 1e3:.2f}",
                        f"{yardstick[1] * 1e3:.2f}",
                        f"{yardstick[0] / base[0]:.2f} / {yardstick[1] / base[1]:.2f}",
                        "1.00 / 1.00",
                    ]
                )
        header = [
            "variant",
            "TFLOP by kind",
            "non-GEMM GB",
            "exchanged MB: FP8 + f32 scales + BF16",
            "NVLink / IB MB (all collectives)",
            "comm. ms",
            "compute ms",
            "step ms, no overlap",
            "step ms, overlapped",
            "x BF16 (no overlap / overlapped)",
            "x BF16 grouped (analytic)",
        ]
        print(f"\n### {mesh_name}\n")
        print(table(rows, header))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--expert-parallel", action="store_true", help="the layer expert parallel (see above)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="the step through fp8jax.accumulate_gradients over this many microbatches",
    )
    parser.add_argument(
        "--unroll",
        action="store_true",
        help="with --microbatches: accumulate_gradients(..., unroll=True)",
    )
    args = parser.parse_args(argv)
    if args.microbatches < 1 or (args.microbatches > 1 and args.expert_parallel):
        parser.error(
            f"--microbatches={args.microbatches}: should be 1 or more, and 1 with --expert-parallel"
        )
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown {name!r}; choose among {', '.join(SHAPES)}")
    if deviceless.h100_topology() is None:
        raise SystemExit("needs the h100 extra: pip install -e '.[h100]'")
    print(f"jax {jax.__version__}; deviceless H100 compile, cuBLAS mode; an ESTIMATE (see the")
    print("module docstring): GEMM FLOPs at H100 peaks plus non-GEMM bytes at 3.35 TB/s", end="")
    if args.expert_parallel:
        print(
            f"; collectives at NVLink {H100['nvlink'] / 1e9:.0f} / InfiniBand "
            f"{H100['infiniband'] / 1e9:.0f} GB/s one way per GPU (peak rates)."
        )
    else:
        print(".")
    for name in args.shapes.split(","):
        if args.expert_parallel:
            report_ep(name, SHAPES[name])
        else:
            report(name, SHAPES[name], args.microbatches, args.unroll)


if __name__ == "__main__":
    main()

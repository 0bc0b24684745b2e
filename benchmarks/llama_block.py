"""A Llama-3-style block's train step, BF16 against FP8: where the FP8 step's extra work is.

    JAX_PLATFORMS=cpu python benchmarks/llama_block.py [--sizes 8B,1B] \
        [--variants bf16,delayed,delayed-cold,...] \
        | tee benchmarks/results/llama_block_deviceless.txt

The model of `../shared/measurements/h100-2026-11-27.md` (issue 38), in plain Equinox: RMSNorm,
separate q/k/v/o Linears without bias, RoPE, causal attention, SwiGLU MLP (`gate`, `up`,
`down`). One train step: value and gradient of the mean square of the block's output over
float32 masters cast to BF16 and over the input (as inside a stack),
`fp8jax.partition_for_grad_overwrite` / `apply_updates`, SGD. FP8 variants convert every
Linear with `fp8jax.fp8_linear_layers(block, Fp8Config(recipe=...))` as documented.

- `8B`: width 4096, 32 heads of 128, SwiGLU 14336, 2 x 4096 tokens (Llama-3-8B's block).
- `1B`: width 2048, 32 heads of 64, SwiGLU 8192, 4 x 2048 tokens (Llama-3.2-1B's block).

On a GPU (`gpu_check`'s `llama` and `profile` sections) attention is cuDNN's flash attention
(`jax.nn.dot_product_attention(implementation="cudnn")`). Run as a script, this file compiles
each step for an H100 without one (cuBLAS mode: `fp8jax.gpu_compiler_options()`), where cuDNN
attention does not compile: attention is then a stand-in `q * k + v` of the same shapes and
gradient paths, the same in every variant. It prints, per variant, what the CPU can measure
of the GPU's step: kernels per step by kind (`fp8jax.hlo_cost`'s categories), the HBM bytes of
every non-GEMM kernel, temp memory (`memory_analysis`) and the cost model's ESTIMATE of the
step's time, each beside BF16's. Kernel counts and bytes are read from the compiled HLO, not timed.
Variants (`RECIPES`): `bf16`, the benchmarks' recipes, `delayed-cold` (no warm start),
`delayed-steady` (the default recipe as `fp8jax.make_train_step` runs it once every scale is
recorded: traced inside `skip_warm_start(recorded=True)`; the output gradients' transposed FP8
copies made apart, `per_tensor.KNOWN_SCALE_APART`), `delayed-steady-fused` (the same with every
transposed copy written by the cast, the default before session 42: `transposes_apart(())`),
`delayed-cond` (the warm start behind a `lax.cond`, `CondWarmStart`), `delayed-apart`,
`delayed-steady-apart` and `current-apart` (those recipes with every transposed FP8 copy written by
a transpose of its own, traced inside `transposes_apart`: the cast then writes one layout, and
reduces the amax in its pass where it need not wait for it), `delayed-steady-apart-acts` (only the
activations' and output gradients' copies apart; `current-apart-grads`: current scaling's output
gradients' only), `delayed-steady-words` and `delayed-steady-apart-words` (`delayed-steady` and
`delayed-steady-apart` with the copies apart written in 32-bit words, `transposes_in_words`),
`delayed-steady-kernel` (the steady state with
every operand quantized by fp8jax's one-pass kernel, both FP8 copies and the amax from one read,
traced inside `per_tensor_pass.cast_transpose_kernel`; `-acts`: the activations and output
gradients only, `-grads`: the output gradients only; `current-kernel` and `current-kernel-grads`:
current scaling's copies by the kernel, its amax from XLA first; `delayed-steady-tc`,
`delayed-steady-tc-grads`, `delayed-steady-apart-tc-grads` and `current-tc`: the same on the
tensor-core kernel, `kernels.tensor_core_transpose`, TMA and one `wgmma` a tile, session 51)
and `blockwise-tiled` (blockwise
scaling on the tiled block kernel, traced inside `tiled_kernel`; `blockwise` runs the persistent
warp-specialized kernel of issue 39, the default on GPUs since run 4; on a CPU compile the recipe
takes the XLA path), `blockwise-pairs` (that kernel in its default configuration with two chunks a
step, `chunks_per_step=2`) and `blockwise-tile-scales` (that kernel given the weights' scales once
per 128 x 128 block, `weight_block_scales`: one scale per warpgroup tile and chunk in the forward
and dgrad; `blockwise-tile-scales-three` with three compute warpgroups there, 192 x 128 CTA
tiles, `PersistentConfig.compute_wgs`, the wgrad's two), `blockwise-chained` (that kernel
with each program's tiles chained into one pipeline,
`chained_pipelines`), `blockwise-slabs` (the default kernels, the quantization kernels holding
`SLAB_ROWS` rows of a tile at a time, `quantize_slabs`: fewer registers, more programs per SM),
`blockwise-tc` (every quantization pass on the Mosaic GPU kernels, the transposes on the
tensor cores, `tensor_core_quantization`, session 52), and `delayed-steady-masters`,
`delayed-steady-kernel-masters`, `current-kernel-masters`, `blockwise-masters` and
`blockwise-tc-masters` (those variants cast to BF16 by `fp8jax.Policy`, which leaves the FP8
Linears' float32 weights for their GEMMs to quantize from the masters, `MASTERS`; every other
variant casts every float as a user's `jax.tree.map` would). Any
of them but `bf16` with `-packed` appended (`PACKED`): the same step with the model's FP8 states
stacked in a few arrays between steps (`Packed`: 12 arrays in, not 73), to time what the state
arrays cost the host's launch. On real arrays (a GPU's timing) delayed scaling's variants start
from the states two warm steps record (`recorded_states`), as a training run's steps do, unless
`-fresh` (`FRESH`) ends the name: a fresh model's states cast its operands with the scale 1.0
(without the warm start: this loss's E5M2 gradients then flush to zero) or 0 (where the warm start
is skipped: every operand zero).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import train_steps
from jaxtyping import Array, Float
from llama_variants import FRESH, PACKED, RECIPE_NAMES, accepted, base_name, unknown

import fp8jax
from fp8jax._src.core.compile_options import cublas_traced
from fp8jax._src.kernels.choice import (
    DEFAULT_CONFIGS,
    chained_pipelines,
    persistent_kernel,
    tensor_core_quantization,
    tiled_kernel,
    weight_block_scales,
)
from fp8jax._src.kernels.persistent_config import PersistentConfig
from fp8jax._src.kernels.quantize_config import quantize_slabs
from fp8jax._src.observe import deviceless
from fp8jax._src.recipes import ROLES
from fp8jax._src.recipes.per_tensor import (
    skip_warm_start,
    transposes_apart,
    transposes_in_words,
)
from fp8jax._src.recipes.per_tensor_pass import cast_transpose_kernel

#: The two blocks of the measurements: Llama-3-8B's and Llama-3.2-1B's.
SHAPES: dict[str, dict[str, int]] = {
    "8B": dict(width=4096, heads=32, ffn=14336, batch=2, context=4096),
    "1B": dict(width=2048, heads=32, ffn=8192, batch=4, context=2048),
    "dry": dict(width=64, heads=4, ffn=128, batch=2, context=32),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CondWarmStart(fp8jax.DelayedScaling):
    """Delayed scaling with its warm start behind a `lax.cond` (an experiment for the GPU
    check, not a recipe of the library): an operand whose history holds an amax is cast with
    the history's scale, with no wait for its own amax (which XLA may then compute in the
    casting pass); one whose history is empty is cast with its own amax, as the warm start
    does. The same numbers as `DelayedScaling()`. What a GPU must tell: the price of a
    conditional per operand (XLA may read its predicate on the host)."""

    def quantize(self, x: Array, state: Any, role: str, axis: int) -> tuple[Any, Any]:
        parent = fp8jax.DelayedScaling.quantize
        cold = dataclasses.replace(self, warm_start=False)
        # The merged state's scale is 0 exactly while its history holds no amax.
        recorded = jnp.all(state.scale > 0.0)
        return jax.lax.cond(
            recorded,
            lambda: parent(cold, x, state, role, axis),
            lambda: parent(self, x, state, role, axis),
        )


#: Rows of a tile the quantization kernels hold at a time in `blockwise-slabs` (ptxas, jax
#: 0.11.2: 32-128 registers a thread in each kernel's warps, whole tiles 116-255; quantize_ptx.py).
SLAB_ROWS = 32

#: The recipes compared with BF16: the benchmarks' own, delayed scaling without its warm
#: start (`warm_start=False`), whose cast need not wait for this step's amax, and with the
#: warm start behind a conditional (`CondWarmStart`).
RECIPES: dict[str, fp8jax.Recipe] = {
    **train_steps.RECIPES,
    "delayed-cold": fp8jax.DelayedScaling(warm_start=False),
    "delayed-steady": fp8jax.DelayedScaling(),
    "delayed-cond": CondWarmStart(),
    "delayed-apart": fp8jax.DelayedScaling(),
    "delayed-steady-apart": fp8jax.DelayedScaling(),
    "delayed-steady-apart-acts": fp8jax.DelayedScaling(),
    "delayed-steady-fused": fp8jax.DelayedScaling(),
    "delayed-steady-words": fp8jax.DelayedScaling(),
    "delayed-steady-apart-words": fp8jax.DelayedScaling(),
    "delayed-steady-kernel": fp8jax.DelayedScaling(),
    "delayed-steady-kernel-acts": fp8jax.DelayedScaling(),
    "delayed-steady-kernel-grads": fp8jax.DelayedScaling(),
    "delayed-steady-apart-kernel-grads": fp8jax.DelayedScaling(),
    "current-apart": fp8jax.CurrentScaling(),
    "current-apart-grads": fp8jax.CurrentScaling(),
    "current-kernel": fp8jax.CurrentScaling(),
    "current-kernel-grads": fp8jax.CurrentScaling(),
    "delayed-steady-tc": fp8jax.DelayedScaling(),
    "delayed-steady-tc-grads": fp8jax.DelayedScaling(),
    "delayed-steady-apart-tc-grads": fp8jax.DelayedScaling(),
    "current-tc": fp8jax.CurrentScaling(),
    "blockwise-tiled": fp8jax.BlockwiseScaling(),
    "blockwise-pairs": fp8jax.BlockwiseScaling(),
    "blockwise-tile-scales": fp8jax.BlockwiseScaling(),
    "blockwise-tile-scales-three": fp8jax.BlockwiseScaling(),
    "blockwise-chained": fp8jax.BlockwiseScaling(),
    "blockwise-slabs": fp8jax.BlockwiseScaling(),
    "blockwise-tc": fp8jax.BlockwiseScaling(),
}
#: Variants whose block-scaled GEMMs run on a kernel of their own, traced inside the context
#: (`step(name)`).
CONTEXTS: dict[str, Callable[[], Any]] = {
    "delayed-steady": lambda: skip_warm_start(recorded=True),
    "delayed-apart": transposes_apart,
    "delayed-steady-apart": lambda: steady_apart(),
    "delayed-steady-apart-acts": lambda: steady_apart(("input", "output_grad")),
    "delayed-steady-fused": lambda: steady_apart(()),
    "delayed-steady-words": lambda: steady_words(None),
    "delayed-steady-apart-words": lambda: steady_words(ROLES),
    "delayed-steady-kernel": lambda: steady_kernel(),
    "delayed-steady-kernel-acts": lambda: steady_kernel(("input", "output_grad")),
    "delayed-steady-kernel-grads": lambda: steady_kernel(("output_grad",)),
    "delayed-steady-apart-kernel-grads": lambda: steady_kernel(
        ("output_grad",), apart=("input", "kernel")
    ),
    "current-apart": transposes_apart,
    "current-apart-grads": lambda: transposes_apart("output_grad"),
    "current-kernel": cast_transpose_kernel,
    "current-kernel-grads": lambda: cast_transpose_kernel("output_grad"),
    "delayed-steady-tc": lambda: steady_kernel(on_tensor_cores=True),
    "delayed-steady-tc-grads": lambda: steady_kernel(("output_grad",), on_tensor_cores=True),
    "delayed-steady-apart-tc-grads": lambda: steady_kernel(
        ("output_grad",), apart=("input", "kernel"), on_tensor_cores=True
    ),
    "current-tc": lambda: cast_transpose_kernel(on_tensor_cores=True),
    "blockwise-tiled": tiled_kernel,
    "blockwise-pairs": lambda: persistent_kernel(
        dataclasses.replace(DEFAULT_CONFIGS["dense"], chunks_per_step=2)
    ),
    "blockwise-tile-scales": lambda: tile_scales(),
    "blockwise-tile-scales-three": lambda: tile_scales(
        dataclasses.replace(DEFAULT_CONFIGS["dense"], compute_wgs=3)
    ),
    "blockwise-chained": lambda: chained(),
    "blockwise-slabs": lambda: quantize_slabs(SLAB_ROWS),
    "blockwise-tc": tensor_core_quantization,
}
#: Variants cast to BF16 by `fp8jax.Policy` (`train_steps.POLICY_BF16`), which leaves the FP8
#: Linears' float32 weights for their GEMMs to quantize from the masters, and the variant
#: each is otherwise (its recipe, in its context); the others cast every float as a user's
#: `jax.tree.map` would (`train_steps.to_bf16`).
MASTERS: dict[str, str] = {
    f"{name}-masters": name
    for name in (
        "delayed-steady",
        "delayed-steady-kernel",
        "current-kernel",
        "blockwise",
        "blockwise-tc",
    )
}
RECIPES.update({name: RECIPES[base] for name, base in MASTERS.items()})
CONTEXTS.update({name: CONTEXTS[base] for name, base in MASTERS.items() if base in CONTEXTS})
# The names the GPU check's supervisor checks without JAX: each a recipe here, and each
# recipe defined here among them (other scripts add to train_steps.RECIPES in their process).
_DIFFER = set(RECIPE_NAMES) ^ (set(RECIPES) - (set(train_steps.RECIPES) - set(RECIPE_NAMES)))
if _DIFFER:
    raise ImportError(f"llama_variants.RECIPE_NAMES and RECIPES differ in {sorted(_DIFFER)}")


@contextlib.contextmanager
def steady_apart(roles: tuple[str, ...] = ROLES) -> Iterator[None]:
    """The train step's steady state (`delayed-steady`) with the transposed FP8 copies of
    the operands of `roles` written apart and the others' by the cast (`()`: every copy by
    the cast; `per_tensor.transposes_apart`)."""
    with skip_warm_start(recorded=True), transposes_apart(roles):
        yield


@contextlib.contextmanager
def steady_words(roles: tuple[str, ...] | None) -> Iterator[None]:
    """The train step's steady state with the transposed FP8 copies made apart (those of
    `roles`; `None`: the default's, the output gradients') written in 32-bit words
    (`per_tensor.transposes_in_words`)."""
    with (
        skip_warm_start(recorded=True),
        transposes_apart(roles) if roles is not None else contextlib.nullcontext(),
        transposes_in_words(),
    ):
        yield


@contextlib.contextmanager
def steady_kernel(
    roles: tuple[str, ...] = ROLES, apart: tuple[str, ...] = (), on_tensor_cores: bool = False
) -> Iterator[None]:
    """The train step's steady state (`delayed-steady`) with the operands of `roles`
    quantized by fp8jax's one-pass kernel: both FP8 copies and the amax from one read
    (`per_tensor_pass.cast_transpose_kernel`, on the tensor-core kernel with
    `on_tensor_cores`); the transposed copies of `apart`'s operands written apart
    (`per_tensor.transposes_apart`)."""
    with (
        skip_warm_start(recorded=True),
        cast_transpose_kernel(roles, on_tensor_cores=on_tensor_cores),
        transposes_apart(apart) if apart else contextlib.nullcontext(),
    ):
        yield


@contextlib.contextmanager
def tile_scales(config: PersistentConfig | None = None) -> Iterator[None]:
    """The persistent kernels (each GEMM in its default configuration, or all in `config`)
    given the weights' block scales once per block (`choice.weight_block_scales`)."""
    with persistent_kernel(config), weight_block_scales():
        yield


@contextlib.contextmanager
def chained() -> Iterator[None]:
    """The persistent kernels (each GEMM in its default configuration) with each program's
    tiles chained into one pipeline (`choice.chained_pipelines`)."""
    with persistent_kernel(), chained_pipelines():
        yield


#: Attention implementations: cuDNN's flash attention (GPU only), XLA's, or the stand-in.
ATTENTION = ("cudnn", "xla", "stand-in")
STAND_IN = "attention_stand_in"


class RMSNorm(eqx.Module):
    """Llama's RMSNorm: statistics in float32, the result in the input's dtype."""

    weight: Float[Array, " width"]
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float = 1e-5):
        self.weight = jnp.ones((width,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch width"]) -> Float[Array, "*batch width"]:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: Float[Array, "batch seq heads dim"]) -> Float[Array, "batch seq heads dim"]:
    """Rotary position embedding (Llama-3's base 500,000), rotating halves."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 500_000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = (f(angles)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def linear(layer: Any, x: Float[Array, "batch seq d_in"]) -> Float[Array, "batch seq d_out"]:
    """An Equinox Linear over every token, vmapped as an Equinox user writes it."""
    return jax.vmap(jax.vmap(layer))(x)


class LlamaBlock(eqx.Module):
    """One Llama-3 transformer block (multi-head attention: K/V as wide as Q)."""

    attn_norm: RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    attention: str = eqx.field(static=True)

    def __init__(self, width: int, heads: int, ffn: int, attention: str, *, key):
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: should be one of {ATTENTION}.")
        keys = jax.random.split(key, 7)
        lin = functools.partial(eqx.nn.Linear, use_bias=False)
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q, self.k, self.v, self.o = (lin(width, width, key=k) for k in keys[:4])
        self.gate, self.up = lin(width, ffn, key=keys[4]), lin(width, ffn, key=keys[5])
        self.down = lin(ffn, width, key=keys[6])
        self.heads = heads
        self.attention = attention

    def attend(self, q: Array, k: Array, v: Array) -> Array:
        if self.attention == "stand-in":
            with jax.named_scope(STAND_IN):
                # q * k, not q + k: XLA would fold the sum's dgrad into one GEMM on the summed
                # weights, dropping two of the three dgrad GEMMs that real attention has.
                return q * k + v
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)

    def __call__(self, x: Float[Array, "batch seq width"]) -> Float[Array, "batch seq width"]:
        b, s, d = x.shape
        h = self.attn_norm(x)
        split = lambda t: t.reshape(b, s, self.heads, d // self.heads)  # noqa: E731
        q, k, v = (split(linear(p, h)) for p in (self.q, self.k, self.v))
        mixed = self.attend(rope(q), rope(k), v).reshape(b, s, d)
        x = x + linear(self.o, mixed)
        h = self.mlp_norm(x)
        return x + linear(self.down, jax.nn.silu(linear(self.gate, h)) * linear(self.up, h))


def loss(block: LlamaBlock, x: Float[Array, "batch seq width"]) -> Float[Array, ""]:
    """Mean square of the block's output, activations in BF16 like the parameters."""
    return jnp.mean(block(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)


def make_block(size: str, attention: str, key: Array | None = None) -> LlamaBlock:
    shape = SHAPES[size]
    key = jax.random.PRNGKey(0) if key is None else key
    return LlamaBlock(shape["width"], shape["heads"], shape["ffn"], attention, key=key)


#: Train steps of the default delayed recipe (`delayed`, its warm start on) run to record the
#: states a delayed-scaling variant is timed with: its first step already scales every
#: operand by its own amax and records it.
RECORD_STEPS = 2


def check_names(
    parser: argparse.ArgumentParser, sizes: list[str], variants: list[str] = ()
) -> None:
    """Exit through `parser.error` for a size not in `SHAPES` or a variant name `variant`
    refuses: before the first compile, not minutes into a run."""
    for size in sizes:
        if size not in SHAPES:
            parser.error(f"--sizes: unknown {size!r}; choose among {', '.join(SHAPES)}")
    for name in variants:
        if unknown([name]):
            parser.error(f"--variants: unknown {name!r}; choose among {accepted()}")


def is_packed(name: str) -> bool:
    """Whether variant `name` is `Packed`."""
    return name.removesuffix(FRESH).endswith(PACKED)


def takes_recorded_states(name: str) -> bool:
    """Whether variant `name` is timed with `recorded_states`: delayed scaling's variants but
    those named with `FRESH`."""
    recipe = RECIPES.get(base_name(name))
    return isinstance(recipe, fp8jax.DelayedScaling) and not name.endswith(FRESH)


def split_states(model: Any) -> tuple[list[Array], Any, Any]:
    """`model` as the arrays of its FP8 states (`fp8jax.partition_for_grad_overwrite`'s first
    part) in tree order, their treedef, and the rest of the model (those arrays taken out):
    `eqx.combine(rest, jax.tree.unflatten(treedef, arrays))` rebuilds it."""
    overwrites, others = fp8jax.partition_for_grad_overwrite(model)
    arrays, statics = eqx.partition(overwrites, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    return leaves, treedef, eqx.combine(others, statics)


def state_arrays(model: Any) -> tuple[Array, ...]:
    """The arrays of `model`'s FP8 states, in tree order (`split_states`)."""
    return tuple(split_states(model)[0])


def with_states(model: Any, arrays: tuple[Array, ...]) -> Any:
    """`model` with the arrays of its FP8 states replaced by `arrays` (`state_arrays` of a
    model with the same FP8 layers, whatever their recipes)."""
    leaves, treedef, rest = split_states(model)
    want = [(jnp.shape(a), a.dtype) for a in leaves]
    got = [(jnp.shape(a), a.dtype) for a in arrays]
    if want != got:
        first = next((w, g) for w, g in itertools.zip_longest(want, got) if w != g)
        raise ValueError(
            f"with_states: {len(got)} arrays given, where the model's FP8 states hold "
            f"{len(want)}; the first that differs (expected, given): {first}. Give "
            "`state_arrays` of a model with the same FP8 layers and recipe states."
        )
    return eqx.combine(rest, jax.tree.unflatten(treedef, arrays))


@functools.cache
def recorded_states(size: str, attention: str) -> tuple[Array, ...]:
    """`state_arrays` of block `size` after `RECORD_STEPS` train steps of `delayed` on the
    benchmark's input: every history holds real amaxes and every state the scale (and kept
    inverse) its next step casts with, as in a training run. Compiled as the GPU check
    compiles the steps it times (`fp8jax.gpu_compiler_options()`: no Triton GEMM to tune)."""
    block = variant(make_block(size, attention), "delayed")
    run = jax.jit(step("delayed"), compiler_options=fp8jax.gpu_compiler_options())
    x = inputs(size)
    for _ in range(RECORD_STEPS):
        block, _, _ = run(block, x)
    return state_arrays(block)


class Packed(eqx.Module):
    """A model whose FP8 states' arrays travel between steps stacked by shape and dtype: the
    step takes and gives a few arrays for them (`stacks`), not three per operand.
    `unpack` rebuilds the model inside the step (slices XLA fuses into their readers), `pack`
    stacks its new states again (the merge has stacked them already). A benchmark's device,
    not an fp8jax API: it tells whether such an API would pay."""

    rest: Any  # the model with its FP8 states' arrays taken out (None there)
    stacks: tuple[Array, ...]
    where: tuple[tuple[int, int], ...] = eqx.field(static=True)  # per array: (stack, index)
    treedef: Any = eqx.field(static=True)  # of the states' arrays


def pack(model: Any) -> Packed:
    """`model` with its FP8 states' arrays stacked (`Packed`)."""
    leaves, treedef, rest = split_states(model)
    groups: dict[tuple, list[Array]] = {}
    where = []
    for leaf in leaves:
        key = (jnp.shape(leaf), jnp.dtype(leaf.dtype))
        group = groups.setdefault(key, [])
        where.append((list(groups).index(key), len(group)))
        group.append(leaf)
    stacks = tuple(jnp.stack(group) for group in groups.values())
    return Packed(rest, stacks, tuple(where), treedef)


def unpack(packed: Packed) -> Any:
    """The model `pack` stacked."""
    leaves = [packed.stacks[g][i] for g, i in packed.where]
    return eqx.combine(packed.rest, jax.tree.unflatten(packed.treedef, leaves))


def variant(block: LlamaBlock, name: str, states: tuple[Array, ...] | None = None) -> Any:
    """`block` as variant `name`: `"bf16"`, or a recipe of `RECIPES` on every Linear through
    `fp8jax.fp8_linear_layers` with the documented `Fp8Config`, its FP8 states' arrays
    `states` where given (`with_states`); with `PACKED` appended to a recipe's name, that
    model `Packed`; `FRESH` after that changes nothing here (see `arguments`)."""
    if name == "bf16":
        return block
    if base_name(name) not in RECIPES:
        raise ValueError(
            f"variant {name!r}: should be one of {['bf16', *RECIPES]}, or a recipe's with "
            f"{PACKED!r}, {FRESH!r} or both appended, in that order"
        )
    model = fp8jax.fp8_linear_layers(block, fp8jax.Fp8Config(recipe=RECIPES[base_name(name)]))
    if states is not None:
        model = with_states(model, states)
    return pack(model) if is_packed(name) else model


def step(name: str = "bf16") -> Callable:
    """The block's train step (`train_steps.block_step`): `(block, x) -> (block, loss, dx)`;
    traced for cuBLAS mode (`cublas_traced`), and for the variants in `CONTEXTS` inside
    their context; a `PACKED` variant's block is `Packed` on the way in and out."""
    cast = train_steps.POLICY_BF16 if base_name(name) in MASTERS else train_steps.to_bf16
    inner = train_steps.block_step(loss, cast)
    context = CONTEXTS.get(base_name(name), contextlib.nullcontext)
    packed = is_packed(name)

    def traced(block: Any, x: Any) -> Any:
        # Compiled with `fp8jax.gpu_compiler_options()`, as `fp8jax.make_train_step` traces
        # its steps (`cublas_traced`).
        with cublas_traced(), context():
            block, value, dx = inner(unpack(block) if packed else block, x)
        return (pack(block) if packed else block), value, dx

    return traced


def inputs(size: str) -> Array:
    """The input of block `size`'s step: standard normal, BF16."""
    shape = SHAPES[size]
    x_shape = (shape["batch"], shape["context"], shape["width"])
    return jax.random.normal(jax.random.PRNGKey(1), x_shape, jnp.bfloat16)


def arguments(size: str, name: str, attention: str, abstract: bool) -> tuple[Any, Any]:
    """`(block, x)` of variant `name`: shapes only when `abstract` (a deviceless compile),
    real arrays otherwise, a delayed-scaling variant's states recorded by warm steps
    (`recorded_states`) unless its name ends with `FRESH`."""
    if abstract:
        block = eqx.filter_eval_shape(lambda: variant(make_block(size, attention), name))
        return block, eqx.filter_eval_shape(inputs, size)
    states = recorded_states(size, attention) if takes_recorded_states(name) else None
    return variant(make_block(size, attention), name, states), inputs(size)


# --- what a deviceless H100 compile shows ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Split:
    """A compiled step, read from its HLO: kernels per step by kind, non-GEMM HBM bytes, GEMM
    FLOPs per precision, temp memory and the cost model's ESTIMATE of its time
    (`fp8jax.Cost.estimate_seconds`: GEMMs at peak, other kernels at HBM bandwidth)."""

    kernels: dict[str, int]
    non_gemm_bytes: dict[str, int]
    gemm_flops: dict[str, int]
    temp_bytes: int
    estimate_s: float = 0.0

    @property
    def kernel_count(self) -> int:
        return sum(self.kernels.values())


def kind_of(kernel: Any) -> str:
    """A kernel of `fp8jax.hlo_cost` as the summary names it: `"GEMM fp8"` / `"GEMM bf16"`,
    `"attention"` (the stand-in's kernels, or cuDNN's), or its non-GEMM category."""
    if kernel.category is None:
        return f"GEMM {kernel.kind}"
    if STAND_IN in kernel.op_name or "cudnn" in kernel.name:
        return "attention"
    return kernel.category


def split(compiled: Any) -> Split:
    """The `Split` of a compiled step (`jax.stages.Compiled`)."""
    cost = fp8jax.hlo_cost(compiled.as_text())
    kernels: collections.Counter[str] = collections.Counter()
    bytes_: collections.Counter[str] = collections.Counter()
    for k in cost.kernels:
        kind = kind_of(k)
        kernels[kind] += k.runs
        if k.category is not None:
            bytes_[kind] += k.bytes * k.runs
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes)
    return Split(dict(kernels), dict(bytes_), dict(cost.flops), temp, cost.estimate_seconds())


def lower_deviceless(
    size: str, name: str, prepare: Callable[[Any], Any] | None = None
) -> jax.stages.Lowered:
    """Variant `name` of block `size`, its step (attention the stand-in) lowered for one H100
    without a GPU; the block passed through `prepare` inside the step, where given."""
    block, x = arguments(size, name, "stand-in", abstract=True)
    fn = step(name)
    if prepare is not None:
        fn = (lambda inner: lambda block, x: inner(prepare(block), x))(fn)
    topology = deviceless.h100_topology()
    lowered, _ = deviceless.lower(fn, (block, x), {}, topology.devices[0])
    return lowered


def compile_deviceless(size: str, name: str) -> Any:
    """Variant `name` of block `size`, its step compiled for one H100 (cuBLAS mode)."""
    return lower_deviceless(size, name).compile(compiler_options=fp8jax.gpu_compiler_options())


def table(size: str, splits: dict[str, Split]) -> str:
    base = splits["bf16"]
    kinds = sorted({k for s in splits.values() for k in s.kernels})
    rows = []
    for name, s in splits.items():
        other, base_other = sum(s.non_gemm_bytes.values()), sum(base.non_gemm_bytes.values())
        rows.append(
            [
                name,
                f"{s.kernel_count} ({s.kernel_count / base.kernel_count:.2f}x)",
                *(s.kernels.get(k, 0) for k in kinds),
                f"{other / 1e9:.2f} ({other / base_other:.2f}x)",
                f"{s.temp_bytes / 2**30:.2f} ({s.temp_bytes / base.temp_bytes:.2f}x)",
                f"{s.estimate_s * 1e3:.2f} ({s.estimate_s / base.estimate_s:.2f}x)",
            ]
        )
    header = [
        "variant",
        "kernels",
        *kinds,
        "non-GEMM GB (x BF16)",
        "temp GiB (x BF16)",
        "ESTIMATE ms (x BF16)",
    ]
    shape = SHAPES[size]
    title = (
        f"{size} block: width {shape['width']}, {shape['heads']} heads, SwiGLU {shape['ffn']}, "
        f"{shape['batch']} x {shape['context']} tokens; deviceless H100, cuBLAS mode, "
        "attention a stand-in (its kernels under 'attention' where XLA keeps them apart)"
    )
    return title + "\n\n" + train_steps.table(rows, header)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Split]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8B,1B")
    parser.add_argument("--variants", default="bf16,delayed,delayed-cold,current")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    check_names(parser, args.sizes.split(","), names)
    if deviceless.h100_topology() is None:
        sys.exit("no CUDA plugin: install fp8jax[h100] for the deviceless H100 compile")
    if names[0] != "bf16":
        names = ["bf16", *names]
    print(f"jax {jax.__version__}; fp8jax.gpu_compiler_options(); kernels per step by kind")
    out = {}
    for size in args.sizes.split(","):
        out[size] = {n: split(compile_deviceless(size, n)) for n in names}
        print("\n" + table(size, out[size]), flush=True)
    return out


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    main()

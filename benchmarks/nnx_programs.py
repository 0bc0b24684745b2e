"""The NNX train step's programs, compiled for an H100 without one (not timed).

    python benchmarks/nnx_programs.py | tee benchmarks/results/nnx_programs.txt

Session 45 changed two things in `fp8jax.nnx_train_step`: it runs delayed scaling's warm
start only until every scale is recorded and a program without it after (as
`fp8jax.make_train_step` has since session 31; before, an NNX model ran the first program
at every step), and `fp8jax.nnx_update_fp8_state` merges every layer's state at once
(`merge_many`, as `fp8jax.apply_updates` does; before, layer by layer). A Llama-3 SwiGLU
feed-forward sub-block in Flax NNX (`x + down(silu(gate(n)) * up(n))`, `n` the RMS-normed
`x`; BF16 parameters and activations, every Linear FP8 with `fp8jax.DelayedScaling()`, SGD)
at the Llama-3-8B and Llama-3.2-1B widths, 8,192 tokens; each program as `fp8jax.inspect`
compiles the step (cuBLAS mode: the options the step compiles with), beside the same
sub-block's BF16 step (`nnx.value_and_grad` and `optimizer.update`, compiled with
`fp8jax.gpu_compiler_options()`) and the same sub-block in Equinox, its step written with
`fp8jax.filter_grad` and `fp8jax.apply_updates` (SGD), traced and compiled as the train
steps' program once every scale is recorded: kernels, FP8 GEMMs, HBM bytes outside the GEMMs
(`fp8jax.hlo_cost`'s categories) and temp memory. The step before session 45 is its first
program with each layer's state merged alone (`merge_many` of one layer at a time, which is
what each layer's `merge` did).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.core.compile_options import traced_for, traced_options  # noqa: E402
from fp8jax._src.ops.warm_start import once_recorded  # noqa: E402

#: width, SwiGLU width, tokens (batch x context as `llama_block.SHAPES`).
SIZES = {"8B": (4096, 14336, 8192), "1B": (2048, 8192, 8192)}
TX = optax.sgd(1e-3)
#: Every Linear FP8, delayed scaling.
CONFIG = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(), exclude=None)


class SwiGLU(nnx.Module):
    """Llama-3's feed-forward sub-block with its RMSNorm and residual, in BF16."""

    def __init__(self, width: int, ffn: int, rngs: nnx.Rngs):
        linear = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.norm = nnx.RMSNorm(width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.gate = nnx.Linear(width, ffn, **linear)
        self.up = nnx.Linear(width, ffn, **linear)
        self.down = nnx.Linear(ffn, width, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        n = self.norm(x)
        return x + self.down(jax.nn.silu(self.gate(n)) * self.up(n))


class EqxSwiGLU(eqx.Module):
    """`SwiGLU` in Equinox."""

    norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, ffn: int, key: jax.Array):
        keys = jax.random.split(key, 3)
        linear = dict(use_bias=False, dtype=jnp.bfloat16)
        self.norm = eqx.nn.RMSNorm(width, dtype=jnp.bfloat16)
        self.gate = eqx.nn.Linear(width, ffn, key=keys[0], **linear)
        self.up = eqx.nn.Linear(width, ffn, key=keys[1], **linear)
        self.down = eqx.nn.Linear(ffn, width, key=keys[2], **linear)

    def __call__(self, x: jax.Array) -> jax.Array:
        n = jax.vmap(self.norm)(x)
        hidden = jax.nn.silu(jax.vmap(self.gate)(n)) * jax.vmap(self.up)(n)
        return x + jax.vmap(self.down)(hidden)


def fp8_eqx(width: int, ffn: int) -> EqxSwiGLU:
    """The Equinox sub-block, its Linears FP8."""
    return fp8jax.fp8_linear_layers(EqxSwiGLU(width, ffn, jax.random.key(0)), CONFIG)


def eqx_step(model: EqxSwiGLU, x: jax.Array) -> EqxSwiGLU:
    """SGD's step on the Equinox sub-block, its FP8 state merged by `apply_updates`."""
    overwrites, grads = fp8jax.partition_for_grad_overwrite(fp8jax.filter_grad(loss)(model, x))
    updates = jax.tree.map(lambda g: -1e-3 * g, eqx.filter(grads, eqx.is_inexact_array))
    return fp8jax.apply_updates(model, updates, overwrites)


def loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


@contextlib.contextmanager
def layer_by_layer() -> Iterator[None]:
    """`Fp8DotGeneral.merge_many` merging one op at a time, inside the `with`."""
    merge_many = fp8jax.Fp8DotGeneral.merge_many

    def one_by_one(pairs: list[tuple[Any, Any]]) -> list[Any]:
        return [merge_many([pair])[0] for pair in pairs]

    fp8jax.Fp8DotGeneral.merge_many = one_by_one
    try:
        yield
    finally:
        fp8jax.Fp8DotGeneral.merge_many = merge_many


def bf16_step(model: SwiGLU, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    value, grads = nnx.value_and_grad(loss)(model, x)
    optimizer.update(model, grads)
    return value


def row(name: str, report: fp8jax.Inspection, base: fp8jax.Inspection | None) -> list[str]:
    """`name`'s kernels, FP8 GEMMs, non-GEMM GB and temp MiB, each x `base`'s where given."""
    cost, memory = report.cost["cublas"], report.memory["cublas"]
    kernels = sum(k.runs for k in cost.kernels)
    other = sum(k.bytes * k.runs for k in cost.kernels if k.category is not None)
    temp = memory.temp_size_in_bytes
    if base is None:
        return [name, str(kernels), str(report.count("cublas")[0]), f"{other / 1e9:.2f}",
                f"{temp / 2**20:.1f}"]  # fmt: skip
    b_cost, b_memory = base.cost["cublas"], base.memory["cublas"]
    b_kernels = sum(k.runs for k in b_cost.kernels)
    b_other = sum(k.bytes * k.runs for k in b_cost.kernels if k.category is not None)
    b_temp = b_memory.temp_size_in_bytes
    return [
        name,
        f"{kernels} ({kernels / b_kernels:.2f}x)",
        str(report.count("cublas")[0]),
        f"{other / 1e9:.2f} ({other / b_other:.2f}x)",
        f"{temp / 2**20:.1f} ({temp / b_temp:.3f}x)",
    ]


def main() -> None:
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode")
    for size, (width, ffn, tokens) in SIZES.items():

        def build(fp8: bool, width: int = width, ffn: int = ffn) -> Any:
            model = SwiGLU(width, ffn, nnx.Rngs(0))
            if fp8:
                model = fp8jax.fp8_linear_layers(model, CONFIG)
            return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

        x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
        bf16 = fp8jax.inspect(bf16_step, *nnx.eval_shape(lambda: build(False)), x,
                              modes=("cublas",))  # fmt: skip
        fp8_model = nnx.eval_shape(lambda: build(True))
        fp8 = fp8jax.inspect(fp8jax.nnx_train_step(loss), *fp8_model, x, modes=("cublas",))
        with layer_by_layer():
            before = fp8jax.inspect(fp8jax.nnx_train_step(loss), *fp8_model, x, modes=("cublas",))
        eqx_model = eqx.filter_eval_shape(fp8_eqx, width, ffn)
        gpu = fp8jax.gpu_compiler_options()
        recorded = traced_for(gpu, once_recorded(eqx_step))
        equinox = fp8jax.inspect(
            recorded, eqx_model, x, modes=("cublas",), compiler_options=traced_options(gpu)
        )
        rows = [
            row("BF16 (nnx.value_and_grad)", bf16, None),
            row("FP8 before session 45: every step", before.first_steps, bf16),
            row("FP8, first steps", fp8.first_steps, bf16),
            row("FP8, once every scale is recorded", fp8, bf16),
            row("Equinox FP8 (apply_updates), once every scale is recorded", equinox, bf16),
        ]
        header = ["program", "kernels", "FP8 GEMMs", "non-GEMM GB", "temp MiB"]
        print(f"\n{size} feed-forward: width {width}, SwiGLU {ffn}, {tokens} tokens\n")
        print(table(rows, header), flush=True)


if __name__ == "__main__":
    main()

"""Where delayed scaling's steady state writes its transposed FP8 copies: GPT MLPs compiled for
an H100 without one, every copy from the cast against the default and every copy apart.

    JAX_PLATFORMS=cpu python benchmarks/steady_copies.py | tee benchmarks/results/steady_copies.txt

Each case is one train step of `fp8jax.examples.gpt.MLP` (every Linear FP8, `DelayedScaling()`)
traced as `fp8jax.make_train_step` runs it once every scale is recorded (cuBLAS mode, inside
`skip_warm_start(recorded=True)`, merged by `fp8jax.apply_updates`), in three forms:

- `fused`: every transposed copy written by the cast (`transposes_apart(())`; fp8jax's default
  before session 42);
- `default`: as traced by default (the output gradients' copies apart,
  `per_tensor.KNOWN_SCALE_APART`);
- `all apart`: every copy transposed from its FP8 values by a kernel of its own
  (`transposes_apart()`).

It prints kernels per step, the HBM bytes of the non-GEMM kernels and temp memory
(`memory_analysis`), each as a ratio to `fused`: read from the compiled HLO, not timed. The
Llama-3 block's figures are `llama_block.py`'s (`delayed-steady`, `-fused`, `-apart`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import llama_block  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.core.compile_options import cublas_traced  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax._src.recipes.per_tensor import skip_warm_start, transposes_apart  # noqa: E402
from fp8jax.examples.gpt import MLP  # noqa: E402

#: (width, tokens, bias) of each MLP `width -> 4 width -> width`.
CASES = ((1024, 4096, False), (2048, 2048, True), (4096, 8192, False), (8192, 8192, False))
#: The forms compared, `fused` first (the ratios' base).
FORMS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "fused": lambda: transposes_apart(()),
    "default": contextlib.nullcontext,
    "all apart": transposes_apart,
}


def steady_step(form: Callable[[], contextlib.AbstractContextManager[None]]) -> Callable:
    """The steady-state train step of an FP8 MLP, traced inside `form()`."""

    def step(model, x):
        with cublas_traced(), skip_warm_start(recorded=True), form():
            loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
            grads = fp8jax.filter_grad(loss)(model, x)
            overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
            return fp8jax.apply_updates(model, grads, overwrites)

    return step


def measure(width: int, tokens: int, bias: bool, form: str) -> llama_block.Split:
    """The `llama_block.Split` of one case's step in `form`, compiled for one H100."""
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling())
    mlp = fp8jax.fp8_linear_layers(MLP(width, 1, bias, key=jax.random.key(0)), config)
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
    device = deviceless.h100_topology().devices[0]
    lowered, _ = deviceless.lower(steady_step(FORMS[form]), (mlp, x), {}, device)
    return llama_block.split(lowered.compile(compiler_options=fp8jax.gpu_compiler_options()))


def main() -> None:
    print(f"jax {jax.__version__}; fp8jax.gpu_compiler_options(); deviceless H100\n")
    rows = []
    for width, tokens, bias in CASES:
        splits = {form: measure(width, tokens, bias, form) for form in FORMS}
        base = splits["fused"]
        for form, s in splits.items():
            moved, base_moved = sum(s.non_gemm_bytes.values()), sum(base.non_gemm_bytes.values())
            rows.append(
                [
                    f"{width} x {tokens}{', bias' if bias else ''}",
                    form,
                    f"{s.kernel_count} ({s.kernel_count - base.kernel_count:+d})",
                    f"{moved / 1e6:.1f} ({moved / base_moved:.3f}x)",
                    f"{s.temp_bytes / 2**20:.1f} ({s.temp_bytes / base.temp_bytes:.3f}x)",
                ]
            )
    header = ["MLP width x tokens", "form", "kernels", "non-GEMM MB (x fused)"]
    header.append("temp MiB (x fused)")
    print(table(rows, header))


if __name__ == "__main__":
    main()

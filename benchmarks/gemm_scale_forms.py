"""Per-tensor FP8 GEMMs: how the scales reach cuBLASLt, in kernels (issue 38).

    python benchmarks/gemm_scale_forms.py | tee benchmarks/results/gemm_scale_forms.txt

A Llama block's per-tensor step (delayed scaling without the warm start, deviceless,
`llama_block.py`) runs one tiny kernel per FP8 GEMM besides the GEMM: 21 fusions of 8-20
bytes that multiply the two operands' `scale_inv` (each `1 / scale`) into the GEMM's alpha.
This compiles one 4096^3 E4M3 GEMM with BF16 output for an H100 (deviceless, fp8jax's XLA
options) in the forms fp8jax could write it, and counts its kernels (`fp8jax.hlo_cost`) and
the GEMM custom calls:

- `alpha` (fp8jax's `per_tensor_dot` by default): `dot(a8, b8) * (sa_inv * sb_inv)`;
- `alpha, given`: the same with the product given, not computed in the step;
- `dequantized`: `dot(a8 * sa_inv, b8 * sb_inv)` in BF16, the pattern XLA's GEMM rewriter
  turns into cuBLASLt's FP8 GEMM with both scales as its own operands (`per_tensor_dot`
  with delayed scaling's kept inverses, traced for cuBLAS mode: `cublas_traced`);
- `dequantized, 1 / scale`: the same with each `scale_inv` computed from the scale in the
  step;
- `dequantized, float32`: the operands dequantized to float32.

Each in cuBLAS mode (`fp8jax.gpu_compiler_options()`) and under XLA's default flags, where
a GEMM of dequantized operands is a Triton GEMM of BF16 copies (`dots` says the operand
types of the GEMM that runs). Nothing runs on a GPU: the compiled HLO is read.

Then (session 41) where a scale computed in the step goes: current scaling's cast of one
8192 x 4096 BF16 operand (`CurrentScaling().quantize`, its amax reduced in the step) against
the amax alone and the amax with one elementwise operation after it, in cuBLAS mode, kernel
by kernel: XLA reduces a tensor to a scalar in two kernels and fuses nothing after the
reduction into them, so a scale (or its inverse, or alpha) computed from an amax is a kernel
of its own.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402

F8, BF16, F32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32
DIMS = (((1,), (1,)), ((), ()))
N = 4096


def alpha(a, b, sa_inv, sb_inv):
    return lax.dot_general(a, b, DIMS, preferred_element_type=BF16) * (sa_inv * sb_inv).astype(BF16)


def alpha_given(a, b, product, unused):
    del unused
    return lax.dot_general(a, b, DIMS, preferred_element_type=BF16) * product.astype(BF16)


def dequantized(a, b, sa_inv, sb_inv):
    a, b = a.astype(BF16) * sa_inv.astype(BF16), b.astype(BF16) * sb_inv.astype(BF16)
    return lax.dot_general(a, b, DIMS, preferred_element_type=BF16)


def dequantized_reciprocal(a, b, sa, sb):
    return dequantized(a, b, 1.0 / sa, 1.0 / sb)


def dequantized_f32(a, b, sa_inv, sb_inv):
    a, b = a.astype(F32) * sa_inv, b.astype(F32) * sb_inv
    return lax.dot_general(a, b, DIMS, preferred_element_type=F32).astype(BF16)


FORMS = {
    "alpha": alpha,
    "alpha, given": alpha_given,
    "dequantized": dequantized,
    "dequantized, 1 / scale": dequantized_reciprocal,
    "dequantized, float32": dequantized_f32,
}


MODES = {"cuBLAS": fp8jax.gpu_compiler_options(), "XLA defaults": {}}


def gemm_operands(hlo: str) -> str:
    """The GEMM that runs: a cuBLAS custom call, or the operand types of the dots in the
    compiled module (a Triton GEMM's)."""
    calls = sorted(set(re.findall(r'custom_call_target="(__cublas[^"]+)"', hlo)))
    if calls:
        return ", ".join(calls)
    dots = re.findall(r"= \w+\[[\d,]*\]\{[^}]*\} dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    types = set()
    for lhs, rhs in dots:
        for name in (lhs, rhs):
            found = re.search(rf"%{re.escape(name)} = (\w+)\[", hlo)
            types.add(found.group(1) if found else "?")
    return "Triton dot of " + " x ".join(sorted(types))


def main() -> None:
    print(f"jax {jax.__version__}; one {N}^3 E4M3 GEMM, BF16 out, deviceless H100")
    print()
    print("| form | mode | kernels | GEMM | other kernels (bytes) |")
    print("|---|---|---|---|---|")
    args = (jax.ShapeDtypeStruct((N, N), F8),) * 2 + (jax.ShapeDtypeStruct((), F32),) * 2
    device = deviceless.h100_topology().devices[0]
    for name, form in FORMS.items():
        lowered, _ = deviceless.lower(form, args, {}, device)
        for mode, options in MODES.items():
            hlo = lowered.compile(compiler_options=options).as_text()
            kernels = fp8jax.hlo_cost(hlo).kernels
            others = [f"{k.name} ({k.bytes})" for k in kernels if k.category is not None]
            row = [name, mode, str(len(kernels)), gemm_operands(hlo), ", ".join(others) or "-"]
            print("| " + " | ".join(row) + " |")


def reduction_epilogues() -> None:
    """Kernels of an amax, an amax with an operation after it, and current scaling's cast."""
    recipe = fp8jax.CurrentScaling()
    cases = {
        "`max(abs(x))`": lambda x: jnp.max(jnp.abs(x)),
        "`max(abs(x)) * 2`": lambda x: jnp.max(jnp.abs(x)).astype(F32) * 2,
        "`CurrentScaling().quantize(x, ...)`": lambda x: recipe.quantize(
            x, recipe.init_state("input"), "input", -1
        ),
    }
    print()
    print("One 8192 x 4096 BF16 operand, cuBLAS mode: its kernels and the bytes each moves")
    print()
    print("| computation | kernels | each kernel (bytes written and read) |")
    print("|---|---|---|")
    device = deviceless.h100_topology().devices[0]
    x = jax.ShapeDtypeStruct((8192, 4096), BF16)
    for name, fn in cases.items():
        lowered, _ = deviceless.lower(fn, (x,), {}, device)
        hlo = lowered.compile(compiler_options=fp8jax.gpu_compiler_options()).as_text()
        kernels = fp8jax.hlo_cost(hlo).kernels
        each = ", ".join(f"{k.name} ({k.bytes})" for k in kernels)
        print(f"| {name} | {len(kernels)} | {each} |")


if __name__ == "__main__":
    main()
    reduction_epilogues()

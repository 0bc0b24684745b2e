"""Current scaling's scale kernels: folding the scale's inverse into the amax reduction, tried.

    JAX_PLATFORMS=cpu python benchmarks/current_inverse_fold.py [--sizes 1B,8B] \
        | tee benchmarks/results/current_inverse_fold.txt

Issue 38: current scaling's Llama-block step has 128 kernels (2.00x BF16's; target 1.6x),
21 of them a kernel of a few bytes per GEMM that multiplies its two operands' scale
inverses into cuBLASLt's alpha, because XLA fuses nothing that follows a reduction into it
(`RESULTS.md`, session 42). With power-of-two scales the inverse is a monotone function of
the amax, `h(a) = 1 / pow2(floor_log2(min(fp8_max / a * 2**-margin, 2**126)))`, so
`max(h(|x|)) = h(max(|x|))`: a reduction can output the inverse itself, which cuBLASLt takes
as the operand's own scale (the form delayed scaling's kept inverses use), with no scalar
kernel after it. The cast takes the same power of two as today's scale and the state keeps
the amax and scale `CurrentScaling` keeps.

`FoldedInverse` does that (an experiment, not a recipe of the library), in four forms:
`current-fold`, `h` by a division per element, reduced beside the amax, the cast multiplying
by `1 / inverse`; `current-bits`, each element's scale exponent from its float32 bits
(`bit_exponents`, no division) and the amax, the scale and the inverse in one variadic
reduction, the cast taking the reduced scale; `-rows`, either with a maximum per row first
and the final reductions over the row maxima (the per-element work of today's amax).
Printed per size: the Llama-3 block step of `llama_block.py` compiled for an H100 without one
(cuBLAS mode, XLA's dot merger off as the train steps compile: `OPTIONS`), kernels by kind
and GEMMs, beside BF16 and `current`; and checks on the CPU that the bits give
`compute_scale`'s exponents for every BF16 value and that each folded form computes
`current`'s numbers bit for bit (output and gradients of a small MLP, float32 and BF16).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jaxtyping import Array  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import llama_block  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.core.amax import batch_shared  # noqa: E402
from fp8jax._src.core.compile_options import cublas_traced, is_cublas_traced, traced_options  # noqa: E402
from fp8jax._src.core.formats import floor_log2, fp8_max, pow2, quantize, widen  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax._src.recipes.base import QTensor  # noqa: E402
from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE, compute_scale  # noqa: E402


def exponent_rule(fmt_max: float, margin: float) -> tuple[int, int]:
    """`(K, threshold)`: a float32 `m * 2**E` (`m` in `[1, 2)`, mantissa bits `i`) whose
    `fmt_max / a` is a normal float32 has `compute_scale`'s scale exponent
    `K - E - (i > threshold)` (before its cap at 126): rounding commutes with the power of two,
    so the exponent of `fl(fl(fmt_max / m) * 2**-margin)` decides, which is `K` up to a
    threshold mantissa and `K - 1` above it (a binary search over the 2**23 mantissas, in
    float32 as `compute_scale` computes). Exact for E4M3 and E5M2 with a margin below 2."""
    fmax, factor = np.float32(fmt_max), np.float32(2.0 ** -float(margin))

    def exponent(i: int) -> int:
        m = np.float32(1.0 + i / 2.0**23)
        return int(np.frexp(np.float32(np.float32(fmax / m) * factor))[1]) - 1

    top, lo, hi = exponent(0), 0, 2**23 - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if exponent(mid) == top else (lo, mid - 1)
    return top, lo


def bit_exponents(a: Array, fmt_max: float, margin: float) -> Array:
    """Each element's scale exponent from its float32 bits (no division): `exponent_rule`'s,
    capped at 126, which zero, subnormals, inf and NaN get (`(biased + 1) & 0xFF` is 0 for
    the 255 of inf and NaN), so that they leave the minimum and maximum to the others."""
    top, threshold = exponent_rule(fmt_max, margin)
    bits = lax.bitcast_convert_type(widen(a), jnp.int32)
    shifted = ((bits >> 23) + 1) & 0xFF
    above = ((bits & (2**23 - 1)) > threshold).astype(jnp.int32)
    return jnp.minimum(top + 128 - shifted - above, 126)


def exp2_bits(exponent: Array) -> Array:
    """`2.0**exponent` as float32 from its bits (normal results)."""
    return lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def amax_scale_inverse(a: Array, fmt_max: float, margin: float) -> tuple[Array, Array, Array]:
    """`current-bits`' one variadic reduction of `a = |x|` over every axis: its amax (by a
    maximum), each element's scale (by a minimum) and inverse (by a maximum), in float32."""
    e = bit_exponents(a, fmt_max, margin)
    return lax.reduce(
        (widen(a), exp2_bits(e), exp2_bits(-e)),
        (np.float32(0), np.float32(2.0**126), np.float32(2.0**-126)),
        lambda p, q: (lax.max(p[0], q[0]), lax.min(p[1], q[1]), lax.max(p[2], q[2])),
        tuple(range(a.ndim)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldedInverse(fp8jax.CurrentScaling):
    """`CurrentScaling` whose amax reduction also outputs the scale's inverse, handed to the
    GEMM as the operand's own scale (in cuBLAS mode, with power-of-two scales). `rows`:
    reduced per row first, the final reductions over the row maxima. `bits`: each element's
    scale and inverse from its bits (`bit_exponents`), reduced with the amax in one
    variadic reduction (the amax by a maximum, the scale by a minimum, the inverse by a
    maximum), the cast taking the reduced scale as it is; else the inverse from a division
    per element, reduced beside the amax, the cast multiplying by its inverse."""

    rows: bool = False
    bits: bool = False

    @property
    def kept_inverses(self) -> bool:
        return self.power_of_two and is_cublas_traced()

    def transposes_apart(self, role: str) -> bool:
        del role
        return False  # the cast waits for the amax, as `current`'s does

    def quantize(self, x: Array, state: Any, role: str, axis: Any) -> tuple[Any, Any]:
        if not self.kept_inverses:
            return super().quantize(x, state, role, axis)
        fmt_max = np.float32(fp8_max(self.format(role)))
        factor = np.float32(2.0 ** -float(self.margin))

        def inverse(a: Array) -> Array:
            fresh = jnp.minimum((fmt_max / a.astype(jnp.float32)) * factor, np.float32(MAX_SCALE))
            return 1.0 / pow2(floor_log2(fresh))

        def reduce(v: Array) -> tuple[Array, ...]:
            a = jnp.abs(v)
            if self.rows:
                a = jnp.max(a.reshape(-1, a.shape[-1]), axis=-1)
            if self.bits:
                return amax_scale_inverse(a, float(fmt_max), float(self.margin))
            every = tuple(range(a.ndim))
            amax = lax.reduce(a, np.array(0, a.dtype), lax.max, every).astype(jnp.float32)
            # Init h(0) = 2**-126: an all-zero operand's inverse, as `h` gives it.
            inv = lax.reduce(inverse(a), np.float32(2.0**-126), lax.max, every)
            return amax, 1.0 / inv, inv

        amax, scale, inv = batch_shared(reduce, "amax, scale, inverse")(x, state.scale)
        _, new_state = self._scale_with(amax, state, role)
        return QTensor(quantize(x, scale, self.format(role)), inv), new_state


#: As `fp8jax.make_train_step` compiles a step for cuBLAS: XLA's dot merger off (a merger
#: of q/k/v's GEMMs, which share their dequantized input in the folded forms, gives a BF16
#: GEMM), which `llama_block.py`'s compile leaves on.
OPTIONS = traced_options(fp8jax.gpu_compiler_options())

VARIANTS = {
    "current-fold": FoldedInverse(),
    "current-fold-rows": FoldedInverse(rows=True),
    "current-bits": FoldedInverse(bits=True),
    "current-bits-rows": FoldedInverse(bits=True, rows=True),
}


def value_and_grad(recipe: Any, mlp: eqx.Module, x: Array) -> Any:
    """The loss `sum(mlp(x)**2)` and its gradient, every Linear of `mlp` FP8 with `recipe`,
    traced for cuBLAS (jitted on the CPU)."""
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p: Any) -> Array:
        return jnp.sum(jax.vmap(eqx.combine(p, static))(x).astype(jnp.float32) ** 2)

    with cublas_traced():
        return jax.jit(jax.value_and_grad(loss))(params)


def exponents_check() -> str:
    """`bit_exponents` against `compute_scale`'s exponent for every positive BF16 value (and
    zero, inf, NaN: the cap), E4M3 and E5M2, margins 0 and 1."""
    lines = []
    values = np.arange(0, 0x8000, dtype=np.uint16).view(jnp.bfloat16)
    a = jnp.asarray(values)
    for fmt in ("e4m3", "e5m2"):
        for margin in (0.0, 1.0):
            fmt_max = fp8_max(fmt)
            got = np.asarray(bit_exponents(a, fmt_max, margin))
            scale = compute_scale(
                a.astype(jnp.float32), np.float32(2.0**126), fmt_max, margin, True
            )
            want = np.asarray(floor_log2(scale))
            finite = np.isfinite(np.asarray(a, np.float32))
            same = np.array_equal(got[finite], want[finite]) and np.all(got[~finite] == 126)
            lines.append(f"{fmt} margin {margin}: {'all' if same else 'NOT all'} {a.size} equal")
    return "\n".join(lines)


def bits_check() -> str:
    """Whether `FoldedInverse` (each form of `VARIANTS`, traced for cuBLAS) computes
    `CurrentScaling`'s output and gradients bit for bit on the CPU: a 2-layer MLP, float32
    and BF16, with a margin, a zero input row and inputs of very different magnitudes."""
    lines = []
    for dtype in (jnp.float32, jnp.bfloat16):
        key = jax.random.PRNGKey(0)
        mlp = eqx.nn.MLP(256, 128, 512, 1, key=key, dtype=dtype)
        x = jax.random.normal(jax.random.PRNGKey(1), (64, 256), dtype) * 30.0
        x = x.at[3].set(0.0).at[5].multiply(1e-4)
        run = functools.partial(value_and_grad, mlp=mlp, x=x)
        want = run(fp8jax.CurrentScaling(margin=1.0))
        for name, folded in VARIANTS.items():
            got = run(dataclasses.replace(folded, margin=1.0))
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
            )
            lines.append(f"{jnp.dtype(dtype).name} {name}: {'bit for bit' if same else 'DIFFERS'}")
    return "\n".join(lines)


def ptx_counts() -> str:
    """The amax's reduction kernels (XLA's partial one, which reads the operand, and its
    final one) of one 8192 x 4096 BF16 operand compiled for an H100: PTX instructions and
    global loads of each, plain (`max(|x|)`) and with `current-bits`' variadic reduction
    (most of a partial kernel is its unrolled loop over the elements)."""

    def plain(x: Array) -> Array:
        return jnp.max(jnp.abs(x)).astype(jnp.float32)

    def bits(x: Array) -> tuple[Array, ...]:
        return amax_scale_inverse(jnp.abs(x), fp8_max("e4m3"), 0.0)

    x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
    device = deviceless.h100_topology().devices[0]
    lines = []
    for name, fn in (("max(|x|)", plain), ("current-bits", bits)):
        lowered, _ = deviceless.lower(fn, (x,), {}, device)
        with tempfile.TemporaryDirectory() as folder:
            options = {**OPTIONS, "xla_dump_to": folder, "xla_dump_emitter_re": "^ptx$"}
            lowered.compile(compiler_options=options)
            texts = [p.read_text() for p in sorted(Path(folder).rglob("*.ptx"))]
        counts = []
        for text in texts:
            ops = [
                line.split()[0]
                for line in map(str.strip, text.splitlines())
                if line and not line.startswith(("//", ".", "{", "}", ")")) and ":" not in line
            ]
            loads = sum(op.startswith("ld.global") for op in ops)
            counts.append((loads, len(ops)))
        kernels = ", ".join(f"{n} instructions ({g} global loads)" for g, n in sorted(counts))
        lines.append(f"{name}: {len(counts)} kernels, {kernels}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1B,8B")
    args = parser.parse_args(argv)
    llama_block.check_names(parser, args.sizes.split(","))
    llama_block.RECIPES.update(VARIANTS)
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode; Llama-3 block step")
    print("\nScale exponents from the bits against compute_scale's, every BF16 value >= 0:")
    print(exponents_check())
    print("\nCPU numerics against CurrentScaling (output and gradients):")
    print(bits_check(), flush=True)
    print("\nThe amax's reduction kernels of one 8192 x 4096 BF16 operand, their PTX (H100):")
    print(ptx_counts(), flush=True)
    for size in args.sizes.split(","):
        rows = []
        for name in ("bf16", "current", *VARIANTS):
            lowered = llama_block.lower_deviceless(size, name)
            compiled = lowered.compile(compiler_options=OPTIONS)
            s = llama_block.split(compiled)
            kernels = fp8jax.hlo_cost(compiled.as_text()).kernels
            small = [k for k in kernels if 0 < k.bytes <= 64]
            divides = sum("divide" in k.name for k in small)
            # Element-wise work XLA left out of the amax's and cast's kernels: a weight's BF16
            # cast alone, a predicate written out.
            apart = sum(
                k.name.startswith("wrapped_convert") or "compare" in k.name for k in kernels
            )
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s.kernels.items()))
            fp8, bf16 = (s.kernels.get(f"GEMM {k}", 0) for k in ("fp8", "bf16"))
            scalar = f"{len(small)} ({divides})"
            gb = f"{sum(s.non_gemm_bytes.values()) / 1e9:.2f}"
            rows.append(
                [name, str(s.kernel_count), f"{fp8} / {bf16}", scalar, str(apart), gb, kinds]
            )
        print(f"\n{size} block, {llama_block.SHAPES[size]}\n")
        print(
            table(
                rows,
                [
                    "variant",
                    "kernels",
                    "GEMMs FP8 / BF16",
                    "kernels of <= 64 bytes (divides)",
                    "converts, predicates apart",
                    "non-GEMM GB",
                    "by kind",
                ],
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

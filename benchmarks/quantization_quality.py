"""Quantization quality of each format and recipe: MSE and SNR, outliers, GEMM error.

    python benchmarks/quantization_quality.py [--size 4096] [--gemm-size 4096]

Prints, in one run:

1. MSE and SNR (dB) of BF16, per-tensor E4M3 and E5M2, blockwise (1 x 128 tiles and
   128 x 128 blocks), MXFP8 and residual FP8 on an N(0, 1) `size x size` tensor;
2. the same after replacing 0.1 % of the entries by outliers at 1e2 ... 1e6 times the typical
   magnitude: SNR over the ordinary entries and over all;
3. each recipe's relative error on a `gemm-size`^3 GEMM against float32 (via
   `fp8jax.Fp8DotGeneral`, forward);
4. the residual recipe's options: the `W_lo` scale predicted from `W_hi`'s, the
   "NormalFloat-aware" 3-sigma scale, and error feedback, with what each costs.

Everything runs on the CPU; quantization is exact there (XLA rounds to FP8 as the GPU does).
SNR = 10 log10(sum x^2 / sum (x - x^)^2).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from train_steps import positive_int

import fp8jax


def snr_db(x: np.ndarray, xq: np.ndarray, mask: np.ndarray | None = None) -> float:
    x, xq = np.asarray(x, np.float64), np.asarray(xq, np.float64)
    if mask is not None:
        x, xq = x[mask], xq[mask]
    noise = np.sum((x - xq) ** 2)
    return float("inf") if noise == 0 else 10 * np.log10(np.sum(x**2) / noise)


def mse(x, xq) -> float:
    return float(np.mean((np.asarray(x, np.float64) - np.asarray(xq, np.float64)) ** 2))


def _qdq(recipe, role, x):
    q, _ = recipe.quantize(x, recipe.init_state(role, x.shape), role, -1)
    terms = q.terms if isinstance(q, fp8jax.QTerms) else (q,)
    return sum(t.dequantize() for t in terms)


# Per-tensor scales are powers of two by default; these keep fp8_max / amax exactly.
EXACT = fp8jax.CurrentScaling(power_of_two=False)
EXACT_E5M2 = fp8jax.CurrentScaling(forward_format="e5m2", power_of_two=False)


def quantizers() -> dict:
    """name -> jitted x (rows, cols) -> real values after quantization."""
    tensor = {
        "BF16": lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
        "E4M3 per-tensor": lambda x: _qdq(fp8jax.CurrentScaling(), "input", x),
        "E4M3 per-tensor, exact scale": lambda x: _qdq(EXACT, "input", x),
        "E5M2 per-tensor": lambda x: _qdq(fp8jax.CurrentScaling(forward_format="e5m2"), "input", x),
        "E5M2 per-tensor, exact scale": lambda x: _qdq(EXACT_E5M2, "input", x),
        "blockwise 1x128 tiles": lambda x: _qdq(fp8jax.BlockwiseScaling(), "input", x),
        "blockwise 128x128 blocks": lambda x: _qdq(fp8jax.BlockwiseScaling(), "kernel", x),
        "MXFP8 1x32": lambda x: _qdq(fp8jax.MXFP8(), "input", x),
        "residual E4M3 hi+lo": lambda x: _qdq(fp8jax.ResidualFP8(), "kernel", x),
    }
    return {name: jax.jit(f) for name, f in tensor.items()}


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])


def section_gaussian(x: jax.Array, qs: dict) -> None:
    print("\n## 1. N(0, 1) tensor", x.shape)
    rows = []
    for name, q in qs.items():
        xq = np.asarray(q(x))
        rows.append([name, f"{mse(x, xq):.3e}", f"{snr_db(x, xq):.1f}"])
    print(table(rows, ["format", "MSE", "SNR dB"]))


def section_outliers(x: jax.Array, qs: dict, rng: np.random.Generator) -> None:
    print("\n## 2. 0.1 % outliers at k x the typical magnitude (SNR dB: ordinary / all)")
    positions = rng.random(x.shape) < 1e-3
    signs = np.where(rng.random(x.shape) < 0.5, -1.0, 1.0)
    factors = [1e2, 1e3, 1e4, 1e5, 1e6]
    rows = {name: [name] for name in qs}
    for k in factors:
        xo = np.where(positions, signs * k, np.asarray(x)).astype(np.float32)
        for name, q in qs.items():
            xq = np.asarray(q(jnp.asarray(xo)))
            rows[name].append(f"{snr_db(xo, xq, ~positions):.1f} / {snr_db(xo, xq):.1f}")
    print(table(list(rows.values()), ["format"] + [f"{k:.0e}x" for k in factors]))


def section_gemm(n: int, rng: np.random.Generator) -> None:
    print(f"\n## 3. GEMM {n}^3 (x (n, n) . w (n, n)^T), relative Frobenius error vs float32")
    x = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), jnp.float32)
    dims = (((1,), (1,)), ((), ()))
    exact = np.asarray(lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST), np.float64)
    # Chunk groups keep the block recipes' partial products at 4 x (n, n) float32.
    recipes = {
        "E4M3 per-tensor (current)": fp8jax.CurrentScaling(),
        "E4M3 per-tensor (current), exact scale": EXACT,
        "blockwise (DeepSeek-V3)": fp8jax.BlockwiseScaling(),
        "MXFP8": fp8jax.MXFP8(),
        "residual, 2 GEMMs": fp8jax.ResidualFP8(),
        "residual, split activation, 3 GEMMs": fp8jax.ResidualFP8(split_activation=True),
    }
    rows = []
    bf16 = lax.dot_general(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32
    )
    rows.append(["BF16 inputs, float32 accumulation", _rel(bf16, exact)])
    for name, recipe in recipes.items():
        dot = fp8jax.Fp8DotGeneral(recipe)
        out = jax.jit(lambda x, w, dot=dot: dot(x, w, dims))(x, w)
        rows.append([name, _rel(out, exact)])
    print(table(rows, ["recipe", "relative error"]))


def section_bf16_bias(rng: np.random.Generator, pairs: int = 20) -> None:
    """The scale factor of a BF16-output GEMM: a bias when it is rounded to BF16."""
    print(
        "\n## 5. BF16 outputs: least-squares ratio to the float64 product of the same FP8 "
        f"values, 256 x 512 x 384, {pairs} random scale pairs"
    )
    from fp8jax._src.recipes.base import per_tensor_dot

    x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.standard_normal((384, 512)), jnp.float8_e4m3fn)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T

    def ratio(sx, sw, exact_scales, pow2=False):
        if pow2:  # what power-of-two scales give: each inverse a power of two
            sx, sw = (np.float32(2.0 ** np.floor(np.log2(s))) for s in (sx, sw))
        qx, qw = fp8jax.QTensor(x, jnp.float32(sx)), fp8jax.QTensor(w, jnp.float32(sw))
        out = np.asarray(per_tensor_dot(qx, qw, -1, -1, None, jnp.bfloat16, exact_scales))
        ref = exact * np.float64(np.float32(sx)) * np.float64(np.float32(sw))
        return float(np.sum(out.astype(np.float64) * ref) / np.sum(ref * ref))

    forms = {
        "factor rounded to BF16 (before: arbitrary scales, applied in BF16)": {
            "exact_scales": True
        },
        "exact scales, applied in float32 (power_of_two=False)": {"exact_scales": False},
        "power-of-two scales, applied in BF16 (the default)": {
            "exact_scales": True,
            "pow2": True,
        },
    }
    scales = np.exp(rng.uniform(-6, 6, (pairs, 2))).astype(np.float32)
    rows = []
    for name, kwargs in forms.items():
        ratios = [ratio(sx, sw, **kwargs) for sx, sw in scales]
        first = ratios[0]
        worst = max(abs(r - 1) for r in ratios)
        rows.append([name, f"{first:.5f}", f"{100 * worst:.3f} %"])
    print(table(rows, ["form", "ratio, first pair", "worst |ratio - 1|"]))


def _rel(out, exact) -> str:
    out = np.asarray(out, np.float64)
    return f"{np.linalg.norm(out - exact) / np.linalg.norm(exact):.2e}"


def _time(f, *args, repeat: int = 5) -> float:
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - start) / repeat


def section_residual_options(x: jax.Array, rng: np.random.Generator) -> None:
    print("\n## 4. Residual FP8 options (on the N(0, 1) tensor as a weight)")
    variants = {
        "measured W_lo scale (default)": fp8jax.ResidualFP8(),
        "predicted W_lo scale": fp8jax.ResidualFP8(predict_lo_scale=True),
        "NF-aware (3 sigma) W_hi scale": fp8jax.ResidualFP8(nf_aware=True),
    }
    rows = []
    base_time = None
    for name, recipe in variants.items():
        f = jax.jit(lambda x, recipe=recipe: _qdq(recipe, "kernel", x))
        seconds = _time(f, x)
        base_time = base_time or seconds
        rows.append([name, f"{snr_db(x, np.asarray(f(x))):.1f}", f"{seconds / base_time:.2f}"])
    amax_single = jax.jit(lambda x: _qdq(fp8jax.CurrentScaling(), "kernel", x))
    rows.append(
        ["E4M3 per-tensor, amax scale", f"{snr_db(x, np.asarray(amax_single(x))):.1f}", "-"]
    )
    # The combination fp8jax refuses: with W_hi saturating, predicted W_lo scales overflow.
    combo = dict(nf_aware=True, predict_lo_scale=True)
    recipe = object.__new__(fp8jax.ResidualFP8)
    for field in fp8jax.ResidualFP8.__dataclass_fields__.values():
        object.__setattr__(recipe, field.name, combo.get(field.name, field.default))
    refused = jax.jit(lambda x: _qdq(recipe, "kernel", x))
    rows.append(
        [
            "NF-aware + predicted (refused by ResidualFP8)",
            f"{snr_db(x, np.asarray(refused(x))):.1f}",
            "-",
        ]
    )
    three_sigma = jnp.float32(448.0) / (3 * jnp.std(x))
    nf_single = np.asarray(fp8jax.dequantize(fp8jax.quantize(x, three_sigma, "e4m3"), three_sigma))
    rows.append(["E4M3 per-tensor, 3-sigma scale (NF-aware)", f"{snr_db(x, nf_single):.1f}", "-"])
    print(table(rows, ["variant", "SNR dB", "quantize time vs default (CPU)"]))

    print("\nError feedback: a weight drifting slowly over 64 steps (W_t = W + t * 1e-4 * D),")
    print("error of the time-averaged quantized weight against the time-averaged weight:")
    n = 512
    w0 = jnp.asarray(rng.standard_normal((n, n)) * 0.02, jnp.float32)
    drift = jnp.asarray(rng.standard_normal((n, n)) * 0.02, jnp.float32)
    rows = []
    for feedback in (False, True):
        recipe = fp8jax.ResidualFP8(error_feedback=feedback)
        state = recipe.init_state("kernel", (n, n))
        step = jax.jit(lambda w, s, r=recipe: r.quantize(w, s, "kernel", -1))
        total_q = jnp.zeros((n, n))
        total_w = jnp.zeros((n, n))
        for t in range(64):
            w = w0 + t * 1e-4 * drift
            q, state = step(w, state)
            total_q = total_q + sum(term.dequantize() for term in q.terms)
            total_w = total_w + w
        err = float(jnp.linalg.norm(total_q - total_w) / jnp.linalg.norm(total_w))
        per_step = float(
            jnp.linalg.norm(sum(t.dequantize() for t in q.terms) - w) / jnp.linalg.norm(w)
        )
        rows.append(
            [
                "on" if feedback else "off",
                f"{err:.2e}",
                f"{per_step:.2e}",
                f"{4 * n * n if feedback else 0} B",
            ]
        )
    print(
        table(
            rows,
            [
                "error feedback",
                "time-averaged rel. error",
                "last-step rel. error",
                "extra state (this weight)",
            ],
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=positive_int, default=4096)
    parser.add_argument("--gemm-size", type=positive_int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"# Quantization quality (jax {jax.__version__}, {jax.devices()[0].platform})")
    x = jnp.asarray(rng.standard_normal((args.size, args.size)), jnp.float32)
    qs = quantizers()
    section_gaussian(x, qs)
    section_outliers(x, qs, rng)
    section_gemm(args.gemm_size, rng)
    section_residual_options(x, rng)
    section_bf16_bias(rng)


if __name__ == "__main__":
    main()

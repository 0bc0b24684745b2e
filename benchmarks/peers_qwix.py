"""fp8jax against Qwix's FP8 quantized training, on the same Flax NNX model.

    pip install -e ".[peers]"   # qwix, beside the test and h100 extras
    python benchmarks/peers_qwix.py | tee benchmarks/results/peers_qwix.txt

Qwix (Google's JAX quantization library) trains in FP8 through its `QtProvider`: a `QtRule`
with `weight_qtype` and `act_qtype` E4M3 and `bwd_qtype` E5M2 quantizes both operands of every
`dot_general` of a Flax model, forward and backward, with scales computed from each call's
own amax (dynamic range), by default one per row of the activations and one per output
channel of the weights (`disable_channelwise_axes=True`: one per tensor; `tile_size=128`:
1 x 128 tiles along the contraction, DeepSeek-V3's activations). It applies to Flax models
only (Linen and NNX), so the model here is NNX: Llama-3's feed-forward sub-block of
`nnx_programs.py` (RMSNorm, SwiGLU `gate` / `up` / `down` without bias, the residual; BF16
parameters and activations), at Llama-3-8B's and Llama-3.2-1B's widths, 8,192 tokens, one
SGD step (`nnx.value_and_grad` and `optimizer.update`; fp8jax's NNX layers through
`fp8jax.nnx_train_step`, its program once every scale is recorded).

Three measures, nothing timed:

- **The step compiled for an H100 without one** (jax's CUDA plugin, deviceless): how many
  GEMMs run on FP8 tensor cores, read by `fp8jax.inspect` in both of XLA's modes (cuBLAS
  mode, `fp8jax.gpu_compiler_options()`, and XLA's defaults), and in cuBLAS mode the
  kernels per step, the HBM bytes of the kernels outside the GEMMs, temp memory and the
  cost model's ESTIMATE of the step's time, each beside the BF16 step's.
- **Numerics on the CPU** (XLA computes FP8 dots exactly there): the step's output and its
  three weight gradients at a smaller size (`NUMERICS`), relative Frobenius error against the
  same step in float64 (the BF16 parameters and input widened). fp8jax's delayed scaling is
  measured at its second step on the batch (scales recorded from the first, as training runs
  it); the other recipes and Qwix scale from the call's own amax.
- **Why the errors differ**: the output's error with every GEMM emulated in NumPy
  (`EMULATIONS`, each a `Scheme`: per tensor or per channel, power-of-two scales or not,
  the scaling in float64 or rounded to BF16 at each step as a computation in BF16 rounds
  it), each beside the variant that computes that scheme.

`peers_qwix_train.py` trains a small GPT with both libraries.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU writes the PTX of the native kernels (blockwise) only when the process starts
# with these set; `fp8jax.inspect` reads them to prove the kernels' FP8 `wgmma`.
os.environ.setdefault("MOSAIC_GPU_DUMP_PTX", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_TO", tempfile.mkdtemp(prefix="fp8jax_qwix_mosaic_"))

import importlib.metadata  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from nnx_programs import TX, SwiGLU, bf16_step, loss  # noqa: E402
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402

try:
    import qwix
except ImportError:  # pragma: no cover - the peers extra
    qwix = None

#: width, SwiGLU width, tokens: the two Llama widths of `nnx_programs.SIZES`.
SIZES = {"8B": (4096, 14336, 8192), "1B": (2048, 8192, 8192)}
#: The numerics' shape (CPU): Llama-3.2-1B's widths, 512 tokens.
NUMERICS = (2048, 8192, 512)
FP8, GRAD = jnp.float8_e4m3fn, jnp.float8_e5m2

#: fp8jax's recipes here, every Linear FP8.
FP8JAX: dict[str, fp8jax.Recipe] = {
    "fp8jax delayed": fp8jax.DelayedScaling(),
    "fp8jax current": fp8jax.CurrentScaling(),
    "fp8jax blockwise": fp8jax.BlockwiseScaling(),
}


def qwix_rules() -> dict[str, Any]:
    """Qwix's FP8 quantized training, three ways: its default scales (per row of the
    activations, per output channel of the weights), per tensor, and 1 x 128 tiles."""
    fp8 = dict(module_path=".*", weight_qtype=FP8, act_qtype=FP8, bwd_qtype=GRAD)
    return {
        "qwix (per channel)": qwix.QtRule(**fp8),
        "qwix per tensor": qwix.QtRule(**fp8, disable_channelwise_axes=True),
        "qwix 1x128 tiles": qwix.QtRule(**fp8, tile_size=128),
    }


def variants() -> list[str]:
    """Every variant's name, BF16 first."""
    return ["bf16", *FP8JAX, *qwix_rules()]


def build(name: str, width: int, ffn: int) -> tuple[SwiGLU, Callable[..., Any]]:
    """Variant `name` of the sub-block (concrete BF16 parameters) and its train step
    `step(model, optimizer, x)`."""
    model = SwiGLU(width, ffn, nnx.Rngs(0))
    if name in FP8JAX:
        config = fp8jax.Fp8Config(recipe=FP8JAX[name], exclude=None)
        return fp8jax.fp8_linear_layers(model, config), fp8jax.nnx_train_step(loss)
    if name != "bf16":
        provider = qwix.QtProvider([qwix_rules()[name]])
        # Qwix runs an NNX model once to intercept its ops; the values do not matter.
        model = qwix.quantize_model(model, provider, jnp.zeros((8, width), jnp.bfloat16))
    return model, bf16_step


def compiled(name: str, width: int, ffn: int, tokens: int) -> fp8jax.Inspection:
    """Variant `name`'s step inspected in both of XLA's modes (deviceless H100)."""
    model, step = build(name, width, ffn)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
    return fp8jax.inspect(step, model, optimizer, x, modes=("cublas", "default"))


def measures(report: fp8jax.Inspection) -> dict[str, float]:
    """Kernels, non-GEMM bytes, temp bytes and the ESTIMATE (s) of `report`'s cuBLAS mode."""
    cost = report.cost["cublas"]
    return {
        "kernels": sum(k.runs for k in cost.kernels),
        "bytes": sum(k.bytes * k.runs for k in cost.kernels if k.category is not None),
        "temp": report.memory["cublas"].temp_size_in_bytes,
        "seconds": cost.estimate_seconds(),
    }


def compile_row(name: str, report: fp8jax.Inspection, base: dict[str, float]) -> list[str]:
    """The compile table's row of `name`."""
    m = measures(report)
    ratio = lambda key: f"({m[key] / base[key]:.2f}x)"  # noqa: E731
    fp8 = " / ".join(f"{report.count(mode)[0]}/{report.count(mode)[1]}" for mode in report.gemms)
    return [
        name,
        fp8,
        f"{m['kernels']} {ratio('kernels')}",
        f"{m['bytes'] / 1e9:.2f} {ratio('bytes')}",
        f"{m['temp'] / 2**20:.0f} {ratio('temp')}",
        f"{m['seconds'] * 1e3:.2f} {ratio('seconds')}",
    ]


def relative_error(got: Any, want: Any) -> float:
    """`|got - want| / |want|` (Frobenius), in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def outputs_and_grads(
    model: Any, x: jax.Array, fp8: bool = False
) -> tuple[jax.Array, list[jax.Array]]:
    """The sub-block's output on `x` and the gradients of `loss` for `gate`, `up`, `down`
    (`fp8`: an fp8jax model, differentiated with its FP8 state)."""
    grads = (fp8jax.nnx_value_and_grad(loss) if fp8 else nnx.grad(loss))(model, x)
    grads = grads[1] if fp8 else grads
    kernels = [grads[name]["kernel"][...] for name in ("gate", "up", "down")]
    return model(x), kernels


def reference(width: int, ffn: int, x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """`outputs_and_grads` of the BF16 sub-block in float64 (parameters and input widened)."""
    model = SwiGLU(width, ffn, nnx.Rngs(0))
    graph, state = nnx.split(model)
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: a.astype(jnp.float64), state)
        model = nnx.merge(graph, wide)
        for layer in (model.norm, model.gate, model.up, model.down):
            layer.dtype = jnp.float64
        return jax.tree.map(np.asarray, outputs_and_grads(model, x.astype(jnp.float64)))


def numerics(name: str, x: jax.Array, want: tuple[Any, list[Any]]) -> list[str]:
    """Variant `name`'s output and gradient errors against `want` (float64)."""
    width, ffn, _ = NUMERICS
    model, step = build(name, width, ffn)
    if name == "fp8jax delayed":  # its second step on the batch: scales recorded
        step(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), x)
    out, grads = outputs_and_grads(model, x, fp8=name in FP8JAX)
    errors = [relative_error(out, want[0])]
    errors += [relative_error(g, w) for g, w in zip(grads, want[1], strict=True)]
    return [name, *(f"{e:.4e}" for e in errors)]


def rounded(a: np.ndarray, dtype: Any) -> np.ndarray:
    """`a` rounded to `dtype` by ml_dtypes' cast from float32 (correctly rounded where `a`
    is a float32, else after rounding to one), back in float64."""
    return np.asarray(a, np.float32).astype(dtype).astype(np.float64)


class Scheme(NamedTuple):
    """A rounding scheme `emulated_dot` follows: E4M3 operands at absmax scales, one per
    tensor or per row of `a` and column of `w` (`per_channel`), exact or rounded up to a
    power of two (`power_of_two`), everything else in float64 but the BF16 output and, with
    `bf16_operand`, the scaled operand rounded to BF16 before its E4M3 cast, with `bf16_rest`
    also the scale, the FP8 product before its scales and each scaling (a computation in
    BF16 rounds all four)."""

    per_channel: bool
    power_of_two: bool = False
    bf16_operand: bool = False
    bf16_rest: bool = False


def emulated_dot(a: np.ndarray, w: np.ndarray, scheme: Scheme) -> np.ndarray:
    """`a (M, K) @ w (K, N)` in E4M3, rounded as `scheme` says."""
    keep = lambda v: v  # noqa: E731
    bf16 = lambda v: rounded(v, ml_dtypes.bfloat16)  # noqa: E731
    operand_bf16 = bf16 if scheme.bf16_operand else keep
    rest_bf16 = bf16 if scheme.bf16_rest else keep
    quantized = []
    for operand, axis in ((a, 1), (w, 0)):
        amax = np.max(np.abs(operand), axis=axis if scheme.per_channel else None, keepdims=True)
        scale = rest_bf16(amax / float(ml_dtypes.finfo(FP8).max))
        if scheme.power_of_two:  # max / amax rounded down to a power of two: its inverse up
            scale = 2.0 ** np.ceil(np.log2(scale))
        q = np.clip(operand_bf16(operand / scale), -448.0, 448.0)
        quantized.append((rounded(q, ml_dtypes.float8_e4m3fn), scale))
    (qa, sa), (qw, sw) = quantized
    return bf16(rest_bf16(rest_bf16(rest_bf16(qa @ qw) * sa) * sw))


#: The emulated schemes, each beside the variant that computes it (if one does).
EMULATIONS: dict[str, tuple[Scheme, str | None]] = {
    "per tensor, power-of-two scales": (Scheme(False, power_of_two=True), "fp8jax current"),
    "per tensor": (Scheme(False), None),
    "per tensor, bf16 scaling": (
        Scheme(False, bf16_operand=True, bf16_rest=True),
        "qwix per tensor",
    ),
    "per channel": (Scheme(True), None),
    "per channel, bf16 scaled operand only": (Scheme(True, bf16_operand=True), None),
    "per channel, bf16 scaling": (
        Scheme(True, bf16_operand=True, bf16_rest=True),
        "qwix (per channel)",
    ),
}


def emulated(x: jax.Array, scheme: Scheme) -> np.ndarray:
    """The sub-block's output on `x` with every GEMM `emulated_dot(..., scheme)` (its
    RMSNorm, SwiGLU and residual in BF16), from the parameters `build` gives every variant."""
    model = SwiGLU(*NUMERICS[:2], nnx.Rngs(0))
    w = {k: np.asarray(getattr(model, k).kernel[...], np.float64) for k in ("gate", "up", "down")}
    n = np.asarray(model.norm(x), np.float64)
    gate, up = (emulated_dot(n, w[k], scheme) for k in ("gate", "up"))
    hidden = jax.nn.silu(jnp.asarray(gate, jnp.bfloat16)) * jnp.asarray(up, jnp.bfloat16)
    out = emulated_dot(np.asarray(hidden, np.float64), w["down"], scheme)
    return rounded(np.asarray(x, np.float64) + out, ml_dtypes.bfloat16)


def main() -> None:
    if qwix is None:
        raise SystemExit("peers_qwix.py needs qwix: pip install -e '.[peers]'")
    versions = {p: importlib.metadata.version(p) for p in ("jax", "flax", "qwix")}
    print(", ".join(f"{p} {v}" for p, v in versions.items()))
    for size, (width, ffn, tokens) in SIZES.items():
        reports = {name: compiled(name, width, ffn, tokens) for name in variants()}
        base = measures(reports["bf16"])
        rows = [compile_row(name, r, base) for name, r in reports.items()]
        header = ["variant", "FP8 GEMMs (cuBLAS / default)", "kernels", "non-GEMM GB",
                  "temp MiB", "ESTIMATE ms"]  # fmt: skip
        print(f"\n{size} feed-forward: width {width}, SwiGLU {ffn}, {tokens} tokens; "
              "deviceless H100, x BF16's in cuBLAS mode\n")  # fmt: skip
        print(table(rows, header), flush=True)
    width, ffn, tokens = NUMERICS
    x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.bfloat16)
    want = reference(width, ffn, x)
    rows = [numerics(name, x, want) for name in variants()]
    header = ["variant", "output", "d gate", "d up", "d down"]
    print(f"\nNumerics (CPU): width {width}, SwiGLU {ffn}, {tokens} tokens; relative Frobenius "
          "error against the same step in float64\n")  # fmt: skip
    print(table(rows, header), flush=True)
    measured = {row[0]: row[1] for row in rows}
    rows = [
        [label, f"{relative_error(emulated(x, scheme), want[0]):.4e}",
         "-" if name is None else f"{name}: {measured[name]}"]
        for label, (scheme, name) in EMULATIONS.items()
    ]  # fmt: skip
    print(
        "\nThe output's error with every GEMM emulated in NumPy: E4M3 operands at absmax scales "
        "per tensor or per row and output channel, in float64 but for the E4M3 casts and the "
        "BF16 output; 'bf16 scaling' rounds the scale, the scaled operand before its E4M3 "
        "cast, the product before its scales and each scaling to BF16, as a BF16 "
        "computation does; 'bf16 scaled operand only' the scaled operand alone\n"
    )
    print(table(rows, ["emulation", "output", "measured"]), flush=True)


if __name__ == "__main__":
    main()

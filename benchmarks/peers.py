"""fp8jax against its peers, side by side in one run: FP8 GEMMs on H100, memory, CPU time.

    python benchmarks/peers.py [--steps 5] [--models mlp,mlp-remat,linears,gpt]

Models (the same shapes for everyone): an MLP 1024 -> 4096 -> 1024 over 2,048 tokens (`mlp`),
the same MLP with its GELU rematerialized (`jax.checkpoint`; `mlp-remat`), its two Linears
alone (residuals only; `linears`), and the tiny GPT of `fp8jax.examples.gpt` (2 layers, width
256, 8 sequences of 256 tokens; `gpt`). `--models` runs those named, default all (an unknown
name is refused before anything is built); the targets are those of the models run. Variants:

- `bf16`: the baseline, every GEMM in BF16;
- `fp8jax <recipe>`: `fp8jax.fp8_linear_layers` with each recipe;
- `haliax fp8`: Haliax 1.4.dev453's `Fp8DotGeneralOp` (quantize-dequantize form);
- `flax direct`: Flax's `fp8_scaled_dot_general`, the op behind `Fp8DirectDotGeneralOp`.

The peers' ops are injected into the same Equinox models through the `dot_general` slot of
`fp8jax.Linear` (Haliax's and Flax's modules take any `dot_general`), so the layers, shapes,
the high-precision head and the BF16 compute of everything else are identical. Parameters are
float32 masters cast to BF16 in the loss; the step is plain SGD, identical for all.

Columns: GEMMs on FP8 tensor cores out of all GEMMs of the train step compiled for an H100
without a GPU (cuBLAS-only, fp8jax's options, and default XLA flags, where the inspector reads
each Triton kernel's PTX); bytes of residuals the forward saves for the backward
(`jax.ad_checkpoint.print_saved_residuals`, excluding the parameters and inputs themselves);
temp memory of the H100 executable (`memory_analysis`); CPU compile and step time, each as a
ratio to the BF16 baseline of the same model. Then the targets. The estimated H100 step time
of larger GPTs is `cost_model.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# fp8jax's native kernels (Pallas Mosaic GPU) are proven FP8 from their PTX, which the plugin
# dumps only when the process starts with these set (fp8jax.inspect reads the folder).
os.environ.setdefault("MOSAIC_GPU_DUMP_PTX", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_TO", tempfile.mkdtemp(prefix="fp8jax_peers_mosaic_"))

import equinox as eqx  # noqa: E402
import haliax.quantization as haxq  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402
from jax.ad_checkpoint import print_saved_residuals  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax.examples.gpt import GPT, MLP, GPTConfig, dense, next_token_loss  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_steps  # noqa: E402
from train_steps import RECIPES, table  # noqa: E402

#: `--models`' names, each a model of `models()` by its title, in the order they run.
MODELS = {
    "mlp": "MLP 1024-4096-1024, 2048 tokens",
    "mlp-remat": "same MLP, GELU rematerialized",
    "linears": "its two Linears alone (no activation), residuals only",
    "gpt": "tiny GPT (2 x 256, 2048 tokens)",
}

# --- peers, behind the dot_general slot ----------------------------------------------------


class FlaxDirect(fp8jax.OverwriteWithGradient):
    """Flax 0.12's `Fp8DirectDotGeneralOp` as an Equinox module: the same state (Flax stores
    the reciprocal scales) and the same call into `fp8_ops.fp8_scaled_dot_general`."""

    input_scale: jax.Array
    kernel_scale: jax.Array
    output_grad_scale: jax.Array
    input_amax_history: jax.Array
    kernel_amax_history: jax.Array
    output_grad_amax_history: jax.Array

    def __init__(self, history: int = 1024):
        one, zeros = jnp.ones((1,), jnp.float32), jnp.zeros((history,), jnp.float32)
        self.input_scale = self.kernel_scale = self.output_grad_scale = one
        self.input_amax_history = self.kernel_amax_history = zeros
        self.output_grad_amax_history = zeros

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision, preferred_element_type
        lhs = lhs.astype(rhs.dtype)
        return fp8_ops.fp8_scaled_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            preferred_element_type=lhs.dtype,
            lhs_scale=self.input_scale,
            rhs_scale=self.kernel_scale,
            grad_scale=self.output_grad_scale,
            lhs_amax_history=self.input_amax_history,
            rhs_amax_history=self.kernel_amax_history,
            grad_amax_history=self.output_grad_amax_history,
            quantize_compute_type=rhs.dtype,
        )


def _is_state(x) -> bool:
    return isinstance(x, fp8jax.OverwriteWithGradient | haxq.OverwriteWithGradient)


def variant(model, name: str):
    """`model` converted for variant `name`."""
    if name == "bf16" or name.startswith("fp8jax"):
        return train_steps.variant(model, name)
    op = {"haliax fp8": lambda: haxq.Fp8DotGeneralOp.init(), "flax direct": FlaxDirect}[name]
    converted = fp8jax.fp8_linear_layers(model)  # the same layers, then swap the op

    def swap(leaf):
        return (
            eqx.tree_at(lambda m: m.dot_general, leaf, op())
            if isinstance(leaf, fp8jax.Linear)
            else leaf
        )

    return jax.tree.map(swap, converted, is_leaf=lambda x: isinstance(x, fp8jax.Linear))


def to_bf16(model):
    """Float parameters in BF16; FP8 state (of any library) untouched."""
    return train_steps.to_bf16(model, _is_state)


def train_step(loss, name: str):
    """`train_steps.train_step` with the library's own gradient, split and update."""
    if name == "haliax fp8":
        return train_steps.train_step(
            loss, eqx.filter_value_and_grad, haxq.partition_for_grad_overwrite,
            haxq.apply_updates, to_bf16,
        )  # fmt: skip
    ours = name.startswith("fp8jax") or name == "bf16"
    value_and_grad = fp8jax.filter_value_and_grad if ours else eqx.filter_value_and_grad
    return train_steps.train_step(loss, value_and_grad, cast=to_bf16)


# --- measurements --------------------------------------------------------------------------


def residual_bytes(loss, model, batch) -> int:
    """Bytes of what the forward saves for the backward, parameters and inputs excluded.

    The float inputs are differentiated too, as when the model sits behind other layers (so the
    first layer's dgrad, and what it needs, count for everyone)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    floats = [eqx.is_inexact_array(b) for b in batch]

    def f(params, *diff):
        it = iter(diff)
        full = [next(it) if is_float else b for b, is_float in zip(batch, floats, strict=True)]
        return loss(to_bf16(eqx.combine(params, static)), *full)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, params, *(b for b, fl in zip(batch, floats, strict=True) if fl))
    total = 0
    for line in out.getvalue().splitlines():
        match = re.match(r"(\w+)\[([\d,]*)\]", line)
        if not match or "from the argument" in line:
            continue
        dtype, dims = match.groups()
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        total += size * (1 if dtype.startswith(("f8", "bool")) else 2 if "16" in dtype else 4)
    return total


def h100_figures(step, model, batch) -> dict:
    figures = {}
    for mode in ("cublas", "default"):
        try:
            report = fp8jax.inspect(step, model, *batch, modes=(mode,))
        except Exception as e:  # noqa: BLE001 - a failed compile is a result here
            first = str(e).strip().splitlines()[0][:90]
            figures[mode] = f"fails: {first}"
            continue
        fp8, total = report.count(mode)
        figures[mode] = f"{fp8}/{total}"
        figures[mode + " temp"] = report.memory[mode].temp_size_in_bytes
        ours = [g for g in report.gemms[mode] if g.layer is not None]
        figures[mode + " targeted"] = (sum(g.fp8 for g in ours), len(ours))
    return figures


def cpu_times(step, model, batch, steps: int) -> tuple[float, float]:
    start = time.perf_counter()
    compiled = eqx.filter_jit(step).lower(model, *batch).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(model, *batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(model, *batch))
        times.append(time.perf_counter() - start)
    return compile_s, statistics.median(times)


class Linears(eqx.Module):
    """The MLP without its activation: everything it saves for the backward is the Linears'."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __call__(self, x):
        return dense(self.fc2, dense(self.fc1, x))


def models():
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (2048, 1024), jnp.float32)

    mse = train_steps.mse  # activations in BF16, like the parameters

    def linear_loss(m, x):  # saves nothing of its own: every residual is the Linears'
        return jnp.mean(m(x.astype(jnp.bfloat16)).astype(jnp.float32))

    mlp = MLP(1024, 4, False, key=key)
    gpt_config = GPTConfig(layers=2, width=256, heads=4, context=256)
    tokens = jax.random.randint(key, (8, gpt_config.context + 1), 0, gpt_config.vocab)
    return {
        MODELS["mlp"]: (mlp, mse, (x,)),
        MODELS["mlp-remat"]: (MLP(1024, 4, True, key=key), mse, (x,)),
        # Residuals only: its loss has a constant gradient, which XLA folds (slowly) into
        # constants, so its timings would mean nothing.
        MODELS["linears"]: (Linears(mlp.fc1, mlp.fc2), linear_loss, (x,)),
        MODELS["gpt"]: (GPT(gpt_config, key=key), next_token_loss, (tokens,)),
    }


def run_model(title, base, loss, batch, steps, residuals_only=False):
    print(f"\n## {title}\n")
    names = ["bf16", *(f"fp8jax {r}" for r in RECIPES), "haliax fp8", "flax direct"]
    rows, raw = [], {}
    for name in names:
        print(f"  ... {name}", file=sys.stderr, flush=True)
        model = variant(base, name)
        step = train_step(loss, name)
        res = residual_bytes(loss, model, batch)
        if residuals_only:
            raw[name] = dict(residual=res, cublas="-", default="-", compile=np.nan, step=np.nan)
            continue
        h100 = h100_figures(step, model, batch)
        try:
            compile_s, step_s = cpu_times(step, model, batch, steps)
        except Exception as e:  # noqa: BLE001 - a failed run is a result here
            print(f"  {name} fails on the CPU: {str(e).strip()[:200]}", file=sys.stderr)
            compile_s = step_s = float("nan")
        raw[name] = dict(h100, residual=res, compile=compile_s, step=step_s)
    ref = raw["bf16"]
    for name in names:
        r = raw[name]
        temp = [r.get(f"{m} temp") for m in ("cublas", "default")]
        ref_temp = [ref.get(f"{m} temp") for m in ("cublas", "default")]
        rows.append(
            [
                name,
                r["cublas"],
                r["default"],
                f"{r['residual'] / 2**20:.1f} ({r['residual'] / ref['residual']:.2f}x)",
                " / ".join(
                    f"{t / 2**20:.1f} ({t / rt:.2f}x)" if t and rt else "-"
                    for t, rt in zip(temp, ref_temp, strict=True)
                ),
                _ratio(r["compile"], ref["compile"]),
                _ratio(r["step"], ref["step"]),
            ]
        )
    header = [
        "variant",
        "GEMMs on FP8 cores (cuBLAS)",
        "GEMMs on FP8 cores (default)",
        "residuals MiB",
        "H100 temp MiB (cuBLAS / default)",
        "CPU compile",
        "CPU step",
    ]
    print(table(rows, header))
    if not residuals_only:
        print(f"\n(BF16 baseline: CPU compile {ref['compile']:.2f} s, step {ref['step']:.3f} s)")
    return raw


def _ratio(value: float, reference: float) -> str:
    return "-" if np.isnan(value) else f"{value / reference:.2f}"


def targets(results) -> None:
    print("\n## Targets\n")
    lines = []
    for title, raw in results.items():
        for name, r in raw.items():
            # The target is for the options fp8jax compiles with (cuBLAS mode). Under XLA's
            # default flags a deviceless compile gets Triton's default tiles, which upcast FP8
            # to f16 (listed in the table, not a target: a GPU's autotuner chooses there).
            if not name.startswith("fp8jax") or r["cublas"] == "-":
                continue
            fp8, total = r.get("cublas targeted", (0, 0))
            lines.append(
                (
                    f"{title}, {name}, cuBLAS mode: {fp8} of {total} GEMMs of FP8 Linears run on "
                    "FP8 tensor cores",
                    total > 0 and fp8 == total,
                )
            )
    linears = results.get(MODELS["linears"], {})
    for name, r in linears.items():
        if name.startswith("fp8jax"):
            ratio = r["residual"] / linears["bf16"]["residual"]
            lines.append(
                (
                    f"residual bytes of the FP8 Linears, {name}: {ratio:.2f}x BF16 "
                    "(target <= 0.55x)",
                    ratio <= 0.55,
                )
            )
    for title in (MODELS["mlp"], MODELS["mlp-remat"]):
        mlp = results.get(title, {})
        for name, r in mlp.items():
            for mode in ("cublas", "default"):
                t, ref = r.get(f"{mode} temp"), mlp["bf16"].get(f"{mode} temp")
                if name in ("fp8jax delayed", "fp8jax current") and t and ref:
                    lines.append(
                        (
                            f"{title}: H100 temp memory, {name}, {mode}: {t / ref:.2f}x BF16 "
                            "(target <= 0.85x)",
                            t / ref <= 0.85,
                        )
                    )
    for title, raw in results.items():
        if np.isnan(raw["bf16"]["step"]):
            continue
        ours = raw["fp8jax delayed"]["step"] / raw["bf16"]["step"]
        theirs = raw["haliax fp8"]["step"] / raw["bf16"]["step"]
        lines.append(
            (
                f"{title}: CPU step overhead, fp8jax delayed {ours:.2f}x against Haliax "
                f"{theirs:.2f}x",
                ours <= theirs,
            )
        )
    for text, ok in lines:
        print(f"- [{'met' if ok else 'MISSED'}] {text}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=train_steps.positive_int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help=f"among {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    chosen = args.models.split(",")
    for name in chosen:
        if name not in MODELS:
            parser.error(f"--models: unknown model {name!r}; choose among {', '.join(MODELS)}")
    titles = [MODELS[name] for name in MODELS if name in chosen]
    assert deviceless.h100_topology() is not None, "needs the h100 extra"
    print(
        f"# fp8jax against its peers (jax {jax.__version__}, CPU: "
        f"{os.cpu_count()} cores; H100 figures from deviceless compiles)"
    )
    results = {}
    built = models()
    for title in titles:
        model, loss, batch = built[title]
        only = "residuals only" in title
        results[title] = run_model(title, model, loss, batch, args.steps, only)
    targets(results)


if __name__ == "__main__":
    main()

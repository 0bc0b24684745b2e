"""Where the compute cast goes: H100 memory of the README's train step with and without it.

    python benchmarks/compute_cast.py [--quick]

(`--quick`: width 256, 1,024 tokens, SGD and cuBLAS mode only; a smoke test of seconds.)

The README's manual loop (`fp8jax.filter_value_and_grad`, `partition_for_grad_overwrite`, an
optax update, `apply_updates`) on peers.py's MLP (1024 -> 4096 -> 1024 over 2,048 tokens, GELU,
FP8 delayed scaling), float32 master weights, the batch in bfloat16. Variants:

- `fp8, no cast`: the FP8 model called as it is. A Linear's output takes the promoted dtype of
  its input and weight, so with float32 weights it is float32: the GELU, the second Linear's
  input and the gradients that flow back are float32 (the GEMMs still are FP8).
- `fp8, cast in the loss`: `Policy.from_string("params=float32,compute=bfloat16,output=float32")
  .cast_to_compute(model)` first thing inside the loss: BF16 weights for the step, FP8 state
  untouched, master weights and their gradients float32.
- `bf16, cast in the loss`: the same cast, no FP8: the reference of the ratios (peers.py's BF16
  baseline).

Each step is compiled for an H100 without a GPU (`JAX_PLATFORMS=cpu`, the `h100` extra) in
XLA's two modes: `cublas` (`xla_gpu_enable_triton_gemm=False`) and `default`. Columns: the dtype
of the first Linear's output inside the loss, FP8 GEMMs out of all GEMMs, the executable's temp
memory (`memory_analysis().temp_size_in_bytes`) and its total (arguments + outputs + temp -
aliased), each as a ratio to the BF16 row of the same optimizer. Two optimizers: the README's
(`clip_by_global_norm` + `adamw`) and plain SGD (peers.py's step). XLA places temporaries in the
output buffers of the new weights and optimizer state where their lifetimes allow, so temp
alone shrinks as the optimizer's outputs grow; the total shows what the program holds in all.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from train_steps import positive_int  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402
from fp8jax.examples.gpt import MLP  # noqa: E402

POLICY = fp8jax.Policy.from_string("params=float32,compute=bfloat16,output=float32")
VARIANTS = ("fp8, no cast", "fp8, cast in the loss", "bf16, cast in the loss")
MODES = ("cublas", "default")


OPTIMIZERS = {
    "readme": "README's optimizer: clip_by_global_norm(1.0) + adamw(3e-4)",
    "sgd": "plain SGD (peers.py's step)",
}


def optimizer(key: str) -> optax.GradientTransformation:
    if key == "readme":
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))
    return optax.sgd(1e-3)


def mse(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def loss_fn(name: str):
    """The loss of variant `name`: with the compute cast inside, or without."""
    if name == "fp8, no cast":
        return mse
    return lambda model, x: mse(POLICY.cast_to_compute(model), x)


def build(name: str, width: int, ratio: int):
    model = MLP(width, ratio, False, key=jax.random.PRNGKey(0))  # float32 master weights
    if name.startswith("fp8"):
        model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling()))
    return model


def readme_step(loss, optimizer):
    """The README's manual loop, its step body verbatim."""

    def step(model, opt_state, batch):
        loss_value, grads = fp8jax.filter_value_and_grad(loss)(model, batch)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)  # FP8 state out
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = fp8jax.apply_updates(model, updates, overwrites)  # FP8 state back in
        return model, opt_state, loss_value

    return step


def first_linear_dtype(name: str, model, x) -> str:
    """Dtype of the first Linear's output as the loss of `name` computes it."""
    seen = model if name == "fp8, no cast" else POLICY.cast_to_compute(model)
    fc1 = seen.fc1
    call = fc1 if isinstance(fc1, fp8jax.Linear) else jax.vmap(fc1)
    return str(eqx.filter_eval_shape(call, x).dtype)


def measure(name: str, optimizer, width: int, ratio: int, tokens: int, modes=MODES) -> dict:
    model = build(name, width, ratio)
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
    step = readme_step(loss_fn(name), optimizer)
    report = fp8jax.inspect(step, model, opt_state, x, modes=modes)
    out = {"dtype": first_linear_dtype(name, model, x)}
    for mode in modes:
        memory = report.memory[mode]
        out[mode] = "{}/{}".format(*report.count(mode))
        out[f"{mode} temp"] = memory.temp_size_in_bytes
        out[f"{mode} total"] = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
    return out


def table(rows, header) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join(
        [
            fmt(header) + " |",
            "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(fmt(r) + " |" for r in rows),
        ]
    )


def _mib(value: int, reference: int) -> str:
    return f"{value / 2**20:.1f} ({value / reference:.2f}x)"


def main(argv=None) -> dict[str, dict[str, dict]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=1024)
    parser.add_argument("--ratio", type=positive_int, default=4, help="hidden width / width")
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--optimizers", default="readme,sgd", help="among readme, sgd")
    parser.add_argument("--modes", default="cublas,default", help="among cublas, default")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="width 256, 1,024 tokens, SGD, cuBLAS mode: a smoke test of seconds",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.tokens, args.optimizers, args.modes = 256, 1024, "sgd", "cublas"
    keys = [k.strip() for k in args.optimizers.split(",")]
    modes = tuple(m.strip() for m in args.modes.split(","))
    for key in keys:
        if key not in OPTIMIZERS:
            parser.error(f"--optimizers: unknown {key!r}; choose among {', '.join(OPTIMIZERS)}")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown {mode!r}; choose among {', '.join(MODES)}")
    assert deviceless.h100_topology() is not None, "needs the h100 extra"
    hidden = args.ratio * args.width
    print(
        f"# The compute cast: MLP {args.width} -> {hidden} -> {args.width}, {args.tokens} "
        f"tokens, GELU, FP8 delayed scaling, float32 master weights, bfloat16 batch\n"
        f"# (jax {jax.__version__}; deviceless H100 compiles, memory_analysis() of the "
        "executable)"
    )
    results = {}
    for key in keys:
        title = OPTIMIZERS[key]
        raw = {}
        for name in VARIANTS:
            print(f"  ... {title}: {name}", file=sys.stderr, flush=True)
            raw[name] = measure(name, optimizer(key), args.width, args.ratio, args.tokens, modes)
        ref = raw["bf16, cast in the loss"]
        rows = [
            [
                name,
                r["dtype"],
                " / ".join(r[m] for m in modes),
                *(_mib(r[f"{m} temp"], ref[f"{m} temp"]) for m in modes),
                *(_mib(r[f"{m} total"], ref[f"{m} total"]) for m in modes),
            ]
            for name, r in raw.items()
        ]
        label = {"cublas": "cuBLAS", "default": "default"}
        header = [
            "variant",
            "fc1 output",
            f"FP8 GEMMs ({' / '.join(label[m] for m in modes)})",
            *(f"temp MiB, {label[m]}" for m in modes),
            *(f"total MiB, {label[m]}" for m in modes),
        ]
        print(f"\n## {title}\n")
        print(table(rows, header))
        results[key] = raw
    print(
        "\n(x) = ratio to `bf16, cast in the loss` with the same optimizer, in the same mode."
        "\ntotal = arguments + outputs + temp - aliased (no buffer donation)."
    )
    return results


if __name__ == "__main__":
    main()

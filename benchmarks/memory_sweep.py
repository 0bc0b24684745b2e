"""H100 temp memory of FP8 train steps against BF16, over step forms, shapes and frameworks.

    python benchmarks/memory_sweep.py [--cases 0,3,7] [--modes cublas,default] [--apart]

One figure (peers.py's MLP with SGD inside the step) says little about memory: XLA places
temporaries in the buffers of a step's outputs (new weights, optimizer state, gradients)
where their lifetimes allow, so the same layers peak differently when the step returns
its gradients, updates with SGD or Adam, or has its parameters donated. This sweep compiles
the same kind of step in many forms, for an H100 without a GPU (`JAX_PLATFORMS=cpu`, the
`h100` extra), and reads the executable's `memory_analysis().temp_size_in_bytes`:

- the model: a GELU MLP `d -> h -> d` over `tokens` rows, float32 master weights and BF16
  compute (Equinox: `fp8jax.Policy`'s `cast_to_compute` inside the loss, as the README does;
  Flax NNX: `nnx.Linear(dtype=bfloat16, param_dtype=float32)`), the batch in BF16;
- the step: `grads` returns the loss and the gradients (value_and_grad only); `sgd` and
  `adam` update the weights inside the step (optax; NNX through `nnx.Optimizer`);
  `donated` donates the parameters (and optimizer state) to the step;
- the variants: BF16 (no FP8) and `fp8jax.fp8_linear_layers` with `DelayedScaling` and
  `CurrentScaling`; every one takes its gradients through fp8jax's `filter_value_and_grad` /
  `nnx_value_and_grad`;
- two XLA modes: `cublas` (`fp8jax.gpu_compiler_options()`, every GEMM a cuBLAS call) and
  `default` (XLA's defaults).

With `--apart` every step is traced inside `transposes_apart()` (issue 38: the per-tensor
recipes' transposed FP8 copies transposed by kernels of their own, not written by the casts).

It prints one row per case and mode (temp MiB of each variant, FP8 as a ratio to BF16), then
the median and worst ratio of each recipe, per mode and over both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from typing import NamedTuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from train_steps import table  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.observe.deviceless import h100_topology  # noqa: E402
from fp8jax._src.recipes.per_tensor import transposes_apart  # noqa: E402

POLICY = fp8jax.Policy.from_string("params=float32,compute=bfloat16,output=float32")
RECIPES = {"delayed": fp8jax.DelayedScaling(), "current": fp8jax.CurrentScaling()}
VARIANTS = ("bf16", *RECIPES)
MODES = {"cublas": fp8jax.gpu_compiler_options(), "default": {}}


class Case(NamedTuple):
    """One step form and shape."""

    framework: str  # "eqx" or "nnx"
    width: int
    hidden: int
    tokens: int
    form: str  # "grads", "sgd" or "adam"
    donated: bool

    def __str__(self) -> str:
        donated = ", donated" if self.donated else ""
        return (
            f"{self.framework} {self.width}-{self.hidden}-{self.width}, {self.tokens} tok, "
            f"{self.form}{donated}"
        )


CASES = (
    Case("eqx", 1024, 4096, 2048, "grads", True),
    Case("eqx", 1024, 4096, 2048, "grads", False),
    Case("eqx", 1024, 4096, 2048, "sgd", True),
    Case("eqx", 1024, 4096, 2048, "sgd", False),  # peers.py's form
    Case("eqx", 1024, 4096, 2048, "adam", True),
    Case("eqx", 1024, 4096, 2048, "adam", False),
    Case("eqx", 1024, 4096, 8192, "grads", True),
    Case("eqx", 1024, 4096, 8192, "sgd", True),
    Case("eqx", 1024, 4096, 1024, "adam", True),
    Case("eqx", 2048, 8192, 4096, "sgd", True),
    Case("eqx", 4096, 4096, 1024, "grads", True),
    Case("eqx", 2048, 2048, 8192, "adam", True),
    Case("nnx", 1024, 4096, 2048, "grads", True),
    Case("nnx", 1024, 4096, 2048, "sgd", True),
    Case("nnx", 1024, 4096, 2048, "adam", True),
    Case("nnx", 1024, 4096, 2048, "adam", False),  # nnx_train_step's form
    Case("nnx", 1024, 4096, 8192, "adam", True),
)


# --- Equinox -------------------------------------------------------------------------------


class EqxMLP(eqx.Module):
    """`fc2(gelu(fc1(x)))` on every row of `x`."""

    fc1: eqx.Module
    fc2: eqx.Module

    def __init__(self, width: int, hidden: int, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k1)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k2)

    def __call__(self, x):
        return jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


def _eqx_loss(model, x):
    model = POLICY.cast_to_compute(model)  # BF16 weights for the step, FP8 state untouched
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def _eqx_step(form: str, optimizer):
    if form == "grads":

        def grads_step(model, x):
            return fp8jax.filter_value_and_grad(_eqx_loss)(model, x)

        return grads_step

    def step(model, opt_state, x):
        loss, grads = fp8jax.filter_value_and_grad(_eqx_loss)(model, x)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)  # FP8 state out
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    return step


def _optimizer(form: str):
    return optax.adam(1e-3) if form == "adam" else optax.sgd(1e-3)


def eqx_program(case: Case, variant: str):
    """`(fn, donated args, other args)` of one Equinox step."""
    model = EqxMLP(case.width, case.hidden, key=jax.random.PRNGKey(0))
    if variant != "bf16":
        model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPES[variant]))
    x = jax.ShapeDtypeStruct((case.tokens, case.width), jnp.bfloat16)
    if case.form == "grads":
        return _eqx_step("grads", None), (model,), (x,)
    optimizer = _optimizer(case.form)
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    return _eqx_step(case.form, optimizer), (model, opt_state), (x,)


# --- Flax NNX ------------------------------------------------------------------------------


def nnx_program(case: Case, variant: str):
    """`(fn, donated args, other args)` of one NNX step, as a pure function of its state."""
    from flax import nnx

    class NnxMLP(nnx.Module):
        def __init__(self, width: int, hidden: int, rngs: nnx.Rngs):
            kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
            self.fc1 = nnx.Linear(width, hidden, **kw)
            self.fc2 = nnx.Linear(hidden, width, **kw)

        def __call__(self, x):
            return self.fc2(jax.nn.gelu(self.fc1(x)))

    def loss_fn(model, x):
        return jnp.mean(model(x).astype(jnp.float32) ** 2)

    model = NnxMLP(case.width, case.hidden, nnx.Rngs(0))
    if variant != "bf16":
        model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPES[variant]))
    objects = model
    if case.form != "grads":
        objects = (model, nnx.Optimizer(model, _optimizer(case.form), wrt=nnx.Param))
    graphdef, state = nnx.split(objects, graph=True)

    def step(state, x):
        objects = nnx.merge(graphdef, state)
        model = objects if case.form == "grads" else objects[0]
        loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x)
        if case.form == "grads":
            return loss, grads
        if variant != "bf16":
            fp8jax.nnx_update_fp8_state(model, grads)
        objects[1].update(model, grads)
        return loss, nnx.state(objects, nnx.Variable, graph=True)

    x = jax.ShapeDtypeStruct((case.tokens, case.width), jnp.bfloat16)
    return step, (state,), (x,)


# --- compiling -----------------------------------------------------------------------------


def compile_h100(fn, donated: tuple, other: tuple, donate: bool, options: dict):
    """`fn(*donated, *other)` compiled for a deviceless H100, the first arguments donated
    when `donate`. Returns the compiled executable."""
    device = h100_topology().devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = (donated, other)
    dynamic, static = eqx.partition(args, lambda a: eqx.is_array(a) or _is_struct(a))

    def abstract(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    def call(donated_dyn, other_dyn):
        d, o = eqx.combine((donated_dyn, other_dyn), static)
        return eqx.filter(fn(*d, *o), eqx.is_array)

    abstract_args = jax.tree.map(abstract, dynamic)
    jitted = jax.jit(call, donate_argnums=(0,) if donate else ())
    return jitted.lower(*abstract_args).compile(compiler_options=dict(options))


def _is_struct(a) -> bool:
    return isinstance(a, jax.ShapeDtypeStruct)


def program(case: Case, variant: str):
    return (nnx_program if case.framework == "nnx" else eqx_program)(case, variant)


def temp_bytes(case: Case, variant: str, mode: str) -> int:
    fn, donated, other = program(case, variant)
    compiled = compile_h100(fn, donated, other, case.donated, MODES[mode])
    return compiled.memory_analysis().temp_size_in_bytes


# --- report --------------------------------------------------------------------------------


def summary(results: dict) -> list[list[str]]:
    """Median and worst ratio of each recipe, per mode and over all modes."""
    rows = []
    modes = sorted({mode for _, mode in results}, key=list(MODES).index)
    for recipe in RECIPES:
        for scope in (*modes, "all"):
            ratios = [
                r[recipe] / r["bf16"]
                for (case, mode), r in results.items()
                if scope in (mode, "all")
            ]
            worst = max(ratios)
            at_most = sum(q <= 1.0 for q in ratios)
            rows.append(
                [
                    recipe,
                    scope,
                    f"{statistics.median(ratios):.2f}x",
                    f"{worst:.2f}x",
                    f"{at_most} of {len(ratios)}",
                ]
            )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated case numbers (default all)")
    parser.add_argument("--modes", default="cublas,default", help="among cublas, default")
    parser.add_argument(
        "--apart", action="store_true", help="trace inside per_tensor.transposes_apart()"
    )
    args = parser.parse_args(argv)
    cases = list(enumerate(CASES))
    if args.cases:
        chosen = {c.strip() for c in args.cases.split(",")}
        for c in chosen:
            if c not in {str(i) for i, _ in cases}:
                parser.error(f"--cases: unknown case {c!r}; choose among 0 to {len(CASES) - 1}")
        cases = [(i, c) for i, c in cases if str(i) in chosen]
    modes = [m.strip() for m in args.modes.split(",")]
    for mode in modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown {mode!r}; choose among {', '.join(MODES)}")
    if h100_topology() is None:
        sys.exit("needs the h100 extra (jax-cuda12-plugin and -pjrt) and JAX_PLATFORMS=cpu")
    print(
        f"# H100 temp memory of FP8 train steps against BF16 (jax {jax.__version__}; "
        "deviceless compiles, memory_analysis().temp_size_in_bytes)"
        + ("; traced inside transposes_apart()" if args.apart else "")
    )
    results, rows = {}, []
    for i, case in cases:
        for mode in modes:
            print(f"  ... {i}: {case}, {mode}", file=sys.stderr, flush=True)
            with transposes_apart() if args.apart else contextlib.nullcontext():
                r = {v: temp_bytes(case, v, mode) for v in VARIANTS}
            results[(case, mode)] = r
            mib = {v: r[v] / 2**20 for v in VARIANTS}
            rows.append(
                [
                    str(i),
                    str(case),
                    mode,
                    f"{mib['bf16']:.1f}",
                    *(f"{mib[v]:.1f} ({r[v] / r['bf16']:.2f}x)" for v in RECIPES),
                ]
            )
    header = ["#", "case", "XLA mode", "BF16 MiB", *(f"{v} MiB (vs BF16)" for v in RECIPES)]
    print()
    print(table(rows, header))
    print()
    print(table(summary(results), ["recipe", "mode", "median", "worst", "at most BF16"]))
    return results


if __name__ == "__main__":
    main()

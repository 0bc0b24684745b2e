"""Section 3: whole train steps, BF16 against each recipe, measured beside the cost model.

Models (the benchmarks' own builders, `benchmarks/train_steps.py` and `moe_cost.py`):

- peers.py's MLP 1024 -> 4096 -> 1024 over 2,048 tokens, its train step (BF16 compute on
  float32 masters, plain SGD);
- one block of cost_model.py's 1B GPT (width 2048, 16 heads, 4 sequences of 2,048), its
  block step (the input's gradient too, as inside a stack);
- moe_cost.py's MoE layer (Mixtral-like: width 4096, 8 experts of 14336, top-2) and its step.

Each step is compiled once with `fp8jax.gpu_compiler_options()`, timed (median, warm), and
its compiled HLO given to `fp8jax.hlo_cost`, cost_model.py's ESTIMATE (GEMM FLOPs at H100
peaks plus non-GEMM bytes at HBM bandwidth). On a GPU that HLO is the real one; the
estimate is printed beside the measurement, labelled as an estimate. The MLP steps are also
compiled under XLA's default options: the input to the compiler-option default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import moe_cost
import train_steps

import fp8jax
from fp8jax.examples.gpt import Block, GPTConfig

from .record import Recorder
from .timing import compile_and_time

SECTION = "3 train steps"
CUBLAS = fp8jax.gpu_compiler_options()
#: Recipes beyond `train_steps.RECIPES`: the native-kernel recipes on their XLA paths.
XLA_PATHS = {
    "blockwise-xla": fp8jax.BlockwiseScaling(native_kernel=False),
    "residual-xla": fp8jax.ResidualFP8(native_kernel=False),
}


def _recipe(name: str) -> fp8jax.Recipe:
    return {**train_steps.RECIPES, **XLA_PATHS}[name]


Built = tuple[Callable, Callable[[str], tuple], str]


def mlp(mode: str) -> Built:
    """(step, variant name -> step arguments, shape) of peers.py's MLP."""
    width, tokens = (64, 64) if mode == "dry" else (1024, 2048)
    base, loss, batch = train_steps.mlp_case(width=width, tokens=tokens)

    def args(name: str) -> tuple:
        if name == "bf16":
            return (base, *batch)
        config = fp8jax.Fp8Config(recipe=_recipe(name))
        return (fp8jax.fp8_linear_layers(base, config), *batch)

    shape = f"{width} -> {4 * width} -> {width}, {tokens} tokens"
    return train_steps.train_step(loss), args, shape


def gpt_block(mode: str) -> Built:
    """(step, variant -> arguments, shape) of one block of cost_model.py's 1B GPT."""
    shape = dict(train_steps.GPT_SHAPES["1B"])
    if mode == "dry":
        shape.update(width=64, heads=2, context=32, batch=2)
    config = GPTConfig(width=shape["width"], heads=shape["heads"], context=shape["context"])
    key = jax.random.PRNGKey(0)
    block = Block(config, key=key)
    x = jax.random.normal(key, (shape["batch"], shape["context"], shape["width"]), jnp.bfloat16)

    def args(name: str) -> tuple:
        if name == "bf16":
            return block, x
        return fp8jax.fp8_linear_layers(block, fp8jax.Fp8Config(recipe=_recipe(name))), x

    text = "width {width}, {heads} heads, {batch} x {context} tokens".format(**shape)
    return train_steps.block_step(), args, text


def moe(mode: str) -> Built:
    """(step, variant -> arguments, shape) of moe_cost.py's Mixtral-like MoE layer."""
    shape = dict(moe_cost.SHAPES["mixtral"])
    if mode == "dry":
        shape.update(tokens=64, width=64, hidden=128, experts=4)
    elif mode == "quick":
        shape.update(tokens=4096)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (shape["tokens"], shape["width"]), jnp.bfloat16)

    def args(name: str) -> tuple:
        recipe = None if name == "bf16" else _recipe(name)
        return moe_cost.make_model(shape, recipe, None), x

    text = "{tokens} tokens, width {width}, {experts} experts of {hidden}, top-{top_k}"
    return moe_cost.moe_step, args, text.format(**shape)


RECIPES = list(train_steps.RECIPES)
#: The recipes with an FP8 grouped GEMM (ResidualFP8 has none: `Fp8RaggedDot` refuses it).
GROUPED = [n for n in RECIPES if not isinstance(train_steps.RECIPES[n], fp8jax.ResidualFP8)]
#: model -> (builder, {mode: variants}). The dry run compiles few: a CPU compile of a train
#: step takes seconds, and the code path is the same for every recipe.
MODELS: dict[str, tuple[Callable[[str], Built], dict[str, list[str]]]] = {
    "MLP (peers.py)": (
        mlp,
        {
            "full": ["bf16", *RECIPES, *XLA_PATHS],
            "quick": ["bf16", *RECIPES],
            "dry": ["bf16", "delayed"],
        },
    ),
    "1B GPT block (cost_model.py)": (
        gpt_block,
        {
            "full": ["bf16", *RECIPES],
            "quick": ["bf16", "delayed", "blockwise"],
            "dry": ["bf16"],
        },
    ),
    "MoE layer (moe_cost.py mixtral)": (
        moe,
        {"full": ["bf16", *GROUPED], "quick": ["bf16", "delayed"], "dry": ["bf16"]},
    ),
}
#: Variants of the MLP also compiled under XLA's default options.
DEFAULT_OPTIONS = {"full": ["bf16", *RECIPES], "quick": ["bf16", "delayed"], "dry": ["bf16"]}


#: Seconds of the budget a train step's compile and runs may need on a GPU: a step starts
#: only with more left, so that the run ends inside its budget.
STEP_NEED_S = 40.0


def _estimate(hlo: str) -> float:
    """cost_model.py's estimate of a compiled step, in seconds."""
    return fp8jax.hlo_cost(hlo).estimate_seconds()


def _time(built: Built, name: str, options: str, seen: dict, mode: str, runs: int) -> dict:
    """Time variant `name` of a built model under `options` ("cuBLAS options" or "XLA
    defaults"). The dry run keeps fp8jax's choice on a CPU: the XLA path (a CPU compile
    never sees the kernels; section 1 interprets them)."""
    step, args, _ = built
    cublas = options == "cuBLAS options"
    opts = CUBLAS if cublas else {}
    compiled, fields = compile_and_time(step, args(name), opts, runs, dry=False)
    fields["estimate_ms"] = _estimate(compiled.hlo) * 1e3
    fields["options"] = opts
    base = seen.get("bf16" if cublas else "bf16, XLA defaults")
    if base:
        fields["measured_vs_bf16"] = fields["ms"] / base["ms"]
        fields["estimate_vs_bf16"] = fields["estimate_ms"] / base["estimate_ms"]
    seen[name if cublas else f"{name}, XLA defaults"] = fields
    return fields


def _build(builder: Callable[[str], Built], mode: str, built: list) -> dict:
    built.extend(builder(mode))
    return {"shape": built[2]}


def run(rec: Recorder, mode: str, runs: int) -> dict[str, dict[str, Any]]:
    """Time every model's variants; returns `{model: {variant: fields}}`."""
    results: dict[str, dict[str, Any]] = {}
    for model, (builder, by_mode) in MODELS.items():
        variants = by_mode[mode]
        built: list = []
        made = rec.measure(
            SECTION, f"{model} | build", functools.partial(_build, builder, mode, built)
        )
        if made is None:
            continue
        rec.cell(SECTION, "shape", model, made["shape"])
        seen = results.setdefault(model, {})
        jobs = [(name, "cuBLAS options") for name in variants]
        if model.startswith("MLP"):
            jobs += [(name, "XLA defaults") for name in DEFAULT_OPTIONS[mode]]
        for name, options in jobs:
            key = name if options == "cuBLAS options" else f"{name}, XLA defaults"
            measure = functools.partial(_time, tuple(built), name, options, seen, mode, runs)
            result = rec.measure(SECTION, f"{model} | {key}", measure, need_s=STEP_NEED_S)
            if result is None:
                rec.cell(SECTION, key, model, rec.not_run())
            elif "measured_vs_bf16" in result:
                text = "{ms:.3f} ms, {measured_vs_bf16:.2f}x (est. {estimate_vs_bf16:.2f}x)"
                rec.cell(SECTION, key, model, text.format(**result))
            else:
                rec.cell(
                    SECTION, key, model, "{ms:.3f} ms (est. {estimate_ms:.3g} ms)".format(**result)
                )
    return results

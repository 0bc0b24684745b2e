"""Train a small GPT on the King James Bible in BF16 and with each FP8 recipe, side by side.

    python -m fp8jax.examples.train_gpt [--steps 300] [--layers 2] [--width 128] [--out DIR]

Every variant starts from the same weights and sees the same batches (byte-level, context 64):
BF16 compute with float32 master weights, the same model computed in float32 (`fp32`, the
yardstick; `--no-fp32` leaves it out), and BF16 with the attention and MLP Linears in FP8
(`fp8_linear_layers`; embeddings and the output head stay in BF16). At the end it prints the
train loss (in nats, the mean of the last logged ones, about 20 steps), the final validation
loss and its relative difference to BF16's, and the steps per second on this machine (the
median of the windows between the loop's reads, the compile left out), and writes to `--out`
`val_gap.png` (each recipe's validation loss relative to BF16's through training, against the
float32 run's gap to BF16: what finer rounding alone changes) and `scale_history.png` (the
per-layer scales of the delayed recipe). The defaults finish in under 10 minutes on 2 CPU
cores; `--steps`, `--layers`, `--width` and `--batch` scale it up.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import time
from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
import optax

import fp8jax
from fp8jax.examples.data import VOCAB, kjv_bytes, sample, split
from fp8jax.examples.gpt import GPT, GPTConfig, check_arguments, check_seeds, next_token_loss

RECIPES = ("delayed", "current", "blockwise", "mxfp8", "residual")
BLOCK_RECIPES = {"blockwise": fp8jax.BlockwiseScaling, "mxfp8": fp8jax.MXFP8}
#: Variants that measure a choice of the defaults; not run unless asked for with --recipes:
#: per-tensor recipes with Transformer Engine's exact scales instead of powers of two, and the
#: residual recipe with E5M2 gradients instead of E4M3.
EXTRA_VARIANTS = {
    "delayed-exact": fp8jax.DelayedScaling(power_of_two=False),
    "current-exact": fp8jax.CurrentScaling(power_of_two=False),
    "residual-e5m2": fp8jax.ResidualFP8(backward_format="e5m2"),
}
#: The variants without FP8: BF16, which every other variant is compared with, and the BF16
#: model computed in float32, whose gap to BF16 is the yardstick for the recipes' gaps: how far
#: a run lands from BF16 when only the rounding changes, and finer rather than coarser.
REFERENCES = ("bf16", "fp32")
VARIANTS = ("fp32", *RECIPES, *EXTRA_VARIANTS)
POLICY = "params=float32,compute=bfloat16,output=float32"
FP32_POLICY = "params=float32,compute=float32,output=float32"


@dataclasses.dataclass
class Run:
    """What one variant's training recorded: `train[i]`, the loss of step `steps[i]` (on the
    model before that step's update), and `val[i]`, the validation loss after step
    `val_steps[i]`'s update (the model of `val_steps[i] + 1` updates; plots put both at the
    step's number)."""

    name: str
    steps: list[int] = dataclasses.field(default_factory=list)
    train: list[float] = dataclasses.field(default_factory=list)
    val_steps: list[int] = dataclasses.field(default_factory=list)
    val: list[float] = dataclasses.field(default_factory=list)
    scales: dict[str, list[tuple[int, float, float, float]]] = dataclasses.field(
        default_factory=dict
    )
    steps_per_second: float = float("nan")


def build(
    config: GPTConfig, variant: str, key: jax.Array, block_dot: str = "chunked"
) -> eqx.Module:
    """The GPT without FP8 (`variant="bf16"` or `"fp32"`) or with a named FP8 recipe in its
    Linears. `fp32` is the same model as `bf16`: `train` computes it in float32 (`FP32_POLICY`).

    `block_dot="dequantized"` runs the block recipes' GEMMs as float32 dots of the dequantized
    operands (`BlockScaledRecipe.dequantized_dot`): the same values up to float32 summation
    order, faster on a CPU.
    """
    model = GPT(config, key=key)
    if variant in REFERENCES:
        return model
    recipe: str | fp8jax.Recipe = EXTRA_VARIANTS.get(variant, variant)
    if block_dot == "dequantized" and variant in BLOCK_RECIPES:
        recipe = BLOCK_RECIPES[variant](dequantized_dot=True)
    return fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe))


def train(
    variant: str,
    config: GPTConfig,
    data: tuple[np.ndarray, np.ndarray],
    args: argparse.Namespace,
) -> Run:
    """Train one variant (a name of `VARIANTS` or `"bf16"`): `fp32` computes in float32
    (`FP32_POLICY`), every other variant in BF16 (`POLICY`), all with float32 master weights."""
    train_data, val_data = data
    model = build(config, variant, jax.random.PRNGKey(args.seed), args.block_dot)
    warmup = max(1, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95))
    policy = fp8jax.Policy.from_string(FP32_POLICY if variant == "fp32" else POLICY)
    train_step = fp8jax.make_train_step(next_token_loss, optimizer, policy=policy)
    evaluate = eqx.filter_jit(lambda m, tokens: next_token_loss(policy.cast_to_compute(m), tokens))
    val_rng = np.random.default_rng(args.seed + 1)
    val_batches = [sample(val_data, val_rng, args.batch, args.context) for _ in range(8)]
    rng = np.random.default_rng(args.seed)  # the same batches for every variant
    state = train_step.init(model)
    run = Run(variant)
    # Steps per second from the median window between the loop's reads (a loss logged, an
    # evaluation): no wait inside a window, so host and device overlap as in a real job; the
    # first window (the compile) left out, delayed scaling's second program (once it drops
    # its warm start) in one window only, and no evaluation timed.
    seconds, started, steps = [], time.perf_counter(), 0
    from tqdm.auto import tqdm  # noqa: PLC0415 (the demo extra's: --help works without it)

    bar = tqdm(range(args.steps), desc=f"{run.name:>9}", leave=True)
    for step in bar:
        state, metrics = train_step(state, sample(train_data, rng, args.batch, args.context))
        steps += 1
        log = step % args.log_every == 0 or step == args.steps - 1
        validate = (step + 1) % args.eval_every == 0 or step == args.steps - 1
        if not (log or validate):
            continue
        jax.block_until_ready((state, metrics))
        seconds.append((time.perf_counter() - started) / steps)
        if log:
            loss = float(metrics.loss)
            run.steps.append(step)
            run.train.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}")
            if variant not in REFERENCES:
                for name, layer in fp8jax.telemetry(state.model).items():
                    run.scales.setdefault(name, []).append(
                        (
                            step,
                            float(layer.input.scale),
                            float(layer.kernel.scale),
                            float(layer.output_grad.scale),
                        )
                    )
        if validate:
            val = np.mean([float(evaluate(state.model, b)) for b in val_batches])
            run.val_steps.append(step)
            run.val.append(float(val))
        started, steps = time.perf_counter(), 0
    if len(seconds) > 1:
        run.steps_per_second = 1.0 / float(np.median(seconds[1:]))
    return run


def table(runs: list[Run], tail: int) -> str:
    """The final losses in nats: train as the mean of the last `tail` logged losses (one
    batch each), validation at the last evaluation and relative to the first run's (BF16)."""
    base_val = runs[0].val[-1]
    header = (
        f"| variant | train loss (mean of last {tail} logged) | val loss | val vs BF16 | steps/s |"
    )
    lines = [header, "|---|---|---|---|---|"]
    for run in runs:
        train, val = np.mean(run.train[-tail:]), run.val[-1]
        rel = (val - base_val) / base_val
        lines.append(
            f"| {run.name} | {train:.4f} | {val:.4f} | {100 * rel:+.2f} % | "
            f"{run.steps_per_second:.1f} |"
        )
    return "\n".join(lines)


def _pyplot():
    """matplotlib's pyplot, drawing to files only (Agg): imported here since only the plots
    need matplotlib (the `demo` extra)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def gap_figure(runs: list[Run], bars: Sequence[tuple[float, str, str]] = ()):
    """The figure of `val_gap.png`: each variant's validation loss relative to BF16's at every
    evaluation, in %, against the float32 run's gap as the yardstick.

    A recipe's gap to BF16 means something only next to what any change of rounding does: the
    `fp32` run (the BF16 model computed in float32) is drawn dashed, with a band of ±|its gap|
    at each evaluation. A lower panel shows BF16's train and validation losses, for where in
    training each evaluation falls.

    Arguments:
        runs: BF16's run first, then the other variants' (`fp32` among them for the yardstick),
            all evaluated at the same steps.
        bars: `(fraction, linestyle, label)` of horizontal lines to draw at ±fraction, e.g.
            `(0.005, "--", "0.5 % bar")`; none by default.

    Returns:
        The matplotlib figure (not saved). Its upper axes hold one line per variant but BF16,
        whose label starts with the run's name and whose y data are, at the run's `val_steps`,
        `100 * (val - bf16_val) / bf16_val`.
    """
    plt = _pyplot()
    base = runs[0]
    bf16_val = np.asarray(base.val)
    fig, (ax, loss_ax) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": (3, 1)}
    )
    ax.axhline(0, color="black", linewidth=0.8)
    for run in runs[1:]:
        rel = 100 * (np.asarray(run.val) - bf16_val) / bf16_val
        if run.name == "fp32":
            ax.fill_between(
                run.val_steps,
                -np.abs(rel),
                np.abs(rel),
                color="gray",
                alpha=0.25,
                linewidth=0,
                label="±|fp32 gap|: the yardstick",
            )
            ax.plot(run.val_steps, rel, "k--", label="fp32: BF16 model computed in float32")
        else:
            ax.plot(run.val_steps, rel, "o-", label=run.name)
    for bar, style, label in bars:
        for sign in (-1, 1):
            ax.axhline(
                100 * sign * bar,
                color="gray",
                linestyle=style,
                linewidth=0.8,
                label=label if sign > 0 else None,
            )
    ax.set(
        ylabel="validation loss relative to BF16 (%)",
        title="Validation loss relative to BF16: above 0 is worse than BF16\n"
        "(a gap inside the shaded band is no larger than float32 compute's)",
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    loss_ax.plot(base.steps, base.train, color="tab:blue", alpha=0.6, label="BF16 train")
    loss_ax.plot(base.val_steps, base.val, "o", color="tab:blue", label="BF16 validation")
    loss_ax.set(xlabel="step", ylabel="BF16 loss (nats)")
    loss_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.align_ylabels()
    return fig


def plot(
    runs: list[Run], out: pathlib.Path, bars: Sequence[tuple[float, str, str]] = ()
) -> list[pathlib.Path]:
    """Write `val_gap.png` (`gap_figure`, with `bars`) and, if a run has FP8 scales,
    `scale_history.png` (the delayed recipe's, or the first such run's) to `out`."""
    plt = _pyplot()
    fig = gap_figure(runs, bars)
    gap = out / "val_gap.png"
    fig.savefig(gap, dpi=120, bbox_inches="tight")
    plt.close(fig)

    delayed = next((r for r in runs if r.name == "delayed"), None) or next(
        (r for r in runs if r.scales), None
    )
    paths = [gap]
    if delayed is not None:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharex=True)
        for name, history in delayed.scales.items():
            steps, *scales = zip(*history, strict=True)
            for ax, values in zip(axes, scales, strict=True):
                ax.semilogy(steps, values, label=name)
        for ax, role in zip(axes, ("input", "kernel", "output gradient"), strict=True):
            ax.set(title=f"{role} scale ({delayed.name})", xlabel="step")
        axes[0].legend(fontsize=6)
        scales = out / "scale_history.png"
        fig.savefig(scales, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(scales)
    return paths


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    layers: int,
    width: int,
    recipes: tuple[str, ...],
    block_dot: str,
    out: str,
) -> None:
    """The model, training and output flags shared by this job and the convergence benchmark,
    with the defaults each chooses."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--recipes",
        default=",".join(recipes),
        help=f"comma-separated runs beside BF16's, among {', '.join(VARIANTS)}; bf16, the "
        "baseline, runs once and first whether named or not (default: %(default)s)",
    )
    parser.add_argument("--out", default=out)
    parser.add_argument(
        "--block-dot",
        choices=("chunked", "dequantized"),
        default=block_dot,
        help="how the block recipes' GEMMs are emulated: one FP8 dot per block (as on a GPU) "
        "or one float32 dot of the dequantized operands (the same values up to float32 "
        "summation order, faster on a CPU)",
    )


def parse_recipes(
    parser: argparse.ArgumentParser, spec: str, choices: tuple[str, ...] = VARIANTS
) -> list[str]:
    """The recipe names of a comma-separated `--recipes`, each checked against `choices`; a
    repeated name runs once, where first given. `bf16` is accepted and left out: the baseline
    runs first whether named or not (naming it was an 'unknown recipe' error)."""
    recipes = list(dict.fromkeys(r for r in spec.split(",") if r))
    for recipe in recipes:
        if recipe not in ("bf16", *choices):
            parser.error(f"unknown recipe {recipe!r}: choose from bf16, {', '.join(choices)}")
    return [recipe for recipe in recipes if recipe != "bf16"]


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The byte-level GPT that `--layers`, `--width`, `--heads` and `--context` describe."""
    return GPTConfig(
        vocab=VOCAB, layers=args.layers, width=args.width, heads=args.heads, context=args.context
    )


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(
        parser,
        steps=300,
        layers=2,
        width=128,
        recipes=RECIPES,
        block_dot="chunked",
        out="gpt_fp8_results",
    )
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the BF16 model computed in float32, whose gap to BF16 is the "
        "yardstick for the recipes' gaps (default: on)",
    )
    args = parser.parse_args(argv)
    check_arguments(parser, args, ("eval_every", "log_every"))
    check_seeds(parser, "--seed", [args.seed])
    recipes = parse_recipes(parser, args.recipes)
    if not args.fp32 and "fp32" in recipes:  # it ran the float32 model all the same
        parser.error(f"--no-fp32 with --recipes {args.recipes}, which names fp32: drop one.")
    if args.block_dot != "chunked" and not set(recipes) & set(BLOCK_RECIPES):  # was ignored
        parser.error(
            f"--block-dot {args.block_dot}: only with a block recipe "
            f"({', '.join(BLOCK_RECIPES)}); --recipes {args.recipes} names none."
        )
    if args.fp32 and "fp32" not in recipes:
        recipes.insert(0, "fp32")
    missing = [name for name in ("tqdm", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:  # before training: the plots, matplotlib's, come after every run
        raise ModuleNotFoundError(
            f"The train_gpt example needs {' and '.join(missing)}: pip install 'fp8jax[demo]'."
        )
    out = pathlib.Path(args.out)
    try:  # before training: a path it cannot write would lose every run's results
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot make a directory there ({e.strerror}).")
    config = model_config(args)
    data = split(kjv_bytes())
    print(
        f"GPT {args.layers} x {args.width}, context {args.context}, batch {args.batch}, "
        f"{args.steps} steps on {len(data[0]) / 1e6:.1f} MB of the King James Bible "
        f"(bytes); BF16 compute, float32 master weights"
    )
    runs = [train(name, config, data, args) for name in ["bf16", *recipes]]
    print()
    print(table(runs, tail=max(1, 20 // args.log_every)))
    for path in plot(runs, out):
        print(f"wrote {path}")
    return runs


if __name__ == "__main__":
    main()

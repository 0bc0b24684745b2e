"""DeepSeek-V3 in miniature on the King James Bible: BF16, FP8 as DeepSeek-V3 trains it, float32.

    python -m fp8jax.examples.deepseek --kjv [--steps 250] [--seeds 0 1 2] [--block-dot ...]

The model is `fp8jax.examples.deepseek_model.DeepSeekV3` (multi-head latent attention and
DeepSeekMoE, the first block dense). Each seed builds it from `jax.random.PRNGKey(seed)` and
trains it three times from those weights on the same batches (byte-level, context 64):

- `bf16`: BF16 compute, float32 master weights, AdamW (DeepSeek's b2 = 0.95) with its moments
  stored in BF16 ([`fp8jax.low_precision_state`][]), each block rematerialised saving only
  what `fp8jax.save_fp8_operands` names;
- `fp8`: the same, with `deepseek_model.fp8_config()`: blockwise FP8 (E4M3, 1 x 128 and
  128 x 128) in every Linear of MLA, the FFNs and the shared experts and in the routed experts'
  grouped GEMMs, so that only FP8 operands are saved for the backward of those GEMMs;
- `fp32`: everything in float32 (moments too): the yardstick. Its gap to BF16 is how far
  rounding alone moves the loss, next to the FP8 run's gap to BF16.

After every step the MoE layers' balancing biases move from the step's load
(`update_balance`, `--balance-speed`, DeepSeek's gamma). The job prints the main job's table per
seed (train and validation losses, gap to BF16, steps per second), the gaps over seeds, then for
the first seed the tokens each routed expert got over the last `--tail` steps as routed and as the
affinities alone would have routed them (the bias's effect), and `fp8jax.report` of the FP8
run's layers.

`--block-dot dequantized` computes the block-scaled GEMMs as float32 dots of the dequantized FP8
operands: the same quantization, faster on a CPU (the default, `chunked`, runs one FP8 dot per
128-chunk, as the GPU kernels do).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax.examples.data import VOCAB, kjv_bytes, sample, split
from fp8jax.examples.deepseek_model import (
    DeepSeekConfig,
    DeepSeekV3,
    deepseek_loss,
    fp8_config,
    update_balance,
)
from fp8jax.examples.gpt import check_lr, check_seeds

POLICY = "params=float32,compute=bfloat16,output=float32"
FP32_POLICY = "params=float32,compute=float32,output=float32"
#: The three runs of a seed: (policy, FP8 Linears, optimizer moments in BF16).
PRECISIONS: dict[str, tuple[str, bool, bool]] = {
    "bf16": (POLICY, False, True),
    "fp8": (POLICY, True, True),
    "fp32": (FP32_POLICY, False, False),
}


@dataclasses.dataclass
class Run:
    """One run: its losses (train every step, validation every `--eval-every` steps and at
    the end), steps per second (the median step's: no compile counted), the model after the
    last step and the tokens per expert of its last steps (`Load` fields summed:
    `(moe_layers, experts)`)."""

    name: str
    seed: int
    train: list[float] = dataclasses.field(default_factory=list)
    val_steps: list[int] = dataclasses.field(default_factory=list)
    val: list[float] = dataclasses.field(default_factory=list)
    steps_per_second: float = float("nan")
    model: DeepSeekV3 | None = None
    routed: np.ndarray | None = None
    unbiased: np.ndarray | None = None


def build(
    config: DeepSeekConfig,
    precision: str,
    seed: int,
    block_dot: str,
    targets: str | None = None,
    power_of_two: bool = False,
) -> DeepSeekV3:
    """The seed's model, converted to FP8 (telemetry on) for `precision == "fp8"`: every layer
    `fp8_config()` converts, or those of them whose path matches the regex `targets`, with
    exact scales or, `power_of_two=True`, powers of two."""
    model = DeepSeekV3(config, key=jax.random.PRNGKey(seed))
    if not PRECISIONS[precision][1]:
        return model
    dequantized = block_dot == "dequantized"
    fp8 = fp8_config(telemetry=True, dequantized_dot=dequantized, power_of_two=power_of_two)
    if targets is not None:
        fp8 = fp8jax.Fp8Config(recipe=fp8.recipe, telemetry=True, targets=targets)
    return convert_fp8(model, fp8)


def convert_fp8(model: DeepSeekV3, fp8: fp8jax.Fp8Config) -> DeepSeekV3:
    """`fp8jax.fp8_linear_layers(model, fp8)` with the head and the routers found by a trace
    of `deepseek_loss` (`example=`), by what their outputs feed, not by widths (a router: a
    Linear whose width is the expert count in the module holding the experts or one above it;
    the head: the vocabulary-wide Linear), which a model's sizes can make ambiguous."""
    example = lambda m: deepseek_loss(m, jnp.zeros((1, 9), jnp.int32))  # noqa: E731
    return fp8jax.fp8_linear_layers(model, fp8, example=example)


def optimizer(steps: int, lr: float, bf16_moments: bool) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay over `steps`, clipping at 1, b2 = 0.95 (the main
    job's, and DeepSeek-V3's b2), its moments stored in BF16 if asked."""
    warmup = max(1, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1))
    adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95))
    return fp8jax.low_precision_state(adamw) if bf16_moments else adamw


def train(
    config: DeepSeekConfig,
    precision: str,
    data: tuple[np.ndarray, np.ndarray],
    args: argparse.Namespace,
    seed: int,
    convert: Callable[[DeepSeekV3], DeepSeekV3] | None = None,
    loss: Callable = deepseek_loss,
) -> Run:
    """Train one run of a seed; every run of the seed sees the same weights and batches.
    `convert`, if given, changes the built model before training (an experiment's layers);
    `loss`, the training loss (`deepseek_loss`'s signature: an experiment's forward). The
    validation losses are `deepseek_loss`'s."""
    train_data, val_data = data
    policy_string, _, bf16_moments = PRECISIONS[precision]
    policy = fp8jax.Policy.from_string(policy_string)
    model = build(config, precision, seed, args.block_dot, args.fp8_targets, args.power_of_two)
    if convert is not None:
        model = convert(model)
    step_fn = fp8jax.make_train_step(
        loss, optimizer(args.steps, args.lr, bf16_moments), policy=policy, has_aux=True
    )
    balance = eqx.filter_jit(update_balance)
    evaluate = eqx.filter_jit(lambda m, t: deepseek_loss(policy.cast_to_compute(m), t)[0])
    val_rng = np.random.default_rng(seed + 1)
    val_batches = [sample(val_data, val_rng, args.batch, args.context) for _ in range(8)]
    rng = np.random.default_rng(seed)
    state = step_fn.init(model)
    run = Run(precision, seed)
    seconds = []
    for step in range(args.steps):
        started = time.perf_counter()
        state, metrics = step_fn(state, sample(train_data, rng, args.batch, args.context))
        load = metrics.aux
        balanced = balance(state.model, load.routed, args.balance_speed)
        state = jax.block_until_ready(eqx.tree_at(lambda s: s.model, state, balanced))
        seconds.append(time.perf_counter() - started)  # the median's: no compile, no evaluation
        run.train.append(float(metrics.loss))
        if step >= args.steps - args.tail:
            routed, unbiased = np.asarray(load.routed), np.asarray(load.unbiased)
            run.routed = routed if run.routed is None else run.routed + routed
            run.unbiased = unbiased if run.unbiased is None else run.unbiased + unbiased
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            run.val_steps.append(step)
            run.val.append(float(np.mean([float(evaluate(state.model, b)) for b in val_batches])))
        if step % 50 == 0 or step == args.steps - 1:
            print(
                f"{precision:>5} seed {seed} step {step:4d}: loss {run.train[-1]:.4f}", flush=True
            )
    if len(seconds) > 1:
        run.steps_per_second = 1.0 / float(np.median(seconds[1:]))
    run.model = state.model
    return run


def inspect_train_step(
    config: DeepSeekConfig,
    batch: int = 2,
    modes: tuple[str, ...] = ("cublas", "default"),
) -> fp8jax.Inspection:
    """The FP8 run's train step (`fp8_config()`, BF16 compute, BF16 Adam moments, `remat` as
    `config` says) on a batch of `batch` sequences, compiled for an H100 (deviceless): every
    GEMM and the kernel that runs it (`fp8jax.inspect`, each layer's GEMMs apart). The native
    kernels' PTX is read where the process started with `MOSAIC_GPU_DUMP_PTX=1` and
    `MOSAIC_GPU_DUMP_TO` set."""
    model = DeepSeekV3(config, key=jax.random.PRNGKey(0))
    model = convert_fp8(model, fp8_config())
    policy = fp8jax.Policy.from_string(POLICY)
    step = fp8jax.make_train_step(
        deepseek_loss, optimizer(100, 3e-3, True), policy=policy, has_aux=True
    )
    tokens = jax.ShapeDtypeStruct((batch, config.context + 1), jnp.int32)
    return fp8jax.inspect(step, step.init(model), tokens, modes=modes, merge_dots=False)


def table(runs: dict[str, Run], tail: int) -> str:
    """The main job's table for one seed: mean train loss of the last `tail` steps, final
    validation loss, its gap to BF16's, steps per second."""
    base = runs["bf16"].val[-1]
    lines = ["| run | train loss | val loss | val vs BF16 | steps/s |", "|---|---|---|---|---|"]
    for name, run in runs.items():
        train, val = np.mean(run.train[-tail:]), run.val[-1]
        lines.append(
            f"| {name} | {train:.4f} | {val:.4f} | {100 * (val - base) / base:+.2f} % | "
            f"{run.steps_per_second:.2f} |"
        )
    return "\n".join(lines)


def gap(runs: dict[str, Run], name: str) -> float:
    """`name`'s final validation loss relative to BF16's: `(val - bf16) / bf16`."""
    base = runs["bf16"].val[-1]
    return (runs[name].val[-1] - base) / base


def seeds_table(by_seed: dict[int, dict[str, Run]]) -> str:
    """The FP8 and float32 gaps to BF16 over the seeds (of the runs made): each seed's, their
    mean and standard deviation (over seeds, `ddof=1`), and the BF16 validation losses' spread
    between seeds."""
    spread = lambda a: f"{np.std(a, ddof=1):.3f}" if len(a) > 1 else "-"  # noqa: E731
    each = lambda a: ", ".join(f"{g:+.3f}" for g in a)  # noqa: E731
    lines = ["| | per seed | mean | std over seeds |", "|---|---|---|---|"]
    for name in [p for p in PRECISIONS if p != "bf16" and p in next(iter(by_seed.values()))]:
        g = np.array([100 * gap(runs, name) for runs in by_seed.values()])
        lines.append(
            f"| {name.upper()} vs BF16 (%) | {each(g)} | {np.mean(g):+.3f} | {spread(g)} |"
        )
    bf16 = np.array([runs["bf16"].val[-1] for runs in by_seed.values()])
    lines.append(
        f"| BF16 val loss | {', '.join(f'{v:.4f}' for v in bf16)} | {np.mean(bf16):.4f} | "
        f"{spread(bf16)} |"
    )
    return "\n".join(lines)


def load_table(runs: dict[str, Run]) -> str:
    """Per MoE layer and routed expert: the share of the last steps' token assignments each
    run routed to it, and (in brackets) the share the affinities alone would have given it."""
    names = [n for n, r in runs.items() if r.routed is not None and r.routed.size]
    if not names:
        return "(no MoE layer)"
    header = "| MoE layer | expert | " + " | ".join(f"{n} routed (unbiased)" for n in names) + " |"
    lines = [header, "|---|---|" + "---|" * len(names)]
    layers, experts = runs[names[0]].routed.shape
    for i in range(layers):
        for e in range(experts):
            cells = []
            for n in names:
                r, u = runs[n].routed[i], runs[n].unbiased[i]
                cells.append(f"{100 * r[e] / r.sum():.1f} % ({100 * u[e] / u.sum():.1f} %)")
            lines.append(f"| {i} | {e} | " + " | ".join(cells) + " |")
    for n in names:
        r, u = runs[n].routed, runs[n].unbiased
        lines.append(
            f"| all | max / mean, {n} | routed {imbalance(r):.2f} | unbiased {imbalance(u):.2f} |"
        )
    return "\n".join(lines)


def imbalance(counts: np.ndarray) -> float:
    """The most loaded expert's tokens over the mean, the worst over layers (1: balanced)."""
    counts = np.asarray(counts, dtype=np.float64)
    return float(np.max(counts.max(axis=-1) / counts.mean(axis=-1)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kjv", action="store_true", help="train on the King James Bible")
    for flag, kind, default, what in (
        ("--steps", int, 250, "training steps of each run"),
        ("--batch", int, 16, "sequences per step"),
        ("--context", int, 64, "tokens (bytes) per sequence"),
        ("--lr", float, 3e-3, "peak learning rate"),
        ("--layers", int, 3, "blocks, the first dense"),
        ("--width", int, 128, "model width"),
        ("--experts", int, 8, "routed experts per MoE block"),
        ("--top-k", int, 2, "routed experts per token"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default: {default})")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one set of runs per seed (default: 0)"
    )
    parser.add_argument(
        "--balance-speed",
        type=float,
        default=1e-2,
        help="the balancing bias's step (DeepSeek's gamma, 0.001 over 14.8T tokens; 0.01 here, "
        "where a run is a few hundred steps)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between validations (default: 50)"
    )
    parser.add_argument(
        "--tail", type=int, default=20, help="steps whose loads are counted (default: 20)"
    )
    parser.add_argument(
        "--block-dot",
        choices=("chunked", "dequantized"),
        default="chunked",
        help="block-scaled GEMMs as one FP8 dot per 128-chunk (as on a GPU) or one float32 "
        "dot of the dequantized operands (the same values up to float32 summation order, "
        "faster on a CPU)",
    )
    parser.add_argument(
        "--power-of-two",
        action="store_true",
        help="FP8 scales rounded down to powers of two instead of 448 / amax exactly "
        "(fp8_config's power_of_two)",
    )
    parser.add_argument(
        "--fp8-targets",
        default=None,
        metavar="REGEX",
        help="convert only the FP8 layers whose path matches (an ablation; default: all)",
    )
    parser.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"the runs, among {', '.join(PRECISIONS)} (bf16 is the baseline: always run)",
    )
    args = parser.parse_args(argv)
    wanted = [p for p in args.precisions.split(",") if p]
    unknown = [p for p in wanted if p not in PRECISIONS]
    if unknown:
        parser.error(
            f"--precisions {args.precisions}: unknown {unknown}; choose among {list(PRECISIONS)}."
        )
    args.precisions = ["bf16", *[p for p in PRECISIONS if p in wanted and p != "bf16"]]
    if not args.kjv:
        parser.error("--kjv: the job trains on the King James Bible; pass --kjv.")
    for name in ("steps", "batch", "context", "layers", "width", "experts", "eval_every", "tail"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: should be >= 1.")
    check_lr(parser, args.lr)
    check_seeds(parser, "--seeds", args.seeds)
    if not 0 <= args.balance_speed < math.inf:
        parser.error(f"--balance-speed {args.balance_speed}: should be >= 0 and finite.")
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k {args.top_k}: should be from 1 to --experts ({args.experts}).")
    args.tail = min(args.tail, args.steps)
    args.seeds = list(dict.fromkeys(args.seeds))
    fp8 = [p for p in args.precisions if PRECISIONS[p][1]]
    fp8_only = {
        "--fp8-targets": args.fp8_targets is not None,
        "--power-of-two": args.power_of_two,
        "--block-dot": args.block_dot != "chunked",
    }
    if not fp8 and any(fp8_only.values()):
        given = ", ".join(flag for flag, on in fp8_only.items() if on)
        parser.error(
            f"{given}: only with the FP8 run; --precisions {','.join(args.precisions)} has none "
            "(add fp8)."
        )
    if args.fp8_targets is not None and fp8:
        # Checked on the model's shapes now, not after the BF16 run has trained.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jax.eval_shape(
                    lambda: build(config_of(args), fp8[0], 0, args.block_dot, args.fp8_targets)
                )
        except ValueError as e:
            parser.error(f"--fp8-targets {args.fp8_targets!r}: {e}")
    return args


def config_of(args: argparse.Namespace) -> DeepSeekConfig:
    """The miniature the command line describes (the other sizes: `DeepSeekConfig`'s)."""
    return DeepSeekConfig(
        vocab=VOCAB,
        context=args.context,
        width=args.width,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        remat=True,
    )


def main(argv: list[str] | None = None) -> dict[int, dict[str, Run]]:
    """Run the job; returns the runs by seed, then by precision (`runs[0]["fp8"]`)."""
    args = parse(argv)
    config = config_of(args)
    data = split(kjv_bytes())
    scales = "power-of-two" if args.power_of_two else "exact"
    print(
        f"DeepSeek-V3 in miniature: {config.layers} blocks ({config.dense_layers} dense) of "
        f"width {config.width}, MLA {config.heads} heads (q latent {config.q_rank}, kv latent "
        f"{config.kv_rank}, RoPE {config.rope_dim}), DeepSeekMoE {config.shared_experts} shared "
        f"+ {config.experts} routed experts (top-{config.top_k}, hidden "
        f"{config.expert_hidden}); context {args.context}, batch {args.batch}, {args.steps} "
        f"steps on the King James Bible (bytes); BF16 and FP8: BF16 compute, float32 masters, "
        f"BF16 Adam moments; FP8: blockwise E4M3 ({args.block_dot} block dots, {scales} "
        "scales); FP32: float32 "
        f"everything; balance speed {args.balance_speed}; seeds {args.seeds}"
    )
    by_seed: dict[int, dict[str, Run]] = {}
    for seed in args.seeds:
        runs = {p: train(config, p, data, args, seed) for p in args.precisions}
        by_seed[seed] = runs
        print()
        print(f"Seed {seed}:")
        print(table(runs, args.tail))
    if len(by_seed) > 1:
        print()
        print(f"Over the {len(by_seed)} seeds, gaps of the final validation loss to BF16's:")
        print(seeds_table(by_seed))
    first = next(iter(by_seed))
    runs = by_seed[first]
    print()
    print(
        f"Seed {first}: tokens per routed expert over the last {args.tail} steps, as routed "
        "(affinity + balancing bias) and, in brackets, as the affinities alone would route them:"
    )
    print(load_table(runs))
    if "fp8" in runs:
        print()
        print(f"fp8jax.report of the FP8 run, seed {first}:")
        fp8jax.report(fp8jax.telemetry(runs["fp8"].model))
    return by_seed


if __name__ == "__main__":
    main()

"""Experiments with the MoE models of `fp8jax.examples.moe_model`, and their command line.

`python -m fp8jax.examples.moe` trains `MoEModel` on a synthetic regression task, in FP8 and in
high precision, and prints the losses.

`python -m fp8jax.examples.moe --kjv [--steps 250] [--layers 2] [--width 128] [--seeds 0 1 2]
[--devices 8 --expert-parallel 8]`
is the evidence on real text: the GPT of `fp8jax.examples.gpt` with each MLP replaced by an MoE
block (`--experts 4`, `--top-k 2`, each expert `mlp_ratio * width / top_k` wide, so that a
token's expert FLOPs match the dense MLP's), and the dense GPT, both trained on the King James
Bible in BF16, in FP8 (delayed scaling, with telemetry) and in float32, the three runs of a model
from the same weights and batches. The float32 run is the yardstick: its gap to BF16 is how far
rounding alone moves the loss, next to the FP8 run's gap to BF16.

For each seed of `--seeds` (default `0`; `--seed N` is an alias of `--seeds N`) the models are
built from `jax.random.PRNGKey(seed)` and the batches drawn from the seed; the job prints the
validation losses and the FP8 and float32 gaps to BF16, MoE and dense side by side. With several
seeds it then prints, per model, the mean gaps over the seeds and each seed's FP8 gap. Last, for
the first seed only: the MoE FP8 run's per-expert telemetry (each expert's kernel scale and the
tokens each expert got over the last steps, FP8 and BF16) and `fp8jax.report` of its grouped
layers.

`--expert-parallel E` trains the MoE GPT expert parallel: `--devices N` CPU devices (forced,
as the tests do), a mesh of `N / E` data-parallel groups of `E` devices, the batch split over
all of them, the experts over the `E` of a group (`fp8jax.expert_exchange`: the FP8 run
dispatches FP8). Every MoE run is trained a second time on one device from the same weights
and batches, and a table compares the two: they differ by float32 summation order only.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import fp8jax
from fp8jax.examples.data import VOCAB, kjv_bytes, sample, split
from fp8jax.examples.gpt import GPT, GPTConfig, check_arguments, check_seeds, next_token_loss
from fp8jax.examples.moe_model import MoE, MoEModel, moe_gpt, moe_gpt_loss, mse, teacher_data

#: The KJV job's precision, `fp8jax.examples.train_gpt`'s (not imported from there: that
#: module needs tqdm, of the `demo` extra): BF16 compute, float32 master weights.
POLICY = "params=float32,compute=bfloat16,output=float32"

#: The float32 yardstick's precision: everything in float32, no rounding to BF16 anywhere.
FP32_POLICY = "params=float32,compute=float32,output=float32"

#: Each run's precision, by the suffix of its name: its policy, and whether its Linears are
#: converted to FP8. The FP8 run computes in BF16 like the BF16 run, so their gap is FP8's alone.
PRECISIONS: dict[str, tuple[str, bool]] = {
    "bf16": (POLICY, False),
    "fp8": (POLICY, True),
    "fp32": (FP32_POLICY, False),
}


def train(model: MoEModel, x: Array, y: Array, steps: int = 50, lr: float = 3e-3) -> list[float]:
    """Adam on `mse`, FP8 state written back each step; returns the losses."""
    optimizer = optax.adam(lr)
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = fp8jax.filter_value_and_grad(mse)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        params = eqx.filter(trainable, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return fp8jax.apply_updates(model, updates, overwrites), opt_state, loss

    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    return losses


def synthetic(steps: int = 100) -> dict[str, list[float]]:
    """Train `MoEModel` on `teacher_data` in high precision and in FP8; print the losses."""
    x, y = teacher_data(512)
    model = MoEModel(key=jax.random.PRNGKey(1))
    runs = {
        "high precision": model,
        "fp8 delayed": fp8jax.fp8_linear_layers(model),
        "fp8 blockwise": fp8jax.fp8_linear_layers(
            model, fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(block_size=16))
        ),
    }
    losses = {name: train(m, x, y, steps) for name, m in runs.items()}
    for name, curve in losses.items():
        print(f"{name:>15}: loss {curve[0]:.4f} -> {curve[-1]:.4f} ({np.argmin(curve)} best)")
    return losses


# --- the King James Bible job ---------------------------------------------------------------


@dataclasses.dataclass
class KjvRun:
    """What one run on the King James Bible recorded: the final validation loss, the model
    after the last step and, for an MoE, the tokens per expert summed over the last steps
    (`(layers, experts)`)."""

    name: str
    val: float
    model: GPT
    tokens: np.ndarray | None = None
    losses: list[float] = dataclasses.field(default_factory=list)


def expert_parallel(loss_fn: Any, mesh: Mesh) -> Any:
    """`loss_fn(model, tokens) -> (loss, tokens per expert)` of an MoE GPT built with
    `expert_axis="expert"`, run with the batch split over every axis of `mesh` and the
    experts over its `"expert"` axis (`shard_map`; `fp8jax.expert_specs` places them). The
    loss is the mean over all devices' tokens, the counts their sum."""
    axes = tuple(mesh.axis_names)

    def loss(model: GPT, tokens: Array) -> tuple[Array, Array]:
        params, static = eqx.partition(model, eqx.is_array)

        def local(params: Any, tokens: Array) -> tuple[Array, Array]:
            value, counts = loss_fn(eqx.combine(params, static), tokens)
            return jax.lax.pmean(value, axes), jax.lax.psum(counts, axes)

        specs = fp8jax.expert_specs(params, "expert")
        run = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axes)), out_specs=(P(), P()))
        return run(params, tokens)

    return loss


def fp8_config(mesh: Mesh | None = None) -> fp8jax.Fp8Config:
    """The FP8 runs' conversion: delayed scaling (amaxes over `mesh`'s axes, if given), with
    telemetry; the head and the routers (`gate`) stay in high precision by name, not by role
    (`keep=()`): the trace that finds roles does not enter the expert parallel run's
    `shard_map`."""
    recipe = fp8jax.DelayedScaling(axis_names=() if mesh is None else tuple(mesh.axis_names))
    exclude = f"{fp8jax.DEFAULT_EXCLUDE}|gate"
    return fp8jax.Fp8Config(recipe=recipe, telemetry=True, exclude=exclude, keep=())


def train_kjv(
    model: GPT,
    name: str,
    data: tuple[np.ndarray, np.ndarray],
    args: argparse.Namespace,
    *,
    policy: str,
    seed: int,
    mesh: Mesh | None = None,
) -> KjvRun:
    """Train `model` as `fp8jax.examples.train_gpt` does (AdamW with warmup and cosine decay,
    clipping), in the precision `policy` (an `fp8jax.Policy` string: `POLICY` for the BF16 and
    FP8 runs, `FP32_POLICY` for the float32 one), on batches drawn from `seed`: every run of a
    seed sees the same ones. An MoE model (`moe_gpt`) trains on `moe_gpt_loss`; the tokens per
    expert of its last `args.tail` steps are summed. With a `mesh`, expert parallel
    (`expert_parallel`); the losses of every step are kept in `KjvRun.losses`."""
    train_data, val_data = data
    warmup = max(1, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95))
    policy = fp8jax.Policy.from_string(policy)
    is_moe = isinstance(model.blocks[0].mlp, MoE)
    loss_fn = moe_gpt_loss if is_moe else next_token_loss
    if mesh is not None:
        loss_fn = expert_parallel(loss_fn, mesh)
    train_step = fp8jax.make_train_step(loss_fn, optimizer, policy=policy, has_aux=is_moe)

    @eqx.filter_jit
    def evaluate(model: GPT, tokens: Array) -> Array:
        loss = loss_fn(policy.cast_to_compute(model), tokens)
        return loss[0] if is_moe else loss

    val_rng = np.random.default_rng(seed + 1)
    val_batches = [sample(val_data, val_rng, args.batch, args.context) for _ in range(8)]
    rng = np.random.default_rng(seed)
    state = train_step.init(model)
    tokens, losses = None, []
    for step in range(args.steps):
        state, metrics = train_step(state, sample(train_data, rng, args.batch, args.context))
        losses.append(float(metrics.loss))
        if is_moe and step >= args.steps - args.tail:
            counted = np.asarray(metrics.aux)
            tokens = counted if tokens is None else tokens + counted
        if step % 50 == 0 or step == args.steps - 1:
            loss = float(metrics.loss)
            print(f"{name:>10} seed {seed} step {step:4d}: train loss {loss:.4f}", flush=True)
    val = float(np.mean([float(evaluate(state.model, b)) for b in val_batches]))
    return KjvRun(name, val, state.model, tokens, losses)


#: The two models of the KJV job, in the order of the tables.
MODELS = ("dense", "moe")


def gap(runs: dict[str, KjvRun], model: str, precision: str) -> float:
    """The validation loss of `model`'s `precision` run relative to its BF16 run's:
    `(val - bf16) / bf16`, positive when the run ended worse than BF16."""
    bf16 = runs[f"{model} bf16"].val
    return (runs[f"{model} {precision}"].val - bf16) / bf16


def gap_table(runs: dict[str, KjvRun]) -> str:
    """Markdown table of one seed's final validation losses and the FP8 and float32 runs' gaps
    to the BF16 run: the float32 gap is what rounding alone does, the scale for the FP8 one."""
    lines = [
        "| model | BF16 val loss | FP8 val loss | FP32 val loss | FP8 vs BF16 | FP32 vs BF16 |",
        "|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        vals = [runs[f"{model} {p}"].val for p in ("bf16", "fp8", "fp32")]
        losses = " | ".join(f"{v:.4f}" for v in vals)
        fp8, fp32 = gap(runs, model, "fp8"), gap(runs, model, "fp32")
        lines.append(f"| {model} | {losses} | {100 * fp8:+.2f} % | {100 * fp32:+.2f} % |")
    return "\n".join(lines)


def summary_table(by_seed: dict[int, dict[str, KjvRun]]) -> str:
    """Markdown table over seeds: per model, the mean FP8 and float32 gaps to BF16 and each
    seed's FP8 gap (in the order of the seeds), so that the spread between seeds shows next to
    the mean."""
    lines = [
        "| model | mean FP8 vs BF16 | mean FP32 vs BF16 | FP8 vs BF16 per seed (%) |",
        "|---|---|---|---|",
    ]
    for model in MODELS:
        fp8 = [100 * gap(runs, model, "fp8") for runs in by_seed.values()]
        fp32 = [100 * gap(runs, model, "fp32") for runs in by_seed.values()]
        each = ", ".join(f"{g:+.2f}" for g in fp8)
        lines.append(f"| {model} | {np.mean(fp8):+.2f} % | {np.mean(fp32):+.2f} % | {each} |")
    return "\n".join(lines)


def expert_table(runs: dict[str, KjvRun]) -> str:
    """Per expert of each MoE block: the FP8 run's `up` and `down` kernel scales (delayed
    scaling, after the last step) and the share of tokens each expert got over the last steps,
    in the FP8 and the BF16 runs."""
    stats = fp8jax.telemetry(runs["moe fp8"].model)
    layers = runs["moe fp8"].tokens.shape[0]
    lines = [
        "| block | expert | up kernel scale | down kernel scale | tokens FP8 | tokens BF16 |",
        "|---|---|---|---|---|---|",
    ]
    for i in range(layers):
        up = np.asarray(stats[f"blocks.{i}.mlp.up"].kernel.scale)
        down = np.asarray(stats[f"blocks.{i}.mlp.down"].kernel.scale)
        fp8, bf16 = runs["moe fp8"].tokens[i], runs["moe bf16"].tokens[i]
        for e in range(len(up)):
            lines.append(
                f"| {i} | {e} | {up[e]:.4g} | {down[e]:.4g} | {int(fp8[e])} "
                f"({100 * fp8[e] / fp8.sum():.1f} %) | {int(bf16[e])} "
                f"({100 * bf16[e] / bf16.sum():.1f} %) |"
            )
    return "\n".join(lines)


def kjv_seed(
    config: GPTConfig, data: tuple[np.ndarray, np.ndarray], args: argparse.Namespace, seed: int
) -> dict[str, KjvRun]:
    """The six runs of one seed, by name (`"dense bf16"`, ..., `"moe fp32"`): the dense GPT and
    the MoE GPT built from `jax.random.PRNGKey(seed)`, each trained in every precision of
    `PRECISIONS` from the same weights, on the batches of `seed`. The FP8 runs keep telemetry,
    so that `fp8jax.report` shows their saturation and underflow.

    With `args.expert_parallel`, the MoE runs are expert parallel (on `args.mesh`, FP8
    amaxes over all its devices) and three more runs, `"moe <precision> one device"`, train
    the same MoE on one device."""
    key = jax.random.PRNGKey(seed)
    mesh = getattr(args, "mesh", None)
    bases = {
        "dense": (GPT(config, key=key), None),
        "moe": (
            moe_gpt(
                config,
                args.experts,
                args.top_k,
                key=key,
                expert_axis="expert" if mesh is not None else None,
                fp8_backward=args.fp8_backward,
            ),
            mesh,
        ),
    }
    if mesh is not None:
        bases["moe one device"] = (moe_gpt(config, args.experts, args.top_k, key=key), None)
    runs = {}
    for model, (base, on) in bases.items():
        conversion = fp8_config(on)
        for precision, (policy, fp8) in PRECISIONS.items():
            name = f"{model} {precision}"
            if model == "moe one device":
                name = f"moe {precision} one device"
            built = fp8jax.fp8_linear_layers(base, conversion) if fp8 else base
            runs[name] = train_kjv(built, name, data, args, policy=policy, seed=seed, mesh=on)
    return runs


def parallel_table(runs: dict[str, KjvRun]) -> str:
    """Markdown table: each MoE run expert parallel against the same run on one device (final
    validation losses, the largest difference of a step's training loss)."""
    lines = [
        "| MoE run | val loss, expert parallel | val loss, one device | largest train loss "
        "difference over the steps |",
        "|---|---|---|---|",
    ]
    for precision in PRECISIONS:
        ep, one = runs[f"moe {precision}"], runs[f"moe {precision} one device"]
        worst = max(abs(a - b) for a, b in zip(ep.losses, one.losses, strict=True))
        lines.append(f"| {precision} | {ep.val:.6f} | {one.val:.6f} | {worst:.2e} |")
    return "\n".join(lines)


#: What `--help` says of the two runs (the flags' own help follows it).
DESCRIPTION = """\
Mixture-of-experts experiments, two runs:

  python -m fp8jax.examples.moe
      the synthetic run: MoEModel on a regression task, in high precision and in FP8
      (delayed and blockwise scaling), 100 steps; it takes no flags.
  python -m fp8jax.examples.moe --kjv [flags of the --kjv run below]
      the dense and the MoE GPT on the King James Bible, in BF16, FP8 and float32, for each
      seed; with --expert-parallel, the MoE GPT expert parallel too."""


def add_kjv_arguments(parser: Any, *, defaults: bool = True) -> dict[str, str]:
    """Add the `--kjv` run's flags to `parser` (an `argparse` parser or argument group);
    returns each flag by its `dest`. With `defaults=False` a flag that is not given is left
    out of the namespace: how `main` tells which were given, to refuse them without `--kjv`."""
    flags = {}

    def add(flag: str, to: Any = parser, **kwargs: Any) -> None:
        if not defaults:
            kwargs["default"] = argparse.SUPPRESS
        flags[to.add_argument(flag, **kwargs).dest] = flag

    add("--steps", type=int, default=250, help="training steps of each run (default: %(default)s)")
    add("--layers", type=int, default=2, help="GPT blocks (default: %(default)s)")
    add("--width", type=int, default=128, help="GPT width (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add(
        "--context", type=int, default=64, help="tokens (bytes) per sequence (default: %(default)s)"
    )
    add("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    add("--experts", type=int, default=None, help="4, or with --expert-parallel E, max(4, E)")
    add("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    add(
        "--tail", type=int, default=20, help="steps whose tokens are counted (default: %(default)s)"
    )
    seeds = parser.add_mutually_exclusive_group()  # --seed N --seeds M dropped M silently
    add("--seeds", seeds, type=int, nargs="+", default=[0], help="one job per seed (default: 0)")
    add("--seed", seeds, type=int, default=None, help="alias: --seed N is --seeds N")
    add("--devices", type=int, default=None, help="CPU devices to force (before JAX starts)")
    add(
        "--expert-parallel",
        type=int,
        default=0,
        metavar="E",
        help="split the experts over groups of E devices (0: one device)",
    )
    add(
        "--fp8-backward",
        action="store_true",
        help="expert parallel: the backward's exchanges in FP8 too (E4M3, 1 x 128 tiles)",
    )
    return flags


def command_line() -> argparse.ArgumentParser:
    """Both runs' command line: `--help` documents the synthetic run and the `--kjv` run's
    flags, grouped apart."""
    parser = argparse.ArgumentParser(
        prog="python -m fp8jax.examples.moe",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--kjv", action="store_true", help="the King James Bible run (default: the synthetic one)"
    )
    add_kjv_arguments(parser.add_argument_group("the --kjv run (refused without --kjv)"))
    return parser


def kjv_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `--kjv` job's command line; `args.seeds` is the list of seeds to run (`--seed N`
    or `--seeds`, not both; a repeated seed runs once)."""
    parser = command_line()
    args = parser.parse_args(argv)
    if args.expert_parallel < 0:
        parser.error(f"--expert-parallel {args.expert_parallel}: should be >= 0 (0: one device).")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices {args.devices}: should be >= 1.")
    if args.experts is None:
        args.experts = max(4, args.expert_parallel)
    check_arguments(parser, args, ("experts", "top_k", "tail"))
    if args.seed is not None:
        check_seeds(parser, "--seed", [args.seed])
    else:
        check_seeds(parser, "--seeds", args.seeds)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k}: should be at most --experts ({args.experts}).")
    if args.devices is not None and not args.expert_parallel:
        parser.error("--devices: only with --expert-parallel (the other runs use one device)")
    if args.fp8_backward and not args.expert_parallel:
        parser.error("--fp8-backward: only with --expert-parallel (there is no exchange)")
    if args.expert_parallel:
        if args.devices is not None:
            jax.config.update("jax_num_cpu_devices", args.devices)
        devices = jax.device_count()
        e = args.expert_parallel
        remainders = {
            f"the devices ({devices}; --devices N forces N) a multiple of {e}": devices % e,
            f"--experts ({args.experts}) a multiple of {e}": args.experts % e,
            f"--batch ({args.batch}) a multiple of the devices ({devices})": args.batch % devices,
        }
        if wrong := [need for need, remainder in remainders.items() if remainder]:
            parser.error(f"--expert-parallel {e}: needs {'; '.join(wrong)}.")
        args.mesh = jax.make_mesh(
            (devices // e, e), ("data", "expert"), axis_types=(AxisType.Auto,) * 2
        )
    args.tail = max(1, min(args.tail, args.steps))
    args.seeds = list(dict.fromkeys([args.seed] if args.seed is not None else args.seeds))
    return args


def kjv(argv: list[str] | None = None) -> dict[int, dict[str, KjvRun]]:
    """The `--kjv` job: MoE and dense GPTs in BF16, FP8 and float32 on the King James Bible,
    for each seed. Returns the runs by seed, then by name (`runs[0]["moe fp8"]`)."""
    args = kjv_args(argv)
    config = GPTConfig(
        vocab=VOCAB, layers=args.layers, width=args.width, heads=args.heads, context=args.context
    )
    data = split(kjv_bytes())
    print(
        f"GPT {args.layers} x {args.width}, context {args.context}, batch {args.batch}, "
        f"{args.steps} steps on the King James Bible (bytes); dense MLP vs MoE "
        f"({args.experts} experts, top-{args.top_k}); BF16 compute, float32 master weights, "
        "FP8 = delayed scaling (BF16 compute), FP32 = float32 compute; "
        f"seeds {', '.join(map(str, args.seeds))}"
        + (
            f"; MoE expert parallel over {args.expert_parallel} of {jax.device_count()} "
            "devices, FP8 dispatch"
            if args.expert_parallel
            else ""
        )
    )
    by_seed = {}
    for seed in args.seeds:
        by_seed[seed] = runs = kjv_seed(config, data, args, seed)
        print()
        print(f"Seed {seed}: validation loss (8 batches of held-out text) after the last step:")
        print(gap_table(runs))
        if args.expert_parallel:
            print()
            print(
                f"Seed {seed}: the MoE expert parallel ({args.expert_parallel} devices per "
                f"group, mesh {dict(args.mesh.shape)}) against one device:"
            )
            print(parallel_table(runs))
    if len(by_seed) > 1:
        print()
        print(f"Over the {len(by_seed)} seeds: mean gaps to BF16, and each seed's FP8 gap:")
        print(summary_table(by_seed))
    first, runs = next(iter(by_seed.items()))
    print()
    print(
        f"Per expert, seed {first} only (MoE FP8 run's kernel scales; tokens over the last "
        f"{args.tail} steps):"
    )
    print(expert_table(runs))
    print()
    grouped = {k: v for k, v in fp8jax.telemetry(runs["moe fp8"].model).items() if v.experts}
    print(f"fp8jax.report of the MoE FP8 run's grouped layers, seed {first} only:")
    fp8jax.report(grouped)
    return by_seed


def main(argv: list[str] | None = None) -> object:
    """`--kjv`: the King James Bible job (`kjv`); otherwise the synthetic task (`synthetic`).
    `--help` documents both; an unknown flag, or one of the `--kjv` run's without `--kjv`, is
    an error rather than silently ignored."""
    parser = command_line()
    if parser.parse_args(argv).kjv:
        return kjv(argv)
    probe = argparse.ArgumentParser(add_help=False)
    flags = add_kjv_arguments(probe, defaults=False)
    given = vars(probe.parse_known_args(argv)[0])
    if given:
        names = ", ".join(flags[dest] for dest in given)
        parser.error(f"{names}: only with --kjv (the synthetic run takes no flags)")
    return synthetic()


if __name__ == "__main__":
    main()

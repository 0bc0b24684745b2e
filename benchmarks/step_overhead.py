"""CPU train-step time of fp8jax's delayed scaling against Haliax's FP8, interleaved.

`peers.py` times each variant once, one after the other; on a shared 2-core machine that
drifts by +-20 % between runs. Here BF16, fp8jax delayed and Haliax FP8 are compiled first,
then timed in `--rounds` rounds, each running every variant for `--steps` steps in turn; the
ratio to BF16 is taken within each round and its median reported, so slow drift cancels.

    python benchmarks/step_overhead.py --rounds 7 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
from peers import models, train_step, variant  # noqa: E402
from train_steps import positive_int  # noqa: E402

VARIANTS = ("bf16", "fp8jax delayed", "haliax fp8")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--steps", type=positive_int, default=3)
    args = parser.parse_args(argv)
    print(
        f"# CPU step time relative to BF16, median over {args.rounds} interleaved rounds of "
        f"{args.steps} steps (jax {jax.__version__}, {os.cpu_count()} cores)\n"
    )
    print("| model | fp8jax delayed | haliax fp8 | delayed no worse? | BF16 step (s) |")
    print("|---|---|---|---|---|")
    for title, (base, loss, batch) in models().items():
        if "residuals only" in title:
            continue
        compiled = {}
        for name in VARIANTS:
            print(f"  ... compiling {title}: {name}", file=sys.stderr, flush=True)
            model = variant(base, name)
            step = eqx.filter_jit(train_step(loss, name)).lower(model, *batch).compile()
            jax.block_until_ready(step(model, *batch))
            compiled[name] = (step, model)
        ratios = {name: [] for name in VARIANTS[1:]}
        base_times = []
        for _ in range(args.rounds):
            times = {}
            for name, (step, model) in compiled.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    jax.block_until_ready(step(model, *batch))
                times[name] = (time.perf_counter() - start) / args.steps
            base_times.append(times["bf16"])
            for name in ratios:
                ratios[name].append(times[name] / times["bf16"])
        fp8, hal = (statistics.median(ratios[n]) for n in VARIANTS[1:])
        verdict = "met" if fp8 <= hal else "MISSED"
        print(
            f"| {title} | {fp8:.2f} | {hal:.2f} | {verdict} | {statistics.median(base_times):.3f} |"
        )


if __name__ == "__main__":
    main()

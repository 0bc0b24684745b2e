"""The HBM rate of each non-GEMM kernel a GPU run traced, and what those rates say of a variant
not yet timed (an ESTIMATE); and where a variant's non-GEMM bytes go (`bytes`).

    # join: a GPU run's profile with the bytes of the same step compiled here, deviceless
    JAX_PLATFORMS=cpu python benchmarks/profile_rates.py join \
        --profile benchmarks/results/gpu_check/h200_run6_llama/profile_kernels.json \
        --variant "8B delayed-cold"
    # estimate: the non-GEMM time of variants at the rates the join printed
    JAX_PLATFORMS=cpu python benchmarks/profile_rates.py estimate --sizes 8B,1B \
        --variants delayed-steady,delayed-steady-apart --rates 1.8,2.9,4.0,4.0,2.0
    # bytes: where a variant's non-GEMM bytes go, by `hlo_cost` category (no rates)
    JAX_PLATFORMS=cpu python benchmarks/profile_rates.py bytes --sizes 8B --variants blockwise

`join` compiles the variant's step for an H100 without one (`llama_block.compile_deviceless`)
with the fp8jax and `llama_block.py` of the commit the profile was taken at (run 6: 1651c36;
run a copy of this file placed in a worktree of it: `git worktree add /tmp/w 1651c36; cp
benchmarks/profile_rates.py /tmp/w/benchmarks/; cd /tmp/w; PYTHONPATH=. python
benchmarks/profile_rates.py join ...`), and matches the profile's kernels
(`profile_kernels.json`'s `top`, GPU run 6: the 40 longest) to the compiled kernels by
name (XLA names a fusion's kernel after its instruction: `input_reduce_fusion_4` is
`input_reduce_fusion.4`). The GPU ran cuDNN's attention and this compile a stand-in, so a
few fusions may be numbered otherwise: a rate above the GPU's HBM peak (H200: 4.8 TB/s) is
marked as a mismatch and left out of the medians. Since session 35 the GPU check's profile
records each kernel's bytes and rate itself, from the compile it ran.

`estimate` classes each non-GEMM kernel of a variant's deviceless step by its fusion's name
(a cast that transposes, a transpose of FP8 values, a reduction, the rest, fp8jax's own
quantization kernels) and times it at
its class's rate (`--rates`, TB/s, in that order) plus `LAUNCH_US` per kernel: an estimate
of the variant's non-GEMM device time, labelled as one, for variants no GPU has run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import llama_block
from gpu_check.profile import kernel_name

import fp8jax

#: H200's HBM peak (TB/s): a joined rate above it is a mismatch of names.
PEAK_TB_S = 4.8
#: A kernel's launch and tail, added to each estimated kernel (microseconds).
LAUNCH_US = 3.0
CLASSES = ("transposing cast", "FP8 transpose", "reduction", "other", "fp8jax kernel")


def kernel_class(name: str) -> str:
    """A non-GEMM kernel's class from its fusion's name (`CLASSES`): fp8jax's own Pallas
    kernels (the quantization kernels, `pallas_call` in the HLO) apart from XLA's fusions."""
    if name.startswith("pallas_call"):
        return "fp8jax kernel"
    if "transpose" in name and "convert" in name:
        return "transposing cast"
    if "transpose" in name:
        return "FP8 transpose"
    if "reduce" in name:
        return "reduction"
    return "other"


def compiled_kernels(size: str, name: str) -> dict[str, object]:
    """Kernel name (as a trace names it) -> `hlo_cost`'s kernel, for the non-GEMM kernels of
    the variant's deviceless step."""
    cost = fp8jax.hlo_cost(llama_block.compile_deviceless(size, name).as_text())
    return {kernel_name(k.name): k for k in cost.kernels if k.category is not None}


def join(profile: Path, variant: str) -> None:
    data = json.loads(profile.read_text())[variant]
    size, name = variant.split(" ", 1)
    kernels = compiled_kernels(size, name)
    steps = data["steps"]
    print(f"{profile} [{variant!r}], joined with its step compiled here (deviceless H100)\n")
    header = ("kernel", "kind", "per step", "mean us", "MB", "TB/s", "class")
    rows, rates = [], {c: [] for c in CLASSES}
    for row in data["top"]:
        if row["bucket"] != "rest":
            continue
        k = kernels.get(row["name"])
        if k is None:
            rows.append((row["name"], row["kind"], row["count"] / steps, row["mean_us"], "-"))
            continue
        rate = k.bytes / (row["mean_us"] * 1e-6) / 1e12
        cls = kernel_class(k.name)
        note = cls if rate <= PEAK_TB_S else f"{cls} (mismatch: above peak)"
        if rate <= PEAK_TB_S:
            rates[cls].append(rate)
        rows.append((row["name"], row["kind"], row["count"] / steps, row["mean_us"], k, rate, note))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        if len(r) == 5:
            print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.1f} | not compiled here | - | - |")
        else:
            print(
                f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.1f} | {r[4].bytes / 1e6:.1f} | "
                f"{r[5]:.2f} | {r[6]} |"
            )
    print("\nmedian rate by class (TB/s; kernels joined):")
    for cls, values in rates.items():
        if values:
            print(f"- {cls}: {statistics.median(values):.2f} ({len(values)} kernels)")
    print(
        f"\nrest measured: {data['device_ms']['rest']:.2f} ms per step; by kind {data['rest_ms']}"
    )


def estimate(sizes: list[str], variants: list[str], rates: dict[str, float]) -> None:
    print(
        "ESTIMATE (not a GPU time): non-GEMM device ms per step, each kernel at its class's "
        f"rate {rates} TB/s + {LAUNCH_US:.0f} us\n"
    )
    header = ("block", "variant", "kernels", "GB", *CLASSES, "ESTIMATE ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for size in sizes:
        for name in variants:
            kernels = compiled_kernels(size, name).values()
            ms = dict.fromkeys(CLASSES, 0.0)
            for k in kernels:
                cls = kernel_class(k.name)
                ms[cls] += (k.bytes / (rates[cls] * 1e12) + LAUNCH_US * 1e-6) * 1e3
            moved = sum(k.bytes for k in kernels) / 1e9
            print(
                f"| {size} | {name} | {len(kernels)} | {moved:.2f} | "
                + " | ".join(f"{ms[c]:.2f}" for c in CLASSES)
                + f" | {sum(ms.values()):.2f} |"
            )


def by_category(sizes: list[str], variants: list[str]) -> None:
    """Each variant's non-GEMM kernels and HBM bytes by `fp8jax.hlo_cost` category (the
    quantization kernels under "quantize"), from its deviceless step; no rates, no times."""
    print("| block | variant | category | kernels | GB |")
    print("|---|---|---|---|---|")
    for size in sizes:
        for name in variants:
            kernels = list(compiled_kernels(size, name).values())
            for category in dict.fromkeys(k.category for k in kernels):
                mine = [k for k in kernels if k.category == category]
                moved = sum(k.bytes for k in mine) / 1e9
                print(f"| {size} | {name} | {category} | {len(mine)} | {moved:.2f} |")
            total = sum(k.bytes for k in kernels) / 1e9
            print(f"| {size} | {name} | all non-GEMM | {len(kernels)} | {total:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join")
    j.add_argument("--profile", type=Path, required=True)
    j.add_argument("--variant", required=True, help='a key of the profile, as "8B delayed-cold"')
    e = sub.add_parser("estimate")
    e.add_argument("--sizes", default="8B,1B")
    e.add_argument("--variants", default="delayed-steady,delayed-steady-apart")
    e.add_argument("--rates", required=True, help="TB/s of each class, in CLASSES' order")
    b = sub.add_parser("bytes")
    b.add_argument("--sizes", default="8B,1B")
    b.add_argument("--variants", default="bf16,blockwise")
    args = parser.parse_args(argv)
    if args.command != "join":
        llama_block.check_names(parser, args.sizes.split(","), args.variants.split(","))
    print(f"jax {__import__('jax').__version__}; {' '.join(sys.argv[1:])}\n")
    if args.command == "join":
        join(args.profile, args.variant)
    elif args.command == "bytes":
        by_category(args.sizes.split(","), args.variants.split(","))
    else:
        values = [float(v) for v in args.rates.split(",")]
        if len(values) != len(CLASSES) or min(values) <= 0:
            parser.error(f"--rates {args.rates!r}: give {len(CLASSES)} positive TB/s, {CLASSES}")
        estimate(
            args.sizes.split(","), args.variants.split(","), dict(zip(CLASSES, values, strict=True))
        )


if __name__ == "__main__":
    main()

"""The check's command line, without JAX: the supervisor refuses a command line the check
cannot run before it starts a child (whose JAX import alone takes seconds of a lease)."""

from __future__ import annotations

import argparse
import math
import os
import threading
from pathlib import Path

from llama_variants import accepted, unknown  # benchmarks/ is on the path

from . import returned

#: The sections, in the order they run.
SECTIONS = (
    "numerics", "gemms", "kernels", "quantize", "transpose", "blockwise", "grouped", "moe",
    "steps", "llama", "profile",
)  # fmt: skip

#: The moe section's variants by mode (`moe.VARIANTS`), the two BF16 steps first: the
#: others' references.
MOE_VARIANTS = {
    "full": [
        "bf16",
        "bf16 jax mgpu",
        "blockwise",
        "blockwise-tc",
        "delayed-e4m3",
        "blockwise-tiled",
        "blockwise-tile-scales",
        "blockwise-chained",
        "blockwise-slabs",
    ],
    "quick": ["bf16", "bf16 jax mgpu", "blockwise", "blockwise-tiled"],
    # The dry run's FP8 steps would interpret every grouped kernel (seconds each): the
    # recipes' layers are tested apart (tests/test_grouped_native.py).
    "dry": ["bf16", "bf16 jax mgpu"],
}


def parser() -> argparse.ArgumentParser:
    """The check's options."""
    parser = argparse.ArgumentParser(
        prog="python3 benchmarks/gpu_check",
        description="fp8jax's one prepared device check: kernel numerics, GEMM timings, "
        "train steps, the Llama block timed and profiled (see benchmarks/README.md).",
    )
    parser.add_argument("--out", type=out_folder, required=True, help="folder for the results")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="fewer shapes (under 4 minutes)")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU, kernels in Mosaic GPU's interpreter; no timing claims",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for all measurements (default: 450 full, 210 quick, 300 dry run)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, in the order given (default: all of "
        f"{','.join(SECTIONS)}, in that order; profile after llama, whose compiled steps it "
        "traces): the budget goes to the first, and a later GPU run can spend its own where "
        "the last ran out",
    )
    parser.add_argument(
        "--llama-variants",
        default=None,
        help="comma-separated llama_block variants for the llama and profile sections "
        "(default: the mode's own; BF16 always runs first), e.g. bf16,blockwise,"
        "blockwise-tiled for issue 39's step ratios",
    )
    parser.add_argument(
        "--moe-variants",
        default=None,
        help="comma-separated variants of the moe section, in the order given (default: the "
        "mode's own), e.g. 'bf16,bf16 jax mgpu,blockwise,blockwise-tc' for issue 39's MoE "
        "target; 'bf16 jax mgpu' is checked against 'bf16' (both needed for the ratios)",
    )
    parser.add_argument(
        "--hang-s",
        type=float,
        default=None,
        help="seconds without a line of progress after which the check's process is killed "
        "as hung, its measurement recorded as crashed and the check started again without "
        "what shares its kernel (default: 90 on a GPU; none in a dry run)",
    )
    # Set by `supervise.py` when it starts the check again after a crash or hang.
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    # Set by `lease.py`: its parts' folders are outside `$OUT`, packed into it by the lease.
    parser.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse(argv: list[str] | None, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`argv` parsed and checked: exits naming an unknown, repeated or misordered section, an
    unknown variant, variants of a section not run, a time that is not a positive number (a
    budget: finite), an
    out folder that cannot be made, whose files would not come back from `$OUT`, or (but in
    a dry run, or a lease's part: `--packed`) that is outside `$OUT` where it is set."""
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.moe_variants = _names(args.moe_variants)
    args.llama_variants = _names(args.llama_variants)
    bad = [v for v in args.moe_variants or () if v not in MOE_VARIANTS["full"]]
    if bad or args.moe_variants == []:
        parser.error(
            f"--moe-variants: unknown {bad}; should name some of {','.join(MOE_VARIANTS['full'])}"
        )
    bad = unknown(args.llama_variants or [])
    if bad or args.llama_variants == []:
        parser.error(f"--llama-variants: unknown {bad}; should name some of {accepted()}")
    unknown_sections = [s for s in args.sections if s not in SECTIONS]
    if unknown_sections or not args.sections:
        parser.error(
            f"--sections={','.join(args.sections)!r}: unknown {unknown_sections}; "
            f"should name one or more of {','.join(SECTIONS)}"
        )
    repeated = sorted({s for s in args.sections if args.sections.count(s) > 1})
    if repeated:
        parser.error(f"--sections={','.join(args.sections)!r}: {repeated} named twice")
    if "profile" in args.sections and "llama" in args.sections[args.sections.index("profile") :]:
        parser.error(
            f"--sections={','.join(args.sections)!r}: profile before llama; name llama first "
            "(profile traces the steps llama compiled)"
        )
    for flag, given, needs in (
        ("--llama-variants", args.llama_variants, ("llama", "profile")),
        ("--moe-variants", args.moe_variants, ("moe",)),
    ):
        if given is not None and not set(needs) & set(args.sections):
            parser.error(
                f"{flag}={','.join(given)!r} is for the {' and '.join(needs)} section(s), which "
                f"--sections={','.join(args.sections)!r} leaves out: add one, or drop {flag}"
            )
    refused = hang_refused(args.hang_s)
    if refused:
        parser.error(refused)
    if args.budget_s is not None and not 0 < args.budget_s < math.inf:  # inf: no bound
        parser.error(f"--budget-s={args.budget_s}: should be a positive, finite number of seconds")
    refused = unwritable("--out", args.out) or returned.out_refused("--out", args.out)
    if refused:
        parser.error(refused)
    refused = None if args.packed else returned.outside_refused("--out", args.out)
    if refused and not args.dry_run:  # a dry run's folder is anywhere (supervise warns)
        parser.error(refused)
    return args


def out_folder(text: str) -> Path:
    """A folder's name; an empty one (`--out "$OUT"` with `$OUT` unset) is refused: as
    `Path("")`, the current folder, it put the results where they do not come back."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: empty; name a folder (made if missing)")
    return Path(text)


def hang_refused(hang_s: float | None) -> str | None:
    """Why `--hang-s` cannot be waited for (`inf` raised OverflowError in the supervisor's
    first wait), or None."""
    if hang_s is not None and not 0 < hang_s <= threading.TIMEOUT_MAX:
        return (
            f"--hang-s={hang_s}: should be a positive number of seconds, at most "
            f"{threading.TIMEOUT_MAX:.0f}"
        )
    return None


def unwritable(flag: str, folder: Path) -> str | None:
    """Why `folder` cannot hold results (a file, under a file, a folder not writable), or
    None: found when the run would make it, after seconds of imports, with a traceback."""
    if folder.exists() and not folder.is_dir():
        return f"{flag}={str(folder)!r} is a file; give a folder (made if missing)"
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{flag}={str(folder)!r} is under {str(existing)!r}, a file; give a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag}={str(folder)!r}: {str(existing)!r} cannot be written; give a folder"
    return None


def _names(given: str | None) -> list[str] | None:
    return None if given is None else [v.strip() for v in given.split(",") if v.strip()]

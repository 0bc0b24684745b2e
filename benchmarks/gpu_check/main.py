"""The GPU check's command line: the sections in order, the decision inputs, the summary."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax

from . import (
    block_kernels,
    gemms,
    grouped,
    llama,
    moe,
    numerics,
    options,
    profile,
    quantize,
    steps,
    transpose,
)
from .options import SECTIONS  # noqa: F401 - the sections, in the order they run
from .record import MODES, OUTSIDE, Recorder
from .timing import METHOD


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked (`options.parse`)."""
    return options.parse(argv, options.parser())


def environment(mode: str) -> dict[str, str]:
    """Device, versions and options: the first thing printed and recorded."""
    import jaxlib

    import fp8jax

    device = jax.devices()[0]
    return {
        "mode": mode,
        "device": f"{device.platform}: {getattr(device, 'device_kind', '?')}",
        "devices": str(len(jax.devices())),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "?"),
        "python": platform.python_version(),
        "fp8jax": os.path.dirname(fp8jax.__file__),
        "cuBLAS compiler options": json.dumps(fp8jax.gpu_compiler_options()),
        "timing": METHOD,
    }


def _ratio(times: dict, slow: str, fast: str) -> str | None:
    if slow in times and fast in times:
        return f"{times[slow] / times[fast]:.2f}"
    return None


def decisions(rec: Recorder, dense: dict, groups: dict, trains: dict) -> None:
    """The measured comparisons that would decide fp8jax's defaults (none is changed here)."""
    for label, t in dense.items():
        if label.startswith("block kernel tiles"):
            if t:
                best = min(t, key=t.get)
                rec.decision(
                    f"block kernel tiles ({label}): fastest (tile_m, tile_n, steps) = {best}, "
                    f"{t[best]:.3f} ms; default {gemms.TILES[0]} "
                    f"{t.get(str(gemms.TILES[0]), float('nan')):.3f} ms"
                )
            continue
        for what, slow, fast in (
            (
                "residual: two cuBLASLt calls / fused kernel",
                "residual 2x cuBLASLt",
                "residual fused",
            ),
            ("blockwise: XLA path / block kernel", "blockwise XLA", "block kernel"),
            (
                "per-tensor FP8: XLA default options / cuBLAS options",
                "fp8 XLA default",
                "fp8 cuBLASLt",
            ),
        ):
            ratio = _ratio(t, slow, fast)
            if ratio:
                rec.decision(f"{what}, {label}: time ratio {ratio} (> 1: the second is faster)")
    for label, t in groups.items():
        for slow in ("bf16 lax.ragged_dot", *(k for k in t if k.startswith("bf16 jax mgpu"))):
            for fast in (
                "fp8 per-tensor kernel",
                "fp8 blockwise kernel",
                "fp8 per-tensor persistent kernel",
                "fp8 blockwise persistent kernel",
            ):
                ratio = _ratio(t, slow, fast)
                if ratio:
                    rec.decision(f"grouped, {label}: {slow} / {fast}: time ratio {ratio}")
        swept = {k: v for k, v in t.items() if k.startswith("fp8 blockwise persistent")}
        if swept and "fp8 blockwise kernel" in t:
            best = min(swept, key=swept.get)
            rec.decision(
                f"grouped, {label}: fastest persistent blockwise configuration: {best} "
                f"({swept[best]:.3f} ms); tiled / it: time ratio "
                f"{t['fp8 blockwise kernel'] / swept[best]:.2f}"
            )
            jax_bf16 = {k: v for k, v in t.items() if k.startswith("bf16 jax mgpu")}
            if jax_bf16:  # issue 39's target: at least 1.4x JAX's BF16 grouped kernel
                fastest = min(jax_bf16, key=jax_bf16.get)
                rec.decision(
                    f"grouped, {label}: fastest {fastest} / fastest persistent blockwise: time "
                    f"ratio {jax_bf16[fastest] / swept[best]:.2f} (issue 39's target: >= 1.4)"
                )
    for model, fields in trains.items():
        t = {k: v["ms"] for k, v in fields.items()}
        for slow, fast in (("residual-xla", "residual"), ("blockwise-xla", "blockwise")):
            ratio = _ratio(t, slow, fast)
            if ratio:
                rec.decision(f"train step {model}: {slow} / {fast}: time ratio {ratio}")
        for name in [k for k in t if not k.endswith("XLA defaults")]:
            ratio = _ratio(t, f"{name}, XLA defaults", name)
            if ratio:
                rec.decision(
                    f"train step {model}, {name}: XLA default options / gpu_compiler_options(): "
                    f"time ratio {ratio}"
                )


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 0, or 1 when a measurement raised or a numerics check failed.
    An exception outside any measurement (the environment, between measurements, the
    decisions, the summary's tables) is recorded and the summary still written."""
    args = parse(argv)
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    if mode == "dry":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before jax starts its backends
    budget, gemm_runs, step_runs, reserve = MODES[mode]
    rec = Recorder(args.out, args.budget_s or budget, reserve, mode == "dry", args.resume)
    found: dict[str, dict] = {"gemms": {}, "grouped": {}, "steps": {}}
    with _outside(rec, "(check)"):
        _sections(args, rec, mode, (gemm_runs, step_runs), found)
    with _outside(rec, "(decisions)"):
        decisions(rec, found["gemms"], found["grouped"], found["steps"])
    try:
        summary = _summary(rec, mode)
    except Exception as error:  # noqa: BLE001 - the counts and the error, not nothing
        _record_error(rec, "(summary)", error)
        counts = ", ".join(f"{v} {k}" for k, v in rec.counts.items())
        summary = f"## Summary ({counts}; results.jsonl has every figure)\n\n"
        summary += f"The summary's tables raised:\n{traceback.format_exc()}"
    (args.out / "summary.txt").write_text(summary + "\n")
    print(summary, flush=True)
    return 1 if rec.counts["error"] or rec.counts["failed"] else 0


@contextlib.contextmanager
def _outside(rec: Recorder, where: str) -> Iterator[None]:
    """An exception outside any measurement recorded as `where`'s error (its traceback
    kept), so that the summary is written after it."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - a failure is a result here
        _record_error(rec, where, error)


def _record_error(rec: Recorder, where: str, error: Exception) -> None:
    rec.record(
        where,
        OUTSIDE,
        "error",
        error=f"{type(error).__name__}: {str(error)[:500]}",
        traceback=traceback.format_exc(),
    )


def _sections(
    args: argparse.Namespace,
    rec: Recorder,
    mode: str,
    runs: tuple[int, int],
    found: dict[str, dict],
) -> None:
    """The environment printed and recorded, then the sections in the order given, each
    one's result for the decisions put in `found`."""
    gemm_runs, step_runs = runs
    env = environment(mode)
    (args.out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    header = "\n".join(f"{k}: {v}" for k, v in env.items())
    print(f"# fp8jax GPU check ({mode})\n{header}", flush=True)
    rec.log(f"environment: {json.dumps(env)}")
    rec.log(f"sections: {','.join(args.sections)}")
    if mode != "dry" and jax.devices()[0].platform != "gpu":  # CPU-timed full shapes: none
        raise RuntimeError(
            f"no GPU: JAX's first device is {env['device']!r} (a jaxlib without CUDA falls back "
            "to the CPU); the check measures nothing; --dry-run is the CPU's check"
        )
    prepared: llama.Cache = {}  # the Llama steps section 4 compiled, traced by section 5
    runners: dict[str, tuple[str, Callable[[], Any]]] = {
        "numerics": (numerics.SECTION, lambda: numerics.run(rec, mode)),
        "gemms": (gemms.SECTION, lambda: gemms.run(rec, mode, gemm_runs)),
        "kernels": (
            block_kernels.SECTION,
            lambda: block_kernels.decide(rec, block_kernels.run(rec, mode, gemm_runs)),
        ),
        "quantize": (
            quantize.SECTION,
            lambda: quantize.decide(rec, quantize.run(rec, mode, gemm_runs)),
        ),
        "transpose": (
            transpose.SECTION,
            lambda: transpose.decide(rec, transpose.run(rec, mode, gemm_runs)),
        ),
        "blockwise": (
            transpose.BLOCKWISE_SECTION,
            lambda: transpose.decide(rec, transpose.run(rec, mode, gemm_runs, blockwise=True)),
        ),
        "grouped": (grouped.SECTION, lambda: grouped.run(rec, mode, gemm_runs)),
        "moe": (
            moe.SECTION,
            lambda: moe.decide(rec, moe.run(rec, mode, step_runs, args.moe_variants)),
        ),
        "steps": (steps.SECTION, lambda: steps.run(rec, mode, step_runs)),
        "llama": (
            llama.SECTION,
            lambda: llama.decide(
                rec, llama.run(rec, mode, step_runs, prepared, args.llama_variants)
            ),
        ),
        "profile": (
            profile.SECTION,
            lambda: profile.run(rec, mode, prepared, args.llama_variants),
        ),
    }
    for name in args.sections:  # in the order given: the budget goes to the first
        section, run = runners[name]
        result = None  # stays None where the section raised (recorded as its error)
        with rec.section(section):
            result = run()
        if name in found and result is not None:
            found[name] = result
        if name == "profile":
            prepared.clear()
        _release()


def _release() -> None:
    """Drop compiled programs and buffers between sections (device memory, CPU mappings)."""
    jax.clear_caches()
    gc.collect()


#: What each section's cells say.
LEGENDS = {
    numerics.SECTION: "max error relative to max |reference|; pass: every element within the "
    "interpreter tests' bound (FP8 wgmma's own accumulation may exceed it: up to 2^-7 is "
    "flagged apart)",
    gemms.SECTION: "ms (TFLOP/s, speed-up over BF16 of the same shape)",
    block_kernels.SECTION: "numerics rows: max error relative to max |float64 reference|; "
    "shape rows: ms (TFLOP/s, speed-up over BF16 of the same shape), the persistent "
    "warp-specialized kernel's configurations beside the tiled block kernel, per-tensor "
    "FP8 (cuBLASLt) and BF16",
    quantize.SECTION: "numerics: elements differing from an IEEE NumPy reference (the kernels "
    "must show 0; XLA's GPU fusions divide approximately); path: case: ms (GB/s of the "
    "bytes the case must move), the one-pass kernels beside the recipe's XLA path",
    transpose.SECTION: "numerics: elements of the two FP8 copies differing from a NumPy cast "
    "(must be 0), amax against NumPy's; way: ms (GB/s of the bytes the pass must move: read "
    "x, write two FP8 copies; the reference x + 1: read and write x)",
    transpose.BLOCKWISE_SECTION: "numerics: elements of the FP8 copies and scales differing "
    "from an IEEE NumPy reference (must be 0), amax against NumPy's; way: ms (GB/s of the "
    "bytes the pass must move; the reference x + 1: read and write x)",
    grouped.SECTION: "ms (TFLOP/s of the real tokens, speed-up over BF16 lax.ragged_dot)",
    moe.SECTION: "ms per step, x each BF16 step (XLA's lax.ragged_dot; JAX's Pallas grouped "
    "kernels, checked against it first: issue 39's yardstick)",
    steps.SECTION: "ms per step, measured time x BF16 (the cost model's ESTIMATE x BF16, "
    "from the step's compiled HLO)",
    llama.SECTION: "ms per step (one step at a time, each waited for; then pipelined: "
    f"{llama.PIPELINED} steps launched back to back), x BF16 of the same size and attention; "
    "beside it the "
    "compiled step's HLO (llama_block.split): kernels, non-GEMM HBM bytes (attention's left "
    "out), temp memory, each x BF16",
    profile.SECTION: f"device ms per step from a jax.profiler trace ({profile.TRACED} steps "
    f"after {profile.WARMUP} warm-ups, mean): GEMM fp8 | GEMM bf16 | attention | rest "
    "(rest x BF16); GPU idle inside the step (span less busy) ms; kernels per step (x BF16); "
    "the rest's HBM rate by kind (TB/s: its kernels' bytes from the compiled HLO over their "
    f"time); every kernel, with its bytes and rate, in {profile.KERNELS_FILE}",
}


def _summary(rec: Recorder, mode: str) -> str:
    """Decision inputs, one compact table per section, and the sections' table last."""
    from train_steps import table

    lines = ["", "## Decision inputs (measured; no default is changed by this run)", ""]
    lines += [f"- {d}" for d in rec.decisions] or ["- (none measured)"]
    if mode == "dry":
        lines += ["", "DRY RUN on the CPU: kernels interpreted, no timing claims."]
    for section, rows in rec.cells.items():
        columns = list(dict.fromkeys(c for cells in rows.values() for c in cells))
        body = [[row, *(cells.get(c, "") for c in columns)] for row, cells in rows.items()]
        lines += ["", f"## {section}: {LEGENDS[section]}", ""]
        lines.append(table(body, ["", *columns]))
    counts = ", ".join(f"{v} {k}" for k, v in rec.counts.items())
    lines += ["", f"## Summary ({counts}; results.jsonl has every figure)", ""]
    status = [
        [name, f"{c.get('seconds', float('nan')):.1f}", *(str(c[k]) for k in rec.counts)]
        for name, c in rec.sections.items()
    ]
    lines.append(table(status, ["section", "seconds", *rec.counts]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

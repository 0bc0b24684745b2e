"""Section 5: where the Llama block's step spends its device time, from a `jax.profiler` trace.

For each variant of section 4 (the same sizes; its compiled steps reused, compiled here when
section 4 did not run), two warm-up steps untraced, then `TRACED` steps inside
`jax.profiler.trace`, each in a `StepTraceAnnotation` and ended by `block_until_ready`. The
trace's `.xplane.pb` is read with `jax.profiler.ProfileData`: the kernels are the events of
the device plane's (`/device:GPU:0`) stream lines ("Stream #..."), the steps' bounds the
annotations' starts on the host (or, where these do not give every step the same number
of kernels, the widest gaps between kernels).

Each kernel is classified by the HLO instruction it ran for (its `hlo_op` stat; else its
name, which for XLA's own kernels is the instruction's name) looked up among the kernels of
`fp8jax.hlo_cost` of the compiled step (`llama_block.kind_of`: "GEMM fp8", "GEMM bf16",
the non-GEMM categories), cuDNN's kernels named as attention; a kernel found in neither by
its name (`kind_from_name`: cuDNN/fmha/flash -> attention; cuBLAS/nvjet/xmma/gemm -> GEMM,
FP8 where the name says e4m3/e5m2/f8). Per step: device time (the kernels' durations summed)
split into GEMM fp8, GEMM bf16 (other GEMM precisions apart), attention and the rest; GPU
idle inside the step (from the first kernel's start to the last one's end, less the union
of the kernels' intervals); kernels per step. The summary gives the mean over the traced
steps and, beside BF16's of the same size, the ratios of the rest and of the kernel count;
`profile_kernels.json` in the out folder keeps each variant's per-step figures and its
kernels by time. Each non-GEMM kernel found among the compiled step's (`hlo_bytes`) also gets
the HBM bytes `fp8jax.hlo_cost` counts for it and the rate it moved them at, and the summary
the rest's rate by kind (since session 35: run 6 showed XLA's transposing casts at under half
of HBM's rate, `benchmarks/profile_rates.py`).

The classification works on plain records (`Event`) so that it is tested without a GPU; the
reading of `ProfileData` is a thin layer over it (`read`). On a CPU there is no device plane:
the result says so ("no GPU device plane") and is recorded as skipped, with the same
analysis over the host's XLA:CPU thunk events as a stand-in check of the code (no claims).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from . import llama
from .profile_classify import (  # noqa: F401 - the classification, read here by its tests
    BUCKETS,
    TRACED,
    WARMUP,
    Event,
    analyse,
    busy_ns,
    bytes_for,
    classify,
    hlo_bytes,
    hlo_kinds,
    kernel_name,
    kind_from_name,
    split_by_gaps,
    split_steps,
    step_figures,
)
from .record import KERNELS_FILE, Recorder
from .timing import Compiled

SECTION = "5 profile"
DEVICE_PLANE = "/device:GPU:0"
STEP_MARK = "fp8jax_profile_step"
#: Seconds of the budget a trace needs: the compiled step reused, or compiled here.
TRACE_NEED_S = 15.0


# --- reading a trace: a thin layer over jax.profiler.ProfileData ------------------------------


#: Lines of a device plane that are not a stream's kernels (derived from them, or overhead).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source", "CUPTI overhead")


@dataclasses.dataclass
class Trace:
    """What the check reads of one trace: the planes' names, the device plane's kernels (None
    without a GPU device plane) and its lines' names, the host's XLA:CPU thunk events (the
    CPU stand-in), and the starts of the step annotations named `STEP_MARK`."""

    planes: list[str]
    device: list[Event] | None
    device_lines: list[str]
    host_ops: list[Event]
    marks: list[float]


def _event(e: Any) -> Event:
    stats = dict(e.stats)
    return Event(e.name, float(e.start_ns), float(e.duration_ns), str(stats.get("hlo_op", "")))


def read(data: Any, device_plane: str = DEVICE_PLANE) -> Trace:
    """The `Trace` of a `jax.profiler.ProfileData`."""
    planes = list(data.planes)
    device, device_lines, host_ops, marks = None, [], [], []
    for plane in planes:
        if plane.name == device_plane:
            lines = list(plane.lines)
            device_lines = [line.name for line in lines]
            streams = [line for line in lines if line.name.startswith("Stream #")]
            if not streams:  # not named as XLA's CUPTI collector names them: every kernel line
                streams = [line for line in lines if not line.name.startswith(DERIVED_LINES)]
            device = [_event(e) for line in streams for e in line.events]
            continue
        for line in plane.lines:
            for e in line.events:
                if e.name == STEP_MARK:
                    marks.append(float(e.start_ns))
                elif plane.name.startswith("/host:") and any(k == "hlo_op" for k, _ in e.stats):
                    host_ops.append(_event(e))
    return Trace([p.name for p in planes], device, device_lines, host_ops, sorted(marks))


def trace_steps(compiled: Compiled, folder: Path) -> tuple[Any, list[float]]:
    """`WARMUP` steps, then `TRACED` steps traced into `folder`: (the trace's `ProfileData`,
    each traced step's host wall time in ms)."""
    for _ in range(WARMUP):
        compiled.run()
    walls = []
    with jax.profiler.trace(str(folder)):
        for i in range(TRACED):
            began = time.perf_counter()
            with jax.profiler.StepTraceAnnotation(STEP_MARK, step_num=i):
                compiled.run()
            walls.append((time.perf_counter() - began) * 1e3)
    found = sorted(folder.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {folder}")
    return jax.profiler.ProfileData.from_file(str(found[-1])), walls


# --- the section ---------------------------------------------------------------------------


def _profile(
    size: str, name: str, mode: str, cache: llama.Cache, seen: dict, kernels: dict, out: Path
) -> dict[str, Any]:
    prepared = cache.get((size, name))
    fields: dict[str, Any] = {}
    if prepared is None:  # section 4 did not run (or not this variant): compile it here
        for attention in llama.attentions(mode):
            try:
                compiled, _ = llama.prepare(size, name, attention, runs=0)
            except Exception as error:  # noqa: BLE001 - the fallback is recorded
                fields[f"{attention}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                continue
            prepared = cache[(size, name)] = llama.Prepared(compiled, attention)
            break
        else:
            raise RuntimeError(f"no attention compiled: {fields}")
        fields["compiled_here"] = True
    fields["attention"] = prepared.attention
    with tempfile.TemporaryDirectory(prefix="fp8jax_profile_") as folder:
        data, walls = trace_steps(prepared.compiled, Path(folder))
        trace = read(data)
    kinds = hlo_kinds(prepared.compiled.hlo)
    fields.update(planes=trace.planes, marks=len(trace.marks), wall_ms=walls)
    fields["ms"] = statistics.median(walls)
    if trace.device is None:
        fields["skipped"] = "no GPU device plane: kernel times are GPU only"
        kernels[f"{size} {name}"] = {"device_plane": None, **fields}
        if trace.host_ops:  # the same analysis over XLA:CPU's thunks: a check of the code
            stand_in = analyse(trace.host_ops, trace.marks, kinds)
            fields["cpu_stand_in"] = _brief(stand_in)
            kernels[f"{size} {name}"]["cpu_stand_in"] = stand_in
        _write(out, kernels)
        return fields
    fields["device_lines"] = trace.device_lines
    if not trace.device:
        raise RuntimeError(f"{DEVICE_PLANE} has no kernel events; its lines: {trace.device_lines}")
    figures = analyse(trace.device, trace.marks, kinds, moved=hlo_bytes(prepared.compiled.hlo))
    base = seen.get((size, prepared.attention, "bf16"))
    if base is not None and name != "bf16":
        fields["rest_vs_bf16"] = _ratio(figures["device_ms"]["rest"], base["device_ms"]["rest"])
        fields["kernels_vs_bf16"] = _ratio(figures["kernels"], base["kernels"])
    seen[(size, prepared.attention, name)] = figures
    kernels[f"{size} {name}"] = {"attention": prepared.attention, **figures}
    _write(out, kernels)
    fields.update(_brief(figures))
    return fields


def _brief(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures without the per-step lists and top kernels (those go to the JSON file)."""
    return {k: v for k, v in figures.items() if k not in ("per_step", "top")}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _write(out: Path, kernels: dict) -> None:
    (out / KERNELS_FILE).write_text(json.dumps(kernels, indent=1) + "\n")


def _cells(rec: Recorder, size: str, name: str, fields: dict[str, Any], note: str) -> None:
    if "skipped" in fields:
        stand_in = fields.get("cpu_stand_in")
        text = "no GPU device plane"
        if stand_in:
            text += f" (CPU stand-in: {stand_in['kernels']:.0f} XLA ops per step)"
        rec.cell(SECTION, name, f"{size} device ms", text)
        return
    d = fields["device_ms"]
    split = f"{d['GEMM fp8']:.2f} | {d['GEMM bf16']:.2f} | {d['attention']:.2f} | {d['rest']:.2f}"
    if d["GEMM other"]:
        split += f" (+ GEMM other {d['GEMM other']:.2f})"
    kernels = f"{fields['kernels']:.0f}"
    if "rest_vs_bf16" in fields:
        split += f" ({fields['rest_vs_bf16']:.2f}x)"
        kernels += f" ({fields['kernels_vs_bf16']:.2f}x)"
    rec.cell(SECTION, name, f"{size} device ms", split + note)
    rec.cell(SECTION, name, f"{size} idle ms", f"{fields['idle_ms']:.2f}")
    rec.cell(SECTION, name, f"{size} kernels", kernels)
    rates = fields.get("rest_tb_s") or {}
    rec.cell(
        SECTION,
        name,
        f"{size} rest TB/s",
        " | ".join(f"{kind} {rate:.2f}" for kind, rate in sorted(rates.items())) or "-",
    )


def run(
    rec: Recorder,
    mode: str,
    cache: llama.Cache | None = None,
    variants: list[str] | None = None,
) -> dict[str, dict]:
    """Trace every size's variants (`variants`, default the llama section's; section 4's
    compiled steps where `cache` has them); returns `{size: {variant: fields}}`."""
    cache = {} if cache is None else cache
    names = (
        llama.VARIANTS[mode]
        if variants is None
        else ["bf16", *(v for v in variants if v != "bf16")]
    )
    results: dict[str, dict] = {}
    seen: dict[tuple[str, str, str], dict] = {}  # (size, attention, variant) -> figures
    kernels: dict[str, Any] = {}
    for size in llama.SIZES[mode]:
        for name in names:
            need = TRACE_NEED_S if (size, name) in cache else llama.NEED_S[size]
            measure = functools.partial(_profile, size, name, mode, cache, seen, kernels, rec.out)
            fields = rec.measure(SECTION, f"{size} | {name}", measure, need_s=need)
            if fields is None:
                rec.cell(SECTION, name, f"{size} device ms", rec.not_run())
                continue
            results.setdefault(size, {})[name] = fields
            usual = fields["attention"] == llama.attentions(mode)[0]
            _cells(rec, size, name, fields, "" if usual else f" ({fields['attention']} attention)")
    return results

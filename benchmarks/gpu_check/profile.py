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

import collections
import dataclasses
import functools
import json
import re
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import llama_block

import fp8jax

from . import llama
from .record import KERNELS_FILE, Recorder
from .timing import Compiled

SECTION = "5 profile"
DEVICE_PLANE = "/device:GPU:0"
STEP_MARK = "fp8jax_profile_step"
WARMUP, TRACED = 2, 2
#: The columns of the device time split, in order.
BUCKETS = ("GEMM fp8", "GEMM bf16", "GEMM other", "attention", "rest")
#: How many kernels by time `profile_kernels.json` keeps per variant (all of a Llama step's).
TOP = 200
#: Seconds of the budget a trace needs: the compiled step reused, or compiled here.
TRACE_NEED_S = 15.0


@dataclasses.dataclass(frozen=True)
class Event:
    """One kernel (or copy) on the device: its name, start and duration in nanoseconds, and
    the HLO instruction it ran for ("" when the trace does not say)."""

    name: str
    start_ns: float
    duration_ns: float
    hlo_op: str = ""

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.duration_ns


# --- classification: pure functions over `Event`s -------------------------------------------

_ATTENTION_WORDS = ("cudnn", "fmha", "flash", "sdpa")
_GEMM_WORDS = ("gemm", "cublas", "nvjet", "xmma", "cutlass", "matmul")
_FP8_WORDS = ("e4m3", "e5m2", "fp8", "f8")
#: cuBLAS's `nvjet` kernels (CUDA 13) name their operand types before `tst`: none for BF16
#: (`nvjet_sm90_tst_...`), `qq` for E4M3 x E4M3 and `qr` for E4M3 x E5M2 (read off run 4's
#: H200 trace: 7 `qq` and 14 `qr` per step where the step has 7 forward and 14 backward FP8
#: GEMMs, none in BF16's step). XLA runs them inside command buffers, whose events name no
#: HLO instruction, so the name is all there is to go by.
_NVJET_FP8 = re.compile(r"nvjet_sm\d+_[qr]+tst")


def kernel_name(hlo_name: str) -> str:
    """The name XLA gives the GPU kernel of an HLO instruction (`llvm_ir::SanitizeFunctionName`:
    every character other than a letter, a digit or `_` becomes `_`)."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in hlo_name)


@functools.lru_cache(maxsize=2)
def compiled_cost(hlo: str) -> Any:
    """`fp8jax.hlo_cost(hlo)`, read once for `hlo_kinds` and `hlo_bytes` of the same step."""
    return fp8jax.hlo_cost(hlo)


def hlo_kinds(hlo: str) -> dict[str, str]:
    """HLO instruction name -> its kind (`llama_block.kind_of`) for every kernel that
    `fp8jax.hlo_cost` finds in the compiled module `hlo`, also under its kernel name."""
    kinds: dict[str, str] = {}
    for kernel in compiled_cost(hlo).kernels:
        if not hasattr(kernel, "category"):  # a collective
            kind = "collective"
        else:
            kind = llama_block.kind_of(kernel)
        kinds[kernel.name] = kind
        kinds.setdefault(kernel_name(kernel.name), kind)
    return kinds


def hlo_bytes(hlo: str) -> dict[str, float]:
    """HLO instruction name -> the HBM bytes `fp8jax.hlo_cost` counts for one run of its
    kernel (non-GEMM kernels only), also under its kernel name: with a kernel's measured
    time, the rate it moved them at."""
    moved: dict[str, float] = {}
    for kernel in compiled_cost(hlo).kernels:
        if getattr(kernel, "category", None) is None:  # a GEMM or a collective
            continue
        moved[kernel.name] = float(kernel.bytes)
        moved.setdefault(kernel_name(kernel.name), float(kernel.bytes))
    return moved


def bytes_for(event: Event, moved: Mapping[str, float]) -> float | None:
    """The bytes of `hlo_bytes` for the kernel of `event` (by its HLO instruction, else its
    name), or None."""
    if event.hlo_op in moved:
        return moved[event.hlo_op]
    return moved.get(event.name)


def kind_from_name(name: str) -> str:
    """A kernel's kind from its name alone: attention, a GEMM (FP8 where the name says so),
    or "unmatched"."""
    low = name.lower()
    if any(w in low for w in _ATTENTION_WORDS):
        return "attention"
    if any(w in low for w in _GEMM_WORDS):
        fp8 = any(w in low for w in _FP8_WORDS) or _NVJET_FP8.match(low)
        return "GEMM fp8" if fp8 else "GEMM bf16"
    return "unmatched"


def classify(event: Event, kinds: Mapping[str, str]) -> tuple[str, str, str]:
    """(bucket of `BUCKETS`, the detailed kind, how it was found: "hlo_op", "name" or
    "heuristic")."""
    by_name = kind_from_name(event.name)
    if event.hlo_op in kinds:
        kind, how = kinds[event.hlo_op], "hlo_op"
    elif event.name in kinds:
        kind, how = kinds[event.name], "name"
    else:
        kind, how = by_name, "heuristic"
    if by_name == "attention" and not kind.startswith("GEMM"):
        kind = "attention"  # cuDNN's kernel for a custom call that hlo_cost counts as "rest"
    return bucket(kind), kind, how


def bucket(kind: str) -> str:
    """The column of `BUCKETS` a detailed kind goes to."""
    if kind in ("GEMM fp8", "GEMM bf16", "attention"):
        return kind
    return "GEMM other" if kind.startswith("GEMM") else "rest"


def busy_ns(events: Iterable[Event]) -> float:
    """The length of the union of the events' intervals (overlapping kernels counted once)."""
    total, end = 0.0, None
    for e in sorted(events, key=lambda e: e.start_ns):
        if end is None or e.start_ns >= end:
            total += e.duration_ns
            end = e.end_ns
        elif e.end_ns > end:
            total += e.end_ns - end
            end = e.end_ns
    return total


def split_steps(events: Iterable[Event], starts: Sequence[float]) -> list[list[Event]]:
    """The events of each step: step `i` holds those starting in `[starts[i], starts[i+1])`
    (the last one, from its start on); events before the first start are dropped."""
    bounds = sorted(starts)
    steps: list[list[Event]] = [[] for _ in bounds]
    for e in sorted(events, key=lambda e: e.start_ns):
        i = sum(1 for b in bounds if b <= e.start_ns) - 1
        if i >= 0:
            steps[i].append(e)
    return steps


def split_by_gaps(events: Iterable[Event], n: int) -> list[list[Event]]:
    """`n` steps cut at the `n - 1` widest gaps in which no event runs (for a trace without
    step annotations)."""
    ordered = sorted(events, key=lambda e: e.start_ns)
    if n <= 1 or len(ordered) < n:
        return [ordered]
    gaps, end = [], ordered[0].end_ns
    for i in range(1, len(ordered)):
        gaps.append((ordered[i].start_ns - end, i))
        end = max(end, ordered[i].end_ns)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: n - 1])
    return [ordered[a:b] for a, b in zip([0, *cuts], [*cuts, len(ordered)], strict=True)]


def step_figures(
    events: Sequence[Event], kinds: Mapping[str, str], moved: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """One step's figures (nanoseconds): `device_ns` by bucket (durations summed),
    `rest_ns` by detailed kind, `span_ns` (first start to last end), `busy_ns` (union),
    `idle_ns` (span less busy), `kernels` and how they were classified (`matched`); with
    `moved` (`hlo_bytes`), `rest_bytes` and `rest_bytes_ns` by kind: the bytes of the rest's
    kernels whose bytes are known, and those kernels' time."""
    device = dict.fromkeys(BUCKETS, 0.0)
    rest: collections.Counter[str] = collections.Counter()
    rest_bytes: collections.Counter[str] = collections.Counter()
    rest_bytes_ns: collections.Counter[str] = collections.Counter()
    matched: collections.Counter[str] = collections.Counter()
    for e in events:
        where, kind, how = classify(e, kinds)
        device[where] += e.duration_ns
        matched[how] += 1
        if where == "rest":
            rest[kind] += e.duration_ns
            size = None if moved is None else bytes_for(e, moved)
            if size is not None:
                rest_bytes[kind] += size
                rest_bytes_ns[kind] += e.duration_ns
    span = max((e.end_ns for e in events), default=0.0) - min(
        (e.start_ns for e in events), default=0.0
    )
    busy = busy_ns(events)
    return {
        "device_ns": device,
        "rest_ns": dict(rest),
        "span_ns": span,
        "busy_ns": busy,
        "idle_ns": span - busy,
        "kernels": len(events),
        "matched": dict(matched),
        "rest_bytes": dict(rest_bytes),
        "rest_bytes_ns": dict(rest_bytes_ns),
    }


def mean_figures(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The steps' mean, in milliseconds: `device_ms` by bucket, `rest_ms` by kind, `span_ms`,
    `busy_ms`, `idle_ms`, and `kernels` per step; `rest_tb_s` by kind: the HBM rate of the
    rest's kernels whose bytes are known (terabytes a second)."""
    n = len(steps)

    def mean(values: Iterable[float]) -> float:
        return sum(values) / n

    kinds = sorted({k for s in steps for k in s["rest_ns"]})
    moved: collections.Counter[str] = collections.Counter()  # the rest's bytes, where known
    timed: collections.Counter[str] = collections.Counter()  # and their kernels' time
    for s in steps:
        moved.update(s.get("rest_bytes", {}))
        timed.update(s.get("rest_bytes_ns", {}))
    return {
        "device_ms": {b: mean(s["device_ns"][b] for s in steps) / 1e6 for b in BUCKETS},
        "rest_ms": {k: mean(s["rest_ns"].get(k, 0.0) for s in steps) / 1e6 for k in kinds},
        "span_ms": mean(s["span_ns"] for s in steps) / 1e6,
        "busy_ms": mean(s["busy_ns"] for s in steps) / 1e6,
        "idle_ms": mean(s["idle_ns"] for s in steps) / 1e6,
        "kernels": mean(s["kernels"] for s in steps),
        "rest_tb_s": {k: moved[k] / timed[k] / 1e3 for k in timed if timed[k] > 0},
    }


def top_kernels(
    steps: Sequence[Sequence[Event]],
    kinds: Mapping[str, str],
    top: int = TOP,
    moved: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """The kernels of all steps grouped by (name, HLO instruction), by total time, longest
    first: `top` of them with their count, total and mean microseconds, bucket and kind,
    and with `moved` (`hlo_bytes`) the bytes of one run and its rate (`tb_s`) where known."""
    groups: dict[tuple[str, str], list[Event]] = collections.defaultdict(list)
    for events in steps:
        for e in events:
            groups[(e.name, e.hlo_op)].append(e)
    rows = []
    for (name, hlo_op), events in groups.items():
        where, kind, how = classify(events[0], kinds)
        total = sum(e.duration_ns for e in events)
        rows.append(
            {
                "name": name,
                "hlo_op": hlo_op,
                "bucket": where,
                "kind": kind,
                "classified_by": how,
                "count": len(events),
                "total_us": total / 1e3,
                "mean_us": total / len(events) / 1e3,
            }
        )
        size = None if moved is None else bytes_for(events[0], moved)
        if size is not None:
            rows[-1]["mb"] = size / 1e6
            rows[-1]["tb_s"] = size * len(events) / total / 1e3 if total else float("nan")
    rows.sort(key=lambda r: r["total_us"], reverse=True)
    return rows[:top]


def analyse(
    events: Sequence[Event],
    marks: Sequence[float],
    kinds: Mapping[str, str],
    n: int = TRACED,
    moved: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The figures of `n` traced steps of one program. The steps are split at the step
    annotations' starts `marks` (when there are `n`), else at the widest gaps between
    kernels; a split is `consistent` when every step has kernels, as many as the others
    (the same program each time). The first consistent split is taken, else the first."""
    splits = [("step annotations", split_steps(events, marks))] if len(marks) == n else []
    splits.append(("gaps between kernels", split_by_gaps(events, n)))
    consistent = [
        (how, steps)
        for how, steps in splits
        if len(steps) == n and all(steps) and len({len(s) for s in steps}) == 1
    ]
    how, steps = (consistent or splits)[0]
    figures = [step_figures(s, kinds, moved) for s in steps]
    return {
        "steps_split_by": how,
        "steps_consistent": bool(consistent),
        "steps": len(steps),
        "events_outside_steps": len(events) - sum(len(s) for s in steps),
        **mean_figures(figures),
        "per_step": figures,
        "top": top_kernels(steps, kinds, moved=moved),
    }


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

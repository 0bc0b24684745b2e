"""Section 5's classification of a trace's kernels (`profile.py`): pure functions over plain
records (`Event`), tested without a GPU: each kernel's kind (its HLO instruction among the
compiled step's, else its name), the steps split apart, and their figures (device time by
bucket, GPU idle, kernels, the rest's HBM rate by kind)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import llama_block

import fp8jax

WARMUP, TRACED = 2, 2
#: The columns of the device time split, in order.
BUCKETS = ("GEMM fp8", "GEMM bf16", "GEMM other", "attention", "rest")
#: How many kernels by time `profile_kernels.json` keeps per variant (all of a Llama step's).
TOP = 200


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

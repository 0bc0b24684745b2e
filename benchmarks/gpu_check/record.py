"""Where the GPU check's results go, as they are produced, and how it spends its budget.

Every result is one JSON line appended to `results.jsonl` and one line of `log.txt` in the
out folder the moment it exists, so that a run killed from outside (its `timeout`, the end of
a GPU lease) still leaves everything measured until then. Each measurement runs in its own
`try`: a failure is recorded with its traceback and the run goes on. A measurement that
leaves the GPU unusable (a kernel's illegal address poisons the process's CUDA context)
ends the process, and one that kills it or hangs is killed: `supervise.py` then starts the
check again with `resume`, which takes every result recorded back from `results.jsonl`
without running it again and skips what shares a kernel with the measurement that crashed
(`families`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: The budget of each mode: mode -> (budget seconds, runs per GEMM, runs per train step,
#: reserve seconds).
MODES = {"full": (450, 10, 10, 20), "quick": (210, 8, 5, 15), "dry": (300, 1, 1, 0)}
#: The check's entry point, which `supervise.py` runs as its child and `lease.py` per part.
SCRIPT = Path(__file__).resolve().parents[1] / "gpu_check.py"
#: A result's statuses, as `results.jsonl` records them.
STATUSES = ("ok", "failed", "error", "skipped")
#: The log's line before a measurement runs: what `supervise.py` blames for a crash or hang.
STARTED = "started "
#: The name of an error outside any measurement (the check's own, or its process's death).
OUTSIDE = "(outside any measurement)"
#: The profile section's kernels by time, per variant (`profile.py` writes it).
KERNELS_FILE = "profile_kernels.json"
#: The first word of a summary the supervisor wrote for a check that could not write its own.
INCOMPLETE = "INCOMPLETE:"
#: Exit statuses: the GPU unusable after a measurement's error; a fault injected to die.
BROKEN, DIED = 3, 70
#: `die:<text>;hang:<text>;broken:<text>`: measurements whose `"<out folder's name>: section |
#: name"` contains the text crash, hang or leave the GPU unusable (tests only).
FAULT_VARIABLE = "FP8JAX_GPU_CHECK_FAULT"
#: Kernels and kernel features several measurements share, by a pattern of the field
#: `family` reads: a crash or hang in one puts every other under suspicion (a kernel that
#: hangs would otherwise cost `--hang-s` once per configuration, size and section).
SHARED = {
    "the per-tensor kernel on the tensor cores": r"^tensor cores\b|^(delayed|current)\S*-tc\b",
    "two chunks a step": r"chunks_per_step=2|^blockwise-pairs\b",
    "chained pipelines": r"chained=True|chained persistent|^blockwise-chained\b",
    "scales under the wgmma": r"scales_under_wgmma=True",
    "three compute warpgroups": r"compute_wgs=3|^blockwise-tile-scales-three\b",
}


class Recorder:
    """The out folder, the time budget and the summary rows of one run.

    `budget_s`: seconds from the start for all measurements; each one starts only if more
    than `reserve_s` are left (a compile and a few runs fit in that), else it is recorded as
    skipped. `dry`: the CPU dry run (kernels interpreted, no timing claims).
    """

    def __init__(
        self, out: Path, budget_s: float, reserve_s: float, dry: bool, resume: bool = False
    ):
        self.out, self.budget_s, self.reserve_s, self.dry = out, budget_s, reserve_s, dry
        out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        #: section -> row -> column -> text: the compact tables of the summary.
        self.cells: dict[str, dict[str, dict[str, str]]] = {}
        self.sections: dict[str, dict[str, float]] = {}
        self.decisions: list[str] = []
        self.counts = dict.fromkeys(STATUSES, 0)
        self.last_status = ""
        #: (section, name) -> what an earlier process recorded (`resume`); family -> the
        #: measurement in which that family crashed or hung.
        self.done: dict[tuple[str, str], dict[str, Any]] = {}
        self.broken: dict[str, str] = {}
        if resume:
            for entry in read_results(out / "results.jsonl"):
                if entry["name"] == OUTSIDE:  # no measurement takes it back: counted now
                    self._replay(entry)
                    continue
                if _no_time(entry):  # skipped for lack of time: runs now, if time allows
                    continue
                self.done[entry["section"], entry["name"]] = entry
                if entry.get("crashed"):
                    for suspect in families(entry["name"]):
                        self.broken[suspect] = f"{entry['section']} | {entry['name']}"
        for name in ("decisions.txt",) if resume else ("results.jsonl", "log.txt", "decisions.txt"):
            (out / name).write_text("")
        if not resume:  # an earlier run's would pass for this one's
            (out / KERNELS_FILE).unlink(missing_ok=True)

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        """A progress line: on stderr and in `log.txt` (stdout keeps the summary table)."""
        line = f"[{time.monotonic() - self.start:7.1f} s] {text}"
        print(line, file=sys.stderr, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(line + "\n")

    def record(self, section: str, name: str, status: str, **fields: Any) -> dict[str, Any]:
        """Append one result (`status`: ok, failed, error or skipped) to `results.jsonl`."""
        entry = {"section": section, "name": name, "status": status, **fields}
        self.counts[status] += 1
        self.last_status = status
        counts = self.sections.setdefault(section, dict.fromkeys(self.counts, 0))
        counts[status] += name != "(section)" or status != "ok"
        with open(self.out / "results.jsonl", "a") as f:
            f.write(json.dumps(entry, default=_jsonable) + "\n")
        brief = {k: v for k, v in fields.items() if k != "traceback"}
        self.log(f"{section} | {name} | {status} | {json.dumps(brief, default=_jsonable)}")
        return entry

    def measure(
        self,
        section: str,
        name: str,
        fn: Callable[[], dict[str, Any]],
        need_s: float | None = None,
    ) -> dict[str, Any] | None:
        """Run `fn` (returning the result's fields) if more than `need_s` seconds (default
        the reserve) are left of the budget; record its result,
        or its exception with the traceback. A result with `passed: False` is `failed`, one
        with a `skipped` reason `skipped`.
        Returns the fields, or None when skipped or raised. Resumed, a measurement an earlier
        process recorded is taken back as it was (its fields returned again; one it skipped
        for lack of time runs now), and one that
        shares a kernel with one that crashed or hung (`families`) is skipped. A measurement
        that raised and left the GPU unusable ends the process (`BROKEN`), recorded as
        crashed."""
        if (section, name) in self.done:
            return self._replay(self.done.pop((section, name)))
        suspect = next((f for f in sorted(families(name)) if f in self.broken), None)
        if suspect is not None:
            reason = f"{suspect!r} crashed or hung in {self.broken[suspect]!r}: not run again"
            self.record(section, name, "skipped", reason=reason)
            return None
        if self.left() <= (self.reserve_s if need_s is None or self.dry else need_s):
            self.record(section, name, "skipped", reason=f"budget: {self.left():.0f} s left")
            return None
        self.log(f"{STARTED}{section} | {name}")
        began = time.monotonic()
        try:
            _inject(f"{self.out.name}: {section} | {name}")
            fields = fn()
        except Exception as error:  # noqa: BLE001 - a failure is a result here
            crashed = not _device_alive(f"{self.out.name}: {section} | {name}", self.dry)
            self.record(
                section,
                name,
                "error",
                error=f"{type(error).__name__}: {str(error)[:500]}",
                traceback=traceback.format_exc(),
                seconds=time.monotonic() - began,
                **({"crashed": True} if crashed else {}),
            )
            if crashed:
                self.log("the GPU is unusable after this error: the process ends here")
                os._exit(BROKEN)
            _reset_interpreter(self.dry)
            return None
        status = "failed" if fields.get("passed") is False else "ok"
        status = "skipped" if "skipped" in fields else status
        self.record(section, name, status, seconds=round(time.monotonic() - began, 3), **fields)
        return fields

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A section: its duration recorded, an exception outside any measurement recorded
        as the section's error and the run going on."""
        self.log(f"== {name} ({self.left():.0f} s of the budget left)")
        began = time.monotonic()
        try:
            yield
        except Exception as error:  # noqa: BLE001 - a failure is a result here
            self.record(
                name,
                "(section)",
                "error",
                error=f"{type(error).__name__}: {str(error)[:500]}",
                traceback=traceback.format_exc(),
            )
            _reset_interpreter(self.dry)
        seconds = time.monotonic() - began
        self.record(name, "(section)", "ok", section_seconds=round(seconds, 1))
        self.sections.setdefault(name, dict.fromkeys(self.counts, 0))["seconds"] = seconds

    def _replay(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        """An earlier process's result of one measurement, counted and logged as if run now:
        its fields for an ok or failed one, else None."""
        section, name, status = entry["section"], entry["name"], entry["status"]
        self.counts[status] += 1
        self.last_status = status
        self.sections.setdefault(section, dict.fromkeys(self.counts, 0))[status] += 1
        self.log(f"{section} | {name} | {status} | (recorded by an earlier process)")
        if status not in ("ok", "failed"):
            return None
        skip = ("section", "name", "status", "seconds", "crashed")
        return {k: _unjsonable(v) for k, v in entry.items() if k not in skip}

    def cell(self, section: str, row: str, column: str, text: str) -> None:
        """One cell of `section`'s table in the summary."""
        self.cells.setdefault(section, {}).setdefault(row, {})[column] = text

    def not_run(self) -> str:
        """A cell for the measurement just recorded without a result."""
        return "ERROR" if self.last_status == "error" else "skipped"

    def decision(self, text: str) -> None:
        """One decision input: a measured comparison that would set a default."""
        self.decisions.append(text)
        with open(self.out / "decisions.txt", "a") as f:
            f.write(text + "\n")


def whole(folder: Path) -> bool:
    """Whether the check in `folder` ended with its own summary (not `INCOMPLETE`'s)."""
    path = folder / "summary.txt"
    return path.exists() and not path.read_text().startswith(INCOMPLETE)


def no_time(folder: Path) -> int:
    """How many measurements of the check in `folder` were last recorded skipped for lack of
    time (its budget): a lease runs the part again for them, resumed."""
    last = {(e["section"], e["name"]): e for e in read_results(folder / "results.jsonl")}
    return sum(map(_no_time, last.values()))


def _no_time(entry: dict[str, Any]) -> bool:
    return entry["status"] == "skipped" and str(entry.get("reason", "")).startswith("budget:")


def end_cut_line(path: Path) -> None:
    """End a last line a killed process cut short, so that the next line appended to `path`
    starts a line of its own."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def read_results(path: Path) -> list[dict[str, Any]]:
    """The entries of a `results.jsonl`, less a line a killed process cut short (a kill at
    the deadline, mid-write: it raised JSONDecodeError, ending the resumed check and the
    lease before their summaries); a cut last line is ended, so that the next entry
    appended starts a line of its own."""
    if not path.exists():
        return []
    end_cut_line(path)
    entries = []
    for line in path.read_text(errors="replace").splitlines():  # a byte cut: no UnicodeError
        with contextlib.suppress(json.JSONDecodeError):
            entries.append(json.loads(line))
    return [e for e in entries if isinstance(e, dict) and "section" in e and "name" in e]


def _reset_interpreter(dry: bool) -> None:
    """Mosaic GPU's interpreter must be reset after a kernel raised, before the next one."""
    if dry:
        with contextlib.suppress(Exception):
            from fp8jax._src.core import mosaic_private

            mosaic_private.reset_interpreter()


def _device_alive(where: str, dry: bool) -> bool:
    """Whether the GPU still computes after an error in a measurement (a kernel's illegal
    address leaves the process's CUDA context unusable: every later call fails); a dry
    run's CPU does."""
    if _fault(where) == "broken":
        return False
    if dry:
        return True
    try:
        import jax.numpy as jnp

        return float((jnp.arange(8.0) + 1).sum()) == 36.0
    except Exception:  # noqa: BLE001 - any failure means the device is gone
        return False


def _fault(where: str) -> str | None:
    """The fault `FAULT_VARIABLE` injects into a measurement: `die`, `hang` or `broken`."""
    for item in os.environ.get(FAULT_VARIABLE, "").split(";"):
        kind, _, text = item.partition(":")
        if text and text in where:
            return kind
    return None


def _inject(where: str) -> None:
    """A crash, hang or unusable GPU in a measurement named in `FAULT_VARIABLE`, as a
    kernel's could be: the test of `supervise.py` on a CPU."""
    fault = _fault(where)
    if fault == "die":
        os._exit(DIED)
    if fault == "hang":
        time.sleep(3600)
    if fault == "broken":
        raise RuntimeError(f"{FAULT_VARIABLE}: an illegal memory access, as a test")


def family(name: str) -> str:
    """What a measurement named `name` runs, to skip elsewhere once it crashed or hung: its
    second `" | "` field if it has one (a Llama variant at every size and in the profile; a
    GEMM configuration or a quantization way at every shape), else the whole name; of a way
    on the tensor cores (`"... tensor cores, <configuration>"`) every configuration."""
    fields = name.split(" | ")
    way = fields[1] if len(fields) > 1 else name
    return way.split(", ")[0] if "tensor cores" in way else way


def families(name: str) -> set[str]:
    """`family(name)` and the kernels and features of `SHARED` whose pattern it matches."""
    way = family(name)
    return {way} | {shared for shared, pattern in SHARED.items() if re.search(pattern, way)}


def _unjsonable(value: Any) -> Any:
    """`value` as `_jsonable` wrote it, its non-finite floats floats again."""
    if isinstance(value, dict):
        return {k: _unjsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjsonable(v) for v in value]
    return float(value) if value in ("nan", "inf", "-inf") else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)

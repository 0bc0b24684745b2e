"""Where the GPU check's results go, as they are produced, and how it spends its budget.

Every result is one JSON line appended to `results.jsonl` and one line of `log.txt` in the
out folder the moment it exists, so that a run killed from outside (its `timeout`, the end of
a GPU lease) still leaves everything measured until then. Each measurement runs in its own
`try`: a failure is recorded with its traceback and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class Recorder:
    """The out folder, the time budget and the summary rows of one run.

    `budget_s`: seconds from the start for all measurements; each one starts only if more
    than `reserve_s` are left (a compile and a few runs fit in that), else it is recorded as
    skipped. `dry`: the CPU dry run (kernels interpreted, no timing claims).
    """

    def __init__(self, out: Path, budget_s: float, reserve_s: float, dry: bool):
        self.out, self.budget_s, self.reserve_s, self.dry = out, budget_s, reserve_s, dry
        out.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        #: section -> row -> column -> text: the compact tables of the summary.
        self.cells: dict[str, dict[str, dict[str, str]]] = {}
        self.sections: dict[str, dict[str, float]] = {}
        self.decisions: list[str] = []
        self.counts = {"ok": 0, "failed": 0, "error": 0, "skipped": 0}
        self.last_status = ""
        for name in ("results.jsonl", "log.txt"):
            (out / name).write_text("")

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
        Returns the fields, or None when skipped or raised."""
        if self.left() <= (self.reserve_s if need_s is None or self.dry else need_s):
            self.record(section, name, "skipped", reason=f"budget: {self.left():.0f} s left")
            return None
        began = time.monotonic()
        try:
            fields = fn()
        except Exception as error:  # noqa: BLE001 - a failure is a result here
            self.record(
                section,
                name,
                "error",
                error=f"{type(error).__name__}: {str(error)[:500]}",
                traceback=traceback.format_exc(),
                seconds=time.monotonic() - began,
            )
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


def _reset_interpreter(dry: bool) -> None:
    """Mosaic GPU's interpreter must be reset after a kernel raised, before the next one."""
    if dry:
        with contextlib.suppress(Exception):
            from fp8jax._src.core import mosaic_private

            mosaic_private.reset_interpreter()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)

"""The GPU check run in a child process that is started again after a crash or a hang.

A lent GPU runs the check once, unattended, on kernels no GPU has run before. One of them
may hang (a barrier never completed) or fault (an illegal address leaves the process's CUDA
context unusable: every later call fails): in one process that would cost the rest of the
call, and a hang the whole `timeout`. Here the check runs as a child; this process, which
imports no JAX, reads its log as it comes. When the child dies inside a measurement, ends
itself because the GPU became unusable (`record.BROKEN`), or prints nothing for `--hang-s`
seconds inside a measurement (`OUTSIDE_S` outside one; then it is killed), the measurement
it had started is recorded as crashed and the check starts again with `--resume` and what
is left of the budget (none left: it measures nothing, but writes the summary): every
result recorded comes back without running again, and what
shares the crashed measurement's kernel (`record.families`) is skipped. A death outside
any measurement starts it again too, once more only if it recorded something since (the
out-of-memory killer's may not come back); a hang outside one ends the check. A check that
ends without its summary gets one from here (`record.INCOMPLETE`).
"""

from __future__ import annotations

import collections
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import options, returned
from .record import (
    BROKEN,
    INCOMPLETE,
    KERNELS_FILE,
    MODES,
    OUTSIDE,
    SCRIPT,
    STARTED,
    STATUSES,
    end_cut_line,
    read_results,
)

#: How many times the check may start again after crashes or hangs.
RESTARTS = 8
#: `--hang-s` on a GPU when not given: the longest measurement of runs 1-6 took 34 s (the
#: quantization kernels' numerics at 8192 x 14336), a Llama 8B variant 26 s. A measurement
#: killed for silence alone is lost with its family, no more; a hang costs this long.
HANG_S = 90.0
#: The budget a check resumed after the budget ran out gets: positive (the check refuses 0),
#: less than any reserve (it measures nothing; it takes back what was recorded, and writes the
#: summary).
SPENT_S = 1e-6
#: Lines of the check's stderr kept for the summary of a check that could not write its own.
TAIL_LINES = 40
#: The check's files cut to fit what comes back from `$OUT` (`returned.fit`), all text:
#: the log's and the results' lines, the profile's JSON (its marked cut names the bytes).
TRIMMED = ("results.jsonl", "log.txt", "decisions.txt", "environment.json", KERNELS_FILE)
#: Seconds without a line outside any measurement (imports, a section's setup, the summary)
#: after which the child is killed: `--hang-s` guards measurements, where kernels run.
OUTSIDE_S = 180.0


def main(argv: list[str] | None = None) -> int:
    """Run the check (`gpu_check.main`) in a child process, started again after a crash or
    hang; returns the check's exit status, or 2 when it could not finish. With `--child`
    first, this process is the child; with `--lease` first, it runs a lease's prepared plan
    (`lease.py`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        from .main import main as check  # JAX: imported by the child only

        return check(argv[1:])
    if argv[:1] == ["--lease"]:
        from .lease import main as lease

        return lease(argv[1:])
    try:  # the whole command line but the variants' names, before a child imports JAX
        known = options.parse(argv, options.parser())
    except SystemExit as refused:  # before the out folder is made
        return refused.code if isinstance(refused.code, int) else 2
    outside = None if known.packed else returned.outside_refused("--out", known.out)
    if outside:  # a dry run's: its folder is the user's to choose (parse refuses the others)
        print(f"warning: {outside}", file=sys.stderr, flush=True)
    mode = "dry" if known.dry_run else "quick" if known.quick else "full"
    budget = MODES[mode][0] if known.budget_s is None else known.budget_s
    hang = known.hang_s or (None if known.dry_run else HANG_S)
    rest = _without_budget(argv)
    return supervise(rest, known.out, budget, hang)


def supervise(argv: list[str], out: Path, budget_s: float, hang_s: float | None) -> int:
    """Run `gpu_check.py --child *argv` until it ends by itself; after a crash or hang,
    record it in `out` and start it again resumed, `budget_s` shared by all. A check that
    ends without its summary (it died or hung outside a measurement, spent its restarts, was
    stopped) leaves one written here: why, what `results.jsonl` holds, its last output."""
    (out / "summary.txt").unlink(missing_ok=True)  # an earlier run's would hide this one's end
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        code, why = _attempts(argv, out, budget_s, hang_s, tail)
    except SystemExit:  # stopped (SIGTERM: the lease's deadline); the child was killed
        _unfinished(out, "stopped from outside (SIGTERM): the check was killed", tail)
        _say_lost(out)
        raise
    if why is not None:
        _unfinished(out, why, tail)
    _say_lost(out)
    return code


def _say_lost(out: Path) -> None:
    """Where `out` is inside `$OUT` (a lease's parts are not: it packs them within the limits
    itself), its files trimmed to what the device tool brings back (`returned.fit`), and the
    end of `out/summary.txt`: what was cut, what under `$OUT` still will not come back
    (`returned.problems`)."""
    base = returned.given_out()
    if base is None or returned.root(out) != base:
        return
    cut, lost = returned.fit(out, TRIMMED), returned.problems(base)
    if (cut or lost) and (out / "summary.txt").exists():
        lines = ["", "## Trimmed to come back from $OUT (each file's middle cut, marked)", ""]
        lines = [*lines, *(f"- {line}" for line in cut)] if cut else []
        if lost:
            lines += ["", "## What the device tool will not bring back from $OUT", ""]
            lines += [f"- {line}" for line in lost]
        print("\n".join(lines), flush=True)
        with open(out / "summary.txt", "a") as f:
            f.write("\n".join(lines) + "\n")


def _attempts(
    argv: list[str], out: Path, budget_s: float, hang_s: float | None, tail: collections.deque
) -> tuple[int, str | None]:
    """`supervise`'s children in turn: the exit status, and why the check could not write
    its summary (None when it did, or refused its command line)."""
    start = time.monotonic()
    resume: list[str] = []
    recorded = -1  # results.jsonl's size after the last death outside a measurement
    for _ in range(RESTARTS + 1):
        left = max(budget_s - (time.monotonic() - start), SPENT_S)
        command = [sys.executable, str(SCRIPT), "--child", *argv, "--budget-s", f"{left:.6f}"]
        code, started, hung = _run(command + resume, hang_s, tail)
        if started is None and not hung and code != BROKEN:  # the check ended by itself
            if code in (0, 1) and (out / "summary.txt").exists():
                return code, None
            if code == 2 and not resume:  # argparse's status: it refused its command line
                return 2, None
            size = _size(out / "results.jsonl")
            error = f"the check died outside a measurement ({_status(code)})"
            _append(out, {"section": "(check)", "name": OUTSIDE, "status": "error",
                          "error": error})  # fmt: skip
            if size == recorded:  # nothing recorded since the last such death: it repeats
                return 2, error
            recorded = _size(out / "results.jsonl")  # once more: the OOM killer's may not
            _say(out, f"supervisor: {error}; starting the check again")
        elif started is not None:
            section, _, name = started.partition(" | ")
            if hung:
                error = f"no progress for {hang_s:.0f} s: the process was killed (hung)"
            else:
                error = f"the process died in this measurement ({_status(code)})"
            _append(out, {"section": section, "name": name, "status": "error", "error": error,
                          "crashed": True})  # fmt: skip
            _say(out, f"supervisor: {started}: {error}; starting the check again")
        elif hung:
            return 2, f"no progress for {OUTSIDE_S:.0f} s outside a measurement: killed"
        # Started again even with the budget spent: it measures nothing then (each measurement
        # skipped), but writes the summary, which a hang that ate the budget had left unwritten.
        resume = ["--resume"]
    return 2, f"{RESTARTS} restarts spent; the check ends here"


def _status(code: int) -> str:
    """A child's exit status in words: a signal's name (SIGKILL: the OOM killer's too)."""
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    oom = ", which the kernel's out-of-memory killer sends" if code == -signal.SIGKILL else ""
    return f"killed by {name}{oom}"


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _unfinished(out: Path, why: str, tail: collections.deque) -> None:
    """`out/summary.txt` for a check that ended without its own (`record.INCOMPLETE` first):
    why, the results recorded by section and status, the check's last lines of output."""
    _say(out, f"supervisor: {why}")
    if (out / "summary.txt").exists():
        return
    counts: dict[str, dict[str, int]] = {}
    for entry in read_results(out / "results.jsonl"):
        if entry["name"] != "(section)" or entry["status"] != "ok":
            section = counts.setdefault(entry["section"], dict.fromkeys(STATUSES, 0))
            section[entry["status"]] = section.get(entry["status"], 0) + 1
    lines = [f"{INCOMPLETE} the check ended without its summary: {why}", ""]
    lines += ["## Results recorded (results.jsonl has every figure, log.txt the progress)", ""]
    lines += [f"- {s}: " + ", ".join(f"{n} {k}" for k, n in c.items()) for s, c in counts.items()]
    lines += ["", f"## The check's last {len(tail)} lines of output (stderr)", "", *tail]
    text = "\n".join(line.rstrip("\n") for line in lines)
    print(text, flush=True)
    (out / "summary.txt").write_text(text + "\n")


def _run(
    command: list[str], hang_s: float | None, tail: collections.deque | None = None
) -> tuple[int, str | None, bool]:
    """Run the child, its stderr echoed (its last lines kept in `tail`); returns (exit
    status, the measurement started and not finished when it ended, whether it was killed
    as hung)."""
    child = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        with child.stderr:  # closed at its end (the child's, or its killed children's)
            for line in child.stderr:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    previous = signal.signal(signal.SIGTERM, lambda *_: (child.kill(), sys.exit(143)))
    started: str | None = None
    try:
        while True:
            limit = hang_s if started is not None or hang_s is None else max(hang_s, OUTSIDE_S)
            try:
                line = lines.get(timeout=limit)
            except queue.Empty:
                child.kill()
                child.wait()
                return child.returncode, started, True
            if line is None:
                return child.wait(), started, False
            sys.stderr.write(line)
            if tail is not None:
                tail.append(line)
            text = line.partition("] ")[2].rstrip("\n")
            if text.startswith(STARTED):
                started = text[len(STARTED) :]
            elif started is not None and text.startswith(started + " | "):
                started = None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.kill()


def _without_budget(argv: list[str]) -> list[str]:
    """`argv` less `--budget-s` (the supervisor passes what is left of it)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--budget-s":
            skip = True
        elif not a.startswith("--budget-s="):
            rest.append(a)
    return rest


def _append(out: Path, entry: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    end_cut_line(out / "results.jsonl")  # a line the killed child cut is ended first
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _say(out: Path, text: str) -> None:
    print(text, file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "a") as f:
        f.write(text + "\n")

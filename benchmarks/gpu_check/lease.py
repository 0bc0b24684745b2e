"""A lent GPU's prepared plan in one call: the check's parts in order, inside one deadline.

A lease is 15 minutes of device time, the machine's start included, one command at a time
of at most 10 minutes, and the machine goes back 30 s after a call ends; at most 8 files
come back from `$OUT`. Four calls in a row (the plan until session 56) would each need the
next call sent within those 30 s, and their budgets added up to more than the lease. Here
one command runs the parts in the order of `PARTS` (what the open issues need first), each
supervised (`supervise.py`: a crash or hang costs its measurement) with the budget it is
given or what is left before `--deadline-s`, whichever is less, and is stopped at the
deadline whatever it is doing. After each part its folder is packed into
`$OUT/<label>_<part>.tar.gz` (one file a part, trimmed to what the device tool brings
back: `returned.py`); `$OUT/lease.txt` says what each part did
and which parts a second call should name; a part whose options its check refuses is
reported so and packs nothing. A measurement that crashed or hung in one part
is skipped in the later ones too (its record is carried into their `results.jsonl`, which
they read `--resume`d). The parts' folders stay in `--work` on the machine: a second call
on the same machine resumes a part the deadline cut, or whose budget ran out (a measurement
skipped for lack of time runs then), keeping what it had measured.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import options, returned
from .options import hang_refused, out_folder, unwritable
from .record import MODES, SCRIPT, STATUSES, no_time, read_results, whole

#: The per-tensor Llama variants issue 38's first part times (benchmarks/README.md, call 1).
PER_TENSOR = (
    "delayed-steady,delayed-steady-tc,delayed-steady-apart-tc-grads,delayed-steady-tc-grads,"
    "delayed-steady-kernel,delayed-steady-kernel-masters,current,current-tc,"
    "delayed-steady-apart,delayed-steady-apart-acts,"
    "delayed-steady-fused,delayed-steady-words,delayed-steady-apart-words,delayed-steady-packed,"
    "delayed-steady-apart-kernel-grads,current-apart,current-kernel,delayed-cold,"
    "delayed-cold-fresh"
)
#: The blockwise Llama variants of issue 39's block-kernel part (call 2).
BLOCKWISE = (
    "blockwise,blockwise-masters,blockwise-tc,blockwise-tile-scales,"
    "blockwise-tile-scales-three,blockwise-slabs,blockwise-chained"
)


@dataclass(frozen=True)
class Part:
    """One part of the plan: what it is for, the check's arguments, its budget (seconds)."""

    what: str
    args: tuple[str, ...]
    budget_s: float


#: The plan, in the order a lease runs it (benchmarks/README.md says why each part).
PARTS = {
    "per_tensor": Part(
        "issue 38: the per-tensor transposing kernels, the Llama block's per-tensor variants "
        "timed and profiled, the kernels' numerics",
        ("--sections", "transpose,llama,profile,numerics", "--llama-variants", PER_TENSOR),
        300,
    ),
    "moe": Part(
        "issue 39: the MoE layer's target (blockwise FP8 against JAX's BF16 grouped kernels)",
        ("--sections", "moe", "--moe-variants", "bf16,bf16 jax mgpu,blockwise,blockwise-tc"),
        90,
    ),
    "block": Part(
        "issue 39: the block kernel's numerics and sweep, the Llama block blockwise",
        ("--sections", "kernels,llama,profile", "--llama-variants", BLOCKWISE),
        330,
    ),
    "grouped": Part(
        "issue 39: the grouped kernels' sweep, the MoE layer, the blockwise quantization",
        ("--sections", "grouped,moe,blockwise"),
        200,
    ),
    "quantize": Part("the quantization kernels' sweep", ("--sections", "quantize"), 300),
}
#: Seconds kept back from the deadline for packing the last part and writing `lease.txt`.
PACK_S = 10.0
#: Seconds of a part that its budget does not cover: the check's imports, its summary, a
#: last measurement started inside the budget (the budget is cut by this much before the
#: deadline, so that the part ends whole).
OVERHEAD_S = 30.0
#: A part is not started with less than this left before the deadline: its budget then
#: leaves 10 s beyond the reserve each measurement needs (`record.MODES`, full); at 45 s
#: (a 15 s budget under the 20 s reserve) it started only to skip every measurement.
MIN_S = OVERHEAD_S + MODES["full"][3] + 10.0
#: Seconds between packings of a running part.
PACK_EVERY_S = 30.0
#: The longest deadline: a call's 600 s limit less the 20 s `timeout` is given beyond the
#: deadline and the 20 s the run tool's `timeout_s` is given beyond that (`--deadline-s`).
DEADLINE_MAX_S = 600.0 - 2 * 20.0


def parse(argv: list[str]) -> argparse.Namespace:
    """The lease's command line (after `--lease`), checked: exits naming a part that does not
    exist or comes twice, a deadline too short to run a part or too long for a call, a label
    that is not a name, a hang limit that is not positive, a file for a folder, an `--out`
    or more parts than the device tool brings back (`returned.py`)."""
    parser = argparse.ArgumentParser(
        prog="python3 benchmarks/gpu_check.py --lease",
        description="The lent GPU's prepared plan in one call: " + ", ".join(PARTS) + ".",
    )
    parser.add_argument("--out", type=out_folder, required=True, help="where the packed parts go")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=560.0,
        help="seconds for the whole call (default and most 560); give `timeout` 20 s more "
        "and the run tool's timeout_s 20 s more again",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts, in the order given (default: {','.join(PARTS)})",
    )
    parser.add_argument("--label", default="lease", help="the packed folders' prefix")
    parser.add_argument(
        "--work",
        type=out_folder,
        default=Path("/tmp/fp8jax_gpu_lease"),
        help="the parts' folders, kept for a second call on the same machine",
    )
    parser.add_argument("--dry-run", action="store_true", help="the check's CPU dry run")
    parser.add_argument("--hang-s", type=float, default=None, help="passed to the check")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts or len(set(args.parts)) != len(args.parts):
        parser.error(
            f"--parts={','.join(args.parts)!r}: unknown or repeated {unknown or args.parts}; "
            f"should name each of {','.join(PARTS)} at most once"
        )
    if not PACK_S + MIN_S < args.deadline_s <= DEADLINE_MAX_S:
        parser.error(
            f"--deadline-s={args.deadline_s}: should be over {PACK_S + MIN_S:.0f} s and at "
            f"most {DEADLINE_MAX_S:.0f} s (a call's 600 s limit less 20 s for `timeout` and 20 "
            "s for the run tool's timeout_s): the call would be killed before the lease.txt"
        )
    refused = hang_refused(args.hang_s)  # 0 was dropped: the default hang
    if refused:
        parser.error(refused)
    for flag, folder in (("--out", args.out), ("--work", args.work)):
        refused = unwritable(flag, folder)
        if refused:
            parser.error(refused)
    refused = returned.out_refused("--out", args.out)
    if refused:
        parser.error(refused)
    refused = returned.outside_refused("--out", args.out)
    if refused and not args.dry_run:
        parser.error(refused)
    if refused:  # a dry run's folder is anywhere
        print(f"warning: {refused}", file=sys.stderr, flush=True)
    if len(args.parts) + 2 > returned.MAX_FILES:  # an archive each, lease.txt, lease.log
        parser.error(
            f"--parts={','.join(args.parts)!r}: {len(args.parts)} archives, lease.txt and "
            f"lease.log; at most {returned.MAX_FILES} files come back: name at most "
            f"{returned.MAX_FILES - 2} parts, the rest in a second call"
        )
    out, work = args.out.absolute(), args.work.absolute()
    if work == out or out in work.parents:  # its files would come back beside the archives
        parser.error(
            f"--work={str(args.work)!r} is inside --out={str(args.out)!r}: the parts' folders "
            "would come back beside their archives (at most 8 files do); give one outside it"
        )
    # ASCII: the run tool leaves out of what comes back a file whose name has odd characters.
    label = args.label.replace("_", "").replace("-", "")
    if not (label.isascii() and label.isalnum()):
        parser.error(f"--label={args.label!r}: ASCII letters, digits, '_' and '-' only")
    return args


def main(argv: list[str]) -> int:
    """Run the parts; returns 0 when every part ran whole, 1 when one recorded an error or
    a failed check, 2 when the deadline cut or skipped one or its check refused one."""
    args = parse(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    running: list[tuple[str, subprocess.Popen]] = []

    def stop(*_: object) -> None:  # the run's `timeout`: stop the part, pack what exists
        for name, child in running:
            _end(child)
            rows[name] = {"status": "stopped from outside", "code": 2}
        for name in [n for n, row in rows.items() if not row.get("refused")]:
            try:  # one part's failure here lost the others' archives and lease.txt
                rows[name]["left_out"] = _pack(args, name)
            except Exception as error:  # noqa: BLE001 - the rest still come back
                rows[name]["status"] += f"; packing it failed ({type(error).__name__}: {error})"
        _report(args, rows)
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        _run_parts(args, start, rows, running)
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(args, rows)
    return max((r["code"] for r in rows.values()), default=0)


def _run_parts(
    args: argparse.Namespace,
    start: float,
    rows: dict[str, dict],
    running: list[tuple[str, subprocess.Popen]],
) -> None:
    """Each part in turn, each stopped at the deadline, packed as it runs and after; one
    that fails in this process (not in its check) is reported, and the next ones run."""
    for name in args.parts:
        try:
            _run_part(args, name, start, rows, running)
        except Exception as error:  # noqa: BLE001 - the next parts and lease.txt still come
            for _, child in running:
                _end(child)
            running.clear()
            failed = f"{type(error).__name__}: {error}"
            rows[name] = {"status": f"the lease failed in it ({failed})", "code": 2}
            _say(args.out, f"== {name}: the lease failed: {traceback.format_exc()}")


def _run_part(
    args: argparse.Namespace,
    name: str,
    start: float,
    rows: dict[str, dict],
    running: list[tuple[str, subprocess.Popen]],
) -> None:
    """One part, stopped at the deadline, packed as it runs and after."""
    part, folder = PARTS[name], _folder(args, name)
    if _done(folder):
        rows[name] = {"status": "done before", "code": 0}
        return
    left = args.deadline_s - (time.monotonic() - start) - PACK_S
    if left < MIN_S:
        rows[name] = {"status": f"not run: {max(left, 0):.0f} s left", "code": 2}
        return
    budget = min(part.budget_s, left - OVERHEAD_S)
    argv = ["--out", str(folder), "--packed", *part.args, "--budget-s", f"{budget:.0f}"]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--hang-s", str(args.hang_s)] if args.hang_s else []
    refused = _refused(argv)
    if refused is not None:  # its child would refuse it too, leaving an empty folder
        rows[name] = {"status": f"refused by its check: {refused}", "code": 2, "refused": True}
        _say(args.out, f"== {name}: refused by its check: {refused}")
        return
    command = [sys.executable, str(SCRIPT), *argv, *_carry_crashes(args.work, args.label, folder)]
    _say(args.out, f"== {name} ({part.what}): budget {budget:.0f} s, {left:.0f} s left")
    began = time.monotonic()
    # A process group of its own (for `_end`), in the call's session: the `run` tool's end
    # of a call reaches it (a new session would outlive the call, still on the GPU).
    child = subprocess.Popen(command, process_group=0)
    running[:] = [(name, child)]
    code = None
    while code is None and time.monotonic() - began < left:
        try:
            code = child.wait(timeout=min(PACK_EVERY_S, left - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:  # pack what a kill from outside would lose
            with contextlib.suppress(OSError, tarfile.TarError):  # a file cut while read
                _pack(args, name)
    if code is None:
        _end(child)
    running.clear()
    if code == 2 and not (folder / "log.txt").exists():  # the check never started
        why = "exit status 2; its message is in the call's output"
        rows[name] = {"status": f"refused by its check ({why})", "code": 2, "refused": True}
        return
    ended, short = whole(folder), no_time(folder)
    status = "ran" if ended else "cut by the deadline" if code is None else "ended early"
    if code not in (None, 0):
        status += f" (exit status {code})"
    if short:
        status += f", {short} measurements skipped for lack of time"
    rows[name] = {"status": status, "seconds": time.monotonic() - began}
    # Done: its exit status (none where the deadline came after its summary); else 2.
    rows[name].update(code=(code or 0) if _done(folder) else 2, **_counts(folder))
    rows[name]["left_out"] = _pack(args, name)


def _done(folder: Path) -> bool:
    """Whether a part's check ended with its summary and nothing skipped for lack of time: a
    part started late skipped all it measures, and passed for done in a second call."""
    return whole(folder) and not no_time(folder)


def _refused(argv: list[str]) -> str | None:
    """Why the check refuses `argv` (its own JAX-free `options.parse`), or None: a part its
    child refused packed an empty archive, and passed for one a second call should run."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            options.parse(argv, options.parser())
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or ["(no message)"])[-1]
        return last.partition(": error: ")[2] or last
    return None


def _folder(args: argparse.Namespace, name: str) -> Path:
    return args.work / f"{args.label}_{name}"


def _end(child: subprocess.Popen) -> None:
    """Stop a part: SIGTERM (its supervisor kills the check), then its whole group."""
    child.terminate()
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _carry_crashes(work: Path, label: str, folder: Path) -> list[str]:
    """Append to `folder`'s results the crashes and hangs recorded by the other parts in
    `work` (the check, `--resume`d, skips what shares their kernels); returns `--resume`
    where `folder` has results to take back, else nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    mine = folder / "results.jsonl"
    known = read_results(mine)
    seen = {(e["section"], e["name"]) for e in known}
    carried = []
    for other in sorted(work.glob(f"{label}_*/results.jsonl")):
        if other == mine:
            continue
        for entry in read_results(other):
            if entry.get("crashed") and (entry["section"], entry["name"]) not in seen:
                seen.add((entry["section"], entry["name"]))
                carried.append({**entry, "carried_from": other.parent.name})
    with open(mine, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in carried)
    return ["--resume"] if known or carried else []


def _counts(folder: Path) -> dict[str, int]:
    """The part's results by status (its `results.jsonl`), its section lines left out: each
    measurement's last (a measurement skipped for time, then taken by a second call, is
    counted once, as taken)."""
    counts: dict[str, int] = {}
    entries = read_results(folder / "results.jsonl")
    for entry in {(e["section"], e["name"]): e for e in entries}.values():
        if "carried_from" in entry:
            counts["carried"] = counts.get("carried", 0) + 1
        elif entry["name"] != "(section)":
            counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    return counts


#: Numbers the packs' files.
_PACKS = itertools.count()


#: A part's files an archive too large keeps longest, the last first (`summary.txt` always):
#: any other file is left out before them, the largest first.
KEPT_LONGEST = ("log.txt", "results.jsonl", "environment.json", "decisions.txt")
#: Bytes kept free under the limit on all the files together for `lease.txt` and `lease.log`.
REPORT_BYTES = 64 << 10
#: Bytes `lease.log` is kept within (its middle cut, `returned.trim`): half the reserve, the
#: rest for `lease.txt`; a log over it would eat into what the archives were packed to fit.
LOG_BYTES = REPORT_BYTES // 2
#: The file an archive trimmed to fit holds: what was left out of it, and why.
LEFT_OUT = "LEFT_OUT.txt"


def _pack(args: argparse.Namespace, name: str) -> list[str]:
    """`$OUT/<label>_<part>.tar.gz`: the part's folder as it is now (written, then renamed:
    a call stopped while packing leaves the last whole archive), within what the device
    tool brings back (`returned.py`: one file's bytes, all files' bytes less those already
    in `$OUT`): the files of least use left out until it fits, named in its `LEFT_OUT`;
    returns them, one line each (none: all packed).

    Each pack writes a file of its own: the `timeout`'s SIGTERM can arrive mid-pack, and its
    handler packs the same part again; with one shared name that pack renamed the file the
    interrupted one was still writing, whose end then landed in the archive."""
    folder = _folder(args, name)
    if not folder.exists():
        return []
    target = args.out / f"{folder.name}.tar.gz"
    others = sum(
        p.stat().st_size
        for p in returned.root(args.out).rglob("*")
        if p.is_file() and p != target and p.suffix != ".partial"
    )
    room = min(returned.MAX_FILE_BYTES, returned.MAX_TOTAL_BYTES - others - REPORT_BYTES)
    sizes = {p: p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    kept = (*KEPT_LONGEST, "summary.txt")
    order = [p for p in sorted(sizes, key=sizes.get, reverse=True) if p.name not in kept]
    order += [p for n in KEPT_LONGEST for p in sizes if p.name == n]
    dropped: list[Path] = []
    while True:
        partial = args.out / f"{folder.name}_{next(_PACKS)}.partial"
        names = {f"{folder.name}/{p.relative_to(folder).as_posix()}" for p in dropped}
        left_out = [f"{p.relative_to(folder)} ({returned.mib(sizes[p])})" for p in dropped]
        try:
            with tarfile.open(partial, "w:gz") as tar:
                tar.add(
                    folder,
                    arcname=folder.name,
                    filter=lambda i, names=names: None if i.name in names else i,
                )
                if left_out:
                    _add_text(tar, f"{folder.name}/{LEFT_OUT}", f"Left out of this archive to "
                              f"fit {returned.mib(room)} (what the device tool brings back):\n"
                              + "\n".join(left_out) + "\n")  # fmt: skip
            if partial.stat().st_size <= room or not order:  # summary.txt is never left out
                partial.replace(target)
                return left_out
        finally:  # none left behind to come back with the archives
            partial.unlink(missing_ok=True)
        dropped.append(order.pop(0))


def _add_text(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _report(args: argparse.Namespace, rows: dict[str, dict]) -> None:
    """`$OUT/lease.txt` and the end of the output: each part's fate, and what a second
    call should name."""
    lines = ["", "## The lease's parts", ""]
    for name in args.parts:
        row = rows.get(name, {"status": "not reached"})
        counts = ", ".join(f"{row[k]} {k}" for k in (*STATUSES, "carried") if k in row)
        lines.append(f"- {name}: {row['status']}, {row.get('seconds', 0):.0f} s"
                     f" ({counts or 'no results'})")  # fmt: skip
        if row.get("left_out"):
            lines.append(f"  left out of its archive to fit what comes back (its {LEFT_OUT} "
                         f"names them): {', '.join(row['left_out'])}")  # fmt: skip
    refused = [n for n in args.parts if rows.get(n, {}).get("refused")]
    rest = [n for n in args.parts if not _done(_folder(args, n)) and n not in refused]
    if rest:
        lines += ["", f"A second call on this machine: --parts {','.join(rest)} (a part the "
                  "deadline cut, or whose budget ran out, resumes where it was)."]  # fmt: skip
    if refused:
        lines += ["", "Parts refused: fix their options (`PARTS` in lease.py); a second call "
                  f"would refuse them again: {','.join(refused)}."]  # fmt: skip
    lost = returned.problems(returned.root(args.out))
    if lost:
        lines += ["", "## What the device tool will not bring back", ""]
        lines += [f"- {line}" for line in lost]
    text = "\n".join(lines)
    print(text, flush=True)
    (args.out / "lease.txt").write_text(text.lstrip() + "\n")


def _say(out: Path, text: str) -> None:
    """A line of `lease.log` (on stderr too), the log kept within `LOG_BYTES`."""
    print(text, file=sys.stderr, flush=True)
    with open(out / "lease.log", "a") as f:
        f.write(text + "\n")
    returned.trim(out / "lease.log", LOG_BYTES)

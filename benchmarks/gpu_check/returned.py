"""What the device tool brings back from `$OUT`, and the check's files kept within it.

A call's files come back only within the tool's limits (its README): at most `MAX_FILES`
files, each at most `MAX_FILE_BYTES` and all together at most `MAX_TOTAL_BYTES`, no deeper
than `MAX_DEPTH` folders below `$OUT` (`$OUT/a/b/file` comes back, `$OUT/a/b/c/file` does
not), named with `NAME`'s characters only. A file left out is lost with the lease, silently:
the lease trims its archives to fit and keeps `lease.log` within its reserve (`lease.py`,
`trim`), the options refuse an `--out` whose files could not come back, and `summary.txt`
or `lease.txt` names whatever still would not. The limits are constants here so that a test
can make them tiny. No JAX: the supervisor and the lease import this.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The files that come back from one call, at most.
MAX_FILES = 8
#: Bytes of one file, at most.
MAX_FILE_BYTES = 16 << 20
#: Bytes of all the files together, at most.
MAX_TOTAL_BYTES = 64 << 20
#: Folders between `$OUT` and a file, at most.
MAX_DEPTH = 2
#: A name that comes back (each folder's too).
NAME = re.compile(r"[A-Za-z0-9._-]+")
#: The variable naming the folder whose files come back (set on the device machine).
OUT_VARIABLE = "OUT"


def plain(path: Path) -> Path:
    """`path` absolute, its links and `..` resolved: `$OUT/../x` is not inside `$OUT`."""
    return path.resolve()


def given_out() -> Path | None:
    """`$OUT` (`plain`), or None where it is not set (not a device machine)."""
    given = os.environ.get(OUT_VARIABLE, "").strip()
    return plain(Path(given)) if given else None


def root(folder: Path) -> Path:
    """The folder whose files come back: `$OUT` where `folder` is inside it, else `folder`."""
    out, folder = given_out(), plain(folder)
    if out is not None and (folder == out or out in folder.parents):
        return out
    return folder


def outside_refused(flag: str, folder: Path) -> str | None:
    """Why `folder` cannot hold results where `$OUT` is set: outside it, its files would go
    back with the machine; or None (inside it, or `$OUT` not set)."""
    out = given_out()
    if out is None or root(folder) == out:
        return None
    return (
        f"{flag}={str(folder)!r} is outside ${OUT_VARIABLE}={str(out)!r}: its files would not "
        f"come back; give a folder inside it, e.g. {str(out / 'gpu_check')!r}"
    )


def out_refused(flag: str, folder: Path, nested: int = 0) -> str | None:
    """Why the files written `nested` folders below `folder` could not come back from `$OUT`
    (too deep, a name with other characters), or None; a folder outside `$OUT` is not
    judged (a dry run's, a lease's work folder)."""
    base = root(folder)
    parts = plain(folder).relative_to(base).parts  # none outside $OUT
    if len(parts) + nested > MAX_DEPTH:
        return (
            f"{flag}={str(folder)!r} is {len(parts)} folders below ${OUT_VARIABLE}: its files "
            f"would be {len(parts) + nested} down, and only {MAX_DEPTH} come back; give one "
            f"at most {MAX_DEPTH - nested} down"
        )
    bad = [p for p in parts if not NAME.fullmatch(p)]
    if bad:
        return (
            f"{flag}={str(folder)!r}: {bad[0]!r} would not come back from ${OUT_VARIABLE}; "
            "name it with ASCII letters, digits, '.', '_' and '-' only"
        )
    return None


def problems(base: Path) -> list[str]:
    """What under `base` (the folder whose files come back) the device tool would leave out,
    one line each: names, depth, sizes, then the count and the total."""
    if not base.is_dir():
        return []
    files = sorted(p for p in base.rglob("*") if p.is_file() or p.is_symlink())
    lines, total = [], 0
    for path in files:
        rel = path.relative_to(base)
        size = path.lstat().st_size
        total += size
        if path.is_symlink() or not path.is_file():
            lines.append(f"{rel}: not a plain file")
        elif not all(NAME.fullmatch(p) for p in rel.parts):
            lines.append(f"{rel}: a name with characters other than letters, digits, '.-_'")
        elif len(rel.parts) - 1 > MAX_DEPTH:
            lines.append(f"{rel}: {len(rel.parts) - 1} folders down, over {MAX_DEPTH}")
        elif size > MAX_FILE_BYTES:
            lines.append(f"{rel}: {mib(size)}, over {mib(MAX_FILE_BYTES)} a file")
    if len(files) > MAX_FILES:
        lines.append(f"{len(files)} files, over {MAX_FILES}: some will not come back")
    if total > MAX_TOTAL_BYTES:
        lines.append(f"{mib(total)} in all, over {mib(MAX_TOTAL_BYTES)}")
    return lines


def mib(size: int) -> str:
    """`size` bytes in MiB, for the lines that name a size."""
    return f"{size / (1 << 20):.2f} MiB"


#: The line that stands for the middle of a file cut to fit (`trim`).
CUT = "[... {cut} bytes of the middle cut here, to fit {limit} bytes ...]"
_MARK = re.compile(rb"\n?\[\.\.\. (\d+) bytes of the middle cut here, to fit \d+ bytes \.\.\.\]\n")


def trim(path: Path, limit: int) -> int:
    """Cut the middle of `path` so that it holds at most `limit` bytes: its first whole lines
    (a quarter of them), a marked line naming the bytes cut, its last whole lines; returns
    the bytes cut (0: it fit). A file over the device tool's limit would come back not at
    all; its head (what ran first) and tail (how it ended) are the parts read first."""
    data = path.read_bytes()
    if len(data) <= limit:
        return 0
    most = len(data) + sum(int(m[1]) for m in _MARK.finditer(data))  # the longest mark's
    keep = max(limit - len(CUT.format(cut=most, limit=limit)) - 2, 0)
    head = data[: keep // 4]
    head = head[: head.rfind(b"\n") + 1] or head  # whole lines, where one ends in it
    start = len(data) - (keep - len(head))
    if 0 < start < len(data) and data[start - 1 : start] != b"\n":
        line_end = data.find(b"\n", start)
        if -1 < line_end < len(data) - 1:
            start = line_end + 1
    tail = data[start:]
    middle = data[len(head) : start]  # a mark cut again counts the bytes it stood for
    marks = list(_MARK.finditer(middle))
    cut = len(middle) - sum(len(m[0]) for m in marks) + sum(int(m[1]) for m in marks)
    mark = ("" if head.endswith(b"\n") or not head else "\n") + CUT.format(cut=cut, limit=limit)
    path.write_bytes(head + (mark + "\n").encode() + tail)
    return cut


#: Bytes `fit` keeps free under the total for the lines then appended to `summary.txt`.
NOTE_BYTES = 8 << 10


def fit(folder: Path, names: tuple[str, ...]) -> list[str]:
    """Trim the check's text files `names` in `folder` (inside `$OUT`) to what comes back:
    each over one file's limit, then the largest while all of `$OUT` is over the total less
    `NOTE_BYTES`; returns what was cut, one line each. Other files (an archive beside them:
    cut, it would not open) are left as they are."""
    folder, lines = plain(folder), []
    base = root(folder)
    files = [folder / n for n in names if (folder / n).is_file() and not (folder / n).is_symlink()]

    def cut_to(path: Path, limit: int, what: str) -> int:
        size = path.stat().st_size
        if trim(path, limit):
            now = mib(path.stat().st_size)
            name = path.relative_to(base)
            lines.append(f"{name}: {mib(size)}, its middle cut to {now} to fit {what} (marked)")
        return size - path.stat().st_size

    for path in files:
        cut_to(path, MAX_FILE_BYTES, f"{mib(MAX_FILE_BYTES)} a file")
    total = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
    room = MAX_TOTAL_BYTES - NOTE_BYTES
    for path in sorted(files, key=lambda p: p.stat().st_size, reverse=True):
        if total > room:
            limit = max(path.stat().st_size - (total - room), 0)
            total -= cut_to(path, limit, f"{mib(MAX_TOTAL_BYTES)} in all")
    return lines

"""A checkpoint file on disk: the permissions it gets, and its data and its name made
durable (`fsync`), so that a crash or a power loss after a save leaves the new checkpoint or
the one it replaced, never an empty or partly written file under the checkpoint's name; the
directories it goes in, made, and an error naming it where it cannot be written."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import stat
from collections.abc import Iterator
from typing import BinaryIO


def file_mode(path: pathlib.Path) -> int:
    """A checkpoint file's permissions: the replaced file's, else a new file's (umask)."""
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def sync_file(f: BinaryIO) -> None:
    """`f`'s data on disk, before a rename makes it the checkpoint: without it, a file system
    may commit the rename first (a crash then leaves an empty file at the checkpoint's name,
    the checkpoint it replaced gone)."""
    f.flush()
    os.fsync(f.fileno())


def sync_directory(path: pathlib.Path) -> None:
    """The entries of the directory `path` on disk: a rename into it done, durably. Where a
    directory cannot be opened or synced (some platforms, file systems), nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: pathlib.Path) -> None:
    """Remove what is at `path`, if anything: a directory with its contents; a symbolic link
    (a checkpoint's path that linked to an earlier one, moved aside by a save) alone, never
    what it links to."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def replace_directory(new: pathlib.Path, path: pathlib.Path) -> None:
    """Put the directory `new` at `path` so that a complete checkpoint is there at every moment
    but one rename: the previous one is moved to `<path>.old` and removed only after the new
    one is in place, or moved back if that rename fails (the failed save then leaves it as it
    was)."""
    old = path.with_name(path.name + ".old")
    moved = path.exists()
    if moved:
        remove(old)  # left by a save stopped while removing it: stale
        os.replace(path, old)  # (a symbolic link moved aside, its target kept)
    try:
        os.replace(new, path)
    except Exception:
        if moved:
            os.replace(old, path)
        raise
    sync_directory(path.parent)
    remove(old)


def make_parents(path: pathlib.Path) -> None:
    """The directories above `path`, made where missing; `NotADirectoryError` naming a file
    among them."""
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(
                f"save_checkpoint: cannot write {os.fspath(path)!r}: {os.fspath(parent)!r} is a "
                "file, not a directory."
            )
    path.parent.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def naming(path: pathlib.Path) -> Iterator[None]:
    """An `OSError` raised inside (no permission, a read-only file system) as one of its type
    that names the checkpoint, not only the temporary file or directory written first."""
    try:
        yield
    except OSError as e:
        if str(e).startswith("save_checkpoint:"):  # names it already
            raise
        raise type(e)(
            e.errno, f"save_checkpoint: cannot write {os.fspath(path)!r}: {e.strerror}", e.filename
        ) from e

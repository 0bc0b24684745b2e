"""Silence the reports orbax leaves after a failed restore: "Event loop is closed", a
coroutine of its never awaited, and asyncio's "Task exception was never retrieved".

Orbax reads a checkpoint's arrays on a fresh asyncio loop and closes that loop as soon as the
first read fails (a half-written checkpoint). The other arrays' reads, still in flight on
tensorstore's threads, finish later and try to wake the closed loop; Python then prints
"Exception ignored ... RuntimeError: Event loop is closed" to stderr, after fp8jax's own
"truncated or corrupt" error and possibly seconds later, and under pytest's
`filterwarnings = error` it fails whichever test is running then. A step of the restore not
yet started is dropped too, and its coroutine, collected unawaited, warns; where warnings are
errors that is reported the same way. A read that failed too, its task collected with its
error unread, is logged at ERROR by asyncio. Those reads' results are discarded by then:
nothing is lost. The hook installed here drops exactly these reports (a closed loop woken by
a tensorstore future; an orbax coroutine collected unawaited, as an error; asyncio's record
of an unread error raised in orbax's code) and passes every other one on.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any


def _in_orbax(filename: str) -> bool:
    package = sys.modules.get("orbax.checkpoint")
    root = os.path.dirname(getattr(package, "__file__", None) or "") + os.sep
    return root != os.sep and filename.startswith(root)


def _is_orbax_leftover(unraisable: Any) -> bool:
    """Whether `unraisable` is a tensorstore read waking an asyncio loop already closed, or
    an orbax coroutine collected unawaited with warnings as errors."""
    error = unraisable.exc_value
    code = getattr(unraisable.object, "cr_code", None)
    if isinstance(error, RuntimeWarning) and code is not None:
        return _in_orbax(code.co_filename)
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "call_soon_threadsafe":
            args = frame.f_locals.get("args", ())
            return any(type(a).__module__.startswith("tensorstore") for a in args)
        tb = tb.tb_next
    return False


def _is_unread_orbax_error(record: logging.LogRecord) -> bool:
    """Whether asyncio's `record` is of an error raised in orbax's code that nothing read."""
    if not str(record.msg).startswith(("Task exception", "Future exception")):
        return False
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return any(_in_orbax(frame.filename) for frame in frames)


class _QuietOrbax(logging.Filter):
    """Drops asyncio's records of errors that a failed orbax restore's tasks left unread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_unread_orbax_error(record)


def quiet_orbax_leftovers() -> None:
    """Wrap `sys.unraisablehook`, and filter asyncio's logger, so that they drop a failed
    orbax restore's leftover reports (see the module's docstring); idempotent, and everything
    else still reaches the hook and the log as before."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietOrbax) for f in asyncio_log.filters):
        asyncio_log.addFilter(_QuietOrbax())
    current = sys.unraisablehook
    if getattr(current, "_fp8jax_orbax_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_orbax_leftover(unraisable):
            current(unraisable)

    hook._fp8jax_orbax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook

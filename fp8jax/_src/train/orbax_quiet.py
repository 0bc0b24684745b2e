"""Silence the reports orbax leaves after a failed restore: "Event loop is closed", and a
coroutine of its never awaited.

Orbax reads a checkpoint's arrays on a fresh asyncio loop and closes that loop as soon as the
first read fails (a half-written checkpoint). The other arrays' reads, still in flight on
tensorstore's threads, finish later and try to wake the closed loop; Python then prints
"Exception ignored ... RuntimeError: Event loop is closed" to stderr, after fp8jax's own
"truncated or corrupt" error and possibly seconds later, and under pytest's
`filterwarnings = error` it fails whichever test is running then. A step of the restore not
yet started is dropped too, and its coroutine, collected unawaited, warns; where warnings are
errors that is reported the same way. Those reads' results are discarded by then: nothing is
lost. The hook installed here drops exactly these two reports (a closed loop woken by a
tensorstore future; an orbax coroutine collected unawaited, as an error) and passes every
other one to the hook it wraps.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _is_orbax_leftover(unraisable: Any) -> bool:
    """Whether `unraisable` is a tensorstore read waking an asyncio loop already closed, or
    an orbax coroutine collected unawaited with warnings as errors."""
    error = unraisable.exc_value
    code = getattr(unraisable.object, "cr_code", None)
    if isinstance(error, RuntimeWarning) and code is not None:
        package = sys.modules.get("orbax.checkpoint")
        root = os.path.dirname(getattr(package, "__file__", None) or "") + os.sep
        return root != os.sep and code.co_filename.startswith(root)
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


def quiet_orbax_leftovers() -> None:
    """Wrap `sys.unraisablehook` so that it drops a failed orbax restore's leftover reads'
    report (see the module's docstring); idempotent, and everything else still reaches the
    hook that was there."""
    current = sys.unraisablehook
    if getattr(current, "_fp8jax_orbax_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_orbax_leftover(unraisable):
            current(unraisable)

    hook._fp8jax_orbax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook

"""Trace-time settings: a context variable that functions traced inside a `with` read.

fp8jax's contexts (`skip_warm_start`, `cublas_traced`, the kernel choices) each set one
value while a function is traced and restore the previous one after, nested or not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def setting(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """`var` set to `value` inside the `with`, and back to what it was after (an exception
    included)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)

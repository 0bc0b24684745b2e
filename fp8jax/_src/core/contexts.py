"""Trace-time settings: values that functions read while they are traced, set by a `with`.

fp8jax's contexts (`skip_warm_start`, `cublas_traced`, the kernel choices) each set one
`Setting` while a function is traced and restore the previous value after, nested or not.
A `Setting` is a JAX user context (`jax.make_user_context`), so its value is part of JAX's
trace and compile cache keys: a function jitted outside a `with` and called inside (a
model's jitted forward, used for evaluation first and then inside the train step) is traced
again inside, where a `contextvars.ContextVar` would give back what it traced outside.
JAX keeps them per thread: a function that JAX calls later on a thread of its own (XLA's
partitioner) runs through `carried()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, final

import jax

T = TypeVar("T")
R = TypeVar("R")


@final
class Setting(Generic[T]):
    """A trace-time value named `name`, `default` outside every `setting(self, ...)`.

    Made once, at import (JAX's user contexts are not made thread-safely); its values must
    be hashable, as cache keys are."""

    def __init__(self, name: str, default: T):
        _check_hashable(name, default)
        self.name = name
        self._context = jax.make_user_context(default)
        _SETTINGS.append(self)

    def get(self) -> T:
        """The value in effect in this thread."""
        return self._context.value

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, value={self.get()!r})"


#: Every `Setting` made, in order.
_SETTINGS: list[Setting] = []


@contextlib.contextmanager
def setting(var: Setting[T], value: T) -> Iterator[None]:
    """`var` set to `value` inside the `with`, and back to what it was after (an exception
    included)."""
    if not isinstance(var, Setting):
        raise TypeError(f"setting: var={var!r}; expected a contexts.Setting.")
    _check_hashable(var.name, value)
    with var._context(value):
        yield


def carried() -> Callable[[Callable[[], R]], R]:
    """A runner that calls a function with every `Setting` and context variable as they are
    now, on whatever thread it runs (XLA's partitioner traces a sharded kernel's per-device
    call on a thread of its own, after the `with` that chose the kernel has ended)."""
    values = [(var, var.get()) for var in _SETTINGS]
    context = contextvars.copy_context()

    def run(fn: Callable[[], R]) -> R:
        with contextlib.ExitStack() as stack:
            for var, value in values:
                stack.enter_context(setting(var, value))
            return context.copy().run(fn)

    return run


def _check_hashable(name: str, value: object) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"fp8jax setting {name!r}: value={value!r} is not hashable; a trace-time "
            "setting's value is part of JAX's cache keys."
        ) from None

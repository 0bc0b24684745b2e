"""Delayed scaling's warm start, paid only while it can change anything.

A [`fp8jax.DelayedScaling`][] state with the warm start scales its operand by the operand's
own amax while it holds no scale yet (its first step), so every cast waits for that amax:
XLA reads each operand twice, in every step, though from the first recorded amax on the
state's scale is used anyway: a Llama-3-8B block's train step compiled for an H100 takes
129 kernels with it and 100 without (`benchmarks/RESULTS.md`, issue 38).

[`fp8jax.scales_recorded`][] says on the device whether every such state holds a scale;
[`fp8jax.without_warm_start`][] traces a function with the warm start skipped (each state
cast by its scale alone, as with `warm_start=False`): once every scale is recorded, the
values the warm start computes (bit for bit where XLA rounds each expression alike in both
programs, as on a CPU under `tests/helpers.SAME_BITS`; another fusion of the same
expression may move a last bit, as any recompilation may). [`fp8jax.TrainStep`][] and
[`fp8jax.nnx_train_step`][]'s steps switch to such a program by themselves (with `read` and
`remember` here).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ..recipes.base import ROLES, TensorState
from ..recipes.per_tensor import DelayedScaling, skip_warm_start
from .base import AbstractFp8Op

P = ParamSpec("P")
R = TypeVar("R")

#: Steps a state's lineage runs with the warm start before `read` first asks whether its
#: scales are recorded: the program without it is a second compile, which pays off over many
#: steps, not over a short run (a test, a notebook's few dozen steps). A hundred warm steps
#: cost less than a compile: 0.15 s at the Llama-3-8B block's 1.5 ms (an H200, GPU run 4).
WARM_STEPS = 100
#: Blocking reads of a step's answer before `read` only takes answers already computed: a
#: lineage whose scales stay unrecorded (a layer never used) then costs no syncs.
BLOCKING_READS = 2


def _warm_states(tree: Any) -> list[TensorState]:
    """Every delayed-scaling state with the warm start in `tree` (shapes suffice)."""
    ops = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, AbstractFp8Op))
    states = []
    for op in ops:
        if isinstance(op, AbstractFp8Op) and isinstance(op.recipe, DelayedScaling):
            if op.recipe.warm_start:
                for role in ROLES:
                    state = getattr(op, role)
                    if type(state) is TensorState:
                        states.append(state)
    return states


def programs(tree: Any) -> tuple[tuple[str, bool], ...]:
    """The programs a train step on `tree` runs, as `(name, warm)`: `("recorded", False)`,
    once every scale is recorded, if it `switches`, and `("first", True)`, until then (every
    step otherwise). The inspector reports them under these names."""
    first = (("first", True),)
    return (("recorded", False), *first) if switches(tree) else first


def switches(tree: Any) -> bool:
    """Whether a train step on `tree` can switch to its program without the warm start: it
    holds a delayed-scaling state with the warm start (`recorded_flag` is not `None`)."""
    return bool(_warm_states(tree))


def scales_recorded(tree: Any) -> Bool[Array, ""]:
    """Whether every [`fp8jax.DelayedScaling`][] state with the warm start in `tree` (a model,
    a [`fp8jax.TrainState`][], any pytree of fp8jax ops) holds a scale: from then on the
    warm start changes nothing, and a step traced by [`fp8jax.without_warm_start`][] computes
    the same, faster. A state holds none before its first step, nor while its operand was
    all zeros (a gradient that is zero in the first steps), nor, per expert, for an expert
    that got no token yet. `True` for a tree with no such state. A Flax Linen model's
    variables and a Flax NNX model are read alike (their FP8 state holds the same ops).
    """
    scales = [jnp.ravel(state.scale) for state in _warm_states(tree)]
    if not scales:
        return jnp.asarray(True)
    return jnp.all(jnp.concatenate(scales) > 0.0)


def without_warm_start(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, with every [`fp8jax.DelayedScaling`][] traced inside casting by its state's
    scale alone (as `warm_start=False`: 1.0 where the state holds none): the cast no longer
    waits for the operand's amax, which XLA then computes in the casting pass. Once
    [`fp8jax.scales_recorded`][] holds for the model, the values `fn` computes (bit for bit
    where XLA rounds each expression alike in both programs).

    `fn` may be jitted already, or call jitted functions: fp8jax's trace-time settings are
    part of JAX's cache keys, so what was traced with the warm start is traced again
    without it:

    ```python
    warm = eqx.filter_jit(step)
    fast = eqx.filter_jit(fp8jax.without_warm_start(step))
    model, loss = warm(model, batch)  # the first step: the histories fill
    if fp8jax.scales_recorded(model):
        model, loss = fast(model, batch)
    ```

    [`fp8jax.make_train_step`][]'s steps switch by themselves.
    """
    if not callable(fn):
        raise TypeError(f"without_warm_start: fn={fn!r} is not callable.")
    return _skipping(fn, recorded=False)


def once_recorded(fn: Callable[P, R]) -> Callable[P, R]:
    """`without_warm_start(fn)` for a caller that runs it only once
    [`fp8jax.scales_recorded`][] holds (the train step): each cast then multiplies by its
    state's scale as it is, with no choice for a state that holds none (one kernel fewer per
    operand and step)."""
    return _skipping(fn, recorded=True)


def _skipping(fn: Callable[P, R], recorded: bool) -> Callable[P, R]:
    @functools.wraps(fn)
    def skipping(*args: P.args, **kwargs: P.kwargs) -> R:
        with skip_warm_start(recorded):
            return fn(*args, **kwargs)

    return skipping


def recorded_flag(tree: Any) -> Bool[Array, ""] | None:
    """`scales_recorded(tree)`, or `None` where `tree` holds no delayed-scaling state with
    the warm start (nothing to switch off: a step keeps the program it has)."""
    return scales_recorded(tree) if switches(tree) else None


class Lineage(NamedTuple):
    """What the host knows of a state returned by a step: what that step said of its
    scales (`said`: `True`, a device bool from `recorded_flag`, or `None`), the blocking
    reads left, and the steps its lineage has run."""

    said: Any = None
    reads_left: int = BLOCKING_READS
    steps: int = 0


#: ids of the objects a step returned -> (weak references to them, their `Lineage`). An
#: entry leaves with its first object.
_SAID: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], Lineage]] = {}


def remember(objects: Sequence[Any], lineage: Lineage) -> None:
    """Keep `lineage` for the state a step returned, for `read` on the next step: `objects`
    stand for that state (a `TrainState`; the arrays of an NNX model's FP8 state), each
    held weakly."""
    objects = tuple(objects)
    if not objects:
        return  # nothing stands for the state: nothing to remember
    key = tuple(map(id, objects))
    _SAID[key] = (tuple(map(weakref.ref, objects)), lineage)
    weakref.finalize(objects[0], _SAID.pop, key, None)


def read(objects: Sequence[Any]) -> tuple[bool, Lineage]:
    """Whether the state `objects` stand for, as returned by the step before, has every
    scale recorded (the next step may skip the warm start), and the `Lineage` the state this
    step returns continues (its `said` to be filled in). A state from elsewhere (`init`, a
    checkpoint, a tree changed between steps: any of `objects` not the one a step returned)
    starts a lineage. Before `WARM_STEPS` steps of a lineage nothing is read; then a device
    answer is read once it is computed, or waited for while blocking reads are left (one
    wait, for the step before to finish)."""
    objects = tuple(objects)
    entry = _SAID.get(tuple(map(id, objects)))
    # Each object the very one a step returned: an id may have been reused by another.
    same = entry is not None and all(r() is o for r, o in zip(entry[0], objects, strict=True))
    known = entry[1] if same else Lineage()
    after = known._replace(steps=known.steps + 1)
    if known.said is True:
        return True, after
    if known.said is None or known.steps < WARM_STEPS:
        return False, after
    if known.reads_left > 0:
        return bool(known.said), after._replace(reads_left=known.reads_left - 1)
    return (bool(known.said) if known.said.is_ready() else False), after

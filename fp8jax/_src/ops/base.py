"""`AbstractFp8Op`: what the stateful FP8 ops share (their state, the checks of a call, `merge`)."""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike
from jaxtyping import Array

from ..core.jax_private import user_dtype
from ..core.stats import Fp8Stats
from ..core.updates import OverwriteWithGradient, haliax_fp8_op
from ..gemm.vjp import States
from ..recipes import ROLES, DelayedScaling, Recipe, ResidualState, TensorState
from ..recipes.base import inverse_scale
from ..recipes.per_tensor import next_scales

#: Prefix of the name scope of every FP8 GEMM: `fp8jax[<layer path>]/fwd|dgrad|wgrad`.
SCOPE = "fp8jax"


def check_float(name: str, x: Any, where: str, op: str) -> np.dtype:
    """The dtype of operand `name` of an FP8 GEMM, which must be a high-precision real float
    array; `where` names the layer in errors, `op` the high-precision operation it stands
    for."""
    if isinstance(x, bool) or not isinstance(x, jax.Array | np.ndarray | np.generic | int | float):
        raise TypeError(
            f"{where}: {name}={x!r} is not an array; pass a jax or NumPy array of "
            f"floats (float32, bfloat16, float16), as to {op}."
        )
    dtype = np.dtype(jnp.result_type(x))
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{where}: {name} has dtype {dtype}; FP8 has no complex format. Use a "
            f"high-precision {op} for complex GEMMs, or split real and imaginary parts into "
            "real GEMMs."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{where}: {name} has dtype {dtype}; FP8 GEMMs take floating inputs "
            "(float32, bfloat16, float16). Cast integer data before the layer."
        )
    if dtype.itemsize == 1:
        raise TypeError(
            f"{where}: {name} is already {dtype}; pass the high-precision tensor and let "
            "the recipe quantize it."
        )
    return dtype


def received_finite(x: Array) -> Array:
    """Elementwise: `x`, a received FP8 state's leaf, holds no NaN and no +inf. -inf is the
    max-combining dtype's zero (a use that did not run), not an overflow: no amax, scale or
    count is ever -inf."""
    return x < jnp.inf  # False for NaN and +inf alone


def received_state(state: TensorState) -> tuple[Array, Array]:
    """Whether a received state is a real update, and whether it is one to reject.

    A zero cotangent (a zero scale) means the layer was not used this step, or its output
    got no gradient: nothing was received; so does -inf, the max-combining dtype's zero,
    which a use that did not run gives (a `lax.cond` branch not taken). A NaN or +inf
    anywhere in it (the operand held one, so its amax is not finite) is rejected: it never
    enters a history, where with `amax_compute="max"` it would freeze the scale for the
    history's length. Per layer of a stacked state (per expert of a grouped layer's kernel).
    """
    lead = jnp.ndim(state.scale)
    # Of an amax history only the newest entry is new: the older ones are the kept state's,
    # rolled (checked when they were new). Checking that entry alone keeps the test a few
    # scalars, which XLA fuses into the kernels that write the state, where a reduction over
    # every history would be one more kernel per operand and step.
    # `scale_inv` is left out: a merge computes it again from the scale it keeps.
    fields = [f.name for f in dataclasses.fields(state) if f.name != "scale_inv"]
    leaves = [
        a[..., :1] if name == "amax_history" else a
        for name in fields
        for a in jax.tree.leaves(getattr(state, name))
    ]
    finite = [jnp.all(received_finite(a), axis=tuple(range(lead, jnp.ndim(a)))) for a in leaves]
    finite = functools.reduce(jnp.logical_and, finite)
    take = finite & (state.scale > 0)
    return take, ~finite


def pick_received(old: Any, received: Any, ok: Array) -> Any:
    """`received` where `ok`, `old` elsewhere, leaf by leaf (in `old`'s dtypes). `ok` is a
    scalar, or has the leading axes of the leaves (one flag per expert, say)."""
    return jax.tree.map(
        lambda o, r: jnp.where(
            jnp.reshape(ok, ok.shape + (1,) * (o.ndim - ok.ndim)), r.astype(o.dtype), o
        ),
        old,
        received,
    )


def with_recorded_scales(op: Any) -> Any:
    """`op`, a state received through the gradient, with each operand's scale (and inverse)
    the one its recipe records beside the operand's newest amax (`Recipe.recorded_scale`),
    where that amax is positive and finite; as it is for delayed scaling (its merge computes
    the scale from the history). A [`fp8jax.ResidualState`][]'s `W_lo` scale too where
    it is a function of that scale (`ResidualFP8.recorded_lo_scale`); others are left as
    the uses' max (a scale not of the amax: `nf_aware`'s kernel, a measured `W_lo` scale).

    The uses of a layer in one step ([`fp8jax.filter_value_and_grad`][],
    [`fp8jax.nnx_value_and_grad`][]) combine their states leaf by leaf by max: the largest
    amax, but beside it the largest scale, that of the smallest amax. This pairs the scale
    with the amax again, as one use of the larger amax records them (and as accumulated
    microbatches keep them): [`fp8jax.combine_by_max`][] (so `filter_value_and_grad` and a
    hand-rolled `jax.grad` with it) and `nnx_value_and_grad` on their gradients,
    `nnx_update_fp8_state` on what it merges (plain `nnx.grad`'s too)."""
    if not isinstance(op, AbstractFp8Op):
        return op
    states = {}
    for r in ROLES:
        state = getattr(op, r)
        if type(state) not in (TensorState, ResidualState) or not eqx.is_array(state.amax_history):
            continue
        amax = state.amax_history[..., 0]
        scale = op.recipe.recorded_scale(amax, r)
        if scale is None:
            continue
        ok = (amax > 0.0) & jnp.isfinite(amax)
        scale = jnp.where(ok, scale.astype(state.scale.dtype), state.scale)
        if type(state) is ResidualState:
            lo = op.recipe.recorded_lo_scale(scale, r)
            lo = state.lo_scale if lo is None else jnp.where(ok, lo, state.lo_scale)
            states[r] = ResidualState(scale, state.amax_history, lo, state.error)
            continue
        inverse = jnp.where(ok, inverse_scale(scale), state.scale_inv)
        states[r] = TensorState(scale, state.amax_history, inverse)
    if not states:
        return op
    return eqx.tree_at(lambda m: tuple(getattr(m, r) for r in states), op, tuple(states.values()))


def merge_stats(old: Fp8Stats, new: Fp8Stats, received: dict[str, tuple[Array, Array]]) -> Fp8Stats:
    """Each operand's fresh statistics where its state was taken, the old ones elsewhere,
    and the count of rejected updates advanced (`received`: `received_state` of each role's
    state; per expert for a grouped layer's kernel)."""
    stats = {}
    for r in ROLES:
        before, (take, reject) = getattr(old, r), received[r]
        count = before.rejected + reject.astype(before.rejected.dtype)
        fresh = eqx.tree_at(lambda s: s.rejected, getattr(new, r), before.rejected)
        stats[r] = eqx.tree_at(lambda s: s.rejected, pick_received(before, fresh, take), count)
    return Fp8Stats(**stats)


def checked_ratio(ratio: Any, who: str) -> tuple[Array, Array]:
    """`ratio` (new loss scale / old) as a float32 scalar, and whether it changes nothing: 1,
    or, traced, a value that is not positive and finite. Raises `ValueError` naming `who`
    for any other shape or such a value."""
    ratio = jnp.asarray(ratio, jnp.float32)
    if ratio.shape != ():
        raise ValueError(
            f"{who}: ratio has shape {ratio.shape}; it should be a scalar "
            "(new loss scale / old loss scale)."
        )
    if not isinstance(ratio, jax.core.Tracer) and not (jnp.isfinite(ratio) and ratio > 0):
        raise ValueError(
            f"{who}: ratio={float(ratio)!r}: should be positive and finite "
            "(new loss scale / old loss scale)."
        )
    return ratio, (ratio == 1.0) | ~jnp.isfinite(ratio) | (ratio <= 0)


def rescaled_gradient_state(op: Any, ratio: Array, keep: Array) -> Any:
    """`op` with its output-gradient state as if its recorded gradients had been `ratio`
    times as large, or as it is where `keep` (`checked_ratio`): delayed scaling's history and
    the scale its next step uses; a recipe that records each step's own amax and scale
    (`Recipe.recorded_scale`), the amax and that scale, which its next step does not read
    (telemetry, in the new loss scale's units). Other recipes' ops as they are.
    `fp8jax.rescale_gradient_states` of one op, on arrays (Haliax's own FP8 op too)."""
    if isinstance(op, haliax_fp8_op()):
        return _rescaled_haliax_state(op, ratio, keep)
    state = op.output_grad
    if not isinstance(state, TensorState | ResidualState):
        return op
    history = jnp.where(keep, state.amax_history, state.amax_history * ratio)
    if isinstance(op.recipe, DelayedScaling):
        scale = op.recipe.next_scale(state.scale, history, "output_grad")
    else:
        amax = history[..., 0]
        recorded = op.recipe.recorded_scale(amax, "output_grad")
        if recorded is None:
            return op
        scale = jnp.where(amax > 0.0, recorded, 0.0)  # none recorded yet: kept below
    # A ratio of 1 keeps the scale as it is, even one set by hand that the history would
    # not give; so does a history that holds no amax (0: "none yet", for a recorded one).
    scale = jnp.where(keep | ~(scale > 0.0), state.scale, scale)
    if type(state) is ResidualState:  # an output gradient is one term: no W_lo scale
        new = ResidualState(scale, history, state.lo_scale, state.error)
    else:
        new = TensorState(scale, history)
    return eqx.tree_at(lambda o: o.output_grad, op, new)


def _rescaled_haliax_state(op: Any, ratio: Array, keep: Array) -> Any:
    """Haliax's FP8 op with its output-gradient amax history times `ratio`, and its scale
    (which Haliax divides by) as its next step computes it from that history: `1 / (e5m2
    max / history max)`, kept where that max is 0 (nothing recorded) or not finite, as
    Haliax keeps it then (its next step computes that scale from the history itself: the
    stored one is its fallback, and what it stores after that step)."""
    old, scale = op.output_grad_amax_history, op.output_grad_scale
    history = jnp.where(keep, old, old * ratio)
    most = jnp.max(history, axis=-1, keepdims=True)  # stacked layers: one per layer
    fp8_max = jnp.finfo(jnp.float8_e5m2).max.astype(jnp.float32)
    kept = keep | ~(most > 0.0) | ~jnp.isfinite(most)
    # As Haliax writes it, a `where` between the divisions: XLA would make `1 / (m / a)`
    # `a / m` (an ulp apart) where nothing stands between them.
    inverse = jnp.where(kept, 1.0 / scale, fp8_max / jnp.where(kept, 1.0, most))
    new = jnp.where(kept, scale, 1.0 / inverse)
    where = lambda o: (o.output_grad_amax_history, o.output_grad_scale)  # noqa: E731
    return eqx.tree_at(where, op, (history, new.astype(scale.dtype)))


def with_rejected_counts(tree: Any, *others: Any) -> Any:
    """`tree` with each FP8 layer's telemetry counts of rejected updates
    (`stats.<role>.rejected`) the largest of `tree`'s and `others`' (trees of its structure):
    a running count only grows, so a step skipped by selecting the old model keeps the
    step's own count of the update its merge rejected."""

    def is_op(x: Any) -> bool:
        return isinstance(x, AbstractFp8Op)

    def counts(op: Any) -> list[Any]:
        return [getattr(op.stats, role).rejected for role in ROLES]

    def take(op: Any, *rest: Any) -> Any:
        if not is_op(op) or op.stats is None:
            return op
        every = [counts(o) for o in (op, *rest)]
        if not all(eqx.is_array(c) for c in jax.tree.leaves(every, is_leaf=lambda x: x is None)):
            return op  # a tree filtered without them
        most = functools.reduce(
            lambda a, b: [jnp.maximum(u, v) for u, v in zip(a, b, strict=True)], every
        )
        return eqx.tree_at(counts, op, most)

    return jax.tree.map(take, tree, *others, is_leaf=is_op)


@functools.lru_cache(maxsize=64)
def _lax_result_type(lhs: np.dtype, rhs: np.dtype) -> np.dtype:
    """The dtype of `lax.dot_general` of operands of these dtypes, asked of JAX itself
    (abstractly) so that the FP8 ops answer as the ops they replace do."""
    one = (((1,), (0,)), ((), ()))
    shapes = (jax.ShapeDtypeStruct((1, 1), lhs), jax.ShapeDtypeStruct((1, 1), rhs))
    return np.dtype(jax.eval_shape(lambda a, b: lax.dot_general(a, b, one), *shapes).dtype)


def check_float32_state(op: AbstractFp8Op) -> None:
    """Raise `TypeError` if a cast of the whole model or variables reached `op`'s FP8 state
    (a floating leaf that is not float32), before it rounds its scales and amax history."""
    for role in ROLES:
        for leaf in jax.tree.leaves(getattr(op, role)):
            dtype = getattr(leaf, "dtype", None)  # np.dtype: not the max-combining view
            if isinstance(dtype, np.dtype) and jnp.issubdtype(dtype, jnp.floating):
                if dtype != np.float32:
                    raise TypeError(
                        f"{op._where}: its FP8 state ({role}) is {dtype}, not float32: a "
                        "cast of the whole model or variables reached it (or it was built "
                        "from NumPy's float64 values: make them float32), which would round "
                        "its scales and amax history. Cast only the parameters: "
                        "fp8jax.Policy's cast_to_compute (Equinox), a cast of "
                        "variables['params'] alone (Linen), or of nnx.state(model, "
                        "nnx.Param) (NNX); FP8 state stays float32."
                    )


def check_one_state(op: AbstractFp8Op) -> None:
    """Raise `ValueError` if `op` holds a stack of states (one per layer of a `Stacked`, a
    vmapped or scanned stack) and is called on the whole stack: every recipe's input scale
    is a scalar, and a call maps the stack's axis away."""
    lead = jnp.shape(op.input.scale)
    if lead:
        named = f" {op.name!r}" if op.name else ""
        raise ValueError(
            f"{op._where}{named}: its FP8 state is a stack of {lead} states (one per layer "
            "of a stack: a haliax Stacked, or layers built under a vmap) and it was called "
            "on the whole stack. Call the layer one member at a time: under jax.vmap or "
            "lax.scan over the stack's axis (hax.vmap, hax.fold or Stacked for Haliax), or "
            "take one layer of the stack first."
        )


@functools.lru_cache(maxsize=64)
def _fresh_kind(recipe: Recipe, role: str) -> tuple[type, int]:
    """The type of `recipe`'s fresh state for `role` and the length of its amax history."""
    fresh = jax.eval_shape(lambda: recipe.init_state(role))
    return type(fresh), jnp.shape(fresh.amax_history)[-1]


def check_state_kind(op: AbstractFp8Op) -> None:
    """Raise `ValueError` if a state of `op` is not of the kind its recipe keeps (its type,
    its amax history's length): a state moved in from a layer of another recipe (by
    `eqx.tree_at`) would run with that recipe's history, or skip the warm start."""
    for role in ("input", "output_grad"):  # the kernel's may be weight-shaped (residual)
        state = getattr(op, role)
        kind, length = _fresh_kind(op.recipe, role)
        found = jnp.shape(state.amax_history)[-1:] if hasattr(state, "amax_history") else None
        if type(state) is not kind or found != (length,):
            held = f"a {type(state).__name__}" + (f" with {found[0]} amaxes" if found else "")
            raise ValueError(
                f"{op._where}{f' {op.name!r}' if op.name else ''}: its {role} state is {held}; "
                f"its recipe {op.recipe!r} keeps a {kind.__name__} with {length}: a state "
                "moved in from a layer of another recipe. Move states only between layers "
                "of one recipe, or give the layer recipe.init_state(role)."
            )


@final
@dataclasses.dataclass(frozen=True)
class LayerTag:
    """The FP8 op that a leaf of its state belongs to, for a leaf held outside the op: a Flax
    NNX `Fp8State` variable keeps it as metadata, so that an `nnx.State` (which holds the
    variables, not the op) still says which FP8 layers it holds, with their recipes (a
    checkpoint of it records them). `depth`: how many keys below the op the leaf is."""

    name: str
    recipe: Recipe
    telemetry: bool
    experts: int | None
    depth: int

    def __repr__(self) -> str:  # short: a variable's repr shows it
        return f"LayerTag({self.name!r})"


def state_tags(op: AbstractFp8Op) -> Any:
    """`op` with each array leaf of its state replaced by the [`LayerTag`][] naming the op."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: LayerTag(
            op.name,
            op.recipe,
            op.stats is not None,
            getattr(op, "num_experts", None),
            len(path),
        ),
        op,
    )


class AbstractFp8Op(OverwriteWithGradient):
    """A high-precision GEMM op computed in FP8, with the scaling state of its three operands.

    Subclasses ([`fp8jax.Fp8DotGeneral`][], [`fp8jax.Fp8RaggedDot`][]) call their FP8 GEMM in
    `__call__` and say how their statistics merge; the checks of a call's dtypes and `merge`
    are shared.
    """

    input: eqx.AbstractVar[TensorState]
    kernel: eqx.AbstractVar[TensorState]
    output_grad: eqx.AbstractVar[TensorState]
    stats: eqx.AbstractVar[Any]
    recipe: eqx.AbstractVar[Recipe]
    name: eqx.AbstractVar[str]

    #: The high-precision operation the op stands for, as errors name it.
    stands_for: eqx.AbstractClassVar[str]
    #: Why its output dtype must be a high-precision float, as errors say it.
    accumulation: eqx.AbstractClassVar[str]

    @property
    @abc.abstractmethod
    def _where(self) -> str:
        """How errors name this op."""

    @abc.abstractmethod
    def _merge_stats(self, new: Any, received: dict[str, tuple[Array, Array]]) -> Any:
        """`self.stats` updated from `new` (a received value's), as `merge` takes states."""

    def _input_dtype(self, name: str, x: Any) -> np.dtype:
        return check_float(name, x, self._where, self.stands_for)

    def _output_dtype(self, lhs: np.dtype, rhs: np.dtype, preferred: DTypeLike | None) -> np.dtype:
        """`preferred_element_type`, checked, or the type `lax.dot_general` gives the operands
        (which is not always `jnp.promote_types`': BF16 with float16 gives BF16)."""
        if preferred is None:
            return _lax_result_type(np.dtype(lhs), np.dtype(rhs))
        if isinstance(preferred, jax.Array | np.ndarray):  # as `lax.dot_general` refuses it
            raise TypeError(
                f"{self._where}: preferred_element_type is an array of {preferred.dtype}, not "
                f"a dtype; pass its dtype (preferred_element_type=x.dtype), as to "
                f"{self.stands_for}."
            )
        try:
            out = np.dtype(preferred)
        except TypeError:
            out = None
        if out is None or not jnp.issubdtype(out, jnp.floating) or out.itemsize < 2:
            shown = preferred if out is None else out
            raise TypeError(
                f"{self._where}: preferred_element_type={shown} is not a high-precision float "
                f"type; use float32, bfloat16 or float16 ({self.accumulation})."
            )
        # What `lax.dot_general` writes too: float64 is float32 unless x64 is enabled, with
        # lax's warning.
        return user_dtype(preferred, self.stands_for)

    def _states(self) -> States:
        check_float32_state(self)
        check_one_state(self)
        check_state_kind(self)
        return States(self.input, self.kernel, self.output_grad, self.stats)

    def _name_scope(self) -> Any:
        """The name scope of the op's GEMMs, which `fp8jax.inspect` reads."""
        return jax.named_scope(f"{SCOPE}[{self.name}]")

    def merge(self, new: Any) -> Any:
        """Take each operand's received state where it is a real, finite update (expert by
        expert for a grouped layer's kernel).

        A zero state (the layer was not used this step, its output got no gradient, or, for
        one expert's kernel, the expert got no tokens) leaves that operand's state as it was.
        So does a state holding an inf or NaN (the operand held one: the fault itself
        reaches the GEMM's output as NaN); telemetry counts those steps in
        `stats.<role>.rejected`.
        """
        return type(self).merge_many([(self, new)])[0]

    @classmethod
    def merge_many(cls, pairs: list[tuple[Any, Any]]) -> list[Any]:
        """`[old.merge(new) for old, new in pairs]`, in a few kernels per step.

        Merged one by one, each operand's state is taken or kept by a select per leaf: two
        small kernels per operand and step. Here the per-tensor states of every role of
        every op are stacked (by history length, delayed scaling's apart), taken or kept by
        one select per leaf, and delayed scaling's given the scale their next step uses
        (`next_scales`: one reduction over all the histories, where the forward would
        reduce each one), which XLA writes, with the slices back to each state, in a few
        kernels. The same values. States of other kinds, and those with one scale per
        expert, are merged one by one.
        """
        stacks: dict[tuple[tuple[int, ...], bool], list[tuple[int, str]]] = {}
        alone: list[tuple[int, str]] = []
        for i, (old, _) in enumerate(pairs):
            for r in ROLES:
                state = getattr(old, r)
                if type(state) is TensorState and jnp.ndim(state.scale) == 0:
                    delayed = isinstance(old.recipe, DelayedScaling)
                    key = (jnp.shape(state.amax_history), delayed)
                    stacks.setdefault(key, []).append((i, r))
                else:  # a state of its own kind, or one per expert
                    alone.append((i, r))
        merged: dict[tuple[int, str], Any] = {}
        received: dict[tuple[int, str], tuple[Array, Array]] = {}
        for i, r in alone:
            old, new = getattr(pairs[i][0], r), getattr(pairs[i][1], r)
            received[i, r] = received_state(new)
            kept = pick_received(old, new, received[i, r][0])
            recipe = pairs[i][0].recipe
            if isinstance(recipe, DelayedScaling) and type(kept) is TensorState:
                scale = recipe.next_scale(kept.scale, kept.amax_history, r)
                kept = TensorState(jnp.where(scale > 0.0, scale, old.scale), kept.amax_history)
            merged[i, r] = kept
        for (_, delayed), slots in stacks.items():
            old, new = (
                jax.tree.map(lambda *a: jnp.stack(a), *(getattr(pairs[i][k], r) for i, r in slots))
                for k in (0, 1)
            )
            if not delayed:
                # Else XLA moves the slices below back through the stack, to each state's
                # own select: a kernel per leaf and state again.
                new = lax.optimization_barrier(new)
            take, reject = received_state(new)
            if delayed:
                # Else XLA may fuse the flags into the reduction over the stacked histories
                # and write that stack whole, each state's history then a slice and a kernel
                # of its own (21 for a Llama block's step without the warm start).
                take = lax.optimization_barrier(take)
            kept = pick_received(old, new, take)
            scales = kept.scale
            if delayed:
                rules = [(pairs[i][0].recipe, r) for i, r in slots]
                scales = next_scales(kept.scale, kept.amax_history, rules)
                # A recorded scale outlives a history emptied again (all-zero operands under
                # a short history): steps without the warm start cast by it.
                scales = jnp.where(scales > 0.0, scales, old.scale)
            for n, slot in enumerate(slots):
                # A scale is never negative; clamped after the slice, every state's scale is
                # an output of one fusion, where a plain slice was a kernel of its own each.
                # Its inverse is computed here for every state (`TensorState`).
                merged[slot] = TensorState(jnp.maximum(scales[n], 0.0), kept.amax_history[n])
                received[slot] = take[n], reject[n]
        out = []
        for i, (old, new) in enumerate(pairs):
            states = {r: merged[i, r] for r in ROLES}
            if old.stats is not None:
                states["stats"] = old._merge_stats(new.stats, {r: received[i, r] for r in ROLES})
            out.append(
                eqx.tree_at(
                    lambda m, names=tuple(states): tuple(getattr(m, n) for n in names),
                    old,
                    tuple(states.values()),
                )
            )
        return out

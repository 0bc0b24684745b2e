"""Per-tensor recipes: one scale per operand, delayed (from a history) or current."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Collection
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..core.compile_options import is_cublas_traced
from ..core.contexts import Setting, setting
from ..core.formats import fp8_max, quantize
from .base import (
    ROLES,
    Axis,
    HybridFormats,
    QTensor,
    Role,
    TensorState,
    check_choice,
    check_flags,
    check_margin,
    check_positive_int,
    per_tensor_dot,
)
from .per_tensor_pass import cast_and_transpose, cast_transpose_chosen, checked_roles, fits
from .per_tensor_pass import transposes_in_words as transposes_in_words
from .per_tensor_pass import transposes_in_words_chosen as transposes_in_words_chosen
from .per_tensor_scale import compute_scale, roll_in

#: Inside `skip_warm_start()`: `"skipped"`, or `"recorded"` where every state is known to
#: hold a scale; `None` outside.
_SKIP_WARM_START: Setting[str | None] = Setting("fp8jax_skip_warm_start", None)


def skip_warm_start(recorded: bool = False) -> contextlib.AbstractContextManager[None]:
    """[`fp8jax.DelayedScaling`][] traced inside casts by its state's scale alone, as with
    `warm_start=False` (1.0 where the state holds none), so the cast does not wait for its
    operand's amax. The same values wherever every state holds a scale
    (`train/warm_start.py`: `fp8jax.scales_recorded`, `fp8jax.without_warm_start`).

    With `recorded`, the caller has checked that every state holds one (the train step's
    program after `scales_recorded`): the cast then multiplies by the state's scale as it
    is, where choosing 1.0 for a state without one is a kernel of its own per operand."""
    if not isinstance(recorded, bool):
        # A truthy non-bool ("no", say) would cast a state without a scale by 0.
        raise ValueError(f"skip_warm_start: recorded={recorded!r}; expected True or False.")
    return setting(_SKIP_WARM_START, "recorded" if recorded else "skipped")


def warm_start_skipped() -> bool:
    """Whether delayed scaling is being traced inside `skip_warm_start()`."""
    return _SKIP_WARM_START.get() is not None


def scales_known_recorded() -> bool:
    """Whether delayed scaling is being traced inside `skip_warm_start(recorded=True)`."""
    return _SKIP_WARM_START.get() == "recorded"


#: The roles whose transposed FP8 copies are made apart by default where the cast does not
#: wait for its operand's amax (`PerTensorRecipe.transposes_apart`): the output gradients'.
#: Their cast then fuses with the kernel that produces the gradient and with its amax, and
#: writes one layout; a transpose of the FP8 bytes makes the wgrad's copy. On a Llama-3-8B
#: block's steady-state step compiled for an H100 (`benchmarks/llama_block.py`): temp memory
#: 1.01x BF16's where both layouts from the cast took 1.19x, 10.82 GB of non-GEMM traffic
#: against 11.15, 100 kernels against 98 (issue 38; `benchmarks/RESULTS.md`, session 42).
KNOWN_SCALE_APART: frozenset[str] = frozenset({"output_grad"})

#: The roles whose transposed FP8 copies are made apart (`transposes_apart`); `None`: each
#: recipe's default.
_TRANSPOSES_APART: Setting[frozenset[str] | None] = Setting("fp8jax_transposes_apart", None)


def transposes_apart(
    roles: Role | Collection[Role] = ROLES,
) -> contextlib.AbstractContextManager[None]:
    """Per-tensor recipes traced inside transpose the FP8 copy of each operand of `roles` (one or
    several of `"input"`: the activation, `"kernel"`, `"output_grad"`; `()`: none) for the
    backward in a pass of its own, from its FP8 values (`Recipe.transposes_apart`), and let
    the pass that quantizes the others write both layouts. That pass may then reduce the
    operand's amax too, where the cast need not wait for it (delayed scaling's steady state),
    and casts at a reduction's rate: in GPU run 6 (H200) XLA's transposing casts moved their
    bytes at 1.77 TB/s, its reductions at 4.0 and an FP8 transpose at 2.9
    (`benchmarks/RESULTS.md`, "Session 35"). Outside it, the output gradients' copies are made
    apart where the cast does not wait for the amax (`KNOWN_SCALE_APART`), the others by the
    cast. Issue 38: the GPU check's `*-apart` and `delayed-steady-fused` variants time the
    choices."""
    return setting(_TRANSPOSES_APART, checked_roles("transposes_apart", roles, allow_empty=True))


def transposes_apart_chosen(role: Role) -> bool:
    """Whether per-tensor recipes are being traced inside `transposes_apart()` with `role`
    among its roles."""
    return role in (_TRANSPOSES_APART.get() or ())


def transposes_apart_set() -> bool:
    """Whether per-tensor recipes are being traced inside `transposes_apart()` (whatever its
    roles, none included), where each recipe's default does not apply."""
    return _TRANSPOSES_APART.get() is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensorRecipe(HybridFormats):
    """Shared machinery of recipes with one scale per tensor.

    A GEMM is `dot_general(x8, w8, preferred_element_type=out) * (1 / (sx * sw))`: real FP8
    operands reach `lax.dot_general`, which XLA's GPU compiler turns into one cuBLASLt FP8
    GEMM whose alpha is the scale. Subclasses say how the scale is chosen (`scale_for`).

    Scales are powers of two by default. The GEMM writes its output dtype directly and the
    dequantization factor `1 / (sx * sw)` is applied in that dtype; a power of two is exact
    there, so a BF16 output carries no error from the scale. An arbitrary factor rounded to
    BF16's 8 significant bits would be off by up to 0.4 %, the same for the whole output: a
    bias, not noise. E4M3's relative precision does not depend on the scale; rounding the
    scale down to a power of two only leaves up to one binade of headroom at the top (the
    amax lands in `(fp8_max / 2, fp8_max]`), which values near the bottom of the range pay
    for (measured in `benchmarks/RESULTS.md`).

    **Arguments:**

    - `power_of_two`: round each scale down to a power of two (default `True`). With `False`
      the scale is `fp8_max / amax` exactly (Transformer Engine's choice) and a BF16 or
      float16 output is scaled in float32 and then converted: as exact, but the GEMM writes
      a float32 buffer and XLA adds a pass to convert it.
    - `forward_format` (inputs and kernels, `"e4m3"`), `backward_format` (output gradients,
      `"e5m2"`; `"e4m3"` is allowed), and those of [`fp8jax.Recipe`][].
    """

    power_of_two: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags(self, "power_of_two")

    def scale_for(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        """The scale to quantize `x` with now, and the state to keep, whose `scale_inv`
        dequantizes the cast (`TensorState(scale, history)` computes it from `scale`): those of
        `x`'s amax (`Recipe.amax`'s, over the batch under `vmap` and over `axis_names`)."""
        return self._scale_with(self.amax(x, state.scale), state, role)

    def quantize(
        self, x: Array, state: TensorState, role: Role, axis: Axis
    ) -> tuple[QTensor, TensorState]:
        """`x` cast to FP8 by one scale for the whole tensor (`scale_for`), and the new state."""
        del axis
        scale, new_state = self.scale_for(x, state, role)
        # No barrier ties the FP8 values to the amax the state records: XLA then writes them,
        # and their transposed copy for the backward (`transposed_copies`), in one pass, and
        # computes the amax where it fits best. (A barrier that made the amax ready before
        # the FP8 values were used, added when delayed scaling's cast did not wait for the
        # amax, measured worse once the copies were saved transposed: temp memory over
        # benchmarks/memory_sweep.py, and more kernels.)
        return QTensor(quantize(x, scale, self.format(role)), new_state.scale_inv), new_state

    def quantize_transposed(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[QTensor, QTensor | None, TensorState]:
        """`x` and its transpose from one kernel inside `cast_transpose_kernel()`."""
        # Inside `cast_transpose_kernel()`: both copies from one kernel (`per_tensor_pass`),
        # and the amax too where the scale does not wait for it; else XLA's amax first.
        if not (cast_transpose_chosen(role) and fits(x)):
            return super().quantize_transposed(x, state, role)
        known = self._known_scale(state)
        if known is None:
            scale, new_state = self.scale_for(x, state, role)
            data, data_t, _ = cast_and_transpose(x, scale, self.format(role))
        else:
            data, data_t, local = cast_and_transpose(x, known, self.format(role))
            # Over the batch under `vmap` and over `axis_names`, as `Recipe.amax` spans them.
            _, new_state = self._scale_with(self.amax(local, state.scale), state, role)
        return QTensor(data, new_state.scale_inv), QTensor(data_t, new_state.scale_inv), new_state

    def _known_scale(self, state: TensorState) -> Float[Array, ""] | None:
        """The scale of this step where it does not depend on the operand (`None` here)."""
        del state
        return None

    @abc.abstractmethod
    def _scale_with(
        self, current: Float[Array, ""], state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        """`scale_for` of an operand whose amax (`Recipe.amax`'s) is `current`."""

    def retile(self, q: QTensor, role: Role, axis: Axis, source: Array | None = None) -> QTensor:
        """`q` as it is: one scale for the whole tensor fits every contracted axis."""
        del role, axis, source
        return q

    @property
    def transposed_copies(self) -> bool:
        """True: a per-tensor operand's transposed copy is made as it is quantized."""
        return True

    def transposes_apart(self, role: Role) -> bool:
        """As `transposes_apart()` sets it, else where the scale needs no amax first."""
        # By default only where the cast does not wait for the amax (kept inverses: the cast
        # then fuses with the amax, where a transposing cast cannot).
        if transposes_apart_set():
            return transposes_apart_chosen(role)
        return role in KNOWN_SCALE_APART and self.kept_inverses

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        """One FP8 GEMM of both operands with their scales' inverses (`per_tensor_dot`)."""
        return per_tensor_dot(
            lhs,
            rhs,
            lhs_axis,
            rhs_axis,
            precision,
            out_dtype,
            exact_scales=self.power_of_two,
            kept_inverses=self.kept_inverses and is_cublas_traced(),
        )

    @property
    def kept_inverses(self) -> bool:
        """Whether each `QTensor`'s `scale_inv` is its state's, as kept between steps (not
        computed in the step): `per_tensor_dot` then hands both to the GEMM as they are."""
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling(PerTensorRecipe):
    """Per-tensor delayed scaling, as in Transformer Engine.

    The scale used at step `t` comes from the amax history *before* step `t`; the amax of
    step `t` then enters the history. With `amax = max(history)` (or `history[0]` for
    `amax_compute="most_recent"`):

    `scale = fp8_max / (amax * 2**margin)` (rounded down to a power of two unless
    `power_of_two=False`), kept unchanged when `amax` is zero or not finite.

    As in Transformer Engine, that scale is computed after each step, once the step's amax
    is in the history: merging the step's new state ([`fp8jax.apply_updates`][] and the
    other train-state helpers, through [`fp8jax.Fp8DotGeneral.merge`][]) stores in
    `TensorState.scale` the scale the next step uses, for every layer at once in a few
    kernels, and the forward reads it as it is, with no reduction over the history per
    operand and step.

    **A warm first step.** While the history holds no amax yet (a fresh layer, or one just
    converted from a trained BF16 checkpoint; its state's scale is then 0), the operand is
    scaled by its own amax, as
    [`fp8jax.CurrentScaling`][] would: Transformer Engine and Haliax scale by 1.0 then, and
    a small tensor (an output gradient of `1e-6`, say) underflows E5M2 and E4M3 entirely, so
    the first steps' weight gradients come out zero. From the first recorded amax on, the
    scale is delayed as above. `warm_start=False` restores the scale of 1.0 (bit-equality
    with Transformer Engine or Haliax). The amax is reduced in either case (it enters the
    history). With the warm start the cast waits for it, in every step: XLA reads each
    operand twice, once for its amax and once to cast it. Without it XLA computes the amax
    in the casting pass or where it fits best, and the cast and the GEMM take the state's
    scale and kept inverse as they are (`TensorState.scale_inv`; the GEMM in cuBLAS mode,
    see `per_tensor_dot`), and the output gradient's cast, which then fuses with its amax,
    leaves the wgrad's transposed copy to a transpose of the FP8 bytes (`KNOWN_SCALE_APART`):
    on a Llama-3-8B block's train step compiled for an H100, 100 kernels instead of 129,
    non-GEMM bytes 1.29x BF16's instead of 1.52x, temp memory 1.01x BF16's instead of
    1.00x (read from the compiled HLO, `benchmarks/RESULTS.md`). Under gradient
    accumulation (or a layer used several times) that first step casts each microbatch (use)
    with its own amax; the history records their max, as always.

    **Arguments:**

    - `history_len`: amaxes remembered (default 1024).
    - `amax_compute`: `"max"` or `"most_recent"`.
    - `margin`: leave `2**margin` of headroom below the format's max (-32 to 32).
    - `warm_start`: scale by the current amax while the history is empty (default `True`).
    - the formats and options of [`fp8jax.PerTensorRecipe`][].

    ```python
    recipe = fp8jax.DelayedScaling(history_len=16, amax_compute="most_recent")
    ```
    """

    history_len: int = 1024
    amax_compute: str = "max"
    margin: float = 0.0
    warm_start: bool = True

    @property
    def reads_state(self) -> bool:
        """True: delayed scaling casts by the scale its amax history gives."""
        return True

    @property
    def stale_state(self) -> str:
        """An undifferentiated state's fault: its scales and amax history never move."""
        return (
            "Its scales and amax history would stay as they are forever (a fresh layer's "
            "empty history would cast every step by its own amax, the warm start, and its "
            "scale never be recorded; with warm_start=False, its scale of 1.0 saturates large "
            "values and flushes small gradients to zero)."
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_margin(self.margin)
        check_positive_int("history_len", self.history_len)
        check_choice("amax_compute", self.amax_compute, ("max", "most_recent"))
        check_flags(self, "warm_start")

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> TensorState:
        """An empty amax history of `history_len`, scale 0 (the warm start) or 1.0 without it."""
        # With the warm start, scale 0 says "no amax recorded yet": the first step then
        # scales by its own amax. Without it, Transformer Engine's 1.0.
        return TensorState(
            scale=jnp.full((), 0.0 if self.warm_start else 1.0, jnp.float32),
            amax_history=jnp.zeros((self.history_len,), jnp.float32),
        )

    def _kept_scale(self, state: TensorState, fallback: Any) -> Float[Array, ""]:
        if not self.warm_start or scales_known_recorded():
            # The state's scale as it is: positive here (1 at first without the warm start;
            # never 0 once recorded), so the cast reads no scalar computed in the step, which
            # would be a kernel of its own per operand and step.
            return state.scale
        return jnp.where(state.scale > 0.0, state.scale, fallback)

    def _scale_with(
        self, current: Float[Array, ""], state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        # The state's scale is the one this step uses, computed from the history when the
        # previous step's state was merged (`next_scales`): no reduction over the history
        # here, one per operand and step otherwise.
        if self.warm_start and not warm_start_skipped():
            fmt_max = fp8_max(self.format(role))
            fallback = compute_scale(current, 1.0, fmt_max, self.margin, self.power_of_two)
        else:
            fallback = 1.0
        history = roll_in(state.amax_history, current)
        scale = self._kept_scale(state, fallback)
        if not self.kept_inverses:
            return scale, TensorState(scale, history, 1.0 / scale)
        # The kept inverse, handed to the GEMM as it is (1 where the state holds no scale and
        # the cast uses 1.0), and in the new state the kept scale (only made positive: that
        # says the state was used, and a merge takes it; 1, Transformer Engine's, where it
        # held none, as a merge gives such a state), not the cast's: each would otherwise
        # be written by a kernel of its own per operand and step.
        used = jnp.where(state.scale > 0.0, state.scale, np.float32(1.0))
        return scale, TensorState(used, history, state.scale_inv)

    @property
    def kept_inverses(self) -> bool:
        """True without the warm start, or once its first steps are past (`warm_start_skipped`)."""
        return not self.warm_start or warm_start_skipped()

    def _known_scale(self, state: TensorState) -> Float[Array, ""] | None:
        # Without the warm start, or where it is skipped, the cast does not wait for the amax.
        return self._kept_scale(state, 1.0) if self.kept_inverses else None

    def next_scale(
        self, scale: Float[Array, "*lead"], history: Float[Array, "*lead n"], role: Role
    ) -> Float[Array, "*lead"]:
        """The scale the step after this one uses: from `history` (this step's amax already
        rolled in), or `scale` (this step's) where that holds no usable amax. See
        `next_scales`."""
        return next_scales(scale, history, [(self, role)])


def next_scales(
    scale: Float[Array, "*lead"],
    history: Float[Array, "*lead n"],
    rules: list[tuple[DelayedScaling, Role]],
) -> Float[Array, "*lead"]:
    """The scales the next step of delayed-scaling states uses, computed once their step's
    state is merged, for a stack of states at once.

    `fmt_max / (amax * 2**margin)` with `amax` the history's max (or its newest entry for
    `amax_compute="most_recent"`), rounded down to a power of two unless
    `power_of_two=False`; `scale` where that amax is zero or not finite (1 without the warm
    start where `scale` is 0); and 0 ("no amax yet") while a history with the warm start
    holds no amax at all. Transformer Engine computes the same after each step
    (`amax_and_scale_update`), where fp8jax's forward once reduced every history itself: a
    kernel per operand and step.

    **Arguments:**

    - `scale`, `history`: the merged states, stacked: `scale (*lead)`, `history (*lead, n)`.
    - `rules`: the recipe and role of each state of the stack (`len(rules) == lead[0]`), or
      one pair for all.
    """
    if len(rules) != 1 and (jnp.ndim(scale) == 0 or len(rules) != jnp.shape(scale)[0]):
        raise ValueError(
            f"next_scales: {len(rules)} rules for scales of shape {jnp.shape(scale)}: give one "
            "rule, or one per state along the leading axis."
        )

    def column(values: list, dtype: Any) -> Any:
        # One value for all states: a constant; else one per state along the leading axis.
        if all(v == values[0] for v in values):
            return values[0]
        return np.asarray(values, dtype).reshape((len(values),) + (1,) * (jnp.ndim(scale) - 1))

    fmt_max = column([fp8_max(r.format(role)) for r, role in rules], np.float32)
    margin = column([r.margin for r, _ in rules], np.float64)
    power_of_two = column([r.power_of_two for r, _ in rules], bool)
    most_recent = column([r.amax_compute == "most_recent" for r, _ in rules], bool)
    warm = column([r.warm_start for r, _ in rules], bool)
    if isinstance(fmt_max, float):
        fmt_max = np.float32(fmt_max)
    largest = jnp.max(history, axis=-1)
    ref = jnp.where(most_recent, history[..., 0], largest)
    # Without the warm start a state always holds a positive scale, which its cast takes as
    # it is: 1 (Transformer Engine's) where none was kept (restored from a checkpoint of a
    # warm-start run that had recorded none, say).
    previous = jnp.where(warm | (scale > 0.0), scale, jnp.ones_like(scale))
    new = compute_scale(ref, previous, fmt_max, margin, power_of_two)
    return jnp.where(warm & ~(largest > 0.0), jnp.zeros_like(new), new)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurrentScaling(PerTensorRecipe):
    """Per-tensor current scaling: each tensor is scaled by its own amax, in the same step.

    `scale = fp8_max / (amax * 2**margin)`, rounded down to a power of two unless
    `power_of_two=False` (the previous scale where the amax is zero or not finite). The amax
    is global: under `jit` with sharded arrays XLA reduces across devices; inside
    `shard_map`, name the mesh axes in `axis_names` to get a `pmax`. Under
    `jax.vmap(model)(batch)` it spans the whole batch. The state keeps the latest scale and
    amax, for telemetry.

    **Arguments:** `margin` (binades of headroom, -32 to 32), and those of
    [`fp8jax.PerTensorRecipe`][].
    """

    margin: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_margin(self.margin)

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> TensorState:
        """A scale of 1 and one amax slot: current scaling scales by the tensor at hand."""
        return TensorState(
            scale=jnp.ones((), jnp.float32), amax_history=jnp.zeros((1,), jnp.float32)
        )

    def _scale_with(
        self, current: Float[Array, ""], state: TensorState, role: Role
    ) -> tuple[Float[Array, ""], TensorState]:
        fmt_max = fp8_max(self.format(role))
        scale = compute_scale(current, state.scale, fmt_max, self.margin, self.power_of_two)
        history = state.amax_history.at[..., 0].set(current)
        return scale, TensorState(scale, history, 1.0 / scale)

    def recorded_scale(self, amax: Array, role: Role) -> Array:
        """The scale current scaling takes from `amax` (`margin` and `power_of_two` applied)."""
        fmt_max = fp8_max(self.format(role))
        return compute_scale(amax, amax, fmt_max, self.margin, self.power_of_two)

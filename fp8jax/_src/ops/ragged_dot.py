"""`Fp8RaggedDot`: a drop-in, stateful replacement for `jax.lax.ragged_dot` (the grouped GEMM
of a mixture of experts), and the checks of its arguments."""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, Int

from ..core.errors import OperandShapeError
from ..core.explicit import explicit_mesh, on_auto_axes, split_evenly
from ..core.jax_private import canonical_precision, varying_axes
from ..core.stats import ExpertStats
from ..gemm.exchange import ExpertExchange
from ..gemm.grouped import fp8_dispatched_ragged_dot, fp8_ragged_dot
from ..gemm.grouped_rules import check_recipe, native_choice
from ..recipes import Recipe, TensorState, recipe_from
from .base import AbstractFp8Op, merge_stats, pick_received


def rows_by_outputs(lhs: Array, rhs: Array, received: int | None = None) -> PartitionSpec:
    """The output sharding of a ragged dot under a mesh with Explicit axes, which JAX leaves to
    `out_sharding` ("Explicit sharding inference ... not implemented"): the tokens as `lhs`'s
    rows are, the outputs as `rhs`'s last axis is unless a mesh axis splits both. With
    `received` (the rows of a dispatched call: its plan's capacity), rows that split `lhs`'s
    unevenly are not split."""
    rows = jax.typeof(lhs).sharding.spec[0] if lhs.ndim else None
    if received is not None:
        rows = split_evenly(rows, received, jax.typeof(lhs).sharding.mesh)
    spec = tuple(jax.typeof(rhs).sharding.spec)
    outputs = spec[2] if len(spec) > 2 else None

    def names(entry: Any) -> set:
        return set(entry) if isinstance(entry, tuple) else set() if entry is None else {entry}

    return PartitionSpec(rows, None if names(rows) & names(outputs) else outputs)


def check_ragged_dot_args(
    where: str,
    lhs_shape: tuple[int, ...],
    rhs_shape: tuple[int, ...],
    group_sizes: Any,
    num_experts: int | None = None,
) -> None:
    """Check the arguments of a ragged dot: `lhs (M, K)`, `rhs (G, K, N)`, `group_sizes (G,)`
    of integers, with `G` equal to `num_experts` when given (the expert count of a layer's
    state). Group sizes known at trace time (NumPy arrays, concrete jax arrays) must be
    >= 0 and sum to at most `M` (rows past their sum get zeros, as from `lax.ragged_dot`);
    traced ones cannot be checked (see [`fp8jax.Fp8RaggedDot`][]).

    Raises `OperandShapeError` (a `ValueError` and, as from lax, a `TypeError`) for shapes,
    `TypeError` for a dtype, `ValueError` for group sizes, each naming what it refuses.
    """
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        raise TypeError(
            f"{where}: group_sizes={group_sizes!r} is not an array; pass the number of tokens "
            "of each expert as an integer array of shape (experts,)."
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"{where}: group_sizes has dtype {group_sizes.dtype}; should be an integer dtype "
            "(int32): the number of tokens of each expert."
        )
    gs_shape = tuple(group_sizes.shape)
    if len(lhs_shape) != 2 or len(rhs_shape) != 3 or len(gs_shape) != 1:
        raise OperandShapeError(
            f"{where}: got lhs {lhs_shape}, rhs {rhs_shape} and group_sizes {gs_shape}; should "
            "be lhs (tokens, in), rhs (experts, in, out) and group_sizes (experts,), as for "
            "jax.lax.ragged_dot (vmap over any other axes)."
        )
    if lhs_shape[1] != rhs_shape[1]:
        raise OperandShapeError(
            f"{where}: lhs {lhs_shape} has {lhs_shape[1]} features but rhs {rhs_shape} takes "
            f"{rhs_shape[1]} (rhs is (experts, in, out))."
        )
    counts = {"group_sizes": gs_shape[0], "rhs": rhs_shape[0]}
    if num_experts is not None:
        counts["the layer's state"] = num_experts
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise OperandShapeError(
            f"{where}: mismatched expert counts ({listed}); group_sizes must have one entry per "
            "expert, rhs one kernel per expert on its first axis"
            + (", and the layer was built for as many experts." if num_experts else ".")
        )
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(
            f"{where}: group_sizes={sizes.tolist()} has negative sizes; each expert gets >= 0 "
            "tokens."
        )
    if int(sizes.sum()) > lhs_shape[0]:
        raise ValueError(
            f"{where}: group_sizes={sizes.tolist()} sums to {int(sizes.sum())} but lhs has "
            f"{lhs_shape[0]} tokens (rows); the groups must fit in lhs's rows (as for "
            "lax.ragged_dot, rows past their sum may be left over: they get zeros)."
        )


def check_dispatch_args(
    where: str,
    lhs_shape: tuple[int, ...],
    rhs_shape: tuple[int, ...],
    plan: ExpertExchange,
    num_experts: int | None = None,
    *,
    rhs_axes: frozenset[str] = frozenset(),
) -> None:
    """Check a dispatched ragged dot: `lhs (tokens, in)` this device's tokens, as many as
    `plan` routed; `rhs (local experts, in, out)` this device's experts, as many as `plan`
    gives rows to (and as the layer's state, `num_experts`, when given), split over the
    plan's mesh axis (`rhs_axes`, the manual axes rhs varies over; checked where `shard_map`
    tracks them, i.e. where the plan varies over its axis)."""
    assignments, local = plan.order.shape[0], plan.group_sizes.shape[0]
    if len(lhs_shape) != 2 or len(rhs_shape) != 3:
        raise OperandShapeError(
            f"{where}: got lhs {lhs_shape} and rhs {rhs_shape} with an ExpertExchange; should "
            "be lhs (tokens, in), this device's tokens, and rhs (local experts, in, out)."
        )
    if lhs_shape[0] * plan.top_k != assignments:
        raise ValueError(
            f"{where}: lhs has {lhs_shape[0]} tokens but the ExpertExchange routed "
            f"{assignments // plan.top_k} (x top_k {plan.top_k}); pass the tokens it was "
            "made for, in the same order."
        )
    if lhs_shape[1] != rhs_shape[1]:
        raise OperandShapeError(
            f"{where}: lhs {lhs_shape} has {lhs_shape[1]} features but rhs {rhs_shape} takes "
            f"{rhs_shape[1]} (rhs is (local experts, in, out))."
        )
    counts = {"the ExpertExchange's local experts": local, "rhs": rhs_shape[0]}
    if num_experts is not None:
        counts["the layer's state"] = num_experts
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise ValueError(
            f"{where}: mismatched expert counts ({listed}); under expert parallelism rhs and "
            "the layer's kernel state hold this device's experts (split them over the "
            "exchange's mesh axis, e.g. shard_map in_specs P(axis) on their leading axis)."
        )
    axis = plan.axis_name
    tracked = axis in varying_axes(plan.group_sizes)
    if tracked and plan.send_sizes.shape[0] > 1 and axis not in rhs_axes:
        raise ValueError(
            f"{where}: rhs (this device's experts) is not split over the ExpertExchange's "
            f"mesh axis {axis!r} (it varies over {tuple(sorted(rhs_axes))}): every device of "
            f"{axis!r} would multiply its rows by the same experts; split the experts' weights "
            f"and FP8 state over {axis!r} (shard_map in_specs fp8jax.expert_specs(params, "
            f"{axis!r}))."
        )


def _check_count(num_experts: Any) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer):
        raise TypeError(f"Fp8RaggedDot: num_experts={num_experts!r}: should be an int >= 1.")
    if num_experts < 1:
        raise ValueError(f"Fp8RaggedDot: num_experts={num_experts!r}: should be an int >= 1.")
    return int(num_experts)


def listed_sizes(group_sizes: Any) -> Any:
    """Group sizes given as a list or tuple, as an array: NumPy's (checked at trace time), or
    jax's when an entry is traced (per-expert counts inside `jit`, which NumPy cannot hold).
    An empty list is integers (NumPy's float64 would name a dtype never given); anything
    else as it is."""
    if not isinstance(group_sizes, list | tuple):
        return group_sizes
    if not group_sizes:
        return np.zeros((0,), np.int32)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(group_sizes)):
        return jnp.asarray(group_sizes)
    return np.asarray(group_sizes)


def widened_group_sizes(group_sizes: Any) -> Array:
    """`group_sizes` in int32 at least: the offsets are cumulative sums of the sizes, which
    int8 sizes would overflow. NumPy's int64 stays int64 only where JAX has 64-bit types (as
    `lax.ragged_dot` takes it, with no warning); uint64 becomes int64 there (JAX promotes it
    with int32 to a float, which `lax.ragged_dot` refuses), int32 elsewhere."""
    sizes = jnp.asarray(group_sizes)
    wide = jnp.promote_types(sizes.dtype, jnp.int32)
    if not jnp.issubdtype(wide, jnp.integer):  # uint64 (and int32) promote to a float
        wide = jnp.dtype(jnp.int64)
    return sizes.astype(jax.dtypes.canonicalize_dtype(wide))


class Fp8RaggedDot(AbstractFp8Op):
    """`jax.lax.ragged_dot` computed as FP8 grouped GEMMs, with per-expert scaling state.

    The grouped GEMM of a mixture of experts, in the role [`fp8jax.Fp8DotGeneral`][] has for
    dense layers. Call it like `lax.ragged_dot`: `lhs (tokens, in)` with its rows sorted by
    expert, `rhs (experts, in, out)` (the experts' stacked kernels), `group_sizes (experts,)`
    (how many consecutive rows each expert gets). Forward, dgrad and wgrad are ragged dots of
    FP8 arrays; the wgrad (`d_rhs[e] = lhs[rows of e]^T @ g[rows of e]`) is a ragged dot over
    each expert's tokens. A `custom_vjp` saves only the FP8 operands, their scales and
    `group_sizes`.

    **Scales.** The kernel is quantized per expert: under a per-tensor recipe each expert has
    its own scale and amax history (its weights may differ in range by orders of magnitude);
    under a block recipe each expert's kernel has its own blocks (128 x 128 for
    [`fp8jax.BlockwiseScaling`][]). The activation and the output gradient are quantized as
    one tensor each: one scale from their amax over all tokens under a per-tensor recipe
    (as Transformer Engine's grouped GEMM does; a token's scale does not depend on which
    expert it was routed to, and the amax of a few tokens routed to one expert would be a
    noisy history), tiles along the features under a block recipe (1 x 128, MXFP8's 1 x 32:
    per token, independent of the experts). A row of the forward and dgrad outputs is scaled
    by its expert's kernel scale; the wgrad by the scalar product of the two tensors' scales.

    **State.** `input` and `output_grad` are [`fp8jax.TensorState`][]s as in a dense layer;
    `kernel` is one with a leading expert axis (`scale (experts,)`, `amax_history
    (experts, history)`, `scale_inv (experts,)`). It leaves the step through the gradient
    and combines across uses by max, as for dense layers (split it with
    [`fp8jax.partition_for_grad_overwrite`][], write it back with
    [`fp8jax.apply_updates`][]). **An expert that got no tokens keeps its state**: its
    weight took part in no GEMM that step. A step with no tokens at all still rolls an amax
    of 0 into the activation's and output gradient's histories (the mixture-of-experts
    guide says what that does to delayed scaling's scales).

    **Group sizes.** They must be >= 0 and sum to at most the number of tokens: rows past
    their sum get zeros, as from `lax.ragged_dot`, and their values set no scale (per-tensor
    recipes leave them out of the amaxes; block recipes' tiles are per row, but their
    recorded amax, telemetry only, spans them: a NaN there counts as a non-finite step of
    the input's). Sizes known at trace time are checked (a
    `ValueError` names them); traced ones (the usual case, computed by the router inside
    `jit`) cannot be: negative sizes, or sizes summing past the tokens, give undefined
    results. Sizes of a narrow integer
    dtype (int8) are widened to int32 first: their offsets would overflow.

    **Recipes:** [`fp8jax.DelayedScaling`][] (the default), [`fp8jax.CurrentScaling`][],
    [`fp8jax.BlockwiseScaling`][] and [`fp8jax.MXFP8`][].

    **On Hopper** the first three run on fp8jax's grouped GEMM kernels (Pallas Mosaic GPU),
    whose work grows with the tokens, not tokens times experts. Elsewhere, and for MXFP8,
    XLA's `ragged_dot`, which an H100 compile expands into a dense GEMM over all experts
    (see the mixture-of-experts guide). With E5M2 gradients (delayed and current
    scaling's default) the dgrad and wgrad multiply E5M2 by E4M3 in FP8 from JAX 0.11 on;
    JAX 0.10's `wgmma` takes one FP8 type, and there they run in the kernels on the FP8
    values upcast to BF16 (exact, at the 16-bit rate). With `backward_format="e4m3"` (or
    blockwise scaling) all three GEMMs are FP8 on every JAX.
    [`fp8jax.telemetry`][] reports its scales and amaxes, the kernel's per expert, and with
    `telemetry=True` the fractions saturated and flushed to zero (the kernel's per expert).

    **Arguments:**

    - `recipe`: a recipe or its name (`None`: delayed scaling).
    - `num_experts`: the number of experts, `rhs.shape[0]`.
    - `name`: the layer's path (set by [`fp8jax.fp8_linear_layers`][]); the GEMMs run under
      the name scope `fp8jax[<name>]/fwd` (`dgrad`, `wgrad`), as for dense layers.
    - `telemetry`: also keep statistics in `stats` ([`fp8jax.ExpertStats`][]): the
      fractions saturated and flushed to zero as dense layers keep them, the kernel's per
      expert (`stats.kernel.saturated (experts,)`; an expert that got no tokens keeps its
      previous ones), and the tokens each expert got (`stats.tokens (experts,)`).
    - `native_kernel`: `None` (the kernels where the program is compiled for Hopper, XLA's
      path elsewhere; [`fp8jax.BlockwiseScaling`][]'s own `native_kernel` is followed when
      this is `None`), `True` (the kernels; compiling fails off Hopper, and raises
      `ValueError` for a CPU) or `False` (XLA's path). Recipes in AMD's fnuz formats take
      XLA's path (the kernels' `wgmma` takes E4M3 and E5M2), and refuse `True`.

    ```python
    dot = fp8jax.Fp8RaggedDot(num_experts=8)
    y = dot(x, w, group_sizes)   # lax.ragged_dot(x, w, group_sizes), in FP8
    ```
    """

    input: TensorState
    kernel: TensorState
    output_grad: TensorState
    stats: ExpertStats | None
    recipe: Recipe = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    name: str = eqx.field(static=True)
    native_kernel: bool | None = eqx.field(static=True)

    stands_for: ClassVar[str] = "jax.lax.ragged_dot"
    accumulation: ClassVar[str] = "the GEMMs accumulate in float32"

    def __init__(
        self,
        recipe: Recipe | str | None = None,
        *,
        num_experts: int,
        name: str = "",
        telemetry: bool = False,
        native_kernel: bool | None = None,
    ):
        if not isinstance(name, str):
            raise TypeError(f"Fp8RaggedDot: name={name!r}: should be a str (the layer's path).")
        self.recipe = recipe_from(recipe)
        if isinstance(native_kernel, np.bool_):  # the bool it holds, as in the recipes
            native_kernel = bool(native_kernel)
        check_recipe(self.recipe, name, native_kernel)
        self.native_kernel = native_kernel
        self.num_experts = _check_count(num_experts)
        self.name = name
        self.input = self.recipe.init_state("input")
        kernel = self.recipe.init_state("kernel")
        self.kernel = jax.tree.map(lambda a: jnp.stack([a] * self.num_experts), kernel)
        self.output_grad = self.recipe.init_state("output_grad")
        if isinstance(telemetry, np.bool_):  # the bool it holds, as Fp8Config takes it
            telemetry = bool(telemetry)
        if not isinstance(telemetry, bool):
            raise TypeError(f"Fp8RaggedDot: telemetry={telemetry!r}: should be True or False.")
        self.stats = ExpertStats.zeros_for(self.num_experts) if telemetry else None

    def __call__(
        self,
        lhs: Float[ArrayLike, "tokens fan_in"],
        rhs: Float[ArrayLike, "experts fan_in fan_out"],
        group_sizes: Int[ArrayLike, " experts"],
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        group_offset: Any = None,
        out_sharding: Any = None,
    ) -> Float[Array, "tokens fan_out"]:
        """**Arguments:** as `jax.lax.ragged_dot` (`group_offset` is not supported: a value
        other than `None` raises; `out_sharding` reshards the output; `group_sizes` may also
        be a list or tuple of ints, and `precision` a list of two, which lax refuses). Under a
        mesh with Explicit axes, where `lax.ragged_dot` requires `out_sharding`, the output's
        rows default to `lhs`'s rows' sharding and its columns to `rhs`'s last axis's.

        **Returns:** `(tokens, out)`, in `preferred_element_type` (default: the type
        `lax.ragged_dot` gives `lhs` and `rhs`: BF16 with float16 is BF16, not
        `jnp.promote_types`' float32).
        """
        if group_offset is not None:
            raise NotImplementedError(
                f"{self._where}: group_offset={group_offset!r} is not supported (lax.ragged_dot "
                "takes it for a shard of the groups); pass every expert's weights and group "
                "sizes, or split experts with fp8jax.expert_exchange (expert parallelism)."
            )
        lhs_dtype = self._input_dtype("lhs", lhs)
        rhs_dtype = self._input_dtype("rhs", rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        if isinstance(precision, list):
            precision = tuple(precision)
        if precision is not None:  # as lax reads it (a preset's name too), or lax's error
            precision = canonical_precision(precision)
        if isinstance(group_sizes, ExpertExchange):
            return self._dispatched(
                lhs, rhs, group_sizes, precision, preferred_element_type, out_sharding
            )
        group_sizes = listed_sizes(group_sizes)
        experts = self._state_experts()
        check_ragged_dot_args(self._where, lhs.shape, rhs.shape, group_sizes, experts)
        out_dtype = self._output_dtype(lhs_dtype, rhs_dtype, preferred_element_type)
        explicit = explicit_mesh(lhs, rhs, group_sizes) is not None
        if out_sharding is None and explicit:
            out_sharding = rows_by_outputs(lhs, rhs)

        def compute(lhs: Array, rhs: Array, group_sizes: Any, states: Any) -> Array:
            with self._name_scope():
                return fp8_ragged_dot(
                    self.recipe,
                    precision,
                    out_dtype,
                    lhs,
                    rhs,
                    group_sizes,
                    states,
                    self.name,
                    native_choice(self.recipe, self.native_kernel),
                )

        sizes = widened_group_sizes(group_sizes)
        states = self._states()
        return on_auto_axes(
            compute, lhs, rhs, sizes, states, out_sharding=out_sharding, explicit=explicit
        )

    def _dispatched(self, lhs, rhs, plan, precision, preferred_element_type, out_sharding) -> Array:
        """Expert parallelism: `lhs` is this device's tokens, quantized here and sent in FP8
        to the devices of their experts (`plan`); returns the rows this device's experts
        received, in expert order (under Explicit axes, split as `lhs`'s rows are)."""
        check_dispatch_args(
            self._where,
            lhs.shape,
            rhs.shape,
            plan,
            self._state_experts(),
            rhs_axes=varying_axes(rhs),
        )
        out_dtype = self._output_dtype(lhs.dtype, rhs.dtype, preferred_element_type)
        explicit = explicit_mesh(lhs, rhs) is not None
        if out_sharding is None and explicit:
            out_sharding = rows_by_outputs(lhs, rhs, plan.capacity)

        def compute(lhs: Array, rhs: Array, plan: ExpertExchange, states: Any) -> Array:
            with self._name_scope():
                return fp8_dispatched_ragged_dot(
                    self.recipe,
                    precision,
                    out_dtype,
                    lhs,
                    rhs,
                    plan,
                    states,
                    self.name,
                    native_choice(self.recipe, self.native_kernel),
                )

        states = self._states()
        return on_auto_axes(
            compute, lhs, rhs, plan, states, out_sharding=out_sharding, explicit=explicit
        )

    @property
    def _where(self) -> str:
        return f"FP8 grouped layer {self.name!r}" if self.name else "Fp8RaggedDot"

    def _state_experts(self) -> int:
        """The expert count of the kernel state (the static `num_experts` unless the state was
        replaced by one for another count)."""
        shape = jnp.shape(jax.tree.leaves(self.kernel)[0])
        return shape[-1] if shape else self.num_experts

    def _merge_stats(self, new: ExpertStats, received: dict) -> ExpertStats:
        operands = merge_stats(self.stats, new, received)
        # Token counts of the step where the layer ran (zeros included: an expert that got
        # none got none).
        ran = received["input"][0]
        tokens = pick_received(self.stats.tokens, new.tokens, ran)
        return ExpertStats(operands.input, operands.kernel, operands.output_grad, tokens)

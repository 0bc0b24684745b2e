"""The dense FP8 GEMM: forward, dgrad and wgrad of any `dot_general`, and its batching rule.

Any `dot_general` is first reshaped into one canonical GEMM, `x (*B, M, K) . w (*B, N, K)`
contracted over both last axes (the layout of an `eqx.nn.Linear` weight, and of cuBLAS's FP8
"TN" GEMM), so that recipes only ever see that form; JAX differentiates the reshapes. For a
Linear they are no-ops.

The forward saves the FP8 operands and their scales; the backward quantizes the incoming
gradient and runs dgrad and wgrad as FP8 x FP8 dots. The custom_vjp around them, and how the
state leaves through the gradient, are `vjp.py`'s (shared with the grouped GEMM).

Under `jax.vmap(model)(batch)` the mapped axis folds into the GEMM (`batching.py`): into its
rows when only the activation is mapped, into its batch when both operands are.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ..core.amax import owner
from ..core.errors import OperandShapeError
from ..core.formats import transpose_in_words
from ..core.stats import Fp8Stats
from ..kernels import dispatch, partition
from ..recipes import Recipe
from ..recipes.base import QTensor, gemm_dims
from ..recipes.per_tensor import transposes_in_words_chosen
from .batching import Fold, folding_backward, folding_forward, may_fold, state_of, unbatched
from .vjp import Gemm, States, Static, fp8_gemm, prepare

#: How the errors of the shared checks name a dense layer without a name.
KIND = "Fp8DotGeneral"

Axes = tuple[int, ...]
Shape = tuple[int, ...]
DimensionNumbers = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]


class Residuals(NamedTuple):
    """What the forward of one FP8 GEMM saves for its backward: the quantized activation and
    kernel (the kernel retiled for the dgrad), the new state of both (returned as their
    cotangents), the output gradient's state as it came in, and the forward's statistics of
    the input and kernel (`None` without telemetry). Only `q_x` and `q_w` can carry a folded
    `vmap` axis."""

    q_x: Any
    q_w: Any
    new_input: Any
    new_kernel: Any
    grad_state: Any
    stats: tuple[Any, Any] | None


#: The residuals made from one operand each, in the forward's order: they carry a mapped axis
#: where their operand does. The others are state, which spans it.
_OPERAND_FIELDS = ("q_x", "q_w")


# --- canonical layout ------------------------------------------------------------------------


def normalize_dimension_numbers(
    dimension_numbers: Any, lhs_shape: Shape, rhs_shape: Shape
) -> DimensionNumbers:
    """Check `dimension_numbers` against the shapes and return it as tuples of ints (an int
    standing for one axis, as `lax.dot_general` takes it).

    Raises `OperandShapeError` (a `ValueError` and, as from lax, a `TypeError`) naming the
    offending axes and sizes.
    """

    def axis_tuple(axes: Any) -> Axes:
        if isinstance(axes, int | np.integer):
            return (operator.index(axes),)
        return tuple(operator.index(a) for a in axes)

    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (axis_tuple(axes) for axes in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise OperandShapeError(
            f"dimension_numbers={dimension_numbers!r}: should be "
            "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), each a tuple of ints "
            "(or an int, for one axis)."
        ) from None
    for name, axes, shape in (("lhs", lc + lb, lhs_shape), ("rhs", rc + rb, rhs_shape)):
        if len(set(axes)) != len(axes) or any(not 0 <= a < len(shape) for a in axes):
            raise OperandShapeError(
                f"dimension_numbers={dimension_numbers!r}: {name} axes {axes} must be distinct "
                f"and within range for {name} shape {shape}."
            )
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(la) != len(ra):
            raise OperandShapeError(
                f"dimension_numbers={dimension_numbers!r}: {len(la)} lhs {kind} axes but "
                f"{len(ra)} rhs {kind} axes."
            )
        for a, b in zip(la, ra, strict=True):
            if lhs_shape[a] != rhs_shape[b]:
                raise OperandShapeError(
                    f"Mismatched shapes for dot_general: lhs {lhs_shape} axis {a} has size "
                    f"{lhs_shape[a]} but rhs {rhs_shape} axis {b} has size {rhs_shape[b]} "
                    f"({kind} axes must match)."
                )
    return (lc, rc), (lb, rb)


class Layout(NamedTuple):
    """How a `dot_general` maps onto the canonical GEMM `(*B, M, K) . (*B, N, K)`."""

    lhs_perm: Axes
    rhs_perm: Axes
    batch: Shape
    lhs_free: Shape
    rhs_free: Shape
    contract: Shape

    @classmethod
    def of(cls, dims: DimensionNumbers, lhs_shape: Shape, rhs_shape: Shape) -> Layout:
        (lc, rc), (lb, rb) = dims
        lf = tuple(a for a in range(len(lhs_shape)) if a not in lc + lb)
        rf = tuple(a for a in range(len(rhs_shape)) if a not in rc + rb)
        return cls(
            lhs_perm=lb + lf + lc,
            rhs_perm=rb + rf + rc,
            batch=tuple(lhs_shape[a] for a in lb),
            lhs_free=tuple(lhs_shape[a] for a in lf),
            rhs_free=tuple(rhs_shape[a] for a in rf),
            contract=tuple(lhs_shape[a] for a in lc),
        )

    def _lead(self) -> Shape:
        return (math.prod(self.batch),) if self.batch else ()

    def lhs(self, lhs: Array) -> Array:
        x = jnp.transpose(lhs, self.lhs_perm)
        return x.reshape(self._lead() + (math.prod(self.lhs_free), math.prod(self.contract)))

    def rhs(self, rhs: Array) -> Array:
        w = jnp.transpose(rhs, self.rhs_perm)
        return w.reshape(self._lead() + (math.prod(self.rhs_free), math.prod(self.contract)))

    def out(self, out: Array) -> Array:
        return out.reshape(self.batch + self.lhs_free + self.rhs_free)


# --- the canonical GEMM, unbatched ---------------------------------------------------------


def _forward(recipe: Recipe, precision: Any, out_dtype: np.dtype, x, w, states: States):
    # Transposed copies, where the pass that quantizes an operand writes one as well.
    q_x, q_x_t, new_input = recipe.quantize_transposed(x, states.input, "input")
    q_w, q_w_t, new_kernel = recipe.quantize_transposed(w, states.kernel, "kernel")
    if recipe.weight_gather == "once" and not dispatch.per_device_gemm(q_w):
        # The kernel as the GEMM takes it (an FSDP weight gathered), a value the backward
        # keeps: a dgrad in a backward loop over layers, which cannot share the forward
        # loop's gather, then multiplies it without gathering again.
        q_w = partition.gathered_for(gemm_dims(q_x, q_w, -1, -1), q_x, q_w)
    with jax.named_scope("fwd"):
        out = recipe.dot(q_x, q_w, -1, -1, precision, out_dtype)
    # Keep what follows (a bias, an activation) out of the GEMM's epilogue: XLA's cuBLAS path
    # fuses bias + GELU with an auxiliary output into FP8 GEMMs and then fails (RET_CHECK in
    # thunk_emitter) when the GELU is rematerialized. The scales stay fused.
    out = lax.optimization_barrier(out)
    stats = None
    if states.stats is not None:
        stats = (
            recipe.statistics(x, q_x, "input", owner(states.input)),
            recipe.statistics(w, q_w, "kernel", owner(states.kernel)),
        )
    # The dgrad's copy of the kernel, laid out for its other contraction, is quantized from
    # the high-precision weight here (one rounding), not from `q_w` in the backward (two).
    q_w = recipe.retile(q_w, "kernel", -2, source=w)
    if recipe.transposed_copies:
        # Saved transposed, written by the kernel that quantizes them: the wgrad and dgrad
        # then contract both operands over their last axis, with no transpose of their own.
        q_x = q_x_t if q_x_t is not None else transposed(q_x, recipe.transposes_apart("input"))
        q_w = q_w_t if q_w_t is not None else transposed(q_w, recipe.transposes_apart("kernel"))
    return out, Residuals(
        q_x=q_x,
        q_w=q_w,
        new_input=new_input,
        new_kernel=new_kernel,
        grad_state=states.output_grad,
        stats=stats,
    )


def transposed(q: QTensor, apart: bool = False) -> QTensor:
    """A per-tensor `q (*B, R, C)` as the same values laid out `(*B, C, R)`; `apart`:
    transposed from `q`'s FP8 values behind a barrier, which XLA then writes in a pass of
    its own rather than in the pass that quantizes `q` (`Recipe.transposes_apart`), in
    32-bit words inside `transposes_in_words()`."""
    if not apart:
        return QTensor(jnp.swapaxes(q.data, -1, -2), q.scale_inv, q.block)
    data = lax.optimization_barrier(q.data)
    if transposes_in_words_chosen():
        return QTensor(transpose_in_words(data), q.scale_inv, q.block)
    return QTensor(jnp.swapaxes(data, -1, -2), q.scale_inv, q.block)


def _k_major_dot(
    recipe: Recipe,
    lhs: QTensor,
    rhs_t: QTensor,
    lhs_axis: int,
    precision: Any,
    out_dtype: Any,
    lhs_t: QTensor | None = None,
) -> Array:
    """`recipe.dot(lhs, rhs, lhs_axis, -2)` for `rhs_t`, a transposed copy of `rhs`: on GPUs
    (and TPUs) as the product of two K-major operands, which cuBLASLt takes as they are (the
    lhs transposed first when it is contracted over its rows, which XLA writes in the pass
    that quantizes it); on CPUs as the product of `lhs` and `rhs` in the canonical layout,
    `rhs` behind a barrier, where XLA folds the transposes away: the order in which a CPU
    dot sums its terms follows its operands' layouts, and so the numbers stay those of the
    untransposed product, the same for a kernel given as `(out, in)` or `(in, out)`. `lhs_t`:
    `lhs` transposed, where the pass that quantized it wrote that copy too."""

    def k_major(lhs: QTensor, rhs_t: QTensor, lhs_t: QTensor | None) -> Array:
        # An lhs contracted over its rows is the wgrad's output gradient.
        if lhs_axis == -2:
            apart = recipe.transposes_apart("output_grad")
            lhs = lhs_t if lhs_t is not None else transposed(lhs, apart)
        return recipe.dot(lhs, rhs_t, -1, -1, precision, out_dtype)

    def canonical(lhs: QTensor, rhs_t: QTensor, lhs_t: QTensor | None) -> Array:
        del lhs_t
        rhs = lax.optimization_barrier(transposed(rhs_t))
        return recipe.dot(lhs, rhs, lhs_axis, -2, precision, out_dtype)

    return lax.platform_dependent(lhs, rhs_t, lhs_t, cpu=canonical, default=k_major)


def _backward(
    recipe: Recipe, lhs_dtype: np.dtype, rhs_dtype: np.dtype, residuals: Residuals, g: Array
):
    grad_state, stats = residuals.grad_state, residuals.stats
    q_x, q_w = residuals.q_x, residuals.q_w
    flipped = recipe.transposed_copies
    # cuBLASLt's FP8 GEMM takes both operands K-major, so the wgrad needs the activation and
    # the output gradient transposed, and the dgrad the kernel. Recipes with
    # `transposed_copies` save the activation and kernel transposed, written by the kernels
    # that quantize them (the untransposed copy dies with the forward GEMM), and transpose
    # the gradient in the pass that quantizes it: no barrier may separate those passes from
    # their transposes (a barrier on a transposed copy would keep it untransposed in front
    # of the barrier, by XLA's layout assignment, and transpose it behind). Without the
    # barriers that once held the backward's transposes (and the wgrad) back, XLA's own
    # schedule measured lower in temp memory (benchmarks/memory_sweep.py: median 0.94x
    # BF16's against 1.00x). For the others (block recipes) the saved activation goes
    # through a barrier: XLA would otherwise compute its retiled copy in the forward, fused
    # with the quantization, and keep both alive until the backward.
    if not flipped:
        q_x = lax.optimization_barrier(q_x)
    # On a mesh that XLA partitions, the kernel reaches the dgrad as the very value the
    # forward multiplied: the all-gather XLA inserts for the forward (an FSDP weight) then
    # serves the dgrad too, where behind a barrier it would be a new value, gathered again
    # (`weight_gather="per_gemm"`). One barrier per operand: a barrier keeps all its operands
    # alive until its results are used.
    if recipe.weight_gather == "per_gemm" or (not flipped and dispatch.per_device_gemm(q_w)):
        q_w = lax.optimization_barrier(q_w)
    back = recipe.backward_dot_precision()
    # dgrad: g (*B, M, N) . w (*B, N, K) over N; wgrad: g . x (*B, M, K) over the tokens M.
    q_g_t = None  # the gradient transposed for the wgrad, where its quantization wrote it
    if flipped:
        q_g, q_g_t, new_grad = recipe.quantize_transposed(g, grad_state, "output_grad")
    else:  # the gradient for the dgrad, and laid out for the wgrad (one pass where it can)
        q_g, q_g_rows, new_grad = recipe.quantize_both(g, grad_state, "output_grad")
    if stats is not None:
        grad_stats = recipe.statistics(g, q_g, "output_grad", owner(grad_state))
        stats = Fp8Stats(*stats, grad_stats)
    with jax.named_scope("dgrad"):
        if flipped:
            d_x = _k_major_dot(recipe, q_g, q_w, -1, back, lhs_dtype)
        else:
            d_x = recipe.dot(q_g, recipe.retile(q_w, "kernel", -2), -1, -2, back, lhs_dtype)
    with jax.named_scope("wgrad"):
        if flipped:
            d_w = _k_major_dot(recipe, q_g, q_x, -2, back, rhs_dtype, q_g_t)
        else:
            d_w = recipe.dot(q_g_rows, recipe.retile(q_x, "input", -2), -2, -2, back, rhs_dtype)
    return d_x, d_w, States(residuals.new_input, residuals.new_kernel, new_grad, stats)


# --- folding a vmapped axis into the GEMM --------------------------------------------------


def _fold(a: Array, how: str, flipped: bool = False) -> Array:
    """`a (v, *B, R, C)` with the mapped axis `v` folded into its rows or its batch (into
    its columns instead of its rows for an operand saved `flipped`, i.e. transposed)."""
    if how == "rows":
        if flipped:
            a = jnp.moveaxis(a, 0, -2)
            return a.reshape(a.shape[:-2] + (a.shape[-2] * a.shape[-1],))
        a = jnp.moveaxis(a, 0, -3)
        return a.reshape(a.shape[:-3] + (a.shape[-3] * a.shape[-2], a.shape[-1]))
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]) if a.ndim == 4 else a


def _unfold(a: Array, how: str, size: int, had_batch: bool, flipped: bool = False) -> Array:
    """Undo `_fold`: the mapped axis of size `size` back in front."""
    if how == "rows":
        if flipped:
            a = a.reshape(a.shape[:-1] + (size, a.shape[-1] // size))
            return jnp.moveaxis(a, -2, 0)
        a = a.reshape(a.shape[:-2] + (size, a.shape[-2] // size, a.shape[-1]))
        return jnp.moveaxis(a, -3, 0)
    return a.reshape((size, a.shape[0] // size) + a.shape[1:]) if had_batch else a


def _unfold_tensor(q: Any, how: str, size: int, had_batch: bool, rank: int, flipped: bool):
    """Unfold the leaves of a quantized operand that span its rows (data, block scales);
    per-tensor scales stay as they are. Returns the tensor and its leaves' batched flags."""

    def spans(leaf: Array) -> bool:
        return leaf.ndim == rank

    out = jax.tree.map(lambda a: _unfold(a, how, size, had_batch, flipped) if spans(a) else a, q)
    return out, jax.tree.map(spans, q)


def _fold_tensor(q: Any, batched: Any, how: str, flipped: bool) -> Any:
    return jax.tree.map(lambda a, b: _fold(a, how, flipped) if b else a, q, batched)


def _how_to_fold(axis_size: int, x_batched: bool, w_batched: bool, states_batched: Any):
    """How the mapped axis folds into the GEMM ("rows" or "batch"), or `None` to map the GEMM
    per example. An empty mapped axis is mapped: a fold could not be undone (nothing tells
    how many rows each of no members had)."""
    if not may_fold(x_batched, states_batched) or axis_size == 0:
        return None
    return "batch" if w_batched else "rows"


def _refuse_forward(name: str, in_batched: list, x, w, states) -> None:
    """A mapping the forward cannot take, folded or mapped per member (per-example
    gradients): a mapped kernel with one error-feedback state for all members."""
    del x, w
    _, w_b, states_b = in_batched
    if w_b and getattr(states.kernel, "error", None) is not None and not states_b.kernel.error:
        # Folded, the one (N, K) error would be broadcast over the kernels; mapped, each
        # member's new error would be another.
        layer = f"FP8 layer {name!r}" if name else "Fp8DotGeneral"
        raise ValueError(
            f"{layer}: ResidualFP8(error_feedback=True): a kernel mapped by vmap with the "
            "layer's state shared by the members holds several kernels, but the state one "
            "kernel's error. Map the layer too, a state per member (eqx.filter_vmap over the "
            "layer, its state stacked), or use another recipe for it."
        )


def _fold_forward(flipped: bool, axis_size: int, in_batched: list, x, w, states) -> Fold | None:
    """The forward's fold: the operands' mapped axis into the GEMM, then out of the output
    and the saved operands (`_refuse_forward` has checked the mapping)."""
    x_b, w_b, states_b = in_batched
    how = _how_to_fold(axis_size, x_b, w_b, states_b)
    if how is None:
        return None
    had_batch = x.ndim == 4
    x, w = _fold(x, how), (_fold(w, how) if w_b else w)
    rank = x.ndim

    def unfold(outs: tuple[Array, Residuals]):
        out, residuals = outs
        out = _unfold(out, how, axis_size, had_batch)
        # Only the operands carry the mapped axis; the state and its statistics span it.
        flags = unbatched(residuals)
        q_x, q_x_b = _unfold_tensor(residuals.q_x, how, axis_size, had_batch, rank, flipped)
        residuals, flags = residuals._replace(q_x=q_x), flags._replace(q_x=q_x_b)
        if w_b:
            q_w, q_w_b = _unfold_tensor(residuals.q_w, how, axis_size, had_batch, rank, flipped)
            residuals, flags = residuals._replace(q_w=q_w), flags._replace(q_w=q_w_b)
        return (out, residuals), (True, flags)

    return (x, w, states), unfold


def _fold_backward(
    flipped: bool, axis_size: int, in_batched: list, residuals: Residuals, g
) -> Fold | None:
    """The backward's fold: the mapped axis of the saved operands and the gradient into the
    GEMM, then out of dgrad (and of wgrad when the kernel was mapped)."""
    res_b, g_b = in_batched
    x_b, w_b = any(jax.tree.leaves(res_b.q_x)), any(jax.tree.leaves(res_b.q_w))
    how = _how_to_fold(axis_size, x_b, w_b, state_of(res_b, _OPERAND_FIELDS)) if g_b else None
    if how is None:
        return None
    had_batch = g.ndim == 4
    folded = residuals._replace(
        q_x=_fold_tensor(residuals.q_x, res_b.q_x, how, flipped),
        q_w=_fold_tensor(residuals.q_w, res_b.q_w, how, flipped),
    )

    def unfold(outs: tuple[Array, Array, States]):
        d_x, d_w, new_states = outs
        d_x = _unfold(d_x, how, axis_size, had_batch)
        d_w = _unfold(d_w, how, axis_size, had_batch) if w_b else d_w
        return (d_x, d_w, new_states), (True, w_b, unbatched(new_states))

    return (folded, _fold(g, how)), unfold


def _gemm(recipe: Recipe, precision: Any, static: Static) -> Gemm:
    """The dense GEMM of one call, for the shared custom_vjp."""
    forward = functools.partial(_forward, recipe, precision, static.out)
    backward = functools.partial(_backward, recipe, *static.gradient_dtypes())
    flipped = recipe.transposed_copies
    return Gemm(
        recipe,
        folding_forward(
            forward,
            functools.partial(_fold_forward, flipped),
            Residuals,
            _OPERAND_FIELDS,
            static.gradient_vmaps,
            functools.partial(_refuse_forward, static.name),
        ),
        folding_backward(
            backward,
            functools.partial(_fold_backward, flipped),
            _OPERAND_FIELDS,
            static.gradient_vmaps,
        ),
    )


def _check_kernel_state(state: Any, layout: Layout, name: str) -> None:
    """Kernel-shaped state (error feedback) must match the kernel of this call."""
    error = getattr(state, "error", None)
    want = (math.prod(layout.rhs_free), math.prod(layout.contract))
    layer = f"FP8 layer {name!r}" if name else "Fp8DotGeneral"
    if error is not None and layout.batch:
        # One (N, K) error cannot hold those of a kernel per batch member: broadcast, it
        # would feed one member's error to all, and its update fail the backward.
        raise ValueError(
            f"{layer}: the kernel of this call has dot_general batch dimensions of sizes "
            f"{layout.batch} (one matrix per batch entry), but its error-feedback state holds "
            f"one (out, in) matrix's error, {tuple(error.shape[-2:])}. Use another recipe for "
            "it, or give each batch entry a layer of its own (vmap the layer with its state)."
        )
    if error is not None and tuple(error.shape[-2:]) != want:
        raise ValueError(
            f"{layer}: its state was made for kernel_shape {tuple(error.shape[-2:])} but the "
            f"kernel of this call is {want} as a matrix (out, in: contracted axes last); "
            f"build the layer with kernel_shape={want}."
        )


def fp8_dot_general(
    recipe: Recipe,
    dimension_numbers: DimensionNumbers,
    precision: Any,
    out_dtype: np.dtype,
    lhs: Array,
    rhs: Array,
    states: States,
    name: str = "",
) -> Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` as FP8 GEMMs under `recipe`.

    Differentiating it computes dgrad and wgrad in FP8 and returns the new `states` as their
    cotangent, in the dtype `states` came in. `name` names the layer in errors.
    """
    (lhs, rhs), static = prepare((lhs, rhs), states, out_dtype, name, KIND)
    layout = Layout.of(dimension_numbers, lhs.shape, rhs.shape)
    _check_kernel_state(states.kernel, layout, name)
    gemm = _gemm(recipe, precision, static)
    # Named for the backward: the transposes of these layout changes lay out the dgrad's and
    # the wgrad's outputs, and a GEMM into which XLA folds such a transpose takes its name.
    with jax.named_scope("dgrad"):
        x = layout.lhs(lhs)
    with jax.named_scope("wgrad"):
        w = layout.rhs(rhs)
    return layout.out(fp8_gemm(gemm, static, x, w, (), states))

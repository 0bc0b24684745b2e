"""The FP8 GEMM paths: forward, dgrad and wgrad, owned by one `jax.custom_vjp`.

Any `dot_general` is first reshaped into one canonical GEMM, `x (*B, M, K) . w (*B, N, K)`
contracted over both last axes (the layout of an `eqx.nn.Linear` weight, and of cuBLAS's FP8
"TN" GEMM), so that recipes only ever see that form; JAX differentiates the reshapes. For a
Linear they are no-ops.

Residuals saved for the backward pass are the FP8 operands and their scales, never a
high-precision copy. The backward quantizes the incoming gradient and runs dgrad and wgrad as
FP8 x FP8 dots. The state of the three operands enters as a differentiable argument; its
cotangent is its new value ("gradient hijack"), in the dtype the state came in (float32, or
the max-combining dtype of `fp8jax._src.core.jax_private`).

Under `jax.vmap(model)(batch)` JAX would run the forward and backward once per example: the
wgrad of an unbatched weight would become a batched outer product, summed afterwards, not a
GEMM, and block recipes would see one token at a time. Custom batching rules fold the mapped
axis into the GEMM instead (into its rows when only the activation is mapped, into its batch
when both operands are), so the wgrad is one FP8 GEMM over all tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ..core import jax_private
from ..core.errors import StateNotDifferentiatedError, StateUsedTwiceError
from ..core.remat import name_fp8_operands, name_gemm_output
from ..core.stats import Fp8Stats
from ..recipes import Recipe

Axes = tuple[int, ...]
Shape = tuple[int, ...]
DimensionNumbers = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]

_PER_EXAMPLE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fp8jax_per_example", default=False
)


@contextlib.contextmanager
def per_example_gradients() -> Iterator[None]:
    """Trace gradients per example: never fold a `vmap`ped axis into a GEMM.

    Folding is what makes `grad(vmap(model))` run its wgrad as one GEMM; under
    `vmap(grad(...))` (per-example gradients) it would sum what must stay per example.
    [`fp8jax.filter_value_and_grad`][] enters this when it is itself being vmapped.
    """
    token = _PER_EXAMPLE.set(True)
    try:
        yield
    finally:
        _PER_EXAMPLE.reset(token)


class States(NamedTuple):
    """The state of the three operands of one FP8 GEMM, and their statistics (`None` when
    the layer keeps no telemetry)."""

    input: Any
    kernel: Any
    output_grad: Any
    stats: Fp8Stats | None = None


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


def _owner(state: Any) -> Array:
    return jax.tree.leaves(state)[0]


# --- canonical layout ------------------------------------------------------------------------


def normalize_dimension_numbers(
    dimension_numbers: Any, lhs_shape: Shape, rhs_shape: Shape
) -> DimensionNumbers:
    """Check `dimension_numbers` against the shapes and return it as tuples of ints.

    Raises `ValueError` naming the offending axes and sizes.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(operator.index(a) for a in axes) for axes in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            f"dimension_numbers={dimension_numbers!r}: should be "
            "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), each a tuple of ints."
        ) from None
    for name, axes, shape in (("lhs", lc + lb, lhs_shape), ("rhs", rc + rb, rhs_shape)):
        if len(set(axes)) != len(axes) or any(not 0 <= a < len(shape) for a in axes):
            raise ValueError(
                f"dimension_numbers={dimension_numbers!r}: {name} axes {axes} must be distinct "
                f"and within range for {name} shape {shape}."
            )
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(la) != len(ra):
            raise ValueError(
                f"dimension_numbers={dimension_numbers!r}: {len(la)} lhs {kind} axes but "
                f"{len(ra)} rhs {kind} axes."
            )
        for a, b in zip(la, ra, strict=True):
            if lhs_shape[a] != rhs_shape[b]:
                raise ValueError(
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
    q_x, new_input = recipe.quantize(x, states.input, "input", -1)
    q_w, new_kernel = recipe.quantize(w, states.kernel, "kernel", -1)
    with jax.named_scope("fwd"):
        out = recipe.dot(q_x, q_w, -1, -1, precision, out_dtype)
    # Keep what follows (a bias, an activation) out of the GEMM's epilogue: XLA's cuBLAS path
    # fuses bias + GELU with an auxiliary output into FP8 GEMMs and then fails (RET_CHECK in
    # thunk_emitter) when the GELU is rematerialized. The scales stay fused.
    out = lax.optimization_barrier(out)
    stats = None
    if states.stats is not None:
        stats = (
            recipe.statistics(x, q_x, "input", _owner(states.input)),
            recipe.statistics(w, q_w, "kernel", _owner(states.kernel)),
        )
    # The dgrad's copy of the kernel, laid out for its other contraction, is quantized from
    # the high-precision weight here (one rounding), not from `q_w` in the backward (two).
    q_w = recipe.retile(q_w, "kernel", -2, source=w)
    return out, Residuals(
        q_x=q_x,
        q_w=q_w,
        new_input=new_input,
        new_kernel=new_kernel,
        grad_state=states.output_grad,
        stats=stats,
    )


def _typed_like_a_barrier(values: Any) -> Any:
    """`values` unchanged, typed as `lax.optimization_barrier` types them: inside `shard_map`
    its results vary over every manual axis any operand varies over, and the branches of
    `lax.platform_dependent` must agree on that."""
    leaves = jax.tree.leaves(values)
    axes = frozenset().union(*(jax_private.varying_axes(a) for a in leaves))

    def vary(a: Array) -> Array:
        missing = tuple(sorted(axes - jax_private.varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(vary, values)


def _backward(
    recipe: Recipe, lhs_dtype: np.dtype, rhs_dtype: np.dtype, residuals: Residuals, g: Array
):
    grad_state, stats = residuals.grad_state, residuals.stats
    # cuBLASLt's FP8 GEMM takes both operands K-major, so the wgrad needs the saved activation
    # transposed (and the dgrad the kernel). Without a barrier XLA computes that copy in the
    # forward, fused with the quantization, and keeps both FP8 layouts alive until the
    # backward: as much memory as one BF16 copy. Behind it, the copy is made here, from the
    # saved FP8 values. One barrier per operand: a barrier keeps all its operands alive until
    # its results are used, so a kernel copy that no dgrad reads (that of a first layer, whose
    # input needs no gradient) would stay alive with the activation until the wgrad.
    q_x, q_w = lax.optimization_barrier(residuals.q_x), lax.optimization_barrier(residuals.q_w)
    back = recipe.backward_dot_precision()
    # dgrad: g (*B, M, N) . w (*B, N, K) over N; wgrad: g . x (*B, M, K) over the tokens M.
    q_g, new_grad = recipe.quantize(g, grad_state, "output_grad", -1)
    if stats is not None:
        grad_stats = recipe.statistics(g, q_g, "output_grad", _owner(grad_state))
        stats = Fp8Stats(*stats, grad_stats)
    with jax.named_scope("dgrad"):
        d_x = recipe.dot(q_g, recipe.retile(q_w, "kernel", -2), -1, -2, back, lhs_dtype)
    q_g, _ = recipe.quantize(g, grad_state, "output_grad", -2)
    if recipe.dgrad_before_wgrad:
        # The wgrad waits for the dgrad. Left to itself, XLA's scheduler orders them by its
        # own memory estimate, which does not know that buffer assignment places temporaries
        # in the step's output buffers until those are written: on the MLP of
        # benchmarks/peers.py it ran the wgrad and the weight update (into an output buffer)
        # first, with the dgrad's operands and the previous layer's residuals still alive,
        # and peaked there. Without the barrier, XLA also makes the wgrad's transposed copy of
        # the FP8 gradient in the pass that quantizes it and keeps both layouts alive through
        # the dgrad; behind it, the copy is made when the wgrad needs it.
        # On a CPU, where memory is not the constraint, the order only costs time (about 5 %
        # of the tiny GPT's step in benchmarks/step_overhead.py): there the barrier is left out.
        d_x, q_g, q_x = lax.platform_dependent(
            (d_x, q_g, q_x), cpu=_typed_like_a_barrier, default=lax.optimization_barrier
        )
    with jax.named_scope("wgrad"):
        d_w = recipe.dot(q_g, recipe.retile(q_x, "input", -2), -2, -2, back, rhs_dtype)
    return d_x, d_w, States(residuals.new_input, residuals.new_kernel, new_grad, stats)


# --- folding a vmapped axis into the GEMM --------------------------------------------------


def _merge(a: Array, how: str) -> Array:
    """`a (v, *B, R, C)` with the mapped axis `v` folded into its rows or its batch."""
    if how == "rows":
        a = jnp.moveaxis(a, 0, -3)
        return a.reshape(a.shape[:-3] + (a.shape[-3] * a.shape[-2], a.shape[-1]))
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]) if a.ndim == 4 else a


def _unmerge(a: Array, how: str, size: int, had_batch: bool) -> Array:
    """Undo `_merge`: the mapped axis of size `size` back in front."""
    if how == "rows":
        a = a.reshape(a.shape[:-2] + (size, a.shape[-2] // size, a.shape[-1]))
        return jnp.moveaxis(a, -3, 0)
    return a.reshape((size, a.shape[0] // size) + a.shape[1:]) if had_batch else a


def _unmerge_tensor(q: Any, how: str, size: int, had_batch: bool, rank: int):
    """Unmerge the leaves of a quantized operand that span its rows (data, block scales);
    per-tensor scales stay as they are. Returns the tensor and its leaves' batched flags."""

    def spans(leaf: Array) -> bool:
        return leaf.ndim == rank

    out = jax.tree.map(lambda a: _unmerge(a, how, size, had_batch) if spans(a) else a, q)
    return out, jax.tree.map(spans, q)


def _merge_tensor(q: Any, batched: Any, how: str) -> Any:
    return jax.tree.map(lambda a, b: _merge(a, how) if b else a, q, batched)


def _fold(axis_size: int, x_batched: bool, w_batched: bool, states_batched: Any) -> str | None:
    """How the mapped axis folds into the GEMM ("rows" or "batch"), or `None` to map the GEMM
    per example. An empty mapped axis is mapped: a fold could not be undone (nothing tells
    how many rows each of no members had)."""
    if _PER_EXAMPLE.get() or any(jax.tree.leaves(states_batched)) or not x_batched:
        return None
    if axis_size == 0:
        return None
    return "batch" if w_batched else "rows"


def _axes(batched: Any) -> Any:
    return jax.tree.map(lambda b: 0 if b else None, batched)


def _axis(batched: bool) -> int | None:
    return 0 if batched else None


def _batched(out_axes: Any, outs: Any) -> Any:
    """Per-leaf batched flags of `outs` from a (prefix) tree of vmap `out_axes`."""
    return jax.tree.map(
        lambda axis, sub: jax.tree.map(lambda _: axis is not None, sub),
        out_axes,
        outs,
        is_leaf=lambda a: a is None or isinstance(a, int),
    )


def _folding_forward(recipe: Recipe, precision: Any, out_dtype: np.dtype):
    raw = functools.partial(_forward, recipe, precision, out_dtype)

    @custom_vmap
    def forward(x, w, states):
        return raw(x, w, states)

    @forward.def_vmap
    def _rule(axis_size, in_batched, x, w, states):
        x_b, w_b, states_b = in_batched
        how = _fold(axis_size, x_b, w_b, states_b)
        if how is None:
            # Per example. Unbatched state stays unbatched (its amaxes span the mapped axis),
            # and so does an operand that depends only on unbatched values.
            s = any(jax.tree.leaves(states_b))
            residual_axes = Residuals(**dict.fromkeys(Residuals._fields, _axis(s)))
            out_axes = (0, residual_axes._replace(q_x=_axis(x_b or s), q_w=_axis(w_b or s)))
            outs = jax.vmap(raw, in_axes=_axes(in_batched), out_axes=out_axes)(x, w, states)
            return outs, _batched(out_axes, outs)
        had_batch = x.ndim == 4
        x, w = _merge(x, how), (_merge(w, how) if w_b else w)
        out, residuals = forward(x, w, states)
        rank = x.ndim
        out = _unmerge(out, how, axis_size, had_batch)
        # Only the operands carry the mapped axis; the state and its statistics span it.
        flags = jax.tree.map(lambda _: False, residuals)
        q_x, q_x_b = _unmerge_tensor(residuals.q_x, how, axis_size, had_batch, rank)
        residuals, flags = residuals._replace(q_x=q_x), flags._replace(q_x=q_x_b)
        if w_b:
            q_w, q_w_b = _unmerge_tensor(residuals.q_w, how, axis_size, had_batch, rank)
            residuals, flags = residuals._replace(q_w=q_w), flags._replace(q_w=q_w_b)
        return (out, residuals), (True, flags)

    return forward


def _folding_backward(recipe: Recipe, lhs_dtype: np.dtype, rhs_dtype: np.dtype):
    raw = functools.partial(_backward, recipe, lhs_dtype, rhs_dtype)

    @custom_vmap
    def backward(residuals, g):
        return raw(residuals, g)

    @backward.def_vmap
    def _rule(axis_size, in_batched, residuals, g):
        res_b, g_b = in_batched
        x_b, w_b = any(jax.tree.leaves(res_b.q_x)), any(jax.tree.leaves(res_b.q_w))
        states_b = res_b._replace(q_x=False, q_w=False)  # everything but the operands
        how = _fold(axis_size, x_b, w_b, states_b) if g_b else None
        if how is None:
            out_axes = (0, 0, _axis(any(jax.tree.leaves(states_b))))
            outs = jax.vmap(raw, in_axes=_axes(in_batched), out_axes=out_axes)(residuals, g)
            return outs, _batched(out_axes, outs)
        had_batch = g.ndim == 4
        merged = residuals._replace(
            q_x=_merge_tensor(residuals.q_x, res_b.q_x, how),
            q_w=_merge_tensor(residuals.q_w, res_b.q_w, how),
        )
        d_x, d_w, new_states = backward(merged, _merge(g, how))
        d_x = _unmerge(d_x, how, axis_size, had_batch)
        d_w = _unmerge(d_w, how, axis_size, had_batch) if w_b else d_w
        flags = (True, w_b, jax.tree.map(lambda _: False, new_states))
        return (d_x, d_w, new_states), flags

    return backward


# --- the custom_vjp ------------------------------------------------------------------------


def _as_f32(tree: Any) -> Any:
    return jax.tree.map(jax_private.to_float32, tree)


class Static(NamedTuple):
    """What the custom_vjp needs to know about one call beyond its arrays (hashable)."""

    lhs: np.dtype
    rhs: np.dtype
    out: np.dtype
    max_combining: bool
    mesh_axes: tuple[frozenset[str], frozenset[str], frozenset[str]]
    name: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gemm(recipe: Recipe, precision: Any, static: Static, x: Array, w: Array, states: States):
    out = _folding_forward(recipe, precision, static.out)(x, w, _as_f32(states))[0]
    return name_gemm_output(out)


def _check_state_differentiated(
    recipe: Recipe, static: Static, x, w, states, kind: str = "Fp8DotGeneral"
) -> None:
    """Raise if gradients flow through this GEMM while its state, which its numerics read,
    is not differentiated: its new value could not leave the step, and the scales would stay
    as they are forever. `kind` names a layer without a name."""
    leaves = jax.tree.leaves(states)
    if not recipe.reads_state or any(leaf.perturbed for leaf in leaves):
        return
    if not (x.perturbed or w.perturbed):
        return
    layer = f"FP8 layer {static.name!r}" if static.name else f"An {kind}"
    raise StateNotDifferentiatedError(
        f"{layer} ({type(recipe).__name__}) is differentiated, but its FP8 state is not: its "
        "new scales and amax history leave the step as the state's gradient, so they would "
        "stay as they are forever (a fresh layer's scale of 1.0 saturates large values and "
        "flushes small gradients to zero). Differentiate the state along with the weights: "
        "with a filter_spec, `filter_spec = fp8jax.with_fp8_state(filter_spec, model)`; "
        "with jax.grad, pass the layer (or model) as a differentiated argument, e.g. "
        "`fp8jax.filter_grad(loss)(model, x)` (gradients you do not use cost nothing under "
        "jit). Recipes that keep no state between steps (CurrentScaling, BlockwiseScaling, "
        "MXFP8) do not need it.",
        static.name,
    )


def _gemm_fwd(recipe, precision, static, x, w, states):
    # Called with `CustomVJPPrimal`s (symbolic_zeros=True): values and whether they are
    # differentiated.
    _check_state_differentiated(recipe, static, x, w, states)
    x, w, states = x.value, w.value, jax.tree.map(lambda p: p.value, states)
    # Residuals stay float32: under an eager `grad` they may leave the jitted function.
    out, res = _folding_forward(recipe, precision, static.out)(x, w, _as_f32(states))
    # Named here, outside the custom_vmap (opaque to jax.checkpoint policies).
    res = res._replace(q_x=name_fp8_operands(res.q_x), q_w=name_fp8_operands(res.q_w))
    return name_gemm_output(out), res


def _reduce_to(a: Array, axes: frozenset[str], reduce: Any) -> Array:
    """`a` reduced over the manual mesh axes it varies on beyond `axes` (inside `shard_map`,
    the gradient of a replicated input is summed over the devices, as JAX's own rules do)."""
    extra = tuple(sorted(jax_private.varying_axes(a) - axes))
    return reduce(a, extra) if extra else a


def _gemm_bwd(recipe, precision, static, residuals, g):
    del precision
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(g.shape, g.dtype)
    d_x, d_w, new_states = _folding_backward(recipe, static.lhs, static.rhs)(residuals, g)
    lhs_axes, rhs_axes, state_axes = static.mesh_axes
    d_x = _reduce_to(d_x, lhs_axes, lax.psum)
    d_w = _reduce_to(d_w, rhs_axes, lax.psum)
    # Replicated state takes the largest amax of all devices, never their sum.
    new_states = jax.tree.map(lambda a: _reduce_to(a, state_axes, lax.pmax), new_states)
    convert = jax_private.to_max_combining if static.max_combining else jax_private.to_float32
    return d_x, d_w, jax.tree.map(convert, new_states)


_gemm.defvjp(_gemm_fwd, _gemm_bwd, symbolic_zeros=True)


def _check_kernel_state(state: Any, layout: Layout, name: str) -> None:
    """Kernel-shaped state (error feedback) must match the kernel of this call."""
    error = getattr(state, "error", None)
    want = (math.prod(layout.rhs_free), math.prod(layout.contract))
    if error is not None and tuple(error.shape[-2:]) != want:
        layer = f"FP8 layer {name!r}" if name else "Fp8DotGeneral"
        raise ValueError(
            f"{layer}: its state was made for kernel_shape {tuple(error.shape[-2:])} but the "
            f"kernel of this call is {want} as a matrix (out, in: contracted axes last); "
            f"build the layer with kernel_shape={want}."
        )


# The FP8 state each differentiation has seen enter a GEMM: trace -> {id(leaf): weak ref}.
# Weak both ways: a tracer refers to its trace, so a strong one would keep the key alive.
_USES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_single_use(leaves: list, name: str, kind: str = "Fp8DotGeneral") -> None:
    """Raise if this FP8 state already entered a GEMM under the same differentiation.

    JAX adds the cotangents of a value used twice; for FP8 state, whose cotangent is its new
    value, that adds the amaxes of the two uses (and their scales). Only the max-combining
    view of [`fp8jax.filter_value_and_grad`][] combines them correctly. Seen at trace time:
    the same state leaf, a tracer of the same reverse-mode trace, reaching two GEMMs. `kind`
    names a layer without a name.
    """
    leaf = leaves[0]
    trace = jax_private.differentiation_trace(leaf)
    if trace is None:
        return
    seen = _USES.setdefault(trace, {})
    earlier = seen.get(id(leaf))
    if earlier is not None and earlier() is leaf:
        layer = f"FP8 layer {name!r}" if name else f"An {kind}"
        raise StateUsedTwiceError(
            f"{layer} runs twice in one differentiated step (a shared or reused layer), "
            "under a gradient that would add its two amaxes and scales instead of keeping the "
            "larger: JAX sums the gradients of a value used twice, and FP8 state leaves the "
            "step through its gradient. Use fp8jax.filter_value_and_grad / fp8jax.filter_grad "
            "(drop-in for Equinox's) or fp8jax.make_train_step, which combine the uses by max; "
            "with plain jax.grad, view the model with fp8jax.combine_by_max inside the "
            "differentiated function.",
            name,
        )
    seen[id(leaf)] = weakref.ref(leaf)


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
    # JAX 0.10 asserts ("non-canonical constant") when a vmapped NumPy constant reaches a
    # custom_vjp inside jit; a copy (elided by XLA) makes it a traced value first.
    lhs, rhs = (
        jnp.array(a, copy=True) if jax_private.is_batch_tracer(a) else a for a in (lhs, rhs)
    )
    leaves = jax.tree.leaves(states)
    max_combining = any(jax_private.is_max_combining(a) for a in leaves)
    if max_combining and not all(jax_private.is_max_combining(a) for a in leaves):
        raise ValueError("FP8 state mixes max-combining and float32 leaves.")
    if not max_combining:
        _check_single_use(leaves, name)
    layout = Layout.of(dimension_numbers, lhs.shape, rhs.shape)
    _check_kernel_state(states.kernel, layout, name)
    mesh_axes = (
        jax_private.varying_axes(lhs),
        jax_private.varying_axes(rhs),
        frozenset().union(*(jax_private.varying_axes(a) for a in leaves)),
    )
    static = Static(
        np.dtype(lhs.dtype),
        np.dtype(rhs.dtype),
        np.dtype(out_dtype),
        max_combining,
        mesh_axes,
        name,
    )
    out = _gemm(recipe, precision, static, layout.lhs(lhs), layout.rhs(rhs), states)
    return layout.out(out)

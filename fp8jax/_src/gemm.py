"""The FP8 GEMM paths: forward, dgrad and wgrad, owned by one `jax.custom_vjp`.

Residuals saved for the backward pass are the FP8 operands and their scales, never a
high-precision copy. The backward quantizes the incoming gradient and runs dgrad and wgrad as
FP8 x FP8 dots. Any `dimension_numbers` work: the transposes are derived, not assumed 2-D.

The state of the three operands enters as a differentiable argument; its cotangent is its new
value ("gradient hijack"). It may arrive as float32 or as the max-combining dtype of
`fp8jax._src.jax_private`, and its cotangent leaves in the dtype it came in.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from . import jax_private
from .recipes import QTensor, Recipe, TensorState

Axes = tuple[int, ...]
DimensionNumbers = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]


_PER_EXAMPLE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fp8jax_per_example", default=False
)


@contextlib.contextmanager
def per_example_gradients() -> Iterator[None]:
    """Trace gradients per example: never fold a `vmap`ped axis into a backward GEMM.

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
    """The state of the three operands of one FP8 GEMM."""

    input: TensorState
    kernel: TensorState
    output_grad: TensorState


def normalize_dimension_numbers(
    dimension_numbers: Any, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]
) -> DimensionNumbers:
    """Check `dimension_numbers` against the shapes and return it as tuples of ints.

    Raises `ValueError` naming the offending axes and sizes.
    """
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
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


def _free(ndim: int, *used: Axes) -> Axes:
    taken = set().union(*used)
    return tuple(a for a in range(ndim) if a not in taken)


class _Transpose(NamedTuple):
    """A backward GEMM `dot_general(g, other, dims)` and how its result maps back."""

    dims: DimensionNumbers
    g_contracting: Axes
    other_contracting: Axes
    perm: Axes


def _backward_gemm(
    nb: int, g_first_free: int, mine: tuple[Axes, Axes, Axes], theirs: tuple[Axes, Axes, Axes]
) -> _Transpose:
    """The GEMM giving the cotangent of operand "mine" from `g` and operand "theirs".

    Each operand is described by (contracting, batch, free) axes. `g` is laid out as
    [batch, lhs free, rhs free]; `g_first_free` is where theirs' free axes start in it.
    """
    my_c, my_b, my_f = mine
    their_c, their_b, their_f = theirs
    g_contracting = tuple(range(g_first_free, g_first_free + len(their_f)))
    dims = ((g_contracting, their_f), (tuple(range(nb)), their_b))
    # Result: [batch, my free (from g), their contracting axes in increasing order].
    their_c_sorted = sorted(their_c)
    ndim = len(my_c) + len(my_b) + len(my_f)
    perm = [0] * ndim
    for i, a in enumerate(my_b):
        perm[a] = i
    for j, a in enumerate(my_f):
        perm[a] = nb + j
    for a, partner in zip(my_c, their_c, strict=True):
        perm[a] = nb + len(my_f) + their_c_sorted.index(partner)
    return _Transpose(dims, g_contracting, their_f, tuple(perm))


def backward_gemms(
    dimension_numbers: DimensionNumbers, lhs_ndim: int, rhs_ndim: int
) -> tuple[_Transpose, _Transpose]:
    """The dgrad (cotangent of lhs) and wgrad (cotangent of rhs) GEMMs of a `dot_general`."""
    (lc, rc), (lb, rb) = dimension_numbers
    lf, rf = _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb)
    nb = len(lb)
    lhs, rhs = (lc, lb, lf), (rc, rb, rf)
    return _backward_gemm(nb, nb + len(lf), lhs, rhs), _backward_gemm(nb, nb, rhs, lhs)


def _as_f32(tree: Any) -> Any:
    return jax.tree.map(jax_private.to_float32, tree)


def _cotangent(tree: Any, max_combining: bool) -> Any:
    """New state (float32) as the cotangent of state that came in max-combining or float32."""
    convert = jax_private.to_max_combining if max_combining else jax_private.to_float32
    return jax.tree.map(convert, tree)


def _quantized_operands(recipe: Recipe, dims: DimensionNumbers, lhs, rhs, states: States):
    (lc, rc), _ = dims
    sx, new_input = recipe.scaling(lhs, states.input, "input")
    sw, new_kernel = recipe.scaling(rhs, states.kernel, "kernel")
    q_lhs = recipe.quantize(lhs, sx, "input", lc)
    q_rhs = recipe.quantize(rhs, sw, "kernel", rc)
    return q_lhs, q_rhs, new_input, new_kernel


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_dot_general(
    recipe: Recipe,
    dimension_numbers: DimensionNumbers,
    precision: Any,
    dtypes: tuple[np.dtype, np.dtype, np.dtype, bool],
    lhs: Array,
    rhs: Array,
    states: States,
) -> Array:
    q_lhs, q_rhs, _, _ = _quantized_operands(recipe, dimension_numbers, lhs, rhs, _as_f32(states))
    return recipe.dot(q_lhs, q_rhs, dimension_numbers, precision).astype(dtypes[2])


def _fwd(recipe, dimension_numbers, precision, dtypes, lhs, rhs, states):
    # Residuals stay float32: under an eager `grad` they may leave the jitted function.
    states = _as_f32(states)
    q_lhs, q_rhs, new_input, new_kernel = _quantized_operands(
        recipe, dimension_numbers, lhs, rhs, states
    )
    out = recipe.dot(q_lhs, q_rhs, dimension_numbers, precision).astype(dtypes[2])
    return out, (q_lhs, q_rhs, new_input, new_kernel, states.output_grad)


def _bwd(recipe, dimension_numbers, precision, dtypes, residuals, g):
    del precision
    q_lhs, q_rhs, new_input, new_kernel, grad_state = residuals
    sg, new_grad = recipe.scaling(g, grad_state, "output_grad")
    dgrad, wgrad = backward_gemms(dimension_numbers, q_lhs.data.ndim, q_rhs.data.ndim)
    d_lhs = _backward_product(recipe, dgrad, g, sg, q_rhs, q_lhs.data)
    d_rhs = _backward_product(recipe, wgrad, g, sg, q_lhs, q_rhs.data)
    return (
        jnp.transpose(d_lhs, dgrad.perm).astype(dtypes[0]),
        jnp.transpose(d_rhs, wgrad.perm).astype(dtypes[1]),
        _cotangent(States(new_input, new_kernel, new_grad), dtypes[3]),
    )


_fp8_dot_general.defvjp(_fwd, _bwd)


def fp8_dot_general(
    recipe: Recipe,
    dimension_numbers: DimensionNumbers,
    precision: Any,
    dtypes: tuple[np.dtype, np.dtype, np.dtype],
    lhs: Array,
    rhs: Array,
    states: States,
) -> Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` as FP8 GEMMs under `recipe`.

    `dtypes` is (lhs dtype, rhs dtype, output dtype). Differentiating it computes dgrad and
    wgrad in FP8 and returns the new `states` as their cotangent, in the dtype `states` came in.
    """
    # JAX 0.10 asserts ("non-canonical constant") when a vmapped NumPy constant reaches a
    # custom_vjp inside jit; a copy (elided by XLA) makes it a traced value first.
    lhs, rhs = (
        jnp.array(x, copy=True) if jax_private.is_batch_tracer(x) else x for x in (lhs, rhs)
    )
    leaves = jax.tree.leaves(states)
    max_combining = any(jax_private.is_max_combining(x) for x in leaves)
    if max_combining and not all(jax_private.is_max_combining(x) for x in leaves):
        raise ValueError("FP8 state mixes max-combining and float32 leaves.")
    return _fp8_dot_general(
        recipe, dimension_numbers, precision, (*dtypes, max_combining), lhs, rhs, states
    )


def _fold_leading_axis(t: _Transpose) -> _Transpose:
    """`t` for operands that gained a leading axis to contract over (the vmapped tokens)."""

    def shift(axes: Axes) -> Axes:
        return tuple(a + 1 for a in axes)

    (gc, oc), (gb, ob) = t.dims
    dims = ((shift(gc) + (0,), shift(oc) + (0,)), (shift(gb), shift(ob)))
    return _Transpose(
        dims, shift(t.g_contracting) + (0,), shift(t.other_contracting) + (0,), t.perm
    )


def _backward_product(
    recipe: Recipe, t: _Transpose, g: Array, sg: Array, other: QTensor, own: Array
) -> Array:
    """`dot(quantize(g), other)` for a dgrad or wgrad, before the transpose `t.perm`.

    Under `jax.vmap(model)(batch)` JAX would run this once per example: the wgrad of an
    unbatched weight would become a batched outer product, summed afterwards, not a GEMM. When
    `g` and `other` are mapped but the operand being differentiated (`own`) and the state are
    not, the mapped axis is folded into the contraction instead: one FP8 GEMM over all tokens.
    """
    back = recipe.backward_dot_precision()

    def product(t: _Transpose, g: Array, sg: Array, other: QTensor) -> Array:
        q_g = recipe.quantize(g, sg, "output_grad", t.g_contracting)
        return recipe.dot(q_g, recipe.retile(other, t.other_contracting), t.dims, back)

    @custom_vmap
    def batched_product(g, sg, other, own):
        del own
        return product(t, g, sg, other)

    @batched_product.def_vmap
    def _rule(axis_size, in_batched, g, sg, other, own):
        g_b, sg_b, other_b, own_b = in_batched
        fold = (
            g_b
            and other_b.data
            and not (own_b or sg_b or other_b.scale_inv)
            and not _PER_EXAMPLE.get()
        )
        if fold:
            return _backward_product(recipe, _fold_leading_axis(t), g, sg, other, own), False
        axes = jax.tree.map(lambda b: 0 if b else None, (g_b, sg_b, other_b))
        out = jax.vmap(functools.partial(product, t), in_axes=axes)(g, sg, other)
        return out, True

    return batched_product(g, sg, other, own)

"""The `jax.custom_vjp` shared by the FP8 GEMMs (dense and grouped), and the checks of a call.

Each GEMM gives its forward and backward (with their batching rules, `batching.py`); this
module owns what is the same for all of them: the call's prologue (`prepare`: the checks of
its state, the dtypes and mesh axes it is differentiated in), the state entering as a
differentiable argument, and the backward's epilogue.

Residuals saved for the backward pass are the FP8 operands and their scales, never a
high-precision copy. The state of the three operands enters as a differentiable argument; its
cotangent is its new value ("gradient hijack"), in the dtype the state came in (float32, or
the max-combining dtype of `fp8jax._src.core.jax_private`), so that several uses of one layer
combine by max.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ..core import jax_private
from ..core.errors import StateNotDifferentiatedError, StateUsedTwiceError
from ..core.remat import name_fp8_operands, name_gemm_output
from ..core.stats import Fp8Stats
from ..kernels import dispatch
from ..recipes import Recipe


class States(NamedTuple):
    """The state of the three operands of one FP8 GEMM, and their statistics (`None` when
    the layer keeps no telemetry)."""

    input: Any
    kernel: Any
    output_grad: Any
    stats: Fp8Stats | None = None


class Static(NamedTuple):
    """What the custom_vjp needs to know about one call beyond its arrays (hashable)."""

    lhs: np.dtype
    rhs: np.dtype
    out: np.dtype
    max_combining: bool
    mesh_axes: tuple[frozenset[str], frozenset[str], tuple[frozenset[str], ...]]
    name: str
    kind: str
    #: Where the call is differentiated under `jax.vmap` (`vmap(grad(f))`): such a vmap maps
    #: the GEMM per member, never folds it (its wgrad would sum what stays per example).
    gradient_vmaps: jax_private.GradientUnderVmap | None = None
    #: The state entered another GEMM of the same `jax.checkpoint` or `jit` body, traced under
    #: a plain gradient (`check_single_use`): the forward rule raises if it is differentiated.
    used_again: bool = False

    def gradient_dtypes(self) -> tuple[np.dtype, np.dtype]:
        """The dtypes the backward's GEMMs write the lhs's and the rhs's gradients in: each
        operand's own, but a master's (an operand wider than both the other and the output:
        a float32 weight beside BF16 activations, which [`fp8jax.Policy`][] leaves uncast in
        FP8 layers) in the output's dtype, widened after (fused into its consumer), as the
        gradient of the cast it stands for would be: no float32 gradient written, and the
        same gradient as a BF16 copy's."""

        def master(own: np.dtype, other: np.dtype) -> bool:
            return own.itemsize > max(other.itemsize, self.out.itemsize)

        return (
            self.out if master(self.lhs, self.rhs) else self.lhs,
            self.out if master(self.rhs, self.lhs) else self.rhs,
        )


class Gemm(NamedTuple):
    """What differs between the FP8 GEMMs, for one call of the shared custom_vjp.

    - `recipe`: its numerics (whether they read the state, for the differentiation check).
    - `forward`: `(x, w, *rest, states) -> (out, residuals)`, with its batching rule;
      `residuals` has the fields `q_x` and `q_w` (the FP8 operands).
    - `backward`: `(residuals, g) -> (d_x, d_w, new_states)`, with its batching rule.
    """

    recipe: Recipe
    forward: Callable[..., tuple[Array, Any]]
    backward: Callable[[Any, Array], tuple[Array, Array, States]]


def _layer(name: str, kind: str) -> str:
    return f"FP8 layer {name!r}" if name else f"An {kind}"


def check_state_differentiated(recipe: Recipe, static: Static, x, w, states) -> None:
    """Raise if gradients flow through this GEMM while its state, which its numerics read,
    is not differentiated: its new value could not leave the step, and the scales would stay
    as they are forever. Takes the `CustomVJPPrimal`s of the call."""
    leaves = jax.tree.leaves(states)
    if not recipe.reads_state or any(leaf.perturbed for leaf in leaves):
        return
    if not (x.perturbed or w.perturbed):
        return
    raise StateNotDifferentiatedError(
        f"{_layer(static.name, static.kind)} ({type(recipe).__name__}) is differentiated, "
        "but its FP8 state is not: its new state leaves the step as the state's gradient. "
        f"{recipe.stale_state} Differentiate the "
        "state along with the weights: with a filter_spec, `filter_spec = "
        "fp8jax.with_fp8_state(filter_spec, model)`; with jax.grad, pass the layer (or "
        "model) as a differentiated argument, e.g. `fp8jax.filter_grad(loss)(model, x)` "
        "(gradients you do not use cost nothing under jit). Recipes that keep no state "
        "between steps (CurrentScaling, BlockwiseScaling, MXFP8) do not need it. (Under "
        "jax.jvp or jax.jacfwd: FP8 GEMMs have reverse-mode derivatives only.)",
        static.name,
        recipe.stale_state,
    )


#: The FP8 state each differentiation has seen enter a GEMM: trace -> {id(leaf): weak ref}.
#: Weak both ways: a tracer refers to its trace, so a strong one would keep the key alive.
STATE_USES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def used_twice(name: str, kind: str) -> StateUsedTwiceError:
    """The error for FP8 state entering two GEMMs of one plain differentiation."""
    return StateUsedTwiceError(
        f"{_layer(name, kind)} runs twice in one differentiated step (a shared or reused "
        "layer), under a gradient that would add its two amaxes and scales instead of "
        "keeping the larger: JAX sums the gradients of a value used twice, and FP8 state "
        "leaves the step through its gradient. Use fp8jax.filter_value_and_grad / "
        "fp8jax.filter_grad (drop-in for Equinox's) or fp8jax.make_train_step, which "
        "combine the uses by max; with plain jax.grad, view the model with "
        "fp8jax.combine_by_max inside the differentiated function.",
        name,
    )


def check_single_use(leaves: list, name: str, kind: str) -> bool:
    """Raise if this FP8 state already entered a GEMM under the same differentiation.

    JAX adds the cotangents of a value used twice; for FP8 state, whose cotangent is its new
    value, that adds the amaxes of the two uses (and their scales). Only the max-combining
    view of [`fp8jax.filter_value_and_grad`][] combines them correctly. Seen at trace time:
    the same state leaf, a tracer of the same reverse-mode trace, reaching two GEMMs. `kind`
    names a layer without a name. Inside a `jax.checkpoint` or `jit` body traced under one,
    whether the state is differentiated is known only to the forward rule: there a second
    use returns `True` (`Static.used_again`), and the forward rule raises if it is.
    """
    leaf = leaves[0]
    trace = jax_private.single_use_trace(leaf)
    if trace is None:
        return False
    seen = STATE_USES.setdefault(trace, {})
    earlier = seen.get(id(leaf))
    if earlier is not None and earlier() is leaf:
        if jax_private.differentiation_trace(leaf) is None:
            return True
        raise used_twice(name, kind)
    seen[id(leaf)] = weakref.ref(leaf)
    return False


def prepare(
    operands: tuple[Array, ...], states: States, out_dtype: np.dtype, name: str, kind: str
) -> tuple[tuple[Array, ...], Static]:
    """The prologue of a call: `operands` (the lhs and rhs first) ready for the custom_vjp,
    `states` checked (one dtype, one use per differentiation), and the call's `Static`.
    `name` names the layer in errors, `kind` a layer without a name."""
    # JAX 0.10 asserts ("non-canonical constant") when a vmapped NumPy constant reaches a
    # custom_vjp inside jit; a copy (elided by XLA) makes it a traced value first.
    operands = tuple(
        jnp.array(a, copy=True) if jax_private.is_batch_tracer(a) else a for a in operands
    )
    # The tokens each expert got stay float32: they add across uses (`max_combining_view`).
    every = jax.tree.leaves(states)
    counted = jax.tree.leaves(_token_counts(states))
    leaves = [a for a, n in zip(every, counted, strict=True) if not n]
    max_combining = any(jax_private.is_max_combining(a) for a in leaves)
    if max_combining and not all(jax_private.is_max_combining(a) for a in leaves):
        raise ValueError("FP8 state mixes max-combining and float32 leaves.")
    used_again = not max_combining and check_single_use(leaves, name, kind)
    lhs, rhs = operands[:2]
    mesh_axes = (
        jax_private.varying_axes(lhs),
        jax_private.varying_axes(rhs),
        tuple(jax_private.varying_axes(a) for a in every),  # per state leaf
    )
    static = Static(
        np.dtype(lhs.dtype),
        np.dtype(rhs.dtype),
        np.dtype(out_dtype),
        max_combining,
        mesh_axes,
        name,
        kind,
        jax_private.gradient_under_vmap(),
        used_again,
    )
    return operands, static


def _as_f32(tree: Any) -> Any:
    return jax.tree.map(jax_private.to_float32, tree)


#: The residuals named `FP8_OPERANDS`: a dense GEMM's, and a grouped one's with its group sizes
#: (one integer per expert).
_SAVED_WITH_OPERANDS = (
    "q_x",
    "q_w",
    "new_input",
    "new_kernel",
    "grad_state",
    "stats",
    "group_sizes",
)


def fp8_gemm(
    gemm: Gemm, static: Static, x: Array, w: Array, rest: tuple[Array, ...], states: States
) -> Array:
    """The FP8 GEMM `gemm` of `x` and `w` (and the operands `rest`, which get no cotangent),
    as `prepare` made them, differentiable: its backward runs dgrad and wgrad in FP8 and
    returns the new `states` as their cotangent, in the dtype `states` came in. In the body
    of a `shard_map` called eagerly, whose trace refuses the custom_vjp, it runs under a
    `jit` of its own, as in a jitted `shard_map`."""
    if jax_private.eager_shard_map():
        return jax.jit(functools.partial(_fp8_gemm, gemm, static))(x, w, rest, states)
    return _fp8_gemm(gemm, static, x, w, rest, states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_gemm(
    gemm: Gemm, static: Static, x: Array, w: Array, rest: tuple[Array, ...], states: States
) -> Array:
    with dispatch.placed_as(x, w):
        return name_gemm_output(gemm.forward(x, w, *rest, _as_f32(states))[0])


_SECOND_DERIVATIVE = (
    "fp8jax's FP8 GEMMs have one reverse-mode derivative (jax.grad, jax.vjp, "
    "fp8jax.filter_value_and_grad): a derivative of that derivative (jax.hessian, "
    "jax.jacfwd of a gradient, a gradient of a gradient) is not defined through the "
    "quantization. Take such derivatives of the model in high precision (before "
    "fp8_linear_layers, or with the layers excluded)."
)


@jax.custom_jvp
def _refuse_derivative_of_gradient(operands: Any) -> Any:
    """The identity on a forward's operands (no kernel), whose derivative raises: only a
    derivative of the gradient differentiates a custom_vjp's forward."""
    return operands


@_refuse_derivative_of_gradient.defjvp
def _(primals, tangents):
    raise TypeError(_SECOND_DERIVATIVE)


def _fp8_gemm_fwd(gemm: Gemm, static: Static, x, w, rest, states):
    # Called with `CustomVJPPrimal`s (symbolic_zeros=True): values and whether they are
    # differentiated.
    x_, w_, rest_, states_ = jax.tree.map(lambda p: p.value, (x, w, rest, states))
    # A derivative of the gradient (jax.hessian, jax.jacfwd of jax.grad, grad of grad) runs
    # this forward on its own tracers: eagerly and under vmap here, and under jit, scan or
    # checkpoint when it differentiates the traced forward; either way it meets the guard.
    x_, w_ = _refuse_derivative_of_gradient((x_, w_))
    check_state_differentiated(gemm.recipe, static, x, w, states)
    if static.used_again and any(leaf.perturbed for leaf in jax.tree.leaves(states)):
        raise used_twice(static.name, static.kind)
    x, w, rest, states = x_, w_, rest_, states_
    # Residuals stay float32: under an eager `grad` they may leave the jitted function.
    with dispatch.placed_as(x, w):
        out, res = gemm.forward(x, w, *rest, _as_f32(states))
    # Named here, outside the custom_vmap (opaque to jax.checkpoint policies): the FP8
    # operands, and beside them the state the forward hands the backward (a few floats), or
    # under `save_fp8_operands` the backward pass would run the forward again to get them,
    # reading each input once more.
    res = res._replace(
        **{f: name_fp8_operands(getattr(res, f)) for f in _SAVED_WITH_OPERANDS if f in res._fields}
    )
    return name_gemm_output(out), res


def _reduce_to(a: Array, axes: frozenset[str], reduce: Any) -> Array:
    """`a` reduced over the manual mesh axes it varies on beyond `axes` (inside `shard_map`,
    the gradient of a replicated input is summed over the devices, as JAX's own rules do)."""
    extra = tuple(sorted(jax_private.varying_axes(a) - axes))
    return reduce(a, extra) if extra else a


def _token_counts(states: States) -> Any:
    """`states` with `True` for the leaf of a grouped layer's token counts, else `False`."""
    flags = jax.tree.map(lambda _: False, states)
    tokens = getattr(states.stats, "tokens", None)
    if tokens is None:
        return flags
    return flags._replace(stats=eqx.tree_at(lambda s: s.tokens, flags.stats, True))


def _fp8_gemm_bwd(gemm: Gemm, static: Static, residuals, g):
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(g.shape, g.dtype)
    with dispatch.placed_as(residuals.q_x, residuals.q_w, g):
        d_x, d_w, new_states = gemm.backward(residuals, g)
    # A master's gradient, written narrower (`Static.gradient_dtypes`), in its own dtype.
    d_x, d_w = d_x.astype(static.lhs), d_w.astype(static.rhs)
    lhs_axes, rhs_axes, state_axes = static.mesh_axes
    d_x = _reduce_to(d_x, lhs_axes, lax.psum)
    d_w = _reduce_to(d_w, rhs_axes, lax.psum)
    # Replicated state takes the largest amax of all devices, never their sum; state split
    # over an axis (expert parallelism's per-expert state) stays each device's own. The
    # tokens each expert got are counted where they arrived: summed over the devices that
    # hold replicas of the expert (a data axis beside the expert axis).
    leaves, tree = jax.tree.flatten(new_states)
    counts = tree.flatten_up_to(_token_counts(new_states))
    reduced = [
        _reduce_to(a, axes, lax.psum if count else lax.pmax)
        for a, axes, count in zip(leaves, state_axes, counts, strict=True)
    ]
    # The counts stay float32: they add across uses (`max_combining_view`).
    convert = jax_private.to_max_combining if static.max_combining else jax_private.to_float32
    new_states = tree.unflatten(
        [
            jax_private.to_float32(a) if n else convert(a)
            for a, n in zip(reduced, counts, strict=True)
        ]
    )
    return d_x, d_w, None, new_states


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd, symbolic_zeros=True)

"""Gradients in which every use of an FP8 layer contributes its amax by max, not sum.

JAX adds the cotangents of a value used several times. For FP8 state, whose cotangent is its
new value, that would add amaxes whenever a layer runs more than once in a step: a shared
Linear, a `lax.scan` over microbatches, a loop. [`fp8jax.filter_value_and_grad`][] views the
state in a dtype whose cotangents combine by `max` before the function runs, so each use
contributes and the history keeps the largest amax. Use it wherever you would use
`eqx.filter_value_and_grad`.

Under `jax.vmap(model)(batch)` the state's amax is already batch-wide (see
`fp8jax._src.core.amax`) and the wgrad is one GEMM over all tokens, with either gradient
function. Under `vmap` of a gradient (per-example gradients), fp8jax's or JAX's own, the GEMMs
keep the mapped axis out of their wgrad, so each example gets its own weight gradient
(`fp8jax._src.gemm.batching`); when `filter_value_and_grad` is itself `vmap`ped, it also traces
apart from its unmapped calls, whose jaxprs JAX would otherwise reuse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax

from ..core import jax_private
from ..core.stats import max_combining_view
from ..core.updates import OverwriteWithGradient, is_overwrite
from ..gemm.batching import per_example_gradients
from ..ops.base import AbstractFp8Op, check_float32_state, with_recorded_scales

T = TypeVar("T")


def combine_by_max(tree: T) -> T:
    """`tree` with the array leaves of its FP8 state viewed in the max-combining dtype.

    Call it inside a differentiated, jitted function, on the model, before the model runs:
    every use of a layer downstream then combines its state's cotangent by max. The cotangent
    reaching the float32 state outside is float32 again, with each scale the one its recipe
    records beside the combined (largest) amax, as one use of that amax records it.
    [`fp8jax.filter_value_and_grad`][] does this for you.
    """

    def convert(node: Any) -> Any:
        # fp8jax's state; Haliax's own (a layer quantized by Haliax) keeps its float32, as
        # its custom gradients expect.
        if not isinstance(node, OverwriteWithGradient):
            return node
        if isinstance(node, AbstractFp8Op):
            check_float32_state(node)  # before the view would widen a cast state unseen
            node = _paired_in_gradient(node)
        return max_combining_view(node)

    return jax.tree.map(convert, tree, is_leaf=is_overwrite)


def _paired_in_gradient(op: AbstractFp8Op) -> AbstractFp8Op:
    """`op` unchanged, but for its gradient (its new state, the uses' combined by max leaf by
    leaf: the largest amax beside the largest scale, the smallest amax's), whose scales are
    paired with the amax they are recorded beside again (`with_recorded_scales`)."""
    arrays, static = eqx.partition(op, eqx.is_array)

    @jax.custom_vjp
    def identity(arrays: Any) -> Any:
        return arrays

    def forward(arrays: Any) -> tuple[Any, None]:
        return arrays, None

    def backward(_: None, cotangent: Any) -> tuple[Any]:
        paired = with_recorded_scales(eqx.combine(cotangent, static))
        return (eqx.filter(paired, eqx.is_array),)

    identity.defvjp(forward, backward)
    return eqx.combine(identity(arrays), static)


def filter_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`eqx.filter_value_and_grad` in which FP8 state combines across uses by max.

    Differentiates with respect to the floating-point arrays of the first argument, like
    Equinox's. The gradient of each [`fp8jax.OverwriteWithGradient`][] module is its new state;
    when a layer runs several times in `fun` (shared weights, a scan over microbatches), its
    amax history receives the largest of their amaxes.

    `fun` is traced under `jax.jit` (the max-combining dtype only exists inside traced code);
    inside your own jitted step that costs nothing.

    ```python
    loss, grads = fp8jax.filter_value_and_grad(loss_fn)(model, batch)
    ```
    """

    @functools.wraps(fun)
    def with_max_state(first: Any, *args: Any, **kwargs: Any) -> Any:
        return fun(combine_by_max(first), *args, **kwargs)

    # Each layer's scales come paired with the largest amax its uses combined to
    # (`combine_by_max`). The whole gradient under one jit: residuals of the max-combining
    # dtype (a remat's saved inputs) never leave it, which an eager caller would otherwise
    # materialize.
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(with_max_state, has_aux=has_aux))

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            if _per_example(args, kwargs):
                # vmap(grad) with shared FP8 state: per-example gradients must not be summed
                # over the mapped axis.
                with per_example_gradients():
                    return value_and_grad(*args, **kwargs)
            return value_and_grad(*args, **kwargs)
        except (TypeError, ValueError) as e:
            if not is_static_slice_error(e):
                raise
            raise TypeError(
                "fp8jax.filter_value_and_grad: JAX cannot differentiate a static slice or "
                "gather of FP8 state (e.g. `stacked_layers[0]`) in its max-combining dtype. "
                "Apply stacked layers with lax.scan or haliax Stacked.fold/scan, index them "
                "with jax.lax.dynamic_index_in_dim, or use eqx.filter_value_and_grad if no FP8 "
                "layer runs more than once per step. Reading the arrays of an "
                "OverwriteWithGradient of your own (a sum of one) fails alike: read one as "
                "jax.lax.stop_gradient(x.astype(jnp.float32))."
            ) from e

    return run


# What JAX 0.10 raises when it transposes a static slice (`slice`, `squeeze`, indexing with
# an int) or a gather of an array of the max-combining dtype: it builds the cotangent with
# NumPy dtypes that know nothing of it. tests/test_jax_private.py checks these still hold.
STATIC_SLICE_ERRORS = (
    "Cannot interpret 'max_f32' as a data type",
    "Unsupported dtype for gather fill_value max_f32",
)


def is_static_slice_error(error: Exception) -> bool:
    """Whether `error` is one of JAX's errors for a static slice of max-combining state."""
    return any(text in str(error) for text in STATIC_SLICE_ERRORS)


def _per_example(args: tuple, kwargs: dict) -> bool:
    """Whether this gradient is being vmapped while the FP8 state is shared (not vmapped)."""
    if not any(jax_private.is_batch_tracer(x) for x in jax.tree.leaves((args, kwargs))):
        return False
    states = [
        node for node in jax.tree.leaves(args[:1], is_leaf=is_overwrite) if is_overwrite(node)
    ]
    return any(not jax_private.is_batch_tracer(x) for x in jax.tree.leaves(states))


def filter_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """`eqx.filter_grad` in which FP8 state combines across uses by max.

    See [`fp8jax.filter_value_and_grad`][]; this returns only the gradients (and the aux
    output, as `(grads, aux)`, when `has_aux=True`).
    """
    value_and_grad = filter_value_and_grad(fun, has_aux=has_aux)

    @functools.wraps(fun)
    def grad_only(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grad(*args, **kwargs)
        if has_aux:
            return grads, value[1]
        return grads

    return grad_only

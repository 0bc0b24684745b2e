"""`select_tree`: one of two pytrees, leaf by leaf and bit for bit, as a step whose gradients
overflowed is skipped without leaving `jit` (telemetry's counts of rejected FP8 updates
kept)."""

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool

from ..ops.base import with_rejected_counts

T = TypeVar("T")

_BITS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _select(pred: Bool[Array, ""], t: Array, f: Array) -> Array:
    """`jnp.where(pred, t, f)`, on the bits of floating arrays: XLA's CPU select of bfloat16
    goes through float32 and would quieten signalling NaNs and drop NaN payloads."""
    if jnp.issubdtype(t.dtype, jnp.floating) and jnp.finfo(t.dtype).bits in _BITS:
        uint = _BITS[jnp.finfo(t.dtype).bits]
        bits = jnp.where(
            pred, jax.lax.bitcast_convert_type(t, uint), jax.lax.bitcast_convert_type(f, uint)
        )
        return jax.lax.bitcast_convert_type(bits, t.dtype)
    return jnp.where(pred, t, f)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def select_tree(pred: Bool[ArrayLike, ""], on_true: T, on_false: T) -> T:
    """`on_true` where `pred` holds, else `on_false`, leaf by leaf and bit for bit.

    Use it to skip a step whose gradients overflowed: select the old model and optimizer state
    (FP8 state included; selecting is not casting) without leaving `jit`. Telemetry's counts
    of rejected FP8 updates (`stats.<role>.rejected`, which only grow) are the larger of the
    two trees': a step skipped for an inf or NaN operand stays counted.

    **Arguments:**

    - `pred`: a boolean scalar (array), e.g. [`fp8jax.all_finite`][]`(grads)`.
    - `on_true`, `on_false`: pytrees of the same structure whose array leaves agree in shape
      and dtype. Their non-array leaves must be equal and are returned as they are.

    **Raises:** `ValueError` naming the first leaf where the trees disagree.

    ```python
    model = fp8jax.select_tree(finite, new_model, model)
    ```
    """
    pred = jnp.asarray(pred)
    if pred.dtype != jnp.bool_ or pred.shape != ():
        raise TypeError(
            f"select_tree: pred has dtype {pred.dtype} and shape {pred.shape}; it should be a "
            "boolean scalar."
        )
    true_leaves, true_def = jax.tree_util.tree_flatten_with_path(on_true)
    false_leaves, false_def = jax.tree_util.tree_flatten_with_path(on_false)
    if true_def != false_def:
        raise ValueError(
            "select_tree: on_true and on_false have different structures:\n"
            f"  on_true:  {true_def}\n  on_false: {false_def}"
        )
    out = []
    for (path, t), (_, f) in zip(true_leaves, false_leaves, strict=True):
        where = jax.tree_util.keystr(path) or "the root"
        if eqx.is_array(t) and eqx.is_array(f):
            if t.shape != f.shape or t.dtype != f.dtype:
                raise ValueError(
                    f"select_tree: at {where}, on_true is {t.dtype}{list(t.shape)} and on_false "
                    f"is {f.dtype}{list(f.shape)}; they should have the same shape and dtype."
                )
            out.append(_select(pred, t, f))
        elif eqx.is_array(t) or eqx.is_array(f):
            raise ValueError(
                f"select_tree: at {where}, one tree has an array and the other "
                f"{type(f if eqx.is_array(t) else t).__name__}; both should be arrays."
            )
        elif _same(t, f):
            out.append(t)
        else:
            raise ValueError(
                f"select_tree: at {where}, the non-array leaves {t!r} and {f!r} differ; "
                "non-array leaves are not selected and must be equal."
            )
    return with_rejected_counts(jax.tree.unflatten(true_def, out), on_true, on_false)

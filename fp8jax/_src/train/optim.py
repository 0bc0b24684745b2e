"""Optimizer state stored in low precision between steps, updated in float32.

DeepSeek-V3 keeps the AdamW moments in bfloat16 next to float32 master weights, halving the
optimizer's memory. [`fp8jax.low_precision_state`][] does this for any optax transformation.

```python
optimizer = fp8jax.low_precision_state(optax.adamw(3e-4), jnp.bfloat16)
```
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from ..core.formats import DTYPE_ALIASES, JAX_FLOATS

T = TypeVar("T")


def _is_stored_low(x: Any) -> bool:
    """Whether a state leaf is kept in the storage dtype: a floating array of rank >= 1."""
    return (
        isinstance(x, jax.Array | np.ndarray)
        and x.ndim > 0
        and jnp.issubdtype(x.dtype, jnp.floating)
    )


def _cast_state(tree: T, storage: np.dtype, dtype: np.dtype) -> T:
    """The leaves stored in `storage` cast to `dtype`; those the inner optimizer keeps
    narrower are its own, handed to it as it keeps them."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if _is_stored_low(x) and x.dtype == storage else x, tree
    )


def _stored(x: Any, dtype: np.dtype) -> Any:
    """A state leaf cast down to the storage dtype; one narrower (an FP8 leaf, optax's
    `mu_dtype=jnp.bfloat16` under float32 storage) is the inner optimizer's own: kept."""
    if _is_stored_low(x) and x.dtype != dtype and x.dtype.itemsize >= dtype.itemsize:
        return x.astype(dtype)
    return x


def _is_floating_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _in_gradients_dtype(updates: T, grads: Any, params: Any) -> T:
    """The inner updates, computed from the float32 state, in the dtype the inner optimizer
    gives them from state of the parameters' dtype: the gradients', promoted with the
    parameters' where given (narrowed only: an update in a narrower dtype keeps it)."""

    def cast(u: Any, g: Any, p: Any) -> Any:
        if not (_is_floating_array(u) and _is_floating_array(g)):
            return u
        try:
            want = jnp.promote_types(g.dtype, p.dtype) if _is_floating_array(p) else g.dtype
        except ValueError:  # 8-bit floats do not promote: leave the update as computed
            return u
        return u.astype(want) if np.dtype(want).itemsize < u.dtype.itemsize else u

    def is_leaf(x: Any) -> bool:
        return x is None

    if params is not None:
        try:
            return jax.tree.map(cast, updates, grads, params, is_leaf=is_leaf)
        except ValueError:
            pass  # parameters not shaped as the gradients (optax's Adam never reads them)
    nothing = jax.tree.map(lambda _: None, grads)
    return jax.tree.map(cast, updates, grads, nothing, is_leaf=is_leaf)


def low_precision_state(
    optimizer: optax.GradientTransformation, dtype: DTypeLike = jnp.bfloat16
) -> optax.GradientTransformationExtraArgs:
    """`optimizer` with its floating-point state stored in `dtype` between steps.

    `init` casts the inner state down to `dtype`. `update` casts it up to float32 (or `dtype`,
    if wider), runs the inner update on the gradients and parameters as given, and casts the new
    state down again: the arithmetic is float32, only the storage is rounded (to nearest).
    Leaves the inner optimizer keeps narrower than `dtype` (FP8 leaves; optax's `mu_dtype=
    jnp.bfloat16` under `dtype=jnp.float32`) are never widened: they stay as it keeps them.
    The updates come back in the dtype the inner optimizer gives them from state of the
    parameters' dtype, the gradients' (promoted with the parameters' where given): bfloat16
    parameters get bfloat16 updates, rounded once from float32. Without `params` the stored
    state does not tell the parameters' dtype, so the gradients' alone decides: bfloat16
    gradients of float32 parameters get bfloat16 updates where optax's own gives float32;
    pass `params` (Adam ignores them otherwise) to get float32 updates.
    Integer and boolean leaves (step counts) and 0-d floating leaves (injected
    hyperparameters such as a learning rate, scalar statistics) keep their dtype: they cost
    nothing and rounding a learning rate would change every step. Complex leaves are kept too.

    **Arguments:**

    - `optimizer`: any optax `GradientTransformation` (extra arguments are passed through).
    - `dtype`: the storage dtype, a floating dtype or its name (`"bf16"`, `"float16"`; `"f8"`,
      NumPy's float64 but FP8 to some readers, is refused); `jnp.bfloat16` by default.

    **Returns:** an `optax.GradientTransformationExtraArgs`.

    **Caveat: stalled second moments.** Rounding to nearest drops any change smaller than half
    a unit in the last place, which for bfloat16 is 2**-9 to 2**-8 of the value (8 significant
    bits). Adam's `nu` moves by `(1 - b2) * (g**2 - nu)` per step; with `b2 = 0.999`:

    - `nu` can never decrease: a step changes it by at most 0.1% of itself downwards, less than
      half an ulp. After a burst of large gradients, `nu` stays at its peak; float32 decays it.
    - Under a steady gradient `nu` stops growing as soon as `0.001 * (g**2 - nu)` falls below
      half an ulp, i.e. between `g**2 / 4.9` and about `g**2 / 2.9`, instead of approaching
      `g**2` (the measured stall and its effect on the updates: `benchmarks/RESULTS.md`,
      "Low-precision optimizer state").

    **float16** has 3 more bits but 2**-24 (6e-8) as its smallest subnormal, and rounds values
    below half of it to 0: Adam's `nu` of ordinary gradients (below about 5.5e-3 with
    `b2 = 0.999`) underflows to 0 and the updates grow some 30x; it warns.

    `mu` (`b1 = 0.9`) moves by 10% of the gap and settles within 2-4% of a steady gradient.
    Where this matters, keep `nu` in float32 (optax's own `optax.adamw(..., mu_dtype=
    jnp.bfloat16)`, without this wrapper, stores only `mu` in bfloat16), or use `b2 = 0.99`:
    its 1% steps exceed half an ulp, so `nu` can decay, and by the same bound it stalls no
    lower than `g**2 / 1.39`. DeepSeek-V3 itself trains with `b2 = 0.95`, whose 5% steps are
    ten times half an ulp.

    **Caveat: state that holds the parameters.** Every floating leaf of rank >= 1 is narrowed,
    including a copy of the parameters: schedule-free's `z` (`optax.contrib.schedule_free*`),
    lookahead's slow weights, an average of the parameters. Such a leaf moves by the update,
    lr-sized, and a bfloat16 `z` near 1 rounds back any step below 2**-8: it stalls (with lr
    1e-3, it never moves). Keep it float32 by wrapping only the optimizer that holds the
    moments, e.g. schedule-free AdamW with only its `nu` in bfloat16 (`b2 = 0.95`, as above):

    ```python
    base = optax.chain(
        fp8jax.low_precision_state(
            optax.scale_by_rms(0.95, 1e-8, eps_in_sqrt=False, bias_correction=True)
        ),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(lr),
    )
    optimizer = optax.contrib.schedule_free(base, learning_rate=lr)  # z float32
    ```

    ```python
    optimizer = fp8jax.low_precision_state(optax.adamw(3e-4))
    opt_state = optimizer.init(params)            # mu, nu in bfloat16; count int32
    updates, opt_state = optimizer.update(grads, opt_state, params)
    ```
    """
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"low_precision_state: optimizer={optimizer!r} should be an optax "
            "GradientTransformation (with init and update)."
        )
    name = dtype.strip().lower() if isinstance(dtype, str) else None
    if name in ("f8", "fp8", "float8"):
        raise ValueError(
            f"low_precision_state: dtype={dtype!r} is ambiguous: NumPy reads 'f8' as float64 "
            "(8 bytes, 4x bfloat16's memory), an FP8 library's reader as FP8. Spell it out: "
            "jnp.bfloat16, jnp.float16 or jnp.float32."
        )
    try:
        # np.dtype(None) is float64: a forgotten dtype must not silently mean "float64".
        storage = None if dtype is None else DTYPE_ALIASES.get(name) or np.dtype(dtype)
    except TypeError:
        storage = None
    if storage is None or not jnp.issubdtype(storage, jnp.floating):
        raise ValueError(
            f"low_precision_state: dtype={dtype!r} should be a floating dtype, e.g. "
            "jnp.bfloat16, jnp.float16 or jnp.float32."
        )
    if storage.itemsize < 2:
        # No scale goes with the stored state: Adam's second moments (g**2) would flush to
        # zero or overflow an 8-bit float's range, and an 8-bit float does not promote.
        raise ValueError(
            f"low_precision_state: dtype={dtype!r} is an 8-bit float, which stores optimizer "
            "state without a scale; use jnp.bfloat16, jnp.float16 or jnp.float32."
        )
    if storage not in JAX_FLOATS:
        raise ValueError(
            f"low_precision_state: dtype={dtype!r} is {storage}, of which JAX has no arrays; "
            "use jnp.bfloat16, jnp.float16 or jnp.float32."
        )
    if storage == np.dtype(jnp.float16):
        warnings.warn(
            "low_precision_state: dtype=float16 flushes values below 3e-8 (half its "
            "smallest subnormal, 6e-8) to zero: Adam's second moment, (1 - b2) * g**2, of a "
            "gradient below about 5.5e-3 (b2 = 0.999) is stored as 0, and its updates grow to "
            "lr / sqrt(1 - b2), some 30x lr. jnp.bfloat16 keeps float32's range; float16 suits "
            "state of gradients' own magnitude (SGD momentum).",
            stacklevel=2,
        )
    compute = np.dtype(jnp.promote_types(storage, jnp.float32))
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params: optax.Params) -> optax.OptState:
        return jax.tree.map(lambda x: _stored(x, storage), inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        new, new_state = inner.update(
            updates, _cast_state(state, storage, compute), params, **extra_args
        )
        stored = jax.tree.map(lambda x: _stored(x, storage), new_state)
        return _in_gradients_dtype(new, updates, params), stored

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

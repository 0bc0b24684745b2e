"""A per-tensor scale from an amax (`compute_scale`) and delayed scaling's amax history
update (`roll_in`): the arithmetic every recipe with per-tensor or per-expert scales shares."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from ..core.formats import floor_log2, pow2
from .base import MAX_MARGIN

#: The largest scale: its inverse, 2**-126, is float32's smallest normal number.
MAX_SCALE: float = 2.0**126
#: The smallest scale fp8jax computes: float32's smallest normal number, whose inverse is
#: finite (a large margin over a large amax would otherwise give a subnormal, flushed to 0).
MIN_SCALE: float = 2.0**-126


def compute_scale(
    amax_value: Float[Array, "*lead"],
    previous: Float[Array, "*lead"],
    fmt_max: Float[ArrayLike, "*#lead"],
    margin: Float[ArrayLike, "*#lead"] = 0.0,
    power_of_two: bool | Bool[ArrayLike, "*#lead"] = False,
) -> Float[Array, "*lead"]:
    """`fmt_max / (amax * 2**margin)`, or `previous` where `amax` is zero or not finite.

    With `power_of_two`, the largest power of two not above that: then `1 / scale` is exact,
    and so is the product of two such inverses in BF16 (see [`fp8jax.PerTensorRecipe`][]).
    A tiny amax would give a scale whose inverse is a subnormal float32, which XLA flushes to
    zero; scales are therefore capped at `2**126` (`MAX_SCALE`). A large margin over a large
    amax would give a subnormal scale, flushed to 0 (an infinite inverse): scales are kept at
    `2**-126` at least (`MIN_SCALE`), where every value flushes to zero. `fmt_max`, `margin` and
    `power_of_two` may be arrays that broadcast against `amax_value` (one per state of a
    stack: merged states of many layers get their scales in one pass); `fmt_max` and
    `power_of_two` traced ones too, `margin` a number or a NumPy array from -32 to 32 (as a
    recipe's): its factor `2**-margin` is a constant of the trace. The quotient is formed in
    float32 (or float64) whatever `amax_value`'s dtype: a BF16 or float16 amax (`max |x|` of
    a BF16 tensor) is widened first, as its own arithmetic would round the scale (or overflow
    float16).
    """
    if isinstance(fmt_max, type | np.dtype | str):  # a format, where its largest value goes
        raise TypeError(
            f"compute_scale: fmt_max={fmt_max!r} is a dtype; pass the format's largest value, "
            "e.g. fp8jax.fp8_max(jnp.float8_e4m3fn) (448.0)."
        )
    amax_value = jnp.asarray(amax_value)
    amax_value = amax_value.astype(jnp.promote_types(amax_value.dtype, jnp.float32))
    ok = (amax_value > 0.0) & jnp.isfinite(amax_value)
    # Times 2**-margin (a float32 constant), not divided by 2**margin: XLA may turn a division
    # by a constant into a multiplication anyway, so the result would depend on the backend.
    try:
        margin = np.asarray(margin, np.float64)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(
            "compute_scale: margin is traced (an argument of a jitted function, say); pass a "
            "Python number or a NumPy array: its factor 2**-margin is a constant of the trace."
        ) from None
    if not np.all(np.abs(margin) <= MAX_MARGIN):  # NaN too
        raise ValueError(
            f"compute_scale: margin={margin.tolist()!r}: should be finite numbers of binades "
            f"from -{MAX_MARGIN} to {MAX_MARGIN}, as a recipe's margin (past them every value "
            "flushes to zero or saturates; 2**-margin overflows float32 from -128)."
        )
    factor = np.asarray(2.0**-margin, np.float32)
    divisor = jnp.where(ok, amax_value, 1.0)
    quotient = fmt_max / divisor
    # A tiny amax overflows `fmt_max / amax` to inf, and inf times the factor stays inf
    # (capped at 2**126) where a margin above 2 brings the true scale below the cap: divide
    # the factor's product instead there (finite, or above the cap too).
    fresh = jnp.where(jnp.isinf(quotient), (fmt_max * factor) / divisor, quotient * factor)
    fresh = jnp.clip(fresh, MIN_SCALE, MAX_SCALE)
    if isinstance(power_of_two, bool):
        if power_of_two:
            fresh = pow2(floor_log2(fresh))
    else:
        fresh = jnp.where(power_of_two, pow2(floor_log2(fresh)), fresh)
    return jnp.where(ok, fresh, previous)


def roll_in(history: Float[Array, "*lead n"], amax: Float[Array, "*lead"]) -> Array:
    """Transformer Engine's history update, `roll(history, -1)` then `amax` at index 0, as
    one concatenation: `[amax, history[2:], history[0]]` (for a history of one, `[amax]`).
    The same values; XLA makes one kernel of it, where the roll and the indexed write were
    two per operand and step."""
    new = jnp.expand_dims(amax, -1).astype(history.dtype)
    if history.shape[-1] == 1:
        return new
    return jnp.concatenate([new, history[..., 2:], history[..., :1]], axis=-1)

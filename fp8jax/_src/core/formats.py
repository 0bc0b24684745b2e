"""FP8 formats and saturating casts.

A *scale* in fp8jax goes the way Transformer Engine's does: values are **multiplied** by it
before the cast to FP8 (`q = fp8(x * scale)`) and the FP8 value is multiplied by `1 / scale`
to come back. Flax stores the reciprocal.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, Shaped

from . import jax_private

_FORMATS: dict[str, np.dtype] = {
    "e4m3": np.dtype(jnp.float8_e4m3fn),
    "e5m2": np.dtype(jnp.float8_e5m2),
    "e4m3fnuz": np.dtype(jnp.float8_e4m3fnuz),
    "e5m2fnuz": np.dtype(jnp.float8_e5m2fnuz),
}
_ALIASES: dict[str, str] = {
    "e4m3fn": "e4m3",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
}

FormatLike = str | DTypeLike


def fp8_dtype(fmt: FormatLike) -> np.dtype:
    """The FP8 dtype named by `fmt`.

    **Arguments:**

    - `fmt`: `"e4m3"` (`float8_e4m3fn`, max 448), `"e5m2"` (`float8_e5m2`, max 57344), their AMD
      variants `"e4m3fnuz"` and `"e5m2fnuz"`, or one of these dtypes itself.

    **Returns:** a NumPy dtype.

    ```python
    >>> fp8jax.fp8_dtype("e4m3")
    dtype(float8_e4m3fn)
    ```
    """
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt.lower(), fmt.lower())
        if key in _FORMATS:
            return _FORMATS[key]
    else:
        try:
            dtype = np.dtype(fmt)
        except TypeError:
            dtype = None
        if dtype is not None and dtype in _FORMATS.values():
            return dtype
    accepted = (
        f"should be one of {sorted(_FORMATS)} or the matching dtype "
        f"({', '.join(sorted(d.name for d in _FORMATS.values()))})"
    )
    try:
        other = np.dtype(fmt.lower() if isinstance(fmt, str) else fmt)
    except TypeError:
        other = None
    if other is not None and other.kind == "V" and other.itemsize == 1 and "float" in other.name:
        # ml_dtypes' other 8-bit floats (float8_e3m4, float8_e8m0fnu: MX's scale format, ...)
        raise ValueError(f"{other.name} is not an FP8 format fp8jax casts to: {accepted}.")
    raise ValueError(f"Unknown FP8 format {fmt!r}: {accepted}.")


def format_name(fmt: FormatLike) -> str:
    """The canonical name (`"e4m3"`, `"e5m2"`, `"e4m3fnuz"`, `"e5m2fnuz"`) of a format given
    by any name or dtype [`fp8jax.fp8_dtype`][] accepts."""
    dtype = fp8_dtype(fmt)
    return next(name for name, d in _FORMATS.items() if d == dtype)


def amd_format(fmt: FormatLike) -> bool:
    """Whether `fmt` is one of AMD's fnuz formats (no infinities, one zero), which no NVIDIA
    tensor core takes: Hopper's `wgmma` multiplies E4M3 and E5M2 only."""
    return format_name(fmt).endswith("fnuz")


def fp8_max(fmt: FormatLike) -> float:
    """The largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(fp8_dtype(fmt)).max)


def overflow_threshold(fmt: FormatLike) -> float:
    """The magnitude above which a value no longer rounds to a finite FP8 value: the format's
    max plus half its spacing there (464 for E4M3, 61440 for E5M2); at which too where
    `ties_overflow`. Scaled values beyond it are the ones a saturating cast clips."""
    dtype = fp8_dtype(fmt)
    top = math.floor(math.log2(fp8_max(dtype)))
    return fp8_max(dtype) + 2.0 ** (top - jnp.finfo(dtype).nmant - 1)


def ties_overflow(fmt: FormatLike) -> bool:
    """Whether a value exactly at `overflow_threshold(fmt)` does not round to a finite FP8
    value either: rounding to nearest even takes that midpoint down to the max where the
    max's last significand bit is even (E4M3's 448), past it where it is odd (E5M2's 57344,
    and both fnuz formats' maxima)."""
    dtype = fp8_dtype(fmt)
    return bool(np.array(fp8_max(dtype), dtype).view(np.uint8) & 1)


def expand_blocks(values: Array, block: tuple[int, ...], shape: tuple[int, ...]) -> Array:
    """Per-block `values (*B, nR, nC)` repeated over each block, cut to `shape (*B, R, C)`."""
    full = jnp.repeat(jnp.repeat(values, block[0], axis=-2), block[1], axis=-1)
    return full[..., : shape[-2], : shape[-1]]


@jax.custom_jvp
def widen(x: Array) -> Float[Array, "*shape"]:
    """`x` as float32, exactly, in a form XLA keeps: the value `x` holds, not the one it was
    rounded from. Its derivative is a convert's (the bit shifts below would give 0).

    XLA's GPU compiler removes a float32 -> bfloat16 -> float32 pair of converts
    (`SimplifyFPConversions`, under its default `xla_allow_excess_precision`). A BF16
    activation computed in float32 (a LayerNorm's output, say) and widened again here would
    then be read as its float32 producer: a float32 intermediate that the BF16 program does
    not have, written and read at twice the bytes, and FP8 values that differ from the CPU's.
    A bfloat16 value is the top half of its float32 bits, so shifting the bits widens it with
    integer operations, which that pass leaves alone; XLA fuses them with their neighbours.
    """
    x = jnp.asarray(x)
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


@widen.defjvp
def _widen_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (t,) = primals, tangents
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):  # an integer x: no tangent
        t = jnp.zeros(jnp.shape(x), jnp.float32)
    return widen(x), jnp.asarray(t).astype(jnp.float32)


def within_float32(x: Any, xp: Any) -> Any:
    """`x` (a NumPy array with `xp=np`, a JAX one with `jnp`) with its finite values beyond
    float32's range clipped to float32's max, infs and NaNs kept: cast to float32 they would
    become inf, which `saturate` takes for a fault. Narrower dtypes come back as they are."""
    if not xp.issubdtype(x.dtype, xp.floating) or xp.dtype(x.dtype).itemsize <= 4:
        return x
    top = float(np.finfo(np.float32).max)
    return xp.where(xp.isfinite(x), xp.clip(x, -top, top), x)


def _odd_float32(x: Any, xp: Any) -> Any:
    """A float64 (or wider) `x` (NumPy's with `xp=np`, JAX's with `jnp`) rounded to float32 to
    odd: where inexact, to the neighbour whose last bit is 1. Rounded once more, to FP8 (3 or
    2 bits: far fewer than float32's 24), it lands on the value nearest `x`; rounded to nearest
    twice, `1.0625 + 1e-12` went to float32's `1.0625`, a midpoint of E4M3, and down to 1, not
    1.125. Other dtypes come back as they are."""
    if not xp.issubdtype(x.dtype, xp.floating) or xp.dtype(x.dtype).itemsize <= 4:
        return x
    f = x.astype(np.float32)
    bits = f.view(np.int32) if xp is np else lax.bitcast_convert_type(f, jnp.int32)
    toward = xp.where(x > f, np.float32(np.inf), xp.where(x < f, np.float32(-np.inf), f))
    odd = xp.nextafter(f, toward.astype(np.float32))  # f itself where f == x (or NaN)
    return xp.where(((bits & 1) == 0) & (f != x), odd, f)


@jax.custom_jvp
def _narrow(x: Array) -> Array:
    """`_odd_float32(x, jnp)`, with a convert's derivative (a select alone would give none)."""
    return _odd_float32(x, jnp)


@_narrow.defjvp
def _narrow_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (t,) = primals, tangents
    return _narrow(x), t.astype(jnp.float32)


def saturate(x: Array, scale: Array, dtype: DTypeLike) -> Array:
    """Cast `x * scale` (formed in float32) to the FP8 `dtype`, clipping at its max.

    Only finite `x` saturate (even where the product overflows float32): an inf or NaN in `x`
    becomes NaN, so that a fault upstream reaches the GEMM's output (and `all_finite`, and
    loss scaling) instead of turning into the format's max. (NaN, not inf: E4M3 has no inf,
    and a GPU's saturating FP8 conversion turns inf into the max.) A float64 `x`
    (`jax_enable_x64`) beyond float32's range is finite too: it is clipped to float32's max
    before the cast, and saturates.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:
        x = _narrow(within_float32(x, jnp))
    x = widen(x)
    limit = float(jnp.finfo(dtype).max)
    scaled = jnp.clip(x * jnp.asarray(scale, jnp.float32), -limit, limit)
    return jnp.where(jnp.isfinite(x), scaled, jnp.nan).astype(dtype)


def quantize(
    x: Float[ArrayLike, "*shape"], scale: Float[ArrayLike, "*#shape"], fmt: FormatLike
) -> Array:
    """Cast `x * scale` to FP8, saturating finite values at the format's max.

    The product is formed in float32 and rounded to nearest-even by the cast; a float64 `x`
    (NumPy's, or JAX's under `jax_enable_x64`) is narrowed to float32 by rounding to odd, so
    that with a power-of-two scale it lands on the FP8 value nearest it. An inf or NaN in `x`
    becomes NaN: faults are not hidden (see `saturate`); a finite float64 beyond float32's
    range saturates, as NumPy's or under `jax_enable_x64`. `scale` broadcasts to `x`'s
    shape (a scalar, or one per row with shape `(rows, 1)`, say); a scale that would broadcast
    `x` to a larger shape, or not at all (per-block scales: repeat them over each block
    first), is refused.

    **Gradient.** `jax.grad` through `quantize` and [`fp8jax.dequantize`][] passes the
    cotangent straight through the rounding (times `scale`), and 0 where `x * scale`
    saturates; but JAX carries the cotangent of an FP8 array in its FP8 dtype, so the
    gradient reaching `x` is `scale * fp8(g / scale)`: rounded to the format's 3 (E4M3) or 2
    (E5M2) significand bits, 0 below its smallest subnormal, and past its max NaN or inf
    (the max where XLA's conversion saturates). For a straight-through estimator in float32
    (quantization-aware training), keep the FP8 values out of the derivative:
    `x + lax.stop_gradient(dequantize(quantize(x, s, fmt), s) - x)`. fp8jax's GEMMs define
    their own derivatives and are not affected.
    """
    if not isinstance(x, jax.Array):  # NumPy's float64 (or a Python float), on the host
        x = np.asarray(x)
        if x.dtype.kind in "biu":  # as float64: jnp.asarray would wrap int64 beyond int32
            x = x.astype(np.float64)
        _check_real(x.dtype)
        x = _odd_float32(within_float32(x, np), np)  # long double too: JAX has none
    x, scale = jnp.asarray(x), jnp.asarray(scale)
    _check_real(x.dtype)
    check_scale_shape("quantize", x.shape, scale.shape)
    return saturate(x, scale, fp8_dtype(fmt))


def _check_real(dtype: np.dtype) -> None:
    """Refuse values without an FP8 form: complex (the imaginary part would be dropped),
    strings, objects."""
    if not (jnp.issubdtype(dtype, jnp.floating) or dtype.kind in "biu"):
        raise ValueError(
            f"quantize: x of dtype {dtype} has no FP8 value (a complex one's imaginary part "
            "would be dropped); give real numbers: a floating (or integer) array."
        )


def check_scale_shape(what: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """Refuse a `scale_shape` that does not broadcast to the values' `shape` unchanged: a
    silent broadcast would return more values than were given."""
    try:
        fits = jnp.broadcast_shapes(shape, scale_shape) == tuple(shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{what}: a scale of shape {tuple(scale_shape)} does not broadcast to the values' "
            f"shape {tuple(shape)}; give a scalar (one scale per tensor) or an array that "
            "broadcasts to it (size 1 along the axes it shares a scale over). Per-block "
            "scales: repeat each over its block first (jnp.repeat), or keep them in an "
            "fp8jax.QTensor with its block."
        )


def pow2(exponent: Array) -> Array:
    """`2.0**exponent` exactly, as float32 (XLA's `exp2` is an approximation)."""
    return jnp.ldexp(jnp.ones_like(exponent, jnp.float32), exponent)


def floor_log2(x: Array) -> Array:
    """`floor(log2(x))` for positive normal float32 `x` (every scale fp8jax computes: from
    `2**-126` to `2**126`), exactly: `jnp.frexp`'s exponent,
    except where `x` varies over `shard_map`'s manual axes (JAX 0.12 types that exponent as
    invariant there): then from its bits, the biased exponent, or for a subnormal its
    mantissa's highest set bit (integer ops: XLA's CPU arithmetic flushes subnormals)."""
    if not jax_private.varying_axes(x):
        _, exponent = jnp.frexp(x)  # x = m * 2**e with m in [0.5, 1)
        return exponent - 1
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return jnp.where(biased == 0, -149 + 31 - lax.clz(mantissa), biased - 127)


def dequantize(
    q: ArrayLike, scale: Float[ArrayLike, "*#shape"], dtype: DTypeLike = jnp.float32
) -> Array:
    """Undo [`fp8jax.quantize`][]: `q / scale` in float32, cast to `dtype` (XLA may multiply
    by `1 / scale` instead: exact for power-of-two scales, within an ulp of float32 for
    others). `scale` is the one `q` was quantized with, of a shape that broadcasts to `q`'s
    (others are refused);
    `dtype` a floating dtype of 16 bits or more (an integer one would truncate the values, an
    FP8 one round them again: refused)."""
    dtype = float_dtype(dtype, "dequantize: dtype")
    q, scale = jnp.asarray(q), jnp.asarray(scale, jnp.float32)
    check_scale_shape("dequantize", q.shape, scale.shape)
    value = q.astype(jnp.float32) / scale
    return value.astype(dtype)


def transpose_in_words(data: Shaped[Array, "*B R C"]) -> Shaped[Array, "*B C R"]:
    """`swapaxes(data, -1, -2)` of 8-bit `data (*B, R, C)` with `R` and `C` multiples of 4,
    written by XLA in 32-bit words: the array seen as `uint32 (*B, R, C / 4)`, transposed
    word by word, and each 4 x 4 block of bytes transposed inside its four words by shifts
    (XLA fuses those into the transposing kernel). The same bytes; XLA's GPU transpose
    emitter stores 8-bit values one byte per instruction (`st.global.b8`), 32-bit words four
    bytes at a time (`benchmarks/store_widths.py`). Other shapes and dtypes (bool, which
    `bitcast_convert_type` refuses, too): `swapaxes`."""
    *batch, rows, cols = data.shape
    if jnp.dtype(data.dtype).itemsize != 1 or data.dtype == jnp.bool_ or rows % 4 or cols % 4:
        return jnp.swapaxes(data, -1, -2)
    words = lax.bitcast_convert_type(data.reshape(*batch, rows, cols // 4, 4), jnp.uint32)
    # (*B, C/4, R) words, viewed as (*B, C/4, R/4, 4): word i of group (c, r) holds row
    # 4 r + i's elements 4 c .. 4 c + 3, element 4 c + j in byte j (bitcast_convert_type puts
    # the first element in the least significant byte).
    grouped = jnp.swapaxes(words, -1, -2).reshape(*batch, cols // 4, rows // 4, 4)
    byte = np.uint32(0xFF)
    out = [
        functools.reduce(
            operator.or_,
            (((grouped[..., i] >> np.uint32(8 * j)) & byte) << np.uint32(8 * i) for i in range(4)),
        )
        for j in range(4)
    ]
    # (*B, C/4, 4, R/4): row 4 c + j of the result, its words over R.
    stacked = jnp.stack(out, axis=-2).reshape(*batch, cols, rows // 4)
    return lax.bitcast_convert_type(stacked, data.dtype).reshape(*batch, cols, rows)


#: Names of floating dtypes beyond NumPy's own (`float_dtype`).
DTYPE_ALIASES: dict[str, np.dtype] = {
    "float32": np.dtype(jnp.float32),
    "f32": np.dtype(jnp.float32),
    "full": np.dtype(jnp.float32),
    "bfloat16": np.dtype(jnp.bfloat16),
    "bf16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(jnp.float16),
    "f16": np.dtype(jnp.float16),
    "half": np.dtype(jnp.float16),
}
ACCEPTED_DTYPES = (
    "float32 (f32, full), bfloat16 (bf16), float16 (f16, half), or float64 (JAX's 64-bit "
    "float, float32 unless jax_enable_x64)"
)
#: The floating dtypes of 16 bits or more that JAX has arrays of.
JAX_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def float_dtype(value: DTypeLike | str, what: str) -> np.dtype:
    """`value` (a dtype-like, or a name such as `"bf16"`) as a floating NumPy dtype of 16 bits
    or more that JAX has arrays of (`JAX_FLOATS`); `what` names it in the `ValueError` that
    refuses anything else."""
    dtype = None
    if value is None:
        raise ValueError(f"{what}=None: give a dtype; use {ACCEPTED_DTYPES}.")
    if isinstance(value, str):
        if value.strip().lower() in ("f8", "fp8", "float8"):
            raise ValueError(
                f"{what}={value!r} is ambiguous: NumPy reads 'f8' as float64 (8 bytes), an "
                "FP8 library's reader as FP8, which fp8jax's GEMMs quantize to and nothing is "
                f"computed or stored in around them. Spell the dtype out; use {ACCEPTED_DTYPES}."
            )
        dtype = DTYPE_ALIASES.get(value.strip().lower())
    if dtype is None:
        try:
            dtype = np.dtype(value.strip() if isinstance(value, str) else value)
        except TypeError:
            dtype = None
    if dtype is None and isinstance(value, str):
        # Names in any letter case ("Float64"), as the aliases are; NumPy's own spelling is
        # tried first, so that its one-letter codes keep their meaning.
        try:
            dtype = np.dtype(value.strip().lower())
        except TypeError:
            pass
    if dtype is None:
        raise ValueError(f"{what}={value!r} is not a dtype; use {ACCEPTED_DTYPES}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        given = f"{value!r} is {dtype}" if isinstance(value, str) else str(dtype)
        raise ValueError(f"{what}={given}, not a floating-point dtype; use {ACCEPTED_DTYPES}.")
    if dtype.itemsize < 2:
        raise ValueError(
            f"{what}={dtype}: an 8-bit (or narrower) float is what fp8jax's GEMMs quantize to, "
            f"not a dtype to compute or store in around them; use {ACCEPTED_DTYPES}."
        )
    if dtype not in JAX_FLOATS:
        given = f"{value!r} is {dtype}" if isinstance(value, str) else str(dtype)
        raise ValueError(f"{what}={given}: JAX has no arrays of it; use {ACCEPTED_DTYPES}.")
    return dtype

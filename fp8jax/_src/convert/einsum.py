"""A two-operand einsum as an FP8 `dot_general`: which axes it contracts, batches, keeps and in
which order, and the call. Shared by the FP8 einsums of every framework (NNX's `nnx.Einsum`,
Linen's `nn.Einsum`, `jnp.einsum` in any function); it holds no framework."""

from __future__ import annotations

import math
import string
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array


def _einsum_parts(subscripts: str, x_ndim: int, k_ndim: int) -> tuple[str, str, str]:
    """The input, kernel and output subscripts of a two-operand einsum, `...` expanded."""
    spec = subscripts.replace(" ", "")
    if spec.count("->") != 1 or spec.count(",") != 1:
        raise ValueError(
            f"FP8 einsum: subscripts={subscripts!r}: should be an explicit two-operand "
            "equation 'input,kernel->output', e.g. 'btd,dhk->bthk'."
        )
    operands, out = spec.split("->")
    x, k = operands.split(",")
    if "..." in k:
        raise ValueError(
            f"FP8 einsum: subscripts={subscripts!r}: the kernel's subscripts {k!r} may not "
            "hold '...'; name each kernel axis."
        )
    for c in (x + k + out).replace("...", ""):
        if not c.isalpha():
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} names axis {c!r}, which is not a "
                "letter; name each axis by a letter (the input's remaining axes by '...')."
            )
    for name, letters in (("input", x), ("output", out)):
        if letters.count("...") > 1:
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r}: the {name} {letters!r} holds '...' "
                "twice; it may hold it once."
            )
    if "..." in out and "..." not in x:
        raise ValueError(
            f"FP8 einsum: subscripts={subscripts!r}: the output {out!r} holds '...' but the "
            f"input {x!r} does not."
        )
    if "..." in x and "..." not in out:
        raise ValueError(
            f"FP8 einsum: subscripts={subscripts!r} sums the axes of the input's '...' (they "
            "are not in the output); FP8 einsums contract axes of both operands (keep '...' "
            "in the output, or sum them before the layer)."
        )
    if "..." in x:
        unused = [c for c in string.ascii_letters if c not in spec]
        n = x_ndim - (len(x) - 3)
        if n < 0 or "..." in x.replace("...", "", 1):
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} does not fit an input of {x_ndim} axes."
            )
        fill = "".join(unused[:n])
        x, out = x.replace("...", fill), out.replace("...", fill)
    for name, letters, ndim in (("input", x, x_ndim), ("kernel", k, k_ndim)):
        if len(letters) != ndim:  # each a letter (checked above; '...' expanded)
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} gives the {name} {len(letters)} axes "
                f"({letters!r}), but it has {ndim}."
            )
    for name, letters in (("input", x), ("kernel", k), ("output", out)):
        if len(set(letters)) != len(letters):
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} repeats an axis of the {name} "
                f"({letters!r}); FP8 einsums take each name once per operand."
            )
    for c in x + k:
        if c not in out and (c not in x or c not in k):
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} sums axis {c!r} of one operand "
                "only; FP8 einsums contract axes of both operands (sum it before the layer)."
            )
    if not set(out) <= set(x + k):
        raise ValueError(
            f"FP8 einsum: subscripts={subscripts!r}: output {out!r} names an axis of neither "
            "operand."
        )
    return x, k, out


def einsum_dimension_numbers(
    subscripts: str, x_ndim: int, k_ndim: int
) -> tuple[Any, tuple[int, ...]]:
    """`lax.dot_general` dimension numbers for the einsum `input,kernel->output`, and the
    permutation taking the `dot_general` result (batch, input's free, kernel's free axes) to
    the output's order."""
    x, k, out = _einsum_parts(subscripts, x_ndim, k_ndim)
    contract = [c for c in x if c in k and c not in out]
    batch = [c for c in out if c in x and c in k]
    dims = (
        (tuple(x.index(c) for c in contract), tuple(k.index(c) for c in contract)),
        (tuple(x.index(c) for c in batch), tuple(k.index(c) for c in batch)),
    )
    result = batch + [c for c in x if c not in k] + [c for c in k if c not in x]
    return dims, tuple(result.index(c) for c in out)


def check_einsum(subscripts: str, kernel_ndim: int) -> None:
    """Raise the `ValueError` the FP8 einsum would raise at its call for an equation it cannot
    run (the input's `...` taken as no axis: its rank is only known then)."""
    x_spec = subscripts.replace(" ", "").split("->")[0].split(",")[0]
    _einsum_parts(subscripts, len(x_spec.replace("...", "")), kernel_ndim)


def check_layer_einsum(layer: str, subscripts: Any, x_ndim: int, k_ndim: int) -> None:
    """Raise the FP8 einsum's `ValueError` for an equation it cannot run, naming `layer` and
    how to keep it in high precision (a call with subscripts not a str is left to refuse)."""
    if not isinstance(subscripts, str):
        return
    try:
        _einsum_parts(subscripts, x_ndim, k_ndim)
    except ValueError as e:
        raise ValueError(
            f"fp8_linear_layers: {layer}: {e} Exclude it (Fp8Config targets or exclude) to "
            "keep it in high precision."
        ) from None


def einsum_kernel_shape(subscripts: str | None, kernel_shape: tuple[int, ...]) -> Any:
    """The canonical `(N, K)` matrix of an einsum's kernel (free axes, contracted axes), or
    `None` when the equation is given only at call time or the kernel has batch axes."""
    if subscripts is None:
        return None
    spec = subscripts.replace(" ", "")
    x_spec = spec.split("->")[0].split(",")[0]
    x_ndim = len(x_spec.replace("...", ""))
    try:
        x, k, out = _einsum_parts(spec, x_ndim, len(kernel_shape))
    except ValueError:
        return None  # reported when the layer runs
    if any(c in x and c in out for c in k):
        return None
    free = math.prod(d for c, d in zip(k, kernel_shape, strict=True) if c not in x)
    contracted = math.prod(d for c, d in zip(k, kernel_shape, strict=True) if c in x)
    return (free, contracted)


def fp8_einsum(
    dot: Any,
    subscripts: str,
    lhs: ArrayLike,
    rhs: ArrayLike,
    precision: Any = None,
    preferred_element_type: DTypeLike | None = None,
) -> Array:
    """`jnp.einsum(subscripts, lhs, rhs)` as the FP8 GEMM `dot` (an `Fp8DotGeneral`), `rhs`
    in the kernel's role: one `dot_general` (contracted axes, batch axes of both operands kept
    in the output), then a transpose to the output's order."""
    if not isinstance(subscripts, str):
        raise TypeError(f"FP8 einsum: subscripts={subscripts!r} should be a str.")
    dims, perm = einsum_dimension_numbers(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
    x, k, _ = _einsum_parts(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
    x_shape, k_shape = jnp.shape(lhs), jnp.shape(rhs)
    for c in x:
        if c in k and x_shape[x.index(c)] != k_shape[k.index(c)]:
            # jnp.einsum broadcasts a size-1 axis; a dot_general does not.
            raise ValueError(
                f"FP8 einsum: subscripts={subscripts!r} gives axis {c!r} size "
                f"{x_shape[x.index(c)]} in the input {x_shape} but {k_shape[k.index(c)]} in "
                f"the kernel {k_shape}; FP8 einsums take each axis the operands share at "
                "one size in both operands (broadcast an axis of size 1 first, e.g. "
                "jnp.broadcast_to)."
            )
    return jnp.transpose(dot(lhs, rhs, dims, precision, preferred_element_type), perm)

"""An Equinox Linear whose matmul is an injectable `dot_general`.

`eqx.nn.Linear` computes `weight @ x` and has no slot for a custom `dot_general`, so
[`fp8jax.fp8_linear_layers`][] replaces it by this module, with the same weight and bias.
"""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from ..core.formats import float_dtype
from ..ops.dot_general import Fp8DotGeneral

#: The two 16-bit floats, which `jnp.promote_types` (an `eqx.nn.Linear`'s `@`) takes to float32.
_HALVES = {np.dtype(jnp.bfloat16), np.dtype(np.float16)}


def _is_array_like(x: object) -> bool:
    """An array, a tracer or a `jax.ShapeDtypeStruct`: has a shape and a dtype."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def one_of_stack(x: Any, lead: int) -> Any:
    """The first layer's `x` of a stack of layers with `lead` leading axes (its shape, for an
    abstract model's `jax.ShapeDtypeStruct`); `x` itself for one layer, or `None`."""
    if x is None or not lead:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[lead:], x.dtype)
    return x[(0,) * lead]


def _check_features(name: str, value: object, size: int) -> int | Literal["scalar"]:
    """`in_features`/`out_features` must agree with the weight (eqx.nn.Linear's convention);
    returns the value to keep (`size` for `None` or an int, NumPy's too)."""
    if value is None:
        return size
    if not isinstance(value, bool) and isinstance(value, int | np.integer) and value == size:
        return size
    if isinstance(value, str) and value == "scalar" and size == 1:
        return "scalar"
    allowed = f"None or {size}" + (" or 'scalar'" if size == 1 else "")
    raise ValueError(f"Linear {name}={value!r} does not match the weight: should be {allowed}.")


class Linear(eqx.Module):
    """`y = x @ weight.T + bias`, the matmul done by `dot_general` (an FP8 one by default).

    Same fields and call as `eqx.nn.Linear`: `weight` has shape `(out_features, in_features)`.
    It also accepts leading axes on `x`, so both `jax.vmap(linear)(x)` and `linear(x)` work on a
    batch.

    **Arguments:**

    - `weight`: `(out_features, in_features)`.
    - `bias`: `(out_features,)` or `None`.
    - `in_features`, `out_features`: ints, or `"scalar"` as in `eqx.nn.Linear`.
    - `dot_general`: the GEMM, a [`fp8jax.Fp8DotGeneral`][] unless you pass another.
    - `compute_dtype`: `None` (the output's dtype is `x`'s and the weight's promotion, as
      `eqx.nn.Linear`'s: float32 for BF16 with float16, where `lax.dot_general` gives BF16),
      or the dtype of the output where the weight is a wider master: set by
      [`fp8jax.Policy`][]'s `cast_to_compute`, which leaves an FP8 layer's float32 weight
      uncast so that the FP8 GEMM quantizes it from the master in one pass (no BF16 copy
      written and read again) and, `x` being cast to this dtype too, writes the weight's
      gradient in it, as a cast's would be (beside a float32 `x` it stays float32). The
      bias is added in this dtype too, as a cast layer's is.
    """

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    dot_general: Fp8DotGeneral
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    compute_dtype: np.dtype | None = eqx.field(static=True)

    def __init__(
        self,
        weight: Float[Array, "out in"],
        bias: Float[Array, " out"] | None,
        *,
        in_features: int | Literal["scalar"] | None = None,
        out_features: int | Literal["scalar"] | None = None,
        dot_general: Fp8DotGeneral | None = None,
        compute_dtype: DTypeLike | None = None,
    ):
        if not _is_array_like(weight):
            raise TypeError(
                f"Linear weight is a {type(weight).__name__}; should be an array of shape "
                "(out_features, in_features)."
            )
        if jnp.ndim(weight) != 2:
            raise ValueError(
                f"Linear weight has shape {jnp.shape(weight)}; should be (out_features, "
                "in_features)."
            )
        if not jnp.issubdtype(weight.dtype, jnp.floating):
            raise TypeError(
                f"Linear weight has dtype {weight.dtype}; should be a floating dtype (float32, "
                "bfloat16, float16)."
            )
        out_size, in_size = jnp.shape(weight)
        if bias is not None and not _is_array_like(bias):
            raise TypeError(
                f"Linear bias is a {type(bias).__name__}; should be an array of shape "
                f"({out_size},) or None."
            )
        if bias is not None and jnp.shape(bias) != (out_size,):
            raise ValueError(
                f"Linear bias has shape {jnp.shape(bias)}; should be ({out_size},) to match "
                f"weight {jnp.shape(weight)}."
            )
        in_features = _check_features("in_features", in_features, in_size)
        out_features = _check_features("out_features", out_features, out_size)
        if dot_general is not None and not callable(dot_general):
            raise TypeError(
                f"Linear dot_general={dot_general!r}: should be None (an fp8jax.Fp8DotGeneral) "
                "or a callable with the signature of jax.lax.dot_general, e.g. "
                "fp8jax.Fp8DotGeneral('current')."
            )
        self.weight = weight
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias is not None
        self.dot_general = Fp8DotGeneral() if dot_general is None else dot_general
        self.compute_dtype = (
            None if compute_dtype is None else float_dtype(compute_dtype, "Linear compute_dtype")
        )

    @classmethod
    def from_eqx(cls, linear: eqx.nn.Linear, dot_general: Fp8DotGeneral | None = None) -> Linear:
        """The same layer as `linear` (an `eqx.nn.Linear`), its matmul done by `dot_general`.
        Its sizes are the weight's, as `linear`'s call takes them: an int `in_features` or
        `out_features` left stale by `eqx.tree_at` surgery on the weight is not checked there."""

        def size(value: Any) -> Any:
            return "scalar" if isinstance(value, str) and value == "scalar" else None

        return cls(
            linear.weight,
            linear.bias,
            in_features=size(linear.in_features),
            out_features=size(linear.out_features),
            dot_general=dot_general,
        )

    def with_compute_dtype(self, compute_dtype: DTypeLike | None) -> Linear:
        """This layer, its output in `compute_dtype` (`None`: `dot_general`'s promotion),
        all else as it is; also a stack of layers (weights `(*layers, out, in)`, as
        `fp8jax.fp8_linear_layers` converts Linears built under `eqx.filter_vmap`)."""
        lead = len(self.weight.shape) - 2
        one = Linear(
            one_of_stack(self.weight, lead),
            one_of_stack(self.bias, lead),
            in_features=self.in_features,
            out_features=self.out_features,
            dot_general=self.dot_general,
            compute_dtype=compute_dtype,
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias, m.dot_general),
            one,
            (self.weight, self.bias, self.dot_general),
            is_leaf=lambda x: x is None,
        )

    def __call__(
        self, x: Float[Array, "*batch in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch out"]:
        """**Arguments:** `x` of shape `(..., in_features)` (or `()` for `"scalar"`).

        **Returns:** shape `(..., out_features)` (or `()` for `"scalar"`).
        """
        del key
        if len(self.weight.shape) > 2:
            lead = tuple(self.weight.shape[:-2])
            fp8 = f" (its FP8 state a stack of {lead} states too)"
            raise ValueError(
                f"Linear weight has shape {tuple(self.weight.shape)}, a stack of {lead} layers' "
                f"weights{fp8 if isinstance(self.dot_general, Fp8DotGeneral) else ''}: it was "
                "called on the whole stack. Call the layer one member at a time: under "
                "jax.vmap or lax.scan over the stack's axis, e.g. "
                "eqx.filter_vmap(lambda layer, x: layer(x))(stack, xs)."
            )
        in_size = self.weight.shape[1]
        if self.in_features == "scalar":
            if jnp.ndim(x) != 0:
                raise ValueError(
                    f"Linear with in_features='scalar' got x of shape {jnp.shape(x)}; should be ()."
                )
            x = jnp.reshape(x, (1,))
        if not _is_array_like(x):
            raise TypeError(
                f"Linear expects x as an array of shape (..., {in_size}); got a {type(x).__name__}."
            )
        if jnp.ndim(x) == 0 or x.shape[-1] != in_size:
            raise ValueError(f"Linear expects x of shape (..., {in_size}); got {jnp.shape(x)}.")
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        out = self.compute_dtype
        if out is None and {np.dtype(x.dtype), np.dtype(self.weight.dtype)} == _HALVES:
            # `eqx.nn.Linear`'s `weight @ x` promotes these to float32; `lax.dot_general`, BF16.
            out = np.dtype(np.float32)
        if out is None:
            y = self.dot_general(x, self.weight, dims)
        else:
            y = self.dot_general(x, self.weight, dims, preferred_element_type=out)
        if self.bias is not None:
            # In `compute_dtype`, as the bias of a layer cast to it is: a wider one would
            # promote the output back.
            bias = self.bias if self.compute_dtype is None else self.bias.astype(self.compute_dtype)
            y = y + bias
        if self.out_features == "scalar":
            y = jnp.squeeze(y, -1)
        return y

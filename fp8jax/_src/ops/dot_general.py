"""`Fp8DotGeneral`: a drop-in, stateful replacement for `jax.lax.dot_general`."""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array

from ..core.stats import Fp8Stats
from ..core.updates import OverwriteWithGradient
from ..gemm.dense import States, fp8_dot_general, normalize_dimension_numbers
from ..recipes import ROLES, Recipe, TensorState, recipe_from

#: Prefix of the name scope of every FP8 GEMM: `fp8jax[<layer path>]/fwd|dgrad|wgrad`.
SCOPE = "fp8jax"


def check_float(
    name: str, x: Any, where: str = "Fp8DotGeneral", op: str = "jax.lax.dot_general"
) -> np.dtype:
    """The dtype of operand `name` of an FP8 GEMM, which must be a high-precision real float
    array; `where` names the layer in errors, `op` the high-precision operation it stands
    for."""
    if isinstance(x, bool) or not isinstance(x, jax.Array | np.ndarray | np.generic | int | float):
        raise TypeError(
            f"{where}: {name}={x!r} is not an array; pass a jax or NumPy array of "
            f"floats (float32, bfloat16, float16), as to {op}."
        )
    dtype = np.dtype(jnp.result_type(x))
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{where}: {name} has dtype {dtype}; FP8 has no complex format. Use a "
            f"high-precision {op} for complex GEMMs, or split real and imaginary parts into "
            "real GEMMs."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{where}: {name} has dtype {dtype}; FP8 GEMMs take floating inputs "
            "(float32, bfloat16, float16). Cast integer data before the layer."
        )
    if dtype.itemsize == 1:
        raise TypeError(
            f"{where}: {name} is already {dtype}; pass the high-precision tensor and let "
            "the recipe quantize it."
        )
    return dtype


def _received(state: TensorState) -> tuple[Array, Array]:
    """Whether a received state is a real update, and whether it is one to reject.

    A zero cotangent (a zero scale) means the layer was not used this step, or its output
    got no gradient: nothing was received. An inf or NaN anywhere in it (the operand held
    one, so its amax is not finite) is rejected: it never enters a history, where with
    `amax_compute="max"` it would freeze the scale for the history's length. Per layer of a
    stacked state.
    """
    lead = jnp.ndim(state.scale)
    finite = [
        jnp.all(jnp.isfinite(a), axis=tuple(range(lead, jnp.ndim(a))))
        for a in jax.tree.leaves(state)
    ]
    finite = functools.reduce(jnp.logical_and, finite)
    take = finite & (state.scale > 0)
    return take, ~finite


def pick_received(old: Any, received: Any, ok: Array) -> Any:
    """`received` where `ok`, `old` elsewhere, leaf by leaf (in `old`'s dtypes). `ok` is a
    scalar, or has the leading axes of the leaves (one flag per expert, say)."""
    return jax.tree.map(
        lambda o, r: jnp.where(
            jnp.reshape(ok, ok.shape + (1,) * (o.ndim - ok.ndim)), r.astype(o.dtype), o
        ),
        old,
        received,
    )


def merge_stats(old: Fp8Stats, new: Fp8Stats, received: dict[str, tuple[Array, Array]]) -> Fp8Stats:
    """Each operand's fresh statistics where its state was taken, the old ones elsewhere,
    and the count of rejected updates advanced (`received`: `_received` of each role's
    state; per expert for a grouped layer's kernel)."""
    stats = {}
    for r in ROLES:
        before, (take, reject) = getattr(old, r), received[r]
        count = before.rejected + reject.astype(before.rejected.dtype)
        fresh = eqx.tree_at(lambda s: s.rejected, getattr(new, r), before.rejected)
        stats[r] = eqx.tree_at(lambda s: s.rejected, pick_received(before, fresh, take), count)
    return Fp8Stats(**stats)


class Fp8DotGeneral(OverwriteWithGradient):
    """`jax.lax.dot_general` computed as FP8 GEMMs, with its scaling state.

    Call it exactly like `lax.dot_general`. The forward quantizes both operands (E4M3 by
    default) and multiplies real FP8 arrays; a `custom_vjp` saves only those FP8 operands and
    their scales, quantizes the incoming gradient (E5M2 by default) and computes dgrad and wgrad
    as FP8 x FP8 dots.

    The state (a [`fp8jax.TensorState`][] each for `input`, `kernel` and `output_grad`) is
    updated by the gradient: the "gradient" of this module is its new value. Split it out with
    [`fp8jax.partition_for_grad_overwrite`][] and write it back with
    [`fp8jax.apply_updates`][].

    **Arguments:**

    - `recipe`: a [`fp8jax.DelayedScaling`][] (the default) or another recipe, or its name.
    - `kernel_shape`: `(N, K)`, the kernel as a matrix with its contracted axes last; only
      recipes that keep weight-shaped state need it (`ResidualFP8(error_feedback=True)`).
    - `name`: the layer's path, e.g. `"blocks.0.mlp.fc1"` (set by `fp8_linear_layers`). The
      GEMMs run under the name scope `fp8jax[<name>]/fwd` (`dgrad`, `wgrad`), which is how
      [`fp8jax.inspect`][fp8jax.observe.inspect] attributes compiled GEMMs to layers.
    - `telemetry`: also keep [`fp8jax.Fp8Stats`][] (the fractions of each operand saturated and
      flushed to zero at the latest step) in `stats`; see [`fp8jax.telemetry`][]. It costs
      two extra reductions over each operand, which XLA fuses with the amax.

    ```python
    dot = fp8jax.Fp8DotGeneral()
    y = dot(x, w, (((1,), (0,)), ((), ())))   # x @ w, in FP8
    ```
    """

    input: TensorState
    kernel: TensorState
    output_grad: TensorState
    stats: Fp8Stats | None
    recipe: Recipe = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(
        self,
        recipe: Recipe | str | None = None,
        kernel_shape: tuple[int, int] | None = None,
        name: str = "",
        telemetry: bool = False,
    ):
        if not isinstance(telemetry, bool):
            raise TypeError(f"Fp8DotGeneral: telemetry={telemetry!r}: should be True or False.")
        if not isinstance(name, str):
            raise TypeError(f"Fp8DotGeneral: name={name!r}: should be a str (the layer's path).")
        if kernel_shape is not None and (
            not isinstance(kernel_shape, tuple | list)
            or len(kernel_shape) != 2
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in kernel_shape
            )
        ):
            raise ValueError(
                f"Fp8DotGeneral: kernel_shape={kernel_shape!r}: should be None or "
                "(out_features, in_features), two ints >= 0: the kernel as a matrix with its "
                "contracted axes last."
            )
        self.recipe = recipe_from(recipe)
        self.name = name
        self.stats = Fp8Stats.zeros() if telemetry else None
        self.input = self.recipe.init_state("input")
        self.kernel = self.recipe.init_state("kernel", kernel_shape)
        self.output_grad = self.recipe.init_state("output_grad")

    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
    ) -> Array:
        lhs_dtype = check_float("lhs", lhs)
        rhs_dtype = check_float("rhs", rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        dims = normalize_dimension_numbers(dimension_numbers, lhs.shape, rhs.shape)
        if preferred_element_type is None:
            out_dtype = np.dtype(jnp.promote_types(lhs_dtype, rhs_dtype))
        else:
            try:
                out_dtype = np.dtype(preferred_element_type)
            except TypeError:
                out_dtype = None
            if (
                out_dtype is None
                or not jnp.issubdtype(out_dtype, jnp.floating)
                or out_dtype.itemsize < 2
            ):
                shown = preferred_element_type if out_dtype is None else out_dtype
                raise TypeError(
                    f"Fp8DotGeneral: preferred_element_type={shown} is not "
                    "a high-precision float type; use float32, bfloat16 or float16 (the GEMM "
                    "accumulates in float32 and writes that type; an FP8 output would be cast "
                    "without a scale or saturation)."
                )
        if isinstance(precision, list):
            precision = tuple(precision)
        states = States(self.input, self.kernel, self.output_grad, self.stats)
        with jax.named_scope(f"{SCOPE}[{self.name}]"):
            return fp8_dot_general(
                self.recipe, dims, precision, out_dtype, lhs, rhs, states, self.name
            )

    def merge(self, new: Fp8DotGeneral) -> Fp8DotGeneral:
        """Take each operand's received state where it is a real, finite update.

        A zero cotangent (the layer was not used this step, or its output got no gradient)
        leaves that operand's state as it was. So does a state holding an inf or NaN (the
        operand held one: the fault itself reaches the GEMM's output as NaN); telemetry
        counts those steps in `stats.<role>.rejected`.
        """

        received = {role: _received(getattr(new, role)) for role in ROLES}
        merged = {
            r: pick_received(getattr(self, r), getattr(new, r), received[r][0]) for r in ROLES
        }
        if self.stats is not None:
            merged["stats"] = merge_stats(self.stats, new.stats, received)
        return eqx.tree_at(
            lambda m: tuple(getattr(m, name) for name in merged),
            self,
            tuple(merged.values()),
        )

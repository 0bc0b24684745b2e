"""The recipe interface: how each operand of an FP8 GEMM is scaled, cast and multiplied.

Recipes see every GEMM in one canonical form (the GEMM paths of `fp8jax._src.gemm.dense` reshape any
`dot_general` into it): operands of shape `(*B, rows, cols)` with at most one leading batch
axis, contracted over their last axis (`axis=-1`) or their rows (`axis=-2`). The forward is
`x (*B, M, K) . w (*B, N, K)`, both contracted on `-1`; dgrad is `g (*B, M, N)` on `-1` with
`w` on `-2`; wgrad is `g` on `-2` with `x` on `-2`.

A recipe is a frozen dataclass of Python configuration. Its methods are pure functions:

1. `quantize(x, state, role, axis)`: FP8 [`fp8jax.QTensor`][] laid out for a GEMM that
   contracts `axis`, and the role's new state;
2. `retile(q, role, axis, source=None)`: the same tensor laid out to be contracted over `axis`
   instead (the dgrad contracts the kernel over its outputs, the wgrad the activation over its
   tokens). The forward retiles the kernel from its high-precision `source` (one rounding);
   the backward retiles the saved activation from its FP8 values (DeepSeek-V3's choice: no
   high-precision copy is kept);
3. `dot(lhs, rhs, lhs_axis, rhs_axis, precision)`: the float32 product of two `QTensor`s.

`quantize_both(x, state, role)` gives the output gradient's two layouts (dgrad and wgrad) at
once: by default `quantize` twice; a recipe that writes both in one pass overrides it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from ..core.amax import amax
from ..core.formats import (
    FormatLike,
    amd_format,
    check_scale_shape,
    expand_blocks,
    format_name,
    fp8_dtype,
)
from ..core.stats import OperandStats, cast_statistics
from ..kernels import BLOCK_GEMM_NAME, dispatch
from ..kernels.partition import Dim, GemmDims

Role = Literal["input", "kernel", "output_grad"]
ROLES: tuple[Role, ...] = ("input", "kernel", "output_grad")
Axis = Literal[-1, -2]

_PRECISIONS = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}


class TensorState(eqx.Module):
    """Scaling state of one operand of an FP8 GEMM (input, kernel or output gradient).

    **Fields:**

    - `scale`: the per-tensor scale; values are multiplied by it before the cast (Transformer
      Engine's convention; Flax stores `1 / scale`). Delayed scaling keeps the scale its next
      step uses, computed from the history when the step's state is merged (0 until the
      history first holds an amax, with the warm start on; a scale once recorded is kept
      through all-zero steps, a short history emptied again included); current scaling the
      scale of the latest step. Block-scaled recipes record `fp8_max / amax` here, for
      telemetry.
    - `amax_history`: recent amaxes, newest at index 0, the second newest at the end
      (Transformer Engine rolls by -1, then writes index 0). Recipes without a history keep one.
    - `scale_inv`: `1 / scale`, or 1 where `scale` is 0, computed when the state is built or
      merged. Without the warm start a cast takes `scale` as it is, with no check per step: a
      state holding 0 (a warm-start layer's, none recorded) moved into such a layer by hand
      casts every operand to 0 until merged (`op.merge(op)` sets 1, Transformer Engine's, as
      `load_checkpoint` does for a restored one). Delayed scaling hands
      `scale_inv` to the GEMM as it is: cuBLASLt's FP8 GEMM takes it as an operand, where an inverse
      computed in the step is a kernel of its own per GEMM. Left out, it is computed from
      `scale`; a state edited by hand (`eqx.tree_at` on `scale`) must set both, or be merged
      ([`fp8jax.Fp8DotGeneral.merge`][]), which computes it again.
    """

    scale: Float[Array, ""]
    amax_history: Float[Array, " history"]
    scale_inv: Float[Array, ""]

    def __init__(
        self,
        scale: Float[ArrayLike, "*lead"],
        amax_history: Float[ArrayLike, "*lead history"],
        scale_inv: Float[ArrayLike, "*lead"] | None = None,
    ):
        self.scale = scale
        self.amax_history = amax_history
        self.scale_inv = inverse_scale(scale) if scale_inv is None else scale_inv


def inverse_scale(scale: Float[ArrayLike, "*lead"]) -> Float[Array, "*lead"]:
    """`1 / scale` where `scale > 0`, else 1: a [`fp8jax.TensorState`][]'s `scale_inv`."""
    scale = jnp.asarray(scale, jnp.float32)
    ok = scale > 0.0
    return jnp.where(ok, 1.0 / jnp.where(ok, scale, 1.0), 1.0)


class QTensor(eqx.Module):
    """An FP8 tensor and what turns it back into real values: `data * scale_inv`.

    **Fields:**

    - `data`: the FP8 values, shape `(*B, rows, cols)`.
    - `scale_inv`: a float32 scalar (per-tensor recipes), one per member of the leading batch
      axes, shape `(*B,)` (a grouped layer's kernel: one per expert), or one value per block,
      shape `(*B, ceil(rows / block[0]), ceil(cols / block[1]))`.
    - `block`: `()` for per-tensor scaling, else the block shape `(block_rows, block_cols)`.
    """

    data: Array
    scale_inv: Array
    block: tuple[int, ...] = eqx.field(static=True, default=())

    def dequantize(self) -> Float[Array, "*shape"]:
        """The real values this tensor stands for, in float32. A `scale_inv` of another shape
        than the fields above say is refused: repeated over blocks, or broadcast, it would
        scale the wrong values without a word."""
        data = self.data.astype(jnp.float32)
        scale_inv = self.scale_inv.astype(jnp.float32)
        if not self.block:
            if 0 < scale_inv.ndim < data.ndim:  # per batch member: the leading axes
                scale_inv = scale_inv.reshape(scale_inv.shape + (1,) * (data.ndim - scale_inv.ndim))
            check_scale_shape("QTensor.dequantize (per-tensor)", data.shape, scale_inv.shape)
            return data * scale_inv
        *batch, rows, cols = data.shape
        blocks = (*batch, -(-rows // self.block[0]), -(-cols // self.block[1]))
        if scale_inv.shape != tuple(blocks):
            raise ValueError(
                f"QTensor.dequantize: data of shape {data.shape} in blocks {self.block} needs "
                f"scale_inv of shape {tuple(blocks)} (one per block), not {scale_inv.shape}."
            )
        return data * expand_blocks(scale_inv, self.block, self.data.shape)


def gemm_dims(lhs: Any, rhs: Any, lhs_axis: Axis, rhs_axis: Axis) -> GemmDims:
    """The axes of a GEMM's quantized operands (each a [`fp8jax.QTensor`][] or a pytree of
    them, contracted on `lhs_axis` / `rhs_axis`), for running a native kernel per shard
    (`fp8jax._src.kernels.partition`): batch `b`, free `m` (lhs) and `n` (rhs), contracted
    `k`; a block scale's axes span its block."""

    def tensor(q: QTensor, free: str, axis: Axis) -> list[tuple[Dim, ...]]:
        batch = (("b", 1),) * (q.data.ndim - 2)
        rows, cols = (free, "k") if axis == -1 else ("k", free)
        data = batch + ((rows, 1), (cols, 1))
        if q.scale_inv.ndim == 0:
            return [data, ()]
        if q.scale_inv.ndim < q.data.ndim:  # a per-tensor scale per batch member
            return [data, (("b", 1),) * q.scale_inv.ndim]
        return [data, batch + ((rows, q.block[0]), (cols, q.block[1]))]

    def operand(tree: Any, free: str, axis: Axis) -> list[tuple[Dim, ...]]:
        tensors = jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, QTensor))
        return [d for q in tensors for d in tensor(q, free, axis)]

    batch = ("b",) * (jax.tree.leaves(lhs)[0].ndim - 2)
    return GemmDims(
        tuple(operand(lhs, "m", lhs_axis) + operand(rhs, "n", rhs_axis)), batch + ("m", "n")
    )


def on_block_kernel(
    native_kernel: bool | None,
    native: Any,
    xla: Any,
    lhs: Any,
    rhs: Any,
    lhs_axis: Axis,
    rhs_axis: Axis,
    out_dtype: Any,
) -> Array:
    """`native(lhs, rhs, out_dtype=...)`, fp8jax's block-scaled kernel, or `xla(lhs, rhs)`, as
    `native_kernel` says (`dispatch.choose`); on a mesh each device runs the kernel on its
    shards, the partitioned call named after the kernel."""
    dims = gemm_dims(lhs, rhs, lhs_axis, rhs_axis)
    return dispatch.choose(
        native_kernel, native, xla, lhs, rhs, dims=dims, out_dtype=out_dtype, name=BLOCK_GEMM_NAME
    )


def check_choice(name: str, value: object, allowed: tuple) -> None:
    """Raise `ValueError` naming `value` and the `allowed` ones unless `value` is allowed."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}: should be one of {list(allowed)}.")


def check_flags(recipe: object, *names: str) -> None:
    """Raise `ValueError` unless each named field of `recipe` is a bool."""
    for name in names:
        value = getattr(recipe, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: should be True or False.")


#: The largest margin, in binades, either way: FP8's widest format, E5M2, spans 32. Past it
#: every value flushes to zero (or saturates), and a GEMM's two inverse scales, each carrying
#: `2**margin`, overflow float32 in their product (`inf * 0`: NaN outputs) at ordinary amaxes.
MAX_MARGIN = 32


def check_margin(margin: object) -> None:
    """Raise `ValueError` unless `margin` is a real number from `-MAX_MARGIN` to `MAX_MARGIN`."""
    if (
        isinstance(margin, bool)
        or not isinstance(margin, int | float)
        or not math.isfinite(margin)
        or abs(margin) > MAX_MARGIN
    ):
        raise ValueError(
            f"margin={margin!r}: should be a finite number of binades of headroom from "
            f"-{MAX_MARGIN} to {MAX_MARGIN} (0 for none; FP8's widest format, E5M2, spans 32)."
        )


def check_positive_int(name: str, value: object) -> None:
    """Raise `ValueError` unless `value` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: should be an int >= 1.")


#: The values of a recipe's `weight_gather` option.
WEIGHT_GATHERS = ("once", "per_gemm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe(abc.ABC):
    """Interface every scaling recipe implements (see the module docstring).

    **Arguments shared by all recipes:**

    - `backward_precision`: precision of the dgrad and wgrad dots: `"highest"` (the default)
      turns off cuBLASLt's fast FP8 accumulation on H100, as Transformer Engine does for
      gradients, and makes fp8jax's grouped (expert) kernels add each 128-element chunk's
      product to a float32 sum; `"default"` allows fast accumulation in both. The forward
      dot uses the caller's `precision`.
    - `axis_names`: mesh axes to take amaxes over inside `shard_map` (a `pmax`). Under plain
      `jit` with sharded arrays the amax is already global; leave this empty there.
    - `weight_gather`: how a weight that XLA gathers for its GEMMs (sharded for FSDP under
      `jit`) reaches the dgrad. `"once"` (default): the forward's gathered FP8 copy is kept
      until the dgrad, one all-gather per step (under a `lax.scan` over layers too), at the
      memory of one gathered FP8 weight per layer between forward and backward.
      `"per_gemm"`: gathered again for the dgrad, twice the all-gather bytes and nothing
      kept (FSDP's re-gather in the backward). On one device the two are the same.
    """

    backward_precision: str = "highest"
    axis_names: tuple[str, ...] = ()
    weight_gather: str = "once"

    def __post_init__(self) -> None:
        # A NumPy scalar is the Python number (or string) it holds (`history_len=np.int64(16)`,
        # `amax_compute=np.str_("max")`): then the checks below take it, and the recipe
        # compares, hashes and reads (repr) as one given the Python value.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, np.integer | np.floating | np.bool_ | np.str_):
                object.__setattr__(self, field.name, value.item())
        check_choice("backward_precision", self.backward_precision, tuple(_PRECISIONS))
        check_choice("weight_gather", self.weight_gather, WEIGHT_GATHERS)
        names = self.axis_names
        if not isinstance(names, tuple | list) or not all(isinstance(a, str) for a in names):
            raise ValueError(
                f"axis_names={names!r}: should be a tuple of mesh axis names, e.g. ('data',)."
            )
        object.__setattr__(self, "axis_names", tuple(names))  # hashable: recipes are static

    def backward_dot_precision(self) -> lax.Precision:
        """`backward_precision` as a `lax.Precision`."""
        return _PRECISIONS[self.backward_precision]

    def amax(self, x: Array, owner: Array) -> Float[Array, ""]:
        """`max(|x|)`: batch-wide under `vmap` (unless `owner`, a state leaf, is batched) and
        across `axis_names` inside `shard_map`."""
        value = amax(x, owner)
        if self.axis_names:
            try:
                value = lax.pmax(value, self.axis_names)
            except (NameError, AssertionError) as e:  # JAX's for an axis not bound here
                mesh = jax.sharding.get_abstract_mesh()
                axes = tuple(getattr(mesh, "axis_names", ()) or ())
                raise ValueError(
                    f"{type(self).__name__} axis_names={self.axis_names!r}: not all are mesh "
                    f"axes of the jax.shard_map this layer runs in (its mesh: {axes or 'none'})."
                    " Name that shard_map's axes; under plain jit leave axis_names empty (the "
                    "amax is global there already)."
                ) from e
        return value

    def statistics(self, x: Array, q: Any, role: Role, owner: Array) -> OperandStats:
        """What quantizing `x` into `q` (from `quantize`, contracted on `-1`) did to it: the
        fractions saturated and flushed to zero, for telemetry. `q` is a
        [`fp8jax.QTensor`][] or has a `terms` tuple of them, the first carrying the
        magnitude; recipes with another layout override this."""
        terms = getattr(q, "terms", (q,))
        return cast_statistics(x, terms, self.format(role), owner, self.axis_names)

    def recorded_scale(self, amax: Float[Array, "*lead"], role: Role) -> Array | None:
        """The scale the state of operand `role` records beside a step's `amax` (positive and
        finite), for recipes whose scale is a function of that amax alone; `None` here (the
        scale of a delayed recipe comes from its history). A layer used several times in a
        step gets its state's leaves by max, the largest amax beside the largest scale:
        its gradient's state takes this scale again ([`fp8jax.filter_value_and_grad`][],
        [`fp8jax.nnx_update_fp8_state`][])."""
        del amax, role
        return None

    @abc.abstractmethod
    def format(self, role: Role) -> jnp.dtype:
        """The FP8 dtype of operand `role`."""

    @abc.abstractmethod
    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> Any:
        """Fresh state for operand `role`; `shape` is the canonical `(N, K)` kernel shape, which
        only recipes that keep weight-shaped state (error feedback) need."""

    @abc.abstractmethod
    def quantize(self, x: Array, state: Any, role: Role, axis: Axis) -> tuple[Any, Any]:
        """`x` as FP8 for a GEMM contracting `axis`, and the role's new state.

        `state` holds float32 arrays. Amaxes that enter the state must come from
        [`fp8jax.Recipe.amax`][] so that `vmap` and several uses of one layer combine by max.
        The new state must record the amax: an inf or NaN in `x` then shows in it, and the
        GEMM keeps the old state instead.
        """

    def quantize_transposed(self, x: Array, state: Any, role: Role) -> tuple[Any, Any, Any]:
        """`quantize(x, state, role, -1)`; the same values transposed (a [`fp8jax.QTensor`][]
        laid out `(*B, cols, rows)`) where the pass that quantized `x` wrote that copy too,
        else `None` (the caller transposes, see `transposed_copies`); and the role's new
        state. Per-tensor recipes write both in one kernel inside
        `cast_transpose_kernel()` (`recipes/per_tensor_pass.py`)."""
        q, new_state = self.quantize(x, state, role, -1)
        return q, None, new_state

    def quantize_both(self, x: Array, state: Any, role: Role) -> tuple[Any, Any, Any]:
        """`x` quantized for a GEMM contracting its last axis and for one contracting its rows
        (the output gradient's copies for the dgrad and the wgrad), and the role's new state
        (the first quantization's). Recipes that can make both in one pass override it."""
        q, new_state = self.quantize(x, state, role, -1)
        q_rows, _ = self.quantize(x, state, role, -2)
        return q, q_rows, new_state

    @property
    def reads_state(self) -> bool:
        """Whether the GEMM's numerics depend on the state carried between steps (a delayed
        scale, an error feedback), not only on the tensors at hand. Such a layer must have
        its state differentiated with its weights, or its scales would never move."""
        return False

    @property
    def stale_state(self) -> str:
        """What goes wrong when a layer that `reads_state` is differentiated without its
        state (the state would never move): a sentence of the error that says so."""
        return "Its state would stay as it is forever."

    @property
    def transposed_copies(self) -> bool:
        """Whether the backward takes the saved activation and kernel, and the output
        gradient for the wgrad, as transposed copies made when they are quantized: for a
        per-tensor [`fp8jax.QTensor`][] (one scale) the copy contracted on its rows is
        its transpose contracted on its columns, which cuBLASLt's FP8 GEMM wants (both
        operands K-major). Made in the pass that quantizes the tensor, it costs no kernel of
        its own, where XLA otherwise transposes each operand before its backward GEMM."""
        return False

    def transposes_apart(self, role: Role) -> bool:
        """With `transposed_copies`: whether the transposed copy of the operand of `role` is
        transposed from its FP8 values by a pass of its own, not written by the pass that
        quantizes it. That pass is then free to reduce the operand's amax as well (XLA fuses
        no reduction into a transposing pass), and it writes one layout: a read of the
        operand fewer (where the cast need not wait for the amax), a transpose of its FP8
        bytes more."""
        del role
        return False

    @abc.abstractmethod
    def retile(self, q: Any, role: Role, axis: Axis, source: Array | None = None) -> Any:
        """`q` (from `quantize`) laid out for a GEMM contracting `axis` instead.

        `source`, when given, is the high-precision tensor `q` was quantized from: a recipe
        whose layout depends on the axis quantizes it again from there (one rounding), rather
        than from `q`'s FP8 values (two).
        """

    @abc.abstractmethod
    def dot(
        self,
        lhs: Any,
        rhs: Any,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision: Any,
        out_dtype: Any = jnp.float32,
    ) -> Float[Array, "*shape"]:
        """The product of the real values of `lhs` and `rhs`, contracting `lhs_axis` with
        `rhs_axis`: shape `(*B, lhs_free, rhs_free)`, in `out_dtype` (accumulated in float32).
        """


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridFormats(Recipe):
    """Recipes with one FP8 format for inputs and kernels and another for output gradients
    (the "hybrid" E4M3/E5M2 scheme of Transformer Engine).

    **Arguments:** `forward_format` (`"e4m3"`), `backward_format` (`"e5m2"`; `"e4m3"` is
    allowed). A GEMM of two E5M2 operands (`forward_format="e5m2"`: the forward, and the
    dgrad and wgrad too with an E5M2 `backward_format`) has no cuBLASLt FP8 kernel: XLA runs
    it as a BF16 GEMM on an H100 (deviceless compile, jax 0.10-0.12); same values, no speed.
    """

    forward_format: FormatLike = "e4m3"
    backward_format: FormatLike = "e5m2"

    def __post_init__(self) -> None:
        super().__post_init__()
        # One spelling per format ("E4M3", jnp.float8_e4m3fn -> "e4m3"): checkpoints compare
        # recipes by their repr.
        object.__setattr__(self, "forward_format", format_name(self.forward_format))
        object.__setattr__(self, "backward_format", format_name(self.backward_format))
        fnuz = [amd_format(f) for f in (self.forward_format, self.backward_format)]
        if fnuz[0] != fnuz[1]:
            raise ValueError(
                f"{type(self).__name__}: forward_format={self.forward_format!r} with "
                f"backward_format={self.backward_format!r} mixes the OCP formats (e4m3, e5m2: "
                "NVIDIA's) with AMD's fnuz ones, which no GEMM takes together: give both "
                "from one family ('e4m3' and 'e5m2', or 'e4m3fnuz' and 'e5m2fnuz')."
            )

    def format(self, role: Role) -> jnp.dtype:
        return fp8_dtype(self.backward_format if role == "output_grad" else self.forward_format)


def canonical_dims(ndim: int, lhs_axis: Axis, rhs_axis: Axis) -> lax.DotDimensionNumbers:
    """`dot_general` dimension numbers for two canonical operands of rank `ndim` (2 or 3)."""
    batch = tuple(range(ndim - 2))
    return ((ndim + lhs_axis,), (ndim + rhs_axis,)), (batch, batch)


def per_tensor_dot(
    lhs: QTensor,
    rhs: QTensor,
    lhs_axis: Axis,
    rhs_axis: Axis,
    precision: Any,
    out_dtype: Any = jnp.float32,
    exact_scales: bool = False,
    kept_inverses: bool = False,
) -> Float[Array, "*shape"]:
    """`dot_general(lhs8, rhs8) * (lhs.scale_inv * rhs.scale_inv)` in `out_dtype`.

    The FP8 dot accumulates in float32 and writes `out_dtype` directly, scaled by one scalar:
    the form XLA's GPU compiler fuses into a single cuBLASLt FP8 GEMM (the scale becomes its
    alpha). A float32 result converted afterwards would cost an extra float32 buffer and lets
    XLA fuse a following bias + GELU epilogue with an auxiliary output into the FP8 GEMM, which
    its cuBLAS path then rejects (a RET_CHECK) when the GELU is rematerialized.

    That form applies the scale in `out_dtype`. It is exact there when `exact_scales` says the
    scales are powers of two (their product then is one too). Otherwise a BF16 factor would
    keep 8 significant bits: one rounding error shared by the whole output, a bias. Such
    scales, and float16 (whose range the unscaled product of two FP8 tensors exceeds: up to
    448 * 57344 per term), are applied in float32 and the result converted.

    With `kept_inverses` (both `scale_inv`s are a state's own, not computed in the step, and
    the step compiles with Triton GEMMs off: delayed scaling inside `cublas_traced`) and
    exact scales, each operand is multiplied by its own inverse instead,
    `dot_general(lhs8 * lhs.scale_inv, rhs8 * rhs.scale_inv)`: the same values, and one
    cuBLASLt FP8 GEMM with both inverses as its own scales, where the product above is a
    kernel of its own. Under XLA's default flags that form would be a BF16 Triton GEMM.
    """
    dims = canonical_dims(lhs.data.ndim, lhs_axis, rhs_axis)
    out_dtype = jnp.dtype(out_dtype)
    f32 = jnp.finfo(jnp.float32)
    wide = exact_scales and jnp.finfo(out_dtype).maxexp >= f32.maxexp
    if kept_inverses and wide:
        lhs_data, rhs_data = (
            q.data.astype(out_dtype) * q.scale_inv.astype(out_dtype) for q in (lhs, rhs)
        )
        return lax.dot_general(
            lhs_data, rhs_data, dims, precision=precision, preferred_element_type=out_dtype
        )
    scale = lhs.scale_inv.astype(jnp.float32) * rhs.scale_inv.astype(jnp.float32)
    direct = out_dtype == f32.dtype or wide
    if not direct:
        out = lax.dot_general(
            lhs.data, rhs.data, dims, precision=precision, preferred_element_type=jnp.float32
        )
        return (out * scale).astype(out_dtype)
    out = lax.dot_general(
        lhs.data, rhs.data, dims, precision=precision, preferred_element_type=out_dtype
    )
    return out * scale.astype(out_dtype)

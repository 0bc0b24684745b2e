"""Residual FP8 (TCFP-style): a weight as the sum of two E4M3 tensors, `W = W_hi + W_lo`.

`W_hi` is `W` in E4M3; `W_lo` is E4M3 of what `W_hi` missed, with its own scale. Two FP8
GEMMs (`x W_hi + x W_lo`) then give about twice E4M3's significand bits, near BF16 precision;
with the activation split the same way, three (`lo x lo` is dropped).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..core.formats import amd_format, fp8_max, quantize
from ..kernels import dispatch
from .base import (
    Axis,
    FormatLike,
    HybridFormats,
    QTensor,
    Role,
    check_flags,
    on_block_kernel,
    per_tensor_dot,
)
from .per_tensor_scale import MAX_SCALE, compute_scale


class ResidualState(eqx.Module):
    """State of one operand under [`fp8jax.ResidualFP8`][].

    **Fields:** `scale` (of the high part) and `amax_history` (its latest amax) as in
    [`fp8jax.TensorState`][]; `lo_scale`, the scale of the residual part (1 when unused);
    `error`, the kernel's quantization error carried to the next step (`None` without error
    feedback), in the canonical `(N, K)` layout.
    """

    scale: Float[Array, ""]
    amax_history: Float[Array, " 1"]
    lo_scale: Float[Array, ""]
    error: Float[Array, "N K"] | None = None


class QTerms(eqx.Module):
    """A tensor as a sum of per-tensor-scaled FP8 terms (high part first)."""

    terms: tuple[QTensor, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResidualFP8(HybridFormats):
    """Residual FP8: weights as `W_hi + W_lo`, both E4M3, with current per-tensor scales.

    Forward: `x W_hi + x W_lo` (2 FP8 GEMMs), or with `split_activation=True`
    `x_hi W_hi + x_hi W_lo + x_lo W_hi` (3). Dgrad: `g W_hi (+ g W_lo)`; wgrad: `x^T g` over the
    activation's terms. Gradients are one E4M3 tensor, scaled per tensor in the same step.

    **Arguments:**

    - `split_activation`: split the activation into hi + lo too (3 forward GEMMs).
    - `dgrad_uses_lo`: include `W_lo` in the dgrad (one more GEMM, more precise input grads).
    - `error_feedback`: carry the weight's remaining quantization error (`W - W_hi - W_lo`) to
      the next step as state and add it before quantizing (needs the kernel's shape; a
      kernel with `dot_general` batch dimensions, one matrix per entry, is refused, and so
      is one mapped by `vmap` with one state for all members: map the layer too, and a
      Linen module multiplying by its kernel both ways, `x @ W` and `h @ W.T`, square or not).
    - `predict_lo_scale`: take `W_lo`'s scale from `W_hi`'s: `W_lo` is at most half an E4M3
      step of `W_hi`'s top binade, so no second amax is needed.
    - `nf_aware`: scale `W_hi` to 3 standard deviations instead of the amax (the
      "NormalFloat-aware" choice for Gaussian-like weights; about 0.3 % of values saturate and
      are caught by `W_lo` only up to its range).
    - `forward_format`, `backward_format`: both `"e4m3"` by default. E4M3 gradients keep one
      more significand bit than E5M2 (a current scale leaves them 18 binades below the amax)
      and let the fused kernel (`native_kernel=None`) run every GEMM on every JAX. With
      `backward_format="e5m2"` the dgrad and wgrad multiply E5M2 by E4M3: fused too from
      JAX 0.11 on, whose Mosaic GPU `wgmma` takes the pair; cuBLASLt calls on JAX 0.10.
    - `native_kernel`: `False` (default): the XLA path, two cuBLASLt FP8 calls, the second
      adding into the first's float32 output. `None`: fp8jax's Pallas Mosaic GPU kernel on
      Hopper GPUs and in compiles for them (the XLA path elsewhere), running the terms that
      share a left operand as one kernel (`x W_hi * s_hi + x W_lo * s_lo`: each tile of `x`
      loaded once, one float32 accumulation in registers, the output dtype written once);
      `True` forces it (sm_90 only; a compile for a CPU raises `ValueError`; not AMD's fnuz
      formats, which `None` runs on the XLA path). The kernel
      keeps the float32 sum out of memory (about delayed scaling's temp memory, where the
      XLA path's float32 buffer takes more) but ran slower than the two cuBLASLt calls on
      an H200 at LLM shapes, hence the default (both measured in `benchmarks/RESULTS.md`).
      Same numerics up to the float32 summation order. With `split_activation`, `x_lo
      W_hi` is a second kernel.
    """

    split_activation: bool = False
    dgrad_uses_lo: bool = True
    error_feedback: bool = False
    predict_lo_scale: bool = False
    nf_aware: bool = False
    native_kernel: bool | None = False
    backward_format: FormatLike = "e4m3"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags(
            self,
            "split_activation",
            "dgrad_uses_lo",
            "error_feedback",
            "predict_lo_scale",
            "nf_aware",
        )
        dispatch.check_native_kernel(self.native_kernel)
        dispatch.check_native_format(
            "ResidualFP8", self.native_kernel, "forward_format", self.forward_format
        )
        if self.nf_aware and self.predict_lo_scale:
            raise ValueError(
                "ResidualFP8(nf_aware=True, predict_lo_scale=True): the predicted W_lo scale "
                "assumes W_hi does not saturate, but a 3-sigma scale saturates the largest "
                "weights, whose remainders then overflow W_lo (a far lower SNR, measured in "
                "benchmarks/RESULTS.md). Use one of the two options."
            )

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> ResidualState:
        """Scales of 1, one amax slot; the kernel's zero error with `error_feedback`."""
        error = None
        if self.error_feedback and role == "kernel":
            if shape is None:
                raise ValueError(
                    "ResidualFP8(error_feedback=True) keeps the kernel's quantization error "
                    "as state and needs its shape: pass kernel_shape=(out_features, "
                    "in_features) to Fp8DotGeneral (fp8_linear_layers does this for you)."
                )
            error = jnp.zeros(shape, jnp.float32)
        one = jnp.ones((), jnp.float32)
        return ResidualState(one, jnp.zeros((1,), jnp.float32), one, error)

    def lo_scale_ratio(self) -> float:
        """`lo_scale / scale` when predicted: `fp8_max` over half an E4M3 step of the top
        binade (28 for E4M3: steps of 32 in [256, 448])."""
        dtype = self.format("kernel")
        top = math.floor(math.log2(fp8_max(dtype)))
        half_step = 2.0 ** (top - jnp.finfo(dtype).nmant) / 2
        return fp8_max(dtype) / half_step

    def recorded_scale(self, amax: Array, role: Role) -> Array | None:
        """`W_hi`'s scale beside the operand's amax (`Recipe.recorded_scale`); `None` for the
        kernel under `nf_aware`, whose scale comes from its standard deviation, not its
        amax (a layer's uses then keep the largest of theirs)."""
        if self.nf_aware and role == "kernel":
            return None
        return compute_scale(amax, amax, fp8_max(self.format(role)))

    def recorded_lo_scale(self, scale: Array, role: Role) -> Array | None:
        """`W_lo`'s scale beside `W_hi`'s `scale`, where it is a function of it
        (`predict_lo_scale`, for an operand split in two); `None` elsewhere: measured, it
        comes from the amax of what `W_hi` missed, which the state does not record (a
        layer's uses then keep the largest of theirs), and an operand kept whole records 1."""
        two = role == "kernel" or (role == "input" and self.split_activation)
        if not (two and self.predict_lo_scale):
            return None
        return jnp.minimum(scale * self.lo_scale_ratio(), MAX_SCALE)

    def _split(self, x: Array, owner: Array, previous: ResidualState, role: Role, two: bool):
        fmt = self.format(role)
        fmt_max = fp8_max(fmt)
        current = self.amax(x, owner)
        if self.nf_aware and role == "kernel":
            reference = 3.0 * jnp.std(x.astype(jnp.float32))
        else:
            reference = current
        scale = compute_scale(reference, previous.scale, fmt_max)
        hi = QTensor(quantize(x, scale, fmt), 1.0 / scale)
        if not two:
            return (hi,), scale, current, previous.lo_scale, None
        rest = x.astype(jnp.float32) - hi.data.astype(jnp.float32) * hi.scale_inv
        if self.predict_lo_scale:
            lo_scale = self.recorded_lo_scale(scale, role)
        else:
            lo_scale = compute_scale(self.amax(rest, owner), previous.lo_scale, fmt_max)
        lo = QTensor(quantize(rest, lo_scale, fmt), 1.0 / lo_scale)
        remaining = rest - lo.data.astype(jnp.float32) * lo.scale_inv
        return (hi, lo), scale, current, lo_scale, remaining

    def quantize(
        self, x: Array, state: ResidualState, role: Role, axis: Axis
    ) -> tuple[QTerms, ResidualState]:
        """`x` (plus the carried error) as an FP8 term and, where split, an FP8 remainder term."""
        del axis
        owner = state.scale
        two = role == "kernel" or (role == "input" and self.split_activation)
        error = state.error if role == "kernel" else None
        target = x if error is None else x.astype(jnp.float32) + error
        terms, scale, current, lo_scale, remaining = self._split(target, owner, state, role, two)
        new_error = remaining if error is not None else None
        history = state.amax_history.at[..., 0].set(current)
        return QTerms(terms), ResidualState(scale, history, lo_scale, new_error)

    @property
    def reads_state(self) -> bool:
        """`error_feedback`: only the carried error makes the GEMM read its state."""
        return self.error_feedback

    @property
    def stale_state(self) -> str:
        """An undifferentiated state's fault: its error feedback stays zero."""
        return (
            "Its error feedback would stay zero (each step's remaining quantization error of "
            "the kernel never carried to the next), as without error_feedback=True."
        )

    def retile(self, q: QTerms, role: Role, axis: Axis, source: Array | None = None) -> QTerms:
        """`q` as it is, less the kernel's remainder term where `dgrad_uses_lo` is off."""
        del source
        if role == "kernel" and not self.dgrad_uses_lo:
            return QTerms(q.terms[:1])
        return q

    def dot(
        self,
        lhs: QTerms,
        rhs: QTerms,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        """The terms' products summed in float32: two cuBLASLt calls, or the fused kernel."""

        def xla(lhs: QTerms, rhs: QTerms) -> Array:
            # The lo terms are ~2^-5 of the hi ones: sum in float32, or BF16 would drop them.
            out = None
            for a, bs in _pairs(lhs, rhs):
                for b in bs:
                    if out is not None:
                        # Two dots sharing `a`: XLA's dot merger would make them one GEMM
                        # against the kernels stacked, with a float32 output twice as large.
                        # Apart, the second cuBLASLt call adds into the first's output.
                        a = jax.lax.optimization_barrier(a)
                    part = per_tensor_dot(a, b, lhs_axis, rhs_axis, precision)
                    out = part if out is None else out + part
            return out.astype(out_dtype)

        def native(lhs: QTerms, rhs: QTerms, out_dtype: Any) -> Array:
            return native_residual_dot(lhs, rhs, lhs_axis, rhs_axis, out_dtype)

        from ..kernels.block_gemm import wgmma_takes

        dtypes = [t.data.dtype for t in lhs.terms + rhs.terms]
        if amd_format(self.forward_format) or not wgmma_takes(*dtypes):
            # AMD's fnuz formats, or E5M2 x E4M3 on JAX 0.10 (one FP8 type per wgmma): cuBLASLt
            return xla(lhs, rhs)
        return on_block_kernel(
            self.native_kernel, native, xla, lhs, rhs, lhs_axis, rhs_axis, out_dtype
        )


def _pairs(lhs: QTerms, rhs: QTerms) -> list[tuple[QTensor, tuple[QTensor, ...]]]:
    """Each term of `lhs` with the `rhs` terms it multiplies: all for the high part, the high
    part only for the low one (lo x lo is below both terms' precision)."""
    return [(a, rhs.terms if i == 0 else rhs.terms[:1]) for i, a in enumerate(lhs.terms)]


def native_residual_dot(
    lhs: QTerms, rhs: QTerms, lhs_axis: Axis, rhs_axis: Axis, out_dtype=jnp.float32
) -> Array:
    """The residual recipe's GEMMs as fp8jax's Mosaic GPU kernel: one kernel per term of
    `lhs`, with all the `rhs` terms it multiplies (each tile of the left operand loaded once),
    per-tensor scales as per-row ones. Shape `(*B, lhs_free, rhs_free)`."""
    from ..kernels.block_gemm import BLOCK_K  # Pallas: imported on use
    from ..kernels.choice import recipe_block_gemm

    def last(q: QTensor, axis: Axis) -> tuple[Array, Array]:
        data = dispatch.k_major(q.data, axis)
        chunks = -(-data.shape[-1] // BLOCK_K)
        shape = data.shape[:-1] + (chunks,)
        return data, jnp.broadcast_to(q.scale_inv.astype(jnp.float32), shape)

    pairs_of_terms = _pairs(lhs, rhs)
    # One kernel writes `out_dtype` itself; the partials of several are summed in float32.
    kernel_dtype = out_dtype if len(pairs_of_terms) == 1 else jnp.float32

    def gemm(a: Array, sa: Array, *terms: Array) -> Array:
        pairs = list(zip(terms[::2], terms[1::2], strict=True))
        return recipe_block_gemm(a, sa, pairs, out_dtype=kernel_dtype)

    out = None
    for a, bs in pairs_of_terms:
        operands = [*last(a, lhs_axis)] + [v for b in bs for v in last(b, rhs_axis)]
        part = (jax.vmap(gemm) if a.data.ndim == 3 else gemm)(*operands)
        out = part if out is None else out + part
    return out.astype(out_dtype)

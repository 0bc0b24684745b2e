"""OCP MXFP8: 1 x 32 blocks with power-of-two `float8_e8m0fnu` scales, emulated in XLA or
through `jax.nn.scaled_matmul` on GPUs that run it natively (compute capability 10+)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..core.formats import floor_log2, fp8_max, pow2
from .base import Axis, QTensor, Role, check_positive_int
from .block_dot import pad_to_blocks, tile
from .blocks import BlockScaledRecipe


def _ceil_log2_ratio(x: Array, divisor: float) -> Array:
    """`ceil(log2(x / divisor))` for positive finite `x`, exactly, without forming the quotient
    (which can be subnormal, and flushed to zero by XLA)."""
    mantissa, exponent = jnp.frexp(x)
    d_mantissa, d_exponent = math.frexp(divisor)
    ratio_mantissa, ratio_exponent = jnp.frexp(mantissa / d_mantissa)  # quotient in (0.5, 2)
    ceil_ratio = jnp.where(ratio_mantissa == 0.5, ratio_exponent - 1, ratio_exponent)
    return exponent - d_exponent + ceil_ratio


#: The block `jax.nn.scaled_matmul`'s cuDNN kernel takes for MXFP8 (E4M3 or E5M2 data).
SCALED_MATMUL_BLOCK = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8(BlockScaledRecipe):
    """OCP MXFP8: 1 x 32 blocks along the contracted axis for every operand, E4M3 data and
    power-of-two scales stored as `float8_e8m0fnu`.

    A block's scale is `2**ceil(log2(block_amax / fp8_max))` (rounded up, as Transformer
    Engine does, so nothing saturates), its exponent kept in [-126, 127] so that the scale is a
    normal float32 (XLA flushes subnormals); `scale_rounding="floor"` gives the OCP reference
    `2**(floor(log2(block_amax)) - emax)`, which can clip the largest values. An axis whose
    length is not a multiple of the block ends in a shorter block, scaled from its own
    elements (as zero padding to whole blocks would give; the OCP format has whole blocks
    only, and `jax.nn.scaled_matmul` is given the data zero-padded). Emulated in plain
    XLA (one FP8 dot per 32-element chunk); with `use_scaled_matmul=True`, or `None` on a GPU
    of compute capability 10 or newer, the forward GEMM goes through `jax.nn.scaled_matmul`
    (compiled for a CPU, where JAX has no `scaled_matmul`, `True` runs the emulation). `None`
    takes it for the blocks its cuDNN kernel takes only, `block_size=32` of E4M3 or E5M2
    data; other block sizes (any >= 1: not OCP MXFP8, the same scaling on other blocks) and
    the fnuz formats run the emulation there, and `True` refuses them.
    For the dgrad, the kernel is quantized a second time along its other axis from the
    high-precision weight, in the forward (as Transformer Engine does: one rounding); for the
    wgrad, the saved FP8 activation is requantized along its tokens.
    """

    block_size: int = 32
    scale_rounding: str = "ceil"
    use_scaled_matmul: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("block_size", self.block_size)
        if not isinstance(self.scale_rounding, str) or self.scale_rounding not in ("ceil", "floor"):
            raise ValueError(
                f"Unknown scale_rounding {self.scale_rounding!r}: should be 'ceil' or 'floor'."
            )
        if self.use_scaled_matmul is not None and not isinstance(self.use_scaled_matmul, bool):
            raise ValueError(
                f"use_scaled_matmul={self.use_scaled_matmul!r}: should be True, False or None "
                "(use it where the GPU supports it)."
            )
        if self.use_scaled_matmul and not self._cudnn_blocks:
            raise ValueError(
                f"MXFP8(use_scaled_matmul=True, block_size={self.block_size}, "
                f"format_name={self.format_name!r}): jax.nn.scaled_matmul's cuDNN kernel takes "
                f"blocks of {SCALED_MATMUL_BLOCK} elements of 'e4m3' or 'e5m2' data only; pass "
                "use_scaled_matmul=None (the emulation for other blocks) or those."
            )

    def block_for(self, role: Role, axis: Axis) -> tuple[int, int]:
        """`1 x block_size` tiles (32 elements by default) along the contracted `axis`, for every
        role."""
        return tile(axis, self.block_size)

    def block_scale(self, block_amax: Array) -> tuple[Array, Array]:
        """A power of two per block from its amax, and the E8M0 inverse stored with the data."""
        fmt_max = fp8_max(self.format_name)
        ok = (block_amax > 0) & jnp.isfinite(block_amax)
        safe = jnp.where(ok, block_amax, 1.0)
        if self.scale_rounding == "ceil":
            exponent = _ceil_log2_ratio(safe, fmt_max)
        else:
            exponent = floor_log2(safe) - math.floor(math.log2(fmt_max))
        exponent = jnp.clip(jnp.where(ok, exponent, 0), -126, 127)
        return pow2(-exponent), pow2(exponent).astype(jnp.float8_e8m0fnu)

    @property
    def _cudnn_blocks(self) -> bool:
        """Whether `jax.nn.scaled_matmul`'s cuDNN kernel takes these blocks: 32 elements of
        E4M3 or E5M2 data."""
        return self.block_size == SCALED_MATMUL_BLOCK and self.format_name in ("e4m3", "e5m2")

    def _scaled_matmul_available(self) -> bool:
        if self.use_scaled_matmul is not None:
            return self.use_scaled_matmul
        if not self._cudnn_blocks:
            return False  # not a block cuDNN's kernel takes: the emulation
        device = jax.devices()[0]
        return device.platform == "gpu" and _cuda_major(device) >= 10

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        """`jax.nn.scaled_matmul` where the backend has it, else XLA's block GEMM."""
        emulated = functools.partial(
            super().dot,
            lhs_axis=lhs_axis,
            rhs_axis=rhs_axis,
            precision=precision,
            out_dtype=out_dtype,
        )
        if lhs_axis == rhs_axis == -1 and self._scaled_matmul_available():
            # JAX has no CPU lowering of `scaled_matmul`: a CPU compile runs the emulation,
            # which computes the same product (one FP8 dot per block, summed in float32).
            scaled = lambda a, b: _scaled_matmul(a, b).astype(out_dtype)  # noqa: E731
            return _per_platform(lhs, rhs, emulated, scaled)
        return emulated(lhs, rhs)


def _cuda_major(device: object) -> int:
    """The major CUDA compute capability of a GPU `device` ("10.0": 10), or 0 where it has
    none: ROCm reports its architecture there ("gfx942"), which is not a number."""
    major = str(getattr(device, "compute_capability", "")).split(".")[0]
    return int(major) if major.isdigit() else 0


def _per_platform(lhs: QTensor, rhs: QTensor, emulated: Callable, scaled: Callable) -> Array:
    """`emulated(lhs, rhs)` in a program compiled for a CPU, else `scaled(lhs, rhs)`."""
    return jax.lax.platform_dependent(lhs, rhs, cpu=emulated, default=scaled)


def _scaled_matmul(lhs: QTensor, rhs: QTensor) -> Float[Array, "*shape"]:
    """`jax.nn.scaled_matmul` on MX operands contracted over their last axis.

    `scaled_matmul` takes `(B, M, K) . (B, N, K)` with one scale per 32 elements of K: the data
    is zero-padded to whole blocks and a batch axis added when there is none.
    """
    squeeze = lhs.data.ndim == 2
    a, b = (pad_to_blocks(q.data, q.block) for q in (lhs, rhs))
    a, b, sa, sb = (v[None] if squeeze else v for v in (a, b, lhs.scale_inv, rhs.scale_inv))
    out = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
    out = out[0] if squeeze else out
    return out[..., : lhs.data.shape[-2], : rhs.data.shape[-2]]

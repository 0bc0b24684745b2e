"""Block-scaled recipes: DeepSeek-V3 fine-grained scaling (and the base of MXFP8).

Each operand is quantized in blocks (1 x 128 tiles along the contracted axis, 128 x 128
weight blocks) with current scales; the GEMMs are `block_dot.py`'s. Where the native GEMM
kernels run, `BlockwiseScaling` quantizes activations, gradients and weights with the
one-pass kernels of `kernels/block_quantize.py` (the same values, one read of each tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..core.amax import local_amax
from ..core.formats import FormatLike, amd_format, floor_log2, fp8_dtype, fp8_max, pow2
from ..core.formats import format_name as canonical_format
from ..kernels import block_quantize, dispatch, padded_quantize
from .base import (
    Axis,
    QTensor,
    Recipe,
    Role,
    TensorState,
    check_flags,
    check_positive_int,
    gemm_dims,
    on_block_kernel,
)
from .block_dot import (
    block_amax,
    block_dot,
    dequantized_block_dot,
    gather_quantized,
    native_block_dot,
    quantize_blocks,
    tile,
)
from .per_tensor_scale import MAX_SCALE

#: Contraction block sizes the native kernel (`fp8jax._src.kernels.block_gemm`) takes.
NATIVE_BLOCK_SIZES = (64, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockScaledRecipe(Recipe):
    """Shared machinery of block-scaled recipes with current (per-step) scales.

    Subclasses choose the block of each role and contraction (`block_for`) and how a block's
    amax becomes its scale (`block_scale`).

    **Arguments shared by block recipes:**

    - `format_name`: the FP8 format of all three GEMMs (`"e4m3"`).
    - `chunks_per_dot`: how many chunks of the contraction each FP8 dot takes, inside a
      `lax.scan` that accumulates in float32. Each holds a float32 `(M, N)` partial until it
      is scaled and added: 1 (the default) keeps that no larger than a float32 output (and
      was also the fastest on a CPU); `None` runs every chunk in one batched dot, holding one
      partial per chunk (about twice the temp memory of one chunk per dot on an MLP step:
      `benchmarks/RESULTS.md`, "Figures the code's reasoning rests on").
    - `dequantized_dot`: compute each GEMM as one float32 dot of the dequantized operands
      (`dequantized_block_dot`): the same quantization and products, float32 accumulation
      across blocks. A fast emulation for CPU experiments; on a GPU it is not an FP8 GEMM.
    """

    format_name: FormatLike = "e4m3"
    chunks_per_dot: int | None = 1
    dequantized_dot: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "format_name", canonical_format(self.format_name))
        if self.chunks_per_dot is not None and (
            isinstance(self.chunks_per_dot, bool)
            or not isinstance(self.chunks_per_dot, int)
            or self.chunks_per_dot < 1
        ):
            raise ValueError(
                f"chunks_per_dot={self.chunks_per_dot!r}: should be None (all chunks in one "
                "batched dot) or an int >= 1 (1, the default, bounds the memory)."
            )
        check_flags(self, "dequantized_dot")

    def _block_dot(self, lhs: QTensor, rhs: QTensor, lhs_axis: Axis, rhs_axis: Axis, precision):
        if self.dequantized_dot:
            return dequantized_block_dot(lhs, rhs, lhs_axis, rhs_axis)
        return block_dot(lhs, rhs, lhs_axis, rhs_axis, precision, self.chunks_per_dot)

    def format(self, role: Role) -> jnp.dtype:
        """The FP8 dtype of every role: the recipe's one `format_name`."""
        return fp8_dtype(self.format_name)

    def block_for(self, role: Role, axis: Axis) -> tuple[int, int]:
        """The `(rows, cols)` block of operand `role` contracted on `axis` (per subclass)."""
        raise NotImplementedError

    def block_scale(self, block_amax: Array) -> tuple[Array, Array]:
        """(scale multiplied before the cast, scale_inv stored with the data), per block."""
        raise NotImplementedError

    def init_state(self, role: Role, shape: tuple[int, ...] | None = None) -> TensorState:
        """A scale of 1 and one amax slot: each block's scale comes from the tensor at hand."""
        return TensorState(
            scale=jnp.ones((), jnp.float32), amax_history=jnp.zeros((1,), jnp.float32)
        )

    def _quantize(self, x: Array, role: Role, axis: Axis) -> QTensor:
        block = self.block_for(role, axis)
        scale, scale_inv = self.block_scale(block_amax(x, block))
        return QTensor(quantize_blocks(x, scale, block, self.format(role)), scale_inv, block)

    def quantize(
        self, x: Array, state: TensorState, role: Role, axis: Axis
    ) -> tuple[QTensor, TensorState]:
        """`x` in `block_for(role, axis)` blocks, each scaled by its amax; the new state."""
        return self._quantize(x, role, axis), self._state(state, role, self.amax(x, state.scale))

    def _state(self, state: TensorState, role: Role, current: Array) -> TensorState:
        """The new state of an operand whose amax (`Recipe.amax`'s) is `current`: it only
        records the amax, and `fp8_max / amax` (capped at `MAX_SCALE`, as per-tensor scales
        are: an inf would read as a fault, and the merge reject the state), for telemetry."""
        nominal = jnp.where(current > 0, self.recorded_scale(current, role), state.scale)
        return TensorState(nominal, state.amax_history.at[..., 0].set(current))

    def recorded_scale(self, amax: Array, role: Role) -> Array:
        """The format's max over `amax`, capped: the scale recorded beside the blocks' own."""
        return jnp.minimum(fp8_max(self.format(role)) / amax, MAX_SCALE)

    def retile(self, q: QTensor, role: Role, axis: Axis, source: Array | None = None) -> QTensor:
        """`q` requantized in the blocks contracting `axis` (from `source` if given)."""
        block = self.block_for(role, axis)
        if tuple(q.block) == block:
            return q
        # From the high-precision tensor where the caller has it (the kernel, in the forward);
        # else from the FP8 values (the activation: no high-precision copy is kept).
        return self._quantize(q.dequantize() if source is None else source, role, axis)

    def quantize_gathered(self, x: Array, rows: Int[Array, " P"], role: Role) -> QTensor:
        """`x`'s rows gathered by `rows` (a row of zeros where negative: an expert layer's
        padded layout) in tiles along them, contracted on -2 as the wgrad takes it:
        `quantize`'s tensor of the gathered copy, without a state (the caller's is the
        ungathered tensor's)."""
        return self._quantize(padded_quantize.gather_rows(x, rows), role, -2)

    def quantize_both_gathered(
        self, x: Array, rows: Int[Array, " P"], state: TensorState, role: Role
    ) -> tuple[QTensor, QTensor, TensorState]:
        """`quantize(x, state, role, -1)` and `quantize_gathered(x, rows, role)`: an expert
        layer's output gradient for its dgrad and its wgrad, and the role's new state.
        `rows` from `gemm/grouped_native.gather_map`. Recipes that make both in one pass
        override it."""
        q, new_state = self.quantize(x, state, role, -1)
        return q, self.quantize_gathered(x, rows, role), new_state

    def retile_gathered(self, q: QTensor, rows: Int[Array, " P"], role: Role) -> QTensor:
        """`retile(q, role, -2)` of `q`'s rows gathered by `rows` (zeros where negative); `q`
        in tiles of one row, as an activation is saved."""
        return self.retile(gather_quantized(q, rows), role, -2)

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        """The XLA block GEMM (`block_dot`: FP8 partials per block, scaled, summed in float32)."""

        def gemm(lhs: QTensor, rhs: QTensor, out_dtype: Any) -> Array:
            return self._block_dot(lhs, rhs, lhs_axis, rhs_axis, precision).astype(out_dtype)

        # Per device under jit sharding: XLA would partition the loop over chunks of a split
        # contraction by gathering the whole operand for every chunk.
        dims = gemm_dims(lhs, rhs, lhs_axis, rhs_axis)
        return dispatch.on_shards(gemm, lhs, rhs, dims=dims, out_dtype=out_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockwiseScaling(BlockScaledRecipe):
    """DeepSeek-V3 fine-grained FP8: 1 x 128 tiles for activations and gradients (along the
    contracted axis), 128 x 128 blocks for weights, E4M3 for all three GEMMs, float32
    accumulation every 128 elements.

    Scales are current (computed from each block's amax in the same step):
    `scale = fp8_max / block_amax`, or the largest power of two not above it with
    `power_of_two=True`. The wgrad contracts the activation over its tokens, so the activation
    saved from the forward (tiled along features) is requantized into 128 x 1 tiles from its
    FP8 values; no high-precision copy is kept.

    **Arguments:**

    - `block_size`: tile length and weight block side (128); the native kernel takes 64 and
      128 only, other sizes (any >= 1) run on the XLA path, also under `native_kernel=None`.
    - `power_of_two`: round scales down to powers of two (exact rescaling, as DeepSeek's later
      UE8M0 scales).
    - `format_name`: `"e4m3"` (default) or another FP8 format.
    - `native_kernel`: run each GEMM as fp8jax's Pallas Mosaic GPU kernel (one `wgmma`
      kernel per GEMM, the promotion in registers, no float32 partials in memory). `None`
      (default): on Hopper GPUs and in compiles for them, the XLA path elsewhere (CPUs, other
      GPUs); `True` forces the kernel (it compiles only for sm_90; a compile for a CPU
      raises `ValueError`), `False` the XLA path. Block sizes 64 and 128 only, E4M3 or E5M2
      (`None` runs AMD's fnuz formats on the XLA path); the numerics are the XLA path's,
      float32 summation order aside. Where the kernel runs, activations, gradients and
      weights of whole 128 x 128 tiles are quantized in one pass each (fp8jax's
      `block_quantize.py`: the XLA path's values, and the K-major copies the backward GEMMs
      take). A weight quantized there comes as the tiles along its contracted axis
      (`QTensor.block` `(1, 128)` or `(128, 1)`) with each 128 x 128 block's scale repeated
      over them: the same values, in the layout the kernels read.
    """

    block_size: int = 128
    power_of_two: bool = False
    native_kernel: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("block_size", self.block_size)
        check_flags(self, "power_of_two")
        dispatch.check_native_kernel(self.native_kernel)
        if self.native_kernel and self.dequantized_dot:
            raise ValueError(
                "BlockwiseScaling(native_kernel=True, dequantized_dot=True): the dequantized "
                "dot is a float32 emulation and the native kernel an FP8 GEMM; choose one."
            )
        if self.native_kernel and self.block_size not in NATIVE_BLOCK_SIZES:
            raise ValueError(
                f"BlockwiseScaling(native_kernel=True, block_size={self.block_size}): the "
                f"native kernel takes block sizes {list(NATIVE_BLOCK_SIZES)}."
            )
        dispatch.check_native_format(
            "BlockwiseScaling", self.native_kernel, "format_name", self.format_name
        )

    @property
    def _kernel(self) -> bool | None:
        """`native_kernel`, or `False` for AMD's fnuz formats, which no Hopper `wgmma` takes."""
        return False if amd_format(self.format_name) else self.native_kernel

    def dot(
        self,
        lhs: QTensor,
        rhs: QTensor,
        lhs_axis: Axis,
        rhs_axis: Axis,
        precision,
        out_dtype=jnp.float32,
    ) -> Float[Array, "*shape"]:
        """The native block-scaled kernel where it applies, else XLA's block GEMM."""

        def xla(lhs: QTensor, rhs: QTensor) -> Array:
            return super(BlockwiseScaling, self).dot(
                lhs, rhs, lhs_axis, rhs_axis, precision, out_dtype
            )

        if self.dequantized_dot or self.block_size not in NATIVE_BLOCK_SIZES:
            return xla(lhs, rhs)

        def native(lhs: QTensor, rhs: QTensor, out_dtype: Any) -> Array:
            return native_block_dot(lhs, rhs, lhs_axis, rhs_axis, out_dtype)

        return on_block_kernel(self._kernel, native, xla, lhs, rhs, lhs_axis, rhs_axis, out_dtype)

    def block_for(self, role: Role, axis: Axis) -> tuple[int, int]:
        """`block_size` squares for the kernel, `1 x block_size` tiles for the others."""
        if role == "kernel":
            return (self.block_size, self.block_size)
        return tile(axis, self.block_size)

    # --- tiles quantized in one pass (`kernels/block_quantize.py`) -------------------------

    def _one_pass(self, x: Array) -> bool:
        """Whether the tiles of `x` may be quantized by the one-pass kernels where the GEMMs
        run natively: whole tiles, at most `block_quantize.MAX_ELEMENTS` elements (32-bit
        offsets), one device's data, the kernel not turned off."""
        return (
            self._kernel is not False
            and not self.dequantized_dot
            and self.block_size in NATIVE_BLOCK_SIZES
            and x.ndim in (2, 3)
            and block_quantize.fits(x.shape, self.block_size)
            and dispatch.per_device_gemm(x)
        )

    def _on_kernel(self, native: Any, xla: Any, *args: Array) -> Any:
        """`native(*args)` where the native GEMMs run (Hopper, the interpreter), else
        `xla(*args)`: the same values, bit for bit for finite inputs."""

        def kernel(*a: Array, out_dtype: Any) -> Any:
            del out_dtype
            return native(*a)

        return dispatch.choose(self._kernel, kernel, xla, *args)

    def _rule(self) -> dict[str, Any]:
        return dict(block=self.block_size, max_scale=MAX_SCALE, power_of_two=self.power_of_two)

    def quantize(
        self, x: Array, state: TensorState, role: Role, axis: Axis
    ) -> tuple[QTensor, TensorState]:
        """As `BlockScaledRecipe.quantize`, by the one-pass kernels where they apply."""
        if role == "kernel" and x.ndim == 2 and self._one_pass(x):
            q, local = self._weight_copy(x, axis)
            return q, self._state(state, role, self.amax(local, state.scale))
        if axis != -1 or role == "kernel" or not self._one_pass(x):
            return super().quantize(x, state, role, axis)
        q, _, new_state = self._quantize_tiles(x, state, role, columns=False)
        return q, new_state

    def _weight_blocks(self, w: Array) -> tuple[Array, ...]:
        """A 2-D weight `(N, K)`'s FP8 blocks, the same transposed, each block's scale once
        per row it covers in the layouts contracting -1 `(N, K / block)` and -2 `(N / block,
        K)`, and its amax (this call's, before `Recipe.amax`): one kernel where the GEMMs run
        natively (called again by `retile` for the dgrad's copy: XLA merges the two identical
        calls into one)."""
        fmt, size = self.format("kernel"), self.block_size

        def native(w: Array) -> tuple[Array, ...]:
            from ..kernels.choice import recipe_quantize_blocks  # Pallas: imported on use

            data, data_t, rows_t, cols, amaxes = recipe_quantize_blocks(w, fmt, **self._rule())
            # `rows_t` chunk-major, as the GEMM kernels read it: transposed back here and
            # again by the kernels' callers, which XLA folds into none.
            return data, data_t, rows_t.T, cols, jnp.max(amaxes)

        def xla(w: Array) -> tuple[Array, ...]:
            q = self._quantize(w, "kernel", -1)
            rows, cols = (jnp.repeat(q.scale_inv, size, axis=a) for a in (-2, -1))
            return q.data, q.data.T, rows, cols, local_amax(w)

        return self._on_kernel(native, xla, w)

    def _weight_copy(self, w: Array, axis: Axis) -> tuple[QTensor, Array]:
        """`w`'s FP8 blocks laid out for a GEMM contracting `axis`, and its amax
        (`_weight_blocks`). Each block's scale comes once per row of its tiles along `axis`
        (`tile(axis)`: the same values as the square blocks, in the layout the GEMM kernels
        take, so that no kernel expands them; inside `choice.weight_block_scales()` once per
        block, as square blocks). Square blocks serve either axis: for -2 the kernel's K-major
        copy, transposed back here, which the GEMM's own transpose undoes (no data moves)."""
        from ..kernels.choice import weight_block_scales_chosen  # Pallas: imported on use

        data, data_t, rows, cols, local = self._weight_blocks(w)
        size = self.block_size
        if weight_block_scales_chosen():  # the square blocks' scales, once per block
            if axis == -1:
                return QTensor(data, rows[::size], (size, size)), local
            return QTensor(data_t.T, cols[:, ::size], (size, size)), local
        if axis == -1:
            return QTensor(data, rows, tile(-1, size)), local
        return QTensor(data_t.T, cols, tile(-2, size)), local

    def quantize_both(
        self, x: Array, state: TensorState, role: Role
    ) -> tuple[QTensor, QTensor, TensorState]:
        """`x` in tiles along its last axis and along its rows from one read of `x`, where
        the one-pass kernel runs (the output gradient's copies for dgrad and wgrad)."""
        if role == "kernel" or not self._one_pass(x):
            return super().quantize_both(x, state, role)
        return self._quantize_tiles(x, state, role, columns=True)

    def _quantize_tiles(
        self, x: Array, state: TensorState, role: Role, columns: bool
    ) -> tuple[QTensor, QTensor | None, TensorState]:
        fmt, size = self.format(role), self.block_size

        def native(x: Array) -> tuple[Array, ...]:
            # Pallas: imported on use. Scales come chunk-major (as the GEMM kernels read
            # them): transposed back there, and again by the kernels' callers, which XLA
            # folds into none.
            from ..kernels.choice import recipe_quantize_rows, recipe_rows_and_columns

            if columns:  # the output gradient's two copies
                return recipe_rows_and_columns(x, fmt, **self._rule())
            return recipe_quantize_rows(x, fmt, **self._rule())

        def xla(x: Array) -> tuple[Array, ...]:
            q = self._quantize(x, role, -1)
            out = (q.data, q.scale_inv, local_amax(x))
            if columns:
                q_t = self._quantize(x, role, -2)
                out += (q_t.data, q_t.scale_inv)
            return out

        data, scale_inv, local, *cols = self._on_kernel(native, xla, x)
        # Over the batch under `vmap` and over `axis_names`, as `Recipe.amax` spans them.
        current = self.amax(local, state.scale)
        q_cols = QTensor(cols[0], cols[1], (size, 1)) if columns else None
        return QTensor(data, scale_inv, (1, size)), q_cols, self._state(state, role, current)

    def retile(self, q: QTensor, role: Role, axis: Axis, source: Array | None = None) -> QTensor:
        """As `BlockScaledRecipe.retile`, by a one-pass kernel where it applies."""
        block = self.block_for(role, axis)
        if role == "kernel" and source is not None and source.ndim == 2 and self._one_pass(source):
            # The dgrad's copy, written by the kernel that quantized the weight.
            return self._weight_copy(source, axis)[0]
        if role == "kernel" and tuple(q.block) == tile(axis, self.block_size):
            return q  # a weight's blocks already laid out for `axis` (`_weight_copy`)
        if (
            source is not None
            or role == "kernel"
            or tuple(q.block) != (1, self.block_size)
            or block != (self.block_size, 1)
            or not self._one_pass(q.data)
        ):
            return super().retile(q, role, axis, source)

        def native(data: Array, scale_inv: Array) -> tuple[Array, Array]:
            from ..kernels.choice import recipe_requantize_columns  # Pallas: imported on use

            return recipe_requantize_columns(data, scale_inv, **self._rule())

        def xla(data: Array, scale_inv: Array) -> tuple[Array, Array]:
            r = self._quantize(QTensor(data, scale_inv, q.block).dequantize(), role, axis)
            return r.data, r.scale_inv

        return QTensor(*self._on_kernel(native, xla, q.data, q.scale_inv), block)

    # --- the wgrad's tiles of an expert layer, gathered (`kernels/padded_quantize.py`) -----

    def _gathers(self, x: Array, rows: Array) -> bool:
        """Whether `x`'s rows may be gathered by `rows` into tiles by the padded kernels."""
        return (
            self._kernel is not False
            and not self.dequantized_dot
            and self.block_size in NATIVE_BLOCK_SIZES
            and padded_quantize.fits(x.shape, rows.shape[0], self.block_size)
            and dispatch.per_device_gemm(x)
        )

    def quantize_gathered(self, x: Array, rows: Int[Array, " P"], role: Role) -> QTensor:
        """As `BlockScaledRecipe.quantize_gathered`, by one native kernel where it applies."""
        if not self._gathers(x, rows):
            return super().quantize_gathered(x, rows, role)
        fmt = self.format(role)

        def native(x: Array, rows: Array) -> tuple[Array, Array]:
            from ..kernels.choice import recipe_gathered  # Pallas: imported on use

            data_t, scale_inv = recipe_gathered(x, rows, fmt, **self._rule())
            return data_t.T, scale_inv

        def xla(x: Array, rows: Array) -> tuple[Array, Array]:
            q = super(BlockwiseScaling, self).quantize_gathered(x, rows, role)
            return q.data, q.scale_inv

        return QTensor(*self._on_kernel(native, xla, x, rows), (self.block_size, 1))

    def quantize_both_gathered(
        self, x: Array, rows: Int[Array, " P"], state: TensorState, role: Role
    ) -> tuple[QTensor, QTensor, TensorState]:
        """As `BlockScaledRecipe.quantize_both_gathered`, by one native kernel where it applies."""
        if role == "kernel" or not self._gathers(x, rows):
            return super().quantize_both_gathered(x, rows, state, role)
        fmt, size = self.format(role), self.block_size

        def native(x: Array, rows: Array) -> tuple[Array, ...]:
            from ..kernels.choice import recipe_both_gathered  # Pallas: imported on use

            data, scale_t, amaxes, data_t, cols = recipe_both_gathered(x, rows, fmt, **self._rule())
            return data, scale_t.T, jnp.max(amaxes), data_t.T, cols

        def xla(x: Array, rows: Array) -> tuple[Array, ...]:
            q = self._quantize(x, role, -1)
            q_t = super(BlockwiseScaling, self).quantize_gathered(x, rows, role)
            return q.data, q.scale_inv, local_amax(x), q_t.data, q_t.scale_inv

        data, scale_inv, local, data_t, cols = self._on_kernel(native, xla, x, rows)
        new_state = self._state(state, role, self.amax(local, state.scale))
        q_cols = QTensor(data_t, cols, (size, 1))
        return QTensor(data, scale_inv, (1, size)), q_cols, new_state

    def retile_gathered(self, q: QTensor, rows: Int[Array, " P"], role: Role) -> QTensor:
        """As `BlockScaledRecipe.retile_gathered`, by one native kernel where it applies."""
        if tuple(q.block) != (1, self.block_size) or not self._gathers(q.data, rows):
            return super().retile_gathered(q, rows, role)

        def native(data: Array, scale_inv: Array, rows: Array) -> tuple[Array, Array]:
            from ..kernels.choice import recipe_requantize_gathered  # Pallas: on use

            data_t, scale_inv = recipe_requantize_gathered(data, scale_inv.T, rows, **self._rule())
            return data_t.T, scale_inv

        def xla(data: Array, scale_inv: Array, rows: Array) -> tuple[Array, Array]:
            gathered = gather_quantized(QTensor(data, scale_inv, q.block), rows)
            r = BlockScaledRecipe.retile(self, gathered, role, -2)
            return r.data, r.scale_inv

        block = self.block_for(role, -2)
        return QTensor(*self._on_kernel(native, xla, q.data, q.scale_inv, rows), block)

    def block_scale(self, block_amax: Array) -> tuple[Array, Array]:
        """The format's max over each block's amax (1 where it is 0 or not finite), its inverse."""
        fmt_max = fp8_max(self.format_name)
        ok = (block_amax > 0) & jnp.isfinite(block_amax)
        scale = jnp.where(ok, fmt_max / jnp.where(ok, block_amax, 1.0), 1.0)
        scale = jnp.minimum(scale, MAX_SCALE)
        if self.power_of_two:
            scale = pow2(floor_log2(scale))
        return scale, 1.0 / scale

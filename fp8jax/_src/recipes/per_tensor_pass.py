"""Per-tensor quantization in one pass: an operand's FP8 copy, its transposed copy and its
amax from one read (`kernels/cast_transpose.py`).

XLA writes the two copies in one transposing fusion but reduces the amax in kernels of its
own (it fuses no reduction into a transposing pass), and its transposing FP8 fusions moved
their bytes at about half HBM's rate in GPU run 6. Inside `cast_transpose_kernel()` the
kernel writes the copies instead, and where the scale is known before the step (delayed
scaling's steady state) the amax too: a trace-time setting until a GPU run has timed it in a
step (issue 38; `benchmarks/llama_block.py`'s `*-kernel` variants).
"""

from __future__ import annotations

import collections.abc
import contextlib
from collections.abc import Collection

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..core.amax import local_amax
from ..core.contexts import Setting, setting
from ..core.formats import quantize
from ..kernels import block_quantize, dispatch
from ..kernels.cast_transpose import cast_transpose
from ..kernels.tensor_core_transpose import tensor_core_cast_transpose
from .base import ROLES, Role

#: The tile the kernel casts (`cast_transpose`'s default): operands of whole tiles only.
BLOCK: int = 128

#: The roles quantized by the kernel (`cast_transpose_kernel`).
_CHOSEN: Setting[frozenset[str]] = Setting("fp8jax_cast_transpose_kernel", frozenset())
#: Whether the kernel is `tensor_core_transpose`'s (Mosaic GPU), not the Pallas Triton one.
_TENSOR_CORES: Setting[bool] = Setting("fp8jax_cast_transpose_on_tensor_cores", False)


def checked_roles(
    name: str, roles: Role | Collection[Role], allow_empty: bool = False
) -> frozenset[str]:
    """`roles` (one role, or several of `ROLES`; none too with `allow_empty`) as a set;
    `name` names the caller in the error for anything else."""
    which = "a subset" if allow_empty else "a non-empty subset"
    refusal = f"expected one role or {which} of {ROLES}."
    if isinstance(roles, str):
        given: tuple = (roles,)
    elif isinstance(roles, Collection) and not isinstance(roles, bytes):
        given = tuple(roles)
    else:  # None, a number, bytes: no roles (`tuple` failed on some, took bytes' ints)
        raise ValueError(f"{name}: roles={roles!r}; {refusal}")
    strings = all(isinstance(r, str) for r in given)  # else unhashable ones fail in a set
    if not (strings and set(given) <= set(ROLES) and (given or allow_empty)):
        raise ValueError(f"{name}: roles={given!r}; {refusal}")
    return frozenset(given)


def cast_transpose_kernel(
    roles: Role | Collection[Role] = ROLES, *, on_tensor_cores: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Per-tensor recipes traced inside quantize each operand of `roles` (one or several of
    `"input"`, `"kernel"`, `"output_grad"`) of a dense GEMM (`Fp8DotGeneral`; the grouped
    GEMMs keep XLA's passes) with fp8jax's one-pass kernel: its FP8 copy and the transposed
    copy its backward GEMM takes from one read, and its amax in the same read where the
    scale is known before the step ([`fp8jax.DelayedScaling`][] without the warm start, or
    inside `skip_warm_start`: the train step's steady state; elsewhere XLA reduces the amax
    first, as without the kernel). Without it XLA writes the two copies in one pass and
    reduces the amax in kernels of its own. The same values, bit for bit.

    `on_tensor_cores`: the kernel is `kernels.tensor_core_transpose`'s (TMA and one `wgmma`
    a tile, Mosaic GPU; its interpreter from JAX 0.11 on) instead of the Pallas Triton one
    (`kernels.cast_transpose`); the same values for finite operands.

    On Hopper GPUs and in the interpreter, for operands of whole `128 x 128` tiles on one
    device's data; XLA's passes everywhere else. Issue 38: the default once a GPU run has
    timed it in a step."""
    if not isinstance(on_tensor_cores, bool):
        raise TypeError(
            f"cast_transpose_kernel: on_tensor_cores={on_tensor_cores!r}; expected a bool."
        )
    return _both(checked_roles("cast_transpose_kernel", roles), on_tensor_cores)


@contextlib.contextmanager
def _both(roles: frozenset[str], on_tensor_cores: bool) -> collections.abc.Iterator[None]:
    with setting(_CHOSEN, roles), setting(_TENSOR_CORES, on_tensor_cores):
        yield


def cast_transpose_chosen(role: Role) -> bool:
    """Whether per-tensor recipes are being traced inside `cast_transpose_kernel()` with
    `role` among its roles."""
    return role in _CHOSEN.get()


def tensor_cores_chosen() -> bool:
    """Whether `cast_transpose_kernel(on_tensor_cores=True)` is in effect."""
    return _TENSOR_CORES.get()


#: Whether transposed FP8 copies made apart are written in 32-bit words (`transposes_in_words`).
_IN_WORDS: Setting[bool] = Setting("fp8jax_transposes_in_words", False)


def transposes_in_words() -> contextlib.AbstractContextManager[None]:
    """Per-tensor recipes traced inside write each transposed FP8 copy they make apart
    (`transposes_apart`, `KNOWN_SCALE_APART`) in 32-bit words (`formats.transpose_in_words`):
    the same bytes and kernels, where XLA's GPU transpose stores FP8 one byte per
    instruction. Issue 38: the default once a GPU run has timed it (`*-words` variants of
    `benchmarks/llama_block.py`)."""
    return setting(_IN_WORDS, True)


def transposes_in_words_chosen() -> bool:
    """Whether per-tensor recipes are being traced inside `transposes_in_words()`."""
    return _IN_WORDS.get()


#: The operand dtypes the kernel reads.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def fits(x: Array) -> bool:
    """Whether the kernel may quantize `x (*B, M, K)`: at most one batch axis, `M` and `K`
    whole tiles, at most `block_quantize.MAX_ELEMENTS` elements in all (32-bit offsets), a
    16- or 32-bit float, one device's data (an opaque kernel on a mesh that XLA partitions
    would make it gather the operand)."""
    return (
        x.ndim in (2, 3)
        and jnp.dtype(x.dtype) in DTYPES
        and block_quantize.fits(x.shape, BLOCK)
        and dispatch.per_device_gemm(x)
    )


def cast_and_transpose(
    x: Float[Array, "*B M K"], scale: Float[Array, ""], fmt: jnp.dtype
) -> tuple[Array, Array, Float[Array, ""]]:
    """`quantize(x, scale, fmt)`, the same values with their last two axes swapped, and
    `max |x|` of this call's `x` alone (`Recipe.amax` then spans a batch or mesh axes): from
    the kernel where it runs (`fits(x)` checked by the caller), else from XLA's passes, the
    same values."""

    def native(x: Array, scale: Array, out_dtype: object) -> tuple[Array, ...]:
        del out_dtype
        if tensor_cores_chosen():  # a batch axis in the kernel's own tile order
            data, data_t, amaxes = tensor_core_cast_transpose(x, scale, fmt)
            return data, data_t, jnp.max(amaxes)

        def one(x: Array) -> tuple[Array, ...]:
            return cast_transpose(x, scale, fmt, block=BLOCK)

        data, data_t, amaxes = jax.vmap(one)(x) if x.ndim == 3 else one(x)
        # One amax per tile (NaN where it holds a NaN): their max is `x`'s.
        return data, data_t, jnp.max(amaxes)

    def xla(x: Array, scale: Array) -> tuple[Array, ...]:
        data = quantize(x, scale, fmt)
        return data, jnp.swapaxes(data, -1, -2), local_amax(x)

    return dispatch.choose(None, native, xla, x, scale)

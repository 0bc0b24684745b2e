"""The quantization kernels' tuning (`ColumnTuning`), beside the kernels that take it
(`block_quantize`, `padded_quantize`, `cast_transpose`), and the trace-time setting that
gives a whole step's kernels tiles in slabs (`quantize_slabs`).

Why slabs: a program holding its whole 128 x 128 tile in float32 takes 175-255 registers a
thread (read by ptxas from the deviceless H100 compile, `benchmarks/quantize_ptx.py`), so two
programs share an SM, eight warps of its 64, and each program loads, then computes, then
stores; GPU run 6 timed these kernels at 0.6-2.2 TB/s where HBM allows 4.8. Walking the tile
in slabs of `slab_rows` rows holds a slab at a time: fewer registers, more programs per SM.
A kernel whose column scales need every row of the tile reads it twice then (the second
time from cache): once for the amaxes, once to cast the transposed copy.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from ..core.contexts import Setting, setting

#: Warps per program: a 128 x 128 float32 tile is 64 KiB of registers over 256 threads.
NUM_WARPS = 8


class ColumnTuning(NamedTuple):
    """Knobs of the quantization kernels, for the GPU check's sweep. `num_warps`: warps per
    program (default `NUM_WARPS`). `transpose_first`: transpose the float32 tile before the
    cast to FP8 (default: cast, then transpose the FP8 tile). `wide_transpose`: transpose
    the FP8 tile widened to BF16 (exact), which Triton transposes with `ldmatrix` where it
    gathers an FP8 tile one byte at a time (read in the PTX: `benchmarks/quantize_ptx.py`).
    `slab_rows`: rows of the tile held at a time (`None`: all of it), a power of two that
    divides the tile's (see the module). The same values every way."""

    num_warps: int = NUM_WARPS
    transpose_first: bool = False
    wide_transpose: bool = False
    slab_rows: int | None = None


#: The rows-and-columns kernel's default tuning: 4 warps, cast, then transposed. On an H200
#: (GPU run 6) it took 0.113 / 0.337 / 0.214 ms at 8192x4096 / 8192x14336 / 14336x4096,
#: 1.74x / 1.51x / 1.38x faster than with 8 warps, and 1.29x / 1.28x / 1.05x faster than
#: XLA's rows-and-columns path (8 warps: 0.70x / 0.73x / 0.66x).
DEFAULT_TUNING = ColumnTuning(num_warps=4)
#: The other transposing kernels' default (8 warps), until a GPU run has swept them.
OTHER_TUNING = ColumnTuning()

_SLABS: Setting[int | None] = Setting("fp8jax_quantize_slab_rows", None)


def quantize_slabs(rows: int) -> contextlib.AbstractContextManager[None]:
    """Quantization kernels traced inside walk their tiles in slabs of `rows` rows
    (`ColumnTuning.slab_rows`) where their tuning names none: to time a whole step's kernels
    so (`benchmarks/llama_block.py`'s `blockwise-slabs`). Issue 39: the default once a GPU
    run has timed it faster."""
    if not is_power_of_two(rows):
        raise ValueError(f"quantize_slabs: rows={rows!r}; expected a power of two >= 1.")
    return setting(_SLABS, rows)


def resolved(tuning: ColumnTuning) -> ColumnTuning:
    """`tuning` with the `quantize_slabs` context's rows where it names none."""
    if tuning.slab_rows is None and _SLABS.get() is not None:
        return tuning._replace(slab_rows=_SLABS.get())
    return tuning


def slab_height(tuning: ColumnTuning, block: int) -> int:
    """Rows of a `block`-row tile a program holds at a time in `tuning`."""
    return block if tuning.slab_rows is None else min(tuning.slab_rows, block)


def check_block(block: object, name: str) -> None:
    """Raise, naming kernel `name`, unless `block` is a power of two: Pallas' Triton lowering
    takes arrays of power-of-two sizes only."""
    if not is_power_of_two(block):
        raise ValueError(
            f"{name}: block={block!r}; expected a power of two (Pallas' Triton kernels take "
            "arrays of power-of-two sizes only), 64 or 128, say."
        )


def check_tuning(tuning: ColumnTuning, name: str, block: int = 128) -> ColumnTuning:
    """`tuning` resolved (`resolved`) for kernel `name` on `block`-row tiles; raise if it is not
    a `ColumnTuning` Triton can run (or `block` not a power of two)."""
    check_block(block, name)
    if (
        not isinstance(tuning, ColumnTuning)
        or not is_power_of_two(tuning.num_warps)
        or tuning.num_warps > 32
    ):
        raise ValueError(
            f"{name}: tuning={tuning!r}; expected a ColumnTuning with num_warps a power of "
            "two from 1 to 32."
        )
    if tuning.transpose_first and tuning.wide_transpose:
        raise ValueError(
            f"{name}: tuning={tuning!r} transposes the float32 tile (transpose_first) and "
            "the FP8 tile widened (wide_transpose); choose one."
        )
    tuning = resolved(tuning)
    rows = tuning.slab_rows
    if rows is not None and not (is_power_of_two(rows) and block % min(rows, block) == 0):
        raise ValueError(
            f"{name}: tuning={tuning!r}; slab_rows should be None or a power of two that "
            f"divides the tile's {block} rows."
        )
    return tuning


def is_power_of_two(n: object) -> bool:
    """Whether `n` is a whole number (not a bool) and a power of two."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)

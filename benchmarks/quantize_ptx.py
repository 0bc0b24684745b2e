"""How the quantization kernels move a tile through shared memory, read from their PTX
(issue 39, deliverable 3); deviceless, nothing runs on a GPU.

    python benchmarks/quantize_ptx.py | tee benchmarks/results/quantize_ptx.txt

Each Pallas (Triton) quantization kernel of `fp8jax._src.kernels` compiled for an H100 at
8192 x 4096 (BF16 in), XLA dumping the PTX it compiled: per thread, the shared-memory
instructions (`ld.shared.b8`: one byte at a time; `ldmatrix ... .trans`: a 16-bit transpose
of eight 8 x 8 tiles at once), warp shuffles, barriers and vector global stores, and the
PTX's length. Beside them, the smallest kernel with a transposed FP8 copy (a cast and its
transpose, no scales), where Triton transposes the BF16 input with `ldmatrix` before the
cast: the fp8jax kernels' transposed copy (scaled per column) is gathered from shared memory
one byte at a time instead. GPU run 6 measured these kernels at 0.6-2.2 TB/s (an H200: 4.8).
Then each kernel that writes a transposed copy with `ColumnTuning(transpose_first=True)`:
whether that compiles to other instructions at all (for the block kernels it does not:
Triton moves the transpose back behind the per-column scaling); and with
`ColumnTuning(wide_transpose=True)` (session 38): the FP8 tile widened to BF16 (exact) before
its transpose, which Triton then moves with `ldmatrix ... .trans`, as the plain cast's.

Since session 39 also each kernel's registers per thread, read by `ptxas -v` (CUDA's assembler,
where this machine has one) from the same PTX, and the programs an SM can hold by registers alone
(65,536 a SM, allocated per warp in 256s; at most 64 warps and 32 programs): whole tiles take
175-255 registers, two programs a SM; in slabs of rows (`ColumnTuning(slab_rows=...)`) the
kernels hold a slab at a time (a last table, every kernel of the GPU check's sweep).

Needs jax 0.11 or later with its CUDA plugin (the `h100` extra) for the deviceless compile.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA reads its flags when its backend starts: set before JAX is imported.
DUMP = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={DUMP} --xla_dump_emitter_re=.* --xla_gpu_dump_llvmir=true"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gpu_check.quantize import (  # noqa: E402
    REQUANTIZING,
    TUNINGS,
    transposing_kernel,
    tuning_name,
)
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from fp8jax._src.kernels import block_quantize  # noqa: E402
from fp8jax._src.kernels.cast_transpose import cast_transpose  # noqa: E402
from fp8jax._src.observe import deviceless  # noqa: E402

M, K = 8192, 4096
E4M3 = jnp.float8_e4m3fn
RULE = dict(max_scale=2.0**126)
COUNTED = {
    "ld.shared.b8": r"ld\.shared\.b8",
    "ldmatrix.trans": r"ldmatrix\.[\w.]*\.trans",
    "other shared loads": r"ld\.shared\.(?!b8)",
    "st.shared": r"st\.shared",
    "shfl.sync": r"shfl\.sync",
    "bar.sync": r"bar\.sync",
    "st.global.v4": r"st\.global\.v4",
}


def registers(ptx: str) -> str:
    """`ptxas -v`'s registers per thread of the fp8jax kernel in `ptx`, and the programs of
    `warps` warps an SM holds by registers (`-` without ptxas)."""
    ptxas = shutil.which("ptxas")
    entry = re.compile(r"\.entry (fp8jax|plain_cast)")
    modules = [m for m in re.split(r"(?m)^(?=\.version)", ptx) if entry.search(m)]
    if ptxas is None or len(modules) != 1:
        return "-"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.ptx")
        with open(path, "w") as f:
            f.write(modules[0])
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    found = re.search(r"Used (\d+) registers", log)
    return found.group(1) if found else "-"


def programs_per_sm(regs: str, warps: int) -> str:
    """Programs of `warps` warps an H100 SM holds by registers alone."""
    if not regs.isdigit():
        return "-"
    per_warp = -(-int(regs) * 32 // 256) * 256
    return str(min(65536 // (per_warp * warps), 64 // warps, 32))


def plain_cast_and_transpose(x):
    """A cast to E4M3 and its transposed copy, nothing else: Triton's own transpose."""

    def kernel(x_ref, q_ref, qt_ref):
        q = x_ref[...].astype(jnp.float32).astype(E4M3)
        q_ref[...] = q
        qt_ref[...] = q.T

    tile = (128, 128)
    same, swapped = pl.BlockSpec(tile, lambda i, j: (i, j)), pl.BlockSpec(tile, lambda i, j: (j, i))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((K, M), E4M3)],
        grid=(M // 128, K // 128),
        in_specs=[same],
        out_specs=[same, swapped],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="plain_cast_and_transpose",
    )(x)


def kernels() -> dict[str, tuple[object, int]]:
    """label -> (function of a BF16 (M, K) operand, warps)."""
    warps8 = block_quantize.ColumnTuning(num_warps=8)
    first = block_quantize.ColumnTuning(num_warps=4, transpose_first=True)
    wide = block_quantize.ColumnTuning(num_warps=4, wide_transpose=True)
    slabs = (
        block_quantize.ColumnTuning(num_warps=4, slab_rows=32),
        block_quantize.ColumnTuning(num_warps=8, slab_rows=16),
    )
    return {
        "quantize_rows (1 x 128 tiles)": (
            lambda x: block_quantize.quantize_rows(x, E4M3, **RULE),
            4,
        ),
        "quantize_rows_and_columns (default)": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE),
            block_quantize.DEFAULT_TUNING.num_warps,
        ),
        "quantize_rows_and_columns, 8 warps": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE, tuning=warps8),
            8,
        ),
        "quantize_rows_and_columns, transposed before the cast": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE, tuning=first),
            4,
        ),
        "quantize_rows_and_columns, widened to BF16 to transpose": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE, tuning=wide),
            4,
        ),
        "cast_transpose (per-tensor)": (
            lambda x: cast_transpose(x, jnp.float32(0.5), E4M3),
            block_quantize.DEFAULT_TUNING.num_warps,
        ),
        "cast_transpose, transposed before the cast": (
            lambda x: cast_transpose(x, jnp.float32(0.5), E4M3, tuning=first),
            4,
        ),
        "cast_transpose, widened to BF16 to transpose": (
            lambda x: cast_transpose(x, jnp.float32(0.5), E4M3, tuning=wide),
            4,
        ),
        "plain cast and transpose (no scales)": (plain_cast_and_transpose, 4),
        "quantize_rows, 32-row slabs": (
            lambda x: block_quantize.quantize_rows(x, E4M3, **RULE, tuning=slabs[0]),
            4,
        ),
        "quantize_rows_and_columns, 32-row slabs": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE, tuning=slabs[0]),
            4,
        ),
        "quantize_rows_and_columns, 16-row slabs, 8 warps": (
            lambda x: block_quantize.quantize_rows_and_columns(x, E4M3, **RULE, tuning=slabs[1]),
            8,
        ),
    }


def ptx_of(fn, specs: tuple) -> str:
    """The PTX XLA compiles for `fn` over `specs` for an H100, comments left out."""
    before = set(glob.glob(os.path.join(DUMP, "*.ptx")))
    lowered, _ = deviceless.lower(fn, specs, {}, deviceless.h100_topology().devices[0])
    lowered.compile()
    new = sorted(set(glob.glob(os.path.join(DUMP, "*.ptx"))) - before)
    return re.sub(r"//.*", "", "".join(open(path).read() for path in new))


def row(label: str, fn, warps: int) -> str:
    ptx = ptx_of(fn, (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),))
    counts = [str(len(re.findall(pattern, ptx))) for pattern in COUNTED.values()]
    regs = registers(ptx)
    cells = [label, str(warps), *counts, str(ptx.count("\n")), regs, programs_per_sm(regs, warps)]
    return "| " + " | ".join(cells) + " |"


def transpose_first_rows() -> list[str]:
    """Per transposing kernel of the GPU check's sweep (`gpu_check.quantize.TUNINGS`, 4 warps):
    its byte loads and `ldmatrix` transposes cast, then transposed, and transposed before the
    cast (`ColumnTuning.transpose_first`), whether the two compile to the same instructions
    (the same count of each opcode), and the same counts widened to BF16 to transpose
    (`ColumnTuning.wide_transpose`)."""
    bf16 = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),)
    saved = (jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((K // 128, M), jnp.float32))
    out = []
    for label in TUNINGS:
        if label == "rows":  # no transposed copy
            continue
        ptx = [
            ptx_of(
                transposing_kernel(label, block_quantize.ColumnTuning(num_warps=4, **first), M),
                saved if label in REQUANTIZING else bf16,
            )
            for first in ({}, {"transpose_first": True}, {"wide_transpose": True})
        ]
        ops = [collections.Counter(re.findall(r"^\s+([a-z][\w.]*)", t, re.M)) for t in ptx]
        cells = [f"{t.count('ld.shared.b8')} / {t.count('ldmatrix')}" for t in ptx]
        same = "yes" if ops[0] == ops[1] else "no"
        out.append(f"| {label} | {cells[0]} | {cells[1]} | {same} | {cells[2]} |")
    return out


def register_rows() -> list[str]:
    """Per kernel and tuning of `gpu_check.quantize.TUNINGS` (and its default in 32-row
    slabs): registers and programs per SM."""
    bf16 = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),)
    saved = (jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((K // 128, M), jnp.float32))
    out = []
    for label, tunings in TUNINGS.items():
        # Its default first; and its default in 32-row slabs, as `blockwise-slabs` runs it
        # (`quantize_slabs(32)`), where the sweep has no such tuning.
        extra = tunings[0]._replace(slab_rows=32)
        for tuning in (*tunings, *([extra] if extra not in tunings else [])):
            ptx = ptx_of(
                transposing_kernel(label, tuning, M), saved if label in REQUANTIZING else bf16
            )
            regs = registers(ptx)
            programs = programs_per_sm(regs, tuning.num_warps)
            warps = str(int(programs) * tuning.num_warps) if programs.isdigit() else "-"
            name = tuning_name(label, tuning).removeprefix(f"{label} kernel alone, ")
            out.append(f"| {label} | {name} | {regs} | {programs} | {warps} |")
    return out


def main() -> None:
    if deviceless.h100_topology() is None:
        sys.exit("no CUDA plugin: install fp8jax[h100] for the deviceless H100 compile")
    print(f"jax {jax.__version__}; deviceless H100; {M} x {K} BF16 in, 128 x 128 tiles")
    print("per thread (each PTX is one program of the kernel):")
    print()
    print(
        "| kernel | warps | "
        + " | ".join(COUNTED)
        + " | PTX lines | registers | programs / SM (registers) |"
    )
    print("|---|---|" + "---|" * len(COUNTED) + "---|---|---|")
    for label, (fn, warps) in kernels().items():
        print(row(label, fn, warps), flush=True)
    print()
    print(
        "Transposed before the cast (`ColumnTuning(transpose_first=True)`) and widened to BF16"
        " to transpose (`ColumnTuning(wide_transpose=True)`), 4 warps:"
    )
    print()
    print(
        "| kernel | ld.shared.b8 / ldmatrix, cast then transposed | the same, transposed first "
        "| same instructions | the same, widened |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(transpose_first_rows()))
    print()
    print(
        "Registers per thread (ptxas) and programs per SM by registers, each kernel of the GPU"
        " check's sweep in each of its tunings (`gpu_check.quantize.TUNINGS`, the default"
        " first) and its default in 32-row slabs (as the steps' `blockwise-slabs` run it):"
    )
    print()
    print("| kernel | tuning | registers | programs / SM (registers) | warps / SM |")
    print("|---|---|---|---|---|")
    print("\n".join(register_rows()))


if __name__ == "__main__":
    main()

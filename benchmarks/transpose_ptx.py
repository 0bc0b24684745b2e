"""The tensor-core quantization kernels (`kernels.tensor_core_transpose`, issues 38 and 39,
sessions 51-52) as ptxas and their PTX see them; deviceless, nothing runs on a GPU.

    python benchmarks/transpose_ptx.py | tee benchmarks/results/transpose_ptx.txt

Each configuration of the GPU check's `transpose` section (`gpu_check/transpose.py`,
`CONFIGS`) compiled for an H100 at the 8B block's shapes, each in a fresh process with
Mosaic GPU dumping its PTX and ptxas' log, for both kernels: the per-tensor cast with its
transposed copy (`tensor_core_cast_transpose`), the blockwise rows and columns
(`tensor_core_quantize_rows_and_columns`, the BF16 shapes), a weight's blocks
(`tensor_core_quantize_blocks`, the weight's shape), a saved activation requantized
(`tensor_core_requantize_columns`) and an activation's rows alone (`tensor_core_quantize_rows`,
the activation's shape), and since session 53 the Mixtral-like MoE layer's experts' weights
`vmap`ped through the weight kernel (one kernel for all experts), and its output gradient
and (session 54) saved FP8 activation gathered into the padded layout, and the gradient's
rows copy with its gathered copy from one read (`tensor_core_gathered`). Registers and spills, the
pipeline's stages and the programs, and per thread and tile the instructions that move a
tile: TMA copies in and out, `ldmatrix` (the BF16 tile into registers), shared-memory
stores (the FP8 copies), the `wgmma` that transposes, the conversions to FP8, and the
divisions of the blockwise scales (`div.rn.f32`, exactly rounded; Mosaic GPU's own `/` would
be `div.full.f32`).

Needs jax 0.11 or later with its CUDA plugin (the `h100` extra) for the deviceless compile.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: label -> (rows, cols, dtype), the GPU check's shapes.
SHAPES = {
    "activation 8192x4096 bf16": (8192, 4096, "bfloat16"),
    "gradient 8192x14336 bf16": (8192, 14336, "bfloat16"),
    "weight 14336x4096 f32": (14336, 4096, "float32"),
}
#: label -> (experts, rows, cols, dtype): the GPU check's experts' weights.
EXPERT_SHAPES = {"experts 8x14336x4096 bf16": (8, 14336, 4096, "bfloat16")}
#: PTX instruction prefixes counted, in the table's order.
COUNTED = (
    "cp.async.bulk.tensor",
    "ldmatrix",
    "ld.shared",
    "st.shared",
    "wgmma.mma_async",
    "cvt.rn.satfinite",
    "bar.sync",
    "shfl.sync",
    "div.rn.f32",
    "div.full.f32",
)
#: The kernels: per-tensor (every shape), blockwise tiles (16-bit shapes) and a weight's
#: blocks (the weight's shape), a saved FP8 activation requantized and an activation's rows
#: alone (the activation's shape); the weight's blocks `vmap`ped over experts' weights; an
#: expert layer's gradient gathered into the padded layout (the gradient's shape) and its
#: saved FP8 activation gathered and requantized (the activation's shape), and the gradient's
#: rows copy with its gathered copy from one read (the gradient's shape).
KERNELS = (
    "per-tensor",
    "blockwise",
    "weight blocks",
    "requantize",
    "rows",
    "experts' blocks",
    "gathered columns",
    "gathered requantization",
    "rows and gathered columns",
)
#: The kernels that read each padded tile's rows from any row (two tiles in flight by hand).
GATHERED = ("gathered columns", "gathered requantization", "rows and gathered columns")


def padded_rows(rows: int, experts: int = 8) -> int:
    """Rows of the padded layout of `rows` gathered rows over `experts` (the GPU check's
    eight, `gpu_check.quantize.row_map`)."""
    return -(-(rows + experts * 127) // 128) * 128


def compile_one(
    rows: int, cols: int, dtype: str, config: str, kernel: str, experts: int = 1
) -> None:
    """Compile `kernel` (of `KERNELS`) for an H100 (this child's only Mosaic GPU kernel),
    `vmap`ped over `experts` weights for the experts' blocks."""
    import jax
    import jax.numpy as jnp

    from fp8jax._src.kernels.tensor_core_blocks import (
        tensor_core_quantize_blocks,
        tensor_core_quantize_rows,
        tensor_core_quantize_rows_and_columns,
        tensor_core_requantize_columns,
    )
    from fp8jax._src.kernels.tensor_core_gathered import (
        tensor_core_quantize_padded_columns,
        tensor_core_quantize_rows_and_padded_columns,
        tensor_core_requantize_padded_columns,
    )
    from fp8jax._src.kernels.tensor_core_transpose import (
        TransposeConfig,
        tensor_core_cast_transpose,
    )
    from fp8jax._src.observe import deviceless
    from fp8jax._src.recipes.per_tensor_scale import MAX_SCALE

    fields = json.loads(config)
    config = dataclasses.replace(TransposeConfig(), **fields)
    spec = (jax.ShapeDtypeStruct((rows, cols), jnp.dtype(dtype)), jax.ShapeDtypeStruct((), "f4"))
    if kernel in ("requantize", "gathered requantization"):  # FP8, chunk-major scales
        spec = (
            jax.ShapeDtypeStruct((rows, cols), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((cols // 128, rows), jnp.float32),
        )

    if kernel == "experts' blocks":
        spec = (jax.ShapeDtypeStruct((experts, rows, cols), jnp.dtype(dtype)), spec[1])
    if kernel in GATHERED:  # each padded tile's first row and rows held
        tiles = jax.ShapeDtypeStruct((padded_rows(rows) // 128,), jnp.int32)
        spec = (*spec[: 2 if kernel == "gathered requantization" else 1], tiles, tiles)

    def cast(x, scale, *count):
        if kernel == "rows and gathered columns":
            fmt = jnp.float8_e4m3fn
            return tensor_core_quantize_rows_and_padded_columns(
                x, scale, *count, fmt, max_scale=MAX_SCALE, config=config
            )
        if kernel == "gathered requantization":
            return tensor_core_requantize_padded_columns(
                x, scale, *count, max_scale=MAX_SCALE, config=config
            )
        if kernel == "gathered columns":
            fmt = jnp.float8_e4m3fn
            return tensor_core_quantize_padded_columns(
                x, scale, *count, fmt, max_scale=MAX_SCALE, config=config
            )
        if kernel == "experts' blocks":
            fmt = jnp.float8_e4m3fn
            blocks = lambda w: tensor_core_quantize_blocks(  # noqa: E731
                w, fmt, max_scale=MAX_SCALE, config=config
            )
            return jax.vmap(blocks)(x)
        if kernel == "requantize":
            return tensor_core_requantize_columns(x, scale, max_scale=MAX_SCALE, config=config)
        if kernel == "rows":
            fmt = jnp.float8_e4m3fn
            return tensor_core_quantize_rows(x, fmt, max_scale=MAX_SCALE, config=config)
        if kernel == "weight blocks":
            fmt = jnp.float8_e4m3fn
            return tensor_core_quantize_blocks(x, fmt, max_scale=MAX_SCALE, config=config)
        if kernel == "blockwise":
            fmt = jnp.float8_e4m3fn
            return tensor_core_quantize_rows_and_columns(x, fmt, max_scale=MAX_SCALE, config=config)
        return tensor_core_cast_transpose(x, scale, jnp.float8_e4m3fn, config=config)

    lowered, _ = deviceless.lower(cast, spec, {}, deviceless.h100_topology().devices[0])
    lowered.compile()


def child(
    rows: int, cols: int, dtype: str, config: dict, kernel: str, experts: int = 1
) -> dict | str:
    """Compile one case in a fresh process; its ptxas figures and PTX counts."""
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_TO": dump}
        env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
        case = [rows, cols, dtype, json.dumps(config), kernel, experts]
        args = [sys.executable, __file__, json.dumps(case)]
        run = subprocess.run(args, env=env, capture_output=True, text=True)
        if run.returncode:
            return f"failed: {run.stderr.strip()[-300:]!r}"
        ptx = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptx")))
        ptxas = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas")))
    ops = collections.Counter(
        m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+\s+)?([a-z][\w.:]*)", ptx, re.M)
    )
    counts = {c: sum(n for op, n in ops.items() if op.startswith(c)) for c in COUNTED}
    counts["wgmma.mma_async"] += (
        len(re.findall(r"wgmma\.mma_async", ptx)) - counts["wgmma.mma_async"]
    )
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas)[:2]
    return {
        "registers": ", ".join(re.findall(r"Used (\d+) registers", ptxas)) or "?",
        "spills": " / ".join(spills) or "?",
        "wgmma kinds": sorted(
            set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+\.f32\.\w+\.\w+)", ptx))
        ),
        **counts,
    }


def main() -> None:
    from fp8jax._src.kernels.tensor_core_transpose import stages, tiles_per_program

    sys.path.insert(0, os.path.dirname(__file__))
    import jax
    import jax.numpy as jnp
    from gpu_check.transpose import CONFIGS
    from train_steps import table

    print(f"jax {jax.__version__}; deviceless H100; cast to E4M3 with a transposed copy")
    print("per-tensor: one scale; blockwise: 1 x 128 tiles and 128 x 1 tiles, transposed;")
    print("weight blocks: one scale a 128 x 128 block, the same values transposed;")
    print("requantize: a saved E4M3 copy's 1 x 128 tiles into 128 x 1 tiles, transposed;")
    print("rows: 1 x 128 tiles alone (on TMA; nothing to transpose);")
    print("experts' blocks: weight blocks of experts' weights under vmap, one kernel for all;")
    print("gathered columns / requantization: an expert layer's gradient / saved E4M3")
    print("activation gathered into the padded layout (8 experts) in 128 x 1 tiles, transposed;")
    print("rows and gathered columns: the gradient's 1 x 128 tiles too, from the same read")
    print("(PTX counts: static instructions of one program's code, whose loop runs once a tile)")
    print()
    head = ["kernel", "shape", "config", "stages", "programs", "registers", "spill bytes st / ld"]
    head += ["wgmma", *COUNTED]
    rows_out = []
    shapes = {k: (1, *v) for k, v in SHAPES.items()} | EXPERT_SHAPES
    for kernel in KERNELS:
        for label, (experts, rows, cols, dtype) in shapes.items():
            if (kernel == "experts' blocks") != (label in EXPERT_SHAPES):
                continue
            if kernel == "blockwise" and jnp.dtype(dtype).itemsize != 2:
                continue
            if kernel == "weight blocks" and not label.startswith("weight"):
                continue
            if kernel in ("requantize", "rows") and not label.startswith("activation"):
                continue
            gradient = ("gathered columns", "rows and gathered columns")
            if kernel in gradient and not label.startswith("gradient"):
                continue
            if kernel == "gathered requantization" and not label.startswith("activation"):
                continue
            eye = jnp.dtype(dtype) if kernel == "blockwise" else jnp.dtype(jnp.float8_e4m3fn)
            eye = None if kernel == "rows" else eye
            fp8 = kernel in ("requantize", "gathered requantization")
            operand = jnp.dtype(jnp.float8_e4m3fn) if fp8 else jnp.dtype(dtype)
            for name, config in CONFIGS.items():
                if kernel in GATHERED and config.max_concurrent_steps != 3:
                    continue  # two tiles in flight by hand: the stages do not apply
                tiles = experts * (rows // 128) * (cols // 128)
                if kernel in GATHERED:
                    tiles = padded_rows(rows) // 128 * (cols // 128)
                programs = tiles // tiles_per_program(config, tiles, experts)
                seen = child(rows, cols, dtype, dataclasses.asdict(config), kernel, experts)
                staged = str(stages(config, operand, eye))
                row = [kernel, label, name, "2 by hand" if kernel in GATHERED else staged]
                row.append(str(programs))
                if isinstance(seen, str):
                    row += [seen] + [""] * (len(head) - 6)
                else:
                    row += [seen["registers"], seen["spills"], ", ".join(seen["wgmma kinds"])]
                    row += [str(seen[c]) for c in COUNTED]
                rows_out.append(row)
    print(table(rows_out, head))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        compile_one(*json.loads(sys.argv[1]))
    else:
        main()

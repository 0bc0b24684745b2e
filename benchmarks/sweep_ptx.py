"""Whether each configuration the GPU check sweeps compiles for an H100 without spills or
serialized `wgmma` (issue 39); deviceless, nothing runs on a GPU.

    python benchmarks/sweep_ptx.py | tee benchmarks/results/sweep_ptx.txt

Each persistent kernel in each configuration of the GPU check's sweeps, at the shapes it
times them (`gpu_check.block_kernels`: its `SWEEP` at both `SHAPES`; `gpu_check.grouped`:
each grouped GEMM's default and its `SWEEP`, 16 experts over 8,192 rows, block scales),
traced through the recipes' kernel choice (`choice.persistent_kernel(config)`, as the check
traces them: the rows kernel's tile and warpgroups fixed by its items) and compiled for an
H100 with Mosaic GPU writing ptxas' log: the bytes ptxas spills (stores / loads) and whether
it serializes the `wgmma` (its warning C7514). One compile per process: Mosaic GPU reads its
dump folder when JAX starts.

Needs jax 0.11 or later with its CUDA plugin (the `h100` extra) for the deviceless compile.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

KINDS = ("dense", "rows", "tokens")


def compile_one(config_json: str, kind: str, shape: tuple[int, ...]) -> dict:
    """Compile one GEMM (this process's only Mosaic GPU kernel) and read ptxas' log."""
    import jax
    import jax.numpy as jnp

    from fp8jax._src.kernels import choice
    from fp8jax._src.kernels.grouped_gemm import row_items
    from fp8jax._src.kernels.persistent_config import PersistentConfig
    from fp8jax._src.observe import deviceless

    config = PersistentConfig(**json.loads(config_json))
    s, f8, f32 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn, jnp.float32
    out = dict(out_dtype=jnp.bfloat16)
    if kind == "dense":
        m, k, n = shape
        args = (s((m, k), f8), s((m, k // 128), f32), s((n, k), f8), s((n, k // 128), f32))

        def gemm(a, sa, b, sb):
            return choice.recipe_block_gemm(a, sa, [(b, sb)], **out)

    elif kind == "rows":
        m, k, n, g = shape
        args = (s((m, k), f8), s((m, k // 128), f32), s((g, n, k), f8))
        args += (s((g, n, k // 128), f32), s((g,), jnp.int32))

        def gemm(a, sa, b, sb, sizes):
            items = row_items(sizes, m)
            return choice.recipe_grouped_rows_gemm(a, b, items, lhs_scale=sa, rhs_scale=sb, **out)

    else:
        t, a_rows, b_rows, g = shape
        args = (s((a_rows, t), f8), s((a_rows, t // 128), f32), s((b_rows, t), f8))
        args += (s((b_rows, t // 128), f32), s((g,), jnp.int32), s((g,), jnp.int32))

        def gemm(a, sa, b, sb, start, count):
            scales = dict(lhs_scale=sa, rhs_scale=sb)
            return choice.recipe_grouped_tokens_gemm(a, b, start, count, **scales, **out)

    with choice.persistent_kernel(config):
        lowered, _ = deviceless.lower(gemm, args, {}, deviceless.h100_topology().devices[0])
    lowered.compile()
    logs = [
        open(f).read() for f in glob.glob(os.path.join(os.environ["MOSAIC_GPU_DUMP_TO"], "*.ptxas"))
    ]
    spills = [
        tuple(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", t)[:2])
        for t in logs
    ]
    return {"spills": spills, "serialized": sum(t.count("C7514") for t in logs)}


def cases() -> list[tuple[str, str, dict, tuple[int, ...]]]:
    """(label, kind, config fields, shape) of every compile."""
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_check import block_kernels, grouped

    from fp8jax._src.kernels.choice import DEFAULT_CONFIGS

    out = []
    for config in block_kernels.SWEEP:
        for label, shape in block_kernels.SHAPES.items():
            out.append((label, "dense", config, shape))
    rows, width, hidden = 8192, grouped.WIDTH, grouped.HIDDEN
    shapes = {
        "rows": {
            f"grouped up {width}->{hidden}": (rows, width, hidden, grouped.EXPERTS),
            f"grouped down {hidden}->{width}": (rows, hidden, width, grouped.EXPERTS),
        },
        "tokens": {f"grouped wgrad ({hidden}, {width})": (rows, hidden, width, grouped.EXPERTS)},
    }
    for kind in ("rows", "tokens"):
        for config in (DEFAULT_CONFIGS[kind], *grouped.SWEEP[kind]):
            for label, shape in shapes[kind].items():
                out.append((label, kind, config, shape))
    return out


def main() -> None:
    if len(sys.argv) == 4:  # a child: one compile
        print(json.dumps(compile_one(sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3])))))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    import jax
    from gpu_check.block_kernels import describe

    print(f"jax {jax.__version__}; deviceless H100; ptxas spill bytes (stores / loads) per kernel")
    print()
    print("| GEMM | configuration | spills | wgmma serialized (C7514) |")
    print("|---|---|---|---|")
    for label, kind, config, shape in cases():
        dump = tempfile.mkdtemp()
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "MOSAIC_GPU_DUMP_PTXAS": "1",
            "MOSAIC_GPU_DUMP_PTX": "1",
            "MOSAIC_GPU_DUMP_TO": dump,
        }
        fields = json.dumps(dataclasses.asdict(config))
        command = [sys.executable, __file__, fields, kind, json.dumps(shape)]
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode:
            print(f"| {label} | {describe(config)} | failed: {run.stderr.strip()[-300:]!r} | |")
            continue
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        spills = ", ".join(f"{a} / {b}" for a, b in seen["spills"]) or "no log"
        print(f"| {label} | {describe(config)} | {spills} | {seen['serialized'] or 'no'} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

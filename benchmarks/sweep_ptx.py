"""Whether each configuration the GPU check sweeps compiles for an H100 without spills or
serialized `wgmma` (issue 39); deviceless, nothing runs on a GPU.

    python benchmarks/sweep_ptx.py | tee benchmarks/results/sweep_ptx.txt

Each persistent kernel in each configuration of the GPU check's sweeps, at the shapes it
times them (`gpu_check.block_kernels`: its `SWEEP` at both `SHAPES`; `gpu_check.grouped`:
each grouped GEMM's default and its `SWEEP`, 16 experts over 8,192 rows, block scales),
traced through the recipes' kernel choice (`choice.persistent_kernel(config)`, as the check
traces them: the rows kernel's tile and warpgroups fixed by its items) and compiled for an
H100 with Mosaic GPU writing ptxas' log: the bytes ptxas spills (stores / loads) and whether
it serializes the `wgmma` (its warning C7514). Then the MoE section's layer step in each of
`MOE_VARIANTS`, whole, traced as on a GPU (the persistent grouped kernels chosen): each of
its grouped kernels' spills. One compile per process: Mosaic GPU reads its dump folder when
JAX starts.

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

#: The MoE section's variants compiled whole (their step as a GPU traces it).
MOE_VARIANTS = ("blockwise", "blockwise-tile-scales", "blockwise-chained", "delayed-e4m3")


def ptxas_logs() -> list[str]:
    """The ptxas logs Mosaic GPU wrote in this process."""
    paths = glob.glob(os.path.join(os.environ["MOSAIC_GPU_DUMP_TO"], "*.ptxas"))
    return [open(path).read() for path in paths]


def read(logs: list[str]) -> dict:
    """Each kernel's spill bytes (stores, loads) and the count of C7514 warnings."""
    spills = [
        tuple(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", t)[:2])
        for t in logs
    ]
    return {"spills": spills, "serialized": sum(t.count("C7514") for t in logs)}


def compile_moe(variant: str) -> dict:
    """The GPU check's MoE layer step of `variant` at its full shape, traced as on a GPU (the
    persistent grouped kernels the default: `choice.on_gpu` answers yes) and compiled for an
    H100 in cuBLAS mode."""
    import equinox as eqx

    import fp8jax
    from fp8jax._src.kernels import choice
    from fp8jax._src.observe import deviceless

    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_check import moe

    choice.on_gpu = lambda: True  # this process compiles nothing else
    layer, x = eqx.filter_eval_shape(lambda: moe.arguments(moe.shape("full"), variant))
    device = deviceless.h100_topology().devices[0]
    lowered, _ = deviceless.lower(moe.step(variant), (layer, x), {}, device)
    lowered.compile(compiler_options=fp8jax.gpu_compiler_options())
    return read(ptxas_logs())


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
    return read(ptxas_logs())


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


def child(env: dict, *args: str) -> dict | str:
    """Run this file on `args` in a fresh process (its own dump folder): the compile's
    reading, or the error's last line."""
    dump = tempfile.mkdtemp()
    env = {**env, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_PTXAS": "1"}
    env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=dump)
    run = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if run.returncode:
        return f"failed: {run.stderr.strip()[-300:]!r}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def cell(seen: dict | str) -> str:
    """A compile's table cells: spill bytes per kernel, and C7514 warnings."""
    if isinstance(seen, str):
        return f"{seen} | "
    spills = ", ".join(f"{a} / {b}" for a, b in seen["spills"]) or "no log"
    return f"{spills} | {seen['serialized'] or 'no'}"


def main() -> None:
    if len(sys.argv) == 4:  # a child: one GEMM
        print(json.dumps(compile_one(sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3])))))
        return
    if len(sys.argv) == 3:  # a child: the MoE layer's step
        print(json.dumps(compile_moe(sys.argv[2])))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    import jax
    from gpu_check.block_kernels import describe

    print(f"jax {jax.__version__}; deviceless H100; ptxas spill bytes (stores / loads) per kernel")
    print()
    print("| GEMM | configuration | spills | wgmma serialized (C7514) |")
    print("|---|---|---|---|")
    for label, kind, config, shape in cases():
        fields = json.dumps(dataclasses.asdict(config))
        seen = child(os.environ, fields, kind, json.dumps(shape))
        print(f"| {label} | {describe(config)} | {cell(seen)} |", flush=True)
    print()
    print("The GPU check's MoE layer step (8 experts of 14336, 8,192 tokens, top-2), traced as on")
    print("a GPU; each grouped kernel's spills (forward and dgrad: rows; wgrad: tokens)")
    print()
    print("| MoE variant | spills | wgmma serialized (C7514) |")
    print("|---|---|---|")
    for variant in MOE_VARIANTS:
        print(f"| {variant} | {cell(child(os.environ, 'moe', variant))} |", flush=True)


if __name__ == "__main__":
    main()

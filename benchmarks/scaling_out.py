"""What a sharded FP8 train step moves between GPUs, and which kernels each GPU runs, read from
deviceless compiles for 8 H100s (nothing runs; the figures are the compiled program's).

    python benchmarks/scaling_out.py --sections fsdp | tee benchmarks/results/scaling_out.txt
    python benchmarks/scaling_out.py --sections gpt | tee benchmarks/results/scaling_out_gpt.txt

`fsdp`: issue 26's FSDP MLP: an Equinox MLP 2048 -> 8192 -> 2048 (GELU), 8,192 tokens split
over `data` (8 GPUs), every weight split on its input axis, float32 masters cast to BF16 in
the loss, value_and_grad plus an SGD update under `jit` (`train_steps.train_step`), compiled
with fp8jax's GPU options in cuBLAS mode. Per variant: all-gather bytes per GPU per step and
their ratio to BF16's, the bytes of every other kind of collective, the GEMM kernels, and the
compiled program's temp memory per GPU; each FP8 recipe with `weight_gather="once"` (the
default: the forward's gathered FP8 weight serves the dgrad) and `"per_gemm"` (gathered
again for the dgrad).

`gpt`: the example GPT (4 layers, width 1024, 8 heads, context 512, batch 16: 8,192 tokens,
vocab 8192) under FSDP (`data` 8) and tensor parallelism (`data` 2 x `model` 4: query, key,
value and fc1 split by columns, out and fc2 by rows), with the recipes that have native
kernels (blockwise, residual). Per layout: each GEMM's kernel and the FP8 `wgmma` found in
its PTX, and each kind of collective's bytes against the BF16 program's. The process reruns
itself with Mosaic GPU's PTX dump on (`MOSAIC_GPU_DUMP_PTX=1`): without it the inspector
cannot read a Mosaic kernel's PTX.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss

sys.path.insert(0, os.path.dirname(__file__))
from train_steps import RECIPES, train_step  # noqa: E402

MIB = 2**20
#: `--sections`' values, in the order they run.
SECTIONS = ("fsdp", "gpt")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}


def collective_bytes(report: fp8jax.Inspection, mode: str = "cublas") -> dict[str, float]:
    """Bytes per GPU of each kind of collective, summed over the program: an all-gather's
    result over the devices (the shard a GPU sends in, where it gathers over all of them),
    an all-reduce's array, a reduce-scatter's result (the shard a GPU keeps: its full input
    is that times the devices it scatters over, which the inspector does not give)."""
    totals: dict[str, float] = collections.defaultdict(float)
    devices = int(report.target.split(" x ")[0])
    for c in report.collectives[mode]:
        size = sum(
            (1 if d.startswith("f8") else _BYTES.get(d, 4)) * int(jnp.prod(jnp.array(s)))
            for s, d in zip(c.shapes, c.dtypes, strict=True)
        )
        totals[c.op] += size / devices if c.op == "all-gather" else size
    return dict(totals)


def recipe_variant(model, name: str, weight_gather: str = "once"):
    if name == "bf16":
        return model
    recipe = dataclasses.replace(RECIPES[name], weight_gather=weight_gather)
    return fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe))


def place(tree, spec_of):
    """`tree` as `jax.ShapeDtypeStruct`s placed by `spec_of(path, leaf)`."""

    def one(path, a):
        if not eqx.is_array(a):
            return a
        sharding = spec_of(jax.tree_util.keystr(path), a)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(one, tree)


# --- the FSDP MLP ------------------------------------------------------------------------------


def mlp_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)


def fsdp_section() -> None:
    mesh = fp8jax.h100_mesh({"data": 8})
    mlp = eqx.nn.MLP(2048, 2048, 8192, 1, activation=jax.nn.gelu, key=jax.random.key(0))

    def spec_of(path, a):
        split = path.endswith(".weight") and a.ndim == 2
        return NamedSharding(mesh, P(None, "data") if split else P())

    rows = NamedSharding(mesh, P("data"))
    batch = [jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16, sharding=rows)] * 2
    step = eqx.filter_jit(train_step(mlp_loss))
    print("FSDP MLP 2048 -> 8192 -> 2048 on 8 H100s (deviceless), 8,192 tokens, cuBLAS mode")
    print(
        f"{'variant':28s} {'all-gather MiB/GPU':>18s} {'x BF16':>7s} "
        f"{'reduce-scatter (shard)':>22s} {'all-reduce':>10s} {'temp MiB':>9s}  GEMM kernels"
    )
    base = None
    variants = [("bf16", "once")] + [
        (name, gather)
        for name in ("delayed", "current", "blockwise", "residual", "mxfp8")
        for gather in ("once", "per_gemm")
    ]
    for name, gather in variants:
        t = time.time()
        model = place(recipe_variant(mlp, name, gather), spec_of)
        report = fp8jax.inspect(step, model, *batch, modes=("cublas",))
        moved = collective_bytes(report)
        gathered = moved.get("all-gather", 0.0)
        base = gathered if base is None else base
        kernels = collections.Counter(g.kernel for g in report.gemms["cublas"])
        label = name if name == "bf16" else f"{name} ({gather})"
        print(
            f"{label:28s} {gathered / MIB:18.2f} {gathered / base:7.2f} "
            f"{moved.get('reduce-scatter', 0) / MIB:22.2f} "
            f"{moved.get('all-reduce', 0) / MIB:10.2f} "
            f"{report.memory['cublas'].temp_size_in_bytes / MIB:9.0f}  "
            f"{dict(kernels)}  [{time.time() - t:.0f} s]",
            flush=True,
        )
    print()


# --- the example GPT, FSDP and tensor-parallel -------------------------------------------------

GPT_CONFIG = GPTConfig(vocab=8192, layers=4, width=1024, heads=8, context=512)
TOKENS = (16, 513)  # 512 inputs and 512 targets a sequence: 8,192 tokens, 1,024 a GPU


def gpt_spec(layout: str, mesh):
    def spec_of(path, a):
        if a.ndim != 2 or "blocks" not in path or not path.endswith(".weight"):
            return NamedSharding(mesh, P())
        if layout == "fsdp":
            return NamedSharding(mesh, P(None, "data"))
        if any(f".{n}." in path for n in ("query", "key", "value", "fc1")):
            return NamedSharding(mesh, P("model"))
        return NamedSharding(mesh, P(None, "model"))  # out, fc2: split by rows

    return spec_of


def gpt_section() -> None:
    layouts = {"fsdp": {"data": 8}, "tensor": {"data": 2, "model": 4}}
    gpt = GPT(GPT_CONFIG, key=jax.random.key(0))
    step = eqx.filter_jit(train_step(next_token_loss))
    for layout, axes in layouts.items():
        mesh = fp8jax.h100_mesh(axes)
        tokens = jax.ShapeDtypeStruct(TOKENS, jnp.int32, sharding=NamedSharding(mesh, P("data")))
        print(f"Example GPT ({GPT_CONFIG}), {layout}: {axes}, 8 H100s (deviceless)")
        base = None
        for name in ("bf16", "blockwise", "residual"):
            model = place(recipe_variant(gpt, name), gpt_spec(layout, mesh))
            report = fp8jax.inspect(step, model, tokens)
            for mode in ("cublas", "default"):
                moved = collective_bytes(report, mode)
                base = moved if base is None or name == "bf16" else base
                gemms = report.gemms[mode]
                blocks = [g for g in gemms if g.layer is not None]  # fp8jax layers' GEMMs
                native = [g for g in blocks if g.kernel == "pallas mosaic gpu"]
                proven = [g for g in native if g.fp8 and any(".e4m3.e4m3" in m for m in g.mma)]
                ratios = {
                    op: f"{b / MIB:.1f} MiB ({b / base[op]:.2f}x BF16)" if base.get(op) else b
                    for op, b in sorted(moved.items())
                }
                print(
                    f"  {name:10s} [{mode}] FP8 layers' GEMMs {len(blocks)}: Mosaic {len(native)}, "
                    f"FP8 wgmma in PTX {len(proven)}; collectives per GPU: {ratios}",
                    flush=True,
                )
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="fsdp,gpt", help=f"comma-separated, among {SECTIONS}")
    args = parser.parse_args()
    sections = args.sections.split(",")
    for section in sections:
        if section not in SECTIONS:
            parser.error(f"--sections: unknown {section!r}; choose among {', '.join(SECTIONS)}")
    if "gpt" in sections and os.environ.get("MOSAIC_GPU_DUMP_PTX") != "1":
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_TO": dump}
            sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    print(f"jax {jax.__version__}, fp8jax {fp8jax.__version__}\n")
    if "fsdp" in sections:
        fsdp_section()
    if "gpt" in sections:
        gpt_section()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()

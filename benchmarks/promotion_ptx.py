"""The block kernel's promotion in its PTX, with scales per row or per 128 x 128 block
(issue 39), and a train step on it in both XLA modes; deviceless, nothing runs on a GPU.

    python benchmarks/promotion_ptx.py | tee benchmarks/results/promotion_ptx.txt

1. `persistent_block_scaled_gemm` (1024 x 1024 -> 2048, E4M3, BF16 out) compiled for an H100
   with each operand's scales per row or per block (`block_rows`), one or two chunks a
   pipeline step: the PTX's `mul.f32`, `fma.rn.f32`, shared loads and `wgmma` per kernel,
   ptxas' spills, and whether ptxas serialized the `wgmma` (its warning C7514). The compute
   warpgroup's code holds one 128-chunk's promotion (two with two chunks a step), so these
   are per chunk and warpgroup.
2. A blockwise MLP's train step (512 -> 1024 -> 512, 256 tokens) on the persistent kernels with
   the weight's scales per block (`choice.weight_block_scales`), compiled for an H100 in
   cuBLAS mode and XLA's defaults (`fp8jax.inspect`): each GEMM's kernel and its `wgmma`;
   then the same with each program's tiles chained (`choice.chained_pipelines`), and in
   three compute warpgroups with the scales multiplied under the `wgmma` (`THREE_UNDER`).

Needs jax 0.11 or later with its CUDA plugin (the `h100` extra) for the deviceless compile.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU decides whether to dump PTX when it starts: set before JAX is imported.
DUMP = tempfile.mkdtemp()
os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=DUMP)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax._src.kernels.choice import (  # noqa: E402
    chained_pipelines,
    persistent_kernel,
    weight_block_scales,
)
from fp8jax._src.kernels.persistent_gemm import (  # noqa: E402
    PersistentConfig,
    persistent_block_scaled_gemm,
)
from fp8jax._src.observe import deviceless  # noqa: E402

M, K, N = 1024, 1024, 2048
#: (label, rows per scale of lhs and rhs)
SCALES = (("per row", (1, 1)), ("rhs per block", (1, 128)), ("both per block", (128, 128)))
#: The step's GEMMs in session 50's options: three compute warpgroups (the forward and dgrad;
#: the wgrad's scales per row on both sides keep two), the scales under the `wgmma`.
THREE_UNDER = PersistentConfig(compute_wgs=3, scales_under_wgmma=True)


def dump_since(before: set[str], suffix: str) -> str:
    files = sorted(glob.glob(os.path.join(DUMP, "*" + suffix)))
    return "".join(open(f).read() for f in files if f not in before)


def gemm_row(label: str, block_rows: tuple[int, int], per_step: int) -> str:
    f8, f32, s = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
    args = (
        s((M, K), f8),
        s((M // block_rows[0], K // 128), f32),
        s((N, K), f8),
        s((N // block_rows[1], K // 128), f32),
    )
    config = PersistentConfig(chunks_per_step=per_step)

    def gemm(a, sa, b, sb):
        kw = dict(out_dtype=jnp.bfloat16, config=config, block_rows=block_rows)
        return persistent_block_scaled_gemm(a, sa, [(b, sb)], **kw)

    before = set(glob.glob(os.path.join(DUMP, "*")))
    lowered, _ = deviceless.lower(gemm, args, {}, deviceless.h100_topology().devices[0])
    lowered.compile()
    ptx, ptxas = dump_since(before, ".ptx"), dump_since(before, ".ptxas")
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    cells = [
        label,
        str(per_step),
        str(count(r"\bmul\.(?:rn\.)?f32")),
        str(count(r"\bfma\.rn\.f32")),
        str(count(r"\bld\.shared")),
        str(count(r"wgmma\.mma_async")),
        ", ".join(re.findall(r"(\d+) bytes spill stores", ptxas)) or "?",
        "yes" if "C7514" in ptxas else "no",
    ]
    return "| " + " | ".join(cells) + " |"


def step_rows(chained: bool = False, config: PersistentConfig | None = None) -> list[str]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    layers = (eqx.nn.Linear(512, 1024, key=k1), eqx.nn.Linear(1024, 512, key=k2))
    model = fp8jax.fp8_linear_layers(layers, fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling()))
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)

    def loss(model, x):
        first, second = model
        return jnp.sum(jax.vmap(lambda t: second(jax.nn.relu(first(t))))(x) ** 2)

    step = fp8jax.filter_value_and_grad(loss)
    chain = chained_pipelines() if chained else contextlib.nullcontext()
    with persistent_kernel(config), weight_block_scales(), chain:
        report = fp8jax.inspect(step, model, x, modes=("cublas", "default"))
    rows = []
    for mode in ("cublas", "default"):
        for g in report.gemms[mode]:
            if g.layer is None:
                continue
            mma = ", ".join(sorted(set(g.mma))) or "-"
            what = f"{mode}{', chained' if chained else ''}"
            what += ", three warpgroups, scales under the wgmma" if config else ""
            rows.append(f"| {what} | {g.layer} | {g.role} | {g.kernel_name} | {g.fp8} | {mma} |")
    return rows


def main() -> None:
    print(f"jax {jax.__version__}; deviceless H100; {M} x {K} -> {N}, E4M3, BF16 out")
    print()
    print(
        "| scales | chunks a step | mul.f32 | fma.rn.f32 | ld.shared | wgmma | spill bytes "
        "| wgmma serialized (ptxas C7514) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, block_rows in SCALES:
        for per_step in (1, 2):
            print(gemm_row(label, block_rows, per_step))
    print()
    print(
        "Blockwise MLP 512 -> 1024 -> 512, 256 tokens, weight scales per block, both XLA modes"
        " (and chained; and three compute warpgroups with the scales under the wgmma, session 50)"
    )
    print()
    print("| mode | layer | role | kernel | FP8 | wgmma |")
    print("|---|---|---|---|---|---|")
    print("\n".join(step_rows()))
    print("\n".join(step_rows(chained=True)))
    print("\n".join(step_rows(config=THREE_UNDER)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

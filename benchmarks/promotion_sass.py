"""The block kernel's compute loop in SASS, the code an H100 runs (issue 39): where each
128-chunk's promotion sits beside its `wgmma`, and what it costs the compute warps in issue
cycles; deviceless, nothing runs on a GPU.

    pip install nvidia-cuda-nvdisasm   # CUDA's disassembler, where none is on the PATH
    python benchmarks/promotion_sass.py | tee benchmarks/results/promotion_sass.txt

`persistent_block_scaled_gemm` at Llama-3-8B's MLP up (8192 x 4096 -> 14336, E4M3, BF16
out) in the recipes' default configuration (`choice.DEFAULT_CONFIGS["dense"]`), compiled for
an H100 in a process of its own with Mosaic GPU disassembling the cubin it built (its
`MOSAIC_GPU_DUMP_SASS`, which runs `nvdisasm` from `MOSAIC_GPU_CUDA_ROOT`): the weight's
scales per row (the recipes' default) or once per 128 x 128 block (`weight_block_scales`),
one or two chunks a pipeline step; and the same pipeline without block scales, as the GPU
check's kernels section times it (`gpu_check.block_kernels._unscaled`): the contraction in
the `wgmma` accumulator alone (as in JAX's Hopper matmul), or each chunk's product added to
a float32 sum. For the compute warpgroups' innermost loop (the shortest loop with `wgmma`,
`QGMMA` in SASS), per chunk: instructions by kind, the instructions issued between the
chunk's first and last `QGMMA`, the waits on them (`WARPGROUP.DEPBAR.LE gsb0, n`: n groups
left in flight) and the stall cycles of the instructions' control codes summed: the fewest
cycles a warp takes to issue one chunk, its scoreboard waits (the `wgmma` and shared loads
it waits for) not counted; and of those, the cycles from the wait for a step's last `wgmma`
to the next step's first, in which the warpgroup gives the tensor cores no work. A chunk's
4 `wgmma` (64 x 128 x 32 each) are 2.1 MFLOP per warpgroup: 256 cycles of an SM's tensor
cores at H100's dense FP8 rate (8,192 FLOP per SM and cycle), the two warpgroups' chunks
512. Static readings, not timings.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

M, K, N = 8192, 4096, 14336
#: (label, rows per scale of the weight: 1 per row, 128 per block; or "one accumulation" /
#: "summed per chunk" for the pipeline without block scales, the default configuration's
#: fields changed: chunks a step; since session 50 the scales multiplied under the wgmma,
#: three compute warpgroups, whose turnaround two others' 512 tensor cycles a chunk cover)
TWO, UNDER = {"chunks_per_step": 2}, {"scales_under_wgmma": True}
VARIANTS = (
    ("weight per row (the recipes' default)", 1, {}),
    ("weight per row (the recipes' default)", 1, TWO),
    ("weight per row, scales under the wgmma", 1, UNDER),
    ("weight per 128 x 128 block", 128, {}),
    ("weight per 128 x 128 block", 128, TWO),
    ("weight per 128 x 128 block, scales under the wgmma", 128, UNDER),
    ("weight per row, three compute warpgroups", 1, {"compute_wgs": 3}),
    ("weight per 128 x 128 block, three compute warpgroups", 128, {"compute_wgs": 3}),
    ("no block scales, one accumulation", "one", {}),
    ("no block scales, summed per chunk", "sum", {}),
)
#: The grouped GEMMs of the GPU check's grouped section (16 experts over 8,192 rows, block
#: scales) in their default configurations (or with the scales multiplied under the `wgmma`,
#: where a third entry changes them): label -> (kind, which of its shapes[, fields changed]).
GROUPED = {
    "grouped rows, up 7168 -> 2048": ("rows", "up"),
    "grouped rows, down 2048 -> 7168": ("rows", "down"),
    "grouped tokens (wgrad)": ("tokens", "wgrad"),
    "grouped rows, up, scales under the wgmma": ("rows", "up", UNDER),
    "grouped tokens, scales under the wgmma": ("tokens", "wgrad", UNDER),
}


def grouped_case(label: str) -> tuple[str, tuple[int, ...]]:
    """`GROUPED[label]`'s kind and its shape as `sweep_ptx.compile_one` takes it."""
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_check import grouped

    kind, which, *_ = GROUPED[label]
    rows, width, hidden, experts = 8192, grouped.WIDTH, grouped.HIDDEN, grouped.EXPERTS
    shapes = {"up": (rows, width, hidden, experts), "down": (rows, hidden, width, experts)}
    shapes["wgrad"] = (rows, hidden, width, experts)
    return kind, shapes[which]


#: Cycles of an SM's tensor cores for one chunk's `wgmma` of one warpgroup (64 x 128 x 128
#: FP8 at 8,192 FLOP per SM and cycle).
TENSOR_CYCLES = 2 * 64 * 128 * 128 // 8192

#: A SASS line as Mosaic GPU's dump writes it with control codes: wait mask, read and write
#: barriers, yield, stall cycles, address, then the instruction.
LINE = re.compile(
    r"^\s*(?P<wait>[-\d]+):(?P<read>[-\d]+):(?P<write>[-\d]+):(?P<yield>[-Y]):(?P<stall>\d+)"
    r"\s+/\*(?P<addr>[0-9a-f]+)\*/\s+(?P<text>.*?)\s*;?\s*$"
)
LABEL = re.compile(r"^\s*(\.L_x_\d+):\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    op: str  # the opcode with its modifiers, e.g. "QGMMA.64x128x32.F32.E4M3.E4M3"
    text: str  # the whole instruction, predicate included
    stall: int  # the control code's stall cycles


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """A SASS dump's instructions in order, and each label's index among them."""
    out: list[Instruction] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = len(out)
        elif m := LINE.match(line):
            text = m.group("text")
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            out.append(Instruction(op, text, int(m.group("stall"))))
    return out, labels


def innermost_mma_loop(sass: str) -> list[Instruction]:
    """The shortest loop (a label and a branch back to it) holding a `wgmma` (`QGMMA` or
    `HGMMA`): a compute warpgroup's loop over the chunks of a tile."""
    code, labels = parse(sass)
    loops = []
    for i, ins in enumerate(code):
        m = re.search(r"\((\.L_x_\d+)\)", ins.text) if ins.op == "BRA" else None
        start = labels.get(m.group(1)) if m else None
        if start is not None and start <= i:
            body = code[start : i + 1]
            if any(b.op.startswith(("QGMMA", "HGMMA")) for b in body):
                loops.append(body)
    if not loops:
        raise ValueError("no loop with a wgmma (QGMMA / HGMMA) in this SASS")
    return min(loops, key=len)


def read_loop(body: list[Instruction]) -> dict:
    """Per chunk (4 `wgmma` a chunk): instructions by kind, those issued between the
    chunk's first and last `wgmma`, the loop's waits on them and its stall cycles."""
    mma = [i for i, b in enumerate(body) if b.op.startswith(("QGMMA", "HGMMA"))]
    chunks = len(mma) // 4
    kinds = collections.Counter(b.op.split(".")[0] for b in body)
    between = sum(mma[4 * c + 3] - mma[4 * c] - 3 for c in range(chunks))
    waits = [
        int(m.group(1))
        for b in body
        if (m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", b.text))
    ]
    last_wait = max(i for i, b in enumerate(body) if b.op.startswith("WARPGROUP.DEPBAR"))
    # From the wait for the loop's last wgmma to the next iteration's first: issue cycles in
    # which this warpgroup gives the tensor cores nothing.
    turnaround = sum(b.stall for b in body[last_wait:]) + sum(b.stall for b in body[: mma[0]])
    per = lambda n: round(n / chunks, 1)  # noqa: E731
    return {
        "chunks": chunks,
        "instructions": per(len(body) - len(mma)),
        "FMUL": per(kinds["FMUL"]),
        "FFMA": per(kinds["FFMA"]),
        "FADD": per(kinds["FADD"]),
        "LDS": per(kinds["LDS"]),
        "between": per(between),
        "waits": waits,
        "stall": per(sum(b.stall for b in body)),
        "turnaround": turnaround,
        "local": kinds["LDL"] + kinds["STL"],
    }


def local_memory(sass: str) -> tuple[int, int, int]:
    """The kernel's local-memory stores and loads (`STL`, `LDL`: ptxas' spills), and of the
    stores those before the warpgroups split (the first `USETMAXREG`): the kernel's
    prologue, run once."""
    code, _ = parse(sass)
    split = next((n for n, i in enumerate(code) if i.op.startswith("USETMAXREG")), len(code))
    stores = [n for n, i in enumerate(code) if i.op.startswith("STL")]
    loads = sum(i.op.startswith("LDL") for i in code)
    return len(stores), loads, sum(n < split for n in stores)


def nvdisasm() -> str | None:
    """CUDA's disassembler: on the PATH, or from the `nvidia-cuda-nvdisasm` wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        paths = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if paths:
            return paths[-1]
    return None


def compile_one(scales: int | str, changes: dict) -> None:
    """Compile one GEMM for an H100 (a child's only Mosaic GPU kernel): the dense kernel
    (`scales` a `VARIANTS` entry's), or with `scales` a key of `GROUPED` the grouped GEMM
    in its default configuration at the GPU check's shape (`sweep_ptx.compile_one`)."""
    import jax
    import jax.experimental.mosaic.gpu  # noqa: F401  (sets MOSAIC_GPU_CUDA_ROOT)
    import jax.numpy as jnp

    # Mosaic GPU points its tools at jax's CUDA when imported; its disassembler is ours.
    os.environ["MOSAIC_GPU_CUDA_ROOT"] = os.environ["PROMOTION_SASS_CUDA_ROOT"]
    from fp8jax._src.kernels.choice import DEFAULT_CONFIGS
    from fp8jax._src.kernels.persistent_gemm import persistent_block_scaled_gemm
    from fp8jax._src.observe import deviceless

    sys.path.insert(0, os.path.dirname(__file__))
    import sweep_ptx
    from gpu_check import block_kernels

    if scales in GROUPED:
        kind, shape = grouped_case(scales)
        changes = GROUPED[scales][2] if len(GROUPED[scales]) > 2 else {}
        config = dataclasses.replace(DEFAULT_CONFIGS[kind], **changes)
        fields = json.dumps(dataclasses.asdict(config))
        sweep_ptx.compile_one(fields, kind, shape)
        return

    config = dataclasses.replace(DEFAULT_CONFIGS["dense"], **changes)
    s, f8, f32 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn, jnp.float32
    if isinstance(scales, str):  # the pipeline without block scales
        args = (s((M, K), f8), s((N, K), f8))

        def gemm(a, b):
            return block_kernels._unscaled(a, b, config=config, promote=scales == "sum")

    else:
        args = (s((M, K), f8), s((M, K // 128), f32), s((N, K), f8))
        args += (s((N // scales, K // 128), f32),)

        def gemm(a, sa, b, sb):
            kw = dict(out_dtype=jnp.bfloat16, config=config, block_rows=(1, scales))
            return persistent_block_scaled_gemm(a, sa, [(b, sb)], **kw)

    device = deviceless.h100_topology().devices[0]
    lowered, _ = deviceless.lower(gemm, args, {}, device)
    lowered.compile()


def child(tool: str, scales: int | str, changes: dict) -> dict | str:
    """Compile one variant in a fresh process and read its loop, or the error's last line."""
    with tempfile.TemporaryDirectory() as dump, tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "bin"))
        os.symlink(tool, os.path.join(root, "bin", "nvdisasm"))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_TO": dump}
        env.update(MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1")
        env["PROMOTION_SASS_CUDA_ROOT"] = root
        args = [sys.executable, __file__, json.dumps([scales, changes])]
        run = subprocess.run(args, env=env, capture_output=True, text=True)
        if run.returncode:
            return f"failed: {run.stderr.strip()[-300:]!r}"
        read = lambda pattern: "".join(  # noqa: E731
            Path(p).read_text() for p in glob.glob(os.path.join(dump, pattern))
        )
        sass, ptxas = read("*.sass*"), read("*.ptxas")
    if not sass:
        return "no SASS written (Mosaic GPU found no nvdisasm)"
    seen = read_loop(innermost_mma_loop(sass))
    seen["registers"] = ", ".join(re.findall(r"Used (\d+) registers", ptxas)) or "?"
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas)[:2]
    seen["spills"] = " / ".join(spills) or "?"
    seen["kernel local"] = local_memory(sass)
    return seen


def row(label: str, per_step: int, seen: dict | str) -> str:
    if isinstance(seen, str):
        return f"| {label} | {per_step} | {seen} |" + " |" * 10
    waits = ", ".join(str(w) for w in seen["waits"])
    cells = [label, per_step] + [seen[k] for k in ("instructions", "FMUL", "FFMA", "FADD")]
    cells += [seen["LDS"], seen["between"], waits, seen["stall"], seen["turnaround"]]
    cells += [seen["registers"], seen["spills"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    if len(sys.argv) == 2:  # a child: one GEMM
        compile_one(*json.loads(sys.argv[1]))
        return
    tool = nvdisasm()
    if tool is None:
        sys.exit("no nvdisasm: pip install nvidia-cuda-nvdisasm (or put CUDA's on the PATH)")
    import jax

    print(f"jax {jax.__version__}; deviceless H100; {M} x {K} -> {N}, E4M3, BF16 out; {tool}")
    print(
        "compute warpgroups' innermost loop, per 128-chunk and warp; a chunk's wgmma: "
        f"{TENSOR_CYCLES} tensor-core cycles of the SM per warpgroup"
    )
    print()
    print(
        "| scales | chunks a step | instructions beside the 4 wgmma | FMUL | FFMA | FADD | LDS "
        "| issued between the first and last wgmma | waits (groups left in flight) "
        "| stall cycles (control codes) | from the last wait to the next wgmma (cycles, a step) "
        "| registers (ptxas) | spill bytes, stores / loads (ptxas) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, scales, changes in VARIANTS:
        per_step = changes.get("chunks_per_step", 1)
        print(row(label, per_step, child(tool, scales, changes)), flush=True)
    print()
    print(
        "The grouped GEMMs (the GPU check's grouped section: 16 experts over 8,192 rows, block "
        "scales, default configurations, and with the scales under the wgmma): where ptxas' "
        "spills sit"
    )
    print()
    print(
        "| grouped GEMM | spill bytes, stores / loads (ptxas) | local stores / loads in the "
        "kernel (STL / LDL) | stores before the warpgroups split | local loads and stores in "
        "the chunk loop "
        "| instructions beside the 4 wgmma | from the last wait to the next wgmma (cycles) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label in GROUPED:
        seen = child(tool, label, {})
        if isinstance(seen, str):
            print(f"| {label} | {seen} | | | | | |", flush=True)
            continue
        stl, ldl, prologue = seen["kernel local"]
        cells = [label, seen["spills"], f"{stl} / {ldl}", prologue, seen["local"]]
        cells += [seen["instructions"], seen["turnaround"]]
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""What the GPU kernels of a compile multiply with, read from their PTX.

The HLO says which operand types a GEMM takes; only the PTX of the kernel that runs it says
whether it multiplies FP8 on tensor cores (`wgmma ... e4m3`) or converts its operands first
(`cvt.rn.f16x2.e4m3x2`). `compile_with_ptx` compiles keeping XLA's PTX, and that of Pallas
Mosaic GPU kernels where the process asked Mosaic to dump it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterable
from typing import Any

from .hlo import Instruction, Module, kernel_hashes, parse

#: The FP8 operand type of a PTX matrix-multiply instruction (`wgmma ... .e4m3`).
FP8_MMA = re.compile(r"\.e[45]m[23]\b")
_MMA_TYPES = re.compile(r"\.(e4m3|e5m2|f16|bf16|tf32|f32|f64|s8|u8|s4|u4|b1)\b")
_PTX_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)", re.MULTILINE)
_PTX_MMA = re.compile(r"\b((?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)(?:\.[\w:]+)*)")
# A conversion from FP8: PTX names the source type last (`cvt.rn.f16x2.e4m3x2`), so one to
# FP8 (`cvt.rn.satfinite.e4m3x2.f16x2`, a fused quantization) is not one.
_PTX_UPCAST = re.compile(r"\b(cvt(?:\.\w+)*\.(?:e4m3|e5m2)(?:x2)?)(?![.\w])")
_UPCAST_TARGET = re.compile(r"\.(b?f16)(?:x2)?\.")
#: A global store and its width: `st.global[.v2|.v4].b8|b16|b32|b64` (and typed forms).
_PTX_STORE = re.compile(r"\bst\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")


def mma_inputs(instruction: str) -> str:
    """The multiplied operands' type of a PTX MMA instruction (`e4m3`, `f16`, ...): the types
    after the accumulator's (`mma.sync ... .f32.f16.f16.f32`, `wgmma ... .f32.e4m3.e4m3`)."""
    types = _MMA_TYPES.findall(instruction)
    inputs = types[1:3] if len(types) >= 3 else types
    return "/".join(dict.fromkeys(inputs)) or "?"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What the PTX of one GPU kernel multiplies with: `mma` (its `mma`/`wgmma`
    instructions, distinct, in order) and `upcasts` (its conversions from FP8); and how wide
    it writes: `stores`, its global store instructions (each thread's, as unrolled) as
    `(bytes one moves, how many)` pairs by width (XLA's GPU transposes store FP8 a byte at
    a time, `benchmarks/store_widths.py`)."""

    name: str
    mma: tuple[str, ...]
    upcasts: tuple[str, ...]
    stores: tuple[tuple[int, int], ...] = ()


def ptx_kernels(texts: Iterable[str]) -> dict[str, Kernel]:
    """Kernel name -> its [`Kernel`][fp8jax._src.observe.ptx.Kernel] facts, from PTX modules.

    The instructions between one `.entry` and the next belong to the first; functions a
    module defines before its first entry (rare in XLA's kernels) go to every entry."""
    kernels: dict[str, Kernel] = {}
    for text in texts:
        entries = list(_PTX_ENTRY.finditer(text))
        shared = text[: entries[0].start()] if entries else ""
        for i, entry in enumerate(entries):
            end = entries[i + 1].start() if i + 1 < len(entries) else len(text)
            body = shared + text[entry.start() : end]
            kernels[entry.group(1)] = Kernel(
                entry.group(1),
                tuple(dict.fromkeys(_PTX_MMA.findall(body))),
                tuple(dict.fromkeys(_PTX_UPCAST.findall(body))),
                _store_widths(body),
            )
    return kernels


def sixteen_bit_kind(kernel: Kernel) -> str | None:
    """The 16-bit GEMM kind (`"f16"`, `"bf16"`) a kernel of FP8 operands multiplies at when
    its PTX has no FP8 MMA but a 16-bit one, or converts FP8 operands up (to the type they
    convert to); `None` when it multiplies FP8 or shows neither."""
    if any(FP8_MMA.search(m) for m in kernel.mma):
        return None
    for inputs in map(mma_inputs, kernel.mma):
        if inputs in ("f16", "bf16"):
            return inputs
    for upcast in kernel.upcasts:
        target = _UPCAST_TARGET.search(upcast)
        if target:
            return target.group(1)
    return None


def shared_kernels(module: Module) -> dict[str, list[str]]:
    """`deduplicated_name` -> the fusions that carry it: XLA emits one kernel for them all,
    named after one of them (not always the one the attribute names)."""
    groups: dict[str, list[str]] = {}
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            dedup = instruction.deduplicated_name
            if dedup is not None:
                groups.setdefault(dedup, []).append(instruction.name)
    return groups


def kernel_names(runner: Instruction, shared: dict[str, list[str]]) -> list[str]:
    """Names the GPU kernel running a fusion may have in the PTX, most likely first: the
    fusion's own, then those of the fusions sharing its kernel (`.` and other characters PTX
    does not allow become `_`)."""
    dedup = runner.deduplicated_name
    names = [runner.name]
    if dedup is not None:
        names += [dedup, *shared.get(dedup, [])]
    return list(dict.fromkeys(re.sub(r"[^\w$]", "_", name) for name in names))


def _store_widths(body: str) -> tuple[tuple[int, int], ...]:
    widths = collections.Counter(
        int(vec or 1) * int(bits) // 8 for vec, bits in _PTX_STORE.findall(body)
    )
    return tuple(sorted(widths.items()))


#: Since jax 0.11 XLA writes each kernel's PTX into `xla_dump_to` only where this pattern
#: matches the tag "ptx" (0.10 wrote them all and ignores it). A wider pattern also dumps
#: every emitter's MLIR and LLVM passes: ten times the compile time.
_PTX_DUMP_OPTIONS = {"xla_dump_emitter_re": "^ptx$"}


def compile_with_ptx(
    lowered: Any, options: dict[str, Any]
) -> tuple[Any, Module, dict[str, Kernel]]:
    """Compile `lowered` with `options`, keeping the PTX XLA generates (`xla_dump_to`: a
    temporary folder, or the caller's): the executable, its parsed HLO, and the PTX facts of
    each kernel. Only files the compile wrote are read: new ones, and those it rewrote (a
    folder an earlier process dumped into holds the names this one writes). Pallas Mosaic GPU
    kernels are read from Mosaic's own dump, where the process enabled it (keys from
    `mosaic_key`)."""
    given = options.get("xla_dump_to")
    mosaic = os.environ.get("MOSAIC_GPU_DUMP_TO") if os.environ.get("MOSAIC_GPU_DUMP_PTX") else None
    with tempfile.TemporaryDirectory(prefix="fp8jax-inspect-") as scratch:
        folder = given or scratch
        before = _ptx_files(folder)
        mosaic_before = _ptx_files(mosaic) if mosaic else {}
        compiled = lowered.compile(
            compiler_options={**options, "xla_dump_to": folder, **_PTX_DUMP_OPTIONS}
        )
        kernels = ptx_kernels(_read(_written(folder, before)))
    dumped: list[tuple[str, Kernel]] = []
    if mosaic:
        # Mosaic GPU writes <kernel>_<n>.ptx, n counting the process's kernels, one entry each.
        for path in sorted(_written(mosaic, mosaic_before), key=_mosaic_number):
            name = re.sub(r"_\d+\.ptx$", "", os.path.basename(path))
            dumped += [(name, k) for k in ptx_kernels(_read([path])).values()]
    module = parse(compiled.as_text())
    order = kernel_hashes(lowered.as_text()) if dumped else []
    kernels.update(_mosaic_kernels(module, dumped, order))
    return compiled, module, kernels


def mosaic_key(kernel_hash: str) -> str:
    """The key of a Mosaic GPU kernel among `compile_with_ptx`'s kernels."""
    return "mosaic:" + kernel_hash


_MOSAIC_SEEN: dict[str, Kernel] = {}  # kernel_hash -> its PTX facts, for this process


def _mosaic_kernels(
    module: Module, dumped: list[tuple[str, Kernel]], order: list[str]
) -> dict[str, Kernel]:
    """`mosaic_key(kernel_hash)` -> PTX facts, for the Mosaic GPU kernels of a module.

    Mosaic compiles each kernel once per process and dumps its PTX then, as
    `<kernel name>_<n>.ptx`, which does not say which call it belongs to. Which order it
    compiles them in depends on the JAX release: JAX 0.11's in program order (`order`: the
    `kernel_hash`es of the lowered program), 0.10's in the optimized module's (a backward's
    kernels reordered by XLA's scheduler). The kernels new to this process are matched to the
    new dumps in the first of the two orders whose kernel names agree with the dumps' (where
    the calls' op_names carry names: a `plgpu.kernel`'s body name; a `pallas_call`'s op_name
    says only "pallas_call"); when the counts differ or neither order agrees, nothing new is
    matched. Kernels seen before keep what was read then."""
    calls: dict[str, str] = {}  # kernel_hash -> op_name of a call to it, in the module's order
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            digest = instruction.kernel_hash if instruction.mosaic else None
            if digest is not None:
                calls.setdefault(digest, instruction.op_name)
    fresh = [h for h in calls if h not in _MOSAIC_SEEN]
    in_program = [h for h in order if h in fresh] + [h for h in fresh if h not in order]
    named = all(any(name in calls[h] for h in fresh) for name, _ in dumped)
    for new in (in_program, fresh):
        agree = all(name in calls[h] for h, (name, _) in zip(new, dumped, strict=False))
        if new and len(new) == len(dumped) and (agree or not named):
            _MOSAIC_SEEN.update(zip(new, (k for _, k in dumped), strict=True))
            break
    return {mosaic_key(h): _MOSAIC_SEEN[h] for h in calls if h in _MOSAIC_SEEN}


def _mosaic_number(path: str) -> int:
    match = re.search(r"_(\d+)\.ptx$", path)
    return int(match.group(1)) if match else -1


def _read(paths: Iterable[str]) -> list[str]:
    texts = []
    for path in paths:
        with open(path) as f:
            texts.append(f.read())
    return texts


def _ptx_files(folder: str) -> dict[str, tuple[int, int, int]]:
    """The `.ptx` files under `folder`, each with what tells a rewrite: its inode,
    modification time and size."""
    if not os.path.isdir(folder):
        return {}
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".ptx"):
                path = os.path.join(root, name)
                stat = os.stat(path)
                files[path] = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return files


def _written(folder: str, before: dict[str, tuple[int, int, int]]) -> list[str]:
    """The `.ptx` files under `folder` that are new or rewritten since `before`, sorted."""
    return sorted(path for path, stat in _ptx_files(folder).items() if before.get(path) != stat)

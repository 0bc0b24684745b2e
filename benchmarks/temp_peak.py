"""Temp memory of the Llama block's step: what XLA allocates against what is live at once.

    JAX_PLATFORMS=cpu python benchmarks/temp_peak.py [--sizes 8B,1B] [--variants ...] \
        | tee benchmarks/results/temp_peak.txt

`memory_analysis().temp_size_in_bytes` (the issue's measure, `llama_block.py`'s "temp" column)
is the size of the one buffer XLA allocates for a step's temporaries, into which its heap
simulator packs every temporary at an offset. The packing can leave holes: the buffer may be
larger than the most bytes ever live at once. This compiles each variant for an H100 without
one (as `llama_block.py` does), has XLA dump its buffer assignment and live ranges, and prints
both: the buffer, the live peak (the most bytes of that buffer's values live at one point of
the schedule, each buffer slice counted once) and the difference, the packing's holes. Read
from the compile, not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import tempfile

import jax
import llama_block
from train_steps import table

import fp8jax

VARIANTS = ("bf16", "delayed", "delayed-steady", "delayed-steady-fused", "current")

_TEMP = re.compile(r"^allocation \d+: size (\d+), .*preallocated-temp:\n((?: value: .*\n)+)", re.M)
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", re.M)
_STEP = re.compile(r"^    (\d+):(\S+)$", re.M)
_RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$", re.M)


@dataclasses.dataclass(frozen=True)
class TempPeak:
    """A step's temp buffer (`allocated` bytes) and the most bytes of it live at once
    (`live`), at schedule position `at` (instruction `where`)."""

    allocated: int
    live: int
    at: int
    where: str


def temp_peak(buffer_assignment: str, live_range: str) -> TempPeak:
    """The `TempPeak` of XLA's dumped `*-buffer-assignment.txt` and `*-live-range.txt` of one
    module. A value XLA names `name` in the first is `name{}` in the second; values sharing a
    slice (offset, size) while live (an in-place update) count once."""
    found = _TEMP.search(buffer_assignment)
    if found is None:
        raise ValueError("no preallocated-temp allocation in the buffer assignment given")
    ranges = {name: (int(a), int(b)) for name, a, b in _RANGE.findall(live_range)}
    sequence = live_range.split("BufferLiveRange")[0]
    steps = {int(i): name for i, name in _STEP.findall(sequence)}
    live: dict[int, set[tuple[int, int]]] = {t: set() for t in range(max(steps, default=0) + 1)}
    for name, size, offset in _VALUE.findall(found.group(2)):
        span = ranges.get(name) or ranges.get(f"{name}{{}}")
        if span is None:
            raise ValueError(f"value {name!r} of the temp buffer has no live range")
        for t in range(span[0], min(span[1], len(live) - 1) + 1):
            live[t].add((int(offset), int(size)))
    at = max(live, key=lambda t: sum(size for _, size in live[t]))
    peak = sum(size for _, size in live[at])
    return TempPeak(int(found.group(1)), peak, at, steps.get(at, ""))


def compiled_temp_peak(lowered: jax.stages.Lowered) -> TempPeak:
    """The `TempPeak` of `lowered` compiled with `fp8jax.gpu_compiler_options()`, read from
    the buffer assignment and live ranges XLA dumps (checked against `memory_analysis`)."""
    with tempfile.TemporaryDirectory() as folder:
        options = {
            **fp8jax.gpu_compiler_options(),
            "xla_dump_to": folder,
            "xla_dump_hlo_as_text": True,
        }
        compiled = lowered.compile(compiler_options=options)
        found = [
            glob.glob(os.path.join(folder, f"*after_optimizations-{kind}.txt"))
            for kind in ("buffer-assignment", "live-range")
        ]
        if any(len(paths) != 1 for paths in found):
            raise RuntimeError(f"expected one dumped module, found {found}")
        texts = []
        for (path,) in found:
            with open(path) as f:
                texts.append(f.read())
    peak = temp_peak(*texts)
    temp = compiled.memory_analysis().temp_size_in_bytes
    if peak.allocated != temp:
        raise RuntimeError(f"dumped temp buffer {peak.allocated} B, memory_analysis {temp} B")
    return peak


def measure(size: str, name: str) -> TempPeak:
    """Variant `name` of block `size` compiled for one H100 (cuBLAS mode, as
    `llama_block.compile_deviceless`)."""
    return compiled_temp_peak(llama_block.lower_deviceless(size, name))


def main(argv: list[str] | None = None) -> dict[str, dict[str, TempPeak]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8B,1B")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if variants[0] != "bf16":
        raise SystemExit(f"--variants {args.variants!r}: the first should be 'bf16' (the base)")
    llama_block.check_names(parser, args.sizes.split(","), variants)
    print(f"jax {jax.__version__}; deviceless H100, cuBLAS mode, attention a stand-in\n")
    rows, results = [], {}
    for size in args.sizes.split(","):
        results[size] = {name: measure(size, name) for name in variants}
        base = results[size]["bf16"]
        for name, p in results[size].items():
            rows.append(
                [
                    size,
                    name,
                    f"{p.allocated / 2**20:.1f} ({p.allocated / base.allocated:.3f}x)",
                    f"{p.live / 2**20:.1f} ({p.live / base.live:.3f}x)",
                    f"{(p.allocated - p.live) / 2**20:.1f}",
                    p.where,
                ]
            )
    header = ["block", "variant", "temp buffer MiB (x BF16)", "live peak MiB (x BF16)"]
    print(table(rows, [*header, "holes MiB", "peak at"]))
    return results


if __name__ == "__main__":
    main()

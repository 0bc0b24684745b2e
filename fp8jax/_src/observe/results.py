"""What the inspector reports: each GEMM with the kernel that runs it and a verdict in words,
each cross-device operation, and the inspection of one program."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, final

from .hlo import F8, LAYER
from .ptx import FP8_MMA, mma_inputs

_TENSOR_CORES = {"f16": "FP16", "bf16": "BF16", "tf32": "TF32", "f64": "FP64", "s8": "INT8"}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a compiled program, and the kernel that runs it.

    **Fields:** `mode` (`"cublas"`, `"default"` or `"stablehlo"`), `instruction` (its name in
    the HLO), `kernel` (`"cublasLt f8"`, `"cublas"`, `"triton"` (a generated GEMM kernel),
    `"fusion"` (a dot XLA emitted inside another kernel), `"pallas mosaic gpu"` (a Pallas
    kernel with an MMA in its PTX, or in an fp8jax layer's scope) or `"dot"` (StableHLO)),
    `lhs` and
    `rhs` (operand element types in the HLO, e.g. `"f8e4m3fn"`), `op_name` (the JAX name stack
    it came from), `flops` (of one run, what the kernel executes, not the useful FLOPs of
    the math: `2 * output size * contracted size` of the GEMM as compiled, fp8jax's own
    kernels' from their padded shapes; a `lax.ragged_dot` that XLA compiles (op name
    `ragged_dot_general`, not fp8jax's grouped kernels) runs as one dense GEMM over all G
    groups, tokens by G x K, and counts `2 * M * G * K * N`, G times its ragged
    `2 * M * K * N`; 0 where the HLO does not say, as for another Pallas kernel), `runs`
    (how many times it runs in the program: the product of the trip counts of the loops
    around it, such as a block recipe's loop over its chunks or a scan over layers; in the
    branches of a `lax.cond` or `lax.switch`, as the cost counts them:
    the costliest branch's GEMMs run, the other branches' run 0 times;
    `flops * runs` is what it computes in all),
    `kernel_name` (the GPU kernel of a generated GEMM, as in its PTX), `mma` (the
    matrix-multiply instructions of that kernel's PTX), `upcasts` (its PTX conversions from
    FP8, e.g. `cvt.rn.f16x2.e4m3x2`), `ptx` (whether the kernel's PTX was read).

    `fp8` is true only for what runs on FP8 tensor cores: the cuBLASLt FP8 call, or a
    generated kernel whose PTX multiplies FP8 (`wgmma ... e4m3`). `verdict` says which in words.
    """

    mode: str
    instruction: str
    kernel: str
    lhs: str
    rhs: str
    op_name: str
    flops: int = 0
    kernel_name: str = ""
    mma: tuple[str, ...] = ()
    upcasts: tuple[str, ...] = ()
    ptx: bool = False
    runs: int = 1

    @property
    def fp8(self) -> bool:
        """Runs on FP8 tensor cores: the cuBLASLt FP8 GEMM, or an FP8 MMA in its PTX."""
        if self.kernel == "cublasLt f8":
            return True
        return any(FP8_MMA.search(m) for m in self.mma)

    @property
    def proven(self) -> bool:
        """What runs it is known: FP8 tensor cores or not (`False` for a kernel whose PTX was
        not read, and in a StableHLO inspection)."""
        if self.kernel in ("cublasLt f8", "cublas"):
            return True
        return self.mode != "stablehlo" and self.ptx

    @property
    def fp8_operands(self) -> bool:
        """Both operands are FP8 in the HLO (necessary for `fp8`, not sufficient)."""
        return bool(F8.match(self.lhs.lower()) and F8.match(self.rhs.lower()))

    @property
    def verdict(self) -> str:
        """What runs this GEMM and on which tensor cores, in words."""
        if self.kernel == "cublasLt f8":
            return "cuBLASLt FP8 GEMM (__cublas$lt$matmul$f8): FP8 tensor cores"
        if self.kernel == "cublas":
            return f"cuBLAS GEMM of {self.lhs} x {self.rhs}: not FP8"
        if self.mode == "stablehlo":
            return (
                f"{self.lhs} x {self.rhs} in StableHLO; no kernel was compiled (no H100 "
                "compiler: see the inspection's target): not proven"
            )
        what = f"{self.kernel} kernel {self.kernel_name or self.instruction}"
        if not self.ptx and self.kernel == "pallas mosaic gpu":
            return (
                f"{what}: no PTX of it was read (Mosaic dumps a kernel's PTX once per process, "
                "when it first compiles it, if the process started with MOSAIC_GPU_DUMP_PTX=1 "
                "and MOSAIC_GPU_DUMP_TO=<an existing folder>): not proven"
            )
        if not self.ptx:
            return f"{what}: its PTX was not found, so its instructions are unknown: not proven"
        fp8 = [m for m in self.mma if FP8_MMA.search(m)]
        if fp8:
            return f"{what}: FP8 tensor cores ({fp8[0]})"
        if not self.mma:
            return f"{what}: no tensor-core instruction in its PTX (scalar or vector code)"
        inputs = mma_inputs(self.mma[0])
        cores = f"{_TENSOR_CORES.get(inputs, inputs)} tensor cores ({self.mma[0]})"
        if self.fp8_operands or self.upcasts:
            converts = f" ({self.upcasts[0]})" if self.upcasts else ""
            return (
                f"{what}: takes FP8 operands but converts them to {inputs}{converts} and "
                f"multiplies on {cores}: not FP8 tensor cores"
            )
        return f"{what}: {self.lhs} x {self.rhs} on {cores}: not FP8"

    @property
    def layer(self) -> str | None:
        """The path of the fp8jax layer this GEMM belongs to, if any."""
        match = LAYER.search(self.op_name)
        return match.group(1) if match else None

    @property
    def role(self) -> str | None:
        """`"fwd"`, `"dgrad"` or `"wgrad"` for GEMMs of fp8jax layers."""
        match = LAYER.search(self.op_name)
        return match.group(2) if match else None

    def __str__(self) -> str:
        # A layer converted alone (the model is the Linear) has the empty path.
        layer = self.layer or "(the model)"
        where = f"{layer}/{self.role}" if self.layer is not None else self.op_name
        head = f"{where}: {self.kernel} ({self.lhs} x {self.rhs}) [{self.instruction}]"
        return f"{head}: {self.verdict}"


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device operation of a compiled program.

    **Fields:** `op` (`"all-reduce"`, `"all-gather"`, `"reduce-scatter"`, `"all-to-all"`,
    `"ragged-all-to-all"`, `"collective-permute"`), `instruction` (its name), `shapes` (the
    result arrays' shapes; a ragged all-to-all's rows to send),
    `dtypes` (their element types), `reduction` (`"add"`, `"maximum"`, ... for reductions,
    else `None`), `op_name` (the JAX name stack it came from).
    """

    op: str
    instruction: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    reduction: str | None
    op_name: str

    @property
    def elements(self) -> int:
        """How many values it moves (summed over its results)."""
        return sum(math.prod(s) for s in self.shapes)


@final
@dataclasses.dataclass(frozen=True)
class _MemoryStats:
    """A compiled executable's `memory_analysis()` figures, copied field by field: XLA's
    `CompiledMemoryStats` cannot be pickled, which made an `Inspection` fail `copy.deepcopy`
    and `pickle`. A field the installed jaxlib lacks is `None`."""

    generated_code_size_in_bytes: int | None = None
    argument_size_in_bytes: int | None = None
    output_size_in_bytes: int | None = None
    alias_size_in_bytes: int | None = None
    temp_size_in_bytes: int | None = None
    host_generated_code_size_in_bytes: int | None = None
    host_argument_size_in_bytes: int | None = None
    host_output_size_in_bytes: int | None = None
    host_alias_size_in_bytes: int | None = None
    host_temp_size_in_bytes: int | None = None
    peak_memory_in_bytes: int | None = None
    serialized_buffer_assignment_proto: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def of(cls, stats: Any) -> _MemoryStats | None:
        """`stats` as a record (`None`, or one already copied, as it is)."""
        if stats is None or isinstance(stats, cls):
            return stats
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(stats, name, None) for name in names})


@final
class Fp8InspectionError(AssertionError):
    """Raised by [`fp8jax.assert_all_fp8`][]: some GEMMs are not FP8."""


@dataclasses.dataclass
class Inspection:
    """The GEMMs of one program, per compile mode, with memory figures where compiled.

    **Fields:** `gemms` (mode -> list of [`fp8jax.Gemm`][]), `memory` (mode -> the compiled
    executable's `memory_analysis()` figures, `temp_size_in_bytes` and the others, in a frozen
    record that copies and pickles; absent in StableHLO mode), `target` (what was compiled
    for), `traffic` (mode -> bytes read and written by the entry computation's instructions
    but the GEMMs, each loop's body counted once: `cost_analysis()` of a deviceless executable
    is empty),
    `collectives` (mode -> list of [`fp8jax.Collective`][]), `cost` (mode -> the program's
    [`fp8jax.Cost`][]: GEMM FLOPs per precision and non-GEMM bytes per category, loops counted
    as often as they run; a generated GEMM of FP8 operands whose PTX multiplies at 16 bits
    counts at that precision), `first_steps` (for a step of [`fp8jax.make_train_step`][] that
    runs two programs: this inspection is of the one it runs once every scale is recorded,
    and `first_steps` of the one before, with delayed scaling's warm start; else `None`).

    Its table marks each GEMM `FP8` (runs on FP8 tensor cores), `high` (proven not to) or
    `???` (not proven either way: its kernel's PTX was not read, or a StableHLO inspection),
    and says why a mode may have no GEMM. A mode it lacks (`gemms["default"]` of an
    inspection compiled in `"cublas"` alone) raises a `KeyError` naming the modes it has.
    """

    gemms: dict[str, list[Gemm]]
    memory: dict[str, Any]
    target: str
    traffic: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: dict[str, list[Collective]] = dataclasses.field(default_factory=dict)
    cost: dict[str, Any] = dataclasses.field(default_factory=dict)
    first_steps: Inspection | None = None

    def __post_init__(self) -> None:
        # `report.gemms["triton"]` names the modes there are, not just the key.
        self.memory = {mode: _MemoryStats.of(stats) for mode, stats in self.memory.items()}
        for field in ("gemms", "memory", "traffic", "collectives", "cost"):
            setattr(self, field, _ByMode(getattr(self, field), field))

    @property
    def deviceless(self) -> bool:
        """Whether this is a real H100 compile (else a StableHLO fallback)."""
        return "stablehlo" not in self.gemms

    def _in(self, mode: str, asked: str) -> list[Gemm]:
        """The GEMMs compiled in `mode`, or an error naming the modes this inspection has."""
        if mode not in self.gemms:
            raise ValueError(
                f"Inspection.{asked}: mode={mode!r} is not one of this inspection's modes, "
                f"{sorted(self.gemms)} (fp8jax.inspect(..., modes=...) chooses them)."
            )
        return self.gemms[mode]

    def count(self, mode: str) -> tuple[int, int]:
        """(GEMMs on FP8 tensor cores, all GEMMs) in `mode`."""
        gemms = self._in(mode, "count")
        return sum(g.fp8 for g in gemms), len(gemms)

    def layers(self, mode: str) -> dict[str, dict[str, list[Gemm]]]:
        """fp8jax layer path -> role -> its GEMMs, in `mode`."""
        out: dict[str, dict[str, list[Gemm]]] = {}
        for g in self._in(mode, "layers"):
            if g.layer is not None:
                out.setdefault(g.layer, {}).setdefault(g.role or "?", []).append(g)
        return out

    def offending(self, strict: bool = False, modes: Iterable[str] | None = None) -> list[Gemm]:
        """GEMMs of fp8jax layers that do not run on FP8 tensor cores (every such GEMM with
        `strict`), in `modes` (all of this inspection's by default), `first_steps`' too."""
        if isinstance(modes, str):  # else read letter by letter: "mode='c'"
            raise ValueError(
                f"Inspection.offending: modes={modes!r} should be a tuple of modes among "
                f"{sorted(self.gemms)}, e.g. ({modes!r},)."
            )
        modes = tuple(self.gemms if modes is None else modes)
        first = [] if self.first_steps is None else self.first_steps.offending(strict, modes)
        return [
            g
            for mode in modes
            for g in self._in(mode, "offending")
            if not g.fp8 and (strict or g.layer is not None)
        ] + first

    def __str__(self) -> str:
        program = "the program" if self.first_steps is None else "the train step's program"
        recorded = "" if self.first_steps is None else " once every scale is recorded"
        lines = [f"GEMMs of {program}{recorded}, compiled for {self.target}"]
        for mode, gemms in self.gemms.items():
            fp8, total = self.count(mode)
            operands = sum(g.fp8_operands for g in gemms)
            lines.append(
                f"\n[{mode}] {fp8} of {total} GEMMs run on FP8 tensor cores "
                f"({operands} take FP8 operands)"
            )
            for g in gemms:
                lines.append(f"  {_mark(g)}  {g}")
            if not gemms:
                lines.append(
                    "  no GEMM: XLA computed every product as something else (a matrix-vector "
                    "product, as of a model called on one example, becomes a reduction) or "
                    "left it out (a product with a dimension of size 0), or there is none"
                )
            if mode in self.memory:
                temp = getattr(self.memory[mode], "temp_size_in_bytes", None)
                lines.append(f"  temp memory: {temp} bytes")
        if self.first_steps is not None:
            first = str(self.first_steps).split("\n", 1)[1]
            lines.append(f"\nIts first steps' program (delayed scaling's warm start):{first}")
        return "\n".join(lines)


@final
class _ByMode(dict):
    """An `Inspection`'s figures by compile mode: a mode it lacks raises a `KeyError` naming
    the modes it has."""

    def __init__(self, items: Any = (), field: str = "gemms"):  # as `dict(...)` too
        super().__init__(items)
        self.field = field

    def __missing__(self, mode: Any) -> Any:
        raise KeyError(
            f"Inspection.{self.field}[{mode!r}]: not a mode of this inspection, which has "
            f"{sorted(self)} (fp8jax.inspect(..., modes=...) chooses them among 'cublas' and "
            "'default'; 'stablehlo' without the h100 extra)."
        )

    def __reduce__(self) -> Any:
        return (_ByMode, (dict(self), self.field))


def _mark(gemm: Gemm) -> str:
    """The table's first column: `FP8 `, `high` (proven not FP8) or `??? ` (not proven)."""
    if gemm.fp8:
        return "FP8 "
    return "high" if gemm.proven else "??? "

"""Every GEMM of a compiled program and the kernel that runs it, read from its HLO (or, without
the H100 compile, from its StableHLO).

A GEMM is a cuBLAS custom call, a `dot` (at the top level, or inside the fusion XLA makes a
kernel of), or a Pallas Mosaic GPU call known to multiply matrices. Each is matched to the
PTX facts of its kernel where `ptx.compile_with_ptx` read them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .cost import uncounted_branches
from .hlo import (
    F8,
    FUSIONS,
    LAYER,
    Computation,
    Instruction,
    Module,
    dot_flops,
    element_type,
    is_native_gemm,
    native_gemm_cost,
    parse,
)
from .ptx import Kernel, kernel_names, mosaic_key, shared_kernels
from .results import Gemm

# Computation -> (the computation calling it, the calling instruction).
_Callers = dict[str, tuple[str, Instruction]]


def hlo_gemms(
    hlo: str | Module,
    mode: str,
    kernels: Mapping[str, Kernel] | None = None,
    *,
    uncounted: frozenset[str] | None = None,
) -> list[Gemm]:
    """Every GEMM of an optimized HLO module (its text, or it parsed): cuBLAS custom calls and
    dots (top level or inside fusions), with operand element types resolved within their
    computation.

    With `kernels` (from [`ptx_kernels`][fp8jax._src.observe.ptx.ptx_kernels]), each dot
    gets the PTX facts of the kernel that runs it: the outermost fusion around it, named as XLA
    names its kernel (the fusion's `deduplicated_name` where XLA reused a kernel, `.` as `_`).

    `uncounted`: the branches the cost does not count, where the caller has walked the cost
    already (`module_cost_and_uncounted`); else walked here (`uncounted_branches`)."""
    module = hlo if isinstance(hlo, Module) else parse(hlo)
    callers = _callers(module)
    loop_names = _loop_op_names(module, callers)
    if uncounted is None:
        uncounted = uncounted_branches(module, kernels)
    runs = _runs(callers, uncounted)
    fusions = _fusion_callers(callers)
    shared = shared_kernels(module)
    gemms = []
    for computation in module.computations.values():
        instructions = computation.instructions
        for instruction in instructions.values():
            name, op, operands = instruction.name, instruction.op, list(instruction.operands)
            target = instruction.gemm_target
            kernel_name, facts = "", None
            if target is not None:
                kernel = "cublasLt f8" if target.endswith("$f8") else "cublas"
            elif op == "custom-call" and instruction.mosaic:
                digest = instruction.kernel_hash
                facts = (kernels or {}).get(mosaic_key(digest)) if digest is not None else None
                kernel, kernel_name = "pallas mosaic gpu", facts.name if facts else name
                if not (facts and facts.mma) and not LAYER.search(instruction.rest):
                    continue  # not a GEMM, or not known to be one
                operands = _matrix_operands(operands, computation)
            elif op == "dot":
                kernel, runner = "dot", instruction
                if computation.name in fusions:  # the outermost fusion around it is the kernel
                    runner, triton = fusions[computation.name]
                    kernel = "triton" if triton else "fusion"
                candidates = kernel_names(runner, shared)
                kernel_name = candidates[0]
                if kernels is not None:
                    found = [c for c in candidates if c in kernels]
                    if found:
                        kernel_name, facts = found[0], kernels[found[0]]
            else:
                continue
            full = [instructions[o].type if o in instructions else "?" for o in operands[:2]]
            if kernel == "pallas mosaic gpu":  # its shapes say its FLOPs, if it is fp8jax's
                native = is_native_gemm(instruction)
                flops = native_gemm_cost(computation, instruction)[0] if native else 0
            else:
                flops = dot_flops(instruction.type, full[0], instruction.rest)
            gemms.append(
                Gemm(
                    mode,
                    name,
                    kernel,
                    *map(element_type, full),
                    loop_names.get(computation.name) or instruction.op_name,
                    flops,
                    kernel_name,
                    facts.mma if facts else (),
                    facts.upcasts if facts else (),
                    facts is not None,
                    runs.get(computation.name, 1),
                )
            )
    return gemms


def _matrix_operands(operands: list[str], computation: Computation) -> list[str]:
    """The operands of a kernel call that are its matrices: the FP8 ones if two are, else
    the first two (a block-scaled GEMM also takes its scales)."""
    instructions = computation.instructions
    fp8 = [o for o in operands if o in instructions and F8.match(instructions[o].type.strip())]
    return fp8[:2] if len(fp8) >= 2 else operands[:2]


def _callers(module: Module) -> _Callers:
    """Computation -> (the computation calling it, the calling instruction), for computations
    run by a fusion, a call, a loop or a conditional's branch (the first caller)."""
    callers: _Callers = {}
    for parent in module.computations.values():
        for instruction in parent.instructions.values():
            for called in instruction.bodies() + instruction.branches():
                callers.setdefault(called, (parent.name, instruction))
    return callers


def _fusion_callers(callers: _Callers) -> dict[str, tuple[Instruction, bool]]:
    """Fused computation -> (the outermost fusion running it, whether that fusion is a Triton
    GEMM)."""
    out = {}
    for computation, (_, caller) in callers.items():
        if caller.op not in FUSIONS:
            continue
        current, seen = computation, set()
        while current in callers and callers[current][1].op in FUSIONS and current not in seen:
            seen.add(current)
            parent, fusion = callers[current]
            top = (fusion, '"__triton' in fusion.rest)
            current = parent
        out[computation] = top
    return out


def _runs(callers: _Callers, uncounted: frozenset[str]) -> dict[str, int]:
    """Computation -> how many times it runs in one run of the program: the product of the
    known trip counts of the `while` loops around it (a loop's condition runs once more than
    its body; a loop whose trip count the HLO does not state counts once, as in `hlo_cost`),
    0 inside a branch of a conditional that `hlo_cost` does not count (`uncounted`: all but
    the costliest branch of each)."""
    runs: dict[str, int] = {}
    for computation in callers:
        total, seen, current = 1, set(), computation
        while current in callers and current not in seen:
            seen.add(current)
            if current in uncounted:
                total = 0
                break
            parent, caller = callers[current]
            if caller.op == "while" and caller.trip_count is not None:
                extra = 1 if caller.callee("condition") == current else 0
                total *= caller.trip_count + extra
            current = parent
        runs[computation] = total
    return runs


def _loop_op_names(module: Module, callers: _Callers) -> dict[str, str]:
    """Computation -> the JAX name of the innermost `while` loop running it (directly, or
    through fusions and calls), for loops of fp8jax layers.

    JAX traces the body of a `lax.scan` once for every scan with the same body (block recipes
    loop over the chunks of each GEMM), so the instructions inside carry the name of the
    first layer that traced it; the loop instruction itself carries its own layer's name.
    """
    names: dict[str, str] = {}
    for computation in module.computations:
        seen, current = set(), computation
        while current in callers and current not in seen:
            seen.add(current)
            parent, caller = callers[current]
            if caller.op == "while":
                if LAYER.search(caller.op_name):
                    names[computation] = caller.op_name
                break
            current = parent
    return names


_STABLEHLO_DOT = re.compile(
    r"stablehlo\.dot_general .*: \(tensor<(?:[\d?]+x)*(\w+)>, tensor<(?:[\d?]+x)*(\w+)>\).*"
    r"loc\((#loc\d+)\)"
)
_LOC = re.compile(r'^(#loc\d+) = loc\("([^"]*)"')


def stablehlo_gemms(text: str) -> list[Gemm]:
    """Every `stablehlo.dot_general` of a module printed with `debug_info=True`."""
    locations = dict(m.groups() for m in map(_LOC.match, text.splitlines()) if m)
    gemms = []
    for i, line in enumerate(text.splitlines()):
        match = _STABLEHLO_DOT.search(line)
        if match:
            lhs, rhs, loc = match.groups()
            gemms.append(
                Gemm("stablehlo", f"dot_general#{i}", "dot", lhs, rhs, locations.get(loc, ""))
            )
    return gemms

"""What a compiled program moves, read from its HLO: the cross-device operations, and the bytes
its top-level instructions other than GEMMs read and write."""

from __future__ import annotations

from .hlo import (
    FUSIONS,
    NO_TRAFFIC,
    Instruction,
    Module,
    array_bytes,
    arrays,
    is_native_gemm,
    parse,
)
from .results import Collective

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)


def hlo_collectives(hlo: str | Module) -> list[Collective]:
    """Every cross-device operation of an optimized HLO module (its text, or it parsed; async
    `-start` halves included, `-done` halves not), with the reduction its `to_apply`
    computation performs."""
    module = hlo if isinstance(hlo, Module) else parse(hlo)
    found = []
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            op = instruction.op
            base = op.removesuffix("-start")
            if base not in _COLLECTIVES:
                continue
            results = arrays(instruction.type)
            sent = sum(len(arrays(computation.type_of(o))) for o in instruction.operands)
            if op.endswith("-start") and (
                base in ("all-gather", "collective-permute") or len(results) == 2 * sent
            ):
                # Typed (operands, results): keep the results. XLA 0.11 on types an async
                # all-reduce's start so too (0.10: its results alone).
                results = results[len(results) // 2 :]
            elif base == "ragged-all-to-all":
                # The rows it sends: its first operand (an async start's type lists its
                # operands, a synchronous one's only the output buffer).
                results = arrays(computation.type_of(instruction.operands[0]))
            apply = instruction.callee("to_apply")
            reducer = module.computations.get(apply) if apply is not None else None
            found.append(
                Collective(
                    base,
                    instruction.name,
                    tuple(shape for _, shape in results),
                    tuple(dtype for dtype, _ in results),
                    reducer.root.op if reducer is not None else None,
                    instruction.op_name,
                )
            )
    return found


def hlo_memory_traffic(hlo: str | Module) -> int:
    """Bytes read and written by the entry computation's instructions other than GEMMs (of an
    HLO module's text, or it parsed): the operands and outputs of every fusion (asynchronous
    ones as one), copy and so on (a model of HBM traffic). GEMMs are cuBLAS calls, fusions
    holding a `dot` (Triton GEMMs, XLA's default mode) and fp8jax's own GEMM kernels, as
    [`fp8jax.hlo_cost`][] counts them. A loop counts its body's (and
    condition's) instructions once, a `call` its callee's, a conditional its largest
    branch's: not the tuples they carry. 0 for a module without an entry computation."""
    module = hlo if isinstance(hlo, Module) else parse(hlo)
    if module.entry is None:
        return 0
    return _traffic(module, module.entry)


def _traffic(module: Module, name: str) -> int:
    """`hlo_memory_traffic` of one computation, the computations it runs counted once."""
    computation = module.computations[name]
    total = 0
    for instruction in computation.instructions.values():
        if instruction.op in NO_TRAFFIC or _is_gemm(module, instruction):
            continue
        if instruction.op in ("while", "call"):
            total += sum(_traffic(module, c) for c in instruction.called())
            continue
        if instruction.op == "conditional":
            total += max((_traffic(module, b) for b in instruction.branches()), default=0)
            continue
        result = instruction.type
        if instruction.op == "fusion-start":  # typed ((operands), result, context)
            result = module.computations[instruction.called()[0]].root.type
        total += array_bytes(result) + sum(
            array_bytes(computation.type_of(o)) for o in instruction.operands
        )
    return total


def _is_gemm(module: Module, instruction: Instruction) -> bool:
    """A cuBLAS call, one of fp8jax's GEMM kernels, or a fusion holding a `dot` (a Triton
    GEMM), looking through nested fusions."""
    if instruction.gemm_target is not None or is_native_gemm(instruction):
        return True
    return instruction.op in FUSIONS and any(
        inner.op == "dot" or _is_gemm(module, inner)
        for name in instruction.called()
        for inner in module.computations[name].instructions.values()
    )

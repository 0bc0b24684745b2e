"""A roofline cost model of a compiled program: GEMM FLOPs per precision, the HBM bytes of
everything else and the bytes its collectives send, read from the text of an optimized HLO
module.

`hlo_cost(compiled.as_text())` walks the module the way the GPU runs it: every top-level
instruction of the entry computation, of `while` bodies (times their trip count), of `call`s
and of `conditional` branches is one kernel. A GEMM kernel (a cuBLAS custom call, or a fusion
holding a `dot`) contributes its FLOPs; a collective, the bytes it sends over NVLink or
InfiniBand; any other kernel, the bytes of its operands and results, sorted into categories
that separate what FP8 adds (amax reductions, quantizing casts, transposes, the float32
partial sums of block recipes) from the rest. An estimate, not a measurement: no launch
overhead, peak GEMM throughput, peak HBM bandwidth, peak link rates.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import final

from ..kernels import QUANTIZE_NAMES
from .hlo import (
    COMPLEX_PARTS,
    F8,
    FUSIONS,
    LAYER,
    NO_TRAFFIC,
    Computation,
    Instruction,
    Module,
    array_bytes,
    dims,
    dot_flops,
    element_type,
    is_native_gemm,
    native_gemm_cost,
    parse,
    readers,
)
from .ptx import Kernel, kernel_names, shared_kernels, sixteen_bit_kind
from .roofline import GPUS_PER_NODE, CollectiveCost, Cost, KernelCost, is_whole, total

#: An integer element type (`s8`, `u8`, `s32`, ...), or `pred`: a boolean GEMM is a loop
#: fusion, integer arithmetic on CUDA cores.
_INTEGER = re.compile(r"^(?:[su]\d+|pred)$")

# Instructions that run no kernel: they name, alias or regroup buffers.
_FREE = NO_TRAFFIC | {"opt-barrier", "add-dependency", "domain", "async-done", "async-update"}
# Collectives, counted by the bytes they send; their async `-done` halves wait, and are free.
_COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_DONE = {f"{op}-done" for op in _COLLECTIVES}
# Pure data movement: a fusion made of these alone (scalar index arithmetic aside) is a copy.
_MOVES = {
    "parameter",
    "constant",
    "bitcast",
    "reshape",
    "tuple",
    "get-tuple-element",
    "copy",
    "transpose",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
}
_COPIES = _MOVES - {"parameter", "constant", "bitcast", "reshape", "tuple", "get-tuple-element"}
_SLICES = {"slice", "dynamic-slice", "gather"}  # read only the part of operand 0 they return
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # write into operand 0's buffer


def hlo_cost(hlo: str, *, gpus_per_node: int = GPUS_PER_NODE) -> Cost:
    """The roofline [`fp8jax.Cost`][] of an optimized HLO module (`compiled.as_text()` of a
    deviceless H100 compile, say), per device.

    **GEMMs:** cuBLAS custom calls, fusions holding a `dot` (Triton GEMMs) and fp8jax's own
    GEMM kernels (`"fp8 block"` for the block-scaled one, whose FLOPs count padding), count
    `2 * |output| * |contraction|` FLOPs, of kind `"fp8"` (both operands FP8, or
    `__cublas$lt$matmul$f8`), `"bf16"`, `"f16"`, or for float32 operands `"tf32"` (what cuBLAS
    runs a float32 GEMM at under JAX's default precision on an H100) or `"f32"` with
    `precision=HIGHEST`, `"f64"` for float64, `"int8"` for 8-bit integer operands and
    `"int32"` for wider integers and booleans (XLA widens uint8 GEMMs to them); a complex GEMM
    counts the real FLOPs of its parts (4x) at their kind (`complex64` as float32, `complex128`
    as `"f64"`). Operands and results are not traffic: a GEMM at peak is bound by its FLOPs.
    The HLO does not say what a generated (Triton) kernel multiplies with: under XLA's
    default flags one of FP8 operands may convert them to f16 and run at the 16-bit peak,
    half the FP8 one, yet from the HLO alone it counts as `"fp8"`; `Inspection.cost`
    ([`fp8jax.inspect`][fp8jax.observe.inspect]) reads its PTX and prices it `"f16"`/`"bf16"`.

    **Bytes:** every other kernel counts its operands and results (a slice reads only its part,
    an in-place update writes only the update; any other custom call, cuDNN attention's say,
    its bytes alone, no FLOPs), all in the first category it belongs to:

    1. `"quantize"`: it converts something to an FP8 type (a cast; a cast fused with an amax,
       a transpose or a GELU is still a quantize; fp8jax's one-pass quantization kernels);
    2. `"amax"`: it reduces `|x|` by maximum (and writes no FP8);
    3. `"block partials"`: it runs inside a `while` loop of an fp8jax layer (the float32
       partial sums of the block recipes, the slicing of their chunks);
    4. `"transpose/copy"`: it only moves data (copies, transposes, slices, concatenations,
       including transposes of FP8 arrays already quantized);
    5. `"rest"`: everything else (norms, activations, softmax, optimizer updates).

    A fusion is classified by what it computes, looking through nested fusions.

    **Loops:** a `while` body runs its `known_trip_count` times (nested loops multiply), its
    condition one time more; a loop whose trip count the HLO does not state is counted once
    and named in `Cost.unknown_trip_counts`. A `call` counts its callee; a `conditional`
    counts its most expensive branch (by `estimate_seconds` at the H100 peaks).

    **Collectives** (all-gather, all-reduce, reduce-scatter, all-to-all, ragged all-to-all,
    collective-permute, synchronous or as async `-start`; a `-done` half is free) are counted
    apart, as [`fp8jax.CollectiveCost`][]s, loops multiplied like any kernel: the bytes one
    device sends by the ring algorithm (`(n-1)/n` of the whole array for an all-gather,
    reduce-scatter or all-to-all over `n` devices, `2(n-1)/n` for an all-reduce, the array
    for a permute; a ragged all-to-all as an all-to-all of the smaller of its rows to send
    and its output buffer, an estimate: what it sends depends on the routing at run time),
    over NVLink when each of its replica groups lies within one node of `gpus_per_node` GPUs
    (devices `k * gpus_per_node ...` are node `k`; `fp8jax.h100_mesh` numbers its GPUs so),
    over InfiniBand when a group spans nodes. `Cost.communication_seconds` prices them at
    the peak link rates of `H100`; `Cost.estimate_seconds` adds them to the kernels'
    time (no overlap) or, with `overlap=True`, takes the larger of the two (collectives
    wholly hidden under compute): the two bound the step. The model has no latency term,
    no hierarchical (tree or two-level) algorithms and no congestion; a group spanning nodes
    is priced at the InfiniBand rate for all its bytes.
    """
    if not isinstance(hlo, str):
        raise TypeError(
            f"hlo_cost: hlo={hlo!r:.80} should be the text of an HLO module (`compiled.as_text()`)."
        )
    module = parse(hlo)
    if module.entry is None:
        raise ValueError(
            f"hlo_cost: hlo={hlo[:80]!r}... has no ENTRY computation of %-named instructions; "
            "pass a compiled module's text (`compiled.as_text()`), not a Lowered's (StableHLO, "
            "or HLO before XLA's optimizations: not the kernels that run)."
        )
    return module_cost(module, gpus_per_node=gpus_per_node)


def module_cost(
    module: Module,
    *,
    gpus_per_node: int = GPUS_PER_NODE,
    kernels: Mapping[str, Kernel] | None = None,
) -> Cost:
    """The [`fp8jax.Cost`][] of a parsed HLO module with an entry computation, as `hlo_cost`
    counts it (for a caller with the module parsed already). With `kernels` (the PTX facts of
    `ptx.compile_with_ptx`), a GEMM fusion of FP8 operands whose kernel's PTX multiplies at 16
    bits (`mma.sync ... f16` after converting the FP8 up) is priced as `"f16"` or `"bf16"`,
    what it runs at, not `"fp8"`."""
    return module_cost_and_uncounted(module, gpus_per_node=gpus_per_node, kernels=kernels)[0]


def module_cost_and_uncounted(
    module: Module,
    *,
    gpus_per_node: int = GPUS_PER_NODE,
    kernels: Mapping[str, Kernel] | None = None,
) -> tuple[Cost, frozenset[str]]:
    """`module_cost` and the branches it does not count (`uncounted_branches`), from one walk
    of the module: the inspector needs both, for its cost and for its GEMMs' runs."""
    if module.entry is None:
        raise ValueError("hlo_cost: the module has no ENTRY computation.")
    if not is_whole(gpus_per_node) or gpus_per_node < 1:
        raise ValueError(
            f"hlo_cost: gpus_per_node={gpus_per_node!r} should be a whole number >= 1 (8 for "
            "a DGX H100)."
        )
    walker = _Walker(module, gpus_per_node, kernels)
    found = walker.walk(module.entry, 1, False)
    return total(found, tuple(walker.unknown)), frozenset(walker.uncounted)


def uncounted_branches(
    module: Module, kernels: Mapping[str, Kernel] | None = None
) -> frozenset[str]:
    """The branch computations of the module's `conditional`s that its cost does not count
    (all but the costliest branch of each, as `module_cost` with these `kernels` chooses
    it); none without an entry computation."""
    if module.entry is None:
        return frozenset()
    return module_cost_and_uncounted(module, kernels=kernels)[1]


@final
class _Walker:
    """Walks a module as the GPU runs it, collecting one `KernelCost` per kernel and one
    `CollectiveCost` per collective."""

    def __init__(self, module: Module, per_node: int, kernels: Mapping[str, Kernel] | None):
        self.computations = module.computations
        self.devices = module.devices
        self.per_node = per_node
        #: PTX facts by kernel name (none: priced from the HLO alone), and fusions sharing one.
        self.kernels = kernels or {}
        self.shared = shared_kernels(module) if kernels else {}
        self.unknown: list[str] = []
        #: The branches of conditionals not counted: all but the costliest of each.
        self.uncounted: set[str] = set()

    def computation(self, name: str) -> Computation:
        if name not in self.computations:
            raise ValueError(f"hlo_cost: the module calls computation {name!r}, which it lacks.")
        return self.computations[name]

    def walk(self, name: str, runs: int, layer_loop: bool) -> list[KernelCost | CollectiveCost]:
        """The kernels of a computation whose instructions run as kernels, `runs` times."""
        computation = self.computation(name)
        kernels: list[KernelCost | CollectiveCost] = []
        categories: dict[str, str | None] = {}  # kernel -> its category, for two-stage amaxes
        for instruction in computation.instructions.values():
            op = instruction.op
            if op in _FREE or op in _DONE:
                continue
            if op.removesuffix("-start") in _COLLECTIVES:
                kernels.append(self.collective(computation, instruction, runs))
            elif op == "while":
                n = instruction.trip_count
                if n is None:
                    self.unknown.append(instruction.name)
                    n = 1
                inner = bool(LAYER.search(instruction.op_name))
                body = instruction.callee("body")
                condition = instruction.callee("condition")
                if body:
                    kernels += self.walk(body, runs * n, inner)
                if condition:
                    kernels += self.walk(condition, runs * (n + 1), inner)
            elif op == "conditional":
                names = instruction.called()
                branches = [self.walk(b, runs, layer_loop) for b in names]
                if branches:
                    seconds = [total(ks).estimate_seconds() for ks in branches]
                    costliest = seconds.index(max(seconds))
                    kernels += branches[costliest]
                    self.uncounted.update(set(names) - {names[costliest]})
            elif op in ("call", "async-start"):
                for callee in instruction.called():
                    kernels += self.walk(callee, runs, layer_loop)
            else:
                kernel = self.kernel(computation, instruction, runs, layer_loop, categories)
                categories[instruction.name] = kernel.category
                kernels.append(kernel)
        return kernels

    def collective(
        self, computation: Computation, instruction: Instruction, runs: int
    ) -> CollectiveCost:
        """A collective: the array it moves per device, its group size and the link."""
        op = instruction.op.removesuffix("-start")
        types = [computation.type_of(o) for o in instruction.operands]
        if op == "ragged-all-to-all":
            # Operands: the rows to send, the output buffer, offsets and sizes. A device sends
            # at most its rows, receives at most its buffer: counted, the smaller (what moves
            # depends on the routing; the ring factor below is uniform routing's share).
            types = [min(types[:2], key=array_bytes)]
        data = sum(array_bytes(t) for t in types)
        if op == "collective-permute":
            pairs = [(s, t) for s, t in instruction.source_target_pairs if s != t]
            devices = 2 if pairs else 1
            spans = any(s // self.per_node != t // self.per_node for s, t in pairs)
        else:
            groups = instruction.replica_groups(self.devices)
            devices = max(len(g) for g in groups)
            spans = any(len({d // self.per_node for d in g}) > 1 for g in groups)
            data *= devices if op == "all-gather" else 1  # the gathered result
        return CollectiveCost(
            instruction.name,
            computation.name,
            op,
            element_type(types[0]) if types else "",
            data,
            devices,
            "infiniband" if spans else "nvlink",
            runs,
            instruction.op_name,
        )

    def kernel(
        self,
        computation: Computation,
        instruction: Instruction,
        runs: int,
        layer_loop: bool,
        categories: Mapping[str, str | None],
    ) -> KernelCost:
        inside = self.inside(computation, instruction)
        gemms = [(c, i) for c, i in inside if i.op == "dot" or i.gemm_target is not None]

        def gemm(flops: int, kind: str) -> KernelCost:  # a GEMM counts FLOPs, no bytes
            name, op = instruction.name, instruction.op
            return KernelCost(name, computation.name, op, None, 0, flops, kind, runs, op_name)

        op_name = instruction.op_name
        if instruction.op == "custom-call" and is_native_gemm(instruction):
            return gemm(*native_gemm_cost(computation, instruction))
        if gemms:
            flops, kinds = 0, {}
            for c, i in gemms:
                f = dot_flops(i.type, c.type_of(i.operands[0]) if i.operands else "", i.rest)
                kind = _gemm_kind(c, i)
                flops += f
                kinds[kind] = kinds.get(kind, 0) + f
            kind = max(kinds, key=kinds.get)
            if kind == "fp8" and instruction.op in FUSIONS:
                kind = self.ptx_kind(instruction) or kind
            return gemm(flops, kind)
        return KernelCost(
            instruction.name,
            computation.name,
            instruction.op,
            self.category(
                inside, layer_loop, self.partial_amaxes(computation, instruction, categories)
            ),
            self.traffic(computation, instruction),
            0,
            None,
            runs,
            instruction.op_name,
        )

    def ptx_kind(self, fusion: Instruction) -> str | None:
        """The 16-bit kind a GEMM fusion's kernel multiplies FP8 operands at, by its PTX."""
        for name in kernel_names(fusion, self.shared):
            if name in self.kernels:
                return sixteen_bit_kind(self.kernels[name])
        return None

    def inside(
        self, computation: Computation, instruction: Instruction
    ) -> list[tuple[Computation, Instruction]]:
        """The instruction itself and, for a fusion, every instruction it fuses (recursively)."""
        found = [(computation, instruction)]
        if instruction.op in FUSIONS:
            for callee in instruction.called():
                fused = self.computation(callee)
                for inner in fused.instructions.values():
                    found += self.inside(fused, inner)
        return found

    def partial_amaxes(
        self,
        computation: Computation,
        instruction: Instruction,
        categories: Mapping[str, str | None],
    ) -> set[str]:
        """Names, as seen inside the kernel, of its inputs that an amax or quantize kernel
        wrote: XLA splits a large max-reduction into two kernels, the second of which reduces
        the first one's partial maxima, and finishes an amax."""
        fed = {
            i
            for i, o in enumerate(instruction.operands)
            if categories.get(computation.producer(o)) in ("amax", "quantize")
        }
        if instruction.op not in FUSIONS:
            return {instruction.operands[i] for i in fed}
        fused = self.computation(instruction.called()[0])
        return {
            i.name
            for i in fused.instructions.values()
            if i.op == "parameter" and int(i.args) in fed
        }

    def category(
        self,
        inside: list[tuple[Computation, Instruction]],
        layer_loop: bool,
        partials: set[str],
    ) -> str:
        ops = [i for _, i in inside if i.op not in FUSIONS]
        if any(i.op == "convert" and F8.match(element_type(i.type)) for i in ops):
            return "quantize"
        if any(i.op == "custom-call" and _is_quantize_kernel(i) for i in ops):
            return "quantize"
        if any(self.is_amax(c, i, partials) for c, i in inside):
            return "amax"
        if layer_loop:
            return "block partials"
        arrays = [i for i in ops if not _is_scalar(i.type)]
        if arrays and all(i.op in _MOVES for i in arrays) and any(i.op in _COPIES for i in arrays):
            return "transpose/copy"
        return "rest"

    def is_amax(
        self, computation: Computation, instruction: Instruction, partials: set[str]
    ) -> bool:
        """A reduction by maximum of `|x|` (through reshapes, transposes and copies), or of
        the partial maxima of one (`partials`)."""
        if instruction.op != "reduce":
            return False
        reducer = instruction.callee("to_apply")
        if reducer is None or self.computation(reducer).root.op != "maximum":
            return False
        name = instruction.operands[0]
        source = computation.instructions.get(name)
        while source is not None and source.op in ("bitcast", "reshape", "transpose", "copy"):
            name = source.operands[0]
            source = computation.instructions.get(name)
        return name in partials or (source is not None and source.op == "abs")

    def traffic(self, computation: Computation, instruction: Instruction) -> int:
        """Bytes read and written by one run of a non-GEMM kernel."""
        operands = [array_bytes(computation.type_of(o)) for o in instruction.operands]
        if instruction.op not in FUSIONS:
            out = array_bytes(instruction.type)
            if instruction.op in _SLICES and operands:
                operands[0] = min(operands[0], out)
            elif instruction.op in _IN_PLACE and len(operands) > 1:
                update = array_bytes(computation.type_of(instruction.updated))
                operands[0], out = 0, min(out, update)
            return out + sum(operands)
        fused = self.computation(instruction.called()[0])
        params = {int(i.args): i for i in fused.instructions.values() if i.op == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for i in fused.instructions.values():
            for o in i.operands:
                users.setdefault(o, []).append(i)
        # A parameter read only through slices costs the slices.
        for index, param in params.items():
            if not 0 <= index < len(operands):
                continue
            sliced = readers(param.name, users)
            if sliced and all(r.op in _SLICES and fused.reads_first(r, param.name) for r in sliced):
                operands[index] = min(operands[index], sum(array_bytes(r.type) for r in sliced))
        # Results written in place into a parameter's buffer cost the update only.
        root = fused.root
        outputs = [fused.instructions[o] for o in root.operands] if root.op == "tuple" else [root]
        out = 0
        for result in outputs:
            base = result
            while base.op == "bitcast" and base.operands:
                base = fused.instructions[base.operands[0]]
            target = fused.instructions.get(base.operands[0]) if base.operands else None
            while target is not None and target.op == "bitcast" and target.operands:
                target = fused.instructions.get(target.operands[0])
            if base.op in _IN_PLACE and target is not None and target.op == "parameter":
                update = fused.instructions.get(base.updated)
                out += array_bytes(update.type) if update is not None else 0
                index = next((k for k, p in params.items() if p is target), -1)
                if 0 <= index < len(operands):
                    operands[index] = 0
            else:
                out += array_bytes(result.type)
        return out + sum(operands)


def _is_scalar(type_text: str) -> bool:
    return math.prod(dims(type_text)) <= 1


def _is_quantize_kernel(instruction: Instruction) -> bool:
    """One of fp8jax's one-pass quantization kernels (`kernels/block_quantize.py`,
    `cast_transpose.py`, `tensor_core_transpose.py`), by name: a scope of the op's name
    (`<name>/pallas_call` for Pallas Triton, `<name>/mpmd_map` for Mosaic GPU)."""
    return any(f"{name}/" in instruction.op_name for name in QUANTIZE_NAMES)


def _gemm_kind(computation: Computation, instruction: Instruction) -> str:
    """The rate a GEMM runs at: `"fp8"`, `"bf16"`, ..., a GEMM kind of `H100`."""
    target = instruction.gemm_target
    if target is not None and target.endswith("$f8"):
        return "fp8"
    types = [element_type(computation.type_of(o)) for o in instruction.operands[:2]]
    types = [COMPLEX_PARTS.get(t, t) for t in types]  # complex: real GEMMs of its parts
    if types and all(F8.match(t) for t in types):
        return "fp8"
    if "f64" in types:
        return "f64"
    if types and all(t in ("s8", "u8") for t in types):
        return "int8"
    if types and all(_INTEGER.match(t) for t in types):
        return "int32"  # wider integers, and uint8 widened by XLA: CUDA cores
    if "f32" in types:
        highest = re.search(r"HIGHEST|highest|ALG_DOT_F32_F32_F32", instruction.rest)
        return "f32" if highest else "tf32"
    if "f16" in types:
        return "f16"
    if "bf16" in types or any(F8.match(t) for t in types):
        return "bf16"
    return types[0] if types else "?"

"""The text of an optimized HLO module, parsed once into computations and instructions.

The inspector's reads (GEMMs, collectives, memory traffic) and the cost model all stand on
this one parse, and on the patterns here for what an instruction's text says: its types, its
JAX name stack, its custom-call target, the computations it calls.
"""

from __future__ import annotations

import dataclasses
import re

from ..ops.base import SCOPE

#: One instruction line: `[ROOT] %name = type op(operands)rest`.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
#: The head of a computation: `[ENTRY] %name (params) -> type {`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
#: An fp8jax layer's scope in a JAX name stack: its path, and its GEMM's role if named.
LAYER = re.compile(re.escape(SCOPE) + r"\[([^\]]*)\]\)*(?:/(fwd|dgrad|wgrad))?")
#: An FP8 element type (`f8e4m3fn`, `f8e5m2`, ...).
F8 = re.compile(r"^f8")
#: Opcodes that name, alias or regroup buffers: no kernel runs, no byte moves.
NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
}

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_MOSAIC_CALL = re.compile(r'custom_call_target="mosaic_gpu[^"]*"')
_KERNEL_HASH = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)"')
_DEDUPLICATED = re.compile(r'deduplicated_name="([^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODIES = re.compile(r"(?:calls|body|condition)=%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=(?:%([\w.\-]+)|\{([^}]*)\})")
_CALLEE = {
    name: re.compile(rf"\b{name}=%([\w.\-]+)")
    for name in ("body", "condition", "to_apply", "true_computation", "false_computation")
}
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ELEMENT = re.compile(r"^\(?\s*([a-z]+[0-9a-z]*)\[")
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_ITEM_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


def element_type(type_text: str) -> str:
    """The element type of the (first) array in an HLO type: `"bf16"` of `bf16[8,4]{1,0}`."""
    match = _ELEMENT.match(type_text.strip())
    return match.group(1) if match else type_text.strip()


def dims(type_text: str) -> list[int]:
    """Dimensions of the (first) array in an HLO type."""
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dimensions) of every array in an HLO type, tuples' members in order."""
    return [
        (dtype, tuple(int(d) for d in shape.split(",") if d))
        for dtype, shape in _ARRAY.findall(type_text)
    ]


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple counts all its members)."""
    total = 0
    for dtype, shape in _ARRAY.findall(type_text):
        size = 1
        for d in shape.split(","):
            size *= int(d) if d else 1
        total += size * (1 if dtype.startswith("f8") else _ITEM_BYTES.get(dtype, 4))
    return total


def operand_names(text: str) -> list[str]:
    """The `%names` in a piece of instruction text, in order."""
    return _NAME.findall(text)


def dot_flops(out_type: str, lhs_type: str, rest: str) -> int:
    """2 * |output| * |contraction| of a dot or cuBLAS GEMM, from its contracting dims."""
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest) or re.search(
        r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest
    )
    if not match:
        return 0
    lhs = dims(lhs_type)
    contracted = 1
    for d in re.findall(r"\d+", match.group(1)):
        contracted *= lhs[int(d)] if int(d) < len(lhs) else 1
    output = 1
    for d in dims(out_type):
        output *= d
    return 2 * output * contracted


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name`, result `type` (as written), `op`code, `operands` (their
    names), `args` (the operand list as written), `rest` (the attributes after it), `root`
    (whether it is its computation's result)."""

    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    args: str
    rest: str
    root: bool

    @property
    def op_name(self) -> str:
        """The JAX name stack it came from (`""` where its metadata has none)."""
        match = _OP_NAME.search(self.rest)
        return match.group(1) if match else ""

    @property
    def gemm_target(self) -> str | None:
        """The custom-call target of a cuBLAS/cuDNN GEMM call, else `None`."""
        target = _TARGET.search(self.rest) if self.op == "custom-call" else None
        if target and ("gemm" in target.group(1) or "matmul" in target.group(1)):
            return target.group(1)
        return None

    @property
    def mosaic(self) -> bool:
        """Whether it calls a Pallas Mosaic GPU kernel (an opaque custom call)."""
        return bool(_MOSAIC_CALL.search(self.rest))

    @property
    def kernel_hash(self) -> str | None:
        """The `kernel_hash` a Mosaic GPU call names its kernel by, if any."""
        match = _KERNEL_HASH.search(self.rest)
        return match.group(1) if match else None

    @property
    def deduplicated_name(self) -> str | None:
        """The fusion whose kernel XLA reuses for this one, if any."""
        match = _DEDUPLICATED.search(self.rest)
        return match.group(1) if match else None

    @property
    def trip_count(self) -> int | None:
        """A `while` loop's `known_trip_count`, where the HLO states it."""
        match = _TRIP_COUNT.search(self.rest)
        return int(match.group(1)) if match else None

    def callee(self, attribute: str) -> str | None:
        """The computation named by `body`, `condition`, `to_apply`, `true_computation` or
        `false_computation`, if it has that attribute."""
        match = _CALLEE[attribute].search(self.rest)
        return match.group(1) if match else None

    def bodies(self) -> list[str]:
        """Computations it runs as its own body: a fusion's or call's (`calls=`), a loop's
        body and condition. Reducers and branches are not among them."""
        return _BODIES.findall(self.rest)

    def called(self) -> list[str]:
        """Every computation it calls (fused, reducer, loop, branches)."""
        names = []
        for match in _CALLS.finditer(self.rest):
            names += [match.group(1)] if match.group(1) else operand_names(match.group(2))
        for pattern in _CALLEE.values():
            names += pattern.findall(self.rest)
        for match in _BRANCHES.finditer(self.rest):
            names += operand_names(match.group(1))
        return names


@dataclasses.dataclass(frozen=True)
class Computation:
    """One HLO computation: its `name` and its `instructions` by name, in order."""

    name: str
    instructions: dict[str, Instruction]

    @property
    def root(self) -> Instruction:
        """The instruction whose value the computation returns."""
        return next(i for i in self.instructions.values() if i.root)

    def type_of(self, name: str) -> str:
        """The type of instruction `name` here (`""` if it has none by that name)."""
        instruction = self.instructions.get(name)
        return instruction.type if instruction is not None else ""


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module: its `computations` by name, in order, and the `entry` computation's
    name (`None` for text without one)."""

    computations: dict[str, Computation]
    entry: str | None


def parse(text: str) -> Module:
    """The computations and instructions of an HLO module's text (`compiled.as_text()`)."""
    computations: dict[str, Computation] = {}
    current: Computation | None = None
    entry = None
    for line in text.splitlines():
        if current is None or line.startswith(("%", "ENTRY")):
            head = _COMPUTATION.match(line)
            if head:
                current = computations.setdefault(head["name"], Computation(head["name"], {}))
                if line.startswith("ENTRY"):
                    entry = current.name
                continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current.instructions[match["name"]] = Instruction(
                match["name"],
                match["type"],
                match["op"],
                tuple(operand_names(match["operands"])),
                match["operands"],
                match["rest"],
                line.lstrip().startswith("ROOT"),
            )
    return Module(computations, entry)

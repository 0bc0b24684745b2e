"""The text of an optimized HLO module, parsed once into computations and instructions.

The inspector's reads (GEMMs, collectives, memory traffic) and the cost model all stand on
this one parse, and on the patterns here for what an instruction's text says: its types, its
JAX name stack, its custom-call target, the computations it calls.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from ..kernels import BLOCK_GEMM_NAME, GROUPED_ROWS_NAME, GROUPED_TOKENS_NAME
from ..ops.base import SCOPE

#: One instruction line: `[ROOT] %name = type op(operands)rest`.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
#: The head of a computation: `[ENTRY] %name (params) -> type {`.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
#: An fp8jax layer's scope in a JAX name stack: its path, and its GEMM's role if named. The
#: path ends at the `]` that closes the scope (transforms' `)`s after it) before a `/`, the
#: name's end or its closing quote: a path may hold brackets itself (`layers[0]`). The role
#: may be wrapped in transforms too (`vmap(fwd)` under `eqx.filter_vmap` over an ensemble).
LAYER = re.compile(
    re.escape(SCOPE) + r'\[(.*?)\]\)*(?=[/"]|$)(?:/(?:\w+\()*(fwd|dgrad|wgrad)\)*(?=[/"]|$))?'
)
#: The real type of a complex type's parts: a complex GEMM runs as real GEMMs of it.
COMPLEX_PARTS = {"c64": "f32", "c128": "f64"}
#: An FP8 element type (`f8e4m3fn`, `f8e5m2`, ...).
F8 = re.compile(r"^f8")
#: Opcodes that name, alias or regroup buffers: no kernel runs, no byte moves (a
#: `fusion-done` waits for its `fusion-start`, which runs the kernel, and names its result).
NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "fusion-done",
}
#: Opcodes of a fused kernel: a fusion, or the start of one XLA runs asynchronously (from
#: JAX 0.11 on, e.g. a loop's dynamic slices: `fusion-start` typed `((operands), result,
#: context)`, its `fusion-done` the result).
FUSIONS = {"fusion", "fusion-start"}

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
#: A collective's `replica_groups`, in any of its three forms: explicit (`{{0,1},{2,3}}`,
#: `{}` for all devices), iota (`[2,4]<=[4,2]T(1,0)`) and mesh axes
#: (`mesh['x'=2,'y'=4] {'y'}`, `mesh['x'=8,'y'=8], device_ids=([8,8]T(1,0)) {'x'}`).
_GROUPS = re.compile(
    r"replica_groups=(?P<list>\{\}|\{\{[\d,{}]*\}\})"
    r"|replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<iota>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
    r"|replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\((?P<ids>.*?)\))? \{(?P<group>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?([^',=]+)'?=(\d+)")
_AXIS_REF = re.compile(r"'?([^',:]+)'?(?::\((\d+)\)(\d+))?")
_DEVICE_IOTA = re.compile(r"^\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_HEADER_COUNT = {
    name: re.compile(rf"\b{name}=(\d+)") for name in ("num_partitions", "replica_count")
}
_ELEMENT = re.compile(r"^\(?\s*([a-z]+[0-9a-z]*)\[")
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
#: The width in bits of an element type: `bf16`, `f8e4m3fn`, `s4`, `c64`, ... (`pred` is a byte).
_BITS = re.compile(r"^(?:bf|[fsuc])(\d+)")


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
    """Bytes of every array in an HLO type (a tuple counts all its members; 4-bit arrays are
    packed two elements to a byte, as XLA stores them)."""
    total = 0
    for dtype, shape in _ARRAY.findall(type_text):
        size = math.prod(int(d) for d in shape.split(",") if d)
        total += -(-size * _element_bits(dtype) // 8)
    return total


def _element_bits(dtype: str) -> int:
    """Bits an element of `dtype` takes in memory: XLA packs 1, 2 and 4-bit types (`s4`,
    `f4e2m1fn`) into bytes and gives any other narrow type (`f6e2m3fn`, `pred`) a byte."""
    if dtype == "token":
        return 0
    match = _BITS.match(dtype)
    bits = int(match.group(1)) if match else 8
    return bits if bits >= 8 or 8 % bits == 0 else 8


def operand_names(text: str) -> list[str]:
    """The `%names` in a piece of instruction text, in order."""
    return _NAME.findall(text)


def dot_flops(out_type: str, lhs_type: str, rest: str) -> int:
    """2 * |output| * |contraction| of a dot or cuBLAS GEMM, from its contracting dims; four
    times that for a complex one (a complex multiply-add is four real ones), in real FLOPs."""
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
    return (8 if element_type(out_type) in COMPLEX_PARTS else 2) * output * contracted


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

    def replica_groups(self, devices: int) -> list[tuple[int, ...]]:
        """The device groups a collective runs over, whatever form the HLO writes them in
        (one group of all `devices` where it names none)."""
        match = _GROUPS.search(self.rest)
        if match is None or match["list"] == "{}":
            return [tuple(range(devices))]
        if match["list"]:
            return [
                tuple(int(d) for d in g.split(",") if d)
                for g in re.findall(r"\{([\d,]*)\}", match["list"][1:-1])
            ]
        if match["shape"]:
            shape = _ints(match["shape"])
            ids = _iota(_ints(match["iota"]), _ints(match["perm"] or ""))
            return [tuple(int(d) for d in g) for g in ids.reshape(shape[0], -1)]
        return _mesh_groups(match["axes"], match["ids"], match["group"])

    @property
    def source_target_pairs(self) -> list[tuple[int, int]]:
        """A collective-permute's (source, target) device pairs."""
        match = _PAIRS.search(self.rest)
        pairs = re.findall(r"\{(\d+),(\d+)\}", match.group(1)) if match else []
        return [(int(s), int(t)) for s, t in pairs]

    @property
    def updated(self) -> str:
        """The operand an in-place update writes: `dynamic-update-slice(buffer, update,
        *index)`, `scatter(buffer, indices, updates)`."""
        return self.operands[-1 if self.op == "scatter" else 1]

    def callee(self, attribute: str) -> str | None:
        """The computation named by `body`, `condition`, `to_apply`, `true_computation` or
        `false_computation`, if it has that attribute."""
        match = _CALLEE[attribute].search(self.rest)
        return match.group(1) if match else None

    def bodies(self) -> list[str]:
        """Computations it runs as its own body: a fusion's (`calls=`), a `call`'s
        (`to_apply=`), a loop's body and condition. Reducers and branches are not among
        them."""
        names = _BODIES.findall(self.rest)
        callee = self.callee("to_apply") if self.op == "call" else None
        return names + [callee] if callee else names

    def branches(self) -> list[str]:
        """The branches of a `conditional` (`true_computation`/`false_computation`, or its
        `branch_computations`), each run in its place."""
        names = [self.callee(a) for a in ("true_computation", "false_computation")]
        for match in _BRANCHES.finditer(self.rest):
            names += operand_names(match.group(1))
        return [name for name in names if name]

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

    def producer(self, name: str) -> str:
        """The kernel that wrote `name`, looking through tuples' elements, bitcasts and the
        `fusion-done` of an asynchronous fusion."""
        source = self.instructions.get(name)
        looked_through = ("get-tuple-element", "bitcast", "fusion-done")
        while source is not None and source.op in looked_through and source.operands:
            name = source.operands[0]
            source = self.instructions.get(name)
        return name

    def reads_first(self, reader: Instruction, name: str) -> bool:
        """Whether `name` (or a bitcast of it) is `reader`'s first operand (the one a slice
        reads part of)."""
        source = self.instructions.get(reader.operands[0]) if reader.operands else None
        while source is not None and source.op == "bitcast" and source.name != name:
            source = self.instructions.get(source.operands[0])
        return source is not None and source.name == name


def readers(name: str, users: dict[str, list[Instruction]]) -> list[Instruction]:
    """The instructions reading `name` (`users`: each name's readers), looking through
    bitcasts."""
    found = []
    for user in users.get(name, []):
        found += readers(user.name, users) if user.op == "bitcast" else [user]
    return found


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module: its `computations` by name, in order, the `entry` computation's name
    (`None` for text without one), and how many `devices` it runs on (its header's
    `num_partitions` times `replica_count`)."""

    computations: dict[str, Computation]
    entry: str | None
    devices: int = 1


def kernel_hashes(text: str) -> list[str]:
    """The `kernel_hash`es of the Mosaic GPU calls in a program's text (HLO, or the StableHLO
    of a lowered program: both print them alike), each once, in order of appearance."""
    return list(dict.fromkeys(_KERNEL_HASH.findall(text)))


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _iota(reshape: list[int], perm: list[int]) -> np.ndarray:
    """XLA's iota tile assignment: `0..n-1` in `reshape`'s shape, transposed by `perm`."""
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return ids.transpose(perm) if perm else ids


def _mesh_groups(axes_text: str, ids_text: str | None, group_text: str) -> list[tuple[int, ...]]:
    """The groups of a mesh-axes replica group list (XLA's `MeshAxesReplicaGroupList`): the
    devices of the mesh that differ only along the grouped axes (or sub-axes `name:(pre)size`
    of an axis split `[pre, size, rest]`), one group per position on the other axes."""
    axes = [(name.strip(), int(size)) for name, size in _MESH_AXIS.findall(axes_text)]
    sizes = [size for _, size in axes]
    names = [name for name, _ in axes]
    count = math.prod(sizes)
    if ids_text is None:
        devices = np.arange(count)
    elif (iota := _DEVICE_IOTA.match(ids_text.strip())) and math.prod(_ints(iota[1])) == count:
        devices = _iota(_ints(iota[1]), _ints(iota[2] or ""))
    else:
        devices = np.array([int(d) for d in re.findall(r"\d+", ids_text)])
    refs: dict[int, list[tuple[int, int, int]]] = {}  # mesh axis -> (order, pre, size)
    for order, (name, pre, size) in enumerate(_AXIS_REF.findall(group_text)):
        if name.strip() not in names:
            raise ValueError(
                f"replica_groups: axis {name.strip()!r} of {{{group_text}}} is not among the "
                f"mesh's axes {names}."
            )
        axis = names.index(name.strip())
        refs.setdefault(axis, []).append((order, int(pre or 1), int(size or sizes[axis])))
    shape: list[int] = []
    grouped: list[tuple[int, int, int]] = []  # (mesh axis, order in the list, dim of `shape`)
    for axis, full in enumerate(sizes):
        covered = 1
        for order, pre, size in sorted(refs.get(axis, []), key=lambda r: r[1]):
            if pre != covered:  # the part of the axis before this sub-axis, not grouped
                shape.append(pre // covered)
                covered = pre
            grouped.append((axis, order, len(shape)))
            shape.append(size)
            covered *= size
        if covered != full:
            shape.append(full // covered)
    # XLA moves the grouped dimensions last, by mesh axis, then in the list's order.
    inner = [dim for _, _, dim in sorted(grouped)]
    kept = [d for d in range(len(shape)) if d not in inner]
    per_group = math.prod(shape[d] for d in inner)
    table = devices.reshape(shape).transpose(kept + inner).reshape(-1, per_group)
    return [tuple(int(d) for d in g) for g in table]


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
    header = text[: text.find("\n")] if "\n" in text else text
    counts = [_HEADER_COUNT[name].search(header) for name in ("num_partitions", "replica_count")]
    devices = math.prod(int(c.group(1)) for c in counts if c is not None)
    return Module(computations, entry, devices)


NATIVE_GEMM_NAMES = (BLOCK_GEMM_NAME, GROUPED_ROWS_NAME, GROUPED_TOKENS_NAME)


def is_native_gemm(instruction: Instruction) -> bool:
    """One of fp8jax's own GEMM kernels (`fp8jax._src.kernels`: block-scaled, grouped rows,
    grouped tokens), an opaque Mosaic GPU custom call recognized by its name."""
    return instruction.mosaic and any(name in instruction.op_name for name in NATIVE_GEMM_NAMES)


def native_gemm_cost(computation: Computation, instruction: Instruction) -> tuple[int, str]:
    """(FLOPs, rate kind) of a native kernel, from its padded shapes (the work it does).

    - block-scaled: operands `lhs (*B, M, K)`, its scales, then a weight `(*B, N, K)` and its
      scales per term: 2 * |output| * K per term;
    - grouped rows: `lhs (M, K)` (the first operand holding values) against one expert per
      row tile: 2 * |output (M, N)| * K;
    - grouped tokens: `lhs (A, T)`, each of the T padded tokens contracted for its own expert
      only: 2 * A * B * T for an output `(G, A, B)`.

    The kind is `"fp8 block"` when the kernel promotes per chunk (scales per row and chunk),
    `"fp8"` for a grouped kernel scaled once per tile, `"bf16"` for 16-bit operands."""
    out = dims(instruction.type)
    if BLOCK_GEMM_NAME in instruction.op_name:
        k = dims(computation.type_of(instruction.operands[0]))[-1]
        terms = (len(instruction.operands) - 2) // 2
        return 2 * math.prod(out) * k * terms, "fp8 block"
    types = [computation.type_of(o) for o in instruction.operands]
    values = [t for t in types if re.match(r"^(f8|bf16|f16)", element_type(t))]
    contracted = dims(values[0])[-1]
    per_chunk = any(element_type(t) == "f32" and len(dims(t)) == 2 for t in types)
    element = element_type(values[0])
    kind = "fp8 block" if per_chunk else "fp8"
    if not F8.match(element):
        kind = "f16" if element == "f16" else "bf16"
    if GROUPED_TOKENS_NAME in instruction.op_name:
        return 2 * math.prod(out[1:]) * contracted, kind
    return 2 * math.prod(out) * contracted, kind

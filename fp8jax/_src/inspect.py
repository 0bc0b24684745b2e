"""Which GEMMs of a program are FP8: a deviceless compile for an H100, or StableHLO.

`inspect(fn, *args)` compiles `fn` for an H100 without a GPU (with the `h100` extra:
`jax-cuda12-plugin` and `jax-cuda12-pjrt` of jax's version, and `JAX_PLATFORMS=cpu` set before
jax starts) in both of XLA's modes:

- `"cublas"`: Triton GEMMs off (`xla_gpu_enable_triton_gemm=False`), every GEMM a cuBLAS call;
  an FP8 GEMM is a `__cublas$lt$matmul$f8` custom call. This is the mode that proves FP8 tensor
  cores: it is the kernel cuBLASLt runs.
- `"default"`: XLA's default flags, where GEMMs become Triton fusions; a GEMM is FP8 when the dot
  inside takes FP8 operands. (Without a GPU the autotuner cannot time Triton against cuBLAS; on
  a real GPU it chooses.)

Every GEMM is reported with its operand types and the JAX name stack it came from; GEMMs of
fp8jax layers carry `fp8jax[<layer path>]/fwd|dgrad|wgrad` there. Without the plugin it falls
back to the StableHLO of the program (operand types as JAX emits them) and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .dot_general import SCOPE

MODES = {
    "cublas": {"xla_gpu_enable_triton_gemm": False},
    "default": {},
}
_LAYER = re.compile(re.escape(SCOPE) + r"\[([^\]]*)\]\)*(?:/(fwd|dgrad|wgrad))?")
_F8 = re.compile(r"^f8")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a compiled program.

    **Fields:** `mode` (`"cublas"`, `"default"` or `"stablehlo"`), `instruction` (its name in
    the HLO), `kernel` (`"cublasLt f8"`, `"cublas"`, `"triton"` or `"dot"`), `lhs` and `rhs`
    (operand element types, e.g. `"f8e4m3fn"`), `op_name` (the JAX name stack it came from),
    `flops` (`2 * output size * contracted size`; 0 where the HLO does not say).
    """

    mode: str
    instruction: str
    kernel: str
    lhs: str
    rhs: str
    op_name: str
    flops: int = 0

    @property
    def fp8(self) -> bool:
        """Both operands are FP8 (or cuBLASLt's FP8 GEMM runs it)."""
        if self.kernel == "cublasLt f8":
            return True
        return bool(_F8.match(self.lhs.lower()) and _F8.match(self.rhs.lower()))

    @property
    def layer(self) -> str | None:
        """The path of the fp8jax layer this GEMM belongs to, if any."""
        match = _LAYER.search(self.op_name)
        return match.group(1) if match else None

    @property
    def role(self) -> str | None:
        """`"fwd"`, `"dgrad"` or `"wgrad"` for GEMMs of fp8jax layers."""
        match = _LAYER.search(self.op_name)
        return match.group(2) if match else None

    def __str__(self) -> str:
        where = f"{self.layer}/{self.role}" if self.layer is not None else self.op_name
        return f"{where}: {self.kernel} ({self.lhs} x {self.rhs}) [{self.instruction}]"


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device operation of a compiled program.

    **Fields:** `op` (`"all-reduce"`, `"all-gather"`, `"reduce-scatter"`, `"all-to-all"`,
    `"collective-permute"`), `instruction` (its name), `shapes` (the result arrays' shapes),
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


class Fp8InspectionError(AssertionError):
    """Raised by [`fp8jax.assert_all_fp8`][]: some GEMMs are not FP8."""


@dataclasses.dataclass
class Inspection:
    """The GEMMs of one program, per compile mode, with memory figures where compiled.

    **Fields:** `gemms` (mode -> list of [`fp8jax.Gemm`][]), `memory` (mode -> the compiled
    executable's `memory_analysis()`, absent in StableHLO mode), `target` (what was compiled
    for), `traffic` (mode -> bytes read and written by everything but the GEMMs, from the HLO:
    `cost_analysis()` of a deviceless executable is empty), `collectives` (mode -> list of
    [`fp8jax.Collective`][]).
    """

    gemms: dict[str, list[Gemm]]
    memory: dict[str, Any]
    target: str
    traffic: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: dict[str, list[Collective]] = dataclasses.field(default_factory=dict)

    @property
    def deviceless(self) -> bool:
        """Whether this is a real H100 compile (else a StableHLO fallback)."""
        return "stablehlo" not in self.gemms

    def count(self, mode: str) -> tuple[int, int]:
        """(FP8 GEMMs, all GEMMs) in `mode`."""
        gemms = self.gemms[mode]
        return sum(g.fp8 for g in gemms), len(gemms)

    def layers(self, mode: str) -> dict[str, dict[str, list[Gemm]]]:
        """fp8jax layer path -> role -> its GEMMs, in `mode`."""
        out: dict[str, dict[str, list[Gemm]]] = {}
        for g in self.gemms[mode]:
            if g.layer is not None:
                out.setdefault(g.layer, {}).setdefault(g.role or "?", []).append(g)
        return out

    def offending(self, strict: bool = False) -> list[Gemm]:
        """GEMMs of fp8jax layers that are not FP8 (every non-FP8 GEMM with `strict`)."""
        return [
            g
            for gemms in self.gemms.values()
            for g in gemms
            if not g.fp8 and (strict or g.layer is not None)
        ]

    def __str__(self) -> str:
        lines = [f"GEMMs of the program, compiled for {self.target}"]
        for mode, gemms in self.gemms.items():
            fp8, total = self.count(mode)
            lines.append(f"\n[{mode}] {fp8} of {total} GEMMs are FP8")
            for g in gemms:
                lines.append(f"  {'FP8 ' if g.fp8 else 'high'}  {g}")
            if mode in self.memory:
                temp = getattr(self.memory[mode], "temp_size_in_bytes", None)
                lines.append(f"  temp memory: {temp} bytes")
        return "\n".join(lines)


def _is_int(n: Any) -> bool:
    return isinstance(n, int | np.integer) and not isinstance(n, bool)


@functools.cache
def h100_topology(devices: int = 1) -> Any | None:
    """`devices` compile-only H100s in one host (`None` when the CUDA plugin is missing)."""
    from jax.experimental import topologies

    config = importlib.resources.files("fp8jax._src").joinpath("data/h100_sxm.txtpb").read_text()
    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x1x{devices}"
        )
    except Exception:  # noqa: BLE001 - any failure means: no deviceless CUDA compiler here
        return None


def h100_mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    """A mesh of compile-only H100s (one host, `prod(axes.values())` GPUs), for
    [`fp8jax.inspect`][] of sharded programs.

    Give `inspect` `jax.ShapeDtypeStruct`s with `NamedSharding`s on this mesh for the
    arguments to shard; the other array arguments are replicated over it.

    ```python
    mesh = fp8jax.h100_mesh({"data": 8})
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    report = fp8jax.inspect(train_step, state, x)
    ```
    """
    if (
        not isinstance(axes, Mapping)
        or not axes
        or not all(isinstance(name, str) for name in axes)
        or not all(_is_int(n) and n >= 1 for n in axes.values())
    ):
        raise ValueError(
            f"h100_mesh: axes={axes!r}: should be a dict from mesh axis names to sizes >= 1, "
            "e.g. {'data': 8}."
        )
    size = math.prod(axes.values())
    topology = h100_topology(size)
    if topology is None:
        raise RuntimeError(
            "h100_mesh needs jax-cuda12-plugin and jax-cuda12-pjrt of jax's version (pip "
            "install 'fp8jax[h100]') and JAX_PLATFORMS=cpu set before jax starts."
        )
    devices = np.array(topology.devices).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(devices, tuple(axes))


def _is_dynamic(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _mesh_of(dynamic: Any) -> jax.sharding.Mesh | None:
    for x in jax.tree.leaves(dynamic):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _lower(fn: Callable, args: tuple, kwargs: dict, device: Any | None):
    """`fn(*args, **kwargs)` lowered with its array leaves abstract: on `device` if given,
    or replicated over the mesh of the arguments that carry a `NamedSharding`."""
    dynamic, static = eqx.partition((args, kwargs), _is_dynamic)
    mesh = _mesh_of(dynamic) if device is not None else None

    def abstract(x: Any) -> jax.ShapeDtypeStruct:
        if mesh is not None:
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
                return x
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        elif device is not None:
            sharding = jax.sharding.SingleDeviceSharding(device)
        else:
            sharding = None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def call(dynamic: Any) -> Any:
        a, k = eqx.combine(dynamic, static)
        return eqx.filter(fn(*a, **k), eqx.is_array)  # outputs may hold functions (a model)

    devices = mesh.size if mesh is not None else 1
    return jax.jit(call).lower(jax.tree.map(abstract, dynamic)), devices


def inspect(
    fn: Callable,
    *args: Any,
    modes: Iterable[str] = ("cublas", "default"),
    merge_dots: bool = True,
    compiler_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Inspection:
    """Compile `fn(*args, **kwargs)` for an H100 (deviceless) and report every GEMM.

    **Arguments:**

    - `fn`: any function, jitted or not (a whole train step, say). Its arguments may be arrays,
      `jax.ShapeDtypeStruct`s or pytrees of them with other leaves (an Equinox model): only
      shapes and dtypes are used; nothing runs.
    - `modes`: among `"cublas"` (Triton GEMMs off) and `"default"` (XLA's default flags).
    - `merge_dots`: XLA merges GEMMs that share an operand (the query, key and value
      projections of one input, say) into one; the merged GEMM keeps the name of only one of
      them. `False` turns that pass off, so that each layer's GEMMs are reported on their own.
    - `compiler_options`: further XLA options for both modes.

    For a sharded program, pass `jax.ShapeDtypeStruct`s with `NamedSharding`s on an
    [`fp8jax.h100_mesh`][] for the arguments to shard; the other arrays are replicated on that
    mesh, and `Inspection.collectives` lists the cross-device operations.

    **Returns:** an [`fp8jax.Inspection`][]; `print` it for a table.

    Without `jax-cuda12-plugin` (the `h100` extra) it reports the StableHLO of `fn` lowered for
    the CPU instead: the operand types JAX emits, before XLA's GPU compiler had its say.

    ```python
    report = fp8jax.inspect(train_step, model, opt_state, batch)
    print(report)
    ```
    """
    if not callable(fn):
        raise TypeError(f"fp8jax.inspect: fn={fn!r} is not callable; pass the function to compile.")
    if isinstance(modes, str) or not isinstance(modes, Iterable):
        raise ValueError(
            f"fp8jax.inspect: modes={modes!r}: should be a tuple of modes among {sorted(MODES)}, "
            "e.g. ('cublas',)."
        )
    modes = tuple(modes)
    if not modes:
        raise ValueError(f"fp8jax.inspect: modes=(): give at least one of {sorted(MODES)}.")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}: should be among {sorted(MODES)}.")
    if not isinstance(merge_dots, bool):
        raise TypeError(f"fp8jax.inspect: merge_dots={merge_dots!r} should be True or False.")
    if compiler_options is not None and not isinstance(compiler_options, Mapping):
        raise TypeError(
            f"fp8jax.inspect: compiler_options={compiler_options!r} should be a dict of XLA "
            "options or None."
        )
    topology = h100_topology()
    if topology is None:
        lowered, _ = _lower(fn, args, kwargs, None)
        gemms = stablehlo_gemms(lowered.as_text(debug_info=True))
        target = (
            "nothing: jax-cuda12-plugin is missing, so this is the StableHLO of the program "
            "(install fp8jax[h100] for the H100 compile)"
        )
        return Inspection({"stablehlo": gemms}, {}, target)
    lowered, devices = _lower(fn, args, kwargs, topology.devices[0])
    gemms, memory, traffic, collectives = {}, {}, {}, {}
    extra = dict(compiler_options or {})
    if not merge_dots:
        extra["xla_disable_hlo_passes"] = ",".join(
            filter(None, [extra.get("xla_disable_hlo_passes", ""), "dot-merger"])
        )
    for mode in modes:
        compiled = lowered.compile(compiler_options={**MODES[mode], **extra})
        text = compiled.as_text()
        gemms[mode] = hlo_gemms(text, mode)
        memory[mode] = compiled.memory_analysis()
        traffic[mode] = hlo_memory_traffic(text)
        collectives[mode] = hlo_collectives(text)
    kind = topology.devices[0].device_kind
    target = f"{devices} x {kind} (deviceless)" if devices > 1 else f"{kind} (deviceless)"
    return Inspection(gemms, memory, target, traffic, collectives)


def assert_all_fp8(
    fn: Callable | Inspection, *args: Any, strict: bool = False, **kwargs: Any
) -> Inspection:
    """Raise [`fp8jax.Fp8InspectionError`][] listing every GEMM of an fp8jax layer that is not
    FP8 (every GEMM of the program, with `strict=True`); return the inspection otherwise.

    `fn` may be a function with its arguments (as for [`fp8jax.inspect`][]) or an
    `Inspection` already made.
    """
    if not isinstance(fn, Inspection) and not callable(fn):
        raise TypeError(
            f"assert_all_fp8: fn={fn!r} should be a function (with its arguments) or an "
            "fp8jax.Inspection."
        )
    report = fn if isinstance(fn, Inspection) else inspect(fn, *args, **kwargs)
    bad = report.offending(strict=strict)
    if bad:
        listing = "\n".join(f"  [{g.mode}] {g}" for g in bad)
        raise Fp8InspectionError(
            f"{len(bad)} GEMM(s) {'of the program' if strict else 'of fp8jax layers'} are not "
            f"FP8 (compiled for {report.target}):\n{listing}"
        )
    return report


# --- parsing ------------------------------------------------------------------------------

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ELEMENT = re.compile(r"^\(?\s*([a-z]+[0-9a-z]*)\[")


def _element_type(type_text: str) -> str:
    match = _ELEMENT.match(type_text.strip())
    return match.group(1) if match else type_text.strip()


_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([\d,]*)\]")
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


def _dims(type_text: str) -> list[int]:
    """Dimensions of the (first) array in an HLO type."""
    match = _ARRAY.search(type_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple counts all its members)."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = 1
        for d in dims.split(","):
            size *= int(d) if d else 1
        total += size * (1 if dtype.startswith("f8") else _ITEM_BYTES.get(dtype, 4))
    return total


def _flops(out_type: str, lhs_type: str, rest: str) -> int:
    """2 * |output| * |contraction| of a dot or cuBLAS GEMM, from its contracting dims."""
    match = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest) or re.search(
        r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest
    )
    if not match:
        return 0
    lhs = _dims(lhs_type)
    contracted = 1
    for d in re.findall(r"\d+", match.group(1)):
        contracted *= lhs[int(d)] if int(d) < len(lhs) else 1
    output = 1
    for d in _dims(out_type):
        output *= d
    return 2 * output * contracted


def _operand_names(text: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", text)


def hlo_gemms(hlo: str, mode: str) -> list[Gemm]:
    """Every GEMM of an optimized HLO module: cuBLAS custom calls and dots (top level or
    inside fusions), with operand element types resolved within their computation."""
    computations: dict[str, dict[str, tuple[str, str, list[str], str]]] = {}
    current: dict[str, tuple[str, str, list[str], str]] | None = None
    for line in hlo.splitlines():
        if current is None or line.startswith(("%", "ENTRY")):
            head = _COMPUTATION.match(line)
            if head:
                current = computations.setdefault(head.group("name"), {})
                continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current[match.group("name")] = (
                match.group("type"),
                match.group("op"),
                _operand_names(match.group("operands")),
                match.group("rest"),
            )
    loop_names = _loop_op_names(computations)
    gemms = []
    for computation, instructions in computations.items():
        for name, (out_type, op, operands, rest) in instructions.items():
            target = _gemm_target(op, rest)
            if target is not None:
                kernel = "cublasLt f8" if target.endswith("$f8") else "cublas"
            elif op == "dot":
                kernel = "triton" if mode == "default" else "dot"
            else:
                continue
            full = [instructions[o][0] if o in instructions else "?" for o in operands[:2]]
            op_name = _OP_NAME.search(rest)
            gemms.append(
                Gemm(
                    mode,
                    name,
                    kernel,
                    *map(_element_type, full),
                    loop_names.get(computation) or (op_name.group(1) if op_name else ""),
                    _flops(out_type, full[0], rest),
                )
            )
    return gemms


_CALLED = re.compile(r"(?:calls|body|condition)=%([\w.\-]+)")


def _loop_op_names(computations: dict[str, dict[str, tuple]]) -> dict[str, str]:
    """Computation -> the JAX name of the innermost `while` loop running it (directly, or
    through fusions and calls), for loops of fp8jax layers.

    JAX traces the body of a `lax.scan` once for every scan with the same body (block recipes
    loop over the chunks of each GEMM), so the instructions inside carry the name of the
    first layer that traced it; the loop instruction itself carries its own layer's name.
    """
    callers: dict[str, tuple[str, str, str]] = {}  # computation -> (parent, op, op_name)
    for parent, instructions in computations.items():
        for _, op, _, rest in instructions.values():
            op_name = _OP_NAME.search(rest)
            for called in _CALLED.findall(rest):
                callers.setdefault(called, (parent, op, op_name.group(1) if op_name else ""))
    names: dict[str, str] = {}
    for computation in computations:
        seen, current = set(), computation
        while current in callers and current not in seen:
            seen.add(current)
            parent, op, op_name = callers[current]
            if op == "while":
                if _LAYER.search(op_name):
                    names[computation] = op_name
                break
            current = parent
    return names


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_TO_APPLY = re.compile(r"to_apply=%([\w.\-]+)")


def hlo_collectives(hlo: str) -> list[Collective]:
    """Every cross-device operation of an optimized HLO module (async `-start` halves
    included, `-done` halves not), with the reduction its `to_apply` computation performs."""
    roots: dict[str, str] = {}
    found = []
    computation = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group("name")
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        op = match.group("op")
        if line.lstrip().startswith("ROOT") and computation is not None:
            roots[computation] = op
        base = op.removesuffix("-start")
        if base not in _COLLECTIVES:
            continue
        arrays = _ARRAY.findall(match.group("type"))
        if op.endswith("-start") and base in ("all-gather", "collective-permute"):
            arrays = arrays[len(arrays) // 2 :]  # (operands, results): keep the results
        op_name = _OP_NAME.search(match.group("rest"))
        to_apply = _TO_APPLY.search(match.group("rest"))
        found.append(
            (
                base,
                match.group("name"),
                tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays),
                tuple(t for t, _ in arrays),
                to_apply.group(1) if to_apply else None,
                op_name.group(1) if op_name else "",
            )
        )
    return [
        Collective(op, name, shapes, dtypes, roots.get(apply) if apply else None, op_name)
        for op, name, shapes, dtypes, apply, op_name in found
    ]


def _gemm_target(op: str, rest: str) -> str | None:
    """The custom-call target of a cuBLAS/cuDNN GEMM call, else `None`."""
    target = _TARGET.search(rest) if op == "custom-call" else None
    if target and ("gemm" in target.group(1) or "matmul" in target.group(1)):
        return target.group(1)
    return None


_NO_TRAFFIC = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
}


def hlo_memory_traffic(hlo: str) -> int:
    """Bytes read and written by the entry computation's instructions other than GEMMs: the
    operands and outputs of every fusion, copy and so on (a model of HBM traffic)."""
    entry = hlo[hlo.index("\nENTRY") + 1 :] if "\nENTRY" in hlo else hlo
    types: dict[str, str] = {}
    total = 0
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, out_type, op = match.group("name"), match.group("type"), match.group("op")
        types[name] = out_type
        if op in _NO_TRAFFIC or _gemm_target(op, match.group("rest")) is not None:
            continue
        operands = _operand_names(match.group("operands"))
        total += array_bytes(out_type) + sum(array_bytes(types.get(o, "")) for o in operands)
    return total


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

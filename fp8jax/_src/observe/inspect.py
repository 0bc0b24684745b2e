"""Which GEMMs of a program run on FP8 tensor cores: a deviceless compile for an H100.

`inspect(fn, *args)` compiles `fn` for an H100 without a GPU (with the `h100` extra:
`jax-cuda12-plugin` and `jax-cuda12-pjrt` of jax's version, and `JAX_PLATFORMS=cpu` set before
jax starts) in both of XLA's modes, and reads what would execute:

- `"cublas"`: Triton GEMMs off (`xla_gpu_enable_triton_gemm=False`, fp8jax's
  [`fp8jax.gpu_compiler_options`][]), every GEMM a cuBLAS call; an FP8 GEMM is a
  `__cublas$lt$matmul$f8` custom call, which cuBLASLt runs on FP8 tensor cores.
- `"default"`: XLA's default flags, where GEMMs become generated (Triton) kernels. For each,
  the inspector reads the kernel's PTX and names its matrix-multiply instruction: FP8 tensor
  cores are `wgmma ... e4m3/e5m2` (or an FP8 `mma`); a kernel that converts FP8 operands to
  f16 (`cvt.rn.f16x2.e4m3x2`) and multiplies with `mma.sync ... f16` is not FP8 whatever its
  operand types. A deviceless compile cannot autotune: XLA takes its default Triton tiles,
  which on jax 0.10 upcast FP8 to f16. On a GPU the autotuner chooses, which is why fp8jax's
  train step compiles with Triton GEMMs off.

Pallas Mosaic GPU kernels are judged the same way, by the PTX Mosaic dumps when the process
starts with `MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=<an existing folder>`; without it they
are reported as not proven.

Every GEMM is reported with its kernel, operand types and the JAX name stack it came from;
GEMMs of fp8jax layers carry `fp8jax[<layer path>]/fwd|dgrad|wgrad` there. Without the plugin
it falls back to the StableHLO of the program (operand types as JAX emits them), which proves
nothing about the kernels, and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..core.compile_options import gpu_compiler_options
from ..ops.base import SCOPE

MODES = {
    "cublas": gpu_compiler_options(),
    "default": {},
}
_LAYER = re.compile(re.escape(SCOPE) + r"\[([^\]]*)\]\)*(?:/(fwd|dgrad|wgrad))?")
_F8 = re.compile(r"^f8")


_FP8_MMA = re.compile(r"\.e[45]m[23]\b")
_MMA_TYPES = re.compile(r"\.(e4m3|e5m2|f16|bf16|tf32|f32|f64|s8|u8|s4|u4|b1)\b")
_TENSOR_CORES = {"f16": "FP16", "bf16": "BF16", "tf32": "TF32", "f64": "FP64", "s8": "INT8"}


def _mma_inputs(instruction: str) -> str:
    """The multiplied operands' type of a PTX MMA instruction (`e4m3`, `f16`, ...): the types
    after the accumulator's (`mma.sync ... .f32.f16.f16.f32`, `wgmma ... .f32.e4m3.e4m3`)."""
    types = _MMA_TYPES.findall(instruction)
    inputs = types[1:3] if len(types) >= 3 else types
    return "/".join(dict.fromkeys(inputs)) or "?"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a compiled program, and the kernel that runs it.

    **Fields:** `mode` (`"cublas"`, `"default"` or `"stablehlo"`), `instruction` (its name in
    the HLO), `kernel` (`"cublasLt f8"`, `"cublas"`, `"triton"` (a generated GEMM kernel),
    `"fusion"` (a dot XLA emitted inside another kernel), `"pallas mosaic gpu"` (a Pallas
    kernel with an MMA in its PTX, or in an fp8jax layer's scope) or `"dot"` (StableHLO)),
    `lhs` and
    `rhs` (operand element types in the HLO, e.g. `"f8e4m3fn"`), `op_name` (the JAX name stack
    it came from), `flops` (`2 * output size * contracted size`; 0 where the HLO does not say),
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

    @property
    def fp8(self) -> bool:
        """Runs on FP8 tensor cores: the cuBLASLt FP8 GEMM, or an FP8 MMA in its PTX."""
        if self.kernel == "cublasLt f8":
            return True
        return any(_FP8_MMA.search(m) for m in self.mma)

    @property
    def fp8_operands(self) -> bool:
        """Both operands are FP8 in the HLO (necessary for `fp8`, not sufficient)."""
        return bool(_F8.match(self.lhs.lower()) and _F8.match(self.rhs.lower()))

    @property
    def verdict(self) -> str:
        """What runs this GEMM and on which tensor cores, in words."""
        if self.kernel == "cublasLt f8":
            return "cuBLASLt FP8 GEMM (__cublas$lt$matmul$f8): FP8 tensor cores"
        if self.kernel == "cublas":
            return f"cuBLAS GEMM of {self.lhs} x {self.rhs}: not FP8"
        if self.mode == "stablehlo":
            return (
                f"{self.lhs} x {self.rhs} in StableHLO; no kernel was compiled (install "
                "fp8jax[h100] for the H100 compile): not proven"
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
        fp8 = [m for m in self.mma if _FP8_MMA.search(m)]
        if fp8:
            return f"{what}: FP8 tensor cores ({fp8[0]})"
        if not self.mma:
            return f"{what}: no tensor-core instruction in its PTX (scalar or vector code)"
        inputs = _mma_inputs(self.mma[0])
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
        match = _LAYER.search(self.op_name)
        return match.group(1) if match else None

    @property
    def role(self) -> str | None:
        """`"fwd"`, `"dgrad"` or `"wgrad"` for GEMMs of fp8jax layers."""
        match = _LAYER.search(self.op_name)
        return match.group(2) if match else None

    def __str__(self) -> str:
        where = f"{self.layer}/{self.role}" if self.layer is not None else self.op_name
        head = f"{where}: {self.kernel} ({self.lhs} x {self.rhs}) [{self.instruction}]"
        return f"{head}: {self.verdict}"


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
    for), `traffic` (mode -> bytes read and written by the entry computation's instructions
    but the GEMMs, loops counted once: `cost_analysis()` of a deviceless executable is empty),
    `collectives` (mode -> list of [`fp8jax.Collective`][]), `cost` (mode -> the program's
    [`fp8jax.Cost`][]: GEMM FLOPs per precision and non-GEMM bytes per category, loops counted
    as often as they run).
    """

    gemms: dict[str, list[Gemm]]
    memory: dict[str, Any]
    target: str
    traffic: dict[str, int] = dataclasses.field(default_factory=dict)
    collectives: dict[str, list[Collective]] = dataclasses.field(default_factory=dict)
    cost: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def deviceless(self) -> bool:
        """Whether this is a real H100 compile (else a StableHLO fallback)."""
        return "stablehlo" not in self.gemms

    def count(self, mode: str) -> tuple[int, int]:
        """(GEMMs on FP8 tensor cores, all GEMMs) in `mode`."""
        gemms = self.gemms[mode]
        return sum(g.fp8 for g in gemms), len(gemms)

    def layers(self, mode: str) -> dict[str, dict[str, list[Gemm]]]:
        """fp8jax layer path -> role -> its GEMMs, in `mode`."""
        out: dict[str, dict[str, list[Gemm]]] = {}
        for g in self.gemms[mode]:
            if g.layer is not None:
                out.setdefault(g.layer, {}).setdefault(g.role or "?", []).append(g)
        return out

    def offending(self, strict: bool = False, modes: Iterable[str] | None = None) -> list[Gemm]:
        """GEMMs of fp8jax layers that do not run on FP8 tensor cores (every such GEMM with
        `strict`), in `modes` (all of this inspection's by default)."""
        modes = self.gemms if modes is None else modes
        return [
            g
            for mode in modes
            for g in self.gemms[mode]
            if not g.fp8 and (strict or g.layer is not None)
        ]

    def __str__(self) -> str:
        lines = [f"GEMMs of the program, compiled for {self.target}"]
        for mode, gemms in self.gemms.items():
            fp8, total = self.count(mode)
            operands = sum(g.fp8_operands for g in gemms)
            lines.append(
                f"\n[{mode}] {fp8} of {total} GEMMs run on FP8 tensor cores "
                f"({operands} take FP8 operands)"
            )
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


def _split_graph_nodes(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """`fn` and its arguments with the Flax NNX objects among them (modules, optimizers,
    variables, at any depth) replaced by their state: a pure function that merges the
    objects, calls `fn`, and returns its output with the objects' new state.

    NNX updates objects in place. Lowered as it is, a train step that updates a model and
    its optimizer returns only its loss, and XLA drops the backward pass and the update as
    dead code; returning the state keeps every GEMM the step runs. The objects are split
    together, so a variable two of them share stays one. Flax is looked up in `sys.modules`:
    when it was never imported no NNX object exists, and `fn` is returned as it is.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return fn, args, kwargs

    def is_node(x: Any) -> bool:
        return isinstance(x, nnx.Pytree | nnx.Variable)

    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    where = [i for i, leaf in enumerate(leaves) if is_node(leaf)]
    if not where:
        return fn, args, kwargs
    graphdef, state = nnx.split(tuple(leaves[i] for i in where), graph=True)
    rest = [None if is_node(leaf) else leaf for leaf in leaves]

    def pure(state: Any, rest: list) -> tuple[Any, Any]:
        nodes = nnx.merge(graphdef, state)
        filled = list(rest)
        for i, node in zip(where, nodes, strict=True):
            filled[i] = node
        a, k = jax.tree.unflatten(treedef, filled)
        out = fn(*a, **k)
        return out, nnx.state(nodes, graph=True)

    return pure, (state, rest), {}


def _lower(fn: Callable, args: tuple, kwargs: dict, device: Any | None):
    """`fn(*args, **kwargs)` lowered with its array leaves abstract: on `device` if given,
    or replicated over the mesh of the arguments that carry a `NamedSharding`. Flax NNX
    objects among the arguments are lowered as their state, which the function returns
    updated (`_split_graph_nodes`)."""
    fn, args, kwargs = _split_graph_nodes(fn, args, kwargs)
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
      shapes and dtypes are used; nothing runs. They may be Flax NNX objects (an `nnx.Module`,
      an `nnx.Optimizer`) that `fn` updates in place, as a step from
      [`fp8jax.nnx_train_step`][] or an `nnx.jit` function does: they are compiled as their
      state, which the compiled program returns updated, so the backward pass and the update
      are compiled too, and the objects passed are left as they were.
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
    from .cost import hlo_cost  # cost.py reads HLO with this module's parsers

    lowered, devices = _lower(fn, args, kwargs, topology.devices[0])
    gemms, memory, traffic, collectives, cost = {}, {}, {}, {}, {}
    extra = dict(compiler_options or {})
    if not merge_dots:
        extra["xla_disable_hlo_passes"] = ",".join(
            filter(None, [extra.get("xla_disable_hlo_passes", ""), "dot-merger"])
        )
    for mode in modes:
        compiled, kernels = _compile_with_ptx(lowered, {**MODES[mode], **extra})
        text = compiled.as_text()
        gemms[mode] = hlo_gemms(text, mode, kernels)
        memory[mode] = compiled.memory_analysis()
        traffic[mode] = hlo_memory_traffic(text)
        collectives[mode] = hlo_collectives(text)
        cost[mode] = hlo_cost(text)
    kind = topology.devices[0].device_kind
    target = f"{devices} x {kind} (deviceless)" if devices > 1 else f"{kind} (deviceless)"
    return Inspection(gemms, memory, target, traffic, collectives, cost)


def assert_all_fp8(
    fn: Callable | Inspection,
    *args: Any,
    strict: bool = False,
    modes: Iterable[str] = ("cublas",),
    **kwargs: Any,
) -> Inspection:
    """Raise [`fp8jax.Fp8InspectionError`][] listing every GEMM of an fp8jax layer that does
    not run on FP8 tensor cores (every GEMM of the program, with `strict=True`); return the
    inspection otherwise.

    `fn` may be a function with its arguments (as for [`fp8jax.inspect`][]) or an
    `Inspection` already made. `modes` are the compile modes checked: by default `"cublas"`,
    the options fp8jax's train step compiles with ([`fp8jax.gpu_compiler_options`][]); add
    `"default"` to check XLA's default flags too (on a deviceless compile, XLA's Triton GEMM
    upcasts FP8 to f16, so that check fails). A StableHLO inspection (no `h100` extra) proves
    nothing and always fails.

    ```python
    fp8jax.assert_all_fp8(train_step, state, batch)  # raises with the offending GEMMs
    ```
    """
    if not isinstance(fn, Inspection) and not callable(fn):
        raise TypeError(
            f"assert_all_fp8: fn={fn!r} should be a function (with its arguments) or an "
            "fp8jax.Inspection."
        )
    if isinstance(modes, str) or not isinstance(modes, Iterable) or not tuple(modes):
        raise ValueError(
            f"assert_all_fp8: modes={modes!r}: should be a non-empty tuple of modes among "
            f"{sorted(MODES)}, e.g. ('cublas',)."
        )
    modes = tuple(modes)
    if isinstance(fn, Inspection):
        report = fn
    else:
        report = inspect(fn, *args, modes=modes, **kwargs)
    if not report.deviceless:
        raise Fp8InspectionError(
            "assert_all_fp8: this is a StableHLO inspection (jax-cuda12-plugin is missing), "
            "which shows operand types, not the kernels that run; install fp8jax[h100] and "
            "set JAX_PLATFORMS=cpu before jax starts for the H100 compile."
        )
    missing = [mode for mode in modes if mode not in report.gemms]
    if missing:
        raise ValueError(
            f"assert_all_fp8: modes={modes!r}: the inspection has no {missing}; it has "
            f"{sorted(report.gemms)}."
        )
    bad = report.offending(strict=strict, modes=modes)
    if bad:
        listing = "\n".join(f"  [{g.mode}] {g}" for g in bad)
        raise Fp8InspectionError(
            f"{len(bad)} GEMM(s) {'of the program' if strict else 'of fp8jax layers'} do not "
            f"run on FP8 tensor cores (compiled for {report.target}):\n{listing}"
        )
    return report


#: Since jax 0.11 XLA writes each kernel's PTX into `xla_dump_to` only where this pattern
#: matches the tag "ptx" (0.10 wrote them all and ignores it). A wider pattern also dumps
#: every emitter's MLIR and LLVM passes: ten times the compile time.
_PTX_DUMP_OPTIONS = {"xla_dump_emitter_re": "^ptx$"}


def _compile_with_ptx(lowered: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Kernel]]:
    """Compile `lowered` with `options`, keeping the PTX XLA generates (`xla_dump_to`: a
    temporary folder, or the caller's), and read the matrix-multiply instructions of each
    kernel. Only files the compile wrote are read. Pallas Mosaic GPU kernels are read from
    Mosaic's own dump, where the process enabled it; see `_mosaic_kernels`."""
    given = options.get("xla_dump_to")
    mosaic = os.environ.get("MOSAIC_GPU_DUMP_TO") if os.environ.get("MOSAIC_GPU_DUMP_PTX") else None
    with tempfile.TemporaryDirectory(prefix="fp8jax-inspect-") as scratch:
        folder = given or scratch
        before = set(_ptx_files(folder))
        mosaic_before = set(_ptx_files(mosaic)) if mosaic else set()
        compiled = lowered.compile(
            compiler_options={**options, "xla_dump_to": folder, **_PTX_DUMP_OPTIONS}
        )
        kernels = ptx_kernels(_read(sorted(set(_ptx_files(folder)) - before)))
    dumped: list[Kernel] = []
    if mosaic:
        # Mosaic GPU writes <kernel>_<n>.ptx, n counting the process's kernels, one entry each.
        for text in _read(sorted(set(_ptx_files(mosaic)) - mosaic_before, key=_mosaic_number)):
            dumped += ptx_kernels([text]).values()
    kernels.update(_mosaic_kernels(compiled.as_text(), dumped))
    return compiled, kernels


_MOSAIC = "mosaic:"
_MOSAIC_SEEN: dict[str, Kernel] = {}  # kernel_hash -> its PTX facts, for this process
_KERNEL_HASH = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)"')
_MOSAIC_CALL = re.compile(r'custom_call_target="mosaic_gpu[^"]*"')


def _mosaic_kernels(hlo: str, dumped: list[Kernel]) -> dict[str, Kernel]:
    """`"mosaic:<kernel_hash>"` -> PTX facts, for the Mosaic GPU kernels of a module.

    Mosaic compiles each kernel once per process and dumps its PTX then, under a name that
    does not say which call it belongs to. The kernels new to this process are matched to
    the new dumps by order (the n-th new `kernel_hash` in the module's text is the n-th
    compiled); when their counts differ nothing new is matched. Kernels seen before keep
    what was read then."""
    hashes: list[str] = []
    for line in hlo.splitlines():
        digest = _KERNEL_HASH.search(line) if _MOSAIC_CALL.search(line) else None
        if digest and digest.group(1) not in hashes:
            hashes.append(digest.group(1))
    new = [h for h in hashes if h not in _MOSAIC_SEEN]
    if new and len(new) == len(dumped):
        _MOSAIC_SEEN.update(zip(new, dumped, strict=True))
    return {_MOSAIC + h: _MOSAIC_SEEN[h] for h in hashes if h in _MOSAIC_SEEN}


def _mosaic_number(path: str) -> int:
    match = re.search(r"_(\d+)\.ptx$", path)
    return int(match.group(1)) if match else -1


def _read(paths: Iterable[str]) -> list[str]:
    texts = []
    for path in paths:
        with open(path) as f:
            texts.append(f.read())
    return texts


def _ptx_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return [
        os.path.join(root, name)
        for root, _, names in os.walk(folder)
        for name in names
        if name.endswith(".ptx")
    ]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What the PTX of one GPU kernel multiplies with: `mma` (its `mma`/`wgmma`
    instructions, distinct, in order) and `upcasts` (its conversions from FP8)."""

    name: str
    mma: tuple[str, ...]
    upcasts: tuple[str, ...]


_PTX_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)", re.MULTILINE)
_PTX_MMA = re.compile(r"\b((?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)(?:\.[\w:]+)*)")
_PTX_UPCAST = re.compile(r"\b(cvt(?:\.\w+)*\.(?:e4m3|e5m2)(?:x2)?)\b")


def ptx_kernels(texts: Iterable[str]) -> dict[str, Kernel]:
    """Kernel name -> its [`Kernel`][fp8jax._src.observe.inspect.Kernel] facts, from PTX modules.

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
            )
    return kernels


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


def hlo_gemms(hlo: str, mode: str, kernels: Mapping[str, Kernel] | None = None) -> list[Gemm]:
    """Every GEMM of an optimized HLO module: cuBLAS custom calls and dots (top level or
    inside fusions), with operand element types resolved within their computation.

    With `kernels` (from [`ptx_kernels`][fp8jax._src.observe.inspect.ptx_kernels]), each dot
    gets the PTX facts of the kernel that runs it: the outermost fusion around it, named as XLA
    names its kernel (the fusion's `deduplicated_name` where XLA reused a kernel, `.` as `_`)."""
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
    callers = _callers(computations)
    loop_names = _loop_op_names(computations, callers)
    fusions = _fusion_callers(callers)
    shared = _shared_kernels(computations)
    gemms = []
    for computation, instructions in computations.items():
        for name, (out_type, op, operands, rest) in instructions.items():
            target = _gemm_target(op, rest)
            kernel_name, facts = "", None
            if target is not None:
                kernel = "cublasLt f8" if target.endswith("$f8") else "cublas"
            elif op == "custom-call" and _MOSAIC_CALL.search(rest):
                digest = _KERNEL_HASH.search(rest)
                facts = (kernels or {}).get(_MOSAIC + digest.group(1)) if digest else None
                kernel, kernel_name = "pallas mosaic gpu", facts.name if facts else name
                if not (facts and facts.mma) and not _LAYER.search(rest):
                    continue  # not a GEMM, or not known to be one
                operands = _matrix_operands(operands, instructions)
            elif op == "dot":
                kernel, runner = "dot", (name, rest)
                if computation in fusions:  # the outermost fusion around it is the kernel
                    runner, triton = fusions[computation]
                    kernel = "triton" if triton else "fusion"
                candidates = _kernel_names(*runner, shared)
                kernel_name = candidates[0]
                if kernels is not None:
                    found = [c for c in candidates if c in kernels]
                    if found:
                        kernel_name, facts = found[0], kernels[found[0]]
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
                    kernel_name,
                    facts.mma if facts else (),
                    facts.upcasts if facts else (),
                    facts is not None,
                )
            )
    return gemms


_DEDUPLICATED = re.compile(r'deduplicated_name="([^"]*)"')


def _matrix_operands(operands: list[str], instructions: dict[str, tuple]) -> list[str]:
    """The operands of a kernel call that are its matrices: the FP8 ones if two are, else
    the first two (a block-scaled GEMM also takes its scales)."""
    fp8 = [o for o in operands if o in instructions and _F8.match(instructions[o][0].strip())]
    return fp8[:2] if len(fp8) >= 2 else operands[:2]


def _ptx_name(name: str) -> str:
    return re.sub(r"[^\w$]", "_", name)


def _shared_kernels(computations: dict[str, dict[str, tuple]]) -> dict[str, list[str]]:
    """`deduplicated_name` -> the fusions that carry it: XLA emits one kernel for them all,
    named after one of them (not always the one the attribute names)."""
    groups: dict[str, list[str]] = {}
    for instructions in computations.values():
        for name, (_, _, _, rest) in instructions.items():
            dedup = _DEDUPLICATED.search(rest)
            if dedup:
                groups.setdefault(dedup.group(1), []).append(name)
    return groups


def _kernel_names(instruction: str, rest: str, shared: dict[str, list[str]]) -> list[str]:
    """Names the GPU kernel running a fusion may have in the PTX, most likely first: the
    fusion's own, then those of the fusions sharing its kernel (`.` and other characters PTX
    does not allow become `_`)."""
    dedup = _DEDUPLICATED.search(rest)
    names = [instruction]
    if dedup:
        names += [dedup.group(1), *shared.get(dedup.group(1), [])]
    return list(dict.fromkeys(map(_ptx_name, names)))


_CALLED = re.compile(r"(?:calls|body|condition)=%([\w.\-]+)")


def _callers(computations: dict[str, dict[str, tuple]]) -> dict[str, tuple[str, str, str, str]]:
    """Computation -> (the computation calling it, the calling instruction, its op, its
    attributes), for computations run by a fusion, a call or a loop (the first caller)."""
    callers: dict[str, tuple[str, str, str, str]] = {}
    for parent, instructions in computations.items():
        for name, (_, op, _, rest) in instructions.items():
            for called in _CALLED.findall(rest):
                callers.setdefault(called, (parent, name, op, rest))
    return callers


def _fusion_callers(
    callers: dict[str, tuple[str, str, str, str]],
) -> dict[str, tuple[tuple[str, str], bool]]:
    """Fused computation -> ((name, attributes) of the outermost fusion running it, whether
    that fusion is a Triton GEMM)."""
    out = {}
    for computation, (_, _, op, _) in callers.items():
        if op != "fusion":
            continue
        current, seen = computation, set()
        while current in callers and callers[current][2] == "fusion" and current not in seen:
            seen.add(current)
            parent, name, _, rest = callers[current]
            top = ((name, rest), '"__triton' in rest)
            current = parent
        out[computation] = top
    return out


def _loop_op_names(
    computations: dict[str, dict[str, tuple]], callers: dict[str, tuple[str, str, str, str]]
) -> dict[str, str]:
    """Computation -> the JAX name of the innermost `while` loop running it (directly, or
    through fusions and calls), for loops of fp8jax layers.

    JAX traces the body of a `lax.scan` once for every scan with the same body (block recipes
    loop over the chunks of each GEMM), so the instructions inside carry the name of the
    first layer that traced it; the loop instruction itself carries its own layer's name.
    """
    names: dict[str, str] = {}
    for computation in computations:
        seen, current = set(), computation
        while current in callers and current not in seen:
            seen.add(current)
            parent, _, op, rest = callers[current]
            if op == "while":
                op_name = _OP_NAME.search(rest)
                if op_name and _LAYER.search(op_name.group(1)):
                    names[computation] = op_name.group(1)
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

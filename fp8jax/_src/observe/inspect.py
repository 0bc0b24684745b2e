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

The parts: `deviceless` lowers and `ptx` compiles (keeping each kernel's PTX); `hlo` parses the
compiled module once, and `gemms`, `traffic` and `cost` read it; `results` holds what is
reported.
"""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from ..core.compile_options import cublas_reads
from ..train.step import TrainState, TrainStep
from .cost import module_cost_and_uncounted
from .deviceless import MODES, h100_topology, lower, no_h100_compiler
from .gemms import hlo_gemms, stablehlo_gemms
from .ptx import compile_with_ptx
from .results import Fp8InspectionError, Inspection
from .traffic import hlo_collectives, hlo_memory_traffic


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

    - `fn`: any function, jitted or not (a whole train step, say), not a compiled one (for that,
      `fp8jax.hlo_cost(compiled.as_text())`). Its arguments may be arrays,
      `jax.ShapeDtypeStruct`s or pytrees of them with other leaves (an Equinox model): only
      shapes and dtypes are used; nothing runs. They may be Flax NNX objects (an `nnx.Module`,
      an `nnx.Optimizer`) that `fn` updates in place, as a step from [`fp8jax.nnx_train_step`][]
      or an `nnx.jit` function does: they are compiled as their state, which the compiled
      program returns updated, so the backward pass and the update are compiled too, and the
      objects passed are left as they were. A step of [`fp8jax.make_train_step`][] (its
      `TrainState` first) or of [`fp8jax.nnx_train_step`][] (its model and optimizer first) is
      compiled as it compiles itself in each mode: the program it runs once every scale is
      recorded (delayed scaling's kept inverses handed to cuBLASLt in `"cublas"` mode), and the
      one it runs before as `first_steps`; a step without delayed scaling's warm start runs one
      program, reported alone. A program whose trace no mode changes (only delayed scaling's
      kept inverses depend on it) is traced and lowered once for all modes. Called inside a
      function of yours, it is part of that function's program (its first). Keywords other than
      the three below are `fn`'s; one that `fn`'s own signature does not take (a `target=`: it
      always compiles for an H100) raises a `TypeError` naming it.
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
    if isinstance(fn, jax.stages.Compiled):  # callable, but JAX cannot trace it again
        raise TypeError(
            f"fp8jax.inspect: fn={fn!r} is compiled already (for its own devices); pass the "
            "function it was compiled from (the inspection compiles it for an H100), or "
            "fp8jax.hlo_cost(compiled.as_text()) for the cost of this compile."
        )
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
    _check_keywords(fn, kwargs)
    topology = h100_topology()
    if topology is None:
        lowered, _ = lower(fn, args, kwargs, None)
        gemms = stablehlo_gemms(lowered.as_text(debug_info=True))
        target = f"nothing: {no_h100_compiler()}; this is the StableHLO of the program"
        return Inspection({"stablehlo": gemms}, {}, target)
    extra = dict(compiler_options or {})
    if not merge_dots:
        extra["xla_disable_hlo_passes"] = ",".join(
            filter(None, [extra.get("xla_disable_hlo_passes", ""), "dot-merger"])
        )
    device = topology.devices[0]
    step_programs = _step_programs(fn, args)
    if step_programs is None:
        lowered, devices = lower(fn, args, kwargs, device)
        return _compiled({m: (lowered, {**MODES[m], **extra}) for m in modes}, devices, device)
    # A train step: each of its programs traced and compiled as the step does for each mode;
    # traced once for every mode where the trace never asked whether it is for cuBLAS (the
    # one thing a mode changes in a step's trace: `traced_for`).
    by_mode = {mode: step_programs(MODES[mode]) for mode in modes}
    reports = {}
    first, *others = modes
    for name in by_mode[first]:
        program, options = by_mode[first][name]
        with cublas_reads() as reads:
            lowered, devices = lower(program, args, kwargs, device)
        lowerings = {first: (lowered, {**options, **extra})}
        for mode in others:
            program, options = by_mode[mode][name]
            if reads:  # the first mode's trace asked: each mode's is its own
                lowered, _ = lower(program, args, kwargs, device)
            lowerings[mode] = (lowered, {**options, **extra})
        reports[name] = _compiled(lowerings, devices, device)
    if "recorded" not in reports:  # a step that never switches: one program
        return reports["first"]
    return dataclasses.replace(reports["recorded"], first_steps=reports["first"])


def _check_keywords(fn: Callable, kwargs: dict[str, Any]) -> None:
    """Refuse a keyword that is neither `inspect`'s nor one `fn` takes (`target=`, `mode=`):
    `inspect` passes every keyword it does not know to `fn`, whose trace would raise."""
    try:
        parameters = pyinspect.signature(fn, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # no signature of its own (a wrapper): `fn` says
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    takes = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for name, value in kwargs.items():
        if name not in takes:
            raise TypeError(
                f"fp8jax.inspect: {name}={value!r} is neither a keyword of inspect (modes, "
                f"merge_dots, compiler_options; it always compiles for an H100) nor one that "
                f"fn={getattr(fn, '__name__', fn)!r} takes ({sorted(takes) or 'none'}), to which "
                "inspect passes the others."
            )


def _step_programs(fn: Callable, args: tuple) -> Callable[[dict[str, Any]], dict] | None:
    """For a train step of fp8jax (`make_train_step`'s, `nnx_train_step`'s), its programs on
    `args` compiled with given options (the step's `programs`); `None` for any other
    function."""
    if isinstance(fn, TrainStep):
        if not args or not isinstance(args[0], TrainState):
            raise TypeError(
                f"fp8jax.inspect: a train step takes its fp8jax.TrainState first, not "
                f"{type(args[0]).__name__ if args else 'nothing'}: inspect(train_step, "
                "train_step.init(model), *batch)."
            )
        return lambda options: fn.programs(options, args[0])
    # An NNX step exists only once its module (which imports Flax) was imported.
    if "fp8jax._src.convert.nnx.train" not in sys.modules:
        return None
    from ..convert.nnx.train import NnxTrainStep

    if not isinstance(fn, NnxTrainStep):
        return None
    if len(args) < 2:
        raise TypeError(
            f"fp8jax.inspect: an NNX train step takes the model and its nnx.Optimizer first, "
            f"then its arguments; got {len(args)} argument(s): inspect(step, model, "
            "optimizer, *args)."
        )
    return lambda options: fn.programs(options, args[0])


def _compiled(
    lowerings: dict[str, tuple[Any, dict[str, Any]]], devices: int, device: Any
) -> Inspection:
    """The `Inspection` of a program lowered for `device` (`devices` of them), per mode: its
    lowering and the options it compiles with."""
    gemms, memory, traffic, collectives, cost = {}, {}, {}, {}, {}
    for mode, (lowered, options) in lowerings.items():
        compiled, module, kernels = compile_with_ptx(lowered, options)
        cost[mode], uncounted = module_cost_and_uncounted(module, kernels=kernels)
        gemms[mode] = hlo_gemms(module, mode, kernels, uncounted=uncounted)  # one walk, both
        memory[mode] = compiled.memory_analysis()
        traffic[mode] = hlo_memory_traffic(module)
        collectives[mode] = hlo_collectives(module)
    kind = device.device_kind
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
    not run on FP8 tensor cores (every GEMM of the program, with `strict=True`; of a train
    step's both programs); return the inspection otherwise.

    `fn` may be a function with its arguments (as for
    [`fp8jax.inspect`][fp8jax.observe.inspect]) or an `Inspection` already made (alone:
    arguments given with it raise a `TypeError`). `modes` are
    the compile modes checked: by default `"cublas"`, the options fp8jax's train step
    compiles with ([`fp8jax.gpu_compiler_options`][]); add
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
    if not isinstance(strict, bool):
        raise TypeError(f"assert_all_fp8: strict={strict!r} should be True or False.")
    if not isinstance(modes, str) and isinstance(modes, Iterable):
        modes = tuple(modes)  # once: an iterator given is used up by reading it
    if not isinstance(modes, tuple) or not modes:
        raise ValueError(
            f"assert_all_fp8: modes={modes!r}: should be a non-empty tuple of modes among "
            f"{sorted(MODES)}, e.g. ('cublas',)."
        )
    if isinstance(fn, Inspection):
        if args or kwargs:
            raise TypeError(
                f"assert_all_fp8: an fp8jax.Inspection is checked as it was made, so its "
                f"{len(args)} argument(s) and keywords {sorted(kwargs)} would be ignored: pass "
                "them to fp8jax.inspect, or the function with them to assert_all_fp8."
            )
        report = fn
    else:
        report = inspect(fn, *args, modes=modes, **kwargs)
    if not report.deviceless:
        raise Fp8InspectionError(
            "assert_all_fp8: this is a StableHLO inspection, which shows operand types, not "
            f"the kernels that run: {no_h100_compiler()}."
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
        unproven = sum(not g.proven for g in bad)
        raise Fp8InspectionError(
            f"{len(bad)} GEMM(s) {'of the program' if strict else 'of fp8jax layers'} are not "
            f"shown to run on FP8 tensor cores ({len(bad) - unproven} proven not to, "
            f"{unproven} not proven either way; compiled for {report.target}):\n{listing}"
        )
    for inspection in (report, report.first_steps):
        for mode in modes if inspection is not None else ():
            _check_some_fp8(inspection, mode)
    return report


def _check_some_fp8(report: Inspection, mode: str) -> None:
    """Raise unless a GEMM of `report` in `mode` runs on FP8 tensor cores: with none, no GEMM
    offends, and yet nothing proves that FP8 runs."""
    fp8, total = report.count(mode)
    if fp8:
        return
    if total == 0:
        why = (
            "it has no GEMM at all: XLA computed every product as something else, as it does "
            "a matrix-vector product (a model called on one example or one token, not on a "
            "batch: jax.vmap it over the batch), or left it out, as it does a product with a "
            "dimension of size 0 (an empty batch); FP8 tensor cores run GEMMs"
        )
    else:
        why = (
            f"none of its {total} GEMMs runs on FP8 tensor cores, and none is an fp8jax "
            "layer's: convert the model (fp8jax.fp8_linear_layers) or its function "
            "(fp8jax.fp8_autocast) first"
        )
    raise Fp8InspectionError(
        f"assert_all_fp8: nothing proves that FP8 runs in the program compiled for "
        f"{report.target} [{mode}]: {why}."
    )

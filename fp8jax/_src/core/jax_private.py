"""Everything fp8jax takes from JAX's internals, in one place (with `jax_primitive` beside it:
the primitive of the high-precision grouped GEMM), and the one piece of Equinox's.

`tests/test_jax_private.py` exercises each piece and fails loudly if JAX moves it.

## A float32 dtype whose autodiff accumulation is `max`, not `+`

FP8 state leaves the step through the gradient: the cotangent of a scale or amax history is
its new value. JAX adds the cotangents of a value used several times (a Linear applied twice,
a `lax.scan` over microbatches), which would add amaxes. Cotangents of this dtype combine with
`max` instead, so every use contributes its amax and the history keeps the largest.

JAX has no public API for this: it takes the extended-dtype rules of `jax._src`, as Flax's
`fp8_ops` does.

Values of this dtype only ever live inside a traced computation: `to_max_combining` and the
cotangent's way back both happen under `jit`, never as eager arrays.

## Whether a value is being `vmap`ped, and whether a gradient is
Used to tell per-example gradients (`vmap` of a gradient) from a batch inside the loss: by
the tracer of a value, and by the stack of traces a GEMM is called under (each trace names
the one it was opened in as `parent_trace`).

## Whether a value is being differentiated, and by which trace
Used to tell when one FP8 layer's state enters two GEMMs under the same `jax.grad` (its
cotangents would be summed), and whether state is differentiated by an outer gradient.

## Whether anything is being traced
`jax.jit(..., compiler_options=...)` raises when called under another trace: the options
belong to a top-level executable. The train step takes its GPU options only at top level.

## The partition spec of an operand XLA's partitioner hands a `custom_partitioning`
JAX turns each operand's HLO sharding into a `NamedSharding` before calling the partition
rule, and raises when one cannot be expressed so (a small array split unevenly, padded): the
native kernels' rule reads the shardings of the operands it needs (`spec_of`), and takes the
rest as `GSPMDSharding`s, which it replaces.

## Interpreting a jaxpr equation by equation
`fp8jax.fp8_autocast` traces a function to a jaxpr and evaluates it again, answering chosen
`dot_general`s itself and binding every other equation as JAX's own `eval_jaxpr` does: the
bind parameters of a primitive, its equations' source information (name scopes, tracebacks),
the primitives that hold sub-jaxprs (`scan`, `while`, `cond`, `remat2`, `pjit`), literals.

## The target of a deviceless Pallas Triton lowering
From JAX 0.11 on, Pallas' Triton lowering reads the GPU it compiles for from the abstract
mesh of the context, else from the local device: in a deviceless compile (`JAX_PLATFORMS=cpu`)
a CPU, which it refuses. `gpu_lowering_target` names the topology's GPU there
(`fp8jax._src.observe.deviceless.lower`); JAX 0.10 needs nothing.

## A primitive that refuses to compile
A `lax.platform_dependent` branch that must never compile for its platform (a forced native
kernel's, on a CPU) is a primitive whose lowering raises the caller's error, naming the
platforms the program is compiled for: `refusing_primitive`.

## The manual mesh axes a value varies over (inside `shard_map`)
A custom VJP must return cotangents that vary over the same axes as its inputs: JAX's own
rules sum the gradient of a replicated input over the axes its cotangent varies on. JAX 0.10
reports those axes as `jax.typeof(x).manual_axis_type.varying` (earlier: `.vma`).

## Whether a `jax.shard_map` runs eagerly
Called outside any `jit`, `shard_map` runs its body on a `ShardMapTrace`, which refuses a
`custom_vjp` with `symbolic_zeros` (the FP8 GEMM's): `eager_shard_map` tells the GEMM to run
under a `jit` of its own there, traced to a jaxpr as in a jitted `shard_map`.

## The precision of a dot, as `lax` reads it
`lax.dot_general` and `lax.ragged_dot` take a `precision` in many forms (a string, a pair, a
`DotAlgorithmPreset` or its name, a `DotAlgorithm`) and canonicalize it with a function JAX
does not export: `canonical_precision` reads it the same way, raising `lax`'s own error.

## Copies of Equinox's `MISSING` sentinel (Equinox's internals)
Equinox flattens a Module with its `MISSING` sentinel in the treedef, and its unflatten tells
the sentinel by identity: a copied treedef (`copy.deepcopy`, `pickle`) held another object and
failed to unflatten ("'_Missing' object is not subscriptable"). A converted Flax NNX model's
graphdef holds each FP8 layer's treedef, so `copy.deepcopy(model)` failed:
`keep_equinox_missing_on_copy` makes copies of the sentinel the sentinel itself.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, dtypes, source_info_util
from jax._src.lax import lax as lax_internal

_F32 = np.dtype(np.float32)


class _MaxF32Rules:
    """Extended-dtype rules: physically float32, `add` is max, zero is -inf."""

    @staticmethod
    def physical_element_aval(dtype: Any) -> core.ShapedArray:
        return core.ShapedArray((), _F32)

    @staticmethod
    def convert_from(dtype: Any, other: Any) -> bool:
        return other == _F32

    @staticmethod
    def convert_to(other: Any, dtype: Any) -> bool:
        return other == _F32

    @staticmethod
    def add(dtype: Any, x: Any, y: Any) -> Any:
        as_f32 = lax.max(lax.convert_element_type(x, _F32), lax.convert_element_type(y, _F32))
        return lax.convert_element_type(as_f32, dtype)

    @staticmethod
    def zero(dtype: Any) -> Any:
        return lax.convert_element_type(np.array(-np.inf, _F32), dtype)

    @staticmethod
    def tangent_dtype(dtype: Any) -> Any:
        return dtype

    @staticmethod
    def full(shape: Any, fill_value: Any, dtype: Any) -> Any:
        value = lax.convert_element_type(fill_value, _F32)
        return lax.convert_element_type(lax.full(shape, value, _F32), dtype)


class max_f32(dtypes.extended):  # noqa: N801 - named like a NumPy scalar type
    """Scalar type of [`MAX_F32`][]; lets `jnp.issubdtype` recognise it."""


@dataclasses.dataclass(frozen=True)
class _MaxF32DType(dtypes.ExtendedDType):
    _rules: type = _MaxF32Rules
    type: type = max_f32

    @property
    def name(self) -> str:
        return "max_f32"

    def __repr__(self) -> str:
        return "max_f32"


MAX_F32 = _MaxF32DType()


def is_max_combining(x: Any) -> bool:
    """Whether `x` is an array of the max-combining dtype."""
    return getattr(x, "dtype", None) == MAX_F32


def to_max_combining(x: Any) -> Any:
    """View a float32 array as the max-combining dtype (inside a traced computation)."""
    if is_max_combining(x):
        return x
    return lax.convert_element_type(jnp.asarray(x, jnp.float32), MAX_F32)


def to_float32(x: Any) -> Any:
    """Undo [`to_max_combining`][]; plain float arrays are cast to float32."""
    if is_max_combining(x):
        return lax.convert_element_type(x, _F32)
    return jnp.asarray(x, jnp.float32)


def is_batch_tracer(x: Any) -> bool:
    """Whether `x` is a tracer of `jax.vmap` (JAX exports no name for its type)."""
    return isinstance(x, core.Tracer) and type(x).__name__ == "BatchTracer"


_DIFFERENTIATION_TRACES = ("LinearizeTrace", "JVPTrace")


def _is_batch_trace(trace: Any) -> bool:
    return type(trace).__name__ == "BatchTrace"


def _applying_vmap() -> Any | None:
    """In a `custom_vmap` rule: the `vmap`'s trace applying it, which JAX passes the rule
    nothing of (it runs the rule with its parent as the current trace): the nearest
    `BatchTrace.process_primitive` up the stack."""
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            break
        if frame.f_code.co_name == "process_primitive":
            trace = frame.f_locals.get("self")
            if _is_batch_trace(trace):
                return trace
        frame = frame.f_back
    return None


class GradientUnderVmap:
    """A call differentiated under `jax.vmap` (`vmap(grad(f))`, per-example gradients), and
    the `vmap`s inside its differentiated function (by their trace tags), which JAX's
    custom_vjp rule applies to the forward and to the backward, summing the gradient of
    what they do not map. Made by [`gradient_under_vmap`][]."""

    def __init__(self, inside: tuple) -> None:
        self._inside = inside

    def vmap_is_below(self) -> bool:
        """In a `custom_vmap` rule: whether its `vmap` maps the gradient (the gradient of a
        value it does not map stays per member), i.e. is not one of the `vmap`s inside the
        differentiated function. A `vmap` that cannot be told (a jaxpr batched anew) counts
        as below: mapping per member is right for both, where folding is not."""
        trace = _applying_vmap()
        return trace is None or not any(trace.tag is tag for tag in self._inside)


def gradient_under_vmap() -> GradientUnderVmap | None:
    """A [`GradientUnderVmap`][] when what runs now is differentiated under a `vmap` (a
    `vmap` below its topmost reverse-mode trace), else `None` (`grad(vmap(f))`: a batch
    inside the loss, where JAX sums the gradient of a value `vmap` does not map).

    Read from the stack of traces, each of which names the one it was opened in: a function
    traced to a jaxpr in between (`jit`, `checkpoint`, `scan`) keeps its parent, which is how
    a `vmap` below one is seen. JAX may reuse such a jaxpr under another trace (its caches
    do not know the parent): a jaxpr traced outside any `vmap`, then mapped, is not seen."""
    trace, inside = core.trace_ctx.trace, []
    while trace is not None and type(trace).__name__ not in _DIFFERENTIATION_TRACES:
        if _is_batch_trace(trace):
            inside.append(trace.tag)
        trace = getattr(trace, "parent_trace", None)
    while trace is not None:
        if _is_batch_trace(trace):
            return GradientUnderVmap(tuple(inside))
        trace = getattr(trace, "parent_trace", None)
    return None


def differentiation_trace(x: Any) -> Any | None:
    """The reverse-mode trace `x` is a tracer of (`jax.grad`, `jax.vjp` and what builds on
    them), or `None`. JAX exports no name for these tracer types or their traces."""
    if isinstance(x, core.Tracer) and type(x).__name__ in ("LinearizeTracer", "JVPTracer"):
        return x._trace
    return None


def single_use_trace(x: Any) -> Any | None:
    """The trace within which two uses of `x` have their cotangents added by a reverse-mode
    derivative: `x`'s own (`differentiation_trace`), or that of a function traced to a jaxpr
    under one (a `jax.checkpoint` or nested `jit` body inside `jax.grad`, whose inputs are
    tracers of the body's trace, its parent the gradient's); `None` outside any."""
    own = differentiation_trace(x)
    if own is not None or not isinstance(x, core.Tracer):
        return own
    if type(x._trace).__name__ != "DynamicJaxprTrace":
        return None
    trace = getattr(x._trace, "parent_trace", None)
    while trace is not None:
        if type(trace).__name__ in _DIFFERENTIATION_TRACES:
            return x._trace
        trace = getattr(trace, "parent_trace", None)
    return None


def tracing() -> bool:
    """Whether this runs under a JAX transformation (`jit`, `vmap`, `grad`, ...)."""
    return not core.trace_state_clean()


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def eager_shard_map() -> bool:
    """Whether a `custom_vjp` called now reaches the `ShardMapTrace` of a `jax.shard_map`
    called eagerly (outside any `jit`), which refuses one with `symbolic_zeros`: the traces
    above it pass the call down (`vmap`), none traces it to a jaxpr (`jit`, or the body of a
    `shard_map` under `jax.grad`) or differentiates it (`jax.grad` in the body)."""
    trace = core.trace_ctx.trace
    while trace is not None:
        name = type(trace).__name__
        if name == "ShardMapTrace":
            return True
        if name in ("DynamicJaxprTrace", "JaxprTrace", *_DIFFERENTIATION_TRACES):
            return False
        trace = getattr(trace, "parent_trace", None)
    return False


def shape_like(shape: tuple[int, ...], dtype: Any, like: Any) -> jax.ShapeDtypeStruct:
    """A kernel's output type `(shape, dtype)` varying over the manual mesh axes `like`
    varies over: inside `shard_map` a `pallas_call`'s outputs must say it."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:  # outside `shard_map`; inside, also where `like` is replicated
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def varying_like(x: Any, *operands: Any) -> Any:
    """`x` typed as varying over every manual mesh axis any of `operands` varies over (the
    initial carry of a loop over them inside `shard_map`: its type must be the body's)."""
    axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(operands)))
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def spec_of(sharding: Any, mesh: Any, ndim: int) -> jax.sharding.PartitionSpec | None:
    """The `PartitionSpec` over `mesh` of `sharding` (a `NamedSharding`, or the
    `GSPMDSharding` a `custom_partitioning` rule gets with `decode_shardings=False`) for an
    array of rank `ndim`; `None` when no `PartitionSpec` expresses it (uneven, padded)."""
    from jax._src import sharding_impls

    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)
    else:
        try:
            (spec,) = sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)
        except Exception:  # noqa: BLE001 - IndivisibleError and kin: not a mesh sharding
            return None
        spec = tuple(spec)
    return jax.sharding.PartitionSpec(*spec, *((None,) * (ndim - len(spec))))


# --- interpreting a jaxpr -------------------------------------------------------------------


def is_literal(var: Any) -> bool:
    """Whether a jaxpr input is a literal (its value is `var.val`) rather than a variable."""
    return isinstance(var, core.Literal)


def bind_equation(eqn: Any, invals: list) -> list:
    """The outputs of equation `eqn` on `invals`, bound as `jax.core.eval_jaxpr` binds it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(params, tuple):  # before JAX 0.10: (subfuns, parameters)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def equation_context(eqn: Any) -> Any:
    """The context `eval_jaxpr` binds `eqn` in: its traceback, and its name scopes appended
    to the current ones (so that compiled ops keep the scopes of the traced function)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def scope_of(eqn: Any) -> str:
    """The name scopes `eqn` was traced under (inside the traced function), `a/b/c`."""
    return str(eqn.source_info.name_stack)


def sub_jaxprs(eqn: Any) -> list:
    """The jaxprs held in `eqn`'s parameters (a scan's body, a cond's branches, ...)."""
    from jax.extend import core as extend_core

    return list(extend_core.jaxprs_in_params(eqn.params))


def jaxpr_parts(jaxpr: Any) -> tuple[Any, list]:
    """`(jaxpr, consts)` of a sub-jaxpr parameter: a `ClosedJaxpr` (JAX 0.10) or an open
    `Jaxpr` whose constants are inputs (JAX 0.11 and later)."""
    if hasattr(jaxpr, "consts"):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def scan_counts(params: dict) -> tuple[int, int]:
    """A `scan` equation's numbers of constant and carried inputs (the rest are scanned):
    `num_consts`/`num_carry` in JAX 0.10, the leaf counts of `ft_in`'s groups later."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    # JAX 0.11+: `ft_in`, a flat tree (consts, carry, xs); each group's length is its leaves.
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def gpu_lowering_target(device: Any, mesh: Any = None) -> contextlib.AbstractContextManager:
    """A context in which Pallas Triton kernels lower for `device` (or `mesh`'s devices),
    compile-only GPUs of a deviceless topology (see the module docstring); a no-op where
    JAX's Triton lowering does not need it, or the context already names a device."""
    import importlib.util

    from jax._src import mesh as mesh_lib

    if (
        importlib.util.find_spec("jax._src.pallas.triton.gpu_info") is None
        or getattr(mesh_lib.get_abstract_mesh(), "abstract_device", None) is not None
    ):
        return contextlib.nullcontext()
    if mesh is not None:  # its abstract mesh names its devices' kind
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    if getattr(device, "platform", None) != "gpu":
        return contextlib.nullcontext()
    target = mesh_lib.AbstractDevice(
        device_kind=device.device_kind,
        num_cores=getattr(device, "core_count", None),
        platform=device.platform,
    )
    return jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((), (), abstract_device=target))


def refusing_primitive(
    name: str, refusal: Callable[[str], Exception]
) -> Callable[[tuple[tuple[tuple[int, ...], Any], ...]], list]:
    """A primitive `name` whose results have the `(shape, dtype)`s it is bound with and whose
    lowering raises `refusal(platforms)` (its eager run `refusal(default backend)`): the
    branch of a `lax.platform_dependent` that must never compile. Returns its bind, taking
    the `(shape, dtype)`s."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    def lowering(ctx: Any, *, avals: tuple) -> Any:
        raise refusal(", ".join(ctx.module_context.platforms))

    def impl(*, avals: tuple) -> Any:
        raise refusal(jax.default_backend())

    primitive = Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(impl)
    primitive.def_abstract_eval(lambda *, avals: [core.ShapedArray(*a) for a in avals])
    mlir.register_lowering(primitive, lowering)
    return lambda avals: primitive.bind(avals=tuple(avals))


def canonical_precision(precision: Any) -> Any:
    """`precision` as `lax.dot_general` and `lax.ragged_dot` read it: `None`, a pair of
    `lax.Precision`s, a `lax.DotAlgorithmPreset` or a `lax.DotAlgorithm`. Raises `lax`'s
    `ValueError`, which lists what it takes, for anything else."""
    return lax_internal.canonicalize_precision(precision)


def user_dtype(dtype: Any, fun_name: str) -> np.dtype:
    """`dtype` as `lax.dot_general` reads a `preferred_element_type`: float64 is float32
    without x64, with lax's `UserWarning` naming `fun_name`; a Python type is JAX's default."""
    return np.dtype(dtypes.check_and_canonicalize_user_dtype(dtype, fun_name))


def keep_equinox_missing_on_copy() -> None:
    """Make copies (`copy`, `pickle`) of Equinox's `MISSING` sentinel the sentinel itself
    (see the module docstring); nothing where Equinox keeps it already, or lays it out
    elsewhere."""
    try:
        from equinox._module._flatten import MISSING
    except ImportError:
        return
    if copy.deepcopy(MISSING) is not MISSING:
        # Reduced to its global name: pickle and copy give back the module's object.
        copyreg.pickle(type(MISSING), lambda _: "MISSING")

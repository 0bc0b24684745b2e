"""Where fp8jax's native kernels run: on a Hopper GPU, in Mosaic GPU's interpreter for tests,
and nowhere else (the XLA path, with the same numerics, serves every other platform)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from ..core import jax_private
from ..core.contexts import Setting, setting
from ..core.formats import amd_format
from . import partition
from .partition import GemmDims

_INTERPRET: Setting[bool] = Setting("fp8jax_interpret_kernels", False)
_ON_MESH: Setting[bool] = Setting("fp8jax_operands_on_mesh", False)
_EMPTY: Setting[bool] = Setting("fp8jax_empty_batch", False)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Trace native kernels for Mosaic GPU's interpreter (on a CPU, slowly), and choose them
    wherever a recipe would choose them on a Hopper GPU. For tests; a function jitted
    outside is traced again inside (`core.contexts`)."""
    with setting(_INTERPRET, True):
        yield


class Interpreted(NamedTuple):
    """What `run_interpreted` ran: `fn`'s outputs with the kernels run on every device's
    shards (`outputs`) and as the partitioned program computes them on the devices
    (`partitioned`: each device runs the kernels' XLA twins), the partitioner's plan of each
    GEMM (in trace order; `None` for one on a device's data as it is, or one XLA removed),
    and the jaxpr that ran the kernels."""

    outputs: Any
    partitioned: Any
    plans: list[partition.ShardPlan | None]
    jaxpr: str


def run_interpreted(fn: Callable[..., Any], *args: Any) -> Interpreted:
    """`fn(*args)`, jitted, with its native kernels run in Mosaic GPU's interpreter, those
    that XLA partitions across devices (`partition.per_shard`) included. For tests.

    The interpreter cannot run inside a partitioned program. So `fn` runs first on the
    devices `args` lie on, each device running the kernels' XLA twins, while XLA's
    partitioner records what every device computes for each GEMM; then on one device, each
    partitioned kernel run on every device's shards in turn as recorded
    (`partition.emulated`). Raises `RuntimeError` if the second trace did not use every
    recorded plan (give `fn` and `args` a trace of their own)."""
    with interpreted(), partition.recording() as plans:
        partitioned = eqx.filter_jit(lambda *a: fn(*a))(*args)
    device = jax.devices()[0]
    local = jax.tree.map(lambda a: jax.device_put(a, device) if eqx.is_array(a) else a, args)
    with interpreted(), partition.replaying(plans) as replay:
        outputs = eqx.filter_jit(lambda *a: fn(*a))(*local)
    if replay.used != len(plans):
        raise RuntimeError(
            f"run_interpreted: {len(plans)} GEMMs recorded but {replay.used} replayed."
        )
    with interpreted(), partition.replaying(plans):
        jaxpr = str(eqx.filter_make_jaxpr(fn)(*local)[0])
    return Interpreted(outputs, partitioned, plans, jaxpr)


@contextlib.contextmanager
def empty_batch() -> Iterator[None]:
    """Inside, every native kernel's call takes the XLA path: traced for a `vmap` of no
    members (an empty batch), whose kernels' grids would have no tile (the interpreter
    raised `ZeroDivisionError`). The XLA path's products are empty, or zeros."""
    with setting(_EMPTY, True):
        yield


def interpreting() -> bool:
    """Whether native kernels are being traced for the interpreter (see `interpreted`)."""
    return _INTERPRET.get()


def _hopper(device: Any) -> bool:
    return str(getattr(device, "compute_capability", "")) in ("9.0", "9.0a")


def local_gpus_lack_hopper() -> bool:
    """True when this process sees CUDA GPUs and not all of them are Hopper (sm_90): the
    native kernels, compiled for `wgmma`, cannot run there."""
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    return bool(gpus) and not all(_hopper(d) for d in gpus)


def per_device_gemm(*operands: Any) -> bool:
    """Whether a GEMM of `operands` runs on one device's data: neither an operand nor the
    program (`jax.set_mesh`) lives on a mesh axis of several devices that XLA partitions
    (inside `shard_map` the mesh axes are manual; a single-device program has no mesh). On
    such an axis, an opaque kernel call would make XLA gather the operands and compute the
    whole product on every device."""
    if partition.inside():
        return True
    if _ON_MESH.get():
        return False
    # The operands' meshes, and `jax.set_mesh`'s: there `jit`'s arguments are typed without
    # one (sharded by `in_shardings`), while XLA partitions the program over it.
    meshes = [
        getattr(jax.typeof(leaf).sharding, "mesh", None) for leaf in jax.tree.leaves(operands)
    ]
    for mesh in [*meshes, jax.sharding.get_abstract_mesh()]:
        if mesh is None or mesh.empty:
            continue
        if any(size > 1 for name, size in mesh.shape.items() if name not in mesh.manual_axes):
            return False
    return True


@contextlib.contextmanager
def placed_as(*operands: Any) -> Iterator[None]:
    """Inside, every GEMM and quantization is placed as `operands` (a layer's GEMM's inputs,
    or its backward's residuals) are: on a mesh that XLA partitions where one of them lies on
    one (`per_device_gemm` is then False), even for an array whose type lost its mesh (the
    output gradient reaching a backward under `vmap` may have none), whose opaque
    quantization kernel XLA would otherwise gather whole onto every device."""
    if per_device_gemm(*operands):
        yield
        return
    with setting(_ON_MESH, True):
        yield


def check_native_kernel(value: object) -> None:
    """Raise `ValueError` unless `value` is a recipe's valid `native_kernel` option."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"native_kernel={value!r}: should be None (the kernel on Hopper GPUs, the XLA path "
            "elsewhere), True (the kernel) or False (the XLA path)."
        )


def check_native_format(who: str, native_kernel: bool | None, field: str, fmt: str) -> None:
    """Raise `ValueError` where `native_kernel=True` asks the Hopper kernels for a format their
    `wgmma` does not take (AMD's fnuz ones)."""
    if native_kernel and amd_format(fmt):
        raise ValueError(
            f"{who}(native_kernel=True, {field}={fmt!r}): the native kernel's wgmma takes "
            "'e4m3' and 'e5m2' only; AMD's fnuz formats run the XLA path (native_kernel=None "
            "or False)."
        )


def choose(
    use_native: bool | None,
    native: Callable[..., Any],
    xla: Callable[..., Any],
    *args: Any,
    dims: GemmDims | None = None,
    out_dtype: Any = jnp.float32,
    name: str = "",
) -> Any:
    """`native(*args, out_dtype=out_dtype)` or `xla(*args)`, as a recipe's `native_kernel`
    option says.

    `True` takes the native kernel (compiling it fails off Hopper; compiling for another
    platform than CUDA, a CPU say, raises `ValueError` naming the option); `False` the XLA path;
    `None` the native kernel where the program is compiled for CUDA and every local GPU, if
    any, is a Hopper (a deviceless compile for an H100 included), the XLA path elsewhere
    (`lax.platform_dependent`: a CPU compile never sees the kernel). Under `interpreted()`,
    `None` and `True` take the native kernel through the interpreter. An empty operand (a
    batch of no rows, or a `vmap` of none: `empty_batch`) takes the XLA path whatever the
    option: no kernel grid is empty, and the product is zeros.

    When the operands lie on a mesh that XLA partitions, `dims` (the operands' axes, see
    `partition.per_shard`) lets each device run the kernel on its shards; without them the
    `None` option keeps the XLA path there (an opaque kernel would make XLA gather the
    operands and compute the whole product on every device). `name`, the kernel's (e.g.
    `BLOCK_GEMM_NAME`), then names the partitioned call, whose kernel would otherwise carry
    no name of its own in the program (the cost model finds the native GEMMs by it).

    The mesh is known only from the operands' types and `jax.set_mesh`'s mesh: a `jit`
    argument sharded by `in_shardings` alone, outside `jax.set_mesh`, is typed on none (no
    public JAX API names `in_shardings` while tracing), so its GEMM takes the one-device path
    and, compiled for CUDA, XLA gathers the operands around the kernel
    (docs/scaling_out.md). Trace such a step under `jax.set_mesh(mesh)`, or place its
    arguments (`jax.device_put`).
    """
    if use_native is False or _EMPTY.get() or any(jnp.size(a) == 0 for a in jax.tree.leaves(args)):
        return xla(*args)  # an empty operand (no rows, say): a kernel's grid would have no tile
    # The kernels write at most 32-bit outputs: a float64 one (x64 on) is their float32 one,
    # widened (asked of them, its buffer took a float32 value, x64 off inside, and raised).
    narrow = jnp.float32 if jnp.dtype(out_dtype).itemsize > 4 else out_dtype
    run = _widened(_without_x64(functools.partial(native, out_dtype=narrow)), out_dtype)
    if _partitioned(dims, args):
        # Mosaic GPU's interpreter simulates a GPU through ordered host callbacks, which
        # `custom_partitioning` cannot hold: interpreted, each device runs the XLA path (the
        # kernel's numerics twin) while XLA partitions the program, and the kernel itself
        # where the partitioner's decisions are replayed on one device (`run_interpreted`).
        local = _as_native(xla) if interpreting() and not partition.replays() else native
        run = functools.partial(partition.per_shard, local, dims, narrow, name=name)
        run = _widened(run, out_dtype)
    elif not per_device_gemm(*args) and not (use_native or interpreting()):
        return xla(*args)
    run = _varying_like(run, args)
    if interpreting():
        return run(*args)
    if use_native:  # a compile for another platform raises, naming the option
        return lax.platform_dependent(*args, cuda=run, default=functools.partial(_refused, run))
    if local_gpus_lack_hopper():
        return xla(*args)
    return lax.platform_dependent(*args, cuda=run, default=xla)


def _refusal(platform: str) -> ValueError:
    return ValueError(
        f"native_kernel=True: fp8jax's native kernels are Pallas Mosaic GPU kernels for Hopper "
        f"GPUs (sm_90), and this program is compiled for {platform}. Use native_kernel=None "
        "(the kernel on Hopper GPUs, the XLA path elsewhere) or False (the XLA path), or "
        "compile for an H100 (fp8jax.inspect's deviceless compile)."
    )


#: A forced native kernel's stand-in in a program compiled for another platform than CUDA
#: (`choose`): compiling it raises `_refusal` (Pallas would say only "Only interpret mode is
#: supported on CPU backend", from inside a kernel).
_refused_p = jax_private.refusing_primitive("fp8jax_native_kernel_refused", _refusal)


def _refused(kernel: Callable[..., Any], *args: Any) -> Any:
    """Outputs shaped as `kernel(*args)`'s, from `_refused_p` (typed as varying as `args`)."""
    leaves, tree = jax.tree.flatten(jax.eval_shape(kernel, *args))
    outs = _refused_p(tuple((o.shape, jnp.dtype(o.dtype)) for o in leaves))
    return jax.tree.unflatten(tree, [jax_private.varying_like(o, args) for o in outs])


def _widened(kernel: Callable[..., Any], out_dtype: Any) -> Callable[..., Any]:
    """`kernel` with its results cast to `out_dtype` where they are narrower (float32 for a
    float64 output); `kernel` itself where they already are."""
    if jnp.dtype(out_dtype).itemsize <= 4:
        return kernel

    def widened(*args: Any) -> Any:
        return jax.tree.map(lambda out: out.astype(out_dtype), kernel(*args))

    return widened


def _without_x64(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel` traced with 64-bit types off, as the kernels are written (Pallas's pipelines
    mix a Python int, int64 under `jax_enable_x64`, with int32 trip counts). Traced for a
    CUDA branch on every platform, it raised under x64 even on a CPU."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        if not jax.config.jax_enable_x64:
            return kernel(*args, **kwargs)
        with jax.enable_x64(False):
            return kernel(*args, **kwargs)

    return traced


def _varying_like(kernel: Callable[..., Any], args: tuple) -> Callable[..., Any]:
    """`kernel` with its results typed as varying over the manual mesh axes its operands vary
    over (inside `shard_map`), as XLA's own ops on them are: a kernel call's results are
    typed as invariant, and `lax.platform_dependent`'s branches must agree."""
    axes = frozenset().union(*(jax_private.varying_axes(a) for a in jax.tree.leaves(args)))
    if not axes:
        return kernel

    def typed(*a: Any) -> Any:
        def vary(x: Any) -> Any:
            missing = tuple(sorted(axes - jax_private.varying_axes(x)))
            return lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(vary, kernel(*a))

    return typed


def on_shards(
    gemm: Callable[..., Any], *args: Any, dims: GemmDims, out_dtype: Any = jnp.float32
) -> Any:
    """`gemm(*args, out_dtype=out_dtype)` (an XLA GEMM), run by each device on its shards
    where the operands lie on a mesh that XLA partitions (`partition.per_shard`), as it is
    elsewhere. For GEMMs XLA would partition badly: a block recipe's loop over 128-wide
    chunks of a contraction split across devices gathers a whole operand per chunk."""
    if _partitioned(dims, args):
        return partition.per_shard(gemm, dims, out_dtype, *args)
    return gemm(*args, out_dtype=out_dtype)


def _partitioned(dims: GemmDims | None, args: tuple) -> bool:
    """Whether a GEMM of `args` with `dims` runs through `partition.per_shard`: its operands
    lie on a mesh that XLA partitions, or recorded plans are replayed (`run_interpreted`).
    One that runs on one device's data is noted where plans are recorded."""
    if dims is None:
        return False
    if partition.replays() or not per_device_gemm(*args):
        return True
    partition.record_local()
    return False


def _as_native(xla: Callable[..., Any]) -> Callable[..., Any]:
    """The XLA path `xla(*args)` (its output dtype fixed) called as a native kernel is."""

    def call(*args: Any, out_dtype: Any) -> Any:
        return xla(*args).astype(out_dtype)

    return call


def k_major(data: jax.Array, axis: int) -> jax.Array:
    """`data` with its contracted `axis` (-1 or -2) moved last, as the kernels take it.

    A transpose is made of the values as they are, held row-major: without that pin XLA's
    layout assignment moves it up into the producers (a quantization, and from there the
    high-precision tensors it reads), which then compute in the transposed layout and keep
    high-precision copies in both layouts alive (more H100 temp memory for block scaling on
    the MLP of benchmarks/peers.py: `benchmarks/RESULTS.md`)."""
    if axis == -1:
        return data
    row_major = Layout(major_to_minor=tuple(range(data.ndim)))
    return jnp.swapaxes(with_layout_constraint(data, row_major), -1, -2)

"""The deviceless H100 compile: compile-only H100s (one, or a mesh of them) from the CUDA
plugin's topology, and a program lowered for them with its arguments abstract.

It needs the `h100` extra (`jax-cuda12-plugin` and `jax-cuda12-pjrt` of jax's version) and
`JAX_PLATFORMS=cpu` set before jax starts; without them `h100_topology` is `None`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..core import jax_private
from ..core.compile_options import gpu_compiler_options
from .roofline import GPUS_PER_NODE, is_whole

#: XLA option sets the inspector compiles with: `"cublas"`, fp8jax's (Triton GEMMs off), and
#: `"default"`, XLA's own.
MODES = {
    "cublas": gpu_compiler_options(),
    "default": {},
}


@functools.cache
def h100_topology(devices: int = 1) -> Any | None:
    """`devices` compile-only H100s (`None` when the CUDA plugin is missing): one host of up
    to 8, or hosts of 8 (DGX H100 nodes) for more. The CUDA plugin's topology is
    `"<slices>x<hosts>x<GPUs per host>"`; device `i` is on host `i // 8` (its
    `process_index`), which is what `hlo_cost` takes for a node."""
    if (
        not is_whole(devices)
        or devices < 1
        or (devices > GPUS_PER_NODE and devices % GPUS_PER_NODE)
    ):
        raise ValueError(
            f"h100_topology: devices={devices!r} should be a whole number from 1 to "
            f"{GPUS_PER_NODE} (one host), or a multiple of {GPUS_PER_NODE} (hosts of "
            f"{GPUS_PER_NODE} GPUs)."
        )
    from jax.experimental import topologies

    config = importlib.resources.files("fp8jax._src").joinpath("data/h100_sxm.txtpb").read_text()
    hosts, per_host = max(1, devices // GPUS_PER_NODE), min(devices, GPUS_PER_NODE)
    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x{hosts}x{per_host}"
        )
    except Exception:  # noqa: BLE001 - any failure means: no deviceless CUDA compiler here
        return None


def no_h100_compiler() -> str:
    """Why `h100_topology()` found no deviceless H100 compiler, in words for a user."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        return "jax-cuda12-plugin is missing (install fp8jax[h100] for the H100 compile)"
    return (
        "jax-cuda12-plugin is installed, but its compiler did not start: on a machine "
        "without a GPU, set JAX_PLATFORMS=cpu before jax starts (the plugin otherwise looks "
        "for a CUDA driver), and keep the plugin at jax's exact version"
    )


def h100_mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
    """A mesh of compile-only H100s (`prod(axes.values())` GPUs: up to 8 in one host, or a
    multiple of 8 in hosts of 8, as DGX H100 nodes), for
    [`fp8jax.inspect`][fp8jax.observe.inspect] and [`fp8jax.hlo_cost`][] of sharded
    programs.

    The devices fill the mesh in order, the last axis fastest: with `{"data": 8, "fsdp": 8}`,
    each `fsdp` group is one node (its collectives cross NVLink) and each `data` group has
    one GPU per node (they cross InfiniBand).

    Give `inspect` `jax.ShapeDtypeStruct`s with `NamedSharding`s on this mesh for the
    arguments to shard; the other array arguments are replicated over it. (Arrays sharded
    over a mesh of this machine's devices, a CPU mesh, are laid out on a mesh of H100s with
    the same axes and axis types, which stands for the CPU mesh as `jax.set_mesh`'s mesh too
    where that is the CPU mesh; a function that builds its own constraints needs this mesh to
    build them.)

    ```python
    mesh = fp8jax.h100_mesh({"data": 8})
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    report = fp8jax.inspect(train_step, state, x)
    ```

    Raises `TypeError` for `axes` that are not a dict from names to whole numbers,
    `ValueError` for sizes it cannot make (below 1; more than 8 GPUs, not a multiple of 8).
    """
    wrong_type = (
        not isinstance(axes, Mapping)
        or not all(isinstance(name, str) for name in axes)
        or not all(is_whole(n) for n in axes.values())
    )
    if wrong_type or not axes or not all(n >= 1 for n in axes.values()):
        raise (TypeError if wrong_type else ValueError)(
            f"h100_mesh: axes={axes!r}: should be a dict from mesh axis names to sizes >= 1, "
            "e.g. {'data': 8}."
        )
    size = math.prod(axes.values())
    if size > GPUS_PER_NODE and size % GPUS_PER_NODE:
        raise ValueError(
            f"h100_mesh: axes={axes!r} make {size} GPUs; more than {GPUS_PER_NODE} should be "
            f"a multiple of {GPUS_PER_NODE} (hosts of {GPUS_PER_NODE} GPUs)."
        )
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


def _named_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """The `NamedSharding` an argument is given with: a `ShapeDtypeStruct`'s, or that of an
    array sharded over a mesh of several devices (a CPU mesh's too: its axes, not its
    devices, are what the H100 compile keeps)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    if isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and sharding.mesh.size > 1):
        return sharding
    return None


def _mesh_of(dynamic: Any) -> jax.sharding.Mesh | None:
    for x in jax.tree.leaves(dynamic):
        sharding = _named_sharding(x)
        if sharding is not None:
            return sharding.mesh
    return None


def split_graph_nodes(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
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


#: What JAX raises for `compiler_options` given to a jit traced inside another.
_NESTED_OPTIONS = "can only be passed to top-level"


def lower(fn: Callable, args: tuple, kwargs: dict, device: Any | None) -> tuple[Any, int]:
    """`fn(*args, **kwargs)` lowered with its array leaves abstract, and how many devices it
    runs on: on `device` if given, or replicated over the mesh of the arguments that carry a
    `NamedSharding`. Flax NNX objects among the arguments are lowered as their state, which
    the function returns updated (`split_graph_nodes`)."""
    original = fn
    fn, args, kwargs = split_graph_nodes(fn, args, kwargs)
    dynamic, static = eqx.partition((args, kwargs), _is_dynamic)
    mesh = _mesh_of(dynamic) if device is not None else None
    context: Any = contextlib.nullcontext()
    if mesh is not None and not all(d.platform == "gpu" for d in mesh.devices.flat):
        # Arguments sharded over this machine's devices (a CPU mesh): the same axes (and axis
        # types), on compile-only H100s (compiled for CPU devices, every kernel choice would be
        # a CPU's); under `jax.set_mesh` of the CPU mesh, set to the H100s' instead.
        cpu_mesh, h100s = mesh, h100_mesh(dict(mesh.shape))
        mesh = jax.sharding.Mesh(h100s.devices, h100s.axis_names, axis_types=mesh.axis_types)
        if jax.sharding.get_abstract_mesh() == cpu_mesh.abstract_mesh:
            context = jax.set_mesh(mesh)

    def abstract(x: Any) -> jax.ShapeDtypeStruct:
        if mesh is not None:
            given = _named_sharding(x)
            if given is not None:
                sharding = jax.sharding.NamedSharding(mesh, given.spec)
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
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
    try:
        with context, jax_private.gpu_lowering_target(device, mesh):
            return jax.jit(call).lower(jax.tree.map(abstract, dynamic)), devices
    except RuntimeError as e:
        if "cuDNN not found" not in str(e):
            raise
        # JAX looks for cuDNN on this machine while tracing cuDNN attention.
        raise RuntimeError(
            "fp8jax could not trace the function for the H100 compile: it calls cuDNN "
            "(jax.nn.dot_product_attention(..., implementation='cudnn'), say), which JAX "
            "looks for on this machine as it traces, and this machine has none. Inspect it "
            "with implementation='xla' (or None) in its place, or on a machine with a GPU. "
            f"JAX said: {e}"
        ) from None
    except ValueError as e:
        if "incompatible devices" in str(e) and mesh is not None:
            raise ValueError(
                f"fp8jax could not lower the function for {devices} H100s: it places values on "
                "other devices (a sharding constraint or device_put on a mesh of this "
                "machine's devices), where the inspection compiles for compile-only H100s. "
                "Build that mesh with fp8jax.h100_mesh (the same axes) for the inspection, "
                f"e.g. pass it to the function as an argument. JAX said: {e}"
            ) from None
        if _NESTED_OPTIONS not in str(e):
            raise
        # A step jitted with compiler options (`jax.jit(step, compiler_options=...)`, as the
        # README's is), which JAX refuses inside another jit: the function it wraps is
        # compiled here, with the inspection's own options in their place.
        wrapped = getattr(original, "__wrapped__", None)
        if wrapped is None:
            raise ValueError(
                "fp8jax could not lower the function for the H100 compile: a jax.jit (or "
                "eqx.filter_jit) with compiler_options inside it, which JAX takes at the top "
                "level only. Inspect the function that jit wraps: the inspection compiles with "
                f"its own options (its modes). JAX said: {e}"
            ) from None
        return lower(wrapped, args, kwargs, device)

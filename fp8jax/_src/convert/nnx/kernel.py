"""FP8 for NNX modules that are Linears without being `nnx.Linear`: a module that holds its
own `kernel` (an `nnx.Param` of two axes or more) and multiplies its input by it through
`lax.dot_general`, `jnp.dot`, `@` or `jnp.einsum` in its call (Hugging Face's `FlaxConv1D`
ported to NNX, `x @ self.kernel.value` in a user's module).

Such a module has no `dot_general` to swap. Conversion keeps the instance and its variables
(so the parameters keep their paths), gives it an [`fp8jax.Fp8NnxDotGeneral`][] as
`fp8_dot` (its FP8 state in [`fp8jax.Fp8State`][] variables, as for `nnx.Linear`), and
changes its class to a subclass of its own class (`Fp8<Name>`, one per class) whose call is
the original call traced to a jaxpr as a function of the module's variables and inputs,
then evaluated again with the GEMMs whose right operand is the kernel (or a view of it: a
transpose, a cast) answered by `fp8_dot`, as `fp8jax.fp8_autocast` answers its GEMMs.
Everything else in the call (bias, casts, reshapes) runs as written, and what the call
writes into the module's variables or those of NNX objects among its arguments (an RNG count,
of its own or of an `nnx.Rngs` passed to it; a batch statistic) is written back, as are the
plain attributes it rebinds on them (a Python counter); an array, Variable or module it binds
to an attribute is refused by name (it would leave the trace).

The state is made without the kernel's `(out, in)` shape, which only the call tells (which
axis is contracted): recipes that keep kernel-shaped state (`ResidualFP8(error_feedback=
True)`) are refused for such a module. A stack of such modules (`nnx.vmap`, a kernel of
three axes or more) is not converted: it stays in high precision (named with what to do by
a conversion with `example`, whose trace finds its GEMMs).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ..autocast import trace_call
from ..config import ROOT, Fp8Config
from ..interpret import Interpreter, KernelChoice
from ..roles import gemm_operands
from .layers import Fp8NnxDotGeneral

#: The parameter a module multiplies its input by, to be converted as a Linear.
KERNEL: str = "kernel"
#: The attribute of a converted module that holds its FP8 `dot_general`.
FP8_DOT: str = "fp8_dot"
#: Modules holding a `kernel` that are no Linear: convolutions (and, should one hold a
#: `kernel`, embeddings and norms).
NOT_LINEAR: tuple[type, ...] = (nnx.Conv, nnx.ConvTranspose, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm)

#: The FP8 subclass made for each class, and the class each FP8 subclass was made from.
_FP8_CLASSES: dict[type, type] = {}
_ORIGINALS: dict[type, type] = {}


def has_kernel(node: Any) -> bool:
    """Whether `node` is an `nnx.Module` holding a `kernel` `nnx.Param` of its own (a matrix;
    an attribute of the module itself, not of a child) and not a convolution. Without a
    trace there is no telling a projection from a user's convolution: a kernel of more axes
    is left alone."""
    if not isinstance(node, nnx.Module) or isinstance(node, NOT_LINEAR):
        return False
    kernel = vars(node).get(KERNEL)
    if not isinstance(kernel, nnx.Param):
        return False
    return len(getattr(kernel.get_value(), "shape", ())) == 2


def original_class(node: Any) -> type:
    """The class a module had before conversion (its own class if not converted)."""
    return _ORIGINALS.get(type(node), type(node))


def kernel_out_width(node: Any) -> int | None:
    """A kernel module's number of outputs, from its `features` or `out_features` (an int),
    else `None`."""
    for attr in ("features", "out_features"):
        width = getattr(node, attr, None)
        if isinstance(width, int) and not isinstance(width, bool):
            return width
    return None


def convert_kernel_module(module: Any, path: tuple[str, ...], config: Fp8Config) -> None:
    """Give the kernel module at `path` its FP8 state and the FP8 call, in place."""
    name = ".".join(path)
    cls = original_class(module)
    try:
        dot = Fp8NnxDotGeneral(config.recipe_for(path), None, name, config.telemetry)
    except ValueError as e:
        raise ValueError(
            f"fp8_linear_layers: the {cls.__name__} {name or ROOT!r} multiplies by its own "
            f"{KERNEL!r}, whose (out, in) shape only its call tells, and its recipe needs that "
            f"shape ({e}) Give it a recipe that keeps no kernel-shaped state (Fp8Config "
            "recipes), or exclude it (Fp8Config exclude or targets)."
        ) from None
    setattr(module, FP8_DOT, nnx.data(dot))
    object.__setattr__(module, "__class__", _fp8_class(cls))


def _fp8_class(cls: type) -> type:
    """The subclass of `cls` whose call runs `cls`'s call with its kernel GEMMs in FP8."""
    sub = _FP8_CLASSES.get(cls)
    if sub is None:
        namespace = {
            "__call__": _fp8_call,
            "__module__": cls.__module__,
            "__qualname__": f"Fp8{cls.__qualname__}",
            "__doc__": f"`{cls.__qualname__}` with its GEMMs on its own kernel in FP8 (fp8jax).",
        }
        pytree = getattr(cls, "_pytree__is_pytree", None)
        kwargs = {} if pytree is None else {"pytree": pytree}
        sub = type(cls)(f"Fp8{cls.__name__}", (cls,), namespace, **kwargs)
        _FP8_CLASSES[cls] = sub
        _ORIGINALS[sub] = cls
    return sub


def _is_own_fp8_dot(path: tuple[Any, ...], value: Any) -> bool:
    return bool(path) and path[0] == FP8_DOT


def _is_kernel(path: Any) -> bool:
    """Whether a key path in `((state, *args), kwargs)` is the module's kernel."""
    names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if names and names[-1] == "value":
        names = names[:-1]
    return names == ["0", "0", KERNEL]


def _nodes(tree: Any) -> list:
    """The NNX objects (graph nodes) in `tree`, outermost ones, in tree order."""
    leaves = jax.tree.leaves(tree, is_leaf=nnx.graph.is_graph_node)
    return [x for x in leaves if nnx.graph.is_graph_node(x)]


def _attributes(root: Any) -> list[tuple[tuple, Any, dict]]:
    """Each NNX object under `root` (itself included): its path, itself and its attributes."""
    return [(p, n, dict(vars(n))) for p, n in nnx.iter_graph(root) if isinstance(n, nnx.Pytree)]


def _write_back_attributes(cls: type, name: str, original: Any, before: list) -> None:
    """Rebind on `original`'s objects the plain attributes the call rebound on its copy's
    (`before`: the copy's objects and their attributes when the call began), as the call
    does on the objects themselves unconverted. An array, Variable or module the call binds
    lives in the trace and cannot leave it: refused by name."""
    originals = {p: n for p, n in nnx.iter_graph(original) if isinstance(n, nnx.Pytree)}
    for path, copy, old in before:
        for attr, value in vars(copy).items():
            if attr.startswith("_pytree__") or old.get(attr, _MISSING) is value:
                continue
            where = ".".join(map(str, path))
            trapped = isinstance(value, nnx.Variable) or nnx.graph.is_graph_node(value)
            if trapped or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
                raise ValueError(
                    f"fp8_linear_layers: the call of the {cls.__name__} {name!r} (converted "
                    f"for its {KERNEL!r}, run in a trace) binds attribute {attr!r} of "
                    f"{type(copy).__name__} {where or '(itself)'!r} to {type(value).__name__}, "
                    "which cannot leave the trace. Make it an nnx.Variable set in __init__ "
                    "(its value is written back), or exclude the module (Fp8Config exclude)."
                )
            if path in originals:
                setattr(originals[path], attr, value)


_MISSING = object()


def _fp8_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The original call, its GEMMs on the kernel answered by `self.fp8_dot`."""
    cls = original_class(self)
    dot = vars(self)[FP8_DOT]
    graphdef, own, state = nnx.split(self, _is_own_fp8_dot, ...)
    before: list = []

    def call(state: Any, *a: Any, **kw: Any) -> Any:
        # New variables for `own` too: the trace's own (an nnx.jit in the call writes back
        # into every variable of the module, which the caller's FP8 state's must not be).
        module = nnx.merge(graphdef, own, state, copy=True)
        # NNX objects among the arguments as copies made in the trace, which the call may
        # rebind attributes of (the originals, made outside it, refuse: TraceContextError).
        copies = {id(n): nnx.clone(n) for n in _nodes((a, kw))}
        a, kw = jax.tree.map(
            lambda x: copies.get(id(x), x), (a, kw), is_leaf=nnx.graph.is_graph_node
        )
        own_attributes = [x for x in _attributes(module) if x[0][:1] != (FP8_DOT,)]
        before[:] = [own_attributes, *(_attributes(n) for n in copies.values())]
        out = cls.__call__(module, *a, **kw)
        # And the variables of NNX objects among the arguments (an nnx.Rngs drawn from).
        return out, nnx.state(module, nnx.Not(_is_own_fp8_dot)), nnx.state((a, kw), nnx.Variable)

    traced = trace_call(call, (state, *args), kwargs)
    name = dot.name or ROOT
    for original, attributes in zip((self, *_nodes((args, kwargs))), before, strict=True):
        _write_back_attributes(cls, name, original, attributes)
    owners = [(KERNEL,) if _is_kernel(p) else None for p in traced.paths]
    operands = gemm_operands(traced.closed, owners)
    kernel_dots = {i for i, (_, rhs) in operands.items() if rhs == (KERNEL,)}
    if not kernel_dots:
        raise ValueError(
            f"fp8_linear_layers: the {cls.__name__} {name!r} holds a {KERNEL!r} parameter, so "
            "it was converted as a Linear, but no GEMM of its call takes that kernel as its "
            "right operand (lax.dot_general(x, kernel), x @ kernel, jnp.einsum(..., x, "
            "kernel)). Exclude it (Fp8Config exclude or targets)."
        )
    choice = KernelChoice(kernel_dots, lambda eqn: dot)
    out, new_state, new_arguments = traced.evaluate(Interpreter(choice))
    old, new = jax.tree.leaves(state), jax.tree.leaves(new_state)
    if any(a is not b for a, b in zip(old, new, strict=True)):
        nnx.update(self, new_state)  # what the call wrote into the module's variables
    if jax.tree.leaves(new_arguments):
        nnx.update((args, kwargs), new_arguments)  # and into its arguments' variables
    return out

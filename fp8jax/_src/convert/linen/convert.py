"""The Flax Linen adapter of model conversion: [`fp8jax.Fp8Linen`][], a Linen model whose
chosen `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers run as FP8 GEMMs, by
`nn.intercept_methods`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, final

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array

from ...core.errors import Fp8StateError, StateErrorWording, reword_state_error
from ...ops.dot_general import Fp8DotGeneral
from ..config import Fp8Config
from ..einsum import check_layer_einsum, einsum_kernel_shape, fp8_einsum
from ..plan import ConversionPlan, announce
from .generic import KERNEL, has_kernel, kernel_call
from .trace import linen_plan

#: The variable collection of FP8 state: Flax's own name for state whose gradient is its new
#: value (`flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT`).
COLLECTION: str = OVERWRITE_WITH_GRADIENT
#: The name of a converted layer's state variable, in the layer's scope.
VARIABLE: str = "fp8jax"


def _state_dict(op: Fp8DotGeneral) -> dict[str, Any]:
    """A layer's FP8 state for Flax's serialization (`flax.serialization.to_bytes`, which
    Linen checkpointing uses): its arrays by their paths in the module."""
    leaves = jax.tree_util.tree_flatten_with_path(op)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _from_state_dict(target: Fp8DotGeneral, state: dict[str, Any]) -> Fp8DotGeneral:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    keys = [jax.tree_util.keystr(path) for path, _ in leaves]
    if sorted(keys) != sorted(state):
        raise ValueError(
            f"Fp8DotGeneral {target.name!r}: the saved FP8 state has the entries "
            f"{sorted(state)}, the target's are {sorted(keys)}: restore into variables made "
            "with the same Fp8Config (recipe and telemetry)."
        )
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(state[k]) for k in keys])


flax.serialization.register_serialization_state(
    Fp8DotGeneral, _state_dict, _from_state_dict, override=True
)


def _kind(module: Any) -> str | None:
    # A Dense subclass with a `__call__` of its own may never call its `dot_general` (an
    # Einsum subclass's may call `jnp.einsum` on other operands than its kernel): it is
    # converted as any module multiplying by its `kernel` (`generic.py`), by tracing its call.
    call = type(module).__call__
    if isinstance(module, nn.Dense | nn.DenseGeneral):
        return "dense" if call in (nn.Dense.__call__, nn.DenseGeneral.__call__) else None
    if isinstance(module, nn.Einsum):
        return "einsum" if call is nn.Einsum.__call__ else None
    return None


def _normalizes_state(module: Any, method: str, args: Any) -> bool:
    """Whether a call is `nn.WeightNorm`'s or `nn.SpectralNorm`'s normalisation of one leaf
    (`(path, value)`, the path's first key its collection) of the FP8 state."""
    if not isinstance(module, nn.WeightNorm | nn.SpectralNorm) or len(args) < 2:
        return False
    if method not in ("_l2_normalize", "_spectral_normalize") or not args[0]:
        return False
    return getattr(args[0][0], "key", None) == COLLECTION


#: The Linen words of a state error of the Equinox layer (whose advice is Equinox's).
_LINEN_WORDING = StateErrorWording(
    unnamed="An FP8 Linen layer",
    reuse="a shared module, a loop",
    grad="jax.grad",
    combine="Differentiate with fp8jax.filter_value_and_grad",
    state=f"collection {COLLECTION!r}",
    differentiate=(
        ". Differentiate the whole variables, e.g. fp8jax.filter_value_and_grad(loss_fn)"
        "(variables), with loss_fn calling apply(variables, ...)."
    ),
)


def _kernel_shape(rhs: Any, dimension_numbers: Any) -> tuple[int, int] | None:
    """The `(N, K)` matrix of a kernel contracted along `dimension_numbers`' rhs axes;
    `None` for a kernel with batch axes (no single matrix)."""
    (_, contracting), (_, batch) = dimension_numbers
    if batch:
        return None
    shape = jnp.shape(rhs)
    contracted = math.prod(shape[d] for d in contracting)
    free = math.prod(d for i, d in enumerate(shape) if i not in contracting)
    return (free, contracted)


class _Einsum(threading.local):
    """`jnp.einsum` answered by an FP8 einsum on this thread while a chosen `nn.Einsum`
    runs (Linen's `Einsum` calls `jnp.einsum` itself, with no `dot_general` to pass)."""

    def __init__(self) -> None:
        self.handler: Callable[..., Array] | None = None


_einsum = _Einsum()
_patch_lock = threading.Lock()
_patch_depth = 0
_original_einsum = jnp.einsum


def _dispatching_einsum(subscripts: Any, *operands: Any, **kwargs: Any) -> Any:
    handler = _einsum.handler
    extra = set(kwargs) - {"precision", "preferred_element_type"}
    if handler is None or len(operands) != 2 or extra or not isinstance(subscripts, str):
        return _original_einsum(subscripts, *operands, **kwargs)
    return handler(subscripts, *operands, **kwargs)


@contextlib.contextmanager
def _einsum_answered_by(handler: Callable[..., Array]) -> Iterator[None]:
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            jnp.einsum = _dispatching_einsum
        _patch_depth += 1
    previous, _einsum.handler = _einsum.handler, handler
    try:
        yield
    finally:
        _einsum.handler = previous
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                jnp.einsum = _original_einsum


@dataclasses.dataclass
class Seen:
    """What one `init`/`apply` saw: every module with its path, the convertible layers and
    their output widths, the embeddings' row counts, the modules holding a kernel of their
    own, and the layers applied by a nested `.apply` (by name)."""

    root: Any = None
    modules: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)
    layers: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)
    widths: dict[tuple[str, ...], int | None] = dataclasses.field(default_factory=dict)
    embeddings: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    kernels: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)
    nested: dict[str, Any] = dataclasses.field(default_factory=dict)


def _width(module: Any) -> int | None:
    """A layer's number of outputs (its GEMM's `N`), read after its call."""
    if isinstance(module, nn.Dense | nn.DenseGeneral):
        features = module.features
        return math.prod(features) if isinstance(features, tuple | list) else features
    if not module.has_variable("params", "kernel"):
        return None
    shape = einsum_kernel_shape(
        module.einsum_str, jnp.shape(nn.unbox(module.get_variable("params", "kernel")))
    )
    return None if shape is None else shape[0]


def _state(module: Any, path: tuple[str, ...], config: Fp8Config, kernel: Any) -> Fp8DotGeneral:
    """The layer's FP8 state, its variable declared on first use (at `init`)."""
    name = ".".join(path)

    def init() -> Fp8DotGeneral:
        recipe = config.recipe_for(path)
        try:
            return Fp8DotGeneral(recipe, kernel, name, config.telemetry)
        except ValueError as e:
            if kernel is not None:
                raise
            raise ValueError(
                f"Fp8Linen: the layer {name!r} multiplies by a kernel with batch axes (one "
                f"matrix per batch entry), which has no single (out, in) matrix for the "
                f"kernel-shaped state of {type(recipe).__name__}. Give the layer another recipe "
                f"(Fp8Config recipes={{{name!r}: 'delayed'}}) or exclude it."
            ) from e

    try:
        return module.variable(COLLECTION, VARIABLE, init).value
    except flax.errors.ScopeCollectionNotFound as e:
        # A lifted transform that neither maps nor broadcasts the collection: nn.scan or
        # nn.vmap with only {"params": 0} in variable_axes, or nn.scan with
        # variable_broadcast="params".
        raise ValueError(
            f"Fp8Linen: the layer {name!r} has no place for its FP8 state: a lifted transform "
            f"around it (nn.scan, nn.vmap) does not carry the collection {COLLECTION!r}. Carry "
            "it as the parameters are: parameters with a layer axis, give it theirs, "
            f"variable_axes={{'params': 0, {COLLECTION!r}: 0}}; parameters shared by every "
            f"step, broadcast it too, variable_broadcast=['params', {COLLECTION!r}] (nn.vmap: "
            f"variable_axes={{'params': None, {COLLECTION!r}: None}}). Or exclude the layer "
            f"(Fp8Config exclude). Flax said: {e}"
        ) from None


def _call(dot: Fp8DotGeneral, name: str, *args: Any, **kwargs: Any) -> Array:
    try:
        return dot(*args, **kwargs)
    except Fp8StateError as e:
        raise reword_state_error(e, name, _LINEN_WORDING) from e


def _missing_state(path: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"Fp8Linen: the variables given hold no FP8 state for the layer {'.'.join(path)!r} "
        f"(collection {COLLECTION!r}). Pass the whole variables that Fp8Linen.init "
        "returned (not only variables['params']: init gives the collection, empty where "
        "it converted no layer), made with the same Fp8Config."
    )


def _interceptor(
    config: Fp8Config, seen: Seen, mode: str, chosen: frozenset = frozenset()
) -> Callable[..., Any]:
    """The interceptor of one `init` (`mode="init"`: FP8 for the `chosen` paths, their state
    declared), `apply` (`"apply"`: FP8 for the layers whose state the variables hold;
    `"apply-without-state"`: the variables hold none) or planning trace (`"plan"`: nothing
    in FP8, everything recorded in `seen`)."""

    def fp8(module: Any, path: tuple[str, ...]) -> bool:
        if mode == "init":
            return path in chosen
        if mode == "apply":
            return module.has_variable(COLLECTION, VARIABLE)
        if mode == "apply-without-state" and config.selects(path):
            raise _missing_state(path)
        return False

    def intercept(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if seen.root is None:
            seen.root = module.scope.root
        kind = _kind(module)
        root = module.scope.root
        if root != seen.root and not root.path:
            # A nested `.apply` on variables of its own (Hugging Face's tied head): no place
            # for FP8 state, so it runs as written. (A lifted transform's scopes, nn.scan's
            # or nn.remat's, have roots of their own too, but keep their path; a module in a
            # shared scope, `nn.share_scope`, called again gets a rewound copy of the root,
            # which Flax's `Scope.__eq__` finds equal: the same variables, the same layers.)
            if kind is not None and context.method_name == "__call__":
                seen.nested.setdefault(module.name or type(module).__name__, module)
            return next_fun(*args, **kwargs)
        path = tuple(str(p) for p in module.path)
        seen.modules.setdefault(path, module)
        if _normalizes_state(module, context.method_name, args):
            # `nn.WeightNorm` and `nn.SpectralNorm` map every collection of their layer
            # through their normalisation (`nn.map_variables`): FP8 state is not a weight.
            return jnp.asarray(args[1])
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if kind is None:
            if isinstance(module, nn.Embed):
                seen.embeddings[path] = module.num_embeddings
            if mode in ("init", "apply") and fp8(module, path):
                return _kernel_layer(module, path, config, next_fun, args, kwargs, mode)
            out = next_fun(*args, **kwargs)
            if mode == "plan" and has_kernel(module):
                seen.kernels.setdefault(path, module)
            return out
        seen.layers.setdefault(path, module)
        if not fp8(module, path):
            out = next_fun(*args, **kwargs)
            seen.widths.setdefault(path, _width(module))
            return out
        name = ".".join(path)
        if kind == "einsum":

            def einsum(subscripts: str, lhs: ArrayLike, rhs: ArrayLike, **kw: Any) -> Array:
                check_layer_einsum(f"nn.Einsum {name!r}", subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
                kernel = einsum_kernel_shape(subscripts, tuple(jnp.shape(rhs)))
                dot = _state(module, path, config, kernel)
                return fp8_einsum(
                    functools.partial(_call, dot, name),
                    subscripts,
                    lhs,
                    rhs,
                    kw.get("precision"),
                    kw.get("preferred_element_type"),
                )

            with _einsum_answered_by(einsum):
                out = next_fun(*args, **kwargs)
            seen.widths.setdefault(path, _width(module))
            return out
        # `dot_general=lax.dot_general`, Linen's default written out, is no dot_general of its own.
        written = module.dot_general
        if (written is not None and written is not jax.lax.dot_general) or module.dot_general_cls:
            own = module.dot_general_cls or written
            raise ValueError(
                f"Fp8Linen: the {type(module).__name__} at {name!r} has its own dot_general "
                f"({own!r}), which fp8jax would replace. Exclude it (Fp8Config targets or "
                "exclude), or build it without one."
            )

        # A layer computing in a narrower `dtype` than its kernel's hands the FP8 GEMM the
        # master uncast (`promote_all_but_kernel`), for it to quantize in one pass, and the
        # GEMM returns `dtype` (the kernel's gradient written in it, as a cast's would be).
        masters = module.dtype is not None and hasattr(module, "promote_dtype")

        def dot_general(
            lhs: ArrayLike,
            rhs: ArrayLike,
            dimension_numbers: Any,
            precision: Any = None,
            preferred_element_type: DTypeLike | None = None,
            out_sharding: Any = None,
        ) -> Array:
            dot = _state(module, path, config, _kernel_shape(rhs, dimension_numbers))
            if masters and preferred_element_type is None:
                preferred_element_type = module.dtype
            args = (lhs, rhs, dimension_numbers, precision, preferred_element_type)
            return _call(dot, name, *args, out_sharding=out_sharding)

        # A Linen module is a frozen dataclass: the FP8 dot_general (and the promotion that
        # leaves the kernel) are its fields for this call only, and restored after.
        promote = getattr(module, "promote_dtype", None)
        object.__setattr__(module, "dot_general", dot_general)
        if masters:
            object.__setattr__(module, "promote_dtype", promote_all_but_kernel(promote))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "dot_general", written)
            if masters:
                object.__setattr__(module, "promote_dtype", promote)
        seen.widths.setdefault(path, _width(module))
        return out

    return intercept


def promote_all_but_kernel(promote: Callable[..., Any]) -> Callable[..., Any]:
    """A Linen layer's `promote_dtype` (`promote(inputs, kernel, bias, dtype=..., ...)`)
    that leaves its second argument, the kernel, as it is. The promotion is given every
    argument, as a user's of Linen's documented signature needs; its cast kernel is
    unused (XLA drops the cast)."""

    def promote_but_kernel(inputs: Any, kernel: Any, *rest: Any, **kwargs: Any) -> list[Any]:
        promoted = promote(inputs, kernel, *rest, **kwargs)
        return [promoted[0], kernel, *promoted[2:]]

    return promote_but_kernel


def _kernel_layer(
    module: Any,
    path: tuple[str, ...],
    config: Fp8Config,
    next_fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    mode: str,
) -> Any:
    """A module that multiplies by its own `kernel` (not a Dense), its GEMMs on the kernel
    in FP8 (see `generic.py`); at `init` its parameters are made first."""
    if mode == "init":
        next_fun(*args, **kwargs)
    name = ".".join(path)
    # One state for every GEMM on the kernel in this call (declared once: a second
    # declaration in one call is a name in use), shared as a Dense called twice shares it.
    dots: list[Fp8DotGeneral] = []
    shapes: list[tuple[int, int] | None] = []
    layouts: list[Any] = []

    def make_op(eqn: Any, layout: Any) -> Callable[..., Array]:
        aval = eqn.invars[1].aval
        rhs = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        shapes.append(_kernel_shape(rhs, eqn.params["dimension_numbers"]))
        layouts.append(layout)
        if not dots:
            dots.append(_state(module, path, config, shapes[0]))
        # A square kernel multiplied both ways has one shape, its layouts (which of its axes
        # are contracted) tell the two apart; a layout hidden by a reshape is not compared.
        transposed = None not in (layouts[0], layout) and layout != layouts[0]
        both = shapes[-1] != shapes[0] or transposed
        if both and getattr(dots[0].kernel, "error", None) is not None:
            # The kernel multiplied both ways (`x @ kernel`, `h @ kernel.T`): error feedback
            # holds one residual, of the first GEMM's kernel.
            ways = "as its transpose" if shapes[-1] == shapes[0] else f"as a {shapes[-1]} matrix"
            raise ValueError(
                f"Fp8Linen: the layer {name!r} multiplies by its {KERNEL!r} as a {shapes[0]} "
                f"matrix (out, in) and {ways} in one call (a tied kernel used both "
                f"ways), but {type(config.recipe_for(path)).__name__} keeps one kernel-shaped "
                "state per layer (its error feedback), of the first's shape. Give the layer a "
                f"recipe without one (Fp8Config recipes={{{name!r}: 'delayed'}}) or exclude it "
                "(Fp8Config exclude)."
            )
        return functools.partial(_call, dots[0], name)

    return kernel_call(module, args, kwargs, make_op, COLLECTION)


@final
@dataclasses.dataclass(frozen=True)
class Fp8Linen:
    """A Flax Linen model whose chosen `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` layers
    run as fp8jax's FP8 GEMMs, its code unedited.

    Made by [`fp8jax.fp8_linear_layers`][] from an `nn.Module`. `init` and `apply` are the
    module's, run under `nn.intercept_methods`: each chosen layer gets an FP8 `dot_general`
    (an `Einsum`, an FP8 `jnp.einsum`) for its call, and its FP8 state (an
    [`fp8jax.Fp8DotGeneral`][]) lives in the variable `"fp8jax"` of collection
    `"_overwrite_with_gradient"` in the layer's scope. The parameters keep the unconverted
    model's paths, so its checkpoints load.

    Layers are chosen by their module path (`module.path`, e.g. `"Block_0.MlpBlock_0.Dense_1"`)
    as [`fp8jax.Fp8Config`][] chooses Linears: targets, `exclude`, per-layer `recipes`.
    `init` checks that every target and recipe pattern matched a layer the model ran.

    **Arguments:**

    - `module`: the Linen model.
    - `config`: the [`fp8jax.Fp8Config`][].

    ```python
    fp8_model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe="blockwise"))
    variables = fp8_model.init(jax.random.key(0), x)   # {"params", "_overwrite_with_gradient"}
    y = fp8_model.apply(variables, x)
    ```
    """

    module: nn.Module
    config: Fp8Config = Fp8Config()
    explain: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(
                f"Fp8Linen: module={type(self.module).__name__}: should be a flax.linen.Module."
            )
        if self.module.scope is not None:
            raise TypeError(
                f"Fp8Linen: module={type(self.module).__name__} is bound to variables; pass "
                "the unbound module (model, not model.bind(...))."
            )
        if not isinstance(self.config, Fp8Config):
            raise TypeError(f"Fp8Linen: config={self.config!r}: should be an fp8jax.Fp8Config.")
        if not isinstance(self.explain, bool):
            raise TypeError(f"Fp8Linen: explain={self.explain!r}: should be True or False.")

    def _run(
        self, mode: str, chosen: frozenset, fun: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        with nn.intercept_methods(_interceptor(self.config, Seen(), mode, chosen)):
            return fun(*args, **kwargs)

    def _plan(self, rngs: Any, args: tuple, kwargs: dict) -> tuple[ConversionPlan, frozenset]:
        def record() -> tuple[Seen, Callable[..., Any]]:
            seen = Seen()
            return seen, _interceptor(self.config, seen, "plan")

        return linen_plan(self.module, self.config, record, rngs, args, kwargs)

    def plan(self, rngs: Any, *args: Any, **kwargs: Any) -> ConversionPlan:
        """Which layers `init(rngs, *args, **kwargs)` converts and why the others stay in
        high precision (a [`fp8jax.ConversionPlan`][]; print it for a table), without
        initialising. Roles come from a trace of the model's `apply`."""
        return self._plan(rngs, args, kwargs)[0]

    def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """`module.init_with_output`, the chosen layers in FP8: `(output, variables)`, the
        variables holding the FP8 state. Traces the model first to choose the layers (see
        [`plan`][fp8jax.Fp8Linen.plan]); prints the plan with `explain=True`; warns when no
        layer is converted (the variables then hold the collection empty) and when an
        `exclude` of yours matches no layer. A `mutable` list
        of collections gets the FP8 state's added. Raises
        `ValueError` if a target or recipe pattern matches no layer that ran (the message
        lists those that did)."""
        plan, chosen = self._plan(rngs, args, kwargs)
        announce(plan, self.explain, "Flax Linen", stacklevel=3)
        mutable = kwargs.get("mutable")
        if isinstance(mutable, str):
            mutable = [mutable]
        if isinstance(mutable, list | tuple) and COLLECTION not in mutable:
            # Linen's `mutable` names the collections `init` makes: the FP8 state is one.
            kwargs = {**kwargs, "mutable": [*mutable, COLLECTION]}
        out, variables = self._run(
            "init", chosen, self.module.init_with_output, rngs, *args, **kwargs
        )
        if isinstance(variables, dict) and COLLECTION not in variables:
            # No layer converted: an empty collection tells `apply` these are init's whole
            # variables (run in high precision), not the parameters alone.
            variables = {**variables, COLLECTION: {}}
        return out, variables

    def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """`module.init`, the chosen layers in FP8: the variables, FP8 state included (see
        [`init_with_output`][fp8jax.Fp8Linen.init_with_output])."""
        return self.init_with_output(rngs, *args, **kwargs)[1]

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        """`module.apply(variables, *args, **kwargs)`, the layers whose FP8 state
        `variables` hold in FP8. `variables` are those `init` made (FP8 state included);
        every argument of Linen's `apply` (`rngs`, `mutable`, `method`) is accepted."""
        with_state = not isinstance(variables, Mapping) or COLLECTION in variables
        mode = "apply" if with_state else "apply-without-state"
        return self._run(mode, frozenset(), self.module.apply, variables, *args, **kwargs)

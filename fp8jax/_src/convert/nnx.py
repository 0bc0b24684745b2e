"""FP8 for Flax NNX: `nnx.Linear` and `nnx.Einsum` with an FP8 `dot_general`, and its state.

An NNX model holds its arrays in `nnx.Variable`s, mutated in place. The FP8 state of a
converted layer (scales and amax histories of its input, kernel and output gradient) lives in
variables of its own type, [`fp8jax.Fp8State`][], inside an [`fp8jax.Fp8NnxDotGeneral`][]
that becomes the layer's `dot_general` (the `einsum_op` of an `nnx.Einsum`). Because the type
is not `nnx.Param`, an `nnx.Optimizer(model, tx, wrt=nnx.Param)` never sees it: no weight
decay, clipping or moment estimate ever touches a scale.

The state is updated as in fp8jax's Equinox path, through the gradient: differentiate with
respect to `(nnx.Param, fp8jax.Fp8State)` and the "gradient" of each `Fp8State` is its new
value. [`fp8jax.nnx_update_fp8_state`][] writes it into the model; the optimizer updates the
Params from the same gradients. [`fp8jax.nnx_value_and_grad`][] differentiates with the state
viewed in a dtype whose cotangents combine by max, so a layer run several times in a step
keeps the largest amax, not their sum:

```python
model = fp8jax.fp8_linear_layers(model)             # an nnx.Module: a converted copy
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
fp8jax.nnx_update_fp8_state(model, grads)            # new scales and histories
optimizer.update(model, grads)                       # Params only (wrt=nnx.Param)
```

[`fp8jax.nnx_train_step`][] does all of it in one jitted step. Flax is imported only
when this module is: `import fp8jax` never imports it.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array

from ..core import jax_private
from ..core.compile_options import checked_compiler_options
from ..core.errors import Fp8StateError, StateNotDifferentiatedError, StateUsedTwiceError
from ..ops.dot_general import Fp8DotGeneral
from .transform import Fp8Config, _stacked_dot_general, choose_layers

M = TypeVar("M")


def _nnx_message(error: Fp8StateError, name: str) -> str:
    """The NNX version of a state error of the Equinox layer (whose advice is Equinox's)."""
    layer = f"FP8 layer {name!r}" if name else "An Fp8NnxDotGeneral"
    if isinstance(error, StateUsedTwiceError):
        return (
            f"{layer} runs twice in one differentiated step (a shared or reused layer, a loop) "
            "under nnx.grad / nnx.value_and_grad, which would add its two amaxes and scales "
            "instead of keeping the larger: JAX sums the gradients of a value used twice, and "
            "FP8 state leaves the step through its gradient. Use fp8jax.nnx_value_and_grad "
            "(or fp8jax.nnx_train_step), which combines the uses by max."
        )
    if isinstance(error, StateNotDifferentiatedError):
        return (
            f"{layer} is differentiated, but its FP8 state (fp8jax.Fp8State) is not: its new "
            "scales and amax history leave the step as the state's gradient, so they would "
            "stay as they are forever. Differentiate it along with the Params: "
            "fp8jax.nnx_value_and_grad(loss_fn), or nnx.grad(loss_fn, "
            "argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))."
        )
    return str(error)


class Fp8State(nnx.Variable):
    """The FP8 scaling state of a converted NNX layer: a scale, an amax history, telemetry.

    A variable type of its own, so that filters tell it from what is trained: an
    `nnx.Optimizer(model, tx, wrt=nnx.Param)` leaves it alone, and
    `nnx.state(model, fp8jax.Fp8State)` selects it (to checkpoint it, or inspect it). Its
    gradient is its new value; [`fp8jax.nnx_update_fp8_state`][] writes that back.
    """


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _check_stacked(stacked: Any) -> tuple[int, ...]:
    if not isinstance(stacked, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in stacked
    ):
        raise ValueError(
            f"Fp8NnxDotGeneral: stacked={stacked!r}: should be a tuple of ints >= 1, the "
            "leading shape of a stack of layers (e.g. (12,) for 12 layers built with "
            "nnx.vmap), or () for one layer."
        )
    return stacked


class Fp8NnxDotGeneral(nnx.Module):
    """`jax.lax.dot_general` as FP8 GEMMs, for Flax NNX: an [`fp8jax.Fp8DotGeneral`][]
    whose state lives in [`fp8jax.Fp8State`][] variables.

    Pass it as the `dot_general` of an `nnx.Linear` (or let
    [`fp8jax.fp8_linear_layers`][] do it). Each call rebuilds the `Fp8DotGeneral` from the
    variables' current values and calls it, so the numerics are exactly those of fp8jax's
    Equinox layers: FP8 operands, a `custom_vjp` whose residuals are the FP8 operands, the
    new state returned as the state's gradient.

    **Arguments:**

    - `recipe`, `kernel_shape`, `name`, `telemetry`: as for [`fp8jax.Fp8DotGeneral`][].
    - `stacked`: the leading shape of a stack of layers (an `nnx.Linear` built under
      `nnx.vmap` to be applied with `nnx.scan`, its kernel `(*stacked, in, out)`): one state
      per layer, stacked the same way. `()` for one layer.

    **Attributes:** `state`, the `Fp8DotGeneral` whose array leaves are `Fp8State`
    variables (its paths read `state.input.amax_history`, `state.kernel.scale`, ...).

    ```python
    layer = nnx.Linear(512, 512, dot_general=fp8jax.Fp8NnxDotGeneral(), rngs=nnx.Rngs(0))
    ```
    """

    def __init__(
        self,
        recipe: Any = None,
        kernel_shape: tuple[int, int] | None = None,
        name: str = "",
        telemetry: bool = False,
        *,
        stacked: tuple[int, ...] = (),
    ):
        stacked = _check_stacked(stacked)
        dot = Fp8DotGeneral(recipe, kernel_shape, name, telemetry)
        if stacked:
            dot = _stacked_dot_general(dot.recipe, stacked, kernel_shape, name, telemetry)
        self.state = nnx.data(jax.tree.map(Fp8State, dot))

    @property
    def recipe(self) -> Any:
        """The layer's scaling recipe."""
        return self.state.recipe

    @property
    def name(self) -> str:
        """The layer's path, as `fp8_linear_layers` set it."""
        return self.state.name

    def value(self) -> Fp8DotGeneral:
        """The `Fp8DotGeneral` holding the variables' current values (arrays)."""
        return jax.tree.map(lambda v: v.get_value(), self.state, is_leaf=_is_variable)

    def set_value(self, dot: Fp8DotGeneral) -> None:
        """Write the array leaves of `dot` (shaped like [`value`][fp8jax.Fp8NnxDotGeneral.value])
        into the variables."""
        if jax.tree.structure(dot) != jax.tree.structure(self.value()):
            raise ValueError(
                f"Fp8NnxDotGeneral.set_value: got a {type(dot).__name__} of structure "
                f"{jax.tree.structure(dot)}; pass one shaped like this layer's value() (the "
                "same recipe and telemetry setting)."
            )
        variables = jax.tree.leaves(self.state, is_leaf=_is_variable)
        for variable, new in zip(variables, jax.tree.leaves(dot), strict=True):
            variable.set_value(new)

    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        out_sharding: Any = None,
    ) -> Array:
        try:
            out = self.value()(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        except Fp8StateError as e:
            raise type(e)(_nnx_message(e, self.name), self.name) from e
        if out_sharding is not None:
            out = jax.sharding.reshard(out, out_sharding)
        return out


# --- nnx.Einsum --------------------------------------------------------------------------


def _einsum_parts(subscripts: str, x_ndim: int, k_ndim: int) -> tuple[str, str, str]:
    """The input, kernel and output subscripts of a two-operand einsum, `...` expanded."""
    spec = subscripts.replace(" ", "")
    if spec.count("->") != 1 or spec.count(",") != 1:
        raise ValueError(
            f"Fp8NnxEinsum: subscripts={subscripts!r}: should be an explicit two-operand "
            "equation 'input,kernel->output', e.g. 'btd,dhk->bthk'."
        )
    operands, out = spec.split("->")
    x, k = operands.split(",")
    if "..." in k:
        raise ValueError(
            f"Fp8NnxEinsum: subscripts={subscripts!r}: the kernel's subscripts {k!r} may not "
            "hold '...'; name each kernel axis."
        )
    if "..." in x:
        unused = [c for c in string.ascii_letters if c not in spec]
        n = x_ndim - (len(x) - 3)
        if n < 0 or "..." in x.replace("...", "", 1):
            raise ValueError(
                f"Fp8NnxEinsum: subscripts={subscripts!r} does not fit an input of {x_ndim} axes."
            )
        fill = "".join(unused[:n])
        x, out = x.replace("...", fill), out.replace("...", fill)
    for name, letters, ndim in (("input", x, x_ndim), ("kernel", k, k_ndim)):
        if len(letters) != ndim or not letters.isalpha():
            raise ValueError(
                f"Fp8NnxEinsum: subscripts={subscripts!r} gives the {name} {len(letters)} axes "
                f"({letters!r}), but it has {ndim}."
            )
    for name, letters in (("input", x), ("kernel", k), ("output", out)):
        if len(set(letters)) != len(letters):
            raise ValueError(
                f"Fp8NnxEinsum: subscripts={subscripts!r} repeats an axis of the {name} "
                f"({letters!r}); FP8 einsums take each name once per operand."
            )
    for c in x + k:
        if c not in out and (c not in x or c not in k):
            raise ValueError(
                f"Fp8NnxEinsum: subscripts={subscripts!r} sums axis {c!r} of one operand "
                "only; FP8 einsums contract axes of both operands (sum it before the layer)."
            )
    if not set(out) <= set(x + k):
        raise ValueError(
            f"Fp8NnxEinsum: subscripts={subscripts!r}: output {out!r} names an axis of neither "
            "operand."
        )
    return x, k, out


def einsum_dimension_numbers(
    subscripts: str, x_ndim: int, k_ndim: int
) -> tuple[Any, tuple[int, ...]]:
    """`lax.dot_general` dimension numbers for the einsum `input,kernel->output`, and the
    permutation taking the `dot_general` result (batch, input's free, kernel's free axes) to
    the output's order."""
    x, k, out = _einsum_parts(subscripts, x_ndim, k_ndim)
    contract = [c for c in x if c in k and c not in out]
    batch = [c for c in out if c in x and c in k]
    dims = (
        (tuple(x.index(c) for c in contract), tuple(k.index(c) for c in contract)),
        (tuple(x.index(c) for c in batch), tuple(k.index(c) for c in batch)),
    )
    result = batch + [c for c in x if c not in k] + [c for c in k if c not in x]
    return dims, tuple(result.index(c) for c in out)


def _einsum_kernel_shape(subscripts: str | None, kernel_shape: tuple[int, ...]) -> Any:
    """The canonical `(N, K)` matrix of an einsum's kernel (free axes, contracted axes), or
    `None` when the equation is given only at call time or the kernel has batch axes."""
    if subscripts is None:
        return None
    spec = subscripts.replace(" ", "")
    x_spec = spec.split("->")[0].split(",")[0]
    x_ndim = len(x_spec.replace("...", ""))
    try:
        x, k, out = _einsum_parts(spec, x_ndim, len(kernel_shape))
    except ValueError:
        return None  # reported when the layer runs
    if any(c in x and c in out for c in k):
        return None
    free = math.prod(d for c, d in zip(k, kernel_shape, strict=True) if c not in x)
    contracted = math.prod(d for c, d in zip(k, kernel_shape, strict=True) if c in x)
    return (free, contracted)


class Fp8NnxEinsum(Fp8NnxDotGeneral):
    """An [`fp8jax.Fp8NnxDotGeneral`][] with the call of `jnp.einsum`, for the `einsum_op`
    of an `nnx.Einsum`.

    The equation must have two operands, the input then the kernel, each axis named once
    per operand, every axis of one operand only kept in the output (no implicit sums).
    Contracted axes go into the FP8 GEMM's contraction, axes of both operands kept in the
    output into its batch, and the result is transposed to the output's order. Unlike
    `jnp.einsum(..., _dot_general=...)`, which may swap the operands, the kernel always
    takes the kernel's role (its recipe's format, block shape and state).
    """

    def __call__(
        self,
        subscripts: str,
        lhs: ArrayLike,
        rhs: ArrayLike,
        *,
        precision: Any = None,
        preferred_element_type: DTypeLike | None = None,
        out_sharding: Any = None,
    ) -> Array:
        if not isinstance(subscripts, str):
            raise TypeError(f"Fp8NnxEinsum: subscripts={subscripts!r} should be a str.")
        dims, perm = einsum_dimension_numbers(subscripts, jnp.ndim(lhs), jnp.ndim(rhs))
        out = super().__call__(lhs, rhs, dims, precision, preferred_element_type)
        out = jnp.transpose(out, perm)
        if out_sharding is not None:
            out = jax.sharding.reshard(out, out_sharding)
        return out


# --- conversion ---------------------------------------------------------------------------


def _kind(node: Any) -> str | None:
    if isinstance(node, nnx.Linear):
        return "linear"
    if isinstance(node, nnx.Einsum):
        return "einsum"
    return None


def _is_fp8(node: Any) -> bool:
    return isinstance(getattr(node, "dot_general", None), Fp8NnxDotGeneral) or isinstance(
        getattr(node, "einsum_op", None), Fp8NnxEinsum
    )


def _graph_nodes(model: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every node of an NNX graph with its dotted-path parts, outside layers and NNX's own
    bookkeeping attributes, each shared node once (under its first path)."""
    nodes = []
    for path, node in nnx.iter_graph(model, graph=True):
        parts = tuple(str(p) for p in path)
        if any(p.startswith(("_pytree__", "_object__")) for p in parts):
            continue
        nodes.append((parts, node))
    nodes.sort(key=lambda item: item[0])
    layers = [p for p, n in nodes if _kind(n) is not None]
    return [
        (p, n)
        for p, n in nodes
        if not any(len(p) > len(lp) and p[: len(lp)] == lp for lp in layers)
    ]


def _fp8_layer(path: tuple[str, ...], layer: Any, config: Fp8Config) -> Fp8NnxDotGeneral:
    recipe = config.recipe_for(path)
    name = ".".join(path)
    kernel = layer.kernel.get_value()
    if _kind(layer) == "linear":
        # nnx.Linear's kernel is (*stacked, in, out); the canonical matrix is (out, in).
        stacked, shape = tuple(kernel.shape[:-2]), (kernel.shape[-1], kernel.shape[-2])
        return Fp8NnxDotGeneral(recipe, shape, name, config.telemetry, stacked=stacked)
    shape = _einsum_kernel_shape(layer.einsum_str, tuple(kernel.shape))
    try:
        return Fp8NnxEinsum(recipe, shape, name, config.telemetry)
    except ValueError as e:
        raise ValueError(
            f"fp8_linear_layers: nnx.Einsum {name!r} ({layer.einsum_str!r}, kernel "
            f"{tuple(kernel.shape)}): {e} Its kernel has batch axes, so it has no single "
            "(out, in) matrix for that state: convert it with another recipe, or exclude it."
        ) from None


def fp8_nnx_linear_layers(model: M, config: Fp8Config | None = None) -> M:
    """The NNX branch of [`fp8jax.fp8_linear_layers`][]: a copy of `model` whose chosen
    `nnx.Linear`s get an [`fp8jax.Fp8NnxDotGeneral`][] as `dot_general`, and whose chosen
    `nnx.Einsum`s an [`fp8jax.Fp8NnxEinsum`][] as `einsum_op`."""
    config = Fp8Config() if config is None else config
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"fp8_linear_layers: model={type(model).__name__}: the NNX path converts an nnx.Module."
        )
    # New variables, the same arrays: the caller's model is kept.
    model = nnx.clone(model, graph=True)
    nodes = _graph_nodes(model)
    layers = [(p, n) for p, n in nodes if _kind(n) is not None]
    chosen = choose_layers(config, nodes, layers, lambda n: isinstance(n, nnx.Module))
    for path, layer in layers:
        if path not in chosen or _is_fp8(layer):
            continue
        dot = _fp8_layer(path, layer, config)
        if _kind(layer) == "linear":
            layer.dot_general = nnx.data(dot)
        else:
            layer.einsum_op = nnx.data(dot)
    return model


# --- gradients and updates ----------------------------------------------------------------


def _fp8_variables(tree: Any) -> list[Fp8State]:
    return [node for _, node in nnx.iter_graph(tree, graph=True) if isinstance(node, Fp8State)]


def nnx_value_and_grad(
    fun: Callable[..., Any], *, wrt: Any = nnx.Param, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`nnx.value_and_grad` for FP8 NNX models: differentiates the first argument's `wrt`
    variables and its [`fp8jax.Fp8State`][], whose uses combine by max.

    The gradient is an `nnx.State` holding the `wrt` gradients and, for each `Fp8State`, its
    new value. Pass it to [`fp8jax.nnx_update_fp8_state`][] and to `optimizer.update` (an
    `nnx.Optimizer` with the same `wrt` ignores the `Fp8State`).

    Plain `nnx.value_and_grad(fun, argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))`
    gives the same result when each FP8 layer runs once per step. When one runs several
    times (a shared layer, a loop, `nnx.scan` over microbatches), JAX would add the
    cotangents of its state, that is, add amaxes; this function views the state in a
    float32 dtype whose cotangents combine by `max` for the duration of `fun` (so the
    history gets the largest amax), and restores it after. Plain `nnx.value_and_grad` raises
    for a layer called twice in one trace, and adds silently across `nnx.scan` iterations.

    `fun` is traced under `nnx.jit` (the max-combining dtype exists only in traced code);
    inside your own `nnx.jit`ted step that costs nothing.

    **Arguments:**

    - `fun`: `fun(model, *args, **kwargs)`, returning a scalar loss (or `(loss, aux)` with
      `has_aux=True`).
    - `wrt`: an NNX filter for the trained variables; `nnx.Param` by default.
    - `has_aux`: as for `nnx.value_and_grad`.

    ```python
    loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
    ```
    """
    if not callable(fun):
        raise TypeError(f"nnx_value_and_grad: fun={fun!r} is not callable.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"nnx_value_and_grad: has_aux={has_aux!r} should be True or False.")

    @functools.wraps(fun)
    def with_max_state(model: Any, *args: Any, **kwargs: Any) -> Any:
        variables = _fp8_variables(model)
        originals = [v.get_value() for v in variables]
        for variable, value in zip(variables, originals, strict=True):
            variable.set_value(jax.tree.map(jax_private.to_max_combining, value))
        try:
            return fun(model, *args, **kwargs)
        finally:
            for variable, value in zip(variables, originals, strict=True):
                variable.set_value(value)

    value_and_grad = nnx.value_and_grad(
        with_max_state,
        argnums=nnx.DiffState(0, (wrt, Fp8State)),
        has_aux=has_aux,
        graph=True,  # DiffState needs graph mode; the user's own code runs in theirs
        graph_updates=True,
    )
    jitted = nnx.jit(value_and_grad, graph=True, graph_updates=True)

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not args:
            raise TypeError("nnx_value_and_grad: call it with the model as first argument.")
        if jax_private.tracing():
            return value_and_grad(*args, **kwargs)
        return jitted(*args, **kwargs)

    return run


def _sub_state(grads: Any, path: tuple[Any, ...]) -> Any:
    node = grads
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def nnx_update_fp8_state(model: Any, grads: Any) -> None:
    """Write the new FP8 state the gradients carry into `model`, in place.

    For each [`fp8jax.Fp8NnxDotGeneral`][] of `model`, takes the value its
    [`fp8jax.Fp8State`][] variables received as gradient, where it is a real update (as
    [`fp8jax.Fp8DotGeneral.merge`][] decides: a layer that did not run, or whose output got
    no gradient, keeps its state; so does one whose operand held an inf or NaN).

    **Arguments:**

    - `model`: the NNX model, as differentiated.
    - `grads`: its gradients, from [`fp8jax.nnx_value_and_grad`][] or from
      `nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))`.

    Raises `ValueError` if `grads` holds no `Fp8State` for a layer (the gradient was not
    taken with respect to it).

    ```python
    loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
    fp8jax.nnx_update_fp8_state(model, grads)
    optimizer.update(model, grads)
    ```
    """
    layers = sorted(
        ((p, n) for p, n in nnx.iter_graph(model, graph=True) if isinstance(n, Fp8NnxDotGeneral)),
        key=lambda item: tuple(map(str, item[0])),
    )
    if not layers:
        raise ValueError(
            f"nnx_update_fp8_state: the {type(model).__name__} given has no FP8 layer; "
            "convert it with fp8jax.fp8_linear_layers first."
        )
    for path, layer in layers:
        received = _sub_state(grads, (*path, "state"))
        if received is None or not any(
            isinstance(v, Fp8State) for v in jax.tree.leaves(received, is_leaf=_is_variable)
        ):
            where = layer.name or ".".join(str(p) for p in path)
            raise ValueError(
                f"nnx_update_fp8_state: the gradients hold no Fp8State for the FP8 layer at "
                f"{where!r}. Differentiate with fp8jax.nnx_value_and_grad, or with "
                "nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State))), and "
                "pass its gradients unfiltered."
            )
        new = nnx.clone(layer, graph=True)
        nnx.update(new, nnx.State({"state": received}))
        layer.set_value(layer.value().merge(new.value()))


def _check_optimizer(model: Any, optimizer: Any) -> None:
    tracked = jax.tree.leaves(
        nnx.state(model, nnx.All(optimizer.wrt, Fp8State), graph=True), is_leaf=_is_variable
    )
    if tracked:
        raise ValueError(
            f"nnx_train_step: the optimizer's wrt={optimizer.wrt!r} selects fp8jax.Fp8State "
            "variables; FP8 state is set from the gradient, never by the optimizer. Build "
            "it with wrt=nnx.Param (or a filter that excludes fp8jax.Fp8State)."
        )


def nnx_train_step(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """A jitted NNX train step for an FP8 model: gradients, FP8 state, optimizer.

    `step(model, optimizer, *args, **kwargs)` differentiates `loss_fn(model, *args,
    **kwargs)` with [`fp8jax.nnx_value_and_grad`][] (with respect to `optimizer.wrt` and the
    FP8 state), writes the new FP8 state into `model` ([`fp8jax.nnx_update_fp8_state`][]),
    updates the Params with `optimizer.update(model, grads)`, and returns the loss (or
    `(loss, aux)` with `has_aux=True`). `model` and `optimizer` are updated in place, as
    NNX does; so are variables of NNX objects among the arguments. Arrays among the
    arguments are traced, other values are static (a new value recompiles).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *args, **kwargs)`, a scalar.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
    - `compiler_options`: XLA options of the step's executable. `None` (the default) means
      [`fp8jax.gpu_compiler_options`][]: on GPUs every FP8 GEMM is a cuBLASLt FP8 call. `{}`
      compiles with XLA's defaults. A step called inside your own `jax.jit` / `nnx.jit` is
      part of your executable, which has your options.

    Raises `ValueError` if the optimizer tracks `Fp8State` (its `wrt` must exclude it).

    ```python
    model = fp8jax.fp8_linear_layers(model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(loss_fn)
    for x, y in batches:
        loss = step(model, optimizer, x, y)
    fp8jax.assert_all_fp8(step, model, optimizer, x, y)  # every FP8 GEMM, on an H100 compile
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"nnx_train_step: loss_fn={loss_fn!r} is not callable.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"nnx_train_step: has_aux={has_aux!r} should be True or False.")
    compiler_options = checked_compiler_options("nnx_train_step", compiler_options)

    def pure(graphdef: Any, state: Any) -> tuple[Any, Any]:
        objects = nnx.merge(graphdef, state)
        model, optimizer, args, kwargs = objects
        _check_optimizer(model, optimizer)
        grad_fn = nnx_value_and_grad(loss_fn, wrt=optimizer.wrt, has_aux=has_aux)
        value, grads = grad_fn(model, *args, **kwargs)
        nnx_update_fp8_state(model, grads)
        optimizer.update(model, grads)
        return value, nnx.state(objects, nnx.Variable, graph=True)

    # jit's compiler options belong to a top-level executable: inside another trace, the plain
    # version joins the caller's.
    inner = jax.jit(pure, static_argnums=0)
    top = jax.jit(pure, static_argnums=0, compiler_options=compiler_options or None)

    @functools.wraps(loss_fn)
    def step(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"nnx_train_step: optimizer={type(optimizer).__name__}: should be an "
                "nnx.Optimizer, e.g. nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)."
            )
        objects = (model, optimizer, args, kwargs)
        graphdef, state = nnx.split(objects, graph=True)
        value, new_state = (inner if jax_private.tracing() else top)(graphdef, state)
        nnx.update(objects, new_state)
        return value

    return step

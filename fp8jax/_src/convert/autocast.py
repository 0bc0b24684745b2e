"""`fp8_autocast`: FP8 for any JAX function, by reinterpreting its jaxpr.

A model that is neither Equinox, Haliax nor Flax (plain JAX, or a framework fp8jax does not
know) has no layers to convert. Its GEMMs are still `dot_general`s in its jaxpr, however they
were written (`x @ w`, `jnp.einsum`, `jnp.dot`, a library's layer). `fp8_autocast` traces
the function at each call (once per call signature inside your `jit`, which caches the
result), then evaluates its jaxpr again, equation by equation,
answering each chosen `dot_general` (and `ragged_dot`) with fp8jax's FP8 GEMM and binding
every other equation as JAX would. The FP8 GEMM is a `custom_vjp`, so gradients of the
result run dgrad and wgrad in FP8 too.

Called outside `jit`, nothing is cached: a trace reused across calls would give back a
stale program where the function reads what it is not passed (a closure or global
rebound), as `jax.jit` does, so reusing one is the caller's choice, a `jit`. The trace is
the small part; the rest is eager JAX running the program op by op, each FP8 GEMM's
quantization included, as an eager `Fp8DotGeneral` does (`benchmarks/eager_cost.py`).

Why the jaxpr, and not patching `jax.lax.dot_general` while the function is traced? JAX's
own functions (`jnp.matmul`, `jnp.einsum`) are jitted and cached: a cached trace never calls
the patched function again. The jaxpr holds every GEMM whatever produced it.

Only recipes that keep no state between steps can work this way: the transformed function
is a pure function of its arguments, with nowhere to keep an amax history.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import jax_private
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot
from ..recipes import RECIPES, BlockScaledRecipe, PerTensorRecipe, Recipe, recipe_from
from .config import Fp8Config
from .interpret import Interpreter, gemm_equations
from .plan import Fp8ConversionWarning


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _check_pattern(name: str, pattern: Any) -> re.Pattern | None:
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(
            f"fp8_autocast: {name}={pattern!r}: should be None or a regular expression (a str) "
            "matched against a GEMM's name scopes, e.g. r'.*mlp.*'."
        )
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"fp8_autocast: {name}={pattern!r} is not a valid regex: {e}.") from None


@dataclasses.dataclass(frozen=True)
class _Choice:
    """Which `dot_general`s become FP8 GEMMs."""

    recipe: Recipe
    scopes: re.Pattern | None
    exclude: re.Pattern | None
    batched: bool
    min_dim: int
    #: The scopes of the GEMMs this choice was asked about, in order (one list per call).
    asked: list = dataclasses.field(default_factory=list, compare=False)
    #: How many floating GEMMs it left for their shape: "batched", "small" (one call's).
    shapes_left: dict = dataclasses.field(default_factory=dict, compare=False)
    #: The GEMMs it converted (one call's).
    picked: list = dataclasses.field(default_factory=list, compare=False)
    #: The scopes of every floating GEMM it saw, whatever their shape (one call's).
    seen: list = dataclasses.field(default_factory=list, compare=False)
    #: The names it gave the GEMMs it converted (one call's).
    named: set = dataclasses.field(default_factory=set, compare=False)

    def name(self, scope: str, kind: str) -> str:
        """A converted GEMM's name: its scope (for one outside any scope, `kind`), numbered in
        program order after the first of that name (`mlp`, `mlp_1`; `dot_general`,
        `dot_general_1`, ...), so that each GEMM has its own."""
        base = found = scope or kind
        n = 0
        while found in self.named:
            n += 1
            found = f"{base}_{n}"
        self.named.add(found)
        return found

    def picks_scope(self, scope: str) -> bool:
        self.asked.append(scope)
        if self.scopes is not None and self.scopes.fullmatch(scope) is None:
            return False
        return self.exclude is None or self.exclude.fullmatch(scope) is None

    def _left(self, why: str) -> bool:
        self.shapes_left[why] = self.shapes_left.get(why, 0) + 1
        return False

    def picks_dot(self, eqn: Any, scope: str) -> bool:
        lhs, rhs = (v.aval for v in eqn.invars[:2])
        if not _floating_gemm(eqn):
            return False
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        self.seen.append(scope)
        if lb and not self.batched:
            return self._left("batched")
        k = math.prod(lhs.shape[d] for d in lc)
        m = math.prod(d for i, d in enumerate(lhs.shape) if i not in (*lc, *lb))
        n = math.prod(d for i, d in enumerate(rhs.shape) if i not in (*rc, *rb))
        if min(m, n, k) < self.min_dim:
            return self._left("small")
        return self.picks_scope(scope)

    def dot_op(self, eqn: Any, scope: str) -> Callable[..., Any] | None:
        """The FP8 GEMM that answers this `dot_general`, or `None` to keep it."""
        if not self.picks_dot(eqn, scope):
            return None
        self.picked.append(scope)
        return Fp8DotGeneral(self.recipe, name=self.name(scope, "dot_general"))

    def held(self, subs: list) -> None:
        """Count the floating GEMMs in `subs`, the jaxprs of an equation bound as traced (a
        `custom_jvp`'s or `custom_vjp`'s, `shard_map`'s): none is converted."""
        n = sum(_floating_gemm(eqn) for eqn in gemm_equations(subs))
        if n:
            self.shapes_left["held"] = self.shapes_left.get("held", 0) + n

    def ragged_op(self, eqn: Any, scope: str) -> Callable[..., Any] | None:
        """The FP8 grouped GEMM that answers this `ragged_dot_general`, or `None`."""
        if not self.picks_ragged(eqn, scope):
            return None
        rhs = eqn.invars[1].aval
        self.picked.append(scope)
        name = self.name(scope, "ragged_dot")
        return Fp8RaggedDot(self.recipe, num_experts=rhs.shape[0], name=name)

    def picks_ragged(self, eqn: Any, scope: str) -> bool:
        lhs, rhs = (v.aval for v in eqn.invars[:2])
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        plain = (
            lhs.ndim == 2
            and rhs.ndim == 3
            and numbers.dot_dimension_numbers == (((1,), (1,)), ((), ()))
            and tuple(numbers.lhs_ragged_dimensions) == (0,)
            and tuple(numbers.rhs_group_dimensions) == (0,)
            and eqn.params.get("group_offset") is None
        )
        floats = _floating_gemm(eqn)
        if plain and floats:
            self.seen.append(scope)
        if plain and floats and min(*lhs.shape, rhs.shape[2]) < self.min_dim:
            return self._left("small")
        if not (plain and floats and self.picks_scope(scope)):
            return False
        if not isinstance(self.recipe, PerTensorRecipe | BlockScaledRecipe):  # Fp8RaggedDot's
            self._left("recipe")  # said here, not again
            warnings.warn(
                f"fp8_autocast: the ragged_dot {scope or '(no scope)'!r} stays in high "
                f"precision: {type(self.recipe).__name__} has no grouped GEMM (delayed, "
                "current, blockwise and MXFP8 scaling have one); exclude its scope to keep it "
                "so without this warning.",
                Fp8ConversionWarning,
                stacklevel=2,
            )
            return False
        return True


def _floating_gemm(eqn: Any) -> bool:
    """Whether a GEMM equation (of `gemm_equations`) has floating operands and result (16
    bits or more: `preferred_element_type` may ask floats for integers or FP8, which the FP8
    GEMM does not write) and, a `dot_general`'s, a contraction."""
    contracts = eqn.primitive.name != "dot_general" or bool(eqn.params["dimension_numbers"][0][0])
    values = (*eqn.invars[:2], eqn.outvars[0])
    return contracts and all(_high_precision_float(v.aval.dtype) for v in values)


def _high_precision_float(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2


def _stateless_names() -> str:
    """The registry's recipe names whose default recipe keeps no state, quoted."""
    return ", ".join(repr(n) for n, kind in RECIPES.items() if not kind().reads_state)


def fp8_autocast(
    fun: Callable[..., Any],
    recipe: Recipe | str = "current",
    *,
    scopes: str | None = None,
    exclude: str | None = None,
    batched: bool = False,
    min_dim: int = 16,
) -> Callable[..., Any]:
    r"""`fun` with its GEMMs computed as fp8jax's FP8 GEMMs: FP8 for any JAX function.

    Every floating `dot_general` traced inside `fun` (however it was written: `x @ w`,
    `jnp.einsum`, `jnp.dot`, a library's layer; under `jit`, `scan`, `while_loop`, `cond`,
    `checkpoint`) that the selection below picks runs as an [`fp8jax.Fp8DotGeneral`][] of
    `recipe`, and every `lax.ragged_dot` as an [`fp8jax.Fp8RaggedDot`][] (the recipes with a
    grouped GEMM: a residual recipe's warn and stay in high precision): FP8 operands, and
    under differentiation FP8 dgrad and wgrad. Nothing else changes. The GEMMs are named by
    their name scopes (`jax.named_scope`), which [`fp8jax.inspect`][fp8jax.observe.inspect]
    reports; those outside any scope are numbered in program order (`dot_general`,
    `dot_general_1`, ...; `ragged_dot`, `ragged_dot_1`, ...), and so are a scope's GEMMs
    after its first (`mlp`, `mlp_1`, ...): each GEMM has a name of its own.

    **Arguments:**

    - `fun`: any function of arrays (other arguments, such as flags, are static; so are
      other values it returns, such as an Equinox module's functions; one JAX cannot
      flatten that holds the function's arrays, a plain class's instance, is refused).
    - `recipe`: a recipe that keeps no state between steps: `"current"` (the default),
      `"blockwise"`, `"mxfp8"`, `"residual"` (without error feedback), or an instance.
      Delayed scaling is refused: its amax history must live somewhere between steps, which
      a function transform does not have; convert the model's layers instead
      ([`fp8jax.fp8_linear_layers`][]).
    - `scopes`: a regex that a GEMM's name scopes, joined by `/` (e.g. `"block0/mlp/bd,df->bf"`:
      `jnp.einsum` adds its equation), must match whole; `None` for every scope.
    - `exclude`: a regex of scopes to keep in high precision, matched whole as `scopes` is
      (the head: `r".*head.*"`; `"head"` alone misses `"lm/head"`).
    - `batched`: also convert GEMMs with batch dimensions (attention's scores and mixing,
      per-expert einsums). Off by default: a layer's GEMM contracts activations with a weight,
      which has no batch dimension.
    - `min_dim`: convert only GEMMs whose rows, columns and contraction are all at least this
      long (tiny GEMMs gain nothing from FP8; a `ragged_dot`'s rows: all its groups').

    What it cannot reach: GEMMs inside `custom_jvp`/`custom_vjp` functions and `shard_map`
    (their own rules would not match: autocast the function `shard_map` maps instead),
    GEMMs of integer or FP8 operands or results. Autocast
    the loss and differentiate the result: a function that differentiates inside (a whole
    train step) has its backward GEMMs traced as forward ones, cast to E4M3 like them, not
    E5M2.

    Raises where `fun` writes a new array into an argument in place and does not return it
    (a Flax NNX model's `BatchNorm` statistics): it runs on copies, as under `jax.jit`.

    Called outside `jit`, it traces `fun` and runs the result op by op at every call, as eager
    JAX runs (nothing cached, so a closure value changed between calls is seen): `jax.jit`
    the autocast function for speed.

    Warns (`fp8jax.Fp8ConversionWarning`) when `scopes` or `exclude` matches none of the
    GEMMs' scopes, and when it converts no GEMM of the call at all (each reason counted:
    under `jax.vmap`, a function of one example has GEMMs of one row, below `min_dim`).

    ```python
    loss_fn = fp8jax.fp8_autocast(loss_fn, "blockwise", exclude=r".*head.*")
    grads = jax.grad(loss_fn)(params, batch)  # forward, dgrad and wgrad in FP8
    ```
    """
    if not callable(fun):
        raise TypeError(f"fp8_autocast: fun={fun!r} is not callable.")
    if recipe is None:
        raise ValueError(
            "fp8_autocast: recipe=None: give a recipe that keeps no state, or its name: "
            f"{_stateless_names()} ('current' is the default)."
        )
    if isinstance(recipe, Fp8Config):
        raise TypeError(
            f"fp8_autocast: recipe={recipe!r} is an Fp8Config, which configures "
            "fp8_linear_layers; fp8_autocast takes its recipe (recipe=config.recipe) and "
            "selects GEMMs with its own scopes=, exclude= and min_dim=."
        )
    try:
        recipe = recipe_from(recipe)
    except ValueError as e:
        raise ValueError(
            f"fp8_autocast: {e} (fp8_autocast takes those that keep no state: "
            f"{_stateless_names()}, or an instance.)"
        ) from None
    if recipe.reads_state:
        raise ValueError(
            f"fp8_autocast: recipe={recipe!r} keeps FP8 state between steps (an amax history, "
            "or error feedback), and a function transform has nowhere to keep it. Use a recipe "
            f"that keeps none ({_stateless_names()}), or convert the model's layers, "
            "whose state lives in the model: fp8jax.fp8_linear_layers (Equinox, Haliax, Flax)."
        )
    if isinstance(batched, np.bool_):  # the bool it holds, as Fp8Config takes it
        batched = bool(batched)
    if not isinstance(batched, bool):
        raise TypeError(f"fp8_autocast: batched={batched!r} should be True or False.")
    if isinstance(min_dim, bool) or not isinstance(min_dim, int | np.integer) or min_dim < 1:
        raise ValueError(f"fp8_autocast: min_dim={min_dim!r} should be an int >= 1.")
    min_dim = int(min_dim)
    choice = _Choice(
        recipe,
        _check_pattern("scopes", scopes),
        _check_pattern("exclude", exclude),
        batched,
        min_dim,
    )

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Any:
        traced = trace_call(_refusing_writes(fun), args, kwargs)
        call = dataclasses.replace(
            choice, asked=[], shapes_left={}, picked=[], seen=[], named=set()
        )
        out = traced.evaluate(Interpreter(call))
        _warn_if_unmatched(call, scopes, exclude)
        return out

    return run


def _refusing_writes(fun: Callable[..., Any]) -> Callable[..., Any]:
    """`fun`, raising where it wrote a new array into one of its arguments (a Flax NNX
    module's `BatchNorm` statistics or a variable it adds, an `nnx.Rngs` drawn from, a
    dict's entry) and did not return it: the trace writes into copies of the arguments, so
    the caller's would silently keep their old values (even under `nnx.jit`, which writes
    back what its call wrote). Arrays only taken away (a dict popped from) are no loss."""

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        given = {id(v) for v in jax.tree.leaves((args, kwargs))}
        out = fun(*args, **kwargs)
        given |= {id(v) for v in jax.tree.leaves(out)}  # nnx.state(model) returned: kept
        for path, new in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            if _is_array(new) and id(new) not in given:
                where = ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])
                raise ValueError(
                    f"fp8_autocast: fun wrote a new array into its argument {where} (state "
                    "updated in place, such as a Flax NNX BatchNorm's statistics or an "
                    "nnx.Rngs drawn from); fp8_autocast, like jax.jit, calls fun on copies of "
                    "its arguments, so the caller's would keep the old value. Return the "
                    "state instead: pass nnx.split(model)'s state, nnx.merge it inside, and "
                    "return nnx.state(model) with the result."
                )
        return out

    return call


def _warn_if_unmatched(choice: _Choice, scopes: str | None, exclude: str | None) -> None:
    """Say what kept `fun`'s GEMMs from FP8 where a choice changed nothing: a `scopes` or
    `exclude` regex that matched none of the GEMMs' scopes (most often written without its
    parents: `mlp` for `block0/mlp/...`), or no GEMM converted at all where some were left
    for their shape (too small, say under `jax.vmap`; batched)."""
    whole = "The regex must match a whole scope, its parents' names included (e.g. r'.*mlp.*')."
    for name, regex, pattern, among, result in (
        # `scopes` among the GEMMs it could convert, `exclude` among all it might keep.
        ("scopes", scopes, choice.scopes, choice.asked, "every GEMM stays in high precision"),
        ("exclude", exclude, choice.exclude, choice.seen, "it keeps none in high precision"),
    ):
        names = sorted(set(among))
        # A regex matching a GEMM left for its shape (batched, small) is not the mistake:
        # the warning below says why nothing was converted.
        if pattern is not None and names and not any(map(pattern.fullmatch, set(choice.seen))):
            shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
            warnings.warn(
                f"fp8_autocast: {name}={regex!r} matched none of the {len(among)} GEMMs' "
                f"scopes ({shown}), so {result}. {whole}",
                Fp8ConversionWarning,
                stacklevel=3,
            )
            return
    left = dict(choice.shapes_left)
    by_scope = len(choice.asked) - left.pop("recipe", 0)
    if choice.picked or not left:  # what the regexes alone left out, the caller chose
        return
    why = [f"{by_scope} left out by scopes or exclude"] if by_scope else []
    if left.get("small"):
        why.append(
            f"{left['small']} with rows, columns or contraction shorter than min_dim="
            f"{choice.min_dim} (under jax.vmap a function of one example has GEMMs of one "
            "row: autocast the vmapped function, fp8_autocast(jax.vmap(f)))"
        )
    if left.get("batched"):
        why.append(f"{left['batched']} with batch dimensions (batched=True converts those)")
    if left.get("held"):
        why.append(
            f"{left['held']} inside custom_jvp, custom_vjp, shard_map or another primitive "
            "whose own rules keep them as written"
        )
    warnings.warn(
        f"fp8_autocast converted none of the function's {by_scope + sum(left.values())} "
        f"GEMMs, so it runs in high precision: {'; '.join(why)}.",
        Fp8ConversionWarning,
        stacklevel=3,
    )


#: Where a value of the jaxpr's outputs goes among a traced result's leaves.
_TRACED = object()


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """A call traced to a jaxpr: its array arguments (`values`, the jaxpr's inputs, each
    with its key path in `(args, kwargs)` in `paths`) and the shape of its result."""

    closed: Any
    values: list
    #: The result's structure and leaves, `_TRACED` where the jaxpr computes one (the rest,
    #: such as an Equinox module's functions, returned as `fun` returned them).
    result: tuple
    paths: list

    def evaluate(self, interpreter: Interpreter) -> Any:
        """The call's result, evaluated again by `interpreter`: its constant leaves (the
        jaxpr's literals and constants, such as a number or a NumPy array returned, and NumPy
        arguments returned as they are) as the arrays `jax.jit` returns."""
        jaxpr = self.closed.jaxpr
        outs = interpreter.run(jaxpr, self.closed.consts, self.values, "")
        outs = iter(
            jnp.asarray(o) if jax_private.is_literal(v) or not isinstance(o, jax.Array) else o
            for o, v in zip(outs, jaxpr.outvars, strict=True)
        )
        treedef, leaves = self.result
        return jax.tree.unflatten(treedef, [next(outs) if v is _TRACED else v for v in leaves])


def array_arguments(args: tuple, kwargs: dict) -> tuple[list, Callable[[Any], tuple], list]:
    """The array leaves of `(args, kwargs)`, a function putting other values in their places
    (the rest, such as flags, kept) and the leaves' key paths: what a trace takes as inputs,
    how the call is rebuilt from them, and where each came from."""
    keyed, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in keyed]
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def fill(values: Any) -> tuple:
        filled = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            filled[i] = value
        return jax.tree.unflatten(treedef, filled)

    return [leaves[i] for i in dynamic], fill, [keyed[i][0] for i in dynamic]


def _holds_tracer(value: Any) -> bool:
    """Whether `value`, a leaf JAX does not flatten, holds a tracer in its attributes (its
    `__dict__`'s or `__slots__`'), or, a function's, its closure, or, a `functools.partial`'s,
    its arguments (one level down: what a class or a closure made in `fun` keeps)."""
    held = [*getattr(value, "__dict__", {}).values()]
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            held.append(getattr(value, slot, None))
    if isinstance(value, functools.partial):
        held += [value.func, value.args, value.keywords]
    for cell in getattr(value, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(held))


def trace_call(fun: Callable[..., Any], args: tuple, kwargs: dict) -> TracedCall:
    """`fun(*args, **kwargs)` traced, its array arguments as the jaxpr's inputs (in the
    order `jax.tree.leaves((args, kwargs))` gives them) and the rest static, as are the
    leaves of its result that are neither arrays nor numbers (returned as they are)."""
    values, fill, paths = array_arguments(args, kwargs)

    result: list = []

    def flat(*values: Any) -> list:
        a, k = fill(values)
        keyed, treedef = jax.tree_util.tree_flatten_with_path(fun(*a, **k))
        leaves = [v for _, v in keyed]
        traced = [_is_array(v) or isinstance(v, bool | int | float | complex) for v in leaves]
        for (path, v), t in zip(keyed, traced, strict=True):
            if not t and _holds_tracer(v):
                raise TypeError(
                    f"fp8jax: {getattr(fun, '__name__', fun)!r} returned at "
                    f"result{jax.tree_util.keystr(path)} a {type(v).__name__} that holds the "
                    "traced arrays, which JAX cannot flatten; it would come back holding "
                    "tracers. Return the arrays in a pytree (a tuple or dict, an eqx.Module, a "
                    "class registered with jax.tree_util.register_dataclass)."
                )
        result[:] = [treedef, [_TRACED if t else v for v, t in zip(leaves, traced, strict=True)]]
        return [v for v, t in zip(leaves, traced, strict=True) if t]

    closed = jax.make_jaxpr(flat)(*values)
    return TracedCall(closed, values, tuple(result), paths)

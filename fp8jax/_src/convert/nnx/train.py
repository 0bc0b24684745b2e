"""Training FP8 Flax NNX models: gradients whose FP8 state combines by max
(`nnx_value_and_grad`, from `grad`), the state written back (`nnx_update_fp8_state`),
gradient histories following a loss scale (`nnx_rescale_gradient_states`), a whole train
step (`nnx_train_step`, an `NnxTrainStep`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, final

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Bool, Float

from ...core import jax_private
from ...core.compile_options import checked_compiler_options, traced_for, traced_options
from ...ops import warm_start
from ...ops.base import (
    checked_ratio,
    rescaled_gradient_state,
    with_recorded_scales,
    with_rejected_counts,
)
from ...ops.dot_general import Fp8DotGeneral
from .grad import nnx_value_and_grad as nnx_value_and_grad
from .grad import received_op, sub_state
from .layers import AbstractFp8NnxDot, Fp8State, is_variable


def _fp8_ops(model: Any) -> list[Fp8DotGeneral]:
    """The op of every FP8 layer of `model`, holding its variables' current values."""
    nodes = nnx.iter_graph(model, graph=True)
    return [node.value() for _, node in nodes if isinstance(node, AbstractFp8NnxDot)]


def nnx_update_fp8_state(
    model: Any, grads: Any, *, where: bool | Bool[ArrayLike, ""] = True
) -> None:
    """Write the new FP8 state the gradients carry into `model`, in place.

    For each FP8 layer of `model` ([`fp8jax.Fp8NnxDotGeneral`][], [`fp8jax.Fp8NnxEinsum`][]),
    takes the value its [`fp8jax.Fp8State`][] variables received as gradient, where it is a
    real update (as [`fp8jax.Fp8DotGeneral.merge`][] decides: a layer that did not run, or
    whose output got no gradient, keeps its state; so does one whose operand held an inf or
    NaN).

    **Arguments:**

    - `model`: the NNX model, as differentiated.
    - `grads`: its gradients, from [`fp8jax.nnx_value_and_grad`][] or from
      `nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State)))`.
    - `where`: whether the step is taken, a boolean scalar (traced too), e.g.
      [`fp8jax.all_finite`][]`(grads)`. Where it is `False` (a step skipped because its
      gradients overflowed) every FP8 state stays as it was, bit for bit, but telemetry's
      counts of rejected updates, which keep the step's own, as
      [`fp8jax.select_tree`][] keeps a skipped step's for [`fp8jax.make_train_step`][]:
      the amaxes of a step that never happened are not recorded.

    Raises `ValueError` if `grads` holds no `Fp8State` for a layer (the gradient was not
    taken with respect to it), `TypeError` if `where` is not a boolean scalar.

    ```python
    loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, y)
    fp8jax.nnx_update_fp8_state(model, grads)
    optimizer.update(model, grads)
    ```
    """
    layers = sorted(
        ((p, n) for p, n in nnx.iter_graph(model, graph=True) if isinstance(n, AbstractFp8NnxDot)),
        key=lambda item: tuple(map(str, item[0])),
    )
    if not layers:
        raise ValueError(
            f"nnx_update_fp8_state: the {type(model).__name__} given has no FP8 layer; "
            "convert it with fp8jax.fp8_linear_layers first."
        )
    taken = _taken(where)
    # Every layer's state merged at once, the ops of one class together (`merge_many`: a few
    # kernels per step, where one layer at a time took a few per layer), as `apply_updates`.
    groups: dict[type, list[tuple[AbstractFp8NnxDot, Any, Any]]] = {}
    for path, layer in layers:
        received = sub_state(grads, (*path, "state"))
        if received is None or not any(
            isinstance(v, Fp8State) for v in jax.tree.leaves(received, is_leaf=is_variable)
        ):
            at = layer.name or ".".join(str(p) for p in path)
            raise ValueError(
                f"nnx_update_fp8_state: the gradients hold no Fp8State for the FP8 layer at "
                f"{at!r}. Differentiate with fp8jax.nnx_value_and_grad, or with "
                "nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State))), and "
                "pass its gradients unfiltered."
            )
        old = layer.value()
        # Each scale paired with the largest amax of the layer's uses (`nnx_value_and_grad`
        # pairs its own gradients; plain `nnx.grad`'s arrive as the uses' max, but under
        # `nnx.scan` as their sum, which no pairing undoes: hence `nnx_value_and_grad`).
        new = with_recorded_scales(received_op(layer, received, path))
        groups.setdefault(type(old), []).append((layer, old, new))
    for cls, group in groups.items():
        merged = cls.merge_many([(old, new) for _, old, new in group])
        for (layer, old, _), value in zip(group, merged, strict=True):
            if taken is not None:  # a skipped step keeps the old state, its rejections counted
                kept = jax.tree.map(lambda new, was: jnp.where(taken, new, was), value, old)
                value = with_rejected_counts(kept, value, old)
            layer.set_value(value)


def _taken(where: Any) -> Any:
    """`nnx_update_fp8_state`'s `where` as a boolean scalar array, `None` for `True` (every
    update taken, no select)."""
    if where is True:
        return None
    try:
        flag = None if isinstance(where, str | bytes) else jnp.asarray(where)
    except (TypeError, ValueError):
        flag = None
    if flag is None or flag.dtype != jnp.bool_ or flag.shape != ():
        raise TypeError(
            f"nnx_update_fp8_state: where={where!r} should be a boolean scalar, e.g. "
            "fp8jax.all_finite(grads): False keeps the FP8 state of a skipped step."
        )
    return flag


def nnx_rescale_gradient_states(model: Any, ratio: Float[ArrayLike, ""]) -> None:
    """[`fp8jax.rescale_gradient_states`][] for an NNX model, in place: each layer's
    output-gradient history times `ratio`, and (delayed scaling) the scale its next step uses
    computed again from it.

    A loss scale multiplies every output gradient, which delayed scaling's history records
    as it is: after a [`fp8jax.DynamicLossScale`][] grows (x2), the next step's largest
    gradients would saturate at E5M2's max. Call it with `new_loss_scale / old_loss_scale`
    after [`fp8jax.nnx_update_fp8_state`][], inside the jitted step or outside.

    **Arguments:** `model`, the NNX model; `ratio`, a positive, finite float32 scalar (1,
    or, traced, a value that is not positive and finite, changes nothing).

    ```python
    new_loss_scale = loss_scale.adjust(finite)
    fp8jax.nnx_rescale_gradient_states(model, new_loss_scale.loss_scale / loss_scale.loss_scale)
    ```
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"nnx_rescale_gradient_states: model is a {type(model).__name__}, not a Flax NNX "
            "module; for an Equinox model or Linen variables, fp8jax.rescale_gradient_states."
        )
    ratio, keep = checked_ratio(ratio, "nnx_rescale_gradient_states")
    for _, node in nnx.iter_graph(model, graph=True):
        if isinstance(node, AbstractFp8NnxDot):
            node.set_value(rescaled_gradient_state(node.value(), ratio, keep))


def _check_optimizer(model: Any, optimizer: Any) -> None:
    tracked = jax.tree.leaves(
        nnx.state(model, nnx.All(optimizer.wrt, Fp8State), graph=True), is_leaf=is_variable
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
) -> NnxTrainStep:
    """A jitted NNX train step for an FP8 model: gradients, FP8 state, optimizer.

    `step(model, optimizer, *args, **kwargs)` differentiates `loss_fn(model, *args, **kwargs)`
    with [`fp8jax.nnx_value_and_grad`][] (with respect to `optimizer.wrt` and the FP8 state),
    writes the new FP8 state into `model` ([`fp8jax.nnx_update_fp8_state`][]), updates the
    Params with `optimizer.update(model, grads)` (`value=loss` for a transformation taking extra
    arguments, as `optax.contrib.reduce_on_plateau`) and returns the loss (`(loss, aux)` with
    `has_aux=True`). `model`, `optimizer` and NNX objects among the arguments are updated in
    place, as NNX does. Arrays among the arguments are traced, other values are static (a new
    value recompiles). A model without FP8 layers (a high-precision baseline) trains too.
    Unlike `make_train_step`, it has no loss scale, [`fp8jax.Policy`][] or microbatches: NNX
    layers compute in their own `dtype`; for float16, write the step by hand (the NNX guide's
    `float16_step` skips overflowed steps); `optax.MultiSteps` accumulates gradients.

    Delayed scaling's warm start is paid only while it can change anything, as in
    [`fp8jax.TrainStep`][]: from the hundredth step on, once every
    [`fp8jax.DelayedScaling`][] state of the model holds a scale (read on the host: one
    wait for the step before to finish), the steps run a program traced without it
    ([`fp8jax.without_warm_start`][]): the same values, without each cast waiting for its
    operand's amax. A model whose FP8 state was set from elsewhere since the last step (a
    checkpoint restored, a layer's state replaced) starts with the warm start again.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *args, **kwargs)`, a scalar.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
    - `compiler_options`: XLA options of the step's executable. `None` (the default) means
      [`fp8jax.gpu_compiler_options`][]: on GPUs every FP8 GEMM is a cuBLASLt FP8 call (and,
      with Triton GEMMs off, XLA's dot merger off unless you set it: it would make BF16
      GEMMs of FP8 ones that share a weight). Options you give replace these (`{}`: XLA's
      defaults; `{**fp8jax.gpu_compiler_options(), ...}` adds yours). A step called in your
      own `jax.jit` / `nnx.jit` is part of your executable (your options), with the warm start.

    **Returns:** an [`fp8jax.NnxTrainStep`][]. Calling it raises `ValueError` if the
    optimizer tracks `Fp8State` (its `wrt` must exclude it).

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
    if not isinstance(has_aux, bool | np.bool_):  # a NumPy bool: the bool it holds
        raise TypeError(f"nnx_train_step: has_aux={has_aux!r} should be True or False.")
    has_aux = bool(has_aux)
    compiler_options = checked_compiler_options("nnx_train_step", compiler_options)
    return NnxTrainStep(loss_fn, has_aux, compiler_options)


def _fp8_arrays(places: dict[bool, tuple[int, ...]], after: bool, leaves: list, model: Any) -> list:
    """The arrays of `model`'s FP8 state (the objects `warm_start.read` and `remember` take:
    a state replaced since the last step, by a checkpoint or a new layer of any recipe, is
    a new array), picked from `leaves`, those of the objects' state before the step or, with
    `after`, of the one it returned (which `model` now holds): found by walking the model
    the first time (tens of milliseconds for a large one), their places among the leaves
    kept in `places` (one state structure's) for the next steps."""
    if after not in places:
        fp8 = jax.tree.leaves(nnx.state(model, Fp8State, graph=True))
        place = {id(leaf): n for n, leaf in enumerate(leaves)}
        if not all(id(array) in place for array in fp8):
            return fp8  # not among the leaves as they are: walked at every step
        places[after] = tuple(place[id(array)] for array in fp8)
    return [leaves[n] for n in places[after]]


@final
class NnxTrainStep:
    """A jitted NNX train step; build it with [`fp8jax.nnx_train_step`][], call it as
    `step(model, optimizer, *args, **kwargs)`, which returns the loss."""

    def __init__(
        self, loss_fn: Callable[..., Any], has_aux: bool, compiler_options: Mapping[str, Any]
    ):
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self.compiler_options = dict(compiler_options)
        # jit's compiler options belong to a top-level executable: inside another trace, the
        # plain version joins the caller's.
        self._inner = jax.jit(self._pure(warm=True), static_argnums=0)
        self._jitted = {
            warm: jax.jit(
                self._program(self.compiler_options, warm),
                static_argnums=0,
                compiler_options=traced_options(self.compiler_options) or None,
            )
            for warm in (True, False)
        }
        # The structure of the objects' state -> where the FP8 state's arrays are among its
        # leaves before the step (False) and after (True): `_fp8_arrays`.
        self._places: dict[Any, dict[bool, tuple[int, ...]]] = {}

    def __repr__(self) -> str:
        return f"NnxTrainStep({self.loss_fn!r}, has_aux={self.has_aux})"

    def __call__(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """One step: `model` and `optimizer` updated in place; returns the loss (with aux)."""
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"nnx_train_step: the model, a {type(model).__name__}, is not a Flax NNX "
                "module; train an Equinox model (or Linen variables) with "
                "fp8jax.make_train_step."
            )
        if not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(
                f"nnx_train_step: optimizer={type(optimizer).__name__}: should be an "
                "nnx.Optimizer, e.g. nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)."
            )
        objects = (model, optimizer, args, kwargs)
        graphdef, state = nnx.split(objects, graph=True)
        if jax_private.tracing():
            value, new_state, _ = self._inner(graphdef, state)
            nnx.update(objects, new_state)
            return value
        leaves, structure = jax.tree.flatten(state)
        places = self._places.setdefault(structure, {})
        recorded, lineage = warm_start.read(_fp8_arrays(places, False, leaves, model))
        warm = not recorded
        value, new_state, said = self._jitted[warm](graphdef, state)
        nnx.update(objects, new_state)
        new = _fp8_arrays(places, True, jax.tree.leaves(new_state), model)
        warm_start.remember(new, lineage._replace(said=said if warm else True))
        return value

    def programs(
        self, options: Mapping[str, Any], model: Any
    ) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
        """The programs this step compiled with `options` runs on `model` (its arrays or
        their shapes), for the inspector, as [`fp8jax.TrainStep`][]'s (named as
        `warm_start.programs` names them), each as a function of `(model, optimizer, *args,
        **kwargs)` traced as the step traces it, with the options its executable compiles
        with."""
        return {
            name: (self._updating(self._program(dict(options), warm)), traced_options(options))
            for name, warm in warm_start.programs(_fp8_ops(model))
        }

    def _pure(self, warm: bool) -> Callable[[Any, Any], tuple[Any, Any, Any]]:
        """The step on the split objects, `(graphdef, state)`: it returns the loss, their
        new state, and with the warm start (`warm`) what `warm_start.recorded_flag` says of
        the new FP8 state."""

        def pure(graphdef: Any, state: Any) -> tuple[Any, Any, Any]:
            objects = nnx.merge(graphdef, state)
            model, optimizer, args, kwargs = objects
            _check_optimizer(model, optimizer)
            grad_fn = nnx_value_and_grad(self.loss_fn, wrt=optimizer.wrt, has_aux=self.has_aux)
            value, grads = grad_fn(model, *args, **kwargs)
            if _fp8_ops(model):  # a model without FP8 layers (a baseline) trains as it is
                nnx_update_fp8_state(model, grads)
            # The loss as optax's extra argument `value`, for a transformation that takes
            # extra arguments (optax.contrib.reduce_on_plateau reads it).
            extra = isinstance(optimizer.tx, optax.GradientTransformationExtraArgs)
            loss = value[0] if self.has_aux else value
            optimizer.update(model, grads, **({"value": loss} if extra else {}))
            said = warm_start.recorded_flag(_fp8_ops(model)) if warm else None
            return value, nnx.state(objects, nnx.Variable, graph=True), said

        return pure

    def _program(self, options: dict[str, Any], warm: bool) -> Callable[..., Any]:
        """`_pure` traced for an executable compiled with `options`: with the warm start, or
        without it for once every scale is recorded (`warm_start.once_recorded`); with Triton
        GEMMs off, delayed scaling's kept inverses reach cuBLASLt as they are, XLA's dot
        merger off (`compile_options.traced_for`)."""
        pure = self._pure(warm)
        return traced_for(options, pure if warm else warm_start.once_recorded(pure))

    @staticmethod
    def _updating(program: Callable[..., Any]) -> Callable[..., Any]:
        """`program` as a function of the objects themselves, updating them in place."""

        def step(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            objects = (model, optimizer, args, kwargs)
            graphdef, state = nnx.split(objects, graph=True)
            value, new_state, _ = program(graphdef, state)
            nnx.update(objects, new_state)
            return value

        return step

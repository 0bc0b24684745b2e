"""One call for the common training step: policy casts, loss scaling, FP8 state, optax.

[`fp8jax.make_train_step`][] strings together the explicit pieces, which stay public for
custom loops: [`fp8jax.filter_value_and_grad`][] (FP8 state combines by max),
[`fp8jax.partition_for_grad_overwrite`][], a loss scale's `unscale`, [`fp8jax.all_finite`][],
the optimizer, [`fp8jax.apply_updates`][] and [`fp8jax.select_tree`][] (skip a step whose
gradients overflowed).

```python
train_step = fp8jax.make_train_step(
    loss_fn, optax.adamw(1e-3), policy="params=float32,compute=bfloat16,output=float32"
)
state = train_step.init(model)
for batch in batches:
    state, metrics = train_step(state, *batch)
```
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from ..core import jax_private
from ..core.compile_options import checked_compiler_options, traced_for, traced_options
from ..core.updates import (
    apply_updates,
    is_fp8_state,
    is_overwrite,
    partition_for_grad_overwrite,
)
from ..ops import warm_start
from .accumulate import accumulate_gradients, check_unroll, is_count, stackable_aux
from .grad import filter_value_and_grad
from .loss_scale import (
    LossScale,
    NoOpLossScale,
    all_finite,
    rescale_gradient_states,
    select_tree,
    states_finite,
)
from .policy import Policy


class TrainState(eqx.Module):
    """Everything a training step changes.

    **Fields:** `model` (parameters in the policy's `param_dtype`, with their FP8 state),
    `opt_state` (the optimizer's, over the trainable parameters only), `loss_scale` (a
    [`fp8jax.LossScale`][]), `step` (steps taken, skipped ones included).
    """

    model: Any
    opt_state: Any
    loss_scale: LossScale
    step: Int[Array, ""]


class StepMetrics(eqx.Module):
    """What one step reports: `loss` (unscaled, in the policy's `output_dtype`), `aux` (the
    loss function's auxiliary output, or `None`), `grads_finite` (`False` when the step was
    skipped) and `loss_scale` (the scale this step used)."""

    loss: Float[Array, ""]
    aux: Any
    grads_finite: Bool[Array, ""]
    loss_scale: Float[Array, ""]


#: What an optimizer's `init` that failed was given (a note on its error).
_OPTIMIZER_TREE = (
    "make_train_step initialises the optimizer on the trainable parameters only: the model "
    "with None at its FP8 state and non-array leaves, eqx.filter(fp8jax.partition_for_grad_"
    "overwrite(model)[1], eqx.is_inexact_array). Build a mask or labels (optax.masked, "
    "multi_transform, add_decayed_weights) from that tree, or pass a function of it; an "
    "optimizer whose params are not the model (optax.lookahead's LookaheadParams) needs a "
    "loop of your own."
)


def _trainable_params(model: Any) -> Any:
    return eqx.filter(partition_for_grad_overwrite(model)[1], eqx.is_inexact_array)


def _is_narrow_float(x: Any) -> bool:
    """An FP8 (or narrower: FP6, FP4, E8M0) array: already quantized, with its own scale."""
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 1


def _cast_batch(policy: Policy, batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """`policy.cast_to_compute(batch)`, but FP8 arrays stay FP8. The policy casts every floating
    array, FP8 ones too; an FP8 input is already quantized, and the loss that knows its scale
    decides how to use it."""
    return jax.tree.map(
        lambda x: x if _is_narrow_float(x) else policy.cast_to_compute(x),
        batch,
        is_leaf=is_overwrite,
    )


class TrainStep(eqx.Module):
    """A jitted training step; build it with [`fp8jax.make_train_step`][].

    `init(model)` gives the first [`fp8jax.TrainState`][]; calling it,
    `step(state, *batch) -> (state, metrics)`, runs one step.

    Delayed scaling's warm start is paid only while it can change anything: once a state's
    lineage has run a hundred steps (`WARM_STEPS`: the second program is a second compile,
    which a short run would not earn back) and the state the last one returned holds a scale for
    every [`fp8jax.DelayedScaling`][] state ([`fp8jax.scales_recorded`][], read on the host:
    one wait for that step to finish), the next steps run a program traced with the warm
    start skipped ([`fp8jax.without_warm_start`][]): the same values, without each cast
    waiting for its operand's amax (a Llama-3-8B block's step compiled for an H100: 100
    kernels instead of 129; its GPU time on recorded scales is still to be measured, the
    earlier timing ran on a fresh state's scale of 1.0, which zeroed the gradients). A state
    from elsewhere (`init`, a checkpoint, one changed between steps) starts a lineage again.
    Called inside your own `jit`, the step keeps the warm start.
    """

    loss_fn: Callable[..., Any] = eqx.field(static=True)
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    policy: Policy = eqx.field(static=True)
    loss_scale: LossScale
    has_aux: bool = eqx.field(static=True)
    skip_nonfinite: bool = eqx.field(static=True)
    microbatches: int = eqx.field(static=True, default=1)
    compiler_options: tuple[tuple[str, Any], ...] = eqx.field(static=True, default=())
    cast_batch: bool = eqx.field(static=True, default=True)
    unroll_microbatches: int | bool = eqx.field(static=True, default=1)

    def init(self, model: Any) -> TrainState:
        """The training state for `model`: its parameters cast to the policy's `param_dtype`
        (FP8 state untouched) and the optimizer initialised on the trainable part. A Flax NNX
        model, or its state (`fp8jax.Fp8State` variables), raises `TypeError`: train it with
        [`fp8jax.nnx_train_step`][]."""
        nnx = sys.modules.get("flax.nnx")  # looked up, never imported
        if isinstance(getattr(nnx, "Module", None), type) and isinstance(model, nnx.Module):
            raise TypeError(
                f"make_train_step: the model, a {type(model).__name__}, is a Flax NNX module, "
                "whose variables this step cannot update; train it with "
                "fp8jax.nnx_train_step(loss_fn) and an nnx.Optimizer."
            )
        # Its state split off (`nnx.split`) is a pytree this step would train: the FP8 state's
        # new values, arriving as gradients, would be the optimizer's (Adam drove a scale
        # negative within three steps).
        held = [x for x in jax.tree.leaves(model, is_leaf=is_fp8_state) if is_fp8_state(x)]
        if any(not is_overwrite(x) for x in held):
            kind = type(next(x for x in held if not is_overwrite(x))).__name__
            raise TypeError(
                f"make_train_step: the model holds {kind} variables (a Flax NNX model's state, "
                "from nnx.split or nnx.state), which this step would hand to the optimizer as "
                "weights; train the NNX model with fp8jax.nnx_train_step(loss_fn) and an "
                "nnx.Optimizer."
            )
        model = self.policy.cast_to_param(model)
        try:
            opt_state = self.optimizer.init(_trainable_params(model))
        except (ValueError, TypeError, AttributeError) as error:
            # optax's own error names where its tree and a mask's (or labels') part.
            error.add_note(_OPTIMIZER_TREE)
            raise
        return TrainState(model, opt_state, self.loss_scale, jnp.zeros((), jnp.int32))

    def programs(
        self, options: Mapping[str, Any], state: TrainState
    ) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
        """The programs this step compiled with `options` runs from `state` (its arrays or
        their shapes), for the inspector, named as `warm_start.programs` names them, each as
        a function of `(state, *batch)` traced as the step traces it, with the options its
        executable compiles with."""
        return {
            name: (functools.partial(_program(dict(options), warm), self), traced_options(options))
            for name, warm in warm_start.programs(state)
        }

    def __call__(self, state: TrainState, *batch: Any) -> tuple[TrainState, StepMetrics]:
        """One step from `state` on `*batch`: the new state and the step's metrics."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"train step: state is of type {type(state).__name__}, not an fp8jax.TrainState; "
                "create it with train_step.init(model)."
            )
        # Compiler options belong to a top-level executable: under the caller's own jit (or
        # another transformation) the step is part of the caller's executable.
        if jax_private.tracing():
            return _jitted((), warm=True)(self, state, *batch)[:2]
        recorded, lineage = warm_start.read((state,))
        if recorded:
            new_state, metrics = _jitted(self.compiler_options, warm=False)(self, state, *batch)
            warm_start.remember((new_state,), lineage._replace(said=True))
            return new_state, metrics
        new_state, metrics, said = _jitted(self.compiler_options, warm=True)(self, state, *batch)
        warm_start.remember((new_state,), lineage._replace(said=said))
        return new_state, metrics


@functools.cache
def _jitted(options: tuple[tuple[str, Any], ...], warm: bool) -> Callable[..., Any]:
    """The step jitted with these XLA options (`_program`)."""
    step = _program(dict(options), warm)
    return eqx.filter_jit(step, compiler_options=traced_options(dict(options)) or None)


def _program(options: dict[str, Any], warm: bool) -> Callable[..., Any]:
    """The step, `(self, state, *batch)`, traced for an executable compiled with `options`:
    with delayed scaling's warm start (`warm`), returning also what
    `warm_start.recorded_flag` says of the new state, or without it, for once every scale is
    recorded (`warm_start.once_recorded`)."""

    def warm_step(self: TrainStep, state: TrainState, *batch: Any) -> tuple[Any, ...]:
        new_state, metrics = _step(self, state, *batch)
        return new_state, metrics, warm_start.recorded_flag(new_state.model)

    # Run only once every scale is recorded (`TrainStep.__call__`).
    step = warm_step if warm else warm_start.once_recorded(_step)
    # With Triton GEMMs off, delayed scaling's kept inverses reach cuBLASLt as they are (and
    # XLA's dot merger is turned off, which would make BF16 GEMMs of those).
    return traced_for(options, step)


def _step(self: TrainStep, state: TrainState, *batch: Any) -> tuple[TrainState, StepMetrics]:
    policy, scale = self.policy, state.loss_scale

    def scaled_loss(model: Any, *batch: Any) -> tuple[Array, tuple[Array, Any]]:
        # Here, after any split into microbatches: each slice is cast as it is used.
        batch = _cast_batch(policy, batch) if self.cast_batch else batch
        out = self.loss_fn(policy.cast_to_compute(model), *batch)
        if self.has_aux and not (isinstance(out, tuple | list) and len(out) == 2):
            got = (
                f"an array of shape {jnp.shape(out)}"
                if isinstance(out, jax.Array)
                else f"a {type(out).__name__}"
            )
            raise ValueError(
                f"make_train_step(has_aux=True): loss_fn returned {got}, not a pair (loss, "
                "aux); return both, or drop has_aux."
            )
        if not self.has_aux and isinstance(out, tuple | list):
            raise ValueError(
                f"make_train_step: loss_fn returned a {type(out).__name__} of {len(out)}, not a "
                "scalar loss; for (loss, aux), pass has_aux=True."
            )
        loss, aux = out if self.has_aux else (out, None)
        if self.has_aux and self.microbatches > 1:
            aux = stackable_aux(aux, f"make_train_step(microbatches={self.microbatches})")
        if jnp.ndim(loss) != 0:
            raise ValueError(
                f"make_train_step: loss_fn returned shape {jnp.shape(loss)}; it must return a "
                "scalar loss (or (loss, aux) with has_aux=True)."
            )
        scaled = jnp.asarray(loss)
        loss = policy.cast_to_output(scaled)
        if jnp.issubdtype(loss.dtype, jnp.floating) and jnp.finfo(loss.dtype).bits < 32:
            # A float16 or bfloat16 output: the scaled loss's gradient with respect to that
            # loss is the scale in its dtype, inf past 65504 in float16 (every gradient was),
            # rounded to 8 bits in bfloat16 (3000 is 3008: every gradient 0.27 % too large).
            # The loss as loss_fn returned it is scaled instead, in at least float32; only the
            # reported loss is in the output dtype.
            scaled = scaled.astype(jnp.promote_types(scaled.dtype, jnp.float32))
        else:  # float32 and wider: scaled as reported
            scaled = loss
        return scale.scale(scaled), (loss, aux)

    if self.microbatches > 1:
        grad_fn = accumulate_gradients(
            scaled_loss, self.microbatches, has_aux=True, unroll=self.unroll_microbatches
        )
        (_, (losses, aux)), grads = grad_fn(state.model, *batch)
        loss = jnp.mean(losses)  # aux stays stacked over microbatches
    else:
        grad_fn = filter_value_and_grad(scaled_loss, has_aux=True)
        (_, (loss, aux)), grads = grad_fn(state.model, *batch)
    overwrites, grads = partition_for_grad_overwrite(grads)
    grads = scale.unscale(grads)
    # The new FP8 state too: a fault in an FP8 operand reaches the loss and gradients as NaN,
    # and its amax shows it even where nothing downstream does (merge would reject it anyway).
    finite = all_finite(grads) & states_finite(overwrites)
    params = _trainable_params(state.model)
    # The loss as optax's extra argument `value` (reduce_on_plateau, polyak_sgd read it),
    # which a transformation without extra arguments is not given.
    optimizer = optax.with_extra_args_support(self.optimizer)
    updates, opt_state = optimizer.update(grads, state.opt_state, params, value=loss)
    model = policy.cast_to_param(apply_updates(state.model, updates, overwrites))
    if self.skip_nonfinite:
        # Old values are selected bit for bit: weights, optimizer state and FP8 state; but
        # telemetry's counts of rejected FP8 updates count the skipped step too (select_tree).
        model, opt_state = select_tree(finite, (model, opt_state), (state.model, state.opt_state))
    new_scale = scale.adjust(finite)
    if new_scale is not scale:
        # Delayed scaling's gradient histories follow the scale (a growth would saturate the
        # next step's largest gradients), other recipes' recorded amaxes too (telemetry); a
        # constant scale's `adjust` returns itself, and adds nothing here.
        model = rescale_gradient_states(model, new_scale.loss_scale / scale.loss_scale)
    new_state = TrainState(model, opt_state, new_scale, state.step + 1)
    return new_state, StepMetrics(loss, aux, finite, scale.loss_scale)


_POLICY_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


def _not_a_policy(policy: Any) -> str:
    """Why `policy` is refused, naming its type (another library's `Policy`, jmp's, printed
    as "Policy(...)") and, for one with the three dtypes, the fp8jax policy that has them."""
    kind = type(policy)
    where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    named = where + kind.__qualname__
    article = "an" if named[0].lower() in "aeiou" else "a"
    message = (
        f"make_train_step: policy={policy!r} is {article} {named}, "
        "not an fp8jax.Policy; pass an fp8jax.Policy, a string for Policy.from_string or None"
    )
    if isinstance(policy, type):  # a class (fp8jax.Policy itself), whose fields are defaults
        return message + "; pass an instance."
    try:
        ours = Policy(**{name: getattr(policy, name) for name in _POLICY_FIELDS})
    except (AttributeError, TypeError, ValueError):
        return message + "."
    return message + f": this one's dtypes are {str(ours)!r}."


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    policy: Policy | str | None = None,
    loss_scale: LossScale | None = None,
    has_aux: bool = False,
    skip_nonfinite: bool = True,
    microbatches: int = 1,
    compiler_options: Mapping[str, Any] | None = None,
    cast_batch: bool = True,
    unroll_microbatches: int | bool = 1,
) -> TrainStep:
    """A jitted step that trains a model with FP8 layers, mixed precision and loss scaling.

    Each step casts the model and the batch to the policy's compute dtype, differentiates
    `loss_scale.scale(loss_fn(model, *batch))` (FP8 state combining by max), splits the FP8
    state out of the gradients, unscales the rest, checks they are finite, runs the optimizer
    on the trainable parameters, writes parameters and FP8 state back in the param dtype, and
    adjusts the loss scale, rescaling the output-gradient states (delayed scaling's
    histories) when it changes ([`fp8jax.rescale_gradient_states`][]). A step with
    non-finite gradients, or a non-finite new FP8 state (an inf or NaN in an FP8 layer's
    operand, passed on as NaN by the saturating cast), changes nothing but the loss scale
    (and those states with it), the step count and telemetry's counts of rejected FP8
    updates (`stats.<role>.rejected`). No host sync, but one wait after the hundredth step,
    where delayed scaling's warm start is dropped once every scale is recorded
    ([`fp8jax.TrainStep`][]).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *batch) -> loss` (a scalar), or `(loss, aux)` with `has_aux`.
    - `optimizer`: any optax transformation (FP8 state never reaches it); one that takes extra
      arguments gets the loss as `value` (`optax.contrib.reduce_on_plateau` reads it).
    - `policy`: a [`fp8jax.Policy`][], a string for `Policy.from_string`, or `None` (float32);
      another library's policy (jmp's) raises `TypeError`, giving the spec of its dtypes.
    - `loss_scale`: a [`fp8jax.LossScale`][]; `None` means [`fp8jax.NoOpLossScale`][]. Use
      [`fp8jax.DynamicLossScale`][] with float16 compute. With a float16 or bfloat16
      `output_dtype` the loss is scaled as `loss_fn` returned it, in at least float32 (a
      float16 loss's gradient, the scale, is inf past 65504; a bfloat16 one's is rounded to
      8 bits), and reported in the output dtype.
    - `skip_nonfinite`: skip steps whose gradients are not finite (default `True`).
    - `microbatches`: accumulate gradients over this many slices of the batch
      ([`fp8jax.accumulate_gradients`][]: each array cut along its first axis, scalars passed
      whole to every slice); with more than one, `aux` is stacked over
      them (a Haliax `NamedArray` along a new leading `microbatch` axis).
    - `compiler_options`: XLA options of the step's executable. `None` (the default) means
      [`fp8jax.gpu_compiler_options`][]: on GPUs every FP8 GEMM is a cuBLASLt FP8 call, not a
      Triton kernel that may upcast FP8 to f16; with Triton GEMMs off the step also turns
      XLA's dot merger off (unless you set it), which would make BF16 GEMMs of FP8 ones that
      share a weight (a layer called twice, microbatches). Options you give replace these:
      `{}` compiles with XLA's defaults; to add one, keep fp8jax's
      (`{**fp8jax.gpu_compiler_options(), "xla_dump_to": DIR}`). A step called inside your
      own `jax.jit` is part of your executable, which has your options.
    - `cast_batch`: cast the batch's floating-point arrays to the policy's compute dtype, inside
      the jitted step, before `loss_fn` sees them (default `True`; jmp's
      `policy.cast_to_compute((params, inputs))`), so a float32 image batch meets a bfloat16
      convolution in bfloat16 (with float32 compute, a bfloat16 batch is widened). Integer
      and boolean arrays (labels, tokens), FP8 arrays and non-array leaves pass as given.
      `False` passes the whole batch as given: for a loss that needs float32 targets (a
      regression target, say) and casts its inputs itself.
    - `unroll_microbatches`: with `microbatches`, [`fp8jax.accumulate_gradients`][]'s
      `unroll`: `True` lets XLA quantize each FP8 weight once for all microbatches instead of
      once each, for more temp memory.

    **Returns:** a [`fp8jax.TrainStep`][]: `state = train_step.init(model)`, then
    `state, metrics = train_step(state, *batch)` ([`fp8jax.StepMetrics`][]).

    ```python
    train_step = fp8jax.make_train_step(
        loss_fn,
        optax.adamw(1e-3),
        policy="params=float32,compute=float16,output=float32",
        loss_scale=fp8jax.DynamicLossScale(),
    )
    ```
    """
    if isinstance(policy, str):
        policy = Policy.from_string(policy)
    elif policy is None:
        policy = Policy()
    elif not isinstance(policy, Policy):
        raise TypeError(_not_a_policy(policy))
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"make_train_step: loss_scale={loss_scale!r}: should be an fp8jax loss scale "
            "(NoOpLossScale, StaticLossScale, DynamicLossScale) or None."
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        multi = isinstance(optimizer, optax.MultiSteps)
        raise TypeError(
            f"make_train_step: optimizer={optimizer!r}: should be an optax "
            "GradientTransformation, e.g. optax.adamw(1e-3)"
            + (
                "; for an optax.MultiSteps, its .gradient_transformation() (or "
                "make_train_step(microbatches=...), which accumulates within one step)."
                if multi
                else "."
            )
        )
    flags = (("has_aux", has_aux), ("skip_nonfinite", skip_nonfinite), ("cast_batch", cast_batch))
    for flag, value in flags:
        if not isinstance(value, bool | np.bool_):  # a NumPy bool: the bool it holds
            raise TypeError(f"make_train_step: {flag}={value!r}: should be True or False.")
    has_aux, skip_nonfinite, cast_batch = bool(has_aux), bool(skip_nonfinite), bool(cast_batch)
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn={loss_fn!r} is not callable.")
    if not is_count(microbatches):
        raise ValueError(f"make_train_step: microbatches={microbatches!r} should be an int >= 1.")
    microbatches = int(microbatches)
    unroll_microbatches = check_unroll("make_train_step: unroll_microbatches", unroll_microbatches)
    compiler_options = checked_compiler_options("make_train_step", compiler_options)
    options = tuple(sorted(compiler_options.items()))
    return TrainStep(
        loss_fn,
        optimizer,
        policy,
        loss_scale,
        has_aux,
        skip_nonfinite,
        microbatches,
        options,
        cast_batch,
        unroll_microbatches,
    )

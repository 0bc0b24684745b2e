"""Per-layer FP8 telemetry: scales, amaxes, saturation and underflow, as a pytree.

[`fp8jax.telemetry`][] reads what every [`fp8jax.Fp8DotGeneral`][] and
[`fp8jax.Fp8RaggedDot`][] holds: in a model it is the state after the latest applied step; in
the gradients (the first output of `partition_for_grad_overwrite`) it is the state this step
produced. It is pure JAX, so it runs
inside a jitted step without a host sync; [`fp8jax.report`][] fetches and prints it.

```python
model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(telemetry=True))
...
fp8jax.report(model, loss_scale=loss_scale)
```
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..convert.config import ROOT
from ..convert.plan import ConversionPlan
from ..core.updates import haliax_fp8_op
from ..ops.base import received_state
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot
from ..recipes import ROLES


class OperandTelemetry(eqx.Module):
    """What one operand of an FP8 GEMM looks like at the latest step.

    **Fields** (float32; with a leading layer axis for stacked layers):

    - `scale`: the state's scale: under delayed scaling the one the next step multiplies
      values by before the cast (computed from the history after each step, as Transformer
      Engine does; 0 before the first amax with the warm start), under current scaling the
      latest step's (block recipes: the nominal `fp8_max / amax`).
    - `amax`: the latest amax, `amax_history[0]`.
    - `history_max`: the largest amax the history remembers.
    - `saturated`, `underflow`: the fractions of values clipped at the format's max and flushed
      to zero ([`fp8jax.OperandStats`][]), or `None` for a layer built without telemetry.
    - `rejected`: how many steps the operand held an inf or NaN, so that the layer kept its
      previous state instead of taking that step's amax, or `None` without telemetry. In
      gradients, 1 where this step's state will be rejected (the model keeps the count).
      A model is read as gradients are: a state holding an inf or NaN (which no merge
      takes: put there by hand) shows its own count plus 1, the update it would be.
    """

    scale: Float[Array, "*layers"]
    amax: Float[Array, "*layers"]
    history_max: Float[Array, "*layers"]
    saturated: Float[Array, "*layers"] | None
    underflow: Float[Array, "*layers"] | None
    rejected: Float[Array, "*layers"] | None = None


class LayerTelemetry(eqx.Module):
    """[`fp8jax.OperandTelemetry`][] of the input, kernel and output gradient of one layer,
    and the FP8 format of each.

    For a grouped layer ([`fp8jax.Fp8RaggedDot`][]) `experts` is its number of experts and
    the kernel's fields have a trailing expert axis (`scale (*layers, experts)`): each expert's
    kernel has its own scale, history and statistics; `tokens (*layers, experts)` is how many
    tokens each expert got at the latest step, over all of the layer's calls (with telemetry;
    else `None`). `experts` and `tokens` are `None` for a dense layer.
    """

    input: OperandTelemetry
    kernel: OperandTelemetry
    output_grad: OperandTelemetry
    recipe: str = eqx.field(static=True)
    formats: tuple[str, str, str] = eqx.field(static=True)
    experts: int | None = eqx.field(static=True, default=None)
    tokens: Float[Array, "*layers experts"] | None = None


def _layer(dot: Fp8DotGeneral | Fp8RaggedDot) -> LayerTelemetry:
    layer_stats = getattr(dot, "stats", None)
    operands = {}
    for role in ROLES:
        state = getattr(dot, role)
        history = state.amax_history
        stats = None if layer_stats is None else getattr(layer_stats, role)
        operands[role] = OperandTelemetry(
            scale=state.scale,
            amax=history[..., 0],
            history_max=jnp.max(history, axis=-1),
            saturated=None if stats is None else stats.saturated,
            underflow=None if stats is None else stats.underflow,
            rejected=None if stats is None else _rejected(stats.rejected, state),
        )
    formats = tuple(np.dtype(dot.recipe.format(role)).name for role in ROLES)
    experts = dot.num_experts if isinstance(dot, Fp8RaggedDot) else None
    tokens = getattr(layer_stats, "tokens", None)
    return LayerTelemetry(
        **operands,
        recipe=type(dot.recipe).__name__,
        formats=formats,
        experts=experts,
        tokens=tokens,
    )


def _unused_as_zero(dot: Any) -> Any:
    """`dot` with -inf as 0: gradients give a layer in a `lax.cond` branch not taken -inf,
    the max-combining zero (nothing received), where an unused layer's are 0; no state of a
    model holds it."""
    return jax.tree.map(
        lambda x: jnp.where(x == -jnp.inf, 0, x) if eqx.is_inexact_array(x) else x, dot
    )


def _rejected(count: Array, state: Any) -> Array:
    """The count of rejected updates, with the one `state` itself would be: gradients hold
    the step's state, which `merge` has not counted yet (a model's state is always finite)."""
    return count + received_state(state)[1].astype(count.dtype)


def _haliax_layer(op: Any) -> LayerTelemetry:
    """A layer Haliax quantized to FP8 itself (kept so by `fp8_linear_layers`), in fp8jax's
    terms: Haliax divides by its scale, and the next step's is `fp8_max / history max`."""
    formats = (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
    operands = {}
    for role, fmt in zip(ROLES, formats, strict=True):
        divisor = getattr(op, f"{role}_scale")[..., 0]
        history = getattr(op, f"{role}_amax_history")  # the newest amax first
        most = jnp.max(history, axis=-1)
        kept = jnp.where(divisor > 0, 1 / jnp.where(divisor > 0, divisor, 1), 0.0)
        ok = (most > 0) & jnp.isfinite(most)
        scale = jnp.where(ok, float(jnp.finfo(fmt).max) / jnp.where(ok, most, 1), kept)
        operands[role] = OperandTelemetry(scale, history[..., 0], most, None, None)
    names = tuple(np.dtype(f).name for f in formats)
    return LayerTelemetry(**operands, recipe="haliax.quantization.Fp8DotGeneralOp", formats=names)


def _nnx() -> Any:
    """fp8jax's Flax NNX layers module if it was imported, else `None`.

    No NNX FP8 layer exists before that module is imported (converting an NNX model imports
    it), so looking it up in `sys.modules` tells NNX models apart without importing flax:
    `import fp8jax` stays free of it.
    """
    return sys.modules.get(f"{__package__.rpartition('.')[0]}.convert.nnx.layers")


def telemetry(tree: Any) -> dict[str, LayerTelemetry]:
    """The [`fp8jax.LayerTelemetry`][] of every FP8 layer in `tree`, by layer name: dense
    ([`fp8jax.Fp8DotGeneral`][]) and grouped ([`fp8jax.Fp8RaggedDot`][], with a scale per
    expert for the kernel) alike, and Haliax Linears that `haliax.quantization` made FP8
    (their scales and amaxes, without statistics; `recipe` names Haliax's op).

    **Arguments:**

    - `tree`: a model, or gradients of one (their FP8 state is the state the step produced;
      a layer in a `lax.cond` branch not taken reads as an unused layer's, zeros).
      A Flax NNX model is read like an Equinox one: its FP8 layers
      ([`fp8jax.Fp8NnxDotGeneral`][]) report the values of their [`fp8jax.Fp8State`][]
      variables, as arrays; a layer shared by two places is reported once. (Its gradients,
      an `nnx.State`, carry no recipe: pass the model after
      [`fp8jax.nnx_update_fp8_state`][].)

    **Returns:** a dict from the layer's name (its path, as `fp8_linear_layers` set it, or its
    position in `tree` for a layer without one or whose name an earlier layer has, numbered
    `#2`, ... if that is taken too; `(root)` for a layer that is `tree` itself, as in
    [`fp8jax.ConversionPlan`][]) to its telemetry: a pytree of arrays, computed
    without leaving the device. Raises `ValueError` if `tree` holds no FP8 layer.

    ```python
    stats = fp8jax.telemetry(model)
    stats["layers.0"].output_grad.saturated   # fraction of gradients clipped at E5M2's max
    stats["moe.up"].kernel.scale              # (experts,): each expert's kernel scale
    ```
    """
    nnx_module = _nnx()
    nnx_layer = None if nnx_module is None else nnx_module.AbstractFp8NnxDot
    haliax_ops = haliax_fp8_op()
    kinds = tuple(k for k in (Fp8DotGeneral, Fp8RaggedDot, nnx_layer, *haliax_ops) if k)

    def is_layer(x: Any) -> bool:
        return isinstance(x, kinds)

    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_layer)[0]
    layers: dict[str, LayerTelemetry] = {}
    seen: set[int] = set()
    for path, node in found:
        if not is_layer(node):
            continue
        where = jax.tree_util.keystr(path).lstrip(".") or ROOT  # as plans name it
        if isinstance(node, haliax_ops):
            layers[_unique(where, where, layers)] = _haliax_layer(node)
            continue
        if not isinstance(node, Fp8DotGeneral | Fp8RaggedDot):
            # An NNX layer: flattening meets a shared one under each of its paths; report it
            # once, under the first (the name fp8_linear_layers gave it).
            if id(node) in seen:
                continue
            seen.add(id(node))
            node = node.value()  # arrays, not the Fp8State variables holding them
        layers[_unique(node.name or where, where, layers)] = _layer(_unused_as_zero(node))
    if not layers:
        hint = (
            "pass a model converted with fp8_linear_layers, or its gradients (Haliax's own "
            "FP8 layers are read too; its int8 ones hold no FP8 state)"
        )
        if nnx_module is not None and _holds(tree, nnx_module.Fp8State, nnx_module.is_variable):
            hint = (
                "it holds fp8jax.Fp8State variables but no layer (NNX gradients, or an "
                "nnx.State, do not say which recipe made them): pass the NNX model itself, "
                "after fp8jax.nnx_update_fp8_state"
            )
        raise ValueError(
            f"fp8jax.telemetry: no Fp8DotGeneral in the {type(tree).__name__} given; {hint}."
        )
    return layers


def _unique(name: str, where: str, layers: dict[str, LayerTelemetry]) -> str:
    """`name`, or, if another layer in `layers` has it, the layer's position `where`, numbered
    (`where #2`, ...) if that is taken too: a layer never replaces another."""
    if name not in layers:
        return name
    found, count = where, 1
    while found in layers:
        count += 1
        found = f"{where} #{count}"
    return found


def _holds(tree: Any, kind: type, is_variable: Callable[[Any], bool]) -> bool:
    """Whether one of the NNX variables in `tree` is a `kind`."""
    leaves = jax.tree.leaves(tree, is_leaf=is_variable)
    return any(isinstance(leaf, kind) for leaf in leaves)


def _percent(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.3g} %"


def _rows(name: str, layer: LayerTelemetry, tokens: bool) -> list[list[str]]:
    """One row per operand of every (stacked) layer; a grouped layer's kernel gets one row per
    expert, its operand named `kernel[e]`, with the tokens the expert got when `tokens`."""
    host = jax.tree.map(np.asarray, layer)
    shape = np.shape(host.input.scale)
    rows = []
    for index in np.ndindex(*shape):
        label = name + "".join(f"[{i}]" for i in index)
        for role, fmt in zip(ROLES, layer.formats, strict=True):
            op = getattr(host, role)
            per_expert = role == "kernel" and layer.experts is not None
            for expert in range(layer.experts) if per_expert else (None,):
                at_index = index if expert is None else (*index, expert)

                def at(value: Any, at_index: tuple = at_index) -> Any:
                    return None if value is None else value[at_index]

                rows.append(
                    [
                        label,
                        role if expert is None else f"{role}[{expert}]",
                        fmt.removeprefix("float8_"),
                        _scale_text(float(at(op.scale))),
                        f"{float(at(op.amax)):.4g}",
                        f"{float(at(op.history_max)):.4g}",
                        _percent(at(op.saturated)),
                        _percent(at(op.underflow)),
                        "-" if op.rejected is None else str(int(at(op.rejected))),
                    ]
                )
                if tokens:
                    count = None if expert is None or host.tokens is None else at(host.tokens)
                    rows[-1].append("-" if count is None else str(int(count)))
                label = ""
    return rows


def _scale_text(scale: float) -> str:
    """A scale as printed; 0 (delayed scaling's warm start before its first amax, or the
    gradient of a layer that did not run: no scale is ever 0) as `-`, which the line under
    the table explains."""
    return "-" if scale == 0 else f"{scale:.4g}"


def _loss_scale_line(loss_scale: Any) -> str:
    parts = [f"loss scale {float(loss_scale.loss_scale):.6g}"]
    if hasattr(loss_scale, "skipped_steps"):
        skipped, total = int(loss_scale.skipped_steps), int(loss_scale.total_steps)
        rate = skipped / total if total else 0.0
        parts.append(f"skipped {skipped} of {total} steps ({100 * rate:.3g} % overflow)")
    return ", ".join(parts)


def report(
    tree: Any,
    loss_scale: Any = None,
    *,
    plan: ConversionPlan | None = None,
    file: TextIO | None = None,
    quiet: bool = False,
) -> str:
    """Print a per-layer table of FP8 telemetry, and the loss scale's statistics.

    **Arguments:**

    - `tree`: a model or its gradients (see [`fp8jax.telemetry`][]), or what `telemetry`
      returned.
    - `loss_scale`: optionally a loss scale ([`fp8jax.DynamicLossScale`][] reports its scale,
      skipped steps and overflow rate). The output gradients' amaxes are then printed in the
      loss's units (the state records them times the loss scale), their scales to match:
      the states follow the loss scale when it changes ([`fp8jax.rescale_gradient_states`][],
      which [`fp8jax.make_train_step`][] calls), so pass the loss scale returned with them.
    - `plan`: optionally the model's [`fp8jax.ConversionPlan`][] (from
      [`fp8jax.conversion_plan`][], or `Fp8Linen.plan`): the layers left in high precision
      are listed after the table, each with why (its role, its name, not targeted).
    - `file`: where to print (standard output by default); `quiet=True` only returns the text.

    **Returns:** the text. Call it outside `jit`: it fetches the values to the host.
    """
    if loss_scale is not None and not hasattr(loss_scale, "loss_scale"):
        raise TypeError(
            f"fp8jax.report: loss_scale={loss_scale!r} should be an fp8jax loss scale "
            "(NoOpLossScale, StaticLossScale, DynamicLossScale), e.g. state.loss_scale, or None."
        )
    if file is not None and not callable(getattr(file, "write", None)):
        raise TypeError(
            f"fp8jax.report: file={file!r} should be a text stream with a write method "
            "(sys.stdout, open(path, 'w')) or None."
        )
    if not isinstance(quiet, bool):
        raise TypeError(f"fp8jax.report: quiet={quiet!r} should be True or False.")
    layers = tree if _is_telemetry(tree) else telemetry(tree)
    factor = 1.0 if loss_scale is None else float(loss_scale.loss_scale)
    if factor != 1.0:
        layers = {name: _unscaled(layer, factor) for name, layer in layers.items()}
    header = [
        "layer",
        "operand",
        "format",
        "scale",
        "amax",
        "history max",
        "saturated",
        "zeroed",
        "non-finite steps",
    ]
    tokens = any(layer.experts is not None for layer in layers.values())
    if tokens:
        header.append("tokens")
    rows = [row for name, layer in layers.items() for row in _rows(name, layer, tokens)]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, ["-" * w for w in widths], *rows]
    ]
    if any(row[3] == "-" for row in rows):
        lines.append(
            "scale -: none recorded yet (the first step's amax sets it), or, in gradients, "
            "a layer that did not run in their step"
        )
    if loss_scale is not None:
        lines.append(_loss_scale_line(loss_scale))
    if factor != 1.0:
        lines.append(
            f"output_grad in the loss's units: amaxes divided by the loss scale ({factor:.6g}), "
            "scales multiplied by it (the state records the scaled gradients)"
        )
    if plan is not None:
        if not isinstance(plan, ConversionPlan):
            raise TypeError(
                f"fp8jax.report: plan={plan!r} should be an fp8jax.ConversionPlan "
                "(fp8jax.conversion_plan(model, config)) or None."
            )
        kept = plan.kept
        if not kept and not plan.unconverted:  # not a heading with nothing under it
            lines.append(f"high precision: none (all {len(plan.layers)} layers in FP8)")
        else:
            lines.append(f"high precision ({len(kept)} of {len(plan.layers)} layers):")
        lines += [f"  {path or ROOT}: {why}" for path, why in kept.items()]
        lines += [f"  not convertible: {u}" for u in plan.unconverted]
    text = "\n".join(lines)
    if not quiet:
        print(text, file=sys.stdout if file is None else file)
    return text


def _unscaled(layer: LayerTelemetry, factor: float) -> LayerTelemetry:
    """`layer` with its output gradient's amaxes divided by the loss scale `factor` and its
    scale multiplied by it: those of the loss's own gradients."""
    grad = layer.output_grad
    fields = (grad.scale * factor, grad.amax / factor, grad.history_max / factor)
    grad = eqx.tree_at(lambda t: (t.scale, t.amax, t.history_max), grad, fields)
    return eqx.tree_at(lambda t: t.output_grad, layer, grad)


def _is_telemetry(tree: Any) -> bool:
    return (
        isinstance(tree, dict)
        and bool(tree)
        and all(isinstance(v, LayerTelemetry) for v in tree.values())
    )

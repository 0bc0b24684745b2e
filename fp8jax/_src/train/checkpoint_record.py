"""What a checkpoint records of the state it holds (its FP8 layers, their recipes, every
leaf's path, shape and dtype; the axis names of a Haliax `NamedArray`'s), and how a record
is compared with the state to restore into: `fp8jax.load_checkpoint` refuses a difference,
naming it, before it reads an array."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ..ops.base import LayerTag
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot

#: Recipe options that choose how a GEMM runs (its kernel, MXFP8's `jax.nn.scaled_matmul`,
#: its emulation, its partial sums,
#: its weight's gather, the precision of its backward, the mesh axes its amaxes reduce
#: over), not what the state holds, or that act only while an amax history is empty (a
#: restored history decides the scale): a checkpoint restores across them (and across
#: versions before they existed).
IMPLEMENTATION_ONLY = frozenset(
    {
        "native_kernel",
        "warm_start",
        "dequantized_dot",
        "chunks_per_dot",
        "weight_gather",
        "backward_precision",
        "axis_names",
        "use_scaled_matmul",
    }
)


def is_layer(x: Any) -> bool:
    """Whether `x` is an FP8 op, whose recipe and telemetry a record names."""
    return isinstance(x, Fp8DotGeneral | Fp8RaggedDot)


def layer_tag(x: Any) -> LayerTag | None:
    """The FP8 layer whose state `x` holds, if `x` is a Flax NNX `Fp8State` variable (its
    `fp8_layer` metadata): an `nnx.State` holds such variables, not the layers."""
    tag = getattr(x, "fp8_layer", None) if hasattr(x, "get_value") else None
    return tag if isinstance(tag, LayerTag) else None


def is_array_like(x: Any) -> bool:
    """An array, or an abstract one (`jax.ShapeDtypeStruct`: a `like` made by
    `eqx.filter_eval_shape`, which restores without building the state first)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def fp8_record(tree: Any) -> dict[str, Any]:
    """What a checkpoint of `tree` holds: its FP8 layers and every leaf's path, shape, dtype;
    the axis names of each array that a Haliax `NamedArray` holds, if any does."""
    layers = {}

    def is_node(x: Any) -> bool:
        return is_layer(x) or layer_tag(x) is not None

    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
        tag = layer_tag(node)
        if tag is not None:  # a variable of an FP8 NNX layer's state, in an `nnx.State`
            where = jax.tree_util.keystr(path[: len(path) - tag.depth])
            entry = {"name": tag.name or where, "recipe": repr(tag.recipe)}
            entry |= {"telemetry": tag.telemetry, "variables": True}
            if tag.experts is not None:
                entry["experts"] = tag.experts
            layers[where] = entry
        elif is_layer(node):
            entry = {
                "name": node.name or jax.tree_util.keystr(path),
                "recipe": repr(node.recipe),
                "telemetry": node.stats is not None,
            }
            if isinstance(node, Fp8RaggedDot):
                entry["experts"] = node.num_experts
            layers[jax.tree_util.keystr(path)] = entry
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_array_like(leaf):
            leaves[jax.tree_util.keystr(path)] = [list(leaf.shape), np.dtype(leaf.dtype).name]
        elif isinstance(leaf, bool | int | float | complex):
            leaves[jax.tree_util.keystr(path)] = [type(leaf).__name__]
    axes = _named_axes(tree)
    return {"fp8_layers": layers, "leaves": leaves} | ({"axes": axes} if axes else {})


def _named_axes(tree: Any) -> dict[str, list[str]]:
    """The axis names of each Haliax `NamedArray` holding an array (looked up, never imported:
    without haliax imported, there is none), by its path. A record without them
    (written before they were recorded) restores unchecked."""
    haliax = sys.modules.get("haliax")
    if haliax is None:
        return {}

    def named(x: Any) -> bool:
        return isinstance(x, haliax.NamedArray)

    return {
        jax.tree_util.keystr(path): [axis.name for axis in node.axes]
        for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=named)[0]
        if named(node) and any(map(is_array_like, jax.tree.leaves(node)))
    }


def _recipe_fields(text: str) -> tuple[str, dict[str, str]] | None:
    """A recipe's repr, `Name(field=value, ...)`, as its name and its fields' values (as
    written), or `None` if it does not read so."""
    match = re.fullmatch(r"(\w+)\((.*)\)", text, re.DOTALL)
    if match is None:
        return None
    fields, depth, quote, start = {}, 0, "", 0
    body = match.group(2) + ","
    for i, char in enumerate(body):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            field, eq, value = body[start:i].strip().partition("=")
            if field:
                if not eq:
                    return None
                fields[field.strip()] = value.strip()
            start = i + 1
    return match.group(1), fields


def _same_value(saved: str | None, expected: str | None) -> bool:
    """Whether two field values, as a recipe's repr writes them, are equal: as Python
    literals where both read as such (`margin=0`, `margin=0.0` and `margin=np.float64(0.0)`
    are one recipe), else as written."""
    if saved == expected:
        return True

    def literal(text: str | None) -> Any:
        if text is not None:  # a NumPy scalar's repr, `np.float64(0.0)`: its value
            text = re.sub(r"^np\.\w+\((.*)\)$", r"\1", text)
        return ast.literal_eval(text)

    try:
        return literal(saved) == literal(expected)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _recipe_difference(saved: str, expected: str) -> str | None:
    """How the recipe a checkpoint recorded differs from the target's in what the state
    holds (`IMPLEMENTATION_ONLY` options aside), or `None` if it does not."""
    s, e = _recipe_fields(saved), _recipe_fields(expected)
    if s is None or e is None or s[0] != e[0]:
        return None if saved == expected else f"recipe {saved} != {expected}"
    differ = [
        f"{field} {s[1].get(field, '(unset)')} != {e[1].get(field, '(unset)')}"
        for field in dict.fromkeys([*s[1], *e[1]])
        if field not in IMPLEMENTATION_ONLY and not _same_value(s[1].get(field), e[1].get(field))
    ]
    return f"recipe {s[0]}: " + ", ".join(differ) if differ else None


def _layer_problems(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    problems, missing, extra = [], {}, {}
    # Records written before grouped layers were recorded have none: their leaves still are.
    grouped_recorded = any("experts" in entry for entry in saved.values())
    # Nor have those of an `nnx.State` (read from its variables) before they were recorded.
    variables_recorded = any(entry.get("variables") for entry in saved.values())
    for where in sorted(set(saved) | set(expected)):
        s, e = saved.get(where), expected.get(where)
        if s is None and "experts" in e and not grouped_recorded:
            continue
        if s is None and e.get("variables") and not variables_recorded:
            continue
        if s is None:
            missing.setdefault(e["name"], []).append(where)
        elif e is None:
            extra.setdefault(s["name"], []).append(where)
        else:
            diffs = [f"{k} {s[k]} != {e.get(k)}" for k in s if k != "recipe" and s[k] != e.get(k)]
            recipe = _recipe_difference(str(s.get("recipe")), str(e.get("recipe")))
            diffs += [recipe] if recipe else []
            if diffs:
                problems.append(f"FP8 layer {e['name']!r}: " + "; ".join(diffs))
    for name in sorted(set(missing) & set(extra)):
        problems.append(
            f"FP8 layer {name!r} is at {', '.join(extra.pop(name))} in the checkpoint, at "
            f"{', '.join(missing.pop(name))} in the target (another kind of state: a "
            "TrainState saved, its model given as `like`, or the other way round?)"
        )
    problems += [f"FP8 layer {name!r} is not in the checkpoint" for name in missing]
    problems += [f"the checkpoint has FP8 layer {n!r}, the target does not" for n in extra]
    return problems


def check_fp8_record(
    saved: dict[str, Any], expected: dict[str, Any], path: os.PathLike | str
) -> None:
    """Raise `ValueError` describing how `saved` differs from `expected`."""
    problems = _layer_problems(saved["fp8_layers"], expected["fp8_layers"])
    if not problems:
        s_leaves, e_leaves = saved["leaves"], expected["leaves"]
        for where in sorted(set(s_leaves) | set(e_leaves)):
            s, e = s_leaves.get(where), e_leaves.get(where)
            if s != e:
                keys = [saved.get("keys", {}).get(where), expected.get("keys", {}).get(where)]
                key = f" (the data of a PRNG key: {keys[0]} saved, {keys[1]} in the target)"
                problems.append(
                    f"leaf {where}: checkpoint has {_describe(s)}, target has {_describe(e)}"
                    + (key if any(keys) else "")
                )
    if problems:
        what, hint = "does not match the state to restore into", _CONFIG_HINT
        if expected["fp8_layers"] and not saved["fp8_layers"]:
            hint = _PLAIN_HINT
    else:  # the same config and shapes: only a Haliax array's axis names differ
        problems = _axes_problems(saved.get("axes", {}), expected.get("axes", {}))
        what, hint = "holds Haliax arrays under other axis names than the target", _AXES_HINT
    if problems:
        shown = "\n  - ".join(problems[:10])
        more = f"\n  (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(
            f"Checkpoint {os.fspath(path)!r} {what}; nothing was loaded:\n  - {shown}{more}\n"
            + hint
        )


_CONFIG_HINT = (
    "Build `like` with the same fp8_linear_layers config (targets, recipes, telemetry), "
    "optimizer and loss scale as when saving."
)
_PLAIN_HINT = (
    "The checkpoint holds no FP8 layer (a model saved before fp8_linear_layers converted it?): "
    "load it with the unconverted model as `like`, then convert the result; its FP8 layers "
    "start with a fresh FP8 state (delayed scaling's warm start)."
)
_AXES_HINT = (
    "A Haliax array restores only under the axis names, in the order, it was saved with. To "
    "restore anyway, give `like` the saved axes (`haliax.rename` its arrays to the saved names; "
    "for another order, build it in the saved one), load, then rename (or `haliax.rearrange`) "
    "the result."
)


def _axes_problems(saved: dict[str, list[str]], expected: dict[str, list[str]]) -> list[str]:
    """How the axis names of the Haliax arrays at the same paths differ (an array read under
    other names, or in another order, would mean another thing)."""
    return [
        f"leaf {w}: checkpoint has axes {tuple(saved[w])}, target has axes {tuple(expected[w])}"
        for w in sorted(set(saved) & set(expected))
        if saved[w] != expected[w]
    ]


def _describe(entry: list | None) -> str:
    if entry is None:
        return "nothing"
    if len(entry) == 1:
        return f"a Python {entry[0]}"
    return f"{entry[1]}{tuple(entry[0])}"


#: A checkpoint's format version, as an Equinox checkpoint's first line and an orbax
#: checkpoint's `fp8jax_format` file hold it: the version this fp8jax writes and reads.
MAGIC = b"fp8jax-checkpoint 1\n"


def check_format(magic: bytes, path: os.PathLike | str, where: str | None = None) -> None:
    """Raise `ValueError` if `magic` is the header of another format version than `MAGIC`'s,
    naming both (a newer fp8jax's checkpoint); if `where` names the file holding `magic`,
    also if it is no header at all (the checkpoint is corrupt)."""
    if magic != MAGIC and re.fullmatch(rb"fp8jax-checkpoint \d+\n", magic):
        raise ValueError(
            f"{os.fspath(path)!r} is an fp8jax checkpoint of format version {int(magic[18:])};"
            f" this fp8jax reads version {int(MAGIC[18:])} (load it with the fp8jax that "
            "wrote it, or a newer one)."
        )
    if magic != MAGIC and where is not None:
        raise corrupt(path, f"its {where} holds {magic[:40]!r}, not {MAGIC!r}")


def corrupt(path: os.PathLike | str, why: str) -> ValueError:
    """The error for a checkpoint that cannot be read as written."""
    # Not "nothing was loaded": that phrase marks a record that differs from `like`'s.
    return ValueError(f"Checkpoint {os.fspath(path)!r} is truncated or corrupt: {why}.")


def parse_record(data: bytes, path: os.PathLike | str) -> dict[str, Any]:
    """The record a checkpoint starts with, checked to have the shape `fp8_record` gives it."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(path, f"its record is not valid JSON ({e})") from None
    ok = (
        isinstance(record, dict)
        and isinstance(record.get("fp8_layers"), dict)
        and isinstance(record.get("leaves"), dict)
        and all(isinstance(v, dict) and "name" in v for v in record["fp8_layers"].values())
        and all(isinstance(v, list) for v in record["leaves"].values())
        and isinstance(record.get("axes", {}), dict)
        and all(
            isinstance(v, list) and all(isinstance(n, str) for n in v)
            for v in record.get("axes", {}).values()
        )
    )
    if not ok:
        raise corrupt(path, "its record does not list FP8 layers and leaves")
    return record

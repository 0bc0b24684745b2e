"""Hostile inputs to the public surface, one table: each row is a call that must fail cleanly.

A row gives the call, the exception type and a phrase of its message: the message names the
offending value and what is accepted (DESIGN.md section 8), never a raw JAX, NumPy or
`KeyError`/`AttributeError` from deep inside. After every call, failed or not, the shared
model, its optimizer state and the checkpoint files (bytes, modification times, and no stray
temporary files) are checked to be exactly as they were.
"""

import dataclasses
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax

MATMUL = (((1,), (0,)), ((), ()))
X = jnp.linspace(-2.0, 2.0, 32, dtype=jnp.float32).reshape(8, 4)


CONFIG = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(history_len=4), telemetry=True)


def _loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _model(width: int = 8, config: fp8jax.Fp8Config | None = None) -> Any:
    mlp = eqx.nn.MLP(4, 2, width, 2, key=jax.random.key(0))
    return fp8jax.fp8_linear_layers(mlp, config or CONFIG)


def _like(width=8, config=None, optimizer=None, policy=None) -> fp8jax.TrainState:
    """The state of another run, to restore the shared checkpoint into."""
    step = fp8jax.make_train_step(_loss, optimizer or optax.adam(1e-2), policy=policy)
    return step.init(_model(width, config))


@dataclasses.dataclass(frozen=True)
class World:
    """What every row may use, built once; none of it may change."""

    plain: Any  # an eqx.nn.MLP, not converted
    state: fp8jax.TrainState  # an FP8 MLP and Adam's state after one step
    step: fp8jax.TrainStep
    base: pathlib.Path  # holds ckpts/ (below) and nothing else
    ckpts: pathlib.Path  # good.eqx (a checkpoint of `state`) and hostile files

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def dot(self) -> fp8jax.Fp8DotGeneral:
        return self.state.model.layers[0].dot_general

    @property
    def linear(self) -> fp8jax.Linear:
        return self.state.model.layers[0]

    def file(self, name: str) -> pathlib.Path:
        return self.ckpts / name


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    step = fp8jax.make_train_step(_loss, optax.adam(1e-2))
    state, _ = step(step.init(_model()), X)  # non-trivial FP8 state and moments
    base = tmp_path_factory.mktemp("hostile")
    ckpts = base / "ckpts"
    ckpts.mkdir()
    good = ckpts / "good.eqx"
    fp8jax.save_checkpoint(good, state)
    raw = good.read_bytes()
    header = len(b"fp8jax-checkpoint 1\n") + 8
    files = {
        "empty.eqx": b"",
        "text.eqx": b"hello, not a checkpoint\n",
        "magic_only.eqx": raw[: header - 8],
        "cut_record.eqx": raw[: header + 40],
        "cut_data.eqx": raw[:-10],
        "half.eqx": raw[: len(raw) // 2],
        "trailing.eqx": raw + b"junk",
        "not_json.eqx": raw[:header] + b"\xff" * (len(raw) - header),
        "empty_record.eqx": raw[: header - 8] + (2).to_bytes(8, "little") + b"{}",
        "huge_record.eqx": raw[: header - 8] + (2**62).to_bytes(8, "little") + b"{}",
        "no_leaves.eqx": raw[: header - 8] + (18).to_bytes(8, "little") + b'{"fp8_layers": {}}',
    }
    for name, data in files.items():
        (ckpts / name).write_bytes(data)
    eqx.tree_serialise_leaves(ckpts / "plain_equinox.eqx", state)
    plain = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(1))
    yield World(plain, state, step, base, ckpts)


def _snapshot(world: World) -> tuple:
    """Every array bit, the tree structures (static configuration included) and every file."""
    leaves, treedef = jax.tree_util.tree_flatten((world.plain, world.state, world.step))
    arrays = [
        (str(x.dtype), x.shape, np.asarray(x).tobytes()) if eqx.is_array(x) else repr(x)
        for x in leaves
    ]
    files = {}
    for path in sorted(world.base.rglob("*")):
        info = path.stat()
        data = path.read_bytes() if path.is_file() else None
        files[str(path.relative_to(world.base))] = (data, info.st_mtime_ns, info.st_mode)
    return treedef, arrays, files


# --- the table ------------------------------------------------------------------------------


def row(name: str, call: Callable[[World], Any], error: type, match: str, *marks) -> Any:
    """One hostile call: `call(world)` raises `error` with a message matching `match`."""
    return pytest.param(call, error, match, id=name, marks=marks)


BLOCKS_FILE = "recipes/blocks.py"
RESIDUAL_FILE = "recipes/residual.py"
BASE_FILE = "recipes/base.py"

DOT_GENERAL = [
    # construction
    row(
        "dot-recipe-unknown",
        lambda w: fp8jax.Fp8DotGeneral("tensorwise"),
        ValueError,
        r"Unknown recipe 'tensorwise'.*'current', 'delayed'",
    ),
    row("dot-recipe-int", lambda w: fp8jax.Fp8DotGeneral(3), ValueError, r"Unknown recipe 3"),
    row(
        "dot-recipe-class",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling),
        ValueError,
        r"recipe=DelayedScaling is a recipe class; pass an instance, DelayedScaling\(\)",
    ),
    row(
        "dot-recipe-wrong-case",
        lambda w: fp8jax.Fp8DotGeneral("Delayed"),
        ValueError,
        r"Unknown recipe 'Delayed'",
    ),
    row(
        "dot-telemetry-int",
        lambda w: fp8jax.Fp8DotGeneral(telemetry=1),
        TypeError,
        r"telemetry=1: should be True or False",
    ),
    row(
        "dot-telemetry-str",
        lambda w: fp8jax.Fp8DotGeneral(telemetry="yes"),
        TypeError,
        r"telemetry='yes': should be True or False",
    ),
    row(
        "dot-telemetry-none",
        lambda w: fp8jax.Fp8DotGeneral(telemetry=None),
        TypeError,
        r"telemetry=None: should be True or False",
    ),
    row(
        "dot-name-int",
        lambda w: fp8jax.Fp8DotGeneral(name=3),
        TypeError,
        r"name=3",
    ),
    row(
        "dot-residual-needs-kernel-shape",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True)),
        ValueError,
        r"needs its shape: pass kernel_shape=\(out_features, in_features\)",
    ),
    row(
        "dot-kernel-shape-1d",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True), (4,)),
        ValueError,
        r"kernel_shape=\(4,\)",
    ),
    row(
        "dot-kernel-shape-negative",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True), (4, -1)),
        ValueError,
        r"kernel_shape=\(4, -1\)",
    ),
    row(
        "dot-kernel-shape-str",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True), "ab"),
        ValueError,
        r"kernel_shape='ab'",
    ),
    row(
        "dot-kernel-shape-float",
        lambda w: fp8jax.Fp8DotGeneral(None, (4.5, 3)),
        ValueError,
        r"kernel_shape=\(4.5, 3\)",
    ),
    row(
        "dot-kernel-shape-disagrees-with-call",
        lambda w: fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(error_feedback=True), (4, 3))(
            jnp.ones((2, 5)), jnp.ones((5, 7)), MATMUL
        ),
        ValueError,
        r"kernel_shape \(4, 3\).*\(7, 5\)",
    ),
    # operands
    row(
        "dot-lhs-int32",
        lambda w: w.dot(jnp.ones((2, 4), jnp.int32), jnp.ones((4, 8)), MATMUL),
        TypeError,
        r"lhs has dtype int32; FP8 GEMMs take floating inputs",
    ),
    row(
        "dot-rhs-bool",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8), bool), MATMUL),
        TypeError,
        r"rhs has dtype bool",
    ),
    row(
        "dot-lhs-already-fp8",
        lambda w: w.dot(jnp.ones((2, 4), jnp.float8_e4m3fn), jnp.ones((4, 8)), MATMUL),
        TypeError,
        r"lhs is already float8_e4m3fn",
    ),
    row(
        "dot-lhs-list",
        lambda w: w.dot([[1.0, 2.0, 3.0, 4.0]], jnp.ones((4, 8)), MATMUL),
        TypeError,
        r"lhs",
    ),
    row(
        "dot-lhs-none",
        lambda w: w.dot(None, jnp.ones((4, 8)), MATMUL),
        TypeError,
        r"lhs=None",
    ),
    row(
        "dot-rhs-str",
        lambda w: w.dot(jnp.ones((2, 4)), "abc", MATMUL),
        TypeError,
        r"rhs='abc'",
    ),
    row(
        "dot-contracting-sizes-differ",
        lambda w: w.dot(jnp.ones((2, 3)), jnp.ones((5, 4)), MATMUL),
        ValueError,
        r"lhs \(2, 3\) axis 1 has size 3 but rhs \(5, 4\) axis 0 has size 5",
    ),
    row(
        "dot-batch-sizes-differ",
        lambda w: w.dot(jnp.ones((2, 3, 4)), jnp.ones((5, 4, 6)), (((2,), (1,)), ((0,), (0,)))),
        ValueError,
        r"axis 0 has size 2 but rhs \(5, 4, 6\) axis 0 has size 5 \(batch axes",
    ),
    # dimension_numbers, malformed in many ways
    row(
        "dims-none",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), None),
        ValueError,
        r"dimension_numbers=None: should be \(\(lhs_contracting, rhs_contracting\)",
    ),
    row(
        "dims-int",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), 1),
        ValueError,
        r"dimension_numbers=1: should be",
    ),
    row(
        "dims-dict",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), {"lhs": 1}),
        ValueError,
        r"dimension_numbers=\{'lhs': 1\}: should be",
    ),
    row(
        "dims-three-parts",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), (((1,), (0,)), ((), ()), ())),
        ValueError,
        r"dimension_numbers=\(\(\(1,\), \(0,\)\), \(\(\), \(\)\), \(\)\): should be",
    ),
    row(
        "dims-no-batch-part",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), ((1,), (0,))),
        ValueError,
        r"dimension_numbers=\(\(1,\), \(0,\)\): should be",
    ),
    row(
        "dims-float-axis",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), ((1.0, 0), ((), ()))),
        ValueError,
        r"each a tuple of ints",
    ),
    row(
        "dims-str-axis",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), ((("a",), (0,)), ((), ()))),
        ValueError,
        r"dimension_numbers=\(\(\('a',\), \(0,\)\), \(\(\), \(\)\)\): should be",
    ),
    row(
        "dims-float-axis",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), (((1.5,), (0,)), ((), ()))),
        ValueError,
        r"dimension_numbers=\(\(\(1.5,\)",
    ),
    row(
        "dims-axis-out-of-range",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), (((2,), (0,)), ((), ()))),
        ValueError,
        r"lhs axes \(2,\) must be distinct and within range for lhs shape \(2, 4\)",
    ),
    row(
        "dims-negative-axis",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), (((-1,), (0,)), ((), ()))),
        ValueError,
        r"lhs axes \(-1,\) must be distinct and within range",
    ),
    row(
        "dims-repeated-axis",
        lambda w: w.dot(jnp.ones((4, 4)), jnp.ones((4, 4)), (((0, 0), (0, 1)), ((), ()))),
        ValueError,
        r"lhs axes \(0, 0\) must be distinct",
    ),
    row(
        "dims-axis-both-batch-and-contracting",
        lambda w: w.dot(jnp.ones((3, 3)), jnp.ones((3, 3)), (((0,), (0,)), ((0,), (1,)))),
        ValueError,
        r"lhs axes \(0, 0\) must be distinct",
    ),
    row(
        "dims-batch-count-differs",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 4)), (((1,), (0,)), ((0,), ()))),
        ValueError,
        r"1 lhs batch axes but 0 rhs batch axes",
    ),
    row(
        "dims-contracting-count-differs",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 4)), (((1,), (0, 1)), ((), ()))),
        ValueError,
        r"1 lhs contracting axes but 2 rhs contracting axes",
    ),
    # precision and preferred_element_type
    row(
        "dot-precision-unknown-str",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, precision="fast"),
        ValueError,
        r"(?s)Precision argument must be one of:.*'highest'.*but got fast\.",
    ),
    row(
        "dot-precision-int",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, precision=3),
        ValueError,
        r"(?s)Precision argument must be one of:.*but got 3\.",
    ),
    row(
        "dot-precision-three-values",
        lambda w: w.dot(jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, precision=(None,) * 3),
        ValueError,
        r"(?s)Precision argument must be one of:.*but got \(None, None, None\)\.",
    ),
    row(
        "dot-preferred-int32",
        lambda w: w.dot(
            jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, preferred_element_type=jnp.int32
        ),
        TypeError,
        r"preferred_element_type=.*int32.* float type; use float32",
    ),
    row(
        "dot-preferred-unknown-name",
        lambda w: w.dot(
            jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, preferred_element_type="floaty"
        ),
        TypeError,
        r"preferred_element_type=.?floaty.? .*float type; use float32",
    ),
    row(
        # lax.dot_general refuses an array here ('Passing an array as a dtype argument is no
        # longer supported'); the FP8 op took its dtype without a word.
        "dot-preferred-array",
        lambda w: w.dot(
            jnp.ones((2, 4)), jnp.ones((4, 8)), MATMUL, preferred_element_type=jnp.ones(3)
        ),
        TypeError,
        r"preferred_element_type is an array of float32, not a dtype; pass its dtype",
    ),
]

LINEAR = [
    row(
        "linear-weight-3d",
        lambda w: fp8jax.Linear(jnp.ones((2, 3, 4)), None),
        ValueError,
        r"weight has shape \(2, 3, 4\); should be \(out_features, in_features\)",
    ),
    row(
        "linear-weight-list",
        lambda w: fp8jax.Linear([[1.0, 2.0], [3.0, 4.0]], None),
        TypeError,
        r"weight is a list; should be an array",
    ),
    row(
        "linear-weight-int",
        lambda w: fp8jax.Linear(jnp.ones((3, 4), jnp.int32), None),
        TypeError,
        r"weight has dtype int32; should be a floating dtype",
    ),
    row(
        "linear-bias-shape",
        lambda w: fp8jax.Linear(jnp.ones((3, 4)), jnp.ones((3, 1))),
        ValueError,
        r"bias has shape \(3, 1\); should be \(3,\)",
    ),
    row(
        "linear-bias-list",
        lambda w: fp8jax.Linear(jnp.ones((3, 4)), [0.0, 0.0, 0.0]),
        TypeError,
        r"bias is a list; should be an array of shape \(3,\) or None",
    ),
    row(
        "linear-in-features-disagree",
        lambda w: fp8jax.Linear(jnp.ones((3, 4)), None, in_features=5),
        ValueError,
        r"in_features=5 does not match the weight: should be None or 4",
    ),
    row(
        "linear-out-features-unknown",
        lambda w: fp8jax.Linear(jnp.ones((3, 4)), None, out_features="vector"),
        ValueError,
        r"out_features='vector' does not match the weight: should be None or 3",
    ),
    row(
        "linear-dot-general-str",
        lambda w: fp8jax.Linear(jnp.ones((3, 4)), None, dot_general="delayed"),
        TypeError,
        r"dot_general='delayed': should be None .* or a callable",
    ),
    row(
        "linear-call-wrong-features",
        lambda w: w.linear(jnp.ones((2, 5))),
        ValueError,
        r"Linear expects x of shape \(\.\.\., 4\); got \(2, 5\)",
    ),
    row(
        "linear-call-scalar",
        lambda w: w.linear(jnp.float32(1.0)),
        ValueError,
        r"Linear expects x of shape \(\.\.\., 4\); got \(\)",
    ),
    row(
        "linear-call-list",
        lambda w: w.linear([1.0, 2.0, 3.0, 4.0]),
        TypeError,
        r"Linear expects x as an array of shape \(\.\.\., 4\); got a list",
    ),
    row(
        "linear-call-int",
        lambda w: w.linear(jnp.ones(4, jnp.int32)),
        TypeError,
        r"lhs has dtype int32",
    ),
]


def _norm_and_linear() -> dict:
    return {"norm": eqx.nn.LayerNorm(4), "fc": eqx.nn.Linear(4, 4, key=jax.random.key(0))}


def _head_and_fc() -> dict:
    key = jax.random.key(0)
    return {"head": eqx.nn.Linear(4, 4, key=key), "fc": eqx.nn.Linear(4, 4, key=key)}


convert, Config = fp8jax.fp8_linear_layers, fp8jax.Fp8Config

CONVERSION = [
    row(
        "config-str",
        lambda w: convert(w.plain, ".*"),
        TypeError,
        r"config='\.\*': should be an fp8jax.Fp8Config or None; to convert only the layers "
        r"it names, fp8jax.Fp8Config\(targets='\.\*'\)",
    ),
    row(
        "config-recipe-name",
        lambda w: convert(w.plain, "current"),
        TypeError,
        r"config='current': should be an fp8jax.Fp8Config or None; for that recipe, pass "
        r"fp8jax.Fp8Config\(recipe='current'\)",
    ),
    row(
        "config-recipe",
        lambda w: convert(w.plain, fp8jax.MXFP8()),
        TypeError,
        r"config=MXFP8\(.*\): should be an fp8jax.Fp8Config or None; for that recipe, pass "
        r"fp8jax.Fp8Config\(recipe=MXFP8\(",
    ),
    row(
        "config-dict",
        lambda w: convert(w.plain, {"recipe": "current"}),
        TypeError,
        r"config=\{'recipe': 'current'\}: should be an fp8jax.Fp8Config or None; for a dict of "
        r"its fields, pass fp8jax.Fp8Config\(\*\*config\)",
    ),
    row(
        "config-class",
        lambda w: convert(w.plain, Config),
        TypeError,
        r"config=Fp8Config \(the class\): should be an fp8jax.Fp8Config or None; pass an "
        r"instance, fp8jax.Fp8Config\(\) \(its fields as arguments\)",
    ),
    row(
        "config-dict",
        lambda w: convert(w.plain, {"targets": None}),
        TypeError,
        r"config=\{'targets': None\}: should be an fp8jax.Fp8Config",
    ),
    row(
        "targets-int",
        lambda w: Config(targets=3),
        ValueError,
        r"targets=3: should be None, a regex string or a list of layer names",
    ),
    row(
        "targets-list-of-ints",
        lambda w: Config(targets=[1, 2]),
        ValueError,
        r"targets=\[1, 2\]: should be None",
    ),
    row(
        "targets-set-of-ints",  # a set of names is a list's config
        lambda w: Config(targets={1}),
        ValueError,
        r"targets=\{1\}: should be None",
    ),
    row(
        "targets-bytes",
        lambda w: Config(targets=b"layers"),
        ValueError,
        r"targets=b'layers': should be None",
    ),
    row(
        "targets-bad-regex",
        lambda w: Config(targets="layers.[0"),
        ValueError,
        r"targets='layers.\[0' is not a valid regex",
    ),
    row(
        "targets-regex-matches-nothing",
        lambda w: convert(w.plain, Config(targets=r"blocks\..*")),
        ValueError,
        r"matches no Linear layer .*Linear layers: 'layers.0', 'layers.1'",
    ),
    row(
        "targets-empty-regex",
        lambda w: convert(w.plain, Config(targets="")),
        ValueError,
        r"targets='' matches no Linear layer",
    ),
    row(
        "targets-name-matches-nothing",
        lambda w: convert(w.plain, Config(targets=["fc9"])),
        ValueError,
        r"target 'fc9' matches no Linear layer. Linear layers: 'layers.0'",
    ),
    row(
        "targets-names-are-not-regexes",
        lambda w: convert(w.plain, Config(targets=["layers.[0-9]"])),
        ValueError,
        r"target 'layers.\[0-9\]' matches no Linear layer",
    ),
    row(
        "targets-regex-matches-non-linear",
        lambda w: convert(_norm_and_linear(), Config(targets="norm")),
        ValueError,
        r"matches only modules that are not Linear: 'norm' \(LayerNorm\). Linear layers: 'fc'",
    ),
    row(
        "targets-name-of-non-linear",
        lambda w: convert(_norm_and_linear(), Config(targets=["norm"])),
        ValueError,
        r"target 'norm' names 'norm', a LayerNorm, not a Linear layer",
    ),
    row(
        "targets-all-excluded",
        lambda w: convert(_head_and_fc(), Config(targets=["head"])),
        ValueError,
        r"target 'head' selects only 'head', which exclude=.* keeps in high precision",
    ),
    row(
        "exclude-int",
        lambda w: Config(exclude=3),
        ValueError,
        r"exclude=3",
    ),
    row(
        "exclude-list",
        lambda w: Config(exclude=["head"]),
        ValueError,
        r"exclude=\['head'\]: .*a Linear's last name or its whole dotted path",
    ),
    row(
        "exclude-bad-regex",
        lambda w: Config(exclude="(head"),
        ValueError,
        r"exclude='\(head' is not a valid regex",
    ),
    row("recipe-unknown", lambda w: Config(recipe="fp8"), ValueError, r"Unknown recipe 'fp8'"),
    row(
        "recipes-not-mapping",
        lambda w: Config(recipes=[("layers.0", "current")]),
        ValueError,
        r"recipes=\[\('layers.0', 'current'\)\]: should be a mapping",
    ),
    row(
        "recipes-unknown-recipe",
        lambda w: Config(recipes={"layers.0": "fast"}),
        ValueError,
        r"recipes pattern 'layers.0': Unknown recipe 'fast'",
    ),
    row(
        "recipes-bad-pattern",
        lambda w: Config(recipes={"(": "current"}),
        ValueError,
        r"recipes pattern='\(' is not a valid regex",
    ),
    row(
        "recipes-non-str-pattern",
        lambda w: Config(recipes={1: "current"}),
        ValueError,
        r"recipes pattern.*1",
    ),
    row(
        "recipes-pattern-matches-nothing",
        lambda w: convert(w.plain, Config(recipes={"fc9": "current"})),
        ValueError,
        r"recipes pattern 'fc9' matches no converted layer. Converted layers: 'layers.0'",
    ),
    row(
        "config-telemetry-int",
        lambda w: Config(telemetry=1),
        ValueError,
        r"telemetry=1: should be True or False",
    ),
    row(
        "tree-without-linears",
        lambda w: convert({"w": jnp.ones(3)}),
        ValueError,
        r"found no Linear layer",
    ),
]

D, C, B, MX, R = (
    fp8jax.DelayedScaling,
    fp8jax.CurrentScaling,
    fp8jax.BlockwiseScaling,
    fp8jax.MXFP8,
    fp8jax.ResidualFP8,
)
NAN, INF = float("nan"), float("inf")

RECIPES = [
    row(
        "delayed-warm-start-not-bool",
        lambda w: D(warm_start="yes"),
        ValueError,
        r"warm_start='yes': should be True or False",
    ),
    row(
        "delayed-history-0",
        lambda w: D(history_len=0),
        ValueError,
        r"history_len=0: should be an int >= 1",
    ),
    row(
        "delayed-history-negative",
        lambda w: D(history_len=-1),
        ValueError,
        r"history_len=-1: should be an int >= 1",
    ),
    row(
        "delayed-history-float",
        lambda w: D(history_len=1.5),
        ValueError,
        r"history_len=1.5: should be an int >= 1",
    ),
    row(
        "delayed-history-bool",
        lambda w: D(history_len=True),
        ValueError,
        r"history_len=True: should be an int >= 1",
    ),
    row(
        "delayed-history-str",
        lambda w: D(history_len="8"),
        ValueError,
        r"history_len='8': should be an int >= 1",
    ),
    row(
        "delayed-amax-compute",
        lambda w: D(amax_compute="mean"),
        ValueError,
        r"Unknown amax_compute 'mean': should be one of \['max', 'most_recent'\]",
    ),
    row(
        "delayed-margin-nan",
        lambda w: D(margin=NAN),
        ValueError,
        r"margin=nan",
    ),
    row(
        "delayed-margin-inf",
        lambda w: D(margin=INF),
        ValueError,
        r"margin=inf",
    ),
    row(
        "delayed-margin-str",
        lambda w: D(margin="1"),
        ValueError,
        r"margin='1'",
    ),
    row(
        "current-margin-nan",
        lambda w: C(margin=NAN),
        ValueError,
        r"margin=nan",
    ),
    row(
        "current-margin-none",
        lambda w: C(margin=None),
        ValueError,
        r"margin=None",
    ),
    row(
        "delayed-margin-past-float32",
        lambda w: D(margin=-200),
        ValueError,
        r"margin=-200: should be a finite number .* from -32 to 32",
    ),
    row(
        "current-margin-past-float32",
        lambda w: C(margin=32.5),
        ValueError,
        r"margin=32.5: should be a finite number .* from -32 to 32",
    ),
    row(
        "blockwise-block-0",
        lambda w: B(block_size=0),
        ValueError,
        r"block_size=0: should be an int >= 1",
    ),
    row(
        "blockwise-block-bool",
        lambda w: B(block_size=True),
        ValueError,
        r"block_size=True",
    ),
    row(
        "blockwise-format",
        lambda w: B(format_name="e2m1"),
        ValueError,
        r"Unknown FP8 format 'e2m1': should be one of \['e4m3'",
    ),
    row(
        "blockwise-format-not-fp8",
        lambda w: B(format_name=jnp.float32),
        ValueError,
        r"Unknown FP8 format .*float32",
    ),
    row(
        "blockwise-chunks-0",
        lambda w: B(chunks_per_dot=0),
        ValueError,
        r"chunks_per_dot=0: should be None \(all chunks in one batched dot\) or an int >= 1",
    ),
    row(
        "blockwise-chunks-bool",
        lambda w: B(chunks_per_dot=True),
        ValueError,
        r"chunks_per_dot=True: should be None .* or an int >= 1",
    ),
    row(
        "blockwise-dequantized-int",
        lambda w: B(dequantized_dot=1),
        ValueError,
        r"dequantized_dot=1: should be True or False",
    ),
    row(
        "blockwise-power-of-two-str",
        lambda w: B(power_of_two="yes"),
        ValueError,
        r"power_of_two='yes'",
    ),
    row(
        "mxfp8-block-0",
        lambda w: MX(block_size=0),
        ValueError,
        r"block_size=0",
    ),
    row(
        "mxfp8-block-str",
        lambda w: MX(block_size="32"),
        ValueError,
        r"block_size='32'",
    ),
    row(
        "mxfp8-scale-rounding",
        lambda w: MX(scale_rounding="round"),
        ValueError,
        r"Unknown scale_rounding 'round': should be 'ceil' or 'floor'",
    ),
    row(
        "mxfp8-use-scaled-matmul-str",
        lambda w: MX(use_scaled_matmul="yes"),
        ValueError,
        r"use_scaled_matmul='yes'",
    ),
    row(
        "residual-split-activation-int",
        lambda w: R(split_activation=1),
        ValueError,
        r"split_activation=1",
    ),
    row(
        "residual-dgrad-uses-lo-str",
        lambda w: R(dgrad_uses_lo="no"),
        ValueError,
        r"dgrad_uses_lo='no'",
    ),
    row(
        "residual-error-feedback-none",
        lambda w: R(error_feedback=None),
        ValueError,
        r"error_feedback=None",
    ),
    row(
        "residual-nf-aware-str",
        lambda w: R(nf_aware="yes"),
        ValueError,
        r"nf_aware='yes'",
    ),
    row(
        "residual-nf-aware-and-predicted-lo",
        lambda w: R(nf_aware=True, predict_lo_scale=True),
        ValueError,
        r"ResidualFP8\(nf_aware=True, predict_lo_scale=True\).*Use one of the two",
    ),
    row(
        "forward-format",
        lambda w: D(forward_format="bf16"),
        ValueError,
        r"Unknown FP8 format 'bf16'",
    ),
    row(
        "backward-format",
        lambda w: R(backward_format="e2m1"),
        ValueError,
        r"Unknown FP8 format 'e2m1'",
    ),
    row(
        "backward-precision",
        lambda w: C(backward_precision="fast"),
        ValueError,
        r"Unknown backward_precision 'fast': should be one of \['default', 'high', 'highest'\]",
    ),
    row(
        "axis-names-str",
        lambda w: D(axis_names="data"),
        ValueError,
        r"axis_names='data': should be a tuple of mesh axis names",
    ),
    row(
        "axis-names-int-inside",
        lambda w: B(axis_names=("data", 3)),
        ValueError,
        r"axis_names=\('data', 3\): should be a tuple",
    ),
    row(
        "axis-names-none",
        lambda w: MX(axis_names=None),
        ValueError,
        r"axis_names=None",
    ),
]

P = fp8jax.Policy

POLICY = [
    row("policy-empty", lambda w: P.from_string(""), ValueError, r"empty spec; expected e.g."),
    row("policy-blank", lambda w: P.from_string("  "), ValueError, r"empty spec"),
    row(
        "policy-unknown-key",
        lambda w: P.from_string("x=f32"),
        ValueError,
        r"unknown key 'x' in 'x=f32'; accepted keys: params \(param, p\), compute \(c\)",
    ),
    row(
        "policy-duplicate-key",
        lambda w: P.from_string("params=f32,params=bf16"),
        ValueError,
        r"'params=f32' and 'params=bf16' .* both set the params dtype",
    ),
    row(
        "policy-duplicate-alias",
        lambda w: P.from_string("p=f32,param=bf16"),
        ValueError,
        r"'p=f32' and 'param=bf16' .* both set the params dtype",
    ),
    row(
        "policy-integer-dtype",
        lambda w: P.from_string("params=int32"),
        ValueError,
        r"params='int32' is int32, not a floating-point dtype; use float32",
    ),
    row(
        "policy-complex-dtype",
        lambda w: P.from_string("compute=complex64"),
        ValueError,
        r"compute='complex64' is complex64, not a floating-point dtype",
    ),
    row(
        "policy-unknown-dtype",
        lambda w: P.from_string("params=floaty"),
        ValueError,
        r"params='floaty' is not a dtype; use float32 \(f32, full\)",
    ),
    row(
        "policy-no-equals",
        lambda w: P.from_string("params"),
        ValueError,
        r"'params' in 'params' is not a key=dtype pair",
    ),
    row(
        "policy-semicolon",
        lambda w: P.from_string("params=f32;compute=bf16"),
        ValueError,
        r"'params=f32;compute=bf16' .* is not a key=dtype pair",
    ),
    row(
        "policy-trailing-comma",
        lambda w: P.from_string("params=f32,"),
        ValueError,
        r"'' in 'params=f32,' is not a key=dtype pair",
    ),
    row(
        "policy-spec-none",
        lambda w: P.from_string(None),
        TypeError,
        r"spec=None should be a string like 'params=float32",
    ),
    row(
        "policy-spec-bytes",
        lambda w: P.from_string(b"params=f32"),
        TypeError,
        r"spec=b'params=f32' should be a string",
    ),
    row(
        "policy-field-int-dtype",
        lambda w: P(param_dtype=jnp.int32),
        ValueError,
        r"param_dtype=int32, not a floating-point dtype",
    ),
    row(
        "policy-field-unknown",
        lambda w: P(compute_dtype="bf17"),
        ValueError,
        r"compute_dtype='bf17' is not a dtype",
    ),
    row(
        "policy-field-none",
        lambda w: P(output_dtype=None),
        ValueError,
        r"output_dtype=None: give a dtype",
    ),
]

S, Dyn = fp8jax.StaticLossScale, fp8jax.DynamicLossScale

LOSS_SCALES = [
    row("static-zero", lambda w: S(0), ValueError, r"loss_scale=0 should be positive"),
    row("static-negative", lambda w: S(-1.0), ValueError, r"loss_scale=-1.0 should be positive"),
    row("static-nan", lambda w: S(NAN), ValueError, r"loss_scale=nan should be finite"),
    row("static-inf", lambda w: S(INF), ValueError, r"loss_scale=inf should be finite"),
    row(
        "static-beyond-float32",
        lambda w: S(1e39),
        ValueError,
        r"loss_scale=1e\+39 should be finite in float32",
    ),
    row("static-str", lambda w: S("1"), TypeError, r"loss_scale='1' should be a real number"),
    row("static-bool", lambda w: S(True), TypeError, r"loss_scale=True should be a real number"),
    row("static-vector", lambda w: S(jnp.ones(2)), TypeError, r"should be a real number"),
    row(
        "dynamic-below-min",
        lambda w: Dyn(loss_scale=0.5),
        ValueError,
        r"loss_scale=0.5 should be at least min_loss_scale=1.0",
    ),
    row(
        "dynamic-period-0",
        lambda w: Dyn(period=0),
        ValueError,
        r"period=0 should be an integer >= 1",
    ),
    row(
        "dynamic-period-float",
        lambda w: Dyn(period=1.5),
        ValueError,
        r"period=1.5 should be an integer >= 1",
    ),
    row(
        "dynamic-period-bool",
        lambda w: Dyn(period=True),
        ValueError,
        r"period=True should be an integer >= 1",
    ),
    row(
        "dynamic-period-beyond-int32",
        lambda w: Dyn(period=2**40),
        ValueError,
        r"period=1099511627776 should be an integer >= 1 and <= 2147483647",
    ),
    row(
        "dynamic-factor-1", lambda w: Dyn(factor=1), ValueError, r"factor=1 should be a number > 1"
    ),
    row(
        "dynamic-factor-nan", lambda w: Dyn(factor=NAN), ValueError, r"factor=nan should be finite"
    ),
    row(
        "dynamic-factor-str",
        lambda w: Dyn(factor="2"),
        TypeError,
        r"factor='2' should be a real number",
    ),
    row(
        "dynamic-backoff-1",
        lambda w: Dyn(backoff=1),
        ValueError,
        r"backoff=1 should be a number in \(0, 1\)",
    ),
    row(
        "dynamic-backoff-0",
        lambda w: Dyn(backoff=0),
        ValueError,
        r"backoff=0 should be a number in \(0, 1\)",
    ),
    row(
        "dynamic-backoff-nan",
        lambda w: Dyn(backoff=NAN),
        ValueError,
        r"backoff=nan should be finite",
    ),
    row(
        "dynamic-min-0",
        lambda w: Dyn(min_loss_scale=0),
        ValueError,
        r"min_loss_scale=0 should be a number > 0",
    ),
    row(
        "dynamic-min-inf",
        lambda w: Dyn(min_loss_scale=INF),
        ValueError,
        r"min_loss_scale=inf should be finite",
    ),
    row(
        "adjust-float",
        lambda w: S(2.0).adjust(1.0),
        TypeError,
        r"grads_finite has dtype float32 and shape \(\); it should be a boolean scalar",
    ),
    row(
        "adjust-vector",
        lambda w: Dyn().adjust(jnp.array([True, False])),
        TypeError,
        r"grads_finite has dtype bool and shape \(2,\)",
    ),
    row(
        "adjust-none",
        lambda w: Dyn().adjust(None),
        TypeError,
        r"DynamicLossScale.adjust: grads_finite=None should be a boolean scalar",
    ),
    row(
        "adjust-str",
        lambda w: fp8jax.NoOpLossScale().adjust("yes"),
        TypeError,
        r"NoOpLossScale.adjust: grads_finite='yes' should be a boolean scalar",
    ),
]

make = fp8jax.make_train_step
ADAM = optax.adam(1e-2)

TRAINING = [
    row(
        "step-loss-fn-none", lambda w: make(None, ADAM), TypeError, r"loss_fn=None is not callable"
    ),
    row(
        "step-optimizer-str",
        lambda w: make(_loss, "adam"),
        TypeError,
        r"optimizer='adam': should be an optax GradientTransformation",
    ),
    row(
        "step-optimizer-factory",
        lambda w: make(_loss, optax.adam),
        TypeError,
        r"optimizer=<function adam.*should be an optax GradientTransformation",
    ),
    row(
        "policy-fp8-compute",
        lambda w: P.from_string("params=f32,compute=float8_e4m3fn"),
        ValueError,
        r"compute=float8_e4m3fn: an 8-bit \(or narrower\) float is what fp8jax's GEMMs",
    ),
    row(
        "step-optimizer-multisteps",
        lambda w: make(_loss, optax.MultiSteps(optax.adam(1e-3), 2)),
        TypeError,
        r"for an optax.MultiSteps, its .gradient_transformation\(\) \(or "
        r"make_train_step\(microbatches=...\)",
    ),
    row(
        "step-policy-int",
        lambda w: make(_loss, ADAM, policy=3),
        TypeError,
        r"policy=3 is an int, not an fp8jax.Policy; pass an fp8jax.Policy, a string for "
        r"Policy.from_string or None\.$",
    ),
    row(
        "step-policy-int8",
        lambda w: make(_loss, ADAM, policy="params=int8"),
        ValueError,
        r"params='int8' is int8, not a floating-point dtype",
    ),
    row(
        "step-loss-scale-float",
        lambda w: make(_loss, ADAM, loss_scale=128.0),
        TypeError,
        r"loss_scale=128.0: should be an fp8jax loss scale",
    ),
    row(
        "step-loss-scale-class",
        lambda w: make(_loss, ADAM, loss_scale=Dyn),
        TypeError,
        r"loss_scale=<class .*DynamicLossScale'>: should be an fp8jax loss scale",
    ),
    row(
        "step-microbatches-0",
        lambda w: make(_loss, ADAM, microbatches=0),
        ValueError,
        r"microbatches=0 should be an int >= 1",
    ),
    row(
        "step-microbatches-float",
        lambda w: make(_loss, ADAM, microbatches=2.0),
        ValueError,
        r"microbatches=2.0 should be an int >= 1",
    ),
    row(
        "step-has-aux-str",
        lambda w: make(_loss, ADAM, has_aux="yes"),
        TypeError,
        r"has_aux='yes'",
    ),
    row(
        "step-skip-nonfinite-int",
        lambda w: make(_loss, ADAM, skip_nonfinite=1),
        TypeError,
        r"skip_nonfinite=1",
    ),
    row(
        "step-state-is-model",
        lambda w: w.step(w.model, X),
        TypeError,
        r"state is of type MLP, not an fp8jax.TrainState; create it with train_step.init",
    ),
    row(
        "step-batch-wrong-features",
        lambda w: w.step(w.state, jnp.ones((8, 5))),
        ValueError,
        r"Linear expects x of shape \(\.\.\., 4\); got \(5,\)",
    ),
    row(
        "step-batch-int",
        lambda w: w.step(w.state, jnp.ones((8, 4), jnp.int32)),
        TypeError,
        r"lhs has dtype int32",
    ),
    row(
        "step-loss-not-scalar",
        lambda w: make(lambda m, x: jax.vmap(m)(x), ADAM)(w.state, X),
        ValueError,
        r"loss_fn returned shape \(8, 2\); it must return a scalar loss",
    ),
    row(
        "step-has-aux-but-scalar",
        lambda w: make(_loss, ADAM, has_aux=True)(w.state, X),
        ValueError,
        r"has_aux=True",
    ),
    row(
        "step-microbatches-indivisible",
        lambda w: make(_loss, ADAM, microbatches=3)(w.state, X),
        ValueError,
        r"a batch axis of size 8 does not split into 3 equal microbatches",
    ),
    row(
        "low-precision-optimizer-str",
        lambda w: fp8jax.low_precision_state("adam"),
        TypeError,
        r"optimizer='adam' should be an optax GradientTransformation",
    ),
    row(
        "low-precision-int8",
        lambda w: fp8jax.low_precision_state(ADAM, jnp.int8),
        ValueError,
        r"dtype=<class 'jax.numpy.int8'> should be a floating dtype",
    ),
    row(
        "low-precision-none",
        lambda w: fp8jax.low_precision_state(ADAM, None),
        ValueError,
        r"dtype=None should be a floating dtype",
    ),
    row(
        "low-precision-fp8",
        lambda w: fp8jax.low_precision_state(ADAM, jnp.float8_e4m3fn),
        ValueError,
        r"dtype=<class 'jax.numpy.float8_e4m3fn'> is an 8-bit float.*use jnp.bfloat16",
    ),
    row(
        "accumulate-fun-none",
        lambda w: fp8jax.accumulate_gradients(None, 2),
        TypeError,
        r"fun=None is not callable",
    ),
    row(
        "accumulate-microbatches-0",
        lambda w: fp8jax.accumulate_gradients(_loss, 0),
        ValueError,
        r"microbatches=0 should be an int >= 1",
    ),
    row(
        "accumulate-has-aux-str",
        lambda w: fp8jax.accumulate_gradients(_loss, 2, has_aux="no"),
        TypeError,
        r"has_aux='no' should be True or False",
    ),
    row(
        "accumulate-unroll-0",
        lambda w: fp8jax.accumulate_gradients(_loss, 2, unroll=0),
        ValueError,
        r"unroll=0 should be an int >= 1 .* or True",
    ),
    row(
        "accumulate-unroll-float",
        lambda w: fp8jax.make_train_step(_loss, optax.sgd(0.1), unroll_microbatches=2.0),
        ValueError,
        r"make_train_step: unroll_microbatches=2.0 should be an int >= 1",
    ),
    row(
        "accumulate-scalar-batch",
        lambda w: fp8jax.accumulate_gradients(_loss, 2)(w.model, 1.0),
        ValueError,
        r"microbatches=2: the batch holds no array to split \(.* only scalars",
    ),
    row(
        "telemetry-without-fp8",
        lambda w: fp8jax.telemetry(w.plain),
        ValueError,
        r"no Fp8DotGeneral in the MLP given",
    ),
    row(
        "report-loss-scale-float",
        lambda w: fp8jax.report(w.model, loss_scale=2.0),
        TypeError,
        r"loss_scale=2.0 should be an fp8jax loss scale",
    ),
    row(
        "report-file-str",
        lambda w: fp8jax.report(w.model, file="out.txt"),
        TypeError,
        r"file='out.txt' should be a text stream",
    ),
    row("inspect-not-callable", lambda w: fp8jax.inspect(3, X), TypeError, r"fn=3 is not callable"),
    row(
        "inspect-compiled",  # JAX said: "Cannot apply JAX transformations to a function
        # lowered and compiled for a particular signature"
        lambda w: fp8jax.inspect(jax.jit(jnp.sin).lower(X).compile(), X),
        TypeError,
        r"fn=<jax.*Compiled.* is compiled already .* pass the function it was compiled from",
    ),
    row(
        "inspect-modes-str",
        lambda w: fp8jax.inspect(jnp.sin, X, modes="cublas"),
        ValueError,
        r"modes='cublas': should be a tuple of modes among \['cublas', 'default'\]",
    ),
    row(
        "inspect-modes-empty",
        lambda w: fp8jax.inspect(jnp.sin, X, modes=()),
        ValueError,
        r"modes=\(\): give at least one of",
    ),
    row(
        "h100-mesh-size-0",
        lambda w: fp8jax.h100_mesh({"data": 0}),
        ValueError,
        r"axes=\{'data': 0\}: should be a dict from mesh axis names to sizes >= 1",
    ),
    *(  # a wrong type was a ValueError; as elsewhere in fp8jax, it is now a TypeError
        row(
            f"h100-mesh-type-{i}",
            lambda w, axes=axes: fp8jax.h100_mesh(axes),
            TypeError,
            rf"axes={re.escape(repr(axes))}: should be a dict from mesh axis names to sizes",
        )
        for i, axes in enumerate([[("data", 4)], {"data": 2.0}, {0: 4}, {"data": True}])
    ),
]

load, save = fp8jax.load_checkpoint, fp8jax.save_checkpoint

CHECKPOINTS = [
    row(
        "load-empty-file",
        lambda w: load(w.file("empty.eqx"), w.state),
        ValueError,
        r"empty.eqx' is not an fp8jax checkpoint",
    ),
    row(
        "load-text-file",
        lambda w: load(w.file("text.eqx"), w.state),
        ValueError,
        r"text.eqx' is not an fp8jax checkpoint",
    ),
    row(
        "load-plain-equinox-file",
        lambda w: load(w.file("plain_equinox.eqx"), w.state),
        ValueError,
        r"plain_equinox.eqx' is not an fp8jax checkpoint .*save_checkpoint",
    ),
    row(
        "load-magic-only",
        lambda w: load(w.file("magic_only.eqx"), w.state),
        ValueError,
        r"magic_only.eqx' is truncated or corrupt: its record is cut off",
    ),
    row(
        "load-cut-in-record",
        lambda w: load(w.file("cut_record.eqx"), w.state),
        ValueError,
        r"cut_record.eqx' is truncated or corrupt: its record is cut off",
    ),
    row(
        "load-cut-in-arrays",
        lambda w: load(w.file("cut_data.eqx"), w.state),
        ValueError,
        r"cut_data.eqx' is truncated or corrupt: its arrays could not be read",
    ),
    row(
        "load-half-a-file",
        lambda w: load(w.file("half.eqx"), w.state),
        ValueError,
        r"half.eqx' is truncated or corrupt",
    ),
    row(
        "load-trailing-bytes",
        lambda w: load(w.file("trailing.eqx"), w.state),
        ValueError,
        r"trailing.eqx' is truncated or corrupt: it has data after the saved state",
    ),
    row(
        "load-record-not-json",
        lambda w: load(w.file("not_json.eqx"), w.state),
        ValueError,
        r"not_json.eqx' is truncated or corrupt: its record is not valid JSON",
    ),
    row(
        "load-record-empty",
        lambda w: load(w.file("empty_record.eqx"), w.state),
        ValueError,
        r"empty_record.eqx' is truncated or corrupt: its record does not list FP8 layers",
    ),
    row(
        "load-record-without-leaves",
        lambda w: load(w.file("no_leaves.eqx"), w.state),
        ValueError,
        r"no_leaves.eqx' is truncated or corrupt: its record does not list FP8 layers and leaves",
    ),
    row(
        "load-record-length-huge",
        lambda w: load(w.file("huge_record.eqx"), w.state),
        ValueError,
        r"huge_record.eqx' is truncated or corrupt: its record is cut off",
    ),
    row(
        "load-missing-file",
        lambda w: load(w.file("missing.eqx"), w.state),
        FileNotFoundError,
        r"missing.eqx",
    ),
    row(
        "load-directory",
        lambda w: load(w.ckpts, w.state),
        IsADirectoryError,
        r"ckpts' is a directory; backend='equinox' reads the file .*backend='orbax'",
    ),
    row(
        "load-path-none",
        lambda w: load(None, w.state),
        TypeError,
        r"path=None should be a str or an os.PathLike",
    ),
    row(
        "load-backend",
        lambda w: load(w.file("good.eqx"), w.state, backend="pickle"),
        ValueError,
        r"backend='pickle': should be one of \['equinox', 'orbax'\]",
    ),
    row(
        "load-orbax-from-file",
        lambda w: load(w.file("good.eqx"), w.state, backend="orbax"),
        NotADirectoryError,
        r"good.eqx' is a file; backend='orbax' reads the directory",
    ),
    row(
        "load-orbax-from-other-directory",
        lambda w: load(w.ckpts, w.state, backend="orbax"),
        ValueError,
        r"ckpts' is not an fp8jax checkpoint \(a directory without fp8jax_record.json\)",
    ),
    row(
        "load-orbax-from-nowhere",
        lambda w: load(w.file("missing"), w.state, backend="orbax"),
        FileNotFoundError,
        r"load_checkpoint: no checkpoint at '.*missing'",
    ),
    row(
        "load-other-shapes",
        lambda w: load(w.file("good.eqx"), _like(width=16)),
        ValueError,
        r"nothing was loaded:\n  - leaf \.model\.layers\[0\]\.bias: checkpoint has "
        r"float32\(8,\), target has float32\(16,\)",
    ),
    row(
        "load-other-targets",
        lambda w: load(
            w.file("good.eqx"), _like(config=dataclasses.replace(CONFIG, targets=["layers.0"]))
        ),
        ValueError,
        r"the checkpoint has FP8 layer 'layers.1', the target does not",
    ),
    row(
        "load-other-recipe",
        lambda w: load(w.file("good.eqx"), _like(config=Config(recipe="current", telemetry=True))),
        ValueError,
        r"FP8 layer 'layers.0': recipe DelayedScaling\(.*\) != CurrentScaling",
    ),
    row(
        "load-other-telemetry",
        lambda w: load(
            w.file("good.eqx"), _like(config=dataclasses.replace(CONFIG, telemetry=False))
        ),
        ValueError,
        r"telemetry True != False",
    ),
    row(
        "load-other-optimizer",
        lambda w: load(w.file("good.eqx"), _like(optimizer=optax.sgd(0.1))),
        ValueError,
        r"leaf \.opt_state.*checkpoint has .* target has nothing",
    ),
    row(
        "load-other-param-dtype",
        lambda w: load(w.file("good.eqx"), _like(policy="params=bf16")),
        ValueError,
        r"checkpoint has float32\(8, 4\), target has bfloat16\(8, 4\)",
    ),
    row(
        "load-unconverted-model",
        lambda w: load(w.file("good.eqx"), w.plain),
        ValueError,
        r"the checkpoint has FP8 layer 'layers.0', the target does not",
    ),
    row(
        "save-onto-directory",
        lambda w: save(w.ckpts, w.state),
        IsADirectoryError,
        r"save_checkpoint: '.*ckpts' is a directory; backend='equinox' writes a file",
    ),
    row(
        "save-under-a-file",
        lambda w: save(w.file("good.eqx") / "x.eqx", w.state),
        NotADirectoryError,
        r"good.eqx' is a file, not a directory",
    ),
    row(
        "save-into-sysfs",  # no one, not even root, creates files there
        lambda w: save("/sys/fp8jax_hostile.eqx", w.state),
        PermissionError,
        r"save_checkpoint: cannot write '/sys/fp8jax_hostile.eqx': Permission denied",
        pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="Linux sysfs only"),
    ),
    row(
        "save-object-array-over-checkpoint",
        lambda w: save(w.file("good.eqx"), {"a": np.array([object()])}),
        ValueError,
        r"leaf \['a'\] is an array of dtype object; a checkpoint holds numeric arrays only",
    ),
    row(
        "save-structured-array-over-checkpoint",
        lambda w: save(w.file("good.eqx"), {"a": np.zeros(2, [("x", "<f4")])}),
        ValueError,
        r"leaf \['a'\] is an array of dtype \[\('x', '<f4'\)\]; a checkpoint holds numeric arrays",
    ),
    row(
        "save-backend",
        lambda w: save(w.file("good.eqx"), w.state, backend="pickle"),
        ValueError,
        r"backend='pickle': should be one of",
    ),
    row(
        "save-path-int",
        lambda w: save(3, w.state),
        TypeError,
        r"save_checkpoint: path=3 should be a str or an os.PathLike",
    ),
]


def _twice(model: Any, x: jax.Array) -> jax.Array:
    return _loss(model, x) + _loss(model, 2 * x)


def _weights_only(w: World) -> Any:
    """The shared model split by a fine-tuning filter spec that trains the weights only."""
    spec = jax.tree.map(lambda _: False, w.state.model)
    layers = len(w.state.model.layers)
    spec = eqx.tree_at(lambda m: [layer.weight for layer in m.layers], spec, [True] * layers)
    return eqx.partition(w.state.model, spec)


# Issue 12: inputs that used to crash obscurely, pass silently or mislead.
NUMERICS = [
    row(
        "dot-preferred-e4m3",
        lambda w: w.dot(X, jnp.ones((4, 3)), MATMUL, None, jnp.float8_e4m3fn),
        TypeError,
        r"preferred_element_type=float8_e4m3fn is not a high-precision float type",
    ),
    row(
        "dot-preferred-e5m2",
        lambda w: w.dot(X, jnp.ones((4, 3)), MATMUL, None, jnp.float8_e5m2),
        TypeError,
        r"preferred_element_type=float8_e5m2 .* use float32, bfloat16 or float16",
    ),
    row(
        "dot-complex-lhs",
        lambda w: w.dot(X.astype(jnp.complex64), jnp.ones((4, 3)), MATMUL),
        TypeError,
        r"lhs has dtype complex64; FP8 has no complex format",
    ),
    row(
        "dot-complex-rhs",
        lambda w: w.dot(X, jnp.ones((4, 3), jnp.complex64), MATMUL),
        TypeError,
        r"rhs has dtype complex64; FP8 has no complex format",
    ),
    row(
        "config-targets-empty-list",
        lambda w: fp8jax.Fp8Config(targets=[]),
        ValueError,
        r"targets=\[\] selects no layer.*pass None",
    ),
    row(
        "config-targets-empty-tuple",
        lambda w: fp8jax.Fp8Config(targets=()),
        ValueError,
        r"targets=\(\) selects no layer",
    ),
    row(
        "grad-state-left-out-by-filter-spec",
        lambda w: jax.grad(lambda d, s: _loss(eqx.combine(d, s), X))(*_weights_only(w)),
        ValueError,
        r"FP8 layer 'layers.0' \(DelayedScaling\) is differentiated, but its FP8 state is not"
        r".*fp8jax.with_fp8_state",
    ),
    row(
        "grad-closed-over-layer",
        lambda w: jax.grad(lambda x: jnp.sum(w.dot(x, jnp.ones((4, 3)), MATMUL)))(X),
        ValueError,
        r"its FP8 state is not.*pass the layer \(or model\) as a differentiated argument",
    ),
    row(
        "eqx-grad-layer-used-twice",
        lambda w: eqx.filter_grad(_twice)(w.state.model, X),
        ValueError,
        r"FP8 layer 'layers.0' runs twice in one differentiated step.*fp8jax.filter_grad",
    ),
    row(
        "jit-eqx-grad-layer-used-twice",
        lambda w: eqx.filter_jit(eqx.filter_grad(_twice))(w.state.model, X),
        ValueError,
        r"runs twice in one differentiated step.*fp8jax.combine_by_max",
    ),
]

ROWS = (
    DOT_GENERAL
    + LINEAR
    + CONVERSION
    + RECIPES
    + POLICY
    + LOSS_SCALES
    + TRAINING
    + CHECKPOINTS
    + NUMERICS
)


@pytest.mark.parametrize("call, error, match", ROWS)
def test_hostile_input_fails_and_changes_nothing(world, call, error, match):
    before = _snapshot(world)
    with pytest.raises(error, match=match):
        call(world)
    assert _snapshot(world) == before


# --- hostile-looking inputs with a documented result ------------------------------------------


def _same_bits(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def _sum_grads(model: Any, x: jax.Array) -> Any:
    return fp8jax.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x)))(model, x)


def _nothing_learned(w: World, grads: Any) -> bool:
    """An empty batch: zero weight gradients, amax 0 recorded, every scale kept."""
    overwrites, trainable = fp8jax.partition_for_grad_overwrite(grads)
    weights = [a for a in jax.tree.leaves(trainable) if eqx.is_inexact_array(a)]
    new, old = overwrites.layers[0].dot_general, w.dot
    return (
        all(a.size and not np.any(np.asarray(a)) for a in weights)
        and float(new.input.amax_history[0]) == 0.0
        and all(
            float(getattr(new, r).scale) == float(getattr(old, r).scale)
            for r in ("input", "kernel", "output_grad")
        )
    )


def _grouped(recipe: str) -> Any:
    layer = fp8jax.GroupedLinear(3, 4, 2, key=jax.random.key(0))
    return fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(recipe=recipe))


def _finite_and_shaped(out: Any, lead: tuple[int, ...]) -> bool:
    leaves = [a for a in jax.tree.leaves(out) if eqx.is_inexact_array(a)]
    return all(bool(jnp.isfinite(a).all()) for a in leaves) and all(
        a.shape[: len(lead)] == lead for a in leaves if a.ndim >= len(lead) and a.size == 0
    )


EMPTY_I32 = jnp.zeros((0, 3), jnp.int32)

RESULTS = [
    pytest.param(
        lambda w: jax.vmap(w.model)(jnp.zeros((0, 4))),
        lambda w, out: out.shape == (0, 2),
        id="vmap-empty-batch",
    ),
    pytest.param(
        lambda w: _sum_grads(w.model, jnp.zeros((0, 4))),
        _nothing_learned,
        id="vmap-empty-batch-grads-keep-scales",
    ),
    pytest.param(
        lambda w: fp8jax.filter_grad(lambda m, x: jnp.sum(jax.vmap(jax.vmap(m))(x)))(
            w.model, jnp.zeros((0, 3, 4))
        ),
        _nothing_learned,
        id="vmap-of-vmap-empty-outer",
    ),
    pytest.param(
        lambda w: fp8jax.filter_grad(lambda m, x: jnp.sum(jax.vmap(jax.vmap(m))(x)))(
            w.model, jnp.zeros((3, 0, 4))
        ),
        _nothing_learned,
        id="vmap-of-vmap-empty-inner",
    ),
    pytest.param(
        lambda w: jax.vmap(fp8jax.filter_grad(lambda m, x: jnp.sum(m(x))), in_axes=(None, 0))(
            w.model, jnp.zeros((0, 4))
        ),
        lambda w, out: _finite_and_shaped(out, (0,)),
        id="per-example-grads-empty-batch",
    ),
    *[
        pytest.param(
            lambda w, r=r: _sum_grads(_model(config=fp8jax.Fp8Config(recipe=r)), jnp.zeros((0, 4))),
            lambda w, out: _finite_and_shaped(out, ()),
            id=f"vmap-empty-batch-{r}",
        )
        for r in ("current", "blockwise", "mxfp8", "residual")
    ],
    *[
        pytest.param(
            lambda w, r=r: fp8jax.filter_grad(lambda m, x, s: jnp.sum(jax.vmap(m)(x, s)))(
                _grouped(r), jnp.zeros((0, 5, 4)), EMPTY_I32
            ),
            lambda w, out: _finite_and_shaped(out, ()),
            id=f"grouped-vmap-no-members-{r}",
        )
        for r in ("delayed", "blockwise")
    ],
    pytest.param(
        lambda w: jax.vmap(
            fp8jax.filter_grad(lambda m, x, s: jnp.sum(m(x, s))), in_axes=(None, 0, 0)
        )(_grouped("delayed"), jnp.zeros((0, 5, 4)), EMPTY_I32),
        lambda w, out: _finite_and_shaped(out, (0,)),
        id="grouped-per-example-grads-no-members",
    ),
    pytest.param(
        lambda w: w.dot(jnp.ones((0, 4)), jnp.ones((4, 3)), MATMUL),
        lambda w, out: out.shape == (0, 3) and out.dtype == jnp.float32,
        id="dot-zero-rows",
    ),
    pytest.param(
        lambda w: jax.grad(lambda d, x: jnp.sum(d(x, jnp.ones((0, 3)), MATMUL)))(
            w.dot, jnp.ones((2, 0))
        ),
        lambda w, out: all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(out)),
        id="dot-zero-contraction-grad-state-finite",
    ),
    pytest.param(
        lambda w: fp8jax.filter_grad(_twice)(w.state.model, X),
        lambda w, out: (
            float(out.layers[0].dot_general.input.amax_history[0]) == float(jnp.abs(2 * X).max())
        ),
        id="fp8jax-grad-layer-used-twice-keeps-the-max",
    ),
    pytest.param(
        lambda w: load(w.file("good.eqx"), _like()),
        lambda w, out: _same_bits(out, w.state),
        id="load-good-checkpoint-into-fresh-state",  # control: the files above are hostile
    ),
    pytest.param(
        lambda w: convert(w.model, CONFIG),
        lambda w, out: out is w.model,
        id="convert-twice-does-not-wrap-twice",
    ),
    pytest.param(
        lambda w: w.dot(X, jnp.ones((4, 8)), [[[1], [0]], [[], []]], precision=["highest"] * 2),
        lambda w, out: _same_bits(
            out, w.dot(X, jnp.ones((4, 8)), MATMUL, precision=("highest", "highest"))
        ),
        id="dot-lists-like-lax",
    ),
    pytest.param(
        lambda w: P.from_string(" PARAMS = BF16 , c=F32 "),
        lambda w, out: out == P(param_dtype="bf16", compute_dtype="f32", output_dtype="bf16"),
        id="policy-case-and-space-ignored",
    ),
    pytest.param(
        lambda w: Config(targets=["layers.0"], recipes={"layers.0": "current"}),
        lambda w, out: out.targets == ("layers.0",) and hash(out) is not None,
        id="config-lists-become-tuples",
    ),
    pytest.param(
        lambda w: D(axis_names=["data"]),
        lambda w, out: out.axis_names == ("data",) and hash(out) is not None,
        id="axis-names-list-becomes-tuple",
    ),
    pytest.param(
        lambda w: Dyn(period=np.int64(10)),
        lambda w, out: type(out.period) is int and out.period == 10,
        id="dynamic-period-numpy-int",
    ),
    pytest.param(
        lambda w: fp8jax.all_finite({"text": "abc", "none": None, "ints": jnp.ones(2, int)}),
        lambda w, out: bool(out),
        id="all-finite-skips-non-float-leaves",
    ),
]


@pytest.mark.parametrize("call, check", RESULTS)
def test_hostile_looking_input_gives_documented_result(world, call, check):
    before = _snapshot(world)
    out = call(world)
    assert check(world, out)
    assert _snapshot(world) == before


def test_the_snapshot_sees_every_kind_of_change(world, tmp_path):
    """The checks above can fail: a flipped bit, a touched file or a stray file shows."""
    files = dataclasses.replace(world, base=tmp_path)
    (tmp_path / "a.eqx").write_bytes(b"abc")
    before = _snapshot(files)
    os.utime(tmp_path / "a.eqx", ns=(1, 1))
    assert _snapshot(files) != before
    before = _snapshot(files)
    (tmp_path / "a.eqx.tmp").write_bytes(b"")
    assert _snapshot(files) != before
    weight = world.model.layers[0].weight
    flipped = eqx.tree_at(lambda s: s.model.layers[0].weight, world.state, weight.at[0, 0].add(1))
    assert _snapshot(dataclasses.replace(world, state=flipped)) != _snapshot(world)

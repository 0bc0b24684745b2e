"""Checkpoints: a run stopped at step k and resumed matches an uninterrupted one bit for bit."""

import gc
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import stat
import sys
import types
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax

needs_orbax = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None, reason="orbax-checkpoint is not installed"
)
BACKENDS = ["equinox", pytest.param("orbax", marks=needs_orbax)]
POLICY = "params=float32,compute=bfloat16,output=float32"


def build(key, config=None, optimizer=None):
    mlp = eqx.nn.MLP(8, 2, 32, 2, key=key)
    model = fp8jax.fp8_linear_layers(mlp, config or fp8jax.Fp8Config(telemetry=True))
    step = fp8jax.make_train_step(
        lambda m, x, y: jnp.mean((jax.vmap(m)(x.astype(jnp.bfloat16)) - y) ** 2),
        optimizer or optax.adamw(1e-2),
        policy=POLICY,
        loss_scale=fp8jax.DynamicLossScale(period=2),
    )
    return step, step.init(model)


def batch(i):
    x = jax.random.normal(jax.random.key(i), (32, 8))
    return x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] ** 2], axis=1)


def nnx_training(dropout: bool, telemetry: bool):
    """An NNX model in FP8 (a dropout between its Linears, telemetry, when asked) to train
    and resume: `pair(seed)` builds a model and its optimizer, `go(model, optimizer, start,
    stop)` trains on batches `start..stop`, `values(model)` reads its state as bytes (a
    PRNG key as its data)."""
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(8, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None
            self.fc2 = nnx.Linear(32, 2, rngs=rngs)

        def __call__(self, x):
            h = jax.nn.gelu(self.fc1(x))
            return self.fc2(h if self.drop is None else self.drop(h))

    def pair(seed):
        config = fp8jax.Fp8Config(exclude=None, keep=(), telemetry=telemetry)
        model = fp8jax.fp8_linear_layers(Net(nnx.Rngs(seed)), config)
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    step = fp8jax.nnx_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))

    def go(model, optimizer, start, stop):
        for i in range(start, stop):
            step(model, optimizer, *batch(i))
        return model

    def values(model):
        leaves = jax.tree.leaves(nnx.state(model))
        is_key = [jnp.issubdtype(a.dtype, jax.dtypes.prng_key) for a in leaves]
        assert any(is_key) == dropout  # the dropout's key
        data = [jax.random.key_data(a) if k else a for a, k in zip(leaves, is_key, strict=True)]
        return [np.asarray(a).tobytes() for a in data]

    return pair, go, values


def run(step, state, start, stop):
    for i in range(start, stop):
        state, _ = step(state, *batch(i))
    return state


def bits(tree):
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_matches_an_uninterrupted_run(backend, tmp_path):
    k = 3
    step, state = build(jax.random.key(0))
    state = run(step, state, 0, k)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state, backend=backend)
    uninterrupted = run(step, state, k, 2 * k)
    # A fresh process would rebuild everything from scratch: another init key, same config.
    step2, like = build(jax.random.key(1))
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    assert bits(restored) == bits(state)
    resumed = run(step2, restored, k, 2 * k)
    assert bits(resumed) == bits(uninterrupted)
    assert int(resumed.step) == 2 * k
    assert float(resumed.loss_scale.loss_scale) == float(uninterrupted.loss_scale.loss_scale)
    # Saving again over an existing checkpoint replaces it.
    fp8jax.save_checkpoint(path, resumed, backend=backend)
    assert bits(fp8jax.load_checkpoint(path, like, backend=backend)) == bits(resumed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_and_fp8_arrays_save_and_resume(backend, tmp_path):
    """bfloat16 moments (`low_precision_state`, as the README advises) and FP8 arrays are
    saved and read back in their dtypes, bit for bit (NumPy calls their dtypes kind V, as
    it does records, which a checkpoint refuses), and the run resumes as if uninterrupted."""
    optimizer = fp8jax.low_precision_state(optax.adamw(1e-2))
    step, state = build(jax.random.key(0), optimizer=optimizer)
    state = run(step, state, 0, 2)
    assert np.dtype(jnp.bfloat16) in {x.dtype for x in jax.tree.leaves(state.opt_state)}
    extra = {
        "fp8": jnp.asarray([0.5, -448.0, 3.0], jnp.float8_e4m3fn),
        "e5m2": jnp.asarray([1.0, -57344.0], jnp.float8_e5m2),
        "bf16": jnp.asarray([1.5, -3.25e-20], jnp.bfloat16),
        "numpy_bf16": np.asarray([2.5, -7.0], jnp.bfloat16),  # restored as NumPy
    }
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, (state, extra), backend=backend)
    _, like = build(jax.random.key(1), optimizer=optimizer)
    like_extra = {
        k: np.zeros_like(v) if k == "numpy_bf16" else jnp.zeros_like(v) for k, v in extra.items()
    }
    restored, restored_extra = fp8jax.load_checkpoint(path, (like, like_extra), backend=backend)
    assert isinstance(restored_extra["numpy_bf16"], np.ndarray)
    for name, value in extra.items():
        assert restored_extra[name].dtype == value.dtype
        assert np.asarray(restored_extra[name]).tobytes() == np.asarray(value).tobytes()
    dtypes = [x.dtype for x in jax.tree.leaves(eqx.filter(restored, eqx.is_array))]
    assert dtypes == [x.dtype for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))]
    assert bits(restored) == bits(state)
    assert bits(run(step, restored, 2, 4)) == bits(run(step, state, 2, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_parallel_state_resumes_from_its_checkpoint(backend, tmp_path):
    """The model and its FP8 state replicated over 8 devices, the batch split over them: the
    state restored into `step.init(model)` (whose scalars, an optimizer's count and the step,
    are uncommitted) trains on as the uninterrupted run does. Restored committed to one
    device, those scalars made `jit` refuse the 8-device arrays beside them."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def sharded(tree):
        return jax.tree.map(lambda a: jax.device_put(a, replicated) if eqx.is_array(a) else a, tree)

    def data_parallel_run(step, state, start, stop):
        for i in range(start, stop):
            state, _ = step(state, *(jax.device_put(a, split) for a in batch(i)))
        return state

    step, state = build(jax.random.key(0))
    like = step.init(sharded(state.model))
    state = data_parallel_run(step, step.init(sharded(state.model)), 0, 2)
    fp8jax.save_checkpoint(tmp_path / "ckpt", state, backend=backend)
    uninterrupted = data_parallel_run(step, state, 2, 4)
    restored = fp8jax.load_checkpoint(tmp_path / "ckpt", like, backend=backend)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        if isinstance(want, jax.Array):
            assert got.committed == want.committed and got.sharding == want.sharding
    assert bits(data_parallel_run(step, restored, 2, 4)) == bits(uninterrupted)
    # An abstract `like` (ShapeDtypeStructs: nothing built to be overwritten) restores the
    # same; once refused as if it had none of the checkpoint's leaves.
    abstract = eqx.filter_eval_shape(step.init, sharded(state.model))
    restored = fp8jax.load_checkpoint(tmp_path / "ckpt", abstract, backend=backend)
    assert bits(data_parallel_run(step, restored, 2, 4)) == bits(uninterrupted)


@pytest.mark.parametrize(
    "config, optimizer, message",
    [
        (fp8jax.Fp8Config(targets=["layers.0", "layers.1"], telemetry=True), None, "layers.2"),
        (fp8jax.Fp8Config(recipe="current", telemetry=True), None, "CurrentScaling"),
        (fp8jax.Fp8Config(), None, "telemetry True != False"),
        (None, optax.sgd(0.1), "leaf"),
    ],
    ids=["targets", "recipe", "telemetry", "optimizer"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_targets_or_recipes_fail_before_loading(
    config, optimizer, message, backend, tmp_path
):
    step, state = build(jax.random.key(0))
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state, backend=backend)
    _, other = build(jax.random.key(1), config, optimizer)
    before = bits(other)
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        fp8jax.load_checkpoint(path, other, backend=backend)
    assert message in str(info.value)
    assert bits(other) == before


@needs_orbax
def test_warm_start_is_not_part_of_the_checkpoint(tmp_path):
    """`warm_start` acts only while a history is empty; a restored history decides the
    scale. Checkpoints restore across it, and across records written before it existed (the
    recipe's repr had no `warm_start` then)."""
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(history_len=4, warm_start=False))
    step, state = build(jax.random.key(0), config)
    state = run(step, state, 0, 2)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state, backend="orbax")
    warm = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(history_len=4))
    _, other = build(jax.random.key(1), warm)
    assert bits(fp8jax.load_checkpoint(path, other, backend="orbax")) == bits(state)
    record = path / "fp8jax_record.json"
    older = record.read_text().replace(", warm_start=False", "")
    assert older != record.read_text()
    record.write_text(older)
    assert bits(fp8jax.load_checkpoint(path, other, backend="orbax")) == bits(state)
    _, wrong = build(jax.random.key(1), fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling()))
    with pytest.raises(ValueError, match="history_len"):
        fp8jax.load_checkpoint(path, wrong, backend="orbax")


def test_a_checkpoint_whose_scales_lag_its_histories_resumes_from_the_histories(tmp_path):
    """Delayed scaling's state keeps the scale its next step uses (computed from the history
    when a step is merged); fp8jax before that kept the scale its latest step used. Restoring
    recomputes each scale from its history: such a checkpoint resumes as this version's own
    does, and this version's comes back bit for bit (the recomputation changes nothing)."""
    step, state = build(jax.random.key(0))
    state = run(step, state, 0, 3)

    def is_layer(node):
        return isinstance(node, fp8jax.Fp8DotGeneral)

    layers = [n for n in jax.tree.leaves(state, is_leaf=is_layer) if is_layer(n)]
    assert layers and all(float(op.input.scale) not in (0.0, 1.0) for op in layers)

    def lagging(node):  # the scale of an earlier step, as an older version stored it
        if not is_layer(node):
            return node
        return eqx.tree_at(lambda op: op.input.scale, node, node.input.scale * 4.0)

    older = jax.tree.map(lagging, state, is_leaf=is_layer)
    assert bits(older) != bits(state)
    _, like = build(jax.random.key(1))
    for saved in (older, state):
        fp8jax.save_checkpoint(tmp_path / "ckpt", saved)
        assert bits(fp8jax.load_checkpoint(tmp_path / "ckpt", like)) == bits(state)


def is_state(node):
    return type(node) is fp8jax.TensorState


class OlderTensorState(eqx.Module):
    """A `TensorState` as fp8jax defined it before it kept `scale_inv`."""

    scale: jax.Array
    amax_history: jax.Array


def older(node):
    return OlderTensorState(node.scale, node.amax_history) if is_state(node) else node


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_without_scale_inverses_restores(backend, tmp_path):
    """Checkpoints written before `TensorState` kept `scale_inv` hold no such leaf: they
    restore, each inverse computed from its scale, and resume as this version's own do."""
    step, state = build(jax.random.key(0))
    state = run(step, state, 0, 3)

    states = [n for n in jax.tree.leaves(state, is_leaf=is_state) if is_state(n)]
    assert states and all(float(s.scale) * float(s.scale_inv) == 1.0 for s in states)
    written = jax.tree.map(older, state, is_leaf=is_state)
    assert len(jax.tree.leaves(written)) == len(jax.tree.leaves(state)) - len(states)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, written, backend=backend)
    step2, like = build(jax.random.key(1))
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    assert bits(restored) == bits(state)
    assert bits(run(step2, restored, 3, 5)) == bits(run(step, state, 3, 5))
    # Its record is still checked against the target's.
    _, wrong = build(jax.random.key(1), fp8jax.Fp8Config(recipe="current", telemetry=True))
    with pytest.raises(ValueError, match="CurrentScaling"):
        fp8jax.load_checkpoint(path, wrong, backend=backend)


def _changed_state(state, field, index, value):
    """`state` with the last FP8 state's `field` holding `value` at `index`; that state's
    path, the new leaf and `states`, a function giving a tree's FP8 states by path."""

    def states(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
        return {jax.tree_util.keystr(p): n for p, n in flat if is_state(n)}

    where, node = list(states(state).items())[-1]  # the last layer's output gradient
    wanted = getattr(node, field).at[index].set(value)
    changed = jax.tree_util.tree_map_with_path(
        lambda p, n: (
            eqx.tree_at(lambda s: getattr(s, field), n, wanted)
            if jax.tree_util.keystr(p) == where
            else n
        ),
        state,
        is_leaf=is_state,
    )
    return changed, where, wanted, states


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index, value", [(5, np.nan), (0, np.inf), (1023, -np.inf)])
def test_a_non_finite_amax_in_a_checkpoint_is_dropped_and_warned_of(
    backend, index, value, tmp_path
):
    """Training never records a NaN or an inf in an amax history (`received_state`), so one
    in a checkpoint was put there after it was written; kept, it would roll along every
    step's new state and every step would be skipped as non-finite. It is set to 0 (no
    amax recorded) with a warning naming the leaf and entry, and the run resumes as one
    whose history held that 0."""
    step, state = build(jax.random.key(0))
    state = run(step, state, 0, 3)
    changed, where, wanted, states = _changed_state(state, "amax_history", index, value)
    zeroed, *_ = _changed_state(state, "amax_history", index, 0.0)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, changed, backend=backend)
    _, like = build(jax.random.key(1))
    pattern = rf"{re.escape(where)}\.amax_history holds {value} \(flat index {index}\)"
    with pytest.warns(RuntimeWarning, match=pattern):
        restored = fp8jax.load_checkpoint(path, like, backend=backend)
    expected = np.where(np.isfinite(wanted), wanted, 0.0)
    np.testing.assert_array_equal(states(restored)[where].amax_history, expected)
    resumed, metrics = step(restored, *batch(3))
    assert bool(metrics.grads_finite)
    assert bits(resumed) == bits(step(zeroed, *batch(3))[0])


@pytest.mark.parametrize("whole", [True, False], ids=["model", "nnx.State"])
def test_a_non_finite_amax_in_an_nnx_checkpoint_is_dropped_and_warned_of(whole, tmp_path):
    """As for an Equinox model: a NaN put in an NNX model's amax history (its `Fp8State`
    variables) is set to 0 on load, with a warning naming the variable; also where only
    `nnx.state(model)` (variables, no layer) was saved."""
    nnx = pytest.importorskip("flax.nnx")
    pair, go, _ = nnx_training(dropout=False, telemetry=True)
    model, optimizer = pair(0)
    go(model, optimizer, 0, 3)
    variable = model.fc1.dot_general.state.input.amax_history
    wanted = np.asarray(variable.get_value()).copy()
    variable.set_value(variable.get_value().at[4].set(np.nan))
    saved, like = (model, pair(1)[0]) if whole else (nnx.state(model), nnx.state(pair(1)[0]))
    fp8jax.save_checkpoint(tmp_path / "ckpt", saved)
    name = (
        ".fc1.dot_general.state.input.amax_history.value"
        if whole
        else "['fc1']['dot_general']['state']['input']['amax_history']"
    )
    with pytest.warns(RuntimeWarning, match=re.escape(f"{name} holds nan (flat index 4)")):
        restored = fp8jax.load_checkpoint(tmp_path / "ckpt", like)
    wanted[4] = 0.0
    if whole:
        got = restored.fc1.dot_general.state.input.amax_history.get_value()
    else:
        got = restored["fc1"]["dot_general"]["state"]["input"]["amax_history"].get_value()
    np.testing.assert_array_equal(np.asarray(got), wanted)


def test_a_non_finite_scale_left_after_the_merge_is_warned_of_and_loaded(tmp_path):
    """A current-scaling state keeps the scale of its latest step, which no history
    recomputes: an inf there is loaded as it is, with a warning naming the leaf. (Delayed
    scaling's merge computes it again from the history, so no warning is due.)"""
    config = fp8jax.Fp8Config(recipe="current", telemetry=True)
    step, state = build(jax.random.key(0), config)
    state = run(step, state, 0, 3)
    changed, where, wanted, states = _changed_state(state, "scale", (), np.inf)
    fp8jax.save_checkpoint(tmp_path / "ckpt", changed)
    _, like = build(jax.random.key(1), config)
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(where)}\.scale holds inf"):
        restored = fp8jax.load_checkpoint(tmp_path / "ckpt", like)
    assert float(states(restored)[where].scale) == np.inf
    delayed, *_ = _changed_state(run(*build(jax.random.key(0)), 0, 3), "scale", (), np.inf)
    fp8jax.save_checkpoint(tmp_path / "delayed", delayed)
    fp8jax.load_checkpoint(tmp_path / "delayed", build(jax.random.key(1))[1])  # no warning


@needs_orbax
def test_the_gemm_implementation_is_not_part_of_the_checkpoint(tmp_path):
    """`native_kernel`, `dequantized_dot` (the CPU emulation), `chunks_per_dot`,
    `weight_gather`, `backward_precision` and `axis_names` choose how GEMMs run, not what
    the state holds: a checkpoint restores across them, and across a record written before
    an option existed. What the state depends on is refused, naming only that option."""
    recipe = fp8jax.BlockwiseScaling(
        native_kernel=False,
        dequantized_dot=True,
        chunks_per_dot=2,
        weight_gather="per_gemm",
        backward_precision="default",
    )
    config = fp8jax.Fp8Config(recipe=recipe)
    step, state = build(jax.random.key(0), config)
    state = run(step, state, 0, 2)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state, backend="orbax")
    # The state restored for a `shard_map`ped step (built only: it runs under a mesh).
    auto = fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(axis_names=("data",)))
    _, other = build(jax.random.key(1), auto)
    assert bits(fp8jax.load_checkpoint(path, other, backend="orbax")) == bits(state)
    record = path / "fp8jax_record.json"  # the orbax backend keeps its record as a file
    older = record.read_text().replace(", native_kernel=False", "")
    assert older != record.read_text()
    record.write_text(older)
    assert bits(fp8jax.load_checkpoint(path, other, backend="orbax")) == bits(state)
    # What the state depends on still counts.
    _, wrong = build(
        jax.random.key(1), fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(block_size=64))
    )
    with pytest.raises(ValueError) as info:
        fp8jax.load_checkpoint(path, wrong, backend="orbax")
    assert "FP8 layer 'layers.0': recipe BlockwiseScaling: block_size 128 != 64\n" in str(
        info.value
    )


def test_the_record_is_checked_before_any_array_is_read(tmp_path):
    step, state = build(jax.random.key(0))
    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, state)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # arrays cut off
    _, other = build(jax.random.key(1), fp8jax.Fp8Config(recipe="current", telemetry=True))
    with pytest.raises(ValueError, match="nothing was loaded"):
        fp8jax.load_checkpoint(path, other)
    with pytest.raises(Exception) as info:  # the matching state gets as far as the arrays
        fp8jax.load_checkpoint(path, state)
    assert "nothing was loaded" not in str(info.value)


def test_a_state_of_another_kind_is_named_as_such(tmp_path):
    """A `TrainState` saved and its model given as `like` (or the other way round): each FP8
    layer is named once, with where it is on each side, not as both missing and extra."""
    _, state = build(jax.random.key(0))
    fp8jax.save_checkpoint(tmp_path / "ckpt", state)
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        fp8jax.load_checkpoint(tmp_path / "ckpt", state.model)
    message = str(info.value)
    assert (
        "FP8 layer 'layers.0' is at .model.layers[0].dot_general in the checkpoint, at "
        ".layers[0].dot_general in the target (another kind of state" in message
    )
    assert "not in the checkpoint" not in message and "the target does not" not in message
    fp8jax.save_checkpoint(tmp_path / "model", state.model)
    with pytest.raises(ValueError, match="is at .layers.0..dot_general in the checkpoint, at "):
        fp8jax.load_checkpoint(tmp_path / "model", state)


def test_checkpoint_errors(tmp_path):
    _, state = build(jax.random.key(0))
    not_ours = tmp_path / "other.bin"
    not_ours.write_bytes(b"hello world, not a checkpoint at all")
    with pytest.raises(ValueError, match="not an fp8jax checkpoint"):
        fp8jax.load_checkpoint(not_ours, state)
    with pytest.raises(ValueError, match="backend='pickle'"):
        fp8jax.save_checkpoint(tmp_path / "x", state, backend="pickle")


def test_a_checkpoint_of_a_later_format_names_its_version(tmp_path):
    """A checkpoint whose header is a later format's (`fp8jax-checkpoint 2`, as a newer
    fp8jax would write it) says so, with the version this fp8jax reads; it was called "not
    an fp8jax checkpoint"."""
    _, state = build(jax.random.key(0))
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state)
    data = path.read_bytes()
    assert data.startswith(b"fp8jax-checkpoint 1\n")
    path.write_bytes(b"fp8jax-checkpoint 12\n" + data[len(b"fp8jax-checkpoint 1\n") :])
    with pytest.raises(ValueError, match=r"format version 12; this fp8jax reads version 1\b"):
        fp8jax.load_checkpoint(path, state)


@needs_orbax
def test_an_orbax_checkpoint_records_its_format_version(tmp_path):
    """An orbax checkpoint recorded no format version, so a later format could not be named
    as the file backend's is. Its directory holds the file backend's header line as
    `fp8jax_format`: a later version's is named, with the version this fp8jax reads; one
    without it (written before) loads as version 1; one that is no header is corrupt."""
    _, state = build(jax.random.key(0))
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, state, backend="orbax")
    version = path / "fp8jax_format"
    assert version.read_bytes() == b"fp8jax-checkpoint 1\n"  # the file backend's header
    version.write_bytes(b"fp8jax-checkpoint 12\n")
    with pytest.raises(ValueError, match=r"format version 12; this fp8jax reads version 1\b"):
        fp8jax.load_checkpoint(path, state, backend="orbax")
    version.write_bytes(b"not a version")
    with pytest.raises(ValueError, match=r"truncated or corrupt: its fp8jax_format holds"):
        fp8jax.load_checkpoint(path, state, backend="orbax")
    version.unlink()  # as a checkpoint of an fp8jax before versions were recorded
    assert bits(fp8jax.load_checkpoint(path, state, backend="orbax")) == bits(state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_haliax_weight_restores_only_into_its_own_axes(backend, tmp_path):
    """A Haliax weight's axis names are recorded and checked: a weight saved as (hidden,
    embed) does not restore into one of axes (embed, hidden) of the same sizes (the array
    read as it was, under the other names: transposed in meaning); it raises before reading,
    naming the leaf and both orders, then how to restore anyway (it gave the advice to build
    `like` with the same config, which it was, before that). The documented way round
    restores the saved array under the new names; a checkpoint written before axes were
    recorded still loads."""
    hax = pytest.importorskip("haliax")
    import haliax.nn as hnn

    embed, hidden, mlp = hax.Axis("embed", 8), hax.Axis("hidden", 8), hax.Axis("mlp", 8)

    def model(inp, out, seed):
        return fp8jax.fp8_linear_layers(hnn.Linear.init(inp, out, key=jax.random.key(seed)))

    saved = model(embed, hidden, 0)
    assert saved.weight.axes == (hidden, embed)
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, saved, backend=backend)
    swapped = model(hidden, embed, 1)  # weight (embed, hidden): same shape, other meaning
    for like in (swapped, eqx.filter_eval_shape(model, hidden, embed, 1)):
        with pytest.raises(ValueError, match="nothing was loaded") as info:
            fp8jax.load_checkpoint(path, like, backend=backend)
        # What is wrong first (the axis names, each leaf's saved and target axes), then how
        # to restore anyway; not the advice for another config, which this is not.
        first, *problems, hint = str(info.value).splitlines()
        assert "axis names" in first
        assert problems == [
            "  - leaf .bias: checkpoint has axes ('hidden',), target has axes ('embed',)",
            "  - leaf .weight: checkpoint has axes ('hidden', 'embed'), target has axes "
            "('embed', 'hidden')",
        ]
        assert "To restore anyway" in hint and "haliax.rename" in hint
    restored = fp8jax.load_checkpoint(path, model(embed, hidden, 1), backend=backend)
    assert restored.weight.axes == saved.weight.axes
    assert bits(restored) == bits(saved)

    # Renamed axes (mlp for hidden), as the message says: rename `like`'s to the saved
    # names, load, rename back.
    renamed = model(embed, mlp, 1)
    with pytest.raises(ValueError, match=r"checkpoint has axes \('hidden', 'embed'\)"):
        fp8jax.load_checkpoint(path, renamed, backend=backend)

    def rename(tree, names):
        named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
        return jax.tree.map(lambda x: hax.rename(x, names) if named(x) else x, tree, is_leaf=named)

    restored = rename(
        fp8jax.load_checkpoint(path, rename(renamed, {"mlp": "hidden"}), backend=backend),
        {"hidden": "mlp"},
    )
    assert restored.weight.axes == (mlp, embed) and restored.bias.axes == (mlp,)
    assert bits(restored) == bits(saved)

    if backend == "equinox":  # a checkpoint of before: its record without axes
        import json

        data = path.read_bytes()
        start = data.index(b"\n") + 1
        size = int.from_bytes(data[start : start + 8], "little")
        record = json.loads(data[start + 8 : start + 8 + size])
        assert record.pop("axes") == {".weight": ["hidden", "embed"], ".bias": ["hidden"]}
        old = json.dumps(record).encode()
        rest = data[start + 8 + size :]
        path.write_bytes(data[:start] + len(old).to_bytes(8, "little") + old + rest)
        restored = fp8jax.load_checkpoint(path, swapped)
        assert restored.weight.axes == swapped.weight.axes  # as before: not checked
        assert bits(restored) == bits(saved)


def build_moe(config):
    from fp8jax.examples import moe_model as moe

    model = moe.MoEModel(width=16, hidden=32, experts=4, top_k=2, key=jax.random.key(0))
    step = fp8jax.make_train_step(moe.mse, optax.adam(1e-2))
    return step, step.init(fp8jax.fp8_linear_layers(model, config))


def test_grouped_layers_are_recorded_and_checked(tmp_path):
    """Expert layers' recipes, telemetry and expert counts are part of the record: a
    mismatch fails before loading; a record from before grouped layers were recorded still
    restores (their leaves are checked)."""
    from fp8jax.examples import moe_model as moe

    config = fp8jax.Fp8Config(telemetry=True)
    step, state = build_moe(config)
    x, y = moe.teacher_data(32)
    state, _ = step(state, x, y)
    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, state)
    _, like = build_moe(config)
    assert bits(fp8jax.load_checkpoint(path, like)) == bits(state)
    for other, message in (
        (fp8jax.Fp8Config(telemetry=True, recipes={"up": "current"}), "'moe.up': recipe"),
        (fp8jax.Fp8Config(), "FP8 layer 'moe.down': telemetry True != False"),
    ):
        _, wrong = build_moe(other)
        with pytest.raises(ValueError, match=message):
            fp8jax.load_checkpoint(path, wrong)
    # A record without grouped entries (written before they were recorded).
    import json

    from fp8jax._src.train import checkpoint_record as checkpoint

    record = checkpoint.fp8_record(state)
    assert {e["name"]: e.get("experts") for e in record["fp8_layers"].values()} == {
        "embed": None,
        "moe.up": 4,
        "moe.down": 4,
    }
    older = {**record, "fp8_layers": {
        k: v for k, v in record["fp8_layers"].items() if "experts" not in v
    }}  # fmt: skip
    checkpoint.check_fp8_record(json.loads(json.dumps(older)), checkpoint.fp8_record(like), path)
    # One that records grouped layers but lacks one of them: that layer is named missing.
    lacking = {**record, "fp8_layers": {
        k: v for k, v in record["fp8_layers"].items() if v["name"] != "moe.up"
    }}  # fmt: skip
    with pytest.raises(ValueError, match="FP8 layer 'moe.up' is not in the checkpoint"):
        checkpoint.check_fp8_record(lacking, checkpoint.fp8_record(like), path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_nnx_model_and_optimizer_round_trip_and_resume(backend, tmp_path):
    """A Flax NNX model (its FP8 state in `Fp8State` variables, whose leaves' paths end in
    `.value`) and its optimizer restore into a fresh pair, which resumes as the original
    does; the fresh pair given as `like` is left as it was."""
    pair, go, values = nnx_training(dropout=False, telemetry=True)
    model, optimizer = pair(0)
    go(model, optimizer, 0, 3)
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, (model, optimizer), backend=backend)
    like = pair(1)
    fresh = values(like[0])
    restored, restored_optimizer = fp8jax.load_checkpoint(path, like, backend=backend)
    assert values(like[0]) == fresh
    assert values(restored) == values(model)
    history = restored.fc1.dot_general.state.input.amax_history.get_value()
    assert float(history[0]) > 0  # the trained state, not a fresh one
    want = values(go(model, optimizer, 3, 5))
    assert values(go(restored, restored_optimizer, 3, 5)) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_nnx_state_records_its_fp8_layers(backend, tmp_path):
    """`nnx.state(model)` saved (the variables, not the module) records the model's FP8
    layers: restoring it into the state of a model converted with another recipe whose state
    has the same shapes fails as the module does, naming the layers and the recipe's
    difference, before anything is read; the same recipe restores, and a record from before
    such states recorded their layers (none) still does. It recorded no layer: the other
    recipe's state was silently loaded."""
    nnx = pytest.importorskip("flax.nnx")
    from fp8jax._src.train import checkpoint_record

    def model(margin):
        net = nnx.Sequential(
            nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 2, rngs=nnx.Rngs(1))
        )
        config = fp8jax.Fp8Config(
            exclude=None, keep=(), recipe=fp8jax.DelayedScaling(margin=margin)
        )
        return fp8jax.fp8_linear_layers(net, config)

    saved, other = model(0.0), model(1.0)
    path, module_path = (tmp_path / (n if backend == "orbax" else n + ".eqx") for n in "sm")
    fp8jax.save_checkpoint(path, nnx.state(saved), backend=backend)
    fp8jax.save_checkpoint(module_path, saved, backend=backend)
    with pytest.raises(ValueError, match="nothing was loaded") as from_module:
        fp8jax.load_checkpoint(module_path, other, backend=backend)
    with pytest.raises(ValueError, match="nothing was loaded") as from_state:
        fp8jax.load_checkpoint(path, nnx.state(other), backend=backend)
    problems = [line for line in str(from_module.value).splitlines() if "FP8 layer" in line]
    assert len(problems) == 2 and "margin 0.0 != 1.0" in problems[0]
    assert [line for line in str(from_state.value).splitlines() if "FP8 layer" in line] == problems
    restored = fp8jax.load_checkpoint(path, nnx.state(model(0.0)), backend=backend)
    assert bits(restored) == bits(nnx.state(saved))
    older = checkpoint_record.fp8_record(nnx.state(saved))
    checkpoint_record.check_fp8_record(
        {**older, "fp8_layers": {}}, checkpoint_record.fp8_record(nnx.state(saved)), path
    )
    # One that records such layers but lacks one of them: that layer is named missing.
    first, *rest = sorted(older["fp8_layers"])
    lacking = {**older, "fp8_layers": {k: older["fp8_layers"][k] for k in rest}}
    with pytest.raises(ValueError, match="is not in the checkpoint") as info:
        checkpoint_record.check_fp8_record(
            lacking, checkpoint_record.fp8_record(nnx.state(saved)), path
        )
    assert f"FP8 layer {older['fp8_layers'][first]['name']!r} is not in" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_python_number_in_like_restores_the_saved_array(backend, tmp_path):
    """A train state built with a Python step (`step=0`, as Flax's `TrainState.create` does)
    restores a checkpoint whose step is an array after training: as that array. A number
    saved as a number, or an array of another kind, is still told apart."""
    _, state = build(jax.random.key(0))
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    saved = {"step": jnp.int32(7), "lr": jnp.float32(0.5), "state": state, "n": 3}
    fp8jax.save_checkpoint(path, saved, backend=backend)
    like = {"step": 0, "lr": 1.0, "state": build(jax.random.key(1))[1], "n": 0}
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    assert isinstance(restored["step"], jax.Array) and restored["step"].dtype == jnp.int32
    assert int(restored["step"]) == 7 and float(restored["lr"]) == 0.5
    # A Python number is saved by the equinox backend; orbax saves arrays alone (documented).
    assert restored["n"] == (3 if backend == "equinox" else 0) and isinstance(restored["n"], int)
    assert bits(restored["state"]) == bits(state)
    with pytest.raises(
        ValueError, match=r"leaf \['step'\]: checkpoint has int32\(\), target has a Python float"
    ):
        fp8jax.load_checkpoint(path, {**like, "step": 0.0}, backend=backend)


def test_a_numpy_subclass_leaf_in_like_restores(tmp_path):
    """JAX's literals (a NumPy subclass: a Flax Linen layer's FP8 state initialised under
    `nn.remat` holds them) in `like` restore like plain NumPy leaves, not as a 'corrupt' file."""

    class Literal(np.ndarray):
        pass

    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, {"scale": jnp.float32(4.0), "h": jnp.arange(3.0)})
    like = {"scale": np.zeros((), np.float32).view(Literal), "h": np.zeros(3, np.float32)}
    restored = fp8jax.load_checkpoint(path, like)
    assert float(restored["scale"]) == 4.0 and type(restored["scale"]) is np.ndarray
    np.testing.assert_array_equal(restored["h"], [0.0, 1.0, 2.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_leaves_restore_as_saved(backend, tmp_path):
    """NumPy scalars (`np.float32(0.5)`, kept in a state as a hyperparameter) are arrays a
    checkpoint holds: both backends restore their values, as NumPy scalars of their dtypes."""
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    saved = {"lr": np.float32(0.5), "count": np.int32(7), "w": jnp.arange(3.0)}
    fp8jax.save_checkpoint(path, saved, backend=backend)
    like = {"lr": np.float32(0), "count": np.int32(0), "w": jnp.zeros(3)}
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    for name in ("lr", "count"):
        assert type(restored[name]) is type(saved[name]) and restored[name] == saved[name]
    np.testing.assert_array_equal(restored["w"], saved["w"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "state",
    [
        jnp.arange(3.0),  # a state that is one array
        {"w": jnp.arange(4.0), "empty": jnp.zeros((0, 2), jnp.bfloat16)},  # a zero-size array
        {"empty": np.zeros((2, 0), np.int32), "n": None},  # no array with data
    ],
    ids=["one-array", "zero-size", "no-data"],
)
def test_any_state_of_arrays_round_trips(backend, state, tmp_path):
    """Both backends save and restore a state that is a single array, holds a zero-size array
    (it has no data), or holds no array with data, as the documented `any pytree`. Orbax
    refused each, with its own messages ("StandardSave does not support single arrays",
    "Cannot save arrays with zero size", "Found empty item")."""
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, state, backend=backend)
    like = jax.tree.map(lambda a: a * 0 + 7, state)
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert type(got) is type(want) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_orbax_would_store_under_one_name_are_refused(backend, tmp_path):
    """Orbax names a leaf by its keys joined with '.': `{"a.b": x, "a": {"b": y}}` gives two
    leaves one name, and it saved both there, restoring one array into both places (the
    other lost, silently). The Equinox file keeps both; orbax's save now refuses it before
    writing, naming the leaves, and the checkpoint at `path` is kept."""
    state = {"a.b": jnp.arange(2.0), "a": {"b": jnp.arange(2.0) + 10}}
    like = jax.tree.map(jnp.zeros_like, state)
    path = tmp_path / "ckpt"
    if backend == "equinox":
        fp8jax.save_checkpoint(path, state)
        restored = fp8jax.load_checkpoint(path, like)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(got, want)
        return
    kept = {"w": jnp.arange(3.0)}
    fp8jax.save_checkpoint(path, kept, backend="orbax")
    match = r"\['a'\]\['b'\] and \['a.b'\] under one name, 'a.b'"
    with pytest.raises(ValueError, match=match):
        fp8jax.save_checkpoint(path, state, backend="orbax")
    restored = fp8jax.load_checkpoint(path, {"w": jnp.zeros(3)}, backend="orbax")
    np.testing.assert_array_equal(restored["w"], kept["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@needs_orbax
def test_a_checkpoint_with_leaves_under_one_orbax_name_is_not_restored(tmp_path, monkeypatch):
    """A checkpoint written before orbax's save refused leaves whose keys joined with '.' are
    one name holds one array for both: its restore read that array into both leaves, with no
    error. It now refuses the target, naming both leaves, before reading any array."""
    from fp8jax._src.train import checkpoint_orbax

    state = {"a.b": jnp.arange(2.0), "a": {"b": jnp.arange(2.0) + 10}}
    path = tmp_path / "ckpt"
    with monkeypatch.context() as patch:  # the save as it was: without the names' check
        patch.setattr(checkpoint_orbax, "_check_names", lambda *args, **kwargs: None)
        fp8jax.save_checkpoint(path, state, backend="orbax")
    like = jax.tree.map(jnp.zeros_like, state)
    match = r"load_checkpoint: .* leaves \['a'\]\['b'\] and \['a.b'\] .* one name, 'a.b'"
    for target in (like, jax.eval_shape(lambda: like)):
        with pytest.raises(ValueError, match=match):
            fp8jax.load_checkpoint(path, target, backend="orbax")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prng_keys_save_and_resume(backend, tmp_path):
    """Typed PRNG keys (`jax.random.key`, as a train state keeps for dropout; an NNX model's
    `nnx.Dropout(rngs=...)` holds one) are saved and restored as keys of their
    implementation, into a concrete or an abstract `like`, and an NNX model with dropout
    resumes as the uninterrupted run does. They made both functions raise `Cannot interpret
    'key<fry>' as a data type`."""
    pytest.importorskip("flax.nnx")
    path = tmp_path / ("keys" if backend == "orbax" else "keys.eqx")
    saved = {"rng": jax.random.split(jax.random.key(3), 2), "w": jnp.arange(3.0)}
    saved["rbg"] = jax.random.key(4, impl="rbg")
    fp8jax.save_checkpoint(path, saved, backend=backend)
    like = {"rng": jax.random.split(jax.random.key(0), 2), "w": jnp.zeros(3)}
    like["rbg"] = jax.random.key(0, impl="rbg")
    for target in (like, jax.eval_shape(lambda: like)):
        restored = fp8jax.load_checkpoint(path, target, backend=backend)
        for name in ("rng", "rbg"):
            assert jax.random.key_impl(restored[name]) == jax.random.key_impl(saved[name])
            np.testing.assert_array_equal(
                jax.random.key_data(restored[name]), jax.random.key_data(saved[name])
            )

    pair, go, values = nnx_training(dropout=True, telemetry=False)
    model, optimizer = pair(0)
    go(model, optimizer, 0, 2)
    fp8jax.save_checkpoint(path, (model, optimizer), backend=backend)
    restored, restored_optimizer = fp8jax.load_checkpoint(path, pair(1), backend=backend)
    assert values(restored) == values(model)
    want = values(go(model, optimizer, 2, 4))
    assert values(go(restored, restored_optimizer, 2, 4)) == want


@pytest.mark.parametrize("axes", ["Auto", "Explicit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prng_keys_restore_into_a_sharded_abstract_like(backend, axes, tmp_path):
    """Keys on a mesh, restored into `jax.ShapeDtypeStruct`s carrying their sharding (how a
    sharded run restores without building its state first): each key comes back with the
    sharding that `like` names, its data as saved. The keys' data got `eval_shape`'s
    sharding, on an abstract mesh: Equinox's backend raised, and orbax's too on a mesh of
    Explicit axes."""
    spec, sharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axes),))
    saved = {
        "split": jax.device_put(
            jax.random.split(jax.random.key(1), 8), sharding(mesh, spec("data"))
        ),
        "whole": jax.device_put(jax.random.split(jax.random.key(2), 3), sharding(mesh, spec())),
    }
    path = tmp_path / ("keys" if backend == "orbax" else "keys.eqx")
    fp8jax.save_checkpoint(path, saved, backend=backend)
    like = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in saved.items()
    }
    restored = fp8jax.load_checkpoint(path, like, backend=backend)
    for name, key in saved.items():
        assert restored[name].sharding == key.sharding, name
        np.testing.assert_array_equal(jax.random.key_data(restored[name]), jax.random.key_data(key))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_eval_shape_like_on_a_mesh_of_explicit_axes(backend, tmp_path):
    """`eval_shape` of a state on a mesh of Explicit axes names each sharding on the abstract
    mesh, which has no devices. Under `jax.set_mesh(mesh)` the arrays (a key's too) restore
    with those shardings on that mesh's devices; outside it, `load_checkpoint` raises before
    reading, naming the leaf and `jax.set_mesh`. Both backends called such a checkpoint
    "truncated or corrupt" (device_set is not implemented for an AbstractMesh)."""
    spec, sharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    split, whole = sharding(mesh, spec("data")), sharding(mesh, spec())
    saved = {
        "w": jax.device_put(jnp.arange(16.0).reshape(8, 2), split),
        "h": jax.device_put(jnp.ones(3, jnp.bfloat16), whole),
        "key": jax.device_put(jax.random.split(jax.random.key(1), 8), split),
    }
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, saved, backend=backend)
    like = jax.eval_shape(lambda s: s, saved)
    assert isinstance(like["w"].sharding.mesh, jax.sharding.AbstractMesh)
    with pytest.raises(ValueError, match=r"jax\.set_mesh") as info:
        fp8jax.load_checkpoint(path, like, backend=backend)
    assert "corrupt" not in str(info.value) and "['h']" in str(info.value)
    with jax.set_mesh(mesh):
        restored = fp8jax.load_checkpoint(path, like, backend=backend)

    def data(tree):
        return bits({**tree, "key": jax.random.key_data(tree["key"])})

    for name, value in saved.items():  # (eval_shape spells P("data") as P("data", None))
        assert restored[name].sharding.is_equivalent_to(value.sharding, value.ndim), name
    assert data(restored) == data(saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_abstract_like_on_another_device_restores_there(backend, tmp_path):
    """A `like` of `jax.ShapeDtypeStruct`s on one device other than the default one (a
    `SingleDeviceSharding`) restores each array, a key's too, onto that device, as a `like`
    of arrays there does; one on the default device restores uncommitted there, as before
    (what `eval_shape` says of an uncommitted array, in some JAX versions). The Equinox
    backend put them all on the default device."""
    device = jax.devices()[3]
    saved = {"w": jnp.arange(6.0).reshape(2, 3), "h": jnp.ones(4, jnp.bfloat16)}
    saved["key"] = jax.random.key(5)
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, saved, backend=backend)

    def on(device):
        single = jax.sharding.SingleDeviceSharding(device)
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=single),
            jax.eval_shape(lambda: saved),
        )

    restored = fp8jax.load_checkpoint(path, on(device), backend=backend)
    for name, value in restored.items():
        assert value.devices() == {device}, name

    def data(tree):
        return bits({**tree, "key": jax.random.key_data(tree["key"])})

    assert data(restored) == data(saved)
    restored = fp8jax.load_checkpoint(path, on(jax.devices()[0]), backend=backend)
    assert all(v.devices() == {jax.devices()[0]} for v in restored.values())
    assert not any(v.committed for v in restored.values())
    assert data(restored) == data(saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restored_arrays_are_committed_as_like_is(backend, tmp_path):
    """Each restored array is committed where `like`'s is and uncommitted where it is not: a
    `like` of arrays made on the default device (`jnp.zeros`, uncommitted), or an abstract one
    of them (`eval_shape`, which names no device), restores uncommitted, both backends alike
    (`jit` then still places it beside arrays on other devices); arrays put on a device
    restore committed. The orbax backend restored an abstract `like`'s arrays committed."""
    made = {"w": jnp.zeros((2, 3)), "h": jnp.zeros(4, jnp.bfloat16), "key": jax.random.key(1)}
    put = jax.device_put(made, jax.devices()[0])
    assert not any(x.committed for x in jax.tree.leaves(made))
    assert all(x.committed for x in jax.tree.leaves(put))
    saved = {"w": jnp.arange(6.0).reshape(2, 3), "h": jnp.ones(4, jnp.bfloat16)}
    saved["key"] = jax.random.key(5)
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, saved, backend=backend)
    for like, committed in [(made, False), (jax.eval_shape(lambda: made), False), (put, True)]:
        restored = fp8jax.load_checkpoint(path, like, backend=backend)
        for name, value in restored.items():
            assert value.committed is committed, name
            assert value.devices() == {jax.devices()[0]}, name


@needs_orbax
def test_a_half_written_orbax_checkpoint_is_named_corrupt(tmp_path):
    """An orbax checkpoint directory with its record but its arrays' files cut short or gone
    (a copy stopped half-way) raises the error a truncated Equinox file does, naming the
    checkpoint, and restores nothing. Orbax's own errors came through: a `JSONDecodeError`
    naming no path for a cut `_METADATA`, a `FileNotFoundError` for a missing `state`."""
    import shutil

    saved = {"w": jnp.arange(64.0), "h": jnp.ones((4, 4), jnp.bfloat16)}
    good = tmp_path / "good"
    fp8jax.save_checkpoint(good, saved, backend="orbax")

    def cut(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def no_data(state):
        for path in state.rglob("*"):
            if path.is_file() and path.parent.name == "d":
                path.unlink()

    damages = {"metadata": lambda s: cut(s / "_METADATA"), "data": no_data}
    damages["state"] = shutil.rmtree
    for name, damage in damages.items():
        path = tmp_path / name
        shutil.copytree(good, path)
        damage(path / "state")
        with pytest.raises(ValueError, match="is truncated or corrupt") as info:
            fp8jax.load_checkpoint(path, saved, backend="orbax")
        assert repr(os.fspath(path)) in str(info.value), name
    assert bits(fp8jax.load_checkpoint(good, saved, backend="orbax")) == bits(saved)


@needs_orbax
def test_a_failed_orbax_restores_leftover_reads_report_nothing(tmp_path, monkeypatch):
    """Orbax closes its asyncio loop when a restore's first read fails; the other reads,
    finishing later on tensorstore's threads, woke the closed loop and Python reported
    "RuntimeError: Event loop is closed" as unraisable, after the corrupt error (CI failed on
    it, in the half-written test above, when a read was still running). Using the orbax
    backend now drops exactly that report; any other still reaches the hook. The leftover is
    made here as orbax makes it: a task awaiting a tensorstore future, on a loop then closed."""
    import asyncio

    import tensorstore as ts

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    fp8jax.save_checkpoint(tmp_path / "ckpt", {"w": jnp.arange(4.0)}, backend="orbax")

    promise, future = ts.Promise.new()

    async def read():
        await future

    loop = asyncio.new_event_loop()
    loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0))  # the read now waits on tensorstore
    loop.close()
    promise.set_result(0)  # tensorstore wakes the closed loop: the report
    assert reported == []

    other = asyncio.new_event_loop()
    other.close()
    with pytest.raises(RuntimeError, match="Event loop is closed") as info:
        other.call_soon_threadsafe(print, "not tensorstore's")
    unraisable = types.SimpleNamespace(
        exc_type=RuntimeError, exc_value=info.value, exc_traceback=info.tb, object=None
    )
    sys.unraisablehook(unraisable)
    assert reported == [unraisable]

    # A step of the restore never started: its coroutine, collected unawaited, warns; with
    # warnings as errors, an unraisable report. Orbax's is dropped, anyone else's is not.
    import orbax.checkpoint as ocp

    async def mine():
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        theirs = ocp.type_handlers.ParamInfo.await_path_creation(None)
        del theirs
        gc.collect()
        assert reported == [unraisable]
        ours = mine()
        del ours
        gc.collect()
    assert len(reported) == 2 and reported[1].object.__name__ == "mine"


@needs_orbax
def test_a_failed_orbax_restores_unread_errors_are_not_logged(tmp_path, caplog):
    """A failed orbax restore's other reads may fail too; their tasks, collected with the
    error unread, made asyncio log "Task exception was never retrieved" at ERROR after the
    corrupt error. Using the orbax backend now drops asyncio's record of an error raised in
    orbax's code; one raised anywhere else is still logged."""
    import asyncio

    import orbax.checkpoint as ocp

    fp8jax.save_checkpoint(tmp_path / "ckpt", {"w": jnp.arange(4.0)}, backend="orbax")

    async def mine():
        raise ValueError("not orbax's")

    class Unwritable:
        @property
        def _parent_dir(self):
            raise OSError("the directory could not be made")

    def unread(coroutine):
        loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine)
        loop.run_until_complete(asyncio.wait([task]))  # failed; nothing reads its error
        loop.close()
        del task
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        unread(ocp.type_handlers.ParamInfo.await_path_creation(None))  # raises in orbax
        # Raised in code that orbax's calls (its last frame not orbax's): still orbax's error.
        unread(ocp.type_handlers.ParamInfo.await_path_creation(Unwritable()))
        assert caplog.records == []
        unread(mine())
    assert [r.msg.split("\n")[0] for r in caplog.records] == ["Task exception was never retrieved"]
    assert "not orbax's" in caplog.text


@needs_orbax
def test_an_orbax_save_replaces_a_stale_previous_checkpoint(tmp_path):
    """A save stopped while it removed the checkpoint it replaced (a preempted job) leaves
    `<path>.old` behind, beside the complete new checkpoint; the next save replaces it. It
    failed with `OSError: Directory not empty`, and so did every save after it."""
    path = tmp_path / "ckpt"
    first, second = {"w": jnp.arange(4.0)}, {"w": jnp.arange(4.0) + 10}
    fp8jax.save_checkpoint(tmp_path / "stale", first, backend="orbax")
    fp8jax.save_checkpoint(path, first, backend="orbax")
    (tmp_path / "stale").rename(tmp_path / "ckpt.old")  # the one a save was removing
    fp8jax.save_checkpoint(path, second, backend="orbax")
    restored = fp8jax.load_checkpoint(path, {"w": jnp.zeros(4)}, backend="orbax")
    np.testing.assert_array_equal(restored["w"], second["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_save_to_a_symbolic_link_replaces_the_link_and_keeps_its_target(backend, tmp_path):
    """A save to `latest`, a symbolic link to an earlier checkpoint, puts the new checkpoint
    at `latest` and leaves the earlier one as it was, as `os.replace` does for a file. An
    orbax save did so, then raised `OSError` (rmtree of the moved link), left `latest.old`,
    and every later save to `latest` failed the same way."""
    like = {"w": jnp.zeros(4)}
    first, second, third = ({"w": jnp.arange(4.0) + i} for i in (0, 10, 20))
    fp8jax.save_checkpoint(tmp_path / "step1", first, backend=backend)
    (tmp_path / "latest").symlink_to("step1")
    for state in (second, third):
        fp8jax.save_checkpoint(tmp_path / "latest", state, backend=backend)
        restored = fp8jax.load_checkpoint(tmp_path / "latest", like, backend=backend)
        np.testing.assert_array_equal(restored["w"], state["w"])
    assert not (tmp_path / "latest").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    kept = fp8jax.load_checkpoint(tmp_path / "step1", like, backend=backend)
    np.testing.assert_array_equal(kept["w"], first["w"])


def stop_before_renaming(monkeypatch, stop):
    """Make `os.replace` stop a save as a killed process would (no clean-up runs) when
    `stop(source)` says so."""
    replace = os.replace

    def stopping(source, target):
        if stop(os.fspath(source)):
            monkeypatch.setattr(os, "unlink", lambda *a, **k: None)  # killed: nothing removed
            raise SystemExit("killed")
        return replace(source, target)

    monkeypatch.setattr(os, "replace", stopping)


@needs_orbax
def test_a_save_stopped_between_its_renames_names_what_it_left(monkeypatch, tmp_path):
    """An orbax save stopped between its two renames leaves no `<path>`, the previous
    checkpoint at `<path>.old` and the new, complete one at `<path>.tmp`: loading names both
    and says which is which (with either backend), and renaming one as the message says
    restores it. It said only "no checkpoint at '<path>'"."""
    path = tmp_path / "ckpt"
    first, second, like = {"w": jnp.arange(4.0)}, {"w": jnp.arange(4.0) + 10}, {"w": jnp.zeros(4)}
    fp8jax.save_checkpoint(path, first, backend="orbax")
    with monkeypatch.context() as m:
        stop_before_renaming(m, lambda source: source.endswith("ckpt.tmp"))
        with pytest.raises(SystemExit):
            fp8jax.save_checkpoint(path, second, backend="orbax")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.old", "ckpt.tmp"]
    new, old = repr(os.fspath(tmp_path / "ckpt.tmp")), repr(os.fspath(tmp_path / "ckpt.old"))
    for backend in ("orbax", "equinox"):
        with pytest.raises(FileNotFoundError, match="no checkpoint at") as info:
            fp8jax.load_checkpoint(path, like, backend=backend)
        message = str(info.value)
        assert f"{new} (the new checkpoint that save wrote, complete" in message, message
        assert f"{old} (the previous checkpoint, complete" in message, message
        assert f"rename it to {repr(os.fspath(path))}" in message, message
        assert ("backend='orbax'" in message) == (backend == "equinox"), message
    (tmp_path / "ckpt.old").rename(path)  # the previous one, as the message says
    restored = fp8jax.load_checkpoint(path, like, backend="orbax")
    np.testing.assert_array_equal(restored["w"], first["w"])
    shutil.rmtree(path)
    (tmp_path / "ckpt.tmp").rename(path)  # or the new one
    restored = fp8jax.load_checkpoint(path, like, backend="orbax")
    np.testing.assert_array_equal(restored["w"], second["w"])


def test_an_equinox_save_stopped_before_its_rename_names_its_file(monkeypatch, tmp_path):
    """A first Equinox save killed before its one rename leaves its temporary file and no
    `<path>`: loading names that file; renamed to `<path>` as the message says, it loads
    (complete: stopped just before the rename). It said "No such file or directory"."""
    path = tmp_path / "ckpt.eqx"
    saved = {"w": jnp.arange(4.0)}
    with monkeypatch.context() as m:
        stop_before_renaming(m, lambda source: source.endswith(".tmp"))
        with pytest.raises(SystemExit):
            fp8jax.save_checkpoint(path, saved)
    (left,) = tmp_path.iterdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint at") as info:
        fp8jax.load_checkpoint(path, {"w": jnp.zeros(4)})
    message = str(info.value)
    assert f"{repr(os.fspath(left))} (a file a save was writing" in message, message
    assert f"rename it to {repr(os.fspath(path))}" in message, message
    left.rename(path)
    restored = fp8jax.load_checkpoint(path, {"w": jnp.zeros(4)})
    np.testing.assert_array_equal(restored["w"], saved["w"])


def test_mxfp8_s_scaled_matmul_choice_is_not_part_of_the_checkpoint(tmp_path):
    """MXFP8's `use_scaled_matmul` chooses only how its forward GEMM runs (JAX's
    `scaled_matmul` on a GPU that has it, or the emulation): a CPU run resumes on such a
    GPU, as across `native_kernel`. It was refused as a recipe difference. What the state
    depends on (`scale_rounding`) still is, naming only that option."""
    step, state = build(jax.random.key(0), fp8jax.Fp8Config(recipe=fp8jax.MXFP8()))
    state = run(step, state, 0, 1)
    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, state)
    for choice in (True, False):
        config = fp8jax.Fp8Config(recipe=fp8jax.MXFP8(use_scaled_matmul=choice))
        _, other = build(jax.random.key(1), config)
        assert bits(fp8jax.load_checkpoint(path, other)) == bits(state)
    floor = fp8jax.MXFP8(use_scaled_matmul=True, scale_rounding="floor")
    _, wrong = build(jax.random.key(1), fp8jax.Fp8Config(recipe=floor))
    with pytest.raises(ValueError) as info:
        fp8jax.load_checkpoint(path, wrong)
    assert "FP8 layer 'layers.0': recipe MXFP8: scale_rounding 'ceil' != 'floor'\n" in str(
        info.value
    )


@pytest.mark.parametrize("margin", [0, np.float64(0.0)], ids=["int", "numpy"])
def test_a_recipe_field_written_as_an_int_or_a_float_is_one_recipe(margin, tmp_path):
    """`DelayedScaling(margin=0)` is the recipe `DelayedScaling()` (`margin=0.0`): equal
    recipes, though their reprs differ, restore into each other; another margin is refused."""
    as_int = fp8jax.DelayedScaling(history_len=4, margin=margin)
    if isinstance(margin, np.floating):
        # A recipe now holds the Python number; older fp8jax kept the NumPy scalar, and its
        # checkpoints' records read `margin=np.float64(0.0)`, which still restore.
        assert repr(as_int) == repr(fp8jax.DelayedScaling(history_len=4, margin=0.0))
        object.__setattr__(as_int, "margin", margin)
    as_float = fp8jax.DelayedScaling(history_len=4, margin=0.0)
    assert as_int == as_float and repr(as_int) != repr(as_float)
    step, state = build(jax.random.key(0), fp8jax.Fp8Config(recipe=as_int, telemetry=True))
    state = run(step, state, 0, 2)
    fp8jax.save_checkpoint(tmp_path / "ckpt", state)
    _, like = build(jax.random.key(1), fp8jax.Fp8Config(recipe=as_float, telemetry=True))
    assert bits(fp8jax.load_checkpoint(tmp_path / "ckpt", like)) == bits(state)
    other = fp8jax.Fp8Config(
        recipe=fp8jax.DelayedScaling(history_len=4, margin=1.0), telemetry=True
    )
    _, wrong = build(jax.random.key(1), other)
    with pytest.raises(ValueError, match=r"margin .*0.*\)? != 1.0"):
        fp8jax.load_checkpoint(tmp_path / "ckpt", wrong)


@needs_orbax
def test_an_orbax_save_replaces_nothing_but_a_checkpoint(tmp_path):
    """An orbax save replaces the directory at `path` whole: a file there, or a directory
    that is not a checkpoint (`"."`, a run's output directory), is refused before anything is
    written, and kept. A file was moved aside and the save then failed; a directory was
    deleted."""
    state = {"w": jnp.arange(4.0)}
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "log.txt").write_text("keep me")
    for path, what in ((afile, "a file, not an"), (outputs, "a directory that is not an")):
        with pytest.raises(FileExistsError, match=what):
            fp8jax.save_checkpoint(path, state, backend="orbax")
    assert afile.read_text() == "mine" and (outputs / "log.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "outputs"]
    # A checkpoint it wrote is replaced, as before.
    fp8jax.save_checkpoint(tmp_path / "ckpt", state, backend="orbax")
    fp8jax.save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4)}, backend="orbax")
    restored = fp8jax.load_checkpoint(tmp_path / "ckpt", state, backend="orbax")
    np.testing.assert_array_equal(restored["w"], np.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_save_is_on_disk_before_it_replaces_the_previous_checkpoint(
    backend, tmp_path, monkeypatch
):
    """Written completely or not at all, across a crash or a power loss too: the new file
    (orbax: its record) is fsynced before the rename that makes it the checkpoint, and the
    directory holding the checkpoint after it, as POSIX asks of a durable replacement."""
    path = tmp_path / "ckpt"
    fp8jax.save_checkpoint(path, {"w": jnp.zeros(4)}, backend=backend)  # to be replaced
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return fsync(fd)

    def recorded_replace(src, dst, **kwargs):
        events.append(("replace", os.stat(src).st_ino))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    fp8jax.save_checkpoint(path, {"w": jnp.arange(4.0)}, backend=backend)
    monkeypatch.undo()
    data = path / "fp8jax_record.json" if backend == "orbax" else path
    renamed = events.index(("replace", path.stat().st_ino))
    assert ("fsync", data.stat().st_ino) in events[:renamed]
    assert ("fsync", tmp_path.stat().st_ino) in events[renamed:]
    restored = fp8jax.load_checkpoint(path, {"w": jnp.zeros(4)}, backend=backend)
    np.testing.assert_array_equal(restored["w"], np.arange(4.0))


def test_an_equinox_checkpoint_file_gets_a_new_files_permissions(tmp_path):
    """The file is written to a temporary file (mode 0600) and renamed: it now gets what
    `open` would give under the umask, or keeps the permissions of the file it replaces."""
    path = tmp_path / "ckpt.eqx"
    previous = os.umask(0o022)
    try:
        fp8jax.save_checkpoint(path, {"w": jnp.arange(4.0)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.chmod(path, 0o640)
        fp8jax.save_checkpoint(path, {"w": jnp.ones(4)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        os.umask(0o077)
        fp8jax.save_checkpoint(tmp_path / "private.eqx", {"w": jnp.ones(4)})
        assert stat.S_IMODE((tmp_path / "private.eqx").stat().st_mode) == 0o600
    finally:
        os.umask(previous)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_nnx_model_with_a_shared_layer_restores_it_shared(backend, tmp_path):
    """An NNX model that uses one Linear twice (tied weights: `self.fc2 = self.fc1`) restores
    with that layer still one object, and resumes as the uninterrupted run does. JAX's
    pytree view of NNX objects copies a shared one at each place it appears: the restored
    layer was two, trained apart (and the restored optimizer, over one, refused them)."""
    nnx = pytest.importorskip("flax.nnx")

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(8, 8, rngs=rngs)
            self.fc2 = self.fc1
            self.out = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.gelu(self.fc2(jax.nn.gelu(self.fc1(x)))))

    def pair(seed):
        config = fp8jax.Fp8Config(exclude=None, keep=())
        model = fp8jax.fp8_linear_layers(Tied(nnx.Rngs(seed)), config)
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    step = fp8jax.nnx_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2))

    def go(model, optimizer, start, stop):
        for i in range(start, stop):
            step(model, optimizer, *batch(i))
        return [np.asarray(a).tobytes() for a in jax.tree.leaves(nnx.state((model, optimizer)))]

    model, optimizer = pair(0)
    go(model, optimizer, 0, 2)
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqx")
    fp8jax.save_checkpoint(path, (model, optimizer), backend=backend)
    restored, restored_optimizer = fp8jax.load_checkpoint(path, pair(1), backend=backend)
    assert restored.fc2 is restored.fc1
    assert go(restored, restored_optimizer, 2, 4) == go(model, optimizer, 2, 4)


@needs_orbax
@pytest.mark.parametrize("fail", ["arrays", "rename"])
def test_a_failed_orbax_save_leaves_the_directory_as_it_was(fail, monkeypatch, tmp_path):
    """An orbax save that raises (orbax failing mid-save, or the final rename) raises that
    error and leaves the previous checkpoint at `path`, loadable, and nothing beside it. It
    left its half-written `<path>.tmp` behind (and, when the rename failed, no `path`)."""
    import orbax.checkpoint as ocp

    path = tmp_path / "ckpt"
    first, like = {"w": jnp.arange(4.0)}, {"w": jnp.zeros(4)}
    fp8jax.save_checkpoint(path, first, backend="orbax")
    save, replace = ocp.StandardCheckpointer.save, os.replace

    def saving_then_failing(self, *args, **kwargs):
        save(self, *args, **kwargs)  # shards written into `<path>.tmp`, then a failure
        raise OSError("disk full")

    def failing_rename(source, target):
        if os.fspath(source).endswith("ckpt.tmp"):
            raise OSError("disk full")
        return replace(source, target)

    with monkeypatch.context() as m:
        if fail == "arrays":
            m.setattr(ocp.StandardCheckpointer, "save", saving_then_failing)
        else:
            m.setattr(os, "replace", failing_rename)
        with pytest.raises(OSError, match="disk full"):
            fp8jax.save_checkpoint(path, {"w": jnp.arange(4.0) + 10}, backend="orbax")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    restored = fp8jax.load_checkpoint(path, like, backend="orbax")
    np.testing.assert_array_equal(restored["w"], first["w"])
    fp8jax.save_checkpoint(path, {"w": jnp.arange(4.0) + 20}, backend="orbax")  # a retry
    np.testing.assert_array_equal(
        fp8jax.load_checkpoint(path, like, backend="orbax")["w"], first["w"] + 20
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_path_starting_with_a_tilde_is_in_the_home_directory(backend, monkeypatch, tmp_path):
    """`~/ckpt` is `ckpt` in the home directory (as `os.path.expanduser` reads it), not a
    directory named `~` made in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", os.fspath(home))
    monkeypatch.chdir(work)
    state = {"w": jnp.arange(4.0, dtype=jnp.bfloat16)}
    fp8jax.save_checkpoint("~/ckpt", state, backend=backend)
    assert list(work.iterdir()) == []
    assert (home / "ckpt").exists()
    restored = fp8jax.load_checkpoint(pathlib.Path("~/ckpt"), state, backend=backend)
    assert restored["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_path_that_cannot_be_written_is_named(backend, capfd, tmp_path):
    """A save where nothing can be written (under a file, not a directory) raises an `OSError`
    naming the checkpoint's path, before orbax starts (whose threads would print tracebacks
    of the temporary directory they could not make), and leaves nothing behind."""
    (tmp_path / "file").write_text("not a directory")
    path = tmp_path / "file" / "ckpt"
    with pytest.raises(NotADirectoryError) as raised:
        fp8jax.save_checkpoint(path, {"w": jnp.ones(3)}, backend=backend)
    assert str(raised.value).startswith(f"save_checkpoint: cannot write {os.fspath(path)!r}")
    assert "Traceback" not in capfd.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prng_key_of_another_implementation_is_named_as_such(backend, tmp_path):
    """Restoring an `rbg` key into a `threefry` one is refused naming both key types, not
    only the shapes of their data, which the user's state never shows."""
    saved = {"k": jax.random.key(0, impl="rbg")}
    like = {"k": jax.random.key(0)}
    fp8jax.save_checkpoint(tmp_path / "ckpt", saved, backend=backend)
    data = (jax.random.key_data(saved["k"]).shape, jax.random.key_data(like["k"]).shape)
    with pytest.raises(ValueError) as raised:
        fp8jax.load_checkpoint(tmp_path / "ckpt", like, backend=backend)
    message = str(raised.value)
    assert f"uint32{data[0]}, target has uint32{data[1]}" in message
    assert f"{saved['k'].dtype} saved, {like['k'].dtype} in the target" in message
    restored = fp8jax.load_checkpoint(tmp_path / "ckpt", saved, backend=backend)
    assert restored["k"].dtype == saved["k"].dtype
    np.testing.assert_array_equal(
        jax.random.key_data(restored["k"]), jax.random.key_data(saved["k"])
    )


def test_a_plain_models_checkpoint_says_how_to_load_it_into_fp8(tmp_path):
    """A checkpoint of the model before conversion, loaded into the converted one, is refused
    saying so and how to load it (into the plain model, then convert), which works: the
    weights are the saved ones, bit for bit."""
    mlp = eqx.nn.MLP(8, 2, 32, 2, key=jax.random.key(0))
    fp8jax.save_checkpoint(tmp_path / "plain", mlp)
    other = eqx.nn.MLP(8, 2, 32, 2, key=jax.random.key(1))
    with pytest.raises(ValueError, match="holds no FP8 layer") as raised:
        fp8jax.load_checkpoint(tmp_path / "plain", fp8jax.fp8_linear_layers(other))
    assert "load it with the unconverted model as `like`, then convert" in str(raised.value)
    model = fp8jax.fp8_linear_layers(fp8jax.load_checkpoint(tmp_path / "plain", other))
    for saved, restored in zip(mlp.layers, model.layers, strict=True):
        assert np.asarray(saved.weight).tobytes() == np.asarray(restored.weight).tobytes()


def test_a_python_number_in_like_restores_an_unsigned_step_and_is_named_against_a_shaped_one(
    tmp_path,
):
    """A Python `int` in `like` restores a saved 0-d unsigned array (a `uint32` step) as that
    array; against a saved array with a shape it is refused, named as the Python int it is."""
    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, {"step": jnp.uint32(7), "steps": jnp.arange(3, dtype=jnp.int32)})
    restored = fp8jax.load_checkpoint(path, {"step": 0, "steps": jnp.zeros(3, jnp.int32)})
    assert restored["step"].dtype == np.uint32 and int(restored["step"]) == 7
    with pytest.raises(
        ValueError, match=r"leaf \['steps'\]: checkpoint has int32\(3,\), target has a Python int"
    ):
        fp8jax.load_checkpoint(path, {"step": 0, "steps": 0})


def test_a_current_scaling_checkpoint_without_scale_inverses_keeps_its_scales(tmp_path):
    """Current scaling's merge keeps a restored scale as it is (delayed scaling's computes it
    again from the history): restored from a checkpoint written before `TensorState` kept
    `scale_inv`, each state holds the saved scale, and `1 / scale` as its inverse."""
    config = fp8jax.Fp8Config(recipe="current")
    step, state = build(jax.random.key(0), config)
    state = run(step, state, 0, 2)

    path = tmp_path / "ckpt.eqx"
    fp8jax.save_checkpoint(path, jax.tree.map(older, state, is_leaf=is_state))
    restored = fp8jax.load_checkpoint(path, build(jax.random.key(1), config)[1])
    saved = [np.asarray(n.scale) for n in jax.tree.leaves(state, is_leaf=is_state) if is_state(n)]
    got = [n for n in jax.tree.leaves(restored, is_leaf=is_state) if is_state(n)]
    assert len(got) == len(saved) and any(float(s) != 1.0 for s in saved)
    for n, scale in zip(got, saved, strict=True):
        np.testing.assert_array_equal(np.asarray(n.scale), scale)
        np.testing.assert_array_equal(np.asarray(n.scale_inv, np.float64), 1 / np.float64(scale))


def test_a_recipe_field_that_is_no_literal_is_compared_as_written():
    """A recipe's field whose repr is no Python literal (a user recipe holding a dtype, say)
    is compared as written: two that differ are a difference, named, not one recipe."""
    from fp8jax._src.train import checkpoint_record

    def record(dtype):
        layer = {"name": "fc", "recipe": f"Mine(dtype=<class 'jax.numpy.{dtype}'>, margin=0)"}
        return {"fp8_layers": {".fc": {**layer, "telemetry": False}}, "leaves": {}}

    checkpoint_record.check_fp8_record(record("float8_e4m3fn"), record("float8_e4m3fn"), "c")
    with pytest.raises(
        ValueError,
        match=r"'fc': recipe Mine: dtype <class 'jax\.numpy\.float8_e5m2'> != "
        r"<class 'jax\.numpy\.float8_e4m3fn'>\n",
    ):
        checkpoint_record.check_fp8_record(record("float8_e5m2"), record("float8_e4m3fn"), "c")


def test_a_record_with_many_differences_lists_ten_and_counts_the_rest():
    """A mismatch message lists the first ten differences and counts the others."""
    from fp8jax._src.train import checkpoint_record

    def record(size):
        leaves = {f"w{i:02}": jax.ShapeDtypeStruct((size,), jnp.float32) for i in range(12)}
        return checkpoint_record.fp8_record(leaves)

    with pytest.raises(ValueError, match="nothing was loaded") as info:
        checkpoint_record.check_fp8_record(record(1), record(2), "c")
    lines = str(info.value).splitlines()
    listed = [line for line in lines if line.startswith("  - leaf ")]
    assert listed[0] == "  - leaf ['w00']: checkpoint has float32(1,), target has float32(2,)"
    assert len(listed) == 10 and "  (and 2 more)" in lines


def test_a_leaf_named_like_an_inverse_leaves_an_older_checkpoint_older(tmp_path):
    """A checkpoint written before `TensorState` kept `scale_inv` is told by its record naming
    no `.scale_inv` leaf: one of another name that starts so (`.scale_inverse`) does not make
    it a newer one; it restores, each inverse `1 / scale`."""

    class Extra(eqx.Module):
        scale_inverse: jax.Array

    path = tmp_path / "ckpt.eqx"
    saved = {"state": OlderTensorState(jnp.float32(4.0), jnp.arange(4.0)), "x": Extra(jnp.ones(2))}
    fp8jax.save_checkpoint(path, saved)
    like = {"state": fp8jax.TensorState(jnp.float32(1.0), jnp.zeros(4)), "x": Extra(jnp.zeros(2))}
    restored = fp8jax.load_checkpoint(path, like)
    assert float(restored["state"].scale) == 4.0 and float(restored["state"].scale_inv) == 0.25
    np.testing.assert_array_equal(restored["state"].amax_history, np.arange(4.0))
    np.testing.assert_array_equal(restored["x"].scale_inverse, np.ones(2))

"""Delayed scaling's warm start paid only while it can change anything: `scales_recorded`,
`without_warm_start`, and `make_train_step`'s switch to a program without it, bit for bit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SAME_BITS

import fp8jax
from fp8jax._src.core.compile_options import is_cublas_traced
from fp8jax._src.ops import warm_start
from fp8jax._src.recipes.per_tensor import (
    scales_known_recorded,
    skip_warm_start,
    warm_start_skipped,
)


def bits(tree):
    """Every array leaf as raw bytes: equal bits, not merely equal values."""
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def mlp(key, recipe="delayed"):
    model = eqx.nn.MLP(16, 4, 32, 2, key=key)
    return fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=recipe))


def batch(key):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (64, 16)), jax.random.normal(ky, (64, 4)) * 1e-3


def spied_mse(cublas=None):
    """A squared-error loss of `model(x)` against `y`, and the list into which each of its
    traces appends whether it was traced with the warm start skipped (and to `cublas`, if
    given, whether it was traced for a compile with Triton GEMMs off)."""
    traced = []

    def loss(model, x, y):
        traced.append(warm_start_skipped())
        if cublas is not None:
            cublas.append(is_cublas_traced())
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return loss, traced


def test_scales_recorded_after_every_state_has_an_amax(getkey):
    model = mlp(getkey())
    x, _ = batch(getkey())
    assert not bool(fp8jax.scales_recorded(model))  # fresh: scale 0, "no amax yet"
    loss = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)  # noqa: E731
    overwrites, grads = fp8jax.partition_for_grad_overwrite(fp8jax.filter_grad(loss)(model))
    no_change = jax.tree.map(jnp.zeros_like, eqx.filter(grads, eqx.is_inexact_array))
    stepped = fp8jax.apply_updates(model, no_change, overwrites)  # the new FP8 state only
    assert bool(fp8jax.scales_recorded(stepped))
    # one state emptied again: not recorded
    layer = stepped.layers[1].dot_general
    empty = eqx.tree_at(
        lambda m: m.layers[1].dot_general.output_grad.scale,
        stepped,
        jnp.zeros_like(layer.output_grad.scale),
    )
    assert not bool(fp8jax.scales_recorded(empty))
    # nothing to record: current scaling, a model without FP8 layers
    assert bool(fp8jax.scales_recorded(mlp(getkey(), "current")))
    assert bool(fp8jax.scales_recorded(eqx.nn.Linear(3, 3, key=getkey())))
    without = mlp(getkey(), fp8jax.DelayedScaling(warm_start=False))
    assert bool(fp8jax.scales_recorded(without))


def test_without_warm_start_casts_by_the_state_alone(getkey):
    """Traced by `without_warm_start`, a fresh delayed state casts with scale 1.0, as
    `warm_start=False` does (the warm start would scale by the operand's own amax); a
    function jitted and traced warm first is traced again without it."""
    key = getkey()
    x, _ = batch(getkey())
    warm, cold = mlp(key), mlp(key, fp8jax.DelayedScaling(warm_start=False))
    forward = lambda m: jax.vmap(m)(x)  # noqa: E731
    skipped = eqx.filter_jit(fp8jax.without_warm_start(forward))(warm)
    assert bits(skipped) == bits(eqx.filter_jit(forward)(cold))
    assert bits(skipped) != bits(eqx.filter_jit(forward)(warm))
    # Its state is still taken: the step's amaxes enter the histories, as they would warm.
    loss = lambda m: jnp.sum(jax.vmap(m)(x) ** 2)  # noqa: E731
    skipped_grad = fp8jax.without_warm_start(fp8jax.filter_grad(loss))
    for grads in (fp8jax.filter_grad(loss)(warm), skipped_grad(warm)):
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
        stepped = fp8jax.apply_updates(warm, None, overwrites)
        assert bool(fp8jax.scales_recorded(stepped))
        assert float(stepped.layers[0].dot_general.input.amax_history[0]) == float(
            jnp.max(jnp.abs(x))
        )
    jitted = eqx.filter_jit(forward)
    assert bits(jitted(warm)) != bits(skipped)
    assert bits(fp8jax.without_warm_start(jitted)(warm)) == bits(skipped)
    assert bits(jitted(warm)) == bits(eqx.filter_jit(forward)(warm))  # both traces kept
    with pytest.raises(TypeError, match="not callable"):
        fp8jax.without_warm_start(3)


@pytest.mark.parametrize("cublas_mode", [False, True], ids=["xla-defaults", "cublas-mode"])
def test_train_step_drops_the_warm_start_once_every_scale_is_recorded(
    getkey, monkeypatch, cublas_mode
):
    """After `WARM_STEPS` steps with the warm start (here 1) every step runs without it
    (one trace each), and the states and losses are those of steps that all keep it, bit
    for bit. A state from elsewhere starts with the warm start again. With Triton GEMMs off
    (ignored on a CPU) the steps are traced for cuBLAS, where the GEMMs without the warm
    start take the kept inverses on their operands: the same bits again."""
    monkeypatch.setattr(warm_start, "WARM_STEPS", 1)
    model = mlp(getkey())
    x, y = batch(getkey())
    cublas = []
    loss, traced = spied_mse(cublas)
    options = {**SAME_BITS, **(fp8jax.gpu_compiler_options() if cublas_mode else {})}

    train_step = fp8jax.make_train_step(loss, optax.adam(1e-2), compiler_options=options)
    state = first = train_step.init(model)
    losses = []
    for _ in range(3):
        state, metrics = train_step(state, x, y)
        losses.append(metrics.loss)
    assert traced == [False, True] and cublas == [cublas_mode] * 2
    # The reference: each step on a copy of the state (a state from elsewhere: the warm start).
    ref, ref_losses = first, []
    for _ in range(3):
        ref, metrics = train_step(jax.tree.map(lambda a: a, ref), x, y)
        ref_losses.append(metrics.loss)
    assert traced == [False, True]  # no new trace: the warm program, as in the first step
    assert bits(state) == bits(ref) and bits(losses) == bits(ref_losses)
    again, _ = train_step(first, x, y)  # `first` is no step's output: the warm start again
    assert bits(again) == bits(train_step(jax.tree.map(lambda a: a, first), x, y)[0])


@pytest.mark.parametrize("loss_scale", [None, fp8jax.DynamicLossScale(2.0, period=1)])
def test_train_step_without_the_warm_start_survives_a_history_emptied_again(
    getkey, monkeypatch, loss_scale
):
    """A step whose output gradients are all zero (a fully masked batch) empties a history of
    one amax: the state keeps its scale, and so does the rescaling for a loss scale that
    grows (every step here), so that the steps after it, which run without the warm start,
    train as steps that all keep it do (here they cast the gradients by a scale of 0 and the
    weights stopped moving)."""
    monkeypatch.setattr(warm_start, "WARM_STEPS", 1)
    model = mlp(getkey(), fp8jax.DelayedScaling(history_len=1))
    x, y = batch(getkey())

    def loss(model, x, y, w):
        return w * jnp.mean((jax.vmap(model)(x) - y) ** 2)

    train_step = fp8jax.make_train_step(
        loss, optax.sgd(1e-1), loss_scale=loss_scale, compiler_options=SAME_BITS
    )
    state = ref = train_step.init(model)
    for w in [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]:
        state, _ = train_step(state, x, y, jnp.float32(w))
        # The reference: each step on a copy of the state (the warm start, every step).
        ref, _ = train_step(jax.tree.map(lambda a: a, ref), x, y, jnp.float32(w))
    assert bool(fp8jax.scales_recorded(state.model))
    assert bits(state) == bits(ref)


def test_train_step_keeps_the_warm_start_while_a_layer_has_recorded_nothing(getkey, monkeypatch):
    """A delayed-scaling layer the loss never calls keeps an empty state: every step keeps
    the warm start (the program that would skip it is never traced)."""
    monkeypatch.setattr(warm_start, "WARM_STEPS", 1)

    class Two(eqx.Module):
        used: eqx.nn.Linear
        unused: eqx.nn.Linear

    model = fp8jax.fp8_linear_layers(
        Two(eqx.nn.Linear(16, 4, key=getkey()), eqx.nn.Linear(16, 4, key=getkey())),
        fp8jax.Fp8Config(recipe="delayed", exclude=None),
    )
    x, y = batch(getkey())
    traced = []

    def loss(model, x, y):
        traced.append(warm_start_skipped())
        return jnp.mean((jax.vmap(model.used)(x) - y) ** 2)

    train_step = fp8jax.make_train_step(loss, optax.adam(1e-2))
    state = train_step.init(model)
    for _ in range(4):
        state, _ = train_step(state, x, y)
    assert traced == [False]
    assert not bool(fp8jax.scales_recorded(state.model))


def test_train_step_keeps_one_program_for_a_short_run(getkey):
    """A run of `WARM_STEPS` steps or fewer never compiles the second program: it would not
    earn back its compile."""
    model = mlp(getkey())
    x, y = batch(getkey())
    loss, traced = spied_mse()

    train_step = fp8jax.make_train_step(loss, optax.sgd(1e-2))
    state = train_step.init(model)
    for _ in range(warm_start.WARM_STEPS):
        state, _ = train_step(state, x, y)
    assert traced == [False]
    state, _ = train_step(state, x, y)  # the next step: the scales were recorded
    assert traced == [False, True]


def test_trace_time_settings_restore_what_they_found():
    """`skip_warm_start` (and the other contexts, through `core.contexts.setting`) set their
    value inside the `with` only: nested, and after an exception, the previous one is back."""
    assert warm_start_skipped() is False
    with skip_warm_start():
        with skip_warm_start(recorded=True):
            assert scales_known_recorded()
        assert warm_start_skipped() and not scales_known_recorded()
        with pytest.raises(RuntimeError), skip_warm_start(recorded=True):
            raise RuntimeError
        assert not scales_known_recorded()
    assert warm_start_skipped() is False


def test_only_a_state_with_the_warm_start_gives_a_second_program(getkey):
    """A train step has its program without the warm start (`programs`: the recorded one
    first, and a flag from `recorded_flag`) only for a tree holding a delayed-scaling state
    with the warm start; a tree without one (`warm_start=False`, current scaling, no FP8
    layer) keeps its one program, with no flag (`True` from `scales_recorded`)."""
    warm = mlp(getkey())
    assert warm_start.programs(warm) == (("recorded", False), ("first", True))
    flag = warm_start.recorded_flag(warm)
    assert flag is not None and not bool(flag)
    for tree in (
        mlp(getkey(), fp8jax.DelayedScaling(warm_start=False)),
        mlp(getkey(), "current"),
        eqx.nn.Linear(3, 3, key=getkey()),
    ):
        assert warm_start.programs(tree) == (("first", True),)
        assert warm_start.recorded_flag(tree) is None
        assert bool(fp8jax.scales_recorded(tree))


class _Answer:
    """A step's device answer to `recorded_flag`: `value`, computed (`is_ready`) or not;
    `reads` counts the reads of its value (a read of one not computed waits for it)."""

    def __init__(self, value, ready):
        self.value, self.ready, self.reads = value, ready, 0

    def is_ready(self):
        return self.ready

    def __bool__(self):
        self.reads += 1
        return self.value


class _State:
    """Stands for a state a step returns (held weakly, compared by identity)."""


def test_read_waits_out_the_warm_steps_then_blocks_twice_at_most(monkeypatch):
    """`read` as the docs say: nothing read in a lineage's first `WARM_STEPS` steps; then
    the step before's answer, waited for while blocking reads are left (2), afterwards only
    once computed; once it said yes, yes without reading. Written out by hand for 3 warm
    steps, each step remembering what it said as `TrainStep.__call__` does."""
    monkeypatch.setattr(warm_start, "WARM_STEPS", 3)
    # Step i's answer: its value, and whether it is computed by the next step's read.
    answers = [_Answer(i >= 4, i >= 6) for i in range(9)]
    state, said = _State(), []
    for answer in answers:
        recorded, lineage = warm_start.read((state,))
        said.append(recorded)
        state = _State()
        warm_start.remember((state,), lineage._replace(said=True if recorded else answer))
    assert said == [False] * 7 + [True, True]
    # Read: the answers of steps 2 and 3 (blocking), 6 (computed); 4, 5 not computed.
    assert [a.reads for a in answers] == [0, 0, 1, 1, 0, 0, 1, 0, 0]
    assert lineage.steps == 9
    # A state that is no step's output starts a lineage: the warm start again.
    assert warm_start.read((_State(),)) == (False, warm_start.Lineage(steps=1))
    # One of several objects dead and its id taken by another object (as CPython reuses
    # freed memory; here `id` says so, not left to the allocator): a new lineage too.
    first, second = _State(), _State()
    warm_start.remember((first, second), warm_start.Lineage(said=True, steps=9))
    assert warm_start.read((first, second))[0] is True
    dead, other = id(second), _State()
    del second
    monkeypatch.setattr(warm_start, "id", lambda o: dead if o is other else id(o), raising=False)
    assert warm_start.read((first, other)) == (False, warm_start.Lineage(steps=1))
    # Nothing standing for the state (an NNX model without FP8 arrays): nothing kept.
    warm_start.remember((), warm_start.Lineage(said=True, steps=9))
    assert warm_start.read(()) == (False, warm_start.Lineage(steps=1))

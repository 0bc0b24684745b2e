"""Flax NNX: conversion, numerics against the Equinox path and Flax Linen, training, max-not-sum,
the optimizer kept off the FP8 state, and the deviceless H100 compile of an NNX train step."""

import functools
import math
import os
import pathlib
import re
import subprocess
import sys
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops
from helpers import (
    RECIPES,
    SAME_BITS,
    assert_examples_not_calling_the_model_are_refused,
    h100_topology,
    make_train_step,
    representable,
)

import fp8jax
from fp8jax._src.convert.einsum import einsum_dimension_numbers
from fp8jax._src.observe import deviceless

DIFF = nnx.DiffState(0, (nnx.Param, fp8jax.Fp8State))


def config(recipe: Any = None, **kwargs: Any) -> fp8jax.Fp8Config:
    return fp8jax.Fp8Config(recipe=recipe, exclude=None, keep=(), **kwargs)


class NnxNet(nnx.Module):
    def __init__(self, sizes: tuple[int, int, int], rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(sizes[0], sizes[1], rngs=rngs)
        self.fc2 = nnx.Linear(sizes[1], sizes[2], rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


class EqxNet(eqx.Module):
    fc1: Any
    fc2: Any

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def to_eqx(linear: nnx.Linear) -> eqx.nn.Linear:
    """The same layer in Equinox: NNX's kernel is (in, out), Equinox's weight (out, in)."""
    kernel = linear.kernel.get_value()
    layer = eqx.nn.Linear(kernel.shape[0], kernel.shape[1], key=jax.random.key(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), layer, (kernel.T, linear.bias.get_value()))


def eqx_net(net: NnxNet) -> EqxNet:
    return EqxNet(to_eqx(net.fc1), to_eqx(net.fc2))


def assert_same_state(ours: fp8jax.Fp8NnxDotGeneral, theirs: fp8jax.Fp8DotGeneral) -> None:
    value = ours.value()
    assert jax.tree.structure(value) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


# --- numerics: the Equinox path, bit for bit ----------------------------------------------


@nnx.jit
def nnx_forward_and_grads(model, x, c):
    def loss(m, x):
        return jnp.sum(m(x) * c)

    grads, grad_x = nnx.grad(loss, argnums=(DIFF, 1))(model, x)
    return model(x), grads, grad_x


@eqx.filter_jit
def eqx_forward_and_grads(model, x, c):
    grads, grad_x = eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1]) * c))((model, x))
    return model(x), grads, grad_x


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_matches_the_equinox_path_bit_for_bit(name):
    net = NnxNet((64, 32, 64), nnx.Rngs(0))
    ours = fp8jax.fp8_linear_layers(net, config(RECIPES[name]))
    theirs = fp8jax.fp8_linear_layers(eqx_net(net), config(RECIPES[name]))
    rng = np.random.default_rng(0)
    for step in range(2):  # the second step runs with the state the first one produced
        x = jnp.asarray(rng.standard_normal((2, 16, 64)) * (1 + 4 * step), jnp.float32)
        c = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
        out, grads, grad_x = nnx_forward_and_grads(ours, x, c)
        out_e, grads_e, grad_x_e = eqx_forward_and_grads(theirs, x, c)
        np.testing.assert_array_equal(out, out_e)
        np.testing.assert_array_equal(grad_x, grad_x_e)
        for layer in ("fc1", "fc2"):
            np.testing.assert_array_equal(
                grads[layer]["kernel"].get_value(), getattr(grads_e, layer).weight.T
            )
            np.testing.assert_array_equal(
                grads[layer]["bias"].get_value(), getattr(grads_e, layer).bias
            )
        fp8jax.nnx_update_fp8_state(ours, grads)
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads_e)
        theirs = fp8jax.apply_updates(theirs, None, overwrites)
        for layer in ("fc1", "fc2"):
            assert_same_state(getattr(ours, layer).dot_general, getattr(theirs, layer).dot_general)


# Bit for bit where XLA compiles the two steps alike. With block recipes XLA fuses the sum of
# the wgrad's per-block partial products into Adam's update differently for NNX's (in, out)
# kernel than for Equinox's (out, in) weight, which changes float32 rounding by an ulp from the
# second step on (with an optimization_barrier between gradient and update both are bit
# for bit equal: the gradients themselves are, as test_every_recipe_... checks).
EXACT_TRAINING = {"delayed", "current"}


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise", "residual"])
def test_training_run_matches_the_equinox_run_step_by_step(name):
    net = NnxNet((64, 32, 32), nnx.Rngs(1))
    ours = fp8jax.fp8_linear_layers(net, config(RECIPES[name]))
    optimizer = nnx.Optimizer(ours, optax.adam(1e-2), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(mse)

    theirs = fp8jax.fp8_linear_layers(eqx_net(net), config(RECIPES[name]))
    tx = optax.adam(1e-2)
    _, trainable = fp8jax.partition_for_grad_overwrite(theirs)
    opt_state = tx.init(eqx.filter(trainable, eqx.is_inexact_array))
    eqx_step = eqx.filter_jit(make_train_step(mse, tx))

    if name in EXACT_TRAINING:
        same = np.testing.assert_array_equal
    else:
        same = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    rng = np.random.default_rng(2)
    target = rng.standard_normal((64, 32)).astype(np.float32)
    losses = []
    for _ in range(5):
        x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
        y = jnp.tanh(x @ target)
        loss = step(ours, optimizer, x, y)
        theirs, opt_state, loss_e = eqx_step(theirs, opt_state, x, y)
        same(loss, loss_e)
        losses.append(float(loss))
        for layer in ("fc1", "fc2"):
            value = getattr(ours, layer).dot_general.value()
            expected = getattr(theirs, layer).dot_general
            assert jax.tree.structure(value) == jax.tree.structure(expected)
            for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(expected), strict=True):
                same(a, b)
            same(getattr(ours, layer).kernel.get_value(), getattr(theirs, layer).weight.T)
    assert int(optimizer.step.get_value()) == 5
    assert losses[-1] < losses[0]


# --- an independent reference: Flax Linen's Fp8DirectDotGeneralOp ---------------------------


class OneLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(32, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


def test_delayed_scaling_matches_flax_linen_fp8_direct_dot_general():
    # Flax computes scale = fp8_max / amax without rounding it to a power of two, and stores
    # its reciprocal; it divides by that reciprocal where fp8jax multiplies by the scale, so
    # outputs agree to float32 rounding, amax histories exactly. Flax scales a fresh history
    # by 1.0: fp8jax's warm start is off for the comparison.
    recipe = fp8jax.DelayedScaling(history_len=16, power_of_two=False, warm_start=False)
    ours = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config(recipe))
    kernel = ours.fc.kernel.get_value()
    dims = (((1,), (0,)), ((), ()))
    op = fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=16)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    flax_state = op.init(jax.random.key(0), x, kernel, dims)[fp8_ops.OVERWRITE_WITH_GRADIENT]

    @jax.jit
    def flax_step(state, x, c):
        def loss(state):
            out = op.apply({fp8_ops.OVERWRITE_WITH_GRADIENT: state}, x, kernel, dims)
            return jnp.sum(out * c), out

        (_, out), new_state = jax.value_and_grad(loss, has_aux=True)(state)
        return out, new_state

    for step in range(4):
        x = jnp.asarray(rng.standard_normal((8, 32)) * 2.0**step, jnp.float32)
        c = jnp.asarray(rng.standard_normal((8, 16)) * 3.0**step, jnp.float32)
        before = ours.fc.dot_general.value()  # holds the scales this step uses
        out, grads, _ = nnx_forward_and_grads(ours, x, c)
        out_flax, flax_state = flax_step(flax_state, x, c)
        np.testing.assert_allclose(out, out_flax, rtol=2e-6, atol=1e-6)
        fp8jax.nnx_update_fp8_state(ours, grads)
        state = ours.fc.dot_general.value()
        for role in ("input", "kernel", "output_grad"):
            ours_role = getattr(state, role)
            np.testing.assert_array_equal(
                ours_role.amax_history, flax_state[f"{role}_amax_history"]
            )
            # Flax stores the reciprocal of the scale this step used, which fp8jax's state
            # held before the step (after it, it holds the next step's).
            np.testing.assert_allclose(
                getattr(before, role).scale, 1.0 / flax_state[f"{role}_scale"][0], rtol=1e-6
            )
        if step:
            assert float(state.input.scale) != 1.0  # the histories are in use


# --- max, not sum -------------------------------------------------------------------------


def test_a_layer_used_twice_keeps_the_larger_amax():
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    rng = np.random.default_rng(4)
    x1 = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    x2 = 7.0 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c1 = 3.0 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    c2 = 0.5 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

    def twice(m):
        return jnp.sum(m(x1) * c1) + jnp.sum(m(x2) * c2)

    _, grads = fp8jax.nnx_value_and_grad(twice)(layer)
    # The weight's own gradient still adds both uses.
    once = [
        fp8jax.nnx_value_and_grad(lambda m, x=x, c=c: jnp.sum(m(x) * c))(layer)[1]
        for x, c in ((x1, c1), (x2, c2))
    ]
    np.testing.assert_allclose(
        grads["fc"]["kernel"].get_value(),
        once[0]["fc"]["kernel"].get_value() + once[1]["fc"]["kernel"].get_value(),
        rtol=1e-6,
        atol=1e-6,
    )
    fp8jax.nnx_update_fp8_state(layer, grads)
    state = layer.fc.dot_general.value()
    newest = {r: float(getattr(state, r).amax_history[0]) for r in ("input", "output_grad")}
    assert newest == {
        "input": float(jnp.maximum(jnp.abs(x1).max(), jnp.abs(x2).max())),
        "output_grad": float(jnp.maximum(jnp.abs(c1).max(), jnp.abs(c2).max())),
    }
    # The state is float32 again, in the model and in the gradients.
    for tree in (nnx.state(layer, fp8jax.Fp8State), nnx.state(grads, fp8jax.Fp8State)):
        assert {leaf.dtype for leaf in jax.tree.leaves(tree)} == {jnp.dtype(jnp.float32)}


def test_a_layer_used_twice_keeps_the_scale_of_the_larger_amax():
    """Current scaling records each step's amax and the scale it gives: in the gradients
    `nnx_value_and_grad` returns (as `fp8jax.filter_value_and_grad`'s) and merged after two
    uses, the state holds the larger amax and its scale (computed in float64), not the
    larger of the two uses' scales (that of the smaller amax)."""
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config("current"))
    rng = np.random.default_rng(4)
    x1 = 0.3 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    x2 = 7.0 * jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    c1 = 3.0 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    c2 = 0.01 * jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

    def twice(m):
        return jnp.sum(m(x1) * c1) + jnp.sum(m(x2) * c2)

    _, grads = fp8jax.nnx_value_and_grad(twice)(layer)
    received = grads["fc"]["dot_general"]["state"]
    fp8jax.nnx_update_fp8_state(layer, grads)
    merged = layer.fc.dot_general.value()
    assert float(merged.input.amax_history[0]) == float(jnp.abs(x2).max())
    names = ("amax_history", "scale", "scale_inv")
    for role, dtype in (("input", jnp.float8_e4m3fn), ("output_grad", jnp.float8_e5m2)):
        sent = [jnp.ravel(received[role][name].get_value())[0] for name in names]
        kept = [jnp.ravel(getattr(getattr(merged, role), name))[0] for name in names]
        for where, (amax, scale, scale_inv) in (("gradients", sent), ("merged", kept)):
            exact = float(jnp.finfo(dtype).max) / np.float64(amax)
            want = 2.0 ** np.floor(np.log2(exact))
            assert (float(scale), float(scale_inv)) == (want, 1 / want), (role, where)


def test_plain_nnx_grad_refuses_a_layer_used_twice():
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match=r"FP8 layer 'fc' runs twice.*fp8jax.nnx_value_and_grad"):
        nnx.grad(lambda m: jnp.sum(m(x)) + jnp.sum(m(2 * x)), argnums=DIFF)(layer)


def test_the_nnx_layer_rewords_the_equinox_layers_typed_errors():
    dot = fp8jax.Fp8DotGeneral()
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    dims = (((1,), (0,)), ((), ()))
    with pytest.raises(fp8jax.StateUsedTwiceError, match="fp8jax.filter_value_and_grad"):
        jax.grad(lambda d: jnp.sum(d(x, w, dims)) + jnp.sum(d(x, w, dims)))(dot)
    with pytest.raises(fp8jax.StateNotDifferentiatedError, match="fp8jax.with_fp8_state"):
        jax.grad(lambda x: jnp.sum(dot(x, w, dims)))(x)
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    x = jnp.ones((2, 32))
    with pytest.raises(fp8jax.StateUsedTwiceError, match="nnx_value_and_grad") as raised:
        nnx.grad(lambda m: jnp.sum(m(x)) + jnp.sum(m(2 * x)), argnums=DIFF)(layer)
    assert raised.value.layer_name == "fc"
    assert isinstance(raised.value.__cause__, fp8jax.StateUsedTwiceError)
    assert "filter_value_and_grad" not in str(raised.value)


def test_scan_over_microbatches_keeps_the_largest_amax():
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    scales = jnp.array([1.0, 5.0, 0.5])
    xs = scales[:, None, None] * jnp.ones((3, 4, 32))

    def accumulated(m):
        @nnx.scan(in_axes=(None, 0), out_axes=0)
        def microbatch(m, x):
            return jnp.sum(m(x))

        return jnp.sum(microbatch(m, xs))

    _, grads = fp8jax.nnx_value_and_grad(accumulated)(layer)
    assert float(grads["fc"]["dot_general"]["state"]["input"]["amax_history"][0]) == 5.0
    # Plain nnx.grad cannot see the three uses (one per scan iteration) and adds them: the
    # reason for nnx_value_and_grad.
    plain = nnx.grad(accumulated, argnums=DIFF)(layer)
    assert float(plain["fc"]["dot_general"]["state"]["input"]["amax_history"][0]) == 6.5


def test_training_in_tree_mode_equals_graph_mode():
    x = jnp.asarray(np.random.default_rng(10).standard_normal((32, 64)), jnp.float32)
    losses = {}
    for graph in (True, False):
        with nnx.set_graph_mode(graph):
            model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
            step = fp8jax.nnx_train_step(mse)
            losses[graph] = [
                float(step(model, optimizer, x, jnp.zeros((32, 32)))) for _ in range(3)
            ]
            state = model.fc1.dot_general.value().input
        assert float(state.amax_history[0]) == float(jnp.abs(x).max())
    assert losses[True] == losses[False]


def test_train_step_traces_for_its_options(tmp_path):
    """With Triton GEMMs off (the default options) the step is traced for cuBLAS
    (`cublas_traced`): delayed scaling without the warm start then hands its kept inverses
    to each GEMM, compiled with XLA's dot merger off (`traced_options`). The same bits on a
    CPU as the step traced for XLA's defaults."""
    from fp8jax._src.core.compile_options import is_cublas_traced

    x = jnp.asarray(np.random.default_rng(11).standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(12).standard_normal((32, 32)), jnp.float32)
    recipe = fp8jax.DelayedScaling(history_len=4, warm_start=False)
    results, traced = {}, {True: [], False: []}
    for cublas in (True, False):

        def loss(model, x, y, cublas=cublas):
            traced[cublas].append(is_cublas_traced())
            return mse(model, x, y)

        model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config(recipe))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        options = {**(fp8jax.gpu_compiler_options() if cublas else {}), **SAME_BITS}
        if cublas:
            options["xla_dump_to"] = str(tmp_path)
        step = fp8jax.nnx_train_step(loss, compiler_options=options)
        losses = [np.asarray(step(model, optimizer, x, y)).tobytes() for _ in range(3)]
        assert traced[cublas] == [cublas], traced
        results[cublas] = (
            losses,
            [np.asarray(a).tobytes() for a in jax.tree.leaves(nnx.state(model))],
        )
    assert results[True] == results[False]
    dumped = [p.read_text() for p in tmp_path.glob("*pure*.debug_options")]
    assert dumped and all("xla_gpu_dot_merger_threshold_mb: 0" in text for text in dumped)


@pytest.mark.parametrize("cublas_mode", [False, True], ids=["xla-defaults", "cublas-mode"])
def test_train_step_drops_the_warm_start_once_every_scale_is_recorded(monkeypatch, cublas_mode):
    """As `make_train_step`'s (tests/test_warm_start_switch.py): after `WARM_STEPS` steps
    (here 1) with the warm start, the steps run the program without it (one trace each), bit
    for bit steps that all keep it. A model whose FP8 state was set since its last step (a
    checkpoint restored, a layer's state emptied) runs the warm start again: with the other
    program, an emptied scale would multiply the layer's input by zero."""
    from fp8jax._src.ops import warm_start
    from fp8jax._src.recipes.per_tensor import warm_start_skipped

    monkeypatch.setattr(warm_start, "WARM_STEPS", 1)
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    traced = []

    def loss(model, x, y):
        traced.append(warm_start_skipped())
        return mse(model, x, y)

    tx = optax.adam(1e-2)  # one, as the optimizer is static to the step: the same program

    def fresh():
        model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def bits(*trees):
        return [np.asarray(a).tobytes() for a in jax.tree.leaves(trees)]

    options = {**SAME_BITS, **(fp8jax.gpu_compiler_options() if cublas_mode else {})}
    step = fp8jax.nnx_train_step(loss, compiler_options=options)
    model, optimizer = fresh()
    assert not bool(fp8jax.scales_recorded(model))  # read on an NNX model too
    losses = [step(model, optimizer, x, y) for _ in range(3)]
    assert traced == [False, True] and bool(fp8jax.scales_recorded(model))
    # The reference: each step after its FP8 state was restored (copies of its arrays).
    ref, ref_optimizer = fresh()
    ref_losses = []
    for _ in range(3):
        nnx.update(ref, jax.tree.map(jnp.copy, nnx.state(ref, fp8jax.Fp8State)))
        ref_losses.append(step(ref, ref_optimizer, x, y))
    assert traced == [False, True]  # no new trace: the warm program, as in the first step
    assert bits(losses, nnx.state(model)) == bits(ref_losses, nnx.state(ref))
    # One layer's state emptied: the warm start again, as for a copy of the model.
    for m in (model, ref):
        value = m.fc1.dot_general.value()
        m.fc1.dot_general.set_value(
            eqx.tree_at(lambda d: d.input.scale, value, jnp.zeros_like(value.input.scale))
        )
    copy, copy_optimizer = nnx.clone((ref, ref_optimizer))
    assert bits(step(model, optimizer, x, y), nnx.state(model)) == bits(
        step(copy, copy_optimizer, x, y), nnx.state(copy)
    )
    assert traced == [False, True]


def test_train_step_stays_off_the_warm_start_once_it_dropped_it(monkeypatch):
    """After `WARM_STEPS` (here 1) warm steps and the step that reads the recorded scales,
    every later step runs the program without the warm start: a step without it says its
    scales are recorded (it ran the warm program every other step, saying nothing)."""
    from fp8jax._src.ops import warm_start

    monkeypatch.setattr(warm_start, "WARM_STEPS", 1)
    step = fp8jax.nnx_train_step(mse)
    ran = []
    for warm, program in list(step._jitted.items()):

        def counted(*args, _program=program, _warm=warm):
            ran.append(_warm)
            return _program(*args)

        monkeypatch.setitem(step._jitted, warm, counted)
    model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    x, y = jnp.ones((8, 64)), jnp.ones((8, 32))
    for _ in range(4):
        step(model, optimizer, x, y)
    assert ran == [True, False, False, False]


def test_train_step_is_inspected_as_it_compiles_both_its_programs():
    """`inspect(step, model, optimizer, ...)` of an `nnx_train_step` compiles its programs as
    the step does: once every scale is recorded (kept inverses, XLA's dot merger off) and,
    as `first_steps`, before. A layer called twice shares its weight's FP8 copy between 2
    forwards and 2 dgrads: 6 FP8 GEMMs in each program, where the step inside a caller's own
    `jit` (its first program, merger on) is inspected with some of them merged."""
    h100_topology()

    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.gain = nnx.Param(jnp.ones(512, jnp.bfloat16))
            self.fc = nnx.Linear(512, 512, use_bias=False, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, a, b):
            ya, yb = (self.fc(x * self.gain) for x in (a, b))
            return jnp.mean(ya.astype(jnp.float32) * yb.astype(jnp.float32))

    def build():
        model = fp8jax.fp8_linear_layers(Twice(nnx.Rngs(0)), config())
        return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    step = fp8jax.nnx_train_step(lambda m, a, b: m(a, b))
    report = fp8jax.assert_all_fp8(fp8jax.inspect(step, model, optimizer, x, x, modes=("cublas",)))
    first = report.first_steps
    assert report.count("cublas") == first.count("cublas") == (6, 6)
    assert len(report.cost["cublas"].kernels) < len(first.cost["cublas"].kernels)
    assert gemm_counts(report) == {"fc": {"fwd": 2, "dgrad": 2, "wgrad": 2}}
    own_jit = fp8jax.inspect(lambda *args: step(*args), model, optimizer, x, x, modes=("cublas",))
    assert own_jit.first_steps is None and own_jit.count("cublas")[0] < 6
    with pytest.raises(TypeError, match="model and its nnx.Optimizer first"):
        fp8jax.inspect(step, model)


def test_every_layers_state_is_merged_at_once(monkeypatch):
    """`nnx_update_fp8_state` merges every layer's state in one `merge_many` (a few kernels
    per step, as `apply_updates`; layer by layer, a few per layer: benchmarks/
    nnx_programs.py), to the values each layer's own `merge` gives."""
    x = jnp.asarray(np.random.default_rng(14).standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(15).standard_normal((32, 32)), jnp.float32)
    model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
    _, grads = fp8jax.nnx_value_and_grad(mse)(model, x, y)
    merge_many, calls = fp8jax.Fp8DotGeneral.merge_many, []

    def spied(pairs):
        calls.append(len(pairs))
        return merge_many(pairs)

    def states(one_by_one):
        calls.clear()
        merged = nnx.clone(model)
        if one_by_one:  # each layer's own merge
            for layer, received in ((merged.fc1, grads["fc1"]), (merged.fc2, grads["fc2"])):
                new = nnx.clone(layer.dot_general)
                nnx.update(new, nnx.State({"state": received["dot_general"]["state"]}))
                layer.dot_general.set_value(layer.dot_general.value().merge(new.value()))
        else:
            fp8jax.nnx_update_fp8_state(merged, grads)
        return [np.asarray(a).tobytes() for a in jax.tree.leaves(nnx.state(merged))]

    monkeypatch.setattr(fp8jax.Fp8DotGeneral, "merge_many", spied)
    alone = states(True)
    assert calls == [1, 1]
    assert states(False) == alone and calls == [2]
    assert alone != [np.asarray(a).tobytes() for a in jax.tree.leaves(nnx.state(model))]


# --- the optimizer never touches FP8 state --------------------------------------------------


def test_weight_decay_never_touches_fp8_state():
    model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
    optimizer = nnx.Optimizer(model, optax.adamw(0.1, weight_decay=0.5), wrt=nnx.Param)
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(optimizer))]
    assert paths and not any("dot_general" in p for p in paths)
    step = fp8jax.nnx_train_step(mse)
    rng = np.random.default_rng(5)
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
        expected = nnx.clone(model)
        _, grads = fp8jax.nnx_value_and_grad(mse)(expected, x, y)
        fp8jax.nnx_update_fp8_state(expected, grads)
        kernel = model.fc1.kernel.get_value()
        step(model, optimizer, x, y)
        assert not np.array_equal(model.fc1.kernel.get_value(), kernel)  # Params did move
        ours = jax.tree.leaves(nnx.state(model, fp8jax.Fp8State))
        want = jax.tree.leaves(nnx.state(expected, fp8jax.Fp8State))
        for a, b in zip(ours, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("has_aux", [False, True])
def test_train_step_gives_the_loss_to_an_optimizer_that_reads_it(has_aux):
    """An optax transformation that takes the loss as `value` (reduce_on_plateau) gets the
    step's loss, as in the same step written by hand (it crashed without it)."""

    def loss_fn(model, x, y):
        loss = mse(model, x, y)
        return (loss, {"twice": 2 * loss}) if has_aux else loss

    # rtol=0.5: any step that does not halve the loss is a plateau; the scale then halves.
    tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1, rtol=0.5))
    model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config())
    expected = nnx.clone(model)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer_e = nnx.Optimizer(expected, tx, wrt=nnx.Param)
    # A NumPy bool, the bool it holds (it was refused; Python bools: the other tests).
    step = fp8jax.nnx_train_step(loss_fn, has_aux=np.bool_(has_aux))

    @nnx.jit
    def by_hand(model, optimizer, x, y):
        value, grads = fp8jax.nnx_value_and_grad(loss_fn, has_aux=has_aux)(model, x, y)
        fp8jax.nnx_update_fp8_state(model, grads)
        optimizer.update(model, grads, value=value[0] if has_aux else value)
        return value

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    for _ in range(4):
        got, want = step(model, optimizer, x, y), by_hand(expected, optimizer_e, x, y)
        np.testing.assert_allclose(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-6)
    scale = optimizer.opt_state[1].scale.get_value()
    assert float(scale) == float(optimizer_e.opt_state[1].scale.get_value()) < 1.0
    np.testing.assert_allclose(
        model.fc1.kernel.get_value(), expected.fc1.kernel.get_value(), rtol=1e-5, atol=1e-7
    )


def test_train_step_refuses_an_optimizer_that_tracks_fp8_state():
    model = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Variable)
    with pytest.raises(ValueError, match=r"selects fp8jax.Fp8State.*wrt=nnx.Param"):
        fp8jax.nnx_train_step(lambda m, x: jnp.sum(m(x)))(model, optimizer, jnp.ones((2, 32)))
    with pytest.raises(TypeError, match=r"optimizer=GradientTransformation.*nnx.Optimizer"):
        fp8jax.nnx_train_step(lambda m, x: jnp.sum(m(x)))(model, optax.adam(1.0), jnp.ones((2, 32)))


# --- conversion -----------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_conversion_follows_the_config_and_keeps_the_original():
    model = Model(nnx.Rngs(0))
    converted = fp8jax.fp8_linear_layers(
        model, fp8jax.Fp8Config(targets=r"blocks\..*", recipes={r"blocks\.1\..*": "current"})
    )
    assert model.blocks[0].up.dot_general is jax.lax.dot_general  # the original is kept
    assert converted.head.dot_general is jax.lax.dot_general  # excluded by default (a head)
    layers = {
        f"blocks.{i}.{name}": type(getattr(converted.blocks[i], name).dot_general.recipe)
        for i in range(2)
        for name in ("up", "down")
    }
    assert layers == {
        "blocks.0.up": fp8jax.DelayedScaling,
        "blocks.0.down": fp8jax.DelayedScaling,
        "blocks.1.up": fp8jax.CurrentScaling,
        "blocks.1.down": fp8jax.CurrentScaling,
    }
    assert converted.blocks[1].down.dot_general.name == "blocks.1.down"
    np.testing.assert_array_equal(
        converted.blocks[0].up.kernel.get_value(), model.blocks[0].up.kernel.get_value()
    )
    # Converting again wraps nothing twice and keeps the state (here, after a step).
    x = jnp.ones((4, 32))
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x)))(converted)
    fp8jax.nnx_update_fp8_state(converted, grads)
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"blocks\.1\.up \(CurrentScaling; the"):
        again = fp8jax.fp8_linear_layers(converted, fp8jax.Fp8Config(targets=r"blocks\..*"))
    assert again.blocks[0].up.dot_general is not converted.blocks[0].up.dot_general  # a copy
    assert_same_state(again.blocks[0].up.dot_general, converted.blocks[0].up.dot_general.value())
    assert type(again.blocks[1].up.dot_general.recipe) is fp8jax.CurrentScaling  # kept
    # The state is filterable by its type; nothing of it is a Param.
    fp8_paths = {p[:3] for p, _ in nnx.to_flat_state(nnx.state(converted, fp8jax.Fp8State))}
    assert fp8_paths == {("blocks", i, p) for i in (0, 1) for p in ("up", "down")}
    params = nnx.state(converted, nnx.Param)
    assert not any("dot_general" in map(str, p) for p, _ in nnx.to_flat_state(params))


def test_a_linear_under_a_private_attribute_is_found():
    model = OneLayer(nnx.Rngs(0))
    model._extra = nnx.Linear(16, 16, rngs=nnx.Rngs(1))
    converted = fp8jax.fp8_linear_layers(model, config())
    assert converted._extra.dot_general.name == "_extra"


def test_a_shared_layer_is_converted_once():
    model = OneLayer(nnx.Rngs(0))
    model.again = model.fc
    converted = fp8jax.fp8_linear_layers(model, config())
    assert converted.again is converted.fc
    assert converted.fc.dot_general.name == "again"  # the first path NNX's graph gives it


def test_a_model_in_fp8_already_converts_again_with_an_example():
    """Converting again leaves FP8 layers as they are, with `example` too: an example calling
    a model whose every layer is FP8 already was refused as calling a model it closes over
    (the trace cannot see a kernel through its FP8 quantization)."""
    fp8 = fp8jax.fp8_linear_layers(NnxNet((8, 8, 4), nnx.Rngs(0)), config())
    x = jnp.ones((2, 8))
    plan = fp8jax.conversion_plan(fp8, config(), example=lambda m: m(x))
    assert plan.converted == ("fc1", "fc2") and plan.traced
    again = fp8jax.fp8_linear_layers(fp8, config(), example=lambda m: m(x))
    assert_same_state(again.fc2.dot_general, fp8.fc2.dot_general.value())


def test_converting_again_with_example_finds_the_roles_of_fp8_layers():
    """With `example`, the trace follows an FP8 layer's GEMM as its high-precision one: an
    einsum head converted before (keep=()) is the head the config keeps, named in the plan
    and the warning as the Equinox path names it; the model traced is left as it is."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(8, 16, rngs=rngs)
            self.proj = nnx.Einsum("bi,io->bo", (16, 4), rngs=rngs)

        def __call__(self, x):
            return self.proj(jax.nn.relu(self.fc(x)))

    model, x = Model(nnx.Rngs(0)), jnp.ones((2, 8))
    example = lambda m: m(x)  # noqa: E731
    reference = fp8jax.conversion_plan(model, example=example)
    assert reference.kept["proj"].startswith("head: ")
    once = fp8jax.fp8_linear_layers(model, config(), example=example)
    plan = fp8jax.conversion_plan(once, example=example)
    assert plan.converted == ("fc", "proj") and plan.traced
    says = f"proj (DelayedScaling; the config: high precision, {reference.kept['proj']})"
    assert plan.kept_as_converted == (says,)
    assert isinstance(once.proj.einsum_op, fp8jax.Fp8NnxEinsum)  # the trace used a copy
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=re.escape(says)):
        again = fp8jax.fp8_linear_layers(once, example=example)
    assert_same_state(again.proj.einsum_op, once.proj.einsum_op.value())


def test_stacked_layers_under_nnx_scan_match_separate_layers():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return OneLayerSquare(rngs)

            self.layers = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return layer(x)

            return body(x, self.layers)

    class OneLayerSquare(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.fc(x))

    stack = fp8jax.fp8_linear_layers(Stack(nnx.Rngs(0)), config())
    assert stack.layers.fc.dot_general.state.input.amax_history.get_value().shape == (3, 1024)
    separate = []
    for i in range(3):
        one = OneLayerSquare(nnx.Rngs(0))
        one.fc.kernel.set_value(stack.layers.fc.kernel.get_value()[i])
        one.fc.bias.set_value(stack.layers.fc.bias.get_value()[i])
        separate.append(fp8jax.fp8_linear_layers(one, config()))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((8, 32)), jnp.float32)
    for _ in range(2):
        _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x)))(stack)
        fp8jax.nnx_update_fp8_state(stack, grads)
        h = x
        for one in separate:
            _, g = fp8jax.nnx_value_and_grad(lambda m, h=h: jnp.sum(m(h)))(one)
            h = one(h)  # with the state the stack's forward used
            fp8jax.nnx_update_fp8_state(one, g)
        # The per-layer states equal those of the separate layers (forward roles; the output
        # gradients differ: the stack's last layer alone receives the loss's gradient).
        stacked = stack.layers.fc.dot_general.value()
        for i, one in enumerate(separate):
            alone = one.fc.dot_general.value()
            for role in ("input", "kernel"):
                np.testing.assert_array_equal(
                    getattr(stacked, role).amax_history[i], getattr(alone, role).amax_history
                )
                np.testing.assert_array_equal(
                    getattr(stacked, role).scale[i], getattr(alone, role).scale
                )


def test_telemetry_of_an_nnx_model():
    model = fp8jax.fp8_linear_layers(NnxNet((64, 32, 32), nnx.Rngs(0)), config(telemetry=True))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((32, 64)), jnp.float32)

    def loss_and_output(m, x, y):
        out = m(x)
        return jnp.mean((out - y) ** 2), out

    step = fp8jax.nnx_train_step(loss_and_output, has_aux=True)
    loss, out = step(model, optimizer, x, jnp.zeros((32, 32)))
    assert out.shape == (32, 32) and loss.shape == ()
    stats = fp8jax.telemetry(model)
    assert set(stats) == {"fc1", "fc2"}
    assert float(stats["fc1"].input.amax) == float(jnp.abs(x).max())
    assert 0.0 <= float(stats["fc1"].input.underflow) <= 1.0
    text = fp8jax.report(model, quiet=True)
    assert "fc1" in text and "output_grad" in text


def test_telemetry_of_an_nnx_model_equals_that_of_the_equinox_model():
    net = NnxNet((64, 32, 32), nnx.Rngs(0))
    # Scale 1.0 on the first step (no warm start), so that a large input saturates.
    cold = config(fp8jax.DelayedScaling(warm_start=False), telemetry=True)
    ours = fp8jax.fp8_linear_layers(net, cold)
    optimizer = nnx.Optimizer(ours, optax.adam(1e-2), wrt=nnx.Param)
    theirs = fp8jax.fp8_linear_layers(eqx_net(net), cold)
    tx = optax.adam(1e-2)
    _, trainable = fp8jax.partition_for_grad_overwrite(theirs)
    opt_state = tx.init(eqx.filter(trainable, eqx.is_inexact_array))
    rng = np.random.default_rng(11)
    # Large enough that E4M3 saturates at scale 1.0: the statistics are not 0.
    x = jnp.asarray(rng.standard_normal((32, 64)) * 300, jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    fp8jax.nnx_train_step(mse)(ours, optimizer, x, y)
    theirs, _, _ = eqx.filter_jit(make_train_step(mse, tx))(theirs, opt_state, x, y)

    stats, expected = fp8jax.telemetry(ours), fp8jax.telemetry(theirs)
    assert list(stats) == list(expected) == ["fc1", "fc2"]
    assert jax.tree.structure(stats) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(expected), strict=True):
        assert type(a) is type(b)  # arrays, not the Fp8State variables holding them
        np.testing.assert_array_equal(a, b)
    assert float(stats["fc1"].input.saturated) > 0
    assert fp8jax.report(ours, quiet=True) == fp8jax.report(theirs, quiet=True)
    # Traceable, as for Equinox: inside a jitted function it reads the traced state.
    traced = nnx.jit(fp8jax.telemetry)(ours)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(stats), strict=True):
        np.testing.assert_array_equal(a, b)


def test_telemetry_names_nnx_layers_as_equinox_layers():
    # A layer with no path is named by its position, as in Equinox (not 'dot_general.state').
    linear = fp8jax.fp8_linear_layers(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), config())
    eqx_linear = fp8jax.fp8_linear_layers(eqx.nn.Linear(8, 4, key=jax.random.key(0)), config())
    assert list(fp8jax.telemetry(linear)) == list(fp8jax.telemetry(eqx_linear)) == ["dot_general"]
    # A shared layer is one layer, under the name conversion gave it.
    model = OneLayer(nnx.Rngs(0))
    model.again = model.fc
    converted = fp8jax.fp8_linear_layers(model, config())
    assert list(fp8jax.telemetry(converted)) == ["again"]
    # NNX gradients hold the new state but not the recipe: the model is what to pass.
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 32)))))(converted)
    with pytest.raises(ValueError, match=r"holds fp8jax.Fp8State.*nnx_update_fp8_state"):
        fp8jax.telemetry(grads)


def test_out_sharding_is_honoured():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    layer = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config())
    with jax.set_mesh(mesh):
        x = jax.device_put(
            jnp.ones((16, 32)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        )
        y = nnx.jit(lambda m, x: m.fc(x, out_sharding=jax.sharding.PartitionSpec()))(layer, x)
    assert y.sharding.spec == jax.sharding.PartitionSpec(None, None)


# --- nnx.Einsum -------------------------------------------------------------------------------


class Projection(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Einsum("btd,dhk->bhtk", (32, 2, 16), (2, 16), rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


@pytest.mark.parametrize("name", ["delayed", "blockwise", "residual error feedback"])
def test_einsum_matches_the_equivalent_linear_bit_for_bit(name):
    einsum = Projection(nnx.Rngs(0))
    kernel = einsum.proj.kernel.get_value()  # (d, h, k): as a Linear's kernel, (d, h * k)
    linear = _Wrapped(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
    linear.fc.kernel.set_value(kernel.reshape(32, 32))
    linear.fc.bias.set_value(einsum.proj.bias.get_value().reshape(32))
    einsum = fp8jax.fp8_linear_layers(einsum, config(RECIPES[name]))
    linear = fp8jax.fp8_linear_layers(linear, config(RECIPES[name]))
    assert isinstance(einsum.proj.einsum_op, fp8jax.Fp8NnxEinsum)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((2, 2, 16, 16)), jnp.float32)
    out, grads, grad_x = nnx_forward_and_grads(einsum, x, c)
    c_flat = jnp.transpose(c, (0, 2, 1, 3)).reshape(2, 16, 32)
    out_l, grads_l, grad_x_l = nnx_forward_and_grads(linear, x, c_flat)
    np.testing.assert_array_equal(out, jnp.transpose(out_l.reshape(2, 16, 2, 16), (0, 2, 1, 3)))
    np.testing.assert_array_equal(grad_x, grad_x_l)
    np.testing.assert_array_equal(
        grads["proj"]["kernel"].get_value().reshape(32, 32), grads_l["fc"]["kernel"].get_value()
    )
    fp8jax.nnx_update_fp8_state(einsum, grads)
    fp8jax.nnx_update_fp8_state(linear, grads_l)
    for a, b in zip(
        jax.tree.leaves(einsum.proj.einsum_op.value()),
        jax.tree.leaves(linear.fc.dot_general.value()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_an_excluded_layer_with_its_own_gemm_op_is_not_warned_of():
    """The warning names the layers kept for their own GEMM op, not one kept for another
    reason (excluded by name), which giving it NNX's default would not convert."""

    class Custom(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(8, 8, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                                 rngs=rngs)  # fmt: skip
            self.other = nnx.Linear(8, 8, rngs=rngs)

    cfg = fp8jax.Fp8Config(exclude="fc", keep=())
    assert fp8jax.conversion_plan(Custom(nnx.Rngs(0)), cfg).kept["fc"].startswith("excluded")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8 = fp8jax.fp8_linear_layers(Custom(nnx.Rngs(0)), cfg)
    assert isinstance(fp8.other.dot_general, fp8jax.Fp8NnxDotGeneral)


def test_an_einsums_preferred_element_type_reaches_its_fp8_gemm():
    """nnx.Einsum(preferred_element_type=bfloat16) hands it to its einsum_op: converted, its
    output is bfloat16 as jnp.einsum's is unconverted, not the float32 of a dropped one."""
    layer = nnx.Einsum("td,dk->tk", (32, 16), preferred_element_type=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.ones((4, 32), jnp.float32)
    assert _Wrapped(layer)(x).dtype == jnp.bfloat16  # Flax's own, the reference
    converted = fp8jax.fp8_linear_layers(_Wrapped(layer), config())
    assert isinstance(converted.fc.einsum_op, fp8jax.Fp8NnxEinsum)
    assert converted(x).dtype == jnp.bfloat16


class _Wrapped(nnx.Module):
    def __init__(self, linear):
        self.fc = linear

    def __call__(self, x):
        return self.fc(x)


@pytest.mark.parametrize("name", ["delayed", "blockwise", "residual error feedback"])
@pytest.mark.parametrize("contract", ["one axis", "two axes"])
def test_linear_general_matches_the_equivalent_linear_bit_for_bit(name, contract):
    # LinearGeneral contracting (2, 16) into 16 features, or 32 into (2, 8): its kernel as a
    # Linear's (in, out) matrix is a reshape of it. Not square: error feedback's residual is
    # of the kernel's (out, in) shape, (16, 32), which its transpose would not be.
    if contract == "two axes":
        general = nnx.LinearGeneral((2, 16), 16, axis=(-2, -1), rngs=nnx.Rngs(0))
        x = jnp.asarray(np.random.default_rng(9).standard_normal((4, 8, 2, 16)), jnp.float32)
        flat_x, c_shape = x.reshape(4, 8, 32), (4, 8, 16)
    else:
        general = nnx.LinearGeneral(32, (2, 8), rngs=nnx.Rngs(0))
        x = jnp.asarray(np.random.default_rng(9).standard_normal((4, 8, 32)), jnp.float32)
        flat_x, c_shape = x, (4, 8, 2, 8)
    general = _Wrapped(general)
    linear = _Wrapped(nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
    linear.fc.kernel.set_value(general.fc.kernel.get_value().reshape(32, 16))
    linear.fc.bias.set_value(general.fc.bias.get_value().reshape(16))
    general = fp8jax.fp8_linear_layers(general, config(RECIPES[name]))
    linear = fp8jax.fp8_linear_layers(linear, config(RECIPES[name]))
    assert isinstance(general.fc.dot_general, fp8jax.Fp8NnxDotGeneral)
    c = jnp.asarray(np.random.default_rng(10).standard_normal(c_shape), jnp.float32)
    out, grads, grad_x = nnx_forward_and_grads(general, x, c)
    out_l, grads_l, grad_x_l = nnx_forward_and_grads(linear, flat_x, c.reshape(4, 8, 16))
    np.testing.assert_array_equal(out.reshape(4, 8, 16), out_l)
    np.testing.assert_array_equal(grad_x.reshape(flat_x.shape), grad_x_l)
    np.testing.assert_array_equal(
        grads["fc"]["kernel"].get_value().reshape(32, 16), grads_l["fc"]["kernel"].get_value()
    )
    fp8jax.nnx_update_fp8_state(general, grads)
    fp8jax.nnx_update_fp8_state(linear, grads_l)
    for a, b in zip(
        jax.tree.leaves(general.fc.dot_general.value()),
        jax.tree.leaves(linear.fc.dot_general.value()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=32, qkv_features=32, decode=False, rngs=rngs
        )

    def __call__(self, x):
        return self.attn(x)


def test_multi_head_attention_projections_train_in_fp8():
    model = fp8jax.fp8_linear_layers(Attention(nnx.Rngs(0)), config())
    assert list(fp8jax.telemetry(model)) == ["attn.key", "attn.out", "attn.query", "attn.value"]
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((4, 8, 32)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 8, 32)), jnp.float32)
    # FP8 within FP8's error of the same attention in float32, and not equal to it.
    reference = Attention(nnx.Rngs(0))(x)
    out = nnx.jit(lambda m, x: m(x))(model, x)
    assert 0 < float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)) < 0.1
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(mse)
    losses = [float(step(model, optimizer, x, y)) for _ in range(5)]
    assert losses[-1] < losses[0]
    for layer in fp8jax.telemetry(model).values():
        assert float(layer.input.amax) > 0 and float(layer.output_grad.amax) > 0


@pytest.mark.parametrize("kind", ["Linear", "LinearGeneral", "Einsum", "dot_general_cls"])
def test_a_layer_with_its_own_gemm_op_keeps_it_and_is_named(kind):
    """A layer built with its own `dot_general` (or `einsum_op`, or a LinearGeneral's
    `dot_general_cls`: a quantization library's, a wrapper) stays as it is, in high
    precision, named with why in the plan and a warning saying how to convert it, as a
    Haliax Linear with its own does (it raised); its op still runs. Given NNX's default GEMM
    as the warning says, it converts."""

    def own(*args, **kwargs):  # the user's GEMM: the default one, its output doubled
        op = jnp.einsum if kind == "Einsum" else jax.lax.dot_general
        return 2 * op(*args, **kwargs)

    class Doubled:  # a dot_general_cls: NNX builds one and calls it
        def __call__(self, *args, **kwargs):
            return own(*args, **kwargs)

    class Custom(nnx.Module):
        def __init__(self, rngs):
            if kind == "Einsum":
                self.fc = nnx.Einsum("bd,df->bf", (8, 8), einsum_op=own, rngs=rngs)
            elif kind == "dot_general_cls":
                self.fc = nnx.LinearGeneral(8, 8, dot_general_cls=Doubled, rngs=rngs)
            else:
                self.fc = getattr(nnx, kind)(8, 8, dot_general=own, rngs=rngs)
            self.other = nnx.Linear(8, 8, rngs=rngs)

    attr = {"Einsum": "einsum_op", "dot_general_cls": "dot_general_cls"}.get(kind, "dot_general")
    name = "Doubled" if kind == "dot_general_cls" else "own"
    article = "an" if attr == "einsum_op" else "a"
    why = f"it has {article} {attr} of its own ({name}), which FP8's would replace"
    model = Custom(nnx.Rngs(0))
    assert fp8jax.conversion_plan(model, config()).kept == {"fc": why}
    with pytest.warns(
        fp8jax.Fp8ConversionWarning,
        match=r"1 NNX layer\(s\) with a GEMM op of their own keep it, in high precision, not "
        r"FP8: fc\. To convert one, give it NNX's default first: .*dot_general = "
        r"jax\.lax\.dot_general",
    ):
        fp8 = fp8jax.fp8_linear_layers(model, config())
    assert getattr(fp8.fc, attr) is getattr(model.fc, attr)
    assert isinstance(fp8.other.dot_general, fp8jax.Fp8NnxDotGeneral)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    kernel, bias = model.fc.kernel.get_value(), model.fc.bias
    bias = 0 if bias is None else bias.get_value()
    expected = 2 * (np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)) + bias
    np.testing.assert_allclose(fp8.fc(x), expected, rtol=1e-5, atol=1e-5)
    # What the warning says converts it.
    if kind == "dot_general_cls":
        model.fc.dot_general_cls = None
    else:
        setattr(model.fc, attr, jnp.einsum if kind == "Einsum" else jax.lax.dot_general)
    assert fp8jax.conversion_plan(model, config()).kept == {}
    converted = fp8jax.fp8_linear_layers(model, config())
    op = converted.fc.einsum_op if kind == "Einsum" else converted.fc.dot_general
    assert isinstance(op, fp8jax.Fp8NnxEinsum if kind == "Einsum" else fp8jax.Fp8NnxDotGeneral)


def test_einsum_with_batch_and_ellipsis_axes_is_exact_on_representable_values():
    class Experts(nnx.Module):
        def __init__(self, rngs):
            self.experts = nnx.Einsum("e...d,edf->e...f", (4, 32, 8), rngs=rngs)

        def __call__(self, x):
            return self.experts(x)

    model = fp8jax.fp8_linear_layers(Experts(nnx.Rngs(0)), config("current"))
    rng = np.random.default_rng(9)
    kernel = representable(rng, (4, 32, 8))
    model.experts.kernel.set_value(jnp.asarray(kernel))
    x = representable(rng, (4, 3, 5, 32))
    # Power-of-two current scales quantize FP8-representable values exactly, and their small
    # dot products are exact in float32.
    expected = np.einsum("eabd,edf->eabf", x, kernel)
    np.testing.assert_array_equal(model(jnp.asarray(x)), expected)


def test_einsum_dimension_numbers():
    dims, perm = einsum_dimension_numbers("btd,dhk->bhtk", 3, 3)
    assert dims == (((2,), (0,)), ((), ()))
    assert perm == (0, 2, 1, 3)  # (b, t, h, k) -> (b, h, t, k)
    dims, perm = einsum_dimension_numbers("e...d,edf->e...f", 4, 3)
    assert dims == (((3,), (1,)), ((0,), (0,)))
    assert perm == (0, 1, 2, 3)
    # An input with fewer axes than its named ones ('...' standing for -1 axes) is said so.
    with pytest.raises(ValueError, match=r"does not fit an input of 2 axes"):
        einsum_dimension_numbers("abc...,cd->ab...d", 2, 2)
    with pytest.raises(ValueError, match=r"output 'acd' names an axis of neither operand"):
        einsum_dimension_numbers("ab,bc->acd", 2, 2)


# --- the deviceless H100 compile --------------------------------------------------------------


class Mixed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(64, 128, rngs=rngs)
        self.proj = nnx.Einsum("bd,hdk->bhk", (2, 128, 32), rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        h = self.proj(jax.nn.relu(self.fc1(x)))
        return self.head(h.reshape(h.shape[0], -1))


def gemm_counts(report: fp8jax.Inspection) -> dict[str, dict[str, int]]:
    return {
        layer: {role: len(gemms) for role, gemms in roles.items()}
        for layer, roles in report.layers("cublas").items()
    }


def test_an_nnx_jit_step_runs_every_targeted_gemm_in_fp8_on_h100():
    h100_topology()
    model = fp8jax.fp8_linear_layers(Mixed(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = fp8jax.nnx_value_and_grad(mse)(model, x, y)
        fp8jax.nnx_update_fp8_state(model, grads)
        optimizer.update(model, grads)
        return loss

    # The step updates model and optimizer in place; inspect compiles it with their new state
    # as outputs, so that the backward pass and the update are not compiled away.
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    report = fp8jax.assert_all_fp8(train_step, model, optimizer, x, y)
    # The input is not differentiated, so fc1 has no dgrad; the head stays high precision.
    assert gemm_counts(report) == {
        "fc1": {"fwd": 1, "wgrad": 1},
        "proj": {"fwd": 1, "dgrad": 1, "wgrad": 1},
    }
    others = [g for g in report.gemms["cublas"] if g.layer is None]
    assert len(others) == 3 and not any(g.fp8_operands for g in others)
    # Nothing ran: the objects passed are as they were.
    assert int(optimizer.step.get_value()) == 0
    assert float(model.fc1.dot_general.value().input.amax_history[0]) == 0.0


def test_inspect_lowers_nnx_objects_as_state_in_and_out():
    # What fp8jax.inspect compiles for NNX arguments, run here: objects anywhere among the
    # arguments (keywords and containers too) go in as state, and their new state comes out.
    layer = OneLayer(nnx.Rngs(0))
    counter = nnx.Variable(jnp.zeros(()))
    layer.counter = counter  # shared by two arguments: one variable, updated once

    def step(layer, x, *, extra):
        extra["counter"][...] += 1.0
        layer.fc.kernel[...] *= 2.0
        return jnp.sum(layer(x))

    kernel = layer.fc.kernel.get_value()
    pure, args, kwargs = deviceless.split_graph_nodes(
        step, (layer, jnp.ones((1, 32))), {"extra": {"counter": counter}}
    )
    loss, state = jax.jit(pure)(*args, **kwargs)
    np.testing.assert_allclose(loss, jnp.sum(2.0 * kernel), rtol=1e-6)  # the doubled kernel
    np.testing.assert_array_equal(state[0]["fc"]["kernel"].get_value(), 2.0 * kernel)
    # The shared variable is in the state once, under its first path.
    assert float(state[0]["counter"].get_value()) == 1.0
    assert [p for p, _ in nnx.to_flat_state(state) if "counter" in p] == [(0, "counter")]
    # The objects passed are left as they were.
    np.testing.assert_array_equal(layer.fc.kernel.get_value(), kernel)
    assert float(counter.get_value()) == 0.0
    # Without NNX objects, the function is lowered as it is.
    assert deviceless.split_graph_nodes(mse, (1, 2), {}) == (mse, (1, 2), {})


def test_nnx_train_step_compiles_the_gemms_of_the_equinox_step_on_h100():
    h100_topology()
    net = NnxNet((64, 32, 32), nnx.Rngs(0))

    def build():
        model = fp8jax.fp8_linear_layers(net, config())
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    # Only shapes matter: the model and the optimizer may be abstract, as for a model too
    # large to build on this machine.
    ours, optimizer = nnx.eval_shape(build)
    assert isinstance(ours.fc1.kernel.get_value(), jax.ShapeDtypeStruct)
    theirs = fp8jax.fp8_linear_layers(eqx_net(net), config())
    tx = optax.adam(1e-3)
    _, trainable = fp8jax.partition_for_grad_overwrite(theirs)
    opt_state = tx.init(eqx.filter(trainable, eqx.is_inexact_array))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    modes = ("cublas",)
    step = fp8jax.nnx_train_step(mse)
    report = fp8jax.assert_all_fp8(fp8jax.inspect(step, ours, optimizer, x, y, modes=modes))
    expected = fp8jax.inspect(make_train_step(mse, tx), theirs, opt_state, x, y, modes=modes)
    assert gemm_counts(report) == gemm_counts(expected)
    assert gemm_counts(report) == {
        "fc1": {"fwd": 1, "wgrad": 1},
        "fc2": {"fwd": 1, "dgrad": 1, "wgrad": 1},
    }
    assert report.count("cublas") == expected.count("cublas") == (5, 5)


# --- errors and packaging ---------------------------------------------------------------------


def test_bad_input_errors():
    model = Model(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"target 'nope' matches no Linear layer.*'blocks.0.up'"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["nope"]))
    with pytest.raises(ValueError, match=r"'norm' names 'blocks.0.norm', a LayerNorm, not a"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["norm"]))
    with pytest.raises(ValueError, match=r"matches only modules that are not Linear.*Block"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r"blocks\.0"))
    with pytest.raises(ValueError, match=r"target 'head' selects only 'head', which exclude="):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["head"]))
    with pytest.raises(ValueError, match=r"recipes pattern 'nope' matches no converted layer"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipes={"nope": "current"}))
    with pytest.raises(ValueError, match=r"found no Linear layer.*flax.nnx.Linear"):
        fp8jax.fp8_linear_layers(nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"config=.*should be an fp8jax.Fp8Config"):
        fp8jax.fp8_linear_layers(model, {"recipe": "current"})
    with pytest.raises(ValueError, match=r"stacked=\(0,\): should be a tuple of ints >= 1"):
        fp8jax.Fp8NnxDotGeneral(stacked=(0,))

    converted = fp8jax.fp8_linear_layers(model)
    x = jnp.ones((2, 32))
    with pytest.raises(
        ValueError,
        match=r"'blocks.0.up' is differentiated, but its FP8 state.*DiffState.* Its scales and "
        r"amax history would stay as they are forever",
    ):
        nnx.grad(lambda m: jnp.sum(m(x)))(converted)
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x)))(converted)
    params_only = nnx.state(grads, nnx.Param)
    with pytest.raises(ValueError, match=r"hold no Fp8State for the FP8 layer at 'blocks.0.down'"):
        fp8jax.nnx_update_fp8_state(converted, params_only)
    with pytest.raises(ValueError, match=r"has no FP8 layer; convert it with"):
        fp8jax.nnx_update_fp8_state(model, params_only)
    with pytest.raises(TypeError, match=r"fun=3 is not callable"):
        fp8jax.nnx_value_and_grad(3)
    with pytest.raises(TypeError, match=r"has_aux='yes' should be True or False"):
        fp8jax.nnx_train_step(mse, has_aux="yes")

    experts = nnx.Einsum("ebd,edf->ebf", (4, 32, 8), rngs=nnx.Rngs(0))
    # The root layer named as plans print its path (it was "nnx.Einsum ''").
    with pytest.raises(ValueError, match=r"nnx.Einsum \(root\) .*kernel \(4, 32, 8\).*has batch"):
        fp8jax.fp8_linear_layers(experts, config(RECIPES["residual error feedback"]))
    # A LinearGeneral with batch axes: refused by its name, as the Einsum (it said only "pass
    # kernel_shape=(out_features, in_features) to Fp8DotGeneral", naming no layer).
    batched = _Wrapped(nnx.LinearGeneral(8, 4, batch_axis={0: 3}, rngs=nnx.Rngs(0)))
    with pytest.raises(
        ValueError,
        match=r"nnx.LinearGeneral 'fc' \(batch_axis=\{0: 3\}, kernel \(3, 8, 4\)\).*has batch "
        r"axes.*another recipe \(Fp8Config recipes\), or exclude it",
    ):
        fp8jax.fp8_linear_layers(batched, config(RECIPES["residual error feedback"]))

    einsum = fp8jax.Fp8NnxEinsum()
    for subscripts, kernel, message in [
        ("bd,df", (4, 3), r"explicit two-operand equation"),
        ("bd,d...->b", (4, 3), r"kernel's subscripts 'd...' may not hold"),
        ("bd,dfg->bf", (4, 3, 5), r"sums axis 'g' of one operand only"),
        ("bdd,df->bf", (4, 3), r"gives the input 3 axes \('bdd'\), but it has 2"),
        ("bd,dd->bd", (4, 4), r"repeats an axis of the kernel"),
        ("bd,df->bfz", (4, 3), r"output 'bfz' names an axis of neither operand"),
    ]:
        with pytest.raises(ValueError, match=message):
            einsum(subscripts, jnp.ones((2, 4)), jnp.ones(kernel))


def test_a_converted_model_deep_copies_and_its_graphdef_pickles():
    """`copy.deepcopy` of a converted model raised "'_Missing' object is not subscriptable":
    NNX copies the graphdef, which holds each FP8 layer's Equinox treedef, whose `MISSING`
    sentinel a copy made another object. The copy now holds the model's values, trains as
    the model does, apart from it; a pickled graphdef merges again."""
    import copy
    import pickle

    model = fp8jax.fp8_linear_layers(Model(nnx.Rngs(0)), config(telemetry=True))
    step = fp8jax.nnx_train_step(mse)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    step(model, optimizer, x, y)
    twin, twin_optimizer = copy.deepcopy((model, optimizer))
    assert type(twin.blocks[0].up.dot_general) is fp8jax.Fp8NnxDotGeneral
    assert nnx.graphdef(twin) == nnx.graphdef(model)
    before = jax.tree.map(np.asarray, nnx.state(model))
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.state(twin), before))
    np.testing.assert_array_equal(step(twin, twin_optimizer, x, y), step(model, optimizer, x, y))
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.state(twin), nnx.state(model)))
    step(twin, twin_optimizer, x, y)  # the model is apart from its copy
    assert not jax.tree.all(jax.tree.map(np.array_equal, nnx.state(twin), nnx.state(model)))
    merged = nnx.merge(pickle.loads(pickle.dumps(nnx.graphdef(model))), nnx.state(model))
    np.testing.assert_array_equal(merged(x), model(x))


def test_a_layer_whose_kernel_is_not_floating_stays_in_high_precision_as_in_equinox():
    """An nnx.Linear with an int8 kernel (quantized already) was converted, its kernel's
    values rounded to FP8's (117 has no 3-bit mantissa), and a complex one converted and
    raised at its call; like the Equinox path, both stay in high precision, named why."""

    class Mixed(nnx.Module):
        def __init__(self, rngs):
            full = nnx.initializers.constant(117)
            self.ints = nnx.Linear(
                8, 8, param_dtype=jnp.int8, use_bias=False, kernel_init=full, rngs=rngs
            )
            self.waves = nnx.Linear(8, 8, param_dtype=jnp.complex64, use_bias=False, rngs=rngs)
            self.fc = nnx.Linear(8, 8, rngs=rngs)

    model = Mixed(nnx.Rngs(0))
    plan = fp8jax.conversion_plan(model, config())
    assert plan.converted == ("fc",)
    assert plan.kept == {
        "ints": "its kernel is int8, not a floating dtype FP8 could round",
        "waves": "its kernel is complex64, not a floating dtype FP8 could round",
    }
    eqx_plan = fp8jax.conversion_plan(
        eqx.nn.Linear(8, 8, key=jax.random.key(0), dtype=jnp.complex64), config()
    )
    assert eqx_plan.kept == {
        "(root)": "its weight is complex64, not a floating dtype FP8 could round"
    }
    converted = fp8jax.fp8_linear_layers(model, config())
    assert converted.ints.dot_general is jax.lax.dot_general
    assert converted.waves.dot_general is jax.lax.dot_general
    x = np.arange(16, dtype=np.float32).reshape(2, 8) / 4
    np.testing.assert_array_equal(converted.ints(x), x.astype(np.float64) @ np.full((8, 8), 117.0))
    waves = np.asarray(model.waves.kernel.get_value(), np.complex128)
    np.testing.assert_allclose(converted.waves(x), x @ waves, rtol=1e-5)


@pytest.mark.parametrize("holder", ["dict", "list", "nnx.state", "nnx.split"])
def test_nnx_objects_outside_a_module_are_refused_naming_the_container(holder):
    """A dict or list of NNX modules, or a model's state split off, went to the Equinox path,
    which said it "found no Linear layer in the tree" of a tree holding nnx.Linears; it is
    refused for what it is, naming the NNX object found and what converts."""
    model = Model(nnx.Rngs(0))
    tree, kind, where = {
        "dict": ({"a": model}, "dict", r"Model at \"\['a'\]\""),
        "list": ([model], "list", r"Model at '\[0\]'"),
        "nnx.state": (nnx.state(model), "State", r"Param at "),
        "nnx.split": (nnx.split(model), "tuple", r"GraphDef at '\[0\]'"),
    }[holder]
    message = rf"model is a {kind} holding Flax NNX objects \(its {where}.*not an nnx.Module"
    with pytest.raises(TypeError, match=message + r".*nnx.List, an nnx.Dict"):
        fp8jax.fp8_linear_layers(tree)
    with pytest.raises(TypeError, match=message):
        fp8jax.conversion_plan(tree)
    # What the message says converts.
    converted = fp8jax.fp8_linear_layers(nnx.Dict({"a": model}))
    assert isinstance(converted["a"].blocks[0].up.dot_general, fp8jax.Fp8NnxDotGeneral)


def test_einsum_errors_name_what_is_wrong_with_the_subscripts():
    """An equation with a non-letter axis, two '...', an output '...' the input lacks, or the
    input's '...' summed away was refused with a message about something else: 'gives the input 2
    axes ('b1'), but it has 2', 'repeats an axis of the output ('...bf')', 'sums axis 'a''
    (a letter the equation does not hold). Each now names its own fault."""
    einsum = fp8jax.Fp8NnxEinsum()
    for subscripts, x_shape, message in [
        ("b1,1f->bf", (2, 4), r"axis '1', which is not a letter"),
        ("...d...,df->f", (2, 3, 4), r"input '\.\.\.d\.\.\.' holds '\.\.\.' twice"),
        ("bd,df->...bf", (2, 4), r"output '\.\.\.bf' holds '\.\.\.' but the input 'bd' does not"),
        ("...d,df->f", (2, 3, 4), r"sums the axes of the input's '\.\.\.'"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            einsum(subscripts, jnp.ones(x_shape), jnp.ones((4, 5)))
        assert "'a'" not in str(raised.value)
        assert "but it has 2." not in str(raised.value)


@pytest.mark.parametrize(
    "subscripts, x_shape, k_shape, broadcast",
    [
        ("bij,bjk->bik", (1, 3, 4), (2, 4, 5), ((2, 3, 4), (2, 4, 5))),  # input's batch axis
        ("bij,bjk->bik", (2, 3, 4), (1, 4, 5), ((2, 3, 4), (2, 4, 5))),  # kernel's
        ("b d,d f->b f", (2, 1), (4, 5), ((2, 4), (4, 5))),  # a contracted axis
        ("...d,df->...f", (3, 2, 4), (8, 5), None),  # sizes that differ
    ],
)
def test_einsum_axis_sizes_that_differ_are_refused_naming_the_equation(
    subscripts, x_shape, k_shape, broadcast
):
    """jnp.einsum broadcasts an axis of size 1 in one operand; the FP8 einsum, a dot_general,
    raised lax's 'Mismatched shapes for dot_general' naming neither the equation nor the axis.
    It now names both and what it accepts; broadcast as it advises, the operands give
    jnp.einsum's result (float64 numpy's, on values FP8 represents exactly)."""
    rng = np.random.default_rng(3)
    x, k = representable(rng, x_shape), representable(rng, k_shape)
    einsum = fp8jax.Fp8NnxEinsum(fp8jax.CurrentScaling())
    message = r"subscripts='.*' gives axis '[bd]' size \d+ in the input .* but \d+ in the kernel"
    with pytest.raises(ValueError, match=message) as raised:
        einsum(subscripts, jnp.asarray(x), jnp.asarray(k))
    assert "one size in both operands" in str(raised.value)
    if broadcast is not None:
        expected = np.einsum(subscripts, x.astype(np.float64), k.astype(np.float64))
        x_full, k_full = (jnp.broadcast_to(a, s) for a, s in zip((x, k), broadcast, strict=True))
        np.testing.assert_array_equal(einsum(subscripts, x_full, k_full), expected)


@pytest.mark.parametrize(
    "subscripts, x_shape, k_shape",
    [(",df->df", (), (4, 5)), ("...,df->...df", (), (4, 5)), ("bd,->bd", (2, 4), ())],
)
def test_einsum_with_an_operand_of_no_axes_computes_jnp_einsum(subscripts, x_shape, k_shape):
    """An operand with no axes (a scalar: '' or a '...' of none), which jnp.einsum takes, was
    refused with the contradiction "gives the input 0 axes (''), but it has 0"; it now gives
    jnp.einsum's result (float64 numpy's, on values FP8 represents exactly)."""
    rng = np.random.default_rng(5)
    x, k = representable(rng, x_shape), representable(rng, k_shape)
    einsum = fp8jax.Fp8NnxEinsum(fp8jax.CurrentScaling())
    expected = np.einsum(subscripts, x.astype(np.float64), k.astype(np.float64))
    np.testing.assert_array_equal(einsum(subscripts, jnp.asarray(x), jnp.asarray(k)), expected)


@pytest.mark.parametrize(
    "subscripts, kernel, message",
    [
        ("bd,dd->bd", (16, 16), r"repeats an axis of the kernel"),
        ("bd,df->bd", (16, 8), r"sums axis 'f' of one operand only"),
    ],
)
def test_einsum_the_fp8_gemm_cannot_run_is_refused_at_conversion(subscripts, kernel, message):
    """An nnx.Einsum whose equation the FP8 einsum cannot run is refused by name when the model
    is converted (it was converted, announced as FP8, and raised only at its first call, with
    no name), and, excluded, runs as jnp.einsum does."""

    class Model(nnx.Module):
        def __init__(self):
            self.e = nnx.Einsum(subscripts, kernel, rngs=nnx.Rngs(0))
            self.fc = nnx.Linear(16, 16, rngs=nnx.Rngs(1))

    with pytest.raises(ValueError, match=rf"nnx.Einsum 'e' .*{message}.*Exclude it"):
        fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config(exclude=None))
    kept = fp8jax.fp8_linear_layers(Model(), fp8jax.Fp8Config(exclude="e"))
    x = jax.random.normal(jax.random.key(0), (4, 16))
    reference = nnx.Einsum(subscripts, kernel, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(kept.e(x), reference(x))


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "nnx.md"


def test_the_docs_example_runs(capsys):
    """docs/nnx.md's Python blocks, run in order in one namespace, as a reader would: the page
    cannot rot. The blocks keep their line numbers in docs/nnx.md for tracebacks."""
    text = DOCS.read_text()
    blocks = [
        (text.count("\n", 0, m.start(1)), m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    ]
    # convert and train, by hand, float16 by hand, plain nnx.value_and_grad, inspect
    assert len(blocks) == 5
    namespace: dict[str, Any] = {"__name__": "docs_nnx"}
    for line, block in blocks:
        exec(compile("\n" * line + block, str(DOCS), "exec"), namespace)
    model, optimizer, loss = namespace["model"], namespace["optimizer"], namespace["loss"]
    out = capsys.readouterr().out
    # The report shows the FP8 layers (the head is excluded by default), and the inspection
    # their 5 GEMMs (2 forward, 1 dgrad: the input gets none, 2 wgrad) in FP8, the head's 3 not.
    assert list(fp8jax.telemetry(model)) == ["fc1", "fc2"]
    assert out.startswith(fp8jax.report(model, quiet=True))
    assert "[cublas] 5 of 8 GEMMs run on FP8 tensor cores" in out
    assert float(loss) < 1.5  # trained: ln(10) = 2.3 at the start
    assert int(optimizer.step.get_value()) == 100
    # The hand-written step and plain nnx.value_and_grad run on real batches too.
    x = jax.random.normal(jax.random.key(1), (128, 64))
    y = x[:, :10].argmax(axis=-1)
    assert np.isfinite(float(namespace["train_step"](model, optimizer, x, y)))
    _, grads = namespace["grad_fn"](model, x, y)
    fp8jax.nnx_update_fp8_state(model, grads)
    assert int(optimizer.step.get_value()) == 101


def test_import_fp8jax_does_not_import_flax():
    code = (
        "import sys, fp8jax; assert 'flax' not in sys.modules; "
        "assert 'Fp8State' in dir(fp8jax); fp8jax.Fp8State; assert 'flax' in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr


# --- experts ------------------------------------------------------------------------------------


class Experts(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = fp8jax.NnxGroupedLinear(4, 32, 64, rngs=rngs)
        self.down = fp8jax.NnxGroupedLinear(4, 64, 32, rngs=rngs)

    def __call__(self, x, sizes):
        return self.down(jax.nn.gelu(self.up(x, sizes)), sizes)


class EqxExperts(eqx.Module):
    up: Any
    down: Any

    def __call__(self, x, sizes):
        return self.down(jax.nn.gelu(self.up(x, sizes)), sizes)


SIZES = jnp.array([8, 0, 16, 8], jnp.int32)


def test_a_stack_of_expert_layers_stays_in_high_precision_and_the_rest_converts():
    """NnxGroupedLinears built under nnx.vmap (a kernel (layers, experts, in, out)) made the
    whole conversion raise, whatever the config; they stay in high precision, the plan saying
    why, and the model's other layers convert. The stack computes as before: the float64
    product of each row with its expert's kernel."""

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return fp8jax.NnxGroupedLinear(4, 8, 8, rngs=rngs)

            self.experts = make(rngs)
            self.fc = nnx.Linear(8, 8, rngs=rngs)

    model = Stack(nnx.Rngs(0))
    plan = fp8jax.conversion_plan(model, config())
    assert plan.converted == ("fc",)
    assert "\nexperts  fp8jax.NnxGroupedLinear  high: " in str(plan)  # fp8jax's class, not NNX's
    assert plan.kept == {
        "experts": "its kernel (2, 4, 8, 8) is a stack of expert layers (nnx.vmap), which "
        "fp8jax's NNX experts do not convert: build each layer's NnxGroupedLinear apart"
    }
    converted = fp8jax.fp8_linear_layers(model, config())
    assert converted.experts.ragged_dot is model.experts.ragged_dot
    assert isinstance(converted.fc.dot_general, fp8jax.Fp8NnxDotGeneral)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 8)), jnp.float32)
    sizes = jnp.asarray([1, 2, 0, 3], jnp.int32)
    out = nnx.vmap(lambda layer, x: layer(x, sizes), in_axes=(0, None))(converted.experts, x)
    kernels = np.asarray(model.experts.kernel.get_value(), np.float64)
    expert = np.repeat(np.arange(4), np.asarray(sizes))
    rows = np.asarray(x, np.float64)[:, None, :]
    expected = np.stack([(rows @ k[expert])[:, 0] for k in kernels])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_experts_record_telemetry_when_asked():
    """`Fp8Config(telemetry=True)` reaches an NnxGroupedLinear's grouped GEMM: each expert's
    tokens, recorded by a step."""
    model = fp8jax.fp8_linear_layers(Experts(nnx.Rngs(0)), config(telemetry=True))
    x = jnp.ones((32, 32))
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x, SIZES) ** 2))(model)
    fp8jax.nnx_update_fp8_state(model, grads)
    stats = fp8jax.telemetry(model)
    np.testing.assert_array_equal(stats["up"].tokens, SIZES)
    np.testing.assert_array_equal(stats["down"].tokens, SIZES)


@pytest.mark.parametrize("native", [False, None])
def test_experts_take_the_configs_grouped_native_kernel(native):
    """`Fp8Config(grouped_native_kernel=...)` is the `native_kernel` of the converted experts'
    grouped GEMMs (as documented for every framework), not the default left in its place."""
    model = fp8jax.fp8_linear_layers(Experts(nnx.Rngs(0)), config(grouped_native_kernel=native))
    ops = (model.up.ragged_dot.value(), model.down.ragged_dot.value())
    assert tuple(op.native_kernel for op in ops) == (native, native)


def test_experts_called_twice_count_both_calls_tokens():
    """Experts run on two batches in one step got both batches' tokens (summed by hand), not
    the larger count of the two."""
    model = fp8jax.fp8_linear_layers(Experts(nnx.Rngs(0)), config(telemetry=True))
    other = jnp.array([2, 10, 4, 16], jnp.int32)
    x = jnp.ones((32, 32))
    _, grads = fp8jax.nnx_value_and_grad(
        lambda m: jnp.sum(m(x, SIZES) ** 2) + jnp.sum(m(x, other) ** 2)
    )(model)
    fp8jax.nnx_update_fp8_state(model, grads)
    stats = fp8jax.telemetry(model)
    expected = np.asarray(SIZES) + np.asarray(other)
    np.testing.assert_array_equal(stats["up"].tokens, expected)
    np.testing.assert_array_equal(stats["down"].tokens, expected)


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise"])
def test_experts_match_the_equinox_experts_bit_for_bit(name):
    model = Experts(nnx.Rngs(0))
    eqx_model = EqxExperts(
        *(
            eqx.tree_at(
                lambda g: g.weight, fp8jax.GroupedLinear(4, *k.shape[1:], key=jax.random.key(0)), k
            )
            for k in (model.up.kernel.get_value(), model.down.kernel.get_value())
        )
    )
    ours = fp8jax.fp8_linear_layers(model, config(RECIPES[name]))
    theirs = fp8jax.fp8_linear_layers(eqx_model, config(RECIPES[name]))
    assert isinstance(ours.up.ragged_dot, fp8jax.Fp8NnxRaggedDot)
    assert model.up.ragged_dot is None  # the model given is kept
    rng = np.random.default_rng(12)

    @nnx.jit
    def nnx_jitted(model, x, c):
        grads, grad_x = nnx.grad(lambda m, x: jnp.sum(m(x, SIZES) * c), argnums=(DIFF, 1))(model, x)
        return model(x, SIZES), grads, grad_x

    # Bit for bit: both programs compiled with SAME_BITS (helpers.py); nnx.jit inside.
    @functools.partial(eqx.filter_jit, compiler_options=SAME_BITS)
    def nnx_step(model, x, c):
        return nnx_jitted(model, x, c)

    @functools.partial(eqx.filter_jit, compiler_options=SAME_BITS)
    def eqx_step(model, x, c):
        grads, grad_x = eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1], SIZES) * c))((model, x))
        return model(x, SIZES), grads, grad_x

    for step in range(2):
        x = jnp.asarray(rng.standard_normal((32, 32)) * (1 + 3 * step), jnp.float32)
        c = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
        out, grads, grad_x = nnx_step(ours, x, c)
        out_e, grads_e, grad_x_e = eqx_step(theirs, x, c)
        np.testing.assert_array_equal(out, out_e)
        np.testing.assert_array_equal(grad_x, grad_x_e)
        for layer in ("up", "down"):
            np.testing.assert_array_equal(
                grads[layer]["kernel"].get_value(), getattr(grads_e, layer).weight
            )
        fp8jax.nnx_update_fp8_state(ours, grads)
        overwrites, _ = fp8jax.partition_for_grad_overwrite(grads_e)
        theirs = fp8jax.apply_updates(theirs, None, overwrites)
        for layer in ("up", "down"):
            value = getattr(ours, layer).ragged_dot.value()
            expected = getattr(theirs, layer).ragged_dot
            for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(expected), strict=True):
                np.testing.assert_array_equal(a, b)
    # A scale per expert; the expert that got no tokens kept its state.
    scale = fp8jax.telemetry(ours)["up"].kernel.scale
    assert scale.shape == (4,)


def test_experts_train_with_the_nnx_train_step():
    model = fp8jax.fp8_linear_layers(Experts(nnx.Rngs(1)), config("blockwise"))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(lambda m, x, y: jnp.mean((m(x, SIZES) - y) ** 2))
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    y = jnp.tanh(x)
    losses = [float(step(model, optimizer, x, y)) for _ in range(5)]
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"ResidualFP8 has no FP8 grouped GEMM"):
        fp8jax.fp8_linear_layers(Experts(nnx.Rngs(0)), config("residual"))
    with pytest.raises(ValueError, match=r"NnxGroupedLinear num_experts=0: should be an int"):
        fp8jax.NnxGroupedLinear(0, 4, 4, rngs=nnx.Rngs(0))


def test_fp8_layers_quantize_their_float32_masters():
    """An `nnx.Linear` computing in BF16 on float32 parameters, converted: its FP8 GEMM gets
    the master uncast (its amax recorded as is; the BF16 copy NNX's cast made has another)
    and returns BF16, and the kernel's gradient is, bit for bit, the copy's (written in BF16,
    widened to float32). A layer that sets its own `preferred_element_type`, or that has no
    `dtype`, keeps NNX's cast."""

    class Two(nnx.Module):
        def __init__(self):
            make = functools.partial(nnx.Linear, 256, 64, use_bias=False, dtype=jnp.bfloat16)
            self.masters = make(rngs=nnx.Rngs(0))
            self.copies = make(rngs=nnx.Rngs(0), preferred_element_type=jnp.bfloat16)
            self.plain = nnx.Linear(256, 64, use_bias=False, rngs=nnx.Rngs(0))

    model = fp8jax.fp8_linear_layers(Two(), config())
    assert model.masters.preferred_element_type == jnp.bfloat16
    assert model.copies.promote_dtype is nnx.Linear(1, 1, rngs=nnx.Rngs(0)).promote_dtype
    assert model.plain.preferred_element_type is None
    x = jnp.asarray(np.random.default_rng(16).standard_normal((32, 256)), jnp.bfloat16)
    c = jnp.asarray(np.random.default_rng(17).standard_normal((32, 64)), jnp.float32)

    def loss(m, x):
        return sum(jnp.sum(layer(x).astype(jnp.float32) * c) for layer in (m.masters, m.copies))

    assert model.masters(x).dtype == jnp.bfloat16
    _, grads = fp8jax.nnx_value_and_grad(loss)(model, x)
    d_masters, d_copies = (
        np.asarray(grads[n]["kernel"].get_value()) for n in ("masters", "copies")
    )
    assert d_masters.dtype == np.float32
    np.testing.assert_array_equal(d_masters, d_copies)
    kernel = np.asarray(model.masters.kernel.get_value())
    fp8jax.nnx_update_fp8_state(model, grads)
    amax = {
        n: float(getattr(model, n).dot_general.value().kernel.amax_history[0])
        for n in ("masters", "copies")
    }
    assert amax["masters"] == np.max(np.abs(kernel))
    assert amax["copies"] == np.max(np.abs(kernel.astype(jnp.bfloat16).astype(np.float32)))
    assert amax["masters"] != amax["copies"]


@pytest.mark.parametrize("kind", ["Linear", "LinearGeneral"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_bf16_layers_with_a_promote_dtype_of_their_own_convert(kind, use_bias):
    """A layer computing in BF16 with a `promote_dtype` of its own taking `(inputs, kernel,
    bias)`, as NNX documents it (it failed: it was given two), converts and computes as the
    same layer with NNX's own promotion: the same output, the master's amax recorded."""

    def promote_three(args, *, dtype=None, inexact=True):
        inputs, kernel, bias = args
        return tuple(None if a is None else jnp.asarray(a, dtype) for a in (inputs, kernel, bias))

    make = functools.partial(getattr(nnx, kind), 32, 16, use_bias=use_bias, dtype=jnp.bfloat16)
    mine = make(promote_dtype=promote_three, rngs=nnx.Rngs(0))
    ours = fp8jax.fp8_linear_layers(mine, config("current"))
    theirs = fp8jax.fp8_linear_layers(make(rngs=nnx.Rngs(0)), config("current"))
    x = jnp.asarray(np.random.default_rng(18).standard_normal((8, 32)), jnp.float32)
    out = ours(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, theirs(x))
    _, grads = fp8jax.nnx_value_and_grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32)))(ours, x)
    fp8jax.nnx_update_fp8_state(ours, grads)
    kernel = np.asarray(ours.kernel.get_value())
    assert float(ours.dot_general.value().kernel.amax_history[0]) == np.max(np.abs(kernel))


def test_the_train_step_trains_a_model_without_fp8_layers_as_flax_does():
    """A baseline (no FP8 layer: unconverted, or everything excluded) trains with the same
    step, as Flax's own step trains it."""

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    @nnx.jit
    def flax_step(model, optimizer, x):
        value, grads = nnx.value_and_grad(loss)(model, x)
        optimizer.update(model, grads)
        return value

    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 32)), jnp.float32)
    runs = []
    for step in (fp8jax.nnx_train_step(loss), flax_step):
        model = NnxNet((32, 16, 8), nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        runs.append([float(step(model, optimizer, x)) for _ in range(3)])
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)
    assert runs[0][-1] < runs[0][0]


def test_a_stack_of_einsums_built_under_vmap_matches_a_stack_of_linears():
    """An nnx.Einsum stack built under nnx.vmap and applied with nnx.scan gets one FP8 state
    per layer, as a stack of nnx.Linears does, and computes what the Linears compute (it was
    converted with one state for the stack and crashed inside nnx.scan)."""

    def stack(layer):
        class Block(nnx.Module):
            def __init__(self, rngs):
                self.fc = layer(rngs)

            def __call__(self, x):
                return jax.nn.relu(self.fc(x))

        class Stack(nnx.Module):
            def __init__(self):
                @nnx.split_rngs(splits=3)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def make(rngs):
                    return Block(rngs)

                self.blocks = make(nnx.Rngs(0))

            def __call__(self, x):
                @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
                def run(block, x):
                    return block(x)

                return run(self.blocks, x)

        return fp8jax.fp8_linear_layers(Stack())

    einsums = stack(lambda r: nnx.Einsum("bd,df->bf", (16, 16), rngs=r))
    linears = stack(lambda r: nnx.Linear(16, 16, use_bias=False, rngs=r))
    nnx.update(einsums, {"blocks": {"fc": {"kernel": linears.blocks.fc.kernel}}})
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(model, x):
        return (model(x) ** 2).mean()

    for model in (einsums, linears):
        _, grads = fp8jax.nnx_value_and_grad(loss)(model, x)
        fp8jax.nnx_update_fp8_state(model, grads)
    np.testing.assert_array_equal(einsums(x), linears(x))
    state = einsums.blocks.fc.einsum_op.state.input.amax_history.get_value()
    assert state.shape == (3, 1024)
    np.testing.assert_array_equal(
        state, linears.blocks.fc.dot_general.state.input.amax_history.get_value()
    )


def test_an_example_that_does_not_call_the_model_it_is_given_is_refused():
    """As for Equinox: an `example` calling the NNX model it closes over traced none of the
    handed model's layers, and the plan, "roles from a trace", put the head `fc2` in FP8
    silently; one returning nothing found no output either."""
    model = NnxNet((32, 32, 4), nnx.Rngs(0))
    x = jnp.ones((2, 32))
    assert fp8jax.conversion_plan(model, example=lambda m: m(x)).converted == ("fc1",)
    assert_examples_not_calling_the_model_are_refused(model, x)


class _Float16Mlp(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(64, 128, dtype=jnp.float16, rngs=rngs)
        self.fc2 = nnx.Linear(128, 128, dtype=jnp.float16, rngs=rngs)
        self.head = nnx.Linear(128, 10, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.gelu(self.fc2(jax.nn.gelu(self.fc1(x)))))


def _float16_run(rescale):
    """A float16 NNX loop of 9 steps with a dynamic loss scale that doubles every 3: per step
    and FP8 layer, (its output-gradient scale used, the step's output-gradient amax)."""
    recipe = fp8jax.DelayedScaling(history_len=8)
    model = fp8jax.fp8_linear_layers(_Float16Mlp(nnx.Rngs(0)), config(recipe))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_fn(model, x, y):
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @nnx.jit
    def step(model, optimizer, loss_scale, x, y):
        scaled = lambda m, x, y: loss_scale.scale(loss_fn(m, x, y))  # noqa: E731
        _, grads = fp8jax.nnx_value_and_grad(scaled)(model, x, y)
        params = loss_scale.unscale(nnx.filter_state(grads, nnx.Param))
        new_scale = loss_scale.adjust(fp8jax.all_finite(params))
        fp8jax.nnx_update_fp8_state(model, grads)
        optimizer.update(model, params)
        if rescale:
            ratio = new_scale.loss_scale / loss_scale.loss_scale
            fp8jax.nnx_rescale_gradient_states(model, ratio)
        states = [grads[n]["dot_general"]["state"] for n in LAYERS]
        amaxes = [state["output_grad"]["amax_history"][0] for state in states]
        return new_scale, amaxes

    loss_scale, seen = fp8jax.DynamicLossScale(2.0**8, period=3), []
    for i in range(9):
        x = jax.random.normal(jax.random.key(i), (64, 64))
        used = [float(getattr(model, n).dot_general.value().output_grad.scale) for n in LAYERS]
        loss_scale, amaxes = step(model, optimizer, loss_scale, x, x[:, :10].argmax(-1))
        seen.append(list(zip(used, map(float, amaxes), strict=True)))
    assert float(loss_scale.loss_scale) == 2.0**11
    return seen


LAYERS = ("fc1", "fc2")


def test_float16_dynamic_loss_scale_growth_saturates_no_output_gradient():
    """Delayed scaling's output-gradient history records gradients times the loss scale: at
    each growth (x2) the next step's largest gradients were twice what the scale allowed and
    saturated at E5M2's max, one step in three here, with no way to follow the loss scale
    for an NNX model (`rescale_gradient_states` refuses one). Rescaled in place, no step's
    largest gradient times its scale passes E5M2's max (from the second step: the first
    casts by its own amax)."""
    e5m2_max = float(jnp.finfo(jnp.float8_e5m2).max)
    fixed = _float16_run(rescale=True)
    assert all(scale * amax <= e5m2_max for per_step in fixed[1:] for scale, amax in per_step)
    # The check sees the saturation where nothing follows the loss scale.
    unfixed = _float16_run(rescale=False)
    assert any(scale * amax > e5m2_max for per_step in unfixed[1:] for scale, amax in per_step)


def _docs_float16_step(loss_fn):
    """docs/nnx.md's `float16_step`, its block run as written with `loss_fn` given."""
    block = next(
        b
        for b in re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M)
        if "def float16_step" in b
    )
    namespace = {"fp8jax": fp8jax, "nnx": nnx, "loss_fn": loss_fn}
    exec(compile(block, str(DOCS), "exec"), namespace)
    return namespace["float16_step"]


def test_the_docs_float16_step_skips_an_overflowed_step():
    """docs/nnx.md's float16 step (its loop, and `_float16_run`'s, updated every step): a loss
    scale of 2**40 overflows float16's gradients (65504 at most; the unscaled gradients are
    inf or NaN, checked by hand), and `optimizer.update` put them into Adam's moments for
    good. The step leaves the Params and the optimizer state bit for bit as they were, backs
    the loss scale off by its backoff (2**40 * 0.5) and counts the skip; a scale that does not
    overflow then updates them, finite."""

    def loss_fn(model, x, y):
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step = _docs_float16_step(loss_fn)
    model = fp8jax.fp8_linear_layers(_Float16Mlp(nnx.Rngs(0)), config())
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (64, 64))
    y = x[:, :10].argmax(-1)
    values = lambda: jax.tree.map(  # noqa: E731
        np.asarray, nnx.as_pure((nnx.state(model, nnx.Param), nnx.state(optimizer)))
    )
    # The overflow, by hand: 2**40 times the loss's gradients is past float16's range.
    scaled = lambda m, x, y: loss_fn(m, x, y) * 2.0**40  # noqa: E731
    _, grads = fp8jax.nnx_value_and_grad(scaled)(nnx.clone(model), x, y)
    params = jax.tree.leaves(nnx.filter_state(grads, nnx.Param))
    assert not all(np.isfinite(np.asarray(g, np.float64)).all() for g in params)

    before = values()
    loss, loss_scale = step(model, optimizer, fp8jax.DynamicLossScale(2.0**40), x, y)
    after = values()
    assert float(loss_scale.loss_scale) == 2.0**40 * 0.5
    assert int(loss_scale.skipped_steps) == 1 and int(loss_scale.counter) == 0
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(np.asarray(a, np.float64)).all()

    _, loss_scale = step(model, optimizer, fp8jax.DynamicLossScale(2.0**8), x, y)
    assert int(loss_scale.skipped_steps) == 0 and int(optimizer.step.get_value()) == 1
    moved = values()
    assert all(np.isfinite(np.asarray(a, np.float64)).all() for a in jax.tree.leaves(moved))
    assert not np.array_equal(moved[0]["fc1"]["kernel"], before[0]["fc1"]["kernel"])


def _state_and_counts(ops):
    """An FP8 state's leaves as raw bytes but telemetry's counts of rejected updates, and
    those counts by layer and role."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(ops, eqx.is_array))[0]
    rest = {
        jax.tree_util.keystr(path): np.asarray(a).tobytes()
        for path, a in leaves
        if not jax.tree_util.keystr(path).endswith(".rejected")
    }
    counts = {
        (name, role): int(getattr(op.stats, role).rejected)
        for name, op in ops.items()
        for role in ("input", "kernel", "output_grad")
    }
    return rest, counts


def test_the_docs_float16_step_keeps_a_skipped_steps_fp8_state_as_make_train_step_does():
    """A step skipped for a loss scale that overflows float16's gradients (2**40): under
    make_train_step (Equinox, the reference) every FP8 state stays as it was, bit for bit,
    but delayed scaling's output-gradient histories, which follow the loss scale's backoff
    (`rescale_gradient_states(old, 0.5)`), and telemetry's counts of rejected updates, which
    keep the step's own (each output gradient's inf, counted once; checked by hand). docs/nnx.md's
    float16_step rolled back the Params and Adam's moments but kept the input and kernel
    amaxes the skipped step recorded: its FP8 state moved on from a step that never
    happened."""
    recipe = fp8jax.DelayedScaling(history_len=4)
    backoff = 0.5

    def expected_counts(before):
        return {(n, r): c + (r == "output_grad") for (n, r), c in before.items()}

    # Equinox, under make_train_step.
    def eqx_loss(model, x, y):
        logits = jax.vmap(model)(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    mlp = eqx.nn.MLP(64, 10, 128, 2, key=jax.random.key(1))
    model = fp8jax.fp8_linear_layers(mlp, config(recipe, telemetry=True))
    x = jax.random.normal(jax.random.key(0), (64, 64))
    y = x[:, :10].argmax(-1)
    train_step = fp8jax.make_train_step(
        eqx_loss,
        optax.adam(1e-3),
        policy="params=float32,compute=float16,output=float32",
        loss_scale=fp8jax.DynamicLossScale(2.0**8),
    )
    state = train_step.init(model)
    for _ in range(2):
        state, _ = train_step(state, x, y)
    state = eqx.tree_at(lambda s: s.loss_scale, state, fp8jax.DynamicLossScale(2.0**40))
    new, metrics = train_step(state, x, y)
    assert not bool(metrics.grads_finite)
    eqx_ops = lambda m: {f"layers.{i}": m.layers[i].dot_general for i in range(3)}  # noqa: E731
    rest, counts = _state_and_counts(eqx_ops(new.model))
    kept, before = _state_and_counts(eqx_ops(fp8jax.rescale_gradient_states(state.model, backoff)))
    assert rest == kept
    assert counts == expected_counts(before)

    # NNX, in the docs' step.
    def loss_fn(model, x, y):
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step = _docs_float16_step(loss_fn)
    model = fp8jax.fp8_linear_layers(_Float16Mlp(nnx.Rngs(0)), config(recipe, telemetry=True))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    nnx_ops = lambda: {n: getattr(model, n).dot_general.value() for n in ("fc1", "fc2", "head")}  # noqa: E731
    for _ in range(2):
        step(model, optimizer, fp8jax.DynamicLossScale(2.0**8), x, y)
    old = nnx_ops()
    _, loss_scale = step(model, optimizer, fp8jax.DynamicLossScale(2.0**40), x, y)
    assert int(loss_scale.skipped_steps) == 1
    rest, counts = _state_and_counts(nnx_ops())
    kept, before = _state_and_counts(fp8jax.rescale_gradient_states(old, backoff))
    assert rest.keys() == kept.keys()
    moved = [k for k in kept if rest[k] != kept[k]]
    assert not moved, f"the skipped step moved {moved}"
    assert counts == expected_counts(before)


def test_nnx_rescale_gradient_states_is_the_recorded_gradients_times_the_ratio():
    """In place: the output-gradient history times the ratio, the scale from it by hand in
    float64 (E5M2's max over its max, rounded down to a power of two), current scaling's
    recorded amax and scale too, the other roles bit for bit; a ratio that is not a positive
    finite scalar is refused."""
    recipes = {"fc1": fp8jax.DelayedScaling(history_len=4), "fc2": fp8jax.CurrentScaling()}
    model = fp8jax.fp8_linear_layers(_Float16Mlp(nnx.Rngs(0)), config(recipes=recipes))
    x = jax.random.normal(jax.random.key(0), (32, 64))
    _, grads = fp8jax.nnx_value_and_grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2))(
        model, x
    )
    fp8jax.nnx_update_fp8_state(model, grads)
    before = {n: getattr(model, n).dot_general.value() for n in LAYERS}
    fp8jax.nnx_rescale_gradient_states(model, 4.0)
    after = {n: getattr(model, n).dot_general.value() for n in LAYERS}
    for name in LAYERS:
        history = np.asarray(before[name].output_grad.amax_history, np.float64) * 4.0
        assert history[0] > 0
        np.testing.assert_array_equal(after[name].output_grad.amax_history, history)
        want = 2.0 ** np.floor(np.log2(float(jnp.finfo(jnp.float8_e5m2).max) / history.max()))
        assert float(after[name].output_grad.scale) == want
        assert float(after[name].output_grad.scale_inv) == 1 / want
        for role in ("input", "kernel"):
            for a, b in zip(
                jax.tree.leaves(getattr(after[name], role)),
                jax.tree.leaves(getattr(before[name], role)),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b)
    for bad, match in (
        (0.0, r"ratio=0.0: should be positive"),
        (jnp.ones(2), r"ratio has shape \(2,\)"),
    ):
        with pytest.raises(ValueError, match=f"nnx_rescale_gradient_states: {match}"):
            fp8jax.nnx_rescale_gradient_states(model, bad)
    with pytest.raises(TypeError, match="nnx_rescale_gradient_states: .*not a Flax NNX"):
        fp8jax.nnx_rescale_gradient_states({"a": 1}, 2.0)


def test_a_loss_scale_leaves_an_nnx_models_fp8_state_alone():
    """`unscale`, `scale` and `all_finite` leave FP8 state alone, NNX's `Fp8State` entries of
    the gradients too: they are new states, not gradients (unscaled, the amax history and
    scale were divided by the loss scale, and the next step's scale 256x too large)."""
    model = fp8jax.fp8_linear_layers(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), config())
    x = jax.random.normal(jax.random.key(0), (8, 64))
    loss_scale = fp8jax.StaticLossScale(256.0)
    scaled = lambda m, x: loss_scale.scale(jnp.mean(m(x) ** 2))  # noqa: E731
    _, grads = fp8jax.nnx_value_and_grad(scaled)(model, x)
    for unscaled, factor in ((loss_scale.unscale(grads), 1 / 256), (loss_scale.scale(grads), 256)):
        for kind, want in ((fp8jax.Fp8State, 1.0), (nnx.Param, factor)):
            got = jax.tree.leaves(nnx.filter_state(unscaled, kind))
            before = jax.tree.leaves(nnx.filter_state(grads, kind))
            assert got and len(got) == len(before)
            for a, b in zip(got, before, strict=True):
                np.testing.assert_array_equal(a, np.asarray(b, np.float64) * want)
    # A NaN in the FP8 state is its merge's to reject, not a gradient's overflow.
    state = nnx.filter_state(grads, fp8jax.Fp8State)
    nan = jax.tree.map(lambda a: a * np.nan, state)
    assert bool(fp8jax.all_finite(nnx.merge_state(grads, nan)))


def test_each_train_step_refuses_the_other_frameworks_model_by_name():
    """An NNX model given to `make_train_step`, or an Equinox one to `nnx_train_step`, is
    refused naming the step that takes it (they failed deep inside: `'>' not supported
    between instances of 'Fp8State' and 'int'`, `custom_jvp ... is not a valid JAX type`)."""
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 4))
    nnx_model = fp8jax.fp8_linear_layers(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), config())
    step = fp8jax.make_train_step(lambda m, x, y: jnp.mean((m(x) - y) ** 2), optax.sgd(0.1))
    refused = r"make_train_step: .*Linear, is a Flax NNX .*nnx_train_step"
    with pytest.raises(TypeError, match=refused):
        step.init(nnx_model)
    mlp = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(0))
    eqx_model = fp8jax.fp8_linear_layers(mlp, config())
    optimizer = nnx.Optimizer(nnx_model, optax.sgd(0.1), wrt=nnx.Param)
    loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)  # noqa: E731
    with pytest.raises(TypeError, match=r"nnx_train_step: .*MLP, is not a Flax NNX .*make_train_"):
        fp8jax.nnx_train_step(loss)(eqx_model, optimizer, x, y)


def test_make_train_step_refuses_an_nnx_models_split_state():
    """An NNX model's state (`nnx.split`), with a loss that merges it, was taken by
    `make_train_step`: its Fp8State values, new states arriving as gradients, went to the
    optimizer as weights (Adam drove an input scale negative within three steps). Refused
    now; a state without FP8 layers (a BF16 baseline) trains as before."""
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 4))
    for fp8 in (True, False):
        model = NnxNet((16, 32, 4), nnx.Rngs(0))
        model = fp8jax.fp8_linear_layers(model, config()) if fp8 else model
        graphdef, state = nnx.split(model)
        loss = lambda s, x, y, g=graphdef: jnp.mean((nnx.merge(g, s)(x) - y) ** 2)  # noqa: E731
        step = fp8jax.make_train_step(loss, optax.adam(0.1), policy="c=bf16")
        if fp8:
            with pytest.raises(TypeError, match=r"holds Fp8State variables .*nnx_train_step"):
                step.init(state)
        else:
            train_state, metrics = step(step.init(state), x, y)
            bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)  # by hand
            want = loss(bf16, x.astype(jnp.bfloat16), y)
            np.testing.assert_allclose(metrics.loss, np.float32(want), rtol=1e-2)


class _Branching(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x, train, mode):
        h = jax.nn.relu(self.fc1(x))
        return self.fc2(2 * h if train else h) * (-1.0 if mode == "flip" else 1.0)


def test_nnx_value_and_grad_outside_jit_takes_python_values_the_loss_branches_on():
    def loss_fn(model, x, train, mode="same"):
        return jnp.sum(model(x, train, mode) ** 2)

    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 16)), jnp.float32)
    model = fp8jax.fp8_linear_layers(_Branching(nnx.Rngs(0)), config())
    for train, mode in [(True, "same"), (False, "flip")]:
        loss, grads = fp8jax.nnx_value_and_grad(loss_fn)(model, x, train, mode=mode)
        # Each layer runs once: plain nnx.value_and_grad, eager, is the reference.
        want, want_grads = nnx.value_and_grad(loss_fn, argnums=DIFF)(model, x, train, mode=mode)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Python numbers are traced as jax.jit traces them: a new rate is no new compile.
    traces = []

    def scaled(model, x, rate):
        traces.append(rate)
        return rate * jnp.sum(model(x, True, "same") ** 2)

    step = fp8jax.nnx_value_and_grad(scaled)
    losses = [float(step(model, x, rate)[0]) for rate in (1.0, 2.0)]
    assert len(traces) == 1
    np.testing.assert_allclose(losses[1], 2 * losses[0], rtol=1e-6)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (config("current"), r"'input.amax_history' of the FP8 layer at 'fc1' is \(1,\), where "),
        (config(telemetry=True), r"'stats.input.rejected' .* is \(\), where the layer's is absent"),
    ],
)
def test_nnx_update_fp8_state_refuses_another_models_gradients(other, message):
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 16)), jnp.float32)
    model = fp8jax.fp8_linear_layers(_Branching(nnx.Rngs(0)), config())
    before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, fp8jax.Fp8State))]
    theirs = fp8jax.fp8_linear_layers(_Branching(nnx.Rngs(0)), other)
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(5 * x, True, "same")))(theirs)
    # A (1,) history was broadcast into all 1024 entries of the model's, silently.
    with pytest.raises(ValueError, match=message):
        fp8jax.nnx_update_fp8_state(model, grads)
    after = jax.tree.leaves(nnx.state(model, fp8jax.Fp8State))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_nnx_update_fp8_state_where_false_keeps_the_state_and_refuses_a_non_boolean():
    """`where=False` (a skipped step) leaves every FP8 state as it was, bit for bit; a NumPy
    True updates as the default does; a value that is not a boolean scalar is refused,
    named, before anything is written."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 16)), jnp.float32)
    model = fp8jax.fp8_linear_layers(_Branching(nnx.Rngs(0)), config())
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(5 * x, True, "same")))(model)
    state = lambda m: [np.asarray(v) for v in jax.tree.leaves(nnx.state(m, fp8jax.Fp8State))]  # noqa: E731
    before = state(model)
    for bad, shown in ((jnp.ones(1, bool), r"Array\(\[ True\]"), (1, "1"), ("no", "'no'")):
        with pytest.raises(TypeError, match=rf"where={shown}.* should be a boolean scalar"):
            fp8jax.nnx_update_fp8_state(model, grads, where=bad)
    fp8jax.nnx_update_fp8_state(model, grads, where=False)
    for a, b in zip(state(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    updated = nnx.clone(model)
    fp8jax.nnx_update_fp8_state(updated, grads)
    fp8jax.nnx_update_fp8_state(model, grads, where=np.bool_(True))
    assert any(not np.array_equal(a, b) for a, b in zip(state(updated), before, strict=True))
    for a, b in zip(state(model), state(updated), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nnx_update_fp8_state_where_false_keeps_the_steps_count_of_rejected_updates():
    """A skipped step (`where=False`) keeps every FP8 state but telemetry's counts of
    rejected updates, which keep the step's own: an input holding an inf is one rejected
    update of the input's state (and none before), counted whether the step is taken or not."""
    model = fp8jax.fp8_linear_layers(OneLayer(nnx.Rngs(0)), config(telemetry=True))
    x = jnp.ones((4, 32)).at[0, 0].set(jnp.inf)
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x)))(model)
    assert int(fp8jax.telemetry(model)["fc"].input.rejected) == 0
    taken = nnx.clone(model)
    fp8jax.nnx_update_fp8_state(taken, grads)
    fp8jax.nnx_update_fp8_state(model, grads, where=False)
    assert [int(fp8jax.telemetry(m)["fc"].input.rejected) for m in (taken, model)] == [1, 1]


def test_set_value_refuses_a_state_shaped_otherwise_than_the_layers():
    layer = fp8jax.Fp8NnxDotGeneral("delayed", stacked=(3,))
    before = [np.asarray(a) for a in jax.tree.leaves(layer.value())]
    # The same structure, one layer's shapes: it was written into the stack's variables.
    with pytest.raises(
        ValueError, match=r"\.input\.scale .* is float32\[\], where this layer's is float32\[3\]"
    ):
        layer.set_value(fp8jax.Fp8DotGeneral("delayed"))
    with pytest.raises(ValueError, match=r"is bfloat16\[3\], where this layer's is float32\[3\]"):
        layer.set_value(jax.tree.map(lambda a: a.astype(jnp.bfloat16), layer.value()))
    for a, b in zip(before, jax.tree.leaves(layer.value()), strict=True):
        np.testing.assert_array_equal(a, b)
    layer.set_value(jax.tree.map(lambda a: a + 1, layer.value()))
    for a, b in zip(before, jax.tree.leaves(layer.value()), strict=True):
        np.testing.assert_array_equal(a + 1, b)


@pytest.mark.parametrize("wrt", [3, 2.5, object()])
def test_nnx_value_and_grad_names_a_wrt_that_is_no_filter(wrt):
    # Flax's own error read "Invalid format specifier '!r' for object of type 'int'".
    with pytest.raises(TypeError, match=re.escape(f"wrt={wrt!r} is not an NNX filter")):
        fp8jax.nnx_value_and_grad(lambda m: 0.0, wrt=wrt)


def test_nnx_value_and_grad_takes_the_filters_nnx_optimizer_takes():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 16)), jnp.float32)
    model = fp8jax.fp8_linear_layers(_Branching(nnx.Rngs(0)), config())
    fc1 = nnx.All(nnx.Param, nnx.PathContains("fc1"))
    for wrt in [nnx.Param, (nnx.Param,), fc1, "nothing-tagged"]:
        _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x, True, "same")), wrt=wrt)(model)
        want = nnx.state(model, nnx.Any(nnx.All(wrt, nnx.Not(fp8jax.Fp8State)), fp8jax.Fp8State))
        assert jax.tree.structure(grads) == jax.tree.structure(want)


@pytest.mark.parametrize("arg", ["dtype", "param_dtype"])
def test_grouped_linear_refuses_a_dtype_that_is_not_a_float(arg):
    """`NnxGroupedLinear(dtype=jnp.int32)` computed its experts in int32 (the kernel truncated
    to integers, `nnx.Linear` refuses such a dtype), or with an FP8 `ragged_dot` blamed the
    call's lhs; `param_dtype=jnp.int32` raised JAX's error from inside the initializer. Both
    are now refused when the layer is built, naming the argument; a float dtype computes as
    `lax.ragged_dot` on the operands cast to it."""
    with pytest.raises(ValueError, match=rf"NnxGroupedLinear {arg}=int32, not a floating"):
        fp8jax.NnxGroupedLinear(2, 4, 3, rngs=nnx.Rngs(0), **{arg: jnp.int32})
    layer = fp8jax.NnxGroupedLinear(2, 4, 3, rngs=nnx.Rngs(0), **{arg: jnp.bfloat16})
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 4)), jnp.float32)
    sizes = jnp.array([2, 3])
    kernel = layer.kernel.get_value()
    expected = jax.lax.ragged_dot(
        *(
            (x, kernel)
            if arg == "param_dtype"
            else (x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16))
        ),
        sizes,
    )
    y = layer(x, sizes)
    assert y.dtype == expected.dtype
    np.testing.assert_array_equal(y, expected)


def test_grouped_linear_refuses_a_dense_fp8_gemm_as_its_ragged_dot():
    """An `Fp8NnxDotGeneral` given as `ragged_dot` was taken, and the call raised
    "dimension_numbers=Array([...]): should be ..." (the group sizes read as its dimension
    numbers); it is refused when the layer is built, naming what a grouped layer takes."""
    with pytest.raises(TypeError, match=r"ragged_dot=Fp8NnxDotGeneral.*Fp8NnxRaggedDot"):
        fp8jax.NnxGroupedLinear(2, 4, 3, rngs=nnx.Rngs(0), ragged_dot=fp8jax.Fp8NnxDotGeneral())


def test_grouped_layers_refuse_the_other_framework_s_fp8_grouped_gemm():
    """An Equinox `Fp8RaggedDot` in an `NnxGroupedLinear` (or an `Fp8NnxRaggedDot` in a
    `GroupedLinear`) was taken and ran forward, but no training step could update its state:
    NNX's step raised `StateNotDifferentiatedError` (blaming the step), Equinox's "'>' not
    supported between instances of 'Fp8State' and 'int'". Both are refused when the layer is
    built, naming the GEMM its framework takes; the right one trains its state."""
    with pytest.raises(
        TypeError,
        match=r"NnxGroupedLinear ragged_dot=Fp8RaggedDot: an Equinox.*"
        r"NnxGroupedLinear's is a fp8jax.Fp8NnxRaggedDot",
    ):
        fp8jax.NnxGroupedLinear(
            2, 4, 3, rngs=nnx.Rngs(0), ragged_dot=fp8jax.Fp8RaggedDot(num_experts=2)
        )
    with pytest.raises(
        TypeError,
        match=r"GroupedLinear ragged_dot=Fp8NnxRaggedDot: a Flax NNX.*"
        r"GroupedLinear's is a fp8jax.Fp8RaggedDot",
    ):
        fp8jax.GroupedLinear(
            2, 4, 3, key=jax.random.key(0), ragged_dot=fp8jax.Fp8NnxRaggedDot(num_experts=2)
        )
    layer = fp8jax.NnxGroupedLinear(
        2, 4, 3, rngs=nnx.Rngs(0), ragged_dot=fp8jax.Fp8NnxRaggedDot(num_experts=2)
    )
    x, sizes = jnp.asarray(np.arange(12.0).reshape(3, 4)), jnp.array([1, 2], jnp.int32)
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x, sizes) ** 2))(layer)
    fp8jax.nnx_update_fp8_state(layer, grads)
    history = layer.ragged_dot.value().input.amax_history
    assert float(history[0]) == float(np.abs(np.asarray(x)).max())


def test_grouped_linear_initialises_each_expert_like_nnx_linear():
    """Each expert's kernel is drawn as `nnx.Linear`'s default draws its kernel, as the
    docstring says: LeCun normal, which in Flax is a normal truncated at two standard
    deviations, scaled to variance 1/in_features. It was an untruncated normal (2 % of the
    values past nnx.Linear's largest)."""
    experts, fan_in, fan_out = 4, 64, 128
    kernel = fp8jax.NnxGroupedLinear(experts, fan_in, fan_out, rngs=nnx.Rngs(3)).kernel
    kernel = np.asarray(kernel.get_value(), np.float64)
    # A standard normal truncated to [-2, 2] has standard deviation `shrink`: LeCun normal's
    # sigma is 1/sqrt(fan_in)/shrink, so that the truncated values have variance 1/fan_in.
    density, mass = math.exp(-2.0) / math.sqrt(2 * math.pi), math.erf(2 / math.sqrt(2))
    shrink = math.sqrt(1 - 4 * density / mass)
    bound = 2 / math.sqrt(fan_in) / shrink
    for e in range(experts):  # each expert's own fan-in, not the stack's
        assert np.abs(kernel[e]).max() <= bound * (1 + 1e-6)
        assert np.abs(kernel[e]).max() > 0.95 * bound
        np.testing.assert_allclose(kernel[e].std(), 1 / math.sqrt(fan_in), rtol=0.04)
    bf16 = fp8jax.NnxGroupedLinear(2, 16, 8, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    assert bf16.kernel.get_value().dtype == jnp.bfloat16


def test_grouped_linear_refuses_a_ragged_dot_built_for_another_expert_count():
    """As `GroupedLinear`: the count mismatch raised at the first call, now when built."""
    with pytest.raises(ValueError, match=r"NnxGroupedLinear num_experts=2 but .* num_experts=3"):
        fp8jax.NnxGroupedLinear(
            2, 4, 3, rngs=nnx.Rngs(0), ragged_dot=fp8jax.Fp8NnxRaggedDot(num_experts=3)
        )


@pytest.mark.parametrize("name", ["current", "blockwise"])
def test_grouped_linear_computing_in_bf16_quantizes_its_float32_master(name):
    """An `NnxGroupedLinear(dtype=bf16)` on float32 parameters with an FP8 `ragged_dot` cast
    its kernel to BF16 before the FP8 GEMM quantized it again (two roundings, the amax of
    the copy), where `nnx.Linear`'s FP8 GEMM gets the master uncast and the Equinox experts
    under a BF16 policy (`compute_dtype`) do too: it now hands the GEMM the master, as they
    do, and returns BF16. Each expert's recorded amax is its master's, and the output and
    the gradients are the Equinox layer's."""
    layer = fp8jax.NnxGroupedLinear(
        4,
        32,
        16,
        rngs=nnx.Rngs(3),
        dtype=jnp.bfloat16,
        ragged_dot=fp8jax.Fp8NnxRaggedDot(name, num_experts=4),
    )
    master = layer.kernel.get_value()
    eqx_layer = fp8jax.GroupedLinear(
        4,
        32,
        16,
        weight=master,
        compute_dtype=jnp.bfloat16,
        ragged_dot=fp8jax.Fp8RaggedDot(name, num_experts=4),
    )
    x = jnp.asarray(np.random.default_rng(5).standard_normal((32, 32)), jnp.bfloat16)

    def loss(m, x):
        return jnp.sum(m(x, SIZES).astype(jnp.float32) ** 2)

    grads, grad_x = nnx.grad(loss, argnums=(DIFF, 1))(layer, x)
    grads_e, grad_x_e = fp8jax.filter_grad(lambda mx: loss(*mx))((eqx_layer, x))
    out = layer(x, SIZES)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, eqx_layer(x, SIZES))
    np.testing.assert_array_equal(grad_x, grad_x_e)
    np.testing.assert_array_equal(grads["kernel"].get_value(), grads_e.weight)
    fp8jax.nnx_update_fp8_state(layer, grads)
    recorded = np.asarray(layer.ragged_dot.value().kernel.amax_history[:, 0])
    want = np.abs(np.asarray(master, np.float64)).max(axis=(1, 2))
    want[np.asarray(SIZES) == 0] = 0.0  # an expert without tokens records nothing
    np.testing.assert_array_equal(recorded, want)


def test_delayed_scaling_state_after_several_steps_matches_a_hand_rolled_history():
    """The FP8 state of an NNX layer trained five steps by `nnx_train_step` equals Transformer
    Engine's delayed-scaling update done by hand in NumPy: each step's amaxes (input, the
    kernel before the step, the output gradient, which `sum(out * c)` makes `c`) rolled into
    a history of 3, newest first, and the next scale `fmt_max / max(history)` rounded down to
    a power of two."""
    recipe = fp8jax.DelayedScaling(history_len=3)
    model = fp8jax.fp8_linear_layers(_Wrapped(nnx.Linear(8, 4, rngs=nnx.Rngs(0))), config(recipe))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fp8jax.nnx_train_step(lambda m, x, c: jnp.sum(m(x) * c))
    rng = np.random.default_rng(5)
    fmt_max = {"input": 448.0, "kernel": 448.0, "output_grad": 57344.0}
    history = {role: np.zeros(3) for role in fmt_max}
    for t, spread in enumerate([1.0, 30.0, 0.5, 2.0, 0.01]):
        x = rng.standard_normal((6, 8)).astype(np.float32) * spread
        c = rng.standard_normal((6, 4)).astype(np.float32) * spread / 3
        kernel = np.asarray(model.fc.kernel.get_value())
        step(model, optimizer, jnp.asarray(x), jnp.asarray(c))
        for role, amax in (("input", x), ("kernel", kernel), ("output_grad", c)):
            h = history[role]
            history[role] = np.concatenate([[np.abs(amax).max()], h[2:], h[:1]])
        state = model.fc.dot_general.value()
        for role, h in history.items():
            got = getattr(state, role)
            np.testing.assert_array_equal(got.amax_history, h.astype(np.float32), err_msg=role)
            scale = 2.0 ** np.floor(np.log2(fmt_max[role] / np.float32(h.max())))
            assert float(got.scale) == scale, (t, role)
            assert float(got.scale_inv) == 1 / scale, (t, role)


def test_a_converted_layers_call_errors_name_the_layer():
    """An operand an FP8 layer cannot take, or an equation its einsum refuses, raised naming no
    layer (of a model with dozens); the error now leads with the layer's path. The same call
    in high precision raises too (the FP8 layer refuses nothing NNX would compute)."""
    linear = _Wrapped(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    einsum = _Wrapped(nnx.Einsum("bd,df->bf", (8, 8), rngs=nnx.Rngs(0)))
    fp8_linear = fp8jax.fp8_linear_layers(linear, config())
    fp8_einsum = fp8jax.fp8_linear_layers(einsum, config())
    with pytest.raises(ValueError, match=r"^FP8 layer 'fc': Mismatched shapes for dot_general"):
        fp8_linear(jnp.ones((2, 7)))
    with pytest.raises(TypeError):
        linear(jnp.ones((2, 7)))
    with pytest.raises(TypeError, match=r"^FP8 layer 'fc': Fp8DotGeneral: lhs has dtype complex64"):
        fp8_linear(jnp.ones((2, 8), jnp.complex64))
    with pytest.raises(ValueError, match=r"^FP8 layer 'fc': FP8 einsum: subscripts='bd,dd->bd'"):
        fp8_einsum.fc(jnp.ones((2, 8)), "bd,dd->bd")
    # An error the op names already ("FP8 layer 'fc': ...", as the Equinox layer says it) is
    # named once: it read "FP8 layer 'fc': FP8 layer 'fc': its state was made for ...".
    dot = fp8jax.Fp8NnxDotGeneral(RECIPES["residual error feedback"], (16, 32), "fc")
    with pytest.raises(ValueError, match=r"^FP8 layer 'fc': its state was made") as raised:
        dot(jnp.ones((2, 16)), jnp.ones((16, 32)), (((1,), (0,)), ((), ())))
    assert str(raised.value).count("FP8 layer") == 1


def test_a_linear_general_with_batch_axes_holds_one_state_and_runs():
    """An nnx.LinearGeneral with `batch_axis` (a kernel per batch entry) is one layer: its
    state is a plain Linear's (no stack axis), its call computes each entry's product with
    its own kernel (float64, within E4M3's rounding of both operands: 2**-4 each) and its
    step records the input's amax."""
    model = _Wrapped(nnx.LinearGeneral(8, 4, batch_axis={0: 3}, rngs=nnx.Rngs(0)))
    plain = fp8jax.fp8_linear_layers(_Wrapped(nnx.Linear(8, 4, rngs=nnx.Rngs(0))), config())
    model = fp8jax.fp8_linear_layers(model, config())
    shapes = [jax.tree.map(jnp.shape, m.fc.dot_general.value()) for m in (model, plain)]
    assert shapes[0] == shapes[1]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 8)), jnp.float32)
    kernel = np.asarray(model.fc.kernel.get_value(), np.float64)  # (3, 8, 4)
    x64 = np.asarray(x, np.float64)
    bias = np.asarray(model.fc.bias.get_value(), np.float64)[:, None, :]  # (3, 1, 4)
    expected = np.einsum("bti,bio->bto", x64, kernel) + bias
    bound = (2 * 2.0**-4 + 2.0**-8) * np.einsum("bti,bio->bto", np.abs(x64), np.abs(kernel))
    assert np.all(np.abs(np.asarray(model(x), np.float64) - expected) <= bound + 1e-6)
    _, grads = fp8jax.nnx_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    fp8jax.nnx_update_fp8_state(model, grads)
    assert float(model.fc.dot_general.value().input.amax_history[0]) == np.abs(x64).max()


@pytest.mark.parametrize("kind", ["einsum", "general"])
def test_batched_kernel_refusal_does_not_tell_fp8_linear_layers_to_pass_kernel_shape(kind):
    """fp8_linear_layers refusing error feedback for a kernel with batch axes quoted the
    recipe's advice to Fp8DotGeneral's users, "pass kernel_shape=... (fp8_linear_layers does
    this for you)", to a user who called fp8_linear_layers; it says why and what to do."""
    if kind == "einsum":
        model = _Wrapped(nnx.Einsum("ebd,edf->ebf", (4, 32, 8), rngs=nnx.Rngs(0)))
    else:
        model = _Wrapped(nnx.LinearGeneral(8, 4, batch_axis={0: 3}, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError) as info:
        fp8jax.fp8_linear_layers(model, config(RECIPES["residual error feedback"]))
    message = str(info.value)
    assert "kernel_shape" not in message and "does this for you" not in message, message
    assert re.search(r"'fc'.*ResidualFP8.*error feedback.*batch axes.*exclude it", message)

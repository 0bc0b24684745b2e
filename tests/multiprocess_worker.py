"""One process of the two-process training run of `test_multiprocess.py` (not a test file).

`python multiprocess_worker.py PROCESS_ID PORT OUT_DIR` joins JAX's multi-controller runtime
(coordinator on 127.0.0.1:PORT, two processes, four CPU devices each, gloo collectives), trains
the example GPT data-parallel and FSDP on the global mesh of eight devices, saves checkpoints of
the FSDP state from both processes, restores them, and writes what it saw to
`OUT_DIR/process{PROCESS_ID}.npz`. The test imports this module for the same problem, shardings
and steps, and runs them in one process.
"""

import os
import sys
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import scales_per_element
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.examples import gpt

DEVICES = 8
PROCESSES = 2
STEPS = 3
LAYOUTS = ("data", "fsdp")
CONFIG = gpt.GPTConfig(vocab=64, layers=1, width=32, heads=2, context=16)
# A short history, so that three steps fill most of it.
RECIPE = fp8jax.DelayedScaling(history_len=4)
BATCH = 16


def build(key):
    """The example GPT with `CONFIG`, without a bias on its attention keys.

    That bias adds `q . b` to every score of a query, which softmax ignores: its gradient is
    zero in exact arithmetic, and what a step computes is rounding noise (about 1e-9 here),
    which Adam scales up to a step of about the learning rate. Two runs that add floats in
    another order (see the test) would disagree on it entirely.
    """
    model_key, linear_key = jax.random.split(key)
    model = gpt.GPT(CONFIG, key=model_key)
    linear = eqx.nn.Linear(CONFIG.width, CONFIG.width, use_bias=False, key=linear_key)
    return eqx.tree_at(lambda m: m.blocks[0].attn.key, model, linear)


def problem():
    """The model (host values, the same in every process) and the global batch as NumPy."""
    model = eqx.filter_jit(build)(jax.random.key(0))  # one compile, not one per initialiser
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPE))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab, (BATCH, CONFIG.context + 1)).astype(np.int32)
    # Sample weights from e**-3 to e**3: each device's examples, and so its gradients and their
    # amaxes, have their own magnitude. A device or a process that scaled with its own amax
    # instead of the global one would record another amax history than one process does.
    weights = np.exp(np.linspace(-3.0, 3.0, BATCH)).astype(np.float32)
    return model, tokens, weights


def loss_fn(model, tokens, weights):
    """Weighted next-token cross-entropy: `gpt.next_token_loss` with a weight per sequence."""
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(weights[:, None] * picked)


def mesh():
    return jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def spec(layout, path, leaf):
    """Where a model leaf lives: FSDP splits every parameter whose first axis divides evenly;
    FP8 state (scales, amax histories) stays replicated, as in `test_sharding.py`."""
    split = layout == "fsdp" and leaf.ndim >= 1 and leaf.shape[0] % DEVICES == 0
    return P("data") if split and "dot_general" not in path else P()


def to_global(tree, spec_of, m):
    """`tree` with each array leaf a global array placed by `spec_of(path, leaf)`: every process
    holds the same values, and gives its devices their part."""

    def place(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        value = np.asarray(leaf)
        sharding = NamedSharding(m, spec_of(jax.tree_util.keystr(path), leaf))
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree_util.tree_map_with_path(place, tree)


def on_mesh(tree, m):
    """`tree` with each array leaf that is not on mesh `m` replicated over it."""

    def place(leaf):
        if not eqx.is_array(leaf) or getattr(leaf.sharding, "mesh", None) == m:
            return leaf
        value = np.asarray(leaf)
        sharding = NamedSharding(m, P())
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(place, tree)


def global_batch(tokens, weights, m):
    """The batch split over `data`: each process gives only the rows its devices hold, as a
    process reading its own part of the data would."""
    out = []
    for value in (tokens, weights):
        sharding = NamedSharding(m, P("data"))
        rows = sharding.addressable_devices_indices_map(value.shape).values()
        start = min(index[0].start for index in rows)
        stop = max(index[0].stop for index in rows)
        out.append(jax.make_array_from_process_local_data(sharding, value[start:stop], value.shape))
    return tuple(out)


#: The recipes whose FSDP weight gather is checked bit for bit (`gathered_weights`).
GATHERED = {
    "delayed": fp8jax.DelayedScaling(history_len=4),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
}


def gathered_weights(m):
    """A weight quantized by each of `GATHERED` and gathered: `{name: NumPy}`. On mesh `m`
    the weight is split on its input axis over every device of every process, quantized
    where it lies (the amax crossing processes as one number) and gathered in FP8; with
    `m=None`, quantized whole on one device. Scales are compared per element: whole on one
    device, a blockwise weight comes in the native kernels' layout (each block's scale
    repeated over the rows of its tiles), on shards in its blocks."""
    rng = np.random.default_rng(1)
    rows = np.exp(np.linspace(-3.0, 3.0, 128, dtype=np.float32))[:, None]
    weight = (rng.standard_normal((128, 1024)) * rows).astype(np.float32)
    out = {}
    for name, recipe in GATHERED.items():
        state = recipe.init_state("kernel", weight.shape)

        def quantize(w, recipe=recipe, state=state):
            q, new_state = recipe.quantize(w, state, "kernel", -1)
            return q.data, scales_per_element(q), new_state

        if m is None:
            q = jax.jit(quantize)(weight)
        else:
            split = to_global(weight, lambda path, leaf: P(None, "data"), m)
            q = jax.jit(quantize, out_shardings=NamedSharding(m, P()))(split)
        for i, leaf in enumerate(jax.tree.leaves(q)):
            value = leaf if m is None else leaf.addressable_data(0)
            out[f"gather/{name}/{i}"] = np.atleast_1d(np.asarray(value)).view(np.uint8)
    return out


def to_host(tree, m):
    """Every array leaf of `tree` as NumPy: gathered whole to each process in one program."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    gathered = jax.jit(lambda t: t, out_shardings=NamedSharding(m, P()))(arrays)
    return eqx.combine(jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), gathered), static)


def replica_copies_agree(tree):
    """Whether every device's copy of each replicated leaf of `tree` is the same, bit for bit."""
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
        if leaf.sharding.is_fully_replicated:
            copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
            if any(c.tobytes() != copies[0].tobytes() for c in copies):
                return False
    return True


class KeptGradients(NamedTuple):
    grads: Any


def keep_gradients():
    """An optax transformation that passes updates through and keeps them in its state: the
    optimizer state then holds the last step's (unscaled) gradients."""

    def init(params):
        return KeptGradients(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        return updates, KeptGradients(updates)

    return optax.GradientTransformation(init, update)


def make_step():
    """The train step: Adam, with the gradients kept in the optimizer state."""
    return fp8jax.make_train_step(loss_fn, optax.chain(keep_gradients(), optax.adam(1e-2)))


def train(layout, m):
    """`STEPS` train steps of `layout` on mesh `m`: the final `TrainState` (global arrays; its
    `opt_state[0].grads` are the last step's gradients) and the loss of every step."""
    model, tokens, weights = problem()
    model = to_global(model, lambda path, leaf: spec(layout, path, leaf), m)
    batch = global_batch(tokens, weights, m)
    step = make_step()
    # The optimizer's moments take their parameters' shardings; its counters (and the step's)
    # are made on one device: replicate them, as the step returns them (else the second step
    # compiles again, for other input shardings).
    state = on_mesh(step.init(model), m)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, *batch)
        losses.append(metrics.loss)
    return state, jnp.stack(losses)


def flat(tree, prefix):
    """`{prefix + path: array}` for every array leaf of `tree` (host values)."""
    return {
        prefix + jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    }


def results(layout, m):
    """The final state of `layout` and what it is compared on: `{name: NumPy array}` with names
    `layout/state...` (every array of the state) and `layout/losses`."""
    state, losses = train(layout, m)
    if not replica_copies_agree((state, losses)):
        raise AssertionError(f"{layout}: the devices' copies of a replicated array differ")
    state_host, losses_host = to_host((state, losses), m)
    return state, {**flat(state_host, f"{layout}/state"), f"{layout}/losses": losses_host}


def main(process_id, port, out_dir):
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", DEVICES // PROCESSES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",  # not every interface (the default)
        num_processes=PROCESSES,
        process_id=process_id,
        initialization_timeout=120,
    )
    assert jax.process_count() == PROCESSES and jax.device_count() == DEVICES
    m = mesh()
    out = {}
    for layout in LAYOUTS:
        state, values = results(layout, m)
        out.update(values)
    out.update(gathered_weights(m))
    # Checkpoints of the last (FSDP) state, written by both processes; then each process
    # restores them into its sharded state.
    for backend, name in (("equinox", "ckpt.eqx"), ("orbax", "ckpt_orbax")):
        path = os.path.join(out_dir, name)
        fp8jax.save_checkpoint(path, state, backend=backend)
        restored = fp8jax.load_checkpoint(path, state, backend=backend)
        got, want = (jax.tree.leaves(eqx.filter(s, eqx.is_array)) for s in (restored, state))
        if [a.sharding for a in got] != [a.sharding for a in want]:
            raise AssertionError(f"{backend}: restored with other shardings than saved")
        got, want = to_host((got, want), m)
        if not all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True)):
            raise AssertionError(f"{backend}: the restored state differs from the saved one")
    np.savez(os.path.join(out_dir, f"process{process_id}.npz"), **out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

"""Two processes (JAX's multi-controller runtime) train as one process on the same mesh does.

`multiprocess_worker.py` runs in two processes joined by `jax.distributed.initialize`
(coordinator on 127.0.0.1, four CPU devices each, gloo collectives): the example GPT with
delayed scaling, data-parallel and FSDP over the eight devices of both, then checkpoints of the
FSDP state written by both. This test runs the same steps in one process on eight devices and
compares the loss of every step, the last step's gradients, the weights, the optimizer state and
every FP8 scale and amax history; then it restores both checkpoints in this one process.
"""

import os
import pathlib
import socket
import subprocess
import sys
import time

import equinox as eqx
import jax
import multiprocess_worker as worker
import numpy as np
import pytest
from helpers import compile_flags

import fp8jax

WORKER = pathlib.Path(worker.__file__)
TIMEOUT = 300  # seconds for the whole run: a worker whose peer is lost waits, it need not end
# Gradients (and the loss) are sums over the eight devices' examples. XLA's in-process
# all-reduce adds the devices' partial sums in device order; gloo's, across processes, in
# another (checked on a sum of eight random arrays). Both runs compile to the same program (their
# optimised HLO differs only in a loop-partitioning hint), so they differ by float32 rounding
# alone: a few ulps of a leaf's largest element after one step, at most 2.5e-7 of it after
# three (measured). A max does not depend on the order: the first step's amaxes, taken before
# any rounded sum reaches them, are compared exactly.
RTOL = 1e-6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the two workers and, meanwhile, the same steps in this process on its eight CPU
    devices. Returns the workers' output folder and this process's `{layout: values}`."""
    out = tmp_path_factory.mktemp("multiprocess")
    port = free_port()
    # The workers set their own device count; and gRPC would send even 127.0.0.1 to a proxy.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and "proxy" not in k.lower()}
    # Otherwise this process's XLA flags (conftest's compile options): the values are compared
    # bit for bit, and XLA:CPU's optimisation level can move the last bit of a LayerNorm.
    if flags := compile_flags():
        env["XLA_FLAGS"] = flags
    env["JAX_PLATFORMS"] = "cpu"
    # The workers import the fp8jax this process imported: a script's sys.path starts at its
    # own folder (tests/), not at the working directory, so without this a checkout tested
    # from its root with another fp8jax installed would compare two versions of fp8jax.
    root = str(pathlib.Path(fp8jax.__file__).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    logs = [out / f"process{i}.log" for i in range(worker.PROCESSES)]
    procs = []
    deadline = time.monotonic() + TIMEOUT
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(i), str(port), str(out)],
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        m = worker.mesh()
        want = {layout: worker.results(layout, m)[1] for layout in worker.LAYOUTS}
        codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for proc in procs:
            if proc.poll() is None:  # a failure here, or a worker past its time
                proc.kill()
                proc.wait()
    if codes != [0] * worker.PROCESSES:
        what = f"timed out after {TIMEOUT} s" if codes is None else f"exit codes {codes}"
        logs = "\n".join(
            f"--- process {i} ---\n{log.read_text()[-6000:]}" for i, log in enumerate(logs)
        )
        pytest.fail(f"the two worker processes failed ({what}):\n{logs}")
    return out, want


def assert_close(got, want, name):
    """Equal within `RTOL` of the leaf's largest magnitude (elements of a sum may cancel)."""
    bound = RTOL * float(np.max(np.abs(want), initial=0.0))
    err = float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))
    assert err <= bound, f"{name}: differs by {err:.3g}, more than {bound:.3g}"


# Where the first step's amax sits in a history after `STEPS` steps: each step rolls the
# history by -1 and writes index 0.
FIRST = -(worker.STEPS - 1) % worker.RECIPE.history_len


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_two_processes_train_as_one(runs, layout):
    out, want = runs
    want = want[layout]
    assert worker.STEPS <= worker.RECIPE.history_len
    for i in range(worker.PROCESSES):
        # Each process's own copy of the replicated arrays (the worker checked that its four
        # devices agree): a process that kept its own amax, not the global one, shows here.
        got = dict(np.load(out / f"process{i}.npz"))
        names = sorted(n for n in got if n.startswith(f"{layout}/"))
        assert names == sorted(want)
        histories = [n for n in names if n.endswith(".amax_history")]
        scales = [n for n in names if ".dot_general." in n and n.endswith(".scale")]
        # 6 FP8 Linears, each with an input, a kernel and an output-gradient state.
        assert len(histories) == len(scales) == 6 * 3
        for name in histories:
            # The first step's amaxes are maxima of the same values in both runs: exact, for
            # inputs, weights and output gradients alike.
            assert got[name][FIRST] == want[name][FIRST] != 0, name
        for name in scales:
            # Powers of two from amaxes that differ by float32 rounding at most: the same.
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        grads = [n for n in names if ".opt_state[0].grads." in n]
        assert len(grads) == len([n for n in names if ".opt_state[1][0].mu." in n]) > 0
        for name in names:  # losses, weights, gradients, optimizer state, amax histories
            assert_close(got[name], want[name], name)


def test_fsdp_weights_gather_in_fp8_bit_for_bit_across_processes(runs):
    """A weight split over the devices of both processes, quantized where it lies and
    gathered (in FP8): each process holds, bit for bit, the weight quantized whole on one
    device, for per-tensor (the amax crossing processes as one number) and block scales."""
    out, _ = runs
    want = worker.gathered_weights(None)
    # The FP8 data and scales, and the new state (amaxes), of each of the three recipes.
    assert {name.split("/")[1] for name in want} == set(worker.GATHERED)
    for i in range(worker.PROCESSES):
        got = dict(np.load(out / f"process{i}.npz"))
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("backend", ["equinox", "orbax"])
def test_checkpoint_of_two_processes_restores_in_one(runs, backend):
    out, _ = runs
    model, _, _ = worker.problem()
    like = worker.make_step().init(model)  # on one device, as a process of its own would have it
    name = "ckpt.eqx" if backend == "equinox" else "ckpt_orbax"
    restored = fp8jax.load_checkpoint(out / name, like, backend=backend)
    saved = dict(np.load(out / "process0.npz"))
    got = worker.flat(restored, "fsdp/state")
    assert sorted(got) == sorted(n for n in saved if n.startswith("fsdp/state"))
    for name, value in got.items():
        np.testing.assert_array_equal(value, saved[name], err_msg=name)
    device = jax.devices()[0]
    assert all(
        a.sharding.device_set == {device}
        for a in jax.tree.leaves(eqx.filter(restored, eqx.is_array))
    )

"""What an FP8 GEMM costs outside `jax.jit`: eager `shard_map` and eager `fp8_autocast`.

    python benchmarks/eager_cost.py [--persistent-cache]

On the CPU (8 host devices), first call then the mean of 10 later calls with the same shapes,
each against the same function under `jax.jit`:

- `shard_map`: a delayed-scaling `Fp8DotGeneral` (16 x 32 by 32 x 8, rows split over the 8
  devices) in a `jax.shard_map` called eagerly. JAX's eager `shard_map` traces and compiles
  each operation of its body again at every call, the FP8 GEMM's own `jit` among them; the
  compiles per eager call are counted from `jax.monitoring`'s backend-compile events, for this
  body and for a plain `jnp.tanh(x @ w.T) * 2`.
- `fp8_autocast`: `fp8_autocast(lambda x: jnp.tanh(x @ w))` (16 x 32 by 32 x 16) called eagerly:
  it traces the function at every call (nothing is cached: a closure could change) and runs
  the FP8 program op by op.

`--persistent-cache`: the same with JAX's persistent compilation cache on (a fresh temporary
folder, `jax_persistent_cache_min_compile_time_secs=0`), so that an eager call's compiles are
read back from it after the first.

Quoted by docs/scaling_out.md and docs/autocast.md; CPU times, so of this machine and load.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8jax  # noqa: E402

CALLS = 10
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # also logged as a backend compile
_EVENTS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(lambda name, *_, **__: _EVENTS.append(name))
jax.monitoring.register_event_listener(lambda name, **__: _EVENTS.append(name))


def timed(fn: Callable, *args) -> tuple[float, float, float, float]:
    """Seconds of the first call, the mean of `CALLS` later ones, and per later call the
    programs compiled and those read back from the persistent cache."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    _EVENTS.clear()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    hits = _EVENTS.count(CACHE_HIT)
    return first, float(np.mean(times)), (_EVENTS.count(COMPILE_EVENT) - hits) / CALLS, hits / CALLS


def main(argv: list[str]) -> None:
    if argv not in ([], ["--persistent-cache"]):
        sys.exit(f"eager_cost.py: unknown arguments {argv!r}; takes only --persistent-cache")
    cached = bool(argv)
    if cached:
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="eager_cost_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    wa = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    dims = (((1,), (1,)), ((), ()))
    dot = fp8jax.Fp8DotGeneral("delayed")
    fp8 = jax.shard_map(
        lambda d, x, w: d(x, w, dims),
        mesh=mesh,
        in_specs=(P(), P("data"), P()),
        out_specs=P("data"),
    )
    plain = jax.shard_map(
        lambda x, w: jnp.tanh(x @ w.T) * 2,
        mesh=mesh,
        in_specs=(P("data"), P()),
        out_specs=P("data"),
    )
    autocast = fp8jax.fp8_autocast(lambda x: jnp.tanh(x @ wa))
    rows = [
        ("shard_map, FP8 GEMM", fp8, (dot, x, w)),
        ("shard_map, jnp.tanh(x @ w.T) * 2", plain, (x, w)),
        ("fp8_autocast, one GEMM + tanh", autocast, (x,)),
    ]
    print(
        f"jax {jax.__version__}; CPU, 8 host devices; first call, then the mean of {CALLS}; "
        f"persistent compilation cache {'on' if cached else 'off'}"
    )
    print()
    print(
        "| function | eager: first / later | a later eager call: compiled / read from the "
        "cache | jitted: first / later |"
    )
    print("|---|---|---|---|")
    for name, fn, args in rows:
        e_first, e_later, compiled, read = timed(fn, *args)
        j_first, j_later, *_ = timed(jax.jit(fn), *args)
        print(
            f"| {name} | {e_first * 1e3:.1f} / {e_later * 1e3:.1f} ms | {compiled:.0f} / "
            f"{read:.0f} | {j_first * 1e3:.1f} / {j_later * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])

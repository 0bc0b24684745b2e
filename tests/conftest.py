import gc
import os
from importlib.metadata import version

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight CPU devices for the sharding tests (must be set before jax starts).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Faster CPU compiles, the suite's main cost: LLVM without optimisation and its expensive
# passes (measured on 2 cores: the whole suite 2001 s -> 1606 s), and on the JAX releases whose
# XLA:CPU has both (the test command's 0.10; later ones have only the fusion emitters and
# reject the flag) its elemental emitters in place of its MLIR fusion emitters (a small Griffin
# train step's compile 29 s -> 6 s, the whole suite 2003 s -> 1186 s; 2026-11-29). The level
# can move the last bit of elementwise math (seen: a LayerNorm's output), and the elemental
# emitters that of an expression fused two ways (a GELU's gradient with and without remat, a
# reduction): a test comparing two programs bit for bit compiles them with helpers.SAME_BITS;
# one comparing another process's results gives it these flags (test_multiprocess.py; the
# Mosaic dump helper passes the whole environment). Set them yourself to test other levels.
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
    _FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs the same examples every time (a red run is reproducible); set
# HYPOTHESIS_PROFILE=explore to search new ones.
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None)
settings.register_profile("explore", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: Seconds each of the slowest test files took on 2 CPU cores (`pytest -n 2 --durations=0`,
#: main of 2026-12-06, each file's tests summed and rounded). Only their order on the workers
#: is decided from it: see `pytest_collection_modifyitems`.
SLOW_FILES = {
    "tests/test_inspect.py": 273,
    "tests/test_gpu_check.py": 226,
    "tests/test_scaling_out.py": 221,
    "notebooks/05_deepseek_v3_in_miniature.ipynb": 192,
    "tests/test_grouped_native.py": 176,
    "tests/test_grouped.py": 135,
    "notebooks/06_flax_linen_unedited.ipynb": 122,
    "tests/test_nnx.py": 122,
    "tests/test_expert_parallel.py": 113,
    "tests/test_train_step.py": 86,
    "tests/test_linen.py": 85,
    "tests/test_kernels.py": 81,
    "tests/test_checkpoint.py": 80,
    "tests/test_numerics.py": 74,
    "tests/test_deepseek.py": 67,
    "tests/test_lowering.py": 59,
    "notebooks/04_flax_nnx.ipynb": 49,
    "tests/test_sharding.py": 47,
}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (controller side): tell each worker the controller's `--dist` mode (xdist
    passes the worker count itself, as `workercount`). A worker's own options read
    `dist="no"` and `numprocesses=None` (xdist resets them), and the workers, not the
    controller, collect and order the tests."""
    node.workerinput["fp8jax_dist"] = node.config.getoption("dist", "no")


def _worksteal_workers(config) -> int | None:
    """The number of xdist workers when this process is one of them under `--dist
    worksteal`, else None (one process, or another mode: the usual order)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or workerinput.get("fp8jax_dist") != "worksteal":
        return None
    return int(workerinput["workercount"])


def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist worksteal` (the default, pyproject.toml), xdist gives each
    worker a contiguous 1/N of the collected tests and lets an idle worker take the tail of
    another's queue. So that no worker starts a long file last, the slow files (`SLOW_FILES`,
    kept whole: their module fixtures are set up once) are dealt to the workers' shares,
    heaviest first to the least loaded, each share starting with its slow files and filled
    up with the other tests in their usual order. Every worker orders its collection so
    (xdist requires the same order on all)."""
    workers = _worksteal_workers(config)
    if workers is None or workers < 2 or len(items) < 2 * workers:
        return
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = sorted((f for f in by_file if f in SLOW_FILES), key=lambda f: -SLOW_FILES[f])
    shares: list[list] = [[] for _ in range(workers)]
    load = [0] * workers
    for f in slow:
        i = load.index(min(load))
        shares[i] += by_file[f]
        load[i] += SLOW_FILES[f]
    rest = [item for f, its in by_file.items() if f not in SLOW_FILES for item in its]
    ordered = []
    for i, share in enumerate(shares):
        size = len(items) // workers if i < workers - 1 else len(items)
        take = max(0, size - len(share)) if i < workers - 1 else len(rest)
        ordered += share + rest[:take]
        rest = rest[take:]
    ordered += rest
    assert sorted(map(id, ordered)) == sorted(map(id, items))
    items[:] = ordered


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. Every CPU executable keeps its own
    memory mappings; one process running the whole suite otherwise nears the kernel's limit
    (vm.max_map_count, 65,530: over 60,000 by the last modules) and XLA crashes in a later
    compile (a segfault or abort, not a test failure)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def compile_once(tmp_path):
    """JAX's persistent compilation cache, in `tmp_path`, for one test: a program compiled
    again (the same HLO and compile options: the same model trained again from another seed,
    say) loads the executable of its first compile instead of compiling it again. Off again
    after the test."""
    from jax.experimental.compilation_cache import compilation_cache

    options = {
        "jax_compilation_cache_dir": str(tmp_path / "jax_cache"),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    saved = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX decides once per process whether to use a cache
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture
def getkey():
    """A function returning a fresh PRNG key on each call (deterministic per test)."""
    key = jax.random.PRNGKey(0)

    def next_key():
        nonlocal key
        key, sub = jax.random.split(key)
        return sub

    return next_key

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


#: Seconds each of the slowest test files took on 2 CPU cores (`pytest -n 2 --durations=100`,
#: main of 2026-11-26, rounded; the Linen and autocast files estimated; notebooks 05 and 06,
#: test_deepseek and test_gpu_check measured on 2026-11-28). Only their order on the workers
#: is decided from it: see `pytest_collection_modifyitems`.
SLOW_FILES = {
    "tests/test_grouped.py": 385,
    "tests/test_inspect.py": 381,
    "tests/test_scaling_out.py": 360,
    "notebooks/06_flax_linen_unedited.ipynb": 355,
    "notebooks/05_deepseek_v3_in_miniature.ipynb": 305,
    "tests/test_deepseek.py": 300,
    "tests/test_grouped_native.py": 203,
    "tests/test_linen.py": 170,
    "tests/test_expert_parallel.py": 160,
    "tests/test_examples.py": 156,
    "tests/test_scan_and_remat.py": 143,
    "tests/test_sharding.py": 118,
    "tests/test_train_step.py": 107,
    "tests/test_autocast.py": 100,
    "tests/test_kernels.py": 97,
    "tests/test_gpu_check.py": 90,
    "tests/test_multiprocess.py": 87,
    "tests/test_nnx.py": 85,
    "notebooks/04_flax_nnx.ipynb": 76,
    "tests/test_telemetry.py": 71,
    "tests/test_checkpoint.py": 70,
    "tests/test_huggingface.py": 55,
}


def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist worksteal` (the default, pyproject.toml), xdist gives each
    worker a contiguous 1/N of the collected tests and lets an idle worker take the tail of
    another's queue. So that no worker starts a long file last, the slow files (`SLOW_FILES`,
    kept whole: their module fixtures are set up once) are dealt to the workers' shares,
    heaviest first to the least loaded, each share starting with its slow files and filled
    up with the other tests in their usual order."""
    workers = getattr(config.option, "numprocesses", None)
    if config.getoption("dist", "no") != "worksteal" or not isinstance(workers, int):
        return
    if workers < 2 or len(items) < 2 * workers:
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

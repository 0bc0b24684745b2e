import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight CPU devices for the sharding tests (must be set before jax starts).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs the same examples every time (a red run is reproducible); set
# HYPOTHESIS_PROFILE=explore to search new ones.
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, database=None)
settings.register_profile("explore", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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

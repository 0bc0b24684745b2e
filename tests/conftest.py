import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def getkey():
    """A function returning a fresh PRNG key on each call (deterministic per test)."""
    key = jax.random.PRNGKey(0)

    def next_key():
        nonlocal key
        key, sub = jax.random.split(key)
        return sub

    return next_key

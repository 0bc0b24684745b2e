"""The example GPT (fp8jax.examples.gpt) and its data (fp8jax.examples.data) against
independent references: NumPy float64 math, the corpus read from its SQLite file."""

import jax
import jax.numpy as jnp
import pytest

from fp8jax.examples.gpt import GPT, GPTConfig


def test_gpt_refuses_a_sequence_longer_than_its_position_table():
    """6 tokens through a GPT of context 4 gave logits (6, vocab): JAX clamps the position
    lookup, so tokens 4 and 5 silently got position 3's embedding."""
    model = GPT(GPTConfig(vocab=8, layers=1, width=8, heads=2, context=4), key=jax.random.key(0))
    assert model(jnp.arange(4)).shape == (4, 8)
    with pytest.raises(ValueError, match=r"shape \(6,\).*at most 4 tokens"):
        model(jnp.arange(6))
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*one sequence"):
        model(jnp.zeros((2, 3), jnp.int32))

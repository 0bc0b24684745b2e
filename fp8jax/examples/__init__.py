"""Runnable examples: `python -m fp8jax.examples.<name>`."""

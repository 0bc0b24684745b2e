"""The FP8 GEMMs as `jax.custom_vjp`s: forward, dgrad and wgrad of dense (`dense.py`) and
grouped (`grouped.py`) GEMMs, with their batching rules. Above recipes and kernels."""

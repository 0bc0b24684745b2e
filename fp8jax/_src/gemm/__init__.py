"""The FP8 GEMMs: forward, dgrad and wgrad of dense (`dense.py`) and grouped (`grouped.py`,
its ragged dots in `grouped_dots.py`) GEMMs, in one shared `jax.custom_vjp` (`vjp.py`) with
shared batching rules (`batching.py`). Above recipes and kernels."""

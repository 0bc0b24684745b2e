"""The stateful FP8 ops: `Fp8DotGeneral` and `Fp8RaggedDot` (both an `AbstractFp8Op`, `base.py`),
drop-in for `lax.dot_general` and `lax.ragged_dot`, carrying their scales and histories. Above
the GEMMs."""

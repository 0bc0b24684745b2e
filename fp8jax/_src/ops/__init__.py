"""The stateful FP8 ops: `Fp8DotGeneral` and `Fp8RaggedDot` (both an `AbstractFp8Op`, `base.py`),
drop-in for `lax.dot_general` and `lax.ragged_dot`, carrying their scales and histories, and
delayed scaling's warm start over them (`warm_start.py`, for the train steps of Equinox and
NNX alike). Above the GEMMs."""

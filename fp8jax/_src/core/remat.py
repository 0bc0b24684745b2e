"""`jax.checkpoint` policies for FP8 layers.

Inside `jax.checkpoint` (Equinox: `eqx.filter_checkpoint`), a policy decides which
intermediate values the backward pass may keep. JAX's policies look at primitives: an FP8
GEMM is a custom rule, not a `dot_general`, so `jax.checkpoint_policies.dots_saveable` saves
none of fp8jax's GEMMs (they are recomputed in the backward pass). fp8jax names what its
GEMMs produce instead, and offers two policies on those names:

- [`fp8jax.save_fp8_operands`][]: keep the quantized operands of every FP8 GEMM (data and
  scales, 1 byte per element) and recompute everything else: the smallest residuals that
  spare the backward pass from quantizing again.
- [`fp8jax.fp8_dots_saveable`][]: `dots_saveable` extended to FP8 GEMMs: keep the outputs of
  every GEMM, FP8 or not, as a BF16 model under `dots_saveable` would.

```python
block = eqx.filter_checkpoint(block, policy=fp8jax.save_fp8_operands)
```
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

#: The name given to the quantized operands of every FP8 GEMM.
FP8_OPERANDS = "fp8jax_fp8_operands"
#: The name given to the output of every FP8 GEMM's forward.
FP8_OUTPUTS = "fp8jax_gemm_outputs"

#: A `jax.checkpoint` policy saving only the FP8 operands of FP8 GEMMs.
save_fp8_operands = jax.checkpoint_policies.save_only_these_names(FP8_OPERANDS)

#: `jax.checkpoint_policies.dots_saveable`, also saving the outputs of FP8 GEMMs.
fp8_dots_saveable = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(FP8_OUTPUTS),
)


def name_fp8_operands(q: Any) -> Any:
    """`q` (a quantized operand: `QTensor`, `QTerms`) with each array named for remat."""
    return jax.tree.map(lambda a: checkpoint_name(a, FP8_OPERANDS), q)


def name_gemm_output(out: Any) -> Any:
    """The output of an FP8 GEMM's forward, named for remat."""
    return checkpoint_name(out, FP8_OUTPUTS)

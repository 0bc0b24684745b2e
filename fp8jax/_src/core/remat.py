"""`jax.checkpoint` policies for FP8 layers.

Inside `jax.checkpoint` (Equinox: `eqx.filter_checkpoint`), a policy decides which
intermediate values the backward pass may keep. JAX's policies look at primitives: an FP8
GEMM is a custom rule, not a `dot_general`, so `jax.checkpoint_policies.dots_saveable` saves
none of fp8jax's GEMMs (they are recomputed in the backward pass). fp8jax names what its
GEMMs produce instead, and offers two policies on those names:

- [`fp8jax.save_fp8_operands`][]: keep the quantized operands of every FP8 GEMM (data and
  scales, 1 byte per element), with the few floats of FP8 state its forward hands its
  backward, and recompute everything else: dgrad and wgrad multiply the saved operands,
  without quantizing again. A GEMM whose output the backward pass needs (before a GELU or
  SiLU, a query or key before attention) runs its forward again from its high-precision
  input, quantizing it again; one whose output only feeds another GEMM or a sum (an output
  projection, an FFN's down projection) does not run again.
- [`fp8jax.fp8_dots_saveable`][]: `dots_saveable` extended to FP8 GEMMs: keep the outputs of
  every FP8 GEMM (dense or grouped) and of the high-precision `dot_general`s (and
  convolutions), as a BF16 model under `dots_saveable` would. Like `dots_saveable`, it does
  not keep a high-precision `lax.ragged_dot`'s (a `GroupedLinear` left out of FP8): that is
  recomputed in the backward pass.

Both also keep what `jax.lax.top_k` returns: an MoE router's choice of experts. The backward
pass recomputes the block, and a recomputation need not be bit-identical to the forward (XLA
may fuse it differently): a token near a tie can go to other experts. Under
`save_fp8_operands` that is worse than a recomputation's usual rounding: the experts' FP8
operands saved from the forward are in the forward's token order, the recomputed routing
gathers and scatters in another, and the backward pass sends gradients to the wrong tokens.
On DeepSeek-V3 in miniature the recomputation changed 0.2 % of the routings, and FP8's
gradient error to float32 went from 9.2 % (no remat) to 12.3 %; with the choices saved, 9.7 %
(issue 40, `benchmarks/deepseek_gap.py remat`). Saving them costs `tokens x k` values and
indices.

```python
block = eqx.filter_checkpoint(block, policy=fp8jax.save_fp8_operands)
```
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

#: The name given to the quantized operands of every FP8 GEMM (and to the FP8 state its forward
#: hands its backward: a few floats).
FP8_OPERANDS = "fp8jax_fp8_operands"
#: The name given to the output of every FP8 GEMM's forward.
FP8_OUTPUTS = "fp8jax_gemm_outputs"


def routing_saveable(prim: Any, *_: Any, **__: Any) -> bool:
    """A `jax.checkpoint` policy saving the outputs of `jax.lax.top_k` (a router's choices)."""
    return prim is jax.lax.top_k_p


_SAVE_FP8_OPERANDS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(FP8_OPERANDS), routing_saveable
)
_FP8_DOTS_SAVEABLE = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(FP8_OUTPUTS),
    ),
    routing_saveable,
)


# Functions of their own, not JAX's combined policies themselves: `help()` and the API
# reference show these docstrings and names, where JAX's closure has neither.
def save_fp8_operands(prim: Any, *avals: Any, **params: Any) -> bool:
    """A `jax.checkpoint` policy saving only the FP8 operands of FP8 GEMMs (data and scales, 1
    byte per element), with the FP8 state their forward hands their backward, and the choices
    of `jax.lax.top_k` (an MoE router's): dgrad and wgrad multiply the saved operands; a GEMM
    whose output the backward needs (before a GELU) runs its forward again from its
    high-precision input. `eqx.filter_checkpoint(block, policy=fp8jax.save_fp8_operands)`."""
    return _SAVE_FP8_OPERANDS(prim, *avals, **params)


def fp8_dots_saveable(prim: Any, *avals: Any, **params: Any) -> bool:
    """`jax.checkpoint_policies.dots_saveable` (`dot_general`s and convolutions, not
    `lax.ragged_dot`) extended to FP8 GEMMs: a `jax.checkpoint` policy saving the outputs of
    every FP8 GEMM, dense or grouped, and of the high-precision `dot_general`s, as a BF16 model
    under `dots_saveable` would, and the choices of `jax.lax.top_k` (an MoE router's)."""
    return _FP8_DOTS_SAVEABLE(prim, *avals, **params)


def name_fp8_operands(q: Any) -> Any:
    """`q` (a quantized operand: `QTensor`, `QTerms`) with each array named for remat."""
    return jax.tree.map(lambda a: checkpoint_name(a, FP8_OPERANDS), q)


def name_gemm_output(out: Any) -> Any:
    """The output of an FP8 GEMM's forward, named for remat."""
    return checkpoint_name(out, FP8_OUTPUTS)

"""`Fp8MoELinear`: Haliax's `MoELinear` (named expert weights) with an FP8 grouped GEMM.

`haliax.nn.MoELinear` calls `jax.lax.ragged_dot_general` itself and has no `dot_general` to
inject into; [`fp8jax.fp8_linear_layers`][] replaces it by this layer, with the same weight,
bias and axes and the same call, whose grouped GEMM is an [`fp8jax.Fp8RaggedDot`][]. Haliax
is imported when the layer runs, never before: it is an optional extra."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp

from ..gemm.exchange import ExpertExchange
from ..ops.ragged_dot import Fp8RaggedDot


class Fp8MoELinear(eqx.Module):
    """`haliax.nn.MoELinear` computed as FP8 grouped GEMMs: `inputs (..., In)` with
    `group_sizes (Experts)` tokens per expert (rows sorted by expert) give `(..., Out)`.

    It takes more than `MoELinear`'s `(Batch, In)`: any number of other axes, `In` anywhere.
    The other axes, in their order, flattened, are the rows; the output has them in that
    order, then `Out`. (`MoELinear` refuses a second batch axis, and `In` not last.)

    Made by [`fp8jax.fp8_linear_layers`][] from a `MoELinear` (weight `(Experts, In, Out)`
    or, `out_first`, `(Experts, Out, In)`; one `In` and one `Out` axis); `ragged_dot` is the
    [`fp8jax.Fp8RaggedDot`][] (a kernel scale per expert). `use_gmm` is not kept: the FP8
    grouped GEMM replaces the GEMM kernel it chose.
    """

    weight: Any
    bias: Any
    ragged_dot: Fp8RaggedDot
    Experts: Any = eqx.field(static=True)
    In: Any = eqx.field(static=True)
    Out: Any = eqx.field(static=True)

    def __call__(self, inputs: Any, group_sizes: Any, *, key: Any = None) -> Any:
        """**Arguments:** as `MoELinear`'s: `inputs` a `NamedArray` with the `In` axis, its
        rows (the other axes, flattened in order) sorted by expert; `group_sizes` a
        `NamedArray` over `Experts`. `key` is unused."""
        import haliax as hax

        del key
        self._check_args(hax, inputs, group_sizes)
        x = inputs.rearrange((..., self.In))
        rows = x.array.reshape(-1, self.In.size)
        weight = self.weight.rearrange((self.Experts, self.In, self.Out)).array
        sizes = group_sizes.rearrange((..., self.Experts)).array
        out = self.ragged_dot(rows, weight, sizes)
        out = jnp.reshape(out, x.array.shape[:-1] + (self.Out.size,))
        q = hax.named(out, hax.replace_axis(x.axes, self.In, self.Out))
        if self.bias is not None:
            q = q + self.bias
        return hax.auto_sharded(q)

    @property
    def out_first(self) -> bool:
        """Whether the weight is `(Experts, Out, In)` (as `MoELinear.out_first`; read from
        its last axis, so also for a stack of layers)."""
        return self.weight.axes[-1] != self.Out

    def _check_args(self, hax: Any, inputs: Any, group_sizes: Any) -> None:
        """Refuse arguments that are not `NamedArray`s (an `ExpertExchange` naming the layers
        that take it), group sizes without the `Experts` axis, and inputs without the
        layer's `In` axis, or with one of another size: their rows would be cut at the wrong
        width."""
        where = f"Fp8MoELinear {self.ragged_dot.name!r}" if self.ragged_dot.name else "Fp8MoELinear"
        if isinstance(group_sizes, ExpertExchange):
            raise TypeError(
                f"{where}: group_sizes is an fp8jax.ExpertExchange, which fp8jax.GroupedLinear "
                "layers take (their experts split by fp8jax.expert_specs inside shard_map); a "
                "Haliax model splits its experts by its axis mapping (e.g. "
                f"{{{self.Experts.name!r}: {group_sizes.axis_name!r}}}) and gives this layer "
                f"group_sizes, a haliax NamedArray over {self.Experts.name}({self.Experts.size})."
            )
        for arg, value, what in (
            ("inputs", inputs, f"with the In axis {self.In.name}({self.In.size})"),
            ("group_sizes", group_sizes, f"over {self.Experts.name}({self.Experts.size})"),
        ):
            if not isinstance(value, hax.NamedArray):
                raise TypeError(
                    f"{where}: {arg} is a {type(value).__name__}; should be a haliax "
                    f"NamedArray {what}, as for haliax.nn.MoELinear."
                )
        if self.Experts.name not in {axis.name for axis in group_sizes.axes}:
            raise ValueError(
                f"{where}: group_sizes have axes {group_sizes.axes} and no axis "
                f"{self.Experts.name}; should be over the layer's Experts axis "
                f"{self.Experts.name}({self.Experts.size})."
            )
        sizes = {axis.name: axis.size for axis in inputs.axes}
        if self.In.name not in sizes:
            raise ValueError(
                f"{where}: inputs have axes {inputs.axes} and no axis {self.In.name}; should "
                f"have the layer's In axis {self.In.name}({self.In.size})."
            )
        if sizes[self.In.name] != self.In.size:
            raise ValueError(
                f"{where}: inputs have axis {self.In.name} of size {sizes[self.In.name]}; "
                f"should be the layer's In axis {self.In.name}({self.In.size})."
            )

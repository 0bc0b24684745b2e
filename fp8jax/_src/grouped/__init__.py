"""FP8 grouped GEMMs for mixtures of experts: [`fp8jax.Fp8RaggedDot`][] (the GEMM, with its
per-expert state) and [`fp8jax.GroupedLinear`][] (the experts' stacked Linears)."""

from __future__ import annotations

from .nn import GroupedLinear
from .ragged_dot import Fp8RaggedDot

__all__ = ["Fp8RaggedDot", "GroupedLinear"]

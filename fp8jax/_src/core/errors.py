"""Typed errors that a higher layer may reword: an adapter (Flax NNX) catches them by type
and says the same in its framework's terms, instead of matching message text."""

from __future__ import annotations


class Fp8StateError(ValueError):
    """A misuse of a layer's FP8 state under differentiation (a `ValueError`)."""

    #: The layer's name, or "" for a layer without one.
    layer_name: str

    def __init__(self, message: str, layer_name: str = "") -> None:
        super().__init__(message)
        self.layer_name = layer_name


class StateUsedTwiceError(Fp8StateError):
    """One layer's FP8 state entered two GEMMs under one plain gradient, which would sum
    its two new states instead of keeping the larger."""


class StateNotDifferentiatedError(Fp8StateError):
    """A layer is differentiated but its FP8 state is not, so its new scales and amax
    history could never leave the step."""

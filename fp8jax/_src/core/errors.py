"""Typed errors that a higher layer may reword: an adapter (Flax NNX) catches them by type
and says the same in its framework's terms (`reword_state_error`), instead of matching message
text."""

from __future__ import annotations

import dataclasses


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
    history (or error feedback) could never leave the step."""

    #: What would go wrong, in the recipe's words ("" when not known).
    consequence: str

    def __init__(self, message: str, layer_name: str = "", consequence: str = "") -> None:
        super().__init__(message, layer_name)
        self.consequence = consequence


class OperandShapeError(ValueError, TypeError):
    """Operands (or `dimension_numbers`) whose shapes an FP8 GEMM cannot take. Both a
    `ValueError`, as fp8jax has always raised, and a `TypeError`, as `lax.dot_general` and
    `lax.ragged_dot` raise for the same input: code that catches either keeps working when
    they are swapped for [`fp8jax.Fp8DotGeneral`][] or [`fp8jax.Fp8RaggedDot`][]."""


@dataclasses.dataclass(frozen=True)
class StateErrorWording:
    """How a framework's adapter words the state errors (the Equinox layer's advice is
    Equinox's): the sentences are shared, these are the framework's parts of them."""

    #: The layer when it has no name, e.g. "An Fp8NnxDotGeneral".
    unnamed: str
    #: The ways a layer runs twice, e.g. "a shared module, a loop".
    reuse: str
    #: The plain gradient that would sum the two uses, e.g. "jax.grad".
    grad: str
    #: The clause that says what combines the uses by max, e.g. "Differentiate with
    #: fp8jax.filter_value_and_grad".
    combine: str
    #: What the FP8 state is in the framework, e.g. "fp8jax.Fp8State".
    state: str
    #: What follows "leave the step as the state's gradient", from its punctuation on: how
    #: to differentiate the state along with the rest.
    differentiate: str


def reword_state_error(
    error: Fp8StateError, name: str, wording: StateErrorWording
) -> Fp8StateError:
    """`error` again, of its type and for the layer `name` ("" for none), with its message
    in a framework's `wording`: raise it `from error`. An error not of a known kind keeps
    its message."""
    layer = f"FP8 layer {name!r}" if name else wording.unnamed
    if isinstance(error, StateUsedTwiceError):
        message = (
            f"{layer} runs twice in one differentiated step ({wording.reuse}) under "
            f"{wording.grad}, which would add its two amaxes and scales instead of keeping the "
            "larger: JAX sums the gradients of a value used twice, and FP8 state leaves the "
            f"step through its gradient. {wording.combine}, which combines the uses by max."
        )
    elif isinstance(error, StateNotDifferentiatedError):
        message = (
            f"{layer} is differentiated, but its FP8 state ({wording.state}) is not: its new "
            "state leaves the step as the state's gradient"
            f"{wording.differentiate}"
        )
        if error.consequence:
            message = f"{message} {error.consequence}"
        return type(error)(message, name, error.consequence)
    else:
        message = str(error)
    return type(error)(message, name)

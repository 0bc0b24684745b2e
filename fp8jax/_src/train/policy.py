"""Mixed-precision policies: which dtype parameters are stored, computed and returned in.

A [`fp8jax.Policy`][] names three dtypes (the JMP design) and casts pytrees to them. FP8 state
([`fp8jax.OverwriteWithGradient`][] modules, NNX's [`fp8jax.Fp8State`][]) is never cast: its
scales and amax histories stay float32 whatever the policy, and the FP8 GEMMs choose their own
formats.

```python
policy = fp8jax.Policy.from_string("params=float32,compute=bfloat16,output=float32")
y = policy.cast_to_output(policy.cast_to_compute(model)(policy.cast_to_compute(x)))
```
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..core.formats import float_dtype
from ..core.updates import is_fp8_state, is_overwrite
from ..layers.grouped import GroupedLinear
from ..layers.linear import Linear
from ..ops.dot_general import Fp8DotGeneral
from ..ops.ragged_dot import Fp8RaggedDot

T = TypeVar("T")

_KEY_ALIASES: dict[str, str] = {
    "params": "param_dtype",
    "param": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}
_ACCEPTED_KEYS = "params (param, p), compute (c), output (o)"
_FIELD_KEYS = {"param_dtype": "params", "compute_dtype": "compute", "output_dtype": "output"}
_EXAMPLE = "'params=float32,compute=bfloat16,output=float32'"


def _is_floating_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) and jnp.issubdtype(
        x.dtype, jnp.floating
    )


#: The layers whose weight a compute cast may leave wider: the field of their GEMM, and the
#: FP8 op that quantizes a master there.
_FP8_GEMMS: dict[type, tuple[str, type]] = {
    Linear: ("dot_general", Fp8DotGeneral),
    GroupedLinear: ("ragged_dot", Fp8RaggedDot),
}


def _is_node(x: Any) -> bool:
    # FP8 state: fp8jax's and Haliax's modules, and NNX's `Fp8State` variables (an
    # `nnx.split` state holds those, not the modules).
    return is_fp8_state(x) or isinstance(x, tuple(_FP8_GEMMS))


def _cast_layer(layer: Linear | GroupedLinear, dtype: np.dtype, masters: bool) -> Any:
    """`layer` cast to `dtype`; with `masters`, an FP8 layer's wider weight kept as it is and
    the layer told to compute in `dtype` (its `compute_dtype`)."""
    weight = layer.weight
    field, fp8_op = next(v for kind, v in _FP8_GEMMS.items() if isinstance(layer, kind))
    keep = (
        masters
        and isinstance(getattr(layer, field), fp8_op)
        and _is_floating_array(weight)
        and weight.dtype.itemsize > dtype.itemsize
    )
    cast = jax.tree.map(lambda x: _cast_floating(x, dtype), layer, is_leaf=is_overwrite)
    if keep:
        cast = eqx.tree_at(lambda m: m.weight, cast, weight)
    want = dtype if keep else None
    if cast.compute_dtype == want or not hasattr(weight, "shape"):
        return cast
    return cast.with_compute_dtype(want)


def _is_variable(x: Any) -> bool:
    """A framework's mutable variable of FP8 state (NNX's `Fp8State`)."""
    return is_fp8_state(x) and not is_overwrite(x)


def _unshared(state: T) -> T:
    """FP8 state as it is, but its mutable variables (NNX's `Fp8State`, alone or in an FP8
    op) new ones holding the same arrays, as the cast parameters are new variables: the
    variables themselves would tie the cast model's FP8 state to the original's (training
    one moved both)."""
    if any(map(_is_variable, jax.tree.leaves(state, is_leaf=_is_variable))):
        return jax.tree.map(lambda a: a, state)
    return state


def _cast_floating(tree: T, dtype: np.dtype, masters: bool = False) -> T:
    """`tree` with its floating array leaves in `dtype`; FP8 state and the rest as they were;
    with `masters`, FP8 layers' wider weights too (`_cast_layer`)."""

    def cast(x: Any) -> Any:
        if isinstance(x, tuple(_FP8_GEMMS)):
            return _cast_layer(x, dtype, masters)
        if is_fp8_state(x):
            return _unshared(x)
        if not _is_floating_array(x) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree, is_leaf=_is_node)


def _refuse_bare_dtype(spec: str) -> None:
    """Raise for a spec that is one dtype (jmp's `"bf16"`: all three dtypes), naming the two
    policies it may mean; anything else is left to the pair parser's message."""
    try:
        dtype = float_dtype(spec, "spec")
    except ValueError:
        return
    name = spec.strip()
    raise ValueError(
        f"Policy.from_string: {spec!r} is a dtype ({dtype.name}), not key=dtype pairs. For "
        f"all three dtypes in it (jmp's reading), {f'params={name}'!r}; for float32 "
        f"parameters and outputs around a compute in it, {f'compute={name}'!r}."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """The dtypes of a mixed-precision model: stored parameters, computation and outputs.

    Keep master weights in `param_dtype` (float32), cast them to `compute_dtype` (bfloat16) for
    the step, and return results in `output_dtype`. The casts touch floating-point arrays only:
    FP8 state ([`fp8jax.OverwriteWithGradient`][] modules, such as [`fp8jax.Fp8DotGeneral`][],
    and the [`fp8jax.Fp8State`][] variables of an NNX model's `nnx.state`),
    integer and boolean arrays, Python numbers and other non-array leaves are left as they are
    (an NNX model's `Fp8State`s as new variables holding the same arrays, as its cast Params
    are: training the cast model leaves the original's FP8 state alone).

    **Arguments:**

    - `param_dtype`: the dtype parameters are stored and updated in.
    - `compute_dtype`: the dtype the forward and backward passes run in.
    - `output_dtype`: the dtype of the model's outputs (e.g. logits for the loss).

    Each is any floating dtype-like (`jnp.bfloat16`, `"bf16"`, `np.float32`) and is stored as a
    `np.dtype`; each defaults to float32. A non-floating dtype, or one JAX has no arrays of
    (NumPy's `longdouble`), raises `ValueError`.

    ```python
    policy = fp8jax.Policy(compute_dtype=jnp.bfloat16)
    model_bf16 = policy.cast_to_compute(model)   # FP8 state stays float32
    ```
    """

    param_dtype: np.dtype = np.dtype(np.float32)
    compute_dtype: np.dtype = np.dtype(np.float32)
    output_dtype: np.dtype = np.dtype(np.float32)

    def __post_init__(self) -> None:
        for name in _FIELD_KEYS:
            object.__setattr__(self, name, float_dtype(getattr(self, name), f"Policy {name}"))

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """The policy described by `spec`, e.g. `"params=float32,compute=bfloat16"`.

        **Arguments:**

        - `spec`: comma-separated `key=dtype` pairs. Keys: `params` (`param`, `p`), `compute`
          (`c`), `output` (`o`). Dtypes: `float32` (`f32`, `full`), `bfloat16` (`bf16`),
          `float16` (`f16`, `half`), or `float64` (JAX's floats of 16 bits or more). Whitespace
          and letter case are ignored. A missing `params` is float32; a missing `compute` or
          `output` is the param dtype. `str(policy)` gives back a spec of this form.

        **Raises:** `ValueError` for an empty spec, a piece that is not `key=dtype`, an unknown
        or repeated key, or a dtype that is not floating point, naming the offending piece; a
        bare dtype (jmp's `"bf16"`, all three dtypes) is refused too, with both policies it
        may mean spelled out: `"params=bf16"` (all three), `"compute=bf16"` (float32 masters).

        ```python
        >>> fp8jax.Policy.from_string("p=f32,c=bf16")
        Policy(param_dtype=dtype('float32'), compute_dtype=dtype(bfloat16), output_dtype=dtype('float32'))
        ```
        """  # noqa: E501
        if not isinstance(spec, str):
            raise TypeError(
                f"Policy.from_string: spec={spec!r} should be a string like {_EXAMPLE}."
            )
        if not spec.strip():
            raise ValueError(f"Policy.from_string: empty spec; expected e.g. {_EXAMPLE}.")
        if "=" not in spec:
            _refuse_bare_dtype(spec)
        found: dict[str, tuple[str, np.dtype]] = {}
        for piece in spec.split(","):
            key, sep, value = piece.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value or "=" in value:
                raise ValueError(
                    f"Policy.from_string: {piece.strip()!r} in {spec!r} is not a key=dtype pair; "
                    f"expected e.g. {_EXAMPLE}."
                )
            field = _KEY_ALIASES.get(key.lower())
            if field is None:
                raise ValueError(
                    f"Policy.from_string: unknown key {key!r} in {spec!r}; accepted keys: "
                    f"{_ACCEPTED_KEYS}."
                )
            if field in found:
                raise ValueError(
                    f"Policy.from_string: {found[field][0]!r} and {piece.strip()!r} in {spec!r} "
                    f"both set the {_FIELD_KEYS[field]} dtype; give each key once."
                )
            found[field] = (piece.strip(), float_dtype(value, f"Policy.from_string: {key}"))
        param = found["param_dtype"][1] if "param_dtype" in found else np.dtype(np.float32)
        dtypes = {name: found[name][1] if name in found else param for name in _FIELD_KEYS}
        return cls(**dtypes)

    def __str__(self) -> str:
        return ",".join(f"{key}={getattr(self, name).name}" for name, key in _FIELD_KEYS.items())

    def cast_to_param(self, tree: T) -> T:
        """`tree` with its floating-point arrays in `param_dtype`; FP8 state untouched.

        ```python
        model = policy.cast_to_param(model)
        ```
        """
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """`tree` with its floating-point arrays in `compute_dtype`; FP8 state untouched, and
        the weights of FP8 layers ([`fp8jax.Linear`][]s with an [`fp8jax.Fp8DotGeneral`][],
        [`fp8jax.GroupedLinear`][]s with an [`fp8jax.Fp8RaggedDot`][]) left in their wider
        `param_dtype`: the FP8 GEMM quantizes each from its master in one
        pass, where a cast would write a BF16 copy for the quantization to read again (4
        bytes a weight saved, and a kernel), and writes its output, and the weight's gradient,
        in `compute_dtype` as the cast copy's would be (the layer's `compute_dtype`). The FP8
        values are the master's own, rounded once.

        ```python
        logits = policy.cast_to_compute(model)(policy.cast_to_compute(x))
        ```
        """
        return _cast_floating(tree, self.compute_dtype, masters=True)

    def cast_to_output(self, tree: T) -> T:
        """`tree` with its floating-point arrays in `output_dtype`; FP8 state untouched.

        ```python
        logits = policy.cast_to_output(logits)
        ```
        """
        return _cast_floating(tree, self.output_dtype)

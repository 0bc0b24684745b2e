"""FP8 for Linen modules that are Linears without being `nn.Dense`: a module that multiplies
its input by its own `kernel` parameter through `lax.dot_general`, `jnp.dot`, `@` or
`jnp.einsum` (Hugging Face's `FlaxConv1D`, a library's own projection).

Such a module has no `dot_general` to swap. Its call is traced to a jaxpr as a function of
its parameters and inputs (`module.apply` of an unbound clone), the GEMMs whose right
operand is the kernel (or a view of it: a transpose, a cast) are found by following the
kernel through the jaxpr, and the jaxpr is evaluated again with those GEMMs answered by the
layer's FP8 state, as `fp8jax.fp8_autocast` answers its GEMMs. Everything else in the call
(bias, casts, reshapes) runs as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax.core import meta
from flax.linen import module as linen_module

from ..autocast import trace_call
from ..interpret import Interpreter, KernelChoice
from ..roles import gemm_operands, gemm_rhs_layouts

#: The parameter a module multiplies its input by, to be converted as a Linear.
KERNEL: str = "kernel"


def has_kernel(module: Any) -> bool:
    """Whether a bound module holds a `kernel` parameter of its own (two axes or more; one
    with partitioning metadata counts as its value)."""
    if not module.has_variable("params", KERNEL):
        return False
    return jax.numpy.ndim(meta.unbox(module.get_variable("params", KERNEL))) >= 2


def _capturing() -> Callable[[Any, str], bool] | None:
    """The `capture_intermediates` filter of the Linen `apply` running (Flax keeps it in a
    private stack, `flax.linen.module._context.capture_stack`); `None` when not capturing."""
    stack = getattr(getattr(linen_module, "_context", None), "capture_stack", None)
    if not stack or not stack[-1]:
        return None
    return linen_module.capture_call_intermediates if stack[-1] is True else stack[-1]


def kernel_call(
    module: Any,
    args: tuple,
    kwargs: dict,
    make_op: Callable[[Any, Any], Callable],
    collection: str,
) -> Any:
    """`module(*args, **kwargs)` with each GEMM on its kernel answered by `make_op(eqn,
    layout)` (an op with `lax.dot_general`'s signature; `eqn` gives the GEMM's shapes,
    `layout` its right operand as the kernel's (free, contracted) axes, `None` where a view
    other than a transpose or cast hides them: see `roles.gemm_rhs_layouts`).

    Raises `ValueError` if no GEMM of the call takes the kernel as its right operand.
    """
    # Unboxed (`nn.with_partitioning` metadata gone, its sharding constraint applied, as
    # Linen's `param` does): the kernel is then the leaf at `params/kernel`.
    variables = meta.unbox({k: v for k, v in module.variables.items() if k != collection})
    unbound = module.clone(parent=None)
    scope = module.scope
    # The call's random streams (a Dropout in it) and its writes (a counter, `sow`) are the
    # bound module's: keys drawn from its streams, the collections it may write mutable.
    rngs = {name: module.make_rng(name) for name in sorted(scope.rngs)}
    # `capture_intermediates` of the apply running: a nested `apply` turns it off, so the
    # modules inside the call are captured by the outer filter here (the call's own output
    # is captured outside, as Linen captures it).
    outer = _capturing()
    capture = outer and scope.mutable is not False
    flags = {"capture_intermediates": lambda m, n: bool(m.path) and outer(m, n)} if capture else {}

    def fun(variables: Any, rngs: Any, *a: Any, **kw: Any) -> Any:
        result = unbound.apply(variables, *a, rngs=rngs, mutable=scope.mutable, **flags, **kw)
        return (result, {}) if scope.mutable is False else result

    traced = trace_call(fun, (variables, rngs, *args), kwargs)
    owners = []
    for path in traced.paths:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        owners.append(("kernel",) if names == ["0", "0", "params", KERNEL] else None)
    operands = gemm_operands(traced.closed, owners)
    kernel_dots = {i for i, (_, rhs) in operands.items() if rhs == ("kernel",)}
    if not kernel_dots:
        raise ValueError(
            f"Fp8Linen: the {type(module).__name__} at {'.'.join(module.path)!r} holds a "
            f"{KERNEL!r} but no GEMM of its call takes it as its right operand; exclude it "
            "(Fp8Config exclude or targets)."
        )
    layouts = gemm_rhs_layouts(traced.closed, owners)
    choice = KernelChoice(kernel_dots, lambda eqn: make_op(eqn, layouts.get(id(eqn))))
    out, updates = traced.evaluate(Interpreter(choice))
    if not module.is_initializing():  # at init, the module's own call made its variables
        for col, tree in updates.items():
            if col not in ("params", collection):
                for name, value in tree.items():
                    scope.put_variable(col, name, value)
    return out

"""Evaluating a jaxpr again, equation by equation, with chosen GEMMs answered by FP8 ops:
the `Interpreter` under `fp8_autocast` (any function's GEMMs) and under the Linen and NNX
adapters' kernel modules (`KernelChoice`: the GEMMs on a module's own kernel). Every other
equation is bound as JAX would; nested `jit`, `scan`, `while`, `cond` and `checkpoint`
holding a GEMM are rebuilt around the answered GEMMs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, final

import jax
from jax import lax

from ..core import jax_private

#: The primitives whose sub-jaxpr is evaluated in place (a nested `jit`, a call).
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _as_jit(body: Callable[..., list], params: dict) -> Callable[..., Any]:
    """`body`, a nested jit's reinterpreted jaxpr, jitted with that jit's shardings where it
    was given any (inlined, they would be lost); else `body` itself, inlined."""
    ins, outs = params.get("in_shardings", ()), params.get("out_shardings", ())
    if not any(isinstance(s, jax.sharding.Sharding) for s in (*ins, *outs)):
        return body
    return jax.jit(lambda *a: tuple(body(*a)), in_shardings=ins, out_shardings=outs)


def gemm_equations(jaxprs: Iterable[Any]) -> Iterator[Any]:
    """Every `dot_general` and `ragged_dot_general` equation of `jaxprs` (open or closed), at
    any depth, lazily: whether an equation's sub-jaxprs hold a GEMM (the interpreter) and how
    many of them it leaves (autocast) are one walk."""
    for jaxpr in jaxprs:
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                yield eqn
            yield from gemm_equations(jax_private.sub_jaxprs(eqn))


def _platform_dependent(branches: list, platforms: tuple, args: list) -> list:
    """A `lax.platform_dependent` choice (a `cond` whose branches name their platforms,
    `None` the default) rebuilt as one: a `lax.switch` would lower every branch for every
    platform, a CUDA-only kernel for a CPU too."""
    per_platform: dict = {}
    for branch, names in zip(branches, platforms, strict=True):
        for name in ("default",) if names is None else names:
            per_platform.setdefault(name, branch)
    return lax.platform_dependent(*args, **per_platform)


@dataclasses.dataclass(frozen=True)
class Interpreter:
    """Evaluates a jaxpr with the chosen GEMMs in FP8: `choice` has `dot_op(eqn, scope)` and
    `ragged_op(eqn, scope)`, each the FP8 op answering that equation or `None` (kept as
    traced), and `held(subs)`, told of the jaxprs of an equation bound as traced whose GEMMs
    it cannot reach. Shared with the Linen adapter, which answers the GEMMs on a module's
    kernel."""

    choice: Any

    def run(self, jaxpr: Any, consts: list, args: list, path: str) -> list:
        env: dict = {}

        def read(v: Any) -> Any:
            return v.val if jax_private.is_literal(v) else env[v]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            scope = "/".join(s for s in (path, jax_private.scope_of(eqn)) if s)
            with jax_private.equation_context(eqn):
                outvals = self.equation(eqn, invals, scope)
            for var, value in zip(eqn.outvars, outvals, strict=True):
                env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def closed(self, sub: Any, path: str) -> Callable[..., list]:
        jaxpr, consts = jax_private.jaxpr_parts(sub)
        return lambda *args: self.run(jaxpr, consts, list(args), path)

    def equation(self, eqn: Any, invals: list, scope: str) -> list:
        name, params = eqn.primitive.name, eqn.params
        op = None
        if name == "dot_general":
            op = self.choice.dot_op(eqn, scope)
            if op is not None:
                return [self.dot(op, invals, params)]
        if name == "ragged_dot_general":
            op = self.choice.ragged_op(eqn, scope)
            if op is not None:
                lhs, rhs, group_sizes = invals
                return [
                    op(lhs, rhs, group_sizes, params["precision"], params["preferred_element_type"])
                ]
        subs = jax_private.sub_jaxprs(eqn)
        if next(gemm_equations(subs), None) is None:
            return jax_private.bind_equation(eqn, invals)
        if name in _INLINE:
            return _as_jit(self.closed(params[_INLINE[name]], scope), params)(*invals)
        if name == "scan":
            return self.scan(invals, params, scope)
        if name == "while":
            return self.while_loop(invals, params, scope)
        if name == "cond":
            branches = [self.closed(b, scope) for b in params["branches"]]
            if params.get("branches_platforms"):  # each branch lowered for its platforms only
                return _platform_dependent(branches, params["branches_platforms"], invals[1:])
            return lax.switch(invals[0], branches, *invals[1:])
        if name in ("remat", "remat2", "checkpoint"):
            body = self.closed(params["jaxpr"], scope)
            rematted = jax.checkpoint(
                body, prevent_cse=params["prevent_cse"], policy=params["policy"]
            )
            return rematted(*invals)
        # custom_jvp / custom_vjp / shard_map and the rest: their own rules hold their GEMMs,
        # which stay as written.
        self.choice.held(subs)
        return jax_private.bind_equation(eqn, invals)

    def dot(self, op: Callable[..., Any], invals: list, params: dict) -> Any:
        lhs, rhs = invals
        out = op(
            lhs,
            rhs,
            params["dimension_numbers"],
            params["precision"],
            params["preferred_element_type"],
            out_sharding=params.get("out_sharding"),
        )
        return out

    def scan(self, invals: list, params: dict, scope: str) -> list:
        n_consts, n_carry = jax_private.scan_counts(params)
        consts, init, xs = (
            invals[:n_consts],
            invals[n_consts : n_consts + n_carry],
            invals[n_consts + n_carry :],
        )
        body = self.closed(params["jaxpr"], scope)

        def step(carry: list, x: list) -> tuple[list, list]:
            outs = body(*consts, *carry, *x)
            return outs[:n_carry], outs[n_carry:]

        carry, ys = lax.scan(
            step,
            init,
            xs,
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry, *ys]

    def while_loop(self, invals: list, params: dict, scope: str) -> list:
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        cond, body = (
            self.closed(params["cond_jaxpr"], scope),
            self.closed(params["body_jaxpr"], scope),
        )
        return lax.while_loop(
            lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), init
        )


@final
class KernelChoice:
    """An `Interpreter` choice answering the `dot_general`s listed by `id` in `kernel_dots`
    (those on a module's own kernel) with `make_op(eqn)`, every other GEMM as traced. The
    Linen and NNX adapters' kernel modules share it."""

    def __init__(self, kernel_dots: set[int], make_op: Callable[[Any], Callable]) -> None:
        self.kernel_dots = kernel_dots
        self.make_op = make_op

    def dot_op(self, eqn: Any, scope: str) -> Callable | None:
        return self.make_op(eqn) if id(eqn) in self.kernel_dots else None

    def ragged_op(self, eqn: Any, scope: str) -> Callable | None:
        return None

    def held(self, subs: list) -> None:
        """GEMMs in `subs`, an equation's jaxprs kept as written (a `custom_vjp`'s): none
        is its kernel's."""

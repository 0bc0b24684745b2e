"""The JAX internals fp8jax relies on (fp8jax/_src/jax_private.py). A failure here means JAX
moved them: fix that module, not the tests."""

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax._src import jax_private


@jax.custom_vjp
def _record(x, state):
    return x


def _record_fwd(x, state):
    return x, jnp.max(jnp.abs(x))


def _record_bwd(amax, g):
    return g, jax_private.to_max_combining(amax)


_record.defvjp(_record_fwd, _record_bwd)


def test_cotangents_combine_by_max():
    def loss(state, xs):
        state = jax_private.to_max_combining(state)
        direct = jnp.sum(_record(xs[0], state)) + jnp.sum(_record(xs[1], state))

        def body(total, x):
            return total + jnp.sum(_record(x, state)), None

        return direct + lax.scan(body, 0.0, xs[2:])[0]

    xs = jnp.array([[1.0, -3.0], [2.0, 0.5], [-7.0, 1.0], [0.0, 4.0]])
    grad = jax.jit(jax.grad(loss))(jnp.float32(0.0), xs)
    assert grad.dtype == jnp.float32 and float(grad) == 7.0


def test_round_trip_and_zero():
    x = jnp.array([0.0, 2.5, 1e30], jnp.float32)

    @jax.jit
    def round_trip(x):
        m = jax_private.to_max_combining(x)
        assert jax_private.is_max_combining(m) and not jax_private.is_max_combining(x)
        zero = jax_private.MAX_F32._rules.zero(jax_private.MAX_F32)
        return jax_private.to_float32(m), jax_private.to_float32(zero)

    back, zero = round_trip(x)
    assert (back == x).all() and float(zero) == float("-inf")


def test_batch_tracer_is_recognised():
    seen = []
    jax.vmap(lambda x: seen.append(jax_private.is_batch_tracer(x)) or x)(jnp.ones(3))
    jax.jit(lambda x: seen.append(jax_private.is_batch_tracer(x)) or x)(jnp.ones(3))
    assert seen == [True, False]
    assert not jax_private.is_batch_tracer(jnp.ones(3))


def test_varying_axes_inside_shard_map():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    seen = []

    def local(replicated, sharded):
        seen.append((jax_private.varying_axes(replicated), jax_private.varying_axes(sharded)))
        return replicated

    jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(
        jnp.ones(3), jnp.ones(16)
    )
    assert seen == [(frozenset(), frozenset({"data"}))]
    assert jax_private.varying_axes(jnp.ones(3)) == frozenset()

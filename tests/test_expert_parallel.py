"""Expert parallelism: experts split over a mesh axis, tokens dispatched to them (FP8 from an
FP8 layer) and combined back, inside `shard_map`, against the same MoE on one device."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import h100_topology
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax._src.gemm import exchange
from fp8jax._src.kernels import reference
from fp8jax.examples.moe_model import MoE

EXPERTS, WIDTH, HIDDEN, TOP_K = 16, 128, 256, 2


def _mesh(shape: dict[str, int], axis_type=jax.sharding.AxisType.Auto):
    assert jax.device_count() >= 8, "tests expect 8 CPU devices (see conftest.py)"
    axis_types = (axis_type,) * len(shape)
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=axis_types)


def _routed(tokens: int, seed: int = 0):
    """Tokens' experts with uneven loads and two experts that get none."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(EXPERTS, 0.5))
    p[[1, 9]] = 0.0
    p /= p.sum()
    chosen = np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=p) for _ in range(tokens)])
    return chosen.astype(np.int32), rng.random((tokens, TOP_K)).astype(np.float32)


# --- the exchange ----------------------------------------------------------------------------


def _numpy_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv):
    """`lax.ragged_all_to_all`'s documented result, device by device."""
    outputs = [o.copy() for o in outputs]
    for i, (x, io, s, oo) in enumerate(zip(operands, in_off, send, out_off, strict=True)):
        for j in range(len(operands)):
            outputs[j][oo[j] : oo[j] + s[j]] = x[io[j] : io[j] + s[j]]
            assert recv[j][i] == s[j]
    return outputs


def test_the_cpu_exchange_is_ragged_all_to_all():
    """XLA:CPU has no ragged all-to-all: the emulation gives the primitive's result."""
    devices, rows = 8, 12
    rng = np.random.default_rng(1)
    send = rng.integers(0, 3, (devices, devices)).astype(np.int32)  # send[i, j]: i -> j
    in_off = np.cumsum(send, axis=1) - send
    out_off = (np.cumsum(send, axis=0) - send).astype(np.int32)  # where i's rows land in j
    recv = send.T.copy()
    x = rng.standard_normal((devices, rows, 3)).astype(np.float32)
    out = np.full((devices, 20, 3), -1.0, np.float32)
    want = _numpy_ragged_all_to_all(list(x), list(out), in_off, send, out_off, recv)
    mesh = _mesh({"e": devices})

    def one(x, out, io, s, oo, r):
        return exchange.ragged_all_to_all(x[0], out[0], io[0], s[0], oo[0], r[0], axis_name="e")[
            None
        ]

    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("e"),) * 6, out_specs=P("e")))
    got = f(x, out, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def _toy_experts(rows, plan, scale):
    """Expert `e` multiplies its rows by `scale[e]` (global expert index)."""
    me = jax.lax.axis_index(plan.axis_name)
    local = plan.group_sizes.shape[0]
    expert = (
        jnp.repeat(jnp.arange(local), plan.group_sizes, total_repeat_length=rows.shape[0])
        + me * local
    )
    return rows * scale[expert].reshape((-1,) + (1,) * (rows.ndim - 1))


@pytest.mark.parametrize(
    ("devices", "capacity"), [(8, None), (8, 40), (4, None), (4, 28), (2, None), (2, 28)]
)
def test_dispatch_and_combine_route_every_token_to_its_experts(devices, capacity):
    """Each token's rows reach its experts' devices, in expert order, and come back summed
    with its weights; the gradient goes back the same way. With a capacity, a device keeps
    the rows that fit (sources in order) and the others come back as zeros. On 2, 4 and 8
    devices (8, 4 and 2 experts each; a capacity under some devices' loads, not all)."""
    tokens = 16
    chosen, weights = _routed(devices * tokens)
    x = np.random.default_rng(2).standard_normal((devices * tokens, 4)).astype(np.float32)
    scale = jnp.arange(1.0, EXPERTS + 1)
    mesh = _mesh({"expert": devices})

    def moe(x, chosen, weights):
        plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert", capacity=capacity)
        return plan.combine(_toy_experts(plan.dispatch(x), plan, scale), weights)

    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")))
    got = np.asarray(f(x, chosen, weights))
    kept = np.ones(chosen.shape, bool)
    if capacity is not None:  # which assignments fit: each device's experts fill in order
        filled = np.zeros(devices, int)
        for d in range(devices):  # source devices in order
            block = chosen[d * tokens : (d + 1) * tokens]
            for dest in range(devices):
                mine = (block // (EXPERTS // devices)) == dest
                n = int(mine.sum())
                fit = max(0, min(n, capacity - filled[dest]))
                # the first `fit` of this source's rows for `dest`, in expert order
                flat = np.flatnonzero(mine.reshape(-1))
                flat = flat[np.argsort(block.reshape(-1)[flat], kind="stable")]
                dropped = flat[fit:]
                kept[d * tokens + dropped // TOP_K, dropped % TOP_K] = False
                filled[dest] += n
        assert 0 < (~kept).sum() < kept.size  # some dropped, not all
    w = np.where(kept, weights, 0.0)
    want = np.einsum("tk,tkf->tf", w, x[:, None, :] * np.asarray(scale)[chosen][..., None])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(f(x, chosen, weights) * want))(x)
    want_grad = want * np.sum(w * np.asarray(scale)[chosen], axis=1, keepdims=True)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


def test_choices_outside_the_experts_are_sent_nowhere():
    """A choice outside `[0, num_experts)` (negative, or too large) adds nothing to its
    token's output, as documented; a negative one was counted as expert 0's."""
    devices, tokens = 4, 8
    chosen, weights = _routed(devices * tokens, seed=5)
    chosen[[0, 9, 17], 0] = [-1, -7, EXPERTS]
    x = np.random.default_rng(6).standard_normal((devices * tokens, 4)).astype(np.float32)
    scale = jnp.arange(1.0, EXPERTS + 1)
    mesh = _mesh({"expert": devices})

    def moe(x, chosen, weights):
        plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert")
        return plan.combine(_toy_experts(plan.dispatch(x), plan, scale), weights)

    specs = (P("expert"),) * 3
    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=specs, out_specs=P("expert")))
    got = np.asarray(f(x, chosen, weights))
    inside = (chosen >= 0) & (chosen < EXPERTS)
    factor = np.where(inside, np.asarray(scale)[np.clip(chosen, 0, EXPERTS - 1)], 0.0)
    want = x * np.sum(weights * factor, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_expert_exchange_names_bad_arguments():
    mesh = _mesh({"expert": 8})

    def plan(experts, n, **kw):
        f = jax.shard_map(
            lambda e: fp8jax.expert_exchange(e, n, "expert", **kw).group_sizes,
            mesh=mesh,
            in_specs=P("expert"),
            out_specs=P("expert"),
        )
        return jax.eval_shape(f, experts)

    experts = jnp.zeros((64, 2), jnp.int32)
    with pytest.raises(ValueError, match="num_experts=12 does not split over the 8"):
        plan(experts, 12)
    with pytest.raises(ValueError, match=r"should be \(tokens, top_k\) integers"):
        plan(experts.astype(jnp.float32), 16)
    with pytest.raises(ValueError, match="capacity=0"):
        plan(experts, 16, capacity=0)
    # No expert per token: taken, and its gradient then divided by top_k = 0.
    with pytest.raises(
        ValueError, match=r"experts \(8, 0\): each token should go to at least one expert"
    ):
        plan(experts[:, :0], 16)
    # An expert count of 0 or below was taken (no experts, or a shape error deep in JAX).
    for bad in (0, -8):
        with pytest.raises(ValueError, match=f"num_experts={bad}: should be an int >= 1"):
            plan(experts, bad)
    with pytest.raises(TypeError, match=r"num_experts=16.0: should be an int >= 1"):
        plan(experts, 16.0)
    # NumPy integers are ints (a capacity computed with NumPy was refused as "not an int").
    assert plan(experts, np.int64(16), capacity=np.int64(20)).shape == (16,)


def test_expert_exchange_takes_nested_lists_as_an_array():
    """Each device's experts given as nested Python lists route as the same array does (a
    list raised AttributeError: 'list' object has no attribute 'ndim'); what is no array of
    integers is refused by name."""
    mesh = _mesh({"expert": 8})
    chosen = [[0, 15], [3, 3], [9, 1]]

    def sizes(experts):
        f = jax.shard_map(
            lambda: fp8jax.expert_exchange(experts, 16, "expert").group_sizes,
            mesh=mesh,
            in_specs=(),
            out_specs=P("expert"),
        )
        return np.asarray(f())

    # Each of the 8 devices sends the same 3 tokens: an expert receives 8 times its count.
    np.testing.assert_array_equal(sizes(chosen), 8 * np.bincount(np.ravel(chosen), minlength=16))
    with pytest.raises(TypeError, match=r"experts=\[\[0, 1\], \[2\]\]: should be"):
        sizes([[0, 1], [2]])


def test_expert_exchange_names_an_axis_name_that_is_not_a_str():
    """Experts split over a tuple of mesh axes were planned, and the exchange then failed
    ("'<' not supported between instances of 'tuple' and 'str'"; an FP8 layer: its recipe's
    axis_names refused, which the user never gave): one mesh axis, named by a str, as
    expert_specs takes."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = jax.shard_map(
        lambda e: fp8jax.expert_exchange(e, 8, ("data", "expert")).group_sizes,
        mesh=mesh,
        in_specs=P(("data", "expert")),
        out_specs=P(("data", "expert")),
    )
    with pytest.raises(TypeError, match=r"axis_name=\('data', 'expert'\): should be"):
        jax.eval_shape(f, jnp.zeros((64, 2), jnp.int32))


def test_expert_exchange_names_an_axis_the_shard_map_does_not_split():
    """A misspelt expert axis, one the `shard_map` leaves Auto (`axis_names={"expert"}`) or a
    call outside `shard_map` raised JAX's bare "unbound axis name: experts": the error now
    names it, with the axes it could be."""
    mesh = _mesh({"data": 2, "expert": 4})

    def plan(axis, **kw):
        f = jax.shard_map(
            lambda e: fp8jax.expert_exchange(e, 8, axis).group_sizes,
            mesh=mesh,
            in_specs=P("expert"),
            out_specs=P("expert"),
            **kw,
        )
        return jax.eval_shape(f, jnp.zeros((64, 2), jnp.int32))

    assert plan("expert").shape == (8,)  # the names as the mesh spells them are taken
    with pytest.raises(ValueError, match=r"axis_name='experts' .* \('data', 'expert'\)"):
        plan("experts")
    with pytest.raises(ValueError, match=r"axis_name='data' .* \('expert',\)"):
        plan("data", axis_names={"expert"})
    with pytest.raises(ValueError, match=r"axis_name='expert' .* \(\)"):
        fp8jax.expert_exchange(jnp.zeros((8, 2), jnp.int32), 8, "expert")


def test_the_exchange_names_arrays_of_other_shapes():
    """dispatch and combine took arrays of any shape and indexed them as the plan's: the
    tokens of another batch (x[:4]), the tokens again in place of the experts' rows, or
    the routing weights transposed ((top_k, tokens)) gave wrong rows (JAX clamps a gather's
    indices) or as many tokens as the weights' first axis, without a word."""
    mesh = _mesh({"expert": 4})
    chosen, weights = _routed(4 * 8, seed=7)  # 8 tokens a device, top-2
    x = np.ones((4 * 8, 3), np.float32)

    def run(fn, *args):
        specs = (P("expert"),) * (len(args) + 1)
        f = jax.shard_map(
            lambda c, *a: fn(fp8jax.expert_exchange(c, EXPERTS, "expert"), *a),
            mesh=mesh,
            in_specs=specs,
            out_specs=P("expert"),
        )
        return jax.eval_shape(f, chosen, *args)

    assert run(lambda plan, x, w: plan.combine(plan.dispatch(x), w), x, weights).shape == x.shape
    with pytest.raises(ValueError, match=r"dispatch: x has 4 rows .* routed 8 tokens"):
        run(lambda plan, x: plan.dispatch(x[:4]), x)
    with pytest.raises(ValueError, match=r"dispatch: x has 9 rows .* routed 8 tokens"):
        run(lambda plan, x: plan.dispatch(jnp.concatenate([x, x[:1]])), x)
    with pytest.raises(ValueError, match=r"combine: y has 8 rows .* capacity \(64\)"):
        run(lambda plan, x, w: plan.combine(x, w), x, weights)
    transposed = np.ascontiguousarray(weights.reshape(4, 8, TOP_K).transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"combine: weights of shape \(2, 8\); .*= \(8, 2\)"):
        run(
            lambda plan, x, w: plan.combine(plan.dispatch(x), w),
            x,
            transposed.reshape(4 * TOP_K, 8),
        )


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_a_layer_whose_experts_are_not_split_over_the_exchanges_axis_is_named(recipe):
    """Experts split over another mesh axis than the exchange's (`expert_specs(params,
    "data")`, the plan over "expert"), or not split at all, with as many per device as the
    plan's: each device multiplied the rows sent to its "expert" index by the experts of its
    "data" index, a wrong result without a word."""
    mesh = _mesh({"data": 2, "expert": 2})
    layer = fp8jax.GroupedLinear(8, 4, 6, key=jax.random.key(0))
    if recipe is not None:
        layer = fp8jax.fp8_linear_layers(layer, fp8jax.Fp8Config(recipe=recipe, exclude=None))
    params, static = eqx.partition(layer, eqx.is_array)
    tokens = P(("data", "expert"))
    chosen = np.tile(np.arange(2, dtype=np.int32), (8, 1))
    x = np.ones((8, 4), np.float32)

    def run(specs, num_experts=8):
        def local(params, x, chosen):
            plan = fp8jax.expert_exchange(chosen, num_experts, "expert")
            return eqx.combine(params, static)(x, plan)

        f = jax.shard_map(local, mesh=mesh, in_specs=(specs, tokens, tokens), out_specs=tokens)
        return jax.eval_shape(f, params, x, chosen)

    assert run(fp8jax.expert_specs(params, "expert")).shape == (4 * 2 * 2 * 2, 6)
    with pytest.raises(ValueError, match=r"not split over the ExpertExchange's mesh axis 'expert'"):
        run(fp8jax.expert_specs(params, "data"))
    with pytest.raises(ValueError, match=r"varies over \(\)"):  # replicated, 8 experts each
        run(P(), num_experts=16)


@pytest.mark.parametrize("recipe", [None, "current"])
def test_no_tokens_go_through_the_exchange(recipe):
    """Devices without tokens (an empty batch): the default capacity was 0 and refused
    ("capacity=0"); the block now gives no rows, in FP8 too, and a gradient of no rows."""
    mesh = _mesh({"expert": 4})
    dot = None if recipe is None else fp8jax.Fp8RaggedDot(recipe, num_experts=8)
    layer = fp8jax.GroupedLinear(8, 32, 16, key=jax.random.key(0), ragged_dot=dot)

    def moe(layer, x, chosen, weights):
        plan = fp8jax.expert_exchange(chosen, 8, "expert")
        return plan.combine(layer(x, plan), weights), plan.group_sizes

    specs = (fp8jax.expert_specs(layer, "expert"), P("expert"), P("expert"), P("expert"))
    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=specs, out_specs=P("expert")))
    chosen, weights = np.zeros((0, TOP_K), np.int32), np.ones((0, TOP_K), np.float32)
    x = np.ones((0, 32), np.float32)
    out, sizes = f(layer, x, chosen, weights)
    assert out.shape == (0, 16)
    np.testing.assert_array_equal(sizes, np.zeros(8))
    grad = jax.grad(lambda x: jnp.sum(f(layer, x, chosen, weights)[0]))(x)
    assert grad.shape == (0, 32)


def _sharded_as_specs(f, specs):
    """`f` taking its arguments resharded as `specs` (`shard_map`'s `in_specs`) says first: on
    a mesh with Explicit axes, JAX 0.12's `shard_map` takes arguments sharded as their specs
    only (JAX 0.11 reshards them itself)."""

    def place(spec, arg):
        return jax.tree.map(lambda a: jax.sharding.reshard(a, spec), arg)

    def sharded(*args):
        specs_ = specs if isinstance(specs, tuple) else (specs,) * len(args)
        is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
        placed = jax.tree.map(
            lambda s, a: a if s is None else place(s, a), specs_, args, is_leaf=is_spec
        )
        return f(*placed)

    return sharded


@pytest.mark.parametrize("axes", ["Auto", "Explicit", "Explicit-split"])
@pytest.mark.parametrize("recipe", [None, "current", "blockwise"])
def test_a_shard_map_over_the_expert_axis_alone_exchanges_as_over_the_whole_mesh(recipe, axes):
    """Experts split over `expert` by a `shard_map` over that axis alone, `data` left to XLA:
    the exchange and the grouped GEMMs failed in JAX (an AssertionError printing
    "ManualAxisType(varying=frozenset({'expert'}), ...)" from jnp.searchsorted). With `data`
    an Explicit axis (`jax.set_mesh`), the FP8 layer's dispatched GEMMs raised "Explicit
    sharding inference for ragged_dot_general is not currently implemented" (as the
    high-precision layer's did). With the tokens also split over the Explicit `data` axis in
    the body ("Explicit-split"), `expert_exchange` raised "Arguments to sort must be unsharded
    over the sorting dimension" from its `jnp.argsort` (there an odd capacity: the rows
    received cannot split over `data`). Now the output and gradients are those of the same
    block on a mesh of the expert axis alone."""
    if recipe == "blockwise":
        recipe = fp8jax.BlockwiseScaling(block_size=32)
    elif recipe is not None:
        recipe = fp8jax.CurrentScaling()
    if recipe is not None:
        recipe = dataclasses.replace(recipe, axis_names=("expert",))
    dot = None if recipe is None else fp8jax.Fp8RaggedDot(recipe, num_experts=8)
    layer = fp8jax.GroupedLinear(8, 32, 16, key=jax.random.key(0), ragged_dot=dot)
    chosen, weights = _routed(64, seed=8)
    chosen = chosen % 8
    x = np.random.default_rng(9).standard_normal((64, 32)).astype(np.float32)
    capacity = 127 if axes == "Explicit-split" else None

    def moe(layer, x, chosen, weights, split=False):
        if split:  # each device's tokens also split over `data`
            x, chosen, weights = (jax.sharding.reshard(a, P("data")) for a in (x, chosen, weights))
        plan = fp8jax.expert_exchange(chosen, 8, "expert", capacity=capacity)
        return plan.combine(layer(x, plan), weights)

    def run(mesh, **manual):
        if manual and axes == "Explicit-split":
            moe_here = functools.partial(moe, split=True)
        else:
            moe_here = moe
        specs = (fp8jax.expert_specs(layer, "expert"), P("expert"), P("expert"), P("expert"))
        f = jax.shard_map(moe_here, mesh=mesh, in_specs=specs, out_specs=P("expert"), **manual)
        if manual and axes != "Auto":
            f = _sharded_as_specs(f, specs)

        @eqx.filter_jit
        def out_and_grads(layer, x):
            out, vjp = eqx.filter_vjp(lambda m, x: f(m, x, chosen, weights), layer, x)
            return out, vjp(out)

        with jax.set_mesh(mesh):
            return jax.tree.leaves(eqx.filter(out_and_grads(layer, x), eqx.is_inexact_array))

    want = run(_mesh({"expert": 4}))
    mesh = _mesh({"data": 2, "expert": 4}, getattr(jax.sharding.AxisType, axes.split("-")[0]))
    got = run(mesh, axis_names={"expert"})
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.max(np.abs(b)))


def test_dispatch_quantized_takes_tokens_split_over_an_explicit_axis():
    """`ExpertExchange.dispatch_quantized` called in a `shard_map` over the experts' axis
    alone, the tokens split over the Explicit `data` axis in the body: it raised "Use
    `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather" (JAX has no
    Explicit rule for gathering split rows). Now the FP8 rows and their tiles' scales arrive
    as on a mesh of the expert axis alone."""
    chosen, _ = _routed(64, seed=8)
    chosen = chosen % 8
    x = np.random.default_rng(9).standard_normal((64, 32)).astype(np.float32)

    def body(x, chosen, split=False):
        if split:
            x, chosen = (jax.sharding.reshard(a, P("data")) for a in (x, chosen))
        plan = fp8jax.expert_exchange(chosen, 8, "expert", capacity=127)
        data, scale_inv = exchange.quantize_tiles(x)  # one scale per row's tile
        q = plan.dispatch_quantized(fp8jax.QTensor(data, scale_inv, (1, exchange.TILE)))
        return q.data.astype(jnp.float32), q.scale_inv

    def run(mesh, **manual):
        f = functools.partial(body, split=bool(manual))
        f = jax.shard_map(f, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), **manual)
        if manual:
            f = _sharded_as_specs(f, P("expert"))
        with jax.set_mesh(mesh):
            return jax.jit(f)(x, chosen)

    want = run(_mesh({"expert": 4}))
    mesh = _mesh({"data": 2, "expert": 4}, jax.sharding.AxisType.Explicit)
    got = run(mesh, axis_names={"expert"})
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fp8_backward", [False, True], ids=["plain", "fp8_backward"])
def test_gradient_back_takes_rows_split_over_an_explicit_axis(fp8_backward):
    """`ExpertExchange.gradient_back` called in a `shard_map` over the experts' axis alone,
    the gradient of the received rows split over the Explicit `data` axis in the body: it
    raised "Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the
    gather" (as `dispatch` did). Now the tokens' gradient is the one on a mesh of the expert
    axis alone."""
    chosen, _ = _routed(64, seed=8)
    chosen = chosen % 8
    d_rows = np.random.default_rng(9).standard_normal((4 * 128, 32)).astype(np.float32)

    def body(chosen, d_rows, split=False):
        if split:
            chosen, d_rows = (jax.sharding.reshard(a, P("data")) for a in (chosen, d_rows))
        plan = fp8jax.expert_exchange(chosen, 8, "expert", capacity=128, fp8_backward=fp8_backward)
        return plan.gradient_back(d_rows)

    def run(mesh, **manual):
        f = functools.partial(body, split=bool(manual))
        f = jax.shard_map(f, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), **manual)
        with jax.set_mesh(mesh):
            return jax.jit(_sharded_as_specs(f, P("expert")) if manual else f)(chosen, d_rows)

    want = run(_mesh({"expert": 4}))
    mesh = _mesh({"data": 2, "expert": 4}, jax.sharding.AxisType.Explicit)
    np.testing.assert_array_equal(run(mesh, axis_names={"expert"}), want)


@pytest.mark.parametrize("method", ["tokens_of", "send", "send_back"])
def test_exchange_steps_take_rows_split_over_an_explicit_axis(method):
    """`ExpertExchange.tokens_of`, `send` and `send_back`, public steps of `dispatch` and
    `combine`, called in a `shard_map` over the experts' axis alone, their rows split over the
    Explicit `data` axis in the body: they raised "Use `.at[...].get(out_sharding=)` to
    provide output PartitionSpec for the gather" (as `dispatch` did). Now each returns what
    it does on a mesh of the expert axis alone."""
    chosen, _ = _routed(64, seed=8)
    chosen = chosen % 8
    rng = np.random.default_rng(9)
    given = {  # per device: 16 tokens, 32 assignments, 128 rows received
        "tokens_of": rng.standard_normal((64, 32)).astype(np.float32),
        "send": rng.standard_normal((64 * TOP_K, 32)).astype(np.float32),
        "send_back": rng.standard_normal((4 * 128, 32)).astype(np.float32),
    }[method]

    def body(chosen, rows, split=False):
        if split:
            chosen, rows = (jax.sharding.reshard(a, P("data")) for a in (chosen, rows))
        plan = fp8jax.expert_exchange(chosen, 8, "expert", capacity=128)
        return getattr(plan, method)(rows)

    def run(mesh, **manual):
        f = functools.partial(body, split=bool(manual))
        f = jax.shard_map(f, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), **manual)
        with jax.set_mesh(mesh):
            return jax.jit(_sharded_as_specs(f, P("expert")) if manual else f)(chosen, given)

    want = run(_mesh({"expert": 4}))
    mesh = _mesh({"data": 2, "expert": 4}, jax.sharding.AxisType.Explicit)
    np.testing.assert_array_equal(run(mesh, axis_names={"expert"}), want)


# --- an MoE block, expert parallel, against one device ----------------------------------------

# Power-of-two scales (the per-tensor recipes' default) keep the quantized values exact
# multiples of the data's: with the integer data and ternary weights of `_exact_problem`
# every GEMM whose result is quantized again sums exactly in float32, so that the expert
# parallel block's outputs and FP8 states can be compared bit for bit.
RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(power_of_two=True),
}


def _moe(recipe, expert_axis=None, axis_names=()):
    moe = MoE(
        WIDTH,
        HIDDEN,
        EXPERTS,
        TOP_K,
        key=jax.random.key(0),
        expert_axis=expert_axis,
        activation=jax.nn.relu,
    )
    # Ternary weights; the router's too (exact logits: the same routing weights on every
    # device count), with expert 0 favoured by every token and experts 1 and 9 by none.
    rng = np.random.default_rng(4)
    gate, up, down = (
        rng.integers(-1, 2, w.shape).astype(np.float32)
        for w in (moe.gate.weight, moe.up.weight, moe.down.weight)
    )
    gate[0], gate[[1, 9]] = 1.0, -1.0
    moe = eqx.tree_at(
        lambda m: (m.gate.weight, m.up.weight, m.down.weight),
        moe,
        tuple(jnp.asarray(w) for w in (gate, up, down)),
    )
    if recipe is None:
        return moe
    recipe = dataclasses.replace(recipe, axis_names=axis_names)  # amaxes over the devices
    return fp8jax.fp8_linear_layers(moe, fp8jax.Fp8Config(recipe=recipe))


def _exact_problem(tokens: int):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (tokens, WIDTH)).astype(np.float32)  # >= 0: the router's biases
    return x, np.zeros_like(x)


def _step(loss):
    @eqx.filter_jit
    def step(model, x, y):
        return fp8jax.filter_value_and_grad(loss, has_aux=True)(model, x, y)

    return step


def _one_device_loss(model, x, y):
    out = model(x)
    return jnp.mean((out - y) ** 2), out


def _expert_parallel_loss(mesh, token_axes, expert_axis):
    """The loss of an expert-parallel block: `shard_map` over `mesh`, tokens split over
    `token_axes`, experts over `expert_axis`."""

    def loss(model, x, y):
        params, static = eqx.partition(model, eqx.is_array)

        def local(params, x, y):
            out = eqx.combine(params, static)(x)
            total = jax.lax.psum(jnp.sum((out - y) ** 2), token_axes)
            return total / (x.shape[0] * jax.lax.psum(1, token_axes) * y.shape[1]), out

        f = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(fp8jax.expert_specs(params, expert_axis), P(token_axes), P(token_axes)),
            out_specs=(P(), P(token_axes)),
        )
        return f(params, x, y)

    return loss


LAYOUTS = {"expert 8": {"expert": 8}, "data 2 x expert 4": {"data": 2, "expert": 4}}


def _sgd(model, grads):
    overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
    return fp8jax.apply_updates(model, jax.tree.map(jnp.zeros_like, grads), overwrites)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_expert_parallel_moe_trains_like_one_device(name, layout):
    """An FP8 MoE block with its 16 experts split over 8 devices (or 4, times 2 data-parallel
    replicas), tokens routed unevenly and two experts empty: two steps (the second with the
    first's FP8 state) give the single-device block's outputs and new FP8 states bit for bit
    (the data make every sum feeding a quantization exact), its loss and weight gradients to
    float32 summation order (the devices' partial sums)."""
    shape = LAYOUTS[layout]
    mesh = _mesh(shape)
    tokens = 256
    x, y = _exact_problem(tokens)
    token_axes = tuple(shape)
    one = _moe(RECIPES[name])
    ep = _moe(RECIPES[name], expert_axis="expert", axis_names=token_axes)
    one_step = _step(_one_device_loss)
    ep_step = _step(_expert_parallel_loss(mesh, token_axes, "expert"))
    for _ in range(2):
        (want_loss, want_out), want = one_step(one, x, y)
        (loss, out), got = ep_step(ep, x, y)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(got, eqx.is_array))
        want_leaves = jax.tree.leaves(eqx.filter(want, eqx.is_array))
        assert len(leaves) == len(want_leaves)
        for (path, a), b in zip(leaves, want_leaves, strict=True):
            key = jax.tree_util.keystr(path)
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            if "ragged_dot" in key:  # FP8 state: the new scales and amax histories
                np.testing.assert_array_equal(a, b, err_msg=key)
            else:  # sums over the tokens, split over devices
                atol = reference.float32_sum_bound(tokens * TOP_K, float(np.abs(b).max()))
                np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=key)
        one, ep = _sgd(one, want), _sgd(ep, got)  # the FP8 state written back


def test_expert_specs_split_the_experts_and_their_fp8_state():
    """Every GroupedLinear weight and its FP8 layer's per-expert leaves (kernel state and
    statistics, tokens) split over the axis; everything else replicated; non-arrays None."""
    moe = _moe(None)
    fp8 = fp8jax.fp8_linear_layers(moe, fp8jax.Fp8Config(telemetry=True))
    specs = fp8jax.expert_specs(fp8, "expert")
    leaves = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda s: s is None or isinstance(s, P)
    )
    split = {jax.tree_util.keystr(p) for p, s in leaves if s == P("expert")}
    assert split == {
        f".{layer}.{leaf}"
        for layer in ("up", "down")
        for leaf in (
            "weight",
            "ragged_dot.kernel.scale",
            "ragged_dot.kernel.amax_history",
            "ragged_dot.kernel.scale_inv",
            "ragged_dot.stats.kernel.saturated",
            "ragged_dot.stats.kernel.underflow",
            "ragged_dot.stats.kernel.rejected",
            "ragged_dot.stats.tokens",
        )
    }
    # Each split leaf has the experts first; the rest is replicated or not an array.
    for (path, s), leaf in zip(
        leaves, jax.tree.leaves(fp8, is_leaf=lambda x: x is None), strict=True
    ):
        if s == P("expert"):
            assert leaf.shape[0] == EXPERTS, jax.tree_util.keystr(path)
    assert all(s in (P(), P("expert"), None) for _, s in leaves)
    with pytest.raises(TypeError, match="axis=3"):
        fp8jax.expert_specs(fp8, 3)


def test_expert_specs_of_stacked_layers_split_the_experts_axis():
    """Expert layers stacked by `eqx.filter_vmap` (weights `(layers, experts, in, out)`)
    split on their experts axis, behind the stack's: once `P('expert')`, which split the
    layers and failed in the layer scan; a scan over the stack under `shard_map` then gives
    what it gives on one device."""
    layers, mesh = 4, jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))

    def build(expert_axis):
        make = lambda k: MoE(32, 64, 4, 2, key=k, expert_axis=expert_axis)  # noqa: E731
        return fp8jax.fp8_linear_layers(
            eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), layers))
        )

    sharded, one = build("expert"), build(None)
    specs = fp8jax.expert_specs(sharded, "expert")
    assert specs.up.weight == specs.up.ragged_dot.kernel.scale == P(None, "expert")
    assert specs.gate.weight == P()

    def run(model, x):
        params, static = eqx.partition(model, eqx.is_array)

        def body(x, layer):
            return x + eqx.combine(layer, static)(x), None

        return jax.lax.scan(body, x, params)[0]

    x = jax.random.normal(jax.random.key(1), (32, 32))
    local = jax.shard_map(
        run, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P("expert"), check_vma=False
    )
    np.testing.assert_allclose(
        jax.jit(local)(sharded, x), jax.jit(run)(one, x), rtol=1e-5, atol=1e-5
    )


# --- a compile for 8 H100s ----------------------------------------------------------------------


def _h100_report(recipe):
    """The expert-parallel block's train step (BF16 compute, 512 tokens per GPU) compiled for
    8 H100s, experts split over all 8."""
    h100_topology(8)
    mesh = fp8jax.h100_mesh({"expert": 8})
    model = _moe(recipe, expert_axis="expert", axis_names=("expert",))
    loss = _expert_parallel_loss(mesh, ("expert",), "expert")

    def bf16_loss(model_and_x, y):  # the block's input differentiated: inside a model
        model, x = jax.tree.map(
            lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
            model_and_x,
            is_leaf=lambda n: isinstance(n, fp8jax.OverwriteWithGradient),
        )
        value, _ = loss(model, x, y)
        return value.astype(jnp.float32)

    rows = NamedSharding(mesh, P("expert"))
    x, y = [jax.ShapeDtypeStruct((8 * 512, WIDTH), jnp.bfloat16, sharding=rows)] * 2
    step = eqx.filter_jit(fp8jax.filter_value_and_grad(bf16_loss))
    return fp8jax.inspect(step, (model, x), y, modes=("cublas",))


def test_the_dispatch_moves_fp8_on_eight_h100s():
    """Compiled for 8 H100s: the dispatch's ragged all-to-all carries the FP8 rows (half the
    BF16 dispatch's bytes) and their float32 1 x 128 tile scales; the combine and the
    backward's exchanges stay BF16, as in the BF16 program; every expert GEMM (forward,
    dgrad, wgrad of both grouped layers) is the grouped Mosaic kernel with FP8 operands."""
    exchanges = {}
    for name, recipe in (("bf16", None), ("blockwise", fp8jax.BlockwiseScaling())):
        report = _h100_report(recipe)
        exchanges[name] = sorted(
            (c.dtypes[0], c.shapes[0])
            for c in report.collectives["cublas"]
            if c.op == "ragged-all-to-all"
        )
        if name == "blockwise":
            experts = [g for g in report.gemms["cublas"] if g.layer in ("up", "down")]
            assert len(experts) == 6, report.gemms["cublas"]
            for g in experts:  # (their PTX's FP8 wgmma: tests/test_grouped_native.py)
                assert g.kernel == "pallas mosaic gpu", g
                assert g.lhs == g.rhs == "f8e4m3fn", g
    assignments = 512 * TOP_K  # rows each GPU sends
    # Forward: dispatch and combine; backward: their transposes. Rows of WIDTH each.
    assert (
        exchanges["bf16"]
        == [("bf16", (assignments, WIDTH))] * 2 + [("bf16", (8 * assignments, WIDTH))] * 2
    ), exchanges
    fp8 = [e for e in exchanges["blockwise"] if e[0].startswith("f8")]
    assert fp8 == [("f8e4m3fn", (assignments, WIDTH))], exchanges  # 1 byte, not 2
    scales = [e for e in exchanges["blockwise"] if e[0] == "f32"]
    assert scales == [("f32", (assignments, WIDTH // 128))], exchanges
    rest = [e for e in exchanges["blockwise"] if e[0] == "bf16"]
    assert len(rest) == 3, exchanges  # the combine and both backward exchanges stay BF16


# --- the example ----------------------------------------------------------------------------


def test_the_moe_gpts_loss_expert_parallel_is_the_one_device_loss():
    """`fp8jax.examples.moe.expert_parallel`: the MoE GPT's loss with the batch split over
    data 2 x expert 4 and its experts over the 4 equals one device's (float32 summation
    order), and so do the tokens each expert got."""
    from fp8jax.examples.gpt import GPTConfig
    from fp8jax.examples.moe import expert_parallel
    from fp8jax.examples.moe_model import moe_gpt, moe_gpt_loss

    config = GPTConfig(vocab=64, layers=1, width=32, heads=2, context=8)
    key = jax.random.key(1)
    one = moe_gpt(config, 8, 2, key=key)
    ep = moe_gpt(config, 8, 2, key=key, expert_axis="expert")
    tokens = jax.random.randint(jax.random.key(2), (8, 9), 0, 64)
    want_loss, want_counts = jax.jit(moe_gpt_loss)(one, tokens)
    loss = expert_parallel(moe_gpt_loss, _mesh({"data": 2, "expert": 4}))
    got_loss, got_counts = eqx.filter_jit(loss)(ep, tokens)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(got_counts, want_counts)


def test_the_moe_example_converts_attention_when_the_expert_count_is_the_width():
    """`--experts` equal to `--width` (16 here): found by width, attention's four Linears were
    kept in high precision as routers. The example's conversion keeps `gate` and `head` by
    name and converts the rest, on one device and expert parallel (whose `shard_map` the
    trace that finds roles does not enter)."""
    from fp8jax.examples.gpt import GPTConfig
    from fp8jax.examples.moe import fp8_config
    from fp8jax.examples.moe_model import moe_gpt

    config = GPTConfig(vocab=64, layers=1, width=16, heads=2, context=8)
    attention = {f"blocks.0.attn.{n}" for n in ("query", "key", "value", "out")}
    want = attention | {"blocks.0.mlp.up", "blocks.0.mlp.down"}
    for mesh, axis in ((None, None), (_mesh({"data": 2, "expert": 4}), "expert")):
        model = moe_gpt(config, 16, 2, key=jax.random.key(1), expert_axis=axis)
        assert model.blocks[0].attn.query.out_features == model.blocks[0].mlp.up.num_experts
        converted = fp8jax.fp8_linear_layers(model, fp8_config(mesh))
        assert set(fp8jax.telemetry(converted)) == want
        assert type(converted.blocks[0].mlp.gate) is eqx.nn.Linear
        assert type(converted.head) is eqx.nn.Linear
        names = () if mesh is None else ("data", "expert")
        assert converted.blocks[0].attn.query.dot_general.recipe.axis_names == names


def test_the_example_names_a_mesh_it_cannot_make():
    from fp8jax.examples.moe import kjv_args

    with pytest.raises(SystemExit):
        kjv_args(["--kjv", "--expert-parallel", "3"])  # 8 devices, 4 experts
    args = kjv_args(["--kjv", "--expert-parallel", "4", "--batch", "8"])
    assert dict(args.mesh.shape) == {"data": 2, "expert": 4}


def _tiles_numpy(rows: np.ndarray) -> np.ndarray:
    """`rows` through `quantize_tiles` and back, by NumPy and ml_dtypes' E4M3 rounding."""
    tile = min(128, rows.shape[-1])
    x = rows.reshape(rows.shape[0], -1, tile).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.floor(np.log2(448.0 / np.where(amax > 0, amax, 1))), 1)
    q = (x * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale
    return q.reshape(rows.shape)


@pytest.mark.parametrize("features", [(4,), (2, 3)], ids=["rows", "rows of 2 x 3"])
def test_fp8_backward_sends_the_gradients_as_e4m3_tiles(features):
    """`fp8_backward=True`: the forward is unchanged; the gradient is the one of two E4M3
    roundings in 1 x 128 tiles of a token's row (the combine's output gradient going out, the
    dispatched rows' gradient coming back), reproduced with ml_dtypes. Tokens of several
    axes (dispatch takes `(tokens, ...)`) are tiled along their values, as one row; their
    gradient failed in jnp.pad ("pad_width with nd=3 has unsupported shape")."""
    devices, tokens = 8, 16
    chosen, weights = _routed(devices * tokens, seed=5)
    shape = (devices * tokens, *features)
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    scale = np.arange(1.0, EXPERTS + 1, dtype=np.float32)
    g_out = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
    mesh = _mesh({"expert": devices})

    def run(fp8_backward):
        def moe(x, chosen, weights):
            plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert", fp8_backward=fp8_backward)
            return plan.combine(_toy_experts(plan.dispatch(x), plan, jnp.asarray(scale)), weights)

        f = jax.shard_map(moe, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert"))

        @jax.jit
        def out_and_grad(x):
            out, vjp = jax.vjp(lambda x: f(x, chosen, weights), x)
            return out, vjp(g_out)[0]

        return (np.asarray(a) for a in out_and_grad(x))

    out, grad = run(True)
    plain_out, plain_grad = run(False)
    np.testing.assert_array_equal(out, plain_out)
    want = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            row = (g_out[t] * weights[t, j]).reshape(1, -1)
            going = _tiles_numpy(row)  # at the token's device
            back = _tiles_numpy(going * scale[chosen[t, j]])  # at the expert's device
            want[t] += back[0].reshape(features)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(grad, plain_grad, rtol=1e-4)  # the roundings show


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=["expert 8", "data 2 x expert 4"])
def test_expert_parallel_telemetry_is_the_steps_as_on_one_device(shape):
    """Telemetry of an expert-parallel step equals one device's: the tokens each expert got
    summed over the devices holding its replicas (it was the largest replica's count), and
    the fractions of the `down` layer's input and output gradient over the rows that hold
    tokens (the receive buffer's padding counted divided them by its slack)."""
    width, hidden, experts, k, tokens = 32, 64, 8, 2, 64
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = (
        jax.random.normal(jax.random.key(4), (tokens, width))
        * jnp.exp(jnp.linspace(-1, 1, tokens))[:, None]
    )
    y = jnp.sin(x)

    def config(axes):
        return fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(axis_names=axes), telemetry=True)

    one = fp8jax.fp8_linear_layers(
        MoE(width, hidden, experts, k, key=jax.random.key(3)), config(())
    )
    ep = fp8jax.fp8_linear_layers(
        MoE(width, hidden, experts, k, key=jax.random.key(3), expert_axis="expert"),
        config(("data", "expert")),
    )

    def loss_ep(m, x, y):
        params, static = eqx.partition(m, eqx.is_array)

        def local(p, x, y):
            loss = jnp.mean((eqx.combine(p, static)(x) - y) ** 2)
            return jax.lax.pmean(loss, ("data", "expert"))

        specs = fp8jax.expert_specs(params, "expert")
        rows = P(("data", "expert"))
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, rows, rows), out_specs=P())(
            params, x, y
        )

    def loss_one(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    a = jax.jit(fp8jax.filter_grad(loss_one))(one, x, y)
    b = jax.jit(fp8jax.filter_grad(loss_ep))(ep, x, y)
    for layer in ("up", "down"):
        got, want = getattr(b, layer).ragged_dot.stats, getattr(a, layer).ragged_dot.stats
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert float(want.tokens.sum()) == tokens * k
        for role in ("input", "output_grad"):
            for field in ("saturated", "underflow"):
                np.testing.assert_allclose(
                    getattr(getattr(got, role), field),
                    getattr(getattr(want, role), field),
                    rtol=1e-6,
                    err_msg=f"{layer}.{role}.{field}",
                )


@pytest.mark.parametrize(
    "shape, axis_names",
    [((1, 8), ()), ((2, 4), ("data",)), ((2, 4), ("data", "expert"))],
    ids=["expert 8", "data 2 x expert 4", "data 2 x expert 4, both named"],
)
def test_dispatched_amaxes_are_over_the_global_batch(shape, axis_names):
    """The activation and the output gradient of a dispatched grouped GEMM are quantized
    with amaxes over every device's rows: the recipe's `axis_names` (the tokens' other axes)
    and the exchange's axis, which the layer adds. The recorded amaxes are NumPy's
    `max |x|` of the whole batch and `max |weight * cotangent|` of all its assignments, and
    the scales (delayed scaling's warm start: from this step's amaxes) theirs. The recorded
    state is combined by max over the devices, so an amax taken over some of them shows
    in the scale (from the smallest such amax), not in the history. The telemetry's
    fractions are the whole batch's too (one device's rows tiny: they flush there alone),
    and each expert's kernel amax its own `max |w[e]|`, even with the experts' axis named
    in `axis_names` (never taken over the axis the experts are split over)."""
    experts, k_in, n_out, tokens = 8, 16, 8, 64
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    recipe = fp8jax.DelayedScaling(axis_names=axis_names)
    dot = fp8jax.Fp8RaggedDot(recipe, num_experts=experts, telemetry=True)
    layer = fp8jax.GroupedLinear(experts, k_in, n_out, key=jax.random.key(0), ragged_dot=dot)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    c = rng.standard_normal((tokens, n_out)).astype(np.float32)
    chosen = np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(tokens)])
    weights = rng.choice(np.float32([0.25, 0.5, 1.0]), (tokens, TOP_K))
    # The largest of each on one device's rows only (not the first device's).
    x[41, 3], c[53, 5], weights[53] = 50.0, -40.0, 1.0
    x[:8] *= 1e-4  # the first device's rows: most flush to zero at the batch's scale
    rows = P(("data", "expert"))

    def loss(layer, x, c, chosen, weights):
        def local(layer, x, c, chosen, weights):
            plan = fp8jax.expert_exchange(chosen.astype(jnp.int32), experts, "expert")
            out = plan.combine(layer(x, plan), weights)
            return jax.lax.psum(jnp.sum(out * c), ("data", "expert"))

        specs = (fp8jax.expert_specs(layer, "expert"), rows, rows, rows, rows)
        f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
        return f(layer, x, c, chosen, weights)

    grads = jax.jit(fp8jax.filter_grad(loss))(layer, x, c, chosen, weights)
    cotangents = weights[:, :, None] * c[:, None, :]  # each assignment's output gradient
    for role, t, fmt_max in (("input", x, 448.0), ("output_grad", cotangents, 57344.0)):
        state, amax = getattr(grads.ragged_dot, role), np.abs(t).max()
        np.testing.assert_array_equal(state.amax_history[0], amax, err_msg=role)
        # The first step's scale (the warm start: its own amax), the same on every device.
        want = 2.0 ** np.floor(np.log2(fmt_max / amax))
        np.testing.assert_array_equal(state.scale, want, err_msg=role)
    stats, x_scale = grads.ragged_dot.stats.input, grads.ragged_dot.input.scale
    with np.errstate(over="ignore", invalid="ignore"):  # ml_dtypes' cast does not saturate
        cast = (x * np.float32(x_scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    flushed = np.mean((cast == 0) & (x != 0))
    assert flushed > 0.05  # the first device's rows
    assert float(stats.saturated) == np.mean(~np.isfinite(cast)) == 0.0
    np.testing.assert_allclose(stats.underflow, flushed, rtol=1e-6)
    w = np.asarray(layer.weight)
    used = np.isin(np.arange(experts), chosen)
    kernel_amax = np.where(used, np.abs(w).max(axis=(1, 2)), 0.0)
    np.testing.assert_array_equal(grads.ragged_dot.kernel.amax_history[:, 0], kernel_amax)


def test_high_precision_grouped_layers_take_lists_and_exchanges():
    """`GroupedLinear` and `NnxGroupedLinear` without an FP8 `ragged_dot` take group sizes as
    a list and an `ExpertExchange`, as their FP8 conversions do (both were refused as "not an
    array"; the NNX layer refused an exchange): each expert's rows against a float64
    product."""
    nnx = pytest.importorskip("flax.nnx")
    layer = fp8jax.NnxGroupedLinear(EXPERTS, 4, 3, rngs=nnx.Rngs(0))
    kernel = np.asarray(layer.kernel.get_value(), np.float64)
    eqx_layer = fp8jax.GroupedLinear(EXPERTS, 4, 3, weight=jnp.asarray(kernel, jnp.float32))
    sizes = [2, 0, 3, 1, 0, 0, 4, 2] * 2
    x = np.random.default_rng(3).standard_normal((sum(sizes), 4)).astype(np.float32)
    experts = np.repeat(np.arange(EXPERTS), sizes)
    want = np.einsum("tk,tkn->tn", x.astype(np.float64), kernel[experts])
    for f in (layer, eqx_layer):
        np.testing.assert_allclose(f(x, sizes), want, rtol=1e-5, atol=1e-5)

    chosen, weights = _routed(16)
    mesh = _mesh({"expert": 1})

    def moe(x, chosen, weights):
        plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert")
        return plan.combine(layer(x, plan), weights)

    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")))
    x = np.random.default_rng(4).standard_normal((16, 4)).astype(np.float32)
    got = f(x, chosen, weights)
    want = np.einsum("tk,tkn->tn", weights, np.einsum("tf,tkfn->tkn", x, kernel[chosen]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("devices", "capacity"), [(4, None), (4, 28)])
def test_the_plans_ragged_arguments_fit_the_buffers_both_ways(devices, capacity):
    """The plan's `ragged_all_to_all` arguments, as the GPU primitive takes them (the CPU
    emulation forgives more): each device's chunk fits the destination's buffer, the sizes a
    receiver expects are the ones sent, and the rows sent there come back where they were
    sent from. Rows past a capacity are neither sent nor received: sent rows past the
    buffer were dropped on CPU, and written past it by the primitive."""
    tokens = 16
    chosen, _ = _routed(devices * tokens, seed=3)
    mesh = _mesh({"expert": devices})
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes", "return_offsets")

    def fields(chosen):
        plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert", capacity=capacity)
        return tuple(getattr(plan, n)[None] for n in names) + (plan.recv_offsets[None],)

    f = jax.jit(jax.shard_map(fields, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    in_off, send, out_off, recv, ret_off, recv_off = (np.asarray(a) for a in f(chosen))
    rows = tokens * TOP_K
    cap = devices * rows if capacity is None else capacity
    # Out: each device's assignments (tagged device * rows + index in `order`).
    tags = [np.arange(rows) + d * rows for d in range(devices)]
    empty = [np.full(cap, -1) for _ in range(devices)]
    out = _numpy_ragged_all_to_all(tags, empty, in_off, send, out_off, recv)
    # Which fit: each destination takes its sources in order, up to the capacity.
    local = EXPERTS // devices
    for j in range(devices):
        n = np.sum(chosen.reshape(devices, -1) // local == j, axis=1)  # from each source
        fit = np.clip(cap - (np.cumsum(n) - n), 0, n)
        np.testing.assert_array_equal(send[:, j], fit)
        assert np.sum(out[j] >= 0) == fit.sum()
    # Back: each device's received rows to their sources, at the offsets they left from.
    empty = [np.full(rows, -1) for _ in range(devices)]
    back = _numpy_ragged_all_to_all(out, empty, recv_off, recv, ret_off, send)
    for d in range(devices):
        kept = np.concatenate([in_off[d, j] + np.arange(send[d, j]) for j in range(devices)])
        want = np.full(rows, -1)
        want[kept] = tags[d][kept]
        np.testing.assert_array_equal(back[d], want)


def test_dispatch_quantized_fills_rows_past_the_received_with_zeros_and_scales_of_one():
    """As documented: the FP8 rows of the tokens routed to this device's experts in expert
    order (by expert, then by source device), each with its tiles' scales; past the received
    rows, zero data and scales of 1."""
    devices, tokens, features = 4, 8, 32
    chosen, _ = _routed(devices * tokens, seed=11)
    x = np.random.default_rng(12).standard_normal((devices * tokens, features)).astype(np.float32)
    data, scale_inv = (np.asarray(a) for a in exchange.quantize_tiles(jnp.asarray(x)))
    mesh = _mesh({"expert": devices})

    def body(data, scale_inv, chosen):
        plan = fp8jax.expert_exchange(chosen, EXPERTS, "expert")
        q = plan.dispatch_quantized(fp8jax.QTensor(data, scale_inv, (1, exchange.TILE)))
        return q.data.astype(jnp.float32), q.scale_inv

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    got_data, got_scale = (
        np.asarray(a).reshape(devices, -1, *a.shape[1:]) for a in f(data, scale_inv, chosen)
    )
    capacity = devices * tokens * TOP_K
    local = EXPERTS // devices
    for j in range(devices):
        rows = [  # by expert, then by source device, each source's (token, k) in order
            i * tokens + t
            for e in range(j * local, (j + 1) * local)
            for i in range(devices)
            for t, k in np.argwhere(chosen[i * tokens : (i + 1) * tokens] == e)
        ]
        want_data = np.zeros((capacity, features), np.float32)
        want_data[: len(rows)] = data[rows].astype(np.float32)
        want_scale = np.ones((capacity, scale_inv.shape[1]), np.float32)
        want_scale[: len(rows)] = scale_inv[rows]
        np.testing.assert_array_equal(got_data[j], want_data)
        np.testing.assert_array_equal(got_scale[j], want_scale)


def test_fp8_backward_tiles_pad_a_row_of_a_width_past_one_tile():
    """A row of 200 values: a tile of 128 and one of 72 padded with zeros, each scaled by its
    own power of two (NumPy and ml_dtypes' E4M3), and back to the 200 values."""
    rows = np.random.default_rng(13).standard_normal((3, 200)).astype(np.float32)
    rows[1, 128:] *= 1e-3  # the second tile's scale differs from the first's
    data, scale_inv = exchange.quantize_tiles(jnp.asarray(rows))
    padded = np.pad(rows, ((0, 0), (0, 56))).reshape(3, 2, 128)
    scale = 2.0 ** np.floor(np.log2(448.0 / np.abs(padded).max(-1)))
    q = (padded * scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(data, np.float32), q.reshape(3, 256))
    np.testing.assert_array_equal(scale_inv, 1.0 / scale)
    back = exchange.dequantize_tiles(data, scale_inv, 200, jnp.float32)
    np.testing.assert_array_equal(back, (q / scale[..., None]).reshape(3, 256)[:, :200])

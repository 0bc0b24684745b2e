"""FP8 train steps on a mesh of 8 CPU devices match the single-device step.

Data-parallel, FSDP-style (parameters sharded) and tensor-parallel (Linear weights split over a
`model` axis) under `jit`, and a `shard_map` data-parallel step with explicit axis names.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

RECIPE = fp8jax.DelayedScaling(history_len=4)
STEPS = 3


def problem(recipe=RECIPE):
    mlp = eqx.nn.MLP(32, 32, 128, 1, key=jax.random.key(0))
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    rows = jnp.exp(jnp.linspace(-2.0, 2.0, 64))[:, None]  # each device's shard its own amax
    x = jax.random.normal(jax.random.key(1), (64, 32)) * rows
    y = jnp.sin(x)
    return model, x, y


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mesh(shape, names):
    assert jax.device_count() >= 8, "tests expect 8 CPU devices (see conftest.py)"
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=axis_types)


def train(state, x, y, step):
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, x, y)
        losses.append(float(metrics.loss))
    return state, losses


def single_device():
    model, x, y = problem()
    step = fp8jax.make_train_step(mse, optax.adam(1e-2))
    return train(step.init(model), x, y, step)


def check_same(state, losses, want_state, want_losses):
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for layer, want in zip(state.model.layers, want_state.model.layers, strict=True):
        np.testing.assert_allclose(layer.weight, want.weight, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.bias, want.bias, rtol=1e-5, atol=1e-6)
        got, ref = layer.dot_general, want.dot_general
        # Amaxes of inputs exactly: a max does not depend on how it is split. The weights'
        # amaxes to the weights' own tolerance: after the first update the weights come out
        # of sharded sums (a shard's max in place of the global one would be far off).
        np.testing.assert_array_equal(got.input.amax_history, ref.input.amax_history)
        np.testing.assert_allclose(
            got.kernel.amax_history, ref.kernel.amax_history, rtol=1e-5, atol=1e-6
        )
        # Output gradients come out of sharded reductions: float32 rounding may differ.
        np.testing.assert_allclose(
            got.output_grad.amax_history, ref.output_grad.amax_history, rtol=1e-6
        )


def shard_params(tree, spec_of):
    """`tree` with each array leaf placed by `spec_of(path, leaf)` (a NamedSharding)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: (
            jax.device_put(a, spec_of(jax.tree_util.keystr(path), a)) if eqx.is_array(a) else a
        ),
        tree,
    )


@pytest.mark.parametrize("layout", ["data", "fsdp", "tensor"])
def test_sharded_train_step_matches_one_device(layout):
    want_state, want_losses = single_device()
    model, x, y = problem()
    if layout == "tensor":
        m = mesh((2, 4), ("data", "model"))

        def spec_of(path, a):
            if path.endswith("layers[0].weight") or path.endswith("layers[0].bias"):
                return NamedSharding(m, P("model"))  # column parallel: split outputs
            if path.endswith("layers[1].weight"):
                return NamedSharding(m, P(None, "model"))  # row parallel: split inputs
            return NamedSharding(m, P())

    else:
        m = mesh((8,), ("data",))

        def spec_of(path, a):
            if (
                layout == "fsdp"
                and a.ndim >= 1
                and a.shape[0] % 8 == 0
                and "dot_general" not in path
            ):
                return NamedSharding(m, P("data"))
            return NamedSharding(m, P())

    model = shard_params(model, spec_of)
    x, y = (jax.device_put(a, NamedSharding(m, P("data"))) for a in (x, y))
    step = fp8jax.make_train_step(mse, optax.adam(1e-2))
    state, losses = train(step.init(model), x, y, step)
    check_same(state, losses, want_state, want_losses)
    if layout != "data":  # parameters stay where they were put
        weight = state.model.layers[0].weight
        assert weight.sharding.spec == spec_of("layers[0].weight", weight).spec


def shard_map_train(model, x, y, optimizer):
    """`model` trained `STEPS` steps by a data-parallel step written with `shard_map` (its
    recipes reduce amaxes over `axis_names=("data",)`): the model and the losses."""
    m = mesh((8,), ("data",))
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    params, static = eqx.partition((model, opt_state), eqx.is_array)

    def local_step(params, x, y):
        model, opt_state = eqx.combine(params, static)

        def local_loss(model, x, y):  # this shard's share of the global mean
            return mse(model, x, y) / jax.lax.axis_size("data")

        loss, grads = fp8jax.filter_value_and_grad(local_loss)(model, x, y)
        # As for any JAX op, the gradients of the replicated parameters come out summed over
        # the devices, and the FP8 state with the largest amax of all of them.
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        loss = jax.lax.psum(loss, "data")
        _, trainable = fp8jax.partition_for_grad_overwrite(model)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(trainable, eqx.is_inexact_array)
        )
        model = fp8jax.apply_updates(model, updates, overwrites)
        return eqx.filter((model, opt_state), eqx.is_array), loss

    step = jax.jit(
        jax.shard_map(
            local_step, mesh=m, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())
        )
    )
    losses = []
    for _ in range(STEPS):
        params, loss = step(params, x, y)
        losses.append(float(loss))
    model, _ = eqx.combine(params, static)
    return model, losses


def test_shard_map_data_parallel_step_with_axis_names():
    want_state, want_losses = single_device()
    model, x, y = problem(fp8jax.DelayedScaling(history_len=4, axis_names=("data",)))
    model, losses = shard_map_train(model, x, y, optax.adam(1e-2))
    check_same(
        fp8jax.TrainState(model, None, fp8jax.NoOpLossScale(), jnp.zeros((), jnp.int32)),
        losses,
        want_state,
        want_losses,
    )


def test_shard_map_blockwise_step_with_replicated_weights():
    """Blockwise scaling (its default `native_kernel=None`: the kernels' branch is traced
    on every platform) inside `shard_map` with the weights replicated: it failed to trace
    (the kernels' outputs were typed as varying over no axis, which `shard_map` refuses).
    With whole 128-token tiles on each device it matches the single-device step."""
    mlp = eqx.nn.MLP(128, 128, 256, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8 * 128, 128))
    y = jnp.sin(x)
    single = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe="blockwise"))
    step = fp8jax.make_train_step(mse, optax.sgd(0.1))
    want_state, want_losses = train(step.init(single), x, y, step)
    recipe = fp8jax.BlockwiseScaling(axis_names=("data",))
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
    model, losses = shard_map_train(model, x, y, optax.sgd(0.1))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for layer, want in zip(model.layers, want_state.model.layers, strict=True):
        np.testing.assert_allclose(layer.weight, want.weight, rtol=1e-5, atol=1e-6)
        for role in ("input", "kernel", "output_grad"):
            got, ref = getattr(layer.dot_general, role), getattr(want.dot_general, role)
            np.testing.assert_allclose(got.amax_history, ref.amax_history, rtol=1e-5)


def abstract(tree, sharding):
    return jax.tree.map(
        lambda a: (
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) if eqx.is_array(a) else a
        ),
        tree,
    )


@pytest.mark.parametrize("layout", ["data", "tensor"])
def test_eight_h100s_keep_fp8_gemms_and_reduce_amaxes_as_scalars(layout):
    if layout == "data":
        m = fp8jax.h100_mesh({"data": 8})
    else:
        m = fp8jax.h100_mesh({"data": 2, "model": 4})
    model, x, y = problem()
    step = fp8jax.make_train_step(mse, optax.adam(1e-2))
    state = abstract(step.init(model), NamedSharding(m, P()))
    if layout == "tensor":
        layers = state.model.layers
        col, row = NamedSharding(m, P("model")), NamedSharding(m, P(None, "model"))
        state = eqx.tree_at(
            lambda s: (s.model.layers[0].weight, s.model.layers[0].bias, s.model.layers[1].weight),
            state,
            (
                jax.ShapeDtypeStruct(layers[0].weight.shape, jnp.float32, sharding=col),
                jax.ShapeDtypeStruct(layers[0].bias.shape, jnp.float32, sharding=col),
                jax.ShapeDtypeStruct(layers[1].weight.shape, jnp.float32, sharding=row),
            ),
        )
    batch = abstract((x, y), NamedSharding(m, P("data")))
    report = fp8jax.inspect(step, state, *batch)
    assert report.target.startswith("8 x ")
    fp8jax.assert_all_fp8(report)
    for mode in ("cublas", "default"):
        roles = {layer: sorted(r) for layer, r in report.layers(mode).items()}
        # The first layer's input is data: its dgrad is dead code, and XLA removes it.
        assert roles == {"layers.0": ["fwd", "wgrad"], "layers.1": ["dgrad", "fwd", "wgrad"]}
        collectives = report.collectives[mode]
        amax = [c for c in collectives if c.reduction == "maximum"]
        assert amax, collectives
        # Each amax crosses devices as one number (XLA may pack several into one all-reduce:
        # at most the 6 of the program's FP8 operands), never as the tensor it was taken of.
        assert all(c.op == "all-reduce" and c.elements <= 6 for c in amax), amax
        assert not [c for c in collectives if c.op == "all-gather" and c.elements > 1024]


def test_axis_names_that_are_not_the_shard_maps_are_refused_by_name():
    """A recipe's `axis_names` naming an axis the `shard_map` does not have (a typo), or
    given under plain `jit`: JAX's bare AssertionError, or its advice to call `psum`, became
    an error naming the recipe's axes and the mesh's."""
    recipe = fp8jax.DelayedScaling(axis_names=("dta",))
    model = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(32, 32, key=jax.random.key(0)), fp8jax.Fp8Config(recipe=recipe)
    )
    params, static = eqx.partition(model, eqx.is_array)
    run = jax.shard_map(
        lambda p, x: jax.vmap(eqx.combine(p, static))(x),
        mesh=mesh((8,), ("data",)),
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    with pytest.raises(ValueError, match=r"axis_names=\('dta',\): .*its mesh: \('data',\)"):
        jax.jit(run)(params, jnp.ones((64, 32)))
    with pytest.raises(ValueError, match=r"its mesh: none\)\. .*under plain jit leave"):
        jax.jit(jax.vmap(model))(jnp.ones((4, 32)))


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_a_shard_map_over_some_axes_of_an_explicit_mesh_runs_fp8_layers(recipe):
    """`jax.shard_map` over one axis (`model`) of a mesh whose other axis (`data`) stays
    Explicit: the FP8 GEMM failed ("Going from `Manual` AxisType to `Auto` ... is not
    allowed": its Explicit-axes path asked JAX to make every axis Auto, the manual one too),
    where the high-precision dot runs. Now its value and gradients are the step's without a
    mesh (summed in another order)."""
    explicit = jax.sharding.AxisType.Explicit
    the_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(explicit, explicit))
    dims = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 128)).astype(np.float32)
    w = rng.standard_normal((128, 16)).astype(np.float32)
    # Blockwise: 32-wide tiles; each `model` shard's 32 tokens one whole wgrad tile, as the
    # block recipes' tiles inside shard_map are each shard's own.
    make = {"current": fp8jax.CurrentScaling, "blockwise": fp8jax.BlockwiseScaling}[recipe]
    extra = {"block_size": 32} if recipe == "blockwise" else {}
    one = fp8jax.Fp8DotGeneral(make(**extra))
    split = fp8jax.Fp8DotGeneral(make(axis_names=("model",), **extra))

    def loss(dot, x, w):
        return jnp.sum(dot(x, w, dims) ** 2)

    def local_loss(dot, x, w):
        return jax.lax.psum(loss(dot, x, w), "model")

    want = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))(one, x, w)
    sharded = jax.shard_map(
        local_loss, in_specs=(P(), P("model"), P()), out_specs=P(), axis_names={"model"}
    )
    with jax.set_mesh(the_mesh):
        args = jax.device_put(x, P(("model", "data"))), jax.device_put(w, P())
        got = jax.jit(jax.value_and_grad(sharded, argnums=(1, 2)))(split, *args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)))


def test_explicit_mesh_is_the_operands_or_the_scopes_mesh_with_explicit_axes():
    """`explicit_mesh`: the mesh with an Explicit axis that the operands are typed on, else
    the one `jax.set_mesh` gives; `None` for a mesh of Auto axes only, NumPy operands
    outside any mesh, or no mesh at all."""
    from fp8jax._src.core.explicit import explicit_mesh

    types = jax.sharding.AxisType
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=(types.Explicit, types.Auto))
    auto = jax.make_mesh((8,), ("data",), axis_types=(types.Auto,))
    x = np.ones((8, 4), np.float32)
    on_explicit = jax.device_put(x, NamedSharding(explicit, P("data")))
    on_auto = jax.device_put(x, NamedSharding(auto, P("data")))
    assert explicit_mesh(x, on_explicit) == explicit.abstract_mesh  # typed on it, none in scope
    assert explicit_mesh(on_auto, x) is None
    assert explicit_mesh(x) is None
    assert explicit_mesh() is None
    with jax.set_mesh(auto):
        assert explicit_mesh(on_auto) is None
    with jax.set_mesh(explicit):
        assert explicit_mesh(x) == explicit.abstract_mesh  # the scope's, for NumPy operands


def test_split_evenly_keeps_a_split_only_where_its_devices_divide_the_axis():
    """`split_evenly`: a `PartitionSpec` entry kept where the devices of its axes (their
    product, for a tuple) divide the array axis, else `None`, as Explicit sharding needs."""
    from fp8jax._src.core.explicit import split_evenly

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert split_evenly("data", 12, mesh) == "data"
    assert split_evenly("data", 10, mesh) is None
    assert split_evenly(("data", "model"), 16, mesh) == ("data", "model")
    assert split_evenly(("data", "model"), 12, mesh) is None  # 4 x 2 = 8 devices
    assert split_evenly("model", 6, mesh) == "model"
    assert split_evenly(None, 7, mesh) is None

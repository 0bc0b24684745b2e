"""FP8 at scale: the native kernels per device under `jit` sharding, and FP8 weight
all-gathers, once per step.

On 8 CPU devices the kernels run in Mosaic GPU's interpreter, per shard (through
`custom_partitioning`), and train as one device does; on a deviceless compile for 8 H100s, an
FSDP step gathers each weight once, in FP8, and every targeted GEMM is the Mosaic kernel.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax._src.kernels import dispatch, reference
from fp8jax._src.kernels.partition import GemmDims, choose_axes
from fp8jax._src.recipes.base import gemm_dims

MESH_SHAPE = {"data": 2, "model": 4}
BLOCK = 128


# --- which mesh axes each device's kernel keeps ----------------------------------------------


def _dims(lhs_axis=-1, rhs_axis=-1, block=True):
    """The dims of a block-scaled GEMM's two operands (data, scale each)."""
    lhs = fp8jax.QTensor(jnp.zeros((512, 512), jnp.float8_e4m3fn), jnp.zeros((512, 4)), (1, BLOCK))
    rhs = fp8jax.QTensor(
        jnp.zeros((512, 512), jnp.float8_e4m3fn), jnp.zeros((4, 4)), (BLOCK, BLOCK)
    )
    if not block:
        lhs, rhs = (fp8jax.QTensor(q.data, jnp.ones(())) for q in (lhs, rhs))
    return gemm_dims(lhs, rhs, lhs_axis, rhs_axis)


def _choose(dims: GemmDims, lhs: P, rhs: P, mesh=None, shapes=None):
    mesh = mesh or {"data": 8, "model": 4}
    specs = [lhs, lhs, rhs, rhs]  # each scale split like its data
    shapes = shapes or [(512, 512), (512, 4), (512, 512), (4, 4)]
    return choose_axes(dims, shapes, specs, mesh)


@pytest.mark.parametrize(
    "layout, lhs, rhs, want",
    [
        ("data parallel", P("data"), P(), dict(m=("data",))),
        ("FSDP: the weight gathered", P("data"), P(None, "data"), dict(m=("data",))),
        ("column-split Linear", P("data"), P("model"), dict(m=("data",), n=("model",))),
        (
            "row-split Linear: partial sums",
            P("data", "model"),
            P(None, "model"),
            dict(m=("data",), k=("model",)),
        ),
        ("a weight split like the rows: gathered", P("data"), P("data"), dict(m=("data",))),
        (
            "FSDP and TP on one weight",
            P("data"),
            P("model", "data"),
            dict(m=("data",), n=("model",)),
        ),
    ],
)
def test_each_device_keeps_the_activations_split(layout, lhs, rhs, want):
    chosen = _choose(_dims(), lhs, rhs)
    assert chosen == {"b": (), "m": (), "k": (), "n": (), **want}, layout


def test_a_wgrad_contracts_the_tokens_on_their_devices():
    # wgrad: g (tokens, out) . x (tokens, in), both contracted over the tokens (axis -2).
    dims = _dims(lhs_axis=-2, rhs_axis=-2, block=False)
    chosen = _choose(dims, P("data"), P("data"))
    assert chosen["k"] == ("data",) and chosen["m"] == chosen["n"] == ()


def test_shards_that_would_split_a_scale_block_are_gathered():
    """K = 512 over 8 devices leaves 64 columns each: half a 128-wide scale block. Over the
    4 of `model` each holds one whole block."""
    assert _choose(_dims(), P(None, "data"), P(None, "data"))["k"] == ()
    assert _choose(_dims(), P(None, "model"), P(None, "model"))["k"] == ("model",)
    # Per-tensor scales have no blocks: 64 columns each are fine.
    dims = _dims(block=False)
    assert _choose(dims, P(None, "data"), P(None, "data"))["k"] == ("data",)


def test_rows_that_do_not_divide_evenly_are_gathered():
    shapes = [(500, 512), (500, 4), (512, 512), (4, 4)]
    assert _choose(_dims(), P("data"), P(), shapes=shapes)["m"] == ()


# --- numerics on 8 CPU devices -----------------------------------------------------------------

RECIPES = {
    "blockwise": fp8jax.BlockwiseScaling(native_kernel=True),
    "residual": fp8jax.ResidualFP8(native_kernel=True),
}


def _mlp(recipe):
    mlp = eqx.nn.MLP(256, 256, 512, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    return fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))


def _batch():
    rows = jnp.exp(jnp.linspace(-2.0, 2.0, 128))[:, None]  # each device's shard its own amax
    x = jax.random.normal(jax.random.key(1), (128, 256)) * rows
    return x, jnp.sin(x)


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _outputs_and_grads(model, x, y):
    out = jax.vmap(model)(x)
    loss, grads = fp8jax.filter_value_and_grad(_loss)(model, x, y)
    return out, loss, grads


def _mesh():
    assert jax.device_count() >= 8, "tests expect 8 CPU devices (see conftest.py)"
    axis_types = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh(tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE), axis_types=axis_types)


def _placed(model, x, y, layout, mesh):
    """The model and batch placed for `layout` on `mesh`: tokens over `data` (over both axes
    for FSDP); FSDP: weights split on their input axis; tensor: the first Linear split by
    columns, the second by rows over `model`."""
    rows = P(("data", "model")) if layout == "fsdp" else P("data")

    def spec(path, a):
        key = jax.tree_util.keystr(path)
        if layout == "fsdp" and key.endswith(".weight"):
            return P(None, ("data", "model"))
        if layout == "tensor" and key.endswith("layers[0].weight"):
            return P("model")
        if layout == "tensor" and key.endswith("layers[0].bias"):
            return P("model")
        if layout == "tensor" and key.endswith("layers[1].weight"):
            return P(None, "model")
        return P()

    model = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.device_put(a, NamedSharding(mesh, spec(p, a))) if eqx.is_array(a) else a,
        model,
    )
    batch = [jax.device_put(a, NamedSharding(mesh, rows)) for a in (x, y)]
    return model, batch


@pytest.mark.parametrize("layout", ["data", "fsdp", "tensor"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_native_kernels_per_shard_train_like_one_device(name, layout):
    """One step's outputs, loss and gradients on 8 devices equal one device's, to float32
    rounding (sums over the tokens' or a row-split Linear's shards), and each GEMM ran per
    shard: the jaxpr holds its `custom_partitioning`. Interpreted, each device runs the XLA
    path, the kernel's numerics twin (Mosaic GPU's interpreter cannot run inside a partitioned
    program: `dispatch.choose`); the compile for 8 H100s below shows the kernels there."""
    model, (x, y) = _mlp(RECIPES[name]), _batch()
    mesh = _mesh()
    step = eqx.filter_jit(_outputs_and_grads)
    xla = dataclasses.replace(RECIPES[name], native_kernel=False)
    want = step(_mlp(xla), x, y)  # one device's XLA path: the numerics of the kernel
    with dispatch.interpreted():
        placed, batch = _placed(model, x, y, layout, mesh)
        got = step(placed, *batch)
        jaxpr = str(eqx.filter_make_jaxpr(_outputs_and_grads)(placed, *batch)[0])
    assert "custom_partitioning" in jaxpr
    out, loss, grads = got
    want_out, want_loss, want_grads = want
    # XLA's CPU dots round a row's sum differently by the shape they see (one float32 ulp);
    # a row-split Linear adds its devices' partial sums: float32 summation over its K = 512.
    if layout == "tensor":
        atol = reference.float32_sum_bound(512, float(np.abs(want_out).max()))
        np.testing.assert_allclose(out, want_out, rtol=0, atol=atol)
    else:
        np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    leaves, want_leaves = (
        jax.tree.leaves(eqx.filter(g, eqx.is_array)) for g in (grads, want_grads)
    )
    assert len(leaves) == len(want_leaves)
    for a, b in zip(leaves, want_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

"""FP8 at scale: the native kernels per device under `jit` sharding, and FP8 weight
all-gathers, once per step.

On 8 CPU devices each GEMM runs per shard (through `custom_partitioning`) and trains as one
device does, and the kernels themselves, in Mosaic GPU's interpreter, run on every device's
shards as XLA's partitioner decided (`dispatch.run_interpreted`); on a deviceless compile for
8 H100s, an FSDP step gathers each weight once, in FP8, and every targeted GEMM is the Mosaic
kernel.
"""

import contextvars
import dataclasses
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import h100_topology, run_with_mosaic_dump, scales_per_element
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax._src.core import contexts
from fp8jax._src.kernels import (
    BLOCK_GEMM_NAME,
    GROUPED_ROWS_NAME,
    GROUPED_TOKENS_NAME,
    dispatch,
    partition,
    reference,
)
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
    assert chosen == {"b": (), "m": (), "k": (), "n": (), "g": (), **want}, layout


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


def test_each_factor_keeps_only_axes_of_several_devices_not_taken_and_agreed():
    """`choose_axes`' rule written out: the contraction stays split only where every operand
    splits it alike (else gathered), a mesh axis of one device is no split, an axis the rows
    took is not the columns' too, and the columns follow the first rhs array."""
    # The activation's K split over `model`, the weight's not: K gathered, rows kept.
    assert _choose(_dims(), P("data", "model"), P()) == dict(b=(), m=("data",), k=(), n=(), g=())
    # `model` of one device: nothing to keep.
    mesh = {"data": 8, "model": 1}
    got = _choose(_dims(), P("data", "model"), P(None, "model"), mesh=mesh)
    assert got["k"] == () and got["m"] == ("data",)
    # Rows and the weight's columns both over `model` (4 ways: whole 128-row blocks each).
    got = _choose(_dims(), P("model"), P("model"))
    assert got["m"] == ("model",) and got["n"] == ()
    # Two rhs arrays (a fused residual's terms, per-tensor scales): columns as the first's.
    cols = (("n", 1), ("k", 1))
    dims = GemmDims(((("m", 1), ("k", 1)), (), cols, (), cols, ()), ("m", "n"))
    shapes = [(512, 512), (), (512, 512), (), (512, 512), ()]
    got = choose_axes(dims, shapes, [P(), P(), P("model"), P(), P(), P()], MESH_SHAPE)
    assert got["n"] == ("model",)


def test_shards_of_a_ragged_last_block_are_gathered():
    """K = 448: 4 scale blocks, the last of 64 columns. Over the 4 of `model` each device
    would hold 112 columns, not a whole 128-wide block: K is gathered."""
    shapes = [(512, 448), (512, 4), (512, 448), (4, 4)]
    assert _choose(_dims(), P(None, "model"), P(None, "model"), shapes=shapes)["k"] == ()


def test_split_partial_sums_are_scattered_only_along_an_output_axis_not_yet_split():
    """A split contraction's partial sums (over `model`) are reduce-scattered along the
    first output axis XLA wants split over `model`, evenly and not already split by a
    factor (the rows over `data`): else all-reduced (`None`)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def scatter(spec, out_axes, shape=(512, 512)):
        result = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        return partition.scatter_axis(result, out_axes, ("model",), mesh)

    assert scatter(P(None, "model"), [("data",), ()]) == (1, ("model",))
    assert scatter(P(("data", "model")), [("data",), ()]) is None  # rows split already
    assert scatter(P(None, "model"), [("data",), ()], shape=(512, 510)) is None  # uneven
    assert scatter(P(), [(), ()]) is None


def test_partial_sums_over_two_axes_scattered_over_one_are_summed_over_the_other():
    """K split over ("data", "model"), the output wanted split over `model` alone: each
    device's partial sums are reduce-scattered over `model` and summed over `data`, giving
    NumPy's product (integer values: exact), split as asked."""
    dims = GemmDims(((("m", 1), ("k", 1)), (("n", 1), ("k", 1))), ("m", "n"))
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-2, 3, (n, 512)).astype(np.float32) for n in (16, 64))
    k_split = NamedSharding(mesh, P(None, ("data", "model")))

    def gemm(a, b):
        product = lambda a, b, out_dtype: (a @ b.T).astype(out_dtype)  # noqa: E731
        return partition.per_shard(product, dims, jnp.float32, a, b)

    out_sharding = NamedSharding(mesh, P(None, "model"))
    out = jax.jit(gemm, out_shardings=out_sharding)(*(jax.device_put(t, k_split) for t in (a, b)))
    assert out.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(out, a @ b.T)


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


@pytest.mark.parametrize(
    "name, layout",
    # The residual kernel's operands (per-tensor scales, two terms) in the layout with the
    # most to get right (the row-split Linear's partial sums); the rule is the same code.
    [("blockwise", "data"), ("blockwise", "fsdp"), ("blockwise", "tensor"), ("residual", "tensor")],
    ids=["blockwise-data", "blockwise-fsdp", "blockwise-tensor", "residual-tensor"],
)
def test_native_kernels_per_shard_train_like_one_device(name, layout):
    """One step's outputs, loss and gradients on 8 devices equal one device's, to float32
    rounding (sums over the tokens' or a row-split Linear's shards), twice
    (`dispatch.run_interpreted`): as XLA partitions the program, each GEMM per shard through
    its `custom_partitioning` (each device runs the XLA path there, the kernel's numerics
    twin: Mosaic GPU's interpreter cannot run inside a partitioned program), and with the
    kernels themselves, interpreted, run on every device's shards as the partitioner decided.
    The compile for 8 H100s below shows the kernels in the partitioned program."""
    model, (x, y) = _mlp(RECIPES[name]), _batch()
    xla = dataclasses.replace(RECIPES[name], native_kernel=False)
    want = eqx.filter_jit(_outputs_and_grads)(_mlp(xla), x, y)  # the kernel's numerics
    placed, batch = _placed(model, x, y, layout, _mesh())
    run = dispatch.run_interpreted(_outputs_and_grads, placed, *batch)
    # Forward, dgrad and wgrad of both Linears (the first's dgrad unused) partitioned, split.
    split = [p for p in run.plans if p is not None and any(p.chosen.values())]
    assert len(split) >= 5, run.plans
    assert run.jaxpr.count(BLOCK_GEMM_NAME) >= 6  # the residual recipe's fused kernel too
    for got in (run.partitioned, run.outputs):
        _assert_trains_like(got, want, layout)


def _assert_trains_like(got, want, layout):
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


#: What the stand-in GEMM reads: an fp8jax setting (`persistent_kernel()`, `interpreted()`
#: are) and a context variable of the caller's own.
_FACTORS = {
    "setting": contexts.Setting("test_factor", 1.0),
    "context variable": contextvars.ContextVar("test_factor", default=1.0),
}


def _scaled_gemm(a, b, out_dtype):
    """A stand-in GEMM that reads both factors where it is traced."""
    factor = _FACTORS["setting"].get() * _FACTORS["context variable"].get()
    return (a @ b.T * factor).astype(out_dtype)


@pytest.mark.parametrize("kind", list(_FACTORS))
def test_each_devices_gemm_is_traced_in_the_callers_context(kind):
    """XLA's partitioner traces each device's GEMM while it compiles, on a thread of its
    own: what the caller set (`persistent_kernel()`, `interpreted()`, its own context
    variables) holds there. Without it, a sharded step traced under `persistent_kernel()`
    would run the tiled kernel on its devices."""
    dims = partition.GemmDims(((("m", 1), ("k", 1)), (("n", 1), ("k", 1))), ("m", "n"))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    a = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("data")))
    b = jnp.ones((16, 32))
    gemm = jax.jit(lambda a, b: partition.per_shard(_scaled_gemm, dims, jnp.float32, a, b))
    factor = _FACTORS[kind]
    if kind == "setting":
        with contexts.setting(factor, 3.0):
            out = gemm(a, b)
    else:
        token = factor.set(3.0)
        try:
            out = gemm(a, b)
        finally:
            factor.reset(token)
    np.testing.assert_array_equal(out, np.full((64, 16), 96.0, np.float32))


@pytest.mark.parametrize("placed", ["device_put", "set_mesh", "in_shardings alone"])
def test_the_ways_of_sharding_that_split_a_native_kernel(placed):
    """docs/scaling_out.md: arrays placed by `device_put`, or `jit`'s `in_shardings` inside
    `jax.set_mesh`, run fp8jax's native kernels per shard. There a jit argument is typed
    without the mesh, and a GEMM of it took the one-device path (XLA then gathered its
    operands onto one device). `in_shardings` alone, on arrays not placed, still does: no
    type or context names the mesh while tracing (the docs said it works as `device_put`)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    a = jnp.ones((64, 32))
    one_device = []

    def gemm(a):
        one_device.append(dispatch.per_device_gemm(a))
        return a

    if placed == "device_put":
        jax.jit(gemm).lower(jax.device_put(a, rows))
    elif placed == "set_mesh":
        with jax.set_mesh(mesh):
            jax.jit(gemm, in_shardings=rows).lower(a)
    else:
        jax.jit(gemm, in_shardings=rows).lower(a)
    # The limitation the docs name: if JAX types such arrays on the mesh, update them.
    assert one_device == [placed == "in_shardings alone"]


@pytest.mark.parametrize("under_set_mesh", [True, False], ids=["set_mesh", "in_shardings alone"])
def test_a_block_gemm_jitted_with_in_shardings_is_split_only_under_set_mesh(under_set_mesh):
    """docs/scaling_out.md's rule, on the program: a block-scaled GEMM (the default
    `native_kernel=None`) of a `jit` argument sharded by `in_shardings` is lowered per shard
    (`partition.per_shard`: the `custom_partitioning` call, each device's GEMM on its
    shards) under `jax.set_mesh`, and not without it, where (compiled for H100s) XLA gathers
    the operands and runs the kernel on the whole of them."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    dot = fp8jax.Fp8DotGeneral(fp8jax.BlockwiseScaling())
    step = jax.jit(
        lambda x, w: dot(x, w, (((1,), (1,)), ((), ()))),
        in_shardings=(NamedSharding(mesh, P("data")), NamedSharding(mesh, P())),
    )
    x, w = jnp.ones((256, BLOCK)), jnp.ones((BLOCK, BLOCK))
    if under_set_mesh:
        with jax.set_mesh(mesh):
            hlo = step.lower(x, w).as_text()
    else:
        hlo = step.lower(x, w).as_text()
    # If JAX comes to name jit's in_shardings while tracing, both split: update the docs.
    assert ("@CustomSPMDPartitioning" in hlo) == under_set_mesh


def test_a_replay_names_a_trace_with_more_gemms_than_recorded():
    dims = partition.GemmDims(((("m", 1), ("k", 1)), (("n", 1), ("k", 1))), ("m", "n"))
    a, b = jnp.ones((8, 4)), jnp.ones((2, 4))
    with partition.replaying([None]) as replay:
        np.testing.assert_array_equal(
            partition.per_shard(_scaled_gemm, dims, jnp.float32, a, b), a @ b.T
        )
        with pytest.raises(RuntimeError, match="replaying 1 recorded GEMM plans"):
            partition.per_shard(_scaled_gemm, dims, jnp.float32, a, b)
    assert replay.used == 1
    # Interpreted, `choose` replays the plans on one device's arrays too (they were
    # recorded on a partitioned mesh): the kernel through `per_shard`, each plan used once.
    native = lambda a, b, out_dtype: (a @ b.T).astype(out_dtype)  # noqa: E731
    with dispatch.interpreted(), partition.replaying([None]) as replay:
        dispatch.choose(None, native, lambda a, b: a @ b.T, a, b, dims=dims)
    assert replay.used == 1


# --- FP8 weight all-gathers ---------------------------------------------------------------------

GATHERED = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
}


@pytest.mark.parametrize("cols", [1024, 768], ids=["whole blocks", "blocks split"])
@pytest.mark.parametrize("name", sorted(GATHERED))
def test_an_fsdp_weight_quantized_on_its_shards_gathers_bit_for_bit(name, cols):
    """A weight split over 8 devices on its input axis, quantized where it lies (a global
    scale for per-tensor recipes: the amax crosses devices as one number), then gathered:
    bit for bit the weight quantized whole on one device, and what moves is FP8 (and float32
    block scales). 768 columns leave 96 per device: a 128 x 128 block spans two devices,
    whose partial block amaxes XLA combines across them; the result is the same. (Whole on
    one device, a blockwise weight comes in the layout of the native kernels, each block's
    scale repeated over the rows of its tiles: compared per element.)"""
    recipe = GATHERED[name]
    rows = jnp.exp(jnp.linspace(-3.0, 3.0, 256))[:, None]
    w = jax.random.normal(jax.random.key(2), (256, cols)) * rows
    state = recipe.init_state("kernel", w.shape)

    def quantize(w):
        return recipe.quantize(w, state, "kernel", -1)

    want = jax.jit(quantize)(w)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.device_put(w, NamedSharding(mesh, P(None, "data")))
    gathered = jax.jit(quantize, out_shardings=NamedSharding(mesh, P()))
    got = gathered(split)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(got))
    (q_got, new_got), (q_want, new_want) = got, want
    pairs = [(q_got.data, q_want.data), (scales_per_element(q_got), scales_per_element(q_want))]
    pairs += zip(jax.tree.leaves(new_got), jax.tree.leaves(new_want), strict=True)
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(
            np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)
        )


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_an_fsdp_weight_gathers_as_fp8_on_eight_h100s(name):
    """On a compile for 8 H100s, what the gather of a quantized FSDP weight moves: FP8 data
    and float32 block scales, never a high-precision copy (a CPU compile moves FP8 as float16:
    XLA's CPU collectives take no 8-bit floats)."""
    h100_topology(8)
    recipe = GATHERED[name]
    mesh = fp8jax.h100_mesh({"data": 8})
    state = recipe.init_state("kernel", (256, 1024))

    def quantize(w):
        q = recipe.quantize(w, state, "kernel", -1)
        return jax.lax.with_sharding_constraint(q, NamedSharding(mesh, P()))

    w = jax.ShapeDtypeStruct(
        (256, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data"))
    )
    report = fp8jax.inspect(quantize, w, modes=("cublas",))
    gathers = [c for c in report.collectives["cublas"] if c.op == "all-gather"]
    assert gathers
    for c in gathers:
        for shape, dtype in zip(c.shapes, c.dtypes, strict=True):
            assert dtype == "f8e4m3fn" or (dtype == "f32" and shape in ((2, 8), ())), c


def _scanned(recipe, width: int, hidden: int, layers: int = 2):
    """`layers` MLP blocks stacked for `lax.scan` (FP8 when `recipe` is given): (params,
    static) and a loss scanning the blocks, float32 masters cast to BF16 in the loss."""

    def block(key):
        mlp = eqx.nn.MLP(width, width, hidden, 1, activation=jax.nn.gelu, key=key)
        return (
            mlp
            if recipe is None
            else fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
        )

    params, static = eqx.partition(
        eqx.filter_vmap(block)(jax.random.split(jax.random.key(0), layers)), eqx.is_array
    )

    def loss(params, x, y):
        def body(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None

        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean((h - y) ** 2)

    return params, loss


def _fsdp_stacked(params, mesh, axis):
    def place(path, a):
        if not eqx.is_array(a):
            return a
        weight = jax.tree_util.keystr(path).endswith(".weight") and a.ndim == 3
        return NamedSharding(mesh, P(None, None, axis) if weight else P())

    return jax.tree_util.tree_map_with_path(place, params)


def test_a_scan_over_fsdp_layers_trains_like_one_device():
    """Layers under `lax.scan` with FSDP weights on 8 devices (each weight gathered in the
    forward loop and kept for the backward loop): one device's loss and gradients, to
    float32 rounding."""
    params, loss = _scanned(fp8jax.DelayedScaling(), 64, 256)
    x, _ = _batch()
    x = x[:, :64]
    y = jnp.sin(x)
    grad = eqx.filter_jit(fp8jax.filter_value_and_grad(loss))
    want_loss, want = grad(params, x, y)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = _fsdp_stacked(params, mesh, "data")
    placed = jax.tree.map(
        lambda a, s: jax.device_put(a, s) if eqx.is_array(a) else a, params, shardings
    )
    rows = NamedSharding(mesh, P("data"))
    got_loss, got = grad(placed, jax.device_put(x, rows), jax.device_put(y, rows))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    leaves, want_leaves = (jax.tree.leaves(eqx.filter(g, eqx.is_array)) for g in (got, want))
    assert len(leaves) == len(want_leaves)
    for a, b in zip(leaves, want_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_scan_over_layers_gathers_each_fp8_weight_once():
    """Under `lax.scan` over layers the backward loop cannot share the forward loop's
    gather: BF16 gathers each weight twice; fp8jax gathers the FP8 weight once, in the
    forward loop, and keeps it for the dgrad (0.25x BF16's bytes); `per_gemm` gathers it
    again (0.5x). Compiled for 8 H100s."""
    h100_topology(8)
    mesh = fp8jax.h100_mesh({"data": 8})
    variants = {
        "bf16": None,
        "delayed": fp8jax.DelayedScaling(),
        "blockwise": fp8jax.BlockwiseScaling(),
        "delayed, re-gathered": fp8jax.DelayedScaling(weight_gather="per_gemm"),
    }
    moved = {}
    for name, recipe in variants.items():
        params, loss = _scanned(recipe, 256, 1024)

        def bf16_loss(params, x, y, loss=loss):
            params = jax.tree.map(
                lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
                params,
                is_leaf=lambda n: isinstance(n, fp8jax.OverwriteWithGradient),
            )
            return loss(params, x, y.astype(jnp.bfloat16)).astype(jnp.float32)

        shardings = _fsdp_stacked(params, mesh, "data")
        abstract = jax.tree.map(
            lambda a, s: (
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if eqx.is_array(a) else a
            ),
            params,
            shardings,
        )
        rows = NamedSharding(mesh, P("data"))
        batch = [jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=rows)] * 2
        grad = eqx.filter_jit(fp8jax.filter_value_and_grad(bf16_loss))
        report = fp8jax.inspect(grad, abstract, *batch, modes=("cublas",))
        moved[name] = report.cost["cublas"].communication.get("all-gather", 0)
    weights = 2 * 2 * 256 * 1024 * 7 // 8  # elements each GPU receives to gather every weight
    assert moved["bf16"] == pytest.approx(2 * 2 * weights, rel=0.01)  # twice, two bytes each
    for name in ("delayed", "blockwise"):
        assert 0.25 <= moved[name] / moved["bf16"] <= 0.26, moved
    assert moved["delayed, re-gathered"] / moved["bf16"] == pytest.approx(0.5, abs=0.01), moved


# --- grouped GEMMs (mixture of experts) ---------------------------------------------------------

GROUPED = {
    "delayed-e4m3": fp8jax.DelayedScaling(backward_format="e4m3"),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
}
GROUP_SIZES = np.array([70, 0, 130, 56], np.int32)  # 256 tokens: 32 a device, groups split


def test_local_group_sizes_count_each_group_within_a_slice():
    sizes = jnp.array([70, 0, 130, 56], jnp.int32)
    for start, length in ((0, 32), (64, 32), (192, 64), (224, 32), (250, 6)):
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        want = [
            max(0, min(hi, start + length) - max(lo, start))
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        got = partition.local_group_sizes(sizes, jnp.int32(start), length)
        assert got.tolist() == want, (start, length)


def test_a_device_on_two_mesh_axes_counts_the_groups_of_its_own_slice():
    """Rows split over ("data", "model") (2 x 4): the device at data 1, model 2 holds slice
    1 * 4 + 2 = 6 of 8 rows each, rows 48-55; groups of 40, 20 and 4 rows give it 0, 8, 0."""
    import types

    dims = GemmDims(((("m", 1), ("k", 1)), (("g", 1),)), ("m",), ragged=(1, "m"))
    mesh = types.SimpleNamespace(shape={"data": 2, "model": 4})
    leaves = [jnp.zeros((8, 4)), jnp.array([40, 20, 4], jnp.int32)]
    chosen = {"m": ("data", "model")}
    got = partition.local_groups(leaves, dims, chosen, mesh, {"data": 1, "model": 2})
    assert np.asarray(got[1]).tolist() == [0, 8, 0]


@pytest.mark.parametrize(
    "name, layout",
    [("delayed-e4m3", "data"), ("current", "fsdp"), ("blockwise", "data"), ("blockwise", "fsdp")],
    ids=["delayed-e4m3-data", "current-fsdp", "blockwise-data", "blockwise-fsdp"],
)
def test_grouped_gemms_per_shard_train_like_one_device(name, layout):
    """An expert layer with its tokens (in expert order) split over 8 devices, experts'
    weights replicated or split for FSDP: forward, dgrad and wgrad per shard, each device
    with the group sizes of its slice of the tokens, equal one device's to float32 summation
    (the wgrad adds the devices' partial sums)."""
    rng = np.random.default_rng(5)
    m, k, n = int(GROUP_SIZES.sum()), 128, 128
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    w = rng.standard_normal((4, k, n)).astype(np.float32)
    w *= np.array([0.01, 1.0, 30.0, 0.3], np.float32)[:, None, None]
    g = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    sizes = jnp.asarray(GROUP_SIZES)

    def step(dot, x, w, g):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        return y, *vjp(g)[1:]

    recipe = GROUPED[name]
    off = fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=False)
    want = eqx.filter_jit(step)(off, x, w, g)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    weights = NamedSharding(mesh, P(None, "data") if layout == "fsdp" else P())
    on = fp8jax.Fp8RaggedDot(recipe, num_experts=4, native_kernel=True)
    args = (jax.device_put(x, rows), jax.device_put(w, weights), jax.device_put(g, rows))
    run = dispatch.run_interpreted(step, on, *args)
    # Forward, dgrad (each device's slice of the tokens, its slice's group sizes) and wgrad
    # partitioned; the kernels run as recorded.
    assert sum(p is not None and p.chosen["m"] == ("data",) for p in run.plans) >= 2
    assert sum(p is not None for p in run.plans) >= 3, run.plans
    assert "custom_partitioning" not in run.jaxpr
    assert run.jaxpr.count(GROUPED_ROWS_NAME) >= 2
    assert GROUPED_TOKENS_NAME in run.jaxpr or BLOCK_GEMM_NAME in run.jaxpr  # the wgrad
    for got in (run.partitioned, run.outputs):
        for a, b, terms in zip(got, want, (k, n, m), strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            atol = reference.float32_sum_bound(terms, float(np.abs(b).max()))
            np.testing.assert_allclose(a, b, rtol=0, atol=atol)


# --- a compile for 8 H100s ----------------------------------------------------------------------

H100_RECIPES = {
    "bf16": None,
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(),
    "residual": fp8jax.ResidualFP8(native_kernel=None),  # the fused kernel on Hopper
    "mxfp8": fp8jax.MXFP8(),  # no native kernel: its XLA GEMMs per shard
    "blockwise, re-gathered": fp8jax.BlockwiseScaling(weight_gather="per_gemm"),
}


@pytest.fixture(scope="module")
def fsdp_reports():
    """An FSDP train step (an MLP 512 -> 2048 -> 512, 2,048 tokens over 8 H100s, weights
    split on their input axis, float32 masters cast to BF16 in the loss) compiled per
    recipe: `{name: Inspection}`."""
    h100_topology(8)
    mesh = fp8jax.h100_mesh({"data": 8})
    mlp = eqx.nn.MLP(512, 512, 2048, 1, activation=jax.nn.gelu, key=jax.random.key(0))

    def loss(model, x, y):
        model = jax.tree.map(
            lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
            model,
            is_leaf=lambda n: isinstance(n, fp8jax.OverwriteWithGradient),
        )
        return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - y) ** 2)

    def step(model, x, y):
        value, grads = fp8jax.filter_value_and_grad(loss)(model, x, y)
        overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -1e-3 * g, grads)
        return fp8jax.apply_updates(model, updates, overwrites), value

    def place(path, a):
        if not eqx.is_array(a):
            return a
        key = jax.tree_util.keystr(path)
        spec = P(None, "data") if key.endswith(".weight") and a.ndim == 2 else P()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    rows = NamedSharding(mesh, P("data"))
    batch = [jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=rows)] * 2
    reports = {}
    for name, recipe in H100_RECIPES.items():
        model = (
            mlp
            if recipe is None
            else fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=recipe))
        )
        model = jax.tree_util.tree_map_with_path(place, model)
        reports[name] = fp8jax.inspect(eqx.filter_jit(step), model, *batch, modes=("cublas",))
    return reports


def test_fsdp_gathers_each_fp8_weight_once(fsdp_reports):
    """All-gather bytes per GPU against BF16's (each BF16 weight gathered once): one byte an
    element for the per-tensor recipes and blockwise scaling (and its block scales), two for
    the residual recipe's two terms; re-gathering for the dgrad doubles the second weight's."""
    moved = {
        n: r.cost["cublas"].communication.get("all-gather", 0) for n, r in fsdp_reports.items()
    }
    ratio = {n: b / moved["bf16"] for n, b in moved.items()}
    for name in ("delayed", "current", "blockwise"):
        assert 0.5 <= ratio[name] <= 0.55, ratio
    assert 1.0 <= ratio["residual"] <= 1.05, ratio
    # MXFP8's dgrad takes the second weight quantized along its other axis (1 x 32 blocks of
    # the output features): another FP8 tensor, gathered too. 0.75 and its E8M0 scales.
    assert 0.75 <= ratio["mxfp8"] <= 0.80, ratio
    # The first layer's dgrad is dead code (its input is data): only the second weight is
    # gathered again, 0.25 more.
    assert ratio["blockwise, re-gathered"] == pytest.approx(ratio["blockwise"] + 0.25, abs=0.01)


def _moved(report) -> dict[str, int]:
    """Elements each kind of collective moves, amax reductions (maxima) apart."""
    out: dict[str, int] = {}
    for c in report.collectives["cublas"]:
        kind = "amax" if c.reduction == "maximum" else c.op
        out[kind] = out.get(kind, 0) + c.elements * (1 if c.dtypes[0].startswith("f8") else 2)
    return out


def test_fsdp_runs_the_native_kernels_and_moves_no_more_than_bf16(fsdp_reports):
    """Every GEMM of the block and residual recipes is a Mosaic kernel on each GPU, and no
    kind of collective moves more than in the BF16 program (activations stay where they are:
    only weights, their scales and the gradients' reductions cross), but the amaxes: one
    number a tensor or a 128 x 128 block split between two GPUs (the weights' 64 columns a
    GPU here), reduced by max."""
    bf16 = _moved(fsdp_reports["bf16"])
    for name, report in fsdp_reports.items():
        if name in ("blockwise", "residual"):
            kernels = {g.kernel for g in report.gemms["cublas"]}
            assert kernels == {"pallas mosaic gpu"}, (name, kernels)
        for kind, moved in _moved(report).items():
            if kind == "amax":  # per-tensor or per-block maxima, not the tensors themselves
                assert moved <= 1e-3 * bf16["all-gather"], (name, kind, moved)
            else:
                assert moved <= bf16[kind], (name, kind, moved, bf16)


@pytest.mark.parametrize("name", ["current", "blockwise"])  # per-tensor and block scales
def test_grouped_gemms_run_the_kernels_on_each_of_eight_h100s(name):
    """An expert layer's forward, dgrad and wgrad with the tokens split over 8 H100s: each
    GPU runs the grouped Mosaic kernels on its tokens (no token crosses GPUs; the experts'
    weights are replicated, the wgrad's partial sums reduced)."""
    h100_topology(8)
    mesh = fp8jax.h100_mesh({"data": 8})
    rows = NamedSharding(mesh, P("data"))
    dot = fp8jax.Fp8RaggedDot(GROUPED[name], num_experts=4, native_kernel=None)

    def step(dot, x, w, g, sizes):
        y, vjp = jax.vjp(lambda d, x, w: d(x, w, sizes), dot, x, w)
        return y, *vjp(g)[1:]

    x = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16, sharding=rows)
    g = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((4, 512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, P()))
    report = fp8jax.inspect(step, dot, x, w, g, sizes, modes=("cublas",))
    gemms = report.gemms["cublas"]
    assert len(gemms) == 3 and {g.kernel for g in gemms} == {"pallas mosaic gpu"}, gemms
    moved = {c.op for c in report.collectives["cublas"] if c.elements > 64}
    assert moved <= {"all-reduce", "reduce-scatter"}, report.collectives["cublas"]


GPT_SCRIPT = """
import json, sys
import equinox as eqx, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import fp8jax
from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss

# Width 512: a row-split Linear's 4 GPUs each hold whole 128-wide tiles of its contraction.
gpt = GPT(GPTConfig(vocab=512, layers=1, width=512, heads=4, context=128), key=jax.random.key(0))

def step(model, tokens):
    return fp8jax.filter_value_and_grad(next_token_loss)(model, tokens)

def placed(model, layout, mesh):
    def one(path, a):
        if not eqx.is_array(a):
            return a
        path = jax.tree_util.keystr(path)
        spec = P()
        if a.ndim == 2 and "blocks" in path and path.endswith(".weight"):
            if layout == "fsdp":
                spec = P(None, "data")
            elif any(f".{n}." in path for n in ("query", "key", "value", "fc1")):
                spec = P("model")
            else:
                spec = P(None, "model")
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(one, model)

out = {}
for layout, axes in (("fsdp", {"data": 8}), ("tensor", {"data": 2, "model": 4})):
    mesh = fp8jax.h100_mesh(axes)
    tokens = jax.ShapeDtypeStruct((16, 129), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    for name in ("bf16", "blockwise"):
        model = gpt if name == "bf16" else fp8jax.fp8_linear_layers(
            gpt, fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling()))
        modes = ("cublas",) if name == "bf16" or layout == "fsdp" else ("cublas", "default")
        report = fp8jax.inspect(
            eqx.filter_jit(step), placed(model, layout, mesh), tokens, modes=modes)
        for mode in modes:
            moved = {}
            for c in report.collectives[mode]:
                kind = "amax" if c.reduction == "maximum" else c.op
                size = 1 if c.dtypes[0].startswith("f8") else (2 if c.dtypes[0] == "bf16" else 4)
                moved[kind] = moved.get(kind, 0) + c.elements * size
            gemms = [(g.layer, g.role, g.kernel, g.fp8, g.mma)
                     for g in report.gemms[mode] if g.layer is not None]
            out[f"{layout}/{name}/{mode}"] = {"moved": moved, "gemms": gemms}
print(json.dumps(out))
"""


def test_example_gpt_on_eight_h100s_runs_the_kernels_and_moves_no_more_than_bf16(tmp_path):
    """The example GPT's train step, FSDP over 8 H100s and tensor-parallel (data 2 x model
    4: query, key, value, fc1 split by columns, out and fc2 by rows; this one in both XLA
    modes, FSDP in cuBLAS mode as `fsdp_reports`): every GEMM of every FP8 layer is the
    block-scaled Mosaic kernel on each GPU, with FP8 `wgmma` in its PTX, and no kind of
    collective moves more bytes than in the BF16 program (the amaxes' maxima apart: there
    are none in BF16)."""
    h100_topology(8)
    run = run_with_mosaic_dump(GPT_SCRIPT, [], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    fp8_mma = re.compile(r"wgmma\.mma_async\..*\.e4m3\.e4m3$")
    assert sorted(seen) == [
        "fsdp/bf16/cublas",
        "fsdp/blockwise/cublas",
        "tensor/bf16/cublas",
        "tensor/blockwise/cublas",
        "tensor/blockwise/default",
    ], sorted(seen)
    for layout, mode in (("fsdp", "cublas"), ("tensor", "cublas"), ("tensor", "default")):
        got, bf16 = seen[f"{layout}/blockwise/{mode}"], seen[f"{layout}/bf16/cublas"]
        # The block's 6 Linears (the head stays BF16: `Fp8Config`'s default `exclude`),
        # a forward, dgrad and wgrad each.
        assert len(got["gemms"]) == 18, got["gemms"]
        for layer, role, kernel, fp8, mma in got["gemms"]:
            assert kernel == "pallas mosaic gpu" and fp8, (layout, mode, layer, role, kernel)
            assert any(fp8_mma.match(m) for m in mma), (layout, mode, layer, role, mma)
        for kind, moved in got["moved"].items():
            if kind == "amax":
                assert moved <= 1e-3 * sum(bf16["moved"].values()), (layout, mode, moved)
            else:
                assert moved <= bf16["moved"][kind], (layout, mode, kind, moved, bf16)

"""Telemetry: saturation and underflow fractions against ml_dtypes, collected as a pytree."""

from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import fp8jax

DIMS = (((1,), (1,)), ((), ()))  # x (M, K) . w (N, K): the canonical GEMM
M, K, N = 64, 256, 128
FORMATS = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}


def spread(rng, shape, low, high):
    """Normal values with log-uniform magnitudes between 10**low and 10**high."""
    return (rng.standard_normal(shape) * 10 ** rng.uniform(low, high, shape)).astype(np.float32)


def ref_stats(x, scale, fmt):
    """(saturated, underflow) of fp8(x * scale), `scale` a scalar or per element.

    Saturated: the float32 product does not round to a finite FP8 value (ml_dtypes' cast does
    not saturate: it gives inf or nan). Underflow: a nonzero value rounds to zero.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(x, np.float32) * np.asarray(scale, np.float32)
        cast = scaled.astype(FORMATS[fmt]).astype(np.float32)
    return np.mean(~np.isfinite(cast)), np.mean((cast == 0) & (x != 0))


def block_scales(x, block, scale_of_amax):
    """Per-element scale of a block recipe, from the reference's block scale rule."""
    out = np.zeros(x.shape, np.float32)
    for r0 in range(0, x.shape[0], block[0]):
        for c0 in range(0, x.shape[1], block[1]):
            tile = x[r0 : r0 + block[0], c0 : c0 + block[1]]
            scale, _ = scale_of_amax(np.float32(np.max(np.abs(tile))))
            out[r0 : r0 + block[0], c0 : c0 + block[1]] = scale
    return out


def run(dot, x, w, c):
    """Gradients of sum(dot(x, w) * c): the output gradient is exactly `c`."""

    def loss(dot, x, w):
        return jnp.sum(dot(x, w, DIMS) * c)

    return eqx.filter_jit(fp8jax.filter_grad(loss))(dot, x, w)


@pytest.fixture
def operands():
    rng = np.random.default_rng(0)
    x = spread(rng, (M, K), -5, 3)
    w = spread(rng, (N, K), -5, 3)
    c = spread(rng, (M, N), -9, 5)
    return x, w, c


def check(stats, expected):
    for role, (saturated, underflow) in expected.items():
        got = getattr(stats, role)
        assert float(got.saturated) == pytest.approx(saturated, abs=0), role
        assert float(got.underflow) == pytest.approx(underflow, abs=0), role


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_per_tensor_statistics_match_ml_dtypes(recipe, operands):
    x, w, c = operands
    dot = fp8jax.Fp8DotGeneral(recipe, telemetry=True)
    for step in range(2):
        x_t, w_t, c_t = x * (1 + 3 * step), w, c * (1 + 3 * step)  # step 2 outgrows history
        grads = run(dot, x_t, w_t, c_t)
        new = fp8jax.apply_updates(dot, None, grads)
        # The scales this step used, as its new state came in (merged, delayed scaling's
        # state holds the next step's).
        expected = {
            "input": ref_stats(x_t, grads.input.scale, "e4m3"),
            "kernel": ref_stats(w_t, grads.kernel.scale, "e4m3"),
            "output_grad": ref_stats(c_t, grads.output_grad.scale, "e5m2"),
        }
        check(new.stats, expected)
        if recipe == "delayed" and step:
            assert float(new.stats.input.saturated) > 0  # a stale scale
        else:
            # Scaled by its own amax (delayed scaling's first step: the warm start).
            assert float(new.stats.input.saturated) == 0
        assert float(new.stats.output_grad.underflow) > 0
        dot = new


def tie_above_max(fmt):
    """The midpoint between `fmt`'s max and the next value its spacing there would give."""
    top = np.array(ml_dtypes.finfo(FORMATS[fmt]).max, FORMATS[fmt])
    below = (top.view(np.uint8) - 1).view(FORMATS[fmt])
    return float(top) + (float(top) - float(below)) / 2


@pytest.mark.parametrize("formats", [("e4m3", "e5m2"), ("e4m3fnuz", "e5m2fnuz")])
def test_statistics_at_the_tie_above_the_max_match_ml_dtypes(formats):
    """A scaled value exactly half a step above the format's max rounds to the max where that
    max's last significand bit is even (E4M3: 464 -> 448), past it where it is odd (E5M2:
    61440 -> inf, and both fnuz formats): saturated as ml_dtypes' unsaturated cast says."""
    forward, backward = formats
    recipe = fp8jax.DelayedScaling(
        warm_start=False, forward_format=forward, backward_format=backward
    )  # scale 1.0 at the first step: the values below are the scaled ones
    dot = fp8jax.Fp8DotGeneral(recipe, telemetry=True)
    x = np.array([[tie_above_max(forward), 1.0], [-1.0, 2.0]], np.float32)
    w = np.array([[1.0, -tie_above_max(forward)], [0.5, 0.25]], np.float32)
    c = np.array([[tie_above_max(backward), 1.0], [3.0, -2.0]], np.float32)
    grads = run(dot, x, w, c)
    expected = {
        "input": ref_stats(x, 1.0, forward),
        "kernel": ref_stats(w, 1.0, forward),
        "output_grad": ref_stats(c, 1.0, backward),
    }
    check(grads.stats, expected)


@pytest.mark.parametrize(
    "recipe, blocks, scale_of_amax",
    [
        (
            fp8jax.BlockwiseScaling(),
            {"input": (1, 128), "kernel": (128, 128), "output_grad": (1, 128)},
            ref.deepseek_scale(),
        ),
        (
            fp8jax.MXFP8(),
            {"input": (1, 32), "kernel": (1, 32), "output_grad": (1, 32)},
            ref.mx_scale(),
        ),
    ],
    ids=["blockwise", "mxfp8"],
)
def test_block_statistics_match_ml_dtypes(recipe, blocks, scale_of_amax, operands):
    x, w, c = operands
    dot = fp8jax.Fp8DotGeneral(recipe, telemetry=True)
    grads = run(dot, x, w, c)
    expected = {
        role: ref_stats(t, block_scales(t, blocks[role], scale_of_amax), "e4m3")
        for role, t in (("input", x), ("kernel", w), ("output_grad", c))
    }
    check(grads.stats, expected)
    assert all(getattr(grads.stats, r).underflow > 0 for r in expected)


def test_residual_statistics_count_values_lost_by_both_terms(operands):
    x, w, c = operands
    dot = fp8jax.Fp8DotGeneral(fp8jax.ResidualFP8(), telemetry=True)
    grads = run(dot, x, w, c)
    scale = ref.current_scale(np.max(np.abs(w)), "e4m3")
    hi = ref.qdq_tensor(w, scale, "e4m3")
    rest = w - hi.astype(np.float32)
    lo_scale = ref.current_scale(np.max(np.abs(rest)), "e4m3")
    lo = ref.cast(rest, lo_scale, "e4m3")
    kernel_underflow = np.mean((hi == 0) & (lo == 0) & (w != 0))
    single = ref_stats(w, scale, "e4m3")[1]
    assert 0 < kernel_underflow < single  # the low term rescues most of what hi flushes
    x_scale = ref.current_scale(np.max(np.abs(x)), "e4m3")
    g_scale = ref.current_scale(np.max(np.abs(c)), "e4m3")
    check(
        grads.stats,
        {
            "input": ref_stats(x, x_scale, "e4m3"),
            "kernel": (0.0, kernel_underflow),
            "output_grad": ref_stats(c, g_scale, "e4m3"),
        },
    )


def test_statistics_span_the_batch_under_vmap(operands, getkey):
    x, _, _ = operands
    linear = eqx.nn.Linear(K, N, key=getkey())
    layer = fp8jax.Linear.from_eqx(linear, fp8jax.Fp8DotGeneral(telemetry=True))

    def loss_vmapped(layer, x):
        return jnp.sum(jax.vmap(layer)(x) ** 2)

    def loss_flat(layer, x):
        return jnp.sum(layer(x) ** 2)

    for grad in (fp8jax.filter_grad, eqx.filter_grad):
        a = eqx.filter_jit(grad(loss_vmapped))(layer, x).dot_general.stats
        b = eqx.filter_jit(grad(loss_flat))(layer, x).dot_general.stats
        assert jax.tree.all(jax.tree.map(lambda u, v: bool(u == v), a, b))
        assert float(a.input.underflow) > 0


def test_shared_layer_keeps_the_worst_use(operands):
    x, w, c = operands
    rng = np.random.default_rng(1)
    dot = fp8jax.Fp8DotGeneral("current", telemetry=True)
    # Another input and gradient: one outlier pushes more of them into the subnormals.
    x2, c2 = spread(rng, (M, K), -5, 3), spread(rng, (M, N), -9, 5)
    x2[0, 0], c2[0, 0] = 1e6, 1e9

    def both(dot, x, x2, w):
        return jnp.sum(dot(x, w, DIMS) * c) + jnp.sum(dot(x2, w, DIMS) * c2)

    grads = eqx.filter_jit(fp8jax.filter_grad(both))(dot, x, x2, w)
    first, second = run(dot, x, w, c).stats, run(dot, x2, w, c2).stats
    assert float(second.input.underflow) > float(first.input.underflow)
    worst = jax.tree.map(jnp.maximum, first, second)
    assert jax.tree.all(jax.tree.map(lambda u, v: bool(u == v), grads.stats, worst))


def test_telemetry_collects_a_pytree_and_report_prints_it(getkey):
    mlp = eqx.nn.MLP(16, 4, 32, 2, key=getkey())
    # Transformer Engine's cold start (scale 1.0), so that the first step saturates.
    cold = fp8jax.DelayedScaling(warm_start=False)
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(recipe=cold, telemetry=True))
    x = jax.random.normal(getkey(), (8, 16)) * 1e3

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    grads = eqx.filter_jit(fp8jax.filter_grad(loss))(model, x)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    stats = eqx.filter_jit(fp8jax.telemetry)(overwrites)  # traceable: no host sync
    assert list(stats) == ["layers.0", "layers.1", "layers.2"]
    first = stats["layers.0"]
    state = overwrites.layers[0].dot_general
    assert float(first.input.amax) == float(state.input.amax_history[0])
    assert float(first.input.history_max) == float(jnp.max(state.input.amax_history))
    assert float(first.input.scale) == float(state.input.scale) == 1.0
    # Scale 1 on inputs of magnitude 1e3: E4M3 saturates at 448.
    expected, underflow = ref_stats(np.asarray(x), 1.0, "e4m3")
    assert float(first.input.saturated) == pytest.approx(expected, abs=0) and expected > 0
    assert float(first.input.underflow) == pytest.approx(underflow, abs=0)
    assert underflow != expected  # so the two fields cannot be swapped unseen
    assert first.formats == ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")
    text = fp8jax.report(stats, quiet=True)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "operand", "format"]
    assert len(lines) == 2 + 3 * 3
    assert lines[2].split()[:3] == ["layers.0", "input", "e4m3fn"]
    assert f"{100 * expected:.3g} %" in lines[2]
    # saturated, zeroed, non-finite steps of a fresh model
    assert fp8jax.report(model, quiet=True).splitlines()[2].split()[-5:] == [
        "0",
        "%",
        "0",
        "%",
        "0",
    ]
    assert lines[0].endswith("non-finite steps")


def test_report_without_telemetry_and_with_a_loss_scale(getkey, capsys):
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey()))
    stats = fp8jax.telemetry(model)
    layer = next(iter(stats.values()))
    assert layer.input.saturated is None and layer.recipe == "DelayedScaling"

    scale = SimpleNamespace(  # what report reads of a dynamic loss scale
        loss_scale=jnp.array(1024.0), skipped_steps=jnp.array(3), total_steps=jnp.array(200)
    )
    fp8jax.report(model, loss_scale=scale)
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[-3:] == ["-", "-", "-"]
    # A fresh delayed layer (warm start) has recorded no scale yet: its state's 0 is no scale.
    assert float(layer.input.scale) == 0 and out.splitlines()[2].split()[3] == "-"
    assert "scale -: none recorded yet" in out.splitlines()[-3]
    assert out.splitlines()[-2] == "loss scale 1024, skipped 3 of 200 steps (1.5 % overflow)"
    assert out.splitlines()[-1].startswith("output_grad in the loss's units")


def test_stacked_layers_report_one_row_per_layer(getkey):
    hax = pytest.importorskip("haliax")
    Layer, In, Out = hax.Axis("layer", 3), hax.Axis("in", 8), hax.Axis("out", 8)
    stacked = hax.nn.Stacked.init(Layer, hax.nn.Linear)(In, Out, key=jax.random.split(getkey(), 3))
    model = fp8jax.fp8_linear_layers(stacked, fp8jax.Fp8Config(telemetry=True))
    stats = fp8jax.telemetry(model)
    (name,) = stats
    assert stats[name].kernel.saturated.shape == (3,)
    rows = fp8jax.report(stats, quiet=True).splitlines()[2:]
    assert rows.pop().startswith("scale -: none recorded yet")  # a fresh model's
    assert [r.split()[0] for r in rows[::3]] == [f"{name}[{i}]" for i in range(3)]


def test_one_layer_of_a_stack_reports_under_the_stacks_name(getkey):
    """docs/training.md: `stacked.get_layer(1)` carries the stack's name, so its telemetry
    is under `name`, not `name[1]`; its figures are the stack's entry sliced at 1."""
    hax = pytest.importorskip("haliax")
    Layer, In, Out = hax.Axis("layer", 3), hax.Axis("in", 8), hax.Axis("out", 8)
    stacked = hax.nn.Stacked.init(Layer, hax.nn.Linear)(In, Out, key=jax.random.split(getkey(), 3))
    model = fp8jax.fp8_linear_layers(stacked, fp8jax.Fp8Config(telemetry=True))
    (name,) = whole = fp8jax.telemetry(model)
    one = fp8jax.telemetry(model.get_layer(1))
    assert list(one) == [name]
    want = jax.tree.map(lambda a: np.asarray(a)[1], whole[name])
    for a, b in zip(jax.tree.leaves(one[name]), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nested_stacked_layers_report_each_layers_own_state_after_a_step():
    """A Haliax Stacked of Stackeds (the inner one of length 1), trained a step: telemetry
    holds one entry with both layer axes, each layer's amaxes those read by hand from its
    own input, weight and output gradient, and the report names each `name[i][j]`."""
    hax = pytest.importorskip("haliax")
    import optax

    Outer, Inner = hax.Axis("outer", 3), hax.Axis("inner", 1)
    In, Out, Batch = hax.Axis("in", 8), hax.Axis("out", 8), hax.Axis("batch", 4)

    class Block(eqx.Module):
        lin: hax.nn.Linear

        @staticmethod
        def init(key):
            return Block(hax.nn.Linear.init(In, Out, key=key))

        def __call__(self, x):
            return (hax.tanh(self.lin(x)) * 2).rename({"out": "in"})

    class Group(eqx.Module):
        inner: hax.nn.Stacked

        @staticmethod
        def init(key):
            return Group(hax.nn.Stacked.init(Inner, Block)(jax.random.split(key, Inner.size)))

        def __call__(self, x):
            return self.inner.fold(x)

    stacked = hax.nn.Stacked.init(Outer, Group)(jax.random.split(jax.random.key(0), Outer.size))
    model = fp8jax.fp8_linear_layers(stacked, fp8jax.Fp8Config(telemetry=True))
    x = hax.named(spread(np.random.default_rng(1), (4, 8), -1, 1), (Batch, In))
    step = fp8jax.make_train_step(
        lambda m, x: hax.sum(m.fold(x) ** 2).scalar(), optax.sgd(0.0), compiler_options={}
    )
    state, _ = step(step.init(model), x)
    (name,) = stats = fp8jax.telemetry(state.model)
    layer = stats[name]
    assert layer.input.amax.shape == (Outer.size, Inner.size)
    h = x
    for i in range(Outer.size):  # each layer's own input and weight, read by hand
        lin = model.get_layer(i).inner.get_layer(0).lin
        got_input, got_kernel = layer.input.amax[i, 0], layer.kernel.amax[i, 0]
        assert float(got_input) == pytest.approx(np.abs(np.asarray(h.array)).max(), rel=1e-6)
        assert float(got_kernel) == np.abs(np.asarray(lin.weight.array, np.float64)).max()
        h = model.get_layer(i)(h)
    y = np.asarray(h.array, np.float64)  # the last output, 2 tanh(z): d sum(y^2) / dz
    grad = np.abs(2 * y * 2 * (1 - (y / 2) ** 2)).max()
    assert float(layer.output_grad.amax[-1, 0]) == pytest.approx(grad, rel=1e-5)
    rows = fp8jax.report(stats, quiet=True).splitlines()[2:]
    assert [r.split()[0] for r in rows[::3]] == [f"{name}[{i}][0]" for i in range(Outer.size)]


def test_a_layer_named_as_another_layers_position_is_reported_too():
    """Names are keys: a layer without a name takes its position (`b`), and if another layer
    is named so, both are reported. The second one replaced the first, silently."""

    class Model(eqx.Module):
        a: fp8jax.Fp8DotGeneral
        b: fp8jax.Fp8DotGeneral
        c: fp8jax.Fp8DotGeneral

    model = Model(
        a=fp8jax.Fp8DotGeneral("delayed", name="b"),
        b=fp8jax.Fp8DotGeneral("current"),
        c=fp8jax.Fp8DotGeneral("blockwise", name="b"),
    )
    stats = fp8jax.telemetry(model)
    assert len(stats) == 3 and stats["b"].recipe == "DelayedScaling"
    for layer in (model.a, model.b, model.c):
        (got,) = [t for t in stats.values() if t.recipe == type(layer.recipe).__name__]
        np.testing.assert_array_equal(got.kernel.scale, layer.kernel.scale)
    rows = fp8jax.report(stats, quiet=True).splitlines()[2:]
    assert sum("kernel" in r.split() for r in rows) == 3


def test_telemetry_errors():
    with pytest.raises(ValueError, match="no Fp8DotGeneral"):
        fp8jax.telemetry({"w": jnp.ones(3)})
    with pytest.raises(TypeError, match="telemetry='yes'"):
        fp8jax.Fp8DotGeneral(telemetry="yes")
    with pytest.raises(ValueError, match="telemetry=1"):
        fp8jax.Fp8Config(telemetry=1)


def test_grouped_layers_report_a_kernel_scale_per_expert():
    from fp8jax.examples import moe_model as moe

    model = moe.MoEModel(width=32, hidden=64, experts=4, top_k=2, key=jax.random.PRNGKey(0))
    model = fp8jax.fp8_linear_layers(model)
    x, y = moe.teacher_data(64)
    grads = eqx.filter_jit(fp8jax.filter_grad(moe.mse))(model, x, y)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    stats = eqx.filter_jit(fp8jax.telemetry)(overwrites)  # traceable, as for dense layers
    assert sorted(stats) == ["embed", "moe.down", "moe.up"]
    assert stats["embed"].experts is None
    for name in ("moe.up", "moe.down"):
        layer, dot = stats[name], getattr(overwrites.moe, name.split(".")[1]).ragged_dot
        assert layer.experts == 4 and layer.recipe == "DelayedScaling"
        assert layer.kernel.scale.shape == layer.kernel.amax.shape == (4,)
        np.testing.assert_array_equal(layer.kernel.scale, dot.kernel.scale)
        np.testing.assert_array_equal(layer.kernel.amax, dot.kernel.amax_history[:, 0])
        np.testing.assert_array_equal(
            layer.kernel.history_max, jnp.max(dot.kernel.amax_history, axis=-1)
        )
        assert float(layer.input.amax) == float(dot.input.amax_history[0])
        assert float(layer.output_grad.scale) == float(dot.output_grad.scale)
        assert layer.kernel.saturated is None  # grouped layers keep no statistics
        assert (np.asarray(layer.kernel.amax) > 0).all()  # every expert got tokens
    # The report: a row per expert's kernel, between the input and the output gradient.
    rows = fp8jax.report(stats, quiet=True).splitlines()[2:]
    start = [r.split()[0] for r in rows].index("moe.up")
    up = rows[start : start + 6]
    assert [r.split()[0] for r in up] == [
        "moe.up",
        "kernel[0]",
        "kernel[1]",
        "kernel[2]",
        "kernel[3]",
        "output_grad",
    ]
    scales = [float(r.split()[2]) for r in up[1:5]]
    np.testing.assert_allclose(scales, stats["moe.up"].kernel.scale, rtol=1e-3)
    assert len(rows) == 3 + 2 * 6


# --- grouped (mixture-of-experts) layers ----------------------------------------------------

SIZES = np.array([20, 0, 30, 14], np.int32)  # expert 1 gets no tokens


def grouped_run(dot, x, w, c, sizes=SIZES):
    def loss(dot, x, w):
        return jnp.sum(dot(x, w, sizes) * c)

    return eqx.filter_jit(fp8jax.filter_grad(loss))(dot, x, w)


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise"])
def test_grouped_statistics_match_ml_dtypes_per_expert(recipe):
    """Each expert's kernel its own saturation and underflow, against ml_dtypes casts with
    that expert's scale; the activation and output gradient one each; an expert without
    tokens keeps its previous statistics."""
    rng = np.random.default_rng(7)
    m, k, n = int(SIZES.sum()), 128, 96
    x, c = spread(rng, (m, k), -5, 3), spread(rng, (m, n), -9, 5)
    # Experts' weights orders of magnitude apart: at delayed scaling's cold first scale (1.0,
    # no warm start) expert 2 saturates and expert 0 underflows.
    w = np.stack([spread(rng, (k, n), lo, hi) for lo, hi in ((-6, -3), (-1, 0), (2, 4), (-2, 0))])
    cold = fp8jax.DelayedScaling(warm_start=False)
    dot = fp8jax.Fp8RaggedDot(
        cold if recipe == "delayed" else recipe, num_experts=4, telemetry=True
    )
    stale = jnp.full((4,), 0.25)  # what expert 1 must keep: it gets no tokens
    dot = eqx.tree_at(lambda d: d.stats.kernel.saturated, dot, stale)
    new = fp8jax.apply_updates(dot, None, grouped_run(dot, x, w, c))
    scale = dot.kernel.scale if recipe == "delayed" else new.kernel.scale
    if recipe == "blockwise":
        blocks = ref.deepseek_scale()
        x_scale, c_scale = block_scales(x, (1, 128), blocks), block_scales(c, (1, 128), blocks)
        w_scale = [block_scales(w[e].T, (128, 128), blocks) for e in range(4)]
    else:
        old = recipe == "delayed"
        x_scale = (dot if old else new).input.scale
        c_scale = (dot if old else new).output_grad.scale
        w_scale = [scale[e] for e in range(4)]
    expected_input = ref_stats(x, x_scale, "e4m3")
    fmt = "e4m3" if recipe == "blockwise" else "e5m2"
    expected_grad = ref_stats(c, c_scale, fmt)
    for role, want in (("input", expected_input), ("output_grad", expected_grad)):
        got = getattr(new.stats, role)
        assert (float(got.saturated), float(got.underflow)) == pytest.approx(want, rel=1e-6), role
    for e in range(4):
        if SIZES[e] == 0:
            assert float(new.stats.kernel.saturated[e]) == 0.25  # kept
            continue
        weights = w[e].T if recipe == "blockwise" else w[e]
        want = ref_stats(weights, w_scale[e], "e4m3")
        got = (float(new.stats.kernel.saturated[e]), float(new.stats.kernel.underflow[e]))
        assert got == pytest.approx(want, rel=1e-6), e  # float32 fractions
    if recipe == "delayed":
        assert float(new.stats.kernel.saturated[2]) > 0 and float(new.stats.kernel.underflow[0]) > 0
        assert float(new.stats.kernel.saturated[0]) == 0 == float(new.stats.kernel.underflow[2])


def test_grouped_rejected_updates_are_counted_per_expert():
    rng = np.random.default_rng(8)
    m, k, n = int(SIZES.sum()), 32, 16
    x, c = rng.standard_normal((m, k)).astype(np.float32), np.ones((m, n), np.float32)
    w = rng.standard_normal((4, k, n)).astype(np.float32)
    w[3, 0, 0] = np.inf  # expert 3's kernel holds an inf: its update is rejected
    dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)
    new = fp8jax.apply_updates(dot, None, grouped_run(dot, x, w, c))
    np.testing.assert_array_equal(new.stats.kernel.rejected, [0, 0, 0, 1])
    np.testing.assert_array_equal(new.kernel.amax_history[3], dot.kernel.amax_history[3])
    assert float(new.kernel.amax_history[0, 0]) == np.abs(w[0]).max()


def test_grouped_telemetry_through_fp8_linear_layers_and_report():
    from fp8jax.examples import moe_model as moe

    model = moe.MoEModel(width=32, hidden=64, experts=4, top_k=2, key=jax.random.PRNGKey(0))
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(telemetry=True))
    assert model.moe.up.ragged_dot.stats.kernel.saturated.shape == (4,)
    x, y = moe.teacher_data(64)
    grads = eqx.filter_jit(fp8jax.filter_grad(moe.mse))(model, x, y)
    hidden = jax.vmap(model.norm)(moe.dense(model.embed, x))
    routing = moe.route(jax.vmap(model.moe.gate)(hidden), model.moe.top_k)
    overwrites, _ = fp8jax.partition_for_grad_overwrite(grads)
    model = fp8jax.apply_updates(model, None, overwrites)
    stats = fp8jax.telemetry(model)["moe.up"]
    assert stats.kernel.saturated.shape == (4,) and stats.input.underflow.shape == ()
    # Tokens per expert: 64 tokens, top-2, as the router assigned them.
    assignments = np.asarray(routing.group_sizes)
    np.testing.assert_array_equal(stats.tokens, assignments)
    assert stats.tokens.sum() == 128
    rows = fp8jax.report(model, quiet=True).splitlines()
    assert rows[0].split()[-1] == "tokens"
    kernel_rows = [r.split() for r in rows if r.split()[:1] == ["kernel[2]"]]
    assert len(kernel_rows) == 2  # moe.up, moe.down
    expected = [f"{100 * float(stats.kernel.saturated[2]):.3g}", "%"]
    assert kernel_rows[0][5:7] == expected
    assert kernel_rows[0][-1] == str(assignments[2])
    assert all(r.split()[-1] == "-" for r in rows[2:] if r.split()[0] in ("input", "embed"))


def test_grouped_tokens_span_a_vmapped_batch():
    """Under `vmap` (kernel and state shared by the batch) the tokens each expert got are
    summed over the members."""
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3], [3, 0, 3, 6]], np.int32)
    rng = np.random.default_rng(9)
    xs, cs = rng.standard_normal((3, 12, 8)), rng.standard_normal((3, 12, 4))
    w = rng.standard_normal((4, 8, 4)).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)

    def loss(dot):
        ys = jax.vmap(lambda x, s: dot(x, w, s))(xs, sizes)
        return jnp.sum(ys * cs)

    new = fp8jax.filter_grad(loss)(dot)
    np.testing.assert_array_equal(new.stats.tokens, sizes.sum(axis=0))


def test_per_example_gradients_count_the_tokens_of_the_whole_batch():
    """`vmap` of a gradient (per-example gradients, each member's GEMMs mapped on their own)
    with the state shared: as the amaxes, the tokens each expert got span the mapped axis,
    summed over the members, in every member's record (not the largest member's count)."""
    sizes = np.array([[6, 0, 4, 2], [0, 0, 9, 3], [3, 0, 3, 6]], np.int32)
    rng = np.random.default_rng(9)
    xs, cs = rng.standard_normal((3, 12, 8)), rng.standard_normal((3, 12, 4))
    w = rng.standard_normal((4, 8, 4)).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)

    def loss(dot, x, s, c):
        return jnp.sum(dot(x, w, s) * c)

    new = jax.vmap(fp8jax.filter_grad(loss), in_axes=(None, 0, 0, 0))(dot, xs, sizes, cs)
    # Expert 0: 6 + 0 + 3 tokens; 1: none; 2: 4 + 9 + 3; 3: 2 + 3 + 6.
    np.testing.assert_array_equal(new.stats.tokens, [[9, 0, 16, 11]] * 3)


@pytest.mark.parametrize("recipe", [fp8jax.BlockwiseScaling(), fp8jax.MXFP8()])
def test_a_tiny_finite_operand_is_recorded_not_rejected(recipe):
    """An operand whose amax is finite but tiny (fp8_max / amax past float32's range) held no
    inf or NaN: its amax is recorded and no rejected step counted. The scale kept for
    telemetry is fp8_max / amax, capped at 2**126 as the per-tensor recipes cap theirs."""
    x = np.full((2, 4), 1e-37, np.float32)
    w, c = np.ones((3, 4), np.float32), np.ones((2, 3), np.float32)
    dot = fp8jax.Fp8DotGeneral(recipe, telemetry=True)
    new = fp8jax.apply_updates(dot, None, run(dot, x, w, c))
    amax = np.abs(x).max()
    with np.errstate(over="ignore"):
        nominal = min(np.float32(448.0) / amax, np.float32(2.0**126))
    assert float(new.input.amax_history[0]) == amax
    assert float(new.input.scale) == nominal
    assert float(new.stats.input.rejected) == 0.0


@pytest.mark.parametrize("role", ["input", "kernel", "output_grad"])
def test_gradients_count_the_steps_rejected_update(role, operands):
    """Telemetry of gradients counts the step whose state merge will reject (an inf in that
    operand), as the model's count does once merged; a grouped kernel per expert."""
    x, w, c = (a.copy() for a in operands)
    {"input": x, "kernel": w, "output_grad": c}[role][3, 5] = np.inf
    dot = fp8jax.Fp8DotGeneral("current", telemetry=True)
    grads = run(dot, x, w, c)
    expected = {r: float(r == role) for r in ("input", "kernel", "output_grad")}
    (layer,) = fp8jax.telemetry(grads).values()
    merged = next(iter(fp8jax.telemetry(fp8jax.apply_updates(dot, None, grads)).values()))
    for r, want in expected.items():
        assert float(getattr(layer, r).rejected) == want, r
        assert float(getattr(merged, r).rejected) == want, r
    assert (
        fp8jax.report(grads, quiet=True)
        .splitlines()[2:5][("input", "kernel", "output_grad").index(role)]
        .split()[-1]
        == "1"
    )


def test_a_model_state_made_non_finite_by_hand_reads_as_a_step_to_reject():
    """Telemetry reads a model as gradients (documented on `OperandTelemetry.rejected` and in
    the training guide): a model's state given a NaN amax by hand shows the model's own count
    (0) plus the 1 a merge of it would count, as gradients holding it do; the report's
    "non-finite steps" too. The model's other operands show their own count."""
    dot = fp8jax.Fp8DotGeneral("delayed", telemetry=True)
    nan = dot.input.amax_history.at[0].set(np.nan)
    model = eqx.tree_at(lambda d: d.input.amax_history, dot, nan)
    assert float(model.stats.input.rejected) == 0.0
    (layer,) = fp8jax.telemetry(model).values()
    merged = dot.merge(model)  # what the count is once such a state is merged
    assert float(layer.input.rejected) == float(merged.stats.input.rejected) == 1.0
    assert float(layer.kernel.rejected) == 0.0 == float(layer.output_grad.rejected)
    rows = fp8jax.report(model, quiet=True).splitlines()[2:5]
    assert [row.split()[-1] for row in rows] == ["1", "0", "0"]


def test_grouped_gradients_count_a_rejected_expert():
    rng = np.random.default_rng(8)
    m, k, n = int(SIZES.sum()), 32, 16
    x, c = rng.standard_normal((m, k)).astype(np.float32), np.ones((m, n), np.float32)
    w = rng.standard_normal((4, k, n)).astype(np.float32)
    w[2, 1, 1] = np.nan
    dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)
    (layer,) = fp8jax.telemetry(grouped_run(dot, x, w, c)).values()
    np.testing.assert_array_equal(layer.kernel.rejected, [0, 0, 1, 0])
    assert float(layer.input.rejected) == 0 == float(layer.output_grad.rejected)


def test_haliax_own_fp8_layers_are_reported(getkey):
    """A model whose only FP8 layer Haliax quantized itself (kept by fp8_linear_layers):
    telemetry reads its amaxes and the scale its next step takes (fp8_max / the history's
    max, Haliax's rule), against float64 from the operands; it raised 'no Fp8DotGeneral'."""
    hax = pytest.importorskip("haliax")
    from haliax import quantization

    In, Out, Batch = hax.Axis("in", 16), hax.Axis("out", 8), hax.Axis("batch", 4)
    lin = hax.nn.Linear.init(In, Out, key=getkey())
    lin = quantization.quantize_linear_layers(lin, quantization.QuantizationConfig(fp8=True))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match="haliax.quantization"):
        model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(exclude=None))
    rng = np.random.default_rng(3)
    xs = [spread(rng, (4, 16), -1, 1) * s for s in (3.0, 0.5)]
    cs = [spread(rng, (4, 8), -4, -2) * s for s in (0.25, 2.0)]

    @eqx.filter_jit
    def step(m, x, c):
        def loss(m):
            y = m(hax.named(x, (Batch, In)))
            return hax.sum(y * hax.named(c, (Batch, Out))).scalar()  # output gradient: c

        overwrites, grads = quantization.partition_for_grad_overwrite(eqx.filter_grad(loss)(m))
        still = jax.tree.map(jnp.zeros_like, grads)  # the weight stays: its amax is known
        return quantization.apply_updates(m, still, overwrites)

    for x, c in zip(xs, cs, strict=True):
        model = step(model, x, c)
    (name,) = stats = fp8jax.telemetry(model)
    layer = stats[name]
    w = np.asarray(lin.weight.array, np.float64)
    amaxes = {
        "input": [np.abs(x).max() for x in xs],
        "kernel": [np.abs(w).max()] * 2,
        "output_grad": [np.abs(c).max() for c in cs],
    }
    fp8_max = {"input": 448.0, "kernel": 448.0, "output_grad": 57344.0}
    for role, seen in amaxes.items():
        got = getattr(layer, role)
        assert float(got.amax) == pytest.approx(seen[-1], rel=1e-6), role
        assert float(got.history_max) == pytest.approx(max(seen), rel=1e-6), role
        assert float(got.scale) == pytest.approx(fp8_max[role] / max(seen), rel=1e-6), role
        assert got.saturated is None and got.rejected is None
    assert layer.formats == ("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")
    rows = fp8jax.report(model, quiet=True).splitlines()[2:]
    assert [r.split()[:3] for r in rows] == [
        [name, "input", "e4m3fn"],
        ["kernel", "e4m3fn", f"{fp8_max['kernel'] / max(amaxes['kernel']):.4g}"],
        ["output_grad", "e5m2", f"{fp8_max['output_grad'] / max(amaxes['output_grad']):.4g}"],
    ]


def test_a_haliax_layer_without_a_usable_history_reports_the_reciprocal_of_its_scale(getkey):
    """Where a Haliax FP8 layer's history gives no next scale (all zeros, or an inf in it),
    telemetry reports the scale it holds in fp8jax's terms: Haliax divides by its scale, so
    1 / it (4 -> 0.25, 0.5 -> 2), and 0 (none) for a scale of 0."""
    hax = pytest.importorskip("haliax")
    from haliax import quantization

    lin = hax.nn.Linear.init(hax.Axis("in", 16), hax.Axis("out", 8), key=getkey())
    lin = quantization.quantize_linear_layers(lin, quantization.QuantizationConfig(fp8=True))
    op = lin.dot_general
    inf_first = jnp.zeros_like(op.kernel_amax_history).at[0].set(jnp.inf)
    op = eqx.tree_at(
        lambda o: (o.input_scale, o.kernel_scale, o.output_grad_scale, o.kernel_amax_history),
        op,
        (jnp.array([4.0]), jnp.array([0.5]), jnp.array([0.0]), inf_first),
    )
    (layer,) = fp8jax.telemetry(op).values()
    scales = [float(getattr(layer, role).scale) for role in ("input", "kernel", "output_grad")]
    assert scales == [0.25, 2.0, 0.0]


def test_report_prints_output_gradients_in_the_losss_units(getkey):
    """Under a loss scale the output gradient's state records the scaled gradients; the report
    given the loss scale prints their amaxes as the loss's (float64 from the known output
    gradient) and the scale to match; the rest as the state holds it."""
    import optax

    lin = eqx.nn.Linear(16, 8, key=getkey())
    model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(telemetry=True))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    cs = [(rng.standard_normal((4, 8)) * s).astype(np.float32) for s in (3e-3, 1e-3)]

    def loss(m, x, c):
        return jnp.sum(jax.vmap(m)(x) * c)  # the output gradient: c (times the loss scale)

    step = fp8jax.make_train_step(
        loss, optax.sgd(0.0), loss_scale=fp8jax.StaticLossScale(1024.0), compiler_options={}
    )
    state = step.init(model)
    for c in cs:
        state, _ = step(state, x, c)
    text = fp8jax.report(state.model, loss_scale=state.loss_scale, quiet=True)
    rows = {r.split()[-10]: r.split()[-9:] for r in text.splitlines()[2:5]}  # by operand
    latest, most = np.abs(np.float64(cs[-1])).max(), max(np.abs(np.float64(c)).max() for c in cs)
    assert rows["output_grad"][2:4] == [f"{latest:.4g}", f"{most:.4g}"]
    held = state.model.dot_general
    assert rows["output_grad"][1] == f"{float(held.output_grad.scale) * 1024:.4g}"
    assert rows["input"][1:4] == [
        f"{float(held.input.scale):.4g}",
        f"{np.abs(x).max():.4g}",
        f"{np.abs(x).max():.4g}",
    ]
    assert text.splitlines()[-1].startswith("output_grad in the loss's units")


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp8", "residual"])
def test_report_after_a_loss_scale_change_is_of_the_latest_step(getkey, recipe):
    """Recipes that scale each step by its own amax, under a dynamic loss scale that grows
    every step and backs off after an overflow: the report given the new loss scale prints
    each step's own output gradient (float64 from the known output gradient) and its scale in
    the loss's units; after the skipped step, the step before's. The state recorded under the
    step's loss scale was divided by the next one (half the amax after a growth)."""
    import optax

    lin = eqx.nn.Linear(16, 8, key=getkey())
    model = fp8jax.fp8_linear_layers(lin, fp8jax.Fp8Config(recipe=recipe, telemetry=True))
    fmt_max = float(jnp.finfo(model.dot_general.recipe.format("output_grad")).max)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    cs = [(rng.standard_normal((4, 8)) * s).astype(np.float32) for s in (3e-3, 1e-3, 1.0)]
    cs[-1][0, 0] = np.inf  # the last step overflows: skipped, the scale backs off

    def loss(m, x, c):
        return jnp.sum(jax.vmap(m)(x) * c)  # the output gradient: c (times the loss scale)

    scale = fp8jax.DynamicLossScale(2.0**10, period=1)
    step = fp8jax.make_train_step(loss, optax.sgd(0.0), loss_scale=scale, compiler_options={})
    state = step.init(model)
    kept = None
    for c in cs:
        state, metrics = step(state, x, c)
        if bool(metrics.grads_finite):
            kept = (np.abs(np.float64(c)).max(), float(metrics.loss_scale))
        text = fp8jax.report(state.model, loss_scale=state.loss_scale, quiet=True)
        row = next(r.split()[-9:] for r in text.splitlines()[2:5] if "output_grad" in r)
        amax, used = kept  # in the loss's units, and the loss scale the step recorded it at
        assert row[2] == f"{amax:.4g}"
        exact = fmt_max / (amax * used)
        recorded = 2.0 ** np.floor(np.log2(exact)) if recipe == "current" else exact
        np.testing.assert_allclose(float(row[1]), recorded * used, rtol=1e-3)  # as printed
    assert float(state.loss_scale.loss_scale) == 2.0**11  # grew twice, backed off once


def test_grouped_tokens_add_over_calls_and_microbatches():
    """A grouped layer run on two batches in one step (called twice, or two microbatches of
    accumulate_gradients) got both batches' tokens: the sum of their group sizes, as one
    call on the whole batch reports (it was the larger of the two, expert by expert)."""
    sizes = np.array([[6, 0, 4, 2], [1, 5, 3, 3]], np.int32)
    rng = np.random.default_rng(10)
    xs = rng.standard_normal((2, 12, 8)).astype(np.float32)
    w = rng.standard_normal((4, 8, 4)).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)
    whole = sizes.sum(axis=0)  # each expert's tokens over both batches, by hand

    def twice(dot):
        return jnp.sum(dot(xs[0], w, sizes[0])) + jnp.sum(dot(xs[1], w, sizes[1]))

    np.testing.assert_array_equal(fp8jax.filter_grad(twice)(dot).stats.tokens, whole)

    def loss(dot, x, s):
        return jnp.sum(dot(x, w, s[0]))

    _, grads = fp8jax.accumulate_gradients(loss, 2)(dot, xs.reshape(24, 8), sizes)
    np.testing.assert_array_equal(grads.stats.tokens, whole)
    (layer,) = fp8jax.telemetry(fp8jax.apply_updates(dot, None, grads)).values()
    np.testing.assert_array_equal(layer.tokens, whole)


def test_a_layer_that_is_the_tree_itself_is_named_root(getkey):
    """An FP8 op passed as the whole tree has no path: its row was keyed `''` and printed
    with a blank name. It is `(root)`, as a conversion plan names the root."""
    op = fp8jax.Fp8DotGeneral()
    plan = fp8jax.conversion_plan(eqx.nn.Linear(32, 32, key=getkey()))
    root = str(plan).splitlines()[2].split()[0]  # the plan's printed name of the root
    assert list(fp8jax.telemetry(op)) == [root]
    rows = fp8jax.report(op, quiet=True).splitlines()[2:]
    assert [r.split()[0] for r in rows[:3]] == [root, "kernel", "output_grad"]


def test_a_plan_with_every_layer_in_fp8_says_so():
    """`report(..., plan=)` of a model whose every Linear became FP8 says none stays in high
    precision, with the plan's count, instead of a heading with nothing under it."""
    mlp = eqx.nn.MLP(8, 2, 32, 2, key=jax.random.key(0))
    config = fp8jax.Fp8Config()
    plan = fp8jax.conversion_plan(mlp, config)
    linears = jax.tree.leaves(mlp, is_leaf=lambda x: isinstance(x, eqx.nn.Linear))
    linears = [x for x in linears if isinstance(x, eqx.nn.Linear)]
    text = fp8jax.report(fp8jax.fp8_linear_layers(mlp, config), plan=plan, quiet=True)
    assert text.splitlines()[-1] == f"high precision: none (all {len(linears)} layers in FP8)"
    assert len(text.splitlines()) == 2 + 3 * len(linears) + 2  # header, rule, rows, two notes


def test_float64_beyond_float32_range_is_counted_saturated_or_underflowed():
    """Under x64, a finite float64 of 1e300 (or 1e39) is saturated by the cast (quantize clips
    it to the format's max), but its magnitude cast to float32 was inf, which is not counted:
    the saturated fraction was 0, not 3/4. Reference: ml_dtypes' unsaturated cast of the
    float64 product."""
    from fp8jax._src.core.stats import cast_statistics

    x = np.array([[1e300, -1e300, 2.0, 1e39]])
    with np.errstate(over="ignore"):
        cast = (x * 0.5).astype(FORMATS["e4m3"]).astype(np.float64)
    want = np.mean(~np.isfinite(cast) & np.isfinite(x))
    with jax.enable_x64(True):
        q = fp8jax.quantize(jnp.asarray(x), 0.5, "e4m3")
        terms = [fp8jax.QTensor(q, jnp.float32(2.0))]
        got = cast_statistics(jnp.asarray(x), terms, "e4m3", jnp.zeros(()))
        assert float(got.saturated) == want == 0.75
    # One below float32's range (1e-50) is nonzero and becomes 0: it underflows, though its
    # float32 magnitude is 0.
    x = np.array([[1e-50, -1e-60, 2.0, 0.0]])
    want = np.mean((x.astype(FORMATS["e4m3"]).astype(np.float64) == 0) & (x != 0))
    with jax.enable_x64(True):
        q = fp8jax.quantize(jnp.asarray(x), 1.0, "e4m3")
        terms = [fp8jax.QTensor(q, jnp.float32(1.0))]
        got = cast_statistics(jnp.asarray(x), terms, "e4m3", jnp.zeros(()))
        assert float(got.underflow) == want == 0.5


def test_infs_and_nans_are_not_counted_saturated():
    """An inf or NaN is a fault the cast passes on as NaN, not a value it clips: neither
    saturated nor underflowed. Reference: ml_dtypes' unsaturated cast of the finite values."""
    from fp8jax._src.core.stats import cast_statistics

    x = np.array([[np.inf, -np.inf, np.nan, 1000.0, -500.0, 0.0, 1e-9, 3.0]], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        cast = x.astype(FORMATS["e4m3"]).astype(np.float64)
    finite = np.isfinite(x)
    terms = [fp8jax.QTensor(fp8jax.quantize(jnp.asarray(x), 1.0, "e4m3"), jnp.float32(1.0))]
    got = cast_statistics(jnp.asarray(x), terms, "e4m3", jnp.zeros(()))
    assert float(got.saturated) == np.mean(finite & ~np.isfinite(cast)) == 2 / 8
    assert float(got.underflow) == np.mean(finite & (cast == 0) & (x != 0)) == 1 / 8


def test_grouped_tokens_start_in_the_float32_a_step_records_under_x64():
    """Under x64 a grouped layer's initial `tokens` were float64 (`jnp.zeros`' default),
    while a step records float32, as every other statistic."""
    with jax.enable_x64(True):
        dot = fp8jax.Fp8RaggedDot(num_experts=4, telemetry=True)
        x, w = np.ones((6, 8), np.float32), np.ones((4, 8, 4), np.float32)
        sizes = np.array([3, 0, 2, 1], np.int32)
        grads = fp8jax.filter_grad(lambda d: jnp.sum(d(x, w, sizes)))(dot)
        assert dot.stats.tokens.dtype == grads.stats.tokens.dtype == np.float32


def test_two_microbatches_statistics_combine_by_max_and_tokens_add():
    """`combine_states` (gradient accumulation's): every statistic the larger of the two
    microbatches', as their amaxes combine, but an expert's tokens the sum of both."""
    from fp8jax._src.core.stats import combine_states

    def stats(seed):
        v = np.random.default_rng(seed).uniform(0, 1, (7, 3)).astype(np.float32)
        ops = [fp8jax.OperandStats(*map(jnp.asarray, v[i])) for i in range(3)]
        per_expert = fp8jax.OperandStats(*map(jnp.asarray, v[3:6].T.copy()))
        return v, fp8jax.Fp8Stats(*ops), fp8jax.ExpertStats(ops[0], per_expert, ops[2], v[6])

    (va, dense_a, grouped_a), (vb, dense_b, grouped_b) = stats(0), stats(1)
    dense = combine_states(dense_a, dense_b)
    got = [
        [getattr(getattr(dense, r), f) for f in ("saturated", "underflow", "rejected")]
        for r in ("input", "kernel", "output_grad")
    ]
    np.testing.assert_array_equal(np.array(got), np.maximum(va, vb)[:3])
    grouped = combine_states(grouped_a, grouped_b)
    np.testing.assert_array_equal(grouped.kernel.saturated, np.maximum(va, vb)[3:6, 0])
    np.testing.assert_array_equal(grouped.tokens, va[6] + vb[6])


def test_grouped_tokens_of_an_expert_without_tokens_are_zero_not_kept():
    """The tokens of the step where the layer ran, zeros included: an expert that got tokens
    in one step and none in the next reports 0 (its kernel state and statistics are kept,
    its token count is not)."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((12, 8)).astype(np.float32)
    w = rng.standard_normal((3, 8, 4)).astype(np.float32)
    dot = fp8jax.Fp8RaggedDot("current", num_experts=3, telemetry=True)
    step = eqx.filter_jit(fp8jax.filter_grad(lambda dot, s: jnp.sum(dot(x, w, s))))
    for sizes in ([5, 4, 3], [0, 9, 3]):
        dot = fp8jax.apply_updates(dot, None, step(dot, jnp.asarray(sizes, jnp.int32)))
        np.testing.assert_array_equal(dot.stats.tokens, sizes)


def test_grouped_statistics_are_over_the_rows_the_groups_hold():
    """Group sizes summing short of the rows: the fractions saturated and flushed are over
    the rows that hold tokens (ml_dtypes casts of those rows at the cold scale 1), not
    diluted by the rows past the groups."""
    rng = np.random.default_rng(13)
    held, rows = 24, 40
    x, c = spread(rng, (rows, 16), -9, 4), spread(rng, (rows, 8), -12, 6)
    w = spread(rng, (3, 16, 8), -1, 0)
    sizes = jnp.asarray([10, 0, held - 10], jnp.int32)
    cold = fp8jax.DelayedScaling(warm_start=False)
    dot = fp8jax.Fp8RaggedDot(cold, num_experts=3, telemetry=True)

    @eqx.filter_jit
    def step(dot, sizes):  # traced sizes: rows past their sum are allowed
        return fp8jax.filter_grad(lambda dot: jnp.sum(dot(x, w, sizes) * c))(dot)

    new = step(dot, sizes).stats
    for got, want in (
        (new.input, ref_stats(x[:held], 1.0, "e4m3")),
        (new.output_grad, ref_stats(c[:held], 1.0, "e5m2")),
    ):
        assert min(want) > 0
        assert (float(got.saturated), float(got.underflow)) == pytest.approx(want, rel=1e-6)

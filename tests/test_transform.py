"""fp8_linear_layers: which layers it converts, what it keeps, and the errors it raises."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import U_F32, matmul_error_bound, ref_qdq
from test_delayed_scaling import ref_update

import fp8jax


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear


def make_model(key):
    keys = jax.random.split(key, 6)
    blocks = [
        Block(
            eqx.nn.MultiheadAttention(2, 8, key=keys[2 * i]),
            eqx.nn.MLP(8, 8, 16, 1, key=keys[2 * i + 1]),
            eqx.nn.LayerNorm(8),
        )
        for i in range(2)
    ]
    return Model(eqx.nn.Embedding(11, 8, key=keys[4]), blocks, eqx.nn.Linear(8, 11, key=keys[5]))


def linear_paths(tree, kind):
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, eqx.nn.Linear | fp8jax.Linear)
    )[0]:
        if isinstance(leaf, kind):
            out.append(".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path))
    return sorted(out)


def test_replaces_eqx_linear_keeping_weight_and_bias(getkey):
    lin = eqx.nn.Linear(16, 8, key=getkey())
    fp8 = fp8jax.fp8_linear_layers(lin)
    assert isinstance(fp8, fp8jax.Linear)
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    assert (fp8.in_features, fp8.out_features, fp8.use_bias) == (16, 8, True)
    x = jax.random.normal(getkey(), (16,))
    bound = matmul_error_bound(x[None], lin.weight)[0]
    np.testing.assert_array_less(np.abs(fp8(x) - lin(x)), bound)
    assert not np.array_equal(fp8(x), lin(x))  # it really ran in FP8


def _first_call_scales(linear, x_amax):
    """The scales a fresh delayed-scaling layer quantizes with on its first call: with the
    warm start (the default), those of its input's and weight's own amax, as the hand-rolled
    update of test_delayed_scaling computes them from its empty histories."""
    dot = linear.dot_general
    assert dot.recipe.warm_start
    assert not np.any(dot.input.amax_history) and not np.any(dot.kernel.amax_history)
    w_amax = np.abs(np.asarray(linear.weight, np.float32)).max()
    scales = []
    for role, amax in (("input", x_amax), ("kernel", w_amax)):
        state = getattr(dot, role)
        scale, _ = ref_update(
            np.asarray(state.scale),
            np.asarray(state.amax_history).copy(),
            np.float32(amax),
            fp8jax.fp8_max(dot.recipe.format(role)),
            dot.recipe.margin,
            dot.recipe.amax_compute,
            dot.recipe.power_of_two,
            warm_start=True,
        )
        scales.append(np.float32(scale))
    return tuple(scales)


def test_scalar_features_like_eqx(getkey):
    lin = eqx.nn.Linear("scalar", "scalar", key=getkey())
    fp8 = fp8jax.fp8_linear_layers(lin)
    x = jnp.float32(0.75)
    assert fp8(x).shape == () == lin(x).shape
    sx, sw = _first_call_scales(fp8, abs(x))
    w, b = np.float32(lin.weight[0, 0]), np.float32(lin.bias[0])
    xq, wq = ref_qdq(x, sx, "e4m3"), ref_qdq(w, sw, "e4m3")
    assert wq != w  # the weight is not an E4M3 value: its rounding shows in the result
    # Two E4M3 values (4 significant bits each) multiply exactly in float32; the bias add is
    # the one float32 rounding, done here in float32 too.
    assert np.float32(xq * wq) == xq * wq
    np.testing.assert_array_equal(fp8(x), np.float32(xq * wq) + b)


def test_converted_attention_matches_float32(getkey):
    """The four projections in FP8 inside eqx's attention: the float64 attention of the
    E4M3-rounded input and weights (ml_dtypes), elementwise."""
    attn = eqx.nn.MultiheadAttention(2, 16, key=getkey())
    fp8 = fp8jax.fp8_linear_layers(attn)
    x = np.asarray(jax.random.normal(getkey(), (6, 16)))
    got = np.asarray(fp8(x, x, x), np.float64)
    projections = ("query_proj", "key_proj", "value_proj", "output_proj")
    scales = {
        name: _first_call_scales(getattr(fp8, name), np.abs(x).max()) for name in projections[:3]
    }
    assert not any(getattr(attn, name).use_bias for name in projections)

    def quantized(name):  # the E4M3 values of a projection's input and weight, as functions
        sx, sw = scales[name]
        return (lambda v: ref_qdq(v, sx, "e4m3")), ref_qdq(getattr(attn, name).weight, sw, "e4m3")

    def project(name, v):
        q8, w = quantized(name)
        return (q8(v) @ w.T).reshape(6, 2, 8)

    q, k, v = (project(name, x) for name in projections[:3])
    logits = np.einsum("shd,Shd->hsS", q, k) / np.sqrt(8)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    o = np.einsum("hsS,Shd->shd", weights, v).reshape(6, 16)
    # The layer quantizes its float32 `o`, not this one. Every path to it takes few float32
    # roundings (16- and 8-term sums, a softmax of 6, a 6-term sum; each 2**-24 relative to
    # the magnitudes summed): 2**-12 of the magnitude of `o` is far above their total. E4M3
    # rounding is monotonic, so the layer's FP8 `o` lies between those of o -+ that margin,
    # and its output in the interval they span.
    margin = 2.0**-12 * np.einsum("hsS,Shd->shd", weights, np.abs(v)).reshape(6, 16)
    # The output projection's input scale comes from the layer's own amax of `o`, within the
    # same margin: the power-of-two scale is the same across it, so the bracket is exact.
    out_low, out_high = (
        _first_call_scales(fp8.output_proj, (np.abs(o) + sign * margin).max()) for sign in (-1, 1)
    )
    assert out_low == out_high
    scales["output_proj"] = out_low
    q8, w_out = quantized("output_proj")
    low, high = q8(o - margin), q8(o + margin)
    center = (low + high) / 2 @ w_out.T
    radius = (high - low) / 2 @ np.abs(w_out).T
    # The output projection's float32 sum of 16 products.
    accumulation = 16 * U_F32 * (np.maximum(np.abs(low), np.abs(high)) @ np.abs(w_out).T)
    np.testing.assert_array_less(np.abs(got - center), radius + accumulation + 1e-30)


def test_default_converts_all_but_head_and_reaches_mlp_and_attention(getkey):
    model = make_model(getkey())
    fp8 = fp8jax.fp8_linear_layers(model)
    converted = linear_paths(fp8, fp8jax.Linear)
    assert len(converted) == 2 * (4 + 2)  # per block: q, k, v, o projections + 2 MLP layers
    assert "blocks.0.attn.query_proj" in converted and "blocks.1.mlp.layers.1" in converted
    assert linear_paths(fp8, eqx.nn.Linear) == ["head"]
    assert fp8.embed is model.embed and fp8.blocks[0].norm is model.blocks[0].norm


@pytest.mark.parametrize(
    "targets, expected",
    [
        (
            ["blocks.0.mlp.layers.0", "blocks.1.mlp.layers.0"],
            ["blocks.0.mlp.layers.0", "blocks.1.mlp.layers.0"],
        ),  # dotted paths
        (["blocks.1.attn.value_proj"], ["blocks.1.attn.value_proj"]),
        (r"blocks\.0\..*", None),  # regex over the whole path
        (r".*mlp.*", None),
    ],
)
def test_targets(getkey, targets, expected):
    model = make_model(getkey())
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=targets))
    converted = linear_paths(fp8, fp8jax.Linear)
    if expected is None:
        expected = [p for p in linear_paths(model, eqx.nn.Linear) if re.fullmatch(targets, p)]
        assert expected
    assert converted == sorted(expected)


def test_last_name_matches_every_layer_with_that_name(getkey):
    model = make_model(getkey())
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["output_proj"]))
    assert linear_paths(fp8, fp8jax.Linear) == [
        "blocks.0.attn.output_proj",
        "blocks.1.attn.output_proj",
    ]


def test_target_matching_nothing_lists_linears(getkey):
    model = make_model(getkey())
    with pytest.raises(ValueError, match=r"'nope' matches no Linear.*'blocks.0.attn.query_proj'"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["nope"]))
    with pytest.raises(ValueError, match=r"matches no Linear layer .*whole dotted path"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets="mlp"))


def test_non_linear_target_is_rejected(getkey):
    model = make_model(getkey())
    with pytest.raises(ValueError, match=r"'embed' names 'embed', a Embedding, not a Linear"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["embed"]))
    with pytest.raises(ValueError, match=r"only modules that are not Linear: 'blocks.0.norm'"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r"blocks\.0\.norm"))


def test_exclusion_of_head_can_be_lifted(getkey):
    model = make_model(getkey())
    with pytest.raises(ValueError, match="keeps in high precision"):
        fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["head"]))
    fp8 = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["head"], exclude=None))
    assert linear_paths(fp8, fp8jax.Linear) == ["head"]


def test_applying_twice_does_not_wrap_twice(getkey):
    model = make_model(getkey())
    once = fp8jax.fp8_linear_layers(model)
    # Give the state a value, so we can see it is kept.
    once = eqx.tree_at(
        lambda m: m.blocks[0].mlp.layers[0].dot_general.input.scale, once, jnp.float32(5.0)
    )
    twice = fp8jax.fp8_linear_layers(once)
    assert jax.tree.structure(twice) == jax.tree.structure(once)
    for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice), strict=True):
        assert a is b
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"attn\.query_proj \(DelayedScaling; "):
        targeted = fp8jax.fp8_linear_layers(once, fp8jax.Fp8Config(targets=r".*mlp.*"))
    assert float(targeted.blocks[0].mlp.layers[0].dot_general.input.scale) == 5.0
    assert isinstance(targeted.blocks[0].attn.query_proj.dot_general, fp8jax.Fp8DotGeneral)


def test_converting_again_with_another_config_keeps_the_layers_and_says_so(getkey):
    """An FP8 layer keeps its recipe and state; where the config would convert it otherwise
    (another recipe, other recipe fields, telemetry, high precision) the plan lists it and a
    warning, pointing at the caller, names it with both."""
    model = eqx.nn.MLP(8, 8, 16, 1, key=getkey())
    once = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(exclude=None))
    cases = [
        (
            fp8jax.Fp8Config(exclude=None, recipe="current"),
            "(DelayedScaling; the config: CurrentScaling)",
        ),
        (
            fp8jax.Fp8Config(exclude=None, recipe=fp8jax.DelayedScaling(margin=1.0)),
            "(DelayedScaling(margin=0.0); the config: DelayedScaling(margin=1.0))",
        ),
        (
            fp8jax.Fp8Config(exclude=None, telemetry=True),
            "telemetry=False; the config: telemetry=True",
        ),
        (
            fp8jax.Fp8Config(exclude="0"),
            "layers.0 (DelayedScaling; the config: high precision, excluded",
        ),
    ]
    for config, says in cases:
        plan = fp8jax.conversion_plan(once, config)
        assert plan.converted == ("layers.0", "layers.1")  # what runs in FP8: both, as before
        assert {c.why for c in plan.layers} == {"DelayedScaling"}
        assert any(says in k for k in plan.kept_as_converted), (says, plan.kept_as_converted)
        assert "FP8 already, kept as it is: " in str(plan)
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=re.escape(says)) as record:
            again = fp8jax.fp8_linear_layers(once, config)
        assert record[0].filename == __file__
        assert all(
            a is b for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(again), strict=True)
        )
        assert again.layers[0].dot_general.recipe == fp8jax.DelayedScaling()
    same = fp8jax.conversion_plan(once, fp8jax.Fp8Config(exclude=None))
    assert same.kept_as_converted == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8jax.fp8_linear_layers(once, fp8jax.Fp8Config(exclude=None))


def test_converting_again_with_example_finds_the_roles_of_fp8_layers(getkey):
    """With `example`, the trace follows an FP8 layer's GEMM as its high-precision one: a
    head converted before (keep=()) is the head the config keeps, named in the plan and the
    warning as without a trace; the layers' roles are the original model's."""
    model = eqx.nn.MLP(8, 4, 16, 1, key=getkey())  # no embedding: only a trace finds the head
    x = jax.random.normal(getkey(), (2, 8))
    example = lambda m: jax.vmap(m)(x)  # noqa: E731
    reference = fp8jax.conversion_plan(model, example=example)
    assert reference.kept["layers.1"].startswith("head: ")
    once = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(keep=()), example=example)
    plan = fp8jax.conversion_plan(once, example=example)
    assert plan.converted == ("layers.0", "layers.1")  # what runs in FP8: both, as before
    says = f"layers.1 (DelayedScaling; the config: high precision, {reference.kept['layers.1']})"
    assert plan.kept_as_converted == (says,)
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=re.escape(says)):
        again = fp8jax.fp8_linear_layers(once, example=example)
    assert all(a is b for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(again), strict=True))
    # An example calling another model than the one it is given is refused, as on the first
    # conversion: every layer is FP8 here, and the trace follows them all.
    with pytest.raises(ValueError, match="example traced no GEMM"):
        fp8jax.conversion_plan(once, example=lambda m: jax.vmap(model)(x))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"targets": 3}, ValueError, "targets=3"),
        ({"targets": "(("}, ValueError, "not a valid regex"),
        ({"recipe": "blockwise-ish"}, ValueError, "Unknown recipe 'blockwise-ish'"),
        ({"exclude": "[a-"}, ValueError, "not a valid regex"),
    ],
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8jax.Fp8Config(**kwargs)


def test_bad_config_type(getkey):
    with pytest.raises(TypeError, match="Fp8Config"):
        fp8jax.fp8_linear_layers(make_model(getkey()), {"targets": None})


def test_tree_without_linears():
    with pytest.raises(ValueError, match="no Linear"):
        fp8jax.fp8_linear_layers({"a": jnp.ones(3)})

"""`Fp8Config` and Equinox conversion at their edges, each once a crash or a silent surprise:
tied weights, non-floating Linears, fp8jax Linears built with another GEMM, `exclude` by
path and matching nothing, a config rebuilt with `dataclasses.replace`, expert layers given
a recipe without a grouped GEMM."""

import dataclasses
import warnings

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_examples_not_calling_the_model_are_refused
from reference import per_tensor_current

import fp8jax

D, V = 32, 64


class Tied(eqx.Module):
    """An embedding and a head sharing one table through `eqx.nn.Shared`, `head_is_node`
    choosing which of the two holds the node standing for it."""

    shared: eqx.nn.Shared
    fc: eqx.nn.Linear

    def __init__(self, head_is_node: bool, key):
        k1, k2, k3 = jax.random.split(key, 3)
        emb = eqx.nn.Embedding(V, D, key=k1)
        head = eqx.nn.Linear(D, V, use_bias=False, key=k2)
        where, get = (lambda p: p[1].weight), (lambda p: p[0].weight)
        if not head_is_node:
            where, get = get, where
        self.shared = eqx.nn.Shared((emb, head), where, get)
        self.fc = eqx.nn.Linear(D, D, key=k3)

    def __call__(self, token):
        emb, head = self.shared()
        return head(jax.nn.gelu(self.fc(emb(token))))


@pytest.mark.parametrize("head_is_node", [True, False])
def test_a_tied_weight_converts_and_trains(head_is_node):
    """A Linear whose weight `eqx.nn.Shared` replaced by its node stays in high precision,
    saying why; the rest converts, and the model runs and differentiates (it crashed reading
    the node's shape, whatever the config)."""
    model = Tied(head_is_node, jax.random.key(0))
    config = fp8jax.Fp8Config(keep=(), exclude=None)
    plan = fp8jax.conversion_plan(model, config)
    if head_is_node:
        assert plan.converted == ("fc",)
        assert plan.kept == {"shared.pytree.1": "its weight is another layer's (eqx.nn.Shared)"}
    else:  # the head holds the table: an ordinary Linear
        assert plan.converted == ("fc", "shared.pytree.1")
    fp8 = fp8jax.fp8_linear_layers(model, config)
    tokens = jnp.arange(8)
    want = jax.vmap(model)(tokens)
    got = jax.vmap(fp8)(tokens)
    assert float(jnp.max(jnp.abs(got - want))) < 0.1 * float(jnp.max(jnp.abs(want)))
    grads = fp8jax.filter_grad(lambda m: jnp.sum(jax.vmap(m)(tokens) ** 2))(fp8)
    assert all(
        bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    )
    if head_is_node:  # named as the only target, it is kept all the same, saying why
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"converted no layer") as said:
            fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=["shared.pytree.1"]))
        assert "its weight is another layer's (eqx.nn.Shared)" in str(said[0].message)


@pytest.mark.parametrize("head_is_node", [True, False])
def test_a_tied_head_stays_in_high_precision_by_default(head_is_node):
    """With the default config and no example, the head of a tied pair stays in high
    precision whichever of the two holds the table: its outputs span the embedding's
    vocabulary. Holding the table, it went to FP8 (the tied embedding's rows were not
    counted, so no vocabulary was known)."""
    plan = fp8jax.conversion_plan(Tied(head_is_node, jax.random.key(0)))
    assert plan.converted == ("fc",)
    reason = plan.kept["shared.pytree.1"]
    if head_is_node:
        assert reason == "its weight is another layer's (eqx.nn.Shared)"
    else:
        assert reason.startswith(f"head: its {V} outputs span the vocabulary"), reason


class Pytree(eqx.Module):
    """A model whose repeated blocks are a list in a field named `pytree` (as
    `eqx.nn.Shared` names its tied layers), each block with a vocabulary-wide Linear."""

    embed: eqx.nn.Embedding
    pytree: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(V, D, key=k[0])
        self.pytree = [eqx.nn.Linear(D, V, key=kk) for kk in k[1:3]]
        self.head = eqx.nn.Linear(D, V, key=k[3])


def test_a_field_named_pytree_is_repeated_blocks_like_any_list():
    """The blocks of a list are repeated, never heads by shape, whatever the field's name:
    the same model with the list named `blocks` keeps only `head`. Named `pytree`, its
    entries were exempted as if they were an `eqx.nn.Shared`'s tied layers (by that name)
    and kept as heads."""
    model = Pytree(jax.random.key(0))
    as_blocks = {"embed": model.embed, "blocks": model.pytree, "head": model.head}
    want = fp8jax.conversion_plan(as_blocks)
    assert want.converted == ("blocks.0", "blocks.1") and list(want.kept) == ["head"]
    plan = fp8jax.conversion_plan(model)
    assert plan.converted == ("pytree.0", "pytree.1")
    assert list(plan.kept) == ["head"], plan.kept


class Twice(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
        return self.b(self.a(x))


def test_a_linear_held_at_two_places_becomes_two_fp8_layers_with_one_weight():
    """One `eqx.nn.Linear` object at two places is two layers to JAX (Equinox's copy
    semantics; docs/conversion.md): converted, each place is an FP8 layer of its own, both
    on the same weight array, each with an FP8 state recording its own call's amax."""
    linear = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    model = fp8jax.fp8_linear_layers(Twice(linear, linear))
    assert isinstance(model.a, fp8jax.Linear) and isinstance(model.b, fp8jax.Linear)
    assert model.a.weight is model.b.weight is linear.weight
    x = np.linspace(-3.0, 2.0, 4, dtype=np.float32)
    grads = fp8jax.filter_grad(lambda m: jnp.sum(m(x)))(model)
    hidden = np.asarray(model.a(x))  # b's input
    assert float(grads.a.dot_general.input.amax_history[0]) == np.abs(x).max()
    assert float(grads.b.dot_general.input.amax_history[0]) == np.abs(hidden).max() != 3.0


def test_a_non_floating_linear_is_kept_and_named():
    """A complex Linear among real ones stays in high precision with its dtype as the reason
    (it raised a TypeError naming no layer, after a plan that listed it as FP8)."""
    keys = jax.random.split(jax.random.key(0), 3)
    layers = [eqx.nn.Linear(D, D, key=k) for k in keys[:2]]
    layers.append(eqx.nn.Linear(D, D, key=keys[2], dtype=jnp.complex64))
    plan = fp8jax.conversion_plan(layers)
    assert plan.converted == ("0", "1")
    assert plan.kept == {"2": "its weight is complex64, not a floating dtype FP8 could round"}
    fp8 = fp8jax.fp8_linear_layers(layers)
    assert fp8[2] is layers[2]
    assert isinstance(fp8[0].dot_general, fp8jax.Fp8DotGeneral)


def test_an_fp8jax_linear_with_another_gemm_converts_as_an_equinox_one():
    """`fp8jax.Linear(w, b, dot_general=lax.dot_general)` converts to the FP8 layer an
    `eqx.nn.Linear` of the same weights becomes, output bit for bit (it raised: the
    conversion passed the static field `use_bias` to `Linear.__init__`)."""
    linear = eqx.nn.Linear(D, D, key=jax.random.key(0))
    plain = fp8jax.Linear(linear.weight, linear.bias, dot_general=jax.lax.dot_general)
    x = jax.random.normal(jax.random.key(1), (D,))
    np.testing.assert_array_equal(plain(x), linear(x))
    converted = fp8jax.fp8_linear_layers([plain])[0]
    reference = fp8jax.fp8_linear_layers([linear])[0]
    assert isinstance(converted.dot_general, fp8jax.Fp8DotGeneral)
    assert converted.dot_general.name == "0"
    np.testing.assert_array_equal(converted(x), reference(x))


def test_a_linear_sized_by_numpy_ints_converts():
    """An `eqx.nn.Linear(np.int64(4), np.int64(3))` (sizes from a NumPy config) converts and
    computes what the Equinox layer does, its sizes Python ints (it raised 'in_features=
    np.int64(4) does not match the weight: should be None or 4')."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox warns of a NumPy scalar in a static field
        linear = eqx.nn.Linear(np.int64(4), np.int64(3), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    plain = fp8jax.Linear.from_eqx(linear, jax.lax.dot_general)
    np.testing.assert_array_equal(plain(x), jax.vmap(linear)(x))
    assert (type(plain.in_features), type(plain.out_features)) == (int, int)
    assert (plain.in_features, plain.out_features) == (4, 3)
    converted = fp8jax.fp8_linear_layers([linear])[0]
    assert isinstance(converted.dot_general, fp8jax.Fp8DotGeneral)
    assert converted(x).shape == (2, 3)


def test_a_linear_resized_by_tree_at_converts_to_what_its_call_computes():
    """An `eqx.nn.Linear(8, 10)` whose weight and bias `eqx.tree_at` replaced by `(12, 8)` and
    `(12,)` ones (a vocabulary grown by model surgery) keeps the stale `out_features=10` that
    Equinox's call never reads; conversion raised 'Linear out_features=10 does not match the
    weight', not naming the layer. It converts to the weight's sizes, its output the FP8
    GEMM of the new weight (NumPy + ml_dtypes reference)."""
    keys = jax.random.split(jax.random.key(0), 4)
    linear = eqx.nn.Linear(8, 10, key=keys[0])
    weight = jax.random.normal(keys[1], (12, 8))
    bias = jax.random.normal(keys[2], (12,))
    resized = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (weight, bias))
    x = jax.random.normal(keys[3], (3, 8))
    config = fp8jax.Fp8Config(recipe="current")
    converted = fp8jax.fp8_linear_layers({"out": resized}, config)["out"]
    assert (converted.in_features, converted.out_features) == (8, 12)
    y = np.asarray(jax.vmap(converted)(x), np.float64)
    expected, _, _ = per_tensor_current(
        np.asarray(x, np.float64), np.asarray(weight, np.float64), np.zeros((3, 12))
    )
    expected = expected.astype(np.float32) + np.asarray(bias)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_bias", [True, False])
def test_a_bfloat16_linear_on_float16_inputs_promotes_as_the_equinox_one(use_bias):
    """An `eqx.nn.Linear` of BF16 weights called on float16 `x` returns float32 (`weight @ x`
    promotes as `jnp.promote_types`); converted, it returned BF16 (`lax.dot_general`'s
    type for the pair), the FP8 GEMM's result rounded to 8 bits of mantissa. It returns
    float32: the FP8 GEMM of the operands (NumPy + ml_dtypes reference), and gradients in
    each operand's own dtype, as Equinox's."""
    keys = jax.random.split(jax.random.key(0), 3)
    linear = eqx.nn.Linear(8, 4, use_bias=use_bias, dtype=jnp.bfloat16, key=keys[0])
    x = jax.random.normal(keys[1], (3, 8)).astype(jnp.float16)
    g = np.asarray(jax.random.normal(keys[2], (3, 4)), np.float32)
    converted = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe="current"))
    y = jax.vmap(converted)(x)
    assert y.dtype == jax.vmap(linear)(x).dtype == jnp.float32
    expected, d_x, d_w = per_tensor_current(
        np.asarray(x, np.float64), np.asarray(linear.weight, np.float64), g.astype(np.float64)
    )
    expected = expected.astype(np.float32)
    if use_bias:
        expected = expected + np.asarray(linear.bias, np.float32)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6, atol=1e-6)
    grads = eqx.filter_grad(lambda mx: jnp.sum(jax.vmap(mx[0])(mx[1]) * g))((converted, x))
    layer, d_input = grads
    assert (d_input.dtype, layer.weight.dtype) == (jnp.float16, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(d_input), d_x.astype(np.float32).astype(np.float16))
    np.testing.assert_array_equal(
        np.asarray(layer.weight), d_w.astype(np.float32).astype(jnp.bfloat16)
    )


def test_explain_takes_a_numpy_bool_as_the_bool_it_holds(capsys):
    """`explain=np.True_` (a flag read from a NumPy config, as `Fp8Config` takes for its
    own flags) raised 'explain=np.True_: should be True or False'. It prints the plan that
    `fp8jax.conversion_plan` returns, as `explain=True` does."""
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    fp8jax.fp8_linear_layers(model, explain=np.True_)
    assert capsys.readouterr().out == f"{fp8jax.conversion_plan(model)}\n"
    fp8jax.fp8_linear_layers(model, explain=np.False_)
    assert capsys.readouterr().out == ""


def test_a_model_no_config_converts_is_not_told_to_change_its_config():
    """A model whose one Linear is complex (kept whatever the config) warned 'Pass
    Fp8Config(keep=()) to convert heads and routers, exclude=None to ignore names, or name
    the layers in targets', which converts nothing either (shown below). It says no config
    converts it; a head kept by its name still gets that advice."""
    linear = eqx.nn.Linear(4, 4, dtype=jnp.complex64, key=jax.random.key(0))
    for config in (None, fp8jax.Fp8Config(keep=(), exclude=None, targets=["layer"])):
        with pytest.warns(fp8jax.Fp8ConversionWarning, match="converted no layer") as said:
            converted = fp8jax.fp8_linear_layers({"layer": linear}, config)
        assert converted["layer"] is linear  # the advice, followed, converts nothing
        assert "keep=()" not in str(said[0].message)
        assert "No Fp8Config converts these" in str(said[0].message)
    head = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"exclude=None to ignore names"):
        fp8jax.fp8_linear_layers({"head": head})
    # Beside the complex layer, the head kept by its name still gets the advice (one layer
    # a config would convert is enough: any, not all).
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"exclude=None to ignore names"):
        fp8jax.fp8_linear_layers({"head": head, "layer": linear})


def test_a_vocabulary_wide_head_is_kept_whatever_its_field_is_called():
    """Roles go by shape, not name: an Equinox head as wide as the embedding's vocabulary is
    kept. One in a field called `stacked` was converted (the name taken for a Haliax
    `Stacked`'s, whose layers are never heads by shape); it is kept as the same head under
    another name is."""
    key = jax.random.key(0)

    def plan(name):
        fields = {"emb": eqx.nn.Embedding, "body": eqx.nn.Linear, name: eqx.nn.Linear}
        model = type("LM", (eqx.Module,), {"__annotations__": fields})(
            eqx.nn.Embedding(V, D, key=key),
            eqx.nn.Linear(D, D, key=key),
            eqx.nn.Linear(D, V, key=key),
        )
        return fp8jax.conversion_plan(model)

    assert plan("out").converted == ("body",)
    assert plan("stacked").converted == ("body",)
    assert plan("stacked").kept["stacked"].startswith("head: ")


def test_exclude_matches_a_dotted_path_and_warns_when_it_matches_nothing():
    """`exclude` matches a layer's last name or its whole dotted path (a path never matched:
    `r"layers\\.2"` left the layer in FP8, silently); one that matches no layer warns."""
    mlp = eqx.nn.MLP(D, D, D, 3, key=jax.random.key(0))
    config = fp8jax.Fp8Config(exclude=r"layers\.2")
    assert fp8jax.conversion_plan(mlp, config).converted == ("layers.0", "layers.1", "layers.3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8 = fp8jax.fp8_linear_layers(mlp, config)
    assert fp8.layers[2] is mlp.layers[2]
    for unmatched in ("layer_2", r"blocks\..*"):
        config = fp8jax.Fp8Config(exclude=unmatched)
        plan = fp8jax.conversion_plan(mlp, config)
        assert len(plan.converted) == 4 and plan.unmatched
        assert f"matches nothing: exclude={unmatched!r}" in str(plan)
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"keeps no layer in high precision"):
            fp8jax.fp8_linear_layers(mlp, config)
    # The default exclude matching nothing (a model without a head so named) is silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8jax.fp8_linear_layers(mlp)


def test_a_config_rebuilt_by_dataclasses_replace_keeps_its_recipes():
    """A config with `recipes` holds them as a tuple of pairs, which its check refused when
    `dataclasses.replace` built the config again; `None` as a recipe is refused by name (it
    meant delayed scaling)."""
    config = fp8jax.Fp8Config(recipe="current", recipes={"fc1": "blockwise"})
    again = dataclasses.replace(config, telemetry=True)
    assert again.recipes == config.recipes and again.telemetry
    assert dataclasses.replace(again, telemetry=False) == config
    assert (
        fp8jax.Fp8Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        == config
    )
    with pytest.raises(ValueError, match=r"recipes pattern 'fc1': recipe None"):
        fp8jax.Fp8Config(recipes={"fc1": None})
    with pytest.raises(ValueError, match=r"keep=\[\['head'\]\]: should be a tuple of roles"):
        fp8jax.Fp8Config(keep=[["head"]])


def test_a_plan_refuses_an_expert_recipe_without_a_grouped_gemm():
    """`conversion_plan` refuses what the conversion refuses: an expert layer given a recipe
    without a grouped GEMM (it printed "FP8 (ResidualFP8)")."""

    class MoE(eqx.Module):
        experts: fp8jax.GroupedLinear
        fc: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.experts = fp8jax.GroupedLinear(4, D, D, key=k1)
            self.fc = eqx.nn.Linear(D, D, key=k2)

    model = MoE(jax.random.key(0))
    message = r"FP8 grouped layer 'experts': recipe ResidualFP8 has no FP8 grouped GEMM"
    for convert in (fp8jax.conversion_plan, fp8jax.fp8_linear_layers):
        with pytest.raises(ValueError, match=message):
            convert(model, fp8jax.Fp8Config(recipe="residual"))
    config = fp8jax.Fp8Config(recipe="residual", recipes={"experts": "current"})
    assert fp8jax.conversion_plan(model, config).converted == ("experts", "fc")


def test_a_model_that_is_one_linear_is_named_root_in_errors():
    """A Linear that is the whole model is `(root)` in a target's error, as in the plan (it
    was listed as `''`)."""
    linear = eqx.nn.Linear(D, D, key=jax.random.key(0))
    assert "(root)" in str(fp8jax.conversion_plan(linear))
    with pytest.raises(ValueError, match=r"matches no Linear layer. Linear layers: '\(root\)'\."):
        fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(targets=["fc"]))


def test_a_stack_of_linears_called_on_the_whole_stack_names_the_fix():
    """A stack of Linears (built under eqx.filter_vmap) holds one FP8 state per layer; called
    on the whole stack instead of one layer at a time, it says so (it raised a concatenate
    error naming neither), and under vmap it runs each layer as that layer alone does."""
    keys = jax.random.split(jax.random.key(0), 3)
    stack = fp8jax.fp8_linear_layers(eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys))
    x = jax.random.normal(jax.random.key(1), (3, D))
    with pytest.raises(ValueError, match=r"stack of \(3,\) states .* under jax.vmap or lax.scan"):
        stack(x[0])
    got = eqx.filter_vmap(lambda layer, x: layer(x))(stack, x)
    for i in range(3):
        one = fp8jax.fp8_linear_layers(eqx.nn.Linear(D, D, key=keys[i]))
        np.testing.assert_array_equal(got[i], one(x[i]))


def test_a_stack_of_non_square_linears_called_whole_names_the_fix():
    """The same for layers of 4 inputs and 3 outputs given a member's x (4,) or not: it said
    'Linear expects x of shape (..., 3)', the stack's second axis, not the inputs."""
    keys = jax.random.split(jax.random.key(0), 2)
    stack = fp8jax.fp8_linear_layers(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 3, key=k))(keys))
    with pytest.raises(ValueError, match=r"stack of \(2,\) states .* under jax.vmap or lax.scan"):
        stack(jnp.ones(4))
    with pytest.raises(ValueError, match=r"stack of \(2,\) layers' weights .* one member at"):
        stack(jnp.ones(3))


def test_a_subclass_of_the_equinox_linear_is_kept_with_its_own_call():
    """A subclass of `eqx.nn.Linear` with a call and fields of its own stays as it is, in
    high precision, saying why (it became a plain `fp8jax.Linear`, silently dropping its
    call: this one's output halved); the plain Linear beside it converts."""

    class Scaled(eqx.nn.Linear):
        alpha: float = eqx.field(static=True, default=2.0)

        def __call__(self, x, *, key=None):
            return super().__call__(x) * self.alpha

    keys = jax.random.split(jax.random.key(0), 2)
    layers = [Scaled(D, D, key=keys[0]), eqx.nn.Linear(D, D, key=keys[1])]
    plan = fp8jax.conversion_plan(layers, fp8jax.Fp8Config(keep=()))
    assert plan.converted == ("1",)
    assert "Scaled, a subclass of eqx.nn.Linear" in plan.kept["0"]
    fp8 = fp8jax.fp8_linear_layers(layers, fp8jax.Fp8Config(keep=()))
    assert fp8[0] is layers[0] and isinstance(fp8[1], fp8jax.Linear)
    x = jax.random.normal(jax.random.key(1), (D,))
    np.testing.assert_array_equal(fp8[0](x), 2.0 * eqx.nn.Linear.__call__(layers[0], x))


def test_an_example_that_does_not_call_the_model_it_is_given_is_refused():
    """`example` must call the model it is handed: one calling the model it closes over
    (or returning nothing) traced none of its layers' GEMMs (or no output), and the plan,
    "roles from a trace", put the head `output` in FP8 silently."""

    class Net(eqx.Module):
        fc: eqx.nn.Linear
        output: eqx.nn.Linear

        def __call__(self, x):
            return self.output(jax.nn.relu(self.fc(x)))

    keys = jax.random.split(jax.random.key(0), 2)
    model = Net(eqx.nn.Linear(D, D, key=keys[0]), eqx.nn.Linear(D, 4, key=keys[1]))
    x = jnp.ones(D)
    assert fp8jax.conversion_plan(model, example=lambda m: m(x)).converted == ("fc",)
    assert_examples_not_calling_the_model_are_refused(model, x)


def test_a_model_in_fp8_already_converts_again_with_an_example():
    """Converting a model again leaves its FP8 layers as they are, with `example` too: an
    example calling a model whose every Linear is FP8 already was refused as calling a model
    it closes over (the trace cannot see a weight through its FP8 quantization)."""
    mlp = eqx.nn.MLP(D, 4, D, depth=1, key=jax.random.key(0))
    x = jnp.ones((2, D))
    config = fp8jax.Fp8Config(keep=())
    fp8 = fp8jax.fp8_linear_layers(mlp, config)
    plan = fp8jax.conversion_plan(fp8, config, example=lambda m: jax.vmap(m)(x))
    assert plan.converted == ("layers.0", "layers.1") and plan.traced
    assert fp8jax.fp8_linear_layers(fp8, config, example=lambda m: jax.vmap(m)(x)) is fp8


def test_an_abstract_model_is_planned_from_a_trace_of_its_example():
    """A model built abstractly (`eqx.filter_eval_shape`, too large to build) is planned with
    `example` as the model itself is: its weights, `jax.ShapeDtypeStruct`s, are traced as
    arrays. They were left out of the trace as not arrays, so the example called the model
    on a ShapeDtypeStruct and raised a TypeError from inside it."""

    def make():
        return eqx.nn.MLP(D, 4, D, depth=2, key=jax.random.key(0))

    x = jnp.ones((2, D))
    want = fp8jax.conversion_plan(make(), example=lambda m: jax.vmap(m)(x))
    abstract = eqx.filter_eval_shape(make)
    assert isinstance(abstract.layers[0].weight, jax.ShapeDtypeStruct)
    got = fp8jax.conversion_plan(abstract, example=lambda m: jax.vmap(m)(x))
    assert got == want and got.traced and got.kept == {"layers.2": want.kept["layers.2"]}


def test_conv_layers_stay_in_high_precision():
    """Equinox's and Haliax's Conv layers are not converted (docs/conversion.md, "What is
    reached"): the converted model holds the very same Conv, whose output is the plain one's
    bit for bit, with the model's Linear in FP8 beside it."""
    keys = jax.random.split(jax.random.key(0), 4)
    C, L, Out = hax.Axis("C", 2), hax.Axis("L", 8), hax.Axis("Out", D)
    convs = [
        (eqx.nn.Conv1d(2, D, 3, key=keys[0]), jnp.ones((2, 8))),
        (eqx.nn.Conv2d(2, D, 3, key=keys[1]), jnp.ones((2, 5, 5))),
        (eqx.nn.ConvTranspose1d(2, D, 3, key=keys[2]), jnp.ones((2, 8))),
        (hax.nn.Conv.init(Spatial=(L,), In=C, Out=Out, kernel_size=3, key=keys[3]), None),
    ]
    for conv, x in convs:
        x = hax.random.normal(keys[0], (C, L)) if x is None else x
        model = (conv, eqx.nn.Linear(D, D, key=keys[3]))
        config = fp8jax.Fp8Config(keep=())
        assert fp8jax.conversion_plan(model, config).converted == ("1",)
        fp8 = fp8jax.fp8_linear_layers(model, config)
        assert fp8[0] is conv and isinstance(fp8[1].dot_general, fp8jax.Fp8DotGeneral)
        got, want = fp8[0](x), conv(x)
        np.testing.assert_array_equal(getattr(got, "array", got), getattr(want, "array", want))

"""The rules by which a conversion picks layers, each on a tiny Equinox model whose expected
plan is written out by hand from the documented rule (`Fp8Config`'s arguments, the roles of
`convert/roles.py`): the slips a one-character change makes in them (a `search` for a
`fullmatch`, a dropped role, the last match for the first) each fail one of these."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax


def linears(**widths):
    """A dict of bias-free `eqx.nn.Linear`s, each name's `(in, out)` widths."""
    keys = iter(jax.random.split(jax.random.key(0), len(widths)))
    return {n: eqx.nn.Linear(i, o, use_bias=False, key=next(keys)) for n, (i, o) in widths.items()}


def test_exclude_must_match_a_whole_last_name():
    """`exclude` must match a Linear's last name whole (or its whole path): the default's
    `head` keeps `head`, not `heads` or `head_proj`; `"up"` keeps `up`, not `up_proj`."""
    tree = linears(head=(8, 8), heads=(8, 8), head_proj=(8, 8), up=(8, 8), up_proj=(8, 8))
    plan = fp8jax.conversion_plan(tree)
    assert plan.converted == ("head_proj", "heads", "up", "up_proj")
    assert list(plan.kept) == ["head"]
    plan = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(exclude="up"))
    assert plan.converted == ("head", "head_proj", "heads", "up_proj")


class _Router(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jax.lax.top_k(x @ self.w, 2)[1]


class _Mix(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class _RawGemms(eqx.Module):
    """A Linear fed by a module multiplying by its own weight (`mix`), scaled by what a
    router written as `x @ w` chose by a top-k: both GEMMs fp8jax cannot convert, neither
    a head (each feeds the Linear's)."""

    fc: eqx.nn.Linear
    out: eqx.nn.Linear
    mix: _Mix
    router: _Router

    def __call__(self, x):
        return self.out(self.fc(self.mix(x) * jnp.sum(self.router(x))))


def test_a_raw_gemm_feeding_a_top_k_is_a_router_not_an_unconverted_gemm():
    """A trace lists the modules whose own GEMMs fp8jax cannot convert, bar heads and
    routers (high precision by role anyway): `mix`, not the top-k's `router`."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    model = _RawGemms(
        eqx.nn.Linear(8, 8, key=k1), eqx.nn.Linear(8, 8, key=k4),
        _Mix(jax.random.normal(k2, (8, 8))),
        _Router(jax.random.normal(k3, (8, 4))),
    )  # fmt: skip
    plan = fp8jax.conversion_plan(model, example=lambda m: m(jnp.ones(8)))
    assert plan.converted == ("fc",)
    assert plan.kept["out"].startswith("head")
    assert [u.split(" ")[0] for u in plan.unconverted] == ["mix"]


def test_a_regex_target_must_match_the_whole_dotted_path():
    """A `targets` regex matches a layer's whole dotted path, not a prefix of it: `"fc1"`
    selects `fc1`, not `fc10`; `r"mlp\\.up"` selects `mlp.up`, not `mlp.up_proj`."""
    tree = {**linears(fc1=(8, 8), fc10=(8, 8)), "mlp": linears(up=(8, 8), up_proj=(8, 8))}
    assert fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets="fc1")).converted == ("fc1",)
    plan = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets=r"mlp\.up"))
    assert plan.converted == ("mlp.up",)


def test_a_listed_target_is_a_name_not_a_regex():
    """A list of `targets` names layers (their last name or whole path); `"fc."` is no
    layer's name, so it matches none, though as a regex it would match `fc1`."""
    tree = linears(fc1=(8, 8), fc2=(8, 8))
    with pytest.raises(ValueError, match=r"target 'fc\.' matches no Linear layer"):
        fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets=["fc."]))


def test_the_first_matching_recipes_pattern_wins():
    """`recipes`: the first pattern matching a layer gives its recipe, later ones only the
    layers it leaves; layers matched by none get `recipe`."""
    tree = linears(fc1=(8, 8), fc2=(8, 8), out=(8, 8))
    config = fp8jax.Fp8Config(recipe="delayed", recipes={"fc1": "current", r"fc\d": "blockwise"})
    plan = fp8jax.conversion_plan(tree, config)
    whys = {c.path: c.why for c in plan.layers}
    assert whys == {"fc1": "CurrentScaling", "fc2": "BlockwiseScaling", "out": "DelayedScaling"}


def test_a_regex_target_partly_excluded_converts_the_rest():
    """A `targets` regex some of whose layers `exclude` keeps is no error (only one whose
    every layer is excluded is): the others convert."""
    tree = linears(fc1=(8, 8), fc2=(8, 8), head=(8, 8))
    plan = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets=r"fc1|head"))
    assert plan.converted == ("fc1",)
    assert plan.kept["head"].startswith("excluded by name")
    with pytest.raises(ValueError, match=r"selects only 'head', which exclude="):
        fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets=r"head"))


def test_only_a_linear_exactly_as_wide_as_the_vocabulary_is_a_head_by_width():
    """Without a trace, a head is a Linear outside the blocks whose width is the largest
    embedding's row count (16): not one wider (32), nor one narrower."""
    key = jax.random.key(2)
    tree = {"embed": eqx.nn.Embedding(16, 8, key=key), **linears(out=(8, 16), wide=(8, 32))}
    tree["narrow"] = eqx.nn.Linear(8, 4, key=key)
    plan = fp8jax.conversion_plan(tree)
    assert plan.converted == ("narrow", "wide")
    assert plan.kept["out"].startswith("head: its 16 outputs span the vocabulary of embedding")


def test_a_router_is_found_beside_its_experts_or_above_them():
    """Without a trace, a Linear as wide as an expert layer's expert count (4) is a router
    when the experts are in its module or one below it (`moe.gate` over `moe.inner.experts`,
    `flat.gate` beside `flat.experts`), not when they are elsewhere (`dense.gate`); a stack
    of MoE blocks (built under `eqx.filter_vmap`, weights `(3, 4, ...)`) counts its experts,
    not its layers."""
    keys = iter(jax.random.split(jax.random.key(3), 8))

    def block(key):
        k1, k2 = jax.random.split(key)
        gate = eqx.nn.Linear(8, 4, use_bias=False, key=k1)
        return {"gate": gate, "experts": fp8jax.GroupedLinear(4, 8, 8, key=k2)}

    tree = {
        "moe": {
            "gate": eqx.nn.Linear(8, 4, key=next(keys)),
            "inner": {"experts": fp8jax.GroupedLinear(4, 8, 8, key=next(keys))},
        },
        "flat": block(next(keys)),
        "dense": linears(gate=(8, 4), up=(8, 8)),
        "stack": eqx.filter_vmap(block)(jax.random.split(next(keys), 3)),
    }
    plan = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(recipe="current"))
    routers = {p for p, why in plan.kept.items() if why.startswith("router")}
    assert routers == {"moe.gate", "flat.gate", "stack.gate"}
    assert set(plan.converted) == {
        "moe.inner.experts", "flat.experts", "dense.gate", "dense.up", "stack.experts",
    }  # fmt: skip


class _Recurrent(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, xs):
        def step(c, x):
            return jnp.tanh(self.a(x)), self.b(c)  # `b` reads the step before's `a`

        return jax.lax.scan(step, jnp.zeros(8), xs)


def test_a_gemm_reaching_another_only_through_a_scan_carry_is_no_head():
    """A scan's carry is followed until what it holds no longer grows: `a`'s output reaches
    `b`'s GEMM only in the next step, so `a` is no head though its last output is returned;
    `b`, the last GEMM before the output, is."""
    model = _Recurrent(*(eqx.nn.Linear(8, 8, key=k) for k in jax.random.split(jax.random.key(4))))
    plan = fp8jax.conversion_plan(model, example=lambda m: m(jnp.ones((3, 8))))
    assert plan.converted == ("a",)
    assert plan.kept["b"].startswith("head")


def test_a_model_converted_again_with_an_equal_config_is_kept_silently():
    """Converting an FP8 model again with a config equal to its own (a new but equal
    recipe) keeps its layers as they are and lists none as differing."""
    tree = linears(fc1=(8, 8), fc2=(8, 8))
    fp8 = fp8jax.fp8_linear_layers(tree, fp8jax.Fp8Config(recipe="current", telemetry=True))
    again = fp8jax.Fp8Config(recipe=fp8jax.CurrentScaling(), telemetry=True)
    assert fp8jax.conversion_plan(fp8, again).kept_as_converted == ()
    plan = fp8jax.conversion_plan(fp8, fp8jax.Fp8Config(recipe="current"))
    assert [k.split(" ")[0] for k in plan.kept_as_converted] == ["fc1", "fc2"]


def test_a_listed_target_converts_a_head_a_regex_target_does_not():
    """A Linear named in a list of `targets` is converted whatever its role; one a regex
    selects keeps its role (the vocabulary-wide `out`, a head)."""
    key = jax.random.key(5)
    tree = {"embed": eqx.nn.Embedding(16, 8, key=key), **linears(out=(8, 16), fc=(8, 8))}
    listed = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets=["out", "fc"]))
    assert listed.converted == ("fc", "out")
    regex = fp8jax.conversion_plan(tree, fp8jax.Fp8Config(targets="out|fc"))
    assert regex.converted == ("fc",) and regex.kept["out"].startswith("head")


def test_a_model_kept_whole_by_its_names_is_told_to_change_exclude():
    """A conversion that converts nothing because `exclude` matched every Linear's name
    warns and says how to lift it (`exclude=None`)."""
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"converted no layer.*exclude=None"):
        fp8jax.fp8_linear_layers(linears(head=(8, 8), router=(8, 4)))


class _Remat(eqx.Module):
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, x):
        return jax.checkpoint(lambda m, x: m.out(jnp.tanh(m.fc(x))))(self, x)


def test_gemms_under_a_checkpoint_are_traced_as_outside_one():
    """The trace follows a model's call into the jaxprs it holds (`jax.checkpoint`'s): the
    last GEMM before the output (`out`) is the head, `fc` converts."""
    model = _Remat(*(eqx.nn.Linear(8, 8, key=k) for k in jax.random.split(jax.random.key(6))))
    plan = fp8jax.conversion_plan(model, example=lambda m: m(jnp.ones(8)))
    assert plan.converted == ("fc",)
    assert plan.kept["out"].startswith("head")


class _OneHotEmbed(eqx.Module):
    embed: eqx.nn.Embedding
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, token):
        x = jax.nn.one_hot(token, 16) @ self.embed.weight  # the lookup as a GEMM
        return self.out(jnp.tanh(self.fc(x)))


def test_an_embedding_looked_up_by_a_gemm_is_not_an_unconverted_gemm():
    """A trace lists no embedding table among the GEMMs fp8jax cannot convert, even where
    the model looks it up by a one-hot GEMM (its GEMM feeds `fc`'s: no head)."""
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    model = _OneHotEmbed(
        eqx.nn.Embedding(16, 8, key=k1), eqx.nn.Linear(8, 8, key=k2), eqx.nn.Linear(8, 8, key=k3)
    )
    plan = fp8jax.conversion_plan(model, example=lambda m: m(3))
    assert plan.converted == ("fc",) and plan.unconverted == ()


class _Unsorted(eqx.Module):
    z: eqx.nn.Linear
    a: eqx.nn.Linear


def test_a_plan_lists_its_layers_in_path_order():
    """A plan's layers are in path order, not the order the model declares them in."""
    model = _Unsorted(*(eqx.nn.Linear(8, 8, key=k) for k in jax.random.split(jax.random.key(8))))
    plan = fp8jax.conversion_plan(model)
    assert [c.path for c in plan.layers] == ["a", "z"] and plan.converted == ("a", "z")


def test_a_dataflow_counts_each_gemm_of_a_layer_once():
    """`Dataflow.gemms` counts a layer's GEMM equations: one in a scan's body is one (the
    body is followed more than once, to its carry's fixed point), one in each of a cond's
    two branches two."""
    from fp8jax._src.convert.roles import dataflow

    def scanned(w, xs):
        return jax.lax.scan(lambda c, x: (c + x @ w, None), jnp.zeros(4), xs)[0]

    def branched(w, x):
        return jax.lax.cond(x[0] > 0, lambda: x @ w, lambda: 2.0 * (x @ w))

    w, x = jnp.ones((4, 4)), jnp.ones(4)
    flow = dataflow(jax.make_jaxpr(scanned)(w, jnp.ones((3, 4))), [("a",), None])
    assert flow.gemms == {("a",): 1}
    assert dataflow(jax.make_jaxpr(branched)(w, x), [("a",), None]).gemms == {("a",): 2}


def test_a_while_condition_sees_what_the_body_carries_into_it():
    """A `while` loop's condition runs on the carry of every pass, not the first alone: a
    GEMM's output carried into it only by the body (the carry starts as zeros) reaches the
    condition's arg-max, so that GEMM's owner feeds a choice (a router in a decoding loop)."""
    from fp8jax._src.convert.roles import dataflow

    def decode(w, x):
        def cond(carry):
            return (jnp.argmax(carry[1]) != 2) & (carry[0] < 5)

        def body(carry):
            return carry[0] + 1, x @ w + carry[1]

        return jax.lax.while_loop(cond, body, (0, jnp.zeros(4)))[1]

    w, x = jnp.ones((4, 4)), jnp.ones(4)
    flow = dataflow(jax.make_jaxpr(decode)(w, x), [("a",), None])
    assert flow.feeds_choice == {("a",)}
    assert flow.gemms == {("a",): 1}


def test_a_gemms_right_operand_is_told_as_its_weights_free_and_contracted_axes():
    """`gemm_rhs_layouts`: `x @ w` contracts the weight's axis 0 and keeps axis 1; `h @ w.T`
    the reverse (which a square `w` cannot tell by shape); a batched GEMM is left out."""
    from fp8jax._src.convert.roles import gemm_rhs_layouts

    def layouts(f, *args):
        found = gemm_rhs_layouts(jax.make_jaxpr(f)(*args), [("w",), None])
        return sorted(found.values())

    w = jnp.ones((4, 4))
    assert layouts(lambda w, x: x @ w, w, jnp.ones((2, 4))) == [((1,), (0,))]
    assert layouts(lambda w, x: x @ w.T, w, jnp.ones((2, 4))) == [((0,), (1,))]
    batched = lambda w, x: jnp.einsum("bk,bkn->bn", x, w)  # noqa: E731
    assert layouts(batched, jnp.ones((2, 4, 4)), jnp.ones((2, 4))) == []

"""Per-layer recipes in Fp8Config, and current scaling's global amax on a mesh."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax


class Block(eqx.Module):
    attn_out: eqx.nn.Linear
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear


def make_blocks(key, n=3):
    keys = jax.random.split(key, 3 * n)
    return [Block(*(eqx.nn.Linear(8, 8, key=k) for k in keys[3 * i : 3 * i + 3])) for i in range(n)]


def recipe_of(linear):
    return type(linear.dot_general.recipe)


def test_per_layer_recipes(getkey):
    blocks = make_blocks(getkey())
    config = fp8jax.Fp8Config(
        recipe="blockwise",
        recipes={"attn_out": "residual", r"2\..*": fp8jax.CurrentScaling()},
    )
    converted = fp8jax.fp8_linear_layers(blocks, config)
    # First matching pattern wins: attn_out of block 2 is residual, its MLP current.
    for i in range(3):
        assert recipe_of(converted[i].attn_out) is fp8jax.ResidualFP8
    assert recipe_of(converted[0].fc1) is fp8jax.BlockwiseScaling
    assert recipe_of(converted[2].fc1) is fp8jax.CurrentScaling
    assert recipe_of(converted[2].fc2) is fp8jax.CurrentScaling
    # and the mixed model trains
    x = jax.random.normal(getkey(), (4, 8))

    def loss(blocks):
        h = x
        for b in blocks:
            h = b.fc2(jax.nn.relu(b.fc1(b.attn_out(h))))
        return jnp.sum(h**2)

    grads = fp8jax.filter_grad(loss)(converted)
    assert np.isfinite(float(jnp.sum(grads[0].fc1.weight)))


def test_recipes_pattern_matching_nothing_is_an_error(getkey):
    with pytest.raises(ValueError, match=r"recipes pattern 'attn' matches no converted layer"):
        fp8jax.fp8_linear_layers(make_blocks(getkey()), fp8jax.Fp8Config(recipes={"attn": "mxfp8"}))
    with pytest.raises(ValueError, match="mapping"):
        fp8jax.Fp8Config(recipes=["residual"])
    with pytest.raises(ValueError, match="Unknown recipe 'fast'"):
        fp8jax.Fp8Config(recipes={"fc1": "fast"})


def test_recipes_pattern_matching_only_layers_kept_in_high_precision_is_an_error(getkey):
    """A recipes pattern whose every layer stays in high precision (set aside as not
    convertible, a complex weight; or excluded by name) is refused as one matching no layer
    is, naming the layers it matched and why each stays (the set-aside one was accepted
    silently)."""
    keys = jax.random.split(getkey(), 3)
    model = {
        "fc": eqx.nn.Linear(8, 8, key=keys[0]),
        "odd": eqx.nn.Linear(8, 8, key=keys[1], dtype=jnp.complex64),
        "head": eqx.nn.Linear(8, 8, key=keys[2]),
    }
    kept = fp8jax.conversion_plan(model).kept  # why each stays, the plan says
    assert set(kept) == {"odd", "head"}
    for pattern in ("odd", "head"):
        config = fp8jax.Fp8Config(recipes={pattern: "current"})
        says = (
            f"recipes pattern {pattern!r} matches no converted layer: only {pattern!r} "
            f"({kept[pattern]}), which stays in high precision. Converted layers: 'fc'."
        )
        for convert in (fp8jax.conversion_plan, fp8jax.fp8_linear_layers):
            with pytest.raises(ValueError, match=re.escape(says)):
                convert(model, config)


def mesh():
    assert jax.device_count() >= 8, "tests expect 8 CPU devices (see conftest.py)"
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def test_numpy_bools_configure_as_the_bools_they_hold():
    """`telemetry` and `grouped_native_kernel` as NumPy bools (read from an array, say): the
    config given the Python bools, equal, hashed and written alike, as recipes take them."""
    config = fp8jax.Fp8Config(telemetry=np.True_, grouped_native_kernel=np.False_)
    plain = fp8jax.Fp8Config(telemetry=True, grouped_native_kernel=False)
    assert config == plain and hash(config) == hash(plain) and repr(config) == repr(plain)


def test_current_scaling_amax_is_global_under_jit_with_sharded_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[60, 3] = 50.0  # on the last device's shard
    w = rng.standard_normal((16, 32)).astype(np.float32)
    dot = fp8jax.Fp8DotGeneral("current")
    dims = (((1,), (1,)), ((), ()))
    want = dot(x, w, dims)
    xs = jax.device_put(x, NamedSharding(mesh(), P("data")))
    got = jax.jit(lambda x, w: dot(x, w, dims))(xs, w)
    np.testing.assert_array_equal(got, want)


def test_current_scaling_pmax_inside_shard_map():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[60, 3] = 50.0
    recipe = fp8jax.CurrentScaling(axis_names=("data",))
    local = fp8jax.CurrentScaling()

    def quantize(recipe):
        def per_shard(x):
            q, state = recipe.quantize(x, recipe.init_state("input"), "input", -1)
            return q.dequantize(), state.amax_history[None]

        return jax.shard_map(
            per_shard, mesh=mesh(), in_specs=P("data"), out_specs=(P("data"), P("data"))
        )(x)

    real, amaxes = quantize(recipe)
    whole, _ = local.quantize(jnp.asarray(x), local.init_state("input"), "input", -1)
    np.testing.assert_array_equal(real, whole.dequantize())
    np.testing.assert_array_equal(amaxes, np.full((8, 1), 50.0))
    # Without axis names every shard scales by its own amax: different numbers.
    real_local, amaxes_local = quantize(local)
    assert len(set(np.asarray(amaxes_local).ravel().tolist())) == 8
    assert not np.array_equal(real_local, real)


@pytest.mark.parametrize("none", [{}, ()])
def test_no_per_layer_recipes_configure_as_none(none):
    """`recipes={}` (or the empty pairs a config holds) overrides no layer's recipe, as
    `recipes=None` does: the config equals, hashes and prints as the default one, and a Linen
    model converted with it converts again with the default silently (it held `()`, unequal
    to None, and was warned that the configs differ in recipes)."""
    config = fp8jax.Fp8Config(recipes=none)
    plain = fp8jax.Fp8Config()
    assert config == plain and hash(config) == hash(plain) and repr(config) == repr(plain)
    nn = pytest.importorskip("flax.linen", reason="needs flax (the linen extra)")
    model = fp8jax.fp8_linear_layers(nn.Dense(4), config)
    assert fp8jax.fp8_linear_layers(model, plain) is model  # no warning (an error here)


def test_targets_listed_in_any_order_configure_alike(getkey):
    """A list of `targets` is a set of names (a Linear matches when one of them names it): in
    another order or with a name twice it converts the same layers, and the configs equal,
    hash and print alike (a static argument of `jit` compiles once; a Linen model converted
    with one converts again with the other silently). They compared unequal."""
    config = fp8jax.Fp8Config(targets=["b", "a", "b"])
    other = fp8jax.Fp8Config(targets=("a", "b"))
    assert set(config.targets) == set(other.targets) == {"a", "b"}
    assert config == other and hash(config) == hash(other) and repr(config) == repr(other)
    model = {n: eqx.nn.Linear(4, 4, key=getkey()) for n in ("a", "b", "c")}
    assert fp8jax.conversion_plan(model, config).converted == ("a", "b")


@pytest.mark.parametrize("keep", [("router", "head"), ["head", "router", "head"]])
def test_roles_kept_in_any_order_configure_as_the_default(keep):
    """`keep` is a set of roles: given in another order or with a role twice it keeps the
    layers the default keeps, so the config equals, hashes and prints as the default one (a
    static argument of `jit` then compiles once; a Linen model converted with it converts
    again with the default silently)."""
    config = fp8jax.Fp8Config(keep=keep)
    plain = fp8jax.Fp8Config()
    assert set(config.keep) == set(plain.keep) == set(keep)  # the same roles kept
    assert config == plain and hash(config) == hash(plain) and repr(config) == repr(plain)
    assert fp8jax.Fp8Config(keep=("router",)).keep == ("router",)


def test_fp8_gemm_runs_in_an_eager_shard_map_as_in_a_jitted_one():
    """A `shard_map` whose body runs an FP8 GEMM, called eagerly (how one debugs it), alone or
    under a `vmap` in the body: JAX's eager `shard_map` refused the GEMM's custom_vjp
    ("custom_vjp symbolic_zeros support with shard_map is not implemented"); it now gives the
    jitted `shard_map`'s output bit for bit."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    dot = fp8jax.Fp8DotGeneral("delayed")
    dims = (((1,), (1,)), ((), ()))

    def sharded(body):
        return jax.shard_map(body, mesh=mesh(), in_specs=(P(), P("data"), P()), out_specs=P("data"))

    forward = sharded(lambda d, x, w: d(x, w, dims))
    mapped = sharded(lambda d, x, w: jax.vmap(lambda x: d(x, w, dims))(x[:, None])[:, 0])
    for f in (forward, mapped):
        np.testing.assert_array_equal(f(dot, x, w), jax.jit(f)(dot, x, w))


@pytest.mark.parametrize(
    "kwargs, converted",
    [
        (dict(targets="(root)"), ("(root)",)),
        (dict(targets=["(root)"]), ("(root)",)),
        (dict(exclude="(root)"), ()),
        (dict(recipes={"(root)": "current"}), ("(root)",)),
        (dict(targets="(root)|fc"), ("(root)",)),
        (dict(targets=r"\(root\)"), ("(root)",)),
        (dict(exclude="(root)|head"), ()),
        (dict(exclude=".*"), ()),
        (dict(recipes={"fc|(root)": "current"}), ("(root)",)),
    ],
    ids=[
        "targets-regex",
        "targets-list",
        "exclude",
        "recipes",
        "targets-alternatives",
        "targets-escaped",
        "exclude-alternatives",
        "exclude-everything",
        "recipes-alternatives",
    ],
)
def test_a_bare_linear_is_named_by_the_path_its_plan_prints(kwargs, converted):
    """A bare Linear's plan prints its path as `(root)`, which targets, exclude and recipes
    refused or ignored (targets: "matches no Linear layer. Linear layers: '(root)'"); each
    takes it, as the plan's other paths, alone or as a regex's alternative (`"(root)|head"`,
    which matched no root), and the plan's lists name it as it prints it (they held '')."""
    linear = eqx.nn.Linear(4, 4, key=jax.random.PRNGKey(0))
    assert "(root)" in str(fp8jax.conversion_plan(linear, fp8jax.Fp8Config()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8jax.Fp8ConversionWarning)  # nothing converted
        plan = fp8jax.conversion_plan(linear, fp8jax.Fp8Config(**kwargs))
    assert plan.converted == converted
    assert [c.path for c in plan.layers] == ["(root)"]
    assert list(plan.kept) == ([] if converted else ["(root)"])
    row = str(plan).splitlines()[-1]
    assert row.split()[0] == plan.layers[0].path, row  # the printed path is the plan's
    if "recipes" in kwargs:
        assert "CurrentScaling" in plan.layers[0].why


def test_a_dotted_dict_key_prints_as_a_nesting_and_is_selected_with_it():
    """Paths join names with ".", so a dict key holding one ({"a.b": ...}) prints as the
    nesting {"a": {"b": ...}} does: the documented behaviour, both selected by "a.b"."""
    key = jax.random.PRNGKey(0)
    model = {"a.b": eqx.nn.Linear(4, 4, key=key), "a": {"b": eqx.nn.Linear(4, 4, key=key)}}
    assert fp8jax.conversion_plan(model, fp8jax.Fp8Config(targets=["a.b"])).converted == (
        "a.b",
        "a.b",
    )
    assert 'holding a "."' in fp8jax.Fp8Config.__doc__


def test_targets_and_keep_given_as_sets_configure_as_lists(getkey):
    """`targets` and `keep` are held as sets (sorted; in `ROLES`' order), so a Python set or
    frozenset of them is what a list is: it was refused ("should be a list of layer names",
    "should be a tuple of roles"). It equals, hashes and prints as the list's config."""
    for given in ({"b", "a"}, frozenset({"a", "b"})):
        config, listed = fp8jax.Fp8Config(targets=given), fp8jax.Fp8Config(targets=["a", "b"])
        assert config == listed and hash(config) == hash(listed) and repr(config) == repr(listed)
    for given in ({"router", "head"}, frozenset({"head"}), set()):
        config, listed = fp8jax.Fp8Config(keep=given), fp8jax.Fp8Config(keep=list(given))
        assert config == listed and hash(config) == hash(listed) and repr(config) == repr(listed)
        assert set(config.keep) == set(given)
    model = {n: eqx.nn.Linear(4, 4, key=getkey()) for n in ("a", "b", "c")}
    assert fp8jax.conversion_plan(model, fp8jax.Fp8Config(targets={"a", "b"})).converted == (
        "a",
        "b",
    )
    with pytest.raises(ValueError, match=r"targets=\{1\}.*list of layer names \(or a set\)"):
        fp8jax.Fp8Config(targets={1})
    with pytest.raises(ValueError, match=r"keep=\{'tail'\}.*among \('head', 'router'\)"):
        fp8jax.Fp8Config(keep={"tail"})

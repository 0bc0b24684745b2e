"""Policy: parsing its string form, and casts that never touch FP8 state."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bf16_linear

import fp8jax
from fp8jax._src.train.policy import Policy

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


@pytest.mark.parametrize(
    "key, field",
    [(k, "param_dtype") for k in ("params", "param", "p", "PARAMS", " p ")]
    + [(k, "compute_dtype") for k in ("compute", "c", "Compute")]
    + [(k, "output_dtype") for k in ("output", "o")],
)
def test_key_aliases(key, field):
    policy = Policy.from_string(f"{key}=bf16")
    assert getattr(policy, field) == BF16


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", F32),
        ("f32", F32),
        ("full", F32),
        ("bfloat16", BF16),
        ("bf16", BF16),
        ("BF16", BF16),
        ("float16", F16),
        ("f16", F16),
        ("half", F16),
        (" float16 ", F16),
        ("float64", np.dtype(np.float64)),
    ],
)
def test_dtype_aliases(name, dtype):
    policy = Policy.from_string(f"params=f32,compute={name}")
    assert policy.compute_dtype == dtype
    assert isinstance(policy.compute_dtype, np.dtype)


@pytest.mark.parametrize("name", ["Float64", "FLOAT64", "Float32", "BFloat16", " FLOAT16 "])
def test_dtype_names_ignore_letter_case(name):
    """The docstring's promise: letter case is ignored in dtypes too, not only in aliases."""
    policy = Policy.from_string(f"compute={name}")
    assert policy.compute_dtype == np.dtype(jnp.dtype(name.strip().lower()))


def test_defaults():
    assert Policy() == Policy(param_dtype=F32, compute_dtype=F32, output_dtype=F32)
    # compute and output default to the param dtype; the param dtype to float32.
    assert Policy.from_string("params=bf16") == Policy(
        param_dtype=BF16, compute_dtype=BF16, output_dtype=BF16
    )
    assert Policy.from_string("compute=f16") == Policy(compute_dtype=F16)
    assert Policy.from_string("p=f16,o=f32") == Policy(
        param_dtype=F16, compute_dtype=F16, output_dtype=F32
    )
    assert Policy.from_string("  params = float32 ,  compute=  bfloat16 , output=f32 ") == Policy(
        compute_dtype=BF16
    )


def test_constructor_takes_dtype_likes_and_stores_np_dtypes():
    policy = Policy(param_dtype="f32", compute_dtype=jnp.bfloat16, output_dtype=np.float16)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, BF16, F16)
    assert all(isinstance(d, np.dtype) for d in vars(policy).values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = BF16  # frozen
    assert hash(policy) == hash(Policy(compute_dtype="bf16", output_dtype="half"))


@pytest.mark.parametrize(
    "policy",
    [
        Policy(),
        Policy(compute_dtype=BF16),
        Policy(param_dtype=BF16, compute_dtype=F16, output_dtype=F32),
        Policy(output_dtype=np.dtype(np.float64)),
    ],
)
def test_str_round_trips(policy):
    assert Policy.from_string(str(policy)) == policy


def test_str_form():
    policy = Policy.from_string("c=bf16")
    assert str(policy) == "params=float32,compute=bfloat16,output=float32"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "empty spec"),
        ("   ", "empty spec"),
        ("params", "'params' in 'params' is not a key=dtype pair"),
        ("params=", "'params=' in 'params=' is not a key=dtype pair"),
        ("=bf16", "'=bf16' in '=bf16' is not a key=dtype pair"),
        ("p=f32,,c=bf16", "'' in 'p=f32,,c=bf16' is not a key=dtype pair"),
        ("p=f32,", "'' in 'p=f32,' is not a key=dtype pair"),
        ("p=f32=bf16", "'p=f32=bf16' .* is not a key=dtype pair"),
        ("weights=f32", r"unknown key 'weights' .*accepted keys: params \(param, p\)"),
        ("p=f32,params=bf16", "'p=f32' and 'params=bf16' .* both set the params dtype"),
        ("c=f32,compute=f32", "both set the compute dtype"),
        ("o=bf16,output=bf16", "both set the output dtype"),
        ("c=int32", r"c='int32' is int32, not a floating-point dtype; use float32 \(f32"),
        ("c=bool", "not a floating-point dtype"),
        ("c=complex64", "not a floating-point dtype"),
        ("c=float31", r"c='float31' is not a dtype; use float32 \(f32, full\), bfloat16"),
        # FP8 is what the GEMMs quantize to, not a dtype around them (it failed in the GEMM).
        ("c=float8_e4m3fn", r"c=float8_e4m3fn: an 8-bit \(or narrower\) float is what"),
        ("o=float8_e5m2", "o=float8_e5m2: an 8-bit"),
        # NumPy's code for float64, which an FP8 library's user means as FP8 (it ran float32).
        ("p=f32,c=f8", r"c='f8' is ambiguous: NumPy reads 'f8' as float64"),
        ("c=FP8", "c='FP8' is ambiguous"),
    ],
)
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        Policy.from_string(spec)


@pytest.mark.parametrize("spec", ["bf16", "f16", " f32 ", "float32", "bfloat16"])
def test_a_bare_dtype_is_refused_with_the_policies_it_may_mean(spec):
    """jmp reads a bare dtype ("bf16") as all three dtypes; fp8jax refused it as a piece that
    is not a key=dtype pair, leaving the user to guess. The error now names both readings, and
    the first one spelled out is jmp's policy."""
    jmp = pytest.importorskip("jmp")
    with pytest.raises(ValueError, match="is a dtype") as info:
        Policy.from_string(spec)
    name = spec.strip()
    message = str(info.value)
    assert repr(spec) in message
    assert f"'params={name}'" in message and f"'compute={name}'" in message
    theirs = jmp.get_policy(name)
    ours = Policy.from_string(f"params={name}")
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    )
    mixed = Policy.from_string(f"compute={name}")
    assert (mixed.param_dtype, mixed.output_dtype) == (F32, F32)
    assert mixed.compute_dtype == ours.compute_dtype


def test_constructor_errors():
    with pytest.raises(ValueError, match="Policy param_dtype=int8, not a floating-point dtype"):
        Policy(param_dtype=jnp.int8)
    with pytest.raises(ValueError, match="Policy compute_dtype='nope' is not a dtype"):
        Policy(compute_dtype="nope")
    with pytest.raises(ValueError, match="Policy output_dtype=None"):
        Policy(output_dtype=None)
    with pytest.raises(TypeError, match="should be a string"):
        Policy.from_string(jnp.bfloat16)


@pytest.mark.skipif(
    np.dtype(np.longdouble).itemsize <= 8, reason="NumPy's longdouble is float64 here"
)
def test_a_float_dtype_jax_has_no_arrays_of_is_refused():
    """NumPy's longdouble (float128) is a floating dtype of more than 16 bits, but JAX has no
    arrays of it: refused by name, where it was taken and the first cast raised JAX's error."""
    for spelling in ("longdouble", np.longdouble, np.dtype(np.longdouble).name):
        with pytest.raises(ValueError, match=r"Policy compute_dtype=.*: JAX has no arrays of"):
            Policy(compute_dtype=spelling)
    with pytest.raises(ValueError, match=r"c='longdouble' is .*: JAX has no arrays of"):
        Policy.from_string("c=longdouble")


def _model():
    """An MLP with FP8 layers, plus an int array, a Python float and a numpy float array."""
    mlp = fp8jax.fp8_linear_layers(
        eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)), fp8jax.Fp8Config()
    )
    return {
        "mlp": mlp,
        "step": jnp.arange(3, dtype=jnp.int32),
        "mask": np.array([True, False]),
        "temperature": 0.5,
        "table": np.linspace(0, 1, 5, dtype=np.float32),
        "nothing": None,
    }


def _fp8_states(tree):
    is_fp8 = lambda x: isinstance(x, fp8jax.Fp8DotGeneral)  # noqa: E731
    return [x for x in jax.tree.leaves(tree, is_leaf=is_fp8) if is_fp8(x)]


def _check_cast(before, after, dtype, masters=False):
    # FP8 state: same modules, float32, bit-identical.
    states_before, states_after = _fp8_states(before), _fp8_states(after)
    assert len(states_before) == len(states_after) == 2
    for old, new in zip(states_before, states_after, strict=True):
        assert jax.tree.structure(old) == jax.tree.structure(new)
        for o, n in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
            assert n.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(n), np.asarray(o))
    # Parameters: cast to `dtype`, values rounded from the originals; with `masters` (the
    # cast to compute of float32 weights) the FP8 layers' weights left as they are, for their
    # GEMMs to quantize, and the layers told to compute in `dtype`.
    for layer_before, layer_after in zip(before["mlp"].layers, after["mlp"].layers, strict=True):
        for name in ("weight", "bias"):
            old, new = getattr(layer_before, name), getattr(layer_after, name)
            kept = masters and name == "weight"
            assert new.dtype == (old.dtype if kept else dtype)
            np.testing.assert_array_equal(
                np.asarray(new), np.asarray(old if kept else old.astype(dtype))
            )
        assert layer_after.compute_dtype == (dtype if masters else None)
    assert after["table"].dtype == dtype
    # Integer, boolean, Python float and None leaves: untouched.
    assert after["step"].dtype == jnp.int32
    np.testing.assert_array_equal(after["step"], before["step"])
    assert after["mask"].dtype == np.bool_
    assert after["temperature"] == 0.5 and type(after["temperature"]) is float
    assert after["nothing"] is None


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_casts_skip_fp8_state(method):
    policy = Policy(param_dtype=F16, compute_dtype=BF16, output_dtype=F16)
    dtype = {"cast_to_param": F16, "cast_to_compute": BF16, "cast_to_output": F16}[method]
    model = _model()
    cast = getattr(policy, method)
    masters = method == "cast_to_compute"  # float32 weights, wider than bfloat16
    _check_cast(model, cast(model), dtype, masters)

    # Under jax.jit (only arrays cross the boundary; the rest is closed over).
    params, static = eqx.partition(model, eqx.is_array)
    jitted = jax.jit(lambda p: eqx.partition(cast(eqx.combine(p, static)), eqx.is_array)[0])
    _, static_after = eqx.partition(cast(model), eqx.is_array)
    _check_cast(model, eqx.combine(jitted(params), static_after), dtype, masters)


def test_cast_round_trip_to_param_dtype_and_numpy_stays_numpy():
    policy = Policy.from_string("p=f32,c=bf16")
    model = _model()
    compute = policy.cast_to_compute(model)
    assert isinstance(compute["table"], np.ndarray)
    back = policy.cast_to_param(compute)
    _check_cast(compute, back, F32)  # FP8 state bit-identical through both casts
    for layer, layer_back in zip(model["mlp"].layers, back["mlp"].layers, strict=True):
        # The FP8 layers' masters were never cast: the same values.
        np.testing.assert_array_equal(np.asarray(layer_back.weight), np.asarray(layer.weight))
        rounded = layer.bias.astype(BF16).astype(F32)
        np.testing.assert_array_equal(np.asarray(layer_back.bias), np.asarray(rounded))
    for old, new in zip(_fp8_states(model), _fp8_states(back), strict=True):
        assert eqx.tree_equal(old, new)


def test_cast_of_bare_arrays_and_scalars():
    policy = Policy(compute_dtype=BF16)
    assert policy.cast_to_compute(jnp.ones(3)).dtype == BF16
    assert policy.cast_to_compute(jnp.ones(3, jnp.int8)).dtype == jnp.int8
    assert policy.cast_to_compute(jnp.ones(3, jnp.complex64)).dtype == jnp.complex64
    assert policy.cast_to_compute(1.0) == 1.0
    assert policy.cast_to_compute(None) is None
    layer = fp8jax.Fp8DotGeneral()
    assert policy.cast_to_compute(layer) is layer


def test_fp8_forward_in_compute_dtype():
    """A model cast to bfloat16 runs its FP8 layers in bfloat16 and keeps float32 state: each
    layer's output is the float64 product of its E4M3-rounded operands, within the BF16
    roundings of the GEMM and of the bias add."""
    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    model = _model()["mlp"]
    x = jax.random.normal(jax.random.key(1), (3, 4))

    @eqx.filter_jit
    def forward(model, x):
        model, x = policy.cast_to_compute(model), policy.cast_to_compute(x)
        y = jax.vmap(model)(x)
        assert y.dtype == BF16
        return x, jax.vmap(model.layers[0])(x), y, policy.cast_to_output(y)

    x_bf16, hidden, y, out = forward(model, x)
    assert hidden.dtype == y.dtype == BF16
    assert out.dtype == F32 and out.shape == (3, 2)
    compute = policy.cast_to_compute(model)
    assert compute.activation is jax.nn.relu  # exact in bfloat16
    inputs = (x_bf16, jax.nn.relu(hidden))
    for layer, layer_in, layer_out in zip(compute.layers, inputs, (hidden, y), strict=True):
        state = layer.dot_general
        assert state.input.scale.dtype == F32 and state.kernel.scale.dtype == F32
        # Empty histories (stored scales 0: no amax yet): a fresh delayed-scaling layer
        # scales each operand by its own amax, the warm start.
        assert not np.any(state.input.amax_history) and not np.any(state.kernel.amax_history)
        assert float(state.input.scale) == float(state.kernel.scale) == 0.0
        sx, sw = (
            float(
                fp8jax.compute_scale(jnp.max(jnp.abs(t.astype(F32))), 1.0, 448.0, power_of_two=True)
            )
            for t in (layer_in, layer.weight)
        )
        assert_bf16_linear(layer_out, layer_in, layer.weight, layer.bias, sx, sw)
    # XLA may skip the BF16 rounding before the cast to float32 (excess precision): `out` is
    # within the same bound, not necessarily equal to `y`.
    assert_bf16_linear(out, inputs[1], compute.layers[1].weight, compute.layers[1].bias, sx, sw)


def test_a_cast_nnx_model_shares_no_fp8_state_with_the_original():
    """`policy.cast_to_param(model)` of an NNX model gave new Params but the original's own
    `Fp8State` variables: training the cast copy moved the original's FP8 state too (its
    Params stayed). Each cast now holds new variables, as `jax.tree.map` (jmp's cast) gives
    for every variable: the original's FP8 state stays bit for bit as it was."""
    nnx = pytest.importorskip("flax.nnx", reason="needs flax (the nnx extra)")
    optax = pytest.importorskip("optax")
    model = fp8jax.fp8_linear_layers(
        nnx.Linear(8, 4, rngs=nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None, keep=())
    )
    before = [np.array(a) for a in jax.tree.leaves(nnx.state(model, fp8jax.Fp8State))]
    policy = Policy.from_string("params=bfloat16")
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        cast = getattr(policy, method)(model)
        optimizer = nnx.Optimizer(cast, optax.sgd(0.1), wrt=nnx.Param)
        loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        fp8jax.nnx_train_step(loss)(cast, optimizer, jnp.full((2, 8), 3.0, BF16))
        moved = jax.tree.leaves(nnx.state(cast, fp8jax.Fp8State))
        assert any(not np.array_equal(a, b) for a, b in zip(moved, before, strict=True))
        after = jax.tree.leaves(nnx.state(model, fp8jax.Fp8State))
        for a, b in zip(after, before, strict=True):
            np.testing.assert_array_equal(a, b)
    # A loss that casts the model (a layer used twice: its uses combine by max through the
    # new variables) trains as the same loss without the cast, bit for bit.
    trained = []
    for cast in (Policy().cast_to_compute, lambda m: m):
        net = fp8jax.fp8_linear_layers(
            nnx.Linear(8, 8, rngs=nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None, keep=())
        )
        twice = lambda m, x, c=cast: jnp.sum(c(m)(c(m)(x)) ** 2)  # noqa: E731
        optimizer = nnx.Optimizer(net, optax.adam(0.01), wrt=nnx.Param)
        for i in range(3):
            fp8jax.nnx_train_step(twice)(
                net, optimizer, jax.random.normal(jax.random.key(i), (4, 8))
            )
        trained.append(jax.tree.leaves(nnx.state(net)))
    for a, b in zip(*trained, strict=True):
        np.testing.assert_array_equal(a, b)


def test_casts_of_an_nnx_state_skip_its_fp8_state():
    """An NNX model's state (`nnx.split`, `nnx.state`) holds its FP8 state as `Fp8State`
    variables, not FP8 modules: each cast leaves them float32 and bit-identical (they were
    cast, and the merged model refused to run), and the merged model computes what the
    documented cast of the `nnx.Param`s alone gives."""
    nnx = pytest.importorskip("flax.nnx", reason="needs flax (the nnx extra)")
    model = fp8jax.fp8_linear_layers(
        nnx.Linear(4, 8, rngs=nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None, keep=())
    )
    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    graphdef, state = nnx.split(model)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        dtype = F32 if method != "cast_to_compute" else BF16
        cast = getattr(policy, method)(state)
        olds, news = (jax.tree.leaves(t, is_leaf=is_var) for t in (state, cast))
        for old, new in zip(olds, news, strict=True):
            assert type(new) is type(old)
            if isinstance(old, fp8jax.Fp8State):
                assert new.get_value().dtype == old.get_value().dtype == F32
                np.testing.assert_array_equal(new.get_value(), old.get_value())
            else:
                assert new.get_value().dtype == dtype
                np.testing.assert_array_equal(new.get_value(), old.get_value().astype(dtype))
    x = jax.random.normal(jax.random.key(1), (3, 4), BF16)
    got = nnx.merge(graphdef, policy.cast_to_compute(state))(x)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    want = nnx.merge(graphdef, policy.cast_to_compute(params), rest)(x)
    assert got.dtype == want.dtype == BF16
    np.testing.assert_array_equal(got, want)

"""`fp8jax.fp8_autocast`: FP8 for any JAX function. A plain-JAX transformer (scan over layers,
remat, einsum attention) against the same model written with fp8jax's FP8 op by hand, the
interpreter's control flow kept exact, the selection, ragged_dot, errors, the H100 compile."""

import dataclasses
import functools
import pathlib
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import h100_topology, ref_qdq, representable
from jax.sharding import PartitionSpec as P

import fp8jax

VOCAB, WIDTH, HEADS, LAYERS = 64, 32, 2, 2


def init(key):
    keys = jax.random.split(key, 6)
    normal = lambda k, *shape: jax.random.normal(k, shape) / np.sqrt(shape[-2])  # noqa: E731
    return {
        "embed": jax.random.normal(keys[0], (VOCAB, WIDTH)),
        "layers": {
            "qkv": normal(keys[1], LAYERS, WIDTH, 3 * WIDTH),
            "out": normal(keys[2], LAYERS, WIDTH, WIDTH),
            "up": normal(keys[3], LAYERS, WIDTH, 4 * WIDTH),
            "down": normal(keys[4], LAYERS, 4 * WIDTH, WIDTH),
        },
        "head": normal(keys[5], WIDTH, VOCAB),
    }


def norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def transformer(params, tokens, dot=jnp.matmul):
    """A GPT in plain JAX: `dot(x, w)` for every weight, einsums for attention."""
    b, t = tokens.shape
    x = params["embed"][tokens]

    def block(x, p):
        with jax.named_scope("attn"):
            q, k, v = jnp.split(dot(norm(x), p["qkv"]), 3, axis=-1)
            q, k, v = (a.reshape(b, t, HEADS, WIDTH // HEADS) for a in (q, k, v))
            scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(WIDTH // HEADS)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
            mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v)
            x = x + dot(mixed.reshape(b, t, WIDTH), p["out"])
        with jax.named_scope("mlp"):
            x = x + dot(jax.nn.gelu(dot(norm(x), p["up"])), p["down"])
        return x, None

    x, _ = jax.lax.scan(jax.checkpoint(block), x, params["layers"])
    with jax.named_scope("head"):
        return dot(norm(x), params["head"])


def loss_fn(params, tokens, dot=jnp.matmul):
    logits = transformer(params, tokens[:, :-1], dot)
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def fp8_dot(recipe):
    """The module path: fp8jax's FP8 op, called by hand where the model multiplies."""

    def dot(x, w):
        return fp8jax.Fp8DotGeneral(recipe)(x, w, (((x.ndim - 1,), (0,)), ((), ())))

    return dot


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 17)), jnp.int32)


@pytest.mark.parametrize("recipe", ["current", "blockwise", "mxfp8"])
def test_a_plain_jax_transformer_matches_the_module_path(recipe):
    params = init(jax.random.key(0))
    ours = jax.jit(jax.value_and_grad(fp8jax.fp8_autocast(loss_fn, recipe, exclude="head.*")))
    recipe_ = fp8jax.Fp8Config(recipe=recipe).recipe
    if recipe == "blockwise":
        recipe_ = fp8jax.BlockwiseScaling()

    def by_hand(params, tokens):
        def dot(x, w):
            if w.shape == params["head"].shape:  # the head stays high precision
                return x @ w
            return fp8_dot(recipe_)(x, w)

        return loss_fn(params, tokens, dot)

    theirs = jax.jit(jax.value_and_grad(by_hand))
    (loss, grads), (loss_e, grads_e) = ours(params, TOKENS), theirs(params, TOKENS)
    np.testing.assert_array_equal(loss, loss_e)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_e), strict=True):
        np.testing.assert_array_equal(a, b)
    # And FP8 it is: the float32 model's loss differs.
    assert float(loss) != float(jax.jit(loss_fn)(params, TOKENS))


def count_fp8_dots(fun, *args):
    """How many `dot_general`s of `fun` (at any depth) take FP8 operands, and how many not;
    of a `lax.platform_dependent` choice, those of the branch that runs on GPUs."""
    closed = jax.make_jaxpr(fun)(*args)
    fp8 = other = 0

    def walk(jaxpr):
        nonlocal fp8, other
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                if "float8" in str(eqn.invars[0].aval.dtype):
                    fp8 += 1
                else:
                    other += 1
            platforms = eqn.params.get("branches_platforms")
            if eqn.primitive.name == "cond" and platforms:
                walk(eqn.params["branches"][platforms.index(None)].jaxpr)
                continue
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return fp8, other


def test_the_selection_by_scope_batch_and_size():
    params = init(jax.random.key(0))
    forward = lambda p, t: transformer(p, t[:, :-1])  # noqa: E731
    # By default: the four layer GEMMs of the scanned block and the head; not the two
    # attention einsums (batched).
    assert count_fp8_dots(fp8jax.fp8_autocast(forward), params, TOKENS) == (5, 2)
    assert count_fp8_dots(fp8jax.fp8_autocast(forward, exclude="head.*"), params, TOKENS) == (4, 3)
    assert count_fp8_dots(fp8jax.fp8_autocast(forward, scopes="mlp.*"), params, TOKENS) == (2, 5)
    assert count_fp8_dots(fp8jax.fp8_autocast(forward, batched=True), params, TOKENS) == (7, 0)
    # Attention's two GEMMs are 16 x 16 x 16 per head here (16 tokens, head dim 16): min_dim=17
    # leaves them out, the layers' GEMMs (64 rows) stay in.
    picked = fp8jax.fp8_autocast(forward, batched=True, min_dim=17)
    assert count_fp8_dots(picked, params, TOKENS) == (5, 2)
    # Under differentiation the backward GEMMs are FP8 too: 3 per converted GEMM (the
    # scanned block's forward is recomputed under remat).
    fp8, other = count_fp8_dots(jax.grad(fp8jax.fp8_autocast(loss_fn)), params, TOKENS)
    assert fp8 >= 3 * 5 and other > 0


def test_scopes_matching_no_gemm_are_said():
    """A `scopes` regex that matches no GEMM (a name the model does not use, a scope written
    without its parents') converts nothing: a warning names the scopes there are (this
    model's GEMMs: 'attn', 'mlp', 'head'); one that matches says nothing."""
    params = init(jax.random.key(0))
    forward = lambda p, t: transformer(p, t[:, :-1])  # noqa: E731
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"scopes='ffn' matched none") as got:
        assert count_fp8_dots(fp8jax.fp8_autocast(forward, scopes="ffn"), params, TOKENS)[0] == 0
    assert "('attn', 'head', 'mlp')" in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8jax.fp8_autocast(forward, scopes=".*mlp.*")(params, TOKENS)
        fp8jax.fp8_autocast(forward)(params, TOKENS)


def test_scopes_and_exclude_match_a_whole_scope_not_a_prefix_or_a_part():
    """As documented: `scopes` and `exclude` must match a GEMM's scopes whole, so
    `scopes="mlp"` leaves `mlp_out` and `exclude="head"` misses `lm/head` (said)."""
    x, w = jnp.ones((32, 32)), jnp.ones((32, 32)) / 32

    def fun(x, w):
        with jax.named_scope("mlp"):
            x = x @ w
        with jax.named_scope("mlp_out"):
            x = x @ w
        with jax.named_scope("lm"), jax.named_scope("head"):
            return x @ w

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count_fp8_dots(fp8jax.fp8_autocast(fun, scopes="mlp"), x, w) == (1, 2)
        assert count_fp8_dots(fp8jax.fp8_autocast(fun, exclude=".*head"), x, w) == (2, 1)
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"exclude='head' matched none"):
        assert count_fp8_dots(fp8jax.fp8_autocast(fun, exclude="head"), x, w) == (3, 0)


def test_gemms_are_named_by_scope_and_program_order_afresh_at_each_call():
    """As documented: a scope's GEMMs after its first are numbered (`mlp`, `mlp_1`,
    `mlp_2`), those outside any scope `dot_general`, `dot_general_1`; a second call of
    the same autocast function names them the same, not on from the first call's."""

    def fun(x, w):
        with jax.named_scope("mlp"):
            x = x @ w @ w @ w
        return x @ w @ w

    autocast, x = fp8jax.fp8_autocast(fun), jnp.ones((32, 32))
    expected = ["dot_general", "dot_general_1", "mlp", "mlp_1", "mlp_2"]
    for _ in range(2):  # a new function each time: make_jaxpr caches a function's trace
        eqns = jax.make_jaxpr(lambda x, w: autocast(x, w))(x, x).jaxpr.eqns
        stacks = " ".join(str(e.source_info.name_stack) for e in eqns)
        assert sorted(set(re.findall(r"fp8jax\[([^\]]*)\]", stacks))) == expected


def test_a_scope_inside_a_nested_jit_is_joined_to_the_scopes_around_it():
    """A GEMM's scopes are joined outermost first, across a nested `jit` and a `scan`:
    `block/mlp`, as `scopes` is documented to match them."""
    x, w = jnp.ones((32, 32)), jnp.ones((32, 32)) / 32

    def inner(x):
        with jax.named_scope("mlp"):
            return x @ w

    def fun(x, w):
        with jax.named_scope("block"):
            x = jax.jit(inner)(x)
            return jax.lax.scan(lambda c, _: (inner(c), None), x, length=2)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count_fp8_dots(fp8jax.fp8_autocast(fun, scopes="block/mlp"), x, w) == (2, 0)


def test_min_dim_reads_rows_columns_and_contraction_as_documented():
    """A GEMM's contraction is the product of all its contracted axes (2 x 8 = 16 here);
    its rows and columns are its free axes' products, batch axes not among them."""
    x, w = jnp.ones((32, 2, 8)), jnp.ones((2, 8, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        contract_two = lambda x, w: jnp.einsum("bij,ijk->bk", x, w)  # noqa: E731
        assert count_fp8_dots(fp8jax.fp8_autocast(contract_two), x, w) == (1, 0)
    four_rows = jnp.ones((64, 4, 32)), jnp.ones((64, 32, 32))  # 64 GEMMs of 4 rows
    four_columns = jnp.ones((64, 32, 32)), jnp.ones((64, 32, 4))
    for a, b in (four_rows, four_columns):
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"1 with rows.*min_dim=16"):
            got = count_fp8_dots(
                fp8jax.fp8_autocast(lambda a, b: a @ b, batched=True, min_dim=16), a, b
            )
        assert got == (0, 1)


def test_scopes_matching_only_gemms_left_for_their_shape_blame_the_shape():
    """A `scopes` regex that matches GEMMs left out for their shape (attention's batched
    einsums with `batched=False`, GEMMs under `min_dim`) was said to match none of the
    GEMMs' scopes, listing the others and blaming how the regex was written: the warning
    must name the shape, and the regex, right all along, converts them once allowed."""
    x, w = jnp.ones((8, 32, 64)), jnp.ones((64, 64))

    def fun(x, w):
        with jax.named_scope("attn"):
            scores = jnp.einsum("bij,bkj->bik", x, x)
        with jax.named_scope("mlp"):
            return jnp.einsum("bik,bkd->bid", scores, x) @ w

    for kwargs, why in (
        ({}, r"2 with batch dimensions"),
        ({"batched": True, "min_dim": 33}, r"min_dim=33"),
    ):
        with pytest.warns(fp8jax.Fp8ConversionWarning) as got:
            fp8jax.fp8_autocast(fun, scopes=".*attn.*", **kwargs)(x, w)
        messages = [str(g.message) for g in got]
        assert not any("matched none" in m for m in messages), messages
        assert any(re.search(why, m) for m in messages), messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        picked = fp8jax.fp8_autocast(fun, scopes=".*attn.*", batched=True)
        assert count_fp8_dots(picked, x, w) == (1, 2)


def test_a_result_with_values_other_than_arrays_is_returned_whole():
    """Non-array arguments are static (an Equinox module's activation, a flag); a result
    holding such values (the module, a tag) crashed the trace ("not a valid JAX type", in
    autocast's own function) where the plain function returns them: they come back as
    returned, the arrays beside them computed in FP8."""
    mlp = eqx.nn.MLP(64, 64, 64, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 64))

    def fun(model, x, dot=jnp.matmul):
        return {"model": model, "tag": "fp8", "y": dot(x, model.layers[0].weight.T), "n": 3}

    out = fp8jax.fp8_autocast(fun)(mlp, x)
    want = fun(mlp, x, fp8_dot(fp8jax.CurrentScaling()))
    assert bool(eqx.tree_equal(out["model"], mlp)) and out["tag"] == "fp8"
    assert jax.tree.structure(out) == jax.tree.structure(want)
    np.testing.assert_array_equal(out["y"], want["y"])
    np.testing.assert_array_equal(out["n"], 3)
    assert not np.array_equal(out["y"], fun(mlp, x)["y"])  # FP8, not float32


def _assert_results_as_under_jit(fun, *args):
    """Every result of `fp8_autocast(fun)` but the first (the GEMM's) is the `jax.Array` that
    `jax.jit(fun)` returns: its type, dtype, weak type and values."""
    got = fp8jax.fp8_autocast(fun)(*args)
    want = jax.jit(fun)(*args)
    for g, v in zip(got[1:], want[1:], strict=True):
        assert isinstance(g, jax.Array), type(g)
        assert jax.typeof(g) == jax.typeof(v)
        np.testing.assert_array_equal(g, v)


def test_constant_results_are_arrays_as_under_jit():
    """A result leaf the function computes from no argument (a number, `jnp.zeros(())`: a
    literal of the jaxpr) came back as a JAX-internal value (`TypedFloat`, `TypedNdArray`,
    a Python `bool`) where every other leaf is a `jax.Array`; each is now the array
    `jax.jit` of the function returns, of the same dtype and weak type."""
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))

    def fun(x, w):
        return x @ w, 1.5, 3, True, jnp.float32(2.0), jnp.zeros(()), 2 + 1j

    _assert_results_as_under_jit(fun, x, w)


def test_constant_array_results_and_numpy_arguments_returned_are_arrays_as_under_jit():
    """A result leaf that is a NumPy array the function builds (a constant of the jaxpr, not
    a literal) came back as JAX's internal `TypedNdArray`, and a NumPy argument returned as
    it is as that `np.ndarray`; under `jax.jit` both are `jax.Array`s, as here now."""
    x, mask = jnp.ones((16, 16)), np.tril(np.ones((16, 16), np.float32))

    def fun(x, mask):
        return x @ (x * mask), np.arange(4.0).reshape(2, 2), mask

    _assert_results_as_under_jit(fun, x, mask)


def control_flow(w, x, loop, dot=jnp.matmul):
    """Every primitive the interpreter rebuilds, each around a GEMM. `loop` (a static Python
    argument) adds a while loop, which reverse-mode differentiation does not take."""
    y = jax.jit(lambda x: dot(x, w))(x)
    y = jax.lax.scan(lambda c, wi: (dot(c, wi), c.sum()), y, jnp.stack([w, w * 0.5]))[0]
    if loop:
        y = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (dot(c[0], w), c[1] + 1), (y, 0))[0]
    y = jax.lax.cond(y.sum() > 0, lambda y: dot(y, w), lambda y: -dot(y, w), y)
    y = jax.checkpoint(lambda y: jnp.tanh(dot(y, w)))(y)
    return dot(jax.nn.relu(y), w)  # relu is a custom_jvp: around a GEMM, not inside it


def test_control_flow_matches_the_module_path():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    ours = fp8jax.fp8_autocast(control_flow, "current")
    dot = fp8_dot(fp8jax.CurrentScaling())
    np.testing.assert_array_equal(ours(w, x, True), control_flow(w, x, True, dot))
    grad = jax.grad(lambda w, x: jnp.sum(ours(w, x, False) ** 2), (0, 1))
    grad_e = jax.grad(lambda w, x: jnp.sum(control_flow(w, x, False, dot) ** 2), (0, 1))
    for a, b in zip(jax.jit(grad)(w, x), jax.jit(grad_e)(w, x), strict=True):
        np.testing.assert_array_equal(a, b)
    assert count_fp8_dots(lambda w, x: ours(w, x, True), w, x) == (7, 0)
    assert count_fp8_dots(lambda w, x: control_flow(w, x, True), w, x) == (0, 7)


def test_rebuilt_primitives_keep_their_parameters():
    """The interpreter rebuilds a scan, a checkpoint and a GEMM around FP8 GEMMs: a reversed,
    unrolled scan stays so (its outputs in reverse step order), a checkpoint keeps its policy
    and `prevent_cse`, a GEMM its `preferred_element_type` (bfloat16 in, float32 out)."""
    policy = jax.checkpoint_policies.dots_saveable
    dims = (((1,), (0,)), ((), ()))

    def fun(xs, w):
        def step(c, x):
            return c + 1.0, c * jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
        return jax.lax.scan(step, 1.0, xs, reverse=True, unroll=2)[1]

    xs, w = jnp.ones((4, 32, 32), jnp.bfloat16), jnp.ones((32, 32), jnp.bfloat16) / 32
    got = fp8jax.fp8_autocast(fun)(xs, w)  # ones and 1/32: exact in FP8
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got[:, 0, 0], [4.0, 3.0, 2.0, 1.0])  # the last step first
    params = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            params.setdefault(eqn.primitive.name, eqn.params)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fp8jax.fp8_autocast(fun))(xs, w).jaxpr)
    assert (params["scan"]["reverse"], params["scan"]["unroll"]) == (True, 2)
    remat = params["remat2"]  # jax.checkpoint's primitive
    assert remat["policy"] is policy and remat["prevent_cse"] is False
    assert count_fp8_dots(fp8jax.fp8_autocast(fun), xs, w) == (1, 0)


def test_a_platform_dependent_choice_compiles_only_its_platforms_branch():
    """`lax.platform_dependent` lowers a branch only for its platforms: a CUDA-only kernel
    (a Pallas call, here with a GEMM inside) is never lowered for a CPU. Rebuilt around its
    FP8 GEMMs, the choice must stay one, and run the default branch here as JAX would."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    def cuda_only(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, w)

    def f(x, w, dot=jnp.matmul):
        y = jax.lax.platform_dependent(x, w, cuda=cuda_only, default=dot)
        return dot(y, w)

    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    dot = fp8_dot(fp8jax.CurrentScaling())
    got = jax.jit(fp8jax.fp8_autocast(f, "current"))(x, w)
    np.testing.assert_array_equal(got, jax.jit(lambda x, w: dot(dot(x, w), w))(x, w))


def test_ragged_dot_becomes_the_grouped_fp8_gemm():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)
    sizes = jnp.array([8, 0, 16, 8], jnp.int32)
    fun = lambda x, w: jax.lax.ragged_dot(x, w, sizes)  # noqa: E731
    ours = jax.jit(
        jax.value_and_grad(lambda x, w: jnp.sum(fp8jax.fp8_autocast(fun)(x, w) ** 2), (0, 1))
    )
    op = fp8jax.Fp8RaggedDot("current", num_experts=4)
    theirs = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(op(x, w, sizes) ** 2), (0, 1)))
    (out, grads), (out_e, grads_e) = ours(x, w), theirs(x, w)
    np.testing.assert_array_equal(out, out_e)
    for a, b in zip(grads, grads_e, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_ragged_dot_whose_groups_end_before_the_rows_gives_what_lax_gives():
    """Concrete group sizes summing to fewer rows than lhs has (valid for `lax.ragged_dot`:
    the rows past them are zeros) were refused by the grouped FP8 layer's check; sizes built
    inside the function, outside it and passed in give plain JAX's output and gradients
    (rows past the groups zero). Values representable in E4M3 (E5M2 for the output
    gradient) with power-of-two scales quantize exactly: equal to float32 `lax`."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(representable(rng, (16, 32)))
    w = jnp.asarray(representable(rng, (3, 32, 16)))
    c = jnp.asarray(representable(rng, (16, 16), "e5m2"))
    sizes = jnp.array([4, 4, 4], jnp.int32)
    funs = {
        "inside": lambda x, w: jax.lax.ragged_dot(x, w, jnp.array([4, 4, 4], jnp.int32)),
        "outside": lambda x, w: jax.lax.ragged_dot(x, w, sizes),
        "argument": lambda x, w, s: jax.lax.ragged_dot(x, w, s),
    }

    def loss(f):
        return lambda x, w, *s: jnp.sum(f(x, w, *s) * c)

    for how, f in funs.items():
        args = (x, w, sizes) if how == "argument" else (x, w)
        want = (funs["outside"](x, w), *jax.grad(loss(funs["outside"]), (0, 1))(x, w))
        ours = fp8jax.fp8_autocast(f, "current")
        got = (ours(*args), *jax.grad(loss(ours), (0, 1))(*args))
        assert "f8_e4m3fn" in str(jax.make_jaxpr(ours)(*args)), how
        for g, r in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, r, err_msg=how)
        np.testing.assert_array_equal(got[0][12:], 0.0)
        np.testing.assert_array_equal(got[1][12:], 0.0)


def test_a_ragged_dot_kept_in_high_precision_is_said_or_small():
    """A residual recipe has no grouped GEMM: its ragged dots stay exact, with a warning (not
    when excluded); `min_dim` applies to a ragged dot's rows, contraction and columns."""
    x, w = jnp.ones((32, 32)), jnp.ones((4, 32, 16))
    sizes = jnp.array([8, 0, 16, 8], jnp.int32)

    def fun(x, w):
        with jax.named_scope("experts"):
            return jax.lax.ragged_dot(x, w, sizes)

    want = fun(x, w)
    residual = fp8jax.ResidualFP8()
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"'experts' stays in high precision"):
        np.testing.assert_array_equal(fp8jax.fp8_autocast(fun, residual)(x, w), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8jax.fp8_autocast(fun, residual, exclude="experts")(x, w)

    def kinds(**kwargs):
        jaxpr = jax.make_jaxpr(fp8jax.fp8_autocast(fun, "current", **kwargs))(x, w)
        return "f8_e4m3fn" in str(jaxpr)

    assert kinds(min_dim=16)  # N = 16 is the smallest dimension
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"none of the function's 1 GEMMs"):
        assert not kinds(min_dim=17)  # converting nothing for its shapes is said


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_a_ragged_dot_of_a_block_recipe_becomes_the_grouped_fp8_gemm(recipe):
    """As documented, the block-scaled recipes have a grouped GEMM: their ragged dots run in
    FP8 without a word (only a residual recipe's stay)."""
    x, w = jnp.ones((32, 32)), jnp.ones((4, 32, 32))
    sizes = jnp.array([8, 0, 16, 8], jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autocast = fp8jax.fp8_autocast(lambda x, w: jax.lax.ragged_dot(x, w, sizes), recipe)
        assert "f8_e4m3fn" in str(jax.make_jaxpr(autocast)(x, w))


def test_a_ragged_dot_inside_a_jit_or_a_scan_runs_in_fp8():
    """The interpreter rebuilds a `jit` or a `scan` whose body holds only a ragged dot: the
    ragged dot runs in FP8 there as at the top level (it stayed high precision, unsaid)."""
    x, w = jnp.ones((32, 32)), jnp.ones((4, 32, 32)) / 32  # ones and 1/32: exact in FP8
    sizes = jnp.array([8, 0, 16, 8], jnp.int32)
    in_jit = lambda x, w: jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, sizes))(x, w)  # noqa: E731

    def in_scan(x, w):
        return jax.lax.scan(lambda c, _: (jax.lax.ragged_dot(c, w, sizes), None), x, length=2)[0]

    for fun in (in_jit, in_scan):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            autocast = fp8jax.fp8_autocast(fun)
            assert "f8_e4m3fn" in str(jax.make_jaxpr(autocast)(x, w))
            np.testing.assert_array_equal(autocast(x, w), fun(x, w))


def test_a_ragged_dot_of_other_dimension_numbers_is_left_as_lax_computes_it():
    """Only the plain `ragged_dot` layout ((m, k) rows by (groups, k, n) experts, no group
    offset) is answered by `Fp8RaggedDot`; one contracting the experts' last axis stays as
    written."""
    x, w = jnp.ones((32, 32)), jnp.ones((4, 16, 32))  # experts (groups, n, k)
    sizes = jnp.array([8, 0, 16, 8], jnp.int32)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    fun = lambda x, w: jax.lax.ragged_dot_general(x, w, sizes, numbers)  # noqa: E731
    autocast = fp8jax.fp8_autocast(fun)
    np.testing.assert_array_equal(autocast(x, w), fun(x, w))
    assert "f8_e4m3fn" not in str(jax.make_jaxpr(autocast)(x, w))
    # A group offset (which lax traces but does not run on a CPU) stays as written too.
    plain = dataclasses.replace(numbers, dot_dimension_numbers=(((1,), (1,)), ((), ())))
    offset = lambda x, w: jax.lax.ragged_dot_general(x, w, sizes, plain, group_offset=1)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(fp8jax.fp8_autocast(offset))(x, jnp.swapaxes(w, 1, 2)))
    assert "f8_e4m3fn" not in jaxpr and "group_offset=1" in jaxpr


def test_bad_input_errors():
    with pytest.raises(
        ValueError,
        match=r"DelayedScaling.*keeps FP8 state between steps.*"
        "fp8_linear_layers",
    ):
        fp8jax.fp8_autocast(loss_fn, "delayed")
    with pytest.raises(ValueError, match=r"error_feedback=True.*keeps FP8 state"):
        fp8jax.fp8_autocast(loss_fn, fp8jax.ResidualFP8(error_feedback=True))
    with pytest.raises(TypeError, match=r"fun=3 is not callable"):
        fp8jax.fp8_autocast(3)
    with pytest.raises(ValueError, match=r"exclude='\(' is not a valid regex"):
        fp8jax.fp8_autocast(loss_fn, exclude="(")
    with pytest.raises(TypeError, match=r"scopes=1: should be None or a regular expression"):
        fp8jax.fp8_autocast(loss_fn, scopes=1)
    for bad in (0, True, 16.0):  # a bool is no count, nor a float
        with pytest.raises(ValueError, match=rf"min_dim={bad} should be an int >= 1"):
            fp8jax.fp8_autocast(loss_fn, min_dim=bad)
    with pytest.raises(TypeError, match=r"batched='yes' should be True or False"):
        fp8jax.fp8_autocast(loss_fn, batched="yes")


def test_min_dim_may_be_a_numpy_integer():
    """`min_dim=np.int64(17)` (read from a NumPy shape or config) was refused as not "an int
    >= 1"; it selects as 17 does, as fp8jax's other integer arguments take NumPy's."""
    params = init(jax.random.key(0))
    forward = lambda p, t: transformer(p, t[:, :-1])  # noqa: E731
    picked = fp8jax.fp8_autocast(forward, batched=True, min_dim=np.int64(17))
    assert count_fp8_dots(picked, params, TOKENS) == (5, 2)
    with pytest.raises(ValueError, match=r"min_dim=np.int32\(0\) should be an int >= 1"):
        fp8jax.fp8_autocast(loss_fn, min_dim=np.int32(0))


def current_qdq(x, fmt="e4m3"):
    """`x` as current scaling's FP8 operand stands for it: its power-of-two scale
    `2**floor(log2(fmt_max / amax))` by hand in float64, rounded by ml_dtypes."""
    fmt_max = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    scale = 2.0 ** np.floor(np.log2(fmt_max / np.max(np.abs(np.asarray(x, np.float64)))))
    return ref_qdq(x, scale, fmt)


def test_batched_may_be_a_numpy_bool():
    """`batched=np.True_` (read from a NumPy array or config) was refused ("should be True or
    False"); it selects as the bool it holds does, as Fp8Config and Fp8DotGeneral take it."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 16, 32), (2, 32, 16)))
    fp8 = np.einsum("bmk,bkn->bmn", current_qdq(a), current_qdq(b))
    high = np.einsum("bmk,bkn->bmn", np.float64(a), np.float64(b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8jax.Fp8ConversionWarning)
        converted = fp8jax.fp8_autocast(jax.lax.batch_matmul, batched=np.True_)(a, b)
        kept = fp8jax.fp8_autocast(jax.lax.batch_matmul, batched=np.False_)(a, b)
    np.testing.assert_allclose(converted, fp8, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(kept, high, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"batched=np.int64\(1\) should be True or False"):
        fp8jax.fp8_autocast(loss_fn, batched=np.int64(1))


def test_a_plain_jax_train_step_runs_its_gemms_in_fp8_on_h100():
    h100_topology()
    params = init(jax.random.key(0))
    grad_fn = jax.grad(fp8jax.fp8_autocast(loss_fn, "current", exclude="head.*"))

    def step(params, tokens):
        grads = grad_fn(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    tokens = jax.ShapeDtypeStruct((4, 17), jnp.int32)
    report = fp8jax.inspect(step, params, tokens, modes=("cublas", "default"))
    fp8jax.assert_all_fp8(report)  # cuBLAS mode: every converted GEMM on FP8 tensor cores
    for mode in ("cublas", "default"):  # XLA's default mode: FP8 operands, whatever kernel
        assert all(g.fp8_operands for g in report.gemms[mode] if g.layer is not None), mode
        layers = report.layers(mode)
        # The four GEMMs of the scanned block, two per scope, named by their scopes and
        # numbered after each scope's first: forward (recomputed under remat: twice), dgrad
        # and wgrad each in FP8.
        assert sorted(layers) == ["attn", "attn_1", "mlp", "mlp_1"], mode
        roles = {role for roles in layers.values() for role in roles}
        assert roles == {"fwd", "dgrad", "wgrad"}, mode


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "autocast.md"


def test_the_docs_example_runs():
    text = DOCS.read_text()
    (block,) = re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    namespace: dict = {"__name__": "docs_autocast"}
    exec(compile(block, str(DOCS), "exec"), namespace)
    loss = namespace["loss"]
    reference = jax.value_and_grad(namespace["loss_fn"])(
        namespace["params"], namespace["x"], namespace["y"]
    )
    assert abs(float(loss) - float(reference[0])) < 0.01 * float(reference[0])
    assert float(loss) != float(reference[0])  # FP8, not float32
    fp8, other = count_fp8_dots(
        jax.grad(namespace["fp8_loss"]), namespace["params"], namespace["x"], namespace["y"]
    )
    # w1's GEMM in FP8: forward, dgrad and wgrad (in the jaxpr: jit drops the unused dgrad);
    # the head's three stay float32.
    assert (fp8, other) == (3, 3)


def test_an_autocast_that_converts_nothing_or_excludes_nothing_says_why():
    """Silent once: a function of one example under `jax.vmap` (its GEMMs have one row,
    below `min_dim`), batched GEMMs with `batched=False`, an `exclude` that matches no
    GEMM's scope (an Equinox model's scopes are its classes'), `recipe=None`."""
    w = jax.random.normal(jax.random.key(0), (64, 64))
    x = jax.random.normal(jax.random.key(1), (32, 64))
    one = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"none of the function's 1 GEMMs") as got:
        jax.vmap(fp8jax.fp8_autocast(one), in_axes=(0, None))(x, w)
    assert "fp8_autocast(jax.vmap(f))" in str(got[0].message)
    with warnings.catch_warnings():  # autocast around the vmap: one GEMM of 32 rows, in FP8
        warnings.simplefilter("error")
        assert count_fp8_dots(fp8jax.fp8_autocast(jax.vmap(one, in_axes=(0, None))), x, w)[0]
    batched = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)  # noqa: E731
    cube = jnp.ones((4, 32, 32))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"1 with batch dimensions"):
        fp8jax.fp8_autocast(batched)(cube, cube)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8jax.fp8_autocast(batched, batched=True)(cube, cube)
    mlp = eqx.nn.MLP(64, 64, 64, 1, key=jax.random.key(2))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"exclude='.\*head.\*' matched none"):
        fp8jax.fp8_autocast(lambda m, x: jax.vmap(m)(x), exclude=r".*head.*")(mlp, x)
    with pytest.raises(ValueError, match=r"recipe=None: give a recipe"):
        fp8jax.fp8_autocast(one, None)


def test_a_call_whose_gemms_all_lie_inside_custom_vjp_or_shard_map_says_so():
    """GEMMs inside a `custom_vjp` (or `custom_jvp`) function or `shard_map` stay as written.
    A call converting no GEMM at all warns, its reasons counted; one whose every GEMM lay
    there ran in high precision without a word."""
    mesh = jax.make_mesh((1,), ("d",))
    w, x = jnp.ones((32, 32)) / 32, jnp.ones((32, 32))

    @jax.custom_vjp
    def own(x, w):
        return x @ w

    own.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def sharded(x, w):
        return jax.shard_map(lambda x: x @ w, mesh=mesh, in_specs=P(), out_specs=P())(x)

    for fun, n in ((own, 1), (sharded, 1), (lambda x, w: own(sharded(x, w), w), 2)):
        with pytest.warns(fp8jax.Fp8ConversionWarning, match=f"none of the function's {n} GEMMs"):
            out = fp8jax.fp8_autocast(fun)(x, w)
        np.testing.assert_array_equal(out, fun(x, w))  # high precision, as written


def test_the_gemms_counted_inside_a_custom_vjp_are_its_floating_ones():
    """The warning counts the GEMMs held inside a `custom_vjp` that autocast would convert
    elsewhere: the float one, not the integer one beside it (1 GEMM, not 2)."""
    x, n = jnp.ones((32, 32)), jnp.ones((32, 32), jnp.int32)

    @jax.custom_vjp
    def own(x, n):
        return x @ x + (n @ n).astype(x.dtype)

    own.defvjp(lambda x, n: (own(x, n), None), lambda r, g: (g, None))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"none of the function's 1 GEMMs"):
        fp8jax.fp8_autocast(own)(x, n)


def test_a_config_or_an_unknown_recipe_is_refused_in_autocasts_terms():
    """An `Fp8Config` (fp8_linear_layers' configuration) was refused as an 'Unknown recipe'
    without naming fp8_autocast, listing 'delayed', which autocast then refuses."""
    f = lambda x, w: x @ w  # noqa: E731
    with pytest.raises(TypeError, match=r"fp8_autocast: .*Fp8Config.*recipe=config.recipe"):
        fp8jax.fp8_autocast(f, fp8jax.Fp8Config(recipe="current"))
    with pytest.raises(ValueError, match=r"^fp8_autocast: Unknown recipe 'fast'.*keep no state"):
        fp8jax.fp8_autocast(f, "fast")
    config = fp8jax.Fp8Config(recipe="blockwise")
    x, w = jnp.ones((32, 128)), jnp.ones((128, 32))
    np.testing.assert_allclose(fp8jax.fp8_autocast(f, config.recipe)(x, w), x @ w, rtol=1e-6)


def test_a_nested_jits_shardings_survive_autocast():
    """The `in_shardings` and `out_shardings` of a `jit` inside the autocast function hold as
    they do without autocast: the output's sharding and the lowered program's sharding
    constraints are the plain function's (inlining the nested jit dropped them: the output
    came back replicated, and the program had none of its constraints)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, cols = (jax.sharding.NamedSharding(mesh, p) for p in (P("x", None), P(None, "x")))
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w), in_shardings=(rows, None), out_shardings=cols)

    def f(x, w):
        return inner(x, w) * 2.0

    x, w = jnp.ones((32, 32)), jnp.ones((32, 32))

    def constraints(g):
        text = jax.jit(g).lower(x, w).as_text()
        return sorted(re.findall(r"sdy\.sharding_constraint %\S+ (<@mesh, [^>]*>)", text))

    with jax.set_mesh(mesh):
        want = jax.jit(f)(x, w).sharding
        got = jax.jit(fp8jax.fp8_autocast(f))(x, w).sharding
        assert constraints(fp8jax.fp8_autocast(f)) == constraints(f)
    assert got.is_equivalent_to(want, 2) and want.spec == P(None, "x")


def test_nested_jits_on_an_explicit_mesh_match_the_plain_function():
    """Under a mesh with Explicit axes, arrays made outside it (typed on no mesh): autocast
    over a nested `jit` (with and without shardings; inside `scan`, inside `checkpoint`)
    gives the plain function's output, gradients and their shardings, bit for bit on
    FP8-representable values (it raised "Missing required keyword argument: 'out_sharding'")."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows, cols = (jax.sharding.NamedSharding(mesh, p) for p in (P("x", None), P(None, "x")))
    plain = jax.jit(lambda x, w: x @ w)
    sharded = jax.jit(lambda x, w: x @ w, in_shardings=(rows, None), out_shardings=cols)

    def twice(inner):
        def f(x, w):
            return jax.lax.scan(lambda c, _: (c + inner(x, w), None), x * 0, None, length=2)[0]

        return f

    cases = {
        "no jit": lambda x, w: x @ w,
        "jit": plain,
        "jit with shardings": sharded,
        "jit in scan": twice(plain),
        "jit with shardings in scan": twice(sharded),
        "jit in checkpoint": jax.checkpoint(plain),
        "jit with shardings in checkpoint": jax.checkpoint(sharded),
    }
    rng = np.random.default_rng(3)
    x, w = (jnp.asarray(representable(rng, (32, 32))) for _ in range(2))
    ct = jnp.asarray(representable(rng, (32, 32), fmt="e5m2"))

    def results(f):
        def run(x, w):
            out, vjp = jax.vjp(f, x, w)
            return out, *vjp(ct)

        return jax.jit(run)(x, w)

    with jax.set_mesh(mesh):
        for name, f in cases.items():
            want, got = results(f), results(fp8jax.fp8_autocast(f))
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=name)
                assert a.sharding.is_equivalent_to(b.sharding, 2), (name, i)


def test_a_gemm_writing_integers_or_fp8_is_left_as_written():
    """`lax.dot_general` takes floating operands with an integer or FP8
    `preferred_element_type`; autocast handed such a GEMM to `Fp8DotGeneral`, whose
    TypeError ("preferred_element_type=int32 is not a high-precision float type") failed the
    whole call. It is left as written, as GEMMs of integer or FP8 operands are; the float
    GEMM beside it is still converted."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)

    def f(x, w):
        counts = jax.lax.dot(x, w, preferred_element_type=jnp.int32)
        narrow = jax.lax.dot(x, w, preferred_element_type=jnp.float8_e4m3fn)
        return counts, narrow, x @ w

    counts, narrow, wide = fp8jax.fp8_autocast(f)(x, w)
    np.testing.assert_array_equal(counts, jax.lax.dot(x, w, preferred_element_type=jnp.int32))
    np.testing.assert_array_equal(narrow, jax.lax.dot(x, w, preferred_element_type=narrow.dtype))
    np.testing.assert_array_equal(wide, fp8_dot(fp8jax.CurrentScaling())(x, w))
    assert count_fp8_dots(fp8jax.fp8_autocast(f), x, w) == (1, 2)


def test_a_dot_general_that_contracts_nothing_is_left_as_written():
    """An outer product written as a `dot_general` (no contracted axis) is no GEMM: even
    with `min_dim=1` it stays exact, and converting nothing for it is not said."""
    a, b = jnp.arange(32.0) / 7, jnp.arange(32.0) / 3
    outer = lambda a, b: jax.lax.dot_general(a, b, (((), ()), ((), ())))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fp8jax.fp8_autocast(outer, min_dim=1)(a, b)
    np.testing.assert_array_equal(got, np.outer(np.float32(a), np.float32(b)))


def test_state_an_nnx_module_writes_in_place_is_refused_unless_returned():
    """A Flax NNX model called inside the function writes its `BatchNorm` statistics (and an
    `nnx.Rngs`' count) into its variables in place. Autocast calls the function on copies of
    its arguments, so those writes were lost without a word, under `nnx.jit` too: statistics
    never updated, the same dropout mask every step. It now raises, naming the variable; the
    state returned beside the result (`nnx.split` outside, `nnx.merge` inside) is updated."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(48, 64, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(64, momentum=0.9, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.bn(self.lin(x))

    x = jnp.asarray(np.random.default_rng(6).standard_normal((32, 48)), jnp.float32)
    net = Net()
    with pytest.raises(ValueError, match=r"its argument args\[0\]\.bn\.mean\.value .*Return"):
        nnx.jit(fp8jax.fp8_autocast(lambda net, x: net(x)))(net, x)
    np.testing.assert_array_equal(net.bn.mean[...], np.zeros(64))  # nothing half-written

    graphdef, state = nnx.split(net)

    def step(state, x):
        net = nnx.merge(graphdef, state)
        return net(x), nnx.state(net)

    _, new = jax.jit(fp8jax.fp8_autocast(step))(state, x)
    hidden = fp8_dot(fp8jax.CurrentScaling())(x, net.lin.kernel[...]) + net.lin.bias[...]
    expected = 0.1 * np.asarray(hidden, np.float64).mean(0)  # momentum 0.9 from zeros
    np.testing.assert_allclose(new["bn"]["mean"][...], expected, rtol=1e-5, atol=1e-7)


def test_a_result_holding_traced_arrays_outside_any_pytree_is_refused():
    """Leaves of the result that are not arrays are returned as they are. An object JAX does
    not flatten (a plain class, a closure) that holds the function's arrays came back
    holding the trace's tracers, and its first use raised JAX's UnexpectedTracerError far
    from the call (`jax.jit` refuses such a result at once). It is refused, naming it."""
    x, w = jnp.ones((32, 32)), jnp.ones((32, 32)) / 32

    class Box:
        def __init__(self, value):
            self.value = value

    def boxed(x, w):
        return x, Box(x @ w)

    with pytest.raises(TypeError, match=r"'boxed'.*result\[1\].*Box.*holds the traced arrays"):
        fp8jax.fp8_autocast(boxed)(x, w)
    with pytest.raises(TypeError, match=r"result.*function.*holds the traced arrays"):
        fp8jax.fp8_autocast(lambda x, w: (lambda y: lambda: y)(x @ w))(x, w)
    # Static values holding no traced array still come back as they are.
    box = fp8jax.fp8_autocast(lambda x, w: (x @ w, Box("label")))(x, w)[1]
    assert box.value == "label"


def test_a_result_holding_traced_arrays_in_slots_or_a_partial_is_refused():
    """A class with `__slots__` (no `__dict__`) or a `functools.partial` holding the
    function's arrays came back holding the trace's tracers (using the partial raised JAX's
    UnexpectedTracerError), where the docs promise a refusal; both are refused, naming them."""
    x, w = jnp.ones((32, 32)), jnp.ones((32, 32)) / 32

    class Slotted:
        __slots__ = ("value",)

        def __init__(self, value):
            self.value = value

    with pytest.raises(TypeError, match=r"result\[1\].*Slotted.*holds the traced arrays"):
        fp8jax.fp8_autocast(lambda x, w: (x, Slotted(x @ w)))(x, w)
    with pytest.raises(TypeError, match=r"result.*partial.*holds the traced arrays"):
        fp8jax.fp8_autocast(lambda x, w: functools.partial(jnp.add, x @ w))(x, w)
    # Holding no traced array, they come back as they are.
    assert fp8jax.fp8_autocast(lambda x, w: (x @ w, Slotted("label")))(x, w)[1].value == "label"
    add = fp8jax.fp8_autocast(lambda x, w: (x @ w, functools.partial(jnp.add, 2.0)))(x, w)[1]
    assert add(1.0) == 3.0


def test_a_new_variable_an_nnx_module_adds_in_place_is_refused_unless_returned():
    """Adding a variable (an `nnx.Intermediate` kept for inspection, a cache entry) changes
    the arguments' structure, which the check for overwritten arrays skipped: the new
    array was lost as silently. A container only taken from (a dict popped) still runs."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(48, 64, rngs=nnx.Rngs(0))

        def __call__(self, x):
            hidden = self.lin(x)
            self.hidden = nnx.Intermediate(hidden)
            return jnp.tanh(hidden)

    x = jnp.ones((32, 48))
    with pytest.raises(ValueError, match=r"its argument args\[0\]\.hidden\.value .*Return"):
        nnx.jit(fp8jax.fp8_autocast(lambda net, x: net(x)))(Net(), x)

    def cached(cache, x, w):
        cache["y"] = x @ w
        return jnp.tanh(cache["y"])

    w = jnp.ones((48, 64)) / 48
    with pytest.raises(ValueError, match=r"its argument args\[0\]\['y'\]"):
        fp8jax.fp8_autocast(cached)({}, x, w)
    popped = fp8jax.fp8_autocast(lambda batch: batch.pop("x") @ batch["w"])({"x": x, "w": w})
    np.testing.assert_array_equal(popped, fp8_dot(fp8jax.CurrentScaling())(x, w))


def test_autocast_inside_shard_map_scales_each_devices_block_by_its_own_amax():
    """GEMMs inside `shard_map` stay as written; docs/autocast.md says to autocast the
    function `shard_map` maps instead. Each device then quantizes its own block: equal to
    the FP8 GEMM of each block alone, not of the whole array (one block 100x larger)."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32).at[:16].multiply(100.0)
    mapped = jax.shard_map(
        fp8jax.fp8_autocast(lambda w, x: x @ w), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
    )
    dot = fp8_dot(fp8jax.CurrentScaling())
    blocks = jnp.concatenate([dot(x[i : i + 16], w) for i in range(0, 64, 16)])
    got = jax.jit(mapped)(w, x)
    np.testing.assert_allclose(got, blocks, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, dot(x, w), rtol=1e-6, atol=1e-6)  # not the global amax's


def test_an_eager_call_sees_a_closure_value_rebound_between_calls():
    """Outside `jit` nothing is cached across calls (the docs say why): a closed-over weight
    and scalar rebound, or a new shape, give what a fresh jitted autocast gives for them."""
    rng = np.random.default_rng(5)
    held = {"w": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32), "s": 2.0}

    def f(x):
        return jnp.tanh(x @ held["w"]) * held["s"]

    autocast = fp8jax.fp8_autocast(f)
    for rows in (16, 16, 32):
        x = jnp.asarray(rng.standard_normal((rows, 32)), jnp.float32)
        np.testing.assert_allclose(autocast(x), jax.jit(fp8jax.fp8_autocast(f))(x), rtol=1e-6)
        held["w"] = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
        held["s"] += 1.0


def test_docstring_and_errors_list_every_recipe_name_autocast_takes():
    """The recipe names `fp8_autocast`'s docstring and errors list are those of the recipe
    registry it takes (the stateless ones): "residual" was taken but listed nowhere."""
    from fp8jax._src.recipes import RECIPES

    def takes(name):
        try:
            fp8jax.fp8_autocast(lambda x: x, recipe=name)
        except ValueError:
            return False
        return True

    taken = {name for name in RECIPES if takes(name)}
    doc = fp8jax.fp8_autocast.__doc__
    argument = doc[doc.index("- `recipe`:") : doc.index("- `scopes`:")]
    assert set(re.findall(r'`"(\w+)"`', argument)) == taken
    for bad in (None, "nope", "delayed"):
        with pytest.raises(ValueError) as info:
            fp8jax.fp8_autocast(lambda x: x, recipe=bad)
        message = str(info.value)
        listed = message[message.index("keep") :]  # the names after the refused one
        assert set(re.findall(r"'(\w+)'", listed)) >= taken, message

"""The default conversion chooses layers by their role, on real models' namings.

Each layout below is a real model family's naming (Hugging Face, Meta, MaxText, Haliax/Levanter,
T5, Mixtral, DeepSeek-V3, flaxmodels' auto-named Linen layers), wired as a transformer. The
default `Fp8Config()` must put every attention and MLP projection in FP8 (SwiGLU gates
included) and keep every output head and MoE router in high precision, whatever they are
called: by shapes for Equinox, Haliax and NNX without an example call, by the model's
dataflow with one and always for Linen. Names alone (the rule before roles) got the gate,
`output` and `Dense_N` heads wrong.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax.examples.deepseek_model import DeepSeekConfig, DeepSeekV3

V, D, F, E = 100, 32, 64, 4  # vocabulary, width, MLP width, experts (all distinct)

#: Layouts: the names of (embedding, attention, q, k, v, o, mlp, gate, up, down, head).
LAYOUTS = {
    "huggingface": ("embed_tokens", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "mlp",
                    "gate_proj", "up_proj", "down_proj", "lm_head"),
    "meta": ("tok_embeddings", "attention", "wq", "wk", "wv", "wo", "feed_forward", "w1", "w3",
             "w2", "output"),
    "maxtext": ("token_embedder", "self_attention", "query", "key", "value", "out", "mlp",
                "wi_0", "wi_1", "wo", "logits_dense"),
    "handwritten": ("embed", "attn", "q", "k", "v", "o", "mlp", "gate", "up", "down", "out"),
    "t5": ("shared", "SelfAttention", "q", "k", "v", "o", "DenseReluDense", "wi_0", "wi_1",
           "wo", "lm_head"),
}  # fmt: skip
ROLE = ("embed", "attn", "q", "k", "v", "o", "mlp", "gate", "up", "down", "head")


def names(layout):
    return dict(zip(ROLE, LAYOUTS[layout], strict=True))


def expected(layout, blocks=2):
    """The dotted paths of the FP8 layers and the kept head of an `EqxLM` of `layout`."""
    n = names(layout)
    fp8 = [
        ".".join(("blocks", str(i), "parts", n[part], n[proj]))
        for i in range(blocks)
        for part, projs in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for proj in projs
    ]
    return sorted(fp8), n["head"]


# --- Equinox -----------------------------------------------------------------------------------


class EqxBlock(eqx.Module):
    parts: dict
    n: dict = eqx.field(static=True)

    def __init__(self, n, key):
        keys = iter(jax.random.split(key, 7))
        lin = lambda i, o: eqx.nn.Linear(i, o, use_bias=False, key=next(keys))  # noqa: E731
        attn = {n[p]: lin(D, D) for p in "qkvo"}
        mlp = {n["gate"]: lin(D, F), n["up"]: lin(D, F), n["down"]: lin(F, D)}
        self.parts, self.n = {n["attn"]: attn, n["mlp"]: mlp}, n

    def __call__(self, x):
        a, m = self.parts[self.n["attn"]], self.parts[self.n["mlp"]]
        q, k, v = (a[self.n[p]](x) for p in "qkv")
        x = x + a[self.n["o"]](v * jax.nn.sigmoid(q * k))
        h = jax.nn.silu(m[self.n["gate"]](x)) * m[self.n["up"]](x)
        return x + m[self.n["down"]](h)


class EqxLM(eqx.Module):
    parts: dict
    blocks: list
    n: dict = eqx.field(static=True)

    def __init__(self, layout, key, blocks=2):
        n = names(layout)
        k1, k2, *ks = jax.random.split(key, 2 + blocks)
        self.parts = {
            n["embed"]: eqx.nn.Embedding(V, D, key=k1),
            n["head"]: eqx.nn.Linear(D, V, use_bias=False, key=k2),
        }
        self.blocks, self.n = [EqxBlock(n, k) for k in ks], n

    def __call__(self, token):
        x = self.parts[self.n["embed"]](token)
        for block in self.blocks:
            x = block(x)
        return self.parts[self.n["head"]](x)


def converted_eqx(model):
    """Dotted paths of the FP8 layers of a converted Equinox/Haliax tree."""
    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, eqx.nn.Linear | fp8jax.Linear)
    )[0]:
        if isinstance(node, fp8jax.Linear):
            found.append(
                ".".join(
                    str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path
                )
            )
    return sorted(found)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equinox_layouts_by_shape(layout):
    model = EqxLM(layout, jax.random.key(0))
    fp8, head = expected(layout)
    assert converted_eqx(fp8jax.fp8_linear_layers(model)) == fp8
    plan = fp8jax.conversion_plan(model)
    (kept,) = plan.kept.items()
    assert kept[0] == f"parts.{head}" and kept[1].startswith("head: its 100 outputs span")
    assert not plan.traced


@pytest.mark.parametrize("layout", ["meta", "handwritten"])
def test_equinox_layouts_by_trace(layout):
    model = EqxLM(layout, jax.random.key(0))
    tokens = jnp.arange(8)
    plan = fp8jax.conversion_plan(model, example=lambda m: jax.vmap(m)(tokens))
    fp8, head = expected(layout)
    assert plan.traced and sorted(plan.converted) == fp8
    assert plan.kept == {
        f"parts.{head}": "head: its output is the model's output (the last GEMM before it)"
    }


def test_a_classifier_head_is_found_only_by_the_trace():
    mlp = eqx.nn.MLP(16, 10, 32, depth=2, key=jax.random.key(0))
    x = jnp.ones((4, 16))
    assert converted_eqx(fp8jax.fp8_linear_layers(mlp)) == ["layers.0", "layers.1", "layers.2"]
    traced = fp8jax.fp8_linear_layers(mlp, example=lambda m: jax.vmap(m)(x))
    assert converted_eqx(traced) == ["layers.0", "layers.1"]


def test_the_trace_inside_shard_map_finds_the_head_as_outside():
    """Inside `shard_map` a replicated weight meets a device's block of the batch through a
    `pvary`, which the trace did not follow: it found no GEMM of the model's layers and
    raised 'example traced no GEMM ... not a model it closes over'. The plan is now the one
    the same trace finds outside `shard_map`: the head kept, the other layers in FP8."""
    mlp = eqx.nn.MLP(16, 10, 32, depth=2, key=jax.random.key(0))
    outside = fp8jax.conversion_plan(mlp, example=lambda m: jax.vmap(m)(jnp.ones((2, 16))))
    mesh = jax.make_mesh(
        (2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    seen = {}

    def body(x):
        seen["plan"] = fp8jax.conversion_plan(mlp, example=lambda m: jax.vmap(m)(x))
        seen["model"] = fp8jax.fp8_linear_layers(mlp, example=lambda m: jax.vmap(m)(x))
        return x

    spec = jax.sharding.PartitionSpec("d")
    jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.ones((4, 16)))
    assert str(seen["plan"]) == str(outside)
    assert converted_eqx(seen["model"]) == ["layers.0", "layers.1"]


class EqxMixtral(eqx.Module):
    gate: eqx.nn.Linear
    experts: list
    up: fp8jax.GroupedLinear
    down: fp8jax.GroupedLinear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(D, E, use_bias=False, key=k[0])
        self.experts = []
        self.up = fp8jax.GroupedLinear(E, D, F, key=k[1])
        self.down = fp8jax.GroupedLinear(E, F, D, key=k[2])

    def __call__(self, x):  # x: (tokens, D); top-1 routing
        logits = jax.vmap(self.gate)(x)
        _, choice = jax.lax.top_k(logits, 1)
        order = jnp.argsort(choice[:, 0])
        sizes = jnp.bincount(choice[:, 0], length=E)
        h = self.down(jax.nn.relu(self.up(x[order], sizes)), sizes)
        return jnp.zeros_like(x).at[order].set(h) * jax.nn.sigmoid(logits.max(-1, keepdims=True))


def test_mixtral_router_named_gate_is_kept_and_its_experts_converted():
    model = EqxMixtral(jax.random.key(0))
    plan = fp8jax.conversion_plan(model)
    assert plan.converted == ("down", "up")
    assert plan.kept == {"gate": "router: its 4 outputs are the experts of 'down'"}
    x = jnp.ones((8, D))
    traced = fp8jax.conversion_plan(model, example=lambda m: m(x))
    assert traced.kept == {"gate": "router: its output feeds a top-k / arg-max (the expert choice)"}


class EqxGatedMixtral(EqxMixtral):
    """`EqxMixtral` with a Linear as wide as the expert count that is no router: `scale`,
    a low-rank bottleneck of rank `E` before the block, feeding no top-k."""

    scale: eqx.nn.Linear
    mix: eqx.nn.Linear

    def __init__(self, key):
        super().__init__(key)
        k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
        self.scale = eqx.nn.Linear(D, E, use_bias=False, key=k1)
        self.mix = eqx.nn.Linear(E, D, use_bias=False, key=k2)

    def __call__(self, x):
        return super().__call__(x + jax.vmap(self.mix)(jax.vmap(self.scale)(x)))


def test_a_trace_keeps_no_layer_as_a_router_for_its_width_alone():
    """With a trace, a router is a layer whose output feeds a top-k (the docs' "from a
    trace" column): a Linear as wide as the expert count that the trace saw feed only
    another GEMM is converted; without a trace its width makes it a router."""
    model = EqxGatedMixtral(jax.random.key(0))
    x = jnp.ones((8, D))
    assert "scale" in fp8jax.conversion_plan(model).kept  # by shapes: as wide as the experts
    traced = fp8jax.conversion_plan(model, example=lambda m: m(x))
    assert traced.kept == {"gate": "router: its output feeds a top-k / arg-max (the expert choice)"}
    assert traced.converted == ("down", "mix", "scale", "up")


def test_a_stack_of_linears_is_no_router_for_its_layer_count():
    """A router is as wide as the expert count: a stack of `E` Linears (built under
    `eqx.filter_vmap`, weights `(E, D, D)`) has `D` outputs, and converts; its layer count
    was taken for its width, making it a router."""
    k1, k2 = jax.random.split(jax.random.key(0))
    model = {
        "blocks": eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(k1, E)),
        "experts": fp8jax.GroupedLinear(E, D, F, key=k2),
    }
    plan = fp8jax.conversion_plan(model)
    assert plan.converted == ("blocks", "experts") and not plan.kept


def test_deepseek_v3_keeps_router_and_head_and_converts_the_rest():
    config = DeepSeekConfig(vocab=200, layers=2, dense_layers=1)
    model = DeepSeekV3(config, key=jax.random.key(0))
    plan = fp8jax.conversion_plan(model, fp8jax.Fp8Config(exclude=None))  # roles only
    kept = plan.kept
    assert sorted(kept) == ["blocks.1.ffn.gate", "head"], kept
    assert kept["blocks.1.ffn.gate"].startswith("router") and kept["head"].startswith("head")
    assert len(plan.converted) >= 10


def test_a_head_as_wide_as_the_expert_count_is_a_head_not_a_router():
    """A router is the gate of a MoE block (a layer of the module holding the experts): with
    as many experts as vocabulary entries (256), the model's head is still the head, and a
    Linear of another block as wide as the experts is no router. The head was called
    "router: its 256 outputs are the experts of 'blocks.1.ffn.down'"."""
    config = DeepSeekConfig(vocab=256, experts=256, layers=2, dense_hidden=256, width=64)
    model = DeepSeekV3(config, key=jax.random.key(0))
    kept = fp8jax.conversion_plan(model, fp8jax.Fp8Config(exclude=None)).kept
    assert sorted(kept) == ["blocks.1.ffn.gate", "head"], kept
    assert kept["head"] == "head: its 256 outputs span the vocabulary of embedding 'embed'"
    assert kept["blocks.1.ffn.gate"].startswith("router"), kept


# --- Haliax ------------------------------------------------------------------------------------


def test_haliax_levanter_llama_keeps_its_head():
    import haliax as hax
    import haliax.nn as hnn

    Embed, Vocab, Mlp, Layers = (
        hax.Axis("embed", D),
        hax.Axis("vocab", V),
        hax.Axis("mlp", F),
        hax.Axis("layers", 2),
    )

    class Mlp_(eqx.Module):
        gate_proj: hnn.Linear
        up_proj: hnn.Linear
        down_proj: hnn.Linear

        @staticmethod
        def init(*, key):
            k = jax.random.split(key, 3)
            return Mlp_(
                hnn.Linear.init(Embed, Mlp, key=k[0]),
                hnn.Linear.init(Embed, Mlp, key=k[1]),
                hnn.Linear.init(Mlp, Embed, key=k[2]),
            )

        def __call__(self, x):
            return x + self.down_proj(hnn.silu(self.gate_proj(x)) * self.up_proj(x))

    class Lm(eqx.Module):
        embeddings: hnn.Embedding
        layers: hnn.Stacked
        lm_head: hnn.Linear

        def __call__(self, tokens):
            return self.lm_head(self.layers.fold(self.embeddings.embed(tokens)))

    k = jax.random.split(jax.random.key(0), 3)
    model = Lm(
        hnn.Embedding.init(Vocab, Embed, key=k[0]),
        hnn.Stacked.init(Layers, Mlp_)(key=jax.random.split(k[1], 2)),
        hnn.Linear.init(Embed, Vocab, key=k[2]),
    )
    tokens = hax.arange(hax.Axis("position", 8)) % V
    for example in (None, lambda m: m(tokens)):
        plan = fp8jax.conversion_plan(model, fp8jax.Fp8Config(exclude=None), example=example)
        assert plan.converted == tuple(
            f"layers.stacked.{p}" for p in ("down_proj", "gate_proj", "up_proj")
        )
        assert list(plan.kept) == ["lm_head"]
    # Traced: Haliax's Linear multiplies its weight by a scalar (its reparametrization's
    # scale) before the GEMM; the trace follows it and finds the head by its dataflow.
    assert plan.traced and plan.kept["lm_head"].startswith("head: its output is the model's")


def test_a_haliax_stacked_model_is_traced_through_its_scan():
    """Haliax's `Stacked` names what its scan carries (`checkpoint_name`, a primitive passing
    its value on): the trace follows a weight through it, so a model that is a `Stacked`
    alone is traced and its router found by its top-k (the example was refused as calling
    no layer of the model)."""
    import haliax as hax
    import haliax.nn as hnn

    Embed, Experts, Mlp, Layers, Token = (
        hax.Axis("embed", D),
        hax.Axis("experts", E),
        hax.Axis("mlp", F),
        hax.Axis("layers", 2),
        hax.Axis("token", 8),
    )

    class Block(eqx.Module):
        router: hnn.Linear
        up: hnn.Linear
        down: hnn.Linear

        @staticmethod
        def init(*, key):
            k = jax.random.split(key, 3)
            return Block(
                hnn.Linear.init(Embed, Experts, key=k[0]),
                hnn.Linear.init(Embed, Mlp, key=k[1]),
                hnn.Linear.init(Mlp, Embed, key=k[2]),
            )

        def __call__(self, x):
            top, _ = jax.lax.top_k(self.router(x).array, 1)
            return x + self.down(hnn.relu(self.up(x))) * hax.named(top[:, 0], Token)

    model = hnn.Stacked.init(Layers, Block)(key=jax.random.split(jax.random.key(0), 2))
    x = hax.random.normal(jax.random.key(1), (Token, Embed))
    plan = fp8jax.conversion_plan(model, example=lambda m: m.fold(x))
    assert plan.traced and plan.converted == ("stacked.down", "stacked.up")
    assert plan.kept == {
        "stacked.router": "router: its output feeds a top-k / arg-max (the expert choice)"
    }


def test_a_weight_scaled_by_a_scalar_is_followed_and_a_scalar_gain_is_not_a_gemm(getkey):
    """A weight times (or over) a scalar is that weight (its layer's GEMM); an activation
    times a scalar parameter does not make the parameter's module run a GEMM."""

    class Scaled(eqx.Module):
        gain: jax.Array
        proj: eqx.nn.Linear
        head: eqx.nn.Linear

        def __call__(self, x):
            h = jax.nn.relu(self.proj(self.gain * x))
            return (self.head.weight * 2.0 / 4.0) @ h

    model = Scaled(
        jnp.ones(()), eqx.nn.Linear(D, F, key=getkey()), eqx.nn.Linear(F, D, key=getkey())
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no module reported as running a GEMM of its own
        plan = fp8jax.conversion_plan(
            model, fp8jax.Fp8Config(exclude=None), example=lambda m: m(jnp.ones(D))
        )
    assert plan.unconverted == ()
    assert plan.converted == ("proj",)
    assert plan.kept["head"].startswith("head: its output is the model's")  # found through
    # the scaling (untraced, a head is found by the vocabulary's width: this model has none)


# --- Flax NNX ----------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    def __init__(self, n, rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        for p in ("gate", "up"):
            setattr(self, n[p], lin(D, F))
        setattr(self, n["down"], lin(F, D))
        self.n = n

    def __call__(self, x):
        n = self.n
        h = jax.nn.silu(getattr(self, n["gate"])(x)) * getattr(self, n["up"])(x)
        return x + getattr(self, n["down"])(h)


class NnxLM(nnx.Module):
    def __init__(self, layout, rngs):
        n = names(layout)
        setattr(self, n["embed"], nnx.Embed(V, D, rngs=rngs))
        self.blocks = nnx.List([NnxBlock(n, rngs) for _ in range(2)])
        setattr(self, n["head"], nnx.Linear(D, V, use_bias=False, rngs=rngs))
        self.n = n

    def __call__(self, tokens):
        x = getattr(self, self.n["embed"])(tokens)
        for block in self.blocks:
            x = block(x)
        return getattr(self, self.n["head"])(x)


@pytest.mark.parametrize("layout", ["meta", "handwritten"])
def test_nnx_layouts(layout):
    model = NnxLM(layout, nnx.Rngs(0))
    n = names(layout)
    fp8 = sorted(f"blocks.{i}.{n[p]}" for i in range(2) for p in ("gate", "up", "down"))
    for example in (None, lambda m: m(jnp.arange(8))):
        plan = fp8jax.conversion_plan(model, example=example)
        assert sorted(plan.converted) == fp8 and list(plan.kept) == [n["head"]]
    converted = fp8jax.fp8_linear_layers(model)
    assert isinstance(getattr(converted.blocks[0], n["gate"]).dot_general, fp8jax.Fp8NnxDotGeneral)
    assert getattr(converted, n["head"]).dot_general is not None  # nnx's default, not FP8
    assert not isinstance(getattr(converted, n["head"]).dot_general, fp8jax.Fp8NnxDotGeneral)


def test_an_nnx_einsum_head_is_kept_by_its_vocabulary_width_without_example():
    """Untraced (and not by name: exclude=None), a head is found by its output width, the
    embedding's row count: an nnx.Einsum's is its kernel's output axes ('dv' -> V), not its
    contracted one (D)."""

    class EinsumLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.up = nnx.Linear(D, D, use_bias=False, rngs=rngs)
            self.head = nnx.Einsum("td,dv->tv", (D, V), rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.up(self.embed(tokens)))

    plan = fp8jax.conversion_plan(EinsumLM(nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None))
    assert plan.converted == ("up",) and list(plan.kept) == ["head"]


def test_an_nnx_router_is_kept_by_its_expert_count_without_example():
    """Untraced (and not by name), a router is the Linear beside NnxGroupedLinears whose
    output width is their expert count, E: their kernel's first axis, not its output one."""

    class Moe(nnx.Module):
        def __init__(self, rngs):
            self.gate = nnx.Linear(D, E, use_bias=False, rngs=rngs)
            self.up = fp8jax.NnxGroupedLinear(E, D, F, rngs=rngs)
            self.down = fp8jax.NnxGroupedLinear(E, F, D, rngs=rngs)

    plan = fp8jax.conversion_plan(Moe(nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None))
    assert plan.converted == ("down", "up")
    assert plan.kept == {"gate": f"router: its {E} outputs are the experts of 'down'"}


def test_an_nnx_stack_of_linears_as_wide_as_the_vocabulary_is_no_head():
    """Untraced (and not by name), a head is a layer as wide as the vocabulary that appears
    once: a stack of nnx.Linears built under nnx.vmap (a kernel (3, in, out)) is a repeated
    block's, converted; the single Linear after it is the head."""

    class Stacked(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(V, V, rngs=rngs)

            self.embed = nnx.Embed(V, V, rngs=rngs)
            self.blocks = make(rngs)
            self.out = nnx.Linear(V, V, rngs=rngs)

    plan = fp8jax.conversion_plan(Stacked(nnx.Rngs(0)), fp8jax.Fp8Config(exclude=None))
    assert plan.converted == ("blocks",)
    assert plan.kept == {"out": f"head: its {V} outputs span the vocabulary of embedding 'embed'"}


# --- Flax Linen --------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    n: dict | None  # None: every layer auto-named (Dense_0, ...), as flaxmodels' GPT-2

    @nn.compact
    def __call__(self, x):
        n = self.n or {}
        dense = lambda f, role: nn.Dense(f, use_bias=False, name=n.get(role))  # noqa: E731
        q, k, v = (dense(D, p)(x) for p in "qkv")
        x = x + dense(D, "o")(v * jax.nn.sigmoid(q * k))
        h = jax.nn.silu(dense(F, "gate")(x)) * dense(F, "up")(x)
        return x + dense(D, "down")(h)


class LinenLM(nn.Module):
    layout: str | None

    @nn.compact
    def __call__(self, tokens):
        n = names(self.layout) if self.layout else {}
        x = nn.Embed(V, D, name=n.get("embed"))(tokens)
        for i in range(2):
            x = LinenBlock(n or None, name=f"blocks_{i}" if n else None)(x)
        return nn.Dense(V, use_bias=False, name=n.get("head"))(x)


@pytest.mark.parametrize("layout", [*LAYOUTS, None])
def test_linen_layouts_by_trace(layout):
    fp8_model = fp8jax.fp8_linear_layers(LinenLM(layout), fp8jax.Fp8Config(exclude=None))
    plan = fp8_model.plan(jax.random.key(0), jnp.arange(8))
    if layout is None:  # auto-named: Block_i.Dense_j, and the head is Dense_0 of the root
        fp8 = sorted(f"LinenBlock_{i}.Dense_{j}" for i in range(2) for j in range(7))
        head = "Dense_0"
    else:
        n = names(layout)
        fp8 = sorted(f"blocks_{i}.{n[p]}" for i in range(2) for p in ROLE[2:6] + ROLE[7:10])
        head = n["head"]
    assert sorted(plan.converted) == fp8
    assert plan.kept == {head: "head: its output is the model's output (the last GEMM before it)"}
    variables = fp8_model.init(jax.random.key(0), jnp.arange(8))
    assert sorted(fp8jax.telemetry(variables)) == fp8


class LinenMixtral(nn.Module):
    @nn.compact
    def __call__(self, x):
        logits = nn.Dense(E, use_bias=False, name="gate")(x)
        weights, choice = jax.lax.top_k(logits, 2)
        out = 0
        for e in range(E):
            h = nn.Dense(F, name=f"w1_{e}")(x)
            y = nn.Dense(D, name=f"w2_{e}")(jax.nn.relu(h))
            out = out + y * jnp.sum(jnp.where(choice == e, weights, 0), -1, keepdims=True)
        return nn.Dense(V, name="output")(x + out)


def test_linen_mixtral_router_named_gate_is_kept(capsys):
    model = fp8jax.fp8_linear_layers(LinenMixtral(), explain=True)
    plan = model.plan(jax.random.key(0), jnp.ones((4, D)))
    assert capsys.readouterr().out == ""  # plan() returns it; init prints it
    model.init(jax.random.key(0), jnp.ones((4, D)))
    assert capsys.readouterr().out == str(plan) + "\n"
    assert plan.kept == {
        "gate": "router: its output feeds a top-k / arg-max (the expert choice)",
        "output": "head: its output is the model's output (the last GEMM before it)",
    }
    assert len(plan.converted) == 2 * E


# --- Linen modules that are Linears without being Dense ----------------------------------------


class Conv1D(nn.Module):
    """Hugging Face's FlaxConv1D: a kernel (features, in), multiplied through lax.dot_general."""

    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.5), (self.features, x.shape[-1]))
        y = jax.lax.dot_general(x, kernel.T, (((x.ndim - 1,), (0,)), ((), ())))
        return y + self.param("bias", nn.initializers.zeros, (self.features,))


class ConvNet(nn.Module):
    dense: bool = False

    @nn.compact
    def __call__(self, x):
        layer = (lambda f, name: nn.Dense(f, name=name)) if self.dense else Conv1D
        h = jax.nn.relu(layer(48, name="c_fc")(x))
        return layer(D, name="c_proj")(h) + x


def test_a_kernel_module_matches_the_equivalent_dense_bit_for_bit():
    x0 = jnp.zeros((4, D))
    config = fp8jax.Fp8Config(keep=())
    conv = fp8jax.fp8_linear_layers(ConvNet(), config)
    dense = fp8jax.fp8_linear_layers(ConvNet(dense=True), config)
    assert sorted(conv.plan(jax.random.key(0), x0).converted) == ["c_fc", "c_proj"]
    v_conv = conv.init(jax.random.key(0), x0)
    v_dense = dense.init(jax.random.key(0), x0)
    v_dense = {  # the same weights: Dense's kernel is (in, out)
        **v_dense,
        "params": jax.tree.map(lambda p: p.T if p.ndim == 2 else p, v_conv["params"]),
    }
    loss = lambda model: lambda v, x: jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    for step in range(2):
        x = jnp.asarray(rng.standard_normal((4, D)) * (1 + 3 * step), jnp.float32)
        (a, ga) = jax.jit(jax.value_and_grad(loss(conv)))(v_conv, x)
        (b, gb) = jax.jit(jax.value_and_grad(loss(dense)))(v_dense, x)
        assert float(a) == float(b)
        owg = "_overwrite_with_gradient"
        for name in ("c_fc", "c_proj"):
            kernel_a, kernel_b = ga["params"][name]["kernel"], gb["params"][name]["kernel"]
            np.testing.assert_array_equal(kernel_a.T, kernel_b)
            np.testing.assert_array_equal(ga["params"][name]["bias"], gb["params"][name]["bias"])
            new_a, new_b = jax.tree.leaves(ga[owg][name]), jax.tree.leaves(gb[owg][name])
            for p, q in zip(new_a, new_b, strict=True):  # the new FP8 state
                np.testing.assert_array_equal(p, q)
        v_conv = {**v_conv, owg: fp8jax.apply_updates(v_conv[owg], None, ga[owg])}
        v_dense = {**v_dense, owg: fp8jax.apply_updates(v_dense[owg], None, gb[owg])}


class TiedLM(nn.Module):
    """Hugging Face's tied head: the head Dense applied by a nested .apply on the embedding."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, D, name="wte")
        x = ConvNet(name="h")(embed(tokens))
        head = nn.Dense(V, use_bias=False, name="lm_head")
        return head.apply({"params": {"kernel": embed.embedding.T}}, x)


def test_a_tied_head_through_a_nested_apply_stays_in_high_precision():
    model = fp8jax.fp8_linear_layers(TiedLM())
    tokens = jnp.arange(8)
    plan = model.plan(jax.random.key(0), tokens)
    assert sorted(plan.converted) == ["h.c_fc", "h.c_proj"]
    assert plan.kept["lm_head"].startswith("applied by a nested .apply")
    variables = model.init(jax.random.key(0), tokens)
    plain = TiedLM().apply({"params": variables["params"]}, tokens)
    out = model.apply(variables, tokens)
    assert float(jnp.abs(out - plain).max()) < 0.1 * float(jnp.abs(plain).max())


def test_an_exclude_naming_a_tied_head_through_a_nested_apply_matches_it():
    """`exclude` naming the nested-apply head (kept in high precision anyway) matches a layer:
    no warning that it matches nothing; a typo of it still warns."""
    tokens = jnp.arange(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = fp8jax.fp8_linear_layers(TiedLM(), fp8jax.Fp8Config(exclude="lm_head"))
        plan = model.plan(jax.random.key(0), tokens)
        model.init(jax.random.key(0), tokens)
    assert not plan.unmatched and "lm_head" in plan.kept
    model = fp8jax.fp8_linear_layers(TiedLM(), fp8jax.Fp8Config(exclude="lm_haed"))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"exclude='lm_haed'.*keeps no layer"):
        model.init(jax.random.key(0), tokens)


class CharLM(eqx.Module):
    """A character-level model: 65 characters, 256 positions (more rows than the vocabulary),
    a projection as wide as the positions outside the blocks, and a head not named like one."""

    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    proj: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.wte, self.wpe = eqx.nn.Embedding(65, D, key=k[0]), eqx.nn.Embedding(256, D, key=k[1])
        self.proj, self.out = eqx.nn.Linear(D, 256, key=k[2]), eqx.nn.Linear(D, 65, key=k[3])

    def __call__(self, token, position):
        x = self.wte(token) + self.wpe(position)
        return self.out(x + self.proj(x)[:D])


def test_a_position_table_larger_than_the_vocabulary_is_taken_for_it_without_a_trace():
    """docs/conversion.md's edge case: from shapes, the largest table is the vocabulary (here
    the positions'), so the head converts; a trace finds the head by its role."""
    model = CharLM(jax.random.key(0))
    plan = fp8jax.conversion_plan(model)
    assert plan.converted == ("out",) and "embedding 'wpe'" in plan.kept["proj"]
    example = lambda m: jax.vmap(m)(jnp.arange(8), jnp.arange(8))  # noqa: E731
    plan = fp8jax.conversion_plan(model, example=example)
    assert plan.converted == ("proj",) and plan.kept["out"].startswith("head: its output is")


# --- nothing silent ----------------------------------------------------------------------------


def test_explain_prints_the_plan_and_report_lists_the_kept_layers(capsys):
    model = EqxLM("meta", jax.random.key(0))
    converted = fp8jax.fp8_linear_layers(model, explain=True)
    printed = capsys.readouterr().out
    assert "14 of 15 layers in FP8" in printed and "parts.output" in printed
    text = fp8jax.report(converted, plan=fp8jax.conversion_plan(model), quiet=True)
    assert "parts.output: head: its 100 outputs span the vocabulary" in text
    with pytest.raises(TypeError, match="plan=3 should be an fp8jax.ConversionPlan"):
        fp8jax.report(converted, plan=3, quiet=True)


def test_a_conversion_that_converts_nothing_or_misses_gemms_warns():
    class OwnWeight(eqx.Module):
        head: eqx.nn.Linear
        w: jax.Array

        def __call__(self, x):
            return self.head(jnp.tanh(x @ self.w))

    model = OwnWeight(eqx.nn.Linear(D, 3, key=jax.random.key(0)), jnp.ones((D, D)))
    with pytest.warns(fp8jax.Fp8ConversionWarning, match=r"converted no layer.*head"):
        fp8jax.fp8_linear_layers(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8jax.fp8_linear_layers(model, example=lambda m: m(jnp.ones(D)))
    messages = [str(w.message) for w in caught]
    assert any("run GEMMs on their own weights" in m and "(root)" in m for m in messages)


def test_a_tree_wide_cast_of_the_fp8_state_is_refused():
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(D, D, key=jax.random.key(0)))
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    with pytest.raises(TypeError, match=r"FP8 state \(input\) is bfloat16.*Cast only the param"):
        cast(jnp.ones(D, jnp.bfloat16))
    # fp8jax's gradient views the state as float32 to combine it by max: it refuses first.
    loss = lambda m: jnp.sum(m(jnp.ones(D, jnp.bfloat16)))  # noqa: E731
    with pytest.raises(TypeError, match=r"FP8 state \(input\) is bfloat16.*Cast only the param"):
        fp8jax.filter_value_and_grad(loss)(cast)
    linen = fp8jax.fp8_linear_layers(ConvNet(), fp8jax.Fp8Config(keep=()))
    variables = linen.init(jax.random.key(0), jnp.ones((2, D)))
    variables = jax.tree.map(lambda x: x.astype(jnp.bfloat16), variables)
    with pytest.raises(TypeError, match=r"is bfloat16, not float32"):
        linen.apply(variables, jnp.ones((2, D), jnp.bfloat16))


def test_bad_arguments():
    model = EqxLM("meta", jax.random.key(0))
    with pytest.raises(ValueError, match=r"keep=\('lm_head',\): should be a tuple of roles"):
        fp8jax.Fp8Config(keep=("lm_head",))
    with pytest.raises(TypeError, match=r"example=3: should be None or a function"):
        fp8jax.fp8_linear_layers(model, example=3)
    with pytest.raises(TypeError, match=r"explain='yes': should be True or False"):
        fp8jax.fp8_linear_layers(model, explain="yes")
    with pytest.raises(TypeError, match=r"example= is for Equinox, Haliax and NNX"):
        fp8jax.fp8_linear_layers(LinenLM("meta"), example=lambda m: m)
    # A layer named in targets is converted whatever its role.
    plan = fp8jax.conversion_plan(model, fp8jax.Fp8Config(targets=["output", "w1"]))
    assert sorted(plan.converted) == ["blocks.0.parts.feed_forward.w1",
                                      "blocks.1.parts.feed_forward.w1", "parts.output"]  # fmt: skip


def test_the_conversion_page_runs_and_prints_what_it_shows(capsys):
    """docs/conversion.md's Python blocks, run in order, print its `text` block exactly."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "conversion.md").read_text()
    namespace = {"__name__": "docs_conversion"}
    for block in re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        exec(compile(block, "docs/conversion.md", "exec"), namespace)
    (shown,) = re.findall(r"^```text\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert capsys.readouterr().out == shown


def test_convolutions_are_neither_converted_nor_warned_about():
    class ConvNetLinen(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.nn.relu(nn.Conv(8, (3,), name="conv")(x))
            x = jax.nn.relu(nn.Dense(16, name="fc")(x.reshape(x.shape[0], -1)))
            return nn.Dense(3, name="out")(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = fp8jax.fp8_linear_layers(ConvNetLinen())
        plan = model.plan(jax.random.key(0), jnp.ones((2, 12, 4)))
        variables = model.init(jax.random.key(0), jnp.ones((2, 12, 4)))
    assert plan.converted == ("fc",) and list(plan.kept) == ["out"] and not plan.unconverted
    assert list(fp8jax.telemetry(variables)) == ["fc"]


def test_a_kernel_modules_train_step_runs_its_gemms_in_fp8_on_h100():
    """A FlaxConv1D-style layer's forward, dgrad and wgrad, answered through its traced call,
    compile for an H100 (deviceless) to FP8 GEMMs: cuBLASLt FP8 in cuBLAS mode, FP8 operands
    under XLA's default flags."""
    from helpers import h100_topology

    h100_topology()
    model = fp8jax.fp8_linear_layers(ConvNet(), fp8jax.Fp8Config(keep=()))
    state = fp8jax.LinenTrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), jnp.ones((32, D))),
        tx=optax.sgd(0.1),
    )

    def train_step(state, x):
        loss = lambda v: jnp.mean(state.apply_fn(v, x) ** 2)  # noqa: E731
        value, grads = fp8jax.filter_value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    x = jax.ShapeDtypeStruct((32, D), jnp.float32)
    report = fp8jax.inspect(train_step, state, x, modes=("cublas", "default"))
    fp8jax.assert_all_fp8(report)
    for mode in ("cublas", "default"):
        ours = [g for g in report.gemms[mode] if g.layer is not None]
        assert ours and all(g.fp8_operands for g in ours), mode
        roles = {layer: set(r) for layer, r in report.layers(mode).items()}
        assert roles == {"c_fc": {"fwd", "wgrad"}, "c_proj": {"fwd", "dgrad", "wgrad"}}, mode

"""Hugging Face's Flax models (transformers 4.x), converted unedited from small random configs
(nothing downloaded): GPT-2 (FlaxConv1D projections, the head tied to the token embedding and
applied by a nested `.apply`) and Llama (SwiGLU, a separate `lm_head`). Which layers become FP8,
the parameters' paths (checkpoints load), the HF model's own parameters in the converted model,
30 steps of training against BF16 and float32 runs, and the HF wrapper refused."""

import functools
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("transformers")

from flax.linen import fp8_ops  # noqa: E402
from transformers import (  # noqa: E402
    FlaxGPT2LMHeadModel,
    FlaxLlamaForCausalLM,
    GPT2Config,
    LlamaConfig,
)
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule  # noqa: E402
from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule  # noqa: E402

import fp8jax  # noqa: E402

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
# 97: not 3 * 32, the width of GPT-2's fused c_attn, nor any other layer's width.
VOCAB, BATCH, LENGTH = 97, 8, 16
TEXT = (
    b"In the beginning God created the heaven and the earth. And the earth was without form, "
    b"and void; and darkness was upon the face of the deep."
)
# Eight overlapping windows of English text, bytes taken modulo the vocabulary. Text, not an
# arithmetic pattern: a pattern like (7 t + c) mod 97 is learnt by the embedding and the head
# alone, and a run whose FP8 layers did not train at all then matches the BF16 run.
TOKENS = jnp.asarray(
    np.stack([np.frombuffer(TEXT, np.uint8)[9 * b : 9 * b + LENGTH] for b in range(BATCH)]) % VOCAB,
    jnp.int32,
)
MASK = jnp.ones((BATCH, LENGTH), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(LENGTH), (BATCH, LENGTH))
INPUTS = (TOKENS, MASK, POSITIONS)
STEPS, LR = 30, 3e-3


def gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


GPT2_LAYERS = [
    f"transformer.h.{i}.{name}"
    for i in range(2)
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
LLAMA_LAYERS = [
    f"model.layers.{i}.{name}"
    for i in range(2)
    for name in (
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    )
]
# (Linen module, HF wrapper, config, the layers in FP8, why lm_head stays high precision)
MODELS = {
    # The head is wte's embedding, applied by a nested .apply (a tied head).
    "gpt2": (
        FlaxGPT2LMHeadModule,
        FlaxGPT2LMHeadModel,
        gpt2_config,
        GPT2_LAYERS,
        r"nested \.apply.*tied head",
    ),
    # An nn.Dense kept for its role: its output is the model's.
    "llama": (
        FlaxLlamaForCausalLMModule,
        FlaxLlamaForCausalLM,
        llama_config,
        LLAMA_LAYERS,
        r"^head: its output is the model's output",
    ),
}


@dataclass
class Case:
    module: Any  # the Linen module, float32 compute (HF's default dtype)
    layers: list[str]  # the layers the default conversion makes FP8
    head: str  # a regex the reason lm_head is kept matches
    fp8_model: fp8jax.Fp8Linen
    variables: dict  # fp8_model.init(key 0)
    plain: dict  # module.init(key 0)
    hf_params: dict  # the HF model's own initialisation (another key)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request) -> Case:
    module_cls, wrapper_cls, make_config, layers, head = MODELS[request.param]
    config = make_config()
    module = module_cls(config)
    fp8_model = fp8jax.fp8_linear_layers(module, fp8jax.Fp8Config())
    # What FlaxGPT2LMHeadModel(config) or from_pretrained(..., _do_init=False) gives as params.
    wrapper = wrapper_cls(config, _do_init=False)

    # One compile for the three (each random draw costs compile time; XLA shares the draws
    # of the two inits from key 0 where they are the same computation).
    @jax.jit
    def inits(key0, key1):
        return (
            fp8_model.init(key0, *INPUTS),
            module.init(key0, *INPUTS),
            wrapper.init_weights(key1, (1, 1)),
        )

    variables, plain, hf_params = inits(jax.random.key(0), jax.random.key(1))
    return Case(module, layers, head, fp8_model, variables, plain, hf_params)


def assert_same(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_default_conversion_layers_and_checkpoint_paths(case):
    plan = case.fp8_model.plan(jax.random.key(0), *INPUTS)
    assert list(plan.converted) == case.layers
    assert list(plan.kept) == ["lm_head"]
    assert re.search(case.head, plan.kept["lm_head"]), plan.kept["lm_head"]
    assert list(fp8jax.telemetry(case.variables)) == case.layers
    assert "lm_head" not in case.variables[OWG]
    # The parameters are the plain module's, path for path and value for value: HF
    # checkpoints load as they are.
    assert_same(case.variables["params"], case.plain["params"])
    shapes = lambda tree: jax.tree.map(jnp.shape, dict(tree))  # noqa: E731
    assert shapes(case.variables["params"]) == shapes(case.hf_params)  # HF's own init
    assert set(case.variables) == {"params", OWG}


def logits_of(apply, variables):
    return apply(variables, *INPUTS, return_dict=False)[0]


def test_hf_params_load_into_the_converted_model(case):
    @jax.jit  # one compile for the two
    def both(variables, params):
        variables = {**variables, "params": params}  # the HF params loaded
        return logits_of(case.fp8_model.apply, variables), logits_of(
            case.module.apply, {"params": params}
        )

    logits, plain = both(case.variables, case.hf_params)
    assert logits.shape == plain.shape == (BATCH, LENGTH, VOCAB)
    # E4M3's rounding only (a fresh delayed-scaling state scales each operand by its own amax,
    # the warm start; calibrated states give the same logits here). Measured: 3.0% (GPT-2),
    # 2.6% (Llama), in the norm; not loading them (the init's own params): 128%, 141%.
    error = float(jnp.linalg.norm(logits - plain) / jnp.linalg.norm(plain))
    assert error < 0.05, error


def loss_fn(apply, cast: bool, variables):
    if cast:  # the compute cast: the weights only, never the FP8 state
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), variables["params"])
        variables = {**variables, "params": params}
    logits = logits_of(apply, variables)[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()


def train(apply, variables, cast: bool) -> tuple[dict, np.ndarray]:
    """STEPS steps of Adam, float32 master weights; the variables after, and each step's loss."""
    state = fp8jax.LinenTrainState.create(apply_fn=apply, params=variables, tx=optax.adam(LR))

    @jax.jit  # a Python loop of jitted steps compiles faster here than a lax.scan of them
    def step(state):
        loss, grads = fp8jax.filter_value_and_grad(functools.partial(loss_fn, apply, cast))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(STEPS):
        state, loss = step(state)
        losses.append(loss)
    return state.params, np.asarray(losses)


def test_trains_like_bf16(case):
    """30 steps from the HF params in float32, BF16 and FP8 (default config, BF16 compute)."""
    # HF's modules compute in their `dtype` (float32 by default), casting the weights to it:
    # BF16 compute is the module built with dtype=bfloat16, plus the cast of the weights.
    module16 = case.module.clone(dtype=jnp.bfloat16)
    fp8_16 = fp8jax.fp8_linear_layers(module16, fp8jax.Fp8Config())
    # The same start for the three; the FP8 state is the float32 module's fresh one (the same
    # layers, the same state).
    start = {**case.variables, "params": case.hf_params}
    _, fp32 = train(case.module.apply, {"params": case.hf_params}, cast=False)
    _, bf16 = train(module16.apply, {"params": case.hf_params}, cast=True)
    variables, fp8 = train(fp8_16.apply, start, cast=True)
    # Measured, first -> last loss (mean of the last 5): GPT-2 fp32 4.558 -> 1.888 (2.006),
    # bf16 4.558 -> 1.892 (2.005), fp8 4.558 -> 1.884 (1.997); Llama fp32 4.610 -> 1.682
    # (1.823), bf16 4.610 -> 1.661 (1.816), fp8 4.611 -> 1.665 (1.823).
    assert fp8[-1] < 0.6 * fp8[0]  # measured 0.41, 0.36; 1.0 when no parameter trains
    # The mean of the last 5 losses (the last alone is noisier). FP8 rounds more coarsely than
    # BF16, so its gap is often several times BF16's to float32: measured |FP8 - BF16| 0.007
    # (GPT-2), 0.007 (Llama), and up to 0.027 (1.6%) over other seeds and data; |BF16 - FP32|
    # 0.001, 0.007, up to 0.016. The bound, 4% of the BF16 loss (0.080, 0.073; twice
    # |BF16 - FP32| where that is larger, as it never was here), fails runs whose FP8 layers'
    # kernels do not train (gaps 0.415 and 0.173; 0.13 to 0.49 over other seeds). A state
    # never updated fails the telemetry check below instead (its loss is within the bound: an
    # empty amax history warm-starts every step, as current scaling would).
    tail = lambda losses: float(losses[-5:].mean())  # noqa: E731
    gap, yardstick = abs(tail(fp8) - tail(bf16)), abs(tail(bf16) - tail(fp32))
    assert gap <= max(2 * yardstick, 0.04 * tail(bf16)), (gap, yardstick, tail(bf16))
    # Every FP8 layer ran and its state moved on: delayed scaling starts from amax 0.
    stats = fp8jax.telemetry(variables)
    assert list(stats) == case.layers
    for name, layer in stats.items():
        for role in ("input", "kernel", "output_grad"):
            assert float(getattr(layer, role).amax) > 0, (name, role)


def test_hf_wrapper_is_refused_with_a_pointer_to_its_module():
    model = FlaxGPT2LMHeadModel(gpt2_config(), _do_init=False)
    with pytest.raises(TypeError, match=r"pass its `\.module`"):
        fp8jax.fp8_linear_layers(model)

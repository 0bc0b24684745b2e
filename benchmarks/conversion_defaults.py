"""How many Linears the default `Fp8Config()` puts in FP8 on real models' namings (issue 37).

Correctness, not speed: tiny models (2 blocks, width 32, vocabulary 100; 15 Linears each, 7 a
block and a head) built as tests/test_roles.py builds them, converted with the default config,
and Hugging Face's Flax GPT-2 (transformers 4.x, the `test` extra). Run it against another
checkout of fp8jax to compare, e.g. the code before roles:

    git worktree add /tmp/old 48cc95e
    PYTHONPATH=/tmp/old python benchmarks/conversion_defaults.py   # fp8jax from /tmp/old

Output: benchmarks/results/conversion_defaults_{48cc95e,roles}.txt.
"""

import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp

import fp8jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_roles import EqxLM, LinenLM, converted_eqx  # noqa: E402


def main() -> None:
    warnings.simplefilter("ignore")
    print(f"fp8jax from {pathlib.Path(fp8jax.__file__).parent}")
    for layout in ("handwritten", "meta", "huggingface"):
        model = fp8jax.fp8_linear_layers(EqxLM(layout, jax.random.key(0)))
        print(f"Equinox {layout:<12} FP8 Linears: {len(converted_eqx(model))} of 15")
    for layout in (None, "meta"):
        variables = fp8jax.fp8_linear_layers(LinenLM(layout)).init(jax.random.key(0), jnp.arange(8))
        found = len(fp8jax.telemetry(variables))
        print(f"Linen {layout or 'auto-named':<14} FP8 layers: {found} of 15")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    ids = jnp.zeros((2, 8), jnp.int32)
    inputs = (ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(8), (2, 8)))
    for tie in (True, False):
        config = GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=tie
        )
        try:
            variables = fp8jax.fp8_linear_layers(FlaxGPT2LMHeadModule(config)).init(
                jax.random.key(0), *inputs
            )
            found = (
                len(fp8jax.telemetry(variables)) if "_overwrite_with_gradient" in variables else 0
            )
            print(f"Hugging Face GPT-2, tied={tie}: FP8 layers {found} of 8 projections")
        except Exception as e:  # noqa: BLE001 - the old code's failure is the measurement
            print(f"Hugging Face GPT-2, tied={tie}: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()

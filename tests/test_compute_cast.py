"""The README's compute cast: where it goes and what it saves (benchmarks/compute_cast.py)."""

import importlib.util
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import h100_topology

import fp8jax

ROOT = pathlib.Path(__file__).parents[1]
POLICY = fp8jax.Policy.from_string("params=float32,compute=bfloat16,output=float32")


def test_fp8_linear_output_promotes_to_float32_unless_the_model_is_cast(getkey):
    model = fp8jax.fp8_linear_layers(eqx.nn.MLP(16, 16, 32, 1, key=getkey()))
    x = jnp.ones((8, 16), jnp.bfloat16)
    dtype = lambda f, *a: eqx.filter_eval_shape(f, *a).dtype  # noqa: E731 - traced, not run
    assert model.layers[0].weight.dtype == jnp.float32
    # BF16 activations times float32 weights: the output is float32, and the layer after it
    # gets float32 too.
    assert dtype(model.layers[0], x) == jnp.float32
    assert dtype(jax.vmap(model), x) == jnp.float32

    cast = POLICY.cast_to_compute(model)
    # The FP8 layers' masters stay float32 (their GEMMs quantize them); the layers compute
    # in BF16.
    assert cast.layers[0].weight.dtype == jnp.float32
    assert cast.layers[0].compute_dtype == jnp.bfloat16
    assert dtype(cast.layers[0], x) == jnp.bfloat16
    assert dtype(jax.vmap(cast), x) == jnp.bfloat16
    # The FP8 state is untouched by the cast.
    is_dot = lambda n: isinstance(n, fp8jax.Fp8DotGeneral)  # noqa: E731
    dots = lambda m: [n for n in jax.tree.leaves(m, is_leaf=is_dot) if is_dot(n)]  # noqa: E731
    assert len(dots(model)) == 2
    assert all(eqx.tree_equal(a, b) for a, b in zip(dots(model), dots(cast), strict=True))

    # Cast inside the loss, the gradients of the master weights come back float32.
    def loss(m, x):
        return jnp.mean(jax.vmap(POLICY.cast_to_compute(m))(x).astype(jnp.float32) ** 2)

    _, grads = eqx.filter_eval_shape(fp8jax.filter_value_and_grad(loss), model, x)
    _, grads = fp8jax.partition_for_grad_overwrite(grads)
    floats = [g for g in jax.tree.leaves(grads) if jnp.issubdtype(g.dtype, jnp.floating)]
    assert len(floats) == 4 and all(g.dtype == jnp.float32 for g in floats)


class _Net(eqx.Module):
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.mlp = eqx.nn.MLP(8, 16, 16, 1, key=k1)
        self.head = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x):
        return self.head(self.mlp(x))


def _readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## One line to switch it on", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_snippet_runs_and_casts_inside_the_loss(getkey):
    snippet = _readme_snippet()
    assert "policy.cast_to_compute(model)" in snippet
    namespace = {"model": _Net(getkey())}
    exec(compile(snippet, "README.md", "exec"), namespace)
    model, opt_state, step = namespace["model"], namespace["opt_state"], namespace["step"]
    fc1 = model.mlp.layers[0]
    assert isinstance(fc1, fp8jax.Linear) and isinstance(model.head, eqx.nn.Linear)

    seen = []  # the dtype of the converted Linear's output inside the loss
    call = fp8jax.Linear.__call__

    def spy(self, x, **kwargs):
        y = call(self, x, **kwargs)
        seen.append(y.dtype)
        return y

    x = jax.random.normal(getkey(), (32, 8))
    y = jax.random.normal(getkey(), (32, 4))
    losses = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8jax.Linear, "__call__", spy)
        for _ in range(3):
            model, opt_state, loss = step(model, opt_state, x, y)
            losses.append(float(loss))
    assert seen and all(d == jnp.bfloat16 for d in seen)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # Master weights stay float32; the FP8 state was updated through the gradient.
    fc1 = model.mlp.layers[0]
    assert fc1.weight.dtype == jnp.float32 and model.head.weight.dtype == jnp.float32
    assert float(fc1.dot_general.input.amax_history[0]) > 0


def test_compute_cast_benchmark_quick(capsys, monkeypatch):
    """The uncast step holds more H100 temp memory than the cast one (deviceless compile)."""
    h100_topology()
    # Its sibling train_steps, as when run as a script (alone, this test failed to import it).
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "compute_cast", ROOT / "benchmarks" / "compute_cast.py"
    )
    compute_cast = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compute_cast)
    results = compute_cast.main(["--quick"])["sgd"]
    uncast, cast = results["fp8, no cast"], results["fp8, cast in the loss"]
    bf16 = results["bf16, cast in the loss"]
    assert uncast["dtype"] == "float32" and cast["dtype"] == bf16["dtype"] == "bfloat16"
    assert uncast["cublas"] == cast["cublas"] == "5/5" and bf16["cublas"] == "0/5"
    # Width 256, 1,024 tokens: 16.8 against 10.8 MiB when measured.
    assert uncast["cublas temp"] > 1.3 * cast["cublas temp"]
    out = capsys.readouterr().out
    assert "| fp8, no cast " in out and "temp MiB, cuBLAS" in out

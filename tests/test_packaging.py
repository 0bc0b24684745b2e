"""The package as users get it: `python -m build` makes an sdist and a wheel from it, and the
wheel installs in a fresh virtualenv with only its declared dependencies, where fp8jax trains
in FP8 and says which extra a missing feature needs."""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SMOKE = """
import importlib.util, sys
import equinox as eqx, jax, jax.numpy as jnp, optax
import fp8jax

for extra in ("flax", "haliax", "orbax", "matplotlib", "pytest"):
    assert importlib.util.find_spec(extra) is None, f"{extra} came with the wheel"
mlp = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.key(0))
model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(targets=[r"layers.0", "layers.1"]))
step = fp8jax.make_train_step(
    lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2), optax.adam(1e-2)
)
state = step.init(model)
x, y = jax.random.normal(jax.random.key(1), (16, 32)), jnp.ones((16, 8))
losses = []
for _ in range(3):
    state, metrics = step(state, x, y)
    losses.append(float(metrics.loss))
assert losses[-1] < losses[0], losses
assert fp8jax.telemetry(state)["layers.0"].input.amax > 0
for name, extra in (("Fp8Linen", "linen"), ("Fp8State", "nnx")):
    try:
        getattr(fp8jax, name)
    except ImportError as e:
        assert f"pip install 'fp8jax[{extra}]'" in str(e), e
    else:
        raise AssertionError(f"fp8jax.{name} imported without Flax")
print("ok", losses)
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_sdist_builds_a_wheel_with_the_package_and_its_data(dist):
    (sdist,) = dist.glob("fp8jax-*.tar.gz")
    (wheel,) = dist.glob("fp8jax-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fp8jax/py.typed" in names
    assert any(n.startswith("fp8jax/_src/data/") and n.endswith(".txtpb") for n in names)
    assert "fp8jax/examples/train_gpt.py" in names
    assert not any(n.startswith(("tests/", "notebooks/", "benchmarks/", "docs/")) for n in names)
    metadata = zipfile.ZipFile(wheel).read("fp8jax-0.1.0.dist-info/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = sorted(line.split()[1] for line in requires if "extra ==" not in line)
    assert runtime == [
        "equinox>=0.13",
        "jax<0.13,>=0.10.2",
        "jaxtyping>=0.2.36",
        "ml_dtypes>=0.5",
        "optax>=0.2.7",
    ]
    extras = {
        line.split(": ", 1)[1]
        for line in metadata.splitlines()
        if line.startswith("Provides-Extra:")
    }
    assert extras == {"haliax", "demo", "docs", "nnx", "linen", "orbax", "test", "h100", "peers"}


def test_the_wheel_installs_alone_and_trains_in_fp8(dist, tmp_path):
    (wheel,) = dist.glob("fp8jax-*-py3-none-any.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-compile", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(python), "-c", SMOKE],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the installed package, not the source tree
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1].startswith("ok")

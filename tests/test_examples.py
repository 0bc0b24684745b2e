import math

from fp8jax.examples import train_mlp


def test_train_mlp_runs_and_learns(capsys):
    losses = train_mlp.main(["--steps", "12", "--width", "64", "--batch", "64"])
    out = capsys.readouterr().out
    assert "input scale" in out and "final loss" in out
    assert all(math.isfinite(v) for v in losses.values())
    first = float(out.splitlines()[1].split()[2])  # step 0, fp8 loss
    assert losses["fp8"] < first

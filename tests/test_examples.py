import math

import pytest

from fp8jax.examples import train_mlp


def test_train_mlp_runs_and_learns(capsys):
    losses = train_mlp.main(["--steps", "12", "--width", "64", "--batch", "64"])
    out = capsys.readouterr().out
    assert "input scale" in out and "final loss" in out
    assert all(math.isfinite(v) for v in losses.values())
    first = float(out.splitlines()[1].split()[2])  # step 0, fp8 loss
    assert losses["fp8"] < first


def test_kjv_corpus_split_and_batches():
    import numpy as np

    from fp8jax.examples import data

    text = data.kjv_bytes()
    assert text.dtype == np.uint8 and len(text) > 4_000_000
    assert bytes(text[:30]).decode() == "1:1 In the beginning God creat"
    train, val = data.split(text)
    assert len(train) + len(val) == len(text) and len(val) == len(text) - int(len(text) * 0.95)
    tokens = data.sample(train, np.random.default_rng(0), batch=3, context=8)
    assert tokens.shape == (3, 9) and tokens.dtype == np.int32
    joined = bytes(train)
    assert all(bytes(row.astype(np.uint8)) in joined for row in tokens)


class _StepClock:
    """A stand-in for `time` on which each run's training step 0 takes 100 s, its step 3
    50 s (a compile: delayed scaling's second program), the others 0.5 s, and nothing else
    takes time: a step's time passes when its batch is sampled (`sample`, wrapped), after
    the run's `val_batches` evaluation batches."""

    def __init__(self, steps: int, val_batches: int):
        self.steps, self.val_batches, self.samples, self.now = steps, val_batches, 0, 0.0

    def perf_counter(self) -> float:
        return self.now

    def sampling(self, sample):
        def timed(*args, **kwargs):
            index = self.samples % (self.val_batches + self.steps) - self.val_batches
            if index >= 0:
                self.now += {0: 100.0, 3: 50.0}.get(index, 0.5)
            self.samples += 1
            return sample(*args, **kwargs)

        return timed


def test_train_gpt_main_job_runs_and_writes_plots(tmp_path, capsys, monkeypatch):
    from fp8jax.examples import train_gpt

    clock = _StepClock(steps=8, val_batches=8)
    monkeypatch.setattr(train_gpt, "time", clock)
    monkeypatch.setattr(train_gpt, "sample", clock.sampling(train_gpt.sample))
    args = ["--steps", "8", "--layers", "1", "--width", "32", "--context", "16", "--batch", "4"]
    args += ["--recipes", "delayed,blockwise", "--eval-every", "4", "--log-every", "2"]
    runs = train_gpt.main([*args, "--out", str(tmp_path)])
    # Steps per second from the median window between reads (logged at steps 0, 2, 4, 6, 7,
    # evaluated after 3 and 7): the compiles (steps 0 and 3) not counted.
    assert [r.steps_per_second for r in runs] == [2.0] * 4
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    names = ["bf16", "fp32", "delayed", "blockwise"]  # fp32, the yardstick, runs by default
    assert [r.split("|")[1].strip() for r in rows[1:]] == names
    assert [r.name for r in runs] == names
    for run in runs:
        assert all(math.isfinite(v) for v in run.train + run.val)
        assert run.train[-1] < run.train[0]  # it learns, even in 8 steps
    # Logged at steps 0, 2, 4, 6 and the last one.
    assert not runs[1].scales  # fp32 has no FP8 layers ...
    assert runs[1].val != runs[0].val  # ... and computes in float32, which rounds otherwise
    assert runs[2].scales and all(len(h) == 5 for h in runs[2].scales.values())
    for name in ("val_gap.png", "scale_history.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_gpt_runs_a_repeated_recipe_once():
    """`--recipes delayed,current,delayed` names each run once, in the order first given (a
    repeat trained the same run again: twice the time and a duplicate row in the table)."""
    import argparse

    from fp8jax.examples import train_gpt

    parser = argparse.ArgumentParser()
    given = ["delayed", "current", "delayed", "fp32", "current"]
    unique = [r for i, r in enumerate(given) if r not in given[:i]]
    assert train_gpt.parse_recipes(parser, ",".join(given)) == unique


def test_train_gpt_accepts_bf16_in_recipes_and_runs_it_once_first(tmp_path, capsys, monkeypatch):
    """`--recipes bf16,...` names the baseline that always runs: it runs once, first (it was
    'unknown recipe bf16'), and `--help` says so. Training is stubbed: only the parsing runs."""
    from fp8jax.examples import train_gpt

    trained = []
    monkeypatch.setattr(train_gpt, "kjv_bytes", lambda: b"")
    monkeypatch.setattr(train_gpt, "split", lambda data: (b"", b""))
    monkeypatch.setattr(train_gpt, "train", lambda name, *a: trained.append(name) or name)
    monkeypatch.setattr(train_gpt, "table", lambda runs, tail: "")
    monkeypatch.setattr(train_gpt, "plot", lambda runs, out: [])
    given = ["delayed", "bf16", "current", "bf16"]
    train_gpt.main(["--recipes", ",".join(given), "--no-fp32", "--out", str(tmp_path)])
    assert trained == ["bf16", *dict.fromkeys(r for r in given if r != "bf16")]
    trained.clear()
    train_gpt.main(["--recipes", "bf16", "--no-fp32", "--out", str(tmp_path)])
    assert trained == ["bf16"]
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    _, out, _ = _cli_exit("train_gpt", ["--help"], capsys)
    entry = next(line for line in out.splitlines() if line.lstrip().startswith("--recipes "))
    assert "bf16, the baseline, runs once and first whether named or not" in entry


def test_train_gpt_gap_figure_plots_the_loss_relative_to_bf16():
    import matplotlib.pyplot as plt

    from fp8jax.examples import train_gpt

    steps = [4, 9]
    runs = [
        train_gpt.Run("bf16", val_steps=steps, val=[3.0, 2.5]),
        train_gpt.Run("fp32", val_steps=steps, val=[3.003, 2.498]),
        train_gpt.Run("delayed", val_steps=steps, val=[2.97, 2.51]),
    ]
    fig = train_gpt.gap_figure(runs)
    ax = fig.axes[0]
    lines = {line.get_label().split(":")[0]: line for line in ax.get_lines()}
    assert {"fp32", "delayed"} <= set(lines) and "bf16" not in lines
    for run in runs[1:]:
        want = [100 * (v - b) / b for v, b in zip(run.val, runs[0].val, strict=True)]
        assert list(lines[run.name].get_xdata()) == steps
        assert lines[run.name].get_ydata() == pytest.approx(want, rel=1e-12)
    # The yardstick: a band from -|fp32 gap| to +|fp32 gap| (0.1 % and 0.08 % here).
    (band,) = ax.collections
    heights = band.get_paths()[0].vertices[:, 1]
    assert max(heights) == pytest.approx(0.1) and min(heights) == pytest.approx(-0.1)
    # Without an fp32 run there is no band, and the bars are drawn when asked for.
    fig = train_gpt.gap_figure([runs[0], runs[2]], bars=[(0.005, "--", "0.5 % bar")])
    ax = fig.axes[0]
    bars = [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert not ax.collections and bars == [-0.5, 0.5]
    plt.close("all")


def test_train_gpt_dequantized_block_dot_builds_the_emulation():
    import jax

    import fp8jax
    from fp8jax.examples import gpt, train_gpt

    config = gpt.GPTConfig(vocab=16, layers=1, width=32, heads=2, context=8)
    want = {
        "blockwise": fp8jax.BlockwiseScaling(dequantized_dot=True),
        "mxfp8": fp8jax.MXFP8(dequantized_dot=True),
        "delayed": fp8jax.DelayedScaling(),
    }
    for variant, recipe in want.items():
        model = train_gpt.build(config, variant, jax.random.PRNGKey(0), block_dot="dequantized")
        is_dot = lambda x: isinstance(x, fp8jax.Fp8DotGeneral)  # noqa: E731
        dots = [leaf for leaf in jax.tree.leaves(model, is_leaf=is_dot) if is_dot(leaf)]
        # One layer: the attention's q, k, v and output Linears and the MLP's two.
        assert len(dots) == 6 and all(d.recipe == recipe for d in dots), variant


def test_digits_classifier_in_fp8_matches_bf16(capsys):
    from fp8jax.examples import digits

    x_train, y_train, x_test, y_test = digits.load_digits()
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0 and set(y_test.tolist()) == set(range(10))
    results = digits.main(["--steps", "150"])
    (bf16_acc, _), (fp8_acc, fp8_loss) = results["bf16"], results["delayed"]
    assert math.isfinite(fp8_loss)
    assert fp8_acc > 0.9  # a real classifier, not chance (0.1)
    assert abs(fp8_acc - bf16_acc) <= 0.03  # within 11 of the 360 test images
    assert "test accuracy" in capsys.readouterr().out


def test_convergence_benchmark_records_reuses_and_judges(tmp_path, capsys, monkeypatch):
    import dataclasses
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence", path)
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    args = ["--steps", "4", "--layers", "1", "--width", "32", "--context", "16", "--batch", "4"]
    args += ["--recipes", "fp32,delayed", "--out", str(tmp_path)]
    runs = convergence.main(args)[0]
    assert [r.name for r in runs] == ["bf16", "fp32", "delayed"]
    saved = json.loads((tmp_path / "seed0" / "delayed.json").read_text())
    assert saved["run"]["val"] == runs[2].val and saved["settings"]["steps"] == 4
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| d")]
    rel = (runs[2].val[-1] - runs[0].val[-1]) / runs[0].val[-1]
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[3] == cells[4] == f"{100 * rel:+.3f} %"  # seed 0, and the mean of one seed
    assert cells[6] == ("yes" if abs(rel) <= 0.005 else "NO")
    assert (tmp_path / "seed0" / "val_gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second call with the same settings trains nothing; a new seed trains every variant.
    trained = []
    monkeypatch.setattr(
        convergence.train_gpt,
        "train",
        lambda variant, *a, **k: trained.append(variant) or dataclasses.replace(runs[0]),
    )
    again = convergence.main(args)[0]
    assert trained == [] and [r.val for r in again] == [r.val for r in runs]
    capsys.readouterr()
    convergence.main([*args, "--seeds", "0,1"])
    assert trained == ["bf16", "fp32", "delayed"]
    # Seed 1's stand-in runs all equal BF16's: the mean is half of seed 0's difference.
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| d")]
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[3:6] == [f"{100 * rel:+.3f} %", "+0.000 %", f"{50 * rel:+.3f} %"]


def test_convergence_benchmark_runs_a_repeated_seed_once(tmp_path, monkeypatch):
    """`--seeds 0,1,0` runs each seed once, in the order first given, as `--recipes` runs a
    repeated name once (seed 0 went through every variant a second time). Training is stubbed."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence", path)
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    ran = []
    run = convergence.train_gpt.Run("bf16", [1], [1.0], [1], [1.0])
    monkeypatch.setattr(convergence, "kjv_bytes", lambda: b"")
    monkeypatch.setattr(convergence, "split", lambda data: (b"", b""))
    monkeypatch.setattr(
        convergence, "_run", lambda name, c, d, a: ran.append((a.seed, name)) or run
    )
    monkeypatch.setattr(convergence.train_gpt, "plot", lambda runs, out, bars: [])
    given = [0, 1, 0, 1]
    by_seed = convergence.main(
        ["--seeds", ",".join(map(str, given)), "--recipes", "delayed", "--out", str(tmp_path)]
    )
    unique = [k for i, k in enumerate(given) if k not in given[:i]]
    assert ran == [(k, name) for k in unique for name in ("bf16", "delayed")]
    assert list(by_seed) == unique


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps 0: should be >= 1"),
        (["--width", "0"], "--width 0: should be >= 1"),
        (["--heads", "3"], "--heads 3: should divide --width 256"),
        (["--lr", "nan"], "--lr nan: should be > 0 and finite"),
        (["--seeds", "0,-1"], "--seeds -1: should be >= 0"),
    ],
)
def test_convergence_benchmark_refuses_what_no_run_could_take(argv, message, capsys):
    """The benchmark's flags (the main job's, `add_arguments`) are checked as the main job
    checks them, before anything trains: `--steps 0` ended in an IndexError, `--heads 3` in
    JAX's reshape error, a negative seed in NumPy's, and `--width 0` or `--lr nan` trained
    1,000 steps of nothing."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence", path)
    convergence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convergence)
    convergence.kjv_bytes = lambda: pytest.fail("it started training")
    with pytest.raises(SystemExit) as exit_:
        convergence.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


#: Every example with a command line, by module name (issue 37: each answers `--help` and
#: refuses a flag it does not use).
EXAMPLES = ("train_mlp", "train_gpt", "digits", "moe", "deepseek")


def _cli_exit(name: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """`main(argv)` of `fp8jax.examples.<name>`, which must exit (argparse does, before any
    training): its exit code, stdout and stderr."""
    import importlib

    module = importlib.import_module(f"fp8jax.examples.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_cli_answers_help(name, capsys):
    """`--help` prints the usage and the flags and exits 0, without training."""
    code, out, _ = _cli_exit(name, ["--help"], capsys)
    assert code == 0 and out.startswith("usage:") and "--help" in out and "--steps" in out


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_cli_refuses_an_unknown_flag(name, capsys):
    """A flag the example does not know is argparse's error (exit 2), named, not ignored."""
    code, _, err = _cli_exit(name, ["--no-such-flag"], capsys)
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize(("name", "flag"), [("train_gpt", "--recipes"), ("digits", "--recipe")])
def test_example_cli_help_lists_the_recipes_its_flag_takes(name, flag, capsys, monkeypatch):
    """`--help` names every recipe the flag accepts (it showed a bare `--recipes RECIPES`:
    the names were learnt only from the error a wrong one gave)."""
    import re

    from fp8jax._src.recipes import RECIPES
    from fp8jax.examples import train_gpt

    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: no name broken at its hyphen
    _, out, _ = _cli_exit(name, ["--help"], capsys)
    entry = next(line for line in out.splitlines() if line.lstrip().startswith(f"{flag} "))
    # What parse_recipes checks --recipes against; what Fp8Config(recipe=...) takes.
    accepted = train_gpt.VARIANTS if name == "train_gpt" else tuple(RECIPES)
    assert set(accepted) <= set(re.findall(r"[\w-]+", " ".join(entry.split()[2:]))), entry


def test_moe_cli_help_documents_both_runs(capsys):
    """The MoE example's `--help` describes the synthetic run and lists the `--kjv` run's
    flags (it used to ignore `--help` and start the synthetic run)."""
    code, out, _ = _cli_exit("moe", ["--help"], capsys)
    assert code == 0 and "synthetic run" in out and "--kjv" in out
    for flag in ("--steps", "--seeds", "--experts", "--expert-parallel", "--fp8-backward"):
        assert flag in out, flag


def test_deepseek_cli_help_describes_every_flag(capsys, monkeypatch):
    """Every flag of the DeepSeek job's `--help` says what it sets (ten, from `--steps` to
    `--eval-every`, were listed with no text), and the counts their default."""
    import re

    monkeypatch.setenv("COLUMNS", "100")  # argparse's wrapping, so the layout is known
    code, out, _ = _cli_exit("deepseek", ["--help"], capsys)
    lines = out.split("options:", 1)[1].splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  --"):
            text = re.match(r"  \S.*?\s{2,}\S", line) or lines[i + 1].startswith(" " * 24)
            assert text, line
    for flag, default in (("steps", 250), ("layers", 3), ("experts", 8), ("eval-every", 50)):
        assert re.search(rf"--{flag} [A-Z_]+\s+[^-]*?\(default:\s+{default}\)", out), flag
    assert code == 0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "3"], "--steps"),
        (["--seed=1", "--fp8-backward"], "--seed, --fp8-backward"),
        (["--ste", "3"], "--steps"),  # argparse's abbreviations too
    ],
    ids=["steps", "seed-and-fp8-backward", "abbreviated"],
)
def test_moe_cli_refuses_kjv_flags_without_kjv(argv, named, capsys):
    """A flag of the `--kjv` run without `--kjv` is an error naming it: the synthetic run
    takes no flags, and used to ignore them silently."""
    code, _, err = _cli_exit("moe", argv, capsys)
    assert code == 2 and f"{named}: only with --kjv" in err


@pytest.mark.parametrize(
    ("name", "argv", "message"),
    [
        ("train_gpt", ["--steps", "0"], "--steps 0: should be >= 1"),
        ("train_gpt", ["--eval-every", "0"], "--eval-every 0: should be >= 1"),
        ("train_gpt", ["--heads", "3", "--width", "64"], "--heads 3: should divide --width 64"),
        ("train_mlp", ["--steps", "0"], "--steps 0: should be >= 1"),
        ("moe", ["--kjv", "--steps", "0"], "--steps 0: should be >= 1"),
        ("moe", ["--kjv", "--top-k", "5"], "--top-k 5: should be at most --experts (4)"),
        ("moe", ["--kjv", "--devices", "8"], "--devices: only with --expert-parallel"),
        ("deepseek", ["--kjv", "--top-k", "9"], "--top-k 9: should be from 1 to --experts (8)"),
        ("deepseek", ["--kjv", "--layers", "0"], "--layers 0: should be >= 1"),
        ("deepseek", ["--kjv", "--balance-speed", "nan"], "--balance-speed nan: should be >= 0"),
        ("deepseek", ["--kjv", "--balance-speed", "inf"], "--balance-speed inf: should be >= 0"),
        # Seeds NumPy's batch sampler cannot take (it raised 'expected non-negative integer').
        ("train_gpt", ["--seed", "-1"], "--seed -1: should be >= 0"),
        ("digits", ["--seed", "-2"], "--seed -2: should be >= 0"),
        ("moe", ["--kjv", "--seed", "-1"], "--seed -1: should be >= 0"),
        ("moe", ["--kjv", "--seeds", "0", "-3"], "--seeds -3: should be >= 0"),
        # Both seed flags: --seed won and the seeds of --seeds were dropped without a word.
        ("moe", ["--kjv", "--seed", "1", "--seeds", "2", "3"], "--seeds: not allowed with"),
        ("deepseek", ["--kjv", "--seeds", "1", "-1"], "--seeds -1: should be >= 0"),
        ("deepseek", ["--kjv", "--width", "-8"], "--width -8: should be >= 1"),
        ("deepseek", ["--kjv", "--experts", "0"], "--experts 0: should be >= 1"),
        ("digits", ["--batch", "0"], "--batch 0: should be >= 1"),
        ("digits", ["--lr", "-1"], "--lr -1.0: should be > 0"),
        # A learning rate no run could train with: every loss NaN, or climbing.
        ("digits", ["--lr", "inf"], "--lr inf: should be > 0 and finite"),
        ("train_gpt", ["--lr", "nan"], "--lr nan: should be > 0 and finite"),
        ("train_gpt", ["--lr", "-0.003"], "--lr -0.003: should be > 0 and finite"),
        ("moe", ["--kjv", "--lr", "0"], "--lr 0.0: should be > 0 and finite"),
        ("deepseek", ["--kjv", "--lr", "nan"], "--lr nan: should be > 0 and finite"),
        ("digits", ["--recipe", "bogus"], "--recipe bogus: Unknown recipe 'bogus'"),
        ("train_gpt", ["--recipes", "bogus"], "unknown recipe 'bogus': choose from bf16, fp32,"),
        # --no-fp32 was ignored where --recipes named fp32: the float32 model trained.
        ("train_gpt", ["--no-fp32", "--recipes", "fp32,delayed"], "--no-fp32 with --recipes"),
        # --block-dot changes the block recipes' GEMMs only: without one it was ignored.
        (
            "train_gpt",
            ["--recipes", "delayed,residual", "--block-dot", "dequantized"],
            "--block-dot dequantized: only with a block recipe (blockwise, mxfp8)",
        ),
        ("moe", ["--kjv", "--expert-parallel", "-1"], "--expert-parallel -1: should be >= 0"),
        ("moe", ["--kjv", "--expert-parallel", "2", "--devices", "0"], "--devices 0: should"),
        # Each unmet condition named (it said "multiples of 4 (the batch of 8)").
        (
            "moe",
            ["--kjv", "--expert-parallel", "4", "--batch", "12"],
            "--expert-parallel 4: needs --batch (12) a multiple of the devices (8).",
        ),
        (
            "moe",
            ["--kjv", "--expert-parallel", "3"],
            "needs the devices (8; --devices N forces N) a multiple of 3; --experts (4) a "
            "multiple of 3.",
        ),
        # Checked on the model's shapes before the BF16 run trains (it failed after it).
        ("deepseek", ["--kjv", "--fp8-targets", "["], "--fp8-targets '[': Fp8Config targets"),
        ("deepseek", ["--kjv", "--fp8-targets", "x"], "targets='x' matches no Linear layer"),
        # FP8 options with no FP8 run: they were ignored, the run silently all BF16/float32.
        (
            "deepseek",
            ["--kjv", "--precisions", "fp32", "--power-of-two", "--fp8-targets", "x"],
            "--fp8-targets, --power-of-two: only with the FP8 run; --precisions bf16,fp32",
        ),
        ("deepseek", ["--kjv", "--precisions", "bf16", "--block-dot", "dequantized"], "(add fp8)"),
    ],
)
def test_example_cli_refuses_what_no_run_could_take(name, argv, message, capsys):
    """Counts below 1, heads that do not divide the width, a top-k above the experts: an
    argparse error naming the flag before anything trains (they ended in tracebacks: an
    IndexError, a ZeroDivisionError, a reshape error, JAX's top_k error after three runs)."""
    code, _, err = _cli_exit(name, argv, capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("train_mlp", ["--seed", str(2**32)]),
        ("train_gpt", ["--seed", str(2**32 + 7)]),
        ("digits", ["--seed", str(2**64)]),
        ("moe", ["--kjv", "--seeds", "0", str(2**32)]),
        ("deepseek", ["--kjv", "--seeds", "1", str(2**63)]),
    ],
)
def test_example_cli_refuses_a_seed_jax_would_alias(name, argv, capsys):
    """`jax.random.PRNGKey` keeps a seed's low 32 bits (without x64, as the examples run):
    seed 2**32 + s built seed s's model, and from 2**63 it raised OverflowError; such a
    seed is refused, named."""
    import jax

    assert (jax.random.PRNGKey(2**32 + 7) == jax.random.PRNGKey(7)).all()
    code, _, err = _cli_exit(name, argv, capsys)
    assert code == 2 and f"{argv[-1]}: should be >= 0 and < 2**32" in err, err


_WITHOUT_DEMO = """
import sys
for name in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.pyplot"):
    sys.modules[name] = None  # not installed: `pip install fp8jax` without the demo extra
from fp8jax.examples import train_gpt
train_gpt.kjv_bytes = lambda: sys.exit("started training")
try:
    train_gpt.main(["--help"])
except SystemExit as e:
    print("help exit", e.code)
try:
    train_gpt.main(["--steps", "1", "--out", sys.argv[1]])
except ModuleNotFoundError as e:
    print("refused:", e)
"""


def test_train_gpt_without_the_demo_extra_answers_help_and_names_the_extra(tmp_path):
    """Without tqdm and matplotlib (the `demo` extra), `--help` works and a run is refused
    before it trains, naming the extra, as the corpus's and digits' missing packages are
    (the module's import raised a bare "No module named 'tqdm'"; matplotlib's import came
    only after every run had trained)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DEMO, str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "help exit 0" in result.stdout
    assert "refused:" in result.stdout and "pip install 'fp8jax[demo]'" in result.stdout
    for name in ("tqdm", "matplotlib"):
        assert name in result.stdout.split("refused:")[1]


def test_train_gpt_refuses_an_out_it_cannot_write_before_training(tmp_path, capsys):
    """`--out` naming a file (or a path under one) is an error before any run trains: the
    directory was made only after every run, which then ended in a traceback."""
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    for out in (taken, taken / "below"):
        code, out_text, err = _cli_exit("train_gpt", ["--steps", "1", "--out", str(out)], capsys)
        assert code == 2 and f"--out {out}: cannot make a directory there" in err
        assert "steps on" not in out_text  # nothing started

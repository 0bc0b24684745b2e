"""The benchmark scripts refuse a flag value they cannot run, before compiling anything."""

import importlib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name: str):
    """benchmarks/`name`.py as a module, imported as the scripts import each other (their
    directory on the path), so that a module another test imported is the same one."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


def never(*args, **kwargs):
    raise AssertionError("compiled before the flags were checked")


def refusal(main, argv, capsys) -> str:
    """What `main(argv)` (`argv` None: sys.argv's) writes to stderr as argparse refuses it."""
    with pytest.raises(SystemExit) as exit_:
        main() if argv is None else main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_cost_model_refuses_an_unknown_attention(monkeypatch, capsys):
    """A typo in --attention was compiled as the attention "as compiled", minutes per model."""
    cost_model = load("cost_model")
    monkeypatch.setattr(cost_model, "compile_cost", never)
    err = refusal(
        cost_model.main,
        ["--models", "1B", "--variants", "bf16", "--attention", "flash-analytic"],
        capsys,
    )
    assert "'flash-analytic'" in err and "compiled, flash" in err


def test_scaling_out_refuses_an_unknown_section(monkeypatch, capsys):
    """An unknown --sections value ran nothing and exited 0 after printing the header."""
    scaling_out = load("scaling_out")
    monkeypatch.setattr(scaling_out, "fsdp_section", never)
    monkeypatch.setattr(scaling_out, "gpt_section", never)
    monkeypatch.setattr(sys, "argv", ["scaling_out.py", "--sections", "gtp"])
    err = refusal(scaling_out.main, None, capsys)
    assert "'gtp'" in err and "fsdp, gpt" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--sizes", "8b"], "'8b'"),
        (["--sizes", "1B", "--variants", "bf16,delayed-stedy"], "'delayed-stedy'"),
    ],
)
def test_llama_block_refuses_an_unknown_size_or_variant(monkeypatch, capsys, flags, named):
    """An unknown size was a KeyError; an unknown variant a ValueError after BF16's compile."""
    llama_block = load("llama_block")
    monkeypatch.setattr(llama_block, "compile_deviceless", never)
    err = refusal(llama_block.main, flags, capsys)
    assert named in err and "choose among" in err


def test_temp_peak_refuses_an_unknown_variant_before_compiling_bf16(monkeypatch, capsys):
    temp_peak = load("temp_peak")
    monkeypatch.setattr(temp_peak, "measure", never)
    assert "'curent'" in refusal(
        temp_peak.main, ["--sizes", "1B", "--variants", "bf16,curent"], capsys
    )


@pytest.mark.parametrize("case", ["99", "x"])
def test_memory_sweep_refuses_an_unknown_case(monkeypatch, capsys, case):
    """A case number out of range printed no row; a non-number was a ValueError traceback."""
    memory_sweep = load("memory_sweep")
    monkeypatch.setattr(memory_sweep, "temp_bytes", never)
    err = refusal(memory_sweep.main, ["--cases", f"0,{case}"], capsys)
    assert f"'{case}'" in err and f"0 to {len(memory_sweep.CASES) - 1}" in err


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--steps", "0"]])
def test_step_overhead_refuses_a_count_under_one(monkeypatch, capsys, flags):
    """--rounds 0 was the median of no ratios, --steps 0 a division by zero: after compiling."""
    pytest.importorskip("haliax")
    step_overhead = load("step_overhead")
    monkeypatch.setattr(step_overhead, "models", never)
    err = refusal(step_overhead.main, flags, capsys)
    assert f"argument {flags[0]}: '{flags[1]}'" in err and "at least 1" in err


def test_moe_cost_refuses_an_unknown_shape(monkeypatch, capsys):
    """An unknown --shapes name was a KeyError traceback after the first shape's tables."""
    moe_cost = load("moe_cost")
    monkeypatch.setattr(moe_cost, "report", never)
    err = refusal(moe_cost.main, ["--shapes", "mixtral,deepseek"], capsys)
    assert "'deepseek'" in err and "mixtral, fine" in err


def test_peers_refuses_an_unknown_model_before_building_any(monkeypatch, capsys):
    """peers.py ran every model (a rerun of the tiny GPT's rows took a Python one-liner);
    its --models names a subset, an unknown name refused before a model is built."""
    pytest.importorskip("haliax")
    pytest.importorskip("flax")
    peers = load("peers")
    monkeypatch.setattr(peers, "models", never)
    monkeypatch.setattr(peers.deviceless, "h100_topology", never)
    err = refusal(peers.main, ["--models", "gpt,gtp"], capsys)
    assert "--models: unknown model 'gtp'; choose among mlp, mlp-remat, linears, gpt" in err


@pytest.mark.parametrize("seeds", ["0,x", ""])
def test_peers_qwix_train_refuses_seeds_that_are_not_integers(monkeypatch, capsys, seeds):
    """A seed that is not an integer was a ValueError traceback from `int`."""
    peers_qwix_train = load("peers_qwix_train")
    monkeypatch.setattr(peers_qwix_train, "train", never)
    assert f"--seeds {seeds!r}: should be comma-separated integers" in refusal(
        peers_qwix_train.main, ["--seeds", seeds], capsys
    )


@pytest.mark.parametrize(
    ("script", "flags"),
    [
        ("compute_cast", ["--width", "0"]),
        ("compute_cast", ["--ratio", "-4"]),
        ("compute_cast", ["--tokens", "many"]),
        ("quantization_quality", ["--size", "0"]),
        ("quantization_quality", ["--gemm-size", "-1"]),
    ],
)
def test_sizes_under_one_are_refused(monkeypatch, capsys, script, flags):
    """A width, ratio, token count or matrix size under 1 was taken, and the script went on
    to build and compile its arrays; it is refused first, as the other scripts' counts."""
    module = load(script)
    monkeypatch.setattr(module.jnp, "asarray", never)  # quantization_quality's first array
    if hasattr(module, "deviceless"):
        monkeypatch.setattr(module.deviceless, "h100_topology", never)  # compute_cast's first
    assert f"{flags[1]!r}: should be an integer of at least 1" in refusal(
        module.main, flags, capsys
    )

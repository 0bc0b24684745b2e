"""The benchmark scripts refuse a flag value they cannot run, before compiling anything."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name: str):
    """benchmarks/`name`.py as a module (its directory on the path, as when run)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def never(*args, **kwargs):
    raise AssertionError("compiled before the flags were checked")


def test_cost_model_refuses_an_unknown_attention(monkeypatch, capsys):
    """A typo in --attention was compiled as the attention "as compiled", minutes per model."""
    cost_model = load("cost_model")
    monkeypatch.setattr(cost_model, "compile_cost", never)
    with pytest.raises(SystemExit) as exit_:
        cost_model.main(["--models", "1B", "--variants", "bf16", "--attention", "flash-analytic"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'flash-analytic'" in err and "compiled, flash" in err


def test_scaling_out_refuses_an_unknown_section(monkeypatch, capsys):
    """An unknown --sections value ran nothing and exited 0 after printing the header."""
    scaling_out = load("scaling_out")
    monkeypatch.setattr(scaling_out, "fsdp_section", never)
    monkeypatch.setattr(scaling_out, "gpt_section", never)
    monkeypatch.setattr(sys, "argv", ["scaling_out.py", "--sections", "gtp"])
    with pytest.raises(SystemExit) as exit_:
        scaling_out.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'gtp'" in err and "fsdp, gpt" in err

"""`benchmarks/gpu_check`'s dry run: the device check's own code, end to end on the CPU.

The check runs on a lent GPU once, unattended, with no way to fix it there: this runs the
same command with `--dry-run` (tiny shapes, kernels in Mosaic GPU's interpreter) and checks
that every section and every native kernel left results in the out folder, that nothing
raised, that the numerics passed their bounds, and that the summary table came last.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("1 numerics", "2 GEMMs (dense)", "2 GEMMs (grouped)", "3 train steps")
#: Every native kernel, by a word of the numerics items that exercise it directly.
KERNELS = ("block_gemm", "fused residual", "grouped rows", "grouped tokens")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as on the command line
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)]
        + ["--budget-s", "800"],  # a slow machine must not skip
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return done, out, results


def test_dry_run_exits_cleanly_with_nothing_raised(dry_run):
    done, _, results = dry_run
    bad = [r for r in results if r["status"] in ("error", "failed")]
    assert not bad, json.dumps(bad, indent=1)[:6000]
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_section_ran_within_the_budget(dry_run):
    _, out, results = dry_run
    timed = {r["section"] for r in results if r["name"] == "(section)" and "section_seconds" in r}
    assert timed == set(SECTIONS)
    # Only JAX's own grouped kernels, which take no interpreter option, may be skipped.
    skipped = [r for r in results if r["status"] == "skipped"]
    assert all("GPU only" in r["skipped"] for r in skipped), skipped
    for section in SECTIONS[1:]:
        measured = [r for r in results if r["section"] == section and "ms" in r]
        assert measured, section
    for name in ("environment.json", "log.txt", "summary.txt", "decisions.txt"):
        assert (out / name).stat().st_size > 0, name


def test_every_kernel_met_its_numerics_bound(dry_run):
    _, _, results = dry_run
    numerics = [r for r in results if r["section"] == "1 numerics" and r["name"] != "(section)"]
    for kernel in KERNELS:
        checked = [r for r in numerics if kernel in r["name"]]
        assert checked, kernel
        assert all(r["passed"] and r["status"] == "ok" for r in checked), checked
    compared = [r for r in numerics if r["rel_err_vs_f64"] is not None]
    assert compared and all(r["rel_err_vs_f64"] < 1e-5 for r in compared), compared
    assert any(r["rel_err_vs_xla"] is not None for r in numerics)


def test_train_steps_carry_the_cost_models_estimate(dry_run):
    _, _, results = dry_run
    steps = [r for r in results if r["section"] == "3 train steps" and "ms" in r]
    assert {r["name"].split(" | ")[0] for r in steps} == {
        "MLP (peers.py)",
        "1B GPT block (cost_model.py)",
        "MoE layer (moe_cost.py mixtral)",
    }
    assert all(r["estimate_ms"] > 0 for r in steps)
    assert any("estimate_vs_bf16" in r for r in steps)


def test_summary_tables_printed_last(dry_run):
    done, out, _ = dry_run
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("# fp8jax GPU check (dry)")
    assert "device: cpu" in done.stdout and "jaxlib: " in done.stdout
    assert "## Decision inputs" in done.stdout and "DRY RUN" in done.stdout
    for section in SECTIONS:
        assert f"## {section}: " in done.stdout, section
    last = lines[lines.index(next(x for x in lines if x.startswith("| section"))) :]
    assert all(line.startswith("|") for line in last)
    assert [row.split("|")[1].strip() for row in last[2:]] == list(SECTIONS)
    assert (out / "summary.txt").read_text().strip().endswith(lines[-1])


@pytest.fixture
def check_modules(monkeypatch):
    """`gpu_check.main` and `gpu_check.steps`, imported as the command line does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import main, steps

    return main, steps


def test_every_variant_of_every_mode_builds(check_modules):
    """The GPU run's variants (full and quick too, not only the dry run's) build at the dry
    run's shapes: an H200 run once lost its MoE residual step to a recipe without a grouped
    GEMM."""
    _, steps = check_modules
    for model, (builder, by_mode) in steps.MODELS.items():
        _, args, _ = builder("dry")
        for name in dict.fromkeys(n for variants in by_mode.values() for n in variants):
            assert args(name), (model, name)


def test_sections_option_picks_and_checks_sections(check_modules, tmp_path):
    main, _ = check_modules
    assert main.parse(["--out", str(tmp_path)]).sections == list(main.SECTIONS)
    assert main.parse(["--out", str(tmp_path), "--sections", "steps, numerics"]).sections == [
        "steps",
        "numerics",
    ]
    for bad in ("steps,gemm", ","):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--sections", bad])

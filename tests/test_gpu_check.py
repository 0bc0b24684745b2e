"""`benchmarks/gpu_check`'s dry run: the device check's own code, end to end on the CPU.

The check runs on a lent GPU once, unattended, with no way to fix it there: this runs the
same command with `--dry-run` (tiny shapes, kernels in Mosaic GPU's interpreter) and checks
that every section and every native kernel left results in the out folder, that nothing
raised, that the numerics passed their bounds, and that the summary table came last.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_flags

from fp8jax._src.core.mosaic_private import interpreter_runs_gpu_path
from fp8jax._src.kernels import block_quantize, quantize_config

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "1 numerics",
    "2 GEMMs (dense)",
    "2c block kernels (persistent)",
    "2d quantization kernels",
    "2e cast and transpose",
    "2f blockwise quantization kernels",
    "2 GEMMs (grouped)",
    "3b MoE layer",
    "3 train steps",
    "4 Llama block",
    "5 profile",
)
#: Every native kernel, by a word of the numerics items that exercise it directly.
KERNELS = ("block_gemm", "fused residual", "grouped rows", "grouped tokens", "quantization kernels")


@pytest.fixture(autouse=True)
def _no_out(monkeypatch):
    """`$OUT` unset (a device machine sets it; the check refuses an `--out` outside it): the
    tests that need it set it."""
    monkeypatch.delenv("OUT", raising=False)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("OUT", None)  # as `_no_out`
    # One CPU device, as on the command line; conftest's compile options kept (compile time).
    env["XLA_FLAGS"] = compile_flags()
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
    # Only JAX's own grouped kernels, which take no interpreter option, may be skipped, and
    # the persistent block kernel and the tensor-core transpose where the interpreter cannot
    # run them (JAX 0.10; gpu_check.transpose.REFUSED).
    skipped = [r for r in results if r["status"] == "skipped"]
    refused = (
        "interpreter cannot run the persistent kernel",
        "interpreter cannot run wgmma on a transposed view",
    )
    allowed = ("GPU only",) + (() if interpreter_runs_gpu_path() else refused)
    assert all(any(a in r["skipped"] for a in allowed) for r in skipped), skipped
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


def test_quantization_kernels_equal_an_ieee_reference(dry_run):
    _, _, results = dry_run
    # The per-tensor and blockwise passes three ways (sections 2e, 2f): the kernels' copies
    # as NumPy's (an output gradient's, a weight's, a saved activation's).
    section = [r for r in results if r["section"].startswith(("2e ", "2f "))]
    numerics = [r for r in section if r["name"].startswith("numerics")]
    assert numerics and all(r["status"] == "ok" and r["passed"] for r in numerics), numerics
    checked = set().union(*(r["elements_differing"] for r in numerics))
    kinds = ("", "blockwise ", "blockwise weight ", "blockwise requantized ", "blockwise rows ")
    kinds += (
        "blockwise experts' weights ",
        "blockwise gathered ",
        "blockwise gathered requantized ",
        "blockwise rows+gathered ",
    )
    assert {f"{kind}triton, default" for kind in kinds} <= checked, checked
    timed = {r["name"].split(" | ")[1] for r in section if "ms" in r}
    assert {f"{kind}{way}" for kind in kinds for way in ("xla", "triton, default")} <= timed
    section = [r for r in results if r["section"] == "2d quantization kernels"]
    numerics = [r for r in section if r["name"].startswith("numerics")]
    assert numerics and all(r["status"] == "ok" and r["passed"] for r in numerics), numerics
    timed = {r["name"].split(" | ")[1] for r in section if "gb_per_s" in r}
    want = {"kernels: rows+columns", "xla: rows+columns", "kernels: weight + dgrad copy"}
    gathered = {f"{p}: {c}" for p in ("kernels", "xla") for c in ("gathered columns", "rows")}
    gathered |= {f"{p}: rows+gathered columns" for p in ("kernels", "xla")}
    assert want | gathered <= timed
    swept = {name.split(" kernel alone")[0] for name in timed if name.startswith("sweep: ")}
    assert swept == {
        f"sweep: {k}"
        for k in (
            "rows+columns",
            "rows",
            "requantize",
            "weight",
            "gathered columns",
            "gathered requantize",
            "rows+gathered columns",
            "per-tensor cast",
        )
    }
    assert {f"{p}: per-tensor cast+transpose+amax" for p in ("kernels", "xla")} <= timed
    checked = {"padded columns", "rows and padded columns", "rows and columns, 32-row slabs"}
    checked |= {"rows and padded columns, 16-row slabs", "per-tensor cast, 16-row slabs"}
    checked |= {"weight blocks", "weight blocks, 32-row slabs"}
    assert all(set(r["kernel_elements_differing_from_ieee"]) >= checked for r in numerics)


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


def test_llama_block_timed_against_bf16_with_its_compiled_split(dry_run):
    _, _, results = dry_run
    llama = {r["name"]: r for r in results if r["section"] == "4 Llama block" and "ms" in r}
    assert set(llama) == {"dry | bf16 | xla", "dry | delayed | xla"}
    bf16, delayed = llama["dry | bf16 | xla"], llama["dry | delayed | xla"]
    for r in (bf16, delayed):
        assert r["attention"] == "xla" and r["ms"] > 0 and r["temp_bytes"] > 0
        assert r["kernels"] == sum(r["kernels_by_kind"].values()) > 0
    assert delayed["vs_bf16"] == pytest.approx(delayed["ms"] / bf16["ms"])
    assert bf16["ms_pipelined"] > 0 and delayed["ms_pipelined"] > 0
    assert delayed["vs_bf16_pipelined"] == pytest.approx(
        delayed["ms_pipelined"] / bf16["ms_pipelined"]
    )
    assert delayed["kernels_vs_bf16"] == pytest.approx(delayed["kernels"] / bf16["kernels"])
    assert "vs_bf16" not in bf16
    probe = next(r for r in results if r["name"] == "host dispatch")
    assert probe["status"] == "ok"
    assert all(probe[f"us_{n}"] > 0 and probe[f"us_{n}_pipelined"] > 0 for n in (10, 74, 200))


def test_llama_decisions_compare_each_candidate_with_its_default(check_modules, tmp_path):
    """`llama.decide`: a candidate variant's time against its default's of the same size and
    attention (one at a time and pipelined); nothing where either did not run or their
    attentions differ."""
    from gpu_check import llama
    from gpu_check.record import Recorder

    rec = Recorder(tmp_path, 100.0, 0.0, dry=True)
    step = lambda ms, piped, attention="cudnn": dict(  # noqa: E731
        ms=ms, ms_pipelined=piped, attention=attention
    )
    llama.decide(
        rec,
        {
            "8B": {"delayed-steady": step(12.0, 10.0), "delayed-steady-apart": step(10.0, 8.0)},
            "1B": {"current": step(6.0, 5.0), "current-apart": step(5.0, 4.0, "xla")},
        },
    )
    assert rec.decisions == [
        "Llama 8B block: delayed-steady / delayed-steady-apart: time ratio 1.200, "
        "pipelined 1.250 (> 1: the second is faster)"
    ]


def test_profile_without_a_gpu_says_so_and_checks_the_reading_on_the_cpu(dry_run):
    """On the CPU the trace has no device plane: each variant is skipped, saying so, and the
    same analysis over XLA:CPU's thunks splits the two traced steps at their annotations,
    each thunk found among the compiled step's kernels by its HLO instruction."""
    done, out, results = dry_run
    traced = {r["name"]: r for r in results if r["section"] == "5 profile" and "ms" in r}
    assert set(traced) == {"dry | bf16", "dry | delayed"}
    kernels = json.loads((out / "profile_kernels.json").read_text())
    assert set(kernels) == {"dry bf16", "dry delayed"}
    for name, r in traced.items():
        assert r["status"] == "skipped" and "no GPU device plane" in r["skipped"]
        assert "/device:GPU:0" not in r["planes"] and "/host:CPU" in r["planes"]
        assert r["marks"] == 2 and len(r["wall_ms"]) == 2
        stand_in = kernels[name.replace(" | ", " ")]["cpu_stand_in"]
        assert stand_in["steps_split_by"] == "step annotations"
        assert stand_in["events_outside_steps"] == 0
        counts = [step["kernels"] for step in stand_in["per_step"]]
        assert len(counts) == 2 and counts[0] == counts[1] > 0
        assert all(step["matched"] == {"hlo_op": step["kernels"]} for step in stand_in["per_step"])
        assert stand_in["top"] and stand_in["top"][0]["total_us"] >= stand_in["top"][-1]["total_us"]
    assert "no GPU device plane" in done.stdout


@pytest.fixture
def check_modules(monkeypatch):
    """`gpu_check.main` and `gpu_check.steps`, imported as the command line does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import main, steps

    return main, steps


@pytest.fixture
def profile(monkeypatch):
    """`gpu_check.profile`, imported as the command line does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import profile

    return profile


def test_every_variant_of_every_mode_builds(check_modules):
    """The GPU run's variants (full and quick too, not only the dry run's) build at the dry
    run's shapes: an H200 run once lost its MoE residual step to a recipe without a grouped
    GEMM."""
    _, steps = check_modules
    for model, (builder, by_mode) in steps.MODELS.items():
        _, args, _ = builder("dry")
        for name in dict.fromkeys(n for variants in by_mode.values() for n in variants):
            assert args(name), (model, name)


def test_every_moe_variant_of_every_mode_builds(monkeypatch):
    """The MoE section's variants, all modes', build at the dry run's shape (which times BF16
    alone), their experts' GEMMs where each variant says."""
    import jax

    import fp8jax

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import moe
    from moe_cost import JaxGroupedBF16

    for name in dict.fromkeys(n for names in moe.VARIANTS.values() for n in names):
        layer, x = moe.arguments(moe.shape("dry"), name)
        gemm = type(layer.up.ragged_dot)
        want = {"bf16": type(None), "bf16 jax mgpu": JaxGroupedBF16}.get(name, fp8jax.Fp8RaggedDot)
        assert gemm is want and type(layer.down.ragged_dot) is want, (name, gemm)
        assert x.dtype == layer.up.weight.dtype == jax.numpy.bfloat16
    with pytest.raises(ValueError, match="'nope'"):
        moe.arguments(moe.shape("dry"), "nope")


def test_moe_variants_trace_inside_their_kernel_choice(monkeypatch):
    """The MoE section's contexts: `blockwise-tiled` takes the tiled grouped kernel,
    `blockwise-tile-scales` the weights' scales per block, `blockwise-chained` the persistent
    rows kernel with its programs' tiles chained, `blockwise-tc` the Mosaic GPU quantization
    kernels and the default GEMMs (a grouped rows GEMM traced inside each, as on a GPU, the
    kernels spied on)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import moe

    from fp8jax._src.kernels import choice
    from fp8jax._src.kernels.grouped_gemm import row_items

    seen = []
    monkeypatch.setattr(choice, "on_gpu", lambda: True)
    monkeypatch.setattr(choice, "grouped_rows_gemm", lambda *a, **k: seen.append("tiled"))
    monkeypatch.setattr(
        choice, "persistent_grouped_rows_gemm", lambda *a, config, **k: seen.append(config)
    )
    a, w = jnp.zeros((256, 256), jnp.float8_e4m3fn), jnp.zeros((2, 128, 256), jnp.float8_e4m3fn)
    items = row_items(jnp.array([100, 156], jnp.int32), 256)
    for name in ("blockwise-tiled", "blockwise-tile-scales", "blockwise-chained"):
        with moe.CONTEXTS[name]():
            choice.recipe_grouped_rows_gemm(a, w, items, item_scale=jnp.ones(items.tile.shape))
            seen.append(choice.weight_block_scales_chosen())
    default, chained = seen[2], seen[4]
    assert seen[:2] == ["tiled", False] and seen[3] is True and seen[5] is False
    assert not default.chained and chained == dataclasses.replace(default, chained=True)
    assert set(moe.CONTEXTS) <= set(moe.RECIPES)
    # `blockwise-slabs`: the quantization kernels in slabs, the GEMMs as `blockwise`'s.
    with moe.CONTEXTS["blockwise-slabs"]():
        assert quantize_config.resolved(block_quantize.DEFAULT_TUNING).slab_rows == 32
        choice.recipe_grouped_rows_gemm(a, w, items, item_scale=jnp.ones(items.tile.shape))
    assert seen[-1] == default
    # `blockwise-tc`: the quantization on the Mosaic GPU kernels, the GEMMs as `blockwise`'s.
    with moe.CONTEXTS["blockwise-tc"]():
        assert choice.tensor_core_quantization_chosen()
        choice.recipe_grouped_rows_gemm(a, w, items, item_scale=jnp.ones(items.tile.shape))
    assert seen[-1] == default and not choice.tensor_core_quantization_chosen()


def test_jax_grouped_bf16_computes_the_moe_step_as_lax_ragged_dot(monkeypatch):
    """The MoE section's yardstick, `moe_cost.JaxGroupedBF16` (JAX's Pallas grouped kernels
    behind a custom VJP), run in Mosaic GPU's interpreter: the MoE layer's loss and every
    gradient (layer and input) as `lax.ragged_dot`'s within the section's bound, the experts'
    weight gradients nonzero (a dgrad or wgrad wired to the wrong operand fails it)."""
    if not interpreter_runs_gpu_path():
        pytest.skip("this JAX's Mosaic GPU interpreter cannot run wgmma (JAX 0.11 on can)")
    import equinox as eqx
    import numpy as np
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from fp8jax._src.core.mosaic_private import interpret_params

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import moe_cost
    from gpu_check import moe

    interpreted = functools.partial(plgpu.kernel, interpret=interpret_params())
    monkeypatch.setattr(plgpu, "kernel", interpreted)
    s = moe.shape("dry")
    four_sms = type("Device", (), {"core_count": 4})()  # the wgrad kernel's grid
    with moe_cost.sms_of(four_sms):
        outs = {
            name: eqx.filter_jit(moe.step(name))(*moe.arguments(s, name))
            for name in ("bf16", "bf16 jax mgpu")
        }
    error = moe.mismatch(outs["bf16 jax mgpu"], outs["bf16"])
    assert error <= moe.MATCH_BOUND, error
    (_, (grads, _)) = outs["bf16 jax mgpu"]
    for w in (grads.up.weight, grads.down.weight):
        assert np.count_nonzero(np.asarray(w, np.float32)) > w.size // 2
    # The comparison itself can fail: the same step against another input's.
    layer, x = moe.arguments(s, "bf16")
    other = eqx.filter_jit(moe.step("bf16"))(layer, -x)
    assert moe.mismatch(other, outs["bf16"]) > moe.MATCH_BOUND


def test_moe_cost_counts_jax_kernels_as_the_experts_bf16_gemms(monkeypatch):
    """moe_cost.py's BF16 yardstick compiles for an H100 without one (JAX's wgrad kernel given
    the topology's SM count) and its six JAX kernels (forward, dgrad and wgrad of both
    layers), opaque Mosaic GPU calls to `hlo_cost`, count as BF16 GEMMs of the experts' own
    FLOPs, their bytes out of the non-GEMM bytes."""
    pytest.importorskip("jax_cuda12_plugin")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import moe_cost

    import fp8jax

    shape = {"tokens": 128, "width": 128, "hidden": 256, "experts": 2, "top_k": 2}
    cost, _, _ = moe_cost.compile_cost(shape, moe_cost.JAX_VARIANT)
    ours = moe_cost.jax_kernels(cost)
    assert len(ours) == 6 and all(k.category is not None for k in ours)
    raw = fp8jax.Cost(
        kernels=cost.kernels,
        bytes={"rest": sum(k.bytes * k.runs for k in cost.kernels if k.category)},
    )
    moved = moe_cost.as_gemms(raw, 1000)
    assert moved.flops == {"bf16": 6000}
    assert moved.total_bytes == raw.total_bytes - sum(k.bytes * k.runs for k in ours) > 0
    # The step's BF16 FLOPs: the experts' (added) and the router's GEMMs (XLA's, counted).
    router = sum(k.flops * k.runs for k in cost.kernels if k.category is None)
    assert 0 < router < cost.flops["bf16"] - router == moe_cost.experts_flops(shape)
    with pytest.raises(ValueError, match="no kernel under"):
        moe_cost.as_gemms(fp8jax.Cost(), 1)


def test_sections_option_picks_and_checks_sections(check_modules, tmp_path):
    main, _ = check_modules
    assert main.parse(["--out", str(tmp_path)]).sections == list(main.SECTIONS)
    assert main.parse(["--out", str(tmp_path), "--sections", "steps, numerics"]).sections == [
        "steps",
        "numerics",
    ]
    for bad in ("steps,gemm", ",", "steps,steps", "profile,llama"):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--sections", bad])
    # Variants of a section not run were accepted and ignored; they are refused.
    for sections, variants in (
        ("moe", ["--llama-variants", "bf16"]),
        ("llama", ["--moe-variants", "bf16"]),
    ):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--sections", sections, *variants])
    assert main.parse(["--out", str(tmp_path), "--sections", "profile", "--llama-variants", "bf16"])


def test_a_command_line_it_cannot_run_is_refused_before_anything_is_written(
    check_modules, tmp_path
):
    """`--budget-s 0` ran with the mode's default budget (the supervisor read 0 as not
    given), an `--out` naming a file raised FileExistsError from the supervisor, and every
    refused command line left an out folder whose log blamed a death outside a measurement."""
    main, _ = check_modules
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    with pytest.raises(SystemExit):
        main.parse(["--out", str(a_file)])
    for budget in ("0", "-5", "nan", "inf"):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--budget-s", budget])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"]
    out = tmp_path / "out"
    for args, said in (
        (["--out", str(a_file)], f"--out={str(a_file)!r} is a file"),
        (["--out", str(out), "--budget-s", "0"], "--budget-s=0.0: should be a positive"),
        (["--out", str(out), "--sections", "numerik"], "unknown ['numerik']; should name"),
        (["--out", str(out), "--quick"], "not allowed with argument --dry-run"),
    ):
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, env=env, cwd=ROOT, check=False
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
        assert "supervisor" not in done.stderr and not out.exists(), done.stderr[-2000:]


def test_the_supervisor_refuses_a_command_line_before_starting_the_check(
    tmp_path, monkeypatch, capsys
):
    """A typo'd section, a misordered one, a stray flag: refused by the supervisor (no JAX),
    not by its child after JAX's import (2 s of a lease on a CPU, more on a GPU)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import supervise

    def started(*args, **kwargs):
        raise AssertionError(f"a child was started: {args}")

    monkeypatch.setattr(supervise.subprocess, "Popen", started)
    monkeypatch.setattr(supervise.subprocess, "call", started)
    out, a_file = tmp_path / "out", tmp_path / "a_file"
    a_file.write_text("")
    for bad, said in (
        (["--sections", "numerik"], "unknown ['numerik']"),
        (["--sections", "profile,llama"], "profile before llama"),
        (["--sections", "gemms", "--moe-variants", "bf16"], "--moe-variants='bf16' is for"),
        (["--hang-s", "-1"], "--hang-s=-1.0"),
        (["--sections", "moe", "--moe-variants", "bf16,blockwize"], "unknown ['blockwize']"),
        # Was refused by the child, after JAX's import.
        (["--llama-variants", "bf16,blockwize"], "unknown ['blockwize']; should name some of"),
        (["--llama-variants", "delayed-fresh-packed"], "or both appended, in that order"),
        (["--hang-s", "inf"], "--hang-s=inf: should be a positive"),  # was OverflowError
        # Was accepted: no bound on the time, the call's `timeout` the only end.
        (["--budget-s", "inf"], "--budget-s=inf: should be a positive, finite number"),
        (["--budget-s=-inf"], "--budget-s=-inf: should be a positive, finite number"),
        (["--budget-s", "nan"], "--budget-s=nan: should be a positive, finite number"),
        (["--lease"], "unrecognized arguments: --lease"),
        (["--out", str(a_file / "out")], f"is under {str(a_file)!r}, a file"),
        (["--out", ""], "argument --out: '': empty"),
    ):
        assert supervise.main(["--out", str(out), "--dry-run", *bad]) == 2, bad
        assert said in capsys.readouterr().err, bad
        assert not out.exists()


def test_a_hang_that_spends_the_budget_still_leaves_the_summary(tmp_path, monkeypatch):
    """A measurement killed as hung after the budget ran out: the supervisor returned 2 at
    once, and the check's summary (written by a resumed process) never came; the check is
    started again resumed, with a budget under any reserve (it measures nothing)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import supervise

    calls = []

    def run(command, hang_s, tail):
        calls.append(command)
        if len(calls) == 1:  # hung in a measurement, the budget spent meanwhile
            return -9, "2 GEMMs (dense) | dry | bf16", True
        (tmp_path / "summary.txt").write_text("the summary\n")
        return 1, None, False  # the resumed check: its summary written, the crash an error

    monkeypatch.setattr(supervise, "_run", run)
    assert supervise.supervise(["--out", str(tmp_path)], tmp_path, 1e-9, 6.0) == 1
    assert len(calls) == 2 and calls[1][-1] == "--resume", calls
    budget = float(calls[1][calls[1].index("--budget-s") + 1])
    assert 0 < budget < min(reserve for *_, reserve in supervise.MODES.values() if reserve)
    entry = json.loads((tmp_path / "results.jsonl").read_text())
    assert entry["crashed"] and entry["name"] == "dry | bf16"


def test_a_checks_summary_names_what_would_not_come_back_from_out(tmp_path, monkeypatch):
    """`$OUT` holding a file the device tool leaves out (over one file's limit, 16 MiB, and
    not the check's own to trim): nothing said so; the summary ends naming it (tiny limits
    here)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import returned, supervise

    def run(command, hang_s, tail):
        (out / "summary.txt").write_text("the summary\n")
        (tmp_path / "other.json").write_text("x" * 200)
        return 0, None, False

    out = tmp_path / "check"
    out.mkdir()
    monkeypatch.setattr(supervise, "_run", run)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 100)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert supervise.supervise(["--out", str(out)], out, 10.0, None) == 0
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("the summary\n\n## What the device tool will not bring back")
    assert "- other.json: 0.00 MiB, over 0.00 MiB a file" in summary, summary
    monkeypatch.delenv("OUT")  # outside $OUT (a lease's part, a dry run): not judged
    assert supervise.supervise(["--out", str(out)], out, 10.0, None) == 0
    assert (out / "summary.txt").read_text() == "the summary\n"


def test_a_checks_file_over_what_comes_back_is_trimmed_keeping_its_head_and_tail(
    tmp_path, monkeypatch
):
    """`--out $OUT/check` whose results.jsonl grew over one file's limit (16 MiB) came back
    not at all, only named in the summary; its middle is now cut (a marked line), its first
    and last lines kept, and the summary says so. The files over the total (64 MiB) are cut
    too, the largest first. Tiny limits stand for the device tool's."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import returned, supervise

    lines = [json.dumps({"section": "s", "name": f"m{i}", "status": "ok"}) for i in range(400)]

    def run(command, hang_s, tail):
        (out / "summary.txt").write_text("the summary\n")
        (out / "results.jsonl").write_text("\n".join(lines) + "\n")  # about 20 kB
        (out / "log.txt").write_text("log line\n" * 800)  # 7.2 kB
        return 0, None, False

    out = tmp_path / "check"
    out.mkdir()
    monkeypatch.setattr(supervise, "_run", run)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 10_000)
    monkeypatch.setattr(returned, "MAX_TOTAL_BYTES", 20_000)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert supervise.supervise(["--out", str(out)], out, 10.0, None) == 0
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    assert max(sizes.values()) <= 10_000 and sum(sizes.values()) <= 20_000, sizes
    assert returned.problems(tmp_path) == []  # everything comes back
    kept = (out / "results.jsonl").read_text().splitlines()
    assert kept[0] == lines[0] and kept[-1] == lines[-1], (kept[0], kept[-1])
    entries = supervise.read_results(out / "results.jsonl")  # the mark is no entry
    assert [e["name"] for e in entries] == [json.loads(k)["name"] for k in kept if k in lines]
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("the summary\n\n## Trimmed to come back from $OUT"), summary
    assert "- check/results.jsonl: 0.02 MiB, its middle cut to" in summary, summary
    assert "to fit 0.02 MiB in all (marked)" in summary, summary  # the largest, cut again
    assert "What the device tool will not bring back" not in summary


def test_a_check_into_out_itself_trims_its_own_files_only(tmp_path, monkeypatch):
    """`--out $OUT` beside an archive an earlier command of the call packed there: the files
    over the total were cut largest first, the archive among them (cut, it would not open);
    now only the check's own text files are cut, the archive kept byte for byte."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import returned, supervise

    archive = os.urandom(10_000)  # at one file's limit: the largest, once results are cut
    (tmp_path / "run_block.tar.gz").write_bytes(archive)

    def run(command, hang_s, tail):
        (tmp_path / "summary.txt").write_text("the summary\n")
        (tmp_path / "results.jsonl").write_text("".join(f"line {i}\n" for i in range(3_000)))
        return 0, None, False

    monkeypatch.setattr(supervise, "_run", run)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 10_000)
    monkeypatch.setattr(returned, "MAX_TOTAL_BYTES", 20_000)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert supervise.supervise(["--out", str(tmp_path)], tmp_path, 10.0, None) == 0
    assert (tmp_path / "run_block.tar.gz").read_bytes() == archive
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert sum(sizes.values()) <= 20_000, sizes
    kept = (tmp_path / "results.jsonl").read_text().splitlines()
    assert kept[0] == "line 0" and kept[-1] == "line 2999", kept


FAKE_CHILD = """
import json, os, signal, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
out.mkdir(exist_ok=True)
with open(out / "calls.txt", "a") as f:
    f.write(" ".join(args) + "\\n")
if "--resume" not in args:  # the first process records a result; a resumed one takes it back
    (out / "results.jsonl").write_text(json.dumps({"section": "s", "name": "m", "status": "ok"}))
elif os.environ["FAKE_CHILD"] == "once":
    (out / "summary.txt").write_text("the check's summary")
    sys.exit(0)
print("compiling the next section's step", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # outside any measurement, as the OOM killer would
"""


@pytest.mark.parametrize("deaths", ["once", "always"])
def test_a_death_outside_any_measurement_still_leaves_a_summary(tmp_path, monkeypatch, deaths):
    """A check killed outside any measurement (the OOM killer compiling a section's step)
    ended the supervisor with no summary, and an earlier run's summary.txt left in place
    passed for this run's; it is started again once (resumed: what it had recorded comes
    back), and where it dies again without recording anything, the supervisor writes an
    INCOMPLETE summary: why, the results by section, the check's last lines."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, record, supervise

    (tmp_path / "child.py").write_text(FAKE_CHILD)
    monkeypatch.setattr(supervise, "SCRIPT", tmp_path / "child.py")
    monkeypatch.setenv("FAKE_CHILD", deaths)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.txt").write_text("an earlier run's summary")
    code = supervise.supervise(["--out", str(out), "--dry-run"], out, 10.0, None)
    calls = (out / "calls.txt").read_text().splitlines()
    assert ["--resume" in c for c in calls] == [False, True], calls  # started again once
    summary = (out / "summary.txt").read_text()
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert results[0] == {"section": "s", "name": "m", "status": "ok"}  # kept, not cleared
    if deaths == "once":
        assert code == 0 and summary == "the check's summary" and record.whole(out)
        return
    assert code == 2 and not record.whole(out) and summary.startswith(record.INCOMPLETE)
    assert "killed by SIGKILL" in summary.splitlines()[0], summary
    assert [e["section"] for e in results] == ["s", "(check)", "(check)"], results
    assert "- s: 1 ok, 0 failed, 0 error, 0 skipped" in summary, summary
    assert "- (check): 0 ok, 0 failed, 2 error, 0 skipped" in summary, summary
    assert summary.rstrip().endswith("compiling the next section's step"), summary
    assert lease.whole is record.whole  # the lease runs such a part again on a second call
    # A check resumed after such deaths counts them in its own summary.
    assert record.Recorder(out, 10.0, 0.0, True, resume=True).sections["(check)"]["error"] == 2


def test_a_crash_or_hang_costs_its_measurement_not_the_call(tmp_path):
    """The check as a lent GPU runs it (`gpu_check.py`, supervised): a measurement whose
    process dies, and one that hangs past `--hang-s`, are recorded as crashed and the check
    starts again (`--resume`), taking back what it had measured without running it again
    and measuring the rest; the summary comes once the last process ends. The faults are
    injected into a dry run's GEMMs section (`record.FAULT_VARIABLE`)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = compile_flags()
    env["FP8JAX_GPU_CHECK_FAULT"] = "die:| fp8 cuBLASLt;hang:| block kernel"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"]
    command += ["--out", str(out), "--sections", "gemms", "--hang-s", "6"]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False
    )
    assert done.returncode == 1, done.stderr[-3000:]  # errors were recorded
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_name = {}
    for entry in results:
        by_name.setdefault(entry["name"].split(" | ")[-1], []).append(entry)
    for name in ("fp8 cuBLASLt", "block kernel"):
        (entry,) = by_name[name]  # recorded once, by the supervisor, never run again
        assert entry["status"] == "error" and entry["crashed"], entry
    assert "died" in by_name["fp8 cuBLASLt"][0]["error"]
    assert "hung" in by_name["block kernel"][0]["error"]
    # Measured once each, before or after the crashes: nothing lost, nothing run twice.
    for name in ("bf16", "fp8 XLA default", "blockwise XLA", "residual fused"):
        assert [e["status"] for e in by_name[name]] == ["ok"], by_name[name]
    assert done.stderr.count("starting the check again") == 2
    summary = done.stdout[done.stdout.rindex("## 2 GEMMs (dense)") :]
    assert summary.count("ERROR") == 2 and "5 ok" not in summary, summary
    assert "(6 ok, 0 failed, 2 error, 0 skipped;" in summary  # the section's line is an ok


def test_a_resumed_check_takes_back_its_results_and_skips_a_crashed_kernel(tmp_path, monkeypatch):
    """`Recorder(resume=True)`: a recorded measurement returns its fields again (non-finite
    floats as floats) without running; what shares a crashed one's kernel is skipped
    elsewhere (a Llama variant at another size and in the profile, every configuration of a
    tensor-core way, the per-tensor tensor-core kernel alone and in the Llama steps, a block
    kernel feature in any configuration and in its Llama variant); the rest runs. An error
    that leaves the GPU unusable is recorded as crashed and ends the process."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import record

    def shared(a: str, b: str) -> bool:
        return bool(record.families(a) & record.families(b))

    assert shared("8B | blockwise-tc | cudnn", "1B | blockwise-tc")
    assert shared(
        "gradient 8192x14336 | blockwise rows tensor cores, stages 2",
        "weight 14336x4096 | blockwise rows tensor cores, stages 4, programs 66",
    )
    assert not shared("x | blockwise rows tensor cores, a", "x | blockwise tensor cores, a")
    assert shared("activation | tensor cores, stages 2", "8B | delayed-steady-apart-tc-grads")
    assert shared("8B | current-tc | cudnn", "1B | delayed-steady-tc | cudnn")
    assert not shared("8B | current-tc | cudnn", "8B | blockwise-tc | cudnn")
    assert not shared("8B | current-tc | cudnn", "8B | current | cudnn")
    up2, chained = "up | persistent chunks_per_step=2", "up | persistent chained=True"
    assert shared(up2, "dsv3 | persistent grid_minor_dim=m, chunks_per_step=2")
    assert shared(up2, "8B | blockwise-pairs | cudnn") and not shared(up2, chained)
    assert shared(chained, "1B | blockwise-chained") and not shared(chained, "1B | blockwise")
    assert shared("up | persistent compute_wgs=3", "8B | blockwise-tile-scales-three | xla")
    assert not shared("up | persistent default", "up | persistent grid_tile_width=4")
    # The numerics measurements of sections 1, 2c and 2e name what they run.
    assert shared("numerics (7, 1, 9, 2), (1, 1) | persistent chunks_per_step=2", up2)
    assert shared("grouped layer, blockwise, chained persistent kernels", "8B | blockwise-chained")
    assert shared("numerics activation | tensor cores, default", "8B | current-tc | cudnn")
    assert not shared("numerics activation", "8B | current-tc | cudnn")
    entries = [
        dict(section="4 Llama block", name="8B | bf16 | cudnn", status="ok", ms=2.0, x="nan"),
        dict(section="4 Llama block", name="8B | blockwise-tc | cudnn", status="error",
             error="died", crashed=True),
        dict(section="2f", name="activation | blockwise rows tensor cores, stages 2",
             status="error", error="hung", crashed=True),
    ]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    rec = record.Recorder(tmp_path, 100.0, 0.0, dry=True, resume=True)
    never = lambda: pytest.fail("a recorded measurement ran again")  # noqa: E731
    fields = rec.measure("4 Llama block", "8B | bf16 | cudnn", never)
    assert fields["ms"] == 2.0 and np.isnan(fields["x"]), fields
    assert rec.measure("4 Llama block", "8B | blockwise-tc | cudnn", never) is None
    for section, name in (
        ("4 Llama block", "1B | blockwise-tc | cudnn"),
        ("5 profile", "8B | blockwise-tc"),
        ("2f", "gradient | blockwise rows tensor cores, stages 4"),
    ):
        assert rec.measure(section, name, never) is None
    assert rec.measure("4 Llama block", "1B | blockwise | cudnn", lambda: {"ms": 3.0}) == {
        "ms": 3.0
    }
    assert rec.counts == {"ok": 2, "failed": 0, "error": 1, "skipped": 3}
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    skipped = [json.loads(line) for line in lines[len(entries) :]][:3]
    assert all("crashed or hung in" in e["reason"] for e in skipped), skipped

    class Ended(Exception):
        pass

    def end(status):
        raise Ended(status)

    monkeypatch.setattr(record.os, "_exit", end)
    monkeypatch.setenv(record.FAULT_VARIABLE, "broken:| cuBLASLt")
    with pytest.raises(Ended, match=str(record.BROKEN)):
        rec.measure("2 GEMMs (dense)", "up | cuBLASLt", lambda: {"ms": 1.0})
    last = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert last["status"] == "error" and last["crashed"], last


def test_a_lease_runs_its_parts_inside_one_deadline(tmp_path, monkeypatch):
    """`gpu_check.py --lease` (`lease.py`), as a lent GPU runs it, on dry runs of the GEMMs
    section: the parts run in order, each packed into one archive; a crash in one is not run
    again in the next (carried, `--resume`d); a part that hangs is stopped at the deadline,
    packed with what it measured, and the parts after it are not started; a second call
    names the parts left, resumes the cut one on what it had measured and runs the rest."""
    import tarfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    gemms = ("--sections", "gemms")
    monkeypatch.setattr(
        lease, "PARTS", {n: lease.Part(n, gemms, 100) for n in ("first", "second", "third")}
    )
    for name, value in (("MIN_S", 4.0), ("PACK_S", 2.0), ("OVERHEAD_S", 2.0)):
        monkeypatch.setattr(lease, name, value)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", compile_flags())
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--out", str(out), "--work", str(work), "--dry-run", "--label", "run"]

    def results(part: str) -> list[dict]:
        lines = (work / f"run_{part}" / "results.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    # The first part's process dies in "fp8 cuBLASLt"; the second hangs in "block kernel"
    # (no --hang-s: only the deadline stops it); the third gets no time.
    faults = "die:| fp8 cuBLASLt;hang:run_second: 2 GEMMs (dense) | dry 128->128, 64 tokens | block"
    monkeypatch.setenv("FP8JAX_GPU_CHECK_FAULT", faults)
    assert lease.main([*common, "--deadline-s", "45"]) == 2  # slack for a busy machine
    report = (out / "lease.txt").read_text()
    assert "- first: ran (exit status 1)" in report and "1 error" in report, report
    assert "- second: cut by the deadline" in report and "- third: not run" in report
    assert "--parts second,third" in report, report
    assert sorted(p.name for p in out.iterdir()) == [
        "lease.log", "lease.txt", "run_first.tar.gz", "run_second.tar.gz",
    ]  # fmt: skip
    with tarfile.open(out / "run_second.tar.gz") as tar:
        packed = json.loads(tar.extractfile("run_second/results.jsonl").readline())
    assert packed["name"].endswith("| fp8 cuBLASLt") and packed["carried_from"] == "run_first"
    second = {e["name"].split(" | ")[-1]: e for e in results("second")}
    assert second["bf16"]["status"] == "ok" and "block kernel" not in second
    log = (work / "run_second" / "log.txt").read_text()
    assert "started 2 GEMMs (dense) | dry 128->128, 64 tokens | fp8 cuBLASLt" not in log
    bf16_before = second["bf16"]

    monkeypatch.delenv("FP8JAX_GPU_CHECK_FAULT")
    assert lease.main([*common, "--parts", "second,third", "--deadline-s", "60"]) == 1
    report = (out / "lease.txt").read_text()
    assert "- second: ran" in report and "- third: ran" in report and "--parts" not in report
    for part in ("second", "third"):
        by_name: dict[str, list] = {}
        for entry in results(part):
            by_name.setdefault(entry["name"].split(" | ")[-1], []).append(entry)
        # Each measured once over both calls; the crash carried, never run.
        assert all(len(v) == 1 for v in by_name.values()), by_name
        assert by_name["fp8 cuBLASLt"][0]["carried_from"] == "run_first"
        assert by_name["block kernel"][0]["status"] == "ok"
    assert results("second")[1] == bf16_before  # kept from the first call, not measured again
    assert (work / "run_third" / "summary.txt").read_text().count("ERROR") == 1


def test_a_part_the_lease_fails_to_start_costs_that_part_only(tmp_path, monkeypatch):
    """An exception in the lease's own code for one part (carrying crashes, packing) ended
    the lease: no later part ran, no lease.txt; the part is reported and the next one runs."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    parts = {n: lease.Part(n, ("--sections", "gemms"), 100) for n in ("first", "second")}
    monkeypatch.setattr(lease, "PARTS", parts)
    tried = []

    def carry(work, label, folder):
        tried.append(folder.name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lease, "_carry_crashes", carry)
    out = tmp_path / "out"
    assert lease.main(["--out", str(out), "--work", str(tmp_path / "work"), "--dry-run"]) == 2
    assert tried == ["lease_first", "lease_second"]
    report = (out / "lease.txt").read_text()
    for part in ("first", "second"):
        assert f"- {part}: the lease failed in it (OSError: [Errno 28] No space" in report
    assert "A second call on this machine: --parts first,second" in report, report


def test_a_part_its_check_refuses_is_reported_refused_and_packs_nothing(tmp_path, monkeypatch):
    """A part whose options its check refuses (a section or variant renamed since the plan
    was written) packed an empty archive, reported 'ended early (exit status 2)' and was
    named again for a second call; it is refused by the lease itself (no child started, the
    check's message in lease.txt), packs nothing, and a second call is not told to run it.
    A child that refuses all the same (its out folder never written) is reported so too."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    parts = {
        "typo": lease.Part("a", ("--sections", "numerik"), 100),
        "stale": lease.Part("b", ("--sections", "llama", "--llama-variants", "blockwize"), 100),
    }
    monkeypatch.setattr(lease, "PARTS", parts)
    started = []
    popen = lease.subprocess.Popen
    monkeypatch.setattr(
        lease.subprocess, "Popen", lambda *a, **k: started.append(a) or popen(*a, **k)
    )
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--out", str(out), "--work", str(work), "--dry-run"]
    assert lease.main(common) == 2
    assert started == [] and sorted(p.name for p in out.iterdir()) == ["lease.log", "lease.txt"]
    report = (out / "lease.txt").read_text()
    assert "- typo: refused by its check: --sections='numerik': unknown ['numerik']" in report
    assert "- stale: refused by its check: --llama-variants: unknown ['blockwize']" in report
    assert "--parts" not in report and "refused: fix their options" in report, report
    # The child refuses what the lease's own look let through: reported as refused too.
    monkeypatch.setattr(lease, "_refused", lambda argv: None)
    assert lease.main([*common, "--parts", "typo"]) == 2
    assert len(started) == 1 and sorted(p.name for p in out.iterdir()) == [
        "lease.log", "lease.txt"
    ]  # fmt: skip
    assert "- typo: refused by its check (exit status 2" in (out / "lease.txt").read_text()


def test_a_measurement_taken_by_a_second_call_is_counted_once(tmp_path, monkeypatch):
    """`lease.txt`'s counts are of each measurement's last entry: one skipped for time by the
    first call and taken by the second is one "ok", not a "skipped" and an "ok" (counted
    by hand from the entries written)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    def entry(name, status, **more):
        return json.dumps({"section": "2 GEMMs (dense)", "name": name, "status": status, **more})

    lines = [
        entry("(section)", "ok"),
        entry("a", "ok"),
        entry("b", "skipped", reason="budget: 3 s left"),
        entry("c", "skipped", reason="budget: 3 s left"),
        entry("(section)", "ok"),
        entry("b", "ok"),
    ]
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    assert lease._counts(tmp_path) == {"ok": 2, "skipped": 1}


def test_a_results_line_cut_by_a_kill_costs_that_line_only(tmp_path, monkeypatch):
    """A check killed mid-write (the lease's deadline) leaves a cut last line in its
    `results.jsonl`: the lease's carrying and counting, the resumed check and the supervisor
    read the whole lines and append after them (json.loads raised JSONDecodeError, ending
    the lease before `lease.txt` and the resumed check before its summary)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, supervise
    from gpu_check.record import Recorder

    crash = {"section": "2 GEMMs (dense)", "name": "x | fp8 cuBLASLt", "status": "error",
             "crashed": True}  # fmt: skip
    first, second = tmp_path / "run_first", tmp_path / "run_second"
    first.mkdir()
    whole = json.dumps(crash) + "\n"
    (first / "results.jsonl").write_text(whole + whole[: len(whole) // 2])
    assert lease._carry_crashes(tmp_path, "run", second) == ["--resume"]
    carried = [json.loads(line) for line in (second / "results.jsonl").read_text().splitlines()]
    assert carried == [{**crash, "carried_from": "run_first"}]
    assert lease._counts(first) == {"error": 1}
    rec = Recorder(first, 100.0, 0.0, dry=True, resume=True)
    assert list(rec.done) == [(crash["section"], crash["name"])]
    rec.record("1 numerics", "after", "ok")
    supervise._append(first, {**crash, "name": "y"})
    lines = (first / "results.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == crash and lines[1] == whole[: len(whole) // 2]
    assert [json.loads(line)["name"] for line in lines[2:]] == ["after", "y"]


def test_a_pack_cut_by_the_stop_handlers_own_leaves_one_whole_archive(tmp_path, monkeypatch):
    """The run's SIGTERM mid-pack: `stop` packs the part again, then exits. With one shared
    temporary name, the handler's pack renamed the file the interrupted pack was writing,
    whose end then went into the archive; each pack now writes its own, none left behind."""
    import argparse
    import tarfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "run_block").mkdir(parents=True)
    payload = os.urandom(1 << 20)  # incompressible: the interrupted write is large
    (work / "run_block" / "results.jsonl").write_bytes(payload)
    args = argparse.Namespace(out=out, work=work, label="run")
    add, calls = tarfile.TarFile.add, []

    def add_then_signal(tar, *a, **k):  # the outer pack is signalled as it writes
        add(tar, *a, **k)
        calls.append(1)
        if len(calls) == 1:
            lease._pack(args, "block")  # the handler's
            raise SystemExit(143)

    monkeypatch.setattr(tarfile.TarFile, "add", add_then_signal)
    with pytest.raises(SystemExit):
        lease._pack(args, "block")
    assert sorted(p.name for p in out.iterdir()) == ["run_block.tar.gz"]
    with tarfile.open(out / "run_block.tar.gz") as tar:
        assert tar.extractfile("run_block/results.jsonl").read() == payload


def test_an_archive_over_what_comes_back_is_trimmed_to_fit_keeping_the_summary(
    tmp_path, monkeypatch
):
    """A part's archive over one file's limit (16 MiB), or over what is left of all the
    files' (64 MiB), came back not at all, its summary.txt with it; its files of least use
    are left out, largest first, until it fits, named in the archive's LEFT_OUT.txt and in
    lease.txt. Tiny limits stand for the device tool's."""
    import argparse
    import tarfile

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, returned

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 30_000)
    monkeypatch.setattr(returned, "MAX_TOTAL_BYTES", 100_000)
    monkeypatch.setattr(lease, "REPORT_BYTES", 0)
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    folder = work / "run_block"
    folder.mkdir(parents=True)
    files = {  # incompressible: an archive's size is its files'
        "summary.txt": 1_000, "results.jsonl": 12_000, "log.txt": 20_000,
        "profile_kernels.json": 30_000, "environment.json": 500,
    }  # fmt: skip
    for name, size in files.items():
        (folder / name).write_bytes(os.urandom(size) if name != "summary.txt" else b"s" * size)
    args = argparse.Namespace(out=out, work=work, label="run")

    def packed() -> tuple[set[str], int]:
        archive = out / "run_block.tar.gz"
        with tarfile.open(archive) as tar:
            return {m.name.split("/")[-1] for m in tar.getmembers() if m.isfile()}, (
                archive.stat().st_size
            )

    # Over one file's limit: the profile's kernels go first, then the log.
    left = lease._pack(args, "block")
    names, size = packed()
    assert size <= returned.MAX_FILE_BYTES, size
    assert names == {"summary.txt", "results.jsonl", "environment.json", "LEFT_OUT.txt"}, names
    assert [line.split(" (")[0] for line in left] == ["profile_kernels.json", "log.txt"], left
    # Over what is left of the total: 90 kB already in $OUT leaves 10 kB, so results go too.
    (out / "run_first.tar.gz").write_bytes(os.urandom(90_000))
    left = lease._pack(args, "block")
    names, size = packed()
    assert size <= 10_000 and names == {"summary.txt", "environment.json", "LEFT_OUT.txt"}
    assert "results.jsonl" in left[-1], left
    # A part whose archive fits is packed whole, as before.
    (out / "run_first.tar.gz").unlink()
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 16 << 20)
    monkeypatch.setattr(returned, "MAX_TOTAL_BYTES", 64 << 20)
    assert lease._pack(args, "block") == [] and packed()[0] == set(files)
    # lease.txt names what was left out, and what in $OUT would still not come back.
    (out / "run_first.tar.gz").write_bytes(b"x" * 50)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 40)
    args.parts = ["block"]
    lease._report(args, {"block": {"status": "ran", "code": 0, "left_out": ["log.txt (1 MiB)"]}})
    report = (out / "lease.txt").read_text()
    assert "left out of its archive to fit what comes back" in report
    assert "log.txt (1 MiB)" in report, report
    assert "## What the device tool will not bring back" in report
    assert "- run_first.tar.gz: 0.00 MiB, over 0.00 MiB a file" in report, report


def test_what_would_not_come_back_from_out_is_named(tmp_path, monkeypatch):
    """`returned.problems`: each file of `$OUT` the device tool leaves out, with why."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import returned

    monkeypatch.setattr(returned, "MAX_FILES", 4)
    monkeypatch.setattr(returned, "MAX_FILE_BYTES", 10)
    monkeypatch.setattr(returned, "MAX_TOTAL_BYTES", 20)
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    for rel, size in (("fine.txt", 5), ("a/b/deep_ok", 5), ("a/b/c/too_deep", 1),
                      ("big.json", 11), ("sp ace.txt", 1)):  # fmt: skip
        (tmp_path / rel).write_bytes(b"x" * size)
    assert returned.problems(tmp_path) == [
        "a/b/c/too_deep: 3 folders down, over 2",
        "big.json: 0.00 MiB, over 0.00 MiB a file",
        "sp ace.txt: a name with characters other than letters, digits, '.-_'",
        "5 files, over 4: some will not come back",
        "0.00 MiB in all, over 0.00 MiB",
    ]
    assert returned.problems(tmp_path / "a" / "b") == []


def test_an_out_folder_whose_files_would_not_come_back_is_refused(tmp_path, monkeypatch, capsys):
    """`--out $OUT/a/b/c` (its files 3 folders down) or a folder named with a space ran the
    whole check or lease and nothing came back; the supervisor and the lease refuse them
    before a child starts, as they refuse more parts than files come back."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, returned, supervise

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(supervise.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    for out, said in (
        (tmp_path / "a" / "b" / "c", "is 3 folders below $OUT: its files would be 3 down"),
        (tmp_path / "a b", "'a b' would not come back from $OUT"),
    ):
        assert supervise.main(["--out", str(out), "--dry-run"]) == 2
        assert said in capsys.readouterr().err
        with pytest.raises(SystemExit):
            lease.parse(["--out", str(out)])
        assert said in capsys.readouterr().err
        assert not out.exists()
    assert lease.parse(["--out", str(tmp_path / "a" / "b")]).out == tmp_path / "a" / "b"
    monkeypatch.setattr(returned, "MAX_FILES", 6)  # 5 parts, lease.txt and lease.log: 7
    with pytest.raises(SystemExit):
        lease.parse(["--out", str(tmp_path)])
    assert "at most 6 files come back: name at most 4 parts" in capsys.readouterr().err
    monkeypatch.delenv("OUT")  # a dry run's folder anywhere: not judged
    assert lease.parse(["--out", str(tmp_path / "a" / "b c" / "d"), "--parts", "moe,block"])


def test_an_out_folder_outside_out_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    """On a device machine (`$OUT` set), `--out /tmp/x` or `--out $OUT/../x` ran the whole
    check or lease and nothing came back; both are refused before a child starts, naming
    the folder and `$OUT`. A dry run's folder only warns (the docs run one anywhere), and a
    lease's parts (`--packed`: outside `$OUT`, packed into it) are not judged."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, options, supervise

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(supervise.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    for folder in (tmp_path / "elsewhere", out / ".." / "x", Path(os.path.relpath(tmp_path))):
        said = f"--out={str(folder)!r} is outside $OUT={str(out)!r}"
        assert supervise.main(["--out", str(folder), "--quick"]) == 2
        assert said in capsys.readouterr().err
        with pytest.raises(SystemExit):
            lease.parse(["--out", str(folder)])
        assert said in capsys.readouterr().err
    for inside in (out, out / "check", out / "a" / ".." / "b"):
        assert options.parse(["--out", str(inside)], options.parser()).out == inside
        assert lease.parse(["--out", str(inside)]).out == inside
    elsewhere = tmp_path / "elsewhere"
    assert options.parse(["--out", str(elsewhere), "--dry-run"], options.parser())
    assert lease.parse(["--out", str(elsewhere), "--dry-run"]).dry_run
    assert "warning: --out=" in capsys.readouterr().err
    assert lease._refused(["--out", str(elsewhere), "--packed", "--sections", "moe"]) is None


def test_a_lease_refuses_parts_deadlines_and_labels_it_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    out = ["--out", str(tmp_path)]
    assert lease.parse(out).parts == list(lease.PARTS)
    a_file = tmp_path / "lease.txt"
    a_file.write_text("")
    for bad, named in (
        (["--out", str(a_file)], f"--out={str(a_file)!r} is a file"),
        (["--parts", "block,gemms"], "'gemms'"),
        (["--parts", "moe,moe"], "'moe'"),
        (["--parts", ","], "should name each of"),
        (["--deadline-s", "30"], "should be over"),
        (["--label", "run/7"], "letters, digits"),
        (["--label", "run_é"], "ASCII letters, digits"),  # its archives would not come back
        (["--work", str(tmp_path / "work")], "is inside --out="),  # 8 files come back
        (["--work", str(tmp_path)], "is inside --out="),
        (["--label", "run²"], "ASCII letters, digits"),
        (["--deadline-s", "nan"], "should be over"),
        (["--deadline-s", "900"], "--deadline-s=900.0: should be over 70 s and at most 560"),
        (["--deadline-s", "561"], "at most 560 s (a call's 600 s limit"),  # timeout_s: 601
        (["--hang-s", "0"], "--hang-s=0.0: should be a positive"),
        (["--hang-s", "inf"], "--hang-s=inf: should be a positive"),
        (["--work", str(a_file)], f"--work={str(a_file)!r} is a file"),
        (["--out", str(a_file / "out")], f"is under {str(a_file)!r}, a file"),
        (["--work", str(a_file / "a" / "b")], f"is under {str(a_file)!r}, a file"),
        (["--out", ""], "argument --out: '': empty"),  # `--out "$OUT"`, $OUT unset: the cwd
        (["--work", " "], "argument --work: ' ': empty"),
    ):
        with pytest.raises(SystemExit):
            lease.parse([*out, *bad])
        assert named in capsys.readouterr().err
    # The entry point a lent GPU runs: `--lease` first (it imports no JAX).
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--lease", *out]
    done = subprocess.run([*command, "--parts", "gemms"], capture_output=True, text=True)
    assert done.returncode == 2 and "--parts='gemms'" in done.stderr, done.stderr


def test_the_readmes_gpu_calls_parse(check_modules, tmp_path):
    """Every `gpu_check.py` command `benchmarks/README.md` prepares for a lent GPU names
    sections and Llama variants that exist: a stale name would cost a GPU session's call."""
    import re
    import shlex

    main, _ = check_modules
    text = (ROOT / "benchmarks" / "README.md").read_text()
    commands = [
        " ".join(found.split())
        for found in re.findall(r"gpu_check\.py((?:[^`\n]|\n(?!\n))*?)(?:`|\n\n|$)", text)
    ]
    commands = [c for c in commands if c.startswith("--")]
    assert len(commands) >= 5, commands  # the full check, the Llama sections, calls 1-3
    assert any("--llama-variants" in c for c in commands)
    from gpu_check import lease

    leases = [c for c in commands if c.startswith("--lease")]
    assert len(leases) == 2, leases  # the lease's call, and the second one for what is left
    for command in commands:
        command = command.replace("$OUT", str(tmp_path)).replace("T-20", "100")
        args = shlex.split(command.replace("--parts PARTS", "--parts block,quantize"))
        if args[0] == "--lease":
            lease.parse(args[1:])
        else:
            main.parse(args)  # exits (SystemExit) on an unknown section or variant
    flat = " ".join(text.split())
    for part in lease.PARTS.values():  # the lease's own copies of the calls, as the README's
        main.parse([*part.args, "--budget-s", str(part.budget_s), "--out", str(tmp_path)])
        for option, value in zip(part.args[::2], part.args[1::2], strict=True):
            assert f"{option} {value}" in flat or f"{option} '{value}'" in flat, value


def test_ptx_reader_counts_each_entrys_global_stores_by_width():
    """The PTX reader `store_widths.py` uses (`ptx.Kernel.stores`) counts each entry's
    global stores by the bytes one moves (vector width times element width), and nothing of
    another entry's or of loads and shared-memory stores."""
    from fp8jax._src.observe.ptx import ptx_kernels

    ptx = "\n".join(
        [
            ".visible .entry first(",
            "  st.global.b8 [%rd1], %rs1;",
            "  st.global.b8 [%rd2], %rs2;",
            "  st.global.v4.b32 [%rd3], {%r1, %r2, %r3, %r4};",
            "  st.shared.b8 [%r5], %rs3;",
            "  ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd4];",
            ".visible .entry second(",
            "  st.global.v2.b16 [%rd5], {%rs4, %rs5};",
            "  st.global.f32 [%rd6], %f1;",
        ]
    )
    found = {name: dict(k.stores) for name, k in ptx_kernels([ptx]).items()}
    assert found == {"first": {1: 2, 16: 1}, "second": {4: 2}}


def test_sections_run_in_the_order_given(check_modules, monkeypatch, tmp_path):
    """The budget goes to the sections named first: they run in `--sections`' order, each
    under its own name, what the decisions read handed on, and a section that raises
    recorded as its error while the others run."""
    main, _ = check_modules
    from gpu_check import grouped, llama, moe, numerics, profile

    ran, seen = [], {}

    def stub(name, result=None, raises=False):
        def run(*args, **kwargs):
            ran.append(name)
            if raises:
                raise RuntimeError(f"{name} broke")
            return result

        return run

    monkeypatch.setattr(main, "environment", lambda mode: {"mode": mode})
    monkeypatch.setattr(grouped, "run", stub("grouped", {"shape": {"fp8": 1.0}}))
    monkeypatch.setattr(moe, "run", stub("moe", raises=True))
    monkeypatch.setattr(numerics, "run", stub("numerics"))
    monkeypatch.setattr(llama, "run", stub("llama", {}))
    monkeypatch.setattr(llama, "decide", lambda rec, times: None)
    monkeypatch.setattr(profile, "run", stub("profile"))
    monkeypatch.setattr(main, "decisions", lambda rec, *found: seen.setdefault("found", found))
    code = main.main(["--dry-run", "--out", str(tmp_path), "--sections", "moe,grouped,llama,"
                      "numerics,profile"])  # fmt: skip
    assert ran == ["moe", "grouped", "llama", "numerics", "profile"]
    assert seen["found"] == ({}, {"shape": {"fp8": 1.0}}, {})
    assert code == 1  # the error moe raised
    log = (tmp_path / "results.jsonl").read_text()
    assert "moe broke" in log


def test_an_exception_outside_any_measurement_still_leaves_the_summary(
    check_modules, monkeypatch, tmp_path
):
    """An exception between sections (`_release`), in the environment, the decisions or the
    summary's tables ended the check with a traceback and no summary: it is recorded as an
    error (with what had been measured) and the summary written."""
    main, _ = check_modules
    from gpu_check import numerics

    def measured(rec, mode):
        rec.measure(numerics.SECTION, "one", lambda: {"passed": True})

    def broke(*args):
        raise RuntimeError("broke outside")

    monkeypatch.setattr(numerics, "run", measured)
    monkeypatch.setattr(main, "environment", lambda mode: {"mode": mode})
    for where in ("_release", "environment", "decisions", "_summary"):
        with monkeypatch.context() as patched:
            patched.setattr(main, where, broke)
            out = tmp_path / where
            assert main.main(["--dry-run", "--out", str(out), "--sections", "numerics"]) == 1
        summary = (out / "summary.txt").read_text()
        assert ("0 ok" if where == "environment" else "2 ok") in summary, where
        assert "0 failed, 1 error, 0 skipped;" in summary, summary
        entries = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        (error,) = [e for e in entries if e["status"] == "error"]
        assert error["error"] == "RuntimeError: broke outside" and error["traceback"], where
        sections = {"decisions": "(decisions)", "_summary": "(summary)"}
        assert error["section"] == sections.get(where, "(check)"), where
        assert ("one" in {e["name"] for e in entries}) == (where != "environment"), where


def test_a_check_on_a_gpu_that_jax_does_not_see_measures_nothing(
    check_modules, monkeypatch, tmp_path
):
    """`--quick` (or a full run) where JAX fell back to the CPU (a jaxlib without CUDA) ran
    every section at GPU shapes on the CPU, each measurement killed as hung, the lease spent;
    it records the missing GPU as its error and writes the summary at once."""
    main, _ = check_modules
    from gpu_check import numerics

    ran = []
    monkeypatch.setattr(numerics, "run", lambda rec, mode: ran.append(mode))
    assert main.main(["--quick", "--out", str(tmp_path), "--sections", "numerics"]) == 1
    assert ran == []
    (error,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert error["error"].startswith("RuntimeError: no GPU: JAX's first device is 'cpu: ")
    assert "0 ok, 0 failed, 1 error" in (tmp_path / "summary.txt").read_text()
    assert main.main(["--dry-run", "--out", str(tmp_path), "--sections", "numerics"]) == 0
    assert ran == ["dry"]


def test_llama_variants_option_names_llama_block_variants(check_modules, tmp_path):
    main, _ = check_modules
    from gpu_check import llama

    assert main.parse(["--out", str(tmp_path)]).llama_variants is None
    picked = main.parse(
        [
            "--out",
            str(tmp_path),
            "--llama-variants",
            "blockwise-tiled, bf16,delayed-packed,delayed-cold-fresh,delayed-packed-fresh",
        ]
    )
    assert picked.llama_variants == [
        "blockwise-tiled",
        "bf16",
        "delayed-packed",
        "delayed-cold-fresh",
        "delayed-packed-fresh",
    ]
    # BF16 first (the others' reference), whatever the order given; the mode's own by default.
    assert llama.variant_names("full", picked.llama_variants) == [
        "bf16",
        "blockwise-tiled",
        "delayed-packed",
        "delayed-cold-fresh",
        "delayed-packed-fresh",
    ]
    assert llama.variant_names("quick", None) == llama.VARIANTS["quick"]
    bad_names = ("blockwise,nope", ",", "bf16-packed", "nope-packed", "bf16-fresh", "nope-fresh")
    for bad in (*bad_names, "delayed-fresh-packed"):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--llama-variants", bad])


def test_moe_variants_option_picks_the_moe_sections_steps(check_modules, tmp_path, monkeypatch):
    """`--moe-variants` names the MoE section's steps (checked by name), which a GPU run times
    in the order given; the dry run keeps its own (its FP8 steps would interpret every
    grouped kernel)."""
    main, _ = check_modules
    from gpu_check import moe
    from gpu_check.record import Recorder

    assert main.parse(["--out", str(tmp_path)]).moe_variants is None
    given = "bf16, bf16 jax mgpu,blockwise-tc,blockwise"
    picked = main.parse(["--out", str(tmp_path), "--moe-variants", given]).moe_variants
    assert picked == ["bf16", "bf16 jax mgpu", "blockwise-tc", "blockwise"]
    for bad in ("blockwise,nope", ",", "bf16 jax"):
        with pytest.raises(SystemExit):
            main.parse(["--out", str(tmp_path), "--moe-variants", bad])
    timed = []
    monkeypatch.setattr(moe, "_time", lambda s, name, *_: timed.append(name) or {"ms": 1.0})
    rec = Recorder(tmp_path, 100.0, 0.0, dry=False)
    assert list(moe.run(rec, "full", 1, picked)) == picked == timed
    timed.clear()
    assert list(moe.run(rec, "dry", 1, picked)) == moe.VARIANTS["dry"] == timed


def test_llama_block_variants_trace_inside_their_kernel_choice(monkeypatch):
    """`blockwise-tiled` takes the tiled block kernel, `blockwise-pairs` the persistent one in
    its default configuration with two chunks a step, `blockwise-tile-scales` the persistent
    one in its default with the weights' scales per block (`-three`: three compute warpgroups
    where those scales are), `blockwise-chained` its default
    with each program's tiles chained (a block-scaled GEMM traced inside each variant's
    context, the kernels spied on)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import llama_block

    from fp8jax._src.kernels import choice

    seen = []
    monkeypatch.setattr(choice, "block_scaled_gemm", lambda *a, **k: seen.append("tiled"))
    monkeypatch.setattr(
        choice, "persistent_block_scaled_gemm", lambda *a, config, **k: seen.append(config)
    )
    a = jnp.zeros((128, 256), jnp.float8_e4m3fn)
    s = jnp.ones((128, 2), jnp.float32)
    names = ("blockwise-tiled", "blockwise-pairs", "blockwise-tile-scales", "blockwise-chained")
    for name in names:
        with llama_block.CONTEXTS[name]():
            choice.recipe_block_gemm(a, s, [(a, s)])
            seen.append(choice.weight_block_scales_chosen())
    dense = choice.DEFAULT_CONFIGS["dense"]
    pairs = dataclasses.replace(dense, chunks_per_step=2)
    chained = dataclasses.replace(dense, chained=True)
    assert seen == ["tiled", False, pairs, False, dense, True, chained, False]
    # `blockwise-tile-scales-three`: three compute warpgroups where the weight's scales come
    # per block (the forward, the dgrad), two with scales per row on both sides (the wgrad).
    with llama_block.CONTEXTS["blockwise-tile-scales-three"]():
        choice.recipe_block_gemm(a, s, [(a, s)])
        choice.recipe_block_gemm(a, s, [(a, s[:1])], block_rows=(1, 128))
        seen.append(choice.weight_block_scales_chosen())
    assert seen[-3:] == [dense, dataclasses.replace(dense, compute_wgs=3), True]
    assert set(llama_block.CONTEXTS) <= set(llama_block.RECIPES)
    # `blockwise-slabs`: the quantization kernels in slabs, the GEMMs as `blockwise`'s.
    default = block_quantize.DEFAULT_TUNING
    with llama_block.CONTEXTS["blockwise-slabs"]():
        assert quantize_config.resolved(default).slab_rows == llama_block.SLAB_ROWS == 32
        choice.recipe_block_gemm(a, s, [(a, s)])
    assert seen[-1] == "tiled" and quantize_config.resolved(default).slab_rows is None


def test_steady_state_variants_trace_the_train_steps_steady_program_with_their_roles(
    monkeypatch,
):
    """Each `delayed-steady*` variant traces inside the train step's steady state (the warm
    start skipped, every scale recorded) with exactly its roles' transposed copies apart
    (`delayed-steady`: the recipe's default, the output gradients'; `-fused`: none) and its
    roles quantized by the one-pass kernel, and nothing of it outside."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import llama_block

    import fp8jax
    from fp8jax._src.recipes import ROLES
    from fp8jax._src.recipes.per_tensor import (
        scales_known_recorded,
        transposes_apart_chosen,
        transposes_apart_set,
        transposes_in_words_chosen,
        warm_start_skipped,
    )
    from fp8jax._src.recipes.per_tensor_pass import cast_transpose_chosen, tensor_cores_chosen

    everything, acts, grads = ROLES, ("input", "output_grad"), ("output_grad",)
    expected = {  # name -> (roles apart, roles by the kernel)
        "delayed-steady": (None, ()),  # the recipe's default: the output gradients' apart
        "delayed-steady-fused": ((), ()),
        "delayed-steady-words": (None, ()),
        "delayed-steady-apart-words": (everything, ()),
        "delayed-steady-apart": (everything, ()),
        "delayed-steady-apart-acts": (acts, ()),
        "delayed-steady-kernel": (None, everything),
        "delayed-steady-kernel-acts": (None, acts),
        "delayed-steady-kernel-grads": (None, grads),
        "delayed-steady-apart-kernel-grads": (("input", "kernel"), grads),
        # The same kernels' pass on the tensor cores (`-tc`).
        "delayed-steady-tc": (None, everything),
        "delayed-steady-tc-grads": (None, grads),
        "delayed-steady-apart-tc-grads": (("input", "kernel"), grads),
        # Cast by the Policy, the FP8 Linears' masters kept (`-masters`): the same contexts.
        "delayed-steady-masters": (None, ()),
        "delayed-steady-kernel-masters": (None, everything),
    }
    assert {n for n in llama_block.CONTEXTS if n.startswith("delayed-steady")} == set(expected)
    recipe = fp8jax.DelayedScaling()
    for name, (apart, kernel) in expected.items():
        with llama_block.CONTEXTS[name]():
            assert warm_start_skipped() and scales_known_recorded(), name
            assert transposes_apart_set() == (apart is not None), name
            assert tuple(r for r in ROLES if transposes_apart_chosen(r)) == (apart or ()), name
            made_apart = tuple(r for r in ROLES if recipe.transposes_apart(r))
            assert made_apart == (grads if apart is None else apart), name
            assert tuple(r for r in ROLES if cast_transpose_chosen(r)) == kernel, name
            assert transposes_in_words_chosen() == name.endswith("-words"), name
            assert tensor_cores_chosen() == ("-tc" in name), name
    assert not (warm_start_skipped() or transposes_apart_set() or transposes_in_words_chosen())
    assert not any(map(cast_transpose_chosen, ROLES)) and not tensor_cores_chosen()


def test_llama_variants_of_every_mode_build(monkeypatch):
    """Every size and variant the GPU run's Llama section names exists (shapes only)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import llama_block
    from gpu_check import llama

    for mode, sizes in llama.SIZES.items():
        assert llama.VARIANTS[mode][0] == "bf16"
        for size in sizes:
            assert size in llama_block.SHAPES and size in llama.NEED_S
    for name in dict.fromkeys(n for names in llama.VARIANTS.values() for n in names):
        block, _ = llama_block.arguments("dry", name, "xla", abstract=True)
        assert block is not None, name


def test_packed_variants_step_the_same_bits_with_a_few_state_arrays(monkeypatch):
    """`delayed-packed` (the FP8 states stacked between steps, `llama_block.Packed`) must be
    timed against the same numbers: three steps of the dry block, loss, input gradient and
    every array of the model after each, bit for bit with `delayed`'s; its step takes 12
    arrays in, not 73 (the 63 state arrays in 3 stacks)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import equinox as eqx
    import jax
    import llama_block

    def run(name):
        block, x = llama_block.arguments("dry", name, "xla", abstract=False)
        arrays = len(jax.tree.leaves(eqx.filter((block, x), eqx.is_array)))
        step = jax.jit(llama_block.step(name))
        seen = []
        for _ in range(3):
            block, value, dx = step(block, x)
            model = llama_block.unpack(block) if name.endswith(llama_block.PACKED) else block
            seen += [value, dx, *jax.tree.leaves(eqx.filter(model, eqx.is_array))]
        return seen, arrays

    (plain, plain_arrays), (packed, packed_arrays) = run("delayed"), run("delayed-packed")
    assert (plain_arrays, packed_arrays) == (73, 12)
    assert len(plain) == len(packed)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(plain, packed, strict=True))


def test_delayed_variants_are_timed_with_recorded_states(monkeypatch):
    """Delayed scaling's variants must be timed on a training run's data, not on a fresh
    model's states (which cast with 0 where the warm start is skipped, with 1.0 without it):
    `arguments` gives them the states two warm steps of `delayed` record (every one of the
    21 scales positive), so that the steady state's step computes the warm start's loss bit
    for bit; with `-fresh` the old states, whose steady-state step zeroes every projection
    (its loss is then the input's mean square). Current scaling keeps its own states, and
    another model's states are refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import jax
    import llama_block

    import fp8jax

    recorded = llama_block.recorded_states("dry", "xla")

    def run(name):
        block, x = llama_block.arguments("dry", name, "xla", abstract=False)
        return block, x, jax.jit(llama_block.step(name))(block, x)[1]

    reference = float(run("delayed")[2])
    for name in ("delayed-steady", "delayed-cold", "delayed-steady-packed"):
        assert llama_block.takes_recorded_states(name), name
        block, _, value = run(name)
        model = llama_block.unpack(block) if llama_block.is_packed(name) else block
        states = llama_block.state_arrays(model)
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(states, recorded, strict=True))
        scales = [
            s.scale
            for s in jax.tree.leaves(model, is_leaf=lambda s: isinstance(s, fp8jax.TensorState))
            if isinstance(s, fp8jax.TensorState)
        ]
        assert len(scales) == 21 and all(float(s) > 0 for s in scales), name
        assert float(value) == reference, name
    _, x, fresh = run("delayed-steady-fresh")
    assert float(fresh) == pytest.approx(float(jnp.mean(x.astype(jnp.float32) ** 2)), rel=1e-6)
    assert abs(float(fresh) - reference) > 1e-3
    for name in ("bf16", "current", "blockwise", "delayed-cold-fresh", "delayed-packed-fresh"):
        assert not llama_block.takes_recorded_states(name), name
    current, _ = llama_block.arguments("dry", "current", "xla", abstract=False)
    with pytest.raises(ValueError, match="with_states"):
        llama_block.with_states(current, recorded)


def test_fresh_states_counts_what_e5m2_keeps_of_the_output_gradient(monkeypatch):
    """`fresh_states.py`'s measure: the dry block's output gradient is the benchmark loss's
    (`2 y / N`, against the block's own output), and the fraction E5M2 keeps nonzero is that
    of magnitudes above half its smallest subnormal (2^-17): most of it at the scale 1.0 at
    that size (N = 4096), none of it a millionth as large, nearly all of that at the scale
    delayed scaling records for it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fresh_states
    import llama_block
    import numpy as np
    import train_steps

    g = fresh_states.output_gradient("dry")
    block = train_steps.to_bf16(llama_block.make_block("dry", "xla"))
    y = np.asarray(block(llama_block.inputs("dry")).astype(jnp.float32))
    bound = 2.0**-7 * np.max(np.abs(g))
    np.testing.assert_allclose(g, 2 * y / y.size, rtol=2.0**-7, atol=bound)

    def above(v):
        return np.mean(np.abs(v) > 2.0**-17)

    tiny = g * np.float32(1e-6)
    for values, scale in ((g, 1.0), (tiny, 1.0), (tiny, 2.0**30)):
        kept = fresh_states.kept(values, scale)
        assert kept == pytest.approx(above(values * np.float32(scale)), abs=1e-3), scale
    assert fresh_states.kept(g, 1.0) > 0.9
    assert fresh_states.kept(tiny, 1.0) == 0.0
    assert fresh_states.kept(tiny, 2.0**30) > 0.99


def test_the_conditional_warm_start_computes_what_delayed_scaling_does(monkeypatch):
    """`delayed-cond` (the warm start behind a `lax.cond`) must be timed against the same
    numbers: three train steps of a layer, the first one warm, bit for bit with
    `DelayedScaling()` (outputs, gradients, scales and histories); and without the warm start
    the first step differs (so the comparison can fail)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import llama_block

    import fp8jax

    key = jax.random.PRNGKey(3)
    x = 1e-3 * jax.random.normal(key, (64, 32))

    def run(recipe):
        layer = fp8jax.fp8_linear_layers(
            eqx.nn.Linear(32, 48, key=key), fp8jax.Fp8Config(recipe=recipe)
        )
        step = eqx.filter_jit(
            lambda m: fp8jax.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(m)
        )
        seen = []
        for _ in range(3):
            loss, grads = step(layer)
            overwrites, grads = fp8jax.partition_for_grad_overwrite(grads)
            layer = fp8jax.apply_updates(layer, jax.tree.map(lambda g: -0.1 * g, grads), overwrites)
            seen.append((loss, jax.tree.leaves(eqx.filter(layer, eqx.is_array))))
        return seen

    def same(a, b):
        return all(
            bool(jnp.array_equal(p, q))
            for (la, xa), (lb, xb) in zip(a, b, strict=True)
            for p, q in zip([la, *xa], [lb, *xb], strict=True)
        )

    reference = run(fp8jax.DelayedScaling())
    assert same(run(llama_block.RECIPES["delayed-cond"]), reference)
    assert not same(run(fp8jax.DelayedScaling(warm_start=False)), reference)


# --- the profile section's reading of a trace, on hand-built kernels -------------------------

#: HLO instruction -> kind, as `profile.hlo_kinds` gives them (also under the kernel names).
KINDS = {
    "custom-call.1": "GEMM fp8",
    "custom-call.2": "GEMM bf16",
    "custom-call.9": "rest",  # cuDNN's attention: hlo_cost does not know it
    "loop_convert_fusion.3": "quantize",
    "loop_convert_fusion_3": "quantize",
    "input_reduce_fusion.4": "amax",
    "dot.5": "GEMM tf32",
}


def _two_steps(profile):
    """Two steps after marks at 0 and 1000 ns, with overlapping kernels, and one kernel
    before the first mark; with the figures computed by hand."""
    E = profile.Event
    events = [
        E("early", -50, 10, "input_reduce_fusion.4"),  # before the first step: dropped
        # step 0: span 10..320 = 310; busy [10,110) + [150,260) + [300,320) = 230; idle 80
        E("sm90_anything", 10, 100, "custom-call.1"),  # GEMM fp8 by its hlo_op
        E("input_reduce_fusion", 50, 30, "input_reduce_fusion.4"),  # amax, inside the GEMM
        E("cudnn_generated_fort_native_sdpa_sm90", 150, 50, "custom-call.9"),  # attention
        E("loop_convert_fusion_3", 190, 70, ""),  # quantize, found by its kernel name
        E("nvjet_tst_e4m3_but_bf16", 300, 20, "custom-call.2"),  # GEMM bf16: hlo_op wins
        # step 1: span 1005..1210 = 205; busy [1005,1125) + [1200,1210) = 130; idle 75
        E("sm90_xmma_gemm_e4m3bf16_e4m3f32", 1005, 100, ""),  # GEMM fp8 by its name
        E("MemcpyD2D", 1105, 20, ""),  # touching the GEMM, not overlapping: rest
        E("dot_5", 1200, 10, "dot.5"),  # a float32 GEMM: "GEMM other"
        E("flash_fwd_kernel", 1201, 4, ""),  # attention by its name, inside the dot
    ]
    expected = [
        {
            "device_ns": {"GEMM fp8": 100, "GEMM bf16": 20, "GEMM other": 0, "attention": 50},
            "rest_ns": {"amax": 30, "quantize": 70},
            "span_ns": 310,
            "busy_ns": 230,
            "idle_ns": 80,
            "kernels": 5,
        },
        {
            "device_ns": {"GEMM fp8": 100, "GEMM bf16": 0, "GEMM other": 10, "attention": 4},
            "rest_ns": {"unmatched": 20},
            "span_ns": 205,
            "busy_ns": 130,
            "idle_ns": 75,
            "kernels": 4,
        },
    ]
    for e in expected:
        e["device_ns"]["rest"] = sum(e["rest_ns"].values())
    return events, expected


def _check_steps(figures, expected):
    assert len(figures) == len(expected)
    for got, want in zip(figures, expected, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value), (key, got[key], value)


def test_profile_classifies_by_hlo_op_then_kernel_name_then_heuristics(profile):
    events, _ = _two_steps(profile)
    got = {e.name: profile.classify(e, KINDS) for e in events}
    assert got["sm90_anything"] == ("GEMM fp8", "GEMM fp8", "hlo_op")
    assert got["input_reduce_fusion"] == ("rest", "amax", "hlo_op")
    assert got["cudnn_generated_fort_native_sdpa_sm90"][:2] == ("attention", "attention")
    assert got["loop_convert_fusion_3"] == ("rest", "quantize", "name")
    assert got["nvjet_tst_e4m3_but_bf16"] == ("GEMM bf16", "GEMM bf16", "hlo_op")
    assert got["sm90_xmma_gemm_e4m3bf16_e4m3f32"] == ("GEMM fp8", "GEMM fp8", "heuristic")
    assert got["MemcpyD2D"] == ("rest", "unmatched", "heuristic")
    assert got["dot_5"] == ("GEMM other", "GEMM tf32", "hlo_op")
    assert got["flash_fwd_kernel"] == ("attention", "attention", "heuristic")
    assert profile.kind_from_name("cublasLt_gemm_bf16") == "GEMM bf16"
    # CUDA 13's cuBLAS kernels, as an H200 trace named them (run 4)
    assert profile.kind_from_name("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "GEMM bf16"
    for fp8 in ("nvjet_sm90_qqtst_176x128_128x5_1x2_h_bz_TNN", "nvjet_sm90_qrtst_128x160_TNT"):
        assert profile.kind_from_name(fp8) == "GEMM fp8"
    assert profile.kernel_name("custom-call.12") == "custom_call_12"


def test_profile_splits_two_steps_with_overlapping_kernels(profile):
    events, expected = _two_steps(profile)
    steps = profile.split_steps(list(reversed(events)), [1000.0, 0.0])
    assert [len(s) for s in steps] == [5, 4]
    _check_steps([profile.step_figures(s, KINDS) for s in steps], expected)
    result = profile.analyse(events, [0.0, 1000.0], KINDS)
    assert result["steps_split_by"] == "step annotations"
    assert result["events_outside_steps"] == 1
    assert not result["steps_consistent"]  # 5 kernels, then 4: not one program's steps
    _check_steps(result["per_step"], expected)
    assert result["idle_ms"] == pytest.approx((80 + 75) / 2 / 1e6)
    assert result["kernels"] == pytest.approx(4.5)
    assert result["device_ms"]["rest"] == pytest.approx((100 + 20) / 2 / 1e6)
    assert result["rest_ms"]["quantize"] == pytest.approx(70 / 2 / 1e6)
    top = result["top"]
    assert top[0]["total_us"] == pytest.approx(0.1) and top[0]["count"] == 1
    assert [r["total_us"] for r in top] == sorted((r["total_us"] for r in top), reverse=True)
    assert len(top) == len(events) - 1  # every kernel but the early one, each its own group


def test_profile_without_annotations_cuts_at_the_widest_gaps(profile):
    events, expected = _two_steps(profile)
    result = profile.analyse(events[1:], [], KINDS)
    assert result["steps_split_by"] == "gaps between kernels"
    _check_steps(result["per_step"], expected)
    # A long kernel covering short ones: a gap is measured from the latest end so far, so the
    # widest is 100 -> 110 (10 ns), not 20 -> 80 inside the long kernel.
    E = profile.Event
    covered = [E("a", 0, 100), E("b", 10, 10), E("c", 80, 10), E("d", 110, 10), E("e", 125, 1)]
    steps = profile.split_by_gaps(covered, 2)
    assert [[e.name for e in s] for s in steps] == [["a", "b", "c"], ["d", "e"]]
    assert profile.busy_ns(covered) == pytest.approx(100 + 10 + 1)


def test_profile_prefers_a_split_that_gives_every_step_the_same_kernels(profile):
    """Two runs of one program (3 kernels each): annotations shifted against the device's
    clock put a kernel of the first step in the second; the gaps split them right."""
    E = profile.Event
    one = [E("gemm_e4m3", 0, 50, "custom-call.1"), E("a", 60, 10), E("b", 75, 20)]
    two = [dataclasses.replace(e, start_ns=e.start_ns + 200) for e in one]
    aligned = profile.analyse(one + two, [-5.0, 195.0], KINDS)
    assert aligned["steps_split_by"] == "step annotations" and aligned["steps_consistent"]
    shifted = profile.analyse(one + two, [-5.0, 70.0], KINDS)
    assert shifted["steps_split_by"] == "gaps between kernels" and shifted["steps_consistent"]
    for result in (aligned, shifted):
        assert [s["kernels"] for s in result["per_step"]] == [3, 3]
        assert result["idle_ms"] == pytest.approx(15 / 1e6)  # 0..95 less 50 + 10 + 20 busy
        assert result["device_ms"]["GEMM fp8"] == pytest.approx(50 / 1e6)


#: A synthetic trace as `jax.profiler.trace` writes one on a GPU (XSpace text proto): the
#: device plane's stream line and a derived line, the host's step annotations and a thunk.
XSPACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #7(Kernel,MemcpyD2D)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 10000 duration_ps: 100000
      stats { metadata_id: 1 str_value: "custom-call.1" } stats { metadata_id: 2 int64_value: 3 } }
    events { metadata_id: 2 offset_ps: 50000 duration_ps: 30000
      stats { metadata_id: 1 ref_value: 4 } }
    events { metadata_id: 3 offset_ps: 1005000 duration_ps: 100000 }
  }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 4 offset_ps: 0 duration_ps: 2000000 } }
  event_metadata { key: 1 value { id: 1 name: "sm90_anything" } }
  event_metadata { key: 2 value { id: 2 name: "input_reduce_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "sm90_xmma_gemm_e4m3bf16_e4m3f32" } }
  event_metadata { key: 4 value { id: 4 name: "jit_step" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
  stat_metadata { key: 2 value { id: 2 name: "program_id" } }
  stat_metadata { key: 4 value { id: 4 name: "input_reduce_fusion.4" } }
}
planes {
  id: 2 name: "/host:CPU"
  lines { id: 3 name: "python" timestamp_ns: 500
    events { metadata_id: 1 offset_ps: 500000 duration_ps: 400000
      stats { metadata_id: 1 int64_value: 0 } }
    events { metadata_id: 1 offset_ps: 1500000 duration_ps: 400000
      stats { metadata_id: 1 int64_value: 1 } } }
  lines { id: 4 name: "tf_XLAPjRtCpuClient" timestamp_ns: 500
    events { metadata_id: 2 offset_ps: 0 duration_ps: 7000
      stats { metadata_id: 2 str_value: "dot.5" } } }
  event_metadata { key: 1 value { id: 1 name: "fp8jax_profile_step" } }
  event_metadata { key: 2 value { id: 2 name: "dot" } }
  stat_metadata { key: 1 value { id: 1 name: "step_num" } }
  stat_metadata { key: 2 value { id: 2 name: "hlo_op" } }
}
"""


def test_profile_reads_a_trace_through_jax_profile_data(profile):
    from jax.profiler import ProfileData

    trace = profile.read(ProfileData.from_text_proto(XSPACE))
    assert trace.planes == ["/device:GPU:0", "/host:CPU"]
    assert trace.device_lines == ["Stream #7(Kernel,MemcpyD2D)", "XLA Ops"]
    E = profile.Event
    # start: the line's timestamp_ns plus the event's offset_ps / 1000; the derived line left out
    assert trace.device == [
        E("sm90_anything", 1010.0, 100.0, "custom-call.1"),
        E("input_reduce_fusion", 1050.0, 30.0, "input_reduce_fusion.4"),
        E("sm90_xmma_gemm_e4m3bf16_e4m3f32", 2005.0, 100.0, ""),
    ]
    assert trace.marks == [1000.0, 2000.0]
    assert trace.host_ops == [E("dot", 500.0, 7.0, "dot.5")]
    result = profile.analyse(trace.device, trace.marks, KINDS)
    assert result["steps_split_by"] == "step annotations"
    assert [s["kernels"] for s in result["per_step"]] == [2, 1]
    assert result["per_step"][0]["device_ns"]["GEMM fp8"] == pytest.approx(100)
    assert result["per_step"][0]["rest_ns"] == {"amax": pytest.approx(30)}
    assert result["per_step"][0]["idle_ns"] == pytest.approx(0)

    host_only = XSPACE[XSPACE.index("planes {\n  id: 2") :]
    trace = profile.read(ProfileData.from_text_proto(host_only))
    assert trace.device is None and trace.planes == ["/host:CPU"] and trace.marks


def test_profile_reads_kernels_of_a_device_plane_without_stream_lines(profile):
    from jax.profiler import ProfileData

    text = XSPACE.replace('name: "Stream #7(Kernel,MemcpyD2D)"', 'name: "Compute"')
    trace = profile.read(ProfileData.from_text_proto(text))
    assert [e.name for e in trace.device] == [
        "sm90_anything",
        "input_reduce_fusion",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32",
    ]


def test_profile_bytes_come_from_the_compiled_hlo(profile):
    """`hlo_bytes`: every non-GEMM kernel's bytes as `hlo_cost` counts them, under its HLO
    name and its kernel name; the GEMMs left out."""
    import jax
    import jax.numpy as jnp

    import fp8jax

    x = jnp.ones((64, 64), jnp.float32)
    hlo = jax.jit(lambda a: jnp.tanh(a @ a.T) + 1).lower(x).compile().as_text()
    moved = profile.hlo_bytes(hlo)
    kernels = fp8jax.hlo_cost(hlo).kernels
    others = [k for k in kernels if k.category is not None]
    assert others and len(others) < len(kernels)  # the GEMM is not among them
    for k in others:
        assert moved[k.name] == moved[profile.kernel_name(k.name)] == k.bytes > 0
    E = profile.Event
    event = E(profile.kernel_name(others[0].name), 0, 1)
    assert profile.bytes_for(event, moved) == others[0].bytes
    assert profile.bytes_for(E("x", 0, 1, others[0].name), moved) == others[0].bytes
    assert profile.bytes_for(E("unknown", 0, 1), moved) is None


def test_profile_kinds_come_from_the_compiled_hlo(profile):
    import jax
    import jax.numpy as jnp

    x = jnp.ones((32, 32), jnp.bfloat16)
    hlo = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a).lower(x).compile().as_text()  # two GEMMs
    kinds = profile.hlo_kinds(hlo)
    names = [k for k in kinds if "." in k or "-" in k]
    assert names and all(kinds[profile.kernel_name(k)] == kinds[k] for k in names)
    assert any(kind.startswith("GEMM") for kind in kinds.values())


def _xspace(events, marks) -> str:
    """The text proto of a trace with `events` on the GPU's stream line and step annotations
    starting at `marks` on the host."""
    names = {n: i for i, n in enumerate(dict.fromkeys(e.name for e in events), 1)}
    lines = []
    for e in events:
        stat = f'stats {{ metadata_id: 1 str_value: "{e.hlo_op}" }}' if e.hlo_op else ""
        lines.append(
            f"events {{ metadata_id: {names[e.name]} offset_ps: {int(e.start_ns * 1000)} "
            f"duration_ps: {int(e.duration_ns * 1000)} {stat} }}"
        )
    metadata = " ".join(
        f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in names.items()
    )
    steps = " ".join(
        f"events {{ metadata_id: 1 offset_ps: {int(m * 1000)} duration_ps: 1000 }}" for m in marks
    )
    return f"""
planes {{ id: 1 name: "/device:GPU:0"
  lines {{ id: 1 name: "Stream #7(Kernel)" timestamp_ns: 0 {" ".join(lines)} }}
  {metadata}
  stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }} }}
planes {{ id: 2 name: "/host:CPU"
  lines {{ id: 2 name: "python" timestamp_ns: 0 {steps} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "fp8jax_profile_step" }} }} }}
"""


def test_profile_section_on_a_gpu_trace(profile, monkeypatch, tmp_path):
    """The section's GPU branch, the trace replaced by a synthetic one per variant: figures,
    ratios to BF16, cells and `profile_kernels.json`."""
    import types

    from gpu_check import llama
    from gpu_check.record import Recorder
    from jax.profiler import ProfileData

    E = profile.Event
    steps = {
        # BF16: a GEMM and two other kernels (10 + 20 ns of rest, 15 idle over 0..95)
        "bf16": [E("gemm", 0, 50, "custom-call.2"), E("a", 60, 10), E("b", 75, 20)],
        # FP8: a GEMM, an amax, a quantize and one other kernel (5 + 10 + 20 ns of rest)
        "delayed": [
            E("gemm", 0, 30, "custom-call.1"),
            E("amax", 35, 5, "input_reduce_fusion.4"),
            E("cast", 40, 10, "loop_convert_fusion.3"),
            E("b", 55, 20),
        ],
    }
    traces = {}
    for name, one in steps.items():
        two = [dataclasses.replace(e, start_ns=e.start_ns + 1000) for e in one]
        traces[name] = _xspace(one + two, [-10.0, 990.0])
    monkeypatch.setattr(
        profile,
        "trace_steps",
        lambda compiled, folder: (ProfileData.from_text_proto(traces[compiled.name]), [1.0, 1.0]),
    )
    monkeypatch.setattr(profile, "hlo_kinds", lambda hlo: KINDS)
    # bytes per run: the amax 10 kB in 5 ns (2 TB/s), the cast 30 kB in 10 ns (3 TB/s)
    moved = {"input_reduce_fusion.4": 10e3, "loop_convert_fusion.3": 30e3}
    monkeypatch.setattr(profile, "hlo_bytes", lambda hlo: moved)
    cache = {
        ("dry", name): llama.Prepared(types.SimpleNamespace(name=name, hlo=""), "xla")
        for name in steps
    }
    rec = Recorder(tmp_path, 100.0, 0.0, dry=True)
    results = profile.run(rec, "dry", cache)["dry"]
    assert rec.counts == {"ok": 2, "failed": 0, "error": 0, "skipped": 0}
    bf16, delayed = results["bf16"], results["delayed"]
    assert bf16["device_ms"]["GEMM bf16"] == pytest.approx(50 / 1e6)
    assert bf16["device_ms"]["rest"] == pytest.approx(30 / 1e6)
    assert bf16["idle_ms"] == pytest.approx(15 / 1e6)
    assert delayed["device_ms"]["GEMM fp8"] == pytest.approx(30 / 1e6)
    assert delayed["rest_ms"] == pytest.approx(
        {"amax": 5 / 1e6, "quantize": 10 / 1e6, "unmatched": 20 / 1e6}
    )
    assert delayed["rest_vs_bf16"] == pytest.approx(35 / 30)
    assert delayed["kernels_vs_bf16"] == pytest.approx(4 / 3)
    assert "rest_vs_bf16" not in bf16
    cells = rec.cells["5 profile"]
    assert cells["delayed"]["dry kernels"].endswith(f"({4 / 3:.2f}x)")
    assert cells["delayed"]["dry device ms"].endswith(f"({35 / 30:.2f}x)")
    saved = json.loads((tmp_path / "profile_kernels.json").read_text())
    assert set(saved) == {"dry bf16", "dry delayed"}
    top = saved["dry delayed"]["top"]
    assert (top[0]["name"], top[0]["bucket"], top[0]["count"]) == ("gemm", "GEMM fp8", 2)
    assert saved["dry delayed"]["steps_split_by"] == "step annotations"
    assert delayed["rest_tb_s"] == pytest.approx({"amax": 2.0, "quantize": 3.0})
    assert cells["delayed"]["dry rest TB/s"] == "amax 2.00 | quantize 3.00"
    assert cells["bf16"]["dry rest TB/s"] == "-"
    rows = {row["name"]: row for row in top}
    assert rows["cast"]["mb"] == pytest.approx(0.03) and rows["cast"]["tb_s"] == pytest.approx(3)
    assert "tb_s" not in rows["b"]  # no bytes known for it


def test_delayed_scalings_state_adds_no_kernels_over_current_scalings(monkeypatch):
    """Issue 38: delayed scaling's history (its update, finiteness check, merge and the scale
    computed from it) is written in a few kernels per step, not a few per operand: the tiny
    Llama block's step compiled for an H100 has no more kernels than current scaling's
    (before: 248 against 166). Without the warm start, whose amax pass is a cost of its own
    (`DelayedScaling`'s docstring), both read each operand once for its amax."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import llama_block

    from fp8jax._src.observe import deviceless

    if deviceless.h100_topology() is None:
        pytest.skip("needs the CUDA plugin (the h100 extra)")
    counts = {
        name: llama_block.split(llama_block.compile_deviceless("dry", name)).kernel_count
        for name in ("delayed-cold", "current")
    }
    assert counts["delayed-cold"] <= counts["current"], counts


def test_profile_rates_joins_a_profile_and_estimates_at_its_rates(monkeypatch, capsys, tmp_path):
    """`benchmarks/profile_rates.py`: a profile's kernels joined by name with the bytes of the
    same step compiled deviceless (rate = bytes / mean time; above HBM's peak a mismatch;
    a name not compiled said so), and the estimate: each kernel's bytes at its class's rate
    plus the launch, summed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_rates

    from fp8jax._src.observe import deviceless

    if deviceless.h100_topology() is None:
        pytest.skip("needs the CUDA plugin (the h100 extra)")
    assert profile_rates.kernel_class("input_convert_transpose_fusion.3") == "transposing cast"
    assert profile_rates.kernel_class("wrapped_transpose.2") == "FP8 transpose"
    assert profile_rates.kernel_class("input_add_reduce_fusion") == "reduction"
    assert profile_rates.kernel_class("loop_add_fusion") == "other"
    assert profile_rates.kernel_class("pallas_call.184") == "fp8jax kernel"
    kernels = profile_rates.compiled_kernels("dry", "delayed-cold")
    (slow, a), (fast, b) = sorted(kernels.items(), key=lambda kv: -kv[1].bytes)[:2]
    rows = [  # `slow` at 1 TB/s (its bytes in as many picoseconds), `fast` at 10 TB/s
        {"name": slow, "bucket": "rest", "kind": "quantize", "count": 2, "mean_us": a.bytes / 1e6},
        {"name": fast, "bucket": "rest", "kind": "amax", "count": 2, "mean_us": b.bytes / 1e7},
        {"name": "not_a_kernel", "bucket": "rest", "kind": "rest", "count": 2, "mean_us": 1.0},
        {"name": "gemm", "bucket": "GEMM fp8", "kind": "GEMM fp8", "count": 2, "mean_us": 9.0},
    ]
    data = {"steps": 2, "top": rows, "device_ms": {"rest": 1.0}, "rest_ms": {}}
    path = tmp_path / "profile_kernels.json"
    path.write_text(json.dumps({"dry delayed-cold": data}))
    profile_rates.join(path, "dry delayed-cold")
    lines = {
        line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
    }
    assert " | 1.00 | " in lines[slow] and "mismatch" not in lines[slow]
    assert " | 10.00 | " in lines[fast] and "mismatch" in lines[fast]
    assert "not compiled here" in lines["not_a_kernel"] and "gemm" not in lines
    rates = dict.fromkeys(profile_rates.CLASSES, 2.0)
    profile_rates.estimate(["dry"], ["delayed-cold"], rates)
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| dry |")]
    want = sum(k.bytes for k in kernels.values()) / 2e12 + len(kernels) * 3e-6
    assert float(row[0].split("|")[-2]) == pytest.approx(want * 1e3, abs=0.006)


def test_sweep_ptx_reads_ptxas_logs_and_lists_every_swept_configuration(monkeypatch):
    """`benchmarks/sweep_ptx.py`: each kernel's spill bytes (stores, loads) and the C7514
    warnings from ptxas' logs as Mosaic GPU writes them, and one compile per configuration
    the GPU check sweeps at each shape it times them (the grouped GEMMs' defaults too)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import sweep_ptx
    from gpu_check import block_kernels, grouped, moe

    spilled = (
        "ptxas warning : Registers are spilled to local memory in function 'k', 20 bytes spill "
        "stores, 36 bytes spill loads\n    24 bytes stack frame, 20 bytes spill stores, 36 "
        "bytes spill loads\n"
    )
    clean = "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    serialized = clean + "ptxas warning : (C7514) wgmma.mma_async instructions are serialized\n"
    seen = sweep_ptx.read([spilled, clean, serialized])
    assert seen == {"spills": [(20, 36), (0, 0), (0, 0)], "serialized": 1}
    cases = sweep_ptx.cases()
    dense = [c for c in cases if c[1] == "dense"]
    assert len(dense) == len(block_kernels.SWEEP) * len(block_kernels.SHAPES)
    assert {c[2] for c in dense} == set(block_kernels.SWEEP)
    for kind, shapes in (("rows", 2), ("tokens", 1)):
        got = [c for c in cases if c[1] == kind]
        assert len(got) == (1 + len(grouped.SWEEP[kind])) * shapes, kind
    assert set(sweep_ptx.MOE_VARIANTS) <= set(moe.VARIANTS["full"])


def test_promotion_sass_reads_the_compute_loop_of_a_disassembly(monkeypatch):
    """`benchmarks/promotion_sass.py`: the shortest loop holding a `wgmma` in a SASS dump with
    control codes (as Mosaic GPU writes it), per chunk its instructions beside the `wgmma`,
    those between a chunk's first and last `wgmma`, its waits and its stall cycles; the
    kernel's local-memory stores and loads (ptxas' spills)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import promotion_sass

    def line(addr, text, stall=1, wait="-"):
        return f"   {wait}:-:-:Y:{stall:02d}        /*{addr:04x}*/    {text} ;"

    mma = "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24"
    inner = [
        ".L_x_9:",
        line(0x10, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R12"),
        line(0x20, "LDS.64 R12, [R0+UR11+0x20800]", 4),
        line(0x30, mma.replace("R24, gdesc[UR8], R24", "R24, gdesc[UR8], RZ, !UPT")),
        line(0x40, "FMUL R173, R171.reuse, R12", 2, wait="1"),
        line(0x50, "FMUL R174, R171, R13"),
        line(0x60, mma),
        line(0x70, mma),
        line(0x80, mma + ", gsb0", 3),
        line(0x90, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 2),
        line(0xA0, "FFMA R170, R25, R12, R170"),
        line(0xB0, "@P1 BRA `(.L_x_9)", 5),
    ]
    split = line(0x04, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8")
    outer = [line(0x02, "STL [R1], R2"), split, ".L_x_8:", line(0x08, "STL [R1+0x10], R0")]
    outer += inner
    outer += [line(0xC0, "F2FP.BF16.F32.PACK_AB R14, R162, R161"), line(0xD0, "BRA `(.L_x_8)")]
    sass = "\n".join(["        .global kernel", *outer, line(0xE0, "EXIT")])
    body = promotion_sass.innermost_mma_loop(sass)
    assert [b.op for b in body][:2] == ["SYNCS.PHASECHK.TRANS64.TRYWAIT", "LDS.64"]
    assert body[-1].op == "BRA" and len(body) == 11
    seen = promotion_sass.read_loop(body)
    assert seen == {
        "chunks": 1,
        "instructions": 7,
        "FMUL": 2,
        "FFMA": 1,
        "FADD": 0,
        "LDS": 1,
        "between": 2,
        "waits": [0],
        "stall": 1 + 4 + 1 + 2 + 1 + 1 + 1 + 3 + 2 + 1 + 5,
        "turnaround": (2 + 1 + 5) + (1 + 4),
        "local": 0,
    }
    assert promotion_sass.local_memory(sass) == (2, 0, 1)
    with pytest.raises(ValueError, match="no loop with a wgmma"):
        promotion_sass.innermost_mma_loop("\n".join([".L_x_1:", line(0x10, "BRA `(.L_x_1)")]))
    assert promotion_sass.TENSOR_CYCLES == 256


def test_a_new_run_leaves_no_earlier_profile_file(tmp_path, monkeypatch):
    """A run into a reused --out cleared results.jsonl, log.txt and decisions.txt but kept an
    earlier run's profile_kernels.json, which then passed for this run's profile; a resumed
    run keeps it (its profile section's figures come back from results.jsonl)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import record

    stale = tmp_path / record.KERNELS_FILE
    stale.write_text("{}\n")
    record.Recorder(tmp_path, 10.0, 0.0, dry=True, resume=True)
    assert stale.exists()
    record.Recorder(tmp_path, 10.0, 0.0, dry=True)
    assert not stale.exists()


def test_the_lease_log_stays_within_its_reserve_keeping_its_first_and_last_lines(
    tmp_path, monkeypatch
):
    """`lease.log` grew without bound (a traceback a part, a line each), while `_pack` kept
    only `REPORT_BYTES` (64 KiB) free for it and `lease.txt`: over 64 KiB of lines now leave
    it within the reserve, its first and last lines kept and a marked cut between."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    lines = [f"== part {i}: " + "x" * 90 for i in range(1_000)]  # about 100 KiB
    for line in lines:
        lease._say(tmp_path, line)
    text = (tmp_path / "lease.log").read_text()
    kept = text.splitlines()
    assert len(text.encode()) <= lease.REPORT_BYTES // 2, len(text.encode())
    assert kept[0] == lines[0] and kept[-1] == lines[-1], (kept[0], kept[-1])
    assert kept[-10:] == lines[-10:]
    cuts = [line for line in kept if "of the middle cut here" in line]
    assert len(cuts) == 1, cuts
    assert set(kept) - set(cuts) <= set(lines)  # whole lines only, in their order
    missing = sum(len(line) + 1 for line in lines if line not in kept)
    assert f"[... {missing} bytes of the middle cut here" in cuts[0], (missing, cuts)
    assert [line for line in kept if line in lines] == sorted(
        (line for line in kept if line in lines), key=lines.index
    )


def test_what_a_part_skipped_for_lack_of_time_runs_in_the_second_call(tmp_path, monkeypatch):
    """A lease's part started late (45 s left: a budget of 15 s) skipped every measurement
    for its budget, wrote its summary, and passed for done: lease.txt named no second call,
    a second call reported it "done before", and a resumed check took the skips back as
    results; now the part is named for a second call and its skips run there."""
    import argparse
    import time

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, record

    folder = tmp_path / "work" / "run_block"
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text("the summary\n")
    entries = [
        dict(section="s", name="a", status="ok", ms=1.0),
        dict(section="s", name="b", status="skipped", reason="budget: 3 s left"),
        dict(section="s", name="c", status="skipped", reason="'c' crashed or hung in 's | x'"),
    ]
    (folder / "results.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", label="run")
    args.parts, args.deadline_s, args.dry_run, args.hang_s = ["block"], 560.0, True, None
    args.out.mkdir()
    rows: dict = {}
    monkeypatch.setattr(lease, "_refused", lambda argv: "(stopped here by the test)")
    lease._run_part(args, "block", time.monotonic(), rows, [])
    assert rows["block"]["status"] != "done before", rows  # on to start it (refused here)
    lease._report(args, {"block": {"status": "ran", "code": 2}})
    assert "A second call on this machine: --parts block" in (args.out / "lease.txt").read_text()
    # Resumed: the measurement skipped for time runs, the one recorded ok is taken back.
    rec = record.Recorder(folder, 100.0, 0.0, dry=True, resume=True)
    ran = []
    assert rec.measure("s", "a", lambda: pytest.fail("ran again")) == {"ms": 1.0}
    assert rec.measure("s", "b", lambda: ran.append("b") or {"ms": 2.0}) == {"ms": 2.0}
    assert ran == ["b"]
    (folder / "summary.txt").write_text("the summary\n")  # the resumed check's
    lease._run_part(args, "block", time.monotonic(), rows, [])
    assert rows["block"]["status"] == "done before", rows


def test_a_part_is_started_only_with_time_to_measure(tmp_path, monkeypatch):
    """A part was started with 45 s left (`MIN_S`): its budget, 45 s less `OVERHEAD_S`, was
    15 s, under the 20 s each full-mode measurement needs left, so it skipped everything
    and spent the lease's last seconds on imports; now the least budget a part starts with
    runs a measurement."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease, record

    budget, reserve = lease.MIN_S - lease.OVERHEAD_S, record.MODES["full"][3]
    rec = record.Recorder(tmp_path, budget, reserve, dry=False)
    assert rec.measure("s", "first", lambda: {"ms": 1.0}) == {"ms": 1.0}, (budget, reserve)


def test_a_part_that_fails_to_pack_when_stopped_loses_no_other_part(tmp_path, monkeypatch):
    """The `timeout`'s SIGTERM packs every part before lease.txt: one pack that raised (a
    full disk) left the parts after it unpacked and no lease.txt; now the failure is
    reported in lease.txt and the other parts are packed."""
    import signal
    import time

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    packed = []

    def pack(args, name):
        if name == "moe":
            raise OSError(28, "No space left on device")
        packed.append(name)
        return []

    def run_parts(args, start, rows, running):
        rows["moe"] = {"status": "ran", "code": 0}
        rows["block"] = {"status": "ran", "code": 0}
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs here
        pytest.fail("not stopped")

    monkeypatch.setattr(lease, "_pack", pack)
    monkeypatch.setattr(lease, "_run_parts", run_parts)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        lease.main(["--out", str(out), "--work", str(tmp_path / "work"), "--parts", "moe,block"])
    assert stopped.value.code == 143 and packed == ["block"], packed
    report = (out / "lease.txt").read_text()
    assert "- moe: ran; packing it failed (OSError: [Errno 28] No space left" in report, report
    assert "- block: ran" in report, report


def test_the_readmes_second_call_threshold_leaves_a_deadline_the_lease_accepts(
    tmp_path, monkeypatch
):
    """The README sent a second lease call where `budget_left_s` left 90 s: its `timeout_s`
    T+20 within that, T at most 70, `--deadline-s T-20` at most 50, which the lease refuses
    (over PACK_S + MIN_S): the call would have been spent on a refusal."""
    import re

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import lease

    text = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    left = int(re.search(r"`lease\.budget_left_s` leaves (\d+) s or more", text)[1])
    timeout = left - 20  # the run tool's timeout_s is T+20
    assert lease.parse(["--out", str(tmp_path), "--deadline-s", str(timeout - 20)])


def test_results_with_bytes_that_are_not_utf8_are_read(tmp_path, monkeypatch):
    """A results.jsonl holding bytes that are not UTF-8 (a write cut mid-character) raised
    UnicodeDecodeError in `read_results`, which the lease's report now calls for every part
    (`no_time`): lease.txt was lost; the entries around them are read."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import record

    entry = {"section": "s", "name": "a", "status": "ok"}
    (tmp_path / "results.jsonl").write_bytes(json.dumps(entry).encode() + b"\n\xa5\xff\n")
    assert record.read_results(tmp_path / "results.jsonl") == [entry]
    assert record.no_time(tmp_path) == 0

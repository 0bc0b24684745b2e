"""fp8jax.inspect: deviceless H100 compiles of the tiny GPT under every recipe."""

import copy
import dataclasses
import functools
import itertools
import pickle
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import h100_topology, make_train_step

import fp8jax
from fp8jax._src.observe import deviceless
from fp8jax._src.observe import inspect as inspect_module
from fp8jax._src.observe.gemms import hlo_gemms
from fp8jax._src.observe.ptx import compile_with_ptx, mma_inputs, ptx_kernels
from fp8jax._src.observe.roofline import H100
from fp8jax._src.observe.traffic import hlo_memory_traffic
from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss

RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(block_size=32),  # XLA's path: no native kernel at 32
    "mxfp8": fp8jax.MXFP8(),
    # XLA's GEMMs here; the fused native kernel of an H100 compile is tests/test_kernels.py's.
    "residual": fp8jax.ResidualFP8(native_kernel=False),
}
ROLES = ["dgrad", "fwd", "wgrad"]
# GEMMs per role of one FP8 Linear. The residual recipe's forward multiplies the activation by
# W_hi and by W_lo, its dgrad the gradient by both (dgrad_uses_lo), its wgrad the gradient by
# the activation; every other recipe runs one GEMM per role (a block recipe's is one batched
# dot over the blocks).
GEMMS = {name: {"fwd": 1, "dgrad": 1, "wgrad": 1} for name in RECIPES}
GEMMS["residual"] = {"fwd": 2, "dgrad": 2, "wgrad": 1}
# The high-precision rest of the GPT step: the head's fwd, dgrad and wgrad, the two attention
# einsums (scores, weights x values) forward and their four backward (two operands each).
OTHERS = 3 + 2 + 4
# One block keeps the H100 compiles (several seconds each) short; two would test nothing more.
SMALL = GPTConfig(layers=1, width=64, context=32)


@pytest.fixture(scope="module")
def h100():
    return h100_topology()


def gpt_train_step(recipe, config=SMALL):
    model = fp8jax.fp8_linear_layers(
        GPT(config, key=jax.random.PRNGKey(0)), fp8jax.Fp8Config(recipe=recipe)
    )
    optimizer = optax.adamw(1e-3)
    _, trainable = fp8jax.partition_for_grad_overwrite(model)
    opt_state = optimizer.init(eqx.filter(trainable, eqx.is_inexact_array))
    tokens = jax.ShapeDtypeStruct((8, config.context + 1), jnp.int32)
    targeted = {
        f"blocks.{i}.{part}"
        for i in range(config.layers)
        for part in ("attn.query", "attn.key", "attn.value", "attn.out", "mlp.fc1", "mlp.fc2")
    }
    return make_train_step(next_token_loss, optimizer), (model, opt_state, tokens), targeted


# Current scaling's GEMMs are delayed scaling's (the same casts and cuBLASLt calls; only where
# the scale comes from differs); its H100 compiles are test_memory's and test_gpu_check's
# (the Llama block's kernels), its FP8 dots test_lowering's (CI time).
@pytest.mark.parametrize("name", [name for name in RECIPES if name != "current"])
def test_gpt_train_step_runs_every_targeted_gemm_in_fp8(h100, name):
    step, args, targeted = gpt_train_step(RECIPES[name])
    # Each layer's own GEMMs (XLA's dot merger would fuse q, k and v under one name; the
    # merged program is checked below).
    report = fp8jax.inspect(step, *args, merge_dots=False)
    assert report.deviceless
    fp8 = len(targeted) * sum(GEMMS[name].values())
    for mode in ("cublas", "default"):
        layers = report.layers(mode)
        assert set(layers) == targeted, mode
        for layer, roles in layers.items():
            counts = {role: len(gemms) for role, gemms in roles.items()}
            assert counts == GEMMS[name], (mode, layer, counts)
            assert all(g.fp8_operands for gemms in roles.values() for g in gemms), (mode, layer)
        others = [g for g in report.gemms[mode] if g.layer is None]
        assert len(others) == OTHERS and not any(g.fp8_operands for g in others), others
        assert not any(g.fp8 for g in others), others
    # fp8jax's options (cuBLAS mode): every FP8 GEMM is cuBLASLt's FP8 kernel.
    assert report.count("cublas") == (fp8, fp8 + OTHERS)
    assert all(g.kernel == "cublasLt f8" for g in report.gemms["cublas"] if g.layer)
    fp8jax.assert_all_fp8(report)
    # XLA's defaults, deviceless: Triton kernels whose PTX converts the FP8 operands to f16
    # and multiplies on FP16 tensor cores. The inspector reads that in the PTX.
    ours = [g for g in report.gemms["default"] if g.layer]
    assert report.count("default") == (0, fp8 + OTHERS)
    for g in ours:
        assert g.kernel == "triton" and g.ptx and g.kernel_name.startswith("gemm_fusion"), g
        assert any(m.startswith("mma.sync") and ".f16.f16." in m for m in g.mma), g
        assert any(".e4m3" in u or ".e5m2" in u for u in g.upcasts), g
        assert "converts them to f16" in g.verdict and "not FP8 tensor cores" in g.verdict
    with pytest.raises(fp8jax.Fp8InspectionError, match=f"(?s){len(ours)} GEMM.*converts"):
        fp8jax.assert_all_fp8(report, modes=("cublas", "default"))


def test_residual_terms_stay_two_gemms_accumulating_in_place(h100):
    """On XLA's path (GPUs other than Hopper, or `native_kernel=False`), `x W_hi` and `x W_lo`
    share `x`: XLA's dot merger would make them one GEMM against the two kernels stacked,
    whose float32 output is twice the layer's (on benchmarks/peers.py's MLP, 94 MiB of H100
    temp memory instead of 62). ResidualFP8 keeps them apart (with the merger on, as users
    compile): two cuBLASLt FP8 calls per layer, the second adding into the first's output
    (beta = 1)."""
    step, args, targeted = gpt_train_step(fp8jax.ResidualFP8(native_kernel=False))
    report = fp8jax.inspect(step, *args, modes=("cublas",))
    for layer, roles in report.layers("cublas").items():
        assert len(roles["fwd"]) == 2, (layer, roles["fwd"])
    lowered, _ = deviceless.lower(step, args, {}, h100.devices[0])
    text = lowered.compile(compiler_options=fp8jax.gpu_compiler_options()).as_text()
    betas = [int(b) for b in re.findall(r'__cublas\$lt\$matmul\$f8".*?"beta":(\d+)', text)]
    assert betas.count(1) >= len(targeted), betas


def test_merged_gemms_stay_fp8(h100):
    """Block recipes quantize the shared input of q, k and v once; XLA then merges their GEMMs
    into one, which must still be FP8 (with every chunk of the contraction in one batched dot:
    XLA does not merge dots inside the loops of `chunks_per_dot=1`)."""
    recipe = fp8jax.BlockwiseScaling(block_size=32, chunks_per_dot=None)
    step, args, targeted = gpt_train_step(recipe)
    report = fp8jax.assert_all_fp8(fp8jax.inspect(step, *args))
    # 6 Linears x 3 GEMMs unmerged. q, k and v read the same FP8 input (quantized once): their
    # forward GEMMs merge into one, and so do their wgrads (each saves the same FP8 input behind
    # an identical barrier and retiles it along the tokens alike): 18 - 2 - 2. Their dgrads read
    # each layer's own quantized output gradient and kernel, and stay apart.
    fp8 = len(targeted) * 3 - 2 - 2
    assert report.count("cublas") == (fp8, fp8 + OTHERS)
    qkv = {f"blocks.0.attn.{name}" for name in ("query", "key", "value")}
    for mode in ("cublas", "default"):
        assert sum(g.fp8_operands for g in report.gemms[mode]) == fp8, mode
        for role, count in (("fwd", 1), ("wgrad", 1), ("dgrad", 3)):
            gemms = [g for g in report.gemms[mode] if g.role == role and g.layer in qkv]
            assert len(gemms) == count and all(g.fp8_operands for g in gemms), (role, gemms)
            assert all(g.fp8 == (mode == "cublas") for g in gemms), gemms


def test_a_train_step_is_inspected_as_it_compiles_both_its_programs(h100):
    """`inspect(train_step, state, batch)` of a `make_train_step` step compiles each of its
    programs as the step traces and compiles it in each mode: the one it runs once every
    scale is recorded (delayed scaling's kept inverses handed to cuBLASLt, XLA's dot merger
    off) and, as `first_steps`, the one before (the warm start). An MLP over 2 microbatches:
    10 FP8 GEMMs in each, fewer kernels once recorded; the same step inside a caller's own
    `jit` is the first program with XLA's merger, 7 GEMMs (its microbatches' merged)."""
    from fp8jax.examples.gpt import MLP

    mlp = fp8jax.fp8_linear_layers(MLP(512, 1, False, key=jax.random.key(0)))
    loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
    train_step = fp8jax.make_train_step(loss, optax.sgd(1e-3), microbatches=2)
    state, x = train_step.init(mlp), jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16)
    report = fp8jax.assert_all_fp8(fp8jax.inspect(train_step, state, x, modes=("cublas",)))
    first = report.first_steps
    assert report.count("cublas") == first.count("cublas") == (10, 10)
    assert len(report.cost["cublas"].kernels) < len(first.cost["cublas"].kernels)
    assert first.first_steps is None and "first steps' program" in str(report)
    own_jit = fp8jax.inspect(lambda s, x: train_step(s, x), state, x, modes=("cublas",))
    assert own_jit.count("cublas") == (7, 7) and own_jit.first_steps is None
    # assert_all_fp8 checks the first steps' program too.
    bad = dataclasses.replace(first.gemms["cublas"][0], kernel="cublas", lhs="bf16", rhs="bf16")
    first.gemms["cublas"][0] = bad
    with pytest.raises(fp8jax.Fp8InspectionError, match="1 GEMM"):
        fp8jax.assert_all_fp8(report)
    # Without the warm start the step runs one program, traced for cuBLAS: the kept inverses.
    config = fp8jax.Fp8Config(recipe=fp8jax.DelayedScaling(warm_start=False))
    cold = fp8jax.fp8_linear_layers(MLP(512, 1, False, key=jax.random.key(0)), config)
    one = fp8jax.inspect(train_step, train_step.init(cold), x, modes=("cublas",))
    assert one.first_steps is None and one.count("cublas") == (10, 10)
    kernels = [len(r.cost["cublas"].kernels) for r in (one, report, first)]
    assert kernels[0] == kernels[1] < kernels[2], kernels
    with pytest.raises(TypeError, match="TrainState first"):
        fp8jax.inspect(train_step, mlp, x)


def test_a_train_step_is_lowered_once_for_both_modes_where_they_trace_it_alike(h100, monkeypatch):
    """A mode changes a train step's trace only where the trace asks whether it is for cuBLAS
    (`is_cublas_traced`): a program whose trace did not ask is lowered once and compiled in
    both modes, and its report is that of a lowering per mode. Delayed scaling asks only once
    every scale is recorded (its kept inverses): its first steps' program is lowered once, the
    recorded one per mode (every other recipe never asks: one lowering)."""
    from fp8jax.examples.gpt import MLP

    mlp = fp8jax.fp8_linear_layers(MLP(256, 1, False, key=jax.random.key(0)))
    loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
    train_step = fp8jax.make_train_step(loss, optax.sgd(1e-3))
    state, x = train_step.init(mlp), jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    calls, lower = [], inspect_module.lower
    monkeypatch.setattr(inspect_module, "lower", lambda *a: calls.append(lower(*a)) or calls[-1])
    report = fp8jax.inspect(train_step, state, x)
    assert len(calls) == 1 + 2

    # Sound: each program lowered apart per mode (as before), the first steps' alike.
    device, texts = h100.devices[0], {}
    for mode in ("cublas", "default"):
        for name, (program, _) in train_step.programs(deviceless.MODES[mode], state).items():
            texts[name, mode] = lower(program, (state, x), {}, device)[0].as_text()
    assert texts["first", "cublas"] == texts["first", "default"]
    assert texts["recorded", "cublas"] != texts["recorded", "default"]
    # The recorded program lowered per mode, the first steps' once (not the other way round).
    lowered = sorted(lowering.as_text() for lowering, _ in calls)
    assert lowered == sorted(
        [texts["first", "cublas"], *(texts["recorded", m] for m in ("cublas", "default"))]
    )
    # FP8 on cuBLASLt; XLA's default flags make Triton GEMMs of them (the module's doc).
    for one in (report, report.first_steps):
        assert one.count("cublas") == (5, 5) and one.count("default")[1] == 5


def test_strict_check_lists_the_high_precision_gemms(h100):
    step, args, _ = gpt_train_step(RECIPES["delayed"])
    report = fp8jax.inspect(step, *args, modes=("cublas",))
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"(?s)not FP8.*eqx.nn.Linear"):
        fp8jax.assert_all_fp8(report, strict=True)
    assert "FP8" in str(report) and "temp memory" in str(report)


def test_two_e5m2_operands_run_as_a_bf16_gemm_as_hybridformats_says(h100):
    """HybridFormats' docstring: a GEMM of two E5M2 operands has no cuBLASLt FP8 kernel, so
    `forward_format="e5m2"` leaves no FP8 GEMM; E4M3 forward, E5M2 backward runs all three."""
    dims = (((1,), (0,)), ((), ()))
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

    def step(d, x, w):
        return fp8jax.filter_grad(lambda a: (a[0](a[1], a[2], dims) ** 2).sum())((d, x, w))

    fp8 = {}
    for forward in ("e4m3", "e5m2"):
        d = fp8jax.Fp8DotGeneral(fp8jax.DelayedScaling(forward_format=forward))
        report = fp8jax.inspect(step, d, x, x, modes=("cublas",))
        fp8[forward] = [g.fp8 for g in report.gemms["cublas"]]
    assert fp8 == {"e4m3": [True] * 3, "e5m2": [False] * 3}


def test_rematerialized_gelu_compiles_in_both_modes(h100):
    """XLA's cuBLAS rewriter fuses a bias + GELU epilogue with an auxiliary output into FP8
    GEMMs and fails with a RET_CHECK for the peers' formulations; fp8jax's compiles."""
    config = dataclasses.replace(SMALL, remat_gelu=True)
    step, args, _ = gpt_train_step(RECIPES["delayed"], config)
    report = fp8jax.inspect(step, *args)
    fp8jax.assert_all_fp8(report)
    assert report.count("cublas")[0] == 18
    assert sum(g.fp8_operands for g in report.gemms["default"]) == 18


def test_offending_gemm_is_reported(h100):
    """A GEMM in an fp8jax scope that is not FP8 is named, with its layer and role."""

    def fake(x, w):
        with jax.named_scope("fp8jax[blocks.9.fake]"), jax.named_scope("fwd"):
            return x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"blocks.9.fake/fwd: cublas \(bf16"):
        fp8jax.assert_all_fp8(fake, x, x)


def test_a_program_without_an_fp8_gemm_proves_nothing(h100):
    """With no GEMM of an fp8jax layer, none offends: `assert_all_fp8` once passed a model
    never converted, and a converted one called on one example (its GEMMs, matrix-vector
    products, compiled as reductions: no GEMM left). Both now raise, saying why."""
    mlp = eqx.nn.MLP(64, 64, 128, 1, key=jax.random.key(0))

    def step(m, x, batched):
        loss = lambda m, x: jnp.mean((jax.vmap(m) if batched else m)(x) ** 2)  # noqa: E731
        return fp8jax.filter_value_and_grad(loss)(m, x)

    batch = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    with pytest.raises(
        fp8jax.Fp8InspectionError, match=r"none of its \d+ GEMMs .*fp8_linear_layers"
    ):
        fp8jax.assert_all_fp8(step, mlp, batch, True)
    model = fp8jax.fp8_linear_layers(mlp, fp8jax.Fp8Config(keep=(), exclude=None))
    one = jax.ShapeDtypeStruct((64,), jnp.bfloat16)
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"no GEMM at all: .*jax.vmap it"):
        fp8jax.assert_all_fp8(step, model, one, False)
    # An empty batch: XLA leaves its products out (the error once said only to vmap).
    empty = jax.ShapeDtypeStruct((0, 64), jnp.bfloat16)
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"no GEMM at all: .*of size 0"):
        fp8jax.assert_all_fp8(step, model, empty, True)
    assert fp8jax.assert_all_fp8(step, model, batch, True).count("cublas") == (5, 5)


def test_a_keyword_fn_does_not_take_is_refused_naming_it(h100):
    """Keywords `inspect` does not know go to `fn`: `target=` or a misspelt `mode=` raised
    TypeError from inside the trace ("<lambda>() got an unexpected keyword argument"), as if
    `inspect` took them; they are now refused naming the value and both sets of keywords. A
    keyword `fn` takes (`w=`, a jit's static `n=`) is passed on, and a wrapper is not read."""
    x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    for name in ("target", "mode"):
        with pytest.raises(TypeError, match=rf"{name}='h100' is neither .*modes.*\(\['a'\]\)"):
            fp8jax.inspect(lambda a: a @ a.T, x, modes=("cublas",), **{name: "h100"})
    matmul = lambda a, *, w: a @ w  # noqa: E731
    assert fp8jax.inspect(matmul, x, w=x.update(shape=(64, 16)), modes=("cublas",)).count(
        "cublas"
    ) == (0, 1)
    rows = jax.jit(lambda a, n: a[:n] @ a.T, static_argnames="n")
    (gemm,) = fp8jax.inspect(rows, x, n=8, modes=("cublas",)).gemms["cublas"]
    assert gemm.flops == 2 * 8 * 64 * 32  # the static keyword reached the program

    def scaled(f):
        @functools.wraps(f)
        def wrapper(*args, scale=1.0):  # a keyword the wrapper takes, not the function
            return f(*args) * scale

        return wrapper

    assert fp8jax.inspect(scaled(lambda a: a @ a.T), x, scale=2.0).count("cublas") == (0, 1)


def test_a_step_jitted_with_compiler_options_is_inspected(h100):
    """The README's step, `jax.jit(step, compiler_options=...)`, is inspected as the function
    it wraps (JAX refuses compiler options on a nested jit); one nested deeper is named."""
    model = fp8jax.fp8_linear_layers(
        eqx.nn.Linear(64, 64, key=jax.random.key(0)), fp8jax.Fp8Config(keep=(), exclude=None)
    )

    def step(m, x):
        return fp8jax.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(m, x)

    x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    options = fp8jax.gpu_compiler_options()
    for jitted in (jax.jit(step, compiler_options=options), eqx.filter_jit(step)):
        assert fp8jax.inspect(jitted, model, x, modes=("cublas",)).count("cublas") == (2, 2)
    inner = jax.jit(step, compiler_options=options)
    with pytest.raises(ValueError, match=r"a jax.jit .* with compiler_options inside it"):
        fp8jax.inspect(lambda m, x: inner(m, x), model, x, modes=("cublas",))


def test_arrays_sharded_on_a_cpu_mesh_inspect_as_that_many_h100s(h100):
    """Concrete arrays sharded over this process's CPU devices compile for as many H100s, on
    a mesh of the same axes, as ShapeDtypeStructs on `h100_mesh` do: they once compiled for
    one H100, without a collective or a word. A sharding constraint on the CPU mesh inside
    the step says to build that mesh with `h100_mesh`."""
    model = fp8jax.fp8_linear_layers(
        eqx.nn.MLP(64, 64, 128, 1, key=jax.random.key(0)), fp8jax.Fp8Config(keep=(), exclude=None)
    )
    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    cpu = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def step(m, x, mesh=None):
        if mesh is not None:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
        return fp8jax.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(m, x)

    x = jax.device_put(jnp.ones((32, 64), jnp.bfloat16), NamedSharding(cpu, P("data")))
    on_cpu = fp8jax.inspect(step, model, x, modes=("cublas",))
    h100s = fp8jax.h100_mesh({"data": 4})
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(h100s, P("data")))
    on_h100s = fp8jax.inspect(step, model, abstract, h100s, modes=("cublas",))
    assert on_cpu.target == on_h100s.target and on_cpu.target.startswith("4 x ")
    assert on_cpu.count("cublas") == on_h100s.count("cublas") == (5, 5)
    ops = lambda r: sorted(c.op for c in r.collectives["cublas"])  # noqa: E731
    assert ops(on_cpu) == ops(on_h100s) and ops(on_cpu)
    assert on_cpu.cost["cublas"].flops == on_h100s.cost["cublas"].flops
    with pytest.raises(ValueError, match=r"Build that mesh with fp8jax.h100_mesh"):
        fp8jax.inspect(step, model, x, cpu, modes=("cublas",))


def test_a_step_under_set_mesh_of_an_explicit_cpu_mesh_is_inspected(h100):
    """A step run as JAX runs Explicit sharding (`jax.make_mesh`'s default axes), under
    `jax.set_mesh` of its arrays' CPU mesh, raised JAX's "context mesh ... should match the
    aval mesh": the arrays were laid out on H100s of Auto axes while the CPU mesh stayed the
    context. It now compiles as the same step on an Explicit mesh of H100s does."""
    model = fp8jax.fp8_linear_layers(
        eqx.nn.MLP(64, 64, 128, 1, key=jax.random.key(0)), fp8jax.Fp8Config(keep=(), exclude=None)
    )
    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    explicit = (jax.sharding.AxisType.Explicit,)
    cpu = jax.make_mesh((4,), ("data",), axis_types=explicit)

    def step(m, x):
        return fp8jax.filter_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(m, x)

    x = jax.device_put(jnp.ones((32, 64), jnp.bfloat16), NamedSharding(cpu, P("data")))
    with jax.set_mesh(cpu):
        on_cpu = fp8jax.inspect(step, model, x, modes=("cublas",))
    h100s = fp8jax.h100_mesh({"data": 4})
    h100s = jax.sharding.Mesh(h100s.devices, h100s.axis_names, axis_types=explicit)
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(h100s, P("data")))
    with jax.set_mesh(h100s):
        on_h100s = fp8jax.inspect(step, model, abstract, modes=("cublas",))
    assert on_cpu.target == on_h100s.target and on_cpu.target.startswith("4 x ")
    assert on_cpu.count("cublas") == on_h100s.count("cublas") == (5, 5)
    ops = lambda r: sorted(c.op for c in r.collectives["cublas"])  # noqa: E731
    assert ops(on_cpu) == ops(on_h100s) and ops(on_cpu)
    assert on_cpu.cost["cublas"].flops == on_h100s.cost["cublas"].flops


def test_stablehlo_fallback_without_the_plugin(monkeypatch):
    monkeypatch.setattr(inspect_module, "h100_topology", lambda: None)
    step, args, targeted = gpt_train_step(RECIPES["delayed"])
    report = fp8jax.inspect(step, *args)
    assert not report.deviceless and "StableHLO" in report.target
    # Why there is no H100 compiler: here the plugin is installed (the h100 extra), so it
    # did not start (as without JAX_PLATFORMS=cpu); said, not "missing".
    assert "installed, but its compiler did not start" in report.target
    assert "JAX_PLATFORMS=cpu" in report.target
    monkeypatch.setattr(deviceless.importlib.util, "find_spec", lambda name: None)
    assert "jax-cuda12-plugin is missing" in deviceless.no_h100_compiler()
    monkeypatch.undo()
    monkeypatch.setattr(inspect_module, "h100_topology", lambda: None)
    assert set(report.layers("stablehlo")) == targeted
    # Operand types only: nothing is proven to run on FP8 tensor cores.
    assert report.count("stablehlo") == (0, 18 + 6 + 3)
    assert sum(g.fp8_operands for g in report.gemms["stablehlo"]) == 18
    assert all("not proven" in g.verdict for g in report.gemms["stablehlo"])
    with pytest.raises(fp8jax.Fp8InspectionError, match="StableHLO inspection"):
        fp8jax.assert_all_fp8(report)


HLO = """
HloModule m

%fused_gemm (p0: f8e4m3fn[16,32], p1: f8e4m3fn[8,32]) -> f32[16,8] {
  %p0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[8,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/vmap(fp8jax[mlp.fc1])/fwd/dot_general"}
}

ENTRY %main (a: bf16[16,32], b: bf16[8,32]) -> f32[16,8] {
  %a = bf16[16,32]{1,0} parameter(0)
  %b = bf16[8,32]{1,0} parameter(1)
  %c = (bf16[16,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/head/dot_general"}
  ROOT %f.2 = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""

PTX = """
.version 8.8
.target sm_90a
.visible .entry f_2(
\t.param .u64 f_2_param_0
)
{
\tcvt.rn.f16x2.e4m3x2 \t%r1, %rs1;
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f5, %f6, %f7, %f8};
\tret;
}
.visible .entry g(
)
{
\twgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
\twgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3 {%f2}, %rd3, %rd4, p, 1, 1;
\tret;
}
"""


def test_ptx_parser():
    kernels = ptx_kernels([PTX])
    assert set(kernels) == {"f_2", "g"}
    assert kernels["f_2"].mma == ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",)
    assert kernels["f_2"].upcasts == ("cvt.rn.f16x2.e4m3x2",)
    assert kernels["g"].mma == ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3",)
    assert kernels["g"].upcasts == ()
    assert mma_inputs(kernels["g"].mma[0]) == "e5m2/e4m3"
    assert mma_inputs(kernels["f_2"].mma[0]) == "f16"


def test_ptx_upcasts_are_conversions_from_fp8_only():
    """A Triton GEMM fusion under XLA's defaults also quantizes its operand in the kernel
    (`cvt.rn.satfinite.e4m3x2.f16x2`, to FP8) before converting it back up: the report quoted
    that cast as the proof of the upcast ("converts them to f16 (cvt.rn.satfinite.e4m3x2)")
    where the README shows `cvt.rn.f16x2.e4m3x2`. Only a cast whose source is FP8 (PTX names
    the source type last) is an upcast."""
    quantizing = PTX.replace(
        "\tcvt.rn.f16x2.e4m3x2",
        "\tcvt.rn.satfinite.e4m3x2.f16x2 \t%rs1, %r9;\n\tcvt.rn.f16x2.e4m3x2",
    ).replace(
        "\tret;\n}\n.visible .entry g",
        "\tcvt.rn.satfinite.e5m2x2.f32 \t%rs2, %f1, %f2;\n\tret;\n}\n.visible .entry g",
    )
    assert quantizing.count("cvt.rn.satfinite") == 2
    kernels = ptx_kernels([quantizing])
    assert kernels["f_2"].upcasts == ("cvt.rn.f16x2.e4m3x2",)
    upcast = hlo_gemms(HLO, "default", kernels)
    (dot,) = [g for g in upcast if g.instruction == "dot.1"]
    assert "converts them to f16 (cvt.rn.f16x2.e4m3x2)" in dot.verdict, dot.verdict


def test_hlo_parser():
    gemms = {g.instruction: g for g in hlo_gemms(HLO, "default")}
    assert set(gemms) == {"dot.1", "c"}
    # Without PTX, FP8 operands prove nothing.
    assert gemms["dot.1"].fp8_operands and not gemms["dot.1"].fp8
    assert not gemms["dot.1"].ptx and "not found" in gemms["dot.1"].verdict
    assert gemms["dot.1"].layer == "mlp.fc1" and gemms["dot.1"].kernel_name == "f_2"
    assert gemms["dot.1"].role == "fwd" and gemms["dot.1"].kernel == "triton"
    assert not gemms["c"].fp8 and (gemms["c"].lhs, gemms["c"].kernel) == ("bf16", "cublas")
    # The kernel f_2 (the fusion f.2) upcasts: not FP8; the same GEMM run by an FP8 wgmma
    # kernel is.
    kernels = ptx_kernels([PTX])
    upcast = hlo_gemms(HLO, "default", kernels)
    (dot,) = [g for g in upcast if g.instruction == "dot.1"]
    assert dot.ptx and not dot.fp8 and "converts them to f16" in dot.verdict
    kernels["f_2"] = dataclasses.replace(kernels["g"], name="f_2")
    (dot,) = [g for g in hlo_gemms(HLO, "default", kernels) if g.layer]
    assert dot.fp8 and "FP8 tensor cores (wgmma" in dot.verdict
    assert gemms["dot.1"].flops == 2 * 16 * 8 * 32
    # Both are GEMMs, the cuBLAS call and the Triton GEMM fusion: no non-GEMM traffic.
    assert hlo_memory_traffic(HLO) == 0


def test_ptx_a_compile_rewrites_in_a_dump_folder_is_read(tmp_path):
    """`compiler_options={"xla_dump_to": DIR}` with a DIR an earlier run wrote (the same
    script run again: XLA numbers its dump files per process, so it writes the same names)
    read no PTX: only new file names were read, and every GEMM of the default mode was 'not
    proven'. A file the compile rewrote is read too."""
    name = "module_0001.jit_f.1.ptx"
    (tmp_path / name).write_text(".version 8.8\n")  # the earlier run's (its text aside)
    (tmp_path / "other.ptx").write_text(PTX.replace("f_2", "stale"))  # untouched: not read

    class Compiled:
        def as_text(self):
            return HLO

    class Lowered:  # a compile that writes its kernels' PTX into the dump folder, as XLA's
        def as_text(self):
            return HLO

        def compile(self, compiler_options):
            (tmp_path / name).write_text(PTX)
            return Compiled()

    _, module, kernels = compile_with_ptx(Lowered(), {"xla_dump_to": str(tmp_path)})
    assert kernels == ptx_kernels([PTX])
    (dot,) = [g for g in hlo_gemms(module, "default", kernels) if g.instruction == "dot.1"]
    assert dot.ptx and "converts them to f16" in dot.verdict


def test_unknown_mode():
    with pytest.raises(ValueError, match="Unknown mode 'triton'"):
        fp8jax.inspect(lambda x: x, jnp.ones(2), modes=("triton",))


LOOPS = """
HloModule m

%body (p: (s32[], f32[16,8])) -> (s32[], f32[16,8]) {
  %p = (s32[], f32[16,8]{1,0}) parameter(0)
  %a = f8e4m3fn[16,32]{1,0} constant({...})
  %b = f8e4m3fn[8,32]{1,0} constant({...})
  %g = (f32[16,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(f)/vmap(fp8jax[mlp.fc1])/fwd/while/body/dot_general"}
  ROOT %t = (s32[], f32[16,8]{1,0}) tuple(%p, %p)
}

%cond (p: (s32[], f32[16,8])) -> pred[] {
  %p = (s32[], f32[16,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: (s32[], f32[16,8])) -> (s32[], f32[16,8]) {
  %x = (s32[], f32[16,8]{1,0}) parameter(0)
  %w1 = (s32[], f32[16,8]{1,0}) while(%x), condition=%cond, body=%body, metadata={op_name="jit(f)/vmap(fp8jax[mlp.fc1])/fwd/while"}
  ROOT %w2 = (s32[], f32[16,8]{1,0}) while(%w1), condition=%cond, body=%body.clone, metadata={op_name="jit(f)/vmap(fp8jax[mlp.fc2])/dgrad/while"}
}
"""


def test_gemms_in_scan_loops_take_their_loop_s_layer():
    """JAX traces identical scan bodies once, so a loop body's GEMM may carry another layer's
    name; the loop instruction carries its own, and the inspector takes that one."""
    clone = LOOPS.split("%cond")[0].replace("%body (", "%body.clone (")
    hlo = LOOPS.replace("ENTRY", clone + "\nENTRY")
    gemms = hlo_gemms(hlo, "cublas")
    assert sorted((g.layer, g.role) for g in gemms) == [("mlp.fc1", "fwd"), ("mlp.fc2", "dgrad")]
    assert all(g.fp8 and g.kernel == "cublasLt f8" for g in gemms)


def _fp8_gemm(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def test_generated_kernels_are_judged_by_their_ptx(h100):
    """The same FP8 GEMM as a Triton kernel: XLA's deviceless default tiles upcast to f16;
    128 x 128 tiles on four warps (as an autotuner might pick on a GPU) give FP8 wgmma. Only
    the PTX tells them apart: the HLO is the same dot of two FP8 operands."""
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((256, 256), jnp.float8_e5m2)
    default = fp8jax.inspect(_fp8_gemm, a, b, modes=("default",))
    (upcast,) = default.gemms["default"]
    assert upcast.fp8_operands and upcast.kernel == "triton" and not upcast.fp8
    assert "f16" in upcast.verdict and "not FP8 tensor cores" in upcast.verdict
    tiles = "block_m:128 block_n:128 block_k:64 num_stages:3 num_warps:4 num_ctas:1"
    wide = fp8jax.inspect(
        _fp8_gemm,
        a,
        b,
        modes=("default",),
        compiler_options={"xla_gpu_override_gemm_autotuner": tiles},
    )
    (native,) = wide.gemms["default"]
    assert native.fp8 and native.fp8_operands and native.kernel == "triton"
    assert any(m.startswith("wgmma") and ".e4m3" in m for m in native.mma), native.mma
    assert native.upcasts == ()
    fp8jax.assert_all_fp8(wide, modes=("default",), strict=True)
    with pytest.raises(fp8jax.Fp8InspectionError, match="converts them to f16"):
        fp8jax.assert_all_fp8(default, modes=("default",), strict=True)
    with pytest.raises(ValueError, match="has no \\['cublas'\\]"):
        fp8jax.assert_all_fp8(default)


def test_the_cost_prices_an_upcasting_triton_gemm_at_its_16_bit_peak(h100):
    """A Triton GEMM of FP8 operands whose PTX converts them to f16 and multiplies with
    `mma.sync ... f16` runs at the FP16 tensor-core peak, not the FP8 one: the inspection's
    cost prices it at the kind its PTX multiplies (the cuBLASLt FP8 call stays FP8)."""
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((256, 256), jnp.float8_e5m2)
    report = fp8jax.inspect(_fp8_gemm, a, b)
    (gemm,) = report.gemms["default"]
    assert gemm.ptx and not gemm.fp8 and gemm.upcasts, gemm.verdict
    inputs = mma_inputs(gemm.mma[0])
    assert inputs in ("f16", "bf16"), gemm.mma
    flops = 2 * 256 * 256 * 256
    default, cublas = report.cost["default"], report.cost["cublas"]
    assert default.flops == {inputs: flops}
    assert default.gemm_seconds() == pytest.approx(flops / H100[inputs])
    assert cublas.flops == {"fp8": flops}
    assert cublas.gemm_seconds() == pytest.approx(flops / H100["fp8"])


def test_the_dump_holds_the_ptx_and_no_pass_logs(h100, tmp_path):
    """The inspector reads the PTX XLA writes, and asks for nothing more: dumps of every
    emitter's passes made each compile ten times slower."""
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((256, 256), jnp.float8_e5m2)
    report = fp8jax.inspect(
        _fp8_gemm, a, b, modes=("default",), compiler_options={"xla_dump_to": str(tmp_path)}
    )
    assert all(g.ptx for g in report.gemms["default"])
    names = [p.name for p in tmp_path.iterdir()]
    assert any(n.endswith(".ptx") for n in names)
    assert not [n for n in names if n.endswith((".mlir-passes.log", ".ttir", ".mlir"))], names


def test_assert_all_fp8_checks_fp8jax_s_options_by_default(h100, monkeypatch):
    """A function given to assert_all_fp8 is compiled in cuBLAS mode only (the options
    make_train_step uses), and passes there."""
    seen = []
    real = inspect_module.inspect

    def spy(fn, *args, modes, **kwargs):
        seen.append(modes)
        return real(fn, *args, modes=modes, **kwargs)

    monkeypatch.setattr(inspect_module, "inspect", spy)
    a = jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn)
    report = fp8jax.assert_all_fp8(_fp8_gemm, a, a, strict=True)
    assert seen == [("cublas",)] and report.count("cublas") == (1, 1)
    for bad in ("cublas", (), 3):
        with pytest.raises(ValueError, match="modes="):
            fp8jax.assert_all_fp8(report, modes=bad)


MOSAIC_SCRIPT = """
import json, os, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import fp8jax

def tiling(a):
    swizzle = plgpu.find_swizzle(a.shape[1] * 8 * a.dtype.itemsize)
    return (plgpu.TilingTransform((8, swizzle // a.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

def kernel_gemm(a, b):
    # One warpgroup: a (64, K) times b (N, K) transposed, wgmma into a float32 accumulator,
    # as a `plgpu.kernel` (its op_name carries the body's name).
    m, k = a.shape
    n = b.shape[0]
    tiles = tiling(a)

    def body(a_gmem, b_gmem, o_gmem, o_smem):
        def step(_, a_smem, b_smem):
            def mm(acc):
                plgpu.wgmma(acc, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
                return acc[...]
            o_smem[...] = pl.run_scoped(mm, plgpu.ACC((m, n), jnp.float32))

        plgpu.emit_pipeline(
            step,
            grid=(1,),
            in_specs=[plgpu.BlockSpec((m, k), lambda i: (0, 0), transforms=tiles),
                      plgpu.BlockSpec((n, k), lambda i: (0, 0), transforms=tiles)],
        )(a_gmem, b_gmem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    with jax.named_scope("fp8jax[tile]"), jax.named_scope("fwd"):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
            scratch_types=[plgpu.SMEM((m, n), jnp.float32)],
        )(a, b)

def call_gemm(a, b):
    # The same product as a `pallas_call` (its op_name says only "pallas_call"); Mosaic GPU
    # lowers these up to JAX 0.10.
    m, k = a.shape
    n = b.shape[0]
    tiles = tiling(a)

    def body(a_ref, b_ref, o_ref):
        def mm(acc):
            plgpu.wgmma(acc, a_ref, plgpu.transpose_ref(b_ref, (1, 0)))
            return acc[...]
        o_ref[...] = pl.run_scoped(mm, plgpu.ACC((m, n), jnp.float32))

    with jax.named_scope("fp8jax[tile]"), jax.named_scope("fwd"):
        return pl.pallas_call(
            body,
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            in_specs=[plgpu.BlockSpec((m, k), lambda: (0, 0), transforms=tiles),
                      plgpu.BlockSpec((n, k), lambda: (0, 0), transforms=tiles)],
            out_specs=plgpu.BlockSpec((m, n), lambda: (0, 0)),
            compiler_params=plgpu.CompilerParams(),
        )(a, b)

forms = {"kernel": kernel_gemm}
if jax.__version_info__ < (0, 11):
    forms["pallas_call"] = call_gemm
out = {}
for form, fn in forms.items():
    for dtype, k in ((jnp.float8_e4m3fn, 128), (jnp.bfloat16, 64)):
        a = jax.ShapeDtypeStruct((64, k), dtype)
        b = jax.ShapeDtypeStruct((128, k), dtype)
        report = fp8jax.inspect(fn, a, b)
        out.setdefault(form, {})[jnp.dtype(dtype).name] = {
            mode: [(g.kernel, g.fp8, g.ptx, g.mma, g.verdict) for g in gemms]
            for mode, gemms in report.gemms.items()
        }
print(json.dumps(out))
"""


def _run_mosaic_script(tmp_path, dump: bool) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("MOSAIC_GPU_DUMP_PTX", None)
    if dump:
        env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", MOSAIC_SCRIPT], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_pallas_mosaic_gpu_kernels_are_judged_by_their_ptx(h100, tmp_path):
    """A Pallas Mosaic GPU GEMM in an fp8jax layer's scope: FP8 wgmma for FP8 operands,
    BF16 wgmma for BF16 ones, read from Mosaic's PTX dump (the same kernel in both modes:
    Mosaic compiles it once per process); without the dump, not proven. Written as a
    `plgpu.kernel` and, on JAX releases whose Mosaic GPU still lowers one, a `pallas_call`."""
    seen = _run_mosaic_script(tmp_path, dump=True)
    forms = ["kernel"] + (["pallas_call"] if jax.__version_info__ < (0, 11) else [])
    assert sorted(seen) == sorted(forms)
    for form, mode in itertools.product(forms, ("cublas", "default")):
        ((kernel, fp8, ptx, mma, verdict),) = seen[form]["float8_e4m3fn"][mode]
        assert (kernel, fp8, ptx) == ("pallas mosaic gpu", True, True), (form, verdict)
        assert any(m.startswith("wgmma.mma_async") and m.endswith(".e4m3.e4m3") for m in mma)
        ((kernel, fp8, ptx, mma, verdict),) = seen[form]["bfloat16"][mode]
        assert (kernel, fp8, ptx) == ("pallas mosaic gpu", False, True), (form, verdict)
        assert "BF16 tensor cores (wgmma" in verdict, verdict
    blind = _run_mosaic_script(tmp_path / "unused", dump=False)
    for form in forms:
        ((kernel, fp8, ptx, _, verdict),) = blind[form]["float8_e4m3fn"]["cublas"]
        assert (kernel, fp8, ptx) == ("pallas mosaic gpu", False, False)
        assert "MOSAIC_GPU_DUMP_PTX=1" in verdict and "not proven" in verdict


def test_a_layer_named_with_brackets_keeps_its_name_and_role(h100):
    """A GEMM scope with brackets (`fp8_autocast` under `jax.named_scope("layers[0]")`) was
    read as layer `layers[0` with no role; each GEMM now has its scope's name and role."""

    def f(x, w1, w2):
        with jax.named_scope("layers[0]"):
            h = jnp.tanh(x @ w1)
        with jax.named_scope("layers[1]"):
            return h @ w2

    def grads(x, w1, w2):
        loss = lambda *a: jnp.sum(fp8jax.fp8_autocast(f)(*a).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    x, w1, w2 = (
        jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(256, 512), (512, 512), (512, 256)]
    )
    report = fp8jax.inspect(grads, x, w1, w2, modes=("cublas",))
    layers = report.layers("cublas")
    # Both layers' fwd, dgrad and wgrad: one GEMM each (x's gradient asked for too).
    assert {name: sorted(roles) for name, roles in layers.items()} == {
        "layers[0]": ROLES,
        "layers[1]": ROLES,
    }
    assert all(len(gemms) == 1 for roles in layers.values() for gemms in roles.values())
    assert "layers[0]/fwd: cublasLt f8" in str(report)


def test_an_ensemble_s_gemms_keep_their_roles(h100):
    """Under `eqx.filter_vmap` over an ensemble, JAX names a GEMM's role scope `vmap(fwd)`
    (`fp8jax[layers.0]/vmap(fwd)/dot_general`): the inspector read no role there, and put
    every GEMM of the layer under `?`. Each layer now has its fwd, dgrad and wgrad."""
    ensemble = eqx.filter_vmap(lambda key: eqx.nn.MLP(32, 32, 64, 1, key=key))(
        jax.random.split(jax.random.key(0), 3)
    )
    model = fp8jax.fp8_linear_layers(ensemble, fp8jax.Fp8Config(keep=(), exclude=None))

    def step(m, x):
        run = eqx.filter_vmap(lambda m, x: jax.vmap(m)(x), in_axes=(eqx.if_array(0), None))
        return fp8jax.filter_grad(lambda m: jnp.mean(run(m, x).astype(jnp.float32) ** 2))(m)

    x = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
    report = fp8jax.inspect(step, model, x, modes=("cublas",))
    assert any("/vmap(fwd)/" in g.op_name for g in report.gemms["cublas"])
    # The first layer's dgrad (the input's gradient) is not asked for.
    assert {name: sorted(roles) for name, roles in report.layers("cublas").items()} == {
        "layers.0": ["fwd", "wgrad"],
        "layers.1": ROLES,
    }


def test_a_gemm_in_a_loop_counts_its_runs(h100):
    """A block recipe's GEMM runs once per chunk of K, in a loop: its `flops` are one run's,
    and nothing said how many runs there were (l1/fwd below read 2*M*N*32, a quarter of its
    GEMM). `runs` now counts them, as for a scan over layers."""
    m, k, n, block, layers = 256, 128, 64, 32, 3
    linear = eqx.nn.Linear(k, n, key=jax.random.key(0), dtype=jnp.bfloat16)
    model = fp8jax.fp8_linear_layers(
        linear, fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(block_size=block))
    )
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    report = fp8jax.inspect(lambda model, x: jax.vmap(model)(x), model, x, modes=("cublas",))
    (fwd,) = report.gemms["cublas"]
    assert fwd.fp8 and fwd.role == "fwd"
    assert (fwd.runs, fwd.flops * fwd.runs) == (k // block, 2 * m * n * k)

    def scan(x, w):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=layers)[0]

    w = jax.ShapeDtypeStruct((k, k), jnp.bfloat16)
    report = fp8jax.inspect(scan, x, w, modes=("cublas",))
    (gemm,) = report.gemms["cublas"]
    assert (gemm.runs, gemm.flops * gemm.runs) == (layers, layers * 2 * m * k * k)
    assert gemm.flops * gemm.runs == report.cost["cublas"].gemm_flops


def test_a_gemm_in_a_branch_inside_a_loop_counts_the_loop_s_runs(h100):
    """A GEMM in a `lax.cond` branch in a scan body was not seen inside the loop (branches
    were not followed up to it): `runs` read 1 for a GEMM that runs once per step."""
    m, k, steps = 256, 512, 5

    def f(p, x, w):
        def body(h, _):
            return jax.lax.cond(p, lambda: jnp.tanh(h @ w), lambda: h * 2), None

        return jax.lax.scan(body, x, None, length=steps)[0]

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((), bool), ((m, k), jnp.bfloat16)]]
    w = jax.ShapeDtypeStruct((k, k), jnp.bfloat16)
    (gemm,) = fp8jax.inspect(f, *args, w, modes=("cublas",)).gemms["cublas"]
    assert (gemm.runs, gemm.flops * gemm.runs) == (steps, steps * 2 * m * k * k)


def test_unnamed_autocast_gemms_are_numbered_in_program_order(h100):
    """`fp8_autocast` named every GEMM outside a `jax.named_scope` `dot_general`, so two of
    them read as one layer in the report (`layers()` merged them). They are now numbered in
    program order: `dot_general`, `dot_general_1`, each with its own shape."""
    shapes = {"dot_general": (32, 64, 32), "dot_general_1": (32, 64, 48)}

    def f(x, w1, w2):
        return jnp.sum(x @ w1) + jnp.sum(x @ w2)

    x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
    w1, w2 = (jax.ShapeDtypeStruct(s[1:], jnp.bfloat16) for s in shapes.values())
    autocast = fp8jax.fp8_autocast(f)
    report = fp8jax.inspect(autocast, x, w1, w2, modes=("cublas",), merge_dots=False)
    layers = report.layers("cublas")
    assert sorted(layers) == sorted(shapes)
    for name, (m, k, n) in shapes.items():
        (gemm,) = layers[name]["fwd"]
        assert gemm.fp8 and gemm.flops == 2 * m * k * n


def test_autocast_gemms_sharing_a_named_scope_are_numbered_in_program_order(h100):
    """Two GEMMs in one `jax.named_scope` were both named by it: `layers()` gave one row
    holding both, their figures indistinguishable. The first keeps the scope's name, the
    next is numbered (`mlp`, `mlp_1`), each with its own shape; a scope holding one GEMM
    keeps its name."""
    m, k, n1, n2 = 32, 64, 48, 80

    def f(x, w1, w2, w3):
        with jax.named_scope("mlp"):
            h = jnp.tanh(x @ w1) @ w2
        with jax.named_scope("head"):
            return jnp.sum(h @ w3)

    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((k, n1), (n1, n2), (n2, k)))
    report = fp8jax.inspect(fp8jax.fp8_autocast(f), x, *ws, modes=("cublas",), merge_dots=False)
    layers = report.layers("cublas")
    expected = {"mlp": 2 * m * k * n1, "mlp_1": 2 * m * n1 * n2, "head": 2 * m * n2 * k}
    assert sorted(layers) == sorted(expected)
    assert len(report.gemms["cublas"]) == 3
    for name, flops in expected.items():
        (gemm,) = layers[name]["fwd"]
        assert gemm.fp8 and gemm.flops == flops, (name, gemm)


def test_gemms_in_the_branches_of_a_cond_count_the_branch_the_cost_counts(h100):
    """In a `lax.cond`, each branch's GEMM read `runs=1`, as if both branches ran, while the
    cost counts the costliest branch only: the GEMMs' `flops * runs` summed past the cost's
    FLOPs. The costliest branch's GEMM now runs once and the other's none, as in the cost."""
    m, k, small, large = 32, 64, 32, 256

    def f(p, x, a, b):
        return jax.lax.cond(p, lambda: jnp.sum(x @ a), lambda: jnp.sum(jnp.tanh(x) @ b))

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [((), bool), ((m, k), jnp.bfloat16)]]
    a, b = (jax.ShapeDtypeStruct((k, n), jnp.bfloat16) for n in (small, large))
    report = fp8jax.inspect(f, *args, a, b, modes=("cublas",))
    runs = {g.flops: g.runs for g in report.gemms["cublas"]}
    assert runs == {2 * m * k * small: 0, 2 * m * k * large: 1}
    flops = sum(g.flops * g.runs for g in report.gemms["cublas"])
    assert flops == report.cost["cublas"].gemm_flops == 2 * m * k * large


def test_an_xla_ragged_dot_counts_the_dense_product_it_executes(h100):
    """`Gemm.flops` is what the kernel executes (fp8jax's kernels count their padded shapes).
    XLA runs a `lax.ragged_dot` as one dense GEMM over every group (tokens by groups x K, zero
    outside each token's group): its `flops` are that product, `groups` times the ragged
    2*M*K*N, as the cost counts it; its docstring now says so."""
    m, k, n, groups = 64, 32, 48, 4

    def f(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes)

    args = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in [((m, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16), ((groups,), jnp.int32)]
    ]
    report = fp8jax.inspect(f, *args, modes=("cublas",))
    (gemm,) = report.gemms["cublas"]
    assert "ragged_dot" in gemm.op_name and gemm.runs == 1
    assert gemm.flops == 2 * m * (groups * k) * n == groups * (2 * m * k * n)
    assert report.cost["cublas"].gemm_flops == gemm.flops


def test_an_inspection_deep_copies_and_pickles_with_its_memory_figures(h100):
    """`copy.deepcopy` and `pickle` of a deviceless inspection failed, "cannot pickle
    'CompiledMemoryStats'": its `memory` held XLA's object. It holds a record of the object's
    figures now: every field equal to the executable's own `memory_analysis()`, copied and
    round-tripped through pickle alike."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 32), jnp.bfloat16)
    matmul = lambda x, w: x @ w  # noqa: E731
    report = fp8jax.inspect(matmul, x, w, modes=("cublas",))
    lowered, _ = deviceless.lower(matmul, (x, w), {}, h100.devices[0])
    original = lowered.compile(compiler_options=deviceless.MODES["cublas"]).memory_analysis()
    names = [n for n in dir(original) if not n.startswith("_")]
    assert "temp_size_in_bytes" in names and original.temp_size_in_bytes > 0
    for inspection in (report, copy.deepcopy(report), pickle.loads(pickle.dumps(report))):
        memory = inspection.memory["cublas"]
        for name in names:
            assert getattr(memory, name) == getattr(original, name), name
        assert f"temp memory: {original.temp_size_in_bytes} bytes" in str(inspection)


def test_cudnn_attention_on_a_machine_without_cudnn_is_refused_saying_why():
    """JAX checks for cuDNN while tracing cuDNN attention: `fp8jax.inspect` of such a function
    on a machine without it raised JAX's bare "cuDNN not found."; it now says that the
    function calls cuDNN, that this machine has none, and what to inspect instead."""
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    try:
        jax.jit(attention).trace(q, q, q)
    except RuntimeError as e:
        assert "cuDNN not found" in str(e)
    else:
        pytest.skip("cuDNN is installed here: JAX traces cuDNN attention")
    with pytest.raises(RuntimeError, match=r"it calls cuDNN .* implementation='xla'"):
        fp8jax.inspect(attention, q, q, q, modes=("cublas",))

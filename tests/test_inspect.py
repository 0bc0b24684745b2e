"""fp8jax.inspect: deviceless H100 compiles of the tiny GPT under every recipe."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import make_train_step

import fp8jax
from fp8jax._src import inspect as inspect_module
from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss

RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "current": fp8jax.CurrentScaling(),
    "blockwise": fp8jax.BlockwiseScaling(block_size=32),
    "mxfp8": fp8jax.MXFP8(),
    "residual": fp8jax.ResidualFP8(),
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
    topology = inspect_module.h100_topology()
    assert topology is not None, "the H100 checks need the h100 extra: pip install -e '.[h100]'"
    return topology


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


@pytest.mark.parametrize("name", RECIPES)
def test_gpt_train_step_runs_every_targeted_gemm_in_fp8(h100, name):
    step, args, targeted = gpt_train_step(RECIPES[name])
    # Each layer's own GEMMs (XLA's dot merger would fuse q, k and v under one name; the
    # merged program is checked below).
    report = fp8jax.inspect(step, *args, merge_dots=False)
    assert report.deviceless
    for mode in ("cublas", "default"):
        layers = report.layers(mode)
        assert set(layers) == targeted, mode
        for layer, roles in layers.items():
            counts = {role: len(gemms) for role, gemms in roles.items()}
            assert counts == GEMMS[name], (mode, layer, counts)
            assert all(g.fp8 for gemms in roles.values() for g in gemms), (mode, layer)
        others = [g for g in report.gemms[mode] if g.layer is None]
        assert len(others) == OTHERS and not any(g.fp8 for g in others), others
        fp8 = len(targeted) * sum(GEMMS[name].values())
        assert report.count(mode) == (fp8, fp8 + OTHERS), mode
        if mode == "cublas":
            assert all(g.kernel == "cublasLt f8" for g in report.gemms[mode] if g.layer)


def test_merged_gemms_stay_fp8(h100):
    """Block recipes quantize the shared input of q, k and v once; XLA then merges their GEMMs
    into one, which must still be FP8 (with every chunk of the contraction in one batched dot:
    XLA does not merge dots inside the loops of `chunks_per_dot=1`)."""
    recipe = fp8jax.BlockwiseScaling(block_size=32, chunks_per_dot=None)
    step, args, targeted = gpt_train_step(recipe)
    report = fp8jax.assert_all_fp8(step, *args)
    # 6 Linears x 3 GEMMs unmerged. The forward GEMMs of q, k and v read the same FP8
    # operand (the input, quantized once) and merge into one: 18 - 3 + 1. Every backward GEMM
    # reads an operand of its own layer (its quantized output gradient; the wgrads' activation
    # retiled along tokens in each layer's backward), so none of them merges.
    fp8 = len(targeted) * 3 - 3 + 1
    for mode in ("cublas", "default"):
        assert report.count(mode) == (fp8, fp8 + OTHERS), mode
        qkv = {f"blocks.0.attn.{name}" for name in ("query", "key", "value")}
        merged = [g for g in report.gemms[mode] if g.role == "fwd" and g.layer in qkv]
        assert len(merged) == 1 and merged[0].fp8, merged


def test_strict_check_lists_the_high_precision_gemms(h100):
    step, args, _ = gpt_train_step(RECIPES["delayed"])
    report = fp8jax.inspect(step, *args, modes=("cublas",))
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"(?s)not FP8.*eqx.nn.Linear"):
        fp8jax.assert_all_fp8(report, strict=True)
    assert "FP8" in str(report) and "temp memory" in str(report)


def test_rematerialized_gelu_compiles_in_both_modes(h100):
    """XLA's cuBLAS rewriter fuses a bias + GELU epilogue with an auxiliary output into FP8
    GEMMs and fails with a RET_CHECK for the peers' formulations; fp8jax's compiles."""
    config = dataclasses.replace(SMALL, remat_gelu=True)
    step, args, _ = gpt_train_step(RECIPES["delayed"], config)
    report = fp8jax.assert_all_fp8(step, *args)
    assert report.count("cublas")[0] == report.count("default")[0] == 18


def test_offending_gemm_is_reported(h100):
    """A GEMM in an fp8jax scope that is not FP8 is named, with its layer and role."""

    def fake(x, w):
        with jax.named_scope("fp8jax[blocks.9.fake]"), jax.named_scope("fwd"):
            return x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    with pytest.raises(fp8jax.Fp8InspectionError, match=r"blocks.9.fake/fwd: cublas \(bf16"):
        fp8jax.assert_all_fp8(fake, x, x)


def test_stablehlo_fallback_without_the_plugin(monkeypatch):
    monkeypatch.setattr(inspect_module, "h100_topology", lambda: None)
    step, args, targeted = gpt_train_step(RECIPES["delayed"])
    report = fp8jax.inspect(step, *args)
    assert not report.deviceless and "StableHLO" in report.target
    assert set(report.layers("stablehlo")) == targeted
    assert report.count("stablehlo") == (18, 18 + 6 + 3)
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
  ROOT %f = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_gemm
}
"""


def test_hlo_parser():
    gemms = {g.instruction: g for g in inspect_module.hlo_gemms(HLO, "default")}
    assert set(gemms) == {"dot.1", "c"}
    assert gemms["dot.1"].fp8 and gemms["dot.1"].layer == "mlp.fc1"
    assert gemms["dot.1"].role == "fwd" and gemms["dot.1"].kernel == "triton"
    assert not gemms["c"].fp8 and (gemms["c"].lhs, gemms["c"].kernel) == ("bf16", "cublas")
    assert gemms["dot.1"].flops == 2 * 16 * 8 * 32
    # The fusion reads a (bf16 16x32) and b (bf16 8x32) and writes f32 16x8.
    assert inspect_module.hlo_memory_traffic(HLO) == 2 * 16 * 32 + 2 * 8 * 32 + 4 * 16 * 8


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
    gemms = inspect_module.hlo_gemms(hlo, "cublas")
    assert sorted((g.layer, g.role) for g in gemms) == [("mlp.fc1", "fwd"), ("mlp.fc2", "dgrad")]
    assert all(g.fp8 and g.kernel == "cublasLt f8" for g in gemms)

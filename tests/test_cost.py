"""hlo_cost: GEMM FLOPs and non-GEMM bytes of optimized HLO, against hand-computed numbers."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax._src.observe import deviceless
from fp8jax._src.observe.cost import hlo_cost
from fp8jax._src.observe.roofline import CATEGORIES, H100, Cost, KernelCost

M, N, K = 256, 512, 256

# --- pure text -----------------------------------------------------------------------------

# A loop of 10 steps: a bf16 GEMM (64x32 @ 32x32), a tanh of its output, and a slice of one
# (64, 32) float32 plane out of a (10, 64, 32) stack; the loop counter lives in the tuple.
LOOP = """HloModule loop, is_scheduled=true

%fused_tanh (param_0: bf16[64,32]) -> bf16[64,32] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  ROOT %tanh.1 = bf16[64,32]{1,0} tanh(%param_0)
}

%fused_slice (param_0.1: f32[10,64,32], param_1.1: s32[]) -> f32[1,64,32] {
  %param_0.1 = f32[10,64,32]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,64,32]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %constant_0, %constant_0), dynamic_slice_sizes={1,64,32}
}

%body (arg: (s32[], bf16[64,32], bf16[32,32], f32[10,64,32])) -> (s32[], bf16[64,32], bf16[32,32], f32[10,64,32]) {
  %arg = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[32,32]{1,0} get-tuple-element(%arg), index=2
  %stack = f32[10,64,32]{2,1,0} get-tuple-element(%arg), index=3
  %gemm = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = bf16[64,32]{1,0} get-tuple-element(%gemm), index=0
  %tanh_fusion = bf16[64,32]{1,0} fusion(%y), kind=kLoop, calls=%fused_tanh
  %slice_fusion = f32[1,64,32]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  ROOT %next = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) tuple(%i, %tanh_fusion, %w, %stack)
}

%cond (arg.1: (s32[], bf16[64,32], bf16[32,32], f32[10,64,32])) -> pred[] {
  %arg.1 = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %lt = pred[] compare(%i.1, %i.1), direction=LT
}

ENTRY %main (p0: bf16[64,32], p1: bf16[32,32], p2: f32[10,64,32]) -> bf16[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,32]{1,0} parameter(1)
  %p2 = f32[10,64,32]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) tuple(%zero, %p0, %p1, %p2)
  %while = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="OP_NAME"}TRIP
  ROOT %out = bf16[64,32]{1,0} get-tuple-element(%while), index=1
}
"""  # noqa: E501 - verbatim HLO
KNOWN = ', backend_config={"known_trip_count":{"n":"10"},"known_init_step":{"init":"0","step":"1"}}'
GEMM_FLOPS = 2 * 64 * 32 * 32
TANH_BYTES = 2 * (64 * 32 * 2)  # read and write a (64, 32) bf16 array
SLICE_BYTES = 2 * (64 * 32 * 4) + 4  # read one float32 plane and the index, write the plane
COMPARE_BYTES = 4 + 4 + 1


def loop(trip: str = KNOWN, op_name: str = "jit(step)/while") -> str:
    return LOOP.replace("TRIP", trip).replace("OP_NAME", op_name)


def test_loop_with_known_trip_count_multiplies_its_body():
    cost = hlo_cost(loop())
    assert cost.flops == {"bf16": 10 * GEMM_FLOPS}
    assert cost.bytes == {
        "rest": 10 * TANH_BYTES + 11 * COMPARE_BYTES,  # the condition runs once more
        "transpose/copy": 10 * SLICE_BYTES,  # a slice only moves data, and reads its part
    }
    assert cost.unknown_trip_counts == ()
    assert {k.name: k.runs for k in cost.kernels} == {
        "gemm": 10,
        "tanh_fusion": 10,
        "slice_fusion": 10,
        "lt": 11,
    }
    seconds = 10 * GEMM_FLOPS / H100["bf16"] + cost.total_bytes / H100["hbm"]
    assert cost.estimate_seconds() == pytest.approx(seconds)


def test_loop_without_trip_count_is_counted_once_and_named():
    cost = hlo_cost(loop(trip=""))
    assert cost.flops == {"bf16": GEMM_FLOPS}
    assert cost.bytes["rest"] == TANH_BYTES + 2 * COMPARE_BYTES
    assert cost.unknown_trip_counts == ("while",)


def test_loop_of_an_fp8jax_layer_holds_block_partials():
    cost = hlo_cost(loop(op_name="jit(step)/fp8jax[blocks.0.mlp.fc1]/fwd/while"))
    assert cost.bytes == {"block partials": 10 * (TANH_BYTES + SLICE_BYTES) + 11 * COMPARE_BYTES}


def test_nested_loops_multiply():
    inner = loop()
    body = inner[inner.index("%body") : inner.index("ENTRY")]
    # An outer loop of 3 steps whose body runs the whole inner loop.
    outer = (
        body.replace("%body", "%outer_body")
        .replace("%cond", "%outer_cond")
        .replace("%gemm = ", "%gemm.o = ")
        .replace("(%gemm)", "(%gemm.o)")
    )
    outer = outer.replace(
        "  %y = ",
        "  %inner = (s32[], bf16[64,32]{1,0}, bf16[32,32]{1,0}, f32[10,64,32]{2,1,0}) while(%arg),"
        ' condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}\n  %y = ',
        1,
    )
    entry = inner[inner.index("ENTRY") :].replace(
        "condition=%cond, body=%body", "condition=%outer_cond, body=%outer_body"
    )
    entry = entry.replace('"n":"10"', '"n":"3"')
    cost = hlo_cost(inner[: inner.index("ENTRY")] + outer + entry)
    assert cost.flops == {"bf16": 3 * GEMM_FLOPS + 3 * 10 * GEMM_FLOPS}


BRANCHES = """HloModule branches, is_scheduled=true

%small (p: bf16[64,32]) -> bf16[64,32] {
  %p = bf16[64,32]{1,0} parameter(0)
  ROOT %neg = bf16[64,32]{1,0} negate(%p)
}

%big (p.1: bf16[64,32]) -> bf16[64,32] {
  %p.1 = bf16[64,32]{1,0} parameter(0)
  %neg.1 = bf16[64,32]{1,0} negate(%p.1)
  ROOT %neg.2 = bf16[64,32]{1,0} negate(%neg.1)
}

ENTRY %main (flag: pred[], x: bf16[64,32]) -> bf16[64,32] {
  %flag = pred[] parameter(0)
  %x = bf16[64,32]{1,0} parameter(1)
  %c = bf16[64,32]{1,0} conditional(%flag, %x, %x), true_computation=%small, false_computation=%big
  ROOT %k = bf16[64,32]{1,0} call(%c), to_apply=%small
}
"""


def test_conditional_counts_its_costliest_branch_and_call_its_callee():
    negate = 2 * 64 * 32 * 2  # read and write a (64, 32) bf16 array
    cost = hlo_cost(BRANCHES)
    assert cost.bytes == {"rest": 2 * negate + negate}
    assert [k.name for k in cost.kernels] == ["neg.1", "neg.2", "neg"]


SLICES = """HloModule slices, is_scheduled=true

%fused_update (param_0: f32[10,64,32], param_1: f32[64,32], param_2: s32[]) -> f32[10,64,32] {
  %param_0 = f32[10,64,32]{2,1,0} parameter(0)
  %param_1 = f32[64,32]{1,0} parameter(1)
  %negate.1 = f32[64,32]{1,0} negate(%param_1)
  %bitcast.1 = f32[1,64,32]{2,1,0} bitcast(%negate.1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[10,64,32]{2,1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_2, %zero, %zero)
}

ENTRY %main (stack: f32[10,64,32], x: f32[64,32], i: s32[]) -> (f32[10,64,32], f32[1,64,32]) {
  %stack = f32[10,64,32]{2,1,0} parameter(0)
  %x = f32[64,32]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  %update = f32[10,64,32]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_update
  %plane = f32[1,64,32]{2,1,0} dynamic-slice(%update, %i, %zero.1, %zero.1), dynamic_slice_sizes={1,64,32}
  ROOT %out = (f32[10,64,32]{2,1,0}, f32[1,64,32]{2,1,0}) tuple(%update, %plane)
}
"""  # noqa: E501 - verbatim HLO


def test_slices_read_and_in_place_updates_write_only_their_part():
    plane = 64 * 32 * 4
    cost = hlo_cost(SLICES)
    kernels = {k.name: (k.category, k.bytes) for k in cost.kernels}
    # x read, its negation written into one plane of the stack in place, the index read
    assert kernels["update"] == ("rest", plane + plane + 4)
    # one plane read (not the whole stack), written, the indices read
    assert kernels["plane"] == ("transpose/copy", plane + plane + 3 * 4)


def test_cost_arithmetic():
    a = Cost({"fp8": 10}, {"amax": 4})
    b = Cost({"fp8": 1, "bf16": 2}, {"rest": 3})
    assert (a + b).flops == {"fp8": 11, "bf16": 2}
    assert (a + b).bytes == {"amax": 4, "rest": 3}
    assert (3 * a).flops == {"fp8": 30} and (a * 3).bytes == {"amax": 12}
    assert (a + b).gemm_flops == 13 and (a + b).total_bytes == 7
    assert set(CATEGORIES) >= set((a + b).bytes)
    with pytest.raises(TypeError, match="repeats=0.5"):
        a * 0.5


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_cost("HloModule nothing")
    with pytest.raises(ValueError, match="'int8'"):
        Cost({"int8": 1}).estimate_seconds()
    with pytest.raises(TypeError, match="hlo=3"):
        hlo_cost(3)


# --- deviceless H100 compiles --------------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
    topology = deviceless.h100_topology()
    if topology is None:
        pytest.skip("the H100 compiles need the h100 extra: pip install -e '.[h100]'")
    return topology


def compiled(h100, fn, *args) -> str:
    lowered, _ = deviceless.lower(fn, args, {}, h100.devices[0])
    return lowered.compile(compiler_options=deviceless.MODES["cublas"]).as_text()


def spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_bf16_gemm_flops(h100):
    cost = hlo_cost(compiled(h100, lambda x, w: x @ w, spec(M, K), spec(K, N)))
    assert cost.flops == {"bf16": 2 * M * N * K}
    assert cost.bytes == {}  # its operands and result are the GEMM's: no other kernel


def test_scan_of_seven_matmuls_counts_seven(h100):
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=7)[0]

    cost = hlo_cost(compiled(h100, f, spec(M, M), spec(M, M)))
    assert cost.flops == {"bf16": 7 * 2 * M * M * M}
    assert cost.unknown_trip_counts == ()
    tanh = [k for k in cost.kernels if k.category == "rest" and k.bytes == 2 * M * M * 2]
    assert [k.runs for k in tanh] == [7]


def test_float32_gemm_is_tf32(h100):
    cost = hlo_cost(compiled(h100, lambda x, w: x @ w, spec(M, K, dtype=jnp.float32), spec(K, N)))
    assert cost.flops == {"tf32": 2 * M * N * K}


def test_cast_to_fp8_is_quantize(h100):
    cost = hlo_cost(compiled(h100, lambda x: x.astype(jnp.float8_e4m3fn), spec(M, N)))
    assert cost.bytes == {"quantize": M * N * 2 + M * N * 1}
    (kernel,) = cost.kernels
    assert kernel.category == "quantize" and kernel.runs == 1


def test_amax_alone(h100):
    cost = hlo_cost(compiled(h100, lambda x: jnp.max(jnp.abs(x.astype(jnp.float32))), spec(M, N)))
    assert set(cost.bytes) == {"amax"}
    # Read x once, write a float32 scalar; XLA may reduce in two kernels, writing and reading
    # at most one float32 partial per row in between.
    assert M * N * 2 + 4 <= cost.bytes["amax"] <= M * N * 2 + 4 + 2 * 4 * M


def test_cast_fused_with_amax_is_quantize(h100):
    def f(x):
        return x.astype(jnp.float8_e4m3fn), jnp.max(jnp.abs(x.astype(jnp.float32)))

    cost = hlo_cost(compiled(h100, f, spec(M, N)))
    assert cost.bytes["quantize"] >= M * N * 3
    assert set(cost.bytes) <= {"quantize", "amax"}  # a second stage finishes the amax


def test_transpose_is_transpose_copy(h100):
    cost = hlo_cost(compiled(h100, lambda x: x.T, spec(M, N)))
    assert cost.bytes == {"transpose/copy": 2 * M * N * 2}


def test_amax_of_a_sum_is_not_a_plain_max(h100):
    cost = hlo_cost(compiled(h100, lambda x: jnp.max(x.astype(jnp.float32)), spec(M, N)))
    assert set(cost.bytes) == {"rest"}  # a max without |x| (softmax's) is no amax


RECIPES = {
    "delayed": fp8jax.DelayedScaling(),
    "blockwise": fp8jax.BlockwiseScaling(native_kernel=False),
    "blockwise native": fp8jax.BlockwiseScaling(),  # chosen in a compile for an H100
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_linear_step_runs_three_fp8_gemms_worth_of_flops(h100, recipe):
    key = jax.random.PRNGKey(0)
    linear = eqx.nn.Linear(K, N, use_bias=False, key=key)
    fp8 = fp8jax.fp8_linear_layers(linear, fp8jax.Fp8Config(recipe=RECIPES[recipe]))
    bf16 = eqx.tree_at(lambda m: m.weight, linear, linear.weight.astype(jnp.bfloat16))

    def step(model, x):
        loss = lambda mx: jnp.mean(mx[0](mx[1]).astype(jnp.float32) ** 2)  # noqa: E731
        return fp8jax.filter_value_and_grad(loss)((model, x))

    x = spec(M, K)
    base = hlo_cost(compiled(h100, lambda m, x: step(eqx.filter_vmap(m), x), bf16, x))
    cost = hlo_cost(compiled(h100, step, fp8, x))
    # forward, dgrad and wgrad: three GEMMs of 2 M N K each (a block recipe runs one per
    # chunk of the contraction, in a loop)
    assert base.flops == {"bf16": 3 * 2 * M * N * K}
    kind = "fp8 block" if recipe == "blockwise native" else "fp8"  # at a block kernel's rate
    assert cost.flops == {kind: 3 * 2 * M * N * K}
    assert cost.bytes.get("quantize", 0) >= M * K * 3  # x in BF16 to FP8, at least
    assert cost.bytes.get("amax", 0) + cost.bytes.get("quantize", 0) > 0
    if recipe == "blockwise":
        # Per chunk of 128 of each GEMM's contraction, the float32 partial sum: the chunk's
        # (rows, cols) product read, the running total read and written; plus, at most, the
        # FP8 chunks of both operands sliced out (read and written, 1 byte each), their float32
        # scales, and a few scalars (loop counter, indices) per step.
        gemms = {"fwd": (M, N, K), "dgrad": (M, K, N), "wgrad": (N, K, M)}  # rows, cols, C
        partials = sum(3 * 4 * r * c * (C // 128) for r, c, C in gemms.values())
        slices = sum(2 * (r + c) * C for r, c, C in gemms.values())
        scales = sum(4 * (r + c) * (C // 128) for r, c, C in gemms.values())
        steps = sum(C // 128 for _, _, C in gemms.values())
        assert partials <= cost.bytes["block partials"] <= partials + slices + scales + 64 * steps
    if recipe == "blockwise native":
        # fp8jax's kernel: three Mosaic GPU GEMMs, no float32 partials in memory.
        gemm_kernels = [k for k in cost.kernels if k.flops]
        assert [k.op for k in gemm_kernels] == ["custom-call"] * 3
        assert "block partials" not in cost.bytes
    assert all(isinstance(k, KernelCost) for k in cost.kernels)

"""hlo_cost: GEMM FLOPs and non-GEMM bytes of optimized HLO, against hand-computed numbers."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax._src.observe import deviceless
from fp8jax._src.observe.cost import hlo_cost, module_cost_and_uncounted, uncounted_branches
from fp8jax._src.observe.gemms import hlo_gemms
from fp8jax._src.observe.hlo import parse
from fp8jax._src.observe.roofline import CATEGORIES, H100, Cost, KernelCost
from fp8jax._src.observe.traffic import hlo_collectives, hlo_memory_traffic

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


SYNC_SLICE = (
    "  %slice_fusion = f32[1,64,32]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice\n"
)
ASYNC_SLICE = (
    "  %slice_start = ((f32[10,64,32]{2,1,0}, s32[]), f32[1,64,32]{2,1,0}, u32[]) "
    "fusion-start(%stack, %i), kind=kLoop, calls=%fused_slice\n"
    "  %slice_fusion = f32[1,64,32]{2,1,0} fusion-done(%slice_start)\n"
)


def asynchronous(module: str) -> str:
    """`module` with its slice fusion run as XLA 0.11+ runs a loop's dynamic slices: a
    `fusion-start` (typed `((operands), result, context)`) and its `fusion-done`."""
    assert module.count(SYNC_SLICE) == 1
    return module.replace(SYNC_SLICE, ASYNC_SLICE)


def test_an_asynchronous_fusion_is_one_kernel_costed_as_its_synchronous_form():
    """A `fusion-start` / `fusion-done` pair is the kernel its fusion is: the same bytes (its
    operands read and its fused result written, not the start's tuple of operands and result
    again), in the same category (a copy here, block partials in an fp8jax layer's loop), once;
    the `-done` half no kernel."""
    for op_name in ("jit(step)/while", "jit(step)/fp8jax[blocks.0.mlp.fc1]/fwd/while"):
        sync, late = hlo_cost(loop(op_name=op_name)), hlo_cost(asynchronous(loop(op_name=op_name)))
        assert late.bytes == sync.bytes and late.flops == sync.flops
        named = {"slice_fusion": "slice_start"}
        assert {named.get(k.name, k.name): (k.bytes, k.category, k.runs) for k in sync.kernels} == {
            k.name: (k.bytes, k.category, k.runs) for k in late.kernels
        }
    entry = LOOP[LOOP.index("%fused_slice") : LOOP.index("%body")]
    module = (
        "HloModule entry, is_scheduled=true\n\n"
        + entry
        + "ENTRY %main (p2: f32[10,64,32], p3: s32[]) -> f32[1,64,32] {\n"
        + "  %stack = f32[10,64,32]{2,1,0} parameter(0)\n"
        + "  %i = s32[] parameter(1)\n"
        + SYNC_SLICE
        + "  ROOT %out = f32[1,64,32]{2,1,0} bitcast(%slice_fusion)\n}\n"
    )
    # The entry's traffic model counts operands whole: the stack, the index, the plane.
    whole = 10 * 64 * 32 * 4 + 4 + 64 * 32 * 4
    assert hlo_memory_traffic(module) == hlo_memory_traffic(asynchronous(module)) == whole


def test_the_inspection_s_traffic_counts_a_loop_s_body_once():
    """`Inspection.traffic` counts loops once: it counted no kernel of a loop's body, and
    the loop's carried tuple (a scan's stacked weights among it) as read and written whole
    by the `while` itself. Now the body's kernels count once (the condition's too), with
    their operands whole as at the top level."""
    body = TANH_BYTES + (10 * 64 * 32 * 4 + 4 + 64 * 32 * 4)  # the GEMM not counted
    assert hlo_memory_traffic(loop()) == body + COMPARE_BYTES


TRITON_GEMM = """
HloModule m

%gemm (p0: bf16[16,32], p1: bf16[32,8]) -> f32[16,8] {
  %p0 = bf16[16,32]{1,0} parameter(0)
  %p1 = bf16[32,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%nested (q0: bf16[16,32], q1: bf16[32,8]) -> f32[16,8] {
  %q0 = bf16[16,32]{1,0} parameter(0)
  %q1 = bf16[32,8]{1,0} parameter(1)
  ROOT %inner = f32[16,8]{1,0} fusion(%q0, %q1), kind=kCustom, calls=%gemm
}

%to_bf16 (r0: f32[16,8]) -> bf16[16,8] {
  %r0 = f32[16,8]{1,0} parameter(0)
  ROOT %convert.1 = bf16[16,8]{1,0} convert(%r0)
}

ENTRY %main (a: bf16[16,32], b: bf16[32,8]) -> (bf16[16,8], f32[16,8]) {
  %a = bf16[16,32]{1,0} parameter(0)
  %b = bf16[32,8]{1,0} parameter(1)
  %g = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
  %n = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%nested
  %c = bf16[16,8]{1,0} fusion(%g), kind=kLoop, calls=%to_bf16
  ROOT %t = (bf16[16,8]{1,0}, f32[16,8]{1,0}) tuple(%c, %n)
}
"""


def test_the_inspection_s_traffic_leaves_out_triton_gemm_fusions():
    """`Inspection.traffic` is the bytes of every kernel but the GEMMs; under XLA's default
    flags it counted a Triton GEMM fusion's operands and result as traffic (a cuBLAS call's
    it left out), so the two modes' figures differed by the GEMMs' bytes. Now a fusion
    holding a dot (nested too) is a GEMM there, as in `hlo_cost`."""
    convert = 4 * 16 * 8 + 2 * 16 * 8  # reads the f32 GEMM output, writes bf16
    assert hlo_memory_traffic(TRITON_GEMM) == convert
    cost = hlo_cost(TRITON_GEMM)
    assert cost.total_bytes == convert and cost.flops == {"bf16": 2 * 2 * 16 * 8 * 32}


def test_an_async_all_reduce_moves_its_results_as_either_release_types_its_start():
    """`hlo_collectives` reads an `all-reduce-start` typed with its results alone (XLA 0.10)
    and typed `(operands, results)` (0.11 on) as the same arrays; two arrays reduced in one
    start (combined) stay two."""
    head = COLLECTIVES[: COLLECTIVES.index("ENTRY")]
    entry = (
        "ENTRY %main (g: f32[256,256], r: f32[64,512]) -> f32[256,256] {\n"
        "  %g = f32[256,256]{1,0} parameter(0)\n"
        "  %r = f32[64,512]{1,0} parameter(1)\n"
        "  %s = TYPE all-reduce-start(OPERANDS), channel_id=2, replica_groups={{0,1}}, "
        "use_global_device_ids=true, to_apply=%add\n"
        "  ROOT %d = DONE all-reduce-done(%s)\n}\n"
    )
    one, two = "f32[256,256]{1,0}", "f32[256,256]{1,0}, f32[64,512]{1,0}"
    forms = {  # (type of the start, its operands, type of the done): results alone first
        "one": [(one, "%g", one), (f"({one}, {one})", "%g", one)],
        "two": [(f"({two})", "%g, %r", f"({two})"), (f"(({two}), ({two}))", "%g, %r", f"({two})")],
    }
    for want, cases in (((256, 256),), forms["one"]), (((256, 256), (64, 512)), forms["two"]):
        for start, operands, done in cases:
            module = head + entry.replace("TYPE", start, 1).replace("OPERANDS", operands)
            (found,) = hlo_collectives(module.replace("DONE", done))
            assert (found.op, found.shapes, found.dtypes) == (
                "all-reduce",
                want,
                ("f32",) * len(want),
            )


def test_loop_without_trip_count_is_counted_once_and_named():
    cost = hlo_cost(loop(trip=""))
    assert cost.flops == {"bf16": GEMM_FLOPS}
    assert cost.bytes["rest"] == TANH_BYTES + 2 * COMPARE_BYTES
    assert cost.unknown_trip_counts == ("while",)


def test_loop_of_an_fp8jax_layer_holds_block_partials():
    cost = hlo_cost(loop(op_name="jit(step)/fp8jax[blocks.0.mlp.fc1]/fwd/while"))
    assert cost.bytes == {"block partials": 10 * (TANH_BYTES + SLICE_BYTES) + 11 * COMPARE_BYTES}


def test_a_call_inside_an_fp8jax_layer_s_loop_holds_block_partials():
    """A kernel in a computation the loop body `call`s runs inside the layer's loop as much
    as one in the body itself: the call passes the loop's category down."""
    body = loop(op_name="jit(step)/fp8jax[blocks.0.mlp.fc1]/fwd/while")
    tanh = "  %tanh_fusion = bf16[64,32]{1,0} fusion(%y), kind=kLoop, calls=%fused_tanh\n"
    callee = (
        "%tanh_call (y.1: bf16[64,32]) -> bf16[64,32] {\n"
        "  %y.1 = bf16[64,32]{1,0} parameter(0)\n"
        "  ROOT %tanh_fusion.1 = bf16[64,32]{1,0} fusion(%y.1), kind=kLoop, calls=%fused_tanh\n"
        "}\n\n"
    )
    body = body.replace(tanh, "  %tanh_fusion = bf16[64,32]{1,0} call(%y), to_apply=%tanh_call\n")
    cost = hlo_cost(body.replace("%body (", callee + "%body (", 1))
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


def test_a_gemm_in_a_call_inside_a_loop_runs_as_often_as_the_loop():
    """The inspector did not follow a `call` (`to_apply=`) up to the loop around it: a GEMM
    in a called computation in a loop body read `runs` 1 where `hlo_cost` counts it once per
    step."""
    body = loop()
    gemm = body[body.index("  %gemm = ") : body.index("  %tanh_fusion")]
    callee = (
        "%gemm_call (x: bf16[64,32], w: bf16[32,32]) -> bf16[64,32] {\n"
        "  %x = bf16[64,32]{1,0} parameter(0)\n"
        "  %w = bf16[32,32]{1,0} parameter(1)\n" + gemm.replace("%y = ", "ROOT %y = ") + "}\n\n"
    )
    body = body.replace(gemm, "  %y = bf16[64,32]{1,0} call(%x, %w), to_apply=%gemm_call\n")
    module = body.replace("%body (", callee + "%body (", 1)
    (kernel,) = [k for k in hlo_cost(module).kernels if k.flops]
    (found,) = hlo_gemms(module, "cublas")
    assert (found.runs, found.flops) == (kernel.runs, kernel.flops) == (10, GEMM_FLOPS)


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
    assert hlo_memory_traffic(BRANCHES) == 2 * negate + negate  # the larger branch's alone
    assert [k.name for k in cost.kernels] == ["neg.1", "neg.2", "neg"]


# A conditional choosing a GEMM contracting 64 rows or one contracting 256 (32x32 results).
BRANCH_GEMMS = """HloModule branch_gemms, is_scheduled=true

%lo (p: bf16[64,32]) -> bf16[32,32] {
  %p = bf16[64,32]{1,0} parameter(0)
  ROOT %dot.small = bf16[32,32]{1,0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%hi (q: bf16[256,32]) -> bf16[32,32] {
  %q = bf16[256,32]{1,0} parameter(0)
  ROOT %dot.big = bf16[32,32]{1,0} dot(%q, %q), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

ENTRY %main (flag: pred[], x: bf16[64,32], y: bf16[256,32]) -> bf16[32,32] {
  %flag = pred[] parameter(0)
  %x = bf16[64,32]{1,0} parameter(1)
  %y = bf16[256,32]{1,0} parameter(2)
  ROOT %c = bf16[32,32]{1,0} conditional(%flag, %x, %y), true_computation=%lo, false_computation=%hi
}
"""


def test_the_cost_s_one_walk_gives_the_gemms_the_branches_they_find_alone():
    """The inspector walks the cost once (`module_cost_and_uncounted`) and hands `hlo_gemms`
    the branches that walk leaves out, rather than walking again: the GEMMs must then run as
    when `hlo_gemms` walks by itself, the cheaper branch's never, and add up to the cost."""
    module = parse(BRANCH_GEMMS)
    cost, uncounted = module_cost_and_uncounted(module)
    assert uncounted == uncounted_branches(module) == {"lo"}
    given = {g.instruction: (g.runs, g.flops) for g in hlo_gemms(module, "m", uncounted=uncounted)}
    alone = {g.instruction: (g.runs, g.flops) for g in hlo_gemms(module, "m")}
    small, big = (2 * 32 * 32 * k for k in (64, 256))  # 2 * |output| * |contraction|
    assert given == alone == {"dot.small": (0, small), "dot.big": (1, big)}
    assert cost.gemm_flops == big == sum(runs * flops for runs, flops in given.values())


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


MIXED = """HloModule mixed, is_scheduled=true

%fused_mixed (p.0: f8e4m3fn[64,32], p.1: bf16[32,16]) -> bf16[64,16] {
  %p.0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p.1 = bf16[32,16]{1,0} parameter(1)
  ROOT %d.0 = bf16[64,16]{1,0} dot(%p.0, %p.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_bytes (p.2: u8[64,32], p.3: u8[32,16]) -> s32[64,16] {
  %p.2 = u8[64,32]{1,0} parameter(0)
  %p.3 = u8[32,16]{1,0} parameter(1)
  ROOT %d.1 = s32[64,16]{1,0} dot(%p.2, %p.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_highest (p.4: f32[64,32], p.5: f32[32,16]) -> f32[64,16] {
  %p.4 = f32[64,32]{1,0} parameter(0)
  %p.5 = f32[32,16]{1,0} parameter(1)
  ROOT %d.2 = f32[64,16]{1,0} dot(%p.4, %p.5), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
}

ENTRY %main (a: f8e4m3fn[64,32], b: bf16[32,16], c: u8[64,32], d: u8[32,16], e: f32[64,32], f: f32[32,16]) -> (bf16[64,16], s32[64,16]) {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %c = u8[64,32]{1,0} parameter(2)
  %d = u8[32,16]{1,0} parameter(3)
  %e = f32[64,32]{1,0} parameter(4)
  %f = f32[32,16]{1,0} parameter(5)
  %highest = f32[64,16]{1,0} fusion(%e, %f), kind=kCustom, calls=%fused_highest
  %mixed = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_mixed
  %bytes = s32[64,16]{1,0} fusion(%c, %d), kind=kCustom, calls=%fused_bytes
  ROOT %out = (bf16[64,16]{1,0}, s32[64,16]{1,0}) tuple(%mixed, %bytes)
}
"""  # noqa: E501 - verbatim HLO


def test_a_gemm_s_kind_by_its_operands_and_precision():
    """Hand-written: FP8 times bf16 is no FP8 GEMM (the FP8 side is widened: `"bf16"`), two
    uint8 operands run on INT8 tensor cores (`"int8"`), float32 at `precision=HIGHEST` at
    the non-tensor-core `"f32"` rate; 2 * 64 * 16 * 32 FLOPs each."""
    found = {k.name: (k.kind, k.flops) for k in hlo_cost(MIXED).kernels if k.flops}
    flops = 2 * 64 * 16 * 32
    assert found == {"mixed": ("bf16", flops), "bytes": ("int8", flops), "highest": ("f32", flops)}


UPDATES = """HloModule updates, is_scheduled=true

%fused_gather (p.0: f16[1000], p.1: s64[64,1]) -> f16[64] {
  %p.0 = f16[1000]{0} parameter(0)
  %p.1 = s64[64,1]{1,0} parameter(1)
  ROOT %g = f16[64]{0} gather(%p.0, %p.1), offset_dims={}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1}
}

%fused_flat_update (p.2: f32[10,64,32], p.3: f32[1,64,32], p.4: s32[]) -> f32[640,32] {
  %p.2 = f32[10,64,32]{2,1,0} parameter(0)
  %p.3 = f32[1,64,32]{2,1,0} parameter(1)
  %p.4 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[10,64,32]{2,1,0} dynamic-update-slice(%p.2, %p.3, %p.4, %z, %z)
  ROOT %flat = f32[640,32]{1,0} bitcast(%u)
}

ENTRY %main (stack: f32[10,64,32], x: f32[1,64,32], i: s32[], table: f16[1000], ids: s64[64,1]) -> (f32[10,64,32], f16[64]) {
  %stack = f32[10,64,32]{2,1,0} parameter(0)
  %x = f32[1,64,32]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %table = f16[1000]{0} parameter(3)
  %ids = s64[64,1]{1,0} parameter(4)
  %zero = s32[] constant(0)
  %dus = f32[10,64,32]{2,1,0} dynamic-update-slice(%stack, %x, %i, %zero, %zero)
  %rows = f16[64]{0} fusion(%table, %ids), kind=kLoop, calls=%fused_gather
  %flat = f32[640,32]{1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_flat_update
  ROOT %out = (f32[10,64,32]{2,1,0}, f16[64]{0}) tuple(%dus, %rows)
}
"""  # noqa: E501 - verbatim HLO


def test_an_unfused_update_and_a_fused_gather_move_only_what_they_touch():
    """Hand-counted: an in-place update outside a fusion reads its update and indices and
    writes the update (not the buffer it updates), as does a fused one returned through a
    bitcast; a gather reads the rows it returns of its
    table but all of its indices (they are no slice's first operand)."""
    found = {k.name: k.bytes for k in hlo_cost(UPDATES).kernels}
    plane = 64 * 32 * 4
    rows = 64 * 2 + 64 * 8 + 64 * 2
    assert found == {"dus": 2 * plane + 3 * 4, "rows": rows, "flat": 2 * plane + 4}


KINDS = """HloModule kinds, is_scheduled=true

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%add (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %s = f32[] add(%a.1, %b.1)
}

%fused_abs_sum (p.0: f32[64,32]) -> f32[] {
  %p.0 = f32[64,32]{1,0} parameter(0)
  %abs.0 = f32[64,32]{1,0} abs(%p.0)
  %zero.0 = f32[] constant(0)
  ROOT %r.0 = f32[] reduce(%abs.0, %zero.0), dimensions={0,1}, to_apply=%add
}

%fused_amax_t (p.1: f32[64,32]) -> f32[] {
  %p.1 = f32[64,32]{1,0} parameter(0)
  %abs.1 = f32[64,32]{1,0} abs(%p.1)
  %t.1 = f32[32,64]{1,0} transpose(%abs.1), dimensions={1,0}
  %zero.1 = f32[] constant(0)
  ROOT %r.1 = f32[] reduce(%t.1, %zero.1), dimensions={0,1}, to_apply=%max
}

%fused_row (p.2: f32[10,64,32], p.3: s32[]) -> f32[1,64,32] {
  %p.2 = f32[10,64,32]{2,1,0} parameter(0)
  %p.3 = s32[] parameter(1)
  %one = s32[] constant(1)
  %i.2 = s32[] add(%p.3, %one)
  %c0 = s32[] constant(0)
  ROOT %ds = f32[1,64,32]{2,1,0} dynamic-slice(%p.2, %i.2, %c0, %c0), dynamic_slice_sizes={1,64,32}
}

%fused_dots (p.4: bf16[64,32], p.5: bf16[32,32], p.6: f32[8,8]) -> (bf16[64,32], f32[8,8]) {
  %p.4 = bf16[64,32]{1,0} parameter(0)
  %p.5 = bf16[32,32]{1,0} parameter(1)
  %p.6 = f32[8,8]{1,0} parameter(2)
  %big = bf16[64,32]{1,0} dot(%p.4, %p.5), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %small = f32[8,8]{1,0} dot(%p.6, %p.6), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %both = (bf16[64,32]{1,0}, f32[8,8]{1,0}) tuple(%big, %small)
}

ENTRY %main (x: f32[64,32], s: f32[10,64,32], i: s32[], l: bf16[64,32], r: bf16[32,32], q: f32[8,8]) -> f32[] {
  %x = f32[64,32]{1,0} parameter(0)
  %s = f32[10,64,32]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %l = bf16[64,32]{1,0} parameter(3)
  %r = bf16[32,32]{1,0} parameter(4)
  %q = f32[8,8]{1,0} parameter(5)
  %sum = f32[] fusion(%x), kind=kInput, calls=%fused_abs_sum
  %amax = f32[] fusion(%x), kind=kInput, calls=%fused_amax_t
  %row = f32[1,64,32]{2,1,0} fusion(%s, %i), kind=kLoop, calls=%fused_row
  %dots = (bf16[64,32]{1,0}, f32[8,8]{1,0}) fusion(%l, %r, %q), kind=kCustom, calls=%fused_dots
  ROOT %out = f32[] add(%sum, %amax)
}
"""  # noqa: E501 - verbatim HLO


def test_kernels_are_sorted_by_what_they_compute():
    """Hand-counted: a sum of |x| is no amax (its reducer adds); a max of |x| read through a
    transpose is one; a dynamic slice whose index adds 1 (scalar index arithmetic) is a copy
    of one plane; a fusion of a bf16 and a smaller float32 dot counts both's FLOPs at the
    kind of most of them."""
    cost = hlo_cost(KINDS)
    found = {k.name: (k.category, k.bytes) for k in cost.kernels if k.kind is None}
    read_x = 64 * 32 * 4
    assert found == {
        "sum": ("rest", read_x + 4),
        "amax": ("amax", read_x + 4),
        "row": ("transpose/copy", 2 * 64 * 32 * 4 + 4),
        "out": ("rest", 3 * 4),
    }
    assert cost.flops == {"bf16": 2 * 64 * 32 * 32 + 2 * 8 * 8 * 8}


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


def test_cost_arithmetic_keeps_loops_kernels_and_collectives():
    """`a + b` keeps both sides' loops of unknown trip count, `cost * n` runs every kernel and
    collective `n` times as often, and a collective's time is all its runs' wire bytes at
    its link's rate (by hand: an all-gather of 800 bytes over 8 devices sends 700 a run)."""
    from fp8jax._src.observe.roofline import CollectiveCost

    kernel = KernelCost("k", "main", "fusion", "rest", 4, 0, None, 2, "")
    gather = CollectiveCost("g", "main", "all-gather", "bf16", 800, 8, "nvlink", 3, "")
    a = Cost({"fp8": 10}, {"rest": 4}, ("w",), (kernel,), collectives=(gather,))
    b = Cost({}, {}, ("v",))
    assert (a + b).unknown_trip_counts == ("w", "v")
    tripled = a * 3
    assert [k.runs for k in tripled.kernels] == [6]
    assert [c.runs for c in tripled.collectives] == [9]
    assert gather.seconds() == pytest.approx(3 * 700 / (900e9 / 2), rel=1e-12)


def test_cost_scales_by_a_numpy_whole_number():
    """`cost * np.int64(3)` raised 'should be a whole number' (the count of steps of a NumPy
    computation), while `np.int64(3) * cost` scaled it; both now scale it."""
    cost = Cost({"fp8": 10}, {"rest": 4})
    for repeats in (np.int64(3), np.int32(3), np.uint8(3)):
        for scaled in (cost * repeats, repeats * cost):
            assert (scaled.flops, scaled.bytes) == ({"fp8": 30}, {"rest": 12})
    with pytest.raises(TypeError, match=r"repeats=np.True_"):
        cost * np.bool_(True)


def test_costs_sum():
    """`sum(costs)` raised TypeError (0 + Cost): the costs of a program's parts, or of each
    step, are added with `sum` as `a + b` adds two."""
    a = Cost({"fp8": 10}, {"amax": 4}, ("w",), communication={"all-gather": 8})
    b = Cost({"fp8": 1, "bf16": 2}, {"rest": 3}, link_bytes={"nvlink": 5})
    assert sum([a, b]) == a + b
    assert sum([a]) == a and sum([a, b], Cost()) == Cost() + a + b
    with pytest.raises(TypeError):
        1 + a


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_cost("HloModule nothing")
    with pytest.raises(ValueError, match="'int4'"):
        Cost({"int4": 1}).estimate_seconds()
    with pytest.raises(TypeError, match="hlo=3"):
        hlo_cost(3)


@pytest.mark.parametrize("dialect", ["stablehlo", "hlo"])
def test_a_lowered_program_s_text_is_refused_naming_the_compiled_text(dialect):
    """A Lowered's text (StableHLO, or HLO before XLA's optimizations, printed without `%`
    names) is not a program of kernels: refused, saying what to pass, not that it lacks the
    ENTRY computation it prints."""
    text = jax.jit(jnp.matmul).lower(jnp.ones((2, 3)), jnp.ones((3, 4))).as_text(dialect=dialect)
    with pytest.raises(ValueError, match=r"compiled\.as_text\(\)`\), not a Lowered's"):
        hlo_cost(text)


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


@pytest.mark.parametrize(
    ("dtype", "bits"), [(jnp.int4, 4), (jnp.uint4, 4), (jnp.complex64, 64), (jnp.int8, 8)]
)
def test_bytes_of_sub_byte_and_complex_types(h100, dtype, bits):
    """Every type was 4 bytes an element unless listed: an int4 array counted 8 times its
    size, a complex64 one half. XLA packs 4-bit elements two to a byte."""
    cost = hlo_cost(compiled(h100, lambda x: x.T, spec(M, N, dtype=dtype)))
    assert cost.bytes == {"transpose/copy": 2 * M * N * bits // 8}


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


def test_native_kernels_on_a_mesh_count_each_devices_flops():
    """On a mesh, each device runs fp8jax's block kernel on its shards (`per_shard`), which
    XLA's partitioner names after the partitioned call: the cost model still finds the kernel
    by its name and counts the FLOPs of each device's shard (a data axis of 8: an eighth of the
    tokens). It once counted none, and their bytes as the rest's."""
    linear = eqx.nn.Linear(K, N, use_bias=False, key=jax.random.PRNGKey(0))
    config = fp8jax.Fp8Config(recipe=fp8jax.BlockwiseScaling(), exclude=None, keep=())
    model = fp8jax.fp8_linear_layers(linear, config)

    def step(model, x):  # forward, dgrad and wgrad
        loss = lambda mx: jnp.mean(jax.vmap(mx[0])(mx[1]).astype(jnp.float32) ** 2)  # noqa: E731
        return fp8jax.filter_value_and_grad(loss)((model, x))

    mesh = fp8jax.h100_mesh({"data": 8})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((8 * M, K), jnp.bfloat16, sharding=sharding)
    inspection = fp8jax.inspect(step, model, x, modes=("cublas",))
    cost = inspection.cost["cublas"]
    assert cost.flops == {"fp8 block": 3 * 2 * M * N * K}
    # The inspector's GEMMs say the same FLOPs (they read 0 for a Pallas kernel once).
    gemms = inspection.gemms["cublas"]
    assert [g.kernel for g in gemms] == ["pallas mosaic gpu"] * 3
    assert sorted(g.flops * g.runs for g in gemms) == [2 * M * N * K] * 3
    native = [k for k in cost.kernels if k.op == "custom-call" and k.flops]
    assert len(native) == 3 and all(k.category is None for k in native)


# --- collectives ---------------------------------------------------------------------------

# Sixteen devices, two nodes of eight: each collective form once, explicit, iota and mesh
# replica groups, and a permute; the `-done` halves are free.
COLLECTIVES = """HloModule collectives, is_scheduled=true, num_partitions=16

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (w: bf16[128,1024], g: f32[256,256], r: f32[64,512], p: bf16[32,32], t: f32[16,64], q: f8e4m3fn[64,32], buf: f8e4m3fn[512,32], o: s64[8]) -> bf16[1024,1024] {
  %w = bf16[128,1024]{1,0} parameter(0)
  %g = f32[256,256]{1,0} parameter(1)
  %r = f32[64,512]{1,0} parameter(2)
  %p = bf16[32,32]{1,0} parameter(3)
  %t = f32[16,64]{1,0} parameter(4)
  %ag = (bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}, dimensions={0}, use_global_device_ids=true
  %ag.done = bf16[1024,1024]{1,0} all-gather-done(%ag)
  %ar = f32[256,256]{1,0} all-reduce(%g), channel_id=2, replica_groups=[2,8]<=[8,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %rs = f32[32,512]{1,0} reduce-scatter(%r), channel_id=3, replica_groups=mesh['x'=2,'y'=8] {'x'}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  %cp = (bf16[32,32]{1,0}, bf16[32,32]{1,0}) collective-permute-start(%p), channel_id=4, source_target_pairs={{0,1},{1,0},{2,2}}
  %cp.done = bf16[32,32]{1,0} collective-permute-done(%cp)
  %a2a = f32[16,64]{1,0} all-to-all(%t), channel_id=5, replica_groups={}, dimensions={0}
  %q = f8e4m3fn[64,32]{1,0} parameter(5)
  %buf = f8e4m3fn[512,32]{1,0} parameter(6)
  %o = s64[8]{0} parameter(7)
  %ra = ((f8e4m3fn[64,32]{1,0}, f8e4m3fn[512,32]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, s64[8]{0}), f8e4m3fn[512,32]{1,0}) ragged-all-to-all-start(%q, %buf, %o, %o, %o, %o), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}
  %ra.done = f8e4m3fn[512,32]{1,0} ragged-all-to-all-done(%ra)
  ROOT %out = bf16[1024,1024]{1,0} copy(%ag.done)
}
"""  # noqa: E501 - verbatim HLO
GATHERED = 1024 * 1024 * 2  # the all-gather's result, bf16
REDUCED = 256 * 256 * 4
SCATTERED = 64 * 512 * 4  # the reduce-scatter's operand
PERMUTED = 32 * 32 * 2
EXCHANGED = 16 * 64 * 4
DISPATCHED = 64 * 32  # the ragged all-to-all's rows to send (its buffer holds 512)


def test_collectives_by_the_ring_model_and_their_links():
    cost = hlo_cost(COLLECTIVES)
    found = {c.name: (c.op, c.dtype, c.bytes, c.devices, c.link) for c in cost.collectives}
    assert found == {
        # groups of one node: NVLink
        "ag": ("all-gather", "bf16", GATHERED, 8, "nvlink"),
        # [2,8]<=[8,2]T(1,0): {0,2,..,14}, {1,3,..,15}, across both nodes
        "ar": ("all-reduce", "f32", REDUCED, 8, "infiniband"),
        # the mesh's 'x' axis: {i, i + 8}, one device per node
        "rs": ("reduce-scatter", "f32", SCATTERED, 2, "infiniband"),
        # 0 <-> 1 in node 0 (2 -> 2 moves nothing)
        "cp": ("collective-permute", "bf16", PERMUTED, 2, "nvlink"),
        # `{}`: every device of the module's 16
        "a2a": ("all-to-all", "f32", EXCHANGED, 16, "infiniband"),
        # the smaller of its rows to send and its buffer: what one device sends at most
        "ra": ("ragged-all-to-all", "f8e4m3fn", DISPATCHED, 8, "nvlink"),
    }
    assert cost.communication == {
        "all-gather": GATHERED * 7 // 8,
        "all-reduce": 2 * REDUCED * 7 // 8,
        "reduce-scatter": SCATTERED // 2,
        "collective-permute": PERMUTED,
        "all-to-all": EXCHANGED * 15 // 16,
        "ragged-all-to-all": DISPATCHED * 7 // 8,
    }
    nvlink = GATHERED * 7 // 8 + PERMUTED + DISPATCHED * 7 // 8
    infiniband = 2 * REDUCED * 7 // 8 + SCATTERED // 2 + EXCHANGED * 15 // 16
    assert cost.link_bytes == {"nvlink": nvlink, "infiniband": infiniband}
    assert cost.communication_bytes == nvlink + infiniband
    seconds = nvlink / 450e9 + infiniband / 50e9
    assert cost.communication_seconds() == pytest.approx(seconds)
    # Collectives are not HBM traffic; the copy is the only other kernel.
    assert cost.bytes == {"transpose/copy": 2 * GATHERED} and cost.flops == {}
    compute = cost.memory_seconds()
    assert cost.estimate_seconds() == pytest.approx(compute + seconds)
    assert cost.estimate_seconds(overlap=True) == pytest.approx(max(compute, seconds))
    # np.bool_ (from a NumPy comparison) counts as the bool it holds; anything else is
    # refused: `overlap="no"` was truthy, so collectives counted as overlapped.
    assert cost.estimate_seconds(overlap=np.bool_(False)) == cost.estimate_seconds()
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=f"overlap={bad!r}"):
            cost.estimate_seconds(overlap=bad)
    # Nodes of four: the all-gather's groups span two nodes each.
    (gather,) = [c for c in hlo_cost(COLLECTIVES, gpus_per_node=4).collectives if c.name == "ag"]
    assert gather.link == "infiniband"


def test_the_inspection_lists_what_each_collective_moves():
    """`hlo_collectives` of hand-written starts: an all-gather's and a permute's results (not
    the operands their start's type lists first), a ragged all-to-all's rows to send; the
    all-reduce's reduction, its `to_apply` root (`%add`), none for the all-gather."""
    collectives = hlo_collectives(COLLECTIVES)
    found = {c.instruction: (c.shapes, c.dtypes) for c in collectives}
    reductions = {c.instruction: c.reduction for c in collectives}
    assert (reductions["ar"], reductions["ag"]) == ("add", None)
    assert found["ag"] == (((1024, 1024),), ("bf16",))
    assert found["cp"] == (((32, 32),), ("bf16",))
    assert found["ra"] == (((64, 32),), ("f8e4m3fn",))


def test_a_permute_of_each_device_to_itself_sends_nothing():
    """A collective-permute whose pairs all send a device's array to itself moves no data:
    one device in its group (`CollectiveCost.devices`), 0 bytes on the wire."""
    cost = hlo_cost(COLLECTIVES.replace("{{0,1},{1,0},{2,2}}", "{{0,0},{1,1},{9,9}}"))
    (permute,) = [c for c in cost.collectives if c.name == "cp"]
    assert (permute.bytes, permute.devices, permute.link) == (PERMUTED, 1, "nvlink")
    assert permute.wire_bytes == 0 and cost.communication["collective-permute"] == 0


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", [(0, 1), (2, 3), (4, 5), (6, 7)]),
        ("{}", [tuple(range(8))]),
        ("[2,4]<=[8]", [(0, 1, 2, 3), (4, 5, 6, 7)]),
        ("[2,4]<=[4,2]T(1,0)", [(0, 2, 4, 6), (1, 3, 5, 7)]),
        ("mesh['x'=2,'y'=4] {'y'}", [(0, 1, 2, 3), (4, 5, 6, 7)]),
        ("mesh['x'=2,'y'=4] {'x'}", [(0, 4), (1, 5), (2, 6), (3, 7)]),
        # devices laid out y-major: the mesh's [x, y] position holds device 2 y + x
        ("mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}", [(0, 1), (2, 3), (4, 5), (6, 7)]),
        ("mesh['x'=8] {'x':(2)2}", [(0, 2), (1, 3), (4, 6), (5, 7)]),  # x split [2, 2, 2]
    ],
)
def test_replica_group_forms(groups, expected):
    line = f"  %ar = f32[8]{{0}} all-reduce(%g), replica_groups={groups}, to_apply=%add"
    (instruction,) = [
        i for i in parse(line.join(["ENTRY %m {\n", "\n}"])).computations["m"].instructions.values()
    ]
    assert instruction.replica_groups(8) == expected


def test_collective_in_a_loop_runs_its_trip_count():
    gather = (
        "  %ag = (bf16[64,32]{1,0}, bf16[512,32]{1,0}) all-gather-start(%x), channel_id=1, "
        "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true\n"
        "  %ag.done = bf16[512,32]{1,0} all-gather-done(%ag)\n"
        "  %tanh_fusion = "
    )
    text = (
        loop()
        .replace("  %tanh_fusion = ", gather, 1)
        .replace("HloModule loop,", "HloModule loop, num_partitions=8,")
    )
    cost = hlo_cost(text)
    (c,) = cost.collectives
    assert (c.op, c.bytes, c.devices, c.link, c.runs) == (
        "all-gather",
        512 * 32 * 2,
        8,
        "nvlink",
        10,
    )
    assert c.wire_bytes == 512 * 32 * 2 * 7 // 8
    assert cost.communication == {"all-gather": 10 * c.wire_bytes}
    assert cost.communication_seconds() == pytest.approx(10 * c.wire_bytes / H100["nvlink"])
    assert cost.flops == {"bf16": 10 * GEMM_FLOPS}  # the rest as before
    assert (2 * cost).communication == {"all-gather": 20 * c.wire_bytes}
    assert [k.runs for k in (2 * cost).collectives] == [20]


def test_single_device_cost_has_no_communication():
    cost = hlo_cost(loop())
    assert cost.communication == {} and cost.link_bytes == {} and cost.collectives == ()
    assert cost.estimate_seconds(overlap=True) == cost.estimate_seconds()
    assert "collectives" not in str(cost)


def test_communication_arithmetic_and_errors():
    a = Cost({"bf16": 989}, {}, communication={"all-gather": 450}, link_bytes={"nvlink": 450})
    b = Cost(communication={"all-reduce": 50}, link_bytes={"infiniband": 50})
    assert (a + b).communication == {"all-gather": 450, "all-reduce": 50}
    assert (3 * a).link_bytes == {"nvlink": 1350}
    peaks = {"bf16": 1.0, "hbm": 1.0, "nvlink": 450.0, "infiniband": 50.0}
    assert (a + b).communication_seconds(peaks) == 2.0
    assert (a + b).estimate_seconds(peaks) == 991.0
    assert (a + b).estimate_seconds(peaks, overlap=True) == 989.0
    with pytest.raises(ValueError, match="'infiniband'"):
        b.communication_seconds({"nvlink": 1.0})
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        hlo_cost(COLLECTIVES, gpus_per_node=0)


def test_a_kernel_cost_s_bytes_are_zero_for_a_gemm_and_its_operands_otherwise(h100):
    """`KernelCost.bytes` was documented as a kernel's operands plus results, a GEMM's too;
    a GEMM's are 0 (it is priced by its FLOPs), the other kernels' their operands and
    results by dtype."""
    m, k, n = 256, 512, 128

    def f(a, b):
        return jnp.tanh(a @ b)

    cost = hlo_cost(compiled(h100, f, spec(m, k), spec(k, n)))
    (gemm,) = [kc for kc in cost.kernels if kc.kind is not None]
    assert gemm.bytes == 0 and gemm.flops == 2 * m * n * k
    (tanh,) = [kc for kc in cost.kernels if kc.kind is None]
    assert tanh.bytes == 2 * (m * n * 2)  # reads and writes m x n bf16


def test_a_missing_peak_is_named_by_the_method_asked():
    """`gemm_seconds` and `memory_seconds` said "Cost.estimate_seconds" and
    `CollectiveCost.seconds` "Cost.communication_seconds" of a peak missing: each now names
    itself (and `estimate_seconds` the part it asks)."""
    cost = hlo_cost(COLLECTIVES) + Cost({"bf16": 1}, {"rest": 1})
    no_gemm = {k: v for k, v in H100.items() if k != "bf16"}
    no_hbm = {k: v for k, v in H100.items() if k != "hbm"}
    no_link = {k: v for k, v in H100.items() if k not in ("nvlink", "infiniband")}
    cases = [
        (cost.gemm_seconds, no_gemm, r"^Cost\.gemm_seconds: no peak for GEMM kind 'bf16'"),
        (cost.memory_seconds, no_hbm, r"^Cost\.memory_seconds: .* has no 'hbm' entry"),
        (cost.communication_seconds, no_link, r"^Cost\.communication_seconds: no rate for link"),
        (cost.collectives[0].seconds, no_link, r"^CollectiveCost\.seconds: no rate for link"),
        (cost.estimate_seconds, no_gemm, r"^Cost\.gemm_seconds: no peak"),
    ]
    for method, peaks, message in cases:
        with pytest.raises(ValueError, match=message):
            method(peaks)


def test_gpus_per_node_may_be_a_numpy_whole_number():
    """`gpus_per_node=np.int64(4)` (a size read from an array) was refused as not "a whole
    number >= 1"; it now counts as 4 does, and a float or a bool is still refused."""
    by_int = hlo_cost(COLLECTIVES, gpus_per_node=4)
    by_numpy = hlo_cost(COLLECTIVES, gpus_per_node=np.int64(4))
    assert by_numpy == by_int and by_numpy.link_bytes == by_int.link_bytes
    assert [c.link for c in by_numpy.collectives] == [c.link for c in by_int.collectives]
    for bad in (4.0, True):
        with pytest.raises(ValueError, match=rf"gpus_per_node={bad!r} should be a whole number"):
            hlo_cost(COLLECTIVES, gpus_per_node=bad)


def test_h100_peaks_are_nvidia_s_published_dense_figures():
    """`H100` against NVIDIA's H100 SXM5 figures, written out here: the whitepaper's dense
    tensor-core peaks (TFLOP/s; the datasheet prints twice these, with sparsity), its FP32,
    FP64 and INT32 rates, HBM3 3.35 TB/s, NVLink 4 900 GB/s in all (half each way), one
    400 Gb/s NDR port per GPU; `"fp8 block"` is torchao's published 1,234 TFLOP/s. `H100`
    rounds the whitepaper's figures to three or four digits, hence `rel=2e-3`."""
    tera = 1e12
    published = {
        "fp8": 1978.9 * tera,
        "fp8 block": 1234 * tera,
        "bf16": 989.4 * tera,
        "f16": 989.4 * tera,
        "tf32": 494.7 * tera,
        "f32": 66.9 * tera,
        "f64": 66.9 * tera,
        "int8": 1978.9 * tera,
        "int32": 33.5 * tera,
        "hbm": 3.35 * tera,
        "nvlink": 900e9 / 2,
        "infiniband": 400e9 / 8,
    }
    assert H100 == pytest.approx(published, rel=2e-3)


def _estimates(cost):
    """Every method of `cost` that prices it from `peaks`."""
    return (
        cost.estimate_seconds,
        cost.gemm_seconds,
        cost.memory_seconds,
        cost.communication_seconds,
        cost.collectives[0].seconds,
    )


def test_peaks_named_by_a_gpu_s_name_are_refused_saying_what_peaks_are():
    """`estimate_seconds("H200")` (a GPU named, not its rates) raised "dictionary update
    sequence element #0 has length 1", `estimate_seconds(None)` "argument of type 'NoneType'
    is not iterable"; each estimate now says that `peaks` is a dict of rates, as `H100`."""
    cost = hlo_cost(COLLECTIVES)
    for peaks in ("H200", None):
        for estimate in _estimates(cost):
            with pytest.raises(TypeError, match=rf"peaks={peaks!r} should be a dict of rates"):
                estimate(peaks)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), "989e12", None, True])
def test_a_peak_rate_that_is_not_a_positive_number_is_refused_naming_it(rate):
    """A rate of 0 raised ZeroDivisionError, a negative one gave a negative time, a string
    "unsupported operand type(s)": each estimate now names the rate and what it should be."""
    cost = hlo_cost(COLLECTIVES)
    peaks = {**H100, "hbm": rate}
    for estimate in _estimates(cost):
        with pytest.raises(ValueError, match=rf"rates {{'hbm': {re.escape(repr(rate))}}}.*> 0"):
            estimate(peaks)
    fast = {**H100, "hbm": 2 * H100["hbm"]}  # a valid rate still prices bytes by it
    assert cost.memory_seconds(fast) == pytest.approx(cost.total_bytes / (2 * H100["hbm"]))


def test_mesh_sizes_beyond_a_node_are_hosts_of_eight():
    with pytest.raises(ValueError, match="12 GPUs"):
        fp8jax.h100_mesh({"data": 12})
    with pytest.raises(ValueError, match="devices=12"):
        deviceless.h100_topology(12)


# --- deviceless sharded compiles -----------------------------------------------------------


def sharded(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile(compiler_options=deviceless.MODES["cublas"]).as_text()


def test_fsdp_all_gather_on_eight_h100s(h100):
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = fp8jax.h100_mesh({"data": 8})
    rows = NamedSharding(mesh, PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=rows)  # FSDP: rows over 8 GPUs
    cost = hlo_cost(sharded(lambda x, w: x @ w, x, w))
    # The weight is gathered whole on every GPU: K x N bf16, of which each GPU holds 1/8.
    (gather,) = cost.collectives
    assert (gather.op, gather.dtype, gather.bytes, gather.devices, gather.link) == (
        "all-gather",
        "bf16",
        K * N * 2,
        8,
        "nvlink",
    )
    assert cost.communication == {"all-gather": K * N * 2 * 7 // 8}
    assert cost.flops == {"bf16": 2 * (M // 8) * N * K}  # each GPU's rows


def test_64_h100s_are_eight_nodes(h100):
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = fp8jax.h100_mesh({"data": 8, "fsdp": 8})
    assert [d.process_index for d in mesh.devices.flat] == [i // 8 for i in range(64)]
    x = jax.ShapeDtypeStruct(
        (M, K), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    )
    for axis, link in (("fsdp", "nvlink"), ("data", "infiniband")):
        w = jax.ShapeDtypeStruct(
            (K, N), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(axis))
        )
        cost = hlo_cost(sharded(lambda x, w: x @ w, x, w))
        gathers = [c for c in cost.collectives if c.op == "all-gather"]
        assert [(c.bytes, c.devices, c.link) for c in gathers] == [(K * N * 2, 8, link)], axis

"""The inspector's reading of hand-written HLO and PTX: which custom calls and fusions are
GEMMs, which kernel runs each and with what operands, each answer read off the text by hand.
No compile: these run in milliseconds."""

import fp8jax
from fp8jax import Gemm
from fp8jax._src.observe.gemms import hlo_gemms, stablehlo_gemms
from fp8jax._src.observe.hlo import element_type, native_gemm_cost, parse
from fp8jax._src.observe.ptx import Kernel, ptx_kernels, sixteen_bit_kind

_GEMM = (
    'backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
    '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
    '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}'
)

CUBLAS = f"""
HloModule m

ENTRY %main (a: bf16[16,32], b: bf16[32,8], x: f8e4m3fn[16,32], y: f8e5m2[32,8]) -> f32[16,8] {{
  %a = bf16[16,32]{{1,0}} parameter(0)
  %b = bf16[32,8]{{1,0}} parameter(1)
  %x = f8e4m3fn[16,32]{{1,0}} parameter(2)
  %y = f8e5m2[32,8]{{1,0}} parameter(3)
  %gemm = (bf16[16,8]{{1,0}}, s8[0]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$gemm", {_GEMM}
  %lt = (bf16[16,8]{{1,0}}, s8[0]{{0}}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", {_GEMM}
  %f8 = (f32[16,8]{{1,0}}, s8[0]{{0}}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8", {_GEMM}
  %mixed = (f32[16,8]{{1,0}}, s8[0]{{0}}) custom-call(%x, %b), custom_call_target="__cublas$lt$matmul", {_GEMM}
  ROOT %t = (f32[16,8]{{1,0}}) tuple(%f8)
}}
"""


def test_only_the_cublaslt_f8_call_is_an_fp8_gemm():
    """cuBLASLt runs bf16 GEMMs too (`__cublas$lt$matmul`): only its `$f8` call multiplies
    FP8; each operand's type is its own (an e4m3 x e5m2 call, an f8 x bf16 one)."""
    gemms = {g.instruction: g for g in hlo_gemms(CUBLAS, "cublas")}
    assert set(gemms) == {"gemm", "lt", "f8", "mixed"}
    kinds = {name: (g.kernel, g.fp8, g.proven, g.lhs, g.rhs) for name, g in gemms.items()}
    assert kinds == {
        "gemm": ("cublas", False, True, "bf16", "bf16"),
        "lt": ("cublas", False, True, "bf16", "bf16"),
        "f8": ("cublasLt f8", True, True, "f8e4m3fn", "f8e5m2"),
        "mixed": ("cublas", False, True, "f8e4m3fn", "bf16"),
    }
    assert [g.fp8_operands for g in gemms.values()] == [False, False, True, False]
    # 2 * |output| * contracted (K = 32, the lhs's dimension 1) for each.
    assert {g.flops for g in gemms.values()} == {2 * 16 * 8 * 32}
    inspection = fp8jax.Inspection({"cublas": list(gemms.values())}, {}, "t")
    assert inspection.count("cublas") == (1, 4)


def test_a_dot_s_flops_contract_the_lhs_s_own_dimensions():
    """`x[16,32] . w[32,8]` contracts x's dimension 1 (32) and w's 0: 2 * 16 * 8 * 32; a
    complex one multiplies-adds four real products per term: 8 * 16 * 8 * 32, a cuBLAS call's
    tuple-typed result included."""
    hlo = f"""
HloModule m

ENTRY %main (x: f32[16,32], w: f32[32,8], u: c64[16,32], v: c64[32,8]) -> f32[16,8] {{
  %x = f32[16,32]{{1,0}} parameter(0)
  %w = f32[32,8]{{1,0}} parameter(1)
  %u = c64[16,32]{{1,0}} parameter(2)
  %v = c64[32,8]{{1,0}} parameter(3)
  %d = f32[16,8]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %c = (c64[16,8]{{1,0}}, s8[0]{{0}}) custom-call(%u, %v), custom_call_target="__cublas$gemm", {_GEMM}
  ROOT %t = (f32[16,8]{{1,0}}) tuple(%d)
}}
"""
    flops = {g.instruction: g.flops for g in hlo_gemms(hlo, "cublas")}
    assert flops == {"d": 2 * 16 * 8 * 32, "c": 8 * 16 * 8 * 32}
    assert element_type("(c64[16,8]{1,0}, s8[0]{0})") == "c64"


NESTED = """
HloModule m

%inner_comp (p0: f8e4m3fn[16,32], p1: f8e4m3fn[8,32]) -> f32[16,8] {
  %p0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[8,32]{1,0} parameter(1)
  ROOT %dot.7 = f32[16,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/fp8jax[fc]/fwd/dot_general"}
}

%outer (q0: f8e4m3fn[16,32], q1: f8e4m3fn[8,32]) -> f32[16,8] {
  %q0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %q1 = f8e4m3fn[8,32]{1,0} parameter(1)
  ROOT %inner = f32[16,8]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%inner_comp
}

%mixed_comp (r0: f8e4m3fn[16,32], r1: bf16[8,32]) -> f32[16,8] {
  %r0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %r1 = bf16[8,32]{1,0} parameter(1)
  ROOT %dot.8 = f32[16,8]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/fp8jax[fc2]/fwd/dot_general"}
}

ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[8,32], c: bf16[8,32]) -> f32[16,8] {
  %a = f8e4m3fn[16,32]{1,0} parameter(0)
  %b = f8e4m3fn[8,32]{1,0} parameter(1)
  %c = bf16[8,32]{1,0} parameter(2)
  %f.3 = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%outer, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %f-4 = f32[16,8]{1,0} fusion(%a, %c), kind=kCustom, calls=%mixed_comp, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""

WGMMA = """
.version 8.8
.target sm_90a
.visible .entry f_3(
)
{
\twgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2 {%f1}, %rd1, %rd2, p, 1, 1;
\tret;
}
.visible .entry inner(
)
{
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f5, %f6, %f7, %f8};
\tret;
}
"""


def test_a_dot_in_a_nested_fusion_is_run_by_the_outermost_kernel():
    """The dot inside a fusion inside a Triton GEMM fusion runs in that Triton kernel (`f_3`,
    whose PTX multiplies e5m2 by e5m2 on FP8 tensor cores), not in a kernel of the inner
    fusion's own name; a dot of f8 by bf16 does not take FP8 operands (its kernel named as
    PTX allows, `f-4` as `f_4`)."""
    gemms = {g.instruction: g for g in hlo_gemms(NESTED, "default", ptx_kernels([WGMMA]))}
    dot = gemms["dot.7"]
    assert (dot.kernel, dot.kernel_name, dot.ptx) == ("triton", "f_3", True)
    assert dot.fp8 and dot.fp8_operands and dot.layer == "fc" and dot.role == "fwd"
    mixed = gemms["dot.8"]
    assert (mixed.lhs, mixed.rhs, mixed.fp8_operands) == ("f8e4m3fn", "bf16", False)
    assert (mixed.kernel, mixed.kernel_name, mixed.ptx, mixed.fp8) == (
        "triton",
        "f_4",
        False,
        False,
    )
    assert mixed.verdict.endswith("not proven")


def test_ptx_functions_before_the_first_entry_belong_to_every_entry():
    """A device function defined before the first `.entry` (called by the kernels after it)
    lends its MMA to each of them; a `.weak .entry` is a kernel too."""
    ptx = """
.version 8.8
.target sm_90a
.func helper()
{
\twgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
\tret;
}
.visible .entry k1(
)
{
\tcall helper;
\tret;
}
.weak .entry k2(
)
{
\tcvt.rn.f16x2.e5m2x2 \t%r1, %rs1;
\tret;
}
"""
    kernels = ptx_kernels([ptx])
    assert set(kernels) == {"k1", "k2"}
    wgmma = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"
    assert kernels["k1"].mma == (wgmma,) and kernels["k1"].upcasts == ()
    assert kernels["k2"].mma == (wgmma,) and kernels["k2"].upcasts == ("cvt.rn.f16x2.e5m2x2",)


MOSAIC = """
HloModule m

ENTRY %main (x: f8e4m3fn[64,128], w: f8e4m3fn[64,128], b: bf16[64,128], s: f32[64,1]) -> f32[64,64] {
  %x = f8e4m3fn[64,128]{1,0} parameter(0)
  %w = f8e4m3fn[64,128]{1,0} parameter(1)
  %b = bf16[64,128]{1,0} parameter(2)
  %s = f32[64,1]{1,0} parameter(3)
  %m1 = f32[64,64]{1,0} custom-call(%x, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/fp8jax[tile]/fwd/body/mpmd_map"}, backend_config={kernel_hash = "h1", module = "ML"}
  %m2 = f32[64,64]{1,0} custom-call(%x, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/softmax/mpmd_map"}, backend_config={kernel_hash = "h2", module = "ML"}
  %m3 = f32[64,64]{1,0} custom-call(%b, %b), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/attention/mpmd_map"}, backend_config={kernel_hash = "h3", module = "ML"}
  ROOT %m4 = f32[64,64]{1,0} custom-call(%b, %s, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/fp8jax[up]/dgrad/mpmd_map"}, backend_config={kernel_hash = "h4", module = "ML"}
}
"""


def test_mosaic_calls_are_gemms_by_their_ptx_or_their_layer_s_scope():
    """A Mosaic GPU call is a GEMM where its PTX has an MMA (`m1`, `m3`) or it runs in an
    fp8jax layer's scope (`m4`, whose PTX was not read: not proven); one with neither (`m2`)
    is not reported. Its matrices are its two FP8 operands, else its first two; another
    Pallas kernel than fp8jax's own counts no FLOPs."""
    fp8 = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"
    bf16 = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
    kernels = {
        "mosaic:h1": Kernel("tile_kernel", (fp8,), ()),
        "mosaic:h2": Kernel("softmax_kernel", (), ()),
        "mosaic:h3": Kernel("attention_kernel", (bf16,), ()),
        "h4": Kernel("up_kernel", (fp8,), ()),  # not a Mosaic key: not this call's
    }
    gemms = {g.instruction: g for g in hlo_gemms(MOSAIC, "cublas", kernels)}
    assert set(gemms) == {"m1", "m3", "m4"}
    got = {
        name: (g.kernel_name, g.lhs, g.rhs, g.fp8, g.proven, g.layer, g.flops)
        for name, g in gemms.items()
    }
    assert got == {
        "m1": ("tile_kernel", "f8e4m3fn", "f8e4m3fn", True, True, "tile", 0),
        "m3": ("attention_kernel", "bf16", "bf16", False, True, None, 0),
        "m4": ("m4", "bf16", "f32", False, False, "up", 0),
    }
    assert {g.kernel for g in gemms.values()} == {"pallas mosaic gpu"}
    assert "BF16 tensor cores" in gemms["m3"].verdict and gemms["m4"].role == "dgrad"


LOOP = """
HloModule m

%inner_body (p: (s32[], f8e4m3fn[16,32])) -> (s32[], f8e4m3fn[16,32]) {
  %p = (s32[], f8e4m3fn[16,32]{1,0}) parameter(0)
  %a = f8e4m3fn[16,32]{1,0} get-tuple-element(%p), index=1
  %g = (f32[16,16]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(f)/fp8jax[first]/fwd/while/body/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  ROOT %t = (s32[], f8e4m3fn[16,32]{1,0}) tuple(%p, %a)
}

%inner_cond (p: (s32[], f8e4m3fn[16,32])) -> pred[] {
  %p = (s32[], f8e4m3fn[16,32]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (q: (s32[], f8e4m3fn[16,32])) -> (s32[], f8e4m3fn[16,32]) {
  %q = (s32[], f8e4m3fn[16,32]{1,0}) parameter(0)
  ROOT %w.in = (s32[], f8e4m3fn[16,32]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, metadata={op_name="jit(f)/fp8jax[inner]/wgrad/while"}, backend_config={"known_trip_count":{"n":"3"}}
}

%outer_cond (q: (s32[], f8e4m3fn[16,32])) -> pred[] {
  %q = (s32[], f8e4m3fn[16,32]{1,0}) parameter(0)
  %b = bf16[16,32]{1,0} constant({...})
  %d = bf16[16,16]{1,0} dot(%b, %b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: (s32[], f8e4m3fn[16,32])) -> (s32[], f8e4m3fn[16,32]) {
  %x = (s32[], f8e4m3fn[16,32]{1,0}) parameter(0)
  ROOT %w.out = (s32[], f8e4m3fn[16,32]{1,0}) while(%x), condition=%outer_cond, body=%outer_body, metadata={op_name="jit(f)/fp8jax[outer]/fwd/while"}, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_gemm_in_nested_loops_runs_their_trip_counts_and_takes_the_inner_loop_s_name():
    """The GEMM in a loop of 3 inside a loop of 4 runs 12 times, under the name of the
    innermost loop (its body's name is another layer's trace); a loop's condition runs once
    more than its body: a GEMM there 5 times, under the name of its loop."""
    gemms = {g.instruction: g for g in hlo_gemms(LOOP, "cublas")}
    assert set(gemms) == {"g", "d"}
    assert (gemms["g"].runs, gemms["g"].layer, gemms["g"].role) == (12, "inner", "wgrad")
    assert gemms["g"].fp8 and gemms["g"].flops == 2 * 16 * 16 * 32
    assert (gemms["d"].runs, gemms["d"].layer, gemms["d"].fp8) == (5, "outer", False)


NATIVE = """
HloModule m

ENTRY %main (x: f8e4m3fn[128,64], w: f8e4m3fn[4,32,64]) -> f32[128,32] {
  %x = f8e4m3fn[128,64]{1,0} parameter(0)
  %w = f8e4m3fn[4,32,64]{2,1,0} parameter(1)
  %s = f32[128]{0} parameter(2)
  %xb = bf16[128,64]{1,0} parameter(3)
  %wb = bf16[4,32,64]{2,1,0} parameter(4)
  %a = f8e4m3fn[2,64,128]{2,1,0} parameter(5)
  %sa = f32[2,64,1]{2,1,0} parameter(6)
  %b = f8e4m3fn[2,32,128]{2,1,0} parameter(7)
  %sb = f32[2,32,1]{2,1,0} parameter(8)
  %n1 = f32[128,32]{1,0} custom-call(%x, %w, %s), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/fp8jax[moe]/fwd/fp8jax_grouped_rows_gemm/mpmd_map"}, backend_config={kernel_hash = "n1", module = "ML"}
  %n2 = bf16[128,32]{1,0} custom-call(%xb, %wb), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/fp8jax[moe]/dgrad/fp8jax_grouped_rows_gemm/mpmd_map"}, backend_config={kernel_hash = "n2", module = "ML"}
  ROOT %n3 = f32[2,64,32]{2,1,0} custom-call(%a, %sa, %b, %sb), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/fp8jax[fc]/fwd/fp8jax_block_scaled_gemm/mpmd_map"}, backend_config={kernel_hash = "n3", module = "ML"}
}
"""


def test_fp8jax_s_own_kernels_cost_their_padded_shapes_at_their_operands_precision():
    """fp8jax's grouped-rows kernel `(M, K)` x experts `(N, K)` runs 2 * M * N * K at FP8 for
    FP8 operands, at bf16 for bf16 ones; its block-scaled kernel of one term, `(B, M, K)` by
    `(B, N, K)`, 2 * B * M * N * K as `"fp8 block"`."""
    module = parse(NATIVE)
    computation = module.computations["main"]
    got = {
        name: native_gemm_cost(computation, computation.instructions[name])
        for name in ("n1", "n2", "n3")
    }
    assert got == {
        "n1": (2 * 128 * 32 * 64, "fp8"),
        "n2": (2 * 128 * 32 * 64, "bf16"),
        "n3": (2 * 2 * 64 * 32 * 128, "fp8 block"),
    }
    gemms = {g.instruction: g for g in hlo_gemms(module, "cublas")}
    assert {name: g.flops for name, g in gemms.items()} == {n: f for n, (f, _) in got.items()}
    assert (gemms["n3"].lhs, gemms["n3"].rhs) == ("f8e4m3fn", "f8e4m3fn")


def test_a_layer_path_ends_at_its_own_scope_s_bracket():
    """The layer's path is the text in its scope's brackets, brackets of its own included
    (`blocks[1].fc`), not up to a later scope's bracket in the name stack."""
    name = "jit(f)/transpose(jvp(fp8jax[blocks[1].fc]))/wgrad/named[x]/dot_general"
    gemm = Gemm("cublas", "g", "cublasLt f8", "f8e5m2", "f8e4m3fn", name)
    assert (gemm.layer, gemm.role) == ("blocks[1].fc", "wgrad")


def test_stablehlo_gemms_keep_each_operand_s_type_and_location():
    """Without the H100 compiler: each `stablehlo.dot_general` with its lhs's and rhs's
    element types as written, and the name stack of its location."""
    text = "\n".join(
        [
            "module @jit_f {",
            "  %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : "
            "(tensor<16x32xf8E4M3FN>, tensor<32x8xbf16>) -> tensor<16x8xf32> loc(#loc3)",
            "}",
            '#loc3 = loc("jit(f)/fp8jax[fc]/fwd/dot_general")',
        ]
    )
    (gemm,) = stablehlo_gemms(text)
    assert (gemm.lhs, gemm.rhs, gemm.layer, gemm.role) == ("f8E4M3FN", "bf16", "fc", "fwd")
    assert not gemm.fp8_operands and not gemm.fp8 and not gemm.proven


def test_a_kernel_upcasting_fp8_to_f16_mma_is_priced_at_f16():
    """A generated GEMM that converts FP8 up (`cvt.rn.f16x2.e4m3x2`) and multiplies with
    `mma.sync ... f16` runs at FP16 rate; an FP8 wgmma kernel at none of the 16-bit ones."""
    upcasting = Kernel(
        "k",
        ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",),
        ("cvt.rn.f16x2.e4m3x2",),
    )
    fp8 = Kernel("k", ("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",), ())
    only_cast = Kernel("k", (), ("cvt.rn.bf16x2.e5m2x2",))
    got = [sixteen_bit_kind(k) for k in (upcasting, fp8, only_cast)]
    assert got == ["f16", None, "bf16"]

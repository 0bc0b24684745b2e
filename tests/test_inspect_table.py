"""The inspection's table: a GEMM nothing proved either way is not marked high precision."""

import dataclasses
import pickle

import pytest

import fp8jax
from fp8jax import Gemm, Inspection


def _gemm(kernel: str, *, ptx: bool = False, mma: tuple[str, ...] = (), mode: str = "cublas"):
    return Gemm(
        mode, "mpmd_map.1", kernel, "f8e4m3fn", "f8e4m3fn", "fp8jax[l1]/fwd", ptx=ptx, mma=mma
    )


@pytest.mark.parametrize(
    "gemm",
    [
        _gemm("pallas mosaic gpu"),  # Mosaic kernel, no PTX dumped
        _gemm("triton"),  # generated kernel whose PTX was not found
        _gemm("dot", mode="stablehlo"),  # no H100 compiler at all
    ],
)
def test_an_unproven_gemm_is_not_marked_high_precision(gemm):
    assert not gemm.fp8 and gemm.verdict.endswith("not proven")
    row = next(
        line
        for line in str(Inspection({gemm.mode: [gemm]}, {}, "t")).splitlines()
        if str(gemm) in line
    )
    assert not row.strip().startswith("high") and not row.strip().startswith("FP8")


def test_proven_gemms_keep_their_marks():
    fp8 = _gemm(
        "pallas mosaic gpu",
        ptx=True,
        mma=("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",),
    )
    bf16 = _gemm("triton", ptx=True, mma=("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",))
    table = str(Inspection({"cublas": [fp8, bf16]}, {}, "t"))
    assert f"FP8   {fp8}" in table and f"high  {bf16}" in table


def test_assert_all_fp8_tells_unproven_gemms_from_those_proven_not_fp8():
    """An unproven GEMM fails the check, as one proven not FP8 does, but the error does not
    claim that it runs in high precision: it counts each kind."""
    unproven = _gemm("pallas mosaic gpu")
    bf16 = _gemm("triton", ptx=True, mma=("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",))
    fp8 = _gemm("cublasLt f8")
    assert unproven.proven is False and bf16.proven is True and fp8.proven is True
    with pytest.raises(fp8jax.Fp8InspectionError) as error:
        fp8jax.assert_all_fp8(Inspection({"cublas": [unproven, bf16, fp8]}, {}, "t"))
    message = str(error.value)
    assert message.startswith("2 GEMM(s) of fp8jax layers are not shown to run on FP8 tensor")
    assert "(1 proven not to, 1 not proven either way;" in message
    assert str(unproven) in message and str(bf16) in message and str(fp8) not in message


def test_assert_all_fp8_checks_modes_given_as_an_iterator():
    """`modes` given as a generator was used up by the check that it is not empty: no mode
    was left to check and a high-precision GEMM of an fp8jax layer passed."""
    bf16 = _gemm("cublas")
    report = Inspection({"cublas": [bf16]}, {}, "t")
    with pytest.raises(fp8jax.Fp8InspectionError, match="1 GEMM"):
        fp8jax.assert_all_fp8(report, modes=(m for m in ["cublas"]))
    with pytest.raises(fp8jax.Fp8InspectionError, match="1 GEMM"):
        fp8jax.assert_all_fp8(report, modes=iter(["cublas"]))


def test_assert_all_fp8_refuses_arguments_an_inspection_cannot_take():
    """An inspection already made was checked as it was, whatever arguments came with it
    (`merge_dots=False`, a batch): they were silently ignored. They now raise."""
    report = Inspection({"cublas": [_gemm("cublasLt f8")]}, {}, "t")
    assert fp8jax.assert_all_fp8(report) is report
    with pytest.raises(TypeError, match=r"merge_dots"):
        fp8jax.assert_all_fp8(report, merge_dots=False)
    with pytest.raises(TypeError, match=r"1 argument"):
        fp8jax.assert_all_fp8(report, 3)


@pytest.mark.parametrize("strict", ["no", "False", 0, None])
def test_assert_all_fp8_strict_is_true_or_false(strict):
    """`strict="no"` (any truthy value) checked every GEMM of the program, `0` or `None`
    only fp8jax layers', without a word; only True or False are now taken."""
    report = Inspection({"cublas": [_gemm("cublasLt f8")]}, {}, "t")
    with pytest.raises(TypeError, match=rf"strict={strict!r}"):
        fp8jax.assert_all_fp8(report, strict=strict)


def test_a_mode_the_inspection_lacks_is_named():
    """`count`, `layers` and `offending` of a mode not compiled raised a bare KeyError
    ('default'); they now name the mode and the inspection's modes."""
    report = Inspection({"cublas": [_gemm("cublasLt f8")]}, {}, "t")
    assert report.count("cublas") == (1, 1)
    for call in (
        lambda: report.count("default"),
        lambda: report.layers("default"),
        lambda: report.offending(modes=("default",)),
    ):
        with pytest.raises(ValueError, match=r"mode='default'.*\['cublas'\]"):
            call()


def test_indexing_a_mode_the_inspection_lacks_names_its_modes():
    """`report.gemms["default"]` of an inspection compiled in "cublas" alone raised a bare
    KeyError('default'); every figure by mode now names the modes it has."""
    report = Inspection({"cublas": [_gemm("cublasLt f8")]}, {"cublas": None}, "t")
    assert report.gemms["cublas"] == [_gemm("cublasLt f8")] and "default" not in report.gemms
    for field in ("gemms", "memory", "traffic", "cost", "collectives"):
        with pytest.raises(KeyError, match=rf"Inspection.{field}\['default'\].*has \["):
            getattr(report, field)["default"]
    assert report.gemms.get("default") is None  # `get` and `in` as for any dict
    copied = pickle.loads(pickle.dumps(report))
    assert dataclasses.asdict(copied)["gemms"] == {
        "cublas": [dataclasses.asdict(_gemm("cublasLt f8"))]
    }
    with pytest.raises(KeyError, match=r"Inspection.gemms\['default'\]"):
        copied.gemms["default"]


def test_a_program_without_a_gemm_says_so_in_its_table():
    """A program with no GEMM printed "0 of 0 GEMMs" and nothing else; its table now says
    that no product was compiled as a GEMM, and why that happens."""
    gemms = {"cublas": [], "default": [_gemm("cublasLt f8", mode="default")]}
    cublas, default = str(Inspection(gemms, {}, "t")).split("[default]")
    assert "0 of 0 GEMMs" in cublas and "no GEMM: " in cublas and "no GEMM" not in default


def test_a_layer_converted_alone_is_named_in_the_table():
    """A Linear converted as the whole model has the empty path: its rows read "/fwd"."""
    alone = Gemm("cublas", "cublas-gemm.1", "cublasLt f8", "f8e4m3fn", "f8e4m3fn", "fp8jax[]/fwd")
    assert alone.layer == "" and alone.role == "fwd"
    assert str(alone).startswith("(the model)/fwd: cublasLt f8")
    assert str(_gemm("cublasLt f8")).startswith("l1/fwd: ")


def _named(kernel: str, lhs: str, op_name: str, **fields) -> Gemm:
    return Gemm("cublas", "g", kernel, lhs, lhs, op_name, **fields)


def test_strict_adds_the_gemms_outside_fp8jax_layers():
    """A high-precision GEMM outside every fp8jax layer (a head) offends only with
    `strict=True`; an fp8jax layer's does always. A program whose only GEMM is the head
    offends in nothing, and proves nothing either."""
    fp8 = _named("cublasLt f8", "f8e4m3fn", "jit(f)/fp8jax[l1]/fwd/dot_general")
    head = _named("cublas", "bf16", "jit(f)/head/dot_general")
    layer = _named("cublas", "bf16", "jit(f)/fp8jax[l2]/wgrad/dot_general")
    report = Inspection({"cublas": [fp8, head]}, {}, "t")
    assert report.offending() == [] and report.offending(strict=True) == [head]
    assert fp8jax.assert_all_fp8(report) is report
    with pytest.raises(fp8jax.Fp8InspectionError, match="1 GEMM"):
        fp8jax.assert_all_fp8(report, strict=True)
    with pytest.raises(fp8jax.Fp8InspectionError, match="none of its 1 GEMMs runs on FP8"):
        fp8jax.assert_all_fp8(Inspection({"cublas": [head]}, {}, "t"))  # nothing offends
    report = Inspection({"cublas": [fp8, head, layer]}, {}, "t")
    assert report.offending() == [layer] and report.offending(strict=True) == [head, layer]


def test_a_train_step_s_first_steps_program_is_checked_too():
    """A step's first-steps program (delayed scaling's warm start) is checked as its other
    one: a high-precision layer GEMM there offends, and one with no FP8 GEMM proves
    nothing, however FP8 the recorded program is."""
    fp8 = _named("cublasLt f8", "f8e4m3fn", "jit(f)/fp8jax[l1]/fwd/dot_general")
    bf16 = _named("cublas", "bf16", "jit(f)/fp8jax[l1]/fwd/dot_general")
    first = Inspection({"cublas": [bf16]}, {}, "t")
    report = Inspection({"cublas": [fp8]}, {}, "t", first_steps=first)
    assert report.offending() == [bf16]
    with pytest.raises(fp8jax.Fp8InspectionError, match="1 GEMM"):
        fp8jax.assert_all_fp8(report)
    empty = Inspection({"cublas": [fp8]}, {}, "t", first_steps=Inspection({"cublas": []}, {}, "t"))
    assert empty.offending() == []
    with pytest.raises(fp8jax.Fp8InspectionError, match="nothing proves"):
        fp8jax.assert_all_fp8(empty)


def test_fp8_operands_multiplied_at_16_bits_count_as_not_fp8():
    """A generated kernel of FP8 operands whose PTX multiplies f16 (`mma.sync ... f16`) is
    not FP8, even without a conversion seen in its PTX: counted among the FP8-operand
    GEMMs, not the FP8 ones; a GEMM with one FP8 operand takes no FP8 operands."""
    mma = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",)
    f8 = _named("triton", "f8e4m3fn", "jit(f)/fp8jax[l1]/fwd/dot", ptx=True, mma=mma)
    half = dataclasses.replace(f8, rhs="bf16")
    assert f8.fp8_operands and not f8.fp8 and f8.proven
    assert not half.fp8_operands and not half.fp8
    assert "takes FP8 operands but converts them to f16" in f8.verdict, f8.verdict
    table = str(Inspection({"cublas": [f8, half]}, {}, "t"))
    assert "0 of 2 GEMMs run on FP8 tensor cores (1 take FP8 operands)" in table
    assert f"high  {f8}" in table


def test_offending_refuses_a_mode_given_as_a_string():
    """`offending(modes="cublas")` read the string letter by letter and raised about a mode
    'c'; it now names the string and the tuple it should be."""
    report = Inspection({"cublas": [_gemm("cublas")]}, {}, "t")
    assert report.offending(modes=("cublas",)) == [_gemm("cublas")]
    with pytest.raises(ValueError, match=r"modes='cublas' should be a tuple.*\('cublas',\)"):
        report.offending(modes="cublas")

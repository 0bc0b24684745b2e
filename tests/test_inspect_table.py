"""The inspection's table: a GEMM nothing proved either way is not marked high precision."""

import pytest

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

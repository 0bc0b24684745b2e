"""A printed Cost shows the figures of a small program, not zeros."""

import re

import pytest

from fp8jax import Cost


def _figure(text: str, label: str) -> float:
    return float(re.search(rf"^{re.escape(label)}: ([0-9.e+-]+)", text, re.M).group(1))


@pytest.mark.parametrize("m, n, k", [(256, 1024, 512), (8192, 8192, 8192)])
def test_printed_cost_matches_its_fields(m, n, k):
    flops = 2 * m * n * k  # one bf16 GEMM, by hand
    moved = 2 * m * n  # its bf16 output read once by an activation
    cost = Cost({"bf16": flops}, {"rest": moved}, ())
    text = str(cost)
    assert _figure(text, "GEMMs") * 1e12 == pytest.approx(flops, rel=1e-3)
    assert _figure(text, "  bf16") * 1e12 == pytest.approx(flops, rel=1e-3)
    assert _figure(text, "non-GEMM HBM traffic") * 1e9 == pytest.approx(moved, rel=1e-3)
    seconds = _figure(text, "estimate at H100 peaks") / 1e3
    assert seconds == pytest.approx(cost.estimate_seconds(), rel=1e-3)

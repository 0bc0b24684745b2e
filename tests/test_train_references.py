"""The train step's pieces against hand-rolled references, for the slips a mutation run of
`fp8jax/_src/train` found no test for: each test fails with one such one-line slip."""

import numpy as np

from fp8jax._src.train.loss_scale import DynamicLossScale


def test_a_dynamic_scale_may_start_at_its_floor():
    """The docs' "the initial scale, at least `min_loss_scale`": equal to it is accepted; a backoff
    there stays at the floor (the reference: max(scale * backoff, floor))."""
    for floor in (1.0, 2.0**-20, float(np.finfo(np.float32).tiny)):
        ls = DynamicLossScale(loss_scale=floor, min_loss_scale=floor, period=2)
        assert float(ls.loss_scale) == floor
        ls = ls.adjust(False)
        assert float(ls.loss_scale) == max(floor * 0.5, floor) == floor
        ls = ls.adjust(True).adjust(True)
        assert float(ls.loss_scale) == 2 * floor

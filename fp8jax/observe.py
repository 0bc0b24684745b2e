"""`fp8jax.observe`: the observers, one family under one name.

- what runs on FP8 tensor cores, proven on a compile: `inspect`, `assert_all_fp8`,
  `h100_mesh`, and what they report (`Inspection`, `Gemm`, `Collective`,
  `Fp8InspectionError`);
- what a compiled step costs at H100 peaks and link rates: `hlo_cost`, `Cost`, `KernelCost`,
  `CollectiveCost`;
- what the layers saw. The statistics a layer records in its state as it runs
  (`Fp8Stats` or `ExpertStats` per layer, both `AbstractStats`; `OperandStats` per operand:
  device arrays, updated by every step) are read by `telemetry` into `LayerTelemetry` /
  `OperandTelemetry` (one per layer and operand, with the scales and amaxes beside them)
  and printed by `report`.

Every name is also at the top level (`fp8jax.hlo_cost` is `fp8jax.observe.hlo_cost`), except
that `from fp8jax import *` leaves `inspect` out, so as not to shadow the standard library's
module: use `fp8jax.inspect` or `fp8jax.observe.inspect`.
"""

from ._src.core.stats import AbstractStats as AbstractStats
from ._src.core.stats import ExpertStats as ExpertStats
from ._src.core.stats import Fp8Stats as Fp8Stats
from ._src.core.stats import OperandStats as OperandStats
from ._src.observe.cost import hlo_cost as hlo_cost
from ._src.observe.deviceless import h100_mesh as h100_mesh
from ._src.observe.inspect import assert_all_fp8 as assert_all_fp8
from ._src.observe.inspect import inspect as inspect
from ._src.observe.results import Collective as Collective
from ._src.observe.results import Fp8InspectionError as Fp8InspectionError
from ._src.observe.results import Gemm as Gemm
from ._src.observe.results import Inspection as Inspection
from ._src.observe.roofline import CollectiveCost as CollectiveCost
from ._src.observe.roofline import Cost as Cost
from ._src.observe.roofline import KernelCost as KernelCost
from ._src.observe.telemetry import LayerTelemetry as LayerTelemetry
from ._src.observe.telemetry import OperandTelemetry as OperandTelemetry
from ._src.observe.telemetry import report as report
from ._src.observe.telemetry import telemetry as telemetry

__all__ = [
    "AbstractStats",
    "Collective",
    "CollectiveCost",
    "Cost",
    "ExpertStats",
    "Fp8InspectionError",
    "Fp8Stats",
    "Gemm",
    "Inspection",
    "KernelCost",
    "LayerTelemetry",
    "OperandStats",
    "OperandTelemetry",
    "assert_all_fp8",
    "h100_mesh",
    "hlo_cost",
    "inspect",
    "report",
    "telemetry",
]

"""fp8jax: FP8 mixed-precision training for JAX, Equinox and Haliax, by `dot_general` injection.

```python
model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(targets=r".*mlp.*"))
```
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import observe as observe
from ._src.convert.autocast import fp8_autocast as fp8_autocast
from ._src.convert.config import DEFAULT_EXCLUDE as DEFAULT_EXCLUDE
from ._src.convert.config import Fp8Config as Fp8Config
from ._src.convert.dispatch import conversion_plan as conversion_plan
from ._src.convert.dispatch import fp8_linear_layers as fp8_linear_layers
from ._src.convert.plan import ConversionPlan as ConversionPlan
from ._src.convert.plan import Fp8ConversionWarning as Fp8ConversionWarning
from ._src.convert.plan import LayerChoice as LayerChoice
from ._src.core.compile_options import gpu_compiler_options as gpu_compiler_options
from ._src.core.compile_options import gpu_xla_flags as gpu_xla_flags
from ._src.core.errors import Fp8StateError as Fp8StateError
from ._src.core.errors import OperandShapeError as OperandShapeError
from ._src.core.errors import StateNotDifferentiatedError as StateNotDifferentiatedError
from ._src.core.errors import StateUsedTwiceError as StateUsedTwiceError
from ._src.core.formats import dequantize as dequantize
from ._src.core.formats import fp8_dtype as fp8_dtype
from ._src.core.formats import fp8_max as fp8_max
from ._src.core.formats import quantize as quantize
from ._src.core.remat import fp8_dots_saveable as fp8_dots_saveable
from ._src.core.remat import save_fp8_operands as save_fp8_operands
from ._src.core.stats import AbstractStats as AbstractStats
from ._src.core.stats import ExpertStats as ExpertStats
from ._src.core.stats import Fp8Stats as Fp8Stats
from ._src.core.stats import OperandStats as OperandStats
from ._src.core.updates import OverwriteWithGradient as OverwriteWithGradient
from ._src.core.updates import apply_updates as apply_updates
from ._src.core.updates import partition_for_grad_overwrite as partition_for_grad_overwrite
from ._src.core.updates import with_fp8_state as with_fp8_state
from ._src.gemm.exchange import ExpertExchange as ExpertExchange
from ._src.gemm.exchange import expert_exchange as expert_exchange
from ._src.layers.grouped import GroupedLinear as GroupedLinear
from ._src.layers.grouped import expert_specs as expert_specs
from ._src.layers.linear import Linear as Linear
from ._src.layers.moe_linear import Fp8MoELinear as Fp8MoELinear
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
from ._src.ops.dot_general import Fp8DotGeneral as Fp8DotGeneral
from ._src.ops.ragged_dot import Fp8RaggedDot as Fp8RaggedDot
from ._src.ops.warm_start import scales_recorded as scales_recorded
from ._src.ops.warm_start import without_warm_start as without_warm_start
from ._src.recipes import MXFP8 as MXFP8
from ._src.recipes import BlockScaledRecipe as BlockScaledRecipe
from ._src.recipes import BlockwiseScaling as BlockwiseScaling
from ._src.recipes import CurrentScaling as CurrentScaling
from ._src.recipes import DelayedScaling as DelayedScaling
from ._src.recipes import PerTensorRecipe as PerTensorRecipe
from ._src.recipes import QTensor as QTensor
from ._src.recipes import QTerms as QTerms
from ._src.recipes import Recipe as Recipe
from ._src.recipes import ResidualFP8 as ResidualFP8
from ._src.recipes import ResidualState as ResidualState
from ._src.recipes import TensorState as TensorState
from ._src.recipes import compute_scale as compute_scale
from ._src.train.accumulate import accumulate_gradients as accumulate_gradients
from ._src.train.checkpoint import load_checkpoint as load_checkpoint
from ._src.train.checkpoint import save_checkpoint as save_checkpoint
from ._src.train.grad import combine_by_max as combine_by_max
from ._src.train.grad import filter_grad as filter_grad
from ._src.train.grad import filter_value_and_grad as filter_value_and_grad
from ._src.train.loss_scale import DynamicLossScale as DynamicLossScale
from ._src.train.loss_scale import LossScale as LossScale
from ._src.train.loss_scale import NoOpLossScale as NoOpLossScale
from ._src.train.loss_scale import StaticLossScale as StaticLossScale
from ._src.train.loss_scale import all_finite as all_finite
from ._src.train.loss_scale import rescale_gradient_states as rescale_gradient_states
from ._src.train.loss_scale import select_tree as select_tree
from ._src.train.optim import low_precision_state as low_precision_state
from ._src.train.policy import Policy as Policy
from ._src.train.step import StepMetrics as StepMetrics
from ._src.train.step import TrainState as TrainState
from ._src.train.step import TrainStep as TrainStep
from ._src.train.step import make_train_step as make_train_step

if TYPE_CHECKING:  # Flax support: imported on first use (flax is the `nnx` / `linen` extra)
    from ._src.convert.linen.convert import Fp8Linen as Fp8Linen
    from ._src.convert.linen.train import LinenTrainState as LinenTrainState
    from ._src.convert.nnx.grouped import Fp8NnxRaggedDot as Fp8NnxRaggedDot
    from ._src.convert.nnx.grouped import NnxGroupedLinear as NnxGroupedLinear
    from ._src.convert.nnx.layers import Fp8NnxDotGeneral as Fp8NnxDotGeneral
    from ._src.convert.nnx.layers import Fp8NnxEinsum as Fp8NnxEinsum
    from ._src.convert.nnx.layers import Fp8State as Fp8State
    from ._src.convert.nnx.train import NnxTrainStep as NnxTrainStep
    from ._src.convert.nnx.train import (
        nnx_rescale_gradient_states as nnx_rescale_gradient_states,
    )
    from ._src.convert.nnx.train import nnx_train_step as nnx_train_step
    from ._src.convert.nnx.train import nnx_update_fp8_state as nnx_update_fp8_state
    from ._src.convert.nnx.train import nnx_value_and_grad as nnx_value_and_grad

#: Names that import Flax, resolved on first access so that `import fp8jax` never does: each
#: with its module under `_src.convert`.
_FLAX_NAMES = {
    "Fp8Linen": "linen.convert",
    "LinenTrainState": "linen.train",
    "Fp8NnxDotGeneral": "nnx.layers",
    "Fp8NnxRaggedDot": "nnx.grouped",
    "NnxGroupedLinear": "nnx.grouped",
    "Fp8NnxEinsum": "nnx.layers",
    "Fp8State": "nnx.layers",
    "NnxTrainStep": "nnx.train",
    "nnx_train_step": "nnx.train",
    "nnx_rescale_gradient_states": "nnx.train",
    "nnx_update_fp8_state": "nnx.train",
    "nnx_value_and_grad": "nnx.train",
}


def __getattr__(name: str) -> Any:
    if name not in _FLAX_NAMES:
        raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")
    try:
        module = importlib.import_module(f"._src.convert.{_FLAX_NAMES[name]}", __name__)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "flax":
            raise
        extra = _FLAX_NAMES[name].split(".")[0]
        raise ImportError(
            f"fp8jax.{name} is fp8jax's Flax {extra.upper() if extra == 'nnx' else 'Linen'} "
            f"support, which needs Flax: pip install 'fp8jax[{extra}]'."
        ) from e
    return getattr(module, name)


def __dir__() -> list[str]:
    """The public names (the Flax ones too, before their first use), not this module's own
    imports (`importlib`, `typing`'s)."""
    return sorted({*__all__, *_FLAX_NAMES, "inspect", "observe", "__version__"})


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_EXCLUDE",
    "AbstractStats",
    "MXFP8",
    "BlockScaledRecipe",
    "BlockwiseScaling",
    "Collective",
    "CollectiveCost",
    "ConversionPlan",
    "Cost",
    "CurrentScaling",
    "DelayedScaling",
    "DynamicLossScale",
    "Fp8Config",
    "Fp8ConversionWarning",
    "Fp8DotGeneral",
    "Fp8InspectionError",
    "Fp8Linen",
    "Fp8MoELinear",
    "Fp8NnxDotGeneral",
    "Fp8NnxEinsum",
    "Fp8NnxRaggedDot",
    "ExpertExchange",
    "Fp8RaggedDot",
    "Fp8State",
    "Fp8StateError",
    "ExpertStats",
    "Fp8Stats",
    "Gemm",
    "GroupedLinear",
    "Inspection",
    "KernelCost",
    "LayerChoice",
    "LayerTelemetry",
    "LinenTrainState",
    "Linear",
    "LossScale",
    "NnxGroupedLinear",
    "NnxTrainStep",
    "NoOpLossScale",
    "OperandShapeError",
    "OperandStats",
    "OperandTelemetry",
    "OverwriteWithGradient",
    "PerTensorRecipe",
    "Policy",
    "QTensor",
    "QTerms",
    "Recipe",
    "ResidualFP8",
    "ResidualState",
    "StateNotDifferentiatedError",
    "StateUsedTwiceError",
    "StaticLossScale",
    "StepMetrics",
    "TensorState",
    "TrainState",
    "TrainStep",
    "accumulate_gradients",
    "all_finite",
    "apply_updates",
    "assert_all_fp8",
    "combine_by_max",
    "compute_scale",
    "conversion_plan",
    "dequantize",
    "expert_exchange",
    "expert_specs",
    "filter_grad",
    "filter_value_and_grad",
    "fp8_dots_saveable",
    "fp8_autocast",
    "fp8_dtype",
    "fp8_linear_layers",
    "fp8_max",
    "gpu_compiler_options",
    "gpu_xla_flags",
    "h100_mesh",
    "hlo_cost",
    "load_checkpoint",
    "low_precision_state",
    "make_train_step",
    "nnx_rescale_gradient_states",
    "nnx_train_step",
    "nnx_update_fp8_state",
    "nnx_value_and_grad",
    "partition_for_grad_overwrite",
    "quantize",
    "report",
    "rescale_gradient_states",
    "save_checkpoint",
    "save_fp8_operands",
    "scales_recorded",
    "select_tree",
    "telemetry",
    "with_fp8_state",
    "without_warm_start",
]

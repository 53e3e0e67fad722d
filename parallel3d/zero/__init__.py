"""ZeRO stages 0-3 with optional optimizer-state offload (host memory or disk): flat bucketed buffers,
sharded mixed-precision AdamW, clipping, sharded checkpoints."""

from parallel3d.zero.lr_schedule import ConstantLR, WarmupCosine
from parallel3d.zero.memory import MEMORY_CATEGORIES
from parallel3d.zero.optimizer import StepInfo, ZeroOptimizer
from parallel3d.zero.options import OFFLOAD_MODES, ZERO_STAGES, OptimizerOptions, ZeroOptions
from parallel3d.zero.options import ZERO3_RESHARD as RESHARD_MODES
from parallel3d.zero.precision import LossScaler

__all__ = ["ConstantLR", "LossScaler", "MEMORY_CATEGORIES", "OFFLOAD_MODES", "OptimizerOptions", "RESHARD_MODES",
           "StepInfo", "WarmupCosine", "ZERO_STAGES", "ZeroOptimizer", "ZeroOptions"]

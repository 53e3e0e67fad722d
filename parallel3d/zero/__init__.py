"""ZeRO stages 0/1/2: flat buffers, sharded mixed-precision AdamW, clipping, sharded checkpoints."""

from parallel3d.zero.lr_schedule import ConstantLR, WarmupCosine
from parallel3d.zero.optimizer import MEMORY_CATEGORIES, ZERO_STAGES, StepInfo, ZeroOptimizer
from parallel3d.zero.precision import LossScaler

__all__ = ["ConstantLR", "LossScaler", "MEMORY_CATEGORIES", "StepInfo", "WarmupCosine", "ZERO_STAGES", "ZeroOptimizer"]

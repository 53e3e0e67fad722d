"""Learning-rate schedules: callables ``step -> lr`` (``step`` counts optimizer steps from 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up to ``max_lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``decay_steps``.

    Step ``s < warmup_steps`` gets ``max_lr * (s + 1) / warmup_steps``; after
    ``decay_steps`` the rate stays at ``min_lr``.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int

    def __post_init__(self) -> None:
        if not (self.max_lr > 0 and 0 <= self.min_lr <= self.max_lr):
            raise ValueError(f"lr schedule: need max_lr > 0 and 0 <= min_lr <= max_lr, got max_lr={self.max_lr}, "
                             f"min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < self.warmup_steps:
            raise ValueError(f"lr schedule: need 0 <= warmup_steps <= decay_steps, got warmup_steps="
                             f"{self.warmup_steps}, decay_steps={self.decay_steps}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class ConstantLR:
    lr: float

    def __call__(self, step: int) -> float:
        return self.lr

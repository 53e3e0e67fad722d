"""Precision settings and the dynamic loss scaler.

``train.precision``: ``fp32`` (parameters are their own master weights),
``bf16`` and ``fp16`` (parameters in half precision, fp32 master weights per
shard). Only fp16 scales the loss: its gradients overflow or underflow without
it. The scaler halves the scale after an overflow (the step is skipped on every
rank) and doubles it after ``growth_interval`` consecutive good steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel3d.option_checks import check_choice, check_positive
from parallel3d.zero.options import PRECISIONS

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of ``train.precision`` (or a gradient dtype spelled the same way)."""
    return DTYPES[check_choice("train.precision", precision, PRECISIONS)]


@dataclass
class LossScaler:
    """Dynamic loss scale (a constant 1.0 when ``enabled`` is False)."""

    enabled: bool = True
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0
            return
        check_positive("fp16 loss scaling: loss_scale_init", self.scale, error=ValueError)
        checks = [
            ("loss_scale_growth_factor", self.growth_factor, self.growth_factor > 1, "> 1"),
            ("loss_scale_backoff_factor", self.backoff_factor, 0 < self.backoff_factor < 1, "in (0, 1)"),
            ("loss_scale_growth_interval", self.growth_interval,
             isinstance(self.growth_interval, int) and self.growth_interval >= 1, "an integer >= 1"),
            ("loss_scale_min", self.min_scale, 0 < self.min_scale <= self.scale, "in (0, loss_scale_init]"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"fp16 loss scaling: {key}={value!r} must be {allowed}")

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        """The scaler's state (never its settings, which belong to the run that loads it)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved scale; a state saved without scaling (bf16/fp32), or loaded into a run
        without it, leaves this scaler as configured."""
        if not self.enabled or not state.get("enabled", True):
            return
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])

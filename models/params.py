"""Exact parameter counts and shapes, from a model built on the meta device (no memory, no init)."""

from __future__ import annotations

from models.config import ModelConfig
from models.transformer import build_model
from parallel3d.parallel_state import ParallelState


def count_parameters(config: ModelConfig, *, verbose: bool = True) -> int:
    """Number of parameters of the whole (tp=1, unpadded) model; printed when ``verbose``."""
    model = build_model(config, ParallelState.single_process(device="meta"), device="meta")
    total = sum(p.numel() for p in model.parameters())
    if verbose:
        print(f"{config.name or config.arch}: {total:,} parameters")
    return total


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole (tp=1, unpadded) model: its name and shape."""
    model = build_model(config, ParallelState.single_process(device="meta"), device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}

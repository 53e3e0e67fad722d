"""Model definitions (GPT, Llama) built from parallel3d's tensor-parallel layers."""

from models.config import ModelConfig

__all__ = ["ModelConfig"]

"""Model definitions (GPT, Llama) built from parallel3d's tensor-parallel layers.

``build_model(config, pstate, ...)`` builds one rank's shard of any slice of layers;
``get_config(name, **overrides)`` returns a named ``ModelConfig``;
``count_parameters(config)`` gives the exact count (meta device).
"""

from models.config import ModelConfig
from models.params import count_parameters
from models.registry import NAMED_CONFIGS, config_names, get_config
from models.transformer import TransformerLM, build_model

__all__ = ["ModelConfig", "NAMED_CONFIGS", "TransformerLM", "build_model", "config_names", "count_parameters",
           "get_config"]

"""``HFFormat``: how one Hugging Face ``transformers`` family stores a model (the data ``models.hf`` converts by).

The families themselves: ``models.hf_formats`` (GPT-2, Llama), ``models.hf_moe`` (Mixtral, Qwen2-MoE,
Qwen3-MoE) and ``models.hf_deepseek`` (DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models.config import ModelConfig


@dataclass(frozen=True)
class HFFormat:
    """How one HF family stores a model of our ``arch`` (module docstring)."""

    arch: str  # our ModelConfig.arch
    model_type: str  # HF config.model_type
    architecture: str  # the HF class written into config.json
    modules: tuple[tuple[str, str], ...]  # (our module path, HF module path); layer paths are relative
    layer_prefix: str  # HF prefix of layer i, "{}" standing for i
    qkv: tuple[str, ...]  # HF module(s) holding our attn.qkv: (fused,) or (q, k, v)
    transposed_weights: bool  # 2-D weights inside layers are stored [in, out]
    config_to_hf: Callable[[ModelConfig], Any]  # our config -> a transformers config (raises if impossible)
    config_from_hf: Callable[[Any], ModelConfig]  # a transformers config -> ours (raises if unsupported)
    # Mixtures of experts: "{e}" in a module path stands for the global expert index. Checkpoints on disk
    # (and the hub) hold one tensor per expert; transformers >= 5 modules hold them fused
    # (``<moe>.experts.gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``) under ``fused_moe_module``.
    moe_module: str = ""  # the HF MoE block in checkpoints ("block_sparse_moe" / "mlp")
    fused_moe_module: str = "mlp"  # the same block in transformers >= 5 modules
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # our w1, w3, w2 per expert
    # Rows a family orders otherwise than we do (DeepSeek-V3's interleaved rotary pairs):
    # ``reorder(cfg, our module path, tensor, to_hf)`` -> the tensor in the other order (None: none do).
    reorder: Callable[[ModelConfig, str, Any, bool], Any] | None = None
    # Non-parameter tensors a family stores per layer (DeepSeek-V3's e_score_correction_bias, our router's
    # expert_bias buffer): ``layer_buffers(cfg, layer)`` -> ((our path in the layer, HF path, shape), ...).
    layer_buffers: Callable[[ModelConfig, int], tuple[tuple[str, str, tuple[int, ...]], ...]] | None = None

    def hf_module(self, ours: str) -> str:
        """The HF module path of our module path (a global one, or one relative to its layer)."""
        for a, b in self.modules:
            if a == ours:
                return b
            if "{e}" in a:
                head, tail = a.split("{e}")
                if ours.startswith(head) and ours.endswith(tail) and ours[len(head):len(ours) - len(tail)].isdigit():
                    return b.replace("{e}", ours[len(head):len(ours) - len(tail)])
        raise ValueError(f"HF {self.model_type} has no tensor for our {ours!r}")



def rope_base(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise ValueError(f"HF rope_type={rope_type!r} (rope scaling) is not supported; only 'default'")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return float(10000.0 if theta is None else theta)



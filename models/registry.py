"""Named model configurations (``get_config(name, **overrides)``).

Published values; sources are cited next to each and in tests/test_models.py:
- GPT-2 124M: Radford et al. 2019 and the HF ``gpt2`` config (n_layer 12, n_embd 768, n_head 12,
  vocab 50257, n_positions 1024, layer_norm_epsilon 1e-5).
- GPT-3 175B: Brown et al. 2020, Table 2.1 (96 layers, d_model 12288, 96 heads, context 2048;
  GPT-2 vocabulary 50257).
- Llama 2 7B: Touvron et al. 2023 and the ``meta-llama/Llama-2-7b-hf`` config.
- Llama 3 8B / 70B and Llama 3.1 405B: the ``meta-llama/Meta-Llama-3-8B``, ``Meta-Llama-3-70B`` and
  ``Llama-3.1-405B`` model-card configs. (Llama 3.1's "llama3" RoPE frequency scaling is not
  modelled; it changes no parameter.)
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig

_GPT = dict(arch="gpt", tie_embeddings=True, use_bias=True, norm_eps=1e-5)
_LLAMA = dict(arch="llama", tie_embeddings=False, use_bias=False, norm_eps=1e-5)

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    # Test models: tiny but with every feature (4 layers, heads and vocab divisible by 4, GQA).
    "gpt_tiny": dict(_GPT, num_layers=4, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=64),
    "llama_tiny": dict(_LLAMA, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=176,
                       vocab_size=512, max_seq_len=64, rope_base=10000.0),
    # Tiny mixtures of experts (models.moe_config): Mixtral-style (8 experts, top-2 softmax) and
    # DeepSeek-style (8 fine-grained experts + 1 shared, sigmoid with the aux-loss-free bias, layer 0 dense).
    "mixtral_tiny": dict(_LLAMA, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=176,
                         vocab_size=512, max_seq_len=64, rope_base=10000.0,
                         moe=dict(num_experts=8, top_k=2, ffn_hidden_size=64, score_function="softmax",
                                  normalize_topk=True, aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    "deepseek_tiny": dict(_LLAMA, num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=176,
                          vocab_size=512, max_seq_len=64, rope_base=10000.0,
                          moe=dict(num_experts=8, top_k=2, ffn_hidden_size=32, num_shared_experts=1,
                                   dense_first=1, score_function="sigmoid", normalize_topk=True,
                                   bias_update_rate=0.001, aux_loss_coeff=0.001, aux_loss_scope="sequence")),
    "gpt2_124m": dict(_GPT, num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257, max_seq_len=1024),
    "gpt3_175b": dict(_GPT, num_layers=96, hidden_size=12288, num_heads=96, vocab_size=50257, max_seq_len=2048),
    "llama2_7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, ffn_hidden_size=11008,
                      vocab_size=32000, max_seq_len=4096, rope_base=10000.0),
    "llama3_8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                      vocab_size=128256, max_seq_len=8192, rope_base=500000.0),
    "llama3_70b": dict(_LLAMA, num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
                       vocab_size=128256, max_seq_len=8192, rope_base=500000.0),
    "llama31_405b": dict(_LLAMA, num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                         ffn_hidden_size=53248, vocab_size=128256, max_seq_len=131072, rope_base=500000.0),
}


def config_names() -> list[str]:
    return list(NAMED_CONFIGS)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The named config with ``overrides`` applied (unknown keys and names are ValueErrors)."""
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {config_names()}")
    return ModelConfig(name=name, **NAMED_CONFIGS[name]).replace(**overrides)

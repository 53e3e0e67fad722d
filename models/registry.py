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
- Mixtral 8x7B: Jiang et al. 2024 and the ``mistralai/Mixtral-8x7B-v0.1`` config (32 layers, hidden 4096,
  32 heads / 8 kv, expert FFN 14336, 8 experts top-2, vocab 32000, rope_theta 1e6, router_aux_loss_coef
  0.02); 46.7B total, 12.9B active parameters.
- Qwen3-235B-A22B: the ``Qwen/Qwen3-235B-A22B`` config (94 layers, hidden 4096, 64 heads / 4 kv of width
  128, q/k RMSNorm, 128 experts of 1536 top-8 normalised, vocab 151936, rope_theta 1e6); 235B total,
  22B active.
- DeepSeek-V3: Liu et al. 2024 (DeepSeek-V3 technical report) and the ``deepseek-ai/DeepSeek-V3`` config
  (61 layers, hidden 7168, MLA with 128 heads, q_lora 1536, kv_lora 512, nope 128 + rope 64, v 128; the
  first 3 layers dense of 18432, then 256 routed experts of 2048 top-8 in 8 groups (4 chosen) with sigmoid
  scores, the aux-loss-free bias (update speed 0.001), routed_scaling_factor 2.5 and one shared expert;
  vocab 129280); 671B total, 37B active, both without the multi-token-prediction module (the report's
  14B MTP module is not modelled). Its YaRN context extension is not modelled (it changes no
  parameter); max_seq_len is the 4K pretraining context.
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
    # Real-size mixtures of experts for the estimator and planner (build them on the meta device).
    "mixtral_8x7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                         vocab_size=32000, max_seq_len=32768, rope_base=1000000.0,
                         moe=dict(num_experts=8, top_k=2, score_function="softmax", normalize_topk=True,
                                  aux_loss_coeff=0.02)),
    "qwen3_235b_a22b": dict(_LLAMA, num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4, kv_channels=128,
                            qk_norm=True, ffn_hidden_size=12288, vocab_size=151936, max_seq_len=40960,
                            norm_eps=1e-6, rope_base=1000000.0,
                            moe=dict(num_experts=128, top_k=8, ffn_hidden_size=1536, score_function="softmax",
                                     normalize_topk=True, aux_loss_coeff=0.001)),
    "deepseek_v3_671b": dict(_LLAMA, num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128,
                             ffn_hidden_size=18432, vocab_size=129280, max_seq_len=4096, norm_eps=1e-6,
                             rope_base=10000.0,
                             mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                      v_head_dim=128),
                             moe=dict(num_experts=256, top_k=8, ffn_hidden_size=2048, num_shared_experts=1,
                                      dense_first=3, score_function="sigmoid", normalize_topk=True,
                                      scaling_factor=2.5, num_groups=8, topk_groups=4, bias_update_rate=0.001,
                                      aux_loss_coeff=0.0001, aux_loss_scope="sequence")),
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

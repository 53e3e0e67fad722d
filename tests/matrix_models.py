"""The small models the layout matrix draws: dense (``MODELS``) and mixtures of experts (``MOE_MODELS``).

Invariant: each model holds every feature the layouts interact with at a size two cores train in seconds,
and ``max_seq_len`` is the matrix's ``SEQ_LEN`` (``tests/shape_fuzz.py`` draws its own shapes instead).
"""

from __future__ import annotations

from typing import Any

SEQ_LEN = 32

# Two small models with every feature the layouts interact with: tied embeddings and
# learned positions (gpt); GQA, rotary, untied head and a vocabulary that does not divide
# by tp (llama: 510 = 2 * 255, padded for tp=4). 8 layers allow pp * virtual_stages = 8.
MODELS: dict[str, dict[str, Any]] = {
    "gpt": dict(name="matrix_gpt", arch="gpt", num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=None,
                ffn_hidden_size=None, vocab_size=512, max_seq_len=SEQ_LEN, tie_embeddings=True, use_bias=True,
                dropout=0.1),
    "llama": dict(name="matrix_llama", arch="llama", num_layers=8, hidden_size=64, num_heads=8, num_kv_heads=4,
                  ffn_hidden_size=96, vocab_size=510, max_seq_len=SEQ_LEN, tie_embeddings=False, use_bias=False,
                  dropout=0.1),
}

# Mixtures of experts (drawn by ``_draw_moe`` only, ids ``MOE_BASE + k`` and the ``moe_`` coverage
# properties; the dense draws above are unchanged). The aux loss is per sequence: a per-micro-batch
# aux loss depends on the micro-batch size, which the layouts vary (models.moe_config).
MOE_MODELS: dict[str, dict[str, Any]] = {
    "mixtral": dict(name="matrix_mixtral", arch="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=96, vocab_size=510, max_seq_len=SEQ_LEN, tie_embeddings=False, use_bias=False,
                    dropout=0.1, moe=dict(num_experts=8, top_k=2, ffn_hidden_size=32, aux_loss_coeff=0.01,
                                          aux_loss_scope="sequence", z_loss_coeff=0.001)),
    "deepseek": dict(name="matrix_deepseek", arch="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                     ffn_hidden_size=96, vocab_size=510, max_seq_len=SEQ_LEN, tie_embeddings=False, use_bias=False,
                     dropout=0.1, moe=dict(num_experts=8, top_k=2, ffn_hidden_size=16, num_shared_experts=1,
                                           dense_first=1, score_function="sigmoid", bias_update_rate=0.01,
                                           aux_loss_coeff=0.001, aux_loss_scope="sequence")),
}

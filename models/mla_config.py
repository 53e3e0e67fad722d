"""The ``model.mla`` section: multi-head latent attention (DeepSeek-V2/V3), off by default.

``kv_lora_rank = 0`` is ordinary attention (the default). Otherwise every layer's attention is
MLA (``models.spec.LatentSpec``; ``models.mla`` builds it): keys and values come from a
``kv_lora_rank`` latent plus one shared rotary key of ``qk_rope_head_dim``; queries from a
``q_lora_rank`` latent (0: straight from the hidden state). Query/key heads are
``qk_nope_head_dim + qk_rope_head_dim`` wide, value heads ``v_head_dim``; ``model.num_kv_heads``
and ``model.kv_channels`` are then unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.spec import LatentSpec


@dataclass(frozen=True)
class MLAConfig:
    """The config keys under ``model.mla`` (module docstring)."""

    kv_lora_rank: int = 0  # 0: ordinary (grouped-query) attention
    q_lora_rank: int = 0  # 0: queries projected from the hidden state directly
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    def spec(self) -> LatentSpec:
        return LatentSpec(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                          qk_nope_dim=self.qk_nope_head_dim, qk_rope_dim=self.qk_rope_head_dim,
                          v_head_dim=self.v_head_dim)

    def validate(self) -> None:
        """Raise ValueError naming the key (``model.mla.<key>``) and what is allowed."""
        for key, low in (("kv_lora_rank", 0), ("q_lora_rank", 0), ("qk_nope_head_dim", 0),
                         ("qk_rope_head_dim", 2), ("v_head_dim", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"model.mla.{key}={value!r}: allowed an integer >= {low}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim}: rotary pairs need an even width")

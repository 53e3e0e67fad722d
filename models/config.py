"""Typed model configuration shared by the models, the trainer and the planners.

One dataclass covers every architecture; ``arch`` names a preset of ``models.spec.ARCH_PRESETS``:
- ``"gpt"``: learned positions, pre-LayerNorm, GELU MLP (ffn = 4h by default); the named
  GPT configs tie input/output embeddings and use biases.
- ``"llama"``: rotary positions, RMSNorm, SwiGLU MLP; the named Llama configs use
  grouped-query attention (``num_kv_heads``), an untied output and no biases.
``use_bias``, ``tie_embeddings`` and ``num_kv_heads`` apply to any arch. ``spec`` is the
resolved architecture (``models.spec.ModelSpec``) and ``shape`` its parameters and FLOPs
(``models.shape.ModelShape``); code reads those, never ``arch``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from functools import cached_property
from typing import Any

from kernels.runtime import BACKENDS
from models.moe_config import MoEConfig
from models.shape import ModelShape
from models.spec import ARCH_PRESETS, NORM_TAKES_BIAS, AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec

ARCHS = tuple(ARCH_PRESETS)


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: same as num_heads (multi-head attention)
    ffn_hidden_size: int | None = None  # None: 4*hidden (gpt); llama configs set it explicitly
    vocab_size: int = 512
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_base: float = 10000.0  # rotary positions only (arch llama)
    tie_embeddings: bool = True
    use_bias: bool = True
    dropout: float = 0.0  # hidden/residual dropout; attention probabilities are not dropped
    init_std: float = 0.02
    fused_kernels: bool = True  # False forces the torch reference ops (kernels.dispatch backend "torch")
    kernel_backend: str = "auto"  # kernels.backend: auto | triton | apex | torch
    name: str = ""
    moe: MoEConfig = field(default_factory=MoEConfig)  # model.moe: mixture-of-experts layers (models.moe_config)

    @property
    def backend(self) -> str:
        """The kernels.dispatch backend the model should ask for."""
        return self.kernel_backend if self.fused_kernels else "torch"

    def __post_init__(self) -> None:
        if not isinstance(self.moe, MoEConfig):  # a config section (mapping or schema dataclass)
            values = asdict(self.moe) if is_dataclass(self.moe) else dict(self.moe)
            object.__setattr__(self, "moe", MoEConfig(**values))
        self.validate()

    # ---- derived -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @cached_property
    def spec(self) -> ModelSpec:
        """The architecture as data: ``arch``'s preset with this config's sizes and flags."""
        preset = ARCH_PRESETS[self.arch]
        norm = NormSpec(kind=preset.norm, size=self.hidden_size, bias=self.use_bias and NORM_TAKES_BIAS[preset.norm],
                        eps=self.norm_eps)
        attention = AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  qkv_bias=self.use_bias, out_bias=self.use_bias)
        block = BlockSpec(hidden_size=self.hidden_size, norm=norm, attention=attention,
                          mlp=MLPSpec(kind=preset.mlp, ffn_size=self.ffn_size, bias=self.use_bias))
        moe_block = replace(block, moe=self.moe.options(self.ffn_size)) if self.moe.enabled else block
        blocks = tuple(moe_block if self.moe.is_moe_layer(i) else block for i in range(self.num_layers))
        return ModelSpec(arch=self.arch, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                         max_seq_len=self.max_seq_len, positions=preset.positions, rope_base=self.rope_base,
                         tied_head=self.tie_embeddings, blocks=blocks, final_norm=norm)

    @cached_property
    def shape(self) -> ModelShape:
        """Parameters (by sharding class) and FLOPs per token of this model (``models.shape``)."""
        return ModelShape.from_spec(self.spec)

    # ---- validation ------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the key and the allowed values."""
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} is not one of {ARCHS}")
        for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key}={value!r} must be an integer >= 1")
        if self.num_kv_heads is not None and (not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1):
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads!r} must be an integer >= 1 or null")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 1):
            raise ValueError(f"model.ffn_hidden_size={self.ffn_hidden_size!r} must be an integer >= 1 or null")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.kv_heads}"
            )
        if ARCH_PRESETS[self.arch].positions == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernels.backend={self.kernel_backend!r} is not one of {', '.join(BACKENDS)}")
        for key in ("norm_eps", "init_std", "rope_base"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.{key}={getattr(self, key)!r}: must be a number > 0")
        self.moe.validate(self.num_layers, self.ffn_size)

    def replace(self, **changes: Any) -> "ModelConfig":
        if isinstance(changes.get("moe"), dict):  # a partial model.moe override keeps the other keys
            changes["moe"] = replace(self.moe, **changes["moe"])
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown model keys {sorted(unknown)}; known: {[f.name for f in fields(self)]}")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

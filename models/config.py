"""Typed model configuration shared by the models, the trainer and the planners.

One dataclass covers every architecture; ``arch`` names a preset of ``models.spec.ARCH_PRESETS``:
- ``"gpt"``: learned positions, pre-LayerNorm, GELU MLP (ffn = 4h by default); the named
  GPT configs tie input/output embeddings and use biases.
- ``"llama"``: rotary positions, RMSNorm, SwiGLU MLP; the named Llama configs use
  grouped-query attention (``num_kv_heads``), an untied output and no biases.
``use_bias``, ``tie_embeddings`` and ``num_kv_heads`` apply to any arch; so do ``kv_channels`` (the
attention head width when it is not ``hidden / heads``, Megatron's name; HF ``head_dim``),
``qkv_bias`` (q/k/v biases apart from the others: Qwen2), ``qk_norm`` (per-head RMSNorm of queries
and keys: Qwen3) and the ``mla`` section (multi-head latent attention: DeepSeek-V3,
``models.mla_config``). ``spec`` is the
resolved architecture (``models.spec.ModelSpec``) and ``shape`` its parameters and FLOPs
(``models.shape.ModelShape``); code reads those, never ``arch``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from functools import cached_property
from typing import Any

from kernels.runtime import BACKENDS
from models.mla_config import MLAConfig
from models.moe_config import MoEConfig
from models.shape import ModelShape
from models.spec import ARCH_PRESETS, NORM_TAKES_BIAS, AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec
from parallel3d.option_checks import check_range

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
    kv_channels: int | None = None  # attention head width; None: hidden_size / num_heads
    qkv_bias: bool | None = None  # biases on q, k, v; None: use_bias
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary positions (Qwen3)
    mla: MLAConfig = field(default_factory=MLAConfig)  # model.mla: multi-head latent attention (models.mla_config)

    @property
    def backend(self) -> str:
        """The kernels.dispatch backend the model should ask for."""
        return self.kernel_backend if self.fused_kernels else "torch"

    def __post_init__(self) -> None:
        for key, cls in (("moe", MoEConfig), ("mla", MLAConfig)):
            section = getattr(self, key)
            if not isinstance(section, cls):  # a config section (mapping or schema dataclass)
                values = asdict(section) if is_dataclass(section) else dict(section)
                object.__setattr__(self, key, cls(**values))
        self.validate()

    # ---- derived -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        """The width of one attention head (``kv_channels``, default ``hidden / heads``)."""
        return self.hidden_size // self.num_heads if self.kv_channels is None else self.kv_channels

    @property
    def rope_dim(self) -> int:
        """The width rotary positions turn: the head (or MLA's rotary part of it)."""
        return self.mla.qk_rope_head_dim if self.mla.enabled else self.head_dim

    def layout_sizes(self) -> dict[str, Any]:
        """The sizes ``Topology.check_model`` splits: the hidden size only where heads split it (with
        ``kv_channels`` the heads have their own width and ``hidden_size`` need not divide by them)."""
        return dict(num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.kv_heads,
                    hidden_size=self.hidden_size if self.kv_channels is None else None)

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @cached_property
    def spec(self) -> ModelSpec:
        """The architecture as data: ``arch``'s preset with this config's sizes and flags."""
        preset = ARCH_PRESETS[self.arch]
        norm = NormSpec(kind=preset.norm, size=self.hidden_size, bias=self.use_bias and NORM_TAKES_BIAS[preset.norm],
                        eps=self.norm_eps)
        qk_norm = (NormSpec(kind="rmsnorm", size=self.head_dim, bias=False, eps=self.norm_eps)
                   if self.qk_norm else None)
        attention = AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  qkv_bias=self.use_bias if self.qkv_bias is None else self.qkv_bias,
                                  out_bias=self.use_bias, qk_norm=qk_norm,
                                  latent=self.mla.spec() if self.mla.enabled else None)
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
        if self.kv_channels is not None and (isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int)
                                             or self.kv_channels < 1):
            raise ValueError(f"model.kv_channels={self.kv_channels!r} must be an integer >= 1 or null")
        for key in ("qk_norm", "qkv_bias"):
            value = getattr(self, key)
            if not (isinstance(value, bool) or (value is None and key == "qkv_bias")):
                allowed = "true, false or null" if key == "qkv_bias" else "true or false"
                raise ValueError(f"model.{key}={value!r} must be {allowed}")
        self.mla.validate()
        if self.mla.enabled and ARCH_PRESETS[self.arch].positions != "rope":
            raise ValueError(f"model.mla with model.arch={self.arch!r}: latent attention needs rotary positions "
                             f"(arch llama)")
        if self.mla.enabled and self.qk_norm:
            raise ValueError("model.qk_norm=true with model.mla: latent attention normalises its latents instead; "
                             "allowed: qk_norm=false")
        if self.kv_channels is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.kv_heads}"
            )
        if ARCH_PRESETS[self.arch].positions == "rope" and self.rope_dim % 2:
            source = (f"model.kv_channels={self.kv_channels}" if self.kv_channels is not None else
                      f"model.hidden_size/num_heads={self.hidden_size}/{self.num_heads}")
            raise ValueError(f"{source}: rotary embeddings need an even head_dim, got {self.rope_dim}")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernels.backend={self.kernel_backend!r} is not one of {', '.join(BACKENDS)}")
        for key in ("norm_eps", "init_std", "rope_base"):  # inf passes "> 0" and makes every loss nan
            check_range(f"model.{key}", getattr(self, key), 0, lo_open=True)
        self.moe.validate(self.num_layers, self.ffn_size)

    def replace(self, **changes: Any) -> "ModelConfig":
        for key in ("moe", "mla"):  # a partial model.moe / model.mla override keeps the other keys
            if isinstance(changes.get(key), dict):
                changes[key] = replace(getattr(self, key), **changes[key])
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown model keys {sorted(unknown)}; known: {[f.name for f in fields(self)]}")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

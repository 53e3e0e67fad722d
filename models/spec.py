"""Architectures as data: what a model's blocks are made of.

``ModelConfig.arch`` names an ``ArchPreset`` (``ARCH_PRESETS``): the kinds of norm, MLP and
position embedding. ``ModelConfig.spec`` resolves the preset with the config's sizes and flags
into a ``ModelSpec``: the embedding, one ``BlockSpec`` per layer (``blocks[i]`` is global layer
``i``), the final norm and the head. The layers (``models.blocks``, ``models.transformer``), the
shape (``models.shape``: parameters and FLOPs) and HF interop (``models.hf_formats``) read the
spec, never ``arch``.

Adding an architecture is data: a preset here (and an ``HFFormat`` for HF interop), and for a new
*kind* one entry in each table that builds or counts kinds (``models.transformer.MLP_CLASSES``,
``models.blocks.NORM_FUNCTIONS``, ``models.shape.MLP_PARAMS``, the kept-tensor tables of
``parallel3d.planning.activations``).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.moe.options import MoEOptions

NORM_KINDS: tuple[str, ...] = ("layernorm", "rmsnorm")
MLP_KINDS: tuple[str, ...] = ("gelu", "swiglu")
POSITION_KINDS: tuple[str, ...] = ("learned", "rope")

# Which norm kinds have a bias (when the model has biases): RMSNorm has none by definition.
NORM_TAKES_BIAS: dict[str, bool] = {"layernorm": True, "rmsnorm": False}


@dataclass(frozen=True)
class ArchPreset:
    """What one ``model.arch`` value fixes; sizes, biases and tying come from the config keys."""

    norm: str  # one of NORM_KINDS
    mlp: str  # one of MLP_KINDS
    positions: str  # one of POSITION_KINDS

    def __post_init__(self) -> None:
        for what, value, allowed in (("norm", self.norm, NORM_KINDS), ("mlp", self.mlp, MLP_KINDS),
                                     ("positions", self.positions, POSITION_KINDS)):
            if value not in allowed:
                raise ValueError(f"ArchPreset.{what}={value!r} is not one of {allowed}")


ARCH_PRESETS: dict[str, ArchPreset] = {
    # GPT-2 / GPT-3: pre-LayerNorm, GELU (tanh) MLP, learned absolute positions.
    "gpt": ArchPreset(norm="layernorm", mlp="gelu", positions="learned"),
    # Llama 2 / 3: RMSNorm, SwiGLU MLP, rotary positions.
    "llama": ArchPreset(norm="rmsnorm", mlp="swiglu", positions="rope"),
}


@dataclass(frozen=True)
class NormSpec:
    """One normalisation over the hidden dimension: a weight of ``size`` (and a bias)."""

    kind: str  # one of NORM_KINDS
    size: int
    bias: bool
    eps: float


@dataclass(frozen=True)
class LatentSpec:
    """Multi-head latent attention (DeepSeek-V2/V3 MLA): queries and keys/values pass through low-rank
    latents. ``q_lora_rank`` 0: queries straight from the hidden state. Query/key heads are
    ``qk_nope_dim + qk_rope_dim`` wide (rotary positions on the last ``qk_rope_dim``, one rotary key
    shared by every head), value heads ``v_head_dim``."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim


@dataclass(frozen=True)
class AttentionSpec:
    """Causal self-attention with ``num_heads`` query heads sharing ``num_kv_heads`` key/value heads.

    ``head_dim`` need not be ``hidden / num_heads`` (Qwen3: ``model.kv_channels``). ``qk_norm``: an RMSNorm
    of width ``head_dim`` over every query head and one over every key head, before rotary positions
    (Qwen3). ``latent``: multi-head latent attention instead (``LatentSpec``; ``head_dim``, the kv
    heads and ``qk_norm`` then unused).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    out_bias: bool
    qk_norm: NormSpec | None = None
    latent: LatentSpec | None = None

    @property
    def kind(self) -> str:
        """``mla`` (latent), ``mha`` (one kv head per query head), ``mqa`` (one kv head) or ``gqa`` (groups)."""
        if self.latent is not None:
            return "mla"
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def score_dim(self) -> int:
        """The width of one query/key head (what QK^T contracts over)."""
        return self.head_dim if self.latent is None else self.latent.qk_head_dim

    @property
    def value_dim(self) -> int:
        """The width of one value head (what PV produces per head)."""
        return self.head_dim if self.latent is None else self.latent.v_head_dim


@dataclass(frozen=True)
class MLPSpec:
    """The feed-forward part of a block: ``kind`` with ``ffn_size`` hidden units."""

    kind: str  # one of MLP_KINDS
    ffn_size: int
    bias: bool


@dataclass(frozen=True)
class BlockSpec:
    """One pre-norm transformer block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    With ``moe`` set the MLP is a mixture of experts (``parallel3d.moe.MoELayer`` with these
    options; ``mlp`` is then unused); otherwise the dense ``mlp``.
    """

    hidden_size: int
    norm: NormSpec  # the two pre-norms (norm1, norm2)
    attention: AttentionSpec
    mlp: MLPSpec
    moe: MoEOptions | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A whole language model: embedding, ``blocks`` (one per global layer), final norm, head."""

    arch: str
    hidden_size: int
    vocab_size: int
    max_seq_len: int
    positions: str  # one of POSITION_KINDS; "learned" adds a [max_seq_len, h] table to the embedding
    rope_base: float
    tied_head: bool  # the output projection is the word embedding
    blocks: tuple[BlockSpec, ...]
    final_norm: NormSpec

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    @property
    def rotary(self) -> bool:
        return self.positions == "rope"

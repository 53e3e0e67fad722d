"""The model's shape: every parameter (name, full shape, how tp holds it) and the FLOPs per token.

One description for every architecture, derived from a ``models.spec.ModelSpec`` alone
(``ModelConfig.shape``). MFU (``parallel3d.metrics``), the memory estimator and the planner's cost
model (``parallel3d.planning``) and pipeline partitioning (``parallel3d.pipeline.partition``) read
it. Tests hold it equal to the built model (names, shapes, tp sharding, every rank's shard) and to
torch's ``FlopCounterMode``.

Parameters. ``ModelShape.tensors()`` lists every parameter once as a ``ParamShape`` whose ``name`` is
the built parameter's ``global_name``. Sharding classes (``Params``): ``tp_split`` (column-parallel
weights and biases, row-parallel weights, the vocabulary rows of the word embedding and head: each
tp rank holds 1/tp, the vocabulary padded to a multiple of tp) and ``replicated`` (norms,
row-parallel biases, learned positions: whole on every tp rank). Counts are unpadded unless a
``tp`` is given. ``active`` is what one token uses: every parameter of a dense model
(mixture-of-experts tensors carry ``active < 1``).

FLOPs per token, all ranks together, count matmuls only (2 per multiply-add), as ``FlopCounterMode``
does; norms, activations, softmax, bias adds and embedding lookups are not counted.
- forward: 2 x the active matmul weight elements of every layer, plus attention, plus the head
  ``2 * h * V`` (tied or not: the logits matmul runs). Attention per layer is QK^T and PV,
  ``2 * s_attended * num_heads * (qk_head_dim + v_head_dim)`` (``4 * s_attended * num_heads *
  head_dim`` unless latent attention makes the widths differ), by the ``attention`` convention: ``"full"``:
  s_attended = s, every query against every key, as FlopCounterMode counts
  ``scaled_dot_product_attention`` (causal or not) and as Megatron-LM's formula counts;
  ``"causal"``: s/2, the pairs a causal mask keeps (diagonal ignored).
- backward: 2 x forward (the gradients of both operands of every matmul). torch's formula for the
  fused SDPA kernels counts 2.5x for attention (it adds the flash backward's recomputed QK^T); the
  math path's matmuls, and the convention here, give 2x.
- recompute (``RECOMPUTED``): forward work re-run in backward. ``"none"`` gives model FLOPs (what
  MFU counts); ``"selective"`` re-runs each layer's attention core, ``"full"`` each layer's whole
  forward (never the head). ``StepFlops.hardware`` includes it (HFU, Megatron's TFLOP/s). torch's
  non-reentrant checkpoint may stop a recompute early, once the tensors backward needs are
  rebuilt (it then skips a region's trailing matmul, e.g. fc2/down, or PV on the math SDPA path);
  the convention counts the whole recomputed forward, as Megatron-LM's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable

from models.spec import AttentionSpec, BlockSpec, MLPSpec, ModelSpec, NormSpec
from parallel3d.moe.options import MoEOptions
from parallel3d.tensor_parallel.layers import padded_vocab_size

SHARDING_CLASSES: tuple[str, ...] = ("tp_split", "replicated")
ATTENTION_CONVENTIONS: tuple[str, ...] = ("causal", "full")
# The forward work each recompute mode re-runs in backward: LayerFlops fields, per layer.
RECOMPUTED: dict[str, tuple[str, ...]] = {"none": (), "selective": ("attention",), "full": ("matmul", "attention")}

COLUMN, ROW = "column", "row"  # column: [out/tp, in], bias split; row: [out, in/tp], bias replicated
# The matrices of each MLP kind, by module name: COLUMN maps h -> ffn, ROW maps ffn -> h.
MLP_MATRICES: dict[str, tuple[tuple[str, str], ...]] = {
    "gelu": (("fc1", COLUMN), ("fc2", ROW)),
    "swiglu": (("gate", COLUMN), ("up", COLUMN), ("down", ROW)),
}


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its full, unpadded shape and how a tp group holds it."""

    name: str  # the built parameter's global_name
    shape: tuple[int, ...]
    split_dim: int | None = None  # the dim split over tp; None: every tp rank holds it whole
    vocab: bool = False  # split_dim is the vocabulary: padded to a multiple of tp before the split
    matmul: bool = False  # a weight matrix every token that uses it multiplies (2 FLOPs per element)
    active: float = 1.0  # the fraction of tokens that use it
    expert: int | None = None  # a routed expert's global index (held by one ep rank, split over etp)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def sharding(self) -> str:
        return "replicated" if self.split_dim is None else "tp_split"

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one of ``tp`` ranks holds."""
        if self.split_dim is None:
            return self.shape
        size = self.shape[self.split_dim]
        if self.vocab:
            size = padded_vocab_size(size, tp)
        elif size % tp:
            raise ValueError(f"{self.name}: dim {self.split_dim} ({size}) is not divisible by tp={tp}")
        return tuple(size // tp if d == self.split_dim else s for d, s in enumerate(self.shape))

    def local_numel(self, tp: int) -> int:
        n = 1
        for d in self.local_shape(tp):
            n *= d
        return n

    def padded_numel(self, tp: int) -> int:
        """Elements over the whole tp group (a split tensor's shards together, vocabulary padded)."""
        return self.numel if self.split_dim is None else self.local_numel(tp) * tp


@dataclass(frozen=True)
class Params:
    """Parameter elements by sharding class (over a tp group)."""

    tp_split: int = 0  # over the tp group: each rank holds tp_split / tp
    replicated: int = 0  # every tp rank holds all of it

    @classmethod
    def of(cls, tensors: Iterable[ParamShape], *, active: bool = False) -> "Params":
        """The tensors' elements by class (``active``: weighted by the fraction of tokens using each)."""
        split = replicated = 0.0
        for t in tensors:
            n = t.numel * (t.active if active else 1.0)
            if t.split_dim is None:
                replicated += n
            else:
                split += n
        return cls(round(split), round(replicated))

    @property
    def total(self) -> int:
        return self.tp_split + self.replicated

    def per_rank(self, tp: int) -> int:
        """Elements on one of ``tp`` ranks (layer tensors divide evenly)."""
        return self.tp_split // tp + self.replicated


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of one layer (or a sum of layers), all tp ranks together."""

    matmul: float  # weight matmuls
    attention: float  # QK^T and PV under the attention convention

    @property
    def total(self) -> float:
        return self.matmul + self.attention

    def __add__(self, other: "LayerFlops") -> "LayerFlops":
        return LayerFlops(self.matmul + other.matmul, self.attention + other.attention)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of one training step (forward + backward, plus recomputation)."""

    forward: float
    backward: float
    recompute: float

    @property
    def model(self) -> float:
        """Forward + backward: the work the model needs (what MFU counts)."""
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        """Model FLOPs plus the recomputed forward (what HFU counts)."""
        return self.model + self.recompute


@dataclass(frozen=True)
class HeldParams:
    """Parameters one tp rank of a model chunk holds, by part."""

    layers: int
    embedding: int
    head: int  # the output projection, or the tied word embedding's copy on a last, not first, chunk
    final_norm: int

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head + self.final_norm


def _check_choice(key: str, value: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {allowed}")


@dataclass(frozen=True)
class LayerShape:
    """The parameters of global layer ``index`` (a ``BlockSpec``) and its FLOPs."""

    index: int
    block: BlockSpec
    tensors: tuple[ParamShape, ...]

    @cached_property
    def params(self) -> Params:
        return Params.of(self.tensors)

    @cached_property
    def active_params(self) -> Params:
        return Params.of(self.tensors, active=True)

    @cached_property
    def _largest_by_tp(self) -> dict[int, int]:
        return {}  # filled by largest_local (the planner asks for the same few tp many times)

    def largest_local(self, tp: int) -> int:
        """Elements of this layer's largest tensor on one of ``tp`` ranks."""
        if tp not in self._largest_by_tp:
            self._largest_by_tp[tp] = max(t.local_numel(tp) for t in self.tensors)
        return self._largest_by_tp[tp]

    def forward_flops(self, seq_len: int, attention: str = "causal") -> LayerFlops:
        """Forward FLOPs per token at sequence length ``seq_len`` (module docstring)."""
        _check_choice("attention", attention, ATTENTION_CONVENTIONS)
        attended = seq_len if attention == "full" else seq_len / 2
        a = self.block.attention
        return LayerFlops(self._matmul_flops, 2.0 * attended * a.num_heads * (a.score_dim + a.value_dim))

    @cached_property
    def _matmul_flops(self) -> float:
        return 2.0 * sum(t.numel * t.active for t in self.tensors if t.matmul)


def _linear(name: str, fan_in: int, fan_out: int, parallel: str, bias: bool) -> list[ParamShape]:
    column = parallel == COLUMN
    weight = ParamShape(f"{name}.weight", (fan_out, fan_in), split_dim=0 if column else 1, matmul=True)
    # A row-parallel bias is added after the sum over tp, so every rank holds it whole.
    return [weight, ParamShape(f"{name}.bias", (fan_out,), split_dim=0 if column else None)] if bias else [weight]


def _norm(name: str, norm: NormSpec) -> list[ParamShape]:
    weight = ParamShape(f"{name}.weight", (norm.size,))
    return [weight, ParamShape(f"{name}.bias", (norm.size,))] if norm.bias else [weight]


def dense_mlp_params(prefix: str, hidden_size: int, mlp: MLPSpec) -> list[ParamShape]:
    """The parameters of a dense MLP (``MLP_MATRICES[mlp.kind]``) under ``prefix`` (``layers.<i>.mlp``)."""
    out: list[ParamShape] = []
    for name, parallel in MLP_MATRICES[mlp.kind]:
        fan_in, fan_out = (hidden_size, mlp.ffn_size) if parallel == COLUMN else (mlp.ffn_size, hidden_size)
        out += _linear(f"{prefix}.{name}", fan_in, fan_out, parallel, mlp.bias)
    return out


# The parameters of each models.spec.MLP_KINDS kind: (prefix, hidden size, MLPSpec) -> ParamShapes.
MLP_PARAMS: dict[str, Callable[[str, int, MLPSpec], list[ParamShape]]] = {
    "gelu": dense_mlp_params, "swiglu": dense_mlp_params,
}


def moe_mlp_params(prefix: str, hidden_size: int, moe: MoEOptions) -> list[ParamShape]:
    """The parameters of ``parallel3d.moe.MoELayer`` under ``prefix``: the router (every token), the routed
    experts (each used by ``top_k / num_experts`` of the tokens), the shared experts (split over tp) and
    their gate (whole on every tp rank)."""
    h, f, used = hidden_size, moe.ffn_hidden, moe.top_k / moe.num_experts
    out = [ParamShape(f"{prefix}.router.weight", (moe.num_experts, h), matmul=True)]
    for e in range(moe.num_experts):
        for name, shape in (("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f))):
            out.append(ParamShape(f"{prefix}.experts.{e}.{name}", shape, matmul=True, active=used, expert=e))
    if moe.num_shared_experts:
        width = moe.num_shared_experts * moe.shared_width
        # split over tp like the dense SwiGLU MLP: w1/w3 column parallel (rows), w2 row parallel (columns)
        out += [ParamShape(f"{prefix}.shared_experts.{name}", shape, split_dim=dim, matmul=True)
                for name, shape, dim in (("w1", (width, h), 0), ("w3", (width, h), 0), ("w2", (h, width), 1))]
    if moe.shared_expert_gate:
        out.append(ParamShape(f"{prefix}.shared_expert_gate.weight", (1, h), matmul=True))
    return out


def attention_params(prefix: str, hidden_size: int, a: AttentionSpec) -> list[ParamShape]:
    """The parameters of ``models.blocks.Attention`` (or ``models.mla.LatentAttention``) under ``prefix``
    (``layers.<i>.attn``). Latent attention: the down projections (and their norms) are whole on every
    tp rank, the up projections split by head (column), the output by head (row)."""
    h, lat = hidden_size, a.latent
    if lat is None:
        out = _linear(f"{prefix}.qkv", h, a.q_size + 2 * a.kv_size, COLUMN, a.qkv_bias)
        if a.qk_norm is not None:
            out += [*_norm(f"{prefix}.q_norm", a.qk_norm), *_norm(f"{prefix}.k_norm", a.qk_norm)]
        return out + _linear(f"{prefix}.out", a.q_size, h, ROW, a.out_bias)
    q_width = a.num_heads * lat.qk_head_dim
    if lat.q_lora_rank:
        out = [ParamShape(f"{prefix}.q_down.weight", (lat.q_lora_rank, h), matmul=True),
               ParamShape(f"{prefix}.q_latent_norm.weight", (lat.q_lora_rank,)),
               *_linear(f"{prefix}.q_up", lat.q_lora_rank, q_width, COLUMN, False)]
    else:
        out = _linear(f"{prefix}.q", h, q_width, COLUMN, False)
    return out + [ParamShape(f"{prefix}.kv_down.weight", (lat.kv_lora_rank + lat.qk_rope_dim, h), matmul=True),
                  ParamShape(f"{prefix}.kv_latent_norm.weight", (lat.kv_lora_rank,)),
                  *_linear(f"{prefix}.kv_up", lat.kv_lora_rank, a.num_heads * (lat.qk_nope_dim + lat.v_head_dim),
                           COLUMN, False),
                  *_linear(f"{prefix}.out", a.num_heads * lat.v_head_dim, h, ROW, a.out_bias)]


def layer_shape(index: int, block: BlockSpec) -> LayerShape:
    """The parameters ``models.blocks.TransformerBlock`` builds for ``block`` as layer ``index``."""
    p, h, mlp = f"layers.{index}.", block.hidden_size, block.mlp
    params = [*_norm(p + "norm1", block.norm),
              *attention_params(p + "attn", h, block.attention),
              *_norm(p + "norm2", block.norm),
              *(moe_mlp_params(p + "mlp", h, block.moe) if block.moe is not None
                else MLP_PARAMS[mlp.kind](p + "mlp", h, mlp))]
    return LayerShape(index, block, tuple(params))


@dataclass(frozen=True)
class ModelShape:
    """Every parameter and the FLOPs per token of one ``ModelSpec`` (module docstring)."""

    spec: ModelSpec
    embedding: tuple[ParamShape, ...]  # the word table first, then learned positions
    layers: tuple[LayerShape, ...]  # layers[i] is global layer i
    final_norm: tuple[ParamShape, ...]
    head: tuple[ParamShape, ...]  # empty when tied to the word embedding

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "ModelShape":
        h = spec.hidden_size
        embedding = [ParamShape("embedding.word.weight", (spec.vocab_size, h), split_dim=0, vocab=True)]
        if spec.learned_positions:
            embedding.append(ParamShape("embedding.position.weight", (spec.max_seq_len, h)))
        head = () if spec.tied_head else (ParamShape("head.weight", (spec.vocab_size, h), split_dim=0, vocab=True,
                                                 matmul=True),)
        return cls(spec=spec, embedding=tuple(embedding),
                   layers=tuple(layer_shape(i, block) for i, block in enumerate(spec.blocks)),
                   final_norm=tuple(_norm("final_norm", spec.final_norm)), head=head)

    # ---- parameters ------------------------------------------------------------------
    @property
    def word_embedding(self) -> ParamShape:
        return self.embedding[0]

    @cached_property
    def uniform_layers(self) -> bool:
        """Every layer has the same block (dense models): per-layer numbers do not depend on the index."""
        return len({layer.block for layer in self.layers}) <= 1

    def tensors(self) -> tuple[ParamShape, ...]:
        """Every parameter of the whole model once (a tied head is the word embedding)."""
        return (*self.embedding, *(t for layer in self.layers for t in layer.tensors), *self.final_norm, *self.head)

    def total_params(self, tp: int = 1) -> int:
        """Parameters of the whole model, the vocabulary padded for ``tp`` (tp=1: unpadded)."""
        return sum(t.padded_numel(tp) for t in self.tensors())

    def active_params(self) -> float:
        """Parameters one token uses (equal to ``total_params()`` for a dense model)."""
        return sum(t.numel * t.active for t in self.tensors())

    def held_tensors(self, layers: Iterable[int], pre_process: bool, post_process: bool) -> tuple[ParamShape, ...]:
        """The tensors a model chunk built by ``build_model`` holds: its ``layers``, the embedding when
        ``pre_process``, the final norm and head when ``post_process`` (a tied head on a chunk without
        the embedding holds its own copy of the word table)."""
        held: list[ParamShape] = list(self.embedding) if pre_process else []
        held += [t for i in layers for t in self.layers[i].tensors]
        if post_process:
            held += [*self.final_norm, *self.head]
            if self.spec.tied_head and not pre_process:
                held.append(self.word_embedding)
        return tuple(held)

    def held_params(self, tp: int, layers: Iterable[int], pre_process: bool, post_process: bool) -> HeldParams:
        """Parameters on one of ``tp`` ranks of a chunk (``held_tensors``), by part."""
        def count(tensors: Iterable[ParamShape]) -> int:
            return sum(t.local_numel(tp) for t in tensors)

        head = count(self.head) if post_process else 0
        if post_process and self.spec.tied_head and not pre_process:
            head += self.word_embedding.local_numel(tp)
        return HeldParams(layers=sum(self.layers[i].params.per_rank(tp) for i in layers),  # layers hold no vocab
                          embedding=count(self.embedding) if pre_process else 0, head=head,
                          final_norm=count(self.final_norm) if post_process else 0)

    def largest_held_tensor(self, tp: int, layers: Iterable[int], pre_process: bool, post_process: bool) -> int:
        """Elements of the largest tensor one of ``tp`` ranks of a chunk holds (``held_tensors``)."""
        outside = self.held_tensors((), pre_process, post_process)
        return max([0, *(t.local_numel(tp) for t in outside), *(self.layers[i].largest_local(tp) for i in layers)])

    # ---- FLOPs -------------------------------------------------------------------------
    def head_forward_flops(self, tp: int = 1) -> float:
        """Forward FLOPs per token of the logits matmul, over the vocabulary padded for ``tp``."""
        return 2.0 * self.spec.hidden_size * padded_vocab_size(self.spec.vocab_size, tp)

    def layers_forward_flops(self, seq_len: int, attention: str = "causal") -> LayerFlops:
        """Forward FLOPs per token of all layers together."""
        total = LayerFlops(0.0, 0.0)
        for layer in self.layers:
            total = total + layer.forward_flops(seq_len, attention)
        return total

    def flops_per_token(self, seq_len: int, *, attention: str = "causal", recompute: str = "none") -> StepFlops:
        """FLOPs per token of a training step at sequence length ``seq_len`` (module docstring)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be an integer >= 1")
        _check_choice("recompute", recompute, RECOMPUTED)
        layers = self.layers_forward_flops(seq_len, attention)
        forward = layers.total + self.head_forward_flops()
        return StepFlops(forward=forward, backward=2.0 * forward,
                         recompute=sum(getattr(layers, part) for part in RECOMPUTED[recompute]))

"""The language model (any ``config.spec``: GPT, Llama) and ``build_model``.

One module serves every layout: it holds the global layers ``[a, b)`` (possibly none) of the model
(``layers`` is a ModuleDict keyed by the *global* index, so parameter names never
depend on pp), plus the embedding when ``pre_process`` and the final norm and head
when ``post_process``. Tensor parallelism enters only through the layers it is built
from; the model code speaks of layers and shapes, not ranks.

Forward contract (docs/ARCHITECTURE.md "Model"):
``module(x, labels=None, *, sample_ids=None, step=0, document_ids=None)`` with ``x`` the token
ids ``[b, s/cp]`` when ``pre_process`` else the hidden states ``[b, s_local, h]``; returns the
mean token loss (``labels`` given) or the logits ``[b, s/cp, V_pad/tp]`` when ``post_process``,
else the hidden states ``[b, s_local, h]``. ``s_local = s/cp/tp`` with sequence parallel.
With context parallel (cp > 1) the tokens are this cp-rank's load-balanced share
(``context_parallel.split_for_cp``) and the loss is ``cp`` times its share of the cp group's
token-weighted mean, so the mean over the cp (and dp) group is the whole batch's loss.
``document_ids [b, s]`` (whole sequence): attention stays inside documents, positions restart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import dispatch
from models.blocks import BuildContext, ForwardContext, Norm, TransformerBlock
from models.config import ModelConfig
from models.gpt import Embedding, GeluMLP
from models.llama import SwiGLUMLP, rotary_tables
from models.mla import LatentAttention
from models.moe_block import moe_mlp
from models.shape import RECOMPUTED
from parallel3d import comm
from parallel3d.context_parallel.model_attention import ContextParallelAttention
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.param_meta import set_meta
from parallel3d.tensor_parallel import ParallelLMHead, column_parallel_linear, vocab_parallel_cross_entropy
from parallel3d.tensor_parallel.cross_entropy import runs_vocab_parallel_loss
from parallel3d.tensor_parallel.dropout import layout_independent_dropout
from parallel3d.tensor_parallel.layers import padded_vocab_size
from parallel3d.tensor_parallel.mappings import tp_chunk_start, tp_group_size

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState

log = logging.getLogger(__name__)

RECOMPUTE_MODES = tuple(RECOMPUTED)  # none | selective | full (models.shape says what each re-runs)
# The module of each models.spec.MLP_KINDS kind: (ctx, layer, MLPSpec) -> [b, s_local, h] -> same.
MLP_CLASSES: dict[str, type[nn.Module]] = {"gelu": GeluMLP, "swiglu": SwiGLUMLP}
EMBEDDING_LAYER = -1  # the "layer index" of the embedding's dropout site


class TransformerLM(nn.Module):
    """Global layers ``layer_range`` of a ``config.spec`` model, optionally with embedding and head."""

    def __init__(self, ctx: BuildContext, layer_range: tuple[int, int], pre_process: bool, post_process: bool) -> None:
        super().__init__()
        c, spec = ctx.config, ctx.config.spec
        self.config, self.pstate, self.seed = c, ctx.pstate, ctx.seed
        self.layer_range, self.pre_process, self.post_process = layer_range, pre_process, post_process
        self.sequence_parallel, self.recompute = ctx.sequence_parallel, ctx.recompute
        self.context_parallel = ctx.context_parallel
        self.padded_vocab_size = padded_vocab_size(c.vocab_size, ctx.pstate.size("tp"))
        self.embedding: Embedding | None = None
        if pre_process:
            self.embedding = Embedding(ctx, with_positions=spec.learned_positions)
        elif post_process and spec.tied_head:
            # A last stage that is not also first: its own copy of the tied word embedding
            # (same global name, same init); the pipeline sums its grad over the embedding group.
            self.embedding = Embedding(ctx, with_positions=False)
        if spec.tied_head and pre_process != post_process and self.embedding is not None:
            # The head's copy is read only by the head's GEMM, whose gradient can wait (zero bubble).
            set_meta(self.embedding.word.weight, tied_embedding=True, tied_head_copy=not pre_process,
                     wgrad_deferrable=not pre_process)
        self.layers = nn.ModuleDict({str(i): _block(ctx, i) for i in range(*layer_range)})
        self.final_norm = Norm(ctx, "final_norm", spec.final_norm) if post_process else None
        self.head: ParallelLMHead | None = None
        if post_process and not spec.tied_head:
            self.head = ParallelLMHead(c.hidden_size, c.vocab_size, ctx.pstate, global_name="head", seed=ctx.seed,
                                       init_std=c.init_std, sequence_parallel=ctx.sequence_parallel,
                                       dtype=ctx.dtype, device=ctx.device)
        # ZeRO-3 gathers these on their own (parallel3d.zero.units): their parameters are read only
        # inside their forward. A tied embedding is read by the head too, so it stays in the root.
        if self.embedding is not None and not spec.tied_head:
            self.embedding.zero3_unit = True
        if self.head is not None:
            self.head.zero3_unit = True

    # ---- helpers ---------------------------------------------------------------------
    def _tp(self) -> int:
        return tp_group_size(self.pstate)

    def _check_tokens(self, x: torch.Tensor) -> tuple[int, int]:
        if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {x.dtype} {tuple(x.shape)}")
        return x.shape[0], x.shape[1]

    def _check_seq(self, s: int) -> None:
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={self.config.max_seq_len}")
        if self.sequence_parallel and s % self._tp():
            raise ValueError(f"sequence parallel: sequence length {s} is not divisible by tp={self._tp()}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden ``[b, s_local, h]`` -> logits ``[b, s, V_pad/tp]``."""
        if self.head is not None:
            return self.head(hidden)
        assert self.embedding is not None
        return column_parallel_linear(hidden, self.embedding.word.weight, None, self.pstate,
                                      sequence_parallel=self.sequence_parallel)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over tokens whose label is not -100 (vocabulary-parallel when tp > 1)."""
        vocab, backend = self.config.vocab_size, self.config.backend
        if self._tp() == 1 and logits.shape[-1] == vocab:
            return self._cp_weighted(dispatch.cross_entropy(logits, labels, backend=backend), labels)
        local = logits.shape[-1]
        if runs_vocab_parallel_loss(backend, vocab, self.padded_vocab_size, local):
            return self._cp_weighted(vocab_parallel_cross_entropy(logits, labels, self.pstate, vocab_size=vocab),
                                     labels)
        start = tp_chunk_start(local, self.pstate)
        # The kernels' sharded cross entropy (fused Triton on GPU) saves the logits, not an fp32 softmax.
        rows = dispatch.vocab_sharded_cross_entropy(
            logits.reshape(-1, local), labels.reshape(-1), vocab_start=start, vocab_size=vocab,
            all_reduce_max=self._all_reduce_max, all_reduce_sum=self._all_reduce_sum, backend=backend)
        return self._cp_weighted(rows.sum() / (labels != -100).sum(), labels)

    def _cp_weighted(self, mean: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """cp > 1: this share's mean loss reweighted by its tokens, times cp, so that the mean over
        the cp group (which the gradient reduction over dp_cp takes) is the whole sequence's mean."""
        cp = self.context_parallel.size
        if cp == 1:
            return mean
        count = (labels != -100).sum().to(torch.float64).reshape(1)
        total = count.clone()
        comm.all_reduce(total, self.pstate, "cp")
        return mean * (count * cp / total).to(mean.dtype)

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.pstate, "tp", op=dist.ReduceOp.MAX)
        return t

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.pstate, "tp")
        return t

    # ---- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *,
                sample_ids: torch.Tensor | None = None, step: int = 0,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        c, cp = self.config, self.context_parallel.size
        positions = None
        if self.pre_process:
            b, s = self._check_tokens(x)
            s *= cp
            self._check_seq(s)
            if cp > 1 or document_ids is not None:
                positions = self.context_parallel.positions(b, s, document_ids, x.device)
            assert self.embedding is not None
            h = self.embedding(x, positions)
        else:
            if x.dim() != 3 or x.shape[-1] != c.hidden_size:
                raise ValueError(f"hidden states must be [batch, seq, {c.hidden_size}], got {tuple(x.shape)}")
            h = x
            b = x.shape[0]
            s = x.shape[1] * (self._tp() if self.sequence_parallel else 1) * cp
            self._check_seq(s)
            if cp > 1 or document_ids is not None:
                positions = self.context_parallel.positions(b, s, document_ids, x.device)
        training = self.training and c.dropout > 0
        if training and sample_ids is None:
            sample_ids = torch.arange(b)
        if training and tuple(sample_ids.shape) != (b,):
            raise ValueError(f"sample_ids must have shape [{b}] (one global sample index per row), "
                             f"got {tuple(sample_ids.shape)}")
        rope = rotary_tables(s, c.rope_dim, c.rope_base, h.device) if c.spec.rotary else None
        if rope is not None and positions is not None:
            rope = (rope[0][positions], rope[1][positions])
        run = ForwardContext(rope=rope, sample_ids=sample_ids, step=step, training=training,
                             document_ids=document_ids)
        if self.pre_process and training:
            h = layout_independent_dropout(h, c.dropout, seed=self.seed, step=step, sample_ids=sample_ids,
                                           layer=EMBEDDING_LAYER, site="embedding", pstate=self.pstate,
                                           sequence_parallel=self.sequence_parallel)
        full = self.recompute == "full" and torch.is_grad_enabled()
        for layer in self.layers.values():
            h = checkpoint(layer, h, run, use_reentrant=False) if full else layer(h, run)
        if not self.post_process:
            return h
        assert self.final_norm is not None
        logits = self.logits(self.final_norm(h))
        return logits if labels is None else self.loss(logits, labels)


def _block(ctx: BuildContext, layer: int) -> TransformerBlock:
    spec = ctx.config.spec.blocks[layer]
    mlp = moe_mlp(ctx, layer, spec) if spec.moe is not None else MLP_CLASSES[spec.mlp.kind](ctx, layer, spec.mlp)
    attention = LatentAttention(ctx, layer, spec.attention) if spec.attention.latent is not None else None
    return TransformerBlock(ctx, layer, spec, mlp, attention)


def _resolve_layer_range(config: ModelConfig, layer_range: tuple[int, int] | None) -> tuple[int, int]:
    if layer_range is None:
        return 0, config.num_layers
    try:
        a, b = (int(v) for v in layer_range)
    except (TypeError, ValueError):
        raise ValueError(f"layer_range must be a pair (start, stop) of ints, got {layer_range!r}") from None
    if not (0 <= a <= b <= config.num_layers):
        raise ValueError(f"layer_range={layer_range!r} must satisfy 0 <= start <= stop <= num_layers={config.num_layers}")
    return a, b


def build_model(
    config: ModelConfig,
    pstate: "ParallelState",
    *,
    seed: int = 0,
    layer_range: tuple[int, int] | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    context_parallel: ContextParallelAttention | None = None,
) -> TransformerLM:
    """Build this rank's shard of global layers ``layer_range`` (see module docstring).

    Every parameter's full value depends only on ``(seed, global name)``. ``device="meta"``
    allocates and initialises nothing (parameter counting for huge configs).
    ``context_parallel``: the job's cp attention (``ContextParallelAttention.build``); None = ring
    (p2p) attention over pstate's cp group, plain attention when cp = 1.
    ``pre_process`` / ``post_process`` default to the range touching the first / last layer; an empty
    ``layer_range`` (a == b) is allowed for a pipeline's first or last chunk: the embedding alone, or the
    final norm and head alone (pass both flags then: (0, 0) and the chunk after it both start at layer 0).
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a models.ModelConfig, got {type(config).__name__}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    tp = pstate.size("tp")
    pstate.topology.check_model(**config.layout_sizes())
    if config.ffn_size % tp:
        raise ValueError(f"model.ffn_hidden_size={config.ffn_size} is not divisible by tp={tp}")
    a, b = _resolve_layer_range(config, layer_range)
    pre = (a == 0) if pre_process is None else bool(pre_process)
    post = (b == config.num_layers) if post_process is None else bool(post_process)
    if a == b and not (pre or post):
        # An empty range is the pipeline's first chunk (embedding only) or last (final norm and head
        # only); a middle chunk without a layer would hold nothing (pipeline.partition refuses it).
        raise ValueError(f"layer_range={layer_range!r} is empty: allowed only with pre_process (the embedding "
                         f"alone) or post_process (the final norm and head alone)")
    padded = padded_vocab_size(config.vocab_size, tp)
    if padded != config.vocab_size and pstate.rank == 0 and (pre or post):
        log.info("vocab_size=%d padded to %d (a multiple of tp=%d); padding rows are zero and masked",
                 config.vocab_size, padded, tp)
    ctx = BuildContext(config=config, pstate=pstate, seed=seed, sequence_parallel=bool(sequence_parallel),
                       recompute=recompute, dtype=dtype,
                       context_parallel=context_parallel
                       or ContextParallelAttention.build(pstate, ContextParallelOptions()),
                       device=torch.device(device) if device is not None else pstate.device)
    return TransformerLM(ctx, (a, b), pre, post)

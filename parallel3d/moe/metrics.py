"""Per-step MoE statistics: expert load, drops and balancing-loss values, as loggable data.

Each ``MoELayer`` owns a ``MoEStepStats``, filled in the layer's backward (once per
micro-batch, recompute or not) with this rank's share of the micro-batch:

- tokens per expert (routed slots before capacity drops), dropped and routed slots;
- its share of the aux and z losses and its *token share* (its tokens / the loss set's
  tokens, so the shares of one micro-batch sum to 1 over its token group).

``finish_step(layers, group)`` runs once per optimizer step, after the last backward and
before (or as part of) the optimizer step: ONE all-reduce of every layer's statistics over
``group`` (every rank holding different tokens of these layers: the data-parallel, cp and
sequence-parallel ranks of a pipeline stage), then each router's ``update_bias`` with the
global load (so the bias update sees the whole global batch: right under gradient
accumulation and the same in every layout), then a reset. It returns ``MoELayerMetrics``
per layer; ``as_dict()`` gives ``moe/{layer}/...`` keys for ``metrics.jsonl`` / W&B:
tokens per expert min / max / coefficient of variation (std / mean) over the global batch,
dropped fraction, and the mean aux / z loss per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import torch
import torch.distributed as dist

from parallel3d.moe.collectives import all_reduce_sum
from parallel3d.moe.router import TopKRouter

_DROPPED, _ROUTED, _AUX, _Z, _SHARE = range(5)  # offsets after the E expert counts


class MoEStepStats:
    """One layer's accumulated statistics of the current step (this rank's shares), float64."""

    def __init__(self, num_experts: int, device: torch.device | str | None = None) -> None:
        self.num_experts = num_experts
        self.values = torch.zeros(num_experts + 5, dtype=torch.float64, device=device)
        self.micro_batches = 0

    def record(self, tokens_per_expert: torch.Tensor, dropped: torch.Tensor, routed: int,
               aux: torch.Tensor | None, z: torch.Tensor | None, token_share: torch.Tensor) -> None:
        e = self.num_experts
        self.values[:e] += tokens_per_expert.to(self.values)
        routed_t = torch.tensor(float(routed), dtype=torch.float64, device=self.values.device)
        extra = torch.stack([dropped.to(self.values).reshape(()), routed_t, _scalar(aux, self.values),
                             _scalar(z, self.values), token_share.to(self.values).reshape(())])
        self.values[e:] += extra
        self.micro_batches += 1

    def reset(self) -> None:
        self.values.zero_()
        self.micro_batches = 0


def _scalar(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device) if t is None else t.detach().to(like).reshape(())


@dataclass(frozen=True)
class MoELayerMetrics:
    """One layer's step summary over the global batch (identical on every rank of the group)."""

    name: str
    tokens_per_expert: list[float]
    dropped_fraction: float
    aux_loss: float
    z_loss: float

    @property
    def tokens_min(self) -> float:
        return min(self.tokens_per_expert)

    @property
    def tokens_max(self) -> float:
        return max(self.tokens_per_expert)

    @property
    def tokens_cv(self) -> float:
        load = torch.tensor(self.tokens_per_expert, dtype=torch.float64)
        mean = load.mean()
        return float(load.std(unbiased=False) / mean) if mean > 0 else 0.0

    def as_dict(self, prefix: str = "moe/") -> dict[str, float]:
        p = f"{prefix}{self.name}/"
        return {p + "tokens_min": self.tokens_min, p + "tokens_max": self.tokens_max, p + "tokens_cv": self.tokens_cv,
                p + "dropped_fraction": self.dropped_fraction, p + "aux_loss": self.aux_loss, p + "z_loss": self.z_loss}


class HasMoEStats(Protocol):
    stats: MoEStepStats
    router: TopKRouter


def finish_step(layers: Mapping[str, HasMoEStats], group: "dist.ProcessGroup | None") -> list[MoELayerMetrics]:
    """Reduce every layer's step statistics over ``group``, update expert biases, reset; see the module docstring."""
    if not layers:
        return []
    names = list(layers)
    packed = all_reduce_sum(torch.cat([layers[n].stats.values for n in names]), group, kind="moe_stats")
    out, start = [], 0
    for name in names:
        layer = layers[name]
        e = layer.stats.num_experts
        values = packed[start:start + e + 5]
        start += e + 5
        load = values[:e]
        layer.router.update_bias(load)
        routed, share = float(values[e + _ROUTED]), float(values[e + _SHARE])
        out.append(MoELayerMetrics(
            name=name, tokens_per_expert=load.tolist(),
            dropped_fraction=float(values[e + _DROPPED]) / routed if routed else 0.0,
            aux_loss=float(values[e + _AUX]) / share if share else 0.0,
            z_loss=float(values[e + _Z]) / share if share else 0.0))
        layer.stats.reset()
    return out

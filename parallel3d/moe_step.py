"""The trainer's side of the MoE layers: the aux-loss scale per step, ``finish_step`` once per
optimizer step, and the ``moe/`` metrics every rank can report.

- ``before_step``: every MoE layer's injected balancing-loss gradient gets the factor the
  pipeline puts on each micro-batch's main loss (``loss_scale / num_microbatches``), times cp:
  each cp rank's main loss is cp times its share (``models.transformer``) because the gradient
  reduction averages over dp x cp, and the layers' aux / z terms are plain shares of the token
  group's losses. So the aux / z losses enter the gradient exactly as if they were added to each
  micro-batch's loss. (tp needs no factor: sequence parallel's gradients are summed over tp.)
- ``finish``: after the step's last backward, ONE reduction of the layers' load statistics over
  the ranks that hold different tokens of this stage (dp x cp, times tp under sequence
  parallel), then each router's bias update (the same global load in every layout).
- ``per_rank_metrics``: a value for every MoE layer of the whole model (0 where this rank does
  not hold the layer); every value is >= 0 and equal on the ranks that hold the layer, so the
  max over the world is the layer's value on any rank (pp stages report through the world).
"""

from __future__ import annotations

from typing import Iterable

import torch

from models.config import ModelConfig
from parallel3d import comm
from parallel3d.moe import MoELayer, finish_step
from parallel3d.parallel_state import ParallelState

METRIC_NAMES = ("tokens_min", "tokens_max", "tokens_cv", "dropped_fraction", "aux_loss", "z_loss")


def layer_key(index: int) -> str:
    """The name of global layer ``index`` in ``moe/{name}/...`` metrics."""
    return f"layer_{index}"


class MoEStep:
    """This rank's MoE layers (by global layer index) and their per-step bookkeeping (module docstring)."""

    def __init__(self, chunks: Iterable[torch.nn.Module], model: ModelConfig, pstate: ParallelState,
                 sequence_parallel: bool) -> None:
        self.pstate = pstate
        self.layers: dict[str, MoELayer] = {}
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, MoELayer):
                    index = int(module.global_name.split(".")[1])  # layers.{i}.mlp
                    self.layers[layer_key(index)] = module
        self.all_keys = [layer_key(i) for i in range(model.num_layers) if model.spec.blocks[i].moe is not None]
        self.tokens_split_over_tp = sequence_parallel and pstate.size("tp") > 1
        self.last: dict[str, float] = {}

    def before_step(self, loss_scale: float, num_microbatches: int) -> None:
        for layer in self.layers.values():
            layer.aux_loss_scale = loss_scale * self.pstate.size("cp") / num_microbatches

    def finish(self) -> dict[str, float]:
        """Reduce the step's statistics, update the expert biases; the metrics of this rank's layers."""
        if not self.all_keys:
            return {}
        if self.tokens_split_over_tp:  # tp ranks hold different tokens under sequence parallel
            for layer in self.layers.values():
                comm.all_reduce(layer.stats.values, self.pstate, "tp")
        metrics = finish_step(self.layers, self.pstate.group("dp_cp"))
        self.last = {k: v for m in metrics for k, v in m.as_dict().items()}
        return self.last

    def per_rank_metrics(self) -> dict[str, float]:
        """Every MoE layer's last metrics, 0 for layers elsewhere (reduce by max over the world)."""
        return {f"moe/{key}/{name}": self.last.get(f"moe/{key}/{name}", 0.0)
                for key in self.all_keys for name in METRIC_NAMES}

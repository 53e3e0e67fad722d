"""Pipeline parallelism: layer partitioning, schedules as data, P2P and the executor.

- ``partition``: which global layers each model chunk holds (``partition_layers``).
- ``placement``: which stage runs each model chunk (a loop, or ZB-V's V).
- ``schedules``: ``build_schedule`` (gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv) as per-stage
  action lists, ``validate_schedule``, ``simulate`` -> ``Timeline``, printable views.
- ``p2p``: batched isend/irecv of activations and gradients with config-fixed shapes.
  (``receive_buffers``: their receive buffers, reused once nothing else uses them).
- ``engine``: ``PipelineEngine.run_step`` runs one stage's action list for one step
  (compiled once by ``step_plan``, executed by ``step_run``; split backwards: ``backward_split``).
- ``tied``: ``sync_tied_embedding_grads`` keeps tied embedding copies identical
  (``TiedGradFinalizer``: the engine's gradient finaliser without ZeRO).
"""

from parallel3d.pipeline import schedules as _schedules
from parallel3d.pipeline.engine import PipelineEngine, StepResult, split_batch
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.pipeline.partition import chunk_costs, partition_layers, stage_layer_ranges
from parallel3d.pipeline.schedules import *  # noqa: F401,F403  the schedule vocabulary, as schedules.__all__
from parallel3d.pipeline.tied import sync_tied_embedding_grads

__all__ = [
    "MessageSpec", "PipelineEngine", "PipelineP2P", "StepResult", "chunk_costs", "partition_layers",
    "split_batch", "stage_layer_ranges", "sync_tied_embedding_grads", *_schedules.__all__,
]

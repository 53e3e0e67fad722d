"""What the trainer saves and restores, at any layout (the trainer applies the trainer state).

``save_request`` gives what one rank hands to ``CheckpointWriter.save``: its pieces of the
weights and Adam state (``pieces.pieces_to_write``), the trainer-state object (from the
logging rank only) and the checkpoint's ``meta.json`` body. ``load_training_state``
checks format and model (rank 0 warns about settings that change the model's computation, not its shapes:
``compat.computation_changes``), reads every box this rank holds into its optimizer, refreshes
the parameters and returns the trainer-state object.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig
from parallel3d import user_warnings
from parallel3d.checkpoint import CheckpointError, read_meta
from parallel3d.checkpoint_io import compat
from parallel3d.checkpoint_io.pieces import TensorPiece, pieces_to_read, pieces_to_write, zero_owned_state
from parallel3d.checkpoint_io.planners import CheckpointMismatch
from parallel3d.checkpoint_io.state import read_state

if TYPE_CHECKING:  # pragma: no cover
    import torch.distributed as dist

    from parallel3d.config import ResolvedJob
    from parallel3d.parallel_state import ParallelState
    from parallel3d.zero.optimizer import ZeroOptimizer


def layout_record(rj: "ResolvedJob") -> dict[str, Any]:
    """The layout a checkpoint was written with (informational: any other one may resume it)."""
    p = rj.job.parallel
    return {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": rj.topology.dp, "zero_stage": p.zero_stage, "offload": p.offload,
            "schedule": p.schedule, "virtual_stages": p.virtual_stages, "order": p.order,
            "pp_layers": None if p.pp_layers is None else list(p.pp_layers)}


def save_request(opt: "ZeroOptimizer", pstate: "ParallelState", trainer_state: dict[str, Any] | None,
                 model: ModelConfig, layout: dict[str, Any], precision: str,
                 config: dict[str, Any]) -> tuple[list[TensorPiece], dict[str, Any], dict[str, Any]]:
    """``(pieces, objects, meta)`` of this rank for ``CheckpointWriter.save``."""
    objects = {} if trainer_state is None else {compat.TRAINER_KEY: trainer_state}
    meta = {"format": compat.FORMAT, "model": dataclasses.asdict(model), "layout": layout,
            "precision": precision, "config": config}
    return pieces_to_write(opt, pstate), objects, meta


def load_training_state(directory: str, opt: "ZeroOptimizer", pstate: "ParallelState", model: ModelConfig,
                        group: "dist.ProcessGroup | None") -> dict[str, Any]:
    """Collective: restore ``opt`` (weights included) from ``directory``; returns the trainer state."""
    meta = read_meta(directory)
    compat.check_format(directory, meta)
    compat.check_same_model(directory, meta, model)
    if pstate.rank == 0 and (changes := compat.computation_changes(directory, meta, model)):
        user_warnings.warn(changes)
    zero_owned_state(opt)
    try:
        objects = read_state(os.path.join(directory, compat.STATE_DIR), pieces_to_read(opt, pstate),
                             (compat.TRAINER_KEY,), group)
    except CheckpointMismatch as exc:
        raise CheckpointError(f"checkpoint {directory}: {exc}") from None
    opt.params_from_master()
    return objects[compat.TRAINER_KEY]

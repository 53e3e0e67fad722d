"""Per-rank memory of one layout, by category, for the worst rank; does it fit the device?

    python scripts/estimate_memory.py model=gpt3_175b parallel.tp=8 parallel.pp=16 --device-mem 80GB
    python scripts/estimate_memory.py model=llama3_70b parallel.tp=8 parallel.pp=4 cluster.gpus=256 \
        train.seq_len=4096 train.recompute=full parallel.zero_stage=2
    python scripts/estimate_memory.py model=llama_tiny parallel.tp=1 parallel.pp=1 parallel.cp=4 \
        parallel.cp_comm=allgather cluster.gpus=4 train.seq_len=64 train.global_batch_size=1
    python scripts/estimate_memory.py model=mixtral_tiny parallel.tp=1 parallel.pp=1 parallel.ep=4 \
        parallel.expert_zero_stage=3 parallel.zero_stage=1 cluster.gpus=4 train.seq_len=64 train.global_batch_size=4

Keys are the training job's (conf/config.yaml) plus cluster.* (conf/cluster/), including
parallel.cp / cp_comm / cp_a2a_size / ep / etp and parallel.expert_zero_stage (the routed experts'
ZeRO stage; default: parallel.zero_stage). parallel.dp=auto takes cluster.gpus / (tp * cp * pp).
``--device-mem X`` is ``cluster.device_mem=X`` (default: the cluster.device preset's memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel3d.config import resolve  # noqa: E402
from parallel3d.planning.activations import ActivationAssumptions  # noqa: E402
from parallel3d.planning.cli import (  # noqa: E402
    cluster_from,
    format_memory,
    layout_from_job,
    run_app,
    split_device_mem_flag,
)
from parallel3d.planning.memory import estimate_memory  # noqa: E402

EXPERT_ZERO_KEY = "parallel.expert_zero_stage"


def split_expert_zero_stage(argv: list[str]) -> tuple[list[str], int | None]:
    """``parallel.expert_zero_stage=N`` taken out of the overrides (a layout key the job schema may lack)."""
    rest, stage = [], None
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key != EXPERT_ZERO_KEY:
            rest.append(arg)
            continue
        if value not in ("0", "1", "2", "3"):
            print(f"error: {EXPERT_ZERO_KEY}={value!r} must be one of 0, 1, 2, 3", file=sys.stderr)
            sys.exit(2)
        stage = int(value)
    return rest, stage


def estimate_with_cp_and_experts(expert_zero_stage: int | None):
    """``run_estimate`` with the job's cp / ep dimensions on the layout."""
    def run(job) -> str:
        cluster = cluster_from(job.cluster)
        model, layout, stage_layers = layout_from_job(job, cluster)
        rj = resolve(job, world_size=cluster.gpus)
        cp_opts = rj.context_parallel
        layout = layout.replace(cp=rj.dims.cp, cp_comm=cp_opts.cp_comm, cp_a2a_size=cp_opts.cp_a2a_size,
                                ep=rj.dims.ep, etp=rj.dims.etp, expert_zero_stage=expert_zero_stage)
        assumptions = ActivationAssumptions.for_model(model, layout.precision, kernels=job.plan.kernels)
        estimate = estimate_memory(model, layout, assumptions, stage_layers=stage_layers)
        return format_memory(estimate, cluster.device.memory_bytes)
    return run


if __name__ == "__main__":
    argv, expert_stage = split_expert_zero_stage(split_device_mem_flag(sys.argv[1:]))
    sys.argv = [sys.argv[0]] + argv
    run_app("estimate", estimate_with_cp_and_experts(expert_stage))

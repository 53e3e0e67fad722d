"""Per-rank memory of one layout, by category, for the worst rank; does it fit the device?

    python scripts/estimate_memory.py model=gpt3_175b parallel.tp=8 parallel.pp=16 --device-mem 80GB
    python scripts/estimate_memory.py model=llama3_70b parallel.tp=8 parallel.pp=4 cluster.gpus=256 \
        train.seq_len=4096 train.recompute=full parallel.zero_stage=2
    python scripts/estimate_memory.py model=llama_tiny parallel.tp=1 parallel.pp=1 parallel.cp=4 \
        parallel.sequence_parallel=false parallel.cp_comm=allgather cluster.gpus=4 train.seq_len=64 train.global_batch_size=1
    python scripts/estimate_memory.py model=mixtral_tiny parallel.tp=1 parallel.pp=1 parallel.ep=4 \
        parallel.sequence_parallel=false parallel.expert_zero_stage=3 parallel.zero_stage=1 cluster.gpus=4 train.seq_len=64 train.global_batch_size=4

Keys are the training job's (conf/config.yaml) plus cluster.* (conf/cluster/), including
parallel.cp / cp_comm / cp_a2a_size / ep / etp and parallel.expert_zero_stage (the routed experts'
ZeRO stage; default: parallel.zero_stage). parallel.dp=auto takes cluster.gpus / (tp * cp * pp).
``--device-mem X`` is ``cluster.device_mem=X`` (default: the cluster.device preset's memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel3d.planning.cli import run_app, run_estimate, split_device_mem_flag  # noqa: E402

if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + split_device_mem_flag(sys.argv[1:])
    run_app("estimate", run_estimate)

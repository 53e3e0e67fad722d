"""Rank parallel layouts of a model on a cluster by predicted step time.

    python scripts/plan.py model=gpt3_175b
    python scripts/plan.py model=llama3_70b cluster.gpus=256 cluster.device=h100_80gb train.seq_len=4096
    python scripts/plan.py model=llama31_405b cluster=dgx_h200 cluster.gpus=2048 plan.json=plan.json

Keys are the training job's (conf/config.yaml) plus cluster.* (conf/cluster/) and plan.*
(conf/plan.yaml). Prints the top layouts with predicted step time, TFLOP/s and MFU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel3d.planning.cli import run_app, run_plan  # noqa: E402
from parallel3d.planning.unread_keys import unread_keys_note  # noqa: E402

if __name__ == "__main__":
    run_app("plan", run_plan, note=lambda args, job: unread_keys_note(args, job.plan.explain))

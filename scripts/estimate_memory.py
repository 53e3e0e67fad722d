"""Per-rank memory of one layout, by category, for the worst rank; does it fit the device?

    python scripts/estimate_memory.py model=gpt3_175b parallel.tp=8 parallel.pp=16 --device-mem 80GB
    python scripts/estimate_memory.py model=llama3_70b parallel.tp=8 parallel.pp=4 cluster.gpus=256 \
        train.seq_len=4096 train.recompute=full parallel.zero_stage=2

Keys are the training job's (conf/config.yaml) plus cluster.* (conf/cluster/);
parallel.dp=auto takes cluster.gpus / (tp * pp). ``--device-mem X`` is
``cluster.device_mem=X`` (default: the cluster.device preset's memory).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from parallel3d.config import ConfigError  # noqa: E402
from parallel3d.planning.cli import register_planning_schema, run_estimate, split_device_mem_flag  # noqa: E402
from parallel3d.topology import LayoutError  # noqa: E402

register_planning_schema()


@hydra.main(version_base=None, config_path=str(Path("..") / "conf"), config_name="estimate")
def main(cfg: DictConfig) -> None:
    try:
        print(run_estimate(OmegaConf.to_object(cfg)))
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv = [sys.argv[0]] + split_device_mem_flag(sys.argv[1:])
    main()

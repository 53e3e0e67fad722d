"""scripts/slurm/pretrain.sbatch: valid bash, and the srun + torchrun command it builds.

``scontrol`` and ``srun`` are replaced by small stand-ins on PATH: ``scontrol show
hostnames`` prints two node names, and ``srun`` runs its command once, as one node's
task would, so the quoting of the Hydra overrides is checked end to end.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm" / "pretrain.sbatch"
OVERRIDES = ["model=gpt3_175b", "parallel.tp=8", "parallel.pp=16", "train.out_dir=/shared/runs/my run"]


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo \"$2\" > \"$REQUEUED\"; exit 0; fi\n"
        "[ \"$1 $2\" = 'show hostnames' ] || exit 1\necho node017\necho node018\n")
    # Drop srun's own options, then run the command (one node's task).
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    # A "python" that prints its arguments, one per line, so we see what torchrun would get.
    (bin_dir / "fakepython").write_text('#!/usr/bin/env bash\necho "cwd=$PWD"\necho "env=${MARKER:-}"\n'
                                        'for a in "$@"; do echo "arg=$a"; done\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{_fake_bin(tmp_path)}:{env['PATH']}", SLURM_JOB_NODELIST="node[017-018]",
               SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO), GPUS_PER_NODE="8", **extra)
    return env


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_two_node_command_is_srun_per_node_and_torchrun_with_c10d(tmp_path):
    env = _env(tmp_path, P3D_DRY_RUN="1", PYTHON="python3")
    out = subprocess.run(["bash", str(SCRIPT), *OVERRIDES], env=env, capture_output=True, text=True, check=True)
    argv = shlex.split(out.stdout)
    assert argv[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert argv[4:6] == ["bash", "-c"]
    assert argv[7] == str(REPO)
    assert argv[8:] == [
        "python3", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node017:29500", "--rdzv-id=4242", "--max-restarts=0", "-m", "parallel3d.train",
        *OVERRIDES,
    ]


def test_launch_runs_in_the_repo_with_the_env_file_and_overrides_intact(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("export MARKER=from-env-file\n")
    env = _env(tmp_path, PYTHON=str(tmp_path / "bin" / "fakepython"), P3D_ENV_FILE=str(env_file),
               MASTER_PORT="31000")
    out = subprocess.run(["bash", str(SCRIPT), *OVERRIDES], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    lines = out.stdout.splitlines()
    assert lines[0] == f"cwd={REPO}"
    assert lines[1] == "env=from-env-file"
    args = [line[4:] for line in lines[2:]]
    assert "--rdzv-endpoint=node017:31000" in args
    assert args[-len(OVERRIDES):] == OVERRIDES


def test_missing_allocation_fails_with_a_message(tmp_path):
    env = _env(tmp_path)
    del env["SLURM_JOB_NODELIST"]
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "SLURM_JOB_NODELIST" in out.stderr


def test_no_nccl_setting_is_hard_coded():
    code = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not any("NCCL_" in line for line in code)


def test_a_run_stopped_by_a_signal_is_requeued(tmp_path):
    """The ranks exit 3 after their preemption checkpoint and rank 0 leaves $P3D_REQUEUE_FILE:
    the script requeues the job; a run that failed (no marker) is not requeued."""
    script = SCRIPT.read_text()
    assert "#SBATCH --signal=USR1@" in script and "#SBATCH --requeue" in script
    for stopped in (True, False):
        body = 'echo "42 received SIGUSR1" > "$P3D_REQUEUE_FILE"; exit 3' if stopped else "exit 1"
        stub = tmp_path / f"stub_{stopped}"
        stub.write_text(f"#!/usr/bin/env bash\n{body}\n")
        stub.chmod(0o755)
        requeued = tmp_path / f"requeued_{stopped}"
        (tmp_path / str(stopped)).mkdir()
        env = _env(tmp_path / str(stopped), PYTHON=str(stub), REQUEUED=str(requeued),
                   P3D_REQUEUE_FILE=str(tmp_path / f"marker_{stopped}"))
        proc = subprocess.run(["bash", str(SCRIPT), *OVERRIDES], env=env, capture_output=True, text=True)
        if stopped:
            assert proc.returncode == 0 and requeued.read_text().strip() == "4242", proc.stderr
            assert "requeueing job 4242" in proc.stderr and not (tmp_path / "marker_True").exists()
        else:
            assert proc.returncode == 1 and not requeued.exists()

"""Helpers of the fault tests: the real CLI as subprocesses, signals by PID, losses from metrics.jsonl, and a CLI
command trained in-process on harness ranks (``train_like_the_cli``: an uninterrupted reference, or a resume whose
launcher is not under test)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32", "optimizer.warmup_steps=1",
        "logging.log_every=1", "train.eval_iters=0", "train.device=cpu", "train.seed=7"]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE", "P3D_FAULT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def train_cmd(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "parallel3d.train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "parallel3d.train", *args]


def run_to_end(args: list[str], nproc: int = 1, timeout: float = 400, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(args, nproc), cwd=REPO, env=cli_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _as_from_a_terminal() -> None:
    """SIGINT at its default in the child, as a job started from a terminal has it. Why: a suite started in
    the background by a non-interactive shell (``pytest ... &``, nohup) inherits SIGINT ignored, every child
    too (POSIX keeps SIG_IGN across exec, and Python then installs no KeyboardInterrupt handler), so Ctrl-C
    tests would see the signal dropped and the run train on to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A training command running in the background, read line by line (stdout and stderr merged)."""

    def __init__(self, args: list[str], nproc: int = 1, **env: str) -> None:
        self.proc = subprocess.Popen(train_cmd(args, nproc), cwd=REPO, env=cli_env(**env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=_as_from_a_terminal)
        self.lines: list[str] = []

    def wait_for(self, pattern: str, timeout: float = 300) -> str:
        """Read until a line matches ``pattern``; returns it."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if rx.search(line):
                return line
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout: float = 120) -> tuple[int, float]:
        """Wait for the exit: ``(status, seconds it took)``; the rest of the output is in ``lines``."""
        t0 = time.monotonic()
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines += out.splitlines()
        return self.proc.returncode, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.communicate()


def _cli_rank(rank: int, world: int, overrides: list[str]) -> tuple[int, int]:
    """One rank of ``torchrun -m parallel3d.train *overrides``: the job the CLI composes, the CLI's thread
    settings (``train._configure_threads``, restored after: harness workers are reused), the CLI's calls.
    Returns the step it started after (a resume's checkpoint step, else 0) and the last step it trained."""
    import torch

    from parallel3d.config import resolve
    from parallel3d.rank_build import make_parallel_state
    from parallel3d.train import _configure_threads, compose_job
    from parallel3d.trainer import train

    job, plain = compose_job(overrides)
    rj = resolve(job, world)
    threads = torch.get_num_threads()
    _configure_threads(rj.device)
    try:
        result = train(rj, make_parallel_state(rj), full_config=plain)
    finally:
        torch.set_num_threads(threads)
    return result.start_step, result.last_step


def train_like_the_cli(overrides: list[str], world: int, timeout: float = 300) -> list[tuple[int, int]]:
    """Train what ``overrides`` asks for on ``world`` harness ranks (forks of a torch-preloaded server), writing
    ``train.out_dir`` as the CLI would (``train.resume=auto`` resumes from its newest checkpoint): the reference of
    a test whose CLI run is interrupted, or the resume that ends it, where the launcher is not what is tested and a
    launch would cost start-up (torchrun + a torch import per rank). Per rank: ``(start_step, last_step)``."""
    from tests.harness import run_on_ranks

    return run_on_ranks(_cli_rank, world, list(overrides), timeout=timeout)


def losses_of(out_dir: str) -> dict[int, float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


def worker_pids(launcher_pid: int) -> list[int]:
    """PIDs of the children of ``launcher_pid`` (torchrun's rank processes), from /proc."""
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid:
            kids.append(int(name))
    return sorted(kids)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

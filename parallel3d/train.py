"""``python -m parallel3d.train [key=value ...]``: the Hydra application (one process per rank).

Launch: plain ``python`` for one process, ``torchrun --nproc-per-node N -m parallel3d.train ...``
for several (multi-node: torchrun / SLURM rendezvous). Config: ``conf/config.yaml`` composed
against ``parallel3d.config.JobConfig``.

Order of events on every rank, so a bad value never hangs a job:
1. compose every job the command line asks for (``parallel3d.command_line``: any flags,
   ``--config-dir``/``--config-name``/``hydra.searchpath``, each job of a ``-m`` sweep)
   and ``resolve`` it (types, ranges, batch arithmetic, layout against ``WORLD_SIZE``, then
   ``preflight``: directories, checkpoints, data files, CUDA);
   a problem prints ONE line (rank 0) and every rank exits with status 2, before any
   process group exists;
2. global rank 0 locks each job's ``train.out_dir`` (``parallel3d.run_lock``: a directory a running job
   holds is one ``ConfigError``), then runs the ``@hydra.main`` app with ``hydra.run.dir = train.out_dir`` (the same on every
   rank); ranks other than 0 pass ``hydra.output_subdir=null`` so only rank 0 writes
   ``.hydra/``; Hydra never changes the working directory;
3. train; an exception on a rank prints ``[rank R] failed: <cause>`` and exits 1 (a ``ConfigError`` only the rank
   can find, the built-in corpus short of a global batch at its first tokenization, is step 1's line and exit 2)
   (torchrun then stops the job; collectives time out after ``train.timeout_s``, and the
   line then names the ranks whose heartbeat stopped: ``parallel3d.heartbeat``); the line is
   also torchrun's cause of that rank's failure (its error file), so the launcher's summary
   names it instead of a pointer to torchrun's docs. A diverged run (``parallel3d.divergence``)
   is not a hang: no heartbeat diagnosis, and under torchrun the ranks other than the logging
   rank leave it the last word (they wait for torchrun to stop them, as for a config error, and
   print nothing);
4. a run stopped early by ``train.preempt_signal`` or ``train.max_minutes`` has saved a
   checkpoint and exits with status 3 (``preemption.EXIT_STOPPED``); rank 0 also creates the
   file named by ``$P3D_REQUEUE_FILE``, if set, so a batch script knows to requeue the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from parallel3d import command_line, run_lock
from parallel3d.user_warnings import one_line_warnings
from parallel3d.command_line import to_job
from parallel3d.config import ConfigError, JobConfig, register_schema, resolve
from parallel3d.faults import inject
from parallel3d.sweep_status import EXIT_FAILED, SWEEP_STATUS_TARGET

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 128 + 2  # the shell's status for a process ended by SIGINT (Ctrl-C)
CONFIG_EXIT_DELAY_S = 5.0

register_schema()


def _rank() -> int:
    """This process's rank; 0 for a RANK that is not a rank of WORLD_SIZE (``config.world_size_from_env``
    reports it, and rank 0 prints the report)."""
    rank, world = os.environ.get("RANK", "0").strip(), os.environ.get("WORLD_SIZE", "1").strip()
    return int(rank) if rank.isdigit() and world.isdigit() and int(rank) < int(world) else 0


def _config_exit(exc: ConfigError) -> None:
    """Rank 0 prints the one line and exits 2 at once; every other rank exits 2 too. Under torchrun (which
    stops the job at the first rank that exits) the other ranks wait a moment, exiting 2 on torchrun's SIGTERM,
    so rank 0 is not killed before it prints. Rank 0 does not wait: its exit, once the line is out, is what
    ends the job (when every rank waited, each config error under torchrun took ``CONFIG_EXIT_DELAY_S`` longer)."""
    if _rank() == 0:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    _await_launcher_stop(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _await_launcher_stop(status: int) -> None:
    """Under torchrun with several ranks: wait up to ``CONFIG_EXIT_DELAY_S`` for torchrun's SIGTERM
    (sent once another rank has exited), exiting ``status`` on it without a word."""
    if _under_torchrun():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
        time.sleep(CONFIG_EXIT_DELAY_S)


def compose_job(overrides: list[str]) -> tuple[JobConfig, dict[str, Any]]:
    """The typed job and its resolved plain dict for ``overrides`` (raises ConfigError)."""
    cmd = command_line.parse(list(overrides), CONF_DIR)
    if cmd is None:
        raise ConfigError(f"cannot read the command line {overrides}")
    return to_job(command_line.compose(cmd, command_line.expand_jobs(cmd).jobs[0]))


def _configure_threads(device: str) -> None:
    """One process per core share: oversubscribed CPU ranks are 9-17x slower (ENVIRONMENT.md)."""
    import torch

    if device == "cpu":
        torch.set_flush_denormal(True)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def hydra_app(cfg: DictConfig) -> int | None:
    """The Hydra entry: validate again (cheap), then train this rank. A failed job of a one-process sweep
    returns ``EXIT_FAILED`` so the sweep goes on (``parallel3d.sweep_status``); any other failure ends the process."""
    rank = _rank()
    try:
        job, plain = to_job(cfg)
        _multirun_job_dir(job, plain)
        rj = resolve(job)
    except ConfigError as exc:
        _config_exit(exc)
    from parallel3d.divergence import TrainingDiverged
    from parallel3d.rank_build import make_parallel_state
    from parallel3d.trainer import train

    _configure_threads(rj.device)
    try:
        pstate = make_parallel_state(rj)
        result = train(rj, pstate, full_config=plain)
    except ConfigError as exc:  # found only on the rank (the built-in corpus, tokenized at first use): as before it
        _config_exit(exc)
    except Exception as exc:  # noqa: BLE001 - one clear line, non-zero exit, torchrun ends the job
        _report_failure(rank, exc, rj, pstate if isinstance(exc, TrainingDiverged) else None)
        if os.environ.get("PARALLEL3D_TRACEBACK") == "1":
            raise
        if rj.world_size == 1 and _in_sweep():  # no peer waits on this process: on to the next job
            _end_failed_job()
            return EXIT_FAILED
        os._exit(EXIT_FAILED)  # peers may be blocked in a collective: do not wait for teardown
    except KeyboardInterrupt:  # the trainer has already let a save in flight finish
        _interrupted(rank, rj.job.train.out_dir)
        os._exit(EXIT_INTERRUPTED)
    import torch.distributed as dist

    if dist.is_initialized():
        pstate.destroy()
        dist.destroy_process_group()
    if result.stopped is not None:
        from parallel3d.preemption import EXIT_STOPPED

        marker = os.environ.get("P3D_REQUEUE_FILE")
        if rank == 0 and marker:
            with open(marker, "w") as fh:
                fh.write(f"{result.last_step} {result.stopped}\n")
        sys.exit(EXIT_STOPPED)


def _in_sweep() -> bool:
    """A ``-m`` sweep whose config registers ``SweepStatus``: only that callback reports a failed job at the
    sweep's end, so a user's own config without it keeps the old rule (the failure ends the sweep, exit 1)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    return hydra_cfg.mode == RunMode.MULTIRUN and any(
        callback.get("_target_") == SWEEP_STATUS_TARGET for callback in (hydra_cfg.callbacks or {}).values())


def _end_failed_job() -> None:
    """What a failed one-process job leaves to the sweep's next job: its process group (the next job makes its
    own) and its W&B run, which the next job's ``wandb.init`` would hand back to it (wandb's ``reinit`` default
    outside notebooks), logging that job into this one's run: finished here, marked failed."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    wandb = sys.modules.get("wandb")  # imported only where the job logs to W&B
    if wandb is not None and wandb.run is not None:
        try:
            wandb.finish(exit_code=EXIT_FAILED)
        except Exception as exc:  # noqa: BLE001 - W&B must never stop the sweep (metrics.WandbSink's rule)
            print(f"W&B: the failed job's run did not finish: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _interrupted(rank: int, out_dir: str) -> None:
    """One line for Ctrl-C (SIGINT not in ``train.preempt_signal``) instead of a traceback per rank."""
    if os.environ.get("PARALLEL3D_TRACEBACK") == "1":
        import traceback

        traceback.print_exc()
    print(f"[rank {rank}] interrupted (SIGINT, Ctrl-C): stopped at once without a save; the checkpoints in "
          f"{os.path.join(out_dir, 'checkpoints')} are kept and train.resume=auto continues from the newest "
          f"(train.preempt_signal=[SIGTERM,SIGUSR1,SIGINT] makes Ctrl-C save and stop)", file=sys.stderr, flush=True)


def _report_failure(rank: int, exc: BaseException, rj: Any, diverged_state: Any = None) -> None:
    """Print this rank's failure line and hand it to torchrun (module doc, step 3). ``diverged_state`` (the
    ``ParallelState``, given for a ``TrainingDiverged``, which every rank raises at the same step): the ranks meet
    once the logging rank has printed its line (``divergence.exit_together``), so no launcher stops the job
    before the line that says why is out, however slowly that rank prints."""
    from parallel3d.divergence import exit_together

    diverged = diverged_state is not None
    if diverged and not exc.says_why and _under_torchrun():
        exit_together(diverged_state)
        # The logging rank's stop line is the one to read: the last line, and torchrun's root cause (its
        # first failure). Silent even after the wait: a SIGTERM that came while the trainer's preemption
        # handler held the signal (it only notes it) was not lost, just answered late.
        _await_launcher_stop(EXIT_FAILED)
        os._exit(EXIT_FAILED)
    line = _failure_line(rank, exc, rj, diagnose=not diverged)
    inject("train.failure_line", rank)  # tests: a rank slow to report (``faults``)
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the format torchrun's summary reads (torch.distributed.elastic.multiprocessing.errors)
        try:
            with open(error_file, "w") as fh:
                json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, fh)
        except OSError:
            pass  # the summary then shows torchrun's pointer to its docs: the line above was printed
    if diverged:
        exit_together(diverged_state)


def _failure_line(rank: int, exc: BaseException, rj: Any, diagnose: bool = True) -> str:
    """``[rank R] failed: <type>: <first line>``, plus (``diagnose``) the ranks whose heartbeat stopped, if any."""
    cause = (str(exc).strip().splitlines() or [""])[0]
    line = f"[rank {rank}] failed: {type(exc).__name__}: {cause}"
    if diagnose and rj.world_size > 1:
        from parallel3d.heartbeat import diagnose_failure

        found = diagnose_failure(rj.job.train.out_dir, rj.world_size, rank)
        if found:
            line += f"; {found}"
    return line


def _multirun_job_dir(job: JobConfig, plain: dict[str, Any]) -> None:
    """In a multirun, the job's run directory is the one Hydra made for it (``command_line`` doc)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    out_dir = hc.runtime.output_dir
    job.train.out_dir = plain["train"]["out_dir"] = out_dir
    if _rank() == 0:
        print(f"multirun job {hc.job.num}: {' '.join(hc.overrides.task)} -> train.out_dir={out_dir}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry (``parallel3d-train``, ``python -m parallel3d.train``, scripts/pretrain.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:  # every job the command line would run, whatever its flags (command_line doc)
        plan = command_line.check_command_line(args, CONF_DIR)
    except ConfigError as exc:
        _config_exit(exc)
    if plan is not None:
        args += plan.overrides
    if _rank() != 0:
        args.append("hydra.output_subdir=null")
    sys.argv = [sys.argv[0], *args]
    # Global rank 0 holds each job's run directory from before Hydra writes .hydra/ there to the end.
    locked = plan.out_dirs if plan is not None and plan.runs and _rank() == 0 else []
    with one_line_warnings(), contextlib.ExitStack() as held:
        try:
            held.enter_context(run_lock.holding(locked))
        except ConfigError as exc:
            _config_exit(exc)
        try:
            hydra_app()
        except KeyboardInterrupt:  # before training (composing, tokenizing the corpus): nothing to keep
            print(f"[rank {_rank()}] interrupted (SIGINT, Ctrl-C) before training", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()

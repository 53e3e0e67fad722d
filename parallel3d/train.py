"""``python -m parallel3d.train [key=value ...]``: the Hydra application (one process per rank).

Launch: plain ``python`` for one process, ``torchrun --nproc-per-node N -m parallel3d.train ...``
for several (multi-node: torchrun / SLURM rendezvous). Config: ``conf/config.yaml`` composed
against ``parallel3d.config.JobConfig``.

Order of events on every rank, so a bad value never hangs a job:
1. compose the config with Hydra's compose API and ``resolve`` it (types, ranges, batch
   arithmetic, layout against ``WORLD_SIZE``); a problem prints ONE line (rank 0) and
   every rank exits with status 2, before any process group exists;
2. run the ``@hydra.main`` app with ``hydra.run.dir = train.out_dir`` (the same on every
   rank); ranks other than 0 pass ``hydra.output_subdir=null`` so only rank 0 writes
   ``.hydra/``; Hydra never changes the working directory;
3. train; an exception on a rank prints ``[rank R] failed: <cause>`` and exits 1
   (torchrun then stops the job; collectives time out after ``train.timeout_s``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from parallel3d.config import (
    ConfigError,
    JobConfig,
    check_no_extra_keys,
    one_line_omegaconf_error,
    register_schema,
    resolve,
)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
EXIT_CONFIG, EXIT_FAILED = 2, 1
CONFIG_EXIT_DELAY_S = 5.0

register_schema()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span lines and chain causes; keep the one that names the key."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    keyed = [e for e in chain if getattr(e, "full_key", None)]
    return one_line_omegaconf_error(keyed[0] if keyed else exc) or type(exc).__name__


def _config_exit(exc: ConfigError) -> None:
    """Rank 0 prints the one line; the others exit a moment later, so torchrun (which
    stops the job at the first failed rank) does not kill rank 0 before it prints."""
    if _rank() == 0:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun
        time.sleep(CONFIG_EXIT_DELAY_S)
    sys.exit(EXIT_CONFIG)


def compose_job(overrides: list[str]) -> tuple[JobConfig, dict[str, Any]]:
    """The typed job and its resolved plain dict for ``overrides`` (raises ConfigError)."""
    from hydra import compose, initialize_config_dir

    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=job_overrides)
        return to_job(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - Hydra raises many types; all are config problems here
        raise ConfigError(_one_line(exc)) from None


def to_job(cfg: DictConfig) -> tuple[JobConfig, dict[str, Any]]:
    check_no_extra_keys(cfg)
    try:
        job = OmegaConf.to_object(cfg)
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(_one_line(exc)) from None
    return job, plain


def _configure_threads(device: str) -> None:
    """One process per core share: oversubscribed CPU ranks are 9-17x slower (ENVIRONMENT.md)."""
    import torch

    if device == "cpu":
        torch.set_flush_denormal(True)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def hydra_app(cfg: DictConfig) -> None:
    """The Hydra entry: validate again (cheap), then train this rank."""
    rank = _rank()
    try:
        job, plain = to_job(cfg)
        rj = resolve(job)
    except ConfigError as exc:
        _config_exit(exc)
    from parallel3d.trainer import make_parallel_state, train

    _configure_threads(rj.device)
    try:
        pstate = make_parallel_state(rj)
        train(rj, pstate, full_config=plain)
    except Exception as exc:  # noqa: BLE001 - one clear line, non-zero exit, torchrun ends the job
        print(f"[rank {rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("PARALLEL3D_TRACEBACK") == "1":
            raise
        os._exit(EXIT_FAILED)  # peers may be blocked in a collective: do not wait for teardown
    import torch.distributed as dist

    if dist.is_initialized():
        pstate.destroy()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Console entry (``parallel3d-train``, ``python -m parallel3d.train``, scripts/pretrain.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("-") for a in args):  # --help, --cfg ... go straight to Hydra
        try:
            resolve(compose_job(args)[0])
        except ConfigError as exc:
            _config_exit(exc)
    if _rank() != 0:
        args.append("hydra.output_subdir=null")
    sys.argv = [sys.argv[0], *args]
    hydra_app()


if __name__ == "__main__":
    main()

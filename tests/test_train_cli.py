"""The real command line: torchrun + ``python -m parallel3d.train``, and bad values before any process group."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from parallel3d import train as entry
from parallel3d.config import ConfigError, TrainConfig
from parallel3d.wandb_reader import find_offline_runs, read_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.slow
def test_bad_value_exits_nonzero_on_every_rank_before_any_process_group():
    """Two "ranks" of an 8-rank job with no rendezvous at all: a config error must not try to connect."""
    cmd = [sys.executable, "-m", "parallel3d.train", "train.global_batch_size=12", "train.micro_batch_size=4"]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=_env(RANK=str(r), WORLD_SIZE="8", LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    (out0, err0), (out3, err3) = outs
    assert err0.strip().splitlines() == [
        "config error: train.global_batch_size=12 is not divisible by train.micro_batch_size*dp = 4*8 = 32; "
        "global_batch = micro_batch * grad_accum * dp needs an integer grad_accum"
    ]
    assert out0 == out3 == err3 == ""  # one line from rank 0, silence elsewhere, no traceback


@pytest.mark.slow
def test_torchrun_config_error_prints_one_line(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "parallel3d.train", "train.steps=3"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    ours = [line for line in text.splitlines() if line.startswith("config error:")]
    assert ours == ["config error: optimizer.warmup_steps=30: must be <= train.steps=3"]
    # Each rank exits 2 on its own, unless torchrun stopped it (SIGTERM, -15) after the first rank's 2.
    exits = [line.split(":")[1].split()[0] for line in text.splitlines() if line.strip().startswith("exitcode")]
    assert len(exits) == 2 and "2" in exits and set(exits) <= {"2", "-15"}, text[-3000:]
    # Rank 0's exit, once its line is out, is what ends the job: the launcher's root cause.
    root = text[text.index("Root Cause"):]
    assert "rank      : 0 " in root and "exitcode  : 2 " in root, root
    # The only traceback is torchrun's own failure report (ChildFailedError), none from a rank.
    assert "parallel3d" not in "".join(line for line in text.splitlines() if line.startswith("  File"))


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_rank_0_exits_once_its_line_is_out_and_the_others_await_the_stop(rank, monkeypatch, capsys):
    """In process, as a torchrun rank: rank 0 prints the config error and exits 2 without waiting (its exit ends
    the job); another rank prints nothing and waits for torchrun's SIGTERM, answering it with exit 2. Before
    session 46 rank 0 waited too, so every config error under torchrun took ``CONFIG_EXIT_DELAY_S`` longer."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "cli46")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    waited, handled = [], []
    monkeypatch.setattr(entry.time, "sleep", waited.append)
    monkeypatch.setattr(entry.signal, "signal", lambda signum, handler: handled.append(signum))
    with pytest.raises(SystemExit) as done:
        entry._config_exit(ConfigError("train.steps=0: must be an integer >= 1"))
    assert done.value.code == entry.EXIT_CONFIG
    err = capsys.readouterr().err
    if rank == 0:
        assert err.splitlines() == ["config error: train.steps=0: must be an integer >= 1"] and waited == [] == handled
    else:
        assert err == "" and waited == [entry.CONFIG_EXIT_DELAY_S] and handled == [signal.SIGTERM]


@pytest.mark.slow
def test_torchrun_two_processes_trains_logs_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "parallel3d.train",
        "parallel.pp=2", "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
        f"train.out_dir={out}", "logging.log_every=1", "logging.wandb.mode=offline",
        "optimizer.warmup_steps=1", f"data.cache_dir={tmp_path / 'cache'}",
    ]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_device", "mfu", "mem_peak_bytes_max",
                "mem_peak_bytes_min", "bubble_fraction", "comm_bytes", "loss_scale", "samples_per_sec", "step_time"):
        assert key in records[0], key
    assert records[0]["mem_peak_bytes_max"] >= records[0]["mem_peak_bytes_min"] > 0
    assert records[0]["comm_bytes"] > 0  # pipeline sends between the two stages
    assert all(0 <= r["bubble_fraction"] < 1 for r in records)  # a pipeline: a bubble is measured
    # A user warning is one line: no framework path, line number, category or source line.
    assert ("warning: no peak TFLOP/s known for device 'cpu' (fp32): MFU is not reported (set train.peak_tflops "
            "to enable it)") in proc.stderr.splitlines()
    assert "RunWarning" not in proc.stderr and "user_warnings.warn(" not in proc.stderr
    # One console line per logged step, from the logging rank only.
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 3
    # Hydra's files: one .hydra/ in the shared run dir, no outputs/ dirs, cwd unchanged.
    assert (out / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000003"]
    # W&B offline: one run, the logged keys read back from its .wandb file.
    runs = find_offline_runs(str(out))
    assert len(runs) == 1
    run = read_run(runs[0], wait_s=60)
    assert run["complete"], "the offline run has no exit record"
    losses = [r["train/loss"] for r in run["history"] if "train/loss" in r]
    assert losses == pytest.approx([r["loss"] for r in records])
    assert run["config"]["parallel"]["pp"] == 2 and run["config"]["train"]["steps"] == 3


@pytest.mark.slow
def test_a_failing_rank_prints_its_cause_and_exits_nonzero(tmp_path):
    # A fault only the rank can find (it reads the index; preflight checks that the files exist). A
    # data.cache_dir under a file, used here before, is now refused up front (tests/test_bad_inputs.py).
    (tmp_path / "not_an_index.bin").write_bytes(b"tokens")
    (tmp_path / "not_an_index.idx").write_bytes(b"not an index")
    cmd = [sys.executable, "-m", "parallel3d.train", f"train.out_dir={tmp_path / 'run'}", "data=indexed",
           f"data.paths=[{tmp_path / 'not_an_index'}]"]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    failed = [line for line in proc.stderr.splitlines() if line.startswith("[rank 0] failed:")]
    assert len(failed) == 1 and "not_an_index.idx" in failed[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ---- flags, search path, multirun (issue 15) --------------------------------------------------------


def _train(args: list[str], cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.train", *args], cwd=str(cwd), env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--cfg", "job"], ["-m"],
                                   *(pytest.param(f, marks=pytest.mark.extended)  # the same code path
                                     for f in (["--config-name", "config"], ["--help"], ["--cfg", "all", "--resolve"]))])
def test_an_unknown_key_is_one_line_and_exit_2_whatever_the_flags(tmp_path, flags):
    proc = _train([*flags, "train.no_such_key=1"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    accepted = ", ".join(f.name for f in dataclasses.fields(TrainConfig))  # the schema, in its order
    assert proc.stderr.strip().splitlines() == [f"config error: train.no_such_key: unknown key; train accepts: {accepted}"]


@pytest.fixture
def extra_confs(tmp_path):
    """A config directory of a user: a model option and a primary config built on ours."""
    d = tmp_path / "my_confs"
    (d / "model").mkdir(parents=True)
    tiny = open(os.path.join(REPO, "conf", "model", "gpt_tiny.yaml")).read()
    (d / "model" / "my_tiny.yaml").write_text(
        tiny.replace("name: gpt_tiny", "name: my_tiny").replace("num_layers: 4", "num_layers: 3"))
    (d / "my_exp.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 70\n  eval_every: 0\n")
    (d / "my_bad_exp.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 0\n")
    return d


def _print_job_in_process(args: list[str], tmp_path, monkeypatch, capsys) -> str:
    """What ``python -m parallel3d.train --cfg job *args`` prints, from the CLI's entry function in this process:
    its check of the command line, then Hydra's own ``--cfg job`` (the composed job, printed; nothing runs)."""
    monkeypatch.setattr(sys, "argv", ["parallel3d.train"])  # main() sets sys.argv for Hydra: restored afterwards
    monkeypatch.chdir(tmp_path)  # where the process ran: relative paths of the default job resolve there
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    entry.main(["--cfg", "job", *args])
    out, err = capsys.readouterr()
    assert err == "", err[-2000:]
    return out


@pytest.mark.slow
def test_searchpath_config_dir_and_config_name_are_honoured(tmp_path, extra_confs, monkeypatch, capsys):
    """The three composed jobs are printed by the entry function in this process (the same check and Hydra
    composition a process runs: a launch would add only its start-up); the two refusals are real processes
    (exit 2, one line)."""
    assert "num_layers: 4" in open(os.path.join(REPO, "conf", "model", "gpt_tiny.yaml")).read()
    for args in ([f"hydra.searchpath=[file://{extra_confs}]", "model=my_tiny"],
                 ["--config-dir", str(extra_confs), "model=my_tiny"]):
        out = _print_job_in_process(args, tmp_path, monkeypatch, capsys)
        assert "name: my_tiny" in out and "num_layers: 3" in out
    out = _print_job_in_process(["--config-dir", str(extra_confs), "--config-name", "my_exp"], tmp_path,
                                monkeypatch, capsys)
    assert "steps: 70" in out
    # The pre-check composes the same config Hydra would: a bad value there is one line too.
    proc = _train(["--config-dir", str(extra_confs), "--config-name", "my_bad_exp"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: train.steps=0: must be an integer >= 1"]
    # Without the search path the option does not exist: one line, exit 2.
    proc = _train(["model=my_tiny"], tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("config error:") and "my_tiny" in proc.stderr


TINY_RUN = ["train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
            "optimizer.warmup_steps=1", "logging.log_every=1", "train.eval_iters=1"]


@pytest.mark.slow
def test_multirun_gives_each_job_its_own_run_directory(tmp_path):
    out = tmp_path / "sweep"
    proc = _train(["-m", "parallel.zero_stage=0,1", *TINY_RUN, f"train.out_dir={out}",
                   f"data.cache_dir={tmp_path / 'cache'}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for job in ("0", "1"):
        records = [json.loads(line) for line in open(out / job / "metrics.jsonl")]
        assert [r["step"] for r in records] == [1, 2], job  # trained, not "resumed with nothing to do"
        assert records[-1]["eval_loss"] > 0
        assert sorted(os.listdir(out / job / "checkpoints")) == ["step_00000002"]
        overrides = open(out / job / ".hydra" / "overrides.yaml").read()
        assert f"parallel.zero_stage={job}" in overrides
        runs[job] = records
    # ZeRO stage does not change the numbers; both jobs ran the whole schedule.
    assert [r["loss"] for r in runs["0"]] == pytest.approx([r["loss"] for r in runs["1"]], rel=1e-5)
    assert proc.stdout.count("run summary:") == 2 and "nothing to do" not in proc.stdout
    assert f"train.out_dir={out / '1'}" in proc.stdout


@pytest.mark.slow
def test_multirun_jobs_sharing_a_run_directory_are_refused(tmp_path):
    shared = tmp_path / "shared"
    proc = _train(["-m", f"train.out_dir={shared},{shared}", "parallel.zero_stage=1", *TINY_RUN], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: train.out_dir={shared}: multirun jobs 0 and 1")
    assert not shared.exists()


@pytest.mark.parametrize("sweep,jobs", [([], 1), (["-m", "parallel.zero_stage=0,1"], 2)])
def test_the_command_line_is_parsed_once_and_each_job_once(sweep, jobs, tmp_path, monkeypatch):
    """``check_command_line`` hands Hydra's parsed overrides along: the command line's overrides are read
    once (not again to expand the sweep or to check hydra.run.dir), each job's once (for both of its checks)."""
    from parallel3d import command_line
    from parallel3d.train import CONF_DIR

    real, calls = command_line._parse_overrides, []
    monkeypatch.setattr(command_line, "_parse_overrides", lambda o: calls.append(list(o)) or real(o))
    args = [*sweep, "model.num_layers=2", "parallel.zero_stage=1", f"train.out_dir={tmp_path}/run"]
    plan = command_line.check_command_line(args, CONF_DIR)
    assert calls[0] == [a for a in args if a != "-m"]  # the command line's overrides, first
    assert len(calls) == 1 + jobs, calls
    assert len(plan.jobs) == len(plan.out_dirs) == jobs

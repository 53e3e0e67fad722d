"""Fault fuzz: a seeded draw of a layout and of ONE failing rank (which, when, how), run through torchrun.

``draw_case(case_id)`` draws, from an RNG keyed by the id alone (a case is reproduced by its id):
- a layout of world 2..``MAX_WORLD``: tp, pp (1f1b, gpipe, interleaved, zb_h1, zbv), dp with any ZeRO stage,
  cp, and on an MoE tiny model ep; a draw is kept only if ``config.resolve`` accepts it (the one validator);
- the failing rank by role: the first, the last, a middle pipeline stage (pp >= 3), a tp peer (tp > 1);
- the step (1 or later) and the point (``tests/fault_inject.POINTS``, those the layout reaches) and how
  (``tests/fault_inject.HOWS``).

``run_case`` runs the layout uninterrupted (the reference, trained in-process on harness ranks as the CLI would:
``fault_runs.train_like_the_cli``; the reference is not under test), then through torchrun with the fault
(``tests/fault_inject`` wraps the framework's own function on that rank inside the launched process), then resumes
the damaged run to the end, in-process the same way (what is tested is the checkpoint it starts from and the
losses, not the launcher: a resume through torchrun is ``tests/test_faults_preemption.py``'s), and returns an
``Outcome``; ``Outcome.problems()`` lists every broken promise of principle 4:
- the job ends within ``bound_s`` of the fault (collective timeout(s) + torchrun's grace + ``MARGIN_S``);
- it exits non-zero (a failed checkpoint save is the documented exception: a warning naming the rank,
  training goes on, exit 0);
- the first ``[rank R] failed:`` line names the failing rank and the cause: ``[rank F] failed: InjectedFault``
  for an exception, else a ``hung or dead:`` clause naming rank F (``parallel3d.heartbeat``);
- no process of the launch is left;
- every complete checkpoint is loadable and intact (sizes and CRC-32), and resuming from the newest one
  reproduces the uninterrupted run's losses bit for bit (``metrics.jsonl``);
- a fault in step k >= 2 that leaves the faulty rank's writer thread alive (an exception, a hang; not in the
  save itself) does not lose step k-1's checkpoint, which may still be in flight (``train.async_save``).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from parallel3d import config as cfg
from parallel3d.checkpoint import complete_checkpoints, is_loadable, read_meta
from parallel3d.checkpoint_verify import damage
from parallel3d.config import ConfigError, resolve
from parallel3d.train import compose_job
from tests.fault_inject import ENV, HOWS, POINTS
from tests.fault_runs import REPO, cli_env, losses_of, train_like_the_cli

FUZZ_SEED = 20261207
MAX_WORLD = 6
STEPS = 3
TIMEOUT_S = 10  # train.timeout_s of every run
TORCHRUN_GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL wait for ranks that do not exit
MARGIN_S = 25  # start-up of a rank's failure path, exit and reaping on a loaded 2-core machine
RUN_LIMIT_S = 600  # a run that takes longer than this is killed and reported as a hang
REAP_WAIT_S = 0.5  # how long a launch's processes may take to be reaped after the launcher exits
MODELS = {"dense": "gpt_tiny", "moe": ("mixtral_tiny", "deepseek_tiny")}
BASE = ["train.seq_len=32", "optimizer.warmup_steps=1", "logging.log_every=1", "train.device=cpu", "train.seed=7",
        f"train.steps={STEPS}", "train.save_every=1", "train.keep_last=3", "train.eval_every=1", "train.eval_iters=1",
        f"train.timeout_s={TIMEOUT_S}"]


@dataclass(frozen=True)
class FaultCase:
    case_id: int
    model: str
    layout: dict[str, Any]  # parallel.* overrides
    micro_batch_size: int
    global_batch_size: int
    world: int
    rank: int
    role: str
    step: int
    point: str
    how: str

    @property
    def name(self) -> str:
        lay = "-".join(f"{k}{v}" for k, v in self.layout.items() if k not in ("schedule", "virtual_stages"))
        sched = self.layout.get("schedule", "")
        return (f"fuzz{self.case_id}-{self.model}-{lay}{'-' + sched if sched else ''}-rank{self.rank}({self.role})"
                f"-step{self.step}-{self.point}-{self.how}")

    def overrides(self, out_dir: str, cache_dir: str) -> list[str]:
        return [f"model={self.model}", *BASE, f"train.micro_batch_size={self.micro_batch_size}",
                f"train.global_batch_size={self.global_batch_size}", f"train.out_dir={out_dir}",
                f"data.cache_dir={cache_dir}", *(f"parallel.{k}={v}" for k, v in self.layout.items())]

    @property
    def bound_s(self) -> float:
        """Fault -> launcher gone. A hang costs a collective timeout, and the survivors' wait for their save in
        flight (``CheckpointWriter.settle``) one more; a hung checkpoint writer up to three (its save's, the next
        save's, then the step's) before the training thread is stuck too."""
        hung = self.how in ("hang", "sigstop")
        timeouts = (3 if self.point == "save" else 2) if hung else 1
        return timeouts * TIMEOUT_S + TORCHRUN_GRACE_S + MARGIN_S


def _resolved(model: str, layout: dict, mbs: int, gbs: int, world: int):
    case = FaultCase(0, model, layout, mbs, gbs, world, 0, "", 1, "data", "exception")
    job, _ = compose_job(case.overrides("unused-out", "unused-cache"))
    return resolve(job, world)


def _draw_layout(rng: random.Random) -> tuple[str, dict[str, Any], int, int, int]:
    moe = rng.random() < 0.3
    model = rng.choice(MODELS["moe"]) if moe else MODELS["dense"]
    tp, pp, cp = rng.choice((1, 1, 2)), rng.choice((1, 2, 2, 3)), rng.choice((1, 1, 2))
    dp = rng.choice([d for d in (1, 2, 3) if 2 <= tp * pp * cp * d <= MAX_WORLD] or [1])
    layout: dict[str, Any] = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "zero_stage": rng.choice(cfg.ZERO_STAGES)}
    if pp > 1:
        layout["schedule"] = rng.choice(cfg.SCHEDULES)
        layout["virtual_stages"] = 2 if layout["schedule"] in ("interleaved_1f1b", "zbv") else 1
    if moe:
        layout["ep"] = rng.choice((1, 2, 2))
    mbs = rng.choice((1, 2))
    gbs = mbs * dp * rng.choice((1, 2, max(pp, 1)))
    return model, layout, mbs, gbs, tp * pp * cp * dp


def _roles(rj: Any, world: int) -> dict[str, int]:
    topo = rj.topology
    roles = {"first": 0, "last": world - 1}
    middle = [r for r in range(world) if 0 < topo.coord("pp", r) < topo.size("pp") - 1]
    if middle:
        roles["middle stage"] = middle[0]
    peers = [r for r in range(world) if topo.coord("tp", r) > 0]
    if peers:
        roles["tp peer"] = peers[-1]
    return roles


def reachable_points(rj: Any) -> list[str]:
    """The points this layout's step passes through on every rank (``tests/fault_inject`` doc)."""
    p, topo = rj.job.parallel, rj.topology
    points = ["data", "forward", "backward", "optimizer", "save", "eval"]
    if p.pp > 1:
        points.append("p2p")
    if topo.size("dp") > 1 and p.zero_stage >= 2:
        points.append("reduce_scatter")
    if topo.size("dp") > 1 and p.zero_stage >= 1:
        points.append("all_gather")
    return [q for q in POINTS if q in points]


def draw_case(case_id: int) -> FaultCase:
    rng = random.Random(f"{FUZZ_SEED}:{case_id}")
    for _ in range(200):
        model, layout, mbs, gbs, world = _draw_layout(rng)
        if not 2 <= world <= MAX_WORLD:
            continue
        try:
            rj = _resolved(model, layout, mbs, gbs, world)
        except ConfigError:
            continue
        role, rank = rng.choice(sorted(_roles(rj, world).items()))
        return FaultCase(case_id, model, layout, mbs, gbs, world, rank, role, rng.choice(range(1, STEPS)),
                         rng.choice(reachable_points(rj)), rng.choice(HOWS))
    raise RuntimeError(f"fault case {case_id}: no valid layout in 200 draws")


def _launch(case: FaultCase, overrides: list[str], fault: dict | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.world),
           "-m", "tests.fault_inject", *overrides]
    env = cli_env(**({ENV: json.dumps(fault)} if fault else {}))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid`` (the launch ran in a session of its own)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in "ZX":
                pids.append(int(name))
    return pids


def _run(case: FaultCase, overrides: list[str], fault: dict | None = None) -> tuple[int | None, str, float, list[int]]:
    """(exit status (None: killed after ``RUN_LIMIT_S``), output, when it ended, processes left) of one launch."""
    proc = _launch(case, overrides, fault)
    try:
        out, _ = proc.communicate(timeout=RUN_LIMIT_S)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        status = None
    ended = time.time()  # wall clock: the faulty rank stamps the fault with it
    reaped_by = time.monotonic() + REAP_WAIT_S
    left = _session_processes(proc.pid)
    while left and time.monotonic() < reaped_by:
        time.sleep(0.05)
        left = _session_processes(proc.pid)
    for pid in left:  # the test's own clean-up; reported as a problem below
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return status, out, ended, left


@dataclass
class Outcome:
    case: FaultCase
    status: int | None = None
    seconds_after_fault: float | None = None
    fired: bool = False
    failure_lines: list[str] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    resumed_from: int | None = None
    resume_identical: bool | None = None
    resume_steps: list[tuple[int, int]] = field(default_factory=list)  # per rank: the resume's (start, last) step
    output: str = ""

    def problems(self) -> list[str]:
        c, found = self.case, []
        if not self.fired:
            return [f"the fault never fired ({c.point} in step {c.step} on rank {c.rank})"]
        if self.status is None or self.seconds_after_fault is None or self.seconds_after_fault > c.bound_s:
            found.append(f"did not end within {c.bound_s:.0f}s of the fault ({self.seconds_after_fault})")
        save_exception = c.point == "save" and c.how == "exception"
        if save_exception:
            if self.status != 0:
                found.append(f"a failed save should warn and train on; exit status {self.status}")
            if not any(f"checkpoint at step {c.step} failed: rank {c.rank}: InjectedFault: injected" in line
                       for line in self.output.splitlines()):
                found.append("no warning naming the rank whose save failed")
        elif self.status == 0:
            found.append("exit status 0 after a failure")
        elif not self.failure_lines:
            found.append("no '[rank R] failed:' line")
        elif not names_failing_rank(self.failure_lines[0], c):
            found.append(f"the first failure line does not name rank {c.rank}: {self.failure_lines[0][:300]}")
        if self.left:
            found.append(f"processes left behind: {self.left}")
        if self.damaged:
            found.append(f"damaged checkpoints: {self.damaged}")
        if c.how in ("exception", "hang") and c.point != "save" and c.step >= 2 and c.step - 1 not in self.checkpoints:
            # step k-1's save may still be in flight at the fault; the faulty rank's writer thread lives on
            found.append(f"the checkpoint of step {c.step - 1} (in flight at the fault) was lost: {self.checkpoints}")
        if self.resume_identical is False:
            found.append(f"resuming from step {self.resumed_from} did not reproduce the uninterrupted losses (per "
                         f"rank, the (start, last) step the resume trained: {self.resume_steps})")
        return found


def names_failing_rank(line: str, case: FaultCase) -> bool:
    """Whether a failure line names the failing rank with its cause (module doc)."""
    if case.how == "exception":
        return line.startswith(f"[rank {case.rank}] failed: InjectedFault: injected at {case.point}") or \
            bool(re.search(rf"hung or dead: .*\brank {case.rank} \(", line))
    clause = line.split("hung or dead: ", 1)[1] if "hung or dead: " in line else ""
    named = re.findall(r"\brank (\d+) \(", clause.split("; last completed step")[0])
    return str(case.rank) in named


def first_case(where: Any, limit: int = 1000) -> FaultCase:
    """The drawn case of least id that ``where`` accepts (how CI picks its few cases from the draw)."""
    for case_id in range(limit):
        case = draw_case(case_id)
        if where(case):
            return case
    raise RuntimeError(f"no case among the first {limit} draws")


def run_case(case: FaultCase, work_dir: str, cache_dir: str, resume: bool = True) -> Outcome:
    """Reference, faulted run, resume (module doc); the outcome with everything ``problems`` checks.
    ``resume=False``: the faulted run alone (checkpoints still verified; no reference, no resume)."""
    ref_dir, out_dir = os.path.join(work_dir, "ref"), os.path.join(work_dir, "run")
    if resume:
        train_like_the_cli(case.overrides(ref_dir, cache_dir), case.world, timeout=RUN_LIMIT_S)
    marker = os.path.join(work_dir, "fired.json")
    fault = {"rank": case.rank, "step": case.step, "point": case.point, "how": case.how, "marker": marker}
    status, out, ended, left = _run(case, case.overrides(out_dir, cache_dir), fault)
    outcome = Outcome(case, status=status, left=left, output=out,
                      failure_lines=[line for line in out.splitlines() if re.match(r"\[rank \d+\] failed: ", line)])
    if os.path.exists(marker):
        outcome.fired = True
        with open(marker) as fh:
            fired_at = json.load(fh)["time"]
        outcome.seconds_after_fault = ended - fired_at if status is not None else None
    root = os.path.join(out_dir, "checkpoints")
    done = complete_checkpoints(root) if os.path.isdir(root) else []
    outcome.checkpoints = [s for s, _ in done]
    for _, path in done:
        try:
            meta = read_meta(path)
            problem = damage(path, meta, list(meta.get("files", []))) if is_loadable(path) else f"{path}: incomplete"
        except (OSError, ValueError) as exc:
            problem = f"{path}: {exc}"
        if problem:
            outcome.damaged.append(problem)
    if resume and not outcome.damaged:
        outcome.resumed_from = outcome.checkpoints[-1] if outcome.checkpoints else 0
        try:  # in-process: the launcher is not what is tested (module doc); a failure is reported, not raised
            outcome.resume_steps = train_like_the_cli(case.overrides(out_dir, cache_dir), case.world,
                                                      timeout=RUN_LIMIT_S)
        except Exception as exc:  # noqa: BLE001 - any failure of the resume is this case's outcome
            outcome.output += f"\n--- resume ---\n{type(exc).__name__}: {str(exc)[-3000:]}"
        # from the newest checkpoint, not from scratch (which gives the same losses) nor an older one
        outcome.resume_identical = (outcome.resume_steps == [(outcome.resumed_from, STEPS)] * case.world
                                    and losses_of(out_dir) == losses_of(ref_dir))
    return outcome



def main(argv: list[str] | None = None) -> None:
    """``python -m tests.fault_fuzz FIRST LAST [OUT.jsonl]``: run cases FIRST..LAST, one JSON line each."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("first", type=int)
    parser.add_argument("last", type=int)
    parser.add_argument("out", nargs="?", default=os.path.join(REPO, "bench_results", "fault_fuzz.jsonl"))
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fault_fuzz_") as tmp:
        cache = os.path.join(tmp, "cache")
        for case_id in range(args.first, args.last + 1):
            case = draw_case(case_id)
            t0 = time.time()
            outcome = run_case(case, tempfile.mkdtemp(dir=tmp), cache)
            problems = outcome.problems()
            row = {"case": case.name, "world": case.world, "status": outcome.status,
                   "seconds_after_fault": outcome.seconds_after_fault, "bound_s": case.bound_s,
                   "first_failure_line": (outcome.failure_lines or [None])[0], "checkpoints": outcome.checkpoints,
                   "resumed_from": outcome.resumed_from, "resume_identical": outcome.resume_identical,
                   "problems": problems, "case_seconds": round(time.time() - t0, 1),
                   "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if problems:
                row["output_tail"] = outcome.output[-4000:]
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"{case.name}: {'OK' if not problems else problems} ({row['case_seconds']}s)", flush=True)


if __name__ == "__main__":
    main()

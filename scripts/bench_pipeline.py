"""Side-by-side pipeline benchmark: our engine (1f1b, zb_h1, interleaved) vs torch.distributed.pipelining and DeepSpeed.

Same model (parallel3d's GPT from ``build_model``, the same partition and init for every
system), same batch and microbatch count, gloo on this machine's CPUs, one thread per rank.
Systems: ours ``1f1b`` (the baseline), ``zb_h1``, ``interleaved_1f1b`` (v chunks);
``torch.distributed.pipelining`` ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``; DeepSpeed
``PipelineModule`` + ``train_batch`` (its 1F1B), run by ``peer_deepspeed_pipeline.py`` under
its OWN virtual environment, ``.cache/peers/deepspeed-venv``, which this script creates on
first use (``DS_BUILD_OPS=0 pip install torch==2.13.0 deepspeed``; never a parallel3d
dependency; ``--no-install`` skips the peer instead, ``--peers torch`` leaves it out).

Timing: a step is the slowest rank's time after a barrier. Each round launches our
process group once (ours and torch's systems alternate step by step, the order rotating
every step) and DeepSpeed once (its own processes; the two launches alternate their order
from round to round), so background load hits every system alike. Per system it prints
min / median / max over all measured steps and the ratio of medians to our 1f1b and to the
fastest 1F1B peer, and for every system the CPU seconds a step costs all ranks (process
time, gloo threads included) with its paired ratio to our 1f1b: on a machine with fewer free
cores than ranks that, not wall time, compares the systems' work; for ours also
the measured bubble and ``simulate``'s fed with our measured costs, defined alike
(``bench_pipeline_bubble``: idle share of the schedule's window on the ranks' common clock,
executor time per computation in the feed; ``sim``: plus the message latency measured in the run,
from a send's post to its blocked receiver waking, the post's own cost left to the executor time
(``bench_pipeline_bubble.in_run_latencies``, the mean over the round; a message timed alone,
``bench_pipeline_messages.one_way_latency``, is printed and fed to ``sim_isolated``); ``sim0``: zero latency; ``sim cpu``: CPU-time costs, a core per
rank; ``sim C``: CPU-time costs on this machine's C cores shared by the ranks, what the measured
bubble (the share of the window a rank is not runnable) is held against where ranks outnumber
cores; where they do not but the computations' CPU / wall time shows they waited for a core
(other load), the measured bubble is not reported), and the issue's schedule
target: the simulated bubble of 1f1b vs zb_h1 at F = B = W. Then (``--small-mb-case``, on by
default) the overhead-bound case of issue 27: m = 16 microbatches of one sample each, our 1f1b
against torch.pipelining's Schedule1F1B only, same shapes, same alternation, its own table
with per-round ratios and the target (torch / ours >= 1, paired) marked met or not. Writes
JSON to ``--out`` (``small_mb_rows``, ``small_mb_targets`` for that case).

    .venv/bin/python scripts/bench_pipeline.py --stages 2 4 --rounds 3 --steps 3 --out bench_results/pipeline.json

On a shared or small machine (p > cores) ranks time-share, "busy" includes waiting for a
core, and numbers are noisy: compare ratios of the same run, never absolute times.
DeepSpeed's step also runs its optimizer step (SGD, tiny here) but no tied-embedding sum (its
stages are built without ``TiedLayerSpec``); ours and torch's run no optimizer step. Ours
sums the tied embedding's two gradient copies in its step (``grad_sync.finalize``); torch's step
is followed by the same code (a ``TiedGradFinalizer`` of its chunks), which a user of it needs for this GPT.

Modules: this one (the CLI, rounds and rows); ``bench_pipeline_group`` (the ranks of one
process group: ours and torch's systems alternating); ``bench_pipeline_bubble`` (measured and
simulated bubbles); ``bench_pipeline_report`` (ratios, the printed tables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench_pipeline_group import run_group  # noqa: E402
from bench_pipeline_bubble import rel_diffs, simulated_bubbles  # noqa: E402
from bench_pipeline_report import (_print_main, _print_small_mb, _simulated_unit_bubbles,  # noqa: E402
                                   _forward_ratios, _split_backward_ratio, _split_backward_ratios, _stats)
from peer_env import deepspeed_python, run_peer  # noqa: E402


def run_deepspeed(args, py: str, world: int) -> tuple[list[float], list[float]]:
    """DeepSpeed's step times and CPU seconds per step (all ranks), from its own launch."""
    cmd = [f"--{key}={getattr(args, key)}" for key in ("microbatches", "layers", "hidden", "seq", "mbs", "vocab",
                                                         "steps", "warmup")]
    got = run_peer(py, "peer_deepspeed_pipeline.py", [*cmd, f"--stages={world}"])
    return got["step_times_s"], got["cpu_times_s"]


def bench_stages(args, p: int, ds_py: str | None, case: str = "main", raw: dict | None = None) -> list[dict]:
    """Rounds alternate the process-group systems (ours, torch) and DeepSpeed (its own processes).
    ``raw``: where to keep the per-rank, per-round stats (key ``(case, p)``) for ``--raw``."""
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # process group systems: CPU seconds per step, summed over ranks
    per_round: list[dict[str, list[float]]] = []  # per round: system -> its step times in that round
    cpu_round: list[dict[str, list[float]]] = []  # the same in CPU seconds
    per_round_stats = []
    grad_diffs: list[float | None] = []  # per round: torch 1f1b's last-step gradients vs ours 1f1b's
    for r in range(args.rounds):
        order = ["group", "deepspeed"] if r % 2 == 0 else ["deepspeed", "group"]
        per_round.append({})
        cpu_round.append({})
        for what in order:
            if what == "group":
                got = run_group(args, p)
                for name, ts in got["times"].items():
                    times.setdefault(name, []).extend(ts)
                    per_round[-1][name] = ts
                for name, cs in got["cpu_times"].items():
                    cpu.setdefault(name, []).extend(cs)
                    cpu_round[-1][name] = cs
                per_round_stats.append(got["per_rank"])
                grad_diffs.append(got["grad_diff_vs_ours_1f1b"])
            elif ds_py is not None:
                ts, cs = run_deepspeed(args, ds_py, p)
                times.setdefault("deepspeed PipelineModule 1f1b", []).extend(ts)
                per_round[-1]["deepspeed PipelineModule 1f1b"] = ts
                cpu.setdefault("deepspeed PipelineModule 1f1b", []).extend(cs)
                cpu_round[-1]["deepspeed PipelineModule 1f1b"] = cs
        print(f"[bench] {case} pp={p} round {r + 1}/{args.rounds} done", flush=True)
    if raw is not None:
        raw[(case, p)] = per_round_stats
    base = statistics.median(times["ours 1f1b"])
    peers = [n for n in times if not n.startswith("ours") and "interleaved" not in n]
    fastest_peer = min((statistics.median(times[n]) for n in peers), default=None)
    rows = []
    for name, ts in times.items():
        row = {"stages": p, "microbatches": args.microbatches, "micro_batch_size": args.mbs, "case": case,
               "system": name, **_stats(ts),
               "vs_ours_1f1b": statistics.median(ts) / base,
               "vs_fastest_1f1b_peer": statistics.median(ts) / fastest_peer if fastest_peer else None,
               # Load on a shared machine drifts between launches: the ratio within each round, then
               # the median over rounds, compares systems under the same background load.
               "paired_vs_ours_1f1b": statistics.median(
                   statistics.median(rnd[name]) / statistics.median(rnd["ours 1f1b"])
                   for rnd in per_round if name in rnd),
               "round_medians_s": [statistics.median(rnd[name]) for rnd in per_round if name in rnd],
               "ours_1f1b_round_medians_s": [statistics.median(rnd["ours 1f1b"]) for rnd in per_round if name in rnd]}
        if name == "torch.pipelining 1f1b":
            row["grad_diff_vs_ours_1f1b"] = max(d for d in grad_diffs if d is not None)
        if name in cpu:
            # CPU seconds a step costs all ranks together: the executor's and the model's work, which
            # time-sharing (p > cores, other users) does not inflate as it does wall time.
            ratios = [statistics.median(rnd[name]) / statistics.median(rnd["ours 1f1b"])
                      for rnd in cpu_round if name in rnd]
            row.update(cpu_median_s=statistics.median(cpu[name]), cpu_steps_s=cpu[name],
                       paired_cpu_vs_ours_1f1b=statistics.median(ratios), cpu_round_ratios=ratios)
        if name.startswith("ours"):
            stats = per_round_stats[-1]
            msg_s = statistics.mean(x[2] for x in stats)
            cores = len(os.sched_getaffinity(0))
            rounds = [simulated_bubbles(rs, name, p, args.microbatches, statistics.mean(x[2] for x in rs),
                                        cores=cores) for rs in per_round_stats]
            # A round on a busy machine may report no measured bubble (core share too low): the
            # median of the rounds that do (None if none does), not of round 0's choice.
            bub = {k: statistics.median(vals) if (vals := [x[k] for x in rounds if x[k] is not None]) else None
                   for k in rounds[0]}
            # the measured bubble's yardstick: sim, or sim_shared where our ranks outnumber the cores
            meas, sim, judged = bub["measured"], bub["sim"], rel_diffs(bub, p, cores)
            row.update(bubble_measured=meas, bubble_simulated=sim, bubble_simulated_zero_latency=bub["sim0"],
                       bubble_simulated_cpu=bub["sim_cpu"], bubble_measured_time_shared=bub["measured_time_shared"],
                       bubble_simulated_shared=bub["sim_shared"], bubble_reference=judged["reference"],
                       bubble_other_load=judged["other_load"],
                       core_share_simulated=bub["sim_core_share"],
                       # the process CPU per step (all ranks) no simulator is fed: gloo's threads, the closing
                       # collectives, the interpreter outside the executor thread
                       cpu_unmodelled_share=1.0 - bub["sim_work_s"] / statistics.median(cpu[name]),
                       bubble_simulated_isolated_latency=bub["sim_isolated"],
                       p2p_message_in_run_s=bub["msg_in_run_s"], p2p_messages_in_run=bub["msg_in_run_n"],
                       bubble_delivery_share=bub["delivery_share"],
                       # what is left of the gap once the waits for messages already sent are taken out
                       bubble_measured_less_delivery=bub["measured_less_delivery"],
                       bubble_rel_diff_less_delivery=judged["rel_diff_less_delivery"],
                       bubble_measured_whole_step=bub["measured_whole_step"], cores=cores,
                       core_share=min(x["core_share"] for x in rounds), bubble_replayed=bub["replay"],
                       bubble_rel_diff=judged["rel_diff"], p2p_message_s=msg_s,
                       bubble_rel_diff_replay=abs(bub["measured_time_shared"] - bub["replay"]) / max(bub["replay"], 1e-12),
                       # the cores' busy share: all ranks' process CPU per step over cores x the step, median over steps
                       cores_busy_share=statistics.median(c / (cores * t) for c, t in zip(cpu[name], times[name])),
                       p2p_exchange_s=statistics.mean(x[3] for x in stats),
                       p2p_post_s=statistics.mean(x[4] for x in stats),
                       after_schedule_share=statistics.mean(o[name]["tail"] for _, o, *_ in stats),
                       executor_us_per_action=statistics.median(
                           o[name]["executor_us_per_action"] for rs in per_round_stats for _, o, *_ in rs),
                       executor_cpu_us_per_action=statistics.median(
                           o[name]["executor_cpu_us_per_action"] for rs in per_round_stats for _, o, *_ in rs),
                       peak_activation_bytes=max(o[name]["peak_activation_bytes"] for _, o, *_ in stats),
                       peak_live_bytes_measured=max((o[name]["peak_live_bytes_measured"] or 0) for _, o, *_ in stats),
                       # (B+W)/B in thread CPU time (the work), worst stage and per stage; the former wall-time one
                       backward_ratio=_split_backward_ratio(per_round_stats, name),
                       backward_ratio_per_stage=_split_backward_ratios(per_round_stats, name),
                       backward_ratio_wall=_split_backward_ratio(per_round_stats, name, key="compute"),
                       forward_ratio_per_stage=_forward_ratios(per_round_stats, name))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "interleaved_1f1b", "zbv"],
                    help="our schedules to time (1f1b always runs: it is the baseline)")
    ap.add_argument("--peers", nargs="*", default=["torch", "deepspeed"], choices=["torch", "deepspeed"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each alternates our group and DeepSpeed")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per system per round")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per system per round")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="receives our engine posts ahead of need (default: the engine's choice for the backend)")
    ap.add_argument("--p2p-reps", type=int, default=20, help="messages per ring link (latency) and send/recv rounds (exchange) timed after the steps")
    ap.add_argument("--peer-venv", default=str(Path(__file__).resolve().parent.parent / ".cache/peers/deepspeed-venv"))
    ap.add_argument("--no-install", action="store_true", help="skip DeepSpeed if its environment is missing")
    ap.add_argument("--memory", action="store_true",
                    help="one more (untimed) step per schedule of ours under torch's profiler: peak live bytes")
    ap.add_argument("--small-mb-case", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the overhead-bound case (issue 27): our 1f1b vs torch.pipelining's "
                         "Schedule1F1B at --small-mb-microbatches microbatches of --small-mb-mbs sample(s), "
                         "same shapes otherwise, alternating steps as above, at every --stages")
    ap.add_argument("--small-mb-only", action="store_true", help="time only the overhead-bound case")
    ap.add_argument("--small-mb-microbatches", type=int, default=16)
    ap.add_argument("--small-mb-mbs", type=int, default=1)
    ap.add_argument("--out", default="bench_results/pipeline.json")
    ap.add_argument("--raw", default=None,
                    help="also pickle every rank's per-step stats (timelines, p2p stamps) here, for "
                         "scripts/bench_pipeline_timeline.py")
    args = ap.parse_args()
    ds_py = (deepspeed_python(args.peer_venv, args.no_install)
             if "deepspeed" in args.peers and not args.small_mb_only else None)
    rows = []
    raw: dict = {}
    for p in args.stages if not args.small_mb_only else ():
        rows += bench_stages(args, p, ds_py, raw=raw)
    small_rows = []
    if args.small_mb_case or args.small_mb_only:
        small = argparse.Namespace(**{**vars(args), "microbatches": args.small_mb_microbatches, "mbs": args.small_mb_mbs,
                                      "schedules": ["1f1b"], "peers": ["torch"]})
        for p in args.stages:
            small_rows += bench_stages(small, p, None, case="small_mb")
    unit = {p: _simulated_unit_bubbles(p, args.microbatches) for p in sorted({*args.stages, 4})}
    if rows:
        _print_main(rows, args, unit)
    small_targets = _print_small_mb(small_rows, args) if small_rows else {}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "peer_venv")}
    path.write_text(json.dumps({"config": config, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "load_average": os.getloadavg(), "unit_cost_bubbles": unit, "rows": rows,
                                "small_mb_rows": small_rows, "small_mb_targets": small_targets},
                               indent=2))
    print(f"wrote {path}")
    if args.raw:
        with open(args.raw, "wb") as f:  # the per-rank stats, as gathered (bench_pipeline_timeline.py reads them)
            pickle.dump({"config": config, "cores": len(os.sched_getaffinity(0)), "stats": raw}, f)
        print(f"wrote {args.raw}")


if __name__ == "__main__":
    main()

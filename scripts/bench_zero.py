"""Benchmark ZeRO stages 0-3 and optimizer offload against torch DDP and FSDP2 on gloo/CPU ranks.

    python scripts/bench_zero.py [--dp 2 4] [--rounds 5] [--steps 4] [--methods ddp zero0 ...]
        [--peers deepspeed] [--peer-venv .cache/peers/deepspeed-venv] [--no-install] [--out bench_results/zero.json]

Same model (a stack of Linear + LayerNorm + GELU blocks), batch and AdamW for every
method; each block is one unit for both stage 3 and FSDP2 (``fully_shard`` per block,
then the root). Methods are run alternating: each of ``rounds`` rounds launches our
methods (``steps`` steps of each, in turn) and DeepSpeed ZeRO-1/2
(``peer_deepspeed_zero.py`` under DeepSpeed's own venv, created on first use as
``bench_pipeline.py`` does; ``--no-install`` skips the peer when it is missing), the
launch order alternating per round, so slow phases of the shared machine hit all of
them; a method's time is the median over rounds of its median step (forward +
backward + optimizer step), its ratio to a peer is taken per round (median and range).
Our stages 1-2 run with ``overlap_param_gather`` (the Trainer's default).

Like with like: every method computes the global gradient norm once per step and nobody clips (ours
for ``StepInfo.grad_norm``, which the Trainer logs; DDP and FSDP2 with torch's ``get_total_norm``, in its
default setting; DeepSpeed computes its own for the overflow check). DDP runs in its best setting
for this model: our bucket size (``BUCKET_MB``, with torch's 1 MiB first bucket, as ours),
``gradient_as_bucket_view`` and torch's fused AdamW, the kernel ``ZeroOptimizer`` runs on the
device (``fused_adamw_backend="auto"``); torch's CPU default AdamW is its per-parameter loop. Memory
accounting runs outside the timed region for every method.

``step ms min/med/max``: over rounds, of each round's median step; ``x DDP``: the per-round (paired)
ratio to DDP's, median [min-max]. ``CPU ms min/med/max``: user + system CPU time of each rank's process
per step (getrusage: every thread, gloo's included), the mean over ranks of each round's median, over
rounds; ``CPU x DDP``: its paired per-round ratio to DDP's (median [min-max]). Unlike wall time it barely moves with other jobs on a shared machine: the
load-robust comparison.

Bytes sent per rank and step (``sent MiB``): ours counted by ``parallel3d.comm``; DeepSpeed's
counted at ``torch.distributed`` with the same conventions (all-reduce 2(n-1)/n of the
tensor, reduce-scatter / all-gather (n-1)/n of the full tensor); DDP's from its all-reduce
of every fp32 gradient (its reducer calls gloo from C++). With fp32 gradients a
reduce-scatter plus all-gather (stages 1-2) sends what DDP's all-reduce sends (on gloo the
reduce-scatter is an all-to-all exchange and the all-gather point-to-point, see ``parallel3d.zero``'s
``reduction`` and ``param_gather``); the ``_ar`` variants all-reduce on gloo (DDP's bytes plus the
all-gather).

Memory per rank, model states only (weights + gradients + optimizer state, on the
device; offloaded state shown apart): ours is ``ZeroOptimizer.memory_peak_bytes``
(the high-water mark inside the step, stage 3's gathered units and staging buckets
included) and ``memory_bytes`` after the step; torch's (DDP, FSDP2) is the sum of
parameter (local shard), gradient and optimizer-state storages after the backward,
which for FSDP2 misses the unsharded parameters it holds while a block computes
(not measurable from outside on CPU). Formulas (Ψ parameters, N = dp): fp32 DDP /
stage 0 16Ψ; stage 1 8Ψ + 8Ψ/N; stage 2 4Ψ + 12Ψ/N; stage 3 and FSDP2 16Ψ/N
(fp32: 4 + 4 + 8; bf16 with bf16 gradients: 2 + 2 + 12 bytes per parameter).
Offload moves the 8 (fp32) or 12 (bf16) optimizer bytes per shard element to host
memory (``cpu``) or disk (``disk``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.parallel_state import ParallelState  # noqa: E402
from parallel3d.topology import Topology  # noqa: E402
from parallel3d.zero import ZeroOptimizer  # noqa: E402
from peer_env import cpu_seconds, deepspeed_python, rank_zero_item, run_peer  # noqa: E402
from peer_deepspeed_zero import BATCH, BUCKET_MB, DEPTH, LR, WIDTH, batch_for, make_model  # noqa: E402
# zeroN: ZeroOptimizer defaults (a true reduce-scatter per bucket: DDP's byte volume);
# zeroN_ar: reduce_scatter="auto", where gloo reduces each bucket with its faster all-reduce;
# zero3 / fsdp2_rs: parameters sharded and gathered per block (FSDP2's reshard_after_forward=True);
# fsdp2: FSDP2 keeping parameters whole from forward to backward; *_cpu / *_disk: offloaded state;
# *_bf16: bf16 parameters with bf16 gradient reduction (ZeRO's 16 bytes per parameter).
METHODS = ("ddp", "fsdp2", "fsdp2_rs", "zero0", "zero1", "zero1_ar", "zero2", "zero2_ar", "zero3", "zero3_ar",
           "zero2_cpu", "zero3_cpu", "zero3_disk", "fsdp2_rs_bf16", "zero3_bf16", "zero3_bf16_cpu")
TORCH_ADAMW = dict(betas=(0.9, 0.999), weight_decay=0.01)  # torch.optim.AdamW's defaults, as DDP/FSDP2/DeepSpeed run
PEERS = {"zero1": "deepspeed_zero1", "zero1_ar": "deepspeed_zero1", "zero2": "deepspeed_zero2",
         "zero2_ar": "deepspeed_zero2", "zero3": "fsdp2_rs", "zero3_ar": "fsdp2_rs", "zero3_bf16": "fsdp2_rs_bf16",
         "zero2_cpu": "zero2", "zero3_cpu": "zero3", "zero3_disk": "zero3", "zero3_bf16_cpu": "zero3_bf16"}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "_local_tensor"):  # DTensor: this rank's shard
            t = t._local_tensor
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def formula_bytes(method: str, psi: int, n: int) -> float:
    """Device model-state bytes per rank (module doc); offload keeps weights + gradients on the device."""
    base = method.removesuffix("_cpu").removesuffix("_disk")
    offloaded = base != method
    bf16 = "bf16" in method
    w, g, k = (2, 2, 12) if bf16 else (4, 4, 8)
    k = 0 if offloaded else k
    stage = {"ddp": 0, "zero0": 0, "zero1": 1, "zero1_ar": 1, "zero2": 2, "zero2_ar": 2}.get(base.replace("_bf16", ""), 3)
    weights = w * psi if stage < 3 else w * psi / n
    grads = g * psi if stage < 2 else g * psi / n
    opt = k * psi if stage == 0 else k * psi / n
    return weights + grads + opt


class Runner:
    """One method on this rank: ``step()`` runs forward + backward + update; ``memory()`` its bytes."""

    def __init__(self, method: str, rank: int, n: int, offload_root: str) -> None:
        self.method = method
        bf16 = "bf16" in method
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.model = make_model(dtype)
        self.psi = sum(p.numel() for p in self.model.parameters())
        self.x = batch_for(rank, dtype)
        self.zero = None
        if method == "ddp":
            self.model = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=BUCKET_MB,
                                                             gradient_as_bucket_view=True)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)
        elif method.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            reshard = "_rs" in method
            mp_policy = MixedPrecisionPolicy()
            if bf16:  # fp32 sharded parameters, bf16 compute and reduction (FSDP2's mixed precision)
                self.model = make_model(torch.float32)
                mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in self.model:
                fully_shard(block, reshard_after_forward=reshard, mp_policy=mp_policy)
            fully_shard(self.model, reshard_after_forward=reshard, mp_policy=mp_policy)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        else:
            ps = self.pstate = ParallelState(Topology(tp=1, pp=1, dp=n))
            parts = method.removeprefix("zero").split("_")
            offload = "cpu" if "cpu" in parts else "disk" if "disk" in parts else "none"
            # torch.optim.AdamW's hyper-parameters (the peers' optimizer), not OptimizerOptions' defaults.
            self.zero = ZeroOptimizer(
                [self.model], ps, zero_stage=int(parts[0]), lr=LR, betas=TORCH_ADAMW["betas"],
                weight_decay=TORCH_ADAMW["weight_decay"], clip_grad=None, bucket_size_mb=BUCKET_MB,
                reduce_scatter="auto" if "ar" in parts else "reduce_scatter", precision="bf16" if bf16 else "fp32",
                grad_reduce_dtype="bf16" if bf16 else "fp32", offload=offload,
                offload_dir=os.path.join(offload_root, method) if offload == "disk" else None,
                overlap_param_gather=True)
            self.opt = self.zero
        self.peak = self.after = self.offloaded = 0
        self.grad_norm = 0.0
        self.sent_bytes: float | None = None
        if method == "ddp":  # its reducer all-reduces every fp32 gradient once per step (ring: 2(n-1)/n)
            self.sent_bytes = 2 * 4 * self.psi * (n - 1) / n

    def count_bytes(self) -> None:
        """One untimed step counting what ours sends (``parallel3d.comm``)."""
        if self.zero is None:
            return
        before = self.pstate.comm_stats.total()
        self.step()
        self.sent_bytes = self.pstate.comm_stats.total() - before

    def step(self) -> tuple[float, float]:
        """Wall and CPU seconds of one step: forward, backward, the global grad norm, the update and
        ``zero_grad`` (module doc); memory is measured outside both."""
        if self.zero is not None:
            self.zero.reset_memory_peak()
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu_seconds()
        self.model(self.x).float().pow(2).mean().backward()
        wall = cpu = 0.0
        if self.zero is None:
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            self._torch_state_bytes()  # untimed, while the gradients exist
            t0, c0 = time.perf_counter(), cpu_seconds()
            self.grad_norm = _total_norm(self.model)
            self.opt.step()
        else:
            self.grad_norm = self.opt.step().grad_norm
        self.opt.zero_grad()
        wall, cpu = wall + time.perf_counter() - t0, cpu + cpu_seconds() - c0
        if self.zero is not None:
            self._zero_state_bytes()
        return wall, cpu

    def _torch_state_bytes(self) -> None:
        params = list(self.model.parameters())
        states = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        self.peak = self.after = _storage_bytes(params + [p.grad for p in params] + states)

    def _zero_state_bytes(self) -> None:
        peak, now = self.zero.memory_peak_bytes(), self.zero.memory_bytes()
        device = ("model_weights", "gradients", "master_weights", "optimizer_moments", "buckets")
        self.peak = sum(peak[k] for k in device)
        self.after = sum(now[k] for k in device if k != "buckets")
        self.offloaded = now["offload_host"] + now["offload_disk"]


def _total_norm(model: nn.Module) -> float:
    """The global gradient norm by torch's ``get_total_norm`` (FSDP2: of the sharded DTensor gradients)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _rank_mean(values: list[float], n: int) -> list[float]:
    """Each entry averaged over the ``n`` ranks (every rank calls it with its own values)."""
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / n).tolist()


def warm_runners(rank: int, n: int, port: int, methods: list[str], root: str) -> dict[str, "Runner"]:
    """This rank's gloo group (one torch thread, 127.0.0.1) and a ``Runner`` per method, each past two warm-up
    steps (the first steps allocate state and record stage 3's orders). Shared with the profiling scripts."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=600))
    runners = {m: Runner(m, rank, n, root) for m in methods}
    for runner in runners.values():
        runner.step()
        runner.step()
    return runners


def profile_parser(doc: str) -> argparse.ArgumentParser:
    """The profiling scripts' shared arguments: ``--dp``, ``--steps`` and the in-memory ``--methods``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--methods", nargs="+", default=["ddp", "zero0"],
                        choices=[m for m in METHODS if "cpu" not in m and "disk" not in m])
    return parser


def _worker(rank: int, n: int, port: int, rounds: int, steps: int, methods: list[str], queue) -> None:
    with tempfile.TemporaryDirectory(prefix=f"p3d-bench-offload-{rank}-") as root:
        runners = warm_runners(rank, n, port, methods, root)
        times: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(rounds):
            for m, runner in runners.items():
                walls, cpus = zip(*(runner.step() for _ in range(steps)))
                times[m].append(statistics.median(walls))
                cpu[m].append(statistics.median(cpus))
        out = {m: {"round_s": times[m], "round_cpu_s": _rank_mean(cpu[m], n), "peak_bytes": r.peak,
                   "after_bytes": r.after, "offloaded_bytes": r.offloaded, "params": r.psi}
               for m, r in runners.items()}
        for m, r in runners.items():
            r.count_bytes()
            out[m]["sent_bytes"] = r.sent_bytes
        for r in runners.values():
            if r.zero is not None:
                r.zero.close()
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run_ours(n: int, rounds: int, steps: int, methods: list[str]) -> dict:
    return rank_zero_item(_worker, n, rounds, steps, methods)


def run_deepspeed(py: str, n: int, rounds: int, steps: int) -> dict:
    out = run_peer(py, "peer_deepspeed_zero.py", ["--dp", str(n), "--rounds", str(rounds), "--steps", str(steps),
                                                 "--bucket-mb", str(BUCKET_MB)])
    for r in out.values():
        r["sent_bytes"] = sum(r["bytes_per_step"].values())
        r["peak_bytes"] = r["after_bytes"] = r["offloaded_bytes"] = 0
    return out


def _merge(total: dict, part: dict) -> None:
    for m, r in part.items():
        if m not in total:
            total[m] = dict(r, round_s=list(r["round_s"]), round_cpu_s=list(r.get("round_cpu_s", [])))
        else:
            total[m]["round_s"] += r["round_s"]
            total[m]["round_cpu_s"] += r.get("round_cpu_s", [])


def _paired(values: list[float], base: list[float]) -> dict | None:
    """Per-round ratios of ``values`` to ``base``: median, min, max (None when either is missing)."""
    ratios = [a / b for a, b in zip(values, base)]
    if not ratios or len(values) != len(base):
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="our methods and torch's (ddp is always run: every ratio is to it)")
    parser.add_argument("--peers", nargs="*", default=["deepspeed"], choices=["deepspeed"])
    parser.add_argument("--peer-venv",
                        default=str(Path(__file__).resolve().parent.parent / ".cache/peers/deepspeed-venv"))
    parser.add_argument("--no-install", action="store_true", help="skip DeepSpeed if its environment is missing")
    parser.add_argument("--out", default="bench_results/zero.json")
    args = parser.parse_args()
    methods = ["ddp"] + [m for m in args.methods if m != "ddp"]
    ds_py = deepspeed_python(args.peer_venv, args.no_install) if "deepspeed" in args.peers else None
    rows = []
    for n in args.dp:
        result: dict = {}
        for r in range(args.rounds):  # one launch of each per round, the order alternating
            order = ["ours", "deepspeed"] if r % 2 == 0 else ["deepspeed", "ours"]
            for who in order:
                if who == "ours":
                    _merge(result, run_ours(n, 1, args.steps, methods))
                elif ds_py is not None:
                    _merge(result, run_deepspeed(ds_py, n, 1, args.steps))
            print(f"[bench] dp={n} round {r + 1}/{args.rounds} done", flush=True)
        names = methods + [m for m in ("deepspeed_zero1", "deepspeed_zero2") if m in result]
        ddp = result["ddp"]
        for method in names:
            r = result[method]
            wall, cpu = _paired(r["round_s"], ddp["round_s"]), _paired(r["round_cpu_s"], ddp["round_cpu_s"])
            peer = PEERS.get(method)
            peer = peer if peer in result else None
            peer_ratios = [a / b for a, b in zip(r["round_s"], result[peer]["round_s"])] if peer else []
            psi = result["ddp"]["params"]
            formula = formula_bytes(method, psi, n) if not method.startswith("deepspeed") else None
            rows.append({"dp": n, "method": method, "median_step_s": statistics.median(r["round_s"]),
                         "min_step_s": min(r["round_s"]), "max_step_s": max(r["round_s"]),
                         "cpu_s_per_rank_range": [min(r["round_cpu_s"]), max(r["round_cpu_s"])] if r["round_cpu_s"]
                         else None,
                         "ratio_to_ddp": wall["median"], "ratio_to_ddp_range": [wall["min"], wall["max"]],
                         "cpu_s_per_rank": statistics.median(r["round_cpu_s"]) if r["round_cpu_s"] else None,
                         "cpu_ratio_to_ddp": cpu, "peer": peer,
                         "ratio_to_peer": statistics.median(peer_ratios) if peer else None,
                         "ratio_to_peer_range": [min(peer_ratios), max(peer_ratios)] if peer else None,
                         "sent_bytes_per_step": r.get("sent_bytes"), "bytes_by_op": r.get("bytes_per_step"),
                         "peak_bytes": r["peak_bytes"], "after_bytes": r["after_bytes"],
                         "offloaded_bytes": r["offloaded_bytes"], "formula_bytes": formula,
                         "after_vs_formula": r["after_bytes"] / formula if formula else None,
                         "peak_vs_formula": r["peak_bytes"] / formula if formula else None,
                         "params": psi, "round_s": r["round_s"], "round_cpu_s": r["round_cpu_s"]})
    print(f"params: {rows[0]['params']:,} ({DEPTH} blocks of Linear {WIDTH}x{WIDTH} + LayerNorm), batch {BATCH}/rank, "
          f"bucket {BUCKET_MB} MiB, fp32, gloo/CPU, 1 thread/rank; {args.rounds} alternating rounds x {args.steps} "
          f"steps ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f})")
    print(f"{'dp':>3} {'method':<16} {'step ms min/med/max':>20} {'x DDP (range)':>17} {'CPU ms min/med/max':>19} "
          f"{'CPU x DDP (range)':>17} "
          f"{'x peer (range)':>30} {'sent MiB':>8} "
          f"{'states MiB':>10} {'peak MiB':>9} {'formula MiB':>11} {'after/formula':>13} {'offloaded MiB':>13}")
    for r in rows:
        peer = "" if r["peer"] is None else (f"{r['ratio_to_peer']:.2f} [{r['ratio_to_peer_range'][0]:.2f}-"
                                             f"{r['ratio_to_peer_range'][1]:.2f}] {r['peer']}")
        sent = "" if r["sent_bytes_per_step"] is None else f"{r['sent_bytes_per_step'] / 2**20:.2f}"
        mem = "" if r["formula_bytes"] is None else (
            f"{r['after_bytes'] / 2**20:>10.2f} {r['peak_bytes'] / 2**20:>9.2f} {r['formula_bytes'] / 2**20:>11.2f} "
            f"{r['after_vs_formula']:>13.3f} {r['offloaded_bytes'] / 2**20:>13.2f}")
        lo, hi = r["ratio_to_ddp_range"]
        c = r["cpu_ratio_to_ddp"]
        cpu_ms = "" if r["cpu_s_per_rank"] is None else "/".join(
            f"{1000 * v:.1f}" for v in (r["cpu_s_per_rank_range"][0], r["cpu_s_per_rank"], r["cpu_s_per_rank_range"][1]))
        cpu_x = "" if c is None else f"{c['median']:.2f} [{c['min']:.2f}-{c['max']:.2f}]"
        step_ms = "/".join(f"{1000 * r[k]:.1f}" for k in ("min_step_s", "median_step_s", "max_step_s"))
        print(f"{r['dp']:>3} {r['method']:<16} {step_ms:>20} "
              f"{r['ratio_to_ddp']:>5.2f} [{lo:.2f}-{hi:.2f}] {cpu_ms:>19} {cpu_x:>17} {peer:>30} {sent:>8} {mem}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"width": WIDTH, "depth": DEPTH, "batch_per_rank": BATCH, "bucket_mb": BUCKET_MB,
                              "rounds": args.rounds, "steps": args.steps, "methods": methods,
                              "peers": args.peers if ds_py else []}, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The dry run's printed table and its JSON record."""

from __future__ import annotations

from parallel3d.config import ResolvedJob
from parallel3d.dryrun.meta_routing import ASSUMPTION
from parallel3d.dryrun.rank_report import RankReport

GiB = 2**30


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f}"


def _coords(r: RankReport) -> str:
    return " ".join(f"{d}{i}" for d, i in r.coords.items()) or "-"


def format_reports(rj: ResolvedJob, reports: list[RankReport]) -> str:
    """One line per rank with its bytes, then its actions and messages per step."""
    p, t = rj.job.parallel, rj.train
    lines = [
        f"dry run: {rj.model.name or rj.model.arch} | {rj.topology.describe()} | zero_stage={p.zero_stage} "
        f"offload={p.offload} | schedule={p.schedule}{' (drain split)' if rj.pipeline.splits_drain(t.recompute) else ''} "
        f"v={p.virtual_stages} | micro {t.micro_batch_size} x accum "
        f"{rj.grad_accum} | seq {t.seq_len} | {t.precision}",
        "",
        f"{'rank':>6} {'coords':<18} {'layers':>6} {'params':>14} {'param GiB':>9} {'grad GiB':>9} "
        f"{'optim GiB':>9} {'activ GiB':>9} {'planner':>9}",
    ]
    for r in reports:
        if r.error:
            lines.append(f"{r.rank:>6} ERROR {r.error}")
            continue
        lines.append(f"{r.rank:>6} {_coords(r):<18} {r.layers:>6} {r.params:>14,} {_gib(r.param_bytes)} "
                     f"{_gib(r.grad_bytes)} {_gib(r.optimizer_state_bytes)} {_gib(r.activation_bytes)} "
                     f"{'n/a' if r.activation_bytes_planner is None else _gib(r.activation_bytes_planner):>9}"
                     + (f" (+{r.offloaded_bytes / GiB:.2f} GiB offloaded)" if r.offloaded_bytes else ""))
    lines += ["", "activ: the step's measured peak of saved activations; planner: the planner's estimate"
              + (" (n/a: none for this model)" if any(r.activation_bytes_planner is None for r in reports) else "")]
    if rj.model.moe.enabled:
        lines.append(ASSUMPTION)
    lines += ["", "per step, measured from the step (calls; bytes this rank sends, comm's ring convention):"]
    for r in reports:
        if r.error:
            continue
        acts = " ".join(f"{k}={v}" for k, v in r.actions.items())
        ran = r.step_microbatches
        how = (f"step run with {ran[0]} microbatches" if len(ran) == 1 else
               f"steps run with {ran[0]} and {ran[1]} microbatches, extrapolated to {rj.grad_accum}")
        lines.append(f"  rank {r.rank}: actions {acts} ({how})")
        for m in r.messages:
            lines.append(f"    {m.kind:<30} {m.count:>8} msgs {m.bytes / GiB:>10.3f} GiB")
    return "\n".join(lines)


def reports_json(rj: ResolvedJob, reports: list[RankReport]) -> dict:
    return {"model": rj.model.name, "world_size": rj.world_size, "topology": rj.topology.describe(),
            "grad_accum": rj.grad_accum, "ranks": [r.to_dict() for r in reports]}

"""Why a search returned no layout, in one paragraph: what is closest, and by how much it misses.

Two ways a ``planner.plan`` comes back empty: no layout could even be formed (the GPUs split into no
tp x pp whose dp, times a searched micro-batch, divides the global batch; or the model's heads, layers
or sequence allow no split), or layouts were formed and none fits the memory budget. The first names
the data-parallel sizes the GPUs allow and the batch sizes that would work with them; the second the
setting with the smallest worst-rank peak (``Plan.closest``), its peak, the budget, and the excess in
GiB and percent. Invariant: the numbers printed are the plan's own (no estimate is redone here).
"""

from __future__ import annotations

from parallel3d.planning.cluster import GiB
from parallel3d.planning.planner import Plan, pipeline_sizes, tensor_parallel_sizes


def data_parallel_sizes(result: Plan) -> list[int]:
    """dp sizes the cluster's GPUs allow over the searched tp and pp (cp = 1), ascending."""
    config, gpus = result.config, result.cluster.gpus
    return sorted({gpus // (t * p) for t in tensor_parallel_sizes(config, result.cluster.gpus_per_node)
                   for p in pipeline_sizes(config.num_layers, result.request.uneven_stages) if gpus % (t * p) == 0})


def nothing_fits(result: Plan) -> str:
    """The explanation printed instead of a ranking (module doc)."""
    r, c = result.request, result.cluster
    budget = c.device.memory_bytes * r.memory_fraction
    if result.closest is not None:
        layout, memory = result.closest
        over = memory.peak_bytes - budget
        return (f"no layout fits: the closest, {layout.short()} {layout.schedule}, needs {memory.peak_bytes / GiB:.2f} "
                f"GiB on its worst rank (stage {memory.worst.stage}), {over / GiB:.2f} GiB ({100 * over / budget:.0f}%) "
                f"over the budget of {budget / GiB:.2f} GiB ({100 * r.memory_fraction:.0f}% of "
                f"{c.device.memory_bytes / GiB:.1f} GiB); try more GPUs, a larger device, plan.offload=[none,cpu], "
                f"a shorter sequence or a larger plan.memory_fraction")
    dps = data_parallel_sizes(result)
    if not dps:
        return (f"no layout can be formed: {c.gpus} GPUs split into no tp x pp of the model (tp: "
                f"{tensor_parallel_sizes(result.config, c.gpus_per_node)}, powers of two up to {c.gpus_per_node} "
                f"dividing the heads, KV heads and FFN width; pp: divisors of the {result.config.num_layers} layers "
                f"or near-even splits); try another GPU count")
    mbs = min(r.micro_batch_sizes)
    fitting = sorted({d * mbs for d in dps})[:6]
    return (f"no layout can be formed: global_batch_size={r.global_batch_size} is not divisible by dp x "
            f"micro_batch_size for any dp the {c.gpus} GPUs allow ({dps[:12]}{' ...' if len(dps) > 12 else ''}) "
            f"and micro-batch in {list(r.micro_batch_sizes)}, or the model's heads / sequence allow no split; "
            f"a multiple of one of {fitting} as the global batch would form layouts")


__all__ = ["data_parallel_sizes", "nothing_fits"]

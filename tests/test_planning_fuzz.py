"""The planner on inputs no issue names: generated searches and self-consistency invariants.

Searches are drawn (seeded; a case is reproduced by its id, ``seed-N``) over GPU counts that are odd or not a
multiple of 8, every device of the catalogue, tiny dense / GQA / MoE models (odd expert counts and top-k),
sequences of 512 to 128k, global batches that leave few or no layouts and memory so tight nothing fits. They
run through ``cli.search``, the function ``scripts/plan.py`` calls. Each must finish without an exception; an
empty plan must say what is closest and by how much (``no_fit``); every layout it ranks must

- pass the training config validator (``config.resolve`` on the layout's own overrides: the same options objects);
- have a step-time breakdown whose columns add up to the step time;
- have an MFU and tokens/s that follow from the step time and the model-shape FLOPs (``models.shape``), one
  source for both, and do the causal work at less than the device's peak.

The memory invariant is checked against an independent reference, the dry run's own construction of a rank
(the trainer's ``build_chunks`` and ``ZeroOptimizer`` on meta tensors and the fake backend): for drawn small
jobs, the planner's weights, gradients, fp32 masters, Adam moments and offloaded state per rank equal the
optimizer's flat buffers, up to the zero padding its buckets carry (ZeRO-3's gather window and the gradient in
flight, which are not buffers, are taken off the planner's side by its own split of them).
"""

from __future__ import annotations

import random

import pytest

from parallel3d.config import resolve
from parallel3d.planning.cli import format_plan, search
from parallel3d.planning.cluster import GiB
from parallel3d.planning.devices import DEVICES
from parallel3d.planning.layer_time import COST_ATTENTION
from parallel3d.train import compose_job
from tests.test_planning_cli import _job

# GPU counts from the issue; those that are not whole nodes of 8 get nodes of a size that divides them.
GPU_COUNTS = (1, 3, 6, 12, 24, 100, 1000)
SEQ_LENS = (512, 2048, 8192, 32768, 131072)


def _node(gpus: int, rng: random.Random) -> int:
    return rng.choice([n for n in (8, 4, 2, 1) if gpus <= n or gpus % n == 0])


def draw_search(seed: int) -> list[str]:
    """Overrides of ``scripts/plan.py`` for one generated search."""
    rng = random.Random(seed)
    gpus = GPU_COUNTS[seed % len(GPU_COUNTS)]
    device = sorted(DEVICES)[seed % len(DEVICES)]
    seq = rng.choice(SEQ_LENS)
    heads = rng.choice([4, 8, 12, 16])
    arch = rng.choice(["gpt", "llama", "moe"])
    hidden = heads * rng.choice([16, 32, 64])
    ov = [f"cluster.gpus={gpus}", f"cluster.gpus_per_node={_node(gpus, rng)}", f"cluster.device={device}",
          f"model.num_layers={rng.choice([2, 3, 5, 6, 8])}", f"model.hidden_size={hidden}", f"model.num_heads={heads}",
          f"model.vocab_size={rng.choice([300, 1000, 32000])}", f"model.max_seq_len={seq}", f"train.seq_len={seq}",
          "plan.top_k=4", "plan.simulate_top=4"]
    if arch == "gpt":
        ov.insert(0, "model=gpt_tiny")
    else:
        kv = rng.choice([k for k in (1, 2, 4, heads) if heads % k == 0])  # GQA shapes down to one KV head
        ov += ["model=mixtral_tiny" if arch == "moe" else "model=llama_tiny", f"model.num_kv_heads={kv}",
               f"model.ffn_hidden_size={rng.choice([3, 4]) * hidden}"]
    if arch == "moe":
        experts = rng.choice([3, 5, 6, 7, 8])
        ov += [f"model.moe.num_experts={experts}", f"model.moe.top_k={rng.randint(1, min(3, experts))}",
               f"model.moe.ffn_hidden_size={hidden}"]
    # Global batches that divide over many dp sizes, few, or none (a prime above the GPU count).
    gbs = gpus * rng.choice([1, 2, 3, 8]) if rng.random() < 0.75 else rng.choice([1, 7, 1009])
    ov.append(f"train.global_batch_size={gbs}")
    if rng.random() < 0.25:  # memory so tight that nothing may fit
        ov.append(f"cluster.device_mem={rng.choice(['64MB', '256MB', '1GB'])}")
    return ov


SEARCH_SEEDS = range(14)
EXTENDED_SEEDS = range(14, 60)


def _check_search(seed: int) -> None:
    overrides = draw_search(seed)
    job = _job("plan", overrides)
    result = search(job)
    text = format_plan(result, job.plan.top_k)
    r = result.request
    budget = result.cluster.device.memory_bytes * r.memory_fraction
    if not result.ranked:
        assert "no layout" in text
        if result.closest is not None:  # says what is closest and by how much, in the plan's own numbers
            peak = result.closest[1].peak_bytes
            assert peak > budget
            assert f"needs {peak / GiB:.2f} GiB" in text and f"{(peak - budget) / GiB:.2f} GiB" in text
        else:
            assert result.fitting == 0 and "no layout can be formed" in text
        return
    model_overrides = [o for o in overrides if o.startswith("model")]
    for cand in result.ranked:
        lay, step = cand.layout, cand.step
        assert cand.peak_bytes <= budget
        # (b) the training validator accepts the layout as the planner prints it
        train_job, _ = compose_job([*model_overrides, *lay.overrides().split()])
        rj = resolve(train_job, world_size=result.cluster.gpus)
        assert (rj.dims.tp, rj.dims.pp, rj.topology.dp, rj.grad_accum) == (lay.tp, lay.pp, lay.dp, lay.num_microbatches)
        # (c) the breakdown's columns add up to the step
        parts = dict(step.breakdown)
        assert all(v >= 0 for v in parts.values()), parts
        assert sum(parts.values()) == pytest.approx(step.step_time_s, rel=1e-9), parts
        # (d) tokens/s and MFU from the step time and the model-shape FLOPs
        tokens_per_s = r.global_batch_size * r.seq_len / step.step_time_s
        assert step.tokens_per_s() == pytest.approx(tokens_per_s, rel=1e-12)
        per_token = result.config.shape.flops_per_token(r.seq_len, attention=COST_ATTENTION).model
        cluster = result.cluster
        mfu = per_token * tokens_per_s / (cluster.gpus * cluster.device.peak_flops)
        assert step.mfu == pytest.approx(mfu, rel=1e-9)
        # Physically possible: the work a causal kernel does (recompute included) at no more than peak. (MFU
        # itself counts the full s x s attention, Megatron's convention, and passes 100% at 128k tokens.)
        done = result.config.shape.flops_per_token(r.seq_len, attention="causal", recompute=lay.recompute).hardware
        assert 0 < done * tokens_per_s / (cluster.gpus * cluster.device.peak_flops) < 1


@pytest.mark.parametrize("seed", SEARCH_SEEDS, ids=lambda s: f"seed-{s}")
def test_generated_searches_finish_and_are_self_consistent(seed):
    _check_search(seed)


@pytest.mark.extended
@pytest.mark.parametrize("seed", EXTENDED_SEEDS, ids=lambda s: f"seed-{s}")
def test_more_generated_searches(seed):
    _check_search(seed)


def test_generated_searches_cover_the_issues_inputs():
    """The draw hits every GPU count and device of the issue, MoE and GQA shapes, tight memory, and both a
    search with layouts and one with none (else a narrowed generator would pass silently)."""
    drawn = [draw_search(s) for s in SEARCH_SEEDS]
    flat = {o for ov in drawn for o in ov}
    assert {f"cluster.gpus={g}" for g in GPU_COUNTS} <= flat
    assert {f"cluster.device={d}" for d in DEVICES} <= flat
    assert any(o.startswith("model.moe.num_experts=") and int(o.split("=")[1]) % 2 for o in flat)
    assert "model.num_kv_heads=1" in flat and any(o.startswith("cluster.device_mem=") for o in flat)
    assert {f"train.seq_len={s}" for s in (SEQ_LENS[0], SEQ_LENS[-1])} <= flat


@pytest.mark.parametrize("overrides, expected", [  # in-process searches above cover the others in CI
    pytest.param(["model=llama3_8b", "cluster.gpus=8", "cluster.device_mem=1GB"], "no layout fits: the closest, ",
                 id="tight-memory"),
    pytest.param(["model=gpt_tiny", "cluster.gpus=7", "train.global_batch_size=5", "train.seq_len=64"],
                 "no layout can be formed: global_batch_size=5", id="prime-batch", marks=pytest.mark.extended),
    pytest.param(["model=llama3_8b", "cluster.gpus=12"], "error: cluster.gpus=12 is not a multiple of "
                 "cluster.gpus_per_node=8", id="partial-node", marks=pytest.mark.extended),
])
def test_plan_script_explains_an_empty_search(overrides, expected):
    """Through the script itself: an empty search says why on stdout (exit 0), a cluster it cannot describe is
    one ``error:`` line (exit 2)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(repo / "scripts" / "plan.py"), *overrides], capture_output=True,
                         text=True, cwd=repo, timeout=300)
    assert out.returncode == (2 if expected.startswith("error") else 0), out.stderr[-2000:]
    assert expected in out.stdout + out.stderr

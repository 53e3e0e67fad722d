"""``parallel.expert_zero_stage``: the routed experts' layout uses its own ZeRO stage over ``edp``.

The numbers (losses, grad norms, eval) of mixed stages are the layout matrix's (MoE draws with
``expert_zero_stage != zero_stage``, one in the CI sample). Here: each layout is held as its own
stage holds it, checked against the sizes the stage implies (ZeRO's table in ``zero.optimizer``):
a stage-3 layout keeps 1/N of its parameters between steps (the whole ones freed), stages 1-3 own
1/N of the optimizer state, stage 0 all of it; N is the layout's replica group (dense: dp x cp,
experts: edp).
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.option_checks import ConfigError
from parallel3d.parallel_state import ParallelState
from parallel3d.param_meta import set_meta
from parallel3d.topology import Topology
from parallel3d.zero.optimizer import ZeroOptimizer
from parallel3d.zero.options import ZeroOptions
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests.harness import run_on_ranks

STAGE_PAIRS = [(d, e) for d in range(4) for e in range(4) if d != e]


class _Block(torch.nn.Module):
    def __init__(self, expert: int) -> None:
        super().__init__()
        self.dense = torch.nn.Parameter(torch.randn(8, 6))
        self.expert = torch.nn.Parameter(torch.randn(6, 8))
        set_meta(self.dense, global_name="dense")
        set_meta(self.expert, global_name=f"experts.{expert}")
        self.expert.expert_index = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dense.T @ self.expert.T


def _held(rank: int, world: int, dense_stage: int, expert_stage: int) -> dict:
    ps = ParallelState(Topology(dp=world, ep=2))
    torch.manual_seed(rank)
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([_Block(ps.coord("ep"))])
    opt = ZeroOptimizer(root, ps, zero_stage=dense_stage, expert_zero_stage=expert_stage, lr=0.1)
    x = torch.randn(3, 6)
    loss = root.layers[0](x).square().sum()
    loss.backward()
    opt.step()
    opt.finish_param_sync()
    out = {"world": world, "edp_size": ps.size("edp")}
    for g, layout in enumerate(opt.layouts):
        p = layout.slots[0].param
        out[layout.reduce_kind] = dict(
            stage=opt.layout_stage(g), state=opt.master_piece(g, layout.buckets[0]).numel() if opt.masters else None,
            owners=sum(b.size for b in layout.buckets) // layout.shard_numel, resident=p.untyped_storage().nbytes() // p.element_size(), numel=p.numel(),
            replicated=opt.layout_replicated(g))
    opt.close()
    return out


@pytest.mark.parametrize("dense_stage,expert_stage", STAGE_PAIRS)
def test_each_kind_is_held_at_its_own_stage(dense_stage: int, expert_stage: int) -> None:
    for res in run_on_ranks(_held, 4, dense_stage, expert_stage):
        for kind, stage, n in (("dp_cp", dense_stage, res["world"]), ("edp", expert_stage, res["edp_size"])):
            got = res[kind]
            assert got["stage"] == stage, (kind, got)
            assert got["owners"] == (n if stage else 1), (kind, got)
            assert got["replicated"] == (stage == 0), (kind, got)
            # stage 3 frees the whole parameter between steps (its shard lives elsewhere); others keep it
            assert (got["resident"] == 0) == (stage == 3), (kind, got)


def test_bad_expert_zero_stage_names_the_key() -> None:
    with pytest.raises(ConfigError, match="parallel.expert_zero_stage=4"):
        ZeroOptions(zero_stage=1, expert_zero_stage=4)
    with pytest.raises(ConfigError, match="parallel.expert_zero_stage=0"):
        ZeroOptions(zero_stage=1, expert_zero_stage=0, offload="cpu")
    assert ZeroOptions(zero_stage=2).expert_stage == 2 and ZeroOptions(zero_stage=2, expert_zero_stage=3).expert_stage == 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_zero_corpus"))


@pytest.mark.slow
@pytest.mark.parametrize("reshard", ["auto", "microbatch"])
def test_expert_zero3_under_zbv_equals_one_process(reshard: str, tmp_path, cache_dir: str) -> None:
    """The smallest layout of matrix case 30005's crash: pp 2 with ZB-V runs both microbatches' B of a
    chunk before their W; the MoE block's experts, router and norms take their gradients in B, the
    attention weights in W. Stage 3 used to count a unit's gradients across those interleaved halves,
    freed the experts in the middle of the second B and segfaulted there. Compared with one process."""
    parallel = dict(tp=1, pp=2, dp=1, zero_stage=1, expert_zero_stage=3, schedule="zbv", virtual_stages=2,
                    sequence_parallel=False, order="tp-pp-ep-dp", pp_layers=None, bucket_size_mb=0.01,
                    offload="none", zero3_reshard=reshard, zero3_prefetch=1, cp=1, cp_comm="p2p",
                    cp_a2a_size=None, ep=1, etp=1)
    case = lm.LayoutCase(case_id=-30005, model="mixtral", parallel=parallel,
                         train={"global_batch_size": 2, "micro_batch_size": 1, "recompute": "full"})
    assert lm.is_valid(case)
    result = lr.run_case(case, str(tmp_path), cache_dir, {}, timeout=300, quiet=True)
    assert result.ok, f"{case.name}: " + "; ".join(result.problems())
    assert len(result.curve) == lm.STEPS

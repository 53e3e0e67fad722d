"""Layout-independent initialisation and dropout: the same seed gives the same model (and the
same dropout masks) for every tp / pp / micro-batch layout, bit for bit."""

from __future__ import annotations

import pytest
import torch

from models import build_model, count_parameters, get_config
from models.state import full_state_dict
from parallel3d.param_meta import tp_split_dim
from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel import init as tp_init
from parallel3d.tensor_parallel import padded_vocab_size
from parallel3d.topology import Topology
from tests.harness import run_on_ranks


@pytest.mark.parametrize("split_dim", [0, 1])
def test_shards_of_blocked_generation_concatenate_to_the_full_tensor(monkeypatch, split_dim):
    # Tiny blocks so a shard straddles several generator blocks.
    monkeypatch.setattr(tp_init, "BLOCK_ELEMENTS", 40)
    rows, cols = 24, 16
    full = torch.empty(rows, cols)
    tp_init.normal_shard(full, seed=3, global_name="w", std=0.5, split_dim=None, tp_rank=0, tp_size=1)
    assert full.std() > 0.3
    for tp in (2, 4, 8):
        local = [rows // tp, cols] if split_dim == 0 else [rows, cols // tp]
        shards = []
        for r in range(tp):
            shard = torch.empty(local)
            tp_init.normal_shard(shard, seed=3, global_name="w", std=0.5, split_dim=split_dim, tp_rank=r, tp_size=tp)
            shards.append(shard)
        assert torch.equal(torch.cat(shards, dim=split_dim), full), tp
    other = torch.empty(rows, cols)
    tp_init.normal_shard(other, seed=4, global_name="w", std=0.5, split_dim=None, tp_rank=0, tp_size=1)
    assert not torch.equal(other, full), "the seed must matter"


def test_padded_vocabulary_rows_are_zero_and_the_rest_unchanged(monkeypatch):
    monkeypatch.setattr(tp_init, "BLOCK_ELEMENTS", 24)
    full = torch.empty(10, 4)
    tp_init.normal_shard(full, seed=1, global_name="e", std=1.0, split_dim=None, tp_rank=0, tp_size=1)
    shards = []
    for r in range(4):  # 10 rows padded to 12, 3 per rank
        shard = torch.empty(3, 4)
        tp_init.normal_shard(shard, seed=1, global_name="e", std=1.0, split_dim=0, tp_rank=r, tp_size=4,
                             logical_rows=10)
        shards.append(shard)
    padded = torch.cat(shards)
    assert torch.equal(padded[:10], full) and not padded[10:].any()


def test_pipeline_slices_hold_the_same_parameters():
    for name in ("gpt_tiny", "llama_tiny"):
        cfg = get_config(name)
        single = ParallelState.single_process()
        whole = full_state_dict(build_model(cfg, single, seed=5))
        first = build_model(cfg, single, seed=5, layer_range=(0, 1))
        middle = build_model(cfg, single, seed=5, layer_range=(1, 3))
        last = build_model(cfg, single, seed=5, layer_range=(3, 4))
        seen = set()
        for part in (first, middle, last):
            for key, value in full_state_dict(part).items():
                assert torch.equal(value, whole[key]), (name, key)
                seen.add(key)
        assert seen == set(whole)


def _init_on_ranks(rank: int, world: int, names: list[str]) -> list[bool]:
    results = []
    for tp in (2, 4):
        pstate = ParallelState(Topology(tp=tp, pp=1, dp=world // tp))
        for name in names:
            overrides = {"num_kv_heads": 4} if (name == "llama_tiny" and tp == 4) else {}
            for vocab in (512, 509):
                cfg = get_config(name, vocab_size=vocab, **overrides)
                sharded = full_state_dict(build_model(cfg, pstate, seed=21))
                ref = full_state_dict(build_model(cfg, ParallelState.single_process(), seed=21))
                results.append(sharded.keys() == ref.keys() and all(torch.equal(sharded[k], ref[k]) for k in ref))
    return results


@pytest.mark.slow
def test_init_is_bit_identical_for_tp_1_2_4():
    for rank_result in run_on_ranks(_init_on_ranks, 4, ["gpt_tiny", "llama_tiny"], timeout=180):
        assert all(rank_result), rank_result


def test_meta_shards_of_a_huge_layout_sum_to_the_full_count():
    # How the planner sizes a layout: every (tp, pp) coordinate builds only its own shard.
    for name, tp, pp in (("gpt3_175b", 8, 16), ("llama31_405b", 8, 14)):
        cfg = get_config(name)
        topology = Topology(tp=tp, pp=pp, dp=1)
        per_stage = cfg.num_layers // pp
        total = 0
        for stage in range(pp):
            for t in range(tp):
                pstate = ParallelState.without_groups(topology, topology.rank_of(tp=t, pp=stage))
                module = build_model(cfg, pstate, device="meta", layer_range=(stage * per_stage, (stage + 1) * per_stage))
                # Replicated parameters (norms, row-parallel biases, positions) count once per tp group.
                total += sum(p.numel() for p in module.parameters() if t == 0 or tp_split_dim(p) is not None)
        padding = (padded_vocab_size(cfg.vocab_size, tp) - cfg.vocab_size) * cfg.hidden_size
        # gpt: the tied word embedding lives on the first and the last stage; llama: embedding + head.
        vocab_matrices = 2
        extra = cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0
        assert total == count_parameters(cfg, verbose=False) + vocab_matrices * padding + extra


def test_dropout_masks_do_not_depend_on_micro_batching():
    cfg = get_config("gpt_tiny", dropout=0.2)
    model = build_model(cfg, ParallelState.single_process(), seed=2).train()
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids, sample_ids=torch.arange(4), step=3)
        halves = torch.cat([model(ids[:2], sample_ids=torch.arange(2), step=3),
                            model(ids[2:], sample_ids=torch.arange(2, 4), step=3)])
        other_step = model(ids, sample_ids=torch.arange(4), step=4)
        no_dropout = model.eval()(ids)
    assert torch.equal(whole, halves)
    assert not torch.allclose(whole, other_step) and not torch.allclose(whole, no_dropout)

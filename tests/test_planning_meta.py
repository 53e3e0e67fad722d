"""Huge named configs instantiate on the meta device with the real layout arithmetic.

Every (tp, pp) coordinate of a tp=8 x pp=16 x dp=8 layout (1024 ranks) builds only
its own shard from ``ParallelState.without_groups`` (coordinates, no process
groups); the shards must add up to the whole model: tensor-split parameters summed
over tp, replicated ones counted once per stage, the last stage's tied embedding
copy not at all, dp replicas once. The whole model's count comes from
``models.count_parameters`` (plus the rows the vocabulary is padded by for tp=8).
Each shard must also equal the planner's analytic ``rank_params``.
"""

from __future__ import annotations

import pytest

from models import build_model, count_parameters, get_config
from parallel3d.param_meta import is_tied_embedding, is_tp_split
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.partition import partition_layers
from parallel3d.planning.params import rank_params
from parallel3d.tensor_parallel.layers import padded_vocab_size
from parallel3d.topology import Topology

TP, PP, DP = 8, 16, 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt3_175b", "llama3_70b", "llama31_405b"])
def test_meta_shards_of_a_1024_rank_layout_sum_to_the_full_model(name):
    config = get_config(name)
    topo = Topology(TP, PP, DP)
    ranges = partition_layers(config, PP)
    total = 0
    for pp in range(PP):
        for tp in range(TP):
            rank = topo.rank_of(tp=tp, pp=pp, dp=(tp + pp) % DP)  # any dp replica: they are copies
            pstate = ParallelState.without_groups(topo, rank)
            shard = build_model(config, pstate, device="meta", layer_range=ranges[pp])
            params = list(shard.parameters())
            assert all(p.device.type == "meta" for p in params)
            layers = {n.split(".")[1] for n, _ in shard.named_parameters() if n.startswith("layers.")}
            assert layers == {str(i) for i in range(*ranges[pp])}  # only its own layers
            held = sum(p.numel() for p in params)
            assert held == rank_params(config, TP, PP, pp, ranges[pp][1] - ranges[pp][0]).total
            for p in params:
                if is_tied_embedding(p) and pp == PP - 1:
                    continue  # the last stage's copy of the tied embedding
                if is_tp_split(p) or tp == 0:
                    total += p.numel()
    padding_rows = padded_vocab_size(config.vocab_size, TP) - config.vocab_size
    embeddings = 1 if config.tie_embeddings else 2
    assert total == count_parameters(config, verbose=False) + padding_rows * config.hidden_size * embeddings


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "gpt2_124m", "llama2_7b", "llama3_8b", "gpt3_175b",
                                  "llama3_70b", "llama31_405b"])
def test_analytic_parameter_count_equals_the_built_model(name):
    config = get_config(name)
    assert config.shape.total_params() == count_parameters(config, verbose=False)

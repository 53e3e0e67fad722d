"""Layer partitioning over pipeline chunks (pure Python) and its errors."""

from __future__ import annotations

import itertools

import pytest

from models import get_config
from models.config import ModelConfig
from parallel3d.pipeline.partition import (
    chunk_costs,
    head_flops,
    layer_costs,
    partition_layers,
    stage_layer_ranges,
)
from parallel3d.topology import LayoutError


def _contiguous(ranges, n):
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges[1:-1])  # only the end chunks may be empty
    assert all(a <= b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


def _best_max_cost_brute_force(cfg, chunks):
    """Smallest achievable most-expensive chunk, by trying every split (the first and last chunk may be
    empty: cuts at 0 or n; the middle ones not: cuts strictly increase)."""
    n = cfg.num_layers
    best = float("inf")
    for cuts in itertools.combinations(range(0, n + 1), chunks - 1):
        bounds = (0, *cuts, n)
        ranges = list(zip(bounds[:-1], bounds[1:]))
        best = min(best, max(chunk_costs(cfg, ranges)))
    return best


@pytest.mark.parametrize("layers,pp,v", [(4, 2, 1), (6, 4, 1), (7, 3, 1), (8, 2, 2), (12, 4, 1), (9, 2, 2), (5, 5, 1),
                                         (4, 5, 1), (3, 5, 1)])
@pytest.mark.parametrize("model", ["gpt_tiny", "llama_tiny", "gpt2_124m"])
def test_default_split_is_contiguous_and_optimal(model, layers, pp, v):
    cfg = get_config(model, num_layers=layers)
    ranges = partition_layers(cfg, pp, v)
    assert len(ranges) == pp * v
    _contiguous(ranges, layers)
    assert max(chunk_costs(cfg, ranges)) == pytest.approx(_best_max_cost_brute_force(cfg, pp * v))


def test_head_cost_moves_layers_off_the_last_stage():
    # GPT-2's head (2 * 768 * 50257 FLOPs/token) costs about 5 layers: the last stage gets fewer layers.
    cfg = get_config("gpt2_124m")
    assert 4.0 < head_flops(cfg) / layer_costs(cfg, cfg.max_seq_len)[-1] < 6.0
    counts = [b - a for a, b in partition_layers(cfg, 4)]
    assert sum(counts) == 12 and counts[-1] < max(counts)
    # A tiny vocabulary barely matters: an even split.
    small = get_config("gpt_tiny", num_layers=8, vocab_size=8)
    assert [b - a for a, b in partition_layers(small, 4)] == [2, 2, 2, 2]


def test_uneven_split_6_layers_4_stages():
    counts = [b - a for a, b in partition_layers(get_config("gpt_tiny", num_layers=6), 4)]
    assert sorted(counts) == [1, 1, 2, 2] and sum(counts) == 6


def test_explicit_split_overrides_and_stage_ranges():
    cfg = get_config("gpt_tiny", num_layers=6)
    ranges = partition_layers(cfg, 2, 2, pp_layers=[1, 2, 2, 1])
    assert ranges == [(0, 1), (1, 3), (3, 5), (5, 6)]
    # Stage s holds model chunks s and s + p.
    assert stage_layer_ranges(ranges, 2, 0) == [(0, 1), (3, 5)]
    assert stage_layer_ranges(ranges, 2, 1) == [(1, 3), (5, 6)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_stages=7), r"model.num_layers=4 is fewer than the pipeline chunks parallel.pp\*virtual_stages=7\*1=7 "
                             r"less the first and the last \(5\)"),
        (dict(num_stages=2, num_virtual_stages=4), "fewer than the pipeline chunks"),
        (dict(num_stages=3, pp_layers=[2, 0, 2]), r"every entry must be an integer >= 1 but the first and the last"),
        (dict(num_stages=2, pp_layers=[5, -1]), "every entry must be an integer >= 1"),
        (dict(num_stages=2, pp_layers=[3, 2]), r"parallel.pp_layers=\[3, 2\] sums to 5 but model.num_layers=4"),
        (dict(num_stages=2, pp_layers=[4]), r"has 1 entries; it needs one per pipeline chunk \(pp\*virtual_stages=2\)"),
        (dict(num_stages=0), "parallel.pp=0 must be an integer >= 1"),
    ],
)
def test_bad_splits_fail_fast(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        partition_layers(ModelConfig(num_layers=4), **kwargs)


def test_only_the_end_chunks_may_be_empty():
    cfg = get_config("gpt_tiny", num_layers=4)
    assert partition_layers(cfg, 2, 2, pp_layers=[0, 2, 2, 0]) == [(0, 0), (0, 2), (2, 4), (4, 4)]
    assert partition_layers(cfg, 2, pp_layers=[4, 0]) == [(0, 4), (4, 4)]
    assert partition_layers(cfg, 2, pp_layers=[0, 4]) == [(0, 0), (0, 4)]
    # The fewest layers: one per middle chunk (4 layers over 6 chunks), one more chunk is too many.
    assert [b - a for a, b in partition_layers(cfg, 3, 2)] == [0, 1, 1, 1, 1, 0]
    with pytest.raises(LayoutError, match="fewer than the pipeline chunks"):
        partition_layers(cfg, 7)
    with pytest.raises(LayoutError, match="but the first and the last"):
        partition_layers(cfg, 2, 2, pp_layers=[1, 0, 3, 0])


def test_balanced_split_empties_the_last_chunk_when_the_head_costs_a_chunk():
    # GPT-2's head costs ~5 layers: at pp=4 the best split leaves the last stage the head alone
    # (max cost 5 layers), where every chunk holding a layer costs at least 6 on one of them.
    cfg = get_config("gpt2_124m")
    counts = [b - a for a, b in partition_layers(cfg, 4)]
    assert counts == [4, 4, 4, 0]
    costs = chunk_costs(cfg, partition_layers(cfg, 4))
    assert max(costs) == pytest.approx(_best_max_cost_brute_force(cfg, 4))
    assert max(costs) < min(max(chunk_costs(cfg, partition_layers(cfg, 4, pp_layers=p)))
                            for p in ([4, 4, 3, 1], [3, 4, 4, 1], [4, 3, 4, 1], [5, 4, 2, 1]))
    # A tiny vocabulary: no chunk is worth emptying.
    assert 0 not in [b - a for a, b in partition_layers(get_config("gpt_tiny", num_layers=8, vocab_size=8), 4)]

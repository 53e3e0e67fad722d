"""``planning.engine_split`` is the pipeline engine's split (``partition_layers``), only cached.

Reference: ``partition_layers`` itself, called afresh, on generated models (dense and mixed blocks,
layer counts, sequence lengths) at every (pp, v) whose chunks the layers fill.
"""

from __future__ import annotations

import random

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.pipeline.partition import partition_layers
from parallel3d.planning.engine_split import engine_split
from parallel3d.topology import LayoutError, fewest_layers


def _models(seed: int) -> list[ModelConfig]:
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        layers = rng.randint(2, 24)
        moe = MoEConfig(num_experts=4, top_k=2, dense_layers=[i for i in range(layers) if rng.random() < 0.3]) if rng.random() < 0.5 else None
        out.append(ModelConfig(arch="llama", num_layers=layers, hidden_size=64 * rng.randint(1, 4), num_heads=4,
                               num_kv_heads=rng.choice([1, 2, 4]), ffn_hidden_size=176, vocab_size=rng.randint(100, 5000),
                               max_seq_len=4096, **({"moe": moe} if moe else {})))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_engine_split_is_partition_layers(seed):
    for config in _models(seed):
        for seq in (None, 512, 4096):
            for pp in range(1, config.num_layers + 3):
                for v in (1, 2, 3):
                    if fewest_layers(pp * v) > config.num_layers:
                        with pytest.raises(LayoutError):
                            engine_split(config, pp, v, seq)
                        continue
                    want = partition_layers(config, pp, v, seq_len=seq)
                    assert list(engine_split(config, pp, v, seq)) == want, (config, pp, v, seq)
                    assert list(engine_split(config, pp, v, seq)) == want  # the cached answer too

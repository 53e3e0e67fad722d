"""The ``model.moe`` section end to end: config keys and their errors, the block spec, presets."""

from __future__ import annotations

import pytest

from models import get_config
from models.moe_config import MoEConfig
from parallel3d.config import ConfigError, job_from_dict, resolve


def _resolve(name: str, world: int = 1, **sections):
    sections.setdefault("train", {"seq_len": 32})
    return resolve(job_from_dict(sections, model=name), world_size=world)


@pytest.mark.parametrize("first,every,layers", [(0, 0, 4), (1, 0, 4), (0, 2, 5), (2, 3, 7), (1, 1, 3)])
def test_dense_layers_follow_first_k_and_every_n(first, every, layers):
    moe = MoEConfig(num_experts=4, top_k=1, dense_first=first, dense_every=every)
    expected = [not (i < first or (every and (i + 1) % every == 0)) for i in range(layers)]
    if not any(expected):
        with pytest.raises(ValueError, match="every one of"):
            get_config("llama_tiny", num_layers=layers, moe=dict(num_experts=4, top_k=1, dense_first=first,
                                                                   dense_every=every))
        return
    cfg = get_config("llama_tiny", num_layers=layers, moe=dict(num_experts=4, top_k=1, dense_first=first,
                                                                 dense_every=every))
    assert [b.moe is not None for b in cfg.spec.blocks] == expected == [moe.is_moe_layer(i) for i in range(layers)]


def test_presets():
    mixtral, deepseek = get_config("mixtral_tiny"), get_config("deepseek_tiny")
    assert mixtral.num_layers == deepseek.num_layers == 4
    assert [b.moe is not None for b in mixtral.spec.blocks] == [True] * 4
    assert [b.moe is not None for b in deepseek.spec.blocks] == [False, True, True, True]
    m, d = mixtral.spec.blocks[0].moe, deepseek.spec.blocks[1].moe
    assert (m.num_experts, m.top_k, m.score_function, m.num_shared_experts) == (8, 2, "softmax", 0)
    assert (d.num_experts, d.score_function, d.num_shared_experts) == (8, "sigmoid", 1)
    assert d.ffn_hidden < m.ffn_hidden  # fine-grained


def test_partial_override_keeps_the_preset_keys():
    rj = _resolve("deepseek_tiny", model={"moe": {"top_k": 3}})
    assert rj.model.moe.top_k == 3 and rj.model.moe.num_shared_experts == 1 and rj.model.moe.dense_first == 1


@pytest.mark.parametrize("moe,match", [
    ({"top_k": 9}, "moe.top_k=9"),
    ({"score_function": "relu"}, "moe.score_function='relu'"),
    ({"capacity_factor": -1.0}, "moe.capacity_factor=-1.0"),
    ({"num_experts": -2}, "model.moe.num_experts=-2"),
])
def test_bad_moe_values_are_one_line_config_errors(moe, match):
    with pytest.raises(ConfigError, match=match) as info:
        _resolve("mixtral_tiny", model={"moe": moe})
    assert "\n" not in str(info.value)


def test_tp_without_sequence_parallel_is_refused():
    with pytest.raises(ConfigError, match=r"parallel\.tp=2: needs parallel\.sequence_parallel=true") as info:
        _resolve("mixtral_tiny", world=2, parallel={"tp": 2, "sequence_parallel": False})
    assert "\n" not in str(info.value)
    _resolve("mixtral_tiny", world=2, parallel={"tp": 2, "sequence_parallel": True})  # tests/test_moe_tp.py
    _resolve("mixtral_tiny", world=4, parallel={"tp": 2, "etp": 1, "ep": 4, "sequence_parallel": True})
    _resolve("llama_tiny", world=2, parallel={"tp": 2, "sequence_parallel": False})  # dense: fine


@pytest.mark.parametrize("parallel", [{"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"ep": 2, "dp": 2}])
def test_capacity_with_split_micro_batches_is_accepted(parallel):
    """Drops are decided over the whole micro-batch (tests/test_moe_capacity_split.py proves them equal)."""
    _resolve("mixtral_tiny", world=2, parallel=parallel, model={"moe": {"capacity_factor": 1.0}})


def test_training_logs_moe_metrics_and_updates_the_expert_bias_once_per_step(tmp_path):
    """The user's run: deepseek_tiny (layer 0 dense) trains, metrics.jsonl carries moe/layer_i/ for MoE layers only."""
    import json

    from parallel3d.parallel_state import ParallelState
    from parallel3d.trainer import Trainer

    steps = 2
    rj = _resolve("deepseek_tiny", train={"steps": steps, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2,
                                          "out_dir": str(tmp_path), "device": "cpu", "save_every": 0},
                  optimizer={"warmup_steps": 1}, data={"cache_dir": str(tmp_path / "cache")}, logging={"log_every": 1})
    trainer = Trainer(rj, ParallelState.single_process())
    biases = [m.router.expert_bias for m in trainer.moe.layers.values()]
    trainer.train()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    keys = {k for r in records for k in r if k.startswith("moe/")}
    assert {k.split("/")[1] for k in keys} == {"layer_1", "layer_2", "layer_3"}
    for r in records:
        assert r["moe/layer_1/tokens_max"] >= r["moe/layer_1/tokens_min"] >= 0
        assert r["moe/layer_1/dropped_fraction"] == 0.0  # dropless
    # sign updates of rate r: after `steps` steps every bias entry is a multiple of r with |b| <= steps * r
    rate = rj.model.moe.bias_update_rate
    for bias in biases:
        assert bias.abs().max() > 0 and bias.abs().max() <= steps * rate + 1e-9

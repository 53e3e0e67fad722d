"""The loss scale enters the last chunk's backward as its seed (``step_run.root_grad``): no multiplication
per microbatch, and bitwise the gradients of ``loss * loss_scale / m`` (the former forward product)."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.op_count import OpCount
from tests.pipeline_toy import HIDDEN, ToyModel, toy_batch

MBS, SEQ, LAYERS = 2, 4, 4


def _case(rank, world, pp: int, m: int, loss_scale: float) -> dict:
    pstate = ParallelState(Topology(tp=1, pp=pp, dp=world // pp))
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=1, vocab_size=32)
    (r,) = stage_layer_ranges(partition_layers(cfg, pp, 1), pp, pstate.coord("pp"))
    chunk = ToyModel(LAYERS, r)
    engine = PipelineEngine([chunk], pstate, schedule="1f1b", num_microbatches=m, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=HIDDEN)
    microbatches = toy_batch(m, MBS, SEQ)
    with OpCount() as counted:
        engine.run_step(microbatches, loss_scale=loss_scale)
    out = {"stage": pstate.coord("pp"), "muls": counted.ops["aten.mul"], "ops": sum(counted.ops.values())}
    if pp == 1:  # the reference: the same model, each microbatch's loss times the factor, backward
        model = ToyModel(LAYERS)
        for mb in microbatches:
            (model(mb["input_ids"], mb["labels"]) * (loss_scale / m)).backward()
        want = dict(model.named_parameters())
        out["equal"] = {n: torch.equal(p.grad, want[n].grad) for n, p in chunk.named_parameters()}
    return out


def test_loss_scale_is_the_backward_seed_no_multiply_same_bits():
    # factors that are not powers of two: 1/3, 1000/7 (rounded to fp32 either way)
    for m, loss_scale in ((3, 1.0), (7, 1000.0)):
        for r in run_on_ranks(_case, 2, 1, m, loss_scale):  # pp 1 (dp 2): against the product's backward
            assert r["equal"] and all(r["equal"].values()), f"m={m} scale={loss_scale}: {r['equal']}"
            assert r["muls"] == 0 < r["ops"]
    for r in run_on_ranks(_case, 2, 2, 4, 1.0):  # pp 2: the last stage's step runs no multiplication
        assert r["muls"] == 0 < r["ops"], f"stage {r['stage']}: {r['muls']} aten.mul in a step"

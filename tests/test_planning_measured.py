"""The memory estimator against bytes measured in real CPU runs (gloo ranks, tiny models).

Measured: ``ZeroOptimizer.memory_peak_bytes()`` (weights, gradients, master weights,
Adam moments; the high-water mark over the step, live ``.grad`` tensors included) and the pipeline engine's ``peak_activation_bytes`` (storages
autograd saved plus the stage's kept inputs/outputs). Estimated:
``parallel3d.planning.memory.estimate_memory`` with the torch-reference kernel
profile (the CPU path). Each category must agree within 10%.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import estimate_memory
from parallel3d.zero.optimizer import ZeroOptimizer
from tests.harness import run_on_ranks

TOLERANCE = 0.10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _measure(rank: int, world: int, case: dict) -> dict:
    layout = Layout(**case["layout"])
    config = get_config(case["model"]).replace(kernel_backend="torch")
    pstate = ParallelState(layout.topology)
    dtype = DTYPES[layout.precision]
    ranges = partition_layers(config, layout.pp, layout.virtual_stages)
    chunks = [
        build_model(config, pstate, layer_range=r, sequence_parallel=layout.sequence_parallel,
                    recompute=layout.recompute, dtype=dtype, seed=3)
        for r in stage_layer_ranges(ranges, layout.pp, pstate.coord("pp"))
    ]
    optimizer = ZeroOptimizer(chunks, pstate, zero_stage=layout.zero_stage, lr=1e-3, precision=layout.precision,
                              offload=layout.offload, zero3_prefetch=layout.zero3_prefetch,
                              zero3_reshard=layout.zero3_reshard, bucket_size_mb=case.get("bucket_mb", 25.0))
    optimizer.reset_memory_peak()
    engine = PipelineEngine(
        chunks, pstate, schedule=layout.schedule, num_microbatches=layout.num_microbatches,
        micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len, hidden_size=config.hidden_size,
        dtype=dtype, sequence_parallel=layout.sequence_parallel, grad_sync=optimizer.grad_sync,
    )
    gen = torch.Generator().manual_seed(100 + pstate.coord("dp"))
    mbs, s = layout.micro_batch_size, layout.seq_len
    microbatches = []
    for i in range(layout.num_microbatches):
        ids = torch.randint(0, config.vocab_size, (mbs, s + 1), generator=gen)
        microbatches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:],
                             "sample_ids": torch.arange(i * mbs, (i + 1) * mbs)})
    result = engine.run_step(microbatches, account_activations=True)
    optimizer.step()
    out = {"stage": pstate.coord("pp"), "activations": result.peak_activation_bytes, **optimizer.memory_peak_bytes()}
    pstate.destroy()
    return out


def _run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_measure(rank, world, case) for case in cases]


CASES = [
    # ZeRO-1 over dp=2 with a 2-stage 1F1B pipeline, fp32 (weights are their own master).
    dict(model="gpt_tiny", layout=dict(tp=1, pp=2, dp=2, zero_stage=1, micro_batch_size=2, seq_len=16,
                                       global_batch_size=12, precision="fp32")),
    # bf16 mixed precision with ZeRO-2 (fp32 main-grad shard only), Llama with GQA, interleaved.
    dict(model="llama_tiny", layout=dict(tp=1, pp=2, dp=2, zero_stage=2, micro_batch_size=1, seq_len=16,
                                         global_batch_size=8, precision="bf16", schedule="interleaved_1f1b",
                                         virtual_stages=2)),
    # Tensor parallel with sequence parallel and selective recompute.
    dict(model="gpt_tiny", layout=dict(tp=2, pp=2, dp=1, zero_stage=0, micro_batch_size=2, seq_len=16,
                                       global_batch_size=6, precision="fp32", sequence_parallel=True,
                                       recompute="selective")),
    # ZeRO-3 with pp > 1 (auto: parameters whole through the step), bf16, tied GPT.
    dict(model="gpt_tiny", layout=dict(tp=1, pp=2, dp=2, zero_stage=3, micro_batch_size=2, seq_len=16,
                                       global_batch_size=8, precision="bf16")),
    # ZeRO-3 per microbatch (root + 1 + prefetch layers whole) with cpu offload: no master or moments
    # on the device. Small buckets, so a layer is many buckets as on a real model.
    dict(model="llama_tiny", bucket_mb=0.01, layout=dict(tp=2, pp=1, dp=2, zero_stage=3, micro_batch_size=2,
                                                         seq_len=16, global_batch_size=8, precision="fp32",
                                                         offload="cpu", zero3_prefetch=1)),
    # GPipe, full recompute, Llama.
    dict(model="llama_tiny", layout=dict(tp=2, pp=2, dp=1, zero_stage=1, micro_batch_size=2, seq_len=16,
                                         global_batch_size=4, precision="fp32", schedule="gpipe",
                                         recompute="full")),
]

MEASURED_AS = {"weights": "model_weights", "gradients": "gradients", "master_weights": "master_weights",
               "optimizer_moments": "optimizer_moments", "activations": "activations"}


@pytest.mark.slow
def test_estimate_matches_measured_cpu_runs_within_10_percent():
    results = run_on_ranks(_run_cases, 4, CASES, timeout=240)
    failures = []
    for index, case in enumerate(CASES):
        layout = Layout(**case["layout"])
        config = get_config(case["model"])
        assumptions = ActivationAssumptions.for_model(config, layout.precision, kernels="torch")
        estimate = estimate_memory(config, layout, assumptions)
        for rank, per_case in enumerate(results):
            measured = per_case[index]
            stage = estimate.stages[measured["stage"]]
            for category, key in MEASURED_AS.items():
                want, got = stage.by_category()[category], measured.get(key, 0)
                if want == got == 0:
                    continue
                if abs(want - got) > TOLERANCE * max(got, 1):
                    failures.append(f"case {index} ({case['model']}, {layout.short()}) rank {rank} "
                                    f"stage {measured['stage']} {category}: estimated {want:.0f} B, "
                                    f"measured {got} B")
    assert not failures, "\n".join(failures)

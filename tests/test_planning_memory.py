"""Memory estimator against published arithmetic and its own invariants.

Published references:
- ZeRO (Rajbhandari et al., SC20, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models"), Figure 1: a 7.5B-parameter model, Nd = 64 data-parallel ranks,
  mixed-precision Adam (K = 12): baseline 120 GB, P_os (stage 1) 31.4 GB, P_os+g
  (stage 2) 16.6 GB per device.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 2: activation bytes per layer
  s*b*h*(34 + 5as/h) (no parallelism), s*b*h*(10 + 24/t + 5as/(ht)) (tensor parallel),
  s*b*h/t*(34 + 5as/h) (tensor + sequence parallel), the 5as/h term dropped by selective
  recompute; and, for the first stage of an interleaved pipeline, L layers times
  (1 + (p - 1)/(p*v)).
"""

from __future__ import annotations

import pytest

from models import ModelConfig, get_config
from parallel3d.pipeline.options import SCHEDULES
from parallel3d.pipeline.schedules import build_schedule, peak_in_flight
from parallel3d.planning.activations import (
    ActivationAssumptions,
    inflight_chunks,
    layer_activation_bytes,
)
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import estimate_memory, model_state_bytes, workspace_bytes
from parallel3d.topology import LayoutError

GB = 1e9


@pytest.mark.parametrize(
    "zero_stage, published_gb",
    [(0, 120.0), (1, 31.4), (2, 16.6)],
)
def test_zero_paper_figure1_per_device_model_states(zero_stage, published_gb):
    # The paper's 16 bytes per parameter: 16-bit gradients (parallel3d's grad_reduce_dtype=bf16).
    states = model_state_bytes(int(7.5e9), dp=64, zero_stage=zero_stage, precision="bf16", grad_reduce_dtype="bf16")
    total_gb = sum(states.values()) / GB
    assert total_gb == pytest.approx(published_gb, abs=0.05)


def test_zero_paper_16_bytes_per_parameter_breakdown():
    states = model_state_bytes(1000, dp=1, zero_stage=0, precision="fp16", grad_reduce_dtype="fp16")
    assert states == {"weights": 2000.0, "gradients": 2000.0, "master_weights": 4000.0, "optimizer_moments": 8000.0}
    # parallel3d's default: fp32 main grads (4 bytes), sharded by stage 2.
    main = model_state_bytes(1000, dp=4, zero_stage=2, precision="bf16")
    assert main["gradients"] == 4 * 250


def _gpt(h: int = 12288, a: int = 96, s: int = 2048) -> ModelConfig:
    return ModelConfig(arch="gpt", num_layers=96, hidden_size=h, num_heads=a, vocab_size=51200, max_seq_len=s)


def _korthikanti(s, b, h, a, t, *, sp, selective):
    """The paper's closed forms, written out independently of the estimator."""
    score = 0.0 if selective else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + score)
    return s * b * h * (10 + 24 / t + score / t)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("b", [1, 4])
def test_layer_activations_match_korthikanti_table2(t, sp, selective, b):
    config = _gpt()
    layout = Layout(tp=t, sequence_parallel=sp and t > 1, micro_batch_size=b, seq_len=2048,
                    recompute="selective" if selective else "none")
    got = layer_activation_bytes(config, layout, ActivationAssumptions.korthikanti())
    assert got == pytest.approx(_korthikanti(2048, b, 12288, 96, t, sp=sp and t > 1, selective=selective), rel=1e-12)


def test_korthikanti_175b_numbers_in_gigabytes():
    # The paper's GPT-3 175B example (s=2048, b=1, t=8, sequence parallel, selective):
    # 34*s*b*h/t bytes per layer = 34 * 2048 * 12288 / 8 = 107 MB.
    layout = Layout(tp=8, sequence_parallel=True, micro_batch_size=1, seq_len=2048, recompute="selective")
    per_layer = layer_activation_bytes(_gpt(), layout, ActivationAssumptions.korthikanti())
    assert per_layer == pytest.approx(34 * 2048 * 12288 / 8)
    full = layout.replace(recompute="full")
    assert layer_activation_bytes(_gpt(), full, ActivationAssumptions.korthikanti()) == pytest.approx(2 * 2048 * 12288 / 8)


def _inflight_cases() -> list[tuple[str, int, int, int]]:
    """Every schedule the config accepts, over small pipelines and microbatch counts."""
    cases = []
    for schedule in SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in (1, 2, 3, 5, 8):
                for v in ((2, 3) if schedule == "interleaved_1f1b" else (2,) if schedule == "zbv" else (1,)):
                    if schedule != "interleaved_1f1b" or (p > 1 and m % p == 0):
                        cases.append((schedule, p, m, v))
    return cases


@pytest.mark.parametrize("schedule, p, m, v", _inflight_cases())
def test_inflight_counts_equal_the_built_schedule(schedule, p, m, v):
    peaks = peak_in_flight(build_schedule(schedule, p, m, v))
    layout = Layout(pp=p, schedule=schedule, virtual_stages=v, micro_batch_size=1, global_batch_size=m)
    assert [inflight_chunks(layout, stage) for stage in range(p)] == [peaks[s] for s in range(p)]


@pytest.mark.parametrize("p, v", [(4, 2), (8, 3), (16, 4)])
def test_interleaved_first_stage_matches_korthikanti_factor(p, v):
    config = ModelConfig(arch="gpt", num_layers=p * v * 2, hidden_size=1024, num_heads=16, vocab_size=512,
                         max_seq_len=512)
    layout = Layout(tp=2, pp=p, schedule="interleaved_1f1b", virtual_stages=v, global_batch_size=4 * p,
                    micro_batch_size=1, seq_len=512, recompute="selective", sequence_parallel=True)
    korth = ActivationAssumptions(hidden_dropout=False)  # no embedding-dropout term on the first stage
    estimate = estimate_memory(config, layout, korth)
    per_layer = layer_activation_bytes(config, layout, korth)
    expected = config.num_layers * per_layer * (1 + (p - 1) / (p * v))
    assert estimate.stages[0].activations == pytest.approx(expected, rel=1e-9)


def test_one_f_one_b_first_stage_holds_all_layers_worth():
    config = get_config("gpt3_175b")
    layout = Layout(tp=8, pp=16, dp=8, sequence_parallel=True, recompute="selective", global_batch_size=1536,
                    micro_batch_size=1, seq_len=2048)
    estimate = estimate_memory(config, layout, ActivationAssumptions.korthikanti())
    # 16 microbatches in flight x 6 layers = all 96 layers' worth, plus the embedding dropout
    # mask of each in-flight microbatch (s*b*h*p/t bytes, the paper's section 4.3).
    sbh_t = 2048 * 12288 / 8
    assert estimate.stages[0].activations == pytest.approx(96 * 34 * sbh_t + 16 * sbh_t)
    assert estimate.worst.stage == 0


def test_zero_stages_shrink_states_and_stage2_grads_stay_sharded_with_accumulation():
    config = get_config("llama3_8b")
    base = Layout(tp=2, pp=2, dp=8, seq_len=1024, micro_batch_size=1, global_batch_size=8, precision="bf16",
                  grad_reduce_dtype="bf16")
    s0, s1, s2 = (estimate_memory(config, base.replace(zero_stage=z)).stages[0] for z in (0, 1, 2))
    assert s1.optimizer_moments == pytest.approx(s0.optimizer_moments / 8, rel=1e-6)
    # Stage 2: the shard plus the one gradient a hook is moving (the embedding slice here).
    transient = 2 * (config.vocab_size // 2) * config.hidden_size
    assert s2.gradients == pytest.approx(s0.gradients / 8 + transient, rel=1e-6)
    accumulating = estimate_memory(config, base.replace(zero_stage=2, global_batch_size=32)).stages[0]
    assert accumulating.gradients == s2.gradients  # every microbatch is reduce-scattered into the shard
    main_grads = estimate_memory(config, base.replace(zero_stage=2, grad_reduce_dtype="fp32")).stages[0]
    assert main_grads.gradients == pytest.approx(2 * s0.gradients / 8 + transient, rel=1e-6)


def test_zero3_shards_the_16_bytes_per_parameter():
    """The issue's arithmetic: 7B parameters with mixed-precision Adam are 112 GB of model states;
    stage 3 over 8 workers leaves about 14 GB per worker (16Ψ/N), before the gather window."""
    whole = model_state_bytes(7_000_000_000, dp=1, zero_stage=0, precision="bf16", grad_reduce_dtype="bf16")
    assert sum(whole.values()) / GB == pytest.approx(112.0)
    states = model_state_bytes(7_000_000_000, dp=8, zero_stage=3, precision="bf16", grad_reduce_dtype="bf16")
    assert sum(states.values()) / GB == pytest.approx(14.0)
    windowed = model_state_bytes(7_000_000_000, dp=8, zero_stage=3, precision="bf16", grad_reduce_dtype="bf16",
                                 gathered_params=10**8)
    assert windowed["weights"] - states["weights"] == 2 * 10**8


def test_zero3_window_and_offload_in_the_estimate():
    config = get_config("llama3_8b")
    base = Layout(tp=1, pp=1, dp=8, seq_len=1024, micro_batch_size=1, global_batch_size=8, zero_stage=3,
                  precision="bf16")
    layer = 2 * config.shape.layers[0].params.per_rank(1)  # bf16 bytes of one transformer layer
    shard2 = estimate_memory(config, base.replace(zero_stage=2)).stages[0]
    mb = {d: estimate_memory(config, base.replace(zero3_prefetch=d)).stages[0] for d in (0, 1, 2)}
    assert mb[1].weights - mb[0].weights == pytest.approx(layer)
    assert mb[2].weights - mb[1].weights == pytest.approx(layer)
    # Untied: the embedding and the head are units of their own; the window is the largest unit (the
    # 128k-vocabulary head) and one prefetched layer, not every weight.
    head = 2 * config.vocab_size * config.hidden_size
    assert mb[1].weights == pytest.approx(shard2.weights / 8 + head + layer + 2 * config.hidden_size, rel=1e-6)
    assert mb[1].weights < shard2.weights / 4
    step = estimate_memory(config, base.replace(zero3_reshard="step")).stages[0]
    assert step.weights == pytest.approx(shard2.weights * (1 + 1 / 8), rel=1e-6)  # whole stage + its shard
    assert base.replace(pp=2, global_batch_size=16).zero3_mode == "step" and base.zero3_mode == "microbatch"
    cpu = estimate_memory(config, base.replace(offload="cpu")).stages[0]
    assert cpu.master_weights == cpu.optimizer_moments == 0
    assert cpu.host == pytest.approx(mb[1].master_weights + mb[1].optimizer_moments) and cpu.disk == 0
    assert cpu.total == pytest.approx(mb[1].total - mb[1].master_weights - mb[1].optimizer_moments)
    disk = estimate_memory(config, base.replace(offload="disk")).stages[0]
    assert disk.disk == cpu.host and disk.host == 0 and disk.total == cpu.total


@pytest.mark.parametrize("changes, key", [
    (dict(tp=0), "parallel.tp"),
    (dict(zero_stage=4), "parallel.zero_stage"),
    (dict(zero_stage=0, offload="cpu"), "parallel.offload"),
    (dict(zero_stage=3, zero3_prefetch=-1), "parallel.zero3_prefetch"),
    (dict(zero_stage=3, zero3_reshard="layer"), "parallel.zero3_reshard"),
    (dict(recompute="some"), "train.recompute"),
    (dict(precision="fp8"), "train.precision"),
    (dict(schedule="zb"), "parallel.schedule"),
    (dict(virtual_stages=2), "parallel.virtual_stages"),
    (dict(dp=2, micro_batch_size=2, global_batch_size=6), "train.global_batch_size"),
    (dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch_size=1, global_batch_size=3),
     "interleaved_1f1b"),
])
def test_bad_layout_values_name_the_key(changes, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Layout(**changes)


def test_layout_that_does_not_fit_the_model_is_a_layout_error():
    with pytest.raises(LayoutError, match="num_heads"):
        estimate_memory(get_config("gpt_tiny"), Layout(tp=8, seq_len=32))
    with pytest.raises(LayoutError, match="max_seq_len"):
        estimate_memory(get_config("gpt_tiny"), Layout(seq_len=4096))


def _cp_cases(n: int = 24) -> list[tuple]:
    """Generated (cp, t, sp, selective, b, heads, s) cases: the paper's layer with cp ranks."""
    import random

    rng = random.Random(24)
    cases = []
    while len(cases) < n:
        cp, t = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        heads = t * rng.choice([2, 4, 8])
        s = 2 * cp * t * rng.choice([16, 64, 256])
        cases.append((cp, t, rng.random() < 0.5 and t > 1, rng.random() < 0.5, rng.choice([1, 2]), heads, s))
    return cases


@pytest.mark.parametrize("cp, t, sp, selective, b, heads, s", _cp_cases())
def test_ring_cp_layer_activations_are_the_paper_table_at_the_sequence_share(cp, t, sp, selective, b, heads, s):
    # Ring cp keeps only its own share's tensors: every per-token term of Korthikanti's Table 2 at
    # s/cp tokens; the unfused scores are (s/cp) queries x s keys, i.e. 5*a*s/h per local token.
    h = heads * 64
    config = ModelConfig(arch="gpt", num_layers=2, hidden_size=h, num_heads=heads, vocab_size=512, max_seq_len=s)
    layout = Layout(tp=t, cp=cp, cp_comm="p2p", sequence_parallel=sp, micro_batch_size=b, seq_len=s,
                    recompute="selective" if selective else "none")
    got = layer_activation_bytes(config, layout, ActivationAssumptions.korthikanti())
    local, score = s // cp, 0.0 if selective else 5 * heads * s / h
    want = local * b * h / t * (34 + score) if sp else local * b * h * (10 + 24 / t + score / t)
    assert got == pytest.approx(want, rel=1e-12)


def test_workspace_counts_the_loss_backward_on_the_stage_that_runs_the_loss():
    """The loss's logit-sized backward is transient memory on the stage holding the model's last chunk: the last
    stage for the loop placement, stage 0 for zbv's V (``Layout.placement``); the estimate once put it on
    stage pp - 1 for every schedule. A stage without layers keeps only that term (``workspace_bytes``)."""
    config = ModelConfig(arch="gpt", num_layers=4, hidden_size=64, num_heads=4, vocab_size=512, max_seq_len=128)
    assumptions = ActivationAssumptions.for_model(config, kernels="torch")  # the torch loss's logit copies
    shape = dict(pp=2, virtual_stages=2, micro_batch_size=1, global_batch_size=4, seq_len=128)
    loop, zbv = Layout(schedule="interleaved_1f1b", **shape), Layout(schedule="zbv", **shape)
    loss = {}
    for layout in (loop, zbv):
        runs_loss = layout.placement.stage_of(layout.num_chunks - 1)
        loss[layout.schedule] = workspace_bytes(config, layout, runs_loss, assumptions, [])
        assert workspace_bytes(config, layout, 1 - runs_loss, assumptions, []) == 0, layout.schedule
    assert loss["zbv"] == loss["interleaved_1f1b"] > 0

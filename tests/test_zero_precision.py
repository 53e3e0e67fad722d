"""Mixed precision: bf16 follows the fp32 loss curve; an fp16 overflow on one rank skips the step everywhere."""

from __future__ import annotations

import math

import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks
from tests.test_zero_optimizer import global_batch, make_mlp

CFG = ModelConfig(arch="gpt", num_layers=2, hidden_size=32, num_heads=2, vocab_size=64, max_seq_len=16)


def _loss_curve(rank, world_size, steps):
    ps = ParallelState(Topology(1, 1, world_size))
    curves = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = build_model(CFG, ps, seed=0, dtype=dtype)
        opt = ZeroOptimizer([model], ps, zero_stage=2, lr=3e-3, weight_decay=0.1, clip_grad=1.0,
                            precision=precision, bucket_size_mb=0.01)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 16, (4, 17), generator=g)  # a small alphabet, so the loss falls quickly
            mine = ids[rank * 2 : rank * 2 + 2]
            loss = model(mine[:, :-1], mine[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert opt.masters[0] is None or opt.masters[0].dtype == torch.float32
        curves[precision] = losses
    return curves


def test_bf16_loss_curve_follows_fp32():
    curves = run_on_ranks(_loss_curve, 2, 20, timeout=120)
    for c in curves:
        fp32, bf16 = c["fp32"], c["bf16"]
        assert fp32[-1] < fp32[0] - 0.5, "the run should learn something"
        for step, (a, b) in enumerate(zip(fp32, bf16)):
            # bf16 keeps 8 significand bits (eps 2^-7 = 0.0078): a few ulps of drift over 20 steps.
            assert abs(a - b) <= 0.03 * abs(a), f"step {step}: fp32 {a:.4f} vs bf16 {b:.4f}"


def _overflow(rank, world_size, bad_rank, bad_step):
    ps = ParallelState(Topology(2, 1, world_size // 2))  # the inf is on one rank of one tp and one dp group
    model = make_mlp(dtype=torch.float16)
    opt = ZeroOptimizer([model], ps, zero_stage=2, lr=1e-2, precision="fp16", loss_scale_init=1024.0,
                        loss_scale_growth_interval=2, bucket_size_mb=40 * 2 / 2**20)
    infos, changed = [], []
    for step in range(5):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        x, y = global_batch(step)
        loss = torch.nn.functional.cross_entropy(model(x.half()).float(), y) * opt.loss_scale
        if rank == bad_rank and step == bad_step:
            loss = loss * math.inf
        loss.backward()
        infos.append(opt.step())
        opt.zero_grad()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        changed.append(not torch.equal(before, after))
    return infos, changed, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_fp16_overflow_on_one_rank_skips_the_step_on_all_ranks():
    results = run_on_ranks(_overflow, 4, 3, 1, timeout=120)
    for infos, changed, _ in results:
        assert [i.skipped for i in infos] == [False, True, False, False, False]
        assert changed == [True, False, True, True, True]
        # 1024 -> halved by the overflow -> doubled after 2 good steps.
        assert [i.loss_scale for i in infos] == [1024.0, 1024.0, 512.0, 512.0, 1024.0]
        assert not math.isfinite(infos[1].grad_norm)
    assert all(torch.equal(results[0][2], r[2]) for r in results), "ranks diverged"

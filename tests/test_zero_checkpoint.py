"""Sharded ZeRO checkpoints: bit-exact resume, resharded resume (dp 4 -> 2, stage 2 -> 1 and 3), atomic writes,
bad checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import WarmupCosine, ZeroOptimizer
from tests.harness import run_on_ranks
from tests.test_zero_optimizer import TINY_BUCKET_MB, global_batch, make_mlp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _make(ps, stage, precision, seed=0, bucket_mb=TINY_BUCKET_MB):
    model = make_mlp(seed, DTYPES[precision])
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=1e-2, weight_decay=0.1, clip_grad=0.05,
                        precision=precision, bucket_size_mb=bucket_mb,
                        lr_schedule=WarmupCosine(max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=8))
    return model, opt


def _train_steps(model, opt, ps, steps, dtype):
    eval_losses = []
    for step in steps:
        x, y = global_batch(step)
        n = ps.dp_size
        local = slice(ps.dp_rank * len(x) // n, (ps.dp_rank + 1) * len(x) // n)
        F.cross_entropy(model(x[local].to(dtype)).float(), y[local]).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the loss on a fixed global batch, comparable across dp sizes
            xe, ye = global_batch(999)
            eval_losses.append(F.cross_entropy(model(xe.to(dtype)).float(), ye).item())
    return eval_losses


def _params(model, opt):
    with opt.gathered_params():  # stage 3 holds only shards between steps
        return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _same_layout(rank, world_size, path, stage, precision):
    ps = ParallelState(Topology(1, 1, world_size))
    dtype = DTYPES[precision]
    model, opt = _make(ps, stage, precision)
    straight = _train_steps(model, opt, ps, range(6), dtype)
    want = _params(model, opt)
    model, opt = _make(ps, stage, precision)
    first = _train_steps(model, opt, ps, range(3), dtype)
    opt.save_sharded(path)
    model, opt = _make(ps, stage, precision, seed=5)  # different weights: all must come from the checkpoint
    opt.load_sharded(path)
    resumed = _train_steps(model, opt, ps, range(3, 6), dtype)
    return straight, first + resumed, bool(torch.equal(_params(model, opt), want)), opt.iteration


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_resume_same_layout_is_bit_exact(tmp_path, stage, precision):
    results = run_on_ranks(_same_layout, 2, str(tmp_path / "ckpt"), stage, precision, timeout=120)
    for straight, resumed, params_equal, iteration in results:
        assert resumed == straight and params_equal and iteration == 6
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["topology"] == {"tp": 1, "pp": 1, "dp": 2} and meta["complete"]
    assert not (tmp_path / "ckpt.partial").exists()


def _run_then_save(rank, world_size, path, stage):
    ps = ParallelState(Topology(1, 1, world_size))
    model, opt = _make(ps, stage, "fp32", bucket_mb=64 * 4 / 2**20)
    _train_steps(model, opt, ps, range(3), torch.float32)
    opt.save_sharded(path)
    return _train_steps(model, opt, ps, range(3, 6), torch.float32)


def _load_and_continue(rank, world_size, path, stage):
    ps = ParallelState(Topology(1, 1, world_size))
    model, opt = _make(ps, stage, "fp32", seed=3, bucket_mb=25 * 4 / 2**20)  # other buckets, other padding
    opt.load_sharded(path)
    return _train_steps(model, opt, ps, range(3, 6), torch.float32)


@pytest.mark.slow
def test_resume_with_another_dp_size_continues_the_loss_curve(tmp_path):
    path = str(tmp_path / "ckpt")
    on_four = run_on_ranks(_run_then_save, 4, path, 2, timeout=120)[0]
    on_two = run_on_ranks(_load_and_continue, 2, path, 2, timeout=120)
    for curve in on_two:
        assert curve == pytest.approx(on_four, rel=1e-5)
    # Stages 1 and 3 read a stage-2 checkpoint too: the format is per parameter, not per buffer.
    assert run_on_ranks(_load_and_continue, 2, path, 1, timeout=120)[0] == pytest.approx(on_four, rel=1e-5)
    assert run_on_ranks(_load_and_continue, 2, path, 3, timeout=120)[0] == pytest.approx(on_four, rel=1e-5)


def test_interrupted_save_never_looks_complete(tmp_path, monkeypatch):
    ps = ParallelState.single_process()
    model, opt = _make(ps, 2, "fp32")
    path = str(tmp_path / "ckpt")
    _train_steps(model, opt, ps, range(2), torch.float32)
    opt.save_sharded(path)
    good = _params(model, opt)
    _train_steps(model, opt, ps, range(2, 4), torch.float32)

    real_replace = os.replace

    def crash_on_commit(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt("simulated crash while committing")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_commit)
    with pytest.raises(RuntimeError, match="committing the ZeRO checkpoint"):
        opt.save_sharded(path)
    monkeypatch.undo()
    assert os.path.isdir(path + ".partial")
    with pytest.raises(FileNotFoundError, match="metadata.json is missing"):
        opt.load_sharded(path + ".partial")
    opt.load_sharded(path)  # the previous checkpoint is intact
    assert torch.equal(_params(model, opt), good)
    with pytest.raises(FileNotFoundError, match="no complete ZeRO checkpoint"):
        opt.load_sharded(str(tmp_path / "never_written"))




def test_checkpoint_from_incompatible_model_names_the_tensor(tmp_path):
    ps = ParallelState.single_process()
    model, opt = _make(ps, 1, "fp32")
    opt.save_sharded(str(tmp_path / "ckpt"))
    other = nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 7))
    other_opt = ZeroOptimizer(other, ps, zero_stage=1, lr=1e-2)
    with pytest.raises(ValueError, match=r"tensor '3.weight' has shape \[5, 9\] there but \[7, 9\] in this model"):
        other_opt.load_sharded(str(tmp_path / "ckpt"))
    extra = nn.Sequential(nn.Linear(6, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 5), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"has no tensor '4.weight'"):
        ZeroOptimizer(extra, ps, zero_stage=1, lr=1e-2).load_sharded(str(tmp_path / "ckpt"))

"""Optimizer-state offload to host memory (``cpu``) and disk (``disk``), with ZeRO stages 1-3.

Against single-process torch.optim.AdamW (fp32 and bf16, with accumulation); what stays on the
device and what moves; disk offload with a state larger than its host budget; and resuming a
disk-offloaded run from a checkpoint, also into another stage, offload mode and dp.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel3d.checkpoint_io.pieces import pieces_to_read, pieces_to_write, zero_owned_state
from parallel3d.checkpoint_io.state import read_state, write_state
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks
from tests.test_zero_memory_comm import make_deep_model
from tests.test_zero_optimizer import (
    accumulate_rank_batch,
    BETAS,
    BF16_NORM_TOLERANCE,
    BF16_PARAM_TOLERANCE,
    DTYPES,
    EPS,
    LR,
    TINY_BUCKET_MB,
    WD,
    global_batch,
    make_mlp,
    train_reference,
)

STEPS, BATCH, ACC = 3, 16, 2


def _train_case(ps, rank, dp, stage, offload, precision, directory):
    dtype = DTYPES[precision]
    model = make_mlp(dtype=dtype)
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, clip_grad=0.05,
                        precision=precision, bucket_size_mb=TINY_BUCKET_MB, offload=offload,
                        offload_dir=directory if offload == "disk" else None,
                        offload_buffer_mb=7 * 24 * 2 / 2**20)  # disk: chunks of 7 elements, several per piece
    norms = []
    for step in range(STEPS):
        accumulate_rank_batch(model, opt, *global_batch(step, BATCH), rank, dp, ACC, dtype)
        info = opt.step()
        assert not info.skipped
        norms.append(info.grad_norm)
        opt.zero_grad()
    mem = opt.memory_bytes()
    files = sorted(os.listdir(os.path.join(directory, f"tp0_cp0_dp{rank}_pp0"))) if offload == "disk" else []
    with opt.gathered_params():
        params = [p.detach().float().clone() for p in model.parameters()]
    return dict(params=params, norms=norms, mem=mem, shard=opt.layouts[0].shard_numel, files=files)


def _cases(rank, world_size, cases, root):
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    out = {}
    for stage, offload, precision in cases:
        directory = os.path.join(root, f"s{stage}-{offload}-{precision}")
        out[(stage, offload, precision)] = _train_case(ps, rank, world_size, stage, offload, precision, directory)
    return out


def test_offload_matches_torch_adamw_and_leaves_the_device(tmp_path):
    cases = [(stage, offload, precision) for stage in (1, 2, 3) for offload in ("cpu", "disk")
             for precision in ("fp32", "bf16")]
    ref, ref_norms = train_reference(STEPS, 0.05, batch=BATCH)
    dp = 2
    results = run_on_ranks(_cases, dp, cases, str(tmp_path), timeout=180)
    for rank, per_case in enumerate(results):
        for (stage, offload, precision), r in per_case.items():
            label = f"rank {rank} stage={stage} offload={offload} {precision}"
            err = max(float((a - b.detach()).abs().max() / b.detach().abs().max())
                      for a, b in zip(r["params"], ref.parameters()))
            if precision == "fp32":
                assert err < 1e-5, f"{label}: rel. error {err:.2e}"
                assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), label
            else:
                assert err < BF16_PARAM_TOLERANCE, f"{label}: rel. error {err:.2e}"
                assert r["norms"] == pytest.approx(ref_norms, rel=BF16_NORM_TOLERANCE), label
            mem, shard = r["mem"], r["shard"]
            # Masters and moments left the device (fp32 training too: the master is a host copy).
            assert mem["master_weights"] == mem["optimizer_moments"] == 0, label
            if offload == "cpu":
                # 12 bytes per shard element, plus two gradient and (bf16) two parameter staging pieces.
                assert mem["offload_host"] >= 12 * shard and mem["offload_disk"] == 0, label
            else:
                assert mem["offload_disk"] == 12 * shard, label
                assert 0 < mem["offload_host"] <= 7 * 24 * 2, label
                assert r["files"] == ["group0_exp_avg.f32", "group0_exp_avg_sq.f32", "group0_master.f32"]


# ---- disk: state larger than the host budget ------------------------------------------------------
BUDGET_MB = 0.02  # 20 KiB of host buffers for ~1.8 MB of optimizer state per rank


def _disk_budget(rank, world_size, root):
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    out = {}
    for offload in ("cpu", "disk"):
        model = make_deep_model()
        opt = ZeroOptimizer([model], ps, zero_stage=3, lr=1e-3, precision="bf16", bucket_size_mb=0.05,
                            offload=offload, offload_dir=os.path.join(root, offload) if offload == "disk" else None,
                            offload_buffer_mb=BUDGET_MB)
        opt.reset_memory_peak()
        for step in range(3):
            x = torch.randn(4, 48, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
            assert not opt.step().skipped
            opt.zero_grad()
        with opt.gathered_params():
            params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        out[offload] = dict(params=params, peak=opt.memory_peak_bytes(), chunks=len(getattr(opt.states, "chunks", [])),
                            buckets=len(opt.layouts[0].buckets))
        opt.close()
    return out


def test_disk_offload_streams_a_state_larger_than_its_host_budget(tmp_path):
    budget = BUDGET_MB * 2**20
    for r in run_on_ranks(_disk_budget, 2, str(tmp_path), timeout=180):
        disk, cpu = r["disk"], r["cpu"]
        assert disk["peak"]["offload_disk"] > 50 * budget  # the optimizer state: 12 bytes x Ψ/N on disk
        assert 0.5 * budget < disk["peak"]["offload_host"] <= budget  # never more than the budget in host memory
        assert disk["chunks"] > disk["buckets"]  # pieces are streamed in several chunks each
        assert cpu["peak"]["offload_host"] > disk["peak"]["offload_disk"]  # cpu keeps all of it in host memory
        # Same host update, same numbers: streaming through files changes nothing.
        assert torch.equal(disk["params"], cpu["params"])


# ---- resume ------------------------------------------------------------------------------------------------
def _make(ps, stage, offload, directory, seed=0):
    model = make_mlp(seed)
    opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=1e-2, weight_decay=0.1, clip_grad=0.05,
                        bucket_size_mb=TINY_BUCKET_MB, offload=offload,
                        offload_dir=directory if offload == "disk" else None, offload_buffer_mb=5 * 24 * 2 / 2**20)
    return model, opt


def _steps(model, opt, ps, steps):
    for step in steps:
        x, y = global_batch(step)
        n = ps.size("dp")
        local = slice(ps.coord("dp") * len(x) // n, (ps.coord("dp") + 1) * len(x) // n)
        F.cross_entropy(model(x[local]), y[local]).backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _group(ps):
    return dist.group.WORLD if ps.distributed else None


def _save(opt, ps, ckpt):
    """What the trainer's checkpoint does (``checkpoint_io``): every rank writes its owned boxes."""
    scalars = {"adam_step": opt.adam_step, "iteration": opt.iteration}
    write_state(ckpt, pieces_to_write(opt, ps), {"scalars": scalars} if ps.rank == 0 else {}, _group(ps))


def _load(opt, ps, ckpt):
    zero_owned_state(opt)
    scalars = read_state(ckpt, pieces_to_read(opt, ps), ("scalars",), _group(ps))["scalars"]
    opt.params_from_master()
    opt.adam_step, opt.iteration = scalars["adam_step"], scalars["iteration"]


def _save_disk(rank, world_size, root, ckpt):
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size))
    model, opt = _make(ps, 2, "disk", os.path.join(root, "straight"))
    straight = _steps(model, opt, ps, range(6))
    model, opt = _make(ps, 2, "disk", os.path.join(root, "first"))
    _steps(model, opt, ps, range(3))
    _save(opt, ps, ckpt)  # streamed from the memory-mapped state files
    model, opt = _make(ps, 2, "disk", os.path.join(root, "resumed"), seed=4)  # weights and files from the checkpoint
    _load(opt, ps, ckpt)
    resumed = _steps(model, opt, ps, range(3, 6))
    return straight, resumed


def _load_elsewhere(rank, world_size, root, ckpt, stage, offload):
    ps = ParallelState(Topology(tp=1, pp=1, dp=world_size)) if world_size > 1 else ParallelState.single_process()
    model, opt = _make(ps, stage, offload, os.path.join(root, f"other-{stage}-{offload}"), seed=9)
    _load(opt, ps, ckpt)
    return _steps(model, opt, ps, range(3, 6))


def test_disk_offload_resumes_bit_exact_and_loads_into_other_stages(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_on_ranks(_save_disk, 2, str(tmp_path), ckpt, timeout=120)
    for straight, resumed in results:
        assert torch.equal(straight, resumed)
    straight = results[0][0]
    # The checkpoint is per parameter: stage 3 without offload on 4 ranks, stage 1 on cpu offload on 1 rank.
    for world, stage, offload in ((4, 3, "none"), (1, 1, "cpu")):
        got = (run_on_ranks(_load_elsewhere, world, str(tmp_path), ckpt, stage, offload, timeout=120)[0]
               if world > 1 else _load_elsewhere(0, 1, str(tmp_path), ckpt, stage, offload))
        assert torch.allclose(got, straight, rtol=1e-5, atol=1e-7), (world, stage, offload)


def test_disk_offload_checkpoint_views_are_the_state_files(tmp_path):
    """Checkpoints see disk-offloaded state as views of the memory-mapped files: what the update wrote
    with positioned writes is what they read, and what a load writes lands in the files (no copy of the
    whole state in memory)."""
    ps = ParallelState.single_process()
    model, opt = _make(ps, 1, "disk", str(tmp_path))
    _steps(model, opt, ps, range(2))
    files = {name: str(tmp_path / "tp0_cp0_dp0_pp0" / f"group0_{name}.f32") for name in ("master", "exp_avg", "exp_avg_sq")}
    on_disk = {name: torch.from_numpy(np.fromfile(path, dtype=np.float32)) for name, path in files.items()}
    segments = opt.owned_segments()
    assert sum(s.length for s in segments) == sum(p.numel() for p in model.parameters())
    for g, layout in enumerate(opt.layouts):
        for b in layout.buckets:
            for name, view in zip(files, opt.read_state_piece(g, b)):
                assert torch.equal(view, on_disk[name][b.shard_offset:b.shard_offset + b.piece_size])
    assert float(on_disk["exp_avg_sq"].abs().sum()) > 0  # two updates happened
    segments[0].exp_avg_sq.fill_(7.0)  # as a checkpoint load does
    after = torch.from_numpy(np.fromfile(files["exp_avg_sq"], dtype=np.float32))
    assert int((after == 7.0).sum()) == segments[0].length
    assert torch.equal(after[after != 7.0], on_disk["exp_avg_sq"][after != 7.0])
    opt.close()

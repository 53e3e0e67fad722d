"""Dropout keeps 1-byte masks, and the dry run runs models with dropout (findings of ``test_dryrun_fuzz``).

Before 2026-12-07 the dry run failed on every rank of a model with ``model.dropout > 0`` (its meta microbatch
gave ``sample_ids`` the tokens' shape, then dropout read the ids and drew masks on the meta device), and
``layout_independent_dropout`` kept its mask in the activations' dtype (autograd saved ``mask.to(x.dtype)``),
2-4 bytes an element where the planner counts 1. References: the plain expression under autograd (values and
gradients, bit for bit) and the bytes autograd saves, counted by ``saved_tensors_hooks``.
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import resolve
from parallel3d.dryrun import dry_run_rank
from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel.dropout import layout_independent_dropout
from parallel3d.train import compose_job
from tests.test_dryrun_estimator import TOLERANCE


def _saved(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_a_bool_mask_and_the_plain_values(dtype):
    x = torch.randn(2, 6, 8, dtype=dtype, requires_grad=True)
    kw = dict(seed=3, step=1, sample_ids=torch.tensor([4, 9]), layer=2, site="mlp", pstate=ParallelState.single_process())
    out, saved = _saved(lambda: layout_independent_dropout(x, 0.3, **kw))
    assert [t.dtype for t in saved] == [torch.bool]  # one mask, 1 byte an element
    mask = saved[0]
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = x_ref * mask.to(dtype) * (1.0 / 0.7)  # the plain expression: what autograd computes from it
    (gx_ref,) = torch.autograd.grad(ref, x_ref, grad)
    assert torch.equal(out, ref) and torch.equal(gx, gx_ref)
    assert 0 < mask.sum() < mask.numel()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_dry_run_of_a_model_with_dropout(schedule):
    """Every rank builds and steps, and the planner's estimate (1-byte masks) holds within its tolerance."""
    ov = ["model=gpt_tiny", "model.dropout=0.1", "parallel.pp=2", "parallel.tp=2", f"parallel.schedule={schedule}",
          "parallel.sequence_parallel=true", "train.precision=bf16", "train.micro_batch_size=2", "train.seq_len=64",
          "model.max_seq_len=64", "train.global_batch_size=8"]
    rj = resolve(compose_job(ov)[0], world_size=4)
    for rank in (0, 3):
        r = dry_run_rank(rj, rank)
        assert r.error is None, r.error
        assert abs(r.activation_bytes_planner - r.activation_bytes) <= TOLERANCE * r.activation_bytes, \
            (r.activation_bytes_planner, r.activation_bytes)

"""The fused multi-tensor AdamW decays inside torch's kernel on a CPU (``zero.adamw_multi``): bitwise what
the separate decay pass gave, and what ``torch.optim.AdamW(fused=True)`` computes, run by run."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adamw import adamw as torch_functional_adamw

from parallel3d.zero.adamw_multi import TensorLists, multi_tensor_adamw_

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _lists(decay: list[bool]) -> TensorLists:
    gen = torch.Generator().manual_seed(len(decay))
    out = TensorLists()
    for i, d in enumerate(decay):
        n = 1000 + 37 * i
        out.masters.append(torch.randn(n, generator=gen))
        out.grads.append(torch.randn(n, generator=gen))
        out.exp_avgs.append(torch.randn(n, generator=gen) * 0.1)
        out.exp_avg_sqs.append(torch.rand(n, generator=gen) * 0.01)
        out.decay.append(d)
    return out


def _clone(lists: TensorLists) -> TensorLists:
    return TensorLists(*[[t.clone() for t in ts] for ts in (lists.masters, lists.exp_avgs, lists.exp_avg_sqs,
                                                            lists.grads)], decay=list(lists.decay))


@pytest.mark.parametrize("step", [1, 5])
def test_in_kernel_decay_is_bitwise_the_separate_pass(step):
    lists = _lists([True, False, True, True, False])
    got, want = _clone(lists), _clone(lists)
    multi_tensor_adamw_(got, coef=1.0, step=step, kind="fused", **HYPER)
    # The earlier path: the decay as its own pass over the decayed runs, then the kernel without decay.
    torch._foreach_mul_([p for p, d in zip(want.masters, want.decay) if d], 1.0 - HYPER["lr"] * HYPER["weight_decay"])
    steps = [torch.tensor(float(step - 1)) for _ in want.masters]
    torch_functional_adamw(want.masters, want.grads, want.exp_avgs, want.exp_avg_sqs, [], steps, fused=True,
                           amsgrad=False, beta1=HYPER["beta1"], beta2=HYPER["beta2"], lr=HYPER["lr"], weight_decay=0.0,
                           eps=HYPER["eps"], maximize=False)
    for name in ("masters", "exp_avgs", "exp_avg_sqs"):
        for i, (a, b) in enumerate(zip(getattr(got, name), getattr(want, name))):
            assert torch.equal(a, b), (name, i)


def _with_torch_twin(decay: list[bool]):
    """``(lists, ours, params, opt)``: our lists, a copy with zero moments (torch's optimizer starts from zero), and
    torch's fused AdamW over the same masters in two parameter groups (decayed, not)."""
    lists = _lists(decay)
    ours = _clone(lists)
    for m in ours.exp_avgs + ours.exp_avg_sqs:
        m.zero_()
    params = [torch.nn.Parameter(m.clone()) for m in lists.masters]
    groups = [{"params": [p for p, d in zip(params, lists.decay) if d], "weight_decay": HYPER["weight_decay"]},
              {"params": [p for p, d in zip(params, lists.decay) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            fused=True)
    return lists, ours, params, opt


def test_matches_torch_fused_adamw_per_decay_group():
    """torch's own optimizer with two parameter groups (decayed, not) over three steps: equal bitwise."""
    lists, ours, params, opt = _with_torch_twin([True, False, False, True])
    for step in (1, 2, 3):
        for p, g in zip(params, lists.grads):
            p.grad = g.clone()
        opt.step()
        multi_tensor_adamw_(ours, coef=1.0, step=step, kind="fused", **HYPER)
    for i, (p, m) in enumerate(zip(params, ours.masters)):
        assert torch.equal(p.detach(), m), i


@pytest.mark.parametrize("steps", [(1, 2, 3, 4), (1, 2, 5, 6), (1, 2, 2, 3)], ids=["consecutive", "jump", "repeat"])
def test_kept_step_counts_follow_the_step_torch_is_given(steps):
    """The kernel's step tensors live across calls (``TensorLists.steps``, as torch keeps ``state["step"]``);
    a step that does not follow the last one (a skipped update, a loaded checkpoint, a retried step) must
    still use its own count: torch's optimizer told the same count each time, bitwise."""
    lists, ours, params, opt = _with_torch_twin([True, False, True])
    for step in steps:
        for p, g in zip(params, lists.grads):
            p.grad = g.clone()
            if p in opt.state:
                opt.state[p]["step"].fill_(float(step - 1))
        opt.step()
        multi_tensor_adamw_(ours, coef=1.0, step=step, kind="fused", **HYPER)
        for i, (p, m) in enumerate(zip(params, ours.masters)):
            assert torch.equal(p.detach(), m), (step, i)

"""The zero-bubble split backward (``B`` then a delayed ``W``) under ZeRO, against plain backwards.

A tied-embedding last chunk (the head's copy of the word embedding is deferred, as are every
linear's weights) trains one step of several microbatches on dp 2 under each ZeRO stage (1, 2,
3) and precision (fp32; bf16 parameters with fp32 main grads; bf16 gradients bound to their
buckets' views), once with one plain backward per microbatch and once split, with ``W`` run
directly (``leaf_grads``) and through autograd's graph. The reduced gradients (every bucket
piece ZeRO hands the optimizer) must be bitwise equal; every parameter's plain-torch hooks (a
tensor hook and a post-accumulate-grad hook, registered before and after ZeRO's) must fire once
per microbatch, for a deferred parameter in its ``W`` only, else in its ``B`` only, in the
same order relative to ZeRO's hook as in a plain backward.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.deferred_grads import backward_inputs
from parallel3d.param_meta import is_wgrad_deferrable
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.backward_split import split_backward
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks

CFG = ModelConfig(arch="gpt", num_layers=2, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=16,
                  tie_embeddings=True, use_bias=True, fused_kernels=False)
MICROBATCHES = 3
# (stage, precision, gradient dtype): fp32; bf16 parameters with fp32 main grads (the hook adds each
# microbatch's bf16 .grad into fp32); bf16 gradients whose .grad is a view of its bucket (autograd adds in place)
CASES = [(s, "fp32", "fp32") for s in (1, 2, 3)] + [(s, "bf16", "fp32") for s in (1, 2, 3)] + [(2, "bf16", "bf16")]


def _pieces(opt: ZeroOptimizer) -> list[torch.Tensor]:
    return [opt.grad_sync.grad_piece(g, b).clone() for g, layout in enumerate(opt.layouts) for b in layout.buckets]


def _one_step(pstate: ParallelState, case: tuple, mode: str, rank: int, delay: int) -> tuple[list[torch.Tensor], dict]:
    """One step's reduced gradient pieces and, per parameter, the hook calls seen (phase, hook); ``W``
    ``delay`` microbatches after its ``B``."""
    stage, precision, grad_dtype = case
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    chunk = build_model(CFG, pstate, seed=1, layer_range=(1, 2), pre_process=False, post_process=True, dtype=dtype)
    names = {id(p): n for n, p in chunk.named_parameters()}
    calls: dict[str, list[tuple[str, str]]] = {n: [] for n in names.values()}
    phase = ["-"]
    for p in chunk.parameters():
        n = names[id(p)]
        p.register_hook(lambda g, n=n: calls[n].append((phase[0], "tensor")))
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls[n].append((phase[0], "before")))
    opt = ZeroOptimizer([chunk], pstate, zero_stage=stage, lr=1e-3, precision=precision, grad_reduce_dtype=grad_dtype,
                        bucket_size_mb=600 * 4 / 2**20, weight_decay=0.0)
    for p in chunk.parameters():  # after ZeRO's: sees the gradient ZeRO has consumed
        n = names[id(p)]
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls[n].append((phase[0], "after")))
    pstate.weight_grads.direct = mode == "direct"
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(2, 8, CFG.hidden_size, generator=gen).to(dtype) for _ in range(MICROBATCHES)]
    labels = [torch.randint(0, CFG.vocab_size, (2, 8), generator=gen) for _ in range(MICROBATCHES)]
    undeferred = backward_inputs(chunk.parameters())
    last = MICROBATCHES - 1
    with pstate.weight_grads.reusing_graphs():
        pending = []
        for mb in range(MICROBATCHES):
            inp = xs[mb].clone().requires_grad_(True)
            loss = chunk(inp, labels[mb]) / MICROBATCHES
            opt.grad_sync.prepare(is_last_microbatch=mb == last)
            phase[0] = f"B{mb}" if mode != "plain" else f"P{mb}"
            if mode == "plain":
                loss.backward()
                continue
            pending.append((mb, split_backward(loss, None, inp, pstate.weight_grads, undeferred)[1]))
            if len(pending) > delay:  # delay 1: W one microbatch late, as zb_h1's steady state
                w_mb, work = pending.pop(0)
                opt.grad_sync.prepare(is_last_microbatch=w_mb == last)
                phase[0] = f"W{w_mb}"
                work.run()
        for w_mb, work in pending:
            opt.grad_sync.prepare(is_last_microbatch=w_mb == last)
            phase[0] = f"W{w_mb}"
            work.run()
    opt.grad_sync.finalize()
    deferred = {names[id(p)]: is_wgrad_deferrable(p) for p in chunk.parameters()}
    pstate.weight_grads.direct = True
    return _pieces(opt), {"calls": calls, "deferred": deferred}


def _run(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    pstate = ParallelState(Topology(dp=world))
    out = []
    for case in cases:
        got = {f"{mode}{delay}": _one_step(pstate, case, mode, rank, delay)
               for mode, delay in (("plain", 0), ("direct", 0), ("graph", 0), ("direct", 1), ("graph", 1))}
        out.append({"case": case, **got})
    return out


def _check(result: dict) -> None:
    """W right after its B: bitwise a plain backward's reduced gradients. W one microbatch late: bitwise
    what W through autograd gave (stages 2-3 reduce a bucket once all its gradients of a microbatch are
    in, so a later B's undeferred gradients can join an earlier microbatch's reduction: a different
    rounding of the same sum than plain backwards, the same whichever way W accumulates)."""
    case = result["case"]
    plain_pieces, plain = result["plain0"]
    assert any(plain["deferred"].values()) and not all(plain["deferred"].values()), case
    for mode, ref in (("direct0", "plain0"), ("graph0", "plain0"), ("direct1", "graph1")):
        pieces, split = result[mode]
        assert len(pieces) == len(result[ref][0])
        for i, (a, b) in enumerate(zip(pieces, result[ref][0])):
            assert torch.equal(a, b), (case, mode, ref, i, (a.float() - b.float()).abs().max())
        for a, b in zip(pieces, plain_pieces):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 if a.dtype == torch.float32 else 1e-3)
        for name, seen in split["calls"].items():
            half = "W" if split["deferred"][name] else "B"
            want = [(f"{half}{mb}", hook) for mb in range(MICROBATCHES) for hook in ("tensor", "before", "after")]
            assert seen == want, (case, mode, name, seen)
            # the same hooks in the same order as in the plain backward
            assert [h for _, h in seen] == [h for _, h in plain["calls"][name]], (case, mode, name)


@pytest.mark.parametrize("cases", [CASES[:4], CASES[4:]], ids=["first", "second"])
def test_split_backward_under_zero_equals_plain_backwards_and_fires_every_hook_once_per_w(cases):
    for per_rank in run_on_ranks(_run, 2, cases, timeout=300):
        for result in per_rank:
            _check(result)


def test_cases_cover_every_stage_and_both_gradient_dtypes():
    assert {c[0] for c in CASES} == {1, 2, 3}
    assert set(itertools.product((1, 2, 3), ("fp32",))) <= {(c[0], c[2]) for c in CASES if c[1] == "bf16"}
    assert any(c[1] == c[2] == "bf16" for c in CASES)

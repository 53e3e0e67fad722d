"""Fused cross-entropy (Triton interpreter on CPU) vs float64 ``torch.nn.functional.cross_entropy``.

Covers: the loss and the logits gradient with ignore_index rows, label smoothing, 3-d
logits, vocab sizes that are not powers of two and span several blocks, a single row;
the vocab-shard pieces (per-shard statistics combined like a tp all-reduce, shard grads,
tp padding columns) against the full-vocabulary loss; the same combination on 2 gloo ranks
through ``kernels.dispatch.vocab_sharded_cross_entropy``; what forward keeps for backward;
and the input errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import run_interpreted
from tests.harness import run_on_ranks

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (logits shape, block_size, label_smoothing, reduction)
CASES = [((1, 7), None, 0.0, "mean"), ((9, 37), 8, 0.1, "mean"), ((2, 3, 300), 64, 0.0, "sum"),
         ((5, 70), 32, 0.2, "none")]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _random_targets(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[1::3] = -100  # some ignored rows (none when rows == 1)
    return t


def _ce_case(shape: tuple, block: int | None, smoothing: float, reduction: str, dtype: torch.dtype, seed: int):
    from kernels.cross_entropy import cross_entropy

    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    rows = logits.numel() // shape[-1]
    targets = _random_targets(g, rows, shape[-1]).reshape(shape[:-1])
    loss = cross_entropy(logits, targets, label_smoothing=smoothing, reduction=reduction, block_size=block)
    upstream = torch.randn(loss.shape, generator=g)
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    x64 = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(x64.reshape(rows, -1), targets.reshape(-1), label_smoothing=smoothing, reduction=reduction)
    (ref_grad,) = torch.autograd.grad(ref, x64, upstream.double().reshape(ref.shape))
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    return {"loss": rel_err(loss.reshape(ref.shape), ref), "grad": rel_err(grad, ref_grad)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cross_entropy_matches_float64_reference(dtype: torch.dtype) -> None:
    for i, (shape, block, smoothing, reduction) in enumerate(CASES):
        errors = run_interpreted(_ce_case, shape, block, smoothing, reduction, dtype, seed=400 + i)
        bad = {k: v for k, v in errors.items() if not v < TOL[dtype]}
        assert not bad, f"cross_entropy {dtype} {shape} smoothing={smoothing} {reduction}: rel errors {bad}"


def _shard_pieces(smoothing: float, seed: int) -> dict:
    """3 shards of 20 columns over a 50-word vocabulary (the last shard has 10 padding columns)."""
    from kernels.cross_entropy import cross_entropy_grad, softmax_stats, softmax_stats_reference

    vocab, width, rows = 50, 20, 7
    g = torch.Generator().manual_seed(seed)
    full = 3 * torch.randn(rows, 3 * width, generator=g)
    full[:, vocab:] = 1e4  # padding columns hold garbage that must not count
    targets = _random_targets(g, rows, vocab)
    targets[0] = vocab - 1  # a target in the last (padded) shard
    shards = [full[:, i * width : (i + 1) * width] for i in range(3)]
    stats = [softmax_stats(s, targets, vocab_start=i * width, vocab_size=vocab, block_size=8)
             for i, s in enumerate(shards)]
    ref_stats = [softmax_stats_reference(s, targets, vocab_start=i * width, vocab_size=vocab)
                 for i, s in enumerate(shards)]
    stats_err = max(rel_err(a, b.double()) for st, rs in zip(stats, ref_stats) for a, b in zip(st, rs))
    # What the tp all-reduces compute:
    global_max = torch.stack([s.max for s in stats]).max(0).values
    sum_exp = sum(s.sum_exp * torch.exp(s.max - global_max) for s in stats)
    lse = global_max + sum_exp.log()
    target_logit = sum(s.target_logit for s in stats)
    sum_logits = sum(s.sum_logits for s in stats)
    valid = targets != -100
    loss = (1 - smoothing) * (lse - target_logit) + smoothing * (lse - sum_logits / vocab)
    loss = torch.where(valid, loss, 0.0).sum() / valid.sum()
    scale = valid.float() / valid.sum()
    grads = [cross_entropy_grad(s, targets, lse, scale, vocab_start=i * width, vocab_size=vocab,
                                label_smoothing=smoothing, block_size=8) for i, s in enumerate(shards)]
    grad = torch.cat(grads, dim=1)
    x64 = full[:, :vocab].double().requires_grad_()
    ref = F.cross_entropy(x64, targets, label_smoothing=smoothing)
    (ref_grad,) = torch.autograd.grad(ref, x64)
    return {"stats": stats_err, "loss": rel_err(loss, ref), "grad": rel_err(grad[:, :vocab], ref_grad),
            "padding_grad": grad[:, vocab:].abs().max().item()}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_shard_pieces_combine_to_full_cross_entropy(smoothing: float) -> None:
    errors = run_interpreted(_shard_pieces, smoothing, seed=11)
    assert errors.pop("padding_grad") == 0.0
    assert all(v < 1e-5 for v in errors.values()), errors


def _sharded_on_ranks(rank: int, world_size: int, smoothing: float) -> tuple[float, float]:
    import torch.distributed as dist

    from kernels import dispatch

    vocab, rows = 37, 6  # shards of 19 columns: the last one has 1 padding column
    width = -(-vocab // world_size)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(rows, width * world_size, generator=g)
    targets = _random_targets(g, rows, vocab)
    shard = full[:, rank * width : (rank + 1) * width].clone().requires_grad_()

    def all_reduce(op):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=op)
            return t

        return reduce

    per_row = dispatch.vocab_sharded_cross_entropy(
        shard, targets, vocab_start=rank * width, vocab_size=vocab, all_reduce_max=all_reduce(dist.ReduceOp.MAX),
        all_reduce_sum=all_reduce(dist.ReduceOp.SUM), label_smoothing=smoothing, backend="torch",
    )
    loss = per_row.sum() / (targets != -100).sum()
    (grad,) = torch.autograd.grad(loss, shard)
    x64 = full[:, :vocab].double().requires_grad_()
    ref = F.cross_entropy(x64, targets, label_smoothing=smoothing)
    (ref_grad,) = torch.autograd.grad(ref, x64)
    ref_shard = F.pad(ref_grad, (0, width * world_size - vocab))[:, rank * width : (rank + 1) * width]
    return rel_err(loss, ref), (grad.double() - ref_shard).abs().max().item()


@pytest.mark.slow
def test_vocab_sharded_cross_entropy_on_two_gloo_ranks() -> None:
    for loss_err, grad_err in run_on_ranks(_sharded_on_ranks, 2, 0.1, timeout=120):
        assert loss_err < 1e-5 and grad_err < 1e-6, (loss_err, grad_err)


def _saved_for_backward() -> tuple[int, int, list[int]]:
    from kernels.cross_entropy import cross_entropy

    logits = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 40, (6,))
    loss = cross_entropy(logits, targets)
    node = loss.grad_fn
    while node is not None and not node.name().endswith("ShardedCrossEntropyBackward"):
        node = node.next_functions[0][0]
    return logits.data_ptr(), logits.numel(), [t.numel() for t in node.saved_tensors]


def test_forward_keeps_no_probabilities() -> None:
    logits_ptr, numel, saved = run_interpreted(_saved_for_backward)
    # logits themselves plus three [rows] vectors (targets, lse, valid): nothing vocab-sized.
    assert sorted(saved) == [6, 6, 6, numel]


def test_cross_entropy_input_errors() -> None:
    from kernels.cross_entropy import cross_entropy, vocab_sharded_cross_entropy

    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 10\) or ignore_index=-100; got e.g. 10"):
        cross_entropy(logits, torch.tensor([1, 2, 10, 3]))
    with pytest.raises(ValueError, match="one target per row"):
        cross_entropy(logits, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        cross_entropy(logits, torch.tensor([1, 2, 3, 4]), label_smoothing=1.5)
    with pytest.raises(ValueError, match="vocab_start=12"):
        vocab_sharded_cross_entropy(logits, torch.tensor([1, 2, 3, 4]), vocab_start=12, vocab_size=12,
                                    all_reduce_max=lambda t: t, all_reduce_sum=lambda t: t)

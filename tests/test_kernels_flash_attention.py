"""Triton flash attention (interpreter on CPU) against the fp32/fp64 math path and torch.

Generated blocks: GQA (hq/hk in 1..3), head dims that are not powers of two, query and key
lengths that are not multiples of the tile, causal masks with global offsets (the block
of a context-parallel step: keys before, overlapping and after the queries), document ids
with boundaries inside the block, and rows that see no key at all (lse = -inf, out 0).
Backward is driven by the block's own out/lse here and by merged ones in the blockwise test
(``local_attention`` on the triton path against torch's whole attention).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.testing import run_interpreted

TILE = 16  # small tiles: several per block, so the tile loops and their causal bounds run


def _block_case(seed: int) -> dict:
    rng = random.Random(seed)
    hk = rng.choice((1, 2))
    return dict(b=rng.choice((1, 2)), hq=hk * rng.choice((1, 2, 3)), hk=hk, d=rng.choice((5, 8, 12)),
                sq=rng.choice((7, 16, 23)), sk=rng.choice((9, 16, 37)), causal=rng.random() < 0.75,
                q_start=rng.choice((0, 11, 40)), k_start=rng.choice((0, 11, 30)), docs=rng.random() < 0.5)


def _triton_block_vs_math(case: dict, seed: int) -> dict:
    from kernels.attention_math import attention_backward_math, attention_forward_math, block_mask
    from kernels.flash_attention import flash_attention_backward, flash_attention_forward

    g = torch.Generator().manual_seed(seed)
    b, hq, hk, d, sq, sk = (case[n] for n in ("b", "hq", "hk", "d", "sq", "sk"))
    q = torch.randn(b, sq, hq, d, generator=g).transpose(1, 2)  # strided, as the CP path passes views
    k, v = torch.randn(b, hk, sk, d, generator=g), torch.randn(b, hk, sk, d, generator=g)
    q_doc = k_doc = None
    if case["docs"]:
        q_doc = torch.sort(torch.randint(0, 3, (b, sq), generator=g), dim=1).values
        k_doc = torch.sort(torch.randint(0, 3, (b, sk), generator=g), dim=1).values
    kw = dict(causal=case["causal"], q_start=case["q_start"], k_start=case["k_start"], q_doc=q_doc, k_doc=k_doc)
    scale = d ** -0.5
    out, lse = flash_attention_forward(q, k, v, scale=scale, block_m=TILE, block_n=TILE, **kw)
    allowed = block_mask(sq, sk, **kw)
    ref_out, ref_lse = attention_forward_math(q.double(), k.double(), v.double(), scale=scale, allowed=allowed)
    dout = torch.randn(b, hq, sq, d, generator=g)
    delta = (dout.double() * ref_out).sum(-1)
    grads = flash_attention_backward(dout, q, k, v, lse, delta.float(), scale=scale, block_m=TILE, block_n=TILE, **kw)
    ref_grads = attention_backward_math(dout.double(), q.double(), k.double(), v.double(), ref_lse, delta,
                                        scale=scale, allowed=allowed)
    finite = torch.isfinite(ref_lse)
    errs = {"out": _rel(out, ref_out), "lse": _rel(lse[finite], ref_lse[finite])}
    errs["lse_inf_match"] = float(not torch.equal(torch.isfinite(lse), finite))
    errs.update({n: _rel(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    return errs


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("seed", range(6))
def test_triton_block_matches_math_path(seed: int) -> None:
    case = _block_case(seed)
    errs = run_interpreted(_triton_block_vs_math, case, seed, timeout=300)
    assert max(errs.values()) < 1e-5, (case, errs)


def _blockwise_on_triton(seed: int) -> dict:
    from kernels.attention_math import attention_reference
    from parallel3d.context_parallel import AttentionStats, document_ids, local_attention

    g = torch.Generator().manual_seed(seed)
    b, s, hq, hk, d = 2, 24, 4, 2, 8
    q, dout = torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hq, d, generator=g)
    k, v = torch.randn(b, s, hk, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    tokens = torch.randint(1, 9, (b, s), generator=g)
    tokens[:, [4, 11, 12]] = 0  # a document ends inside, and one on the edge of, the first chunk
    docs = document_ids(tokens, 0)
    errs = {}
    for name, doc in (("plain", None), ("documents", docs)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        stats = AttentionStats()
        out = local_attention(*leaves, document_ids=doc, backend="triton", stats=stats)
        grads = torch.autograd.grad(out, leaves, dout)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*ref_leaves, document_ids=doc)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
        errs[name] = max([_rel(out, ref)] + [_rel(x, r) for x, r in zip(grads, ref_grads)])
        errs[name + "_blocks"] = len(stats.blocks())
    return errs


def test_blockwise_attention_on_the_triton_path_matches_torch() -> None:
    errs = run_interpreted(_blockwise_on_triton, 3, timeout=300)
    assert errs["plain"] < 1e-5 and errs["documents"] < 1e-5, errs
    assert errs["plain_blocks"] == 1 and errs["documents_blocks"] >= 2, errs  # documents cut the sequence in chunks


def _whole_flash_attention(seed: int) -> float:
    from kernels.attention_math import attention_reference
    from kernels.flash_attention import flash_attention

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 19, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 19, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 19, 2, 8, generator=g, requires_grad=True)
    out = flash_attention(q, k, v, block_m=TILE, block_n=TILE)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    return max([_rel(out, ref)] + [_rel(x, r) for x, r in zip(grads, ref_grads)])


def test_flash_attention_autograd_function_matches_torch() -> None:
    assert run_interpreted(_whole_flash_attention, 5, timeout=300) < 1e-5

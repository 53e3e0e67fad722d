"""Flash attention in Triton: forward returning the log-sum-exp, backward from it.

Layout: ``q [b, hq, sq, d]``, ``k``/``v [b, hk, sk, d]`` (any strides), ``hq % hk == 0``
(grouped-query: query head ``j`` reads kv head ``j // (hq // hk)``, kv never copied).
The mask is that of ``kernels.attention_math`` (the oracle these kernels are tested
against in the interpreter): ``causal`` with the block's global offsets ``q_start`` /
``k_start`` (key ``j`` visible to query ``i`` iff ``k_start + j <= q_start + i``), and
optional document ids ``q_doc [b, sq]`` / ``k_doc [b, sk]`` (visible only within a
document). So one launch computes any block of a context-parallel attention.

Forward (one program per ``BLOCK_M`` queries of one head): the online softmax in fp32 over
``BLOCK_N`` key tiles; with ``causal`` the loop stops at the last tile a query of the
program can see. Returns ``out`` (fp32) and ``lse [b, hq, sq]`` (fp32, ``-inf`` and out 0
for a query that sees no key).

Backward, given the final ``lse`` and ``delta = rowsum(dout * out)`` of the queries (both
may come from merging several blocks): one kernel per kv tile accumulates ``dk``/``dv``
over the group's query heads, a second per query tile accumulates ``dq``; no atomics,
so results are deterministic. Gradients come back in fp32.

All tiles are loaded as fp32 (the interpreter computes bf16 ``tl.dot`` wrongly); fp32
inputs use IEEE products (no TF32) so results match the fp32 math path on a GPU too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_math import attention_forward_math  # noqa: F401 (the oracle, re-exported)
from kernels.runtime import next_power_of_2

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load_tile(BASE, rows, n_rows, stride, offs_d, D):
    """fp32 ``[len(rows), BLOCK_D]`` tile of a ``[n_rows, D]`` matrix (0 outside it)."""
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < D)
    return tl.load(BASE + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(BASE, tile, rows, n_rows, stride, offs_d, D):
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < D)
    tl.store(BASE + rows[:, None] * stride + offs_d[None, :], tile, mask=mask)


@triton.jit
def _docs(DOC, rows, n_rows, HAS_DOC: tl.constexpr):
    """Document ids of ``rows`` (-1 past the end); ``rows`` itself when there are no documents."""
    if HAS_DOC:
        return tl.load(DOC + rows, mask=rows < n_rows, other=-1)
    return rows


@triton.jit
def _visible(offs_m, offs_n, sq, sk, q_start, k_start, qdoc, kdoc, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` visibility of keys ``offs_n`` to queries ``offs_m``."""
    ok = (offs_m[:, None] < sq) & (offs_n[None, :] < sk)
    if CAUSAL:
        ok = ok & ((k_start + offs_n)[None, :] <= (q_start + offs_m)[:, None])
    if HAS_DOC:
        ok = ok & (qdoc[:, None] == kdoc[None, :])
    return ok


@triton.jit
def _key_end(m_end, sk, q_start, k_start, CAUSAL: tl.constexpr):
    """Keys past this index are hidden from queries ``< m_end`` by the causal mask."""
    if CAUSAL:
        return tl.minimum(sk, tl.maximum(q_start + m_end - k_start, 0))
    return sk


@triton.jit
def _probs_tile(q, k, lse, ok, scale, IEEE: tl.constexpr):
    """``P = exp(S - lse)`` of one tile, 0 where hidden (lse = -inf rows hide every key)."""
    s = _dot(q, tl.trans(k), IEEE) * scale
    return tl.where(ok, tl.exp(s - tl.where(ok, lse[:, None], 0.0)), 0.0)


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, QDOC, KDOC, sq, sk, q_start, k_start, scale, HQ, GROUP, D,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, l_sb, l_sh, qd_sb, kd_sb,
    CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HQ, bh % HQ
    k_base, v_base = K + b * k_sb + (h // GROUP) * k_sh, V + b * v_sb + (h // GROUP) * v_sh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * q_sb + h * q_sh, offs_m, sq, q_ss, offs_d, D)
    qdoc = _docs(QDOC + b * qd_sb, offs_m, sq, HAS_DOC)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = _key_end(tl.minimum((pid_m + 1) * BLOCK_M, sq), sk, q_start, k_start, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, sk, k_ss, offs_d, D)
        v = _load_tile(v_base, offs_n, sk, v_ss, offs_d, D)
        kdoc = _docs(KDOC + b * kd_sb, offs_n, sk, HAS_DOC)
        ok = _visible(offs_m, offs_n, sq, sk, q_start, k_start, qdoc, kdoc, CAUSAL, HAS_DOC)
        s = tl.where(ok, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no visible key yet keep m = -inf: shift by 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, v, IEEE)
        m_i = m_new
    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    _store_tile(O + b * o_sb + h * o_sh, out, offs_m, sq, o_ss, offs_d, D)
    tl.store(LSE + b * l_sb + h * l_sh + offs_m, lse, mask=offs_m < sq)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QDOC, KDOC, sq, sk, q_start, k_start, scale, HQ, HK, GROUP, D,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss, l_sb, l_sh,
    dk_sb, dk_sh, dk_ss, dv_sb, dv_sh, dv_ss, qd_sb, kd_sb,
    CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, hk = bh // HK, bh % HK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * k_sb + hk * k_sh, offs_n, sk, k_ss, offs_d, D)
    v = _load_tile(V + b * v_sb + hk * v_sh, offs_n, sk, v_ss, offs_d, D)
    kdoc = _docs(KDOC + b * kd_sb, offs_n, sk, HAS_DOC)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Causal: queries before this tile's first key see none of it.
    lo = 0
    if CAUSAL:
        lo = tl.maximum(k_start + pid_n * BLOCK_N - q_start, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):  # the query heads that read this kv head
        h = hk * GROUP + g
        for start_m in range(lo, sq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _load_tile(Q + b * q_sb + h * q_sh, offs_m, sq, q_ss, offs_d, D)
            do = _load_tile(DO + b * do_sb + h * do_sh, offs_m, sq, do_ss, offs_d, D)
            lse = tl.load(LSE + b * l_sb + h * l_sh + offs_m, mask=offs_m < sq, other=0.0)
            delta = tl.load(DELTA + b * l_sb + h * l_sh + offs_m, mask=offs_m < sq, other=0.0)
            qdoc = _docs(QDOC + b * qd_sb, offs_m, sq, HAS_DOC)
            ok = _visible(offs_m, offs_n, sq, sk, q_start, k_start, qdoc, kdoc, CAUSAL, HAS_DOC)
            p = _probs_tile(q, k, lse, ok, scale, IEEE)
            dv += _dot(tl.trans(p), do, IEEE)
            ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
            dk += _dot(tl.trans(ds), q, IEEE) * scale
    _store_tile(DK + b * dk_sb + hk * dk_sh, dk, offs_n, sk, dk_ss, offs_d, D)
    _store_tile(DV + b * dv_sb + hk * dv_sh, dv, offs_n, sk, dv_ss, offs_d, D)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QDOC, KDOC, sq, sk, q_start, k_start, scale, HQ, GROUP, D,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss, l_sb, l_sh,
    dq_sb, dq_sh, dq_ss, qd_sb, kd_sb,
    CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HQ, bh % HQ
    k_base, v_base = K + b * k_sb + (h // GROUP) * k_sh, V + b * v_sb + (h // GROUP) * v_sh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * q_sb + h * q_sh, offs_m, sq, q_ss, offs_d, D)
    do = _load_tile(DO + b * do_sb + h * do_sh, offs_m, sq, do_ss, offs_d, D)
    lse = tl.load(LSE + b * l_sb + h * l_sh + offs_m, mask=offs_m < sq, other=0.0)
    delta = tl.load(DELTA + b * l_sb + h * l_sh + offs_m, mask=offs_m < sq, other=0.0)
    qdoc = _docs(QDOC + b * qd_sb, offs_m, sq, HAS_DOC)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = _key_end(tl.minimum((pid_m + 1) * BLOCK_M, sq), sk, q_start, k_start, CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, sk, k_ss, offs_d, D)
        v = _load_tile(v_base, offs_n, sk, v_ss, offs_d, D)
        kdoc = _docs(KDOC + b * kd_sb, offs_n, sk, HAS_DOC)
        ok = _visible(offs_m, offs_n, sq, sk, q_start, k_start, qdoc, kdoc, CAUSAL, HAS_DOC)
        p = _probs_tile(q, k, lse, ok, scale, IEEE)
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _dot(ds, k, IEEE) * scale
    _store_tile(DQ + b * dq_sb + h * dq_sh, dq, offs_m, sq, dq_ss, offs_d, D)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_doc, k_doc) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: q [b, hq, sq, d] and k = v [b, hk, sk, d] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: {q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    if (q_doc is None) != (k_doc is None):
        raise ValueError("flash_attention: give document ids for both queries and keys, or for neither")


class _Launch:
    """Arguments shared by the three kernels of one block (shapes, offsets, mask flags, tiles)."""

    def __init__(self, q, k, q_doc, k_doc, causal, q_start, k_start, scale, block_m, block_n) -> None:
        self.b, self.hq, self.sq, self.d = q.shape
        self.hk, self.sk = k.shape[1], k.shape[2]
        self.has_doc = q_doc is not None
        dummy = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
        self.q_doc = q_doc.contiguous() if self.has_doc else dummy
        self.k_doc = k_doc.contiguous() if self.has_doc else dummy
        self.scalars = (self.sq, self.sk, q_start, k_start, scale)
        self.flags = dict(
            CAUSAL=bool(causal), HAS_DOC=self.has_doc, IEEE=q.dtype == torch.float32,
            BLOCK_M=block_m or BLOCK_M, BLOCK_N=block_n or BLOCK_N, BLOCK_D=max(16, next_power_of_2(self.d)),
        )

    def docs(self) -> tuple:
        return self.q_doc.stride(0), self.k_doc.stride(0)


def _bhs(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False,
    q_start: int = 0, k_start: int = 0, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, sq, d] fp32, lse [b, hq, sq] fp32)`` of one block; see the module doc."""
    _check(q, k, v, q_doc, k_doc)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    run = _Launch(q, k, q_doc, k_doc, causal, q_start, k_start, scale, block_m, block_n)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if out.numel():
        grid = (triton.cdiv(run.sq, run.flags["BLOCK_M"]), run.b * run.hq)
        _fwd_kernel[grid](
            q, k, v, out, lse, run.q_doc, run.k_doc, *run.scalars, run.hq, run.hq // run.hk, run.d,
            *_bhs(q), *_bhs(k), *_bhs(v), *_bhs(out), lse.stride(0), lse.stride(1), *run.docs(), **run.flags,
        )
    return out, lse


def flash_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, *, scale: float, causal: bool = False, q_start: int = 0, k_start: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in fp32 of one block from the final ``lse`` and ``delta [b, hq, sq]``."""
    _check(q, k, v, q_doc, k_doc)
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    run = _Launch(q, k, q_doc, k_doc, causal, q_start, k_start, scale, block_m, block_n)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if not (dq.numel() and dk.numel()):
        return dq, dk, dv
    common = (*_bhs(q), *_bhs(k), *_bhs(v), *_bhs(dout), lse.stride(0), lse.stride(1))
    group = run.hq // run.hk
    _bwd_dkdv_kernel[(triton.cdiv(run.sk, run.flags["BLOCK_N"]), run.b * run.hk)](
        q, k, v, dout, lse, delta, dk, dv, run.q_doc, run.k_doc, *run.scalars, run.hq, run.hk, group, run.d,
        *common, *_bhs(dk), *_bhs(dv), *run.docs(), **run.flags,
    )
    _bwd_dq_kernel[(triton.cdiv(run.sq, run.flags["BLOCK_M"]), run.b * run.hq)](
        q, k, v, dout, lse, delta, dq, run.q_doc, run.k_doc, *run.scalars, run.hq, group, run.d,
        *common, *_bhs(dq), *run.docs(), **run.flags,
    )
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Whole-sequence attention on ``[b, h, s, d]`` tensors (causal and/or documents)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, document_ids, scale, block_m, block_n):
        kw = dict(scale=scale, causal=causal, q_doc=document_ids, k_doc=document_ids, block_m=block_m, block_n=block_n)
        out, lse = flash_attention_forward(q, k, v, **kw)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        delta = (dout.float() * out.float()).sum(-1)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, lse, delta, **ctx.kw)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
    document_ids: torch.Tensor | None = None, scale: float | None = None,
    block_m: int | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """Differentiable attention ``[b, s, hq, d]`` from ``q [b, s, hq, d]``, ``k``/``v [b, s, hk, d]``;
    ``document_ids [b, s]`` keeps attention inside each packed document."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out = FlashAttentionFunction.apply(qh, kh, vh, causal, document_ids, scale, block_m, block_n)
    return out.transpose(1, 2)

"""One block of attention, forward (out + log-sum-exp) and backward, on the best path here.

Layout: ``q [b, hq, sq, d]``, ``k``/``v [b, hk, sk, d]`` (views with any strides), one
``Block`` of a plan (``blocks``) giving its global segments and mask flags. Outputs and
gradients come back in the compute dtype (fp32; fp64 for fp64 inputs) for fp32
accumulation by the caller.

Paths (``backend``, same names as ``kernels.backend`` plus ``math``):
- ``triton``: ``kernels.flash_attention`` (CUDA, or CPU under ``TRITON_INTERPRET=1``);
  it takes every mask (causal with offsets, documents, GQA) itself.
- ``torch``: torch's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``,
  which returns the log-sum-exp and has a backward) for blocks without a document mask
  whose causal mask, if any, is top-left aligned (the only one its ``is_causal`` knows);
  it reads grouped kv heads itself from torch 2.5 on (older torch: kv heads are repeated
  for it). Every other block, and any block on a device without that kernel, uses the
  math path. ``fused_forward`` / ``fused_backward`` call it on one whole block without the
  casts to the compute dtype and without ``delta`` (it computes its own): the single-block
  path (``single_block``) uses its out/lse and gradients as they come.
- ``math``: ``kernels.attention_math`` (explicit masks, fp32 softmax) everywhere.
- ``auto``: ``triton`` where Triton can run on the tensor, else ``torch``.

Backward uses the final (merged) ``out``, ``lse`` and ``delta = rowsum(dout * out)`` of the
block's queries, so each block's gradient is exact on its own.
"""

from __future__ import annotations

import torch

from kernels.attention_math import attention_backward_math, attention_forward_math, block_mask, compute_dtype
from kernels.runtime import resolve_backend
from parallel3d.context_parallel.blocks import Block

ATTENTION_BACKENDS = ("auto", "triton", "torch", "math")
_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def flash_cpu_reads_grouped_kv() -> bool:
    """torch's CPU flash kernels index kv head ``i // (hq / hk)`` themselves from torch 2.5 on (the
    release that added ``enable_gqa``); before, they assume ``hq == hk`` and kv heads must be repeated."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def _kv_for_flash_cpu(k: torch.Tensor, v: torch.Tensor, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    group = q_heads // k.shape[1]
    if group == 1 or flash_cpu_reads_grouped_kv():
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _sum_kv_groups(dk: torch.Tensor, hk: int) -> torch.Tensor:
    """A repeated kv head's gradient is the sum over the query heads that read it (no-op unrepeated)."""
    b, h, s, d = dk.shape
    return dk if h == hk else dk.reshape(b, hk, h // hk, s, d).sum(2)


def resolve_attention_backend(backend: str, tensor: torch.Tensor) -> str:
    """``"triton"``, ``"torch"`` or ``"math"`` for ``tensor``; an explicit choice that cannot run raises."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "math":
        return "math"
    return resolve_backend(backend, "flash_attention", tensor)  # "triton" or "torch" for these names


class BlockAttention:
    """Computes blocks for one attention call: ``scale``, the resolved path, whole-sequence
    ``document_ids [b, s]`` (or None) and an optional ``AttentionStats`` to record into."""

    def __init__(self, path: str, scale: float, document_ids: torch.Tensor | None = None, stats=None) -> None:
        self.path, self.scale, self.document_ids, self.stats = path, scale, document_ids, stats

    def _docs(self, block: Block) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not block.documents:
            return None, None
        assert self.document_ids is not None
        return (self.document_ids[:, block.q.start:block.q.end], self.document_ids[:, block.k.start:block.k.end])

    def _mask(self, block: Block, device: torch.device) -> torch.Tensor | None:
        q_doc, k_doc = self._docs(block)
        return block_mask(block.q.length, block.k.length, q_start=block.q.start, k_start=block.k.start,
                          causal=block.causal, q_doc=q_doc, k_doc=k_doc, device=device)

    def fused(self, block: Block, q: torch.Tensor) -> bool:
        """Whether ``block`` runs as one call of torch's CPU flash kernels (``fused_forward``/``fused_backward``)."""
        return (self.path == "torch" and q.device.type == "cpu" and not block.documents
                and block.top_left_causal and q.dtype in _FLASH_CPU_DTYPES)

    def _triton_kw(self, block: Block) -> dict:
        q_doc, k_doc = self._docs(block)
        return dict(scale=self.scale, causal=block.causal, q_start=block.q.start, k_start=block.k.start,
                    q_doc=q_doc, k_doc=k_doc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [b, hq, sq, d], lse [b, hq, sq])`` of the block, compute dtype."""
        if self.stats is not None:
            self.stats.record("forward", block, q.shape[1])
        ct = compute_dtype(q.dtype)
        if self.path == "triton":
            from kernels.flash_attention import flash_attention_forward  # imports triton: only on this path

            out, lse = flash_attention_forward(q, k, v, **self._triton_kw(block))
            return out.to(ct), lse.to(ct)
        if self.fused(block, q):
            out, lse = self._flash_forward(q, k, v, block)
            return out.to(ct), lse.to(ct)
        return attention_forward_math(q, k, v, scale=self.scale, allowed=self._mask(block, q.device))

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, delta: torch.Tensor, block: Block,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of the block in the compute dtype; ``out``/``lse``/``delta`` are final."""
        if self.stats is not None:
            self.stats.record("backward", block, q.shape[1])
        ct = compute_dtype(q.dtype)
        if self.path == "triton":
            from kernels.flash_attention import flash_attention_backward

            grads = flash_attention_backward(dout, q, k, v, lse, delta, **self._triton_kw(block))
            return tuple(g.to(ct) for g in grads)  # type: ignore[return-value]
        if self.fused(block, q):
            dq, dk, dv = self._flash_backward(dout, q, k, v, out, lse.to(ct), block)
            return dq.to(ct), dk.to(ct), dv.to(ct)
        return attention_backward_math(dout, q, k, v, lse, delta, scale=self.scale, allowed=self._mask(block, q.device))

    def _flash_forward(self, q, k, v, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        kr, vr = _kv_for_flash_cpu(k, v, q.shape[1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, block.causal, scale=self.scale)

    def _flash_backward(self, dout, q, k, v, out, lse, block: Block) -> tuple[torch.Tensor, ...]:
        kr, vr = _kv_for_flash_cpu(k, v, q.shape[1])
        # dout / out go in as the strided views they are: the kernel reads strides (no copies).
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out, lse.contiguous(), 0.0, block.causal, scale=self.scale,
        )
        return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, v.shape[1])

    def fused_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of a ``fused`` block straight from the kernel: out in the input dtype (the
        kernel accumulates in fp32), laid out as ``q``'s strides; lse fp32 (fp64 for fp64)."""
        if self.stats is not None:
            self.stats.record("forward", block, q.shape[1])
        return self._flash_forward(q, k, v, block)

    def fused_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, block: Block) -> tuple[torch.Tensor, ...]:
        """``(dq, dk, dv)`` of a ``fused`` block in the input dtype; needs no ``delta`` (the kernel forms it)."""
        if self.stats is not None:
            self.stats.record("backward", block, q.shape[1])
        return self._flash_backward(dout, q, k, v, out, lse, block)


def merge_partial(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running ``(acc_out, acc_lse)`` in place.

    ``acc_out [.., sq, d]``/``acc_lse [.., sq]`` start at 0 / -inf. With ``L = logaddexp(acc_lse, lse)``:
    ``acc_out = exp(acc_lse - L) acc_out + exp(lse - L) out``, ``acc_lse = L``: the softmax over
    the union of both key sets. Rows still without keys (L = -inf) stay 0 / -inf."""
    merged = torch.logaddexp(acc_lse, lse)
    shift = torch.where(torch.isfinite(merged), merged, 0.0)
    acc_out.mul_(torch.exp(acc_lse - shift).unsqueeze(-1)).add_(out * torch.exp(lse - shift).unsqueeze(-1))
    acc_lse.copy_(merged)

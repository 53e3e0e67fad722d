"""``grouped_linear``: one linear layer per expert over rows sorted by expert, with autograd.

``grouped_linear(x [M, K], weights, sizes) -> [M, N]``: rows ``[start_g, start_g + sizes[g])``
of ``x`` go through ``weights[g]`` (``[N, K]``, nn.Linear layout, one tensor per expert so
each stays its own parameter, named by its global expert index). ``sizes`` are host
integers summing to ``M``; a size may be 0. Backends (``backend``):

- ``grouped_mm``: ``torch._grouped_mm`` (CPU in torch 2.13 and CUDA; bf16/fp32; every row
  stride a multiple of 16 bytes);
- ``triton``: ``kernels.grouped_gemm`` (CUDA, or the CPU interpreter under TRITON_INTERPRET=1);
- ``loop``: one ``torch.mm`` per expert (the reference; runs everywhere);
- ``auto``: ``grouped_mm`` where it applies, else ``triton`` where it runs, else ``loop``.

No output element is left unwritten, whatever the sizes: the forward's groups cover
every row, and a weight gradient of an expert with no rows is zeros.

Separable weight gradients (pipeline split backward, ``parallel3d.pipeline.backward_split``):
the backward computes ``dX`` only if the engine will run the node that receives it and each
``dW`` only if the engine will run its weight's node (asked through
``torch._C._will_engine_execute_node``; each operand enters through its own view node,
since the engine cannot be asked about a leaf under ``autograd.grad``). So a ``B`` pass
(``autograd.grad(out, inp)``) runs just the input-gradient GEMM and the deferred ``W``
pass just the weight-gradient GEMMs, and a plain ``backward()`` both.
The stacked ``[G, N, K]`` weight is a view when the weights lie back to back in one storage
(``GroupedExperts`` allocates each of w1 / w3 / w2 so: no copy per GEMM), else a temporary copy of
each GEMM call; never saved.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kernels.runtime import triton_runs_on

BACKENDS = ("auto", "grouped_mm", "triton", "loop")
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def _grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm takes these operands: both feature sizes (K and N) 16-byte aligned,
    one dtype it supports here (CPU: bf16/fp32; CUDA: bf16 on compute capability >= 9.0)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype or x.dtype not in _GROUPED_MM_DTYPES:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
        return False
    return all(d * x.element_size() % 16 == 0 for d in weight.shape)


def resolve_backend(backend: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """The backend that runs this call (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"moe.gemm_backend={backend!r}: allowed {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if _grouped_mm_applies(x, weight):
        return "grouped_mm"
    return "triton" if triton_runs_on(x) else "loop"


def _offsets(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.cumsum(torch.tensor(list(sizes), dtype=torch.int64), 0).to(torch.int32).to(device)


def group_mm(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int], backend: str) -> torch.Tensor:
    """``y[rows_g] = x[rows_g] @ w[g]`` for ``w [G, K, N]`` -> ``[M, N]``."""
    if backend == "grouped_mm":
        if x.shape[0] == 0:
            return x.new_empty((0, w.shape[2]))
        return torch._grouped_mm(x, w, offs=_offsets(sizes, x.device))
    if backend == "triton":
        from kernels.grouped_gemm import grouped_mm  # imports triton only when chosen

        return grouped_mm(x, w, sizes)
    y = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            torch.mm(x[start:start + size], w[g], out=y[start:start + size])
        start += size
    return y


def group_tmm(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int], backend: str) -> torch.Tensor:
    """``out[g] = a[rows_g]^T @ b[rows_g]`` -> ``[G, A, B]`` (zeros for a group with no rows)."""
    if backend == "grouped_mm":
        if a.shape[0] == 0:
            return a.new_zeros((len(sizes), a.shape[1], b.shape[1]))
        return torch._grouped_mm(a.t(), b, offs=_offsets(sizes, a.device))
    if backend == "triton":
        from kernels.grouped_gemm import grouped_tmm

        return grouped_tmm(a, b, sizes)
    out = torch.empty((len(sizes), a.shape[1], b.shape[1]), dtype=a.dtype, device=a.device)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            torch.mm(a[start:start + size].t(), b[start:start + size], out=out[g])
        else:
            out[g].zero_()
        start += size
    return out


def _will_run(node: Any) -> bool:
    """Whether the running backward will execute ``node`` (True when it cannot tell)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return True


def stacked_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[G, N, K]``: a view of the weights' storage when they lie back to back in it, else a copy."""
    w0 = weights[0]
    n = w0.numel()
    adjacent = w0.is_contiguous() and all(
        w.is_contiguous() and w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
        and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
        and w.storage_offset() == w0.storage_offset() + g * n for g, w in enumerate(weights))
    if adjacent:
        return w0.detach().as_strided((len(weights), *w0.shape), (n, *w0.stride()), w0.storage_offset())
    return torch.stack(weights)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, backend, nodes, *weights):  # type: ignore[override]
        ctx.sizes, ctx.backend, ctx.nodes = sizes, backend, nodes
        ctx.save_for_backward(x, *weights)
        stacked = stacked_weights(weights)  # [G, N, K]
        return group_mm(x, stacked.transpose(1, 2), sizes, backend)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        x_node, weight_nodes = ctx.nodes
        grad_x = None
        if ctx.needs_input_grad[0] and _will_run(x_node):
            grad_x = group_mm(grad, stacked_weights(weights), ctx.sizes, ctx.backend)
        needs_w = [ctx.needs_input_grad[4 + i] and _will_run(n) for i, n in enumerate(weight_nodes)]
        grad_w: list[torch.Tensor | None] = [None] * len(weights)
        if any(needs_w):
            stacked = group_tmm(grad, x, ctx.sizes, ctx.backend)  # [G, N, K]
            grad_w = [g if need else None for g, need in zip(stacked.unbind(0), needs_w)]
        return (grad_x, None, None, None, *grad_w)


def _entry(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``t`` through its own view node when it takes a gradient (see the module docstring)."""
    if torch.is_grad_enabled() and t.requires_grad:
        v = t.view_as(t)
        return v, v.grad_fn
    return t, None


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], sizes: Sequence[int],
                   backend: str = "auto") -> torch.Tensor:
    """Per-expert ``F.linear`` over expert-sorted rows; see the module docstring."""
    sizes = [int(s) for s in sizes]
    if len(weights) != len(sizes):
        raise ValueError(f"grouped_linear: {len(weights)} weights for {len(sizes)} groups")
    if sum(sizes) != x.shape[0] or any(s < 0 for s in sizes):
        raise ValueError(f"grouped_linear: group sizes {sizes} must be >= 0 and sum to the {x.shape[0]} rows")
    chosen = resolve_backend(backend, x, weights[0])
    x_in, x_node = _entry(x)
    entered = [_entry(w) for w in weights]
    nodes = (x_node, [n for _, n in entered])
    return _GroupedLinear.apply(x_in.contiguous(), sizes, chosen, nodes, *[w for w, _ in entered])

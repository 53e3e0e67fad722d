"""Fused kernels (Triton) with torch references; models call them through ``kernels.dispatch``.

One module per kernel, each with its Triton kernels, a ``*_reference`` torch function and
the ``torch.autograd.Function`` tying forward and backward together:

- ``kernels.rmsnorm.rms_norm(x, weight, eps=1e-6)``
- ``kernels.layernorm.layer_norm(x, weight, bias, eps=1e-5)``
- ``kernels.rope.apply_rope(q, k, cos, sin)``
- ``kernels.swiglu.swiglu(gate, up)``
- ``kernels.cross_entropy.cross_entropy(logits, targets, ignore_index=-100)`` and the
  vocab-shard pieces (``softmax_stats``, ``cross_entropy_grad``, ``vocab_sharded_cross_entropy``)
- ``kernels.adamw.adamw_step(...)`` / ``adamw_flat_(...)``: in-place AdamW on flat fp32 buffers
- ``kernels.flash_attention.flash_attention(q, k, v, causal=True, document_ids=None)`` and the
  per-block ``flash_attention_forward`` (out + log-sum-exp) / ``flash_attention_backward``; its
  oracle is ``kernels.attention_math`` (used by ``parallel3d.context_parallel``)

``kernels.dispatch`` picks Triton / apex / torch per call from its ``backend`` argument
(``kernels.runtime.resolve_backend``); ``kernels.testing.run_interpreted`` runs code in a
child process where Triton interprets the kernels on the CPU (how the tests run them).
The modules here import triton; importing the package itself does not.
"""

"""A tiny model trained a few steps with fused kernels on vs off gives the same losses.

``fused_kernels=True`` with ``kernels.backend=auto`` runs the Triton kernels of a Llama
(RMSNorm, RoPE, SwiGLU, cross-entropy) in the Triton interpreter, and the fused AdamW
updates the parameters; the reference run uses the torch ops (``fused_kernels=False``) and
``torch.optim.AdamW``. One short interpreted run (the interpreter is slow); LayerNorm, the
GPT norm, is covered op by op in test_kernels_norms/test_kernels_dispatch. On plain CPU (no
interpreter) ``auto`` falls back to the torch ops, so both settings must agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from kernels.testing import run_interpreted

STEPS = 3
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _train(arch: str, fused: bool, fused_optimizer: bool) -> list[float]:
    from kernels.adamw import adamw_step
    from models import build_model, get_config
    from parallel3d.parallel_state import ParallelState

    config = get_config(f"{arch}_tiny", num_layers=2, hidden_size=32, max_seq_len=16, fused_kernels=fused,
                        **({"ffn_hidden_size": 48} if arch == "llama" else {}))
    model = build_model(config, ParallelState.single_process(), seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, config.vocab_size, (2, 13), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in params}
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    losses = []
    for step in range(1, STEPS + 1):  # the same batch each step, so the loss must fall
        loss = model(tokens, labels)
        losses.append(loss.item())
        model.zero_grad(set_to_none=True)
        loss.backward()
        if fused_optimizer:
            for p in params:
                m, v = state[p]
                adamw_step(p.data.view(-1), p.grad.view(-1), m.view(-1), v.view(-1), step=step, **HYPER)
        else:
            opt.step()
    return losses


@pytest.mark.slow
def test_fused_kernels_on_and_off_give_the_same_losses() -> None:
    fused = run_interpreted(_train, "llama", True, True, timeout=300)
    reference = _train("llama", False, False)
    assert len(fused) == STEPS and fused[0] > 1.0
    assert fused[-1] < fused[0]  # it trains
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def test_auto_backend_on_plain_cpu_equals_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _train("gpt", True, False) == _train("gpt", False, False)

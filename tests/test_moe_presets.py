"""Real-size MoE presets against their published parameter counts, and the attention variants they need.

References: the published figures (Mixtral 8x7B: Mistral AI's release, 46.7B total / 12.9B active;
Qwen3-235B-A22B: the model card, 235B / 22B; DeepSeek-V3: the technical report, 671B / 37B, both without
the MTP module) and the model built on the meta device (its parameters counted one by one, independent of
``models.shape``). Tolerances: totals within 0.1% (each published total is rounded to < 0.2%); active
counts within 2%: "37B" for DeepSeek-V3 is 37.55B counting the input embedding and output head, 36.63B
without the input embedding (a lookup); Mixtral 12.88B, Qwen3 22.19B.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from parallel3d.parallel_state import ParallelState

PUBLISHED_B = {"mixtral_8x7b": (46.7, 12.9), "qwen3_235b_a22b": (235.0, 22.0), "deepseek_v3_671b": (671.0, 37.0)}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_real_size_presets_match_published_counts(name):
    cfg = get_config(name)
    total_b, active_b = PUBLISHED_B[name]
    model = build_model(cfg, ParallelState.single_process(device="meta"), device="meta")
    built = sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "meta" for p in model.parameters())
    assert cfg.shape.total_params() == built
    assert abs(built / 1e9 - total_b) / total_b < 1e-3, built
    assert abs(cfg.shape.active_params() / 1e9 - active_b) / active_b < 0.02, cfg.shape.active_params()


def _reference_attention(q, k, v):
    """Causal softmax attention written out in float64: q/k [b, s, H, dq], v [b, s, H, dv]."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    s = q.shape[1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(q.shape[0], s, -1)


def _rope(x, pos_cos, pos_sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = pos_cos[None, :, None], pos_sin[None, :, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("q_lora", [0, 24])
def test_latent_attention_equals_a_written_out_reference(q_lora):
    """MLA of one layer against the DeepSeek-V2 equations computed here from the weights (float64)."""
    cfg = get_config("llama_tiny", num_layers=1, kernel_backend="torch",
                     mla=dict(kv_lora_rank=16, q_lora_rank=q_lora, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=12))
    model = build_model(cfg, ParallelState.single_process(), seed=3, dtype=torch.float64)
    attn = model.layers["0"].attn
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a skipped norm shows
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    lat, H = cfg.spec.blocks[0].attention.latent, cfg.num_heads
    q = (rms(x @ attn.q_down.t(), attn.q_latent_norm.weight) @ attn.q_up.weight.t() if q_lora
         else x @ attn.q.weight.t()).view(2, 10, H, -1)
    ckv = x @ attn.kv_down.t()
    kv = (rms(ckv[..., :16], attn.kv_latent_norm.weight) @ attn.kv_up.weight.t()).view(2, 10, H, -1)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    ang = torch.arange(10, dtype=torch.float64)[:, None] * inv[None]
    q_rope = _rope(q[..., 8:], ang.cos(), ang.sin())
    k_rope = _rope(ckv[..., 16:].view(2, 10, 1, 4), ang.cos(), ang.sin())
    qf = torch.cat([q[..., :8], q_rope], -1)
    kf = torch.cat([kv[..., :8], k_rope.expand(2, 10, H, 4)], -1)
    expected = _reference_attention(qf, kf, kv[..., 8:]) @ attn.out.weight.t()
    from models.blocks import ForwardContext
    from models.llama import rotary_tables
    cos, sin = rotary_tables(10, 4, cfg.rope_base, x.device)
    got = attn(x, ForwardContext(rope=(cos.double(), sin.double()), sample_ids=None, step=0, training=False))
    # The model's rotary tables are float32 (as HF's), the reference's float64: 1e-6, not 1e-12.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_latent_attention_refuses_tensor_parallel_in_one_line():
    from parallel3d.topology import Topology

    cfg = get_config("deepseek_v3_671b")
    topo = Topology(tp=2, pp=1, dp=1)
    with pytest.raises(ValueError, match=r"model.mla with parallel.tp=2, parallel.cp=1: latent attention runs at tp=1"):
        build_model(cfg, ParallelState.without_groups(topo, 0), device="meta")


def test_bad_new_keys_name_the_key():
    with pytest.raises(ValueError, match=r"model.kv_channels=0"):
        get_config("llama_tiny", kv_channels=0)
    with pytest.raises(ValueError, match=r"model.mla.qk_rope_head_dim=3"):
        get_config("llama_tiny", mla=dict(kv_lora_rank=8, qk_rope_head_dim=3))
    with pytest.raises(ValueError, match=r"model.moe.dense_layers=\[7\]"):
        get_config("mixtral_tiny", moe=dict(dense_layers=[7]))
    with pytest.raises(ValueError, match=r"model.mla with model.arch='gpt'"):
        get_config("gpt_tiny", mla=dict(kv_lora_rank=8))

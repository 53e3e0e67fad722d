"""``models.shape`` against the built model and torch's FLOP counter, on generated configs.

References, all independent of the shape module: the parameters ``build_model`` creates
(names, shapes, tp sharding: single-process, and every rank's shard of tp x pp layouts built
from ``ParallelState.without_groups`` on the meta device) and the FLOPs
``torch.utils.flop_counter.FlopCounterMode`` counts in a real forward and backward.
Configs: every registered model (registry and conf/model/*.yaml, GPT-3 175B and Llama 3.1 405B
included, on the meta device) and random small ones (both archs, MHA/GQA/MQA, tied or not,
biases or not, odd vocabularies, odd layer counts).

Attention convention: the counter counts ``scaled_dot_product_attention`` over the full s x s
product whether or not it is causal, so ``attention="full"`` is the convention that equals it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import random

import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from models import build_model, config_names, get_config
from models.config import ARCHS, ModelConfig
from parallel3d.param_meta import is_tied_embedding, tp_split_dim
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.partition import partition_layers
from parallel3d.topology import Topology

CONF_MODELS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "conf", "model", "*.yaml")))


def random_configs(count: int, seed: int) -> list[ModelConfig]:
    """Small configs of every arch with random sizes, head grouping, tying and biases."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kv = rng.choice([1, 2, 4])
        heads = kv * rng.choice([1, 2, 3])
        head_dim = rng.choice([2, 4, 6])  # even: rotary pairs
        out.append(ModelConfig(
            arch=ARCHS[i % len(ARCHS)], num_layers=rng.randint(1, 5), hidden_size=heads * head_dim,
            num_heads=heads, num_kv_heads=rng.choice([kv, None]) if kv == heads else kv,
            ffn_hidden_size=rng.choice([None, 4 * rng.randint(2, 9)]), vocab_size=2 * rng.randint(5, 48) + 1,
            max_seq_len=rng.randint(6, 20), tie_embeddings=rng.random() < 0.5, use_bias=rng.random() < 0.5,
            kernel_backend="torch", name=f"random{i}"))
    return out


RANDOM = random_configs(16, seed=23)


def _conf_model(path: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(path)))


def _built(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """{global name: (local shape, tp split dim)} of a built model or shard."""
    return {getattr(p, "global_name", n): (tuple(p.shape), tp_split_dim(p)) for n, p in model.named_parameters()}


def _expected(tensors, tp: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    return {t.name: (t.local_shape(tp), t.split_dim) for t in tensors}


# ---- parameters: the whole single-process model -------------------------------------------
@functools.cache
def _check_whole_model(cfg: ModelConfig) -> None:
    """Asserts; a config that passed is not built again in this process: every conf/model YAML equals the
    registry's config of its name (a meta build of a huge model costs seconds, and each was built twice
    before session 46). A failing config raises again on every call (``functools.cache`` keeps no exception)."""
    model = build_model(cfg, ParallelState.single_process(device="meta"), device="meta")
    shape = cfg.shape
    assert _built(model) == _expected(shape.tensors(), 1)
    total = sum(p.numel() for p in model.parameters())
    assert shape.total_params() == total
    # Active: a routed expert serves top_k / num_experts of the tokens, every other parameter all of them.
    active = 0.0
    for n, p in model.named_parameters():
        moe = cfg.spec.blocks[int(n.split(".")[1])].moe if ".experts." in n else None
        active += p.numel() * (moe.top_k / moe.num_experts if moe is not None else 1.0)
    assert shape.active_params() == pytest.approx(active, rel=1e-12)
    assert (shape.active_params() < total) == cfg.moe.enabled
    assert sum(layer.params.total for layer in shape.layers) == sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("layers."))


@pytest.mark.parametrize("name", config_names())
def test_registered_models_match_the_built_model(name):
    _check_whole_model(get_config(name))


@pytest.mark.parametrize("path", CONF_MODELS, ids=[os.path.basename(p) for p in CONF_MODELS])
def test_conf_models_match_the_built_model(path):
    _check_whole_model(_conf_model(path))


@pytest.mark.parametrize("cfg", RANDOM, ids=[c.name for c in RANDOM])
def test_random_models_match_the_built_model(cfg):
    _check_whole_model(cfg)


def test_conf_and_registry_cover_the_huge_models():
    names = {_conf_model(p).name for p in CONF_MODELS} | set(config_names())
    assert {"gpt3_175b", "llama31_405b"} <= names


# ---- parameters: every rank's shard of tp x pp layouts ---------------------------------------
def _layouts(cfg: ModelConfig, rng: random.Random) -> list[tuple[int, int]]:
    valid = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3)
             if cfg.kv_heads % tp == 0 and cfg.ffn_size % tp == 0 and pp <= cfg.num_layers]
    return sorted({(1, 1), *rng.sample(valid, min(2, len(valid)))})


def _check_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    shape, topo = cfg.shape, Topology(tp=tp, pp=pp, dp=1)
    ranges = partition_layers(cfg, pp)
    whole = 0
    for stage, (a, b) in enumerate(ranges):
        first, last = stage == 0, stage == pp - 1
        for tp_rank in range(tp):
            pstate = ParallelState.without_groups(topo, topo.rank_of(tp=tp_rank, pp=stage))
            shard = build_model(cfg, pstate, device="meta", layer_range=(a, b))
            assert _built(shard) == _expected(shape.held_tensors(range(a, b), first, last), tp), (tp, pp, stage)
            assert sum(p.numel() for p in shard.parameters()) == shape.held_params(tp, range(a, b), first, last).total
            for p in shard.parameters():
                if is_tied_embedding(p) and not first:
                    continue  # a copy of the first stage's word embedding
                if tp_split_dim(p) is not None or tp_rank == 0:
                    whole += p.numel()
    assert whole == shape.total_params(tp)


@pytest.mark.parametrize("cfg", RANDOM, ids=[c.name for c in RANDOM])
def test_every_rank_shard_matches_the_shape(cfg):
    for tp, pp in _layouts(cfg, random.Random(cfg.name)):
        _check_layout(cfg, tp, pp)


@pytest.mark.parametrize("name,tp,pp", [("gpt_tiny", 4, 2), ("llama_tiny", 2, 4), ("gpt2_124m", 4, 3)])
def test_named_model_shards_match_the_shape(name, tp, pp):
    _check_layout(get_config(name), tp, pp)


# ---- FLOPs against torch's counter ----------------------------------------------------------
FLOP_CONFIGS = [get_config("gpt_tiny", kernel_backend="torch"), get_config("llama_tiny", kernel_backend="torch"),
                *RANDOM[:5], get_config("mixtral_tiny", kernel_backend="torch"),
                get_config("deepseek_tiny", kernel_backend="torch"),
                # heads wider than hidden / heads with per-head q/k norms (Qwen3), and latent attention (MLA)
                get_config("llama_tiny", kernel_backend="torch", kv_channels=24, qk_norm=True, qkv_bias=True),
                get_config("deepseek_tiny", kernel_backend="torch", dropout=0.0,
                           mla=dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=12))]
# The CPU SDPA kernel is not in torch's FLOP registry; map it onto torch's own SDPA formulas (those it
# registers for the GPU flash / efficient / cuDNN kernels).
def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm`` (not in torch's registry): every row of ``a`` meets the one matrix of its
    group, so the multiply-adds are ``a``'s elements times the output width ([N, k] x [G, k, n] and
    the weight gradient's [k, N] x [N, n] alike)."""
    numel = 1
    for d in a_shape:
        numel *= d
    return 2 * numel * out_shape[-1]


# torch's FLOP registry lacks the grouped GEMM of the MoE experts; count it by the formula above.
GROUPED_MM_FORMULA = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
FUSED_SDPA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}


def _count(cfg: ModelConfig, seq: int, *, backward: bool, recompute: str = "none", fused: bool = False) -> int:
    """FLOPs FlopCounterMode counts for one batch of 2 x ``seq`` tokens (forward, or forward + backward).

    Recomputation runs without torch's early stop (which ends a recompute once backward's saved
    tensors are rebuilt, skipping a region's trailing matmul): the convention counts the whole
    recomputed forward (models.shape)."""
    torch.manual_seed(0)
    model = build_model(cfg, ParallelState.single_process(), recompute=recompute)
    x = torch.randint(0, cfg.vocab_size, (2, seq))
    backend = contextlib.nullcontext() if fused else sdpa_kernel(SDPBackend.MATH)
    grad = contextlib.nullcontext() if backward else torch.no_grad()
    counter = FlopCounterMode(display=False,
                              custom_mapping={**GROUPED_MM_FORMULA, **(FUSED_SDPA_FORMULAS if fused else {})})
    with backend, grad, set_checkpoint_early_stop(False), counter as c:
        loss = model(x, x)
        if backward:
            loss.backward()
    return c.get_total_flops()


@pytest.mark.parametrize("cfg", FLOP_CONFIGS, ids=[c.name for c in FLOP_CONFIGS])
def test_flops_equal_the_flop_counter(cfg):
    """Math-path SDPA (its matmuls are what the counter sees): forward, forward + backward, and
    each recompute mode's hardware FLOPs, all under the ``full`` attention convention."""
    seq = min(cfg.max_seq_len - 1, 15)  # any length up to max_seq_len; short keeps the counter cheap
    tokens = 2 * seq
    flops = cfg.shape.flops_per_token(seq, attention="full")
    assert _count(cfg, seq, backward=False) == tokens * flops.forward
    assert _count(cfg, seq, backward=True) == tokens * flops.model == tokens * flops.hardware
    for recompute in ("selective", "full"):
        flops = cfg.shape.flops_per_token(seq, attention="full", recompute=recompute)
        assert _count(cfg, seq, backward=True, recompute=recompute) == tokens * flops.hardware, recompute


@pytest.mark.parametrize("cfg", FLOP_CONFIGS[:2], ids=[c.name for c in FLOP_CONFIGS[:2]])
def test_fused_sdpa_formula_counts_a_recomputed_score_in_backward(cfg):
    """torch's formula for the fused kernels: the forward is the ``full`` convention; its backward
    adds the flash kernel's recomputed QK^T (half the attention forward) to our 2x forward."""
    seq = 16
    tokens, flops = 2 * seq, cfg.shape.flops_per_token(seq, attention="full")
    attention = cfg.shape.layers_forward_flops(seq, "full").attention
    assert _count(cfg, seq, backward=False, fused=True) == tokens * flops.forward
    assert _count(cfg, seq, backward=True, fused=True) == tokens * (flops.model + attention / 2)


@pytest.mark.parametrize("cfg", RANDOM[:4] + [get_config("gpt3_175b"), get_config("llama31_405b")],
                         ids=lambda c: c.name)
def test_causal_convention_halves_only_the_attention_pairs(cfg):
    seq = cfg.max_seq_len
    full = cfg.shape.flops_per_token(seq, attention="full")
    causal = cfg.shape.flops_per_token(seq, attention="causal")
    attention = cfg.shape.layers_forward_flops(seq, "full").attention
    assert attention == 4 * seq * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert full.forward - causal.forward == pytest.approx(attention / 2)
    assert full.model == 3 * full.forward and causal.model == 3 * causal.forward


def test_flop_arguments_are_checked():
    shape = get_config("gpt_tiny").shape
    with pytest.raises(ValueError, match=r"attention='half' is not one of \('causal', 'full'\)"):
        shape.flops_per_token(8, attention="half")
    with pytest.raises(ValueError, match=r"recompute='some' is not one of \('none', 'selective', 'full'\)"):
        shape.flops_per_token(8, recompute="some")
    with pytest.raises(ValueError, match="seq_len=0 must be an integer >= 1"):
        shape.flops_per_token(0)

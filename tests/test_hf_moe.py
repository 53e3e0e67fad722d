"""HF transformers is the reference for the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE): random small
configs generated here, HF models built from them (nothing downloaded), weights perturbed so every
tensor matters. Checked: our model from the HF model gives HF's logits (fp32); our model written as a
checkpoint directory (one tensor per expert, as on the hub) loads in ``from_pretrained`` with our logits;
the ``train.init_from=hf:DIR`` reader (``check_init_from`` + ``from_hf_unit``, unit by unit) takes a
directory transformers saved to exactly the HF model's weights."""

from __future__ import annotations

import json
import random

import pytest
import torch

from models import build_model, get_config
from models.config import ModelConfig
from models.hf import from_hf, from_hf_unit, hf_config, hf_units, to_hf
from models.hf_formats import hf_format
from models.hf_moe import fuse_experts
from models.state import full_state_dict
from parallel3d.parallel_state import ParallelState
from tests.hf_cases import perturb, rel, token_ids

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def random_moe_config(family: str, seed: int) -> ModelConfig:
    """A small config of ``family`` with random sizes, expert counts, top-k and dense layers."""
    rng = random.Random(f"{family}{seed}")
    kv = rng.choice([1, 2])
    heads = kv * rng.choice([1, 2])
    layers, experts = rng.randint(2, 4), rng.choice([4, 6, 8])
    moe = dict(num_experts=experts, top_k=rng.randint(1, 3), normalize_topk=True)
    extra: dict = {}
    ffn = 4 * rng.randint(4, 12)
    if family == "mixtral":
        moe["ffn_hidden_size"] = ffn
    else:
        # expert widths a multiple of 4 floats: transformers' grouped-mm experts need 16-byte strides
        moe.update(ffn_hidden_size=4 * rng.randint(2, 6), normalize_topk=rng.random() < 0.5,
                   dense_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))
        extra["kv_channels"] = rng.choice([None, 6, 10])
    if family == "qwen2_moe":
        moe.update(num_shared_experts=1, shared_ffn_hidden_size=2 * rng.randint(4, 12), shared_expert_gate=True)
        extra["qkv_bias"] = rng.random() < 0.7
    if family == "qwen3_moe":
        extra["qk_norm"] = True
    return get_config("mixtral_tiny", num_layers=layers, hidden_size=8 * heads, num_heads=heads, num_kv_heads=kv,
                      ffn_hidden_size=ffn, vocab_size=rng.randint(40, 90), tie_embeddings=rng.random() < 0.3,
                      kernel_backend="torch", moe=moe, **extra).replace(name=f"{family}{seed}")


CASES = [(f, s) for f in FAMILIES for s in range(3)]


def _hf_model(cfg: ModelConfig, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return perturb(getattr(transformers, hf_format(cfg).architecture)(hf_config(cfg)).eval())


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return token_ids(cfg, 11)


@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_logits_equal_transformers(family, seed):
    cfg = random_moe_config(family, seed)
    assert hf_format(cfg).model_type == family
    hf = _hf_model(cfg, seed)
    ours = from_hf(hf).eval()  # the config read back from HF's own config
    keys = ("num_layers", "hidden_size", "num_heads", "kv_heads", "head_dim", "qk_norm", "tie_embeddings")
    assert all(getattr(ours.config, k) == getattr(cfg, k) for k in keys)
    assert [ours.config.moe.is_moe_layer(i) for i in range(cfg.num_layers)] == [
        cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers)]
    ids = _ids(cfg)
    with torch.no_grad():
        assert rel(ours(ids), hf(ids).logits) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_our_logits(family, tmp_path):
    """Our weights -> checkpoint names in safetensors + config.json -> ``from_pretrained`` (offline)."""
    import transformers
    from safetensors.torch import save_file

    cfg = random_moe_config(family, 7)
    ours = build_model(cfg, ParallelState.single_process(), seed=5).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    state = to_hf(ours)
    assert any(".experts.0." in k for k in state)  # one tensor per expert, as hub checkpoints hold them
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hc = hf_config(cfg)
    hc.architectures = [hf_format(cfg).architecture]
    hc.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(hf).__name__ == hf_format(cfg).architecture
    ids = _ids(cfg)
    with torch.no_grad():
        assert rel(hf(ids).logits, ours(ids)) < 1e-5
    # and back: exactly our tensors
    back = from_hf(hf)
    for key, value in full_state_dict(ours).items():
        assert torch.equal(full_state_dict(back)[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_reader_takes_a_transformers_saved_directory(family, tmp_path):
    from parallel3d.checkpoint_io.hf_init import HFWeights, check_init_from
    from models.hf import expected_hf_shapes, hf_unit_of

    cfg = random_moe_config(family, 11)
    hf = _hf_model(cfg, 2)
    hf.save_pretrained(tmp_path)
    check_init_from(f"hf:{tmp_path}", cfg)
    weights = HFWeights(str(tmp_path))
    keys: dict = {}
    for key in expected_hf_shapes(cfg):
        if not (key == "lm_head.weight" and cfg.tie_embeddings):
            keys.setdefault(hf_unit_of(key), []).append(key)
    reference = full_state_dict(from_hf(hf))
    for unit in hf_units(cfg):
        for name, value in from_hf_unit(weights.read(keys[unit]), cfg, unit).items():
            assert torch.equal(value, reference[name]), name


def test_round_trip_through_a_transformers_module_is_exact():
    cfg = random_moe_config("qwen2_moe", 1)
    ours = build_model(cfg, ParallelState.single_process(), seed=3)
    hf = _hf_model(cfg)
    hf.load_state_dict(fuse_experts(to_hf(ours), hf_format(cfg), cfg.moe.num_experts), strict=True)
    back = full_state_dict(from_hf(hf))
    for key, value in full_state_dict(ours).items():
        assert torch.equal(back[key], value), key


def test_configs_a_family_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="Mixtral has no q/k norms"):
        hf_config(get_config("mixtral_tiny", moe=dict(dense_layers=[0])))
    with pytest.raises(ValueError, match="score_function='sigmoid'"):
        hf_config(get_config("deepseek_tiny"))
    # latent attention is DeepSeek-V3's (tests/test_hf_deepseek.py); a Llama-arch model without it is not
    assert hf_format(get_config("deepseek_v3_671b")).model_type == "deepseek_v3"


def _init_from_hf_on_rank(rank: int, world: int, cfg: ModelConfig, directory: str, reference: dict) -> dict:
    """``train.init_from=hf:DIR``'s loader at tp=``world`` (sequence parallel): each parameter's error
    against its tp slice of the one-process conversion, and the shared experts' held fraction."""
    from parallel3d.checkpoint_io.hf_init import load_hf_weights
    from parallel3d.param_meta import tp_split_dim
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    # etp=1: routed experts whole on each rank (checkpoint pieces do not cut etp slices yet)
    pstate = ParallelState(Topology(tp=world, etp=1))
    model = build_model(cfg, pstate, seed=5, dtype=torch.float32, sequence_parallel=True)
    opt = ZeroOptimizer(model, pstate, zero_stage=1, lr=0.1)
    load_hf_weights(opt, pstate, f"hf:{directory}", cfg)
    errors, held = {}, {}
    for p in model.parameters():
        want, dim = reference[p.global_name], tp_split_dim(p)
        if dim is not None:
            if getattr(p, "unpadded_rows", None) is not None:  # vocabulary rows padded to a multiple of tp: zeros
                want = torch.cat([want, want.new_zeros(p.shape[0] * world - want.shape[0], *want.shape[1:])])
            want = want.narrow(dim, pstate.coord("tp") * p.shape[dim], p.shape[dim])
        errors[p.global_name] = float((p.detach() - want).abs().max()) if p.shape == want.shape else float("inf")
        if ".shared_experts." in p.global_name:
            held[p.global_name] = p.numel() / reference[p.global_name].numel()
    opt.close()
    pstate.destroy()
    return dict(errors=errors, held=held)


@pytest.mark.slow
def test_init_from_hf_fills_tp_split_shared_experts(tmp_path):
    """Qwen2-MoE (one gated shared expert) read at tp=2: the shared expert is split over tp like the dense
    MLP, and every rank's slice is the HF weight's (checkpoint pieces cut the boxes by ``tp_split_dim``)."""
    from tests.harness import run_on_ranks

    seeds = [s for s in range(40) if random_moe_config("qwen2_moe", s).num_heads % 2 == 0
             and random_moe_config("qwen2_moe", s).kv_heads % 2 == 0][:2]
    assert seeds
    for seed in seeds:
        cfg = random_moe_config("qwen2_moe", seed)
        hf = _hf_model(cfg, 3)
        directory = tmp_path / f"qwen2_moe{seed}"
        hf.save_pretrained(directory)
        reference = full_state_dict(from_hf(hf))
        for rank, r in enumerate(run_on_ranks(_init_from_hf_on_rank, 2, cfg, str(directory), reference, timeout=200)):
            bad = {k: v for k, v in r["errors"].items() if v > 0}
            assert not bad, (seed, rank, bad)
            assert r["held"] and all(v == 0.5 for v in r["held"].values()), (seed, rank, r["held"])

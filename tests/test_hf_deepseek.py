"""HF transformers' ``DeepseekV3ForCausalLM`` is the reference for DeepSeek-V3 import and export: random small
configs generated here (latent attention with and without a query latent, interleaved rotary rows, sigmoid
group-limited routing with a random ``e_score_correction_bias``, scaled weights, shared experts, the first k
layers dense), HF models built from them (nothing downloaded), every weight perturbed so a misplaced one shows.
Checked: our model from the HF model gives HF's logits (fp32); our model (random weights and expert bias)
written as a checkpoint directory loads in ``from_pretrained`` with exactly our tensors and our logits; the
``train.init_from=hf:DIR`` reader takes a directory transformers saved; the 671B preset is transformers'
default DeepSeek-V3 config; what transformers' DeepSeek-V3 has and we do not is refused naming the field."""

from __future__ import annotations

import random

import pytest
import torch

from models import build_model, get_config
from models.config import ModelConfig
from models.hf import config_from_hf, from_hf, from_hf_unit, hf_config, hf_units, to_hf
from models.hf_formats import hf_format
from models.hf_moe import unfuse_experts
from models.state import full_state_dict
from parallel3d.parallel_state import ParallelState
from tests.hf_cases import perturb, rel, token_ids

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):  # pragma: no cover
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)


def random_deepseek_config(seed: int) -> ModelConfig:
    """A small DeepSeek-V3-shaped config with random sizes, groups, top-k and dense layers."""
    rng = random.Random(f"deepseek{seed}")
    heads, layers = rng.choice([1, 2, 4]), rng.randint(2, 4)
    groups = rng.choice([1, 2, 4])
    experts = groups * rng.choice([2, 3, 4])
    topk_groups = rng.randint(1, groups)
    moe = dict(num_experts=experts, top_k=rng.randint(1, min(4, topk_groups * experts // groups)),
               ffn_hidden_size=4 * rng.randint(2, 6), num_shared_experts=rng.choice([1, 2]), shared_ffn_hidden_size=None,
               dense_first=rng.randint(0, layers - 1), score_function="sigmoid", normalize_topk=rng.random() < 0.7,
               scaling_factor=rng.choice([1.0, 2.5, round(rng.uniform(0.5, 3), 3)]), num_groups=groups,
               topk_groups=topk_groups, bias_update_rate=0.001, aux_loss_coeff=0.0)
    mla = dict(kv_lora_rank=rng.randint(4, 20), q_lora_rank=rng.choice([0, rng.randint(4, 20)]),
               qk_nope_head_dim=rng.randint(2, 10), qk_rope_head_dim=rng.choice([2, 4, 6, 8]),
               v_head_dim=rng.randint(2, 10))
    return get_config("deepseek_tiny", num_layers=layers, hidden_size=8 * rng.randint(2, 5), num_heads=heads,
                      num_kv_heads=heads, ffn_hidden_size=4 * rng.randint(4, 12), vocab_size=rng.randint(40, 90),
                      tie_embeddings=rng.random() < 0.3, norm_eps=1e-6, rope_base=rng.choice([10000.0, 500.0]),
                      kernel_backend="torch", moe=moe, mla=mla).replace(name=f"deepseek{seed}")


SEEDS = range(4)


def _hf_model(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    # sigmoid scores are in (0, 1): a correction bias of this size changes choices
    return perturb(transformers.DeepseekV3ForCausalLM(hf_config(cfg)).eval(), {"e_score_correction_bias": 0.3})


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return token_ids(cfg, 13)


def _ours_with_buffers(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers()), **full_state_dict(model)}


@pytest.mark.parametrize("seed", SEEDS)
def test_logits_equal_transformers(seed):
    cfg = random_deepseek_config(seed)
    assert hf_format(cfg).model_type == "deepseek_v3"
    hf = _hf_model(cfg, seed)
    ours = from_hf(hf).eval()  # the config read back from HF's own config
    back = ours.config
    assert (back.mla, back.num_layers, back.hidden_size, back.num_heads, back.ffn_size, back.tie_embeddings) == (
        cfg.mla, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.ffn_size, cfg.tie_embeddings)
    keys = ("num_experts", "top_k", "ffn_hidden_size", "num_shared_experts", "dense_first", "normalize_topk",
            "scaling_factor", "num_groups", "topk_groups")
    assert all(getattr(back.moe, k) == getattr(cfg.moe, k) for k in keys)
    ids = _ids(cfg)
    with torch.no_grad():
        assert rel(ours(ids), hf(ids).logits) < 1e-5


def test_export_loads_in_transformers_with_our_tensors_and_logits(tmp_path):
    """Our weights and expert biases -> checkpoint names (one tensor per expert) + config.json -> ``from_pretrained``."""
    from safetensors.torch import save_file

    cfg = random_deepseek_config(7)
    ours = build_model(cfg, ParallelState.single_process(), seed=5).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for _, b in ours.named_buffers():
            b.copy_(0.3 * torch.randn_like(b))
    state = to_hf(ours)
    assert any(".experts.0." in k for k in state) and any(k.endswith("e_score_correction_bias") for k in state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hc = hf_config(cfg)
    hc.architectures = [hf_format(cfg).architecture]
    hc.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    loaded = unfuse_experts({**dict(hf.named_buffers()), **hf.state_dict()}, hf_format(cfg))
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    ids = _ids(cfg)
    with torch.no_grad():
        assert rel(hf(ids).logits, ours(ids)) < 1e-5
    back = _ours_with_buffers(from_hf(hf))
    for key, value in _ours_with_buffers(ours).items():
        assert torch.equal(back[key], value), key


def test_init_from_reader_takes_a_transformers_saved_directory(tmp_path):
    from parallel3d.checkpoint_io.hf_init import HFWeights, check_init_from
    from models.hf import expected_hf_shapes, hf_unit_of

    cfg = random_deepseek_config(11)
    hf = _hf_model(cfg, 2)
    hf.save_pretrained(tmp_path)
    check_init_from(f"hf:{tmp_path}", cfg)
    weights = HFWeights(str(tmp_path))
    keys: dict = {}
    for key in expected_hf_shapes(cfg):
        if not (key == "lm_head.weight" and cfg.tie_embeddings):
            keys.setdefault(hf_unit_of(key), []).append(key)
    reference = _ours_with_buffers(from_hf(hf))
    seen = set()
    for unit in hf_units(cfg):
        for name, value in from_hf_unit(weights.read(keys[unit]), cfg, unit).items():
            assert torch.equal(value, reference[name]), name
            seen.add(name)
    assert seen == set(reference)


def test_671b_preset_is_transformers_default_deepseek_v3():
    """transformers' ``DeepseekV3Config()`` defaults are DeepSeek-V3 671B: our preset must write the same."""
    ours, theirs = hf_config(get_config("deepseek_v3_671b")), transformers.DeepseekV3Config()
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
              "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
              "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
              "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings", "rope_interleave", "max_position_embeddings")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    back, preset = config_from_hf(theirs).shape, get_config("deepseek_v3_671b").shape
    assert [(t.name, t.shape) for t in back.tensors()] == [(t.name, t.shape) for t in preset.tensors()]
    assert abs(back.total_params() / 671e9 - 1) < 0.001  # the published 671B (the MTP module not counted)


def _hf_cfg(**changes):
    hc = hf_config(random_deepseek_config(0))
    for key, value in changes.items():
        setattr(hc, key, value)
    return hc


@pytest.mark.parametrize("changes,field", [
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(num_key_value_heads=99), "num_key_value_heads"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type='yarn'"),
])
def test_import_refuses_what_we_do_not_model(changes, field):
    with pytest.raises(ValueError, match=field) as info:
        config_from_hf(_hf_cfg(**changes))
    assert "\n" not in str(info.value)


def test_export_refuses_what_deepseek_v3_cannot_hold():
    cfg = random_deepseek_config(1)
    with pytest.raises(ValueError, match="model.moe.dense_first"):
        hf_config(cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "dense_every": 2})))
    with pytest.raises(ValueError, match="model.norm_eps"):
        hf_config(cfg.replace(norm_eps=1e-5))
    with pytest.raises(ValueError, match="score_function='softmax'"):
        hf_config(cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "score_function": "softmax"})))


def test_nonzero_correction_bias_needs_an_expert_bias():
    cfg = random_deepseek_config(3)
    hf = _hf_model(cfg)
    no_bias = cfg.replace(moe=cfg.moe.__class__(**{**cfg.moe.__dict__, "bias_update_rate": 0.0}))
    with pytest.raises(ValueError, match="bias_update_rate"):
        from_hf(hf, config=no_bias)


def _init_from_hf_on_rank(rank: int, world: int, cfg: ModelConfig, directory: str) -> dict:
    """``train.init_from=hf:DIR``'s loader at ep=``world``: this rank's parameters and buffers by global name."""
    from parallel3d.checkpoint_io.hf_init import load_hf_weights
    from parallel3d.checkpoint_io.pieces import BUFFER_PREFIX, buffer_pieces
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    pstate = ParallelState(Topology(dp=world, ep=world))
    model = build_model(cfg, pstate, seed=5, dtype=torch.float32)
    opt = ZeroOptimizer(model, pstate, zero_stage=1, lr=0.1)
    load_hf_weights(opt, pstate, f"hf:{directory}", cfg)
    params = {p.global_name: p.detach().clone() for p in model.parameters()}
    buffers = {piece.key.removeprefix(BUFFER_PREFIX): piece.data.clone() for piece in buffer_pieces(opt)}
    opt.close()
    pstate.destroy()
    return dict(params=params, buffers=buffers)


@pytest.mark.parametrize("world", [1, 2])
def test_init_from_hf_loads_parameters_and_the_correction_bias(tmp_path, world):
    """``load_hf_weights`` (what ``train.init_from=hf:DIR`` runs) fills every parameter and the router's
    ``expert_bias`` from ``e_score_correction_bias``, at ep 1 and 2, equal to the one-process conversion."""
    from tests.harness import run_on_ranks

    cfg = random_deepseek_config(5)
    if cfg.moe.num_experts % world:
        cfg = random_deepseek_config(6)
    hf = _hf_model(cfg, 4)
    hf.save_pretrained(tmp_path)
    reference = _ours_with_buffers(from_hf(hf))
    biases = [k for k in reference if k.endswith("router.expert_bias")]
    assert biases and all(reference[k].abs().max() > 0 for k in biases)
    for r in run_on_ranks(_init_from_hf_on_rank, world, cfg, str(tmp_path), timeout=200):
        for name, value in r["params"].items():
            assert torch.equal(value, reference[name]), name
        assert set(biases) <= set(r["buffers"])
        for name in biases:
            assert torch.equal(r["buffers"][name], reference[name]), name

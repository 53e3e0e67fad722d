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

    # etp=1: routed experts whole on each rank (etp slices: test_hf_import_export_on_the_expert_grid)
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


# ---- the expert grid: HF import/export at ep > 1 and etp != tp, on real gloo ranks -------------------------
# (tp, pp, dp, ep, etp) of the two layouts one rank-pool run holds: the in-process API (``from_hf`` / ``to_hf``
# with a ParallelState) at ep=2, etp=1 != tp=2, and ``train.init_from=hf:DIR``'s loader at pp=2 (stage chunks)
# whose checkpoint the exporter turns back into a transformers directory.
API_LAYOUT = dict(tp=2, pp=1, dp=2, ep=2, etp=1)
INIT_LAYOUT = dict(tp=2, pp=2, dp=1, ep=2, etp=1)
EXTENDED_LAYOUTS = [(dict(tp=1, pp=1, dp=4, ep=2, etp=2), dict(tp=1, pp=2, dp=2, ep=1, etp=2)),  # etp > tp
                    (dict(tp=2, pp=1, dp=2, ep=4, etp=1), dict(tp=1, pp=1, dp=4, ep=2, etp=2))]


def _grid_case() -> tuple[ModelConfig, torch.nn.Module]:
    """A Qwen2-MoE config (shared expert split over tp, dense and MoE layers) that tp=2 and ep=4 can hold."""
    for seed in range(100):
        cfg = random_moe_config("qwen2_moe", seed)
        if (cfg.num_heads % 2 == 0 and cfg.kv_heads % 2 == 0 and cfg.moe.num_experts % 4 == 0
                and cfg.num_layers >= 2 and cfg.moe.ffn_hidden_size % 2 == 0
                and any(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers))):
            return cfg, _hf_model(cfg, 6)
    raise AssertionError("no qwen2_moe seed fits the layouts")


def _expert_grid_on_rank(rank: int, world: int, cfg: ModelConfig, hf_state: dict, ids: torch.Tensor,
                         directory: str, root: str, api: dict, init: dict) -> dict:
    """``from_hf``/``to_hf`` at ``api`` (logits, loss, the exported dict); then ``load_hf_weights`` at ``init``
    in pipeline-stage chunks, saved as a checkpoint under ``root`` as the trainer saves it."""
    from parallel3d.checkpoint_io.hf_init import load_hf_weights
    from parallel3d.checkpoint_io.resume import save_request
    from parallel3d.checkpoint_io.writer import CheckpointWriter
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.tensor_parallel.mappings import gather_last_dim
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    ps = ParallelState(Topology(**api))
    model = from_hf(hf_state, cfg, pstate=ps, dtype=torch.float32, sequence_parallel=api["tp"] > 1).eval()
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        logits = gather_last_dim(model(ids), ps)[..., : cfg.vocab_size]
        loss = model(ids, labels=labels)
    exported = to_hf(model)
    ps.destroy()

    ps = ParallelState(Topology(**init))
    ranges = partition_layers(cfg, init["pp"], 1, None)
    chunks = [build_model(cfg, ps, seed=5, layer_range=r, pre_process=r[0] == 0, post_process=r[1] == cfg.num_layers,
                          dtype=torch.float32, sequence_parallel=init["tp"] > 1) for r in stage_layer_ranges(ranges, init["pp"], ps.coord("pp"))]
    stages = [full_state_dict(from_hf(hf_state, cfg, pstate=ps, layer_range=r, pre_process=r[0] == 0,
                                      post_process=r[1] == cfg.num_layers, dtype=torch.float32,
                                      sequence_parallel=init["tp"] > 1))
              for r in stage_layer_ranges(ranges, init["pp"], ps.coord("pp"))]
    opt = ZeroOptimizer(chunks, ps, zero_stage=1, lr=0.1)
    load_hf_weights(opt, ps, f"hf:{directory}", cfg)
    writer = CheckpointWriter(root, ps, keep_last=1, async_save=False, timeout_s=120)
    writer.save(0, *save_request(opt, ps, {}, cfg, init, "fp32", {}))
    saved = writer.close()
    opt.close()
    ps.destroy()
    return dict(logits=logits, loss=loss, exported=exported, saved=saved, stages=stages)


def _check_expert_grid(tmp_path, api: dict, init: dict) -> None:
    from safetensors.torch import load_file

    from parallel3d.checkpoint_io.hf_export import export_hf
    from tests.harness import run_on_ranks

    cfg, hf = _grid_case()
    hf.save_pretrained(tmp_path / "hf")
    ids = token_ids(cfg, 12)  # sequence parallel: a multiple of tp
    labels = torch.roll(ids, -1, dims=1)
    one = from_hf(hf).eval()  # the one-process conversion is the reference
    with torch.no_grad():
        ref_logits, ref_loss = one(ids), one(ids, labels=labels)
        assert rel(ref_logits, hf(ids).logits) < 1e-5
    reference, ours = to_hf(one), full_state_dict(one)
    assert any(".experts.3." in k for k in reference)
    results = run_on_ranks(_expert_grid_on_rank, 4, cfg, hf.state_dict(), ids, str(tmp_path / "hf"),
                           str(tmp_path / "run" / "checkpoints"), api, init, timeout=300)
    for rank, r in enumerate(results):
        assert rel(r["logits"], ref_logits) < 1e-5, rank
        assert abs(float(r["loss"]) - float(ref_loss)) < 1e-5 * abs(float(ref_loss)), rank
        assert r["exported"].keys() == reference.keys(), rank  # every rank gets every expert, by global index
        for key, value in reference.items():
            assert torch.equal(r["exported"][key], value), (rank, key)
        assert r["saved"] == [(0, True)], rank
        for stage in r["stages"]:  # from_hf of a pipeline stage's chunk: its tensors, every expert whole
            assert stage and all(torch.equal(value, ours[key]) for key, value in stage.items()), rank
    assert set().union(*(stage.keys() for r in results for stage in r["stages"])) == ours.keys()
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"), dtype="fp32", with_tokenizer=False)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    if cfg.tie_embeddings:
        reference.pop("lm_head.weight")
    assert written.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(written[key], value), key


@pytest.mark.slow
def test_hf_import_export_on_the_expert_grid(tmp_path):
    """Qwen2-MoE on four gloo ranks. ``from_hf(..., pstate)`` at tp=2, ep=2, etp=1 gives the one-process
    model's logits and loss (and HF's), and ``to_hf`` there returns the whole HF dict on every rank
    (experts of the other ep rank included, whole); ``load_hf_weights`` (``train.init_from=hf:DIR``) at
    tp=2, pp=2, ep=2, etp=1 then a checkpoint then ``export_hf`` gives back exactly the HF tensors; and
    ``from_hf`` of each pipeline stage's chunk there holds the one-process model's tensors of that stage."""
    _check_expert_grid(tmp_path, API_LAYOUT, INIT_LAYOUT)


@pytest.mark.extended
@pytest.mark.parametrize("api,init", EXTENDED_LAYOUTS, ids=["etp-above-tp", "ep4-and-ep1"])
def test_hf_import_export_on_other_expert_grids(tmp_path, api, init):
    _check_expert_grid(tmp_path, api, init)

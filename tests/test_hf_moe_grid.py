"""HF import and export of every MoE family on generated multi-rank expert grids (real gloo ranks).

Cases are (family, layout, draw): Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (where the installed
transformers has it) x ep=4, etp != tp (below and above), pp=2 with a first stage holding no MoE layer
(where the family has dense layers), and experts at ZeRO-3 under dense ZeRO-1. Each case draws a random
small config of its family that the layout can hold, builds the transformers model (nothing downloaded,
every weight and DeepSeek's ``e_score_correction_bias`` perturbed) and saves it. Checked, against
transformers: our one-process model from it gives HF's logits; on four ranks, what ``train.init_from=hf:DIR``
runs (``build_chunks``'s chunks, ``ZeroOptimizer`` at the layout's stages, ``load_hf_weights``, then the
trainer's checkpoint save) gives HF's logits at the layout (without pp), and ``python -m parallel3d.export
RUN --hf OUT`` then writes exactly the HF checkpoint's tensors (bit for bit, one tensor per expert, by
global expert index), ``from_pretrained(OUT)`` giving the original model's logits; ``--dtype bf16`` writes
exactly what transformers' own bf16 ``save_pretrained`` writes (the tensors it keeps in fp32 included).
The CI sample is one case per family covering the four layouts in one rank-pool run; the whole product
(two generated configs per case) is ``extended``."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from models.config import ModelConfig
from models.hf import expected_hf_shapes, from_hf
from models.hf_formats import hf_format
from models.hf_moe import unfuse_experts
from tests.hf_cases import perturb, rel, token_ids
from tests.test_hf_moe import random_moe_config

HAS_DEEPSEEK = hasattr(transformers, "DeepseekV3ForCausalLM")
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe") + (("deepseek_v3",) if HAS_DEEPSEEK else ())
WORLD = 4

# name -> (topology on WORLD ranks, dense ZeRO stage, expert ZeRO stage)
LAYOUTS = {
    "ep4": (dict(tp=1, pp=1, dp=4, ep=4, etp=1), 1, None),
    "etp-below-tp": (dict(tp=2, pp=1, dp=2, ep=2, etp=1), 2, None),
    "etp-above-tp": (dict(tp=1, pp=1, dp=4, ep=2, etp=2), 1, None),
    "pp-dense-stage": (dict(tp=1, pp=2, dp=2, ep=2, etp=1), 1, None),
    "expert-zero3": (dict(tp=1, pp=1, dp=4, ep=2, etp=1), 1, 3),
}
# one case per family in CI, the four issue-25 layouts among them (Mixtral has no dense layer for the pp case)
CI_CASES = [("mixtral", "expert-zero3", 0), ("qwen2_moe", "etp-below-tp", 0), ("qwen3_moe", "pp-dense-stage", 0),
            ("deepseek_v3", "ep4", 0) if HAS_DEEPSEEK else ("qwen2_moe", "ep4", 0)]
# DeepSeek-V3's latent attention runs at tp=1 (models.mla): its etp != tp case is etp-above-tp
# extended: every (family, layout) the family can hold, two generated configs each
ALL_CASES = [(f, l, d) for f in FAMILIES for l in LAYOUTS for d in (0, 1)
             if not (f == "deepseek_v3" and LAYOUTS[l][0]["tp"] > 1)]


def _random_config(family: str, seed: int) -> ModelConfig:
    if family == "deepseek_v3":
        from tests.test_hf_deepseek import random_deepseek_config

        return random_deepseek_config(seed)
    return random_moe_config(family, seed)


def _first_stage_layers(cfg: ModelConfig, pp: int) -> range:
    from parallel3d.pipeline.partition import partition_layers

    a, b = partition_layers(cfg, pp)[0]
    return range(a, b)


def _fits(cfg: ModelConfig, family: str, layout: str) -> bool:
    """Whether the layout can hold ``cfg`` and shows what it is meant to show."""
    topo, _, _ = LAYOUTS[layout]
    tp, ep, etp, pp = topo["tp"], topo["ep"], topo["etp"], topo["pp"]
    moe_layers = [i for i in range(cfg.num_layers) if cfg.moe.is_moe_layer(i)]
    if not moe_layers or cfg.moe.num_experts % ep or cfg.moe.ffn_hidden_size % etp:
        return False
    if cfg.num_heads % tp or cfg.kv_heads % tp or cfg.ffn_size % tp:
        return False
    if cfg.moe.num_shared_experts and (cfg.moe.shared_ffn_hidden_size or cfg.moe.ffn_hidden_size) % tp:
        return False
    if pp > 1:
        if cfg.num_layers < pp:
            return False
        first_dense = not any(cfg.moe.is_moe_layer(i) for i in _first_stage_layers(cfg, pp))
        # the pp case is about a stage without MoE layers wherever the family has dense layers
        if family != "mixtral" and not first_dense:
            return False
    return True


def grid_case(family: str, layout: str, draw: int = 0) -> ModelConfig:
    """The ``draw``-th generated config of ``family`` (seeds in a fixed order per case) that ``layout`` holds."""
    rng = random.Random(f"{family}/{layout}")
    fitting = (cfg for cfg in map(lambda seed: _random_config(family, seed), rng.sample(range(1000), 300))
               if _fits(cfg, family, layout))
    for k, cfg in enumerate(fitting):
        if k == draw:
            return cfg
    raise AssertionError(f"no {family} config fits {layout} (draw {draw})")


def _hf_model(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = getattr(transformers, hf_format(cfg).architecture)(_hf_config(cfg)).eval()
    # sigmoid scores are in (0, 1): a correction bias of this size changes DeepSeek's choices
    return perturb(hf, {"e_score_correction_bias": 0.3})


def _hf_config(cfg: ModelConfig):
    from models.hf import hf_config

    return hf_config(cfg)


def _import_save_on_rank(rank: int, world: int, cases: list) -> list[dict]:
    """Per case ``(cfg, topology, zero_stage, expert_zero_stage, hf_dir, run_dir)``: the trainer's chunks and
    optimizer at the layout, ``load_hf_weights`` (``train.init_from=hf:DIR``), the trainer's step-0 save."""
    from models import build_model
    from parallel3d.checkpoint_io.hf_init import load_hf_weights
    from parallel3d.checkpoint_io.resume import save_request
    from parallel3d.checkpoint_io.writer import CheckpointWriter
    from parallel3d.parallel_state import ParallelState
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.tensor_parallel.mappings import gather_last_dim
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    out = []
    for cfg, topo, zero_stage, expert_zero_stage, hf_dir, run_dir, ids in cases:
        ps = ParallelState(Topology(**topo))
        ranges = partition_layers(cfg, topo["pp"])
        mine = stage_layer_ranges(ranges, topo["pp"], ps.coord("pp"))
        chunks = [build_model(cfg, ps, seed=5, layer_range=r, pre_process=r[0] == 0,
                              post_process=r[1] == cfg.num_layers, dtype=torch.float32,
                              sequence_parallel=topo["tp"] > 1) for r in mine]
        opt = ZeroOptimizer(chunks, ps, zero_stage=zero_stage, expert_zero_stage=expert_zero_stage, lr=0.1)
        load_hf_weights(opt, ps, f"hf:{hf_dir}", cfg)
        logits = None
        if topo["pp"] == 1:  # the whole model on every rank: its logits at the layout
            with torch.no_grad():
                logits = gather_last_dim(chunks[0].eval()(ids), ps)[..., : cfg.vocab_size]
        writer = CheckpointWriter(f"{run_dir}/checkpoints", ps, keep_last=1, async_save=False, timeout_s=120)
        writer.save(0, *save_request(opt, ps, {"step": 0} if ps.is_logging_rank() else None, cfg,
                                     {**topo, "zero_stage": zero_stage}, "fp32", {}))
        saved = writer.close()
        moe_layers = [i for a, b in mine for i in range(a, b) if cfg.moe.is_moe_layer(i)]
        opt.close()
        ps.destroy()
        out.append(dict(saved=saved, moe_layers=moe_layers, logits=logits))
    return out


def _check_cases(tmp_path, cases: list[tuple[str, str]]) -> None:
    from safetensors.torch import load_file

    from parallel3d.export import main as export_main
    from tests.harness import run_on_ranks

    prepared, jobs = [], []
    for i, (family, layout, draw) in enumerate(cases):
        cfg = grid_case(family, layout, draw)
        assert hf_format(cfg).model_type == family
        hf = _hf_model(cfg, 10 + i)
        ids = token_ids(cfg, 12)  # sequence parallel: a multiple of tp
        with torch.no_grad():
            hf_logits = hf(ids).logits
            assert rel(from_hf(hf).eval()(ids), hf_logits) < 1e-5, (family, layout, cfg.name)
        hf_dir, run_dir = tmp_path / f"{i}-hf", tmp_path / f"{i}-run"
        hf.save_pretrained(hf_dir)
        # the checkpoint's tensors (one per expert) that transformers saved, buffers included
        original = unfuse_experts({**dict(hf.named_buffers()), **hf.state_dict()}, hf_format(cfg))
        prepared.append((family, layout, cfg, ids, hf_logits, original, run_dir))
        topo, zero_stage, expert_zero_stage = LAYOUTS[layout]
        jobs.append((cfg, topo, zero_stage, expert_zero_stage, str(hf_dir), str(run_dir), ids))
    results = run_on_ranks(_import_save_on_rank, WORLD, jobs, timeout=300)

    for k, (family, layout, cfg, ids, hf_logits, original, run_dir) in enumerate(prepared):
        case = (family, layout, cfg.name)
        assert all(r[k]["saved"] == [(0, True)] for r in results), case
        for rank, r in enumerate(results):
            assert (r[k]["logits"] is not None) == (LAYOUTS[layout][0]["pp"] == 1), (case, rank)
            if r[k]["logits"] is not None:
                assert rel(r[k]["logits"], hf_logits) < 1e-5, (case, rank)
        if layout == "pp-dense-stage" and family != "mixtral":
            assert any(not r[k]["moe_layers"] for r in results) and any(r[k]["moe_layers"] for r in results), case
        out = run_dir / "hf"
        assert export_main([str(run_dir), "--hf", str(out), "--dtype", "fp32", "--no-tokenizer"]) == 0, case
        written = load_file(str(out / "model.safetensors"))
        want = set(expected_hf_shapes(cfg)) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
        assert set(written) == want, (case, sorted(set(written) ^ want)[:4])
        bad = [key for key in sorted(want) if not torch.equal(written[key], original[key])]
        assert not bad, (case, bad[:4])
        back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        with torch.no_grad():
            assert torch.equal(back(ids).logits, hf_logits), case
        # bf16: transformers' own bf16 save of the HF model is the reference (dtypes included: it keeps
        # DeepSeek-V3's router weight and correction bias in fp32)
        out16, theirs16 = run_dir / "hf-bf16", run_dir / "theirs-bf16"
        assert export_main([str(run_dir), "--hf", str(out16), "--dtype", "bf16", "--no-tokenizer"]) == 0, case
        transformers.AutoModelForCausalLM.from_pretrained(run_dir.parent / f"{k}-hf", dtype=torch.bfloat16,
                                                          local_files_only=True).save_pretrained(theirs16)
        ours16, want16 = load_file(str(out16 / "model.safetensors")), load_file(str(theirs16 / "model.safetensors"))
        assert ours16.keys() == want16.keys(), (case, sorted(ours16.keys() ^ want16.keys())[:4])
        bad = [key for key in sorted(want16) if ours16[key].dtype != want16[key].dtype
               or not torch.equal(ours16[key], want16[key])]
        assert not bad, (case, bad[:4])


@pytest.mark.slow
def test_every_family_imports_and_exports_on_the_expert_grid(tmp_path):
    """One case per family, the CI layouts among them: ep4, etp < tp, pp with a stage without MoE, expert ZeRO-3."""
    assert {l for _, l, _ in CI_CASES} >= {"etp-below-tp", "pp-dense-stage", "expert-zero3", "ep4"}
    _check_cases(tmp_path, CI_CASES)


@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_on_every_generated_layout(tmp_path, family):
    _check_cases(tmp_path, [c for c in ALL_CASES if c[0] == family and c not in CI_CASES])

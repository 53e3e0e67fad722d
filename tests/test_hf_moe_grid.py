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
Context parallel (cp=2) layouts fold ep over cp, cp x dp and tp x cp (sequence parallel); each cp case
draws its ``parallel.cp_comm`` variant (every variant, and both a2a sizes of a2a+p2p, occur across the
product) and each rank runs its load-balanced share (rank r: chunks r and 2cp-1-r, split here, not by the
library): the shares put back at those positions give HF's logits. DeepSeek-V3's latent attention refuses
cp (``models.mla``): before the spawn (``config.resolve``) and on the ranks, in one line naming
``parallel.cp``. Pipeline layouts run the engine's forward path (``pipeline.forward_only.ForwardOnlyRunner``,
the evaluator's): its loss with every label but one masked is that token's loss, equal to the cross entropy
of HF's logits (torch's op) at every position, and unmasked to transformers' own ``labels=`` loss.
The CI sample is one case per family covering the four layouts plus one cp case in one rank-pool run; the
whole product (two generated configs per case) is ``extended``."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import transformers

from models.config import ModelConfig
from models.hf import expected_hf_shapes, from_hf
from models.hf_formats import hf_format
from models.hf_moe import unfuse_experts
from parallel3d.context_parallel.attention import CP_COMM_VARIANTS
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.option_checks import ConfigError
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
    "cp2-ep2": (dict(tp=1, cp=2, pp=1, dp=2, ep=2, etp=1), 1, None),  # the ep group is the cp group
    "cp2-ep4": (dict(tp=1, cp=2, pp=1, dp=2, ep=4, etp=1), 1, None),  # ep folded over cp x dp
    "cp2-tp2-ep4": (dict(tp=2, cp=2, pp=1, dp=1, ep=4, etp=1), 2, None),  # ep over tp x cp, sequence parallel
}
SEQ = 16  # tokens per row: 2 * cp * tp chunks of two
CP_LAYOUTS = tuple(name for name, (topo, _, _) in LAYOUTS.items() if topo.get("cp", 1) > 1)
# (parallel.cp_comm, parallel.cp_a2a_size): a2a+p2p at cp=2 either all-to-all only or ring only
CP_VARIANTS = tuple((c, a) for c in CP_COMM_VARIANTS for a in ((1, 2) if c == "a2a+p2p" else (None,)))
# the families whose attention runs at cp > 1 (DeepSeek-V3's latent attention refuses it: test below)
CP_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
_CP_CASES = [(f, l, d) for f in CP_FAMILIES for l in CP_LAYOUTS for d in (0, 1)]
# one case per family in CI, the four issue-25 layouts among them (Mixtral has no dense layer for the pp case)
# and one cp case: ep folded over cp x dp, on the default ring (p2p)
CI_CASES = [("mixtral", "expert-zero3", 0), ("qwen2_moe", "etp-below-tp", 0), ("qwen3_moe", "pp-dense-stage", 0),
            ("deepseek_v3", "ep4", 0) if HAS_DEEPSEEK else ("qwen2_moe", "ep4", 0), ("qwen3_moe", "cp2-ep4", 1)]
# DeepSeek-V3's latent attention runs at tp=1, cp=1 (models.mla): its etp != tp case is etp-above-tp
# extended: every (family, layout) the family can hold, two generated configs each
ALL_CASES = [(f, l, d) for f in FAMILIES for l in LAYOUTS for d in (0, 1)
             if not (f == "deepseek_v3" and (LAYOUTS[l][0]["tp"] > 1 or l in CP_LAYOUTS))]
# DeepSeek-V3 at cp=2 (tp=1): every rank refuses to build the latent attention
REFUSED_CASES = [("deepseek_v3", l, 0) for l in CP_LAYOUTS if HAS_DEEPSEEK and LAYOUTS[l][0]["tp"] == 1]


def cp_variant(family: str, layout: str, draw: int) -> tuple[str, int | None]:
    """The case's (cp_comm, cp_a2a_size): the cp cases take the variants in turn (p2p at cp=1)."""
    if (family, layout, draw) not in _CP_CASES:  # not a cp layout, or one the family refuses
        return "p2p", None
    return CP_VARIANTS[_CP_CASES.index((family, layout, draw)) % len(CP_VARIANTS)]


def _random_config(family: str, seed: int) -> ModelConfig:
    if family == "deepseek_v3":
        from tests.test_hf_deepseek import random_deepseek_config

        return random_deepseek_config(seed)
    return random_moe_config(family, seed)


def _first_stage_layers(cfg: ModelConfig, pp: int) -> range:
    from parallel3d.pipeline.partition import partition_layers

    a, b = partition_layers(cfg, pp)[0]
    return range(a, b)


def cp_share_positions(seq: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions of ``cp_rank``'s tokens under the causal load balance: chunks r and 2cp-1-r of 2cp."""
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (cp_rank, 2 * cp - 1 - cp_rank)])


def _fits(cfg: ModelConfig, family: str, layout: str, draw: int = 0) -> bool:
    """Whether the layout can hold ``cfg`` and shows what it is meant to show."""
    topo, _, _ = LAYOUTS[layout]
    tp, ep, etp, pp = topo["tp"], topo["ep"], topo["etp"], topo["pp"]
    if layout in CP_LAYOUTS:
        comm, a2a = cp_variant(family, layout, draw)
        try:  # the all-to-all variants need heads the a2a group can split
            ContextParallelOptions(comm, a2a).check_layout(cp=topo["cp"], tp=tp, seq_len=SEQ, num_heads=cfg.num_heads,
                                                           num_kv_heads=cfg.kv_heads, sequence_parallel=tp > 1)
        except ConfigError:
            return False
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
               if _fits(cfg, family, layout, draw))
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


def _pipeline_token_losses(chunks: list, ps, cfg: ModelConfig, topo: dict, ids: torch.Tensor):
    """The engine's forward path at a pp layout (``ForwardOnlyRunner``, what ``Evaluator`` runs): the batch's
    mean loss, and ``[b, s-1]`` per-token losses, each from a run whose labels mask every other token
    (last stage; None elsewhere)."""
    from parallel3d.pipeline.forward_only import ForwardOnlyRunner

    b, s = ids.shape
    runner = ForwardOnlyRunner(chunks, ps, num_microbatches=1, micro_batch_size=b, seq_len=s,
                               hidden_size=cfg.hidden_size, sequence_parallel=topo["tp"] > 1)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]

    def run(lab: torch.Tensor) -> float | None:
        return runner.run([{"input_ids": ids, "labels": lab, "sample_ids": torch.arange(b)}])

    mean = run(labels)
    per_token = torch.zeros(b, s - 1, dtype=torch.float64)
    for row in range(b):
        for t in range(s - 1):  # collective: every stage runs every token's step
            one = torch.full_like(ids, -100)
            one[row, t] = labels[row, t]
            loss = run(one)
            if loss is not None:
                per_token[row, t] = loss
    return (mean, per_token) if mean is not None else (None, None)


def _import_save_on_rank(rank: int, world: int, cases: list) -> list[dict]:
    """Per case ``(cfg, topology, zero_stage, expert_zero_stage, hf_dir, run_dir, ids, (cp_comm, a2a))``: the
    trainer's chunks (one ``ContextParallelAttention`` for all, as ``build_chunks``) and optimizer at the layout,
    ``load_hf_weights`` (``train.init_from=hf:DIR``), the trainer's step-0 save; the logits of this rank's
    share (without pp) or the pipeline's per-token losses (pp)."""
    from models import build_model
    from parallel3d.checkpoint_io.hf_init import load_hf_weights
    from parallel3d.checkpoint_io.resume import save_request
    from parallel3d.checkpoint_io.writer import CheckpointWriter
    from parallel3d.context_parallel.model_attention import ContextParallelAttention
    from parallel3d.parallel_state import ParallelState
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.tensor_parallel.mappings import gather_last_dim
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    out = []
    for cfg, topo, zero_stage, expert_zero_stage, hf_dir, run_dir, ids, (cp_comm, a2a) in cases:
        ps = ParallelState(Topology(**topo))
        ranges = partition_layers(cfg, topo["pp"])
        mine = stage_layer_ranges(ranges, topo["pp"], ps.coord("pp"))
        cp_attention = ContextParallelAttention.build(ps, ContextParallelOptions(cp_comm, a2a))
        try:
            chunks = [build_model(cfg, ps, seed=5, layer_range=r, pre_process=r[0] == 0,
                                  post_process=r[1] == cfg.num_layers, dtype=torch.float32,
                                  sequence_parallel=topo["tp"] > 1, context_parallel=cp_attention) for r in mine]
        except ValueError as exc:  # a layout the model refuses (DeepSeek-V3's latent attention at cp > 1)
            ps.destroy()
            out.append(dict(refused=str(exc)))
            continue
        opt = ZeroOptimizer(chunks, ps, zero_stage=zero_stage, expert_zero_stage=expert_zero_stage, lr=0.1)
        load_hf_weights(opt, ps, f"hf:{hf_dir}", cfg)
        logits, positions, mean_loss, token_losses = None, None, None, None
        if topo["pp"] == 1:  # the whole model on every rank: the logits of its share at the layout
            cp, cp_rank = ps.size("cp"), ps.coord("cp")
            positions = cp_share_positions(ids.shape[1], cp, cp_rank) if cp > 1 else torch.arange(ids.shape[1])
            with torch.no_grad():
                logits = gather_last_dim(chunks[0].eval()(ids[:, positions]), ps)[..., : cfg.vocab_size]
        else:
            mean_loss, token_losses = _pipeline_token_losses(chunks, ps, cfg, topo, ids)
        writer = CheckpointWriter(f"{run_dir}/checkpoints", ps, keep_last=1, async_save=False, timeout_s=120)
        writer.save(0, *save_request(opt, ps, {"step": 0} if ps.is_logging_rank() else None, cfg,
                                     {**topo, "zero_stage": zero_stage}, "fp32", {}))
        saved = writer.close()
        moe_layers = [i for a, b in mine for i in range(a, b) if cfg.moe.is_moe_layer(i)]
        cp_group = tuple(ps.ranks("cp"))
        opt.close()
        ps.destroy()
        out.append(dict(saved=saved, moe_layers=moe_layers, logits=logits, positions=positions, cp_group=cp_group,
                        mean_loss=mean_loss, token_losses=token_losses))
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
        ids = token_ids(cfg, SEQ)
        with torch.no_grad():
            hf_logits = hf(ids).logits
            assert rel(from_hf(hf).eval()(ids), hf_logits) < 1e-5, (family, layout, cfg.name)
            hf_loss = hf(ids, labels=ids).loss  # transformers' own (shifted, mean) loss
        hf_dir, run_dir = tmp_path / f"{i}-hf", tmp_path / f"{i}-run"
        hf.save_pretrained(hf_dir)
        # the checkpoint's tensors (one per expert) that transformers saved, buffers included
        original = unfuse_experts({**dict(hf.named_buffers()), **hf.state_dict()}, hf_format(cfg))
        prepared.append((family, layout, cfg, ids, hf_logits, hf_loss, original, run_dir))
        topo, zero_stage, expert_zero_stage = LAYOUTS[layout]
        jobs.append((cfg, topo, zero_stage, expert_zero_stage, str(hf_dir), str(run_dir), ids,
                     cp_variant(family, layout, draw)))
    results = run_on_ranks(_import_save_on_rank, WORLD, jobs, timeout=600)

    for k, (family, layout, cfg, ids, hf_logits, hf_loss, original, run_dir) in enumerate(prepared):
        case = (family, layout, cfg.name, cp_variant(family, layout, draw=cases[k][2]))
        topo = LAYOUTS[layout][0]
        if family == "deepseek_v3" and layout in CP_LAYOUTS:  # refused on every rank, in one line naming cp
            for rank, r in enumerate(results):
                assert "parallel.cp=2: latent attention runs at tp=1 and cp=1" in r[k].get("refused", ""), (case, rank)
            continue
        assert all("refused" not in r[k] for r in results), (case, [r[k].get("refused") for r in results])
        assert all(r[k]["saved"] == [(0, True)] for r in results), case
        if topo["pp"] == 1:
            # each cp group's shares, put back at the positions of the load balance, are HF's logits
            groups: dict[tuple, torch.Tensor] = {}
            for rank, r in enumerate(results):
                assert r[k]["token_losses"] is None, (case, rank)
                whole = groups.setdefault(r[k]["cp_group"], torch.full_like(hf_logits, float("nan")))
                assert whole[:, r[k]["positions"]].isnan().all(), (case, rank, "two shares hold one position")
                whole[:, r[k]["positions"]] = r[k]["logits"]
            assert len(groups) == WORLD // topo.get("cp", 1), case
            for members, whole in groups.items():
                assert not whole.isnan().any(), (case, members)
                assert rel(whole, hf_logits) < 1e-5, (case, members)
        else:
            # per-token cross entropy of HF's logits (torch's op) and transformers' mean loss
            want = F.cross_entropy(hf_logits[:, :-1].transpose(1, 2).double(), ids[:, 1:], reduction="none")
            last = [r[k] for r in results if r[k]["mean_loss"] is not None]
            assert len(last) == WORLD // topo["pp"], case
            assert all(x[k]["logits"] is None for x in results), case
            for r in last:
                assert rel(r["token_losses"], want) < 1e-5, (case, (r["token_losses"] - want).abs().max())
                assert abs(r["mean_loss"] - float(hf_loss)) <= 1e-5 * float(hf_loss), (case, r["mean_loss"], hf_loss)
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
    """One case per family, the CI layouts among them: ep4, etp < tp, pp with a stage without MoE (its
    per-token losses through the pipeline's forward), expert ZeRO-3, and ep folded over cp x dp."""
    assert {l for _, l, _ in CI_CASES} >= {"etp-below-tp", "pp-dense-stage", "expert-zero3", "ep4", "cp2-ep4"}
    _check_cases(tmp_path, CI_CASES)


def test_cp_cases_draw_every_cp_comm_variant():
    """Across the product every cp_comm variant (and both a2a sizes of a2a+p2p at cp=2) runs, on a
    generated config that can hold it; every case family x cp layout x draw is in the product."""
    from parallel3d.topology import Topology

    assert {cp_variant(*c) for c in _CP_CASES} == set(CP_VARIANTS)
    assert set(_CP_CASES) <= set(ALL_CASES)
    for layout in CP_LAYOUTS:  # ep folds over cp: each expert exchange mixes the shares of a sequence
        topo = Topology(**LAYOUTS[layout][0])
        assert all(any(set(cp) <= set(ep) for ep in topo.groups("ep")) for cp in topo.groups("cp")), layout
    for comm, a2a in CP_VARIANTS:
        case = next(c for c in _CP_CASES if cp_variant(*c) == (comm, a2a))
        cfg = grid_case(*case)
        topo = LAYOUTS[case[1]][0]
        ContextParallelOptions(comm, a2a).check_layout(cp=topo["cp"], tp=topo["tp"], seq_len=SEQ,
                                                       num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads,
                                                       sequence_parallel=topo["tp"] > 1)


def test_latent_attention_refuses_cp_before_the_spawn():
    """``config.resolve`` refuses latent attention (DeepSeek-V3's) at cp=2 in one line naming parallel.cp, before
    any process starts (the ranks' own refusal is in the extended grid); cp=1 resolves."""
    from parallel3d.config import job_from_dict, resolve

    def job(parallel: dict):
        mla = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
        return job_from_dict({"parallel": parallel, "train": {"seq_len": SEQ}, "model": {"mla": mla}},
                             model="deepseek_tiny")

    with pytest.raises(ConfigError, match=r"^model.mla with parallel.tp=1, parallel.cp=2: latent attention runs at "
                                          r"tp=1 and cp=1"):
        resolve(job({"cp": 2}), world_size=2)
    assert resolve(job({"dp": 2}), world_size=2).model.mla.enabled


@pytest.mark.extended
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_on_every_generated_layout(tmp_path, family):
    """The whole product (cp refusals included for DeepSeek-V3) but the CI cases."""
    _check_cases(tmp_path, [c for c in ALL_CASES + REFUSED_CASES if c[0] == family and c not in CI_CASES])

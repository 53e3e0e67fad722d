"""ZeRO combined with tensor and pipeline parallelism (models.build_model + PipelineEngine)
against a single-process model trained by torch.optim.AdamW on the same global batch."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.param_meta import no_weight_decay
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.tensor_parallel.sharding import gather_full
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from tests.harness import run_on_ranks

CFG = ModelConfig(arch="gpt", num_layers=2, hidden_size=16, num_heads=2, vocab_size=61, max_seq_len=8)
SEQ, MBS, M = 8, 1, 2  # per DP rank and step: M microbatches of MBS sequences
# eps well above round-off: Adam maps a gradient g to about g / (|g| + eps), so an element whose
# gradient is ~1e-8 (here: attention key biases, whose true gradient is 0) would turn the
# summation-order noise of a different layout into a visible parameter difference.
LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-4, 0.1, 0.5
BUCKET_MB = 300 * 4 / 2**20


def _name(name: str, p: torch.nn.Parameter) -> str:
    return getattr(p, "global_name", None) or name


def _batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "sample_ids": torch.arange(rows) + step * rows}


def _reference(steps: int, global_rows: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    model = build_model(CFG, ParallelState.single_process(), seed=0)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if not no_weight_decay(p)], "weight_decay": WD},
              {"params": [p for p in params if no_weight_decay(p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    norms, losses = [], []
    for step in range(steps):
        b = _batch(step, global_rows)
        loss = model(b["input_ids"], b["labels"], sample_ids=b["sample_ids"], step=step)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
    return {_name(n, p): p.detach().clone() for n, p in model.named_parameters()}, norms, losses


def _train(rank, world_size, tp, pp, dp, stages, steps, ref):
    ps = ParallelState(Topology(tp, pp, dp))
    rows = dp * M * MBS
    per_layer = CFG.num_layers // pp
    out = {}
    for stage in stages:
        model = build_model(CFG, ps, seed=0, layer_range=(ps.pp_rank * per_layer, (ps.pp_rank + 1) * per_layer))
        opt = ZeroOptimizer([model], ps, zero_stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            clip_grad=CLIP, bucket_size_mb=BUCKET_MB)
        # The engine records parameter storages, so it is built after the optimizer re-homes them.
        engine = PipelineEngine([model], ps, schedule="1f1b", num_microbatches=M, micro_batch_size=MBS,
                                seq_len=SEQ, hidden_size=CFG.hidden_size, grad_sync=opt.grad_sync)
        norms = []
        for step in range(steps):
            b = _batch(step, rows)
            mine = slice(ps.dp_rank * M * MBS, (ps.dp_rank + 1) * M * MBS)
            local = {k: v[mine] for k, v in b.items()}
            mbs = [{k: v[i * MBS : (i + 1) * MBS] for k, v in local.items()} for i in range(M)]
            engine.run_step(mbs, loss_scale=opt.loss_scale, step=step)
            norms.append(opt.step().grad_norm)
            opt.zero_grad()
        errors = {}
        for n, p in model.named_parameters():
            full = gather_full(p, ps)
            want = ref[_name(n, p)]
            errors[_name(n, p)] = float((full - want).abs().max() / want.abs().max())
        out[stage] = (errors, norms)
    return out


def _run(tp: int, pp: int, dp: int, stages: tuple[int, ...], steps: int, label: str) -> None:
    ref, ref_norms, _ = _reference(steps, dp * M * MBS)  # once, in the test process
    assert max(ref_norms) > CLIP, "clipping should be active"
    results = run_on_ranks(_train, tp * pp * dp, tp, pp, dp, stages, steps, ref, timeout=240)
    for rank, per_stage in enumerate(results):
        for stage, (errors, norms) in per_stage.items():
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-5, f"{label} stage={stage} rank={rank}: {worst} rel. error {errors[worst]:.2e}"
            assert norms == pytest.approx(ref_norms, rel=1e-5), f"{label} stage={stage}: grad norms differ"


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_zero_with_tp_or_pp_matches_single_process(tp, pp):
    _run(tp, pp, 2, (0, 1, 2), 10, f"tp={tp} pp={pp} dp=2")

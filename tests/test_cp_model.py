"""Context parallelism is on in the model: the real ``TransformerLM`` on cp ranks.

For every ``parallel.cp_comm`` (and ``a2a+p2p`` with a real hierarchy at cp = 4), with and without
packed-document masks, each rank builds the Llama test model (GQA, RoPE) with the job's
``ContextParallelAttention`` and runs forward and backward on its load-balanced share of a
sequence. Proved against the single-process model on the whole sequence:

- the loss (mean over the cp ranks: each rank's is cp times its token share) and the weight
  gradients (mean over cp, what the dp_cp reduction takes) equal the single process's;
- each rank's attention computed queries for exactly its share (ring/all-gather), or for the
  whole sequence over exactly its 1/a of the heads (all-to-all over a ranks): never the whole
  attention on one rank, never only the local block ("CP silently off");
- every layer ran the CP attention (the same blocks per layer).
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from parallel3d.context_parallel import AttentionStats, local_positions, shift_labels, split_for_cp
from parallel3d.context_parallel.documents import document_ids
from parallel3d.context_parallel.model_attention import ContextParallelAttention
from parallel3d.context_parallel.options import ContextParallelOptions
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from tests.harness import run_on_ranks

SEQ, BATCH, EOD = 32, 2, 7
TOL = 1e-5


def _batch(document_mask: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(8, 500, (BATCH, SEQ), generator=gen)
    if document_mask:  # documents of different lengths in each row
        tokens[0, [5, 17]] = EOD
        tokens[1, [12]] = EOD
    batch = {"tokens": tokens, "labels": shift_labels(tokens)}
    batch["labels"][:, -1] = 1  # a target for every token: the labels of a longer stream
    batch["document_ids"] = document_ids(tokens, EOD) if document_mask else None
    return batch


def _model_loss(model, tokens, labels, docs):
    loss = model(tokens, labels, document_ids=docs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _on_rank(rank: int, world: int, cp_comm: str, a2a_size: int | None, document_mask: bool) -> dict:
    torch.manual_seed(0)
    pstate = ParallelState(Topology(cp=world))
    options = ContextParallelOptions(cp_comm=cp_comm, cp_a2a_size=a2a_size)
    cpa = ContextParallelAttention.build(pstate, options)
    cpa.stats = AttentionStats()
    config = get_config("llama_tiny", dropout=0.0)
    model = build_model(config, pstate, seed=5, context_parallel=cpa)
    b = _batch(document_mask)
    r = pstate.coord("cp")
    loss, grads = _model_loss(model, split_for_cp(b["tokens"], world, r), split_for_cp(b["labels"], world, r),
                              b["document_ids"])
    return {"loss": loss, "grads": grads, "queries": cpa.stats.query_positions(),
            "heads": cpa.stats.query_heads(), "forward_calls": len(cpa.stats.blocks()),
            "backward_queries": cpa.stats.query_positions("backward")}


VARIANTS = [("p2p", None, 2, False), ("allgather", None, 2, True), ("a2a", None, 2, True), ("p2p", None, 4, True),
            ("a2a+p2p", 2, 4, True), ("a2a", None, 4, False)]


@pytest.mark.parametrize("cp_comm,a2a_size,cp,document_mask", VARIANTS,
                         ids=[f"{v[0]}{v[1] or ''}-cp{v[2]}{'-docs' if v[3] else ''}" for v in VARIANTS])
def test_each_rank_attends_its_share_and_the_model_equals_one_process(cp_comm, a2a_size, cp, document_mask):
    results = run_on_ranks(_on_rank, cp, cp_comm, a2a_size, document_mask)
    config = get_config("llama_tiny", dropout=0.0)
    model = build_model(config, ParallelState.single_process(), seed=5)
    b = _batch(document_mask)
    ref_loss, ref_grads = _model_loss(model, b["tokens"], b["labels"], b["document_ids"])
    loss = sum(r["loss"] for r in results) / cp
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    for name, want in ref_grads.items():
        got = sum(r["grads"][name] for r in results) / cp
        assert (got - want).abs().max() <= TOL * want.abs().max() + 1e-9, name
    a2a = {"a2a": cp, "a2a+p2p": a2a_size}.get(cp_comm, 1)
    heads = config.num_heads
    for rank, r in enumerate(results):
        group = rank // a2a
        share = {int(p) for m in range(group * a2a, (group + 1) * a2a) for p in local_positions(SEQ, cp, m)}
        assert r["queries"] == share and r["backward_queries"] == share, (rank, sorted(r["queries"]))
        assert r["heads"] == {heads // a2a}, (rank, r["heads"])
        assert len(share) == SEQ * a2a // cp  # never the whole sequence with all heads on one rank
    # Every layer ran the CP attention: the same number of blocks per layer on each rank.
    assert all(r["forward_calls"] % config.num_layers == 0 and r["forward_calls"] > 0 for r in results)


@pytest.mark.parametrize("name", ["llama_tiny", "gpt_tiny"])
def test_document_mask_equals_each_document_run_alone(name):
    """An independent reference for ``document_ids``: a packed row's logits are those of each of
    its documents run through the model alone (attention inside it, positions from 0: RoPE or
    learned)."""
    config = get_config(name, dropout=0.0)
    model = build_model(config, ParallelState.single_process(), seed=5)
    tokens = _batch(True)["tokens"]
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids(tokens, EOD))
        for row in range(BATCH):
            ends = [int(i) + 1 for i in (tokens[row] == EOD).nonzero()] + [SEQ]
            starts = [0, *ends[:-1]]
            alone = torch.cat([model(tokens[row:row + 1, a:b]) for a, b in zip(starts, ends) if b > a], dim=1)
            assert (packed[row:row + 1] - alone).abs().max() <= 1e-5 * alone.abs().max()
        assert (packed - model(tokens)).abs().max() > 1e-3  # the mask changes what the model computes


@pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")
def test_trainer_feeds_document_ids(tmp_path):
    """Through the Trainer: with data.document_mask each microbatch (train and eval) carries the
    whole sequence's document ids at the tokenizer's EOD (the model tests above take it from there)."""
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.trainer import Trainer
    from tests import layout_matrix as lm

    values = lm.job_values("gpt", {}, {"global_batch_size": 4, "micro_batch_size": 2}, str(tmp_path / "run"),
                           str(tmp_path / "cache"), document_mask=True)
    rj = resolve(job_from_dict(values), 1)
    trainer = Trainer(rj, ParallelState.single_process())
    step = next(trainer.batches)
    eod = trainer.eod_id
    assert eod is not None and all(torch.equal(mb["document_ids"], document_ids(mb["input_ids"], eod)) for mb in step)
    assert "document_ids" in trainer.evaluator.batches.keys

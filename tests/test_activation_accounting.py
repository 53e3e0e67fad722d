"""Activation accounting only on steps that ask for it (``run_step(account_activations=...)``).

* ``activation_bytes.output_saved`` (the check used without the saved-tensor hooks) agrees
  with the hooks' answer on real model chunks: gpt/llama/mixtral, first/middle/last
  stages, tp 1 and tp 2 with sequence parallelism, recompute none/selective/full;
  and it never calls an output "not saved" that a toy op did save.
* a step without accounting gives bitwise the same losses and gradients (and frees the
  same sent outputs) as one with it; ``peak_activation_bytes`` is None without it.
* the trainer asks for it exactly on its log steps, whose records carry the bytes.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline import engine as engine_module
from parallel3d.pipeline import step_run
from parallel3d.pipeline.activation_bytes import SavedBytes, output_saved, storage_key
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.pipeline_toy import toy_batch

MBS, SEQ = 2, 8


# ---- the cheap check on toy graphs ------------------------------------------------------
class _KeepsOnCtx(torch.autograd.Function):
    """Keeps its own output as a ctx attribute: no saved-tensor hook sees it, backward reads it."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = x * 3
        ctx.y = y
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.y.sign() * 3


class _Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.scale = 2.0
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * ctx.scale


@pytest.mark.parametrize("op, saved", [
    (lambda a: a + 1, False),  # add saves nothing
    (lambda a: a * 2, False),
    (lambda a: torch.tanh(a), True),  # saves its result
    (lambda a: torch.exp(a).view(-1), True),  # a view of a saved result
    (lambda a: (a + 1).view(-1), True),  # a view: unproven (its base is another tensor), so "saved"
    (lambda a: _KeepsOnCtx.apply(a), True),
    (lambda a: _Plain.apply(a), False),
    (lambda a: a, True),  # a leaf passed through: never freed
], ids=["add", "mul", "tanh", "exp-view", "add-view", "ctx-attr", "custom-plain", "leaf"])
def test_output_saved_on_toy_ops(op, saved: bool) -> None:
    a = torch.randn(4, 4, requires_grad=True)
    assert output_saved(op(a)) is saved


def test_output_saved_under_identity_hooks_is_saved() -> None:
    """An identity pack hook keeps ``exp``'s result as itself: no extra storage use shows it."""
    a = torch.randn(4, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = torch.exp(a)
        assert output_saved(out)
        assert output_saved(a + 1)  # unproven under hooks, whatever the op


# ---- the cheap check against the hooks on model chunks ------------------------------------
def _chunk_verdicts(pstate: ParallelState, model: str, recompute: str, sp: bool) -> list[tuple]:
    """Per stage of a 3-stage split: (stage, hooks' "saved", output_saved) for the chunk's output."""
    torch.manual_seed(0)
    cfg = get_config(model, fused_kernels=False, dropout=0.1)
    ranges = partition_layers(cfg, 3, 1, None)
    tp = pstate.size("tp")
    out = []
    for stage, r in enumerate(ranges):
        chunk = build_model(cfg, pstate, seed=0, layer_range=r, sequence_parallel=sp, recompute=recompute)
        chunk.train()
        if r[1] == cfg.num_layers:  # the last stage returns the loss: nothing is sent
            continue
        if r[0] == 0:
            x = torch.randint(0, cfg.vocab_size, (MBS, SEQ))
        else:
            seq = SEQ // tp if sp else SEQ
            x = torch.randn(MBS, seq, cfg.hidden_size, requires_grad=True)
        params = {storage_key(p) for p in chunk.parameters()}
        verdicts = []
        for hooked in (True, False):
            saved = SavedBytes(params)
            if hooked:
                with saved.recording():
                    y = chunk(x, None, sample_ids=torch.arange(MBS), step=3)
                verdicts.append(y.grad_fn is None or storage_key(y) in saved.storages)
            else:
                y = chunk(x, None, sample_ids=torch.arange(MBS), step=3)
                verdicts.append(output_saved(y))
            y.float().sum().backward()
        out.append((stage, r, *verdicts))
    return out


CHUNK_CASES = [(m, rc) for m in ("gpt_tiny", "llama_tiny", "mixtral_tiny") for rc in ("none", "selective", "full")]


@pytest.mark.parametrize("model, recompute", CHUNK_CASES)
def test_output_saved_agrees_with_hooks_tp1(model: str, recompute: str) -> None:
    verdicts = _chunk_verdicts(ParallelState.single_process(), model, recompute, sp=False)
    assert verdicts and all(hooked == cheap for _, _, hooked, cheap in verdicts), verdicts
    assert not all(hooked for _, _, hooked, _ in verdicts)  # the check is not vacuous: some output may go


def _tp2_case(rank: int, world: int, model: str, recompute: str) -> list[tuple]:
    return _chunk_verdicts(ParallelState(Topology(tp=2, pp=1, dp=1)), model, recompute, sp=True)


@pytest.mark.parametrize("model, recompute", [("gpt_tiny", "none"), ("llama_tiny", "selective"),
                                              ("mixtral_tiny", "full"), ("mixtral_tiny", "none")])
def test_output_saved_agrees_with_hooks_tp2_sequence_parallel(model: str, recompute: str) -> None:
    for verdicts in run_on_ranks(_tp2_case, 2, model, recompute, timeout=240):
        assert verdicts and all(hooked == cheap for _, _, hooked, cheap in verdicts), verdicts


# ---- the step: same numbers with and without accounting ---------------------------------
def _batch(cfg, m: int) -> list[dict]:
    return toy_batch(m, MBS, SEQ, seed=5, vocab=cfg.vocab_size)


def _step_case(rank: int, world: int, model: str, schedule: str, v: int) -> dict:
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1))
    cfg = get_config(model, fused_kernels=False, dropout=0.1)
    ranges = stage_layer_ranges(partition_layers(cfg, 2, v, None), 2, pstate.coord("pp"))
    chunks = [build_model(cfg, pstate, seed=0, layer_range=r) for r in ranges]
    engine = PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=4, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=cfg.hidden_size)
    class Recording(step_run.StepRun):
        """Notes which sent outputs each step marks freeable."""

        def forward(self, c) -> None:
            super().forward(c)
            if c.key in self.freeable_bytes:
                freeable.add(c.key)

    runs: dict = {}
    engine_module.StepRun = Recording
    try:
        for account in (True, False, True):
            for c in chunks:
                c.zero_grad(set_to_none=True)
            freeable: set = set()
            result = engine.run_step(_batch(cfg, 4), step=2, account_activations=account)
            grads = [p.grad.clone() for c in chunks for p in c.parameters() if p.grad is not None]
            runs.setdefault(account, []).append((result.loss, grads, result.peak_activation_bytes,
                                                result.peak_live_activations, set(freeable)))
    finally:
        engine_module.StepRun = step_run.StepRun
    return runs


@pytest.mark.parametrize("model, schedule, v", [("gpt_tiny", "1f1b", 1), ("mixtral_tiny", "interleaved_1f1b", 2),
                                                ("llama_tiny", "zb_h1", 1)])
def test_step_without_accounting_is_bitwise_the_same(model: str, schedule: str, v: int) -> None:
    ranks = run_on_ranks(_step_case, 2, model, schedule, v, timeout=240)
    assert any(runs[False][0][4] for runs in ranks)  # some sent output was freed without the hooks
    for runs in ranks:
        (on_loss, on_grads, on_bytes, on_live, on_freed), (_, _, on_bytes2, _, _) = runs[True]
        ((off_loss, off_grads, off_bytes, off_live, off_freed),) = runs[False]
        assert off_loss == on_loss
        assert len(off_grads) == len(on_grads) > 0
        assert all(torch.equal(a, b) for a, b in zip(off_grads, on_grads))
        assert off_bytes is None and on_bytes == on_bytes2 and on_bytes > 0
        assert off_live == on_live
        assert off_freed == on_freed  # the same sent outputs lose their storage


class _SavedOutputStage(torch.nn.Module):
    """Stage 0 ends in a Function that keeps its output on its ctx (the same tensor, unlike what
    autograd saves): freeing the sent output would corrupt B."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(32, 16)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, labels=None, *, sample_ids=None, step=0):
        return _KeepsOnCtx.apply(self.lin(self.emb(x)))


class _LossStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x, labels=None, *, sample_ids=None, step=0):
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _saved_output_case(rank: int, world: int) -> tuple:
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1))
    chunk = _SavedOutputStage() if pstate.coord("pp") == 0 else _LossStage()
    engine = PipelineEngine([chunk], pstate, schedule="1f1b", num_microbatches=4, micro_batch_size=MBS,
                            seq_len=SEQ, hidden_size=16)
    gen = torch.Generator().manual_seed(3)
    batch = [{"input_ids": torch.randint(0, 32, (MBS, SEQ), generator=gen),
              "labels": torch.randint(0, 32, (MBS, SEQ), generator=gen), "sample_ids": torch.arange(MBS)}
             for _ in range(4)]
    kept = PipelineEngine([chunk], pstate, schedule="1f1b", num_microbatches=4, micro_batch_size=MBS,
                          seq_len=SEQ, hidden_size=16, free_sent_activations=False)
    grads = []
    for e, account in ((kept, True), (engine, True), (engine, False)):
        chunk.zero_grad(set_to_none=True)
        e.run_step(batch, account_activations=account)
        grads.append([p.grad.clone() for p in chunk.parameters()])
    return [all(torch.equal(a, b) for a, b in zip(grads[0], g)) for g in grads[1:]]


def test_a_saved_sent_output_is_kept_without_accounting() -> None:
    assert run_on_ranks(_saved_output_case, 2, timeout=120) == [[True, True], [True, True]]


# ---- the trainer asks on its log steps ---------------------------------------------------
def test_trainer_accounts_exactly_on_log_steps(tmp_path, monkeypatch) -> None:
    from parallel3d.config import job_from_dict, resolve
    from parallel3d.trainer import train

    asked: list[bool] = []
    run_step = PipelineEngine.run_step

    def spy(self, microbatches, **kwargs):
        asked.append(kwargs["account_activations"])
        return run_step(self, microbatches, **kwargs)

    monkeypatch.setattr(PipelineEngine, "run_step", spy)
    values = {
        "train": {"steps": 5, "global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "seed": 7,
                  "out_dir": str(tmp_path / "run"), "save_every": 0, "device": "cpu"},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1},
        "data": {"cache_dir": str(tmp_path / "cache")},
        "logging": {"log_every": 2},
    }
    rj = resolve(job_from_dict(values, model="gpt_tiny"), 1)
    result = train(rj, ParallelState.single_process())
    assert asked == [False, True, False, True, True]  # steps 2, 4 and the last
    assert [r["step"] for r in result.records] == [2, 4, 5]
    assert all(r["mem_activations_bytes_max"] > 0 for r in result.records)


# ---- the step's microbatch tensors: once per step, however they share storage ----------------
def _step_peak(microbatches: list[dict], schedule: str) -> int:
    torch.manual_seed(0)
    cfg = get_config("gpt_tiny", fused_kernels=False, dropout=0.1)
    pstate = ParallelState.single_process()
    chunk = build_model(cfg, pstate, seed=0)
    engine = PipelineEngine([chunk], pstate, schedule=schedule, num_microbatches=len(microbatches),
                            micro_batch_size=1, seq_len=SEQ, hidden_size=cfg.hidden_size)
    return engine.run_step(microbatches, step=1, account_activations=True).peak_activation_bytes


def _storage_bytes(microbatches: list[dict]) -> int:
    """Bytes of the distinct storages behind the microbatches' tensors (independent of the engine's helpers)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for mb in microbatches for t in mb.values()}.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_tensors_count_once_whatever_storage_they_share(schedule: str) -> None:
    """A CPU job's data path (``data.batches`` at micro-batch 1) hands microbatches whose ids and labels are
    views of one step token buffer; a device job's are copies, one storage each. Both steps compute the same,
    so their peaks may differ only by the step tensors' storages, each counted once: counted inside each
    forward, the shared buffer counted once per microbatch in flight (GPipe: all 4; the dry run's fuzz cases
    2006, 2013, 2018: -6.5% to -22.6% against the real run) and the ids' saving op decided what counted."""
    m = 4
    buffer = torch.randint(0, 64, (m, SEQ + 1), generator=torch.Generator().manual_seed(3))
    shared = [{"input_ids": buffer[j:j + 1, :-1].contiguous(), "labels": buffer[j:j + 1, 1:].contiguous(),
               "sample_ids": torch.tensor([j])} for j in range(m)]
    assert shared[0]["input_ids"].untyped_storage().nbytes() == buffer.untyped_storage().nbytes()  # views
    own = [{k: t.clone() for k, t in mb.items()} for mb in shared]
    peak_shared, peak_own = _step_peak(shared, schedule), _step_peak(own, schedule)
    assert peak_shared - _storage_bytes(shared) == peak_own - _storage_bytes(own)

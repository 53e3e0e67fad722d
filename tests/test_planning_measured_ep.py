"""The estimator's expert-parallel scaling against peak RSS measured from outside the code.

A 4-rank job (dp = 4, tp = cp = pp = 1) trains one step of a Mixtral-style model (fp32, 8 routed
experts, top-2) whose experts dominate its parameters, at ep = 1, 2, 4 (experts fold over the dp
ranks: edp = 4 / ep). Peak RSS per rank comes from ``tests/peak_rss.py``. The baseline subtracted is
the ep = 1 job's own measured peak on the same rank (same fork image, process and torch start-up,
data, dense part): measured saving(ep) = peak(ep=1) - peak(ep). The estimator must predict that
saving (its ep=1 worst-rank total minus its ep worst-rank total) within 10% (measured there by the CPU
allocator's peak of live tensor bytes, ``peak_allocated_of_job``), and the per-rank peak RSS must fall
with every doubling of ep.
"""

from __future__ import annotations

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import estimate_memory
from tests.peak_rss import VOCAB, job_values, peak_allocated_of_job, peak_rss_of_job, token_file

TOLERANCE = 0.10
WORLD = 4
SEQ = 64
MOE = dict(num_experts=8, top_k=2, ffn_hidden_size=512, aux_loss_coeff=0.01)
MODEL = dict(name="rss_moe", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=176, tie_embeddings=False, use_bias=False, max_seq_len=SEQ)


def _estimated_total(ep: int, zero_stage: int) -> float:
    config = ModelConfig(**MODEL, vocab_size=VOCAB, dropout=0.0, moe=MoEConfig(**MOE))
    layout = Layout(dp=WORLD, ep=ep, zero_stage=zero_stage, seq_len=SEQ, micro_batch_size=1, precision="fp32")
    return estimate_memory(config, layout, ActivationAssumptions.for_model(config, "fp32", kernels="torch")).worst.total


def _measured(tmp_path, tokens: str, ep: int, zero_stage: int, allocator: bool = False) -> list[int]:
    values = job_values(tokens, str(tmp_path / f"out{ep}z{zero_stage}"), {**MODEL, "moe": MOE},
                        dict(ep=ep, zero_stage=zero_stage),
                        dict(seq_len=SEQ, micro_batch_size=1, global_batch_size=WORLD))
    return (peak_allocated_of_job if allocator else peak_rss_of_job)(values, WORLD)


def _peaks(tmp_path, zero_stage: int, allocator: bool = False) -> dict[int, list[int]]:
    tokens = token_file(str(tmp_path))
    return {ep: _measured(tmp_path, tokens, ep, zero_stage, allocator) for ep in (1, 2, 4)}


def test_peak_per_rank_falls_with_ep(tmp_path):
    peaks = _peaks(tmp_path, 0)
    falls = [f"rank {rank}: ep={small} {peaks[small][rank]} B -> ep={large} {peaks[large][rank]} B"
             for small, large in ((1, 2), (2, 4)) for rank in range(WORLD)
             if not peaks[large][rank] < peaks[small][rank]]
    assert not falls, "peak did not fall with ep:\n" + "\n".join(falls)
    # the estimate's saving must be at least most of the measured one (the 10% check is below)
    for ep in (2, 4):
        want = _estimated_total(1, 0) - _estimated_total(ep, 0)
        assert all(want > 0.5 * (peaks[1][r] - peaks[ep][r]) for r in range(WORLD)), (ep, want, peaks)


# The saving includes the step's transients that scale with the experts held: the grad-norm clip's
# square and fp64 copy of the largest gradient piece and, at ZeRO 1 on gloo, the backend's copy of the
# gradient buffer being reduce-scattered (planning.memory).
@pytest.mark.slow
# ZeRO 1: gloo's post-step parameter all-gathers allocate flat copies on its worker threads, and how many
# coexist depends on timing (13.5-16.5 MiB measured against 14.8); a difference of two such peaks is no CI check
@pytest.mark.parametrize("zero_stage", [0, pytest.param(1, marks=pytest.mark.extended)])
def test_ep_saving_within_10_percent_of_estimate(tmp_path, zero_stage):
    """The saving by the CPU allocator's peak of live tensor bytes (exact and deterministic; peak RSS,
    checked above, also counts pages beside tensors: rank 0's varies by ~1 MiB)."""
    peaks = _peaks(tmp_path, zero_stage, allocator=True)
    failures = []
    for ep in (2, 4):
        want = _estimated_total(1, zero_stage) - _estimated_total(ep, zero_stage)
        for rank in range(WORLD):
            got = peaks[1][rank] - peaks[ep][rank]
            if abs(want - got) > TOLERANCE * got:
                failures.append(f"zero {zero_stage} ep={ep} rank {rank}: estimated saving {want / 2**20:.2f} MiB, "
                                f"measured {got / 2**20:.2f} MiB")
    assert not failures, "\n".join(failures)

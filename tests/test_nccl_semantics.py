"""NCCL's p2p semantics on CPU: ``ParallelState(emulate_nccl=True)`` over gloo.

NCCL returns ONE Work for a whole ``batch_isend_irecv`` batch (gloo: one per op) and
runs a rank's batches on a group in FIFO order on one stream. The emulation reproduces
both, so code that pairs Works with ops, or that posts a receive ahead of the sends a
peer waits for, fails here as it would on GPUs. The pipeline engine under emulation is
checked against the single-process model in ``test_pipeline_engine``; here: the
wrapper, the production p2p layer's batches under it, the FIFO deadlock it reproduces,
the engine's plan check, and a Trainer run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.config import job_from_dict, resolve
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.actions import Action
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.p2p import MessageSpec, PipelineP2P
from parallel3d.topology import Topology
from parallel3d.trainer import train
from tests.harness import run_on_ranks
from tests.pipeline_toy import HIDDEN, ToyModel
from tests.test_train_e2e import assert_close, job_values, losses_of, train_single

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")  # CPU: no MFU, by design
MESSAGE = MessageSpec((2, 3, 4), torch.float32)


def _ops(pstate: ParallelState, rank: int, sends: int, recvs: int) -> tuple[list[dist.P2POp], list[torch.Tensor]]:
    """``sends`` tensors to the other stage, then ``recvs`` buffers from it, on the pp group."""
    peer, group = 1 - rank, pstate.group("pp")
    ops = [dist.P2POp(dist.isend, torch.full((4,), 10.0 * rank + k), peer, group=group) for k in range(sends)]
    buffers = [torch.zeros(4) for _ in range(recvs)]
    ops += [dist.P2POp(dist.irecv, b, peer, group=group) for b in buffers]
    return ops, buffers


def _one_batch(rank, world, emulate):
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1), emulate_nccl=emulate)
    ops, buffers = _ops(pstate, rank, sends=2, recvs=2)
    works = comm.batch_isend_irecv(ops, pstate)
    kinds = [type(w).__name__ for w in works]
    for work in works:
        work.wait()
    done = all(w.is_completed() for w in works)
    return kinds, done, [b.tolist() for b in buffers], pstate.p2p_coalesces


def test_emulation_returns_one_work_per_batch():
    for emulate, expected in ((False, 4), (True, 1)):
        for rank, (kinds, done, received, coalesces) in enumerate(run_on_ranks(_one_batch, 2, emulate)):
            assert len(kinds) == expected, (emulate, kinds)
            assert coalesces == emulate and done
            if emulate:
                assert kinds == ["CoalescedWork"]
            peer = 1 - rank
            assert received == [[10.0 * peer + k] * 4 for k in range(2)]  # FIFO per pair and direction


def _message(rank: int, kind: str, microbatch: int) -> torch.Tensor:
    return torch.full(MESSAGE.shape, 1000.0 * rank + 100.0 * ("ACT" in kind) + microbatch)


def _steady_state_batches(rank, world, emulate):
    """Through ``PipelineP2P`` (what the engine posts): batches of two sends and two receives each way,
    the shape of a steady-state interleaved step; returns what each receive delivered."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1), emulate_nccl=emulate)
    p2p = PipelineP2P(pstate, MESSAGE)
    send, recv = (("SEND_ACT", "RECV_GRAD") if pstate.coord("pp") == 0 else ("SEND_GRAD", "RECV_ACT"))
    received = {}
    for first in (0, 2):
        got = p2p.exchange([(Action(send, mb), _message(rank, send, mb)) for mb in (first, first + 1)],
                           [Action(recv, mb) for mb in (first, first + 1)])
        received.update({f"{a.kind}{a.microbatch}": t.clone() for a, t in got.items()})
    p2p.wait_sends()
    return received


def test_pipeline_p2p_under_emulated_nccl_treats_a_batch_as_one_unit():
    """The bug class of issue 11, in the production p2p layer: code that pairs Works with ops
    (one per op on gloo) loses receives once a batch is one Work (NCCL, and the emulation)."""
    for emulate in (False, True):
        for rank, received in enumerate(run_on_ranks(_steady_state_batches, 2, emulate)):
            peer, recv = 1 - rank, ("RECV_GRAD" if rank == 0 else "RECV_ACT")
            sent_by_peer = "SEND_ACT" if rank == 1 else "SEND_GRAD"
            assert sorted(received) == [f"{recv}{mb}" for mb in range(4)], (emulate, rank, sorted(received))
            for mb in range(4):
                assert torch.equal(received[f"{recv}{mb}"], _message(peer, sent_by_peer, mb)), (emulate, rank, mb)


def _receive_batched_ahead(rank, world, emulate):
    """Each rank posts a receive, then (as a second batch) the send its peer's receive needs."""
    pstate = ParallelState(Topology(tp=1, pp=2, dp=1), timeout_s=2, emulate_nccl=emulate)
    recv_ops, buffers = _ops(pstate, rank, sends=0, recvs=1)
    send_ops, _ = _ops(pstate, rank, sends=1, recvs=0)
    try:
        works = comm.batch_isend_irecv(recv_ops, pstate) + comm.batch_isend_irecv(send_ops, pstate)
        for work in works:
            work.wait()
    except RuntimeError as exc:
        return str(exc)
    return buffers[0].tolist()


def test_emulated_fifo_batches_deadlock_where_nccl_does():
    """On NCCL the second batch queues behind the first on the group's stream: both ranks wait forever."""
    assert run_on_ranks(_receive_batched_ahead, 2, False) == [[10.0] * 4, [0.0] * 4]
    for rank, message in enumerate(run_on_ranks(_receive_batched_ahead, 2, True, timeout=60)):
        assert message.startswith(f"rank {rank}: batch_isend_irecv on the pp group [0, 1] failed"), message


def _coordinates_only(backend: str, emulate: bool = False) -> ParallelState:
    return ParallelState(Topology(tp=1, pp=2, dp=1), rank=0, distributed=False, backend=backend, device="cpu",
                         emulate_nccl=emulate)


def _engine(pstate: ParallelState, schedule: str, **kwargs) -> PipelineEngine:
    chunks = [ToyModel(4, (0, 1)), ToyModel(4, (2, 3))] if schedule == "interleaved_1f1b" else [ToyModel(4, (0, 2))]
    return PipelineEngine(chunks, pstate, schedule=schedule, num_microbatches=4, micro_batch_size=2, seq_len=4,
                          hidden_size=HIDDEN, **kwargs)


def test_coalescing_backends_post_no_receive_ahead_and_refuse_one():
    gloo, nccl, emulated = _coordinates_only("gloo"), _coordinates_only("nccl"), _coordinates_only("gloo", True)
    assert (gloo.p2p_coalesces, nccl.p2p_coalesces, emulated.p2p_coalesces) == (False, True, True)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        assert _engine(gloo, schedule).prefetch_recvs == 2
        for pstate in (nccl, emulated):
            engine = _engine(pstate, schedule)
            assert engine.prefetch_recvs == 0 and not any(step.ahead for step in engine.plan)
            with pytest.raises(ValueError, match="deadlock under NCCL"):
                _engine(pstate, schedule, prefetch_recvs=1)
    # With batches as units even gloo needs interleaving's receives posted ahead (the check says so).
    with pytest.raises(ValueError, match="deadlock under gloo"):
        _engine(gloo, "interleaved_1f1b", prefetch_recvs=0)


# ---- one real Trainer run ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))


def _train_emulating_nccl(rank: int, world: int, values: dict) -> bool:
    rj = resolve(job_from_dict(values, model="gpt_tiny"), world)
    pstate = ParallelState(rj.topology, emulate_nccl=True)
    train(rj, pstate)
    return pstate.p2p_coalesces


def test_trainer_with_emulated_nccl_matches_single_process(tmp_path, cache_dir):
    """pp=3 (uneven 4-layer split, middle stage, tied embedding) with one Work per batch and FIFO batches."""
    ref = train_single("gpt_tiny", job_values(str(tmp_path / "ref"), cache_dir))
    out = str(tmp_path / "emulated")
    values = job_values(out, cache_dir, parallel={"tp": 1, "pp": 3, "dp": 1, "zero_stage": 1})
    assert run_on_ranks(_train_emulating_nccl, 3, values, timeout=240) == [True] * 3
    assert_close(losses_of(out), ref)

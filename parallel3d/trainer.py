"""The training loop: build this rank's pieces from a ``ResolvedJob``, train, log, checkpoint.

Per rank: the model chunks of its pipeline stage (``models.build_model`` over the
layer ranges of ``pipeline.partition``), one ``ZeroOptimizer`` over them, one
``PipelineEngine`` running the schedule with the optimizer's gradient sync, and a
``DistributedBatchIterator`` over the job's dataset. One step = one global batch
of ``train.global_batch_size`` samples = ``grad_accum`` micro-batches per DP rank.

Logging: every rank takes part in the per-log-step reductions (loss over DP on
the last stage; memory, bubble and communication over the world); only the
logging rank (last stage, tp=0, dp=0: it has the loss) writes metrics.jsonl,
W&B and the console line. Steps are numbered from 1 (the record of step k
describes the k-th optimizer step).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models import build_model
from parallel3d import comm, data
from parallel3d.atomic_io import atomic_torch_save
from parallel3d.checkpoint import CheckpointManager
from parallel3d.config import ResolvedJob
from parallel3d.metrics import (
    JsonlSink,
    StepTimer,
    ThroughputModel,
    WandbSink,
    format_console,
    memory_snapshot,
    reduce_over_world,
    resolve_peak_tflops,
)
from parallel3d.parallel_state import ParallelState, init_distributed
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.zero import WarmupCosine, ZeroOptimizer
from parallel3d.zero.precision import precision_dtype

TRAINER_STATE = "trainer_state.pt"  # step, data position, optimizer counters (logging rank)
ZERO_DIR = "zero"  # model shards + sharded optimizer state (ZeroOptimizer.save_sharded)


@dataclass
class TrainResult:
    """What ``train`` returns on every rank (records only on the logging rank)."""

    rank: int
    start_step: int  # steps already done when this run started (0 unless resumed)
    last_step: int
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # steps saved successfully
    wall_time: float = 0.0


def _layout(rj: ResolvedJob) -> dict[str, Any]:
    p = rj.job.parallel
    return {"tp": p.tp, "pp": p.pp, "virtual_stages": p.virtual_stages, "order": p.order,
            "pp_layers": None if p.pp_layers is None else list(p.pp_layers)}


def make_parallel_state(rj: ResolvedJob) -> ParallelState:
    """Initialise torch.distributed (if launched by torchrun) and build this rank's groups."""
    backend = "nccl" if rj.device == "cuda" else "gloo"
    init_distributed(backend, rj.job.train.timeout_s)
    device = None
    if rj.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return ParallelState(rj.topology, backend=backend, timeout_s=rj.job.train.timeout_s, device=device)


def build_chunks(rj: ResolvedJob, pstate: ParallelState) -> list[torch.nn.Module]:
    """This stage's model chunks: global chunk ``pp_rank + c * pp`` for c < virtual_stages."""
    p, t = rj.job.parallel, rj.job.train
    ranges = partition_layers(rj.model, p.pp, p.virtual_stages, p.pp_layers, seq_len=t.seq_len)
    last = len(ranges) - 1
    chunks = []
    for c, layer_range in enumerate(stage_layer_ranges(ranges, p.pp, pstate.pp_rank)):
        k = pstate.pp_rank + c * p.pp
        chunks.append(build_model(
            rj.model, pstate, seed=t.seed, layer_range=layer_range, pre_process=k == 0, post_process=k == last,
            sequence_parallel=p.sequence_parallel, recompute=t.recompute, dtype=precision_dtype(t.precision),
            device=pstate.device,
        ))
    return chunks


def build_batches(rj: ResolvedJob, pstate: ParallelState) -> data.DistributedBatchIterator:
    """The dataset of ``data.*`` and this rank's batch iterator (tokens only on end stages)."""
    d, t = rj.job.data, rj.job.train
    if d.source == "default":
        prefix, _ = data.build_default_corpus(
            d.cache_dir, vocab_size=rj.model.vocab_size, corpus=d.corpus, tokenizer=d.tokenizer,
            is_builder=pstate.rank == 0, wait_timeout_s=t.timeout_s,
        )
        sources, weights = [prefix], None
    else:
        sources, weights = list(d.paths), None if d.weights is None else list(d.weights)
    dataset = data.GPTDataset(sources, weights, seq_len=t.seq_len, seed=t.seed, model_vocab_size=rj.model.vocab_size)
    return data.DistributedBatchIterator.for_rank(dataset, pstate, t.global_batch_size, t.micro_batch_size)


class Trainer:
    """One rank's training run; see module doc. ``full_config`` is the resolved Hydra config (for W&B/meta)."""

    def __init__(self, rj: ResolvedJob, pstate: ParallelState, full_config: dict[str, Any] | None = None) -> None:
        self.rj, self.pstate = rj, pstate
        self.full_config = full_config or {}
        t, o, p = rj.job.train, rj.job.optimizer, rj.job.parallel
        self.chunks = build_chunks(rj, pstate)
        self.optimizer = ZeroOptimizer(
            self.chunks, pstate, zero_stage=p.zero_stage, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay, clip_grad=o.clip_grad or None, bucket_size_mb=p.bucket_size_mb,
            precision=t.precision, grad_reduce_dtype=p.grad_reduce_dtype, offload=p.offload,
            offload_dir=p.offload_dir, offload_buffer_mb=p.offload_buffer_mb, zero3_prefetch=p.zero3_prefetch,
            zero3_reshard=p.zero3_reshard,
            # kernels.backend=torch means torch everywhere, the optimizer's fused update included.
            fused_adamw_backend="torch" if rj.model.kernel_backend == "torch" else "auto",
            lr_schedule=WarmupCosine(max_lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, decay_steps=t.steps),
        )
        self.engine = PipelineEngine(
            self.chunks, pstate, schedule=p.schedule, num_microbatches=rj.grad_accum,
            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, hidden_size=rj.model.hidden_size,
            dtype=precision_dtype(t.precision), sequence_parallel=p.sequence_parallel,
            grad_sync=self.optimizer.grad_sync,
        )
        self.batches = build_batches(rj, pstate)
        self.ckpt = CheckpointManager(os.path.join(t.out_dir, "checkpoints"), pstate, keep_last=t.keep_last)
        self.is_logging_rank = pstate.is_logging_rank()
        self.throughput = ThroughputModel.build(
            rj.model, seq_len=t.seq_len, global_batch_size=t.global_batch_size, world_size=rj.world_size,
            recompute=t.recompute,
            peak_tflops=resolve_peak_tflops(t.peak_tflops, pstate.device, t.precision)
            if self.is_logging_rank else t.peak_tflops,
        )
        self.step = 0
        self.wandb_id: str | None = None

    # ---- checkpoints -------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        opt = self.optimizer
        return {
            "step": self.step,
            "data": self.batches.state_dict(),
            "iteration": opt.iteration,
            "adam_step": opt.adam_step,
            "scaler": opt.scaler.state_dict(),  # state only: the scaler's settings come from this run
            "wandb_id": self.wandb_id,
        }

    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if self.pstate.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.pstate.device)
        return state

    def save_checkpoint(self) -> bool:
        def write_rank(directory: str) -> None:
            self.optimizer.save_sharded(os.path.join(directory, ZERO_DIR))
            os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
            atomic_torch_save(self._rng_state(), os.path.join(directory, "rng", f"rank_{self.pstate.rank:05d}.pt"))
            if self.is_logging_rank:  # it also knows the W&B run id
                atomic_torch_save(self._trainer_state(), os.path.join(directory, TRAINER_STATE))

        meta = {"layout": _layout(self.rj), "dp": self.pstate.dp_size, "config": self.full_config}
        return self.ckpt.save(self.step, write_rank, meta)

    def load_checkpoint(self, directory: str) -> None:
        self.ckpt.check_layout(directory, _layout(self.rj))
        self.optimizer.load_sharded(os.path.join(directory, ZERO_DIR))
        state = torch.load(os.path.join(directory, TRAINER_STATE), weights_only=False)
        self.step = int(state["step"])
        self.batches.load_state_dict(state["data"])
        self.optimizer.iteration = int(state["iteration"])
        self.optimizer.adam_step = int(state["adam_step"])
        self.optimizer.scaler.load_state_dict(state["scaler"])
        self.wandb_id = state.get("wandb_id")
        rng_path = os.path.join(directory, "rng", f"rank_{self.pstate.rank:05d}.pt")
        if os.path.exists(rng_path):  # absent when resuming with another dp size
            rng = torch.load(rng_path, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if "cuda" in rng and self.pstate.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.pstate.device)

    # ---- one step --------------------------------------------------------------------
    def _to_device(self, microbatches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        if self.pstate.device.type == "cpu":
            return microbatches
        # A non_blocking copy from pageable host memory is synchronous on CUDA: pin first, so the
        # step's token copies overlap the previous step's tail instead of stalling the host.
        return [{k: v.pin_memory().to(self.pstate.device, non_blocking=True) for k, v in mb.items()}
                for mb in microbatches]

    def _dp_mean_loss(self, loss: float | None) -> float | None:
        """Mean loss of the global batch (last stage only; other stages have none)."""
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64, device=self.pstate.device)
        comm.all_reduce(t, self.pstate, "dp")
        return t.item() / comm.group_size(self.pstate, "dp")

    def _record(self, step_time: float, result: Any, info: Any, comm_bytes: dict[str, int]) -> dict[str, Any] | None:
        """Collective: the step's metrics record (on the logging rank; None elsewhere)."""
        loss = self._dp_mean_loss(result.loss)
        # Model-state bytes at their high-water mark during the log interval (inside backward,
        # where e.g. gradients peak), not what is left after the step.
        mem = memory_snapshot(self.pstate.device, self.optimizer.memory_peak_bytes())
        mem["mem_activations_bytes"] = result.peak_activation_bytes
        per_rank = dict(mem, bubble_fraction=result.bubble_fraction,
                        **{f"comm_bytes_{k}": v for k, v in comm_bytes.items()})
        reduced = reduce_over_world(per_rank, self.pstate)
        if not self.is_logging_rank:
            return None
        record: dict[str, Any] = {"step": self.step, "loss": loss, "lr": info.lr, "grad_norm": info.grad_norm,
                                  "loss_scale": info.loss_scale, "skipped": info.skipped}
        record.update(self.throughput.step_metrics(step_time))
        record["bubble_fraction"] = reduced["bubble_fraction"].mean
        record["comm_bytes"] = sum(reduced[f"comm_bytes_{k}"].sum for k in comm_bytes)
        for k in comm_bytes:
            record[f"comm_bytes_{k}"] = reduced[f"comm_bytes_{k}"].sum
        for key in mem:
            record[f"{key}_max"] = int(reduced[key].max)
            record[f"{key}_min"] = int(reduced[key].min)
        return record

    def _comm_delta(self, before: dict[str, int]) -> dict[str, int]:
        now = self.pstate.comm_stats.by_kind()
        return {k: now.get(k, 0) - before.get(k, 0) for k in ("tp", "pp", "dp", "embedding")}

    # ---- the run ---------------------------------------------------------------------
    def train(self) -> TrainResult:
        t, lg = self.rj.job.train, self.rj.job.logging
        t0 = time.perf_counter()
        resume_dir = self.ckpt.find(t.resume)
        if resume_dir is not None:
            self.load_checkpoint(resume_dir)
        result = TrainResult(rank=self.pstate.rank, start_step=self.step, last_step=self.step)
        jsonl = wandb = None
        if self.is_logging_rank:
            jsonl = JsonlSink(os.path.join(t.out_dir, "metrics.jsonl"),
                              keep_through_step=self.step if resume_dir else None)
            wandb = WandbSink(mode=lg.wandb.mode, project=lg.wandb.project, entity=lg.wandb.entity,
                              name=lg.wandb.name, run_dir=t.out_dir, config=self.full_config, resume_id=self.wandb_id,
                              init_timeout_s=lg.wandb.init_timeout_s)
            self.wandb_id = wandb.run_id
            self._banner(resume_dir)
        end = t.steps if t.stop_after is None else min(t.steps, t.stop_after)
        timer = StepTimer(self.pstate.device)
        # Throughput is averaged over the whole log interval (data, step, logging and
        # checkpoints included), as Megatron reports it, not taken from one step.
        interval_start, interval_steps = time.perf_counter(), 0
        while self.step < end:
            timer.start()
            before = self.pstate.comm_stats.by_kind()
            microbatches = self._to_device(next(self.batches))
            self.optimizer.zero_grad()
            step_result = self.engine.run_step(microbatches, loss_scale=self.optimizer.loss_scale, step=self.step)
            info = self.optimizer.step()
            timer.stop()  # synchronises the device so the interval below is honest
            comm_bytes = self._comm_delta(before)
            self.step += 1
            interval_steps += 1
            if self.step % lg.log_every == 0 or self.step == end:
                step_time = (time.perf_counter() - interval_start) / interval_steps
                record = self._record(step_time, step_result, info, comm_bytes)
                if record is not None:
                    result.records.append(record)
                    jsonl.log(record)
                    wandb.log(record)
                    print(format_console(record, t.steps), flush=True)
                interval_start, interval_steps = time.perf_counter(), 0
                self.optimizer.reset_memory_peak()
            if (t.save_every and self.step % t.save_every == 0) or self.step == end:
                if self.save_checkpoint():
                    result.checkpoints.append(self.step)
        result.last_step = self.step
        result.wall_time = time.perf_counter() - t0
        if wandb is not None:
            last = result.records[-1] if result.records else {}
            wandb.finish({"final_loss": last.get("loss"), "steps": self.step, "wall_time_s": result.wall_time})
        return result

    def _banner(self, resume_dir: str | None) -> None:
        rj, t = self.rj, self.rj.job.train
        n = sum(p.numel() for c in self.chunks for p in c.parameters())
        offload = rj.job.parallel.offload
        print(
            f"parallel3d: {rj.model.name or rj.model.arch} | {rj.topology.describe()} | zero_stage="
            f"{rj.job.parallel.zero_stage}{'' if offload == 'none' else f' offload={offload}'} | "
            f"schedule={rj.job.parallel.schedule} | global_batch="
            f"{t.global_batch_size} = micro {t.micro_batch_size} x accum {rj.grad_accum} x dp {rj.topology.dp} | "
            f"seq {t.seq_len} | {t.precision} on {self.pstate.device} | params on this rank {n:,} | "
            + (f"resumed from {resume_dir} at step {self.step}" if resume_dir else "fresh start"),
            flush=True,
        )
        if self.step >= t.steps:
            print(f"already trained to train.steps={t.steps}: nothing to do (train.resume=none starts over, "
                  f"or raise train.steps)", flush=True)


def train(rj: ResolvedJob, pstate: ParallelState | None = None, full_config: dict[str, Any] | None = None) -> TrainResult:
    """Train ``rj`` on this rank (all ranks call it); builds the ParallelState unless given."""
    if pstate is None:
        pstate = make_parallel_state(rj)
    if rj.device == "cpu":
        torch.set_flush_denormal(True)  # denormals slow CPU matmuls 100x (ENVIRONMENT.md)
    return Trainer(rj, pstate, full_config).train()

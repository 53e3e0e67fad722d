"""The training loop: build this rank's pieces from a ``ResolvedJob``, train, log, checkpoint.

Per rank: the model chunks of its pipeline stage (``models.build_model`` over the
layer ranges of ``pipeline.partition``), one ``ZeroOptimizer`` over them, one
``PipelineEngine`` running the schedule with the optimizer's gradient sync, and a
``DistributedBatchIterator`` over the job's dataset. One step = one global batch
of ``train.global_batch_size`` samples = ``grad_accum`` micro-batches per DP rank.

Context parallel (``parallel.cp``): ``_to_device`` splits each microbatch's tokens and labels
for this cp rank (train and eval); ``rank_build.build_chunks`` builds the one ``ContextParallelAttention``.

Logging: every rank takes part in the per-log-step reductions (loss over dp x cp on
the last stage; memory, bubble and communication over the world); only the
logging rank (last stage, tp=0, dp=0: it has the loss) writes metrics.jsonl,
W&B and the console line. Steps are numbered from 1 (the record of step k
describes the k-th optimizer step).

Evaluation (``parallel3d/eval.py``) runs every ``train.eval_every`` steps and at the end, forward only
through the pipeline; a step with an evaluation is always logged, its record carrying ``eval_loss`` /
``eval_ppl``. ``train.eval_only`` runs it once instead of training (``parallel3d/eval_only.py``; restored
with ``strict_data=False``: no training batch is read). Console lines carry elapsed time and ETA
(``progress.RunClock``), a line per saved checkpoint; the banner, the end summary and ``TrainResult`` are
``parallel3d/run_result.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from parallel3d import data, user_warnings
from parallel3d.checkpoint import read_meta, step_dir
from parallel3d.checkpoint_io.hf_init import load_hf_weights
from parallel3d.checkpoint_io.resume import layout_record, load_training_state, save_request
from parallel3d.checkpoint_io.writer import CheckpointWriter
from parallel3d.config import ResolvedJob
from parallel3d.context_parallel import split_batch_for_cp
from parallel3d.datasets import build_datasets
from parallel3d.divergence import DivergenceGuard, stop_run
from parallel3d.eval import EvalResult, Evaluator
from parallel3d.eval_only import evaluate_once
from parallel3d.heartbeat import Heartbeat, beat_interval
from parallel3d.metrics import JsonlSink, StepTimer, ThroughputModel, WandbSink, format_console, resolve_peak_tflops
from parallel3d.moe_step import MoEStep
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.engine import PipelineEngine
from parallel3d.pipeline.microbatch import DOCUMENT_IDS, SAMPLE_IDS, with_documents
from parallel3d.planning.cli import job_w_lags
from parallel3d.preemption import StopPolicy
from parallel3d.progress import RunClock, checkpoint_line
from parallel3d.resume_notes import lr_schedule, nothing_to_do_line, schedule_change
from parallel3d.rank_build import build_chunks, make_parallel_state
from parallel3d.run_result import TrainResult, banner, run_summary
from parallel3d.step_record import StepRecorder
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.precision import precision_dtype


class Trainer:
    """One rank's training run; see module doc. ``full_config`` is the resolved Hydra config (for W&B/meta)."""

    def __init__(self, rj: ResolvedJob, pstate: ParallelState, full_config: dict[str, Any] | None = None) -> None:
        self.rj, self.pstate = rj, pstate
        # Constructed first, so the time budget counts the set-up too.
        self.stop_policy = StopPolicy(pstate, list(rj.stop.preempt_signal), rj.stop.max_minutes)
        self.full_config = full_config or {}
        t, o, p = rj.job.train, rj.optimizer, rj.job.parallel
        self.chunks = build_chunks(rj, pstate)
        self.optimizer = ZeroOptimizer(
            self.chunks, pstate, **dataclasses.asdict(rj.zero), lr=o.lr, betas=o.betas, eps=o.eps,
            weight_decay=o.weight_decay, clip_grad=o.clip_grad or None, precision=t.precision,
            loss_scale_init=o.loss_scale_init,
            # kernels.backend=torch means torch everywhere, the optimizer's fused update included.
            fused_adamw_backend="torch" if rj.model.kernel_backend == "torch" else "auto",
            lr_schedule=lr_schedule(o, t.steps),
        )
        self.engine = PipelineEngine(
            self.chunks, pstate, schedule=p.schedule, num_microbatches=rj.grad_accum,
            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len // p.cp, hidden_size=rj.model.hidden_size,
            dtype=precision_dtype(t.precision), sequence_parallel=p.sequence_parallel,
            grad_sync=self.optimizer.grad_sync, w_lags=job_w_lags(rj),
            split_drain=rj.pipeline.splits_drain(rj.train.recompute),
        )
        self.moe = MoEStep(self.chunks, rj.model, pstate, p.sequence_parallel)
        train_set, valid_set, tokenizer = build_datasets(rj, pstate)
        self.eod_id = data.document_eod_id(rj.data.document_mask, tokenizer)
        keys = with_documents(self.engine.microbatch_keys, self.eod_id is not None)
        self.batches = data.DistributedBatchIterator.for_rank(train_set, pstate, t.global_batch_size,
                                                              t.micro_batch_size, keys=keys, eod_id=self.eod_id)
        self.evaluator = (Evaluator(rj, pstate, self.chunks, valid_set, self._to_device, eod_id=self.eod_id)
                          if valid_set is not None and t.eval_iters > 0 else None)
        if pstate.rank == 0:  # the run directory carries its tokenizer: export needs nothing else
            if tokenizer is not None:
                data.save_run_tokenizer(tokenizer, t.out_dir)
            else:
                user_warnings.warn("data.source=indexed without data.tokenizer_file: the run directory has no tokenizer, "
                                   "so HF export will need --tokenizer")
        # Async saves stage the whole shard in host memory; a disk-offloaded state does not fit
        # there by assumption, so it is streamed from its memory-mapped files synchronously.
        self.checkpoints = CheckpointWriter(os.path.join(t.out_dir, "checkpoints"), pstate, keep_last=t.keep_last,
                                            async_save=t.async_save and p.offload != "disk", timeout_s=t.timeout_s,
                                            keep=rj.checkpoint.resume_dir)  # recovery never moves it
        self.ckpt = self.checkpoints.manager
        self._save_started: dict[int, float] = {}  # step -> when its (possibly background) save began
        self.is_logging_rank = pstate.is_logging_rank()
        self.throughput = ThroughputModel.build(
            rj.model, seq_len=t.seq_len, global_batch_size=t.global_batch_size, world_size=rj.world_size,
            recompute=t.recompute,
            # An evaluation-only run computes no MFU: no warning that the peak is unknown.
            peak_tflops=resolve_peak_tflops(t.peak_tflops, pstate.device, t.precision)
            if self.is_logging_rank and not rj.train.eval_only else t.peak_tflops,
        )
        self.recorder = StepRecorder(pstate, self.optimizer, self.moe, self.throughput, self.is_logging_rank)
        self.guard = DivergenceGuard(t.on_nonfinite, self.optimizer.scaler, announce=self.is_logging_rank)
        self.step = 0
        self.wandb_id: str | None = None
        self._wandb_dir: str | None = None

    # ---- checkpoints -------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        opt = self.optimizer
        return {
            "step": self.step,
            "data": self.batches.state_dict(),
            "iteration": opt.iteration,  # drives the LR schedule
            "adam_step": opt.adam_step,
            "scaler": opt.scaler.state_dict(),  # state only: the scaler's settings come from this run
            "wandb_id": self.wandb_id,
            **self.guard.state_dict(),  # skipped steps in a row: a resumed run counts on
            # Dropout masks, data order and init derive from (seed, step, sample id, layer): no RNG
            # stream of any rank needs saving, and none depends on the layout.
            "seed": self.rj.job.train.seed,
        }

    def save_checkpoint(self) -> None:
        """Collective: save this step (in the background with ``train.async_save``); see ``checkpoint_io``."""
        self.checkpoints.save(self.step, *save_request(
            self.optimizer, self.pstate, self._trainer_state() if self.is_logging_rank else None, self.rj.model,
            layout_record(self.rj), self.rj.job.train.precision, self.full_config))

    def _report_saves(self, finished: list[tuple[int, bool]]) -> list[int]:
        """The steps of ``finished`` saves that succeeded; the logging rank prints a line for each
        (path, size, seconds from the start of the save to its commit)."""
        done = []
        for step, ok in finished:
            started = self._save_started.pop(step, None)
            if not ok:
                continue
            done.append(step)
            if self.is_logging_rank and started is not None:
                print(checkpoint_line(step, step_dir(self.ckpt.root, step), time.perf_counter() - started), flush=True)
        return done

    def load_checkpoint(self, directory: str, strict_data: bool = True) -> None:
        """Collective: restore weights, optimizer and trainer state written at any layout (``strict_data``: restore)."""
        state = load_training_state(directory, self.optimizer, self.pstate, self.rj.model, self.checkpoints.group)
        self.step = int(state["step"])
        self.batches.load_state_dict(state["data"], strict=strict_data)
        self.optimizer.iteration = int(state["iteration"])
        self.optimizer.adam_step = int(state["adam_step"])
        self.optimizer.scaler.load_state_dict(state["scaler"])
        self.guard.load_state_dict(state)
        self.wandb_id = state.get("wandb_id")
        note = schedule_change(read_meta(directory).get("config") or {}, self.rj.optimizer,
                               self.rj.job.train.steps, self.optimizer.iteration)
        if note and self.is_logging_rank:
            user_warnings.warn(note)
        if state.get("seed") != self.rj.job.train.seed:
            user_warnings.warn(f"resuming a run trained with train.seed={state.get('seed')} with train.seed="
                               f"{self.rj.job.train.seed}: dropout masks and data order change from here")

    def restore(self, strict_data: bool = True) -> str | None:
        """Collective: load ``train.resume``'s checkpoint (returned), else ``train.init_from``'s weights."""
        t = self.rj.job.train
        resume_dir = self.ckpt.find(t.resume)
        if resume_dir is not None:
            self.load_checkpoint(resume_dir, strict_data)
        elif t.init_from is not None:
            load_hf_weights(self.optimizer, self.pstate, t.init_from, self.rj.model)
        return resume_dir

    # ---- one step --------------------------------------------------------------------
    def _to_device(self, microbatches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        cp = self.pstate.size("cp")
        if cp > 1:  # labels were shifted on the whole sequence (the dataset's s+1 tokens); now the share
            microbatches = [split_batch_for_cp(mb, cp, self.pstate.coord("cp"), keep_whole=(DOCUMENT_IDS, SAMPLE_IDS))
                            for mb in microbatches]
        if self.pstate.device.type == "cpu":
            return microbatches
        # A non_blocking copy from pageable host memory is synchronous on CUDA: pin first, so the
        # step's token copies overlap the previous step's tail instead of stalling the host.
        return [{k: v.pin_memory().to(self.pstate.device, non_blocking=True) for k, v in mb.items()}
                for mb in microbatches]

    # ---- the run ---------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train to ``train.steps`` (or ``stop_after``, or until ``StopPolicy`` stops the run)."""
        heartbeat = None
        if self.pstate.world_size > 1:  # names a hung rank when a collective times out (heartbeat.py)
            heartbeat = Heartbeat(self.rj.job.train.out_dir, self.pstate.rank, beat_interval(self.rj.job.train.timeout_s))
            heartbeat.start()
        self.stop_policy.install()
        try:
            return self._evaluate_only() if self.rj.train.eval_only else self._train(heartbeat)
        except BaseException:
            # The previous step's checkpoint may still be written in the background: finish it (its
            # collectives time out after train.timeout_s) rather than lose it with this process.
            self.checkpoints.settle(self.rj.job.train.timeout_s)
            raise
        finally:
            self.stop_policy.uninstall()
            if heartbeat is not None:
                heartbeat.stop()

    def _train(self, heartbeat: Heartbeat | None) -> TrainResult:
        t, lg = self.rj.job.train, self.rj.job.logging
        t0 = time.perf_counter()
        resume_dir = self.restore()
        result = TrainResult(rank=self.pstate.rank, start_step=self.step, last_step=self.step)
        jsonl = wandb = None
        if self.is_logging_rank:
            jsonl = JsonlSink(os.path.join(t.out_dir, "metrics.jsonl"),
                              keep_through_step=self.step if resume_dir else None)
            wandb = WandbSink(mode=lg.wandb.mode, project=lg.wandb.project, entity=lg.wandb.entity,
                              name=lg.wandb.name, run_dir=t.out_dir, config=self.full_config, resume_id=self.wandb_id,
                              init_timeout_s=lg.wandb.init_timeout_s)
            self.wandb_id = wandb.run_id
            self._wandb_dir = wandb.run_dir
            self._banner(resume_dir)
        end = self.rj.train.last_step()
        if resume_dir is not None and self.step < end:  # checkpoints after the one resumed are now another branch
            self.ckpt.branch_from(resume_dir)
        clock = RunClock(self.step, end, eval_every=t.eval_every, evaluating=self.evaluator is not None)
        timer = StepTimer(self.pstate.device)
        # Throughput is averaged over the whole log interval (data, step, logging and
        # checkpoints included, evaluation excluded), as Megatron reports it, not taken from one step.
        interval_start, interval_steps, interval_eval = time.perf_counter(), 0, 0.0
        while self.step < end:
            iteration_start = time.perf_counter()
            timer.start()
            before = self.pstate.comm_stats.by_kind()
            microbatches = self._to_device(next(self.batches))
            self.optimizer.zero_grad()
            self.moe.before_step(self.optimizer.loss_scale, self.rj.grad_accum)
            # The activation accounting (saved-tensor hooks) costs every forward: only log steps read it.
            step_result = self.engine.run_step(microbatches, loss_scale=self.optimizer.loss_scale, step=self.step,
                                               account_activations=self._logs_after(self.step + 1, end))
            self.moe.finish()
            info = self.optimizer.step()
            timer.stop()  # synchronises the device so the interval below is honest
            comm_bytes = self.recorder.comm_delta(before)
            self.step += 1
            self._stop_if_diverged(self.guard.after_step(self.step, info), info, step_result.loss, result.checkpoints)
            if heartbeat is not None:
                heartbeat.completed(self.step)
            interval_steps += 1
            evaluation = self._maybe_evaluate(end)
            if evaluation is not None:
                interval_eval += evaluation.seconds
                clock.add_eval(evaluation.seconds)
            if self._logs_after(self.step, end):
                step_time = (time.perf_counter() - interval_start - interval_eval) / interval_steps
                record = self.recorder.record(self.step, step_time, step_result, info, comm_bytes)
                if record is not None:
                    if evaluation is not None:
                        record.update(evaluation.metrics())
                    record.update(clock.metrics(self.step))
                    result.records.append(record)
                    jsonl.log(record)
                    wandb.log(record)
                    print(format_console(record, t.steps), flush=True)
                interval_start, interval_steps, interval_eval = time.perf_counter(), 0, 0.0
                self.optimizer.reset_memory_peak()
            saving = (t.save_every and self.step % t.save_every == 0) or self.step == end
            stop = None if self.step == end else self.stop_policy.should_stop(time.perf_counter() - iteration_start)
            if saving or stop is not None:
                self._stop_if_diverged(self.guard.saving_verdict(self.optimizer, self.pstate), info,
                                       step_result.loss, result.checkpoints)
                self._save_started[self.step] = time.perf_counter()
                self.save_checkpoint()
            result.checkpoints += self._report_saves(self.checkpoints.completed())
            if stop is not None:
                result.stopped = stop
                if self.is_logging_rank:
                    print(f"stopping at step {self.step} of {t.steps}: {stop}; saving a checkpoint "
                          f"(train.resume=auto continues from it)", flush=True)
                break
            clock.add_step(time.perf_counter() - iteration_start - (evaluation.seconds if evaluation else 0.0))
        self.optimizer.finish_param_sync()  # whoever reads the model after training sees final weights
        result.checkpoints += self._report_saves(self.checkpoints.close())
        result.last_step = self.step
        result.wall_time = time.perf_counter() - t0
        result.summary = run_summary(self.rj, self.pstate, result, clock, self.throughput, self.ckpt.root,
                                     [self._wandb_dir] if self._wandb_dir else [])  # collective
        if result.summary is not None:
            for line in result.summary.lines():
                print(line, flush=True)
        if wandb is not None:
            wandb.finish(result.summary.wandb() if result.summary else {})
        return result

    def _evaluate_only(self) -> TrainResult:
        """``train.eval_only``: one evaluation of the restored weights (``parallel3d.eval_only``), nothing trained."""
        resume_dir = self.restore(strict_data=False)  # no training batch is read: any data order will do
        record, stopped = evaluate_once(self.rj, self.pstate, self.evaluator, self.step, resume_dir, self.full_config,
                                        interrupt=lambda: self.stop_policy.should_stop(0.0))
        return TrainResult(self.pstate.rank, self.step, self.step, [record] if record else [], stopped=stopped)

    def _stop_if_diverged(self, reason: str | None, info: Any, loss: float | None, saved: list[int]) -> None:
        """Collective: raise ``TrainingDiverged`` for ``reason`` (``divergence``: every rank has the same one),
        before anything of this step is saved; a save still in flight (an earlier, good step) finishes first."""
        if reason is not None:
            loss = self.recorder.dp_mean_loss(loss)
            saved = saved + self._report_saves(self.checkpoints.wait())
            last = step_dir(self.ckpt.root, saved[-1]) if saved else self.ckpt.latest()
            stop_run(self.step, reason, loss, info, last, self.is_logging_rank)

    def _evaluates_after(self, step: int, end: int) -> bool:
        """Whether the run evaluates once ``step`` steps are done (every ``eval_every``, and the last)."""
        every = self.rj.job.train.eval_every
        return self.evaluator is not None and (bool(every and step % every == 0) or step == end)

    def _logs_after(self, step: int, end: int) -> bool:
        """Whether a metrics record is written once ``step`` steps are done: every ``log_every``, the
        last step and evaluation steps. Known before the step runs, so it asks the engine for the
        activation bytes the record reads (the same on every rank: the record is collective)."""
        return step % self.rj.job.logging.log_every == 0 or step == end or self._evaluates_after(step, end)

    def _maybe_evaluate(self, end: int) -> EvalResult | None:
        """Collective: evaluate after this step if it is an eval step (``_evaluates_after``)."""
        if not self._evaluates_after(self.step, end):
            return None
        result = self.evaluator.evaluate(self.step, interrupt=lambda: self.stop_policy.should_stop(0.0))
        if result.interrupted is not None and self.is_logging_rank:
            print(f"evaluation after step {self.step} stopped after {result.batches} of {self.evaluator.iters} "
                  f"batches: {result.interrupted}; no eval_loss logged for it", flush=True)
        return result

    def _banner(self, resume_dir: str | None) -> None:
        print(banner(self.rj, self.chunks, self.pstate.device, resume_dir, self.step), flush=True)
        if idle := nothing_to_do_line(self.rj.train, self.step):
            print(idle, flush=True)


def train(rj: ResolvedJob, pstate: ParallelState | None = None, full_config: dict[str, Any] | None = None) -> TrainResult:
    """Train ``rj`` on this rank (all ranks call it); builds the ParallelState unless given."""
    if pstate is None:
        pstate = make_parallel_state(rj)
    if rj.device == "cpu":
        torch.set_flush_denormal(True)  # denormals slow CPU matmuls 100x (ENVIRONMENT.md)
    return Trainer(rj, pstate, full_config).train()

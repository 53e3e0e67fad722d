"""``train.eval_only=true``: evaluate one set of weights once, train nothing, write no checkpoint.

Megatron-LM's ``--skip-train`` (torchtitan has none). The weights are the ones a training run of the same
config would start from (``Trainer.restore``: ``train.resume``'s checkpoint, else ``train.init_from``, else the
seed's init), at any layout; the training data's position is not read, so the data may differ from the
checkpoint's (another validation set: ``data.valid_paths``). The evaluation is the trainer's own
``Evaluator``, so its ``eval_loss`` is the number a training run logs at that checkpoint's step.

Invariant: what it writes is one evaluation record, the keys a training run's evaluation adds to its step's
record (``EvalResult.metrics``) plus ``step`` (the checkpoint's; 0 for an init) and ``elapsed_s``, appended to
``metrics.jsonl`` (the run's history is kept whole) and logged to a new W&B run (a resumed one would drop a
step it has already logged); no checkpoint, no training record.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

from parallel3d.config import ResolvedJob
from parallel3d.eval import Evaluator
from parallel3d.metrics import JsonlSink, WandbSink

if TYPE_CHECKING:  # pragma: no cover
    from parallel3d.parallel_state import ParallelState


def weights_line(rj: ResolvedJob, resume_dir: str | None, step: int) -> str:
    """Which weights are evaluated, for the run's one line."""
    if resume_dir is not None:
        return f"checkpoint {resume_dir} (step {step})"
    if rj.checkpoint.init_from is not None:
        return f"the weights of train.init_from={rj.checkpoint.init_from} (step 0)"
    return f"the initial weights of train.seed={rj.train.seed} (step 0: no checkpoint in {rj.train.out_dir})"


def evaluate_once(
    rj: ResolvedJob, pstate: "ParallelState", evaluator: Evaluator, step: int, resume_dir: str | None,
    full_config: dict[str, Any], interrupt: Callable[[], str | None],
) -> tuple[dict[str, Any] | None, str | None]:
    """Collective: evaluate the loaded weights (module doc). Returns ``(record, stopped)``: the logged record on
    the logging rank (None elsewhere, or when stopped), and why a stop signal cut the evaluation short."""
    start = time.perf_counter()
    result = evaluator.evaluate(step, interrupt=interrupt)
    if not pstate.is_logging_rank():
        return None, result.interrupted
    t, lg = rj.train, rj.logging
    what = weights_line(rj, resume_dir, step)
    if result.interrupted is not None:
        print(f"eval only: {what}: stopped after {result.batches} of {evaluator.iters} batches: {result.interrupted}; "
              f"no eval_loss logged", flush=True)
        return None, result.interrupted
    record = {"step": step, **result.metrics(), "elapsed_s": time.perf_counter() - start}
    JsonlSink(os.path.join(t.out_dir, "metrics.jsonl"), append=True).log(record)
    wandb = WandbSink(mode=lg.wandb.mode, project=lg.wandb.project, entity=lg.wandb.entity, name=lg.wandb.name,
                      run_dir=t.out_dir, config=full_config, init_timeout_s=lg.wandb.init_timeout_s)
    wandb.log(record)
    wandb.finish({})
    print(f"eval only: {what}: eval_loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f} over "
          f"{evaluator.iters} validation batches of {t.global_batch_size} x {t.seq_len} tokens "
          f"({result.seconds:.1f} s); nothing trained, no checkpoint written; the record is in "
          f"{os.path.join(t.out_dir, 'metrics.jsonl')}" + (f" and {wandb.run_dir}" if wandb.run_dir else ""),
          flush=True)
    return record, None

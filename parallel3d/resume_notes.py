"""What a resume tells the user about what it changes or cannot do: one line each, never silent.

A resumed run follows *this* run's ``optimizer.lr`` / ``min_lr`` / ``warmup_steps`` and ``train.steps`` (the
cosine's length), as Megatron-LM does with ``--override-opt_param-scheduler``; without that flag Megatron
refuses such a resume, so a user coming from it expects to hear about the change. ``meta.json`` holds the
resolved config of the run that wrote the checkpoint; ``schedule_change`` names each changed key and the
next step's lr under both schedules. Invariant: the schedule is ``zero.lr_schedule.WarmupCosine``, built
here from the same options the trainer builds it from; this module only compares.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, get_type_hints

from parallel3d.train_options import TrainOptions
from parallel3d.zero.lr_schedule import WarmupCosine
from parallel3d.zero.options import OptimizerOptions

# (section, key) of the resolved config that shape the schedule: every other list of them derives from this.
SCHEDULE_KEYS = (("optimizer", "lr"), ("optimizer", "min_lr"), ("optimizer", "warmup_steps"), ("train", "steps"))


def lr_schedule(optimizer: OptimizerOptions, steps: int) -> WarmupCosine:
    """The run's schedule: linear warm-up, cosine decay to ``min_lr`` at ``train.steps``."""
    return WarmupCosine(max_lr=optimizer.lr, min_lr=optimizer.min_lr, warmup_steps=optimizer.warmup_steps,
                        decay_steps=steps)


def _schedule_values(config: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """``config``'s value of each of ``SCHEDULE_KEYS`` (KeyError or TypeError where it does not hold one)."""
    return {(section, key): config[section][key] for section, key in SCHEDULE_KEYS}


def _saved_schedule(saved: dict[tuple[str, str], Any]) -> WarmupCosine:
    """The schedule of a checkpoint's ``_schedule_values``, each optimizer value read as its option's type."""
    types = get_type_hints(OptimizerOptions)
    optimizer = OptimizerOptions(**{key: types[key](value) for (section, key), value in saved.items()
                                    if section == "optimizer"})
    return lr_schedule(optimizer, int(saved["train", "steps"]))


def schedule_change(saved_config: dict[str, Any], optimizer: OptimizerOptions, steps: int, iteration: int) -> str | None:
    """The warning for a resume at optimizer ``iteration`` whose schedule differs from the one recorded in the
    checkpoint's ``saved_config`` (None: the same, or a config that does not record it)."""
    now = _schedule_values({"optimizer": asdict(optimizer), "train": {"steps": steps}})
    try:
        saved = _schedule_values(saved_config)
        before = _saved_schedule(saved)(iteration)
    except (KeyError, TypeError, ValueError):
        return None  # a config without these keys (hand-made, or older): nothing to compare
    changed = [f"{section}.{key} {saved[section, key]} -> {now[section, key]}" for section, key in SCHEDULE_KEYS
               if saved[section, key] != now[section, key]]
    if not changed:
        return None
    after = lr_schedule(optimizer, steps)(iteration)
    return (f"resuming with another learning-rate schedule than the checkpoint's run ({', '.join(changed)}): the "
            f"next step's lr is {after:.3g} where the checkpoint's schedule gives {before:.3g}; this run's values "
            f"apply from here (as Megatron's --override-opt_param-scheduler)")


def nothing_to_do_line(train: TrainOptions, step: int) -> str | None:
    """What a run resumed at ``step`` prints when it will train no step (None when it trains): it is at
    ``train.steps``, or at or past ``train.stop_after`` (``TrainOptions.last_step``). It exits 0, as Megatron-LM
    does from a checkpoint at ``--train-iters``; the line says why, rather than a summary of 0 steps alone."""
    if step >= train.steps:
        return already_trained_line(train.steps, step)
    if step >= train.last_step():
        return (f"train.stop_after={train.stop_after} is at or below the checkpoint's step {step}: nothing to do; "
                f"raise train.stop_after, or set train.stop_after=null to train on to train.steps={train.steps}")
    return None


def already_trained_line(steps: int, step: int) -> str:
    """What a resume that is already at (or past) ``train.steps`` prints. Not ``train.resume=none``: that
    is refused while ``train.out_dir`` holds checkpoints (``preflight``)."""
    return (f"already trained to train.steps={steps} (checkpoint at step {step}): nothing to do; raise train.steps "
            f"to go on, or start over in another train.out_dir")

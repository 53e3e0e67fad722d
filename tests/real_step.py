"""One real rank's held bytes and one step's messages: the reference a dry run is compared with.

``held_and_sent(trainer)`` reads the bytes from the tensors of the real ``Trainer``'s optimizer
(``optimizer_bytes.held_state_bytes``: device state, and what offloading keeps in host memory) and then
runs one training step as ``Trainer.train`` does (the cp split of ``_to_device``, ``zero_grad``, the MoE
layers' ``before_step``, the engine, ``MoEStep.finish``, the optimizer step, the parameter sync), counting
every message through ``comm`` (``pstate.comm_stats``: calls and bytes per group kind and op).
"""

from __future__ import annotations

from parallel3d.trainer import Trainer
from tests.optimizer_bytes import held_state_bytes

Sent = dict[str, tuple[int, int]]  # "<group kind> <op>" -> (calls, bytes)


def held_and_sent(trainer: Trainer) -> tuple[dict[str, int], Sent]:
    """({params, param_bytes, grad_bytes, optimizer_state_bytes, offloaded_bytes, activation_bytes}, messages)."""
    opt = trainer.optimizer
    state = held_state_bytes(opt)  # experts at another ZeRO stage: summed over its parts (zero.mixed)
    held = {"params": sum(p.numel() for c in trainer.chunks for p in c.parameters()),
            "param_bytes": state["weights"], "grad_bytes": state["gradients"],
            "optimizer_state_bytes": state["masters"] + state["moments"], "offloaded_bytes": state["offloaded"]}
    stats = trainer.pstate.comm_stats  # then one real step: what this rank's collectives counted
    stats.reset()
    microbatches = trainer._to_device(next(trainer.batches))  # the trainer's own cp split (parallel.cp > 1)
    opt.zero_grad()
    trainer.moe.before_step(opt.loss_scale, trainer.rj.grad_accum)  # as Trainer.train's step (MoE jobs)
    result = trainer.engine.run_step(microbatches, loss_scale=opt.loss_scale, step=0, account_activations=True)
    trainer.moe.finish()
    held["activation_bytes"] = result.peak_activation_bytes  # the engine's count on real storages
    opt.step()
    opt.finish_param_sync()
    sent = {f"{kind} {op}": (stats.calls[(kind, op)], stats.bytes[(kind, op)]) for kind, op in stats.bytes}
    return held, sent

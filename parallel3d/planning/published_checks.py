"""Consistency checks of one published run; each failure is one error naming the run and field.

- the layout's arithmetic: ``tp*pp*cp*dp == gpus``, the global batch splits into whole
  micro-batches per data-parallel rank, expert groups (``ep*etp``) fold into ``tp*cp*dp``;
- the shape: heads divide by kv heads and by tp, experts by ep;
- the published numbers agree with each other (TFLOP/s / peak vs MFU, tokens/s vs step time)
  and with the device catalogue's peak;
- conventions are named from fixed vocabularies, and every ``inferred`` key names a real field;
- the rank check's metadata: ``unstated`` fields are completable and inferred, ``rank_fixed`` degrees stated.
"""

from __future__ import annotations

from typing import Any, Mapping

from parallel3d.config import PRECISIONS, RECOMPUTE, SCHEDULES
from parallel3d.planning.devices import DEVICES
from parallel3d.planning.published_schema import PublishedRun

SPLITS = ("calibration", "held_out", "reference")
RUN_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp32") + ("fp8",)
# The training config's schedules, plus those only published runs use; "none" when pp = 1.
RUN_SCHEDULES = ("none",) + SCHEDULES + ("dualpipe",)
# A published run's K/V exchange: the runtime's single-level variants (a2a+p2p needs a size no source states).
RUN_CP_COMMS = ("p2p", "allgather", "a2a")
MLPS = ("gelu", "swiglu", "squared_relu")
ATTENTIONS = ("mha", "gqa", "mla", "gqa_swa")
ANSWERS = ("yes", "no", "n/a", "unknown")
ATTENTION_COUNTING = ("full", "causal", "none", "unknown", "n/a")
METRICS = ("mfu_percent", "hfu_percent", "tflops_per_gpu", "tokens_per_s_per_gpu", "step_time_s")
# Published percentages are rounded (often to whole percents): TFLOP/s over the peak may differ
# from the printed MFU by this many points, and tokens/s from batch/step time by this fraction.
MFU_POINTS_TOLERANCE = 1.0
RATE_TOLERANCE = 0.02
# Fields the rank check may complete when the source leaves them unstated (the knobs the search itself
# chooses per layout), and the parallel degrees a source may state its experiment held fixed.
UNSTATED_FIELDS = ("layout.vp", "layout.schedule", "layout.micro_batch")
FIXED_FIELDS = ("layout.tp", "layout.pp", "layout.cp", "layout.ep", "layout.dp")


def fail(run_id: str, message: str) -> ValueError:
    return ValueError(f"published_runs.yaml: run {run_id!r}: {message}")


def _choice(run_id: str, path: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise fail(run_id, f"{path}={value!r} is not one of {allowed}")


def _field_paths(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, Mapping) and key != "inferred":
            paths |= _field_paths(value, path + ".")
    return paths


def _check_shape(run: PublishedRun) -> None:
    m, lay, rid = run.model, run.layout, run.id
    _choice(rid, "model.mlp", m.mlp, MLPS)
    _choice(rid, "model.attention", m.attention, ATTENTIONS)
    for key in ("layers", "hidden", "heads", "kv", "ffn", "vocab"):
        if getattr(m, key) < 1:
            raise fail(rid, f"model.{key} must be >= 1")
    if m.heads % m.kv:
        raise fail(rid, f"model.heads={m.heads} is not divisible by model.kv_heads={m.kv}")
    if m.head_dim is None and m.hidden % m.heads:
        raise fail(rid, f"model.hidden={m.hidden} is not divisible by model.heads={m.heads} (set model.head_dim)")
    if (m.attention == "mla") != (m.mla is not None):
        raise fail(rid, "model.mla is required with model.attention='mla' and only then")
    if m.attention != "mla" and (m.attention == "mha") != (m.kv == m.heads):
        raise fail(rid, f"model.attention={m.attention!r} with kv_heads={m.kv}, heads={m.heads}: "
                         "'mha' exactly when they are equal")
    if m.heads % lay.tp:
        raise fail(rid, f"model.heads={m.heads} is not divisible by layout.tp={lay.tp}")
    if m.moe is None:
        if lay.ep != 1 or lay.etp != 1:
            raise fail(rid, f"a dense model needs layout.ep = layout.etp = 1, got {lay.ep}, {lay.etp}")
        return
    e = m.moe
    if not 1 <= e.top_k <= e.experts or e.expert_ffn < 1 or e.dense_layers >= m.layers:
        raise fail(rid, "model.moe needs 1 <= top_k <= experts, expert_ffn >= 1 and dense_layers < layers")
    if (e.shared_experts == 0) != (e.shared_expert_ffn == 0):
        raise fail(rid, "model.moe.shared_experts and shared_expert_ffn must both be 0 or both > 0")
    if e.experts % lay.ep:
        raise fail(rid, f"model.moe.experts={e.experts} is not divisible by layout.ep={lay.ep}")


def _check_layout(run: PublishedRun) -> None:
    lay, rid = run.layout, run.id
    for key in ("tp", "pp", "vp", "cp", "ep", "etp", "dp", "micro_batch"):
        if getattr(lay, key) < 1:
            raise fail(rid, f"layout.{key} must be >= 1")
    _choice(rid, "layout.recompute", lay.recompute, RECOMPUTE)
    _choice(rid, "layout.schedule", lay.schedule, RUN_SCHEDULES)
    _choice(rid, "layout.precision", lay.precision, RUN_PRECISIONS)
    _choice(rid, "layout.cp_comm", lay.cp_comm, RUN_CP_COMMS)
    _choice(rid, "layout.zero_stage", lay.zero_stage, (0, 1, 2, 3))
    gpus = run.hardware.gpus
    if lay.tp * lay.pp * lay.cp * lay.dp != gpus:
        raise fail(rid, f"layout.tp*pp*cp*dp = {lay.tp}*{lay.pp}*{lay.cp}*{lay.dp} = "
                         f"{lay.tp * lay.pp * lay.cp * lay.dp} != hardware.gpus={gpus}")
    if (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp):
        raise fail(rid, f"layout.ep*etp={lay.ep * lay.etp} does not fold into tp*cp*dp={lay.tp * lay.cp * lay.dp}")
    if run.batch.global_batch % (lay.micro_batch * lay.dp):
        raise fail(rid, f"batch.global_batch={run.batch.global_batch} is not divisible by "
                         f"layout.micro_batch*dp={lay.micro_batch * lay.dp}")
    if (lay.pp == 1) != (lay.schedule == "none"):
        raise fail(rid, f"layout.schedule={lay.schedule!r} with layout.pp={lay.pp}: 'none' exactly when pp = 1")
    if lay.vp > 1 and lay.schedule != "interleaved_1f1b":
        raise fail(rid, f"layout.vp={lay.vp} needs layout.schedule='interleaved_1f1b'")
    if lay.schedule == "interleaved_1f1b" and lay.vp < 2:
        raise fail(rid, "layout.schedule='interleaved_1f1b' needs layout.vp >= 2")
    if lay.sequence_parallel and lay.tp == 1:
        raise fail(rid, "layout.sequence_parallel needs layout.tp > 1")
    if lay.cp > 1 and run.batch.seq_len % (2 * lay.cp):
        raise fail(rid, f"batch.seq_len={run.batch.seq_len} is not divisible by 2*layout.cp={2 * lay.cp}")
    if run.hardware.device not in DEVICES:
        raise fail(rid, f"hardware.device={run.hardware.device!r} is not in the device catalogue {sorted(DEVICES)}")
    if gpus > run.hardware.gpus_per_node and gpus % run.hardware.gpus_per_node:
        raise fail(rid, f"hardware.gpus={gpus} is not a multiple of hardware.gpus_per_node")


def _check_published(run: PublishedRun) -> None:
    pub, conv, rid = run.published, run.flops_convention, run.id
    _choice(rid, "published.primary", pub.primary, METRICS)
    if getattr(pub, pub.primary) is None:
        raise fail(rid, f"published.primary={pub.primary!r} has no value")
    for key in ("mfu_percent", "hfu_percent"):
        value = getattr(pub, key)
        if value is not None and not 0 < value <= 100:
            raise fail(rid, f"published.{key}={value} is not a percentage")
    if pub.mfu_percent is not None and pub.hfu_percent is not None and pub.hfu_percent < pub.mfu_percent:
        raise fail(rid, "published.hfu_percent < mfu_percent: hardware FLOPs include the model's")
    for key in ("recompute_counted", "gqa_accounted", "logits_counted"):
        _choice(rid, f"flops_convention.{key}", getattr(conv, key), ANSWERS)
    _choice(rid, "flops_convention.attention", conv.attention, ATTENTION_COUNTING)
    if (pub.mfu_percent is not None or pub.hfu_percent is not None) and conv.peak_tflops is None:
        raise fail(rid, "an MFU/HFU is published but flops_convention.peak_tflops is null")
    if conv.peak_tflops is not None:
        device_peak = DEVICES[run.hardware.device].peak_flops / 1e12
        if abs(conv.peak_tflops / device_peak - 1) > 0.01:
            raise fail(rid, f"flops_convention.peak_tflops={conv.peak_tflops} is not the catalogue's "
                             f"{run.hardware.device} peak {device_peak:g}")
    if pub.mfu_percent is not None and pub.tflops_per_gpu is not None:
        implied = 100 * pub.tflops_per_gpu / conv.peak_tflops
        if abs(implied - pub.mfu_percent) > MFU_POINTS_TOLERANCE:
            raise fail(rid, f"published.tflops_per_gpu / peak = {implied:.1f}% disagrees with "
                             f"published.mfu_percent={pub.mfu_percent}")
    if pub.tokens_per_s_per_gpu is not None and pub.step_time_s is not None:
        from_time = run.tokens_per_step / (pub.step_time_s * run.hardware.gpus)
        if abs(from_time / pub.tokens_per_s_per_gpu - 1) > RATE_TOLERANCE:
            raise fail(rid, f"published.tokens_per_s_per_gpu={pub.tokens_per_s_per_gpu} disagrees with the "
                             f"batch over published.step_time_s ({from_time:.1f})")


def validate_run(run: PublishedRun, data: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the run and field when ``run`` is inconsistent."""
    _choice(run.id, "split", run.split, SPLITS)
    _check_shape(run)
    _check_layout(run)
    _check_published(run)
    if not isinstance(run.inferred, Mapping) or not all(isinstance(v, str) and v for v in run.inferred.values()):
        raise fail(run.id, "inferred must map field paths to how each was inferred")
    valid = _field_paths({k: v for k, v in data.items() if k != "inferred"})
    bad = sorted(set(run.inferred) - valid)
    if bad:
        raise fail(run.id, f"inferred names field(s) that do not exist: {bad}")
    _check_rank_metadata(run)


def _check_rank_metadata(run: PublishedRun) -> None:
    """``unstated`` names completable fields the run also lists as inferred; ``rank_fixed`` holds only
    stated degrees, each with the source's words."""
    if not all(isinstance(f, str) for f in run.unstated) or len(set(run.unstated)) != len(run.unstated):
        raise fail(run.id, f"unstated={list(run.unstated)!r} must be a list of distinct field paths")
    for path in run.unstated:
        _choice(run.id, "unstated", path, UNSTATED_FIELDS)
        if path not in run.inferred:
            raise fail(run.id, f"unstated names {path}, which inferred does not explain")
    fixed = run.rank_fixed or {}
    if not isinstance(fixed, Mapping):
        raise fail(run.id, "rank_fixed must map layout degrees to the source's statement")
    for path, why in fixed.items():
        _choice(run.id, "rank_fixed", path, FIXED_FIELDS)
        if not isinstance(why, str) or not why:
            raise fail(run.id, f"rank_fixed.{path} needs the source's statement")
        if path in run.inferred:
            raise fail(run.id, f"rank_fixed holds {path}, which the source does not state (it is inferred)")

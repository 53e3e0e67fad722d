"""Training metrics: FLOPs / MFU, throughput, memory, and the JSONL / W&B / console sinks.

FLOPs convention (also in conf/README.md): the FLOPs per token come from the model's shape
(``models.shape``, ``ModelConfig.shape.flops_per_token``), counting matmuls only, 2 FLOPs per
multiply-add, as torch's FlopCounterMode does: every weight matmul of the layers, the attention
score and value matmuls (QK^T, PV), and the logits matmul ``h * V`` (also when tied to the
input embedding). Norms, activations, softmax, bias adds and embedding lookups are not counted.
- Model FLOPs = forward + backward (twice the forward), with attention counted over the causal
  half of the ``s x s`` pairs (``MFU_ATTENTION``): per token
  ``6 * N_matmul + 6 * L * s * heads * head_dim``.
- MFU uses model FLOPs only (recompute does not count). HFU adds the forward work recompute
  re-runs: ``full`` every layer's forward (not the head), ``selective`` every layer's attention core.
- The peak is per device for the run's dtype: dense bf16/fp16 tensor-core peak (never
  TF32 or sparse) or the plain fp32 peak for fp32 runs. Unknown devices (and CPUs)
  get no MFU and a single warning unless ``train.peak_tflops`` is given.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.config import ModelConfig
from parallel3d import comm
from parallel3d.faults import inject
from parallel3d.jsonl_records import read_lines, skipped_message
from parallel3d.logging_options import WandbOptions
from parallel3d.parallel_state import ParallelState
from parallel3d import user_warnings

# Dense peaks in TFLOP/s: (bf16/fp16 tensor core, fp32 without TF32). Matched as
# substrings of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM
    ("A100", 312.0, 19.5),
    ("A10G", 125.0, 31.2),
    ("L40S", 362.0, 91.6),
    ("V100", 125.0, 15.7),  # fp16 (no bf16 on V100)
)
MFU_ATTENTION = "causal"  # models.shape's attention convention for MFU/HFU: a causal mask skips half the pairs


def peak_tflops_for(device_name: str, precision: str) -> float | None:
    """The dense peak for ``precision`` of a GPU named like ``torch.cuda.get_device_name``, else None."""
    for pattern, half, fp32 in PEAK_TFLOPS:
        if pattern in device_name:
            return fp32 if precision == "fp32" else half
    return None


def detect_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The per-device dense peak for ``precision`` on a known GPU, else None (CPUs included)."""
    if device.type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device), precision)


# ---- memory -----------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_snapshot(device: torch.device, tracked: dict[str, int] | None = None) -> dict[str, int]:
    """``mem_*`` values of this rank.

    CUDA: allocator's allocated / reserved / peak allocated. CPU: the tracked
    parameter / gradient / optimizer bytes (from the optimizer) plus RSS; the
    peak is the peak RSS.
    """
    out = {f"mem_{k}_bytes": int(v) for k, v in (tracked or {}).items()}
    if device.type == "cuda":
        out["mem_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["mem_reserved_bytes"] = torch.cuda.memory_reserved(device)
        out["mem_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        out["mem_rss_bytes"] = rss_bytes()
        out["mem_peak_bytes"] = peak_rss_bytes()
    return out


# ---- per-step numbers -------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputModel:
    """What a step's FLOPs and tokens are; built once per run."""

    tokens_per_step: int
    samples_per_step: int
    world_size: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    peak_tflops: float | None  # per device; None: no MFU/HFU

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        *,
        seq_len: int,
        global_batch_size: int,
        world_size: int,
        recompute: str,
        peak_tflops: float | None,
    ) -> "ThroughputModel":
        tokens = global_batch_size * seq_len
        flops = cfg.shape.flops_per_token(seq_len, attention=MFU_ATTENTION, recompute=recompute)
        return cls(
            tokens_per_step=tokens,
            samples_per_step=global_batch_size,
            world_size=world_size,
            model_flops_per_step=flops.model * tokens,
            hardware_flops_per_step=flops.hardware * tokens,
            peak_tflops=peak_tflops,
        )

    def step_metrics(self, step_time: float) -> dict[str, float | None]:
        tflops = self.model_flops_per_step / step_time / self.world_size / 1e12
        hw_tflops = self.hardware_flops_per_step / step_time / self.world_size / 1e12
        peak = self.peak_tflops
        return {
            "step_time": step_time,
            "tokens_per_sec": self.tokens_per_step / step_time,
            "samples_per_sec": self.samples_per_step / step_time,
            "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None,
            "hfu": hw_tflops / peak if peak else None,
        }


def resolve_peak_tflops(configured: float | None, device: torch.device, precision: str) -> float | None:
    """The configured peak, else a detected one; warns once when there is none."""
    if configured is not None:
        return float(configured)
    peak = detect_peak_tflops(device, precision)
    if peak is None:
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        user_warnings.warn(f"no peak TFLOP/s known for device {what!r} ({precision}): MFU is not reported "
                           f"(set train.peak_tflops to enable it)")
    return peak


# ---- sinks --------------------------------------------------------------------------------

WANDB_GROUPS = {
    "loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "loss_scale": "train",
    "tokens_per_sec": "throughput",
    "samples_per_sec": "throughput",
    "step_time": "throughput",
    "tflops_per_device": "throughput",
    "mfu": "throughput",
    "hfu": "throughput",
    "bubble_fraction": "parallel",
    "comm_bytes": "parallel",
    "eval_loss": "eval",
    "eval_ppl": "eval",
    "eval_time": "eval",
    "elapsed_s": "progress",
    "eta_s": "progress",
}


def wandb_key(key: str) -> str:
    """The grouped W&B name of a JSONL key (``train/``, ``throughput/``, ``memory/``, ``parallel/``,
    ``eval/``, ``progress/``)."""
    if key.startswith("mem_"):
        return f"memory/{key}"
    if key.startswith("comm_bytes_"):
        return f"parallel/{key}"
    return f"{WANDB_GROUPS.get(key, 'train')}/{key}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["<no message>"])[0]


class JsonlSink:
    """``metrics.jsonl``: one JSON object per logged step, flushed at once. ``keep_through_step``: a resumed run's
    file, cut after its checkpoint's step; ``append``: an evaluation-only run's, kept whole; else a fresh file."""

    def __init__(self, path: str, *, keep_through_step: int | None = None, append: bool = False) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if keep_through_step is not None:
            self._truncate_after(keep_through_step)
        elif os.path.exists(path) and not append:
            os.remove(path)  # a fresh run starts a fresh file

    def _truncate_after(self, step: int) -> None:
        """A resumed run drops records the interrupted run wrote after its checkpoint."""
        if not os.path.exists(self.path):
            return
        lines = read_lines(self.path)
        bad = [number for number, _, record in lines if record is None]
        if bad:  # the interrupted run was killed mid-write: its checkpoint is intact, so the resume goes on
            user_warnings.warn(skipped_message(self.path, bad))
        kept = [line if line.endswith("\n") else line + "\n" for _, line, record in lines
                if record is not None and record.get("step", 0) <= step]
        # Written aside, then renamed over: a rewrite cut short (a full disk, a kill) keeps the whole history.
        aside = self.path + ".rewrite"
        try:
            with open(aside, "w") as fh:
                inject("metrics.rewrite", 0)  # tests: a full disk here (``faults``: the one writer, named rank 0)
                fh.writelines(kept)
            os.replace(aside, self.path)
        finally:
            if os.path.exists(aside):
                os.remove(aside)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


class WandbSink:
    """One W&B run; a W&B failure never stops training.

    ``mode="online"`` with a server that does not answer within ``init_timeout_s`` falls
    back to an offline run in ``run_dir/wandb/`` (one warning saying so and how to
    ``wandb sync`` it later); any other failure (missing package, offline init failing,
    a log call raising) warns once and disables W&B, metrics.jsonl goes on.
    ``run_dir`` (attribute): the local run directory W&B writes (None when disabled).
    """

    def __init__(
        self, *, mode: str, project: str, entity: str | None, name: str | None, run_dir: str,
        config: dict[str, Any], resume_id: str | None = None,
        init_timeout_s: float = WandbOptions.init_timeout_s,
    ) -> None:
        self.run = None
        self.run_id: str | None = None
        self.run_dir: str | None = None
        if mode == "disabled":
            return
        try:
            import wandb

            self._wandb = wandb
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return

        def init(run_mode: str):  # noqa: ANN202 - a wandb Run
            return wandb.init(
                mode=run_mode, project=project, entity=entity, name=name, dir=run_dir, config=config,
                id=resume_id, resume="allow" if resume_id else None,
                settings=wandb.Settings(init_timeout=init_timeout_s, silent=True, console="off"),
            )

        try:
            self.run = init(mode)
        except Exception as exc:  # noqa: BLE001 - W&B must never kill training
            if mode != "online":
                self._fail(exc)
                return
            try:
                self.run = init("offline")
            except Exception as offline_exc:  # noqa: BLE001
                self._fail(offline_exc)
                return
            local = self._local_dir()
            user_warnings.warn(
                f"W&B online init failed ({type(exc).__name__}: {_first_line(exc)}; logging.wandb.init_timeout_s="
                f"{init_timeout_s:g}): logging offline to {local}; upload it later with `wandb sync {local}`")
        self.run_id = self.run.id
        self.run_dir = self._local_dir()

    def _local_dir(self) -> str | None:
        """The run's own directory (``.../wandb/<offline-run-...>``), what ``wandb sync`` takes."""
        files = getattr(self.run, "dir", None)
        return os.path.dirname(files) if files else None

    def _fail(self, exc: BaseException) -> None:
        user_warnings.warn(f"W&B disabled ({type(exc).__name__}: {_first_line(exc)}); metrics.jsonl continues")
        self.run = None

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            data = {wandb_key(k): v for k, v in record.items() if k != "step" and v is not None}
            self.run.log(data, step=int(record["step"]))
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            for k, v in summary.items():
                self.run.summary[k] = v
            self.run.finish()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        self.run = None


def format_console(record: dict[str, Any], total_steps: int) -> str:
    """The one line printed per logged step (logging rank only)."""
    parts = [f"step {record['step']:>5d}/{total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    if record.get("loss_scale") not in (None, 1.0):  # dynamic loss scaling (fp16) only
        parts.append(f"scale {record['loss_scale']:.0f}")
    parts.append(f"{record['tokens_per_sec']:,.0f} tok/s")
    parts.append(f"{record['step_time'] * 1e3:.0f} ms")
    parts.append(f"{record['tflops_per_device']:.3g} TFLOP/s/dev")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("bubble_fraction") is not None:
        parts.append(f"bubble {100 * record['bubble_fraction']:.0f}%")
    parts.append(f"mem {record.get('mem_peak_bytes_max', 0) / 2**20:,.0f} MiB")
    if record.get("eval_loss") is not None:
        parts.append(f"eval loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}")
    if record.get("elapsed_s") is not None:
        from parallel3d.progress import format_duration

        eta = record.get("eta_s")
        parts.append(f"elapsed {format_duration(record['elapsed_s'])}"
                     + (f" ETA {format_duration(eta)}" if eta is not None else ""))
    return " | ".join(parts)


class StepTimer:
    """Wall time of one step; synchronises CUDA so the time covers the queued kernels."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._t0 = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._t0


@dataclass(frozen=True)
class Reduced:
    max: float
    min: float
    sum: float
    mean: float


def reduce_over_world(values: dict[str, float], pstate: "ParallelState") -> dict[str, Reduced]:
    """Max, min, sum and mean of per-rank ``values`` over all ranks (every rank must call it)."""
    keys = sorted(values)
    hi = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=pstate.device)
    lo, total = hi.clone(), hi.clone()
    comm.all_reduce_world(hi, pstate, op=dist.ReduceOp.MAX)
    comm.all_reduce_world(lo, pstate, op=dist.ReduceOp.MIN)
    comm.all_reduce_world(total, pstate, op=dist.ReduceOp.SUM)
    world = pstate.world_size
    return {
        k: Reduced(hi[i].item(), lo[i].item(), total[i].item(), total[i].item() / world) for i, k in enumerate(keys)
    }

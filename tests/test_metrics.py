"""FLOPs/MFU convention against torch's FLOP counter and the real models; JSONL and W&B sinks."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from models import build_model, get_config
from parallel3d.metrics import (
    JsonlSink,
    ThroughputModel,
    WandbSink,
    detect_peak_tflops,
    peak_tflops_for,
    format_console,
    MFU_ATTENTION,
    resolve_peak_tflops,
    wandb_key,
)
from parallel3d.parallel_state import ParallelState
from parallel3d.wandb_reader import find_offline_runs, iter_record_bytes, read_run


def test_mfu_counts_causal_attention_and_hfu_the_recompute():
    """MFU's FLOPs are the shape's model FLOPs with causal attention (tests/test_model_shape.py
    holds the shape to torch's FLOP counter); HFU adds the recomputed forward."""
    assert MFU_ATTENTION == "causal"
    cfg = get_config("llama_tiny")
    shape, s, h, L = cfg.shape, 64, cfg.hidden_size, cfg.num_layers
    layer_weights = sum(t.numel for layer in shape.layers for t in layer.tensors if len(t.shape) == 2)
    matmul_weights = layer_weights + h * cfg.vocab_size  # the head's logits matmul runs tied or not
    # Recompute re-runs the layers' forward (2 FLOPs per weight, causal attention 2*s*h), never the head.
    for recompute, rerun in (("none", 0), ("selective", 2 * s * h * L), ("full", 2 * layer_weights + 2 * s * h * L)):
        tm = ThroughputModel.build(cfg, seq_len=s, global_batch_size=2, world_size=1, recompute=recompute,
                                   peak_tflops=1.0)
        per_token = 6 * matmul_weights + 6 * L * s * h  # the causal half of 12*L*s*h
        assert tm.model_flops_per_step == pytest.approx(per_token * 2 * s)
        assert tm.hardware_flops_per_step == pytest.approx((per_token + rerun) * 2 * s)


def test_throughput_and_mfu_arithmetic():
    cfg = get_config("gpt_tiny")
    tm = ThroughputModel.build(cfg, seq_len=64, global_batch_size=8, world_size=4, recompute="full", peak_tflops=2.0)
    m = tm.step_metrics(0.5)
    assert m["tokens_per_sec"] == 8 * 64 / 0.5 and m["samples_per_sec"] == 16
    flops = cfg.shape.flops_per_token(64, attention="causal", recompute="full")
    assert m["tflops_per_device"] == pytest.approx(flops.model * 8 * 64 / 0.5 / 4 / 1e12)
    assert m["mfu"] == pytest.approx(m["tflops_per_device"] / 2.0)
    assert m["hfu"] == pytest.approx(m["mfu"] * flops.hardware / flops.model)
    none = ThroughputModel.build(cfg, seq_len=64, global_batch_size=8, world_size=4, recompute="none", peak_tflops=None)
    assert none.step_metrics(0.5)["mfu"] is None


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H200", "fp16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-SXM4-40GB", "fp32", 19.5), ("NVIDIA GeForce GTX 1080", "bf16", None),
])
def test_known_gpu_peaks_are_dense_and_per_dtype(name, precision, peak):
    assert peak_tflops_for(name, precision) == peak


def test_unknown_device_gives_no_mfu_and_one_warning():
    assert detect_peak_tflops(torch.device("cpu"), "bf16") is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_peak_tflops(None, torch.device("cpu"), "bf16") is None
        assert resolve_peak_tflops(312.0, torch.device("cpu"), "bf16") == 312.0
    assert len(caught) == 1 and "no peak TFLOP/s known" in str(caught[0].message)


def test_jsonl_sink_fresh_and_resumed(tmp_path):
    path = str(tmp_path / "run" / "metrics.jsonl")
    sink = JsonlSink(path)
    for step in (1, 2, 3, 4):
        sink.log({"step": step, "loss": 1.0 / step})
    # A resumed run from the step-2 checkpoint drops the interrupted run's steps 3 and 4.
    JsonlSink(path, keep_through_step=2).log({"step": 3, "loss": 0.3})
    rows = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 0.3
    JsonlSink(path)  # a fresh run starts over
    assert not os.path.exists(path)


RECORD = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "loss_scale": 1.0, "tokens_per_sec": 1000.0,
          "samples_per_sec": 10.0, "step_time": 0.5, "tflops_per_device": 0.01, "mfu": None, "hfu": None,
          "bubble_fraction": 0.25, "comm_bytes": 123, "mem_peak_bytes_max": 2**20, "mem_peak_bytes_min": 2**19}


def test_console_line():
    line = format_console(RECORD, 10)
    assert "step     3/10" in line and "loss 2.5000" in line and "MFU" not in line and "bubble 25%" in line


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    big_config = {"model": {"name": "gpt_tiny"}, "notes": "x" * 40000}  # spans two 32 KiB blocks
    sink = WandbSink(mode="offline", project="p3d-test", entity=None, name="t", run_dir=str(tmp_path),
                     config=big_config)
    assert sink.run is not None
    for step in (1, 2):
        sink.log(dict(RECORD, step=step, loss=3.0 - step))
    sink.finish({"final_loss": 1.0})
    files = find_offline_runs(str(tmp_path))
    assert len(files) == 1
    run = read_run(files[0], wait_s=60)
    assert run["complete"], "the offline run has no exit record"
    rows = [r for r in run["history"] if "train/loss" in r]
    assert [r["_step"] for r in rows] == [1, 2] and [r["train/loss"] for r in rows] == [2.0, 1.0]
    expected = {wandb_key(k) for k, v in RECORD.items() if k != "step" and v is not None}
    assert expected <= set(rows[0])
    assert {"train/loss", "throughput/tokens_per_sec", "memory/mem_peak_bytes_max", "parallel/bubble_fraction"} <= expected
    assert run["config"]["notes"] == "x" * 40000 and run["config"]["model"] == {"name": "gpt_tiny"}
    assert run["summary"]["final_loss"] == 1.0
    assert max(len(r) for r in iter_record_bytes(files[0])) > 32 * 1024


def test_missing_wandb_warns_once_and_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    with pytest.warns(UserWarning, match="W&B disabled"):
        sink = WandbSink(mode="offline", project="p", entity=None, name=None, run_dir=str(tmp_path), config={})
    sink.log(RECORD)
    sink.finish({})
    assert sink.run is None

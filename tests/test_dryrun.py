"""``python -m parallel3d.dryrun`` on the published layouts it exists for, and its one-line errors.

GPT-3 175B on 1,024 ranks (tp 8, pp 16, dp 8) and Llama 3 405B on 16,384 ranks (tp 8, pp 16,
dp 128), a few ranks each, through ``main`` as a user runs it (JSON read back). References:
the model-shape module's parameter count for the rank (``planning.params.rank_params``, no
model built), ZeRO's sharding (an owned piece is 1/dp of every padded bucket, so the masters and
moments are 12 bytes per 1/dp of the padded weight buffer), and 1F1B's message counts (the
first and last stage send one message per microbatch, a middle stage two).
"""

from __future__ import annotations

import json

import pytest
import torch

from parallel3d.config import resolve
from parallel3d.dryrun import __main__ as cli
from parallel3d.dryrun import dry_run_rank, parse_ranks, rank_report
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.planning.params import rank_params
from parallel3d.option_checks import ConfigError
from parallel3d.train import compose_job

GPT3 = ["model=gpt3_175b", "parallel.tp=8", "parallel.pp=16", "parallel.zero_stage=1", "train.precision=bf16",
        "train.global_batch_size=128", "train.micro_batch_size=1", "train.seq_len=2048"]
LLAMA405 = ["model=llama31_405b", "parallel.tp=8", "parallel.pp=16", "parallel.zero_stage=1",
            "parallel.sequence_parallel=true", "train.precision=bf16", "train.global_batch_size=2048",
            "train.micro_batch_size=1", "train.seq_len=8192"]


def _run(overrides: list[str], world: int, ranks: str, tmp_path) -> dict:
    out = tmp_path / "dryrun.json"
    code = cli.main(overrides + [f"dryrun.world_size={world}", f"dryrun.ranks={ranks}", f"dryrun.json={out}"])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("overrides,world,ranks,dp", [(GPT3, 1024, "first,519,last", 8),
                                                      (LLAMA405, 16384, "first,last", 128)],
                         ids=["gpt3_175b-1024", "llama31_405b-16384"])
def test_published_layouts_dry_run(overrides, world, ranks, dp, tmp_path):
    result = _run(overrides, world, ranks, tmp_path)
    job, _ = compose_job(overrides)
    rj = resolve(job, world_size=world)
    tp, pp, m = rj.dims.tp, rj.dims.pp, rj.grad_accum
    assert result["world_size"] == world and rj.topology.dp == dp
    assert [r["rank"] for r in result["ranks"]] == parse_ranks(ranks, world)
    for r in result["ranks"]:
        assert r["error"] is None
        stage = rj.topology.coord("pp", r["rank"])
        assert r["params"] == rank_params(rj.model, tp, pp, stage, r["layers"]).total
        padded = r["param_bytes"] // 2  # bf16 weights: the padded flat buffer's elements
        assert r["params"] <= padded < r["params"] + 64 * dp
        assert padded % dp == 0
        assert r["grad_bytes"] == 4 * padded  # fp32 main grads, whole buffer at stage 1
        assert r["optimizer_state_bytes"] == 12 * (padded // dp)
        assert r["activation_bytes"] > 0
        sends = {m["kind"]: m for m in r["messages"]}["pp send"]
        ends = stage in (0, pp - 1)
        assert sends["count"] == (1 if ends else 2) * m
        hidden, seq = rj.model.hidden_size, rj.train.seq_len // (tp if rj.dims.sequence_parallel else 1)
        assert sends["bytes"] == sends["count"] * seq * hidden * 2
        # 1F1B with its drain split (parallel.split_drain=auto, the default): every stage but the first splits
        # the backwards from the one after its last forward on, 1F1B's p - s (its warm-up's p - s - 1, plus one)
        drain = {"W": min(pp - stage, m)} if stage > 0 else {}
        assert r["actions"] == {"F": m, "B": m, **drain}


def _fail_build_on_rank_1(monkeypatch, message: str) -> None:
    """Rank 1's model build raises ``RuntimeError(message)``; every other rank builds for real."""
    real_build = rank_report.build_chunks

    def build_failing_on_rank_1(rj, pstate):
        if pstate.rank == 1:
            raise RuntimeError(message)
        return real_build(rj, pstate)

    monkeypatch.setattr(rank_report, "build_chunks", build_failing_on_rank_1)


def test_a_failing_rank_is_one_line_and_the_others_still_run(monkeypatch, capsys):
    """A rank whose build fails is reported by rank in one line; the fake world is torn down, so
    the next rank builds; the exit status is 1."""
    _fail_build_on_rank_1(monkeypatch, "out of parameters\nsecond line of a deep cause")
    code = cli.main(["model=gpt_tiny", "parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=1",
                     "dryrun.world_size=4", "dryrun.ranks=0,1,3"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_FAILED
    assert err.strip().splitlines() == ["dry run failed: rank 1: RuntimeError: out of parameters"]
    assert "ERROR rank 1" in out and "second line" not in out + err
    assert "rank 3: actions" in out and "rank 0: actions" in out


def test_a_terminal_sees_each_rank_start_and_end(monkeypatch, capsys):
    """On a terminal, a line when each rank starts and one when it ends, failed ranks said so (a large rank
    takes minutes and the table waits for every rank); off a terminal stderr is the failures only (above)."""
    _fail_build_on_rank_1(monkeypatch, "out of parameters")
    monkeypatch.setattr(cli, "stderr_is_terminal", lambda: True)
    code = cli.main(["model=gpt_tiny", "parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=1",
                     "dryrun.world_size=4", "dryrun.ranks=3,1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_FAILED
    assert [line.rsplit(" in ", 1)[0] for line in lines] == [
        "dry run: rank 3 (1 of 2): building and stepping", "dry run: rank 3 (1 of 2): done",
        "dry run: rank 1 (2 of 2): building and stepping", "dry run: rank 1 (2 of 2): failed",
        "dry run failed: rank 1: RuntimeError: out of parameters"], lines


@pytest.mark.parametrize("args,fragment", [
    (["dryrun.ranks=0"], "dryrun.world_size: missing"),
    (["dryrun.world_size=0"], "dryrun.world_size='0'"),
    (["dryrun.world_size=8", "dryrun.ranks=0,8"], "rank 8 is outside 0..7"),
    (["dryrun.world_size=8", "dryrun.ranks=0,middle"], "'middle' is not a rank number"),
    (["dryrun.world_size=8", "dryrun.rank=0"], "'dryrun.rank=0'"),
    (["dryrun.world_size=6", "parallel.tp=4"], "parallel.tp"),
    (["dryrun.world_size=8", "parallel.zero_stage=5"], "parallel.zero_stage"),
])
def test_bad_keys_fail_in_one_line_before_any_rank(args, fragment, capsys):
    assert cli.main(["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=1", *args]) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and fragment in err, err


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["model=gpt_tiny", "dryrun.world_size=8", "--help"]])
def test_help_prints_the_usage_not_a_config_error(args, capsys):
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.strip() == cli.__doc__.strip() and "dryrun.world_size=N" in out


def test_disk_offload_is_refused_before_any_file_is_made(tmp_path, capsys):
    """It once failed on every rank with a numpy TypeError, after creating a state directory per rank."""
    state_dir = tmp_path / "offload"
    args = ["dryrun.world_size=2", "parallel.dp=2", "parallel.zero_stage=1", "parallel.offload=disk",
            f"parallel.offload_dir={state_dir}"]
    assert cli.main(["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=1", *args]) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and "parallel.offload=disk: the dry run creates no optimizer state files" in err, err
    assert not state_dir.exists()


def test_dry_run_rank_refuses_disk_offload_in_one_line_before_any_file_is_made(tmp_path):
    """``dry_run_rank`` itself, as the dry-run fuzz and other callers use it: the command's refusal, not the numpy
    ``TypeError`` the meta optimizer raised (session 44: six drawn disk cases of ``--dryrun-seeds 1000:1032``)."""
    state_dir = tmp_path / "offload"
    job, _ = compose_job(["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=1", "parallel.dp=2",
                          "parallel.zero_stage=1", "parallel.offload=disk", f"parallel.offload_dir={state_dir}"])
    report = dry_run_rank(resolve(job, world_size=2), 0)
    assert report.error.startswith("rank 0: ConfigError: parallel.offload=disk: the dry run creates no optimizer state"), \
        report.error
    assert not state_dir.exists()


def test_parse_ranks_names_and_order():
    assert parse_ranks("last, 0 ,first,3", 8) == [7, 0, 3]
    with pytest.raises(ConfigError):
        parse_ranks("-1", 8)


def test_dry_run_rank_reports_zero_stage_3_shards():
    """Stage 3 on 2 dp ranks: the weights are half the stage-0 buffer (its own shard)."""
    base = ["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=1"]
    reports = {}
    for stage in (0, 3):
        job, _ = compose_job(base + [f"parallel.zero_stage={stage}"])
        reports[stage] = dry_run_rank(resolve(job, world_size=2), 1)
        assert reports[stage].error is None, reports[stage].error
    assert reports[3].param_bytes * 2 == reports[0].param_bytes
    assert reports[3].optimizer_state_bytes * 2 == reports[0].optimizer_state_bytes


def _tiny(extra: list[str]):
    job, _ = compose_job(["model=gpt_tiny", "train.micro_batch_size=1", "train.seq_len=32", *extra])
    return job


@pytest.mark.parametrize("extra,world", [
    (["parallel.pp=4", "train.global_batch_size=12"], 4),
    (["parallel.pp=2", "parallel.zero_stage=2", "train.recompute=full", "train.global_batch_size=16"], 4),
    (["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "parallel.pp_layers=[0,2,2,0]",
      "train.global_batch_size=8"], 2),
    # m 16: at m 8 no smaller count has stage 1's B-/W-pending profile (it runs all 8, untested here)
    (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "train.global_batch_size=16"], 2),
    # W-pending microbatches hold more than B-pending ones here: the profile must tell them apart
    (["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "train.recompute=full",
      "train.global_batch_size=16"], 2),
    # zb_h1 at the engine's W lags (job_w_lags: 0 on both stages here, not the default 0, 1): stage 1's
    # profile is read off that schedule, so it reduces to fewer microbatches than the default lags' would
    (["parallel.pp=2", "parallel.schedule=zb_h1", "train.global_batch_size=8"], 2),
], ids=["pp4-1f1b", "pp2dp2-z2-full-recompute", "pp2-interleaved-empty-end-chunks", "pp2-zbv-both-ends-on-stage0",
        "pp2-zbv-full-recompute", "pp2-zb_h1-engine-lags"])
def test_reduced_step_extrapolates_to_the_full_step(extra, world, monkeypatch):
    """Steps run at fewer microbatches and extrapolated (``dryrun.step``) give the messages and the
    activation peak of the full step run with every microbatch, on every rank."""
    rj = resolve(_tiny(extra), world_size=world)
    reduced = {r: dry_run_rank(rj, r) for r in range(world)}
    monkeypatch.setattr(rank_report, "reduced_microbatches", lambda *a: None)
    for rank, short in reduced.items():
        full = dry_run_rank(rj, rank)
        assert short.error is None and full.error is None, (short.error, full.error)
        assert len(short.step_microbatches) == 2 and full.step_microbatches == [rj.grad_accum]
        assert short.messages == full.messages, rank
        assert short.activation_bytes == full.activation_bytes > 0


def _as_the_full_step(rj, monkeypatch) -> dict:
    """Each rank's dry run as it chose to run it, checked against the full step forced (no reduced steps):
    the same messages and activation peak on every rank. Returns the reports as run."""
    ran = {r: dry_run_rank(rj, r) for r in range(rj.world_size)}
    monkeypatch.setattr(rank_report, "reduced_microbatches", lambda *a: None)
    for rank, report in ran.items():
        full = dry_run_rank(rj, rank)
        assert report.error is None and full.error is None, (report.error, full.error)
        assert (report.messages, report.activation_bytes) == (full.messages, full.activation_bytes), rank
    return ran


def test_a_stage_whose_messages_are_not_linear_runs_the_full_step(monkeypatch):
    """ZeRO 3 on ZB-V (gpt_tiny pp 2 v 2, dp 2, 16 microbatches): stage 1's reduce-scatters follow the order of
    its W actions, so its two reduced steps (8 and 14 microbatches: 11 and 20 calls) are not linear in the count;
    the dry run once failed there (drawn case 2046 of ``tests/dryrun_fuzz.py``). It runs the full step instead:
    every rank's messages and peak are the full step's."""
    rj = resolve(_tiny(["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.zero_stage=3",
                        "parallel.dp=2", "train.global_batch_size=32"]), world_size=4)
    reduced = _as_the_full_step(rj, monkeypatch)
    # every stage of ZB-V splits its backwards: under ZeRO 3 each runs the full step (rank_report._step_messages;
    # stage 0's reduced steps happened to extrapolate here, stage 1's of a ZeRO 2 job did not: the test below)
    assert all(r.step_microbatches == [rj.grad_accum] for r in reduced.values())


def test_a_split_stage_under_zero2_runs_the_full_step(monkeypatch):
    """ZeRO 2 on ZB-V (gpt_tiny pp 2 v 2, dp 2, 6 microbatches): stage 1's reduce-scatters follow the order of its
    W actions; its two reduced steps (4 and 5 microbatches) look linear yet extrapolate to 3 reduce-scatters where
    the full step sends 4 (drawn case 2084: 84 against 88). A split stage under ZeRO 2 or 3 runs the full step:
    every rank's messages and peak are the full step's."""
    rj = resolve(_tiny(["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.zero_stage=2",
                        "parallel.dp=2", "train.global_batch_size=12"]), world_size=4)
    _as_the_full_step(rj, monkeypatch)


def test_a_job_left_on_device_auto_is_dry_run_as_on_its_accelerator():
    """``train.device=auto`` (the default) is a cluster job's, dry-run on a machine without its accelerator: its
    ranks step with NCCL's p2p (``fake_world.runs_on_nccl``) and the fused kernels (``meta_kernels``), as a
    dry run told ``nccl=True`` does; a job pinned to the CPU steps plain gloo's p2p (more interleaved sends) and
    the torch ops (other saved bytes). llama_tiny (RMSNorm, SwiGLU), pp 2, v 2: the pp sends and the activation
    peaks differ on both ranks."""
    job = ["model=llama_tiny", "train.micro_batch_size=1", "train.seq_len=32", "parallel.pp=2",
           "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "train.global_batch_size=4"]
    auto, cpu = (resolve(compose_job([*job, f"train.device={d}"])[0], world_size=2) for d in ("auto", "cpu"))
    for rank in range(2):
        on_auto, on_nccl = dry_run_rank(auto, rank), dry_run_rank(auto, rank, nccl=True)
        cpu_gloo, cpu_nccl = dry_run_rank(cpu, rank), dry_run_rank(cpu, rank, nccl=True)
        assert not any(r.error for r in (on_auto, on_nccl, cpu_gloo, cpu_nccl)), rank
        assert (on_auto.messages, on_auto.activation_bytes) == (on_nccl.messages, on_nccl.activation_bytes), rank
        assert on_auto.messages != cpu_gloo.messages, rank  # p2p semantics
        assert on_auto.activation_bytes != cpu_nccl.activation_bytes, rank  # kernels


def test_dry_run_with_empty_end_chunks():
    """Llama 3 405B's ends at small scale: interleaved pp=2 v=2 with the embedding alone in chunk 0 and
    the head alone in chunk 3. Every rank builds and steps; it holds its layers and the shape module's
    parameters for them (embedding on stage 0, head on the last), and runs every chunk's F and B."""
    rj = resolve(_tiny(["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                        "parallel.pp_layers=[0,2,2,0]", "train.global_batch_size=8"]), world_size=2)
    for rank in range(2):
        r = dry_run_rank(rj, rank)
        assert r.error is None, r.error
        assert r.layers == 2
        assert r.params == rank_params(rj.model, 1, 2, rank, r.layers).total
        # the drain split (the default): a W for each backward of the plain order after the stage's last
        # forward, but the model's first chunk's (stage 0's chunk 0)
        plain = [a for a in build_schedule("interleaved_1f1b", 2, rj.grad_accum, 2)[rank] if a.is_compute]
        last_f = max(i for i, a in enumerate(plain) if a.kind == "F")
        drain = [a for a in plain[last_f:] if a.kind == "B" and (rank, a.chunk) != (0, 0)]
        assert r.actions == {"F": 2 * rj.grad_accum, "B": 2 * rj.grad_accum, "W": len(drain)}


def test_a_stage_with_a_wrong_output_shape_fails_in_the_step_naming_its_rank(monkeypatch, capsys):
    """A model bug only a step finds (stage 0's chunk returns half its sequence): building passes,
    the step's first send fails, and the dry run names the rank; the other stage still runs."""
    real_build = rank_report.build_chunks

    class HalfSequence(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)[:, : args[0].shape[1] // 2]

    def build(rj, pstate):
        chunks = real_build(rj, pstate)
        return [HalfSequence(c) for c in chunks] if pstate.coord("pp") == 0 else chunks

    monkeypatch.setattr(rank_report, "build_chunks", build)
    code = cli.main(["model=gpt_tiny", "parallel.pp=2", "train.global_batch_size=4", "train.micro_batch_size=1",
                     "train.seq_len=32", "dryrun.world_size=2", "dryrun.ranks=0,1"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_FAILED
    assert len(err.strip().splitlines()) == 1 and err.startswith("dry run failed: rank 0: "), err
    assert "sends shape (1, 16, " in err, err
    assert "rank 1: actions" in out


DEEPSEEK_V3 = ["model=deepseek_v3_671b", "parallel.pp=16", "parallel.ep=64", "parallel.zero_stage=1",
               "train.precision=bf16", "train.global_batch_size=2048", "train.micro_batch_size=1", "train.seq_len=4096"]


def test_deepseek_v3_671b_dry_run_at_2048_ranks_moves_the_balanced_token_bytes(tmp_path):
    """DeepSeek-V3's own layout (pp 16 x ep 64 over dp 128, 2,048 ranks): the last stage's MoE layers run on meta
    with balanced routing (``dryrun.meta_routing``), so its token all-to-all bytes are known from the shapes alone:
    per micro-batch and MoE layer, the count exchange (E int64 to the ep - 1 others) and four row exchanges
    (dispatch, combine, and their two backward ones) of T*k*(ep - 1)/ep rows of h bf16 values."""
    result = _run(DEEPSEEK_V3, 2048, "last", tmp_path)
    job, _ = compose_job(DEEPSEEK_V3)
    rj = resolve(job, world_size=2048)
    (r,) = result["ranks"]
    assert r["error"] is None and r["coords"]["ep"] == 63 and r["coords"]["pp"] == 15
    m, moe, ep = rj.grad_accum, rj.model.moe, rj.dims.ep
    moe_layers = sum(moe.is_moe_layer(i) for i in range(rj.model.num_layers - r["layers"], rj.model.num_layers))
    assert moe_layers == r["layers"] > 0
    slots = rj.train.micro_batch_size * rj.train.seq_len * moe.top_k
    rows = slots * (ep - 1) // ep * rj.model.hidden_size * 2
    counts = moe.num_experts * 8 * (ep - 1) // ep
    sent = {x["kind"]: x for x in r["messages"]}["ep all_to_all"]
    assert sent["count"] == 5 * m * moe_layers
    assert sent["bytes"] == m * moe_layers * (4 * rows + counts)

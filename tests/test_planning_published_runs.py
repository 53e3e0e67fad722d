"""The published-runs data file (parallel3d/planning/published_runs.yaml) and its loader.

Every row is checked by cases generated over the rows: its arithmetic, its conventions and
source, and its numbers against an independent count of the model's parameters (written
here, not the planner's shape module) and against the other rows of the same source. The
loader's own validation is tested by breaking valid rows one field at a time.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from models import get_config
from parallel3d.planning.devices import DEVICES
from parallel3d.planning.published import (
    RUNS_FILE,
    PublishedRun,
    format_table,
    load_published_runs,
    main,
    parse_run,
)

RUNS = load_published_runs()
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
RAW = {item["id"]: item for item in yaml.load(RUNS_FILE.read_text(), Loader=_LOADER)["runs"]}
SCORED = [r for r in RUNS if r.split != "reference"]


def _ids(runs):
    return [r.id for r in runs]


def _params(run: PublishedRun, active: bool = False, matmul_only: bool = False) -> float:
    """Parameters from the shape alone (norms and biases ignored): total, or active per token.

    ``matmul_only`` leaves out the input embedding (a lookup, not a matmul) so that 6x this
    is the forward+backward matmul FLOPs per token without attention scores."""
    m = run.model
    d = m.query_head_dim
    if m.mla is not None:
        a = m.mla
        attn = (m.hidden * a.q_lora_rank + a.q_lora_rank * m.heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
                + m.hidden * (a.kv_lora_rank + a.qk_rope_head_dim)
                + a.kv_lora_rank * m.heads * (a.qk_nope_head_dim + a.v_head_dim) + m.heads * a.v_head_dim * m.hidden)
    else:
        attn = 2 * m.hidden * m.heads * d + 2 * m.hidden * m.kv * d
    mats = 3 if m.mlp == "swiglu" else 2
    dense_mlp = mats * m.hidden * m.ffn
    if m.moe is None:
        layers = m.layers * (attn + dense_mlp)
    else:
        e = m.moe
        experts = e.top_k if active else e.experts
        moe_mlp = mats * m.hidden * (experts * e.expert_ffn + e.shared_experts * e.shared_expert_ffn)
        layers = m.layers * attn + e.dense_layers * dense_mlp + (m.layers - e.dense_layers) * moe_mlp
    embeddings = m.vocab * m.hidden * (1 if matmul_only or m.tied_embeddings else 2)
    return layers + embeddings


def test_the_file_has_enough_runs_of_every_kind():
    assert len(RUNS) >= 24 and len({r.id for r in RUNS}) == len(RUNS)
    dense = [r for r in SCORED if r.model.moe is None]
    moe = [r for r in SCORED if r.model.moe is not None]
    assert len(dense) >= 12 and len(moe) >= 4
    generations = {r.hardware.device.split("_")[0] for r in SCORED}
    assert {"a100", "h100"} <= generations
    sizes = [_params(r) for r in RUNS]
    assert min(sizes) < 2e9 and max(sizes) >= 1e12
    assert any(r.layout.cp > 1 for r in SCORED) and any(r.layout.ep > 1 for r in SCORED)
    assert {r.layout.recompute for r in SCORED} == {"none", "selective", "full"}


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_row_arithmetic_is_consistent(run):
    lay, gpus = run.layout, run.hardware.gpus
    assert lay.tp * lay.pp * lay.cp * lay.dp == gpus
    assert run.batch.global_batch % (lay.micro_batch * lay.dp) == 0
    assert run.microbatches * lay.micro_batch * lay.dp == run.batch.global_batch
    assert (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp) == 0
    if run.model.moe is not None:
        assert run.model.moe.experts % lay.ep == 0
    assert run.model.heads % lay.tp == 0 and run.model.heads % run.model.kv == 0
    if lay.schedule == "interleaved_1f1b":
        assert lay.vp >= 2 and lay.pp >= 2
    # Every pipeline stage gets at least one layer (a stage may hold one fewer, as Llama 3's do).
    assert run.model.layers >= lay.pp * lay.vp - 2
    if run.published.tokens_per_s_per_gpu and run.published.step_time_s:
        step = run.batch.global_batch * run.batch.seq_len / (run.published.tokens_per_s_per_gpu * gpus)
        assert step == pytest.approx(run.published.step_time_s, rel=0.02)


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_row_has_conventions_and_a_source(run):
    src, conv = run.source, run.flops_convention
    assert src.url.startswith("https://") and len(src.citation) > 20 and src.location and src.verified
    assert len(conv.formula) > 30
    assert run.hardware.device in DEVICES
    if conv.peak_tflops is not None:
        assert conv.peak_tflops * 1e12 == pytest.approx(DEVICES[run.hardware.device].peak_flops, rel=0.01)
    if run.published.mfu_percent is not None or run.published.hfu_percent is not None:
        assert conv.peak_tflops is not None
    if run.split != "reference":  # scored rows say how recompute and the MFU peak are counted
        assert conv.recompute_counted in ("yes", "no")
        assert run.mfu is not None or run.published.step_time_s is not None
    # What is inferred is said, and only real fields are named.
    for path, how in run.inferred.items():
        node = RAW[run.id]
        for key in path.split("."):
            node = node[key]
        assert len(how) > 5, path


@pytest.mark.parametrize("run", [r for r in RUNS if r.model.params_b], ids=_ids([r for r in RUNS if r.model.params_b]))
def test_stated_parameter_count_matches_the_shape(run):
    # Sources round (1.7B for 1.65B); 4% also leaves room for norms and biases.
    assert _params(run) / 1e9 == pytest.approx(run.model.params_b, rel=0.04)


IMPLIED = [r for r in RUNS if r.implied_flops_per_token]
KNOWN_CONVENTION = [r for r in IMPLIED if r.flops_convention.attention != "unknown"]


@pytest.mark.parametrize("run", KNOWN_CONVENTION, ids=_ids(KNOWN_CONVENTION))
def test_published_numbers_imply_a_plausible_flop_count(run):
    # FLOPs per token implied by (TFLOP/s or MFU) and (tokens/s or step time): at least the
    # 6N matmul FLOPs of the active parameters, at most that with recompute and s^2 attention.
    base = 6 * _params(run, active=True, matmul_only=True)
    ratio = run.implied_flops_per_token / base
    low = 0.97 if run.flops_convention.recompute_counted == "no" else 1.25
    assert low <= ratio <= 1.8, ratio


def _groups():
    groups: dict[tuple, list[PublishedRun]] = {}
    for run in IMPLIED:
        key = (run.source.citation, run.model.name, run.batch.seq_len, run.flops_convention.formula)
        groups.setdefault(key, []).append(run)
    return [g for g in groups.values() if len(g) > 1]


@pytest.mark.parametrize("group", _groups(), ids=lambda g: g[0].model.name)
def test_rows_of_one_source_and_model_count_the_same_flops(group):
    # Different GPU counts and batches of one model must imply the same FLOPs per token: a
    # transcription error in GPUs, batch, time or MFU breaks this.
    values = [r.implied_flops_per_token for r in group]
    assert max(values) / min(values) < 1.02, [(r.id, v) for r, v in zip(group, values)]


def test_split_calibrates_on_a_stated_third_spanning_generations_and_moe():
    calibration = [r for r in SCORED if r.split == "calibration"]
    assert 0.25 <= len(calibration) / len(SCORED) <= 0.4
    assert {r.hardware.device for r in calibration} >= {"a100_80gb", "h100_80gb"}
    assert any(r.model.moe for r in calibration) and any(not r.model.moe for r in calibration)
    held = {r.id for r in SCORED if r.split == "held_out"}
    # The cases issue 26 names as over-predicted are held out, not fitted.
    assert {"mcore08_gpt_1.7b_48gpus", "nemotron4_15b_dp96", "nemotron4_15b_dp288"} <= held
    header = RUNS_FILE.read_text().split("\nruns:")[0]
    assert f"calibration ({len(calibration)} rows" in header


def test_shapes_agree_with_the_model_registry():
    by_name = {r.model.name: r.model for r in RUNS}
    for name, config in (("Llama 3 8B", "llama3_8b"), ("Llama 3 70B", "llama3_70b"),
                         ("Llama 3 405B", "llama31_405b"), ("GPT-3 175B", "gpt3_175b")):
        shape, cfg = by_name[name], get_config(config)
        assert (shape.layers, shape.hidden, shape.heads, shape.kv, shape.ffn) == (
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.ffn_size), name
        if cfg.arch == "llama":
            assert shape.vocab == cfg.vocab_size and shape.mlp == "swiglu"


def _raw(run_id: str) -> dict:
    return copy.deepcopy(RAW[run_id])


@pytest.mark.parametrize("run_id, mutate, words", [
    ("narayanan21_gpt_18.4b", lambda d: d["layout"].update(dp=31), ["tp*pp*cp*dp", "gpus"]),
    ("narayanan21_gpt_18.4b", lambda d: d["batch"].update(global_batch=1000), ["global_batch", "micro_batch"]),
    ("narayanan21_gpt_18.4b", lambda d: d["published"].update(mfu_percent=48), ["tflops_per_gpu", "mfu_percent"]),
    ("narayanan21_gpt_18.4b", lambda d: d["flops_convention"].update(peak_tflops=989), ["peak_tflops", "a100_80gb"]),
    ("narayanan21_gpt_18.4b", lambda d: d["inferred"].update({"layout.tpp": "typo"}), ["inferred", "layout.tpp"]),
    ("narayanan21_gpt_18.4b", lambda d: d["layout"].update(recompute="some"), ["layout.recompute"]),
    ("narayanan21_gpt_18.4b", lambda d: d["layout"].update(vp=2), ["layout.vp", "interleaved"]),
    ("narayanan21_gpt_18.4b", lambda d: d["source"].pop("url"), ["source.url", "missing"]),
    ("narayanan21_gpt_18.4b", lambda d: d["layout"].update(pipeline=1), ["layout", "unknown", "pipeline"]),
    ("narayanan21_gpt_18.4b", lambda d: d["model"].update(heads=47), ["model.heads"]),
    ("narayanan21_gpt_18.4b", lambda d: d["published"].update(primary="mfu"), ["published.primary"]),
    ("narayanan21_gpt_18.4b", lambda d: d["hardware"].update(device="a200_80gb"), ["hardware.device"]),
    ("nemotron4_15b_dp96", lambda d: d["published"].update(tokens_per_s_per_gpu=4000), ["tokens_per_s_per_gpu"]),
    ("nemotron4_15b_dp96", lambda d: d["published"].update(hfu_percent=30.0), ["hfu_percent"]),
    ("folding_mixtral_8x22b_folding_128gpus", lambda d: d["layout"].update(ep=16), ["ep"]),
    ("folding_mixtral_8x22b_folding_128gpus", lambda d: d["model"].update(moe=None), ["dense model", "layout.ep"]),
    ("llama3_405b_128k_16384gpus", lambda d: d["batch"].update(seq_len=131070), ["seq_len", "2*layout.cp"]),
    ("deepseek_v3_h800_pretraining", lambda d: d["model"].pop("mla"), ["model.mla"]),
    # rank metadata (validation.rank_run): unstated fields must be inferred ones; rank_fixed only on stated degrees
    ("narayanan21_gpt_3.6b", lambda d: d.update(unstated=["layout.tp"]), ["unstated", "layout.tp"]),
    ("nemotron4_15b_dp96", lambda d: d.update(unstated=["layout.vp"]), ["layout.vp", "inferred"]),
    ("narayanan21_gpt3_175b_384gpus", lambda d: d.update(rank_fixed={"layout.tp": "x"}), ["layout.tp", "inferred"]),
    ("narayanan21_gpt3_175b_384gpus", lambda d: d.update(rank_fixed={"layout.vp": "x"}), ["rank_fixed", "layout.vp"]),
    ("narayanan21_gpt3_175b_384gpus", lambda d: d.update(rank_fixed={"layout.dp": ""}), ["rank_fixed.layout.dp"]),
])
def test_loader_rejects_an_inconsistent_row(run_id, mutate, words):
    data = _raw(run_id)
    parse_run(copy.deepcopy(data))  # the row as committed is valid
    mutate(data)
    with pytest.raises(ValueError) as err:
        parse_run(data)
    message = str(err.value)
    assert run_id in message and all(w in message for w in words), message


def test_duplicate_ids_are_rejected(tmp_path):
    row = RAW["narayanan21_gpt_18.4b"]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "runs": [row, row]}))
    with pytest.raises(ValueError, match="duplicate"):
        load_published_runs(path)


def test_table_command_prints_every_run(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for run in RUNS:
        assert run.id in out
    assert out == format_table(RUNS) + "\n"

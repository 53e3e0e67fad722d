"""The bad-configuration matrix: every case gives exit status 2, exactly one line
``config error: <key>=<value>: <what is allowed>`` and no traceback, before any process group.

Cases: generated from the schema (``JobConfig``: for every typed leaf key a value of the wrong
type and an out-of-range one, so a new key is covered without editing this file) plus the
arithmetic and cross-key cases a schema cannot express (world size, divisibility, batch
arithmetic, schedules, paths, resume targets, blends, Hydra flags).

Most cases go through ``parallel3d.train.main`` in this process (the CLI's entry function,
with Hydra's app replaced by a failure: a case that got past the checks would start training);
a sample goes through real subprocesses (test_train_cli: several ranks, and torchrun, where
every rank must exit 2).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from parallel3d import train as train_cli
from parallel3d.config import JobConfig
from tests.fault_runs import cli_env

# Keys whose value is free text: any string of the right type is valid (a path to be created, a name).
FREE_TEXT = {"model.name", "train.out_dir", "data.cache_dir", "logging.wandb.project", "logging.wandb.entity",
             "logging.wandb.name", "parallel.order"}
# Keys where a negative number is allowed by meaning.
NEGATIVE_OK: set[str] = set()


def _leaves(schema: type = JobConfig, prefix: str = "") -> list[tuple[str, typing.Any]]:
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", hint))
    return out


def _base(hint: typing.Any) -> typing.Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _base(args[0])
    return hint


def generated_cases() -> list[tuple[str, list[str], str]]:
    """``(id, overrides, key expected in the message)`` for every leaf of the schema."""
    cases = []
    for key, hint in _leaves():
        base = _base(hint)
        origin = typing.get_origin(base)
        if base is bool:
            cases.append((f"{key}:type", [f"{key}=maybe"], key))
        elif base is int:
            cases.append((f"{key}:type", [f"{key}=abc"], key))
            if key not in NEGATIVE_OK:
                cases.append((f"{key}:range", [f"{key}=-7"], key))
        elif base is float:
            cases.append((f"{key}:type", [f"{key}=abc"], key))
            if key not in NEGATIVE_OK:
                cases.append((f"{key}:range", [f"{key}=-1.5"], key))
        elif base is str:
            if key not in FREE_TEXT:
                cases.append((f"{key}:choice", [f"{key}=no_such_value"], key))
        elif origin is list:
            cases.append((f"{key}:type", [f"{key}={{a: 1}}"], key))
        elif base is typing.Any:  # parallel.dp: an int or "auto"
            cases.append((f"{key}:type", [f"{key}=many"], key))
            cases.append((f"{key}:range", [f"{key}=0"], key))
    return cases


def hand_cases(tmp: str) -> list[tuple[str, list[str], str, int]]:
    """``(id, overrides, text expected in the message, world size)``: what a schema cannot say."""
    a_file = os.path.join(tmp, "a_file")
    return [
        ("world:dp-mismatch", ["parallel.tp=2", "parallel.dp=3"], "parallel.tp*pp*dp", 4),
        ("world:not-divisible", ["parallel.tp=3"], "parallel.dp=auto: world_size=4", 4),
        ("world:pp-too-big", ["parallel.pp=8"], "parallel.dp=auto", 4),
        ("heads:tp", ["parallel.tp=8", "model.num_heads=4", "model.hidden_size=64"], "num_heads=4", 8),
        ("heads:hidden", ["model.hidden_size=66"], "hidden_size=66", 1),
        ("kv-heads:heads", ["model=llama_tiny", "model.num_kv_heads=3"], "kv", 1),
        ("kv-heads:tp", ["model=llama_tiny", "model.num_kv_heads=1", "parallel.tp=2"], "kv", 2),
        ("layers:pp", ["parallel.pp=7", "model.num_layers=4"], "num_layers", 7),
        ("layers:virtual", ["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=4"],
         "layers", 2),
        ("ffn:tp", ["parallel.tp=2", "model.ffn_hidden_size=255"], "ffn", 2),
        ("vocab:corpus", ["model.vocab_size=100"], "model.vocab_size=100", 1),
        ("batch:divisible", ["train.global_batch_size=12", "train.micro_batch_size=8"], "train.global_batch_size=12", 1),
        ("batch:dp", ["train.global_batch_size=6", "train.micro_batch_size=2"], "train.global_batch_size=6", 4),
        ("batch:micro-zero", ["train.micro_batch_size=0"], "train.micro_batch_size=0", 1),
        ("schedule:virtual-without-interleaved", ["parallel.pp=2", "parallel.virtual_stages=2"],
         "parallel.virtual_stages=2", 2),
        ("schedule:interleaved-pp1", ["parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
         "interleaved_1f1b", 1),
        ("schedule:zbv-chunks", ["parallel.pp=2", "parallel.schedule=zbv", "parallel.virtual_stages=3"],
         "parallel.virtual_stages=2", 2),
        ("schedule:interleaved-accum", ["parallel.pp=2", "parallel.schedule=interleaved_1f1b",
                                        "parallel.virtual_stages=2", "train.global_batch_size=6",
                                        "train.micro_batch_size=2"], "grad_accum=3", 2),
        ("pp_layers:count", ["parallel.pp=2", "parallel.pp_layers=[4]"], "parallel.pp_layers", 2),
        ("pp_layers:sum", ["parallel.pp=2", "parallel.pp_layers=[1,1]"], "parallel.pp_layers", 2),
        ("sp:tp1", ["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true", 1),
        ("sp:seq", ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"], "train.seq_len=33", 2),
        ("cp:seq", ["parallel.cp=2", "train.seq_len=30"], "train.seq_len=30", 2),
        ("cp:seq-sp", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=36"],
         "train.seq_len=36", 4),
        ("cp:a2a-heads", ["model=llama_tiny", "parallel.cp=8", "parallel.cp_comm=a2a", "train.seq_len=64"],
         "parallel.cp=8", 8),
        ("cp:a2a-kv-heads", ["model=llama_tiny", "model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=96",
                             "parallel.cp=2", "parallel.cp_comm=a2a"], "parallel.cp=2", 2),
        ("cp:a2a+p2p-no-size", ["parallel.cp=2", "parallel.cp_comm=a2a+p2p"], "parallel.cp_a2a_size=null", 2),
        ("cp:a2a-size-divides", ["parallel.cp=4", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=3"],
         "parallel.cp_a2a_size=3", 4),
        ("cp:a2a-size-without-a2a+p2p", ["parallel.cp=2", "parallel.cp_a2a_size=2"], "parallel.cp_a2a_size=2", 2),
        ("precision:reduce", ["train.precision=bf16", "parallel.grad_reduce_dtype=fp16"], "grad_reduce_dtype", 1),
        ("precision:cuda", ["train.device=cuda"], "train.device=cuda", 1),
        ("seq:max", ["train.seq_len=4096"], "train.seq_len=4096", 1),
        ("lr:zero", ["optimizer.lr=0"], "optimizer.lr=0", 1),
        ("lr:min-above", ["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"], "optimizer.min_lr", 1),
        ("warmup:steps", ["train.steps=10", "optimizer.warmup_steps=11"], "optimizer.warmup_steps=11", 1),
        ("beta:one", ["optimizer.beta2=1.0"], "optimizer.beta2=1.0", 1),
        ("loss-scale:zero", ["train.precision=fp16", "optimizer.loss_scale_init=0"], "optimizer.loss_scale_init=0", 1),
        ("steps:zero", ["train.steps=0"], "train.steps=0", 1),
        ("on-nonfinite:choice", ["train.on_nonfinite=ignore"], "train.on_nonfinite='ignore'", 1),
        ("path:data", ["data=indexed", f"data.paths=[{tmp}/nope]"], "does not exist", 1),
        ("path:valid", ["data=indexed", f"data.paths=[{tmp}/nope]", f"data.valid_paths=[{tmp}/nope2]",
                        "data.valid_fraction=0"],
         "does not exist", 1),
        ("path:tokenizer", ["data=indexed", f"data.tokenizer_file={tmp}/nope.json"], "data.", 1),
        ("path:init_from", [f"train.init_from=hf:{tmp}/nope"], "train.init_from", 1),
        ("blend:weights-default", ["data.weights=[1.0]"], "data.weights", 1),
        ("blend:string", ["data=indexed", "data.blend='0.3 a 0.7'"], "data.", 1),
        ("blend:negative", ["data=indexed", f"data.paths=[{tmp}/a,{tmp}/b]", "data.weights=[1.0,-1.0]"], "data.", 1),
        ("resume:missing", [f"train.resume={tmp}/no_checkpoint"], "train.resume=", 1),
        ("out_dir:under-a-file", [f"train.out_dir={a_file}/run"], "train.out_dir=", 1),
        ("out_dir:is-a-file", [f"train.out_dir={a_file}"], "train.out_dir=", 1),
        ("eval:no-valid-set", ["train.eval_iters=2", "data.valid_fraction=0"], "train.eval_iters=2", 1),
        ("valid_fraction:one", ["data.valid_fraction=1.0"], "data.valid_fraction=1.0", 1),
        ("preempt:sigkill", ["train.preempt_signal=[SIGKILL]"], "train.preempt_signal", 1),
        ("unknown:key", ["train.no_such_key=1"], "train.no_such_key", 1),
        ("unknown:plus-key", ["+train.another=1"], "train.another", 1),
        ("unknown:section", ["+nosection.key=1"], "nosection", 1),
        ("group:model", ["model=no_such_model"], "no_such_model", 1),
        ("group:parallel", ["parallel=nope"], "nope", 1),
        ("hydra:config-name", ["--config-name", "no_such_config"], "no_such_config", 1),
        ("hydra:searchpath", ["hydra.searchpath=notalist"], "hydra.searchpath", 1),
        ("hydra:config-dir", ["--config-dir", f"{tmp}/no_dir"], "--config-dir", 1),
        ("hydra:grammar", ["train.steps=[1,"], "", 1),
        ("multirun:bad-job", ["-m", "train.steps=50,0"], "train.steps=0", 1),
    ]


def _check_output(stderr: str, stdout: str, expect: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), stderr[-3000:]
    assert expect in lines[0], (expect, lines[0])
    assert "Traceback" not in stderr + stdout


def _run_in_process(args: list[str], world: int, monkeypatch, capsys) -> tuple[int, str, str]:
    import torch.distributed as dist

    def started(*_a, **_k):  # a case that reached Hydra's app would start training: fail instead
        raise AssertionError(f"{args} was accepted")

    monkeypatch.setattr(train_cli, "hydra_app", started)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(args)
    assert not dist.is_initialized()
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def tmp_config_paths(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    return str(tmp_path)


GENERATED = generated_cases()


def test_the_matrix_has_at_least_90_cases(tmp_path):
    assert len(GENERATED) + len(hand_cases(str(tmp_path))) >= 90


@pytest.mark.parametrize("case", GENERATED, ids=[c[0] for c in GENERATED])
def test_every_schema_key_rejects_a_wrong_type_and_a_bad_value(case, monkeypatch, capsys, tmp_path):
    _, overrides, key = case
    code, out, err = _run_in_process([*overrides, f"train.out_dir={tmp_path}/run"], 1, monkeypatch, capsys)
    assert code == 2
    _check_output(err, out, key)


HAND_IDS = [c[0] for c in hand_cases("/tmp")]


@pytest.mark.parametrize("index", range(len(HAND_IDS)), ids=HAND_IDS)
def test_cross_key_and_launch_errors(index, monkeypatch, capsys, tmp_config_paths):
    _, overrides, expect, world = hand_cases(tmp_config_paths)[index]
    if not any(o.startswith("train.out_dir") for o in overrides):
        overrides = [*overrides, f"train.out_dir={tmp_config_paths}/run"]
    code, out, err = _run_in_process(overrides, world, monkeypatch, capsys)
    assert code == 2
    _check_output(err, out, expect)


# One case of each kind of check, through a real process: the schema (a value), Hydra's composition
# (a flag), a filesystem probe. Several ranks of one job without a rendezvous, and torchrun ranks,
# are test_train_cli's (test_bad_value_exits_nonzero_on_every_rank_before_any_process_group,
# test_torchrun_config_error_prints_one_line).
SUBPROCESS_SAMPLE = ["train.steps:range", "hydra:config-name", "out_dir:under-a-file"]


@pytest.mark.slow
def test_a_sample_through_real_processes(tmp_config_paths):
    cases = {c[0]: (c[1], c[2]) for c in GENERATED}
    cases.update({c[0]: (c[1], c[2]) for c in hand_cases(tmp_config_paths)})
    procs = {name: subprocess.Popen([sys.executable, "-m", "parallel3d.train", *cases[name][0]], cwd=tmp_config_paths,
                                    env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in SUBPROCESS_SAMPLE}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, out, err)
        _check_output(err, out, cases[name][1])


def test_a_missing_data_file_names_its_key_and_a_bin_suffix_gets_the_prefix(tmp_path):
    """Session 43: a missing validation prefix was reported as a ``data.paths`` entry, and ``data.paths=[x.bin]``
    (Megatron's entries are prefixes) as "x.bin.bin does not exist" with no hint."""
    from parallel3d.config import ConfigError
    from parallel3d.data.options import DataOptions
    from parallel3d.preflight import check_data_files

    for ext in (".bin", ".idx"):
        (tmp_path / f"a{ext}").write_bytes(b"")
    good, missing = str(tmp_path / "a"), str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=rf"^data\.valid_paths entry '{missing}': file {missing}\.bin does not"):
        check_data_files(DataOptions(source="indexed", paths=(good,), valid_paths=(missing,), valid_fraction=0.0))
    with pytest.raises(ConfigError, match=rf"entries are prefixes without \.bin/\.idx: '{good}'\)$"):
        check_data_files(DataOptions(source="indexed", paths=(good + ".bin",)))
    check_data_files(DataOptions(source="indexed", paths=(good,)))


def test_a_document_mask_without_a_tokenizer_is_a_config_error_before_any_rank(tmp_path):
    """Session 44: ``data.document_mask=true`` on indexed data with no tokenizer failed on every rank after the
    model was built (``[rank 0] failed: DataError``, exit 1); it is now one config line (exit 2) from preflight,
    found by the same rule the run reads its tokenizer by (``data.tokenizer_file``, else ``<prefix>.tokenizer.json``)."""
    from parallel3d.config import ConfigError
    from parallel3d.data.options import DataOptions
    from parallel3d.preflight import check_data_files

    for ext in (".bin", ".idx"):
        (tmp_path / f"a{ext}").write_bytes(b"")
    prefix = str(tmp_path / "a")
    masked = DataOptions(source="indexed", paths=(prefix,), document_mask=True)
    with pytest.raises(ConfigError, match=r"^data\.document_mask=true: .*set data\.tokenizer_file"):
        check_data_files(masked)
    check_data_files(DataOptions(source="indexed", paths=(prefix,)))  # no mask: no tokenizer needed
    (tmp_path / "a.tokenizer.json").write_text("{}")  # found beside the data (its content is read by the run)
    check_data_files(masked)

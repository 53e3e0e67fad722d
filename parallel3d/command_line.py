"""What ``python -m parallel3d.train ARGS`` will run, composed and validated before Hydra runs it.

Hydra reports a bad override (an unknown key, a wrong type) with a multi-line error and
exit 1, and only once it has started the job. ``check_command_line`` reads the command
line with Hydra's own argument parser, composes every job it would run with the public
compose API and the same search path (the primary config dir or ``--config-path``,
``--config-dir``, ``hydra.searchpath=[...]``, ``--config-name``), and validates each with
``config.resolve``, so a problem is one ``ConfigError`` whatever flags are given
(``--cfg``, ``--info``, ``--help``, ``-m`` ...).

Multirun (``-m``, Hydra's basic sweeper: the cartesian product of the sweep overrides in
command-line order, ``glob()`` over the group's YAML files): each job is one run with its
own output directory, the directory Hydra creates for it, ``hydra.sweep.dir /
hydra.sweep.subdir``, which ``conf/config.yaml`` sets to ``train.out_dir / <job number>``.
When ``train.out_dir`` itself is swept, each job's ``train.out_dir`` is its directory
(``MultirunPlan.overrides`` adds ``hydra.sweep.subdir=.``). Two jobs that would share a
directory are refused with one line: they would resume each other's checkpoints.
"""

from __future__ import annotations

import glob as globlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from parallel3d.config import ConfigError, check_no_extra_keys, one_line_omegaconf_error, resolve
from parallel3d.option_checks import check_bool
from parallel3d.preflight import check_writable_dir

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MAX_CHECKED_JOBS = 256  # a bigger sweep is checked on its first jobs only (each compose costs ~0.1 s)


@dataclass
class CommandLine:
    """The parts of a command line that decide which configs are composed."""

    overrides: list[str]
    parsed: list[Any]  # Hydra's Override of each of ``overrides``, in order: parsed once, here
    config_dir: str  # primary config directory
    config_name: str
    search_path: list[str]  # extra search path entries (``file://...``), in order
    multirun: bool
    extra_config_dir: str | None = None  # ``--config-dir`` as ``file://ABS`` (also first in search_path)
    check: bool = True  # False for shell completion / rerun: nothing is composed from the overrides
    runs: bool = True  # False for --cfg / --help / --hydra-help / --info: Hydra prints and runs no job


@dataclass
class MultirunPlan:
    """The jobs a command line runs: one without ``-m``."""

    jobs: list[list[str]]  # every job's overrides (job overrides only, hydra.* excluded)
    hydra_subdir: str | None = None  # hydra.sweep.subdir as given or added here; None = the config's (job number)
    out_dirs: list[str] = field(default_factory=list)  # each checked job's train.out_dir, in job order
    runs: bool = True  # CommandLine.runs: the jobs will run (their directories are then locked: run_lock)
    overrides: list[str] = field(default_factory=list)  # added to the command line before Hydra runs it


def parse(args: list[str], default_config_dir: str, default_config_name: str = "config") -> CommandLine | None:
    """Hydra's reading of ``args``; None when argparse itself rejects them (Hydra then says why)."""
    from hydra._internal.utils import get_args_parser

    try:
        ns = get_args_parser().parse_args(args)
    except SystemExit:
        return None
    config_dir = default_config_dir
    if ns.config_path is not None:  # relative to the file declaring @hydra.main, as Hydra does
        config_dir = ns.config_path if os.path.isabs(ns.config_path) else os.path.join(PACKAGE_DIR, ns.config_path)
    search: list[str] = []
    extra = None
    if ns.config_dir is not None:
        path = os.path.abspath(ns.config_dir)
        if not os.path.isdir(path):
            raise ConfigError(f"--config-dir={ns.config_dir}: directory {path} does not exist")
        extra = f"file://{path}"
        search.append(extra)
    overrides = list(ns.overrides)
    parsed = _parse_overrides(overrides)
    for override, raw in zip(parsed, overrides):
        if override.get_key_element() == "hydra.searchpath":
            value = override.value()
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{raw}: hydra.searchpath must be a list of strings, e.g. [file:///my/confs]")
            search += value
    return CommandLine(
        overrides=overrides, parsed=parsed, config_dir=config_dir, config_name=ns.config_name or default_config_name,
        search_path=search, multirun=bool(ns.multirun), extra_config_dir=extra,
        check=not (ns.shell_completion or ns.experimental_rerun is not None),
        runs=not (ns.cfg or ns.help or ns.hydra_help or ns.info),
    )


def _parse_overrides(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors: one line
        raise ConfigError(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_hydra_key(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _group_options(cmd: CommandLine, group: str) -> list[str]:
    """Option names of config group ``group`` in every search path directory (for ``glob()``)."""
    dirs = [cmd.config_dir] + [p[len("file://"):] for p in cmd.search_path if p.startswith("file://")]
    names = set()
    for d in dirs:
        for path in globlib.glob(os.path.join(d, group.replace(".", "/"), "*.yaml")):
            names.add(os.path.splitext(os.path.basename(path))[0])
    return sorted(names)


def expand_jobs(cmd: CommandLine) -> MultirunPlan:
    """Every job's job overrides (one job without ``-m``), as Hydra's basic sweeper orders them."""
    axes: list[list[str]] = []
    out_dir_swept = False
    hydra_subdir = None
    for override, raw in zip(cmd.parsed, cmd.overrides):
        key = override.get_key_element()
        if _is_hydra_key(key.lstrip("+~")):
            if key == "hydra.sweep.subdir":
                hydra_subdir = override.get_value_element_as_str()
            continue
        if cmd.multirun and override.is_sweep_override():
            if override.value_type.name == "GLOB_CHOICE_SWEEP":
                values = override.value().filter(_group_options(cmd, override.key_or_group))
            else:
                values = list(override.sweep_string_iterator())
            axes.append([f"{key}={v}" for v in values])
            out_dir_swept |= key == "train.out_dir"
        else:
            axes.append([raw])
    jobs = [list(combo) for combo in itertools.product(*axes)]
    plan = MultirunPlan(jobs, hydra_subdir, runs=cmd.runs)
    if cmd.multirun and out_dir_swept and hydra_subdir is None:
        plan.overrides.append("hydra.sweep.subdir=.")
        plan.hydra_subdir = "."
    return plan


def job_out_dir(out_dir: str, job_num: int, subdir: str | None) -> str:
    """The directory Hydra gives job ``job_num`` of a multirun (``hydra.sweep.dir / hydra.sweep.subdir``)."""
    if subdir is None:
        subdir = str(job_num)
    subdir = subdir.replace("${hydra.job.num}", str(job_num)).replace("${hydra:job.num}", str(job_num))
    return os.path.normpath(os.path.join(out_dir, subdir))


def to_job(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """A composed DictConfig as ``(JobConfig, plain resolved dict)`` (raises ConfigError)."""
    from omegaconf import OmegaConf

    check_no_extra_keys(cfg)
    try:
        job = OmegaConf.to_object(cfg)
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(one_line(exc)) from None
    return job, plain


def _check_group_choices(cmd: CommandLine, job_overrides: list[str], parsed: list[Any]) -> None:
    """``model=null`` (a group set to null) names the group and its options (Hydra's error names neither)."""
    for override, raw in zip(parsed, job_overrides):
        group = override.get_key_element().lstrip("+")
        options = _group_options(cmd, group)
        if options and not override.is_delete() and override.value() is None:
            raise ConfigError(f"{raw}: {group} is a config group; must be one of {', '.join(options)}")


def compose(cmd: CommandLine, job_overrides: list[str]) -> Any:
    """The composed DictConfig of one job (raises ConfigError with one line).

    Uses the compose API over the search path ``hydra.main`` builds for this command line
    (primary dir, then ``--config-dir`` where Hydra puts it); ``hydra.searchpath=[...]`` goes
    in as an override, which Hydra processes the same way in both.
    """
    from hydra import compose as hydra_compose
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    parsed = _parse_overrides(job_overrides)  # once per job: both checks read it
    _check_group_choices(cmd, job_overrides, parsed)
    overrides = list(job_overrides)
    user_search = [p for p in cmd.search_path if p != cmd.extra_config_dir]
    if user_search:
        overrides.append("hydra.searchpath=[" + ",".join(user_search) + "]")
    gh = GlobalHydra.instance()
    gh.clear()
    try:
        search = create_config_search_path(f"file://{os.path.abspath(cmd.config_dir)}")
        if cmd.extra_config_dir:
            search.prepend(provider="command-line", path=cmd.extra_config_dir,
                           anchor=SearchPathQuery(provider="schema"))
        Hydra.create_main_hydra2(task_name="parallel3d", config_search_path=search)
        cfg = hydra_compose(config_name=cmd.config_name, overrides=overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra raises many types; all are config problems here
        raise ConfigError(one_line(exc)) from None
    finally:
        gh.clear()
    _check_bool_overrides(cfg, parsed)
    return cfg


def _check_bool_overrides(cfg: Any, parsed: list[Any]) -> None:
    """A number given for a bool-typed key is refused: OmegaConf reads any nonzero number as true
    (``model.tie_embeddings=2``), so the override's value is checked as typed, against the composed
    node's type (whatever the schema: the training job's or the planners'). true/false and the words
    OmegaConf reads (yes/no, on/off) still pass."""
    from omegaconf import DictConfig
    from omegaconf.nodes import BooleanNode

    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or _is_hydra_key(key):
            continue
        value = override.value()
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        if isinstance(value, str) and not _reads_as_number(value):
            continue
        node = cfg
        for part in key.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if isinstance(node, BooleanNode):
            check_bool(key, value)


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span lines and chain causes; keep the one that names the key."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    keyed = [e for e in chain if getattr(e, "full_key", None)]
    return one_line_omegaconf_error(keyed[0] if keyed else exc) or type(exc).__name__


def _check_hydra_dirs(cmd: CommandLine, out_dir: str) -> None:
    """``hydra.run.dir`` / ``hydra.output_subdir`` given on the command line can be created (Hydra's own
    mkdir fails with a traceback); values with an interpolation are Hydra's to resolve, not checked."""
    given = {o.get_key_element(): o.value() for o in cmd.parsed
             if o.get_key_element() in ("hydra.run.dir", "hydra.output_subdir")}
    run_dir = given.get("hydra.run.dir", out_dir)
    if isinstance(run_dir, str) and "${" not in run_dir:
        check_writable_dir("hydra.run.dir", run_dir)
        subdir = given.get("hydra.output_subdir")
        if isinstance(subdir, str) and "${" not in subdir:
            check_writable_dir("hydra.output_subdir", os.path.join(run_dir, subdir))


def check_command_line(args: list[str], default_config_dir: str) -> MultirunPlan | None:
    """Compose and resolve every job of ``args`` (raises ConfigError); the plan of its jobs (one without
    ``-m``), or None when Hydra composes nothing from the overrides (shell completion, rerun)."""
    cmd = parse(args, default_config_dir)
    if cmd is None or not cmd.check:
        return None
    plan = expand_jobs(cmd)
    for num, job_overrides in enumerate(plan.jobs[:MAX_CHECKED_JOBS]):
        job, _ = to_job(compose(cmd, job_overrides))
        if cmd.multirun:
            job.train.out_dir = job_out_dir(job.train.out_dir, num, plan.hydra_subdir)
        plan.out_dirs.append(job.train.out_dir)
        try:
            resolve(job)
            if not cmd.multirun:
                _check_hydra_dirs(cmd, job.train.out_dir)
        except ConfigError as exc:
            where = f"multirun job {num} ({' '.join(job_overrides)}): " if cmd.multirun and len(plan.jobs) > 1 else ""
            raise ConfigError(f"{where}{exc}") from None
    if cmd.multirun:
        seen: dict[str, int] = {}
        for num, out_dir in enumerate(plan.out_dirs):
            if out_dir in seen:
                raise ConfigError(
                    f"train.out_dir={out_dir}: multirun jobs {seen[out_dir]} and {num} would share this run "
                    f"directory (the second would resume the first's checkpoints); sweep train.out_dir or keep "
                    f"hydra.sweep.subdir at its default (the job number)"
                )
            seen[out_dir] = num
    return plan

"""Cheap checks that a README command would start: each is handed to the entry point's own validation,
never run. Hydra jobs go through ``command_line.check_command_line`` (the training CLI's own check, every
key composed and resolved at the command's world size), the planners through their compose + the part of
their run that validates, the dry run through ``dryrun.__main__.prepare``, argparse scripts through their own
parser (captured at ``parse_args``: the script's ``main`` stops there), pytest arguments through pytest's
parser. Which checker applies is read from the target's source (``checker_of``), not from a list.

Invariant: a check returns None when the command would start, else one line saying why not.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

from tests.readme_commands import ROOT, Command, is_placeholder


class _Parsed(Exception):
    """The script's own parser accepted README's arguments: stop its main there."""


def module_file(name: str) -> Path | None:
    """The source file of module ``name`` (a package's ``__main__``), None if it does not exist."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    if spec.submodule_search_locations is not None:
        origin = origin.parent / "__main__.py"
    return origin if origin.is_file() else None


def script_target(cmd: Command) -> Path | None:
    """The file ``cmd`` runs (a script path or a module's source)."""
    if cmd.kind == "module":
        return module_file(cmd.target)
    path = ROOT / cmd.target
    return path if path.is_file() else None


def forwarded_module(shell_script: Path) -> str | None:
    """The module a shell wrapper hands its arguments to (``... -m MODULE ... "$@"``)."""
    m = re.search(r"-m\s+([\w.]+)[^\n]*\"\$@\"", shell_script.read_text())
    return m.group(1) if m else None


def checker_of(source: Path) -> tuple[str, str]:
    """``(checker, detail)`` for a Python entry point, from what its source calls."""
    text = source.read_text()
    if "from parallel3d.train import main" in text or source == module_file("parallel3d.train"):
        return "train", ""
    if source == module_file("parallel3d.dryrun"):
        return "dryrun", ""
    app = re.search(r'run_app\("(\w+)"', text)
    if app:
        return "planning", app.group(1)
    if any("ArgumentParser(" in t for t in (text, *(sibling.read_text() for sibling in _siblings(source, text)))):
        return "argparse", ""
    return "exists", "no argparse parser: the entry point must exist"


def _siblings(source: Path, text: str) -> list[Path]:
    """The modules beside ``source`` that it imports by bare name (``python scripts/x.py`` puts its folder on
    ``sys.path``): a script whose parser lives in a shared helper (``scripts/odd_pair_runs.py``) is checked too."""
    names = re.findall(r"^from (\w+) import|^import (\w+)", text, re.M)
    paths = [source.parent / f"{a or b}.py" for a, b in names]
    return [p for p in paths if p.is_file() and p != source]


def check_train(args: list[str], world_size: int) -> str | None:
    """The training CLI's own validation (every job of a sweep) at ``world_size`` processes."""
    from parallel3d import command_line
    from parallel3d.config import ConfigError
    from parallel3d.train import CONF_DIR

    env = {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world_size)}
    saved = {k: os.environ.get(k) for k in env}
    if command_line.parse(list(args), CONF_DIR) is None:
        return f"Hydra's argument parser rejects {args}"
    os.environ.update(env)
    try:
        command_line.check_command_line(list(args), CONF_DIR)
    except ConfigError as exc:
        return f"config error: {exc}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return None


def check_planning(args: list[str], config_name: str, split_flags: bool) -> str | None:
    """What scripts/plan.py / estimate_memory.py check before their work: the keys compose into a
    ``PlanningJob``; the estimate is run (it is cheap); the plan's model, cluster and JSON path are checked."""
    from omegaconf import OmegaConf

    from parallel3d import command_line
    from parallel3d.config import ConfigError
    from parallel3d.planning import cli
    from parallel3d.preflight import check_writable_file
    from parallel3d.topology import LayoutError

    cli.register_planning_schema()
    if split_flags:
        args = cli.split_device_mem_flag(list(args))
    try:
        cli.check_overrides(list(args), config_name)
        cmd = command_line.parse(list(args), str(cli.CONF_DIR), config_name)
        if cmd is None:
            return f"Hydra's argument parser rejects {args}"
        job = OmegaConf.to_object(command_line.compose(cmd, command_line.expand_jobs(cmd).jobs[0]))
        if config_name == "estimate":
            cli.run_estimate(job)
        else:
            cli.cluster_from(job.cluster)
            cli.resolve_model_only(job)
            if job.plan.json:
                check_writable_file("plan.json", job.plan.json)
    except (ConfigError, LayoutError, ValueError) as exc:
        return f"error: {exc}"
    return None


def check_dryrun(args: list[str]) -> str | None:
    from parallel3d.config import ConfigError
    from parallel3d.dryrun.__main__ import prepare
    from parallel3d.topology import LayoutError

    try:
        prepare(list(args))
    except (ConfigError, LayoutError, ValueError) as exc:
        return f"config error: {exc}"
    return None


def check_argparse(source: Path, run_name: str, args: list[str], as_module: str | None) -> str | None:
    """Run the entry point until its own parser has parsed ``args`` (then stop it); its error if rejected."""
    original = argparse.ArgumentParser.parse_args
    rejected: list[str] = []

    def parse_once(self: argparse.ArgumentParser, _args: Any = None, namespace: Any = None) -> Any:
        argparse.ArgumentParser.parse_args = original  # a parser that parses inside parse_args stays real
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                original(self, with_defaults_for_placeholders(self, args), namespace)
        except SystemExit:
            rejected.append(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "rejected")
        raise _Parsed

    argv, path = sys.argv, list(sys.path)
    argparse.ArgumentParser.parse_args = parse_once  # type: ignore[method-assign]
    sys.argv = [str(source), *args]
    if not as_module:
        sys.path.insert(0, str(source.parent))  # as ``python scripts/x.py`` does: its siblings import
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if as_module:
                with warnings.catch_warnings():  # runpy's note that the module is imported already
                    warnings.simplefilter("ignore", RuntimeWarning)
                    runpy.run_module(as_module, run_name=run_name, alter_sys=False)
            else:
                runpy.run_path(str(source), run_name=run_name)
    except _Parsed:
        return rejected[0] if rejected else None
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv, sys.path[:] = argv, path
    return "its main returned without parsing arguments with argparse"


def with_defaults_for_placeholders(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """README's placeholder values (``--hidden H``, ``<run ids>``) stand for a value README does not state: the
    flag's own default takes their place, so the flag is checked and the value is not invented."""
    out = list(args)
    for i, arg in enumerate(args):
        if i and is_placeholder(arg) and args[i - 1] in parser._option_string_actions:
            default = parser._option_string_actions[args[i - 1]].default
            if default is not None:
                out[i] = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return out


def check_pytest(args: list[str], pytest_parser: Any) -> str | None:
    """pytest's own parser (this session's: conftest's options and the plugins registered) knows every flag,
    and every test path exists."""
    namespace, unknown = pytest_parser.parse_known_and_unknown_args(list(args))
    if unknown:
        return f"pytest does not know {unknown}"
    missing = [p for p in namespace.file_or_dir if not (ROOT / p.split("::")[0]).exists()]
    return f"no such test path {missing}" if missing else None


def check_pip(args: list[str]) -> str | None:
    """The extras a ``pip install -e ".[a,b]"`` names exist in pyproject.toml."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for arg in args:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", arg.strip("'\""))
        if m:
            missing = [e for e in m.group(1).split(",") if e not in declared]
            if missing:
                return f"pyproject.toml has no extra {missing} (has {sorted(declared)})"
    return None


def check_shell_script(path: Path, seen: set[Path] | None = None) -> str | None:
    """A wrapper's set-up path, short of running it: bash parses it, each script it runs (``bash X``)
    exists and passes the same check, and the extras its ``pip install`` names exist."""
    seen = set() if seen is None else seen
    seen.add(path)
    parsed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    if parsed.returncode:
        return f"bash -n {path.relative_to(ROOT)}: {parsed.stderr.strip()}"
    text = path.read_text()
    for called in re.findall(r"^\s*(?:exec\s+)?bash\s+(\S+\.sh)", text, re.M):
        target = ROOT / called
        if not target.is_file():
            return f"{path.relative_to(ROOT)} runs a missing {called}"
        if target not in seen and (error := check_shell_script(target, seen)):
            return error
    for line in re.findall(r"pip install[^\n]*", text):
        if error := check_pip(line.split()):
            return f"{path.relative_to(ROOT)}: {error}"
    return None


def check_command(cmd: Command, pytest_parser: Any) -> str | None:
    """One line saying why ``cmd`` would not start, or None."""
    if cmd.kind == "python-c":
        compile(cmd.args[0], "<README python -c>", "exec")
        return None
    if cmd.kind == "pip":
        return check_pip(cmd.args)
    if cmd.kind == "external":
        return None
    if cmd.kind == "bare":
        return None  # a program named in prose (classify's rule)
    source = script_target(cmd)
    if source is None:
        return f"no such {'module' if cmd.kind == 'module' else 'file'}: {cmd.target}"
    if cmd.inline and not cmd.args:
        return None  # an entry point named in prose (classify's rule): existing is all
    if cmd.kind == "sbatch":
        return check_train(cmd.args, cmd.world_size)
    if source.suffix == ".sh":
        if error := check_shell_script(source):
            return error
        module = forwarded_module(source)
        if module is None:
            return None  # a shell script that takes no arguments to check: existing is all
        source = module_file(module)
        if source is None:
            return f"{cmd.target} runs a missing module {module}"
        return _check_python(source, module, cmd.args, cmd.world_size, pytest_parser)
    if source.suffix != ".py":
        return None  # an executable file (e.g. .ci/run): existing is all
    return _check_python(source, cmd.target if cmd.kind == "module" else None, cmd.args, cmd.world_size,
                         pytest_parser)


def _check_python(source: Path, module: str | None, args: list[str], world_size: int,
                  pytest_parser: Any) -> str | None:
    if module == "pytest":
        return check_pytest(args, pytest_parser)
    checker, detail = checker_of(source)
    if checker == "train":
        return check_train(args, world_size)
    if checker == "dryrun":
        return check_dryrun(args)
    if checker == "planning":
        return check_planning(args, detail, "split_device_mem_flag" in source.read_text())
    if checker == "argparse":
        return check_argparse(source, "__main__", args, module)
    return None

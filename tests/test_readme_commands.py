"""Every command README.md, docs/*.md and conf/README.md show would start as written: extracted from those files
(``tests/readme_commands.py``) and handed to its entry point's own validation (``tests/readme_checks.py``),
never run. Every repository path and config key they name exists. Commands not meant to run here (SLURM, pip on a cluster, an external
tool) are skipped by a stated rule, printed with ``-rP`` / ``-s``; a ``...`` repeat of an earlier command is
no command (it starts with no program).
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.readme_checks import check_command
from tests.readme_commands import (ROOT, config_key_references, doc_files, doc_name, is_placeholder, path_references,
                                   readme_commands)

COMMANDS = readme_commands()
PATHS = [(doc_name(f), line, path) for f in doc_files() for line, path in path_references(f.read_text())]
KEYS = [(doc_name(f), line, key, value) for f in doc_files() for line, key, value in config_key_references(f.read_text())]


@pytest.fixture
def in_scratch_dir(tmp_path, monkeypatch):
    """README's relative output paths (``runs/...``) land in a fresh directory, as on a clean clone."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_commands_are_found():
    """The extraction sees the commands of every kind (a broken extractor would pass everything), in README
    and in the docs/ files (140 commands before README's history moved to docs/, session 41)."""
    kinds = {c.kind for c in COMMANDS}
    assert {"module", "script", "sbatch", "pip"} <= kinds, kinds
    assert len(COMMANDS) >= 140, len(COMMANDS)
    assert COMMANDS[0].words[:2] == ["bash", "scripts/pretrain.sh"], COMMANDS[0].where()
    files = {c.file for c in COMMANDS}
    assert "README.md" in files and any(f.startswith("docs/") for f in files), files


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.file}:L{c.line}-{c.target or c.kind}" for c in COMMANDS])
def test_readme_command_would_start(cmd, in_scratch_dir, pytestconfig):
    if cmd.skip:
        print(f"{cmd.where()}\n  rule: {cmd.skip}")
    error = check_command(cmd, pytestconfig._parser)
    assert error is None, f"{cmd.where()}\n  -> {error}"


def _attribute_defined(path: str) -> bool:
    """``tests/layout_run.run_case``: a module path and a name it defines."""
    module, _, name = path.rpartition(".")
    source = ROOT / f"{module}.py"
    return source.is_file() and re.search(rf"^(def|class) {name}\b|^{name}\s*[:=]", source.read_text(),
                                          re.M) is not None


@pytest.mark.parametrize("doc,line,path", PATHS, ids=[f"{doc}:L{line}-{path}" for doc, line, path in PATHS])
def test_readme_path_exists(doc, line, path):
    if "*" in path:
        assert glob.glob(str(ROOT / path)), f"{doc}:{line}: {path} matches no file"
        return
    if "<" in path:
        print(f"{doc}:{line}: {path}\n  rule: a placeholder path (<...>): not checked")
        return
    exists = os.path.exists(ROOT / path) or ("." in path.rsplit("/", 1)[-1] and _attribute_defined(path))
    assert exists, f"{doc}:{line}: {path} does not exist"


def _schema_has(key: str) -> bool:
    """``key`` is a key of the planners' schema (the training job's plus ``cluster.*`` and ``plan.*``)."""
    from omegaconf import DictConfig, OmegaConf

    from parallel3d.planning.cli import PlanningJob

    node = OmegaConf.structured(PlanningJob)
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("doc,line,key,value", KEYS, ids=[f"{doc}:L{line}-{key}" for doc, line, key, _ in KEYS])
def test_readme_config_key_exists(doc, line, key, value):
    """A key README names in prose (``train.eval_iters``, ``model=mixtral_tiny``) is one the job accepts; the
    values are not checked (README shows refused values on purpose, and placeholders such as ``N``)."""
    where = f"{doc}:{line}: {key}{'=' + value if value else ''}"
    module = ROOT / key.replace(".", "/")
    if not value and (module.with_suffix(".py").is_file() or module.is_dir()):
        print(f"{where}\n  rule: names a module of the repository (it exists), not a config key")
    elif key.startswith("dryrun."):
        from parallel3d.dryrun.options import split_args

        split_args([f"{key}=1", "dryrun.world_size=1"])  # raises on a key the dry run does not take
    elif "." in key:
        assert _schema_has(key), f"{where}: no such config key"
    elif value and value not in ("null", "...") and not is_placeholder(value) and "|" not in value:
        assert (ROOT / "conf" / key / f"{value}.yaml").is_file(), f"{where}: no conf/{key}/{value}.yaml"

"""The documentation's commands, read from README.md, docs/*.md and conf/README.md themselves: every
fenced-block line and inline code span that starts with a program (python, torchrun, bash, pytest, sbatch, pip,
wandb), split into words as the shell would, and classified by what it runs. Nothing here is a hand-kept list of
commands: a command added to README, to a docs/ topic file or to conf/README.md is extracted and checked
(``tests/test_readme_commands.py``, ``readme_checks``) without touching this file.

Invariant: each ``Command`` keeps its file, line number and text, so a failing check names where it is.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
CONF_README = ROOT / "conf" / "README.md"


def doc_files() -> list[Path]:
    """README first (its first command is the newcomer's), then the docs/ topic files in name order, then the
    config reference (``conf/README.md``), whose commands, paths and keys a newcomer copies too."""
    return [README, *sorted(DOCS_DIR.glob("*.md")), CONF_README]


def doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT))

PYTHONS = ("python", "python3", ".venv/bin/python", ".venv/bin/python3")
TORCHRUNS = ("torchrun", ".venv/bin/torchrun")
PROGRAMS = (*PYTHONS, *TORCHRUNS, "bash", "pytest", ".venv/bin/pytest", "sbatch", "pip", ".venv/bin/pip", "wandb")
PREFIXES = ("/usr/bin/time", "time", "env")  # words before the program that only wrap it
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PATH_ROOTS = ("parallel3d", "conf", "scripts", "tests", "docs", "models", "kernels", "bench_results")
PATH_REF = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w./*<>-]|\{[\w.,-]*\})*)" % "|".join(PATH_ROOTS))


@dataclass
class Command:
    line: int  # line of ``file`` the command starts on
    text: str  # as README writes it (continuations joined)
    words: list[str] = field(default_factory=list)  # the shell's words, wrapper prefixes and env removed
    env: dict[str, str] = field(default_factory=dict)
    kind: str = ""  # see classify()
    target: str = ""  # the module, script or file it runs
    args: list[str] = field(default_factory=list)  # the target's own arguments
    world_size: int = 1  # torchrun --nproc-per-node; sbatch --nodes x GPUS_PER_NODE
    skip: str = ""  # the stated rule that skips it, else ""
    inline: bool = False  # from an inline code span (else a fenced block)
    file: str = "README.md"  # the documentation file it is written in, relative to the repository

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _blocks_and_prose(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code-block lines, prose lines), each as (1-based line number, text)."""
    code, prose, fenced = [], [], False
    for num, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        (code if fenced else prose).append((num, line))
    return code, prose


def _first_program(words: list[str]) -> int | None:
    """Index of the program word after env assignments and wrappers, None if the words are no command."""
    for i, word in enumerate(words):
        if ENV_ASSIGNMENT.match(word) or word in PREFIXES:
            continue
        return i if word in PROGRAMS else None
    return None


def _rough_words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def block_commands(text: str) -> list[Command]:
    """Commands in fenced blocks: logical lines (``\\`` continuations joined) that start with a program."""
    code, _ = _blocks_and_prose(text)
    out, pending, start = [], "", 0
    for num, line in code:
        if not pending:
            start = num
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical, pending = pending + line, ""
        if _first_program(_rough_words(logical)) is not None:
            out.append(Command(line=start, text=" ".join(logical.split())))
    return out


def inline_spans(text: str) -> list[tuple[int, str]]:
    """Every inline code span of the prose (spans may wrap over lines), with its line number."""
    _, prose = _blocks_and_prose(text)
    joined = "\n".join(line for _, line in prose)
    numbers = [num for num, _ in prose]
    spans = []
    for m in re.finditer(r"`([^`]+)`", joined):
        line = numbers[joined.count("\n", 0, m.start())]
        spans.append((line, " ".join(m.group(1).split())))
    return spans


def inline_commands(text: str) -> list[Command]:
    return [Command(line=line, text=span, inline=True) for line, span in inline_spans(text)
            if _first_program(_rough_words(span)) is not None]


def _first_alternative(word: str) -> str:
    """README writes alternatives in a word: ``--split calibration|all``, ``--hidden {128,256}``; the first
    stands for all (each is a value of the same flag)."""
    word = re.sub(r"(?<!\$)\{([^{},]*),[^{}]*\}", r"\1", word)
    if "|" in word:
        key, sep, value = word.rpartition("=") if "=" in word else ("", "", word)
        word = key + sep + value.split("|")[0]
    return word


def shell_words(text: str) -> list[str]:
    """The words the shell passes: placeholders (``<run ids>``) become one word, ``$PWD`` the repository,
    ``$(...)`` is run by bash (README's own substitution, e.g. a generated ``pp_layers`` list)."""
    text = re.sub(r"<[^<>]*>", PLACEHOLDER, text)
    if "$(" in text:
        script = f'cd "{ROOT}"; PATH="{ROOT}/.venv/bin:/work/main/.venv/bin:$PATH"; printf "%s\\0" {text}'
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True)
        words = done.stdout.split("\0")[:-1]
    else:
        words = shlex.split(text.replace("$PWD", str(ROOT)), comments=True)
    return [_first_alternative(w) for w in words]


PLACEHOLDER = "PLACEHOLDER"


def is_placeholder(word: str) -> bool:
    """``<run ids>`` (made PLACEHOLDER by shell_words) or a capital letter or two standing for a number (``H``)."""
    return word == PLACEHOLDER or re.fullmatch(r"[A-Z]{1,2}", word) is not None


def _flag_value(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


# torchrun's options that take a value (the word after them is not the script); both spellings.
TORCHRUN_VALUE_FLAGS = tuple(f"--{name.replace('_', sep)}"
                             for name in ("nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint",
                                          "rdzv_id", "master_addr", "master_port")
                             for sep in ("-", "_"))


def _after_launcher(args: list[str]) -> tuple[str, str, list[str]]:
    """``(kind, target, args)`` of what ``python`` / ``torchrun`` runs: ``-m module`` or a script."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m" and i + 1 < len(args):
            return "module", args[i + 1], args[i + 2:]
        if arg == "-c":
            return "python-c", "", args[i + 1:]
        if arg in TORCHRUN_VALUE_FLAGS:  # torchrun's options with a value
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return "script", arg, args[i + 1:]
    return "bare", "", []


SBATCH_GPUS_PER_NODE = re.compile(r'GPUS_PER_NODE="\$\{GPUS_PER_NODE:-\$\{SLURM_GPUS_ON_NODE:-(\d+)\}\}"')


def classify(cmd: Command) -> Command:
    """Fill ``words``, ``kind``, ``target``, ``args``, ``world_size`` and ``skip`` (the stated rules)."""
    words = shell_words(cmd.text)
    start = _first_program(words)
    assert start is not None, cmd.where()
    cmd.env = dict(w.split("=", 1) for w in words[:start] if ENV_ASSIGNMENT.match(w))
    cmd.words = words[start:]
    program, rest = cmd.words[0], cmd.words[1:]
    if not rest or rest == ["-c"]:  # `sbatch`, `python -c` named in prose
        cmd.kind, cmd.skip = "bare", "a program named in prose, not a command"
        return cmd
    if program in PYTHONS or program in TORCHRUNS:
        kind, cmd.target, cmd.args = _after_launcher(rest)
        cmd.kind = kind
        if program in TORCHRUNS:
            cmd.world_size = (int(_flag_value(rest, "--nproc-per-node", "--nproc_per_node") or 1)
                              * int(_flag_value(rest, "--nnodes") or 1))
        if kind == "python-c":
            cmd.skip = "python -c snippet: compiled only (it reads files an earlier command writes)"
    elif program == "bash":
        cmd.kind, cmd.target, cmd.args = "script", rest[0], rest[1:]
    elif program in ("pytest", ".venv/bin/pytest"):
        cmd.kind, cmd.target, cmd.args = "module", "pytest", rest
    elif program == "sbatch":
        script = next((w for w in rest if not w.startswith("-")), "")
        cmd.kind, cmd.target = "sbatch", script
        cmd.args = rest[rest.index(script) + 1:] if script else []
        path = ROOT / script
        per_node = SBATCH_GPUS_PER_NODE.search(path.read_text()) if script and path.is_file() else None
        nodes = int(_flag_value(rest, "--nodes", "-N") or 1)
        cmd.world_size = nodes * int(per_node.group(1)) if per_node else nodes
        cmd.skip = "SLURM: not submitted; the script must exist and its Hydra overrides validate at nodes x GPUs"
    elif program in ("pip", ".venv/bin/pip"):
        cmd.kind, cmd.skip = "pip", "pip on a GPU cluster: not run; the extras it names must exist in pyproject.toml"
        cmd.args = rest
    else:
        cmd.kind, cmd.skip = "external", f"{program}: an external tool's command, not this repository's"
    if cmd.inline and not cmd.args and cmd.kind in ("module", "script"):
        cmd.skip = "an entry point named in prose without arguments: it must exist"
    return cmd


def path_references(text: str) -> list[tuple[int, str]]:
    """Repository paths named in inline code and commands (``parallel3d/...``, ``conf/...``, ``tests/...``),
    as ``(line, path)``; trailing punctuation dropped."""
    found: list[tuple[int, str]] = []
    sources = inline_spans(text) + [(c.line, c.text) for c in block_commands(text)]
    for line, span in sources:
        for m in PATH_REF.finditer(span):
            found += [(line, p) for p in expand_braces(m.group(1).rstrip(".,:;)"))]
    return found


def expand_braces(word: str) -> list[str]:
    """The shell's brace expansion: ``a_{x,y}.{txt,json}`` -> four words."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",") for w in expand_braces(word[:m.start()] + alt + word[m.end():])]


OUTPUT_ARGS = ("--hf", "--output-prefix", "train.out_dir")  # where a command writes what a later one reads
INPUT_KEYS = ("train.init_from", "train.resume")


def _outputs(cmd: Command) -> list[str]:
    found = []
    for i, arg in enumerate(cmd.args):
        key, sep, value = arg.partition("=")
        if key in OUTPUT_ARGS:
            found.append(value if sep else (cmd.args[i + 1] if i + 1 < len(cmd.args) else ""))
    return found


def drop_earlier_outputs(cmds: list[Command]) -> None:
    """A command reading what an earlier README command writes (``train.init_from=hf:DIR`` after an export
    ``--hf DIR``) cannot find it on a clean clone: that override is dropped and the rest checked."""
    written: set[str] = set()
    for cmd in cmds:
        for arg in list(cmd.args):
            key, _, value = arg.partition("=")
            value = value.removeprefix("hf:")
            if key in INPUT_KEYS and any(value == w or value.startswith(w + "/") for w in written):
                cmd.args.remove(arg)
                cmd.skip = f"{arg} reads an earlier README command's output: checked without it"
        written.update(_outputs(cmd))


def file_commands(path: Path) -> list[Command]:
    """One documentation file's commands in its order, classified, each naming the file."""
    text = path.read_text()
    cmds = sorted(block_commands(text) + inline_commands(text), key=lambda c: c.line)
    for cmd in cmds:
        cmd.file = doc_name(path)
    return [classify(c) for c in cmds]


def readme_commands() -> list[Command]:
    """The commands of README, then of each docs/ file (``doc_files``' order), classified; an input one of
    them reads that an earlier one writes is dropped across files too."""
    cmds = [cmd for path in doc_files() for cmd in file_commands(path)]
    drop_earlier_outputs(cmds)
    return cmds


CONFIG_GROUPS = ("model", "parallel", "train", "optimizer", "data", "logging", "kernels", "cluster", "plan", "dryrun")
KEY_REF = re.compile(r"^(%s)(\.[a-z_][\w]*)*(=.*)?$" % "|".join(CONFIG_GROUPS))
FILE_SUFFIXES = (".py", ".yaml", ".json", ".jsonl", ".md", ".txt", ".sh", ".png", ".bin", ".idx")


def config_key_references(text: str) -> list[tuple[int, str, str]]:
    """``(line, key, value)`` of every ``group.key[=value]`` / ``group=choice`` word in the inline code that is
    no command (``parallel.cp=N``, ``train.eval_iters``); wildcards (``cluster.*``) and file names skipped."""
    found = []
    for line, span in inline_spans(text):
        words = _rough_words(span)
        if _first_program(words) is not None:
            continue
        for word in words:
            word = word.rstrip(",;:)")
            if "*" in word or not KEY_REF.match(word) or word.split("=")[0].endswith(FILE_SUFFIXES):
                continue
            key, _, value = word.partition("=")
            found.append((line, key, value))
    return found

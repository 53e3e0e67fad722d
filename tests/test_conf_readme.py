"""conf/README.md's key table documents the whole training schema: every leaf key of ``JobConfig`` (generated
from the options classes) appears, backticked, in its own group's rows, and every ``conf/model/*.yaml`` is listed
as a ``model=`` option. A key or named model added without its row fails here, so the table stays the reference
the README points a newcomer to. The keys come from the schema itself, not from a list restated here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from parallel3d.config import JobConfig

ROOT = Path(__file__).resolve().parent.parent
CONF_README = ROOT / "conf" / "README.md"
BACKTICKED = re.compile(r"`([^`]+)`")


def schema_keys(obj: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf key of a schema instance, as a path (``("parallel", "tp")``, ``("model", "moe", "top_k")``)."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = (*prefix, f.name)
        keys.extend(schema_keys(value, path) if dataclasses.is_dataclass(value) else [path])
    return keys


def group_tokens(text: str) -> dict[str, set[str]]:
    """Backticked words of each group's rows in the "Groups and keys" table, by group name (``model``, ...):
    a row whose first cell names ``group/`` opens the group; rows with an empty first cell continue it."""
    section = text.split("## Groups and keys", 1)[1].split("\n## ", 1)[0]
    tokens: dict[str, set[str]] = {}
    group = None
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| group"):
            continue
        first = line.split("|")[1].strip()
        opened = re.match(r"`(\w+)/`", first)
        if opened:
            group = opened.group(1)
        if group is not None:
            tokens.setdefault(group, set()).update(BACKTICKED.findall(line))
    return tokens


def test_conf_readme_names_every_schema_key_in_its_group():
    tokens = group_tokens(CONF_README.read_text())
    keys = schema_keys(JobConfig())
    assert len(keys) > 80 and {"model", "parallel", "train", "data", "logging", "kernels"} <= {k[0] for k in keys}
    # A key is documented when its name, or its dotted path inside the section (``wandb.mode``), is backticked
    # in its section's rows.
    missing = [".".join(k) for k in keys
               if not any(".".join(k[i:]) in tokens.get(k[0], set()) for i in range(1, len(k)))]
    assert not missing, f"conf/README.md's key table lacks: {missing}"


def test_conf_readme_lists_every_named_model():
    tokens = group_tokens(CONF_README.read_text())["model"]
    names = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    assert len(names) >= 10
    assert sorted(set(names) - tokens) == [], "conf/README.md's model/ row lacks these model= options"

"""``job_from_dict``'s fast path (``parallel3d/plain_schema.py``) builds the object OmegaConf builds.

The reference is ``job_from_dict`` with the fast path switched off (``instance_of`` answering ``None``): the
OmegaConf merge into the structured schema. Compared on generated jobs: the layout matrix's, the MoE and
pipeline draws', the shape fuzz's (valid and refused draws alike), every named registry model, and each
leaf key of the schema set to a drawn value of another kind (an int, a float, a bool, a numeric string, an
interpolation, ``???``, ``None``, containers); plus unknown keys and sections given a non-dict. The two must
give the same object with the same types at every leaf, or the same exception with the same message.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any, Callable

import pytest

from models.registry import config_names
from parallel3d import config as cfg
from parallel3d import plain_schema
from tests import layout_matrix as lm
from tests import shape_fuzz as sf

SEED = 20261207
# The kinds of value a leaf is set to: each kind OmegaConf converts, refuses or keeps.
VARIANTS: tuple[Any, ...] = (3, 0, -1, 2.5, 3.0, True, False, "7", "2.5", "true", "x", "${train.seed}", "\\${x}", "???",
                             None, [1, 2], (1, 2), [2.5], [True], ["a"], {"a": 1}, 10**400)
VARIANTS_PER_LEAF = 3


def _typed(obj: Any) -> Any:
    """``obj`` with the type of every leaf beside it (1 == 1.0 == True in Python; not here)."""
    if dataclasses.is_dataclass(obj):
        return type(obj).__name__, {f.name: _typed(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple, dict)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return type(obj).__name__, [(k, _typed(v)) for k, v in items]
    return type(obj).__name__, repr(obj)


def _outcome(build: Callable[[], Any]) -> tuple:
    try:
        return "ok", _typed(build())
    except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
        return "raised", type(exc).__name__, str(exc)


def _both(monkeypatch: pytest.MonkeyPatch, values: dict, model: str | None = None) -> tuple[tuple, tuple]:
    """(job_from_dict's outcome, the OmegaConf path's outcome) for ``values``."""
    fast = _outcome(lambda: cfg.job_from_dict(values, model=model))
    with monkeypatch.context() as m:
        m.setattr(plain_schema, "instance_of", lambda schema, values: None)
        slow = _outcome(lambda: cfg.job_from_dict(values, model=model))
    return fast, slow


def _drawn_values() -> list[dict]:
    """Jobs the generators draw, before the validator judged them: the first draws of a few ids each."""
    out = []
    for case_id in (*range(4), lm.PIPE_BASE, lm.PIPE_BASE + 1, lm.MOE_BASE, lm.MOE_BASE + 1):
        rng = random.Random(f"{SEED}:{case_id}")
        out += [lm._drawer(case_id)(rng, case_id).values("out", "cache") for _ in range(3)]
    rng = random.Random(SEED)
    out += [sf.draw(rng, k).values("out", "cache") for k in range(12)]
    return out


def _leaves(schema: type, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        out += _leaves(hint, (*prefix, f.name)) if dataclasses.is_dataclass(hint) else [(*prefix, f.name)]
    return out


def _with(values: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of ``values`` with ``path`` set to ``value`` (sections on the way created)."""
    if len(path) == 1:
        return {**values, path[0]: value}
    return {**values, path[0]: _with(dict(values.get(path[0], {})), path[1:], value)}


def test_drawn_jobs_take_the_fast_path_and_build_the_same_object(monkeypatch):
    """Every generator's draw is plain typed values: built without OmegaConf (the collection-time saving),
    and equal, leaf types included, to what OmegaConf builds; the result shares no list with its input."""
    for values in _drawn_values():
        assert plain_schema.instance_of(cfg.JobConfig, values) is not None, values
        fast, slow = _both(monkeypatch, values)
        assert fast == slow and fast[0] == "ok", (values, fast, slow)
    values = lm.generate_case(lm.PIPE_BASE).values("out", "cache")
    job = cfg.job_from_dict(values)
    values["parallel"]["pp_layers"].append(99)
    assert 99 not in job.parallel.pp_layers


@pytest.mark.parametrize("model", config_names())
def test_named_models_build_the_same_object(monkeypatch, model):
    fast, slow = _both(monkeypatch, {"model": {"dropout": 0.0}, "train": {"seq_len": 64}}, model)
    assert fast == slow, (fast, slow)


@pytest.mark.parametrize("per_leaf", [VARIANTS_PER_LEAF, pytest.param(len(VARIANTS), marks=pytest.mark.extended)],
                         ids=["ci", "all"])
def test_each_leaf_set_to_another_kind_of_value_gives_the_same_object_or_the_same_error(monkeypatch, per_leaf):
    """Per leaf key of the schema, ``per_leaf`` drawn kinds of value (reproducible from ``SEED`` and the key)
    on a layout matrix job: where the fast path answers, OmegaConf gives that object (so it never answers
    what OmegaConf would refuse or convert otherwise); where it does not, OmegaConf alone decides. Every kind
    is drawn for some leaf, and the fast path answers for some and declines for others. CI draws 3 a leaf;
    ``extended`` all."""
    base = lm.generate_case(lm.MOE_BASE).values("out", "cache")
    drawn, answered = set(), {True: 0, False: 0}
    for path in _leaves(cfg.JobConfig):
        picks = random.Random(f"{SEED}:{'.'.join(path)}").sample(range(len(VARIANTS)), per_leaf)
        drawn.update(picks)
        for i in picks:
            values = _with(base, path, VARIANTS[i])
            claimed = plain_schema.instance_of(cfg.JobConfig, values) is not None
            answered[claimed] += 1
            if claimed:  # else job_from_dict is the OmegaConf path itself
                fast, slow = _both(monkeypatch, values)
                assert fast == slow, (path, VARIANTS[i], fast, slow)
    assert drawn == set(range(len(VARIANTS))) and min(answered.values()) > 0, (drawn, answered)


@pytest.mark.parametrize("values", [
    {"trian": {"steps": 3}}, {"train": {"stepz": 3}}, {"model": {"moe": {"experts": 4}}}, {"train": 3},
    {"model": {"moe": None}}, {"model": {"moe": [1]}}, {"parallel": {"dp": [2]}}, {"parallel": {"dp": {"a": 1}}},
    {3: {}}, {"train": {"preempt_signal": "SIGTERM"}}, {"data": {"weights": [1, 2.5]}},
], ids=repr)
def test_unknown_keys_and_misplaced_containers_give_the_same_error(monkeypatch, values):
    fast, slow = _both(monkeypatch, values)
    assert fast == slow, (fast, slow)

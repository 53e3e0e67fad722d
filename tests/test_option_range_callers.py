"""Every caller of the one finite-number range rule (``option_checks.check_range`` / ``check_positive`` /
``check_weights``) refuses nan, +-inf, a number out of range and a string: one line, its own error class,
naming its key and the value.

The table below is the list of callers; ``test_the_table_lists_every_calling_module`` reads the source and
fails when a module starts calling the rule without a row here. Which values are out of range is decided
here from each row's lower bound (``lo``, ``lo_open``), not from the code under test.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import yaml

from models.moe_config import MoEConfig
from models.registry import get_config
from parallel3d.data.blend import BlendError, resolve_blend
from parallel3d.data.errors import DataError
from parallel3d.data.options import DataOptions
from parallel3d.logging_options import WandbOptions
from parallel3d.moe.options import MoEOptionError, MoEOptions
from parallel3d.option_checks import ConfigError
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.devices import DEVICE_DIR, device_from_dict
from parallel3d.planning.sizes import parse_bytes
from parallel3d.preemption import StopOptions
from parallel3d.train_options import TrainOptions
from parallel3d.zero.options import OptimizerOptions, ZeroOptions
from parallel3d.zero.precision import LossScaler

REPO = Path(__file__).resolve().parents[1]
RULE_NAMES = ("check_range", "check_positive", "check_weights")


class Caller(NamedTuple):
    module: str  # the file that calls the rule
    key: str  # as the message must name it
    build: Callable[[Any], Any]  # builds the object with the value under test in the key's place
    error: type[Exception]  # the caller's own error class (kept through the refactor)
    good: Any  # a value the caller accepts (so a refusal is the rule's, not another check's)
    lo: float = 0.0
    lo_open: bool = True
    takes_strings: bool = True  # False: a string there means something else (a Megatron blend's prefix)


def _device(key: str) -> Callable[[Any], Any]:
    data = yaml.safe_load((DEVICE_DIR / "a100_80gb.yaml").read_text())
    return lambda v: device_from_dict({**data, key: v})


def _moe(key: str) -> Callable[[Any], Any]:
    return lambda v: MoEOptions(num_experts=8, top_k=2, ffn_hidden=4, **{key: v})


def _dataset(tmp: Path) -> Callable[[Any], Any]:
    """A one-dataset blend weighted ``v`` (the dataset is written on first use, under ``tmp``)."""
    from parallel3d.data import GPTDataset, write_indexed_dataset

    def build(v: Any) -> Any:
        prefix = tmp / "a"
        if not prefix.with_suffix(".idx").exists():
            write_indexed_dataset(prefix, [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 4)
        return GPTDataset(str(prefix), [v], 4, seed=0)
    return build


def callers(tmp: Path) -> list[Caller]:
    return [
        *[Caller("parallel3d/planning/cluster.py", f"cluster.{k}", lambda v, k=k: ClusterSpec.build(**{k: v}),
                 ValueError, 100.0) for k in ("peak_tflops", "intra_node_gbps", "inter_node_gbps")],
        *[Caller("parallel3d/planning/devices.py", f"device: {k}", _device(k), ValueError, 100.0)
          for k in ("peak_tflops", "hbm_gbps")],
        Caller("parallel3d/planning/sizes.py", "cluster.device_mem", lambda v: parse_bytes(v, "cluster.device_mem"),
               ValueError, "80GB"),
        Caller("parallel3d/preemption.py", "train.max_minutes", lambda v: StopOptions(max_minutes=v),
               ConfigError, 5.0),
        Caller("parallel3d/moe/options.py", "moe.capacity_factor", _moe("capacity_factor"), MoEOptionError, 1.0),
        *[Caller("parallel3d/moe/options.py", f"moe.{k}", _moe(k), MoEOptionError, 0.0, lo_open=False)
          for k in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate")],
        Caller("models/moe_config.py", "model.moe.scaling_factor",
               lambda v: MoEConfig(scaling_factor=v).validate(num_layers=2, ffn_size=8), ValueError, 2.5),
        Caller("parallel3d/zero/precision.py", "loss_scale_init", lambda v: LossScaler(scale=v), ValueError, 1024.0),
        Caller("parallel3d/data/blend.py", "data.weights", lambda v: resolve_blend(["a", "b"], [1.0, v], None),
               BlendError, 0.5),
        Caller("parallel3d/data/blend.py", "data.paths", lambda v: resolve_blend([1.0, "a", v, "b"], None, None),
               BlendError, 0.5, takes_strings=False),
        Caller("parallel3d/data/blend.py", "data.blend", lambda v: resolve_blend([], None, f"1.0 a {v} b"),
               BlendError, 0.5, takes_strings=False),
        Caller("parallel3d/data/gpt_dataset.py", "weights", _dataset(tmp), DataError, 1.0),
        *[Caller("parallel3d/train_options.py", f"train.{k}", lambda v, k=k: TrainOptions(**{k: v}), ConfigError, 9.0)
          for k in ("timeout_s", "peak_tflops")],
        *[Caller("parallel3d/zero/options.py", f"parallel.{k}", lambda v, k=k: ZeroOptions(**{k: v}), ConfigError, 8.0)
          for k in ("bucket_size_mb", "offload_buffer_mb")],
        *[Caller("parallel3d/zero/options.py", f"optimizer.{k}", lambda v, k=k: OptimizerOptions(**{k: v}),
                 ConfigError, 1e-4, lo_open=k in ("lr", "eps"))
          for k in ("lr", "min_lr", "weight_decay", "clip_grad", "eps")],
        Caller("parallel3d/logging_options.py", "logging.wandb.init_timeout_s",
               lambda v: WandbOptions(init_timeout_s=v), ConfigError, 30.0),
        Caller("parallel3d/data/options.py", "data.valid_fraction", lambda v: DataOptions(valid_fraction=v),
               ConfigError, 0.1, lo_open=False),
        *[Caller("models/config.py", f"model.{k}", lambda v, k=k: get_config("gpt_tiny", **{k: v}), ConfigError,
                 good) for k, good in (("norm_eps", 1e-5), ("init_std", 0.02), ("rope_base", 1e4))],
    ]


def bad_values(caller: Caller) -> list[Any]:
    """nan, +-inf, the bound itself where it is open, a number below it, and a string where one can go there."""
    values: list[Any] = [math.nan, math.inf, -math.inf, caller.lo - 1.0]
    if caller.lo_open:
        values.append(caller.lo)
    if caller.takes_strings:
        values.append("x")
    return values


CASES = [(c, v) for c in callers(Path("/nonexistent")) for v in bad_values(c)]


def _rows(tmp_path: Path) -> dict[tuple[str, str], Caller]:
    return {(c.module, c.key): c for c in callers(tmp_path)}


@pytest.mark.parametrize("module,key,value", [(c.module, c.key, v) for c, v in CASES],
                         ids=[f"{c.key}={v!r}" for c, v in CASES])
def test_each_caller_refuses_in_one_line_naming_its_key(module, key, value, tmp_path):
    caller = _rows(tmp_path)[(module, key)]
    caller.build(caller.good)  # the row is wired right: a good value passes
    with pytest.raises(Exception) as caught:
        caller.build(value)
    message = str(caught.value)
    assert type(caught.value) is caller.error, (type(caught.value), message)
    assert "\n" not in message and f"{key}=" in message and repr(value) in message, message
    if not isinstance(value, str):  # the rule, with "finite" where that is why
        bound = f"{'>' if caller.lo_open else '>='} {caller.lo:g}"
        finite = "finite " if not math.isfinite(value) else ""
        assert f"must be a {finite}number {bound}" in message or \
            f"every weight must be a {finite}number {bound}" in message, message


def _calling_modules() -> set[str]:
    found = set()
    for top in ("parallel3d", "models", "kernels", "scripts"):
        for path in (REPO / top).rglob("*.py"):
            if path.name == "option_checks.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in RULE_NAMES:
                    found.add(str(path.relative_to(REPO)))
                    break
    return found


def test_the_table_lists_every_calling_module():
    assert _calling_modules() == {c.module for c in callers(Path("/nonexistent"))}

"""``parallel3d.export`` into a directory that already holds an export: the directory then loads the new weights.

transformers' ``from_pretrained`` reads ``model.safetensors`` before ``model.safetensors.index.json``, so a
single-file export left behind by an earlier run would shadow a sharded one written over it. Reference: the
same checkpoint exported into a fresh directory.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from parallel3d.checkpoint_io.hf_export import WEIGHT_FILE
from parallel3d.export import main as export_main
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests import reshard_matrix as rm

pytestmark = pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")

# gpt's blocks are ~200 KB each: one shard per unit, or two blocks per shard
SHARDINGS = {"one file": [], "per unit": ["--max-shard-size", "60KB"], "two blocks": ["--max-shard-size", "450KB"]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A single-process gpt run with checkpoints at steps 2 and 4 (different weights)."""
    root = tmp_path_factory.mktemp("run")
    values = lm.job_values("gpt", {}, {"global_batch_size": 4, "micro_batch_size": 2}, str(root / "run"),
                           str(root / "corpus"))
    values["train"].update(steps=4, save_every=2, async_save=False)
    lr.reference_records(values, quiet=True)
    return str(root / "run")


def _logits(directory: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


def _weight_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if WEIGHT_FILE.fullmatch(f))


@pytest.mark.parametrize("first, second", [("one file", "per unit"), ("per unit", "one file"),
                                           ("per unit", "two blocks")])
def test_an_export_over_an_earlier_one_loads_the_new_weights(run_dir, tmp_path, first, second):
    old, new = rm.checkpoint_of(run_dir, 2), rm.checkpoint_of(run_dir, 4)
    fresh, reused = str(tmp_path / "fresh"), str(tmp_path / "reused")
    assert export_main([new, "--hf", fresh, *SHARDINGS[second]]) == 0
    assert export_main([old, "--hf", reused, *SHARDINGS[first]]) == 0
    (tmp_path / "reused" / "notes.txt").write_text("the user's own file")
    assert not torch.equal(_logits(reused), _logits(fresh))  # the two checkpoints differ
    assert not set(_weight_files(reused)) <= set(_weight_files(fresh))  # the first export leaves other files
    assert export_main([new, "--hf", reused, *SHARDINGS[second]]) == 0
    assert torch.equal(_logits(reused), _logits(fresh))
    assert _weight_files(reused) == _weight_files(fresh)
    assert (tmp_path / "reused" / "notes.txt").read_text() == "the user's own file"


def test_an_export_to_a_file_is_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert export_main([run_dir, "--hf", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"export error: {str(tmp_path / 'a_file')!r} must be a directory")

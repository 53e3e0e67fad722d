"""HF export (``python -m parallel3d.export``) of checkpoints written at multi-rank layouts, and
``train.init_from=hf:DIR`` into another layout; transformers (offline) is the reference.

gpt: the matrix gpt (tied embedding: a copy on the last stage) saved at pp2-dp2 with ZeRO-3
(parameters sharded over dp); llama: the matrix llama (GQA, untied head, vocabulary 510
padded to 512) saved at tp4, imported into tp2-dp2 ZeRO-3 with the optimizer offloaded to the host. Checked: the
HF model's logits equal ours from the checkpoint; the exported tokenizer loads offline with
the run's vocabulary and ids; a sharded export loads the same; a run initialised from the
export at another layout starts from exactly the checkpoint's weights, and its first loss
equals the HF model's loss on the same global batch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from models.config import ModelConfig
from models.state import load_full_state_dict
from models.transformer import build_model
from parallel3d import data
from parallel3d.checkpoint import read_meta
from parallel3d.checkpoint_io.compat import STATE_DIR
from parallel3d.checkpoint_io.state import read_metadata, read_tensors
from parallel3d.config import ConfigError, job_from_dict, resolve
from parallel3d.export import main as export_main
from parallel3d.parallel_state import ParallelState
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests import reshard_matrix as rm

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]

SAVED_AT = {"gpt": {"tp": 1, "pp": 2, "dp": 2, "zero_stage": 3}, "llama": {"tp": 4, "pp": 1, "dp": 1, "zero_stage": 2}}
INIT_AT = {"gpt": {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 1},
           "llama": {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 3, "offload": "cpu"}}
TRAIN = {"global_batch_size": 8, "micro_batch_size": 2}


def _values(model: str, parallel: dict, out: str, cache: str, **train) -> dict:
    values = lm.job_values(model, parallel, TRAIN, out, cache)
    values["model"]["dropout"] = 0.0
    values["train"].update(steps=2, **train)
    return values


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module", params=["gpt", "llama"])
def trained(request, tmp_path_factory, cache_dir) -> tuple[str, str]:
    model = request.param
    out = str(tmp_path_factory.mktemp(model) / "run")
    lm_values = _values(model, SAVED_AT[model], out, cache_dir)
    rm.run(lr.train_case_on_rank, 4, lm_values, True)
    return model, out


def _checkpoint_weights(run_dir: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    ckpt = rm.checkpoint_of(run_dir, 2)
    state = os.path.join(ckpt, STATE_DIR)
    keys = [k for k in read_metadata(state).state_dict_metadata if k.startswith("model.")]
    return ModelConfig(**read_meta(ckpt)["model"]), {k[len("model."):]: v for k, v in read_tensors(state, keys).items()}


def _our_logits(cfg: ModelConfig, weights: dict, ids: torch.Tensor) -> torch.Tensor:
    ours = build_model(cfg, ParallelState.single_process())
    load_full_state_dict(ours, weights)
    with torch.no_grad():
        return ours.eval()(ids)


def _first_global_batch(cfg: ModelConfig, cache_dir: str, values: dict) -> torch.Tensor:
    prefix, _ = data.build_default_corpus(cache_dir, vocab_size=cfg.vocab_size)
    t = values["train"]
    split = dict(split="train", valid_fraction=values["data"]["valid_fraction"]) if values["data"].get("valid_fraction") else {}
    dataset = data.GPTDataset([prefix], None, seq_len=t["seq_len"], seed=t["seed"], model_vocab_size=cfg.vocab_size, **split)
    return torch.from_numpy(dataset.get_samples(np.arange(t["global_batch_size"])))


def test_export_loads_in_transformers_with_the_same_logits_and_tokenizer(trained, tmp_path, cache_dir):
    model, run_dir = trained
    cfg, weights = _checkpoint_weights(run_dir)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    want = _our_logits(cfg, weights, ids)
    for name, extra in (("one", []), ("sharded", ["--max-shard-size", "100KB"])):
        out = str(tmp_path / name)
        assert export_main([run_dir, "--hf", out, *extra]) == 0
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        with torch.no_grad():
            got = hf(ids).logits
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5, name
        assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) == (name == "sharded")
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    _, ours = data.build_default_corpus(cache_dir, vocab_size=cfg.vocab_size)
    assert len(tok) == ours.vocab_size > 256  # offline loads can silently give an empty tokenizer
    text = "Resume a run at another layout: def f(x):\n    return x ** 2  # ünïcode"
    assert tok(text, add_special_tokens=False).input_ids == ours.encode(text)
    assert tok.eos_token_id == ours.eod_id


def _init_on_rank(rank: int, world: int, values: dict, checkpoint_state: str) -> tuple[list, list[str]]:
    from parallel3d.trainer import Trainer

    rj = resolve(job_from_dict(values), world)
    with lr.silenced(True):
        trainer = Trainer(rj, ParallelState(rj.topology))
        assert trainer.restore() is None
        differing = rm.params_differing_from(trainer, checkpoint_state)
        records = trainer.train().records
    return lr.curve_of(records), differing


def test_init_from_hf_starts_any_layout_at_the_exported_weights(trained, tmp_path, cache_dir):
    model, run_dir = trained
    out = str(tmp_path / "hf")
    assert export_main([run_dir, "--hf", out]) == 0
    values = _values(model, INIT_AT[model], str(tmp_path / "continued"), cache_dir, init_from=f"hf:{out}")
    per_rank = rm.run(_init_on_rank, 4, values, os.path.join(rm.checkpoint_of(run_dir, 2), STATE_DIR))
    assert all(not differing for _, differing in per_rank), [d for _, d in per_rank if d][0]
    curve = next(c for c, _ in per_rank if c)
    tokens = _first_global_batch(ModelConfig(**read_meta(rm.checkpoint_of(run_dir, 2))["model"]), cache_dir, values)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten()).item()
    assert abs(curve[0][1] - hf_loss) < 1e-5 * hf_loss, (curve[0][1], hf_loss)


def test_init_from_another_model_is_a_config_error(trained, tmp_path, cache_dir):
    model, run_dir = trained
    out = str(tmp_path / "hf")
    assert export_main([run_dir, "--hf", out, "--no-tokenizer"]) == 0
    values = _values(model, {}, str(tmp_path / "x"), cache_dir, init_from=f"hf:{out}")
    values["model"]["hidden_size"] = 128
    with pytest.raises(ConfigError, match=r"train.init_from='hf:.*': another model \(hidden_size=64 there, 128 in "):
        resolve(job_from_dict(values), 1)
    values = _values(model, {}, str(tmp_path / "x"), cache_dir, init_from=f"hf:{tmp_path / 'nothing'}")
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve(job_from_dict(values), 1)
    assert export_main([str(tmp_path / "nothing"), "--hf", str(tmp_path / "y")]) == 2

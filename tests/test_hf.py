"""HF transformers is the independent reference: randomly initialised GPT2LMHeadModel /
LlamaForCausalLM (built from config, nothing downloaded) against our model at tp=1 and tp=2."""

from __future__ import annotations

import pytest
import torch

from models import build_model, get_config
from models.hf import from_hf, hf_config, to_hf
from models.hf_formats import hf_format
from models.state import full_state_dict
from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel import gather_last_dim
from parallel3d.topology import Topology
from tests.harness import run_on_ranks


def _transformers():
    # Imported lazily: the gloo ranks import this module and must not pay for transformers.
    return pytest.importorskip("transformers")

NAMES = ["gpt_tiny", "llama_tiny"]


def _hf_model(name: str, seed: int = 0):
    cfg = get_config(name)
    transformers = _transformers()
    cls = getattr(transformers, hf_format(cfg).architecture)
    torch.manual_seed(seed)
    return cfg, cls(hf_config(cfg)).eval()


def _batch(vocab: int):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # HF shifts labels inside
    return ids, labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def _reference(name: str) -> dict:
    """The HF model's weights, logits and loss (computed in this process, shipped to the ranks)."""
    cfg, hf = _hf_model(name)
    ids, labels = _batch(cfg.vocab_size)
    with torch.no_grad():
        out = hf(ids, labels=ids)
    return dict(cfg=cfg, state=hf.state_dict(), ids=ids, labels=labels, logits=out.logits, loss=out.loss)


def _parity(pstate: ParallelState, ref: dict) -> tuple[float, float]:
    ours = from_hf(ref["state"], ref["cfg"], pstate=pstate).eval()
    with torch.no_grad():
        logits = gather_last_dim(ours(ref["ids"]), pstate)[..., : ref["cfg"].vocab_size]
        loss = ours(ref["ids"], labels=ref["labels"])
    return _rel(logits, ref["logits"]), _rel(loss, ref["loss"])


@pytest.mark.parametrize("name", NAMES)
def test_hf_parity_tp1(name):
    cfg, hf = _hf_model(name)
    ids, labels = _batch(cfg.vocab_size)
    ours = from_hf(hf).eval()  # config derived from the HF model's own config
    explicit = dict(name=cfg.name, ffn_hidden_size=cfg.ffn_size)
    assert ours.config.replace(**explicit) == cfg.replace(**explicit)
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        assert _rel(ours(ids), ref.logits) < 1e-5
        assert _rel(ours(ids, labels=labels), ref.loss) < 1e-5


def _parity_tp2(rank: int, world: int, refs: list[dict]) -> list[tuple[float, float]]:
    pstate = ParallelState(Topology(2, 1, 1))
    return [_parity(pstate, ref) for ref in refs]


@pytest.mark.slow
def test_hf_parity_tp2():
    refs = [_reference(name) for name in NAMES]
    for rank_result in run_on_ranks(_parity_tp2, 2, refs, timeout=180):
        for logits_err, loss_err in rank_result:
            assert logits_err < 1e-5 and loss_err < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_exact(name):
    cfg = get_config(name)
    ours = build_model(cfg, ParallelState.single_process(), seed=11)
    _, hf = _hf_model(name)
    state = to_hf(ours)
    hf.load_state_dict(state, strict=True)  # exactly HF's key set and shapes
    back = from_hf(hf)
    original, returned = full_state_dict(ours), full_state_dict(back)
    assert original.keys() == returned.keys()
    for key, value in original.items():
        assert torch.equal(value, returned[key]), key


def test_state_dict_errors_name_the_keys():
    cfg, hf = _hf_model("llama_tiny")
    state = hf.state_dict()
    with pytest.raises(ValueError, match="needs config"):
        from_hf(state)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.up_proj.weight'\]"):
        from_hf(missing, cfg)
    extra = dict(state, **{"model.layers.9.bogus.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected keys \['model.layers.9.bogus.weight'\]"):
        from_hf(extra, cfg)
    wrong = dict(state, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(65,\) .* expected \(64,\)"):
        from_hf(wrong, cfg)
    with pytest.raises(ValueError, match="whole model"):
        to_hf(build_model(cfg, ParallelState.single_process(), layer_range=(0, 2)))


def test_unsupported_hf_config_is_rejected():
    cfg = hf_config(get_config("gpt_tiny"))
    cfg.activation_function = "relu"
    with pytest.raises(ValueError, match="activation_function='relu'"):
        from_hf(_transformers().GPT2LMHeadModel(cfg))


def test_llama_with_biases_converts_every_tensor_of_the_shape():
    """Conversion walks ``config.shape``: a Llama with biases maps to HF's attention_bias + mlp_bias,
    every bias perturbed so that a misplaced one changes the logits."""
    cfg = get_config("llama_tiny", use_bias=True)
    torch.manual_seed(3)
    hf = _transformers().LlamaForCausalLM(hf_config(cfg)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert any(k.endswith("q_proj.bias") for k in hf.state_dict()) and any(k.endswith("down_proj.bias")
                                                                             for k in hf.state_dict())
    ids, _ = _batch(cfg.vocab_size)
    ours = from_hf(hf).eval()
    assert ours.config.use_bias
    with torch.no_grad():
        assert _rel(ours(ids), hf(ids).logits) < 1e-5
    state = to_hf(ours)
    assert state.keys() == hf.state_dict().keys()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in state.items())

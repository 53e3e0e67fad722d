"""``pipeline.activation_bytes.SavedBytes``: what it counts, and that counting leaks no graph."""

from __future__ import annotations

import weakref

import torch

from parallel3d.pipeline.activation_bytes import SavedBytes, storage_key


def test_counts_saved_storages_once_without_parameters() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4, requires_grad=True)
    saved = SavedBytes({storage_key(w)})
    with saved.recording():
        y = torch.exp(x @ w)  # mm saves x and w (a parameter); exp saves its output y
        z = y[:2] * 2.0  # a view of y saved again by nothing new (mul by a scalar saves nothing)
    saved.add(x)  # the engine adds the stored input too: the same storage, counted once
    assert saved.total == x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    z.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_a_saved_output_does_not_keep_its_own_graph_alive() -> None:
    """exp saves its own output; stored as itself it would hold its grad_fn, which holds it: a cycle
    of C++ references that outlives a retained graph's last Python reference."""
    x = torch.randn(8, requires_grad=True)
    saved = SavedBytes(set())
    with saved.recording():
        y = torch.exp(x)
    gone = weakref.ref(y)
    y.sum().backward(retain_graph=True)
    del y
    saved._seen.clear()  # the counter's own list holds the tensors until counted
    assert gone() is None

import os

import pytest

# Tests never talk to a W&B server.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--layout-matrix", choices=("ci", "all"), default="ci",
        help="layout-equivalence cases to run: the CI sample (default) or the whole generated matrix",
    )
    parser.addoption(
        "--extended", action="store_true",
        help="also run tests marked `extended` (costly repeats of behaviour CI covers more cheaply)",
    )


def pytest_collection_modifyitems(config, items):
    """`extended` tests are deselected unless --extended: CI stays under 15 minutes on 2 cores."""
    if config.getoption("--extended"):
        return
    keep = [item for item in items if item.get_closest_marker("extended") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("extended")])
        items[:] = keep
